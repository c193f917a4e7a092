"""TensorRT backend (GPU): a deserialized plan and execution contexts that run it.

``TensorRTEngine(config, model_dir)`` finds the plan built for this TensorRT flavour, version
and GPU (``plans.find_plan``: a missing or stale plan is a ``PlanMismatch`` naming the reasons,
never a blind deserialization), deserializes it and checks its I/O against the config.
``create_context()`` gives a ``TensorRTContext``: its own ``IExecutionContext``, CUDA stream,
and grow-only device and pinned host buffers per tensor. One request at a time per context
(``ModelHost`` pools them); per request::

    [set_optimization_profile_async]  when the request fits a different profile
    set_input_shape, copy host -> device, set_tensor_address      (each input)
    get_tensor_shape, set_tensor_address                           (each output)
    execute_async_v3, copy device -> host, synchronize

Every TensorRT call goes through ``_trt_call``: a False return or an exception becomes
``InferenceError`` naming the call (``EngineFault`` for a refused profile switch, which no
request causes). Plan outputs the config does not declare (a plan built elsewhere) get scratch
device buffers, since TensorRT needs an address for every output; they are not returned.

The boundary to TensorRT is the ``ICudaEngine``/``IExecutionContext`` objects and to CUDA a
``cuda.MemoryApi``; ``TensorRTEngine.from_cuda_engine`` takes both, so an engine built in
process (or a stand-in) can be served without a plan file.
"""

from __future__ import annotations

import logging
import math
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from . import cuda, trt_module
from ..contract.config import ModelConfig
from ..contract.datatypes import NUMPY_BY_DATATYPE
from .base import Footprint
from ..contract.errors import ConfigError, EngineFault, InferenceError, InvalidInput
from .plans import PlanManifest, PlanMismatch, find_plan
from ..contract.repository import MODEL_FILENAME

if TYPE_CHECKING:  # type-checked against tensorrt-stubs (tests/unit/test_tensorrt_typecheck.py)
    import tensorrt as trt

logger = logging.getLogger(__name__)

# TensorRT DataType names -> KServe datatypes (BF16, FP8, INT4 have no KServe v2 equivalent).
DATATYPE_BY_TRT: dict[str, str] = {
    "FLOAT": "FP32", "HALF": "FP16", "INT8": "INT8", "INT32": "INT32", "INT64": "INT64",
    "BOOL": "BOOL", "UINT8": "UINT8",
}


def _dims(dims: Any) -> tuple[int, ...]:
    """A TensorRT ``Dims`` (or any sequence) as a tuple of ints."""
    return tuple(int(dims[i]) for i in range(len(dims)))


# Bytes per element of TensorRT DataType names, for outputs the config does not declare.
_ITEMSIZE_BY_TRT: dict[str, int] = {
    "FLOAT": 4, "HALF": 2, "BF16": 2, "INT8": 1, "INT32": 4, "INT64": 8, "BOOL": 1, "UINT8": 1,
    "FP8": 1, "INT4": 1, "FP4": 1, "E8M0": 1,
}


def _trt_call(where: str, call: str, fn: Any, *args: Any,
              error: type[InferenceError] = InferenceError) -> Any:
    """Call a TensorRT method and turn both ways it reports failure into ``error`` naming the
    call: returning False (as documented for ``set_input_shape``, ``execute_async_v3`` ...), and
    raising (the Python binding raises ``RuntimeError`` from e.g. ``set_optimization_profile_async``).
    TensorRT's own text goes to the log, not to the client."""
    try:
        result = fn(*args)
    except Exception as e:  # the binding's exceptions carry internal text: logged, not sent
        logger.error("%s: TensorRT %s raised %s: %s", where, call, type(e).__name__, e)
        raise error(f"{where}: TensorRT {call} raised {type(e).__name__} (the server log has TensorRT's message)") from None
    if result is False:
        raise error(f"{where}: TensorRT {call} returned False")
    return result


@dataclass(frozen=True)
class TensorIO:
    """One engine I/O tensor: name, numpy dtype, and for inputs the (min, max) shape per profile."""

    name: str
    dtype: np.dtype
    is_input: bool
    profiles: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = ()


