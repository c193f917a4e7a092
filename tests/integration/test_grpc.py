"""KServe v2 over gRPC (``deployments.grpc_service``) with ``tritonclient.grpc`` unmodified
against the real server: infer on a pool model (INT32, BYTES, FP32 against ONNX Runtime), a
dedicated model and a pipeline, raw and typed contents, health, metadata, config, statistics
and the repository index; errors with their gRPC codes and the HTTP path's text; compression
and the message limit."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
import requests

from .conftest import REPOSITORY

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def client(grpc_url):
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(grpc_url) as c:
        yield c


@pytest.fixture(scope="module")
def stub(grpc_url):
    """The raw generated stub, for messages ``tritonclient`` never builds (typed contents)."""
    from tritonclient.grpc import service_pb2_grpc

    with grpc.insecure_channel(grpc_url, options=[("grpc.max_send_message_length", -1)]) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def pair(batch: int = 1) -> tuple[np.ndarray, np.ndarray]:
    a = np.tile(np.arange(16, dtype=np.int32), (batch, 1))
    return a, np.full((batch, 16), -1, np.int32) * np.arange(1, batch + 1, dtype=np.int32)[:, None]


def simple_inputs(a: np.ndarray, b: np.ndarray, datatype: str = "INT32", module=None) -> list:
    import tritonclient.grpc as grpcclient

    module = module or grpcclient
    inputs = [module.InferInput("INPUT0", list(a.shape), datatype), module.InferInput("INPUT1", list(b.shape), datatype)]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs


def error_of(call) -> tuple[str, str]:
    """(gRPC status, message) of the ``InferenceServerException`` that ``call()`` raises."""
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as info:
        call()
    return info.value.status(), info.value.message()


def settled(count):
    """``count()`` once two reads 0.5 s apart agree: earlier requests' counts reach the node's
    files within a flush or so."""
    last, now = None, count()
    while now != last:
        time.sleep(0.5)
        last, now = now, count()
    return now


def settled_at(count, expected, timeout_s: float = 30.0):
    """``settled(count)``, once ``count()`` is ``expected`` or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while count() != expected and time.monotonic() < deadline:
        time.sleep(0.2)
    return settled(count)


def message_of_bytes(limit: int):
    """A ``ModelInferRequest`` for tiny_cnn of exactly ``limit`` bytes (its one raw entry of
    zeros: not the byte count the model takes)."""
    from tritonclient.grpc import service_pb2 as pb

    request = pb.ModelInferRequest(model_name="tiny_cnn")
    request.inputs.add(name="input", datatype="FP32", shape=[1, 3, 224, 224])
    request.raw_input_contents.append(b"")
    size = limit - request.ByteSize() + 1 - 4  # the empty entry's 1-byte length becomes a 4-byte varint
    request.raw_input_contents[0] = b"\x00" * size
    assert request.ByteSize() == limit
    return request


