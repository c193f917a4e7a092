"""CUDA runtime through cuda-python (``cuda.bindings.runtime``): checked calls and owned buffers.

cuda-python returns ``(err, *result)`` tuples instead of raising; ``check`` turns a non-success
``err`` into ``CudaError`` naming the call and the CUDA error (``cudaErrorMemoryAllocation``).
``Stream``, ``DeviceBuffer`` and ``PinnedBuffer`` own what they allocate and free it in
``close()`` (also usable as context managers); the buffers are grow-only: ``ensure(nbytes)``
reallocates only when asked for more than they hold, so a request at the profile's max
shape allocates once and smaller requests reuse it.

``CudaMemory`` bundles these behind the small surface that ``tensorrt_engine`` uses (make a
stream or a buffer, copy asynchronously, read free memory), so a fake can stand in for it.

The module imports without cuda-python; the first call that needs it raises ``CudaError``.
"""

from __future__ import annotations

import ctypes
import math
import threading
from types import ModuleType
from typing import Any, Protocol

import numpy as np

from ..contract.errors import EngineFault, InferenceError

# Allocations are rounded up to this many bytes (cudaMalloc itself aligns to 256).
ALIGN_BYTES = 256


class CudaError(InferenceError):
    """A CUDA runtime call failed (HTTP 500); the message names the call and the CUDA error."""


def _runtime() -> ModuleType:
    """``cuda.bindings.runtime`` (cuda-python >= 12.6), or ``cuda.cudart`` of older releases; the
    calling thread's capture mode relaxed first (``relax_capture_mode``).

    Raises:
        CudaError: cuda-python is not installed.
    """
    try:
        from cuda.bindings import runtime  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        try:
            from cuda import cudart as runtime  # type: ignore[import-not-found,no-redef,attr-defined,unused-ignore]
        except ImportError:
            raise CudaError("cuda-python is not installed (pip install cuda-bindings)") from None
    relax_capture_mode(runtime)
    return runtime


_THREAD = threading.local()


def relax_capture_mode(runtime: ModuleType | None = None) -> None:
    """Let this thread make any CUDA call while another thread captures a CUDA graph.

    ONNX Runtime captures a context's graph (``onnxruntime_cuda.cuda_graphs``) in CUDA's global
    mode, in which a call another thread makes that CUDA deems unsafe during a capture (a copy
    from pageable memory, a ``cudaMalloc``, a synchronize) fails, and the capture with it: with two
    contexts running at once, one request's capture failed another's run. A thread in relaxed
    mode may make them; every thread that touches CUDA here sets it once, before its first call
    (``_runtime``, the copies, every ONNX Runtime CUDA run). Our streams are non-blocking, so
    none of those calls waits on a capturing stream. Where no device answers, nothing is set.
    """
    if getattr(_THREAD, "relaxed", False):
        return
    _THREAD.relaxed = True
    try:
        rt = runtime if runtime is not None else _runtime()
        rt.cudaThreadExchangeStreamCaptureMode(rt.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed)
    except Exception:  # no cuda-python, driver or device: no capture can be under way either
        pass


def error_name(err: Any) -> str:
    """The CUDA error's name, e.g. ``cudaErrorInvalidValue``; ``str(err)`` when it has none."""
    return str(getattr(err, "name", err))


def check(result: Any, call: str) -> Any:
    """Unpack a cuda-python ``(err, *values)`` tuple, raising on a non-success ``err``.

    Args:
        result: what the cuda-python call returned: ``(err,)``, ``(err, value)`` or
            ``(err, v1, v2, ...)``.
        call: the call's name for the message, e.g. ``"cudaMalloc(1048576)"``.

    Returns:
        None, the single value, or a tuple of the values.

    Raises:
        CudaError: ``err`` is not ``cudaSuccess`` (0); the message is
            ``"<call> failed: <cuda error name> (<code>)"``.
    """
    err, *values = result
    if int(err) != 0:
        raise CudaError(f"{call} failed: {error_name(err)} ({int(err)})")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _round_up(nbytes: int) -> int:
    return max(ALIGN_BYTES, -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES)


