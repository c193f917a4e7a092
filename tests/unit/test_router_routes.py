"""The router's HTTP routes under Starlette's TestClient, without Ray.

``RouterApp`` runs over the real model repository with a fake of our own ``ModelClient``
interface (never of ONNX Runtime): it records what the router passed and answers with arrays
derived from the inputs, or raises what a model replica would. Real inference through real
Ray Serve stays in ``tests/integration``.
"""

from __future__ import annotations

import asyncio
import logging
import gzip
import json
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
from starlette.testclient import TestClient

from deployments.client import ReplicaCounts
from deployments.ingress import RouterApp
from deployments.routes import RouterOptions
from deployments.protocol.answer import answer_body
from deployments.runtime.contract.errors import InvalidInput, ModelNotReady
from deployments.runtime.contract.repository import ModelRepository

GOOD = {"name": "input", "shape": [1, 3, 224, 224], "datatype": "FP32", "data": [0.0] * (3 * 224 * 224)}
LIMIT_BYTES = 8 << 20


def tensor(**changes: Any) -> dict[str, Any]:
    t = dict(GOOD)
    t.update(changes)
    return t


class FakeModelClient:
    """``ModelClient``'s interface: ``dedicated``, ``pool``, ``pool_models``, ``infer``, ``infer_body``,
    ``backend``, ``memory``, ``pool_memory``, ``pool_states``. ``infer`` answers ``logits`` = the first 1000
    input values per row, x 2 (so a test can check what arrived), or raises ``raises``."""

    def __init__(self, repo: ModelRepository, not_ready: set[str] = frozenset()) -> None:
        entries = repo.entries()
        self.pool_models = frozenset(e.name for e in entries
                                     if e.config.deployment.mode == "pool" and not e.config.pipeline)
        self.dedicated = {e.name: None for e in entries if e.name not in self.pool_models}
        self.pool = object()
        self.not_ready = set(not_ready)
        self.calls: list[tuple[str, dict[str, np.ndarray], list[str] | None]] = []
        self.raises: BaseException | None = None
        self.delay_s = 0.0
        self.keys: list[str | None] = []
        self.backend_calls: list[str] = []
        self.backend_delay_s = 0.0

    async def infer(self, name: str, inputs: dict[str, np.ndarray], outputs: list[str] | None = None,
                    key: str | None = None, version: int | None = None):
        self.calls.append((name, inputs, outputs))
        self.keys.append(key)
        await asyncio.sleep(self.delay_s)
        if self.raises is not None:
            raise self.raises
        (x,) = inputs.values()
        return {"logits": 2 * x.reshape(x.shape[0], -1)[:, :1000]}

    async def infer_body(self, name: str, key: str | None, version: str, batched: bool, chunks: list[bytes],
                         header_length: str | None, default_timeout_s: float):
        """A pool model's body, decoded and answered where it runs (as ``PoolDeployment.infer_body``)."""
        return await answer_body(name, version, batched, chunks, header_length,
                                 lambda inputs, outputs: self.infer(name, inputs, outputs, key), default_timeout_s)

    async def backend(self, name: str) -> str:
        self.backend_calls.append(name)
        await asyncio.sleep(self.backend_delay_s)
        if name in self.not_ready:
            raise ModelNotReady(f"model '{name}' has no replica")
        return "pipeline" if name == "ocr" else "onnxruntime"

    async def memory(self, name: str) -> dict[str, Any]:
        return {"backend": "onnxruntime", "total_bytes": 1000 + len(name)}

    async def pool_memory(self) -> dict[str, Any]:
        return {"replica": "r1", "load_policy": "lru"}

    async def pool_states(self) -> dict[str, dict[str, Any]]:
        return {name: {"state": "absent", "evictions": 0, "backend": "onnxruntime"} for name in self.pool_models}


def make_router(repo: ModelRepository, not_ready: set[str] = frozenset(),
                timeout_s: float = 60.0) -> tuple[TestClient, FakeModelClient]:
    client = FakeModelClient(repo, not_ready)
    router = RouterApp(repo, client, RouterOptions(max_body_bytes=LIMIT_BYTES, request_timeout_s=timeout_s))
    try:  # one pass marks every model that answers ready; the rest stay loading
        asyncio.run(asyncio.wait_for(router.poll_ready(), 0.2 if not_ready else 5.0))
    except asyncio.TimeoutError:
        assert not_ready
    return TestClient(router.build_app(), raise_server_exceptions=False), client


@pytest.fixture(scope="module")
def repo(model_repository: ModelRepository) -> ModelRepository:
    return model_repository


@pytest.fixture
def router(repo: ModelRepository) -> TestClient:
    return make_router(repo)[0]


def assert_error(r, status: int, *fragments: str) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    assert r.content.isascii()
    body = r.json()
    assert list(body) == ["error"]
    for f in fragments:
        assert f in body["error"], body["error"]
    assert "Traceback" not in body["error"]


def post(router: TestClient, path: str, body: Any, **kwargs: Any):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return router.post(path, content=data, headers={"Content-Type": "application/json"}, **kwargs)


# --- health, metadata, index ------------------------------------------------------------------

def test_live_ready_and_server_metadata(router):
    assert router.get("/v2/health/live").json() == {"live": True}
    assert router.get("/v2/health/ready").json() == {"ready": True}
    meta = router.get("/v2").json()
    assert meta["name"] == "trt-serve" and meta["extensions"] == [
        "model_repository", "model_configuration", "binary_tensor_data", "classification", "statistics",
        "system_shared_memory", "cuda_shared_memory"]


