"""KServe v2 gRPC (``inference.GRPCInferenceService``, Triton's ``grpc_service.proto``) messages
to and from the HTTP binary tensor data extension (``protocol.binary``).

Source: Triton Inference Server, docs/protocol/extension_binary_data.md and
``grpc_service.proto`` (``ModelInferRequest``, ``InferTensorContents``), as the generated
modules of ``tritonclient.grpc`` (``service_pb2``) define them; no proto of this project's own.

The gRPC edge (``deployments.grpc_service``) hands the router's infer route the same body an
HTTP client of the binary extension sends, so that both protocols share one decoder, one set of
checks and one error text: ``infer_body`` writes a ``ModelInferRequest`` as a JSON header plus
one binary chunk per input, ``infer_response`` reads the binary answer back into a
``ModelInferResponse`` (every output as ``raw_output_contents``, as Triton answers).

Tensor contents: ``raw_input_contents`` (one entry per input, in ``inputs`` order: all inputs
or none) are passed on as they came, without a copy; typed ``contents`` (``bool_contents``,
``int_contents`` ... ``bytes_contents``) become the same raw little-endian bytes (BYTES: a
4-byte little-endian length before each element). FP16 and BF16 have no typed field: raw only. An input or output in shared memory carries its
``shared_memory_*`` parameters, as over HTTP (``protocol.shared_memory``).

Shared-memory register and status messages to and from the HTTP routes' JSON:
``system_register_body``, ``cuda_register_body``, ``region_statuses``.
"""

from __future__ import annotations

import base64
import json
import math
import struct
from typing import Any, Iterable, Mapping

import numpy as np
from google.protobuf.json_format import ParseDict
from tritonclient.grpc import service_pb2 as pb

from ..runtime.contract.datatypes import NUMPY_BY_DATATYPE, check_integer_range
from ..runtime.contract.errors import InvalidInput
from .binary import HEADER_LENGTH, fixed_byte_size, tensor_from_bytes
from .parameters import check_flag

# The typed contents field of each datatype (grpc_service.proto, ``InferTensorContents``).
CONTENTS_FIELD = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
                  "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
                  "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
                  "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents"}
_LENGTH_PREFIX = struct.Struct("<I")


def parameter_value(parameter: Any) -> Any:
    """The value of an ``InferParameter`` or ``ModelRepositoryParameter`` as JSON holds it
    (None: none of its fields set; ``bytes_param`` as base64 text)."""
    which = parameter.WhichOneof("parameter_choice")
    if which is None:
        return None
    value = getattr(parameter, which)
    return base64.b64encode(value).decode("ascii") if isinstance(value, bytes) else value


def parameters(params: Mapping[str, Any]) -> dict[str, Any]:
    """A protobuf parameter map as a JSON object."""
    return {key: parameter_value(value) for key, value in params.items()}


def set_parameter(parameter: Any, value: Any) -> None:
    """Fill an ``InferParameter`` from a JSON value (bool, int, float or text; others as JSON text)."""
    if isinstance(value, bool):
        parameter.bool_param = value
    elif isinstance(value, int) and -(1 << 63) <= value < (1 << 63):
        parameter.int64_param = value
    elif isinstance(value, int) and 0 <= value < (1 << 64):
        parameter.uint64_param = value
    elif isinstance(value, float):
        parameter.double_param = value
    elif isinstance(value, str):
        parameter.string_param = value
    else:
        parameter.string_param = json.dumps(value)


def _typed_contents(where: str, datatype: str, shape: list[int], contents: Any) -> bytes:
    """An input's typed ``contents`` as the raw little-endian bytes of the binary extension.

    Raises:
        InvalidInput: a field other than the datatype's is set, the element count differs from
            the shape's, or an integer falls outside the datatype.
    """
    given = [field.name for field, _ in contents.ListFields()]
    if datatype not in NUMPY_BY_DATATYPE or any(d <= 0 for d in shape):
        return b""  # the decoder names the datatype or axis, as over HTTP
    wanted = CONTENTS_FIELD.get(datatype)
    if wanted is None:
        raise InvalidInput(f"{where}: {datatype} has no typed contents field; send it in raw_input_contents")
    if given != [wanted]:
        raise InvalidInput(f"{where}: a {datatype} input takes its values in contents.{wanted}, got "
                           f"{['contents.' + name for name in given]}")
    values = getattr(contents, wanted)
    count = math.prod(shape)
    if len(values) != count:
        raise InvalidInput(f"{where}: shape {shape} needs {count} elements, contents.{wanted} has {len(values)}")
    if datatype == "BYTES":
        return b"".join(_LENGTH_PREFIX.pack(len(item)) + item for item in values)
    dtype = NUMPY_BY_DATATYPE[datatype].newbyteorder("<")
    # The range is checked on the Python ints and numpy is given the dtype: left to infer one,
    # numpy read protobuf 6's repeated uint64 field (and a list mixing 0 with 2**64 - 1) as
    # float64, and 2**64 - 1 came out as 0.
    if dtype.kind in "iu":
        check_integer_range(where, datatype, values)
    return np.array(list(values), dtype=dtype).tobytes()


