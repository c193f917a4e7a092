"""KServe v2 JSON codec: every datatype round-trips; bad tensors are InvalidInput naming the input."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from deployments.protocol.errors import error_status, retry_after_headers
from deployments.protocol.v2 import decode_infer_request, encode_infer_response, parse_json
from deployments.runtime.contract.datatypes import NUMPY_BY_DATATYPE
from deployments.runtime.contract.errors import (
    ConfigError, InferenceError, InferenceTimeout, InvalidInput, MethodNotAllowed, ModelNotFound, ModelNotReady, OverBudget, Overloaded,
    PayloadTooLarge)


def decode(tensor: dict, **request) -> dict[str, np.ndarray]:
    return decode_infer_request({"inputs": [tensor], **request}).inputs


@pytest.mark.parametrize("datatype", sorted(set(NUMPY_BY_DATATYPE) - {"BYTES", "BOOL"}))
def test_numeric_datatypes_decode_to_their_numpy_dtype(datatype):
    arr = decode({"name": "a", "shape": [2, 2], "datatype": datatype, "data": [[1, 2], [3, 4]]})["a"]
    assert arr.dtype == NUMPY_BY_DATATYPE[datatype] and arr.shape == (2, 2)
    assert arr.ravel().tolist() == [1, 2, 3, 4]


def test_bool_and_bytes_decode():
    assert decode({"name": "b", "shape": [2], "datatype": "BOOL", "data": [True, False]})["b"].tolist() == [True, False]
    arr = decode({"name": "s", "shape": [2], "datatype": "BYTES", "data": ["héllo", "x"]})["s"]
    assert arr.dtype == object and arr.tolist() == ["héllo".encode(), b"x"]


def test_base64_bytes_marked_by_content_type_decode_to_raw_bytes():
    raw = bytes(range(256))
    arr = decode({"name": "img", "shape": [1], "datatype": "BYTES", "data": [base64.b64encode(raw).decode()],
                  "parameters": {"content_type": "base64"}})["img"]
    assert arr[0] == raw


def test_request_fields_id_outputs_and_parameters_are_kept():
    req = decode_infer_request({"id": "r7", "inputs": [{"name": "a", "shape": [1], "datatype": "FP32", "data": [1.5]}],
                                "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
                                "parameters": {"priority": 1}})
    assert req.id == "r7" and req.outputs == ["y"] and req.output_parameters == {"y": {"binary_data": True}}
    assert req.parameters == {"priority": 1}


@pytest.mark.parametrize("tensor,fragment", [
    ({"name": "a", "shape": [2], "datatype": "FP32", "data": [1]}, "needs 2 elements, data has 1"),
    ({"name": "a", "shape": [2], "datatype": "FP33", "data": [1, 2]}, "datatype \"FP33\" is not one of"),
    ({"name": "a", "shape": [-2], "datatype": "FP32", "data": []}, "axis 0 is -2"),
    ({"name": "a", "shape": [0], "datatype": "FP32", "data": []}, "axis 0 is 0"),
    ({"name": "a", "shape": [1.5], "datatype": "FP32", "data": [1]}, "axis 0 is 1.5"),
    ({"name": "a", "shape": [True], "datatype": "FP32", "data": [1]}, "axis 0 is true"),
    ({"name": "a", "shape": "2", "datatype": "FP32", "data": [1, 2]}, "'shape' must be a list"),
    ({"name": "a", "shape": [2], "datatype": "INT8", "data": [1, 128]},
     "INT8 data element 1 is 128, out of INT8's range [-128, 127]"),
    ({"name": "a", "shape": [2], "datatype": "UINT8", "data": [1, -1]},
     "UINT8 data element 1 is -1, out of UINT8's range [0, 255]"),
    ({"name": "a", "shape": [2], "datatype": "INT32", "data": [1, 1.5]}, "INT32 data must be integers"),
    ({"name": "a", "shape": [2], "datatype": "FP32", "data": [1, "2"]}, "FP32 data must be numbers"),
    ({"name": "a", "shape": [2], "datatype": "FP32", "data": [1, None]}, "FP32 data must be numbers"),
    ({"name": "a", "shape": [1], "datatype": "BOOL", "data": [1]}, "BOOL data must be true/false"),
    ({"name": "a", "shape": [1], "datatype": "BYTES", "data": [1]}, "BYTES data must be strings"),
    ({"name": "a", "shape": [1], "datatype": "BYTES", "data": ["%%"], "parameters": {"content_type": "base64"}},
     "not valid base64"),
    ({"name": "a", "shape": [1], "datatype": "FP32"}, "'data' is missing"),
    ({"shape": [1], "datatype": "FP32", "data": [1]}, "'name' must be a non-empty string"),
    ({"name": "a", "shape": [1], "datatype": ["FP32"], "data": [1]}, "is not one of"),
    ({"name": "a", "shape": [1] * 33, "datatype": "FP32", "data": [1]}, "33 axes, at most 32"),
    ({"name": "a", "shape": [1], "datatype": "FP32", "data": [1e300]}, "values overflow FP32"),
    ({"name": "a", "shape": [1], "datatype": "FP16", "data": [70000]}, "values overflow FP16"),
    ({"name": "\ud800", "shape": [1], "datatype": "FP32", "data": [1]}, "not valid Unicode"),
    ({"name": "a", "shape": [1], "datatype": "BYTES", "data": ["\udfff"]}, "element 0 is not valid Unicode"),
    ({"name": "a", "shape": [2], "datatype": "FP32", "data": [True, 0.5]}, "must be numbers, not true/false"),
    ({"name": "a", "shape": [2, 2], "datatype": "FP32", "data": [[1, 2], [3]]}, "data[1] has 1 items"),
    ({"name": "a", "shape": [2, 1], "datatype": "FP32", "data": [[1], [[2]]]}, "data[1][0] is nested deeper"),
    ({"name": "a", "shape": [1], "datatype": "FP32", "data": 1.5}, "'data' must be a list"),
    ({"name": "a", "shape": [1], "datatype": "BYTES", "data": ["x"], "parameters": {"content_type": "np"}},
     "content_type \"np\" is not one of"),
])
def test_bad_tensors_are_invalid_input_naming_what_is_wrong(tensor, fragment):
    with pytest.raises(InvalidInput) as err:
        decode(tensor)
    assert fragment in err.value.message


INTEGER_DATATYPES = ["UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"]


@pytest.mark.parametrize("datatype", INTEGER_DATATYPES)
@pytest.mark.parametrize("beside", ["alone", "beside 1", "beside the minimum"])
@pytest.mark.parametrize("end", ["max + 1", "min - 1"])
def test_an_integer_just_outside_its_datatype_is_400_saying_out_of_range(datatype, beside, end):
    """JSON's 9223372036854775808 in INT64 data was refused as not an integer ("no fractions,
    strings ..."): numpy reads it beside 1 as float64, beside -1 as an object."""
    info = np.iinfo(NUMPY_BY_DATATYPE[datatype])
    beside = {"alone": [], "beside 1": [1], "beside the minimum": [int(info.min)]}[beside]
    value = info.max + 1 if end == "max + 1" else info.min - 1
    with pytest.raises(InvalidInput) as err:
        decode({"name": "a", "shape": [len(beside) + 1], "datatype": datatype, "data": beside + [value]})
    assert err.value.message == (f"input 'a': {datatype} data element {len(beside)} is {value}, out of {datatype}'s "
                                 f"range [{info.min}, {info.max}]")
    assert error_status(err.value)[0] == 400


