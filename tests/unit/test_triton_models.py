"""Triton's quickstart models (simple, simple_string, simple_identity): generated graphs, BYTES
through ONNX Runtime, footprints measured at the max profile, Triton's error wording."""

from __future__ import annotations

import hashlib

import numpy as np
import onnxruntime as ort
import pytest

from deployments.protocol.errors import error_status
from deployments.runtime.contract.errors import InvalidInput, ModelNotFound
from deployments.runtime.contract.repository import ModelRepository
from deployments.runtime.contract.validation import validate_inputs, validate_outputs
from deployments.runtime.residency import footprints
from deployments.runtime.residency.host import ModelHost
from deployments.runtime.tools import prepare as prep

TRITON_MODELS = ["simple", "simple_string", "simple_identity"]
ROW = np.arange(16, dtype=np.int32)


def text(values) -> np.ndarray:
    """Integers -> an object array of their decimal UTF-8 bytes (as tritonclient builds BYTES)."""
    array = np.asarray(values)
    return np.array([str(v).encode() for v in array.reshape(-1)], dtype=object).reshape(array.shape)


@pytest.fixture(scope="module")
def repo(prepared_engines) -> ModelRepository:
    return ModelRepository(prepared_engines, TRITON_MODELS)


@pytest.fixture(scope="module")
def hosts(repo):
    loaded = {name: ModelHost(repo.get(name), backend="onnxruntime").load() for name in TRITON_MODELS}
    yield loaded
    for host in loaded.values():
        host.unload()


@pytest.mark.parametrize("name", TRITON_MODELS)
def test_generation_is_deterministic_and_matches_pinned_hash(name):
    data = prep.generated_model_bytes(name)
    assert data == prep.generated_model_bytes(name)
    assert hashlib.sha256(data).hexdigest() == prep.GENERATED_SHA256[name]


def test_simple_returns_sum_and_difference_at_batch_1_and_8():
    session = ort.InferenceSession(prep.generated_model_bytes("simple"), providers=["CPUExecutionProvider"])
    for batch in (1, 8):
        a = np.tile(ROW, (batch, 1))
        b = np.full((batch, 16), -1, np.int32) * np.arange(1, batch + 1, dtype=np.int32)[:, None]
        total, difference = session.run(["OUTPUT0", "OUTPUT1"], {"INPUT0": a, "INPUT1": b})
        assert total.dtype == difference.dtype == np.int32
        np.testing.assert_array_equal(total, a + b)
        np.testing.assert_array_equal(difference, a - b)


def test_simple_string_adds_decimal_strings_and_answers_bytes(hosts):
    a, b = np.tile(ROW, (2, 1)), np.array([[1] * 16, [-40] * 16])
    out = hosts["simple_string"].infer({"INPUT0": text(a), "INPUT1": text(b)})
    assert out["OUTPUT0"].dtype == object and out["OUTPUT0"].shape == (2, 16)
    np.testing.assert_array_equal(out["OUTPUT0"], text(a + b))
    np.testing.assert_array_equal(out["OUTPUT1"], text(a - b))


def test_simple_identity_returns_the_same_bytes_nul_and_non_ascii_included(hosts):
    items = np.array([b"he\x00llo", b"\x00\x01\x02\x03", "h\u00e9llo \u4e16".encode(), b""] * 4,
                     dtype=object).reshape(1, 16)
    out = hosts["simple_identity"].infer({"INPUT0": items})["OUTPUT0"]
    assert out.shape == (1, 16) and all(type(x) is bytes for x in out.reshape(-1))
    np.testing.assert_array_equal(out, items)
    fixed = np.array([[b"\x00\x01\x02\x03"] * 16], dtype=np.bytes_)  # numpy S4, as one example sends
    np.testing.assert_array_equal(hosts["simple_identity"].infer({"INPUT0": fixed})["OUTPUT0"], fixed.astype(object))