def device_count() -> int:
    """Number of visible CUDA devices; 0 where cuda-python, a driver or a device is missing."""
    try:
        rt = _runtime()
    except CudaError:
        return 0
    err, count = rt.cudaGetDeviceCount()
    return int(count) if int(err) == 0 else 0


def compute_capability(device: int = 0) -> tuple[int, int]:
    """``(major, minor)`` compute capability of ``device``, e.g. ``(9, 0)`` for an H200.

    Raises:
        CudaError: no driver or no such device.
    """
    rt = _runtime()
    attr = rt.cudaDeviceAttr
    major = check(rt.cudaDeviceGetAttribute(attr.cudaDevAttrComputeCapabilityMajor, device),
                  f"cudaDeviceGetAttribute(ComputeCapabilityMajor, {device})")
    minor = check(rt.cudaDeviceGetAttribute(attr.cudaDevAttrComputeCapabilityMinor, device),
                  f"cudaDeviceGetAttribute(ComputeCapabilityMinor, {device})")
    return int(major), int(minor)


def device_name(device: int = 0) -> str:
    """The device's marketing name, e.g. ``"NVIDIA H200"``.

    Raises:
        CudaError: no driver or no such device.
    """
    rt = _runtime()
    props = check(rt.cudaGetDeviceProperties(device), f"cudaGetDeviceProperties({device})")
    name = props.name
    return (name.split(b"\0", 1)[0].decode() if isinstance(name, bytes) else str(name)).strip()


# How a host thread waits for the GPU (``cudaSetDeviceFlags``'s scheduling flags). CUDA's
# ``auto`` spins a core for the whole wait when the process has fewer contexts than the machine
# has cores, i.e. always here; ``blocking`` sleeps until the GPU is done. Measured on the H200
# (docs/performance.md, "Waiting for the GPU"): with 8 processes sharing the GPU, resnet18 at batch 1
# costs 5.3 ms of CPU per call spinning against 2.1 ms blocking, at the same calls/s.
WAIT_MODES = {"auto": "cudaDeviceScheduleAuto", "spin": "cudaDeviceScheduleSpin",
              "yield": "cudaDeviceScheduleYield", "blocking": "cudaDeviceScheduleBlockingSync"}


def set_wait(mode: str) -> None:
    """Make this process's threads wait for the current device in ``mode`` (``WAIT_MODES``).

    Call it before the process's CUDA context exists (before any stream, buffer or session):
    CUDA fixes the flags when the primary context is made.

    Raises:
        ValueError: ``mode`` is not one of ``WAIT_MODES``.
        CudaError: cuda-python is missing, or CUDA refused the flags (e.g. the context exists).
    """
    if mode not in WAIT_MODES:
        raise ValueError(f"CUDA wait mode '{mode}' is not one of {sorted(WAIT_MODES)}")
    rt = _runtime()
    check(rt.cudaSetDeviceFlags(int(getattr(rt, WAIT_MODES[mode]))), f"cudaSetDeviceFlags({WAIT_MODES[mode]})")


def mem_get_info() -> tuple[int, int]:
    """``(free_bytes, total_bytes)`` of the current device (``cudaMemGetInfo``).

    Raises:
        CudaError: no driver or device.
    """
    free, total = check(_runtime().cudaMemGetInfo(), "cudaMemGetInfo")
    return int(free), int(total)


