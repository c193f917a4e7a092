"""Model folders as a newcomer brings them: ``<root>/<name>/1/model.onnx`` and nothing else (no
``config.yaml``; the server completes the config from the graph), each small and made with
``onnx.helper``, several of which the server's own runs or readers used to trip over.

- ``nc_div``: INT32 ``C = Div(A, B)``, ``A, B, C [N, 4]``: zeros divide by zero.
- ``nc_reshape``: FP32 ``Y = Reshape(X, [3, -1])``, ``X [N, 4]``: only a batch that 3 divides
  reshapes (``N * 4`` elements into 3 rows).
- ``nc_scalar``: FP32 ``Y = X * 2`` with ``X`` and ``Y`` of shape ``[]`` (rank 0).
- ``nc_garbage``: random bytes; ``nc_empty``: an empty file; ``nc_truncated``: half of
  ``nc_div``'s file.
- ``nc_custom_op``: a valid ONNX file whose one node is ``Frobnicate`` of domain ``com.example``.
- ``nc_no_inputs``: a valid ONNX file whose graph has no inputs (a ``Constant`` output).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper


def _model(nodes, inputs, outputs, opsets=(("", 17),)) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "newcomer", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    model.ir_version = 8
    return model


def div_model() -> onnx.ModelProto:
    return _model([helper.make_node("Div", ["A", "B"], ["C"], name="div")],
                  [helper.make_tensor_value_info(n, TensorProto.INT32, ["N", 4]) for n in "AB"],
                  [helper.make_tensor_value_info("C", TensorProto.INT32, ["N", 4])])


def reshape_model() -> onnx.ModelProto:
    model = _model([helper.make_node("Reshape", ["X", "shape"], ["Y"], name="reshape")],
                   [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 4])],
                   [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [3, "M"])])
    model.graph.initializer.append(helper.make_tensor("shape", TensorProto.INT64, [2], [3, -1]))
    return model


def scalar_model() -> onnx.ModelProto:
    model = _model([helper.make_node("Mul", ["X", "two"], ["Y"], name="double")],
                   [helper.make_tensor_value_info("X", TensorProto.FLOAT, [])],
                   [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [])])
    model.graph.initializer.append(helper.make_tensor("two", TensorProto.FLOAT, [], [2.0]))
    return model


def custom_op_model() -> onnx.ModelProto:
    return _model([helper.make_node("Frobnicate", ["X"], ["Y"], domain="com.example", name="frob")],
                  [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 4])],
                  [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 4])],
                  opsets=(("", 17), ("com.example", 1)))


def no_inputs_model() -> onnx.ModelProto:
    return _model([helper.make_node("Constant", [], ["Y"], name="const",
                                    value=helper.make_tensor("v", TensorProto.FLOAT, [4], [1, 2, 3, 4]))],
                  [], [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [4])])


MODELS = {"nc_div": div_model, "nc_reshape": reshape_model, "nc_scalar": scalar_model,
          "nc_custom_op": custom_op_model, "nc_no_inputs": no_inputs_model}
"""Valid ONNX files, by model name."""

BROKEN = {"nc_garbage": lambda: np.random.default_rng(5).bytes(4096), "nc_empty": lambda: b"",
          "nc_truncated": lambda: div_model().SerializeToString()[:40]}
"""Files that are not ONNX models, by model name."""


def write_model(root: Path, name: str) -> Path:
    """``root/name/1/model.onnx`` of model ``name`` (``MODELS`` or ``BROKEN``), nothing else;
    returns the file's path."""
    path = Path(root) / name / "1" / "model.onnx"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(BROKEN[name]() if name in BROKEN else MODELS[name]().SerializeToString())
    return path
