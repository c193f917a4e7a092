"""Model control in the engine layer and the router, without Ray: the cache's ``load`` /
``unload`` / ``add``, the repository read again at run time, the dedicated deployment's gate,
and the router's repository routes over a fake client (``tests/integration/test_model_control.py``
runs the real thing)."""

from __future__ import annotations

import asyncio
import json
import zlib
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

from deployments.ingress import RouterApp
from deployments.routes import RouterOptions
from deployments.control import ControlDeployment, Desired, Follower, initial_state, outcome, reading
from deployments.runtime.contract.config import CacheOptions
from deployments.runtime.contract.errors import (ConfigError, InvalidModelFile, ModelNotFound, ModelNotReady, OverBudget,
                                               ServingError)
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


def test_gate_close_returns_when_the_last_request_leaves_even_if_reopened_meanwhile():
    """A ``close`` waiting for the requests inside is woken by the last one out, whatever the gate's
    state then (an ``open`` in between must not leave it blocked)."""
    gate = Gate("m")
    closed = threading.Event()
    gate.request().__enter__()
    closer = threading.Thread(target=lambda: (gate.close(), closed.set()))
    closer.start()
    time.sleep(0.1)
    gate.open()
    gate.request().__exit__(None, None, None)
    closer.join(5)
    assert closed.is_set()


def test_a_replicas_load_error_keeps_whose_fault_it_is():
    """Only a config the load's sender wrote is 400; a server fault kept 400 here too (every
    ``ConfigError`` was turned into ``InvalidInput``, an unreadable model file included).
    ``tests/unit/test_whose_fault.py`` makes each error for real."""
    from deployments.protocol.errors import error_status
    from deployments.runtime.contract.errors import DeviceOutOfMemory, LoadFault

    statuses = [error_status(outcome(error, True)["error"])[0] for error in (
        ConfigError("x/config.yaml: bad"), LoadFault("model 'x': onnx could not read its model file"),
        DeviceOutOfMemory("model 'x': out of memory"), RuntimeError("boom"))]
    assert statuses == [400, 500, 503, 500]
    assert outcome(None, True, "onnxruntime") == {"loaded": True, "backend": "onnxruntime", "error": None}


# --- the router's routes ----------------------------------------------------------------------

class MemoryStore:
    """``control.StateStore`` in memory, JSON round-tripped as the GCS store's; it outlives the
    control deployments made over it, as the GCS outlives a control replica."""

    def __init__(self) -> None:
        self.raw: str | None = None

    def load(self) -> dict[str, Any] | None:
        return None if self.raw is None else json.loads(self.raw)

    def save(self, state: dict[str, Any]) -> None:
        self.raw = json.dumps(state)


