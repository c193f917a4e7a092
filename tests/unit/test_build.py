"""Plan builds with real TensorRT-RTX on the CPU: plans, manifests, staleness, profile errors.

TensorRT-RTX (pip ``tensorrt-rtx-cu13``, the ``tensorrt`` extra) builds without a GPU, so
these build real plans. Small models are made here with ``onnx.helper``; the last test builds
the six repository models that ``make models`` puts in ``engines/``.
"""

from __future__ import annotations

import json
import os
import shutil
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed (pip install -e '.[tensorrt]')")

from deployments.runtime.backends import trt_module
from deployments.runtime.tools import build  # noqa: E402
from deployments.runtime.contract.config import load_model_config  # noqa: E402
from deployments.runtime.contract.errors import ConfigError  # noqa: E402
from deployments.runtime.backends.plans import PlanManifest, PlanMismatch, file_sha256, find_plan, stale_reasons  # noqa: E402

REPO_ENGINES = Path(__file__).resolve().parents[2] / "engines"
SIX_MODELS = ("tiny_cnn", "mid_cnn", "resnet18", "ocr_det", "ocr_cls", "ocr_rec")


def conv_model(path: Path, dims=("N", 3, 32, 32), seed: int = 0, second_input: tuple | None = None) -> Path:
    """A conv -> global pool -> flatten model: input ``input`` (N, 3, H, W) -> ``logits`` (N, 8).

    With ``second_input`` (its dims), a second input ``bias`` (N, 8) is added to the logits.
    """
    rng = np.random.default_rng(seed)
    weight = numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "W")
    nodes = [helper.make_node("Conv", ["input", "W"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("GlobalAveragePool", ["c"], ["p"]),
             helper.make_node("Flatten", ["p"], ["f" if second_input else "logits"])]
    inputs = [helper.make_tensor_value_info("input", TensorProto.FLOAT, list(dims))]
    if second_input:
        nodes.append(helper.make_node("Add", ["f", "bias"], ["logits"]))
        inputs.append(helper.make_tensor_value_info("bias", TensorProto.FLOAT, list(second_input)))
    graph = helper.make_graph(nodes, "conv", inputs,
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 8])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)
    return path


