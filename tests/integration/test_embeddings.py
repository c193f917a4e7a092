"""Sentence embeddings over HTTP: the embed pipeline through POST /v2/models/embed/infer, and the
OpenAI-compatible /v1/embeddings through the real ``openai`` client; their bad input."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
import requests

pytestmark = pytest.mark.integration

SENTENCES = ["The weather is lovely today.", "It's so sunny outside!", "He drove to the stadium."]
# sentence-transformers/all-MiniLM-L6-v2's model card
PUBLISHED = {(0, 1): 0.6660, (0, 2): 0.1046, (1, 2): 0.1411}
LONG = " ".join(["serving"] * 300)  # 302 tokens with [CLS] and [SEP]


def similarities_match(embedding: np.ndarray) -> None:
    for (i, j), published in PUBLISHED.items():
        assert abs(float(embedding[i] @ embedding[j]) - published) <= 5e-4, (i, j, float(embedding[i] @ embedding[j]))


def v2_embed(server: str, data: list, shape: list[int] | None = None, datatype: str = "BYTES",
             parameters: dict | None = None) -> requests.Response:
    tensor = {"name": "text", "shape": shape or [len(data)], "datatype": datatype, "data": data}
    if parameters:
        tensor["parameters"] = parameters
    return requests.post(f"{server}/v2/models/embed/infer", json={"inputs": [tensor]}, timeout=120)


def outputs(response: requests.Response) -> dict[str, dict]:
    assert response.status_code == 200, response.text
    return {o["name"]: o for o in response.json()["outputs"]}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def test_v2_infer_gives_the_published_similarities(server):
    out = outputs(v2_embed(server, SENTENCES))
    assert out["embedding"]["datatype"] == "FP32" and out["embedding"]["shape"] == [3, 384]
    similarities_match(np.array(out["embedding"]["data"], np.float32).reshape(3, 384))
    assert out["tokens"]["data"] == [8, 9, 8]


def test_v2_a_text_over_256_tokens_is_cut_and_the_response_parameters_say_so(server):
    r = v2_embed(server, ["short", LONG, ""])
    assert outputs(r)["tokens"]["data"] == [3, 256, 2]
    assert r.json()["parameters"] == {"truncated": [1], "max_seq_length": 256}
    assert "parameters" not in v2_embed(server, ["short"]).json()


def test_openai_client_gives_the_published_similarities_and_lists_the_model(client):
    answer = client.embeddings.create(model="embed", input=SENTENCES)  # the client asks for base64
    assert [d.index for d in answer.data] == [0, 1, 2] and answer.model == "embed"
    similarities_match(np.array([d.embedding for d in answer.data]))
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == 25
    floats = client.embeddings.create(model="embed", input="hello", encoding_format="float")
    assert len(floats.data[0].embedding) == 384
    assert [m.id for m in client.models.list()] == ["embed"]


def test_openai_client_token_ids_get_a_400_naming_the_langchain_fix(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="embed", input=[[1820, 4062, 374]])
    assert caught.value.status_code == 400
    error = caught.value.body
    assert error["type"] == "invalid_request_error" and error["param"] == "input"
    assert "check_embedding_ctx_length=False" in error["message"]


def test_openai_client_unknown_model_gets_a_404_in_openai_shape(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.embeddings.create(model="text-embedding-3-small", input="x")
    assert caught.value.body["code"] == "model_not_found"
    assert "embedding models: ['embed']" in caught.value.body["message"]


@pytest.mark.parametrize("data, shape, datatype, parameters, status, message", [
    ([base64.b64encode(b"ok").decode(), base64.b64encode(b"\xff\xfe").decode()], [2], "BYTES",
     {"content_type": "base64"}, 400, "input 'text'[1] is not UTF-8 text (invalid byte at offset 0)"),
    (["a"] * 2049, [2049], "BYTES", None, 413, "holds 2049 texts; at most 2048 are accepted per request"),
    ([], [0], "BYTES", None, 400, "input 'text': shape axis 0 is 0, must be a positive integer (>= 1)"),
    ([1.0, 2.0], [2], "FP32", None, 400, "text"),
])
def test_v2_bad_input_gets_a_4xx_naming_it_and_the_server_keeps_serving(server, data, shape, datatype, parameters,
                                                                      status, message):
    r = v2_embed(server, data, shape, datatype, parameters)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]
    assert outputs(v2_embed(server, ["still serving"]))["embedding"]["shape"] == [1, 384]


def test_openai_bad_input_gets_a_4xx_in_openai_shape_and_the_server_keeps_serving(server, client):
    for body, status, message in [
        ({"model": "embed", "input": ["a"] * 2049}, 413, "at most 2048 are accepted per request"),
        ({"model": "embed", "input": []}, 400, "'input' is an empty list; send a string or a list of at least one"),
        ({"model": "embed", "input": "x", "encoding_format": "int8"}, 400, "allowed: 'float', 'base64'"),
    ]:
        r = requests.post(f"{server}/v1/embeddings", json=body, timeout=120)
        assert r.status_code == status, r.text
        assert message in r.json()["error"]["message"]
    assert len(client.embeddings.create(model="embed", input="still serving").data) == 1


def _encoder_rows(server: str) -> int:
    [stats] = requests.get(f"{server}/v2/models/all-MiniLM-L6-v2/stats", timeout=60).json()["model_stats"]
    return stats["inference_count"]


def test_a_timed_out_request_leaves_no_encoder_calls_behind_to_starve_the_next(server):
    """2,048 texts of 122 tokens: 64 encoder calls of 32 rows. Answered 504 after 2 s, they kept
    running (all sent at once, none cancelled) and a one-word request behind them waited for
    all 2,048 rows. Now at most the calls in flight when the 504 went out run (4 at a time,
    ``step_calls_in_flight``), then the one word's row."""
    before = _encoder_rows(server)
    texts = ["word " * 120] * 2048
    big = {"inputs": [{"name": "text", "shape": [2048], "datatype": "BYTES", "data": texts}],
           "parameters": {"timeout": 2_000_000}}  # microseconds
    r = requests.post(f"{server}/v2/models/embed/infer", json=big, timeout=120)
    assert r.status_code == 504, r.text[:300]
    assert outputs(v2_embed(server, ["hi"]))["tokens"]["data"] == [3]
    ran = _encoder_rows(server) - before
    assert ran <= 8 * 32 + 1, f"{ran} encoder rows ran for a request answered 504 and a one-word one"


