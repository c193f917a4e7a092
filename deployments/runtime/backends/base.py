"""The engine contract every backend fills.

An ``Engine`` is the loaded, read-only model (TensorRT: ``ICudaEngine``; ONNX Runtime: an
``InferenceSession``). An ``ExecutionContext`` is the unit of concurrency: one request at a
time each; ``ModelHost`` pools them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol

import numpy as np



# Backends whose footprints are GPU bytes, measured by the backend itself when it loads.
GPU_BACKENDS = frozenset({"tensorrt", "onnxruntime_cuda"})


@dataclass(frozen=True)
class Footprint:
    """Memory a loaded model holds, in bytes.

    ``engine_bytes``: weights/plan; ``context_bytes``: per execution context (activations,
    I/O buffers); ``measured``: True when taken from the backend or a memory delta, False when
    predicted; ``device``: where the bytes live, ``host`` (RAM: ONNX Runtime on CPU) or ``gpu``
    (device memory: TensorRT, ONNX Runtime's CUDA provider).
    """

    engine_bytes: int
    context_bytes: int
    measured: bool = True
    device: str = "host"

    def total(self, instances: int) -> int:
        return self.engine_bytes + instances * self.context_bytes


class ExecutionContext(Protocol):
    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one request. Inputs are validated already; returns every output by name.

        A context of an engine with ``device_io = True`` (``contract.device.takes_device_io``)
        also takes ``infer(inputs, targets)``: ``DeviceTensor`` inputs and the ``DeviceOutput``
        targets by output name, those outputs answered as ``DeviceTensor``.

        Raises:
            InferenceError: the backend reported a failure.
        """

    def close(self) -> None: ...


class Engine(Protocol):
    backend: str

    def create_context(self) -> ExecutionContext: ...

    def footprint(self) -> Footprint: ...

    def check_health(self) -> None:
        """Raise ``EngineFault`` when the engine or its device can no longer run anything (a
        sticky CUDA error); cheap enough for Ray's periodic health check."""

    def close(self) -> None:
        """Release the engine; every context must be closed first."""
