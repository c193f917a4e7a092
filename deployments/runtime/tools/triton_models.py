"""Triton's quickstart example models as ONNX graphs: ``simple``, ``simple_string``, ``simple_identity``.

Triton's example clients (``src/python/examples/simple_http_*.py`` in
github.com/triton-inference-server/client) call these models by name; Triton ships them as
TensorFlow/Python models in its ``docs/examples/model_repository``. Here they are small ONNX graphs
built with ``onnx.helper`` (no weights, no download), opset 17, IR version 8, batch axis ``N``
dynamic (``max_batch_size: 8`` in their ``config.yaml``):

===============  ==========================================  ===========================================
model            inputs                                       outputs
===============  ==========================================  ===========================================
simple           ``INPUT0``, ``INPUT1`` INT32 ``(N, 16)``      ``OUTPUT0 = INPUT0 + INPUT1``,
                                                              ``OUTPUT1 = INPUT0 - INPUT1``, INT32 ``(N, 16)``
simple_string    ``INPUT0``, ``INPUT1`` BYTES ``(N, 16)``:     the sum and difference as decimal strings,
                 decimal integers as UTF-8 text               BYTES ``(N, 16)``
simple_identity  ``INPUT0`` BYTES ``(N, 16)``                  ``OUTPUT0``: the same bytes
===============  ==========================================  ===========================================

``simple_string`` is ``Cast`` string -> int32, ``Add``/``Sub``, ``Cast`` int32 -> string (ONNX
Runtime parses with ``std::stoll``: leading spaces and a sign are accepted, a value that is not a
number fails the run). The BYTES models run on ONNX Runtime only (TensorRT has no string tensors),
so their ``config.yaml`` says ``backend: onnxruntime``.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

OPSET = 17
IR_VERSION = 8
WIDTH = 16
"""Elements per row of every tensor, as in Triton's examples (``dims: [16]``)."""


def _model(name: str, nodes: list[onnx.NodeProto], inputs: dict[str, int], outputs: dict[str, int],
           doc: str) -> onnx.ModelProto:
    """A checked model whose tensors are all ``(N, 16)`` of the given ONNX element types."""
    def values(tensors: dict[str, int]) -> list[onnx.ValueInfoProto]:
        return [helper.make_tensor_value_info(n, t, ["N", WIDTH]) for n, t in tensors.items()]

    graph = helper.make_graph(nodes, name, values(inputs), values(outputs))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION,
                              producer_name="trt-serve deployments.runtime.tools.prepare", doc_string=doc)
    onnx.checker.check_model(model, full_check=True)
    return model


def _sum_and_difference(a: str, b: str, total: str, difference: str) -> list[onnx.NodeProto]:
    return [helper.make_node("Add", [a, b], [total], name="add"),
            helper.make_node("Sub", [a, b], [difference], name="sub")]


def build_simple() -> onnx.ModelProto:
    """``simple``: INT32 ``INPUT0``, ``INPUT1`` ``(N, 16)`` -> ``OUTPUT0`` sum, ``OUTPUT1`` difference."""
    int32 = TensorProto.INT32
    return _model("simple", _sum_and_difference("INPUT0", "INPUT1", "OUTPUT0", "OUTPUT1"),
                  {"INPUT0": int32, "INPUT1": int32}, {"OUTPUT0": int32, "OUTPUT1": int32},
                  "simple: Triton's quickstart model; OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1")


def build_simple_string() -> onnx.ModelProto:
    """``simple_string``: ``simple`` over decimal integers held as strings, BYTES in and out."""
    string, int32 = TensorProto.STRING, TensorProto.INT32
    nodes = [
        helper.make_node("Cast", ["INPUT0"], ["a"], name="parse0", to=int32),
        helper.make_node("Cast", ["INPUT1"], ["b"], name="parse1", to=int32),
        *_sum_and_difference("a", "b", "total", "difference"),
        helper.make_node("Cast", ["total"], ["OUTPUT0"], name="format0", to=string),
        helper.make_node("Cast", ["difference"], ["OUTPUT1"], name="format1", to=string),
    ]
    return _model("simple_string", nodes, {"INPUT0": string, "INPUT1": string},
                  {"OUTPUT0": string, "OUTPUT1": string},
                  "simple_string: Triton's quickstart model; sum and difference of decimal strings")


def build_simple_identity() -> onnx.ModelProto:
    """``simple_identity``: BYTES ``INPUT0`` ``(N, 16)`` -> ``OUTPUT0``, the same elements."""
    return _model("simple_identity", [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"], name="identity")],
                  {"INPUT0": TensorProto.STRING}, {"OUTPUT0": TensorProto.STRING},
                  "simple_identity: Triton's quickstart model; OUTPUT0 = INPUT0 (strings)")
