"""gRPC against HTTP and the in-process call, side by side on one or more running servers.

Latency: one client, one request at a time, the same requests over HTTP (``tritonclient.http``,
binary tensors) and gRPC (``tritonclient.grpc``, raw contents), and the model's ``ModelHost``
called in this process (the floor: what serving adds is the rest); p50 and p95 per model and
protocol. Throughput (``--clients``): closed-loop clients on one event loop, each with its own
connection (an ``aiohttp`` session for HTTP, a ``grpc.aio`` channel for gRPC), each sending one
prebuilt request and the next as its answer arrives; QPS = answers with status 200 (HTTP) or OK
(gRPC) per second over ``--duration-s`` after ``--warmup-s``; any other answer is counted apart.

CPU (a target given with its server's session, ``LABEL=HTTP,GRPC,SESSION``: the PID of the
``make serve`` runner started in a session of its own, as ``bench.autoscale.start_runner`` does):
the CPU time every process of that session (replicas, router, HAProxy, Ray's own) used during a
latency run, less what it uses idle, per request: a figure the load of other processes on the
machine does not inflate the way it inflates latency.

Every figure is measured ``--rounds`` times; each round runs every target and protocol in turn,
the order reversed every other round (a machine shared with others drifts), and the table gives
the median of the rounds' figures, with the load average before and after.

    python -m bench.grpc_latency --target before=127.0.0.1:8000,127.0.0.1:8001[,SESSION] \\
        --target after=127.0.0.1:9000,127.0.0.1:9001[,SESSION] --rounds 5 --requests 200 --clients 16,64

Models: ``simple`` (pool, 2 x 64 B), ``ocr_cls`` (dedicated, 1x3x48x192 FP32), ``tiny_cnn``
(pool, 1x3x224x224 FP32, 602 KB).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from typing import Any, Callable, Sequence

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


def timed_ms(call: Callable[[], Any], n: int, warmup: int = 20) -> list[float]:
    """``n`` sequential latencies (ms) of ``call`` after ``warmup`` unmeasured calls."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def latencies_ms(client: Any, module: Any, model: str, n: int, warmup: int = 20) -> list[float]:
    """``n`` sequential infer latencies (ms) of ``model`` through ``client`` (a tritonclient)."""
    inputs = _inputs(module, CASES[model])
    return timed_ms(lambda: client.infer(model, inputs), n, warmup)


def in_process_ms(repository: str, model: str, n: int, inputs: dict[str, np.ndarray] | None = None,
                  backend: str = "auto") -> list[float]:
    """``n`` sequential latencies (ms) of ``ModelHost.infer`` on ``model``'s engine, loaded in
    this process on ``backend`` (its input validation included, as a replica runs it);
    ``inputs``: name -> array (default: ``CASES[model]``'s)."""
    from deployments.runtime.contract.repository import ModelRepository
    from deployments.runtime.residency.host import ModelHost

    host = ModelHost(ModelRepository(repository).get(model), backend).load()
    try:
        inputs = inputs if inputs is not None else {name: x for name, x, _ in CASES[model]}
        return timed_ms(lambda: host.infer(inputs), n)
    finally:
        host.unload()


def _http_body(model: str) -> tuple[bytes, dict[str, str]]:
    """The binary-extension body and headers ``tritonclient.http`` sends for ``model``'s case."""
    import tritonclient.http as httpclient

    body, header_length = httpclient.InferenceServerClient.generate_request_body(_inputs(httpclient, CASES[model]))
    headers = {"Content-Type": "application/octet-stream"}
    if header_length is not None:
        headers["Inference-Header-Content-Length"] = str(header_length)
    return body, headers


def _grpc_request(model: str) -> Any:
    """The ``ModelInferRequest`` ``tritonclient.grpc`` sends for ``model``'s case (raw contents)."""
    return infer_request(model, CASES[model])


def infer_request(model: str, tensors: Sequence[tuple[str, np.ndarray, str]]) -> Any:
    """A ``ModelInferRequest`` for ``model`` with ``tensors`` (name, array, KServe datatype) as
    raw contents, as ``tritonclient.grpc`` sends them."""
    from tritonclient.grpc import service_pb2 as pb

    request = pb.ModelInferRequest(model_name=model)
    for name, x, datatype in tensors:
        request.inputs.add(name=name, datatype=datatype, shape=list(x.shape))
        request.raw_input_contents.append(np.ascontiguousarray(x).tobytes())
    return request


