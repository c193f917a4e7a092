"""Dynamic batching for a dedicated model deployment: our own scheduler (``BatchScheduler``),
asyncio in the replica's event loop and a worker thread per running batch (``asyncio.to_thread``, or a
free execution context's own thread: ``ModelHost.call``).

Why not Ray Serve's ``@serve.batch`` (which served here until issue 30): Ray 2.60 forms a batch
when it is full or ``batch_wait_timeout_s`` has passed since its first request, whether or not
an execution context is free (``max_concurrent_batches`` gates execution only,
``ray/serve/batching.py``). So a lone client always waited the window (resnet18 on the H200,
padded to 8: 10 ms p50 against 3.8 ms unbatched, issue 30), and under load a batch closed at the
window, not when a context could take it. Its queue also has one size and one timeout for every
shape; the sequence buckets below need the shape in the batching key.

The policy (``BatchScheduler``), one per replica, ``instances`` batches running at most:

- **a context is free** (fewer batches run than ``instances``): what is queued runs now, so a
  lone request runs at once, alone, at its own size (never padded up: batch 1 is a warmed size)
  while the replica is **idle**: no other batch running, nothing else queued, and the previous
  batch was a lone request too. Under load (any of those), even a lone request is padded to a
  preferred size: on ONNX Runtime's CUDA provider every change of a context's input shape
  rebuilds its convolutions' cuDNN plans, and a replica alternating batch 1 and its padded size
  under load ran 3-5x slower than unbatched (resnet18 and tiny_cnn on the H200, 16 and 64
  clients; docs/performance.md, "Dynamic batching on the GPU"). So one client keeps batch 1 and
  a loaded replica keeps its padded sizes, and the shape changes once when the load does;
- **every context is busy**: requests gather. When a context comes free, the oldest request's
  shape key runs with the other requests queued under that key, oldest first, up to
  ``max_rows`` rows (a request that would overflow waits for the next batch);
- **the window** (``max_queue_delay_ms``) bounds how long a batch stays open: a request that
  has waited it while every context stayed busy closes its batch (up to ``max_rows`` rows of its
  key), which runs at the next free context, before anything that is still open. A longer window
  gives fuller batches under load and costs a lone request nothing.

A batch (``run_batch``):

- groups its requests by signature (every input's non-batch shape and dtype, e.g. ocr_rec's
  width, a text's sequence bucket), so only tensors that fit together are concatenated;
- runs each group as one call on the model (``np.concatenate`` along axis 0), splits every
  output back by each request's row range and keeps the outputs that request asked for;
- with padding (``BatchPolicy.pad_to``: 1 and the preferred sizes; under load the preferred
  sizes only, ``BatchPolicy.padded_rows``), appends zero rows up to the smallest of those sizes
  that holds the group, and drops their outputs: the model then only ever sees those sizes
  (why: ``DynamicBatching.pad_to_preferred``);
- when a combined run fails for a reason a single request could cause (``InferenceError`` or
  an unexpected exception), runs that group's requests one by one, so each gets its own result
  or error; a cause no request owns (``InferenceTimeout``, ``ModelNotReady``) fails the group.

**Sequence buckets** (``dynamic_batching.sequence_buckets``, ``SequenceAxis``): each request's
inputs that carry the sequence axis (axis 1) are zero-padded on it to the smallest bucket that
holds them (past the largest bucket: their own length), when the request is queued. The bucket
is part of the signature, so requests of different lengths join one batch and the model sees a
few sequence lengths; outputs that carry the axis are cut back to each request's own length.
Zero padding is only right where the model's attention mask makes padded positions inert
(BERT-like encoders: ``attention_mask`` 0 there), hence opt-in.

Requests are validated before they are queued (``BatchItem.of``), so a malformed request is
answered alone and never joins a batch; the joined batch and the requests run alone are not
validated again (``ModelHost.run``).

Ray facts kept: the multiplexed pool does not batch (put a model that wants batching in a
dedicated deployment); an unload waits for the queue (the deployment's ``Gate`` holds each
request from arrival to answer).
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import logging
import time

from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Collection, Mapping, Protocol, Sequence

import numpy as np

from .runtime.contract.completion import read_onnx_signature
from .runtime.contract.config import ModelConfig
from .runtime.contract.datatypes import zeros
from .runtime.contract.errors import ConfigError, EngineFault, InferenceTimeout, ModelNotReady
from .runtime.contract.validation import validate_request
from .runtime.residency.warmup import warmup_shape

# Failures that belong to no single request: retrying the group one by one cannot help.
_GROUP_FAILURES = (InferenceTimeout, ModelNotReady, EngineFault)


logger = logging.getLogger(__name__)

# Backends where ``pad_to_preferred: auto`` pads: a change of input shape rebuilds every
# convolution's cuDNN plan in ONNX Runtime's CUDA provider (``DynamicBatching`` docstring).
PAD_AUTO_BACKENDS = frozenset({"onnxruntime_cuda"})

# Backends whose sequence buckets are warmed at load. Not ONNX Runtime CPU: there a first run at
# a new shape costs what later runs cost (all-MiniLM-L6-v2, 2 cores: batch 1 x 16 tokens 3.6 ms
# the first time then 2.5 ms; 32 x 256 2.0 s both times), while warming 2 sizes x 5 buckets
# costs about 2.5 s per context: the warm buys nothing there.
BUCKET_WARM_BACKENDS = frozenset({"onnxruntime_cuda", "tensorrt"})


class Runner(Protocol):
    """What ``run_batch`` needs of a ``ModelHost``."""

    def run(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]: ...


@dataclass(frozen=True)
class SequenceAxis:
    """The sequence axis (axis 1, after the batch axis) that ``sequence_buckets`` pads.

    ``inputs``: the inputs padded on it; ``outputs``: the outputs cut back on it. Which tensors
    carry it (``of``): those whose axis 1 has the ONNX file's symbol for it (the symbol every
    input with a dynamic axis 1 has there, e.g. ``sequence`` in all-MiniLM-L6-v2's
    ``input_ids``, ``attention_mask``, ``token_type_ids`` and ``last_hidden_state``); where the
    file names no symbol there, every input and output whose axis 1 is dynamic in the config.
    """

    buckets: tuple[int, ...]
    inputs: frozenset[str]
    outputs: frozenset[str]

    @classmethod
    def of(cls, config: ModelConfig, model_file: Path | None = None) -> "SequenceAxis | None":
        """The axis for ``config`` (its ``dynamic_batching.sequence_buckets``; None without
        them) with the symbols of ``model_file`` (None, or unreadable: the fallback rule).

        Raises:
            ConfigError: the inputs with a dynamic axis 1 have different symbols there, so which
                axis the buckets pad is ambiguous.
        """
        batching = config.dynamic_batching
        if batching is None or not batching.sequence_buckets:
            return None
        dynamic = [t for t in config.inputs if len(t.dims) >= 2 and t.dims[1] == -1]
        dynamic_out = [t for t in config.outputs if len(t.dims) >= 2 and t.dims[1] == -1]
        signature = read_onnx_signature(model_file) if model_file is not None else None
        if signature is not None:
            symbols = {t.name: t.dims[1] for t in signature.inputs + signature.outputs
                       if t.dims is not None and len(t.dims) >= 2 and isinstance(t.dims[1], str)}
            named = {symbols[t.name] for t in dynamic if t.name in symbols}
            if len(named) > 1:
                raise ConfigError(f"model '{config.name}': dynamic_batching.sequence_buckets: the inputs' axis 1 has "
                                  f"several symbols in {signature.path} ({sorted(named)}); the buckets pad one "
                                  "sequence axis shared by the inputs")
            if named:
                (symbol,) = named
                return cls(tuple(batching.sequence_buckets),
                           frozenset(t.name for t in dynamic if symbols.get(t.name) == symbol),
                           frozenset(t.name for t in dynamic_out if symbols.get(t.name) == symbol))
        return cls(tuple(batching.sequence_buckets), frozenset(t.name for t in dynamic),
                   frozenset(t.name for t in dynamic_out))

    def bucket(self, length: int) -> int:
        """The smallest bucket >= ``length``; ``length`` itself past the largest."""
        return next((b for b in self.buckets if b >= length), length)

    def pad(self, inputs: Mapping[str, np.ndarray]) -> tuple[Mapping[str, np.ndarray], int, int]:
        """``(inputs padded, own length, bucket)``: the sequence inputs zero-padded on axis 1 to
        the bucket of their length. Inputs left as they are, with length and bucket 0, where
        the sequence inputs disagree on their length or are not numeric."""
        names = [n for n in self.inputs if n in inputs]
        lengths = {inputs[n].shape[1] for n in names}
        if len(lengths) != 1 or any(inputs[n].dtype.kind not in "biuf" for n in names):
            return inputs, 0, 0
        (length,) = lengths
        bucket = self.bucket(length)
        if bucket == length:
            return inputs, length, bucket
        padded = dict(inputs)
        for n in names:
            a = inputs[n]
            out = np.zeros((a.shape[0], bucket) + a.shape[2:], a.dtype)
            out[:, :length] = a
            padded[n] = out
        return padded, length, bucket


@dataclass(frozen=True)
class BatchPolicy:
    """How one model batches: at most ``max_rows`` rows, a batch open at most
    ``max_queue_delay_ms``; ``pad_to``: the sizes (ascending, 1 first) every batch is padded to,
    empty for no padding; ``sequence``: the sequence buckets, None for none."""

    max_rows: int
    max_queue_delay_ms: float
    pad_to: tuple[int, ...] = ()
    sequence: SequenceAxis | None = None
    preferred: tuple[int, ...] = ()  # the config's preferred batch sizes

    @property
    def wait_s(self) -> float:
        return self.max_queue_delay_ms / 1e3

    @classmethod
    def of(cls, config: ModelConfig, backend: str = "onnxruntime", model_file: Path | None = None,
           replayed: Collection[int | None] = ()) -> "BatchPolicy | None":
        """The policy from ``config.dynamic_batching`` for a model served by ``backend`` (its
        ``model_file`` names the sequence axis: ``SequenceAxis.of``); None when batching is off.
        ``replayed``: the batch sizes the loaded model's contexts replay as CUDA graphs
        (``ModelHost.replayed_batches``): where every size up to ``max_rows`` is one, ``auto``
        does not pad for a change of shape's sake.

        ``max_rows`` is the largest preferred batch size, else ``max_batch_size`` (the config
        guarantees both stay within ``max_batch_size`` and so within the profile max). A model
        whose ``max_rows`` is 1 cannot batch and gets None. ``pad_to`` is 1 and the preferred
        sizes when ``pad_to_preferred`` is true, or ``auto`` and ``backend`` in
        ``PAD_AUTO_BACKENDS`` and the contexts do not replay every size: 1 is there so that a lone
        request of one row runs unpadded.
        ``sequence`` (the buckets) applies when ``pad_to_preferred`` is true, or ``auto`` and
        ``backend`` runs on a GPU (``BUCKET_WARM_BACKENDS``): on ONNX Runtime CPU a new sequence
        length costs nothing, and padding a 150-token text to 256 costs its attention about 3x
        (the embed pipeline served 11-22 texts/s bucketed against 45-49 unbucketed on 2 cores,
        docs/performance.md, "Sentence embeddings").

        Raises:
            ConfigError: see ``SequenceAxis.of``.
        """
        batching = config.dynamic_batching
        if batching is None or not batching.enabled:
            return None
        max_rows = max(batching.preferred_batch_size, default=config.max_batch_size)
        if max_rows < 2:
            return None
        pad = batching.pad_to_preferred
        if pad == "auto":
            pad = backend in PAD_AUTO_BACKENDS and not set(range(1, max_rows + 1)) <= set(replayed)
        pad_to = tuple(sorted({1, *batching.preferred_batch_size})) if pad and batching.preferred_batch_size else ()
        if pad and not batching.preferred_batch_size:
            logger.warning(
                "model '%s': dynamic_batching has no preferred_batch_size, so its batches run at every size from 1 to "
                "%d on %s, where a model's convolutions rebuild their cuDNN plans at each change of size and only "
                "batch 1 replays a CUDA graph; set preferred_batch_size (e.g. [8]) to pad batches to a few sizes",
                config.name, max_rows, backend)
        sequence = SequenceAxis.of(config, model_file)  # checked on every backend
        if batching.pad_to_preferred is False or (batching.pad_to_preferred == "auto" and backend not in BUCKET_WARM_BACKENDS):
            sequence = None  # on ONNX Runtime CPU a new length costs nothing: padding would only waste
        return cls(max_rows=max_rows, max_queue_delay_ms=batching.max_queue_delay_ms, pad_to=pad_to,
                   sequence=sequence, preferred=tuple(batching.preferred_batch_size))

    def padded_rows(self, rows: int, loaded: bool = False) -> int:
        """The rows a batch of ``rows`` runs with: the smallest ``pad_to`` size >= rows
        (``rows`` itself without padding or when no size holds it); ``loaded`` (the replica is
        under load: ``BatchScheduler``): the smallest preferred size, 1 left out unless the
        config prefers it."""
        sizes = self.pad_to
        if loaded and len(sizes) > 1 and sizes[0] == 1 and 1 not in self.preferred:
            sizes = sizes[1:]
        return next((size for size in sizes if size >= rows), rows)

    def warm_shapes(self, config: ModelConfig, backend: str) -> list[dict[str, tuple[int, ...]]]:
        """The input shapes to run once each at load, largest first (``ModelHost.warm``).

        Batch sizes: ``pad_to`` with padding; else, with sequence buckets, 1 and ``max_rows``
        (the smallest and largest batch). Sequence lengths: every bucket on a backend in
        ``BUCKET_WARM_BACKENDS`` (other axes as the config's warmup has them); so at most
        (preferred sizes + 1) x buckets shapes. Empty when nothing needs warming (no padding,
        and no buckets or buckets on ONNX Runtime CPU).
        """
        buckets = self.sequence.buckets if self.sequence is not None and backend in BUCKET_WARM_BACKENDS else ()
        sizes = self.pad_to or ((1, self.max_rows) if buckets else ())
        shapes = []
        for size in sizes:
            for length in buckets or (None,):
                shape = {}
                for spec in config.inputs:
                    dims = list(warmup_shape(config, spec, size))
                    if length is not None and spec.name in self.sequence.inputs:
                        dims[1] = length
                    shape[spec.name] = tuple(dims)
                shapes.append(shape)
        return sorted(shapes, key=lambda s: [-int(np.prod(d)) for d in s.values()])


@dataclass(frozen=True)
class BatchItem:
    """One validated request waiting in the batch queue (its sequence inputs padded to their
    bucket: ``length`` its own, ``bucket`` the padded length; both 0 without buckets)."""

    inputs: Mapping[str, np.ndarray]
    outputs: tuple[str, ...] | None
    rows: int
    signature: tuple[Any, ...]
    length: int = 0
    bucket: int = 0
    cut: frozenset[str] = frozenset()  # outputs cut back to ``length`` on axis 1

    @classmethod
    def of(cls, config: ModelConfig, inputs: Mapping[str, np.ndarray],
           outputs: Sequence[str] | None, sequence: SequenceAxis | None = None) -> "BatchItem":
        """Validate one request and describe it for batching (padded to its sequence bucket).

        Raises:
            InvalidInput: the inputs or requested outputs do not fit ``config``.
        """
        validate_request(config, inputs, outputs)
        length = bucket = 0
        if sequence is not None:
            inputs, length, bucket = sequence.pad(inputs)
        names = sorted(inputs)
        signature = tuple((n, inputs[n].shape[1:], inputs[n].dtype.str) for n in names)
        rows = inputs[names[0]].shape[0]
        cut = sequence.outputs if sequence is not None and bucket > length else frozenset()
        return cls(inputs, None if outputs is None else tuple(outputs), rows, signature, length, bucket, cut)

    def own(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``outputs`` of this request's rows, those on the sequence axis cut back to its length."""
        if not self.cut:
            return outputs
        return {n: a[:, :self.length] if n in self.cut and a.ndim >= 2 else a for n, a in outputs.items()}

    def positions(self) -> tuple[int, int]:
        """(real, run) sequence positions of this request's rows: rows x own length, rows x bucket."""
        return self.rows * self.length, self.rows * self.bucket


def total_rows(items: Sequence[BatchItem]) -> int:
    """A batch's size: its rows, not its requests."""
    return sum(item.rows for item in items)


@dataclass
class BatchRun:
    """What one ``run_batch`` did.

    ``results``: per request, in order, its outputs or the exception to raise for it.
    ``calls``: ``(requests joined, rows)`` of every model call made (``(1, rows)`` for a
    request run alone).
    ``retried_alone``: requests run one by one after their group's combined call failed.
    ``padded_rows``: zero rows added to reach preferred sizes (``BatchPolicy.pad_to``).
    ``positions`` / ``padded_positions``: sequence positions (rows x sequence length) of the
    requests' own rows, and those the model ran beyond them (sequence padding of real rows and
    every position of padded rows); 0 without sequence buckets.
    """

    results: list[dict[str, np.ndarray] | BaseException]
    calls: list[tuple[int, int]]
    retried_alone: int
    padded_rows: int = 0
    positions: int = 0
    padded_positions: int = 0


@dataclass
class BatchStats:
    """Counts across batches: model calls by requests joined, rows, retries, padding waste.

    ``max_requests > 1`` means the replica did run several requests as one model call.
    ``rows`` / ``padded_rows`` and ``positions`` / ``padded_positions``: real against padding
    (``BatchRun``), the waste of ``pad_to`` and of ``sequence_buckets``.
    """

    batches: int = 0
    requests: int = 0
    calls_by_requests: Counter = field(default_factory=Counter)
    calls_by_rows: Counter = field(default_factory=Counter)
    retried_alone: int = 0
    rows: int = 0
    padded_rows: int = 0
    positions: int = 0
    padded_positions: int = 0

    def record(self, items: Sequence["BatchItem"], run: BatchRun) -> None:
        self.batches += 1
        self.requests += len(items)
        for requests, rows in run.calls:
            self.calls_by_requests[requests] += 1
            self.calls_by_rows[rows] += 1
            self.rows += rows
        self.retried_alone += run.retried_alone
        self.padded_rows += run.padded_rows
        self.positions += run.positions
        self.padded_positions += run.padded_positions

    def as_dict(self) -> dict[str, Any]:
        return {
            "batches": self.batches,
            "requests": self.requests,
            "max_requests": max(self.calls_by_requests, default=0),
            "max_rows": max(self.calls_by_rows, default=0),
            "calls_by_requests": dict(sorted(self.calls_by_requests.items())),
            "calls_by_rows": dict(sorted(self.calls_by_rows.items())),
            "retried_alone": self.retried_alone,
            "rows": self.rows,
            "padded_rows": self.padded_rows,
            "positions": self.positions,
            "padded_positions": self.padded_positions,
        }


def _run_alone(host: Runner, item: BatchItem) -> dict[str, np.ndarray] | BaseException:
    try:
        return item.own(host.run(item.inputs, item.outputs))
    except Exception as e:  # each request gets its own error back
        return e


def _joined(group: list[BatchItem], name: str, rows: int, pad: int) -> np.ndarray:
    """Input ``name`` of every request in ``group`` along axis 0, then ``pad`` zero rows: one
    copy into one new array."""
    first = group[0].inputs[name]
    out = np.empty((rows + pad,) + first.shape[1:], first.dtype)
    np.concatenate([item.inputs[name] for item in group], out=out[:rows])
    out[rows:] = 0
    return out


def _run_group(host: Runner, group: list[BatchItem], padded_rows: int) -> tuple[list[dict[str, np.ndarray] | BaseException], str, int]:
    """Run requests of one signature as one call of ``padded_rows`` rows (>= theirs: the
    excess is zero rows whose outputs are dropped; numeric inputs only); returns (results,
    how, zero rows added): how is ``single`` (one request, unpadded), ``joined`` (one model
    call), ``retried`` (the joined call failed, each ran alone) or ``failed``."""
    rows = sum(item.rows for item in group)
    pad = padded_rows - rows
    if pad > 0 and any(a.dtype.kind not in "biuf" for a in group[0].inputs.values()):
        pad = 0  # only numeric tensors are padded
    if len(group) == 1 and pad <= 0:
        return [_run_alone(host, group[0])], "single", 0
    pad = max(pad, 0)
    combined = {name: _joined(group, name, rows, pad) for name in group[0].inputs}
    try:
        result = host.run(combined)  # its requests were validated one by one
    except _GROUP_FAILURES as e:
        return [copy.copy(e) for _ in group], "failed", 0  # one exception object per request
    except Exception:  # one request may be the cause: answer each on its own
        return [_run_alone(host, item) for item in group], "retried", 0
    if any(a.ndim == 0 or a.shape[0] != rows + pad for a in result.values()):  # outputs not per row
        return [_run_alone(host, item) for item in group], "retried", 0
    out: list[dict[str, np.ndarray] | BaseException] = []
    start = 0
    for item in group:
        stop = start + item.rows
        wanted = item.outputs if item.outputs is not None else result.keys()
        out.append(item.own({name: result[name][start:stop] for name in wanted}))
        start = stop
    return out, "joined", pad


def run_batch(host: Runner, items: Sequence[BatchItem], policy: BatchPolicy | None = None,
              loaded: bool = False) -> BatchRun:
    """Run queued requests as few model calls as their signatures allow (blocking); with
    ``policy.pad_to``, each call padded to one of those sizes (``loaded``: the replica is under
    load, ``BatchPolicy.padded_rows``).

    Returns:
        Per request, in order: its outputs (``name -> (rows, ...)`` array, the names it asked
        for) or the exception to raise for it (a ``ServingError`` keeps its type).
    """
    groups: dict[tuple[Any, ...], list[int]] = {}
    for index, item in enumerate(items):
        groups.setdefault(item.signature, []).append(index)
    results: list[dict[str, np.ndarray] | BaseException] = [None] * len(items)  # type: ignore[list-item]
    done = BatchRun(results, [], 0)
    for indices in groups.values():
        group = [items[i] for i in indices]
        rows = sum(item.rows for item in group)
        group_results, how, pad = _run_group(host, group, policy.padded_rows(rows, loaded) if policy else rows)
        if how == "joined":
            done.calls.append((len(group), rows))
            done.padded_rows += pad
            done.padded_positions += pad * group[0].bucket  # every position of a padded row
        elif how != "failed":
            done.calls.extend((1, item.rows) for item in group)
            done.retried_alone += len(group) if how == "retried" else 0
        if how != "failed":
            for item in group:
                real, ran = item.positions()
                done.positions += real
                done.padded_positions += ran - real
        for i, r in zip(indices, group_results):
            results[i] = r
    return done


@dataclass
class _Waiting:
    item: BatchItem
    future: asyncio.Future
    deadline: float  # loop time at which its batch closes


class BatchScheduler:
    """Queues requests and runs them in batches (the module docstring gives the policy).

    Args:
        run: runs one batch, blocking (in a worker thread): ``(items, loaded) -> BatchRun``,
            e.g. ``lambda items, loaded: run_batch(host, items, policy, loaded)``; ``loaded``:
            the replica was not idle when the batch started (another batch running, requests
            left queued, or the previous batch joined several requests: the module docstring).
        max_rows: the most rows in one batch.
        wait_s: how long a batch stays open while every context is busy.
        slots: batches run at once: the model's ``instances``.
        on_ran: called in the event loop after each batch with ``(items, BatchRun, seconds)``.
        call: how ``run`` is run off the event loop (``ModelHost.call``: on a free execution
            context's own thread where it has one); default ``asyncio.to_thread``.

    ``submit`` must be called from the event loop the scheduler runs in; everything here runs
    in that loop but ``run``. ``stats`` counts every batch (``BatchStats``).
    """

    def __init__(self, run: Callable[[list[BatchItem], bool], BatchRun], max_rows: int, wait_s: float, slots: int,
                 on_ran: Callable[[list[BatchItem], BatchRun, float], None] | None = None,
                 call: Callable[..., Awaitable[Any]] = asyncio.to_thread) -> None:
        self._run_batch = run
        self._call = call
        self.max_rows = max_rows
        self.wait_s = wait_s
        self.slots = slots
        self.on_ran = on_ran
        self.stats = BatchStats()
        self._open: deque[_Waiting] = deque()
        self._closed: deque[list[_Waiting]] = deque()
        self._running = 0
        self._timer: asyncio.Handle | None = None
        self._timer_at = 0.0  # the loop time ``_timer`` was armed for
        self._last_joined = False  # the previous batch started held several requests
        self._tasks: set[asyncio.Task] = set()

    @property
    def running(self) -> int:
        """Batches running now."""
        return self._running

    @property
    def queued(self) -> int:
        """Requests waiting: in open batches and in closed ones not yet running."""
        return len(self._open) + sum(len(batch) for batch in self._closed)

    @property
    def closed(self) -> int:
        """Batches closed (full or their window passed) that wait for a context."""
        return len(self._closed)

    def submit(self, item: BatchItem) -> asyncio.Future:
        """Queue ``item``; the future gives its outputs or the exception to raise for it. Runs
        it at once when a context is free."""
        loop = asyncio.get_running_loop()
        waiting = _Waiting(item, loop.create_future(), loop.time() + self.wait_s)
        self._open.append(waiting)
        self._pump()
        return waiting.future

    async def infer(self, item: BatchItem) -> dict[str, np.ndarray]:
        """``submit`` and wait: the request's outputs. Raises the exception its batch gave it."""
        result = await self.submit(item)
        if isinstance(result, BaseException):
            raise result
        return result

    def _take(self) -> list[_Waiting]:
        """The oldest open request and, oldest first, the others open under its signature up
        to ``max_rows`` rows (stopping at the first that would overflow); removed from the queue."""
        head = self._open.popleft()
        batch, rows, kept = [head], head.item.rows, deque()
        while self._open:
            waiting = self._open.popleft()
            if waiting.item.signature != head.item.signature:
                kept.append(waiting)
                continue
            if rows + waiting.item.rows > self.max_rows:
                kept.append(waiting)
                kept.extend(self._open)
                self._open.clear()
                break
            batch.append(waiting)
            rows += waiting.item.rows
        self._open = kept
        return batch

    def _pump(self) -> None:
        """Start batches while a context is free (closed batches first); close open batches
        whose window passed; arm the timer for the next window to pass."""
        while self._open and self._open[0].future.done():  # its request went away
            self._open.popleft()
        while self._running < self.slots and (self._closed or self._open):
            self._start(self._closed.popleft() if self._closed else self._take())
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self._open and self._open[0].deadline <= now:
            self._closed.append(self._take())
        # The deadline the timer was armed for is kept here: uvloop's ``call_at`` answers a
        # deadline under half a millisecond away with a plain ``Handle``, which has no ``when``.
        if self._timer is not None and (not self._open or self._timer_at != self._open[0].deadline):
            self._timer.cancel()
            self._timer = None
        if self._open and self._timer is None:
            self._timer_at = self._open[0].deadline
            self._timer = loop.call_at(self._timer_at, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._pump()

    def _start(self, batch: list[_Waiting]) -> None:
        batch = [w for w in batch if not w.future.done()]  # requests that went away do not run
        if not batch:
            return
        loaded = self._running > 0 or bool(self._open or self._closed) or self._last_joined or len(batch) > 1
        self._last_joined = len(batch) > 1
        self._running += 1
        # A context of its own: the batch is no request's (``ReplicaRecorder.batch_ran``).
        task = asyncio.get_running_loop().create_task(self._run(batch, loaded), context=contextvars.Context())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: list[_Waiting], loaded: bool) -> None:
        items = [w.item for w in batch]
        start = time.perf_counter()
        try:
            try:
                done = await self._call(self._run_batch, items, loaded)
            except BaseException as e:  # run_batch answers per request; this is a fault of its own
                done = BatchRun([copy.copy(e) for _ in items], [], 0)
            seconds = time.perf_counter() - start
            for w, result in zip(batch, done.results):
                if not w.future.done():
                    w.future.set_result(result)
            self.stats.record(items, done)
            if self.on_ran is not None:
                self.on_ran(items, done, seconds)
        finally:
            self._running -= 1
            self._pump()
