"""Triton's binary tensor data extension for KServe v2 HTTP requests and responses.

Source: Triton Inference Server, "Binary Tensor Data Extension"
(docs/protocol/extension_binary_data.md), as ``tritonclient.http`` speaks it.

Request: the ``Inference-Header-Content-Length: N`` header says the body's first ``N`` bytes
are the JSON infer request; the bytes after it are the raw data of every input whose
``parameters`` carry ``binary_data_size``, one after another in the order of ``inputs``.
Raw data is row-major and little-endian; BOOL takes one byte per element, 0 or 1; BYTES is, per
element, a 4-byte little-endian length then that many bytes.

Response: an output is binary when its ``outputs[i].parameters.binary_data`` is true, or when
the request's ``parameters.binary_data_output`` is true and the output does not say
``binary_data: false``. The JSON header then lists it with ``parameters.binary_data_size``
and no ``data``; its bytes follow the header in output order, and the response carries
``Inference-Header-Content-Length``. With no binary output the response is plain JSON.

Zero copy: ``decode_body`` parses the header length once and ``join_body`` places the body in one buffer whose binary section starts on a
64-byte boundary, and numeric inputs are ``np.frombuffer`` views of it (copied only when an
input's offset is not a multiple of its element size).
"""

from __future__ import annotations

import json
import math
import re
import struct
import sys
from typing import Any, Iterable, Mapping, Protocol

import numpy as np

from ..runtime.contract.datatypes import NUMPY_BY_DATATYPE, datatype_of
from ..runtime.contract.device import DeviceTensor
from ..runtime.contract.errors import InvalidInput
from .parameters import SHARED_MEMORY_PARAMETERS, check_flag
from .v2 import (
    InferRequest,
    check_finite,
    decode_infer_request,
    decode_tensor,
    encode_infer_response,
    encode_tensor,
    parse_json,
    tensor_header,
)

HEADER_LENGTH = "inference-header-content-length"
JSON_MEDIA_TYPE = "application/json"
BINARY_MEDIA_TYPE = "application/octet-stream"
_ALIGN = 64
_LENGTH_PREFIX = struct.Struct("<I")
_LENGTH = re.compile(r"[0-9]{1,18}")  # ASCII digits only: str.isdigit() also takes superscripts

Body = bytes | bytearray | memoryview


def parse_header_length(value: str | None, body_bytes: int) -> int | None:
    """The JSON header's length from ``Inference-Header-Content-Length`` (None: no header).

    Raises:
        InvalidInput: not a non-negative integer, or longer than the body.
    """
    if value is None:
        return None
    text = value.strip()
    if not _LENGTH.fullmatch(text):
        raise InvalidInput(f"Inference-Header-Content-Length must be a non-negative integer, got {value[:40]!r}")
    length = int(text)
    if length > body_bytes:
        raise InvalidInput(
            f"Inference-Header-Content-Length is {length} bytes but the body has only {body_bytes} bytes")
    return length


def join_body(chunks: list[bytes], header_length: int | None) -> Body:
    """Join the body's chunks into one buffer (one copy, as ``b"".join``).

    For a binary request (``header_length`` from ``parse_header_length``, not None) the buffer
    is placed so that the binary section (after the JSON header) starts 64-byte aligned, so
    numeric inputs decode as aligned views without a copy.
    """
    size = sum(len(c) for c in chunks)
    if header_length is None or header_length == size:
        return b"".join(chunks)
    joined = memoryview(aligned_buffer(size, header_length)).cast("B")
    pos = 0
    for chunk in chunks:  # a memoryview slice copies without making a numpy view per chunk
        end = pos + len(chunk)
        joined[pos:end] = chunk
        pos = end
    return joined


def aligned_buffer(size: int, lead: int = 0) -> np.ndarray:
    """A new uninitialized ``uint8`` array of ``size`` bytes whose byte ``lead`` starts on a
    64-byte boundary (so numeric tensors from there on decode as aligned views)."""
    raw = np.empty(size + _ALIGN, dtype=np.uint8)
    start = -(raw.ctypes.data + lead) % _ALIGN
    return raw[start:start + size]


def decode_body(chunks: list[bytes], header_value: str | None, shm: TensorReader | None = None) -> InferRequest:
    """A request body as it arrived (its chunks) -> ``InferRequest``: the
    ``Inference-Header-Content-Length`` header is parsed once, then the chunks are joined
    (``join_body``) and decoded (``decode_request``, inputs in shared memory read by ``shm``).

    Raises:
        InvalidInput: a malformed header length, or a body that does not follow the protocol.
    """
    length = parse_header_length(header_value, sum(len(c) for c in chunks))
    return decode_request(join_body(chunks, length), length, shm)


