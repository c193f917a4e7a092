"""A dedicated replica runs a short model's request on its event loop, not in a worker thread
(``ModelDeployment._runs_inline``), with the same answers and the same timeout as through a thread."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from starlette.testclient import TestClient

from deployments import model as model_module
from deployments.model import ModelDeployment
from deployments.routes import RouterOptions

Deployment = ModelDeployment.func_or_class  # the class under Serve's decorator
X0 = np.arange(16, dtype=np.int32).reshape(1, 16)
X1 = np.full((1, 16), 3, dtype=np.int32)
BODY = {"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": X0.ravel().tolist()},
                   {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": X1.ravel().tolist()}]}


@pytest.fixture
def replica(prepared_engines):
    """Triton's ``simple`` (OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1, ONNX Runtime CPU) in a
    dedicated replica without Ray, metrics off, and whether each run found an event loop running in
    its thread (True: it ran inline)."""
    replica = Deployment.__new__(Deployment)
    asyncio.run(Deployment.__init__(replica, str(prepared_engines), "simple", "onnxruntime",
                                    RouterOptions(max_body_bytes=1 << 20, request_timeout_s=60.0),
                                    {"enabled": False}))
    on_loop: list[bool] = []
    run = replica.host.run

    def recorded(*args, **kwargs):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return run(*args, **kwargs)

    replica.host.run = recorded
    yield TestClient(replica.__serve_build_asgi_app__(), raise_server_exceptions=False), replica, on_loop
    replica.host.unload()


def outputs(r) -> dict[str, list[int]]:
    assert r.status_code == 200, r.text
    return {o["name"]: o["data"] for o in r.json()["outputs"]}


def test_a_short_model_runs_on_the_event_loop_after_its_first_run(replica, monkeypatch):
    client, deployment, on_loop = replica
    monkeypatch.setattr(model_module, "INLINE_RUN_S", 60.0)  # every run counts as short
    for _ in range(3):
        assert outputs(client.post("/v2/models/simple/infer", json=BODY)) == {
            "OUTPUT0": (X0 + X1).ravel().tolist(), "OUTPUT1": (X0 - X1).ravel().tolist()}
    # the first in a thread (no run measured yet), then on the loop; each run measured
    assert on_loop == [False, True, True]
    assert deployment.host.recent_run_s is not None and deployment.host.in_flight == 0


def test_a_model_slower_than_the_bound_runs_in_a_worker_thread(replica, monkeypatch):
    client, _, on_loop = replica
    monkeypatch.setattr(model_module, "INLINE_RUN_S", 0.0)
    for _ in range(2):
        assert outputs(client.post("/v2/models/simple/infer", json=BODY))["OUTPUT0"] == (X0 + X1).ravel().tolist()
    assert on_loop == [False, False]


def test_an_inline_run_past_the_requests_own_timeout_is_504_as_through_a_thread(replica, monkeypatch):
    client, _, on_loop = replica
    monkeypatch.setattr(model_module, "INLINE_RUN_S", 60.0)
    assert client.post("/v2/models/simple/infer", json=BODY).status_code == 200  # measured: inline from now on
    r = client.post("/v2/models/simple/infer", json={**BODY, "parameters": {"timeout": 1}})
    assert r.status_code == 504, r.text
    assert r.json()["error"] == ("model 'simple' did not answer within 0.001 ms "
                                 "(the request's parameters.timeout: 1 microseconds)")
    assert on_loop == [False, True]


def test_a_client_error_of_an_inline_run_is_the_same_400(replica, monkeypatch):
    client, _, on_loop = replica
    monkeypatch.setattr(model_module, "INLINE_RUN_S", 60.0)
    assert client.post("/v2/models/simple/infer", json=BODY).status_code == 200
    bad = {"inputs": [{**BODY["inputs"][0], "shape": [1, 17], "data": list(range(17))}, BODY["inputs"][1]]}
    inline = client.post("/v2/models/simple/infer", json=bad)
    monkeypatch.setattr(model_module, "INLINE_RUN_S", 0.0)
    threaded = client.post("/v2/models/simple/infer", json=bad)
    assert inline.status_code == threaded.status_code == 400, inline.text
    assert inline.json() == threaded.json()
