"""KServe v2 / Open Inference Protocol: JSON request decoding and response encoding.

Source: the Open Inference Protocol REST spec ("Inference Request JSON Object", "Tensor Data").
BYTES elements travel as UTF-8 strings, or base64 when the tensor's parameters carry
``"content_type": "base64"`` (MLServer's convention); responses use base64 only for BYTES
outputs that are not valid UTF-8.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from ..runtime.contract.config import ModelConfig
from ..runtime.contract.datatypes import NUMPY_BY_DATATYPE, check_integer_range, datatype_of
from ..runtime.contract.errors import InvalidInput
from .parameters import (INPUT_PARAMETERS, OUTPUT_PARAMETERS, REQUEST_PARAMETERS, SHARED_MEMORY_PARAMETERS,
                         check_flag, check_parameters, check_priority, check_shared_memory_output, class_count,
                         timeout_s)

DATATYPES = sorted(NUMPY_BY_DATATYPE)


@dataclass
class InferRequest:
    """A decoded infer request: arrays by input name, requested outputs and their parameters."""

    id: str | None
    inputs: dict[str, np.ndarray]
    outputs: list[str] | None = None
    output_parameters: dict[str, dict[str, Any]] = field(default_factory=dict)
    parameters: dict[str, Any] = field(default_factory=dict)
    timeout_s: float | None = None  # Triton's ``timeout`` request parameter


MAX_RANK = 32


def _reject_constant(token: str) -> Any:
    raise InvalidInput(f"request body is not valid JSON: {token} is not allowed (JSON has no NaN or Infinity)")


def _check_finite(value: Any) -> None:
    """Every float of a parsed body outside a ``data`` member finite (json reads a number
    past float64, e.g. 1e999, as Infinity).

    Raises:
        InvalidInput: one is not.
    """
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidInput("request body is not valid JSON: a number in it overflows to Infinity (the largest "
                               f"finite is {sys.float_info.max:g})")
    elif isinstance(value, dict):
        for key, item in value.items():
            if key != "data":
                _check_finite(item)
    elif isinstance(value, list):
        for item in value:
            _check_finite(item)


def parse_json(body: bytes | memoryview) -> Any:
    """Parse a JSON body strictly (UTF-8, or UTF-16/32 as ``json.loads`` detects). Floats are
    parsed by json itself, then checked finite outside tensors' ``data`` (``_check_finite``;
    the decoder checks those as arrays: ``_numeric_array``): a Python check per number held a
    replica's event loop 50 of the 85 ms a 1.5 MB tensor took to decode.

    Raises:
        InvalidInput: not JSON, NaN/Infinity tokens or numbers that overflow to Infinity,
            integers over Python's digit limit, nesting too deep.
    """
    try:
        value = json.loads(bytes(body), parse_constant=_reject_constant)
        _check_finite(value)
        return value
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, the int digit limit
        if "integer string conversion" in str(e):  # Python's own advice names a function only it can call
            raise InvalidInput(f"request body holds an integer of more than {sys.get_int_max_str_digits()} "
                               "digits; no tensor datatype holds one that long") from None
        if isinstance(e, UnicodeDecodeError):  # json's guess of the encoding names a codec the client never chose
            raise InvalidInput(f"request body is not valid JSON: byte {e.start} cannot be decoded as text "
                               "(JSON bodies are UTF-8, UTF-16 or UTF-32 text)") from None
        raise InvalidInput(f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise InvalidInput("request body is not valid JSON: nested too deeply") from None


def _text(where: str, value: str) -> str:
    """``value`` if it encodes as UTF-8 (no lone surrogates such as "\\ud800")."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInput(f"{where} is not valid Unicode text (lone surrogate)") from None
    return value


