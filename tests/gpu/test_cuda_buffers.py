"""``deployments.runtime.backends.cuda`` on a real GPU: checked calls, owned streams and grow-only buffers.

Needs only cuda-python and a CUDA device (no TensorRT); the pointer/stream test also uses
PyTorch, where installed, to run a real kernel on this module's memory and stream.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from deployments.runtime.backends import cuda
from tests.gpu.conftest import requires_cuda

pytestmark = requires_cuda

MiB = 1 << 20


def round_trip(memory: cuda.CudaMemory, stream: cuda.Stream, data: np.ndarray,
               device: cuda.DeviceBuffer, host_in: cuda.PinnedBuffer, host_out: cuda.PinnedBuffer) -> np.ndarray:
    """host_in -> device -> host_out on ``stream``; returns a copy of what came back."""
    for buf in (device, host_in, host_out):
        buf.ensure(data.nbytes)
    host_in.view(data.dtype, data.shape)[...] = data
    memory.copy_to_device(device, host_in, data.nbytes, stream)
    memory.copy_to_host(host_out, device, data.nbytes, stream)
    stream.synchronize()
    return host_out.view(data.dtype, data.shape).copy()


def test_the_device_reports_its_name_compute_capability_and_memory():
    major, minor = cuda.compute_capability(0)
    free, total = cuda.mem_get_info()
    print(f"\ndevice 0: {cuda.device_name(0)}, compute capability {major}.{minor}, "
          f"{free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB")
    assert cuda.device_count() >= 1 and major >= 7 and 0 < free <= total


def test_a_device_buffer_grows_only_and_gives_its_memory_back_on_close():
    free_start, _ = cuda.mem_get_info()
    buf = cuda.DeviceBuffer()
    assert buf.ensure(256 * MiB) and buf.nbytes == 256 * MiB and buf.ptr
    taken = free_start - cuda.mem_get_info()[0]
    assert taken >= 256 * MiB
    first_ptr = buf.ptr
    assert not buf.ensure(1 * MiB) and buf.ptr == first_ptr  # smaller: reused
    assert buf.ensure(512 * MiB) and buf.allocations == 2  # larger: reallocated
    buf.close()
    buf.close()  # idempotent
    still_held = free_start - cuda.mem_get_info()[0]
    print(f"\n256 MiB buffer took {taken / MiB:.1f} MiB of device memory; after growing to 512 MiB "
          f"and close(), {still_held / MiB:.1f} MiB is still held")
    assert abs(still_held) <= 4 * MiB


def test_pinned_memory_round_trips_through_the_device_on_an_own_stream():
    memory = cuda.CudaMemory()
    data = np.random.default_rng(0).standard_normal((32, 3, 224, 224)).astype(np.float32)  # 18.4 MiB
    with cuda.Stream() as stream, cuda.DeviceBuffer() as device, cuda.PinnedBuffer() as a, cuda.PinnedBuffer() as b:
        assert stream.handle != 0
        out = round_trip(memory, stream, data, device, a, b)
    np.testing.assert_array_equal(out, data)


def test_a_failed_allocation_raises_cuda_error_naming_the_call_and_error():
    with pytest.raises(cuda.CudaError, match=r"cudaMalloc\(\d+\) failed: cudaErrorMemoryAllocation \(2\)"):
        cuda.DeviceBuffer().ensure(1 << 50)  # 1 PiB: refused at once by cudaMalloc
    buf = cuda.DeviceBuffer(1 * MiB)  # the runtime is still healthy afterwards
    buf.close()


def test_a_closed_stream_refuses_use_and_closes_once():
    stream = cuda.Stream()
    stream.synchronize()
    stream.close()
    stream.close()
    with pytest.raises(cuda.CudaError, match="stream used after close"):
        _ = stream.handle


def test_threads_with_their_own_streams_and_buffers_never_mix_data():
    memory = cuda.CudaMemory()
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            with cuda.Stream() as stream, cuda.DeviceBuffer() as device, cuda.PinnedBuffer() as a, \
                    cuda.PinnedBuffer() as b:
                for _ in range(25):
                    data = rng.standard_normal(int(rng.integers(1, 1 << 20))).astype(np.float32)
                    np.testing.assert_array_equal(round_trip(memory, stream, data, device, a, b), data)
        except BaseException as e:  # noqa: BLE001  (collected and re-raised below)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_device_pointers_and_stream_handles_work_with_a_real_kernel():
    torch = pytest.importorskip("torch", reason="PyTorch runs the kernel in this test")

    class DeviceArray:  # exposes a DeviceBuffer to PyTorch (Numba's __cuda_array_interface__ v3)
        def __init__(self, buf: cuda.DeviceBuffer, shape: tuple[int, ...], stream: cuda.Stream) -> None:
            self.__cuda_array_interface__ = {"shape": shape, "typestr": "<f4", "data": (buf.ptr, False),
                                             "version": 3, "stream": stream.handle}

    memory = cuda.CudaMemory()
    data = np.arange(1 << 20, dtype=np.float32)
    with cuda.Stream() as stream, cuda.DeviceBuffer(data.nbytes) as device, \
            cuda.PinnedBuffer(data.nbytes) as host:
        host.view(data.dtype, data.shape)[...] = data
        memory.copy_to_device(device, host, data.nbytes, stream)
        with torch.cuda.stream(torch.cuda.ExternalStream(stream.handle)):
            tensor = torch.as_tensor(DeviceArray(device, data.shape, stream), device="cuda")
            tensor.mul_(2).add_(1)  # in place, on our stream, in our memory
        memory.copy_to_host(host, device, data.nbytes, stream)
        stream.synchronize()
        np.testing.assert_array_equal(host.view(data.dtype, data.shape), data * 2 + 1)
