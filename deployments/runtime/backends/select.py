"""Backend selection: which backend serves a model on this machine, why, and opening its engine.

``auto`` takes the first backend that can run here, in this order:

1. ``tensorrt``: a TensorRT module that can run on the visible GPU (``trt_module``);
2. ``onnxruntime_cuda``: ONNX Runtime's CUDA execution provider (the ``onnxruntime-gpu`` build)
   AND a visible CUDA device (``onnxruntime_cuda.unavailable_reason``);
3. ``onnxruntime``: ONNX Runtime on CPU.

Every choice carries a one-line reason (logged when a model loads, shown in ``/v2/memory``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from ..contract.config import ModelConfig
from ..contract.errors import ConfigError
from .base import Engine

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BackendChoice:
    """The backend that serves a model (``tensorrt``, ``onnxruntime_cuda``, ``onnxruntime``)
    and why (e.g. ``"auto: no TensorRT runtime for this GPU; CUDAExecutionProvider on NVIDIA
    H200 (compute capability 9.0), onnxruntime 1.31.1"``)."""

    backend: str
    reason: str


def tensorrt_available() -> bool:
    """True when a TensorRT module imports, a CUDA GPU is visible and the module can run on it
    (a stubs-only ``tensorrt`` folder does not count; TensorRT-RTX refuses e.g. an H200)."""
    from .trt_module import runtime_available

    return runtime_available()


def cuda_provider_unavailable() -> str | None:
    """Why ONNX Runtime's CUDA provider cannot run here, or None when it can."""
    from .onnxruntime_cuda import unavailable_reason

    return unavailable_reason()


def _cuda_description() -> str:
    from .onnxruntime_cuda import describe_device

    try:
        return describe_device()
    except Exception:  # a reason must not fail the load
        return "a CUDA device"


def choose_backend(requested: str) -> BackendChoice:
    """Resolve ``requested`` (``auto`` or a backend name) to the backend that will run, with the reason.

    Raises:
        ConfigError: ``tensorrt`` or ``onnxruntime_cuda`` was asked for explicitly and cannot run
            here (the message says why).
    """
    if requested == "tensorrt":
        if not tensorrt_available():
            raise ConfigError("backend 'tensorrt' requested, but no TensorRT module and CUDA GPU are present")
        return BackendChoice("tensorrt", "requested: tensorrt")
    if requested == "onnxruntime_cuda":
        why_not = cuda_provider_unavailable()
        if why_not:
            raise ConfigError(f"backend 'onnxruntime_cuda' requested, but {why_not}")
        return BackendChoice("onnxruntime_cuda", f"requested: CUDAExecutionProvider on {_cuda_description()}")
    if requested != "auto":
        return BackendChoice(requested, f"requested: {requested}")
    if tensorrt_available():
        return BackendChoice("tensorrt", "auto: a TensorRT runtime can run on this GPU")
    why_not = cuda_provider_unavailable()
    if why_not is None:
        return BackendChoice("onnxruntime_cuda",
                             f"auto: no TensorRT runtime for this GPU; CUDAExecutionProvider on {_cuda_description()}")
    return BackendChoice("onnxruntime", f"auto: no TensorRT runtime; {why_not}")


def resolve_backend(requested: str) -> str:
    """``choose_backend(requested).backend``.

    Raises:
        ConfigError: as ``choose_backend``.
    """
    return choose_backend(requested).backend


def requested_backend(config: ModelConfig, backend: str) -> str:
    """The backend asked for a model: the replica's ``backend``, or under ``auto`` the model
    config's own ``backend`` (itself ``auto`` by default; ``resolve_backend`` decides that)."""
    return config.backend if backend == "auto" else backend


def open_engine(config: ModelConfig, model_dir: Path, backend: str = "auto") -> Engine:
    """Load the model in ``model_dir`` (a version folder) with the chosen backend; the engine's
    ``choice`` attribute holds the ``BackendChoice`` (logged here).

    Under ``auto``, a TensorRT GPU without a fresh plan for it falls back to ONNX Runtime (CUDA
    where it can run, else CPU) with a warning (``make engines`` builds the plans); an explicit
    ``tensorrt`` raises instead.

    Raises:
        ConfigError: the config cannot be served as written (signature mismatch, a backend
            requested that this machine lacks).
        LoadFault, DeviceOutOfMemory: the server cannot bring the model up (no plan or a stale
            one, an unreadable model file, a provider that did not start, out of device memory).
    """
    requested = requested_backend(config, backend)
    choice = choose_backend(requested)
    engine: Engine | None = None
    if choice.backend == "tensorrt":
        from .plans import PlanMismatch
        from .tensorrt import TensorRTEngine  # GPU only; imported lazily

        try:
            engine = TensorRTEngine(config, model_dir)
        except PlanMismatch as e:
            if requested != "auto":
                raise
            logger.warning("%s; serving model '%s' with ONNX Runtime instead", e.message, config.name)
            why_not = cuda_provider_unavailable()
            choice = (BackendChoice("onnxruntime_cuda", f"auto: {e.message}; CUDAExecutionProvider instead")
                      if why_not is None else BackendChoice("onnxruntime", f"auto: {e.message}; {why_not}"))
    if engine is None and choice.backend == "onnxruntime_cuda":
        from .onnxruntime_cuda import OnnxRuntimeCudaEngine

        engine = OnnxRuntimeCudaEngine(config, model_dir)
    if engine is None:
        from .onnxruntime import OnnxRuntimeEngine

        engine = OnnxRuntimeEngine(config, model_dir)
    engine.choice = choice  # type: ignore[attr-defined]
    logger.info("model '%s': backend %s (%s)", config.name, choice.backend, choice.reason)
    return engine
