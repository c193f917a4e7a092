"""ModelCache: the models one replica holds, under a byte budget and an optional count cap.

Long because its promises below are one state machine under one lock (reference counts, single
flight, the count cap, the byte budget and the timeline): split, each part would need the others'
state.

Three load policies (``CacheOptions.load_policy``; docs/placement.md, "Memory"):

* ``eager``: ``start()`` loads every model; nothing is ever evicted.
* ``lazy``: a model loads on its first request; nothing is ever evicted.
* ``lru``: a model loads on its first request; before a load, least-recently-used models that
  no request holds are evicted until the new one fits ``budget_bytes`` (and ``max_models``).

``budget_bytes`` and ``max_models`` come from ``CacheOptions`` (``memory_budget_mib``,
``max_num_models_per_replica``).

Promises, all policies:

* A request holds its model (a reference count) from ``acquire`` to the end of the ``with``
  block; a held model is never evicted: eviction only picks models at zero.
* Concurrent first requests for one cold model load it once (single flight): the others wait
  for that load and share its outcome.
* ``max_models`` counts loaded models and loads that hold their place; a load still waiting for
  room holds none, so a burst of first requests for more models than the cap loads the first
  ``max_models`` at once and the rest evict them as their requests end.
* A model whose footprint alone is over ``budget_bytes`` is refused with ``OverBudget`` (503)
  naming both figures. With ``lru``, when the new model does not fit because the resident
  models are in use, the request waits up to ``wait_timeout_s`` for them to be released, then
  gets ``OverBudget``; ``eager`` and ``lazy`` never free memory, so they refuse at once.
* ``resident_bytes`` (the footprints of the loaded models) is at most ``budget_bytes`` after
  every event of the timeline.

Footprint of a model = ``engine_bytes + instances x context_bytes`` (``backends.base.Footprint``). Before
a model's first load the cache reserves the best figure it has: one measured earlier in this
process (``footprints.measured_footprint``), one passed in ``footprints``, one another replica
measured (``prefetch``'s bytes: ``reported``), one recorded beside the model
(``footprints.read_record``), else the graph prediction (``predict.predict``); on a GPU the
prediction is raised by what earlier loads here measured over their predictions, and a load
before any such reading makes room for the whole budget (``_gpu_first_reservation``), or for
the room left by the GPU growth read since, whichever is less. A prediction alone over the
budget is not trusted enough to refuse on, nor to evict for: that load reserves only the room
free now and evicts nothing up front. The load then measures the real one
(``footprints.load_and_measure``: exact on TensorRT, RSS growth on ONNX Runtime); when it is
larger than the reservation, the extra is reserved at once, under the load lock, by evicting
unheld models; if that is not enough the model is unloaded before any other load starts and its
load starts over with the real figure, waiting for room (``OverBudget`` after the wait); a real
figure alone over the budget is refused (``OverBudget``), so a model predicted and measured not
to fit leaves every model that was loaded in place. So the real bytes of the loaded models stay
within the budget, except while a model whose figure was too low (or predicted over the budget)
is being loaded and measured: then its own bytes can pass the budget (one model's error, never
two). Reloads use the measured figure.

On a GPU the budget also counts this process's GPU growth that no model's footprint covers
(``gpu_growth_bytes``): NVML's per-process reading over the baseline less the footprints
resident, read after every eviction, before and after every load (under the load lock), and
once a second while the cache is idle (``check_gpu_growth``, from a thread started at the
first model found to run on a GPU under a budget). Where a reading takes the accounting past the
budget (a new shape's kernels loaded lazily at a request, a reload's contexts larger than
measured), the least recently used unheld models are evicted until it fits again: before a
load adds a model, before a loaded one is published, or within a second of the growth while
serving. Unloading every session does not give back the kernel modules that
CUDA loads on first use (lazy loading) or the libraries' workspaces: seen on the H200, 20 MiB
stayed after the pool's three CNNs were all evicted, and the next two loads took the reading
8.4 MB over a 1,600.1 MB budget while the footprints summed within it (docs/lab-notes.md,
"Fractional GPUs"). Device-wide readings (``source: device``) include other processes and are
not used, so there (and before ``onnxruntime_cuda.prime`` sets the baseline) the growth stays 0.
The growth is everything on the GPU in this process that no resident footprint covers: one
cache per process (the pool replica's) is assumed. It is taken only when every loaded model's
bytes are in the accounting (a loaded model awaiting publication counts its measured figure);
it only grows in practice (loaded kernel modules stay).

Loads and evictions run one at a time in the process (a process-wide lock), outside the cache's
bookkeeping lock, so requests on resident models never wait for a load. The RSS measurement is
process-wide, so serializing loads also keeps one load's measurement free of another's.

Timeline: every load, reload, evict and refusal is logged (logger ``deployments.runtime.residency.cache``)
and kept (the last ``timeline_size``) for ``timeline()``; a load's ``detail`` is ``prefetch`` when
``prefetch`` made it (a placement put the model here), empty when a request did.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np

from ..backends.base import GPU_BACKENDS, Footprint
from ..backends.process import process_rss_bytes
from ..backends import gpu_memory
from ..backends.gpu_memory import GpuReading, process_gpu_bytes
from ..backends.select import requested_backend, resolve_backend
from . import footprints
from .predict import predict
from ..contract.config import CacheOptions
from ..contract.errors import (ConfigError, InferenceError, InvalidInput, InvalidModelFile, LoadFault, ModelNotReady,
                               OverBudget, ServingError, replaced_version, unknown_model, unloaded_model)
from ..contract.units import format_mib
from .host import ModelHost
from ..contract.validation import validate_request
from ..contract.repository import ModelEntry, ModelRepository

logger = logging.getLogger(__name__)

_ABSENT, _LOADING, _READY, _EVICTING = "absent", "loading", "ready", "evicting"

# A model whose measured footprint alone exceeds the budget is measured again, up to this many
# readings in all, before it is refused (footprints: RSS noise only adds).
MAX_MEASUREMENTS = 2

# One load or eviction at a time in the process: RSS readings are process-wide.
_LOAD_LOCK = threading.Lock()

# Why a load runs, for its timeline event's ``detail``: "" for a request's, "prefetch" for
# ``ModelCache.prefetch``'s (a placement put the model here before its requests come).
_LOAD_CAUSE: contextvars.ContextVar[str] = contextvars.ContextVar("model_cache_load_cause", default="")

# How often an idle cache holding GPU models under a budget re-reads its GPU growth
# (``ModelCache.check_gpu_growth``).
GPU_GROWTH_CHECK_S = 1.0


@dataclass
class _Flight:
    """One load in progress; ``holders`` requests (the loader included) get a reference when it
    succeeds, or ``error`` when it fails."""

    holders: int = 1
    done: bool = False
    error: BaseException | None = None
    counted: bool = False  # the load has its place under ``max_models`` (``_reserve``)


@dataclass
class _Slot:
    name: str
    host: ModelHost
    state: str = _ABSENT
    refcount: int = 0
    last_used: int = 0
    bytes: int = 0
    footprint: Footprint | None = None
    footprint_source: str = ""
    flight: _Flight | None = None
    backend: str = ""
    loads: int = 0
    evictions: int = 0
    load_error: str = ""  # why the last load failed, when it did and nothing loaded it since
    enabled: bool = True  # False after ``unload``: requests get ModelNotReady until ``load``
    replacing: bool = False  # a load replaces its reading (``replacing``): requests wait for it instead
    evict_detail: str = ""  # why it is marked for eviction, when not for room: its evict event's detail


def _fails_every_load(error: BaseException) -> bool:
    """Whether a load that failed with ``error`` would fail again alike (its model file, its
    config or the backend at fault), not for lack of room or time (``OverBudget``,
    ``ModelNotReady``, ``InferenceTimeout``)."""
    return isinstance(error, (ConfigError, LoadFault, InferenceError, InvalidInput))


class ModelCache:
    """The models of one replica, loaded by policy and kept under a byte budget.

    Args:
        repository: the model repository.
        names: the models this cache serves (default: every non-pipeline model). Each served
            version of a model (its ``version_policy``) is a cache entry of its own, under the
            same limits, keyed by ``ModelEntry.key``: the model name for its newest served
            version, ``<name>@<version>`` for older ones; the methods below take these keys.
        options: ``CacheOptions``: load policy, byte budget (``memory_budget_mib``), count cap
            (``max_num_models_per_replica``; both limits apply together), and how long a load
            waits for held models to be released (``wait_timeout_s``, ``lru``).
        backend: ``auto``, ``onnxruntime`` or ``tensorrt`` (``backends.select.requested_backend``).
        measure_elements: input elements of the measuring runs at a model's first load on ONNX
            Runtime (``footprints.measure_batch_of``); None measures at the full max batch.
        footprints: known footprints by model name (e.g. from ``python -m deployments.runtime.tools.plan measure --write`` or a
            TensorRT build), used before the first load instead of the prediction.
        checkout_timeout_s: ``ModelHost``'s wait for a free execution context.
        timeline_size: events kept for ``timeline()``.
        loader_threads: threads ``acquire`` uses in async code to wait for a load.
        on_event: called with each timeline record (``timeline()`` keys) as it is made, under
            the cache's lock: keep it short, never call the cache from it, never raise.
        on_execution: set as every host's ``ModelHost.on_execution``.

    Raises:
        ConfigError: a pipeline model among ``names``.
        ModelNotFound: a name the repository does not hold.
    """

    def __init__(self, repository: ModelRepository, names: Iterable[str] | None = None,
                 options: CacheOptions = CacheOptions(), *, backend: str = "auto",
                 measure_elements: int | None = footprints.MEASURE_INPUT_ELEMENTS,
                 footprints: Mapping[str, Footprint] | None = None, checkout_timeout_s: float = 30.0,
                 timeline_size: int = 1000, loader_threads: int = 8,
                 on_event: Callable[[dict[str, Any]], None] | None = None,
                 on_execution: Callable[[str, int, int, float], None] | None = None) -> None:
        entries = ([repository.get(n) for n in names] if names is not None
                   else [e for e in repository.entries() if not e.config.pipeline])
        pipelines = [e.name for e in entries if e.config.pipeline]
        if pipelines:
            raise ConfigError(f"pipeline models {pipelines} have no engine to cache")
        self.options = options
        self.load_policy: str = options.load_policy
        self.budget_bytes = options.budget_bytes
        self.max_models = options.max_num_models_per_replica
        self.wait_timeout_s = options.wait_timeout_s
        self.measure_elements = measure_elements
        self._backend_request = backend
        self._given = dict(footprints or {})
        self._reported: dict[str, int] = {}  # bytes another replica measured (``prefetch``'s nbytes)
        self._gpu_fit: tuple[float, int] | None = None  # GPU bytes over the prediction: (ratio, excess)
        self._estimates: dict[tuple, int | None] = {}  # (model, its file) -> estimated_bytes
        self._checkout_timeout_s = checkout_timeout_s
        self._on_execution = on_execution
        self._slots = {key: _Slot(key, self._host(e.at(version))) for e in entries
                       for key, version in e.keys().items()}
        self._on_event = on_event
        self._cond = threading.Condition()
        self._resident_bytes = 0
        self._reserved_bytes = 0
        self._gpu_growth_bytes = 0
        self._tick = itertools.count(1)
        self._seq = itertools.count(1)
        self._events: deque[dict[str, Any]] = deque(maxlen=timeline_size)
        self._started = time.monotonic()
        self._closed = False
        self._stop = threading.Event()  # ends the GPU growth check's thread (``close``)
        self._growth_thread: threading.Thread | None = None  # started at the first GPU model
        self._executor = ThreadPoolExecutor(max_workers=loader_threads, thread_name_prefix="model-cache")

    # ---------------------------------------------------------------------------- public API

    @property
    def names(self) -> list[str]:
        return sorted(self._slots)

    def serves(self, name: str) -> bool:
        """True when ``name`` is a model of this cache that is not unloaded (``unload``)."""
        slot = self._slots.get(name)
        return slot is not None and slot.enabled

    def _host(self, entry: ModelEntry) -> ModelHost:
        if entry.config.pipeline:
            raise ConfigError(f"pipeline model '{entry.name}' has no engine to cache")
        host = ModelHost(entry, self._backend_request, self._checkout_timeout_s)
        host.on_execution = self._on_execution
        return host

    def add(self, entry: ModelEntry, enabled: bool = True) -> None:
        """Serve ``entry``'s served versions too (a model added to the repository after start), or
        take a model's re-read entry. A model that is loaded, loading or held keeps the entry it loaded with
        (unload it first); otherwise its next load uses ``entry``. ``enabled=False`` adds it
        unloaded (requests get ``ModelNotReady`` until ``load``).

        Raises:
            ConfigError: a pipeline model (no engine to cache).
        """
        for key, version in entry.keys().items():
            host = self._host(entry.at(version))
            with self._cond:
                slot = self._slots.get(key)
                if slot is None:
                    self._slots[key] = _Slot(key, host, enabled=enabled)
                elif slot.state == _ABSENT and not slot.refcount and not slot.enabled:
                    slot.host, slot.backend, slot.footprint, slot.footprint_source = host, "", None, ""
                    self._reported.pop(key, None)  # another replica's figure was of the file it replaces

    def load(self, name: str) -> None:
        """Serve ``name`` (again, after ``unload``) and load it now, as a first request would
        (evicting least-recently-used unheld models under ``lru``); blocks until it is ready.

        Raises: as ``acquire`` (``OverBudget``, ``ConfigError``, ``LoadFault``, ``InferenceError``...).
        """
        slot = self._slot(name)
        with self._cond:
            slot.enabled = True
        with self.acquire(name):
            pass

    @contextlib.contextmanager
    def replacing(self, names: Iterable[str]) -> Iterator[None]:
        """While inside, a load replaces the reading of ``names`` (unloaded, given a new entry with
        ``add``, loaded again: ``PoolDeployment._load_reading``): a request for one of them that
        finds it unloaded waits for the load instead of answering ``ModelNotReady``, then goes on
        with what serves when the block ends (``infer_async`` checks it against its request)."""
        slots = [self._slot(name) for name in names]
        with self._cond:
            for slot in slots:
                slot.replacing = True
        try:
            yield
        finally:
            with self._cond:
                for slot in slots:
                    slot.replacing = False
                self._cond.notify_all()

    def unload(self, name: str) -> None:
        """Stop serving ``name``: new requests get ``ModelNotReady`` at once; the requests that
        hold it (and a load in progress) finish first, as with an eviction; then it is unloaded
        (timeline event ``unload``). Blocks until it is gone; a model not loaded is only marked.
        """
        slot = self._slot(name)
        with self._cond:
            slot.enabled = False
            self._cond.wait_for(lambda: slot.refcount == 0 and slot.state in (_ABSENT, _READY))
            if slot.state == _ABSENT:
                return
            slot.state = _EVICTING
        with _LOAD_LOCK:
            self._evict_marked()

    def prefetch(self, name: str, nbytes: int | None = None) -> bool:
        """Load ``name`` now, without holding it (a replica about to receive its requests:
        ``placement: bytes``), only where it fits beside the models loaded now: a prefetch never
        evicts (placed models that do not fit together would evict each other in turn). Not
        when it is unloaded (``unload``: model control decides that) or already loaded; a
        model never loaded here counts by ``nbytes`` (what another replica measured), else by
        the bytes of the largest measured here so far. Blocking. Returns whether it loaded here.

        Raises: as ``acquire``.
        """
        slot = self._slot(name)
        with self._cond:
            if not slot.enabled or slot.state != _ABSENT:
                return False
            known = [s.footprint.total(s.host.config.instances) for s in self._slots.values() if s.footprint]
            need = (slot.footprint.total(slot.host.config.instances) if slot.footprint is not None
                    else nbytes if nbytes else max(known, default=0))
            loaded = sum(1 for s in self._slots.values() if s.state != _ABSENT)
            if ((self.budget_bytes is not None and self._resident_bytes + self._reserved_bytes + need > self.budget_bytes)
                    or (self.max_models is not None and loaded + 1 > self.max_models)):
                return False
            if slot.footprint is None and nbytes:
                self._reported[slot.name] = nbytes  # the load reserves what the fit was checked at
        cause = _LOAD_CAUSE.set("prefetch")
        try:
            with self.acquire(name):
                return True
        finally:
            _LOAD_CAUSE.reset(cause)

    def release(self, name: str) -> bool:
        """Give back ``name``'s memory (a replica that lost it to another: ``placement: bytes``),
        never while a request holds it: unheld and loaded, it is evicted now (timeline event
        ``evict``, detail ``released``); held or loading, it only becomes the first to evict
        when room is needed. It keeps serving: a request that still comes loads it again.
        Blocking. Returns whether it was evicted now."""
        slot = self._slot(name)
        with self._cond:
            slot.last_used = 0
            if slot.refcount or slot.state != _READY:
                return False
            slot.state, slot.evict_detail = _EVICTING, "released"
        with _LOAD_LOCK:
            self._evict_marked()
        return True

    def footprint_bytes(self, name: str) -> int | None:
        """``name``'s footprint as its last load here measured it (engine + instances x
        contexts, what it counts against the budget), kept after an eviction; for a model never
        resident here, the figure this process measured of its file (a model refused as alone
        over the budget was measured, then unloaded: ``footprints.measured_footprint``); None
        before any measurement."""
        slot = self._slot(name)
        with self._cond:
            footprint = slot.footprint
            if footprint is None and slot.backend:
                footprint = footprints.measured_footprint(slot.host.entry, slot.backend)
            return None if footprint is None else footprint.total(slot.host.config.instances)

    def estimated_bytes(self, name: str) -> int | None:
        """The bytes ``name``'s first load here would reserve (``footprint_bytes`` once it is
        measured): a figure given or recorded beside the model, else the graph prediction
        (``predict.predict``, read once per model file); None when that fails (its load will
        say why)."""
        slot = self._slot(name)
        key = (slot.name, str(slot.host.entry.onnx_path()))
        if key not in self._estimates:
            try:
                self._estimates[key] = self._estimate(slot)[0].total(slot.host.config.instances)
            except Exception as error:  # a model file the load refuses: no estimate, not a failed report
                logger.debug("model cache: no estimate of %s: %s", name, error)
                self._estimates[key] = None
        return self._estimates[key]

    @property
    def resident_bytes(self) -> int:
        """Sum of the footprints of the loaded models (bytes)."""
        return self._resident_bytes

    @property
    def gpu_growth_bytes(self) -> int:
        """This process's GPU bytes that no resident model's footprint covers, counted against the
        budget (module docstring); 0 on the CPU."""
        return self._gpu_growth_bytes

    def start(self) -> "ModelCache":
        """``eager``: load every model now, in name order; other policies: nothing. Returns self.

        Raises:
            OverBudget: the models do not fit ``budget_bytes`` / ``max_models`` together.
            ConfigError, LoadFault, InferenceError: a model failed to load.
        """
        if self.load_policy == "eager":
            for name in self.names:
                if not self._slots[name].enabled:
                    continue
                with self.acquire(name):
                    pass
        return self

    def check_gpu_growth(self) -> bool:
        """Read this process's GPU growth now (NVML) and, where it takes the accounting past the
        budget, evict least recently used unheld models until it fits (module docstring). Skipped
        while a load or eviction runs (that one reads it). Returns whether a reading was taken."""
        if not _LOAD_LOCK.acquire(blocking=False):
            return False
        try:
            return self._settle_gpu_growth()
        finally:
            _LOAD_LOCK.release()

    def _start_gpu_growth_check(self) -> None:
        """Start the thread of ``check_gpu_growth`` once, at the first model found to run on a GPU."""
        with self._cond:
            if self._growth_thread is not None or self._closed:
                return
            self._growth_thread = threading.Thread(target=self._check_gpu_growth_every,
                                                   name="model-cache-gpu-growth", daemon=True)
        self._growth_thread.start()

    def _check_gpu_growth_every(self) -> None:
        while not self._stop.wait(GPU_GROWTH_CHECK_S):
            try:
                self.check_gpu_growth()
            except Exception:  # a failed reading or unload is logged; the next second tries again
                logger.exception("model cache: GPU growth check failed")

    def acquire(self, name: str) -> "Lease":
        """Hold model ``name`` for one request: ``with cache.acquire(name) as host:`` or
        ``async with cache.acquire(name) as host:``; ``host`` is a loaded ``ModelHost``.

        Entering loads the model when needed (evicting others under ``lru``) and blocks until
        it is ready; the async form waits in a cache thread, never on the event loop. The
        model cannot be evicted until the block exits. Call ``host.infer`` inside the block
        (in async code through ``asyncio.to_thread``, or use ``infer_async``).

        Raises (on entering):
            ModelNotFound: ``name`` is not served by this cache.
            OverBudget: the model alone is over the budget, or no room was freed in time.
            ModelNotReady: the cache is closed, or a concurrent load of this model failed.
            ConfigError, LoadFault, InferenceError: this request's load of the model failed.
        """
        if name not in self._slots:
            raise unknown_model(name, f"this replica serves {self.names}")
        return Lease(self, name)

    def infer(self, name: str, inputs: Mapping[str, np.ndarray],
              outputs: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """Validate the request, acquire ``name``, run it (blocking) and release.

        The request is validated once, before any load: a malformed one never loads or
        evicts a model.

        Raises: ``InvalidInput`` (``validate_request``), as ``acquire`` and ``ModelHost.run``.
        """
        wanted = validate_request(self._slot(name).host.config, inputs, outputs)
        with self.acquire(name) as host:
            return host.run(inputs, wanted)

    async def infer_async(self, name: str, inputs: Mapping[str, np.ndarray],
                          outputs: Iterable[str] | None = None, version: int | None = None) -> dict[str, np.ndarray]:
        """Async ``infer``: the load wait and the run happen in threads (a short run of a loaded
        model in the caller's: ``ModelHost.runs_inline``). If the calling task is cancelled, the
        run still finishes in its thread and releases the model then.

        ``version``: the version the answer will be labelled with; the request runs only on that
        version's engine (``add`` may replace an unloaded entry while the request waits: a new
        version or config read at a load, ``replacing``), validated again where the entry it was
        validated against was replaced.

        Raises: as ``infer``; ``ModelNotReady`` when what serves now is another version than
        ``version`` (or than the replaced entry's, where ``version`` is None).
        """
        expected = self._slot(name).host
        wanted = validate_request(expected.config, inputs, outputs)
        host = await self._checkout_async(name)
        asked = version if version is not None else expected.version
        try:
            if host.version != asked:
                raise replaced_version(host.name, asked, f"version {host.version}")
            if host is not expected:  # the same version read again (a new config, or its file rewritten)
                wanted = validate_request(host.config, inputs, outputs)
        except BaseException:
            self._release(name)
            raise
        if host.runs_inline():  # a short run: the hop to a thread costs more (``ModelHost.runs_inline``)
            try:
                return host.run(inputs, wanted)
            finally:
                self._release(name)

        async def run() -> dict[str, np.ndarray]:
            try:  # in a worker thread or the context's own (``ModelHost.call``), the caller's context variables seen
                return await host.call(host.run, inputs, wanted)
            finally:
                self._release(name)

        return await asyncio.shield(run())

    def timeline(self) -> list[dict[str, Any]]:
        """The cache's events, oldest first, as JSON-ready dicts (for an HTTP endpoint).

        Keys: ``seq``; ``t_s`` (seconds since the cache was made); ``unix_time``; ``event``
        (``load``, ``reload`` (a load after an eviction), ``evict``, ``unload`` (asked for: ``unload``), ``refused``); ``model``;
        ``ms`` (duration of the load or eviction, 0 for a refusal; a load's without its warmup);
        ``warmup_ms`` (a load's warmup runs, the config's ``warmup:``; else 0); ``model_bytes`` (its
        footprint); ``footprint_source`` (``measured``, ``given``, ``reported``, ``recorded``, ``predicted``);
        ``resident_bytes`` (all models' footprints after the event); ``resident_models``;
        ``budget_bytes``; ``max_models``; ``process_rss_bytes`` (the process's resident set
        after the event, for comparison); ``process_gpu_bytes`` and ``gpu_source`` (models on a
        GPU backend: this process's GPU bytes, ``backends.gpu_memory.process_gpu_bytes``);
        ``gpu_over_baseline_bytes`` (that reading less the process's bytes before any model:
        what the budget bounds); ``gpu_growth_bytes`` (the part of it no resident footprint
        covers, counted against the budget; taken at evictions, so a load event carries the value
        of the last eviction); ``detail`` (refusals: the message).
        """
        with self._cond:
            return [dict(e) for e in self._events]

    def status(self) -> dict[str, Any]:
        """A JSON-ready snapshot: policy, limits, resident and reserved bytes, the GPU growth
        counted against the budget (``gpu_growth_bytes``, see the module docstring), and per model
        its state (``absent``, ``loading``, ``ready``, ``evicting``), bytes, holders, loads, evictions,
        the source of its footprint and, when its measuring runs failed, why (``footprint_detail``),
        and why its last load failed where a new try would fail alike (``load_error``: its model
        file, config or backend at fault; empty once a load succeeds)."""
        with self._cond:
            return {
                "load_policy": self.load_policy, "budget_bytes": self.budget_bytes,
                "max_models": self.max_models, "resident_bytes": self._resident_bytes,
                "reserved_bytes": self._reserved_bytes, "gpu_growth_bytes": self._gpu_growth_bytes,
                "models": {s.name: {"state": s.state, "enabled": s.enabled, "bytes": s.bytes, "in_use": s.refcount,
                                    "loads": s.loads, "evictions": s.evictions,
                                    "footprint_source": s.footprint_source, "backend": s.backend,
                                    "footprint_detail": self._footprint_detail(s), "load_error": s.load_error,
                                    "backend_reason": s.host.backend_reason if s.host.ready else "",
                                    "cuda_graphs": s.host.cuda_graphs(),
                                    "device": s.footprint.device if s.footprint is not None else ""}
                           for s in sorted(self._slots.values(), key=lambda s: s.name)},
            }

    @staticmethod
    def _footprint_detail(slot: _Slot) -> str:
        """Why a loaded model's footprint is the graph prediction: its measuring runs failed
        (``footprints.measurement_failure``); empty otherwise."""
        if slot.footprint_source != "predicted" or not slot.backend:
            return ""
        return footprints.measurement_failure(slot.host.entry, slot.backend) or ""

    def check_health(self) -> None:
        """Probe every loaded model's engine (``ModelHost.check_health``); a cache with nothing
        loaded is healthy.

        Raises:
            EngineFault: a loaded model's engine or device can no longer run requests.
        """
        with self._cond:
            hosts = [s.host for s in self._slots.values() if s.state == _READY]
        for host in hosts:
            try:
                host.check_health()
            except ModelNotReady:  # an eviction unloaded it since the list was made: nothing to probe
                continue

    def resident(self) -> list[str]:
        """Names of the loaded models, least recently used first."""
        with self._cond:
            return [s.name for s in sorted(self._slots.values(), key=lambda s: s.last_used)
                    if s.state in (_READY, _EVICTING)]

    def close(self) -> None:
        """Refuse new requests, wait for held models to be released, unload everything."""
        self._stop.set()
        with self._cond:
            self._closed = True
            self._cond.notify_all()  # requests waiting for a load that replaces a reading end
            self._cond.wait_for(lambda: all(s.refcount == 0 and s.state != _LOADING for s in self._slots.values()))
            for s in self._slots.values():
                if s.state == _READY:
                    s.state = _EVICTING
        with _LOAD_LOCK:
            self._evict_marked()
        self._executor.shutdown(wait=False)

    # ---------------------------------------------------------------------------- checkout

    def _slot(self, name: str) -> _Slot:
        slot = self._slots.get(name)
        if slot is None:
            raise unknown_model(name, f"this replica serves {self.names}")
        return slot

    def _try_checkout(self, name: str) -> ModelHost | None:
        """Take a reference without blocking when the model is loaded; else None."""
        slot = self._slot(name)
        with self._cond:
            if slot.state == _READY and slot.enabled and not self._closed:
                slot.refcount += 1
                slot.last_used = next(self._tick)
                return slot.host
        return None

    def _checkout(self, name: str) -> ModelHost:
        """Take a reference, loading the model first when needed (blocking)."""
        slot = self._slot(name)
        deadline = time.monotonic() + self.wait_timeout_s
        with self._cond:
            while True:
                if self._closed:
                    raise ModelNotReady(f"model '{slot.host.name}': the model cache is closed")
                if not slot.enabled:
                    if slot.replacing:  # a load is replacing its reading: wait for it
                        self._cond.wait_for(lambda: not slot.replacing or slot.enabled or self._closed)
                        continue
                    raise unloaded_model(slot.host.name)  # the model's name, not its cache key (``m@1``)
                if slot.state == _READY:
                    slot.refcount += 1
                    slot.last_used = next(self._tick)
                    return slot.host
                if slot.state == _LOADING:
                    joined = slot.flight
                    assert joined is not None
                    joined.holders += 1
                    self._cond.wait_for(lambda: joined.done)
                    if joined.error is not None:
                        raise _shared_error(joined.error, slot.host.name)
                    return slot.host  # the loader took our reference
                if slot.state == _EVICTING:
                    self._cond.wait_for(lambda: slot.state != _EVICTING)
                    continue
                flight = _Flight()
                slot.state, slot.flight = _LOADING, flight
                break
        try:
            self._load(slot, flight, deadline)
        except BaseException as error:
            with self._cond:
                slot.state, slot.flight = _ABSENT, None
                flight.error, flight.done = error, True
                if _fails_every_load(error):
                    slot.load_error = error.message  # type: ignore[attr-defined]
                self._cond.notify_all()
            if isinstance(error, InvalidModelFile):
                slot.host.file_refused()  # never loaded from that file: a repaired one may (``ModelHost._check_file``)
            raise
        slot.load_error = ""
        return slot.host

    async def _checkout_async(self, name: str) -> ModelHost:
        host = self._try_checkout(name)
        if host is not None:
            return host
        future = asyncio.get_running_loop().run_in_executor(self._executor, self._checkout, name)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            # The checkout goes on in its thread; give its reference back when it lands.
            future.add_done_callback(
                lambda f: self._release(name) if not f.cancelled() and f.exception() is None else None)
            raise

    def _release(self, name: str) -> None:
        slot = self._slots[name]
        with self._cond:
            slot.refcount -= 1
            slot.last_used = next(self._tick)
            if slot.refcount == 0:
                self._cond.notify_all()

    # ---------------------------------------------------------------------------- loading

    def _estimate(self, slot: _Slot) -> tuple[Footprint, str]:
        entry = slot.host.entry
        if not slot.backend:
            slot.backend = resolve_backend(requested_backend(entry.config, self._backend_request))
            if slot.backend in GPU_BACKENDS and self.budget_bytes is not None:
                self._start_gpu_growth_check()
        backend = slot.backend
        known = footprints.measured_footprint(entry, backend)
        if known is not None:
            if self._measure_again(slot, known):
                return predict(entry).footprint(), "predicted"
            return known, "measured"
        if slot.name in self._given:
            return self._given[slot.name], "given"
        if slot.name in self._reported:
            instances = slot.host.config.instances
            return Footprint(engine_bytes=0, context_bytes=-(-self._reported[slot.name] // instances),
                             device="gpu" if backend in GPU_BACKENDS else "host"), "reported"
        recorded = footprints.read_record(entry, backend)
        if recorded is not None:
            return recorded, "recorded"
        return predict(entry).footprint(), "predicted"

    def _measure_again(self, slot: _Slot, measured: Footprint) -> bool:
        """Whether ``slot``'s ``measured`` footprint, alone over the whole budget, is taken again
        before the model is refused: a reading can carry RSS that other requests of the replica
        allocated meanwhile (it only adds; seen right after start: tiny_cnn read at 3,155 MiB,
        then 981 MiB); the smaller reading of each part is kept, at most ``MAX_MEASUREMENTS``."""
        return (self.budget_bytes is not None and measured.total(slot.host.config.instances) > self.budget_bytes
                and footprints.measurement_count(slot.host.entry, slot.backend) < MAX_MEASUREMENTS)

    def _load(self, slot: _Slot, flight: _Flight, deadline: float) -> None:
        """Make room, load and measure ``slot``'s model, then publish it (state ready, the
        flight's holders as references). Runs in the loading request's thread.

        The real footprint is known only once the model is loaded. When it is larger than the
        reservation, the extra is reserved at once, still under the load lock (evicting unheld
        models), so no other load starts beside an under-reserved model; when it does not fit
        now, the model is unloaded again and its load starts over with the real figure, waiting
        for room like any load (until ``deadline``).

        A model never measured whose prediction (on a GPU, ``_gpu_first_reservation``) alone is
        over the budget reserves only the room free now, evicting nothing: it is measured
        there, refused (``OverBudget``) if its real figure is over the budget too, else grows
        its reservation as above."""
        instances = slot.host.config.instances
        estimate, source = self._estimate(slot)
        while True:
            if source != "predicted":
                self._refuse_if_alone_over_budget(slot, estimate, source)
            need = estimate.total(instances)
            if source == "predicted" and slot.backend in GPU_BACKENDS and self.budget_bytes is not None:
                if self.budget_bytes - self._growth_for(slot) <= 0:
                    self._refuse_if_alone_over_budget(slot, estimate, source)
                need = self._gpu_first_reservation(slot, need)
            # predicted not to fit at all: measured in the room free now, evicting nothing
            unfit = (source == "predicted" and self.budget_bytes is not None
                     and need + self._growth_for(slot) > self.budget_bytes)
            reserved = self._reserve(slot, None if unfit else need, deadline, adds_model=True,
                                     predicted=source == "predicted")
            try:
                with _LOAD_LOCK:
                    self._evict_marked()
                    self._settle_gpu_growth(slot)  # growth since the last reading, before this model adds to it
                    start = time.perf_counter()
                    predicted = estimate.total(instances) if source == "predicted" else 0
                    if not predicted and self._gpu_fit is None and slot.backend in GPU_BACKENDS:
                        # loads by a known figure (a prefetch's reported bytes, a measured reload)
                        # teach the fit too: else the first predicted load after them reserves the whole budget
                        try:
                            predicted = predict(slot.host.entry).footprint().total(instances)
                        except Exception:  # a graph the prediction cannot read: nothing learned
                            predicted = 0
                    footprint, source = self._load_host(slot, estimate, source)
                    load_ms = (time.perf_counter() - start) * 1e3
                    actual = footprint.total(instances)
                    if predicted and footprint.device == "gpu" and footprint.measured:
                        self._learn_gpu_fit(predicted, actual)
                    fits = actual <= reserved or self._grow_reservation(slot, actual - reserved)
                    if fits:
                        reserved = max(reserved, actual)
                        self._evict_marked()
                        self._settle_gpu_growth(slot, actual)  # what the load grew beyond its figure
                    else:
                        slot.host.unload()
            except BaseException:
                self._give_back(slot, reserved)
                if slot.host.ready:
                    with _LOAD_LOCK:
                        slot.host.unload()
                raise
            if fits:
                break
            logger.info("model cache: %s needs %s, not the %s reserved, and no room is free now; "
                        "unloaded, loading again with its real figure", slot.name, format_mib(actual), format_mib(reserved))
            self._give_back(slot, reserved)
            estimate = footprint
            if source == "predicted":  # its measuring runs failed: the prediction is all there is to go by
                self._refuse_if_alone_over_budget(slot, footprint, source)
            if source == "measured" and self._measure_again(slot, footprint):
                estimate, source = predict(slot.host.entry).footprint(), "predicted"
        with self._cond:
            self._reserved_bytes -= reserved
            self._resident_bytes += actual
            slot.bytes, slot.footprint, slot.footprint_source = actual, footprint, source
            slot.state, slot.flight = _READY, None
            slot.refcount += flight.holders
            slot.last_used = next(self._tick)
            slot.loads += 1
            flight.done = True
            warmup_ms = slot.host.warmup_ms
            self._record("reload" if slot.evictions else "load", slot, load_ms - warmup_ms, detail=_LOAD_CAUSE.get(),
                         warmup_ms=warmup_ms)
            self._cond.notify_all()

    def _load_host(self, slot: _Slot, estimate: Footprint, source: str) -> tuple[Footprint, str]:
        """Load ``slot``'s host (the load lock is held) and return its real footprint and source:
        a GPU backend's own figure (TensorRT exact, CUDA provider measured); on ONNX Runtime the measurement for a predicted model, else
        ``estimate`` (a measured, given or recorded figure)."""
        if source == "predicted":
            # The measuring runs serve no request: keep them out of execution counts.
            counter, slot.host.on_execution = slot.host.on_execution, None
            try:
                footprint = footprints.load_and_measure(slot.host, self.measure_elements)
                return footprint, "measured" if footprint.measured else "predicted"
            finally:
                slot.host.on_execution = counter
        slot.host.load()
        engine = slot.host.engine
        if engine is not None and engine.backend in GPU_BACKENDS:  # they measure their own, at load
            return slot.host.footprint(), "measured"
        return estimate, source

    def _gpu_first_reservation(self, slot: _Slot, predicted: int) -> int:
        """What a GPU model's first load reserves when only the graph prediction is known
        (``predicted`` bytes, host-side). The GPU holds more (each context's session, cuDNN and
        cuBLAS handles and workspaces, the arena's rounding) and a load overshooting its
        reservation takes the replica over its budget until the evictions after it (seen on
        the H200: +10 MB). Before any model is measured here: the whole budget less the GPU
        growth (everything else is evicted), or the prediction where that is more. After: the
        prediction scaled by the largest ratio of GPU bytes to prediction seen on this replica,
        or raised by the largest excess, whichever is more (a small model's fixed per-context
        cost makes its ratio the larger, a large one's activations its excess). Not capped: a
        figure over the whole budget says the model is not expected to fit, and ``_load`` then
        evicts nothing to measure it."""
        whole = self.budget_bytes - self._growth_for(slot)
        with self._cond:
            fit = self._gpu_fit
        if fit is None:
            return max(whole, predicted)
        ratio, excess = fit
        return max(int(predicted * ratio), predicted + excess)

    def _learn_gpu_fit(self, predicted: int, actual: int) -> None:
        """Keep the largest ratio and excess of a first load's ``actual`` GPU bytes over its graph
        prediction (``predicted``), for ``_gpu_first_reservation``."""
        if predicted <= 0:
            return
        with self._cond:
            ratio, excess = self._gpu_fit or (0.0, 0)
            self._gpu_fit = (max(ratio, actual / predicted), max(excess, actual - predicted))

    def _grow_reservation(self, slot: _Slot, extra: int) -> bool:
        """Reserve ``extra`` more bytes for ``slot`` now, marking unheld models for eviction
        (``lru``); False, reserving nothing, when that is not enough. Never waits."""
        with self._cond:
            victims = self._plan(slot, extra, adds_model=False)
            if victims is None:
                return False
            for victim in victims:
                victim.state = _EVICTING
            self._reserved_bytes += extra
            return True

    def _give_back(self, slot: _Slot, reserved: int) -> None:
        """Return a load's reservation (bytes and its place under ``max_models``)."""
        with self._cond:
            self._reserved_bytes -= reserved
            if slot.flight is not None:
                slot.flight.counted = False
            self._cond.notify_all()

    def _refuse_if_alone_over_budget(self, slot: _Slot, footprint: Footprint, source: str) -> None:
        if self.budget_bytes is None:
            return
        instances = slot.host.config.instances
        need = footprint.total(instances)
        growth = self._growth_for(slot)
        if need + growth <= self.budget_bytes:
            return
        held = f" less the {format_mib(growth)} of GPU growth no model accounts for" if growth else ""
        message = (f"model '{slot.name}' needs {format_mib(need)} ({source}: engine {format_mib(footprint.engine_bytes)} + "
                   f"{instances} x context {format_mib(footprint.context_bytes)}), more than this replica's "
                   f"memory budget of {format_mib(self.budget_bytes)}{held}")
        with self._cond:
            self._record("refused", slot, 0.0, detail=message, model_bytes=need)
        raise OverBudget(message)

    def _reserve(self, slot: _Slot, need: int | None, deadline: float, adds_model: bool,
                 predicted: bool = False) -> int:
        """Reserve ``need`` bytes for ``slot``: mark least-recently-used unheld models for
        eviction when that makes it fit (``lru``), else wait (``lru``, until ``deadline``) or
        refuse. The marked models are unloaded by the next holder of the load lock. ``need``
        None: only the bytes free now under the budget, evicting nothing for bytes (the count
        cap still applies). ``predicted``: ``need`` is a prediction, which becomes None once it
        and the GPU growth (read again meanwhile) no longer fit the budget together: a whole-budget
        first reservation made before the growth rose would otherwise wait for room no eviction
        can make. Returns the bytes reserved."""
        with self._cond:
            while True:
                if (predicted and need is not None and self.budget_bytes is not None
                        and need + self._growth_for(slot) > self.budget_bytes):
                    need = None
                if need is None:
                    assert self.budget_bytes is not None
                    amount = max(0, self.budget_bytes - self._used_bytes(slot))
                else:
                    amount = need
                victims = self._plan(slot, amount, adds_model)
                if victims is not None:
                    for victim in victims:
                        victim.state = _EVICTING
                    self._reserved_bytes += amount
                    if adds_model and slot.flight is not None:
                        slot.flight.counted = True
                    return amount
                remaining = deadline - time.monotonic()
                if self.load_policy != "lru" or remaining <= 0:
                    message = self._no_room_message(slot, amount, waited=self.load_policy == "lru")
                    self._record("refused", slot, 0.0, detail=message, model_bytes=amount)
                    raise OverBudget(message)
                self._cond.wait(remaining)

    def _plan(self, slot: _Slot | None, need: int, adds_model: bool) -> list[_Slot] | None:
        """Models to evict so that ``need`` more bytes (and one more model) fit; [] when it fits
        now, None when even evicting every unheld model (``lru``) is not enough."""
        used = self._used_bytes(slot)
        # Loads still waiting for room hold no place yet: counting them would make a burst of
        # first requests for more models than the cap wait on each other.
        count = sum(1 for s in self._slots.values() if s is not slot and (
            s.state == _READY or (s.state == _LOADING and s.flight is not None and s.flight.counted)))
        count += 1  # the model being loaded

        def fits() -> bool:
            return ((self.budget_bytes is None or used + need <= self.budget_bytes)
                    and (not adds_model or self.max_models is None or count <= self.max_models))

        if fits():
            return []
        if self.load_policy != "lru":
            return None
        victims = []
        for candidate in sorted(self._slots.values(), key=lambda s: s.last_used):
            if candidate is slot or candidate.state != _READY or candidate.refcount:
                continue
            victims.append(candidate)
            used -= candidate.bytes
            count -= 1
            if fits():
                return victims
        return None

    def _used_bytes(self, slot: _Slot | None) -> int:
        """The bytes counted against the budget for a load of ``slot`` (``self._cond`` is
        held): resident models not marked for eviction, loads' reservations, the GPU growth."""
        pending = sum(s.bytes for s in self._slots.values() if s.state == _EVICTING)
        return self._resident_bytes - pending + self._reserved_bytes + self._growth_for(slot)

    def _no_room_message(self, slot: _Slot, need: int, waited: bool) -> str:
        held = [s for s in self._slots.values() if s.state == _READY and s.refcount]
        held_text = ", ".join(f"{s.name} ({format_mib(s.bytes)}, {s.refcount} in use)" for s in held) or "none"
        limits = []
        if self.budget_bytes is not None:
            growth = f", {format_mib(self._growth_for(slot))} of GPU growth" if self._growth_for(slot) else ""
            limits.append(f"budget {format_mib(self.budget_bytes)}, {format_mib(self._resident_bytes)} resident, "
                          f"{format_mib(self._reserved_bytes)} reserved by loads in progress{growth}")
        if self.max_models is not None:
            limits.append(f"at most {self.max_models} models")
        wait = (f" after waiting {self.wait_timeout_s:g} s for models in use to be released" if waited
                else f" ({self.load_policy} policy never evicts)")
        return (f"model '{slot.name}' needs {format_mib(need)} but there is no room{wait}: {'; '.join(limits)}; "
                f"in use: {held_text}")

    def _evict_marked(self) -> None:
        """Unload every model marked for eviction (the load lock is held)."""
        while True:
            with self._cond:
                slot = next((s for s in self._slots.values() if s.state == _EVICTING), None)
                if slot is None:
                    return
            start = time.perf_counter()
            slot.host.unload()
            ms = (time.perf_counter() - start) * 1e3
            with self._cond:
                self._resident_bytes -= slot.bytes
                model_bytes, slot.bytes = slot.bytes, 0
                slot.state = _ABSENT
                slot.evictions += slot.enabled  # an unload is asked for, not an eviction
                detail, slot.evict_detail = slot.evict_detail, ""
                self._record("evict" if slot.enabled else "unload", slot, ms, detail=detail, model_bytes=model_bytes)
                self._cond.notify_all()

    # ---------------------------------------------------------------------------- timeline

    def _record(self, event: str, slot: _Slot, ms: float, detail: str = "", model_bytes: int | None = None,
                warmup_ms: float = 0.0) -> None:
        """Append one event (``self._cond`` is held) and log it."""
        resident = sorted(s.name for s in self._slots.values() if s.state in (_READY, _EVICTING) and s.bytes)
        model_bytes = slot.bytes if model_bytes is None else model_bytes
        record: dict[str, Any] = {
            "seq": next(self._seq), "t_s": round(time.monotonic() - self._started, 6), "unix_time": time.time(),
            "event": event, "model": slot.name, "ms": round(ms, 3), "warmup_ms": round(warmup_ms, 3),
            "model_bytes": model_bytes,
            "footprint_source": slot.footprint_source, "resident_bytes": self._resident_bytes,
            "resident_models": resident, "budget_bytes": self.budget_bytes, "max_models": self.max_models,
            "process_rss_bytes": process_rss_bytes(), "detail": detail,
        }
        if slot.backend in GPU_BACKENDS:  # the per-process GPU reading beside the accounting
            reading = process_gpu_bytes()
            record["process_gpu_bytes"], record["gpu_source"] = reading.bytes, reading.source
            if gpu_memory.baseline is not None:  # the models' share: over the CUDA context's bytes
                record["gpu_over_baseline_bytes"] = reading.bytes - gpu_memory.baseline.bytes
                if event in ("evict", "unload"):
                    self._note_gpu_growth(reading)
        record["gpu_growth_bytes"] = self._gpu_growth_bytes
        self._events.append(record)
        if self._on_event is not None:
            self._on_event(record)
        budget = format_mib(self.budget_bytes) if self.budget_bytes is not None else "no budget"
        if event == "refused":
            logger.warning("model cache: refused %s: %s", slot.name, detail)
        else:
            warmup = f" + warmup {warmup_ms:.1f} ms" if warmup_ms else ""
            logger.info("model cache: %s %s in %.1f ms%s (%s); resident %s of %s: %s", event, slot.name, ms, warmup,
                        format_mib(model_bytes), format_mib(self._resident_bytes), budget, ", ".join(resident))

    def _growth_for(self, slot: _Slot | None) -> int:
        """The GPU growth a load of ``slot`` must leave room for: ``gpu_growth_bytes`` for a
        model on a GPU backend (or ``slot`` None: the cache as a whole), 0 for one on the CPU
        (its footprint is host memory)."""
        return self._gpu_growth_bytes if slot is None or slot.backend in GPU_BACKENDS else 0

    def _note_gpu_growth(self, reading: GpuReading, loading: _Slot | None = None, loaded_bytes: int = 0) -> bool:
        """Set ``gpu_growth_bytes`` from ``reading`` (``self._cond`` and the load lock are held,
        so no other load or unload runs): the reading over the baseline less the footprints of
        the GPU models resident or not yet unloaded, and ``loaded_bytes`` for ``loading`` (a
        model loaded and measured by the caller, not yet published). Per-process readings only.
        Skipped while another loaded model awaits publication (its bytes are on the GPU but in
        no footprint yet), so that they are not counted as growth. Returns whether it was set."""
        baseline = gpu_memory.baseline
        if baseline is None or reading.source != "nvml-process" or baseline.source != "nvml-process":
            return False
        if any(s.state == _LOADING and s.host.ready and s is not loading for s in self._slots.values()):
            return False
        counted = sum(s.bytes for s in self._slots.values()
                      if s.backend in GPU_BACKENDS and s.state in (_READY, _EVICTING))
        if loading is not None and loading.host.ready:
            counted += loaded_bytes
        self._gpu_growth_bytes = max(0, reading.bytes - baseline.bytes - counted)
        return True

    def _settle_gpu_growth(self, loading: _Slot | None = None, loaded_bytes: int = 0) -> bool:
        """Read the GPU growth now (the load lock is held; ``loading``: the model this thread is
        loading, ``loaded_bytes`` its figure once loaded) and, when the accounting is then past
        the budget, evict least recently used unheld models until it fits (never ``loading``;
        where every other model is held it stays over and the next reading tries again).
        Nothing to do without a budget or a GPU model. Returns whether a reading was taken."""
        if self.budget_bytes is None or gpu_memory.baseline is None:
            return False
        if loading is not None and loading.backend not in GPU_BACKENDS:
            return False
        if loading is None and not any(s.backend in GPU_BACKENDS and s.state == _READY for s in self._slots.values()):
            return False
        reading = process_gpu_bytes()
        with self._cond:
            if not self._note_gpu_growth(reading, loading, loaded_bytes):
                return False
            over = self._used_bytes(loading) - self.budget_bytes
            if over <= 0:
                return True
            victims = self._plan(loading, 0, adds_model=False)
            if victims is None:  # every other model is held: evict what is free, the rest waits
                victims = [s for s in self._slots.values() if s is not loading and s.state == _READY and not s.refcount]
            logger.warning("model cache: GPU growth %s takes the accounting %s past the budget; evicting %s",
                           format_mib(self._gpu_growth_bytes), format_mib(over), [v.name for v in victims] or "nothing (all held)")
            for victim in victims:
                victim.state, victim.evict_detail = _EVICTING, f"GPU growth {format_mib(self._gpu_growth_bytes)}"
        self._evict_marked()
        return True


def _shared_error(error: BaseException, name: str) -> BaseException:
    """The error a request that waited on another request's load gets."""
    if isinstance(error, ServingError):
        return type(error)(error.message)
    return ModelNotReady(f"model '{name}' failed to load")


class Lease:
    """A request's hold on one model: a sync and async context manager yielding the ``ModelHost``."""

    def __init__(self, cache: ModelCache, name: str) -> None:
        self._cache = cache
        self.name = name
        self._held = False

    def __enter__(self) -> ModelHost:
        host = self._cache._checkout(self.name)
        self._held = True
        return host

    def __exit__(self, *exc: object) -> None:
        if self._held:
            self._held = False
            self._cache._release(self.name)

    async def __aenter__(self) -> ModelHost:
        host = await self._cache._checkout_async(self.name)
        self._held = True
        return host

    async def __aexit__(self, *exc: object) -> None:
        self.__exit__()