def write_config(folder: Path, hw: tuple[int, int] = (32, 32), max_batch: int = 8, **extra) -> Path:
    h, w = hw
    config = {
        "max_batch_size": max_batch,
        "inputs": [{"name": "input", "datatype": "FP32", "dims": [-1, 3, h, w],
                    "profile": {"min": [1, 3, h, w], "opt": [2, 3, h, w], "max": [max_batch, 3, h, w]}}],
        "outputs": [{"name": "logits", "datatype": "FP32", "dims": [-1, 8]}],
        **extra,
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return folder / "config.yaml"


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A repository with one small model ``small`` (version 1) and one pipeline model."""
    write_config(tmp_path / "small")
    conv_model(tmp_path / "small" / "1" / "model.onnx")
    (tmp_path / "pipe").mkdir()
    (tmp_path / "pipe" / "config.yaml").write_text(yaml.safe_dump({
        "pipeline": "x", "inputs": [{"name": "i", "datatype": "BYTES", "dims": [1]}],
        "outputs": [{"name": "o", "datatype": "BYTES", "dims": [1]}]}))
    return tmp_path


def only(results: list[build.BuildResult]) -> build.BuildResult:
    assert len(results) == 1, results
    return results[0]


def test_small_model_builds_a_named_plan_and_a_complete_manifest_on_the_cpu(repo):
    result = only(build.build_all(repo))  # the pipeline model is skipped
    assert result.status == "built", result.error
    rtx = trt_module.load("tensorrt_rtx")
    version_dir = repo / "small" / "1"
    plans = sorted(p.name for p in version_dir.glob("*.plan"))
    assert plans == [f"model.tensorrt_rtx-{rtx.version}.sm80_86_89_120_121.plan"]
    assert (version_dir / plans[0]).stat().st_size > 0
    raw = json.loads((version_dir / plans[0]).with_suffix(".json").read_text())
    assert raw["model"] == "small" and raw["version"] == 1
    assert raw["flavour"] == "tensorrt_rtx" and raw["tensorrt_version"] == rtx.version
    assert raw["compute_capabilities"] == ["8.0", "8.6", "8.9", "12.0", "12.1"]
    assert raw["built_on"] == "cpu (no CUDA device)"
    assert "portable set" in raw["target_note"]
    assert raw["onnx_sha256"] == file_sha256(version_dir / "model.onnx")
    assert raw["plan_sha256"] == file_sha256(version_dir / plans[0])
    assert raw["plan_bytes"] == (version_dir / plans[0]).stat().st_size
    assert raw["profiles"] == [{"input": {"min": [1, 3, 32, 32], "opt": [2, 3, 32, 32], "max": [8, 3, 32, 32]}}]
    assert raw["precision"] == "fp16" and raw["precision_built"] == "onnx"  # strongly typed flavour
    assert raw["workspace_mib"] == 1024 and raw["timing_cache"] is None
    assert raw["build_s"] > 0 and datetime.fromisoformat(raw["built_at"]).tzinfo is not None


def test_a_second_build_keeps_the_fresh_plan(repo):
    first = only(build.build_all(repo))
    mtime = first.plan_path.stat().st_mtime_ns
    second = only(build.build_all(repo))
    assert second.status == "fresh" and second.plan_path.stat().st_mtime_ns == mtime
    assert only(build.build_all(repo, force=True)).status == "built"


def test_a_changed_onnx_file_makes_the_plan_stale_and_the_build_rebuilds_it(repo):
    first = only(build.build_all(repo))
    onnx_path = repo / "small" / "1" / "model.onnx"
    conv_model(onnx_path, seed=1)  # same graph, other weights
    config = load_model_config(repo / "small" / "config.yaml")
    reasons = stale_reasons(first.manifest, config, onnx_path, first.plan_path)
    assert reasons == ["the ONNX file changed since the plan was built (sha256 differs)"]
    again = only(build.build_all(repo))
    assert again.status == "built" and again.reasons == reasons
    assert again.manifest.onnx_sha256 == file_sha256(onnx_path) != first.manifest.onnx_sha256


def test_a_changed_profile_or_precision_in_the_config_makes_the_plan_stale(repo):
    first = only(build.build_all(repo))
    write_config(repo / "small", max_batch=4, tensorrt={"precision": "fp32"})
    config = load_model_config(repo / "small" / "config.yaml")
    reasons = stale_reasons(first.manifest, config, repo / "small" / "1" / "model.onnx", first.plan_path)
    assert [r.split(":")[0] for r in reasons] == ["profiles changed", "precision changed"]


def test_load_finds_the_fresh_plan_for_a_targeted_compute_capability(repo):
    result = only(build.build_all(repo))
    config = load_model_config(repo / "small" / "config.yaml")
    rtx = trt_module.load("tensorrt_rtx")
    plan_path, manifest = find_plan(config, repo / "small" / "1", "tensorrt_rtx", rtx.version, "8.6")
    assert plan_path == result.plan_path and manifest == result.manifest


def test_load_refuses_a_gpu_the_plan_was_not_built_for_and_lists_what_is_there(repo):
    only(build.build_all(repo))
    config = load_model_config(repo / "small" / "config.yaml")
    rtx = trt_module.load("tensorrt_rtx")
    with pytest.raises(PlanMismatch, match=r"no TensorRT plan for tensorrt_rtx .* on compute capability 9\.0; "
                                           r"plans there: model\.tensorrt_rtx-.*sm80_86_89_120_121\.plan .*make engines"):
        find_plan(config, repo / "small" / "1", "tensorrt_rtx", rtx.version, "9.0")
    with pytest.raises(PlanMismatch, match=r"no TensorRT plan for tensorrt 10\.13\.0\.35"):
        find_plan(config, repo / "small" / "1", "tensorrt", "10.13.0.35", "8.6")


def test_load_refuses_a_stale_or_truncated_plan_naming_the_reason(repo):
    result = only(build.build_all(repo))
    config = load_model_config(repo / "small" / "config.yaml")
    rtx = trt_module.load("tensorrt_rtx")
    conv_model(repo / "small" / "1" / "model.onnx", seed=2)
    with pytest.raises(PlanMismatch, match=r"model 'small'.*is stale: the ONNX file changed.*make engines"):
        find_plan(config, repo / "small" / "1", "tensorrt_rtx", rtx.version, "8.6")
    only(build.build_all(repo))
    with open(result.plan_path, "r+b") as f:
        f.truncate(1000)
    with pytest.raises(PlanMismatch, match=r"plan file is 1000 bytes, manifest says \d+ \(truncated or replaced\)"):
        find_plan(config, repo / "small" / "1", "tensorrt_rtx", rtx.version, "8.6")


def test_an_unreadable_manifest_is_a_plan_mismatch_not_a_crash(repo):
    result = only(build.build_all(repo))
    result.plan_path.with_suffix(".json").write_text("{not json")
    with pytest.raises(PlanMismatch, match=r"unreadable .*make engines"):
        PlanManifest.read(result.plan_path.with_suffix(".json"))
    assert only(build.build_all(repo)).status == "built"  # the build command just rebuilds


def _unchecked_source(folder: Path) -> build.ModelSource:
    """``folder``'s config as written, not checked against its ONNX file (the repository refuses
    one that contradicts the file: ``completion``), so that TensorRT's own check is reached."""
    return build.ModelSource(load_model_config(folder / "config.yaml"), 1, folder / "1")


