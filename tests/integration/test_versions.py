"""Versions (issue 14, item 3) on a running server: two versions of one pool model served side by
side (``version_policy: {all: {}}``), each by its route and by tritonclient.http's
``model_version``, with different outputs that match ONNX Runtime run directly on that version's
file; a version not served answers 404 naming the served ones; metadata and the repository index
list both; a dedicated model serves its newest only.

A second application ("versions", under /versions) serves a temporary repository: ``cnn``
(pool; version 1 is tiny_cnn, version 2 the same graph with other weights, seed 5) and
``simple_dedicated`` (Triton's ``simple`` on a dedicated deployment, versions 1 and 2 on disk),
every model loaded at start under explicit model control, through two router replicas (a
version loaded through one is listed by both: the last test).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import requests
import yaml

from ..unit.test_versions import versioned_repository
from .conftest import REPOSITORY, wait_ready

pytestmark = pytest.mark.integration

PREFIX = "/versions"
X = np.random.default_rng(11).random((2, 3, 224, 224), dtype=np.float32)


@pytest.fixture(scope="module")
def versions(serve_instance, tmp_path_factory):
    """(base URL, repository root) of the application with versioned models."""
    from deployments.app import delete_server, run_applications

    root = versioned_repository(tmp_path_factory.mktemp("versions-repo"), {1: 0, 2: 5}, {"all": {}})
    raw = yaml.safe_load((Path(REPOSITORY) / "simple" / "config.yaml").read_text())
    raw.update(deployment={"mode": "dedicated"}, version_policy={"all": {}})
    (root / "simple_dedicated").mkdir()
    (root / "simple_dedicated" / "config.yaml").write_text(yaml.safe_dump(raw))
    for version in (1, 2):
        (root / "simple_dedicated" / str(version)).mkdir()
        shutil.copy(Path(REPOSITORY) / "simple" / "1" / "model.onnx", root / "simple_dedicated" / str(version))
    run_applications({"repository": str(root), "pool": {"max_num_models_per_replica": 2},
                      "model_control_mode": "explicit", "startup_models": ["*"], "router": {"num_replicas": 2}},
                     name="versions", route_prefix=PREFIX)
    url = f"{serve_instance}{PREFIX}"
    wait_ready(url)
    yield url, root
    delete_server("versions")


def infer(url: str, route: str) -> requests.Response:
    body = {"inputs": [{"name": "input", "shape": list(X.shape), "datatype": "FP32", "data": X.ravel().tolist()}]}
    return requests.post(f"{url}/v2/models/{route}/infer", json=body)


def test_two_versions_of_a_pool_model_serve_side_by_side_each_by_its_route(versions):
    url, root = versions
    expected = {v: ort.InferenceSession(str(root / "cnn" / str(v) / "model.onnx")).run(None, {"input": X})[0]
                for v in (1, 2)}
    assert not np.allclose(expected[1], expected[2])
    for route, version in (("cnn/versions/1", 1), ("cnn/versions/2", 2), ("cnn", 2)):
        r = infer(url, route)
        assert r.status_code == 200, r.text
        assert r.json()["model_version"] == str(version)
        got = np.array(r.json()["outputs"][0]["data"], np.float32).reshape(expected[version].shape)
        np.testing.assert_allclose(got, expected[version], rtol=1e-4, atol=1e-5)
    memory = requests.get(f"{url}/v2/memory").json()["pool"]["models"]
    assert {key: memory[key]["state"] for key in ("cnn", "cnn@1")} == {"cnn": "ready", "cnn@1": "ready"}

    r = infer(url, "cnn/versions/3")
    assert r.status_code == 404
    assert r.json()["error"].startswith("Request for unknown model: 'cnn' version 3 is not found")
    assert "versions: [1, 2]" in r.json()["error"]
    assert requests.get(f"{url}/v2/models/cnn").json()["versions"] == ["1", "2"]
    assert requests.get(f"{url}/v2/models/cnn/versions/1/ready").status_code == 200
    assert requests.get(f"{url}/v2/models/cnn/versions/1/config").json()["version_policy"] == {"all": {}}
    deadline = time.monotonic() + 30  # the index reads the pool replicas' reports, sent once a second
    while True:
        index = [(i["name"], i["version"], i["state"]) for i in requests.post(f"{url}/v2/repository/index").json()]
        if ("cnn", "1", "READY") in index and ("cnn", "2", "READY") in index:
            break
        assert time.monotonic() < deadline, index
        time.sleep(0.5)


def test_tritonclient_picks_each_version_by_model_version(versions):
    import tritonclient.http as httpclient

    url, root = versions
    client = httpclient.InferenceServerClient(url.removeprefix("http://"), network_timeout=120)
    for version in ("1", "2"):
        expected = ort.InferenceSession(str(root / "cnn" / version / "model.onnx")).run(None, {"input": X})[0]
        tensor = httpclient.InferInput("input", list(X.shape), "FP32")
        tensor.set_data_from_numpy(X)  # binary tensor data
        result = client.infer("cnn", [tensor], model_version=version)
        assert result.get_response()["model_version"] == version
        np.testing.assert_allclose(result.as_numpy("logits"), expected, rtol=1e-4, atol=1e-5)
        assert client.is_model_ready("cnn", version)
        assert client.get_model_metadata("cnn", version)["versions"] == ["1", "2"]
    client.close()


def test_a_dedicated_model_serves_its_newest_version_only(versions):
    url, _ = versions
    pair = [{"name": f"INPUT{i}", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))} for i in range(2)]
    r = requests.post(f"{url}/v2/models/simple_dedicated/versions/2/infer", json={"inputs": pair})
    assert r.status_code == 200, r.text
    r = requests.post(f"{url}/v2/models/simple_dedicated/versions/1/infer", json={"inputs": pair})
    assert r.status_code == 404
    assert "served versions: [2] (a dedicated model serves its newest only)" in r.json()["error"]
    assert requests.get(f"{url}/v2/models/simple_dedicated").json()["versions"] == ["2"]


def test_a_new_version_with_a_truncated_model_file_fails_its_load_and_changes_nothing(versions):
    """A truncated ``model.onnx`` in a new version folder failed the load, and the versions that
    served until then were gone: the pool model and the dedicated one answered 503 "not loaded".
    Now the load answers 500 naming the version's file, and every version served before answers
    as before (the new file is checked before the old versions are unloaded)."""
    url, root = versions
    pair = [{"name": f"INPUT{i}", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))} for i in range(2)]
    cases = (("cnn", 4, root / "cnn" / "1" / "model.onnx"),
             ("simple_dedicated", 3, root / "simple_dedicated" / "2" / "model.onnx"))
    try:
        for name, version, source in cases:
            data = source.read_bytes()
            (root / name / str(version)).mkdir()
            (root / name / str(version) / "model.onnx").write_bytes(data[:len(data) // 3])
            r = requests.post(f"{url}/v2/repository/models/{name}/load", timeout=120)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error.startswith(f"failed to load '{name}': model '{name}': its model file {name}/{version}/model.onnx "
                                    "is not a valid ONNX model: it does not parse as one"), error
            assert error.endswith("as before"), error
        for version in (1, 2):
            r = infer(url, f"cnn/versions/{version}")
            expected = ort.InferenceSession(str(root / "cnn" / str(version) / "model.onnx")).run(None, {"input": X})[0]
            assert r.status_code == 200 and r.json()["model_version"] == str(version), r.text
            np.testing.assert_allclose(np.array(r.json()["outputs"][0]["data"], np.float32).reshape(expected.shape),
                                       expected, rtol=1e-4, atol=1e-5)
        r = requests.post(f"{url}/v2/models/simple_dedicated/infer", json={"inputs": pair})
        assert r.status_code == 200 and r.json()["model_version"] == "2", r.text
    finally:
        for name, version, _ in cases:
            shutil.rmtree(root / name / str(version), ignore_errors=True)


def index_versions(url: str, model: str) -> list[str] | None:
    """``model``'s versions in one repository index answer (None: no answer in time)."""
    try:
        index = requests.post(f"{url}/v2/repository/index", timeout=10).json()
    except (requests.ConnectionError, requests.Timeout):
        return None
    return sorted(i["version"] for i in index if i["name"] == model)


