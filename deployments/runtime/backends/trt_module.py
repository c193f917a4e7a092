"""Import whichever TensorRT flavour is installed: ``tensorrt`` (10.x/11.x) or ``tensorrt_rtx``.

Both expose the same Python API (Builder, OnnxParser, Runtime, ICudaEngine, IExecutionContext);
the differences this project cares about are read from the module, not assumed from its name:

- ``tensorrt_rtx`` (pip ``tensorrt-rtx-cu13``) builds on a CPU-only machine, for a set of
  target compute capabilities; its networks are strongly typed (no FP16/BF16 builder flag),
  and its timing cache is a no-op.
- ``tensorrt`` builds on the GPU it targets; TensorRT 10 still has the FP16/BF16 flags of
  weakly typed networks, which later releases drop in favour of strong typing.

A ``tensorrt`` folder that holds only type stubs (``pip install tensorrt-stubs`` makes one)
imports as an empty namespace package: it is not counted as TensorRT.
"""

from __future__ import annotations

import importlib
import itertools
import logging
import re
from collections import deque
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

from ..contract.errors import LoadFault

Flavour = Literal["tensorrt", "tensorrt_rtx"]
FlavourRequest = Literal["auto", "tensorrt", "tensorrt_rtx"]

# Preference order for ``auto``: full TensorRT serves datacenter GPUs (the H200) that
# TensorRT-RTX refuses; TensorRT-RTX is the one that installs from PyPI and builds on a CPU.
FLAVOURS: tuple[Flavour, ...] = ("tensorrt", "tensorrt_rtx")


class TensorRTUnavailable(LoadFault):
    """No usable TensorRT module for the requested flavour (HTTP 500 at load, exit 2 at build)."""


@dataclass(frozen=True)
class TensorRTModule:
    """An imported TensorRT flavour.

    Attributes:
        flavour: ``"tensorrt"`` or ``"tensorrt_rtx"``; used in plan file names.
        module: the imported module (``trt``).
        version: ``module.__version__``, e.g. ``"10.13.0.35"`` or ``"1.7.1.116"``.
    """

    flavour: Flavour
    module: ModuleType
    version: str

    @property
    def strongly_typed_only(self) -> bool:
        """True when the builder has no FP16 flag: precision follows the ONNX file's types."""
        return not hasattr(self.module.BuilderFlag, "FP16")

    @property
    def builds_without_gpu(self) -> bool:
        """True for TensorRT-RTX, whose builder targets compute capabilities without a GPU."""
        return hasattr(self.module, "ComputeCapability")

    @property
    def has_timing_cache(self) -> bool:
        """False for TensorRT-RTX, where timing-cache calls are deprecated no-ops."""
        return self.flavour == "tensorrt"

    @property
    def label(self) -> str:
        return f"{self.flavour}-{self.version}"

    def target_compute_capabilities(self) -> tuple[str, ...] | None:
        """TensorRT-RTX: the targets its ``ComputeCapability`` enum names, ascending
        (``("7.5", "8.0", ..., "12.1")``); None for full TensorRT, which targets the GPU it
        builds on."""
        enum = getattr(self.module, "ComputeCapability", None)
        if enum is None:
            return None
        ccs = []
        for name in dir(enum):
            m = re.fullmatch(r"SM(\d+)(\d)", name)
            if m:
                ccs.append((int(m.group(1)), int(m.group(2))))
        return tuple(f"{major}.{minor}" for major, minor in sorted(ccs))


def _import(flavour: Flavour) -> TensorRTModule | None:
    try:
        module = importlib.import_module(flavour)
    except ImportError:
        return None
    if not hasattr(module, "Builder") or not hasattr(module, "Runtime"):
        return None  # a stubs-only namespace package, or a broken install
    return TensorRTModule(flavour=flavour, module=module, version=str(module.__version__))


_cache: dict[Flavour, TensorRTModule | None] = {}


