"""Placement by bytes against the hash on a long-tail pool workload (issue 31's benchmark).

One server per policy, as ``make serve`` runs it (``python -m deployments.run``, HAProxy in
front, Ray's throughput-optimized mode): ``--models`` pool models, each a copy of ``ocr_cls``'s
model file under its own name (its own file, so each replica measures each footprint apart)
with a max batch of 4, 8, 16 or 32 in turn (so their footprints differ about 4x), ``--replicas``
pool replicas, each with ``memory_budget_mib`` = ``--budget-fraction`` of all the models'
bytes (measured beforehand, ``deployments.runtime.tools.plan measure``) and no count cap.
``pool.placement`` is ``hash`` or ``bytes``; nothing else differs.

Clients: closed loop, each picks its next model at random with Zipf popularity (weight of the
k-th model ~ 1 / k^s) from its own seeded generator, sends ocr_cls's input (Triton binary
tensors) and checks every answer: its output's datatype and shape, and every
``SAMPLE_EVERY``-th one's values against ONNX Runtime's in this process
(``bench.loadgen.expected_from_onnx``; every copy has the same weights). A wrong answer counts
as an error.

Per policy and client count (after ``--warmup-s`` under the same load, so rates and the
placement settle): cold loads per 1,000 requests (the pool replicas' ``trt_serve_cache_loads``
+ ``_reloads`` from ``GET /metrics``, whose counters outlive a killed replica, across the
window, over the requests answered in it), p50 / p99, QPS, and the most any replica's cache
held over its budget at any sampled moment (``max_resident_over_budget_bytes``: from
``/v2/memory``, one replica a call, every ``SAMPLE_S``: its resident bytes now and after every
event of its timeline; and from the metrics' per-replica resident gauge; 0 when never over).
Also each pool replica's CPU seconds in the window (``replica_cpu_s``: the spread of their
busy time), errors by status, and the footprints the replicas measured.

Without ``--quick``, after the steady window the popularity shifts (the ranking rotated by half:
the hot set changes) and the cold-load rate is reported per ``BUCKET_S`` after it
(``after_shift``; under ``bytes`` each bucket's ``why``: its loads sorted into prefetches of
copies a placement revision put there, moves among them, and loads no revision explains
(``Watch.loads_between``); ``steady_loads`` the same for the steady window), then one pool replica is killed (``bench.replicas.kill_replica``) under load
and the requests that were not answered 200 from the kill on are counted (``lost``, with their
statuses).

Defaults: 4 pool replicas, a third of the bytes each, Zipf s = 1; ``--quick``: 30 models, 16
clients, 25 s warm-up and a 30 s window per policy (about 4 minutes on 2 cores); else 48
models, 16 and 64 clients, 40 s and 60 s, then the shift (``--shift-s`` 40) and the kill
(``--kill-s`` 30) at each client count.

On a GPU (``--gpu-fraction F``: each pool replica's ``num_gpus``; 0, the default, runs on CPU
as before): the footprints are measured on the backend the replicas serve with (``--backend``,
passed to ``plan measure`` and to the application; ``auto`` picks ``onnxruntime_cuda`` on the
H200, and with ``--gpu-fraction 0`` means ``onnxruntime``), so the budgets are GPU bytes, and
answers are checked within TF32's tolerance. Beside the cache's accounting, every
``NVML_SAMPLE_S`` each pool replica's GPU bytes as NVML counts them per process
(``nvidia-smi --query-compute-apps``; nothing where ``nvidia-smi`` is missing):
``max_nvml_process_bytes`` (the most any pool replica's pid held at any sample of the point,
warm-up included) and ``max_nvml_over_budget_bytes`` (that less the budget, 0 when under). NVML
counts the whole process: its CUDA context (about 0.5 GB on an H200) and ONNX Runtime's arena
beside the models, so the raw figure and the budget are both in the row (``nvml``: each pid's
most, the pool's and the others') for a reader to judge, with NVML's bytes of a process that
primed the CUDA provider and holds no model (``primed_process_bytes``, measured once) and the
most less both (``max_nvml_over_budget_less_primed_bytes``); ``max_gpu_over_baseline_over_budget_bytes``
is the replicas' own reading of it less the bytes they held before any model (the cache's
events, where the replica has ``nvidia-ml-py``; None where no event carried it), and
``replica_gpu_sources`` how the replicas read their GPU bytes (``device``: the whole GPU's,
so their footprints measured while a neighbour loads count its bytes too).
``--no-shift-kill`` skips the shift and the kill without ``--quick``'s other defaults.

``--policies`` also takes ``multiplexed``: issue 31's anchor, Ray Serve's plain
``@serve.multiplexed`` routing with a count cap of ``--budget-fraction`` of the models (10 of
30: a third, as the byte budget holds) on as many replicas, reached through an ingress
deployment's handle (a router hop), loading the same model files in ONNX Runtime sessions
(CUDA with ``--gpu-fraction``; ``bench.multiplexed``); its cold loads are the loads its loader counted, and its over-budget
figure the most bytes (by the measured footprints) the count cap let a replica hold past the
byte budget.

    .venv/bin/python -m bench.placement --quick --out /tmp/placement.json
    .venv/bin/python -m bench.placement --out /tmp/placement.json
    python -m bench.placement --policies hash,bytes --clients 16,64 --no-shift-kill --warmup-s 20 \
        --duration-s 30 --gpu-fraction 0.2 --out placement.json    # the H200 (bench/h200.sh placement)
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
APP = "models"
BASE = "ocr_cls"
PORT_ATTEMPTS = 3  # server starts per policy when a port it was given was taken first
MAX_BATCHES = (4, 8, 16, 32)  # the copies' max batch in turn: footprints about 4x apart
POLICIES = ("hash", "bytes", "multiplexed")
ERROR_BODIES = 5  # the bodies kept of each error status (the row's ``error_bodies``), for a cause
SAMPLE_S = 0.5  # how often /v2/memory and /metrics are read
BUCKET_S = 10.0  # the cold-load rate after a shift, per this many seconds
SAMPLE_EVERY = 16  # one answer in this many per client has its values compared
NVML_SAMPLE_S = 2.0  # how often nvidia-smi lists the GPU's processes


# --- pure parts: popularity, counters, rows ----------------------------------------------------

def zipf_weights(n: int, s: float = 1.0) -> np.ndarray:
    """Probabilities of ranks 1..``n`` under Zipf's law with exponent ``s`` (``1 / k^s``,
    normalized); shape ``(n,)``, float64, summing to 1."""
    if n < 1:
        raise ValueError(f"Zipf needs at least one model, got {n}")
    weights = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** s
    return weights / weights.sum()


def popularity(models: Sequence[str], s: float = 1.0, shift: int = 0) -> dict[str, float]:
    """Model -> its share of requests: ``models[shift]`` ranked first, the next ones after it
    (wrapping round), weights ``zipf_weights``. A ``shift`` of half the models makes the cold
    half hot."""
    weights = zipf_weights(len(models), s)
    n = len(models)
    return {models[(shift + rank) % n]: float(weights[rank]) for rank in range(n)}


class Sampler:
    """Draws models with the probabilities of ``shares`` (model -> share), from a
    ``numpy.random.Generator``; ``shares`` may be replaced at any time (``set``)."""

    def __init__(self, shares: dict[str, float], rng: np.random.Generator) -> None:
        self.rng = rng
        self.set(shares)

    def set(self, shares: dict[str, float]) -> None:
        self.names = list(shares)
        cumulative = np.cumsum([shares[m] for m in self.names])
        self.cumulative = list(cumulative / cumulative[-1])

    def draw(self) -> str:
        index = bisect.bisect_right(self.cumulative, float(self.rng.random()))
        return self.names[min(index, len(self.names) - 1)]


def cache_counters(metrics_text: str) -> dict[str, dict[str, float]]:
    """Per pool replica (the ``replica`` label) its ``loads``, ``reloads`` and ``evictions``
    (summed over models) and ``resident_bytes`` / ``budget_bytes`` (gauges), from a Prometheus
    text exposition (``GET /metrics``)."""
    from prometheus_client.parser import text_string_to_metric_families

    names = {"trt_serve_cache_loads": "loads", "trt_serve_cache_reloads": "reloads",
             "trt_serve_cache_evictions": "evictions", "trt_serve_cache_resident_bytes": "resident_bytes",
             "trt_serve_cache_budget_bytes": "budget_bytes"}
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            key = names.get(sample.name.removesuffix("_total"))
            if key is None or "replica" not in sample.labels:
                continue
            counts = out.setdefault(sample.labels["replica"], {k: 0.0 for k in names.values()})
            counts[key] += sample.value
    return out


def cold_loads(counters: dict[str, dict[str, float]]) -> float:
    """Loads and reloads of every replica in ``cache_counters``' answer."""
    return sum(c["loads"] + c["reloads"] for c in counters.values())


