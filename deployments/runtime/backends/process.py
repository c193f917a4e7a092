"""Reading this process's memory: resident set size, and returning freed heap to the OS."""

from __future__ import annotations

import ctypes
import ctypes.util
import os


def process_rss_bytes() -> int:
    """Resident set size of this process in bytes, from ``/proc/self/statm`` (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _load_libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


_LIBC = _load_libc()


def release_free_heap() -> None:
    """Return freed heap memory to the OS (glibc ``malloc_trim(0)``); a no-op elsewhere.

    Called before each RSS reading so that memory freed earlier (an evicted model, a parsed
    ONNX protobuf) and kept by the allocator does not absorb a later growth.
    """
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def measured_rss_bytes() -> int:
    """``process_rss_bytes()`` after ``release_free_heap()``."""
    release_free_heap()
    return process_rss_bytes()