def test_a_version_loaded_through_one_router_replica_is_listed_by_every_one(versions):
    """The router replica that did not take the load never read the folder of a model it knew
    again: its index kept listing versions 1 and 2 while the pool served 1, 2 and 3. Runs last:
    it adds version 3."""
    url, root = versions
    versioned_repository(root, {3: 6}, {"all": {}})
    r = requests.post(f"{url}/v2/repository/models/cnn/load", timeout=120)
    assert r.status_code == 200, r.text
    r = infer(url, "cnn/versions/3")
    expected = ort.InferenceSession(str(root / "cnn" / "3" / "model.onnx")).run(None, {"input": X})[0]
    assert r.status_code == 200 and r.json()["model_version"] == "3", r.text
    np.testing.assert_allclose(np.array(r.json()["outputs"][0]["data"], np.float32).reshape(expected.shape),
                               expected, rtol=1e-4, atol=1e-5)
    deadline, answers = time.monotonic() + 30, []
    while time.monotonic() < deadline:  # both replicas answer among 20 (they follow within a second)
        answers = [index_versions(url, "cnn") for _ in range(20)]
        if all(a == ["1", "2", "3"] for a in answers):
            break
        time.sleep(0.5)
    assert all(a == ["1", "2", "3"] for a in answers), answers
