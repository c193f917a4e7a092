"""Benchmark the three load policies (eager / lazy / lru) of ``ModelCache`` on this machine.

Engine layer only (no Ray), ONNX Runtime on the CPU. Reproduces the reference's table: start-up
time, resident memory at start and once every model is warm, first-request latency per model,
reload latency after eviction, steady-state latency. Writes to ``bench/results/`` (git-ignored):
``memory_policies.json``, ``memory_policies.md`` and ``memory_policies.png`` (resident memory
over time, one panel per policy).

    python -m bench.memory_policies [--root engines] [--budget-fraction 0.45] [--requests 100]

Method:
1. Each model's footprint is measured once, each in its own process
   (``python -m deployments.runtime.tools.plan measure``), and handed to every policy's cache as a
   known footprint, so no policy pays the measuring runs inside its latencies (their cost is
   reported separately, ``measure_s``).
2. Each policy runs in a fresh process (clean resident set): build the cache (``eager``
   loads everything in ``start()``), one request per model in a fixed order (first-request
   latency), then, for ``lru``, one more request to every model the first pass evicted (reload
   latency), then ``--requests`` requests drawn from a fixed skewed mix, one at a time
   (steady state: p50/p95, reloads). ``lru`` gets ``budget_bytes`` = ``--budget-fraction`` x
   the sum of the footprints (at least the largest model); ``eager`` and ``lazy`` get no budget.
3. Requests are batch 1 at each input's profile opt shape (CNNs 224x224, ocr_det 736x736,
   ocr_rec 48x320, ocr_cls 48x192), random normal data from a fixed seed.
4. Memory: the process's resident set (RSS, sampled every 20 ms) and the cache's accounted
   ``resident_bytes`` (sum of footprints, the figure the budget limits).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Sequence, cast

import numpy as np

MODELS = ["tiny_cnn", "mid_cnn", "resnet18", "ocr_cls", "ocr_det", "ocr_rec"]
MIX = {"tiny_cnn": 0.3, "resnet18": 0.25, "mid_cnn": 0.2, "ocr_cls": 0.1, "ocr_rec": 0.1, "ocr_det": 0.05}
POLICIES = ["eager", "lazy", "lru"]
MB = 1e6


def _measure_footprints(root: str) -> dict[str, dict[str, Any]]:
    footprints = {}
    for name in MODELS:
        done = subprocess.run([sys.executable, "-m", "deployments.runtime.tools.plan", "measure", name,
                               "--root", root, "--json"], capture_output=True, text=True, check=True)
        footprints[name] = json.loads(done.stdout)
        print(f"measured {name}: {footprints[name]['total_bytes'] / MB:,.1f} MB "
              f"in {footprints[name]['seconds']:.2f} s", flush=True)
    return footprints


def _inputs(repo: Any, name: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    config = repo.get(name).config
    out = {}
    for spec in config.inputs:
        shape = list(spec.profile.opt if spec.profile is not None else spec.dims)
        if config.max_batch_size:
            shape[0] = 1
        out[spec.name] = rng.standard_normal(shape).astype(np.float32)
    return out


class _RssSampler(threading.Thread):
    def __init__(self, period_s: float = 0.02) -> None:
        super().__init__(daemon=True)
        from deployments.runtime.backends.process import process_rss_bytes

        self._read = process_rss_bytes
        self.period_s = period_s
        self.samples: list[tuple[float, int]] = []
        self.t0 = time.monotonic()
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            self.samples.append((time.monotonic() - self.t0, self._read()))
            self._halt.wait(self.period_s)

    def stop(self) -> None:
        self._halt.set()
        self.join()


def _timed(cache: Any, name: str, inputs: dict[str, np.ndarray]) -> float:
    start = time.perf_counter()
    cache.infer(name, inputs)
    return (time.perf_counter() - start) * 1e3


def run_policy(root: str, policy: str, footprints: dict[str, dict[str, Any]], budget_bytes: int | None,
               requests: int, seed: int) -> dict[str, Any]:
    """One policy's run in this process (called in a fresh child process by ``main``)."""
    from deployments.runtime.contract.config import CacheOptions, LoadPolicy
    from deployments.runtime.contract.units import MIB
    from deployments.runtime.residency.cache import ModelCache
    from deployments.runtime.backends.base import Footprint
    from deployments.runtime.backends.process import measured_rss_bytes
    from deployments.runtime.contract.repository import ModelRepository

    repo = ModelRepository(root)
    rng = np.random.default_rng(seed)
    inputs = {name: _inputs(repo, name, rng) for name in MODELS}
    given = {n: Footprint(engine_bytes=f["engine_bytes"], context_bytes=f["context_bytes"]) for n, f in footprints.items()}
    baseline_rss = measured_rss_bytes()
    sampler = _RssSampler()
    sampler.start()
    cache_offset_s = time.monotonic() - sampler.t0
    start = time.perf_counter()
    options = CacheOptions(load_policy=cast(LoadPolicy, policy), max_num_models_per_replica=None, wait_timeout_s=120,
                           memory_budget_mib=None if budget_bytes is None else budget_bytes / MIB)
    cache = ModelCache(repo, MODELS, options, footprints=given).start()
    startup_s = time.perf_counter() - start
    at_start = {"rss_bytes": measured_rss_bytes(), "resident_bytes": cache.resident_bytes}

    first_ms = {name: _timed(cache, name, inputs[name]) for name in MODELS}
    warm = {"rss_bytes": measured_rss_bytes(), "resident_bytes": cache.resident_bytes,
            "resident_models": cache.resident()}
    peak_accounted = max([e["resident_bytes"] for e in cache.timeline()] + [0])

    reload_ms: dict[str, float] = {}
    reload_load_ms: dict[str, float] = {}
    if policy == "lru":
        evicted = [n for n in MODELS if n not in cache.resident()]
        for name in evicted:
            before = len(cache.timeline())
            reload_ms[name] = _timed(cache, name, inputs[name])
            loads = [e for e in cache.timeline()[before:] if e["event"] == "reload" and e["model"] == name]
            if loads:
                reload_load_ms[name] = loads[0]["ms"]

    order_rng = np.random.default_rng(seed + 1)
    sequence = order_rng.choice(list(MIX), size=requests, p=list(MIX.values()))
    before = len(cache.timeline())
    latencies = [_timed(cache, str(name), inputs[str(name)]) for name in sequence]
    steady_events = cache.timeline()[before:]
    timeline = cache.timeline()
    cache.close()
    sampler.stop()
    per_model = {name: float(np.median([ms for n, ms in zip(sequence, latencies) if n == name]))
                 for name in MODELS if name in set(sequence)}
    return {
        "policy": policy, "budget_bytes": budget_bytes, "baseline_rss_bytes": baseline_rss,
        "startup_s": startup_s, "at_start": at_start, "warm": warm,
        "peak_resident_bytes": max([e["resident_bytes"] for e in timeline] + [peak_accounted]),
        "peak_rss_bytes": max(r for _, r in sampler.samples),
        "first_request_ms": first_ms, "reload_request_ms": reload_ms, "reload_load_ms": reload_load_ms,
        "steady": {"requests": requests, "p50_ms": float(np.percentile(latencies, 50)),
                   "p95_ms": float(np.percentile(latencies, 95)), "mean_ms": float(np.mean(latencies)),
                   "reloads": sum(1 for e in steady_events if e["event"] == "reload"),
                   "evictions": sum(1 for e in steady_events if e["event"] == "evict"),
                   "p50_ms_by_model": per_model},
        "timeline": timeline, "rss_samples": sampler.samples, "cache_offset_s": cache_offset_s,
    }


