"""ContextThread: the one thread an execution context runs every call on.

ONNX Runtime keeps CUDA graphs per calling thread, so a context with graphs runs each request
on a thread of its own (``onnxruntime_cuda``), and ``ModelHost.call`` hands a request straight to
the thread of the context that serves it. That hand-off is on every request's path, so it is a
plain thread reading a ``queue.SimpleQueue``: ``submit`` puts the work there and returns (no
future, no executor bookkeeping); the work itself reports its outcome (``ModelHost``'s queued
call settles its caller's asyncio future).
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

logger = logging.getLogger(__name__)


class ContextThread:
    """A thread that runs the work handed to it, one piece at a time, in order.

    ``submit`` hands it work without waiting (the work reports its own outcome: an exception it
    lets escape is logged); ``call`` runs a function there and returns what it returned, or
    raises what it raised (on that thread itself it just calls it); ``stop`` ends the thread
    once the work already handed to it is done. A daemon thread: a process that exits with a
    context still open does not wait for it.
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[..., Any], tuple] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _stopped against a submit racing a stop
        self._stopped = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()
        self._ident = self._thread.ident

    def _serve(self) -> None:
        while (work := self._queue.get()) is not None:
            fn, args = work
            try:
                fn(*args)
            except BaseException:  # submitted work settles its own caller; this is a bug in it
                logger.exception("work on context thread %s raised", self._thread.name)
            del work, fn, args  # keep no reference to the last request's data while waiting

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` there without waiting for it. Raises RuntimeError after ``stop``."""
        with self._lock:
            if self._stopped:
                raise RuntimeError(f"context thread {self._thread.name} is stopped")
            self._queue.put((fn, args))

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on this thread: its result, or what it raised."""
        if threading.get_ident() == self._ident:
            return fn(*args)
        done: Future = Future()

        def run() -> None:
            try:
                done.set_result(fn(*args))
            except BaseException as e:
                done.set_exception(e)

        self.submit(run)
        return done.result()

    def stop(self) -> None:
        """Let the thread end (its thread-local state with it) once the work handed to it is
        done; waits for that unless called on the thread itself; idempotent."""
        with self._lock:
            if not self._stopped:
                self._stopped = True
                self._queue.put(None)
        if threading.get_ident() != self._ident:
            self._thread.join()
