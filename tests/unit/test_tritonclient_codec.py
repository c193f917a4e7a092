"""The codec against tritonclient's own encoder and parser (no server): the request shapes Triton's
example clients send (JSON and binary inputs mixed in one request, BYTES holding numbers as text,
strings with NUL bytes, no requested outputs) and the responses they read back."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.http as httpclient

from deployments.protocol.binary import HEADER_LENGTH, decode_body, encode_response
from deployments.runtime.contract.repository import ModelRepository
from deployments.runtime.contract.validation import validate_inputs, validate_outputs

Client = httpclient.InferenceServerClient


def request_of(inputs, outputs=None):
    """tritonclient's request body -> our ``InferRequest``."""
    body, json_size = Client.generate_request_body(inputs, outputs=outputs)
    return decode_body([body], None if json_size is None else str(json_size))


def result_of(request, outputs: dict[str, np.ndarray]):
    """Our response -> tritonclient's ``InferResult``."""
    body, headers = encode_response("m", "1", request, outputs)
    length = headers.get(HEADER_LENGTH)
    return Client.parse_response_body(body, header_length=None if length is None else int(length))


def tensor(name: str, array: np.ndarray, datatype: str, binary: bool):
    t = httpclient.InferInput(name, list(array.shape), datatype)
    return t.set_data_from_numpy(array, binary_data=binary)


@pytest.fixture(scope="module")
def simple(prepared_engines):
    return ModelRepository(prepared_engines, ["simple", "simple_string"])


def test_json_and_binary_inputs_in_one_request_and_mixed_outputs(simple):
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), -1, np.int32)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
               httpclient.InferRequestedOutput("OUTPUT1", binary_data=False)]
    request = request_of([tensor("INPUT0", a, "INT32", False), tensor("INPUT1", b, "INT32", True)], outputs)
    assert request.inputs["INPUT0"].dtype == request.inputs["INPUT1"].dtype == np.int32
    np.testing.assert_array_equal(request.inputs["INPUT0"], a)
    np.testing.assert_array_equal(request.inputs["INPUT1"], b)
    validate_inputs(simple.get("simple").config, request.inputs)
    assert validate_outputs(simple.get("simple").config, request.outputs) == ["OUTPUT0", "OUTPUT1"]

    result = result_of(request, {"OUTPUT0": a + b, "OUTPUT1": a - b})
    by_name = {o["name"]: o for o in result.get_response()["outputs"]}
    assert by_name["OUTPUT0"]["parameters"] == {"binary_data_size": 64} and "data" in by_name["OUTPUT1"]
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


def test_no_requested_outputs_answers_every_output_in_binary_as_tritonclient_asks(simple):
    a = np.ones((1, 16), np.int32)
    request = request_of([tensor("INPUT0", a, "INT32", False), tensor("INPUT1", a, "INT32", True)])
    assert request.outputs is None and request.parameters == {"binary_data_output": True}
    assert validate_outputs(simple.get("simple").config, request.outputs) == ["OUTPUT0", "OUTPUT1"]
    result = result_of(request, {"OUTPUT0": a + a, "OUTPUT1": a - a})
    assert all(o["parameters"] == {"binary_data_size": 64} for o in result.get_response()["outputs"])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + a)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - a)


def test_bytes_numbers_as_text_binary_and_json_decode_to_the_same_bytes(simple):
    numbers = np.array([str(i).encode() for i in range(16)], dtype=object).reshape(1, 16)
    request = request_of([tensor("INPUT0", numbers, "BYTES", True), tensor("INPUT1", numbers, "BYTES", False)])
    for name in ("INPUT0", "INPUT1"):
        assert request.inputs[name].dtype == object and request.inputs[name].shape == (1, 16)
        np.testing.assert_array_equal(request.inputs[name], numbers)
    validate_inputs(simple.get("simple_string").config, request.inputs)


@pytest.mark.parametrize("items", [
    np.array([b"he\x00llo"] * 16, dtype=object).reshape(1, 16),          # NUL inside a string
    np.array([b"\x00\x01\x02\x03"] * 16, dtype=np.bytes_).reshape(1, 16),  # numpy S4
])
@pytest.mark.parametrize("binary", [True, False])
def test_strings_with_control_bytes_round_trip_binary_and_json(items, binary):
    request = request_of([tensor("INPUT0", items, "BYTES", binary)],
                         [httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)])
    expected = items.astype(object)
    np.testing.assert_array_equal(request.inputs["INPUT0"], expected)
    got = result_of(request, {"OUTPUT0": request.inputs["INPUT0"]}).as_numpy("OUTPUT0")
    # tritonclient gives bytes for binary BYTES outputs and str for JSON ones
    as_bytes = np.array([x if isinstance(x, bytes) else x.encode() for x in got.reshape(-1)], dtype=object)
    np.testing.assert_array_equal(as_bytes.reshape(got.shape), expected)