def over_budget_bytes(memory: dict[str, Any] | None) -> int:
    """How far one pool replica's ``/v2/memory`` status (``pool``) shows its cache over its
    budget: its resident bytes now and after each event of its timeline, less the budget; 0
    when never over or when it has no budget."""
    if not memory or memory.get("budget_bytes") is None:
        return 0
    budget = memory["budget_bytes"]
    held = [memory.get("resident_bytes", 0)] + [e.get("resident_bytes", 0) for e in memory.get("events", ())]
    return max(0, max(held) - budget)


def gpu_over_budget_bytes(memory: dict[str, Any] | None) -> int | None:
    """How far one pool replica's ``/v2/memory`` status (``pool``) shows its own GPU reading over
    its budget: the most of its events' ``gpu_over_baseline_bytes`` (NVML's bytes of the process
    less those before any model) less the budget, 0 when never over; None when no event carries
    the reading (a CPU backend, no ``nvidia-ml-py`` in the replica) or there is no budget."""
    if not memory or memory.get("budget_bytes") is None:
        return None
    held = [e["gpu_over_baseline_bytes"] for e in memory.get("events", ()) if e.get("gpu_over_baseline_bytes") is not None]
    return max(0, max(held) - memory["budget_bytes"]) if held else None


def parse_compute_apps(text: str) -> dict[int, int]:
    """pid -> GPU bytes from ``nvidia-smi --query-compute-apps=pid,used_memory --format=csv,
    noheader,nounits`` (one ``pid, MiB`` line per process and GPU, summed per pid); lines whose
    figure NVML hides (``[N/A]``, ``[Not Supported]``) are left out."""
    out: dict[int, int] = {}
    for line in text.splitlines():
        pid, _, mib = (part.strip() for part in line.partition(","))
        if pid.isdigit() and mib.isdigit():
            out[int(pid)] = out.get(int(pid), 0) + int(mib) * 2**20
    return out


