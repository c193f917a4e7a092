"""Triton's shared-memory extensions without Ray or HTTP (``deployments.protocol.shared_memory``):
registration checked as Triton checks it, inputs read from and outputs written to real objects in
/dev/shm, mapped once per process, each fault answered with Triton's words."""

from __future__ import annotations

import base64
import contextlib
import json
import uuid

import numpy as np
import pytest
import tritonclient.utils.shared_memory as shm_client

from deployments.protocol.binary import decode_request, encode_response
from deployments.protocol.errors import error_status
from deployments.protocol.shared_memory import CUDA, SYSTEM, Region, SharedMemory, key_path
from deployments.runtime.contract.errors import InvalidInput, RegionNotFound, SharedMemoryError


class DictStore:
    """A ``RegionStore`` in a dict (the server's is Ray's GCS: ``deployments.regions``)."""

    def __init__(self) -> None:
        self.items: dict[str, Region] = {}

    def get(self, name):
        return self.items.get(name)

    def add(self, region):
        return self.items.setdefault(region.name, region) is region

    def remove(self, name):
        self.items.pop(name, None)

    def regions(self):
        return list(self.items.values())


@pytest.fixture
def key():
    """A fresh 256-byte object in /dev/shm, removed afterwards."""
    name = f"/trt_serve_test_{uuid.uuid4().hex[:12]}"
    handle = shm_client.create_shared_memory_region("r", name, 256)
    yield name
    with contextlib.suppress(FileNotFoundError):  # a test removed it
        shm_client.destroy_shared_memory_region(handle)


@pytest.fixture
def memory():
    shared = SharedMemory(DictStore())
    yield shared
    shared.close()


def write(key: str, array: np.ndarray, offset: int = 0) -> None:
    path = key_path("r", key)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(array.tobytes())


def read(key: str, dtype, count: int, offset: int = 0) -> np.ndarray:
    return np.frombuffer(key_path("r", key).read_bytes()[offset:], dtype=dtype, count=count)


def request(inputs, outputs=None) -> bytes:
    return json.dumps({"inputs": inputs, **({"outputs": outputs} if outputs else {})}).encode()


def shm_input(name: str, region: str, size: int, offset: int = 0, datatype="INT32", shape=(1, 16)) -> dict:
    params = {"shared_memory_region": region, "shared_memory_byte_size": size}
    if offset:
        params["shared_memory_offset"] = offset
    return {"name": name, "datatype": datatype, "shape": list(shape), "parameters": params}


def test_register_status_and_unregister_answer_as_triton(memory, key):
    registry = memory.registry
    registry.register(SYSTEM, "in", {"key": key, "offset": 64, "byte_size": 128})
    registry.register(CUDA, "gpu", {"raw_handle": {"b64": base64.b64encode(bytes(64)).decode()}, "device_id": 0,
                                    "byte_size": 1024})
    assert registry.status(SYSTEM) == [{"name": "in", "key": key, "offset": 64, "byte_size": 128}]
    assert registry.status(CUDA, "gpu") == [{"name": "gpu", "device_id": 0, "byte_size": 1024}]
    with pytest.raises(SharedMemoryError, match="^shared memory region 'in' already in manager"):
        registry.register(SYSTEM, "in", {"key": key, "byte_size": 8})
    with pytest.raises(RegionNotFound, match="^The region named 'gpu' is registered as CUDA shared memory, not "
                                             "system shared memory$"):
        registry.status(SYSTEM, "gpu")
    registry.unregister(SYSTEM)  # all system regions; the CUDA one stays
    with pytest.raises(RegionNotFound, match="^Unable to find system shared memory region: 'in'$"):
        registry.status(SYSTEM, "in")
    assert [r["name"] for r in registry.status(CUDA)] == ["gpu"]
    registry.unregister(SYSTEM, "never_registered")  # Triton: no error
    assert error_status(RegionNotFound("x"))[0] == 404 and error_status(SharedMemoryError("x"))[0] == 400


@pytest.mark.parametrize("bad_key, words", [
    ("/", "cannot register shared memory region 'r' - invalid shm key '/'"),
    ("/../etc/passwd", "cannot register shared memory region 'r' - invalid shm key '/../etc/passwd'"),
    ("a/b", "invalid shm key 'a/b'"),
    ("..", "invalid shm key '..'"),
    ("/triton_python_backend_shm_region_1", "as the key contains the reserved prefix"),
    ("/no_such_object_here", "Unable to open shared memory region: '/no_such_object_here'"),
])
def test_a_key_outside_dev_shm_or_absent_is_refused_with_tritons_words(memory, bad_key, words):
    with pytest.raises(SharedMemoryError) as raised:
        memory.registry.register(SYSTEM, "r", {"key": bad_key, "byte_size": 8})
    assert words in raised.value.message
    assert memory.registry.status(SYSTEM) == []


