"""Backend selection on any machine: ``auto``'s order tensorrt -> onnxruntime_cuda -> onnxruntime
and the reasons it gives, with the availability probes replaced (the real ones answer for this
machine: CPU-only in CI), and the real probe's answer here."""

from __future__ import annotations

import onnxruntime as ort
import pytest

from deployments.runtime.backends import cuda, onnxruntime_cuda, select
from deployments.runtime.contract.config import DynamicBatching
from deployments.runtime.contract.errors import ConfigError


@pytest.fixture
def machine(monkeypatch):
    """Set what this 'machine' has: ``machine(tensorrt=..., cuda=None | 'why not')``."""
    def set_(tensorrt: bool, cuda_reason: str | None) -> None:
        monkeypatch.setattr(select, "tensorrt_available", lambda: tensorrt)
        monkeypatch.setattr(select, "cuda_provider_unavailable", lambda: cuda_reason)
        monkeypatch.setattr(select, "_cuda_description", lambda: "NVIDIA H200 (compute capability 9.0)")
    return set_


@pytest.mark.parametrize("tensorrt,cuda_reason,backend,fragment", [
    (True, None, "tensorrt", "TensorRT runtime can run"),
    (True, "no CUDA device 0 visible", "tensorrt", "TensorRT runtime can run"),
    (False, None, "onnxruntime_cuda", "no TensorRT runtime for this GPU; CUDAExecutionProvider on NVIDIA H200"),
    (False, "no CUDA device 0 visible (0 visible, CUDA_VISIBLE_DEVICES='')", "onnxruntime",
     "auto: no TensorRT runtime; no CUDA device 0 visible"),
])
def test_auto_takes_the_first_backend_that_can_run(machine, tensorrt, cuda_reason, backend, fragment):
    machine(tensorrt, cuda_reason)
    choice = select.choose_backend("auto")
    assert choice.backend == backend and fragment in choice.reason
    assert select.resolve_backend("auto") == backend


def test_explicit_backends_raise_with_the_reason_when_they_cannot_run(machine):
    machine(False, "onnxruntime 1.32.0 has no CUDAExecutionProvider")
    with pytest.raises(ConfigError, match="'onnxruntime_cuda' requested, but onnxruntime 1.32.0 has no CUDA"):
        select.choose_backend("onnxruntime_cuda")
    with pytest.raises(ConfigError, match="'tensorrt' requested"):
        select.choose_backend("tensorrt")
    assert select.choose_backend("onnxruntime") == select.BackendChoice("onnxruntime", "requested: onnxruntime")


def test_explicit_cuda_backend_where_it_can_run(machine):
    machine(True, None)
    choice = select.choose_backend("onnxruntime_cuda")
    assert choice.backend == "onnxruntime_cuda" and "requested" in choice.reason


