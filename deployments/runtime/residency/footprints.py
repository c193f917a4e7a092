"""Measure a loaded model's footprint on ONNX Runtime, remember it, record it next to the model.

* **ONNX Runtime** (``load_and_measure``): the process resident set size (RSS) before and after
  creating the session is the engine bytes; the RSS growth across two runs at the max profile
  (batch scaled, see below) is the context bytes: ORT's CPU arena keeps what a run allocated, so
  that growth *is* the memory the session keeps once it has served max-profile requests (the
  second run captures the arena's fragmentation). The heap is trimmed (``malloc_trim``) before
  every RSS reading so freed memory that glibc kept does not hide a growth. To bound the cost,
  the runs use the largest batch whose inputs hold at most ``measure_elements`` elements
  (default ``MEASURE_INPUT_ELEMENTS``, 8 images of 3x224x224), and the growth is scaled by
  ``max_batch / batch``: activation memory is linear in batch (ORT 1.32, memory pattern off,
  fresh process, RSS growth per sample at batch 4/8/16/32: tiny_cnn 16.2/16.1/16.1/16.1 MB,
  ResNet-18 5.2/6.7/6.7/6.7 MB, mid_cnn 3.4/3.4/3.4/3.4 MB; ocr_rec at width 3200, batch
  1/2/4/8: 57.8/57.3/57.1/57.0 MB). Below 8 images ResNet-18's growth is noisy (the arena's
  chunking), hence the default.
* **TensorRT**: exact, from the engine (``device_memory_size_v2``); no measurement.

RSS is process-wide: requests running on other models while a model is measured add noise
(seen: tiny_cnn's 2 x 515 MiB read as 2 x 1,036 MiB while the pool served other models).
``ModelCache`` serializes loads to keep that noise small; the noise only ever adds, so a model
measured more than once keeps the smallest reading of each part (``measurement_count``).

The measuring runs feed inputs of the server's own making (zeros), which a model may refuse
where no real request would (an integer ``Div`` by zero, a ``Reshape`` the measuring batch does
not divide): a failed measuring run never fails the load. The graph prediction
(``residency.predict``) stands in for the context bytes, the reason is logged once per model
file and kept (``measurement_failure``: ``/v2/memory`` shows it), and the model is not run on
zeros again.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper

from ..backends.base import Footprint
from ..backends.select import requested_backend, resolve_backend
from ..contract.files import write_atomic
from ..contract.config import ModelConfig
from ..contract.datatypes import zeros
from ..contract.errors import InferenceError, InvalidInput, ServingError, refused_by_the_model
from ..contract.repository import ModelEntry
from ..contract.reshape import engine_config
from ..contract.shapes import batch_of, max_profile_shapes
from .host import ModelHost
from .predict import _file_key, predict
from ..backends.process import measured_rss_bytes

logger = logging.getLogger(__name__)

MEASURE_INPUT_ELEMENTS = 8 * 3 * 224 * 224
"""Input elements of a measuring run (sets its batch); the growth is scaled to the max batch."""

RECORD_FILENAME = "footprint.json"
"""A recorded footprint next to the model file: ``<model>/<version>/footprint.json``."""


_MEASURED: dict[tuple, tuple[Footprint, int]] = {}  # (smallest reading of each part, readings)
_MEASURED_LOCK = threading.Lock()
_FAILED: dict[tuple, str] = {}  # why the measuring runs failed, by ``_measure_key``


def _measure_key(entry: ModelEntry, backend: str) -> tuple | None:
    """What a measurement of ``entry`` on ``backend`` is kept under; None when its model file
    cannot be read (deleted since it was read): nothing measured of it, and its load says why."""
    try:
        file = _file_key(entry.onnx_path())
    except OSError:
        return None
    return (file, backend, json.dumps(engine_options(entry, backend), sort_keys=True))


def engine_options(entry: ModelEntry, backend: str) -> dict[str, Any]:
    """What besides the model file shapes its measured footprint on ``backend``: on ONNX
    Runtime's CUDA provider its provider options and the CUDA graphs its contexts capture
    (``onnxruntime_cuda.footprint_options``), nothing elsewhere. A measurement or a record made
    under other options is not this model's footprint now."""
    if backend != "onnxruntime_cuda":
        return {}
    from ..backends import onnxruntime_cuda

    return onnxruntime_cuda.footprint_options(engine_config(entry.config))