def _flatten(where: str, data: Any, shape: tuple[int, ...]) -> list:
    """``data`` as a flat list: either flat already, or nested exactly as ``shape``; for shape
    ``[]`` (rank 0) a bare element is taken as a list of it.

    Raises:
        InvalidInput: ``data`` is not a list, or its nesting disagrees with ``shape``.
    """
    if not isinstance(data, list):
        if not shape:  # a rank-0 tensor: its one element alone, or in a list
            return [data]
        raise InvalidInput(f"{where}: 'data' must be a list (flat, or nested as the shape; for shape [] its "
                           "one element, alone or in a list)")
    if list not in map(type, data):  # flat (the scan in C: a tensor's data is 150,528 numbers)
        return data
    out: list = []

    def walk(level: Any, axis: int, path: str) -> None:
        if axis == len(shape):
            if isinstance(level, list):
                raise InvalidInput(f"{where}: data{path} is nested deeper than shape {list(shape)}")
            out.append(level)
            return
        if not isinstance(level, list) or len(level) != shape[axis]:
            got = f"{len(level)} items" if isinstance(level, list) else "a scalar"
            raise InvalidInput(
                f"{where}: data{path} has {got}, shape {list(shape)} needs {shape[axis]} on axis {axis}")
        for i, item in enumerate(level):
            walk(item, axis + 1, f"{path}[{i}]")

    walk(data, 0, "")
    return out


def _check_shape(where: str, shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, list):
        raise InvalidInput(f"{where}: 'shape' must be a list of positive integers, got {json.dumps(shape)[:80]}")
    if len(shape) > MAX_RANK:
        raise InvalidInput(f"{where}: shape has {len(shape)} axes, at most {MAX_RANK} are allowed")
    for axis, d in enumerate(shape):
        if isinstance(d, bool) or not isinstance(d, int):
            raise InvalidInput(f"{where}: shape axis {axis} is {json.dumps(d)[:40]}, must be a positive integer")
        if d <= 0:
            raise InvalidInput(f"{where}: shape axis {axis} is {d}, must be a positive integer (>= 1)")
    return tuple(shape)


def _numeric_array(where: str, datatype: str, flat: list) -> np.ndarray:
    dtype = NUMPY_BY_DATATYPE[datatype]
    try:
        raw = np.asarray(flat)
    except (ValueError, OverflowError):
        raw = np.asarray(flat, dtype=object)
    kind = raw.dtype.kind
    if datatype == "BOOL":
        if kind != "b":
            raise InvalidInput(f"{where}: BOOL data must be true/false values")
        return raw
    if bool in map(type, flat):  # numpy would read true/false as 1/0 among numbers
        raise InvalidInput(f"{where}: {datatype} data must be numbers, not true/false")
    if dtype.kind in "iu":
        if kind not in "iu":  # numpy reads ints no one 64-bit type holds (1 and 2**63, 2**64) as float64 or objects
            if not all(type(x) is int for x in flat):
                raise InvalidInput(f"{where}: {datatype} data must be integers (no fractions, strings, booleans or "
                                   "nulls)")
            check_integer_range(where, datatype, flat)
            return np.array(flat, dtype=dtype)
        check_integer_range(where, datatype, raw)
    elif kind not in "iuf":
        raise InvalidInput(f"{where}: {datatype} data must be numbers (no strings, booleans, nulls or huge integers)")
    if dtype.kind != "f":
        return raw.astype(dtype, copy=False)
    with np.errstate(over="ignore"):
        array = raw.astype(dtype, copy=False)
    if not np.isfinite(array).all():
        raise InvalidInput(f"{where}: values overflow {datatype} (largest finite: {np.finfo(dtype).max:g})")
    return array


def _bytes_array(where: str, flat: list, base64_encoded: bool) -> np.ndarray:
    out = np.empty(len(flat), dtype=object)
    for i, item in enumerate(flat):
        if not isinstance(item, str):
            raise InvalidInput(f"{where}: BYTES data must be strings, element {i} is {type(item).__name__}")
        if base64_encoded:
            try:
                out[i] = base64.b64decode(item, validate=True)
            except (binascii.Error, ValueError):
                raise InvalidInput(f"{where}: element {i} is not valid base64 (content_type is base64)") from None
        else:
            out[i] = _text(f"{where}: element {i}", item).encode("utf-8")
    return out


