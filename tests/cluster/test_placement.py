"""Fractional GPUs: replicas pack onto a GPU node's logical GPU; what does not fit waits, visibly."""

from __future__ import annotations

import json
import re

import pytest
import requests

from .conftest import (
    SLOW_STARTUP_WARNING_S,
    TINY_BODY,
    TINY_CNN_CONFIG,
    TINY_CNN_ONNX,
    add_model,
    deployment_details,
    post,
    replicas,
    running,
    wait_for,
)

pytestmark = pytest.mark.integration

_WAITING = re.compile(r"has (\d+) replicas that have taken more than \d+s to be scheduled")
_REQUIRED = re.compile(r"Resources required for each replica: (\{[^}]*\})")


def test_quarter_gpu_replicas_pack_four_per_gpu_and_a_whole_gpu_model_waits_with_a_clear_status(
        ray_cluster, tmp_path):
    from ray import serve

    from deployments.app import INGRESS_MAX_ONGOING_REQUESTS, delete_server, run_applications

    url = ray_cluster.url
    gpu_a = ray_cluster.gpu_nodes[0]
    frac_repo, pending_repo = tmp_path / "frac", tmp_path / "pending"
    add_model(frac_repo, "quarter", TINY_CNN_CONFIG,
              {"mode": "dedicated", "num_replicas": 5, "num_gpus": 0.25, "num_cpus": 0.1,
               "max_ongoing_requests": 8}, TINY_CNN_ONNX)
    add_model(pending_repo, "whole", TINY_CNN_CONFIG, {"mode": "dedicated", "num_gpus": 1}, TINY_CNN_ONNX)
    add_model(pending_repo, "on_cpu", TINY_CNN_CONFIG, {"mode": "dedicated"}, TINY_CNN_ONNX)
    try:
        # One GPU node: four quarter-GPU replicas fill its GPU, the fifth waits for resources.
        run_applications({"repository": str(frac_repo), "use_gpus": True},
                   name="frac", route_prefix="/frac", wait=False, one_hop=False)
        wait_for(lambda: running("frac", "model-quarter") == 4, 90, "4 quarter-GPU replicas running")
        placed = replicas("frac", "model-quarter")
        assert sorted(r["node_id"] for r in placed if r["state"] == "RUNNING") == [gpu_a.node_id] * 4
        assert [r["state"] for r in placed if r["state"] != "RUNNING"] == ["STARTING"]
        config = deployment_details("frac", "model-quarter")["deployment_config"]
        assert config["ray_actor_options"]["num_gpus"] == 0.25
        assert config["ray_actor_options"]["num_cpus"] == 0.1
        # the model's max_ongoing_requests (8) is its replicas' own bound (admission.Admission); Serve's sits above
        assert config["max_ongoing_requests"] == INGRESS_MAX_ONGOING_REQUESTS and config["num_replicas"] == 5
        # The message is refreshed every SLOW_STARTUP_WARNING_S: it may first count all five.
        message = wait_for(lambda: _pending_message("frac", "model-quarter", replicas=1),
                           SLOW_STARTUP_WARNING_S * 3 + 30, "the pending replica reported in serve.status")
        assert _required(message) == {"CPU": 0.1, "GPU": 0.25}
        wait_for(lambda: requests.get(f"{url}/frac/v2/health/ready").status_code == 200, 60, "frac ready")
        assert post(f"{url}/frac/v2/models/quarter/infer", TINY_BODY).status_code == 200

        # A second GPU node joins (as an autoscaling cluster would add one): the fifth lands there.
        gpu_b = ray_cluster.add_gpu_node()
        wait_for(lambda: running("frac", "model-quarter") == 5, 90, "fifth replica on the new GPU node")
        nodes = sorted(r["node_id"] for r in replicas("frac", "model-quarter"))
        assert nodes == sorted([gpu_a.node_id] * 4 + [gpu_b.node_id])

        # 0.75 GPU is free now, on node B: a model needing a whole GPU stays pending, its
        # application's other model serves, and the router answers 503 naming the pending one.
        run_applications({"repository": str(pending_repo), "use_gpus": True},
                   name="pending", route_prefix="/pending", wait=False, one_hop=False)
        wait_for(lambda: running("pending", "model-on_cpu") == 1, 90, "on_cpu running")
        wait_for(lambda: requests.get(f"{url}/pending/v2/models/on_cpu/ready").status_code == 200,
                 60, "router sees on_cpu ready")
        assert post(f"{url}/pending/v2/models/on_cpu/infer", TINY_BODY).status_code == 200
        r = post(f"{url}/pending/v2/models/whole/infer", TINY_BODY)
        assert r.status_code == 503, r.text
        assert "model 'whole' is not ready" in r.json()["error"]
        r = requests.get(f"{url}/pending/v2/health/ready")
        assert r.status_code == 503 and "whole" in r.json()["error"]
        message = wait_for(lambda: _pending_message("pending", "model-whole", replicas=1),
                           SLOW_STARTUP_WARNING_S * 3 + 30, "the pending model reported in serve.status")
        assert _required(message) == {"CPU": 0.1, "GPU": 1.0}
        status = serve.status().applications
        assert status["pending.whole"].deployments["model-whole"].status == "UPDATING"
        assert status["pending.whole"].deployments["model-whole"].replica_states.get("RUNNING", 0) == 0
        assert status["pending.on_cpu"].deployments["model-on_cpu"].status == "HEALTHY"
        assert [r["state"] for r in replicas("pending", "model-whole")] == ["STARTING"]
        # The first application is untouched.
        assert post(f"{url}/frac/v2/models/quarter/infer", TINY_BODY).status_code == 200
    finally:
        for app in ("frac", "pending"):
            delete_server(app)


def _pending_message(app: str, deployment: str, replicas: int) -> str | None:
    """The deployment's ``serve.status`` message once it reports ``replicas`` replicas waiting
    for resources."""
    from ray import serve

    from deployments.client import deployment_application

    status = serve.status().applications.get(deployment_application(app, deployment))
    message = status.deployments[deployment].message if status and deployment in status.deployments else ""
    waiting = _WAITING.search(message)
    return message if waiting and int(waiting.group(1)) == replicas and _REQUIRED.search(message) else None


def _required(message: str) -> dict[str, float]:
    """Resources one replica asks for, as Serve's pending-replica message states them."""
    match = _REQUIRED.search(message)
    assert match, message
    return json.loads(match.group(1))
