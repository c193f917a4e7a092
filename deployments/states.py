"""The serving state of each model in one routes object: one ``ModelState`` per model; no Ray.

A model's status decides how its requests are answered (``routes.V2Routes._not_ready``) and
what the repository index says of it:

    NOT_LOADED   in the repository, not loaded (explicit model control)   404 "not loaded"  index UNAVAILABLE
    LOADING      loaded; no replica answered yet, or it lost them all     503 "not ready"   index LOADING
    READY        loaded and answered by a replica                         served            index READY
    UNLOADED     unloaded through the repository API (or a failed load)   503 "unloaded"    index UNAVAILABLE

A name this object has never recorded is NOT_LOADED. A load or unload going on through the
repository API is the router's own (``changing``), shown over this state in the index.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable


class Status(enum.Enum):
    NOT_LOADED = "NOT_LOADED"
    LOADING = "LOADING"
    READY = "READY"
    UNLOADED = "UNLOADED"

    @property
    def index_state(self) -> str:
        """The state Triton's repository index names (UNAVAILABLE, LOADING, READY)."""
        return "UNAVAILABLE" if self in (Status.NOT_LOADED, Status.UNLOADED) else self.value


LOADED = frozenset({Status.LOADING, Status.READY})


@dataclass(frozen=True)
class ModelState:
    """One model's status and why: an UNLOADED model's ``reason`` is why its load failed (None:
    unloaded through the API), a NOT_LOADED one's how to load it."""

    status: Status
    reason: str | None = None

    @property
    def index_reason(self) -> str | None:
        """The repository index's ``reason`` of an unavailable model."""
        return (self.reason or UNLOADED_REASON) if self.status is Status.UNLOADED else self.reason


def not_loaded_reason(name: str) -> str:
    return f"not loaded: POST /v2/repository/models/{name}/load loads it"


UNLOADED_REASON = "unloaded"  # Triton's reason for a model unloaded through the API


class ModelStates:
    """The ``ModelState`` of every model a routes object serves, and the transitions between them.

    Args:
        loaded: the models loaded at start.
        ready: those of them that serve at once (pool models: a pool replica loads on demand);
            the rest are LOADING until a replica answers (``answered``).
    """

    def __init__(self, loaded: Iterable[str], ready: Iterable[str] = ()) -> None:
        ready = set(ready)
        self._states: dict[str, ModelState] = {
            name: ModelState(Status.READY if name in ready else Status.LOADING) for name in loaded}

    def get(self, name: str) -> ModelState:
        return self._states.get(name) or ModelState(Status.NOT_LOADED, not_loaded_reason(name))

    def status(self, name: str) -> Status:
        return self.get(name).status

    def is_loaded(self, name: str) -> bool:
        """LOADING or READY: loaded, whether or not a replica serves it yet."""
        return self.status(name) in LOADED

    def is_ready(self, name: str) -> bool:
        return self.status(name) is Status.READY

    def names(self, *statuses: Status) -> set[str]:
        """The models recorded with one of ``statuses``."""
        return {name for name, state in self._states.items() if state.status in statuses}

    def _set(self, name: str, status: Status, reason: str | None = None) -> None:
        self._states[name] = ModelState(status, reason)

    # --- transitions ---------------------------------------------------------------------------
    def loaded(self, name: str) -> None:
        """A load applied by every replica (or a replica's own model loaded): READY."""
        self._set(name, Status.READY)

    def unloaded(self, name: str, reason: str | None = None) -> None:
        """Unloaded through the repository API, or its load failed (``reason`` says why): UNLOADED."""
        self._set(name, Status.UNLOADED, reason)

    def answered(self, name: str) -> None:
        """A replica of a LOADING model answered (or Serve counts one RUNNING): READY. Nothing
        changes for a model not loaded."""
        if self.status(name) is Status.LOADING:
            self._set(name, Status.READY)

    def lost(self, name: str) -> bool:
        """A READY model has no running replica now: LOADING (503 until one runs).

        Returns:
            Whether it was READY.
        """
        if self.status(name) is not Status.READY:
            return False
        self._set(name, Status.LOADING, "no running replica")
        return True
