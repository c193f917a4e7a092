"""GPU memory held by THIS process, for footprints and budgets of models that live on a GPU.

Several replicas share one GPU under fractional ``num_gpus``, so a device-wide reading
(``cudaMemGetInfo``'s total - free) counts every process's allocations, and a delta of it across
one replica's load counts whatever the others allocated meanwhile. The per-process figure comes
from NVML (``nvmlDeviceGetComputeRunningProcesses``: ``usedGpuMemory`` of this pid, summed over
the devices); it includes the CUDA context (about 0.5 GB on an H200, once per process) and
every allocation of the process: ONNX Runtime's arena, cuDNN/cuBLAS workspaces, our own
``cudaMalloc`` buffers. Where NVML is missing or does not report this process (no
``nvidia-ml-py``, a sandbox whose driver shim hides other pids), the device-wide reading stands
in and ``source`` says ``device`` so callers and ``/v2/memory`` can tell.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

from . import cuda

_NVML_LOCK = threading.Lock()
# This process's GPU bytes once its CUDA context and the provider's libraries were loaded
# (set by ``onnxruntime_cuda.prime``): what no model accounts for; None before.
baseline: "GpuReading | None" = None
_NVML: Any = None  # the pynvml module once nvmlInit succeeded; False once it failed


@dataclass(frozen=True)
class GpuReading:
    """GPU bytes in use. ``source``: ``nvml-process`` (this pid's ``usedGpuMemory``, the true
    per-process figure), ``device`` (device-wide total - free: includes other processes) or
    ``none`` (no CUDA device; ``bytes`` is 0)."""

    bytes: int
    source: str


def _nvml() -> Any:
    """pynvml after ``nvmlInit`` (once per process), or None where it is missing or fails."""
    global _NVML
    with _NVML_LOCK:
        if _NVML is None:
            try:
                import pynvml  # nvidia-ml-py

                pynvml.nvmlInit()
                _NVML = pynvml
            except Exception:  # not installed, no driver, or the sandbox refuses it
                _NVML = False
        return _NVML or None


def nvml_process_bytes(pid: int | None = None) -> int | None:
    """``usedGpuMemory`` of ``pid`` (default: this process) summed over every GPU NVML sees,
    in bytes; None where NVML is unavailable, does not list the pid, or hides the figure.

    NVML indexes physical GPUs (``CUDA_VISIBLE_DEVICES`` does not apply), so summing over all of
    them is right whichever GPU Ray gave this replica.
    """
    nvml = _nvml()
    if nvml is None:
        return None
    pid = os.getpid() if pid is None else pid
    total, seen = 0, False
    try:
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == pid:
                    seen = True
                    used = proc.usedGpuMemory
                    if used is None:  # NVML_VALUE_NOT_AVAILABLE (e.g. some containers)
                        return None
                    total += int(used)
    except Exception:
        return None
    return total if seen else None


def nvml_processes() -> list[dict[str, int]]:
    """Every compute process NVML lists: ``{"gpu": index, "pid": pid, "used_bytes": n}``
    (``used_bytes`` -1 where hidden); empty where NVML is unavailable. For proofs and logs."""
    nvml = _nvml()
    if nvml is None:
        return []
    out = []
    try:
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                used = -1 if proc.usedGpuMemory is None else int(proc.usedGpuMemory)
                out.append({"gpu": index, "pid": int(proc.pid), "used_bytes": used})
    except Exception:
        return out
    return out


def process_gpu_bytes() -> GpuReading:
    """GPU bytes this process holds: NVML's per-process figure where it is available, else the
    device-wide total - free of the current device (``source`` says which; module docstring)."""
    used = nvml_process_bytes()
    if used is not None:
        return GpuReading(used, "nvml-process")
    if cuda.device_count() == 0:
        return GpuReading(0, "none")
    free, total = cuda.mem_get_info()
    return GpuReading(total - free, "device")