def measured_footprint(entry: ModelEntry, backend: str) -> Footprint | None:
    """The footprint ``load_and_measure`` took of this model file in this process, if any (the
    smallest reading of each part when it was measured more than once)."""
    with _MEASURED_LOCK:
        known = _MEASURED.get(_measure_key(entry, backend))
    return known[0] if known else None


def measurement_count(entry: ModelEntry, backend: str) -> int:
    """How many times ``load_and_measure`` measured this model file in this process."""
    with _MEASURED_LOCK:
        known = _MEASURED.get(_measure_key(entry, backend))
    return known[1] if known else 0


def measurement_failure(entry: ModelEntry, backend: str) -> str | None:
    """Why the measuring runs on this model file failed in this process (the graph prediction
    stands in for its context bytes), or None when they did not fail."""
    with _MEASURED_LOCK:
        return _FAILED.get(_measure_key(entry, backend))


def _record_measurement(entry: ModelEntry, backend: str, footprint: Footprint) -> Footprint:
    """Remember ``footprint``; returns what is kept: per part, the smallest reading so far
    (RSS noise from other requests only adds)."""
    key = _measure_key(entry, backend)
    if key is None:
        return footprint
    with _MEASURED_LOCK:
        known = _MEASURED.get(key)
        if known is not None:
            old, count = known
            footprint = Footprint(engine_bytes=min(old.engine_bytes, footprint.engine_bytes),
                                  context_bytes=min(old.context_bytes, footprint.context_bytes),
                                  measured=footprint.measured, device=footprint.device)
        _MEASURED[key] = (footprint, (known[1] if known else 0) + 1)
        return footprint


