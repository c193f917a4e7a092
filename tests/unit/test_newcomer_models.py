"""Model folders as a newcomer brings them (``tests/newcomer_models.py``: only ``1/model.onnx``)
through the engine layer and the protocol edge, with real ONNX Runtime:

- the server's own runs on zeros (the pool's measuring runs, a dedicated replica's warming of
  batch shapes) never fail a load: the graph prediction stands in for the footprint and the
  reason is kept; a ``warmup:`` the user wrote that fails is a 400 naming it;
- a rank-0 output keeps shape ``[]``; a rank-0 input is taken as a bare JSON number too;
- a model file that is not ONNX, uses an operator ONNX Runtime does not have, or has no inputs
  is ``InvalidModelFile`` (400) naming the file and what is wrong, never a ``config.yaml`` that
  does not exist.

Over HTTP and gRPC on a running server: ``tests/integration/test_newcomer_models.py``."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import yaml

from deployments.control import outcome
from deployments.protocol.binary import decode_body, encode_response
from deployments.protocol.errors import error_status
from deployments.protocol.v2 import decode_infer_request, encode_infer_response
from deployments.runtime.backends.onnxruntime import session_error
from deployments.runtime.contract.config import CacheOptions
from deployments.runtime.contract.errors import ConfigError, InvalidModelFile
from deployments.runtime.contract.repository import ModelRepository
from deployments.runtime.residency import footprints
from deployments.runtime.residency.cache import ModelCache
from deployments.runtime.residency.host import ModelHost
from deployments.runtime.tools import plan
from tests.newcomer_models import BROKEN, write_model

A = np.arange(1, 9, dtype=np.int32).reshape(2, 4) * 7
B = np.array([[1, 2, 3, 4], [5, 6, 7, 8]], np.int32)


def ort_run(path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


def cache_of(root: Path, name: str) -> ModelCache:
    return ModelCache(ModelRepository(root, [name]), [name], CacheOptions(load_policy="lazy"), backend="onnxruntime")


# --- A: the server's own runs on zeros never fail a load ----------------------------------------

@pytest.mark.parametrize("name, feeds, detail", [
    ("nc_div", {"A": A, "B": B}, "ONNX Runtime run failed in its Div node 'div' (Fail)"),
    ("nc_reshape", {"X": np.arange(24, dtype=np.float32).reshape(6, 4)},
     "ONNX Runtime run failed in its Reshape node 'reshape' (Fail)"),
], ids=["integer-div-by-zero", "reshape-the-batch-does-not-divide"])
def test_a_model_that_refuses_the_measuring_zeros_loads_once_on_the_graph_prediction(tmp_path, name, feeds, detail):
    """Seen: the pool's measuring run on zeros divided by zero (Div) or reshaped a batch of
    1,024 rows into 3 (Reshape): every request answered 500 "ONNX Runtime run failed in its Div
    node", and the pool loaded and unloaded the model again at each."""
    path = write_model(tmp_path, name)
    cache = cache_of(tmp_path, name)
    try:
        for _ in range(2):
            answer = cache.infer(name, feeds)
            for got, expected in zip(answer.values(), ort_run(path, feeds)):
                np.testing.assert_array_equal(got, expected)
        status = cache.status()["models"][name]
        assert (status["state"], status["loads"], status["footprint_source"]) == ("ready", 1, "predicted")
        assert status["footprint_detail"] == (
            f"the measuring run on zeros at the max profile failed (model '{name}': {detail}; the server log has "
            "the runtime's message); the graph prediction stands in for its context bytes")
    finally:
        cache.close()


