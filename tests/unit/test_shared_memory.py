"""Triton's shared-memory extensions without Ray or HTTP (``deployments.protocol.shared_memory``):
registration checked as Triton checks it, inputs read from and outputs written to real objects in
/dev/shm with pread and pwrite (never mapped: a client's object that shrinks never faults the
server), each fault answered with Triton's words."""

from __future__ import annotations

import base64
import contextlib
import json
import multiprocessing
import os
import uuid
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import tritonclient.utils.shared_memory as shm_client

from deployments.protocol.answer import answer
from deployments.protocol.binary import decode_request, encode_response
from deployments.protocol.errors import error_status
from deployments.protocol.shared_memory import CUDA, SYSTEM, Region, RegionCache, SharedMemory, key_path
from deployments.runtime.contract.errors import InvalidInput, RegionNotFound, SharedMemoryError


class DictStore:
    """A ``RegionStore`` in a dict (the server's is Ray's GCS: ``deployments.regions``); ``reads``
    counts its reads by method."""

    def __init__(self) -> None:
        self.items: dict[str, Region] = {}
        self.token: bytes | None = None
        self.reads: Counter[str] = Counter()

    def get(self, name):
        self.reads["get"] += 1
        return self.items.get(name)

    def add(self, region):
        stored = self.items.setdefault(region.name, region) is region
        if stored:
            self.token = uuid.uuid4().bytes
        return stored

    def remove(self, name):
        self.items.pop(name, None)
        self.token = uuid.uuid4().bytes

    def regions(self):
        self.reads["regions"] += 1
        return list(self.items.values())

    def generation(self):
        self.reads["generation"] += 1
        return self.token


@pytest.fixture
def key():
    """A fresh 256-byte object in /dev/shm, removed afterwards."""
    name = f"/trt_serve_test_{uuid.uuid4().hex[:12]}"
    handle = shm_client.create_shared_memory_region("r", name, 256)
    yield name
    with contextlib.suppress(FileNotFoundError):  # a test removed it
        shm_client.destroy_shared_memory_region(handle)


@pytest.fixture
def object_key():
    """A fresh 256-byte object in /dev/shm that this process has not mapped (``key``'s is mapped
    by the client library), removed afterwards."""
    name = f"/trt_serve_test_{uuid.uuid4().hex[:12]}"
    key_path("r", name).write_bytes(bytes(256))
    yield name
    key_path("r", name).unlink(missing_ok=True)


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


def test_a_name_no_region_can_have_is_refused_by_status_as_by_register_and_errors_stay_short(memory):
    """Status of a 300-character name answered 404 "Unable to find ..." though register refuses
    such a name (400); a 20,000-character one quoted whole made a gRPC error's trailer overflow
    gRPC's metadata limit (the client got RESOURCE_EXHAUSTED "Stream removed")."""
    with pytest.raises(SharedMemoryError, match="^invalid shared memory region name .* a region name is 1 to 255"):
        memory.registry.status(SYSTEM, "m" * 300)
    whole = f"Unable to find system shared memory region: '{'m' * 20000}'"
    status, message = error_status(RegionNotFound(whole))
    assert status == 404 and message == f"{whole[:2000]}... ({len(whole) - 2000} more characters)"


def test_cuda_register_needs_a_64_byte_handle(memory):
    with pytest.raises(SharedMemoryError, match="^'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t"):
        memory.registry.register(CUDA, "g", {"raw_handle": {"b64": "AAAA"}, "device_id": 0, "byte_size": 8})


def test_inputs_are_read_from_the_region_as_aligned_copies_leaving_nothing_mapped_or_open(memory, object_key):
    key = object_key
    a, b = np.arange(16, dtype=np.int32), np.full(16, 3, np.int32)
    write(key, a, 32)
    write(key, b, 96)
    memory.registry.register(SYSTEM, "in", {"key": key, "offset": 32, "byte_size": 128})
    got = decode_request(request([shm_input("A", "in", 64), shm_input("B", "in", 64, offset=64)]), None, memory)
    np.testing.assert_array_equal(got.inputs["A"], a.reshape(1, 16))
    np.testing.assert_array_equal(got.inputs["B"], b.reshape(1, 16))
    assert got.inputs["A"].ctypes.data % 64 == 0 and got.inputs["B"].ctypes.data % 64 == 0
    write(key, a * 10, 32)  # the client writes again: the decoded input is the request's own copy
    np.testing.assert_array_equal(got.inputs["A"], a.reshape(1, 16))
    assert not mapped_here(key) and not open_here(key)


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


def mapped_here(key: str) -> bool:
    """Whether this process has the object of ``key`` mapped (its ``/proc/self/maps``)."""
    return str(key_path("r", key)) in Path("/proc/self/maps").read_text()


