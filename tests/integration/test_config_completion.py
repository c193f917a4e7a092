"""A model folder holding only ``1/model.onnx`` (a copy of tiny_cnn's) serves on a real server:
from the start (``model_control_mode: none``, the repository read at start) and through ``load``
in explicit model control (a folder added after start). Its config is completed from the ONNX
graph (``runtime.contract.completion``): ``GET .../config`` shows it, and the answers are ONNX
Runtime's own for the same file."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import requests

from .conftest import REPOSITORY, wait_ready

pytestmark = pytest.mark.integration

X = np.random.default_rng(11).random((2, 3, 224, 224), dtype=np.float32)
TINY_CNN = Path(REPOSITORY) / "tiny_cnn" / "1" / "model.onnx"
COMPLETED = {"max_batch_size": 4, "input": [{"name": "input", "data_type": "TYPE_FP32", "dims": [3, 224, 224]}],
             "output": [{"name": "logits", "data_type": "TYPE_FP32", "dims": [1000]}]}


def bare_model(root: Path, name: str) -> Path:
    """``root/name/1/model.onnx``, a copy of tiny_cnn's, and nothing else."""
    (root / name / "1").mkdir(parents=True)
    return Path(shutil.copy(TINY_CNN, root / name / "1" / "model.onnx"))


def cnn_body(x: np.ndarray) -> dict:
    return {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}


def assert_serves_like_onnx_runtime(url: str, model: str, path: Path) -> None:
    r = requests.post(f"{url}/v2/models/{model}/infer", json=cnn_body(X), timeout=60)
    assert r.status_code == 200, r.text
    [output] = r.json()["outputs"]
    expected = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"input": X})[0]
    assert (output["name"], output["datatype"], output["shape"]) == ("logits", "FP32", [2, 1000])
    np.testing.assert_allclose(np.array(output["data"], np.float32).reshape(expected.shape), expected,
                               rtol=1e-4, atol=1e-5)


def assert_completed_config(url: str, model: str) -> None:
    config = requests.get(f"{url}/v2/models/{model}/config", timeout=30).json()
    assert {k: config[k] for k in COMPLETED} == COMPLETED, config


@pytest.fixture(scope="module")
def started(serve_instance, tmp_path_factory):
    """(base URL, model file) of an application whose repository held only ``bare_cnn/1/model.onnx``
    when it started."""
    from deployments.app import delete_server, run_applications

    root = tmp_path_factory.mktemp("bare-repo")
    path = bare_model(root, "bare_cnn")
    run_applications({"repository": str(root)}, name="bare", route_prefix="/bare")
    url = f"{serve_instance}/bare"
    wait_ready(url)
    yield url, path
    delete_server("bare")


@pytest.fixture(scope="module")
def explicit(serve_instance, tmp_path_factory):
    """(base URL, repository root) of an explicit-control application started with ``simple``."""
    from deployments.app import delete_server, run_applications

    root = tmp_path_factory.mktemp("explicit-repo")
    shutil.copytree(Path(REPOSITORY) / "simple", root / "simple")
    run_applications({"repository": str(root), "model_control_mode": "explicit", "startup_models": ["simple"]},
                     name="explicit", route_prefix="/explicit")
    url = f"{serve_instance}/explicit"
    wait_ready(url)
    yield url, root
    delete_server("explicit")


def test_a_folder_with_only_a_model_file_serves_from_the_start_with_its_completed_config(started):
    url, path = started
    assert_completed_config(url, "bare_cnn")
    assert_serves_like_onnx_runtime(url, "bare_cnn", path)
    metadata = requests.get(f"{url}/v2/models/bare_cnn", timeout=30).json()
    assert metadata["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 3, 224, 224]}]
    r = requests.post(f"{url}/v2/models/bare_cnn/infer", json=cnn_body(np.zeros((5, 3, 224, 224), np.float32)),
                      timeout=60)
    assert r.status_code == 400 and "batch-size must be <= 4" in r.json()["error"], r.text


def test_a_folder_with_only_a_model_file_added_after_start_loads_in_explicit_mode_and_serves(explicit):
    url, root = explicit
    path = bare_model(root, "late_cnn")
    r = requests.post(f"{url}/v2/repository/models/late_cnn/load", timeout=120)
    assert r.status_code == 200, r.text
    assert_completed_config(url, "late_cnn")
    assert_serves_like_onnx_runtime(url, "late_cnn", path)
