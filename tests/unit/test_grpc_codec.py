"""The gRPC edge's codec (``deployments.protocol.grpc``) against tritonclient.grpc's own request
builder and result reader (no server): raw and typed contents decode to the arrays the client
sent, through the HTTP binary decoder; answers read back as the client reads them; the gRPC
code of every status of the error table."""

from __future__ import annotations

import json
import struct

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc._utils import _get_inference_request

from deployments.protocol.binary import decode_body, encode_response
from deployments.protocol.errors import STATUS_BY_ERROR, grpc_code
from deployments.protocol.grpc import infer_body, infer_response
from deployments.runtime.contract.errors import InvalidInput

ARRAYS = {
    "BOOL": np.array([[True, False, True]]), "INT8": np.array([[-128, 0, 127]], np.int8),
    "INT16": np.array([[-3, 0, 3]], np.int16), "INT32": np.array([[-(2**31), 0, 2**31 - 1]], np.int32),
    "INT64": np.array([[-(2**63), 0, 2**63 - 1]], np.int64), "UINT8": np.array([[0, 1, 255]], np.uint8),
    "UINT16": np.array([[0, 1, 65535]], np.uint16), "UINT32": np.array([[0, 1, 2**32 - 1]], np.uint32),
    "UINT64": np.array([[0, 1, 2**64 - 1]], np.uint64), "FP32": np.array([[-1.5, 0, np.inf]], np.float32),
    "FP64": np.array([[-1.5, 0, 1e300]], np.float64), "FP16": np.array([[-1.5, 0, 2]], np.float16),
    "BYTES": np.array([[b"a\x00b", b"", "\u00e9".encode()]], dtype=object),
}


def request(inputs, outputs=None, request_id="", priority=0, timeout=None) -> pb.ModelInferRequest:
    """What tritonclient.grpc's ``infer`` sends."""
    return _get_inference_request("m", inputs, "", request_id, outputs, 0, False, False, priority, timeout, None)


def decoded(message: pb.ModelInferRequest):
    chunks, length = infer_body(message)
    return decode_body(chunks, str(length))


def raw_input(name: str, datatype: str, x: np.ndarray):
    tensor = grpcclient.InferInput(name, list(x.shape), datatype)
    return tensor.set_data_from_numpy(x)


@pytest.mark.parametrize("datatype", sorted(ARRAYS))
def test_raw_contents_decode_to_the_arrays_the_client_sent(datatype):
    x = ARRAYS[datatype]
    got = decoded(request([raw_input("x", datatype, x)])).inputs["x"]
    assert got.shape == x.shape and got.tolist() == x.tolist()


@pytest.mark.parametrize("datatype", sorted(set(ARRAYS) - {"FP16"}))
def test_typed_contents_decode_as_the_raw_ones(datatype):
    x = ARRAYS[datatype]
    message = pb.ModelInferRequest(model_name="m")
    tensor = message.inputs.add(name="x", datatype=datatype, shape=list(x.shape))
    values = x.ravel().tolist()
    getattr(tensor.contents, {"BOOL": "bool_contents", "INT64": "int64_contents", "UINT64": "uint64_contents",
                              "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents"}.get(
        datatype, "uint_contents" if datatype.startswith("UINT") else "int_contents")).extend(values)
    got = decoded(message).inputs["x"]
    assert got.dtype == decoded(request([raw_input("x", datatype, x)])).inputs["x"].dtype
    assert got.tolist() == x.tolist()


def typed(datatype: str, shape: list[int], **contents) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name="m")
    message.inputs.add(name="x", datatype=datatype, shape=shape, contents=pb.InferTensorContents(**contents))
    return message


@pytest.mark.parametrize("message, error", [
    (typed("INT32", [1, 3], int_contents=[1, 2]), "input 'x': shape [1, 3] needs 3 elements, contents.int_contents has 2"),
    (typed("INT8", [1], int_contents=[300]), "input 'x': INT8 data element 0 is 300, out of INT8's range [-128, 127]"),
    (typed("INT32", [1], fp32_contents=[1.0]),
     "input 'x': a INT32 input takes its values in contents.int_contents, got ['contents.fp32_contents']"),
    (typed("FP16", [1], fp32_contents=[1.0]), "input 'x': FP16 has no typed contents field; send it in raw_input_contents"),
], ids=["count", "range", "field", "fp16"])
def test_typed_contents_that_do_not_fit_name_the_input(message, error):
    with pytest.raises(InvalidInput) as info:
        infer_body(message)
    assert info.value.message == error


