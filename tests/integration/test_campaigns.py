"""The reliability campaigns in their short form (bench/fuzz.py, bench/soak.py, bench/faults.py
run the full ones; docs/reliability.md), against one application of the real
repository served by real Ray Serve on 127.0.0.1, shared by the module.

The application serves a scratch copy of ``engines/`` (version folders linked; a fault copies
the file it damages) with a pool of at most 2 models, so LRU evictions happen all the time.
"""

from __future__ import annotations

import os
import re

import pytest

from bench import faults, fuzz, soak
from bench.replicas import replica_pids, server_rss_bytes

from .conftest import wait_ready

pytestmark = pytest.mark.integration

APP = "campaigns"


@pytest.fixture(scope="module")
def campaign(serve_instance, prepared_engines, tmp_path_factory):
    """(base URL, Ray session id, scratch repository) of the campaign application."""
    from deployments.app import delete_server, run_applications

    repository = faults.scratch_repository(tmp_path_factory.mktemp("campaign") / "engines", prepared_engines)
    # Serve's Python proxy in front (the session's Serve instance): the models' applications get no
    # route prefix, as `make serve FAST=0` gives them (docs/placement.md, "Where a request goes"): the router
    # sends again a request whose model replica died holding it, which Serve's proxy does not
    run_applications({"repository": str(repository), "pool": {"max_num_models_per_replica": 2}},
                     name=APP, route_prefix=f"/{APP}", one_hop=False)
    url = f"{serve_instance}/{APP}"
    wait_ready(url)
    yield url, os.getsid(0), repository  # ray.init ran here: Ray's processes share this session
    delete_server(APP)


def test_a_model_file_truncated_before_its_load_is_a_clear_400_and_heals_once_repaired(campaign):
    # first in the module: the pool has loaded nothing yet
    url, _, repository = campaign
    result = faults.damaged_model_file(url, repository)
    assert result.lost == 0, result
    assert result.answers == {"400": 2, "200": 1}
    # the reader is onnx (the footprint's prediction) or ONNX Runtime (a footprint already known)
    assert re.fullmatch(
        r"model 'simple_identity': its model file simple_identity/1/model.onnx is not a valid ONNX model: (onnx|ONNX "
        r"Runtime) could not parse it \(\w+; damaged, truncated or another format\); the server log has the details",
        result.errors["400"]), result
    assert result.recovered


def test_fuzzed_requests_get_no_5xx_no_hang_and_only_clean_error_bodies(campaign):
    url, _, _ = campaign
    report = fuzz.fuzz(url, 400, seed=12)
    assert report.requests == 400
    assert report.findings == [], fuzz.summary(report)
    assert report.alive_after
    # the cases reach every layer: answers, client errors of several kinds, unknown routes
    assert {"200", "400", "404"} <= set(report.by_status), report.by_status
    assert all(int(s) < 500 or s == "504" for s in report.by_status), report.by_status


def test_fuzz_checker_flags_what_it_must():
    case = fuzz.Case(0, "POST", "/v2/models/simple/infer", {}, b"")
    assert fuzz.check(case, 500, {}, b'{"error": "internal server error"}') == ["5xx"]
    assert fuzz.check(case, None, {}, b"") == ["hang or no HTTP answer"]
    assert fuzz.check(case, 400, {}, b"Bad Request") == ["error body is not JSON"]
    assert fuzz.check(case, 400, {}, b'{"detail": "x"}') == ['error body is not {"error": text}']
    for leak in ('Traceback (most recent call last)', "KeyError('x')", 'File "/work/x.py", line 3',
                 "<object at 0x7f00>", "[ONNXRuntimeError] : 2"):
        assert fuzz.check(case, 400, {}, fuzz.json.dumps({"error": leak}).encode()) == ["internal text in error"]
    assert fuzz.check(case, 400, {}, b'{"error": "inference input \'x\' data-type is \'FP32\'"}') == []
    assert fuzz.check(case, 503, {"Retry-After": "1"}, b'{"error": "overloaded"}') == []


def test_short_soak_with_a_pool_replica_killed_loses_no_request(campaign):
    url, session, _ = campaign
    report = soak.soak(url, session, APP, duration_s=40, kill_every_s=12, concurrency=2, think_s=0.05,
                       targets=("pool", "model-ocr_cls"), warmup_s=5, window_s=10, sample_every_s=2)
    assert report.lost == 0, soak.summary(report)
    assert report.requests == report.ok + sum(report.documented.values())
    assert set(report.documented) <= {"503", "504"}
    assert [k["deployment"] for k in report.kills] == ["pool", "model-ocr_cls"]
    assert report.kills[0]["replaced_after_s"] is not None  # Serve replaced the killed pool replica
    # every model got requests, and the pool evicted (2 models at most, 6 in use)
    assert {"tiny_cnn", "mid_cnn", "resnet18", "simple", "ocr", "ocr_det"} <= set(report.by_model)
    # counted by the killed pool replica before its kill and by its replacement since: a
    # replacement that came up late on a busy machine may not have evicted yet
    assert report.evictions_before_kills + soak.pool_evictions(url) > 0
    # RSS is read per role from the first sample on; the killed roles come back and are read again
    # (Serve notices a dead replica at its next health check, up to 10 s after the kill: the
    # run's last sample can come before the replacement of the one killed at 24 s)
    roles = report.rss_samples[0]["rss_bytes"]
    assert {"router", "pool", "model-ocr_cls", "ray"} <= set(roles) and min(roles.values()) > 0
    faults.wait_replicas(session, APP, ["pool", "model-ocr_cls"])
    roles = server_rss_bytes(session, APP)
    assert {"router", "pool", "model-ocr_cls", "ray"} <= set(roles) and min(roles.values()) > 0


def test_a_pool_replica_killed_in_the_middle_of_a_load_answers_and_the_pool_heals(campaign):
    url, session, _ = campaign
    result = faults.pool_kill_mid_load(url, session, APP)
    print(result)  # the answers, for the log (pytest -rA)
    assert result.detail.startswith("killed pool replica pid"), result.detail
    assert result.lost == 0, result
    assert result.recovered, result
    faults.wait_replicas(session, APP, ["pool"])
    assert len(replica_pids(session, APP, "pool")) == 1


def test_the_router_replica_killed_under_load_answers_every_request_and_heals(campaign):
    # Ray's Python proxy in front (the module's Serve instance): what it held gets its plain-text
    # 500; through HAProxy (make serve): tests/integration/test_ports.py
    url, session, _ = campaign
    result = faults.router_kill_under_load(url, session, APP, python_proxy=True)
    print(result)
    assert result.lost == 0, result
    assert "None" not in result.answers and set(result.in_flight) <= {"200", "500"}, result
    assert result.recovered, result
    assert result.answers.get("200", 0) > 10
    faults.wait_replicas(session, APP, ["router"])
    assert server_rss_bytes(session, APP)["router"] > 0
