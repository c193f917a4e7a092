"""Model deployments: a dedicated deployment per hot model, and one multiplexed pool.

Thin Ray layer: each replica owns engine-layer objects (``ModelHost``) and runs their blocking
``infer`` in a worker thread so one replica serves ``instances`` requests at once.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Iterable

import numpy as np
from ray import serve

from .runtime.errors import ModelNotFound, ModelNotReady
from .runtime.host import ModelHost
from .runtime.validation import validate_inputs
from .runtime.repository import ModelRepository

logger = logging.getLogger("ray.serve")

_EVICTION_RETRIES = 3


@serve.deployment
class ModelDeployment:
    """A dedicated deployment: every replica loads one model at start (eager)."""

    def __init__(self, repository: str, name: str, backend: str = "auto") -> None:
        self.host = ModelHost(ModelRepository(repository).get(name), backend).load()

    async def infer(self, inputs: dict[str, np.ndarray], outputs: list[str] | None = None) -> dict[str, np.ndarray]:
        """Run one request; see ``ModelHost.infer`` for shapes and raised errors."""
        return await asyncio.to_thread(self.host.infer, inputs, outputs)

    def ready(self) -> str:
        """The backend in use (``onnxruntime`` or ``tensorrt``) once loaded.

        Raises:
            ModelNotReady: not loaded.
        """
        return self.host.backend

    def check_health(self) -> None:
        if not self.host.ready:
            raise RuntimeError(f"model '{self.host.name}' is not loaded")


class _PooledModel:
    """What the multiplexed loader returns; Ray calls ``__del__`` when it evicts the model."""

    def __init__(self, host: ModelHost) -> None:
        self.host = host

    def __del__(self) -> None:
        self.host.unload()  # waits for in-flight requests, then frees contexts and engine


@serve.deployment
class PoolDeployment:
    """The multiplexed pool: serves the long tail of models, loaded on first use.

    The model is chosen by the request's multiplexed model id (the router sets it through
    ``handle.options(multiplexed_model_id=name)``). Ray Serve routes a model's requests to a
    replica that has it loaded and evicts least recently used models past
    ``max_num_models_per_replica``.
    """

    def __init__(self, repository: str, names: Iterable[str], backend: str = "auto",
                 max_num_models_per_replica: int = 3) -> None:
        repo = ModelRepository(repository)
        self._entries = {n: repo.get(n) for n in names}
        self._backend = backend

        async def load(name: str) -> _PooledModel:  # a plain function: Ray keeps its LRU on it
            return await self._load(name)

        self._loader = load
        self._get_model = serve.multiplexed(max_num_models_per_replica=max_num_models_per_replica)(load)

    async def _load(self, name: str) -> _PooledModel:
        entry = self._entries.get(name)
        if entry is None:
            raise ModelNotFound(f"model '{name}' is not in the multiplexed pool; pool: {sorted(self._entries)}")
        host = ModelHost(entry, self._backend)
        await asyncio.to_thread(host.load)
        return _PooledModel(host)

    async def infer(self, inputs: dict[str, np.ndarray], outputs: list[str] | None = None) -> dict[str, np.ndarray]:
        """Run one request on the model named by the multiplexed model id.

        A model evicted between lookup and use answers ``ModelNotReady``; it is looked up
        (and so reloaded) again rather than failing the request.
        """
        name = serve.get_multiplexed_model_id()
        for attempt in range(_EVICTION_RETRIES):
            model = await self._get_model(name)
            try:
                return await asyncio.to_thread(model.host.infer, inputs, outputs)
            except ModelNotReady:
                if attempt == _EVICTION_RETRIES - 1:
                    raise
        raise AssertionError("unreachable")

    def loaded_models(self) -> dict[str, Any]:
        """Names of the models this replica holds now."""
        wrapper = getattr(self._loader, "__serve_multiplex_wrapper", None)
        return {"models": sorted(wrapper.models) if wrapper is not None else []}


class ModelClient:
    """Calls a model by name through its deployment handle: dedicated or pooled.

    Used by the router and by pipelines; the arrays travel to the replica as Ray objects
    (no re-encoding between deployments).
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
        return await self.handle(name).infer.remote(inputs, outputs)


@serve.deployment
class PipelineDeployment:
    """A composed model (like a Triton ensemble) whose steps call other model deployments."""

    def __init__(self, repository: str, name: str, dedicated: dict[str, Any], pool: Any | None,
                 pool_models: Iterable[str]) -> None:
        from .pipelines import build_pipeline

        repo = ModelRepository(repository)
        self.config = repo.get(name).config
        client = ModelClient(dedicated, pool, pool_models)
        self.pipeline = build_pipeline(self.config, repo, client.infer)

    async def infer(self, inputs: dict[str, np.ndarray], outputs: list[str] | None = None) -> dict[str, np.ndarray]:
        validate_inputs(self.config, inputs)
        result = await self.pipeline.run(inputs)
        return result if outputs is None else {n: result[n] for n in outputs}

    def ready(self) -> str:
        return "pipeline"
