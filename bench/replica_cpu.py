"""A model replica's CPU per request by stage, beside the echo replica's, in one Ray cluster.

One Ray Serve cluster in ``bench.throughput``'s config (``fast`` by default: HAProxy, Ray's
throughput-optimized mode) serves each ``--models`` model as a dedicated deployment with
``--replicas`` replicas and the echo ceiling (``bench.echo``) with as many. Rounds alternate
product and echo (ABBA: product, echo, echo, product, ...), each a closed loop of
``--concurrency`` clients sending the same binary request (``bench.loadgen``, answers checked).
Per round:

- the replicas' CPU seconds from ``/proc`` over the measured window (``bench.replicas.CpuSampler``),
  divided by the requests answered: **CPU per request**, every thread of the process;
- the stages' own CPU (``bench.stage_cpu``, installed in the replicas by Ray's worker setup hook:
  ``time.thread_time()`` around the synchronous steps of the request path, exact however loaded
  the machine) per request: header, decode, validate, model, encode, metrics, and the cycle
  collector's runs (gc); **rest** is the process's CPU less them: uvicorn, Starlette, Serve's
  ingress and its hop between event loops, reading the body and writing the answer, the thread
  hop to the model, Ray's C++ threads.

The model call is its own stage (``model``: ``ModelHost.run``, the engine under it); "outside the
model call" is the process's CPU per request less it, the figure issue 30 compares with the
echo's. Medians over the rounds are reported, with each round's figures in the JSON.

A sampling profiler does not give CPU by stage on a machine with more runnable threads than
cores: py-spy counts a thread that is runnable but not running as busy. ``--stacks DIR`` keeps
py-spy's raw stacks of each round (``record --format raw --nonblocking``) for reading the rest
by eye (py-spy must be able to attach: ptrace).

    python -m bench.replica_cpu --models tiny_cnn --rounds 4 --duration-s 6
    python -m bench.replica_cpu --models resnet18 --backend onnxruntime_cuda --concurrency 32  # on a GPU

Results go to ``--out`` (``replica-cpu-<time>.json`` and ``.md``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from bench import echo, stage_cpu
from bench.replicas import CpuSampler, replica_pids
from bench.throughput import RAY_CONFIGS, ROOT, SHAPES, Bench, Server, prepare_repository, write_results

ORDER = ["header", "decode", "validate", "model", "encode", "metrics", "gc", "rest"]


def py_spy() -> str:
    """The py-spy next to this Python (the project's venv), else the one on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if found is None:
        raise SystemExit("py-spy is not installed (pip install py-spy); run without --stacks")
    return found


class Profile:
    """py-spy ``record`` on ``pids`` for ``duration_s``, started ``delay_s`` from now (the load
    generator's warm-up), into ``folder``."""

    def __init__(self, pids: list[int], delay_s: float, duration_s: float, rate_hz: int, folder: Path) -> None:
        self.files = [folder / f"{pid}.txt" for pid in pids]
        self.procs: list[subprocess.Popen] = []
        self.args = (pids, duration_s, rate_hz)
        self.timer = threading.Timer(delay_s, self._start)

    def _start(self) -> None:
        pids, duration_s, rate_hz = self.args
        for pid, out in zip(pids, self.files):
            self.procs.append(subprocess.Popen(
                [py_spy(), "record", "-p", str(pid), "--format", "raw", "--rate", str(rate_hz), "--nonblocking",
                 "--duration", str(max(1, round(duration_s))), "-o", str(out)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def __enter__(self) -> "Profile":
        self.timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.timer.join()
        for proc in self.procs:
            proc.wait(timeout=120)


def measure(bench: Bench, workload: Any, pids: list[int], args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """One round on ``pids`` (the serving replicas): QPS, CPU per request from /proc, and the
    stages' CPU per request (``bench.stage_cpu``) over the measured window; ``rest`` is the
    process's CPU per request less the stages'."""
    snapshots: list[dict[str, list[float]]] = []
    first = threading.Timer(args.warmup_s, lambda: snapshots.append(stage_cpu.read(folder / "stages", pids)))
    profile = Profile(pids, args.warmup_s, args.duration_s, args.rate_hz, folder) if args.stacks else None
    first.start()
    with CpuSampler(pids) as cpu, (profile or contextlib.nullcontext()):
        (r,) = bench.measure([(workload, args.concurrency)])
    first.join()
    time.sleep(0.3)  # the replicas' last write of their totals (every 0.25 s)
    _, cores = cpu.window(args.duration_s)
    cpu_us = cores * 1e6 / r.qps if r.qps else 0.0
    row: dict[str, Any] = {"qps": r.qps, "p50_ms": r.p50_ms, "errors": r.errors, "replica_cores": cores,
                           "cpu_us_per_request": round(cpu_us, 1)}
    before, after = snapshots[0], stage_cpu.read(folder / "stages", pids)
    counted = stage_cpu.calls(before, after, "decode_body") or stage_cpu.calls(before, after, "echo_answer")
    if counted:
        stages = stage_cpu.stages_us(before, after, counted)
        stages["rest"] = round(cpu_us - sum(stages.values()), 1)
        row["stages_us"] = stages
        row["outside_model_us"] = round(cpu_us - stages.get("model", 0.0), 1)
    if profile is not None:
        keep = Path(args.stacks)
        keep.mkdir(parents=True, exist_ok=True)
        for f in profile.files:
            if f.exists():
                shutil.copy(f, keep / f"{workload.label.replace(':', '-')}-{time.strftime('%H%M%S')}-{f.name}")
    return row


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds of every figure (stages included)."""
    def med(values: list[float]) -> float:
        return round(statistics.median(values), 1)

    out: dict[str, Any] = {k: med([r[k] for r in rounds]) for k in ("qps", "cpu_us_per_request", "replica_cores")}
    if all("stages_us" in r for r in rounds):
        stages = {s for r in rounds for s in r["stages_us"]}
        out["stages_us"] = {s: med([r["stages_us"].get(s, 0.0) for r in rounds]) for s in ORDER if s in stages}
        out["outside_model_us"] = med([r["outside_model_us"] for r in rounds])
    return out


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    lines = [f"`{meta['command']}` ({meta['date']}, {meta['machine']})", ""]
    servers = list(results["summary"])
    lines.append("| stage (µs CPU / request, median) | " + " | ".join(servers) + " |")
    lines.append("|---|" + "---|" * len(servers))
    stages = [s for s in ORDER if any(s in results["summary"][k].get("stages_us", {}) for k in servers)]
    for s in stages:
        lines.append(f"| {s} | " + " | ".join(str(results["summary"][k].get("stages_us", {}).get(s, "-"))
                                                for k in servers) + " |")
    for key, label in (("cpu_us_per_request", "**total** (/proc)"), ("outside_model_us", "**outside the model call**"),
                       ("qps", "QPS"), ("replica_cores", "replica cores")):
        lines.append(f"| {label} | " + " | ".join(str(results["summary"][k].get(key, "-")) for k in servers) + " |")
    product = [k for k in servers if k != "echo"]
    if "echo" in results["summary"] and product:
        echo_out = results["summary"]["echo"].get("outside_model_us") or results["summary"]["echo"]["cpu_us_per_request"]
        for k in product:
            mine = results["summary"][k].get("outside_model_us")
            if mine and echo_out:
                lines.append(f"\n{k} outside the model call / echo: **{mine / echo_out:.2f}x**")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["tiny_cnn"])
    p.add_argument("--repository", default=str(ROOT / "engines"))
    p.add_argument("--backend", default="auto")
    p.add_argument("--ray-config", default="fast", choices=RAY_CONFIGS)
    p.add_argument("--replicas", type=int, default=1, help="replicas of each model and of the echo")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=4, help="rounds per server, alternating (ABBA)")
    p.add_argument("--duration-s", type=float, default=6.0)
    p.add_argument("--warmup-s", type=float, default=2.0)
    p.add_argument("--processes", type=int, default=1, help="client processes")
    p.add_argument("--rate-hz", type=int, default=200, help="py-spy samples per second")
    p.add_argument("--stacks", help="record py-spy's raw stacks of each round into this folder")
    p.add_argument("--gpu-fraction", type=float, default=0.0, help="each model replica's num_gpus")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = p.parse_args(argv)
    unknown = [m for m in a.models if m not in SHAPES]
    if unknown:
        p.error(f"no input shape known for {unknown}; one of {sorted(SHAPES)} (bench.throughput.SHAPES)")
    # what bench.throughput.Bench reads
    a.max_queue_delay_ms, a.together_concurrency = 0.0, a.concurrency
    return a


def main(argv: Sequence[str]) -> None:
    a = parse_args(argv)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # Ray's workers
    os.environ.setdefault("ORT_INTRA_OP_THREADS", "1")  # as bench.throughput: replicas, not ORT threads, scale
    scratch = Path(tempfile.mkdtemp(prefix="bench-replica-cpu-"))
    os.environ[stage_cpu.ENV] = str(scratch / "stages")  # the replicas inherit it (bench.stage_cpu)
    repo = prepare_repository(scratch / "engines", Path(a.repository), a.models, (), a.replicas, 0, a.gpu_fraction)
    bench = Bench(a, repo)
    rounds: dict[str, list[dict[str, Any]]] = {m: [] for m in a.models} | {"echo": []}
    try:
        with Server("ray", repo, a.ray_config, replicas=a.replicas, backend=a.backend, echo=True) as server:
            pids = {m: bench._serving_pids(server, m) for m in a.models}
            pids["echo"] = replica_pids(server.process.pid, echo.APP_NAME, "Echo")
            for i in range(a.rounds):
                for model in a.models:
                    order = [model, "echo"] if i % 2 == 0 else ["echo", model]
                    for name in order:
                        endpoint = server.echo_endpoint if name == "echo" else server
                        workload = bench.workload(endpoint, model)
                        row = measure(bench, workload, pids[name], a, scratch)
                        rounds[name].append(row)
                        print(f"round {i} {name:10} {json.dumps(row)}",
                              file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    results = {
        "meta": {"command": "python -m bench.replica_cpu " + " ".join(argv),
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "machine": f"{platform.node()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
                 "git": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                       text=True).stdout.strip()},
        "rounds": rounds,
        "summary": {name: summarize(rows) for name, rows in rounds.items() if rows},
    }
    print(write_results(Path(a.out), "replica-cpu", results, markdown(results))[1])


if __name__ == "__main__":
    main(sys.argv[1:])
