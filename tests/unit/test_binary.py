"""Triton's binary tensor data extension: decoding requests, encoding responses, malformed bodies."""

from __future__ import annotations

import asyncio
import json
import struct

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.http._utils import _get_inference_request

from deployments.protocol.answer import answer
from deployments.protocol.binary import (
    HEADER_LENGTH,
    binary_outputs,
    decode_body,
    decode_request,
    encode_response,
    join_body,
    parse_header_length,
)
from deployments.protocol.errors import error_status
from deployments.protocol.v2 import InferRequest
from deployments.runtime.contract.outputs import Outputs
from deployments.runtime.contract.errors import InvalidInput


def triton_body(inputs: list[httpclient.InferInput], outputs=None, request_id: str = "") -> tuple[bytes, str | None]:
    """The body and header length ``tritonclient.http`` would send."""
    body, header_length = _get_inference_request(inputs, request_id, outputs, 0, False, False, 0, None, None)
    return body, None if header_length is None else str(header_length)


def binary_body(header: dict, *payloads: bytes) -> tuple[bytes, str]:
    head = json.dumps(header).encode()
    return head + b"".join(payloads), str(len(head))


def tensor(name: str, array: np.ndarray, datatype: str, binary: bool = True) -> httpclient.InferInput:
    t = httpclient.InferInput(name, list(array.shape), datatype)
    t.set_data_from_numpy(array, binary_data=binary)
    return t


def decode(body, header):
    return decode_body([body], header)


def test_tritonclient_binary_request_decodes_to_the_same_arrays():
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 5), dtype=np.float32)
    ids = np.arange(6, dtype=np.int64).reshape(2, 3)
    flags = np.array([True, False, True])
    half = np.linspace(-1, 1, 7).astype(np.float16)
    body, header = triton_body([tensor("x", x, "FP32"), tensor("ids", ids, "INT64"),
                                tensor("flags", flags, "BOOL"), tensor("half", half, "FP16")], request_id="r1")
    request = decode(body, header)
    assert request.id == "r1"
    np.testing.assert_array_equal(request.inputs["x"], x)
    np.testing.assert_array_equal(request.inputs["ids"], ids)
    np.testing.assert_array_equal(request.inputs["flags"], flags)
    np.testing.assert_array_equal(request.inputs["half"], half)
    assert request.inputs["x"].dtype == np.float32 and request.inputs["ids"].dtype == np.int64


def test_binary_and_json_inputs_mix_in_one_request():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    y = np.array([[1, 2]], dtype=np.int32)
    body, header = triton_body([tensor("x", x, "FP32"), tensor("y", y, "INT32", binary=False)])
    request = decode(body, header)
    np.testing.assert_array_equal(request.inputs["x"], x)
    np.testing.assert_array_equal(request.inputs["y"], y)


def test_bytes_elements_are_length_prefixed_little_endian():
    words = np.array([b"", b"ab", "\u00e9t\u00e9".encode(), bytes(range(256))], dtype=object).reshape(2, 2)
    body, header = triton_body([tensor("s", words, "BYTES")])
    request = decode(body, header)
    assert request.inputs["s"].shape == (2, 2)
    assert request.inputs["s"].ravel().tolist() == words.ravel().tolist()


def test_bytes_elements_that_leave_bytes_over_are_400():
    payload = struct.pack("<I", 3) + b"abc" + struct.pack("<I", 0) + b"zz"  # 2 elements take 11 of 13 bytes
    body, header = binary_body(
        {"inputs": [{"name": "s", "shape": [2], "datatype": "BYTES", "parameters": {"binary_data_size": 13}}]},
        payload)
    with pytest.raises(InvalidInput, match="2 BYTES elements take 11 bytes, binary_data_size gives 13 bytes"):
        decode(body, header)


def test_numeric_inputs_are_aligned_views_of_the_body_without_a_copy():
    x = np.random.default_rng(1).standard_normal((1, 3, 64, 64), dtype=np.float32)
    y = np.ones((1, 3, 64, 64), dtype=np.float32)
    body, header = triton_body([tensor("x", x, "FP32"), tensor("y", y, "FP32")])
    length = parse_header_length(header, len(body))
    buffer = join_body([body[:1000], body[1000:]], length)  # two chunks, as a stream delivers them
    request = decode_request(buffer, length)
    for name in ("x", "y"):
        array = request.inputs[name]
        assert array.flags.aligned and array.base is not None and not array.flags.owndata
        assert np.shares_memory(array, np.frombuffer(buffer, dtype=np.uint8))
    assert request.inputs["x"].ctypes.data % 64 == 0
    np.testing.assert_array_equal(request.inputs["x"], x)