def measure_batch_of(config: ModelConfig, measure_elements: int | None = MEASURE_INPUT_ELEMENTS) -> int:
    """Batch of the measuring runs: the largest (at least 1, at most the max batch) whose inputs at
    the max profile hold at most ``measure_elements`` elements; the max batch when None."""
    full = batch_of(config)
    if measure_elements is None or not config.max_batch_size:
        return full
    per_sample = sum(int(np.prod(s[1:])) for s in max_profile_shapes(config, 1).values())
    return max(1, min(full, measure_elements // max(1, per_sample)))


def measure_context_bytes(host: ModelHost, measure_elements: int | None = MEASURE_INPUT_ELEMENTS,
                          runs: int = 2) -> int:
    """RSS growth of ``runs`` requests at the max profile, scaled to the max batch (bytes).

    Args:
        host: a loaded ``ModelHost`` with an ONNX Runtime engine; nobody else should use it yet
            (its arena must still be empty).
        measure_elements: sets the runs' batch (``measure_batch_of``); the growth is multiplied
            by ``max_batch / batch``. None runs the full max batch.
        runs: requests to run; the second captures the arena's fragmentation (module docstring).

    The inputs are zeros of the declared datatypes (BYTES: the text "0", ``datatypes.zeros``); they
    exist before the first reading and the outputs are dropped before the last, so neither is counted.

    Raises:
        InferenceError, InvalidInput: from ``host.infer``.
    """
    config = host.config
    full = batch_of(config)
    batch = measure_batch_of(config, measure_elements)
    feeds = {name: zeros(config.input(name).datatype, shape)
             for name, shape in max_profile_shapes(config, batch if config.max_batch_size else None).items()}
    before = measured_rss_bytes()
    for _ in range(runs):
        outputs = host.infer(feeds)
        del outputs
    growth = max(0, measured_rss_bytes() - before)
    return int(growth * full / batch)


_PRIMED = threading.Event()


def _prime_onnxruntime() -> None:
    """Create (once per process) a throwaway session on a one-node graph, so ONNX Runtime's
    one-time start-up memory (its environment, about 30 MB) is not counted as the first model's."""
    if _PRIMED.is_set():
        return
    import onnxruntime

    value = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "prime", [value],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    session.run(None, {"x": np.zeros(1, np.float32)})
    _PRIMED.set()


def load_and_measure(host: ModelHost, measure_elements: int | None = MEASURE_INPUT_ELEMENTS) -> Footprint:
    """Load ``host`` and return its footprint: exact on TensorRT, measured on ONNX Runtime.

    ONNX Runtime: engine bytes = RSS growth across ``host.load()``; context bytes =
    ``measure_context_bytes(host, measure_elements)`` (module docstring gives the method). The result
    is remembered for this model file (``measured_footprint``), so a reload need not measure; a
    second measurement keeps the smaller reading of each part, and that is what is returned.
    The host stays loaded, with its arena grown by the measuring runs.

    A measuring run that fails (the model refuses the zeros, ``InferenceError`` or
    ``InvalidInput``) does not fail the load: the context bytes are the graph prediction's
    (``measured=False``, nothing remembered as measured), and the reason is kept
    (``measurement_failure``); later loads of the file skip the runs.

    Raises:
        ConfigError, LoadFault, InferenceError: from loading (the config's warmup runs included);
            EngineFault from a measuring run (the host is unloaded).
    """
    if resolve_backend(requested_backend(host.config, host.backend_request)) == "onnxruntime":
        _prime_onnxruntime()
    before = measured_rss_bytes()
    host.load()
    try:
        engine = host.engine
        assert engine is not None
        if engine.backend != "onnxruntime":
            return _record_measurement(host.entry, engine.backend, engine.footprint())
        engine_bytes = max(0, measured_rss_bytes() - before)
        if measurement_failure(host.entry, engine.backend) is None:
            try:
                context_bytes = measure_context_bytes(host, measure_elements)
            except (InferenceError, InvalidInput) as e:
                if not refused_by_the_model(e):  # the engine or device is unusable: no load can serve
                    raise
                _measuring_failed(host, e)
            else:
                footprint = Footprint(engine_bytes=engine_bytes, context_bytes=context_bytes, measured=True)
                return _record_measurement(host.entry, engine.backend, footprint)
        return Footprint(engine_bytes=engine_bytes, context_bytes=_predicted_context_bytes(host), measured=False)
    except BaseException:
        host.unload()
        raise


def _measuring_failed(host: ModelHost, error: ServingError) -> None:
    """Remember (and log, once per model file) why ``host``'s measuring runs failed."""
    reason = (f"the measuring run on zeros at the max profile failed ({error.message}); "
              "the graph prediction stands in for its context bytes")
    key = _measure_key(host.entry, "onnxruntime")
    with _MEASURED_LOCK:
        if key is not None:
            _FAILED[key] = reason
    logger.warning("model '%s': %s", host.name, reason)


def _predicted_context_bytes(host: ModelHost) -> int:
    """The graph prediction's context bytes (``predict``), 0 when the graph cannot be analysed."""
    try:
        return predict(host.entry).context_bytes
    except ServingError as e:
        logger.warning("model '%s': no graph prediction of its context bytes either: %s", host.name, e.message)
        return 0


def _runtime_version(backend: str) -> str:
    if backend in ("onnxruntime", "onnxruntime_cuda"):
        import onnxruntime

        return onnxruntime.__version__
    return ""


def write_record(entry: ModelEntry, backend: str, footprint: Footprint, measure_elements: int | None) -> Path:
    """Write ``footprint`` to ``<model>/<version>/footprint.json`` (keys: ``engine_bytes``,
    ``context_bytes``, ``backend``, ``runtime_version``, ``model_bytes``, ``measure_batch``,
    ``engine_options``, ``source``). A TensorRT build can write the same keys next to its plan."""
    path = entry.onnx_path().parent / RECORD_FILENAME
    record = {"engine_bytes": footprint.engine_bytes, "context_bytes": footprint.context_bytes,
              "backend": backend, "runtime_version": _runtime_version(backend),
              "model_bytes": entry.onnx_path().stat().st_size,
              "measure_batch": measure_batch_of(entry.config, measure_elements),
              "engine_options": engine_options(entry, backend),
              "source": "python -m deployments.runtime.tools.plan measure"}
    write_atomic(path, json.dumps(record, indent=2) + "\n")
    return path


def read_record(entry: ModelEntry, backend: str) -> Footprint | None:
    """The recorded footprint of this model for ``backend``, or None when absent or stale
    (another backend, runtime version, model file size or ``engine_options``: a record without
    them stands for none)."""
    path = entry.onnx_path().parent / RECORD_FILENAME
    try:
        record, model_bytes = json.loads(path.read_text()), entry.onnx_path().stat().st_size
    except (OSError, ValueError):
        return None
    if (record.get("backend") != backend or record.get("runtime_version") != _runtime_version(backend)
            or record.get("model_bytes") != model_bytes
            or record.get("engine_options", {}) != engine_options(entry, backend)):
        return None
    try:
        return Footprint(engine_bytes=int(record["engine_bytes"]), context_bytes=int(record["context_bytes"]),
                         measured=True)
    except (KeyError, TypeError, ValueError):
        return None