def compute_apps(timeout_s: float = 10.0) -> dict[int, int]:
    """Every GPU process's used memory as NVML counts it per process (``parse_compute_apps``),
    through ``nvidia-smi`` (on every GPU machine, unlike ``nvidia-ml-py``); empty where
    ``nvidia-smi`` is missing, fails or does not answer in time."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {}
    try:
        done = subprocess.run([smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return parse_compute_apps(done.stdout) if done.returncode == 0 else {}


PRIME = ("import os, sys\n"
         "from deployments.runtime.backends.onnxruntime_cuda import prime\n"
         "prime()\n"
         "print(os.getpid(), flush=True)\n"
         "sys.stdin.read()\n")


def primed_process_bytes(timeout_s: float = 120.0) -> int | None:
    """NVML's bytes of a process that holds what a pool replica holds before any model: the
    CUDA context and ONNX Runtime's CUDA provider primed (``onnxruntime_cuda.prime``), read
    through ``nvidia-smi`` while it waits; None where that process fails or NVML does not list it."""
    with subprocess.Popen([sys.executable, "-c", PRIME], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        try:
            line = proc.stdout.readline().strip()
            deadline = time.monotonic() + min(timeout_s, 10.0)
            while line.isdigit() and time.monotonic() < deadline:
                used = compute_apps().get(int(line))
                if used is not None:
                    return used
                time.sleep(0.5)
            return None
        finally:
            proc.stdin.close()
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()


def nvml_summary(most: dict[int, int], pool_pids: Iterable[int], budget_bytes: int, samples: int,
                 primed_bytes: int | None = None) -> dict[str, Any]:
    """The NVML figures of one point: ``most`` (pid -> the most GPU bytes seen of it) split into
    the pool replicas' (``pool_pids``) and the others', the most any pool replica held
    (``max_nvml_process_bytes``, None when none was seen) and that less ``budget_bytes``
    (``max_nvml_over_budget_bytes``, 0 when under, None when none was seen); with
    ``primed_bytes`` (``primed_process_bytes``) also the most less both
    (``max_nvml_over_budget_less_primed_bytes``)."""
    pool = set(pool_pids)
    mine = {pid: b for pid, b in most.items() if pid in pool}
    top = max(mine.values()) if mine else None
    less_primed = None if top is None or primed_bytes is None else max(0, top - primed_bytes - budget_bytes)
    return {"max_nvml_process_bytes": top,
            "max_nvml_over_budget_bytes": None if top is None else max(0, top - budget_bytes),
            "max_nvml_over_budget_less_primed_bytes": less_primed,
            "nvml": {"samples": samples, "budget_bytes": budget_bytes, "primed_process_bytes": primed_bytes,
                     "pool_pid_bytes": {str(p): b for p, b in sorted(mine.items())},
                     "other_pid_bytes": {str(p): b for p, b in sorted(most.items()) if p not in pool},
                     "note": "per-process bytes: CUDA context and ONNX Runtime's arena beside the models"}}


@dataclass(frozen=True)
class Answer:
    """One request: when it was sent and answered (``time.monotonic`` s), its model and status
    (``"200"``, another HTTP status, ``wrong answer: ...`` or the client error's name)."""

    sent_s: float
    done_s: float
    model: str
    status: str


def window_stats(answers: Iterable[Answer], start_s: float, stop_s: float) -> dict[str, Any]:
    """The requests answered within ``[start_s, stop_s)``: ``requests`` (200s), ``errors`` by
    status, ``qps``, ``p50_ms`` and ``p99_ms`` of the 200s (None when there are none)."""
    latencies, errors = [], {}
    for a in answers:
        if start_s <= a.done_s < stop_s:
            if a.status == "200":
                latencies.append(a.done_s - a.sent_s)
            else:
                errors[a.status] = errors.get(a.status, 0) + 1
    ms = np.array(latencies) * 1e3
    return {"requests": len(latencies), "errors": errors, "qps": round(len(latencies) / (stop_s - start_s), 2),
            "p50_ms": round(float(np.percentile(ms, 50)), 2) if ms.size else None,
            "p99_ms": round(float(np.percentile(ms, 99)), 2) if ms.size else None}


def row(placement: str, clients: int, stats: dict[str, Any], cold_before: float, cold_after: float,
        over_bytes: int, **extra: Any) -> dict[str, Any]:
    """One result row: ``stats`` (``window_stats``) with the cold loads across the window
    (``cold_after - cold_before``) per 1,000 of its requests, and ``max_resident_over_budget_bytes``."""
    cold = cold_after - cold_before
    return {"placement": placement, "clients": clients,
            "cold_loads_per_1000": round(1000 * cold / stats["requests"], 2) if stats["requests"] else None,
            "p50_ms": stats["p50_ms"], "p99_ms": stats["p99_ms"], "qps": stats["qps"],
            "max_resident_over_budget_bytes": int(over_bytes), "cold_loads": int(cold),
            "requests": stats["requests"], "errors": stats["errors"], **extra}


def verdict(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per client count, issue 31's test of ``bytes`` against ``hash``: at most half the cold
    loads, p99 within 1.1x, no replica over its budget."""
    out = {}
    by = {(r["placement"], r["clients"]): r for r in rows}
    for (policy, clients), b in by.items():
        h = by.get(("hash", clients))
        if policy != "bytes" or h is None or None in (b["cold_loads_per_1000"], h["cold_loads_per_1000"], b["p99_ms"], h["p99_ms"]):
            continue
        checks = {"half_the_cold_loads": b["cold_loads_per_1000"] <= 0.5 * h["cold_loads_per_1000"],
                  "p99_within_1.1x": b["p99_ms"] <= 1.1 * h["p99_ms"],
                  "never_over_budget": b["max_resident_over_budget_bytes"] == 0}
        out[str(clients)] = {**checks, "bytes_wins": all(checks.values())}
    return out


# --- the repository ----------------------------------------------------------------------------

def model_names(count: int) -> list[str]:
    """The pool models, most popular first at the start (``popularity``'s rank order)."""
    return [f"m{k:02d}" for k in range(count)]


def prepare(dest: Path, source: Path, names: Sequence[str], backend: str = "onnxruntime") -> tuple[dict[str, int], str]:
    """``dest`` with each of ``names`` a pool model: ``source/BASE``'s config with the max batch
    ``MAX_BATCHES[k % 4]`` (profile max and opt to match) and its own copy of the model file.
    Returns each model's footprint in bytes, measured once per max batch in a fresh process
    (``deployments.runtime.tools.plan measure --backend backend``: GPU bytes on a GPU backend),
    and the backend that measured (``auto`` resolved)."""
    from bench.throughput import _base_config

    by_batch: dict[int, int] = {}
    measured_on = backend
    for k, name in enumerate(names):
        batch = MAX_BATCHES[k % len(MAX_BATCHES)]
        raw = _base_config(source, BASE)
        raw.update(max_batch_size=batch, deployment={"mode": "pool"})
        for spec in raw["inputs"]:
            profile = spec["profile"]
            profile["max"][0], profile["opt"][0] = batch, min(profile["opt"][0], batch)
        (dest / name / "1").mkdir(parents=True)
        (dest / name / "config.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
        shutil.copy(source / BASE / "1" / "model.onnx", dest / name / "1" / "model.onnx")
    for k, batch in enumerate(MAX_BATCHES[:len(names)]):
        done = subprocess.run([sys.executable, "-m", "deployments.runtime.tools.plan", "measure", names[k],
                               "--root", str(dest), "--json", "--backend", backend], cwd=ROOT, capture_output=True,
                              text=True, check=True)
        record = json.loads(done.stdout)
        by_batch[batch], measured_on = int(record["total_bytes"]), record["backend"]
    return {name: by_batch[MAX_BATCHES[k % len(MAX_BATCHES)]] for k, name in enumerate(names)}, measured_on


def write_config(tmp: Path, repository: Path, policy: str, replicas: int, budget_bytes: int, models: int,
                 port: int, metrics_port: int, gpu_fraction: float = 0.0, backend: str | None = None) -> Path:
    """``serve_config.yaml``'s router and pool applications on ``repository``: ``replicas`` pool
    replicas of ``num_gpus`` = ``gpu_fraction``, ``placement`` = ``policy``, ``lru`` under
    ``budget_bytes`` each, no count cap; ``backend`` (None: the file's) for every model."""
    from deployments.check import write

    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config["http_options"]["port"] = port
    config["applications"] = [app := config["applications"][0]]
    app["args"].update(repository=str(repository), request_timeout_s=30, metrics={"port": metrics_port},
                       **({"backend": backend} if backend else {}),
                       pool=dict(app["args"]["pool"], num_gpus=gpu_fraction, num_replicas=replicas, placement=policy,
                                 load_policy="lru", memory_budget_mib=budget_bytes / 2**20,
                                 max_num_models_per_replica=models))
    path = tmp / f"serve_config.{policy}.yaml"
    path.write_text(yaml.safe_dump(config))
    write(path)
    return path


# --- the server and what it reports ------------------------------------------------------------

def start_multiplexed(repository: Path, port: int, replicas: int, max_models: int, footprints: dict[str, int],
                      budget_bytes: int, log: Path, gpu_fraction: float = 0.0, **env: str) -> subprocess.Popen:
    """The anchor (``bench.multiplexed``: Serve's ``@serve.multiplexed`` with a count cap of
    ``max_models``, behind an ingress deployment) in a session of its own, with ``make
    serve``'s environment and ``env`` over it, as ``bench.autoscale.start_runner`` starts a server."""
    from bench.autoscale import serve_env

    full = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                **serve_env(1), **env)
    full.pop("RAY_ADDRESS", None)
    with log.open("w") as out:
        return subprocess.Popen([sys.executable, "-m", "bench.multiplexed", "--repository", str(repository),
                                 "--port", str(port), "--replicas", str(replicas), "--max-models", str(max_models),
                                 "--budget-bytes", str(budget_bytes), "--footprints", json.dumps(footprints),
                                 "--gpu-fraction", str(gpu_fraction)],
                                cwd=ROOT, env=full, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _get_json(url: str, timeout_s: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return json.loads(r.read())


def _get_text(url: str, timeout_s: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return r.read().decode()


def _until(condition, what: str, timeout_s: float, proc: subprocess.Popen, log: Path) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}): {log.read_text()[-3000:]}")
        try:
            value = condition()
            if value:
                return value
        except (OSError, ValueError):  # not listening yet, a 503, a read that timed out
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{what}: not within {timeout_s:g} s; log: {log.read_text()[-3000:]}")


class Watch:
    """Reads ``/v2/memory`` and ``/metrics`` every ``SAMPLE_S`` in a thread: the largest
    over-budget figure seen, each replica's last memory status, and (time, cold loads) pairs."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.over_bytes = 0
        self.memory: dict[str, dict[str, Any]] = {}
        self.cold: list[tuple[float, float]] = []
        self.counters: dict[str, dict[str, float]] = {}  # the last reading's, per replica
        self.placement: dict[str, Any] = {}  # the last placement a replica showed (bytes only)
        self.gpu_over_bytes: int | None = None  # gpu_over_budget_bytes' most; None until one is seen
        self.gpu_sources: set[str] = set()  # the events' gpu_source: nvml-process, or device (other processes in it)
        self.events: dict[tuple[str, int], dict[str, Any]] = {}  # (replica, seq) -> a load, reload or evict event
        self.revisions: list[dict[str, Any]] = []  # each placement revision first seen: when, targets, reasons
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def read(self) -> float:
        """Read both once; returns the cold loads so far (``cold_loads``)."""
        counters = cache_counters(_get_text(f"{self.url}/metrics"))
        for c in counters.values():
            if c["budget_bytes"]:
                self.over_bytes = max(self.over_bytes, int(c["resident_bytes"] - c["budget_bytes"]))
        total = cold_loads(counters)
        self.counters = counters
        self.cold.append((time.monotonic(), total))
        try:
            pool = _get_json(f"{self.url}/v2/memory")["pool"]
        except (OSError, ValueError):  # a killed replica's 503 while it is replaced
            return total
        if pool:
            self.memory[pool["replica"]] = {k: v for k, v in pool.items() if k != "events"}
            self.memory[pool["replica"]]["seen_s"] = time.monotonic()
            if (pool.get("placement") or {}).get("revision") is not None:
                self.placement = pool["placement"]
                self._note_revision(pool["placement"])
            for e in pool.get("events", ()):
                if e.get("event") in ("load", "reload", "evict"):
                    self.events[(pool["replica"], e["seq"])] = {
                        "unix_time": e["unix_time"], "event": e["event"], "model": e["model"], "detail": e.get("detail", "")}
            self.over_bytes = max(self.over_bytes, over_budget_bytes(pool))
            gpu_over = gpu_over_budget_bytes(pool)
            self.gpu_sources.update(e["gpu_source"] for e in pool.get("events", ()) if e.get("gpu_source"))
            if gpu_over is not None:
                self.gpu_over_bytes = max(self.gpu_over_bytes or 0, gpu_over)
        return total

    def _note_revision(self, placement: dict[str, Any]) -> None:
        revision = placement["revision"]
        if self.revisions and self.revisions[-1]["revision"] >= revision:
            return
        models = placement.get("models", {})
        self.revisions.append({"unix_time": time.time(), "revision": revision, "replicas": placement.get("replicas", []),
                               "target": {m: w["replicas"] for m, w in models.items()},
                               "reasons": {m: w["reason"] for m, w in models.items()}})

    def loads_between(self, t0: float, t1: float) -> dict[str, Any]:
        """The loads (and reloads) of every replica whose events this watch saw with ``unix_time``
        in ``[t0, t1)``, each sorted by the revisions seen from 10 s before it to a few samples
        after (a prefetch follows the revision that placed it; this watch sees a revision up to
        a few samples late): ``placed_here`` (one of them placed the model on that replica: a
        new copy or a move, ``moved`` those whose reason was a move) or ``not_placed_here`` (a
        request that reached a replica no such revision named); ``loads`` names each, with the
        reason; ``evictions`` (releases included); ``revisions`` (revision, replicas reporting)
        first seen in the window and the ``moves`` they made (``model: reason``)."""
        out: dict[str, Any] = {"placed_here": 0, "moved": 0, "not_placed_here": 0, "evictions": 0, "loads": []}
        for (replica, _), e in sorted(self.events.items(), key=lambda kv: kv[1]["unix_time"]):
            if not t0 <= e["unix_time"] < t1:
                continue
            if e["event"] == "evict":
                out["evictions"] += 1
                continue
            # a prefetch follows the revision that placed it, seen here up to a few samples later
            near = [r for r in self.revisions if e["unix_time"] - 10 <= r["unix_time"] <= e["unix_time"] + 10 * SAMPLE_S]
            rev = next((r for r in reversed(near) if replica in r["target"].get(e["model"], ())), near[-1] if near else None)
            placed = rev is not None and replica in rev["target"].get(e["model"], ())
            reason = rev["reasons"].get(e["model"], "") if rev else ""
            out["placed_here" if placed else "not_placed_here"] += 1
            out["moved"] += int(placed and "moved" in reason)
            out["loads"].append(f"{e['model']}@{replica[:6]}: {reason if placed else 'not placed here'}")
        revs = [r for r in self.revisions if t0 <= r["unix_time"] < t1]
        out["revisions"] = [(r["revision"], len(r["replicas"])) for r in revs]
        out["moves"] = sorted({f"{m}: {why}" for r in revs for m, why in r["reasons"].items() if "moved" in why})
        return out

    def cold_at(self, t: float) -> float:
        """The cold loads of the last reading at or before ``t`` (the first one before any)."""
        before = [c for at, c in self.cold if at <= t]
        return before[-1] if before else self.cold[0][1]

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            try:
                self.read()
            except (OSError, ValueError):
                pass

    def __enter__(self) -> "Watch":
        deadline = time.monotonic() + 60
        while True:  # a busy machine's router can answer 503 just after the server said ready
            try:
                self.read()
                break
            except (OSError, ValueError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(SAMPLE_S)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class GpuWatch:
    """Lists the GPU's processes (``compute_apps``) every ``NVML_SAMPLE_S`` in a thread while
    entered: each pid's most bytes (``most``), the samples that listed any (``samples``), and
    the pool replicas' pids seen (``pool_pids``: ``pids()`` at each such sample, so a replica
    that replaces a killed one counts too). Nothing is sampled, and nothing found, without
    ``nvidia-smi``."""

    def __init__(self, pids: Any, interval_s: float = NVML_SAMPLE_S) -> None:
        self.pids, self.interval_s = pids, interval_s
        self.most: dict[int, int] = {}
        self.pool_pids: set[int] = set()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        apps = compute_apps()
        if not apps:
            return
        self.samples += 1
        self.pool_pids.update(self.pids())
        for pid, used in apps.items():
            self.most[pid] = max(self.most.get(pid, 0), used)

    def summary(self, budget_bytes: int, primed_bytes: int | None = None) -> dict[str, Any]:
        return nvml_summary(self.most, self.pool_pids, budget_bytes, self.samples, primed_bytes)

    def _run(self) -> None:
        while True:
            try:
                self.sample()
            except Exception as e:  # a sample that fails must not end the run: say so, take the next
                print(f"nvidia-smi sample failed: {e!r}", file=sys.stderr, flush=True)
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> "GpuWatch":
        if shutil.which("nvidia-smi"):
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


# --- the clients -------------------------------------------------------------------------------

@dataclass
class Load:
    """Closed-loop clients drawing models from ``shares`` (``Sampler``), each with its own
    generator (seed + client index); ``answers`` collects every request. ``set_shares`` changes
    the popularity for every client at once."""

    url: str
    body: bytes
    headers: dict[str, str]
    expected: Any
    shares: dict[str, float]
    seed: int = 0
    answers: list[Answer] = field(default_factory=list)
    error_bodies: dict[str, list[str]] = field(default_factory=dict)  # status -> its first bodies (300 chars)

    def set_shares(self, shares: dict[str, float]) -> None:
        for sampler in self._samplers:
            sampler.set(shares)

    async def run(self, clients: int, until: asyncio.Event) -> None:
        import aiohttp

        self._samplers = [Sampler(self.shares, np.random.default_rng(self.seed + i)) for i in range(clients)]
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients), timeout=timeout,
                                         headers={"Accept-Encoding": "identity"}) as session:
            await asyncio.gather(*(self._client(session, s, until) for s in self._samplers))

    async def _client(self, session: Any, sampler: Sampler, until: asyncio.Event) -> None:
        import aiohttp

        count = 0
        while not until.is_set():
            model = sampler.draw()
            sent = time.monotonic()
            try:
                async with session.post(f"{self.url}/v2/models/{model}/infer", data=self.body,
                                        headers=self.headers) as response:
                    body = await response.read()
                    status = str(response.status)
                    if status != "200" and len(kept := self.error_bodies.setdefault(status, [])) < ERROR_BODIES:
                        kept.append(f"{time.strftime('%H:%M:%S')} {model}: {body[:300].decode(errors='replace')}")
                    if status == "200":
                        problem = self.expected.problem(body, response.headers, count % SAMPLE_EVERY == 0)
                        status = status if problem is None else f"wrong answer: {problem}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                status = type(e).__name__
            self.answers.append(Answer(sent, time.monotonic(), model, status))
            count += 1
            if status != "200":
                await asyncio.sleep(0.05)  # no tight loop on a refusing server


# --- one policy --------------------------------------------------------------------------------

class Bench:
    def __init__(self, args: argparse.Namespace, repository: Path, footprints: dict[str, int],
                 budget_bytes: int, scratch: Path, backend: str = "onnxruntime") -> None:
        """``backend``: the one the footprints were measured on (``prepare``); a GPU one's answers
        are checked within TF32's tolerance (1e-2), the CPU's within 1e-4."""
        from bench.loadgen import expected_from_onnx, make_workload

        self.args, self.repository, self.footprints = args, repository, footprints
        self.budget_bytes, self.scratch = budget_bytes, scratch
        # what a pool replica holds on the GPU before any model (NVML's figure counts it)
        self.primed_bytes = primed_process_bytes() if args.gpu_fraction and backend == "onnxruntime_cuda" else None
        self.names = list(footprints)
        self.max_models = max(1, round(args.budget_fraction * len(self.names)))  # the anchor's count cap
        x = np.random.default_rng(0).random((1, 3, 48, 192), dtype=np.float32)
        tolerance = 1e-4 if backend == "onnxruntime" else 1e-2
        expected = expected_from_onnx(str(ROOT / "engines" / BASE / "1" / "model.onnx"), x, rtol=tolerance,
                                      atol=tolerance)
        input_name = yaml.safe_load((repository / self.names[0] / "config.yaml").read_text())["inputs"][0]["name"]
        self.request = make_workload("placement", "http://x", self.names[0], input_name, x, binary=True,
                                     expected=expected)

    def log(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def policy(self, policy: str) -> list[dict[str, Any]]:
        """Every client count (and, without --quick, the shift and the kill) on one server."""
        from bench.autoscale import start_runner
        from bench.replicas import interrupt_group
        from bench.throughput import free_port, ray_env

        a = self.args
        folder = self.scratch / policy
        folder.mkdir()
        log = folder / "server.log"
        started = time.monotonic()
        for attempt in range(1, PORT_ATTEMPTS + 1):
            # A port free_port() saw free can be taken by the new cluster's own processes before
            # HAProxy binds it (Ray's workers listen on ephemeral ports): start again on others.
            port, metrics_port = free_port(), free_port()
            short = Path(tempfile.mkdtemp(prefix="bp-", dir=self.scratch.parent))  # HAProxy's socket path: at most 97 characters
            haproxy = {k: v for k, v in ray_env("fast", short).items()  # this run's own HAProxy files and ports
                       if k.startswith("RAY_SERVE_HAPROXY_") and k != "RAY_SERVE_HAPROXY_BINARY_PATH"}
            if policy == "multiplexed":
                proc = start_multiplexed(self.repository, port, a.replicas, self.max_models, self.footprints,
                                         self.budget_bytes, log, a.gpu_fraction, **haproxy)
            else:
                config = write_config(folder, self.repository, policy, a.replicas, self.budget_bytes, len(self.names),
                                      port, metrics_port, a.gpu_fraction, a.serve_backend)
                proc = start_runner(config, log, **haproxy)
            try:
                self._ready(policy, url := f"http://127.0.0.1:{port}", proc, log)
                break
            except RuntimeError:
                if proc.poll() is None:
                    interrupt_group(proc)
                shutil.rmtree(short, ignore_errors=True)
                if attempt == PORT_ATTEMPTS or "Address already in use" not in log.read_text(errors="replace"):
                    raise
                self.log(f"{policy}: a port was taken before the server bound it; starting again on others")
        rows = []
        try:
            self.log(f"{policy}: serving after {time.monotonic() - started:.0f} s")
            for clients in a.clients:
                rows.append(asyncio.run(self._point(policy, clients, url, proc)))
                self.log(json.dumps(rows[-1]))
        finally:
            if proc.poll() is None:
                interrupt_group(proc)
            shutil.rmtree(short, ignore_errors=True)
        return rows

    def _ready(self, policy: str, url: str, proc: subprocess.Popen, log: Path) -> None:
        a = self.args

        def ready() -> bool:
            with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=5) as r:
                return r.status == 200

        if policy == "multiplexed":  # every pool replica reported (in its constructor) and the ingress answers
            def ready() -> bool:
                return len(cache_counters(_get_text(f"{url}/metrics"))) == a.replicas

        _until(ready, "the server ready", 300, proc, log)
        if policy == "bytes":  # a placement of every model over every replica
            def placed() -> bool:
                place = (_get_json(f"{url}/v2/memory")["pool"] or {}).get("placement", {})
                return bool(place.get("revision")) and len(place.get("replicas", ())) == a.replicas and \
                    set(place.get("models", {})) == set(self.names)

            _until(placed, "a placement over every replica", 180, proc, log)

    async def _point(self, policy: str, clients: int, url: str, proc: subprocess.Popen) -> dict[str, Any]:
        from bench.replicas import cpu_seconds, kill_replica, replica_pids

        a = self.args
        w = self.request
        load = Load(url, w.body, w.headers, w.expected, popularity(self.names, a.zipf_s), seed=a.seed)
        stop = asyncio.Event()
        task = asyncio.get_running_loop().create_task(load.run(clients, stop))
        extra: dict[str, Any] = {"replicas": a.replicas, "models": len(self.names), "budget_bytes": self.budget_bytes}
        if policy == "multiplexed":
            extra.update(max_num_models_per_replica=self.max_models, router_hop=True)
        gpu = GpuWatch(lambda: replica_pids(proc.pid, APP, "pool"))
        with Watch(url) as watch, gpu:
            await asyncio.sleep(a.warmup_s)
            pids = replica_pids(proc.pid, APP, "pool")
            cpu = {pid: cpu_seconds(pid) for pid in pids}
            watch.read()
            start, start_unix = time.monotonic(), time.time()
            counters_before, revision_before = watch.counters, watch.placement.get("revision")
            over_before = watch.over_bytes  # the warm-up's own loads are not the steady state's
            await asyncio.sleep(a.duration_s)
            stop_s = time.monotonic()
            watch.read()
            extra["load_average_1m"] = round(os.getloadavg()[0], 1)  # the machine is shared: its noise
            extra["resident_bytes_by_replica"] = {  # the replicas seen in the window (not one killed before)
                r: m.get("resident_bytes") for r, m in sorted(watch.memory.items()) if m["seen_s"] >= start}
            extra["gpu_growth_bytes_by_replica"] = {  # what each cache counts beside the footprints (GPU)
                r: m.get("gpu_growth_bytes") for r, m in sorted(watch.memory.items()) if m["seen_s"] >= start}
            extra["replica_cpu_s"] = sorted((round(cpu_seconds(p) - t, 2) for p, t in cpu.items()), reverse=True)
            steady = window_stats(load.answers, start, stop_s)
            if load.error_bodies:
                extra["error_bodies"] = {k: list(v) for k, v in load.error_bodies.items()}
            if watch.revisions:  # the steady window's loads, sorted as after the shift
                extra["steady_loads"] = watch.loads_between(start_unix, time.time())
            extra["replica_cache_events"] = {  # loads + reloads (prefetches included), evictions (releases included)
                r: {k: int(c[k] - counters_before.get(r, {}).get(k, 0)) for k in ("loads", "reloads", "evictions")}
                for r, c in watch.counters.items()}
            if revision_before is not None:
                extra["placement_revisions"] = watch.placement.get("revision", 0) - revision_before
                extra["copies"] = {m: w["copies"] for m, w in watch.placement.get("models", {}).items() if w["copies"] > 1}
                extra["reasons"] = sorted({w["reason"].split(":")[0] for w in watch.placement.get("models", {}).values()})
            result = row(policy, clients, steady, watch.cold_at(start), watch.cold_at(stop_s),
                         watch.over_bytes, over_budget_in_warmup_bytes=max(0, over_before), **extra)
            if not a.no_shift_kill:
                result.update(await self._shift_and_kill(load, watch, proc))
            stop.set()
            await task
            result["measured_footprints"] = {r: {m: s["bytes"] for m, s in mem.get("models", {}).items() if s["bytes"]}
                                             for r, mem in watch.memory.items()}
            result["max_resident_over_budget_bytes"] = max(result["max_resident_over_budget_bytes"], watch.over_bytes)
        if a.gpu_fraction:
            result.update(gpu.summary(self.budget_bytes, self.primed_bytes),
                          max_gpu_over_baseline_over_budget_bytes=watch.gpu_over_bytes,
                          replica_gpu_sources=sorted(watch.gpu_sources))
        return result

    async def _shift_and_kill(self, load: Load, watch: Watch, proc: subprocess.Popen) -> dict[str, Any]:
        """The popularity shifts (ranking rotated by half): cold loads per 1,000 per ``BUCKET_S``
        for ``--shift-s``; then one pool replica is killed under load: the requests answered
        other than 200 from then on for ``--kill-s`` (``lost``, by status)."""
        from bench.replicas import kill_replica

        a = self.args
        load.set_shares(popularity(self.names, a.zipf_s, shift=len(self.names) // 2))
        shifted, shifted_unix = time.monotonic(), time.time()
        await asyncio.sleep(a.shift_s)
        watch.read()
        buckets = []
        for k in range(int(a.shift_s // BUCKET_S)):
            t0, t1 = shifted + k * BUCKET_S, shifted + (k + 1) * BUCKET_S
            stats = window_stats(load.answers, t0, t1)
            cold = watch.cold_at(t1) - watch.cold_at(t0)
            buckets.append({"from_s": k * BUCKET_S, "cold_loads_per_1000": round(1000 * cold / stats["requests"], 2)
                            if stats["requests"] else None, "cold_loads": int(cold), "requests": stats["requests"],
                            "qps": stats["qps"], "p99_ms": stats["p99_ms"],
                            **({"why": watch.loads_between(shifted_unix + k * BUCKET_S, shifted_unix + (k + 1) * BUCKET_S)}
                               if watch.revisions else {})})
        killed = kill_replica(proc.pid, APP, "pool")
        at = time.monotonic()
        await asyncio.sleep(a.kill_s)
        after = window_stats(load.answers, at, time.monotonic())
        return {"after_shift": buckets,
                "kill": {"pid": killed, "seconds": a.kill_s, "answered": after["requests"],
                         "lost": sum(after["errors"].values()), "lost_by_status": after["errors"],
                         "p99_ms": after["p99_ms"]}}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 clients, 30 models, shorter windows, no shift or kill "
                        "(each overridable: --clients, --models, --warmup-s, --duration-s)")
    parser.add_argument("--out", type=Path, required=True, help="JSON rows are written here")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--models", type=int)
    parser.add_argument("--replicas", type=int)
    parser.add_argument("--clients", type=str)
    parser.add_argument("--budget-fraction", type=float, default=1 / 3)
    parser.add_argument("--zipf-s", type=float, default=1.0)
    parser.add_argument("--warmup-s", type=float)
    parser.add_argument("--duration-s", type=float)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shift-s", type=float, default=40.0, help="without --quick: after the popularity shift")
    parser.add_argument("--kill-s", type=float, default=30.0, help="without --quick: after a pool replica is killed")
    parser.add_argument("--no-shift-kill", action="store_true", help="no popularity shift and no kill (as --quick)")
    parser.add_argument("--gpu-fraction", type=float, default=0.0,
                        help="each pool replica's num_gpus (0: CPU); the footprints then measured on the GPU")
    parser.add_argument("--backend", default="auto", help="footprints' and serving's backend: auto | onnxruntime | "
                        "onnxruntime_cuda (auto with --gpu-fraction 0: onnxruntime)")
    a = parser.parse_args(argv)
    quick = a.quick
    a.no_shift_kill = a.no_shift_kill or quick
    # The footprints are measured on the backend the replicas serve with: ONNX Runtime on CPU
    # without a GPU share (a GPU machine's replicas too), else the one auto picks there.
    a.serve_backend = "onnxruntime" if a.backend == "auto" and not a.gpu_fraction else a.backend
    a.models = a.models or (30 if quick else 48)
    a.replicas = a.replicas or 4
    a.clients = [int(c) for c in (a.clients or ("16" if quick else "16,64")).split(",")]
    a.warmup_s = a.warmup_s if a.warmup_s is not None else (25.0 if quick else 40.0)
    a.duration_s = a.duration_s if a.duration_s is not None else (30.0 if quick else 60.0)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-placement-") as tmp:
        scratch = Path(tmp)
        repository = scratch / "engines"
        footprints, backend = prepare(repository, ROOT / "engines", model_names(a.models), a.serve_backend)
        budget = int(a.budget_fraction * sum(footprints.values()))
        print(f"{a.models} models, {sum(footprints.values()) / 2**20:.0f} MiB together ({backend}); budget per "
              f"replica {budget / 2**20:.0f} MiB", file=sys.stderr, flush=True)
        bench = Bench(a, repository, footprints, budget, scratch, backend)
        rows: list[dict[str, Any]] = []
        policies = a.policies.split(",")
        for k, policy in enumerate(policies):
            rows += bench.policy(policy)
            # written after each policy, so a run stopped by a time limit keeps what it measured
            meta = {"command": " ".join(["python -m bench.placement", *(argv if argv is not None else sys.argv[1:])]),
                    "date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                    "load_average": os.getloadavg(), "wall_s": round(time.monotonic() - started),
                    "footprints_planned": sorted(set(footprints.values())), "footprint_backend": backend,
                    "gpu_fraction": a.gpu_fraction, "verdict": verdict(rows),
                    **({"partial": f"{k + 1} of {len(policies)} policies"} if k + 1 < len(policies) else {})}
            a.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(json.dumps(meta, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
