"""Check decoded request tensors against a model's contract before any context is checked out."""

from __future__ import annotations

from typing import Iterable, Mapping

import numpy as np

from .config import ModelConfig
from .datatypes import NUMPY_BY_DATATYPE, datatype_of
from .errors import InvalidInput


def _dims_text(dims: Iterable[int]) -> str:
    """Dims as Triton prints them (``DimsListToString``): ``[-1,16]``."""
    return "[" + ",".join(str(d) for d in dims) + "]"


def _datatype_text(array: np.ndarray) -> str:
    try:
        return datatype_of(array)
    except KeyError:
        return str(array.dtype)


_LISTED = 8  # names an error lists at most: its body stays small however many a request sends
_NAME_CHARS = 64


def _short(name: str) -> str:
    return name if len(name) <= _NAME_CHARS else f"{name[:_NAME_CHARS]}..."


def _listed(names: Iterable[str]) -> str:
    """``names`` as a list text, at most ``_LISTED`` of them (each cut to ``_NAME_CHARS``), then
    how many more: an error body must not grow with the request."""
    names = list(names)
    text = ", ".join(repr(_short(n)) for n in names[:_LISTED])
    more = f", ... and {len(names) - _LISTED} more" if len(names) > _LISTED else ""
    return f"[{text}{more}]"


def validate_inputs(config: ModelConfig, inputs: Mapping[str, np.ndarray]) -> None:
    """Check names, dtypes, ranks, the batch size and every axis against the optimization profile.

    Each message starts with Triton's wording for the same fault (source: Triton core,
    ``InferenceRequest::Normalize`` and ``Model::GetInput``), then names the model, the input,
    the axis and the allowed range.

    Args:
        config: the model's contract.
        inputs: input name -> array; shapes include the batch axis when ``max_batch_size > 0``.

    Raises:
        InvalidInput: see above.
    """
    model = config.name
    expected = {t.name for t in config.inputs}
    missing = sorted(expected - inputs.keys())
    unknown = sorted(inputs.keys() - expected)
    if missing or unknown:
        if unknown:
            triton = f"unexpected inference input '{_short(unknown[0])}' for model '{model}'"
        else:
            triton = (f"expected {len(expected)} inputs but got {len(inputs)} inputs for model '{model}'. "
                      f"Got input(s) {_listed(sorted(inputs))}, but missing required input(s) {missing}. "
                      "Please provide all required input(s)")
        raise InvalidInput(
            f"{triton}; model '{model}' expects inputs {sorted(expected)}; missing {missing}, unknown {_listed(unknown)}")
    batch = None
    for spec in config.inputs:  # the messages are made only for a fault: this runs per request
        array = inputs[spec.name]
        want = NUMPY_BY_DATATYPE[spec.datatype]
        if array.dtype != want and not (spec.datatype == "BYTES" and array.dtype.kind in "OSU"):
            raise InvalidInput(
                f"inference input '{spec.name}' data-type is '{_datatype_text(array)}', but model "
                f"'{model}' expects '{spec.datatype}'; {_where(model, spec.name)}: datatype must be {spec.datatype}")
        shape = array.shape
        if len(shape) != len(spec.dims):
            raise InvalidInput(
                f"{_shape_fault(model, spec.name, spec.dims, shape)}; {_where(model, spec.name)}: expected rank "
                f"{len(spec.dims)} (dims {list(spec.dims)}), got shape {list(shape)}")
        if config.max_batch_size:
            if shape[0] > config.max_batch_size:
                raise InvalidInput(
                    f"inference request batch-size must be <= {config.max_batch_size} for '{model}'; "
                    f"{_where(model, spec.name)}: axis 0 is {shape[0]}, allowed [1, {config.max_batch_size}] "
                    "(max_batch_size)")
            if batch is not None and shape[0] != batch:
                raise InvalidInput(
                    f"input '{spec.name}' batch size does not match other inputs for '{model}'; "
                    f"model '{model}': inputs disagree on batch size (axis 0): {batch} and {shape[0]}")
            batch = shape[0]
        lo, hi = spec.bounds()
        steps = spec.multiple_of
        for axis, size in enumerate(shape):
            step = steps[axis] if steps else 1
            if not lo[axis] <= size <= hi[axis] or size % step:
                allowed = f"{lo[axis]}" if lo[axis] == hi[axis] else f"[{lo[axis]}, {hi[axis]}]"
                if step > 1:
                    allowed += f" and a multiple of {step}"
                raise InvalidInput(
                    f"{_shape_fault(model, spec.name, spec.dims, shape)}; {_where(model, spec.name)}: axis {axis} "
                    f"is {size}, allowed {allowed} (shape {list(shape)})")


def _where(model: str, name: str) -> str:
    return f"model '{model}' input '{name}'"


def _shape_fault(model: str, name: str, dims: Iterable[int], shape: Iterable[int]) -> str:
    """Triton's words for an input of the wrong shape."""
    return f"unexpected shape for input '{name}' for model '{model}'. Expected {_dims_text(dims)}, got {_dims_text(shape)}"


def validate_outputs(config: ModelConfig, outputs: Iterable[str] | None) -> list[str]:
    """The output names to return: all declared ones when ``outputs`` is None.

    Raises:
        InvalidInput: a requested output the model does not declare, naming the declared ones
            (Triton's "unexpected inference output" first).
    """
    declared = [t.name for t in config.outputs]
    if outputs is None:
        return declared
    wanted = list(outputs)
    unknown = [n for n in wanted if n not in declared]
    if unknown:
        raise InvalidInput(
            f"unexpected inference output '{_short(unknown[0])}' for model '{config.name}'; model "
            f"'{config.name}' has no outputs {_listed(unknown)}; outputs: {declared}")
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