class Remote:
    """A handle's ``method.remote(*args)`` over a plain object (awaitable, as a handle's)."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def __getattr__(self, method: str) -> Any:
        async def call(*args: Any) -> Any:
            return getattr(self.target, method)(*args)

        return type("Method", (), {"remote": staticmethod(call)})


Control = ControlDeployment.func_or_class  # the class under Serve's decorator


class FakeReplica:
    """A pool replica's model control: a real ``Follower`` whose ``apply`` loads or unloads
    at once, or fails a load with ``fail``; ``held``: it does not poll (a slow load)."""

    def __init__(self, replica: str, control: Any, initial: Desired) -> None:
        self.follower = Follower(control, initial, self.apply, replica=replica, deployment="pool")
        self.fail: ServingError | None = None
        self.held = False

    def apply(self, changed: Desired) -> dict[str, dict[str, Any]]:
        return {name: outcome(self.fail if state["loaded"] else None, state["loaded"], "onnxruntime")
                for name, state in changed.items()}


class FakeControlClient:
    """``ModelClient``'s interface over a real ``ControlDeployment`` (its state in a
    ``MemoryStore``) and pool replicas ``replicas`` (``FakeReplica``, real followers), of which
    Serve counts ``running`` RUNNING. Every ``control_applied`` is one poll of every replica
    not held (time passing)."""

    def __init__(self, repo: ModelRepository, initial: Desired | None = None) -> None:
        self.pool_models = set(repo.names())
        self.dedicated: dict[str, Any] = {}
        self.pool = object()
        self.initial = initial or initial_state({n: "pool" for n in repo.names()}, set())
        self.store = MemoryStore()
        self.control = Control(self.initial, store=self.store)
        self.replicas = {"r1": FakeReplica("r1", Remote(self.control), self.initial)}
        self.running = {"r1"}
        self.routed: list[tuple[str | None, str]] = []  # (key, version) of each pool request routed

    @property
    def desired(self) -> Desired:
        return self.control.models

    async def poll(self) -> None:
        for replica in self.replicas.values():
            if not replica.held:
                await replica.follower.sync()

    async def control_desired(self) -> dict[str, Any]:
        return self.control.desired()

    async def control_set(self, name: str, loaded: bool, placement: str, read: dict[str, Any] | None = None,
                          kept: dict[str, Any] | None = None, reason: str | None = None):
        return self.control.set(name, loaded, placement, read, kept, reason)

    async def control_applied(self, name: str, placement: str, state: dict[str, Any]):
        await self.poll()
        return self.control.applied("pool", state), frozenset(self.running)

    async def pool_states(self) -> dict[str, dict[str, Any]]:
        return {n: {"state": "absent", "evictions": 0, "backend": "onnxruntime"} for n in self.pool_models}

    async def infer_body(self, name: str, key: str | None, version: str, batched: bool, chunks: list[bytes],
                         header_length: str | None, default_timeout_s: float):
        """A pool model's body, answered as ``PoolDeployment.infer_body`` (labelled ``version``),
        its ``(key, version)`` recorded in ``routed``."""
        from deployments.protocol.answer import answer_body

        self.routed.append((key, version))

        async def run(inputs: dict[str, np.ndarray], outputs: list[str] | None) -> dict[str, np.ndarray]:
            return {"OUTPUT0": inputs["INPUT0"] + 1, "OUTPUT1": inputs["INPUT0"] - 1}

        return await answer_body(name, version, batched, chunks, header_length, run, default_timeout_s)


def router(repo: ModelRepository, explicit: bool) -> TestClient:
    client = FakeControlClient(repo)
    initial = client.initial if explicit else None
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


def test_an_unloaded_models_metadata_and_config_answer_as_its_ready_does_until_it_is_loaded_again(root):
    """Metadata and config of an unloaded model answered 200 while its ready and infer answered
    503 "unloaded"; they answer the same 503 now, and 200 again once it is loaded."""
    repo = ModelRepository(root)
    client = router(repo, explicit=True)
    assert client.post("/v2/repository/models/simple/load").status_code == 200
    described = {route: client.get(f"/v2/models/simple{route}") for route in ("", "/config")}
    assert [r.status_code for r in described.values()] == [200, 200]
    assert client.post("/v2/repository/models/simple/unload").status_code == 200
    ready = client.get("/v2/models/simple/ready")
    assert ready.status_code == 503 and "has no available versions; it is unloaded" in ready.json()["error"]
    for route in ("", "/config", "/versions/1", "/versions/1/config"):
        r = client.get(f"/v2/models/simple{route}")
        assert (r.status_code, r.json()) == (503, ready.json()), route
    assert client.post("/v2/repository/models/simple/load").status_code == 200
    for route, before in described.items():
        r = client.get(f"/v2/models/simple{route}")
        assert (r.status_code, r.json()) == (200, before.json()), route


def test_a_never_loaded_models_metadata_is_404_as_its_requests_are(root):
    client = router(ModelRepository(root), explicit=True)
    for route in ("", "/config", "/ready"):
        r = client.get(f"/v2/models/simple{route}")
        assert r.status_code == 404 and "it is in the repository but not loaded" in r.json()["error"], route


def test_a_load_and_an_unload_at_once_end_in_the_state_the_replicas_keep(root):
    """The newcomer's race: load and unload of one model sent together both answer 200; the
    router's readiness then matches the desired state the replicas apply (it answered ready
    200 while requests got 503 "unloaded", until its next poll)."""
    repo = ModelRepository(root)
    client = FakeControlClient(repo)
    client.replicas["r1"].held = True  # the load is still being applied when the unload arrives
    set_state, asked = client.control_set, threading.Event()

    async def control_set(*args: Any, **kwargs: Any) -> Any:
        asked.set()
        return await set_state(*args, **kwargs)

    client.control_set = control_set
    app = RouterApp(repo, client, RouterOptions(max_body_bytes=1 << 20, request_timeout_s=5), initial=client.initial)
    with TestClient(app.build_app(), raise_server_exceptions=False) as http:  # one event loop
        with ThreadPoolExecutor(2) as threads:
            load = threads.submit(http.post, "/v2/repository/models/simple/load")
            assert asked.wait(60)  # the load set the desired state first (a busy machine took 0.1 s and more)
            client.replicas["r1"].held = False
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
    control = FakeControlClient(repo, initial_state({"simple": "pool", "pipe": "pipeline"}, {"simple", "pipe"}))
    control.pool_models.discard("pipe")
    app = RouterApp(repo, control, RouterOptions(max_body_bytes=1 << 20, request_timeout_s=5), initial=control.initial)
    app.states.answered("pipe")  # its replica answered
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
                    initial=control.initial)
    app.states.answered("pipe")
    app.steps["pipe"] = ("simple",)
    app.states.unloaded("simple")
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


@pytest.mark.parametrize("parameters, message", [
    ({"unload_dependents": "yes"}, "failed to unload 'simple': parameters.unload_dependents must be true or false (a "
                                   "bool), got str \"yes\""),
    ({"cascade": True}, "failed to unload 'simple': parameters.\"cascade\": not a parameter this server knows; allowed "
                        "here: ['unload_dependents']"),
])
def test_unload_parameters_of_another_name_or_type_are_400_naming_them(root, parameters, message):
    """Seen: any unload parameter was accepted and ignored (Triton's ``unload_dependents`` is a bool)."""
    client = router(ModelRepository(root), explicit=True)
    r = client.post("/v2/repository/models/simple/unload", json={"parameters": parameters})
    assert (r.status_code, r.json()) == (400, {"error": message})
    assert str(root) not in r.json()["error"]  # bench.fuzz: the server's paths stay out of answers


@pytest.mark.parametrize("route", ["models/simple/load", "models/simple/unload", "index"])
@pytest.mark.parametrize("parameters", [5, "config", [1], True])
def test_repository_parameters_that_are_not_an_object_are_400(root, route, parameters):
    """``{"parameters": 5}`` was a 500 on load (its keys were sorted) and a string's letters
    were named as unsupported parameters; unload and index took anything."""
    client = router(ModelRepository(root), explicit=True)
    r = client.post(f"/v2/repository/{route}", json={"parameters": parameters})
    assert r.status_code == 400, r.text
    assert "'parameters' must be a JSON object, got " + json.dumps(parameters) in r.json()["error"]


@pytest.mark.parametrize("route", ["models/simple/load", "models/simple/unload", "index"])
@pytest.mark.parametrize(("body", "why"), [
    (b"{", "Expecting property name enclosed in double quotes"),  # said "must be a JSON object"
    (b"[" * 5000, "nested too deeply"),  # was a 500 (RecursionError) on all three: bench.fuzz's body routes
    (b'{"a": ' * 3000 + b"1" + b"}" * 3000, "nested too deeply"),
    (b'{"ready": NaN}', "NaN"),
    (b'{"parameters": {"x": 1e999}}', "overflows to Infinity"),
])
def test_repository_bodies_that_are_not_json_are_400_naming_why(root, route, body, why):
    client = router(ModelRepository(root), explicit=True)
    r = client.post(f"/v2/repository/{route}", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"].startswith("request body is not valid JSON: ")  # as an infer body's
    assert why in r.json()["error"]
    r = client.post(f"/v2/repository/{route}", content=zlib.compress(body), headers={"Content-Encoding": "deflate"})
    assert r.status_code == 400 and why in r.json()["error"], r.text  # compressed, the same answer


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



# --- applied on every RUNNING replica, rolled back on failure, kept across restarts --------------

def explicit_router(root: Path, timeout_s: float = 5.0) -> tuple[RouterApp, FakeControlClient, TestClient]:
    repo = ModelRepository(root)
    fake = FakeControlClient(repo)
    app = RouterApp(repo, fake, RouterOptions(max_body_bytes=1 << 20, request_timeout_s=timeout_s),
                    initial=fake.initial)
    return app, fake, TestClient(app.build_app(), raise_server_exceptions=False)


def test_a_load_answers_once_every_running_replica_applied_it_not_a_count_of_reports(root):
    """A draining replica's report stood in for the running one that had not applied the load
    (``len(reports) >= running``): the load answered 200 while the running replica still
    answered 404 "not loaded". The running replica's own report is needed."""
    app, fake, http = explicit_router(root)
    fake.replicas["old"] = FakeReplica("old", Remote(fake.control), fake.initial)  # draining: not RUNNING
    fake.running = {"r1"}
    fake.replicas["r1"].held = True
    polls = []

    async def applied(name, placement, state):
        polls.append(len(polls))
        fake.replicas["r1"].held = len(polls) < 4  # the running replica applies at the 4th poll
        return await FakeControlClient.control_applied(fake, name, placement, state)

    fake.control_applied = applied
    r = http.post("/v2/repository/models/simple/load")
    assert r.status_code == 200, r.text
    assert fake.replicas["r1"].follower.state == {"incarnation": fake.control.incarnation, "revision": 1}
    assert len(polls) == 4


def test_a_load_that_times_out_and_fails_later_is_rolled_back_with_its_reason_and_a_later_load_retries(root):
    """The load outlived its request (504), then failed on the replica: the index showed READY
    and infer went on to the replica, which answered 503 "unloaded". Now: LOADING while it
    loads, then UNAVAILABLE with the failure as the reason (index and infer); the next load tries
    again on every replica."""
    app, fake, http = explicit_router(root, timeout_s=0.3)
    replica = fake.replicas["r1"]
    replica.held = True
    r = http.post("/v2/repository/models/simple/load")
    assert r.status_code == 504, r.text
    assert r.json()["error"].startswith("failed to load 'simple' within 0.3 s on every replica "
                                        "(0 of 1 running replicas done); it goes on")
    (item,) = http.post("/v2/repository/index").json()  # at once, and after the routers' next pass
    assert item["state"] == "LOADING"
    asyncio.run(app.follow_desired(fake.control.desired()))
    (item,) = http.post("/v2/repository/index").json()
    assert item["state"] == "LOADING"

    replica.held, replica.fail = False, OverBudget("model 'simple' needs 9.0 MiB, more than the budget of 8.0 MiB")
    asyncio.run(app.follow_desired(fake.control.desired()))  # a poll: the replica's load fails
    asyncio.run(app.follow_desired(fake.control.desired()))
    reason = "failed to load: model 'simple' needs 9.0 MiB, more than the budget of 8.0 MiB"
    assert fake.desired["simple"] == {"loaded": False, "placement": "pool", "generation": 1, "reason": reason,
                                      **reading(app.repo.get("simple"))}
    assert http.post("/v2/repository/index").json() == [
        {"name": "simple", "version": "1", "state": "UNAVAILABLE", "reason": reason}]
    r = http.post("/v2/models/simple/infer", json={"inputs": []})
    assert r.status_code == 503
    assert r.json()["error"] == (f"Request for unknown model: 'simple' has no available versions; it is not loaded: "
                                 f"{reason}; POST /v2/repository/models/simple/load tries again")

    replica.fail = None
    assert http.post("/v2/repository/models/simple/load").status_code == 200
    assert fake.desired["simple"]["loaded"] and replica.follower.outcomes["simple"]["loaded"]
    assert http.get("/v2/models/simple/ready").status_code == 200


def test_a_load_that_fails_at_once_answers_the_replica_error_and_leaves_the_reason(root):
    app, fake, http = explicit_router(root)
    fake.replicas["r1"].fail = OverBudget("model 'simple' needs 9.0 MiB")
    r = http.post("/v2/repository/models/simple/load")
    assert (r.status_code, r.json()["error"]) == (503, "failed to load 'simple': model 'simple' needs 9.0 MiB")
    assert http.post("/v2/repository/index").json()[0]["reason"] == "failed to load: model 'simple' needs 9.0 MiB"


def test_a_restarted_control_replica_keeps_run_time_changes_and_no_replica_skips_the_next(root):
    """Its revision restarted at 0 from the build-time state: a replica that had applied
    revision 1 skipped the next change. The state now comes back from the store, incarnation
    and revision included, and the next change reaches every replica."""
    fake = FakeControlClient(ModelRepository(root))
    replica = fake.replicas["r1"]
    fake.control.set("simple", True, "pool")
    asyncio.run(fake.poll())
    assert replica.follower.applied["simple"]["loaded"]
    before = fake.control.desired()

    restarted = Control(fake.initial, store=fake.store)  # Serve starts a new control replica
    assert restarted.desired() == before
    replica.follower.control = Remote(restarted)
    restarted.set("simple", False, "pool")
    asyncio.run(replica.follower.sync())
    assert replica.follower.applied["simple"]["loaded"] is False
    assert replica.follower.outcomes["simple"]["loaded"] is False
    assert restarted.applied("pool", {"incarnation": before["incarnation"], "revision": 2})


def test_a_new_deploy_starts_from_the_build_time_state_under_a_new_incarnation(root):
    """A replica that applied revision 1 of another incarnation applies the differences from it."""
    fake = FakeControlClient(ModelRepository(root))
    replica = fake.replicas["r1"]
    fake.control.set("simple", True, "pool")
    asyncio.run(fake.poll())
    redeployed = Control(fake.initial, store=MemoryStore())  # a new build's store: nothing in it
    redeployed.set("other", True, "pool")  # revision 1 again, of another incarnation
    assert redeployed.incarnation != fake.control.incarnation and redeployed.revision == 1
    replica.follower.control = Remote(redeployed)
    asyncio.run(replica.follower.sync())
    assert replica.follower.applied["simple"]["loaded"] is False and replica.follower.applied["other"]["loaded"]


def test_a_change_the_store_refused_is_not_made():
    """A change is stored before it is answered or applied: a control replica that dies (or a
    store that fails) in between loses nothing it answered."""
    class Failing(MemoryStore):
        def save(self, state: dict[str, Any]) -> None:
            if state["revision"]:
                raise ConnectionError("GCS unavailable")
            super().save(state)

    control = Control(initial_state({"m": "pool"}, set()), store=Failing())
    with pytest.raises(ConnectionError):
        control.set("m", True, "pool")
    assert control.desired()["revision"] == 0 and control.desired()["models"]["m"]["loaded"] is False


# --- Follower.first_sync ------------------------------------------------------------------------

def test_first_sync_gives_up_on_an_unreachable_control_replica_after_its_bound():
    class Unreachable:
        class desired:
            @staticmethod
            async def remote() -> None:
                await asyncio.Event().wait()  # never answers

    async def scenario() -> tuple[float, bool]:
        follower = Follower(Unreachable(), {}, lambda changed: {}, replica="r", deployment="pool")
        follower.task = asyncio.create_task(follower.run())
        start = time.monotonic()
        await follower.first_sync(timeout_s=0.5)
        follower.task.cancel()
        return time.monotonic() - start, follower.synced

    waited_s, synced = asyncio.run(scenario())
    assert 0.5 <= waited_s < 5 and not synced


def test_first_sync_waits_for_a_load_longer_than_its_bound_once_the_state_was_read(root):
    """The bound is for reading the state: a load slower than it is waited for (a replacement
    replica served 503 "reading the model control state" until its load ended)."""
    fake = FakeControlClient(ModelRepository(root))
    fake.control.set("simple", True, "pool")
    loads = []

    def slow_apply(changed: Desired) -> dict[str, dict[str, Any]]:
        time.sleep(1.0)
        loads.append(sorted(changed))
        return {name: outcome(None, True, "onnxruntime") for name in changed}

    async def scenario() -> bool:
        follower = Follower(Remote(fake.control), fake.initial, slow_apply, replica="new", deployment="pool")
        follower.task = asyncio.create_task(follower.run())
        await follower.first_sync(timeout_s=0.2)
        follower.task.cancel()
        return follower.synced

    assert asyncio.run(scenario()) and loads == [["simple"]]


# --- a new version of a loaded pool model -------------------------------------------------------

def test_a_request_labelled_with_a_version_the_cache_no_longer_runs_is_refused(tmp_path):
    """The cache ran version 1's engine for requests labelled version 2 after a load read a new
    version folder; a request is now run only on the version its answer is labelled with."""
    from .test_versions import versioned_repository

    root = versioned_repository(tmp_path, {1: 0}, None)
    repo = ModelRepository(root)
    cache = ModelCache(repo, ["cnn"], CacheOptions(load_policy="lazy"))
    x = {"input": np.zeros((1, 3, 224, 224), np.float32)}
    asyncio.run(cache.infer_async("cnn", x, version=1))
    versioned_repository(tmp_path, {2: 5}, None)
    cache.unload("cnn")
    cache.add(repo.read("cnn"), enabled=False)
    cache.load("cnn")
    with pytest.raises(ModelNotReady, match="^model 'cnn' version 1 is no longer served by this replica: a load "
                                            "replaced it with version 2; send the request again$"):
        asyncio.run(cache.infer_async("cnn", x, version=1))
    assert asyncio.run(cache.infer_async("cnn", x, version=2))["logits"].shape == (1, 1000)
    cache.close()


def test_the_index_does_not_show_ready_a_pool_model_whose_requests_answer_503_for_want_of_a_replica(root):
    """The index took a pool model's state from one pool replica's cache alone: READY (a
    replacement replica had it resident) while the router, not yet counting that replica
    RUNNING, answered its requests 503 "no running replica"."""
    app, fake, http = explicit_router(root)
    assert http.post("/v2/repository/models/simple/load").status_code == 200

    async def resident() -> dict[str, dict[str, Any]]:
        return {"simple": {"state": "ready", "evictions": 0, "backend": "onnxruntime"}}

    fake.pool_states = resident
    assert http.post("/v2/repository/index").json()[0]["state"] == "READY"
    app.refresh_ready({"simple": 1})
    app.refresh_ready({"simple": 0})  # the pool replica died; its replacement is not counted yet
    assert http.post("/v2/models/simple/infer", json={"inputs": []}).status_code == 503
    assert http.post("/v2/repository/index").json() == [
        {"name": "simple", "version": "1", "state": "UNAVAILABLE",
         "reason": "the pool has no running replica; retry shortly"}]


# --- a load never leaves the router's view apart from what the replicas serve -------------------

def edit_config(root: Path, name: str, **changes: Any) -> None:
    raw = yaml.safe_load((root / name / "config.yaml").read_text())
    raw.update(changes)
    (root / name / "config.yaml").write_text(yaml.safe_dump(raw))


def test_a_triton_folder_added_at_run_time_loads_into_the_pool_and_one_that_batches_is_refused_naming_its_file(root):
    """A config.pbtxt with dynamic_batching makes a dedicated model (``contract.triton_config``),
    which a load at run time cannot make: the error names the config.pbtxt and its field, not an
    absent config.yaml's ``deployment.mode``."""
    app, fake, http = explicit_router(root)
    for name, extra in (("tri", ""), ("tri_batched", "dynamic_batching { }\n")):
        (root / name / "1").mkdir(parents=True)
        shutil.copy(ENGINES / "simple" / "1" / "model.onnx", root / name / "1" / "model.onnx")
        (root / name / "config.pbtxt").write_text('platform: "onnxruntime_onnx"\nmax_batch_size: 2\n' + extra)
    assert http.post("/v2/repository/models/tri/load").status_code == 200
    assert http.get("/v2/models/tri/config").json()["max_batch_size"] == 2
    r = http.post("/v2/repository/models/tri_batched/load")
    assert (r.status_code, r.json()["error"]) == (
        400, f"failed to load 'tri_batched': {root}/tri_batched/config.pbtxt: dynamic_batching: a dedicated model "
             "needs a deployment of its own, made when the application is deployed (serve deploy); models added at "
             "run time load into the pool (deployment.mode: pool, a config.pbtxt without dynamic_batching)")


def deployed_router(root: Path) -> tuple[FakeControlClient, TestClient]:
    """A router over ``simple`` (dedicated), ``spare`` (pool), ``pipe`` (a pipeline calling
    ``spare`` as a step), every one loaded and answering."""
    add_model(root, "spare")
    raw = yaml.safe_load((ENGINES / "ocr" / "config.yaml").read_text())
    raw["parameters"]["steps"] = ["spare"]
    (root / "pipe").mkdir()
    (root / "pipe" / "config.yaml").write_text(yaml.safe_dump(raw))
    repo = ModelRepository(root)
    fake = FakeControlClient(repo, initial_state({"simple": "dedicated", "spare": "pool", "pipe": "pipeline"},
                                                 {"simple", "spare", "pipe"}))
    fake.dedicated = {"simple": object(), "pipe": object()}
    fake.pool_models = {"spare"}
    app = RouterApp(repo, fake, RouterOptions(max_body_bytes=1 << 20, request_timeout_s=5), initial=fake.initial)
    for name in ("simple", "pipe"):
        app.states.answered(name)
    return fake, TestClient(app.build_app(), raise_server_exceptions=False)


@pytest.mark.parametrize("name, what", [
    ("simple", "this dedicated model's deployment"),
    ("pipe", "this pipeline's deployment"),
    ("spare", "the pipeline(s) ['pipe'] calling it as a step"),
])
def test_a_load_of_a_changed_config_that_a_deployment_was_built_with_is_400_and_changes_nothing(root, name, what):
    """The router read the folder again and described the new config (metadata, config, index)
    while the replicas validated requests against the one they were deployed with (a pipeline's
    replica never re-read it). Now the load is refused, naming the fields and what can be
    loaded, and nothing changes: the desired state, the router's config route, the readiness."""
    fake, http = deployed_router(root)
    before = http.get(f"/v2/models/{name}/config").json()
    revision = fake.control.revision
    field, value = ("parameters", {"steps": ["spare"], "text_score": 0.9}) if name == "pipe" else ("max_batch_size", 4)
    edit_config(root, name, **{field: value})
    r = http.post(f"/v2/repository/models/{name}/load")
    assert r.status_code == 400, r.text
    assert r.json()["error"] == (
        f"failed to load '{name}': {root}/{name}/config.yaml changed since {what} was deployed (fields "
        f"['{field}'], as completed from its model file); its replicas keep the config they were deployed with, "
        "so this load changes nothing: a config change needs a new deploy (serve deploy, or restart the server); "
        "a load takes a new version folder whose config is unchanged")
    assert http.get(f"/v2/models/{name}/config").json() == before
    assert fake.control.revision == revision
    assert http.get(f"/v2/models/{name}/ready").status_code == 200 or name == "spare"  # the fake pool holds none


def test_a_new_version_of_a_dedicated_model_with_its_config_unchanged_loads(root):
    fake, http = deployed_router(root)
    (root / "simple" / "2").mkdir()
    shutil.copy(root / "simple" / "1" / "model.onnx", root / "simple" / "2" / "model.onnx")
    assert http.post("/v2/repository/models/simple/load").status_code == 200
    assert http.get("/v2/models/simple").json()["versions"] == ["2"]


@pytest.mark.parametrize("replica_fails", [True, False])
def test_a_failed_load_of_a_changed_pool_model_leaves_the_routers_view_as_the_replicas_serve(root, replica_fails):
    """``repo.read`` replaced the router's entry before the load was known to succeed: after a
    load its replica refused (or a config the router refused, its placement), the router's
    metadata and config described the new folder while the replicas served the old."""
    app, fake, http = explicit_router(root)
    assert http.post("/v2/repository/models/simple/load").status_code == 200
    if replica_fails:
        edit_config(root, "simple", max_batch_size=4)
        fake.replicas["r1"].fail = OverBudget("model 'simple' needs 9.0 MiB")
        expected = (503, "failed to load 'simple': model 'simple' needs 9.0 MiB; it serves versions [1] as before")
    else:
        edit_config(root, "simple", max_batch_size=4, deployment={"mode": "dedicated"})
        expected = (400, f"failed to load 'simple': {root}/simple/config.yaml: deployment.mode: a dedicated model "
                         "needs a deployment of its own, made when the application is deployed (serve deploy); models "
                         "added at run time load into the pool (deployment.mode: pool); it serves versions [1] as before")
    r = http.post("/v2/repository/models/simple/load")
    assert (r.status_code, r.json()["error"]) == expected
    assert http.get("/v2/models/simple/config").json()["max_batch_size"] == 8
    assert app.repo.get("simple").config.deployment.mode == "pool"

    fake.replicas["r1"].fail = None  # a load that succeeds takes the folder, where a pool replica takes it too
    edit_config(root, "simple", max_batch_size=4, deployment={"mode": "pool"})
    assert http.post("/v2/repository/models/simple/load").status_code == 200
    assert http.get("/v2/models/simple/config").json()["max_batch_size"] == 4


def test_a_failed_load_of_a_pool_model_whose_every_load_fails_does_not_say_it_serves_as_before(root):
    """A pool model loaded on first use whose every load failed (ONNX Runtime made no session of
    its file): a load refused by the router answered "...; it serves versions [1] as before",
    though no request was ever answered, and the index said "not loaded yet; loads on first
    request". The index now gives the failure, as readiness does, and the load claims nothing."""
    app, fake, http = explicit_router(root)
    assert http.post("/v2/repository/models/simple/load").status_code == 200
    failure = "model 'simple': ONNX Runtime could not create a session from its model file simple/1/model.onnx: x"

    async def pool_states() -> dict[str, dict[str, Any]]:
        return {n: {"state": "absent", "evictions": 0, "backend": "onnxruntime",
                    "load_error": failure if n == "simple" else ""} for n in fake.pool_models}

    fake.pool_states = pool_states
    [line] = [item for item in http.post("/v2/repository/index").json() if item["name"] == "simple"]
    assert (line["state"], line["reason"]) == ("UNAVAILABLE", f"its last load failed: {failure}; the next request "
                                                              "tries again")
    assert http.get("/v2/models/simple/ready").json()["error"] == (f"model 'simple' is not ready: its last load "
                                                                  f"failed: {failure}; the next request tries again")
    edit_config(root, "simple", deployment={"mode": "dedicated"})  # refused by the router before any replica
    r = http.post("/v2/repository/models/simple/load")
    assert r.status_code == 400 and "as before" not in r.json()["error"], r.text
    edit_config(root, "simple", deployment={"mode": "pool"})
    fake.replicas["r1"].fail = InvalidModelFile(failure)  # refused by the replica
    r = http.post("/v2/repository/models/simple/load")
    assert (r.status_code, r.json()["error"]) == (400, f"failed to load 'simple': {failure}")


def test_a_failed_load_of_a_new_version_of_a_loaded_model_changes_nothing_and_the_old_version_serves(root):
    """A load of a new version that a replica failed (a truncated model file) rolled the model
    back to not loaded: its old version, which served until then, answered 503 everywhere.
    Now the control deployment restores the reading served before (its versions and config):
    the answer is the load's error, and version 1 keeps serving, its index line as before."""
    from deployments.runtime.contract.errors import LoadFault

    app, fake, http = explicit_router(root)
    assert http.post("/v2/repository/models/simple/load").status_code == 200
    served = http.post("/v2/repository/index").json()
    (root / "simple" / "2").mkdir()
    shutil.copy(ENGINES / "simple" / "1" / "model.onnx", root / "simple" / "2" / "model.onnx")
    fake.replicas["r1"].fail = LoadFault("model 'simple': onnx could not read its model file (DecodeError)")
    r = http.post("/v2/repository/models/simple/load")
    assert (r.status_code, r.json()["error"]) == (
        500, "failed to load 'simple': model 'simple': onnx could not read its model file (DecodeError); "
             "it serves versions [1] as before")
    state = fake.desired["simple"]
    assert (state["loaded"], state["versions"], state["reason"]) == (
        True, [1], "failed to load: model 'simple': onnx could not read its model file (DecodeError)")
    for _ in range(3):  # the failing replica keeps reporting its error: no second rollback
        asyncio.run(fake.poll())
    assert fake.desired["simple"]["loaded"]
    body = {"inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32", "data": a.ravel().tolist()}
                       for n, a in PAIR.items()]}
    r = http.post("/v2/models/simple/infer", json=body)
    assert r.status_code == 200 and r.json()["model_version"] == "1", r.text
    assert http.post("/v2/repository/index").json() == served  # version 1 as the pool replica holds it

    fake.replicas["r1"].fail = None  # the file repaired, a load takes version 2
    assert http.post("/v2/repository/models/simple/load").status_code == 200
    r = http.post("/v2/models/simple/infer", json=body)
    assert r.status_code == 200 and r.json()["model_version"] == "2", r.text


