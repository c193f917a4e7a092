"""Triton's model configuration extension: ``GET /v2/models/{name}[/versions/{v}]/config``.

Source: Triton's ``model_config.proto`` (``ModelConfig``, ``ModelInput``, ``ModelOutput``,
``ModelDynamicBatching``, ``ModelInstanceGroup``) in its JSON form, which is what
``tritonclient.http.InferenceServerClient.get_model_config`` returns; the fields are those a
Triton ``config.pbtxt`` would hold for the same model, taken from its ``config.yaml``.
"""

from __future__ import annotations

from typing import Any

from ..runtime.contract.config import ModelConfig
from ..runtime.contract.datatypes import TRITON_TYPES

# KServe / Triton platform names by backend (what metadata's ``platform`` reports).
# ONNX Runtime on CPU and on CUDA share Triton's platform name; metadata's ``backend`` tells them apart.
PLATFORMS = {"onnxruntime": "onnxruntime_onnx", "onnxruntime_cuda": "onnxruntime_onnx",
             "tensorrt": "tensorrt_plan", "pipeline": "ensemble"}
# Where a backend's execution contexts live.
INSTANCE_KINDS = {"tensorrt": "KIND_GPU", "onnxruntime_cuda": "KIND_GPU", "onnxruntime": "KIND_CPU"}


def platform_of(backend: str) -> str:
    """Triton platform name of a backend (``onnxruntime`` -> ``onnxruntime_onnx``, ...)."""
    return PLATFORMS.get(backend, backend)


def model_configuration(config: ModelConfig, backend: str) -> dict[str, Any]:
    """The Triton model configuration (JSON form) of a model served with ``backend``.

    ``backend`` is ``onnxruntime``, ``tensorrt`` or ``pipeline`` (a composed model: Triton's
    ``ensemble`` platform, no backend and no instance group). As in Triton, ``dims`` leave out
    the batch axis when ``max_batch_size > 0`` (the config's ``dims`` include it), and so does a
    tensor's ``reshape`` (``{"shape": [...]}``); -1 is a dynamic axis. ``dynamic_batching``
    appears only when the model batches, with the queue delay in microseconds
    (``max_queue_delay_microseconds``, Triton's unit).
    """
    skip = 1 if config.max_batch_size else 0

    def tensors(specs) -> list[dict[str, Any]]:
        return [{"name": t.name, "data_type": TRITON_TYPES[t.datatype], "dims": list(t.dims[skip:]),
                 **({} if t.reshape is None else {"reshape": {"shape": list(t.reshape[skip:])}})} for t in specs]

    out: dict[str, Any] = {
        "name": config.name,
        "platform": platform_of(backend),
        "backend": "" if backend == "pipeline" else backend,
        "version_policy": config.version_policy.model_dump(exclude_none=True) or {"latest": {"num_versions": 1}},
        "max_batch_size": config.max_batch_size,
        "input": tensors(config.inputs),
        "output": tensors(config.outputs),
    }
    if backend != "pipeline":
        out["instance_group"] = [{"name": config.name, "kind": INSTANCE_KINDS.get(backend, "KIND_AUTO"),
                                  "count": config.instances}]
    batching = config.dynamic_batching
    if batching is not None and batching.enabled:
        out["dynamic_batching"] = {"preferred_batch_size": list(batching.preferred_batch_size),
                                   "max_queue_delay_microseconds": round(batching.max_queue_delay_ms * 1000)}
    if config.parameters:
        # Triton's parameters map string -> {"string_value": ...}.
        out["parameters"] = {k: {"string_value": str(v)} for k, v in config.parameters.items()}
    return out