def test_raw_contents_for_some_inputs_only_or_beside_typed_ones_are_refused():
    message = request([raw_input("a", "INT32", ARRAYS["INT32"]), raw_input("b", "INT32", ARRAYS["INT32"])])
    del message.raw_input_contents[1]
    with pytest.raises(InvalidInput, match="raw_input_contents has 1 entries for 2 inputs"):
        infer_body(message)
    message = request([raw_input("a", "INT32", ARRAYS["INT32"])])
    message.inputs[0].contents.int_contents.extend([1, 2, 3])
    with pytest.raises(InvalidInput, match="input 'a': give either contents or raw_input_contents, not both"):
        infer_body(message)


@pytest.mark.parametrize("datatype, shape, size, expected", [("INT32", [1, 16], 60, 64), ("FP32", [2, 3], 28, 24),
                                                             ("BOOL", [4], 0, 4)])
def test_raw_contents_of_another_size_than_the_shape_name_raw_input_contents(datatype, shape, size, expected):
    message = request([raw_input("a", "INT32", ARRAYS["INT32"])])
    message.inputs[0].datatype, message.inputs[0].shape[:] = datatype, shape
    message.raw_input_contents[0] = bytes(size)
    with pytest.raises(InvalidInput) as info:
        infer_body(message)
    assert info.value.message == (f"input byte size mismatch for input 'a'. Expected {expected}, got {size}; input "
                                  f"'a': shape {shape} x {datatype} needs {expected} bytes, raw_input_contents gives "
                                  f"{size} bytes")


@pytest.mark.parametrize("entry, error", [
    (struct.pack("<I", 99999) + b"ab", "input 'a': 16 BYTES elements need at least 64 bytes (a 4-byte length each), "
                                       "raw_input_contents gives 6 bytes"),
    (b"".join(struct.pack("<I", 2) + b"ab" for _ in range(15)) + struct.pack("<I", 9) + b"abc",
     "input 'a': BYTES element 15 says 9 bytes but only 3 bytes remain of raw_input_contents 97"),
    (b"".join(struct.pack("<I", 1) + b"a" for _ in range(16)) + b"xx",
     "input 'a': 16 BYTES elements take 80 bytes, raw_input_contents gives 82 bytes"),
], ids=["too short", "overrun", "left over"])
def test_bytes_raw_contents_that_do_not_parse_name_raw_input_contents(entry, error):
    """BYTES entries were checked by the decoder of the body the edge writes, whose messages
    named ``binary_data_size``, a field no gRPC request has."""
    message = request([raw_input("a", "INT32", ARRAYS["INT32"])])
    message.inputs[0].datatype, message.inputs[0].shape[:] = "BYTES", [1, 16]
    message.raw_input_contents[0] = entry
    with pytest.raises(InvalidInput) as info:
        infer_body(message)
    assert info.value.message == error


@pytest.mark.parametrize("datatype, needs", [("INT32", "64 bytes"), ("BYTES", "16 elements")])
def test_an_input_with_no_contents_at_all_names_the_fields_that_carry_them(datatype, needs):
    message = pb.ModelInferRequest(model_name="m")
    message.inputs.add(name="a", datatype=datatype, shape=[1, 16])
    with pytest.raises(InvalidInput) as info:
        infer_body(message)
    assert info.value.message == (f"input 'a' has no data: shape [1, 16] x {datatype} needs {needs}; give them in "
                                  "raw_input_contents (one entry per input, in the order of inputs), in the input's "
                                  "contents, or in shared memory (parameters.shared_memory_region)")


def test_a_bad_shape_or_datatype_in_typed_contents_is_the_decoders_to_name():
    with pytest.raises(InvalidInput, match="shape axis 1 is -1, must be a positive integer"):
        decoded(typed("INT32", [1, -1], int_contents=[1]))
    with pytest.raises(InvalidInput, match="datatype \"FLOAT\" is not one of"):
        decoded(typed("FLOAT", [1], fp32_contents=[1.0]))


def test_id_outputs_and_parameters_pass_as_the_http_request_gives_them():
    outputs = [grpcclient.InferRequestedOutput("y", class_count=3)]
    got = decoded(request([raw_input("x", "FP32", ARRAYS["FP32"])], outputs, request_id="r-7"))
    assert (got.id, got.outputs) == ("r-7", ["y"])
    assert got.output_parameters == {"y": {"classification": 3, "binary_data": True}}
    message = request([raw_input("x", "FP32", ARRAYS["FP32"])], priority=2, timeout=1500)
    assert decoded(message).timeout_s == 0.0015 and decoded(message).parameters["priority"] == 2
    message.parameters["sequence_id"].int64_param = 3
    with pytest.raises(InvalidInput, match="parameters.\"sequence_id\": the sequence extension is not supported"):
        decoded(message)


