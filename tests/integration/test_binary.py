"""Triton's binary tensor data extension over real HTTP: tritonclient unmodified, malformed bodies."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
import requests

from .conftest import REPOSITORY

pytestmark = pytest.mark.integration


def reference(model: str, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(f"{REPOSITORY}/{model}/1/model.onnx", providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


@pytest.fixture(scope="module")
def client(server):
    import tritonclient.http as httpclient

    return httpclient.InferenceServerClient(server.removeprefix("http://"), network_timeout=120)


def binary_input(name: str, x: np.ndarray, datatype: str = "FP32"):
    import tritonclient.http as httpclient

    tensor = httpclient.InferInput(name, list(x.shape), datatype)
    tensor.set_data_from_numpy(x, binary_data=True)
    return tensor


def test_tritonclient_binary_in_and_out_equals_onnxruntime(client):
    x = np.random.default_rng(5).standard_normal((3, 3, 224, 224), dtype=np.float32)
    result = client.infer("tiny_cnn", [binary_input("input", x)], request_id="bin-1")  # all outputs binary
    response = result.get_response()
    assert response["id"] == "bin-1"
    (logits,) = response["outputs"]
    assert logits["parameters"] == {"binary_data_size": 3 * 1000 * 4} and "data" not in logits
    np.testing.assert_allclose(result.as_numpy("logits"), reference("tiny_cnn", x), rtol=1e-5, atol=1e-5)


def test_ocr_det_640_input_binary_equals_onnxruntime_and_json(client, server):
    import tritonclient.http as httpclient

    x = np.random.default_rng(6).random((1, 3, 640, 640), dtype=np.float32)
    binary = client.infer("ocr_det", [binary_input("x", x)],
                          outputs=[httpclient.InferRequestedOutput("sigmoid_0.tmp_0", binary_data=True)])
    expected = reference("ocr_det", x)
    np.testing.assert_allclose(binary.as_numpy("sigmoid_0.tmp_0"), expected, rtol=1e-4, atol=1e-5)
    body = {"inputs": [{"name": "x", "shape": [1, 3, 640, 640], "datatype": "FP32", "data": x.ravel().tolist()}]}
    as_json = requests.post(f"{server}/v2/models/ocr_det/infer", json=body, timeout=120).json()["outputs"][0]
    np.testing.assert_array_equal(np.array(as_json["data"], np.float32).reshape(expected.shape),
                                  binary.as_numpy("sigmoid_0.tmp_0"))


def test_binary_input_with_json_output_when_the_output_says_so(client):
    import tritonclient.http as httpclient

    x = np.random.default_rng(8).standard_normal((1, 3, 224, 224), dtype=np.float32)
    result = client.infer("mid_cnn", [binary_input("input", x)],
                          outputs=[httpclient.InferRequestedOutput("logits", binary_data=False)])
    (logits,) = result.get_response()["outputs"]
    assert "data" in logits and "parameters" not in logits
    np.testing.assert_allclose(result.as_numpy("logits"), reference("mid_cnn", x), rtol=1e-5, atol=1e-5)


def post_binary(server: str, model: str, header: dict, payload: bytes, header_length: int | None = None):
    head = json.dumps(header).encode()
    length = len(head) if header_length is None else header_length
    return requests.post(f"{server}/v2/models/{model}/infer", data=head + payload,
                         headers={"Inference-Header-Content-Length": str(length),
                                  "Content-Type": "application/octet-stream"}, timeout=60)


def test_byte_count_that_disagrees_with_shape_is_400_giving_both(server):
    header = {"inputs": [{"name": "x", "shape": [1, 3, 640, 640], "datatype": "FP32",
                          "parameters": {"binary_data_size": 4915196}}]}
    r = post_binary(server, "ocr_det", header, bytes(4915196))
    assert r.status_code == 400
    assert "needs 4915200 bytes" in r.json()["error"] and "gives 4915196 bytes" in r.json()["error"]


def test_binary_data_size_past_the_body_is_400_and_the_server_keeps_serving(server, client):
    header = {"inputs": [{"name": "input", "shape": [1, 3, 224, 224], "datatype": "FP32",
                          "parameters": {"binary_data_size": 602112}}]}
    r = post_binary(server, "tiny_cnn", header, bytes(1000))
    assert r.status_code == 400 and "only 1000 bytes" in r.json()["error"]
    x = np.zeros((1, 3, 224, 224), np.float32)
    np.testing.assert_allclose(client.infer("tiny_cnn", [binary_input("input", x)]).as_numpy("logits"),
                               reference("tiny_cnn", x), rtol=1e-5, atol=1e-5)


def test_tritonclient_class_count_gives_the_top_k_as_triton_does_and_the_extension_is_advertised(client, server):
    import tritonclient.http as httpclient

    x = np.random.default_rng(8).standard_normal((2, 3, 224, 224), dtype=np.float32)
    result = client.infer("tiny_cnn", [binary_input("input", x)],
                          outputs=[httpclient.InferRequestedOutput("logits", class_count=3)])
    top = result.as_numpy("logits")
    assert top.shape == (2, 3) and top.dtype == object
    logits = reference("tiny_cnn", x)
    for row, entries in zip(logits, top):
        indices = [int(e.split(b":")[1]) for e in entries]
        assert indices == list(np.argsort(-row, kind="stable")[:3])
        np.testing.assert_allclose([float(e.split(b":")[0]) for e in entries], row[indices], atol=1e-5)
    assert "classification" in requests.get(f"{server}/v2").json()["extensions"]


def test_an_input_in_an_unregistered_shared_memory_region_is_400_naming_it(server):
    body = {"inputs": [{"name": "input", "shape": [1, 3, 224, 224], "datatype": "FP32",
                        "parameters": {"shared_memory_region": "in0", "shared_memory_byte_size": 602112}}]}
    r = requests.post(f"{server}/v2/models/tiny_cnn/infer", json=body)
    assert r.status_code == 400 and r.json()["error"].startswith("Unable to find shared memory region: 'in0'; ")