def test_model_metadata_names_tensors_and_the_platform_a_replica_reported(router):
    meta = router.get("/v2/models/ocr_det").json()
    assert meta["versions"] == ["1"] and meta["platform"] == "onnxruntime_onnx"
    assert router.get("/v2/models/ocr_det/versions/1").json() == meta
    assert router.get("/v2/models/ocr").json()["platform"] == "ensemble"


def test_repository_index_says_which_models_load_on_first_request(router, repo):
    index = {i["name"]: i for i in router.post("/v2/repository/index").json()}
    assert sorted(index) == repo.names()
    pooled = {n for n in repo.names() if repo.get(n).config.deployment.mode == "pool" and not repo.get(n).config.pipeline}
    assert all(index[n]["state"] == "READY" and "reason" not in index[n] for n in set(index) - pooled)
    assert index["tiny_cnn"] == {"name": "tiny_cnn", "version": "1", "state": "UNAVAILABLE",
                                 "reason": "not loaded yet; loads on first request"}
    ready = router.post("/v2/repository/index", json={"ready": True}).json()
    assert sorted(i["name"] for i in ready) == sorted(n for n in index if index[n]["state"] == "READY")
    assert_error(router.post("/v2/repository/index", json={"ready": "yes"}), 400,
                 "repository index: 'ready' must be true or false, not \"yes\"")


def test_memory_gathers_dedicated_engines_and_the_pool(router):
    memory = router.get("/v2/memory").json()
    assert memory["pool"] == {"replica": "r1", "load_policy": "lru"}
    assert sorted(memory["dedicated"]) == ["all-MiniLM-L6-v2", "ocr_cls", "ocr_det", "ocr_rec"]  # pipelines have no engine
    assert memory["dedicated"]["ocr_det"]["total_bytes"] == 1007


def test_model_without_a_replica_is_503_until_it_answers(repo):
    router, client = make_router(repo, not_ready={"ocr_det"})
    assert_error(router.get("/v2/health/ready"), 503, "models still loading", "ocr_det")
    assert_error(router.get("/v2/models/ocr_det/ready"), 503, "model 'ocr_det' is not ready")
    body = {"inputs": [{"name": "x", "shape": [1, 3, 64, 64], "datatype": "FP32", "data": [0.0] * (3 * 64 * 64)}]}
    assert_error(post(router, "/v2/models/ocr_det/infer", body), 503, "model 'ocr_det' is not ready")
    assert client.calls == []
    assert router.get("/v2/models/tiny_cnn/ready").json() == {"name": "tiny_cnn", "ready": True}


# --- infer: what reaches the model client --------------------------------------------------------

def test_infer_passes_the_decoded_arrays_and_outputs_and_echoes_the_id(router, repo):
    test_client, client = make_router(repo)
    x = np.arange(2 * 3 * 224 * 224, dtype=np.float32).reshape(2, 3, 224, 224) / 1e5
    body = {"id": "req-7", "inputs": [tensor(shape=[2, 3, 224, 224], data=x.tolist())],
            "outputs": [{"name": "logits"}]}
    r = post(test_client, "/v2/models/tiny_cnn/versions/1/infer", body)
    assert r.status_code == 200, r.text
    (name, inputs, outputs), = client.calls
    assert name == "tiny_cnn" and outputs == ["logits"]
    np.testing.assert_array_equal(inputs["input"], x)
    out = r.json()
    assert out["id"] == "req-7" and out["model_name"] == "tiny_cnn" and out["model_version"] == "1"
    assert out["outputs"][0]["shape"] == [2, 1000]
    np.testing.assert_array_equal(np.array(out["outputs"][0]["data"], np.float32), 2 * x.reshape(2, -1)[:, :1000].ravel())


def test_chunked_body_decodes_as_the_whole_body(repo):
    router, client = make_router(repo)
    data = json.dumps({"inputs": [tensor(data=[0.25] * (3 * 224 * 224))]}).encode()

    def chunks():
        for start in range(0, len(data), 65536):
            yield data[start:start + 65536]

    r = router.post("/v2/models/tiny_cnn/infer", content=chunks())
    assert r.status_code == 200, r.text
    assert (client.calls[0][1]["input"] == 0.25).all() and client.calls[0][1]["input"].shape == (1, 3, 224, 224)


def test_binary_body_in_chunks_decodes_to_the_same_array(repo):
    router, client = make_router(repo)
    x = np.random.default_rng(2).standard_normal((1, 3, 224, 224), dtype=np.float32)
    head = json.dumps({"inputs": [{"name": "input", "shape": [1, 3, 224, 224], "datatype": "FP32",
                                   "parameters": {"binary_data_size": x.nbytes}}]}).encode()
    data = head + x.tobytes()
    r = router.post("/v2/models/tiny_cnn/infer", content=iter([data[:1000], data[1000:]]),
                    headers={"Inference-Header-Content-Length": str(len(head))})
    assert r.status_code == 200, r.text
    np.testing.assert_array_equal(client.calls[0][1]["input"], x)


