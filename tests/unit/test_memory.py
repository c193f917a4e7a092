"""The memory planner: graph prediction, ONNX Runtime measurement, the plan command."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import shutil
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from deployments.runtime.backends.base import Footprint
from deployments.runtime.contract import shapes
from deployments.runtime.residency import footprints
from deployments.runtime.residency.predict import predict
from deployments.runtime.tools import plan as plan_cli
from deployments.runtime.residency.host import ModelHost
from deployments.runtime.contract.repository import ModelRepository

CNNS = ["tiny_cnn", "mid_cnn", "resnet18"]

# TensorRT context memory at batch 32 @224 in the reference measurement (runtime/residency/predict.py).
REFERENCE_CONTEXT_BYTES = {"tiny_cnn": 296_000_000, "resnet18": 79_000_000}


def test_tiny_cnn_peak_activation_is_its_first_conv_output(model_repository: ModelRepository) -> None:
    prediction = predict(model_repository.get("tiny_cnn"))
    assert prediction.graph.parameters == 90_539
    assert prediction.graph.input_shapes == {"input": (32, 3, 224, 224)}
    assert prediction.graph.peak_activation_bytes == 128 * 112 * 112 * 4  # FP32, per sample
    assert prediction.context_bytes == int(3 * 32 * 128 * 112 * 112 * 4)


def test_resnet18_parameters_and_peak_activation(model_repository: ModelRepository) -> None:
    prediction = predict(model_repository.get("resnet18"))
    assert prediction.graph.parameters == 11_684_712
    assert prediction.engine_bytes == 11_684_712 * 4
    assert prediction.graph.peak_activation_bytes == 64 * 112 * 112 * 4  # the stem conv's output


def test_ocr_weights_in_constant_nodes_count_as_parameters(model_repository: ModelRepository) -> None:
    prediction = predict(model_repository.get("ocr_det"))
    assert prediction.graph.parameters > 1_000_000
    assert prediction.graph.input_shapes == {"x": (1, 3, 2016, 2016)}


@pytest.mark.parametrize("name", ["tiny_cnn", "resnet18"])
def test_fp16_prediction_is_an_upper_estimate_within_2x_of_the_reference(
        model_repository: ModelRepository, name: str) -> None:
    """The reference measurement (runtime/residency/predict.py) put TensorRT contexts at batch 32 @224: tiny_cnn 296 MB,
    ResNet-18 79 MB. Those engines were FP16: in FP32 tiny_cnn's first conv output and the
    depthwise conv reading it alone take 2 x 205 MB. Stated tolerance: the 3 x rule, with
    activations at FP16, predicts between 0.9x and 2.0x the reference (tiny_cnn +4 %,
    ResNet-18 +95 %: its largest tensor, the stem's, is live only briefly)."""
    predicted = predict(model_repository.get(name), precision="fp16").context_bytes
    ratio = predicted / REFERENCE_CONTEXT_BYTES[name]
    assert 0.9 <= ratio <= 2.0, f"{name}: predicted {predicted / 1e6:.0f} MB, ratio {ratio:.2f}"


def _measure_in_this_process(root: str) -> dict[str, Footprint]:
    repository = ModelRepository(root)
    measured = {}
    for name in CNNS:
        host = ModelHost(repository.get(name), "onnxruntime")
        measured[name] = footprints.load_and_measure(host)
        host.unload()
    return measured


@pytest.fixture(scope="module")
def measured_cnns(model_repository: ModelRepository) -> dict[str, Footprint]:
    """Measured in a fresh process: an RSS delta in this one depends on what earlier tests
    left in the allocator (freed memory is reused and reads as a smaller delta)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_measure_in_this_process, str(model_repository.root)).result()


def test_prediction_is_an_upper_estimate_of_onnxruntime_context_memory_for_cnns(
        model_repository: ModelRepository, measured_cnns: dict[str, Footprint]) -> None:
    """Stated tolerance: for the CNNs the FP32 prediction is 1.0x-1.6x the measured ORT context
    (measured on this machine: tiny_cnn 1.19, mid_cnn 1.42, ResNet-18 1.43)."""
    for name, footprint in measured_cnns.items():
        predicted = predict(model_repository.get(name)).context_bytes
        ratio = predicted / footprint.context_bytes
        assert 1.0 <= ratio <= 1.6, f"{name}: predicted / measured = {ratio:.2f}"


def test_measured_engine_bytes_are_the_weights_within_a_few_mb(
        model_repository: ModelRepository, measured_cnns: dict[str, Footprint]) -> None:
    for name, footprint in measured_cnns.items():
        weights = predict(model_repository.get(name)).engine_bytes
        assert abs(footprint.engine_bytes - weights) < 8_000_000, name


def test_measurement_at_a_small_batch_scales_to_the_full_batch(
        model_repository: ModelRepository, measured_cnns: dict[str, Footprint]) -> None:
    """tiny_cnn measured at batch 8 and scaled x4 agrees with a real batch-32 measurement."""
    entry = model_repository.get("tiny_cnn")
    assert footprints.measure_batch_of(entry.config) == 8
    host = ModelHost(entry, "onnxruntime").load()
    full = footprints.measure_context_bytes(host, measure_elements=None)
    host.unload()
    assert abs(measured_cnns["tiny_cnn"].context_bytes - full) <= 0.1 * full


def test_measure_batch_is_set_by_input_volume(model_repository: ModelRepository) -> None:
    batches = {n: footprints.measure_batch_of(model_repository.get(n).config)
               for n in ["tiny_cnn", "ocr_cls", "ocr_det", "ocr_rec"]}
    assert batches == {"tiny_cnn": 8, "ocr_cls": 32, "ocr_det": 1, "ocr_rec": 2}


def test_max_profile_uses_max_batch_size_and_shrinking_halves_batch_or_dynamic_axes(
        model_repository: ModelRepository) -> None:
    rec = model_repository.get("ocr_rec").config
    assert shapes.max_profile_shapes(rec) == {"x": (32, 3, 48, 3200)}
    assert shapes.shrunk_shapes(rec) == ({"x": (16, 3, 48, 3200)}, "batch 32->16")
    det = model_repository.get("ocr_det").config  # batch 1: its spatial axes halve, not below opt
    assert shapes.shrunk_shapes(det) == ({"x": (1, 3, 1008, 1008)}, "axis 2 2016->1008, axis 3 2016->1008")


def test_plan_json_reports_totals_fit_and_shrink_savings(
        model_repository: ModelRepository, capsys: pytest.CaptureFixture[str]) -> None:
    root = str(model_repository.root)
    assert plan_cli.main(["plan", "--root", root, "--json", "--gpu-memory-gib", "80", "--headroom", "0.15"]) == 0
    plan = json.loads(capsys.readouterr().out)
    models = {m["model"]: m for m in plan["models"]}
    assert set(models) == {"tiny_cnn", "mid_cnn", "resnet18", "ocr_det", "ocr_cls", "ocr_rec", "simple", "simple_string",
                           "simple_identity", "all-MiniLM-L6-v2"}  # every engine model; pipelines (ocr, embed) have none
    assert plan["total_bytes"] == sum(m["total_bytes"] for m in plan["models"])
    assert plan["usable_bytes"] == int(80 * 2**30 * 0.85) and plan["fits"] is True
    tiny = models["tiny_cnn"]
    assert tiny["total_bytes"] == tiny["engine_bytes"] + 2 * tiny["predicted_context_bytes"]
    assert tiny["shrink_saves_bytes"] == pytest.approx(tiny["predicted_context_bytes"], rel=1e-6)  # 2 x half

    assert plan_cli.main(["plan", "--root", root, "--json", "--gpu-memory-gib", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["fits"] is False


def test_recorded_footprint_is_read_back_and_ignored_when_stale(
        model_repository: ModelRepository, tmp_path: Path) -> None:
    source = model_repository.get("ocr_cls")
    (tmp_path / "ocr_cls" / "1").mkdir(parents=True)
    shutil.copy(source.path / "config.yaml", tmp_path / "ocr_cls" / "config.yaml")
    shutil.copy(source.onnx_path(), tmp_path / "ocr_cls" / "1" / "model.onnx")
    entry = ModelRepository(tmp_path).get("ocr_cls")
    assert footprints.read_record(entry, "onnxruntime") is None
    footprint = Footprint(engine_bytes=1_000_000, context_bytes=2_000_000)
    footprints.write_record(entry, "onnxruntime", footprint, footprints.MEASURE_INPUT_ELEMENTS)
    assert footprints.read_record(entry, "onnxruntime") == footprint
    assert footprints.read_record(entry, "tensorrt") is None
    with open(entry.onnx_path(), "ab") as f:  # another model file: the record is stale
        f.write(b"\0")
    assert footprints.read_record(entry, "onnxruntime") is None


def test_a_cuda_footprint_stands_only_for_the_options_it_was_measured_under(
        model_repository: ModelRepository, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On ONNX Runtime's CUDA provider the CUDA graphs a context captures at load and the
    provider options are part of its footprint: a record or an in-process measurement made
    under others (graphs off, another arena cap, a record written before they were recorded) is
    stale, not a figure to place by."""
    monkeypatch.delenv("TRT_SERVE_CUDA_GRAPHS", raising=False)
    source = model_repository.get("resnet18")
    (tmp_path / "resnet18" / "1").mkdir(parents=True)
    shutil.copy(source.path / "config.yaml", tmp_path / "resnet18" / "config.yaml")
    shutil.copy(source.onnx_path(), tmp_path / "resnet18" / "1" / "model.onnx")
    entry = ModelRepository(tmp_path).get("resnet18")
    options = footprints.engine_options(entry, "onnxruntime_cuda")
    assert options["graph_batches"] == [1] and options["onnxruntime_cuda"]["gpu_mem_limit_mib"] == 4096.0
    assert footprints.engine_options(entry, "onnxruntime") == {}
    footprint = Footprint(engine_bytes=0, context_bytes=461_373_440, measured=True)
    path = footprints.write_record(entry, "onnxruntime_cuda", footprint, footprints.MEASURE_INPUT_ELEMENTS)
    assert json.loads(path.read_text())["engine_options"] == options
    assert footprints.read_record(entry, "onnxruntime_cuda") == footprint
    key = footprints._measure_key(entry, "onnxruntime_cuda")
    monkeypatch.setenv("TRT_SERVE_CUDA_GRAPHS", "0")  # graphs off: another footprint
    assert footprints.engine_options(entry, "onnxruntime_cuda")["graph_batches"] is None
    assert footprints.read_record(entry, "onnxruntime_cuda") is None
    assert footprints._measure_key(entry, "onnxruntime_cuda") != key
    monkeypatch.delenv("TRT_SERVE_CUDA_GRAPHS")
    capped = dataclasses.replace(entry, config=entry.config.model_copy(update={
        "onnxruntime_cuda": entry.config.onnxruntime_cuda.model_copy(update={"gpu_mem_limit_mib": 1024.0})}))
    assert footprints.read_record(capped, "onnxruntime_cuda") is None
    record = json.loads(path.read_text())
    del record["engine_options"]  # written before the options were recorded
    path.write_text(json.dumps(record))
    assert footprints.read_record(entry, "onnxruntime_cuda") is None
