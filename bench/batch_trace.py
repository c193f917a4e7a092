"""BENCHMARK ONLY: timestamps along a model replica's batched path, for ``bench.throughput``.

Installed in every Ray worker process as Ray's ``worker_process_setup_hook`` (``install``) when
``BENCH_BATCH_TRACE`` names a folder; it wraps, in that process only:

- ``BatchItem.of`` (the request reached ``ModelDeployment.infer``: **arrive**),
- ``BatchScheduler.submit`` (**enqueue**) and a done-callback on the request's future
  (**done**: the loop ran the callback, i.e. the caller can resume),
- ``BatchScheduler._start`` (**formed**: a context took the batch) and ``_run`` starting
  (**exec**) and ending,
- ``ModelClient.infer`` in the router (the handle call, from send to answer),
- ``ModelHost.run`` (**engine start / end**, in the worker thread; the batch it belongs to comes
  through the context variable that ``asyncio.to_thread`` carries into the thread),

plus a task on the replica's event loop that sleeps 1 ms in a loop and records how late it
wakes (**loop lag**: how long the loop was kept from running anything). Every 0.5 s each
process writes its events to ``<folder>/<pid>.json``; ``summarize`` reads them back for a window
of ``time.perf_counter`` (CLOCK_MONOTONIC: one clock for every process of the machine).

It also calls ``bench.gpu_standin.install`` (the GPU stand-in engine, ``BENCH_GPU_STANDIN``) and
``bench.stage_cpu.install`` (CPU per stage, ``BENCH_STAGE_CPU``).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ENV = "BENCH_BATCH_TRACE"
_BATCH = contextvars.ContextVar("bench_batch", default=None)
_requests: list[dict[str, float]] = []  # per request: arrive, enqueue, formed, exec, done, batch
_batches: list[dict[str, Any]] = []     # per batch: id, size, exec, end
_engine: list[tuple[float, float, int, Any]] = []  # (start, end, rows, batch id or None)
_lag: list[tuple[float, float]] = []    # (when, lag_s)
_calls: list[tuple[float, float]] = []  # router side: (start, end) of ModelClient.infer
_lock = threading.Lock()


def install() -> None:
    """Ray ``worker_process_setup_hook``: the GPU stand-in, the stage CPU counters
    (``bench.stage_cpu``), then the trace, each when asked for."""
    from bench import gpu_standin, stage_cpu

    gpu_standin.install()
    stage_cpu.install()
    interval = os.environ.get("BENCH_SWITCH_INTERVAL_S")
    if interval:  # an experiment: the GIL's switch interval (Python's default 0.005 s)
        import sys

        sys.setswitchinterval(float(interval))
    folder = os.environ.get(ENV)
    if folder:
        _install_trace(Path(folder))


def _now() -> float:
    return time.perf_counter()


def _install_trace(folder: Path) -> None:
    from deployments import batching
    from deployments.runtime.residency.host import ModelHost

    folder.mkdir(parents=True, exist_ok=True)
    scheduler_cls = batching.BatchScheduler
    counter = iter(range(1 << 62))

    real_of = batching.BatchItem.of.__func__

    def of(cls, *args, **kwargs):
        arrive = _now()
        item = real_of(cls, *args, **kwargs)
        object.__setattr__(item, "_bench_arrive", arrive)
        return item

    batching.BatchItem.of = classmethod(of)

    real_submit = scheduler_cls.submit

    def submit(self, item):
        record = {"enqueue": _now()}
        record["arrive"] = getattr(item, "_bench_arrive", record["enqueue"])
        object.__setattr__(item, "_bench", record)
        future = real_submit(self, item)
        future.add_done_callback(lambda _f: record.__setitem__("done", _now()))
        with _lock:
            _requests.append(record)
        _start_lag_monitor()
        return future

    scheduler_cls.submit = submit

    real_start = scheduler_cls._start

    def start_batch(self, batch):
        formed = _now()
        for waiting in batch:
            waiting.item._bench["formed"] = formed
        return real_start(self, batch)

    scheduler_cls._start = start_batch

    real_inner = scheduler_cls._run

    async def run_batch(self, batch, loaded):
        start = _now()
        batch_id = next(counter)
        for waiting in batch:
            waiting.item._bench["exec"] = start
            waiting.item._bench["batch"] = batch_id
        _BATCH.set(batch_id)  # the batch's task has a context of its own
        try:
            return await real_inner(self, batch, loaded)
        finally:
            with _lock:
                _batches.append({"id": batch_id, "size": len(batch), "exec": start, "end": _now()})

    scheduler_cls._run = run_batch

    real_run = ModelHost.run

    @functools.wraps(real_run)
    def run(self, inputs, outputs=None):
        start = _now()
        try:
            return real_run(self, inputs, outputs)
        finally:
            first = next(iter(inputs.values()), None)
            rows = int(first.shape[0]) if first is not None and first.ndim else 1
            with _lock:
                _engine.append((start, _now(), rows, _BATCH.get()))

    ModelHost.run = run

    from deployments.client import ModelClient

    real_call = ModelClient.infer

    @functools.wraps(real_call)
    async def call(self, *args, **kwargs):
        start = _now()
        try:
            return await real_call(self, *args, **kwargs)
        finally:
            with _lock:
                _calls.append((start, _now()))

    ModelClient.infer = call
    threading.Thread(target=_writer, args=(folder / f"{os.getpid()}.json",), daemon=True).start()


_monitor_started = False


def _start_lag_monitor() -> None:
    global _monitor_started
    if _monitor_started:
        return
    _monitor_started = True

    async def monitor() -> None:
        while True:
            before = _now()
            await asyncio.sleep(0.001)
            lag = _now() - before - 0.001
            with _lock:
                _lag.append((before, lag))

    asyncio.get_running_loop().create_task(monitor())


def _writer(path: Path) -> None:
    while True:
        time.sleep(0.5)
        with _lock:
            if not (_requests or _engine or _calls):
                continue
            data = {"requests": [r for r in _requests if "done" in r], "batches": list(_batches),
                    "engine": list(_engine), "lag": list(_lag[-200000:]),
                    "calls": list(_calls)}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)


# --- reading it back (the benchmark's process) -------------------------------------------------

def _ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "max": None}
    a = np.array(values) * 1e3
    return {"p50": round(float(np.percentile(a, 50)), 3), "p90": round(float(np.percentile(a, 90)), 3),
            "max": round(float(a.max()), 3)}


def summarize(folder: Path, start: float, stop: float) -> dict[str, Any]:
    """What the replicas that wrote into ``folder`` did between ``start`` and ``stop``
    (``time.perf_counter`` of this machine): per request, ms spent from arrival to enqueue,
    queued until its batch formed, formed until the batch ran (``max_concurrent_batches``),
    batch start to engine start (concatenate + thread hop), engine, engine end to done (thread
    hop back + split + futures); per batch its requests and duration; engine calls per second
    and rows per call; event-loop lag. Percentiles p50/p90/max in ms."""
    time.sleep(0.6)  # the writers' period
    requests, batches, engine, lag, calls = [], [], [], [], []
    for path in folder.glob("*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        requests += [r for r in data["requests"] if start <= r["arrive"] <= stop]
        batches += [b for b in data["batches"] if start <= b["exec"] <= stop]
        engine += [e for e in data["engine"] if start <= e[0] <= stop]
        lag += [x for t, x in data["lag"] if start <= t <= stop]
        calls += [c for c in data["calls"] if start <= c[0] <= stop]
    by_batch = {}
    for e in engine:
        if e[3] is not None:
            by_batch.setdefault(e[3], []).append(e)
    pre, post = [], []
    for r in requests:
        runs = by_batch.get(r.get("batch"))
        if runs and "exec" in r:
            pre.append(runs[0][0] - r["exec"])
            post.append(r["done"] - runs[-1][1])
    window = stop - start
    return {
        "requests": len(requests),
        "stage_ms": {
            "arrive_to_enqueue": _ms([r["enqueue"] - r["arrive"] for r in requests]),
            "enqueue_to_formed": _ms([r["formed"] - r["enqueue"] for r in requests if "formed" in r]),
            "formed_to_exec": _ms([r["exec"] - r["formed"] for r in requests if "exec" in r and "formed" in r]),
            "exec_to_engine_start": _ms(pre),
            "engine": _ms([e[1] - e[0] for e in engine]),
            "engine_end_to_done": _ms(post),
            "batch_call": _ms([b["end"] - b["exec"] for b in batches]),
            "arrive_to_done": _ms([r["done"] - r["arrive"] for r in requests]),
            "router_handle_call": _ms([c[1] - c[0] for c in calls]),
        },
        # Little's law: mean requests inside the model replica / waiting on the router's handle
        "in_replica_mean": round(sum(r["done"] - r["arrive"] for r in requests) / window, 2),
        "in_router_call_mean": round(sum(c[1] - c[0] for c in calls) / window, 2),
        "batches": len(batches),
        "requests_per_batch": round(sum(b["size"] for b in batches) / len(batches), 2) if batches else None,
        "engine_calls_per_s": round(len(engine) / window, 1),
        "rows_per_engine_call": round(sum(e[2] for e in engine) / len(engine), 2) if engine else None,
        "engine_busy_fraction": round(sum(e[1] - e[0] for e in engine) / window, 3),
        "loop_lag_ms": _ms(lag),
    }