def test_errors_the_replica_raises_answer_with_their_status_and_text(repo):
    router, client = make_router(repo)
    client.raises = InvalidInput("model 'tiny_cnn' input 'input': axis 2 is 225, allowed 224")
    assert_error(post(router, "/v2/models/tiny_cnn/infer", {"inputs": [GOOD]}), 400, "axis 2 is 225, allowed 224")
    client.raises = RuntimeError("secret internal detail")
    r = post(router, "/v2/models/tiny_cnn/infer", {"inputs": [GOOD]})
    assert_error(r, 500, "internal server error")
    assert "secret" not in r.text


def test_model_slower_than_the_request_timeout_is_504(repo):
    router, client = make_router(repo, timeout_s=0.05)
    client.delay_s = 1.0
    assert_error(post(router, "/v2/models/tiny_cnn/infer", {"inputs": [GOOD]}), 504,
                 "model 'tiny_cnn' did not answer within 50 ms (request_timeout_s of the application args)")
    # the request's own timeout (microseconds, Triton's unit) is named as such
    assert_error(post(router, "/v2/models/tiny_cnn/infer", {"inputs": [GOOD], "parameters": {"timeout": 1}}), 504,
                 "did not answer within 0.001 ms (the request's parameters.timeout: 1 microseconds)")


# --- moved from tests/integration/test_bad_input.py (HTTP-level cases) -------------------------

def test_unknown_model_and_version_are_404(router):
    assert_error(post(router, "/v2/models/nope/infer", {"inputs": [GOOD]}), 404,
                 "Request for unknown model: 'nope' is not found; available models: [")
    assert_error(router.get("/v2/models/nope"), 404, "Request for unknown model: 'nope' is not found")
    assert_error(post(router, "/v2/models/tiny_cnn/versions/7/infer", {"inputs": [GOOD]}), 404,
                 "no version '7'", "versions: [1]")
    assert_error(router.get("/v2/models/tiny_cnn/versions/x"), 404, "no version 'x'")


@pytest.mark.parametrize("path", [  # the client sends these undecoded; the app sees '/' in the name
    "/v2/models/..%2Fx", "/v2/models/%2e%2e%2fx/ready", "/v2/models/a/b", "/v2/models/a%2Fb/versions/1",
    "/v2/models/..%2F..%2Fetc%2Fpasswd",
])
def test_path_like_model_names_are_404_like_any_unknown_name(router, path):
    r = router.get(path)
    assert r.status_code == 404
    assert r.json()["error"].startswith("Request for unknown model: '"), r.json()


def test_unknown_route_is_404_naming_it(router):
    assert_error(router.get("/v3/anything"), 404, "no route GET /v3/anything")


def test_wrong_method_is_405_naming_the_allowed_one(router):
    r = router.get("/v2/models/tiny_cnn/infer")
    assert_error(r, 405, "method GET not allowed", "allowed: POST")
    assert r.headers["Allow"] == "POST"


def test_trailing_slash_is_404_not_a_redirect(router):
    r = post(router, "/v2/models/tiny_cnn/infer/", {"inputs": [GOOD]}, follow_redirects=False)
    assert_error(r, 404, "no route POST /v2/models/tiny_cnn/infer/")  # tiny_cnn exists: the route does not


def test_a_known_model_with_a_route_this_server_lacks_is_an_unknown_route(router):
    assert_error(router.get("/v2/models/simple/trace/setting"), 404, "no route GET /v2/models/simple/trace/setting")


def test_body_over_limit_is_413(router):  # by its declared Content-Length
    assert_error(post(router, "/v2/models/tiny_cnn/infer", b" " * (LIMIT_BYTES + 1)), 413,
                 f"request body is {LIMIT_BYTES + 1} bytes; the limit is {LIMIT_BYTES} bytes")


