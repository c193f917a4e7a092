"""ONNX Runtime on a CUDA GPU (``backend: onnxruntime_cuda``): the CUDA execution provider of the
``onnxruntime-gpu`` wheel, for GPUs where no TensorRT runtime can run (e.g. the H200 here:
TensorRT-RTX refuses compute capability 9.0 and full TensorRT is not installed).

Each execution context owns:

* an ``InferenceSession`` with the CUDA execution provider on the context's OWN CUDA stream
  (provider option ``user_compute_stream``; ``cuda.Stream``), so contexts of one replica run
  concurrently on the GPU. The weights are therefore held once per context (ResNet-18: 47 MB);
* an ``IOBinding`` with device buffers (``cuda.DeviceBuffer``, cudaMalloc) for every input, and
  for every output whose non-batch dims are fixed, sized at the max profile when the context is
  made and reused by every request: one host -> device copy per input and one device -> host
  copy per output per request, on the context's stream. Outputs with dynamic non-batch dims
  (``ocr_det``'s map, ``ocr_rec``'s sequence) are allocated by ONNX Runtime from the context's
  arena for each run and copied back once;
* a capped CUDA arena (``gpu_mem_limit`` = ``onnxruntime_cuda.gpu_mem_limit_mib`` of the model's
  config, ``arena_extend_strategy: kSameAsRequested``), warmed by one run at the max profile
  when the context is made, so later requests find their memory there and the footprint is
  bounded by the profile, not by the request history. A profile whose run needs more than the
  cap fails at load (``DeviceOutOfMemory``, 503, naming the cap).

CUDA graphs (``onnxruntime_cuda.cuda_graphs``, default on): the session is made with ONNX Runtime's
``enable_cuda_graph``, and the context captures one graph per batch size of ``graph_batches`` (1 and
the preferred sizes) when it is made, inside the footprint measurement, then runs the max profile
once without a graph to size the arena. Every later run of a captured shape replays its graph as one
launch (``gpu_graph_id``); any other run, and tensors in CUDA shared memory, run without
(``NO_GRAPH``), and nothing is captured after the load, so the graphs' memory is part of the
measured footprint.
ONNX Runtime keeps graphs per calling thread: a context with graphs runs every call on a thread of
its own (``ContextThread``), which it stops when it closes. The capture runs in CUDA's global mode:
every thread that touches CUDA here relaxes its capture mode (``cuda.relax_capture_mode``). A model
whose inputs have dynamic axes besides the batch axis, whose outputs' shapes only the run tells,
that ONNX Runtime refuses graphs for, or whose capture fails, runs without (``graphs_reason``).

CUDA shared memory (Triton's extension, ``contract.device``): an input in a client's CUDA region
(``DeviceTensor``) is bound where it lies instead of the context's buffer, and an output asked into
one is bound there (or, for an output whose shape only the run tells, copied there from the arena
on the GPU): no host copy either way. The region is opened in this process once
(``cuda_ipc.IpcOpenings``), on the model's device.

Precision: ``onnxruntime_cuda.use_tf32`` (default true, ONNX Runtime's own default) lets cuDNN
and cuBLAS use TF32 tensor cores for FP32 convolutions and matrix products; false keeps full
FP32. Tolerances against the CPU provider, measured on the H200: ``TOLERANCE`` below and
docs/performance.md, "Accuracy against the CPU provider".

Footprint (``footprint()``): GPU bytes, ``device="gpu"``. ``context_bytes`` is the largest
per-process GPU growth (``gpu_memory.process_gpu_bytes``: NVML's figure for this pid) across
making and warming one context: session, weights, cuDNN/cuBLAS handles and workspaces, arena at
the max profile, I/O buffers. ``engine_bytes`` is 0: nothing is shared between contexts on the
GPU. The CUDA context and the provider's libraries (a one-time cost per process, about 0.5 GB)
are loaded by ``prime()`` before the first model is measured and are counted by nobody.

ONNX Runtime's TensorRT execution provider (same wheel) is not offered: it needs the TensorRT
libraries (``libnvinfer``), which no machine here has; where they exist, this project's own
TensorRT backend (``backend: tensorrt``) serves plans instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import onnxruntime as ort
import onnx
from onnx import helper

from ..contract.config import ModelConfig
from ..contract.datatypes import NUMPY_BY_DATATYPE
from ..contract.device import DeviceOutput, DeviceTensor
from ..contract.errors import (ConfigError, DeviceOutOfMemory, EngineFault, InferenceError, InvalidInput, LoadFault,
                               ServingError)
from ..contract.repository import MODEL_FILENAME
from ..contract.shapes import max_profile_shapes
from ..contract.units import mib_to_bytes
from . import cuda
from .base import Footprint
from .context_thread import ContextThread
from . import gpu_memory
from .gpu_memory import process_gpu_bytes
from .onnxruntime import check_signature, out_of_memory, run_error, session_options

logger = logging.getLogger(__name__)

PROVIDER = "CUDAExecutionProvider"

# |GPU - CPU provider| <= TOLERANCE x max(1, |CPU output|). Measured on the H200 (docs/performance.md,
# "Accuracy against the CPU provider"): TF32 up to 4.2e-3 (ocr_rec), FP32 up to 1.9e-6 (resnet18).
TOLERANCE = {True: 1e-2, False: 1e-4}  # use_tf32 -> tolerance

_PRIME_LOCK = threading.Lock()
_PRIMED = False

# CUDA graphs per context (``onnxruntime_cuda.cuda_graphs``): one per batch size of ``graph_batches``,
# captured at load; any other shape runs without one. Graph ids start at 1: ONNX Runtime replays
# id 0 for a run that names none, so every run of a graph session names its id, -1 for none.
MAX_GRAPHS = 16
# "1" / "0": every model of this process with / without graphs, whatever its config says.
CUDA_GRAPHS_ENV = "TRT_SERVE_CUDA_GRAPHS"
NO_GRAPH = -1
# ONNX Runtime captures a graph id at its third run (the first ones allocate what the capture
# keeps): each shape of ``graph_batches`` runs this often when the context is made.
GRAPH_WARM_RUNS = 3

# How this process's threads wait for the GPU (``cuda.WAIT_MODES``), set once by ``prime``.
CUDA_WAIT_ENV = "TRT_SERVE_CUDA_WAIT"
DEFAULT_CUDA_WAIT = "auto"


def cuda_wait_mode() -> str:
    """The wait mode ``TRT_SERVE_CUDA_WAIT`` asks for (default ``DEFAULT_CUDA_WAIT``).

    Raises:
        ConfigError: not one of ``cuda.WAIT_MODES``.
    """
    mode = os.environ.get(CUDA_WAIT_ENV, "").strip() or DEFAULT_CUDA_WAIT
    if mode not in cuda.WAIT_MODES:
        raise ConfigError(f"{CUDA_WAIT_ENV}={mode!r} is not a CUDA wait mode; allowed: {sorted(cuda.WAIT_MODES)}")
    return mode


def unavailable_reason(device_id: int = 0) -> str | None:
    """Why the CUDA execution provider cannot run here, or None when it can: the installed
    ``onnxruntime`` lists ``CUDAExecutionProvider`` (the ``onnxruntime-gpu`` build) AND a CUDA
    device ``device_id`` is visible to this process (``CUDA_VISIBLE_DEVICES``, as Ray sets it)."""
    providers = ort.get_available_providers()
    if PROVIDER not in providers:
        return (f"onnxruntime {ort.__version__} has no {PROVIDER} (providers: {', '.join(providers)}); "
                "install onnxruntime-gpu instead of onnxruntime (make serve GPU=1)")
    try:
        cuda._runtime()
    except cuda.CudaError:
        return "cuda-python is not installed (pip install cuda-bindings; the gpu extra has it)"
    count = cuda.device_count()
    if count <= device_id:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return (f"no CUDA device {device_id} visible ({count} visible"
                + (f", CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "") + ")")
    return None


def describe_device(device_id: int = 0) -> str:
    """``"NVIDIA H200 (compute capability 9.0), onnxruntime-gpu 1.31.1"`` for logs and reasons."""
    major, minor = cuda.compute_capability(device_id)
    return f"{cuda.device_name(device_id)} (compute capability {major}.{minor}), onnxruntime {ort.__version__}"


def prime() -> None:
    """Once per process: load the CUDA libraries the provider needs (``preload_dlls``: cuDNN,
    cuBLAS, the CUDA runtime from the pip ``nvidia-*`` packages where present), then run a one-Conv
    graph on the provider and drop it, so that the CUDA context and library modules exist before
    any model's footprint is measured. First of all, before the context exists, it sets how
    the process's threads wait for the GPU (``cuda_wait_mode``).

    Raises:
        ConfigError: ``TRT_SERVE_CUDA_WAIT`` is not a wait mode.
    """
    global _PRIMED
    with _PRIME_LOCK:
        if _PRIMED:
            return
        mode = cuda_wait_mode()
        try:
            cuda.set_wait(mode)
        except cuda.CudaError as e:  # e.g. something else in the process made the context first
            logger.warning("CUDA wait mode '%s' not set (%s): the driver's default stands", mode, e)
        preload = getattr(ort, "preload_dlls", None)
        if preload is not None:
            try:
                preload()
            except Exception as e:  # libraries found by the system loader instead
                logger.debug("onnxruntime.preload_dlls: %s", e)
        x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 1, 8, 8])
        y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)
        w = helper.make_tensor("w", onnx.TensorProto.FLOAT, [1, 1, 3, 3], [1.0] * 9)
        graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["c"]),
                                   helper.make_node("MatMul", ["c", "c"], ["y"])], "prime", [x], [y], [w])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        session = ort.InferenceSession(model.SerializeToString(), providers=[PROVIDER])
        session.run(None, {"x": np.ones((1, 1, 8, 8), np.float32)})
        del session
        gpu_memory.baseline = process_gpu_bytes()
        logger.info("CUDA provider primed: this process holds %s GPU bytes before any model (%s)",
                    gpu_memory.baseline.bytes, gpu_memory.baseline.source)
        _PRIMED = True


def graphs_wanted(config: ModelConfig) -> tuple[bool, str]:
    """Whether the model's contexts should capture CUDA graphs, and if not, why:
    ``onnxruntime_cuda.cuda_graphs``, unless ``TRT_SERVE_CUDA_GRAPHS`` (1 or 0) says otherwise.

    Raises:
        ConfigError: ``TRT_SERVE_CUDA_GRAPHS`` is neither 1 nor 0.
    """
    forced = os.environ.get(CUDA_GRAPHS_ENV, "").strip()
    if forced not in ("", "0", "1"):
        raise ConfigError(f"{CUDA_GRAPHS_ENV}={forced!r} is neither 1 (graphs for every model) nor 0 (none)")
    if forced:
        return forced == "1", f"off ({CUDA_GRAPHS_ENV}=0)"
    return config.onnxruntime_cuda.cuda_graphs, "off (onnxruntime_cuda.cuda_graphs: false)"


def graphs_refused(config: ModelConfig) -> str | None:
    """Why the model's shapes cannot be captured at load, or None: an input with a dynamic axis
    besides the batch axis (its shapes are not known before the requests come), or an output
    whose shape only the run tells (a graph writes a buffer fixed at capture)."""
    for spec in config.inputs:
        lo, hi = spec.bounds()
        axes = range(1 if config.max_batch_size else 0, len(spec.dims))
        if any(lo[a] != hi[a] for a in axes):
            return (f"off: input '{spec.name}' has a dynamic axis besides the batch axis (graphs are captured "
                    "at load, for fixed shapes)")
    for spec in config.outputs:
        dims = spec.dims[1:] if config.max_batch_size else spec.dims
        if any(d == -1 for d in dims):
            return "off: an output's shape is only known after the run"
    return None


def graph_batches(config: ModelConfig) -> tuple[int | None, ...]:
    """The batch sizes a context captures a graph for at load: 1 and, with dynamic batching on,
    the preferred sizes (what a padded batch runs at), at most ``MAX_GRAPHS``; ``(None,)`` for a
    model without a batch axis (its one shape). Each graph keeps the activation memory of its
    size (measured on the H200: docs/performance.md, "CUDA graphs"), so every size up to the
    max batch would cost about twice the max profile's run: other sizes run without a graph."""
    if not config.max_batch_size:
        return (None,)
    sizes = {1}
    batching = config.dynamic_batching
    if batching is not None and batching.enabled:
        sizes |= set(batching.preferred_batch_size)
    return tuple(sorted(sizes))[:MAX_GRAPHS]


