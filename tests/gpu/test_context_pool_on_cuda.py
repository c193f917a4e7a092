"""``TensorRTEngine``/``TensorRTContext`` and ``ModelHost``'s pool with REAL CUDA memory and
streams, and a STAND-IN for TensorRT.

The H200 machine has CUDA, cuda-python and PyTorch but no TensorRT, so ``TorchCudaEngine`` /
``TorchExecutionContext`` (defined here) stand where ``trt.ICudaEngine`` /
``trt.IExecutionContext`` stand: ``execute_async_v3`` runs a PyTorch matmul on the stream
handle and device addresses it was given, as TensorRT would run its kernels. Everything else
is the shipped code: ``cuda.CudaMemory`` (cudaMalloc, cudaMallocHost, cudaMemcpyAsync),
per-context streams, grow-only buffers, checked booleans, copies back, synchronization.
"""

from __future__ import annotations

import enum
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from deployments.runtime.backends import cuda
from deployments.runtime.residency import host as host_module
from deployments.runtime.contract.config import ModelConfig
from deployments.runtime.residency.host import ModelHost
from deployments.runtime.contract.repository import ModelEntry
from deployments.runtime.backends.tensorrt import TensorRTEngine
from tests.gpu.conftest import CUDA_REASON

if CUDA_REASON:
    pytest.skip(CUDA_REASON, allow_module_level=True)
torch = pytest.importorskip("torch", reason="PyTorch stands in for TensorRT's kernels in this test")

K, M, MAX_BATCH = 4096, 1024, 32
MiB = 1 << 20


class DeviceArray:
    """A device address as a PyTorch tensor source (``__cuda_array_interface__`` v3)."""

    def __init__(self, ptr: int, shape: tuple[int, ...]) -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "<f4", "data": (ptr, False),
                                         "version": 3, "stream": None}


class TorchTensorIOMode(enum.Enum):
    INPUT = 1
    OUTPUT = 2


class TorchDataType(enum.Enum):
    FLOAT = 0


class TorchExecutionContext:
    """Stands where ``trt.IExecutionContext`` stands: y = x @ W + b, run by PyTorch on the GPU
    in the memory and on the stream TensorRTContext hands it."""

    def __init__(self, engine: "TorchCudaEngine") -> None:
        self.engine = engine
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}

    def set_optimization_profile_async(self, index: int, stream: int) -> bool:
        return index == 0

    def set_input_shape(self, name: str, shape) -> bool:
        ok = name == "x" and len(shape) == 2 and 1 <= shape[0] <= MAX_BATCH and shape[1] == K
        if ok:
            self.shapes[name] = tuple(shape)
        return ok

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        batch = self.shapes.get("x", (-1,))[0]
        return (batch, K) if name == "x" else (batch, M)

    def set_tensor_address(self, name: str, address: int) -> bool:
        self.addresses[name] = address
        return address != 0

    def execute_async_v3(self, stream_handle: int) -> bool:
        n = self.shapes["x"][0]
        with torch.cuda.stream(torch.cuda.ExternalStream(stream_handle)):
            x = torch.as_tensor(DeviceArray(self.addresses["x"], (n, K)), device="cuda")
            y = torch.as_tensor(DeviceArray(self.addresses["y"], (n, M)), device="cuda")
            torch.matmul(x, self.engine.weight, out=y)
            y.add_(self.engine.bias)
        return True


class TorchCudaEngine:
    """Stands where ``trt.ICudaEngine`` stands: input ``x`` (N, 4096), output ``y`` (N, 1024)."""

    num_io_tensors = 2
    num_optimization_profiles = 1
    device_memory_size_v2 = 0

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.weight_host = (rng.standard_normal((K, M)) / np.sqrt(K)).astype(np.float32)
        self.bias_host = rng.standard_normal(M).astype(np.float32)
        self.weight = torch.from_numpy(self.weight_host).cuda()
        self.bias = torch.from_numpy(self.bias_host).cuda()

    def get_tensor_name(self, index: int) -> str:
        return ("x", "y")[index]

    def get_tensor_mode(self, name: str) -> TorchTensorIOMode:
        return TorchTensorIOMode.INPUT if name == "x" else TorchTensorIOMode.OUTPUT

    def get_tensor_dtype(self, name: str) -> TorchDataType:
        return TorchDataType.FLOAT

    def get_tensor_profile_shape(self, name: str, index: int):
        return [(1, K), (8, K), (MAX_BATCH, K)]

    def get_device_memory_size_for_profile_v2(self, index: int) -> int:
        return 0

    def create_execution_context(self) -> TorchExecutionContext:
        return TorchExecutionContext(self)


