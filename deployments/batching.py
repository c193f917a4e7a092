"""Dynamic batching for a dedicated model deployment, on Ray Serve's ``@serve.batch``.

A request carries its own ``N`` rows (axis 0). ``@serve.batch`` (Ray 2.60) queues requests and
hands them over as a list once ``batch_size_fn`` (here: rows) reaches ``max_rows`` or
``max_queue_delay_ms`` has passed since the first; a request that would overflow waits for the
next batch. ``run_batch`` then:

- groups the requests by signature (every input's non-batch shape and dtype, e.g. ocr_rec's
  width), so only tensors that fit together are concatenated;
- runs each group as one call on the model (``np.concatenate`` along axis 0), splits every
  output back by each request's row range and keeps the outputs that request asked for;
- with padding (``BatchPolicy.pad_to``), appends zero rows up to the smallest preferred size
  that holds the group, a lone request included, and drops their outputs: the model then
  only ever sees the preferred sizes (why: ``DynamicBatching.pad_to_preferred``);
- when a combined run fails for a reason a single request could cause (``InferenceError`` or
  an unexpected exception), runs that group's requests one by one, so each gets its own result
  or error; a cause no request owns (``InferenceTimeout``, ``ModelNotReady``) fails the group.

Requests are validated before they are queued (``BatchItem.of``), so a malformed request is
answered alone and never joins a batch; the joined batch and the requests run alone are not
validated again (``ModelHost.run``). The result list holds, per request, its outputs or
the exception to raise for it.

Ray facts this relies on (``ray/serve/batching.py``, 2.60): the queue splits a batch by
multiplexed model id, but one queue has one ``max_batch_size`` and one timeout for every model,
so the multiplexed pool does not batch (put a model that wants batching in a dedicated
deployment). A batch is formed when full or timed out, whether or not an earlier batch still
runs (``max_concurrent_batches`` gates execution only), so ``max_queue_delay_ms`` is the knob
that decides how much batching happens.
"""

from __future__ import annotations

import copy

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from .runtime.contract.config import ModelConfig
from .runtime.contract.errors import EngineFault, InferenceTimeout, ModelNotReady
from .runtime.residency.host import ModelHost
from .runtime.contract.validation import validate_request

# Failures that belong to no single request: retrying the group one by one cannot help.
_GROUP_FAILURES = (InferenceTimeout, ModelNotReady, EngineFault)


# Backends where ``pad_to_preferred: auto`` pads: a change of input shape rebuilds every
# convolution's cuDNN plan in ONNX Runtime's CUDA provider (``DynamicBatching`` docstring).
PAD_AUTO_BACKENDS = frozenset({"onnxruntime_cuda"})


@dataclass(frozen=True)
class BatchPolicy:
    """How one model batches: at most ``max_rows`` rows, waiting up to ``max_queue_delay_ms``;
    ``pad_to``: the sizes (ascending) every batch is padded to, empty for no padding."""

    max_rows: int
    max_queue_delay_ms: float
    pad_to: tuple[int, ...] = ()

    @property
    def wait_s(self) -> float:
        return self.max_queue_delay_ms / 1e3

    @classmethod
    def of(cls, config: ModelConfig, backend: str = "onnxruntime") -> "BatchPolicy | None":
        """The policy from ``config.dynamic_batching`` for a model served by ``backend``; None
        when batching is off.

        ``max_rows`` is the largest preferred batch size, else ``max_batch_size`` (the config
        guarantees both stay within ``max_batch_size`` and so within the profile max). A model
        whose ``max_rows`` is 1 cannot batch and gets None. ``pad_to`` is the preferred sizes
        when ``pad_to_preferred`` is true, or ``auto`` and ``backend`` in ``PAD_AUTO_BACKENDS``.
        """
        batching = config.dynamic_batching
        if batching is None or not batching.enabled:
            return None
        max_rows = max(batching.preferred_batch_size, default=config.max_batch_size)
        if max_rows < 2:
            return None
        pad = batching.pad_to_preferred
        if pad == "auto":
            pad = backend in PAD_AUTO_BACKENDS
        pad_to = tuple(sorted(set(batching.preferred_batch_size))) if pad else ()
        return cls(max_rows=max_rows, max_queue_delay_ms=batching.max_queue_delay_ms, pad_to=pad_to)

    def padded_rows(self, rows: int) -> int:
        """The rows a batch of ``rows`` runs with: the smallest ``pad_to`` size >= rows
        (``rows`` itself without padding or when no size holds it)."""
        return next((size for size in self.pad_to if size >= rows), rows)


