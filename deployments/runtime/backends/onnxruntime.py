"""ONNX Runtime backend (CPU): the default on machines without a CUDA GPU; ``check_signature``
and ``session_options`` serve the CUDA backend (``onnxruntime_cuda``) too.

BYTES tensors are ONNX ``tensor(string)``: ONNX Runtime takes numpy object arrays of ``str`` (it
would turn a ``bytes`` element into the text ``"b'...'"``) and returns ``str`` elements. The
context decodes BYTES inputs as UTF-8 (strictly: other bytes are a client error) and encodes
string outputs back to UTF-8 ``bytes``, so the protocol layer sees bytes both ways.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Mapping

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as ort_errors

from ..contract.config import ModelConfig
from ..contract.datatypes import ONNX_TYPE_BY_DATATYPE
from .base import Footprint
from .process import measured_rss_bytes
from ..contract.errors import (ConfigError, DeviceOutOfMemory, InferenceError, InvalidInput, InvalidModelFile,
                               ServingError, unreadable_model_file, unsupported_operator)
from ..contract.files import shown_model_file
from ..contract.repository import MODEL_FILENAME

logger = logging.getLogger(__name__)


_UNREGISTERED_OP = re.compile(r"(?:Fatal error: )?([\w.]*):(\w+)\(-?\d+\) is not a registered function/op")
_NOT_IMPLEMENTED_OP = re.compile(r"Could not find an implementation for (\w+)\((\d+)\)")


def session_error(model: str, path: Path, error: Exception) -> ServingError:
    """The error for an ONNX Runtime session that could not be created from ``path``: an
    operator it does not implement (``unsupported_operator``: a custom domain's, or one of a
    standard domain without a kernel for these types), ``unreadable_model_file`` for a file that
    does not parse or is missing (ONNX Runtime's text, which names the full path, goes to the
    log only), else ONNX Runtime's reason for a file that parses but makes no session (a graph
    whose types do not check, an operator that cannot start: ``_session_reason``)."""
    text = str(error)
    if (found := _UNREGISTERED_OP.search(text)) is not None:
        return unsupported_operator(model, shown_model_file(path), found.group(2), found.group(1))
    if (found := _NOT_IMPLEMENTED_OP.search(text)) is not None:
        return unsupported_operator(model, shown_model_file(path), found.group(1), "")
    if not path.is_file():
        return unreadable_model_file(model, "ONNX Runtime", FileNotFoundError(str(path)), shown_model_file(path))
    if isinstance(error, ort_errors.InvalidProtobuf) or _NO_GRAPH in text:
        return unreadable_model_file(model, "ONNX Runtime", error, shown_model_file(path))
    return InvalidModelFile(f"model '{model}': ONNX Runtime could not create a session from its model file "
                            f"{shown_model_file(path)}: {_session_reason(error, path)}")


_NO_GRAPH = "No graph was found in the protobuf"  # ONNX Runtime's words for an empty file
_ORT_PREFIX = re.compile(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ")
# Where in ONNX Runtime's sources it failed (``/onnxruntime_src/.../x.cc:235 onnxruntime::...()::<lambda()> ``)
_SOURCE_LOCATION = re.compile(r"\S+\.(?:cc|cpp|h):\d+ .*?(?:\)|>) (?=\S)")


def _session_reason(error: Exception, path: Path) -> str:
    """ONNX Runtime's reason a session of a file that parses could not be made (a graph whose
    types do not check, an operator's attribute it cannot use), for a client: its first line,
    without its error prefix, the file's full path or the source location it failed at (the
    error's type where it says nothing)."""
    text = str(error).strip()
    line = _ORT_PREFIX.sub("", text.splitlines()[0] if text else type(error).__name__)
    line = line.replace(f"Load model from {path} failed:", "").replace(str(path), shown_model_file(path))
    line = line.replace("Exception during initialization: ", "")
    line = _SOURCE_LOCATION.sub("", line, count=1).strip()
    return (line[:300] + " ...") if len(line) > 300 else line


