"""``make serve`` listens on loopback only: the server started as the Makefile starts it
(``deployments.run`` under ``make print-serve-env``'s environment), then every listening socket
of its processes (Ray's GCS, raylet, agents, dashboard, every worker's gRPC server, HAProxy,
the replicas' metrics port, the router's gRPC port) is on 127.0.0.1 / ::1, but for what Ray 2.60 hard-codes
(docs/security.md, "What listens where"); each replica's gRPC server, which Ray binds to ``[::]``, is moved
to 127.0.0.1 (``loopback.replica_grpc_on_loopback``):

- HAProxy's syslog sender (``log 127.0.0.1:514`` in Ray's template): a UDP socket the kernel
  binds to ``0.0.0.0:<ephemeral>`` on the first datagram sent; HAProxy never reads it.

The same server, last: its router replica killed under load, every request gets an HTTP answer
(HAProxy as ``deployments.haproxy`` configures it; the Python proxy's answer:
``test_campaigns.py``).
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import requests
import yaml

from bench import faults

from .conftest import ROOT, _free_port, runner_config, wait_ready

pytestmark = pytest.mark.integration


def _serve_env() -> dict[str, str]:
    """This environment plus ``make serve``'s variables (``make print-serve-env``)."""
    words = subprocess.run(["make", "-s", "print-serve-env"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    return dict(os.environ, **dict(word.split("=", 1) for word in words))


def _listeners(root_pid: int) -> list[tuple[str, int, str, str, int]]:
    """(address, port, protocol, process name, pid) of every TCP socket listening, and every UDP
    socket bound without a peer, in ``root_pid`` and its descendants."""
    root = psutil.Process(root_pid)
    found = []
    for process in [root, *root.children(recursive=True)]:
        try:
            name = process.name()
            for c in process.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    found.append((c.laddr.ip, c.laddr.port, "tcp", name, process.pid))
                elif c.type == socket.SOCK_DGRAM and not c.raddr:
                    found.append((c.laddr.ip, c.laddr.port, "udp", name, process.pid))
        except psutil.NoSuchProcess:
            continue
    return found


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or bool(getattr(ip, "ipv4_mapped", None) and ip.ipv4_mapped.is_loopback)


def _beyond_loopback(listeners: list[tuple[str, int, str, str, int]]) -> list[tuple[str, int, str, str, int]]:
    """``listeners`` not on loopback, less HAProxy's UDP syslog sender (module docstring)."""
    return sorted(entry for entry in listeners
                  if not _is_loopback(entry[0]) and not (entry[2] == "udp" and entry[3] == "haproxy"))


@pytest.fixture(scope="module")
def make_serve(tmp_path_factory):
    """(URL, pid) of ``python -m deployments.run`` on serve_config.yaml with free ports for the
    API and the metrics, run with the Makefile's environment; stopped with Ctrl-C (SIGINT)."""
    repository = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]["args"]["repository"]
    metrics_port, grpc_port = _free_port(), _free_port()
    path, port = runner_config(tmp_path_factory.mktemp("make-serve"), repository=str(ROOT / repository),
                               metrics={"port": metrics_port}, grpc_port=grpc_port)
    log = path.with_suffix(".log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "deployments.run", str(path)], cwd=ROOT, env=_serve_env(),
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, Path(log.name).read_text()[-3000:]
            try:
                wait_ready(url, timeout_s=5)
                break
            except (requests.RequestException, TimeoutError):
                assert time.monotonic() < deadline, "make serve not ready in 240 s"
        yield url, server.pid, metrics_port, grpc_port
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(30)
        log.close()


def test_make_serve_listens_on_loopback_only(make_serve):
    url, pid, metrics_port, grpc_port = make_serve
    # every replica is up once ready; HAProxy's side ports, the metrics and gRPC ports bind soon after
    deadline = time.monotonic() + 30
    while True:
        listeners = _listeners(pid)
        names = {name for _, _, _, name, _ in listeners}
        ports = {port for _, port, protocol, _, _ in listeners if protocol == "tcp"}
        if ("haproxy" in names and {metrics_port, grpc_port} <= ports) or time.monotonic() > deadline:
            break
        time.sleep(1)
    exposed = _beyond_loopback(listeners)
    print("\n".join(f"{a:>16} {p:>5} {proto} {n}" for a, p, proto, n, _ in sorted(listeners, key=lambda e: e[3])))
    assert exposed == [], f"listening beyond loopback: {exposed}"
    # not vacuous: the API, Ray's core servers, HAProxy's stats, the metrics and gRPC ports were seen
    assert int(url.rsplit(":", 1)[1]) in ports and metrics_port in ports and grpc_port in ports
    assert {"gcs_server", "raylet", "haproxy"} <= names
    haproxy_ports = {port for _, port, protocol, name, _ in listeners if name == "haproxy" and protocol == "tcp"}
    assert len(haproxy_ports) >= 3, haproxy_ports  # API, stats, Prometheus
    assert requests.get(f"{url}/v2/health/ready", timeout=10).status_code == 200
    import tritonclient.grpc as grpcclient  # gRPC answers under make serve's environment (user code on Serve's loop)

    with grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}") as client:
        assert client.is_server_ready(client_timeout=30)


def test_make_serve_answers_every_request_in_flight_when_its_router_replica_is_killed(make_serve):
    url, pid, _, _ = make_serve  # the server leads its own session (start_new_session)
    result = faults.router_kill_under_load(url, pid, "models", index=True)  # one hop: models skip the router
    print(result)
    assert result.lost == 0 and "None" not in result.answers, result
    # sent again by HAProxy (200: on Ray's fallback proxy) or a JSON 502/503 with Retry-After
    assert sum(result.in_flight.values()) >= 1 and set(result.in_flight) <= {"200", "502", "503"}, result
    assert result.recovered, result
