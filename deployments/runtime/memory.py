"""Memory planner: predict a model's footprint from its ONNX graph, measure it on ONNX Runtime.

A loaded model holds ``engine_bytes + instances x context_bytes`` (``engine.Footprint``):

* **Prediction, from the ONNX graph alone** (``predict``): ONNX shape inference at the max
  profile gives every activation tensor's size; the largest one, divided by the max batch, is
  the *peak activation per sample*. Predicted context bytes =
  ``CONTEXT_FACTOR (3) x max_batch x peak activation bytes per sample``; engine bytes = the
  bytes of all weights (initializers and ``Constant`` nodes). Source of the factor: the reference
  measurement on TensorRT (DESIGN.md: a 0.09M-parameter CNN needed 296 MB per context at
  batch 32 @224, ResNet-18 79 MB; context / (batch x peak activation) measured 3.0-3.6 for a CNN).
  Sized at FP16 (``precision="fp16"``, what the reference's TensorRT engines held) it predicts
  308 MB for tiny_cnn (+4 %) and 154 MB for ResNet-18 (+95 %). It is a planning figure: on
  ONNX Runtime (FP32) it over-predicts the CNNs' measured context memory by 20-45 % and
  under-predicts the PP-OCR graphs' (many tensors alive at once) by 35-50 %. Measure before
  trusting it for a tight budget.
* **Measurement, ONNX Runtime** (``load_and_measure``): the process resident set size (RSS,
  ``/proc/self/statm``) before and after creating the session is the engine bytes; the RSS
  growth across two runs at the max profile (batch scaled, see below) is the context bytes: ORT's
  CPU arena keeps what a run allocated, so that growth *is* the memory the session keeps once it
  has served max-profile requests (the second run captures the arena's fragmentation, and the
  memory-pattern block when a session has ``enable_mem_pattern`` on). The heap is trimmed
  (``malloc_trim``) before every RSS reading so freed memory that glibc kept does not hide a
  growth. To bound the cost, the runs use the largest batch whose inputs hold at most
  ``measure_elements`` elements (default ``MEASURE_INPUT_ELEMENTS``, 8 images of 3x224x224), at
  the max profile's other axes, and the growth is scaled by ``max_batch / batch``: activation
  memory is linear in batch (ORT 1.32, memory pattern off, fresh process, RSS growth per sample
  at batch 4/8/16/32: tiny_cnn 16.2/16.1/16.1/16.1 MB, ResNet-18 5.2/6.7/6.7/6.7 MB, mid_cnn
  3.4/3.4/3.4/3.4 MB; ocr_rec at width 3200, batch 1/2/4/8: 57.8/57.3/57.1/57.0 MB). Below
  8 images ResNet-18's growth is noisy (the arena's chunking), hence the default. So the CNNs
  run at batch 8, ocr_rec at batch 2 (a full batch-32 run at width 3200 takes 9 s on 2 cores),
  ocr_cls at its full 32, ocr_det at its only batch, 1.
* **TensorRT**: exact, from the engine (``device_memory_size_v2``); no measurement.

RSS is process-wide: requests running on other models while a model is measured add noise
(upward when their arenas grow). ``ModelCache`` serializes loads to keep that noise small.
Figures are printed in MB = 10^6 bytes.

Command line::

    python -m deployments.runtime.memory plan [--root engines] [--gpu-memory-gb 80] [--headroom 0.15]
        [--precision fp16] [--instances N] [--baseline-mb 0] [--measure] [--json]
    python -m deployments.runtime.memory measure MODEL [--root engines] [--write] [--json]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, shape_inference

from .config import ModelConfig
from .datatypes import NUMPY_BY_DATATYPE
from .engine import Footprint, resolve_backend
from .errors import ConfigError
from .host import ModelHost
from .repository import ModelEntry, ModelRepository

CONTEXT_FACTOR = 3.0
"""Predicted context bytes / (max batch x peak activation bytes per sample); DESIGN.md."""

REFERENCE_CONTEXT_BYTES: dict[str, int] = {"tiny_cnn": 296_000_000, "resnet18": 79_000_000}
"""TensorRT context memory at batch 32 @224 in the reference measurement (DESIGN.md)."""

MEASURE_INPUT_ELEMENTS = 8 * 3 * 224 * 224
"""Input elements of a measuring run (sets its batch); the growth is scaled to the max batch."""

RECORD_FILENAME = "footprint.json"
"""A recorded footprint next to the model file: ``<model>/<version>/footprint.json``."""

MB = 1_000_000

_FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE,
                onnx.TensorProto.BFLOAT16}


# --------------------------------------------------------------------------------------------
# Process memory


def process_rss_bytes() -> int:
    """Resident set size of this process in bytes, from ``/proc/self/statm`` (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _load_libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


_LIBC = _load_libc()


def release_free_heap() -> None:
    """Return freed heap memory to the OS (glibc ``malloc_trim(0)``); a no-op elsewhere.

    Called before each RSS reading so that memory freed earlier (an evicted model, a parsed
    ONNX protobuf) and kept by the allocator does not absorb a later growth.
    """
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def measured_rss_bytes() -> int:
    """``process_rss_bytes()`` after ``release_free_heap()``."""
    release_free_heap()
    return process_rss_bytes()


# --------------------------------------------------------------------------------------------
# Shapes at the max profile


def batch_of(config: ModelConfig) -> int:
    """The max batch a context must hold: ``max_batch_size``, or 1 for a model without batch axis."""
    return config.max_batch_size if config.max_batch_size > 0 else 1


def max_profile_shapes(config: ModelConfig, batch: int | None = None) -> dict[str, tuple[int, ...]]:
    """Input name -> the largest shape the model accepts, axis 0 set to ``batch`` when given.

    Axis 0 is ``max_batch_size`` for a batched model (the config may allow a larger profile
    max, which is never used); other axes come from the profile max or the fixed dims.

    Raises:
        ConfigError: an input has a dynamic non-batch axis without a profile (no max known).
    """
    shapes: dict[str, tuple[int, ...]] = {}
    for spec in config.inputs:
        if spec.profile is not None:
            shape = list(spec.profile.max)
        else:
            shape = list(spec.dims)
            if config.max_batch_size and shape and shape[0] == -1:
                shape[0] = config.max_batch_size
            if any(d == -1 for d in shape):
                raise ConfigError(
                    f"model '{config.name}' input '{spec.name}': dims {list(spec.dims)} are dynamic "
                    "and there is no profile giving their max")
        if config.max_batch_size:
            shape[0] = batch if batch is not None else config.max_batch_size
        shapes[spec.name] = tuple(shape)
    return shapes


def shrunk_shapes(config: ModelConfig) -> tuple[dict[str, tuple[int, ...]], str] | None:
    """The max profile made smaller, and a description: half the max batch, else half the
    dynamic axes (never below the profile's opt). None when nothing can shrink."""
    shapes = max_profile_shapes(config)
    if config.max_batch_size > 1:
        half = config.max_batch_size // 2
        return {n: (half,) + s[1:] for n, s in shapes.items()}, f"batch {config.max_batch_size}->{half}"
    changed: dict[str, tuple[int, ...]] = {}
    notes = []
    for spec in config.inputs:
        shape = list(shapes[spec.name])
        if spec.profile is not None:
            for axis in range(1 if config.max_batch_size else 0, len(shape)):
                if spec.dims[axis] == -1:
                    target = max(shape[axis] // 2, spec.profile.opt[axis])
                    if target < shape[axis]:
                        notes.append(f"axis {axis} {shape[axis]}->{target}")
                        shape[axis] = target
        changed[spec.name] = tuple(shape)
    if not notes:
        return None
    return changed, ", ".join(notes)


# --------------------------------------------------------------------------------------------
# Graph analysis and prediction


@dataclass(frozen=True)
class GraphProfile:
    """What ONNX shape inference says about one model at one set of input shapes.

    ``peak_activation_bytes`` is per sample: the largest tensor a node produces, divided by
    ``batch``; ``unknown_tensors`` counts node outputs whose shape inference could not size
    (they are left out of the peak).
    """

    parameters: int
    weight_bytes: int
    batch: int
    input_shapes: dict[str, tuple[int, ...]]
    peak_tensor: str
    peak_activation_bytes: float
    unknown_tensors: int

    def context_bytes(self, batch: int | None = None, factor: float = CONTEXT_FACTOR) -> int:
        """``factor x batch x peak_activation_bytes`` (batch defaults to the analysed one)."""
        return int(factor * (self.batch if batch is None else batch) * self.peak_activation_bytes)


def _itemsize(elem_type: int, precision: str | None) -> int:
    if precision == "fp16" and elem_type in _FLOAT_TYPES:
        return 2
    if precision == "fp32" and elem_type in _FLOAT_TYPES:
        return 4
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).itemsize


def _weights(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    tensors = list(model.graph.initializer)
    for node in model.graph.node:
        if node.op_type == "Constant":
            tensors.extend(a.t for a in node.attribute if a.name == "value" and a.type == onnx.AttributeProto.TENSOR)
    return tensors


def analyze_graph(model: onnx.ModelProto | str | Path, shapes: Mapping[str, Sequence[int]],
                  batch: int, precision: str | None = None) -> GraphProfile:
    """Shape-infer ``model`` with its inputs fixed to ``shapes`` and find the peak activation.

    Args:
        model: an ONNX model or the path of one (not modified).
        shapes: input name -> full shape, batch axis included.
        batch: the batch in ``shapes`` (1 for a model without batch axis); divides the peak.
        precision: ``None`` uses each tensor's own dtype; ``"fp16"`` or ``"fp32"`` sizes every
            floating-point tensor (weights and activations) at 2 or 4 bytes, as a TensorRT
            build in that precision would hold them.

    Weights are initializers and ``Constant`` node values (the PP-OCR exports keep their weights
    in ``Constant`` nodes); ``parameters`` counts their floating-point elements.
    """
    proto = onnx.load(str(model)) if isinstance(model, (str, Path)) else model
    proto_copy = onnx.ModelProto()
    proto_copy.CopyFrom(proto)
    for value in proto_copy.graph.input:
        if value.name in shapes:
            dims = value.type.tensor_type.shape.dim
            for dim, size in zip(dims, shapes[value.name]):
                dim.Clear()
                dim.dim_value = int(size)
    weights = _weights(proto_copy)
    weight_names = {t.name for t in proto_copy.graph.initializer}
    parameters = sum(int(np.prod(t.dims, dtype=np.int64)) for t in weights if t.data_type in _FLOAT_TYPES)
    weight_bytes = sum(int(np.prod(t.dims, dtype=np.int64)) * _itemsize(t.data_type, precision) for t in weights)
    try:
        inferred = shape_inference.infer_shapes(proto_copy, strict_mode=False, data_prop=True)
    except Exception:  # an op the checker does not know: fall back to declared shapes only
        inferred = proto_copy
    sizes: dict[str, int | None] = {}
    for value in list(inferred.graph.value_info) + list(inferred.graph.output):
        tensor_type = value.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else 0 for d in tensor_type.shape.dim]
        known = tensor_type.HasField("shape") and all(d > 0 for d in dims)
        sizes[value.name] = (int(np.prod(dims, dtype=np.int64)) * _itemsize(tensor_type.elem_type, precision)
                             if known else None)
    produced = [o for node in inferred.graph.node if node.op_type != "Constant" for o in node.output
                if o and o not in weight_names]
    known_sizes: dict[str, int] = {name: nbytes for name in produced if (nbytes := sizes.get(name))}
    unknown = len(produced) - len(known_sizes)
    if known_sizes:
        peak_tensor = max(known_sizes, key=lambda n: known_sizes[n])
        peak = known_sizes[peak_tensor] / batch
    else:
        peak_tensor, peak = "", 0.0
    return GraphProfile(parameters=parameters, weight_bytes=weight_bytes, batch=batch,
                        input_shapes={k: tuple(int(x) for x in v) for k, v in shapes.items()},
                        peak_tensor=peak_tensor, peak_activation_bytes=peak, unknown_tensors=unknown)


@dataclass(frozen=True)
class Prediction:
    """A model's predicted footprint at its max profile (see ``predict``)."""

    model: str
    instances: int
    graph: GraphProfile

    @property
    def engine_bytes(self) -> int:
        return self.graph.weight_bytes

    @property
    def context_bytes(self) -> int:
        return self.graph.context_bytes()

    def footprint(self) -> Footprint:
        """The prediction as a ``Footprint`` (``measured=False``)."""
        return Footprint(engine_bytes=self.engine_bytes, context_bytes=self.context_bytes, measured=False)


_PREDICTIONS: dict[tuple, Prediction] = {}
_PREDICTIONS_LOCK = threading.Lock()


def _file_key(path: Path) -> tuple:
    st = path.stat()
    return (str(path.resolve()), st.st_size, st.st_mtime_ns)


def predict(entry: ModelEntry, precision: str | None = None) -> Prediction:
    """Predict ``entry``'s footprint from its ONNX graph at the max profile (memoized per file).

    Context bytes = ``CONTEXT_FACTOR x max_batch x peak activation bytes per sample``; engine
    bytes = weight bytes. See ``analyze_graph`` for ``precision``.

    Raises:
        ConfigError: a pipeline model (no ONNX file) or a dynamic axis without a profile.
    """
    if entry.config.pipeline:
        raise ConfigError(f"model '{entry.name}' is a pipeline; it has no ONNX graph to plan")
    path = entry.onnx_path()
    key = (_file_key(path), precision)
    with _PREDICTIONS_LOCK:
        cached = _PREDICTIONS.get(key)
    if cached is not None:
        return cached
    config = entry.config
    graph = analyze_graph(path, max_profile_shapes(config), batch_of(config), precision)
    prediction = Prediction(model=entry.name, instances=config.instances, graph=graph)
    with _PREDICTIONS_LOCK:
        _PREDICTIONS[key] = prediction
    return prediction


# --------------------------------------------------------------------------------------------
# Measurement


_MEASURED: dict[tuple, Footprint] = {}
_MEASURED_LOCK = threading.Lock()


def _measure_key(entry: ModelEntry, backend: str) -> tuple:
    return (_file_key(entry.onnx_path()), backend)


def measured_footprint(entry: ModelEntry, backend: str) -> Footprint | None:
    """The footprint ``load_and_measure`` took of this model file in this process, if any."""
    with _MEASURED_LOCK:
        return _MEASURED.get(_measure_key(entry, backend))


def _record_measurement(entry: ModelEntry, backend: str, footprint: Footprint) -> None:
    with _MEASURED_LOCK:
        _MEASURED[_measure_key(entry, backend)] = footprint


def measure_batch_of(config: ModelConfig, measure_elements: int | None = MEASURE_INPUT_ELEMENTS) -> int:
    """Batch of the measuring runs: the largest (at least 1, at most the max batch) whose inputs at
    the max profile hold at most ``measure_elements`` elements; the max batch when None."""
    full = batch_of(config)
    if measure_elements is None or not config.max_batch_size:
        return full
    per_sample = sum(int(np.prod(s[1:])) for s in max_profile_shapes(config, 1).values())
    return max(1, min(full, measure_elements // max(1, per_sample)))


def measure_context_bytes(host: ModelHost, measure_elements: int | None = MEASURE_INPUT_ELEMENTS,
                          runs: int = 2) -> int:
    """RSS growth of ``runs`` requests at the max profile, scaled to the max batch (bytes).

    Args:
        host: a loaded ``ModelHost`` with an ONNX Runtime engine; nobody else should use it yet
            (its arena must still be empty).
        measure_elements: sets the runs' batch (``measure_batch_of``); the growth is multiplied
            by ``max_batch / batch``. None runs the full max batch.
        runs: requests to run; the second captures the arena's fragmentation (module docstring).

    The inputs are zeros of the declared dtypes; they exist before the first reading and the
    outputs are dropped before the last, so neither is counted.

    Raises:
        InferenceError, InvalidInput: from ``host.infer``.
    """
    config = host.config
    full = batch_of(config)
    batch = measure_batch_of(config, measure_elements)
    feeds = {name: np.zeros(shape, dtype=NUMPY_BY_DATATYPE[config.input(name).datatype])
             for name, shape in max_profile_shapes(config, batch if config.max_batch_size else None).items()}
    before = measured_rss_bytes()
    for _ in range(runs):
        outputs = host.infer(feeds)
        del outputs
    growth = max(0, measured_rss_bytes() - before)
    return int(growth * full / batch)


_PRIMED = threading.Event()


def _prime_onnxruntime() -> None:
    """Create (once per process) a throwaway session on a one-node graph, so ONNX Runtime's
    one-time start-up memory (its environment, about 30 MB) is not counted as the first model's."""
    if _PRIMED.is_set():
        return
    import onnxruntime

    value = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "prime", [value],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    session.run(None, {"x": np.zeros(1, np.float32)})
    _PRIMED.set()


def load_and_measure(host: ModelHost, measure_elements: int | None = MEASURE_INPUT_ELEMENTS) -> Footprint:
    """Load ``host`` and return its footprint: exact on TensorRT, measured on ONNX Runtime.

    ONNX Runtime: engine bytes = RSS growth across ``host.load()``; context bytes =
    ``measure_context_bytes(host, measure_elements)`` (module docstring gives the method). The result
    is remembered for this model file (``measured_footprint``), so a reload need not measure.
    The host stays loaded, with its arena grown by the measuring runs.

    Raises:
        ConfigError, InferenceError: from loading or the measuring runs (the host is unloaded).
    """
    requested = host.config.backend if host.backend_request == "auto" else host.backend_request
    if resolve_backend(requested) == "onnxruntime":
        _prime_onnxruntime()
    before = measured_rss_bytes()
    host.load()
    try:
        engine = host.engine
        assert engine is not None
        if engine.backend != "onnxruntime":
            footprint = engine.footprint()
        else:
            engine_bytes = max(0, measured_rss_bytes() - before)
            footprint = Footprint(engine_bytes=engine_bytes,
                                  context_bytes=measure_context_bytes(host, measure_elements), measured=True)
    except BaseException:
        host.unload()
        raise
    _record_measurement(host.entry, engine.backend, footprint)
    return footprint


# --------------------------------------------------------------------------------------------
# Recorded footprints (``<model>/<version>/footprint.json``)


def _runtime_version(backend: str) -> str:
    if backend == "onnxruntime":
        import onnxruntime

        return onnxruntime.__version__
    return ""


def write_record(entry: ModelEntry, backend: str, footprint: Footprint, measure_elements: int | None) -> Path:
    """Write ``footprint`` to ``<model>/<version>/footprint.json`` (keys: ``engine_bytes``,
    ``context_bytes``, ``backend``, ``runtime_version``, ``model_bytes``, ``measure_batch``,
    ``source``). A TensorRT build can write the same keys next to its plan."""
    path = entry.onnx_path().parent / RECORD_FILENAME
    record = {"engine_bytes": footprint.engine_bytes, "context_bytes": footprint.context_bytes,
              "backend": backend, "runtime_version": _runtime_version(backend),
              "model_bytes": entry.onnx_path().stat().st_size,
              "measure_batch": measure_batch_of(entry.config, measure_elements),
              "source": "python -m deployments.runtime.memory measure"}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def read_record(entry: ModelEntry, backend: str) -> Footprint | None:
    """The recorded footprint of this model for ``backend``, or None when absent or stale
    (another backend, runtime version or model file size)."""
    path = entry.onnx_path().parent / RECORD_FILENAME
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if (record.get("backend") != backend or record.get("runtime_version") != _runtime_version(backend)
            or record.get("model_bytes") != entry.onnx_path().stat().st_size):
        return None
    try:
        return Footprint(engine_bytes=int(record["engine_bytes"]), context_bytes=int(record["context_bytes"]),
                         measured=True)
    except (KeyError, TypeError, ValueError):
        return None


# --------------------------------------------------------------------------------------------
# The plan


@dataclass
class ModelPlan:
    """One row of the plan; bytes are totals for ``instances`` contexts where named ``total``."""

    model: str
    parameters: int
    engine_bytes: int
    max_profile: str
    peak_activation_bytes: float
    predicted_context_bytes: int
    measured_engine_bytes: int | None
    measured_context_bytes: int | None
    measured_source: str
    instances: int
    total_bytes: int
    shrink: str
    shrink_saves_bytes: int
    unknown_tensors: int = 0
    notes: list[str] = field(default_factory=list)


def _profile_text(shapes: Mapping[str, Sequence[int]]) -> str:
    return "; ".join("x".join(str(d) for d in s) for s in shapes.values())


def _measure_in_subprocess(root: Path, name: str, measure_elements: int | None) -> Footprint:
    cmd = [sys.executable, "-m", "deployments.runtime.memory", "measure", name, "--root", str(root), "--json",
           "--measure-elements", str(measure_elements or 0)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"measuring {name} failed: {done.stderr.strip().splitlines()[-1:]}")
    record = json.loads(done.stdout)
    return Footprint(engine_bytes=record["engine_bytes"], context_bytes=record["context_bytes"], measured=True)


def plan_model(entry: ModelEntry, precision: str | None = None, instances: int | None = None,
               measured: Footprint | None = None, measured_source: str = "") -> ModelPlan:
    """The plan row of one model: prediction, optional measurement, and the shrink saving.

    The total uses the measured figures where given, else the predicted ones. The saving of the
    shrunk profile is the predicted context difference (scaled by measured / predicted when a
    measurement exists) times the instances.
    """
    prediction = predict(entry, precision)
    config = entry.config
    n = instances or config.instances
    engine_bytes = measured.engine_bytes if measured else prediction.engine_bytes
    context_bytes = measured.context_bytes if measured else prediction.context_bytes
    shrink_text, saves = "-", 0
    shrunk = shrunk_shapes(config)
    if shrunk is not None:
        small_shapes, shrink_text = shrunk
        small_batch = next(iter(small_shapes.values()))[0] if config.max_batch_size else 1
        small = analyze_graph(entry.onnx_path(), small_shapes, small_batch, precision).context_bytes()
        scale = context_bytes / prediction.context_bytes if prediction.context_bytes else 1.0
        saves = int(n * (prediction.context_bytes - small) * scale)
    return ModelPlan(
        model=entry.name, parameters=prediction.graph.parameters, engine_bytes=prediction.engine_bytes,
        max_profile=_profile_text(prediction.graph.input_shapes),
        peak_activation_bytes=prediction.graph.peak_activation_bytes,
        predicted_context_bytes=prediction.context_bytes,
        measured_engine_bytes=measured.engine_bytes if measured else None,
        measured_context_bytes=measured.context_bytes if measured else None,
        measured_source=measured_source, instances=n, total_bytes=engine_bytes + n * context_bytes,
        shrink=shrink_text, shrink_saves_bytes=saves, unknown_tensors=prediction.graph.unknown_tensors)


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / MB:,.1f}"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool]) -> str:
    """A plain aligned text table."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def render_plan(plans: Sequence[ModelPlan], gpu_memory_bytes: int, headroom: float, baseline_bytes: int,
                precision: str | None) -> str:
    """The plan as text: one row per model, then whether the set fits."""
    headers = ["model", "params", "max profile", "peak act/sample MB", "engine pred MB", "ctx pred MB",
               "engine meas MB", "ctx meas MB", "inst", "total MB", "shrink max profile", "saves MB"]
    right = [False, True, False, True, True, True, True, True, True, True, False, True]
    rows = [[p.model, f"{p.parameters:,}", p.max_profile, f"{p.peak_activation_bytes / MB:,.2f}",
             _mb(p.engine_bytes), _mb(p.predicted_context_bytes), _mb(p.measured_engine_bytes),
             _mb(p.measured_context_bytes) + (f" ({p.measured_source})" if p.measured_source else ""),
             str(p.instances), _mb(p.total_bytes), p.shrink, _mb(p.shrink_saves_bytes)] for p in plans]
    total = baseline_bytes + sum(p.total_bytes for p in plans)
    usable = int(gpu_memory_bytes * (1.0 - headroom))
    saves = sum(p.shrink_saves_bytes for p in plans)
    verdict = (f"fits ({_mb(usable - total)} MB to spare)" if total <= usable
               else f"does NOT fit (short by {_mb(total - usable)} MB)")
    shrunk_verdict = "fits" if total - saves <= usable else "does not fit"
    lines = [
        format_table(headers, rows, right),
        "",
        f"context: predicted = {CONTEXT_FACTOR:g} x max batch x peak activation per sample "
        f"(activations sized {'as in the graph' if precision is None else precision}); "
        "measured where a measurement exists. total = engine + instances x context (measured if any).",
        f"set: {_mb(total)} MB (baseline {_mb(baseline_bytes)} MB + models {_mb(total - baseline_bytes)} MB); "
        f"GPU {_mb(gpu_memory_bytes)} MB with {headroom:.0%} headroom leaves {_mb(usable)} MB: {verdict}.",
        f"shrinking every max profile as shown saves {_mb(saves)} MB -> {_mb(total - saves)} MB ({shrunk_verdict}).",
    ]
    unknown = [p for p in plans if p.unknown_tensors]
    if unknown:
        lines.append("shape inference left some tensors unsized (not in the peak): "
                     + ", ".join(f"{p.model} {p.unknown_tensors}" for p in unknown))
    return "\n".join(lines)


def _cmd_plan(args: argparse.Namespace) -> int:
    repo = ModelRepository(args.root)
    entries = [e for e in repo.entries() if not e.config.pipeline]
    if args.models:
        entries = [repo.get(n) for n in args.models]
    plans = []
    for entry in entries:
        measured, source = read_record(entry, "onnxruntime"), "recorded"
        if measured is None and args.measure:
            measured, source = _measure_in_subprocess(Path(args.root), entry.name, args.measure_elements), "ORT"
        plans.append(plan_model(entry, args.precision, args.instances, measured, source if measured else ""))
    gpu_bytes = int(args.gpu_memory_gb * 1e9)
    baseline = int(args.baseline_mb * MB)
    if args.json:
        total = baseline + sum(p.total_bytes for p in plans)
        usable = int(gpu_bytes * (1 - args.headroom))
        print(json.dumps({"models": [asdict(p) for p in plans], "total_bytes": total, "usable_bytes": usable,
                          "fits": total <= usable, "gpu_memory_bytes": gpu_bytes, "headroom": args.headroom,
                          "baseline_bytes": baseline, "precision": args.precision}, indent=2))
    else:
        print(render_plan(plans, gpu_bytes, args.headroom, baseline, args.precision))
    return 0


def _cmd_measure(args: argparse.Namespace) -> int:
    entry = ModelRepository(args.root).get(args.model)
    host = ModelHost(entry, args.backend)
    start = time.perf_counter()
    footprint = load_and_measure(host, args.measure_elements)
    seconds = time.perf_counter() - start
    backend = host.engine.backend if host.engine is not None else args.backend
    host.unload()
    record: dict[str, Any] = {"model": entry.name, "backend": backend, "engine_bytes": footprint.engine_bytes,
              "context_bytes": footprint.context_bytes, "instances": entry.config.instances,
              "total_bytes": footprint.total(entry.config.instances),
              "measure_batch": measure_batch_of(entry.config, args.measure_elements),
              "seconds": round(seconds, 3)}
    if args.write:
        record["written"] = str(write_record(entry, backend, footprint, args.measure_elements))
    if args.json:
        print(json.dumps(record))
    else:
        print(f"{entry.name} ({backend}): engine {_mb(footprint.engine_bytes)} MB, context "
              f"{_mb(footprint.context_bytes)} MB, total for {entry.config.instances} instances "
              f"{_mb(record['total_bytes'])} MB (measured in {seconds:.1f} s)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m deployments.runtime.memory``."""
    parser = argparse.ArgumentParser(prog="python -m deployments.runtime.memory", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="predict (and optionally measure) each model's memory; check a GPU fits")
    plan.add_argument("--root", default="engines", help="model repository (default: engines)")
    plan.add_argument("--models", nargs="*", help="only these models (default: every non-pipeline model)")
    plan.add_argument("--gpu-memory-gb", type=float, default=80.0, help="GPU memory in GB (10^9 bytes)")
    plan.add_argument("--headroom", type=float, default=0.15, help="fraction kept free (0.15-0.20)")
    plan.add_argument("--baseline-mb", type=float, default=0.0,
                      help="memory the process holds before any model (CUDA context, libraries)")
    plan.add_argument("--instances", type=int, default=None, help="contexts per model (default: config)")
    plan.add_argument("--precision", choices=["fp16", "fp32"], default=None,
                      help="size floating-point weights and activations at this precision "
                           "(default: as in the ONNX graph)")
    plan.add_argument("--measure", action="store_true",
                      help="measure each model with ONNX Runtime (one subprocess each)")
    plan.add_argument("--measure-elements", type=int, default=MEASURE_INPUT_ELEMENTS,
                      help="input elements of a measuring run (sets its batch; 0 = the full max batch)")
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    measure = sub.add_parser("measure", help="load one model with ONNX Runtime and measure its footprint")
    measure.add_argument("model")
    measure.add_argument("--root", default="engines")
    measure.add_argument("--backend", default="onnxruntime")
    measure.add_argument("--measure-elements", type=int, default=MEASURE_INPUT_ELEMENTS,
                         help="input elements of a measuring run (sets its batch; 0 = the full max batch)")
    measure.add_argument("--write", action="store_true", help=f"record it in <model>/<version>/{RECORD_FILENAME}")
    measure.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.measure_elements == 0:
        args.measure_elements = None
    return _cmd_plan(args) if args.command == "plan" else _cmd_measure(args)


if __name__ == "__main__":
    sys.exit(main())
