"""A BERT encoder as ONNX, built with ``onnx.helper`` from its weights (no torch).

``build_bert(weights, shape)`` writes the graph of Hugging Face ``transformers``' ``BertModel``
(post-LayerNorm, absolute positions, exact erf GELU; Devlin et al. 2019) for the weight names of a
``model.safetensors`` saved by ``transformers`` (``embeddings.word_embeddings.weight``,
``encoder.layer.{i}.attention.self.query.weight``, ...; a ``bert.`` prefix is accepted). The
pooler is left out: sentence-transformers pools the last hidden state itself.

Contract (all three inputs required, as ONNX exports of ``BertModel`` have them)::

    input  input_ids       INT64 [batch, sequence]   token ids (< vocab size)
           attention_mask  INT64 [batch, sequence]   1 for a token, 0 for padding
           token_type_ids  INT64 [batch, sequence]   segment ids (0 for one sentence)
    output last_hidden_state FP32 [batch, sequence, hidden]

Padded positions are masked out of attention by adding -10000 to their scores (BERT's original
value; exp(-10000) is 0 in FP32, and the figure stays finite in FP16); their own output rows are
not meaningful and are left to pooling to ignore. Sequences up to ``max_position_embeddings``.

``python -m deployments.runtime.tools.bert SRC --root engines --name NAME`` exports a
sentence-transformers (or ``transformers``) BERT folder holding ``config.json`` and
``model.safetensors`` to ``<root>/<NAME>/1/model.onnx``, with its ``tokenizer.json`` beside it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..contract.files import write_atomic

OPSET = 17  # LayerNormalization is in opset 17
IR_VERSION = 8
INPUTS = ("input_ids", "attention_mask", "token_type_ids")
OUTPUT = "last_hidden_state"
MASK_BIAS = -10000.0
TOKENIZER_FILENAME = "tokenizer.json"


@dataclass(frozen=True)
class BertShape:
    """The hyperparameters of a BERT encoder (the fields of its ``config.json``)."""

    hidden_size: int
    num_attention_heads: int
    num_hidden_layers: int
    layer_norm_eps: float = 1e-12

    @classmethod
    def from_config(cls, config: Mapping[str, object]) -> "BertShape":
        """From a ``transformers`` ``config.json`` mapping.

        Raises:
            ValueError: not a BERT config of this graph (another ``model_type``,
                ``hidden_act`` other than ``gelu``, relative positions).
        """
        if config.get("model_type", "bert") != "bert":
            raise ValueError(f"model_type is {config.get('model_type')!r}; only 'bert' is exported")
        if config.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"hidden_act is {config.get('hidden_act')!r}; only 'gelu' (erf) is exported")
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("only absolute position embeddings are exported")
        return cls(int(config["hidden_size"]), int(config["num_attention_heads"]),  # type: ignore[arg-type]
                   int(config["num_hidden_layers"]), float(config.get("layer_norm_eps", 1e-12)))  # type: ignore[arg-type]


class _Graph:
    """Nodes and initializers of one graph; names are unique by a counter."""

    def __init__(self, weights: Mapping[str, np.ndarray]) -> None:
        prefix = "bert." if "bert.embeddings.word_embeddings.weight" in weights else ""
        self.weights = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []
        self._count = 0

    def name(self, kind: str) -> str:
        self._count += 1
        return f"{kind}_{self._count}"

    def param(self, key: str, transpose: bool = False) -> str:
        """The weight ``key`` as an FP32 initializer (transposed: a ``Linear`` weight for MatMul)."""
        try:
            array = self.weights[key]
        except KeyError:
            raise ValueError(f"weight '{key}' is missing") from None
        array = np.asarray(array, np.float32)
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array.T if transpose else array), key))
        return key

    def const(self, value: np.ndarray) -> str:
        name = self.name("const")
        self.initializers.append(numpy_helper.from_array(value, name))
        return name

    def op(self, op_type: str, inputs: Sequence[str], **attributes: object) -> str:
        out = self.name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, **attributes))
        return out

    def linear(self, x: str, prefix: str) -> str:
        """``x @ W^T + b`` of ``transformers``' ``nn.Linear`` at ``prefix``."""
        return self.op("Add", [self.op("MatMul", [x, self.param(f"{prefix}.weight", transpose=True)]),
                               self.param(f"{prefix}.bias")])

    def layer_norm(self, x: str, prefix: str, eps: float) -> str:
        return self.op("LayerNormalization", [x, self.param(f"{prefix}.weight"), self.param(f"{prefix}.bias")],
                       axis=-1, epsilon=eps)

    def gelu(self, x: str) -> str:
        """``0.5 x (1 + erf(x / sqrt 2))`` (``transformers``' ``gelu``; the ONNX Gelu op is opset 20)."""
        scaled = self.op("Div", [x, self.const(np.array(np.sqrt(2.0), np.float32))])
        one_plus = self.op("Add", [self.op("Erf", [scaled]), self.const(np.array(1.0, np.float32))])
        return self.op("Mul", [self.op("Mul", [x, one_plus]), self.const(np.array(0.5, np.float32))])


