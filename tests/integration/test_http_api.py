"""KServe v2 REST against the real application: metadata, health, infer equals ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import requests

from .conftest import REPOSITORY

pytestmark = pytest.mark.integration


def reference(model: str, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(f"{REPOSITORY}/{model}/1/model.onnx", providers=["CPUExecutionProvider"])
    return session.run(None, {"input": x})[0]


def test_live_ready_and_server_metadata(server):
    assert requests.get(f"{server}/v2/health/live").json() == {"live": True}
    assert requests.get(f"{server}/v2/health/ready").json() == {"ready": True}
    meta = requests.get(f"{server}/v2").json()
    assert meta["name"] == "trt-serve" and "model_repository" in meta["extensions"]


def test_model_metadata_lists_tensors_and_versions(server):
    meta = requests.get(f"{server}/v2/models/tiny_cnn").json()
    assert meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 3, 224, 224]}]
    assert meta["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, 1000]}]
    assert requests.get(f"{server}/v2/models/tiny_cnn/versions/1").json() == meta
    ocr = requests.get(f"{server}/v2/models/ocr").json()
    assert ocr["platform"] == "ensemble"
    assert [t["name"] for t in ocr["outputs"]] == ["text", "boxes", "scores"]


def test_model_ready_for_dedicated_and_pooled_models(server):
    for name in ("ocr_det", "tiny_cnn", "ocr"):
        r = requests.get(f"{server}/v2/models/{name}/ready")
        assert r.status_code == 200 and r.json() == {"name": name, "ready": True}


@pytest.mark.parametrize("model", ["tiny_cnn", "mid_cnn", "resnet18"])
def test_infer_equals_onnxruntime(server, model):
    x = np.random.default_rng(7).standard_normal((2, 3, 224, 224), dtype=np.float32)
    body = {"id": f"req-{model}",
            "inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
    r = requests.post(f"{server}/v2/models/{model}/infer", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["id"] == f"req-{model}" and out["model_name"] == model and out["model_version"] == "1"
    (logits,) = out["outputs"]
    assert logits["name"] == "logits" and logits["datatype"] == "FP32" and logits["shape"] == [2, 1000]
    np.testing.assert_allclose(np.array(logits["data"], np.float32).reshape(2, 1000), reference(model, x),
                               rtol=1e-5, atol=1e-5)


def test_nested_data_and_versioned_route_give_the_same_answer(server):
    x = np.random.default_rng(1).standard_normal((1, 3, 224, 224), dtype=np.float32)
    flat = {"inputs": [{"name": "input", "shape": [1, 3, 224, 224], "datatype": "FP32", "data": x.ravel().tolist()}]}
    nested = {"inputs": [{"name": "input", "shape": [1, 3, 224, 224], "datatype": "FP32", "data": x.tolist()}]}
    a = requests.post(f"{server}/v2/models/tiny_cnn/infer", json=flat).json()
    b = requests.post(f"{server}/v2/models/tiny_cnn/versions/1/infer", json=nested).json()
    assert a["outputs"] == b["outputs"]
    assert "id" not in a


def test_requested_outputs_only(server):
    x = np.zeros((1, 3, 224, 224), np.float32)
    body = {"inputs": [{"name": "input", "shape": [1, 3, 224, 224], "datatype": "FP32", "data": x.ravel().tolist()}],
            "outputs": [{"name": "logits"}]}
    r = requests.post(f"{server}/v2/models/resnet18/infer", json=body)
    assert [o["name"] for o in r.json()["outputs"]] == ["logits"]


def test_repository_index_lists_every_model_and_its_version(server):
    index = requests.post(f"{server}/v2/repository/index").json()
    names = sorted(i["name"] for i in index)
    assert names == ["all-MiniLM-L6-v2", "embed", "mid_cnn", "ocr", "ocr_cls", "ocr_det", "ocr_rec", "resnet18", "simple",
                     "simple_identity", "simple_string", "tiny_cnn"]
    assert all(i["version"] == "1" for i in index)  # states: test_model_config_and_states.py


def test_tritonclient_http_infer_equals_onnxruntime(server):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("tiny_cnn")
    assert client.get_model_metadata("tiny_cnn")["inputs"][0]["name"] == "input"
    x = np.random.default_rng(3).standard_normal((4, 3, 224, 224), dtype=np.float32)
    tensor = httpclient.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=False)
    result = client.infer("tiny_cnn", [tensor], outputs=[httpclient.InferRequestedOutput("logits", binary_data=False)],
                          request_id="triton-1")
    assert result.get_response()["id"] == "triton-1"
    np.testing.assert_allclose(result.as_numpy("logits"), reference("tiny_cnn", x), rtol=1e-5, atol=1e-5)
