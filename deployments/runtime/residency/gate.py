"""Gate: counts the requests in flight through a door that can close (a model being unloaded)."""

from __future__ import annotations

import threading

from ..contract.errors import unloaded_model


class Gate:
    """Requests pass while the gate is open; ``close`` shuts it and waits for those inside.

    A dedicated model's deployment holds each request in it from arrival to answer (the
    dynamic batching queue included), so an unload never drops a request in flight: it
    waits for them, as the cache's eviction waits for its holders.
    """

    def __init__(self, name: str, open_: bool = True) -> None:
        self.name = name
        self._open = open_
        self._inside = 0
        self._cond = threading.Condition()

    @property
    def is_open(self) -> bool:
        return self._open

    def request(self) -> "Gate":
        """``with gate.request():`` holds the gate for one request.

        Raises:
            ModelNotReady: the gate is closed (the model is unloaded).
        """
        return self

    def __enter__(self) -> None:
        with self._cond:
            if not self._open:
                raise unloaded_model(self.name)
            self._inside += 1

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._inside -= 1
            if not self._inside:  # the last one out wakes a ``close`` waiting for it (if any)
                self._cond.notify_all()

    def close(self) -> None:
        """Refuse new requests and wait (blocking) for the requests inside to leave."""
        with self._cond:
            self._open = False
            self._cond.wait_for(lambda: self._inside == 0)

    def open(self) -> None:
        with self._cond:
            self._open = True
