"""The model replicas' part: a recorder per replica process and the wrapper of ``infer``."""

from __future__ import annotations

import functools
from typing import Any, Awaitable, Callable

from .metrics import CacheRecorder, PlacementRecorder, ReplicaRecorder
from .options import start


def replica_recorder(metrics: dict[str, Any] | None) -> ReplicaRecorder | None:
    """This replica's recorder (``metrics``: ``MetricsOptions`` as a dict); None when off."""
    return None if start(metrics) is None else ReplicaRecorder()


def cache_recorder(recorder: ReplicaRecorder | None, budget_bytes: int | None) -> Callable[[dict[str, Any]], None] | None:
    """``ModelCache(on_event=...)`` for this pool replica (label ``replica``: Serve's replica id)."""
    if recorder is None:
        return None
    from ray import serve

    cache = CacheRecorder(serve.get_replica_context().replica_id.unique_id)
    cache.status(0, 0, budget_bytes)
    return cache.on_event


def placement_recorder(metrics: dict[str, Any] | None) -> PlacementRecorder | None:
    """The placement deployment's recorder of its decisions (``metrics``: ``MetricsOptions`` as
    a dict); None when off."""
    return None if start(metrics) is None else PlacementRecorder()


def observe_replica_infer(key: Callable[[Any], tuple[str, int | None]]) -> Callable:
    """Wrap a deployment's ``async infer(self, *args)`` in ``self.recorder.request(model,
    version)``; ``key(self, *args)`` names the model and version (version None:
    ``self.versions[name]``)."""

    def decorate(infer: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        @functools.wraps(infer)
        async def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            recorder: ReplicaRecorder | None = self.recorder
            if recorder is None:
                return await infer(self, *args, **kwargs)
            name, version = key(self, *args)
            if version is None:
                version = self.versions.get(name)
                if version is None:  # not a model of this pool: infer raises ModelNotFound
                    return await infer(self, *args, **kwargs)
            with recorder.request(name, version):
                return await infer(self, *args, **kwargs)

        return wrapper

    return decorate


def observed_steps(infer: Callable[..., Awaitable[Any]], metrics: dict[str, Any] | None,
                   versions: dict[str, str]) -> Callable[..., Awaitable[Any]]:
    """A pipeline's step caller that counts each step as a request of its model, as Triton
    counts an ensemble's composing models (success / failure and duration; no decode or
    encode happens between steps). ``versions``: step model -> served version."""
    if start(metrics) is None:
        return infer
    import time

    from ..protocol.errors import error_status
    from .metrics import RequestTiming, RouterRecorder

    recorder = RouterRecorder()

    async def step(name: str, *args: Any, **kwargs: Any) -> Any:
        timing = RequestTiming(time.perf_counter())
        try:
            result = await infer(name, *args, **kwargs)
        except BaseException as e:
            if name in versions:
                recorder.finished(name, versions[name], error_status(e)[0] if isinstance(e, Exception) else 499, timing)
            raise
        if name in versions:
            recorder.finished(name, versions[name], 200, timing)
        return result

    return step
