"""``repository: s3://models/<prefix>`` end to end: ``make check`` and ``make serve``'s runner
(``python -m deployments.run``) against a real S3 server (SeaweedFS, ``tests/seaweed.py``)
reached through a TCP proxy the test can slow down; explicit model control. Models uploaded
answer as the same files in ``engines/``; one uploaded after the start, and a new version,
load through the API; the store slowed or stopped fails a load with 503 naming model and store
while loaded models keep serving; no answer, index, memory status or log carries the
credentials."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import requests
import yaml

from ..seaweed import DelayProxy
from .conftest import _free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
ENGINES = ROOT / "engines"


@pytest.fixture(scope="module")
def remote_serve(seaweedfs, prepared_engines, tmp_path_factory):
    """The runner on a repository of tiny_cnn and simple in the store (every model loaded at
    start); yields (base URL, proxy, prefix URL, config path, env, output file)."""
    tmp = tmp_path_factory.mktemp("object_store")
    prefix = f"serve{uuid.uuid4().hex[:6]}"
    for name in ("tiny_cnn", "simple"):
        seaweedfs.upload(prepared_engines / name, f"{prefix}/{name}")
    proxy = DelayProxy(("127.0.0.1", seaweedfs.port))
    port = _free_port()
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config["http_options"]["port"] = port
    config["applications"] = config["applications"][:1]
    url = f"s3://{seaweedfs.bucket}/{prefix}"
    config["applications"][0]["args"].update(repository=url, model_control_mode="explicit", startup_models=["*"])
    path = tmp / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{**seaweedfs.env, "AWS_ENDPOINT_URL": proxy.endpoint},
               TRT_SERVE_CACHE_DIR=str(tmp / "cache"), TRT_SERVE_STORE_ATTEMPTS="2", TRT_SERVE_STORE_TIMEOUT_S="3",
               ORT_INTRA_OP_THREADS="1")
    env.pop("RAY_ADDRESS", None)
    subprocess.run([sys.executable, "-m", "deployments.check", "--write", str(path)], cwd=ROOT, env=env, check=True,
                   capture_output=True, timeout=120)  # the pool's application, from the store's models
    log = tmp / "out.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "deployments.run", str(path)], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if requests.get(f"{base}/v2/health/ready", timeout=5).status_code == 200:
                    break
            except (requests.ConnectionError, requests.Timeout):
                pass
            time.sleep(0.5)
        else:
            raise AssertionError(f"the runner is not ready: {log.read_text()[-3000:]}")
        yield base, proxy, url, path, env, log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        proxy.close()


def _tiny_input() -> np.ndarray:
    return np.random.default_rng(1).standard_normal((1, 3, 224, 224)).astype(np.float32)


def _infer_tiny(base: str, path: str = "/v2/models/tiny_cnn/infer") -> requests.Response:
    x = _tiny_input()
    body = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
    return requests.post(base + path, json=body, timeout=60)


def _onnxruntime(path: Path) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {"input": _tiny_input()})[0]


def _index(base: str) -> dict[str, dict]:
    return {(i["name"], i.get("version")): i for i in requests.post(f"{base}/v2/repository/index", timeout=30).json()}


def _no_credentials(text: str, seaweedfs) -> bool:
    return seaweedfs.key_id not in text and seaweedfs.secret not in text


def test_make_check_validates_the_remote_repository(remote_serve):
    _, _, url, path, env, _ = remote_serve
    result = subprocess.run([sys.executable, "-m", "deployments.check", str(path)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"{path}: OK, 2 models ['simple', 'tiny_cnn']")


def test_models_from_the_store_answer_as_the_same_files_in_engines(remote_serve):
    base = remote_serve[0]
    r = _infer_tiny(base)
    assert r.status_code == 200, r.text
    got = np.array(r.json()["outputs"][0]["data"], dtype=np.float32).reshape(1, 1000)
    np.testing.assert_allclose(got, _onnxruntime(ENGINES / "tiny_cnn/1/model.onnx"), rtol=1e-6, atol=1e-6)


def test_a_model_uploaded_after_the_start_is_listed_then_loaded_and_served(remote_serve, seaweedfs):
    base, _, url, *_ = remote_serve
    prefix = url.split("/", 3)[3]
    seaweedfs.upload(ENGINES / "simple_identity", f"{prefix}/simple_identity")
    [line] = [line for (name, _), line in _index(base).items() if name == "simple_identity"]
    assert line["state"] == "UNAVAILABLE", line  # listed from the store, not loaded
    r = requests.post(f"{base}/v2/repository/models/simple_identity/load", timeout=120)
    assert r.status_code == 200, r.text
    texts = [f"t{i}" for i in range(16)]
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "BYTES", "data": texts}]}
    r = requests.post(f"{base}/v2/models/simple_identity/infer", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["outputs"][0]["data"] == texts, r.text


def test_a_new_version_uploaded_is_loaded_and_served_under_its_own_label(remote_serve, seaweedfs):
    base, _, url, *_ = remote_serve
    prefix = url.split("/", 3)[3]
    seaweedfs.upload(ENGINES / "tiny_cnn/1", f"{prefix}/tiny_cnn/2")
    r = requests.post(f"{base}/v2/repository/models/tiny_cnn/load", timeout=120)
    assert r.status_code == 200, r.text
    assert _index(base)[("tiny_cnn", "2")]["state"] == "READY"
    r = _infer_tiny(base, "/v2/models/tiny_cnn/versions/2/infer")
    assert r.status_code == 200 and r.json()["model_version"] == "2", r.text
    r = _infer_tiny(base, "/v2/models/tiny_cnn/versions/1/infer")
    assert r.status_code == 404 and "version 1 of model 'tiny_cnn' is not served" in r.json()["error"]


def test_memory_shows_the_node_cache_with_one_download_per_version(remote_serve):
    base = remote_serve[0]
    cache = requests.get(f"{base}/v2/memory", timeout=30).json()["model_cache"]
    node = next(n for n in cache["nodes"] if n["node"] == cache["node"])  # the router's (the only Ray node)
    versions = sorted((e["model"], e["version"]) for e in node["entries"])
    assert versions == [("simple", 1), ("simple_identity", 1), ("tiny_cnn", 1), ("tiny_cnn", 2)]
    assert node["downloads"] == 4 and node["hits"] > 0
    assert all(e["pinned"] for e in node["entries"] if (e["model"], e["version"]) != ("tiny_cnn", 1))


def test_a_truncated_upload_of_a_new_version_fails_its_load_and_the_served_version_keeps_serving(remote_serve,
                                                                                                   seaweedfs):
    """Runs after the memory test (it downloads version 3). A truncated model file in a new
    version failed the load and unloaded version 2, which had served until then."""
    base, _, url, *_ = remote_serve
    prefix = url.split("/", 3)[3]
    key = f"{seaweedfs.bucket}/{prefix}/tiny_cnn/3/model.onnx"
    data = (ENGINES / "tiny_cnn/1/model.onnx").read_bytes()
    fs = seaweedfs.filesystem()
    fs.pipe(key, data[:len(data) // 3])
    try:
        r = requests.post(f"{base}/v2/repository/models/tiny_cnn/load", timeout=120)
        assert (r.status_code, r.json()["error"]) == (
            400, "failed to load 'tiny_cnn': model 'tiny_cnn': its model file tiny_cnn/3/model.onnx is not a valid ONNX "
                 "model: it does not parse as one (damaged, truncated or another format); it serves versions [2] as "
                 "before"), r.text
        for path in ("/v2/models/tiny_cnn/infer", "/v2/models/tiny_cnn/versions/2/infer"):
            r = _infer_tiny(base, path)
            assert r.status_code == 200 and r.json()["model_version"] == "2", r.text
            got = np.array(r.json()["outputs"][0]["data"], dtype=np.float32).reshape(1, 1000)
            np.testing.assert_allclose(got, _onnxruntime(ENGINES / "tiny_cnn/1/model.onnx"), rtol=1e-6, atol=1e-6)
        # The kept reading is restored under a new generation: LOADING until every replica
        # reports it, then READY (it serves throughout, as checked above).
        deadline = time.monotonic() + 60
        while (state := _index(base)[("tiny_cnn", "2")]["state"]) != "READY" and time.monotonic() < deadline:
            time.sleep(0.5)
        assert state == "READY"
    finally:
        fs.rm(key)


def test_a_slow_store_fails_a_load_with_503_naming_model_and_store_while_loaded_models_serve(remote_serve, seaweedfs):
    base, proxy, url, *_ = remote_serve
    prefix = url.split("/", 3)[3]
    seaweedfs.upload(ENGINES / "mid_cnn", f"{prefix}/mid_cnn")
    proxy.set(delay_s=5.0)  # over TRT_SERVE_STORE_TIMEOUT_S (3 s), on every connection
    try:
        r = requests.post(f"{base}/v2/repository/models/mid_cnn/load", timeout=120)
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error.startswith(f"model 'mid_cnn': the model store {url} (endpoint {proxy.endpoint}) did not answer "
                                "in 2 tries"), error
        assert _no_credentials(r.text, seaweedfs)
        assert _infer_tiny(base).status_code == 200  # loaded models keep serving
    finally:
        proxy.set()
    assert requests.post(f"{base}/v2/repository/models/mid_cnn/load", timeout=120).status_code == 200


def test_a_truncated_upload_fails_its_load_and_the_other_models_serve(remote_serve, seaweedfs):
    base, _, url, *_ = remote_serve
    prefix = url.split("/", 3)[3]
    fs = seaweedfs.filesystem()
    fs.put_file(str(ENGINES / "resnet18/config.yaml"), f"{seaweedfs.bucket}/{prefix}/resnet18/config.yaml")
    data = (ENGINES / "resnet18/1/model.onnx").read_bytes()
    fs.pipe(f"{seaweedfs.bucket}/{prefix}/resnet18/1/model.onnx", data[:len(data) // 3])
    r = requests.post(f"{base}/v2/repository/models/resnet18/load", timeout=120)
    assert r.status_code == 400, r.text  # the uploaded file is the user's content
    assert r.json()["error"].startswith("failed to load 'resnet18': model 'resnet18': its model file "
                                        "resnet18/1/model.onnx is not a valid ONNX model"), r.text
    [line] = [line for (name, _), line in _index(base).items() if name == "resnet18"]
    assert line["state"] == "UNAVAILABLE" and line["reason"].startswith("failed to load"), line
    assert _infer_tiny(base).status_code == 200


def test_no_answer_index_memory_or_log_carries_the_credentials(remote_serve, seaweedfs):
    base, _, _, _, _, log = remote_serve
    answers = [requests.post(f"{base}/v2/repository/index", timeout=30).text,
               requests.get(f"{base}/v2/memory", timeout=30).text,
               requests.get(f"{base}/metrics", timeout=30).text,
               requests.post(f"{base}/v2/repository/models/nope/load", timeout=30).text]
    assert all(_no_credentials(text, seaweedfs) for text in answers)
    assert _no_credentials(log.read_text(errors="replace"), seaweedfs)  # the replicas' warnings included


def test_the_store_stopped_fails_a_load_with_503_and_loaded_models_serve(remote_serve, seaweedfs):
    base, proxy, url, *_ = remote_serve
    prefix = url.split("/", 3)[3]
    seaweedfs.upload(ENGINES / "simple_string", f"{prefix}/simple_string")
    proxy.close()  # the store is gone for the rest of this module
    r = requests.post(f"{base}/v2/repository/models/simple_string/load", timeout=120)
    assert r.status_code == 503 and r.json()["error"].startswith("model 'simple_string': the model store"), r.text
    assert _infer_tiny(base).status_code == 200
    assert requests.post(f"{base}/v2/repository/index", timeout=30).status_code == 200