def _rejection(source: build.ModelSource) -> build.ProfileRejected:
    rtx = trt_module.load("tensorrt_rtx")
    target, built_on, note = build.choose_target(rtx)
    with pytest.raises(build.ProfileRejected) as raised:
        build.build_plan(source, rtx, target, built_on=built_on, target_note=note)
    return raised.value


def test_a_profile_tensorrt_rejects_names_the_model_the_input_and_tensorrts_reason(repo):
    write_config(repo / "small", hw=(64, 64))  # the ONNX input is fixed at 32 x 32
    with pytest.raises(ConfigError, match=r"inputs\.0\.dims: \[-1, 3, 64, 64\], but .* axis 2 fixed to 32"):
        build.build_all(repo)  # the repository's check comes first
    error = _rejection(_unchecked_source(repo / "small"))
    assert (error.model, error.input) == ("small", "input")
    assert "Dimension mismatch for tensor input and profile 0" in error.reason  # TensorRT's words
    assert error.message.startswith("model 'small' input 'input': TensorRT rejected the optimization profile")
    assert build.main(["--root", str(repo), "--no-progress"]) == 1


def test_with_two_inputs_the_rejected_profile_names_the_input_at_fault(tmp_path):
    config = {
        "max_batch_size": 8,
        "inputs": [{"name": "input", "datatype": "FP32", "dims": [-1, 3, 32, 32],
                    "profile": {"min": [1, 3, 32, 32], "opt": [2, 3, 32, 32], "max": [8, 3, 32, 32]}},
                   {"name": "bias", "datatype": "FP32", "dims": [-1, 9],
                    "profile": {"min": [1, 9], "opt": [2, 9], "max": [8, 9]}}],
        "outputs": [{"name": "logits", "datatype": "FP32", "dims": [-1, 8]}],
    }
    (tmp_path / "two").mkdir()
    (tmp_path / "two" / "config.yaml").write_text(yaml.safe_dump(config))
    conv_model(tmp_path / "two" / "1" / "model.onnx", second_input=("N", 8))
    assert _rejection(_unchecked_source(tmp_path / "two")).input == "bias"


def test_a_symbolic_dim_name_shared_by_axes_of_different_sizes_is_split_so_the_profile_builds(repo):
    # PP-OCR's classifier names H and W both '?'; TensorRT would read 48 != 192 as a contradiction.
    write_config(repo / "small", hw=(48, 192))
    conv_model(repo / "small" / "1" / "model.onnx", dims=("N", 3, "?", "?"))
    result = only(build.build_all(repo))
    assert result.status == "built", result.error
    assert any("symbolic dim '?' renamed 'input.2'" in note for note in result.manifest.notes)


def test_extra_profiles_from_the_config_are_built_and_recorded(repo):
    small = {"input": {"min": [1, 3, 32, 32], "opt": [1, 3, 32, 32], "max": [2, 3, 32, 32]}}
    write_config(repo / "small", tensorrt={"profiles": [small], "workspace_mib": 256})
    result = only(build.build_all(repo))
    assert result.status == "built", result.error
    assert len(result.manifest.profiles) == 2 and result.manifest.profiles[1] == small
    assert result.manifest.workspace_mib == 256


def test_an_extra_profile_outside_profile_0_is_a_config_error(repo):
    big = {"input": {"min": [1, 3, 32, 32], "opt": [1, 3, 32, 32], "max": [64, 3, 32, 32]}}
    write_config(repo / "small", tensorrt={"profiles": [big]})
    with pytest.raises(ConfigError, match=r"tensorrt\.profiles\[0\].*axis 0 range \[1, 64\] is outside profile 0's \[1, 8\]"):
        load_model_config(repo / "small" / "config.yaml")


def test_a_model_without_onnx_fails_alone_and_the_others_still_build(repo):
    write_config(repo / "empty")
    results = {r.model: r for r in build.build_all(repo)}
    assert results["small"].status == "built"
    assert results["empty"].status == "failed" and "run `make models`" in results["empty"].error.message