def footprint_options(config: ModelConfig) -> dict[str, Any]:
    """What besides the model file shapes a context's measured footprint here: the provider
    options of ``onnxruntime_cuda`` (the arena cap, cuDNN's workspace) and the batch sizes whose
    CUDA graphs the context captures at load (None: no graphs). A footprint measured under other
    options does not stand for this one (``residency.footprints``)."""
    wanted, _ = graphs_wanted(config)
    captured = list(graph_batches(config)) if wanted and graphs_refused(config) is None else None
    return {"onnxruntime_cuda": config.onnxruntime_cuda.model_dump(mode="json", exclude={"cuda_graphs", "device_id"}),
            "graph_batches": captured}


def graph_run(graph: int) -> ort.RunOptions:
    """RunOptions naming CUDA graph ``graph`` (``NO_GRAPH``: run without one)."""
    options = ort.RunOptions()
    options.add_run_config_entry("gpu_graph_id", str(graph))
    return options


class _HostArray:
    """A numpy array's address where ``cuda.CudaMemory`` copies take a host buffer (pageable
    memory: the driver stages it; one copy from the caller's point of view)."""

    def __init__(self, array: np.ndarray) -> None:
        self.ptr = array.ctypes.data


class OnnxRuntimeCudaContext:
    """One execution slot: its own session, stream, binding and device buffers (module docstring).

    Raises:
        DeviceOutOfMemory: at creation, the session or the warm-up run at the max profile ran
            out of device memory (e.g. over ``gpu_mem_limit_mib``); names the cap (503).
        LoadFault: at creation, the provider did not come up, or the session or the warm-up run
            failed otherwise (500); a warm-up run the model refuses (its zeros are not valid
            input for it: ``InferenceError``, ``InvalidInput``) is logged and skipped.
        CudaError: a CUDA call failed (stream, allocation, copy).
    """

    def __init__(self, engine: "OnnxRuntimeCudaEngine") -> None:
        self._engine = engine
        config = engine.config
        memory = engine.memory
        self.stream = memory.stream()
        self.session: ort.InferenceSession | None = None
        self._inputs: dict[str, cuda.DeviceBuffer] = {}
        self._outputs: dict[str, cuda.DeviceBuffer] = {}
        # Input shapes -> the RunOptions naming their graph id (``_run_options``); empty while
        # the session has no graphs (``graphs`` False).
        self._graph_runs: dict[tuple, ort.RunOptions] = {}
        self._no_graph = graph_run(NO_GRAPH)
        self._capturing = False  # a shape's first runs capture its graph: only while the context is made
        self._sizing = False  # the arena's sizing run at load: no graph
        self.thread: ContextThread | None = None  # where every run goes while the session has graphs
        self.graphs = False
        self.graph_batches: frozenset[int | None] = frozenset()  # the batch sizes replayed as graphs
        try:
            wanted, self.graphs_reason = graphs_wanted(config)
            refused = graphs_refused(config) if wanted else None
            if refused:
                wanted, self.graphs_reason = False, refused
                logger.info("model '%s': CUDA graphs %s", config.name, self.graphs_reason)
            if wanted:
                self.thread = ContextThread(f"ort-cuda-{config.name}")
            self._open_session(wanted)
            max_shapes = max_profile_shapes(config)
            for spec in config.inputs:
                buf = self._inputs[spec.name] = memory.device_buffer()
                buf.ensure(int(np.prod(max_shapes[spec.name])) * NUMPY_BY_DATATYPE[spec.datatype].itemsize)
            for spec in config.outputs:
                shape = self._static_output_shape(spec.name, batch_of_max(config))
                if shape is not None:
                    buf = self._outputs[spec.name] = memory.device_buffer()
                    buf.ensure(int(np.prod(shape)) * NUMPY_BY_DATATYPE[spec.datatype].itemsize)
            if self.graphs:
                try:
                    self._capture(graph_batches(config))
                except ServingError as e:  # the capture failed: the same session cannot be trusted
                    if isinstance(e, DeviceOutOfMemory):
                        raise
                    self.graphs_reason = f"off: ONNX Runtime could not capture the model ({e.message[-200:]})"
                    logger.warning("model '%s': CUDA graphs %s; it runs without", config.name, self.graphs_reason)
                    self._stop_thread()
                    self._open_session(False)
            if not self.graphs:
                self._stop_thread(release=False)  # the session without graphs runs in its callers' threads
            self._sizing = True  # the max profile's run without a graph: the arena then holds any uncaptured run
            try:
                self._warm_up(max_shapes)
            finally:
                self._sizing = False
        except BaseException:
            self.close()
            raise

    def _capture(self, batches: tuple[int | None, ...]) -> None:
        """Capture a graph per batch size in ``batches``, each shape run ``GRAPH_WARM_RUNS``
        times on the context's thread."""
        config = self._engine.config
        self._capturing = True
        try:
            for batch in batches:
                for _ in range(GRAPH_WARM_RUNS):
                    self._warm_up(max_profile_shapes(config, batch), strict=True)
        finally:
            self._capturing = False
        self.graph_batches = frozenset(batches)

    def _open_session(self, graphs: bool) -> None:
        """(Re)create the session, with CUDA graphs where ``graphs`` and ONNX Runtime takes them
        (it refuses a model with a node on the CPU: then without, ``graphs_reason`` says why)."""
        engine, config = self._engine, self._engine.config
        self.session, self._graph_runs, self.graphs, self.graph_batches = None, {}, False, frozenset()
        options = engine.provider_options(self.stream.handle)

        def make(with_graphs: bool) -> ort.InferenceSession:
            return ort.InferenceSession(
                str(engine.model_path), sess_options=session_options(intra_op_threads=1),
                providers=[(PROVIDER, {**options, "enable_cuda_graph": "1" if with_graphs else "0"}),
                           "CPUExecutionProvider"])

        try:
            try:
                session = make(graphs)
            except Exception as e:
                if not graphs or out_of_memory(e):
                    raise
                self.graphs_reason = f"off: ONNX Runtime refused them ({str(e)[-200:]})"
                logger.info("model '%s': CUDA graphs %s", config.name, self.graphs_reason)
                graphs = False
                session = make(False)
        except Exception as e:  # e.g. the weights alone over the arena cap (BFCArena refuses)
            fault = DeviceOutOfMemory if out_of_memory(e) else LoadFault
            raise fault(
                f"model '{config.name}': ONNX Runtime could not create a {PROVIDER} session with "
                f"gpu_mem_limit_mib {config.onnxruntime_cuda.gpu_mem_limit_mib} ({str(e)[-200:]})") from e
        if PROVIDER not in session.get_providers():
            raise LoadFault(f"model '{config.name}': ONNX Runtime did not start {PROVIDER} "
                            f"(session providers: {session.get_providers()}); see its log")
        check_signature(config, session)
        self.session, self.binding, self.graphs = session, session.io_binding(), graphs
        if graphs:
            self.graphs_reason = "on"

    def _run_options(self, inputs: Mapping[str, Any], targets: Mapping[str, DeviceOutput]) -> ort.RunOptions | None:
        """The run's options: None without graphs; else the graph id of these input shapes (a
        new one while the context is being made: ``_capture``), or ``NO_GRAPH`` for a run whose
        tensors do not lie in this context's own buffers (CUDA shared memory) or a shape without
        a graph."""
        if not self.graphs:
            return None
        if self._sizing or targets or any(isinstance(v, DeviceTensor) for v in inputs.values()):
            return self._no_graph
        key = tuple((name, value.shape) for name, value in inputs.items())
        options = self._graph_runs.get(key)
        if options is None:
            if not self._capturing:  # ``graph_batches`` holds at most ``MAX_GRAPHS`` sizes
                return self._no_graph
            options = self._graph_runs[key] = graph_run(len(self._graph_runs) + 1)
        return options

    def _static_output_shape(self, name: str, batch: int | None) -> tuple[int, ...] | None:
        """The output's shape when only its batch axis is dynamic (``batch`` rows), else None."""
        config = self._engine.config
        dims = list(next(t for t in config.outputs if t.name == name).dims)
        if config.max_batch_size and dims and dims[0] == -1:
            if batch is None:
                return None
            dims[0] = batch
        return tuple(dims) if all(d > 0 for d in dims) else None

    def _warm_up(self, max_shapes: Mapping[str, tuple[int, ...]], strict: bool = False) -> None:
        """One run on zeros at the max profile. ``strict``: any failure but running out of
        memory is raised as it came (the caller drops the graphs)."""
        config = self._engine.config
        feeds = {n: np.zeros(s, NUMPY_BY_DATATYPE[config.input(n).datatype]) for n, s in max_shapes.items()}
        try:
            self.infer(feeds)
        except ServingError as e:
            short = isinstance(e, DeviceOutOfMemory) or out_of_memory(e.__cause__ or e)
            if strict and not short:
                raise
            if not short and isinstance(e, (InferenceError, InvalidInput)) and not isinstance(e, EngineFault):
                # The model refused the server's own zeros (an integer Div by zero, a Reshape the
                # max batch does not divide): not a fault of the load; the arena grows at the
                # first request instead.
                logger.warning("model '%s': the warm-up run on zeros at the max profile %s failed (%s); loaded "
                               "without it: the first request of that size grows the arena", config.name,
                               dict(max_shapes), e.message)
                return
            fault = DeviceOutOfMemory if short else LoadFault
            raise fault(
                f"model '{config.name}': a run at the max profile {dict(max_shapes)} failed on "
                f"{PROVIDER} with gpu_mem_limit_mib {config.onnxruntime_cuda.gpu_mem_limit_mib} "
                f"({e.__cause__ or e}); raise onnxruntime_cuda.gpu_mem_limit_mib or lower the profile") from e

    def infer(self, inputs: Mapping[str, Any], targets: Mapping[str, DeviceOutput] | None = None) -> dict[str, Any]:
        """Run one request (on the context's own thread where it has graphs); returns every
        output by name. An input in CUDA shared memory
        (``DeviceTensor``) is bound where it lies, and an output with a target (``targets``:
        output name -> ``DeviceOutput``) is written there: bound as the run's output when its
        shape is known before the run, else copied there on the GPU from ONNX Runtime's; it is
        answered as a ``DeviceTensor``. No host copy for either.

        Raises:
            SharedMemoryError: an output does not fit its target (Triton's words), or a region
                does not open on this GPU (400).
            InferenceError: ONNX Runtime failed (``run_error``). CudaError: a CUDA call failed.
        """
        thread = self.thread
        if thread is not None:
            return thread.call(self._run, inputs, targets)
        return self._run(inputs, targets)

    def _run(self, inputs: Mapping[str, Any], targets: Mapping[str, DeviceOutput] | None) -> dict[str, Any]:
        engine = self._engine
        memory, device, binding = engine.memory, engine.device_id, self.binding
        assert self.session is not None, "context used after close()"
        cuda.relax_capture_mode()  # ONNX Runtime's own calls in this thread too (``cuda.relax_capture_mode``)
        targets = targets or {}
        batch = None
        run_options = self._run_options(inputs, targets)
        with contextlib.ExitStack() as held:  # the CUDA regions stay open until the outputs are read
            try:
                for name, value in inputs.items():
                    if batch is None and value.ndim:
                        batch = int(value.shape[0])
                    if isinstance(value, DeviceTensor):
                        base = held.enter_context(value.lease(device))
                        binding.bind_input(name, engine.device_type, device, value.dtype.type, list(value.shape),
                                           base + value.offset)
                        continue
                    array = np.asarray(value, order="C")  # rank 0 stays rank 0
                    buf = self._inputs[name]
                    if buf.ensure(array.nbytes) and self.graphs:  # grow-only; inputs are validated against the profile
                        self._graphs_moved()
                        run_options = self._no_graph
                    if array.nbytes:
                        memory.copy_to_device(buf, _HostArray(array), array.nbytes, self.stream)
                    binding.bind_input(name, engine.device_type, device, array.dtype.type, list(array.shape), buf.ptr)
                shapes: dict[str, tuple[int, ...]] = {}
                for spec in engine.config.outputs:
                    shape = self._static_output_shape(spec.name, batch) if spec.name in self._outputs else None
                    if shape is None:
                        binding.bind_output(spec.name, engine.device_type, device)  # ORT allocates from the arena
                        continue
                    dtype = NUMPY_BY_DATATYPE[spec.datatype]
                    target = targets.get(spec.name)
                    if target is not None:
                        target.check_fits(shape, dtype)
                        ptr = held.enter_context(target.lease(device)) + target.offset
                    else:
                        buf = self._outputs[spec.name]
                        if buf.ensure(int(np.prod(shape)) * dtype.itemsize) and self.graphs:
                            self._graphs_moved()
                            run_options = self._no_graph
                        ptr = buf.ptr
                    binding.bind_output(spec.name, engine.device_type, device, dtype.type, list(shape), ptr)
                    shapes[spec.name] = shape
                self.session.run_with_iobinding(binding, run_options)  # returns once the stream is synchronized
                results: dict[str, Any] = {}
                values = binding.get_outputs()  # held until the stream is synchronized
                for spec, value in zip(engine.config.outputs, values):
                    dtype = NUMPY_BY_DATATYPE[spec.datatype]
                    target = targets.get(spec.name)
                    if target is not None and spec.name in shapes:  # ONNX Runtime wrote it there
                        results[spec.name] = target.written(shapes[spec.name], dtype)
                    elif target is not None:  # its shape came with the run: one copy on the GPU
                        shape = tuple(value.shape())
                        nbytes = target.check_fits(shape, dtype)
                        ptr = held.enter_context(target.lease(device)) + target.offset
                        if nbytes:
                            memory.copy_on_device(ptr, value.data_ptr(), nbytes, self.stream)
                        results[spec.name] = target.written(shape, dtype)
                    elif spec.name in shapes:
                        out = np.empty(shapes[spec.name], dtype)
                        if out.nbytes:
                            memory.copy_to_host(_HostArray(out), self._outputs[spec.name], out.nbytes, self.stream)
                        results[spec.name] = out
                    else:
                        results[spec.name] = value.numpy()  # one device -> host copy
                self.stream.synchronize()
            except (cuda.CudaError, ServingError):
                raise
            except Exception as e:  # ORT raises its own types for shape/runtime/memory faults
                raise run_error(engine.config.name, e) from e
            finally:
                binding.clear_binding_inputs()
                binding.clear_binding_outputs()
        return results

    def _graphs_moved(self) -> None:
        """A buffer the captured graphs write or read was reallocated (a tensor over the max
        profile): their addresses are gone, so every later run goes without a graph."""
        self._graph_runs, self._capturing, self.graph_batches = {}, False, frozenset()
        self.graphs_reason = "off: an I/O buffer was reallocated after the graphs were captured"
        logger.warning("model '%s': CUDA graphs %s", self._engine.config.name, self.graphs_reason)

    def _release(self) -> None:
        self.session = None
        self.binding = None  # type: ignore[assignment]

    def _stop_thread(self, release: bool = True) -> None:
        """End the context's thread (ONNX Runtime's state for the thread, graphs included, with
        it), the session freed there first where ``release``."""
        thread, self.thread = self.thread, None
        if thread is not None:
            if release:
                thread.call(self._release)
            thread.stop()

    def close(self) -> None:
        """Free the session (its arena and graphs), the context's thread, the buffers and the
        stream; idempotent."""
        self._stop_thread()
        self._release()
        for buf in (*self._inputs.values(), *self._outputs.values()):
            buf.close()
        self._inputs, self._outputs = {}, {}
        if self.stream is not None:
            self.stream.synchronize()
            self.stream.close()
            self.stream = None  # type: ignore[assignment]