def test_answers_read_back_as_tritonclient_reads_them():
    infer_request = decoded(request([raw_input("x", "FP32", ARRAYS["FP32"])], request_id="r-1"))
    outputs = {"y": ARRAYS["FP32"], "s": ARRAYS["BYTES"], "b": ARRAYS["BOOL"]}
    body, headers = encode_response("m", "3", infer_request, outputs, {"sequence_id": 4})
    response = infer_response(body, headers)
    result = grpcclient.InferResult(response)
    for name, x in outputs.items():
        assert result.as_numpy(name).tolist() == x.tolist(), name
    assert (response.model_name, response.model_version, response.id) == ("m", "3", "r-1")
    assert response.parameters["sequence_id"].int64_param == 4


def test_an_answer_in_json_reads_back_too():
    infer_request = decoded(request([raw_input("x", "FP32", ARRAYS["FP32"])]))
    infer_request.parameters = {}  # as a JSON answer comes back
    body, headers = encode_response("m", "1", infer_request, {"y": ARRAYS["INT32"], "s": ARRAYS["BYTES"]})
    result = grpcclient.InferResult(infer_response(body, headers))
    assert result.as_numpy("y").tolist() == ARRAYS["INT32"].tolist()
    assert result.as_numpy("s").tolist() == ARRAYS["BYTES"].tolist()


def test_every_status_of_the_error_table_has_a_grpc_code_and_only_500_is_internal():
    codes = {status: grpc_code(status) for status in set(STATUS_BY_ERROR.values())}
    assert codes[400] == grpc.StatusCode.INVALID_ARGUMENT and codes[404] == grpc.StatusCode.NOT_FOUND
    assert codes[413] == grpc.StatusCode.RESOURCE_EXHAUSTED and codes[503] == grpc.StatusCode.UNAVAILABLE
    assert codes[504] == grpc.StatusCode.DEADLINE_EXCEEDED
    assert [s for s, c in codes.items() if c == grpc.StatusCode.INTERNAL] == [500]


def test_inputs_in_shared_memory_take_no_raw_entry_and_outputs_in_it_are_not_asked_binary():
    a = raw_input("a", "INT32", ARRAYS["INT32"])
    b = grpcclient.InferInput("b", [1, 3], "INT32").set_shared_memory("region", 12, offset=4)
    output = grpcclient.InferRequestedOutput("y")
    output.set_shared_memory("out", 12)
    chunks, _ = infer_body(request([a, b], [output, grpcclient.InferRequestedOutput("z")]))
    header = json.loads(chunks[0])
    assert header["inputs"][1]["parameters"] == {"shared_memory_region": "region", "shared_memory_byte_size": 12,
                                                 "shared_memory_offset": 4}
    assert header["inputs"][0]["parameters"] == {"binary_data_size": 12} and len(chunks) == 2
    assert [o["parameters"] for o in header["outputs"]] == [
        {"shared_memory_region": "out", "shared_memory_byte_size": 12}, {"binary_data": True}]


def test_an_output_written_to_shared_memory_answers_an_empty_entry_and_its_parameters():
    head = json.dumps({"model_name": "m", "model_version": "1", "outputs": [
        {"name": "y", "datatype": "INT32", "shape": [1, 3],
         "parameters": {"shared_memory_region": "out", "shared_memory_byte_size": 12}}]}).encode()
    response = infer_response(head, {})
    assert list(response.raw_output_contents) == [b""]
    assert response.outputs[0].parameters["shared_memory_region"].string_param == "out"


def test_a_parameter_of_the_wrong_type_or_size_is_refused_naming_it():
    """Seen: an input's ``binary_data_size`` given as a bool was accepted silently (the edge
    wrote its own over it); ``binary_data`` and ``binary_data_output`` as numbers too."""
    message = request([raw_input("a", "INT32", ARRAYS["INT32"])])
    message.inputs[0].parameters["binary_data_size"].bool_param = True
    with pytest.raises(InvalidInput) as info:
        infer_body(message)
    assert info.value.message == ("input 'a': parameters.binary_data_size must be an integer of bytes (int64_param or "
                                  "uint64_param), got bool true")
    message.inputs[0].parameters["binary_data_size"].int64_param = 5
    with pytest.raises(InvalidInput, match="input 'a': parameters.binary_data_size is 5 bytes but its contents hold 12"):
        infer_body(message)
    message.inputs[0].parameters["binary_data_size"].int64_param = 12
    assert decoded(message).inputs["a"].tolist() == ARRAYS["INT32"].tolist()
    message = request([raw_input("a", "INT32", ARRAYS["INT32"])], [grpcclient.InferRequestedOutput("y")])
    message.outputs[0].parameters["binary_data"].int64_param = 1
    with pytest.raises(InvalidInput, match=r"output 'y': parameters.binary_data must be true or false \(a bool\), "
                                           "got int 1"):
        infer_body(message)
    message = request([raw_input("a", "INT32", ARRAYS["INT32"])])
    message.parameters["binary_data_output"].string_param = "yes"
    with pytest.raises(InvalidInput, match="request: parameters.binary_data_output must be true or false"):
        infer_body(message)
