"""TensorRT plan files: their names, their JSON manifests and the staleness rules.

A plan is bound to the TensorRT flavour and version that built it and to the GPU compute
capabilities it targets (the idea of Triton's ``cc_model_filenames``), so each lives beside
its ONNX file under a name that says all three, with a manifest of the same stem::

    engines/<model>/<version>/model.onnx
    engines/<model>/<version>/model.tensorrt-10.13.0.35.sm90.plan      (+ .json)
    engines/<model>/<version>/model.tensorrt_rtx-1.7.1.116.sm80_86_89_120_121.plan  (+ .json)

The manifest records the ONNX file's sha256, the profiles, the precision asked for and the one
built, the workspace limit, the flavour and version, the target compute capabilities, what
machine built it and when. ``stale_reasons`` compares a manifest with what the config and the
files say now; ``python -m deployments.runtime.tools.build`` rebuilds on any reason, and
``find_plan`` (at load) refuses with ``PlanMismatch`` instead of deserializing blindly.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..contract.config import ModelConfig, Profile
from ..contract.errors import ConfigError, LoadFault
from ..contract.files import file_sha256, write_atomic

MANIFEST_FORMAT = 1
PLAN_PREFIX = "model"

# A profile as stored in a manifest: input name -> {"min": [...], "opt": [...], "max": [...]}.
ProfileShapes = dict[str, dict[str, list[int]]]


class PlanMismatch(LoadFault):
    """No plan fits this model, TensorRT and GPU, or the one there is stale (HTTP 500 at load).

    The message names the model, the plan, every reason and the command that rebuilds it.
    """


def cc_label(cc: str) -> str:
    """``"8.6"`` -> ``"86"``, ``"12.0"`` -> ``"120"`` (the digits of ``sm_86``, ``sm_120``)."""
    major, minor = cc.split(".")
    return f"{int(major)}{int(minor)}"


@dataclass(frozen=True)
class PlanTarget:
    """Which runtime a plan is for: flavour, version and compute capabilities (``"9.0"``)."""

    flavour: str
    version: str
    compute_capabilities: tuple[str, ...]

    @property
    def stem(self) -> str:
        ccs = "_".join(cc_label(cc) for cc in self.compute_capabilities)
        return f"{PLAN_PREFIX}.{self.flavour}-{self.version}.sm{ccs}"

    def plan_path(self, model_dir: Path) -> Path:
        return Path(model_dir) / f"{self.stem}.plan"

    def manifest_path(self, model_dir: Path) -> Path:
        return Path(model_dir) / f"{self.stem}.json"


def _shapes(profile: Profile) -> dict[str, list[int]]:
    return {"min": list(profile.min), "opt": list(profile.opt), "max": list(profile.max)}


def requested_profiles(config: ModelConfig) -> list[ProfileShapes]:
    """The optimization profiles the config asks for, profile 0 first.

    Profile 0 comes from each input's ``profile`` (or its fixed ``dims``); the rest from
    ``tensorrt.profiles`` (an input they leave out keeps its fixed dims).

    Raises:
        ConfigError: an input has a dynamic dim (-1) and no ``profile``.
    """
    first: ProfileShapes = {}
    for spec in config.inputs:
        if spec.profile is not None:
            first[spec.name] = _shapes(spec.profile)
        elif -1 in spec.dims:
            raise ConfigError(
                f"model '{config.name}' input '{spec.name}': dims {list(spec.dims)} are dynamic; "
                "a TensorRT plan needs a profile {min, opt, max} for it in config.yaml")
        else:
            first[spec.name] = {k: list(spec.dims) for k in ("min", "opt", "max")}
    profiles = [first]
    for extra in config.tensorrt.profiles:
        shapes = {name: dict(first[name]) for name in first}
        shapes.update({name: _shapes(p) for name, p in extra.items()})
        profiles.append(shapes)
    return profiles


@dataclass(frozen=True)
class PlanManifest:
    """What a plan was built from and for (``<stem>.json`` beside ``<stem>.plan``).

    ``precision`` is what the config asked for; ``precision_built`` what the builder did:
    ``fp16``/``bf16``/``fp32``, or ``onnx`` where the flavour is strongly typed and the ONNX
    file's own tensor types decide. ``compute_capabilities`` are the targets (``"9.0"``);
    ``target_note`` says how they were chosen (the GPU present, or a CPU-only TensorRT-RTX
    build for a portable set). ``build_s`` is the builder's wall time in seconds.
    """

    model: str
    version: int
    flavour: str
    tensorrt_version: str
    compute_capabilities: list[str]
    target_note: str
    built_on: str
    built_at: str
    build_s: float
    onnx_file: str
    onnx_sha256: str
    onnx_bytes: int
    plan_file: str
    plan_sha256: str
    plan_bytes: int
    profiles: list[ProfileShapes]
    precision: str
    precision_built: str
    workspace_mib: int
    timing_cache: str | None = None
    format: int = MANIFEST_FORMAT
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    def write(self, path: Path) -> None:
        """Write atomically (``write_atomic``)."""
        write_atomic(path, self.to_json())

    @classmethod
    def read(cls, path: Path) -> "PlanManifest":
        """Parse a manifest.

        Raises:
            PlanMismatch: unreadable, not JSON, or missing/unknown fields.
        """
        try:
            raw: dict[str, Any] = json.loads(Path(path).read_text())
            return cls(**raw)
        except (OSError, ValueError, TypeError) as e:
            raise PlanMismatch(f"plan manifest {path} is unreadable ({type(e).__name__}: {e}); "
                               "rebuild it with `make engines`") from None

    @property
    def target(self) -> PlanTarget:
        return PlanTarget(self.flavour, self.tensorrt_version, tuple(self.compute_capabilities))


def stale_reasons(manifest: PlanManifest, config: ModelConfig, onnx_path: Path,
                  plan_path: Path, check_plan_hash: bool = True) -> list[str]:
    """Every way ``manifest`` disagrees with the config and the files now; empty = fresh.

    Checks the manifest format, the ONNX file's size and sha256, the plan file's presence,
    size and (with ``check_plan_hash``) sha256, and the requested profiles, precision and
    workspace. Flavour, version and compute capability are the caller's to compare.
    """
    reasons: list[str] = []
    if manifest.format != MANIFEST_FORMAT:
        reasons.append(f"manifest format {manifest.format}, expected {MANIFEST_FORMAT}")
    if manifest.model != config.name:
        reasons.append(f"manifest is for model '{manifest.model}'")
    if not Path(onnx_path).is_file():
        reasons.append(f"{onnx_path} is missing")
    elif (Path(onnx_path).stat().st_size != manifest.onnx_bytes
          or file_sha256(onnx_path) != manifest.onnx_sha256):
        reasons.append("the ONNX file changed since the plan was built (sha256 differs)")
    if not Path(plan_path).is_file():
        reasons.append(f"plan file {Path(plan_path).name} is missing")
    elif Path(plan_path).stat().st_size != manifest.plan_bytes:
        reasons.append(f"plan file is {Path(plan_path).stat().st_size} bytes, manifest says "
                       f"{manifest.plan_bytes} (truncated or replaced)")
    elif check_plan_hash and file_sha256(plan_path) != manifest.plan_sha256:
        reasons.append("plan file sha256 differs from the manifest (corrupt or replaced)")
    try:
        wanted = requested_profiles(config)
    except ConfigError as e:
        reasons.append(e.message)
    else:
        if manifest.profiles != wanted:
            reasons.append(f"profiles changed: plan has {manifest.profiles}, config asks {wanted}")
    if manifest.precision != config.tensorrt.precision:
        reasons.append(f"precision changed: plan {manifest.precision}, config {config.tensorrt.precision}")
    if manifest.workspace_mib != config.tensorrt.workspace_mib:
        reasons.append(f"workspace changed: plan {manifest.workspace_mib} MiB, "
                       f"config {config.tensorrt.workspace_mib} MiB")
    return reasons


def manifests_in(model_dir: Path, flavour: str | None = None) -> list[Path]:
    """Manifest files in a version folder (of one flavour when given), sorted by name."""
    pattern = f"{PLAN_PREFIX}.{flavour}-*.json" if flavour else f"{PLAN_PREFIX}.*.json"
    return sorted(Path(model_dir).glob(pattern))


def find_plan(config: ModelConfig, model_dir: Path, flavour: str, version: str,
              compute_capability: str, onnx_filename: str = "model.onnx") -> tuple[Path, PlanManifest]:
    """The plan in ``model_dir`` built by this flavour/version for this GPU, checked fresh.

    Args:
        config: the model's contract (profiles, precision and workspace are compared).
        model_dir: the version folder holding ``model.onnx`` and the plans.
        flavour, version: the TensorRT module that will deserialize it.
        compute_capability: the GPU's, e.g. ``"9.0"``.

    Returns:
        ``(plan_path, manifest)``.

    Raises:
        PlanMismatch: no manifest for this flavour, version and compute capability (the
            message lists the plans that are there and for what), or the matching one is
            stale (the message lists the reasons). Both say to run ``make engines``.
    """
    model_dir = Path(model_dir)
    where = f"model '{config.name}' ({model_dir})"
    found: list[str] = []
    for path in manifests_in(model_dir):
        manifest = PlanManifest.read(path)
        found.append(f"{path.with_suffix('.plan').name} ({manifest.flavour} {manifest.tensorrt_version}, "
                     f"sm {'/'.join(manifest.compute_capabilities)})")
        if (manifest.flavour, manifest.tensorrt_version) != (flavour, version):
            continue
        if compute_capability not in manifest.compute_capabilities:
            continue
        plan_path = model_dir / manifest.plan_file
        reasons = stale_reasons(manifest, config, model_dir / onnx_filename, plan_path)
        if reasons:
            raise PlanMismatch(f"{where}: plan {manifest.plan_file} is stale: " + "; ".join(reasons)
                               + ". Rebuild it: `make engines` (python -m deployments.runtime.tools.build "
                               f"--models {config.name})")
        return plan_path, manifest
    listing = "; ".join(found) if found else "none"
    raise PlanMismatch(
        f"{where}: no TensorRT plan for {flavour} {version} on compute capability "
        f"{compute_capability}; plans there: {listing}. Build one on this machine: `make engines` "
        f"(python -m deployments.runtime.tools.build --models {config.name} --flavour {flavour})")
