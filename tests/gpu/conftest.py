"""GPU tests: skipped, with the reason, where no CUDA GPU (or no TensorRT for it) is present.

``requires_cuda``: cuda-python and a visible CUDA device (the H200 machine has both).
``requires_tensorrt``: additionally a TensorRT module that can run on that GPU: full TensorRT,
or TensorRT-RTX on one of its targets (it refuses an H200, compute capability 9.0).
"""

from __future__ import annotations

import pytest

from deployments.runtime.backends import cuda, trt_module


def _cuda_reason() -> str | None:
    try:
        cuda._runtime()
    except cuda.CudaError:
        return "cuda-python is not installed (pip install cuda-bindings)"
    if cuda.device_count() == 0:
        return "no CUDA GPU visible to cuda-python"
    return None


def _tensorrt_reason() -> str | None:
    reason = _cuda_reason()
    if reason:
        return reason
    if not trt_module.available():
        return "no TensorRT module (tensorrt or tensorrt_rtx) is installed"
    if not trt_module.runtime_available():
        major, minor = cuda.compute_capability(0)
        found = trt_module.load()
        return (f"{found.flavour} {found.version} cannot run on this GPU "
                f"(compute capability {major}.{minor}; its targets: {found.target_compute_capabilities()})")
    return None


CUDA_REASON = _cuda_reason()
TENSORRT_REASON = _tensorrt_reason()
requires_cuda = pytest.mark.skipif(CUDA_REASON is not None, reason=CUDA_REASON or "")
requires_tensorrt = pytest.mark.skipif(TENSORRT_REASON is not None, reason=TENSORRT_REASON or "")