def tensor_header(obj: Any, index: int) -> tuple[str, str, str, tuple[int, ...], dict[str, Any]]:
    """Check the fields every input tensor has, JSON or binary.

    Returns:
        ``(name, where, datatype, shape, parameters)``; ``where`` names the input for messages.

    Raises:
        InvalidInput: not an object, a bad name, datatype, shape or parameters.
    """
    if not isinstance(obj, dict):
        raise InvalidInput(f"inputs[{index}] must be an object with name, shape, datatype and data")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidInput(f"inputs[{index}]: 'name' must be a non-empty string")
    where = f"input '{_text(f'inputs[{index}] name', name)}'"
    datatype = obj.get("datatype")
    if not isinstance(datatype, str) or datatype not in NUMPY_BY_DATATYPE:
        raise InvalidInput(f"{where}: datatype {json.dumps(datatype)[:40]} is not one of {DATATYPES}")
    shape = _check_shape(where, obj.get("shape"))
    params = obj.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidInput(f"{where}: 'parameters' must be an object")
    check_parameters(where, params, INPUT_PARAMETERS)
    return name, where, datatype, shape, params


def decode_tensor(obj: Any, index: int) -> tuple[str, np.ndarray]:
    """One JSON input tensor -> (name, array shaped as declared).

    Raises:
        InvalidInput: a missing field, an unknown datatype, a bad shape, element count or value.
    """
    name, where, datatype, shape, params = tensor_header(obj, index)
    if any(p in params for p in SHARED_MEMORY_PARAMETERS):  # ``protocol.binary`` reads them where it can
        raise InvalidInput(f"{where}: shared memory is not available on this path; send the data in the body")
    if "data" not in obj:
        raise InvalidInput(f"{where}: 'data' is missing")
    flat = _flatten(where, obj["data"], shape)
    count = math.prod(shape)
    if len(flat) != count:
        raise InvalidInput(f"{where}: shape {list(shape)} needs {count} elements, data has {len(flat)}")
    if datatype == "BYTES":
        content_type = params.get("content_type", "str")
        if content_type not in ("str", "base64"):
            raise InvalidInput(f"{where}: content_type {json.dumps(content_type)[:40]} is not one of "
                               "['base64', 'str'] (BYTES elements travel as UTF-8 text or base64)")
        array = _bytes_array(where, flat, content_type == "base64")
    else:
        array = _numeric_array(where, datatype, flat)
    return name, array.reshape(shape)


def decode_infer_request(payload: Any,
                         decode: Callable[[Any, int], tuple[str, np.ndarray]] = decode_tensor) -> InferRequest:
    """A parsed JSON infer request -> ``InferRequest``.

    ``decode`` turns each ``inputs[i]`` object into ``(name, array)`` (``protocol.binary``
    passes one that also reads tensors from the binary section of the body).

    Raises:
        InvalidInput: the request does not follow the protocol.
    """
    if not isinstance(payload, dict):
        raise InvalidInput("request body must be a JSON object with an 'inputs' list")
    raw_inputs = payload.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise InvalidInput("request needs a non-empty 'inputs' list")
    request_id = payload.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidInput("'id' must be a string")
    if request_id is not None:
        _text("'id'", request_id)
    inputs: dict[str, np.ndarray] = {}
    for i, raw in enumerate(raw_inputs):
        name, array = decode(raw, i)
        if name in inputs:
            raise InvalidInput(f"input '{name}' is given twice")
        inputs[name] = array
    outputs = None
    output_parameters: dict[str, dict[str, Any]] = {}
    raw_outputs = payload.get("outputs")
    if raw_outputs is not None:
        if not isinstance(raw_outputs, list):
            raise InvalidInput("'outputs' must be a list of {\"name\": ...} objects")
        outputs = []
        for i, o in enumerate(raw_outputs):
            if not isinstance(o, dict) or not isinstance(o.get("name"), str):
                raise InvalidInput(f"outputs[{i}] must be an object with a string 'name'")
            params = o.get("parameters") or {}
            if not isinstance(params, dict):
                raise InvalidInput(f"outputs[{i}]: 'parameters' must be an object")
            check_parameters(f"output '{_text(f'outputs[{i}] name', o['name'])}'", params, OUTPUT_PARAMETERS)
            if o["name"] in output_parameters:
                raise InvalidInput(f"output '{o['name']}' is requested twice")
            class_count(f"output '{o['name']}'", params)
            check_flag(f"output '{o['name']}'", params, "binary_data")
            check_shared_memory_output(f"output '{o['name']}'", params)
            outputs.append(_text(f"outputs[{i}] name", o["name"]))
            output_parameters[o["name"]] = params
        outputs = outputs or None  # an empty list requests no output in particular: all of them (Triton)
    parameters = payload.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidInput("'parameters' must be an object")
    check_parameters("request", parameters, REQUEST_PARAMETERS)
    check_priority(parameters)
    check_flag("request", parameters, "binary_data_output")
    return InferRequest(request_id, inputs, outputs, output_parameters, parameters, timeout_s(parameters))