def _text_array(model: str, name: str, array: np.ndarray) -> np.ndarray:
    """A BYTES input (object array of ``bytes``, or a numpy ``S``/``U`` array) -> object array of
    ``str``, same shape, for a ``tensor(string)`` input.

    Raises:
        InvalidInput: an element is not valid UTF-8; the message names the input, the element's
            flat index and the first bad byte.
    """
    flat = array.reshape(-1)
    text = np.empty(flat.shape, dtype=object)
    for i, item in enumerate(flat):
        if isinstance(item, (bytes, bytearray, memoryview)):
            try:
                text[i] = bytes(item).decode("utf-8")
            except UnicodeDecodeError as e:
                raise InvalidInput(
                    f"model '{model}' input '{name}': element {i} is not valid UTF-8 (byte {e.start} is "
                    f"0x{bytes(item)[e.start]:02x}); this model's BYTES inputs are ONNX strings, which hold "
                    "UTF-8 text") from None
        else:
            text[i] = str(item)
    return text.reshape(array.shape)


# What ONNX Runtime's Cast from string accepts (std::stoll / std::stoull / std::stod, which it
# calls): leading C whitespace, then a sign and digits (integers), or a decimal, hex, inf or nan
# number (floats). A string it cannot parse fails the whole run with a RuntimeException.
_INTEGER_TEXT = re.compile(r"[ \t\n\v\f\r]*([+-]?)([0-9]+)")
_FLOAT_TEXT = re.compile(r"[ \t\n\v\f\r]*[+-]?(?:[0-9]|\.[0-9]|inf|nan|0x[0-9a-f])", re.IGNORECASE)
_INTEGER_CASTS = {onnx.TensorProto.INT8, onnx.TensorProto.INT16, onnx.TensorProto.INT32, onnx.TensorProto.INT64,
                  onnx.TensorProto.UINT8, onnx.TensorProto.UINT16, onnx.TensorProto.UINT32, onnx.TensorProto.UINT64}
_FLOAT_CASTS = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}


def numeric_string_inputs(model_path: Path, string_inputs: frozenset[str]) -> dict[str, int]:
    """String inputs the graph parses as numbers: input name -> the ONNX type of a ``Cast``
    node that reads it directly (an integer type before a float one)."""
    if not string_inputs:
        return {}
    graph = onnx.load(str(model_path), load_external_data=False).graph
    found: dict[str, int] = {}
    for node in graph.node:
        if node.op_type == "Cast" and node.input and node.input[0] in string_inputs:
            to = next(a.i for a in node.attribute if a.name == "to")
            if to in _INTEGER_CASTS or (to in _FLOAT_CASTS and node.input[0] not in found):
                found[node.input[0]] = to
    return found


def check_numeric_text(model: str, name: str, to: int, text: np.ndarray) -> None:
    """Refuse, before the run, a string element the graph's ``Cast`` to ``to`` cannot parse.

    Raises:
        InvalidInput: names the input, the element's flat index, its text and the number expected.
    """
    kind = onnx.TensorProto.DataType.Name(to)
    if to in _INTEGER_CASTS:  # ONNX Runtime parses 64 bits, then wraps into the type: refuse what would wrap
        info = np.iinfo(onnx.helper.tensor_dtype_to_np_dtype(to))
        low, high = int(info.min), int(info.max)
    for i, item in enumerate(text.reshape(-1)):
        if to in _INTEGER_CASTS:
            match = _INTEGER_TEXT.match(item)
            ok = match is not None and low <= int(match.group(1) + match.group(2)) <= high
        else:
            ok = _FLOAT_TEXT.match(item) is not None
        if not ok:
            expected = f"a decimal integer from {low} to {high}" if to in _INTEGER_CASTS else "a number"
            raise InvalidInput(
                f"model '{model}' input '{name}': element {i} is {item[:40]!r}, but the model reads it as a "
                f"number ({kind}): expected {expected}")


# ONNX Runtime's words for an allocation it could not make (its arena, BFCArena, or CUDA's
# cudaErrorMemoryAllocation, "out of memory"); it has no exception class of its own for it.
_OUT_OF_MEMORY = re.compile(r"Failed to allocate memory|Available memory of \d+ is smaller|out of memory",
                            re.IGNORECASE)
