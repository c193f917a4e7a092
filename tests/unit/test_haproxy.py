"""deployments.haproxy: Ray's own HAProxy config (rendered by Ray 2.60's code) keeps its stats and
Prometheus listeners on 127.0.0.1 and stays valid for the real HAProxy; it retries or answers
(JSON) a request whose server dies, tried on the real HAProxy; the wrapper as Ray runs it."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from deployments import haproxy

WRAPPER = Path(haproxy.__file__)


def _ray_haproxy_config(tmp_path: Path, host: str, routes: dict[str, str] | None = None) -> Path:
    """The config file Ray Serve's HAProxyApi writes for an API on ``host``:8000, with an HTTP
    backend ``http-<application>`` (one server, port 9) per ``routes`` item (application -> route
    prefix), as Ray's HAProxy manager names them."""
    from ray.serve._private.haproxy import BackendConfig, HAProxyApi, HAProxyConfig, ServerConfig
    from ray.serve.config import HTTPOptions

    cfg = HAProxyConfig(http_options=HTTPOptions(host=host, port=8000), socket_path=str(tmp_path / "admin.sock"),
                        server_state_base=str(tmp_path), server_state_file=str(tmp_path / "server-state"),
                        metrics_socket_path=str(tmp_path / "metrics.sock"))
    api = HAProxyApi(cfg=cfg, config_file_path=str(tmp_path / "haproxy.cfg"))
    api.set_backend_configs({f"http-{app}": BackendConfig(name=f"http-{app}", path_prefix=prefix, app_name=app,
                                                          servers=[ServerConfig(f"SERVE_REPLICA--{app}", "127.0.0.1", 9)])
                             for app, prefix in (routes or {}).items()})
    api._generate_config_file_internal()
    return tmp_path / "haproxy.cfg"


def _binds(config: str) -> list[str]:
    return [line.split()[1] for line in config.splitlines() if line.strip().startswith("bind ")]


def _real_haproxy() -> str:
    return haproxy.real_haproxy({})


def test_rays_template_binds_stats_and_prometheus_on_every_interface(tmp_path):
    binds = _binds(_ray_haproxy_config(tmp_path, "127.0.0.1").read_text())
    assert "*:8404" in binds and ":9101" in binds and "127.0.0.1:8000" in binds


