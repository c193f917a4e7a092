"""``POST /v1/embeddings``, ``GET /v1/models`` and ``GET /v1/models/{model}`` under Starlette's TestClient, without Ray.

The router runs over the real repository; its model client runs ``embed`` through the real
embed pipeline and encoder (ModelHost, ONNX Runtime), as the pipeline's replica would, and
records each call. Real Ray Serve and the ``openai`` client over HTTP: tests/integration/test_embeddings.py.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import json

import numpy as np
import pytest

from deployments.pipelines import create_pipeline
from deployments.protocol.errors import overloaded
from deployments.runtime.contract.errors import ModelNotReady
from deployments.runtime.residency.host import ModelHost
from tests.unit.test_router_routes import LIMIT_BYTES, FakeModelClient, make_router

SENTENCES = ["The weather is lovely today.", "It's so sunny outside!", "He drove to the stadium."]
TOKEN_IDS_FIX = "check_embedding_ctx_length=False"


@pytest.fixture(scope="module")
def encoder(model_repository):
    host = ModelHost(model_repository.get("all-MiniLM-L6-v2"), backend="onnxruntime").load()
    yield host
    host.unload()


@pytest.fixture
def served(model_repository, encoder, monkeypatch):
    """(TestClient, the fake client): ``embed`` runs the real pipeline."""
    async def run_encoder(name, inputs):
        return await asyncio.to_thread(encoder.infer, inputs)

    pipeline = create_pipeline(model_repository, "embed", run_encoder)
    real_infer = FakeModelClient.infer

    async def infer(self, name, inputs, outputs=None, key=None, version=None):
        if name != "embed":
            return await real_infer(self, name, inputs, outputs, key, version)
        self.calls.append((name, inputs, outputs))
        if self.raises is not None:
            raise self.raises
        return (await pipeline.infer(inputs)).select(outputs)

    monkeypatch.setattr(FakeModelClient, "infer", infer)
    return make_router(model_repository)


def post(router, body, **kwargs):
    return router.post("/v1/embeddings", content=json.dumps(body), headers={"content-type": "application/json"},
                       **kwargs)


def test_three_sentences_answer_in_openai_shape_with_the_published_similarities(served):
    router, client = served
    r = post(router, {"model": "embed", "input": SENTENCES})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "embed"
    assert [(d["object"], d["index"]) for d in body["data"]] == [("embedding", i) for i in range(3)]
    e = np.array([d["embedding"] for d in body["data"]])
    assert e.shape == (3, 384)
    assert [round(float(e[i] @ e[j]), 4) for i, j in ((0, 1), (0, 2), (1, 2))] == pytest.approx(
        [0.6660, 0.1046, 0.1411], abs=5e-4)
    assert body["usage"] == {"prompt_tokens": 8 + 9 + 8, "total_tokens": 25}
    (name, inputs, outputs), = client.calls
    assert name == "embed" and outputs == ["embedding", "tokens"]
    assert inputs["text"].tolist() == [s.encode() for s in SENTENCES]


def test_base64_encoding_is_the_float32_bytes_of_the_float_answer(served):
    router, _ = served
    floats = post(router, {"model": "embed", "input": "hello"}).json()["data"][0]["embedding"]
    packed = post(router, {"model": "embed", "input": "hello", "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), "<f4")
    assert decoded.tolist() == np.array(floats, np.float32).tolist()


def test_models_lists_the_embedding_models(served):
    router, _ = served
    r = router.get("/v1/models")
    assert r.status_code == 200
    assert [(m["id"], m["object"], m["owned_by"]) for m in r.json()["data"]] == [("embed", "model", "trt-serve")]
    assert r.json()["object"] == "list" and isinstance(r.json()["data"][0]["created"], int)


def test_models_lists_only_the_embedding_models_that_serve_now(model_repository):
    """Seen: ``/v1/models`` listed ``embed`` after it was unloaded, while ``/v1/embeddings``
    answered 503. A model not ready (loading here) is neither listed nor retrieved."""
    router, _ = make_router(model_repository, not_ready={"embed"})
    r = router.get("/v1/models")
    assert (r.status_code, r.json()) == (200, {"object": "list", "data": []})
    message = _error(router.get("/v1/models/embed"), 503, None)
    assert message.startswith("model 'embed' is not ready: its deployment is starting, stopping or has no running "
                              "replica"), message


def test_retrieve_model_gives_an_embedding_models_object_and_404_in_openai_shape_for_another(served):
    """OpenAI's ``GET /v1/models/{model}`` (``client.models.retrieve``), which was a 404 route."""
    router, _ = served
    r = router.get("/v1/models/embed")
    assert r.status_code == 200 and r.json() == router.get("/v1/models").json()["data"][0]
    for model in ("text-embedding-3-small", "resnet18", "org/model"):
        message = _error(router.get(f"/v1/models/{model}"), 404, "model", "model_not_found")
        assert message.startswith(f"The model '{model}' does not exist or is not an embedding model; embedding "
                                  "models: ['embed']")


