"""Warmup requests (a model config's ``warmup:`` section) built from the config alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..contract.config import ModelConfig, TensorSpec
from ..contract.datatypes import NUMPY_BY_DATATYPE, zeros
from ..contract.errors import ConfigError


def warmup_shape(config: ModelConfig, spec: TensorSpec, batch: int) -> tuple[int, ...]:
    """``batch`` on axis 0 (when the model batches), other dynamic axes at the profile's opt
    (min without a profile), fixed axes from ``dims``."""
    low, _ = spec.bounds()
    middle = spec.profile.opt if spec.profile is not None else low
    shape = [d if d != -1 else middle[axis] for axis, d in enumerate(spec.dims)]
    if config.max_batch_size:
        shape[0] = batch
    return tuple(shape)


def _random(datatype: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if datatype == "BYTES":
        return np.array([str(int(v)).encode() for v in rng.integers(0, 10, int(np.prod(shape)))],
                        dtype=object).reshape(shape)
    dtype = NUMPY_BY_DATATYPE[datatype]
    if dtype.kind == "f":
        return rng.random(shape).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(dtype)
    return rng.integers(0, 10, shape).astype(dtype)


def _from_file(config: ModelConfig, model_dir: Path, spec: TensorSpec, shape: tuple[int, ...]) -> np.ndarray:
    assert config.warmup is not None and config.warmup.file is not None
    path = model_dir / config.warmup.file
    try:
        with np.load(path, allow_pickle=False) as arrays:
            sample = arrays[spec.name]
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"{path}: warmup.file: cannot read input '{spec.name}' from it ({e})") from None
    if config.max_batch_size:  # rows repeated to the batch size
        sample = np.resize(sample, shape)
    if sample.shape != shape:
        raise ConfigError(f"{path}: warmup.file: input '{spec.name}' has shape {list(sample.shape)}; "
                          f"expected {list(shape)}")
    return sample.astype(NUMPY_BY_DATATYPE[spec.datatype])


def warmup_requests(config: ModelConfig, model_dir: Path) -> list[dict[str, np.ndarray]]:
    """The inputs of each warmup run, one per ``warmup.batch_sizes`` entry ([] without warmup).

    Raises:
        ConfigError: ``data: file`` and the file is missing, lacks an input or has the wrong shape.
    """
    if config.warmup is None:
        return []
    rng = np.random.default_rng(0)
    requests = []
    for batch in config.warmup.batch_sizes:
        inputs = {}
        for spec in config.inputs:
            shape = warmup_shape(config, spec, batch)
            if config.warmup.data == "zeros":
                inputs[spec.name] = zeros(spec.datatype, shape)
            elif config.warmup.data == "random":
                inputs[spec.name] = _random(spec.datatype, shape, rng)
            else:
                inputs[spec.name] = _from_file(config, model_dir, spec, shape)
        requests.append(inputs)
    return requests
