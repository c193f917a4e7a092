"""Build TensorRT plans for the model repository: ``python -m deployments.runtime.tools.build``.

Long because it holds the whole build as small steps, each a function tested alone (parse,
check the network's I/O, add profiles, configure, build, save), and the command that runs them
over a repository.

For every non-pipeline model in the repository (or those named with ``--models``), the
latest version's ``model.onnx`` is parsed with TensorRT's ONNX parser and built with:

- the optimization profiles from ``config.yaml`` (profile 0 from the inputs' ``profile``
  fields, more from ``tensorrt.profiles``);
- the precision from ``tensorrt.precision`` where the flavour has the builder flag
  (TensorRT 10); strongly typed flavours keep the ONNX file's types, and the manifest says so;
- a workspace limit (``tensorrt.workspace_mib``);
- a timing cache reused across builds (``<root>/.cache/timing.<flavour>-<version>.sm<cc>.cache``;
  TensorRT-RTX has none: its timing-cache calls are no-ops);
- a progress display: TensorRT's ``IProgressMonitor`` phases as tqdm bars where the module
  has it, under one tqdm bar over the models.

Each plan gets a manifest (``plans.PlanManifest``); a plan whose manifest still matches the
config and ONNX file is kept ("fresh"), any mismatch rebuilds it (``--force`` always does).

Targets: full TensorRT builds for the GPU it runs on. TensorRT-RTX builds on a CPU: for the
compute capabilities given with ``--compute-capability``, else for the GPU present if it
supports it, else for its portable set (every target from 8.0 up that the module names).

Exit status: 0 all built or fresh, 1 some model failed (each failure is printed with the
model, the input where there is one, and TensorRT's reason), 2 no TensorRT module.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import logging
import os
import re
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Literal, Sequence

from tqdm import tqdm

from ..backends import cuda, trt_module
from ..contract.config import ModelConfig
from ..contract.reshape import engine_config
from ..contract.errors import ConfigError, LoadFault
from ..backends.plans import (
    PlanManifest,
    PlanMismatch,
    PlanTarget,
    ProfileShapes,
    requested_profiles,
    stale_reasons,
)
from ..contract.files import file_sha256, write_atomic
from ..contract.repository import MODEL_FILENAME, ModelRepository
from ..contract.units import MIB
from ..backends.trt_module import TensorRTModule

if TYPE_CHECKING:  # type-checked against tensorrt-stubs (tests/unit/test_tensorrt_typecheck.py)
    import tensorrt as trt

logger = logging.getLogger(__name__)


class BuildError(ConfigError):
    """A plan could not be built. ``model``, ``input`` (or None) and ``reason`` (TensorRT's
    words where TensorRT refused) are kept as attributes and in the message."""

    def __init__(self, model: str, reason: str, input: str | None = None) -> None:
        where = f"model '{model}'" + (f" input '{input}'" if input else "")
        super().__init__(f"{where}: {reason}")
        self.model, self.input, self.reason = model, input, reason

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.model, self.reason, self.input))


class ProfileRejected(BuildError):
    """TensorRT rejected an optimization profile; ``input`` names the input it concerns."""


@dataclass(frozen=True)
class ModelSource:
    """A model to build: its config, version folder and ONNX file."""

    config: ModelConfig
    version: int
    version_dir: Path

    @property
    def onnx_path(self) -> Path:
        return self.version_dir / MODEL_FILENAME


@dataclass
class BuildResult:
    """What happened to one model: ``status`` is ``built``, ``fresh`` (kept) or ``failed``."""

    model: str
    status: Literal["built", "fresh", "failed"]
    plan_path: Path | None = None
    manifest: PlanManifest | None = None
    reasons: list[str] = field(default_factory=list)
    error: BuildError | None = None
    seconds: float = 0.0


# ---------------------------------------------------------------------------------------------
# Targets


def _gpu() -> tuple[str, str] | None:
    """``(compute capability, description)`` of CUDA device 0, or None without one."""
    if cuda.device_count() == 0:
        return None
    major, minor = cuda.compute_capability(0)
    return f"{major}.{minor}", f"GPU 0: {cuda.device_name(0)} (compute capability {major}.{minor})"


def choose_target(trt_mod: TensorRTModule, requested: Sequence[str] = ()) -> tuple[PlanTarget, str, str]:
    """Decide the compute capabilities to build for.

    Returns:
        ``(target, built_on, target_note)``: the plan target, the machine description
        (``"cpu (no CUDA device)"`` or the GPU) and how the targets were chosen.

    Raises:
        ConfigError: full TensorRT without a GPU, ``--compute-capability`` with full
            TensorRT, or a compute capability TensorRT-RTX cannot target.
    """
    gpu = _gpu()
    built_on = gpu[1] if gpu else "cpu (no CUDA device)"
    if not trt_mod.builds_without_gpu:
        if requested:
            raise ConfigError("full TensorRT builds for the GPU it runs on; "
                             "--compute-capability applies to TensorRT-RTX only")
        if gpu is None:
            raise ConfigError("full TensorRT (module tensorrt) needs a CUDA GPU to build on; "
                             "none is visible. On a CPU-only machine build with "
                             "--flavour tensorrt_rtx")
        return (PlanTarget(trt_mod.flavour, trt_mod.version, (gpu[0],)), built_on,
                f"the GPU it was built on ({gpu[0]})")
    supported = list(trt_mod.target_compute_capabilities() or ())
    if requested:
        bad = [cc for cc in requested if cc not in supported]
        if bad:
            raise ConfigError(f"TensorRT-RTX {trt_mod.version} cannot target compute "
                             f"capability {bad}; it supports {supported}")
        ccs = sorted(set(requested), key=supported.index)
        note = "the compute capabilities asked for (--compute-capability)"
    elif gpu is not None and gpu[0] in supported:
        ccs, note = [gpu[0]], f"the GPU it was built on ({gpu[0]})"
    else:
        ccs = [cc for cc in supported if float(cc) >= 8.0]
        why = (f"the GPU present ({gpu[0]}) is not a TensorRT-RTX target" if gpu
               else "built on a CPU with no GPU")
        note = (f"TensorRT-RTX portable set ({why}): every target from 8.0 up that this module "
                "names; 7.5 (Turing) only when asked, as TensorRT-RTX documents")
    return PlanTarget(trt_mod.flavour, trt_mod.version, tuple(ccs)), built_on, note


# ---------------------------------------------------------------------------------------------
# ONNX preparation


def unify_dynamic_dims(model_bytes: bytes, config: ModelConfig,
                       profiles: list[ProfileShapes]) -> tuple[bytes | None, list[str]]:
    """Rename an input's symbolic dims where one name stands for axes the profiles size apart.

    TensorRT treats equal ``dim_param`` names as one size: PP-OCR's classifier names H and
    W of ``x`` both ``?``, so a 48 x 192 profile reads as a contradiction. Each such axis
    gets its own name (``x.2``, ``x.3``); names whose axes share one range stay as they are.

    Returns:
        ``(new model bytes or None when nothing changed, notes for the manifest)``.
    """
    import onnx

    model = onnx.load_from_string(model_bytes)
    ranges: dict[str, set[tuple[tuple[int, int], ...]]] = {}
    dims = []
    for graph_input in model.graph.input:
        if graph_input.name not in profiles[0]:
            continue
        for axis, dim in enumerate(graph_input.type.tensor_type.shape.dim):
            if dim.HasField("dim_param"):
                key = tuple((p[graph_input.name]["min"][axis], p[graph_input.name]["max"][axis])
                            for p in profiles)
                ranges.setdefault(dim.dim_param, set()).add(key)
                dims.append((graph_input.name, axis, dim))
    conflicting = {name for name, seen in ranges.items() if len(seen) > 1}
    notes = []
    for input_name, axis, dim in dims:
        if dim.dim_param in conflicting:
            notes.append(f"input '{input_name}' axis {axis}: symbolic dim '{dim.dim_param}' renamed "
                         f"'{input_name}.{axis}' (the name stood for axes of different ranges)")
            dim.dim_param = f"{input_name}.{axis}"
    if not notes:
        return None, []
    return model.SerializeToString(), notes


# ---------------------------------------------------------------------------------------------
# Progress


def progress_monitor(trt_mod: TensorRTModule, max_depth: int = 2) -> Any | None:
    """A ``trt.IProgressMonitor`` showing the builder's phases as nested tqdm bars, or None
    when the module has no ``IProgressMonitor``. Phases deeper than ``max_depth`` are not drawn."""
    base = getattr(trt_mod.module, "IProgressMonitor", None)
    if base is None:
        return None

    class TqdmProgressMonitor(base):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            super().__init__()
            self._bars: dict[str, Any] = {}
            self._depth: dict[str, int] = {}

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            depth = 0 if parent_phase is None else self._depth.get(parent_phase, 0) + 1
            self._depth[phase_name] = depth
            if depth < max_depth:
                self._bars[phase_name] = tqdm(total=num_steps, desc=f"  {phase_name}", leave=False,
                                              position=depth + 1, unit="step")

        def step_complete(self, phase_name: str, step: int) -> bool:
            bar = self._bars.get(phase_name)
            if bar is not None:
                bar.update(1)
            return True  # False would cancel the build

        def phase_finish(self, phase_name: str) -> None:
            bar = self._bars.pop(phase_name, None)
            if bar is not None:
                bar.close()

    return TqdmProgressMonitor()


# ---------------------------------------------------------------------------------------------
# Building


def _input_named_in(messages: Iterable[str], names: Sequence[str]) -> str | None:
    """The first input name that a TensorRT message mentions as a whole word."""
    for message in messages:
        for name in names:
            if re.search(rf"(?<![\w./:-]){re.escape(name)}(?![\w./:-])", message):
                return name
    return None


def _unmark_undeclared_outputs(network: "trt.INetworkDefinition", declared: set[str]) -> list[str]:
    """Unmark network outputs that config.yaml does not declare, so the plan neither computes nor
    needs an address for them (TensorRT wants one for every output before ``execute_async_v3``).
    Returns a note for the manifest, or nothing."""
    undeclared = [network.get_output(i) for i in range(network.num_outputs)
                  if network.get_output(i).name not in declared]
    for tensor in undeclared:
        network.unmark_output(tensor)
    if not undeclared:
        return []
    return [f"network outputs {sorted(t.name for t in undeclared)} are not declared in config.yaml: "
            "not outputs of the plan"]


def _timing_cache_path(root: Path, target: PlanTarget) -> Path:
    ccs = target.stem.rsplit(".", 1)[-1]
    return root / ".cache" / f"timing.{target.flavour}-{target.version}.{ccs}.cache"


@dataclass
class ParsedNetwork:
    """A network parsed from ONNX, with the builder that made it and the parser that owns its
    weights (TensorRT: the parser must outlive the build)."""

    builder: Any
    network: Any
    parser: Any
    log: Any  # trt_module.capturing_logger(...)
    notes: list[str]


def parse_network(source: ModelSource, trt_mod: TensorRTModule,
                  profiles: list[ProfileShapes]) -> ParsedNetwork:
    """Step 1 (Polygraphy's ``NetworkFromOnnxPath``): parse ``source``'s ONNX file (strongly
    typed where the flavour only builds that way) and check its inputs and outputs against the
    config. Symbolic dims whose axes differ in size are split first (``unify_dynamic_dims``).

    Raises:
        BuildError: the parser refused the file, or the network and ``config.yaml`` disagree.
    """
    trt_ = trt_mod.module
    config = source.config
    log = trt_module.capturing_logger(trt_mod)
    builder: trt.Builder = trt_.Builder(log)
    flags = 0
    if trt_mod.strongly_typed_only and hasattr(trt_.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
        flags |= 1 << int(trt_.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network: trt.INetworkDefinition = builder.create_network(flags)
    parser: trt.OnnxParser = trt_.OnnxParser(network, log)
    model_bytes = source.onnx_path.read_bytes()
    prepared, notes = unify_dynamic_dims(model_bytes, config, profiles)
    mark = log.mark()
    if not parser.parse(prepared if prepared is not None else model_bytes, str(source.onnx_path)):
        errors = [str(parser.get_error(i).desc()) for i in range(parser.num_errors)]
        raise BuildError(config.name, "TensorRT's ONNX parser refused "
                         f"{source.onnx_path}: {'; '.join(errors or log.errors_since(mark)) or 'no reason given'}")
    check_network_io(network, config)
    notes += _unmark_undeclared_outputs(network, {t.name for t in config.outputs})
    return ParsedNetwork(builder, network, parser, log, notes)


def check_network_io(network: trt.INetworkDefinition, config: ModelConfig) -> None:
    """The network's inputs are exactly the config's, and it has every configured output.

    Raises:
        BuildError: naming the input or outputs that disagree.
    """
    name = config.name
    net_inputs = {network.get_input(i).name for i in range(network.num_inputs)}
    net_outputs = {network.get_output(i).name for i in range(network.num_outputs)}
    for spec in config.inputs:
        if spec.name not in net_inputs:
            raise BuildError(name, f"not an input of the ONNX network; its inputs are {sorted(net_inputs)}",
                             input=spec.name)
    undeclared = sorted(net_inputs - {t.name for t in config.inputs})
    if undeclared:
        raise BuildError(name, f"network inputs {undeclared} are not declared in config.yaml")
    missing_outputs = sorted({t.name for t in config.outputs} - net_outputs)
    if missing_outputs:
        raise BuildError(name, f"config outputs {missing_outputs} are not network outputs "
                         f"{sorted(net_outputs)}")


def add_profiles(parsed: ParsedNetwork, builder_config: trt.IBuilderConfig, trt_mod: TensorRTModule,
                 config: ModelConfig, profiles: list[ProfileShapes]) -> None:
    """Step 2 (Polygraphy's ``Profile``): one optimization profile per entry of ``profiles``
    (``requested_profiles``), checking every boolean and index TensorRT returns.

    Raises:
        ProfileRejected: naming the input and TensorRT's reason.
    """
    trt_, log, name = trt_mod.module, parsed.log, config.name
    input_names = [t.name for t in config.inputs]
    for index, shapes in enumerate(profiles):
        profile: trt.IOptimizationProfile = parsed.builder.create_optimization_profile()
        for input_name, s in shapes.items():
            mark = log.mark()
            try:  # full TensorRT raises (e.g. a rank that differs from the network's) where RTX logs
                profile.set_shape(input_name, trt_.Dims(s["min"]), trt_.Dims(s["opt"]), trt_.Dims(s["max"]))
            except (RuntimeError, TypeError, ValueError) as e:
                raise ProfileRejected(name, f"TensorRT rejected profile {index} {s}: "
                                      + "; ".join([*log.errors_since(mark), f"set_shape raised: {e}"]),
                                      input=input_name) from e
            if not profile:  # IOptimizationProfile.__bool__ is isValid()
                raise ProfileRejected(name, f"TensorRT rejected profile {index} {s}: "
                                      + "; ".join(log.errors_since(mark) or ["profile is invalid"]),
                                      input=input_name)
        mark = log.mark()
        if builder_config.add_optimization_profile(profile) < 0:
            errors = log.errors_since(mark)
            raise ProfileRejected(name, f"TensorRT rejected profile {index}: {'; '.join(errors)}",
                                  input=_input_named_in(errors, input_names))


def configure_builder(parsed: ParsedNetwork, builder_config: trt.IBuilderConfig, trt_mod: TensorRTModule,
                      config: ModelConfig, target: PlanTarget) -> str:
    """Step 3 (Polygraphy's ``CreateConfig``): precision, workspace limit and, on TensorRT-RTX,
    the compute-capability targets. Returns the precision built (``onnx`` for strongly typed
    flavours, which keep the ONNX file's types; ``parsed.notes`` says so).

    Raises:
        BuildError: the flavour has no flag for the precision, or refused a target.
    """
    trt_, log, name = trt_mod.module, parsed.log, config.name
    precision = config.tensorrt.precision
    if trt_mod.strongly_typed_only:
        precision_built = "onnx"
        if precision != "fp32":
            parsed.notes.append(f"{trt_mod.flavour} {trt_mod.version} builds strongly typed networks: "
                                f"the ONNX file's tensor types decide; precision '{precision}' was not applied")
    else:
        precision_built = precision
        if precision in ("fp16", "bf16"):
            flag = getattr(trt_.BuilderFlag, precision.upper(), None)
            if flag is None:
                raise BuildError(name, f"{trt_mod.label} has no {precision.upper()} builder flag")
            builder_config.set_flag(flag)
    builder_config.set_memory_pool_limit(trt_.MemoryPoolType.WORKSPACE, config.tensorrt.workspace_mib * MIB)

    if trt_mod.builds_without_gpu:
        rtx_config: Any = builder_config  # compute-capability targets are TensorRT-RTX API only
        rtx_config.num_compute_capabilities = len(target.compute_capabilities)
        for i, cc in enumerate(target.compute_capabilities):
            enum = getattr(trt_.ComputeCapability, f"SM{cc.replace('.', '')}")
            mark = log.mark()
            if not rtx_config.set_compute_capability(enum, i):
                raise BuildError(name, f"set_compute_capability({cc}) failed: "
                                 + "; ".join(log.errors_since(mark)))
    return precision_built


def load_timing_cache(builder_config: trt.IBuilderConfig, trt_mod: TensorRTModule,
                      timing_cache: Path | None) -> Path | None:
    """Give the builder the timing cache in ``timing_cache`` (a new one when absent or when
    it does not fit this TensorRT/GPU). Returns the path in use, None for flavours without."""
    if timing_cache is None or not trt_mod.has_timing_cache:
        return None
    data = timing_cache.read_bytes() if timing_cache.is_file() else b""
    cache = builder_config.create_timing_cache(data)
    if not builder_config.set_timing_cache(cache, False):
        logger.warning("timing cache %s does not fit this TensorRT/GPU; starting a new one", timing_cache)
        cache = builder_config.create_timing_cache(b"")
        builder_config.set_timing_cache(cache, False)
    return timing_cache


def build_serialized(parsed: ParsedNetwork, builder_config: trt.IBuilderConfig,
                     config: ModelConfig) -> tuple[memoryview, float]:
    """Step 4 (Polygraphy's ``EngineBytesFromNetwork``): build; returns (plan bytes, seconds).

    Raises:
        ProfileRejected: the builder refused a profile (names the input where it can).
        BuildError: any other builder failure, with TensorRT's logged errors.
    """
    log, name = parsed.log, config.name
    input_names = [t.name for t in config.inputs]
    mark = log.mark()
    start = time.perf_counter()
    serialized = parsed.builder.build_serialized_network(parsed.network, builder_config)
    build_s = time.perf_counter() - start
    if serialized is None:
        errors = log.errors_since(mark)
        reason = "; ".join(errors) or "the builder returned no plan and logged no error"
        if any("profile" in e.lower() for e in errors):
            raise ProfileRejected(name, f"TensorRT rejected the optimization profile: {reason}",
                                  input=_input_named_in(errors, input_names)
                                  or (input_names[0] if len(input_names) == 1 else None))
        raise BuildError(name, f"TensorRT's builder failed: {reason}")
    return memoryview(serialized).cast("B"), build_s


def save_plan(source: ModelSource, target: PlanTarget, plan: memoryview, manifest: PlanManifest) -> None:
    """Step 5 (Polygraphy's ``SaveBytes``): write the plan, then its manifest, atomically
    beside the ONNX file (a reader never finds a manifest without its plan; when the manifest
    cannot be written, the plan is removed again: no orphan plan is left on a full disk)."""
    plan_path = target.plan_path(source.version_dir)
    write_atomic(plan_path, plan)
    try:
        manifest.write(target.manifest_path(source.version_dir))
    except BaseException:  # e.g. the disk filled between the two: no plan without its manifest
        plan_path.unlink(missing_ok=True)
        raise


def build_plan(source: ModelSource, trt_mod: TensorRTModule, target: PlanTarget, *,
               built_on: str, target_note: str, timing_cache: Path | None = None,
               progress: bool = False) -> PlanManifest:
    """Build one plan and write it and its manifest beside the ONNX file: ``parse_network``,
    ``add_profiles``, ``configure_builder``, ``load_timing_cache``, ``build_serialized``,
    ``save_plan`` (the timing cache is written back after the build).

    Args:
        source: the model (config, version folder, ONNX path).
        trt_mod: the TensorRT flavour to build with.
        target: flavour/version/compute capabilities; names the files.
        built_on, target_note: recorded in the manifest.
        timing_cache: file to load and update (flavours with a timing cache only).
        progress: draw the builder's phases (``IProgressMonitor``) as tqdm bars.

    Returns:
        The manifest written.

    Raises:
        ProfileRejected: TensorRT refused a profile; names model, input and TensorRT's reason.
        BuildError: parsing failed, config and network disagree, or the builder failed.
    """
    config = source.config
    profiles = requested_profiles(config)
    parsed = parse_network(source, trt_mod, profiles)
    builder_config: trt.IBuilderConfig = parsed.builder.create_builder_config()
    add_profiles(parsed, builder_config, trt_mod, config, profiles)
    precision_built = configure_builder(parsed, builder_config, trt_mod, config, target)
    cache_used = load_timing_cache(builder_config, trt_mod, timing_cache)
    if progress:
        monitor = progress_monitor(trt_mod)
        if monitor is not None:
            builder_config.progress_monitor = monitor
    plan, build_s = build_serialized(parsed, builder_config, config)
    if cache_used is not None:
        write_atomic(cache_used, memoryview(builder_config.get_timing_cache().serialize()).cast("B"))

    plan_path = target.plan_path(source.version_dir)
    manifest = PlanManifest(
        model=config.name, version=source.version, flavour=trt_mod.flavour, tensorrt_version=trt_mod.version,
        compute_capabilities=list(target.compute_capabilities), target_note=target_note,
        built_on=built_on, built_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        build_s=round(build_s, 3), onnx_file=MODEL_FILENAME, onnx_sha256=file_sha256(source.onnx_path),
        onnx_bytes=source.onnx_path.stat().st_size, plan_file=plan_path.name,
        plan_sha256=hashlib.sha256(plan).hexdigest(), plan_bytes=len(plan), profiles=profiles,
        precision=config.tensorrt.precision, precision_built=precision_built,
        workspace_mib=config.tensorrt.workspace_mib, timing_cache=None if cache_used is None else str(cache_used),
        notes=parsed.notes)
    save_plan(source, target, plan, manifest)
    return manifest


def find_sources(root: Path, names: Sequence[str] | None = None) -> tuple[list[ModelSource], list[BuildResult]]:
    """Non-pipeline models under ``root`` (only ``names`` when given), latest version each,
    as ``ModelRepository`` indexes them; models whose config says ``backend: onnxruntime``
    (string tensors, which TensorRT lacks) are skipped.

    Returns:
        ``(sources, failures)``: a model with no ``<version>/model.onnx`` or an unknown name
        is a failure (status ``failed``), not an exception, so the other models still build.

    Raises:
        ConfigError: ``root`` is missing or a ``config.yaml`` is invalid.
    """
    repo = ModelRepository(root, require_versions=False)
    failures = [BuildResult(n, "failed", error=BuildError(n, f"no model folder {root}/{n}"))
                for n in (names or []) if n not in repo.names()]
    sources = []
    for entry in repo.entries():
        if (names and entry.name not in names) or entry.config.pipeline:
            continue
        if entry.config.backend == "onnxruntime":  # pinned to ONNX Runtime: no plan to build
            continue
        if not entry.versions:
            failures.append(BuildResult(entry.name, "failed", error=BuildError(
                entry.name, f"no <version>/{MODEL_FILENAME} under {entry.path}; run `make models`")))
            continue
        # the plan is the model file's: reshaped tensors in its shapes (``contract.reshape``)
        sources.append(ModelSource(engine_config(entry.config), entry.latest, entry.onnx_path().parent))
    return sources, failures


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _disk_full(source: ModelSource, error: Exception) -> BuildError | None:
    """A ``BuildError`` saying which folder ran out of space for a write that failed with
    ENOSPC, EDQUOT or EFBIG (a full disk, a quota, a file size limit); None for other errors.
    ``write_atomic`` leaves no partial file and ``save_plan`` no plan without its manifest, so
    the next ``make engines`` after freeing space builds the plan again."""
    if not isinstance(error, OSError) or error.errno not in _DISK_FULL:
        return None
    folder = Path(error.filename).parent if error.filename else source.version_dir
    return BuildError(source.config.name, f"{os.strerror(error.errno)} while writing into {folder} "
                      "(the plan, its manifest or the timing cache); nothing partial was kept: free space "
                      "there and run `make engines` again")


def build_all(root: Path | str = "engines", names: Sequence[str] | None = None,
              flavour: trt_module.FlavourRequest = "auto", compute_capabilities: Sequence[str] = (),
              force: bool = False, progress: bool = False) -> list[BuildResult]:
    """Build (or keep, when fresh) the plan of every selected model.

    Args:
        root: the model repository.
        names: models to build; all non-pipeline models when None or empty.
        flavour: ``auto`` (``tensorrt``, else ``tensorrt_rtx``), ``tensorrt`` or ``tensorrt_rtx``.
        compute_capabilities: TensorRT-RTX targets such as ``["8.6", "8.9"]``.
        force: rebuild even when the manifest matches.
        progress: show tqdm bars (models, and the builder's phases).

    Returns:
        One ``BuildResult`` per model, failures included (with their ``BuildError``).

    Raises:
        TensorRTUnavailable: no TensorRT module of that flavour.
        ConfigError: no target can be chosen (e.g. full TensorRT without a GPU), or the
            repository or a config is invalid.
    """
    root = Path(root)
    trt_mod = trt_module.load(flavour)
    target, built_on, note = choose_target(trt_mod, compute_capabilities)
    cache = _timing_cache_path(root, target) if trt_mod.has_timing_cache else None
    sources, results = find_sources(root, names)
    bar = tqdm(sources, desc="plans", unit="model", disable=not progress)
    for source in bar:
        bar.set_postfix_str(source.config.name)
        start = time.perf_counter()
        plan_path = target.plan_path(source.version_dir)
        manifest_path = target.manifest_path(source.version_dir)
        reasons = ["--force"] if force else []
        if not force:
            if manifest_path.is_file():
                try:
                    reasons = stale_reasons(PlanManifest.read(manifest_path), source.config,
                                            source.onnx_path, plan_path)
                except (ConfigError, PlanMismatch) as e:
                    reasons = [e.message]
            else:
                reasons = ["no plan yet"]
        if not reasons:
            results.append(BuildResult(source.config.name, "fresh", plan_path,
                                       PlanManifest.read(manifest_path),
                                       seconds=time.perf_counter() - start))
            continue
        try:
            manifest = build_plan(source, trt_mod, target, built_on=built_on, target_note=note,
                                  timing_cache=cache, progress=progress)
        except Exception as e:  # one model's failure, expected or not, never stops the others
            disk_full = _disk_full(source, e)
            error = e if isinstance(e, BuildError) else disk_full or BuildError(
                source.config.name, f"the build raised {type(e).__name__}: {e}")
            if not isinstance(e, BuildError) and disk_full is None:  # a full disk needs no traceback
                logger.exception("building model '%s' failed", source.config.name)
            results.append(BuildResult(source.config.name, "failed", reasons=reasons, error=error,
                                       seconds=time.perf_counter() - start))
            continue
        results.append(BuildResult(source.config.name, "built", plan_path, manifest, reasons,
                                   seconds=time.perf_counter() - start))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status (0 ok, 1 a model failed, 2 no TensorRT)."""
    parser = argparse.ArgumentParser(prog="python -m deployments.runtime.tools.build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default="engines", help="model repository (default: engines)")
    parser.add_argument("--models", nargs="*", help="models to build (default: all non-pipeline models)")
    parser.add_argument("--flavour", choices=["auto", "tensorrt", "tensorrt_rtx"], default="auto")
    parser.add_argument("--compute-capability", action="append", default=[], metavar="CC",
                        help="TensorRT-RTX target such as 8.6; repeat for several")
    parser.add_argument("--force", action="store_true", help="rebuild plans that are still fresh")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=sys.stderr.isatty(),
                        help="tqdm bars (default: on when stderr is a terminal)")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        results = build_all(args.root, args.models, args.flavour, args.compute_capability,
                            args.force, args.progress)
    except trt_module.TensorRTUnavailable as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    except (ConfigError, LoadFault) as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 1
    for r in results:
        if r.status == "failed":
            print(f"FAILED {r.model}: {r.error.message if r.error else '?'}", file=sys.stderr)
        else:
            m = r.manifest
            assert m is not None and r.plan_path is not None
            why = f" ({'; '.join(r.reasons)})" if r.status == "built" else ""
            print(f"{r.status:5s} {r.model}: {r.plan_path} [{m.precision_built}, sm "
                  f"{'/'.join(m.compute_capabilities)}, {m.plan_bytes / 2**20:.1f} MiB, "
                  f"{r.seconds:.1f} s]{why}")
    return 1 if any(r.status == "failed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