@pytest.mark.parametrize("datatype", INTEGER_DATATYPES)
def test_an_integer_datatypes_whole_range_decodes_exactly(datatype):
    info = np.iinfo(NUMPY_BY_DATATYPE[datatype])
    values = [info.min, 0, 1, info.max]
    assert decode({"name": "a", "shape": [4], "datatype": datatype, "data": values})["a"].tolist() == values


def test_a_fraction_beside_an_integer_out_of_range_is_still_not_an_integer():
    with pytest.raises(InvalidInput, match=r"INT64 data must be integers \(no fractions"):
        decode({"name": "a", "shape": [2], "datatype": "INT64", "data": [2 ** 63, 1.5]})


@pytest.mark.parametrize("payload,fragment", [
    ([], "JSON object"), ({}, "non-empty 'inputs'"), ({"inputs": {}}, "non-empty 'inputs'"),
    ({"id": 5, "inputs": [{"name": "a", "shape": [1], "datatype": "FP32", "data": [1]}]}, "'id' must be a string"),
    ({"inputs": [{"name": "a", "shape": [1], "datatype": "FP32", "data": [1]}] * 2}, "given twice"),
    ({"inputs": [{"name": "a", "shape": [1], "datatype": "FP32", "data": [1]}], "outputs": "y"}, "'outputs' must be"),
    ({"inputs": [{"name": "a", "shape": [1], "datatype": "FP32", "data": [1]}],
      "outputs": [{"name": "y", "parameters": [1]}]}, "'parameters' must be an object"),
    ({"id": "\ud800", "inputs": [{"name": "a", "shape": [1], "datatype": "FP32", "data": [1]}]}, "not valid Unicode"),
    ({"inputs": [{"name": "a", "shape": [1], "datatype": "FP32", "data": [1]}],
      "outputs": [{"name": "y"}, {"name": "y", "parameters": {"binary_data": True}}]}, "^output 'y' is requested twice$"),
])
def test_bad_requests_are_invalid_input(payload, fragment):
    with pytest.raises(InvalidInput, match=fragment):
        decode_infer_request(payload)


