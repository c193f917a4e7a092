"""Config completion from the model file: what ``config.yaml`` leaves out is read from the ONNX
graph, and what it says is checked against the graph (Triton's "auto-complete", with its rules).

Filled in when the config leaves it out:

- ``inputs`` / ``outputs``: every graph input (initializers excluded) / output, in the graph's
  order, with its name, KServe v2 datatype and dims, a dynamic axis (a symbol such as ``N``, or
  no size at all) as -1;
- ``max_batch_size``: ``DEFAULT_MAX_BATCH_SIZE`` when axis 0 is the batch axis, else 0. Axis 0
  is the batch axis when every input and output has one symbol there (``N`` in all of them; an
  axis without a symbol is no shared symbol); otherwise the model has no batch axis unless its
  config sets ``max_batch_size``;
- ``profile`` of each input with a dynamic axis and no ``profile``: ``DefaultProfile``'s rule
  (``default_profile`` in the config overrides it, an input's own ``profile`` replaces it).

What a config may narrow: fix a dynamic axis to a size, set ``max_batch_size``, set a profile.
What must match the file: input names (all of them), output names (a subset may be listed),
datatypes, rank, and every axis the file fixes. A batched model (``max_batch_size > 0``) needs
axis 0 dynamic in every input and output. A mismatch is a ``ConfigError`` naming the config
file, the field and the model file.

A TensorRT plan's bindings are not read: a version is indexed by its ``model.onnx``, which every
plan is built from (``tools.build``), and reading a plan needs the GPU it was built for.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from .config import ModelConfig, ModelConfigFile, TensorSpec, completed_config
from .datatypes import ONNX_TYPE_BY_DATATYPE, TRITON_TYPES
from .errors import ConfigError, InvalidModelFile, ServingError, unreadable_model_file, unsupported_operator
from .files import file_version, shown_model_file
from .store import PBTXT_FILENAME

# As Triton's ``--backend-config=default-max-batch-size`` (4): the max_batch_size a batched model
# gets when its config gives none.
DEFAULT_MAX_BATCH_SIZE = 4

_DATATYPE_BY_ONNX_TYPE = {onnx_type: datatype for datatype, onnx_type in ONNX_TYPE_BY_DATATYPE.items()}

Dim = int | str | None  # a fixed size, a symbol, or a dynamic axis without a symbol


@dataclass(frozen=True)
class FileTensor:
    """One input or output of a model file: ``datatype`` (KServe v2, or the ONNX type's name
    when it has none) and ``dims`` (None: the file gives no shape)."""

    name: str
    datatype: str
    dims: Optional[tuple[Dim, ...]]

    def shown(self) -> str:
        """``dims`` as text: symbols by name, an axis without one as ``?``."""
        return "[" + ", ".join("?" if d is None else str(d) for d in self.dims or ()) + "]"

    def config_dims(self) -> tuple[int, ...]:
        """``dims`` in a config's terms: a dynamic axis as -1."""
        return tuple(d if isinstance(d, int) else -1 for d in self.dims or ())


@dataclass(frozen=True)
class FileSignature:
    """A model file's inputs and outputs, in the graph's order."""

    path: Path
    inputs: tuple[FileTensor, ...]
    outputs: tuple[FileTensor, ...]
    unsupported: tuple[tuple[str, str], ...] = ()  # (op, domain) of nodes no ONNX Runtime domain has

    def batch_symbol(self) -> str | None:
        """The symbol every input and output has on axis 0, or None (no batch axis)."""
        firsts = {t.dims[0] if t.dims else None for t in self.inputs + self.outputs}
        first = firsts.pop() if len(firsts) == 1 else None
        return first if isinstance(first, str) else None


def read_onnx_signature(path: Path) -> FileSignature | None:
    """The inputs and outputs of the ONNX file at ``path``, cached per ``file_version`` for
    this process (every replica reads the repository; the file is parsed once per process).
    None when the file is missing or is not ONNX: loading it reports that, naming the model
    (``errors.unreadable_model_file``), and heals once the file is repaired.
    """
    try:
        version = file_version(path)
    except OSError:
        return None
    signature = _signature(*version)
    return None if signature is None else dataclasses.replace(signature, path=Path(path))