def test_misaligned_input_is_copied_and_still_correct():
    a = np.array([7], dtype=np.uint8)
    x = np.arange(5, dtype=np.float64)
    body, header = triton_body([tensor("a", a, "UINT8"), tensor("x", x, "FP64")])
    length = parse_header_length(header, len(body))
    buffer = join_body([body], length)
    request = decode_request(buffer, length)  # x starts 1 byte after a 64-byte boundary
    assert request.inputs["x"].flags.aligned
    assert not np.shares_memory(request.inputs["x"], np.frombuffer(buffer, dtype=np.uint8))
    np.testing.assert_array_equal(request.inputs["x"], x)


def test_plain_json_request_still_decodes_without_the_header():
    body = json.dumps({"inputs": [{"name": "x", "shape": [2], "datatype": "INT32", "data": [1, 2]}]}).encode()
    request = decode(body, None)
    np.testing.assert_array_equal(request.inputs["x"], np.array([1, 2], np.int32))


@pytest.mark.parametrize("datatype,shape,size,expected", [
    ("FP32", [1, 3, 640, 640], 4915196, 4915200),
    ("INT64", [2, 2], 40, 32),
    ("FP16", [3], 4, 6),
    ("BOOL", [4], 5, 4),
])
def test_size_that_disagrees_with_shape_and_datatype_is_400_giving_both_counts(datatype, shape, size, expected):
    body, header = binary_body(
        {"inputs": [{"name": "x", "shape": shape, "datatype": datatype, "parameters": {"binary_data_size": size}}]},
        bytes(size))
    with pytest.raises(InvalidInput) as e:
        decode(body, header)
    assert f"needs {expected} bytes" in e.value.message and f"gives {size} bytes" in e.value.message
    assert error_status(e.value)[0] == 400


def test_header_length_beyond_the_body_is_400():
    body, header = binary_body({"inputs": []})
    with pytest.raises(InvalidInput, match=f"is {len(body) + 1} bytes but the body has only {len(body)}"):
        decode(body, str(len(body) + 1))


@pytest.mark.parametrize("value", ["-1", "abc", "1.5", ""])
def test_header_length_that_is_not_a_count_is_400(value):
    with pytest.raises(InvalidInput, match="must be a non-negative integer"):
        decode(b"{}", value)


def test_binary_data_size_running_past_the_body_is_400():
    body, header = binary_body(
        {"inputs": [{"name": "x", "shape": [4], "datatype": "FP32", "parameters": {"binary_data_size": 16}}]},
        bytes(12))
    with pytest.raises(InvalidInput, match="binary_data_size is 16 bytes but only 12 bytes"):
        decode(body, header)


def test_bytes_left_over_after_the_last_input_are_400():
    body, header = binary_body(
        {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "parameters": {"binary_data_size": 4}}]},
        bytes(4), b"junk")
    with pytest.raises(InvalidInput, match="4 bytes after the binary data"):
        decode(body, header)


def test_binary_input_without_the_header_is_400_naming_the_header():
    body = json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32",
                                   "parameters": {"binary_data_size": 4}}]}).encode()
    with pytest.raises(InvalidInput, match="no Inference-Header-Content-Length header"):
        decode(body, None)


