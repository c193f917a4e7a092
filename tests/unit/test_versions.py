"""Versions (issue 14, item 3): a model's ``version_policy`` picks its served versions; the pool's
cache holds each served version as an entry of its own under the same limits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml

from deployments.runtime.contract.config import CacheOptions, VersionPolicy
from deployments.runtime.contract.errors import ConfigError, InvalidInput, ModelNotFound, ModelNotReady
from deployments.runtime.contract.repository import ModelRepository
from deployments.runtime.residency.cache import ModelCache
from deployments.runtime.residency.host import ModelHost
from deployments.runtime.tools.prepare import build_tiny_cnn

ROOT = Path(__file__).resolve().parents[2]
X = np.random.default_rng(3).random((1, 3, 224, 224), dtype=np.float32)


def versioned_repository(root: Path, versions: dict[int, int], policy: dict | None) -> Path:
    """``root/cnn``: tiny_cnn's config (with ``policy``), version v built with seed ``versions[v]``."""
    raw = yaml.safe_load((ROOT / "engines" / "tiny_cnn" / "config.yaml").read_text())
    raw.pop("warmup", None)
    if policy is not None:
        raw["version_policy"] = policy
    (root / "cnn").mkdir(parents=True, exist_ok=True)
    (root / "cnn" / "config.yaml").write_text(yaml.safe_dump(raw))
    for version, seed in versions.items():
        (root / "cnn" / str(version)).mkdir(exist_ok=True)
        onnx.save(build_tiny_cnn(seed), root / "cnn" / str(version) / "model.onnx")
    return root


@pytest.mark.parametrize("policy, served", [
    ({}, (5,)),
    ({"latest": {}}, (5,)),
    ({"latest": {"num_versions": 2}}, (2, 5)),
    ({"latest": {"num_versions": 9}}, (1, 2, 5)),
    ({"all": {}}, (1, 2, 5)),
    ({"specific": {"versions": [5, 1, 1]}}, (1, 5)),
])
def test_each_policy_serves_its_versions_as_triton_does(policy, served):
    assert VersionPolicy.model_validate(policy).select((1, 2, 5)) == served


def test_a_bad_policy_fails_naming_the_file_and_the_field(tmp_path):
    for policy, words in [({"latest": {"num_versions": 0}}, "version_policy.latest.num_versions"),
                          ({"all": {}, "latest": {}}, "give one of latest, all, specific"),
                          ({"specific": {"versions": [2, 3]}}, "version_policy.specific.versions: [3] have no version folder"),
                          ({"newest": {}}, "version_policy.newest: unknown field; allowed: latest, all, specific")]:
        versioned_repository(tmp_path / str(len(words)), {1: 0, 2: 1}, policy)
        with pytest.raises(ConfigError) as e:
            ModelRepository(tmp_path / str(len(words)))
        assert "config.yaml" in e.value.message and words in e.value.message, e.value.message


def test_a_version_folder_named_with_leading_zeros_is_refused_naming_it(tmp_path):
    """``cnn/07`` was listed as version 7 and then read from ``cnn/7/model.onnx``, which is not
    there: its load answered 500 naming a file that never existed (alone: the folder was no model
    at all). The folder is now refused, named, with the name it should have."""
    import shutil

    for also in (False, True):
        root = versioned_repository(tmp_path / str(also), {1: 0} if also else {}, None)
        (root / "cnn" / "07").mkdir(parents=True)
        onnx.save(build_tiny_cnn(1), root / "cnn" / "07" / "model.onnx")
        if not also:
            (root / "cnn" / "config.yaml").unlink()  # a folder with only the zero-led version is a model too
        with pytest.raises(ConfigError) as e:
            ModelRepository(root)
        assert e.value.message == (f"{root}/cnn: version folders ['07'] are named with leading zeros; a version "
                                   "folder is named by its number (['7']): rename them")
        shutil.move(root / "cnn" / "07", root / "cnn" / "7")
        assert ModelRepository(root).get("cnn").latest == 7


