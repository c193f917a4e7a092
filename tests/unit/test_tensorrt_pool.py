"""TensorRT backend's pool and buffer logic, on CPU, with FAKES at the thinnest boundary.

What is fake (defined here, not in the package): ``FakeCudaEngine``/``FakeExecutionContext``
stand where TensorRT's ``ICudaEngine``/``IExecutionContext`` stand, and ``FakeMemory`` where
``cuda.CudaMemory`` stands (device memory is a dict of bytearrays keyed by made-up addresses).
What is real: ``TensorRTEngine``, ``TensorRTContext`` (profile choice, every checked boolean,
buffer growth, copies in and out) and ``ModelHost``'s context pool. The fake context computes
its output from the bytes at the addresses it was given, so wrong addresses or copies show.
"""

from __future__ import annotations

import enum
import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from deployments.runtime.backends import cuda
from deployments.runtime.residency import host as host_module
from deployments.runtime.contract.config import ModelConfig
from deployments.runtime.contract.errors import ConfigError, EngineFault, InferenceError
from deployments.runtime.residency.gate import Gate
from deployments.runtime.residency.host import ModelHost
from deployments.runtime.contract.repository import ModelEntry
from deployments.runtime.backends.tensorrt import TensorRTContext, TensorRTEngine

WEIGHTS = np.arange(4 * 3, dtype=np.float32).reshape(4, 3) / 10  # output = input @ WEIGHTS


# ---------------------------------------------------------------------------- fake CUDA memory


class FakeDeviceBuffer:
    def __init__(self, memory: "FakeMemory") -> None:
        self._memory, self.ptr, self.nbytes, self.allocations = memory, 0, 0, 0

    def ensure(self, nbytes: int) -> bool:
        if nbytes <= self.nbytes and self.ptr:
            return False
        self.close()
        self.ptr, self.nbytes = self._memory.alloc(max(nbytes, 1))
        self.allocations += 1
        return True

    def close(self) -> None:
        if self.ptr:
            self._memory.free(self.ptr)
        self.ptr, self.nbytes = 0, 0


class FakeHostBuffer(FakeDeviceBuffer):
    def view(self, dtype, shape):
        count = int(np.prod(shape))
        return np.frombuffer(self._memory.blocks[self.ptr], dtype=dtype, count=count).reshape(shape)


class FakeStream:
    handles = itertools.count(1)

    def __init__(self, memory: "FakeMemory") -> None:
        self._memory = memory
        self.handle = next(self.handles)
        self.synchronized = 0
        memory.streams.add(self.handle)

    def synchronize(self) -> None:
        self._memory.raise_if_sticky("cudaStreamSynchronize")
        self.synchronized += 1

    def close(self) -> None:
        self._memory.streams.discard(self.handle)


class StickyCudaError(enum.IntEnum):
    """cuda-python's error codes for the sticky errors (CUDA runtime API: the process must restart)."""

    cudaErrorIllegalAddress = 700
    cudaErrorLaunchFailure = 719


class FakeMemory:
    """Stands where ``cuda.CudaMemory`` stands: copies happen at once, addresses are made up."""

    def __init__(self, total_bytes: int = 1 << 30) -> None:
        self.blocks: dict[int, bytearray] = {}
        self.streams: set[int] = set()
        self._next = 0x10000
        self._lock = threading.Lock()
        self.total_bytes = total_bytes
        self.sticky: StickyCudaError | None = None  # once set, every call fails with it

    def raise_if_sticky(self, call: str) -> None:
        if self.sticky is not None:
            cuda.check((self.sticky,), call)

    def alloc(self, nbytes: int) -> tuple[int, int]:
        with self._lock:
            ptr, self._next = self._next, self._next + nbytes + 4096
            self.blocks[ptr] = bytearray(nbytes)
            return ptr, nbytes

    def free(self, ptr: int) -> None:
        with self._lock:
            del self.blocks[ptr]

    def used_bytes(self) -> int:
        return sum(len(b) for b in self.blocks.values())

    def stream(self):
        return FakeStream(self)

    def device_buffer(self):
        return FakeDeviceBuffer(self)

    def host_buffer(self):
        return FakeHostBuffer(self)

    def copy_to_device(self, dst, src, nbytes, stream) -> None:
        self.blocks[dst.ptr][:nbytes] = self.blocks[src.ptr][:nbytes]

    def copy_to_host(self, dst, src, nbytes, stream) -> None:
        self.blocks[dst.ptr][:nbytes] = self.blocks[src.ptr][:nbytes]

    def mem_get_info(self) -> tuple[int, int]:
        self.raise_if_sticky("cudaMemGetInfo")
        return self.total_bytes - self.used_bytes(), self.total_bytes