class Stream:
    """An owned non-blocking CUDA stream; ``handle`` is the integer TensorRT takes.

    Raises:
        CudaError: at creation, or from ``synchronize``/``close``.
    """

    def __init__(self) -> None:
        rt = _runtime()
        self._rt = rt
        self._stream: Any = check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking),
                                  "cudaStreamCreateWithFlags(cudaStreamNonBlocking)")

    @property
    def handle(self) -> int:
        if self._stream is None:
            raise CudaError("stream used after close()")
        return int(self._stream)

    def synchronize(self) -> None:
        """Block until the stream's work is done; a failed kernel surfaces here."""
        check(self._rt.cudaStreamSynchronize(self._stream), "cudaStreamSynchronize")

    def close(self) -> None:
        """Destroy the stream (once; later calls do nothing)."""
        stream, self._stream = self._stream, None
        if stream is not None:
            check(self._rt.cudaStreamDestroy(stream), "cudaStreamDestroy")

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Buffer:
    """Grow-only allocation; subclasses name the allocate/free calls."""

    _alloc_call = ""
    _free_call = ""

    def __init__(self, nbytes: int = 0) -> None:
        self._rt = _runtime()
        self.ptr = 0
        self.nbytes = 0
        self.allocations = 0  # how many times memory was (re)allocated; tests read it
        if nbytes:
            self.ensure(nbytes)

    def _alloc(self, nbytes: int) -> int:
        raise NotImplementedError

    def _free(self, ptr: int) -> None:
        raise NotImplementedError

    def ensure(self, nbytes: int) -> bool:
        """Make room for at least ``nbytes``; returns True when it (re)allocated.

        Grow-only: a smaller request keeps the buffer. Reallocating discards the old contents.

        Raises:
            CudaError: the allocation failed (e.g. ``cudaErrorMemoryAllocation``).
        """
        if nbytes <= self.nbytes and self.ptr:
            return False
        size = _round_up(nbytes)
        old, self.ptr, self.nbytes = self.ptr, 0, 0
        if old:
            self._free(old)
        self.ptr = self._alloc(size)
        self.nbytes = size
        self.allocations += 1
        return True

    def close(self) -> None:
        """Free the memory (once; later calls do nothing)."""
        ptr, self.ptr, self.nbytes = self.ptr, 0, 0
        if ptr:
            self._free(ptr)

    def __enter__(self) -> "_Buffer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DeviceBuffer(_Buffer):
    """Device memory from ``cudaMalloc``; ``ptr`` is the device address (int)."""

    def _alloc(self, nbytes: int) -> int:
        return int(check(self._rt.cudaMalloc(nbytes), f"cudaMalloc({nbytes})"))

    def _free(self, ptr: int) -> None:
        check(self._rt.cudaFree(ptr), "cudaFree")


class PinnedBuffer(_Buffer):
    """Page-locked host memory from ``cudaMallocHost`` (fast, truly async copies)."""

    def _alloc(self, nbytes: int) -> int:
        return int(check(self._rt.cudaMallocHost(nbytes), f"cudaMallocHost({nbytes})"))

    def _free(self, ptr: int) -> None:
        check(self._rt.cudaFreeHost(ptr), "cudaFreeHost")

    def view(self, dtype: np.dtype | type, shape: tuple[int, ...]) -> np.ndarray:
        """A numpy array over the first ``prod(shape) * itemsize`` bytes (no copy).

        The view is valid until the next ``ensure`` that reallocates, or ``close``: copy
        results out before the buffer is reused.

        Raises:
            ValueError: the buffer is smaller than the view.
        """
        dtype = np.dtype(dtype)
        count = math.prod(shape)
        nbytes = count * dtype.itemsize
        if nbytes > self.nbytes:
            raise ValueError(f"view of {nbytes} bytes over a {self.nbytes}-byte pinned buffer")
        if count == 0:
            return np.empty(shape, dtype)
        raw = (ctypes.c_uint8 * nbytes).from_address(self.ptr)
        return np.frombuffer(memoryview(raw), dtype=dtype, count=count).reshape(shape)


class HostAddress(Protocol):
    """Host memory a copy reads or writes: an address (a pinned buffer, or a numpy array's data)."""

    @property
    def ptr(self) -> int: ...