# The node a kernel failed in: "... while running Gather node. Name:'embed' Status Message: ...".
_FAILED_NODE = re.compile(r"while running (\w{1,64}) node\. Name:'([^']{0,64})")


def out_of_memory(error: BaseException) -> bool:
    """Whether ONNX Runtime's (or CUDA's) ``error`` says an allocation failed."""
    return _OUT_OF_MEMORY.search(str(error)) is not None


def run_error(model: str, error: Exception) -> ServingError:
    """The serving error for ONNX Runtime's exception ``error`` from a run, by its kind; the
    runtime's own text goes to the log (this module's logger: the replica's log and terminal),
    never to the client (it names files and source lines).

    - ``InvalidArgument``: a kernel refused the values it was given, e.g. a ``Gather`` index
      past its table (a token id past the vocabulary). The request's inputs passed the config's
      checks and ``GraphChecks``, so the data is what the model cannot take: the client's
      (``InvalidInput``, 400, naming the node and its operator). Logged at INFO.
    - an allocation that failed: capacity (``DeviceOutOfMemory``, 503).
    - anything else (``Fail``, ``RuntimeException``, ``EPFail``, ...): a fault of the model or
      the runtime (``InferenceError``, 500). Logged at ERROR.
    """
    failed = _FAILED_NODE.search(str(error))
    node = f" in its {failed[1]} node '{failed[2]}'" if failed else ""
    kind = type(error).__name__
    if isinstance(error, ort_errors.InvalidArgument):
        logger.info("model '%s': ONNX Runtime refused a request's values (%s): %s", model, kind, error)
        return InvalidInput(f"model '{model}': the model cannot compute these input values: ONNX Runtime refused "
                            f"them{node} ({kind}), e.g. an index past a table it reads (a token id past the "
                            "vocabulary); the server log has the runtime's message")
    if out_of_memory(error):
        logger.warning("model '%s': ONNX Runtime ran out of memory (%s): %s", model, kind, error)
        return DeviceOutOfMemory(f"model '{model}': out of memory while running{node}; retry later, or with "
                                 "fewer rows")
    logger.error("model '%s': ONNX Runtime run failed (%s): %s", model, kind, error)
    return InferenceError(f"model '{model}': ONNX Runtime run failed{node} ({kind}); the server log has the "
                          "runtime's message")


def _bytes_array(array: np.ndarray) -> np.ndarray:
    """A ``tensor(string)`` output (object array of ``str``) -> object array of UTF-8 ``bytes``."""
    flat = array.reshape(-1)
    out = np.empty(flat.shape, dtype=object)
    for i, item in enumerate(flat):
        out[i] = item.encode("utf-8") if isinstance(item, str) else bytes(item)
    return out.reshape(array.shape)


