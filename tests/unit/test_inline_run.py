"""A dedicated replica and the pool's cache run a short model's request on the event loop, not in
a worker thread (``ModelHost.runs_inline``), with the same answers, errors and timeout as through a
thread."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from starlette.testclient import TestClient

from deployments.runtime.residency import host as host_module
from deployments.model import ModelDeployment
from deployments.protocol.answer import within_timeout
from deployments.routes import RouterOptions
from deployments.runtime.contract.config import CacheOptions
from deployments.runtime.contract.errors import InferenceTimeout
from deployments.runtime.residency.cache import ModelCache

Deployment = ModelDeployment.func_or_class  # the class under Serve's decorator
X0 = np.arange(16, dtype=np.int32).reshape(1, 16)
X1 = np.full((1, 16), 3, dtype=np.int32)
BODY = {"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": X0.ravel().tolist()},
                   {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": X1.ravel().tolist()}]}


@pytest.fixture(params=[False, True], ids=["asyncio", "uvloop"])
def replica(prepared_engines, request):
    """Triton's ``simple`` (OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1, ONNX Runtime CPU) in a
    dedicated replica without Ray, metrics off, and whether each run found an event loop running in
    its thread (True: it ran inline); served on asyncio's loop and on uvloop's (Serve's replicas
    run on uvloop, whose clock stands still during a run that never yields)."""
    replica = Deployment.__new__(Deployment)
    asyncio.run(Deployment.__init__(replica, str(prepared_engines), "simple", "onnxruntime",
                                    RouterOptions(max_body_bytes=1 << 20, request_timeout_s=60.0),
                                    {"enabled": False}))
    on_loop: list[bool] = []
    replica.host.run = recording(replica.host.run, on_loop)
    client = TestClient(replica.__serve_build_asgi_app__(), raise_server_exceptions=False,
                        backend_options={"use_uvloop": request.param})
    yield client, replica, on_loop
    replica.host.unload()


def recording(run, on_loop: list[bool]):
    """``run`` (a ``ModelHost.run``) that appends whether it found an event loop running in its thread."""
    def recorded(*args, **kwargs):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return run(*args, **kwargs)

    return recorded


def outputs(r) -> dict[str, list[int]]:
    assert r.status_code == 200, r.text
    return {o["name"]: o["data"] for o in r.json()["outputs"]}


def test_a_short_model_runs_on_the_event_loop_after_its_first_run(replica, monkeypatch):
    client, deployment, on_loop = replica
    monkeypatch.setattr(host_module, "INLINE_RUN_S", 60.0)  # every run counts as short
    for _ in range(3):
        assert outputs(client.post("/v2/models/simple/infer", json=BODY)) == {
            "OUTPUT0": (X0 + X1).ravel().tolist(), "OUTPUT1": (X0 - X1).ravel().tolist()}
    # the first in a thread (no run measured yet), then on the loop; each run measured
    assert on_loop == [False, True, True]
    assert deployment.host.recent_run_s is not None and deployment.host.in_flight == 0


def test_a_model_slower_than_the_bound_runs_in_a_worker_thread(replica, monkeypatch):
    client, _, on_loop = replica
    monkeypatch.setattr(host_module, "INLINE_RUN_S", 0.0)
    for _ in range(2):
        assert outputs(client.post("/v2/models/simple/infer", json=BODY))["OUTPUT0"] == (X0 + X1).ravel().tolist()
    assert on_loop == [False, False]


def test_an_inline_run_past_the_requests_own_timeout_is_504_as_through_a_thread(replica, monkeypatch):
    client, _, on_loop = replica
    monkeypatch.setattr(host_module, "INLINE_RUN_S", 60.0)
    assert client.post("/v2/models/simple/infer", json=BODY).status_code == 200  # measured: inline from now on
    r = client.post("/v2/models/simple/infer", json={**BODY, "parameters": {"timeout": 1}})
    assert r.status_code == 504, r.text
    assert r.json()["error"] == ("model 'simple' did not answer within 0.001 ms "
                                 "(the request's parameters.timeout: 1 microseconds)")
    assert on_loop == [False, True]


def test_a_client_error_of_an_inline_run_is_the_same_400(replica, monkeypatch):
    client, _, on_loop = replica
    monkeypatch.setattr(host_module, "INLINE_RUN_S", 60.0)
    assert client.post("/v2/models/simple/infer", json=BODY).status_code == 200
    bad = {"inputs": [{**BODY["inputs"][0], "shape": [1, 17], "data": list(range(17))}, BODY["inputs"][1]]}
    inline = client.post("/v2/models/simple/infer", json=bad)
    monkeypatch.setattr(host_module, "INLINE_RUN_S", 0.0)
    threaded = client.post("/v2/models/simple/infer", json=bad)
    assert inline.status_code == threaded.status_code == 400, inline.text
    assert inline.json() == threaded.json()


def test_the_pools_short_run_runs_in_the_callers_thread_and_gives_the_model_back(model_repository, monkeypatch):
    cache = ModelCache(model_repository, ["simple"], CacheOptions(load_policy="lazy"), backend="onnxruntime")
    monkeypatch.setattr(host_module, "INLINE_RUN_S", 60.0)
    inputs = {"INPUT0": X0, "INPUT1": X1}

    on_loop: list[bool] = []
    cache._slot("simple").host.run = recording(cache._slot("simple").host.run, on_loop)

    async def three() -> list[dict[str, np.ndarray]]:
        first = await cache.infer_async("simple", inputs)  # loads it: its footprint's runs in a thread
        assert on_loop[0] is False
        on_loop.clear()
        return [first] + [await cache.infer_async("simple", inputs) for _ in range(2)]

    answers = asyncio.run(three())
    assert [a["OUTPUT0"].tolist() for a in answers] == [(X0 + X1).tolist()] * 3
    assert on_loop == [True, True]
    assert cache.status()["models"]["simple"]["in_use"] == 0  # each inline run released its hold
    cache.close()


def test_an_answer_that_never_yielded_past_its_bound_is_504():
    async def blocking_run() -> dict:  # as a model run in the loop's thread: no await inside
        time.sleep(0.02)
        return {}

    with pytest.raises(InferenceTimeout) as raised:
        asyncio.run(within_timeout("simple", blocking_run(), 0.001, 60.0))
    assert raised.value.message == ("model 'simple' did not answer within 1 ms "
                                    "(the request's parameters.timeout: 1000 microseconds)")