def test_full_tensorrt_without_a_gpu_is_a_clear_error_not_a_crash():
    full = trt_module.TensorRTModule("tensorrt", SimpleNamespace(BuilderFlag=SimpleNamespace(FP16=1)), "10.13.0.35")
    with pytest.raises(ConfigError, match=r"needs a CUDA GPU to build on.*--flavour tensorrt_rtx"):
        build.choose_target(full)


def test_an_rtx_target_it_does_not_support_is_refused_by_name():
    rtx = trt_module.load("tensorrt_rtx")
    target, _, note = build.choose_target(rtx, ["8.6"])
    assert target.compute_capabilities == ("8.6",) and "asked for" in note
    with pytest.raises(ConfigError, match=r"cannot target compute capability \['9\.0'\]"):
        build.choose_target(rtx, ["9.0"])


@pytest.mark.skipif(not all((REPO_ENGINES / m / "1" / "model.onnx").is_file() for m in SIX_MODELS),
                    reason="the repository models are missing: run `make models`")
def test_all_six_repository_models_build_real_plans_on_the_cpu(tmp_path):
    # Build from a copy of engines/ (configs copied, ONNX files linked) so the real repository
    # is not written to.
    for model in [*SIX_MODELS, "ocr"]:
        shutil.copytree(REPO_ENGINES / model, tmp_path / model,
                        ignore=lambda d, names: [n for n in names if n != "config.yaml" and not n.isdigit()])
        if model != "ocr":
            os.symlink(REPO_ENGINES / model / "1" / "model.onnx", tmp_path / model / "1" / "model.onnx")
    results = {r.model: r for r in build.build_all(tmp_path)}
    assert sorted(results) == sorted(SIX_MODELS)  # the ocr pipeline has no plan
    for model, result in results.items():
        assert result.status == "built", result.error
        assert result.plan_path.is_file() and result.plan_path.stat().st_size == result.manifest.plan_bytes
        manifest = PlanManifest.read(result.plan_path.with_suffix(".json"))
        config = load_model_config(tmp_path / model / "config.yaml")
        assert manifest.model == model and manifest.profiles[0] == {
            t.name: {"min": list(t.profile.min), "opt": list(t.profile.opt), "max": list(t.profile.max)}
            for t in config.inputs}
        assert manifest.onnx_sha256 == file_sha256(REPO_ENGINES / model / "1" / "model.onnx")
        assert stale_reasons(manifest, config, tmp_path / model / "1" / "model.onnx", result.plan_path) == []


def test_the_progress_display_follows_the_builders_phases(repo, capsys):
    monitor = build.progress_monitor(trt_module.load("tensorrt_rtx"))
    assert monitor is not None  # TensorRT-RTX has IProgressMonitor
    assert only(build.build_all(repo, progress=True)).status == "built"
    drawn = capsys.readouterr().err
    assert "plans" in drawn and "Building engine" in drawn  # tqdm bars: models, then TensorRT's phases


def test_build_steps_compose_and_each_runs_alone(repo):
    """parse_network -> add_profiles -> configure_builder -> build_serialized -> save_plan, as
    ``build_plan`` composes them; each step is callable on its own."""
    rtx = trt_module.load("tensorrt_rtx")
    (source,), failures = build.find_sources(repo)
    assert failures == [] and source.config.name == "small" and source.version == 1
    profiles = build.requested_profiles(source.config)
    parsed = build.parse_network(source, rtx, profiles)
    assert [parsed.network.get_input(i).name for i in range(parsed.network.num_inputs)] == ["input"]
    builder_config = parsed.builder.create_builder_config()
    build.add_profiles(parsed, builder_config, rtx, source.config, profiles)
    assert builder_config.num_optimization_profiles == 1
    target, _, _ = build.choose_target(rtx)
    assert build.configure_builder(parsed, builder_config, rtx, source.config, target) == "onnx"
    assert any("strongly typed" in note for note in parsed.notes)
    plan, build_s = build.build_serialized(parsed, builder_config, source.config)
    assert len(plan) > 0 and build_s > 0
    manifest = PlanManifest(
        model="small", version=1, flavour=rtx.flavour, tensorrt_version=rtx.version,
        compute_capabilities=list(target.compute_capabilities), target_note="", built_on="", built_at="",
        build_s=build_s, onnx_file="model.onnx", onnx_sha256="", onnx_bytes=0, plan_file="", plan_sha256="",
        plan_bytes=len(plan), profiles=profiles, precision="fp16", precision_built="onnx", workspace_mib=1024)
    build.save_plan(source, target, plan, manifest)
    assert target.plan_path(source.version_dir).read_bytes() == bytes(plan)
    assert PlanManifest.read(target.manifest_path(source.version_dir)).plan_bytes == len(plan)