def test_a_symbolic_link_in_dev_shm_is_not_followed(memory, key, tmp_path):
    target = tmp_path / "secret"
    target.write_bytes(bytes(64))
    link = key_path("r", key).with_name(f"{key_path('r', key).name}_link")
    link.symlink_to(target)
    try:
        with pytest.raises(SharedMemoryError, match=f"^Unable to open shared memory region: '/{link.name}'; {link} is "
                                                    "not a shared-memory object"):
            memory.registry.register(SYSTEM, "r", {"key": f"/{link.name}", "byte_size": 8})
        memory.store.add(Region("r", SYSTEM, 8, key=f"/{link.name}"))  # were it registered: not opened either
        with pytest.raises(SharedMemoryError, match="^Unable to open shared memory region"):
            decode_request(request([shm_input("A", "r", 8, datatype="INT8", shape=(8,))]), None, memory)
    finally:
        link.unlink()


@pytest.mark.parametrize("body, words", [
    ({"offset": 0, "byte_size": 8}, "Shared memory register request has no 'key' field"),
    ({"key": "K"}, "Shared memory register request has no 'byte_size' field"),
    ({"key": "K", "byte_size": -1}, "'byte_size' must be a non-negative integer, got -1"),
    ({"key": "K", "offset": 200, "byte_size": 100},
     "failed to register shared memory region 'r': invalid args; offset 200 + byte_size 100 = 300 bytes, and the "
     "object of key 'K' holds 256 bytes"),
])
def test_a_malformed_or_too_large_registration_is_400(memory, key, body, words):
    body = {k: (key if v == "K" else v) for k, v in body.items()}
    with pytest.raises(SharedMemoryError) as raised:
        memory.registry.register(SYSTEM, "r", body)
    assert words.replace("'K'", f"'{key}'") in raised.value.message


@pytest.mark.parametrize("name", ["", "a/b", "x\x00"])
def test_a_region_name_with_a_slash_or_nul_is_refused(memory, key, name):
    with pytest.raises(SharedMemoryError, match="invalid shared memory region name"):
        memory.registry.register(SYSTEM, name, {"key": key, "byte_size": 8})


def test_cuda_register_needs_a_64_byte_handle(memory):
    with pytest.raises(SharedMemoryError, match="^'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t"):
        memory.registry.register(CUDA, "g", {"raw_handle": {"b64": "AAAA"}, "device_id": 0, "byte_size": 8})


def test_inputs_are_read_from_the_region_without_a_copy_and_mapped_once(memory, key):
    a, b = np.arange(16, dtype=np.int32), np.full(16, 3, np.int32)
    write(key, a, 32)
    write(key, b, 96)
    memory.registry.register(SYSTEM, "in", {"key": key, "offset": 32, "byte_size": 128})
    got = decode_request(request([shm_input("A", "in", 64), shm_input("B", "in", 64, offset=64)]), None, memory)
    np.testing.assert_array_equal(got.inputs["A"], a.reshape(1, 16))
    np.testing.assert_array_equal(got.inputs["B"], b.reshape(1, 16))
    write(key, a * 10, 32)  # the client writes again: the decoded input is the region itself
    np.testing.assert_array_equal(got.inputs["A"], (a * 10).reshape(1, 16))
    assert memory.mapped == 1
    del got
    memory.registry.unregister(SYSTEM, "in")  # unmaps here at once
    assert memory.mapped == 0


def test_bytes_inputs_are_read_as_length_prefixed_elements(memory, key):
    items = [b"12", b"-3"]
    raw = b"".join(len(x).to_bytes(4, "little") + x for x in items)
    write(key, np.frombuffer(raw, np.uint8))
    memory.registry.register(SYSTEM, "s", {"key": key, "byte_size": 256})
    got = decode_request(request([shm_input("T", "s", len(raw), datatype="BYTES", shape=(1, 2))]), None, memory)
    assert got.inputs["T"].tolist() == [items]


@pytest.mark.parametrize("tensor, words", [
    (shm_input("A", "nope", 64), "Unable to find shared memory region: 'nope'; input 'A' names it"),
    (shm_input("A", "in", 64, offset=128), "Invalid offset for shared memory region: 'in'; input 'A': offset 128, "
                                           "the region holds 128 bytes"),
    (shm_input("A", "in", 64, offset=96), "Invalid offset + byte size for shared memory region: 'in'; input 'A': "
                                          "offset 96 + byte size 64 = 160 bytes, the region holds 128"),
    (shm_input("A", "in", 32), "input byte size mismatch for input 'A'. Expected 64, got 32; input 'A': shape "
                               "[1, 16] x INT32 needs 64 bytes, shared_memory_byte_size gives 32 bytes"),
    ({**shm_input("A", "in", 64), "parameters": {"shared_memory_region": "in"}},
     "Unable to parse 'shared_memory_byte_size'; input 'A': parameters.shared_memory_byte_size must be a "
     "non-negative integer of bytes (required with shared_memory_region), got null"),
    ({**shm_input("A", "in", 64), "data": list(range(16))},
     "Input must set only one of the following fields: 'data', 'binary_data_size' in 'parameters', "
     "'shared_memory_region' in 'parameters'. But set 'data' 'shared_memory_region'"),
])
def test_a_bad_reference_to_a_region_is_400_with_tritons_words(memory, key, tensor, words):
    memory.registry.register(SYSTEM, "in", {"key": key, "byte_size": 128})
    with pytest.raises(InvalidInput) as raised:
        decode_request(request([tensor]), None, memory)
    assert error_status(raised.value)[0] == 400
    assert words in raised.value.message


