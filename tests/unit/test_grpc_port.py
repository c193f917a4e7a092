"""The gRPC port is shared with SO_REUSEPORT among a node's router replicas, and with nobody else:
``grpc_service.foreign_listeners`` and the start's refusal."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys

import psutil
import pytest

from deployments import grpc_service

LISTEN = """
import socket, sys, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
print("listening", flush=True)
time.sleep(120)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def other_server():
    """(port, pid) of another process listening on a free port with SO_REUSEPORT, as a second
    server's gRPC listener does."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-c", LISTEN, str(port)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "listening"
    yield port, proc.pid
    proc.kill()
    proc.wait()


def test_another_process_on_the_port_is_foreign_and_this_one_is_not(other_server):
    port, pid = other_server
    mine = socket.socket()
    mine.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    mine.bind(("127.0.0.1", port))
    mine.listen()
    try:
        (found,) = grpc_service.foreign_listeners(port)
        assert found.startswith(f"pid {pid} (") and "-c" in found
    finally:
        mine.close()


def test_a_free_port_has_no_foreign_listener():
    assert grpc_service.foreign_listeners(_free_port()) == []


def test_the_start_refuses_a_port_another_server_listens_on_and_lets_it_go(other_server):
    port, pid = other_server

    async def start() -> None:
        await grpc_service.start(None, port, "127.0.0.1", 1 << 20)

    with pytest.raises(RuntimeError, match=f"another server listens on port {port} too.*pid {pid} "):
        asyncio.run(start())
    own = [c for c in psutil.net_connections(kind="tcp")
           if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid == os.getpid()]
    assert own == []  # the refused server let the port go
