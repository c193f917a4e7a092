"""Input shapes at a model's max optimization profile (what a context must hold)."""

from __future__ import annotations

from .config import ModelConfig
from .errors import ConfigError



def batch_of(config: ModelConfig) -> int:
    """The max batch a context must hold: ``max_batch_size``, or 1 for a model without batch axis."""
    return config.max_batch_size if config.max_batch_size > 0 else 1


def max_profile_shapes(config: ModelConfig, batch: int | None = None) -> dict[str, tuple[int, ...]]:
    """Input name -> the largest shape the model accepts, axis 0 set to ``batch`` when given.

    Axis 0 is ``max_batch_size`` for a batched model (the config may allow a larger profile
    max, which is never used); other axes come from the profile max or the fixed dims.

    Raises:
        ConfigError: an input has a dynamic non-batch axis without a profile (no max known).
    """
    shapes: dict[str, tuple[int, ...]] = {}
    for spec in config.inputs:
        if spec.profile is not None:
            shape = list(spec.profile.max)
        else:
            shape = list(spec.dims)
            if config.max_batch_size and shape and shape[0] == -1:
                shape[0] = config.max_batch_size
            if any(d == -1 for d in shape):
                raise ConfigError(
                    f"model '{config.name}' input '{spec.name}': dims {list(spec.dims)} are dynamic "
                    "and there is no profile giving their max")
        if config.max_batch_size:
            shape[0] = batch if batch is not None else config.max_batch_size
        shapes[spec.name] = tuple(shape)
    return shapes


def shrunk_shapes(config: ModelConfig) -> tuple[dict[str, tuple[int, ...]], str] | None:
    """The max profile made smaller, and a description: half the max batch, else half the
    dynamic axes (never below the profile's opt). None when nothing can shrink."""
    shapes = max_profile_shapes(config)
    if config.max_batch_size > 1:
        half = config.max_batch_size // 2
        return {n: (half,) + s[1:] for n, s in shapes.items()}, f"batch {config.max_batch_size}->{half}"
    changed: dict[str, tuple[int, ...]] = {}
    notes = []
    for spec in config.inputs:
        shape = list(shapes[spec.name])
        if spec.profile is not None:
            for axis in range(1 if config.max_batch_size else 0, len(shape)):
                if spec.dims[axis] == -1:
                    target = max(shape[axis] // 2, spec.profile.opt[axis])
                    if target < shape[axis]:
                        notes.append(f"axis {axis} {shape[axis]}->{target}")
                        shape[axis] = target
        changed[spec.name] = tuple(shape)
    if not notes:
        return None
    return changed, ", ".join(notes)
