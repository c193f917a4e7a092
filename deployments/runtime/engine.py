"""The engine contract both backends fill, and backend selection.

An ``Engine`` is the loaded, read-only model (TensorRT: ``ICudaEngine``; ONNX Runtime: an
``InferenceSession``). An ``ExecutionContext`` is the unit of concurrency: one request at a
time each; ``ModelHost`` pools them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Protocol

import numpy as np

from .config import ModelConfig
from .errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Footprint:
    """Memory a loaded model holds, in bytes.

    ``engine_bytes``: weights/plan; ``context_bytes``: per execution context (activations,
    I/O buffers); ``measured``: True when taken from the backend or a memory delta, False when
    predicted.
    """

    engine_bytes: int
    context_bytes: int
    measured: bool = True

    def total(self, instances: int) -> int:
        return self.engine_bytes + instances * self.context_bytes


class ExecutionContext(Protocol):
    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one request. Inputs are validated already; returns every output by name.

        Raises:
            InferenceError: the backend reported a failure.
        """

    def close(self) -> None: ...


class Engine(Protocol):
    backend: str

    def create_context(self) -> ExecutionContext: ...

    def footprint(self) -> Footprint: ...

    def close(self) -> None:
        """Release the engine; every context must be closed first."""


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


def open_engine(config: ModelConfig, model_dir: Path, backend: str = "auto") -> Engine:
    """Load the model in ``model_dir`` (a version folder) with the chosen backend.

    Under ``auto``, a TensorRT GPU without a fresh plan for it falls back to ONNX Runtime with
    a warning (``make engines`` builds the plans); an explicit ``tensorrt`` raises instead.

    Raises:
        ConfigError: the backend cannot load this model (no plan, stale plan, signature mismatch).
    """
    requested = config.backend if backend == "auto" else backend
    chosen = resolve_backend(requested)
    if chosen == "tensorrt":
        from .plans import PlanMismatch
        from .tensorrt_engine import TensorRTEngine  # GPU only; imported lazily

        try:
            return TensorRTEngine(config, model_dir)
        except PlanMismatch as e:
            if requested != "auto":
                raise
            logger.warning("%s; serving model '%s' with ONNX Runtime instead", e.message, config.name)
    from .onnxruntime_engine import OnnxRuntimeEngine

    return OnnxRuntimeEngine(config, model_dir)
