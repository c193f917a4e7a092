"""Composed models: a model whose ``config.yaml`` says ``pipeline: <kind>`` is served by a
pipeline class that calls other models through an async ``infer(model_name, inputs)`` callable.

The Ray layer builds one with ``create_pipeline(repository, name, infer)``, gets handles for
``pipeline.steps`` and serves ``await pipeline.infer(inputs)``. Pipeline modules are imported
only when built (the OCR one pulls in OpenCV and rapidocr, the embed one tokenizers).
"""

from __future__ import annotations

import asyncio
import collections
import importlib
from typing import Any, Awaitable, Callable, Generic, Mapping, Protocol, Sequence, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..runtime.contract.config import describe_validation_error
from ..runtime.contract.errors import ConfigError, InvalidInput
from ..runtime.contract.repository import ModelRepository

InferFn = Callable[[str, dict[str, np.ndarray]], Awaitable[dict[str, np.ndarray]]]

# pipeline kind (``pipeline:`` in config.yaml) -> "module:class" of a class with
# ``from_repository(repository, infer, name)``.
PIPELINES: dict[str, str] = {
    "ocr": "deployments.pipelines.ocr:OcrPipeline",
    "embed": "deployments.pipelines.embed:EmbedPipeline",
}


P = TypeVar("P", bound="PipelineParameters")
T = TypeVar("T")
I = TypeVar("I")


class PipelineParameters(BaseModel):
    """A pipeline's ``parameters`` (its ``config.yaml``): frozen, unknown fields refused.
    ``step_calls_in_flight``: the calls one request has at a step at once (``map_bounded``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    step_calls_in_flight: int = Field(4, ge=1)

    @classmethod
    def parse(cls: type[P], raw: Mapping[str, Any], where: str) -> P:
        """Validate a ``parameters`` mapping.

        Raises:
            ConfigError: naming ``where``, the field and the problem (unknown fields included).
        """
        try:
            return cls.model_validate(dict(raw))
        except ValidationError as e:
            raise ConfigError(f"{where}: {describe_validation_error(e, prefix='parameters')}") from None


class Pipeline(Protocol):
    @property
    def steps(self) -> tuple[str, ...]:
        """Names of the models the pipeline calls."""

    async def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run on the pipeline model's inputs; returns its outputs by name (an
        ``Outputs`` where the answer carries response parameters)."""


async def map_bounded(call: Callable[[I], Awaitable[T]], items: Sequence[I], limit: int) -> list[T]:
    """``[await call(item) for item in items]``, at most ``limit`` calls running at once.

    A step's replicas serve every request's calls from one queue: one request sending all its
    calls at once (2,048 texts: 64 encoder calls) put every later request behind all of them,
    so a few at a time lets other requests' calls interleave. The first call that raises
    cancels the others (those not started never run; a running one is cancelled at its step's
    replica, ``ModelClient``), and so does cancelling the caller (the request timed out, was
    shed or its client left); the error is raised as the call raised it.
    """
    gate = asyncio.Semaphore(limit)

    async def one(item: I) -> T:
        async with gate:
            return await call(item)

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(item)) for item in items]
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [task.result() for task in tasks]


class JoinedCalls(Generic[I, T]):
    """A step's calls from concurrent requests joined into fewer, larger calls.

    ``await joined(items)`` returns ``call(items)``'s rows for ``items``. While fewer than
    ``calls_in_flight`` calls run, it is sent at once (one request alone waits for nothing);
    otherwise it waits, and when a call ends, the waiting items go together, up to ``max_rows``
    items a call, in arrival order. Each hop to a step's replica costs CPU at both ends, per
    call, whatever its rows, and a step replica's event loop takes calls in only so fast, so
    its own batch queue saw one or two at a time (docs/performance.md, "The embed path"):
    joined, the replicas pay the hop once for many requests' rows, and the step's dynamic
    batching still joins calls from other callers.

    ``call(items)`` returns a sequence of one result per item (e.g. an ``(N, H)`` array), which
    is split back to its callers. A call that raises raises in each of its callers. A caller
    that is cancelled (its request timed out or its client left) leaves its call; a call whose
    callers all left is cancelled (``ModelClient`` cancels it at the step's replica too).
    """

    def __init__(self, call: Callable[[list[I]], Awaitable[Sequence[T]]], max_rows: int, calls_in_flight: int) -> None:
        self._call = call
        self.max_rows = max_rows
        self.calls_in_flight = calls_in_flight
        self._waiting: collections.deque[tuple[list[I], asyncio.Future]] = collections.deque()
        self._running: set[asyncio.Task] = set()

    async def __call__(self, items: Sequence[I]) -> Sequence[T]:
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((list(items), future))
        self._send()
        return await future

    def _send(self) -> None:
        while self._waiting and len(self._running) < self.calls_in_flight:
            taken: list[tuple[list[I], asyncio.Future]] = []
            rows = 0
            while self._waiting and (not taken or rows + len(self._waiting[0][0]) <= self.max_rows):
                items, future = self._waiting.popleft()
                if not future.done():  # its caller left while it waited
                    taken.append((items, future))
                    rows += len(items)
            if not taken:
                return
            task = asyncio.get_running_loop().create_task(self._run(taken))
            self._running.add(task)
            futures = [future for _, future in taken]
            for future in futures:
                future.add_done_callback(lambda _, t=task, f=futures: t.cancel() if all(x.cancelled() for x in f) else None)

    async def _run(self, taken: list[tuple[list[I], asyncio.Future]]) -> None:
        try:
            results = await self._call([item for items, _ in taken for item in items])
        except BaseException as e:  # a cancelled call: all its callers left
            for _, future in taken:
                if not future.done():
                    future.set_exception(e)
            if not isinstance(e, Exception):
                raise
        else:
            start = 0
            for items, future in taken:
                if not future.done():
                    future.set_result(results[start:start + len(items)])
                start += len(items)
        finally:
            self._running.discard(asyncio.current_task())
            self._send()


def create_pipeline(repository: ModelRepository, name: str, infer: InferFn) -> Pipeline:
    """Build the pipeline that serves model ``name``.

    Raises:
        ModelNotFound: ``name`` or one of its steps is not in the repository.
        ConfigError: ``name`` is not a pipeline model, its kind is unknown, or its parameters
            or steps are invalid.
    """
    config = repository.get(name).config
    if config.pipeline is None:
        raise ConfigError(f"model '{name}' is not a pipeline model (no `pipeline:` in its config)")
    target = PIPELINES.get(config.pipeline)
    if target is None:
        raise ConfigError(f"model '{name}': unknown pipeline '{config.pipeline}'; known: {sorted(PIPELINES)}")
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls).from_repository(repository, step_caller(name, infer), name)


def step_caller(pipeline: str, infer: InferFn) -> InferFn:
    """``infer`` for pipeline ``pipeline``'s steps, whose errors keep whose fault they are: a
    step's ``InvalidInput`` (400: what the pipeline made of this request does not fit the step,
    e.g. an image whose lines come out outside the recognizer's profile) stays 400, its message
    naming the pipeline, the step and the shapes sent; capacity (503), a timeout (504) and a
    real fault (500) pass on as the step raised them. (A pipeline checks at build that each
    step's profile admits what it sends, so what a step refuses at run time comes from the
    request.)"""

    async def step(model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            return await infer(model, inputs)
        except InvalidInput as e:
            shapes = {n: list(a.shape) for n, a in inputs.items()}
            raise InvalidInput(f"model '{pipeline}': its step '{model}' refused what the pipeline made of this "
                               f"request (shapes {shapes}): {e.message}") from None

    return step