class HostBufferLike(Protocol):
    ptr: int
    nbytes: int

    def ensure(self, nbytes: int) -> bool: ...

    def view(self, dtype: np.dtype | type, shape: tuple[int, ...]) -> np.ndarray: ...

    def close(self) -> None: ...


class DeviceBufferLike(Protocol):
    ptr: int
    nbytes: int

    def ensure(self, nbytes: int) -> bool: ...

    def close(self) -> None: ...


class StreamLike(Protocol):
    @property
    def handle(self) -> int: ...

    def synchronize(self) -> None: ...

    def close(self) -> None: ...


class MemoryApi(Protocol):
    """What the TensorRT execution contexts need from CUDA; ``CudaMemory`` is the real one."""

    def stream(self) -> StreamLike: ...

    def device_buffer(self) -> DeviceBufferLike: ...

    def host_buffer(self) -> HostBufferLike: ...

    def copy_to_device(self, dst: DeviceBufferLike, src: HostAddress, nbytes: int,
                       stream: StreamLike) -> None: ...

    def copy_to_host(self, dst: HostAddress, src: DeviceBufferLike, nbytes: int,
                     stream: StreamLike) -> None: ...

    def mem_get_info(self) -> tuple[int, int]: ...


class CudaMemory:
    """The real ``MemoryApi``: cuda-python streams, cudaMalloc/cudaMallocHost buffers and
    ``cudaMemcpyAsync`` copies on the caller's stream."""

    def __init__(self) -> None:
        self._rt = _runtime()

    def stream(self) -> Stream:
        return Stream()

    def device_buffer(self) -> DeviceBuffer:
        return DeviceBuffer()

    def host_buffer(self) -> PinnedBuffer:
        return PinnedBuffer()

    def copy_to_device(self, dst: DeviceBufferLike, src: HostAddress, nbytes: int,
                       stream: StreamLike) -> None:
        """Enqueue ``nbytes`` host -> device on ``stream``.

        Raises:
            CudaError: ``cudaMemcpyAsync`` failed.
        """
        self._copy_async(dst.ptr, src.ptr, nbytes, "HostToDevice", stream)

    def copy_to_host(self, dst: HostAddress, src: DeviceBufferLike, nbytes: int,
                     stream: StreamLike) -> None:
        """Enqueue ``nbytes`` device -> host on ``stream``.

        Raises:
            CudaError: ``cudaMemcpyAsync`` failed.
        """
        self._copy_async(dst.ptr, src.ptr, nbytes, "DeviceToHost", stream)

    def copy_on_device(self, dst: int, src: int, nbytes: int, stream: StreamLike) -> None:
        """Enqueue ``nbytes`` device -> device (addresses) on ``stream``.

        Raises:
            CudaError: ``cudaMemcpyAsync`` failed.
        """
        self._copy_async(dst, src, nbytes, "DeviceToDevice", stream)

    def _copy_async(self, dst: int, src: int, nbytes: int, direction: str, stream: StreamLike) -> None:
        relax_capture_mode(self._rt)
        rt = self._rt
        kind = getattr(rt.cudaMemcpyKind, f"cudaMemcpy{direction}")
        check(rt.cudaMemcpyAsync(dst, src, nbytes, kind, stream.handle), f"cudaMemcpyAsync({direction}, {nbytes})")

    def mem_get_info(self) -> tuple[int, int]:
        return mem_get_info()


def check_device(memory: MemoryApi, where: str) -> None:
    """Probe the device with one CUDA call (``cudaMemGetInfo``): after a sticky error
    (``cudaErrorIllegalAddress``, ``cudaErrorLaunchFailure``, ...) every CUDA call in the process
    fails until it restarts, so a failing probe means no request can succeed here.

    Raises:
        EngineFault: the probe failed; the message starts with ``where`` and names the CUDA error.
    """
    try:
        memory.mem_get_info()
    except InferenceError as e:  # CudaError
        raise EngineFault(f"{where}: the CUDA device is unusable ({e.message}); "
                          "the process must restart") from None
