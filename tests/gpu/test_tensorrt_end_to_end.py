"""Real TensorRT end to end: build a plan on this GPU, serve it, compare with ONNX Runtime.

Runs where a TensorRT module can run on the GPU present (full TensorRT on any GPU it supports;
TensorRT-RTX on its RTX targets). Skipped with the reason elsewhere: the H200 machine has no
TensorRT, and TensorRT-RTX refuses compute capability 9.0.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper
import onnx

from deployments.runtime.backends import cuda
from deployments.runtime.tools import build
from deployments.runtime.contract.config import load_model_config
from deployments.runtime.residency.host import ModelHost
from deployments.runtime.backends.plans import PlanMismatch
from deployments.runtime.contract.repository import ModelRepository
from deployments.runtime.backends.tensorrt import TensorRTEngine
from tests.gpu.conftest import requires_tensorrt

pytestmark = requires_tensorrt

REPO_ENGINES = Path(__file__).resolve().parents[2] / "engines"
MiB = 1 << 20
# FP16 plans against FP32 ONNX Runtime: fp16 has a 10-bit mantissa (relative step ~1e-3);
# accumulated over a few layers, 2e-2 relative to the output's scale is the usual bound.
FP16_TOLERANCE = 2e-2


def small_repository(root: Path) -> Path:
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array((rng.standard_normal((16, 3, 3, 3)) / 5).astype(np.float32), "W")
    fc = numpy_helper.from_array((rng.standard_normal((16, 10)) / 4).astype(np.float32), "F")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["input", "W"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["c"], ["r"]),
         helper.make_node("GlobalAveragePool", ["r"], ["p"]),
         helper.make_node("Flatten", ["p"], ["f"]),
         helper.make_node("MatMul", ["f", "F"], ["logits"])],
        "small", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 64, 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])], [weight, fc])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (root / "small" / "1").mkdir(parents=True)
    onnx.save(model, root / "small" / "1" / "model.onnx")
    (root / "small" / "config.yaml").write_text(yaml.safe_dump({
        "max_batch_size": 16, "instances": 2,
        "inputs": [{"name": "input", "datatype": "FP32", "dims": [-1, 3, 64, 64],
                    "profile": {"min": [1, 3, 64, 64], "opt": [4, 3, 64, 64], "max": [16, 3, 64, 64]}}],
        "outputs": [{"name": "logits", "datatype": "FP32", "dims": [-1, 10]}]}))
    return root


def assert_close_fp16(got: np.ndarray, want: np.ndarray) -> None:
    scale = max(float(np.abs(want).max()), 1e-3)
    assert got.shape == want.shape
    assert float(np.abs(got - want).max()) <= FP16_TOLERANCE * scale


def test_a_plan_built_here_serves_outputs_equal_to_onnx_runtime_within_fp16_tolerance(tmp_path):
    root = small_repository(tmp_path)
    result, = build.build_all(root)
    assert result.status == "built", result.error
    entry = ModelRepository(root).get("small")
    session = ort.InferenceSession(str(entry.onnx_path()), providers=["CPUExecutionProvider"])
    model_host = ModelHost(entry, backend="tensorrt").load()
    assert model_host.engine.backend == "tensorrt"
    for batch in (1, 4, 16, 3):
        x = np.random.default_rng(batch).standard_normal((batch, 3, 64, 64)).astype(np.float32)
        assert_close_fp16(model_host.infer({"input": x})["logits"], session.run(None, {"input": x})[0])
    print(f"\n{result.manifest.flavour} {result.manifest.tensorrt_version} on "
          f"{result.manifest.built_on}: footprint {model_host.footprint()}")
    model_host.unload()


def test_unloading_returns_the_engines_and_contexts_device_memory(tmp_path):
    root = small_repository(tmp_path)
    build.build_all(root)
    config = load_model_config(root / "small" / "config.yaml")
    free_start, _ = cuda.mem_get_info()
    engine = TensorRTEngine(config, root / "small" / "1")
    contexts = [engine.create_context() for _ in range(2)]
    for c in contexts:
        c.infer({"input": np.ones((16, 3, 64, 64), np.float32)})
    held = free_start - cuda.mem_get_info()[0]
    footprint = engine.footprint()
    engine.close()
    left = free_start - cuda.mem_get_info()[0]
    print(f"\nheld {held / MiB:.1f} MiB loaded (footprint says {footprint.total(2) / MiB:.1f} MiB), "
          f"{left / MiB:.1f} MiB left after close, engine.released_bytes={engine.released_bytes}")
    assert held > 0 and footprint.context_bytes > 0
    assert left <= 16 * MiB  # the reference measurement: about 12 MB per model stays as driver cache


def test_a_plan_from_another_tensorrt_version_is_refused_at_load_not_deserialized(tmp_path):
    root = small_repository(tmp_path)
    result, = build.build_all(root)
    version_dir = root / "small" / "1"
    manifest_path = result.plan_path.with_suffix(".json")
    raw = json.loads(manifest_path.read_text())
    raw["tensorrt_version"] = "0.0.0"
    stem = result.plan_path.stem.replace(result.manifest.tensorrt_version, "0.0.0")
    raw["plan_file"] = f"{stem}.plan"
    shutil.move(result.plan_path, version_dir / f"{stem}.plan")
    (version_dir / f"{stem}.json").write_text(json.dumps(raw))
    os.remove(manifest_path)
    with pytest.raises(PlanMismatch, match=r"no TensorRT plan for .* plans there: .*0\.0\.0"):
        TensorRTEngine(load_model_config(root / "small" / "config.yaml"), version_dir)


@pytest.mark.parametrize("model", ["tiny_cnn", "resnet18", "ocr_cls", "ocr_rec"])
def test_repository_models_match_onnx_runtime_within_fp16_tolerance(model, tmp_path):
    source = REPO_ENGINES / model / "1" / "model.onnx"
    if not source.is_file():
        pytest.skip("the repository models are missing: run `make models`")
    (tmp_path / model / "1").mkdir(parents=True)
    shutil.copy(REPO_ENGINES / model / "config.yaml", tmp_path / model / "config.yaml")
    os.symlink(source, tmp_path / model / "1" / "model.onnx")
    result, = build.build_all(tmp_path)
    assert result.status == "built", result.error
    entry = ModelRepository(tmp_path).get(model)
    spec = entry.config.inputs[0]
    shape = tuple(spec.profile.opt) if spec.profile else tuple(spec.dims)
    x = np.random.default_rng(0).random(shape, dtype=np.float32)
    want = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"]).run(None, {spec.name: x})[0]
    model_host = ModelHost(entry, backend="tensorrt").load()
    assert_close_fp16(model_host.infer({spec.name: x})[entry.config.outputs[0].name], want)
    model_host.unload()