def test_provider_probe_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    assert "has no CUDAExecutionProvider" in onnxruntime_cuda.unavailable_reason()
    assert "onnxruntime-gpu" in onnxruntime_cuda.unavailable_reason()
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(cuda, "device_count", lambda: 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    reason = onnxruntime_cuda.unavailable_reason()
    if "cuda-python" not in reason:  # where cuda-python is installed, the device count decides
        assert reason == "no CUDA device 0 visible (0 visible, CUDA_VISIBLE_DEVICES='')"
    monkeypatch.setattr(cuda, "device_count", lambda: 1)
    monkeypatch.setattr(cuda, "_runtime", lambda: None)
    assert onnxruntime_cuda.unavailable_reason() is None


def test_this_machine_answers_consistently():
    """Whatever this machine has, ``auto`` and the probe agree (CI: CPU, with the reason)."""
    choice = select.choose_backend("auto")
    reason = onnxruntime_cuda.unavailable_reason()
    if choice.backend == "onnxruntime":
        assert reason is not None and reason in choice.reason
    else:
        assert choice.backend in ("tensorrt", "onnxruntime_cuda")


def test_an_explicit_cuda_backend_fails_the_load_with_the_reason(model_repository, monkeypatch):
    """ModelHost with ``onnxruntime_cuda`` where the provider is missing: ConfigError, no engine."""
    from deployments.runtime.residency.host import ModelHost

    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    host = ModelHost(model_repository.get("tiny_cnn"), "onnxruntime_cuda")
    with pytest.raises(ConfigError, match="no CUDAExecutionProvider"):
        host.load()
    assert not host.ready


def test_cuda_wait_mode_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(onnxruntime_cuda.CUDA_WAIT_ENV, raising=False)
    assert onnxruntime_cuda.cuda_wait_mode() == onnxruntime_cuda.DEFAULT_CUDA_WAIT
    monkeypatch.setenv(onnxruntime_cuda.CUDA_WAIT_ENV, "spin")
    assert onnxruntime_cuda.cuda_wait_mode() == "spin"
    monkeypatch.setenv(onnxruntime_cuda.CUDA_WAIT_ENV, "sleepy")
    with pytest.raises(ConfigError, match=r"TRT_SERVE_CUDA_WAIT='sleepy' is not a CUDA wait mode; allowed: "
                                          r"\['auto', 'blocking', 'spin', 'yield'\]"):
        onnxruntime_cuda.cuda_wait_mode()


def test_set_wait_passes_cuda_its_scheduling_flag(monkeypatch):
    """The flag values are CUDA's (driver_types.h: Spin 1, Yield 2, BlockingSync 4)."""
    calls = []

    class Runtime:
        cudaDeviceScheduleAuto, cudaDeviceScheduleSpin, cudaDeviceScheduleYield, cudaDeviceScheduleBlockingSync = 0, 1, 2, 4

        @staticmethod
        def cudaSetDeviceFlags(flags):
            calls.append(flags)
            return (0,) if flags != 2 else (708,)  # cudaErrorSetOnActiveProcess, as a made context answers

    monkeypatch.setattr(cuda, "_runtime", lambda: Runtime)
    cuda.set_wait("blocking")
    cuda.set_wait("spin")
    assert calls == [4, 1]
    with pytest.raises(cuda.CudaError, match=r"cudaSetDeviceFlags\(cudaDeviceScheduleYield\) failed: 708"):
        cuda.set_wait("yield")
    with pytest.raises(ValueError, match=r"CUDA wait mode 'busy' is not one of \['auto', 'blocking', 'spin', 'yield'\]"):
        cuda.set_wait("busy")
    assert calls == [4, 1, 2]


def test_cuda_graphs_follow_the_config_unless_the_environment_says_otherwise(model_repository, monkeypatch):
    on = model_repository.get("resnet18").config
    config = on.model_copy(update={"onnxruntime_cuda": on.onnxruntime_cuda.model_copy(update={"cuda_graphs": False})})
    monkeypatch.delenv(onnxruntime_cuda.CUDA_GRAPHS_ENV, raising=False)
    assert onnxruntime_cuda.graphs_wanted(on)[0] is True  # the default
    assert onnxruntime_cuda.graphs_wanted(config) == (False, "off (onnxruntime_cuda.cuda_graphs: false)")
    monkeypatch.setenv(onnxruntime_cuda.CUDA_GRAPHS_ENV, "0")
    assert onnxruntime_cuda.graphs_wanted(on) == (False, "off (TRT_SERVE_CUDA_GRAPHS=0)")
    monkeypatch.setenv(onnxruntime_cuda.CUDA_GRAPHS_ENV, "1")
    assert onnxruntime_cuda.graphs_wanted(config)[0] is True
    monkeypatch.setenv(onnxruntime_cuda.CUDA_GRAPHS_ENV, "yes")
    with pytest.raises(ConfigError, match=r"TRT_SERVE_CUDA_GRAPHS='yes' is neither 1 \(graphs for every model\) "
                                          r"nor 0 \(none\)"):
        onnxruntime_cuda.graphs_wanted(config)


def test_graphs_are_captured_at_load_for_one_row_and_the_preferred_sizes(model_repository):
    """1 (a lone request) and, with dynamic batching on, the sizes padded batches run at; a model
    without a batch axis has its one shape."""
    resnet18 = model_repository.get("resnet18").config  # max_batch_size 32, no dynamic_batching
    assert onnxruntime_cuda.graph_batches(resnet18) == (1,)
    batched = resnet18.model_copy(update={"dynamic_batching": DynamicBatching(preferred_batch_size=[8, 2])})
    assert onnxruntime_cuda.graph_batches(batched) == (1, 2, 8)
    off = resnet18.model_copy(update={"dynamic_batching": DynamicBatching(preferred_batch_size=[8], enabled=False)})
    assert onnxruntime_cuda.graph_batches(off) == (1,)
    assert onnxruntime_cuda.graph_batches(resnet18.model_copy(update={"max_batch_size": 0})) == (None,)


def test_graphs_need_shapes_known_at_load(model_repository):
    """An input with a dynamic axis besides the batch axis, or an output only the run shapes,
    cannot be captured at load: the context says why."""
    assert onnxruntime_cuda.graphs_refused(model_repository.get("resnet18").config) is None
    assert onnxruntime_cuda.graphs_refused(model_repository.get("ocr_rec").config) == (
        "off: input 'x' has a dynamic axis besides the batch axis (graphs are captured at load, for fixed shapes)")
    assert onnxruntime_cuda.graphs_refused(model_repository.get("ocr_det").config).startswith("off: input 'x' has")


def test_a_graph_run_names_its_graph_id():
    """ONNX Runtime replays graph 0 for a run of a graph session that names none: each run names its own."""
    assert onnxruntime_cuda.graph_run(3).get_run_config_entry("gpu_graph_id") == "3"
    assert onnxruntime_cuda.graph_run(onnxruntime_cuda.NO_GRAPH).get_run_config_entry("gpu_graph_id") == "-1"


def test_a_thread_relaxes_its_capture_mode_once(monkeypatch):
    """Every thread that touches CUDA asks for the relaxed capture mode once (another thread's graph
    capture must not fail its calls), and a machine without a device does not fail for it."""
    calls = []

    class Runtime:
        class cudaStreamCaptureMode:
            cudaStreamCaptureModeRelaxed = 2

        @staticmethod
        def cudaThreadExchangeStreamCaptureMode(mode):
            calls.append(mode)
            raise RuntimeError("no CUDA driver")  # as where no device answers: ignored

    import threading

    def twice() -> None:
        cuda.relax_capture_mode(Runtime)
        cuda.relax_capture_mode(Runtime)

    for _ in range(2):
        thread = threading.Thread(target=twice)
        thread.start()
        thread.join()
    assert calls == [2, 2]  # once per thread