def test_chunked_body_over_limit_is_413_while_reading(router):
    chunks = iter([b" " * (1 << 20)] * (LIMIT_BYTES // (1 << 20) + 1))  # no Content-Length: chunked
    assert_error(router.post("/v2/models/tiny_cnn/infer", content=chunks), 413,
                 f"request body exceeds the limit of {LIMIT_BYTES} bytes")


def test_malformed_json_is_400(router):
    assert_error(post(router, "/v2/models/tiny_cnn/infer", b"{not json"), 400, "not valid JSON")


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_tokens_are_400(router, token):
    body = '{"inputs":[{"name":"input","shape":[1],"datatype":"FP32","data":[%s]}]}' % token
    assert_error(post(router, "/v2/models/tiny_cnn/infer", body), 400, token, "not allowed")


def test_element_count_mismatch_is_400(router):
    r = post(router, "/v2/models/tiny_cnn/infer", {"inputs": [tensor(data=[0.0] * 10)]})
    assert_error(r, 400, "input 'input'", "needs 150528 elements", "has 10")


@pytest.mark.parametrize("shape,fragment", [
    ([1, 3, -224, 224], "axis 2 is -224"),
    ([0, 3, 224, 224], "axis 0 is 0"),
    ([1, 3, 224.5, 224], "axis 2 is 224.5"),
    ([1, 3, "224", 224], "axis 2 is \"224\""),
])
def test_negative_zero_and_non_integer_dims_are_400(router, shape, fragment):
    assert_error(post(router, "/v2/models/tiny_cnn/infer", {"inputs": [tensor(shape=shape)]}), 400, fragment)


def test_empty_inputs_and_a_body_that_is_not_an_object_are_400(router):
    assert_error(post(router, "/v2/models/tiny_cnn/infer", {"inputs": []}), 400, "non-empty 'inputs'")
    assert_error(post(router, "/v2/models/tiny_cnn/infer", [1, 2]), 400, "JSON object")


def test_booleans_among_numbers_are_400(router):
    data = [True] + [0.5] * (3 * 224 * 224 - 1)
    assert_error(post(router, "/v2/models/tiny_cnn/infer", {"inputs": [tensor(data=data)]}), 400, "not true/false")


@pytest.mark.parametrize("data,fragment", [
    ([[0.5] * 150527, [0.5]], "data has 2 items, shape [1, 3, 224, 224] needs 1 on axis 0"),
    ([[[[0.5] * 448] * 112] * 3], "data[0][0] has 112 items, shape [1, 3, 224, 224] needs 224 on axis 2"),
])
def test_nested_data_must_follow_the_shape(router, data, fragment):
    assert_error(post(router, "/v2/models/tiny_cnn/infer", {"inputs": [tensor(data=data)]}), 400, fragment)


def test_lone_surrogate_in_a_name_is_400_with_a_json_body(router):
    body = '{"inputs":[{"name":"\\ud800","shape":[1],"datatype":"FP32","data":[1]}]}'
    assert_error(post(router, "/v2/models/tiny_cnn/infer", body), 400, "not valid Unicode")


def test_number_overflowing_the_datatype_is_400(router):
    assert_error(post(router, "/v2/models/tiny_cnn/infer", {"inputs": [tensor(data=[1e39] * (3 * 224 * 224))]}),
                 400, "input 'input'", "overflow FP32")
    assert_error(post(router, "/v2/models/tiny_cnn/infer", '{"inputs": [1e999]}'), 400, "overflows to Infinity")


def test_output_parameters_that_are_not_an_object_are_400(router):
    assert_error(post(router, "/v2/models/tiny_cnn/infer", {"inputs": [GOOD], "outputs": [{"name": "logits",
                 "parameters": [1]}]}), 400, "'parameters' must be an object")


# --- moved from tests/integration/test_binary.py (decoded by the router) -----------------------

def post_binary(router: TestClient, model: str, header: dict, payload: bytes, header_length: int | None = None):
    head = json.dumps(header).encode()
    length = len(head) if header_length is None else header_length
    return router.post(f"/v2/models/{model}/infer", content=head + payload,
                       headers={"Inference-Header-Content-Length": str(length),
                                "Content-Type": "application/octet-stream"})


def test_byte_count_that_disagrees_with_shape_is_400_giving_both(router):
    header = {"inputs": [{"name": "x", "shape": [1, 3, 640, 640], "datatype": "FP32",
                          "parameters": {"binary_data_size": 4915196}}]}
    r = post_binary(router, "ocr_det", header, bytes(4915196))
    assert_error(r, 400, "needs 4915200 bytes", "gives 4915196 bytes")


def test_header_length_beyond_the_body_is_400(router):
    header = {"inputs": [{"name": "input", "shape": [1, 3, 224, 224], "datatype": "FP32",
                          "parameters": {"binary_data_size": 602112}}]}
    r = post_binary(router, "tiny_cnn", header, bytes(16), header_length=10_000)
    assert_error(r, 400, "Inference-Header-Content-Length is 10000 bytes")


def test_a_model_that_loses_its_replicas_is_503_again_and_ready_once_one_runs(repo, caplog):
    client = FakeModelClient(repo)
    app = RouterApp(repo, client, RouterOptions(max_body_bytes=LIMIT_BYTES, request_timeout_s=60.0))
    asyncio.run(asyncio.wait_for(app.poll_ready(), 5.0))
    router = TestClient(app.build_app(), raise_server_exceptions=False)
    assert router.get("/v2/models/ocr_det/ready").status_code == 200
    app.refresh_ready({"ocr_det": 1, "tiny_cnn": 1, "ocr": 1})
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        app.refresh_ready({"ocr_det": 0, "tiny_cnn": 0, "ocr": 1}, stopped={"tiny_cnn"})  # both lost theirs
    # a model whose application is being deleted (Ctrl-C) lost them by plan: no warning on the terminal
    assert sorted((r.levelname, r.getMessage()) for r in caplog.records if "no running replica" in r.getMessage()) == [
        ("INFO", "model 'tiny_cnn' has no running replica: not ready (503) until one runs"),
        ("WARNING", "model 'ocr_det' has no running replica: not ready (503) until one runs")]
    for name in ("ocr_det", "tiny_cnn"):
        assert_error(router.get(f"/v2/models/{name}/ready"), 503, f"model '{name}' is not ready")
    assert_error(router.get("/v2/health/ready"), 503, "ocr_det", "tiny_cnn")
    body = {"inputs": [{"name": "x", "shape": [1, 3, 64, 64], "datatype": "FP32", "data": [0.0] * (3 * 64 * 64)}]}
    assert_error(post(router, "/v2/models/ocr_det/infer", body), 503, "model 'ocr_det' is not ready")
    assert client.calls == []
    app.refresh_ready({"ocr_det": 1, "tiny_cnn": 2})
    assert router.get("/v2/health/ready").status_code == 200


def test_requests_before_the_routers_first_readiness_pass_ask_the_replica_once(repo):
    """Serve can route to the router before ``poll_ready`` saw a dedicated model's replica:
    infer and the ready routes ask it (concurrent requests share one call) and are answered as
    a ready model, not 503."""
    client = FakeModelClient(repo)
    client.backend_delay_s = 0.5  # the replica answers after every request below arrived
    app = RouterApp(repo, client, RouterOptions(max_body_bytes=LIMIT_BYTES, request_timeout_s=60.0))
    body = {"inputs": [{"name": "x", "shape": [1, 3, 64, 64], "datatype": "FP32", "data": [0.0] * (3 * 64 * 64)}]}
    calls = [lambda: post(router, "/v2/models/ocr_det/infer", body)] * 4 + [
        lambda: router.get("/v2/models/ocr_det/ready"), lambda: router.get("/v2/health/ready")]
    with TestClient(app.build_app(), raise_server_exceptions=False) as router:  # one event loop
        with ThreadPoolExecutor(len(calls)) as threads:
            answers = list(threads.map(lambda call: call(), calls))
        assert [r.status_code for r in answers] == [200] * len(calls), [r.text for r in answers]
        assert client.backend_calls.count("ocr_det") == 1 and len(client.calls) == 4
        assert answers[4].json() == {"name": "ocr_det", "ready": True}
        assert router.get("/v2/models/ocr_det").json()["platform"] == "onnxruntime_onnx"
        assert client.backend_calls.count("ocr_det") == 1  # known now: no more calls


def test_a_model_that_never_answered_stays_loading_whatever_the_replica_count(repo):
    client = FakeModelClient(repo, not_ready={"ocr_det"})
    app = RouterApp(repo, client, RouterOptions(max_body_bytes=LIMIT_BYTES, request_timeout_s=60.0))
    app.refresh_ready({"ocr_det": 1})
    router = TestClient(app.build_app(), raise_server_exceptions=False)
    assert_error(router.get("/v2/models/ocr_det/ready"), 503, "model 'ocr_det' is not ready")


def test_class_count_answers_the_top_k_as_bytes_and_the_extension_is_advertised(router, repo):
    x = np.zeros((2, 3, 224, 224), np.float32)
    x[0, 0, 0, 7], x[0, 0, 0, 3], x[1, 0, 0, 9] = 5.0, 4.0, 1.0  # logits = 2 x the first 1000 values
    body = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}],
            "outputs": [{"name": "logits", "parameters": {"classification": 2}}]}
    r = post(router, "/v2/models/tiny_cnn/infer", body)
    assert r.status_code == 200, r.text
    (out,) = r.json()["outputs"]
    assert out == {"name": "logits", "datatype": "BYTES", "shape": [2, 2],
                   "data": ["10.000000:7", "8.000000:3", "2.000000:9", "0.000000:0"]}
    assert "classification" in router.get("/v2").json()["extensions"]