class TensorRTContext:
    """An ``IExecutionContext`` with its own CUDA stream and its own buffers; not thread-safe.

    ``infer`` takes inputs already validated against the config (dtypes, ranks, profile 0
    bounds). Buffers grow to the largest request seen and are reused; results are copied out
    of the pinned buffers before ``infer`` returns.
    """

    def __init__(self, engine: "TensorRTEngine", context: "trt.IExecutionContext",
                 memory: cuda.MemoryApi, index: int) -> None:
        self._engine = engine
        self._context: trt.IExecutionContext | None = context
        self._memory = memory
        self.index = index
        self._where = f"model '{engine.config.name}' context {index}"
        self._stream: cuda.StreamLike | None = memory.stream()
        self._device: dict[str, cuda.DeviceBufferLike] = {}
        self._host: dict[str, cuda.HostBufferLike] = {}
        self._profile = 0
        self._busy = threading.Lock()

    def _buffers(self, name: str, nbytes: int) -> tuple[cuda.DeviceBufferLike, cuda.HostBufferLike]:
        device = self._device.get(name)
        if device is None:
            device = self._device[name] = self._memory.device_buffer()
            self._host[name] = self._memory.host_buffer()
        host = self._host[name]
        device.ensure(nbytes)
        host.ensure(nbytes)
        return device, host

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one request.

        Args:
            inputs: input name -> array of the config's dtype, shape inside profile 0.

        Returns:
            output name -> a new array, shape read from the context after the input shapes
            were set (e.g. ``(N, 1000)`` float32 logits).

        Raises:
            InferenceError: a TensorRT call returned False (the message names it), an output
                shape is not known before execution, the context is closed or already busy.
            CudaError: an allocation, copy or the stream synchronization failed.
        """
        if not self._busy.acquire(blocking=False):
            raise InferenceError(f"{self._where}: used by two requests at once (contexts are not thread-safe)")
        try:
            return self._infer(inputs)
        finally:
            self._busy.release()

    def _infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        context, stream = self._context, self._stream
        if context is None or stream is None:
            raise InferenceError(f"{self._where}: execution context is closed")
        engine, memory, where = self._engine, self._memory, self._where
        profile = engine.select_profile({name: tuple(a.shape) for name, a in inputs.items()})
        if profile != self._profile:
            _trt_call(where, f"set_optimization_profile_async({profile})", context.set_optimization_profile_async,
                      profile, stream.handle, error=EngineFault)
            self._profile = profile
        for io in engine.inputs:
            array = np.asarray(inputs[io.name], dtype=io.dtype, order="C")  # rank 0 stays rank 0
            _trt_call(where, f"set_input_shape('{io.name}', {list(array.shape)})", context.set_input_shape,
                      io.name, array.shape)
            device, host = self._buffers(io.name, array.nbytes)
            host.view(array.dtype, array.shape)[...] = array
            memory.copy_to_device(device, host, array.nbytes, stream)
            _trt_call(where, f"set_tensor_address('{io.name}')", context.set_tensor_address, io.name, device.ptr)
        shapes: dict[str, tuple[int, ...]] = {}
        for io in (*engine.outputs, *engine.scratch_outputs):
            shape = _dims(_trt_call(where, f"get_tensor_shape('{io.name}')", context.get_tensor_shape, io.name))
            if any(d < 0 for d in shape):
                raise InferenceError(f"{where}: output '{io.name}' shape {list(shape)} is not known "
                                     "after set_input_shape (data-dependent output shapes are not supported)")
            shapes[io.name] = shape
            device, _ = self._buffers(io.name, math.prod(shape) * io.dtype.itemsize)
            _trt_call(where, f"set_tensor_address('{io.name}')", context.set_tensor_address, io.name, device.ptr)
        _trt_call(where, "execute_async_v3", context.execute_async_v3, stream.handle)
        for io in engine.outputs:
            memory.copy_to_host(self._host[io.name], self._device[io.name],
                                math.prod(shapes[io.name]) * io.dtype.itemsize, stream)
        stream.synchronize()
        return {io.name: self._host[io.name].view(io.dtype, shapes[io.name]).copy() for io in engine.outputs}

    @property
    def buffer_bytes(self) -> dict[str, int]:
        """Device bytes held per tensor (grow-only)."""
        return {name: buf.nbytes for name, buf in self._device.items()}

    def close(self) -> None:
        """Destroy the execution context, then free its buffers and stream (idempotent)."""
        with self._busy:
            context, self._context = self._context, None
            del context  # the last reference: TensorRT destroys the context here
            for buf in [*self._device.values(), *self._host.values()]:
                buf.close()
            self._device.clear()
            self._host.clear()
            stream, self._stream = self._stream, None
            if stream is not None:
                stream.close()
            self._engine._forget(self)


class TensorRTEngine:
    """A deserialized TensorRT plan: the read-only engine the contexts share.

    Args:
        config: the model's contract.
        model_dir: its version folder (``model.onnx`` and the plans built by
            ``python -m deployments.runtime.tools.build``).
        flavour: which TensorRT module to use (``auto``: ``tensorrt``, else ``tensorrt_rtx``).
        device: CUDA device ordinal whose compute capability picks the plan.

    Footprint: ``engine_bytes`` is the device-memory drop measured with ``cudaMemGetInfo``
    across deserialization (the plan's size when that reads 0); ``context_bytes`` is
    ``max(device_memory_size_v2, the drop measured across the first context's creation)``
    plus the device I/O buffers at profile 0's max shapes. ``cudaMemGetInfo`` is device-wide:
    loads running in parallel in one process blur the measured figures.

    Raises:
        TensorRTUnavailable: no TensorRT module.
        CudaError: no CUDA device.
        PlanMismatch: no plan for this TensorRT and GPU, a stale one, or one TensorRT refuses.
        ConfigError: the plan's I/O tensors disagree with the config.
    """

    backend = "tensorrt"

    def __init__(self, config: ModelConfig, model_dir: Path, flavour: trt_module.FlavourRequest = "auto",
                 device: int = 0) -> None:
        trt_mod = trt_module.load(flavour)
        memory = cuda.CudaMemory()
        major, minor = cuda.compute_capability(device)
        plan_path, manifest = find_plan(config, Path(model_dir), trt_mod.flavour, trt_mod.version,
                                        f"{major}.{minor}", MODEL_FILENAME)
        plan = plan_path.read_bytes()
        log = trt_module.capturing_logger(trt_mod)
        runtime: trt.Runtime = trt_mod.module.Runtime(log)
        where = f"model '{config.name}' plan {plan_path.name}"
        _check_validity(trt_mod, runtime, plan, log, where)
        free_before, _ = memory.mem_get_info()
        mark = log.mark()
        engine: trt.ICudaEngine | None = runtime.deserialize_cuda_engine(plan)
        if engine is None:
            raise PlanMismatch(f"{where}: TensorRT refused to deserialize it: "
                               + ("; ".join(log.errors_since(mark)) or "no reason logged")
                               + ". Rebuild it on this machine with `make engines`")
        free_after, _ = memory.mem_get_info()
        delta = free_before - free_after
        self._setup(config, engine, memory, engine_bytes=delta if delta > 0 else len(plan),
                    keepalive=(runtime, log), manifest=manifest)

    @classmethod
    def from_cuda_engine(cls, config: ModelConfig, engine: "trt.ICudaEngine", memory: cuda.MemoryApi,
                         engine_bytes: int = 0, keepalive: Sequence[Any] = ()) -> "TensorRTEngine":
        """Serve an engine that is already deserialized (or built in process).

        Args:
            config: the model's contract; the engine's I/O must match it.
            engine: an ``ICudaEngine`` (or an object with its API).
            memory: streams, buffers and copies (``cuda.CudaMemory()`` for a real GPU).
            engine_bytes: device bytes the engine holds, for the footprint.
            keepalive: objects to keep alive as long as the engine (its Runtime, its logger).

        Raises:
            ConfigError: the engine's I/O tensors disagree with the config.
        """
        self = cls.__new__(cls)
        self._setup(config, engine, memory, engine_bytes=engine_bytes, keepalive=tuple(keepalive))
        return self

    def _setup(self, config: ModelConfig, engine: "trt.ICudaEngine", memory: cuda.MemoryApi, *,
               engine_bytes: int, keepalive: tuple[Any, ...], manifest: PlanManifest | None = None) -> None:
        self.config = config
        self.manifest = manifest
        self._engine: trt.ICudaEngine | None = engine
        self._memory = memory
        self._keepalive = keepalive
        self._engine_bytes = max(0, int(engine_bytes))
        self._contexts: weakref.WeakSet[TensorRTContext] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._created = 0
        self._context_bytes_measured = 0
        self._io_bytes_max: int | None = None
        self.released_bytes: int | None = None
        self.num_profiles = int(engine.num_optimization_profiles)
        self.inputs, self.outputs = self._read_io(engine)

    def _read_io(self, engine: "trt.ICudaEngine") -> tuple[tuple[TensorIO, ...], tuple[TensorIO, ...]]:
        where = f"model '{self.config.name}'"
        tensors = {}
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            is_input = engine.get_tensor_mode(name).name == "INPUT"
            trt_dtype = engine.get_tensor_dtype(name).name
            tensors[name] = (is_input, trt_dtype)
        ios: list[list[TensorIO]] = [[], []]
        for group, specs in ((0, self.config.inputs), (1, self.config.outputs)):
            kind = "input" if group == 0 else "output"
            for spec in specs:
                found = tensors.get(spec.name)
                if found is None or found[0] != (group == 0):
                    raise ConfigError(f"{where}: config {kind} '{spec.name}' is not an {kind} of the plan; "
                                      f"plan tensors: {sorted(tensors)}")
                if DATATYPE_BY_TRT.get(found[1]) != spec.datatype:
                    raise ConfigError(f"{where}: {kind} '{spec.name}' is {found[1]} in the plan, "
                                      f"config says {spec.datatype}")
                profiles: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = ()
                if group == 0:
                    profiles = tuple(
                        (_dims(shapes[0]), _dims(shapes[2]))
                        for shapes in (engine.get_tensor_profile_shape(spec.name, p)
                                       for p in range(self.num_profiles)))
                ios[group].append(TensorIO(spec.name, NUMPY_BY_DATATYPE[spec.datatype], group == 0, profiles))
        declared = {t.name for t in (*self.config.inputs, *self.config.outputs)}
        undeclared_inputs = sorted(n for n, (is_input, _) in tensors.items() if is_input and n not in declared)
        if undeclared_inputs:
            raise ConfigError(f"{where}: plan inputs {undeclared_inputs} are not declared in config.yaml "
                              "(TensorRT needs every input); declare them or rebuild with `make engines`")
        self.scratch_outputs = tuple(
            TensorIO(n, np.dtype((np.void, _ITEMSIZE_BY_TRT.get(trt_dtype, 8))), False)
            for n, (is_input, trt_dtype) in sorted(tensors.items()) if not is_input and n not in declared)
        if self.scratch_outputs:
            logger.warning("%s: plan outputs %s are not declared in config.yaml; they get scratch buffers "
                           "and are not returned (rebuild with `make engines` to drop them from the plan)",
                           where, [io.name for io in self.scratch_outputs])
        return tuple(ios[0]), tuple(ios[1])

    def select_profile(self, shapes: Mapping[str, tuple[int, ...]]) -> int:
        """The optimization profile to run ``shapes`` with: among those whose [min, max]
        holds every input, the one with the smallest max volume (the tightest); ties go to
        the lower index.

        Raises:
            InvalidInput: no profile holds the shapes (validation normally answers first).
        """
        best: tuple[int, int] | None = None
        for p in range(self.num_profiles):
            volume = 0
            for io in self.inputs:
                lo, hi = io.profiles[p]
                shape = shapes[io.name]
                if len(shape) != len(lo) or not all(a <= s <= b for a, s, b in zip(lo, shape, hi)):
                    break
                volume += math.prod(hi)
            else:
                if best is None or volume < best[0]:
                    best = (volume, p)
        if best is None:
            raise InvalidInput(f"model '{self.config.name}': input shapes {dict(shapes)} fit no "
                               "optimization profile of the plan")
        return best[1]

    def create_context(self) -> TensorRTContext:
        """A new execution context with its own stream and buffers.

        Raises:
            InferenceError: the engine is closed, or TensorRT could not create the context
                (``create_execution_context`` returned None, e.g. out of device memory).
            CudaError: the stream could not be created.
        """
        with self._lock:
            engine = self._engine
            if engine is None:
                raise InferenceError(f"model '{self.config.name}': engine is closed")
            free_before, _ = self._memory.mem_get_info()
            context: trt.IExecutionContext | None = _trt_call(
                f"model '{self.config.name}'", "create_execution_context", engine.create_execution_context)
            if context is None:
                raise InferenceError(f"model '{self.config.name}': TensorRT create_execution_context "
                                     "returned None (out of device memory?)")
            free_after, _ = self._memory.mem_get_info()
            self._context_bytes_measured = max(self._context_bytes_measured, free_before - free_after)
            if self._io_bytes_max is None:
                self._io_bytes_max = self._measure_io_bytes(context)
            wrapped = TensorRTContext(self, context, self._memory, self._created)
            self._created += 1
            self._contexts.add(wrapped)
            return wrapped

    def _measure_io_bytes(self, context: "trt.IExecutionContext") -> int:
        """Device I/O bytes at profile 0's max shapes, from the context's shape inference."""
        where = f"model '{self.config.name}'"
        total = 0
        for io in self.inputs:
            shape = io.profiles[0][1]
            _trt_call(where, f"set_input_shape('{io.name}', {list(shape)})", context.set_input_shape, io.name, shape)
            total += math.prod(shape) * io.dtype.itemsize
        for io in (*self.outputs, *self.scratch_outputs):
            shape = _dims(_trt_call(where, f"get_tensor_shape('{io.name}')", context.get_tensor_shape, io.name))
            total += math.prod(max(d, 0) for d in shape) * io.dtype.itemsize
        return total

    def _forget(self, context: TensorRTContext) -> None:
        self._contexts.discard(context)

    @property
    def profile_context_bytes(self) -> tuple[int, ...]:
        """``get_device_memory_size_for_profile_v2`` per profile: activation bytes a context needs."""
        engine = self._engine
        if engine is None:
            return ()
        return tuple(int(engine.get_device_memory_size_for_profile_v2(p)) for p in range(self.num_profiles))

    def footprint(self) -> Footprint:
        """Device bytes: ``engine_bytes`` (measured at load) and ``context_bytes`` per context
        (TensorRT's ``device_memory_size_v2`` or the measured creation delta, whichever is
        larger, plus I/O buffers at profile 0's max).

        Raises:
            InferenceError: the engine is closed.
        """
        engine = self._engine
        if engine is None:
            raise InferenceError(f"model '{self.config.name}': engine is closed")
        activation = max(int(engine.device_memory_size_v2), self._context_bytes_measured)
        io_bytes = self._io_bytes_max
        if io_bytes is None:  # no context yet: inputs at their max, outputs not known
            io_bytes = sum(math.prod(io.profiles[0][1]) * io.dtype.itemsize for io in self.inputs)
        return Footprint(engine_bytes=self._engine_bytes, context_bytes=activation + io_bytes, measured=True)

    def check_health(self) -> None:
        """Probe the device with one CUDA call (``cudaMemGetInfo``): after a sticky error
        (``cudaErrorIllegalAddress``, ``cudaErrorLaunchFailure``, ...) every CUDA call in the
        process fails until it restarts, so a failing probe means no request can succeed here.

        Raises:
            EngineFault: the probe failed (the message names the CUDA error); the engine is closed.
        """
        where = f"model '{self.config.name}'"
        if self._engine is None:
            raise EngineFault(f"{where}: engine is closed")
        cuda.check_device(self._memory, where)

    def close(self) -> None:
        """Close remaining contexts, then destroy the engine; ``released_bytes`` then holds
        the device-memory rise ``cudaMemGetInfo`` measured across it (idempotent)."""
        with self._lock:
            contexts = list(self._contexts)
        for context in contexts:
            context.close()
        with self._lock:
            engine, self._engine = self._engine, None
            if engine is None:
                return
            free_before, _ = self._memory.mem_get_info()
            del engine  # the last reference: TensorRT destroys the engine here
            self._keepalive = ()
            free_after, _ = self._memory.mem_get_info()
            self.released_bytes = free_after - free_before


def _check_validity(trt_mod: trt_module.TensorRTModule, runtime: Any, plan: bytes, log: Any, where: str) -> None:
    """Ask TensorRT-RTX whether the plan's header fits this runtime and GPU before deserializing.

    Full TensorRT has no such call (``Runtime.get_engine_validity`` is TensorRT-RTX's); there the
    manifest check and ``deserialize_cuda_engine`` returning None are the guards.

    Raises:
        PlanMismatch: the runtime says INVALID; the message lists its diagnostics
            (``UNSUPPORTED_CC``, ``VERSION_MISMATCH``, ...) and the logged reason.
    """
    validity = getattr(runtime, "get_engine_validity", None)
    header_size = getattr(runtime, "engine_header_size", 0)
    if validity is None or not header_size:
        return
    mark = log.mark()
    state, diagnostics = validity(plan[:header_size])
    if state.name != "INVALID":
        return
    flags = []
    enum = getattr(trt_mod.module, "EngineInvalidityDiagnostics", None)
    for name in dir(enum) if enum is not None else ():
        value = getattr(getattr(enum, name), "value", None)
        if name.isupper() and isinstance(value, int) and int(diagnostics) & value:
            flags.append(name)
    reason = "; ".join(log.errors_since(mark)) or "no reason logged"
    raise PlanMismatch(f"{where}: TensorRT says this plan cannot run here "
                       f"({', '.join(flags) or 'no diagnostic flags'}): {reason}")