def check_finite(model_name: str, outputs: Mapping[str, np.ndarray]) -> None:
    """Raises InvalidInput when a floating-point output holds NaN or Infinity: JSON cannot carry
    them, and the request can fix it (inputs that overflow the model, or binary outputs)."""
    for name, array in outputs.items():
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            raise InvalidInput(
                f"model '{model_name}' output '{name}' holds NaN or Infinity (NaN or Infinity in the "
                "inputs, or inputs that overflow the model's arithmetic), which JSON cannot carry; send finite "
                "values in range or ask for the output as binary data (parameters.binary_data)")


def encode_tensor(name: str, array: np.ndarray) -> dict[str, Any]:
    """One output array -> a JSON tensor object (flat ``data``)."""
    datatype = datatype_of(array)
    tensor: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
    if datatype == "BYTES":
        items = [x if isinstance(x, bytes) else str(x).encode("utf-8") for x in array.reshape(-1)]
        try:
            tensor["data"] = [x.decode("utf-8") for x in items]
        except UnicodeDecodeError:
            tensor["data"] = [base64.b64encode(x).decode("ascii") for x in items]
            tensor["parameters"] = {"content_type": "base64"}
    else:
        tensor["data"] = array.reshape(-1).tolist()
    return tensor


def encode_infer_response(model_name: str, model_version: str, request_id: str | None,
                          outputs: Mapping[str, np.ndarray], parameters: Mapping[str, Any] | None = None) -> bytes:
    """Outputs -> the JSON infer response body (UTF-8); ``parameters``: the response's own
    (left out when empty).

    Raises:
        InvalidInput: an output holds NaN or Infinity, which JSON cannot carry.
    """
    body: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if request_id is not None:
        body["id"] = request_id
    if parameters:
        body["parameters"] = dict(parameters)
    check_finite(model_name, outputs)
    body["outputs"] = [encode_tensor(n, a) for n, a in outputs.items()]
    return json.dumps(body, separators=(",", ":"), allow_nan=False, ensure_ascii=False).encode("utf-8")


def model_metadata(config: ModelConfig, versions: Iterable[int], platform: str,
                   backend: str | None = None) -> dict[str, Any]:
    """The model metadata response object (``GET /v2/models/{name}``); ``backend`` (the backend a
    replica runs, e.g. ``onnxruntime_cuda``, whose platform is Triton's ``onnxruntime_onnx``) is
    added as an extra field when known."""
    def tensors(specs):
        return [{"name": t.name, "datatype": t.datatype, "shape": list(t.dims)} for t in specs]

    return {
        "name": config.name,
        "versions": [str(v) for v in versions],
        "platform": platform,
        "inputs": tensors(config.inputs),
        "outputs": tensors(config.outputs),
    } | ({"backend": backend} if backend else {})