# ---------------------------------------------------------------------------- fake TensorRT


class FakeTensorIOMode(enum.Enum):
    INPUT = 1
    OUTPUT = 2


class FakeDataType(enum.Enum):
    FLOAT = 0
    HALF = 1


class FakeExecutionContext:
    """Stands where ``trt.IExecutionContext`` stands. ``fail`` names a call that returns False;
    ``raise:<call>`` makes it raise ``RuntimeError`` instead, as the real binding does for some
    calls (``set_optimization_profile_async``). Like TensorRT, ``execute_async_v3`` fails when
    an I/O tensor of the engine has no address."""

    def __init__(self, engine: "FakeCudaEngine") -> None:
        self.engine = engine
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}
        self.profile = 0
        self.calls: list[str] = []
        self.in_use = False
        self.destroyed = False

    def _maybe_raise(self, call: str) -> None:
        if self.engine.fail == f"raise:{call}":
            raise RuntimeError(f"[TRT] {call}: internal error text")

    def set_optimization_profile_async(self, index: int, stream: int) -> bool:
        self.calls.append(f"set_optimization_profile_async({index})")
        self._maybe_raise("set_optimization_profile_async")
        if self.engine.fail == "set_optimization_profile_async":
            return False
        self.profile = index
        return True

    def set_input_shape(self, name: str, shape) -> bool:
        self.calls.append("set_input_shape")
        self._maybe_raise("set_input_shape")
        if self.engine.fail == "set_input_shape":
            return False
        lo, _, hi = self.engine.get_tensor_profile_shape(name, self.profile)
        if not all(a <= s <= b for a, s, b in zip(lo, shape, hi)):
            return False  # what TensorRT does outside the active profile
        self.shapes[name] = tuple(shape)
        return True

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        self._maybe_raise("get_tensor_shape")
        if name in self.engine.extra_outputs:
            return (self.shapes["input"][0], 2) if "input" in self.shapes else (-1, 2)
        if name == "input":
            return self.shapes.get("input", (-1, 4))
        if self.engine.output_shape_unknown:
            return (-1, 3)
        return (self.shapes["input"][0], 3) if "input" in self.shapes else (-1, 3)

    def set_tensor_address(self, name: str, address: int) -> bool:
        self.calls.append("set_tensor_address")
        self._maybe_raise("set_tensor_address")
        if self.engine.fail == f"set_tensor_address:{name}":
            return False
        self.addresses[name] = address
        return True

    def execute_async_v3(self, stream_handle: int) -> bool:
        self.calls.append("execute_async_v3")
        self._maybe_raise("execute_async_v3")
        if set(self.engine.tensor_names) - set(self.addresses):
            return False  # TensorRT: "address is not set for output tensor ..."
        assert not self.in_use, "one execution context ran two requests at once"
        self.in_use = True
        try:
            with self.engine.lock:
                self.engine.running += 1
                self.engine.peak_running = max(self.engine.peak_running, self.engine.running)
            time.sleep(self.engine.execute_s)
            if self.engine.fail == "execute_async_v3":
                return False
            blocks = self.engine.memory.blocks
            batch = self.shapes["input"][0]
            x = np.frombuffer(blocks[self.addresses["input"]], np.float32, batch * 4).reshape(batch, 4)
            y = x @ WEIGHTS + self.engine.bias
            blocks[self.addresses["output"]][: y.nbytes] = y.astype(np.float32).tobytes()
            return True
        finally:
            with self.engine.lock:
                self.engine.running -= 1
            self.in_use = False

    def __del__(self) -> None:
        self.engine.events.append("context destroyed")