def test_the_repository_serves_the_policys_versions_and_names_them_for_one_not_served(tmp_path):
    repo = ModelRepository(versioned_repository(tmp_path, {1: 0, 2: 1, 3: 2}, {"specific": {"versions": [1, 2]}}))
    entry = repo.get("cnn", "1")
    assert (entry.versions, entry.served, entry.latest) == ((1, 2, 3), (1, 2), 2)
    assert entry.keys() == {"cnn@1": 1, "cnn": 2}
    with pytest.raises(ModelNotFound) as e:
        repo.get("cnn", "3")
    assert "served versions: [1, 2]" in e.value.message


def test_the_cache_holds_each_version_as_an_entry_of_its_own_under_the_same_count_cap(tmp_path):
    root = versioned_repository(tmp_path, {1: 0, 2: 5}, {"all": {}})
    cache = ModelCache(ModelRepository(root), options=CacheOptions(max_num_models_per_replica=1))
    assert cache.names == ["cnn", "cnn@1"]
    outputs = {}
    for key, version in (("cnn@1", 1), ("cnn", 2)):
        outputs[version] = cache.infer(key, {"input": X})["logits"]
        expected = ort.InferenceSession(str(root / "cnn" / str(version) / "model.onnx")).run(None, {"input": X})[0]
        np.testing.assert_allclose(outputs[version], expected, rtol=1e-4, atol=1e-5)
    assert not np.allclose(outputs[1], outputs[2])
    assert cache.resident() == ["cnn"]  # the count cap of 1 evicted version 1 for version 2
    assert [(e["event"], e["model"]) for e in cache.timeline()] == [
        ("load", "cnn@1"), ("evict", "cnn@1"), ("load", "cnn")]
    # an unloaded version's request is told in the model's name, never its cache key: "'cnn@1' ...
    # POST /v2/repository/models/cnn@1/load loads it" sent the client to a load that 404s
    cache.unload("cnn@1")
    with pytest.raises(ModelNotReady) as refused:
        cache.infer("cnn@1", {"input": X})
    assert str(refused.value) == ("Request for unknown model: 'cnn' has no available versions; it is unloaded: "
                                  "POST /v2/repository/models/cnn/load loads it")
    cache.close()


def test_the_router_sends_each_version_to_its_cache_key_and_lists_the_served_versions(tmp_path):
    from .test_router_routes import make_router

    repo = ModelRepository(versioned_repository(tmp_path, {1: 0, 2: 5, 3: 6}, {"specific": {"versions": [1, 2]}}))
    router, client = make_router(repo)
    body = {"inputs": [{"name": "input", "shape": [1, 3, 224, 224], "datatype": "FP32", "data": X.ravel().tolist()}]}
    for route, key, version in (("cnn/versions/1", "cnn@1", "1"), ("cnn/versions/2", "cnn", "2"), ("cnn", "cnn", "2")):
        r = router.post(f"/v2/models/{route}/infer", json=body)
        assert r.status_code == 200 and r.json()["model_version"] == version, r.text
        assert client.keys[-1] == key
    r = router.post("/v2/models/cnn/versions/3/infer", json=body)
    assert r.status_code == 404 and "served versions: [1, 2]" in r.json()["error"], r.text
    assert router.get("/v2/models/cnn").json()["versions"] == ["1", "2"]
    assert router.get("/v2/models/cnn/versions/1/config").json()["version_policy"] == {"specific": {"versions": [1, 2]}}
    index = router.post("/v2/repository/index").json()
    assert [(i["name"], i["version"]) for i in index] == [("cnn", "1"), ("cnn", "2")]