def session_options(intra_op_threads: int | None = None) -> ort.SessionOptions:
    """Session options of both ONNX Runtime backends: ``intra_op_threads`` (default: the
    ``ORT_INTRA_OP_THREADS`` environment variable, 0 = one per core) and the memory pattern off
    (``OnnxRuntimeEngine``'s docstring gives the measurement)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads or int(os.environ.get("ORT_INTRA_OP_THREADS", "0"))
    options.enable_mem_pattern = False
    return options


def check_signature(config: ModelConfig, session: ort.InferenceSession) -> None:
    """Check that every input/output of ``config`` is in the session's graph with its datatype.

    Raises:
        ConfigError: a tensor is missing or has another type (names both).
    """
    where = f"model '{config.name}'"
    for kind, declared, actual in (
        ("input", config.inputs, session.get_inputs()),
        ("output", config.outputs, session.get_outputs()),
    ):
        by_name = {a.name: a for a in actual}
        for spec in declared:
            arg = by_name.get(spec.name)
            if arg is None:
                raise ConfigError(
                    f"{where}: config {kind} '{spec.name}' is not in the ONNX file; "
                    f"the file has {sorted(by_name)}")
            if arg.type != ONNX_TYPE_BY_DATATYPE[spec.datatype]:
                raise ConfigError(
                    f"{where}: {kind} '{spec.name}' is {arg.type} in the ONNX file, "
                    f"config says {spec.datatype}")


class OnnxRuntimeContext:
    """One execution slot over a shared ``InferenceSession`` (``run`` is thread-safe)."""

    def __init__(self, engine: "OnnxRuntimeEngine") -> None:
        self._engine = engine

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one request: input name -> array; returns every output by name (BYTES as bytes).

        Raises:
            InvalidInput: a BYTES element is not valid UTF-8 (names input, element and byte), or
                is text the graph casts to a number and cannot parse (``check_numeric_text``), or
                ONNX Runtime refused the values (``run_error``).
            DeviceOutOfMemory, InferenceError: ONNX Runtime's run failed (``run_error``).
        """
        engine = self._engine
        model = engine.config.name
        # np.asarray, not np.ascontiguousarray: that makes a rank-0 input rank 1 (its output too)
        feeds = {name: _text_array(model, name, a) if name in engine.string_inputs else np.asarray(a, order="C")
                 for name, a in inputs.items()}
        for name, to in engine.numeric_strings.items():
            if name in feeds:
                check_numeric_text(model, name, to, feeds[name])
        try:
            values = engine.session.run(engine.output_names, feeds)
        except Exception as e:  # ORT raises its own types for shape/runtime faults
            raise run_error(model, e) from e
        return {name: _bytes_array(v) if name in engine.string_outputs else v
                for name, v in zip(engine.output_names, values)}

    def close(self) -> None:
        pass


class OnnxRuntimeEngine:
    """An ``InferenceSession`` on ``<model_dir>/model.onnx``.

    ``footprint()``: engine bytes are the process RSS delta across session creation; context
    bytes are 0 here: ``residency.footprints.load_and_measure`` measures them (the arena's growth across runs
    at the max profile; the model cache does it at a model's first load).

    The session keeps ONNX Runtime's CPU arena but turns the memory pattern off: with it, every
    distinct input shape's first repeat allocates one more block beside the first run's
    allocations, which doubles the memory a session keeps (tiny_cnn at batch 32: 900 MB against
    515 MB) for no measured latency gain (ResNet-18 and tiny_cnn at batch 1 and 8, p50 within 1 %).

    Raises:
        ConfigError: the ONNX file's inputs/outputs disagree with the config (names, types).
        InvalidModelFile: ONNX Runtime cannot load the file: it does not parse, or uses an operator
            ONNX Runtime does not implement (``session_error``).
        LoadFault: the file is missing.
    """

    backend = "onnxruntime"

    def __init__(self, config: ModelConfig, model_dir: Path, intra_op_threads: int | None = None) -> None:
        self.config = config
        options = session_options(intra_op_threads)
        before = measured_rss_bytes()
        path = Path(model_dir) / MODEL_FILENAME
        try:
            self.session = ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
        except Exception as e:  # a damaged, truncated or missing file; ORT's text names the path: log only
            logger.warning("model '%s': ONNX Runtime could not load %s: %s", config.name, path, e)
            raise session_error(config.name, Path(path), e) from None
        self._engine_bytes = max(0, measured_rss_bytes() - before)
        check_signature(config, self.session)
        self.output_names = [t.name for t in config.outputs]
        self.string_inputs = frozenset(t.name for t in config.inputs if t.datatype == "BYTES")
        self.string_outputs = frozenset(t.name for t in config.outputs if t.datatype == "BYTES")
        self.numeric_strings = numeric_string_inputs(path, self.string_inputs)

    def create_context(self) -> OnnxRuntimeContext:
        return OnnxRuntimeContext(self)

    def footprint(self) -> Footprint:
        return Footprint(engine_bytes=self._engine_bytes, context_bytes=0, measured=True)

    def check_health(self) -> None:
        """Nothing on the CPU can break for good the way a CUDA context does: always healthy."""

    def close(self) -> None:
        self.session = None  # type: ignore[assignment]