def test_a_region_whose_object_is_not_on_this_node_is_400_naming_why(memory, key):
    memory.registry.register(SYSTEM, "in", {"key": key, "byte_size": 64})
    key_path("in", key).unlink()  # what a replica on another node sees: no such object in its /dev/shm
    with pytest.raises(SharedMemoryError) as raised:
        decode_request(request([shm_input("A", "in", 64)]), None, memory)
    assert raised.value.message.startswith(f"Unable to open shared memory region: '{key}'; region 'in' is "
                                           "registered, but")
    assert "another node than the client's" in raised.value.message


def test_outputs_are_written_into_the_region_and_answered_without_data(memory, key):
    memory.registry.register(SYSTEM, "out", {"key": key, "byte_size": 256})
    decoded = decode_request(request([{"name": "A", "datatype": "INT32", "shape": [1], "data": [1]}], [
        {"name": "Y", "parameters": {"shared_memory_region": "out", "shared_memory_byte_size": 64,
                                     "shared_memory_offset": 128, "binary_data": False}},
        {"name": "Z", "parameters": {"binary_data": True}}]), None, memory)
    y, z = np.arange(16, dtype=np.float32).reshape(1, 16), np.array([np.nan], np.float32)
    body, headers = encode_response("m", "1", decoded, {"Y": y, "Z": z}, shm=memory)
    head = json.loads(body[:int(headers["inference-header-content-length"])])
    assert head["outputs"][0] == {"name": "Y", "datatype": "FP32", "shape": [1, 16], "parameters": {
        "shared_memory_region": "out", "shared_memory_byte_size": 64, "shared_memory_offset": 128}}
    assert body.endswith(z.tobytes()) and len(body) == len(json.dumps(head, separators=(",", ":"))) + 4
    np.testing.assert_array_equal(read(key, np.float32, 16, 128), y.ravel())


def test_an_output_larger_than_its_region_bytes_is_400_with_tritons_words(memory, key):
    memory.registry.register(SYSTEM, "out", {"key": key, "byte_size": 256})
    decoded = decode_request(request([{"name": "A", "datatype": "INT32", "shape": [1], "data": [1]}], [
        {"name": "Y", "parameters": {"shared_memory_region": "out", "shared_memory_byte_size": 32}}]), None, memory)
    with pytest.raises(SharedMemoryError) as raised:
        encode_response("m", "1", decoded, {"Y": np.zeros((1, 16), np.float32)}, shm=memory)
    assert raised.value.message.startswith("shared memory size specified with the request for output 'Y' (32 bytes) "
                                           "should be at least 64 bytes to hold the results")


def test_only_shared_memory_outputs_answer_plain_json(memory, key):
    memory.registry.register(SYSTEM, "out", {"key": key, "byte_size": 256})
    decoded = decode_request(request([{"name": "A", "datatype": "INT32", "shape": [1], "data": [1]}], [
        {"name": "Y", "parameters": {"shared_memory_region": "out", "shared_memory_byte_size": 4}}]), None, memory)
    body, headers = encode_response("m", "1", decoded, {"Y": np.array([7], np.int32)}, shm=memory)
    assert headers == {"content-type": "application/json"}
    assert json.loads(body)["outputs"] == [{"name": "Y", "datatype": "INT32", "shape": [1], "parameters": {
        "shared_memory_region": "out", "shared_memory_byte_size": 4}}]


def test_a_mapping_held_by_a_request_is_unmapped_by_a_later_sweep(memory, key):
    memory.registry.register(SYSTEM, "in", {"key": key, "byte_size": 64})
    held = decode_request(request([shm_input("A", "in", 64)]), None, memory)
    memory.store.remove("in")  # unregistered through another router: this process learns it at its sweep
    assert memory.sweep() == 1  # still held by the request in flight
    del held
    assert memory.sweep() == 0


def test_the_sweep_stops_quietly_once_the_loop_executor_is_shut_down(monkeypatch, caplog):
    """A stopping replica shuts its loop's default executor down before its tasks end: the
    sweep then returns, with no traceback in the ``serve run`` terminal."""
    import asyncio

    from deployments import regions

    class Store:
        swept = 0

        def sweep(self) -> None:
            Store.swept += 1

    async def run() -> None:
        monkeypatch.setattr(regions, "SWEEP_S", 0)
        await asyncio.to_thread(Store().sweep)  # the executor works
        await asyncio.get_running_loop().shutdown_default_executor()
        await asyncio.wait_for(regions._sweep_forever(Store()), 10)

    with caplog.at_level("WARNING", logger=regions.logger.name):
        asyncio.run(run())
    assert Store.swept == 1 and caplog.records == []
