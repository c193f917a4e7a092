"""Ray Serve app vs the single-process baseline, side by side on one machine, in one run.

Scenarios (each against both servers unless noted; inputs are random FP32 tensors sent as
Triton binary tensors unless the scenario compares encodings):

- ``alone``: each model alone, closed-loop concurrency sweep: QPS, p50/p90/p99; also the echo
  ceiling under the same requests (``of echo`` = QPS / echo's QPS).
- ``together``: two and three models at once at ``--together-concurrency`` each;
  retention = sum of QPS together / sum of QPS alone at that concurrency.
- ``batching``: Ray only: a copy of each model with ``dynamic_batching`` against the
  unbatched model, plus the replica's batch counters (requests per model call); with
  ``--padded`` also a copy padded to the preferred sizes, with ``--auto`` one batched as a config
  without preferred sizes is (pad_to_preferred auto); with ``--trace`` the replica's own
  timestamps per point (``bench.batch_trace``: queue, batch call, engine, event-loop lag);
  ``--standin`` serves the named models on ``bench.gpu_standin`` (a GPU-like wait, no compute);
  with ``--model-replicas k`` > 1 each variant has k replicas, and the echo ceiling (k replicas,
  the same requests) is measured beside them.
- ``payload``: JSON vs binary for ocr_det's (1, 3, 640, 640) FP32 input.
- ``hop``: p50 at concurrency 1 through the product's route (today HTTP -> router -> model
  replica), a Serve ingress that runs the model in its own replica (HTTP -> model), the echo
  ceiling (HTTP -> echo replica) and the single process; the router hop adds (router - direct),
  the product adds (router - single) over the single process.
- ``configs`` (Ray only, a fresh cluster each): Ray's ingress and handle options:
  ``proxy`` (Python proxy), ``haproxy`` (``RAY_SERVE_ENABLE_HA_PROXY=1``), ``haproxy-grpc``
  (plus ``RAY_SERVE_USE_GRPC_BY_DEFAULT=1``: handles default to ``_by_reference=False``),
  ``fast`` (HAProxy plus ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``: the ``make serve`` default).
- ``pool`` (Ray only, with ``--router-replicas 1,2,4``): a pool model's path through the router
  (HTTP -> router replica -> multiplexed pool replica, the body passed through as bytes) at r
  router replicas, with ``--pool-replicas`` pool replicas serving one copy each of
  ``--pool-model`` (so that the pool is not the limit: Serve's multiplexed routing keeps a
  model on the replica that has it), the clients split evenly over the copies; side by side in
  the same cluster, today's router path before it: the same model as a dedicated model with as
  many replicas, reached through the router (its application without a route prefix:
  ``run_applications(one_hop=False)``; the router decodes it), and the echo ceiling with r
  replicas. Per point: QPS, p50/p99, QPS per router replica, the router replicas' CPU per
  request and busiest replica's CPU share, the model replicas' CPU shares (from /proc; an idle
  pool replica means two copies landed on one);
  ``x router`` = the pool path's QPS per router replica / the two-hop path's. Then, in a second
  cluster with the applications' route prefixes (``one_hop=True``, as ``make serve``), the same
  copies by the pool's own path (``pool_one_hop``: HAProxy -> the pool replica its model name
  hashes to, no router; ``deployments.haproxy.hash_pool_models``) and the dedicated model in
  one hop (``one_hop``); ``x router`` compares them with the first cluster's two-hop path too.
- ``scaleout`` (with ``--replicas 1,2,4,...``): every model and the router with k replicas;
  each model alone and all together; scale-out efficiency = QPS(k) / (k x QPS(1)); the echo
  ceiling with k replicas under each model's requests in the same cluster (``of echo`` = QPS /
  echo's QPS at the same k and clients; ``x single`` = QPS / the single process's).

The echo ceiling (``bench.echo``): an application ``echo`` at ``/echo`` in the same Ray cluster,
behind the same ingress, whose replicas read the request and answer a fixed small KServe v2
response (no model): ingress -> one replica -> answer, the most any path here can reach.

Every server runs ONNX Runtime with one intra-op thread per session (``ORT_INTRA_OP_THREADS=1``)
so replicas and contexts, not ORT's own threads, are what scales. Results go to ``--out``
(default ``bench/results/``): ``throughput-<time>.json``, ``.md`` and ``.png``.

    python -m bench.throughput --quick            # a couple of minutes on 2 cores
    python -m bench.throughput                    # the full sweep 1..64 and the config comparison
    python -m bench.throughput --scenarios scaleout --replicas 1,2,4,8
    python -m bench.throughput --scenarios pool --router-replicas 1,2,4 --pool-replicas 4 --pool-concurrency 64,128
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import yaml

from bench import batch_trace, echo, gpu_standin, stage_cpu
from bench.loadgen import Expected, Result, Workload, expected_from_onnx, make_workload, run, split_clients, sweep
from bench.replicas import CpuSampler, cpu_seconds, replica_pids
from deployments import loopback

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    "ocr_cls": (1, 3, 48, 192),
    "ocr_rec": (1, 3, 48, 320),
    "tiny_cnn": (1, 3, 224, 224),
    "mid_cnn": (1, 3, 224, 224),
    "resnet18": (1, 3, 224, 224),
    "ocr_det": (1, 3, 640, 640),
}
# The OCR pipeline's input: a real PNG (3 lines of text), sent as JSON base64 BYTES.
OCR_IMAGE = ROOT / "tests" / "data" / "ocr_sample.png"
OCR_LINES = ("Hello World 2026", "The quick brown fox")  # drawn into OCR_IMAGE by tests/data/make_ocr_sample.py
BATCHED_SUFFIX = "_batched"
PADDED_SUFFIX = "_padded"  # batched, padded to the preferred sizes (pad_to_preferred: true)
AUTO_SUFFIX = "_auto"  # batched as a config without preferred sizes is: pad_to_preferred auto
VARIANT_SUFFIXES = (BATCHED_SUFFIX, PADDED_SUFFIX, AUTO_SUFFIX)
RAY_CONFIGS = ("proxy", "haproxy", "haproxy-grpc", "fast")
SCENARIOS = ("alone", "together", "batching", "payload", "hop", "configs", "scaleout", "pool")
POOL_COPY_SUFFIX = "_pool"  # the pool scenario's copies of --pool-model: <model>_pool0, _pool1, ...


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the model repository the servers share --------------------------------------------------

def prepare_repository(dest: Path, source: Path, models: Sequence[str], batched: Sequence[str],
                       replicas: int, max_queue_delay_ms: float, gpu_fraction: float = 0.0,
                       preferred_batch_size: Sequence[int] = (), padded: bool = False, auto: bool = False) -> Path:
    """``dest`` with each model as a dedicated deployment of ``replicas`` replicas, batching
    off, plus ``<model>_batched`` copies with ``dynamic_batching`` for ``batched`` (never
    padded) and, with ``padded``, ``<model>_padded`` copies padded to the preferred sizes
    (``pad_to_preferred: true``; default sizes [8]), with ``auto``, ``<model>_auto`` copies
    batched as a config that names no preferred size is (``pad_to_preferred: auto``, the
    default); a pipeline model brings its steps.
    ``gpu_fraction``: each model replica's ``num_gpus`` (0: none). Version folders are
    symlinks to ``source``'s."""
    names = list(models)
    for name in models:
        steps = yaml.safe_load((source / name / "config.yaml").read_text()).get("parameters", {}).get("steps", [])
        names += [s for s in steps if s not in names]
    copies = [copy for m in batched for copy in batch_variants(m, padded, auto)]
    for name in names + copies:
        base = base_model(name)
        if (dest / name).exists():
            continue
        raw = _base_config(source, base)
        raw["deployment"] = {"mode": "dedicated", "num_replicas": replicas, "num_cpus": 0.1,
                             "max_ongoing_requests": 64}
        if gpu_fraction and not raw.get("pipeline"):
            raw["deployment"]["num_gpus"] = gpu_fraction
        if name.endswith(AUTO_SUFFIX):
            raw["dynamic_batching"] = {"max_queue_delay_ms": max_queue_delay_ms}
        elif name != base:
            sizes = [b for b in preferred_batch_size or ([8] if name.endswith(PADDED_SUFFIX) else [])
                     if b <= raw.get("max_batch_size", 0)]
            raw["dynamic_batching"] = {"max_queue_delay_ms": max_queue_delay_ms,
                                       "pad_to_preferred": name.endswith(PADDED_SUFFIX)}
            if sizes:
                raw["dynamic_batching"]["preferred_batch_size"] = sizes
        _write_model(dest, source, base, name, raw)
    return dest


