"""Triton's ``reshape``: tensors whose shape in the model file differs from the shape clients send
and receive (``TensorSpec.reshape`` against ``TensorSpec.dims``).

Source: Triton's model configuration, "Reshape" (docs/user_guide/model_configuration.md): an
input is reshaped to ``reshape`` before the model runs, an output from the model's shape to
``dims`` after; with a batch axis the reshape applies per batch item and the batch axis is
kept, so a batch of requests joined on axis 0 is reshaped as one. E.g. Triton's
``densenet_onnx``: input ``[3, 224, 224]`` runs as ``[1, 3, 224, 224]``, output ``[1, 1000, 1,
1]`` comes back as ``[1000]``.

A reshape only relabels the elements (C order, no copy for a contiguous array); ``ModelHost``
applies it around every run (requests, warmup), so the backends and the batcher above never see
the other shape.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from .config import ModelConfig
from .errors import InferenceError, InvalidInput


@dataclass(frozen=True)
class Reshape:
    """The reshapes of one model: ``inputs`` (name -> the model's shape) and ``outputs`` (name ->
    the client's shape), each per batch item when ``batched`` (the batch axis left out), -1 for
    the one axis whose size follows from the element count."""

    model: str
    batched: bool
    inputs: Mapping[str, tuple[int, ...]]
    outputs: Mapping[str, tuple[int, ...]]

    @staticmethod
    def of(config: ModelConfig) -> "Reshape | None":
        """The reshapes ``config`` asks for; None when no tensor has a ``reshape``."""
        skip = 1 if config.max_batch_size else 0
        inputs = {t.name: t.reshape[skip:] for t in config.inputs if t.reshape is not None}
        outputs = {t.name: t.dims[skip:] for t in config.outputs if t.reshape is not None}
        if not inputs and not outputs:
            return None
        return Reshape(config.name, bool(skip), inputs, outputs)

    def to_model(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """``inputs`` (arrays or ``DeviceTensor``), those with a reshape in the model's shape.

        Raises:
            InvalidInput: an input whose element count does not fit the model's shape (a client's
                shape along a dynamic axis); names the input and both shapes.
        """
        return {name: self._reshaped(value, self.inputs[name], f"input '{name}'", InvalidInput)
                if name in self.inputs else value for name, value in inputs.items()}

    def to_client(self, outputs: Mapping[str, Any]) -> dict[str, Any]:
        """``outputs`` (arrays or ``DeviceTensor``), those with a reshape in the client's shape (``dims``).

        Raises:
            InferenceError: the model produced an output whose element count does not fit ``dims``.
        """
        return {name: self._reshaped(value, self.outputs[name], f"output '{name}'", InferenceError)
                if name in self.outputs else value for name, value in outputs.items()}

    def _reshaped(self, value: Any, item: tuple[int, ...], what: str, error: type[Exception]) -> Any:
        shape = tuple(value.shape)
        target = (shape[0], *item) if self.batched and shape else item
        resolved = resolve(math.prod(shape), target)
        if resolved is None:
            raise error(f"model '{self.model}': {what} of shape {list(shape)} ({math.prod(shape)} elements) "
                        f"cannot be reshaped to {list(target)} (reshape in its config)")
        if isinstance(value, np.ndarray):
            return value.reshape(resolved)
        return dataclasses.replace(value, shape=resolved)  # a DeviceTensor: only its shape changes


def resolve(size: int, target: tuple[int, ...]) -> tuple[int, ...] | None:
    """``target`` with its -1 (at most one) set so that it holds ``size`` elements; None when no
    size fits (or, without -1, when it holds another count)."""
    known = math.prod(d for d in target if d != -1)
    if -1 not in target:
        return target if known == size else None
    if known == 0 or size % known:
        return None
    return tuple(size // known if d == -1 else d for d in target)


def engine_config(config: ModelConfig) -> ModelConfig:
    """``config`` as the model file sees it, for the backends and the plan builder: each tensor
    with a ``reshape`` gets it as its ``dims`` and its profile (the client's shapes) mapped to
    the model's shapes (the batch axis kept; a profile shape that maps to no model shape, along
    a dynamic axis, leaves the tensor without a profile); ``config`` itself when nothing is
    reshaped. Requests are validated against ``config``, never against this.
    """
    if Reshape.of(config) is None:
        return config
    skip = 1 if config.max_batch_size else 0

    def model_side(spec: Any) -> Any:
        if spec.reshape is None:
            return spec
        item = spec.reshape[skip:]
        profile = None
        if spec.profile is not None:
            shapes = [resolve(math.prod(s), (*s[:skip], *item)) for s in (spec.profile.min, spec.profile.opt,
                                                                          spec.profile.max)]
            if all(s is not None for s in shapes):
                profile = dict(zip(("min", "opt", "max"), shapes))
        return spec.model_validate({"name": spec.name, "datatype": spec.datatype, "dims": spec.reshape,
                                    "profile": profile})

    return config.model_copy(update={"inputs": tuple(model_side(t) for t in config.inputs),
                                     "outputs": tuple(model_side(t) for t in config.outputs)})
