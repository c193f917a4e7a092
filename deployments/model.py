"""Model deployments: a dedicated deployment per hot model, pipelines, and the model client.

Thin Ray layer: each replica owns engine-layer objects (``ModelHost``) and runs their blocking
``infer`` in a worker thread so one replica serves ``instances`` requests at once.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Iterable

import numpy as np
from ray import serve
from ray.exceptions import RayActorError

from .logs import show_on_terminal
from .pipelines import create_pipeline
from .batching import BatchItem, BatchPolicy, BatchStats, run_batch, total_rows
from .runtime.contract.errors import ModelNotFound, ModelNotReady
from .runtime.residency.host import ModelHost
from .runtime.residency.predict import predict
from .runtime.contract.validation import validate_inputs
from .runtime.contract.repository import ModelRepository

logger = logging.getLogger("ray.serve")

_REPLICA_LOST_RETRIES = 1  # sends again of a request whose model replica died holding it


@serve.deployment
class ModelDeployment:
    """A dedicated deployment: every replica loads one model at start (eager).

    With ``dynamic_batching`` in the model's config, concurrent requests are batched through
    ``@serve.batch`` (see ``deployments.batching``), up to ``instances`` batches at once.
    """

    def __init__(self, repository: str, name: str, backend: str = "auto") -> None:
        show_on_terminal()
        self.host = ModelHost(ModelRepository(repository).get(name), backend).load()
        self.batch_stats = BatchStats()
        policy = BatchPolicy.of(self.host.config)
        self._batched = None
        self._max_rows = 0 if policy is None else policy.max_rows
        if policy is not None:
            async def run(items: list[BatchItem]) -> list:
                done = await asyncio.to_thread(run_batch, self.host, items)
                self.batch_stats.record(items, done)
                return done.results

            self._batched = serve.batch(
                max_batch_size=policy.max_rows, batch_wait_timeout_s=policy.wait_s,
                max_concurrent_batches=self.host.config.instances, batch_size_fn=total_rows)(run)

    async def infer(self, inputs: dict[str, np.ndarray], outputs: list[str] | None = None) -> dict[str, np.ndarray]:
        """Run one request; see ``ModelHost.infer`` for shapes and raised errors."""
        item = None if self._batched is None else BatchItem.of(self.host.config, inputs, outputs)
        if item is None or item.rows > self._max_rows:  # a request over the batch size runs alone
            return await asyncio.to_thread(self.host.infer, inputs, outputs)
        result = await self._batched(item)
        if isinstance(result, BaseException):
            raise result
        return result

    def batching(self) -> dict:
        """This replica's batch counters (``BatchStats.as_dict``); empty batches when off."""
        return {"enabled": self._batched is not None, **self.batch_stats.as_dict()}

    def ready(self) -> str:
        """The backend in use (``onnxruntime`` or ``tensorrt``) once loaded.

        Raises:
            ModelNotReady: not loaded.
        """
        return self.host.backend

    def memory(self) -> dict[str, Any]:
        """The loaded model's footprint in bytes (engine, per context, total for its instances).

        TensorRT reports context memory exactly; ONNX Runtime's is only known by measuring runs
        at the max profile, which a dedicated replica skips at start, so the graph prediction
        (``runtime.residency.predict.predict``) stands in and ``context_source`` says so.
        """
        footprint = self.host.footprint()
        context, source = footprint.context_bytes, "measured"
        if not context:
            context, source = predict(self.host.entry).context_bytes, "predicted"
        instances = self.host.config.instances
        return {"backend": self.host.backend, "engine_bytes": footprint.engine_bytes,
                "context_bytes": context, "context_source": source, "instances": instances,
                "total_bytes": footprint.engine_bytes + instances * context}

    def check_health(self) -> None:
        if not self.host.ready:
            raise RuntimeError(f"model '{self.host.name}' is not loaded")


# Requests whose inputs hold at least this many bytes go to the replica by reference (Ray's
# object store: shared memory on one node) even where handles default to gRPC, which copies
# and was 5x slower for a 4.9 MB tensor (bench/README.md).
BY_REFERENCE_MIN_BYTES = 1 << 20


def payload_bytes(inputs: dict[str, np.ndarray]) -> int:
    """Bytes the arrays carry (BYTES elements counted by their length)."""
    return sum(sum(len(x) for x in a.flat) if a.dtype == object else a.nbytes for a in inputs.values())


class ModelClient:
    """Calls a model by name through its deployment handle: dedicated or pooled.

    Used by the router and by pipelines; the arrays travel to the replica as Ray objects
    (no re-encoding between deployments): over gRPC where the cluster makes that the handle
    default (``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``, see the Makefile's ``serve``), by reference
    for inputs of ``BY_REFERENCE_MIN_BYTES`` and more.
    """

    def __init__(self, dedicated: dict[str, Any], pool: Any | None, pool_models: Iterable[str]) -> None:
        self.dedicated = dedicated
        self.pool = pool
        self.pool_models = frozenset(pool_models)

    def handle(self, name: str) -> Any:
        """The deployment handle serving ``name``.

        Raises:
            ModelNotFound: no deployment serves this model.
        """
        if name in self.dedicated:
            return self.dedicated[name]
        if name in self.pool_models and self.pool is not None:
            return self.pool.options(multiplexed_model_id=name)
        raise ModelNotFound(f"unknown model '{name}'")

    async def infer(self, name: str, inputs: dict[str, np.ndarray],
                    outputs: list[str] | None = None) -> dict[str, np.ndarray]:
        """Run ``inputs`` on model ``name``; returns its outputs by name.

        A replica that dies holding the request surfaces as ``ray.exceptions.RayActorError``
        (``ActorDiedError``); Serve has dropped it from routing by then, so the request is sent
        once more, to a live or replacement replica (inference has no side effects).

        Raises:
            ModelNotFound: no deployment serves ``name``.
            ModelNotReady: the replica died again on the second try.
            ServingError: whatever the model replica raised (``InvalidInput``, ``OverBudget``...).
        """
        handle = self.handle(name)
        if payload_bytes(inputs) >= BY_REFERENCE_MIN_BYTES:
            handle = handle.options(_by_reference=True)
        for attempt in range(_REPLICA_LOST_RETRIES + 1):
            try:
                return await handle.infer.remote(inputs, outputs)
            except RayActorError:
                if attempt == _REPLICA_LOST_RETRIES:
                    break
                logger.warning("model '%s': replica died during a request; sending it again", name)
        raise ModelNotReady(f"model '{name}': its replica stopped while serving the request; retry shortly")


@serve.deployment
class PipelineDeployment:
    """A composed model (like a Triton ensemble) whose steps call other model deployments."""

    def __init__(self, repository: str, name: str, dedicated: dict[str, Any], pool: Any | None,
                 pool_models: Iterable[str]) -> None:
        show_on_terminal()
        repo = ModelRepository(repository)
        self.config = repo.get(name).config
        self.pipeline = create_pipeline(repo, name, ModelClient(dedicated, pool, pool_models).infer)

    async def infer(self, inputs: dict[str, np.ndarray], outputs: list[str] | None = None) -> dict[str, np.ndarray]:
        validate_inputs(self.config, inputs)
        result = await self.pipeline.infer(inputs)
        return result if outputs is None else {n: result[n] for n in outputs}

    def ready(self) -> str:
        return "pipeline"