def replicas_of_cnn(root: Path) -> tuple[Any, Any]:
    """A pool replica and a dedicated model's replica serving ``root/cnn`` (loaded), built
    without Ray: their model control's ``apply``, cache or host, and routes are real."""
    from deployments.adapters import PoolAdapter
    from deployments.replica_routes import ModelRoutes, PoolRoutes
    from deployments.routes import RouterOptions
    from deployments.model import ModelDeployment
    from deployments.pool import PoolDeployment
    from deployments.runtime.residency.gate import Gate
    from deployments.runtime.residency.host import ModelHost

    pool = PoolDeployment.func_or_class.__new__(PoolDeployment.func_or_class)
    pool.repo = ModelRepository(root)
    pool.cache = ModelCache(pool.repo)
    pool.entries, pool.versions = {"cnn": pool.repo.get("cnn")}, {"cnn": pool.repo.get("cnn").latest}
    pool.keys = {key: ("cnn", v) for key, v in pool.repo.get("cnn").keys().items()}
    pool.backend_request, pool.backends = "auto", {"cnn": "onnxruntime"}
    pool.routes = PoolRoutes(ModelRepository(root), PoolAdapter(["cnn"], None, dict), RouterOptions(1 << 20, 5.0))
    pool.cache.load("cnn")
    dedicated = ModelDeployment.func_or_class.__new__(ModelDeployment.func_or_class)
    dedicated.repo = ModelRepository(root)
    dedicated.host, dedicated.gate = ModelHost(dedicated.repo.get("cnn")).load(), Gate("cnn")
    dedicated.routes = ModelRoutes(dedicated.repo.get("cnn"), dedicated.repo, None, RouterOptions(1 << 20, 5.0))
    dedicated.routes.model_loaded("onnxruntime")
    return pool, dedicated


@pytest.mark.parametrize("unload_first", [True, False])
def test_a_version_folder_added_after_start_is_served_by_the_next_load(tmp_path, unload_first):
    """After an unload, or while the model is loaded: a load of a pool model whose folder has a
    new version kept running version 1's engine under the label of version 2 (the cache skipped
    a model it served while the routes read the folder again)."""
    from deployments.states import ModelState, Status

    root = versioned_repository(tmp_path, {1: 0}, {"latest": {"num_versions": 2}})
    pool, dedicated = replicas_of_cnn(root)
    unload, load = ({"cnn": {"loaded": flag, "placement": "pool"}} for flag in (False, True))
    if unload_first:
        for replica in (pool, dedicated):
            assert replica.apply(unload)["cnn"]["error"] is None
        assert dedicated.routes.states.get("cnn") == ModelState(Status.UNLOADED, None)  # 503
        assert pool.routes.states.get("cnn") == ModelState(Status.UNLOADED, None)
    versioned_repository(root, {2: 5}, {"latest": {"num_versions": 2}})  # version 2 arrives
    for replica in (pool, dedicated):
        assert replica.apply(load)["cnn"]["error"] is None
    assert dedicated.routes.states.is_ready("cnn") and dedicated.routes.repo.get("cnn").latest == 2
    assert pool.routes.states.is_loaded("cnn") and not pool.routes.states.names(Status.UNLOADED)
    assert pool.routes.repo.get("cnn").latest == 2
    expected = {v: ort.InferenceSession(str(root / "cnn" / str(v) / "model.onnx")).run(None, {"input": X})[0]
                for v in (1, 2)}
    assert pool.keys == {"cnn@1": ("cnn", 1), "cnn": ("cnn", 2)}
    for key, version in (("cnn@1", 1), ("cnn", 2)):
        np.testing.assert_allclose(pool.cache.infer(key, {"input": X})["logits"], expected[version], rtol=1e-4, atol=1e-5)
    assert dedicated.host.version == 2  # a dedicated model serves its newest only
    np.testing.assert_allclose(dedicated.host.infer({"input": X})["logits"], expected[2], rtol=1e-4, atol=1e-5)
    pool.cache.close()
    dedicated.host.unload()