def _in_shared_memory(params: Mapping[str, Any]) -> bool:
    return "shared_memory_region" in params


def infer_body(request: Any) -> tuple[list[bytes], int]:
    """A ``ModelInferRequest`` as the binary extension's HTTP body: its chunks (the JSON
    header, then each input's bytes) and the header's length (``Inference-Header-Content-Length``).
    Every output is asked for in binary form (``infer_response`` reads it so), but one in shared
    memory. An input in shared memory (``shared_memory_region``) takes no raw entry and sends no
    bytes: the replica reads it from its region, as over HTTP (so ``tritonclient.grpc`` sends it).

    Raises:
        InvalidInput: ``raw_input_contents`` not one entry per input outside shared memory, an
            input with raw and typed contents (or either beside a region), or typed contents
            that do not fit (``_typed_contents``). What the body itself gets wrong (datatype,
            shape, byte counts, parameters) is the decoder's to say, in the same words as over HTTP.
    """
    raw = list(request.raw_input_contents)
    carried = [t for t in request.inputs if not _in_shared_memory(t.parameters)]
    if raw and len(raw) != len(carried):
        raise InvalidInput(f"raw_input_contents has {len(raw)} entries for {len(carried)} inputs (not counting "
                           "inputs in shared memory); give one per input, in the order of inputs (or typed "
                           "contents for every input)")
    entries = iter(raw)
    inputs, chunks = [], []
    for tensor in request.inputs:
        where = f"input '{tensor.name}'"
        params = parameters(tensor.parameters)
        has_contents = tensor.HasField("contents")
        if _in_shared_memory(params):
            if has_contents:
                raise InvalidInput(f"{where}: give either contents or parameters.shared_memory_region, not both")
            inputs.append({"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape),
                           "parameters": params})
            continue
        if raw and has_contents:
            raise InvalidInput(f"{where}: give either contents or raw_input_contents, not both")
        if raw:
            data = next(entries)
            _check_raw_size(where, tensor.datatype, list(tensor.shape), data)
        elif has_contents:
            data = _typed_contents(where, tensor.datatype, list(tensor.shape), tensor.contents)
        else:
            _check_no_data(where, tensor.datatype, list(tensor.shape))
            data = b""
        _check_given_size(where, params, len(data))
        inputs.append({"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape),
                       "parameters": {**params, "binary_data_size": len(data)}})
        chunks.append(data)
    given = parameters(request.parameters)
    check_flag("request", given, "binary_data_output")
    header: dict[str, Any] = {"inputs": inputs, "parameters": {**given, "binary_data_output": True}}
    if request.id:
        header["id"] = request.id
    if request.outputs:
        header["outputs"] = []
        for o in request.outputs:
            params = parameters(o.parameters)
            check_flag(f"output '{o.name}'", params, "binary_data")
            header["outputs"].append({"name": o.name, "parameters": params if _in_shared_memory(params) else
                                      {**params, "binary_data": True}})
    head = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return [head, *chunks], len(head)


def _check_raw_size(where: str, datatype: str, shape: list[int], data: bytes) -> None:
    """An input's ``raw_input_contents`` entry holds shape x datatype bytes (a datatype of fixed
    size), or, for BYTES, one 4-byte length and that many bytes per element (a datatype or shape
    the decoder refuses is the decoder's to name). Checked here so that the message names the
    gRPC field: the body the edge writes gives the size as ``binary_data_size``, which a gRPC
    request does not have.

    Raises:
        InvalidInput: another byte count (Triton's words, then both byte counts), BYTES lengths
            that overrun or fall short of the entry.
    """
    if datatype not in NUMPY_BY_DATATYPE or any(d < 0 for d in shape):
        return
    if datatype == "BYTES":
        tensor_from_bytes(where, memoryview(data), datatype, tuple(shape), "raw_input_contents")
    else:
        fixed_byte_size(where, datatype, tuple(shape), len(data), "raw_input_contents")