def load(flavour: FlavourRequest = "auto") -> TensorRTModule:
    """Import TensorRT: the named flavour, or for ``auto`` the first of ``FLAVOURS`` present.

    Raises:
        TensorRTUnavailable: the flavour (or, for ``auto``, any flavour) does not import.
    """
    wanted: tuple[Flavour, ...] = FLAVOURS if flavour == "auto" else (flavour,)
    for name in wanted:
        if name not in _cache:
            _cache[name] = _import(name)
        found = _cache[name]
        if found is not None:
            return found
    hint = ("pip install -e '.[tensorrt]' (TensorRT-RTX, module tensorrt_rtx); full TensorRT "
            "(module tensorrt) comes from NVIDIA's own package index")
    raise TensorRTUnavailable(f"no TensorRT module importable for flavour '{flavour}' "
                              f"(tried {', '.join(wanted)}); {hint}")


def available(flavour: FlavourRequest = "auto") -> bool:
    """True when ``load(flavour)`` would succeed; never raises."""
    try:
        load(flavour)
    except TensorRTUnavailable:
        return False
    return True


def runtime_available(flavour: FlavourRequest = "auto", device: int = 0) -> bool:
    """True when TensorRT imports, CUDA ``device`` is visible, and the flavour can run on it
    (TensorRT-RTX only on its target compute capabilities: it refuses an H200, 9.0). Never raises."""
    from . import cuda  # cuda-python is optional; cuda.py imports it lazily

    try:
        if cuda.device_count() <= device:  # cheap; importing TensorRT is not
            return False
        trt = load(flavour)
        major, minor = cuda.compute_capability(device)
    except (TensorRTUnavailable, cuda.CudaError):
        return False
    targets = trt.target_compute_capabilities()
    return targets is None or f"{major}.{minor}" in targets


# ILogger severities, most severe first (TensorRT's ``ILogger.Severity`` values).
SEVERITY_NAMES = ("INTERNAL_ERROR", "ERROR", "WARNING", "INFO", "VERBOSE")
_ERROR = 1
_WARNING = 2


@dataclass(frozen=True)
class LogRecord:
    """One message TensorRT logged: ``seq`` orders records, ``severity`` 0 (internal error) to 4."""

    seq: int
    severity: int
    message: str

    @property
    def is_error(self) -> bool:
        return self.severity <= _ERROR


def capturing_logger(trt: TensorRTModule, keep: int = 500) -> Any:
    """A ``trt.ILogger`` that keeps the last ``keep`` warnings and errors for error messages.

    TensorRT reports why a build, a profile or a deserialization failed only through its
    logger; the caller takes ``mark()`` before a call and ``errors_since(mark)`` after it
    returned None or False, and puts those messages into its typed error. Warnings are
    echoed to Python logging (``deployments.runtime.tensorrt``) at WARNING, everything
    else at DEBUG. Keep the logger alive as long as the Builder or Runtime it was given to.
    """
    module = trt.module
    echo = logging.getLogger("deployments.runtime.tensorrt")

    class CapturingLogger(module.ILogger):  # type: ignore[name-defined,misc,unused-ignore]
        def __init__(self) -> None:
            module.ILogger.__init__(self)
            self.records: deque[LogRecord] = deque(maxlen=keep)
            self._seq = itertools.count()

        def log(self, severity: Any, msg: str) -> None:
            level = int(severity)
            if level <= _WARNING:
                self.records.append(LogRecord(next(self._seq), level, msg))
            echo.log(logging.WARNING if level == _WARNING else logging.DEBUG,
                     "%s: %s", SEVERITY_NAMES[level] if level < len(SEVERITY_NAMES) else level, msg)

        def mark(self) -> int:
            """A position in the log; pass it to ``errors_since``."""
            return self.records[-1].seq + 1 if self.records else 0

        def errors_since(self, mark: int) -> list[str]:
            """Error messages logged at or after ``mark``, oldest first."""
            return [r.message for r in list(self.records) if r.seq >= mark and r.is_error]

    return CapturingLogger()