def test_a_dedicated_replica_refuses_a_load_of_a_changed_config_and_describes_what_it_serves(tmp_path):
    """The replica's own check, for a folder edited after the router's (``control.config_kept``):
    it kept validating with its deployed config while it took the version of a changed folder;
    now the load fails (400, naming the fields) and its routes keep describing what it serves."""
    root = versioned_repository(tmp_path, {1: 0}, None)
    _, dedicated = replicas_of_cnn(root)
    versioned_repository(root, {2: 5}, {"all": {}})  # a new version, and a changed version_policy
    raw = yaml.safe_load((root / "cnn" / "config.yaml").read_text())
    (root / "cnn" / "config.yaml").write_text(yaml.safe_dump({**raw, "max_batch_size": 4}))
    error = dedicated.apply({"cnn": {"loaded": True, "placement": "dedicated"}})["cnn"]["error"]
    assert isinstance(error, InvalidInput)
    assert error.message.startswith(f"failed to load 'cnn': {root}/cnn/config.yaml changed since this dedicated "
                                    "model's deployment was deployed (fields ['max_batch_size', 'version_policy']")
    assert dedicated.host.version == 1 and dedicated.host.config.max_batch_size == 32
    assert dedicated.routes.repo.get("cnn").latest == 1 and dedicated.routes.repo.get("cnn").config.max_batch_size == 32
    dedicated.host.unload()


def test_a_pool_model_loaded_again_with_a_changed_config_is_described_and_validated_by_it(tmp_path):
    """A pool model unloaded, its config changed (max_batch_size, version_policy), loaded
    again: the pool replica's metadata, its config route, its versions and its validation all
    follow the new config (the router takes the same folder once the load succeeded:
    ``test_model_control``)."""
    from starlette.testclient import TestClient

    root = versioned_repository(tmp_path, {1: 0, 2: 5}, None)
    pool, _ = replicas_of_cnn(root)
    http = TestClient(pool.routes.build_app(), raise_server_exceptions=False)
    assert http.get("/v2/models/cnn").json()["versions"] == ["2"]
    assert pool.apply({"cnn": {"loaded": False, "placement": "pool"}})["cnn"]["error"] is None
    raw = yaml.safe_load((root / "cnn" / "config.yaml").read_text())
    (root / "cnn" / "config.yaml").write_text(yaml.safe_dump({**raw, "max_batch_size": 2, "version_policy": {"all": {}}}))
    assert pool.apply({"cnn": {"loaded": True, "placement": "pool"}})["cnn"]["error"] is None
    assert http.get("/v2/models/cnn").json()["versions"] == ["1", "2"]
    config = http.get("/v2/models/cnn/versions/1/config").json()
    assert (config["max_batch_size"], config["version_policy"]) == (2, {"all": {}})
    assert pool.keys == {"cnn@1": ("cnn", 1), "cnn": ("cnn", 2)}
    batch = np.concatenate([X] * 3)
    for key in ("cnn@1", "cnn"):
        with pytest.raises(InvalidInput, match=r"batch-size must be <= 2 for 'cnn'"):
            pool.cache.infer(key, {"input": batch})
        assert pool.cache.infer(key, {"input": batch[:2]})["logits"].shape == (2, 1000)
    pool.cache.close()


