"""gRPC as `make serve` runs it (HAProxy ingress, Serve serving gRPC): HAProxy's gRPC frontend
reads the model's name in each ModelInfer and sends it to that model's replicas in one hop
(``haproxy.route_grpc_models``; the replica answers it, ``grpc_service.ServeGrpcMethods``), every
other call to the router's; they answer, err, count and read shared memory as over HTTP.

One server for the module: ``python -m deployments.run`` with the Makefile's environment, its
HAProxy stats page on a known port, on a repository of two pool models (``simple``,
``tiny_cnn``) and a dedicated one (``solo_cnn``: tiny_cnn's model file)."""

from __future__ import annotations

import csv
import io
import shutil
import time
import urllib.request

import grpc
import numpy as np
import onnxruntime as ort
import pytest
import requests
import yaml

from bench.autoscale import start_runner
from bench.replicas import interrupt_group

from .conftest import REPOSITORY, _free_port, runner_config
from .test_grpc import error_of, message_of_bytes, settled, settled_at, simple_inputs

pytestmark = pytest.mark.integration

X = np.random.default_rng(3).random((1, 3, 224, 224), dtype=np.float32)
A, B = np.arange(16, dtype=np.int32).reshape(1, 16), np.full((1, 16), 5, np.int32)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base URL, gRPC address, HAProxy stats port, repository, session) of ``make serve``'s
    runner (its session: the runner's PID, ``start_runner``)."""
    tmp = tmp_path_factory.mktemp("grpc_one_hop")
    root = tmp / "engines"
    for name in ("simple", "tiny_cnn"):
        (root / name / "1").mkdir(parents=True)
        shutil.copy(f"{REPOSITORY}/{name}/config.yaml", root / name / "config.yaml")
        (root / name / "1" / "model.onnx").symlink_to(f"{REPOSITORY}/{name}/1/model.onnx")
    (root / "solo_cnn" / "1").mkdir(parents=True)
    shutil.copy(f"{REPOSITORY}/tiny_cnn/1/model.onnx", root / "solo_cnn" / "1" / "model.onnx")
    raw = yaml.safe_load((root / "tiny_cnn" / "config.yaml").read_text())
    raw["deployment"] = {"mode": "dedicated"}
    (root / "solo_cnn" / "config.yaml").write_text(yaml.safe_dump(raw))
    grpc_port, stats_port = _free_port(), _free_port()
    path, port = runner_config(tmp, repository=str(root), grpc_port=grpc_port, pool={"num_gpus": 0})
    log = tmp / "out.log"
    proc = start_runner(path, log, RAY_SERVE_HAPROXY_STATS_PORT=str(stats_port))
    url, address = f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                if requests.get(f"{url}/v2/health/ready", timeout=5).status_code == 200 and _grpc_live(address):
                    break
            except (requests.ConnectionError, requests.Timeout):  # HAProxy starts with Serve; a busy replica answers late
                pass
            time.sleep(0.5)
        yield url, address, stats_port, root, proc.pid
    finally:
        interrupt_group(proc)


def _grpc_live(address: str) -> bool:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    try:
        with grpcclient.InferenceServerClient(address) as client:
            return client.is_server_live()
    except InferenceServerException:
        return False


@pytest.fixture
def client(served):
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(served[1]) as c:
        yield c


def haproxy_pids(session: int) -> set[int]:
    """The HAProxy processes of the server in ``session``: Ray reloads HAProxy (a new process,
    whose counters start at 0) when the replicas it sends to change."""
    from bench.replicas import session_processes

    return {p.pid for p in session_processes(session) if "haproxy" in p.title.split(" ")[0]}


def backend_requests(stats_port: int) -> dict[str, int]:
    """Requests each HAProxy backend has taken (``stot`` of its BACKEND row), by backend name."""
    with urllib.request.urlopen(f"http://127.0.0.1:{stats_port}/stats;csv", timeout=10) as r:
        rows = csv.DictReader(io.StringIO(r.read().decode().lstrip("# ")))
        return {row["pxname"]: int(row["stot"] or 0) for row in rows if row["svname"] == "BACKEND"}


def counted(served, backend: str, send):
    """(requests HAProxy's ``backend`` took during ``send()``, what ``send()`` returned, requests
    every other backend took, by name, where any); a round during which HAProxy reloaded (a new
    process, whose counters restart) is sent again, up to five rounds."""
    _, _, stats_port, _, session = served
    for _ in range(5):
        pids, before = haproxy_pids(session), backend_requests(stats_port)
        sent = send()
        after = backend_requests(stats_port)
        if haproxy_pids(session) == pids:
            break
    others = {name: after[name] - before.get(name, 0) for name in after if name != backend}
    return after[backend] - before[backend], sent, {name: n for name, n in others.items() if n}


def cnn_inputs() -> list:
    import tritonclient.grpc as grpcclient

    tensor = grpcclient.InferInput("input", [1, 3, 224, 224], "FP32")
    tensor.set_data_from_numpy(X)
    return [tensor]


@pytest.mark.parametrize("model, backend", [("solo_cnn", "grpc-models.solo_cnn"), ("tiny_cnn", "grpc-models.pool")],
                         ids=["dedicated", "pool"])
def test_model_infer_is_one_request_of_the_models_grpc_backend(served, client, model, backend):
    """Each ModelInfer is one request of the gRPC backend of the model's application (its
    replica, in one hop from HAProxy), of no other backend (the router's, an HTTP one), and
    answers what ONNX Runtime computes."""
    root = served[3]
    expected = ort.InferenceSession(str(root / model / "1" / "model.onnx")).run(None, {"input": X})[0]
    output = client.get_model_metadata(model).outputs[0].name
    taken, answers, others = counted(served, backend, lambda: [
        client.infer(model, cnn_inputs(), request_id=f"r{i}") for i in range(3)])
    assert taken == 3
    assert others == {}
    for i, answer in enumerate(answers):
        assert answer.get_response().id == f"r{i}"
        np.testing.assert_allclose(answer.as_numpy(output), expected, rtol=1e-4, atol=1e-5)


def test_errors_have_the_http_text_and_the_grpc_code_of_its_status(served, client):
    url = served[0]
    status, message = error_of(lambda: client.infer("simple", simple_inputs(A.astype(np.float32),
                                                                            B.astype(np.float32), "FP32")))
    body = {"inputs": [{"name": n, "shape": [1, 16], "datatype": "FP32", "data": [0.0] * 16}
                       for n in ("INPUT0", "INPUT1")]}
    http = requests.post(f"{url}/v2/models/simple/infer", json=body, timeout=60)
    assert status == "StatusCode.INVALID_ARGUMENT" and http.status_code == 400
    assert message == http.json()["error"]
    status, message = error_of(lambda: client.infer("solo_cnn", simple_inputs(A, B)))
    http = requests.post(f"{url}/v2/models/solo_cnn/infer", timeout=60, json={"inputs": [
        {"name": n, "shape": [1, 16], "datatype": "INT32", "data": [0] * 16} for n in ("INPUT0", "INPUT1")]})
    assert status == "StatusCode.INVALID_ARGUMENT" and http.status_code == 400
    assert message == http.json()["error"]
    status, message = error_of(lambda: client.infer("simple", simple_inputs(A, B), model_version="7"))
    assert status == "StatusCode.NOT_FOUND" and message.startswith("Request for unknown model: 'simple' version 7")


def test_statistics_count_each_grpc_request_once(served, client):
    url = served[0]

    def counts() -> tuple[int, int]:
        [stats] = requests.get(f"{url}/v2/models/simple/versions/1/stats", timeout=30).json()["model_stats"]
        return stats["inference_stats"]["success"]["count"], stats["inference_stats"]["fail"]["count"]

    before = settled(counts)
    for _ in range(4):
        client.infer("simple", simple_inputs(A, B))
    error_of(lambda: client.infer("simple", simple_inputs(A.astype(np.float32), B.astype(np.float32), "FP32")))
    assert settled_at(counts, (before[0] + 4, before[1] + 1), 60) == (before[0] + 4, before[1] + 1)


def test_system_shared_memory_registered_over_grpc_serves_an_infer_through_haproxy(served, client):
    """Regions registered over gRPC (the router's) are read and written by the pool replica
    HAProxy sends the infer to."""
    import uuid

    import tritonclient.grpc as grpcclient
    import tritonclient.utils.shared_memory as shm

    keys = {name: f"/trt_serve_grpc_hop_{name}_{uuid.uuid4().hex[:8]}" for name in ("in", "out")}
    handles = {"in": shm.create_shared_memory_region("in", keys["in"], 64),
               "out": shm.create_shared_memory_region("out", keys["out"], 128)}
    try:
        shm.set_shared_memory_region(handles["in"], [A])
        client.unregister_system_shared_memory()
        client.register_system_shared_memory("in", keys["in"], 64)
        client.register_system_shared_memory("out", keys["out"], 128)
        inputs = simple_inputs(A, B)
        inputs[0].set_shared_memory("in", 64)
        outputs = [grpcclient.InferRequestedOutput("OUTPUT0"), grpcclient.InferRequestedOutput("OUTPUT1")]
        outputs[0].set_shared_memory("out", 64)
        outputs[1].set_shared_memory("out", 64, offset=64)
        taken, result, others = counted(served, "grpc-models.pool", lambda: client.infer("simple", inputs, outputs=outputs))
        assert (taken, others) == (1, {})
        assert result.get_output("OUTPUT1").parameters["shared_memory_offset"].int64_param == 64
        assert shm.get_contents_as_numpy(handles["out"], np.int32, [1, 16]).tolist() == (A + B).tolist()
        assert shm.get_contents_as_numpy(handles["out"], np.int32, [1, 16], offset=64).tolist() == (A - B).tolist()
        inputs[0].set_shared_memory("unregistered", 64)
        status, message = error_of(lambda: client.infer("simple", inputs, outputs=outputs))
        assert status == "StatusCode.INVALID_ARGUMENT"
        assert message.startswith("Unable to find shared memory region: 'unregistered'")
    finally:
        client.unregister_system_shared_memory()
        for handle in handles.values():
            shm.destroy_shared_memory_region(handle)


def test_a_message_of_the_body_limit_passes_and_one_byte_over_is_resource_exhausted(served):
    """A message of exactly ``max_body_mib`` reaches the model's replica (which refuses its byte
    count), one byte more does not, and says the limit."""
    from tritonclient.grpc import service_pb2_grpc as pb_grpc

    limit = 64 * 2**20
    request = message_of_bytes(limit)
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    with grpc.insecure_channel(served[1], options=options) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(request, timeout=120)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert "input byte size mismatch for input 'input'" in info.value.details()
        request.raw_input_contents[0] += b"\x00"
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(request, timeout=120)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert str(limit) in info.value.details(), info.value.details()


def _raw_call(address: str, method: str, message: bytes, metadata=()):
    with grpc.insecure_channel(address) as channel:
        return channel.unary_unary(f"/inference.GRPCInferenceService/{method}")(message, timeout=60, metadata=metadata)


@pytest.mark.parametrize("name", ["nope", "n" * 300], ids=["unknown", "long"])
def test_a_model_no_application_serves_is_not_found_in_the_http_words(served, client, name):
    """An unknown name goes to the pool's replicas, as its HTTP path does: NOT_FOUND with
    HTTP's 404 text."""
    http = requests.post(f"{served[0]}/v2/models/{name}/infer", timeout=60, json={"inputs": [
        {"name": n, "shape": [1, 16], "datatype": "INT32", "data": [0] * 16} for n in ("INPUT0", "INPUT1")]})
    status, message = error_of(lambda: client.infer(name, simple_inputs(A, B)))
    assert status == "StatusCode.NOT_FOUND" and http.status_code == 404
    assert message == http.json()["error"]
    a, b = client.infer("simple", simple_inputs(A, B)).as_numpy("OUTPUT0"), A + B  # it serves on
    assert a.tolist() == b.tolist()


def test_a_message_that_is_not_protobuf_is_invalid_argument_and_the_server_serves_on(served, client):
    with pytest.raises(grpc.RpcError) as info:
        _raw_call(served[1], "ModelInfer", b"\x0a\x06simple\xff\xff\xff\xff not a protobuf")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the ModelInfer request is not a valid protobuf message" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        _raw_call(served[1], "ModelMetadata", b"\xff\xff\xff\xff")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert client.infer("simple", simple_inputs(A, B)).as_numpy("OUTPUT1").tolist() == (A - B).tolist()


def test_stream_infer_answers_each_request_and_names_the_one_that_failed(served, client):
    """ModelStreamInfer (the router's, through Serve's bidirectional streaming): each request
    answered in order, a failing one by its id and the error text, and the stream goes on."""
    import queue

    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        client.async_stream_infer("simple", simple_inputs(A, B), request_id="ok1")
        client.async_stream_infer("simple", simple_inputs(A.astype(np.float32), B.astype(np.float32), "FP32"),
                                  request_id="bad")
        client.async_stream_infer("simple", simple_inputs(B, A), request_id="ok2")
        got = [answers.get(timeout=60) for _ in range(3)]
    finally:
        client.stop_stream()
    assert got[0][1] is None and got[0][0].get_response().id == "ok1"
    assert got[0][0].as_numpy("OUTPUT0").tolist() == (A + B).tolist()
    body = {"inputs": [{"name": n, "shape": [1, 16], "datatype": "FP32", "data": [0.0] * 16}
                       for n in ("INPUT0", "INPUT1")]}
    http = requests.post(f"{served[0]}/v2/models/simple/infer", json=body, timeout=60)
    assert got[1][0] is None and http.json()["error"] in str(got[1][1])
    assert got[2][1] is None and got[2][0].as_numpy("OUTPUT1").tolist() == (B - A).tolist()


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_messages_reach_the_models_replica_and_answer_right(served, client, algorithm):
    """HAProxy cannot read a compressed message's name: the call goes to the router's gRPC
    backend, which answers it through the model's handle, right."""
    expected = ort.InferenceSession(str(served[3] / "solo_cnn" / "1" / "model.onnx")).run(None, {"input": X})[0]
    taken, answer, _ = counted(served, "grpc-models", lambda: client.infer(
        "solo_cnn", cnn_inputs(), compression_algorithm=algorithm))
    assert taken == 1
    np.testing.assert_allclose(answer.as_numpy(answer.get_response().outputs[0].name), expected, rtol=1e-4, atol=1e-5)