def test_network_whose_inputs_disagree_with_the_config_is_a_build_error_naming_the_input(repo):
    rtx = trt_module.load("tensorrt_rtx")
    (source,), _ = build.find_sources(repo)
    parsed = build.parse_network(source, rtx, build.requested_profiles(source.config))
    renamed = source.config.model_copy(update={"inputs": (source.config.inputs[0].model_copy(update={"name": "x"}),)})
    with pytest.raises(build.BuildError, match="model 'small' input 'x': not an input of the ONNX network"):
        build.check_network_io(parsed.network, renamed)


def test_find_sources_reports_a_model_without_versions_and_an_unknown_name_per_model(repo):
    (repo / "empty").mkdir()
    write_config(repo / "empty")
    (repo / "empty" / "²").mkdir()  # not an ASCII version number: ignored, as the server ignores it
    conv_model(repo / "empty" / "²" / "model.onnx")
    sources, failures = build.find_sources(repo, ["small", "empty", "nope"])
    assert [s.config.name for s in sources] == ["small"]
    assert {f.model: f.error.reason for f in failures} == {
        "nope": f"no model folder {repo}/nope",
        "empty": f"no <version>/model.onnx under {repo / 'empty'}; run `make models`"}

def test_set_shape_raising_for_one_model_fails_that_model_and_the_others_still_build(repo, monkeypatch):
    # Full TensorRT raises from IOptimizationProfile.set_shape (e.g. a rank that differs) where
    # TensorRT-RTX logs; the real RTX builder with set_shape raising for one input stands for it.
    write_config(repo / "other")
    conv_model(repo / "other" / "1" / "model.onnx", seed=1)
    trt = trt_module.load("tensorrt_rtx").module
    real_set_shape = trt.IOptimizationProfile.set_shape

    def set_shape(self, name, *dims):
        if self is profiles_of_other[-1]:
            raise RuntimeError("setShape: min/opt/max ranks differ from the network's")
        return real_set_shape(self, name, *dims)

    profiles_of_other: list = []
    real_create = trt.Builder.create_optimization_profile
    building: list[str] = []
    real_build_plan = build.build_plan

    def build_plan(source, *args, **kwargs):
        building.append(source.config.name)
        return real_build_plan(source, *args, **kwargs)

    def create_optimization_profile(self):
        profile = real_create(self)
        if building[-1] == "other":
            profiles_of_other.append(profile)
        return profile

    monkeypatch.setattr(build, "build_plan", build_plan)
    monkeypatch.setattr(trt.Builder, "create_optimization_profile", create_optimization_profile)
    monkeypatch.setattr(trt.IOptimizationProfile, "set_shape", set_shape)
    results = {r.model: r for r in build.build_all(repo, flavour="tensorrt_rtx")}
    assert results["small"].status == "built", results["small"].error
    assert results["other"].status == "failed"
    error = results["other"].error
    assert isinstance(error, build.ProfileRejected) and (error.model, error.input) == ("other", "input")
    assert "set_shape raised: setShape: min/opt/max ranks differ" in error.message


def test_any_unexpected_exception_in_one_build_fails_that_model_only(repo, monkeypatch):
    write_config(repo / "other")
    conv_model(repo / "other" / "1" / "model.onnx", seed=1)
    real_build_plan = build.build_plan

    def build_plan(source, *args, **kwargs):
        if source.config.name == "other":
            raise MemoryError("std::bad_alloc")
        return real_build_plan(source, *args, **kwargs)

    monkeypatch.setattr(build, "build_plan", build_plan)
    results = {r.model: r for r in build.build_all(repo, flavour="tensorrt_rtx")}
    assert results["small"].status == "built"
    assert results["other"].status == "failed"
    assert results["other"].error.message == "model 'other': the build raised MemoryError: std::bad_alloc"


def test_network_outputs_the_config_does_not_declare_are_not_outputs_of_the_plan(repo):
    path = repo / "small" / "1" / "model.onnx"
    model = onnx.load(path)
    model.graph.output.append(helper.make_tensor_value_info("p", TensorProto.FLOAT, ["N", 8, 1, 1]))
    onnx.save(model, path)
    result = only(build.build_all(repo, flavour="tensorrt_rtx"))
    assert result.status == "built", result.error
    assert "network outputs ['p'] are not declared in config.yaml: not outputs of the plan" in result.manifest.notes
