"""Overload sweep: does throughput hold its plateau from saturation up to 8x, and is excess shed?

Serves the DEFAULT configuration (``serve_config.yaml``'s application args, Ray's fast paths as
``make serve`` sets them) and, where the ``nvidia-pytriton`` wheel is installed in a separate
venv (``--triton-python``), NVIDIA Triton's own server over the same ONNX files
(``bench/triton_server.py``: ONNX Runtime CPU, 2 ms dynamic batcher, the model's ``instances``
as Triton instances, the same intra-op threads). Both run at once; every concurrency level is
measured on one server then the other, so machine noise hits both alike.

For each model (a dedicated one, ``ocr_cls``, and a pool one, ``tiny_cnn``) a closed-loop sweep
(``bench.loadgen``) gives QPS, p50/p99 and answers by status. From it:

- ``peak``: the highest QPS of the sweep; ``saturation``: the lowest concurrency reaching 90 %
  of it;
- ``qps_ratio`` at 2x, 4x and 8x saturation: QPS there / peak (the issue asks >= 0.9);
- ``shed``: 503 answers with ``Retry-After`` and a ``{"error": ...}`` body (load beyond the
  bounded queues); ``lost``: anything else that was not a 200 (bare 503s, 5xx, timeouts,
  dropped connections); must be 0.

    python -m bench.overload                                  # 1..128 clients, 6 s a point
    python -m bench.overload --levels 1,4,16,64,256,512 --processes 4   # the 16-core machine

Writes ``bench/results/overload-<time>.json`` and ``.png`` and prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import yaml

from bench.loadgen import Result, expected_from_onnx, make_workload, run
from bench.throughput import ROOT, SHAPES, Server, _wait_ready, free_port

LEVELS = (1, 2, 4, 8, 16, 32, 64, 128)
SATURATION_SHARE = 0.9  # saturation: the lowest concurrency reaching this share of the peak
MULTIPLES = (2, 4, 8)


def default_app_args(config: Path) -> dict[str, Any]:
    """The first application's ``args`` in ``config``, its repository made absolute."""
    app = yaml.safe_load(config.read_text())["applications"][0]
    args = dict(app.get("args") or {})
    args["repository"] = str((config.parent / args.get("repository", "engines")).resolve())
    return args


def plateau(points: Sequence[Result]) -> dict[str, Any]:
    """Peak QPS, saturating concurrency and QPS / peak at ``MULTIPLES`` of it (None where the
    sweep has no such level); answers shed and lost over the whole sweep."""
    peak = max(p.qps for p in points)
    saturation = min(p.concurrency for p in points if p.qps >= SATURATION_SHARE * peak)
    by_level = {p.concurrency: p for p in points}
    ratios = {f"{k}x": (round(by_level[k * saturation].qps / peak, 3) if k * saturation in by_level else None)
              for k in MULTIPLES}
    shed = sum(p.error_statuses.get("503", 0) for p in points)
    lost = sum(n for p in points for status, n in p.error_statuses.items() if status != "503")
    return {"peak_qps": peak, "saturation": saturation, "qps_ratio": ratios, "shed": shed, "lost": lost}


