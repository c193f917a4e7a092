"""Model configuration: ``engines/<model>/config.yaml`` parsed once into frozen pydantic models.

Layout of one model folder (Triton-like)::

    engines/<model>/config.yaml
    engines/<model>/<version>/model.onnx      # integer version folders

``config.yaml`` may leave out ``inputs``, ``outputs`` and ``max_batch_size`` (or be absent):
``ModelConfigFile`` is what the file says, ``ModelConfig`` the completed contract
(``completion.complete_config`` fills the rest from the model file and checks the file agrees).
A bad config fails at start with ``ConfigError`` naming the file and the field.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal, Optional, Union, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .datatypes import Datatype
from .errors import ConfigError
from .units import mib_to_bytes

# ``onnxruntime``: ONNX Runtime on CPU; ``onnxruntime_cuda``: ONNX Runtime's CUDA execution
# provider (the onnxruntime-gpu build); ``tensorrt``: TensorRT plans; ``auto``: the first of
# tensorrt -> onnxruntime_cuda -> onnxruntime that can run here (``backends.select``).
Backend = Literal["auto", "onnxruntime", "onnxruntime_cuda", "tensorrt"]
LoadPolicy = Literal["eager", "lazy", "lru"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Profile(_Frozen):
    """TensorRT optimization profile of one input: the min/opt/max shapes, batch axis included."""

    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]

    @model_validator(mode="after")
    def _ordered(self) -> "Profile":
        if not (len(self.min) == len(self.opt) == len(self.max)):
            raise ValueError("min, opt and max must have the same rank")
        for axis, (lo, mid, hi) in enumerate(zip(self.min, self.opt, self.max)):
            if not 1 <= lo <= mid <= hi:
                raise ValueError(f"axis {axis}: need 1 <= min <= opt <= max, got {lo}/{mid}/{hi}")
        return self


class TensorSpec(_Frozen):
    """One input or output tensor: name, KServe datatype and dims (-1 = dynamic; batch axis first).

    ``multiple_of`` (inputs, optional): per axis, the size must be a multiple of this (1 = any),
    e.g. ``[1, 1, 32, 32]`` for a detector whose strides need H and W divisible by 32.

    ``reshape`` (optional; Triton's ``reshape``): the shape the model file has for this tensor
    when it differs from the shape clients send and receive (``dims``), in the same terms as
    ``dims`` (the batch axis first, as -1, when ``max_batch_size > 0``), e.g. dims ``[3, 224,
    224]`` with reshape ``[1, 3, 224, 224]``. An input is reshaped to it before the run, an
    output from it to ``dims`` after (``contract.reshape``); ``dims``, the profile and the
    request checks stay the client's shape, the model file is checked against ``reshape``.
    """

    name: str
    datatype: Datatype
    dims: tuple[int, ...]
    profile: Optional[Profile] = None
    multiple_of: Optional[tuple[int, ...]] = None
    reshape: Optional[tuple[int, ...]] = None

    @model_validator(mode="after")
    def _dims(self) -> "TensorSpec":
        if any(d == 0 or d < -1 for d in self.dims):
            raise ValueError(f"dims must be positive or -1 (dynamic), got {list(self.dims)}")
        if self.reshape is not None and any(d == 0 or d < -1 for d in self.reshape):
            raise ValueError(f"reshape must be positive or -1 (dynamic), got {list(self.reshape)}")
        if self.multiple_of is not None and (
                len(self.multiple_of) != len(self.dims) or any(m < 1 for m in self.multiple_of)):
            raise ValueError(f"multiple_of needs one positive integer per axis of dims {list(self.dims)}")
        if self.profile is not None:
            if len(self.profile.max) != len(self.dims):
                raise ValueError(f"profile rank {len(self.profile.max)} != dims rank {len(self.dims)}")
            for axis, d in enumerate(self.dims):
                if d != -1 and not (self.profile.min[axis] == self.profile.max[axis] == d):
                    raise ValueError(f"profile axis {axis} must equal the fixed dim {d}")
        return self

    def bounds(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Allowed (min, max) shape; fixed dims from ``dims``, dynamic ones from the profile."""
        if self.profile is not None:
            return self.profile.min, self.profile.max
        return tuple(1 if d == -1 else d for d in self.dims), tuple(
            2**31 - 1 if d == -1 else d for d in self.dims)


class TensorRTOptions(_Frozen):
    """How ``python -m deployments.runtime.tools.build`` builds this model's TensorRT plan
    (the optional ``tensorrt:`` section of ``config.yaml``).

    ``precision``: ``fp16``/``bf16`` set the builder flag where the flavour has one (TensorRT
    10); strongly typed flavours (TensorRT-RTX, later TensorRT) keep the ONNX file's types and
    the manifest says so. ``workspace_mib``: the builder's workspace pool limit, in MiB.
    ``profiles``: optimization profiles beyond the one the inputs' ``profile`` fields define
    (profile 0, which bounds every request); each maps every dynamic input to min/opt/max
    inside profile 0's range, e.g. a small-batch profile tuned for latency.
    """

    precision: Literal["fp32", "fp16", "bf16"] = "fp16"
    workspace_mib: int = Field(1024, ge=1)
    profiles: tuple[dict[str, Profile], ...] = ()


class OnnxRuntimeCudaOptions(_Frozen):
    """ONNX Runtime's CUDA execution provider for this model (the optional ``onnxruntime_cuda:``
    section; used when the model runs on ``backend: onnxruntime_cuda``, also when ``auto`` picks it).

    ``use_tf32``: TF32 tensor cores for FP32 convolutions/matmuls (ONNX Runtime's default; outputs
    differ from the CPU provider within ``backends.onnxruntime_cuda.TOLERANCE``); false keeps full
    FP32. ``gpu_mem_limit_mib``: cap of each execution context's CUDA arena (MiB); the max
    profile's run must fit in it. ``cudnn_conv_algo_search``: ``HEURISTIC`` (default: no
    per-shape benchmarking), ``EXHAUSTIVE`` (benchmarks each new input shape, allocating
    workspaces while it does) or ``DEFAULT``. Whichever, onnxruntime-gpu 1.20+ rebuilds every
    convolution's cuDNN plan when a context's input shape differs from its previous run's
    (resnet18 ~35 ms, ocr_cls ~87 ms on the H200): ``DynamicBatching.pad_to_preferred``.
    ``cudnn_conv_use_max_workspace``: let cuDNN take workspaces as large as the arena allows
    (ONNX Runtime's default: faster convolutions; in FP32 ocr_rec asked for 2.1 GB at batch 6);
    false caps them (ONNX Runtime's 32 MB limit). ``device_id``: the CUDA device among the
    visible ones (Ray makes the replica's GPU device 0). ``cuda_graphs`` (default on): each execution
    context captures its kernels as CUDA graphs when it is made, one per batch size (ONNX Runtime's
    ``enable_cuda_graph``; ``backends.onnxruntime_cuda.graph_batches``), and replays them: a run
    costs the host one launch instead of one per operator, and a context switching batch sizes
    rebuilds no cuDNN plan. The graphs' memory is part of the measured footprint; nothing is
    captured after the load. A model ONNX Runtime cannot capture (a node on the CPU, control flow,
    an input with a dynamic axis besides the batch axis, an output whose shape only the run tells)
    runs without, and ``TRT_SERVE_CUDA_GRAPHS=0`` turns them off for every model.
    """

    use_tf32: bool = True
    gpu_mem_limit_mib: float = Field(4096.0, gt=0)
    cudnn_conv_algo_search: Literal["HEURISTIC", "EXHAUSTIVE", "DEFAULT"] = "HEURISTIC"
    cudnn_conv_use_max_workspace: bool = True
    device_id: int = Field(0, ge=0)
    cuda_graphs: bool = True


class Autoscaling(_Frozen):
    """Ray Serve ``autoscaling_config`` fields this project passes through."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    initial_replicas: Optional[int] = Field(None, ge=0)
    target_ongoing_requests: float = Field(2.0, gt=0)
    upscale_delay_s: float = Field(30.0, ge=0)
    downscale_delay_s: float = Field(600.0, ge=0)
    metrics_interval_s: Optional[float] = Field(None, gt=0)
    look_back_period_s: Optional[float] = Field(None, gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> "Autoscaling":
        initial = self.min_replicas if self.initial_replicas is None else self.initial_replicas
        if not self.min_replicas <= initial <= self.max_replicas:
            raise ValueError(
                f"need min_replicas <= initial_replicas <= max_replicas, got "
                f"{self.min_replicas} <= {self.initial_replicas} <= {self.max_replicas}")
        return self


class DynamicBatching(_Frozen):
    """Server-side batching of concurrent requests (the optional ``dynamic_batching:`` section).

    Requests are concatenated along axis 0 and run as one batch of at most
    ``max(preferred_batch_size)`` rows (``max_batch_size`` rows when no preferred size is
    given); each request keeps its own rows. A request runs at once when an execution context
    is free (a lone request runs alone); while every context is busy, requests gather into a
    batch, which closes when full or ``max_queue_delay_ms`` after its oldest request, and runs
    at the next free context (``deployments.batching``). Needs a batch axis
    (``max_batch_size > 0``); every preferred size lies in ``[1, max_batch_size]``, so a batch
    never exceeds the profile max either. ``enabled: false`` keeps the section but turns
    batching off.

    ``pad_to_preferred``: run every batch at 1 or a preferred size, padding it with zero rows to
    the smallest of those that holds it (the padding's outputs are dropped), so an execution
    context sees only those shapes, and a lone one-row request runs unpadded. ``auto`` (default) pads where the backend makes
    a change of input shape costly: ``onnxruntime_cuda``, whose convolutions rebuild their cuDNN
    plans whenever a run's shape differs from the previous run's (resnet18 ~30 ms, the PaddleOCR
    models ~0.5 s a change on the H200: docs/performance.md, "Dynamic batching on the GPU") while a larger batch costs little
    (resnet18 batch 8: 1.3x batch 1). Not on CPU, where every padded row costs its full
    compute. ``true`` / ``false`` force it; padding needs ``preferred_batch_size`` (rows) or
    ``sequence_buckets`` (lengths).

    ``sequence_buckets`` (ascending lengths, e.g. ``[16, 32, 64, 128, 256]``; default none):
    for a model with a dynamic sequence axis (axis 1 after the batch axis), each request's
    inputs on that axis are zero-padded to the smallest bucket that holds them, so requests of
    different lengths join one batch and the model sees a few lengths; outputs on that axis are
    cut back to each request's length (``deployments.batching.SequenceAxis`` says which tensors
    carry the axis). Only for models whose attention mask makes the padded positions inert
    (BERT-like encoders), hence opt-in. Each bucket lies within every such input's axis-1 range.
    Applied as ``pad_to_preferred`` says: ``auto`` on a GPU backend only (on ONNX Runtime CPU a
    new length costs nothing, while padding a passage to its bucket costs its attention up to
    3x); ``true`` everywhere; ``false`` nowhere.
    """

    enabled: bool = True
    max_queue_delay_ms: float = Field(1.0, ge=0, le=10_000)
    preferred_batch_size: tuple[int, ...] = ()
    pad_to_preferred: Union[bool, Literal["auto"]] = "auto"
    sequence_buckets: tuple[int, ...] = ()

    @model_validator(mode="after")
    def _padding_needs_sizes(self) -> "DynamicBatching":
        if self.pad_to_preferred is True and not (self.preferred_batch_size or self.sequence_buckets):
            raise ValueError("dynamic_batching.pad_to_preferred needs preferred_batch_size (the sizes to pad to) "
                             "or sequence_buckets (the lengths to pad to)")
        buckets = list(self.sequence_buckets)
        if buckets != sorted(set(buckets)) or any(b < 1 for b in buckets):
            raise ValueError(f"dynamic_batching.sequence_buckets must be positive lengths in ascending order, got {buckets}")
        return self


class DeploymentOptions(_Frozen):
    """How the model is placed: its own deployment (``dedicated``) or the multiplexed ``pool``.

    The two bounded queues in front of a model (Ray Serve's own limits):
    ``max_ongoing_requests`` requests are handed to each replica, where they wait in the replica
    for a free execution context (or in the batcher); ``max_queued_requests`` more may wait in
    each caller's handle (the router) for a replica to take them. A request beyond both is shed
    at once with 503 and ``Retry-After`` (``-1``: no handle limit). The queue belongs in the
    replica, not the handle: requests waiting in a Ray 2.60 handle cost the caller's process
    routing retries (25 ms back-off doubling to 0.5 s, capped at 50 ms by the app) and, on the
    H200 machine, ocr_cls at 512 clients served 310 QPS with its queue in the handle against 688
    with it in the replica (docs/lab-notes.md, "Overload"); so the handle's share is small.
    """

    mode: Literal["dedicated", "pool"] = "pool"
    num_replicas: int = Field(1, ge=1)
    autoscaling: Optional[Autoscaling] = None
    num_gpus: float = Field(0.0, ge=0)
    num_cpus: float = Field(0.1, ge=0)
    max_ongoing_requests: int = Field(512, ge=1)
    max_queued_requests: int = Field(128, ge=-1)

    @model_validator(mode="after")
    def _queue_limit(self) -> "DeploymentOptions":
        if self.max_queued_requests == 0:
            raise ValueError("max_queued_requests must be -1 (no limit) or a positive integer")
        return self


class CacheOptions(_Frozen):
    """What one replica keeps resident (``residency.cache.ModelCache``); the pool's options in
    ``serve_config.yaml`` (``deployments.app.PoolOptions``) carry these fields.

    ``load_policy``: ``eager``, ``lazy`` or ``lru`` (docs/placement.md, "Memory"). ``memory_budget_mib``:
    the most MiB of model footprints (engine + contexts) resident at once; None for no byte
    limit. ``max_num_models_per_replica``: the most models resident at once (Ray's multiplexed
    count cap as well); None for no count limit. ``wait_timeout_s``: how long a load waits for
    held models to be released (``lru``) before ``OverBudget``.
    """

    load_policy: LoadPolicy = "lru"
    memory_budget_mib: Optional[float] = Field(None, gt=0)
    max_num_models_per_replica: Optional[int] = Field(3, ge=1)
    wait_timeout_s: float = Field(30.0, gt=0)

    @property
    def budget_bytes(self) -> int | None:
        """``memory_budget_mib`` in bytes (None: no byte limit)."""
        return None if self.memory_budget_mib is None else mib_to_bytes(self.memory_budget_mib)


class Warmup(_Frozen):
    """Requests run on every execution context after a load, before the model is reported
    ready (the optional ``warmup:`` section), so the first real request does not pay the
    backend's lazy start-up (arena growth, kernel choice; on TensorRT the first enqueue).

    ``batch_sizes``: one warmup run per size, in order (each within [1, ``max_batch_size``]; a
    model without a batch axis runs once per entry). Shapes: the batch size on axis 0, the
    other dynamic axes at the profile's ``opt`` (``min`` without a profile). ``data``:
    ``zeros``, ``random`` (uniform [0, 1), seed 0; BYTES: decimal digits) or ``file``: an
    ``.npz`` in the model's folder (``file``) holding one array per input, whose rows are
    repeated to each batch size.
    """

    batch_sizes: tuple[int, ...] = (1,)
    data: Literal["zeros", "random", "file"] = "zeros"
    file: Optional[str] = None

    @model_validator(mode="after")
    def _file(self) -> "Warmup":
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch_sizes must be positive integers, got {list(self.batch_sizes)}")
        if (self.data == "file") != (self.file is not None):
            raise ValueError("file: give it exactly when data is file (an .npz in the model's folder)")
        if self.file is not None and (Path(self.file).is_absolute() or ".." in Path(self.file).parts):
            raise ValueError(f"file: '{self.file}' must be a path inside the model's folder")
        return self


class DefaultProfile(_Frozen):
    """The profile an input gets when one of its axes is dynamic and the config gives it no
    ``profile`` (the optional ``default_profile:`` section): the batch axis (axis 0 when
    ``max_batch_size > 0``) gets ``[1, max_batch_size, max_batch_size]``, every other dynamic
    axis ``[1, min(opt, max), max]``. It bounds what a request may send on every backend (a
    larger size is refused with 400 naming the axis and range), sizes the memory a context
    holds, and is profile 0 of a TensorRT plan. An input's own ``profile`` replaces it.
    """

    opt: int = Field(128, ge=1)
    max: int = Field(1024, ge=1)

    def axis(self, batch_axis: bool, max_batch_size: int) -> tuple[int, int, int]:
        """(min, opt, max) of one dynamic axis; ``batch_axis``: axis 0 of a batched model."""
        if batch_axis:
            return 1, max_batch_size, max_batch_size
        return 1, min(self.opt, self.max), self.max


class LatestVersions(_Frozen):
    """``latest: {num_versions: N}``: the N highest version numbers."""

    num_versions: int = Field(1, ge=1)


class AllVersions(_Frozen):
    """``all: {}``: every version folder."""


class SpecificVersions(_Frozen):
    """``specific: {versions: [..]}``: these version numbers (each must have a folder)."""

    versions: tuple[int, ...] = Field(min_length=1)


class VersionPolicy(_Frozen):
    """Which of a model's version folders are served (the optional ``version_policy:`` section,
    as Triton's model configuration has it): exactly one of ``latest: {num_versions: N}``
    (default: ``latest: {num_versions: 1}``), ``all: {}`` or ``specific: {versions: [..]}``.
    The unversioned routes serve the newest served version.
    """

    latest: Optional[LatestVersions] = None
    all: Optional[AllVersions] = None
    specific: Optional[SpecificVersions] = None

    @model_validator(mode="after")
    def _one(self) -> "VersionPolicy":
        given = [k for k in ("latest", "all", "specific") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"give one of latest, all, specific; got {given}")
        return self

    def select(self, versions: tuple[int, ...]) -> tuple[int, ...]:
        """The served versions (ascending) among ``versions`` (the folders on disk, ascending).

        Raises:
            ValueError: ``specific`` names versions without a folder.
        """
        if self.all is not None:
            return versions
        if self.specific is not None:
            missing = sorted(set(self.specific.versions) - set(versions))
            if missing:
                raise ValueError(f"version_policy.specific.versions: {missing} have no version folder; "
                                 f"versions on disk: {list(versions)}")
            return tuple(sorted(set(self.specific.versions)))
        count = (self.latest or LatestVersions()).num_versions
        return versions[-count:]


class ModelConfigFile(_Frozen):
    """What a model's ``config.yaml`` says (every field of ``ModelConfig``): ``inputs``,
    ``outputs`` and ``max_batch_size`` may be left out (None), for ``completion.complete_config``
    to fill from the model file. A folder without ``config.yaml`` reads as ``name`` alone.
    """

    name: str
    backend: Backend = "auto"
    max_batch_size: Optional[int] = Field(None, ge=0)
    instances: int = Field(1, ge=1)
    inputs: Optional[tuple[TensorSpec, ...]] = None
    outputs: Optional[tuple[TensorSpec, ...]] = None
    deployment: DeploymentOptions = DeploymentOptions()
    pipeline: Optional[str] = None
    parameters: dict[str, Any] = Field(default_factory=dict)
    tensorrt: TensorRTOptions = TensorRTOptions()
    onnxruntime_cuda: OnnxRuntimeCudaOptions = OnnxRuntimeCudaOptions()
    dynamic_batching: Optional[DynamicBatching] = None
    warmup: Optional[Warmup] = None
    version_policy: VersionPolicy = VersionPolicy()
    default_profile: DefaultProfile = DefaultProfile()


class ModelConfig(ModelConfigFile):
    """A model's contract: its ``config.yaml`` completed from the model file (a pipeline's,
    which has none, as written).

    ``max_batch_size`` is the largest first-axis size accepted (0 = the model has no batch
    axis); it may not exceed any input profile's max on axis 0. ``instances`` is the number
    of execution contexts per replica. A ``pipeline`` model (e.g. ``ocr``) has no ONNX file:
    it names a pipeline in ``deployments.pipelines`` that composes other models.
    """

    max_batch_size: int = Field(0, ge=0)
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @model_validator(mode="after")
    def _contract(self) -> "ModelConfig":
        if not self.inputs or not self.outputs:
            raise ValueError("a model needs at least one input and one output")
        for group in (self.inputs, self.outputs):
            names = [t.name for t in group]
            if len(set(names)) != len(names):
                raise ValueError(f"duplicate tensor names in {names}")
        for kind, group in (("inputs", self.inputs), ("outputs", self.outputs)):
            for index, t in enumerate(group):
                if t.reshape is not None:
                    _check_reshape(f"{kind}.{index}", t, kind == "inputs", self.max_batch_size > 0)
        if self.max_batch_size:
            for t in self.inputs:
                lo, hi = t.bounds()
                if hi[0] < self.max_batch_size:
                    raise ValueError(
                        f"max_batch_size {self.max_batch_size} exceeds input '{t.name}' "
                        f"profile max batch {hi[0]}")
        for index, profile in enumerate(self.tensorrt.profiles, start=1):
            _check_extra_profile(self.inputs, index, profile)
        if self.warmup is not None:
            top = self.max_batch_size or 1
            too_big = [b for b in self.warmup.batch_sizes if b > top]
            if too_big:
                raise ValueError(f"warmup.batch_sizes {too_big} over max_batch_size {self.max_batch_size} "
                                 f"(at most {top})")
        batching = self.dynamic_batching
        if batching is not None and batching.enabled:
            if not self.max_batch_size:
                raise ValueError("dynamic_batching needs a batch axis: set max_batch_size > 0")
            too_big = [b for b in batching.preferred_batch_size if not 1 <= b <= self.max_batch_size]
            if too_big:
                raise ValueError(
                    f"dynamic_batching.preferred_batch_size {too_big} outside [1, max_batch_size "
                    f"{self.max_batch_size}]")
            if batching.sequence_buckets:
                _check_buckets(self.inputs, batching.sequence_buckets)
        return self

    def input(self, name: str) -> TensorSpec:
        return next(t for t in self.inputs if t.name == name)


def _check_reshape(field: str, spec: TensorSpec, is_input: bool, batched: bool) -> None:
    """A tensor's ``reshape`` against its ``dims``: a batched model keeps the batch axis first
    (-1) in both; the shape reshaped to (an input's ``reshape``, an output's ``dims``) has at
    most one dynamic axis after it, and where neither side has one, both hold as many elements."""
    dims, shape = spec.dims, spec.reshape or ()
    if batched:
        if not dims or not shape or dims[0] != -1 or shape[0] != -1:
            raise ValueError(f"{field}.reshape: {list(shape)} and dims {list(dims)} must both start with the batch "
                             "axis -1 (max_batch_size > 0)")
        dims, shape = dims[1:], shape[1:]
    target, side = (shape, "reshape") if is_input else (dims, "dims")
    if target.count(-1) > 1:
        raise ValueError(f"{field}.{side}: {list(target)} has more than one dynamic axis (-1) "
                         f"{'after the batch axis ' if batched else ''}where a reshape needs at most one")
    if -1 not in dims and -1 not in shape and math.prod(dims) != math.prod(shape):
        raise ValueError(f"{field}.reshape: {list(spec.reshape or ())} holds {math.prod(shape)} elements "
                         f"{'per batch item ' if batched else ''}and dims {list(spec.dims)} {math.prod(dims)}: "
                         "a reshape keeps the element count")


def _check_buckets(inputs: tuple[TensorSpec, ...], buckets: tuple[int, ...]) -> None:
    """``sequence_buckets`` need an input with a dynamic axis 1 and lie within each such
    input's axis-1 range."""
    dynamic = [t for t in inputs if len(t.dims) >= 2 and t.dims[1] == -1]
    if not dynamic:
        raise ValueError("dynamic_batching.sequence_buckets needs an input with a dynamic sequence axis (axis 1, "
                         f"after the batch axis); inputs: {[f'{t.name} {list(t.dims)}' for t in inputs]}")
    for spec in dynamic:
        lo, hi = spec.bounds()
        outside = [b for b in buckets if not lo[1] <= b <= hi[1]]
        if outside:
            raise ValueError(f"dynamic_batching.sequence_buckets {outside} outside input '{spec.name}' axis 1 "
                             f"range [{lo[1]}, {hi[1]}]")


def _check_extra_profile(inputs: tuple[TensorSpec, ...], index: int, profile: dict[str, Profile]) -> None:
    """An extra TensorRT profile names every dynamic input and lies inside profile 0's range."""
    where = f"tensorrt.profiles[{index - 1}] (TensorRT profile {index})"
    by_name = {t.name: t for t in inputs}
    unknown = sorted(set(profile) - set(by_name))
    if unknown:
        raise ValueError(f"{where}: {unknown} are not inputs; inputs: {sorted(by_name)}")
    for spec in inputs:
        shapes = profile.get(spec.name)
        if shapes is None:
            if -1 in spec.dims:
                raise ValueError(f"{where}: dynamic input '{spec.name}' needs min/opt/max")
            continue
        if len(shapes.max) != len(spec.dims):
            raise ValueError(f"{where}: input '{spec.name}' rank {len(shapes.max)} != dims rank {len(spec.dims)}")
        lo, hi = spec.bounds()
        for axis in range(len(spec.dims)):
            if not (lo[axis] <= shapes.min[axis] and shapes.max[axis] <= hi[axis]):
                raise ValueError(
                    f"{where}: input '{spec.name}' axis {axis} range [{shapes.min[axis]}, "
                    f"{shapes.max[axis]}] is outside profile 0's [{lo[axis]}, {hi[axis]}]")


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside a field's annotation (``Optional[X]``, ``tuple[X, ...]``...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _fields_at(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str] | None:
    """Field names of the model that holds the last element of ``loc`` (None if not a model)."""
    current: type[BaseModel] | None = model
    for step in loc[:-1]:
        if isinstance(step, int):
            continue  # an item of a sequence: the element model was found at the field
        if current is None or step not in current.model_fields:
            return None
        current = _model_in(current.model_fields[step].annotation)
    return None if current is None else list(current.model_fields)


def describe_validation_error(err: ValidationError, model: type[BaseModel] | None = None,
                              prefix: str = "") -> str:
    """One line for a pydantic error: ``field.path: what is wrong`` per error, joined by "; ".

    ``model`` (the validated class) lets an unknown field list the allowed ones (pydantic only
    says "Extra inputs are not permitted"); a wrong choice already names the choices in
    pydantic's message. ``prefix`` (e.g. ``parameters``) is put before each field path.
    """
    parts = []
    for e in err.errors():
        loc = ".".join([prefix] * bool(prefix) + [str(p) for p in e["loc"]]) or "(top level)"
        message = e["msg"]
        if e["type"] == "extra_forbidden" and model is not None:
            allowed = _fields_at(model, tuple(e["loc"]))
            message = "unknown field" + (f"; allowed: {', '.join(allowed)}" if allowed else "")
        parts.append(f"{loc}: {message}")
    return "; ".join(parts)


def read_config_file(path: Path) -> ModelConfigFile:
    """Parse and validate one ``config.yaml`` as written (``ModelConfigFile``); a missing file
    reads as ``name`` (the folder's name) alone.

    Raises:
        ConfigError: unreadable YAML or an invalid field; the message names ``path`` and the field.
    """
    if not path.exists():
        return ModelConfigFile(name=path.parent.name)
    return _validated(ModelConfigFile, _raw(path), path)


def validated_config_file(raw: dict[str, Any], path: Path) -> ModelConfigFile:
    """``raw`` (a config's fields, read from ``path``: a ``config.yaml``'s mapping, or a
    ``config.pbtxt`` mapped by ``triton_config``) validated as ``ModelConfigFile``.

    Raises:
        ConfigError: an invalid field, or a name other than the folder's; names ``path`` and the field.
    """
    return _validated(ModelConfigFile, raw, path)


def load_model_config(path: Path) -> ModelConfig:
    """Parse and validate one ``config.yaml`` that needs no completion (it gives ``inputs``
    and ``outputs``, e.g. a pipeline's).

    Raises:
        ConfigError: unreadable YAML or an invalid field; the message names ``path`` and the field.
    """
    return _validated(ModelConfig, _raw(path), path)


def completed_config(given: ModelConfigFile, fields: dict[str, Any], path: Path) -> ModelConfig:
    """``given`` (read from ``path``) with ``fields`` (``ModelConfig`` field -> value) put in,
    validated as a ``ModelConfig``.

    Raises:
        ConfigError: the result is invalid; names ``path`` and the field.
    """
    return _validated(ModelConfig, {**given.model_dump(exclude_unset=True), "name": given.name, **fields}, path)


def read_yaml(path: Path) -> Any:
    """The value of the YAML file at ``path``.

    Raises:
        ConfigError: unreadable, or not YAML: one line naming the file's own line and column
            (``path:3:7: cannot read YAML: ...``), not PyYAML's ``"<unicode string>", line 1``.
    """
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read YAML ({e.strerror or e})") from None
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        context = f" ({e.context} at line {e.context_mark.line + 1})" if e.context and e.context_mark else ""
        raise ConfigError(f"{where}: cannot read YAML: {e.problem or e.context}{context}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: cannot read YAML: {' '.join(str(e).split())}") from None


def _raw(path: Path) -> dict[str, Any]:
    """The mapping in the YAML file at ``path``, ``name`` defaulting to its folder's name."""
    raw = read_yaml(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    raw.setdefault("name", path.parent.name)
    return raw


def _validated(model: type[ModelConfigFile], raw: dict[str, Any], path: Path) -> Any:
    """``raw`` validated as ``model``, its name that of ``path``'s folder.

    Raises:
        ConfigError: an invalid field, or another name; names ``path`` and the field.
    """
    try:
        config = model.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(f"{path}: {describe_validation_error(e, ModelConfigFile)}") from None
    if config.name != path.parent.name:
        raise ConfigError(f"{path}: name: '{config.name}' must equal its folder name '{path.parent.name}'")
    return config