def test_an_empty_outputs_list_requests_every_output_as_triton_does():
    request = decode_infer_request({"inputs": [{"name": "a", "shape": [1], "datatype": "FP32", "data": [1]}],
                                    "outputs": []})
    assert request.outputs is None


@pytest.mark.parametrize("body", [b"{", b"[1,]", b"\xff\xfe", b'{"a": NaN}', b'{"a": -Infinity}', b"[" * 100000,
                                  b'{"a": 1e999}'])
def test_strict_json_parsing(body):
    with pytest.raises(InvalidInput, match="not valid JSON"):
        parse_json(body)


def test_a_number_past_float64_is_refused_wherever_it_stands():
    """json itself parses floats (a Python check per number cost a 1.5 MB tensor 50 ms); one
    that overflows to Infinity is still refused: outside tensor data by the parse, inside by
    the decoder, as a value its datatype cannot hold."""
    for body in (b'{"parameters": {"deep": [{"x": 1e999}]}}', b'[-1' + b'0' * 400 + b'.5]'):
        with pytest.raises(InvalidInput, match=r"^request body is not valid JSON: a number in it overflows to Infinity"):
            parse_json(body)
    tensor = b'{"inputs": [{"name": "a", "shape": [2], "datatype": "FP64", "data": [1.5, 1e999]}]}'
    with pytest.raises(InvalidInput, match=r"^input 'a': values overflow FP64"):
        decode_infer_request(parse_json(tensor))


@pytest.mark.parametrize("body, at", [(b'{"a": "\xff"}', 7), (b'{\x00"\x00a', 4)])  # UTF-8; UTF-16 cut short
def test_a_body_that_is_not_text_names_the_byte_and_the_encodings_json_takes(body, at):
    """Not json's guess of a codec ("'utf-16-le' codec can't decode...", a codec the client never chose)."""
    with pytest.raises(InvalidInput) as e:
        parse_json(body)
    assert e.value.message == (f"request body is not valid JSON: byte {at} cannot be decoded as text "
                               "(JSON bodies are UTF-8, UTF-16 or UTF-32 text)")


def test_an_integer_over_pythons_digit_limit_is_named_without_pythons_advice():
    with pytest.raises(InvalidInput, match="an integer of more than 4300 digits") as caught:
        parse_json(b'{"a": ' + b"9" * 5000 + b"}")
    assert "set_int_max_str_digits" not in caught.value.message


def test_response_encodes_outputs_flat_with_shapes_and_echoes_id():
    body = json.loads(encode_infer_response("m", "1", "r1", {
        "y": np.arange(6, dtype=np.float32).reshape(2, 3), "t": np.array([b"ok", "é".encode()], dtype=object),
        "raw": np.array([b"\xff\x00"], dtype=object)}))
    assert body["id"] == "r1" and body["model_name"] == "m" and body["model_version"] == "1"
    y, t, raw = body["outputs"]
    assert y == {"name": "y", "datatype": "FP32", "shape": [2, 3], "data": [0, 1, 2, 3, 4, 5]}
    assert t["data"] == ["ok", "é"] and "parameters" not in t
    assert raw["parameters"] == {"content_type": "base64"} and base64.b64decode(raw["data"][0]) == b"\xff\x00"


def test_nan_output_is_a_400_suggesting_binary_not_invalid_json():
    with pytest.raises(InvalidInput, match="output 'y' holds NaN or Infinity.*binary_data"):
        encode_infer_response("m", "1", None, {"y": np.array([np.nan], np.float32)})


@pytest.mark.parametrize("exc,status", [
    (InvalidInput("x"), 400), (ModelNotFound("x"), 404), (PayloadTooLarge("x"), 413), (ModelNotReady("x"), 503),
    (OverBudget("x"), 503), (InferenceTimeout("x"), 504), (InferenceError("x"), 500),
    (MethodNotAllowed("x"), 405), (ConfigError("x"), 500), (Overloaded("x"), 503),
])
def test_error_table(exc, status):
    assert error_status(exc) == (status, "x")