def _refused_by_onnxruntime(path: Path) -> None:
    """An ONNX file with tiny_cnn's inputs and outputs that reads (``onnx.load``) but that ONNX
    Runtime refuses to load: its one node is an ``Add`` of one input (an operator no one
    defines is refused earlier, when the folder is read: ``completion``)."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Add", ["input"], ["logits"])], "refused",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 224, 224])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 1000])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, path)


@pytest.mark.parametrize("fault", ["truncated", "refused"])
def test_a_failed_load_of_a_new_version_leaves_each_replica_serving_the_version_it_served(tmp_path, fault):
    """A new version whose model file is truncated (checked before anything is unloaded), or
    reads but its engine fails to load (the old version is loaded again), failed the load with
    version 1 already unloaded: the pool replica and the dedicated one answered 503 "not
    loaded". Now both serve version 1 as before, its answers ONNX Runtime's on its file."""
    from deployments.control import reading
    from deployments.states import Status

    root = versioned_repository(tmp_path, {1: 0}, None)
    pool, dedicated = replicas_of_cnn(root)
    (root / "cnn" / "2").mkdir()
    if fault == "truncated":
        data = (root / "cnn" / "1" / "model.onnx").read_bytes()
        (root / "cnn" / "2" / "model.onnx").write_bytes(data[:len(data) // 3])
    else:
        _refused_by_onnxruntime(root / "cnn" / "2" / "model.onnx")
    state = {"loaded": True, "placement": "pool", "generation": 1, **reading(ModelRepository(root).peek("cnn"))}
    assert state["versions"] == [2]
    errors = [pool.apply({"cnn": state})["cnn"]["error"],
              dedicated.apply({"cnn": {**state, "placement": "dedicated"}})["cnn"]["error"]]
    if fault == "truncated":
        assert [e.message for e in errors] == ["model 'cnn': its model file cnn/2/model.onnx is not a valid ONNX "
                                               "model: it does not parse as one (damaged, truncated or another "
                                               "format)"] * 2
    else:
        assert all(e is not None for e in errors)
    expected = ort.InferenceSession(str(root / "cnn" / "1" / "model.onnx")).run(None, {"input": X})[0]
    assert pool.keys == {"cnn": ("cnn", 1)} and pool.routes.states.get("cnn").status is Status.READY
    np.testing.assert_allclose(pool.cache.infer("cnn", {"input": X})["logits"], expected, rtol=1e-4, atol=1e-5)
    assert dedicated.host.version == 1 and dedicated.gate.is_open and dedicated.routes.states.get("cnn").status is \
        Status.READY
    np.testing.assert_allclose(dedicated.host.infer({"input": X})["logits"], expected, rtol=1e-4, atol=1e-5)
    pool.cache.close()
    dedicated.host.unload()


def test_a_model_file_written_in_place_is_never_served_under_the_reading_that_read_the_old_one(tmp_path):
    """A version's model.onnx overwritten in place (other weights, same size) while the pool
    serves it: a load answered 200 and kept the old engine, and the first reload after an
    eviction served the new weights under the same label without any load. Now a reload that
    finds another file than its reading saw is 503 naming why, and a load serves the new file."""
    from deployments.runtime.contract.errors import ModelNotReady

    root = versioned_repository(tmp_path, {1: 0, 2: 5}, {"all": {}})
    cache = ModelCache(ModelRepository(root), options=CacheOptions(max_num_models_per_replica=1))
    path = root / "cnn" / "1" / "model.onnx"
    old = ort.InferenceSession(str(path)).run(None, {"input": X})[0]
    np.testing.assert_allclose(cache.infer("cnn@1", {"input": X})["logits"], old, rtol=1e-4, atol=1e-5)
    cache.infer("cnn", {"input": X})  # version 2 evicts version 1 (one model at a time)
    before = path.stat().st_size
    onnx.save(build_tiny_cnn(7), path)  # in place, other weights
    assert path.stat().st_size == before
    with pytest.raises(ModelNotReady) as e:
        cache.infer("cnn@1", {"input": X})
    assert e.value.message.startswith("model 'cnn' version 1: its model file cnn/1/model.onnx changed on disk since "
                                      "the server read it"), e.value.message
    assert "POST /v2/repository/models/cnn/load" in e.value.message
    np.testing.assert_allclose(cache.infer("cnn", {"input": X})["logits"],  # the other version serves on
                               ort.InferenceSession(str(root / "cnn" / "2" / "model.onnx")).run(None, {"input": X})[0],
                               rtol=1e-4, atol=1e-5)
    cache.close()


def test_a_load_after_the_served_file_was_written_in_place_serves_the_new_file(tmp_path):
    from deployments.control import reading
    from deployments.runtime.contract.errors import ModelNotReady

    root = versioned_repository(tmp_path, {1: 0}, None)
    pool, dedicated = replicas_of_cnn(root)
    path = root / "cnn" / "1" / "model.onnx"
    first = reading(ModelRepository(root).peek("cnn"))
    onnx.save(build_tiny_cnn(7), path)  # in place, other weights
    new = ort.InferenceSession(str(path)).run(None, {"input": X})[0]
    state = {"loaded": True, "placement": "pool", "generation": 1, **reading(ModelRepository(root).peek("cnn"))}
    assert state["versions"] == first["versions"] == [1] and state["digest"] != first["digest"]
    assert pool.apply({"cnn": state})["cnn"]["error"] is None
    assert dedicated.apply({"cnn": {**state, "placement": "dedicated"}})["cnn"]["error"] is None
    np.testing.assert_allclose(pool.cache.infer("cnn", {"input": X})["logits"], new, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dedicated.host.infer({"input": X})["logits"], new, rtol=1e-4, atol=1e-5)
    assert dedicated.host.version == 1 and pool.routes.states.is_loaded("cnn")

    onnx.save(build_tiny_cnn(9), path)  # again, and no load: a replica that starts now does not serve it
    replacement = ModelHost(ModelRepository(root, entries=[dedicated.host.entry]).get("cnn"))
    with pytest.raises(ModelNotReady, match=r"cnn/1/model.onnx changed on disk since the server read it"):
        replacement.load()
    assert not replacement.ready
    pool.cache.close()
    dedicated.host.unload()


def test_a_file_half_written_after_another_replica_loaded_the_reading_is_not_taken_as_its_repair(tmp_path):
    """A replica that never loaded the version saw a damaged file (one being copied over the
    read one) and took whatever came next as a repair of the reading: other weights under the
    label the first replica serves from the read file."""
    from deployments.runtime.contract.errors import InvalidModelFile, ModelNotReady

    root = versioned_repository(tmp_path, {1: 0}, None)
    entry = ModelRepository(root).get("cnn")
    first = ModelHost(entry).load()
    path = root / "cnn" / "1" / "model.onnx"
    path.write_bytes(b"half a model")
    second = ModelHost(entry)
    with pytest.raises(InvalidModelFile):
        second.load()
    onnx.save(build_tiny_cnn(7), path)
    with pytest.raises(ModelNotReady, match="changed on disk since the server read it"):
        second.load()
    first.unload()


def test_a_rollback_after_a_failed_load_of_a_file_written_in_place_keeps_the_files_it_served(tmp_path):
    """A load after an in-place edit that a replica failed rolls back to the reading served
    before: its digest named files no longer on disk, so every replica and router refused the
    rollback (503 everywhere). Now the rollback keeps the old reading's files: a replica still
    holding them serves on, one that must load them again refuses the other bytes."""
    from deployments.control import read_as_desired, reading
    from deployments.runtime.contract.errors import ModelNotReady

    root = versioned_repository(tmp_path, {1: 0}, None)
    repo = ModelRepository(root)
    served = repo.peek("cnn")
    onnx.save(build_tiny_cnn(7), root / "cnn" / "1" / "model.onnx")  # in place; the load of it then failed
    rollback = {"loaded": True, "placement": "pool", "generation": 2, **reading(served), "reason": "failed to load: x"}
    entry = read_as_desired(repo, "cnn", rollback)
    assert entry == served and entry.files == served.files
    with pytest.raises(ModelNotReady, match="changed on disk since the server read it"):
        ModelHost(entry).load()
    changed = {**rollback, "config_digest": "0" * 16}
    with pytest.raises(InvalidInput, match="changed since the load of 'cnn' read it"):
        read_as_desired(repo, "cnn", changed)


def test_requests_that_arrive_while_a_load_replaces_the_served_file_wait_for_it_and_get_the_new_file(
        tmp_path, monkeypatch):
    """A load that replaced a served reading (a config changed, a file written in place, a new
    version) unloaded it first, and a request arriving meanwhile answered 503 "has no available
    versions; it is unloaded: POST .../load loads it" though the model was never unloaded (the
    newcomer's 23 of 1,128 requests while toggling a pool model's config). Such a request now
    waits for the load and runs on what serves then, where that is the version it is labelled
    with; one labelled with a version the load replaced is told so ("send the request again")."""
    import asyncio
    import threading

    from deployments.admission import Admission
    from deployments.control import reading

    root = versioned_repository(tmp_path, {1: 0}, None)
    pool, dedicated = replicas_of_cnn(root)
    dedicated.admission, dedicated._batched, dedicated.recorder = Admission(8, None, 5.0), None, None
    path = root / "cnn" / "1" / "model.onnx"
    loading, go = threading.Event(), threading.Event()

    def hold(owner: Any, method: str) -> None:
        """``owner.method`` (called once the old reading is unloaded: the pool's ``ModelCache.add``
        of the new entry, the dedicated replica's ``ModelHost.load`` of it) waits for ``go``."""
        original = getattr(owner, method)

        def held(*args: Any, **kwargs: Any) -> Any:
            loading.set()  # a request now finds the model not loaded
            assert go.wait(60)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, method, held)

    async def while_replaced(apply: Any, request: Any) -> Any:
        loading.clear()
        go.clear()
        applying = threading.Thread(target=apply)
        applying.start()
        assert await asyncio.to_thread(loading.wait, 60)
        pending = asyncio.ensure_future(request())
        await asyncio.sleep(0.2)
        waited = not pending.done()
        go.set()
        answer = await pending
        await asyncio.to_thread(applying.join)
        return waited, answer

    for seed, (replica, placement) in enumerate([(pool, "pool"), (dedicated, "dedicated")], start=7):
        onnx.save(build_tiny_cnn(seed), path)  # in place, other weights: the same version, a new reading
        new = ort.InferenceSession(str(path)).run(None, {"input": X})[0]
        state = {"loaded": True, "placement": placement, "generation": seed, **reading(ModelRepository(root).peek("cnn"))}
        hold(pool.cache, "add") if replica is pool else hold(ModelHost, "load")
        request = (lambda: pool.cache.infer_async("cnn", {"input": X}, version=1)) if replica is pool else (
            lambda: dedicated.infer({"input": X}, None, version=1))
        waited, answer = asyncio.run(while_replaced(lambda: replica.apply({"cnn": state}), request))
        monkeypatch.undo()
        assert waited, placement  # it waited for the load, not answered at once
        assert isinstance(answer, dict), (placement, answer)  # not ModelNotReady
        np.testing.assert_allclose(answer["logits"], new, rtol=1e-4, atol=1e-5)

    # a new version: a request labelled version 1 that waited is refused, naming the version serving now
    versioned_repository(tmp_path, {2: 3}, None)
    state = reading(ModelRepository(root).peek("cnn"))

    async def refused() -> Any:
        try:
            return await pool.cache.infer_async("cnn", {"input": X}, version=1)
        except ModelNotReady as e:
            return e

    for replica, placement, request in [(pool, "pool", refused),
                                        (dedicated, "dedicated", lambda: dedicated.infer({"input": X}, None, version=1))]:
        hold(pool.cache, "add") if replica is pool else hold(ModelHost, "load")
        waited, answer = asyncio.run(while_replaced(
            lambda: replica.apply({"cnn": {"loaded": True, "placement": placement, "generation": 30, **state}}), request))
        monkeypatch.undo()
        assert waited and isinstance(answer, ModelNotReady), (placement, answer)
        assert str(answer) == ("model 'cnn' version 1 is no longer served by this replica: a load replaced it with "
                               "version 2; send the request again"), placement
    pool.cache.close()
    dedicated.host.unload()
