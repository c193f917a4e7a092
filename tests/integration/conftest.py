"""One real Ray Serve instance on 127.0.0.1 for every integration test in the session."""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests
import yaml

ROOT = Path(__file__).resolve().parents[2]
REPOSITORY = str(ROOT / "engines")


def _free_port() -> int:
    """A port free now, between Ray's worker ports (10002-19999 by default) and the kernel's
    ephemeral range: a port the kernel handed out (bind to port 0) can be handed out again to
    one of Ray's own gRPC servers before the test's server binds it, and gRPC sets SO_REUSEPORT,
    so both then listen on it and the kernel splits the connections: a tritonclient.grpc call
    reached a server of Ray's and answered UNIMPLEMENTED (test_ports, once on a busy machine)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, max(20001, low))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in 20000-{low - 1}")


def runner_config(folder: Path, **args) -> tuple[Path, int]:
    """``serve_config.yaml`` for ``make serve``'s runner in ``folder``: the router application's
    args updated with ``args`` (a dict merged into the arg's own, e.g. ``pool={"num_gpus": 0}``;
    the metrics and gRPC on free ports, so a developer's ``make serve`` on 8001 and a test's
    server never meet), the HTTP port free, and the models' applications written again
    for those args (``deployments.check.write``); returns (its path, the HTTP port)."""
    from deployments.check import write

    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    port = _free_port()
    config["http_options"]["port"] = port
    config["applications"] = [app := config["applications"][0]]  # the models' are written below
    for name, value in {"metrics": {"port": _free_port()}, "grpc_port": _free_port(), **args}.items():
        given = app["args"].get(name)
        app["args"][name] = dict(given, **value) if isinstance(given, dict) and isinstance(value, dict) else value
    path = folder / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    write(path)
    return path, port


@pytest.fixture(scope="session")
def serve_instance():
    """A local Ray cluster and Serve's HTTP proxy on a free loopback port; yields the base URL."""
    import ray
    from ray import serve

    port = _free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"ORT_INTRA_OP_THREADS": "1"}})
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def grpc_port() -> int:
    """The free loopback port the session's router replicas serve gRPC on (``server``)."""
    return _free_port()


@pytest.fixture(scope="session")
def server(serve_instance, grpc_port):
    """The application of serve_config.yaml over the real repository, served at ``/``; gRPC
    on ``grpc_port``."""
    from deployments.app import run_applications

    run_applications({"repository": REPOSITORY, "pool": {"max_num_models_per_replica": 2}, "grpc_port": grpc_port},
              name="models", route_prefix="/")
    wait_ready(serve_instance)
    return serve_instance


@pytest.fixture(scope="session")
def grpc_url(server, grpc_port) -> str:
    """``127.0.0.1:<grpc_port>`` once the router's gRPC server answers ServerLive."""
    import tritonclient.grpc as grpcclient

    url = f"127.0.0.1:{grpc_port}"
    deadline = time.monotonic() + 60
    with grpcclient.InferenceServerClient(url) as client:
        while True:
            try:
                if client.is_server_live(client_timeout=5):
                    return url
            except Exception:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.2)


def wait_ready(url: str, timeout_s: float = 120.0) -> None:
    """Poll ``/v2/health/ready`` until 200 (every dedicated model answered); an answer slower
    than its 5 s (a busy machine) or a refused connection counts as not yet."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{url}/v2/health/ready", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready within {timeout_s} s")


def send_together(calls: list) -> list:
    """Run every call at once: a barrier releases all threads together; results in call order."""
    barrier = threading.Barrier(len(calls))

    def run(call):
        barrier.wait()
        return call()

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(run, calls))



@contextmanager
def deployment_calls() -> Iterator[Callable[[str, str, str], object]]:
    """``call(app_name, deployment, method)``: the answer of a deployment's method (e.g. a
    replica's batch counters). The handles live on one event loop of their own (a handle's
    router may be bound to the loop it was made on, as with RAY_SERVE_THROUGHPUT_OPTIMIZED=1)."""
    from ray import serve

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def ask(app_name: str, deployment: str, method: str) -> object:
        return await getattr(serve.get_deployment_handle(deployment, app_name=app_name), method).remote()

    try:
        yield lambda *names: asyncio.run_coroutine_threadsafe(ask(*names), loop).result(timeout=60)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


@contextmanager
def application(serve_instance: str, args: dict, name: str) -> Iterator[str]:
    """The application of ``args`` (a router application's args) served as ``name`` under
    ``/<name>`` until the block ends; yields its base URL once ready."""
    from deployments.app import delete_server, run_applications

    run_applications(args, name=name, route_prefix=f"/{name}")
    try:
        url = f"{serve_instance}/{name}"
        wait_ready(url)
        yield url
    finally:
        delete_server(name)
