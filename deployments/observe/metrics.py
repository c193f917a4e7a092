"""Triton-named Prometheus series, recorded in every replica process, summed per node.

Long because the router's, the replica's and the cache's recorders share one in-process buffer
and one file layout per node; apart, each would need the buffer's internals.

Why not Ray's metrics API: Ray 2.60 exports application metrics on its own port with a fixed
``ray_`` prefix (``ray/_private/telemetry/open_telemetry_metric_recorder.py``: ``NAMESPACE =
"ray"``, not configurable) and only after its report interval (seconds), so Triton's names
(``nv_inference_request_success``...) cannot come from it. Instead each process records with
``prometheus_client`` in its multiprocess mode: every metric value lives in a memory-mapped file
(one per process) in one directory per node, Ray session and application
(``<session_dir>/trt_serve_metrics/<app>``); a scrape merges the files (``prometheus_client.multiprocess``: counters and histograms summed,
live gauges summed over processes still running). So two replicas of a model on one node show
as one series whose value is the sum, the moment they count; across nodes Prometheus sums
(``sum by (model)``). The router's ``GET /metrics`` renders its application's directory on its
node; ``:port/metrics`` (``serve_node_metrics``) every application's on the node, summed.
Ray's own ``ray_*`` series are untouched.

A request's values are added in the process first (``_Buffer``: plain floats under one lock)
and written to the process's file every ``FLUSH_INTERVAL_S`` (a daemon thread writes whatever
changed at each tick): writing every value through
``prometheus_client`` costs about 1.2 us each (a lock, ``os.getpid()``, a struct write), 15 per
request. The recorders of one request, router and replica, cost 24 us of CPU written through
and 5 us buffered (docs/lab-notes.md, "Metrics on vs off"). So a scrape sees a request's counts at
most ``FLUSH_INTERVAL_S`` (plus scheduling delay) after its answer; a replica killed outright
loses what it had not written.

Series (labels ``model``, ``version`` as Triton's; units in names; counters rendered without
``_total`` exactly as Triton does):

================================================ ======= ==========================================
``nv_inference_request_success``                  counter requests answered 200 (router)
``nv_inference_request_failure`` (+``reason``)    counter requests answered non-200 for a known model
                                                          (``REJECTED`` 504, ``CANCELED`` client gone,
                                                          ``BACKEND`` 500, ``OTHER`` 400/413/503)
``nv_inference_count``                            counter rows run successfully (a batch of n counts n)
``nv_inference_exec_count``                       counter model executions (a dynamic batch counts 1)
``nv_inference_request_duration_us``              counter successful requests' time in the router
``nv_inference_queue_duration_us``                counter time at the model replica before the run
                                                          (batcher, context or model load wait)
``nv_inference_compute_input_duration_us``        counter decode + validation (router)
``nv_inference_compute_infer_duration_us``        counter the run (host->device copies included);
                                                          a batched request counts its batch's run
``nv_inference_compute_output_duration_us``       counter encode of the response (router)
``nv_inference_pending_request_count``            gauge   requests at a model replica, not answered
================================================ ======= ==========================================

Project series (prefix ``trt_serve_``): ``trt_serve_request_duration_seconds`` (histogram, for
percentiles), ``trt_serve_request_failure_duration_us``, ``trt_serve_last_inference_ms`` (unix
ms, max over processes), ``trt_serve_batch_exec_count`` and
``trt_serve_batch_compute_infer_duration_us`` (label ``batch_size``), and the pool cache's
``trt_serve_cache_{loads,reloads,evictions}`` (counters), ``trt_serve_cache_load_duration_seconds``
(histogram), ``trt_serve_cache_{resident,budget}_bytes`` and ``trt_serve_cache_resident_models``
(gauges, label ``replica``), and the pool placement's (``placement: bytes``)
``trt_serve_placement_*`` (``PlacementRecorder``). GPU gauges: ``deployments.observe.gpu``.
"""

from __future__ import annotations

import atexit
import bisect
import contextvars
import glob
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

logger = logging.getLogger("ray.serve")

