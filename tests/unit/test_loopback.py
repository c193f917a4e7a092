"""deployments.loopback: the environment a local cluster gets (``local_env``): Ray's
single-machine mode, and Ray's HAProxy run through ``deployments/haproxy.py`` on free ports."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from typing import Iterator

from deployments import haproxy, loopback


def _real_haproxy() -> str:
    return haproxy.real_haproxy({})


def test_local_env_without_haproxy_is_rays_single_machine_mode():
    assert loopback.local_env({}) == {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30"}
    assert loopback.local_env({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1", "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "9"}) == {}  # the user's choice stands


def test_local_env_with_haproxy_wraps_the_binary_ray_would_run_and_keeps_the_users_ports():
    env = loopback.local_env({"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_HAPROXY_STATS_PORT": "18404"})
    assert env["RAY_SERVE_HAPROXY_BINARY_PATH"] == str(haproxy.WRAPPER)
    assert env[haproxy.REAL_BINARY_ENV] == _real_haproxy() and os.access(env[haproxy.REAL_BINARY_ENV], os.X_OK)
    assert "RAY_SERVE_HAPROXY_STATS_PORT" not in env and int(env["RAY_SERVE_HAPROXY_METRICS_PORT"]) > 0
    again = loopback.local_env({"RAY_SERVE_ENABLE_HA_PROXY": "1", **env})  # wrapped once, not twice
    assert again[haproxy.REAL_BINARY_ENV] == env[haproxy.REAL_BINARY_ENV]
    assert env["RAY_SERVE_HAPROXY_HEALTH_CHECK_FALL"] == "6"  # a busy replica stays in rotation
    assert env["RAY_SERVE_HAPROXY_OBSERVE_ERROR_LIMIT"] == "1"  # a dead one leaves it at its first refusal
    users = loopback.local_env({"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_HAPROXY_HEALTH_CHECK_FALL": "3"})
    assert "RAY_SERVE_HAPROXY_HEALTH_CHECK_FALL" not in users  # the user's value stands


def test_each_run_gets_haproxy_files_of_its_own_unless_the_user_chose_them():
    """Two servers on one host shared Ray's /tmp/haproxy-serve: its config, admin socket and
    state (one HAProxy's reload read the other's config)."""
    env = loopback.local_env({"RAY_SERVE_ENABLE_HA_PROXY": "1"})
    folder = haproxy.haproxy_folder(os.getpid())
    assert {name: env[name] for name in haproxy.HAPROXY_FILES} == {
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": f"{folder}/haproxy.cfg", "RAY_SERVE_HAPROXY_SOCKET_PATH": f"{folder}/admin.sock",
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": folder, "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": f"{folder}/server-state",
        "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": f"{folder}/metrics.sock"}
    assert len(env["RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH"].encode()) < 100  # a socket path's limit is 107 bytes
    users = loopback.local_env({"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_HAPROXY_SOCKET_PATH": "/run/mine.sock"})
    assert not set(haproxy.HAPROXY_FILES) & set(users)  # the user's files stand, all of Ray's defaults with them
    assert not set(haproxy.HAPROXY_FILES) & set(loopback.local_env({}))  # no HAProxy, no files


def test_a_port_held_on_any_interface_gives_way_to_a_free_one():
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        taken = held.getsockname()[1]
        chosen = haproxy.port_or_free(taken)
    assert chosen != taken and chosen > 0


def test_the_direct_ingress_ports_start_at_a_free_one():
    """Ray warned "Failed to start RequestProtocol.HTTP server on port 30000 ... Retrying" at every
    start while another server held 30000: the range now starts at a port free at start."""
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        taken = held.getsockname()[1]
        assert loopback.first_free_port(taken, taken + 10) != taken
        assert loopback.first_free_port(taken, taken + 1) == taken  # none free: Ray's own start
    env = loopback.local_env({"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": "31500"})
    assert "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT" not in env  # the user's value stands
    # below the kernel's ephemeral ports (Ray's 40000 is among them)
    assert 31000 <= int(env["RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT"]) < 32000
    # Serve's fallback proxy on the last port of the run's gRPC block (not 9500, one per host);
    # Ray's max is past the replicas' range (``range(min, max)``)
    assert int(env["RAY_SERVE_FALLBACK_PROXY_GRPC_PORT"]) == int(env["RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT"])
    assert int(env["RAY_SERVE_FALLBACK_PROXY_GRPC_PORT"]) % 200 == 199


def free_span(length: int) -> int:
    """The first of ``length`` ports, each free now, from 20000 up in steps of 1000: below Linux's
    ephemeral range (32768+), where an outgoing connection once held 36000 during a full suite, and
    below Ray's direct-ingress ports (30000+)."""
    for base in range(20000, 30000, 1000):
        try:
            for port in range(base, base + length):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise AssertionError("no free span of ports between 20000 and 30000")