@functools.lru_cache(maxsize=None)
def _signature(path: str, size: int, mtime_ns: int) -> FileSignature | None:
    import onnx
    from google.protobuf.message import DecodeError

    try:
        model = onnx.load(path, load_external_data=False)
    except (OSError, DecodeError):
        return None
    if model.ir_version <= 0 or not model.HasField("graph"):  # e.g. an emptied file parses as an empty model
        return None
    initializers = {i.name for i in model.graph.initializer}
    return FileSignature(
        path=Path(path),
        inputs=tuple(_tensor(v) for v in model.graph.input if v.name not in initializers),
        outputs=tuple(_tensor(v) for v in model.graph.output),
        unsupported=_unsupported_ops(model))


# Domains whose operators ONNX Runtime implements beside ONNX's own: its contrib operators.
_RUNTIME_DOMAINS = ("com.microsoft", "com.microsoft.nchwc", "com.microsoft.experimental", "com.ms.internal.nhwc")


def _unsupported_ops(model: Any) -> tuple[tuple[str, str], ...]:
    """``(op, domain)`` of the top-level graph's nodes that neither ONNX's operator sets nor ONNX
    Runtime's own domains (``_RUNTIME_DOMAINS``) nor the model's local functions define: a
    custom operator, which no session of this server can run (an operator of a known domain
    without a kernel for its types is found when the session is made)."""
    import onnx

    local = {(f.domain, f.name) for f in model.functions}
    found: list[tuple[str, str]] = []
    for node in model.graph.node:
        domain = "" if node.domain == "ai.onnx" else node.domain
        if (node.domain, node.op_type) in local or domain in _RUNTIME_DOMAINS:
            continue
        if domain in ("", "ai.onnx.ml") and onnx.defs.has(node.op_type, domain):
            continue
        if (node.op_type, domain) not in found:
            found.append((node.op_type, domain))
    return tuple(found)


def model_file_error(name: str, path: Path) -> ServingError:
    """The error for model ``name``'s file at ``path`` that ``read_onnx_signature`` could not
    read: missing (``LoadFault``), else not an ONNX model (``InvalidModelFile``, naming the file
    relative to the repository and, for an empty file, that it is empty)."""
    shown = shown_model_file(path)
    try:
        size = Path(path).stat().st_size
    except OSError as e:
        return unreadable_model_file(name, "onnx", e, shown)
    if size == 0:
        return InvalidModelFile(f"model '{name}': its model file {shown} is empty, not an ONNX model")
    return InvalidModelFile(f"model '{name}': its model file {shown} is not a valid ONNX model: it does not parse as "
                            "one (damaged, truncated or another format)")


def _tensor(value: Any) -> FileTensor:
    """An ONNX ``ValueInfoProto`` as a ``FileTensor``."""
    import onnx

    tensor_type = value.type.tensor_type
    onnx_type = f"tensor({onnx.TensorProto.DataType.Name(tensor_type.elem_type).lower()})"
    dims = None
    if tensor_type.HasField("shape"):
        dims = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0
                     else d.dim_param if d.HasField("dim_param") and d.dim_param else None
                     for d in tensor_type.shape.dim)
    return FileTensor(name=value.name, datatype=_DATATYPE_BY_ONNX_TYPE.get(onnx_type, onnx_type), dims=dims)


COMPLETED_FIELDS = ("max_batch_size", "inputs", "outputs")


def complete_config(given: ModelConfigFile, config_path: Path, model_files: list[Path]) -> ModelConfig:
    """``given`` (read from ``config_path``, which may not exist) completed from
    ``model_files[0]`` (the newest served version's ``model.onnx``) and checked against each of
    ``model_files`` that can be read (one that cannot is reported when it loads).

    Raises:
        ConfigError: the config disagrees with a model file, or leaves out a field that the
            file cannot tell (no shape, no KServe datatype); names the config file, the field
            and the model file.
        InvalidModelFile: a model file uses an operator ONNX Runtime does not have; the config
            leaves out a field and the model file is not ONNX (damaged, truncated, empty) or has
            no inputs or outputs: names the model file (``model_file_error``).
        LoadFault: the config leaves out a field and the model file is missing.
    """
    signatures = [read_onnx_signature(path) for path in model_files]
    first = signatures[0]
    left_out = [f for f in COMPLETED_FIELDS if getattr(given, f) is None]
    if left_out and first is None:
        raise model_file_error(given.name, model_files[0])
    for signature in signatures:
        if signature is not None and signature.unsupported:
            op, domain = signature.unsupported[0]
            raise unsupported_operator(given.name, shown_model_file(signature.path), op, domain)
    for kind in ("inputs", "outputs"):
        if getattr(given, kind) is None and not getattr(first, kind):
            raise InvalidModelFile(f"model '{given.name}': its model file {shown_model_file(first.path)} has no "
                                   f"{kind} (its graph's {kind} are {'all initializers or ' if kind == 'inputs' else ''}"
                                   f"none): a served model takes at least one input and gives at least one output")
    max_batch_size = given.max_batch_size
    if max_batch_size is None:
        max_batch_size = DEFAULT_MAX_BATCH_SIZE if first.batch_symbol() is not None else 0
    readable = [s for s in signatures if s is not None]
    if max_batch_size:
        for signature in readable:
            _check_batch_axis(max_batch_size, signature, config_path)
    inputs = given.inputs if given.inputs is not None else _tensors(first, "inputs", config_path)
    outputs = given.outputs if given.outputs is not None else _tensors(first, "outputs", config_path)
    config = completed_config(given, {
        "max_batch_size": max_batch_size,
        "inputs": [_with_profile(t, max_batch_size, given).model_dump(exclude_none=True) for t in inputs],
        "outputs": [t.model_dump(exclude_none=True) for t in outputs]}, config_path)
    for signature in readable:
        check_against_file(config, config_path, signature)
    return config


