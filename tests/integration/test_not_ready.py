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