def open_here(key: str) -> bool:
    """Whether this process holds the object of ``key`` open (its ``/proc/self/fd``)."""
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is closed by now
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
    return str(key_path("r", key)) in targets


def in_a_child(scenario, *args):
    """``scenario(*args)`` run in a forked child process, so that a fault that kills a process
    (SIGBUS) fails the test instead of ending pytest. Returns the child's exit code (negative:
    the signal that killed it) and what ``scenario`` returned (None: it returned nothing)."""
    context = multiprocessing.get_context("fork")
    results = context.SimpleQueue()
    child = context.Process(target=lambda: results.put(scenario(*args)))
    child.start()
    child.join(60)
    return child.exitcode, None if results.empty() else results.get()


def shrunk_text(key: str, where: str, region: str, size: int) -> str:
    """The 400 of a tensor at offset 64 of 64 bytes of a region at offset 0 over ``key``,
    whose object holds ``size`` bytes now."""
    return (f"Invalid shared memory region: '{key}'; {where}: region '{region}', offset 64, byte size 64 needs bytes "
            f"64 to 128 of {key_path('r', key)}, and it holds {size} bytes now (the client shrank it since the "
            "region was registered); write the object back to its size or register the region again")


def shrink_then_read(key: str, size: int, used_before: bool):
    """A replica's read of an input after the client truncated its object to ``size`` bytes
    (``used_before``: a request read it before the truncation, as a replica that served the
    client already has): the decoded values, or the error's status and text."""
    memory = SharedMemory(DictStore())
    memory.registry.register(SYSTEM, "in", {"key": key, "byte_size": 256})
    body = request([shm_input("A", "in", 64, offset=64)])
    if used_before:
        decode_request(body, None, memory).inputs["A"].sum()
    os.truncate(key_path("r", key), size)
    try:
        return decode_request(body, None, memory).inputs["A"].tolist()  # the values, as a model reads them
    except SharedMemoryError as error:
        return error_status(error)[0], error.message


@pytest.mark.parametrize("size", [0, 100])
@pytest.mark.parametrize("used_before", [False, True])
def test_an_input_whose_object_shrank_after_register_is_400_naming_it_and_the_process_lives(object_key, size,
                                                                                             used_before):
    exitcode, result = in_a_child(shrink_then_read, object_key, size, used_before)
    assert exitcode == 0  # before pread: -7, the child killed by SIGBUS where a request had mapped it
    assert result == (400, shrunk_text(object_key, "input 'A'", "in", size))


def shrink_then_write(key: str, size: int):
    """A replica's write of an output after the client truncated its object to ``size`` bytes,
    the region written once before: the error's status and text, and the object's size after."""
    memory = SharedMemory(DictStore())
    memory.registry.register(SYSTEM, "out", {"key": key, "byte_size": 256})
    params = {"Y": {"shared_memory_region": "out", "shared_memory_byte_size": 64, "shared_memory_offset": 64}}
    output = {"Y": np.arange(16, dtype=np.int32)}
    memory.write_outputs(params, output)
    os.truncate(key_path("r", key), size)
    try:
        memory.write_outputs(params, output)
        return None
    except SharedMemoryError as error:
        return error_status(error)[0], error.message, os.stat(key_path("r", key)).st_size


@pytest.mark.parametrize("size", [0, 100])
def test_an_output_whose_object_shrank_after_register_is_400_naming_it_and_the_object_is_left_as_is(object_key, size):
    exitcode, result = in_a_child(shrink_then_write, object_key, size)
    assert exitcode == 0  # before pwrite: -7, the child killed by SIGBUS
    assert result == (400, shrunk_text(object_key, "output 'Y'", "out", size), size)


def test_an_object_grown_back_after_a_shrink_is_read_again(memory, object_key):
    memory.registry.register(SYSTEM, "in", {"key": object_key, "byte_size": 256})
    os.truncate(key_path("r", object_key), 0)
    with pytest.raises(SharedMemoryError):
        decode_request(request([shm_input("A", "in", 64, offset=64)]), None, memory)
    write(object_key, np.full(64, 5, np.int32))
    assert decode_request(request([shm_input("A", "in", 64, offset=64)]), None, memory).inputs["A"].tolist() \
        == [[5] * 16]


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


def recreate(key: str, array: np.ndarray) -> None:
    """What a client does that destroys its object and creates a new one at the same key
    (Triton's simple_http_shm_client.py, then simple_grpc_shm_client.py): a new object, a new inode."""
    path = key_path("r", key)
    path.unlink()
    path.write_bytes(array.tobytes().ljust(256, b"\0"))


