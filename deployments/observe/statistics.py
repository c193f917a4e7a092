"""Triton's statistics extension (``GET /v2/models[/{m}[/versions/{v}]]/stats``) from the series.

The JSON shape is Triton's ``$stats_model_response`` (docs/protocol/extension_statistics.md):
``{"model_stats": [{name, version, last_inference (ms since the epoch), inference_count,
execution_count, inference_stats: {success, fail, queue, compute_input, compute_infer,
compute_output, cache_hit, cache_miss: {count, ns}}, response_stats: {}, batch_stats:
[{batch_size, compute_input, compute_infer, compute_output}], memory_usage: []}]}``.

Figures come from the same series as ``/metrics`` (``deployments.observe.metrics``), so both
always agree: ``success`` is ``nv_inference_request_success`` with
``nv_inference_request_duration_us`` x 1000 ns; ``fail`` sums the failure reasons; ``queue``
and the three ``compute_*`` count successful requests with their duration counters; per batch
size, executions and run time (input and output are measured per request at the router, so
their per-batch ``ns`` is 0). No response cache: ``cache_hit`` / ``cache_miss`` are zero.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

from .metrics import PREFIX

_DURATIONS = {  # stats key -> sample name of its microsecond counter
    "queue": "nv_inference_queue_duration_us",
    "compute_input": "nv_inference_compute_input_duration_us",
    "compute_infer": "nv_inference_compute_infer_duration_us",
    "compute_output": "nv_inference_compute_output_duration_us",
}


def _stat(count: float, us: float = 0.0) -> dict[str, int]:
    return {"count": int(count), "ns": int(round(us * 1e3))}


def sums(families: Iterable[Any]) -> dict[tuple[str, str, str], float]:
    """``(sample name, model, version) -> value`` summed over the other labels (reason,
    batch size, replica, node); batch series keep ``"name|batch_size"`` as sample name."""
    out: dict[tuple[str, str, str], float] = defaultdict(float)
    for family in families:
        for s in family.samples:
            model, version = s.labels.get("model"), s.labels.get("version")
            if model is None or version is None:
                continue
            name = s.name if "batch_size" not in s.labels else f"{s.name}|{s.labels['batch_size']}"
            out[(name, model, version)] += s.value
    return out


def model_stats(totals: dict[tuple[str, str, str], float], name: str, version: str) -> dict[str, Any]:
    """One ``$model_stat`` object for ``name`` / ``version`` from ``sums(...)``."""
    def get(sample: str) -> float:
        return totals.get((sample, name, version), 0.0)

    success = get("nv_inference_request_success")
    stats = {
        "success": _stat(success, get("nv_inference_request_duration_us")),
        "fail": _stat(get("nv_inference_request_failure"), get(PREFIX + "request_failure_duration_us_total")),
        **{key: _stat(success, get(sample)) for key, sample in _DURATIONS.items()},
        "cache_hit": _stat(0), "cache_miss": _stat(0),
    }
    batches = []
    prefix = PREFIX + "batch_exec_count_total|"
    for (sample, model, ver), count in totals.items():
        if model == name and ver == version and sample.startswith(prefix):
            size = sample[len(prefix):]
            run_us = totals.get((f"{PREFIX}batch_compute_infer_duration_us_total|{size}", name, version), 0.0)
            batches.append({"batch_size": int(size), "compute_input": _stat(count),
                            "compute_infer": _stat(count, run_us), "compute_output": _stat(count)})
    return {
        "name": name, "version": version,
        "last_inference": int(get(PREFIX + "last_inference_ms")),
        "inference_count": int(get("nv_inference_count")),
        "execution_count": int(get("nv_inference_exec_count")),
        "inference_stats": stats, "response_stats": {},
        "batch_stats": sorted(batches, key=lambda b: b["batch_size"]), "memory_usage": [],
    }


def statistics(families: Iterable[Any], models: Iterable[tuple[str, str]]) -> dict[str, Any]:
    """``{"model_stats": [...]}`` for each ``(name, version)`` in ``models``, in that order."""
    totals = sums(families)
    return {"model_stats": [model_stats(totals, n, v) for n, v in models]}