def onnx_runtime(model: str, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(f"{REPOSITORY}/{model}/1/model.onnx", providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


# --- infer ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("compression", [None, "gzip", "deflate"])
def test_simple_adds_and_subtracts_raw_int32(client, compression):
    import tritonclient.grpc as grpcclient

    a, b = pair(2)
    outputs = [grpcclient.InferRequestedOutput("OUTPUT0"), grpcclient.InferRequestedOutput("OUTPUT1")]
    result = client.infer("simple", simple_inputs(a, b), outputs=outputs, request_id="r-1",
                          compression_algorithm=compression)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    response = result.get_response()
    assert (response.model_name, response.model_version, response.id) == ("simple", "1", "r-1")


def test_no_requested_outputs_answers_every_output(client):
    a, b = pair()
    result = client.infer("simple", simple_inputs(a, b))
    assert sorted(o.name for o in result.get_response().outputs) == ["OUTPUT0", "OUTPUT1"]
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


def test_async_infer_and_asyncio_client(client, grpc_url):
    import asyncio

    import tritonclient.grpc.aio as aioclient

    a, b = pair()
    done: list = []
    client.async_infer("simple", simple_inputs(a, b), callback=lambda result, error: done.append((result, error)))
    deadline = time.monotonic() + 60
    while not done and time.monotonic() < deadline:
        time.sleep(0.05)
    result, error = done[0]
    assert error is None
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)

    async def run():
        async with aioclient.InferenceServerClient(grpc_url) as aio:
            got = await aio.infer("simple", simple_inputs(a, b, module=aioclient))
            return got.as_numpy("OUTPUT1")

    np.testing.assert_array_equal(asyncio.run(run()), a - b)


def test_simple_string_sums_numbers_held_as_bytes(client):
    a, b = pair()
    text = [np.array([str(v).encode() for v in x.ravel()], dtype=object).reshape(x.shape) for x in (a, b)]
    result = client.infer("simple_string", simple_inputs(*text, datatype="BYTES"))
    assert [int(x) for x in result.as_numpy("OUTPUT0").ravel()] == (a + b).ravel().tolist()
    assert [int(x) for x in result.as_numpy("OUTPUT1").ravel()] == (a - b).ravel().tolist()


@pytest.mark.parametrize("model, shape", [("tiny_cnn", (2, 3, 224, 224)), ("ocr_cls", (1, 3, 48, 192))],
                         ids=["pool", "dedicated"])
def test_fp32_raw_matches_onnx_runtime(client, model, shape):
    import tritonclient.grpc as grpcclient

    x = np.random.default_rng(0).random(shape, dtype=np.float32)
    name = "input" if model == "tiny_cnn" else "x"
    tensor = grpcclient.InferInput(name, list(shape), "FP32")
    tensor.set_data_from_numpy(x)
    result = client.infer(model, [tensor])
    output = result.get_response().outputs[0].name
    np.testing.assert_allclose(result.as_numpy(output), onnx_runtime(model, x), rtol=1e-4, atol=1e-5)


def test_classification_answers_top_k_as_bytes(client):
    import tritonclient.grpc as grpcclient

    x = np.random.default_rng(1).random((1, 3, 224, 224), dtype=np.float32)
    tensor = grpcclient.InferInput("input", [1, 3, 224, 224], "FP32")
    tensor.set_data_from_numpy(x)
    result = client.infer("tiny_cnn", [tensor], outputs=[grpcclient.InferRequestedOutput("logits", class_count=3)])
    top = [int(item.split(b":")[1]) for item in result.as_numpy("logits").ravel()]
    assert top == np.argsort(-onnx_runtime("tiny_cnn", x)[0], kind="stable")[:3].tolist()


def test_embed_pipeline_answers_over_grpc(client, server):
    import tritonclient.grpc as grpcclient

    texts = np.array([b"The weather is lovely today.", b"It's so sunny outside!"], dtype=object)
    tensor = grpcclient.InferInput("text", [2], "BYTES")
    tensor.set_data_from_numpy(texts)
    result = client.infer("embed", [tensor])
    body = {"inputs": [{"name": "text", "shape": [2], "datatype": "BYTES", "data": [t.decode() for t in texts]}]}
    http = requests.post(f"{server}/v2/models/embed/infer", json=body, timeout=120).json()
    expected = np.array(next(o["data"] for o in http["outputs"] if o["name"] == "embedding")).reshape(2, 384)
    np.testing.assert_allclose(result.as_numpy("embedding"), expected, rtol=1e-5, atol=1e-6)


def test_typed_contents_int_and_bytes(stub):
    from tritonclient.grpc import service_pb2 as pb

    a, b = pair()
    request = pb.ModelInferRequest(model_name="simple")
    for name, x in (("INPUT0", a), ("INPUT1", b)):
        request.inputs.add(name=name, datatype="INT32", shape=[1, 16]).contents.int_contents.extend(x.ravel().tolist())
    response = stub.ModelInfer(request, timeout=60)
    out = {o.name: np.frombuffer(raw, np.int32) for o, raw in zip(response.outputs, response.raw_output_contents)}
    assert out["OUTPUT0"].tolist() == (a + b).ravel().tolist()

    request = pb.ModelInferRequest(model_name="simple_identity")
    items = [b"a\x00b", b""] * 8
    request.inputs.add(name="INPUT0", datatype="BYTES", shape=[1, 16]).contents.bytes_contents.extend(items)
    response = stub.ModelInfer(request, timeout=60)
    assert response.raw_output_contents[0] == b"\x03\x00\x00\x00a\x00b\x00\x00\x00\x00" * 8


def test_stream_infer_answers_each_request_and_errors_in_the_stream(client):
    import queue

    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        a, b = pair()
        client.async_stream_infer("simple", simple_inputs(a, b))
        client.async_stream_infer("no_such_model", simple_inputs(a, b))
        client.async_stream_infer("simple", simple_inputs(b, a))
        got = [results.get(timeout=60) for _ in range(3)]
    finally:
        client.stop_stream()
    np.testing.assert_array_equal(got[0][0].as_numpy("OUTPUT0"), a + b)
    assert got[1][0] is None and got[1][1].message().startswith("Request for unknown model: 'no_such_model'")
    np.testing.assert_array_equal(got[2][0].as_numpy("OUTPUT1"), b - a)


def test_a_stream_error_answer_carries_the_id_of_the_request_it_answers(stub):
    """Seen: a stream request with ``id="1"`` for an unknown model came back with
    ``infer_response.id == ''``; Triton's stream handler sets the request's id on an error
    answer "so that client knows which request failed"."""
    from tritonclient.grpc import service_pb2 as pb

    def requests():
        for request_id, model in (("1", "no_such_model"), ("2", "simple"), ("3", "simple")):
            request = pb.ModelInferRequest(model_name=model, id=request_id)
            for name in ("INPUT0", "INPUT1"):
                request.inputs.add(name=name, datatype="INT32", shape=[1, 16]).contents.int_contents.extend(range(16))
            if request_id == "3":
                request.inputs[1].shape[:] = [1, 15]
            yield request

    answers = list(stub.ModelStreamInfer(requests(), timeout=60))
    assert [(a.infer_response.id, bool(a.error_message)) for a in answers] == [("1", True), ("2", False), ("3", True)]
    assert answers[0].error_message.startswith("Request for unknown model: 'no_such_model'")
    assert answers[2].error_message.startswith("input 'INPUT1': shape [1, 15] needs 15 elements")


# --- health, metadata, config, statistics, index --------------------------------------------------

def test_health_metadata_and_config(client):
    assert client.is_server_live(headers={"test": "1"}) and client.is_server_ready()
    assert client.is_model_ready("simple") and client.is_model_ready("simple", "1")
    server = client.get_server_metadata()
    assert server.name == "trt-serve" and "model_repository" in server.extensions
    metadata = client.get_model_metadata("simple")
    assert (metadata.name, list(metadata.versions), metadata.platform) == ("simple", ["1"], "onnxruntime_onnx")
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == [
        ("INPUT0", "INT32", [-1, 16]), ("INPUT1", "INT32", [-1, 16])]
    config = client.get_model_config("simple").config
    assert (config.name, config.max_batch_size, config.input[0].data_type) == ("simple", 8, 8)  # TYPE_INT32
    assert list(config.input[0].dims) == [16]


def test_config_and_metadata_of_a_pipeline(client):
    assert client.get_model_config("ocr").config.platform == "ensemble"
    assert client.get_model_metadata("embed").platform == "ensemble"


def test_statistics_count_grpc_requests_as_http_ones(client, server):
    def count() -> tuple[int, int]:
        stats = client.get_inference_statistics("simple", "1").model_stats[0].inference_stats
        return stats.success.count, stats.fail.count

    before = settled(count)
    a, b = pair()
    client.infer("simple", simple_inputs(a, b))
    error_of(lambda: client.infer("simple", simple_inputs(a.astype(np.float32), b.astype(np.float32), "FP32")))
    assert settled_at(count, (before[0] + 1, before[1] + 1)) == (before[0] + 1, before[1] + 1)
    http = requests.get(f"{server}/v2/models/simple/versions/1/stats", timeout=30).json()["model_stats"][0]
    assert (http["inference_stats"]["success"]["count"], http["inference_stats"]["fail"]["count"]) == count()
    every = client.get_inference_statistics()
    assert "simple" in {m.name for m in every.model_stats}


def test_repository_index_lists_models_and_load_is_refused_without_model_control(client):
    index = client.get_model_repository_index()
    assert {"simple", "ocr", "tiny_cnn"} <= {m.name for m in index.models}
    assert next(m for m in index.models if m.name == "ocr").state == "READY"
    status, message = error_of(lambda: client.load_model("simple"))
    assert status == "StatusCode.INVALID_ARGUMENT"
    assert message.startswith("failed to load 'simple': explicit model load / unload is not allowed")


# --- errors ----------------------------------------------------------------------------------------

def test_unknown_model_and_version_are_not_found_with_tritons_words(client):
    a, b = pair()
    status, message = error_of(lambda: client.infer("wrong_model_name", simple_inputs(a, b)))
    assert status == "StatusCode.NOT_FOUND"
    assert message.startswith("Request for unknown model: 'wrong_model_name' is not found; available models: [")
    status, message = error_of(lambda: client.infer("simple", simple_inputs(a, b), model_version="7"))
    assert status == "StatusCode.NOT_FOUND" and message.startswith("Request for unknown model: 'simple' version 7")
    status, message = error_of(lambda: client.get_model_metadata("wrong_model_name"))
    assert status == "StatusCode.NOT_FOUND" and "Request for unknown model" in message
    assert client.is_model_ready("wrong_model_name") is False  # as Triton, and tritonclient.http here


def test_wrong_datatype_and_shape_are_invalid_argument_with_the_http_text(client, server):
    a, b = pair()
    status, message = error_of(lambda: client.infer("simple", simple_inputs(a.astype(np.float32),
                                                                            b.astype(np.float32), "FP32")))
    assert status == "StatusCode.INVALID_ARGUMENT"
    assert message.startswith("inference input 'INPUT0' data-type is 'FP32', but model 'simple' expects 'INT32'")
    wide = [np.zeros((1, 17), np.int32)] * 2
    status, message = error_of(lambda: client.infer("simple", simple_inputs(*wide)))
    assert status == "StatusCode.INVALID_ARGUMENT"
    body = {"inputs": [{"name": n, "shape": [1, 17], "datatype": "INT32", "data": [0] * 17}
                       for n in ("INPUT0", "INPUT1")]}
    http = requests.post(f"{server}/v2/models/simple/infer", json=body, timeout=60)
    assert http.status_code == 400 and message == http.json()["error"]


def test_typed_contents_that_do_not_fit_are_invalid_argument(stub):
    from tritonclient.grpc import service_pb2 as pb

    request = pb.ModelInferRequest(model_name="simple")
    request.inputs.add(name="INPUT0", datatype="INT32", shape=[1, 16]).contents.int_contents.extend(range(15))
    request.inputs.add(name="INPUT1", datatype="INT32", shape=[1, 16]).contents.fp32_contents.extend([0.0] * 16)
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request, timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "input 'INPUT0': shape [1, 16] needs 16 elements, contents.int_contents has 15"
    request.inputs[0].contents.int_contents.append(15)
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request, timeout=60)
    assert info.value.details() == ("input 'INPUT1': a INT32 input takes its values in contents.int_contents, got "
                                    "['contents.fp32_contents']")