def test_a_text_of_megabytes_answers_200_cut_at_256_tokens(server, client):
    """A text is tokenized on a prefix only (``pipelines.embed.encode_bounded``). Tokenized whole,
    a 25 MB text kept the pipeline's worker thread busy past this request's 20 s timeout (and
    a 63 MB one past the 60 s default, then for minutes after its 504)."""
    text = "word " * (5 * 1024 * 1024)
    body = {"inputs": [{"name": "text", "shape": [2], "datatype": "BYTES", "data": ["short", text]}],
            "parameters": {"timeout": 20_000_000}}  # microseconds
    r = requests.post(f"{server}/v2/models/embed/infer", json=body, timeout=120)
    assert outputs(r)["tokens"]["data"] == [3, 256]
    assert r.json()["parameters"] == {"truncated": [1], "max_seq_length": 256}
    # the same text's embedding is its first 254 words'
    alone = np.array(outputs(v2_embed(server, ["word " * 254]))["embedding"]["data"], np.float32)
    np.testing.assert_allclose(np.array(outputs(r)["embedding"]["data"][384:], np.float32), alone, atol=1e-5)
    answer = client.embeddings.create(model="embed", input=[text])
    assert answer.usage.prompt_tokens == 256


@pytest.mark.parametrize("method, path, status, message", [
    ("GET", "/v1/embeddings", 405, "method GET not allowed on /v1/embeddings; allowed: POST"),
    ("GET", "/v1/chat/completions", 404, "no route GET /v1/chat/completions; OpenAI-compatible routes: "
                                         "POST /v1/embeddings, GET /v1/models, GET /v1/models/{model}"),
])
def test_a_v1_path_or_method_no_route_takes_answers_in_openai_shape(server, method, path, status, message):
    r = requests.request(method, f"{server}{path}", timeout=60)
    assert r.status_code == status, r.text
    assert r.json() == {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