def test_unknown_exceptions_are_500_without_leaking_their_text():
    status, message = error_status(KeyError("secret internal detail"))
    assert status == 500 and "secret" not in message


def test_ray_wrapped_errors_keep_their_status():
    from ray.exceptions import RayTaskError

    wrapped = RayTaskError("infer", "traceback text", InvalidInput("bad axis")).as_instanceof_cause()
    assert error_status(wrapped) == (400, "bad axis")


def test_ray_backpressure_is_a_503_with_retry_after_naming_the_queue_limit():
    from ray.exceptions import RayTaskError
    from ray.serve.exceptions import BackPressureError

    exc = BackPressureError(num_queued_requests=64, max_queued_requests=64, retry_after_s=1.5)
    status, message = error_status(exc)
    assert status == 503 and "64 requests already wait" in message and "limit 64" in message
    assert retry_after_headers(exc) == {"Retry-After": "2"}  # delay-seconds, rounded up
    wrapped = RayTaskError("infer", "traceback text", exc).as_instanceof_cause()  # from a pipeline step
    assert error_status(wrapped)[0] == 503 and retry_after_headers(wrapped) == {"Retry-After": "2"}


def test_only_shed_requests_carry_retry_after():
    assert retry_after_headers(Overloaded("full", retry_after_s=1.0)) == {"Retry-After": "1"}
    assert retry_after_headers(ModelNotReady("loading")) == {} and retry_after_headers(KeyError("x")) == {}


# ---------------------------------------------------------------------------- parameters


from deployments.protocol.parameters import apply_classification, classify  # noqa: E402

