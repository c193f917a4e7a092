"""Triton's system shared-memory extension against the real server, with tritonclient.http and
tritonclient.utils.shared_memory unmodified: regions registered through the router and used by a
pool replica and a dedicated model's replica (other processes), and by a process started after
the registration; every fault 400 (status 404) in Triton's words, the server serving after each;
shared-memory requests counted by the statistics as any other; Triton's HTTP and gRPC shm examples'
sequence (the same names and keys over new objects) and a burst of requests on regions registered a
moment before answered 200 with the right outputs; an object the client truncates after register
answered 400 over HTTP and gRPC by pool, dedicated and pipeline replicas that serve on."""

from __future__ import annotations

import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnxruntime as ort
import pytest
import requests

from deployments.observe.metrics import FLUSH_INTERVAL_S

from .conftest import REPOSITORY

pytestmark = pytest.mark.integration


@pytest.fixture
def client(server):
    import tritonclient.http as httpclient

    triton = httpclient.InferenceServerClient(server.removeprefix("http://"), network_timeout=120)
    triton.unregister_system_shared_memory()
    triton.unregister_cuda_shared_memory()
    yield triton
    triton.unregister_system_shared_memory()
    triton.unregister_cuda_shared_memory()


@pytest.fixture
def regions():
    """Create regions in /dev/shm (``make(name, byte_size)`` -> (handle, key)); destroyed after."""
    import tritonclient.utils.shared_memory as shm

    made = []

    def make(name: str, byte_size: int):
        key = f"/trt_serve_it_{name}_{uuid.uuid4().hex[:8]}"
        made.append(shm.create_shared_memory_region(name, key, byte_size))
        return made[-1], key

    yield make
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def simple_through_regions(client, regions, in_name="in", out_name="out"):
    """Triton's simple_http_shm_client: INPUT0, INPUT1 in one region, OUTPUT0, OUTPUT1 in another."""
    import tritonclient.http as httpclient
    import tritonclient.utils.shared_memory as shm

    a, b = np.arange(16, dtype=np.int32), np.full(16, 5, np.int32)
    out_handle, out_key = regions(out_name, 128)
    in_handle, in_key = regions(in_name, 128)
    shm.set_shared_memory_region(in_handle, [a])
    shm.set_shared_memory_region(in_handle, [b], offset=64)
    client.register_system_shared_memory(out_name, out_key, 128)
    client.register_system_shared_memory(in_name, in_key, 128)
    inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"), httpclient.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_shared_memory(in_name, 64)
    inputs[1].set_shared_memory(in_name, 64, offset=64)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
               httpclient.InferRequestedOutput("OUTPUT1", binary_data=True)]
    outputs[0].set_shared_memory(out_name, 64)
    outputs[1].set_shared_memory(out_name, 64, offset=64)
    return a, b, out_handle, in_key, out_key, inputs, outputs


def test_simple_reads_its_inputs_from_a_region_and_writes_its_outputs_into_one(client, regions):
    import tritonclient.utils.shared_memory as shm

    a, b, out_handle, in_key, out_key, inputs, outputs = simple_through_regions(client, regions)
    result = client.infer("simple", inputs, outputs=outputs)
    assert result.get_output("OUTPUT0") == {"name": "OUTPUT0", "datatype": "INT32", "shape": [1, 16], "parameters": {
        "shared_memory_region": "out", "shared_memory_byte_size": 64}}
    assert all("data" not in output for output in result.get_response()["outputs"])  # no data in the answer
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.int32, [1, 16]), [a + b])
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.int32, [1, 16], offset=64), [a - b])
    assert client.get_system_shared_memory_status() == [
        {"name": "in", "key": in_key, "offset": 0, "byte_size": 128},
        {"name": "out", "key": out_key, "offset": 0, "byte_size": 128}]
    client.unregister_system_shared_memory("in")
    assert [r["name"] for r in client.get_system_shared_memory_status()] == ["out"]


