"""Triton's CUDA shared-memory extension without a GPU: a CUDA region's input decodes to a
``DeviceTensor`` checked by byte size as a system region's is, outputs asked into one become
``DeviceOutput`` names, each handle is opened once per process and closed when its region is
unregistered (``IpcOpenings`` over a fake opener), and where the model does not run on the GPU
(the CPU provider, the router, a pipeline) the request answers 400 naming why. The GPU path
itself runs in tests/gpu/test_cuda_shared_memory.py."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest

from deployments.client import ModelClient
from deployments.protocol.binary import decode_request, encode_response
from deployments.protocol.errors import error_status
from deployments.protocol.shared_memory import CUDA, SharedMemory
from deployments.runtime.backends.base import Footprint
from deployments.runtime.backends.cuda import CudaError
from deployments.runtime.backends.cuda_ipc import IpcOpenings
from deployments.runtime.contract.device import DeviceOutput, DeviceTensor
from deployments.runtime.contract.errors import InvalidInput, SharedMemoryError
from deployments.runtime.contract.repository import ModelRepository
from deployments.runtime.contract.validation import validate_inputs
from deployments.runtime.residency import host as host_module
from deployments.runtime.residency.host import ModelHost

from .test_shared_memory import DictStore, ListedWhileRegistering, request, shm_input

HANDLE = bytes(range(64))
OTHER = bytes(range(1, 65))


class FakeOpener:
    """Stands in for cudaIpcOpenMemHandle / cudaIpcCloseMemHandle: hands out made-up addresses
    and records every open and close (a fake: no GPU here)."""

    def __init__(self, fail: bool = False) -> None:
        self.opened: list[tuple[bytes, int]] = []
        self.closed: list[int] = []
        self.fail = fail

    def open(self, handle, device_id):
        if self.fail:
            raise CudaError("cudaIpcOpenMemHandle(device 0) failed: cudaErrorInvalidValue (1)")
        self.opened.append((handle, device_id))
        return 0x10000 * len(self.opened)

    def close(self, address):
        self.closed.append(address)


@pytest.fixture
def opener():
    return FakeOpener()


@pytest.fixture
def memory(opener):
    shared = SharedMemory(DictStore(), IpcOpenings(opener))
    yield shared
    shared.close()


def register(memory, name="g", handle=HANDLE, byte_size=128):
    memory.registry.register(CUDA, name, {"raw_handle": {"b64": base64.b64encode(handle).decode()},
                                          "device_id": 0, "byte_size": byte_size})


def cuda_output(name, region, size, offset=0, **more):
    params = {"shared_memory_region": region, "shared_memory_byte_size": size, **more}
    if offset:
        params["shared_memory_offset"] = offset
    return {"name": name, "parameters": params}


def test_a_cuda_input_is_a_device_tensor_of_its_shape_and_datatype_at_its_offset(memory, opener):
    register(memory)
    got = decode_request(request([shm_input("A", "g", 64, offset=64)]), None, memory).inputs["A"]
    assert isinstance(got, DeviceTensor)
    assert (got.shape, got.dtype, got.region, got.offset, got.nbytes) == ((1, 16), np.dtype(np.int32), "g", 64, 64)
    assert opener.opened == []  # opened where the model runs, not at decode
    with got.lease(0) as base:
        assert base == 0x10000 and opener.opened == [(HANDLE, 0)]


@pytest.mark.parametrize("tensor, words", [
    (shm_input("A", "g", 32), "input byte size mismatch for input 'A'. Expected 64, got 32; input 'A': shape "
                              "[1, 16] x INT32 needs 64 bytes, shared_memory_byte_size gives 32 bytes"),
    (shm_input("A", "g", 64, offset=128), "Invalid offset for shared memory region: 'g'; input 'A': offset 128, "
                                          "the region holds 128 bytes"),
    (shm_input("A", "g", 64, offset=96), "Invalid offset + byte size for shared memory region: 'g'; input 'A': "
                                         "offset 96 + byte size 64 = 160 bytes, the region holds 128"),
    (shm_input("A", "g", 8, datatype="BYTES", shape=(1, 1)), "input 'A': BYTES tensors cannot be read from CUDA "
                                                              "shared memory region 'g'"),
])
def test_a_bad_cuda_input_is_400_with_the_system_paths_words(memory, tensor, words):
    register(memory)
    with pytest.raises(InvalidInput) as raised:
        decode_request(request([tensor]), None, memory)
    assert error_status(raised.value)[0] == 400
    assert raised.value.message.startswith(words)


def test_an_output_asked_into_a_cuda_region_is_a_device_output_name(memory):
    register(memory)
    decoded = memory.device_outputs(decode_request(request(
        [{"name": "A", "datatype": "INT32", "shape": [1], "data": [1]}],
        [cuda_output("Y", "g", 64, offset=32), {"name": "Z"}]), None, memory))
    y, z = decoded.outputs
    assert isinstance(y, DeviceOutput) and y == "Y" and (y.region, y.byte_size, y.offset) == ("g", 64, 32)
    assert type(z) is str


@pytest.mark.parametrize("output, words", [
    (cuda_output("Y", "g", 64, offset=96), "Invalid offset + byte size for shared memory region: 'g'; output 'Y'"),
    (cuda_output("Y", "g", 64, classification=2), "Output can't set both 'shared_memory_region' and "
                                                  "'classification'; output 'Y'"),
])
def test_a_bad_cuda_output_is_400_before_the_model_runs(memory, output, words):
    register(memory)
    with pytest.raises(SharedMemoryError) as raised:
        memory.device_outputs(decode_request(request(
            [{"name": "A", "datatype": "INT32", "shape": [1], "data": [1]}], [output]), None, memory))
    assert raised.value.message.startswith(words)


def test_an_output_too_large_for_its_cuda_region_bytes_is_400_in_the_system_paths_words(memory):
    target = DeviceOutput("Y", "g", 32, 0, lambda device: None)
    with pytest.raises(SharedMemoryError) as raised:
        target.check_fits((1, 16), np.dtype(np.float32))
    assert raised.value.message == ("shared memory size specified with the request for output 'Y' (32 bytes) should "
                                    "be at least 64 bytes to hold the results; it is FP32 [1, 16]")
    assert target.check_fits((1, 8), np.dtype(np.float32)) == 32


def test_an_output_written_on_the_gpu_is_answered_without_data_its_parameters_echoed(memory):
    register(memory)
    decoded = memory.device_outputs(decode_request(request(
        [{"name": "A", "datatype": "INT32", "shape": [1], "data": [1]}], [cuda_output("Y", "g", 64)]), None, memory))
    written = decoded.outputs[0].written((1, 16), np.dtype(np.float32))
    body, headers = encode_response("m", "1", decoded, {"Y": written}, shm=memory)
    assert headers == {"content-type": "application/json"}
    assert json.loads(body)["outputs"] == [{"name": "Y", "datatype": "FP32", "shape": [1, 16], "parameters": {
        "shared_memory_region": "g", "shared_memory_byte_size": 64}}]
    with pytest.raises(SharedMemoryError, match="^output 'Y': shared memory region 'g' is CUDA shared memory"):
        encode_response("m", "1", decoded, {"Y": np.zeros((1, 16), np.float32)}, shm=memory)


def test_validation_takes_a_device_tensor_by_shape_and_datatype(memory):
    config = ModelRepository("engines", ["simple"]).get("simple").config
    register(memory)
    tensor = decode_request(request([shm_input("INPUT0", "g", 64)]), None, memory).inputs["INPUT0"]
    validate_inputs(config, {"INPUT0": tensor, "INPUT1": np.zeros((1, 16), np.int32)})
    wide = DeviceTensor((1, 17), np.dtype(np.int32), "g", 0, tensor.lease, "input 'INPUT0'")
    with pytest.raises(InvalidInput, match="^unexpected shape for input 'INPUT0' for model 'simple'"):
        validate_inputs(config, {"INPUT0": wide, "INPUT1": np.zeros((1, 16), np.int32)})
    floats = DeviceTensor((1, 16), np.dtype(np.float32), "g", 0, tensor.lease, "input 'INPUT0'")
    with pytest.raises(InvalidInput, match="^inference input 'INPUT0' data-type is 'FP32'"):
        validate_inputs(config, {"INPUT0": floats, "INPUT1": np.zeros((1, 16), np.int32)})


@pytest.fixture(scope="module")
def simple_on_cpu():
    host = ModelHost(ModelRepository("engines", ["simple"]).get("simple"), backend="onnxruntime").load()
    yield host
    host.unload()


def test_a_cuda_region_on_a_cpu_replica_is_400_naming_why(memory, simple_on_cpu):
    register(memory)
    decoded = memory.device_outputs(decode_request(request(
        [shm_input("INPUT0", "g", 64), {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16}]),
        None, memory))
    with pytest.raises(SharedMemoryError) as raised:
        simple_on_cpu.infer(decoded.inputs, decoded.outputs)
    assert error_status(raised.value)[0] == 400
    assert raised.value.message == (
        "input 'INPUT0': shared memory region 'g' is CUDA shared memory, and this server reads and writes CUDA "
        "shared memory only in a replica that runs the model on a GPU; this model runs on the CPU here (backend "
        "onnxruntime): put the tensor in system shared memory (/v2/systemsharedmemory) or in the request body")
    ones = np.ones((1, 16), np.int32)
    out = memory.device_outputs(decode_request(request(
        [{"name": n, "datatype": "INT32", "shape": [1, 16], "data": [1] * 16} for n in ("INPUT0", "INPUT1")],
        [cuda_output("OUTPUT0", "g", 64)]), None, memory))
    with pytest.raises(SharedMemoryError, match="^output 'OUTPUT0': shared memory region 'g' is CUDA shared memory.*"
                                                "runs on the CPU here"):
        simple_on_cpu.infer({"INPUT0": ones, "INPUT1": ones}, out.outputs)
    assert simple_on_cpu.infer({"INPUT0": ones, "INPUT1": ones})["OUTPUT0"].tolist() == [[2] * 16]  # still serves


def test_the_router_and_pipelines_refuse_a_cuda_region_naming_why(memory):
    register(memory)
    tensor = decode_request(request([shm_input("A", "g", 64)]), None, memory).inputs["A"]
    with pytest.raises(SharedMemoryError) as raised:
        asyncio.run(ModelClient({}, None, []).infer("resnet18", {"A": tensor}))
    assert raised.value.message.startswith("input 'A': shared memory region 'g' is CUDA shared memory")
    assert "this request reached a process that calls model 'resnet18' in another (the router)" in raised.value.message


class FakeGpuEngine:
    """An engine that says it takes CUDA shared memory (``device_io``): its context records what
    it was given and answers each target as written (a fake: no GPU here)."""

    backend = "onnxruntime_cuda"
    device_io = True

    def __init__(self):
        self.calls = []

    def create_context(self):
        engine = self

        class Context:
            def infer(self, inputs, targets=None):
                engine.calls.append((dict(inputs), dict(targets or {})))
                out = {"OUTPUT0": np.zeros((1, 16), np.int32), "OUTPUT1": np.zeros((1, 16), np.int32)}
                for name, target in (targets or {}).items():
                    target.check_fits((1, 16), np.dtype(np.int32))
                    out[name] = target.written((1, 16), np.dtype(np.int32))
                return out

            def close(self):
                pass

        return Context()

    def footprint(self):
        return Footprint(0, 0, device="gpu")

    def check_health(self):
        pass

    def close(self):
        pass


def test_a_gpu_backend_gets_the_device_tensors_and_output_targets(memory, monkeypatch):
    engine = FakeGpuEngine()
    monkeypatch.setattr(host_module, "open_engine", lambda *args: engine)
    host = ModelHost(ModelRepository("engines", ["simple"]).get("simple"), backend="onnxruntime_cuda").load()
    register(memory)
    decoded = memory.device_outputs(decode_request(request(
        [shm_input("INPUT0", "g", 64), {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16}],
        [cuda_output("OUTPUT0", "g", 64, offset=64), {"name": "OUTPUT1"}]), None, memory))
    engine.calls.clear()  # the config's warmup, if any
    out = host.infer(decoded.inputs, decoded.outputs)
    (inputs, targets), = engine.calls
    assert inputs["INPUT0"] is decoded.inputs["INPUT0"] and list(targets) == ["OUTPUT0"]
    assert isinstance(out["OUTPUT0"], DeviceTensor) and out["OUTPUT0"].offset == 64
    assert isinstance(out["OUTPUT1"], np.ndarray)


def test_a_handle_is_opened_once_per_process_and_closed_when_unregistered(memory, opener):
    register(memory, "a", HANDLE)
    register(memory, "b", OTHER)
    tensor = decode_request(request([shm_input("A", "a", 64)]), None, memory).inputs["A"]
    for _ in range(3):
        with tensor.lease(0):
            pass
    with decode_request(request([shm_input("A", "b", 64)]), None, memory).inputs["A"].lease(0):
        pass
    assert opener.opened == [(HANDLE, 0), (OTHER, 0)] and memory.cuda.opened == 2
    memory.registry.unregister(CUDA, "a")
    assert opener.closed == [0x10000] and memory.cuda.opened == 1
    memory.registry.unregister(CUDA)
    assert opener.closed == [0x10000, 0x20000] and memory.cuda.opened == 0


def test_a_region_unregistered_while_a_request_uses_it_closes_when_the_request_ends(memory, opener):
    register(memory)
    tensor = decode_request(request([shm_input("A", "g", 64)]), None, memory).inputs["A"]
    with tensor.lease(0) as base:
        memory.registry.unregister(CUDA, "g")
        assert opener.closed == [] and base == 0x10000  # still in use
    assert opener.closed == [0x10000] and memory.cuda.opened == 0


def test_a_region_unregistered_through_another_router_is_closed_by_the_sweep(memory, opener):
    register(memory)
    with decode_request(request([shm_input("A", "g", 64)]), None, memory).inputs["A"].lease(0):
        pass
    assert memory.sweep() == 1
    memory.store.remove("g")  # what another router's unregister leaves here: the store only
    assert memory.sweep() == 0 and opener.closed == [0x10000]


def test_the_sweep_lists_the_store_only_when_its_generation_changed_or_something_new_is_opened(memory, opener):
    def use(name):
        with decode_request(request([shm_input("A", name, 64)]), None, memory).inputs["A"].lease(0):
            pass

    register(memory, "a", HANDLE)
    register(memory, "b", OTHER)
    use("a")
    assert memory.sweep() == 1
    memory.store.reads.clear()
    assert memory.sweep() == 1 and memory.store.reads == {"generation": 1}  # nothing registered or removed since
    use("b")  # a handle the last listing did not see
    memory.store.reads.clear()
    assert memory.sweep() == 2 and memory.store.reads["regions"] == 1
    memory.store.remove("a")  # unregistered through another router: the next sweep lists and closes
    memory.store.reads.clear()
    assert memory.sweep() == 1 and memory.store.reads["regions"] == 1 and opener.closed == [0x10000]


def test_a_handle_that_does_not_open_is_400_naming_the_cuda_error():
    memory = SharedMemory(DictStore(), IpcOpenings(FakeOpener(fail=True)))
    register(memory)
    tensor = decode_request(request([shm_input("A", "g", 64)]), None, memory).inputs["A"]
    with pytest.raises(SharedMemoryError) as raised:
        with tensor.lease(0):
            pass
    assert error_status(raised.value)[0] == 400
    assert raised.value.message.startswith("Unable to open CUDA shared memory region: 'g'; its handle does not open "
                                           "on CUDA device 0 of this replica (cudaIpcOpenMemHandle(device 0) failed: "
                                           "cudaErrorInvalidValue (1))")
    assert memory.cuda.opened == 0


def test_a_cuda_region_registered_while_the_sweep_reads_the_store_stays_open(opener):
    """The sweep closes only what was opened before it read the store: a region registered and
    first used meanwhile is not in what it read, and stays open."""
    memory = SharedMemory(ListedWhileRegistering(), IpcOpenings(opener))
    register(memory, "old", HANDLE)
    with decode_request(request([shm_input("A", "old", 64)]), None, memory).inputs["A"].lease(0):
        pass

    def register_and_use():
        register(memory, "new", OTHER)
        with decode_request(request([shm_input("A", "new", 64)]), None, memory).inputs["A"].lease(0):
            pass

    memory.store.meanwhile = register_and_use
    assert memory.sweep() == 2 and opener.closed == []
    memory.store.meanwhile = None
    memory.registry.unregister(CUDA, "new")
    assert memory.sweep() == 1 and opener.closed == [0x20000]


def test_a_cuda_name_registered_again_over_other_memory_is_used_there_in_a_replica_that_had_the_first_open():
    """As for a system region: the replica still holds the first memory's opening when the name
    is registered again (through the router) with another allocation's handle; the request uses
    the new handle's memory, and the first is closed at the replica's sweep."""
    store, opener = DictStore(), FakeOpener()
    router, replica = SharedMemory(store, IpcOpenings(FakeOpener())), SharedMemory(store, IpcOpenings(opener))
    register(router, "g", HANDLE)
    with decode_request(request([shm_input("A", "g", 64)]), None, replica).inputs["A"].lease(0) as first:
        pass
    router.registry.unregister(CUDA, "g")
    register(router, "g", OTHER)
    with decode_request(request([shm_input("A", "g", 64)]), None, replica).inputs["A"].lease(0) as second:
        pass
    assert opener.opened == [(HANDLE, 0), (OTHER, 0)] and second != first
    assert replica.sweep() == 1 and opener.closed == [first]
