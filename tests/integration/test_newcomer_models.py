"""A newcomer's own ONNX models (folders with only ``1/model.onnx``, ``tests/newcomer_models.py``)
on a real server, over HTTP and gRPC: one explicit-control application whose pool serves
``nc_div`` (INT32 ``Div``: the server's own zeros divide by zero), ``nc_reshape`` (a
``Reshape`` the measuring batch does not divide) and ``nc_scalar`` (rank-0 ``Y = X * 2``) from the
start; broken model files are written after the start and loaded through the repository API.

Each answer is checked against ONNX Runtime's on the same file."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.newcomer_models import write_model

from .conftest import _free_port, wait_ready

pytestmark = pytest.mark.integration

PREFIX = "/newcomer"
GRPC_PORT = _free_port()
A = np.arange(1, 9, dtype=np.int32).reshape(2, 4) * 7
B = np.array([[1, 2, 3, 4], [5, 6, 7, 8]], np.int32)
STARTED = ["nc_div", "nc_reshape", "nc_scalar"]


@pytest.fixture(scope="module")
def newcomer(serve_instance, tmp_path_factory):
    """(base URL, repository root) of the application; gRPC on ``GRPC_PORT``."""
    from deployments.app import delete_server, run_applications

    root = tmp_path_factory.mktemp("newcomer-repo")
    for name in STARTED:
        write_model(root, name)
    run_applications({"repository": str(root), "model_control_mode": "explicit", "startup_models": STARTED,
                      "grpc_port": GRPC_PORT}, name="newcomer", route_prefix=PREFIX)
    url = f"{serve_instance}{PREFIX}"
    wait_ready(url)
    yield url, root
    delete_server("newcomer")


def ort_run(path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


def tensor(name: str, x: np.ndarray, datatype: str) -> dict:
    return {"name": name, "shape": list(x.shape), "datatype": datatype, "data": x.ravel().tolist()}


def infer(url: str, model: str, inputs: list[dict]) -> requests.Response:
    return requests.post(f"{url}/v2/models/{model}/infer", json={"inputs": inputs}, timeout=120)


def test_models_that_refuse_the_measuring_zeros_serve_and_say_why_their_footprint_is_predicted(newcomer):
    """Seen: every request answered 500 "ONNX Runtime run failed in its Div node" (the pool's
    measuring run on zeros divided by zero) and the pool loaded the model again at each, while
    ``/v2/models/nc_div/ready`` said ready."""
    url, root = newcomer
    expected = ort_run(root / "nc_div" / "1" / "model.onnx", {"A": A, "B": B})[0]
    for _ in range(2):
        r = infer(url, "nc_div", [tensor("A", A, "INT32"), tensor("B", B, "INT32")])
        assert r.status_code == 200, r.text
        assert r.json()["outputs"][0]["data"] == expected.ravel().tolist()
    x = np.arange(24, dtype=np.float32).reshape(6, 4)
    r = infer(url, "nc_reshape", [tensor("X", x, "FP32")])
    assert r.status_code == 200, r.text
    [y] = ort_run(root / "nc_reshape" / "1" / "model.onnx", {"X": x})
    assert (r.json()["outputs"][0]["shape"], r.json()["outputs"][0]["data"]) == (list(y.shape), y.ravel().tolist())
    with grpcclient.InferenceServerClient(f"127.0.0.1:{GRPC_PORT}") as client:
        inputs = [grpcclient.InferInput(n, [2, 4], "INT32") for n in "AB"]
        inputs[0].set_data_from_numpy(A)
        inputs[1].set_data_from_numpy(B)
        np.testing.assert_array_equal(client.infer("nc_div", inputs).as_numpy("C"), expected)
        assert client.is_model_ready("nc_div")
    assert requests.get(f"{url}/v2/models/nc_div/ready", timeout=30).status_code == 200
    pool = requests.get(f"{url}/v2/memory", timeout=60).json()["pool"]["models"]["nc_div"]
    assert (pool["state"], pool["loads"], pool["footprint_source"]) == ("ready", 1, "predicted")
    assert pool["footprint_detail"].startswith("the measuring run on zeros at the max profile failed (model 'nc_div': "
                                               "ONNX Runtime run failed in its Div node 'div' (Fail)")


def test_a_rank_0_output_answers_shape_empty_over_http_json_binary_and_grpc(newcomer):
    """Seen: ``"shape": [1]`` for a model whose metadata and ONNX Runtime say ``[]``."""
    url, root = newcomer
    [expected] = ort_run(root / "nc_scalar" / "1" / "model.onnx", {"X": np.array(3.5, np.float32)})
    assert expected.shape == ()
    metadata = requests.get(f"{url}/v2/models/nc_scalar", timeout=30).json()
    assert metadata["outputs"] == [{"name": "Y", "datatype": "FP32", "shape": []}]
    for data in (3.5, [3.5]):
        r = infer(url, "nc_scalar", [{"name": "X", "shape": [], "datatype": "FP32", "data": data}])
        assert r.status_code == 200, r.text
        assert r.json()["outputs"] == [{"name": "Y", "datatype": "FP32", "shape": [], "data": [7.0]}]
    with httpclient.InferenceServerClient(url.removeprefix("http://")) as client:
        x = httpclient.InferInput("X", [], "FP32")
        x.set_data_from_numpy(np.array(3.5, np.float32), binary_data=True)
        result = client.infer("nc_scalar", [x], outputs=[httpclient.InferRequestedOutput("Y", binary_data=True)])
        assert result.get_output("Y")["shape"] == [] and result.as_numpy("Y").tolist() == 7.0
    with grpcclient.InferenceServerClient(f"127.0.0.1:{GRPC_PORT}") as client:
        x = grpcclient.InferInput("X", [], "FP32")
        x.set_data_from_numpy(np.array(3.5, np.float32))
        result = client.infer("nc_scalar", [x])
        assert list(result.get_output("Y").shape) == [] and result.as_numpy("Y").shape == ()


@pytest.mark.parametrize("name, message", [
    ("nc_garbage", "model 'nc_garbage': its model file nc_garbage/1/model.onnx is not a valid ONNX model: it does not "
                   "parse as one (damaged, truncated or another format)"),
    ("nc_empty", "model 'nc_empty': its model file nc_empty/1/model.onnx is empty, not an ONNX model"),
    ("nc_custom_op", "model 'nc_custom_op': its model file nc_custom_op/1/model.onnx uses operator 'Frobnicate' of "
                     "domain 'com.example', which ONNX Runtime does not implement"),
    ("nc_no_inputs", "model 'nc_no_inputs': its model file nc_no_inputs/1/model.onnx has no inputs"),
])
def test_loading_a_model_file_the_server_cannot_serve_is_400_naming_the_file_over_http_and_grpc(newcomer, name,
                                                                                                 message):
    """Seen: random bytes answered 500 ".../config.yaml: max_batch_size, inputs, outputs: left
    out, and ..." (no config.yaml there), gRPC INTERNAL; a custom-domain op 500 "could not read
    its model file"; no inputs 400 naming the config.yaml."""
    url, root = newcomer
    write_model(root, name)
    r = requests.post(f"{url}/v2/repository/models/{name}/load", timeout=120)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"] and "config.yaml" not in r.json()["error"], r.text
    with grpcclient.InferenceServerClient(f"127.0.0.1:{GRPC_PORT}") as client:
        with pytest.raises(Exception) as raised:
            client.load_model(name)
        assert raised.value.status() == "StatusCode.INVALID_ARGUMENT" and message in raised.value.message()
        assert not client.is_model_ready(name)
    assert requests.get(f"{url}/v2/models/{name}/ready", timeout=30).status_code != 200
    assert infer(url, "nc_div", [tensor("A", A, "INT32"), tensor("B", B, "INT32")]).status_code == 200
    shutil.rmtree(root / name)


def test_a_model_loaded_after_the_start_that_refuses_the_zeros_loads(newcomer):
    """Seen: ``POST .../load`` of the Div model answered 500 (its measuring run failed)."""
    url, root = newcomer
    shutil.copytree(root / "nc_div", root / "nc_div_late")
    r = requests.post(f"{url}/v2/repository/models/nc_div_late/load", timeout=120)
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 60
    while requests.get(f"{url}/v2/models/nc_div_late/ready", timeout=30).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    r = infer(url, "nc_div_late", [tensor("A", A, "INT32"), tensor("B", B, "INT32")])
    assert r.status_code == 200 and r.json()["outputs"][0]["data"] == (A // B).ravel().tolist(), r.text