def test_a_failed_load_of_a_model_new_to_the_router_gives_its_reason(root):
    app, fake, http = explicit_router(root)
    add_model(root, "late")
    fake.replicas["r1"].fail = OverBudget("model 'late' needs 9.0 MiB")
    assert http.post("/v2/repository/models/late/load").status_code == 503
    body = {"inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32", "data": a.ravel().tolist()}
                       for n, a in PAIR.items()]}
    r = http.post("/v2/models/late/infer", json=body)
    assert r.status_code == 503 and "it is not loaded: failed to load: model 'late' needs 9.0 MiB" in r.json()["error"]
    assert [i for i in http.post("/v2/repository/index").json() if i["name"] == "late"] == [
        {"name": "late", "version": "1", "state": "UNAVAILABLE", "reason": "failed to load: model 'late' needs 9.0 MiB"}]


def test_a_load_that_outlives_its_request_takes_the_folder_it_read_once_every_replica_serves_it(root):
    app, fake, http = explicit_router(root, timeout_s=0.3)
    assert http.post("/v2/repository/models/simple/load").status_code == 200
    (root / "simple" / "2").mkdir()
    shutil.copy(root / "simple" / "1" / "model.onnx", root / "simple" / "2" / "model.onnx")
    fake.replicas["r1"].held = True
    assert http.post("/v2/repository/models/simple/load").status_code == 504
    assert [(i["version"], i["state"]) for i in http.post("/v2/repository/index").json()] == [("1", "LOADING")]
    fake.replicas["r1"].held = False
    asyncio.run(app.follow_desired(fake.control.desired()))
    assert http.get("/v2/models/simple").json()["versions"] == ["2"]
    assert [i["version"] for i in http.post("/v2/repository/index").json()] == ["2"]