@pytest.mark.parametrize("tensor_json,message", [
    ({"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0], "parameters": {"binary_data_size": 4}},
     "Input must set only one of the following fields: 'data', 'binary_data_size' in 'parameters', "
     "'shared_memory_region' in 'parameters'. But set 'data' 'binary_data_size'"),
    ({"name": "x", "shape": [1], "datatype": "FP32", "parameters": {"binary_data_size": -4}},
     "non-negative integer"),
    ({"name": "x", "shape": [1], "datatype": "FP32", "parameters": {"binary_data_size": True}},
     "non-negative integer"),
    ({"name": "x", "shape": [1], "datatype": "BF16", "parameters": {"binary_data_size": 2}},
     "is not one of"),
    ({"name": "x", "shape": [0], "datatype": "FP32", "parameters": {"binary_data_size": 0}},
     "must be a positive integer"),
    ({"shape": [1], "datatype": "FP32", "parameters": {"binary_data_size": 4}}, "'name'"),
])
def test_malformed_binary_tensor_header_is_400(tensor_json, message):
    body, header = binary_body({"inputs": [tensor_json]}, bytes(4))
    with pytest.raises(InvalidInput, match=message.replace("(", r"\(")):
        decode(body, header)


@pytest.mark.parametrize("payload,message", [
    (struct.pack("<I", 10) + b"abc", "BYTES element 0 says 10 bytes"),  # a length past the end
    (b"\x01\x00", "1 BYTES elements need at least 4 bytes"),           # a truncated length prefix
    (struct.pack("<I", 1) + b"a" + b"\x01\x00\x00", "BYTES element 1 of 2 starts at byte 5"),
])
def test_truncated_bytes_elements_are_400(payload, message):
    shape = [message.count("element 1") + 1]
    body, header = binary_body(
        {"inputs": [{"name": "s", "shape": shape, "datatype": "BYTES",
                     "parameters": {"binary_data_size": len(payload)}}]}, payload)
    with pytest.raises(InvalidInput, match=message):
        decode(body, header)


def test_bytes_element_count_beyond_the_payload_is_400_before_any_allocation():
    body, header = binary_body(
        {"inputs": [{"name": "s", "shape": [2**40], "datatype": "BYTES", "parameters": {"binary_data_size": 0}}]}, b"")
    with pytest.raises(InvalidInput, match="1099511627776 BYTES elements need at least"):
        decode(body, header)


@pytest.mark.parametrize("value", ["\u00b2", "9" * 5000, "-1", "1.0", " "])
def test_header_length_that_is_not_a_plain_integer_is_400(value):
    with pytest.raises(InvalidInput, match="must be a non-negative integer"):
        parse_header_length(value, 10)


def test_malformed_json_header_is_400():
    with pytest.raises(InvalidInput, match="not valid JSON"):
        decode(b"{not json" + bytes(8), "9")


@pytest.mark.parametrize("body", [b"\x89PNG\r\n\x1a\n" + bytes(8), b"", b"name=tiny_cnn"])
def test_a_body_that_is_not_json_says_what_an_infer_body_is(body):
    """A file posted as the body (an image, a form) gets the reason and what the route takes."""
    with pytest.raises(InvalidInput, match=r"^request body is not valid JSON: .*\. An infer request's body is a "
                       r"KServe v2 JSON object \{\"inputs\": \[\.\.\.\]\} \(a file such as an image goes in a "
                       r"BYTES input: base64 .*Inference-Header-Content-Length header$"):
        decode_request(body, None)


@pytest.mark.parametrize("delta", [-3, 5])
def test_a_header_length_that_misses_the_json_part_names_the_header(delta):
    body, header = binary_body({"inputs": [{"name": "x", "shape": [2], "datatype": "FP32",
                                            "parameters": {"binary_data_size": 8}}]}, bytes(8))
    with pytest.raises(InvalidInput, match=rf"the body's first {int(header) + delta} bytes "
                       r"\(Inference-Header-Content-Length\) are not one JSON object: .*exact length"):
        decode(body, str(int(header) + delta))


def request_with(parameters=None, output_parameters=None) -> InferRequest:
    return InferRequest("id-7", {}, None, output_parameters or {}, parameters or {})


def test_binary_output_selection_follows_request_and_output_flags():
    names = ["a", "b"]
    assert binary_outputs(request_with(), names) == set()
    assert binary_outputs(request_with({"binary_data_output": True}), names) == {"a", "b"}
    assert binary_outputs(request_with({"binary_data_output": True}, {"a": {"binary_data": False}}), names) == {"b"}
    assert binary_outputs(request_with(None, {"b": {"binary_data": True}}), names) == {"b"}
    with pytest.raises(InvalidInput, match="binary_data must be true or false"):
        binary_outputs(request_with(None, {"a": {"binary_data": "yes"}}), names)


def test_binary_response_is_read_back_by_tritonclient():
    logits = np.random.default_rng(2).standard_normal((2, 10)).astype(np.float32)
    words = np.array([b"hi", b"\xff\x00"], dtype=object)
    counts = np.array([1, 2], dtype=np.int64)
    outputs = {"logits": logits, "text": words, "counts": counts}
    request = request_with({"binary_data_output": True}, {"counts": {"binary_data": False}})
    body, headers = encode_response("m", "1", request, outputs)
    assert headers["content-type"] == "application/octet-stream"
    result = httpclient.InferResult.from_response_body(body, header_length=int(headers[HEADER_LENGTH]))
    response = result.get_response()
    assert response["id"] == "id-7" and response["model_name"] == "m"
    sizes = {o["name"]: o.get("parameters", {}).get("binary_data_size") for o in response["outputs"]}
    assert sizes == {"logits": 80, "text": 4 + 2 + 4 + 2, "counts": None}
    np.testing.assert_array_equal(result.as_numpy("logits"), logits)
    assert result.as_numpy("text").tolist() == [b"hi", b"\xff\x00"]
    np.testing.assert_array_equal(result.as_numpy("counts"), counts)


def test_empty_and_transposed_binary_outputs_are_read_back_by_tritonclient():
    """An output with no elements (a detector that found nothing: shape [0, 4]) answers an empty
    binary tensor, not a 500; a non-contiguous one (a transpose) is laid out row-major."""
    boxes = np.zeros((0, 4), np.float32)
    scores = np.arange(6, dtype=np.float32).reshape(2, 3).T
    body, headers = encode_response("m", "1", request_with({"binary_data_output": True}),
                                    {"boxes": boxes, "scores": scores})
    result = httpclient.InferResult.from_response_body(body, header_length=int(headers[HEADER_LENGTH]))
    sizes = {o["name"]: (o["shape"], o["parameters"]["binary_data_size"]) for o in result.get_response()["outputs"]}
    assert sizes == {"boxes": ([0, 4], 0), "scores": ([3, 2], 24)}
    assert result.as_numpy("boxes").shape == (0, 4)
    np.testing.assert_array_equal(result.as_numpy("scores"), scores)


def test_binary_outputs_may_hold_nan_but_json_outputs_may_not():
    nan = np.array([np.nan], dtype=np.float32)
    body, headers = encode_response("m", "1", request_with({"binary_data_output": True}), {"y": nan})
    assert np.isnan(np.frombuffer(body[int(headers[HEADER_LENGTH]):], np.float32)).all()
    with pytest.raises(Exception, match="NaN or Infinity"):
        encode_response("m", "1", request_with(), {"y": nan})


def test_a_json_output_beside_binary_ones_may_not_hold_nan_either():
    from deployments.runtime.contract.errors import InvalidInput

    request = request_with(None, {"y": {"binary_data": True}})
    nan = np.array([np.nan], dtype=np.float32)
    with pytest.raises(InvalidInput, match="output 'z' holds NaN or Infinity"):
        encode_response("m", "1", request, {"y": nan, "z": nan})


def test_json_response_when_no_output_is_binary():
    body, headers = encode_response("m", "1", request_with(), {"y": np.array([1.5], np.float32)})
    assert headers == {"content-type": "application/json"}
    assert json.loads(body)["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [1], "data": [1.5]}]


@pytest.mark.parametrize("payload,index,byte", [(b"\x00\x01\x02", 2, 2), (b"\xff\x00\x01", 0, 255)])
def test_binary_bool_bytes_other_than_0_and_1_are_400_naming_the_element(payload, index, byte):
    body, header = binary_body(
        {"inputs": [{"name": "flags", "shape": [3], "datatype": "BOOL", "parameters": {"binary_data_size": 3}}]},
        payload)
    with pytest.raises(InvalidInput) as e:
        decode(body, header)
    assert f"element {index} is byte {byte}" in e.value.message and "only 0 (false) and 1 (true)" in e.value.message
    assert error_status(e.value)[0] == 400


def test_binary_bool_zeros_and_ones_decode_to_false_and_true():
    body, header = binary_body(
        {"inputs": [{"name": "flags", "shape": [4], "datatype": "BOOL", "parameters": {"binary_data_size": 4}}]},
        b"\x00\x01\x01\x00")
    assert decode(body, header).inputs["flags"].tolist() == [False, True, True, False]


@pytest.mark.parametrize("binary", [False, True])
def test_an_answer_s_own_parameters_reach_the_response_in_json_and_binary(binary):
    """A pipeline's ``Outputs.parameters`` (the embed pipeline's ``truncated``) are the response's
    ``parameters``; a plain dict answers without them."""
    body = json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}],
                       "parameters": {"binary_data_output": binary}}).encode()
    said = {"truncated": [0], "max_seq_length": 256}

    async def run(outputs):
        async def infer(request):
            return outputs
        done = await answer("m", "1", False, [body], None, infer)
        length = int(done.headers.get(HEADER_LENGTH, len(done.content)))
        return json.loads(done.content[:length])

    y = {"y": np.ones(1, np.float32)}
    assert asyncio.run(run(Outputs(y, said)))["parameters"] == said
    assert "parameters" not in asyncio.run(run(y))
