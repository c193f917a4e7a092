"""Router replicas under load through `make serve`'s HAProxy: a timeline of their count and QPS.

Starts ``python -m deployments.run`` with ``make serve``'s environment (HAProxy ingress, Ray's
throughput-optimized mode) on a copy of ``serve_config.yaml``'s router application over a
repository of one pool model (``simple`` by default: Triton's quickstart add/sub, so the time a
request takes is the serving path's, not the model's) reached through the router (the pool's
application without a route prefix: ``write_config``), its router's ``autoscaling`` given
``--autoscaling`` over the defaults (short delays, so the test fits in a minute or two). Then,
once a second: idle (``--idle-s``), ``--clients`` closed-loop clients (``--load-s`` per step), idle
again until one router replica is left (at most ``--after-s``). Each second's row: seconds
since the load began, router replica processes (``bench.replicas``: Ray's process titles),
the servers HAProxy lists in the router's backend and how many of them took requests in that
second (its stats page, CSV), answers in that second (QPS), errors, the router replicas' RSS;
and the requests HAProxy sent to Ray's fallback proxy, the only caller with a deployment handle
in front of the router (none: the router's replicas counted the load themselves). ``--fast 0``:
Serve's Python proxy instead of HAProxy (``make serve FAST=0``), whose handle counts them.

    flock /tmp/ray-heavy.lock .venv/bin/python -m bench.autoscale --clients 32 --load-s 60

Results: a markdown table on stdout, JSON in ``bench/results/autoscale.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import io
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Sequence

import yaml

from bench.replicas import interrupt_group, replica_pids, rss_bytes

ROOT = Path(__file__).resolve().parents[1]
APP = "models"
# What the timeline needs to show a rise and a fall within minutes: decisions on 2 s of
# metrics pushed every 0.5 s, acted on after 2 s up and 10 s down; up to 4 replicas whatever
# the cores (the default gives a 2-core machine 1).
SHORT_DELAYS = {"max_replicas": 4, "upscale_delay_s": 2, "downscale_delay_s": 10, "look_back_period_s": 2, "metrics_interval_s": 0.5}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_env(fast: int = 1) -> dict[str, str]:
    """``make serve``'s environment variables (``make print-serve-env FAST=<fast>``)."""
    words = shlex.split(subprocess.run(["make", "-s", "print-serve-env", f"FAST={fast}"], cwd=ROOT,
                                       capture_output=True, text=True, check=True).stdout)
    return dict(w.split("=", 1) for w in words if "=" in w)


def start_runner(config: Path, log: Path, fast: int = 1, **env: str) -> subprocess.Popen:
    """``make serve``'s runner (``python -m deployments.run config``) with its environment
    (``serve_env``) and ``env`` over it, this checkout first on ``PYTHONPATH``, output to
    ``log``, in a session of its own (``bench.replicas`` finds its processes by it;
    ``interrupt_group`` stops it as Ctrl-C does)."""
    full = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                **serve_env(fast), **env)
    full.pop("RAY_ADDRESS", None)
    with log.open("w") as out:
        return subprocess.Popen([sys.executable, "-m", "deployments.run", str(config)], cwd=ROOT, env=full,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def write_config(tmp: Path, model: str, port: int, router: dict[str, Any]) -> Path:
    """``serve_config.yaml``'s router application on a repository of ``model`` (a pool model),
    listening on ``port``, ``args.router`` = ``router``; the pool's application without a route
    prefix, so that ``model``'s requests cross the router (as ``make serve FAST=0`` serves them;
    with it, HAProxy would send them to the pool replica in one hop)."""
    from deployments.check import write

    root = tmp / "engines"
    (root / model / "1").mkdir(parents=True)
    shutil.copy(ROOT / "engines" / model / "config.yaml", root / model / "config.yaml")
    (root / model / "1" / "model.onnx").symlink_to((ROOT / "engines" / model / "1" / "model.onnx").resolve())
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config["http_options"]["port"] = port
    config["applications"] = [app := config["applications"][0]]
    app["args"].update(repository=str(root), router=router, metrics={"port": _free_port()})
    path = tmp / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    write(path)
    config = yaml.safe_load(path.read_text())
    for app in config["applications"][1:]:
        app["route_prefix"] = None
    path.write_text(yaml.safe_dump(config))
    return path


def request_body(model: str) -> tuple[bytes, dict[str, str]]:
    """A JSON infer request for ``model``: every input of its config at its profile's ``opt``
    shape (ones), as the datatype asks."""
    from deployments.runtime.contract.config import load_model_config

    config = load_model_config(ROOT / "engines" / model / "config.yaml")
    inputs = []
    for spec in config.inputs:
        shape = list(spec.profile.opt) if spec.profile else [1 if d < 0 else d for d in spec.dims]
        n = 1
        for d in shape:
            n *= d
        data = ["1"] * n if spec.datatype == "BYTES" else [1] * n
        inputs.append({"name": spec.name, "shape": shape, "datatype": spec.datatype, "data": data})
    return json.dumps({"inputs": inputs}).encode(), {"Content-Type": "application/json"}


class Load:
    """Up to ``clients`` closed-loop clients posting ``body`` to ``url`` in a thread of their
    own (aiohttp, one event loop): the first ``active`` of them send, the others wait;
    ``done`` holds each answer's (time, status)."""

    def __init__(self, url: str, body: bytes, headers: dict[str, str], clients: int) -> None:
        self.url, self.body, self.headers, self.clients = url, body, headers, clients
        self.active = 0
        self.stop = threading.Event()
        self.done: list[tuple[float, int]] = []
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _client(self, session, index: int) -> None:
        import aiohttp

        while not self.stop.is_set():
            if index >= self.active:
                await asyncio.sleep(0.05)
                continue
            try:
                async with session.post(self.url, data=self.body, headers=self.headers) as r:
                    await r.read()
                    status = r.status
            except (aiohttp.ClientError, asyncio.TimeoutError):
                status = 0
            self.done.append((time.monotonic(), status))
            if status == 503:
                await asyncio.sleep(1.0)  # Retry-After

    async def _main(self) -> None:
        import aiohttp

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.clients),
                                         timeout=aiohttp.ClientTimeout(total=60),
                                         headers={"Accept-Encoding": "identity"}) as session:
            await asyncio.gather(*(self._client(session, i) for i in range(self.clients)))