# --- compressed bodies (protocol.compression) ------------------------------------------------

@pytest.mark.parametrize("coding, encode", [("gzip", gzip.compress), ("deflate", zlib.compress)])
def test_a_compressed_request_reaches_the_model_decoded(repo, coding, encode):
    router, client = make_router(repo)
    r = router.post("/v2/models/tiny_cnn/infer", content=encode(json.dumps({"inputs": [GOOD]}).encode()),
                    headers={"Content-Encoding": coding, "Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    ((name, inputs, _),) = client.calls
    assert name == "tiny_cnn" and inputs["input"].shape == (1, 3, 224, 224)


def test_a_compressed_binary_request_keeps_its_header_length(repo):
    router, client = make_router(repo)
    x = np.arange(3 * 224 * 224, dtype=np.float32).reshape(1, 3, 224, 224)
    head = json.dumps({"inputs": [{"name": "input", "shape": [1, 3, 224, 224], "datatype": "FP32",
                                   "parameters": {"binary_data_size": x.nbytes}}]}).encode()
    r = router.post("/v2/models/tiny_cnn/infer", content=gzip.compress(head + x.tobytes()),
                    headers={"Content-Encoding": "gzip", "Inference-Header-Content-Length": str(len(head))})
    assert r.status_code == 200, r.text
    np.testing.assert_array_equal(client.calls[0][1]["input"], x)


def test_an_unknown_content_encoding_is_415(router):
    r = router.post("/v2/models/tiny_cnn/infer", content=b"{}", headers={"Content-Encoding": "br"})
    assert_error(r, 415, "Content-Encoding 'br' is not supported; supported: ['deflate', 'gzip', 'identity']")


def test_a_body_decompressing_over_the_limit_is_413(router):
    r = router.post("/v2/models/tiny_cnn/infer", content=gzip.compress(b" " * (LIMIT_BYTES + 1)),
                    headers={"Content-Encoding": "gzip"})
    assert_error(r, 413, f"to more than the limit of {LIMIT_BYTES} bytes")


@pytest.mark.parametrize("coding, decode", [("deflate", zlib.decompress), ("gzip", gzip.decompress)])
def test_the_response_is_compressed_as_accept_encoding_asks(router, coding, decode):
    with router.stream("POST", "/v2/models/tiny_cnn/infer", content=json.dumps({"inputs": [GOOD]}),
                       headers={"Accept-Encoding": coding}) as r:
        raw = b"".join(r.iter_raw())
    assert r.status_code == 200 and r.headers["content-encoding"] == coding
    assert json.loads(decode(raw))["outputs"][0]["shape"] == [1, 1000]


def test_a_zero_count_for_a_model_never_seen_running_changes_nothing(router, repo):
    # A snapshot taken while the deployments still start (or older than their first replica)
    # must not turn a ready pool model or an answered dedicated model away.
    client = FakeModelClient(repo)
    app = RouterApp(repo, client, RouterOptions(max_body_bytes=LIMIT_BYTES, request_timeout_s=60.0))
    asyncio.run(asyncio.wait_for(app.poll_ready(), 5.0))
    app.refresh_ready({"ocr_det": 0, "tiny_cnn": 0})
    ready = TestClient(app.build_app(), raise_server_exceptions=False)
    assert ready.get("/v2/models/tiny_cnn/ready").status_code == 200
    assert ready.get("/v2/models/ocr_det/ready").status_code == 200


class CountingClient(FakeModelClient):
    """``FakeModelClient`` with Serve's replica counts (``ModelClient.replica_counts``):
    ``counts``; ``while_asked`` runs while a snapshot is on its way; ``passes`` counts the
    watcher's passes (``cut_unassigned`` comes right after ``refresh_ready``)."""

    def __init__(self, repo: ModelRepository, counts: dict[str, int]) -> None:
        super().__init__(repo)
        self.counts = counts
        self.missing: set[str] = set()  # models whose application Serve does not list
        self.while_asked = None
        self.passes = 0

    async def replica_counts(self) -> ReplicaCounts:
        if self.while_asked is not None:
            await self.while_asked()
        return ReplicaCounts(dict(self.counts), missing=frozenset(self.missing))

    def cut_unassigned(self, names, idle_s: float) -> None:
        self.passes += 1


def _one_watch_pass(app: RouterApp, client: CountingClient) -> None:
    async def run() -> None:
        done = client.passes + 1
        watcher = asyncio.ensure_future(app.watch_replicas())
        while client.passes < done:
            await asyncio.sleep(0.01)
        watcher.cancel()

    asyncio.run(asyncio.wait_for(run(), 30.0))


def test_a_model_whose_replica_answered_then_died_before_any_count_saw_it_running_is_503(repo):
    # The replica answered poll_ready, then died before the router's first snapshot counted it
    # (Serve noticed at once): a snapshot asked for after the answer says it has gone.
    client = CountingClient(repo, {"ocr_det": 0})
    app = RouterApp(repo, client, RouterOptions(max_body_bytes=LIMIT_BYTES, request_timeout_s=60.0))
    asyncio.run(asyncio.wait_for(app.poll_ready(), 5.0))
    router = TestClient(app.build_app(), raise_server_exceptions=False)
    assert router.get("/v2/models/ocr_det/ready").status_code == 200
    _one_watch_pass(app, client)
    assert_error(router.get("/v2/models/ocr_det/ready"), 503, "model 'ocr_det' is not ready")
    client.counts = {"ocr_det": 1}  # the replacement runs
    _one_watch_pass(app, client)
    assert router.get("/v2/models/ocr_det/ready").status_code == 200


def _not_served(repo: ModelRepository, model: str, app: str) -> tuple[RouterApp, CountingClient, TestClient]:
    """A router whose Serve snapshot lacks ``model``'s application ``app``: its routes and the
    server's readiness answer 503 naming it."""
    client = CountingClient(repo, {model: 0})
    client.missing = {model}
    router_app = RouterApp(repo, client, RouterOptions(max_body_bytes=LIMIT_BYTES, request_timeout_s=60.0))
    router = TestClient(router_app.build_app(), raise_server_exceptions=False)
    _one_watch_pass(router_app, client)
    for r in (router.get(f"/v2/models/{model}/ready"), post(router, f"/v2/models/{model}/infer", {"inputs": [GOOD]})):
        assert_error(r, 503, f"model '{model}' is not served: its application '<router application>.{app}' is not "
                     "deployed", "python -m deployments.check --write serve_config.yaml")
    assert_error(router.get("/v2/health/ready"), 503, f"models ['{model}'] are not served")
    return router_app, client, router


def test_a_dedicated_model_whose_application_is_not_deployed_is_503_naming_it_until_it_is(repo):
    # serve run with a Serve config that lacks the model's application (the router app alone)
    app, client, router = _not_served(repo, "ocr_det", "ocr_det")
    client.missing, client.counts = set(), {"ocr_det": 1}  # deployed now
    asyncio.run(asyncio.wait_for(app.poll_ready(), 5.0))
    _one_watch_pass(app, client)
    assert router.get("/v2/models/ocr_det/ready").status_code == 200


def test_a_pool_model_whose_pools_application_is_not_deployed_is_503_naming_it(repo):
    # a Serve config written before the pool had an application of its own (plain serve run)
    _, client, _ = _not_served(repo, "tiny_cnn", "pool")
    assert not client.calls  # nothing waited on a pool that is not there


def test_a_snapshot_asked_for_before_the_first_answer_changes_nothing(repo):
    # The snapshot left before the replica answered and counts none: it is older than the replica.
    client = CountingClient(repo, {"ocr_det": 0})
    app = RouterApp(repo, client, RouterOptions(max_body_bytes=LIMIT_BYTES, request_timeout_s=60.0))
    client.while_asked = app.poll_ready
    _one_watch_pass(app, client)
    router = TestClient(app.build_app(), raise_server_exceptions=False)
    assert router.get("/v2/models/ocr_det/ready").status_code == 200


class LateHandleClient(FakeModelClient):
    """The router's handle reaches the model's replica only from the ``unreachable``-th
    ``backend`` call on (before that: no replica known yet)."""

    def __init__(self, repo: ModelRepository, unreachable: int) -> None:
        super().__init__(repo)
        self.unreachable = unreachable

    async def backend(self, name: str) -> str:
        self.backend_calls.append(name)
        if len(self.backend_calls) <= self.unreachable:
            raise ModelNotReady(f"model '{name}' has no replica")
        return "onnxruntime"


@pytest.mark.parametrize("running, status, calls", [(1, 200, 3), (0, 503, 1)])
def test_a_request_for_a_model_serve_counts_running_waits_until_the_router_reaches_it(repo, running, status, calls):
    """Serve counts a RUNNING replica of a model this router has not reached yet: the request
    asks again until it answers; with none running, one ask and 503 at once."""
    client = LateHandleClient(repo, unreachable=2)
    app = RouterApp(repo, client, RouterOptions(max_body_bytes=LIMIT_BYTES, request_timeout_s=60.0))
    app.refresh_ready({"ocr_det": running})
    body = {"inputs": [{"name": "x", "shape": [1, 3, 64, 64], "datatype": "FP32", "data": [0.0] * (3 * 64 * 64)}]}
    r = post(TestClient(app.build_app(), raise_server_exceptions=False), "/v2/models/ocr_det/infer", body)
    assert r.status_code == status, r.text
    assert client.backend_calls == ["ocr_det"] * calls


def test_metrics_and_statistics_routes_answer_404_when_metrics_are_off(router):
    # RouterApp without an observer (application args metrics.enabled: false).
    for path in ("/metrics", "/v2/models/stats", "/v2/models/tiny_cnn/stats", "/v2/models/tiny_cnn/versions/1/stats"):
        assert_error(router.get(path), 404, "metrics are off")


def test_only_infer_responses_are_compressed_as_tritonclient_aio_expects(router):
    """tritonclient's asyncio client reads non-infer answers raw while aiohttp asks for gzip."""
    for path in ("/v2/models/tiny_cnn", "/v2/models/tiny_cnn/config", "/v2"):
        r = router.get(path, headers={"Accept-Encoding": "gzip, deflate"})
        assert r.status_code == 200 and "content-encoding" not in r.headers, path


def test_a_body_that_stalls_is_408_naming_what_arrived(repo, monkeypatch):
    """A client that sends part of its body, then nothing: 408 once no byte has come for
    ``BODY_STALL_TIMEOUT_S`` (HAProxy's own timeout covers only the first 16 KiB)."""
    from deployments import routes

    monkeypatch.setattr(routes, "BODY_STALL_TIMEOUT_S", 0.3)
    app = make_router(repo)[0].app
    sent: list[dict] = []
    arrived = iter([{"type": "http.request", "body": b'{"inputs": [', "more_body": True},
                    {"type": "http.request", "body": b" " * 10, "more_body": True}])

    async def receive() -> dict:
        message = next(arrived, None)
        if message is None:
            await asyncio.sleep(60)  # stalls
        await asyncio.sleep(0.2)  # under the deadline between chunks: a slow sender is not cut
        return message

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v2/models/tiny_cnn/infer", "raw_path": b"/v2/models/tiny_cnn/infer", "root_path": "",
             "query_string": b"", "server": ("testserver", 80), "client": ("testclient", 1),
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"1000")]}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 10))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert start["status"] == 408
    error = json.loads(body)["error"]
    assert "the request body stalled: no bytes for 0.3 s after 22 bytes of the 1000" in error, error


