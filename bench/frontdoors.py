"""The front doors side by side: resnet18 through HTTP binary, gRPC raw and system shared memory.

One Ray Serve cluster per replica count k (``--replicas 1,8``), started as ``bench.throughput``
starts its servers (the ``fast`` config: HAProxy and Ray's throughput-optimized mode, a free
gRPC port for the router replicas' gRPC front door), serving:

- ``unbatched``: resnet18 as a dedicated model of k replicas, batching off;
- ``padded``: its copy ``resnet18_padded`` with dynamic batching, padded to the preferred batch
  size 8 (``bench.throughput --padded --preferred-batch-size 8``), k replicas;
- ``echo``: Ray Serve's own ceiling (``bench.echo``: an ingress replica that reads the request and
  answers a fixed output, no model), k replicas, reached over HTTP binary with the same requests.

Every model variant is measured through each protocol (``--protocols``), one after another
against the same running server, at each client count (``--clients``, closed loop):

- ``http``: KServe v2 HTTP with Triton binary tensors, input and output (``bench.loadgen``);
- ``grpc``: KServe v2 gRPC ``ModelInfer`` with ``raw_input_contents`` (``grpc.aio`` and
  ``tritonclient.grpc``'s generated stubs, a channel per client), to the server's gRPC port;
- ``shm``: Triton's system shared memory over HTTP: each client creates and registers its own
  input and output regions (POSIX shm) before the window and writes the input once; each
  request names the regions and the answer's output is read from the output region (which the
  client fills with NaN before each request, so a stale answer cannot pass). The regions are
  unregistered and destroyed at the end of the point. Where /dev/shm cannot hold a region per
  client, the clients of a process share one input region (the row says ``shm_input``).

Every answer is checked (``bench.loadgen.Expected``): each output's datatype, shape and size;
every ``--check-every``-th answer of a client has its values compared with ONNX Runtime's
output for the same input, computed in this process on the CPU (``--tolerance``, default 1e-4
where the server runs on the CPU, 1e-2 on a GPU, where cuDNN and TF32 differ); the echo's fixed
answer likewise. A wrong answer counts as an error (``wrong answer: ...``), never as a success.

Per point: QPS over ``--duration-s`` after ``--warmup-s``, p50/p99 of the good answers, errors
by status (gRPC: ``grpc <CODE>``; a request shed with a retry-after, HTTP 503 or gRPC
UNAVAILABLE, makes its client wait that long, as ``bench.loadgen``'s clients do), ``of echo``
(QPS / the echo's at the same k and clients), and the server's CPU ms per request (every process
of the server's session: Ray, HAProxy, replicas; CPU over the whole run / (QPS x (warm-up +
window)): approximate, idle use included). Per k, at one client: the p50 of each protocol
(unbatched) less the p50 of the model's ``ModelHost`` called in this process on the same
backend (``bench.grpc_latency.in_process_ms``), measured beside the idle server just before its
points.

Results (``--out``): ``frontdoors-<time>.json`` (rewritten after every point), ``.md`` (the
tables) and ``.png`` (QPS by clients, one panel per k; where matplotlib is importable).

    python -m bench.frontdoors --quick --out /tmp/fd            # minutes on 2 cores
    python -m bench.frontdoors --replicas 1 --gpu-fraction 0.04 --processes 4 --out OUT
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import yaml

from bench import echo
from bench.grpc_latency import in_process_ms, infer_request, session_cpu_s
from bench.loadgen import Expected, _Samples, expected_from_onnx, is_shed, make_workload, run
from bench.throughput import (PADDED_SUFFIX, ROOT, SHAPES, Server, _ints, _ratio, _table, free_port,
                              prepare_repository)

MODEL = "resnet18"
VARIANTS = ("unbatched", "padded", "echo")
PROTOCOLS = ("http", "grpc", "shm")
PREFERRED_BATCH_SIZE = 8
MAX_QUEUE_DELAY_MS = 2.0
OK = "200"  # the status of a good answer, whatever the protocol (gRPC OK and checked)


@dataclass(frozen=True)
class Target:
    """What a gRPC or shared-memory client process needs (picklable: it crosses to spawned
    processes): where to send ``model``'s request for input ``input_name`` = ``x`` and what
    each answer must hold. ``shm_shared_input``: the clients of a process share one input
    region."""

    label: str
    protocol: str
    http_url: str
    grpc_address: str
    model: str
    input_name: str
    x: np.ndarray
    expected: Expected
    shm_shared_input: bool = False


# --- clients (in the load generator's processes) ---------------------------------------------

def grpc_problem(response: Any, expected: Expected, compare: bool) -> str | None:
    """What is wrong with a ``ModelInferResponse`` (outputs as raw contents); None: nothing."""
    from tritonclient.utils import triton_to_np_dtype

    try:
        described = {o.name: (i, o) for i, o in enumerate(response.outputs)}
        for name in expected.outputs:
            if name not in described:
                return f"no output {name!r} (answered: {sorted(described)})"
            i, out = described[name]
            raw = response.raw_output_contents[i] if i < len(response.raw_output_contents) else None
            shape = list(out.shape)
            problem = expected.output_problem(
                name, out.datatype, shape, None if raw is None else len(raw),
                lambda: None if raw is None else np.frombuffer(raw, triton_to_np_dtype(out.datatype)).reshape(shape),
                compare)
            if problem is not None:
                return problem
    except Exception as e:  # an answer the client cannot read is a wrong answer
        return f"unreadable answer ({type(e).__name__}: {e})"
    return None


class GrpcClient:
    """One gRPC client: its own channel (its own connection) and the prebuilt request."""

    def __init__(self, target: Target) -> None:
        import grpc
        from tritonclient.grpc import service_pb2_grpc as pb_grpc

        self.target, self.grpc = target, grpc
        options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1),
                   ("grpc.use_local_subchannel_pool", 1)]
        self.channel = grpc.aio.insecure_channel(target.grpc_address, options=options)
        self.stub = pb_grpc.GRPCInferenceServiceStub(self.channel)
        self.request = infer_request(target.model, [(target.input_name, target.x, "FP32")])

    async def setup(self) -> None:
        pass

    async def send(self, compare: bool) -> tuple[str, bytes, float | None]:
        """(status, body of an error, seconds to wait before the next: a shed request's
        ``retry-after``, else None)."""
        try:
            response = await self.stub.ModelInfer(self.request)
        except self.grpc.aio.AioRpcError as e:
            retry = dict(e.trailing_metadata() or ()).get("retry-after")
            return f"grpc {e.code().name}", (e.details() or "").encode(), float(retry) if retry else None
        problem = grpc_problem(response, self.target.expected, compare)
        return (OK, b"", None) if problem is None else (f"wrong answer: {problem}", b"", None)

    async def close(self) -> None:
        await self.channel.close()


class Region:
    """A POSIX shared-memory region of this process (``tritonclient.utils.shared_memory``)
    registered with the server under ``name`` (``register``), unregistered and destroyed by
    ``close``."""

    def __init__(self, byte_size: int) -> None:
        import tritonclient.utils.shared_memory as shm

        self.shm = shm
        self.name = f"fd_{os.getpid()}_{uuid.uuid4().hex[:10]}"
        self.key, self.byte_size = "/" + self.name, byte_size
        self.handle = shm.create_shared_memory_region(self.name, self.key, byte_size)
        self.registered = False

    async def register(self, session: Any, base_url: str) -> None:
        url = f"{base_url}/v2/systemsharedmemory/region/{self.name}/register"
        async with session.post(url, json={"key": self.key, "offset": 0, "byte_size": self.byte_size}) as answer:
            if answer.status != 200:
                raise RuntimeError(f"registering {self.name}: {answer.status} {await answer.text()}")
        self.registered = True

    async def close(self, session: Any, base_url: str) -> None:
        if self.registered:
            with contextlib.suppress(Exception):
                async with session.post(f"{base_url}/v2/systemsharedmemory/region/{self.name}/unregister") as answer:
                    await answer.read()
        self.shm.destroy_shared_memory_region(self.handle)


class ShmClient:
    """One system shared-memory client: its own HTTP connection and output region, its own
    input region (or its process's shared one), written once; each request names them."""

    def __init__(self, target: Target, shared_input: Region | None = None) -> None:
        import aiohttp
        from tritonclient.utils import triton_to_np_dtype

        self.target, self.aiohttp = target, aiohttp
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1),
                                             timeout=aiohttp.ClientTimeout(total=120))
        self.url = f"{target.http_url}/v2/models/{target.model}/infer"
        self.own_input = shared_input is None
        self.input = shared_input or Region(target.x.nbytes)
        self.outputs: dict[str, tuple[int, np.dtype, tuple[int, ...]]] = {}  # name -> (offset, dtype, shape)
        offset = 0
        for name, (datatype, shape) in target.expected.outputs.items():
            dtype = np.dtype(triton_to_np_dtype(datatype))
            self.outputs[name] = (offset, dtype, shape)
            offset += int(np.prod(shape)) * dtype.itemsize
        self.output = Region(offset)
        self.blank = np.full(offset // 4, np.nan, np.float32)  # written before each request
        self.body = json.dumps({
            "inputs": [{"name": target.input_name, "shape": list(target.x.shape), "datatype": "FP32", "parameters": {
                "shared_memory_region": self.input.name, "shared_memory_byte_size": target.x.nbytes}}],
            "outputs": [{"name": name, "parameters": {
                "shared_memory_region": self.output.name, "shared_memory_offset": o,
                "shared_memory_byte_size": int(np.prod(shape)) * dtype.itemsize}}
                for name, (o, dtype, shape) in self.outputs.items()]}).encode()

    async def setup(self) -> None:
        if self.own_input:
            self.input.shm.set_shared_memory_region(self.input.handle, [self.target.x])
            await self.input.register(self.session, self.target.http_url)
        await self.output.register(self.session, self.target.http_url)

    async def send(self, compare: bool) -> tuple[str, bytes, float | None]:
        """(status, body of an error, seconds to wait before the next: a shed request's
        ``Retry-After``, as ``bench.loadgen``'s clients wait, else None)."""
        self.output.shm.set_shared_memory_region(self.output.handle, [self.blank])
        try:
            async with self.session.post(self.url, data=self.body,
                                         headers={"Content-Type": "application/json"}) as answer:
                body = await answer.read()
                status = str(answer.status)
                if status == "503" and is_shed(answer.headers, body):
                    return status, body, float(answer.headers["Retry-After"])
        except (self.aiohttp.ClientError, asyncio.TimeoutError) as e:
            return type(e).__name__, b"", None
        if status == "503":
            return "503 without Retry-After or error body", body, None
        if status != OK:
            return status, body, None
        problem = self.problem(body, compare)
        return (OK, b"", None) if problem is None else (f"wrong answer: {problem}", b"", None)

    def problem(self, body: bytes, compare: bool) -> str | None:
        """What is wrong with a 200 answer (its JSON, the output region); None: nothing."""
        try:
            described = {o["name"]: o for o in json.loads(body).get("outputs", [])}
            for name, (offset, dtype, shape) in self.outputs.items():
                out = described.get(name)
                if out is None:
                    return f"no output {name!r} (answered: {sorted(described)})"
                parameters = out.get("parameters") or {}
                if parameters.get("shared_memory_region") != self.output.name or "data" in out:
                    return f"output {name!r} not in the region {self.output.name!r}: {json.dumps(out)[:200]}"
                problem = self.target.expected.output_problem(
                    name, out.get("datatype"), out.get("shape", ()), parameters.get("shared_memory_byte_size"),
                    lambda: self.output.shm.get_contents_as_numpy(self.output.handle, dtype, shape, offset), compare)
                if problem is not None:
                    return problem
        except Exception as e:  # an answer the client cannot read is a wrong answer
            return f"unreadable answer ({type(e).__name__}: {e})"
        return None

    async def close(self) -> None:
        await self.output.close(self.session, self.target.http_url)
        if self.own_input:
            await self.input.close(self.session, self.target.http_url)
        await self.session.close()


async def _worker(client: Any, start: float, stop: float, samples: _Samples, check_every: int) -> None:
    answers = 0
    while (sent := time.perf_counter()) < stop:
        status, answer, retry_after_s = await client.send(answers % check_every == 0)
        answers += 1
        done = time.perf_counter()
        samples.add(sent, done, status, answer, start, stop)
        if retry_after_s is not None:  # a polite client waits as told (never past the window)
            await asyncio.sleep(max(0.0, min(retry_after_s, stop - done)))


async def _clients(target: Target, clients: int, warmup_s: float, duration_s: float) -> _Samples:
    """``clients`` closed-loop clients of ``target`` on this event loop; the window starts
    ``warmup_s`` after every client is set up (regions registered)."""
    shared = Region(target.x.nbytes) if target.protocol == "shm" and target.shm_shared_input else None
    made: list[Any] = []
    try:
        if shared is not None:
            import aiohttp

            shared.shm.set_shared_memory_region(shared.handle, [target.x])
            async with aiohttp.ClientSession() as session:
                await shared.register(session, target.http_url)
        for _ in range(clients):
            made.append(GrpcClient(target) if target.protocol == "grpc" else ShmClient(target, shared))
        await asyncio.gather(*(c.setup() for c in made))
        start = time.perf_counter() + warmup_s
        samples = _Samples()
        await asyncio.gather(*(_worker(c, start, start + duration_s, samples, target.expected.sample_every)
                               for c in made))
        return samples
    finally:
        await asyncio.gather(*(c.close() for c in made), return_exceptions=True)
        if shared is not None:
            import aiohttp

            async with aiohttp.ClientSession() as session:
                await shared.close(session, target.http_url)


def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _run_share(args: tuple[list[tuple[Target, int]], float, float]) -> list[_Samples]:
    """``bench.loadgen.run``'s runner for gRPC and shared-memory targets (one client process).
    A SIGTERM (the pool's ``terminate`` on an interrupted run) unwinds it as Ctrl-C does, so
    its regions are unregistered and destroyed."""
    signal.signal(signal.SIGTERM, _interrupted)
    share, warmup_s, duration_s = args
    return [asyncio.run(_clients(target, clients, warmup_s, duration_s)) for target, clients in share]


# --- the benchmark -----------------------------------------------------------------------------

def shm_fits(clients: int, byte_size: int, free_bytes: int | None = None) -> bool:
    """Whether ``clients`` input regions of ``byte_size`` fit in half of /dev/shm's free space."""
    if free_bytes is None:
        free_bytes = shutil.disk_usage("/dev/shm").free
    return clients * byte_size <= free_bytes // 2


def default_tolerance(backend: str) -> float:
    """1e-4 where the server runs on the CPU; 1e-2 where it may run on a GPU (cuDNN, TF32)."""
    import onnxruntime

    on_gpu = backend != "onnxruntime" and "CUDAExecutionProvider" in onnxruntime.get_available_providers()
    return 1e-2 if on_gpu else 1e-4


def wait_grpc_ready(address: str, models: Sequence[str], timeout_s: float = 180.0) -> None:
    """Poll the gRPC front door until the server and each of ``models`` is ready."""
    import tritonclient.grpc as grpcclient

    deadline = time.monotonic() + timeout_s
    client = grpcclient.InferenceServerClient(address)
    try:
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if client.is_server_ready(client_timeout=5) and all(
                        client.is_model_ready(m, client_timeout=5) for m in models):
                    return
            time.sleep(0.5)
    finally:
        client.close()
    raise TimeoutError(f"gRPC at {address} not ready within {timeout_s:g} s")


class FrontDoors:
    """The points, the report and its files; ``points`` and ``added`` are the rows."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.x = np.random.default_rng(0).random(SHAPES[MODEL], dtype=np.float32)
        self.model_file = Path(args.repository) / MODEL / "1" / "model.onnx"
        self.expected = expected_from_onnx(str(self.model_file), self.x, rtol=args.tolerance, atol=args.tolerance,
                                           sample_every=args.check_every)
        config = yaml.safe_load((Path(args.repository) / MODEL / "config.yaml").read_text())
        self.input_name = config["inputs"][0]["name"]
        self.results: dict[str, Any] = {"meta": meta(args), "in_process": [], "points": [], "added_latency": []}
        args.out.mkdir(parents=True, exist_ok=True)
        self.stem = args.out / f"frontdoors-{time.strftime('%Y%m%d-%H%M%S')}"

    def save(self) -> None:
        self.stem.with_suffix(".json").write_text(json.dumps(self.results, indent=2))
        self.stem.with_suffix(".md").write_text(markdown(self.results))

    def in_process(self, repository: Path, replicas: int) -> None:
        """p50/p99 of ``ModelHost.infer`` in this process, on the servers' backend, beside the
        idle server of ``replicas`` replicas (the conditions of its one-client points)."""
        times = in_process_ms(str(repository), MODEL, self.args.in_process_requests, {self.input_name: self.x},
                              self.args.backend)
        row = {"replicas": replicas, "p50_ms": round(statistics.median(times), 3),
               "p99_ms": round(float(np.percentile(times, 99)), 3), "requests": len(times)}
        self.results["in_process"].append(row)
        print(f"k={replicas} in-process {MODEL}: p50 {row['p50_ms']} ms  p99 {row['p99_ms']} ms", flush=True)
        self.save()

    def serve(self, scratch: Path, replicas: int) -> tuple[Server, int]:
        a = self.args
        repository = prepare_repository(scratch / f"engines-{replicas}", Path(a.repository), [MODEL],
                                        [MODEL] if "padded" in a.variants else [], replicas, MAX_QUEUE_DELAY_MS,
                                        a.gpu_fraction, [PREFERRED_BATCH_SIZE], padded="padded" in a.variants)
        models = [MODEL] * ("unbatched" in a.variants) + [MODEL + PADDED_SUFFIX] * ("padded" in a.variants)
        grpc_port = free_port()
        server = Server("ray", repository, "fast", replicas=replicas, models=models or [MODEL], backend=a.backend,
                        echo="echo" in a.variants, grpc_port=grpc_port, grpc_front=a.grpc_front)
        if models and "grpc" in a.protocols:
            wait_grpc_ready(f"127.0.0.1:{grpc_port}", models)
        return server, grpc_port

    def measure(self, server: Server, grpc_port: int, replicas: int, variant: str, protocol: str,
                clients: int) -> dict[str, Any]:
        a = self.args
        model = MODEL + PADDED_SUFFIX if variant == "padded" else MODEL
        label = f"{variant}/{protocol}"
        row: dict[str, Any] = {"replicas": replicas, "variant": variant, "protocol": protocol, "clients": clients}
        if protocol == "http":
            url = server.url + (echo.ROUTE_PREFIX if variant == "echo" else "")
            plan = [(make_workload(label, url, model, self.input_name, self.x, binary=True,
                                   expected=echo.expected() if variant == "echo" else self.expected), clients)]
            runner: dict[str, Any] = {}
        else:
            shared = protocol == "shm" and not shm_fits(clients, self.x.nbytes + 4096)
            row["shm_input"] = ("shared per process" if shared else "per client") if protocol == "shm" else None
            plan = [(Target(label, protocol, server.url, f"127.0.0.1:{grpc_port}", model, self.input_name, self.x,
                            self.expected, shared), clients)]
            runner = {"runner": _run_share}
        cpu_before, began = session_cpu_s(server.process.pid), time.monotonic()
        (result,) = run(plan, a.duration_s, a.warmup_s, a.processes, **runner)
        cpu_s = session_cpu_s(server.process.pid) - cpu_before
        served = result.qps * (a.warmup_s + a.duration_s)
        row.update({k: v for k, v in asdict(result).items() if k not in ("label", "concurrency")})
        row["server_cpu_ms_per_request"] = round(cpu_s * 1e3 / served, 3) if served else None
        row["wall_s"] = round(time.monotonic() - began, 1)
        return row

    def add(self, row: dict[str, Any]) -> None:
        points = self.results["points"]
        points.append(row)
        echo_qps = {(p["replicas"], p["clients"]): p.get("qps") for p in points if p["variant"] == "echo"}
        for p in points:  # the echo's points come after the model's
            if p["variant"] != "echo" and p.get("qps") is not None:
                p["of_echo"] = _ratio(p["qps"], echo_qps.get((p["replicas"], p["clients"])))
        errors = ", ".join(f"{n} {s}" for s, n in (row.get("error_statuses") or {}).items())
        print(f"k={row['replicas']} {row['variant']:9} {row['protocol']:4} c={row['clients']:<3} "
              + (f"FAILED {row['failed']}" if "failed" in row else
                 f"{row['qps']:9.1f} QPS  p50 {row['p50_ms']} ms  p99 {row['p99_ms']} ms  "
                 f"errors {row['errors']}{' (' + errors + ')' if errors else ''}  "
                 f"cpu {row['server_cpu_ms_per_request']} ms/req"), flush=True)
        self.save()

    def added_latency(self, replicas: int) -> None:
        """One row: p50 at one client (unbatched) of each protocol, less the in-process call's."""
        base = next((r["p50_ms"] for r in self.results["in_process"] if r["replicas"] == replicas), None)
        p50 = {p["protocol"]: p.get("p50_ms") for p in self.results["points"]
               if (p["replicas"], p["variant"], p["clients"]) == (replicas, "unbatched", 1)}
        if not p50:
            return
        row: dict[str, Any] = {"replicas": replicas, "in_process_p50_ms": base}
        for protocol, value in p50.items():
            row[f"{protocol}_p50_ms"] = value
            row[f"{protocol}_added_ms"] = round(value - base, 3) if value is not None and base is not None else None
        if p50.get("grpc") is not None and p50.get("http") is not None:
            row["grpc_minus_http_ms"] = round(p50["grpc"] - p50["http"], 3)
        self.results["added_latency"].append(row)
        print(f"k={replicas} added over in-process ({base} ms): "
              + ", ".join(f"{p} {row[f'{p}_added_ms']} ms" for p in p50), flush=True)
        self.save()

    def run_replicas(self, scratch: Path, replicas: int) -> None:
        a = self.args
        began = time.monotonic()
        server, grpc_port = self.serve(scratch, replicas)
        with server:
            print(f"k={replicas}: server up in {time.monotonic() - began:.0f} s", flush=True)
            if {"unbatched", "padded"} & set(a.variants) and 1 in a.clients:
                try:
                    self.in_process(prepare_repository(scratch / f"engines-floor-{replicas}", Path(a.repository),
                                                       [MODEL], [], 1, 0), replicas)
                except Exception as e:  # the points go on without their floor
                    print(f"k={replicas} in-process FAILED {type(e).__name__}: {e}"[:500], flush=True)
            for variant in a.variants:
                for protocol in (("http",) if variant == "echo" else a.protocols):
                    for clients in a.clients:
                        try:
                            row = self.measure(server, grpc_port, replicas, variant, protocol, clients)
                        except Exception as e:  # one failed point does not end the run
                            row = {"replicas": replicas, "variant": variant, "protocol": protocol,
                                   "clients": clients, "failed": f"{type(e).__name__}: {e}"[:500]}
                        self.add(row)
            self.added_latency(replicas)


def markdown(results: dict[str, Any]) -> str:
    meta_ = results["meta"]
    out = [f"# Front doors: {MODEL} through HTTP binary, gRPC raw, system shared memory\n",
           f"`{meta_['command']}`, {meta_['date']}, {meta_['machine']} ({meta_['cpus']} CPUs), Ray {meta_['ray']}, "
           f"ONNX Runtime {meta_['onnxruntime']}, backend {meta_['backend']} ({meta_['backend_here']} in the "
           f"benchmark's process), gpu fraction {meta_['gpu_fraction']}, "
           f"window {meta_['duration_s']} s after {meta_['warmup_s']} s, {meta_['processes']} client processes, "
           f"values checked on every {meta_['check_every']}th answer within {meta_['tolerance']}\n",
           "QPS: good answers per second in the window; p50/p99 ms: their latency; errors: answers other "
           "than a good one (status, or `wrong answer`); of echo: QPS / the echo's at the same replicas "
           "and clients; CPU ms/req: the server's CPU (all its processes) per request, approximate\n"]
    out.append(_table(["replicas", "variant", "protocol", "clients", "QPS", "p50 ms", "p99 ms", "errors",
                       "of echo", "CPU ms/req"],
                      [[p["replicas"], p["variant"], p["protocol"], p["clients"],
                        p.get("qps", "failed"), p.get("p50_ms"), p.get("p99_ms"),
                        (", ".join(f"{n} {s}" for s, n in p.get("error_statuses", {}).items()) or 0)
                        if "failed" not in p else p["failed"][:80],
                        p.get("of_echo"), p.get("server_cpu_ms_per_request")] for p in results["points"]]))
    if results["added_latency"]:
        out.append("\n## Added latency at one client (unbatched p50 less the in-process `ModelHost.infer` p50)\n")
        out.append(_table(["replicas", "in-process p50 ms", "HTTP p50 ms", "gRPC p50 ms", "shm p50 ms",
                           "HTTP added ms", "gRPC added ms", "shm added ms", "gRPC - HTTP ms"],
                          [[r["replicas"], r["in_process_p50_ms"], r.get("http_p50_ms"), r.get("grpc_p50_ms"),
                            r.get("shm_p50_ms"), r.get("http_added_ms"), r.get("grpc_added_ms"),
                            r.get("shm_added_ms"), r.get("grpc_minus_http_ms")] for r in results["added_latency"]]))
    return "\n".join(out) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    """QPS by clients, one panel per replica count, a line per variant and protocol."""
    from bench.panels import save_panels

    points = [p for p in results["points"] if p.get("qps") is not None]
    panels = []
    for k in sorted({p["replicas"] for p in points}):
        lines = []
        for variant, protocol in sorted({(p["variant"], p["protocol"]) for p in points if p["replicas"] == k}):
            rows = [p for p in points if (p["replicas"], p["variant"], p["protocol"]) == (k, variant, protocol)]
            lines.append((f"{variant} {protocol}", [p["clients"] for p in rows], [p["qps"] for p in rows],
                          "--" if variant == "echo" else "-"))
        panels.append((f"{MODEL}, {k} replica{'s' if k > 1 else ''}", lines))
    if panels:
        save_panels(path, panels, xlabel="clients", ylabel="QPS (log)", ylog=True)


def meta(a: argparse.Namespace) -> dict[str, Any]:
    import onnxruntime
    import ray

    from deployments.runtime.backends.select import resolve_backend

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    return {"command": a.command, "machine": cpu, "cpus": os.cpu_count(), "ray": ray.__version__,
            "onnxruntime": onnxruntime.__version__, "python": platform.python_version(), "backend": a.backend,
            "backend_here": resolve_backend(a.backend),
            "gpu_fraction": a.gpu_fraction, "duration_s": a.duration_s, "warmup_s": a.warmup_s,
            "processes": a.processes, "tolerance": a.tolerance, "check_every": a.check_every,
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def _names(text: str, allowed: Sequence[str], flag: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    unknown = sorted(set(names) - set(allowed))
    if unknown:
        raise SystemExit(f"{flag}: unknown {unknown}; allowed: {','.join(allowed)}")
    return names


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="a short run on a small machine: replicas 1, clients 1,16, a 2 s window after 1 s, 1 process")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"subset of {','.join(VARIANTS)}")
    p.add_argument("--replicas", help="replica counts, one server each (default 1,8; quick 1)")
    p.add_argument("--protocols", default=",".join(PROTOCOLS), help=f"subset of {','.join(PROTOCOLS)} (echo: http only)")
    p.add_argument("--clients", help="closed-loop client counts (default 1,16,64,256; quick 1,16)")
    p.add_argument("--duration-s", type=float, help="measured window per point (default 3; quick 2)")
    p.add_argument("--warmup-s", type=float, help="warm-up before each window (default 1)")
    p.add_argument("--processes", type=int, help="load generator processes (default 4; quick 1)")
    p.add_argument("--backend", default="auto", help="auto | onnxruntime | onnxruntime_cuda (servers and in-process)")
    p.add_argument("--grpc-front", choices=("haproxy", "router"), default="haproxy",
                   help="haproxy: as make serve (HAProxy sends each ModelInfer to the model's replica); router: "
                        "each router replica's own gRPC server, the body through HAProxy's HTTP frontend")
    p.add_argument("--gpu-fraction", type=float, default=0.0, help="num_gpus of each model replica (0: none)")
    p.add_argument("--tolerance", type=float, help="rtol and atol of the value checks (default 1e-4 CPU, 1e-2 GPU)")
    p.add_argument("--check-every", type=int, default=16, help="compare the values of every Nth answer per client")
    p.add_argument("--in-process-requests", type=int, default=200, help="calls of the in-process floor")
    p.add_argument("--repository", default=str(ROOT / "engines"), help="source model repository")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = p.parse_args(argv)
    a.command = "python -m bench.frontdoors " + " ".join(argv)
    a.variants = _names(a.variants, VARIANTS, "--variants")
    a.protocols = _names(a.protocols, PROTOCOLS, "--protocols")
    a.replicas = _ints(a.replicas or ("1" if a.quick else "1,8"))
    a.clients = _ints(a.clients or ("1,16" if a.quick else "1,16,64,256"))
    a.duration_s = a.duration_s or (2.0 if a.quick else 3.0)
    a.warmup_s = a.warmup_s if a.warmup_s is not None else 1.0
    a.processes = a.processes or (1 if a.quick else 4)
    a.tolerance = a.tolerance if a.tolerance is not None else default_tolerance(a.backend)
    a.out = Path(a.out)
    return a


def main(argv: Sequence[str]) -> None:
    a = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupted)  # a SIGTERM (e.g. `timeout`) stops the servers too
    os.environ["ORT_INTRA_OP_THREADS"] = "1"  # as bench.throughput: replicas, not ORT's threads, scale
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    bench = FrontDoors(a)
    scratch = Path(tempfile.mkdtemp(prefix="bench-frontdoors-"))
    try:
        for replicas in a.replicas:
            try:
                bench.run_replicas(scratch, replicas)
            except Exception as e:  # a server that did not start: the next replica count still runs
                print(f"k={replicas} FAILED {type(e).__name__}: {e}"[:1000], flush=True)
    finally:
        bench.save()
        shutil.rmtree(scratch, ignore_errors=True)
        try:
            plot(bench.results, bench.stem.with_suffix(".png"))
            png = ", .png"
        except Exception as e:  # matplotlib missing, or no point measured: the tables stand without it
            png = f" (no plot: {type(e).__name__}: {e})"
        print(markdown(bench.results))
        print(f"wrote {bench.stem}.json, .md{png}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