@dataclass(frozen=True)
class BatchItem:
    """One validated request waiting in the batch queue."""

    inputs: Mapping[str, np.ndarray]
    outputs: tuple[str, ...] | None
    rows: int
    signature: tuple[Any, ...]

    @classmethod
    def of(cls, config: ModelConfig, inputs: Mapping[str, np.ndarray],
           outputs: Sequence[str] | None) -> "BatchItem":
        """Validate one request and describe it for batching.

        Raises:
            InvalidInput: the inputs or requested outputs do not fit ``config``.
        """
        validate_request(config, inputs, outputs)
        names = sorted(inputs)
        signature = tuple((n, inputs[n].shape[1:], inputs[n].dtype.str) for n in names)
        rows = inputs[names[0]].shape[0]
        return cls(inputs, None if outputs is None else tuple(outputs), rows, signature)


def total_rows(items: Sequence[BatchItem]) -> int:
    """``batch_size_fn`` for ``@serve.batch``: a batch's size is its rows, not its requests."""
    return sum(item.rows for item in items)


@dataclass
class BatchRun:
    """What one ``run_batch`` did.

    ``results``: per request, in order, its outputs or the exception to raise for it.
    ``calls``: ``(requests joined, rows)`` of every model call made (``(1, rows)`` for a
    request run alone).
    ``retried_alone``: requests run one by one after their group's combined call failed.
    ``padded_rows``: zero rows added to reach preferred sizes (``BatchPolicy.pad_to``).
    """

    results: list[dict[str, np.ndarray] | BaseException]
    calls: list[tuple[int, int]]
    retried_alone: int
    padded_rows: int = 0


@dataclass
class BatchStats:
    """Counts across ``run_batch`` calls: model calls by requests joined, rows, retries.

    ``max_requests > 1`` means the replica did run several requests as one model call.
    """

    batches: int = 0
    requests: int = 0
    calls_by_requests: Counter = field(default_factory=Counter)
    calls_by_rows: Counter = field(default_factory=Counter)
    retried_alone: int = 0
    padded_rows: int = 0

    def record(self, items: Sequence["BatchItem"], run: BatchRun) -> None:
        self.batches += 1
        self.requests += len(items)
        for requests, rows in run.calls:
            self.calls_by_requests[requests] += 1
            self.calls_by_rows[rows] += 1
        self.retried_alone += run.retried_alone
        self.padded_rows += run.padded_rows

    def as_dict(self) -> dict[str, Any]:
        return {
            "batches": self.batches,
            "requests": self.requests,
            "max_requests": max(self.calls_by_requests, default=0),
            "max_rows": max(self.calls_by_rows, default=0),
            "calls_by_requests": dict(sorted(self.calls_by_requests.items())),
            "calls_by_rows": dict(sorted(self.calls_by_rows.items())),
            "retried_alone": self.retried_alone,
            "padded_rows": self.padded_rows,
        }


def _run_alone(host: ModelHost, item: BatchItem) -> dict[str, np.ndarray] | BaseException:
    try:
        return host.run(item.inputs, item.outputs)
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


def _run_group(host: ModelHost, group: list[BatchItem], padded_rows: int) -> tuple[list[dict[str, np.ndarray] | BaseException], str, int]:
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
        out.append({name: result[name][start:stop] for name in wanted})
        start = stop
    return out, "joined", pad


def run_batch(host: ModelHost, items: Sequence[BatchItem], policy: BatchPolicy | None = None) -> BatchRun:
    """Run queued requests as few model calls as their signatures allow (blocking); with
    ``policy.pad_to``, each call padded to a preferred size.

    Returns:
        Per request, in order: its outputs (``name -> (rows, ...)`` array, the names it asked
        for) or the exception to raise for it (a ``ServingError`` keeps its type).
    """
    groups: dict[tuple[Any, ...], list[int]] = {}
    for index, item in enumerate(items):
        groups.setdefault(item.signature, []).append(index)
    results: list[dict[str, np.ndarray] | BaseException] = [None] * len(items)  # type: ignore[list-item]
    calls, retried, padded = [], 0, 0
    for indices in groups.values():
        group = [items[i] for i in indices]
        rows = sum(item.rows for item in group)
        group_results, how, pad = _run_group(host, group, policy.padded_rows(rows) if policy else rows)
        if how == "joined":
            calls.append((len(group), rows))
            padded += pad
        elif how != "failed":
            calls.extend((1, item.rows) for item in group)
            retried += len(group) if how == "retried" else 0
        for i, r in zip(indices, group_results):
            results[i] = r
    return BatchRun(results, calls, retried, padded)