def model_config(instances: int) -> ModelConfig:
    return ModelConfig.model_validate({
        "name": "matmul", "max_batch_size": MAX_BATCH, "instances": instances,
        "inputs": [{"name": "x", "datatype": "FP32", "dims": [-1, K],
                    "profile": {"min": [1, K], "opt": [8, K], "max": [MAX_BATCH, K]}}],
        "outputs": [{"name": "y", "datatype": "FP32", "dims": [-1, M]}],
    })


def requests(count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    return [rng.standard_normal((int(rng.integers(1, MAX_BATCH + 1)), K)).astype(np.float32) for _ in range(count)]


@pytest.fixture(scope="module")
def stand_in() -> TorchCudaEngine:
    engine = TorchCudaEngine()
    warm = torch.zeros((MAX_BATCH, K), device="cuda") @ engine.weight  # cuBLAS initialised up front
    torch.cuda.synchronize()
    del warm
    return engine


def release_torch_caches() -> None:
    torch.cuda.synchronize()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()


def test_a_context_runs_on_the_gpu_and_matches_numpy(stand_in):
    engine = TensorRTEngine.from_cuda_engine(model_config(1), stand_in, cuda.CudaMemory())
    context = engine.create_context()
    for x in requests(6):
        y = context.infer({"x": x})["y"]
        np.testing.assert_allclose(y, x @ stand_in.weight_host + stand_in.bias_host, rtol=2e-3, atol=2e-3)
    print(f"\ncontext buffers after 6 requests (grow-only): {context.buffer_bytes}")
    engine.close()


def test_concurrent_requests_beyond_the_pool_each_equal_a_serial_run(stand_in, monkeypatch):
    config = model_config(instances=3)
    serial_engine = TensorRTEngine.from_cuda_engine(config, stand_in, cuda.CudaMemory())
    serial_context = serial_engine.create_context()
    batch = requests(96)
    serial = [serial_context.infer({"x": x})["y"] for x in batch]
    serial_engine.close()

    monkeypatch.setattr(host_module, "open_engine",
                        lambda config, path, backend: TensorRTEngine.from_cuda_engine(config, stand_in, cuda.CudaMemory()))
    model_host = ModelHost(ModelEntry(config=config, path=Path("/nonexistent"), versions=(1,)), "tensorrt").load()
    with ThreadPoolExecutor(24) as pool:  # 24 callers share 3 contexts, each with its own stream
        parallel = list(pool.map(lambda x: model_host.infer({"x": x})["y"], batch))
    model_host.unload()
    for got, want in zip(parallel, serial):
        np.testing.assert_array_equal(got, want)


def test_closing_the_engine_gives_the_contexts_device_memory_back(stand_in):
    release_torch_caches()
    free_start, _ = cuda.mem_get_info()
    engine = TensorRTEngine.from_cuda_engine(model_config(4), stand_in, cuda.CudaMemory())
    contexts = [engine.create_context() for _ in range(4)]
    x = requests(1)[0][:1].repeat(MAX_BATCH, axis=0)
    for c in contexts:
        c.infer({"x": x})
    held = free_start - cuda.mem_get_info()[0]
    engine.close()
    release_torch_caches()
    left = free_start - cuda.mem_get_info()[0]
    print(f"\n4 contexts at batch {MAX_BATCH}: {held / MiB:.1f} MiB held while loaded, "
          f"{left / MiB:.1f} MiB left after close")
    assert held >= 4 * MAX_BATCH * (K + M) * 4  # every context's own device I/O buffers
    assert left <= 2 * MiB