class FakeCudaEngine:
    """Stands where ``trt.ICudaEngine`` stands: input ``input`` (N, 4) FP32, output ``output``
    (N, 3) FP32 = input @ WEIGHTS + bias, with the given (min, opt, max) batch profiles."""

    def __init__(self, memory: FakeMemory, profiles=((1, 4, 8),), input_dtype: str = "FLOAT",
                 extra_outputs: tuple[str, ...] = (), extra_inputs: tuple[str, ...] = ()) -> None:
        self.memory = memory
        self.profiles = profiles
        self.input_dtype = input_dtype
        self.fail: str | None = None
        self.output_shape_unknown = False
        self.execute_s = 0.0
        self.bias = 0.0
        self.lock = threading.Lock()
        self.running = self.peak_running = 0
        self.contexts: list[FakeExecutionContext] = []
        self.events: list[str] = []
        self.device_memory_size_v2 = 5_000_000
        self.num_optimization_profiles = len(profiles)
        self.extra_outputs, self.extra_inputs = extra_outputs, extra_inputs
        self.tensor_names = ("input", *extra_inputs, "output", *extra_outputs)
        self.num_io_tensors = len(self.tensor_names)

    def get_tensor_name(self, index: int) -> str:
        return self.tensor_names[index]

    def get_tensor_mode(self, name: str) -> FakeTensorIOMode:
        return FakeTensorIOMode.INPUT if name in ("input", *self.extra_inputs) else FakeTensorIOMode.OUTPUT

    def get_tensor_dtype(self, name: str) -> FakeDataType:
        return FakeDataType[self.input_dtype] if name == "input" else FakeDataType.FLOAT

    def get_tensor_profile_shape(self, name: str, index: int):
        lo, opt, hi = self.profiles[index]
        return [(lo, 4), (opt, 4), (hi, 4)]

    def get_device_memory_size_for_profile_v2(self, index: int) -> int:
        return 1_000_000 * self.profiles[index][2]

    def create_execution_context(self) -> FakeExecutionContext:
        if self.fail == "raise:create_execution_context":
            raise RuntimeError("[TRT] create_execution_context: internal error text")
        context = FakeExecutionContext(self)
        self.contexts.append(context)
        return context

    def __del__(self) -> None:
        self.events.append("engine destroyed")


def model_config(instances: int = 2, max_batch: int = 8) -> ModelConfig:
    return ModelConfig.model_validate({
        "name": "fake", "max_batch_size": max_batch, "instances": instances,
        "inputs": [{"name": "input", "datatype": "FP32", "dims": [-1, 4],
                    "profile": {"min": [1, 4], "opt": [4, 4], "max": [max_batch, 4]}}],
        "outputs": [{"name": "output", "datatype": "FP32", "dims": [-1, 3]}],
    })


def expected(x: np.ndarray, bias: float = 0.0) -> np.ndarray:
    return x @ WEIGHTS + bias


@pytest.fixture
def memory() -> FakeMemory:
    return FakeMemory()


def serve(memory: FakeMemory, fake: FakeCudaEngine, config: ModelConfig | None = None) -> TensorRTEngine:
    return TensorRTEngine.from_cuda_engine(config or model_config(), fake, memory, engine_bytes=1234)


def batch(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 4)).astype(np.float32)


# ---------------------------------------------------------------------------- tests


def test_infer_copies_in_runs_and_copies_out_with_the_shape_the_context_reports(memory):
    engine = serve(memory, FakeCudaEngine(memory))
    context = engine.create_context()
    x = batch(3)
    out = context.infer({"input": x})
    assert out["output"].shape == (3, 3)
    np.testing.assert_allclose(out["output"], expected(x), rtol=1e-6)


def test_results_are_copies_that_the_next_request_does_not_overwrite(memory):
    engine = serve(memory, FakeCudaEngine(memory))
    context = engine.create_context()
    first = context.infer({"input": batch(2, seed=1)})["output"]
    kept = first.copy()
    context.infer({"input": batch(2, seed=2)})
    np.testing.assert_array_equal(first, kept)