def _markdown(results: dict[str, Any]) -> str:
    runs = {r["policy"]: r for r in results["runs"]}
    fp = results["footprints"]
    lines = [
        "# Load policies: eager / lazy / lru (engine layer, ONNX Runtime CPU)",
        "",
        f"Machine: {results['machine']}. lru budget: {results['budget_bytes'] / MB:,.1f} MB "
        f"({results['budget_fraction']:.0%} of the {results['total_footprint_bytes'] / MB:,.1f} MB the six models "
        f"need together). RSS = process resident set (includes {runs['eager']['baseline_rss_bytes'] / MB:,.0f} MB "
        "of interpreter and libraries before any model); accounted = the cache's sum of footprints.",
        "",
        "| policy | start-up | RSS at start | accounted at start | RSS all warm | accounted all warm "
        "| peak RSS | steady p50 | steady p95 | reloads (steady) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for policy in POLICIES:
        r = runs[policy]
        lines.append(
            f"| {policy} | {r['startup_s'] * 1e3:,.0f} ms | {r['at_start']['rss_bytes'] / MB:,.0f} MB "
            f"| {r['at_start']['resident_bytes'] / MB:,.0f} MB | {r['warm']['rss_bytes'] / MB:,.0f} MB "
            f"| {r['warm']['resident_bytes'] / MB:,.0f} MB | {r['peak_rss_bytes'] / MB:,.0f} MB "
            f"| {r['steady']['p50_ms']:.1f} ms | {r['steady']['p95_ms']:.1f} ms "
            f"| {r['steady']['reloads']} of {r['steady']['requests']} |")
    lines += ["", "First request per model (ms; lazy and lru include the load), and lru's reload after eviction "
              "(request ms / of which load ms):", "",
              "| model | footprint | eager | lazy | lru | lru reload |", "|---|---|---|---|---|---|"]
    for name in MODELS:
        reload = runs["lru"]["reload_request_ms"].get(name)
        reload_text = (f"{reload:.1f} / {runs['lru']['reload_load_ms'].get(name, float('nan')):.1f}"
                       if reload is not None else "(not evicted)")
        lines.append(f"| {name} | {fp[name]['total_bytes'] / MB:,.1f} MB "
                     + "".join(f"| {runs[p]['first_request_ms'][name]:.1f} " for p in POLICIES)
                     + f"| {reload_text} |")
    lines += ["", "Measuring each footprint at a model's first load (not inside the figures above, "
              "done once per process or recorded): "
              + ", ".join(f"{n} {fp[n]['seconds']:.2f} s" for n in MODELS) + "."]
    return "\n".join(lines) + "\n"


def _plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 3.2 * len(runs)), sharey=True)
    for ax, run in zip(np.atleast_1d(axes), runs):
        ts = [t for t, _ in run["rss_samples"]]
        ax.plot(ts, [r / MB for _, r in run["rss_samples"]], label="process RSS", lw=1)
        events = run["timeline"]
        if events:
            offset = run["cache_offset_s"]  # event t_s counts from the cache's creation
            end = ts[-1] if ts else offset + events[-1]["t_s"]
            xs = [offset] + [offset + e["t_s"] for e in events] + [end]
            ys = [0.0] + [e["resident_bytes"] / MB for e in events] + [events[-1]["resident_bytes"] / MB]
            ax.step(xs, ys, where="post", label="accounted (sum of footprints)", lw=1.5)
            for e in events:
                if e["event"] in ("evict", "reload"):
                    ax.axvline(offset + e["t_s"], color="grey" if e["event"] == "evict" else "tab:red", lw=0.3)
        if run["budget_bytes"]:
            ax.axhline(run["budget_bytes"] / MB, color="k", ls="--", lw=1, label="budget")
        ax.set_title(f"{run['policy']}")
        ax.set_ylabel("MB")
        ax.legend(loc="upper right", fontsize=8)
    np.atleast_1d(axes)[-1].set_xlabel("seconds since the process started sampling (just before the cache)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Benchmark eager / lazy / lru load policies (no Ray).")
    parser.add_argument("--root", default="engines")
    parser.add_argument("--budget-fraction", type=float, default=0.45)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--child", choices=POLICIES, help=argparse.SUPPRESS)
    parser.add_argument("--child-args", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        spec = json.loads(args.child_args.read_text())
        result = run_policy(args.root, args.child, spec["footprints"], spec["budget_bytes"], args.requests, args.seed)
        args.child_args.write_text(json.dumps(result))
        return 0

    footprints = _measure_footprints(args.root)
    total = sum(f["total_bytes"] for f in footprints.values())
    budget = max(int(args.budget_fraction * total), max(f["total_bytes"] for f in footprints.values()))
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for policy in POLICIES:
            spec_path = Path(tmp) / f"{policy}.json"
            spec_path.write_text(json.dumps({"footprints": footprints,
                                             "budget_bytes": budget if policy == "lru" else None}))
            subprocess.run([sys.executable, "-m", "bench.memory_policies", "--root", args.root, "--child", policy,
                            "--child-args", str(spec_path), "--requests", str(args.requests),
                            "--seed", str(args.seed)], check=True)
            runs.append(json.loads(spec_path.read_text()))
            print(f"{policy}: start-up {runs[-1]['startup_s']:.2f} s, steady p50 {runs[-1]['steady']['p50_ms']:.1f} ms",
                  flush=True)
    import os
    import platform

    import onnxruntime

    results = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, ONNX Runtime {onnxruntime.__version__}, "
                   f"Python {platform.python_version()}",
        "footprints": footprints, "total_footprint_bytes": total, "budget_bytes": budget,
        "budget_fraction": args.budget_fraction, "requests": args.requests, "seed": args.seed, "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memory_policies.json").write_text(json.dumps(results, indent=1))
    markdown = _markdown(results)
    (args.out / "memory_policies.md").write_text(markdown)
    _plot(results, args.out / "memory_policies.png")
    print(markdown)
    print(f"wrote {args.out}/memory_policies.{{json,md,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
