"""Model control in the engine layer and the router, without Ray: the cache's ``load`` /
``unload`` / ``add``, the repository read again at run time, the dedicated deployment's gate,
and the router's repository routes over a fake client (``tests/integration/test_model_control.py``
runs the real thing)."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from starlette.testclient import TestClient

from deployments.ingress import RouterApp, RouterOptions
from deployments.control import initial_state, outcome
from deployments.runtime.contract.config import CacheOptions
from deployments.runtime.contract.errors import ConfigError, ModelNotFound, ModelNotReady
from deployments.runtime.contract.repository import ModelRepository
from deployments.runtime.residency.cache import ModelCache
from deployments.runtime.residency.gate import Gate

ENGINES = Path(__file__).resolve().parents[2] / "engines"
PAIR = {"INPUT0": np.arange(16, dtype=np.int32)[None], "INPUT1": np.ones((1, 16), np.int32)}


def add_model(root: Path, name: str, source: str = "simple", **changes: Any) -> None:
    raw = yaml.safe_load((ENGINES / source / "config.yaml").read_text())
    raw.update(changes)
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.yaml").write_text(yaml.safe_dump(raw))
    shutil.copy(ENGINES / source / "1" / "model.onnx", root / name / "1" / "model.onnx")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    add_model(tmp_path, "simple")
    return tmp_path


def test_repository_reads_a_folder_added_after_start_and_refuses_a_bad_one_unchanged(root):
    repo = ModelRepository(root)
    add_model(root, "late")
    assert repo.names() == ["simple"] and repo.folders() == ["late", "simple"]
    assert repo.read("late").latest == 1 and repo.names() == ["late", "simple"]
    (root / "late" / "config.yaml").write_text((root / "late" / "config.yaml").read_text() + "max_batch_sise: 4\n")
    with pytest.raises(ConfigError, match=rf"^{root}/late/config.yaml: max_batch_sise: unknown field; allowed: name, "):
        repo.read("late")
    assert repo.get("late").config.max_batch_size == 8  # the index keeps what it had
    for name in ("missing", "../simple", "simple/1"):
        with pytest.raises(ModelNotFound, match="no model folder"):
            repo.read(name)


def test_cache_unload_waits_for_the_request_holding_the_model_then_refuses_until_load(root):
    cache = ModelCache(ModelRepository(root), ["simple"], CacheOptions(load_policy="lazy"))
    lease = cache.acquire("simple")
    lease.__enter__()  # a request in flight
    done = threading.Event()
    unloader = threading.Thread(target=lambda: (cache.unload("simple"), done.set()))
    unloader.start()
    deadline = time.monotonic() + 30  # the unloader has refused new requests: it waits for the lease
    while cache.status()["models"]["simple"]["enabled"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not done.is_set() and cache.status()["models"]["simple"]["state"] == "ready"
    with pytest.raises(ModelNotReady, match="^Request for unknown model: 'simple' has no available versions; "):
        cache.infer("simple", PAIR)  # new requests are refused at once
    lease.__exit__(None, None, None)
    unloader.join(5)
    status = cache.status()["models"]["simple"]
    assert done.is_set() and (status["state"], status["enabled"], status["evictions"]) == ("absent", False, 0)
    assert [e["event"] for e in cache.timeline()] == ["load", "unload"]
    cache.load("simple")
    assert cache.status()["models"]["simple"]["state"] == "ready"
    np.testing.assert_array_equal(cache.infer("simple", PAIR)["OUTPUT0"], PAIR["INPUT0"] + 1)
    cache.close()


def test_cache_adds_a_model_unloaded_and_serves_it_once_loaded(root):
    repo = ModelRepository(root)
    cache = ModelCache(repo, ["simple"], CacheOptions(load_policy="lazy"))
    add_model(root, "late")
    cache.add(repo.read("late"), enabled=False)
    assert cache.names == ["late", "simple"] and not cache.serves("late")
    with pytest.raises(ModelNotReady):
        cache.infer("late", PAIR)
    cache.load("late")
    np.testing.assert_array_equal(cache.infer("late", PAIR)["OUTPUT1"], PAIR["INPUT0"] - 1)
    cache.close()


def test_gate_close_waits_for_the_requests_inside_and_refuses_new_ones():
    gate = Gate("m")
    closed = threading.Event()
    with gate.request():
        closer = threading.Thread(target=lambda: (gate.close(), closed.set()))
        closer.start()
        time.sleep(0.1)
        assert not closed.is_set()
    closer.join(5)
    assert closed.is_set()
    with pytest.raises(ModelNotReady, match="'m' has no available versions"):
        with gate.request():
            pass
    gate.open()
    with gate.request():
        pass


def test_a_config_error_reported_by_a_replica_becomes_400():
    assert type(outcome(ConfigError("x: bad"), True)["error"]).__name__ == "InvalidInput"
    assert outcome(None, True, "onnxruntime") == {"loaded": True, "backend": "onnxruntime", "error": None}


# --- the router's routes ----------------------------------------------------------------------

class FakeControlClient:
    """``ModelClient``'s interface, with a control deployment whose every replica applies a
    change at once (reports as the pool replica would)."""

    def __init__(self, repo: ModelRepository) -> None:
        self.pool_models = set(repo.names())
        self.dedicated: dict[str, Any] = {}
        self.pool = object()
        self.revision = 0
        self.desired = initial_state({n: "pool" for n in repo.names()}, set())
        self.load_s = 0.0  # how long the replicas take to apply a load

    async def control_set(self, name: str, loaded: bool, placement: str) -> int:
        self.revision += 1
        self.desired[name] = {"loaded": loaded, "placement": placement, "generation": self.revision}
        return self.revision

    async def control_applied(self, name: str, placement: str, revision: int):
        if self.desired[name]["loaded"]:
            await asyncio.sleep(self.load_s)
        line = outcome(None, self.desired[name]["loaded"], "onnxruntime")
        return [{"replica": "r1", "revision": revision, "models": {name: line}}], 1

    async def pool_states(self) -> dict[str, dict[str, Any]]:
        return {n: {"state": "absent", "evictions": 0, "backend": "onnxruntime"} for n in self.pool_models}


def router(repo: ModelRepository, explicit: bool) -> TestClient:
    client = FakeControlClient(repo)
    initial = client.desired if explicit else None
    app = RouterApp(repo, client, RouterOptions(max_body_bytes=1 << 20, request_timeout_s=5), initial=initial)
    return TestClient(app.build_app(), raise_server_exceptions=False)


def test_load_and_unload_are_refused_with_model_control_mode_none(root):
    client = router(ModelRepository(root), explicit=False)
    for verb in ("load", "unload"):
        r = client.post(f"/v2/repository/models/simple/{verb}")
        assert r.status_code == 400
        assert r.json()["error"].startswith(f"failed to {verb} 'simple': explicit model load / unload is not allowed: "
                                            "model_control_mode is none")


def test_explicit_index_lists_folders_on_disk_and_follows_load_and_unload(root):
    repo = ModelRepository(root)
    client = router(repo, explicit=True)
    add_model(root, "late")
    assert client.post("/v2/repository/index", json={}).json() == [
        {"name": "late", "state": "UNAVAILABLE", "reason": "not loaded: POST /v2/repository/models/late/load loads it"},
        {"name": "simple", "version": "1", "state": "UNAVAILABLE",
         "reason": "not loaded: POST /v2/repository/models/simple/load loads it"}]
    assert client.get("/v2/models/late/ready").status_code == 404
    r = client.post("/v2/repository/models/late/load", content=b"")
    assert (r.status_code, r.content) == (200, b"")
    assert client.get("/v2/models/late/ready").status_code == 200
    assert client.post("/v2/repository/index", json={"ready": True}).json() == []  # the fake pool holds nothing
    assert client.post("/v2/repository/models/late/unload", json={"parameters": {"unload_dependents": True}}).status_code == 200
    r = client.get("/v2/models/late/ready")
    assert r.status_code == 503 and "has no available versions" in r.json()["error"]
    late = [i for i in client.post("/v2/repository/index").json() if i["name"] == "late"]
    assert late == [{"name": "late", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}]


def test_a_load_and_an_unload_at_once_end_in_the_state_the_replicas_keep(root):
    """The newcomer's race: load and unload of one model sent together both answer 200; the
    router's readiness then matches the desired state the replicas apply (it answered ready
    200 while requests got 503 "unloaded", until its next poll)."""
    repo = ModelRepository(root)
    client = FakeControlClient(repo)
    client.load_s = 0.3  # the load is still being applied when the unload arrives
    app = RouterApp(repo, client, RouterOptions(max_body_bytes=1 << 20, request_timeout_s=5), initial=client.desired)
    with TestClient(app.build_app(), raise_server_exceptions=False) as http:  # one event loop
        with ThreadPoolExecutor(2) as threads:
            load = threads.submit(http.post, "/v2/repository/models/simple/load")
            time.sleep(0.1)
            unload = threads.submit(http.post, "/v2/repository/models/simple/unload")
            assert (load.result().status_code, unload.result().status_code) == (200, 200)
        assert client.desired["simple"]["loaded"] is False  # the unload came last
        r = http.get("/v2/models/simple/ready")
        assert r.status_code == 503 and "has no available versions" in r.json()["error"]


def test_a_pipeline_is_not_ready_while_a_step_is_unloaded_and_its_requests_name_the_step(root):
    """A pipeline whose step model is unloaded answers ready 503 and infer 503 naming the step
    (it answered ready 200 while every request failed at that step), and is ready again once
    the step is loaded; with model control off its steps always serve."""
    raw = yaml.safe_load((ENGINES / "ocr" / "config.yaml").read_text())
    raw["parameters"]["steps"] = ["simple"]
    (root / "pipe").mkdir()
    (root / "pipe" / "config.yaml").write_text(yaml.safe_dump(raw))
    repo = ModelRepository(root)
    control = FakeControlClient(repo)
    control.pool_models.discard("pipe")
    control.desired = initial_state({"simple": "pool", "pipe": "pipeline"}, {"simple", "pipe"})
    app = RouterApp(repo, control, RouterOptions(max_body_bytes=1 << 20, request_timeout_s=5), initial=control.desired)
    app.ready_models.add("pipe")  # its replica answered
    client = TestClient(app.build_app(), raise_server_exceptions=False)
    assert client.get("/v2/models/pipe/ready").json() == {"name": "pipe", "ready": True}
    assert client.post("/v2/repository/models/simple/unload").status_code == 200
    for r in (client.get("/v2/models/pipe/ready"), client.post("/v2/models/pipe/infer", json={
            "inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", "data": ["x"]}]})):
        assert r.status_code == 503, r.text
        assert r.json()["error"] == ("model 'pipe' is not ready: its step model(s) ['simple'] are not loaded; "
                                     "POST /v2/repository/models/simple/load loads it")
    assert client.post("/v2/repository/models/simple/load").status_code == 200
    assert client.get("/v2/models/pipe/ready").status_code == 200
    assert router(ModelRepository(root), explicit=False).get("/v2/models/pipe/ready").status_code == 200

    # A config without parameters.steps (the pipeline's defaults): the steps its replica's built
    # pipeline names (``steps``) are the ones checked.
    del raw["parameters"]["steps"]
    (root / "pipe" / "config.yaml").write_text(yaml.safe_dump(raw))
    app = RouterApp(ModelRepository(root), control, RouterOptions(max_body_bytes=1 << 20, request_timeout_s=5),
                    initial=control.desired)
    app.ready_models.add("pipe")
    app.steps["pipe"] = ("simple",)
    app.loaded.discard("simple")
    r = TestClient(app.build_app(), raise_server_exceptions=False).get("/v2/models/pipe/ready")
    assert r.status_code == 503 and "its step model(s) ['simple'] are not loaded" in r.json()["error"], r.text


def test_load_parameters_and_bodies_it_cannot_use_are_400(root):
    client = router(ModelRepository(root), explicit=True)
    r = client.post("/v2/repository/models/simple/load", json={"parameters": {"config": "{}"}})
    assert r.status_code == 400 and "load parameters ['config'] are not supported" in r.json()["error"]
    r = client.post("/v2/repository/models/simple/load", content=b"[1]")
    assert r.status_code == 400 and "must be a JSON object" in r.json()["error"]
    r = client.post("/v2/repository/models/nope/load")
    assert r.status_code == 404 and r.json()["error"].startswith("failed to load 'nope': no model folder 'nope'")


@pytest.mark.parametrize("route", ["models/simple/load", "models/simple/unload", "index"])
@pytest.mark.parametrize("parameters", [5, "config", [1], True])
def test_repository_parameters_that_are_not_an_object_are_400(root, route, parameters):
    """``{"parameters": 5}`` was a 500 on load (its keys were sorted) and a string's letters
    were named as unsupported parameters; unload and index took anything."""
    client = router(ModelRepository(root), explicit=True)
    r = client.post(f"/v2/repository/{route}", json={"parameters": parameters})
    assert r.status_code == 400, r.text
    assert "'parameters' must be a JSON object, got " + json.dumps(parameters) in r.json()["error"]


# --- warmup -----------------------------------------------------------------------------------

def test_warmup_requests_follow_the_config_for_each_batch_size(root):
    from deployments.runtime.contract.config import load_model_config
    from deployments.runtime.residency.warmup import warmup_requests

    add_model(root, "warm", warmup={"batch_sizes": [1, 4], "data": "random"})
    config = load_model_config(root / "warm" / "config.yaml")
    requests = warmup_requests(config, root / "warm")
    assert [r["INPUT0"].shape for r in requests] == [(1, 16), (4, 16)]
    assert all(r["INPUT1"].dtype == np.int32 for r in requests) and requests[1]["INPUT0"].any()
    np.savez(root / "warm" / "sample.npz", INPUT0=np.full((1, 16), 5, np.int32), INPUT1=np.ones((1, 16), np.int32))
    config = config.model_copy(update={"warmup": config.warmup.model_copy(update={"data": "file", "file": "sample.npz"})})
    assert (warmup_requests(config, root / "warm")[1]["INPUT0"] == 5).all()
    broken = config.model_copy(update={"warmup": config.warmup.model_copy(update={"file": "missing.npz"})})
    with pytest.raises(ConfigError, match=r"missing.npz: warmup.file: cannot read input 'INPUT0'"):
        warmup_requests(broken, root / "warm")


def test_warmup_config_errors_name_the_field(root):
    add_model(root, "over", warmup={"batch_sizes": [16]})
    add_model(root, "nofile", warmup={"data": "file"})
    with pytest.raises(ConfigError, match=r"over/config.yaml: \(top level\): Value error, warmup.batch_sizes \[16\] over max_batch_size 8"):
        ModelRepository(root, ["over"])
    with pytest.raises(ConfigError, match=r"nofile/config.yaml: warmup: Value error, file: give it exactly when data is file"):
        ModelRepository(root, ["nofile"])


def test_the_cache_timeline_shows_warmup_apart_from_the_load(root):
    add_model(root, "warm", warmup={"batch_sizes": [1, 8], "data": "zeros"}, instances=2)
    cache = ModelCache(ModelRepository(root), ["simple", "warm"], CacheOptions(load_policy="lazy"))
    cache.load("warm")
    cache.load("simple")
    warm, cold = cache.timeline()
    assert warm["event"] == "load" and warm["warmup_ms"] > 0 and warm["ms"] > 0
    assert cold["warmup_ms"] == 0
    np.testing.assert_array_equal(cache.infer("warm", PAIR)["OUTPUT0"], PAIR["INPUT0"] + 1)
    cache.close()