def batch_variants(model: str, padded: bool, auto: bool) -> tuple[str, ...]:
    """The batching copies of ``model`` (``prepare_repository``): ``_batched``, with ``padded``
    ``_padded``, with ``auto`` ``_auto``."""
    return (model + BATCHED_SUFFIX,) + ((model + PADDED_SUFFIX,) if padded else ()) + (
        (model + AUTO_SUFFIX,) if auto else ())


def base_model(name: str) -> str:
    """The model a batching variant's copy (``<model>_batched``, ``_padded``, ``_auto``) serves."""
    for suffix in VARIANT_SUFFIXES:
        name = name.removesuffix(suffix)
    return name


def _base_config(source: Path, base: str) -> dict[str, Any]:
    """``source``'s config of model ``base`` for a copy under another name: without its
    ``name`` and ``dynamic_batching`` (the copy says its own)."""
    raw = yaml.safe_load((source / base / "config.yaml").read_text())
    raw.pop("name", None)
    raw.pop("dynamic_batching", None)
    return raw


def _write_model(dest: Path, source: Path, base: str, name: str, raw: dict[str, Any]) -> None:
    """``dest/name`` with config ``raw`` and, where ``source/base`` has one, its version folder
    as a symlink to that one."""
    folder = dest / name
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    if (source / base / "1").exists():
        (folder / "1").symlink_to((source / base / "1").resolve())


def prepare_pool_repository(dest: Path, source: Path, model: str, copies: int, replicas: int,
                            gpu_fraction: float = 0.0) -> Path:
    """``dest`` for the ``pool`` scenario: ``model`` as a dedicated deployment of ``replicas``
    replicas (``prepare_repository``) and ``copies`` pool copies of it (``pool_copies``, each
    ``deployment.mode: pool``, batching off); version folders are symlinks to ``source``'s."""
    prepare_repository(dest, source, [model], (), replicas, 0, gpu_fraction)
    for name in pool_copies(model, copies):
        _write_model(dest, source, model, name, {**_base_config(source, model), "deployment": {"mode": "pool"}})
    return dest


def pool_copies(model: str, copies: int) -> list[str]:
    """The names of ``model``'s pool copies in the ``pool`` scenario."""
    return [f"{model}{POOL_COPY_SUFFIX}{i}" for i in range(copies)]


# --- the servers -----------------------------------------------------------------------------

def ray_env(config: str, scratch: Path) -> dict[str, str]:
    """Environment for a Ray cluster in ``config``; HAProxy's files and ports are this run's own
    (its defaults under /tmp/haproxy-serve and ports 8404/9101 would collide with other
    clusters on the machine). With HAProxy, the rest of what ``make serve`` sets
    (``deployments.loopback.local_env``): the cluster on 127.0.0.1, and HAProxy run through the
    wrapper that keeps it there and makes it retry or answer a request whose ingress replica
    dies, and its buffer sized as ``make serve`` sizes it for the default ``retry_body_mib``."""
    from deployments.app import AppArgs
    from deployments.haproxy import BUFSIZE_ENV, buffer_env
    from deployments.runtime.contract.units import mib_to_bytes

    if config not in RAY_CONFIGS:
        raise ValueError(f"unknown Ray config {config!r}; one of {RAY_CONFIGS}")
    env: dict[str, str] = {}
    if config != "proxy":
        env.update({
            "RAY_SERVE_ENABLE_HA_PROXY": "1",
            "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(scratch / "haproxy.cfg"),
            "RAY_SERVE_HAPROXY_SOCKET_PATH": str(scratch / "admin.sock"),
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(scratch),
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(scratch / "server-state"),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
            "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
        })
    if config == "haproxy-grpc":
        env["RAY_SERVE_USE_GRPC_BY_DEFAULT"] = "1"
    if config == "fast":
        env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] = "1"
    if config in ("haproxy-grpc", "fast"):
        # gRPC between deployments caps messages at 4 MiB by default: a (1, 3, 640, 640) FP32
        # tensor (4.9 MB) would fail. Raise it to gRPC's own 2 GiB limit.
        env["RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"] = str(2**31 - 1)
    if config != "proxy":
        env.update(loopback.local_env({**os.environ, **env}))
        if BUFSIZE_ENV not in os.environ:  # as make serve sizes it (deployments.run.retry_buffer_env)
            env.update((name, value) for name, value in buffer_env(
                mib_to_bytes(AppArgs.model_fields["retry_body_mib"].default)).items() if name not in os.environ)
    return env


def _serve_ray(args: argparse.Namespace) -> None:
    """Subprocess: a fresh local Ray cluster serving the app (``/``), the direct ingress
    (``/direct``) and, with ``--echo``, the echo ceiling (``/echo``, ``--replicas`` replicas:
    ``bench.echo``); prints READY, answers ``stats <model>`` lines, shuts down at EOF.
    ``--scratch``: the folder ``ray_env`` was made for, whose environment came with the process
    (``Server``): set here it would come after this module imported Ray Serve (through
    ``bench.echo``), whose defaults read at import (a handle's transport) would stay the old ones."""
    scratch = Path(args.scratch)
    import ray
    from ray import serve

    from deployments.app import run_applications
    from deployments.grpc_service import SERVE_SERVICER

    hooks = {"worker_process_setup_hook": "bench.batch_trace.install"} if (
        os.environ.get(batch_trace.ENV) or os.environ.get(gpu_standin.ENV) or os.environ.get(stage_cpu.ENV)) else None
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
             runtime_env=hooks)
    try:
        serve_grpc = args.grpc_port and args.grpc_front == "haproxy" and os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1"
        serve.start(http_options={"host": "127.0.0.1", "port": args.port}, grpc_options={  # as deployments.run
            "port": args.grpc_port, "grpc_servicer_functions": [SERVE_SERVICER]} if serve_grpc else None)
        router = {"num_replicas": args.replicas, "num_cpus": 0.1, "max_ongoing_requests": 1024}
        app_args = json.loads(args.app_args) if args.app_args else {"repository": args.repository, "router": router}
        app_args.setdefault("backend", args.backend)
        if args.models:
            app_args["models"] = args.models.split(",")
        if args.grpc_port:
            app_args["grpc_port"] = args.grpc_port
        # the router's, and each dedicated model's at /v2/models/<name> (--two-hop: no prefix)
        run_applications(app_args, "models", "/", one_hop=not args.two_hop)
        if args.echo:
            serve.run(echo.app(args.replicas), name=echo.APP_NAME, route_prefix=echo.ROUTE_PREFIX)
        if args.direct:
            serve.run(_direct_ingress(serve).options(num_replicas=args.replicas).bind(
                args.repository, args.direct.split(",")), name="direct", route_prefix="/direct")
        base = f"http://127.0.0.1:{args.port}"
        _wait_ready(f"{base}/v2/health/ready")
        if args.direct:
            _wait_ready(f"{base}/direct/v2/health/ready")
        if args.echo:
            _wait_ready(f"{base}{echo.ROUTE_PREFIX}/v2/health/ready")
        print("READY", flush=True)
        asyncio.run(_answer_stats(serve))
    except RuntimeError:
        for app in serve.status().applications.values():
            for name, d in app.deployments.items():
                print(f"{name}: {d.status}: {d.message[-2000:]}", file=sys.stderr)
        raise
    finally:
        # No serve.shutdown(): it waits 30 s for HAProxy to drain; the whole cluster goes anyway.
        ray.shutdown()
        _stop_leftovers(scratch)
        shutil.rmtree(scratch, ignore_errors=True)