def test_buffers_grow_only_and_are_reused_for_smaller_requests(memory):
    engine = serve(memory, FakeCudaEngine(memory))
    context = engine.create_context()
    sizes = []
    for n in (2, 8, 1, 5, 8):
        context.infer({"input": batch(n)})
        sizes.append(dict(context.buffer_bytes))
    assert sizes[1]["input"] >= 8 * 4 * 4 and sizes[1]["output"] >= 8 * 3 * 4
    assert sizes[2:] == [sizes[1]] * 3  # never shrinks, never regrows
    assert context._device["input"].allocations == 2  # noqa: SLF001  (2 -> 8, then reused)


def test_each_context_has_its_own_stream_and_device_and_host_buffers(memory):
    engine = serve(memory, FakeCudaEngine(memory))
    a, b = engine.create_context(), engine.create_context()
    a.infer({"input": batch(2)})
    b.infer({"input": batch(2)})
    assert a._stream.handle != b._stream.handle  # noqa: SLF001
    pointers_a = {buf.ptr for buf in [*a._device.values(), *a._host.values()]}  # noqa: SLF001
    pointers_b = {buf.ptr for buf in [*b._device.values(), *b._host.values()]}  # noqa: SLF001
    assert pointers_a.isdisjoint(pointers_b)


def test_execute_async_v3_returning_false_raises_inference_error_naming_the_call(memory):
    fake = FakeCudaEngine(memory)
    engine = serve(memory, fake)
    context = engine.create_context()
    fake.fail = "execute_async_v3"
    with pytest.raises(InferenceError, match=r"model 'fake' context 0: TensorRT execute_async_v3 returned False"):
        context.infer({"input": batch(2)})
    fake.fail = None  # the context stays usable
    np.testing.assert_allclose(context.infer({"input": batch(2)})["output"], expected(batch(2)), rtol=1e-6)


def test_set_input_shape_returning_false_names_the_input_and_shape(memory):
    fake = FakeCudaEngine(memory)
    context = serve(memory, fake).create_context()
    fake.fail = "set_input_shape"
    with pytest.raises(InferenceError, match=r"set_input_shape\('input', \[3, 4\]\) returned False"):
        context.infer({"input": batch(3)})


def test_set_tensor_address_returning_false_names_the_tensor(memory):
    fake = FakeCudaEngine(memory)
    context = serve(memory, fake).create_context()
    fake.fail = "set_tensor_address:output"
    with pytest.raises(InferenceError, match=r"set_tensor_address\('output'\) returned False"):
        context.infer({"input": batch(3)})


def test_an_output_shape_unknown_after_set_input_shape_is_an_error_not_a_guess(memory):
    fake = FakeCudaEngine(memory)
    context = serve(memory, fake).create_context()
    fake.output_shape_unknown = True
    with pytest.raises(InferenceError, match=r"output 'output' shape \[-1, 3\] is not known"):
        context.infer({"input": batch(3)})


def test_the_tightest_profile_is_chosen_and_the_switch_is_checked(memory):
    fake = FakeCudaEngine(memory, profiles=((1, 4, 8), (1, 1, 2)))
    engine = serve(memory, fake)
    assert engine.select_profile({"input": (2, 4)}) == 1
    assert engine.select_profile({"input": (3, 4)}) == 0
    context = engine.create_context()
    context.infer({"input": batch(2)})
    assert "set_optimization_profile_async(1)" in fake.contexts[0].calls
    np.testing.assert_allclose(context.infer({"input": batch(5)})["output"], expected(batch(5)), rtol=1e-6)
    fake.fail = "set_optimization_profile_async"
    with pytest.raises(InferenceError, match=r"set_optimization_profile_async\(1\) returned False"):
        context.infer({"input": batch(1)})


def test_a_plan_whose_input_dtype_disagrees_with_the_config_is_refused(memory):
    with pytest.raises(ConfigError, match=r"input 'input' is HALF in the plan, config says FP32"):
        serve(memory, FakeCudaEngine(memory, input_dtype="HALF"))


def test_one_context_refuses_a_second_simultaneous_request(memory):
    fake = FakeCudaEngine(memory)
    fake.execute_s = 0.2
    context = serve(memory, fake).create_context()
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(context.infer, {"input": batch(1)})
        deadline = time.monotonic() + 30  # the first request is inside the context (0.2 s)
        while not fake.running and time.monotonic() < deadline:
            time.sleep(0.001)
        with pytest.raises(InferenceError, match="used by two requests at once"):
            context.infer({"input": batch(1)})
        first.result()


