"""Triton's GPU gauges from NVML (``nvidia-ml-py``, module ``pynvml``), read at scrape time.

``nv_gpu_utilization`` (0.0-1.0), ``nv_gpu_memory_total_bytes``, ``nv_gpu_memory_used_bytes``,
label ``gpu_uuid`` as Triton's (docs/user_guide/metrics.md, "GPU Metrics"). Without
``nvidia-ml-py`` or without a GPU (NVML fails to initialise) there are no GPU series.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Iterable

logger = logging.getLogger("ray.serve")

GPU_SERIES = ("nv_gpu_utilization", "nv_gpu_memory_total_bytes", "nv_gpu_memory_used_bytes")
_state: dict[str, Any] = {}
_lock = threading.Lock()


def _nvml() -> Any:
    """The initialised ``pynvml`` module, or None (not installed, no driver, no GPU)."""
    with _lock:
        if "module" not in _state:
            try:
                import pynvml  # type: ignore[import-not-found]  # optional: nvidia-ml-py

                pynvml.nvmlInit()
                _state["module"] = pynvml if pynvml.nvmlDeviceGetCount() > 0 else None
            except Exception as e:  # ImportError, NVMLError (no driver): no GPU series
                logger.debug("no GPU metrics: %s", e)
                _state["module"] = None
        return _state["module"]


def gpu_families() -> Iterable[Any]:
    """The three GPU gauge families (one sample per GPU of this node); nothing without NVML."""
    nvml = _nvml()
    if nvml is None:
        return []
    from prometheus_client.core import GaugeMetricFamily

    util = GaugeMetricFamily("nv_gpu_utilization", "GPU utilization rate [0.0 - 1.0)", labels=["gpu_uuid"])
    total = GaugeMetricFamily("nv_gpu_memory_total_bytes", "GPU total memory, in bytes", labels=["gpu_uuid"])
    used = GaugeMetricFamily("nv_gpu_memory_used_bytes", "GPU used memory, in bytes", labels=["gpu_uuid"])
    for index in range(nvml.nvmlDeviceGetCount()):
        device = nvml.nvmlDeviceGetHandleByIndex(index)
        uuid = nvml.nvmlDeviceGetUUID(device)
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        memory = nvml.nvmlDeviceGetMemoryInfo(device)
        util.add_metric([uuid], nvml.nvmlDeviceGetUtilizationRates(device).gpu / 100.0)
        total.add_metric([uuid], float(memory.total))
        used.add_metric([uuid], float(memory.used))
    return [util, total, used]