def test_a_model_new_to_the_router_is_loading_in_the_index_while_its_load_goes_on(root):
    app, fake, http = explicit_router(root, timeout_s=0.3)
    add_model(root, "late")
    fake.replicas["r1"].held = True
    assert http.post("/v2/repository/models/late/load").status_code == 504
    assert [i for i in http.post("/v2/repository/index").json() if i["name"] == "late"] == [
        {"name": "late", "state": "LOADING", "reason": "asked for through the repository API"}]
    fake.replicas["r1"].held = False
    asyncio.run(app.follow_desired(fake.control.desired()))
    assert [i for i in http.post("/v2/repository/index").json() if i["name"] == "late"] == [
        {"name": "late", "version": "1", "state": "UNAVAILABLE", "reason": "not loaded yet; loads on first request"}]


# --- every router and every replica serve what the load read ------------------------------------

def add_version(root: Path, name: str, version: int) -> None:
    (root / name / str(version)).mkdir()
    shutil.copy(root / name / "1" / "model.onnx", root / name / str(version) / "model.onnx")


def two_routers(root: Path) -> tuple[FakeControlClient, TestClient, RouterApp, TestClient]:
    """Routers A and B (two replicas of the router) over one control deployment and its pool
    replica, ``simple`` loaded at build; returns the fake, A's HTTP client, B and B's client."""
    repo = ModelRepository(root)
    fake = FakeControlClient(repo, initial_state({"simple": "pool"}, {"simple"}))
    options = RouterOptions(max_body_bytes=1 << 20, request_timeout_s=5)
    a = RouterApp(repo, fake, options, initial=fake.initial)
    b = RouterApp(ModelRepository(root), fake, options, initial=fake.initial)
    return fake, TestClient(a.build_app(), raise_server_exceptions=False), b, TestClient(
        b.build_app(), raise_server_exceptions=False)