def batch_of_max(config: ModelConfig) -> int | None:
    return config.max_batch_size or None


class OnnxRuntimeCudaEngine:
    """``model.onnx`` on ONNX Runtime's CUDA execution provider; each context its own session.

    Args:
        config: the model's contract; ``config.onnxruntime_cuda`` holds the provider options.
        model_dir: the version folder holding ``model.onnx``.
        memory: CUDA streams/buffers/copies (``cuda.CudaMemory``).

    Raises:
        ConfigError: the provider cannot run here (``unavailable_reason``).
    """

    backend = "onnxruntime_cuda"
    device_type = "cuda"  # IOBinding's device name for the buffers
    device_io = True  # its contexts take inputs and outputs in CUDA shared memory (``contract.device``)

    def __init__(self, config: ModelConfig, model_dir: Path, memory: cuda.CudaMemory | None = None) -> None:
        self.config = config
        self.device_id = config.onnxruntime_cuda.device_id
        reason = unavailable_reason(self.device_id)
        if reason:
            raise ConfigError(f"model '{config.name}': backend 'onnxruntime_cuda' cannot run: {reason}")
        self.model_path = Path(model_dir) / MODEL_FILENAME
        self.memory = memory or cuda.CudaMemory()
        prime()
        self._lock = threading.Lock()
        self._context_bytes: list[int] = []
        self.gpu_source = ""

    def provider_options(self, stream_handle: int) -> dict[str, str]:
        """The CUDA provider options of one context's session (values as strings)."""
        opts = self.config.onnxruntime_cuda
        return {
            "device_id": str(self.device_id),
            "user_compute_stream": str(stream_handle),
            "has_user_compute_stream": "1",
            "gpu_mem_limit": str(mib_to_bytes(opts.gpu_mem_limit_mib)),
            "arena_extend_strategy": "kSameAsRequested",
            "cudnn_conv_algo_search": opts.cudnn_conv_algo_search,
            "use_tf32": "1" if opts.use_tf32 else "0",
            "cudnn_conv_use_max_workspace": "1" if opts.cudnn_conv_use_max_workspace else "0",
        }

    def create_context(self) -> OnnxRuntimeCudaContext:
        """Make and warm one context, measuring this process's GPU growth across it."""
        cuda.relax_capture_mode()
        with self._lock:  # one at a time, so each delta is one context's
            before = process_gpu_bytes()
            context = OnnxRuntimeCudaContext(self)
            after = process_gpu_bytes()
            self._context_bytes.append(max(0, after.bytes - before.bytes))
            self.gpu_source = after.source
        return context

    def footprint(self) -> Footprint:
        return Footprint(engine_bytes=0, context_bytes=max(self._context_bytes, default=0),
                         measured=bool(self._context_bytes), device="gpu")

    def check_health(self) -> None:
        """Probe the device (``cuda.check_device``), as the TensorRT engine does.

        Raises:
            EngineFault: the CUDA device is unusable (a sticky error); the process must restart.
        """
        cuda.check_device(self.memory, f"model '{self.config.name}'")

    def close(self) -> None:
        pass