@contextlib.contextmanager
def another_server(call: str) -> Iterator[str]:
    """A process that prints what ``call`` (``loopback``'s) returns, then holds its claims until
    the block ends: what it printed."""
    code = f"import sys; from deployments import loopback; print(loopback.{call}, flush=True); sys.stdin.read()"
    other = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        yield other.stdout.readline().strip()
    finally:
        other.communicate("")


def test_servers_started_at_once_claim_separate_blocks_of_the_ingress_range(tmp_path):
    """Two servers started at once both found 30000 free and began there: one's replica took the
    port the other's HAProxy listed (its first requests 421). Each process now claims a block of
    the range with a lock held for its life; another process gets the next block, and a block
    comes free when its process is gone."""
    folder = str(tmp_path / "locks")
    b = free_span(1000)
    with another_server(f"claim_ingress_block({b}, 1000, 200, {folder!r})") as theirs:
        assert theirs == f"({b}, {b + 200})"  # the first block, held by the other process
        mine = loopback.claim_ingress_block(b, 1000, 200, folder)
        assert mine == (b + 200, b + 400)  # the next block: no port of the other's
        assert loopback.claim_ingress_block(b, 1000, 200, folder) == mine  # this process's own, again
    os.close(loopback._CLAIMS.pop(f"{b + 200}.lock"))  # forget this process's claim (a new process's view) to read the first block
    assert loopback.claim_ingress_block(b, 1000, 200, folder) == (b, b + 200)  # free once the other went
    with socket.socket() as held:  # a port taken inside a block: the block starts after it
        held.bind(("127.0.0.1", b + 400))
        held.listen()
        assert loopback.claim_ingress_block(b + 400, 400, 200, folder)[0] > b + 400


def test_servers_started_at_once_take_different_haproxy_side_ports(tmp_path):
    """Two servers started at once both found 8404 free, both gave it to their HAProxy, and the
    second's died ("cannot bind socket (Address already in use) for [127.0.0.1:8404]"). A server
    now claims the port for its life; another server gets a free port while that claim stands,
    and the port once the claimant is gone."""
    folder = str(tmp_path / "locks")
    port = free_span(1)
    with another_server(f"claim_port({port}, {folder!r})") as theirs:
        assert theirs == str(port)  # the other server's, though no socket holds it yet
        mine = loopback.claim_port(port, folder)
        assert mine != port and mine > 0
    assert loopback.claim_port(port, folder) == port  # free once the other went
    assert loopback.claim_port(port, folder) == port  # this process's own, again
    os.close(loopback._CLAIMS.pop(f"port-{port}.lock"))
    (tmp_path / "a-file").write_text("")
    assert loopback.claim_port(port, str(tmp_path / "a-file" / "locks")) == port  # no folder for claims: free is enough
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        assert loopback.claim_port(port, folder) != port  # claimed here, but another process's socket holds it
    os.close(loopback._CLAIMS.pop(f"port-{port}.lock"))
