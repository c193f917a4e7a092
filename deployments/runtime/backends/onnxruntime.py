"""ONNX Runtime backend (CPU): the default on machines without a CUDA GPU; ``check_signature``
and ``session_options`` serve the CUDA backend (``onnxruntime_cuda``) too."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import numpy as np
import onnxruntime as ort

from ..contract.config import ModelConfig
from ..contract.datatypes import ONNX_TYPE_BY_DATATYPE
from .base import Footprint
from .process import measured_rss_bytes
from ..contract.errors import ConfigError, InferenceError
from ..contract.repository import MODEL_FILENAME


def session_options(intra_op_threads: int | None = None) -> ort.SessionOptions:
    """Session options of both ONNX Runtime backends: ``intra_op_threads`` (default: the
    ``ORT_INTRA_OP_THREADS`` environment variable, 0 = one per core) and the memory pattern off
    (``OnnxRuntimeEngine``'s docstring gives the measurement)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads or int(os.environ.get("ORT_INTRA_OP_THREADS", "0"))
    options.enable_mem_pattern = False
    return options


def check_signature(config: ModelConfig, session: ort.InferenceSession) -> None:
    """Check that every input/output of ``config`` is in the session's graph with its datatype.

    Raises:
        ConfigError: a tensor is missing or has another type (names both).
    """
    where = f"model '{config.name}'"
    for kind, declared, actual in (
        ("input", config.inputs, session.get_inputs()),
        ("output", config.outputs, session.get_outputs()),
    ):
        by_name = {a.name: a for a in actual}
        for spec in declared:
            arg = by_name.get(spec.name)
            if arg is None:
                raise ConfigError(
                    f"{where}: config {kind} '{spec.name}' is not in the ONNX file; "
                    f"the file has {sorted(by_name)}")
            if arg.type != ONNX_TYPE_BY_DATATYPE[spec.datatype]:
                raise ConfigError(
                    f"{where}: {kind} '{spec.name}' is {arg.type} in the ONNX file, "
                    f"config says {spec.datatype}")


class OnnxRuntimeContext:
    """One execution slot over a shared ``InferenceSession`` (``run`` is thread-safe)."""

    def __init__(self, engine: "OnnxRuntimeEngine") -> None:
        self._engine = engine

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        session = self._engine.session
        feeds = {name: np.ascontiguousarray(a) for name, a in inputs.items()}
        try:
            values = session.run(self._engine.output_names, feeds)
        except Exception as e:  # ORT raises its own types for shape/runtime faults
            raise InferenceError(
                f"model '{self._engine.config.name}': ONNX Runtime run failed ({type(e).__name__})") from e
        return dict(zip(self._engine.output_names, values))

    def close(self) -> None:
        pass


class OnnxRuntimeEngine:
    """An ``InferenceSession`` on ``<model_dir>/model.onnx``.

    ``footprint()``: engine bytes are the process RSS delta across session creation; context
    bytes are 0 here: ``residency.footprints.load_and_measure`` measures them (the arena's growth across runs
    at the max profile; the model cache does it at a model's first load).

    The session keeps ONNX Runtime's CPU arena but turns the memory pattern off: with it, every
    distinct input shape's first repeat allocates one more block beside the first run's
    allocations, which doubles the memory a session keeps (tiny_cnn at batch 32: 900 MB against
    515 MB) for no measured latency gain (ResNet-18 and tiny_cnn at batch 1 and 8, p50 within 1 %).

    Raises:
        ConfigError: the ONNX file's inputs/outputs disagree with the config (names, types).
    """

    backend = "onnxruntime"

    def __init__(self, config: ModelConfig, model_dir: Path, intra_op_threads: int | None = None) -> None:
        self.config = config
        options = session_options(intra_op_threads)
        before = measured_rss_bytes()
        self.session = ort.InferenceSession(
            str(Path(model_dir) / MODEL_FILENAME), sess_options=options, providers=["CPUExecutionProvider"])
        self._engine_bytes = max(0, measured_rss_bytes() - before)
        check_signature(config, self.session)
        self.output_names = [t.name for t in config.outputs]

    def create_context(self) -> OnnxRuntimeContext:
        return OnnxRuntimeContext(self)

    def footprint(self) -> Footprint:
        return Footprint(engine_bytes=self._engine_bytes, context_bytes=0, measured=True)

    def check_health(self) -> None:
        """Nothing on the CPU can break for good the way a CUDA context does: always healthy."""

    def close(self) -> None:
        self.session = None  # type: ignore[assignment]