def _check_batch_axis(max_batch_size: int, signature: FileSignature, config_path: Path) -> None:
    """A batched model's axis 0 is dynamic in every input and output of the file.

    Raises:
        ConfigError: a tensor fixes it; names it and says to set ``max_batch_size: 0``.
    """
    for kind, tensors in (("input", signature.inputs), ("output", signature.outputs)):
        for tensor in tensors:
            if tensor.dims and isinstance(tensor.dims[0], int):
                raise ConfigError(
                    f"{config_path}: max_batch_size: {max_batch_size} makes axis 0 the batch axis, but {signature.path} "
                    f"has {kind} '{tensor.name}' with axis 0 fixed to {tensor.dims[0]} (dims {tensor.shown()}): a "
                    "batched model's axis 0 is dynamic in every input and output; set max_batch_size: 0")


def _tensors(signature: FileSignature, kind: str, config_path: Path) -> tuple[TensorSpec, ...]:
    """The file's inputs or outputs (``kind``) as a config's.

    Raises:
        ConfigError: a tensor with no shape, or a datatype without a KServe v2 equivalent.
    """
    out = []
    for tensor in getattr(signature, kind):
        what = (f"{config_path}: {kind}: left out, and" if config_path.exists() else
                f"{config_path.parent.name} (no config.yaml): {kind} are read from its model file, and")
        what += f" {signature.path} has {kind[:-1]} '{tensor.name}'"
        if tensor.datatype not in ONNX_TYPE_BY_DATATYPE:
            raise ConfigError(f"{what} of type {tensor.datatype}, which has no KServe v2 datatype (allowed: "
                              f"{', '.join(ONNX_TYPE_BY_DATATYPE)})")
        if tensor.dims is None:
            raise ConfigError(f"{what} without a shape: list the {kind} with their dims in a config.yaml")
        out.append(TensorSpec(name=tensor.name, datatype=tensor.datatype, dims=tensor.config_dims()))
    return tuple(out)


def _with_profile(spec: TensorSpec, max_batch_size: int, given: ModelConfigFile) -> TensorSpec:
    """``spec`` with the default profile (``DefaultProfile``) when it has a dynamic axis and
    no ``profile``."""
    if spec.profile is not None or -1 not in spec.dims:
        return spec
    axes = [(d, d, d) if d != -1 else given.default_profile.axis(axis == 0 and max_batch_size > 0, max_batch_size)
            for axis, d in enumerate(spec.dims)]
    profile = {"min": [a[0] for a in axes], "opt": [a[1] for a in axes], "max": [a[2] for a in axes]}
    return TensorSpec.model_validate({**spec.model_dump(exclude_none=True), "profile": profile})


