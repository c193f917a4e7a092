"""Check decoded request tensors against a model's contract before any context is checked out."""

from __future__ import annotations

from typing import Mapping

import numpy as np

from .config import ModelConfig
from .datatypes import NUMPY_BY_DATATYPE
from .errors import InvalidInput


def validate_inputs(config: ModelConfig, inputs: Mapping[str, np.ndarray]) -> None:
    """Check names, dtypes, ranks and every axis against the optimization profile.

    Args:
        config: the model's contract.
        inputs: input name -> array; shapes include the batch axis when ``max_batch_size > 0``.

    Raises:
        InvalidInput: naming the model, the input, the axis and the allowed range.
    """
    expected = {t.name for t in config.inputs}
    missing = sorted(expected - inputs.keys())
    unknown = sorted(inputs.keys() - expected)
    if missing or unknown:
        raise InvalidInput(
            f"model '{config.name}' expects inputs {sorted(expected)}; "
            f"missing {missing}, unknown {unknown}")
    batch = None
    for spec in config.inputs:
        array = inputs[spec.name]
        want = NUMPY_BY_DATATYPE[spec.datatype]
        if array.dtype != want and not (spec.datatype == "BYTES" and array.dtype.kind in "OSU"):
            raise InvalidInput(
                f"model '{config.name}' input '{spec.name}': datatype must be {spec.datatype}")
        if array.ndim != len(spec.dims):
            raise InvalidInput(
                f"model '{config.name}' input '{spec.name}': expected rank {len(spec.dims)} "
                f"(dims {list(spec.dims)}), got shape {list(array.shape)}")
        lo, hi = spec.bounds()
        for axis, size in enumerate(array.shape):
            if not lo[axis] <= size <= hi[axis]:
                allowed = f"{lo[axis]}" if lo[axis] == hi[axis] else f"[{lo[axis]}, {hi[axis]}]"
                raise InvalidInput(
                    f"model '{config.name}' input '{spec.name}': axis {axis} is {size}, "
                    f"allowed {allowed} (shape {list(array.shape)})")
        if config.max_batch_size:
            if array.shape[0] > config.max_batch_size:
                raise InvalidInput(
                    f"model '{config.name}' input '{spec.name}': batch (axis 0) is "
                    f"{array.shape[0]}, allowed [1, {config.max_batch_size}] (max_batch_size)")
            if batch is not None and array.shape[0] != batch:
                raise InvalidInput(
                    f"model '{config.name}': inputs disagree on batch size (axis 0): "
                    f"{batch} and {array.shape[0]}")
            batch = array.shape[0]