INFER_SIMPLE = {"inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32", "data": a.ravel().tolist()}
                           for n, a in PAIR.items()]}


def test_a_router_describes_and_labels_the_version_and_config_another_router_loaded(root):
    """Router A loaded version 2 (then a changed config) of a pool model router B already
    served: B never read the folder again (it skipped a model it knew), so its metadata, index
    and config kept version 1 and the old config, and it labelled the requests it routed 1,
    while the replicas served version 2."""
    fake, a, b, http_b = two_routers(root)
    asyncio.run(b.follow_desired(fake.control.desired()))
    assert http_b.get("/v2/models/simple").json()["versions"] == ["1"]
    add_version(root, "simple", 2)
    assert a.post("/v2/repository/models/simple/load").status_code == 200
    asyncio.run(b.follow_desired(fake.control.desired()))
    assert http_b.get("/v2/models/simple").json()["versions"] == ["2"]
    assert [(i["version"], i["state"]) for i in http_b.post("/v2/repository/index").json()] == [("2", "UNAVAILABLE")]
    r = http_b.post("/v2/models/simple/infer", json=INFER_SIMPLE)
    assert (r.status_code, r.json()["model_version"], fake.routed[-1]) == (200, "2", ("simple", "2")), r.text
    assert http_b.get("/v2/models/simple/versions/1").status_code == 404

    edit_config(root, "simple", max_batch_size=4)  # a reload that changes the pool model's config
    assert a.post("/v2/repository/models/simple/load").status_code == 200
    asyncio.run(b.follow_desired(fake.control.desired()))
    assert http_b.get("/v2/models/simple/config").json()["max_batch_size"] == 4


