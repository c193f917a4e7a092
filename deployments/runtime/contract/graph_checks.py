"""Checks of a request that a model's ONNX graph implies and its config cannot say, made before
the run so that a client's mistake is a 400 naming it instead of a runtime failure (a 500, or on
a GPU an index read out of bounds):

* inputs whose axes share a named dimension (``dim_param``): ``input_ids`` and
  ``attention_mask`` both ``[batch, sequence]`` must agree on ``sequence`` (a name that is no
  identifier, such as the ``?`` some exporters write for "unknown", ties nothing);
* integer inputs a ``Gather`` reads a table with (an embedding): every index must be inside
  the table, ``[-rows, rows - 1]`` as ONNX counts negative indices from the end.

``GraphChecks.read`` reads them from the file once per file version (memoized).
"""

from __future__ import annotations

import functools
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np
import onnx

from .errors import InvalidInput
from .files import file_version

# A dimension's name that names a size: some exporters write "?" for "unknown" on every dynamic
# axis (paddle2onnx: the OCR models), which ties nothing together.
_SIZE_NAME = re.compile(r"[A-Za-z_][\w.:-]*")


@dataclass(frozen=True)
class SharedAxis:
    """A dimension the graph names (``dim_param``) on more than one input axis: ``members`` are
    ``(input, axis)`` pairs, axes counted as in the request (batch axis first)."""

    name: str
    members: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class TableIndex:
    """Input ``input`` indexes axis ``axis`` of a table of ``rows`` entries there, in the graph's
    ``Gather`` node ``node``."""

    input: str
    node: str
    rows: int


@dataclass(frozen=True)
class GraphChecks:
    shared: tuple[SharedAxis, ...] = ()
    indices: tuple[TableIndex, ...] = ()

    @staticmethod
    def read(path: Path) -> "GraphChecks":
        """The checks of the ONNX file at ``path`` (no checks for a file that cannot be read:
        its load reports that)."""
        try:
            version = file_version(path)
        except OSError:
            return GraphChecks()
        return _read(*version)

    def check(self, model: str, inputs: Mapping[str, np.ndarray]) -> None:
        """Raise ``InvalidInput`` for the first check ``inputs`` fail; inputs not given are skipped.

        An input in GPU memory (``contract.device.DeviceTensor``) has its axes checked, not its
        values (they are not read on the host).

        Raises:
            InvalidInput: two inputs disagree on a shared axis (names both, the axis and the
                sizes), or an index is outside its table (names the input, the element's flat
                index, its value and the allowed range).
        """
        for shared in self.shared:
            sizes = [(name, axis, inputs[name].shape[axis]) for name, axis in shared.members
                     if name in inputs and inputs[name].ndim > axis]
            if len({size for _, _, size in sizes}) > 1:
                listed = ", ".join(f"'{name}' axis {axis} is {size}" for name, axis, size in sizes)
                raise InvalidInput(f"model '{model}': inputs must agree on the dimension the model names "
                                   f"'{shared.name}': {listed}")
        for index in self.indices:
            array = inputs.get(index.input)
            if not isinstance(array, np.ndarray) or array.size == 0 or array.dtype.kind not in "iu":
                continue
            bad = np.flatnonzero((array < -index.rows) | (array >= index.rows))
            if bad.size:
                i = int(bad[0])
                raise InvalidInput(
                    f"model '{model}' input '{index.input}': element {i} is {array.reshape(-1)[i]}, past the "
                    f"{index.rows} entries of the table it indexes (node '{index.node}'); allowed "
                    f"0 to {index.rows - 1} (or -{index.rows} to -1, counted from the end)")


@functools.lru_cache(maxsize=64)
def _read(path: str, size: int, mtime_ns: int) -> GraphChecks:
    """``GraphChecks`` of one version of a file (``files.file_version``)."""
    graph = onnx.load(path, load_external_data=False).graph
    initializers = {t.name: tuple(t.dims) for t in graph.initializer}
    inputs = [i for i in graph.input if i.name not in initializers]
    named: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for value in inputs:
        for axis, dim in enumerate(value.type.tensor_type.shape.dim):
            if dim.HasField("dim_param") and _SIZE_NAME.fullmatch(dim.dim_param):
                named[dim.dim_param].append((value.name, axis))
    shared = tuple(SharedAxis(name, tuple(members)) for name, members in named.items() if len(members) > 1)
    names = {i.name for i in inputs}
    indices = []
    for node in graph.node:
        if node.op_type == "Gather" and len(node.input) == 2 and node.input[1] in names \
                and node.input[0] in initializers:
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            table = initializers[node.input[0]]
            if -len(table) <= axis < len(table):
                indices.append(TableIndex(node.input[1], node.name or node.output[0], int(table[axis])))
    return GraphChecks(shared, tuple(indices))
