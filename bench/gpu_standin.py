"""BENCHMARK ONLY: an engine that waits like a GPU and computes nothing.

``GpuStandInEngine`` mimics the cost profile of a model on a GPU, measured on the H200
(docs/lab-notes.md, "In-process engine ceiling": resnet18 0.79 ms at batch 1, 1.27 ms at batch 8):
a run waits ``base_ms + per_row_ms x rows`` (default 1.0 + 0.05 ms: batch 8 costs 1.33x batch 1)
in ``time.sleep``, which holds no CPU and releases the GIL, as a thread waiting for a CUDA
stream does. The wait is split in ``GIL_RELEASES`` (4) sleeps, as the CUDA backend's run
releases the GIL four times (``onnxruntime_cuda.OnnxRuntimeCudaContext.infer``: host-to-device
copy, ``run_with_iobinding``, device-to-host copy, stream synchronize), each time having to take
it back. Each context waits on its own (a context per CUDA stream).

Shape changes: ONNX Runtime's CUDA ``Conv`` (1.20 and later, cuDNN frontend) rebuilds its
execution plan whenever a session's input shape differs from the shape of its PREVIOUS run
(``onnxruntime/core/providers/cuda/nn/conv.cc``, ``Conv::UpdateState``: ``input_dims_changed`` ->
``CreateCudnnFeExecutionPlan``, no per-shape cache; microsoft/onnxruntime#23006, "x15 slower
after 1.19.2 -> 1.20.1 ... interleaving of input tensor resolutions"). So a context fed
alternating batch sizes pays that rebuild on every call. The stand-in waits ``switch_ms``
(``BENCH_GPU_STANDIN_SWITCH_MS``, default 30: resnet18 on the H200, docs/lab-notes.md, "In-process engine ceiling") more when
a run's input shapes differ from its context's previous run; 0 turns it off. Outputs are zeros of
the config's output shapes with the request's rows, so the serving path (batching, splitting,
encoding) does its real work. It answers nothing meaningful: it exists so that a machine
without a GPU can show what the serving path costs around a GPU-fast engine. It is never part
of the product or of the tests.

Enabled in Ray's worker processes by ``install()`` (``bench.batch_trace.install`` calls it as
Ray's ``worker_process_setup_hook``) when ``BENCH_GPU_STANDIN`` lists model names (``*``: all),
e.g. ``BENCH_GPU_STANDIN=resnet18,resnet18_batched``; those models then load this engine
whatever their backend says, with backend name ``gpu_standin``.
"""

from __future__ import annotations

import os
import time
from typing import Mapping

import numpy as np

from deployments.runtime.backends.base import Footprint
from deployments.runtime.contract.datatypes import NUMPY_BY_DATATYPE

ENV = "BENCH_GPU_STANDIN"
BASE_MS = float(os.environ.get("BENCH_GPU_STANDIN_BASE_MS", "1.0"))
PER_ROW_MS = float(os.environ.get("BENCH_GPU_STANDIN_PER_ROW_MS", "0.05"))
SWITCH_MS = float(os.environ.get("BENCH_GPU_STANDIN_SWITCH_MS", "30"))
GIL_RELEASES = 4


class GpuStandInContext:
    def __init__(self, engine: "GpuStandInEngine") -> None:
        self.engine = engine
        self.last_shapes: tuple | None = None

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows = next(iter(inputs.values())).shape[0] if self.engine.config.max_batch_size else 1
        shapes = tuple(sorted((name, value.shape) for name, value in inputs.items()))
        if self.last_shapes is not None and shapes != self.last_shapes:
            time.sleep(SWITCH_MS / 1e3)  # the plan rebuild (CPU work on a real GPU; here a wait)
        self.last_shapes = shapes
        wait_s = (BASE_MS + PER_ROW_MS * rows) / 1e3 / GIL_RELEASES
        for _ in range(GIL_RELEASES):
            time.sleep(wait_s)
        out = {}
        for spec in self.engine.config.outputs:
            dims = [rows if (i == 0 and self.engine.config.max_batch_size) else max(d, 1)
                    for i, d in enumerate(spec.dims)]
            out[spec.name] = np.zeros(dims, NUMPY_BY_DATATYPE[spec.datatype])
        return out

    def close(self) -> None:
        pass


class GpuStandInEngine:
    backend = "gpu_standin"

    def __init__(self, config) -> None:
        self.config = config

    def create_context(self) -> GpuStandInContext:
        return GpuStandInContext(self)

    def footprint(self) -> Footprint:
        return Footprint(engine_bytes=0, context_bytes=0, measured=False, device="gpu")

    def check_health(self) -> None:
        pass

    def close(self) -> None:
        pass


def install() -> None:
    """Make the models named in ``BENCH_GPU_STANDIN`` load ``GpuStandInEngine`` in this process."""
    names = {n for n in os.environ.get(ENV, "").split(",") if n}
    if not names:
        return
    from deployments.runtime.backends.select import BackendChoice
    from deployments.runtime.residency import host

    real_open = host.open_engine

    def open_engine(config, model_dir, backend="auto"):
        if "*" not in names and config.name not in names:
            return real_open(config, model_dir, backend)
        engine = GpuStandInEngine(config)
        engine.choice = BackendChoice("gpu_standin", f"bench stand-in: {BASE_MS} ms + {PER_ROW_MS} ms/row, +{SWITCH_MS} ms on a shape change, no compute")
        return engine

    host.open_engine = open_engine