def test_bind_loopback_moves_only_stats_and_prometheus_and_haproxy_accepts_it(tmp_path):
    path = _ray_haproxy_config(tmp_path, "0.0.0.0")
    original = path.read_text()
    rewritten = haproxy.bind_loopback(original)
    assert sorted(_binds(rewritten)) == ["*:8000", "127.0.0.1:8404", "127.0.0.1:9101"]  # the API: as asked
    assert len(rewritten.splitlines()) == len(original.splitlines())
    assert haproxy.bind_loopback(rewritten) == rewritten
    path.write_text(rewritten)
    check = subprocess.run([_real_haproxy(), "-c", "-f", str(path)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize("section", haproxy.WILDCARD_SECTIONS)
def test_bind_loopback_refuses_a_config_without_a_section_it_must_move(section):
    config = "".join(f"{s}\n    bind *:{1000 + i}\n" for i, s in enumerate(haproxy.WILDCARD_SECTIONS) if s != section)
    with pytest.raises(ValueError, match=section):
        haproxy.bind_loopback(config)


def test_the_wrapper_rewrites_the_config_then_runs_the_real_haproxy_with_rays_arguments(tmp_path):
    path = _ray_haproxy_config(tmp_path, "127.0.0.1")
    env = dict(os.environ, **{haproxy.REAL_BINARY_ENV: _real_haproxy()})
    done = subprocess.run([str(WRAPPER), "-c", "-f", str(path)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    # the side ports are the template's 8404 and 9101 where 127.0.0.1 can bind them now, else free
    # ones (a make serve running beside the tests holds them): what the wrapper recorded beside it
    side = json.loads(Path(str(path) + haproxy.PORTS_SUFFIX).read_text())
    assert len(side) == 2 and all(isinstance(port, int) and port > 0 for port in side.values()), side
    assert sorted(_binds(path.read_text())) == sorted(["127.0.0.1:8000", *(f"127.0.0.1:{p}" for p in side.values())])


def test_the_wrapper_exits_2_naming_what_is_missing(tmp_path):
    path = tmp_path / "haproxy.cfg"
    path.write_text("listen stats\n  bind *:8404\n")
    env = dict(os.environ, **{haproxy.REAL_BINARY_ENV: _real_haproxy()})
    done = subprocess.run([str(WRAPPER), "-db", "-f", str(path)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "frontend prometheus" in done.stderr
    bare = {k: v for k, v in os.environ.items() if k != haproxy.REAL_BINARY_ENV}
    done = subprocess.run([str(WRAPPER), "-db", "-f", str(path)], env=bare, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and haproxy.REAL_BINARY_ENV in done.stderr


def test_a_side_port_taken_after_make_serve_started_is_exchanged_for_a_free_one_as_haproxy_starts(tmp_path):
    """``make serve`` found 9101 free at start; another server took it before Ray started
    HAProxy (minutes later), which died "cannot bind socket" with a 40-line traceback. The
    wrapper chooses the side ports as HAProxy starts, records them, and a reload keeps them."""
    path = _ray_haproxy_config(tmp_path, "127.0.0.1")
    ports = {"RAY_SERVE_HAPROXY_STATS_PORT": _free_port(), "RAY_SERVE_HAPROXY_METRICS_PORT": _free_port()}
    path.write_text(haproxy.move_side_ports(path.read_text(), ports))
    record = Path(str(path) + haproxy.PORTS_SUFFIX)
    env = dict(os.environ, **{haproxy.REAL_BINARY_ENV: _real_haproxy()})
    with socket.socket() as held:
        held.bind((haproxy.LOOPBACK, ports["RAY_SERVE_HAPROXY_METRICS_PORT"]))
        held.listen()
        process = subprocess.Popen([str(WRAPPER), "-db", "-f", str(path)], env=env, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True)
        try:
            _until(lambda: process.poll() is not None or (record.is_file() and _get(
                json.loads(record.read_text())["RAY_SERVE_HAPROXY_METRICS_PORT"], "/metrics") is not None))
            assert process.poll() is None, process.stderr.read()
            chosen = json.loads(record.read_text())
            assert chosen["RAY_SERVE_HAPROXY_STATS_PORT"] == ports["RAY_SERVE_HAPROXY_STATS_PORT"]  # free: kept
            assert chosen["RAY_SERVE_HAPROXY_METRICS_PORT"] != ports["RAY_SERVE_HAPROXY_METRICS_PORT"]
            assert _get(chosen["RAY_SERVE_HAPROXY_METRICS_PORT"], "/metrics")[0] == 200
            assert _get(chosen["RAY_SERVE_HAPROXY_STATS_PORT"], "/stats")[0] == 200
            # a reload (Ray's -sf, the running HAProxy holding the ports) binds the recorded ones again
            rendered = haproxy.move_side_ports(haproxy.rewrite_config(path.read_text()), ports)
            reloaded = haproxy.choose_side_ports(rendered, record, reload=True)
            assert haproxy.side_ports(reloaded) == chosen
        finally:
            process.send_signal(signal.SIGUSR1)  # HAProxy's soft stop
            process.wait(timeout=30)


def test_haproxys_bind_failure_is_one_line_naming_the_port_and_the_variables(tmp_path, monkeypatch):
    """Should another process take the chosen port in the moment before HAProxy binds it,
    ``make serve`` says so in one line (from HAProxy's own stderr, read here from the real
    HAProxy refused the port)."""
    path = _ray_haproxy_config(tmp_path, "127.0.0.1")
    ports = {"RAY_SERVE_HAPROXY_STATS_PORT": _free_port(), "RAY_SERVE_HAPROXY_METRICS_PORT": _free_port()}
    path.write_text(haproxy.move_side_ports(haproxy.rewrite_config(path.read_text()), ports))
    with socket.socket() as held:
        held.bind((haproxy.LOOPBACK, ports["RAY_SERVE_HAPROXY_METRICS_PORT"]))
        held.listen()
        done = subprocess.run([_real_haproxy(), "-db", "-f", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    line = haproxy.bind_failure(done.stderr, ports)
    port = ports["RAY_SERVE_HAPROXY_METRICS_PORT"]
    assert line == (f"HAProxy could not bind 127.0.0.1:{port} (Address already in use): another process took it as "
                    f"HAProxy started; run again (a free port is chosen at start), or set "
                    f"RAY_SERVE_HAPROXY_METRICS_PORT to a free port (RAY_SERVE_HAPROXY_STATS_PORT / "
                    f"RAY_SERVE_HAPROXY_METRICS_PORT move HAProxy's stats and Prometheus ports)")
    assert haproxy.bind_failure(done.stderr, {"RAY_SERVE_HAPROXY_STATS_PORT": ports["RAY_SERVE_HAPROXY_STATS_PORT"]}) is None
    # what `make serve` (deployments.run) prints: the ports as recorded, then that line, from Ray's stderr log
    from deployments.run import HAProxyWatch

    for variable in haproxy.HAPROXY_DEFAULT_PORTS:  # Ray's defaults asked for; the record says where they went
        monkeypatch.delenv(variable, raising=False)
    record = Path(str(path) + haproxy.PORTS_SUFFIX)
    record.write_text(json.dumps(ports))
    (tmp_path / "admin.sock.1.0.stderr.log").write_text(done.stderr)
    watch = HAProxyWatch(record, (tmp_path, "admin.sock.*.stderr.log"), since=0.0)
    announced, failure = watch.lines()
    assert announced == [f"HAProxy stats: http://127.0.0.1:{ports['RAY_SERVE_HAPROXY_STATS_PORT']}/stats, Prometheus: "
                         f"http://127.0.0.1:{port}/metrics (8404 was taken (RAY_SERVE_HAPROXY_STATS_PORT); 9101 was "
                         f"taken (RAY_SERVE_HAPROXY_METRICS_PORT))"] and failure == line
    assert watch.lines() == ([], line)  # the ports once


def _defaults_of(config: str) -> list[str]:
    lines = config.splitlines()
    start = lines.index("defaults")
    end = next((i for i in range(start + 1, len(lines)) if lines[i] and not lines[i][0].isspace()), len(lines))
    return [line.strip() for line in lines[start + 1:end]]


def _http_error_bodies(defaults: list[str]) -> dict[int, tuple[dict, str | None]]:
    """status -> (JSON body, Retry-After or None) of each ``http-error status N ... string "..."
    [hdr Retry-After S]`` line."""
    found = {}
    for line in defaults:
        if line.startswith("http-error status "):
            retry = line.rsplit(" ", 1)[1] if '" hdr Retry-After ' in line else None
            end = line.rindex('" hdr Retry-After ') if retry else len(line) - 1
            quoted = line[line.index(' string "') + len(' string "'):end]
            found[int(line.split()[2])] = (json.loads(quoted.replace('\\"', '"')), retry)
    return found


def test_rays_config_is_made_to_retry_or_answer_json_and_haproxy_accepts_it(tmp_path):
    path = _ray_haproxy_config(tmp_path, "127.0.0.1")
    original = path.read_text()
    assert "    retry-on conn-failure\n" in original and "errorfile 502" in original  # Ray's, as it stands
    rewritten = haproxy.rewrite_config(original)
    defaults = _defaults_of(rewritten)
    assert "retry-on conn-failure empty-response" in defaults and f"retries {haproxy.RETRIES}" in defaults
    assert "option http-buffer-request" in defaults and "option redispatch 1" in defaults  # Ray's kept
    assert not [line for line in defaults if line.startswith("errorfile")]
    assert _http_error_bodies(defaults) == {
        **{status: ({"error": text}, "1") for status, text in haproxy.ERROR_ANSWERS.items()},
        **{status: ({"error": text}, None) for status, text in haproxy.CLIENT_ERROR_ANSWERS.items()}}
    assert "timeout http-request 30s" in defaults
    assert haproxy.rewrite_config(rewritten) == rewritten
    # out: errorfile x3; in: the marker, http-buffer-request, retries, http-error x4, timeout;
    # answer_unrouted's marker in default_backend (its 404 line is replaced in place)
    assert rewritten.count("\n") == original.count("\n") - 3 + 8 + 1
    path.write_text(rewritten)
    check = subprocess.run([_real_haproxy(), "-c", "-f", str(path)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def test_the_answers_keep_what_ray_was_told_and_skip_a_config_without_defaults():
    told = "defaults\n    mode http\n    retry-on none\n    retries 2\nbackend b\n    server s 127.0.0.1:1\n"
    defaults = _defaults_of(haproxy.answer_replica_deaths(told))
    assert "retry-on none" in defaults and "retries 2" in defaults  # RAY_SERVE_HAPROXY_RETRY_ON / _RETRIES
    assert not [line for line in defaults if line.startswith(("retries 1", "retry-on conn"))]
    assert set(_http_error_bodies(defaults)) == {408, 502, 503, 504}
    bare = "defaults\n    mode http\n"  # no retry-on at all: the policy is added
    assert "retry-on conn-failure empty-response" in _defaults_of(haproxy.answer_replica_deaths(bare))
    without = "global\n    maxconn 10\nfrontend f\n    bind 127.0.0.1:1\n"
    assert haproxy.answer_replica_deaths(without) == without


_BACKEND = '''
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
name = sys.argv[2]
class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *args): pass
    def answer(self, body):
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        if self.path.endswith("/hold"):  # held until the test kills this process
            time.sleep(600)
        self.answer(name.encode())
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        if name == "dying":  # holds the request until the test kills this process
            print("holding", flush=True)
            time.sleep(600)
        self.answer(json.dumps({"by": name}).encode())
ThreadingHTTPServer.daemon_threads = True
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((haproxy.LOOPBACK, 0))
        return s.getsockname()[1]


def _until(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def _get(port: int, path: str, timeout_s: float = 5.0) -> tuple[int, bytes] | None:
    try:
        conn = http.client.HTTPConnection(haproxy.LOOPBACK, port, timeout=timeout_s)
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    except OSError:
        return None


def test_haproxy_retries_a_request_whose_server_died_and_answers_json_where_it_cannot(tmp_path):
    """Ray's global and defaults sections, rewritten, in front of a server that dies holding the
    request (as the Router replica does) and a backup (as Ray's fallback proxy). The request
    held is retried once (``RETRIES``), on the only server, dead by then: HAProxy answers a
    JSON 502 or 503 "send it again" (on a client connection that sent a request before, it may close it
    with no answer instead: HAProxy's keep-alive rule, the client sends it again), and the next
    request goes to the backup."""
    ray_config = _ray_haproxy_config(tmp_path, "127.0.0.1").read_text()
    head = ray_config[:ray_config.index("\nfrontend ") + 1]
    front, dying, backup, closed = (_free_port() for _ in range(4))
    (tmp_path / "backend.py").write_text(_BACKEND)
    limit = haproxy.HAPROXY_HEALTH_ENV["RAY_SERVE_HAPROXY_OBSERVE_ERROR_LIMIT"]  # as Ray renders it under local_env
    config = haproxy.answer_replica_deaths(head + f"""frontend api
    bind 127.0.0.1:{front}
    use_backend nothing if {{ path_beg /nothing }}
    default_backend app
backend app
    option httpchk GET /-/healthz
    default-server fastinter 250ms downinter 250ms fall 2 rise 2 inter 5s check
    server router 127.0.0.1:{dying} check observe layer4 error-limit {limit} on-error mark-down
    server fallback 127.0.0.1:{backup} check backup
backend nothing
    server gone 127.0.0.1:{closed} check observe layer4 error-limit {limit} on-error mark-down
""")
    (tmp_path / "lab.cfg").write_text(config)
    processes = []

    def start(*args: str) -> subprocess.Popen:
        processes.append(subprocess.Popen(list(args), stdout=subprocess.PIPE, text=True))
        return processes[-1]

    try:
        start(sys.executable, str(tmp_path / "backend.py"), str(backup), "fallback")
        start(_real_haproxy(), "-db", "-f", str(tmp_path / "lab.cfg"))
        for body, fresh in ((b"x" * 400, True), (b"x" * 400, False), (b"x" * 65536, True)):
            server = start(sys.executable, str(tmp_path / "backend.py"), str(dying), "dying")
            _until(lambda: _get(front, "/who") == (200, b"dying"))  # HAProxy sees it up
            conn = http.client.HTTPConnection(haproxy.LOOPBACK, front, timeout=30)
            if not fresh:  # a request on a reused client connection (HAProxy's keep-alive case)
                conn.request("GET", "/who")
                conn.getresponse().read()
            conn.request("POST", "/v2/models/m/infer", body=body)
            assert server.stdout.readline() == "holding\n"
            server.send_signal(signal.SIGKILL)
            server.wait()
            try:
                response = conn.getresponse()
            except http.client.RemoteDisconnected:
                assert not fresh  # the keep-alive rule only
            else:
                answer = (response.status, response.getheader("Content-Type"), response.getheader("Retry-After"),
                          json.loads(response.read()))
                # fits HAProxy's buffer: sent again once, to the dead server (the only one not a
                # backup, not yet marked down): refused (503) or cut on a connection it had open
                # (502); larger (16 KiB): cannot be sent again (502)
                statuses = (502, 503) if len(body) < 16384 else (502,)
                assert answer[0] in statuses, answer
                assert answer == (answer[0], "application/json", "1", {"error": haproxy.ERROR_ANSWERS[answer[0]]})
            conn = http.client.HTTPConnection(haproxy.LOOPBACK, front, timeout=30)
            conn.request("POST", "/v2/models/m/infer", body=body)
            response = conn.getresponse()
            assert (response.status, json.loads(response.read())) == (200, {"by": "fallback"})
        conn = http.client.HTTPConnection(haproxy.LOOPBACK, front, timeout=30)
        conn.request("POST", "/nothing", body=b"{}")
        response = conn.getresponse()
        assert (response.status, response.getheader("Content-Type"), response.getheader("Retry-After"),
                json.loads(response.read())) == (503, "application/json", "1", {"error": haproxy.ERROR_ANSWERS[503]})
    finally:
        for process in processes:
            process.kill()
            process.wait()


_CRASHING = '''
import os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *args): pass
    def do_GET(self):  # Ray's health check
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def do_POST(self):  # a request that crashes its replica (in native code, say)
        self.rfile.read(int(self.headers["Content-Length"]))
        print("took it", flush=True)
        os._exit(1)
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
'''


@contextlib.contextmanager
def _ray_app_haproxy(tmp_path: Path, servers: dict[str, int], bufsize: int = 16384) -> Iterator[tuple[int, Path]]:
    """The real HAProxy on Ray's config for one application at ``/`` whose servers are
    ``servers`` (name -> port), rendered as Ray renders it under ``HAPROXY_HEALTH_ENV`` (and
    ``tune.bufsize`` ``bufsize``: Ray's default 16 KiB) and rewritten by the wrapper; yields
    (its port, its admin socket)."""
    from ray.serve._private.haproxy import BackendConfig, HAProxyApi, HAProxyConfig, ServerConfig
    from ray.serve.config import HTTPOptions

    front = _free_port()
    cfg = HAProxyConfig(http_options=HTTPOptions(host="127.0.0.1", port=front), socket_path=str(tmp_path / "admin.sock"),
                        server_state_base=str(tmp_path), server_state_file=str(tmp_path / "server-state"),
                        metrics_socket_path=str(tmp_path / "metrics.sock"),
                        observe_error_limit=int(haproxy.HAPROXY_HEALTH_ENV["RAY_SERVE_HAPROXY_OBSERVE_ERROR_LIMIT"]),
                        health_check_fall=int(haproxy.HAPROXY_HEALTH_ENV["RAY_SERVE_HAPROXY_HEALTH_CHECK_FALL"]),
                        bufsize=bufsize, stats_port=_free_port(), metrics_port=_free_port())  # not Ray's 8404 / 9101:
    api = HAProxyApi(cfg=cfg, config_file_path=str(tmp_path / "haproxy.cfg"))      # another server may hold them
    api.set_backend_configs({"http-app": BackendConfig(
        name="http-app", path_prefix="/", app_name="app",
        servers=[ServerConfig(name, "127.0.0.1", port) for name, port in servers.items()])})
    api._generate_config_file_internal()
    config = haproxy.rewrite_config((tmp_path / "haproxy.cfg").read_text())
    (tmp_path / "haproxy.cfg").write_text(config)
    process = subprocess.Popen([_real_haproxy(), "-db", "-f", str(tmp_path / "haproxy.cfg")])
    try:
        _until(lambda: _get(front, "/-/healthz") is not None)
        yield front, tmp_path / "admin.sock"
    finally:
        process.kill()
        process.wait()


def _server_stats(admin: Path) -> dict[str, dict[str, str]]:
    """HAProxy's ``show stat`` for backend ``http-app``'s servers: name -> {field: value}."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(admin))
        s.sendall(b"show stat\n")
        text = b""
        while chunk := s.recv(65536):
            text += chunk
    header, *rows = text.decode().strip().splitlines()
    fields = header.lstrip("# ").split(",")
    stats = [dict(zip(fields, row.split(","))) for row in rows]
    return {row["svname"]: row for row in stats if row["pxname"] == "http-app" and row["svname"] != "BACKEND"}


def test_a_request_that_crashes_its_replica_reaches_at_most_two(tmp_path):
    """Three replicas, each crashing on the request it takes: HAProxy sends it to one, retries it
    once on another (``RETRIES``) and answers the JSON 502; the third replica lives (with
    ``retries 10`` the request took down all three)."""
    ports = {f"replica-{i}": _free_port() for i in range(3)}
    (tmp_path / "crashing.py").write_text(_CRASHING)
    replicas = {name: subprocess.Popen([sys.executable, str(tmp_path / "crashing.py"), str(port)],
                                       stdout=subprocess.PIPE, text=True) for name, port in ports.items()}
    try:
        for port in ports.values():
            _until(lambda: _get(port, "/-/healthz") is not None)
        with _ray_app_haproxy(tmp_path, ports) as (front, _):
            conn = http.client.HTTPConnection(haproxy.LOOPBACK, front, timeout=30)
            conn.request("POST", "/v2/models/m/infer", body=b"{}")
            response = conn.getresponse()
            answer = (response.status, response.getheader("Content-Type"), json.loads(response.read()))
            assert answer == (502, "application/json", {"error": haproxy.ERROR_ANSWERS[502]})
            took, alive = [], []
            for name, process in replicas.items():  # HAProxy answered: a replica that took it has died or dies now
                try:
                    process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    alive.append(name)
                    continue
                took += [name] if process.stdout.read() == "took it\n" else []
            assert (len(took), len(alive)) == (2, 1), (took, alive)
    finally:
        for process in replicas.values():
            process.kill()
            process.wait()


def test_a_request_sent_to_a_dead_replica_is_answered_by_a_live_one(tmp_path):
    """Two replicas up; one dies (its port refuses) while HAProxy still lists it up: every request
    is answered 200 by the live one, those sent to the dead one too (retried past it), and the
    dead one is marked down (live traffic does so at its first refused connection:
    ``HAPROXY_HEALTH_ENV``'s error limit 1)."""
    ports = {"dying": _free_port(), "live": _free_port()}
    (tmp_path / "backend.py").write_text(_BACKEND)
    replicas = {name: subprocess.Popen([sys.executable, str(tmp_path / "backend.py"), str(port), name])
                for name, port in ports.items()}
    try:
        for port in ports.values():
            _until(lambda: _get(port, "/who") is not None)
        with _ray_app_haproxy(tmp_path, ports) as (front, admin):
            _until(lambda: all(s["check_status"] == "L7OK" for s in _server_stats(admin).values()))
            replicas["dying"].kill()
            replicas["dying"].wait()
            answers = []
            while len(answers) < 10 and _server_stats(admin)["dying"]["status"].startswith("UP"):
                conn = http.client.HTTPConnection(haproxy.LOOPBACK, front, timeout=30)
                conn.request("POST", "/v2/models/m/infer", body=b"{}")
                response = conn.getresponse()
                answers.append((response.status, json.loads(response.read())))
                conn.close()
            dead = _server_stats(admin)["dying"]
            assert answers and answers == [(200, {"by": "live"})] * len(answers)
            assert (dead["status"], dead["stot"]) == ("DOWN", "1"), dead  # one request was sent to it
    finally:
        for process in replicas.values():
            process.kill()
            process.wait()


def test_a_request_held_by_a_dying_replica_is_sent_again_up_to_the_retry_body_size(tmp_path):
    """Ray's config with ``tune.bufsize`` = ``retry_bufsize(R)``, two replicas: the live one
    busy with a held request (so that leastconn sends the next to the other), the other killed
    while it holds a POST. A body of exactly R bytes is sent again, to the live replica (200);
    one the header room larger cannot be, and is answered HAProxy's JSON 502."""
    retry_body = 256 * 1024
    ports = {"dying": _free_port(), "live": _free_port()}
    (tmp_path / "backend.py").write_text(_BACKEND)
    live = subprocess.Popen([sys.executable, str(tmp_path / "backend.py"), str(ports["live"]), "live"])
    processes = [live]
    try:
        _until(lambda: _get(ports["live"], "/who") is not None)
        with _ray_app_haproxy(tmp_path, ports, bufsize=haproxy.retry_bufsize(retry_body)) as (front, admin):
            busy = http.client.HTTPConnection(haproxy.LOOPBACK, front, timeout=60)
            busy.request("GET", "/hold")  # held by live: leastconn sends the POST to dying
            _until(lambda: _server_stats(admin)["live"]["scur"] == "1")
            answers = []
            for size in (retry_body, retry_body + haproxy.RETRY_HEADER_ROOM_BYTES):
                dying = subprocess.Popen([sys.executable, str(tmp_path / "backend.py"), str(ports["dying"]), "dying"],
                                         stdout=subprocess.PIPE, text=True)
                processes.append(dying)
                _until(lambda: _get(ports["dying"], "/who") is not None)
                _until(lambda: (_server_stats(admin)["dying"]["status"], _server_stats(admin)["dying"]["check_status"])
                       == ("UP", "L7OK"))  # up again, checked since it runs
                conn = http.client.HTTPConnection(haproxy.LOOPBACK, front, timeout=30)
                conn.request("POST", "/v2/models/m/infer", body=b"x" * size,
                             headers={"Content-Type": "application/octet-stream"})
                assert select.select([dying.stdout], [], [], 30)[0] and dying.stdout.readline() == "holding\n"
                dying.kill()
                dying.wait()
                response = conn.getresponse()
                answers.append((response.status, json.loads(response.read())))
            assert answers == [(200, {"by": "live"}), (502, {"error": haproxy.ERROR_ANSWERS[502]})]
    finally:
        for process in processes:
            process.kill()
            process.wait()


def _raw(port: int, data: bytes) -> tuple[int, str | None, dict]:
    """Send ``data`` as is; (status, Content-Type, JSON body) of the answer."""
    with socket.create_connection((haproxy.LOOPBACK, port), timeout=30) as s:
        s.sendall(data)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers.get("content-type"), json.loads(body)


def test_haproxy_answers_a_request_that_never_arrives_in_full_in_json(tmp_path):
    """HAProxy's own 408 (less body than Content-Length) in the ``{"error": ...}`` shape, with Ray's defaults rewritten (its http-request timeout, here 1 s,
    kept where set)."""
    ray_config = _ray_haproxy_config(tmp_path, "127.0.0.1").read_text()
    head = ray_config[:ray_config.index("\nfrontend ") + 1].replace("    timeout connect", "    timeout http-request 1s\n    timeout connect", 1)
    front, backend = _free_port(), _free_port()
    (tmp_path / "backend.py").write_text(_BACKEND)
    config = haproxy.answer_replica_deaths(head + f"""frontend api
    bind 127.0.0.1:{front}
    default_backend app
backend app
    server s 127.0.0.1:{backend}
""")
    assert "timeout http-request 1s" in _defaults_of(config) and "timeout http-request 30s" not in config
    (tmp_path / "lab.cfg").write_text(config)
    processes = [subprocess.Popen([sys.executable, str(tmp_path / "backend.py"), str(backend), "ok"]),
                 subprocess.Popen([_real_haproxy(), "-db", "-f", str(tmp_path / "lab.cfg")])]
    try:
        _until(lambda: _get(front, "/who") == (200, b"ok"))
        assert _raw(front, b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
                    + b"x" * 10) == (408, "application/json", {"error": haproxy.CLIENT_ERROR_ANSWERS[408]})
    finally:
        for process in processes:
            process.kill()
            process.wait()


_ROUTES_BACKEND = '''
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *args): pass
    def do_GET(self):
        if self.path == "/who":
            status, kind, body = 200, "text/plain", b"up"
        elif self.path.startswith("/app/json"):  # the application's own 404
            status, kind, body = 404, "application/json", json.dumps({"error": "unknown model"}).encode()
        else:  # Ray's Python proxy once the route is gone
            status, kind, body = 404, "text/plain", f"Path '{self.path}' not found.".encode()
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
class Server(ThreadingHTTPServer):
    daemon_threads = True
    def handle_error(self, request, client_address): pass  # HAProxy drops a body it replaces
Server(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
'''


def _answer(port: int, path: str) -> tuple[int, str | None, str | None, dict | str]:
    conn = http.client.HTTPConnection(haproxy.LOOPBACK, port, timeout=30)
    conn.request("GET", path)
    response = conn.getresponse()
    body = response.read()
    kind = response.getheader("Content-Type")
    return (response.status, kind, response.getheader("Retry-After"),
            json.loads(body) if kind == "application/json" else body.decode())


def test_a_request_no_application_takes_answers_json_503_while_starting_or_stopping_404_else(tmp_path):
    """Ray's config with no application (as while Serve starts or stops), and one routing /app
    to a server standing for Ray's Python proxy: Ray's plain-text 404s become JSON, 503 with
    Retry-After where the path is an application's (or no application is routed), 404 where no
    route prefix matches it; the application's own JSON 404 passes unchanged."""
    front, front2, stats, prometheus, server = (_free_port() for _ in range(5))
    bare = haproxy.rewrite_config(_ray_haproxy_config(tmp_path, "127.0.0.1").read_text())
    bare = (bare.replace("127.0.0.1:8000", f"127.0.0.1:{front}").replace("127.0.0.1:8404", f"127.0.0.1:{stats}")
            .replace("127.0.0.1:9101", f"127.0.0.1:{prometheus}"))
    assert haproxy.answer_unrouted(bare) == bare  # idempotent
    head = bare[:bare.index("\nfrontend ") + 1]
    routed = haproxy.answer_unrouted(head + f"""frontend api
    bind 127.0.0.1:{front2}
    use_backend app if {{ path_beg /app }}
    default_backend default_backend
backend default_backend
    http-request return status 404 content-type text/plain lf-string "Path '%[path]' not found. Ping http://.../-/routes for available routes."
backend app
    server proxy 127.0.0.1:{server}
""")
    (tmp_path / "bare.cfg").write_text(bare)
    (tmp_path / "routed.cfg").write_text(routed)
    (tmp_path / "backend.py").write_text(_ROUTES_BACKEND)
    processes = [subprocess.Popen([sys.executable, str(tmp_path / "backend.py"), str(server)]),
                 subprocess.Popen([_real_haproxy(), "-db", "-f", str(tmp_path / "bare.cfg")]),
                 subprocess.Popen([_real_haproxy(), "-db", "-f", str(tmp_path / "routed.cfg")])]
    try:
        _until(lambda: _get(front2, "/app/who") is not None and _get(front, "/") is not None)
        error_503 = haproxy.UNROUTED_ANSWERS[503]
        assert _answer(front, '/v2/models/m\\x"/infer') == (
            503, "application/json", "1", {"error": error_503.format(path='/v2/models/m\\x"/infer')})
        assert _answer(front2, "/app/v2/models/simple/infer") == (
            503, "application/json", "1", {"error": error_503.format(path="/app/v2/models/simple/infer")})
        assert _answer(front2, "/app/json") == (404, "application/json", None, {"error": "unknown model"})
        assert _answer(front2, "/elsewhere") == (
            404, "application/json", None, {"error": haproxy.UNROUTED_ANSWERS[404].format(path="/elsewhere")})
    finally:
        for process in processes:
            process.kill()
            process.wait()


def _lab_config(front: int, fallback: int, routers: dict[str, int], models: dict[str, int]) -> str:
    """Ray's HAProxy config in small, rewritten by ``router_backs_up_models``: a router
    application ``app`` (servers ``routers``: name suffix -> port) and a model application
    ``app.m`` at /v2/models/m/ (servers ``models``), each with Ray's fallback proxy as backup."""
    def servers(app: str, ports: dict[str, int]) -> str:
        return "".join(f"    server SERVE_REPLICA--{app}-{name} 127.0.0.1:{port} check\n" for name, port in ports.items())

    return haproxy.router_backs_up_models(f"""global
    maxconn 100
defaults
    mode http
    timeout connect 5s
    timeout client 30s
    timeout server 30s
frontend api
    bind 127.0.0.1:{front}
    use_backend http-app.m if {{ path_beg /v2/models/m/ }}
    default_backend http-app
backend http-app
    default-server inter 200ms fall 1 rise 1
{servers("app", routers)}    server SERVE_PROXY_ACTOR-n 127.0.0.1:{fallback} check backup
backend http-app.m
    default-server inter 200ms fall 1 rise 1
{servers("app.m", models)}    server SERVE_PROXY_ACTOR-n 127.0.0.1:{fallback} check backup
""")


def test_a_model_backend_without_a_live_server_goes_to_the_router_then_back(tmp_path):
    """A dedicated model's application (``http-app.m``) with no replica up: its requests reach
    the router application's server (``router_backs_up_models``), and the model's own replica
    again once it runs; Ray's fallback proxy stays the last backup."""
    router, model, fallback, front = (_free_port() for _ in range(4))
    (tmp_path / "backend.py").write_text(_BACKEND)
    config = _lab_config(front, fallback, {"router-x": router}, {"model-m-x": model})
    assert haproxy.router_backs_up_models(config) == config  # idempotent
    servers = [line.split()[1] for line in config.split("backend http-app.m\n")[1].splitlines()
               if line.split()[:1] == ["server"]]
    assert servers == ["SERVE_REPLICA--app.m-model-m-x", "trt-router-SERVE_REPLICA--app-router-x", "SERVE_PROXY_ACTOR-n"]
    (tmp_path / "lab.cfg").write_text(config)
    check = subprocess.run([_real_haproxy(), "-c", "-f", str(tmp_path / "lab.cfg")], capture_output=True, text=True,
                           timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    processes = []
    try:
        for port, name in ((router, "router"), (fallback, "fallback")):
            processes.append(subprocess.Popen([sys.executable, str(tmp_path / "backend.py"), str(port), name]))
        processes.append(subprocess.Popen([_real_haproxy(), "-db", "-f", str(tmp_path / "lab.cfg")]))
        _until(lambda: _get(front, "/v2/models/m/ready") == (200, b"router"))  # no model replica: the router
        processes.append(subprocess.Popen([sys.executable, str(tmp_path / "backend.py"), str(model), "model"]))
        _until(lambda: _get(front, "/v2/models/m/ready") == (200, b"model"))  # its replica runs: one hop
        assert _get(front, "/v2/health/ready") == (200, b"router")
    finally:
        for process in processes:
            process.kill()
            process.wait()


def test_with_several_router_replicas_each_backs_up_a_model_and_a_live_one_answers(tmp_path):
    """Router replicas scale with load (``args.router.autoscaling``), and Ray's HAProxy config
    lists each as a server of the router's backend: every one becomes a backup of a model's
    backend, in Ray's order, before Ray's fallback proxy. HAProxy sends a model's requests to
    the first backup that is up (no ``option allbackups``: the fallback proxy must stay last),
    so with that router replica gone the next one answers."""
    first, second, fallback, front = (_free_port() for _ in range(4))
    (tmp_path / "backend.py").write_text(_BACKEND)
    config = _lab_config(front, fallback, {"router-a": first, "router-b": second}, {})
    servers = [line.split()[1] for line in config.split("backend http-app.m\n")[1].splitlines()
               if line.split()[:1] == ["server"]]
    assert servers == ["trt-router-SERVE_REPLICA--app-router-a", "trt-router-SERVE_REPLICA--app-router-b",
                       "SERVE_PROXY_ACTOR-n"]
    (tmp_path / "lab.cfg").write_text(config)
    processes = {}
    try:
        for port, name in ((first, "first"), (second, "second"), (fallback, "fallback")):
            processes[name] = subprocess.Popen([sys.executable, str(tmp_path / "backend.py"), str(port), name])
        processes["haproxy"] = subprocess.Popen([_real_haproxy(), "-db", "-f", str(tmp_path / "lab.cfg")])
        _until(lambda: _get(front, "/v2/models/m/ready") == (200, b"first"))
        processes["first"].kill()
        _until(lambda: _get(front, "/v2/models/m/ready") == (200, b"second"))
        # the router's own backend checks its servers apart (200 ms): until it marks the killed
        # one down, a request there may still be sent to it
        _until(lambda: _get(front, "/v2/health/ready") == (200, b"second"))
    finally:
        for process in processes.values():
            process.kill()
            process.wait()


@pytest.mark.parametrize(("routes", "missing"), [
    ({}, None),  # nothing routed: Serve starting, or stopped
    ({"models.ocr": "/v2/models/ocr", "models.ocr_cls": "/v2/models/ocr_cls"}, ["http-models"]),
    ({"models": "/", "models.ocr": "/v2/models/ocr"}, []),
    ({"models": "/api"}, []),
    ({"models": "/", "edge": "/edge", "edge.m": "/edge/v2/models/m"}, []),
    ({"models.m": "/v2/models/m", "edge": "/edge", "edge.m": "/edge/v2/models/m"}, ["http-models"]),
])
def test_the_routers_missing_from_rays_config_are_those_of_routed_model_applications(tmp_path, routes, missing):
    """A dedicated model's application ``<router>.<model>`` routed without its router's
    application: the router is missing (Serve routes each application once its ingress has a
    replica); with nothing routed, nothing is known by name."""
    config = _ray_haproxy_config(tmp_path, "127.0.0.1", routes).read_text()
    assert haproxy.routed_backends(config) == {f"http-{app}" for app in routes}
    assert haproxy.missing_routers(haproxy.routed_backends(config)) == missing


def _serve_ray_config(tmp_path: Path, name: str, routes: dict[str, str]) -> tuple[int, subprocess.Popen]:
    """Ray's config for ``routes`` (``_ray_haproxy_config``), rewritten as the wrapper does, run
    by the real HAProxy on free ports: (its front port, its process)."""
    front, stats, prometheus = (_free_port() for _ in range(3))
    folder = tmp_path / name
    folder.mkdir()
    config = haproxy.rewrite_config(_ray_haproxy_config(folder, "127.0.0.1", routes).read_text())
    config = (config.replace("127.0.0.1:8000", f"127.0.0.1:{front}").replace("127.0.0.1:8404", f"127.0.0.1:{stats}")
              .replace("127.0.0.1:9101", f"127.0.0.1:{prometheus}"))
    (folder / "rewritten.cfg").write_text(config)
    return front, subprocess.Popen([_real_haproxy(), "-db", "-f", str(folder / "rewritten.cfg")])


def test_a_path_no_application_takes_answers_503_until_the_router_is_routed_then_404_outside_its_prefix(tmp_path):
    """Ray's config with the models' applications routed but not their router's (as while
    ``make serve`` starts, or after Ctrl-C): a path none of them takes, a model the router
    serves, answers JSON 503 with Retry-After naming the router application; with the router
    routed at /api, a path outside /api is a genuine 404."""
    path = "/v2/models/simple/infer"
    models_only = {"models.ocr": "/v2/models/ocr", "models.ocr_cls": "/v2/models/ocr_cls"}
    with_router = {"models": "/api", "models.ocr": "/api/v2/models/ocr"}
    starting, starting_haproxy = _serve_ray_config(tmp_path, "starting", models_only)
    routed, routed_haproxy = _serve_ray_config(tmp_path, "routed", with_router)
    try:
        _until(lambda: _get(starting, "/") is not None and _get(routed, "/") is not None)
        assert _answer(starting, path) == (503, "application/json", "1", {
            "error": haproxy.ROUTER_UNROUTED_ANSWER.format(path=path, apps="'models'")})
        assert _answer(routed, path) == (
            404, "application/json", None, {"error": haproxy.UNROUTED_ANSWERS[404].format(path=path)})
    finally:
        for process in (starting_haproxy, routed_haproxy):
            process.kill()
            process.wait()


def _ray_pool_config(tmp_path: Path, prefix: str, pool_ports: dict[str, int], router_port: int,
                     ocr_port: int = 12) -> str:
    """Ray's HAProxy config (Ray 2.60's code) for a router application ``models`` at ``prefix``,
    a dedicated model's ``models.ocr`` and the pool's ``models.pool`` at ``<prefix>/v2/models``
    (servers ``pool_ports``: name -> port), rewritten as the wrapper does."""
    from ray.serve._private.haproxy import BackendConfig, HAProxyApi, HAProxyConfig, ServerConfig
    from ray.serve.config import HTTPOptions

    base = prefix.rstrip("/")
    cfg = HAProxyConfig(http_options=HTTPOptions(host="127.0.0.1", port=8000), socket_path=str(tmp_path / "admin.sock"),
                        server_state_base=str(tmp_path), server_state_file=str(tmp_path / "server-state"),
                        metrics_socket_path=str(tmp_path / "metrics.sock"))
    api = HAProxyApi(cfg=cfg, config_file_path=str(tmp_path / "haproxy.cfg"))
    backends = {"models": (prefix, {"router": router_port}), "models.ocr": (f"{base}/v2/models/ocr", {"ocr": ocr_port}),
                "models.pool": (f"{base}/v2/models", pool_ports)}
    api.set_backend_configs({f"http-{app}": BackendConfig(
        name=f"http-{app}", path_prefix=path, app_name=app,
        servers=[ServerConfig(name, "127.0.0.1", port) for name, port in servers.items()])
        for app, (path, servers) in backends.items()})
    api._generate_config_file_internal()
    return haproxy.rewrite_config((tmp_path / "haproxy.cfg").read_text())


def _pool_section(config: str) -> list[str]:
    section = config.split("backend http-models.pool\n")[1] + "\nbackend "
    return [line.strip() for line in section[:section.index("\nbackend ")].splitlines()]


@pytest.mark.parametrize(("prefix", "field"), [("/", 4), ("/api", 5)])
def test_the_pool_backend_is_balanced_by_the_hash_of_the_model_name(tmp_path, prefix, field):
    """In Ray's config the pool's backend gets the model-name hash (the path segment after
    ``<prefix>/v2/models/``) on a consistent ring with bounded loads; the router's and the
    dedicated model's backends keep Ray's least connections; rewriting again changes nothing."""
    config = _ray_pool_config(tmp_path, prefix, {"pool-a": 9, "pool-b": 10}, 11)
    assert haproxy.rewrite_config(config) == config
    rays = (tmp_path / "haproxy.cfg").read_text()  # every backend: a retry takes no stale server connection
    assert "http-reuse always" not in config
    assert config.count(f"http-reuse {haproxy.SERVER_CONNECTION_REUSE}") == rays.count("http-reuse always") == 3
    pool = _pool_section(config)
    assert pool[pool.index(haproxy.POOL_HASH_MARKER) + 1:][:3] == [
        f"balance hash path,field({field},/)", "hash-type consistent",
        f"hash-balance-factor {haproxy.POOL_HASH_BALANCE_FACTOR}"]
    assert config.count("balance hash") == 1 and "balance leastconn" in config  # Ray's default for the others
    alone = haproxy.rewrite_config(_ray_haproxy_config(tmp_path / "alone", "127.0.0.1", {  # routed before its router
        "models.pool": "/v2/models", "other.pool": "/other"}).read_text())
    assert "balance hash path,field(4,/)" in _pool_section(alone) and alone.count("balance hash") == 1
    without = config.replace("acl is_http-models.pool path_beg", "acl is_http-models.pool path_end")
    assert "balance hash" not in haproxy.hash_pool_models(without.replace(haproxy.POOL_HASH_MARKER, "#").replace(
        f"    balance hash path,field({field},/)\n", ""))  # no prefix to count from: Ray's balance stays


@contextlib.contextmanager
def _pool_haproxy(tmp_path: Path, ports: dict[str, int], map_file: Path | None = None) -> Iterator[tuple[int, int]]:
    """The real HAProxy on the rewritten config of a pool with servers ``ports`` (name -> port),
    a router and ``ocr``, each a small server answering with its name (with ``map_file``: the
    pool placed by that map, ``haproxy.place_pool_models``); yields the front and the stats
    ports once every server is up."""
    router, ocr, front, stats, prometheus = (_free_port() for _ in range(5))
    config = _ray_pool_config(tmp_path, "/", ports, router, ocr)
    config = config if map_file is None else haproxy.place_pool_models(config, str(map_file))
    config = (config.replace("127.0.0.1:8000", f"127.0.0.1:{front}").replace("*:8404", f"127.0.0.1:{stats}")
              .replace("127.0.0.1:8404", f"127.0.0.1:{stats}").replace("127.0.0.1:9101", f"127.0.0.1:{prometheus}"))
    (tmp_path / "pool.cfg").write_text(config)
    (tmp_path / "backend.py").write_text(_BACKEND)
    processes = [subprocess.Popen([sys.executable, str(tmp_path / "backend.py"), str(port), name])
                 for name, port in {**ports, "router": router, "ocr": ocr}.items()]
    processes.append(subprocess.Popen([_real_haproxy(), "-db", "-f", str(tmp_path / "pool.cfg")]))
    try:
        _until(lambda: all(_get(port, "/") is not None for port in ports.values()), 60)
        # HAProxy's own view: every server of the lab UP (its health checks pass, rise 2), the
        # pool's, the router's and ocr's, read from its stats page, however long a busy machine takes
        _until(lambda: _all_servers_up(stats) and _servers_up(stats) >= set(ports), 60)
        yield front, stats
    finally:
        for process in processes:
            process.kill()
            process.wait()


def test_haproxy_sends_each_pool_models_requests_to_one_replica_and_spreads_the_models(tmp_path):
    """On the real HAProxy with the rewritten config: every request for one pool model (its
    routes, any version) reaches the same pool replica, and 16 models spread over the three."""
    ports = {name: _free_port() for name in ("pool-a", "pool-b", "pool-c")}
    with _pool_haproxy(tmp_path, ports) as (front, _):
        chosen = {}
        for i in range(16):
            paths = [f"/v2/models/m{i}/ready", f"/v2/models/m{i}", f"/v2/models/m{i}/versions/2/ready"] * 3
            answers = {_get(front, path) for path in paths}
            assert len(answers) == 1, (i, answers)
            [(status, by)] = answers
            assert status == 200 and by.decode() in ports, (i, status, by)
            chosen[f"m{i}"] = by.decode()
        assert len(set(chosen.values())) >= 2, chosen
        assert _get(front, "/v2/health/ready") == (200, b"router")
        assert _get(front, "/v2/models/ocr/ready") == (200, b"ocr")


def _server_states(stats_port: int) -> dict[tuple[str, str], str]:
    """(backend, server) -> status of every server HAProxy's stats page (CSV) lists ({} while it
    does not answer)."""
    answer = _get(stats_port, "/stats;csv")
    if answer is None or answer[0] != 200:
        return {}
    rows = [line.split(",") for line in answer[1].decode().splitlines() if not line.startswith("#")]
    return {(row[0], row[1]): row[17] for row in rows if len(row) > 17 and row[1] not in ("FRONTEND", "BACKEND")}


def _servers_up(stats_port: int) -> set[str]:
    """The names of the servers HAProxy lists UP."""
    return {server for (_, server), status in _server_states(stats_port).items() if status.startswith("UP")}


def _all_servers_up(stats_port: int) -> bool:
    """Whether HAProxy lists servers and every one is UP."""
    states = _server_states(stats_port)
    return bool(states) and all(status.startswith("UP") for status in states.values())


def _pool_models_replicas(tmp_path: Path, ports: dict[str, int], models: int) -> dict[str, str]:
    """On the real HAProxy with the rewritten config of a pool with servers ``ports`` (name ->
    port): the server each of ``models`` pool models' requests reach."""
    with _pool_haproxy(tmp_path, ports) as (front, stats):
        def read() -> dict[str, str]:
            chosen = {}
            for i in range(models):
                answer = _get(front, f"/v2/models/m{i}/ready", timeout_s=60)
                assert answer is not None and answer[0] == 200, answer
                chosen[f"m{i}"] = answer[1].decode()
            return chosen

        # the ring of the servers all UP: a reading during which HAProxy marked a server down (a
        # health check or a request that failed on a loaded machine) is taken again
        for _ in range(5):
            _until(lambda: _all_servers_up(stats), 60)
            chosen = read()
            if _all_servers_up(stats) and read() == chosen:
                return chosen
        raise AssertionError("HAProxy's servers did not stay UP through one reading of the models")


def test_a_pool_replica_that_goes_moves_only_its_own_models(tmp_path):
    """Ray lists the running replicas, so one that dies or is scaled down leaves the list and the
    servers after it move up; HAProxy's ring places a server by its id, by default its position:
    without an id of its own, 22 of the 39 models on the 3 remaining replicas moved too (and each
    replica had to load another's). With ids from the servers' names only the gone replica's
    models move."""
    ports = {name: _free_port() for name in ("pool-a", "pool-b", "pool-c", "pool-d")}
    (tmp_path / "four").mkdir()
    (tmp_path / "three").mkdir()
    before = _pool_models_replicas(tmp_path / "four", ports, 48)
    after = _pool_models_replicas(tmp_path / "three", {n: p for n, p in ports.items() if n != "pool-b"}, 48)
    stayed = {model for model, server in before.items() if server != "pool-b"}
    assert len(set(before.values())) >= 3 and stayed, before
    assert {model: after[model] for model in stayed} == {model: before[model] for model in stayed}


def test_the_pool_servers_ids_come_from_their_names(tmp_path):
    """Each pool server's ``id`` follows its name, whatever its place in the list; other backends'
    servers keep HAProxy's numbering; rewriting again changes nothing."""
    config = _ray_pool_config(tmp_path, "/", {"pool-a": 9, "pool-b": 10, "pool-c": 11}, 12, 13)
    (tmp_path / "fewer").mkdir()
    fewer = _ray_pool_config(tmp_path / "fewer", "/", {"pool-c": 11, "pool-a": 9}, 12, 13)
    ids = {line.split()[1]: line.split()[-1] for line in _pool_section(config) if line.startswith("server ")}
    assert ids["pool-a"] == str(haproxy.pool_server_id("pool-a", set())) and len(set(ids.values())) == len(ids)
    assert {line.split()[1]: line.split()[-1] for line in _pool_section(fewer) if line.startswith("server pool-")} == {
        "pool-a": ids["pool-a"], "pool-c": ids["pool-c"]}
    assert all(int(i) >= haproxy.POOL_SERVER_ID_BASE for i in ids.values())
    servers = [line.strip() for line in config.splitlines() if line.strip().startswith("server ")]
    assert sum(" id " in line for line in servers) == len(ids) < len(servers)  # the router's, ocr's: none
    assert haproxy.rewrite_config(config) == config
    assert haproxy.pool_server_id("x", {haproxy.pool_server_id("x", set())}) != haproxy.pool_server_id("x", set())


def test_haproxy_sends_a_placed_pool_model_to_its_replicas_and_follows_a_new_placement_at_once(tmp_path):
    """With the placement's map (``place_pool_models``): a model placed on one replica reaches
    it alone; one with two copies reaches one of them; a copy the backend does not have is
    passed over; a model the map does not name, or names only a server that is not there, is
    hashed as before. A placement published through the admin socket takes effect at once,
    and its file is what a reload would read."""
    ports = {name: _free_port() for name in ("pool-a", "pool-b", "pool-c")}
    map_file = tmp_path / "placement.map"
    entries = haproxy.placement_map({"m0": ["pool-b"], "m1": ["pool-a", "pool-c"], "m2": ["gone"],
                                     "m3": ["gone", "pool-c"]})
    map_file.write_text("".join(f"{k} {v}\n" for k, v in entries.items()))
    assert entries["m1"] == "pool-a+pool-c"
    with _pool_haproxy(tmp_path, ports, map_file) as (front, _):
        def servers(model: str, n: int) -> set[str]:
            out = set()
            for _ in range(n):
                answer = _get(front, f"/v2/models/{model}/ready", timeout_s=30)
                assert answer is not None and answer[0] == 200, answer
                out.add(answer[1].decode())
            return out

        assert servers("m0", 20) == {"pool-b"}
        assert servers("m1", 20) <= {"pool-a", "pool-c"}
        assert servers("m3", 10) == {"pool-c"}
        hashed = servers("m9", 5)
        assert len(hashed) == 1 and hashed <= set(ports)
        assert len(servers("m2", 10)) == 1  # a gone server's model is hashed to one live replica
        error = haproxy.publish_placement(str(map_file), str(tmp_path / "admin.sock"),
                                          haproxy.placement_map({"m0": ["pool-c"], "m1": ["pool-b"]}))
        assert error is None
        assert servers("m0", 10) == {"pool-c"} and servers("m1", 10) == {"pool-b"}
        assert map_file.read_text().splitlines()[0] == "m0 pool-c"


def _in_flight(stats_port: int, server: str) -> int:
    """The requests HAProxy's stats page (CSV: ``scur``) shows ``server`` holding now (-1 while
    it does not answer)."""
    answer = _get(stats_port, "/stats;csv")
    if answer is None or answer[0] != 200:
        return -1
    rows = [line.split(",") for line in answer[1].decode().splitlines() if not line.startswith("#")]
    return sum(int(row[4]) for row in rows if len(row) > 4 and row[1] == server and row[0].endswith(".pool"))


def test_a_placed_models_requests_go_to_the_copy_holding_the_fewest_requests(tmp_path):
    """A model with copies on pool-a and pool-c: while pool-a holds two requests (of another
    model placed there alone) and pool-c none, every request goes to pool-c; once pool-c holds
    three, every one goes to pool-a. (A copy drawn at random per request sent half of them to
    the busy replica.)"""
    ports = {name: _free_port() for name in ("pool-a", "pool-b", "pool-c")}
    map_file = tmp_path / "placement.map"
    entries = haproxy.placement_map({"m1": ["pool-a", "pool-c"], "on-a": ["pool-a"], "on-c": ["pool-c"]})
    map_file.write_text("".join(f"{k} {v}\n" for k, v in entries.items()))
    with _pool_haproxy(tmp_path, ports, map_file) as (front, stats):
        def hold(model: str, count: int, server: str) -> None:
            for _ in range(count):
                threading.Thread(target=_get, args=(front, f"/v2/models/{model}/hold", 600), daemon=True).start()
            _until(lambda: _in_flight(stats, server) >= count, 60)

        def answers(n: int) -> list[str]:
            out = []
            for _ in range(n):
                answer = _get(front, "/v2/models/m1/ready", timeout_s=30)
                assert answer is not None and answer[0] == 200, answer
                out.append(answer[1].decode())
            return out

        hold("on-a", 2, "pool-a")
        assert answers(20) == ["pool-c"] * 20
        hold("on-c", 3, "pool-c")
        assert answers(20) == ["pool-a"] * 20


def test_the_placement_rules_go_into_the_hashed_pool_backend_only(tmp_path):
    config = _ray_pool_config(tmp_path, "/api", {"pool-a": 9}, 11)
    placed = haproxy.rewrite_config(config, "/x/placement.map")
    assert haproxy.place_pool_models(placed, "/x/placement.map") == placed
    pool = _pool_section(placed)
    assert pool[pool.index(haproxy.PLACEMENT_MARKER) + 1] == (
        "http-request set-var(txn.trt_placed) path,field(5,/),map(/x/placement.map)")
    assert sum(line.startswith("use-server") for line in pool) == 1
    assert "http-request set-var(txn.trt_load1) srv_conn(http-models.pool/pool-a) if { var(txn.trt_copy1) -m str " \
        "pool-a } { srv_is_up(http-models.pool/pool-a) }" in pool
    assert haproxy.publish_placement(str(tmp_path / "p.map"), None, {"m": "a"}) == "no HAProxy admin socket"
    assert (tmp_path / "p.map").read_text() == "m a\n"


@contextlib.contextmanager
def _process_with_args(*args: str) -> Iterator[int]:
    """A process whose command line ends in ``args`` (as a raylet's names its session); its pid."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", *args])
    try:
        # Popen returns once the child execs (vfork), which can be before the kernel has set the
        # new command line: an empty /proc/<pid>/cmdline for a moment (a raylet's is long set)
        deadline = time.monotonic() + 30
        while args[-1].encode() not in Path(f"/proc/{process.pid}/cmdline").read_bytes():
            assert time.monotonic() < deadline, "the child's command line never showed its arguments"
            time.sleep(0.01)
        yield process.pid
    finally:
        process.kill()
        process.wait()


def test_the_cluster_id_is_the_session_name_on_the_command_line_of_the_nodes_raylet():
    with _process_with_args("--node-ip-address=127.0.0.1", "--session-name=session_2026_a_1", "--gcs-address=x") as pid:
        assert haproxy.cluster_id({"RAY_RAYLET_PID": str(pid)}) == "session_2026_a_1"
    with _process_with_args("--node-ip-address=127.0.0.1") as pid:
        assert haproxy.cluster_id({"RAY_RAYLET_PID": str(pid)}) is None
    assert haproxy.cluster_id({}) is None  # not a Ray worker (a test, a driver): nothing to check


def test_each_http_frontend_names_its_cluster_on_every_request_and_haproxy_accepts_it(tmp_path):
    """The rewrite sets ``X-Trt-Serve-Cluster`` in Ray's HTTP frontend (not Prometheus'), once,
    and HAProxy accepts the config; without a cluster id nothing is set."""
    rays = _ray_haproxy_config(tmp_path, "127.0.0.1", {"models": "/"}).read_text()
    config = haproxy.rewrite_config(rays, cluster="session_a")
    assert haproxy.rewrite_config(config, cluster="session_a") == config
    front = config.split("frontend http_frontend\n")[1].split("\nbackend ")[0]
    assert front.count(f"http-request set-header {haproxy.CLUSTER_HEADER} session_a") == 1
    assert haproxy.CLUSTER_HEADER not in config.split("frontend prometheus\n")[1].split("frontend http_frontend")[0]
    assert haproxy.CLUSTER_HEADER not in haproxy.rewrite_config(rays)
    path = tmp_path / "rewritten.cfg"
    path.write_text(config)
    done = subprocess.run([_real_haproxy(), "-c", "-f", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    with pytest.raises(ValueError, match="cluster id"):
        haproxy.mark_cluster(rays, "a b")


_HEADER_ECHO = '''
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args): pass
    def do_GET(self):
        body = json.dumps(self.headers.get_all("X-Trt-Serve-Cluster") or []).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
'''


def test_the_wrapper_stamps_its_clusters_id_and_a_clients_own_header_does_not_reach_the_replica(tmp_path):
    """As Ray runs it (``RAY_RAYLET_PID`` in its environment), the wrapper's HAProxy sends each
    request to the replica with exactly one ``X-Trt-Serve-Cluster``: its raylet's session name,
    whatever the client sent in that header."""
    front, stats, prometheus, replica = (_free_port() for _ in range(4))
    path = _ray_haproxy_config(tmp_path, "127.0.0.1", {"models": "/"})
    path.write_text(path.read_text().replace("127.0.0.1:8000", f"127.0.0.1:{front}")
                    .replace("*:8404", f"*:{stats}").replace(":9101", f":{prometheus}")
                    .replace("127.0.0.1:9 ", f"127.0.0.1:{replica} "))
    echo = subprocess.Popen([sys.executable, "-c", _HEADER_ECHO, str(replica)])
    with _process_with_args("--session-name=session_ours") as raylet:
        env = dict(os.environ, RAY_RAYLET_PID=str(raylet), **{haproxy.REAL_BINARY_ENV: _real_haproxy()})
        server = subprocess.Popen([str(WRAPPER), "-db", "-f", str(path)], env=env)
        try:
            _until(lambda: (_get(front, "/x") or (0,))[0] == 200)
            conn = http.client.HTTPConnection(haproxy.LOOPBACK, front, timeout=5)
            conn.request("GET", "/x", headers={"X-Trt-Serve-Cluster": "session_theirs"})
            response = conn.getresponse()
            assert (response.status, json.loads(response.read())) == (200, ["session_ours"])
            assert json.loads(_get(front, "/x")[1]) == ["session_ours"]
        finally:
            for process in (server, echo):
                process.kill()
                process.wait()