def test_a_name_registered_again_over_a_new_object_at_its_key_is_read_and_written_there(key):
    """The replica maps "in" and "out" for a first client; the client unregisters them through
    the router (the replica is not told: it learns at its sweep), creates new objects at the same
    keys and registers the same names: the replica reads the new input and writes the new output
    object, never the first (unlinked) ones it still has mapped."""
    store = DictStore()
    router, replica = SharedMemory(store), SharedMemory(store)
    out_key = f"{key}_out"
    shm_client.create_shared_memory_region("o", out_key, 256)
    try:
        for round_, base in enumerate((1, 100)):
            if round_:
                router.registry.unregister(SYSTEM)
                recreate(key, np.full(16, base, np.int32))
                recreate(out_key, np.zeros(64, np.int32))
            else:
                write(key, np.full(16, base, np.int32))
            router.registry.register(SYSTEM, "in", {"key": key, "byte_size": 64})
            router.registry.register(SYSTEM, "out", {"key": out_key, "byte_size": 64})
            decoded = decode_request(request([shm_input("A", "in", 64)], [
                {"name": "Y", "parameters": {"shared_memory_region": "out", "shared_memory_byte_size": 64}}]),
                None, replica)
            assert decoded.inputs["A"].tolist() == [[base] * 16]
            encode_response("m", "1", decoded, {"Y": decoded.inputs["A"] + 1}, shm=replica)
            assert read(out_key, np.int32, 16).tolist() == [base + 1] * 16
            del decoded
    finally:
        key_path("o", out_key).unlink()
        replica.close()
    assert replica.sweep() == 0  # the first objects' mappings are gone once unregistered


def test_an_object_replaced_at_its_key_without_a_new_register_is_400_naming_why(memory, key):
    memory.registry.register(SYSTEM, "in", {"key": key, "byte_size": 64})
    assert decode_request(request([shm_input("A", "in", 64)]), None, memory).inputs["A"].tolist() == [[0] * 16]
    recreate(key, np.full(16, 7, np.int32))
    for process in (memory, SharedMemory(memory.store)):  # one that mapped the first object, one that did not
        with pytest.raises(SharedMemoryError) as raised:
            decode_request(request([shm_input("A", "in", 64)]), None, process)
        assert raised.value.message.startswith(f"Unable to open shared memory region: '{key}'; region 'in' was "
                                               f"registered over another object than {key_path('r', key)} is now")
        assert error_status(raised.value)[0] == 400


class ListedWhileRegistering(DictStore):
    """A store whose listing is overtaken: while a sweep reads it, ``meanwhile`` runs (a client
    registers a region and a request opens it) after the regions were listed."""

    meanwhile = None

    def regions(self):
        listed = super().regions()
        if self.meanwhile is not None:
            self.meanwhile()
        return listed


def test_a_region_unregistered_while_a_request_reads_it_and_registered_again_is_usable(memory, key):
    memory.registry.register(SYSTEM, "in", {"key": key, "byte_size": 64})
    held = decode_request(request([shm_input("A", "in", 64)]), None, memory)
    memory.registry.unregister(SYSTEM, "in")
    memory.registry.register(SYSTEM, "in", {"key": key, "byte_size": 64})  # the same object again
    write(key, np.full(16, 4, np.int32))
    assert decode_request(request([shm_input("A", "in", 64)]), None, memory).inputs["A"].tolist() == [[4] * 16]
    assert held.inputs["A"].tolist() == [[0] * 16]  # the earlier request keeps its own copy


def test_a_registration_of_another_server_version_reads_with_defaults_and_without_unknown_fields():
    older = json.dumps({"name": "r", "kind": SYSTEM, "byte_size": 8, "key": "/k", "offset": 0, "device_id": 0,
                        "raw_handle": ""}).encode()
    assert Region.from_json(older) == Region("r", SYSTEM, 8, key="/k")  # no object identity: taken as it is
    newer = json.dumps({**json.loads(older), "dev": 5, "ino": 7, "added_later": 1}).encode()
    assert Region.from_json(newer) == Region("r", SYSTEM, 8, key="/k", dev=5, ino=7)


def infer_through(replica: SharedMemory, body: bytes) -> dict:
    """One infer request as a replica answers it (``protocol.answer.answer``), of a model whose
    output ``Y`` is its input ``A`` + 1; returns the answer's JSON."""
    import asyncio

    async def run(decoded):
        return {"Y": decoded.inputs["A"] + 1}

    done = asyncio.run(answer("m", "1", False, [body], None, run, replica))
    return json.loads(done.content)