def test_a_model_that_refuses_the_measuring_zeros_and_is_predicted_over_the_budget_is_refused_once(tmp_path):
    """Its footprint stays the prediction (it cannot be measured), over the budget: the load
    measured it in the room free, found no room, unloaded it and loaded it again, forever (the
    request's thread never came back). Now it is refused naming the prediction and the budget."""
    import threading

    from deployments.runtime.contract.errors import OverBudget
    from deployments.runtime.residency.predict import predict

    write_model(tmp_path, "nc_div")
    repo = ModelRepository(tmp_path, ["nc_div"])
    predicted = predict(repo.get("nc_div")).footprint().total(repo.get("nc_div").config.instances)
    cache = ModelCache(repo, ["nc_div"], CacheOptions(load_policy="lru", memory_budget_mib=predicted / 2 / 2**20),
                       backend="onnxruntime")
    outcome_of: list[BaseException] = []

    def request() -> None:
        try:
            cache.infer("nc_div", {"A": A, "B": B})
        except BaseException as e:  # what the request's caller gets
            outcome_of.append(e)

    try:
        thread = threading.Thread(target=request, daemon=True)
        thread.start()
        thread.join(60)
        assert not thread.is_alive(), "the load is still going round"
        [error] = outcome_of
        assert isinstance(error, OverBudget) and "predicted" in error.message and "memory budget" in error.message, error
        assert cache.status()["models"]["nc_div"]["state"] == "absent"
    finally:
        cache.close()


def test_a_warmup_the_config_asks_for_that_fails_is_400_naming_the_warmup(tmp_path):
    write_model(tmp_path, "nc_div")
    (tmp_path / "nc_div" / "config.yaml").write_text(yaml.safe_dump({"warmup": {"batch_sizes": [1], "data": "zeros"}}))
    with pytest.raises(ConfigError) as raised:
        ModelHost(ModelRepository(tmp_path).get("nc_div"), "onnxruntime").load()
    assert raised.value.message == (
        f"{tmp_path / 'nc_div' / 'config.yaml'}: warmup: a warm-up run the model's config asks for failed: model "
        "'nc_div': ONNX Runtime run failed in its Div node 'div' (Fail); the server log has the runtime's message; "
        "change or remove its warmup section")
    assert error_status(outcome(raised.value, False)["error"])[0] == 400