def test_a_load_refused_for_its_model_file_gives_the_failure_as_its_reason_on_every_router(root):
    """A load answered 400 before any replica tried it (a model file that is not ONNX) left the
    model listed as "not loaded: POST .../load loads it", unlike a load a replica failed. Now
    the failure is its reason, on the router that refused it and on the other, for a model new
    to them and for one unloaded before; a model that serves keeps serving when a load of it is
    refused."""
    repo = ModelRepository(root)
    fake = FakeControlClient(repo, initial_state({"simple": "pool"}, {"simple"}))
    options = RouterOptions(max_body_bytes=1 << 20, request_timeout_s=5)
    routers = [RouterApp(ModelRepository(root), fake, options, initial=fake.initial) for _ in range(2)]
    http = [TestClient(router.build_app(), raise_server_exceptions=False) for router in routers]
    add_model(root, "late")
    add_model(root, "spare")
    assert http[0].post("/v2/repository/models/spare/load").status_code == 200
    assert http[0].post("/v2/repository/models/spare/unload").status_code == 200
    for name in ("late", "spare"):  # a config completed from the model file: read by the router
        (root / name / "config.yaml").write_text("max_batch_size: 8\n")
        (root / name / "1" / "model.onnx").write_bytes(b"not an onnx model")
        r = http[0].post(f"/v2/repository/models/{name}/load")
        assert r.status_code == 400, r.text
        prefix = f"failed to load '{name}': "
        error = r.json()["error"]
        assert error.startswith(f"{prefix}model '{name}': its model file "), error
        reason = f"failed to load: {error.removeprefix(prefix)}"
        assert (fake.desired[name]["loaded"], fake.desired[name]["reason"]) == (False, reason)
        asyncio.run(fake.poll())
        for router, client in zip(routers, http):
            asyncio.run(router.follow_desired(fake.control.desired()))
            (item,) = [i for i in client.post("/v2/repository/index").json() if i["name"] == name]
            assert (item["state"], item["reason"]) == ("UNAVAILABLE", reason), item

    edit_config(root, "simple", max_batch_sise=4)
    r = http[0].post("/v2/repository/models/simple/load")
    assert r.status_code == 400, r.text
    assert fake.desired["simple"]["loaded"] and "reason" not in fake.desired["simple"]
    r = http[0].post("/v2/models/simple/infer", json=INFER_SIMPLE)
    assert r.status_code == 200, r.text


