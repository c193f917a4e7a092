"""The client side of Triton's CUDA shared memory in a process of its own, as a real client is:
CUDA does not open a ``cudaIpcMemHandle_t`` in the process that exported it
(``cudaIpcOpenMemHandle`` there fails, ``cudaErrorDeviceUninitialized``), so a test that serves
a region in this process must make it in another.

``CudaClient`` starts one spawned worker (``ProcessPoolExecutor`` of one process: the same
process runs every call, and no CUDA state is forked) that makes each region with tritonclient's
``cuda_shared_memory`` (cudaMalloc + cudaIpcGetMemHandle), keeps it allocated, writes inputs
into it and reads it back on request, and frees every region when the client closes. An error
in the worker is raised here, with the worker's traceback as its cause.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Sequence

import numpy as np

CUDA_REGIONS = "tritonclient.utils.cuda_shared_memory"

# The worker's state: the regions module and the regions made, by name (handle, byte size).
_regions: Any = None
_made: dict[str, tuple[Any, int]] = {}


def _start(module: str) -> None:
    global _regions
    _regions = importlib.import_module(module)


def _create(name: str, byte_size: int, device_id: int) -> str:
    handle = _regions.create_shared_memory_region(name, byte_size, device_id)
    _made[name] = (handle, byte_size)
    return _regions.get_raw_handle(handle).decode()


def _write(name: str, arrays: Sequence[np.ndarray]) -> None:
    _regions.set_shared_memory_region(_made[name][0], list(arrays))


def _read(name: str) -> bytes:
    handle, byte_size = _made[name]
    return _regions.get_contents_as_numpy(handle, np.uint8, [byte_size]).tobytes()


def _destroy_all() -> None:
    while _made:
        _regions.destroy_shared_memory_region(_made.popitem()[1][0])


class CudaClient:
    """A CUDA shared-memory client in another process; use as a context manager (``close``).

    Args:
        regions: the module that makes regions, by import name: tritonclient's
            ``cuda_shared_memory`` (its ``create_shared_memory_region``, ``get_raw_handle``,
            ``set_shared_memory_region``, ``get_contents_as_numpy``,
            ``destroy_shared_memory_region``); a fake of the same functions in unit tests.
        timeout_s: seconds one call may take (the first one starts the worker).

    Raises (every call):
        TimeoutError: the worker did not answer within ``timeout_s``.
        BrokenProcessPool: the worker died.
        Exception: what the regions module raised in the worker.
    """

    def __init__(self, regions: str = CUDA_REGIONS, timeout_s: float = 120.0) -> None:
        self.timeout_s = timeout_s
        self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_start, initargs=(regions,))

    def _call(self, fn, *args):
        return self._pool.submit(fn, *args).result(timeout=self.timeout_s)

    @property
    def pid(self) -> int:
        """The worker's process id (never this process's)."""
        return self._call(os.getpid)

    def create(self, name: str, byte_size: int, device_id: int = 0) -> str:
        """Make region ``name`` of ``byte_size`` bytes on GPU ``device_id``; returns its
        ``cudaIpcMemHandle_t`` in base64, as the register request's ``raw_handle.b64`` takes it."""
        return self._call(_create, name, byte_size, device_id)

    def write(self, name: str, arrays: Sequence[np.ndarray]) -> None:
        """Write ``arrays`` into region ``name`` one after another from its byte 0 (row-major)."""
        self._call(_write, name, list(arrays))

    def read(self, name: str) -> bytes:
        """Region ``name``'s bytes, all of them."""
        return self._call(_read, name)

    def close(self) -> None:
        """Free every region made, then stop the worker."""
        try:
            self._call(_destroy_all)
        finally:
            self._pool.shutdown()

    def __enter__(self) -> "CudaClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
