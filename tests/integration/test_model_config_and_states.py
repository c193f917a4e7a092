"""Triton's model configuration route, unknown routes under a model, and metadata and index that
report the backend in use and the pool cache's real state (the shared ``server`` fixture)."""

from __future__ import annotations

import time

import pytest
import requests
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2

pytestmark = pytest.mark.integration

POOL = ["mid_cnn", "resnet18", "tiny_cnn"]  # deployment.mode: pool in engines/; the pool holds 2 at once here
INDEX_STATE = {"ready": "READY", "absent": "UNAVAILABLE", "loading": "LOADING", "evicting": "UNLOADING"}


def infer(server: str, model: str) -> None:
    body = {"inputs": [{"name": "input", "shape": [1, 3, 224, 224], "datatype": "FP32",
                        "data": [0.5] * (3 * 224 * 224)}]}
    assert requests.post(f"{server}/v2/models/{model}/infer", json=body).status_code == 200


def test_tritonclient_get_model_config_answers_tritons_model_config(server):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.removeprefix("http://"))
    config = client.get_model_config("ocr_cls")
    json_format.ParseDict(config, model_config_pb2.ModelConfig())  # Triton's own schema
    assert (config["name"], config["platform"], config["backend"]) == ("ocr_cls", "onnxruntime_onnx", "onnxruntime")
    assert config["max_batch_size"] == 32
    assert config["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [3, 48, 192]}]
    assert "dynamic_batching" not in config  # ocr_cls ships with batching off (docs/performance.md, "Dynamic batching on the GPU")
    assert config["instance_group"] == [{"name": "ocr_cls", "kind": "KIND_CPU", "count": 1}]
    assert client.get_model_config("tiny_cnn", "1")["platform"] == "onnxruntime_onnx"
    assert client.get_model_config("ocr")["platform"] == "ensemble"


@pytest.mark.parametrize("path", ["/v2/models/ocr/trace/setting", "/v2/models/ocr/versions/1/trace",
                                  "/v2/models/tiny_cnn/ready/", "/v2/models/tiny_cnn/config/x"])
def test_an_unknown_suffix_after_a_model_is_an_unknown_route(server, path):
    r = requests.get(f"{server}{path}")
    assert r.status_code == 404
    error = r.json()["error"]
    assert error.startswith(f"no route GET {path}; model routes: ") and "/config" in error, error
    assert "unknown model" not in error


def test_metadata_reports_the_backend_the_model_runs_on(server):
    for name in POOL + ["ocr_cls"]:  # pool and dedicated models; CI has no TensorRT GPU
        assert requests.get(f"{server}/v2/models/{name}").json()["platform"] == "onnxruntime_onnx", name


def test_repository_index_states_follow_the_pool_cache(server):
    for name in POOL:  # three models through a cache of two: one is evicted
        infer(server, name)
    memory = requests.get(f"{server}/v2/memory").json()
    cached = memory["pool"]["models"]
    # ONNX Runtime on the CPU has no CUDA graphs: /v2/memory says so for pool and dedicated models
    ready = [name for name in POOL if cached[name]["state"] == "ready"]
    assert ready and all(cached[name]["cuda_graphs"] is None for name in ready), cached
    assert all(m["cuda_graphs"] is None for m in memory["dedicated"].values()), memory["dedicated"]
    deadline = time.monotonic() + 10  # the index follows the pool replicas' reports, sent each second
    while True:
        index = {item["name"]: item for item in requests.post(f"{server}/v2/repository/index").json()}
        if all(index[name]["state"] == INDEX_STATE[cached[name]["state"]] for name in POOL) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for name in POOL:
        assert index[name]["state"] == INDEX_STATE[cached[name]["state"]], (name, cached[name], index[name])
    assert sum(index[name]["state"] == "READY" for name in POOL) == 2
    evicted = [name for name in POOL if cached[name]["state"] == "absent"]
    assert evicted and all(index[name]["reason"].startswith("evicted") for name in evicted)
    for name in ("ocr", "ocr_cls", "ocr_det", "ocr_rec", "embed", "all-MiniLM-L6-v2"):  # dedicated: ready once loaded
        assert index[name]["state"] == "READY" and "reason" not in index[name]
