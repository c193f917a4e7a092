"""Gate: counts the requests in flight through a door that can close (a model being unloaded)."""

from __future__ import annotations

import asyncio
import threading

from ..contract.errors import unloaded_model


class Gate:
    """Requests pass while the gate is open; ``close`` shuts it and waits for those inside.

    A dedicated model's deployment holds each request in it from arrival to answer (the
    dynamic batching queue included), so an unload never drops a request in flight: it
    waits for them, as the cache's eviction waits for its holders. A gate closed for a
    replacement (``close(replacing=True)``: a load takes a new version) keeps its requests
    waiting (``async with``) until it opens again or ``settle`` ends the replacement, as the
    pool's requests wait for a load that replaces their model's reading.
    """

    def __init__(self, name: str, open_: bool = True) -> None:
        self.name = name
        self._open = open_
        self._replacing = False
        self._inside = 0
        self._cond = threading.Condition()
        self._waiting: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    @property
    def is_open(self) -> bool:
        return self._open

    def request(self) -> "Gate":
        """``with gate.request():`` (or ``async with``, which waits out a replacement) holds
        the gate for one request.

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

    async def __aenter__(self) -> None:
        while True:
            loop = asyncio.get_running_loop()
            with self._cond:
                if self._open:
                    self._inside += 1
                    return
                if not self._replacing:
                    raise unloaded_model(self.name)
                woken = loop.create_future()
                self._waiting.append((loop, woken))
            await woken

    async def __aexit__(self, *exc: object) -> None:
        self.__exit__()

    def close(self, replacing: bool = False) -> None:
        """Refuse new requests (or, ``replacing``, hold them until ``open`` or ``settle``) and
        wait (blocking) for the requests inside to leave."""
        with self._cond:
            self._open, self._replacing = False, replacing
            self._cond.wait_for(lambda: self._inside == 0)

    def open(self) -> None:
        with self._cond:
            self._open = True
            self._wake()

    def settle(self) -> None:
        """End a replacement (``close(replacing=True)``): the requests it held go on, into an
        open gate or refused by a closed one."""
        with self._cond:
            self._wake()

    def _wake(self) -> None:
        self._replacing = False
        for loop, woken in self._waiting:
            loop.call_soon_threadsafe(lambda f=woken: f.done() or f.set_result(None))
        self._waiting.clear()