def reference(model: str, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(f"{REPOSITORY}/{model}/1/model.onnx", providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


@pytest.mark.parametrize("model, input_name, output_name, shape, classes", [
    ("tiny_cnn", "input", "logits", (2, 3, 224, 224), 1000),  # a pool replica
    ("ocr_cls", "x", "save_infer_model/scale_0.tmp_1", (2, 3, 48, 192), 2),  # a dedicated model's replica
])
def test_fp32_models_through_regions_equal_onnxruntime(client, regions, model, input_name, output_name, shape,
                                                       classes):
    import tritonclient.http as httpclient
    import tritonclient.utils.shared_memory as shm

    x = np.random.default_rng(3).standard_normal(shape, dtype=np.float32)
    out_bytes = shape[0] * classes * 4
    handle, key = regions("tensors", 64 + x.nbytes + out_bytes)
    shm.set_shared_memory_region(handle, [x], offset=64)
    client.register_system_shared_memory("tensors", key, x.nbytes + out_bytes, offset=64)  # at an offset of the key
    tensor = httpclient.InferInput(input_name, list(shape), "FP32").set_shared_memory("tensors", x.nbytes)
    wanted = httpclient.InferRequestedOutput(output_name)
    wanted.set_shared_memory("tensors", out_bytes, offset=x.nbytes)
    client.infer(model, [tensor], outputs=[wanted])
    got = shm.get_contents_as_numpy(handle, np.float32, [shape[0], classes], offset=64 + x.nbytes)
    np.testing.assert_allclose(got, reference(model, x), rtol=1e-5, atol=1e-5)


def test_a_process_started_after_the_registration_uses_the_region(client, regions):
    """Every replica reads a region from Ray's GCS when a request names it: here a Ray worker
    started after the registration decodes a request naming it through the server's code."""
    import ray
    import tritonclient.utils.shared_memory as shm

    handle, key = regions("later", 64)
    shm.set_shared_memory_region(handle, [np.arange(16, dtype=np.int32)])
    client.register_system_shared_memory("later", key, 64)

    @ray.remote(num_cpus=0)
    def decode_in_a_new_process() -> list:
        import json

        from deployments.protocol.binary import decode_request
        from deployments.protocol.shared_memory import SharedMemory
        from deployments.regions import GcsRegionStore

        body = json.dumps({"inputs": [{"name": "A", "datatype": "INT32", "shape": [16], "parameters": {
            "shared_memory_region": "later", "shared_memory_byte_size": 64}}]}).encode()
        return decode_request(body, None, SharedMemory(GcsRegionStore())).inputs["A"].tolist()

    assert ray.get(decode_in_a_new_process.options(runtime_env={"working_dir": None}).remote()) == list(range(16))


@pytest.mark.parametrize("model, input_name, output_name, shape, classes", [
    ("tiny_cnn", "input", "logits", (1, 3, 224, 224), 1000),  # a pool replica
    ("ocr_cls", "x", "save_infer_model/scale_0.tmp_1", (1, 3, 48, 192), 2),  # a dedicated model's replica
])
def test_a_region_registered_again_differently_or_unregistered_is_seen_by_the_next_request(
        server, grpc_url, client, regions, model, input_name, output_name, shape, classes):
    """Each replica keeps the registrations its requests read until a register or unregister
    changes the store's generation: the same name registered again over the same object at
    another offset, through HTTP or gRPC, is read there by the next requests (over either),
    never at the offset kept; every region unregistered (HTTP or gRPC, all at once) is 400 in
    Triton's words for the next requests."""
    import tritonclient.grpc as grpcclient
    import tritonclient.utils.shared_memory as shm
    from tritonclient.utils import InferenceServerException

    rng = np.random.default_rng(11)
    xs = [rng.standard_normal(shape, dtype=np.float32) for _ in range(2)]
    size, out_bytes = xs[0].nbytes, shape[0] * classes * 4
    handle, key = regions("again", 2 * size + out_bytes)  # [x0][x1][output]
    shm.set_shared_memory_region(handle, xs)
    body = {"inputs": [{"name": input_name, "datatype": "FP32", "shape": list(shape), "parameters": {
                "shared_memory_region": "in", "shared_memory_byte_size": size}}],
            "outputs": [{"name": output_name, "parameters": {
                "shared_memory_region": "out", "shared_memory_byte_size": out_bytes}}]}

    def output() -> np.ndarray:
        return shm.get_contents_as_numpy(handle, np.float32, [shape[0], classes], offset=2 * size)

    def over_grpc(triton) -> None:
        tensor = grpcclient.InferInput(input_name, list(shape), "FP32").set_shared_memory("in", size)
        wanted = grpcclient.InferRequestedOutput(output_name)
        wanted.set_shared_memory("out", out_bytes)
        triton.infer(model, [tensor], outputs=[wanted])

    def register(triton, offset: int) -> None:
        triton.register_system_shared_memory("in", key, size, offset=offset)
        triton.register_system_shared_memory("out", key, out_bytes, offset=2 * size)

    expected = [reference(model, x) for x in xs]
    with grpcclient.InferenceServerClient(grpc_url) as over:
        for registrar, offset in ((client, 0), (over, size), (client, 0)):
            client.unregister_system_shared_memory("in")
            client.unregister_system_shared_memory("out")
            register(registrar, offset)
            for _ in range(4):  # requests through several replicas where there are several
                shm.set_shared_memory_region(handle, [np.full((shape[0], classes), np.nan, np.float32)],
                                             offset=2 * size)
                assert post(server, f"/v2/models/{model}/infer", body).status_code == 200
                np.testing.assert_allclose(output(), expected[offset // size], rtol=1e-5, atol=1e-5)
                over_grpc(over)
                np.testing.assert_allclose(output(), expected[offset // size], rtol=1e-5, atol=1e-5)
        client.unregister_system_shared_memory()
        for unregister in (over.unregister_system_shared_memory, client.unregister_system_shared_memory):
            register(client, 0)
            post(server, f"/v2/models/{model}/infer", body).raise_for_status()
            unregister()  # every region, by the other protocol in turn
            for _ in range(4):
                r = post(server, f"/v2/models/{model}/infer", body)
                assert (r.status_code, r.json()["error"].startswith(
                    f"Unable to find shared memory region: 'in'; input '{input_name}' names it")) == (400, True)
                with pytest.raises(InferenceServerException) as refused:
                    over_grpc(over)
                assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
                assert "Unable to find shared memory region: 'in'" in refused.value.message()


def post(server: str, path: str, body=None) -> requests.Response:
    return requests.post(f"{server}{path}", json=body, timeout=60)


def shm_input(region: str, size: int, offset: int = 0) -> dict:
    return {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "parameters": {
        "shared_memory_region": region, "shared_memory_byte_size": size, "shared_memory_offset": offset}}


JSON_INPUT1 = {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16}


def test_every_fault_is_answered_in_tritons_words_and_the_server_keeps_serving(server, client, regions):
    _, key = regions("faults", 128)
    assert post(server, "/v2/systemsharedmemory/region/faults/register", {"key": key, "byte_size": 64}).status_code == 200
    cuda = {"raw_handle": {"b64": "A" * 86 + "=="}, "device_id": 0, "byte_size": 64}
    assert post(server, "/v2/cudasharedmemory/region/gpu/register", cuda).status_code == 200
    cases = [
        ("/v2/systemsharedmemory/region/faults/register", {"key": key, "byte_size": 8}, 400,
         "shared memory region 'faults' already in manager"),
        ("/v2/systemsharedmemory/region/evil/register", {"key": "/../etc/passwd", "byte_size": 8}, 400,
         "cannot register shared memory region 'evil' - invalid shm key '/../etc/passwd'"),
        ("/v2/systemsharedmemory/region/gone/register", {"key": "/no_such_key_here", "byte_size": 8}, 400,
         "Unable to open shared memory region: '/no_such_key_here'"),
        ("/v2/systemsharedmemory/region/big/register", {"key": key, "offset": 64, "byte_size": 128}, 400,
         "failed to register shared memory region 'big': invalid args"),
        ("/v2/models/simple/infer", {"inputs": [shm_input("nope", 64), JSON_INPUT1]}, 400,
         "Unable to find shared memory region: 'nope'"),
        ("/v2/models/simple/infer", {"inputs": [shm_input("faults", 64, offset=64), JSON_INPUT1]}, 400,
         "Invalid offset for shared memory region: 'faults'"),
        ("/v2/models/simple/infer", {"inputs": [shm_input("faults", 64, offset=32), JSON_INPUT1]}, 400,
         "Invalid offset + byte size for shared memory region: 'faults'"),
        ("/v2/models/simple/infer", {"inputs": [shm_input("faults", 32), JSON_INPUT1]}, 400,
         "input byte size mismatch for input 'INPUT0'. Expected 64, got 32"),
        ("/v2/models/simple/infer", {"inputs": [shm_input("gpu", 64), JSON_INPUT1]}, 400,
         "input 'INPUT0': shared memory region 'gpu' is CUDA shared memory, and this server reads and writes CUDA "
         "shared memory only in a replica that runs the model on a GPU; this model runs on the CPU here"),
        ("/v2/models/simple/infer", {"inputs": [{**JSON_INPUT1, "name": "INPUT0"}, JSON_INPUT1], "outputs": [
            {"name": "OUTPUT0", "parameters": {"shared_memory_region": "faults", "shared_memory_byte_size": 32}}]},
         400, "shared memory size specified with the request for output 'OUTPUT0' (32 bytes) should be at least "
              "64 bytes to hold the results"),
    ]
    for path, body, status, words in cases:
        r = post(server, path, body)
        assert (r.status_code, words in r.json()["error"]) == (status, True), (path, r.text)
        ok = post(server, "/v2/models/simple/infer", {"inputs": [{**JSON_INPUT1, "name": "INPUT0"}, JSON_INPUT1]})
        assert ok.status_code == 200
    r = requests.get(f"{server}/v2/systemsharedmemory/region/gpu/status", timeout=60)
    assert (r.status_code, r.json()) == (404, {"error": "The region named 'gpu' is registered as CUDA shared memory, "
                                                        "not system shared memory"})
    r = requests.get(f"{server}/v2/cudasharedmemory/region/nope/status", timeout=60)
    assert (r.status_code, r.json()) == (404, {"error": "Unable to find cuda shared memory region: 'nope'"})
    assert client.get_cuda_shared_memory_status() == [{"name": "gpu", "device_id": 0, "byte_size": 64}]


def success_count(server: str, model: str) -> int:
    stats = requests.get(f"{server}/v2/models/{model}/stats", timeout=60).json()
    return stats["model_stats"][0]["inference_stats"]["success"]["count"]


def settled_count(server: str, model: str, expected: int | None = None, timeout_s: float = 30.0) -> int:
    """The success count once the replicas have written theirs (they flush every
    ``FLUSH_INTERVAL_S``): ``expected`` once it reads so, else the same value read twice a
    flush interval and more apart; the last reading at the deadline."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        count = success_count(server, model)
        if count == expected or (expected is None and count == last):
            return count
        last = count
        time.sleep(5 * FLUSH_INTERVAL_S)
    return count


def test_shared_memory_requests_count_in_the_statistics_as_any_other(server, client, regions):
    _, _, _, _, _, inputs, outputs = simple_through_regions(client, regions, "count_in", "count_out")
    before = settled_count(server, "simple")
    for _ in range(3):
        client.infer("simple", inputs, outputs=outputs)
    assert settled_count(server, "simple", before + 3) == before + 3


def example_round(module, triton, keys: tuple[str, str], base: int) -> tuple[np.ndarray, np.ndarray]:
    """What Triton's simple_http_shm_client.py and simple_grpc_shm_client.py each do (``module``:
    ``tritonclient.http`` or ``tritonclient.grpc``): objects created at fixed keys, registered as
    "input_data" and "output_data", one infer of ``simple``, unregistered, destroyed. Returns the
    outputs read from the output object (sum, difference) and the inputs (``base``: this round's)."""
    import tritonclient.utils.shared_memory as shm

    a, b = np.arange(base, base + 16, dtype=np.int32), np.full(16, base + 1, np.int32)
    out_handle = shm.create_shared_memory_region("output_data", keys[1], 128)
    in_handle = shm.create_shared_memory_region("input_data", keys[0], 128)
    try:
        shm.set_shared_memory_region(in_handle, [a])
        shm.set_shared_memory_region(in_handle, [b], offset=64)
        triton.register_system_shared_memory("output_data", keys[1], 128)
        triton.register_system_shared_memory("input_data", keys[0], 128)
        inputs = [module.InferInput("INPUT0", [1, 16], "INT32"), module.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_shared_memory("input_data", 64)
        inputs[1].set_shared_memory("input_data", 64, offset=64)
        outputs = [module.InferRequestedOutput("OUTPUT0"), module.InferRequestedOutput("OUTPUT1")]
        outputs[0].set_shared_memory("output_data", 64)
        outputs[1].set_shared_memory("output_data", 64, offset=64)
        triton.infer("simple", inputs, outputs=outputs)
        got = (shm.get_contents_as_numpy(out_handle, np.int32, [16]).copy(),
               shm.get_contents_as_numpy(out_handle, np.int32, [16], offset=64).copy())
        triton.unregister_system_shared_memory()
    finally:
        shm.destroy_shared_memory_region(out_handle)
        shm.destroy_shared_memory_region(in_handle)
    return got, (a, b)


def test_the_shm_examples_one_after_another_each_get_their_own_sums(server, grpc_url, client):
    """Triton's HTTP and gRPC shm examples, run one after another against one server, use the
    same region names and keys: the second's objects are new objects at the same keys, and its
    answer must be read from and written into them, not into the first's (unlinked) objects."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    run = uuid.uuid4().hex[:8]
    keys = (f"/trt_serve_it_input_simple_{run}", f"/trt_serve_it_output_simple_{run}")
    with grpcclient.InferenceServerClient(grpc_url) as over_grpc:
        for base, (module, triton) in enumerate([(httpclient, client), (grpcclient, over_grpc), (grpcclient, over_grpc),
                                                 (httpclient, client), (httpclient, client)]):
            (sums, differences), (a, b) = example_round(module, triton, keys, 100 * base)
            assert (sums.tolist(), differences.tolist()) == ((a + b).tolist(), (a - b).tolist()), (base, module.__name__)


def test_a_burst_of_requests_on_regions_registered_a_moment_before_is_answered_200_with_the_right_outputs(
        server, client, regions):
    """Closed-loop clients, each registering fresh input and output regions and naming them in
    requests at once (bench.frontdoors' shared-memory clients), among many regions registered
    (a replica's sweep once read each of them while regions were first used; it has nothing of a
    system region to close now): every request is answered 200 with the model's output in its
    region, none 500."""
    import tritonclient.utils.shared_memory as shm

    _, filler_key = regions("filler", 64)
    with ThreadPoolExecutor(6) as pool:  # a sweep reads each registered region: this makes it take a while
        list(pool.map(lambda i: post(server, f"/v2/systemsharedmemory/region/filler_{i}/register",
                                     {"key": filler_key, "byte_size": 64}).raise_for_status(), range(300)))
    x = np.random.default_rng(5).standard_normal((1, 3, 224, 224), dtype=np.float32)
    expected = reference("tiny_cnn", x)
    stop = time.monotonic() + 15

    def burst(worker: int) -> list:
        answers = []
        with requests.Session() as session:
            while time.monotonic() < stop:
                name = f"burst_{worker}_{len(answers)}"
                in_key, out_key = (f"/trt_serve_it_{name}_{end}_{uuid.uuid4().hex[:8]}" for end in ("in", "out"))
                in_handle = shm.create_shared_memory_region(f"{name}_in", in_key, x.nbytes)
                out_handle = shm.create_shared_memory_region(f"{name}_out", out_key, expected.nbytes)
                shm.set_shared_memory_region(in_handle, [x])
                for region, key, size in ((f"{name}_in", in_key, x.nbytes), (f"{name}_out", out_key, expected.nbytes)):
                    registered = session.post(f"{server}/v2/systemsharedmemory/region/{region}/register",
                                              json={"key": key, "byte_size": size}, timeout=60)
                    assert registered.status_code == 200, registered.text
                body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape), "parameters": {
                            "shared_memory_region": f"{name}_in", "shared_memory_byte_size": x.nbytes}}],
                        "outputs": [{"name": "logits", "parameters": {
                            "shared_memory_region": f"{name}_out", "shared_memory_byte_size": expected.nbytes}}]}
                for _ in range(3):
                    shm.set_shared_memory_region(out_handle, [np.full_like(expected, np.nan)])
                    r = session.post(f"{server}/v2/models/tiny_cnn/infer", json=body, timeout=60)
                    got = shm.get_contents_as_numpy(out_handle, np.float32, expected.shape)
                    answers.append((r.status_code, r.text if r.status_code != 200 else "",
                                    bool(np.allclose(got, expected, rtol=1e-4, atol=1e-4))))
                for region in (f"{name}_in", f"{name}_out"):
                    session.post(f"{server}/v2/systemsharedmemory/region/{region}/unregister", timeout=60)
                shm.destroy_shared_memory_region(in_handle)
                shm.destroy_shared_memory_region(out_handle)
        return answers

    with ThreadPoolExecutor(6) as pool:
        answers = [a for worker in pool.map(burst, range(6)) for a in worker]
    failed = [a for a in answers if a != (200, "", True)]
    assert answers and not failed, (len(answers), failed[:5])


def replica_processes() -> dict[str, int]:
    """Every live Serve replica of this session's Ray: its actor name (a new one for a replica
    Serve starts in place of one that died) -> its process id."""
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith("SERVE_REPLICA::")]
    pids = ray.get([ray.get_actor(name, namespace="serve").__ray_call__.remote(lambda self: os.getpid())
                    for name in names], timeout=60)
    return dict(zip(names, pids))


def shrunk(key: str, where: str, region: str, size: int) -> str:
    """The 400 of ``size`` bytes at offset 0 of ``region`` (at offset 0 of ``key``), whose object
    the client truncated to 0 bytes."""
    return (f"Invalid shared memory region: '{key}'; {where}: region '{region}', offset 0, byte size {size} needs "
            f"bytes 0 to {size} of /dev/shm/{key.lstrip('/')}, and it holds 0 bytes now (the client shrank it since "
            "the region was registered); write the object back to its size or register the region again")


def refused_over_both(server, over_grpc, model: str, body: dict, grpc_call, words: str) -> None:
    """``body`` over HTTP is 400 and ``grpc_call(over_grpc)`` INVALID_ARGUMENT, each saying ``words``."""
    from tritonclient.utils import InferenceServerException

    r = post(server, f"/v2/models/{model}/infer", body)
    assert r.status_code == 400, (r.status_code, r.text[:300])  # a replica killed: 500/503 without JSON
    assert r.json() == {"error": words}
    with pytest.raises(InferenceServerException) as refused:
        grpc_call(over_grpc)
    assert (refused.value.status(), refused.value.message()) == ("StatusCode.INVALID_ARGUMENT", words)


@pytest.mark.parametrize("model, input_name, output_name, shape, classes", [
    ("tiny_cnn", "input", "logits", (1, 3, 224, 224), 1000),  # a pool replica
    ("ocr_cls", "x", "save_infer_model/scale_0.tmp_1", (1, 3, 48, 192), 2),  # a dedicated model's replica
])
def test_an_object_truncated_after_register_is_400_over_http_and_grpc_and_the_replica_serves_on(
        server, grpc_url, client, regions, model, input_name, output_name, shape, classes):
    """A client truncates its input object, then its output object, to 0 bytes after a request
    used them (a replica that had mapped them faulted: SIGBUS killed it): each infer naming them
    is 400 / INVALID_ARGUMENT naming the region, offset and size; once the objects are whole
    again the same replicas (same processes, none restarted) answer shared-memory and plain
    requests with the model's output."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    import tritonclient.utils.shared_memory as shm

    x = np.random.default_rng(17).standard_normal(shape, dtype=np.float32)
    expected = reference(model, x)
    in_handle, in_key = regions("trunc_in", x.nbytes)
    out_handle, out_key = regions("trunc_out", expected.nbytes)
    client.register_system_shared_memory("trunc_in", in_key, x.nbytes)
    client.register_system_shared_memory("trunc_out", out_key, expected.nbytes)
    body = {"inputs": [{"name": input_name, "datatype": "FP32", "shape": list(shape), "parameters": {
                "shared_memory_region": "trunc_in", "shared_memory_byte_size": x.nbytes}}],
            "outputs": [{"name": output_name, "parameters": {
                "shared_memory_region": "trunc_out", "shared_memory_byte_size": expected.nbytes}}]}

    def over_grpc(triton) -> None:
        tensor = grpcclient.InferInput(input_name, list(shape), "FP32").set_shared_memory("trunc_in", x.nbytes)
        wanted = grpcclient.InferRequestedOutput(output_name)
        wanted.set_shared_memory("trunc_out", expected.nbytes)
        triton.infer(model, [tensor], outputs=[wanted])

    def whole_again() -> None:  # the objects back to their size (the client's own mappings valid again)
        for key, size in ((in_key, x.nbytes), (out_key, expected.nbytes)):
            os.truncate(f"/dev/shm/{key.lstrip('/')}", size)
        shm.set_shared_memory_region(in_handle, [x])
        shm.set_shared_memory_region(out_handle, [np.full_like(expected, np.nan)])

    def output() -> np.ndarray:
        return shm.get_contents_as_numpy(out_handle, np.float32, expected.shape)

    whole_again()
    before = replica_processes()
    with grpcclient.InferenceServerClient(grpc_url) as over:
        for _ in range(2):  # through more than one replica where there are several: each has used the regions
            assert post(server, f"/v2/models/{model}/infer", body).status_code == 200
            over_grpc(over)
        np.testing.assert_allclose(output(), expected, rtol=1e-5, atol=1e-5)
        for key, where, region, size in ((in_key, f"input '{input_name}'", "trunc_in", x.nbytes),
                                         (out_key, f"output '{output_name}'", "trunc_out", expected.nbytes)):
            os.truncate(f"/dev/shm/{key.lstrip('/')}", 0)  # the test's own mapping is not touched until whole again
            for _ in range(2):
                refused_over_both(server, over, model, body, over_grpc, shrunk(key, where, region, size))
            whole_again()
        assert post(server, f"/v2/models/{model}/infer", body).status_code == 200
        np.testing.assert_allclose(output(), expected, rtol=1e-5, atol=1e-5)
        shm.set_shared_memory_region(out_handle, [np.full_like(expected, np.nan)])
        over_grpc(over)
        np.testing.assert_allclose(output(), expected, rtol=1e-5, atol=1e-5)
    plain = client.infer(model, [httpclient.InferInput(input_name, list(shape), "FP32").set_data_from_numpy(x)])
    np.testing.assert_allclose(plain.as_numpy(output_name), expected, rtol=1e-5, atol=1e-5)
    after = replica_processes()
    assert {name: after.get(name) for name in before} == before  # no replica died or was replaced


def test_a_pipelines_input_object_truncated_after_register_is_400_and_the_pipeline_serves_on(
        server, grpc_url, client, regions):
    """The same for the embed pipeline's replica, which reads its BYTES input from the region."""
    import tritonclient.grpc as grpcclient
    import tritonclient.utils.shared_memory as shm
    from tritonclient.utils import serialize_byte_tensor

    texts = np.array([b"a client shrank its object", b"the pipeline serves on"], dtype=object)
    serialized = serialize_byte_tensor(texts)  # each text after its 4-byte length
    raw = serialized.item()
    handle, key = regions("trunc_text", len(raw))
    shm.set_shared_memory_region(handle, [serialized])
    client.register_system_shared_memory("trunc_text", key, len(raw))
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], "parameters": {
        "shared_memory_region": "trunc_text", "shared_memory_byte_size": len(raw)}}]}

    def over_grpc(triton):
        tensor = grpcclient.InferInput("text", [2], "BYTES").set_shared_memory("trunc_text", len(raw))
        return triton.infer("embed", [tensor])

    plain_body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], "data": [t.decode() for t in texts]}]}
    plain = post(server, "/v2/models/embed/infer", plain_body)
    assert plain.status_code == 200
    embedding_data = next(o["data"] for o in plain.json()["outputs"] if o["name"] == "embedding")
    before = replica_processes()
    with grpcclient.InferenceServerClient(grpc_url) as over:
        for _ in range(2):
            assert post(server, "/v2/models/embed/infer", body).json()["outputs"] == plain.json()["outputs"]
        os.truncate(f"/dev/shm/{key.lstrip('/')}", 0)
        for _ in range(2):
            refused_over_both(server, over, "embed", body, over_grpc, shrunk(key, "input 'text'", "trunc_text", len(raw)))
        os.truncate(f"/dev/shm/{key.lstrip('/')}", len(raw))
        shm.set_shared_memory_region(handle, [serialized])
        assert post(server, "/v2/models/embed/infer", body).json()["outputs"] == plain.json()["outputs"]
        embedding = over_grpc(over).as_numpy("embedding")
    np.testing.assert_allclose(embedding, np.array(embedding_data, np.float32).reshape(2, 384), rtol=1e-6, atol=1e-6)
    assert post(server, "/v2/models/embed/infer", plain_body).json()["outputs"] == plain.json()["outputs"]
    after = replica_processes()
    assert {name: after.get(name) for name in before} == before