def test_footprint_is_device_memory_size_v2_plus_io_buffers_at_the_max_profile(memory):
    engine = serve(memory, FakeCudaEngine(memory))
    engine.create_context()
    footprint = engine.footprint()
    io_at_max = 8 * 4 * 4 + 8 * 3 * 4  # input (8, 4) + output (8, 3), float32
    assert footprint.engine_bytes == 1234
    assert footprint.context_bytes >= 5_000_000 + io_at_max
    assert engine.profile_context_bytes == (8_000_000,)


def test_close_destroys_contexts_then_the_engine_and_frees_every_buffer_and_stream(memory):
    fake = FakeCudaEngine(memory)
    engine = serve(memory, fake)
    contexts = [engine.create_context() for _ in range(2)]
    for c in contexts:
        c.infer({"input": batch(4)})
    assert memory.used_bytes() > 0 and len(memory.streams) == 2
    events = fake.events
    fake.contexts.clear()  # the test's own references would keep them alive
    del fake
    engine.close()
    assert memory.blocks == {} and memory.streams == set()
    assert events == ["context destroyed", "context destroyed", "engine destroyed"]
    with pytest.raises(InferenceError, match="closed"):
        contexts[0].infer({"input": batch(1)})


def test_concurrent_requests_beyond_the_pool_each_equal_a_serial_run(memory, monkeypatch):
    fake = FakeCudaEngine(memory)
    fake.execute_s = 0.002
    fake.bias = 0.5
    monkeypatch.setattr(host_module, "open_engine", lambda config, path, backend: serve(memory, fake, config))
    entry = ModelEntry(config=model_config(instances=2), path=Path("/nonexistent"), versions=(1,))
    model_host = ModelHost(entry, backend="tensorrt").load()
    requests = [batch(1 + i % 8, seed=i) for i in range(64)]
    serial = [expected(x, bias=0.5) for x in requests]
    with ThreadPoolExecutor(16) as pool:  # 16 callers, 2 contexts
        results = list(pool.map(lambda x: model_host.infer({"input": x})["output"], requests))
    for got, want in zip(results, serial):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert fake.peak_running == 2  # the pool ran both contexts at once, never more
    assert len(fake.contexts) == 2
    model_host.unload()
    assert memory.blocks == {}


def test_cuda_check_names_the_call_and_the_cuda_error():
    class FakeCudaError(enum.IntEnum):
        cudaSuccess = 0
        cudaErrorMemoryAllocation = 2

    assert cuda.check((FakeCudaError.cudaSuccess, 1234), "cudaMalloc(16)") == 1234
    assert cuda.check((FakeCudaError.cudaSuccess, 1, 2), "cudaMemGetInfo") == (1, 2)
    assert cuda.check((FakeCudaError.cudaSuccess,), "cudaFree") is None
    with pytest.raises(cuda.CudaError, match=r"cudaMalloc\(16\) failed: cudaErrorMemoryAllocation \(2\)") as info:
        cuda.check((FakeCudaError.cudaErrorMemoryAllocation, None), "cudaMalloc(16)")
    assert isinstance(info.value, InferenceError)


def test_context_type_is_the_one_the_engine_hands_out(memory):
    assert isinstance(serve(memory, FakeCudaEngine(memory)).create_context(), TensorRTContext)


@pytest.mark.parametrize("call,error", [
    ("set_optimization_profile_async", EngineFault), ("set_input_shape", InferenceError),
    ("get_tensor_shape", InferenceError), ("set_tensor_address", InferenceError),
    ("execute_async_v3", InferenceError)])
def test_a_tensorrt_call_that_raises_is_a_typed_error_naming_the_call_without_tensorrts_text(memory, call, error):
    fake = FakeCudaEngine(memory, profiles=((1, 4, 8), (1, 1, 2)))
    context = serve(memory, fake).create_context()
    context.infer({"input": batch(5)})  # profile 0 is set; batch 1 switches to profile 1
    fake.fail = f"raise:{call}"
    with pytest.raises(error) as raised:
        context.infer({"input": batch(1)})
    assert raised.value.message.startswith(f"model 'fake' context 0: TensorRT {call}")
    assert "raised RuntimeError" in raised.value.message and "internal error text" not in raised.value.message
    fake.fail = None  # the context stays usable
    np.testing.assert_allclose(context.infer({"input": batch(1)})["output"], expected(batch(1)), rtol=1e-6)


