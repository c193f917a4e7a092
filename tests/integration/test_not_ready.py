"""A model whose deployment has no running replica answers 503; the rest keeps serving."""

from __future__ import annotations

import shutil
import time

import pytest
import requests

from .conftest import REPOSITORY

pytestmark = pytest.mark.integration

CONFIG = """
max_batch_size: 4
inputs:
  - {name: input, datatype: FP32, dims: [-1, 3, 224, 224],
     profile: {min: [1, 3, 224, 224], opt: [1, 3, 224, 224], max: [4, 3, 224, 224]}}
outputs:
  - {name: logits, datatype: FP32, dims: [-1, 1000]}
deployment: {mode: dedicated, num_gpus: 1}
"""


def test_model_without_a_replica_is_503_and_others_still_serve(server, tmp_path):
    from ray import serve

    from deployments.app import build_app

    (tmp_path / "gpu_cnn" / "1").mkdir(parents=True)
    shutil.copy(f"{REPOSITORY}/tiny_cnn/1/model.onnx", tmp_path / "gpu_cnn" / "1" / "model.onnx")
    (tmp_path / "gpu_cnn" / "config.yaml").write_text(CONFIG)
    # use_gpus: true on a cluster without GPUs: the replica can never be placed.
    serve._run(build_app({"repository": str(tmp_path), "use_gpus": True}), _blocking=False,
               name="pending", route_prefix="/pending")
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            r = requests.get(f"{server}/pending/v2/health/live")
            if r.status_code == 200:
                break
            time.sleep(0.5)
        body = {"inputs": [{"name": "input", "shape": [1, 3, 224, 224], "datatype": "FP32",
                            "data": [0.0] * (3 * 224 * 224)}]}
        r = requests.post(f"{server}/pending/v2/models/gpu_cnn/infer", json=body)
        assert r.status_code == 503, r.text
        assert "model 'gpu_cnn' is not ready" in r.json()["error"]
        r = requests.get(f"{server}/pending/v2/health/ready")
        assert r.status_code == 503 and "gpu_cnn" in r.json()["error"]
        assert requests.get(f"{server}/pending/v2/models/gpu_cnn/ready").status_code == 503
        assert requests.post(f"{server}/v2/models/tiny_cnn/infer", json=body).status_code == 200
    finally:
        serve.delete("pending", _blocking=False)


def test_readiness_returns_to_503_when_a_dedicated_model_loses_its_replicas(server, tmp_path):
    """The replica dies and its replacement cannot load (the model file is gone): readiness
    and requests answer 503 at once, not a 504 after the request timeout."""
    import ray
    from ray import serve

    from deployments.app import build_app

    model = tmp_path / "lost_cnn"
    (model / "1").mkdir(parents=True)
    shutil.copy(f"{REPOSITORY}/tiny_cnn/1/model.onnx", model / "1" / "model.onnx")
    (model / "config.yaml").write_text(CONFIG.replace("num_gpus: 1", "num_gpus: 0"))
    serve.run(build_app({"repository": str(tmp_path), "request_timeout_s": 30}), name="lost",
              route_prefix="/lost")
    try:
        base = f"{server}/lost"
        deadline = time.monotonic() + 60
        while requests.get(f"{base}/v2/health/ready").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert requests.get(f"{base}/v2/models/lost_cnn/ready").status_code == 200
        (model / "1" / "model.onnx").unlink()  # a replacement replica cannot load it
        replicas = [a for a in ray.util.list_named_actors(all_namespaces=True)
                    if a["name"].startswith("SERVE_REPLICA::lost#model-lost_cnn#")]
        assert len(replicas) == 1, replicas
        ray.kill(ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"]), no_restart=True)
        deadline = time.monotonic() + 30
        while requests.get(f"{base}/v2/models/lost_cnn/ready").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.5)
        r = requests.get(f"{base}/v2/models/lost_cnn/ready")
        assert r.status_code == 503 and "model 'lost_cnn' is not ready" in r.json()["error"]
        assert requests.get(f"{base}/v2/health/ready").status_code == 503
        body = {"inputs": [{"name": "input", "shape": [1, 3, 224, 224], "datatype": "FP32",
                            "data": [0.0] * (3 * 224 * 224)}]}
        r = requests.post(f"{base}/v2/models/lost_cnn/infer", json=body, timeout=60)
        assert r.status_code == 503 and "model 'lost_cnn' is not ready" in r.json()["error"], r.text
    finally:
        serve.delete("lost", _blocking=False)
