"""The multiplexed pool deployment: the long tail of models, under a byte budget per replica."""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
from ray import serve

from .logs import show_on_terminal
from .runtime.backends.select import resolve_backend
from .runtime.contract.errors import ConfigError, ModelNotFound
from .runtime.contract.repository import ModelRepository
from .runtime.residency.cache import ModelCache


def _backend_here(requested: str) -> str:
    """The backend the cache will load a model with on this machine (it resolves ``requested``
    the same way); ``requested`` itself when that cannot work here (its load will say why)."""
    try:
        return resolve_backend(requested)
    except ConfigError:
        return requested


@serve.deployment
class PoolDeployment:
    """Serves the models not given a dedicated deployment, chosen by multiplexed model id.

    Ray Serve's multiplexing routes a model's requests to a replica that has it and caps the
    models per replica by count (``max_num_models_per_replica``); what is actually resident is
    decided by the replica's ``ModelCache``: the same count cap plus ``memory_budget_mb``, with
    the chosen ``load_policy``, never evicting a model a request holds.

    Args:
        repository: model repository root.
        names: the models of the pool.
        backend: ``auto``, ``onnxruntime`` or ``tensorrt``.
        max_num_models_per_replica: count cap (Ray's and the cache's).
        load_policy: ``eager``, ``lazy`` or ``lru``.
        memory_budget_mb: budget in MB (10**6 bytes, as the cache's messages print) for the
            models' footprints; None
            for no byte limit.
        wait_timeout_s: how long a load waits for held models to be released before 503.
    """

    def __init__(self, repository: str, names: Iterable[str], backend: str = "auto",
                 max_num_models_per_replica: int = 3, load_policy: str = "lru",
                 memory_budget_mb: float | None = None, wait_timeout_s: float = 30.0) -> None:
        show_on_terminal()
        names = list(names)
        repo = ModelRepository(repository, names)
        self.backends = {e.name: _backend_here(e.config.backend if backend == "auto" else backend)
                         for e in repo.entries()}
        self.cache = ModelCache(
            repo, names, load_policy=load_policy,  # type: ignore[arg-type]
            budget_bytes=None if memory_budget_mb is None else int(memory_budget_mb * 1e6),
            max_models=max_num_models_per_replica, backend=backend, wait_timeout_s=wait_timeout_s).start()

        async def register(name: str) -> str:  # a plain function: Ray keeps its routing LRU on it
            if name not in self.cache.names:
                raise ModelNotFound(f"model '{name}' is not in the multiplexed pool; pool: {self.cache.names}")
            return name  # residency is the cache's business, not Ray's

        self._get_model = serve.multiplexed(max_num_models_per_replica=max_num_models_per_replica)(register)

    async def infer(self, inputs: dict[str, np.ndarray], outputs: list[str] | None = None) -> dict[str, np.ndarray]:
        """Run one request on the model named by the multiplexed model id.

        Raises: as ``ModelCache.acquire`` and ``ModelHost.infer`` (e.g. ``OverBudget``).
        """
        name = await self._get_model(serve.get_multiplexed_model_id())
        return await self.cache.infer_async(name, inputs, outputs)

    def models(self) -> dict[str, dict[str, Any]]:
        """Per pool model on this replica: ``state`` in the cache (``absent``, ``loading``,
        ``ready``, ``evicting``), ``evictions`` so far, and the ``backend`` it runs (or will run) on."""
        cached = self.cache.status()["models"]
        return {name: {"state": cached[name]["state"], "evictions": cached[name]["evictions"],
                       "backend": backend} for name, backend in self.backends.items()}

    def memory(self) -> dict[str, Any]:
        """This replica's cache status and load/evict/reload timeline (JSON-ready)."""
        context = serve.get_replica_context()
        return {"replica": context.replica_id.unique_id, **self.cache.status(), "events": self.cache.timeline()}