def test_a_router_that_reads_the_folder_otherwise_than_the_load_did_does_not_claim_it(root):
    """The folder changed between router A's load and router B's next pass: B must not describe
    or label its own reading under that load; it shows the model UNAVAILABLE with why."""
    fake, a, b, http_b = two_routers(root)
    add_version(root, "simple", 2)
    assert a.post("/v2/repository/models/simple/load").status_code == 200
    edit_config(root, "simple", max_batch_size=4)
    asyncio.run(b.follow_desired(fake.control.desired()))
    (item,) = http_b.post("/v2/repository/index").json()
    assert (item["version"], item["state"]) == ("1", "UNAVAILABLE")
    assert item["reason"].startswith(f"this router cannot read it as its load did: {root}/simple/config.yaml (or "
                                     "the model file it is completed from) changed since the load of 'simple' read it")
    r = http_b.post("/v2/models/simple/infer", json=INFER_SIMPLE)
    assert r.status_code == 503 and "this router cannot read it as its load did" in r.json()["error"], r.text
    assert a.post("/v2/repository/models/simple/load").status_code == 200  # a new load: B follows it
    asyncio.run(b.follow_desired(fake.control.desired()))
    assert http_b.post("/v2/models/simple/infer", json=INFER_SIMPLE).json()["model_version"] == "2"