def test_raw_byte_count_that_disagrees_with_the_shape_is_invalid_argument(stub):
    from tritonclient.grpc import service_pb2 as pb

    request = pb.ModelInferRequest(model_name="simple")
    for name in ("INPUT0", "INPUT1"):
        request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
    request.raw_input_contents.extend([b"\x00" * 64, b"\x00" * 60])
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request, timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == ("input byte size mismatch for input 'INPUT1'. Expected 64, got 60; input 'INPUT1': "
                                    "shape [1, 16] x INT32 needs 64 bytes, raw_input_contents gives 60 bytes")


@pytest.fixture
def regions(client):
    """Regions in /dev/shm (``make(name, byte_size)`` -> (handle, key)); every registration of
    the client and the regions removed after."""
    import uuid

    import tritonclient.utils.shared_memory as shm

    made = []

    def make(name: str, byte_size: int):
        key = f"/trt_serve_grpc_{name}_{uuid.uuid4().hex[:8]}"
        made.append(shm.create_shared_memory_region(name, key, byte_size))
        return made[-1], key

    client.unregister_system_shared_memory()
    yield make
    client.unregister_system_shared_memory()
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def test_system_shared_memory_over_grpc_as_simple_grpc_shm_client(client, regions):
    """Register, status, an infer whose inputs and outputs are in regions (one raw input beside
    them), unregister: what Triton's simple_grpc_shm_client.py does."""
    import tritonclient.grpc as grpcclient
    import tritonclient.utils.shared_memory as shm

    a, b = np.arange(16, dtype=np.int32), np.full(16, 5, np.int32)
    in_handle, in_key = regions("in", 64)
    out_handle, out_key = regions("out", 128)
    shm.set_shared_memory_region(in_handle, [a])
    client.register_system_shared_memory("in", in_key, 64)
    client.register_system_shared_memory("out", out_key, 128)
    status = client.get_system_shared_memory_status()
    assert {name: (r.key, r.byte_size) for name, r in status.regions.items()} == {
        "in": (in_key, 64), "out": (out_key, 128)}
    inputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"), grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_shared_memory("in", 64)
    inputs[1].set_data_from_numpy(b[None])  # raw, beside the region
    outputs = [grpcclient.InferRequestedOutput("OUTPUT0"), grpcclient.InferRequestedOutput("OUTPUT1")]
    outputs[0].set_shared_memory("out", 64)
    outputs[1].set_shared_memory("out", 64, offset=64)
    result = client.infer("simple", inputs, outputs=outputs)
    assert result.get_output("OUTPUT0").parameters["shared_memory_region"].string_param == "out"
    sums = shm.get_contents_as_numpy(out_handle, np.int32, [1, 16])
    differences = shm.get_contents_as_numpy(out_handle, np.int32, [1, 16], offset=64)
    assert sums.tolist() == [(a + b).tolist()] and differences.tolist() == [(a - b).tolist()]
    status_code, message = error_of(lambda: client.get_system_shared_memory_status("nope"))
    assert status_code == "StatusCode.NOT_FOUND" and message.startswith("Unable to find system shared memory region: 'nope'")
    inputs[0].set_shared_memory("unregistered", 64)
    status_code, message = error_of(lambda: client.infer("simple", inputs, outputs=outputs))
    assert status_code == "StatusCode.INVALID_ARGUMENT"
    assert message.startswith("Unable to find shared memory region: 'unregistered'")
    client.unregister_system_shared_memory("in")
    assert list(client.get_system_shared_memory_status().regions) == ["out"]


