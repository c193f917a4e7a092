"""How long Ctrl-C takes to stop the server, and what happens to the requests in flight.

For each run (``--env 'K=V K=V'``, repeatable, with a matching ``--code`` checkout whose
``deployments`` package serves and ``--via``: ``serve-run`` for Ray's ``serve run``,
``make-serve`` for ``python -m deployments.run``, what ``make serve`` runs), it starts the server
on a copy of ``serve_config.yaml`` with a free port, in its own process group (as a terminal
runs it), waits for ``/v2/health/ready``, asks ``serve status`` with and without
``RAY_AUTH_MODE=token``, keeps ``--clients`` closed-loop clients sending small ``tiny_cnn``
requests, sends SIGINT to the group (what Ctrl-C does) and measures the seconds until the
command exits. Requests sent before the SIGINT should all be answered 200; the output is
searched for Ray's "failed to shut down" warning and for the application's "ready" line.

    F='RAY_SERVE_ENABLE_HA_PROXY=1 RAY_SERVE_THROUGHPUT_OPTIMIZED=1 RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH=2147483647'
    .venv/bin/python -m bench.stop_time --code <checkout before> --via serve-run --env "$F" \
        --code . --via make-serve --env "$(make -s print-serve-env)"

Prints a table and writes ``bench/results/stop_time.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Sequence

import requests
import yaml

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
BODY = json.dumps({"inputs": [{"name": "input", "shape": [1, 3, 224, 224], "datatype": "FP32",
                               "data": [0.5] * (3 * 224 * 224)}]})


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config_on_port(port: int, folder: Path) -> Path:
    """``serve_config.yaml`` written into ``folder`` with HTTP on ``port`` and absolute repositories."""
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config["http_options"]["port"] = port
    for app in config["applications"]:
        app["args"]["repository"] = str(ROOT / app["args"]["repository"])
    path = folder / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _serve_status(log: Path, env: dict[str, str]) -> dict[str, object]:
    """``serve status`` against this cluster's dashboard, without and with RAY_AUTH_MODE=token."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text())  # Ray colours the address
    found = re.search(r"dashboard at (?:http://)?([0-9.]+:[0-9]+)", plain)
    if not found:
        return {"serve_status": "no dashboard address in the log"}
    out: dict[str, object] = {}
    for mode in (None, "token"):
        child = {k: v for k, v in env.items() if k != "RAY_AUTH_MODE"}
        if mode:
            child["RAY_AUTH_MODE"] = mode
        result = subprocess.run([str(ROOT / ".venv" / "bin" / "serve"), "status", "-a", f"http://{found.group(1)}"],
                                env=child, capture_output=True, text=True, timeout=60)
        text = result.stdout + result.stderr
        out[f"serve_status_{mode or 'unset'}"] = (
            f"rc {result.returncode}" + (", app RUNNING" if "status: RUNNING" in text else "")
            + (", AuthenticationError" if "AuthenticationError" in text else ""))
    return out


COMMANDS = {"serve-run": [str(ROOT / ".venv" / "bin" / "serve"), "run"],  # Ray's CLI
            "make-serve": [sys.executable, "-m", "deployments.run"]}  # what `make serve` runs


def measure(env_text: str, code: Path, via: str, ready_timeout_s: float, clients: int) -> dict:
    """One start, load, Ctrl-C and exit of ``COMMANDS[via] <config>`` under the variables in
    ``env_text``, with the application's code from ``code`` (its ``deployments`` package)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PYTHONPATH=str(code), **dict(item.split("=", 1) for item in env_text.split()))
        log = Path(tmp) / "serve.log"
        with log.open("w") as out:
            proc = subprocess.Popen([*COMMANDS[via], str(config_on_port(port, Path(tmp)))],
                                    cwd=code, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            start = time.monotonic()
            while time.monotonic() - start < ready_timeout_s:
                try:
                    if requests.get(f"{url}/v2/health/ready", timeout=2).status_code == 200:
                        break
                except requests.RequestException:
                    pass
                time.sleep(0.5)
            else:
                os.killpg(proc.pid, signal.SIGKILL)
                raise TimeoutError(f"not ready within {ready_timeout_s} s: {log.read_text()[-2000:]}")
            ready_s = time.monotonic() - start
            status = _serve_status(log, env)
            stop = threading.Event()
            sigint_at: list[float] = []
            results: list[tuple[float, int | str]] = []  # (send time, status or error)

            def client() -> None:
                session = requests.Session()
                while not stop.is_set():
                    sent = time.monotonic()
                    try:
                        status: int | str = session.post(f"{url}/v2/models/tiny_cnn/infer", data=BODY,
                                                         headers={"Content-Type": "application/json"},
                                                         timeout=30).status_code
                    except requests.RequestException as e:
                        status = type(e).__name__
                    results.append((sent, status))

            threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
            for t in threads:
                t.start()
            time.sleep(3.0)
            sigint_at.append(time.monotonic())
            os.killpg(proc.pid, signal.SIGINT)
            rc = proc.wait(timeout=120)
            stop_s = time.monotonic() - sigint_at[0]
            stop.set()
            for t in threads:
                t.join(timeout=35)
        text = log.read_text()
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"stop_time_{port}.log").write_text(text)
    before = [s for sent, s in results if sent < sigint_at[0]]
    return {"env": env_text, "code": str(code), "command": via, "log": f"bench/results/stop_time_{port}.log", **status, "ready_s": round(ready_s, 1), "stop_s": round(stop_s, 1), "rc": rc,
            "requests_before_sigint": len(before), "answered_200": sum(1 for s in before if s == 200),
            "failed_before_sigint": sorted({str(s) for s in before if s != 200}),
            "failed_sent_ms_before_sigint": sorted(round((sigint_at[0] - sent) * 1e3) for sent, s in results
                                                   if sent < sigint_at[0] and s != 200),
            "shutdown_warning": "failed to shut down" in text,
            "ready_line": any("ready" in line and url in line for line in text.splitlines())}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Seconds from Ctrl-C to exit of `serve run`, per environment.")
    parser.add_argument("--env", action="append", required=True, help="'K=V K=V' for serve run (repeatable)")
    parser.add_argument("--code", action="append", type=Path,
                        help="checkout whose deployments package serves, one per --env (default: this one)")
    parser.add_argument("--via", action="append", choices=sorted(COMMANDS),
                        help="how serve starts, one per --env (default: serve-run)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--ready-timeout-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    codes = args.code or [ROOT] * len(args.env)
    vias = args.via or ["serve-run"] * len(args.env)
    if not len(codes) == len(vias) == len(args.env):
        parser.error("give one --code and one --via per --env")
    rows = [measure(e, c, v, args.ready_timeout_s, args.clients) for e, c, v in zip(args.env, codes, vias)]
    print("| code | command | environment | ready (s) | Ctrl-C to exit (s) | requests before SIGINT | answered 200 | "
          "warning | ready line | serve status (RAY_AUTH_MODE unset / token) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['code']} | {r['command']} | `{r['env']}` | {r['ready_s']} | {r['stop_s']} | {r['requests_before_sigint']} | "
              f"{r['answered_200']} | {'yes' if r['shutdown_warning'] else 'no'} | {'yes' if r['ready_line'] else 'no'} | "
              f"{r.get('serve_status_unset', '-')} / {r.get('serve_status_token', '-')} |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "stop_time.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