DIRECTORY_NAME = "trt_serve_metrics"
PREFIX = "trt_serve_"
# Histogram buckets (seconds): 0.5 ms .. 10 s, for p50 / p99 by ``histogram_quantile``.
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
LOAD_BUCKETS_S = (0.01, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
# Triton's failure reasons by HTTP status (docs/user_guide/metrics.md, "Failure Count Categories").
REASON_BY_STATUS = {504: "REJECTED", 499: "CANCELED", 500: "BACKEND"}
# Seconds a recorded value may wait in its process before it is written to the metrics file.
FLUSH_INTERVAL_S = 0.1

_lock = threading.Lock()
_families: "_Families | None" = None
_buffer: "_Buffer | None" = None
_directory: str | None = None


def reason_for(status: int) -> str:
    """Triton's ``reason`` label for a failed request's HTTP status (499: the client left)."""
    return REASON_BY_STATUS.get(status, "OTHER")


def node_root() -> str:
    """This node's metrics root for the current Ray session: ``<session_dir>/trt_serve_metrics``.

    Outside Ray (unit tests, benchmarks) ``TRT_SERVE_METRICS_DIR`` names it.
    """
    explicit = os.environ.get("TRT_SERVE_METRICS_DIR")
    if explicit:
        return explicit
    import ray

    node = ray._private.worker._global_node  # the session directory has no public getter in 2.60
    if node is None:
        raise RuntimeError("not in a Ray worker and TRT_SERVE_METRICS_DIR is not set")
    return os.path.join(node.get_session_dir_path(), DIRECTORY_NAME)


def node_directory() -> str:
    """This server's metrics directory on this node (created if missing): the router
    application's name under ``node_root()`` (``default`` outside a replica). A dedicated
    model's application, ``<router application>.<model>``, writes to its router's, whose
    ``/metrics`` and statistics read them all."""
    app = "default"
    try:
        from ray import serve

        app = (serve.get_replica_context().app_name or app).split(".", 1)[0]
    except Exception:  # not in a Serve replica
        pass
    path = os.path.join(node_root(), app)
    os.makedirs(path, exist_ok=True)
    return path


def _enable_multiprocess(directory: str) -> None:
    """Make ``prometheus_client`` metrics created from now on in this process write to
    ``directory`` (its documented switch is this env var, read when ``values`` is imported;
    a Serve replica has not imported it before, but set the value class too to be sure)."""
    from prometheus_client import multiprocess, values

    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    values.ValueClass = values.MultiProcessValue()
    multiprocess.mark_process_dead(os.getpid(), directory)  # a previous process with our pid


class _Families:
    """The metric families of one process (created once, after multiprocess mode is on)."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        mv = ["model", "version"]
        self.success = Counter("nv_inference_request_success", "Number of successful inference requests, all batch sizes", mv, registry=None)
        self.failure = Counter("nv_inference_request_failure", "Number of failed inference requests, all batch sizes", mv + ["reason"], registry=None)
        self.inference_count = Counter("nv_inference_count", "Number of inferences performed (does not include cached requests)", mv, registry=None)
        self.exec_count = Counter("nv_inference_exec_count", "Number of model executions performed (does not include cached requests)", mv, registry=None)
        self.request_us = Counter("nv_inference_request_duration_us", "Cumulative inference request duration in microseconds (includes cached requests)", mv, registry=None)
        self.queue_us = Counter("nv_inference_queue_duration_us", "Cumulative inference queuing duration in microseconds (includes cached requests)", mv, registry=None)
        self.input_us = Counter("nv_inference_compute_input_duration_us", "Cumulative compute input duration in microseconds (does not include cached requests)", mv, registry=None)
        self.infer_us = Counter("nv_inference_compute_infer_duration_us", "Cumulative compute inference duration in microseconds (does not include cached requests)", mv, registry=None)
        self.output_us = Counter("nv_inference_compute_output_duration_us", "Cumulative inference compute output duration in microseconds (does not include cached requests)", mv, registry=None)
        self.pending = Gauge("nv_inference_pending_request_count", "Instantaneous number of pending requests awaiting execution per-model.", mv, multiprocess_mode="livesum", registry=None)
        self.request_s = Histogram(PREFIX + "request_duration_seconds", "Successful inference request duration in the router, seconds", mv, buckets=LATENCY_BUCKETS_S, registry=None)
        self.failure_us = Counter(PREFIX + "request_failure_duration_us", "Cumulative duration of failed inference requests in microseconds", mv, registry=None)
        self.last_inference = Gauge(PREFIX + "last_inference_ms", "Time of the last successful inference, milliseconds since the epoch", mv, multiprocess_mode="max", registry=None)
        mvb = mv + ["batch_size"]
        self.batch_exec = Counter(PREFIX + "batch_exec_count", "Model executions by batch size (rows)", mvb, registry=None)
        self.batch_infer_us = Counter(PREFIX + "batch_compute_infer_duration_us", "Cumulative model execution duration by batch size, microseconds", mvb, registry=None)
        self.batch_rows = Counter(PREFIX + "batch_rows", "Dynamic batching: rows of requests run in batches", mv, registry=None)
        self.batch_padded_rows = Counter(PREFIX + "batch_padded_rows", "Dynamic batching: zero rows added to reach a padded batch size", mv, registry=None)
        self.batch_positions = Counter(PREFIX + "batch_positions", "Dynamic batching: sequence positions (rows x length) of requests run in batches", mv, registry=None)
        self.batch_padded_positions = Counter(PREFIX + "batch_padded_positions", "Dynamic batching: sequence positions run beyond the requests' own (sequence buckets and padded rows)", mv, registry=None)
        self.cache_loads = Counter(PREFIX + "cache_loads", "Pool cache: first loads of a model", ["model", "replica"], registry=None)
        self.cache_reloads = Counter(PREFIX + "cache_reloads", "Pool cache: loads of a model after its eviction", ["model", "replica"], registry=None)
        self.cache_evictions = Counter(PREFIX + "cache_evictions", "Pool cache: evictions of a model", ["model", "replica"], registry=None)
        self.cache_load_s = Histogram(PREFIX + "cache_load_duration_seconds", "Pool cache: model load (and reload) duration, seconds", ["model"], buckets=LOAD_BUCKETS_S, registry=None)
        self.cache_resident = Gauge(PREFIX + "cache_resident_bytes", "Pool cache: footprints of the resident models, bytes", ["replica"], multiprocess_mode="livesum", registry=None)
        self.cache_budget = Gauge(PREFIX + "cache_budget_bytes", "Pool cache: byte budget (absent: no budget)", ["replica"], multiprocess_mode="livesum", registry=None)
        self.cache_models = Gauge(PREFIX + "cache_resident_models", "Pool cache: resident models", ["replica"], multiprocess_mode="livesum", registry=None)
        # One writer (the placement replica); ``livemostrecent``: a replacement's values, not a sum with its predecessor's.
        placement = dict(multiprocess_mode="livemostrecent", registry=None)
        self.placement_revision = Gauge(PREFIX + "placement_revision", "Pool placement: the decision's revision (a change of where a model is routed)", **placement)
        self.placement_recomputes = Counter(PREFIX + "placement_recomputes", "Pool placement: decisions made (a new revision or not)", registry=None)
        self.placement_replicas = Gauge(PREFIX + "placement_replicas", "Pool placement: pool replicas reporting", **placement)
        self.placement_copies = Gauge(PREFIX + "placement_copies", "Pool placement: replicas a model is placed on (0: not placed)", ["model"], **placement)
        self.placement_bytes = Gauge(PREFIX + "placement_bytes", "Pool placement: a model's footprint as placed, bytes", ["model"], **placement)
        self.placement_rate = Gauge(PREFIX + "placement_rate_per_s", "Pool placement: a model's requests per second over the pool replicas, decayed", ["model"], **placement)
        self.placement_placed = Gauge(PREFIX + "placement_placed", "Pool placement: 1 where a model is placed, 0 where it was and is no longer", ["model", "replica"], **placement)
        self.placement_routed = Gauge(PREFIX + "placement_routed", "Pool placement: 1 where HAProxy sends a model's requests, 0 where it did and no longer does", ["model", "replica"], **placement)
        self.placement_replica_bytes = Gauge(PREFIX + "placement_replica_bytes", "Pool placement: footprints of the models placed on a replica, bytes", ["replica"], **placement)
        self.placement_replica_models = Gauge(PREFIX + "placement_replica_models", "Pool placement: models placed on a replica", ["replica"], **placement)


def exported_series() -> dict[str, str]:
    """Every series name as Prometheus stores it (``nv_*`` counters without ``_total``, other
    counters with it, histograms' ``_bucket`` / ``_sum`` / ``_count``) -> its type; GPU
    gauges included. For checking dashboards and alerts against what is exported."""
    from .gpu import GPU_SERIES

    out = {name: "gauge" for name in GPU_SERIES}
    for metric in vars(_Families()).values():
        name, kind = metric._name, metric._type
        if kind == "counter":
            out[name if name.startswith("nv_") else name + "_total"] = kind
        elif kind == "histogram":
            out.update({name + suffix: kind for suffix in ("_bucket", "_sum", "_count")})
        else:
            out[name] = kind
    return out


def families() -> _Families:
    """This process's metric families; the first call turns multiprocess mode on and starts
    the buffer's flush thread."""
    global _families, _directory, _buffer
    if _families is None:
        with _lock:
            if _families is None:
                _directory = node_directory()
                _enable_multiprocess(_directory)
                _buffer = _Buffer(FLUSH_INTERVAL_S)
                _families = _Families()
    return _families


def buffer() -> "_Buffer":
    """This process's ``_Buffer`` (metrics on: ``families()`` creates it)."""
    families()
    assert _buffer is not None
    return _buffer


def flush() -> None:
    """Write this process's buffered values to its metrics file now (no-op before any)."""
    if _buffer is not None:
        _buffer.flush()


class _CounterCell:
    """A counter child's increments not yet written (callers hold ``_Buffer.lock``)."""

    __slots__ = ("child", "delta")

    def __init__(self, child: Any) -> None:
        self.child, self.delta = child, 0.0

    def add(self, amount: float) -> None:
        self.delta += amount

    def write(self) -> None:
        if self.delta:
            self.child.inc(self.delta)
            self.delta = 0.0


class _GaugeCell:
    """A gauge child's latest value (``set``) or running total (``add``), written when changed."""

    __slots__ = ("child", "value", "changed")

    def __init__(self, child: Any) -> None:
        self.child, self.value, self.changed = child, 0.0, False

    def set(self, value: float) -> None:
        self.value, self.changed = value, True

    def add(self, amount: float) -> None:
        self.value += amount
        self.changed = True

    def write(self) -> None:
        if self.changed:
            self.child.set(self.value)
            self.changed = False


class _HistogramCell:
    """A histogram child's observations not yet written: count per bucket and their sum.

    Written through the child's own bucket and sum values (``Histogram._buckets`` / ``_sum``,
    prometheus_client's internals since 0.4; ``tests/unit/test_metrics.py`` checks the result
    against ``observe``): a bucket holds the observations ``<= le`` and above the previous.
    """

    __slots__ = ("child", "bounds", "counts", "total", "changed")

    def __init__(self, child: Any) -> None:
        self.child, self.bounds = child, list(child._upper_bounds)
        self.counts, self.total, self.changed = [0] * len(self.bounds), 0.0, False

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.changed = True

    def write(self) -> None:
        if not self.changed:
            return
        self.child._sum.inc(self.total)
        for i, n in enumerate(self.counts):
            if n:
                self.child._buckets[i].inc(n)
                self.counts[i] = 0
        self.total, self.changed = 0.0, False


class _Buffer:
    """One process's recorded values between writes to its metrics file.

    Recorders add under ``lock`` (one acquisition per request and side) and call
    ``maybe_flush(now)`` at the end of a request: the cells are written when ``interval_s``
    has passed since the last write. A daemon thread writes every ``interval_s`` too (values
    of a process that went idle), and so does exit (``atexit``).
    """

    def __init__(self, interval_s: float) -> None:
        self.lock = threading.Lock()
        self.interval_s = interval_s
        self._cells: list[Any] = []
        self._written_at = time.perf_counter()
        threading.Thread(target=self._tick, name="trt-serve-metrics-flush", daemon=True).start()
        atexit.register(self.flush)

    def _cell(self, cell: Any) -> Any:
        with self.lock:
            self._cells.append(cell)
        return cell

    def counter(self, child: Any) -> _CounterCell:
        return self._cell(_CounterCell(child))

    def gauge(self, child: Any) -> _GaugeCell:
        return self._cell(_GaugeCell(child))

    def histogram(self, child: Any) -> _HistogramCell:
        return self._cell(_HistogramCell(child))

    def flush(self) -> None:
        with self.lock:
            for cell in self._cells:
                cell.write()
            self._written_at = time.perf_counter()

    def maybe_flush(self, now: float) -> None:
        """Flush if ``interval_s`` has passed since the last (``now``: ``time.perf_counter()``)."""
        if now - self._written_at >= self.interval_s:
            self.flush()

    def _tick(self) -> None:
        # Every tick writes what changed since the last write: a value added just after a write
        # is written within one ``interval_s`` (``maybe_flush`` here left it for a second tick).
        idle = threading.Event()  # never set: a wait that samplers (py-spy) see as idle
        while not idle.wait(self.interval_s):
            self.flush()


# --------------------------------------------------------------------------- router side

class _ModelSeries:
    """Buffered label-bound children for one (model, version): ``labels()`` once, not per request."""

    def __init__(self, f: _Families, b: _Buffer, model: str, version: str) -> None:
        self.success = b.counter(f.success.labels(model, version))
        self.request_us = b.counter(f.request_us.labels(model, version))
        self.input_us = b.counter(f.input_us.labels(model, version))
        self.output_us = b.counter(f.output_us.labels(model, version))
        self.request_s = b.histogram(f.request_s.labels(model, version))
        self.last_inference = b.gauge(f.last_inference.labels(model, version))
        self.failure_us = b.counter(f.failure_us.labels(model, version))
        self._failure_family, self._buffer = f.failure, b
        self._failures: dict[str, _CounterCell] = {}
        self._labels = (model, version)

    def failure(self, reason: str) -> _CounterCell:
        cell = self._failures.get(reason)
        if cell is None:
            cell = self._failures[reason] = self._buffer.counter(self._failure_family.labels(*self._labels, reason))
        return cell


@dataclass
class RequestTiming:
    """Phases of one request in the router, seconds (``time.perf_counter`` differences)."""

    start: float
    compute_input_s: float = 0.0
    compute_output_s: float = 0.0


class RouterRecorder:
    """Counts requests at the router: success / failure, duration, decode and encode time."""

    def __init__(self) -> None:
        self._f = families()
        self._buffer = buffer()
        self._series: dict[tuple[str, str], _ModelSeries] = {}

    def _of(self, model: str, version: str) -> _ModelSeries:
        series = self._series.get((model, version))
        if series is None:
            series = self._series[(model, version)] = _ModelSeries(self._f, self._buffer, model, version)
        return series

    def finished(self, model: str, version: str, status: int, timing: RequestTiming) -> None:
        """Record one answered request (``status`` 200: success, else a failure)."""
        now = time.perf_counter()
        total_s = now - timing.start
        s = self._of(model, version)
        failure = None if status == 200 else s.failure(reason_for(status))
        with self._buffer.lock:
            if failure is None:
                s.success.add(1)
                s.request_us.add(total_s * 1e6)
                s.input_us.add(timing.compute_input_s * 1e6)
                s.output_us.add(timing.compute_output_s * 1e6)
                s.request_s.observe(total_s)
                s.last_inference.set(time.time() * 1e3)
            else:
                failure.add(1)
                s.failure_us.add(total_s * 1e6)
        self._buffer.maybe_flush(now)


# --------------------------------------------------------------------------- replica side

class RunHolder:
    """Seconds of model run that served the current request (see ``ReplicaRecorder``)."""

    __slots__ = ("run_s",)

    def __init__(self) -> None:
        self.run_s = 0.0


_CURRENT_RUN: contextvars.ContextVar[RunHolder | None] = contextvars.ContextVar("trt_serve_run", default=None)


class ReplicaRecorder:
    """Counts at a model replica: executions (via ``ModelHost.on_execution``) and per request
    the queue and compute time (``request()``).

    A request's run time reaches it through a context variable: ``asyncio.to_thread`` and the
    pool cache's executor carry the context into the thread that runs the model, where
    ``on_execution`` adds the run to the request's ``RunHolder``. A dynamically batched request
    is given its batch's run time by the deployment (``RunHolder.run_s``).
    """

    def __init__(self) -> None:
        self._f = families()
        self._buffer = buffer()
        self._exec: dict[tuple[str, int, int], tuple[_CounterCell, ...]] = {}
        self._req: dict[tuple[str, int], tuple[Any, ...]] = {}
        self._members: dict[int, RunHolder] = {}
        self._padding: dict[tuple[str, int], tuple[_CounterCell, ...]] = {}

    def on_execution(self, model: str, version: int, rows: int, run_s: float) -> None:
        """One successful model run of ``rows`` rows taking ``run_s`` seconds."""
        key = (model, version, rows)
        cells = self._exec.get(key)
        if cells is None:
            v, b = str(version), str(rows)
            cells = self._exec[key] = tuple(self._buffer.counter(child) for child in (
                self._f.exec_count.labels(model, v), self._f.inference_count.labels(model, v),
                self._f.batch_exec.labels(model, v, b), self._f.batch_infer_us.labels(model, v, b)))
        executions, inferences, batch_executions, batch_us = cells
        with self._buffer.lock:
            executions.add(1)
            inferences.add(rows)
            batch_executions.add(1)
            batch_us.add(run_s * 1e6)
        holder = _CURRENT_RUN.get()
        if holder is not None:
            holder.run_s += run_s

    def batch_member(self, item: object) -> None:
        """The current request waits in the dynamic batcher as ``item``."""
        holder = _CURRENT_RUN.get()
        if holder is not None:
            self._members[id(item)] = holder

    def batch_ran(self, items: Iterable[object], run_s: float) -> None:
        """The batch holding ``items`` ran for ``run_s`` seconds: each request's compute time.
        Also detaches the batch task from the context of the request that started it."""
        _CURRENT_RUN.set(None)
        for item in items:
            holder = self._members.pop(id(item), None)
            if holder is not None:
                holder.run_s = run_s

    def batch_padding(self, model: str, version: int, run: Any) -> None:
        """A batch's real and padded work (``batching.BatchRun``: ``rows`` from its calls,
        ``padded_rows``, ``positions``, ``padded_positions``)."""
        key = (model, version)
        cells = self._padding.get(key)
        if cells is None:
            v, f = str(version), self._f
            cells = self._padding[key] = tuple(self._buffer.counter(family.labels(model, v)) for family in (
                f.batch_rows, f.batch_padded_rows, f.batch_positions, f.batch_padded_positions))
        values = (sum(rows for _, rows in run.calls), run.padded_rows, run.positions, run.padded_positions)
        with self._buffer.lock:
            for cell, value in zip(cells, values):
                if value:
                    cell.add(value)

    def request(self, model: str, version: int) -> "_ReplicaRequest":
        """``with recorder.request(m, v) as holder:`` around one request at the replica: pending
        while inside; on success, queue = time inside - ``holder.run_s``, compute = ``run_s``."""
        key = (model, version)
        series = self._req.get(key)
        if series is None:
            v, b = str(version), self._buffer
            series = self._req[key] = (b, b.gauge(self._f.pending.labels(model, v)),
                                       b.counter(self._f.queue_us.labels(model, v)),
                                       b.counter(self._f.infer_us.labels(model, v)))
        return _ReplicaRequest(*series)


class _ReplicaRequest:
    __slots__ = ("_buffer", "_pending", "_queue_us", "_infer_us", "_start", "_holder", "_token")

    def __init__(self, buffer: _Buffer, pending: _GaugeCell, queue_us: _CounterCell, infer_us: _CounterCell) -> None:
        self._buffer, self._pending, self._queue_us, self._infer_us = buffer, pending, queue_us, infer_us

    def __enter__(self) -> RunHolder:
        with self._buffer.lock:
            self._pending.add(1)
        self._holder = RunHolder()
        self._token = _CURRENT_RUN.set(self._holder)
        self._start = time.perf_counter()
        return self._holder

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        now = time.perf_counter()
        total_s = now - self._start
        _CURRENT_RUN.reset(self._token)
        with self._buffer.lock:
            self._pending.add(-1)
            if exc_type is None:
                run_s = min(self._holder.run_s, total_s)
                self._queue_us.add((total_s - run_s) * 1e6)
                self._infer_us.add(run_s * 1e6)
        self._buffer.maybe_flush(now)


class CacheRecorder:
    """Turns ``ModelCache`` events (``on_event``) into the ``trt_serve_cache_*`` series."""

    def __init__(self, replica: str) -> None:
        f = self._f = families()
        self.replica = replica
        self._resident = f.cache_resident.labels(replica)
        self._models = f.cache_models.labels(replica)
        self._budget = f.cache_budget.labels(replica)

    def status(self, resident_bytes: int, resident_models: int, budget_bytes: int | None) -> None:
        self._resident.set(resident_bytes)
        self._models.set(resident_models)
        if budget_bytes is not None:
            self._budget.set(budget_bytes)

    def on_event(self, event: dict[str, Any]) -> None:
        """One cache timeline record (``ModelCache.timeline`` keys)."""
        kind, model = event["event"], event["model"]
        if kind in ("load", "reload"):
            (self._f.cache_loads if kind == "load" else self._f.cache_reloads).labels(model, self.replica).inc()
            self._f.cache_load_s.labels(model).observe(event["ms"] / 1e3)
        elif kind == "evict":
            self._f.cache_evictions.labels(model, self.replica).inc()
        self.status(event["resident_bytes"], len(event["resident_models"]), event["budget_bytes"])


def placement_values(decision: dict[str, Any]) -> dict[str, dict[tuple[str, ...], float]]:
    """The ``trt_serve_placement_*`` values of a placement decision (``placement.Decider.state``),
    by family attribute (``_Families``) and label values: per model its copies, bytes and rate;
    per (model, replica) placed and routed (1); per replica reporting its placed bytes and
    models (a reporting replica with none: 0); the revision and the replicas reporting."""
    why, target, routed = decision["why"], decision["target"], decision["routed"]
    replica_bytes: dict[tuple[str, ...], float] = {(r,): 0.0 for r in decision["replicas"]}
    replica_models = dict(replica_bytes)
    for model, where in target.items():
        for replica in where:
            replica_bytes[(replica,)] = replica_bytes.get((replica,), 0.0) + why[model]["bytes"]
            replica_models[(replica,)] = replica_models.get((replica,), 0.0) + 1
    return {"placement_revision": {(): decision["revision"]},
            "placement_replicas": {(): len(decision["replicas"])},
            "placement_copies": {(m,): len(target.get(m, ())) for m in why},
            "placement_bytes": {(m,): w["bytes"] for m, w in why.items()},
            "placement_rate": {(m,): w["rate_per_s"] for m, w in why.items()},
            "placement_placed": {(m, r): 1 for m, where in target.items() for r in where},
            "placement_routed": {(m, r): 1 for m, where in routed.items() for r in where},
            "placement_replica_bytes": replica_bytes, "placement_replica_models": replica_models}


class PlacementRecorder:
    """Writes each placement decision as the ``trt_serve_placement_*`` series
    (``placement_values``). A label set written before and absent now is set to 0, not
    removed (a multiprocess file keeps a value once written), except a model's ``bytes``,
    which keeps its last figure; so a model unloaded or moved, or a replica gone, reads 0."""

    def __init__(self) -> None:
        self._f = families()
        self._written: dict[str, set[tuple[str, ...]]] = {}

    def decided(self, decision: dict[str, Any]) -> None:
        """One decision made (``recomputes`` counts it)."""
        self._f.placement_recomputes.inc()
        for name, values in placement_values(decision).items():
            family = getattr(self._f, name)
            written = self._written.setdefault(name, set())
            if name != "placement_bytes":
                values = {**{labels: 0 for labels in written}, **values}
            for labels, value in values.items():
                (family.labels(*labels) if labels else family).set(value)
            written.update(values)


# --------------------------------------------------------------------------- scrape side

_LIVE_FILE = re.compile(r"gauge_live\w*?_(\d+)\.db$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def node_families(directory: str, recursive: bool = False) -> list[Any]:
    """The merged metric families of every process that recorded in ``directory`` (with
    ``recursive``, in its sub-directories too: every application's): live gauges
    of processes no longer running are dropped (a replica that crashed); Triton-named counters
    carry no ``_total`` suffix, as Triton renders them."""
    from prometheus_client.multiprocess import MultiProcessCollector

    files = []
    pattern = os.path.join(directory, "**", "*.db") if recursive else os.path.join(directory, "*.db")
    for path in glob.glob(pattern, recursive=recursive):
        match = _LIVE_FILE.search(os.path.basename(path))
        if match is None or _alive(int(match.group(1))):
            files.append(path)
    merged = list(MultiProcessCollector.merge(files, accumulate=True))
    for family in merged:
        if family.type == "counter" and family.name.startswith("nv_"):
            family.samples = [s._replace(name=family.name) if s.name == family.name + "_total" else s
                              for s in family.samples]
    return sorted(merged, key=lambda f: f.name)


class _NodeCollector:
    def __init__(self, directory: str, recursive: bool, extra: Iterable[Callable[[], Iterable[Any]]]) -> None:
        self.directory, self.recursive, self.extra = directory, recursive, list(extra)

    def collect(self) -> Iterable[Any]:
        yield from node_families(self.directory, self.recursive)
        for source in self.extra:
            yield from source()


def render(directory: str | None = None, recursive: bool = False) -> bytes:
    """Prometheus text exposition (format 0.0.4) of the series in ``directory`` (default: this
    application's on this node; ``recursive``: with sub-directories), GPU gauges included."""
    from prometheus_client import CollectorRegistry, generate_latest

    from .gpu import gpu_families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_NodeCollector(directory or node_directory(), recursive, [gpu_families]))
    return _TRITON_COUNTER_HEADER.sub(rb"\1", generate_latest(registry))


# prometheus_client writes a counter's HELP / TYPE lines as ``<name>_total``; Triton's have none.
_TRITON_COUNTER_HEADER = re.compile(rb"^(# (?:HELP|TYPE) nv_\w+?)_total(?= )", re.MULTILINE)


_server_started = False


def serve_node_metrics(port: int, host: str = "0.0.0.0", retry_s: float = 5.0) -> None:
    """Serve ``GET host:port/metrics`` (this node's series) from this process if no other process on
    the node does yet: the first replica to bind the port serves it; the others retry every
    ``retry_s`` seconds in a daemon thread, so the port moves on when its owner stops."""
    global _server_started
    with _lock:
        if _server_started:
            return
        _server_started = True
    root = node_root()

    def bind_loop() -> None:
        from wsgiref.simple_server import WSGIRequestHandler, make_server
        from prometheus_client.exposition import ThreadingWSGIServer

        def app(environ: dict, start_response: Callable) -> list[bytes]:
            if environ.get("PATH_INFO", "/") not in ("/metrics", "/"):
                start_response("404 Not Found", [("Content-Type", "text/plain")])
                return [b"only /metrics here\n"]
            body = render(root, recursive=True)
            start_response("200 OK", [("Content-Type", "text/plain; version=0.0.4; charset=utf-8")])
            return [body]

        class Quiet(WSGIRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

        while True:
            try:
                server = make_server(host, port, app, ThreadingWSGIServer, handler_class=Quiet)
            except OSError:
                threading.Event().wait(retry_s)  # as time.sleep, but idle to samplers (py-spy)
                continue
            logger.info("node metrics on %s:%d/metrics (pid %d)", host, port, os.getpid())
            server.serve_forever()

    threading.Thread(target=bind_loop, name="trt-serve-metrics", daemon=True).start()
