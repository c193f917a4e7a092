"""Engines: the ``Engine`` protocol, backend selection, ONNX Runtime, TensorRT, CUDA memory, plans."""