def test_trace_and_log_settings_are_unimplemented_with_a_reason(client):
    status, message = error_of(lambda: client.get_trace_settings())
    assert status == "StatusCode.UNIMPLEMENTED" and message.startswith("trace settings are not supported")


def test_message_of_the_body_limit_passes_and_one_byte_over_is_resource_exhausted(stub):
    limit = 64 * 2**20
    request = message_of_bytes(limit)
    with pytest.raises(grpc.RpcError) as info:  # the limit passes: the model refuses the byte count
        stub.ModelInfer(request, timeout=120)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    request.raw_input_contents[0] += b"\x00"
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request, timeout=120)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(limit) in info.value.details(), info.value.details()


@pytest.mark.parametrize("method", ["ModelInfer", "ModelMetadata"])
def test_a_message_that_is_not_protobuf_is_invalid_argument_and_the_server_serves_on(grpc_url, client, method):
    with grpc.insecure_channel(grpc_url) as channel:
        call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")
        with pytest.raises(grpc.RpcError) as info:
            call(b"\xff\xff\xff\xff not a protobuf", timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"the {method} request is not a valid protobuf message" in info.value.details()
    a, b = pair()
    assert np.array_equal(client.infer("simple", simple_inputs(a, b)).as_numpy("OUTPUT0"), a + b)


def test_a_stream_message_that_is_not_protobuf_ends_the_stream_invalid_argument(grpc_url):
    with grpc.insecure_channel(grpc_url) as channel:
        call = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
        with pytest.raises(grpc.RpcError) as info:
            list(call(iter([b"\xff\xff\xff\xff"]), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the ModelStreamInfer request is not a valid protobuf message" in info.value.details()
