"""A Triton model repository served as it is: folders with a ``config.pbtxt`` beside
``1/model.onnx`` and no ``config.yaml``, over real HTTP (JSON and tritonclient's binary).

An application ("triton", under /triton) serves a temporary repository of two generated models:
``densenet_like``, Triton's quickstart densenet_onnx config in small (``max_batch_size: 0``,
input dims [3, 8, 8] reshaped to the file's [1, 3, 8, 8], output the file's [1, 10, 1, 1]
answered as [10]), a pool model; and ``simple_batched``, Triton's ``simple`` with
``max_batch_size: 8`` and ``dynamic_batching`` (a 500 ms window), which makes it a dedicated
model that batches.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import requests
from onnx import TensorProto, helper, numpy_helper

from ..unit.test_triton_pbtxt import DENSENET_PBTXT
from .conftest import application, deployment_calls, send_together

pytestmark = pytest.mark.integration

# Triton's densenet_onnx config in small: [3, 8, 8] reshaped to [1, 3, 8, 8], 10 classes.
DENSENET_LIKE = (DENSENET_PBTXT.replace("densenet_onnx", "densenet_like").replace("3, 224, 224", "3, 8, 8")
                 .replace("1000", "10"))

SIMPLE_BATCHED = """\
name: "simple_batched"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [
  { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
  { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
  { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
]
dynamic_batching { max_queue_delay_microseconds: 500000 }
instance_group [ { count: 1 kind: KIND_CPU } ]
"""


def _save(graph, path: Path) -> None:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True)
    onnx.save(model, path)


def densenet_like(path: Path) -> None:
    """``data_0`` FP32 [1, 3, 8, 8] -> a 3x3 convolution to 10 channels, ReLU, global average
    pool -> ``fc6_1`` FP32 [1, 10, 1, 1] (seeded weights)."""
    rng = np.random.default_rng(3)
    weights = [numpy_helper.from_array(rng.standard_normal((10, 3, 3, 3)).astype(np.float32), "w"),
               numpy_helper.from_array(rng.standard_normal(10).astype(np.float32), "b")]
    _save(helper.make_graph(
        [helper.make_node("Conv", ["data_0", "w", "b"], ["conv"], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["conv"], ["relu"]),
         helper.make_node("GlobalAveragePool", ["relu"], ["fc6_1"])], "densenet_like",
        [helper.make_tensor_value_info("data_0", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("fc6_1", TensorProto.FLOAT, [1, 10, 1, 1])], weights), path)


def simple_batched(path: Path) -> None:
    """Triton's ``simple``: INT32 INPUT0, INPUT1 [N, 16] -> OUTPUT0 = sum, OUTPUT1 = difference."""
    _save(helper.make_graph(
        [helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
         helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"])], "simple",
        [helper.make_tensor_value_info(n, TensorProto.INT32, ["N", 16]) for n in ("INPUT0", "INPUT1")],
        [helper.make_tensor_value_info(n, TensorProto.INT32, ["N", 16]) for n in ("OUTPUT0", "OUTPUT1")]), path)


@pytest.fixture(scope="module")
def triton_repository(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("triton-repo")
    for name, make, pbtxt in (("densenet_like", densenet_like, DENSENET_LIKE),
                              ("simple_batched", simple_batched, SIMPLE_BATCHED)):
        make(root / name / "1" / "model.onnx")
        (root / name / "config.pbtxt").write_text(pbtxt)
    return root


@pytest.fixture(scope="module")
def triton_server(serve_instance, triton_repository):
    with application(serve_instance, {"repository": str(triton_repository)}, "triton") as url:
        yield url


@pytest.fixture(scope="module")
def batch_counters(triton_server):
    """The dedicated model's batch counters (``ModelDeployment.batching``)."""
    with deployment_calls() as call:
        yield lambda: call("triton.simple_batched", "model-simple_batched", "batching")


def densenet_reference(repository: Path, x: np.ndarray) -> np.ndarray:
    """ONNX Runtime's answer for the client's [3, 8, 8], run as the file's [1, 3, 8, 8], as [10]."""
    session = ort.InferenceSession(str(repository / "densenet_like/1/model.onnx"), providers=["CPUExecutionProvider"])
    return session.run(None, {"data_0": x.reshape(1, 3, 8, 8)})[0].reshape(10)


def test_densenet_like_answers_json_in_the_configs_dims_with_onnxruntimes_values(triton_server, triton_repository):
    x = np.random.default_rng(5).standard_normal((3, 8, 8)).astype(np.float32)
    body = {"inputs": [{"name": "data_0", "shape": [3, 8, 8], "datatype": "FP32", "data": x.ravel().tolist()}]}
    response = requests.post(f"{triton_server}/v2/models/densenet_like/infer", json=body, timeout=120)
    assert response.status_code == 200, response.text
    (out,) = response.json()["outputs"]
    assert (out["name"], out["shape"], out["datatype"]) == ("fc6_1", [10], "FP32")
    np.testing.assert_allclose(np.array(out["data"], np.float32), densenet_reference(triton_repository, x),
                               rtol=1e-5, atol=1e-6)
    # the file's own shape is not the client's: 400 naming the input and its dims
    body["inputs"][0]["shape"] = [1, 3, 8, 8]
    refused = requests.post(f"{triton_server}/v2/models/densenet_like/infer", json=body, timeout=120)
    assert refused.status_code == 400
    assert "input 'data_0': expected rank 3 (dims [3, 8, 8]), got shape [1, 3, 8, 8]" in refused.json()["error"]


def test_densenet_like_answers_tritonclient_binary_and_its_config_parses(triton_server, triton_repository):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(triton_server.removeprefix("http://"), network_timeout=120)
    x = np.random.default_rng(6).standard_normal((3, 8, 8)).astype(np.float32)
    tensor = httpclient.InferInput("data_0", [3, 8, 8], "FP32")
    tensor.set_data_from_numpy(x, binary_data=True)
    result = client.infer("densenet_like", [tensor], outputs=[httpclient.InferRequestedOutput("fc6_1", binary_data=True)])
    got = result.as_numpy("fc6_1")
    assert got.shape == (10,)
    np.testing.assert_allclose(got, densenet_reference(triton_repository, x), rtol=1e-5, atol=1e-6)
    config = client.get_model_config("densenet_like")
    assert config["max_batch_size"] == 0 and config["platform"] == "onnxruntime_onnx"
    assert config["input"][0]["dims"] == [3, 8, 8] and config["input"][0]["reshape"] == {"shape": [1, 3, 8, 8]}
    assert config["output"][0]["dims"] == [10] and config["output"][0]["reshape"] == {"shape": [1, 10, 1, 1]}


def post_simple(url: str, request_id: str, a: np.ndarray, b: np.ndarray) -> requests.Response:
    body = {"id": request_id, "inputs": [
        {"name": n, "shape": list(v.shape), "datatype": "INT32", "data": v.ravel().tolist()}
        for n, v in (("INPUT0", a), ("INPUT1", b))]}
    return requests.post(f"{url}/v2/models/simple_batched/infer", json=body, timeout=120)


def test_simple_batched_joins_concurrent_requests_and_each_gets_its_own_rows(triton_server, batch_counters):
    rng = np.random.default_rng(7)
    pairs = [(rng.integers(-100, 100, (rows, 16), dtype=np.int32), rng.integers(-100, 100, (rows, 16), dtype=np.int32))
             for rows in (1, 2, 1, 3, 1)]
    calls = [lambda i=i, a=a, b=b: post_simple(triton_server, f"s-{i}", a, b) for i, (a, b) in enumerate(pairs)]
    config = requests.get(f"{triton_server}/v2/models/simple_batched/config", timeout=30).json()
    assert config["max_batch_size"] == 8 and config["input"][0]["dims"] == [16]
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 500000
    # Requests that arrive while the replica is busy join; on a loaded machine one round's requests
    # can arrive apart, so up to five rounds are sent (each checked) until one joins.
    for _ in range(5):
        before = batch_counters()
        responses = send_together(calls)
        for i, ((a, b), response) in enumerate(zip(pairs, responses)):
            assert response.status_code == 200, response.text
            body = response.json()
            assert body["id"] == f"s-{i}"
            outputs = {o["name"]: np.array(o["data"], np.int32).reshape(o["shape"]) for o in body["outputs"]}
            np.testing.assert_array_equal(outputs["OUTPUT0"], a + b)
            np.testing.assert_array_equal(outputs["OUTPUT1"], a - b)
        after = batch_counters()
        assert after["enabled"] and after["requests"] - before["requests"] == len(pairs)
        if after["max_requests"] > 1:
            break
    assert after["max_requests"] > 1 and after["max_rows"] <= 8
    nine = np.zeros((9, 16), np.int32)
    refused = post_simple(triton_server, "s-9", nine, nine)
    assert refused.status_code == 400
    assert refused.json()["error"].startswith("inference request batch-size must be <= 8 for 'simple_batched'")