class TritonServer:
    """``bench/triton_server.py`` under ``python`` (a venv with nvidia-pytriton and onnxruntime)."""

    def __init__(self, python: str, models: dict[str, tuple[Path, int]], intra_op_threads: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        libdir = subprocess.check_output(
            [python, "-c", "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"], text=True).strip()
        env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [libdir, os.environ.get("LD_LIBRARY_PATH")]))}
        env.pop("PYTHONPATH", None)  # nothing of this project's venv in Triton's interpreter
        cmd = [python, str(ROOT / "bench" / "triton_server.py"), "--port", str(self.port),
               "--intra-op-threads", str(intra_op_threads)]
        for name, (path, instances) in models.items():
            cmd += ["--model", f"{name}={path}@{instances}"]
        self.process = subprocess.Popen(cmd, env=env, start_new_session=True,  # its log is long
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for name in models:
                _wait_ready(f"{self.url}/v2/models/{name}/ready", timeout_s=180, process=self.process)
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> "TritonServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _model_inputs(repository: Path, model: str) -> tuple[str, Path, int]:
    """(input name, ONNX path of the served version, instances) from the model's config."""
    from deployments.runtime.contract.repository import ModelRepository

    entry = ModelRepository(str(repository)).get(model)
    return entry.config.inputs[0].name, entry.onnx_path(), entry.config.instances


def sweep_all(servers: dict[str, Any], models: Sequence[str], repository: Path, levels: Sequence[int],
              duration_s: float, warmup_s: float, processes: int) -> list[dict[str, Any]]:
    """Every model at every level, each level on every server in turn."""
    rows = []
    for model in models:
        name, onnx_path, _ = _model_inputs(repository, model)
        x = np.random.default_rng(0).random(SHAPES[model], dtype=np.float32)
        expected = expected_from_onnx(str(onnx_path), {name: x})  # answers checked, not only statuses
        for c in levels:
            for server, s in servers.items():
                workload = make_workload(f"{server}:{model}", s.url, model, name, x, binary=True, expected=expected)
                r = run([(workload, c)], duration_s, warmup_s, processes)[0]
                rows.append({"server": server, "model": model, **r.__dict__})
                print(f"{server:>7} {model:>9} c={c:<4} {r.qps:8.1f} QPS  p50 {r.p50_ms or 0:8.1f} ms  "
                      f"p99 {r.p99_ms or 0:8.1f} ms  {r.error_statuses or ''}", flush=True)
    return rows


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for server, model in dict.fromkeys((r["server"], r["model"]) for r in rows):
        points = [Result(**{k: v for k, v in r.items() if k not in ("server", "model")})
                  for r in rows if r["server"] == server and r["model"] == model]
        out.append({"server": server, "model": model, **plateau(points)})
    return out


def markdown(rows: list[dict[str, Any]], summary: list[dict[str, Any]]) -> str:
    servers = list(dict.fromkeys(r["server"] for r in rows))
    head = ["model", "clients"] + [f"{s} {col}" for s in servers for col in ("QPS", "p50 ms", "p99 ms", "shed", "lost")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model in dict.fromkeys(r["model"] for r in rows):
        for c in sorted({r["concurrency"] for r in rows if r["model"] == model}):
            cells = [model, str(c)]
            for s in servers:
                r = next(x for x in rows if x["model"] == model and x["server"] == s and x["concurrency"] == c)
                shed = r["error_statuses"].get("503", 0)
                cells += [f"{r['qps']:.1f}", f"{r['p50_ms'] or 0:.1f}", f"{r['p99_ms'] or 0:.1f}",
                          str(shed), str(r["errors"] - shed)]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| server | model | peak QPS | saturation (clients) | 2x / peak | 4x / peak | 8x / peak | shed | lost |",
              "|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        q = s["qps_ratio"]
        lines.append(f"| {s['server']} | {s['model']} | {s['peak_qps']:.1f} | {s['saturation']} | "
                     f"{q['2x']} | {q['4x']} | {q['8x']} | {s['shed']} | {s['lost']} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    from bench.panels import save_panels

    panels = []
    for model in dict.fromkeys(r["model"] for r in rows):
        lines = []
        for server in dict.fromkeys(r["server"] for r in rows):
            pts = [r for r in rows if r["model"] == model and r["server"] == server]
            lines.append((server, [r["concurrency"] for r in pts], [r["qps"] for r in pts], "-"))
        panels.append((f"{model}: overload sweep", lines))
    save_panels(path, panels, xlabel="concurrent clients (closed loop)", ylabel="QPS (200s)", size=(5, 3.8),
                legend_size=8)


def main(argv: Sequence[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "serve_config.yaml"), help="serve config whose app args to serve")
    p.add_argument("--models", default="ocr_cls,tiny_cnn")
    p.add_argument("--levels", default=",".join(map(str, LEVELS)))
    p.add_argument("--duration-s", type=float, default=6.0)
    p.add_argument("--warmup-s", type=float, default=2.0)
    p.add_argument("--processes", type=int, default=1, help="load generator processes")
    p.add_argument("--triton-python", default="/tmp/pytriton-venv/bin/python",
                   help="interpreter of a venv with nvidia-pytriton and onnxruntime ('' to skip Triton)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = p.parse_args(argv)
    models = a.models.split(",")
    levels = [int(x) for x in a.levels.split(",")]
    app_args = default_app_args(Path(a.config))
    repository = Path(app_args["repository"])
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))

    from deployments.app import AppArgs, cores, intra_op_threads
    from deployments.runtime.contract.repository import ModelRepository

    parsed = AppArgs.model_validate(app_args)
    threads = intra_op_threads(cores(), parsed, ModelRepository(parsed.repository, parsed.models).entries())

    with contextlib.ExitStack() as stack:
        servers: dict[str, Any] = {"ray": stack.enter_context(Server("ray", repository, "fast", app_args=app_args))}
        if a.triton_python and Path(a.triton_python).exists():
            onnx = {m: _model_inputs(repository, m)[1:] for m in models}
            servers["triton"] = stack.enter_context(TritonServer(
                a.triton_python, onnx, threads))
        else:
            print(f"no Triton line: {a.triton_python or '--triton-python'} not found", file=sys.stderr)
        rows = sweep_all(servers, models, repository, levels, a.duration_s, a.warmup_s, a.processes)
    summary = summarize(rows)
    results = {"command": "python -m bench.overload " + " ".join(argv), "cpus": os.cpu_count(),
               "date": time.strftime("%Y-%m-%d %H:%M:%S"), "duration_s": a.duration_s, "warmup_s": a.warmup_s,
               "processes": a.processes, "app_args": app_args, "rows": rows, "summary": summary}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"overload-{time.strftime('%Y%m%d-%H%M%S')}"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2))
    with contextlib.suppress(Exception):
        plot(rows, stem.with_suffix(".png"))
    print(markdown(rows, summary))
    print(f"wrote {stem}.json, .png", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
