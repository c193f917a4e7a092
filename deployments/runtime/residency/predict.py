"""Predict a model's footprint from its ONNX graph alone (no backend needed).

Context bytes = ``CONTEXT_FACTOR (3) x max_batch x peak activation bytes per sample`` from ONNX
shape inference at the max profile; engine bytes = the bytes of all weights (initializers and
``Constant`` nodes). Source of the factor: the reference measurement on TensorRT (a
0.09M-parameter CNN needed 296 MB per context at batch 32 @224, ResNet-18 79 MB;
context / (batch x peak activation) measured 3.0-3.6 for a CNN). Sized at FP16 it predicts
308 MB for tiny_cnn (+4 %) and 154 MB for ResNet-18 (+95 %). On ONNX Runtime (FP32) it
over-predicts the CNNs' measured context memory by 20-45 % and under-predicts the PP-OCR graphs'
by 35-50 %: a planning figure; measure (``residency.footprints``) before trusting it for a tight
budget.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, shape_inference

from ..backends.base import Footprint
from ..contract.errors import ConfigError, unreadable_model_file
from ..contract.files import shown_model_file
from ..contract.repository import ModelEntry
from ..contract.shapes import batch_of, max_profile_shapes

logger = logging.getLogger(__name__)

CONTEXT_FACTOR = 3.0
"""Predicted context bytes / (max batch x peak activation bytes per sample); see the module docstring."""

_FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE,
                onnx.TensorProto.BFLOAT16}


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
        ConfigError: a pipeline model (no ONNX file), a dynamic axis without a profile.
        LoadFault, InvalidModelFile: a model file that cannot be read, or parsed
            (``unreadable_model_file``).
    """
    if entry.config.pipeline:
        raise ConfigError(f"model '{entry.name}' is a pipeline; it has no ONNX graph to plan")
    path = entry.onnx_path()
    try:
        key = (_file_key(path), precision)
    except OSError as e:
        raise unreadable_model_file(entry.name, "onnx", e, shown_model_file(path)) from None
    with _PREDICTIONS_LOCK:
        cached = _PREDICTIONS.get(key)
    if cached is not None:
        return cached
    config = entry.config
    try:
        graph = analyze_graph(path, max_profile_shapes(config), batch_of(config), precision)
    except ConfigError:
        raise
    except Exception as e:  # a missing, truncated or damaged file: the reader's text names the path
        logger.warning("model '%s': cannot read %s: %s", entry.name, path, e)
        raise unreadable_model_file(entry.name, "onnx", e, shown_model_file(path)) from None
    prediction = Prediction(model=entry.name, instances=config.instances, graph=graph)
    with _PREDICTIONS_LOCK:
        _PREDICTIONS[key] = prediction
    return prediction