def test_an_unknown_route_lists_the_server_and_model_routes(router):
    assert_error(router.get("/v2/models"), 404, "no route GET /v2/models", "POST /v2/repository/index (lists the models)",
                 "/v2/models/{name}[/versions/{version}]")


def test_an_integer_over_pythons_digit_limit_is_400_without_pythons_advice(router):
    body = '{"inputs":[{"name":"input","shape":[1],"datatype":"INT64","data":[%s]}]}' % ("9" * 5000)
    r = post(router, "/v2/models/tiny_cnn/infer", body)
    assert_error(r, 400, "an integer of more than 4300 digits")
    assert "sys.set_int_max_str_digits" not in r.json()["error"]


def test_routes_in_a_model_replica_shed_before_reading_the_body(repo):
    """An overloaded replica answers 503 without reading or decoding the body (the routes ask
    its ``Admission`` first): under 250 clients every shed request had cost a full decode."""
    from deployments.admission import Admission

    client = FakeModelClient(repo)
    app = RouterApp(repo, client, RouterOptions(max_body_bytes=LIMIT_BYTES, request_timeout_s=60.0))
    asyncio.run(asyncio.wait_for(app.poll_ready(), 5.0))
    app.admission = Admission(0, 0)  # no room at all
    router = TestClient(app.build_app(), raise_server_exceptions=False)
    r = router.post("/v2/models/ocr_det/infer", content=b"not even JSON")  # a decode would say 400
    assert_error(r, 503, "server overloaded: 0 requests already wait for this model (limit 0)")
    assert r.headers["retry-after"] == "1" and client.calls == []
    app.admission = Admission(1, 0)
    body = {"inputs": [{"name": "x", "shape": [1, 3, 64, 64], "datatype": "FP32", "data": [0.0] * (3 * 64 * 64)}]}
    assert post(router, "/v2/models/ocr_det/infer", body).status_code == 200


