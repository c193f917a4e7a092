"""The benchmark's echo ceiling (``bench.echo``) answers the load generator's requests with KServe v2
responses that a Triton client decodes, binary or JSON, without a model."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.http as triton
from starlette.testclient import TestClient

from bench.echo import create_app
from bench.loadgen import HEADER_LENGTH, make_workload


@pytest.fixture(scope="module")
def client():
    with TestClient(create_app()) as c:
        yield c


def post(client, binary: bool, model: str = "tiny_cnn"):
    x = np.zeros((1, 3, 8, 8), np.float32)
    w = make_workload("echo", "http://testserver", model, "input", x, binary=binary)
    return client.post(w.url.removeprefix("http://testserver"), content=w.body, headers=w.headers)


def test_a_binary_request_gets_a_binary_response_named_after_the_requested_model(client):
    r = post(client, binary=True)
    assert r.status_code == 200
    result = triton.InferResult.from_response_body(r.content, header_length=int(r.headers[HEADER_LENGTH]))
    assert result.get_response()["model_name"] == "tiny_cnn"
    assert result.as_numpy("echo").tolist() == [0.0]


def test_a_json_request_gets_a_json_response(client):
    r = post(client, binary=False, model="ocr_cls")
    assert r.status_code == 200 and HEADER_LENGTH not in r.headers
    assert r.json() == {"model_name": "ocr_cls",
                        "outputs": [{"name": "echo", "datatype": "FP32", "shape": [1], "data": [0.0]}]}


def test_a_versioned_infer_route_and_the_health_routes_answer(client):
    assert client.post("/v2/models/any/versions/3/infer", content=b"{}").status_code == 200
    assert client.get("/v2/health/ready").status_code == 200
    assert client.get("/v2/health/live").status_code == 200
