"""The multiplexed pool deployment: the long tail of models, loaded on first use."""

from __future__ import annotations

import asyncio
from typing import Any, Iterable

import numpy as np
from ray import serve

from .runtime.errors import ModelNotFound, ModelNotReady
from .runtime.host import ModelHost
from .runtime.repository import ModelRepository

_EVICTION_RETRIES = 3


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
