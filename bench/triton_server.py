"""NVIDIA Triton's own HTTP server over the same ONNX models: the reference line in ``bench.overload``.

Runs under a SEPARATE virtual environment holding the ``nvidia-pytriton`` wheel (it ships the
``tritonserver`` binary) and ``onnxruntime``; it imports nothing from this project, so the
project's venv never needs Triton::

    python3.11 -m venv /tmp/pytriton-venv && /tmp/pytriton-venv/bin/pip install nvidia-pytriton onnxruntime
    LD_LIBRARY_PATH=$(python3.11 -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))') \\
        /tmp/pytriton-venv/bin/python bench/triton_server.py --port 8010 \\
        --model ocr_cls=engines/ocr_cls/1/model.onnx --model tiny_cnn=engines/tiny_cnn/1/model.onnx

``tritonserver`` loads ``libpython3.X.so`` of the interpreter that runs this script, hence
``LD_LIBRARY_PATH``. Each model is a Python callable running an ONNX Runtime CPU session
(``--intra-op-threads`` threads, ``--instances`` model instances, i.e. Triton instance-group
copies, each its own session) behind Triton's dynamic batcher (``--max-queue-delay-ms``, batches
up to ``--max-batch-size`` rows): the configuration the issue compared against. Inputs and
outputs keep the ONNX file's names, except characters Triton refuses in a tensor name (``/``
and the like), which become ``_``. Serves KServe v2 over HTTP until SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
from typing import Sequence

import numpy as np


def _tensor_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def _dims(shape: Sequence) -> tuple[int, ...]:
    """ONNX dims without the batch axis; symbolic ones are -1 (dynamic)."""
    return tuple(d if isinstance(d, int) else -1 for d in shape)


def _infer_fn(path: str, threads: int):
    import onnxruntime as ort
    from pytriton.decorators import batch

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(path, sess_options=options, providers=["CPUExecutionProvider"])
    inputs = [i.name for i in session.get_inputs()]
    outputs = [o.name for o in session.get_outputs()]

    @batch
    def infer(**arrays: np.ndarray) -> dict[str, np.ndarray]:
        feeds = {name: arrays[_tensor_name(name)] for name in inputs}
        return {_tensor_name(n): v for n, v in zip(outputs, session.run(outputs, feeds))}

    return infer, session


def main(argv: Sequence[str]) -> None:
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8010, help="HTTP port; gRPC and metrics take the next two")
    parser.add_argument("--model", action="append", required=True,
                        help="NAME=PATH to model.onnx, optionally @INSTANCES (default --instances)")
    parser.add_argument("--instances", type=int, default=1)
    parser.add_argument("--intra-op-threads", type=int, default=1)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--max-queue-delay-ms", type=float, default=2.0)
    args = parser.parse_args(argv)

    config = TritonConfig(http_address="127.0.0.1", http_port=args.port, grpc_address="127.0.0.1",
                          grpc_port=args.port + 1, metrics_port=args.port + 2)
    with Triton(config=config) as triton:
        for spec in args.model:
            name, path = spec.split("=", 1)
            path, _, instances = path.partition("@")
            fns = [_infer_fn(path, args.intra_op_threads) for _ in range(int(instances or args.instances))]
            session = fns[0][1]
            triton.bind(
                model_name=name,
                infer_func=[fn for fn, _ in fns],
                inputs=[Tensor(name=_tensor_name(i.name), dtype=np.float32, shape=_dims(i.shape[1:]))
                        for i in session.get_inputs()],
                outputs=[Tensor(name=_tensor_name(o.name), dtype=np.float32, shape=_dims(o.shape[1:]))
                         for o in session.get_outputs()],
                config=ModelConfig(max_batch_size=args.max_batch_size, batcher=DynamicBatcher(
                    max_queue_delay_microseconds=int(args.max_queue_delay_ms * 1000))),
                strict=False)
        signal.signal(signal.SIGTERM, lambda *_: triton.stop())
        print("READY", flush=True)
        triton.serve()


if __name__ == "__main__":
    main(sys.argv[1:])