def test_a_replica_serves_exactly_the_versions_the_load_read_or_fails_it_with_why(tmp_path):
    """A version folder added between the router's read and a replica's: the replica read the
    folder itself and served version 2, which the router did not report; one gone, or a config
    changed, in between: it served what it found. Now it loads the versions the desired state
    names, and a folder that no longer reads as the load read it fails the load, which the
    control deployment rolls back with why."""
    import onnxruntime as ort

    from deployments.control import reading

    from .test_versions import X, replicas_of_cnn, versioned_repository

    root = versioned_repository(tmp_path, {1: 0}, {"all": {}})
    pool, dedicated = replicas_of_cnn(root)
    initial = initial_state({"cnn": "pool"}, {"cnn"})
    control = Control(initial, store=MemoryStore())
    control.set("cnn", True, "pool", reading(ModelRepository(root).peek("cnn")))  # the router's read
    versioned_repository(root, {2: 5}, {"all": {}})  # version 2 arrives before the replicas read
    state = control.models["cnn"]
    assert pool.apply({"cnn": state})["cnn"]["error"] is None
    assert dedicated.apply({"cnn": {**state, "placement": "dedicated"}})["cnn"]["error"] is None
    assert pool.keys == {"cnn": ("cnn", 1)} and pool.routes.repo.get("cnn").served == (1,)
    assert dedicated.host.version == 1 and dedicated.routes.repo.get("cnn").served == (1,)
    expected = ort.InferenceSession(str(root / "cnn" / "1" / "model.onnx")).run(None, {"input": X})[0]
    np.testing.assert_allclose(pool.cache.infer("cnn", {"input": X})["logits"], expected, rtol=1e-4, atol=1e-5)

    follower = Follower(Remote(control), initial, pool.apply, replica="p1", deployment="pool")
    read = reading(ModelRepository(root).peek("cnn"))  # the router's read: versions 1 and 2
    edit_config(root, "cnn", max_batch_size=4)  # changed before the replica reads
    control.set("cnn", True, "pool", read)
    asyncio.run(follower.sync())
    assert control.models["cnn"]["loaded"] is False
    assert control.models["cnn"]["reason"].startswith(
        f"failed to load: {root}/cnn/config.yaml (or the model file it is completed from) changed since the load "
        "of 'cnn' read it (config hash ")
    edit_config(root, "cnn", max_batch_size=32)
    control.set("cnn", True, "pool", read)  # loaded again
    shutil.rmtree(root / "cnn" / "2")  # gone before the replica reads
    asyncio.run(follower.sync())
    assert control.models["cnn"]["reason"] == (f"failed to load: {root}/cnn: version folder(s) [2] "
                                               "(<version>/model.onnx) are gone; versions on disk: [1]")
    asyncio.run(follower.sync())  # the rollback (nothing was kept: a load asked for without it) reaches it
    assert pool.routes.states.get("cnn").reason == control.models["cnn"]["reason"]
    pool.cache.close()
    dedicated.host.unload()
