"""The Grafana dashboard's panels over a short benchmark, drawn from ``/metrics`` scrapes.

Without a Prometheus and a Grafana at hand, this plays both: it starts the application (Ray,
``fast`` configuration, metrics on), runs a load in three phases, scrapes the router's
``GET /metrics`` every ``--scrape-s`` seconds meanwhile, and draws the panels of
``cluster/grafana-dashboard.json`` with matplotlib from the same series and the same
arithmetic as its PromQL (``rate`` over ``--window-s``, ``histogram_quantile`` with linear
interpolation inside a bucket):

QPS per model; p50 / p99 latency; queue vs compute time per request; rows per model execution
(batch size); pending requests; pool cache resident bytes; cache loads, reloads and evictions;
GPU memory (only where ``nv_gpu_*`` series exist).

The load: ``tiny_cnn``, ``mid_cnn`` and ``resnet18`` from the pool (two replicas' worth of
models: ``max_num_models_per_replica: 2``, so three models make it evict and reload) and
``ocr_cls_batched`` (ocr_cls with a 2 ms batching window). Phase 1: tiny_cnn and
ocr_cls_batched; phase 2: also mid_cnn and resnet18 at one client each; phase 3:
ocr_cls_batched alone at 4x the clients. ``--replot run.json`` redraws a saved run.

    python -m bench.dashboard                      # 3 phases of 20 s; PNG + JSON in bench/results
    python -m bench.dashboard --phase-s 10 --png bench/dashboard-cpu.png
    python -m bench.dashboard --gpu-fraction 0.1   # on a GPU machine: GPU memory too (nvidia-ml-py)
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import requests

from bench.loadgen import make_workload, run
from bench.throughput import ROOT, SHAPES, Server, prepare_repository

POOL_MODELS = ("tiny_cnn", "mid_cnn", "resnet18")
BATCHED = "ocr_cls_batched"
Scrape = tuple[float, dict[tuple[str, tuple[tuple[str, str], ...]], float]]


class Scraper:
    """Scrapes ``url`` every ``every_s`` seconds in a thread: ``(time s, {(sample name,
    sorted labels): value})`` per scrape (samples as ``prometheus_client``'s parser names them)."""

    def __init__(self, url: str, every_s: float) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        self.url, self.every_s, self.parse = url, every_s, text_string_to_metric_families
        self.scrapes: list[Scrape] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        start = time.monotonic()
        while not self._stop.is_set():
            t = time.monotonic() - start
            try:
                text = requests.get(self.url, timeout=10).text
            except requests.RequestException:
                text = ""
            values = {(s.name, tuple(sorted(s.labels.items()))): s.value
                      for family in self.parse(text) for s in family.samples}
            self.scrapes.append((t, values))
            self._stop.wait(max(0.0, self.every_s - (time.monotonic() - start - t)))

    def __enter__(self) -> "Scraper":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


# --- PromQL's arithmetic over the scrapes ------------------------------------------------------

def select(values: dict, name: str, by: Sequence[str], **match: str) -> dict[tuple[str, ...], float]:
    """``sum by (by) (name{match})`` of one scrape (``name`` of a counter: with or without the
    ``_total`` that prometheus_client's parser gives every counter sample)."""
    out: dict[tuple[str, ...], float] = defaultdict(float)
    names = (name, name + "_total")
    for (sample, labels), v in values.items():
        d = dict(labels)
        if sample in names and all(d.get(k) == m for k, m in match.items()):
            out[tuple(d.get(k, "") for k in by)] += v
    return out


def rate(scrapes: list[Scrape], name: str, by: Sequence[str], window_s: float,
         **match: str) -> tuple[np.ndarray, dict[tuple[str, ...], np.ndarray]]:
    """``sum by (by) (rate(name[window_s]))`` at every scrape from the first full window."""
    times, out = [], defaultdict(list)
    keys = {k for _, values in scrapes for k in select(values, name, by, **match)}
    for i, (t, values) in enumerate(scrapes):
        j = next((j for j in range(i, -1, -1) if t - scrapes[j][0] >= window_s), None)
        if j is None:
            continue
        now, then = select(values, name, by, **match), select(scrapes[j][1], name, by, **match)
        times.append(t)
        for k in keys:
            out[k].append(max(0.0, now.get(k, 0.0) - then.get(k, 0.0)) / (t - scrapes[j][0]))
    return np.array(times), {k: np.array(v) for k, v in out.items()}


def gauge(scrapes: list[Scrape], name: str, by: Sequence[str]) -> tuple[np.ndarray, dict[tuple[str, ...], np.ndarray]]:
    """``sum by (by) (name)`` at every scrape (0 where absent)."""
    keys = {k for _, values in scrapes for k in select(values, name, by)}
    series = {k: np.array([select(values, name, by).get(k, 0.0) for _, values in scrapes]) for k in keys}
    return np.array([t for t, _ in scrapes]), series


def histogram_quantile(q: float, buckets: dict[float, float]) -> float:
    """Prometheus's ``histogram_quantile``: ``buckets`` upper bound -> cumulative rate; linear
    interpolation inside the bucket holding the rank (NaN without observations)."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return math.nan
    rank, lower, below = q * total, 0.0, 0.0
    for upper in bounds:
        if buckets[upper] >= rank:
            if math.isinf(upper):
                return lower
            return lower + (upper - lower) * (rank - below) / max(buckets[upper] - below, 1e-12)
        lower, below = upper, buckets[upper]
    return lower


def quantiles(scrapes: list[Scrape], q: float, window_s: float) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Per model, ``histogram_quantile(q, sum by (model, le) (rate(..._bucket[window])))`` in ms."""
    times, rates = rate(scrapes, "trt_serve_request_duration_seconds_bucket", ("model", "le"), window_s)
    by_model: dict[str, dict[float, np.ndarray]] = defaultdict(dict)
    for (model, le), r in rates.items():
        by_model[model][float(le)] = r
    return times, {m: np.array([histogram_quantile(q, {le: r[i] for le, r in b.items()}) * 1e3
                                for i in range(len(times))]) for m, b in by_model.items()}


def per_request(scrapes: list[Scrape], counter: str, window_s: float) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Per model, ``rate(counter) / rate(nv_inference_request_success)``, microseconds -> ms."""
    times, num = rate(scrapes, counter, ("model",), window_s)
    _, den = rate(scrapes, "nv_inference_request_success", ("model",), window_s)
    return times, {k[0]: np.where(den[k] > 0, num[k] / np.maximum(den[k], 1e-12) / 1e3, np.nan) for k in num if k in den}


# --- the figure ---------------------------------------------------------------------------------

def draw(scrapes: list[Scrape], phases: list[tuple[float, str]], window_s: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 2, figsize=(14, 15))

    def lines(ax: Any, times: np.ndarray, series: dict, label: Callable[[Any], str], style: str = "-") -> None:
        for k in sorted(series):
            ax.plot(times, series[k], style, label=label(k))

    def qps(ax: Any) -> None:
        lines(ax, *rate(scrapes, "nv_inference_request_success", ("model",), window_s), lambda k: k[0])
        times, failed = rate(scrapes, "nv_inference_request_failure", ("model", "reason"), window_s)
        lines(ax, times, failed, lambda k: f"{k[0]} failed ({k[1]})", ":")

    def latency(ax: Any) -> None:
        for q, style in ((0.5, "-"), (0.99, "--")):
            times, series = quantiles(scrapes, q, window_s)
            ax.set_prop_cycle(None)
            lines(ax, times, series, lambda m, q=q: f"{m} p{int(q * 100)}", style)

    def queue_compute(ax: Any) -> None:
        for counter, style, what in (("nv_inference_queue_duration_us", "--", "queue"),
                                     ("nv_inference_compute_infer_duration_us", "-", "compute")):
            times, series = per_request(scrapes, counter, window_s)
            ax.set_prop_cycle(None)
            lines(ax, times, series, lambda m, what=what: f"{m} {what}", style)

    def batch(ax: Any) -> None:
        times, rows = rate(scrapes, "nv_inference_count", ("model",), window_s)
        _, execs = rate(scrapes, "nv_inference_exec_count", ("model",), window_s)
        lines(ax, times, {k: np.where(execs[k] > 0, rows[k] / np.maximum(execs[k], 1e-12), np.nan)
                          for k in rows if k in execs}, lambda k: k[0])

    def pending(ax: Any) -> None:
        lines(ax, *gauge(scrapes, "nv_inference_pending_request_count", ("model",)), lambda k: k[0])

    def residency(ax: Any) -> None:
        times, series = gauge(scrapes, "trt_serve_cache_resident_bytes", ("replica",))
        lines(ax, times, {k: v / 2**20 for k, v in series.items()}, lambda k: f"replica {k[0][:8]}")
        times, budget = gauge(scrapes, "trt_serve_cache_budget_bytes", ("replica",))
        lines(ax, times, {k: v / 2**20 for k, v in budget.items() if v.any()}, lambda k: f"budget {k[0][:8]}", ":")

    def cache_events(ax: Any) -> None:
        for name, style in (("loads", "-"), ("reloads", "--"), ("evictions", ":")):
            times, series = gauge(scrapes, f"trt_serve_cache_{name}", ("model",))
            ax.set_prop_cycle(None)
            lines(ax, times, series, lambda k, name=name: f"{k[0]} {name}", style)

    def gpu(ax: Any) -> None:
        times, used = gauge(scrapes, "nv_gpu_memory_used_bytes", ("gpu_uuid",))
        _, total = gauge(scrapes, "nv_gpu_memory_total_bytes", ("gpu_uuid",))
        if not used:
            ax.text(0.5, 0.5, "no nv_gpu_* series (no GPU on this machine)", ha="center", va="center",
                    transform=ax.transAxes)
        lines(ax, times, {k: v / 2**30 for k, v in used.items()}, lambda k: f"used {k[0][:12]}")
        lines(ax, times, {k: v / 2**30 for k, v in total.items()}, lambda k: f"total {k[0][:12]}", ":")

    panels: list[tuple[str, str, Callable[[Any], None]]] = [("Requests per second (QPS)", "requests/s", qps),
              ("Request latency p50 (solid) / p99 (dashed)", "ms", latency),
              ("Queue (dashed) vs compute (solid) per request", "ms", queue_compute),
              ("Batch size (rows per model execution)", "rows", batch),
              ("Pending requests", "requests", pending),
              ("Pool cache residency", "MiB", residency),
              ("Pool cache loads, reloads, evictions (cumulative)", "count", cache_events),
              ("GPU memory", "GiB", gpu)]
    end = scrapes[-1][0] if scrapes else 1.0
    for ax, (name, unit, fill) in zip(axes.flat, panels):
        fill(ax)
        for start, label in phases:
            ax.axvline(start, color="grey", lw=0.6)
            ax.text(start, 1.0, f" {label.split(':')[0]}", transform=ax.get_xaxis_transform(), fontsize=8,
                    va="top", color="grey")
        ax.set_xlim(0, end)
        ax.set_title(name, fontsize=10)
        ax.set_ylabel(unit)
        ax.set_xlabel("s")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0, 0.9))
    fig.suptitle(title + "\nphases: " + "; ".join(label for _, label in phases), fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def title(args: dict[str, Any]) -> str:
    return (f"trt-serve over a 3-phase benchmark ({args['concurrency']} clients per model): the panels of "
            f"cluster/grafana-dashboard.json from /metrics scraped every {args['scrape_s']:g} s, "
            f"rate window {args['window_s']:g} s")


def main(argv: Sequence[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phase-s", type=float, default=20.0)
    p.add_argument("--scrape-s", type=float, default=1.0)
    p.add_argument("--window-s", type=float, default=5.0, help="rate() window")
    p.add_argument("--concurrency", type=int, default=4, help="clients per model (phase 3: 4x)")
    p.add_argument("--gpu-fraction", type=float, default=0.0, help="num_gpus of the pool and ocr_cls_batched (0: CPU)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--png", default="", help="the figure's path (default: in --out)")
    p.add_argument("--replot", default="", help="draw from a previous run's JSON instead of running")
    a = p.parse_args(argv)
    if a.replot:
        saved = json.loads(Path(a.replot).read_text())
        scrapes = [(t, {(n, tuple(sorted(labels.items()))): v for n, labels, v in values})
                   for t, values in saved["scrapes"]]
        png = Path(a.png or Path(a.replot).with_suffix(".png"))
        draw(scrapes, [tuple(x) for x in saved["phases"]], saved["args"]["window_s"], png, title(saved["args"]))
        print(f"wrote {png}", file=sys.stderr)
        return
    import matplotlib  # noqa: F401  (needed at the end: fail before the run, not after)

    scratch = Path(tempfile.mkdtemp(prefix="bench-dashboard-"))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    png = Path(a.png) if a.png else Path(a.out) / f"dashboard-{stamp}.png"
    repo = scratch / "engines"
    repo.mkdir()
    for name in POOL_MODELS:
        (repo / name).symlink_to((ROOT / "engines" / name).resolve())
    prepare_repository(repo, ROOT / "engines", [], ["ocr_cls"], 1, 2.0, a.gpu_fraction)
    app = {"repository": str(repo), "models": [*POOL_MODELS, BATCHED], "use_gpus": bool(a.gpu_fraction),
           "router": {"num_replicas": 1, "num_cpus": 0.1, "max_ongoing_requests": 1024},
           "pool": {"num_replicas": 1, "max_num_models_per_replica": 2, "num_gpus": a.gpu_fraction}}
    rng = np.random.default_rng(0)
    try:
        with Server("ray", repo, app_args=app) as server:
            load = {m: make_workload(m, server.url, m, "x" if m.startswith("ocr") else "input",
                                     rng.random(SHAPES[m.removesuffix("_batched")], dtype=np.float32), binary=True)
                    for m in [*POOL_MODELS, BATCHED]}
            c = a.concurrency
            plan = [("1: tiny_cnn + ocr_cls_batched", [(load["tiny_cnn"], c), (load[BATCHED], c)]),
                    ("2: + mid_cnn, resnet18 at 1 client (the pool evicts)",
                     [(load["tiny_cnn"], c), (load[BATCHED], c), (load["mid_cnn"], 1), (load["resnet18"], 1)]),
                    ("3: ocr_cls_batched x4 clients", [(load[BATCHED], 4 * c)])]
            phases = []
            with Scraper(f"{server.url}/metrics", a.scrape_s) as scraper:
                time.sleep(2 * a.scrape_s)
                for label, workloads in plan:
                    phases.append((scraper.scrapes[-1][0] if scraper.scrapes else 0.0, label))
                    results = run(workloads, a.phase_s, 0.0)
                    print(label, {r.label: r.qps for r in results}, flush=True)
                time.sleep(a.window_s)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    data = Path(a.out) / f"dashboard-{stamp}.json"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text(json.dumps({"args": vars(a), "phases": phases,
                                "scrapes": [[t, [[n, dict(l), v] for (n, l), v in values.items()]]
                                            for t, values in scraper.scrapes]}))
    draw(scraper.scrapes, phases, a.window_s, png, title(vars(a)))
    print(f"wrote {png} and {data}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
