"""``routes.ClusterGuard``: a replica app (the router's, a dedicated model's or pipeline's, a pool
replica's: every one built by ``V2Routes.build_app``) answers 421 to a request that another Ray
cluster's HAProxy stamped (``haproxy.CLUSTER_HEADER``) and runs it for its own cluster's HAProxy
and for a request without the stamp (Serve's Python proxy, a handle, a test)."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.testclient import TestClient

from deployments.adapters import PoolAdapter
from deployments.haproxy import CLUSTER_HEADER
from deployments.ingress import RouterApp
from deployments.replica_routes import ModelRoutes, PoolRoutes
from deployments.routes import RouterOptions, V2Routes
from deployments.runtime.contract.repository import ModelRepository

from .test_router_routes import GOOD, FakeModelClient, assert_error

OURS, THEIRS = "session_2026-12-02_15-00-05_415190_27754", "session_2026-12-02_14-58-11_102030_26001"
OPTIONS = RouterOptions(1 << 20, 5.0)


def _model_routes(repo: ModelRepository) -> V2Routes:
    routes = ModelRoutes(repo.get("simple"), repo, None, OPTIONS)
    routes.model_loaded("onnxruntime")
    return routes


def _pool_routes(repo: ModelRepository) -> V2Routes:
    return PoolRoutes(repo, PoolAdapter(["tiny_cnn"], None, dict), OPTIONS)


@pytest.mark.parametrize("build", [_model_routes, _pool_routes], ids=["dedicated model", "pool"])
def test_a_replica_answers_421_to_another_clusters_haproxy_and_serves_its_own(model_repository, build):
    routes = build(model_repository)
    routes.cluster = OURS
    client = TestClient(routes.build_app(), raise_server_exceptions=False)
    assert_error(client.get("/v2/health/live", headers={CLUSTER_HEADER: THEIRS}), 421,
                 "this replica belongs to another Ray cluster", f"'{OURS}', not '{THEIRS}'", "stale or shared port",
                 "was not run")
    assert client.get("/v2/health/live", headers={CLUSTER_HEADER: OURS}).json() == {"live": True}
    assert client.get("/v2/health/live").json() == {"live": True}  # not through HAProxy


def test_the_router_runs_no_infer_for_another_clusters_haproxy_and_runs_its_own(model_repository):
    fake = FakeModelClient(model_repository)
    router = RouterApp(model_repository, fake, OPTIONS)
    asyncio.run(asyncio.wait_for(router.poll_ready(), 5.0))
    router.cluster = OURS
    client = TestClient(router.build_app(), raise_server_exceptions=False)
    body = json.dumps({"inputs": [GOOD]})

    def infer(cluster: str):
        return client.post("/v2/models/resnet18/infer", content=body,
                           headers={"Content-Type": "application/json", CLUSTER_HEADER: cluster})

    assert_error(infer(THEIRS), 421, "another Ray cluster")
    assert fake.calls == []
    assert infer(OURS).status_code == 200
    assert [name for name, _, _ in fake.calls] == ["resnet18"]


def test_a_replica_that_cannot_tell_its_cluster_serves_every_request(model_repository):
    routes = _model_routes(model_repository)
    assert routes.cluster is None  # no RAY_RAYLET_PID here: not a Ray worker
    client = TestClient(routes.build_app(), raise_server_exceptions=False)
    assert client.get("/v2/health/live", headers={CLUSTER_HEADER: THEIRS}).status_code == 200