def test_a_request_reads_the_generation_once_and_a_region_once_a_generation(key):
    store = DictStore()
    router, replica = SharedMemory(store), SharedMemory(store)
    router.registry.register(SYSTEM, "in", {"key": key, "byte_size": 64})
    router.registry.register(SYSTEM, "out", {"key": key, "offset": 128, "byte_size": 64})
    body = request([shm_input("A", "in", 64)], [
        {"name": "Y", "parameters": {"shared_memory_region": "out", "shared_memory_byte_size": 64}}])
    try:
        store.reads.clear()
        infer_through(replica, body)
        assert store.reads == {"generation": 1, "get": 2}  # the input's region, the output's
        store.reads.clear()
        infer_through(replica, body)
        assert store.reads == {"generation": 1}
        store.reads.clear()
        infer_through(replica, request([{"name": "A", "datatype": "INT32", "shape": [1, 16], "data": [0] * 16}]))
        assert store.reads == {}  # no region named: the store is not read
    finally:
        replica.close()


@pytest.mark.parametrize("again", [{"offset": 64}, {"byte_size": 32}, {"key": "other"}])
def test_a_region_registered_again_differently_is_used_by_the_next_request_of_every_process(key, again):
    """The replica has read region "in" (its record kept); the client unregisters it and registers
    the same name over another offset, size or key, through the router: the replica's next
    request uses the new registration, never the record it kept."""
    other = f"{key}_other"
    shm_client.create_shared_memory_region("o", other, 256)
    write(key, np.arange(64, dtype=np.int32))
    write(other, np.arange(1000, 1064, dtype=np.int32))
    store = DictStore()
    router, replica = SharedMemory(store), SharedMemory(store)
    try:
        router.registry.register(SYSTEM, "in", {"key": key, "byte_size": 128})
        one = request([shm_input("A", "in", 32, shape=(1, 8))])
        assert infer_through(replica, one)["outputs"][0]["data"] == list(range(1, 9))
        router.registry.unregister(SYSTEM, "in")
        new = {"key": key, "byte_size": 128, **again}
        router.registry.register(SYSTEM, "in", {**new, "key": other if new["key"] == "other" else key})
        expected = {"offset": list(range(17, 25)), "byte_size": list(range(1, 9)), "key": list(range(1001, 1009))}
        assert infer_through(replica, one)["outputs"][0]["data"] == expected[next(iter(again))]
        if "byte_size" in again:  # the new, smaller size bounds the next request
            with pytest.raises(SharedMemoryError, match="^Invalid offset for shared memory region: 'in'; input 'A': "
                                                        "offset 32, the region holds 32 bytes"):
                infer_through(replica, request([shm_input("A", "in", 32, offset=32, shape=(1, 8))]))
    finally:
        key_path("o", other).unlink()
        replica.close()


@pytest.mark.parametrize("name", ["in", None])
def test_an_unregistered_region_is_400_for_the_next_request_of_every_process(key, name):
    store = DictStore()
    router, replica = SharedMemory(store), SharedMemory(store)
    try:
        router.registry.register(SYSTEM, "in", {"key": key, "byte_size": 64})
        one = request([shm_input("A", "in", 64)])
        assert infer_through(replica, one)["outputs"][0]["data"] == [1] * 16
        router.registry.unregister(SYSTEM, name)  # by name, or every system region
        with pytest.raises(SharedMemoryError) as raised:
            infer_through(replica, one)
        assert raised.value.message.startswith("Unable to find shared memory region: 'in'; input 'A' names it, and "
                                               "it is not registered")
        assert error_status(raised.value)[0] == 400
    finally:
        replica.close()


class ChangedWhileRead(DictStore):
    """A store whose read of a region is overtaken: ``meanwhile`` runs after the record was read
    and before it is returned (a client registers the name again, a newer request starts)."""

    meanwhile = None

    def get(self, name):
        region = super().get(name)
        if self.meanwhile is not None:
            meanwhile, self.meanwhile = self.meanwhile, None
            meanwhile()
        return region


def test_a_record_read_under_an_older_generation_is_not_kept_for_newer_requests():
    store = ChangedWhileRead()
    store.add(Region("r", SYSTEM, 64, key="/k"))
    cache = RegionCache(store)
    older = cache.lookup()
    newer = []

    def register_again_and_start_a_request():
        store.remove("r")
        store.add(Region("r", SYSTEM, 32, key="/k", offset=32))
        newer.append(cache.lookup())

    store.meanwhile = register_again_and_start_a_request
    assert older("r").offset == 0  # the request that started first reads what was registered then
    assert newer[0]("r").offset == 32 and cache.lookup()("r").offset == 32


def test_system_regions_leave_the_sweep_nothing_to_close_or_read(key):
    store = DictStore()
    router, replica = SharedMemory(store), SharedMemory(store)
    router.registry.register(SYSTEM, "in", {"key": key, "byte_size": 64})
    infer_through(replica, request([shm_input("A", "in", 64)]))
    store.reads.clear()
    assert replica.sweep() == 0 and store.reads == {}  # nothing held open between requests