def _check_no_data(where: str, datatype: str, shape: list[int]) -> None:
    """An input with neither a ``raw_input_contents`` entry nor ``contents`` (nor a region)
    holds no elements.

    Raises:
        InvalidInput: its shape has elements; names the fields that carry them.
    """
    if datatype not in NUMPY_BY_DATATYPE or any(d < 0 for d in shape) or math.prod(shape) == 0:
        return
    needs = (f"{math.prod(shape)} elements" if datatype == "BYTES" else
             f"{math.prod(shape) * NUMPY_BY_DATATYPE[datatype].itemsize} bytes")
    raise InvalidInput(f"{where} has no data: shape {shape} x {datatype} needs {needs}; give them in "
                       "raw_input_contents (one entry per input, in the order of inputs), in the input's "
                       "contents, or in shared memory (parameters.shared_memory_region)")


def _check_given_size(where: str, params: Mapping[str, Any], size: int) -> None:
    """An input's own ``binary_data_size`` parameter (the edge sets it to its contents' bytes):
    absent, or an integer (``int64_param`` / ``uint64_param``) equal to ``size``.

    Raises:
        InvalidInput: another type (a bool, a string) or another size; names the parameter.
    """
    given = params.get("binary_data_size")
    if given is None:
        return
    if isinstance(given, bool) or not isinstance(given, int):
        raise InvalidInput(f"{where}: parameters.binary_data_size must be an integer of bytes (int64_param or "
                           f"uint64_param), got {type(given).__name__} {json.dumps(given)[:40]}")
    if given != size:
        raise InvalidInput(f"{where}: parameters.binary_data_size is {given} bytes but its contents hold {size}; "
                           "leave it out (the contents' size is taken)")


def _json_data_bytes(tensor: Mapping[str, Any]) -> bytes:
    """The raw bytes of an output answered as JSON ``data`` (the binary extension's layout)."""
    data, datatype = tensor["data"], tensor["datatype"]
    if datatype == "BYTES":
        b64 = (tensor.get("parameters") or {}).get("content_type") == "base64"
        items = [base64.b64decode(x) if b64 else x.encode("utf-8") for x in data]
        return b"".join(_LENGTH_PREFIX.pack(len(x)) + x for x in items)
    return np.asarray(data, dtype=NUMPY_BY_DATATYPE[datatype].newbyteorder("<")).tobytes()


def infer_response(content: bytes, headers: Mapping[str, str]) -> Any:
    """The router's infer answer (``content`` and its ``headers``: binary extension or JSON) as
    a ``ModelInferResponse``, every output's bytes in ``raw_output_contents`` (an empty entry
    for one written to shared memory, whose parameters it echoes)."""
    length = headers.get(HEADER_LENGTH)
    head_bytes = content if length is None else content[:int(length)]
    head = json.loads(head_bytes)
    response = pb.ModelInferResponse(model_name=head["model_name"], model_version=head["model_version"],
                                     id=head.get("id", ""))
    for key, value in (head.get("parameters") or {}).items():
        set_parameter(response.parameters[key], value)
    offset = len(head_bytes)
    view = memoryview(content)
    for tensor in head["outputs"]:
        response.outputs.add(name=tensor["name"], datatype=tensor["datatype"], shape=tensor["shape"])
        params = tensor.get("parameters") or {}
        size = params.get("binary_data_size")
        if _in_shared_memory(params):
            for key, value in params.items():
                set_parameter(response.outputs[-1].parameters[key], value)
            response.raw_output_contents.append(b"")
        elif size is None:
            response.raw_output_contents.append(_json_data_bytes(tensor))
        else:
            response.raw_output_contents.append(bytes(view[offset:offset + size]))
            offset += size
    return response


def json_message(value: Any, message: Any) -> Any:
    """``message`` (a protobuf message) filled from ``value``, the JSON an HTTP route answered
    (its fields are the proto's; fields the proto lacks, such as metadata's ``backend``, are left out)."""
    return ParseDict(value, message, ignore_unknown_fields=True)


def repository_body(params: Mapping[str, Any]) -> dict[str, Any]:
    """A load / unload request's ``parameters`` as the HTTP route's JSON body."""
    return {"parameters": parameters(params)} if params else {}


def system_register_body(request: Any) -> dict[str, Any]:
    """A ``SystemSharedMemoryRegisterRequest`` as the HTTP register route's body."""
    return {"key": request.key, "offset": request.offset, "byte_size": request.byte_size}


def cuda_register_body(request: Any) -> dict[str, Any]:
    """A ``CudaSharedMemoryRegisterRequest`` as the HTTP register route's body."""
    return {"raw_handle": {"b64": base64.b64encode(request.raw_handle).decode("ascii")},
            "device_id": request.device_id, "byte_size": request.byte_size}


def region_statuses(regions: list[dict[str, Any]], message: Any) -> Any:
    """The HTTP status route's list of regions as a ``*SharedMemoryStatusResponse`` (``message``),
    its ``regions`` map keyed by name."""
    return json_message({"regions": {region["name"]: region for region in regions}}, message)