def test_warming_batch_shapes_on_zeros_the_model_refuses_is_skipped_and_logged(tmp_path, caplog):
    """A dedicated replica warms the shapes its batches run at (``ModelHost.warm``): no request
    asked for them, so a refusal skips the shape instead of failing the load."""
    write_model(tmp_path, "nc_div")
    host = ModelHost(ModelRepository(tmp_path).get("nc_div"), "onnxruntime").load()
    with caplog.at_level(logging.WARNING, logger="deployments.runtime.residency.host"):
        host.warm([1, 4])
    logged = [r.getMessage() for r in caplog.records if r.name == "deployments.runtime.residency.host"]
    assert [m.split(" failed (")[0] for m in logged] == [
        "model 'nc_div': warming shape (('A', (1, 4)), ('B', (1, 4))) on zeros",
        "model 'nc_div': warming shape (('A', (4, 4)), ('B', (4, 4))) on zeros"]
    np.testing.assert_array_equal(host.infer({"A": A, "B": B})["C"], A // B)


def test_plan_measure_says_the_measuring_run_failed_and_writes_nothing(tmp_path, capsys):
    """``plan measure`` was asked for a measurement: it says why there is none (exit 1)."""
    write_model(tmp_path, "nc_div")
    assert plan.main(["measure", "nc_div", "--root", str(tmp_path), "--write"]) == 1
    assert "nc_div (onnxruntime): not measured: the measuring run on zeros at the max profile failed (model " \
           "'nc_div': ONNX Runtime run failed in its Div node 'div'" in capsys.readouterr().err
    assert not (tmp_path / "nc_div" / "1" / footprints.RECORD_FILENAME).exists()


# --- B: rank-0 tensors -------------------------------------------------------------------------

def test_a_rank_0_output_keeps_shape_empty_through_the_engine_and_both_encodings(tmp_path):
    """Seen: ``Y = X * 2`` with X and Y of shape ``[]`` answered ``"shape": [1]`` over HTTP
    JSON, HTTP binary and gRPC (``np.ascontiguousarray`` makes rank 0 rank 1)."""
    path = write_model(tmp_path, "nc_scalar")
    host = ModelHost(ModelRepository(tmp_path).get("nc_scalar"), "onnxruntime").load()
    [expected] = ort_run(path, {"X": np.array(3.5, np.float32)})
    for data in (3.5, [3.5]):  # a bare number or a one-element list
        request = decode_infer_request({"inputs": [{"name": "X", "shape": [], "datatype": "FP32", "data": data}]})
        assert request.inputs["X"].shape == ()
        outputs = host.infer(request.inputs)
        assert outputs["Y"].shape == expected.shape == ()
        body = json.loads(encode_infer_response("nc_scalar", "1", None, outputs))
        assert body["outputs"] == [{"name": "Y", "datatype": "FP32", "shape": [], "data": [7.0]}]
    head = json.dumps({"inputs": [{"name": "X", "shape": [], "datatype": "FP32", "parameters": {"binary_data_size": 4}}],
                       "parameters": {"binary_data_output": True}}).encode()
    binary_request = decode_body([head, np.float32(3.5).tobytes()], str(len(head)))
    assert binary_request.inputs["X"].shape == ()
    content, headers = encode_response("nc_scalar", "1", binary_request, host.infer(binary_request.inputs))
    length = int({k.lower(): v for k, v in headers.items()}["inference-header-content-length"])
    assert json.loads(content[:length])["outputs"][0]["shape"] == []
    assert np.frombuffer(content[length:], "<f4").tolist() == [7.0]


# --- C: a model file that is not one the server can serve --------------------------------------

@pytest.mark.parametrize("name, message", [
    ("nc_garbage", "model 'nc_garbage': its model file nc_garbage/1/model.onnx is not a valid ONNX model: it does not "
                   "parse as one (damaged, truncated or another format)"),
    ("nc_empty", "model 'nc_empty': its model file nc_empty/1/model.onnx is empty, not an ONNX model"),
    ("nc_truncated", "model 'nc_truncated': its model file nc_truncated/1/model.onnx is not a valid ONNX model: it "
                     "does not parse as one (damaged, truncated or another format)"),
    ("nc_custom_op", "model 'nc_custom_op': its model file nc_custom_op/1/model.onnx uses operator 'Frobnicate' of "
                     "domain 'com.example', which ONNX Runtime does not implement (custom operators and domains are "
                     "not supported); export the model with standard ONNX operators"),
    ("nc_no_inputs", "model 'nc_no_inputs': its model file nc_no_inputs/1/model.onnx has no inputs (its graph's "
                     "inputs are all initializers or none): a served model takes at least one input and gives at "
                     "least one output"),
])
def test_a_model_file_the_server_cannot_serve_is_400_naming_the_file_and_no_config_yaml(tmp_path, name, message):
    """Seen: random bytes answered 500 ".../config.yaml: max_batch_size, inputs, outputs: left
    out, and ..." naming a config.yaml that does not exist; a custom-domain op 500 "could not
    read its model file ... damaged or not an ONNX model"; no inputs 400 naming config.yaml."""
    write_model(tmp_path, name)
    with pytest.raises(InvalidModelFile) as raised:
        ModelRepository(tmp_path, [name])
    assert raised.value.message == message
    assert error_status(raised.value) == (400, message)  # on a request's path (a lazy load) too
    assert error_status(outcome(raised.value, False)["error"]) == (400, message)  # a load through the API


def test_onnx_runtime_refusing_an_operator_names_it_and_its_domain(tmp_path):
    """Where the graph check does not see it (a config listing the tensors skips no check, but a
    file replaced after the read does), ONNX Runtime's own refusal is read for the op."""
    path = write_model(tmp_path, "nc_custom_op")
    with pytest.raises(Exception) as raised:
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    error = session_error("nc_custom_op", path, raised.value)
    assert (type(error), error.message) == (InvalidModelFile, (
        "model 'nc_custom_op': its model file nc_custom_op/1/model.onnx uses operator 'Frobnicate' of domain "
        "'com.example', which ONNX Runtime does not implement (custom operators and domains are not supported); "
        "export the model with standard ONNX operators"))
    path.write_bytes(BROKEN["nc_garbage"]())
    with pytest.raises(Exception) as raised:
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    error = session_error("nc_custom_op", path, raised.value)
    assert type(error) is InvalidModelFile and error.message.startswith(
        "model 'nc_custom_op': its model file nc_custom_op/1/model.onnx is not a valid ONNX model: ONNX Runtime "
        "could not parse it (")


# --- readiness never says ready for a model whose every load fails ------------------------------

def test_the_cache_keeps_why_a_load_failed_until_one_succeeds(tmp_path):
    path = write_model(tmp_path, "nc_div")
    good = path.read_bytes()
    cache = cache_of(tmp_path, "nc_div")
    try:
        path.write_bytes(b"")  # emptied after the folder was read: every load fails alike
        with pytest.raises(InvalidModelFile) as raised:
            cache.infer("nc_div", {"A": A, "B": B})
        assert cache.status()["models"]["nc_div"]["load_error"] == raised.value.message
        path.write_bytes(good)
        np.testing.assert_array_equal(cache.infer("nc_div", {"A": A, "B": B})["C"], A // B)
        assert cache.status()["models"]["nc_div"]["load_error"] == ""
    finally:
        cache.close()


def test_a_pool_model_whose_last_load_failed_is_not_ready(model_repository, monkeypatch):
    """Seen: ``/v2/models/nc_div/ready`` said ready while every request's load failed."""
    from tests.unit.test_router_routes import FakeModelClient, make_router

    async def pool_states(self):
        return {name: {"state": "absent", "evictions": 0, "backend": "onnxruntime",
                       "load_error": "model 'tiny_cnn': its model file tiny_cnn/1/model.onnx is empty, not an ONNX "
                                     "model" if name == "tiny_cnn" else ""} for name in self.pool_models}

    monkeypatch.setattr(FakeModelClient, "pool_states", pool_states)
    router, _ = make_router(model_repository)
    r = router.get("/v2/models/tiny_cnn/ready")
    assert (r.status_code, r.json()) == (503, {"error": (
        "model 'tiny_cnn' is not ready: its last load failed: model 'tiny_cnn': its model file tiny_cnn/1/model.onnx "
        "is empty, not an ONNX model; the next request tries again")})
    assert router.get("/v2/models/mid_cnn/ready").status_code == 200


def test_under_placement_a_pool_models_readiness_reads_every_replicas_report(model_repository, monkeypatch):
    """With ``placement: bytes`` the ready route reads ``load_error`` across the pool (the
    placement's ``pool_cache``, as the repository index does), not from whichever pool replica
    answers: here the replica asked knows of no failure, another one's report does."""
    from tests.unit.test_router_routes import FakeModelClient, make_router

    error = "model 'tiny_cnn': its model file tiny_cnn/1/model.onnx is empty, not an ONNX model"

    async def pool_states(self):
        return {name: {"state": "absent", "evictions": 0, "backend": "onnxruntime", "load_error": ""}
                for name in self.pool_models}

    async def placement_decision(self):
        return {"replicas": ["r1", "r2"], "cache": {
            "tiny_cnn": {"state": "absent", "evictions": 0, "resident": [], "loading": [], "load_error": error}}}

    monkeypatch.setattr(FakeModelClient, "pool_states", pool_states)
    monkeypatch.setattr(FakeModelClient, "placement_decision", placement_decision, raising=False)
    monkeypatch.setattr(FakeModelClient, "placement", object(), raising=False)
    router, _ = make_router(model_repository)
    for _ in range(3):
        r = router.get("/v2/models/tiny_cnn/ready")
        assert (r.status_code, r.json()) == (503, {"error": (
            f"model 'tiny_cnn' is not ready: its last load failed: {error}; the next request tries again")})
    assert router.get("/v2/models/mid_cnn/ready").status_code == 200