def test_a_pool_replicas_routes_answer_its_models_and_the_routers_errors_for_the_rest(repo):
    """``PoolRoutes`` as a pool replica serves them at ``/v2/models`` (Serve's root_path): a pool
    model's infer runs through the replica's own ``infer_body`` with the version's cache key;
    an unknown model's 404 names every model, as the router's does; a dedicated model (its own
    application) is not served here (503)."""
    from deployments.adapters import PoolAdapter
    from deployments.replica_routes import pool_routes

    fake = FakeModelClient(repo)
    keys = []

    async def infer_body(name, version, batched, chunks, header_length, default_timeout_s, key):
        keys.append(key)
        return await fake.infer_body(name, key, version, batched, chunks, header_length, default_timeout_s)

    states = {name: {"state": "ready", "evictions": 0, "backend": "onnxruntime_cuda"} for name in fake.pool_models}
    routes = pool_routes(repo, fake.pool_models, infer_body, lambda: states,
                         RouterOptions(max_body_bytes=LIMIT_BYTES, request_timeout_s=60.0), {"enabled": False}, None,
                         "models")
    assert isinstance(routes.client, PoolAdapter) and routes.observer is None
    client = TestClient(routes.build_app(), root_path="/v2/models", raise_server_exceptions=False)
    x = np.arange(3 * 224 * 224, dtype=np.float32) / 1000
    r = client.post("/v2/models/tiny_cnn/infer", json={"inputs": [tensor(data=x.tolist())]})
    assert r.status_code == 200, r.text
    [out] = r.json()["outputs"]
    np.testing.assert_allclose(out["data"], 2 * x[:1000], rtol=1e-6)
    assert keys == ["tiny_cnn"] and r.json()["model_name"] == "tiny_cnn"
    assert client.get("/v2/models/tiny_cnn").json()["platform"] == "onnxruntime_onnx"
    r = client.get("/v2/models/no_such_model/ready")
    assert r.status_code == 404 and f"available models: {repo.names()}" in r.json()["error"], r.text
    for r in (client.get("/v2/models/ocr_cls/ready"), post(client, "/v2/models/ocr_cls/infer", {"inputs": [GOOD]})):
        assert_error(r, 503, "model 'ocr_cls' is not served: its application 'models.ocr_cls' is not deployed or not "
                     "routed yet", "python -m deployments.check --write serve_config.yaml")
    assert keys == ["tiny_cnn"]
    r = client.get("/v2/models/tiny_cnn/infer")
    assert r.status_code == 405 and r.headers["allow"] == "POST"