class TensorReader(Protocol):
    """Reads an input that lives in shared memory (``protocol.shared_memory.SharedMemory``)."""

    def read_input(self, where: str, datatype: str, shape: tuple[int, ...],
                   params: Mapping[str, Any]) -> np.ndarray | DeviceTensor: ...


_SOURCES = ("data", "binary_data_size", "shared_memory_region")


def _one_source(obj: dict, params: Mapping[str, Any]) -> None:
    """Raises InvalidInput unless an input gives exactly one of ``data``,
    ``parameters.binary_data_size`` and ``parameters.shared_memory_region`` (Triton's words,
    ``ValidateInputContentType``)."""
    given = [s for s in _SOURCES if (s in obj if s == "data" else s in params)]
    if len(given) != 1:
        raise InvalidInput(
            "Input must set only one of the following fields: 'data', 'binary_data_size' in 'parameters', "
            "'shared_memory_region' in 'parameters'. But " + (
                "no field is set" if not given else "set " + " ".join(f"'{s}'" for s in given)))


class _BinarySection:
    """Reads input tensors from the binary section of a body, in order, or from shared memory
    (``shm``; None: an input in shared memory is refused)."""

    def __init__(self, data: memoryview, has_header: bool, shm: TensorReader | None = None) -> None:
        self.data = data
        self.offset = 0
        self.has_header = has_header
        self.shm = shm

    def decode(self, obj: Any, index: int) -> tuple[str, np.ndarray]:
        """``inputs[index]`` -> (name, array): from the binary section when it has
        ``parameters.binary_data_size``, from shared memory when it has
        ``parameters.shared_memory_region``, else from its JSON ``data``.

        Raises:
            InvalidInput: more or less than one of them; the size is not a non-negative
                integer, runs past the body or disagrees with shape x datatype (the message
                gives both byte counts); as ``SharedMemory.read_input``.
        """
        params = obj.get("parameters") if isinstance(obj, dict) else None
        if not isinstance(params, dict) or not ("binary_data_size" in params
                                                or any(p in params for p in SHARED_MEMORY_PARAMETERS)):
            return decode_tensor(obj, index)
        name, where, datatype, shape, params = tensor_header(obj, index)
        _one_source(obj, params)
        if any(p in params for p in SHARED_MEMORY_PARAMETERS):
            if self.shm is None:
                raise InvalidInput(f"{where}: shared memory is not available on this path; send the data in the body")
            return name, self.shm.read_input(where, datatype, shape, params)
        size = params["binary_data_size"]
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise InvalidInput(f"{where}: binary_data_size must be a non-negative integer, got {size!r}"[:200])
        remaining = len(self.data) - self.offset
        if size > remaining:
            if not self.has_header:
                raise InvalidInput(
                    f"{where}: binary_data_size is {size} bytes but the request has no "
                    "Inference-Header-Content-Length header (binary tensor data extension)")
            raise InvalidInput(
                f"{where}: binary_data_size is {size} bytes but only {remaining} bytes of binary "
                "data remain in the body")
        raw = self.data[self.offset:self.offset + size]
        self.offset += size
        return name, tensor_from_bytes(where, raw, datatype, shape, "binary_data_size")

    def finish(self) -> None:
        """Raises InvalidInput when bytes are left over after the last binary input."""
        left = len(self.data) - self.offset
        if left:
            raise InvalidInput(
                f"the body has {left} bytes after the binary data of every input "
                f"({self.offset} bytes declared by binary_data_size)")


def tensor_from_bytes(where: str, raw: memoryview, datatype: str, shape: tuple[int, ...], source: str) -> np.ndarray:
    """A tensor of ``datatype`` and ``shape`` from its raw bytes (the binary tensor data
    extension's layout; shared memory's is the same): a view of ``raw`` for a numeric datatype
    (copied only when misaligned). ``source`` names the parameter that gave the bytes' size,
    for messages.

    Raises:
        InvalidInput: the byte count is not shape x datatype, a BOOL byte is not 0 or 1, BYTES
            lengths overrun.
    """
    count = math.prod(shape)
    if datatype == "BYTES":
        array = _decode_bytes(where, raw, count, source)
    else:
        array = _decode_fixed(where, raw, datatype, shape, count, source)
    return array.reshape(shape)


