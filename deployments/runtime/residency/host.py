"""ModelHost: one loaded model in a replica, its engine and a pool of execution contexts."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from ..backends.base import GPU_BACKENDS, Engine, ExecutionContext, Footprint
from ..backends.context_thread import ContextThread
from ..backends.select import open_engine
from ..contract.datatypes import zeros
from ..contract.device import device_io, device_targets, refuse_device_io, takes_device_io
from ..contract.errors import (ConfigError, InferenceError, InferenceTimeout, InvalidInput, InvalidModelFile,
                               ModelNotReady, refused_by_the_model)
from ..contract.graph_checks import GraphChecks
from ..contract.files import shown_model_file
from ..contract.repository import ModelEntry, local_file_identity
from ..contract.reshape import Reshape, engine_config
from ..contract.validation import validate_request
from .warmup import warmup_requests, warmup_shape

logger = logging.getLogger(__name__)
RECENT_WEIGHT = 0.1  # of each run in ``ModelHost.recent_run_s``: about the last 10 runs count
# A request of a model whose recent runs took at most this long runs in the event loop's own thread
# (``ModelHost.runs_inline``): the hop to a worker thread and back cost a replica more CPU than
# that (docs/performance.md, "A replica's CPU per request by stage").
INLINE_RUN_S = float(os.environ.get("TRT_SERVE_INLINE_RUN_US", "200")) * 1e-6


class ModelHost:
    """Owns an ``Engine`` and ``config.instances`` execution contexts; one request per context.

    ``infer`` blocks the calling thread: call it from a worker thread in async code, or in the
    event loop's thread where ``runs_inline()`` says the run is short and cannot wait. Requests
    beyond the pool size wait up to ``checkout_timeout_s`` for a free context, first come first
    served: a context that comes free goes to the longest waiting request, never to one that
    arrives meanwhile (Python's ``Condition`` lets a newcomer take it while the woken waiter
    is still being scheduled, and the waiter then waits again at the back: ocr_cls, one
    context, 16 clients, groups of requests came back 0.3-1.1 s late at a median of 26 ms on
    the H200 machine and 0.3-0.5 s late at 50 ms on 2 cores; docs/lab-notes.md,
    "Overload"). A request takes
    a free context whose previous run had the same input shapes when there is one, else the
    context free the longest: ONNX Runtime's CUDA provider rebuilds every convolution's cuDNN
    plan when a context's input shape changes from its previous run (``DynamicBatching``), so
    keeping shapes on their contexts saves that work where several shapes are in flight.
    ``in_flight`` counts requests that hold the model; ``unload`` waits for it to reach zero.
    ``on_execution``, when set, is called after every successful run with
    ``(name, version, rows, run_s)``: axis-0 rows (1 for a model without a batch axis) and the
    run's seconds (``time.perf_counter``), in the thread that ran it; it must not raise.
    ``recent_run_s`` is those seconds averaged over recent runs (exponentially, ``RECENT_WEIGHT``;
    None before the first; warmups are not runs): what a caller weighs to run a request in its
    own thread or hand it to another.
    Tensors with a ``reshape`` in the config run in the model's shape and are answered in the
    client's (``contract.reshape``): every run here, requests and warmups, goes through it.

    ``call`` is how async code runs blocking work that calls ``run`` (a request, a batch): the
    work waits in the same first-come queue as ``run``'s callers and then runs on a free
    context's own thread with that context bound to it, so a request crosses one thread boundary
    each way and no thread waits for a context. Every context has that thread: its backend's
    where it must run there (``context.thread``: ONNX Runtime keeps CUDA graphs per thread), else
    one the host starts at load and stops at unload.
    """

    def __init__(self, entry: ModelEntry, backend: str = "auto", checkout_timeout_s: float = 30.0) -> None:
        self.entry = entry
        self.config = entry.config
        self.version = entry.latest  # the newest served version (``ModelEntry.at`` picks one)
        self.backend_request = backend
        self.checkout_timeout_s = checkout_timeout_s
        self.engine: Engine | None = None
        self._contexts: list[ExecutionContext] = []
        self._threads: dict[int, ContextThread] = {}  # id(context) -> the thread its queued calls run on
        self._own_threads: list[ContextThread] = []  # those of ``_threads`` this host started (and stops)
        self._pinned = False  # a context must run on its thread (the backend's: CUDA graphs are per thread)
        self._free: list[ExecutionContext] = []  # longest free first
        self._last_shapes: dict[int, tuple] = {}  # id(context) -> input shapes of its last run
        self._slots = threading.RLock()  # guards _free, _last_shapes, _waiting
        # Requests waiting for a context, oldest first: each waits on its own condition (same lock).
        self._waiting: deque[threading.Condition] = deque()
        self._lock = threading.Condition()
        self._in_flight = 0
        self._unloading = False
        self._graph_checks = GraphChecks()  # the model file's (``load`` reads them)
        read = entry.file_identity(self.version)
        self._watch_file = read is not None and read.startswith("sha256:")  # a local file, its content's hash recorded
        self._file = read if self._watch_file else None  # the file this version serves (``_check_file``)
        self._served = False  # a load succeeded: answers were given from ``_file``
        self.load_ms: float | None = None  # engine and contexts, without the warmup runs
        self.warmup_ms = 0.0  # the config's warmup runs at the last load (``residency.warmup``)
        self.on_execution: Callable[[str, int, int, float], None] | None = None
        self.recent_run_s: float | None = None  # ``run``'s engine call, recent runs weighted (None: no run yet)
        self._reshape = Reshape.of(self.config)
        self._bound = threading.local()  # .context: the context a ``call`` bound to this thread

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def ready(self) -> bool:
        return self.engine is not None

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def runs_inline(self) -> bool:
        """Whether a request may run in the caller's own thread (an event loop's) rather than be
        handed to a worker thread: the model's recent runs took at most ``INLINE_RUN_S``
        (``recent_run_s``; the hop to a thread and back costs more CPU than such a run holds the
        loop), and no run is in flight nor work waiting, so every context is free and the checkout
        cannot wait. Never where a context must run on a thread of its backend's (``ContextThread``
        of a CUDA context with graphs): the run would hop to it anyway."""
        recent = self.recent_run_s
        return (recent is not None and recent <= INLINE_RUN_S and self._in_flight == 0 and not self._waiting
                and len(self._free) == len(self._contexts) and not self._pinned)

    def replayed_batches(self) -> frozenset[int | None]:
        """The batch sizes every loaded context replays as a captured CUDA graph
        (``onnxruntime_cuda.cuda_graphs``): a batch of one of these sizes rebuilds no cuDNN plan,
        so batches need no padding for its sake (``BatchPolicy.of``). Empty when not loaded or
        on a backend without graphs."""
        sets = [frozenset(getattr(c, "graph_batches", ())) for c in self._contexts]
        return frozenset.intersection(*sets) if sets else frozenset()

    def load(self) -> "ModelHost":
        """Load the engine, create the contexts and run the config's warmup requests on each
        (``residency.warmup``; ``load_ms`` and ``warmup_ms`` time the two apart) before the model
        counts as ready; idempotent; waits for an unload in progress. On failure, whatever was
        created is closed again. Returns self.

        Raises:
            ConfigError: the config disagrees with the model file or this machine.
            ConfigError: a warm-up run of the config's ``warmup:`` failed (the model refused it).
            LoadFault, DeviceOutOfMemory, EngineFault: the backend could not load the model.
        """
        with self._lock:
            self._lock.wait_for(lambda: not self._unloading)
            if self.engine is not None:
                return self
            start = time.perf_counter()
            model_file = self.entry.onnx_path(self.version)
            try:
                engine = open_engine(engine_config(self.config), model_file.parent, self.backend_request)
            except InvalidModelFile:
                self.file_refused()
                raise
            contexts: list[ExecutionContext] = []
            own_threads: list[ContextThread] = []
            try:
                # After the engine read it: a file that does not load says so first (a damaged
                # file is the client's 400, a missing one a LoadFault), one that loads must be
                # the one this version serves.
                file = self._check_file(model_file)
                checks = self._graph_checks = GraphChecks.read(model_file)
                for _ in range(self.config.instances):
                    contexts.append(engine.create_context())
                loaded = time.perf_counter()
                warmups = warmup_requests(self.config, self.entry.path)
                try:
                    warmups = [self._to_model(request) for request in warmups]
                    for request in warmups:  # every context, every size
                        checks.check(self.name, request)
                        for context in contexts:
                            context.infer(request)
                except (InvalidInput, InferenceError) as e:  # no client sent it: the config's warmup is at fault
                    if not refused_by_the_model(e):
                        raise
                    raise ConfigError(f"{self.entry.path / 'config.yaml'}: warmup: a warm-up run the model's config "
                                      f"asks for failed: {e.message}; change or remove its warmup section") from e
                # Every context gets a thread for the calls queued for it (``call``): its backend's
                # where it must run there, else one of the host's own.
                pinned = {id(c): c.thread for c in contexts if getattr(c, "thread", None) is not None}
                for c in contexts:
                    if id(c) not in pinned:
                        own_threads.append(ContextThread(f"ctx-{self.name}"))
            except BaseException:
                for thread in own_threads:
                    thread.stop()
                for c in contexts:
                    c.close()
                engine.close()
                raise
            with self._slots:  # every context last ran the last warmup request
                self._free = list(contexts)
                self._last_shapes = {id(c): _shapes(warmups[-1]) for c in contexts} if warmups else {}
                self._contexts = contexts
                self._own_threads = own_threads
                own = iter(own_threads)
                self._threads = {id(c): pinned.get(id(c)) or next(own) for c in contexts}
                self._pinned = bool(pinned)
                self._wake_next()
            self.engine = engine
            if file is not None:
                self._file = file  # what this version serves from now on, until a load reads the folder again
            self._served = True
            self.load_ms = (loaded - start) * 1e3
            self.warmup_ms = (time.perf_counter() - loaded) * 1e3 if warmups else 0.0
        logger.info("loaded model %s v%d (%s, %d contexts) in %.1f ms (warmup %.1f ms)",
                    self.name, self.version, engine.backend, len(contexts), self.load_ms, self.warmup_ms)
        return self

    def file_refused(self) -> None:
        """This version's model file does not load (``InvalidModelFile``, here or in a caller's
        look at it before the load): where it never loaded, nothing was served from it, so a
        repaired file takes its place at the next load (``_check_file``)."""
        if not self._watch_file or self._served or self._file is None:
            return
        if local_file_identity(self.entry.onnx_path(self.version)) == self._file:  # the very file the reading
            self._file = None  # saw (not one half-written since)

    def _check_file(self, model_file: Path) -> str | None:
        """``model_file``'s identity now (``local_file_identity``: its content's hash; None where
        this version's reading recorded none: an object store's file, an entry made by hand). Raises
        ModelNotReady (503) when it is not the file this version serves: the one the
        repository's reading saw (``ModelEntry.files``), or, once loaded, the one it loaded. A
        file replaced or written in place since is served only after a load reads the folder
        again (a new entry, a new host), so a version's answers never change under its label
        without one (a reload after an eviction, a replica that starts later). The exception: a
        reading whose file never loaded (``InvalidModelFile``: nothing was served from it) takes
        the repaired file at its next load (``file_refused``)."""
        if not self._watch_file:
            return None
        now = local_file_identity(model_file)
        if self._file is not None and now != self._file:
            raise ModelNotReady(
                f"model '{self.name}' version {self.version}: its model file {shown_model_file(model_file)} changed "
                f"on disk since the server read it, and a version's answers change only with a load: load the "
                f"model again (POST /v2/repository/models/{self.name}/load, model_control_mode: explicit) or "
                "restart the server to serve the new file; put a new model in a new version folder")
        return now

    def _loaded(self) -> Engine:
        if self.engine is None:
            raise ModelNotReady(f"model '{self.name}' is not loaded")
        return self.engine

    @property
    def backend(self) -> str:
        """``onnxruntime``, ``onnxruntime_cuda`` or ``tensorrt``. Raises ModelNotReady when not loaded."""
        return self._loaded().backend

    @property
    def backend_reason(self) -> str:
        """Why this backend serves the model (``backends.select.BackendChoice.reason``); empty for
        an engine made outside ``open_engine``. Raises ModelNotReady when not loaded."""
        choice = getattr(self._loaded(), "choice", None)
        return choice.reason if choice is not None else ""

    def footprint(self) -> Footprint:
        """Raises ModelNotReady when not loaded."""
        return self._loaded().footprint()

    def check_health(self) -> None:
        """The health probe a serving layer calls (Ray's ``check_health``). The probe counts as
        a request in flight, so an ``unload`` (an eviction) that starts meanwhile closes the
        engine only after it: a probe never runs on a closed engine (TensorRT's says "engine is
        closed", an ``EngineFault``, which would fail a healthy replica).

        Raises:
            ModelNotReady: not loaded.
            EngineFault: the engine or its device can no longer run requests (``Engine.check_health``).
        """
        with self._lock:
            engine = self._loaded()
            self._in_flight += 1
        try:
            engine.check_health()
        finally:
            with self._lock:
                self._in_flight -= 1
                self._lock.notify_all()

    def infer(self, inputs: Mapping[str, np.ndarray], outputs: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """Validate (``validate_request``), then ``run``.

        Args:
            inputs: input name -> array, shapes with batch axis when ``max_batch_size > 0``.
            outputs: names to return; all outputs when None.

        Raises:
            InvalidInput: inputs or requested outputs do not fit the config.
            ModelNotReady, InferenceTimeout, InferenceError: as ``run``.
        """
        return self.run(inputs, validate_request(self.config, inputs, outputs))

    def run(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Run inputs that were already validated against the config on a free execution
        context, after the checks its model file implies (``GraphChecks``: inputs sharing a
        named axis, indices into a table); returns the outputs named in ``outputs`` (all
        outputs when None).

        Callers that validated a request once (``ModelHost.infer``, ``ModelCache``, a batch of
        validated requests) use this; anything else calls ``infer``.

        Inputs (``DeviceTensor``) and outputs (``DeviceOutput`` names) in CUDA shared memory are
        passed to a backend that takes them (``contract.device.takes_device_io``: it runs on
        the GPU), which writes those outputs there and returns them as ``DeviceTensor``.

        Raises:
            InvalidInput: the inputs fail the model file's checks (``GraphChecks.check``), or
                the backend refused their values (the client's).
            SharedMemoryError: inputs or outputs in CUDA shared memory, and the backend runs on
                the CPU (the message names it).
            ModelNotReady: the model is not loaded.
            InferenceTimeout: no context became free within ``checkout_timeout_s``.
            InferenceError: the backend failed.
        """
        wanted = outputs if outputs is not None else [t.name for t in self.config.outputs]
        inputs = self._to_model(inputs)
        self._graph_checks.check(self.name, inputs)
        on_device = bool(device_io(inputs, wanted))
        with self._lock:
            if self.engine is None:
                raise ModelNotReady(f"model '{self.name}' is not loaded")
            if on_device and not takes_device_io(self.engine):
                refuse_device_io(inputs, wanted, f"this model runs on the {_device_of(self.engine)} here "
                                                 f"(backend {self.engine.backend})")
            self._in_flight += 1
        try:
            bound = getattr(self._bound, "context", None)  # this thread's own context (``call``)
            if bound is not None:
                with self._slots:
                    self._last_shapes[id(bound)] = _shapes(inputs)
            context = bound if bound is not None else self._checkout(_shapes(inputs))
            try:
                start = time.perf_counter()
                # a GPU backend takes inputs and outputs in CUDA shared memory (``contract.device``)
                result = context.infer(inputs, device_targets(wanted)) if on_device else (  # type: ignore[call-arg]
                    context.infer(inputs))
                run_s = time.perf_counter() - start
            finally:
                if bound is None:
                    self._check_in([context])
            # one float written under the GIL: a race between threads loses a sample, no more
            last = self.recent_run_s
            self.recent_run_s = run_s if last is None else last + RECENT_WEIGHT * (run_s - last)
            if self.on_execution is not None:
                self.on_execution(self.name, self.version, _rows(self.config.max_batch_size, inputs), run_s)
        finally:
            with self._lock:
                self._in_flight -= 1
                self._lock.notify_all()
        return self._to_client({name: result[name] for name in wanted})

    def _to_model(self, inputs: Mapping[str, Any]) -> Mapping[str, Any]:
        """``inputs`` in the model file's shapes (``Reshape.to_model``). Raises InvalidInput."""
        return inputs if self._reshape is None else self._reshape.to_model(inputs)

    def _to_client(self, outputs: dict[str, Any]) -> dict[str, Any]:
        """``outputs`` in the config's ``dims`` (``Reshape.to_client``). Raises InferenceError."""
        return outputs if self._reshape is None else self._reshape.to_client(outputs)

    def _checkout(self, shapes: tuple) -> ExecutionContext:
        """A free context, preferring one whose last run had ``shapes``; waits up to
        ``checkout_timeout_s``. Raises InferenceTimeout."""
        with self._slots:
            if not self._free or self._waiting:
                turn = threading.Condition(self._slots)
                self._waiting.append(turn)
                try:
                    served = turn.wait_for(lambda: self._free and self._waiting[0] is turn,
                                           timeout=self.checkout_timeout_s)
                finally:
                    self._waiting.remove(turn)
                if not served:
                    self._wake_next()  # a context may have come free for the next in line
                    raise self._no_context_free()
            context = next((c for c in self._free if self._last_shapes.get(id(c)) == shapes), self._free[0])
            self._free.remove(context)
            self._last_shapes[id(context)] = shapes
            self._wake_next()  # another context may still be free for the next in line
            return context

    def _check_in(self, contexts: Iterable[ExecutionContext]) -> None:
        """Give ``contexts`` back to the free list and wake the longest waiting request."""
        with self._slots:
            self._free.extend(c for c in contexts if c in self._contexts)  # not one an unload closed meanwhile
            self._wake_next()

    def _wake_next(self) -> None:
        """Serve the longest waiting request while a context is free (``self._slots`` held): wake
        a thread waiting in ``_checkout``, or start a ``call`` on the free context's thread."""
        while self._free and self._waiting:
            head = self._waiting[0]
            if not isinstance(head, _Call):
                head.notify()
                return
            context = self._free[0]
            self._threads[id(context)].submit(head.run, self, context)  # it checks the context in, later
            self._waiting.popleft()
            self._free.pop(0)

    def cuda_graphs(self) -> dict[str, Any] | None:
        """For ``/v2/memory``: ``{"batches": [...], "reason": ...}``, the batch sizes every
        context replays as a CUDA graph, and ``"on"`` or why the contexts run without
        (``graphs_reason``); None where the backend has no CUDA graphs or nothing is loaded."""
        contexts = list(self._contexts)
        if not contexts or not all(hasattr(c, "graphs_reason") for c in contexts):
            return None
        off = next((c.graphs_reason for c in contexts if not c.graphs), None)
        batches = self.replayed_batches()
        if off is None and None in batches:
            return {"batches": [], "reason": "on: the model's one shape (it has no batch axis)"}
        return {"batches": sorted(b for b in batches if b is not None), "reason": off or "on"}

    def threaded(self) -> bool:
        """Whether every context has a thread of its own (``call`` runs work there): while loaded."""
        return bool(self._threads)

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, blocking work that calls ``run`` (one request, a batch), off the event
        loop: on a free context's own thread with that context bound to ``run`` there, in the
        first-come order of every request waiting for a context; while nothing is loaded
        (``threaded`` False), in a worker thread (``asyncio.to_thread``: ``run`` answers
        ``ModelNotReady`` there). Either way ``fn`` sees the caller's context variables. Work
        still waiting when the caller goes away is dropped.

        Raises:
            InferenceTimeout: no context came free within ``checkout_timeout_s``.
            ModelNotReady: the model was unloaded while the work waited.
            Whatever ``fn`` raises.
        """
        if not self.threaded():
            return await asyncio.to_thread(fn, *args)
        loop = asyncio.get_running_loop()
        waiting = _Call(fn, args, contextvars.copy_context(), time.monotonic() + self.checkout_timeout_s, loop)
        with self._slots:
            if not self._contexts:  # unloaded since ``threaded`` was read
                raise ModelNotReady(f"model '{self.name}' is not loaded")
            self._waiting.append(waiting)
            self._wake_next()
            queued = bool(self._waiting) and self._waiting[-1] is waiting  # not handed to a free context at once
        # Only work left waiting needs its checkout timer (one handed over checks its deadline as it starts).
        timer = loop.call_later(self.checkout_timeout_s, self._expire, waiting) if queued else None
        try:
            return await waiting.future
        except asyncio.CancelledError:  # the future is cancelled with the caller: a run it reaches skips it
            self._drop(waiting)
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def _drop(self, waiting: "_Call") -> bool:
        """Take ``waiting`` out of the queue; False when it was no longer there (started or failed)."""
        with self._slots:
            if waiting in self._waiting:
                self._waiting.remove(waiting)
                return True
            return False

    def _expire(self, waiting: "_Call") -> None:
        """A ``call`` still queued after ``checkout_timeout_s`` fails as ``_checkout`` would (on
        the caller's loop: its timer)."""
        if self._drop(waiting) and not waiting.future.done():
            waiting.future.set_exception(self._no_context_free())

    def _no_context_free(self) -> InferenceTimeout:
        """The 504 of a request that waited ``checkout_timeout_s`` for a context (``_checkout``, ``call``)."""
        return InferenceTimeout(f"model '{self.name}': no execution context free within "
                                f"{self.checkout_timeout_s:g} s ({self.config.instances} instances)")

    def warm(self, shapes: Sequence[int | Mapping[str, Sequence[int]]]) -> None:
        """Run zeros once per entry of ``shapes``, spread over the contexts: entry ``j`` on
        context ``j % instances`` (with fewer entries than contexts, context ``i`` runs entry
        ``i % len(shapes)``), so every entry and every context runs, and each context last ran
        a different entry where there are enough (the first requests of those shapes find a
        context that last ran theirs). An entry is a batch size (other axes as the config's warmup has them,
        ``warmup.warmup_shape``) or a shape per input. Unlike the config's warmup (every size on
        every context, at load), this spreads the shapes over the contexts. Outputs are dropped.
        A run the model refuses (zeros are not valid input for it: ``InferenceError``,
        ``InvalidInput``) is logged and skipped: nobody asked for it.

        Raises:
            ModelNotReady: not loaded. InferenceTimeout: contexts stayed busy. EngineFault.
        """
        feeds = [self._to_model({spec.name: zeros(spec.datatype, warmup_shape(self.config, spec, shape)
                                                  if isinstance(shape, int) else tuple(shape[spec.name]))
                                 for spec in self.config.inputs})
                 for shape in shapes]
        with self._lock:
            if self.engine is None:
                raise ModelNotReady(f"model '{self.name}' is not loaded")
            self._in_flight += 1
        taken: list[ExecutionContext] = []
        try:
            for i in range(len(self._contexts) if feeds else 0):
                context = self._checkout(("warming", i))  # any free one: the key never matches
                taken.append(context)
                for feed in feeds[i::len(self._contexts)] or [feeds[i % len(feeds)]]:
                    try:
                        context.infer(feed)
                    except (InferenceError, InvalidInput) as e:
                        if not refused_by_the_model(e):
                            raise
                        # The model refused the server's own zeros (an integer Div by zero, a
                        # Reshape this size does not divide): no request asked for this run.
                        logger.warning("model '%s': warming shape %s on zeros failed (%s); skipped: the first "
                                       "request of that shape pays its first run", self.name, _shapes(feed), e.message)
                        continue
                    with self._slots:
                        self._last_shapes[id(context)] = _shapes(feed)
        finally:
            self._check_in(taken)
            with self._lock:
                self._in_flight -= 1
                self._lock.notify_all()

    def unload(self) -> None:
        """Wait for in-flight requests, then close contexts and the engine (in that order).
        New requests get ``ModelNotReady`` from the start; a ``load`` waits until this ends."""
        with self._lock:
            engine, self.engine = self.engine, None  # new requests now get ModelNotReady
            if engine is None:
                return
            self._unloading = True
            self._lock.wait_for(lambda: self._in_flight == 0)
            contexts, self._contexts = self._contexts, []
            self._pinned = False
            with self._slots:
                self._free, self._last_shapes = [], {}
                threads, self._own_threads, self._threads = self._own_threads, [], {}
                for waiting in [w for w in self._waiting if isinstance(w, _Call)]:
                    self._waiting.remove(waiting)
                    waiting.settle(error=ModelNotReady(f"model '{self.name}' is not loaded"))
        try:
            for thread in threads:  # each ends once the work handed to it is done
                thread.stop()
            for c in contexts:
                c.close()
            engine.close()
        finally:
            with self._lock:
                self._unloading = False
                self._lock.notify_all()
        logger.info("unloaded model %s v%d", self.name, self.version)


class _Call:
    """Work ``ModelHost.call`` queued for a context's thread; its outcome goes to ``future``, an
    asyncio future of the caller's loop, settled from the context's thread in one
    ``call_soon_threadsafe`` (no ``concurrent.futures`` future chained to it)."""

    def __init__(self, fn: Callable[..., Any], args: tuple, context: contextvars.Context, deadline: float,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.fn, self.args, self.vars, self.deadline, self.loop = fn, args, context, deadline, loop
        self.future: asyncio.Future = loop.create_future()

    def settle(self, result: Any = None, error: BaseException | None = None) -> None:
        """Give the caller ``result``, or raise ``error`` there; from any thread. Nothing when the
        caller went away (its future is done) or its loop has closed."""
        try:
            self.loop.call_soon_threadsafe(_settle, self.future, result, error)
        except RuntimeError:  # the caller's loop closed: nobody waits
            pass

    def run(self, host: "ModelHost", context: ExecutionContext) -> None:
        """On ``context``'s thread: ``fn`` with ``context`` bound to ``host.run`` here, then the
        context back to the host (and to the next in line), then the outcome to the caller: a
        caller that has its answer finds the context free again."""
        outcome: tuple[Any, BaseException | None] | None = None
        try:
            if self.future.done():  # its caller went away (a read of the future's state: no race that matters)
                return
            if time.monotonic() > self.deadline:
                outcome = None, host._no_context_free()
                return
            host._bound.context = context
            try:
                outcome = self.vars.run(self.fn, *self.args), None
            except BaseException as e:
                outcome = None, e
            finally:
                host._bound.context = None
        finally:
            host._check_in([context])
            if outcome is not None:
                self.settle(*outcome)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    """On the caller's loop: ``_Call.settle``'s outcome into ``future`` unless it is done."""
    if future.done():
        return
    if isinstance(error, StopIteration):  # an asyncio future refuses it (TypeError): the caller would wait for ever
        error = RuntimeError(f"the work raised StopIteration: {error!r}")
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _device_of(engine: Engine) -> str:
    return "GPU, without taking CUDA shared memory" if engine.backend in GPU_BACKENDS else "CPU"


def _shapes(inputs: Mapping[str, np.ndarray]) -> tuple:
    """The inputs' ``(name, shape)`` pairs, sorted: what a context's engine state depends on."""
    return tuple(sorted((name, np.shape(value)) for name, value in inputs.items()))


def _rows(max_batch_size: int, inputs: Mapping[str, np.ndarray]) -> int:
    """Axis-0 size of the first input when the model batches, else 1."""
    if max_batch_size <= 0 or not inputs:
        return 1
    first = next(iter(inputs.values()))
    return int(first.shape[0]) if first.ndim else 1
