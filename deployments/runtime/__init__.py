"""The Ray-free engine layer: contract <- backends <- residency <- tools (nothing imports upward).

- ``contract``: what a model is and what a request must be (config, datatypes, errors,
  repository, validation, shapes).
- ``backends``: the ``Engine`` protocol, backend selection, ONNX Runtime, TensorRT, CUDA memory,
  plans, process memory readings.
- ``residency``: what is loaded where: ``ModelHost`` (engine + context pool), ``ModelCache``
  (eager / lazy / lru under a byte budget), footprint prediction and measurement.
- ``tools``: the command lines (``make models``, ``make engines``, ``make plan``); no replica
  imports them.
"""
