"""A Triton model configuration (``<model>/config.pbtxt``, protobuf text format) read as this
server's config: what a Triton user's model repository says, with Triton's meaning.

Parsed with protobuf's ``text_format`` into Triton's own ``ModelConfig`` message
(``tritonclient.grpc.model_config_pb2``, generated from Triton's ``model_config.proto``), then
mapped field by field to a ``ModelConfigFile`` (what a ``config.yaml`` would say); what the file
leaves out is completed from the model file exactly as for a ``config.yaml``
(``completion.complete_config``). docs/models.md, "A Triton model repository", lists what is
read, what is refused and what is ignored:

- read: ``name``, ``platform`` / ``backend`` (ONNX and TensorRT), ``max_batch_size``, ``input`` /
  ``output`` (``data_type``, ``dims`` without the batch axis, ``reshape``), ``dynamic_batching``
  (``preferred_batch_size``, ``max_queue_delay_microseconds``; the model is then a dedicated
  one, where this server batches; otherwise it joins the pool), ``instance_group`` (``count``,
  ``kind``), ``version_policy``, ``default_model_filename`` (``model.onnx`` only),
  ``parameters``, ``model_warmup`` (zero or random data);
- refused (``REFUSED``, a ``ConfigError``): what would change the answers or cannot run here;
- ignored with a note (``IGNORED``; logged at the start and printed by ``make check``): what
  changes speed or bookkeeping, never an answer.

``max_batch_size``: protobuf's text format cannot tell ``max_batch_size: 0`` from a file
without the field, and Triton's auto-complete reads both alike: when the file lists neither
``input`` nor ``output``, 0 is completed from the model file (axis 0 shared by every tensor:
``completion.DEFAULT_MAX_BATCH_SIZE``, Triton's ``default-max-batch-size``); when it lists
either, the value stands as written (0: no batch axis).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .config import ModelConfigFile, validated_config_file
from .datatypes import TRITON_TYPES
from .errors import ConfigError
from .store import MODEL_FILENAME

# platform / backend -> the model file it serves (both kinds run from <version>/model.onnx here;
# TensorRT plans are built from it: tools.build).
PLATFORMS = {"onnxruntime_onnx": "onnx", "tensorrt_plan": "plan"}
BACKENDS = {"onnxruntime": "onnx", "tensorrt": "plan"}
_SUPPORTED = "platform onnxruntime_onnx or tensorrt_plan, backend onnxruntime or tensorrt"

_DATATYPE_BY_TRITON_TYPE = {triton: datatype for datatype, triton in TRITON_TYPES.items()}

# Fields this server cannot honour without changing the answers (or at all): a config error.
REFUSED = {
    "runtime": "a backend's runtime library or script is not run here (ONNX and TensorRT models only)",
    "batch_input": "ragged batching (batch_input) is not supported: requests are joined on axis 0 only",
    "batch_output": "ragged batching (batch_output) is not supported: requests are joined on axis 0 only",
    "sequence_batching": "stateful sequence models are not supported: models here are stateless",
    "ensemble_scheduling": "ensembles are not supported: a pipeline model composes models here "
                           "(docs/models.md)",
    "model_operations": "custom operation libraries (op_library_filename) are not loaded",
    "model_repository_agents": "repository agents (checksum, decryption) are not run",
}
# Fields that change speed or bookkeeping, never an answer: ignored, with a note.
IGNORED = {
    "optimization": "speed settings (graph level, CUDA graphs, execution accelerators); the backend "
                    "runs with its own",
    "cc_model_filenames": "TensorRT plans are named by TensorRT version and compute capability here "
                          "(docs/gpu.md)",
    "metric_tags": "metrics carry this server's labels (docs/observability.md)",
    "response_cache": "no response cache: every request runs the model",
    "model_metrics": "metrics are this server's (docs/observability.md)",
}
_INSTANCE_GROUP_READ = ("name", "kind", "count")
_DYNAMIC_BATCHING_READ = ("preferred_batch_size", "max_queue_delay_microseconds")


def read_pbtxt(path: Path) -> tuple[ModelConfigFile, tuple[str, ...]]:
    """The ``config.pbtxt`` at ``path`` as this server's config (``ModelConfigFile``: what it
    leaves out is completed later), with a note per field it sets that is ignored here.

    Raises:
        ConfigError: unreadable text, a field Triton's schema does not have, or one this server
            refuses or cannot read as given; one line naming ``path`` and the field.
    """
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror or e})") from None
    message = model_config_pb2.ModelConfig()
    try:
        text_format.Parse(text, message)
    except text_format.ParseError as e:
        where = f"{path}:{e.GetLine()}:{e.GetColumn()}" if e.GetLine() else str(path)
        reason = str(e).split(" : ", 1)[-1]
        raise ConfigError(f"{where}: cannot read Triton's model configuration: {reason}") from None
    raw, notes = _mapped(message, path)
    raw.setdefault("name", path.parent.name)
    return validated_config_file(raw, path), tuple(notes)


def _mapped(config: Any, path: Path) -> tuple[dict[str, Any], list[str]]:
    """Triton's ``ModelConfig`` message as ``config.yaml`` fields, and the notes on what it ignored.

    Raises:
        ConfigError: a refused field or value.
    """
    notes: list[str] = []
    for field, _ in config.ListFields():
        if field.name in REFUSED:
            raise ConfigError(f"{path}: {field.name}: {REFUSED[field.name]}; remove it to serve the model here")
        if field.name in IGNORED:
            notes.append(f"{path}: {field.name}: ignored: {IGNORED[field.name]}")
    if config.model_transaction_policy.decoupled:
        raise ConfigError(f"{path}: model_transaction_policy.decoupled: true: decoupled models (zero or many "
                          "responses per request) are not supported: each request gets one response here")
    if config.default_model_filename not in ("", MODEL_FILENAME):
        raise ConfigError(f"{path}: default_model_filename: '{config.default_model_filename}': this server reads "
                          f"<version>/{MODEL_FILENAME} (and builds TensorRT plans from it); name the file "
                          f"{MODEL_FILENAME} and drop the field")
    raw: dict[str, Any] = {}
    if config.name:
        raw["name"] = config.name
    kind = _model_kind(config, path)
    instances, backend = _instances(config, kind, path, notes)
    raw["instances"] = instances
    raw["backend"] = backend
    listed = bool(config.input or config.output)
    if config.max_batch_size or listed:
        raw["max_batch_size"] = config.max_batch_size
    batched = config.max_batch_size > 0
    if config.input:
        raw["inputs"] = [_tensor(t, f"input[{i}]", batched, path, notes) for i, t in enumerate(config.input)]
    if config.output:
        raw["outputs"] = [_tensor(t, f"output[{i}]", batched, path, notes) for i, t in enumerate(config.output)]
    if config.HasField("dynamic_batching"):
        raw["dynamic_batching"] = _dynamic_batching(config.dynamic_batching, path, notes)
        raw["deployment"] = {"mode": "dedicated"}  # where dynamic batching runs here (deployments.model)
    if config.HasField("version_policy"):
        raw["version_policy"] = _version_policy(config.version_policy)
    if config.parameters:
        raw["parameters"] = {key: value.string_value for key, value in config.parameters.items()}
        notes.append(f"{path}: parameters: {sorted(config.parameters)} are shown in the model's configuration and "
                     "not acted on (backend settings of Triton's)")
    if config.model_warmup:
        warmup = _warmup(config.model_warmup, path, notes)
        if warmup is not None:
            raw["warmup"] = warmup
    return raw, notes


def _model_kind(config: Any, path: Path) -> str | None:
    """``onnx`` or ``plan`` from ``platform`` and ``backend`` (None when neither is given: the
    model file tells).

    Raises:
        ConfigError: one this server does not serve, or two that disagree.
    """
    kinds = []
    for field, table in (("platform", PLATFORMS), ("backend", BACKENDS)):
        value = getattr(config, field)
        if not value:
            continue
        if value not in table:
            raise ConfigError(f"{path}: {field}: '{value}' is not served here; supported: {_SUPPORTED} "
                              f"(the model in <version>/{MODEL_FILENAME})")
        kinds.append((field, value, table[value]))
    if len({k for _, _, k in kinds}) > 1:
        raise ConfigError(f"{path}: platform: '{config.platform}' and backend: '{config.backend}' name different "
                          "model kinds; give one, or two that agree (onnxruntime_onnx / onnxruntime, tensorrt_plan / "
                          "tensorrt)")
    return kinds[0][2] if kinds else None


def _instances(config: Any, kind: str | None, path: Path, notes: list[str]) -> tuple[int, str]:
    """``(instances, backend)`` from ``instance_group``: the counts summed (Triton's default
    count is 1); ``kind`` KIND_CPU runs ONNX Runtime on the CPU, KIND_GPU ONNX Runtime's CUDA
    provider (a plan: TensorRT), KIND_AUTO or none ``auto`` (a plan: ``tensorrt``).

    Raises:
        ConfigError: groups of different kinds, KIND_MODEL, or a plan on KIND_CPU.
    """
    from tritonclient.grpc import model_config_pb2

    kind_name = model_config_pb2.ModelInstanceGroup.Kind.Name
    groups = list(config.instance_group)
    kinds = sorted({kind_name(g.kind) for g in groups}) or ["KIND_AUTO"]
    if len(kinds) > 1:
        raise ConfigError(f"{path}: instance_group: kinds {kinds} differ: a model's instances run on one backend "
                          "here; give one kind")
    (instance_kind,) = kinds
    for index, group in enumerate(groups):
        ignored = [f.name for f, _ in group.ListFields() if f.name not in _INSTANCE_GROUP_READ]
        if ignored:
            notes.append(f"{path}: instance_group[{index}]: {', '.join(ignored)}: ignored: Ray Serve places the "
                         "replicas and their GPUs (deployment in docs/configuration.md)")
    count = sum(g.count or 1 for g in groups) or 1
    if instance_kind == "KIND_MODEL":
        raise ConfigError(f"{path}: instance_group.kind: KIND_MODEL is for models that place themselves; "
                          "give KIND_CPU, KIND_GPU or KIND_AUTO")
    if kind == "plan":
        if instance_kind == "KIND_CPU":
            raise ConfigError(f"{path}: instance_group.kind: KIND_CPU, but a TensorRT plan runs on a GPU; give "
                              "KIND_GPU, or platform onnxruntime_onnx to run model.onnx on the CPU")
        return count, "tensorrt"
    return count, {"KIND_CPU": "onnxruntime", "KIND_GPU": "onnxruntime_cuda"}.get(instance_kind, "auto")


def _tensor(tensor: Any, field: str, batched: bool, path: Path, notes: list[str]) -> dict[str, Any]:
    """One ``input`` / ``output`` as a ``TensorSpec``'s fields: ``dims`` (and ``reshape``) with
    the batch axis (-1) put first when ``batched``, as a ``config.yaml`` has them.

    Raises:
        ConfigError: no or an unsupported ``data_type``, or a refused flag.
    """
    from tritonclient.grpc import model_config_pb2

    type_name = model_config_pb2.DataType.Name(tensor.data_type)
    datatype = _DATATYPE_BY_TRITON_TYPE.get(type_name)
    if datatype is None:
        given = "missing" if type_name == "TYPE_INVALID" else type_name
        raise ConfigError(f"{path}: {field}.data_type: {given}; supported: {', '.join(TRITON_TYPES.values())}")
    for flag, why in (("is_shape_tensor", "TensorRT shape tensors are not supported"),
                      ("allow_ragged_batch", "ragged batching is not supported: requests are joined on axis 0 only"),
                      ("is_non_linear_format_io", "TensorRT non-linear I/O formats are not supported")):
        if getattr(tensor, flag, False):
            raise ConfigError(f"{path}: {field}.{flag}: true: {why}")
    if getattr(tensor, "optional", False):
        notes.append(f"{path}: {field}.optional: ignored: every input is required here; requests must send "
                     f"'{tensor.name}'")
    if getattr(tensor, "label_filename", ""):
        notes.append(f"{path}: {field}.label_filename: ignored: classification answers carry 'value:index' "
                     "without labels here")
    batch = (-1,) if batched else ()
    spec: dict[str, Any] = {"name": tensor.name, "datatype": datatype, "dims": [*batch, *tensor.dims]}
    if tensor.HasField("reshape"):
        spec["reshape"] = [*batch, *tensor.reshape.shape]
    return spec


def _dynamic_batching(batching: Any, path: Path, notes: list[str]) -> dict[str, Any]:
    """``dynamic_batching`` as this server's: preferred sizes, the queue delay in ms (Triton's
    default delay is 0)."""
    ignored = [f.name for f, _ in batching.ListFields() if f.name not in _DYNAMIC_BATCHING_READ]
    if ignored:
        notes.append(f"{path}: dynamic_batching: {', '.join(ignored)}: ignored: requests are served in arrival "
                     "order with the server's own queue limits (docs/reliability.md)")
    return {"preferred_batch_size": list(batching.preferred_batch_size),
            "max_queue_delay_ms": batching.max_queue_delay_microseconds / 1000}


def _version_policy(policy: Any) -> dict[str, Any]:
    """``version_policy`` (one of latest, all, specific) as this server's (the same three)."""
    choice = policy.WhichOneof("policy_choice")
    if choice == "all":
        return {"all": {}}
    if choice == "specific":
        return {"specific": {"versions": list(policy.specific.versions)}}
    return {"latest": {"num_versions": policy.latest.num_versions}}


def _warmup(samples: Any, path: Path, notes: list[str]) -> dict[str, Any] | None:
    """``model_warmup`` as this server's ``warmup`` (one run per sample's batch size) when every
    input of every sample is zeros, or every one random; otherwise None, with a note."""
    kinds = {tensor.WhichOneof("input_data_type") for sample in samples for tensor in sample.inputs.values()}
    data = {"zero_data": "zeros", "random_data": "random"}.get(kinds.pop()) if len(kinds) == 1 else None
    if data is None:
        notes.append(f"{path}: model_warmup: ignored: only samples all of zero_data or all of random_data are run "
                     "here (warmup in docs/models.md); the model is not warmed")
        return None
    return {"batch_sizes": [max(1, sample.batch_size) for sample in samples], "data": data}
