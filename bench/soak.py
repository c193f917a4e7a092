"""Soak: mixed load on every model for many minutes, a replica killed every few minutes.

Load: ``concurrency`` clients, each sends one request, waits for the answer (client timeout
``client_timeout_s``: longer than that is a hung request), pauses ``think_s`` and sends the
next, to a model drawn at random (seeded) from every model of the repository: the dedicated
OCR models and the ``ocr`` pipeline on a real PNG (``tests/data/ocr_sample.png``), and the pool
models, whose memory budget (``POOL``) holds the largest CNN but not all three, so the pool
evicts and reloads all the time (LRU churn; the count of evictions is reported). Tensor
models get random inputs, half as JSON and half as binary tensors; ``simple``'s answers are
checked (OUTPUT0 = INPUT0 + INPUT1).

Faults: every ``kill_every_s`` a replica is killed with SIGKILL, in turn the pool and each
dedicated deployment (``bench.replicas``: PIDs from Ray's process titles); Serve replaces it.

Every request must be answered: 200, or a documented error of the one error table with its
``{"error": ...}`` body: 503 (shed, or the model has no running replica: "not ready") or 504
(the model did not answer within ``request_timeout_s``). Anything else is **lost**: another
status, a bare 503, a broken connection, no answer within the client timeout.

Memory: RSS of the server's processes (every replica, Ray's own processes;
``bench.replicas.server_rss_bytes``), sampled every ``sample_every_s``; growth = mean of the
last ``window_s`` over the mean of the first ``window_s`` after ``warmup_s`` (a killed replica
comes back with a fresh process, so the per-deployment figures of the roles never killed
are reported too).

    python -m bench.soak                                  # 20 minutes, a kill every 3 minutes
    python -m bench.soak --duration-s 120 --kill-every-s 40   # a short look

Writes ``bench/results/soak-<time>.json`` and prints the summary. The short form runs in
``make test`` (``tests/integration/test_campaigns.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import random
import re
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from bench.loadgen import Workload, make_workload
from bench.replicas import kill_replica, replica_pids, server_rss_bytes

ROOT = Path(__file__).resolve().parents[1]
OCR_IMAGE = ROOT / "tests" / "data" / "ocr_sample.png"
# The pool of the soak: serve_config.yaml's (count cap 6, LRU, 1,536 MiB): any one CNN fits (their
# ONNX Runtime footprints, measured at load, are about 0.5-1 GiB each), never all three: LRU churn.
POOL = {"max_num_models_per_replica": 6, "load_policy": "lru", "memory_budget_mib": 1536}
TENSOR_SHAPES = {"tiny_cnn": ("input", (1, 3, 224, 224)), "mid_cnn": ("input", (1, 3, 224, 224)),
                 "resnet18": ("input", (1, 3, 224, 224)), "ocr_det": ("x", (1, 3, 320, 320)),
                 "ocr_cls": ("x", (1, 3, 48, 192)), "ocr_rec": ("x", (1, 3, 48, 320))}
KILL_TARGETS = ("pool", "model-ocr_det", "model-ocr_rec", "model-ocr_cls", "pipeline-ocr")
# 502: HAProxy's JSON "send it again" for a request a killed replica held in one hop whose body
# was over its buffer (deployments/haproxy.py); 503, 504: the server's own.
DOCUMENTED = (502, 503, 504)


def _json_workload(label: str, base_url: str, model: str, inputs: list[dict[str, Any]],
                   outputs: list[str] | None = None) -> Workload:
    body: dict[str, Any] = {"inputs": inputs}
    if outputs:
        body["outputs"] = [{"name": n} for n in outputs]
    return Workload(label, f"{base_url.rstrip('/')}/v2/models/{model}/infer", json.dumps(body).encode(),
                    {"Content-Type": "application/json"})


def workloads(base_url: str, seed: int = 0) -> list[Workload]:
    """One request per model of the repository (tensor models twice: JSON and binary)."""
    rng = np.random.default_rng(seed)
    out = []
    for model, (name, shape) in TENSOR_SHAPES.items():
        x = rng.random(shape, dtype=np.float32)
        out.append(make_workload(f"{model}/json", base_url, model, name, x, binary=False))
        out.append(make_workload(f"{model}/binary", base_url, model, name, x, binary=True))
    a, b = list(range(16)), [3] * 16
    out.append(_json_workload("simple", base_url, "simple", [
        {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": a},
        {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": b}]))
    out.append(_json_workload("simple_string", base_url, "simple_string", [
        {"name": "INPUT0", "shape": [1, 16], "datatype": "BYTES", "data": [str(v) for v in a]},
        {"name": "INPUT1", "shape": [1, 16], "datatype": "BYTES", "data": [str(v) for v in b]}]))
    out.append(_json_workload("simple_identity", base_url, "simple_identity", [
        {"name": "INPUT0", "shape": [1, 16], "datatype": "BYTES", "data": [f"soak {i}" for i in a]}]))
    image = base64.b64encode(OCR_IMAGE.read_bytes()).decode()
    out.append(_json_workload("ocr", base_url, "ocr", [
        {"name": "image", "shape": [1], "datatype": "BYTES", "parameters": {"content_type": "base64"},
         "data": [image]}], ["text"]))
    return out


SIMPLE_SUM = [i + 3 for i in range(16)]


@dataclass
class Outcome:
    """One request: workload label, ``status`` (None: no HTTP answer), the ``{"error"}`` text or
    the client-side failure, seconds from the start of the run when sent, latency in seconds."""

    label: str
    status: int | None
    error: str | None
    sent_s: float
    latency_s: float

    @property
    def lost(self) -> bool:
        """Not a 200 and not a documented 503/504 carrying an ``{"error": ...}`` body."""
        return not (self.status == 200 or (self.status in DOCUMENTED and self.error is not None))


def _check_answer(label: str, status: int, body: bytes) -> tuple[int | None, str | None]:
    """(status, error text): the ``error`` of an error body; a wrong ``simple`` answer or an error
    status without a JSON ``{"error": ...}`` body becomes status None with what was wrong."""
    if status == 200:
        if label == "simple":
            outputs = {o["name"]: o["data"] for o in json.loads(body)["outputs"]}
            if outputs["OUTPUT0"] != SIMPLE_SUM:
                return None, f"wrong answer: OUTPUT0 = {outputs['OUTPUT0']}"
        return 200, None
    try:
        error = json.loads(body)["error"]
        return status, str(error)
    except (ValueError, KeyError, TypeError):
        return status if status not in DOCUMENTED else None, f"{status} without an error body: {body[:120]!r}"


async def _client(session, plan: list[Workload], rng: random.Random, start: float, stop: float,
                  think_s: float, client_timeout_s: float, outcomes: list[Outcome]) -> None:
    import aiohttp

    while time.monotonic() < stop:
        w = rng.choice(plan)
        sent = time.monotonic()
        try:
            async with session.post(w.url, data=w.body, headers=w.headers,
                                    timeout=aiohttp.ClientTimeout(total=client_timeout_s)) as r:
                status, error = _check_answer(w.label, r.status, await r.read())
        except asyncio.TimeoutError:
            status, error = None, f"no answer within {client_timeout_s:g} s (hung)"
        except aiohttp.ClientError as e:
            status, error = None, f"{type(e).__name__}: {e}"
        outcomes.append(Outcome(w.label, status, error, round(sent - start, 3), round(time.monotonic() - sent, 4)))
        await asyncio.sleep(think_s)


async def _load(plan: list[Workload], concurrency: int, duration_s: float, think_s: float,
                client_timeout_s: float, seed: int, outcomes: list[Outcome]) -> None:
    import aiohttp

    start = time.monotonic()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        await asyncio.gather(*(_client(session, plan, random.Random(seed + i), start, start + duration_s,
                                       think_s, client_timeout_s, outcomes) for i in range(concurrency)))


@dataclass
class Kill:
    """One injected fault: when (s from start), which deployment, the pid killed, and seconds
    until a replacement process of that deployment was running (None: not within the run)."""

    at_s: float
    deployment: str
    pid: int
    replaced_after_s: float | None = None


@dataclass
class SoakReport:
    duration_s: float
    requests: int
    ok: int
    documented: dict[str, int]
    lost: int
    lost_examples: list[dict[str, Any]]
    by_model: dict[str, dict[str, int]]
    errors: dict[str, int]
    kills: list[dict[str, Any]]
    rss_samples: list[dict[str, Any]] = field(default_factory=list)
    memory: dict[str, Any] = field(default_factory=dict)
    pool_evictions: int | None = None
    # evictions the pool replicas counted before they were killed (``pool_evictions`` read just
    # before each kill of the pool: a killed replica's timeline goes with it)
    evictions_before_kills: int = 0


def memory_growth(samples: list[dict[str, Any]], warmup_s: float, window_s: float,
                  killed: set[str]) -> dict[str, Any]:
    """Growth of RSS: mean of the last ``window_s`` of samples over the mean of the first
    ``window_s`` after ``warmup_s``, for the total and for the roles never killed.

    Args:
        samples: ``{"t_s": seconds, "rss_bytes": {role: bytes}}`` in time order.
    """
    end = samples[-1]["t_s"] if samples else 0.0
    first = [s for s in samples if warmup_s <= s["t_s"] < warmup_s + window_s]
    last = [s for s in samples if s["t_s"] > end - window_s]
    if not first or not last or first[-1]["t_s"] >= last[0]["t_s"]:
        return {"growth": None, "why": "run too short for two windows after the warm-up"}

    def mean(rows: list[dict[str, Any]], roles: Callable[[str], bool]) -> float:
        return sum(sum(v for k, v in r["rss_bytes"].items() if roles(k)) for r in rows) / len(rows)

    total_before, total_after = mean(first, lambda k: True), mean(last, lambda k: True)
    kept_before, kept_after = mean(first, lambda k: k not in killed), mean(last, lambda k: k not in killed)
    return {"window_s": window_s, "warmup_s": warmup_s,
            "total_before_bytes": round(total_before), "total_after_bytes": round(total_after),
            "growth": round(total_after / total_before - 1, 4),
            "never_killed_before_bytes": round(kept_before), "never_killed_after_bytes": round(kept_after),
            "never_killed_growth": round(kept_after / kept_before - 1, 4) if kept_before else None}


def soak(base_url: str, session: int, app: str, duration_s: float, kill_every_s: float,
         concurrency: int = 4, think_s: float = 0.05, client_timeout_s: float = 90.0,
         targets: Sequence[str] = KILL_TARGETS, sample_every_s: float = 5.0, warmup_s: float = 60.0,
         window_s: float = 120.0, seed: int = 0, log: Callable[[str], None] = lambda s: None) -> SoakReport:
    """Run the soak against a live server and return its report.

    Args:
        base_url: the application's base URL (``http://127.0.0.1:port[/prefix]``).
        session: session id of the Ray instance's processes (``bench.replicas``).
        app: the Serve application's name (replica titles carry it).
        duration_s: seconds of load; the first kill comes at ``kill_every_s``.
    """
    plan = workloads(base_url, seed)
    outcomes: list[Outcome] = []
    runner = threading.Thread(target=lambda: asyncio.run(
        _load(plan, concurrency, duration_s, think_s, client_timeout_s, seed, outcomes)), daemon=True)
    start = time.monotonic()
    runner.start()
    kills: list[Kill] = []
    samples: list[dict[str, Any]] = []
    next_kill, next_sample, turn, evicted = start + kill_every_s, start, 0, 0
    while runner.is_alive():
        now = time.monotonic()
        if now >= next_sample:
            samples.append({"t_s": round(now - start, 1), "rss_bytes": server_rss_bytes(session, app)})
            next_sample += sample_every_s
        for k in kills:  # a replacement is a new pid of the deployment
            if k.replaced_after_s is None and set(replica_pids(session, app, k.deployment)) - {k.pid}:
                k.replaced_after_s = round(now - start - k.at_s, 1)
        if now >= next_kill and now < start + duration_s - 10:
            deployment = targets[turn % len(targets)]
            turn += 1
            if deployment == "pool":
                with contextlib.suppress(OSError, ValueError):
                    evicted += pool_evictions(base_url)
            try:
                kills.append(Kill(round(now - start, 1), deployment, kill_replica(session, app, deployment)))
                log(f"{now - start:7.1f} s: killed {deployment} (pid {kills[-1].pid}); "
                    f"{len(outcomes)} requests so far, {sum(o.lost for o in outcomes)} lost")
            except LookupError as e:
                log(f"{now - start:7.1f} s: {e}")
            next_kill += kill_every_s
        runner.join(0.5)
    report = _report(outcomes, kills, samples, duration_s, warmup_s, window_s)
    report.evictions_before_kills = evicted
    return report


def _report(outcomes: list[Outcome], kills: list[Kill], samples: list[dict[str, Any]], duration_s: float,
            warmup_s: float, window_s: float) -> SoakReport:
    documented: dict[str, int] = {}
    by_model: dict[str, dict[str, int]] = {}
    for o in outcomes:
        key = "lost" if o.lost else str(o.status)
        if not o.lost and o.status != 200:
            documented[key] = documented.get(key, 0) + 1
        row = by_model.setdefault(o.label.split("/")[0], {})
        row[key] = row.get(key, 0) + 1
    lost = [o for o in outcomes if o.lost]
    errors: dict[str, int] = {}  # distinct error texts (digits masked) with their counts
    for o in outcomes:
        if o.error is not None:
            text = f"{o.status}: " + re.sub(r"\d+", "N", o.error)[:160]
            errors[text] = errors.get(text, 0) + 1
    killed = {k.deployment for k in kills}
    return SoakReport(
        duration_s=duration_s, requests=len(outcomes), ok=sum(o.status == 200 for o in outcomes),
        documented=documented, lost=len(lost), lost_examples=[asdict(o) for o in lost[:10]],
        by_model=by_model, errors=errors, kills=[asdict(k) for k in kills], rss_samples=samples,
        memory=memory_growth(samples, warmup_s, window_s, killed))


def pool_evictions(base_url: str) -> int:
    """Evictions in the pool replica's cache timeline (``GET /v2/memory``) of the replica now
    running (a killed one's count is gone with it)."""
    import urllib.request

    with urllib.request.urlopen(f"{base_url.rstrip('/')}/v2/memory", timeout=30) as r:
        pool = json.load(r)["pool"] or {}
    return sum(e["event"] == "evict" for e in pool.get("events", []))


def summary(report: SoakReport) -> str:
    """The report as a few lines for people."""
    mem = report.memory
    growth = "n/a" if mem.get("growth") is None else (
        f"{mem['growth']:+.1%} total ({mem['total_before_bytes'] / 2**20:.0f} -> "
        f"{mem['total_after_bytes'] / 2**20:.0f} MiB), {mem['never_killed_growth']:+.1%} in processes never killed")
    lines = [f"soaked {report.duration_s / 60:.1f} min: {report.requests} requests, {report.ok} answered 200, "
             f"documented errors {report.documented}, lost {report.lost}",
             f"kills: {len(report.kills)} " + ", ".join(
                 f"{k['deployment']}@{k['at_s']:.0f}s (replaced after {k['replaced_after_s']} s)" for k in report.kills),
             f"memory growth after warm-up: {growth}",
             f"pool evictions (current pool replica): {report.pool_evictions}"]
    lines += [f"  {m:16} {row}" for m, row in sorted(report.by_model.items())]
    lines += [f"  {n:6} x {text}" for text, n in sorted(report.errors.items(), key=lambda x: -x[1])]
    lines += [f"  lost: {e}" for e in report.lost_examples]
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    from bench.overload import default_app_args
    from bench.throughput import Server

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=1200.0)
    p.add_argument("--kill-every-s", type=float, default=180.0)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--think-s", type=float, default=0.05, help="pause of each client between requests")
    p.add_argument("--warmup-s", type=float, default=60.0)
    p.add_argument("--window-s", type=float, default=120.0, help="memory: mean over this at start and end")
    p.add_argument("--config", default=str(ROOT / "serve_config.yaml"), help="application args from here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = p.parse_args(argv)
    app_args = default_app_args(Path(a.config))
    app_args["pool"] = {**app_args.get("pool", {}), **POOL}
    with Server("ray", Path(app_args["repository"]), app_args=app_args) as server:
        session = server.process.pid  # start_new_session: the server leads its own session
        print(f"server at {server.url}; soaking {a.duration_s:g} s", file=sys.stderr, flush=True)
        report = soak(server.url, session, "models", a.duration_s, a.kill_every_s, a.concurrency, a.think_s,
                      warmup_s=a.warmup_s, window_s=a.window_s, seed=a.seed,
                      log=lambda s: print(s, file=sys.stderr, flush=True))
        report.pool_evictions = pool_evictions(server.url)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"soak-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"command": "python -m bench.soak " + " ".join(argv), "app_args": app_args,
                                **asdict(report)}, indent=2))
    print(summary(report))
    print(f"wrote {path}", file=sys.stderr)
    growth = report.memory.get("growth")
    return 1 if report.lost or (growth is not None and growth >= 0.10) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
