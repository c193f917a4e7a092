"""deployments.runtime.tools.prepare: OCR models extracted from the rapidocr wheel, synthetic CNNs generated."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from deployments.runtime.tools import prepare as prep
from deployments.runtime.residency.host import ModelHost
from deployments.runtime.contract.repository import ModelRepository

GENERATED = ["tiny_cnn", "mid_cnn", "resnet18"]


@pytest.fixture(scope="module")
def generated_bytes() -> dict[str, bytes]:
    return {name: prep.generated_model_bytes(name) for name in GENERATED}


@pytest.fixture(scope="module")
def wheel(prepared_engines: Path) -> Path:
    found = prep.cached_wheel(prepared_engines / ".cache")
    if found is None:  # the OCR files were present, so prepare did not need the wheel
        found = prep.fetch_wheel(prepared_engines / ".cache", progress=lambda line: None)
    return found


@pytest.mark.parametrize("name, expected", [
    ("tiny_cnn", 90_539), ("mid_cnn", 4_570_792), ("resnet18", 11_684_712)])
def test_generated_model_has_documented_parameter_count(generated_bytes, name, expected):
    model = onnx.load_from_string(generated_bytes[name])
    assert prep.parameter_count(model) == expected == prep.PARAMETER_COUNTS[name]


def test_resnet18_count_is_torchvision_count_with_batchnorm_folded():
    # torchvision resnet18: 11,689,512 parameters, of which 2 x 4,800 BN gamma/beta; folding
    # leaves one bias per conv output channel (4,800).
    assert prep.PARAMETER_COUNTS["resnet18"] == 11_689_512 - 2 * 4_800 + 4_800


def test_generation_is_deterministic_and_matches_pinned_hash(generated_bytes):
    for name in GENERATED:
        again = prep.generated_model_bytes(name)
        assert again == generated_bytes[name], name
        assert hashlib.sha256(again).hexdigest() == prep.GENERATED_SHA256[name], name


@pytest.mark.parametrize("name", GENERATED)
def test_generated_model_declares_dynamic_batch_and_opset_17(generated_bytes, name):
    model = onnx.load_from_string(generated_bytes[name])
    onnx.checker.check_model(model, full_check=True)
    assert [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] == [17]
    (inp,), (out,) = model.graph.input, model.graph.output
    assert inp.name == "input" and out.name == "logits"
    assert inp.type.tensor_type.elem_type == out.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    in_dims = [d.dim_param or d.dim_value for d in inp.type.tensor_type.shape.dim]
    out_dims = [d.dim_param or d.dim_value for d in out.type.tensor_type.shape.dim]
    assert in_dims == ["N", 3, 224, 224] and out_dims == ["N", 1000]


def test_tiny_cnn_keeps_128_channels_at_112x112_after_first_conv(generated_bytes):
    model = onnx.load_from_string(generated_bytes["tiny_cnn"])
    inferred = onnx.shape_inference.infer_shapes(model)
    first_conv = next(n for n in model.graph.node if n.op_type == "Conv")
    shapes = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in inferred.graph.value_info}
    assert shapes[first_conv.output[0]] == ["N", 128, 112, 112]


@pytest.mark.parametrize("name", GENERATED)
def test_generated_model_runs_at_batch_1_and_32_with_finite_input_dependent_logits(generated_bytes, name):
    session = ort.InferenceSession(generated_bytes[name], providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(7)
    single = rng.random((1, 3, 224, 224), dtype=np.float32)
    (logits_1,) = session.run(["logits"], {"input": single})
    assert logits_1.shape == (1, 1000) and logits_1.dtype == np.float32

    batch = rng.random((32, 3, 224, 224), dtype=np.float32)
    batch[0] = single[0]
    batch[1] = 0.0
    (logits_32,) = session.run(["logits"], {"input": batch})
    assert logits_32.shape == (32, 1000)
    assert np.isfinite(logits_32).all()
    np.testing.assert_allclose(logits_32[0], logits_1[0], rtol=1e-4, atol=1e-4)
    assert logits_32.std() > 0.1                                   # not collapsed to a constant
    assert np.abs(logits_32[2] - logits_32[3]).max() > 1e-3        # depends on the input
    assert np.abs(logits_32[1] - logits_32[2]).max() > 1e-2


def test_ocr_files_equal_wheel_members_byte_for_byte(prepared_engines, wheel):
    with zipfile.ZipFile(wheel) as zf:
        for name, member in prep.OCR_MEMBERS.items():
            assert prep.model_path(prepared_engines, name).read_bytes() == zf.read(member.path), name


@pytest.mark.parametrize("name", ["ocr_det", "ocr_cls", "ocr_rec"])
def test_ocr_onnx_tensor_names_match_config(prepared_engines, model_repository, name):
    session = ort.InferenceSession(
        str(prep.model_path(prepared_engines, name)), providers=["CPUExecutionProvider"])
    config = model_repository.get(name).config
    assert [i.name for i in session.get_inputs()] == [t.name for t in config.inputs]
    assert [o.name for o in session.get_outputs()] == [t.name for t in config.outputs]


def test_repository_indexes_and_loads_every_model(model_repository: ModelRepository):
    assert model_repository.names() == [
        "all-MiniLM-L6-v2", "embed", "mid_cnn", "ocr", "ocr_cls", "ocr_det", "ocr_rec", "resnet18", "simple", "simple_identity",
        "simple_string", "tiny_cnn"]
    for entry in model_repository.entries():
        if entry.config.pipeline:
            continue
        host = ModelHost(entry, backend="onnxruntime").load()
        try:
            assert host.ready and host.engine is not None and host.engine.backend == "onnxruntime"
        finally:
            host.unload()


def test_prepare_fills_an_empty_root_then_skips_everything(tmp_path, wheel):
    lines: list[str] = []
    written = prep.prepare(tmp_path, cache_dir=wheel.parent, progress=lines.append)
    names = ["ocr_det", "ocr_cls", "ocr_rec", prep.MINILM, "tiny_cnn", "mid_cnn", "resnet18", "simple", "simple_string",
             "simple_identity"]
    encoder = prep.model_path(tmp_path, prep.MINILM)
    assert written == [prep.model_path(tmp_path, n) for n in names[:4]] + [encoder.parent / "tokenizer.json"] + [
        prep.model_path(tmp_path, n) for n in names[4:]]
    assert any("extracted" in line for line in lines)
    for name in GENERATED:
        assert hashlib.sha256(prep.model_path(tmp_path, name).read_bytes()).hexdigest() == prep.GENERATED_SHA256[name]

    mtimes = {p: p.stat().st_mtime_ns for p in written}
    assert prep.prepare(tmp_path, cache_dir=wheel.parent, progress=lambda line: None) == []
    assert {p: p.stat().st_mtime_ns for p in written} == mtimes
    assert not list(tmp_path.rglob("*.tmp"))


def test_prepare_rewrites_a_corrupted_file_only(tmp_path, wheel):
    prep.prepare(tmp_path, cache_dir=wheel.parent, progress=lambda line: None)
    broken = [prep.model_path(tmp_path, "ocr_cls"), prep.model_path(tmp_path, "tiny_cnn")]
    for path in broken:
        path.write_bytes(b"not a model")
    assert prep.prepare(tmp_path, cache_dir=wheel.parent, progress=lambda line: None) == broken
    assert hashlib.sha256(broken[0].read_bytes()).hexdigest() == prep.OCR_MEMBERS["ocr_cls"].sha256


def test_wheel_member_with_wrong_hash_is_refused(tmp_path):
    fake = tmp_path / "rapidocr_onnxruntime-1.4.4-py3-none-any.whl"
    with zipfile.ZipFile(fake, "w") as zf:
        zf.writestr(prep.OCR_MEMBERS["ocr_det"].path, b"tampered")
    with pytest.raises(prep.PrepareError, match="SHA-256"):
        prep.prepare_ocr(tmp_path, cache_dir=tmp_path, progress=lambda line: None)
    assert not prep.model_path(tmp_path, "ocr_det").exists()


def test_cli_reports_a_missing_root_with_exit_status_1(tmp_path, capsys):
    assert prep.main(["--root", str(tmp_path / "missing")]) == 1
    assert "does not exist" in capsys.readouterr().err
