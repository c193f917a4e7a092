"""The in-process replica adapters: the ``ModelClient`` interface over a model or pool replica's own
methods, so that its routes (``replica_routes``) run the model in this process, with no handle."""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Iterable

from .protocol.errors import raise_if_error


class ReplicaAdapter:
    """The ``ModelClient`` of ``ModelRoutes``: model ``name`` runs in this process through
    ``infer`` (the replica's own ``infer(inputs, outputs)``); no pool, no handles."""

    pool = None

    def __init__(self, name: str, infer: Callable[..., Awaitable[dict]]) -> None:
        self.dedicated: dict[str, Any] = {name: None}
        self.pool_models: set[str] = set()
        self._infer = infer

    async def infer(self, name: str, inputs: dict, outputs: list[str] | None = None, key: str | None = None,
                    version: int | None = None) -> dict:
        return raise_if_error(await self._infer(inputs, outputs, version))




class PoolAdapter:
    """The ``ModelClient`` of ``PoolRoutes``: the pool's models run in this process, through the
    pool replica's own ``infer_body`` (keyed by the version's cache key) and ``models``; no
    handles. ``pool`` is the adapter itself: the routes treat the pool as present."""

    def __init__(self, pool_models: Iterable[str], infer_body: Callable[..., Awaitable[Any]],
                 states: Callable[[], dict[str, dict[str, Any]]]) -> None:
        self.dedicated: dict[str, Any] = {}
        self.pool = self
        self.pool_models = set(pool_models)
        self._infer_body = infer_body
        self._states = states

    async def infer_body(self, name: str, key: str | None, version: str, batched: bool, chunks: list[bytes],
                         header_length: str | None, default_timeout_s: float) -> Any:
        return raise_if_error(await self._infer_body(name, version, batched, chunks, header_length,
                                                     default_timeout_s, key))

    async def pool_states(self) -> dict[str, dict[str, Any]]:
        return self._states()