async def _closed_loop(send: Callable[[int], Any], clients: int, warmup_s: float, duration_s: float) -> dict:
    """``clients`` workers, each calling ``await send(i)`` (True: a good answer) in a loop;
    the good and bad answers completed within ``duration_s`` after ``warmup_s``."""
    loop = asyncio.get_running_loop()
    start = loop.time() + warmup_s
    end = start + duration_s
    counts = {"ok": 0, "bad": 0}

    async def worker(i: int) -> None:
        while loop.time() < end:
            good = await send(i)
            now = loop.time()
            if start <= now < end:
                counts["ok" if good else "bad"] += 1

    await asyncio.gather(*(worker(i) for i in range(clients)))
    return {"qps": counts["ok"] / duration_s, "bad": counts["bad"]}


async def http_qps(address: str, model: str, clients: int, warmup_s: float, duration_s: float) -> dict:
    import aiohttp

    body, headers = _http_body(model)
    url = f"http://{address}/v2/models/{model}/infer"
    sessions = [aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) for _ in range(clients)]

    async def send(i: int) -> bool:
        try:
            async with sessions[i].post(url, data=body, headers=headers) as answer:
                await answer.read()
                return answer.status == 200
        except aiohttp.ClientError:
            return False

    try:
        return await _closed_loop(send, clients, warmup_s, duration_s)
    finally:
        await asyncio.gather(*(s.close() for s in sessions))


async def grpc_qps(address: str, model: str, clients: int, warmup_s: float, duration_s: float) -> dict:
    import grpc
    from tritonclient.grpc import service_pb2_grpc as pb_grpc

    request = _grpc_request(model)
    options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    # A channel per client: each its own connection, as separate clients have (grpcio shares one
    # subchannel among channels of equal arguments unless told otherwise).
    channels = [grpc.aio.insecure_channel(address, options=[*options, ("grpc.use_local_subchannel_pool", 1)])
                for _ in range(clients)]
    stubs = [pb_grpc.GRPCInferenceServiceStub(c) for c in channels]

    async def send(i: int) -> bool:
        try:
            await stubs[i].ModelInfer(request)
            return True
        except grpc.aio.AioRpcError:
            return False

    try:
        return await _closed_loop(send, clients, warmup_s, duration_s)
    finally:
        await asyncio.gather(*(c.close() for c in channels))


def session_cpu_s(session: int) -> float:
    """CPU seconds used so far by the live processes of ``session``."""
    from bench.replicas import cpu_seconds, session_processes

    return sum(cpu_seconds(p.pid) for p in session_processes(session))


def idle_cpu_rate(session: int, seconds: float = 1.0) -> float:
    """CPU seconds per second ``session`` uses with no request sent."""
    start = session_cpu_s(session)
    time.sleep(seconds)
    return (session_cpu_s(session) - start) / seconds


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def _ordered(items: list, round_index: int) -> list:
    return items if round_index % 2 == 0 else items[::-1]