X = {"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}


def test_classification_gives_top_k_value_index_strings_per_row_as_triton_does():
    logits = np.array([[0.1, 3.5, -2.0, 3.5, 0.7], [5.0, 4.0, 3.0, 2.0, 1.0]], np.float32)
    top = classify("m", logits, 3, batched=True)
    assert top.shape == (2, 3) and top.dtype == object
    assert top.tolist() == [[b"3.500000:1", b"3.500000:3", b"0.700000:4"],
                            [b"5.000000:0", b"4.000000:1", b"3.000000:2"]]
    assert classify("m", logits[0], 9, batched=False).tolist()[-1] == b"-2.000000:2"  # k over the classes: all


def test_classification_of_an_output_with_no_rows_or_no_elements_is_empty_not_a_500():
    """A detector that found nothing answers shape [0, 4]: its top k is [0, k] (no row to rank);
    an unbatched output with no element ranks nothing."""
    assert classify("m", np.zeros((0, 4), np.float32), 2, batched=True).shape == (0, 2)
    assert classify("m", np.zeros((0,), np.float32), 3, batched=False).shape == (0,)
    assert classify("m", np.zeros((2, 0), np.float32), 3, batched=True).shape == (2, 0)


def test_requested_output_with_class_count_is_replaced_by_its_top_k_and_others_are_untouched():
    request = decode_infer_request({"inputs": [X], "outputs": [
        {"name": "logits", "parameters": {"classification": 2}}, {"name": "raw"}]})
    outputs = {"logits": np.array([[1.0, 9.0, 5.0]], np.float32), "raw": np.array([[1.0]], np.float32)}
    result = apply_classification("m", True, request.output_parameters, outputs)
    assert result["logits"].tolist() == [[b"9.000000:1", b"5.000000:2"]]
    np.testing.assert_array_equal(result["raw"], outputs["raw"])
    body = json.loads(encode_infer_response("m", "1", None, result))
    assert body["outputs"][0] == {"name": "logits", "datatype": "BYTES", "shape": [1, 2],
                                  "data": ["9.000000:1", "5.000000:2"]}


@pytest.mark.parametrize("value", [0, -1, 2.5, "3", True])
def test_a_class_count_that_is_not_a_positive_integer_is_400(value):
    with pytest.raises(InvalidInput, match=r"output 'logits': parameters.classification \(class_count\) must be"):
        decode_infer_request({"inputs": [X], "outputs": [{"name": "logits", "parameters": {"classification": value}}]})


def test_classification_of_a_bytes_output_is_400():
    with pytest.raises(InvalidInput, match="classification needs a numeric output, this one is BYTES$"):
        apply_classification("ocr", True, {"text": {"classification": 1}}, {"text": np.array([b"a"], dtype=object)})


@pytest.mark.parametrize("request_json,message", [
    ({"inputs": [{**X, "parameters": {"shared_memory_region": "r"}}]},
     "input 'x': shared memory is not available on this path; send the data in the body"),
    ({"inputs": [X], "outputs": [{"name": "y", "parameters": {"shared_memory_region": "r", "classification": 2}}]},
     "Output can't set both 'shared_memory_region' and 'classification'; output 'y'"),
    ({"inputs": [X], "outputs": [{"name": "y", "parameters": {"shared_memory_region": "r", "binary_data": True}}]},
     "Output can't set both 'shared_memory_region' and 'binary_data'; output 'y'"),
    ({"inputs": [X], "parameters": {"sequence_id": 7}},
     "request: parameters.\"sequence_id\": the sequence extension is not supported"),
    ({"inputs": [X], "outputs": [{"name": "y", "parameters": {"top_k": 3}}]},
     "output 'y': parameters.\"top_k\": not a parameter this server knows; allowed here: ['binary_data', 'classification', "
     "'shared_memory_region', 'shared_memory_byte_size', 'shared_memory_offset']"),
    ({"inputs": [{**X, "parameters": {"scale": 2}}]}, "input 'x': parameters.\"scale\": not a parameter this server knows"),
    ({"inputs": [X], "parameters": {"temperature": 0.1}}, "request: parameters.\"temperature\": not a parameter"),
    ({"inputs": [X], "parameters": {"timeout": -5}},
     "request: parameters.timeout must be an integer of microseconds in [1, 18446744073709551615], got -5"),
    ({"inputs": [X], "parameters": {"priority": "high"}},
     "request: parameters.priority must be a priority level (an integer; 0 is the model's default) in "
     "[0, 18446744073709551615], got \"high\""),
    ({"inputs": [X], "parameters": {"priority": -1}}, "parameters.priority must be a priority level"),
    ({"inputs": [X], "parameters": {"priority": True}}, "parameters.priority must be a priority level"),
])
def test_parameters_that_would_change_the_answer_and_are_not_implemented_are_400_naming_them(request_json, message):
    with pytest.raises(InvalidInput) as raised:
        decode_infer_request(request_json)
    assert message in raised.value.message


@pytest.mark.parametrize("request_json, message", [
    ({"inputs": [X], "parameters": {"timeout": 10**30}},
     "request: parameters.timeout must be an integer of microseconds in [1, 18446744073709551615], got "
     "1000000000000000000000000000000"),
    ({"inputs": [X], "parameters": {"timeout": 2**64}}, "parameters.timeout must be an integer of microseconds in "),
    ({"inputs": [X], "parameters": {"priority": 2**64}}, "parameters.priority must be a priority level"),
    ({"inputs": [X], "outputs": [{"name": "y", "parameters": {"classification": 10**30}}]},
     "output 'y': parameters.classification (class_count) must be an integer in [1, 4294967295], got "
     "1000000000000000000000000000000"),
    ({"inputs": [X], "outputs": [{"name": "y", "parameters": {"binary_data": 1}}]},
     "output 'y': parameters.binary_data must be true or false (a bool), got int 1"),
    ({"inputs": [X], "parameters": {"binary_data_output": "yes"}},
     "request: parameters.binary_data_output must be true or false (a bool), got str \"yes\""),
])
def test_parameters_out_of_their_range_or_type_are_400_naming_the_parameter_and_the_range(request_json, message):
    """Seen: ``timeout: 10**30`` and ``classification: 10**30`` answered 200 (Triton's timeout is
    a uint64 of microseconds, its class count a uint32); a non-bool ``binary_data`` was refused
    only after the model ran."""
    with pytest.raises(InvalidInput) as raised:
        decode_infer_request(request_json)
    assert message in raised.value.message


def test_the_largest_timeout_priority_and_class_count_are_accepted():
    request = decode_infer_request({"inputs": [X], "parameters": {"timeout": 2**64 - 1, "priority": 2**64 - 1},
                                    "outputs": [{"name": "y", "parameters": {"classification": 2**32 - 1}}]})
    assert request.timeout_s == (2**64 - 1) / 1e6


def test_parameters_the_server_implements_or_that_change_no_answer_are_accepted():
    request = decode_infer_request({
        "inputs": [{**X, "parameters": {"content_type": "str"}}],
        "outputs": [{"name": "y", "parameters": {"binary_data": True, "classification": 1}}],
        "parameters": {"binary_data_output": False, "priority": 1, "timeout": 250000}})
    assert request.timeout_s == 0.25
