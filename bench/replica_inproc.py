"""A dedicated model replica's CPU per request in process: its ASGI app without Ray or sockets.

``ModelDeployment``'s class (under Serve's decorator) is built in this process with metrics on
(their folder in a scratch directory), and its app is called with ASGI requests of the binary
body ``bench.replica_cpu`` sends (64 KiB chunks), ``--concurrency`` at a time; or, with
``--echo``, ``bench.echo``'s app with the same requests. Per run: the process's CPU per request
(``time.process_time``), the event loop thread's, the model's (``ModelHost.run``'s thread time:
**model**) and the cycle collector's (``gc.callbacks``). What is left beside the model is the
replica's own code, the thread hop and Starlette, without uvicorn, Serve or Ray's threads, so
a cut in them shows here at a fraction of the noise of ``bench.replica_cpu``. With
``--protocol grpc`` each request is the same tensors as a serialized ``ModelInferRequest`` (raw
contents) given to the replica's ``ModelInfer`` as Serve's gRPC server gives it, its answer
serialized as Serve does: the replica's gRPC path without grpc.aio, Serve or sockets.

    python -m bench.replica_inproc --model simple --requests 3000
    TRT_SERVE_INLINE_RUN_US=0 python -m bench.replica_inproc --model simple   # every run in a thread
    python -m bench.replica_inproc --model tiny_cnn --requests 400
    python -m bench.replica_inproc --model resnet18 --fake-model --concurrency 1 --requests 4000
    python -m bench.replica_inproc --model resnet18 --fake-model --concurrency 1 --protocol grpc
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CHUNK_BYTES = 65536


def body_of(config: Any) -> tuple[bytes, int]:
    """A binary request for every input of ``config`` at batch 1 (random values; the dims the
    config gives, 1 for a variable one): (body, JSON header length)."""
    from deployments.runtime.contract.datatypes import NUMPY_BY_DATATYPE

    rng = np.random.default_rng(0)
    tensors, raws = [], []
    for spec in config.inputs:
        shape = [1] + [d if d > 0 else 1 for d in spec.dims[1:]] if config.max_batch_size > 0 else [
            d if d > 0 else 1 for d in spec.dims]
        x = (rng.random(shape) * 100).astype(NUMPY_BY_DATATYPE[spec.datatype])
        raw = x.tobytes()
        tensors.append({"name": spec.name, "shape": shape, "datatype": spec.datatype,
                        "parameters": {"binary_data_size": len(raw)}})
        raws.append(raw)
    head = json.dumps({"inputs": tensors, "parameters": {"binary_data_output": True}}).encode()
    return head + b"".join(raws), len(head)


async def call(app: Any, model: str, root_path: str, body: bytes, head_bytes: int) -> None:
    """One POST /v2/models/{model}/infer through ``app``; raises unless it answers 200."""
    path = f"/v2/models/{model}/infer"
    scope = {"type": "http", "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
             "raw_path": path.encode(), "root_path": root_path, "query_string": b"",
             "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 1234),
             "headers": [(b"content-type", b"application/octet-stream"), (b"content-length", str(len(body)).encode()),
                         (b"inference-header-content-length", str(head_bytes).encode())]}
    chunks = iter([body[i:i + CHUNK_BYTES] for i in range(0, len(body), CHUNK_BYTES)])

    async def receive() -> dict[str, Any]:
        chunk = next(chunks, None)
        return {"type": "http.request", "body": chunk or b"", "more_body": chunk is not None}

    status: list[int] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])

    await app(scope, receive, send)
    if status != [200]:
        raise RuntimeError(f"{path} answered {status}")


def message_of(model: str, body: bytes, head_bytes: int) -> bytes:
    """``body`` (``body_of``'s) as a serialized ``ModelInferRequest`` for ``model``: the same
    tensors in ``raw_input_contents``, as ``tritonclient.grpc`` sends them."""
    from tritonclient.grpc import service_pb2 as pb

    head = json.loads(body[:head_bytes])
    request, offset = pb.ModelInferRequest(model_name=model), head_bytes
    for tensor in head["inputs"]:
        size = tensor["parameters"]["binary_data_size"]
        request.inputs.add(name=tensor["name"], datatype=tensor["datatype"], shape=tensor["shape"])
        request.raw_input_contents.append(body[offset:offset + size])
        offset += size
    return request.SerializeToString()


class _GrpcContext:
    """What the replica's gRPC methods read of Serve's gRPC context: no metadata; a code set
    other than OK fails the run."""

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return []

    def set_code(self, code: Any) -> None:
        raise RuntimeError(f"ModelInfer answered {code}")

    def set_details(self, details: str) -> None:
        pass

    def set_trailing_metadata(self, metadata: Any) -> None:
        pass


async def grpc_call(replica: Any, message: bytes) -> None:
    """One ModelInfer through the replica's gRPC method; its answer serialized as Serve does."""
    answer = await replica.ModelInfer(message, _GrpcContext())
    if not answer.raw_output_contents:
        raise RuntimeError(f"ModelInfer answered no output: {answer}")
    answer.SerializeToString()


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    from deployments.model import ModelDeployment
    from deployments.routes import RouterOptions
    from deployments.runtime.residency import host as host_module

    model_s = [0.0]
    run = host_module.ModelHost.run

    def timed_run(self: Any, *a: Any, **k: Any) -> Any:
        start = time.thread_time()
        try:
            return run(self, *a, **k)
        finally:
            model_s[0] += time.thread_time() - start

    host_module.ModelHost.run = timed_run  # type: ignore[method-assign]
    cls = ModelDeployment.func_or_class
    replica = cls.__new__(cls)
    await cls.__init__(replica, args.repository, args.model, args.backend,
                       RouterOptions(max_body_bytes=1 << 30, request_timeout_s=60.0), {"port": None})
    if args.fake_model:  # the replica's own code alone: zeros of the outputs' shapes at once, inline
        from deployments.runtime.contract.datatypes import NUMPY_BY_DATATYPE

        config = replica.host.config
        zeros = {t.name: np.zeros([max(d, 1) for d in t.dims], NUMPY_BY_DATATYPE[t.datatype])  # batch 1
                 for t in config.outputs}

        def answer_zeros(self: Any, inputs: Any, outputs: Any = None) -> dict[str, np.ndarray]:
            return {k: zeros[k] for k in (outputs or zeros)}

        run = answer_zeros  # what ``timed_run`` calls
        replica.host.recent_run_s = 1e-6  # ``runs_inline``: no thread hop
    body, head_bytes = body_of(replica.host.config)
    if args.echo:
        from bench.echo import create_app
        app, root_path = create_app(), ""
    else:
        app, root_path = replica.__serve_build_asgi_app__(), f"/v2/models/{args.model}"
    if args.protocol == "grpc":
        message = message_of(args.model, body, head_bytes)

        async def one() -> None:
            await grpc_call(replica, message)
    else:
        async def one() -> None:
            await call(app, args.model, root_path, body, head_bytes)
    for _ in range(args.warmup):
        await one()
    gate = asyncio.Semaphore(args.concurrency)

    async def bounded() -> None:
        async with gate:
            await one()

    collected = [0, 0.0, 0.0]  # runs, CPU s, start of the running one

    def on_collection(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            collected[2] = time.thread_time()
        else:
            collected[0] += 1
            collected[1] += time.thread_time() - collected[2]

    gc.callbacks.append(on_collection)
    model_s[0] = 0.0
    cpu, wall, loop = time.process_time(), time.perf_counter(), time.thread_time()
    await asyncio.gather(*(bounded() for _ in range(args.requests)))
    cpu, wall, loop = time.process_time() - cpu, time.perf_counter() - wall, time.thread_time() - loop
    gc.callbacks.remove(on_collection)
    n = args.requests
    return {"model": args.model, "app": "echo" if args.echo else "replica", "protocol": args.protocol, "requests": n,
            "request_bytes": len(body), "qps": round(n / wall), "cpu_us_per_request": round(cpu * 1e6 / n),
            "model_us": round(model_s[0] * 1e6 / n), "outside_model_us": round((cpu - model_s[0]) * 1e6 / n),
            "loop_thread_us": round(loop * 1e6 / n), "gc_us": round(collected[1] * 1e6 / n), "gc_runs": collected[0],
            "inline_run_us": os.environ.get("TRT_SERVE_INLINE_RUN_US", "default")}


def main(argv: Sequence[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="simple")
    p.add_argument("--repository", default=str(ROOT / "engines"))
    p.add_argument("--backend", default="onnxruntime")
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--echo", action="store_true", help="bench.echo's app with the same requests")
    p.add_argument("--protocol", choices=("http", "grpc"), default="http",
                   help="grpc: the tensors as a ModelInferRequest to the replica's gRPC method")
    p.add_argument("--fake-model", action="store_true",
                   help="the model answers zeros at once, in the event loop's thread: the replica's own code alone")
    args = p.parse_args(argv)
    os.environ.setdefault("ORT_INTRA_OP_THREADS", "1")  # as bench.replica_cpu
    os.environ.setdefault("TRT_SERVE_METRICS_DIR", tempfile.mkdtemp(prefix="bench-inproc-metrics-"))
    print(json.dumps(asyncio.run(measure(args))))


if __name__ == "__main__":
    main(sys.argv[1:])
