"""``python -m deployments.run [serve_config.yaml]``: what ``make serve`` runs.

1. ``deployments.check`` on the config, before Ray starts: a bad config stops here with one
   line (file, field, what is allowed) and exit status 2; so does an HTTP port that something
   else listens on (``port_taken``).
2. Ray Serve's own ``serve run <config>`` (``ray.serve.scripts.run``), in this process.
3. A deploy that fails anyway (an application ``DEPLOY_FAILED`` in ``serve.status()``, polled
   every ``STATUS_POLL_S`` until every application runs) prints
   ``deploy failed: application '<name>': <Serve's message>`` on stderr, stops as Ctrl-C does
   and exits 1. Plain ``serve run`` keeps running after a failed deploy: it submits the
   config and sleeps (``ray.serve.scripts.run``: ``while True: time.sleep(10)``).
4. Ctrl-C answers the requests in flight and stops in seconds. ``serve run`` meets Ctrl-C with
   ``serve.shutdown()``, which kills the HAProxy ingress process at once
   (``HAProxyManager.stop`` sends SIGKILL) while the replicas still drain, so a request in
   flight through HAProxy was cut. Here the first Ctrl-C deletes the applications first
   (every replica finishes its requests while HAProxy still runs), polling ``serve.status()``
   every ``app.DELETE_POLL_S`` until they are gone (``serve.delete`` polls every 1 s), then lets
   ``serve run`` shut Serve down as usual, then stops Ray (``stop_ray``: 1.5 s sooner than
   Ray's exit hook). A second Ctrl-C skips the wait.

Before any of it, the environment that keeps a local cluster on 127.0.0.1 (``deployments.loopback``:
Ray's single-machine mode, HAProxy's stats and Prometheus listeners on loopback at ports that
are free): nothing this command starts listens on another interface.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Sequence

import yaml

from . import check, loopback
from .haproxy import haproxy_folder

STATUS_POLL_S = 1.0  # seconds between checks for DEPLOY_FAILED while the applications start
# Serve's controller ends its own shutdown with ``ray.kill`` on itself while ``serve.shutdown()``
# still waits on its ``graceful_shutdown`` (``ray/serve/_private/controller.py``, ``shutdown``;
# ``client.py`` catches the RayActorError), and Ray reports that call as a failed task: by design.
STOPPING_LINE = ("stopping: the requests in flight are answered first; a 'Task ServeController.graceful_shutdown "
                 "failed ... killed by ray.kill' line that Ray may print is how Serve's controller exits, not an error")


def _delete_then_interrupt(app_names: list[str]):
    """A SIGINT handler: delete the applications (blocking), then ``KeyboardInterrupt``."""

    def handler(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C: stop waiting
        print(STOPPING_LINE, file=sys.stderr, flush=True)
        try:
            from .app import delete_applications  # imports Ray: only once the environment is set

            delete_applications(app_names)
        except Exception:  # Serve not started yet, or already gone: nothing to drain
            pass
        raise KeyboardInterrupt

    return handler


def config_for_proxy(path: Path, environ: dict[str, str] | None = None) -> Path:
    """The config ``serve run`` gets: with HAProxy on (``RAY_SERVE_ENABLE_HA_PROXY=1``, ``make
    serve``) ``config_for_grpc``'s (``path`` itself, or a copy with Serve's ``grpc_options``); with Serve's Python proxy (``make serve FAST=0``) a copy beside it in which
    the models' applications have no route prefix, so the router answers their routes (two
    hops): one hop needs HAProxy (docs/placement.md, "Where a request goes"), and the copy says why on
    stderr. ``path`` unchanged where no model application has a prefix."""
    environ = os.environ if environ is None else environ
    if environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":
        return config_for_grpc(path)
    prefixed = {app.name for app in check.model_applications_of(path) if app.route_prefix is not None}
    config = yaml.safe_load(path.read_text())
    models = [app for app in config["applications"] if app["name"] in prefixed]
    if not models:
        return path
    for app in models:
        app["route_prefix"] = None
    copy = path.with_name(f".{path.stem}.python-proxy.yaml")
    copy.write_text(f"# {path} for Serve's Python proxy, written by `python -m deployments.run`: the models' "
                    "applications without route prefixes\n" + yaml.safe_dump(config, sort_keys=False))
    print(f"Serve's Python proxy (no HAProxy): {[a['name'] for a in models]} get no route prefix; the router "
          f"answers their routes (one hop needs HAProxy: make serve without FAST=0). Serving {copy}", file=sys.stderr)
    return copy


def router_grpc_port(config: dict) -> int | None:
    """The router application's ``grpc_port`` in a Serve config (its default where unset); None
    for ``null``, or where the config has no one router application."""
    from .app import AppArgs

    routers = [app for app in config.get("applications") or [] if not (app.get("args") or {}).get("model")]
    if len(routers) != 1:
        return None
    return (routers[0].get("args") or {}).get("grpc_port", AppArgs.model_fields["grpc_port"].default)


def config_for_grpc(path: Path) -> Path:
    """With HAProxy: ``path`` itself where the router application serves no gRPC (``grpc_port:
    null``), else a copy beside it whose ``grpc_options`` have Serve serve KServe v2 gRPC on
    ``grpc_port`` (``grpc_service.SERVE_SERVICER``; HAProxy binds the port and sends each
    ModelInfer to the replicas of the model its message names: docs/architecture.md, "The gRPC
    front door"). Servicer functions the config's own ``grpc_options`` name are kept."""
    from .grpc_service import SERVE_SERVICER

    config = yaml.safe_load(path.read_text())
    port = router_grpc_port(config)
    if port is None:
        return path
    options = dict(config.get("grpc_options") or {})
    functions = list(options.get("grpc_servicer_functions") or [])
    config["grpc_options"] = {**options, "port": port,
                              "grpc_servicer_functions": functions + [SERVE_SERVICER] * (SERVE_SERVICER not in functions)}
    copy = path.with_name(f".{path.stem}.grpc.yaml")
    copy.write_text(f"# {path} with Serve's gRPC on grpc_port {port} (KServe v2, through HAProxy), written by "
                    "`python -m deployments.run`\n" + yaml.safe_dump(config, sort_keys=False))
    print(f"KServe v2 gRPC on port {port} through HAProxy (Serve's grpc_options added): serving {copy}", file=sys.stderr)
    return copy


def _bind_error(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound now (the OS's words), or None when it can. With
    ``SO_REUSEADDR``, as servers bind: a closed socket's TIME_WAIT is no owner."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None


def port_taken(path: Path, environ: dict[str, str] | None = None) -> str | None:
    """The line to print when ``path``'s HTTP port (``http_options``: Ray's defaults 127.0.0.1
    and 8000), or with HAProxy its gRPC port (the router's ``grpc_port``, which HAProxy binds:
    ``config_for_grpc``), is taken on this machine, else None. Only where this command starts
    the cluster (no ``RAY_ADDRESS``): Serve on a running cluster holds its own port. Ray would
    start anyway and its proxy (HAProxy, or Serve's Python proxy) would retry binding forever,
    with no error on the terminal: a second ``make serve`` hung silently."""
    environ = os.environ if environ is None else environ
    if environ.get("RAY_ADDRESS"):
        return None
    config = yaml.safe_load(path.read_text()) or {}
    options = config.get("http_options") or {}
    host, port = options.get("host") or "127.0.0.1", int(options.get("port") or 8000)
    grpc_port = router_grpc_port(config) if environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1" else None
    for port, setting in ((port, "http_options"), (grpc_port, "router application's args, grpc_port")):
        error = None if port is None else _bind_error(host, port)
        if error is not None:
            return (f"port {port} on {host} is taken ({error}): another server (an earlier `make serve`?) "
                    f"listens there; stop it, or set another port in {path}'s {setting}")
    return None


def metrics_port_taken(path: Path, environ: dict[str, str] | None = None) -> str | None:
    """The warning to print when a node metrics port of ``path``'s applications (``args.metrics.port``,
    default 8002: ``observe.options.MetricsOptions``) is taken on 127.0.0.1, else None (as
    ``port_taken``, only where this command starts the cluster). The server starts: its
    replicas serve ``:port/metrics`` once the port is free, and until then a scrape there reads
    whatever holds it, another server's series included (a scrape lagging this server's
    answers by seconds); the router's ``GET /metrics`` is this server's."""
    from .observe.options import MetricsOptions

    environ = os.environ if environ is None else environ
    if environ.get("RAY_ADDRESS"):
        return None
    ports = set()
    for app in (yaml.safe_load(path.read_text()) or {}).get("applications") or []:
        if app.get("import_path") == check.APP_IMPORT_PATH:
            options = MetricsOptions.model_validate((app.get("args") or {}).get("metrics") or {})
            if options.enabled and options.port is not None:
                ports.add(options.port)
    taken = {port: error for port in sorted(ports) if (error := _bind_error(loopback.LOOPBACK, port)) is not None}
    if not taken:
        return None
    return (f"metrics port(s) {sorted(taken)} on {loopback.LOOPBACK} taken ({next(iter(taken.values()))}): until "
            f"free, a scrape of :port/metrics reads what holds it (another server's series?), not this server's; "
            f"GET /metrics through the HTTP port is this server's. Stop the other server, or set args.metrics.port "
            f"in {path}")


def _stay_on_loopback() -> bool:
    """Set ``loopback.local_env`` in this process's environment (before Ray is imported: it
    reads some of it at import); whether HAProxy runs through ``deployments/haproxy.py``."""
    added = loopback.local_env(os.environ)
    os.environ.update(added)
    return "RAY_SERVE_HAPROXY_BINARY_PATH" in added


def retry_buffer_env(path: Path, environ: dict[str, str] | None = None) -> dict[str, str]:
    """``{RAY_SERVE_HAPROXY_TUNE_BUFSIZE: bytes, ...}`` for the config at ``path``, to set before
    Ray starts (Ray's HAProxy manager reads it as it starts): a buffer that holds a request of
    its router applications' ``retry_body_mib`` (at most their ``max_body_mib``; the largest of
    them) whole, so that HAProxy sends it again when the replica holding it dies, and HTTP/2
    frames to match and a larger window (``haproxy.buffer_env``). Empty where HAProxy is off;
    each variable the user set stands (a buffer of the user's: no frame size either).

    Raises:
        ConfigError: as ``check``'s reading of ``path``.
    """
    from .app import AppArgs
    from .haproxy import BUFSIZE_ENV, H2_FRAME_ENV, buffer_env
    from .runtime.contract.units import mib_to_bytes

    environ = os.environ if environ is None else environ
    if environ.get("RAY_SERVE_ENABLE_HA_PROXY") != "1":
        return {}
    routers = [AppArgs.model_validate(app.args or {}) for app in check.router_applications_of(path)]
    if not routers:
        return {}
    body = max(mib_to_bytes(min(args.retry_body_mib, args.max_body_mib)) for args in routers)
    env = buffer_env(body)
    if BUFSIZE_ENV in environ:  # the user's buffer: frames sized for this one might not fit it
        env.pop(BUFSIZE_ENV), env.pop(H2_FRAME_ENV)
    return {name: value for name, value in env.items() if name not in environ}


class HAProxyWatch:
    """What ``make serve`` says about HAProxy's side ports: where they are once HAProxy took
    them (the wrapper's record, ``haproxy.choose_side_ports``: a port taken since start is
    exchanged for a free one then), and the one line of a bind that failed all the same.

    Args:
        record: the wrapper's record beside Ray's HAProxy config (``<config>.ports.json``).
        logs: the folder and file-name glob of HAProxy's stderr logs (Ray's, beside its socket).
        since: ``time.time()`` at start; older logs are an earlier run's.
    """

    def __init__(self, record: Path, logs: tuple[Path, str], since: float) -> None:
        self.record, self.logs, self.since = record, logs, since
        self.announced = False

    def lines(self) -> tuple[list[str], str | None]:
        """The lines to print now (the ports, once) and the bind failure's, if HAProxy logged one."""
        from .haproxy import HAPROXY_DEFAULT_PORTS, SIDE_PORTS, bind_failure

        out = []
        try:
            ports = {k: int(v) for k, v in json.loads(self.record.read_text()).items()}
        except (OSError, ValueError):
            ports = {}
        if ports and not self.announced:
            self.announced = True
            stats, metrics = (ports.get(v) for v, _ in SIDE_PORTS.values())
            moved = [f"{os.environ.get(v, HAPROXY_DEFAULT_PORTS[v])} was taken ({v})" for v, port in ports.items()
                     if str(port) != os.environ.get(v, str(HAPROXY_DEFAULT_PORTS[v]))]
            out.append(f"HAProxy stats: http://{loopback.LOOPBACK}:{stats}/stats, Prometheus: "
                       f"http://{loopback.LOOPBACK}:{metrics}/metrics" + (f" ({'; '.join(moved)})" if moved else ""))
        folder, pattern = self.logs
        expected = ports or {v: int(os.environ.get(v, p)) for v, p in HAPROXY_DEFAULT_PORTS.items()}
        for log in folder.glob(pattern):
            try:
                if log.stat().st_mtime >= self.since and (failure := bind_failure(log.read_text(), expected)):
                    return out, failure
            except OSError:  # Ray removed it meanwhile
                continue
        return out, None


def haproxy_watch() -> HAProxyWatch:
    """The ``HAProxyWatch`` of the HAProxy this process's Ray will start (Ray's file locations,
    read from the environment set by ``_stay_on_loopback``); an earlier run's record removed."""
    from ray.serve._private.constants import RAY_SERVE_HAPROXY_CONFIG_FILE_LOC, RAY_SERVE_HAPROXY_SOCKET_PATH

    from .haproxy import PORTS_SUFFIX

    record = Path(RAY_SERVE_HAPROXY_CONFIG_FILE_LOC + PORTS_SUFFIX)
    try:
        record.unlink(missing_ok=True)
    except OSError:  # another user's: the wrapper cannot write it either, and says so
        pass
    socket_path = Path(RAY_SERVE_HAPROXY_SOCKET_PATH)
    return HAProxyWatch(record, (socket_path.parent, f"{socket_path.name}.*.stderr.log"), time.time())


def _watch_haproxy(watch: HAProxyWatch, failures: list[str]) -> None:
    """Print ``watch``'s lines as they come; on a bind failure record it in ``failures`` and
    send this process SIGINT (stop as Ctrl-C does)."""
    while True:
        time.sleep(STATUS_POLL_S)
        lines, failure = watch.lines()
        for line in lines:
            print(line, file=sys.stderr, flush=True)
        if failure is not None:
            print(failure, file=sys.stderr, flush=True)
            failures.append(failure)
            os.kill(os.getpid(), signal.SIGINT)
            return


def stop_ray() -> None:
    """``ray.shutdown()``, called before the interpreter exits (Ray's own exit hook first
    sleeps 0.5 s for late log lines). Where this process started the local cluster, Ray's
    autoscaler monitor is killed first: ``ray.shutdown()`` stops the GCS before it, and the
    monitor's SIGTERM handler then waits on the GCS until Ray kills it 1 s later (a local
    cluster has nothing to autoscale). Reaches into ``ray._private`` (Ray 2.60, pinned in
    pyproject.toml); without that attribute only the 1 s is lost."""
    import ray
    from ray._private import worker

    node = getattr(worker, "_global_node", None)
    for info in getattr(node, "all_processes", {}).get("monitor", []):
        if info.process.poll() is None:
            info.process.kill()
    ray.shutdown()


def deploy_failure(statuses: dict, app_names: list[str]) -> str | None:
    """The line to print for the first of ``app_names`` whose status is ``DEPLOY_FAILED``, else None.

    Args:
        statuses: ``serve.status().applications`` (name -> ``ApplicationStatusOverview``).
    """
    for name in app_names:
        app = statuses.get(name)
        if app is not None and app.status == "DEPLOY_FAILED":
            return f"deploy failed: application '{name}': {app.message.strip()}"
    return None


def _watch_deploy(app_names: list[str], failures: list[str]) -> None:
    """Poll ``serve.status()`` until every application runs; on ``DEPLOY_FAILED`` print the
    line, record it in ``failures`` and send this process SIGINT (stop as Ctrl-C does)."""
    import ray
    from ray import serve

    while True:
        time.sleep(STATUS_POLL_S)
        if not ray.is_initialized():
            continue
        try:
            statuses = serve.status().applications
        except Exception:  # the controller is starting or stopping: ask again
            continue
        line = deploy_failure(statuses, app_names)
        if line is not None:
            print(line, file=sys.stderr, flush=True)
            failures.append(line)
            os.kill(os.getpid(), signal.SIGINT)
            return
        if all(name in statuses and statuses[name].status == "RUNNING" for name in app_names):
            return


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    path = Path(args[0] if args else "serve_config.yaml")
    wrapped = _stay_on_loopback()
    status = check.main([str(path)])
    if status:
        return status
    os.environ.update(retry_buffer_env(path))
    taken = port_taken(path)
    if taken:
        print(taken, file=sys.stderr)
        return 2
    metrics_taken = metrics_port_taken(path)
    if metrics_taken:
        print(f"warning: {metrics_taken}", file=sys.stderr)
    from ray.serve.schema import ServeDeploySchema
    from ray.serve.scripts import run

    path = config_for_proxy(path)
    schema = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    app_names = [app.name for app in schema.applications]
    signal.signal(signal.SIGINT, _delete_then_interrupt(app_names))
    failures: list[str] = []
    threading.Thread(target=_watch_deploy, args=(app_names, failures), daemon=True).start()
    if wrapped:
        threading.Thread(target=_watch_haproxy, args=(haproxy_watch(), failures), daemon=True).start()
    try:
        hook = ["--runtime-env-json", json.dumps({"worker_process_setup_hook": loopback.WORKER_SETUP_HOOK})]
        run.main([str(path), *(hook if wrapped else [])], prog_name="serve run", standalone_mode=False)
    except SystemExit:  # serve run's own exit after its shutdown
        pass
    finally:
        stop_ray()
        if wrapped and os.environ.get("RAY_SERVE_HAPROXY_SERVER_STATE_BASE") == haproxy_folder(os.getpid()):
            shutil.rmtree(haproxy_folder(os.getpid()), ignore_errors=True)  # this run's own (loopback.local_env)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
