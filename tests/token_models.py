"""Small real ONNX models that take token ids, as a text model does, written into a model
repository folder with their ``config.yaml`` (``onnx.helper``; a few hundred bytes each).

``write_token_model(root, name)``: inputs ``input_ids`` and ``attention_mask``, INT64
``[batch, sequence]``; ``embeddings = table[input_ids] * attention_mask`` ``[batch, sequence, 4]``
with a table of ``vocab`` rows. ``mask_axis``: the name the graph gives the mask's second axis
(the same ``sequence`` by default: the inputs share it). ``offset``: ids go through ``Add(ids,
offset)`` before the ``Gather``, so no check before the run can see the table's bound.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import yaml
from onnx import TensorProto, helper

WIDTH = 4


def token_model(vocab: int = 10, mask_axis: str = "sequence", offset: int | None = None) -> onnx.ModelProto:
    table = helper.make_tensor("table", TensorProto.FLOAT, [vocab, WIDTH],
                               np.arange(vocab * WIDTH, dtype=np.float32).tolist())
    initializers = [table, helper.make_tensor("axes", TensorProto.INT64, [1], [2])]
    nodes = []
    ids = "input_ids"
    if offset is not None:
        initializers.append(helper.make_tensor("offset", TensorProto.INT64, [], [offset]))
        nodes.append(helper.make_node("Add", ["input_ids", "offset"], ["shifted"], name="shift"))
        ids = "shifted"
    nodes += [helper.make_node("Gather", ["table", ids], ["embedded"], axis=0, name="embed"),
              helper.make_node("Cast", ["attention_mask"], ["mask_float"], to=TensorProto.FLOAT, name="cast"),
              helper.make_node("Unsqueeze", ["mask_float", "axes"], ["mask3"], name="unsqueeze"),
              helper.make_node("Mul", ["embedded", "mask3"], ["embeddings"], name="mask_mul")]
    graph = helper.make_graph(
        nodes, "tokens",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", mask_axis])],
        [helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, ["batch", "sequence", WIDTH])],
        initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def token_config(name: str, **changes: Any) -> dict[str, Any]:
    profile = {"min": [1, 1], "opt": [1, 8], "max": [8, 64]}
    config = {"name": name, "max_batch_size": 8,
              "inputs": [{"name": n, "datatype": "INT64", "dims": [-1, -1], "profile": profile}
                         for n in ("input_ids", "attention_mask")],
              "outputs": [{"name": "embeddings", "datatype": "FP32", "dims": [-1, -1, WIDTH]}],
              "deployment": {"mode": "pool"}}
    config.update(changes)
    return config


def write_token_model(root: Path, name: str, vocab: int = 10, mask_axis: str = "sequence",
                      offset: int | None = None, **changes: Any) -> Path:
    """``root/name/config.yaml`` (``token_config`` with ``changes``) and ``root/name/1/model.onnx``;
    returns the model's folder."""
    folder = root / name
    (folder / "1").mkdir(parents=True)
    onnx.save(token_model(vocab, mask_axis, offset), str(folder / "1" / "model.onnx"))
    (folder / "config.yaml").write_text(yaml.safe_dump(token_config(name, **changes)))
    return folder


def token_inputs(ids: list[list[int]], mask_length: int | None = None) -> dict[str, np.ndarray]:
    """``input_ids`` from ``ids`` and an all-ones ``attention_mask`` as long (or ``mask_length``)."""
    input_ids = np.array(ids, np.int64)
    length = input_ids.shape[1] if mask_length is None else mask_length
    return {"input_ids": input_ids, "attention_mask": np.ones((input_ids.shape[0], length), np.int64)}
