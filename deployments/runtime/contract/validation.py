"""Check decoded request tensors against a model's contract before any context is checked out."""

from __future__ import annotations

from typing import Iterable, Mapping

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
            step = spec.multiple_of[axis] if spec.multiple_of else 1
            if not lo[axis] <= size <= hi[axis] or size % step:
                allowed = f"{lo[axis]}" if lo[axis] == hi[axis] else f"[{lo[axis]}, {hi[axis]}]"
                if step > 1:
                    allowed += f" and a multiple of {step}"
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


def validate_outputs(config: ModelConfig, outputs: Iterable[str] | None) -> list[str]:
    """The output names to return: all declared ones when ``outputs`` is None.

    Raises:
        InvalidInput: a requested output the model does not declare, naming the declared ones.
    """
    declared = [t.name for t in config.outputs]
    if outputs is None:
        return declared
    wanted = list(outputs)
    unknown = [n for n in wanted if n not in declared]
    if unknown:
        raise InvalidInput(f"model '{config.name}' has no outputs {unknown}; outputs: {declared}")
    return wanted


def validate_request(config: ModelConfig, inputs: Mapping[str, np.ndarray],
                     outputs: Iterable[str] | None) -> list[str]:
    """``validate_inputs`` then ``validate_outputs``: the one check of a request, made by the
    replica that runs it. Returns the output names to return.

    Raises:
        InvalidInput: as ``validate_inputs`` and ``validate_outputs``.
    """
    validate_inputs(config, inputs)
    return validate_outputs(config, outputs)