def check_against_file(config: ModelConfig, config_path: Path, signature: FileSignature) -> None:
    """Check a completed config against one model file: input names (all), output names (a
    subset), datatypes, rank, the axes the file fixes.

    Raises:
        ConfigError: the first disagreement; names ``config_path``, the field and the file.
    """
    file_inputs = {t.name: t for t in signature.inputs}
    names = [t.name for t in config.inputs]
    missing = [n for n in file_inputs if n not in names]
    unknown = [n for n in names if n not in file_inputs]
    pbtxt = config_path.name == PBTXT_FILENAME  # a Triton config: its fields named as it names them
    if missing or unknown:
        raise ConfigError(f"{config_path}: {'input' if pbtxt else 'inputs'}: {names} are not the inputs of "
                          f"{signature.path}, {list(file_inputs)} (missing {missing}, not in the file {unknown}): list "
                          "every input of the file, or leave inputs out to take them from it")
    file_outputs = {t.name: t for t in signature.outputs}
    unknown = [t.name for t in config.outputs if t.name not in file_outputs]
    if unknown:
        raise ConfigError(f"{config_path}: {'output' if pbtxt else 'outputs'}: {unknown} are not outputs of "
                          f"{signature.path}, whose outputs are {list(file_outputs)}: list some of them, or leave "
                          "outputs out to take them all")
    for kind, specs, found in (("inputs", config.inputs, file_inputs), ("outputs", config.outputs, file_outputs)):
        for index, spec in enumerate(specs):
            _check_tensor(spec, found[spec.name], config_path, _ConfigField(pbtxt, kind, index, config.max_batch_size),
                          f"{signature.path} has {kind[:-1]} '{spec.name}'")


@dataclass(frozen=True)
class _ConfigField:
    """A tensor of a config as its file names it: ``inputs.0.dims: [-1, 9]`` in a config.yaml,
    ``input[0].dims: [9]`` in Triton's config.pbtxt (``pbtxt``), whose dims leave out the batch
    axis of a batched model and whose datatypes are ``data_type: TYPE_FP32``."""
    pbtxt: bool
    kind: str
    index: int
    max_batch_size: int

    def __call__(self, key: str, value: Any) -> str:
        if not self.pbtxt:
            return f"{self.kind}.{self.index}.{key}: {value}"
        if key == "datatype":
            return f"{self.kind[:-1]}[{self.index}].data_type: {TRITON_TYPES.get(value, value)}"
        return f"{self.kind[:-1]}[{self.index}].{key}: {value[1:] if self.max_batch_size > 0 else value}"

    def with_batch_axis(self) -> str:
        """What to say after a rank counted with a batch axis that the file's dims leave out."""
        return " with the batch axis" if self.pbtxt and self.max_batch_size > 0 else ""


def _check_tensor(spec: TensorSpec, tensor: FileTensor, config_path: Path, field: _ConfigField, file: str) -> None:
    """One config tensor (``field``: how ``config_path`` names it) against the file's tensor of
    that name (``file``: says which): its ``reshape`` where it has one (the model's shape),
    else its ``dims``.

    Raises:
        ConfigError: another datatype, rank or fixed axis.
    """
    if spec.datatype != tensor.datatype:
        raise ConfigError(f"{config_path}: {field('datatype', spec.datatype)}, but {file} as {tensor.datatype}: the "
                          "datatype must be the file's")
    if tensor.dims is None:
        return  # the file gives no shape: the config's dims stand
    shown = tensor.shown()
    dims, key = (spec.dims, "dims") if spec.reshape is None else (spec.reshape, "reshape")
    if len(dims) != len(tensor.dims):
        raise ConfigError(f"{config_path}: {field(key, list(dims))} has rank {len(dims)}{field.with_batch_axis()}, "
                          f"but {file} with rank {len(tensor.dims)} (dims {shown}): the rank must be the file's")
    for axis, (want, have) in enumerate(zip(dims, tensor.dims)):
        if isinstance(have, int) and want != have:
            raise ConfigError(f"{config_path}: {field(key, list(dims))}, but {file} with axis {axis} fixed to {have} "
                              f"(dims {shown}): a config may fix a dynamic axis to a size, not change a fixed one")


def completed_fields(given: ModelConfigFile, config: ModelConfig) -> dict[str, Any]:
    """What completion put into ``config`` that ``given`` (its ``config.yaml``) left out: field
    path (``max_batch_size``, ``inputs``, ``outputs``, ``inputs.<i>.profile``) -> value, as
    YAML would hold it; empty when the config said it all."""
    out: dict[str, Any] = {}
    if given.max_batch_size is None:
        out["max_batch_size"] = config.max_batch_size
    for kind in ("inputs", "outputs"):
        if getattr(given, kind) is None:
            out[kind] = [t.model_dump(mode="json", exclude_none=True) for t in getattr(config, kind)]
    for index, (said, spec) in enumerate(zip(given.inputs or (), config.inputs)):
        if said.profile is None and spec.profile is not None:
            out[f"inputs.{index}.profile"] = spec.profile.model_dump(mode="json")
    return out
