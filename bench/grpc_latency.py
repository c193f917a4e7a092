"""One client, one request at a time: the same requests over HTTP (``tritonclient.http``, binary
tensors) and gRPC (``tritonclient.grpc``, raw contents) against one running server; p50 and p95
per model and protocol, and what gRPC adds at p50.

    python -m bench.grpc_latency --http 127.0.0.1:8000 --grpc 127.0.0.1:8001 --requests 300

Models: ``simple`` (pool, 2 x 64 B), ``ocr_cls`` (dedicated, 1x3x48x192 FP32), ``tiny_cnn``
(pool, 1x3x224x224 FP32, 602 KB).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Sequence

import numpy as np

CASES = {
    "simple": [("INPUT0", np.arange(16, dtype=np.int32).reshape(1, 16), "INT32"),
               ("INPUT1", np.ones((1, 16), np.int32), "INT32")],
    "ocr_cls": [("x", np.random.default_rng(0).random((1, 3, 48, 192), dtype=np.float32), "FP32")],
    "tiny_cnn": [("input", np.random.default_rng(0).random((1, 3, 224, 224), dtype=np.float32), "FP32")],
}


def _inputs(module: Any, spec: list[tuple[str, np.ndarray, str]]) -> list:
    out = []
    for name, x, datatype in spec:
        tensor = module.InferInput(name, list(x.shape), datatype)
        tensor.set_data_from_numpy(x)
        out.append(tensor)
    return out


def latencies_ms(client: Any, module: Any, model: str, n: int, warmup: int = 20) -> list[float]:
    """``n`` sequential infer latencies (ms) of ``model`` after ``warmup`` unmeasured ones."""
    inputs = _inputs(module, CASES[model])
    for _ in range(warmup):
        client.infer(model, inputs)
    times = []
    for _ in range(n):
        start = time.perf_counter()
        client.infer(model, inputs)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def main(argv: Sequence[str]) -> int:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--http", default="127.0.0.1:8000")
    parser.add_argument("--grpc", default="127.0.0.1:8001")
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args(argv)
    clients = {"http": (httpclient.InferenceServerClient(args.http), httpclient),
               "grpc": (grpcclient.InferenceServerClient(args.grpc), grpcclient)}
    print("| model | HTTP p50 / p95 ms | gRPC p50 / p95 ms | gRPC - HTTP p50 ms |\n|---|---|---|---|")
    for model in CASES:
        got = {}
        for protocol, (client, module) in clients.items():
            times = latencies_ms(client, module, model, args.requests)
            got[protocol] = (statistics.median(times), statistics.quantiles(times, n=20)[18])
        (hp50, hp95), (gp50, gp95) = got["http"], got["grpc"]
        print(f"| {model} | {hp50:.2f} / {hp95:.2f} | {gp50:.2f} / {gp95:.2f} | {gp50 - hp50:+.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