def fixed_byte_size(where: str, datatype: str, shape: tuple[int, ...], got: int, source: str) -> int:
    """The bytes of a ``datatype`` (not BYTES) tensor of ``shape``, when ``got`` (the size
    ``source`` gives) is that.

    Raises:
        InvalidInput: ``got`` differs (Triton's words, then both byte counts).
    """
    expected = math.prod(shape) * NUMPY_BY_DATATYPE[datatype].itemsize
    if got != expected:
        raise InvalidInput(
            f"input byte size mismatch for {where}. Expected {expected}, got {got}; {where}: shape "
            f"{list(shape)} x {datatype} needs {expected} bytes, {source} gives {got} bytes")
    return expected


def _decode_fixed(where: str, raw: memoryview, datatype: str, shape: tuple[int, ...], count: int,
                  source: str) -> np.ndarray:
    dtype = NUMPY_BY_DATATYPE[datatype].newbyteorder("<")
    fixed_byte_size(where, datatype, shape, len(raw), source)
    if datatype == "BOOL":
        _check_bool_bytes(where, raw)
    array = np.frombuffer(raw, dtype=dtype, count=count)
    if not array.flags.aligned:  # an offset not a multiple of the element size
        array = array.copy()
    return array if dtype.isnative else array.astype(dtype.newbyteorder("="))


def _check_bool_bytes(where: str, raw: memoryview) -> None:
    """Raises InvalidInput when a BOOL byte is not 0 or 1 (numpy would read 2 as an odd True)."""
    as_bytes = np.frombuffer(raw, dtype=np.uint8)
    bad = np.flatnonzero(as_bytes > 1)
    if bad.size:
        raise InvalidInput(
            f"{where}: BOOL element {bad[0]} is byte {as_bytes[bad[0]]} ({bad.size} such bytes); the binary "
            "tensor data extension allows only 0 (false) and 1 (true)")


def _decode_bytes(where: str, raw: memoryview, count: int, source: str) -> np.ndarray:
    if count > len(raw) // _LENGTH_PREFIX.size:  # checked before allocating ``count`` slots
        raise InvalidInput(
            f"{where}: {count} BYTES elements need at least {count * _LENGTH_PREFIX.size} bytes "
            f"(a 4-byte length each), {source} gives {len(raw)} bytes")
    out = np.empty(count, dtype=object)
    pos, end = 0, len(raw)
    for i in range(count):
        if pos + 4 > end:
            raise InvalidInput(
                f"{where}: BYTES element {i} of {count} starts at byte {pos}, past the "
                f"{end} bytes given by {source} (each element is a 4-byte length, then its bytes)")
        (length,) = _LENGTH_PREFIX.unpack_from(raw, pos)
        pos += 4
        if pos + length > end:
            raise InvalidInput(
                f"{where}: BYTES element {i} says {length} bytes but only {end - pos} bytes remain "
                f"of {source} {end}")
        out[i] = bytes(raw[pos:pos + length])
        pos += length
    if pos != end:
        raise InvalidInput(
            f"{where}: {count} BYTES elements take {pos} bytes, {source} gives {end} bytes")
    return out


def decode_request(body: Body, header_length: int | None, shm: TensorReader | None = None) -> InferRequest:
    """An infer request body, JSON or binary, -> ``InferRequest``.

    Args:
        body: the whole request body (``join_body``'s result or plain bytes).
        header_length: the JSON header's length in bytes (``parse_header_length`` of the
            ``Inference-Header-Content-Length`` header), or None for plain JSON.
        shm: reads the inputs in shared memory (None: such an input is refused).

    Raises:
        InvalidInput: the JSON or the binary section does not follow the protocol.
    """
    view = memoryview(body).cast("B")
    if header_length is None:
        header, section = view, _BinarySection(view[:0], has_header=False, shm=shm)
    else:
        header, section = view[:header_length], _BinarySection(view[header_length:], has_header=True, shm=shm)
    try:
        parsed = parse_json(bytes(header))
    except InvalidInput as e:
        if header_length is None:
            raise InvalidInput(
                f"{e.message}. An infer request's body is a KServe v2 JSON object {{\"inputs\": [...]}} "
                "(a file such as an image goes in a BYTES input: base64 in JSON with parameters "
                "{\"content_type\": \"base64\"}), or, with the binary tensor extension, that JSON "
                "header followed by the tensors' bytes and its length in the Inference-Header-Content-Length "
                "header") from None
        raise InvalidInput(
            f"the body's first {header_length} bytes (Inference-Header-Content-Length) are not one "
            f"JSON object: {e.message}; the header must give the exact length of the JSON part, "
            "with the binary tensor data after it") from None
    request = decode_infer_request(parsed, decode=section.decode)
    section.finish()
    return request