def _stop_leftovers(scratch: Path) -> None:
    """SIGTERM processes whose command line names ``scratch`` (this run's HAProxy, which can
    outlive its killed manager actor), by pid."""
    marker = str(scratch).encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if marker in (proc / "cmdline").read_bytes():
                os.kill(int(proc.name), signal.SIGTERM)


async def _answer_stats(serve: Any) -> None:
    """Answer ``stats <model>`` lines on stdin with the model's batch counters, until EOF.
    Handles are used inside this one event loop (in Ray's throughput-optimized mode a
    handle's router runs on the loop that made it)."""
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        words = line.split()
        if words[:1] == ["stats"]:
            handle = serve.get_deployment_handle(f"model-{words[1]}", app_name=f"models.{words[1]}")
            print(json.dumps(await handle.batching.remote()), flush=True)


def _direct_ingress(serve: Any) -> Any:
    """A Serve ingress whose replica runs the models itself (the single-process app inside a
    replica): HTTP -> model with no handle hop."""

    @serve.deployment(max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0.1})
    @serve.ingress()
    class DirectIngress:
        def __init__(self, repository: str, models: list[str]) -> None:
            from bench.single_process import create_app

            self.asgi = create_app(repository, models)

        def __serve_build_asgi_app__(self) -> Any:
            return self.asgi

    return DirectIngress


def _wait_ready(url: str, timeout_s: float = 300.0, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server for {url} exited with status {process.returncode}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready within {timeout_s:g} s")


@dataclass(frozen=True)
class Endpoint:
    """Where workloads go: ``kind`` labels them, ``url`` is the base URL (``/v2/...`` below it)."""

    kind: str
    url: str


class Server:
    """A server subprocess: the Ray app (``kind='ray'``) or the single process."""

    def __init__(self, kind: str, repository: Path, ray_config: str = "fast", replicas: int = 1,
                 models: Sequence[str] = (), direct: Sequence[str] = (),
                 app_args: dict[str, Any] | None = None, backend: str = "auto", echo: bool = False,
                 one_hop: bool = True, grpc_port: int | None = None, grpc_front: str = "haproxy") -> None:
        """``app_args``: the Ray application's args as they stand (e.g. ``serve_config.yaml``'s),
        instead of ``repository`` with ``replicas`` router replicas. ``echo``: also serve the
        echo ceiling at ``/echo`` with ``replicas`` replicas (Ray only). ``one_hop`` False: the
        dedicated models' applications get no route prefix, so the router answers their routes
        and calls them through its handles (the path before one hop; Ray only). ``grpc_port``:
        the port of the KServe v2 gRPC front door (Ray only; default the app's, 8001);
        ``grpc_front``: ``haproxy``, as ``make serve`` serves it (Serve's gRPC, HAProxy reading
        each ModelInfer's model name, where ``ray_config`` runs HAProxy), or ``router`` (each
        router replica's own gRPC server, the body through HAProxy's HTTP frontend)."""
        self.kind, self.ray_config = kind, ray_config
        self.echo = echo and kind == "ray"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if kind == "ray":
            cmd = [sys.executable, "-m", "bench.throughput", "_serve-ray", "--repository", str(repository),
                   "--port", str(self.port), "--ray-config", ray_config, "--replicas", str(replicas),
                   "--backend", backend]
            cmd += ["--models", ",".join(models)] if models else []
            cmd += ["--direct", ",".join(direct)] if direct else []
            cmd += ["--app-args", json.dumps(app_args)] if app_args else []
            cmd += ["--echo"] if echo else []
            cmd += [] if one_hop else ["--two-hop"]
            cmd += ["--grpc-port", str(grpc_port), "--grpc-front", grpc_front] if grpc_port else []
            # The cluster's environment set before the server's Python starts, as ``make serve``
            # does: Ray Serve reads some of it once, when imported (the transport of the handles
            # the server process makes).
            scratch = Path(tempfile.mkdtemp(prefix="bench-ray-"))
            self.process = subprocess.Popen(cmd + ["--scratch", str(scratch)], cwd=ROOT, stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, text=True, start_new_session=True,
                                            env={**os.environ, **ray_env(ray_config, scratch)})
            if self._reply() != "READY":
                self.close()
                raise RuntimeError("the Ray server did not start; its stderr is above")
        else:
            cmd = [sys.executable, "-m", "bench.single_process", "--repository", str(repository),
                   "--port", str(self.port), "--backend", backend] + (["--models", ",".join(models)] if models else [])
            self.process = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)
            _wait_ready(f"{self.url}/v2/health/ready", process=self.process)

    @property
    def echo_endpoint(self) -> Endpoint | None:
        """The echo ceiling in this server's cluster (``bench.echo``), or None."""
        return Endpoint("echo", self.url + echo.ROUTE_PREFIX) if self.echo else None

    def _reply(self) -> str:
        """The server's next protocol line (READY or JSON); anything else printed is passed on."""
        for line in self.process.stdout:
            if line.startswith(("READY", "{")):
                return line.strip()
            sys.stderr.write(line)
        return ""

    def batch_stats(self, model: str) -> dict[str, Any]:
        self.process.stdin.write(f"stats {model}\n")
        self.process.stdin.flush()
        return json.loads(self._reply())

    def close(self) -> None:
        if self.process.poll() is not None:
            return
        if self.process.stdin is not None:
            self.process.stdin.close()  # the Ray server shuts its cluster down at EOF
        else:
            self.process.terminate()
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGTERM)  # its own process group (start_new_session)
            self.process.wait(timeout=30)

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def ocr_workload(label: str, base_url: str) -> Workload:
    """The OCR pipeline on ``OCR_IMAGE``: one PNG per request (JSON, base64 BYTES), text out;
    every answer must read the image's lines (``OCR_LINES``)."""
    data = base64.b64encode(OCR_IMAGE.read_bytes()).decode()
    body = json.dumps({"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES",
                                   "parameters": {"content_type": "base64"}, "data": [data]}],
                       "outputs": [{"name": "text"}]}).encode()
    lines = np.array([line.encode() for line in OCR_LINES], dtype=object)
    expected = Expected.of({"text": lines}, {"text": "BYTES"}, sample_every=1)
    return Workload(label, f"{base_url.rstrip('/')}/v2/models/ocr/infer", body,
                    {"Content-Type": "application/json"}, expected)