def main(argv: Sequence[str]) -> int:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", action="append", metavar="LABEL=HTTP_ADDR,GRPC_ADDR",
                        help="a server to measure (repeat to compare; default server=127.0.0.1:8000,127.0.0.1:8001)")
    parser.add_argument("--requests", type=int, default=200, help="latency requests per round, model and protocol")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", default=",".join(CASES))
    parser.add_argument("--repository", default="engines", help="where the in-process baseline loads the models")
    parser.add_argument("--ort-threads", default="1", help="ORT_INTRA_OP_THREADS of the in-process baseline "
                        "(make serve's on 2 cores with every model: 1)")
    parser.add_argument("--clients", default="", help="throughput at these client counts, e.g. 16,64 (none: skip)")
    parser.add_argument("--qps-models", default="simple,tiny_cnn")
    parser.add_argument("--warmup-s", type=float, default=1.0)
    parser.add_argument("--duration-s", type=float, default=4.0)
    args = parser.parse_args(argv)
    os.environ.setdefault("ORT_INTRA_OP_THREADS", args.ort_threads)
    targets, sessions = {}, {}
    for spec in args.target or ["server=127.0.0.1:8000,127.0.0.1:8001"]:
        label, addresses = spec.split("=", 1)
        targets[label] = addresses.split(",")[:2]
        if len(addresses.split(",")) > 2:
            sessions[label] = int(addresses.split(",")[2])
    models = args.models.split(",")
    print(f"load average before: {_load()}", flush=True)

    clients = {label: {"http": (httpclient.InferenceServerClient(http), httpclient),
                       "grpc": (grpcclient.InferenceServerClient(grpc), grpcclient)}
               for label, (http, grpc) in targets.items()}
    p50s: dict[tuple[str, str, str], list[float]] = {}
    p95s: dict[tuple[str, str, str], list[float]] = {}
    cpu_ms: dict[tuple[str, str, str], list[float]] = {}
    pairs = [(label, protocol) for label in targets for protocol in ("http", "grpc")]
    warmup = 20
    for r in range(args.rounds):
        idle = {label: idle_cpu_rate(session) for label, session in sessions.items()}
        for model in models:
            times = in_process_ms(args.repository, model, args.requests)
            for label, protocol in [("in-process", "call"), *_ordered(pairs, r)]:
                if label != "in-process":
                    client, module = clients[label][protocol]
                    cpu_before, wall_before = session_cpu_s(sessions[label]) if label in sessions else 0.0, time.monotonic()
                    times = latencies_ms(client, module, model, args.requests, warmup)
                    if label in sessions:
                        used = session_cpu_s(sessions[label]) - cpu_before - idle[label] * (time.monotonic() - wall_before)
                        cpu_ms.setdefault((model, label, protocol), []).append(used * 1e3 / (args.requests + warmup))
                p50s.setdefault((model, label, protocol), []).append(statistics.median(times))
                p95s.setdefault((model, label, protocol), []).append(statistics.quantiles(times, n=20)[18])
        print(f"latency round {r + 1}/{args.rounds} done, load average {_load()}", flush=True)

    def med(values: dict, *key: str) -> float:
        return statistics.median(values[key])

    print("\nOne client, p50 / p95 ms (median over rounds); added: p50 minus the in-process call's\n")
    print("| model | in-process | " + " | ".join(f"{label} HTTP | {label} gRPC | {label} gRPC added | "
                                                  f"{label} gRPC - HTTP" for label in targets) + " |")
    print("|---|---|" + "---|---|---|---|" * len(targets))
    for model in models:
        base = med(p50s, model, "in-process", "call")
        cells = [f"{base:.2f} / {med(p95s, model, 'in-process', 'call'):.2f}"]
        for label in targets:
            http, grpc_ = med(p50s, model, label, "http"), med(p50s, model, label, "grpc")
            cells += [f"{http:.2f} / {med(p95s, model, label, 'http'):.2f}",
                      f"{grpc_:.2f} / {med(p95s, model, label, 'grpc'):.2f}",
                      f"{grpc_ - base:+.2f}", f"{grpc_ - http:+.2f}"]
        print(f"| {model} | " + " | ".join(cells) + " |")
    if sessions:
        print("\nServer CPU ms per request at one client, idle use taken off (median over rounds)\n")
        print("| model | " + " | ".join(f"{label} HTTP | {label} gRPC" for label in sessions) + " |")
        print("|---|" + "---|---|" * len(sessions))
        for model in models:
            print(f"| {model} | " + " | ".join(f"{med(cpu_ms, model, label, 'http'):.2f} | "
                                               f"{med(cpu_ms, model, label, 'grpc'):.2f}" for label in sessions) + " |")

    if args.clients:
        counts = [int(c) for c in args.clients.split(",")]
        qps: dict[tuple[str, int, str, str], list[float]] = {}
        bad: dict[tuple[str, int, str, str], int] = {}
        runners = {"http": http_qps, "grpc": grpc_qps}
        for r in range(args.rounds):
            for model in args.qps_models.split(","):
                for n in counts:
                    for label, protocol in _ordered(pairs, r):
                        address = targets[label][0 if protocol == "http" else 1]
                        got = asyncio.run(runners[protocol](address, model, n, args.warmup_s, args.duration_s))
                        qps.setdefault((model, n, label, protocol), []).append(got["qps"])
                        bad[(model, n, label, protocol)] = bad.get((model, n, label, protocol), 0) + got["bad"]
            print(f"throughput round {r + 1}/{args.rounds} done, load average {_load()}", flush=True)
        print("\nQPS, median over rounds (answers other than 200 / OK, all rounds, in brackets)\n")
        print("| model | clients | " + " | ".join(f"{label} HTTP | {label} gRPC | {label} gRPC / HTTP"
                                                   for label in targets) + " |")
        print("|---|---|" + "---|---|---|" * len(targets))
        for model in args.qps_models.split(","):
            for n in counts:
                cells = []
                for label in targets:
                    h, g = statistics.median(qps[(model, n, label, "http")]), statistics.median(qps[(model, n, label, "grpc")])
                    hb, gb = bad[(model, n, label, "http")], bad[(model, n, label, "grpc")]
                    cells += [f"{h:.0f}" + (f" ({hb})" if hb else ""), f"{g:.0f}" + (f" ({gb})" if gb else ""),
                              f"{g / h:.2f}" if h else "-"]
                print(f"| {model} | {n} | " + " | ".join(cells) + " |")
    print(f"\nload average after: {_load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