def binary_outputs(request: InferRequest, names: Iterable[str]) -> set[str]:
    """Names among ``names`` to answer in binary form (see the module docstring).

    Raises:
        InvalidInput: ``binary_data`` or ``binary_data_output`` is not a boolean.
    """
    default = bool(check_flag("request", request.parameters, "binary_data_output"))
    chosen = set()
    for name in names:
        own = check_flag(f"output '{name}'", request.output_parameters.get(name, {}), "binary_data")
        if own if own is not None else default:
            chosen.add(name)
    return chosen


def raw_bytes(array: np.ndarray) -> bytes | memoryview:
    """An array's bytes as the binary tensor data extension lays them out (and shared memory):
    row-major little-endian; BYTES as a 4-byte little-endian length then the bytes, per element."""
    if datatype_of(array) == "BYTES":
        parts = []
        for x in array.reshape(-1):
            item = x if isinstance(x, bytes) else str(x).encode("utf-8")
            parts.append(_LENGTH_PREFIX.pack(len(item)))
            parts.append(item)
        return b"".join(parts)
    array = np.asarray(array)  # a subclass (np.matrix) keeps two axes through reshape(-1)
    if not (array.dtype.byteorder in "=|" and sys.byteorder == "little" and array.flags.c_contiguous):
        array = np.asarray(array, dtype=array.dtype.newbyteorder("<"), order="C")
    return memoryview(array.reshape(-1).view(np.uint8))  # an empty tensor too (a cast refuses a 0 in the shape)


class OutputWriter(Protocol):
    """Writes outputs into shared memory (``protocol.shared_memory.SharedMemory``)."""

    def write_outputs(self, request_params: Mapping[str, Mapping[str, Any]],
                      outputs: Mapping[str, np.ndarray]) -> dict[str, dict[str, Any]]: ...


def _in_shared_memory(request: InferRequest, outputs: Mapping[str, np.ndarray],
                      shm: OutputWriter | None) -> dict[str, dict[str, Any]]:
    """The outputs written to shared memory by ``shm`` (output name -> the parameters its answer
    echoes).

    Raises:
        InvalidInput: an output asks for shared memory where there is none (``shm`` None).
        SharedMemoryError: as ``SharedMemory.write_outputs``.
    """
    if shm is not None:
        return shm.write_outputs(request.output_parameters, outputs)
    for name in outputs:
        if "shared_memory_region" in request.output_parameters.get(name, {}):
            raise InvalidInput(f"output '{name}': shared memory is not available on this path; ask for it in the body")
    return {}


def encode_response(model_name: str, model_version: str, request: InferRequest,
                    outputs: Mapping[str, np.ndarray], parameters: Mapping[str, Any] | None = None,
                    shm: OutputWriter | None = None) -> tuple[bytes, dict[str, str]]:
    """Outputs -> (response body, response headers), binary where the request asks, written to
    shared memory where the request asks (``shm``: listed without data, their shared-memory
    parameters echoed); ``parameters``: the response's own (none when empty).

    Raises:
        InvalidInput: a binary flag is not a boolean, or a JSON output holds NaN or Infinity
            (binary and shared-memory outputs may; ``v2.check_finite``); as ``_in_shared_memory``.
    """
    in_shm = _in_shared_memory(request, outputs, shm)
    binary = binary_outputs(request, [n for n in outputs if n not in in_shm])
    if not binary and not in_shm:
        return encode_infer_response(model_name, model_version, request.id, outputs, parameters), {
            "content-type": JSON_MEDIA_TYPE}
    check_finite(model_name, {n: a for n, a in outputs.items() if n not in binary and n not in in_shm})
    header: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if request.id is not None:
        header["id"] = request.id
    if parameters:
        header["parameters"] = dict(parameters)
    tensors, buffers = [], []
    for name, array in outputs.items():
        if name in in_shm:
            tensors.append({"name": name, "datatype": datatype_of(array), "shape": list(array.shape),
                            "parameters": in_shm[name]})
        elif name in binary:
            raw = raw_bytes(array)
            tensors.append({"name": name, "datatype": datatype_of(array), "shape": list(array.shape),
                            "parameters": {"binary_data_size": len(raw)}})
            buffers.append(raw)
        else:
            tensors.append(encode_tensor(name, array))
    header["outputs"] = tensors
    head = json.dumps(header, separators=(",", ":"), allow_nan=False, ensure_ascii=False).encode("utf-8")
    if not buffers:
        return head, {"content-type": JSON_MEDIA_TYPE}
    return b"".join([head, *buffers]), {"content-type": BINARY_MEDIA_TYPE, HEADER_LENGTH: str(len(head))}