def test_a_repository_request_body_is_read_as_an_infer_body_is(router):
    """The repository index's body (and load's and unload's, read by the same ``_json_body``)
    keeps the infer routes' limit (413 from the declared length, or once more arrived), and a
    gzip body is read (``V2Routes._read_body``)."""
    big = b"{" + b" " * LIMIT_BYTES + b"}"
    assert_error(post(router, "/v2/repository/index", big), 413, "request body is", f"the limit is {LIMIT_BYTES} bytes")
    chunked = router.post("/v2/repository/index", content=iter([big[:LIMIT_BYTES], big[LIMIT_BYTES:]]),
                          headers={"Content-Type": "application/json"})
    assert_error(chunked, 413, f"request body exceeds the limit of {LIMIT_BYTES} bytes")
    r = router.post("/v2/repository/index", content=gzip.compress(b'{"ready": true}'),
                    headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert r.status_code == 200 and all(item["state"] == "READY" for item in r.json()), r.text


class StoppingClient(CountingClient):
    """Serve's counts answer (``deleting`` as set); the model control state does not (its
    deployment is gone, as when the application is being deleted)."""

    def __init__(self, repo: ModelRepository, deleting: bool) -> None:
        super().__init__(repo, {"ocr_det": 1})
        self.deleting = deleting

    async def replica_counts(self) -> ReplicaCounts:
        return ReplicaCounts(dict(self.counts), deleting=self.deleting)

    async def control_desired(self) -> dict:
        raise RuntimeError("Deployment(name='control', app='models') is unavailable")


@pytest.mark.parametrize("deleting, warnings", [(False, 1), (True, 0)])
def test_the_watch_warns_once_per_outage_and_not_while_the_application_is_deleted(repo, monkeypatch, caplog,
                                                                                    deleting, warnings):
    """Stopping a server in explicit mode printed the same traceback 43 times: the router's
    watch asked the control deployment, already gone, every 0.1 s."""
    import deployments.readiness as readiness

    monkeypatch.setattr(readiness, "_READY_POLL_S", 0.01)
    client = StoppingClient(repo, deleting)
    app = RouterApp(repo, client, RouterOptions(max_body_bytes=LIMIT_BYTES, request_timeout_s=60.0))
    app.initial = {}  # explicit model control: the watch follows the desired state

    async def run() -> None:
        watcher = asyncio.ensure_future(app.watch_replicas())
        while client.passes < 8:
            await asyncio.sleep(0.01)
        watcher.cancel()

    with caplog.at_level(logging.WARNING):
        asyncio.run(asyncio.wait_for(run(), 30.0))
    unavailable = [r for r in caplog.records if r.levelno >= logging.WARNING and r.getMessage().startswith("readiness:")]
    assert len(unavailable) == warnings, [r.getMessage() for r in caplog.records]