def haproxy_router_servers(stats_port: int) -> tuple[dict[str, int], int]:
    """From HAProxy's stats page (CSV), the router application's backend: requests (``stot``)
    each live server has taken, by name (the router replicas' direct-ingress ports), and those
    its backup servers took (Ray's fallback proxy, whose deployment handle would be the only
    one in front of the router)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{stats_port}/stats;csv", timeout=5) as r:
        rows = [row for row in csv.DictReader(io.StringIO(r.read().decode().lstrip("# ")))
                if row["pxname"] == f"http-{APP}" and row["svname"] not in ("FRONTEND", "BACKEND")]
    live = {row["svname"]: int(row["stot"] or 0) for row in rows
            if row.get("bck") != "1" and row.get("status", "").startswith("UP")}
    return live, sum(int(row["stot"] or 0) for row in rows if row.get("bck") == "1")


def wait_ready(url: str, model: str, proc: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"server not ready: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/v2/models/{model}/ready", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)


def timeline(args: argparse.Namespace) -> list[dict[str, Any]]:
    router = {"autoscaling": {**SHORT_DELAYS, **json.loads(args.autoscaling)}}
    with tempfile.TemporaryDirectory(prefix="autoscale-") as tmp_name:
        tmp = Path(tmp_name)
        port, stats_port = _free_port(), _free_port()
        path = write_config(tmp, args.model, port, router)
        log = tmp / "out.log"
        proc = start_runner(path, log, args.fast, RAY_SERVE_HAPROXY_STATS_PORT=str(stats_port))
        url = f"http://127.0.0.1:{port}"
        rows: list[dict[str, Any]] = []
        try:
            wait_ready(url, args.model, proc, log)
            body, headers = request_body(args.model)
            steps = [int(c) for c in args.clients.split(",")]
            load = Load(f"{url}/v2/models/{args.model}/infer", body, headers, max(steps))
            load.thread.start()
            start = time.monotonic() + args.idle_s
            load_end = start + args.load_s * len(steps)
            last_totals: dict[str, int] = {}
            tick = time.monotonic()
            while True:
                tick += 1.0
                time.sleep(max(0.0, tick - time.monotonic()))
                now = time.monotonic()
                load.active = steps[int((now - start) // args.load_s)] if start <= now < load_end else 0
                clients = steps[int((now - 0.5 - start) // args.load_s)] if start <= now - 0.5 < load_end else 0
                second = [s for t, s in load.done if now - 1.0 <= t < now]
                try:
                    totals, backup_requests = haproxy_router_servers(stats_port)
                except OSError:
                    totals, backup_requests = {}, -1
                taking = sum(1 for name, n in totals.items() if n > last_totals.get(name, 0))
                last_totals = totals
                pids = replica_pids(proc.pid, APP, "router")
                replicas = len(pids)
                rows.append({"t_s": round(now - start), "clients": clients,
                             "router_replicas": replicas, "haproxy_servers": len(totals), "servers_taking": taking,
                             "qps": sum(1 for s in second if s == 200), "errors": sum(1 for s in second if s != 200),
                             "backup_requests": backup_requests,
                             "router_rss_mib": round(sum(rss_bytes(p) for p in pids) / 2**20)})
                print(" ".join(f"{k}={v}" for k, v in rows[-1].items()), file=sys.stderr, flush=True)
                if now > load_end and (replicas <= 1 and len(totals) <= 1 and now > load_end + 5
                                       or now > load_end + args.after_s):
                    break
            load.stop.set()
        finally:
            interrupt_group(proc)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="simple", help="a pool model of engines/")
    parser.add_argument("--clients", default="32", help="clients, or steps of clients (e.g. 8,32), each --load-s")
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument("--load-s", type=float, default=60.0, help="seconds of each step of clients")
    parser.add_argument("--after-s", type=float, default=90.0, help="most seconds to wait for the scale-down")
    parser.add_argument("--autoscaling", default="{}",
                        help=f"JSON: args.router.autoscaling fields over {SHORT_DELAYS} (and the router's defaults)")
    parser.add_argument("--fast", type=int, default=1, choices=(0, 1),
                        help="make serve's FAST: 0 is Serve's Python proxy (its handle counts the router's requests)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "autoscale.json"))
    args = parser.parse_args(argv)
    rows = timeline(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print("| t (s) | clients | router replicas | HAProxy servers (taking requests) | QPS | errors | routers' RSS MiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['t_s']} | {r['clients']} | {r['router_replicas']} | {r['haproxy_servers']} ({r['servers_taking']}) "
              f"| {r['qps']} | {r['errors']} | {r['router_rss_mib']} |")
    print(f"requests Ray's fallback proxy (HAProxy's backup) took: {rows[-1]['backup_requests'] if rows else None}")


if __name__ == "__main__":
    main()