def test_bytes_that_are_not_utf8_are_400_naming_input_element_and_byte(hosts):
    items = np.array([b"ok"] * 16, dtype=object).reshape(1, 16)
    items[0, 5] = b"a\xffb"
    with pytest.raises(InvalidInput) as info:
        hosts["simple_identity"].infer({"INPUT0": items})
    assert error_status(info.value)[0] == 400
    assert "input 'INPUT0': element 5 is not valid UTF-8 (byte 1 is 0xff)" in info.value.message


@pytest.mark.parametrize("name", TRITON_MODELS)
def test_footprint_is_measured_at_the_max_profile_with_int32_and_bytes_inputs(repo, name):
    host = ModelHost(repo.get(name), backend="onnxruntime")
    try:
        footprint = footprints.load_and_measure(host)
        assert footprint.measured and footprint.engine_bytes >= 0 and footprint.context_bytes >= 0
        assert footprints.measure_batch_of(host.config) == 8  # 8 x 16 elements: the full max batch
    finally:
        host.unload()


# --- Triton's wording first, our detail after it --------------------------------------------


def test_unknown_model_and_version_start_with_tritons_words(repo):
    with pytest.raises(ModelNotFound) as info:
        repo.get("wrong_model_name")
    assert info.value.message.startswith("Request for unknown model: 'wrong_model_name' is not found; ")
    assert "available models: ['simple', 'simple_identity', 'simple_string']" in info.value.message
    with pytest.raises(ModelNotFound) as info:
        repo.get("simple", "7")
    assert info.value.message.startswith("Request for unknown model: 'simple' version 7 is not found; ")
    assert "versions: [1]" in info.value.message


def ints(shape=(1, 16), dtype=np.int32) -> np.ndarray:
    return np.zeros(shape, dtype)


@pytest.mark.parametrize("inputs, triton, ours", [
    ({"INPUT0": ints(), "INPUT1": ints(), "INPUT9": ints()},
     "unexpected inference input 'INPUT9' for model 'simple'", "unknown ['INPUT9']"),
    ({"INPUT0": ints()},
     "expected 2 inputs but got 1 inputs for model 'simple'. Got input(s) ['INPUT0'], but missing required "
     "input(s) ['INPUT1']", "missing ['INPUT1']"),
    ({"INPUT0": ints(dtype=np.float32), "INPUT1": ints()},
     "inference input 'INPUT0' data-type is 'FP32', but model 'simple' expects 'INT32'", "datatype must be INT32"),
    ({"INPUT0": ints((1, 17)), "INPUT1": ints((1, 17))},
     "unexpected shape for input 'INPUT0' for model 'simple'. Expected [-1,16], got [1,17]", "axis 1 is 17, allowed 16"),
    ({"INPUT0": ints((16,)), "INPUT1": ints((16,))},
     "unexpected shape for input 'INPUT0' for model 'simple'. Expected [-1,16], got [16]", "expected rank 2"),
    ({"INPUT0": ints((9, 16)), "INPUT1": ints((9, 16))},
     "inference request batch-size must be <= 8 for 'simple'", "axis 0 is 9, allowed [1, 8]"),
    ({"INPUT0": ints((2, 16)), "INPUT1": ints((3, 16))},
     "input 'INPUT1' batch size does not match other inputs for 'simple'", "disagree on batch size (axis 0): 2 and 3"),
])
def test_bad_inputs_start_with_tritons_message_then_ours(repo, inputs, triton, ours):
    with pytest.raises(InvalidInput) as info:
        validate_inputs(repo.get("simple").config, inputs)
    assert info.value.message.startswith(triton), info.value.message
    assert ours in info.value.message


def test_unknown_output_starts_with_tritons_message(repo):
    with pytest.raises(InvalidInput) as info:
        validate_outputs(repo.get("simple").config, ["OUTPUT0", "OUTPUT7"])
    assert info.value.message.startswith("unexpected inference output 'OUTPUT7' for model 'simple'; ")
    assert "outputs: ['OUTPUT0', 'OUTPUT1']" in info.value.message