def test_a_profile_switch_tensorrt_refuses_fails_a_batch_once_instead_of_retrying_each_request(
        memory, monkeypatch):
    from deployments.batching import BatchItem, run_batch

    fake = FakeCudaEngine(memory, profiles=((1, 4, 8), (1, 1, 2)))
    monkeypatch.setattr(host_module, "open_engine", lambda config, path, backend: serve(memory, fake, config))
    entry = ModelEntry(config=model_config(instances=1), path=Path("/nonexistent"), versions=(1,))
    model_host = ModelHost(entry, backend="tensorrt").load()
    fake.fail = "raise:set_optimization_profile_async"
    items = [BatchItem.of(model_host.config, {"input": batch(1, seed=i)}, None) for i in range(2)]
    run = run_batch(model_host, items)
    assert all(isinstance(r, EngineFault) for r in run.results), run.results
    assert run.retried_alone == 0 and run.calls == []
    model_host.unload()


def test_create_execution_context_raising_is_an_inference_error(memory):
    fake = FakeCudaEngine(memory)
    engine = serve(memory, fake)
    fake.fail = "raise:create_execution_context"
    with pytest.raises(InferenceError, match=r"TensorRT create_execution_context raised RuntimeError"):
        engine.create_context()


def test_plan_outputs_the_config_does_not_declare_get_scratch_buffers_and_are_not_returned(memory):
    fake = FakeCudaEngine(memory, extra_outputs=("aux",))
    engine = serve(memory, fake)
    context = engine.create_context()
    x = batch(3)
    out = context.infer({"input": x})
    assert list(out) == ["output"]
    np.testing.assert_allclose(out["output"], expected(x), rtol=1e-6)
    assert context.buffer_bytes["aux"] >= 3 * 2 * 4


def test_a_plan_input_the_config_does_not_declare_is_refused_at_load_naming_it(memory):
    with pytest.raises(ConfigError, match=r"plan inputs \['mask'\] are not declared in config.yaml"):
        serve(memory, FakeCudaEngine(memory, extra_inputs=("mask",)))


@pytest.mark.parametrize("sticky", list(StickyCudaError))
def test_a_sticky_cuda_error_fails_the_health_probe_of_host_and_dedicated_deployment(memory, monkeypatch, sticky):
    from deployments.model import ModelDeployment

    fake = FakeCudaEngine(memory)
    monkeypatch.setattr(host_module, "open_engine", lambda config, path, backend: serve(memory, fake, config))
    entry = ModelEntry(config=model_config(instances=1), path=Path("/nonexistent"), versions=(1,))
    model_host = ModelHost(entry, backend="tensorrt").load()
    replica = ModelDeployment.func_or_class.__new__(ModelDeployment.func_or_class)
    replica.host = model_host
    replica.gate = Gate(model_host.name)
    replica.check_health()  # healthy
    memory.sticky = sticky  # a kernel faulted: from now on every CUDA call in the process fails
    with pytest.raises(cuda.CudaError, match=sticky.name):
        model_host.infer({"input": batch(2)})
    for probe in (model_host.check_health, replica.check_health):
        with pytest.raises(EngineFault, match=rf"the CUDA device is unusable \(cudaMemGetInfo failed: {sticky.name}"):
            probe()


def test_an_unloaded_model_fails_the_dedicated_health_probe_as_not_ready_unless_unloaded_on_purpose(memory):
    from deployments.model import ModelDeployment
    from deployments.runtime.contract.errors import ModelNotReady
    replica = ModelDeployment.func_or_class.__new__(ModelDeployment.func_or_class)
    replica.host = ModelHost(ModelEntry(config=model_config(), path=Path("/nonexistent"), versions=(1,)))
    replica.gate = Gate("m")
    with pytest.raises(ModelNotReady):
        replica.check_health()
    replica.gate.close()  # model control unloaded it: healthy, answering 503 until loaded
    replica.check_health()
