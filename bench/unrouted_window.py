"""What a client that polls a known model sees while ``make serve`` starts and stops (HAProxy on).

For each ``--code`` checkout (its ``deployments`` package serves, its ``deployments/haproxy.py``
rewrites Ray's HAProxy config), it starts ``python -m deployments.run`` (what ``make serve``
runs, under ``make -s print-serve-env``'s variables) on a copy of ``serve_config.yaml`` with a
free port, sends ``POST /v2/models/<model>/infer`` every ``--poll-s`` from the start, sends
SIGINT ``--serve-s`` after the first 200, and keeps polling until the command exits. Each answer
is counted by phase (before / after SIGINT) and kind: 200, a JSON 503 of HAProxy's "no
application serves" answer, the "no application route matches" 404, another status with its
JSON ``error`` cut short, or a connection error, and what the HAProxy config on disk routed
when it was sent (nothing, the models' applications without their router's, the router's). Alongside, the backends that Ray's HAProxy
config routes to (``use_backend`` lines of the newest ``<node id>/haproxy.cfg`` beside
``RAY_SERVE_HAPROXY_CONFIG_FILE_LOC``), each time they change, with the seconds since start.

    flock /tmp/ray-heavy.lock .venv/bin/python -m bench.unrouted_window --code /work/main --code .

Prints the counts and the timeline; writes ``bench/results/unrouted_window.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import requests

from bench.stop_time import config_on_port, free_port
from deployments.haproxy import missing_routers

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
# Ray's HAProxy manager writes its config under a folder per node: <dir>/<node id>/haproxy.cfg.
HAPROXY_CONFIG = Path(os.environ.get("RAY_SERVE_HAPROXY_CONFIG_FILE_LOC", "/tmp/haproxy-serve/haproxy.cfg"))
SIMPLE_BODY = json.dumps({"inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32", "data": list(range(16))}
                                     for n in ("INPUT0", "INPUT1")]})


def _kind(response: requests.Response) -> str:
    """A short label of one answer (module docstring)."""
    if response.status_code == 200:
        return "200"
    try:
        error = str(response.json().get("error", ""))
    except ValueError:
        return f"{response.status_code} {response.headers.get('Content-Type')}: {response.text[:50]!r}"
    if error.startswith("no application serves"):
        named = re.search(r"router application (\S+) has no route", error)
        return (f"{response.status_code} no application serves (Retry-After {response.headers.get('Retry-After')})"
                + (f", naming router {named[1]}" if named else ""))
    if error.startswith("no application route matches"):
        return f"{response.status_code} no application route matches"
    return f"{response.status_code} json: {error[:60]}"


def _routed_backends(since: float) -> tuple[str, ...] | None:
    """The backends named by ``use_backend`` in the newest HAProxy config written at or after
    ``since`` (``time.time()``), else None."""
    try:
        newest = max(((path.stat().st_mtime, path) for path in HAPROXY_CONFIG.parent.glob(f"*/{HAPROXY_CONFIG.name}")),
                     default=None)
        if newest is None or newest[0] < since:
            return None
        text = newest[1].read_text()
    except OSError:
        return None
    if "default_backend default_backend" not in text:  # read while Ray rewrites it (truncated)
        return None
    return tuple(sorted({m[1] for m in re.finditer(r"^\s+use_backend\s+(\S+)", text, re.M)}))


def _state(routed: tuple[str, ...] | None) -> str:
    """What the HAProxy config on disk routes: no config yet, nothing, the models' applications
    without their router's, or the router's (``deployments.haproxy.missing_routers``)."""
    if routed is None:
        return "no config"
    missing = missing_routers(set(routed))
    return "nothing routed" if missing is None else f"{missing} not routed" if missing else "router routed"


def measure(code: Path, model: str, poll_s: float, serve_s: float, ready_timeout_s: float) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}/v2/models/{model}/infer"
    env_text = subprocess.run(["make", "-s", "print-serve-env"], cwd=code, capture_output=True, text=True,
                              check=True).stdout
    answers: list[tuple[float, str, str]] = []  # (seconds since start, phase, kind)
    backends: list[tuple[float, tuple[str, ...] | None]] = []
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PYTHONPATH=str(code), **dict(item.split("=", 1) for item in env_text.split()))
        log = Path(tmp) / "serve.log"
        with log.open("w") as out:
            start, started_at = time.monotonic(), time.time()
            proc = subprocess.Popen([sys.executable, "-m", "deployments.run", str(config_on_port(port, Path(tmp)))],
                                    cwd=code, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            phase, first_200, sigint_at = "starting", None, None
            session = requests.Session()
            while proc.poll() is None:
                now = time.monotonic() - start
                seen = _routed_backends(started_at)
                if not backends or seen is not None and backends[-1][1] != seen:
                    backends.append((round(now, 2), seen))
                try:
                    kind = _kind(session.post(url, data=SIMPLE_BODY, headers={"Content-Type": "application/json"},
                                              timeout=30))
                except requests.RequestException as e:
                    kind, session = type(e).__name__, requests.Session()
                answers.append((round(now, 2), phase, f"{kind}  [config: {_state(backends[-1][1])}]"))
                if kind == "200" and first_200 is None:
                    first_200 = now
                if sigint_at is None and (first_200 is not None and now - first_200 >= serve_s
                                          or now >= ready_timeout_s):
                    sigint_at, phase = now, "stopping"
                    os.killpg(proc.pid, signal.SIGINT)
                time.sleep(poll_s)
            stopped_s = time.monotonic() - start
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"unrouted_window_{port}.log").write_text(log.read_text())
    counts = {p: dict(collections.Counter(k for _, ph, k in answers if ph == p)) for p in ("starting", "stopping")}

    def window(label: str, phase: str) -> list[float] | None:
        times = [t for t, ph, k in answers if ph == phase and k.startswith(label)]
        return [times[0], times[-1]] if times else None

    return {"code": str(code), "env": env_text.strip(), "log": f"bench/results/unrouted_window_{port}.log",
            "first_200_s": first_200 and round(first_200, 2), "sigint_s": sigint_at and round(sigint_at, 2),
            "exit_s": round(stopped_s, 2), "rc": proc.returncode, "counts": counts,
            "unrouted_404_window_s": {p: window("404 no application route matches", p) for p in counts},
            "backends": backends}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Answers to a known model while make serve starts and stops.")
    parser.add_argument("--code", action="append", type=Path, help="checkout to serve (repeatable; default: this one)")
    parser.add_argument("--model", default="simple")
    parser.add_argument("--poll-s", type=float, default=0.2)
    parser.add_argument("--serve-s", type=float, default=3.0, help="seconds of 200s before SIGINT")
    parser.add_argument("--ready-timeout-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    rows = [measure(c.resolve(), args.model, args.poll_s, args.serve_s, args.ready_timeout_s)
            for c in args.code or [ROOT]]
    for r in rows:
        print(f"== {r['code']}: first 200 at {r['first_200_s']} s, SIGINT at {r['sigint_s']} s, exit at "
              f"{r['exit_s']} s (rc {r['rc']}); log {r['log']}")
        for phase, counts in r["counts"].items():
            print(f"  {phase}:")
            for kind, n in sorted(counts.items(), key=lambda kv: -kv[1]):
                print(f"    {n:5d}  {kind}")
        print(f"  'no application route matches' 404s (first, last s): {r['unrouted_404_window_s']}")
        print("  routed backends (s since start):")
        for t, seen in r["backends"]:
            print(f"    {t:7.2f}  {list(seen) if seen is not None else 'no config written yet'}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "unrouted_window.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
