"""Six models in one multiplexed pool under a byte budget below two thirds of their footprints, over HTTP:
every request answers 200 with the right output, and resident bytes never exceed the budget."""

from __future__ import annotations

import random
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import requests
import yaml

from .conftest import REPOSITORY

pytestmark = pytest.mark.integration

# The six footprints add up to about 4,100 MiB on ONNX Runtime (bench/memory_policies.py). The
# pool measures a model by RSS growth while its other models serve requests, which has read
# tiny_cnn's 2 x 515 MiB as 2 x 1,036 MiB on a loaded 2-core machine: the budget leaves room for
# such a reading of any one model, so the test checks eviction and answers, not RSS noise.
BUDGET_MIB = 2600
SHAPES = {"tiny_cnn": (1, 3, 224, 224), "mid_cnn": (1, 3, 224, 224), "resnet18": (1, 3, 224, 224),
          "ocr_det": (1, 3, 64, 96), "ocr_cls": (2, 3, 48, 192), "ocr_rec": (1, 3, 48, 120)}


@pytest.fixture(scope="module")
def pooled(serve_instance, tmp_path_factory):
    """An application whose six models all live in the pool (configs copied with ``mode: pool``)."""
    from deployments.app import delete_server, run_applications

    root = tmp_path_factory.mktemp("pooled")
    for name in SHAPES:
        config = yaml.safe_load(Path(REPOSITORY, name, "config.yaml").read_text())
        config["deployment"] = {"mode": "pool"}
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.yaml").write_text(yaml.safe_dump(config))
        (root / name / "1" / "model.onnx").symlink_to(Path(REPOSITORY, name, "1", "model.onnx"))
    run_applications({"repository": str(root), "pool": {
        "load_policy": "lru", "memory_budget_mib": BUDGET_MIB, "max_num_models_per_replica": 6}},
        name="pooled", route_prefix="/pooled")
    yield f"{serve_instance}/pooled", root
    delete_server("pooled")


def request(name: str, x: np.ndarray) -> dict:
    return {"id": name, "inputs": [{"name": "input" if "cnn" in name or name == "resnet18" else "x",
                                    "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}


def test_random_workload_under_budget_answers_everything_like_a_serial_run(pooled):
    url, root = pooled
    rng = np.random.default_rng(11)
    inputs = {n: rng.random(s, dtype=np.float32) for n, s in SHAPES.items()}
    expected = {}
    for n, x in inputs.items():
        session = ort.InferenceSession(str(root / n / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
        expected[n] = session.run(None, {session.get_inputs()[0].name: x})[0]
    pick = random.Random(5)
    order = [pick.choice(sorted(SHAPES)) for _ in range(36)]

    def call(name: str) -> tuple[str, requests.Response]:
        return name, requests.post(f"{url}/v2/models/{name}/infer", json=request(name, inputs[name]), timeout=120)

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(call, order))
    for name, r in results:
        assert r.status_code == 200, (name, r.text)
        out = r.json()["outputs"][0]
        got = np.array(out["data"], np.float32).reshape(out["shape"])
        np.testing.assert_allclose(got, expected[name], rtol=1e-4, atol=1e-5)

    memory = requests.get(f"{url}/v2/memory").json()["pool"]
    budget = BUDGET_MIB * 2**20
    assert memory["budget_bytes"] == budget and memory["load_policy"] == "lru"
    events = memory["events"]
    assert events and all(e["resident_bytes"] <= budget for e in events)
    kinds = {e["event"] for e in events}
    assert {"load", "evict", "reload"} <= kinds, kinds
    assert "refused" not in kinds
    assert memory["resident_bytes"] <= budget


def test_model_alone_over_budget_is_503_with_both_figures(serve_instance, tmp_path):

    from deployments.app import delete_server, run_applications

    (tmp_path / "resnet18" / "1").mkdir(parents=True)
    (tmp_path / "resnet18" / "config.yaml").write_text(Path(REPOSITORY, "resnet18", "config.yaml").read_text())
    (tmp_path / "resnet18" / "1" / "model.onnx").symlink_to(Path(REPOSITORY, "resnet18", "1", "model.onnx"))
    run_applications({"repository": str(tmp_path), "pool": {"memory_budget_mib": 50}},
              name="tiny-budget", route_prefix="/tiny-budget")
    try:
        x = np.zeros((1, 3, 224, 224), np.float32)
        r = requests.post(f"{serve_instance}/tiny-budget/v2/models/resnet18/infer", json=request("resnet18", x))
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert re.search(r"model 'resnet18' needs \d+\.\d MiB", error), error
        assert "memory budget of 50.0 MiB" in error
    finally:
        delete_server("tiny-budget")