def _error(r, status: int, param: str | None, code: str | None = None) -> str:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error" if status < 500 else "server_error", param, code)
    return error["message"]


@pytest.mark.parametrize("tokens", [[1820, 4062], [[1820, 4062], [9906]]])
def test_token_id_input_is_a_400_that_names_the_langchain_fix(served, tokens):
    router, client = served
    message = _error(post(router, {"model": "embed", "input": tokens}), 400, "input")
    assert "token ids" in message and TOKEN_IDS_FIX in message
    assert client.calls == []


def test_an_unknown_model_is_a_404_in_openai_shape_naming_the_embedding_models(served):
    router, client = served
    for model in ("text-embedding-3-small", "resnet18"):
        message = _error(post(router, {"model": model, "input": "x"}), 404, None, "model_not_found")
        assert f"The model '{model}' does not exist or is not an embedding model; embedding models: ['embed']" in message
    assert client.calls == []


@pytest.mark.parametrize("body, status, param, message", [
    ({"input": "x"}, 400, "model", "'model' is required"),
    ({"model": "embed"}, 400, "input", "'input' is required: a string or a list of strings"),
    ({"model": 5, "input": "x"}, 400, "model", "'model' must be a string, the name of an embedding model (GET "
                                               "/v1/models lists them), got number"),  # said "'model' is required"
    ({"model": "embed", "input": {"text": "x"}}, 400, "input", "'input' must be a string or a list of strings, got object"),
    ({"model": "embed", "input": 5}, 400, "input", "'input' must be a string or a list of strings, got number"),
    ({"model": "embed", "input": "x", "encoding_format": 5}, 400, "encoding_format",
     "'encoding_format' must be a string, 'float' or 'base64', got number"),
    ({"model": "embed", "input": "x", "encoding_format": False}, 400, "encoding_format", "got boolean"),
    ({"model": "embed", "input": "x", "dimensions": "384"}, 400, "dimensions",
     "'dimensions' is \"384\" (a string); it must be a positive integer"),
    ({"model": "embed", "input": "x", "user": 7}, 400, "user", "'user' must be a string, got number"),
    ({"model": "embed", "input": ["ok", 3.5]}, 400, "input", "'input'[1] is 3.5; 'input' must be a string or a list"),
    ({"model": "embed", "input": "x", "encoding_format": "int8"}, 400, "encoding_format", "allowed: 'float', 'base64'"),
    ({"model": "embed", "input": "x", "dimensions": 256}, 400, "dimensions", "gives embeddings of 384 dimensions only"),
    ({"model": "embed", "input": []}, 400, "input", "'input' is an empty list; send a string or a list of at least one"),
    ({"model": "embed", "input": ["a"] * 2049}, 413, "input", "holds 2049 texts; at most 2048 are accepted per request"),
    ({"model": "embed", "input": ["fine", "\ud800"]}, 400, "input", "input 'text'[1] is not UTF-8 text"),
    ([1, 2], 400, None, "the request body must be a JSON object"),
])
def test_bad_requests_answer_4xx_in_openai_shape_naming_field_and_what_is_allowed(served, body, status, param, message):
    router, _ = served
    assert message in _error(post(router, body), status, param)
    assert post(router, {"model": "embed", "input": "still serving"}).status_code == 200


