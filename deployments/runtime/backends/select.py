"""Backend selection: which backend serves a model on this machine, and opening its engine."""

from __future__ import annotations

import logging
from pathlib import Path

from ..contract.config import ModelConfig
from ..contract.errors import ConfigError
from .base import Engine

logger = logging.getLogger(__name__)


def tensorrt_available() -> bool:
    """True when a TensorRT module imports, a CUDA GPU is visible and the module can run on it
    (a stubs-only ``tensorrt`` folder does not count; TensorRT-RTX refuses e.g. an H200)."""
    from .trt_module import runtime_available

    return runtime_available()


def resolve_backend(requested: str) -> str:
    """``auto`` -> ``tensorrt`` when available, else ``onnxruntime``.

    Raises:
        ConfigError: ``tensorrt`` was asked for and no TensorRT GPU is present.
    """
    if requested == "auto":
        return "tensorrt" if tensorrt_available() else "onnxruntime"
    if requested == "tensorrt" and not tensorrt_available():
        raise ConfigError("backend 'tensorrt' requested, but no TensorRT module and CUDA GPU are present")
    return requested


def requested_backend(config: ModelConfig, backend: str) -> str:
    """The backend asked for a model: the replica's ``backend``, or under ``auto`` the model
    config's own ``backend`` (itself ``auto`` by default; ``resolve_backend`` decides that)."""
    return config.backend if backend == "auto" else backend


def open_engine(config: ModelConfig, model_dir: Path, backend: str = "auto") -> Engine:
    """Load the model in ``model_dir`` (a version folder) with the chosen backend.

    Under ``auto``, a TensorRT GPU without a fresh plan for it falls back to ONNX Runtime with
    a warning (``make engines`` builds the plans); an explicit ``tensorrt`` raises instead.

    Raises:
        ConfigError: the backend cannot load this model (no plan, stale plan, signature mismatch).
    """
    requested = requested_backend(config, backend)
    chosen = resolve_backend(requested)
    if chosen == "tensorrt":
        from .plans import PlanMismatch
        from .tensorrt import TensorRTEngine  # GPU only; imported lazily

        try:
            return TensorRTEngine(config, model_dir)
        except PlanMismatch as e:
            if requested != "auto":
                raise
            logger.warning("%s; serving model '%s' with ONNX Runtime instead", e.message, config.name)
    from .onnxruntime import OnnxRuntimeEngine

    return OnnxRuntimeEngine(config, model_dir)
