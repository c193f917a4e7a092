"""CUDA shared-memory regions opened in this process: a client's ``cudaIpcMemHandle_t`` opened
once per (handle, device) with ``cudaIpcOpenMemHandle`` and closed with ``cudaIpcCloseMemHandle``
once its region is unregistered and no request uses it.

``IpcOpenings`` keeps the bookkeeping (open once, count the requests that use an opening, close
when asked and free) over an ``IpcOpener``; ``CudaIpcOpener`` is the real one (cuda-python), a
fake stands in for it in unit tests. The handle is opened on the device the model runs on (as
this process numbers devices: under Ray's ``CUDA_VISIBLE_DEVICES`` it is not the client's number);
a handle of another GPU opens there with peer access where the GPUs allow it
(``cudaIpcMemLazyEnablePeerAccess``), else the open fails and the request answers 400.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from typing import Collection, Iterable, Iterator, Protocol

from ..contract.errors import SharedMemoryError
from .cuda import CudaError, _runtime, check

logger = logging.getLogger(__name__)

HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)


class IpcOpener(Protocol):
    def open(self, handle: bytes, device_id: int) -> int:
        """The device address of the memory ``handle`` exports, opened on ``device_id``."""
        ...

    def close(self, address: int) -> None: ...


class CudaIpcOpener:
    """``cudaIpcOpenMemHandle`` / ``cudaIpcCloseMemHandle`` through cuda-python.

    Raises:
        CudaError: cuda-python is missing, or a call failed (the message names it).
    """

    def open(self, handle: bytes, device_id: int) -> int:
        rt = _runtime()
        check(rt.cudaSetDevice(device_id), f"cudaSetDevice({device_id})")
        raw = rt.cudaIpcMemHandle_t()
        ctypes.memmove(raw.getPtr(), handle, HANDLE_BYTES)  # cuda-bindings 13 exposes only its address
        return int(check(rt.cudaIpcOpenMemHandle(raw, rt.cudaIpcMemLazyEnablePeerAccess),
                         f"cudaIpcOpenMemHandle(device {device_id})"))

    def close(self, address: int) -> None:
        check(_runtime().cudaIpcCloseMemHandle(address), "cudaIpcCloseMemHandle")


class _Opening:
    def __init__(self, address: int) -> None:
        self.address = address
        self.users = 0
        self.stale = False  # its region was unregistered: close when the last user leaves


class IpcOpenings:
    """This process's opened CUDA regions, by (handle, device): each opened once, on first use
    (``lease``), and closed by ``close`` (its region was unregistered) or ``keep_only`` (every
    handle no longer registered) at once when no request uses it, else when the last one ends.

    Args:
        opener: opens and closes handles (``CudaIpcOpener``).
    """

    def __init__(self, opener: IpcOpener | None = None) -> None:
        self._opener = opener or CudaIpcOpener()
        self._lock = threading.Lock()
        self._open: dict[tuple[bytes, int], _Opening] = {}

    @property
    def opened(self) -> int:
        """How many openings this process holds."""
        return len(self._open)

    @contextlib.contextmanager
    def lease(self, handle: bytes, device_id: int, region: str) -> Iterator[int]:
        """While entered: the base address of ``handle``'s memory on ``device_id`` (opened on
        first use), kept open until exit. ``region`` names it in messages.

        Raises:
            SharedMemoryError: the handle cannot be opened on that device (400, naming the CUDA
                error: a handle of another machine, or of memory already freed, or of a GPU this
                one cannot reach).
        """
        key = (handle, device_id)
        with self._lock:
            opening = self._open.get(key)
            if opening is None:
                try:
                    address = self._opener.open(handle, device_id)
                except CudaError as e:
                    raise SharedMemoryError(
                        f"Unable to open CUDA shared memory region: '{region}'; its handle does not open on CUDA "
                        f"device {device_id} of this replica ({e.message}): register a handle of memory on the GPU "
                        "that serves the model, from a process on the same host, and keep that memory "
                        "allocated") from None
                opening = self._open[key] = _Opening(address)
            opening.stale = False  # registered again while a request still used it: the same memory
            opening.users += 1
        try:
            yield opening.address
        finally:
            with self._lock:
                opening.users -= 1
                if opening.stale and opening.users == 0:
                    self._close(key, opening)

    def close(self, handle: bytes) -> None:
        """``handle``'s region was unregistered: close its openings (on every device) now, or
        when the requests using them end."""
        with self._lock:
            for key in [k for k in self._open if k[0] == handle]:
                self._retire(key)

    def keys(self) -> set[tuple[bytes, int]]:
        """The (handle, device) of every opening now (``keep_only``'s ``among``)."""
        with self._lock:
            return set(self._open)

    def keep_only(self, handles: Iterable[bytes], among: Collection[tuple[bytes, int]] | None = None) -> int:
        """Close every opening whose handle is not in ``handles`` (the registered ones), as
        ``close``, of those in ``among`` (``keys()`` taken before ``handles`` was read: an
        opening made since, of a region registered meanwhile, stays; None: every opening);
        returns how many openings stay."""
        live = set(handles)
        with self._lock:
            for key in [k for k in self._open if k[0] not in live and (among is None or k in among)]:
                self._retire(key)
            return len(self._open)

    def _retire(self, key: tuple[bytes, int]) -> None:
        opening = self._open[key]
        opening.stale = True
        if opening.users == 0:
            self._close(key, opening)

    def _close(self, key: tuple[bytes, int], opening: _Opening) -> None:
        del self._open[key]
        try:
            self._opener.close(opening.address)
        except CudaError as e:  # the mapping is gone from the books either way
            logger.warning("CUDA shared memory: closing an opened handle failed: %s", e.message)

    def close_all(self) -> None:
        """Close every opening no request uses (the process stops serving)."""
        with self._lock:
            for key in list(self._open):
                self._retire(key)
