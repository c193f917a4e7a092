"""ModelClient: call a model by name through its deployment handle (dedicated or pooled).

The router and the pipelines use it; it knows handles, not HTTP.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Iterable

import numpy as np
from ray import serve
from ray.exceptions import RayActorError

from .runtime.contract.errors import ModelNotReady, unknown_model

logger = logging.getLogger("ray.serve")

_REPLICA_LOST_RETRIES = 1  # sends again of a request whose model replica died holding it

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

    def __init__(self, dedicated: dict[str, Any], pool: Any | None, pool_models: Iterable[str],
                 control: Any | None = None) -> None:
        self.dedicated = dedicated
        self.pool = pool
        self.pool_models = set(pool_models)  # grows when a model added to the repository is loaded
        self.control = control  # ``deployments.control.ControlDeployment`` (explicit model control)

    def handle(self, name: str) -> Any:
        """The deployment handle serving ``name``.

        Raises:
            ModelNotFound: no deployment serves this model.
        """
        if name in self.dedicated:
            return self.dedicated[name]
        if name in self.pool_models and self.pool is not None:
            return self.pool.options(multiplexed_model_id=name)
        raise unknown_model(name, "no deployment serves it")

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

    async def backend(self, name: str) -> str:
        """The backend of dedicated model ``name`` (``onnxruntime``, ``tensorrt``, ``pipeline``);
        answers only once a replica has loaded the model.

        Raises:
            KeyError: ``name`` has no dedicated deployment.
        """
        return await self.dedicated[name].backend.remote()

    async def memory(self, name: str) -> dict[str, Any]:
        """``ModelDeployment.memory`` of one replica of dedicated model ``name``.

        Raises:
            KeyError: ``name`` has no dedicated deployment.
        """
        return await self.dedicated[name].memory.remote()

    async def running_replicas(self) -> dict[str, int]:
        """Model name -> RUNNING replicas of the deployment serving it (pool models: the pool's),
        from ``serve.status()`` (a call to Serve's controller, made in a worker thread).

        Raises:
            Exception: the controller did not answer (Ray's own exceptions).
        """
        handles = dict(self.dedicated)
        if self.pool is not None:
            handles.update((name, self.pool) for name in self.pool_models)
        return await asyncio.to_thread(_running, handles)

    async def control_desired(self) -> dict[str, Any]:
        """``ControlDeployment.desired``: ``{"revision", "models"}``."""
        return await self.control.desired.remote()

    async def control_set(self, name: str, loaded: bool, placement: str) -> int:
        """``ControlDeployment.set``: model ``name`` should (not) serve; returns the revision."""
        return await self.control.set.remote(name, loaded, placement)

    async def control_applied(self, name: str, placement: str, revision: int) -> tuple[list[dict[str, Any]], int]:
        """The reports of the replicas serving ``name`` (the pool's for ``placement`` ``pool``)
        that applied ``revision``, and how many of them Serve counts RUNNING."""
        handle = self.pool if placement == "pool" else self.dedicated[name]
        reports = await self.control.applied.remote(handle.deployment_name, revision)
        running = await asyncio.to_thread(_running, {name: handle})
        return reports, running[name]

    async def pool_memory(self) -> dict[str, Any]:
        """``PoolDeployment.memory`` of one pool replica (the pool must exist)."""
        return await self.pool.memory.remote()

    async def pool_states(self) -> dict[str, dict[str, Any]]:
        """``PoolDeployment.models`` of one pool replica: per pool model its cache ``state``,
        ``evictions`` and ``backend`` (the pool must exist)."""
        return await self.pool.models.remote()


def _running(handles: dict[str, Any]) -> dict[str, int]:
    """Name -> RUNNING replicas of the deployment behind each handle (``serve.status()``: a
    blocking call to Serve's controller)."""
    applications = serve.status().applications
    counts = {}
    for name, handle in handles.items():
        app = applications.get(handle.app_name)
        deployment = app.deployments.get(handle.deployment_name) if app is not None else None
        counts[name] = deployment.replica_states.get("RUNNING", 0) if deployment is not None else 0
    return counts