def test_a_body_that_is_not_json_is_a_400(served):
    router, _ = served
    r = router.post("/v1/embeddings", content=b"{not json", headers={"content-type": "application/json"})
    _error(r, 400, None)


def test_a_text_over_256_tokens_is_cut_and_counted_at_256(served):
    router, _ = served
    body = post(router, {"model": "embed", "input": [" ".join(["serving"] * 300)]}).json()
    assert body["usage"]["prompt_tokens"] == 256


def test_a_pipeline_not_ready_is_a_503_server_error(served):
    router, client = served
    client.raises = ModelNotReady("model 'embed' is not ready: retry shortly")
    message = _error(post(router, {"model": "embed", "input": "x"}), 503, None)
    assert message == "model 'embed' is not ready: retry shortly"


@pytest.mark.parametrize("method, path, status, message, allow", [
    ("GET", "/v1/embeddings", 405, "method GET not allowed on /v1/embeddings; allowed: POST", "POST"),
    ("POST", "/v1/models", 405, "method POST not allowed on /v1/models; allowed: GET, HEAD", "GET, HEAD"),
    ("DELETE", "/v1/models/embed", 405, "method DELETE not allowed on /v1/models/embed; allowed: GET, HEAD",
     "GET, HEAD"),
    ("GET", "/v1/chat/completions", 404, "no route GET /v1/chat/completions; OpenAI-compatible routes: POST "
                                         "/v1/embeddings, GET /v1/models, GET /v1/models/{model}", None),
    ("GET", "/v1", 404, "no route GET /v1; OpenAI-compatible routes: POST /v1/embeddings", None),
])
def test_a_v1_path_or_method_no_route_takes_answers_in_openai_shape(served, method, path, status, message, allow):
    router, _ = served
    r = router.request(method, path)
    assert message in _error(r, status, None)
    assert r.headers.get("allow") == allow


@pytest.mark.parametrize("content, headers, status, message", [
    (b"x" * (LIMIT_BYTES + 1), {}, 413, f"request body is {LIMIT_BYTES + 1} bytes; the limit is {LIMIT_BYTES} bytes"),
    (b'{"model": "embed"}', {"content-encoding": "br"}, 415,
     "Content-Encoding 'br' is not supported; supported: ['deflate', 'gzip', 'identity']"),
    (gzip.compress(b" " * (LIMIT_BYTES + 1)), {"content-encoding": "gzip"}, 413,
     f"request body decompresses (Content-Encoding: gzip) to more than the limit of {LIMIT_BYTES} bytes"),
    (b"{not json", {}, 400, "request body is not valid JSON"),
])
def test_a_body_refused_before_parsing_answers_in_openai_shape(served, content, headers, status, message):
    router, _ = served
    r = router.post("/v1/embeddings", content=content, headers={"content-type": "application/json", **headers})
    assert message in _error(r, status, None)


def test_a_shed_embeddings_request_answers_503_in_openai_shape_with_retry_after(served):
    router, client = served
    client.raises = overloaded(40, 40, 3.0)
    r = post(router, {"model": "embed", "input": "x"})
    assert "40 requests already wait for this model (limit 40); retry after 3 s" in _error(r, 503, None)
    assert r.headers["retry-after"] == "3"


def test_v2_paths_keep_their_own_error_shape(served):
    router, _ = served
    r = router.get("/v2/models/embed/infer")
    assert r.status_code == 405 and r.json() == {"error": "method GET not allowed on /v2/models/embed/infer; "
                                                          "allowed: POST"}
    assert isinstance(router.get("/v2/nothing").json()["error"], str)