def build_bert(weights: Mapping[str, np.ndarray], shape: BertShape, name: str = "bert",
               doc: str = "") -> onnx.ModelProto:
    """The encoder graph (module docstring) over ``weights`` (name -> array, as
    ``safetensors.numpy.load_file`` returns).

    Raises:
        ValueError: a weight is missing, or ``hidden_size`` is not a multiple of the head count.
    """
    hidden, heads = shape.hidden_size, shape.num_attention_heads
    if hidden % heads:
        raise ValueError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    head_size = hidden // heads
    g = _Graph(weights)
    ids, mask, types = INPUTS

    # Embeddings: word + position (0..S-1) + token type, then LayerNorm.
    seq = g.op("Gather", [g.op("Shape", [ids]), g.const(np.array(1, np.int64))], axis=0)
    positions = g.op("Range", [g.const(np.array(0, np.int64)), seq, g.const(np.array(1, np.int64))])
    x = g.op("Add", [g.op("Gather", [g.param("embeddings.word_embeddings.weight"), ids]),
                     g.op("Gather", [g.param("embeddings.position_embeddings.weight"), positions])])
    x = g.op("Add", [x, g.op("Gather", [g.param("embeddings.token_type_embeddings.weight"), types])])
    x = g.layer_norm(x, "embeddings.LayerNorm", shape.layer_norm_eps)

    # (1 - mask) * -10000 as (B, 1, 1, S), added to every head's scores.
    keep = g.op("Cast", [mask], to=TensorProto.FLOAT)
    bias = g.op("Mul", [g.op("Sub", [g.const(np.array(1.0, np.float32)), keep]),
                        g.const(np.array(MASK_BIAS, np.float32))])
    bias = g.op("Unsqueeze", [bias, g.const(np.array([1, 2], np.int64))])
    split_heads = g.const(np.array([0, 0, heads, head_size], np.int64))  # (B, S, H) -> (B, S, heads, d)
    merge_heads = g.const(np.array([0, 0, hidden], np.int64))
    scale = g.const(np.array(1.0 / np.sqrt(head_size), np.float32))

    for layer in range(shape.num_hidden_layers):
        p = f"encoder.layer.{layer}"
        q, k, v = (g.op("Reshape", [g.linear(x, f"{p}.attention.self.{part}"), split_heads])
                   for part in ("query", "key", "value"))
        q = g.op("Transpose", [q], perm=[0, 2, 1, 3])  # (B, heads, S, d)
        k = g.op("Transpose", [k], perm=[0, 2, 3, 1])  # (B, heads, d, S)
        v = g.op("Transpose", [v], perm=[0, 2, 1, 3])
        scores = g.op("Add", [g.op("Mul", [g.op("MatMul", [q, k]), scale]), bias])
        context = g.op("MatMul", [g.op("Softmax", [scores], axis=-1), v])
        context = g.op("Reshape", [g.op("Transpose", [context], perm=[0, 2, 1, 3]), merge_heads])
        x = g.layer_norm(g.op("Add", [g.linear(context, f"{p}.attention.output.dense"), x]),
                         f"{p}.attention.output.LayerNorm", shape.layer_norm_eps)
        inner = g.gelu(g.linear(x, f"{p}.intermediate.dense"))
        x = g.layer_norm(g.op("Add", [g.linear(inner, f"{p}.output.dense"), x]),
                         f"{p}.output.LayerNorm", shape.layer_norm_eps)
    g.nodes.append(helper.make_node("Identity", [x], [OUTPUT], name="output"))

    dims = ["batch", "sequence"]
    graph = helper.make_graph(
        g.nodes, name, [helper.make_tensor_value_info(n, TensorProto.INT64, dims) for n in INPUTS],
        [helper.make_tensor_value_info(OUTPUT, TensorProto.FLOAT, [*dims, hidden])], initializer=g.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION,
                              producer_name="trt-serve deployments.bert", doc_string=doc)
    onnx.checker.check_model(model)
    return model


def load_safetensors(data: bytes) -> dict[str, np.ndarray]:
    """Name -> array of a ``model.safetensors`` file's bytes (read with numpy, no torch)."""
    from safetensors.numpy import load  # imported here: only the tools need it

    return load(data)


def export_folder(src: Path, root: Path, name: str, version: str = "1") -> Path:
    """Export ``src`` (``config.json``, ``model.safetensors``, ``tokenizer.json``) to
    ``<root>/<name>/<version>/model.onnx`` with ``tokenizer.json`` beside it; returns the model path.

    Raises:
        ValueError: see ``BertShape.from_config`` and ``build_bert``.
        OSError: a file is missing or unreadable.
    """
    shape = BertShape.from_config(json.loads((src / "config.json").read_text()))
    model = build_bert(load_safetensors((src / "model.safetensors").read_bytes()), shape, name,
                       f"{name}: BERT encoder exported from {src.name}")
    path = root / name / version / "model.onnx"
    write_atomic(path, model.SerializeToString())
    shutil.copyfile(src / TOKENIZER_FILENAME, path.parent / TOKENIZER_FILENAME)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deployments.runtime.tools.bert",
        description="Export a BERT sentence encoder folder (config.json, model.safetensors, tokenizer.json) "
                    "to <root>/<name>/1/model.onnx for the embed pipeline.")
    parser.add_argument("src", type=Path, help="the model folder (a sentence-transformers or transformers save)")
    parser.add_argument("--root", type=Path, default=Path("engines"), help="model repository (default: engines)")
    parser.add_argument("--name", required=True, help="the model's name in the repository")
    args = parser.parse_args(argv)
    try:
        path = export_folder(args.src, args.root, args.name)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {path} and {path.parent / TOKENIZER_FILENAME}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