# --- scenarios -------------------------------------------------------------------------------

class Bench:
    def __init__(self, args: argparse.Namespace, repository: Path) -> None:
        self.args, self.repository = args, repository
        self.results: dict[str, Any] = {}
        self.inputs = {m: np.random.default_rng(0).random(SHAPES[m], dtype=np.float32) for m in SHAPES}
        configs = {m: yaml.safe_load((repository / m / "config.yaml").read_text())
                   for m in os.listdir(repository)}
        self.input_names = {m: c["inputs"][0]["name"] for m, c in configs.items()}
        self.pipelines = {m for m, c in configs.items() if c.get("pipeline")}
        self.backend = args.backend
        self._expected: dict[str, Expected] = {}

    def workload(self, server: Server | Endpoint, model: str, binary: bool = True, prefix: str = "",
                 label: str | None = None) -> Workload:
        base = base_model(model)
        if base == "ocr":
            return ocr_workload(label or f"{server.kind}:{model}", server.url + prefix)
        return make_workload(label or f"{server.kind}:{model}", server.url + prefix, model,
                             self.input_names[model], self.inputs[base], binary, expected=self.expected(server, base))

    def expected(self, server: Server | Endpoint, base: str) -> Expected:
        """What each answer of ``base``'s workload must hold: the echo's fixed answer, else the
        model file's own output for ``self.inputs[base]`` (``loadgen.expected_from_onnx``;
        GPU answers within TF32's tolerance)."""
        if server.kind == "echo":
            return echo.expected()
        if base not in self._expected:
            tolerance = 1e-2 if self.backend != "onnxruntime" else 1e-4
            model_file = ROOT / "engines" / base / "1" / "model.onnx"
            self._expected[base] = expected_from_onnx(str(model_file), self.inputs[base], rtol=tolerance, atol=tolerance)
        return self._expected[base]

    def measure(self, plan: list[tuple[Workload, int]], duration_s: float | None = None) -> list[Result]:
        a = self.args
        return run(plan, duration_s or a.duration_s, a.warmup_s, a.processes)

    def log(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def alone(self, servers: dict[str, Server]) -> None:
        """Each model alone on each server, and on the Ray server's echo ceiling (same requests,
        same replica count) where it has one: ``of_echo`` = QPS / echo's QPS at that concurrency."""
        endpoints: dict[str, Server | Endpoint] = dict(servers)
        echo_endpoint = next((s.echo_endpoint for s in servers.values() if s and s.echo_endpoint), None)
        if echo_endpoint is not None:
            endpoints["echo"] = echo_endpoint
        rows = []
        for model in self.args.models:
            for name, server in endpoints.items():
                for r in sweep(self.workload(server, model), self.args.levels, self.args.duration_s,
                               self.args.warmup_s, self.args.processes):
                    rows.append({"server": name, "model": model, **asdict(r)})
                    self.log(f"alone {name:6} {model:10} c={r.concurrency:<3} {r.qps:8.1f} QPS  p50 {r.p50_ms} ms")
        echo_qps = {(r["model"], r["concurrency"]): r["qps"] for r in rows if r["server"] == "echo"}
        for row in rows:
            if row["server"] != "echo":
                row["of_echo"] = _ratio(row["qps"], echo_qps.get((row["model"], row["concurrency"])))
        self.results["alone"] = rows

    def _alone_qps(self, server: str, model: str, concurrency: int) -> float:
        for row in self.results.get("alone", []):
            if (row["server"], row["model"], row["concurrency"]) == (server, model, concurrency):
                return row["qps"]
        return float("nan")

    def together(self, servers: dict[str, Server]) -> None:
        c = self.args.together_concurrency
        models = self.args.models
        groups = [models[:2], models[:3]] if len(models) >= 3 else [models[:2]]
        rows = []
        for group in groups:
            for name, server in servers.items():
                results = self.measure([(self.workload(server, m), c) for m in group])
                alone = {m: self._alone_qps(name, m, c) for m in group}
                together = {m: r.qps for m, r in zip(group, results)}
                retention = sum(together.values()) / sum(alone.values())
                rows.append({"server": name, "models": group, "concurrency_each": c, "qps_alone": alone,
                             "qps_together": together, "retention": round(retention, 3),
                             "p50_ms": {m: r.p50_ms for m, r in zip(group, results)},
                             "errors": sum(r.errors for r in results)})
                self.log(f"together {name:6} {'+'.join(group)}: retention {retention:.2f}")
        self.results["together"] = rows

    def batching(self, ray_server: Server) -> None:
        rows = []
        for model in self.args.batched:
            for variant in (model, *batch_variants(model, self.args.padded, self.args.auto)):
                for level in self.args.batch_levels:
                    # the counters are one replica's (a handle call picks any): read with one only
                    counted = self.args.model_replicas == 1
                    before = ray_server.batch_stats(variant) if counted else {}
                    began = time.perf_counter()
                    (r,) = self.measure([(self.workload(ray_server, variant), level)])
                    after = ray_server.batch_stats(variant) if counted else {}
                    calls = sum(after.get("calls_by_requests", {}).values()) - sum(before.get("calls_by_requests", {}).values())
                    requests = after.get("requests", 0) - before.get("requests", 0)
                    row = {"model": model, "batched": variant != model,
                           "variant": variant.removeprefix(model).lstrip("_") or "unbatched", **asdict(r),
                           "requests_per_model_call": round(requests / calls, 2) if calls else None,
                           "padded_rows": after.get("padded_rows", 0) - before.get("padded_rows", 0) if counted else None}
                    if self.args.trace:
                        row["trace"] = batch_trace.summarize(
                            self.args.trace, began + self.args.warmup_s, began + self.args.warmup_s + self.args.duration_s)
                        self.log(json.dumps(row["trace"]))
                    rows.append(row)
                    self.log(f"batching {variant:18} c={level:<3} {r.qps:8.1f} QPS  p50 {r.p50_ms} ms")
            if ray_server.echo_endpoint is not None:  # the ceiling: the same requests, as many echo replicas
                for level in self.args.batch_levels:
                    (r,) = self.measure([(self.workload(ray_server.echo_endpoint, model), level)])
                    rows.append({"model": model, "batched": False, "variant": "echo", **asdict(r),
                                 "requests_per_model_call": None, "padded_rows": None})
                    self.log(f"batching {'echo':18} c={level:<3} {r.qps:8.1f} QPS  p50 {r.p50_ms} ms")
        self.results["batching"] = rows

    def payload(self, servers: dict[str, Server]) -> None:
        rows = []
        for name, server in servers.items():
            for binary in (False, True):
                workload = self.workload(server, "ocr_det", binary)
                (r,) = self.measure([(workload, self.args.payload_concurrency)], self.args.payload_duration_s)
                rows.append({"server": name, "encoding": "binary" if binary else "json",
                             "request_bytes": len(workload.body), **asdict(r)})
                self.log(f"payload {name:6} {'binary' if binary else 'json':6} {r.qps:8.2f} QPS  p50 {r.p50_ms} ms")
        self.results["payload"] = rows

    def hop(self, ray_server: Server, single: Server | None, models: Sequence[str]) -> list[dict[str, Any]]:
        """p50 at concurrency 1 of each path: ``router`` (the product's route, ``/``), ``direct``,
        ``echo`` (where the server has it) and ``single``; ``router_hop_ms`` = router - direct,
        ``added_over_single_ms`` = router - single (the product's added latency)."""
        rows = []
        for model in models:
            paths: list[tuple[str, Server | Endpoint, str]] = [("router", ray_server, ""), ("direct", ray_server, "/direct")]
            if ray_server.echo_endpoint is not None:
                paths.append(("echo", ray_server.echo_endpoint, ""))
            if single is not None:
                paths.append(("single", single, ""))
            p50 = {}
            for path, server, prefix in paths:
                (r,) = self.measure([(self.workload(server, model, prefix=prefix), 1)])
                p50[path] = r.p50_ms
            rows.append({"model": model, "ray_config": ray_server.ray_config, "p50_ms": p50,
                         "router_hop_ms": _difference(p50["router"], p50["direct"]),
                         "added_over_single_ms": _difference(p50["router"], p50.get("single"))})
            self.log(f"hop {model:10} {p50}")
        return rows

    def configs(self) -> None:
        rows = []
        model = self.args.hop_models[0]
        for config in self.args.ray_configs:
            with Server("ray", self.repository, config, models=[model], direct=[model]) as server:
                (hop,) = self.hop(server, None, [model])
                (r,) = self.measure([(self.workload(server, model), self.args.together_concurrency)])
                rows.append({"ray_config": config, "model": model, "p50_c1_ms": hop["p50_ms"],
                             "router_hop_ms": hop["router_hop_ms"], "concurrency": r.concurrency,
                             "qps": r.qps, "p50_ms": r.p50_ms, "p99_ms": r.p99_ms, "errors": r.errors})
                self.log(f"configs {config:13} {r.qps:8.1f} QPS hop {hop['router_hop_ms']} ms")
        self.results["configs"] = rows

    def scaleout(self, single: Server | None) -> None:
        rows = []
        c = self.args.scaleout_concurrency
        models = self.args.models
        if single is not None:
            rows += self._scaleout_row(single, "single", 1, models, c)
        for k in self.args.replicas:
            repo = prepare_repository(self.repository.parent / f"engines-k{k}", Path(self.args.repository),
                                      models, (), k, 0, self.args.gpu_fraction)
            with Server("ray", repo, self.args.ray_config, replicas=k, backend=self.backend, echo=True) as server:
                rows += self._scaleout_row(server, "ray", k, models, c)
                rows += self._scaleout_echo(server, k, models, c)
        ones = {(r["server"], r["models"]): r["qps_total"] for r in rows if r["replicas"] == 1}
        echo_qps = {(r["replicas"], r["models"]): r["qps_total"] for r in rows if r["server"] == "echo"}
        single_qps = {r["models"]: r["qps_total"] for r in rows if r["server"] == "single"}
        for row in rows:
            base = ones.get((row["server"], row["models"]))
            row["efficiency"] = round(row["qps_total"] / (row["replicas"] * base), 3) if base else None
            if row["server"] != "echo":
                row["of_echo"] = _ratio(row["qps_total"], echo_qps.get((row["replicas"], row["models"])))
            if row["server"] == "ray":
                row["x_single"] = _ratio(row["qps_total"], single_qps.get(row["models"]))
        self.results["scaleout"] = rows

    def _measure_cpu(self, plan: list[tuple[Workload, int]], pids: list[int]) -> tuple[list[Result], dict[str, Any]]:
        """``measure`` with the CPU it cost (``CpuSampler`` over the measured window): the
        machine's busy cores, the serving processes' (``pids``) cores and their CPU ms per request."""
        with CpuSampler(pids) as cpu:
            results = self.measure(plan)
        machine, serving = cpu.window(self.args.duration_s)
        qps = sum(r.qps for r in results)
        return results, {"machine_busy_cores": machine, "serving_cores": serving,
                         "serving_cpu_ms_per_request": round(serving * 1e3 / qps, 3) if qps else None}

    def _scaleout_echo(self, server: Server, k: int, models: Sequence[str], c: int) -> list[dict]:
        """The echo ceiling (``k`` replicas) under each model's requests at ``c`` clients."""
        rows = []
        for model in models:
            (r,), cpu = self._measure_cpu([(self.workload(server.echo_endpoint, model), c)],
                                          replica_pids(server.process.pid, echo.APP_NAME, "Echo"))
            rows.append({"server": "echo", "replicas": k, "models": model, "concurrency_each": c,
                         "qps_total": r.qps, "p50_ms": r.p50_ms, "p99_ms": r.p99_ms, "errors": r.errors, **cpu})
            self.log(f"scaleout echo k={k} {model}: {r.qps:.1f} QPS {cpu}")
        return rows

    def _serving_pids(self, server: Server, model: str) -> list[int]:
        """The processes that serve ``model``: the single process, or the model's replicas."""
        if server.kind != "ray":
            return [server.process.pid]
        from deployments.client import deployment_name

        return replica_pids(server.process.pid, "models", deployment_name(model, model in self.pipelines))

    def _scaleout_row(self, server: Server, name: str, k: int, models: Sequence[str], c: int) -> list[dict]:
        rows, alone_total = [], {}
        for model in models:
            (r,), cpu = self._measure_cpu([(self.workload(server, model), c)], self._serving_pids(server, model))
            alone_total[model] = r.qps
            rows.append({"server": name, "replicas": k, "models": model, "concurrency_each": c,
                         "qps_total": r.qps, "p50_ms": r.p50_ms, "p99_ms": r.p99_ms, "errors": r.errors, **cpu})
            self.log(f"scaleout {name} k={k} {model}: {r.qps:.1f} QPS {cpu}")
        if len(models) < 2:  # "together" would repeat the row above under the same key
            return rows
        results = self.measure([(self.workload(server, m), c) for m in models])
        total = sum(r.qps for r in results)
        rows.append({"server": name, "replicas": k, "models": "+".join(models), "concurrency_each": c,
                     "qps_total": round(total, 2), "qps": {m: r.qps for m, r in zip(models, results)},
                     "retention": round(total / sum(alone_total.values()), 3),
                     "errors": sum(r.errors for r in results)})
        self.log(f"scaleout {name} k={k} together: {total:.1f} QPS")
        return rows

    def pool(self) -> None:
        """The ``pool`` scenario (module docstring): per router replica count r, one cluster
        serving ``--pool-model`` both ways and the echo ceiling, each at every
        ``--pool-concurrency``."""
        a = self.args
        model, copies = a.pool_model, pool_copies(a.pool_model, a.pool_replicas)
        x = np.random.default_rng(0).random(SHAPES[model], dtype=np.float32)
        rows: list[dict[str, Any]] = []
        try:
            self._pool_clusters(a, model, copies, x, rows)
        finally:  # the points measured so far survive a cluster that does not start
            self.results["pool"] = pool_ratios(rows)

    def _pool_clusters(self, a: argparse.Namespace, model: str, copies: list[str], x: Any,
                       rows: list[dict[str, Any]]) -> None:
        """``pool``'s clusters, appending each point to ``rows`` as it is measured."""
        for r in a.router_replicas:
            repo = prepare_pool_repository(self.repository.parent / f"engines-pool-r{r}", Path(a.repository),
                                           model, len(copies), a.pool_replicas, a.gpu_fraction)
            app_args = {"repository": str(repo), "backend": self.backend,
                        "router": {"num_replicas": r, "num_cpus": 0.1, "max_ongoing_requests": 1024,
                                   "max_queued_requests": 1024},
                        "pool": {"num_replicas": a.pool_replicas, "num_gpus": a.gpu_fraction,
                                 "max_num_models_per_replica": len(copies), "memory_budget_mib": None}}
            name = self.input_names.get(model) or yaml.safe_load(
                (repo / model / "config.yaml").read_text())["inputs"][0]["name"]
            for one_hop in (False, True):
                with Server("ray", repo, a.ray_config, replicas=r, backend=self.backend, app_args=app_args,
                            echo=not one_hop, one_hop=one_hop) as server:
                    expected = self.expected(server, model)
                    pooled = [make_workload(f"pool:{c}", server.url, c, name, x, True, expected=expected) for c in copies]
                    self._place_copies(pooled)
                    dedicated = [make_workload("model", server.url, model, name, x, True, expected=expected)]
                    paths = {"pool_one_hop": (pooled, "pool"), "one_hop": (dedicated, f"model-{model}")} if one_hop else {
                        "pool": (pooled, "pool"), "two_hop": (dedicated, f"model-{model}"),
                        "echo": ([make_workload("echo", server.echo_endpoint.url, model, name, x, True,
                                                  expected=echo.expected())], None)}
                    for c in a.pool_concurrency:
                        for path, (workloads, backend) in paths.items():
                            row = self._pool_point(server, path, workloads, backend, r, c)
                            rows.append(row)
                            self.log(f"pool r={r} c={c} {path:12} {row['qps']:8.1f} QPS  router "
                                     f"{row['router_cpu_us_per_request']} us CPU/request")

    def _place_copies(self, workloads: list[Workload]) -> None:
        """One request to each pool copy in turn, a second apart: through the router, Serve's
        multiplexed routing sends a model seen nowhere yet to a replica with the fewest models,
        once it knows where the previous copies went, so each copy lands on a replica of its own;
        in one hop HAProxy's hash of the copy's name places it (two may share a replica, and
        under load the bounded hash spills to the others: ``model_cpu_shares`` says)."""
        for w in workloads:
            run([(w, 1)], duration_s=0.2, warmup_s=0.0)
            time.sleep(1.0)

    def _pool_point(self, server: Server, path: str, workloads: list[Workload], backend: str | None,
                    r: int, c: int) -> dict[str, Any]:
        """One point of ``pool``: ``c`` clients over ``workloads`` (split evenly), a warm-up run,
        then the measured one with the CPU seconds of the router replicas and of ``backend``'s
        replicas (None: not read) read from /proc before and after."""
        a = self.args
        session = server.process.pid  # the server runs in its own session (start_new_session)
        plan = list(zip(workloads, split_clients(c, len(workloads))))
        run(plan, duration_s=max(a.warmup_s, 0.5), warmup_s=0.0, processes=a.processes)
        routers = replica_pids(session, "models", "router") if path != "echo" else []
        backends = replica_pids(session, "models", backend) if backend else []
        before = {pid: cpu_seconds(pid) for pid in routers + backends}
        start = time.perf_counter()
        results = run(plan, duration_s=a.duration_s, warmup_s=0.0, processes=a.processes)
        wall_s = time.perf_counter() - start
        used = {pid: cpu_seconds(pid) - t for pid, t in before.items()}
        requests = sum(res.requests for res in results)
        qps = round(sum(res.qps for res in results), 2)
        router_s = sum(used[pid] for pid in routers)
        return {"path": path, "router_replicas": r, "pool_replicas": a.pool_replicas, "concurrency": c,
                "qps": qps, "qps_per_router_replica": round(qps / r, 2),
                "p50_ms": max((res.p50_ms for res in results if res.p50_ms is not None), default=None),
                "p99_ms": max((res.p99_ms for res in results if res.p99_ms is not None), default=None),
                "errors": sum(res.errors for res in results), "requests": requests,
                "router_cpu_us_per_request": round(router_s / requests * 1e6, 1) if routers and requests else None,
                "router_cpu_busiest": round(max(used[pid] for pid in routers) / wall_s, 3) if routers else None,
                "model_cpu_busiest": round(max(used[pid] for pid in backends) / wall_s, 3) if backends else None,
                # each model replica's share, busiest first: an idle pool replica means two copies share one
                "model_cpu_shares": sorted((round(used[pid] / wall_s, 3) for pid in backends), reverse=True),
                "qps_by_workload": {res.label: res.qps for res in results}}


def pool_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` of the ``pool`` scenario with, for each non-echo row, ``x_router`` (its QPS per
    router replica / the ``two_hop`` row's at the same router replicas and clients: the same
    replica count, so the ratio of QPS) and ``of_echo`` (QPS / the echo row's there)."""
    by_point = {(row["path"], row["router_replicas"], row["concurrency"]): row["qps"] for row in rows}
    out = []
    for row in rows:
        point = (row["router_replicas"], row["concurrency"])
        extra = {}
        if row["path"] != "echo":
            extra["x_router"] = _ratio(row["qps"], by_point.get(("two_hop", *point)))
            extra["of_echo"] = _ratio(row["qps"], by_point.get(("echo", *point)))
        out.append({**row, **extra})
    return out


def _ratio(qps: float, ceiling: float | None) -> float | None:
    return round(qps / ceiling, 3) if ceiling else None


def _difference(a_ms: float | None, b_ms: float | None) -> float | None:
    return round(a_ms - b_ms, 3) if a_ms is not None and b_ms is not None else None


# --- report ----------------------------------------------------------------------------------

def _table(headers: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.2f}" if abs(v) < 100 else f"{v:,.0f}"
        return "-" if v is None else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    out = ["# Throughput: Ray Serve app vs single process\n",
           f"`{meta['command']}` on {meta['machine']} ({meta['cpus']} CPUs), Ray {meta['ray']}, "
           f"ONNX Runtime {meta['onnxruntime']}, Ray config `{meta['ray_config']}`, "
           f"{meta['duration_s']} s per point after {meta['warmup_s']} s warm-up, "
           f"{meta['processes']} client process(es), binary tensors unless noted.\n"]
    if "alone" in results:
        out.append("## Each model alone (closed loop; of echo = QPS / the echo ceiling's QPS)\n")
        out.append(_table(["model", "server", "concurrency", "QPS", "p50 ms", "p90 ms", "p99 ms", "errors", "of echo"],
                          [[r["model"], r["server"], r["concurrency"], r["qps"], r["p50_ms"], r["p90_ms"],
                            r["p99_ms"], r["errors"], r.get("of_echo")] for r in results["alone"]]))
    if "together" in results:
        out.append("\n## Models together (retention = QPS together / sum of QPS alone)\n")
        out.append(_table(["models", "server", "concurrency each", "QPS alone", "QPS together", "retention"],
                          [["+".join(r["models"]), r["server"], r["concurrency_each"],
                            " / ".join(f"{v:.0f}" for v in r["qps_alone"].values()),
                            " / ".join(f"{v:.0f}" for v in r["qps_together"].values()), r["retention"]]
                           for r in results["together"]]))
    if "batching" in results:
        out.append("\n## Dynamic batching (Ray), unbatched vs batched\n")
        out.append(_table(["model", "variant", "concurrency", "QPS", "p50 ms", "p99 ms", "requests / model call",
                           "padded rows", "replica: ms per batch call p50", "replica: engine ms p50"],
                          [[r["model"], r.get("variant", "batched" if r["batched"] else "unbatched"), r["concurrency"],
                            r["qps"], r["p50_ms"], r["p99_ms"], r["requests_per_model_call"], r.get("padded_rows"),
                            r.get("trace", {}).get("stage_ms", {}).get("batch_call", {}).get("p50"),
                            r.get("trace", {}).get("stage_ms", {}).get("engine", {}).get("p50")]
                           for r in results["batching"]]))
    if "payload" in results:
        out.append("\n## JSON vs binary, ocr_det (1, 3, 640, 640) FP32\n")
        out.append(_table(["server", "encoding", "request bytes", "concurrency", "QPS", "p50 ms", "p99 ms"],
                          [[r["server"], r["encoding"], r["request_bytes"], r["concurrency"], r["qps"],
                            r["p50_ms"], r["p99_ms"]] for r in results["payload"]]))
    if "hop" in results:
        out.append("\n## Hops: p50 at concurrency 1\n")
        out.append(_table(["model", "echo (HTTP->echo replica) ms", "product (`/v2/models/<m>/infer`) ms",
                           "direct (HTTP->model replica) ms", "single process ms", "product - single ms",
                           "product - direct ms"],
                          [[r["model"], r["p50_ms"].get("echo"), r["p50_ms"]["router"], r["p50_ms"]["direct"],
                            r["p50_ms"].get("single"), r.get("added_over_single_ms"), r["router_hop_ms"]]
                           for r in results["hop"]]))
    if "configs" in results:
        out.append("\n## Ray ingress / handle configurations\n")
        out.append(_table(["config", "model", "router hop ms (c=1)", "router p50 ms (c=1)", "concurrency",
                           "QPS", "p50 ms", "p99 ms", "errors"],
                          [[r["ray_config"], r["model"], r["router_hop_ms"], r["p50_c1_ms"]["router"],
                            r["concurrency"], r["qps"], r["p50_ms"], r["p99_ms"], r["errors"]]
                           for r in results["configs"]]))
    if "scaleout" in results:
        out.append("\n## Scale-out (efficiency = QPS(k) / (k x QPS(1)); retention = together / sum alone; "
                   "of echo = QPS / the echo ceiling's QPS at the same k and clients; x single = QPS / the "
                   "single process's)\n")
        out.append(_table(["server", "replicas k", "models", "concurrency each", "QPS", "p50 ms", "p99 ms",
                           "efficiency", "retention", "of echo", "x single", "machine cores busy",
                           "serving cores", "serving CPU ms / request"],
                          [[r["server"], r["replicas"], r["models"], r["concurrency_each"], r["qps_total"],
                            r.get("p50_ms"), r.get("p99_ms"), r["efficiency"], r.get("retention"),
                            r.get("of_echo"), r.get("x_single"), r.get("machine_busy_cores"),
                            r.get("serving_cores"), r.get("serving_cpu_ms_per_request")]
                           for r in results["scaleout"]]))
    if "pool" in results:
        out.append("\n## A pool model through the router (pool: HTTP -> router -> pool replica, body passed "
                   "through; two_hop: the same model as a dedicated model reached through the router, "
                   "today's router path before one hop; echo: the ceiling with as many replicas as routers; "
                   "in a second cluster with route prefixes, pool_one_hop: HAProxy -> the pool replica the "
                   "model's name hashes to, and one_hop: the dedicated model; "
                   "x router = pool QPS per router replica / two_hop's; CPU busiest = the busiest replica's "
                   "CPU seconds per second)\n")
        out.append(_table(["path", "router replicas", "pool / model replicas", "concurrency", "QPS",
                           "QPS per router replica", "p50 ms", "p99 ms", "errors", "router CPU us / request",
                           "router CPU busiest", "model CPU busiest", "x router", "of echo"],
                          [[r["path"], r["router_replicas"], r["pool_replicas"], r["concurrency"], r["qps"],
                            r["qps_per_router_replica"], r["p50_ms"], r["p99_ms"], r["errors"],
                            r["router_cpu_us_per_request"], r["router_cpu_busiest"], r["model_cpu_busiest"],
                            r.get("x_router"), r.get("of_echo")] for r in results["pool"]]))
    return "\n".join(out) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    if "alone" in results:
        models = sorted({r["model"] for r in results["alone"]})
        panels += [("alone", m) for m in models]
    if "scaleout" in results:
        panels.append(("scaleout", None))
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False)
    for ax, (kind, model) in zip(axes[0], panels):
        if kind == "alone":
            for server in sorted({r["server"] for r in results["alone"]}):
                rows = [r for r in results["alone"] if r["model"] == model and r["server"] == server]
                ax.plot([r["concurrency"] for r in rows], [r["qps"] for r in rows], marker="o", label=server)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
            ax.set_title(f"{model} alone")
        else:
            for server, style in (("ray", "-"), ("echo", "--")):
                server_rows = [r for r in results["scaleout"] if r["server"] == server]
                for models in sorted({r["models"] for r in server_rows}):
                    rows = [r for r in server_rows if r["models"] == models]
                    ax.plot([r["replicas"] for r in rows], [r["qps_total"] for r in rows], style, marker="o",
                            label=models if server == "ray" else f"echo ({models})")
            ax.set_xlabel("replicas per model")
            ax.set_title("scale-out (Ray)")
        ax.set_ylabel("QPS")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# --- main ------------------------------------------------------------------------------------

def write_results(out: Path, prefix: str, results: dict[str, Any], report: str) -> tuple[Path, str]:
    """``results`` as ``<out>/<prefix>-<time>.json`` and ``report`` beside it as ``.md``;
    returns the path without suffix and ``report``."""
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2))
    stem.with_suffix(".md").write_text(report)
    return stem, report


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer points, shorter windows (a couple of minutes)")
    p.add_argument("--scenarios", help=f"comma-separated subset of {','.join(SCENARIOS)}")
    p.add_argument("--repository", default=str(ROOT / "engines"), help="source model repository")
    p.add_argument("--models", default="ocr_cls,tiny_cnn,resnet18")
    p.add_argument("--batched", default="ocr_cls,resnet18", help="models also served with dynamic batching")
    p.add_argument("--max-queue-delay-ms", type=float, default=2.0)
    p.add_argument("--ray-config", default="fast", choices=RAY_CONFIGS, help="Ray config of the main run")
    p.add_argument("--ray-configs", default=",".join(RAY_CONFIGS), help="configs compared by 'configs'")
    p.add_argument("--replicas", default="1,2,4", help="replica counts for 'scaleout'")
    p.add_argument("--model-replicas", type=int, default=1,
                   help="replicas of each model (and of its batched copies) in the main run: alone, together, batching...")
    p.add_argument("--router-replicas", default="1,2,4", help="router replica counts for 'pool'")
    p.add_argument("--pool-replicas", type=int, default=4,
                   help="'pool': pool replicas (one copy of --pool-model each) and the dedicated model's replicas")
    p.add_argument("--pool-model", default="tiny_cnn", choices=sorted(SHAPES), help="the model of 'pool'")
    p.add_argument("--pool-concurrency", default="64,128", help="client counts of 'pool'")
    p.add_argument("--levels", help="concurrency sweep for 'alone' (default 1..64; quick 1,16)")
    p.add_argument("--together-concurrency", type=int, default=16)
    p.add_argument("--scaleout-concurrency", type=int, default=64)
    p.add_argument("--duration-s", type=float)
    p.add_argument("--warmup-s", type=float)
    p.add_argument("--processes", type=int, default=1, help="load generator processes")
    p.add_argument("--backend", default="auto", help="every server's backend: auto | onnxruntime | onnxruntime_cuda")
    p.add_argument("--gpu-fraction", type=float, default=0.0,
                   help="num_gpus of each model replica (0: none reserved; e.g. 0.04 for 8 replicas of 3 models on one GPU)")
    p.add_argument("--batch-levels", help="concurrencies of 'batching' (default 1 and --together-concurrency)")
    p.add_argument("--preferred-batch-size", default="", help="preferred_batch_size of the batched copies")
    p.add_argument("--auto", action="store_true",
                   help="'batching' also serves <model>_auto: dynamic_batching without preferred sizes, "
                        "pad_to_preferred auto (as a config that sets neither)")
    p.add_argument("--padded", action="store_true",
                   help="'batching' also serves <model>_padded: batched AND padded to the preferred sizes (default [8])")
    p.add_argument("--standin", default="",
                   help="models served by bench.gpu_standin (a GPU-like wait, no compute; benchmark only)")
    p.add_argument("--trace", action="store_true",
                   help="'batching': timestamps along the replica's path (bench.batch_trace) per point")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = p.parse_args(argv)
    a.command = "python -m bench.throughput " + " ".join(argv)
    a.models = a.models.split(",")
    a.batched = [m for m in a.batched.split(",") if m]
    a.ray_configs = a.ray_configs.split(",")
    a.replicas = _ints(a.replicas)
    a.router_replicas = _ints(a.router_replicas)
    a.pool_concurrency = _ints(a.pool_concurrency)
    default_scenarios = [s for s in SCENARIOS if s not in ("scaleout", "pool") + (("configs",) if a.quick else ())]
    a.scenarios = a.scenarios.split(",") if a.scenarios else default_scenarios
    a.levels = _ints(a.levels) if a.levels else ([1, 16] if a.quick else [1, 2, 4, 8, 16, 32, 64])
    if a.together_concurrency not in a.levels and "together" in a.scenarios:
        a.levels = sorted(set(a.levels) | {a.together_concurrency})
    a.duration_s = a.duration_s or (2.0 if a.quick else 10.0)
    a.warmup_s = a.warmup_s if a.warmup_s is not None else (1.0 if a.quick else 2.0)
    a.batch_levels = _ints(a.batch_levels) if a.batch_levels else [1, a.together_concurrency]
    a.preferred_batch_size = _ints(a.preferred_batch_size) if a.preferred_batch_size else []
    a.payload_concurrency = 2
    a.payload_duration_s = max(a.duration_s, 4.0)
    a.hop_models = [m for m in ("ocr_cls", "tiny_cnn") if m in a.models][: 1 if a.quick else 2] or a.models[:1]
    return a


def _meta(a: argparse.Namespace) -> dict[str, Any]:
    import onnxruntime
    import ray

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    return {"command": a.command, "machine": cpu, "cpus": os.cpu_count(), "ray": ray.__version__,
            "onnxruntime": onnxruntime.__version__, "python": platform.python_version(),
            "ray_config": a.ray_config, "backend": a.backend, "gpu_fraction": a.gpu_fraction, "model_replicas": a.model_replicas, "duration_s": a.duration_s, "warmup_s": a.warmup_s,
            "processes": a.processes, "scenarios": a.scenarios, "standin": a.standin, "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def main(argv: Sequence[str]) -> None:
    if argv[:1] == ["_serve-ray"]:
        p = argparse.ArgumentParser()
        for flag in ("--repository", "--ray-config", "--direct", "--models", "--app-args"):
            p.add_argument(flag)
        p.add_argument("--scratch", required=True)
        p.add_argument("--backend", default="auto")
        p.add_argument("--port", type=int)
        p.add_argument("--replicas", type=int, default=1)
        p.add_argument("--grpc-port", type=int)
        p.add_argument("--grpc-front", choices=("haproxy", "router"), default="haproxy")
        p.add_argument("--echo", action="store_true")
        p.add_argument("--two-hop", action="store_true")
        _serve_ray(p.parse_args(argv[1:]))
        return
    a = parse_args(argv)
    os.environ["ORT_INTRA_OP_THREADS"] = "1"
    if a.standin:
        os.environ[gpu_standin.ENV] = ",".join(m + s for m in a.standin.split(",")
                                               for s in ("", *VARIANT_SUFFIXES))
    a.trace = Path(tempfile.mkdtemp(prefix="bench-trace-")) if a.trace else None
    if a.trace:
        os.environ[batch_trace.ENV] = str(a.trace)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    scratch = Path(tempfile.mkdtemp(prefix="bench-repo-"))
    needs_main = set(a.scenarios) & {"alone", "together", "batching", "payload", "hop"}
    models = list(dict.fromkeys(a.models + a.batched + (["ocr_det"] if "payload" in a.scenarios else [])
                                + a.hop_models))
    repository = prepare_repository(scratch / "engines", Path(a.repository), models, a.batched, a.model_replicas,
                                    a.max_queue_delay_ms, a.gpu_fraction, a.preferred_batch_size, a.padded, a.auto)
    bench = Bench(a, repository)
    results: dict[str, Any] = {"meta": _meta(a)}
    try:
        with contextlib.ExitStack() as stack:
            single = stack.enter_context(Server("single", repository, backend=a.backend, models=a.models + (
                ["ocr_det"] if "payload" in a.scenarios else []))) if set(a.scenarios) - {"batching", "configs", "pool"} else None
            if needs_main:
                # with --model-replicas k > 1, the echo ceiling for 'batching' too, with k replicas
                # (as many router replicas: one-hop models do not cross them)
                ray_server = stack.enter_context(Server("ray", repository, a.ray_config, replicas=a.model_replicas,
                                                        backend=a.backend,
                                                        direct=a.hop_models if "hop" in a.scenarios else (),
                                                        echo=bool({"alone", "hop"} & set(a.scenarios))
                                                        or ("batching" in a.scenarios and a.model_replicas > 1)))
                servers = {"ray": ray_server, "single": single}
                for scenario in ("alone", "together", "payload"):
                    if scenario in a.scenarios:
                        getattr(bench, scenario)(servers)
                if "batching" in a.scenarios:
                    bench.batching(ray_server)
                if "hop" in a.scenarios:
                    bench.results["hop"] = bench.hop(ray_server, single, a.hop_models)
                ray_server.close()
            if "scaleout" in a.scenarios:
                bench.scaleout(single)
        if "configs" in a.scenarios:
            bench.configs()
        if "pool" in a.scenarios:
            bench.pool()
    finally:
        results.update(bench.results)
        stem, report = write_results(Path(a.out), "throughput", results, markdown(results))
        with contextlib.suppress(Exception):
            plot(results, stem.with_suffix(".png"))
        shutil.rmtree(scratch, ignore_errors=True)
        print(report)
        print(f"wrote {stem}.json, .md, .png", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
