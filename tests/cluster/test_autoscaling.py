"""Per-model autoscaling: replicas grow toward max under load and shrink back to min after it."""

from __future__ import annotations

import time

import pytest

from .conftest import BUSY_BODY, BUSY_CONFIG, Load, add_model, deployment_details, running, wait_for

pytestmark = pytest.mark.integration

AUTOSCALING = {"min_replicas": 1, "max_replicas": 3, "initial_replicas": 1, "target_ongoing_requests": 1,
               "upscale_delay_s": 0.5, "downscale_delay_s": 2, "metrics_interval_s": 0.5,
               "look_back_period_s": 1}


def test_replicas_grow_toward_max_under_load_and_shrink_to_min_after_it(ray_cluster, tmp_path):
    from ray import serve

    from deployments.app import INGRESS_MAX_ONGOING_REQUESTS, delete_server, run_applications

    add_model(tmp_path, "busy", BUSY_CONFIG, {"mode": "dedicated", "autoscaling": AUTOSCALING,
                                              "max_ongoing_requests": 4, "num_cpus": 0.1})
    url = f"{ray_cluster.url}/scale/v2/models/busy/infer"
    try:
        run_applications({"repository": str(tmp_path), "use_gpus": True}, name="scale",
                  route_prefix="/scale", one_hop=False)  # Serve's Python proxy here: the router answers
        config = deployment_details("scale", "model-busy")["deployment_config"]
        assert {k: config["autoscaling_config"][k] for k in AUTOSCALING} == AUTOSCALING
        # the model's own max_ongoing_requests (4) bounds its replica's requests (admission.Admission);
        # Serve's, whose shedding answers plain text, sits far above it
        assert config["max_ongoing_requests"] == INGRESS_MAX_ONGOING_REQUESTS
        assert running("scale", "model-busy") == 1

        # Four clients back to back against target_ongoing_requests 1: Serve wants 4 replicas,
        # max_replicas caps it at 3.
        # A deadline, not a timing: on a busy 2-core machine a new replica's start (a process,
        # the model's load, its first health check) took over 60 s once in two suites.
        with Load(url, BUSY_BODY, threads=4, max_duration_s=180) as load:
            peak = wait_for(lambda: (n := running("scale", "model-busy")) == 3 and n, 150,
                            "scale-up to max_replicas under load")
            time.sleep(2)  # keep serving with all replicas up
        outcomes = load.outcomes
        assert peak == 3
        assert outcomes and all(o.status == 200 for o in outcomes), _summary(outcomes)

        wait_for(lambda: running("scale", "model-busy") == 1 and
                 serve.status().applications["scale.busy"].deployments["model-busy"].status == "HEALTHY",
                 45, "scale-down to min_replicas after the load")
    finally:
        delete_server("scale")


def _summary(outcomes) -> str:
    bad = [o for o in outcomes if o.status != 200]
    return f"{len(bad)} of {len(outcomes)} failed, first: {bad[:3]}"
