"""The gRPC edge's CPU per ModelInfer by stage, in process, against a running server's HTTP ingress.

The router replica's gRPC server (``grpc_service.start``: its ``grpc.aio`` server, the handlers,
``IngressForward``) runs in this process on a uvloop event loop of its own thread, as a router
replica runs it, over a stand-in for the router's routes (the repository's models and the body
limit: every call takes the hop), forwarding to ``--http`` (a ``make serve``'s HAProxy, which
sends it to the model's replica). ``tritonclient.grpc`` sends ``--requests`` ModelInfers one at
a time from the main thread. Per stage, the median of the loop thread's CPU time
(``time.thread_time``) spent in it per request: ``infer_body`` (the message to the binary
body), ``forward`` (``IngressForward.infer``: connection, write, and everything the loop ran until
the answer came, the answer's parsing included), ``infer_response`` (the answer to the
message), ``handler`` (``ModelInfer`` whole); and the loop thread's CPU per request in all,
grpc.aio's work included. ``--echo``: a ``grpc.aio`` server on the same kind of loop answering a
prebuilt response, the floor of any gRPC edge in Python.

    python -m bench.grpc_edge --http 127.0.0.1:8000 --model simple --requests 3000
    python -m bench.grpc_edge --http 127.0.0.1:8000 --model simple --requests 3000 --echo
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import socket
import statistics
import sys
import threading
import time
from typing import Any, Callable, Sequence

import uvloop

from deployments import grpc_service
from deployments.runtime.contract.repository import ModelRepository

STAGES = {"infer_body": "infer_body", "forward": "IngressForward.infer", "infer_response": "infer_response",
          "handler": "InferenceService.ModelInfer"}


class _Routes:
    """The router's routes as the edge reads them when every call takes the hop."""

    def __init__(self, repository: str) -> None:
        self.repo, self.max_body_bytes = ModelRepository(repository), 64 << 20


def _timed(spent: list[int], call: Callable[..., Any]) -> Callable[..., Any]:
    """``call`` (a function or coroutine function) adding its thread CPU ns to ``spent``."""
    if asyncio.iscoroutinefunction(call):
        @functools.wraps(call)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time_ns()
            try:
                return await call(*args, **kwargs)
            finally:
                spent.append(time.thread_time_ns() - start)
        return timed_async

    @functools.wraps(call)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time_ns()
        try:
            return call(*args, **kwargs)
        finally:
            spent.append(time.thread_time_ns() - start)
    return timed


def _instrument() -> dict[str, list[int]]:
    """Wrap each stage of ``STAGES`` in ``grpc_service`` with a thread CPU timer."""
    spent: dict[str, list[int]] = {stage: [] for stage in STAGES}
    for stage, where in STAGES.items():
        owner, _, name = where.rpartition(".")
        target = getattr(grpc_service, owner) if owner else grpc_service
        setattr(target, name, _timed(spent[stage], getattr(target, name)))
    return spent


async def _echo_server(http: str, port: int, model: str) -> Any:
    """A ``grpc.aio`` server answering every ModelInfer with ``model``'s answer, fetched once."""
    import grpc
    from tritonclient.grpc import service_pb2_grpc as pb_grpc

    from bench.grpc_latency import _grpc_request
    from deployments.protocol.grpc import infer_body, infer_response

    forward = grpc_service.IngressForward(f"http://{http}", 60.0)
    chunks, length = infer_body(_grpc_request(model))
    answer = await forward.infer(model, f"/v2/models/{model}/infer", chunks, length)
    await forward.close()
    assert answer is not None and answer.status_code == 200, answer
    response = infer_response(bytes(answer.body), answer.headers)

    class Echo(pb_grpc.GRPCInferenceServiceServicer):
        async def ModelInfer(self, request: Any, context: Any) -> Any:
            return response

    server = grpc.aio.server()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(Echo(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


def _serve(args: argparse.Namespace, port: int, started: threading.Event, stop: threading.Event,
           loop_thread: list[int]) -> None:
    async def main() -> None:
        loop_thread.append(threading.get_ident())
        forward = grpc_service.IngressForward(f"http://{args.http}", 60.0)
        if args.echo:
            server = await _echo_server(args.http, port, args.model)
        else:
            server = await grpc_service.start(_Routes(args.repository), port, "127.0.0.1", 64 << 20, None, forward)
        started.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await server.stop(None)
        await forward.close()

    uvloop.run(main())


def _thread_cpu_s(ident: int) -> float:
    """CPU seconds of this process's thread ``ident`` (``threading.get_ident``)."""
    return time.clock_gettime(time.pthread_getcpuclockid(ident))


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--http", required=True, help="a running server's HTTP ingress, HOST:PORT")
    parser.add_argument("--model", default="simple", help="a case of bench.grpc_latency (simple, ocr_cls, tiny_cnn)")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--repository", default="engines")
    parser.add_argument("--echo", action="store_true", help="a grpc.aio server answering a prebuilt response")
    args = parser.parse_args(argv)
    import tritonclient.grpc as grpcclient

    from bench.grpc_latency import CASES, _inputs

    spent = {} if args.echo else _instrument()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started, stop, loop_thread = threading.Event(), threading.Event(), []
    server = threading.Thread(target=_serve, args=(args, port, started, stop, loop_thread), daemon=True)
    server.start()
    if not started.wait(60):
        print("the gRPC edge did not start", file=sys.stderr)
        return 1
    client, inputs = grpcclient.InferenceServerClient(f"127.0.0.1:{port}"), _inputs(grpcclient, CASES[args.model])
    for _ in range(args.warmup):
        client.infer(args.model, inputs)
    for times in spent.values():
        times.clear()
    cpu_before, latencies = _thread_cpu_s(loop_thread[0]), []
    for _ in range(args.requests):
        start = time.perf_counter()
        client.infer(args.model, inputs)
        latencies.append(time.perf_counter() - start)
    loop_us = (_thread_cpu_s(loop_thread[0]) - cpu_before) / args.requests * 1e6
    client.close()
    stop.set()
    server.join(10)
    print(f"{'echo' if args.echo else 'edge'} {args.model}: {args.requests} requests, p50 "
          f"{statistics.median(latencies) * 1e3:.2f} ms; loop thread CPU {loop_us:.0f} us a request")
    for stage, times in spent.items():
        print(f"  {stage:15s} {statistics.median(times) / 1e3:7.1f} us (median thread CPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
