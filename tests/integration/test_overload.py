"""Overload over real HTTP: past saturation the model keeps its throughput, and what its bounded
queues cannot hold is shed at once with 503, ``Retry-After`` and an ``{"error": ...}`` body.

A third application ("overload", under /overload) serves ocr_cls (its own config, dynamic
batching included) with small queues: 4 requests running in its replica (``max_ongoing_requests``)
and 4 waiting there (``max_queued_requests``), so 4x the saturating concurrency, 4x those bounds
too, is sure to overflow them. (With 8 and 8 a full-suite CI run once shed nothing: 32 clients, 79 QPS,
answers in 0.40 s, yet never more than 16 requests in the replica at once on 2 cores.) Both load levels run in this one test, side by side, and only their ratio is checked, so a
slow or busy machine moves both alike.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import requests
import yaml

from bench.loadgen import is_shed, make_workload, run

from .conftest import REPOSITORY, wait_ready

pytestmark = pytest.mark.integration

PREFIX = "/overload"
SATURATING_CLIENTS = 8   # ocr_cls's QPS flattens from here on (docs/performance.md, "Overload")
QUEUE = {"max_ongoing_requests": 4, "max_queued_requests": 4}


@pytest.fixture(scope="module")
def overload_server(serve_instance, tmp_path_factory):
    from deployments.app import delete_server, run_applications

    root = tmp_path_factory.mktemp("overload-repo")
    raw = yaml.safe_load((Path(REPOSITORY) / "ocr_cls" / "config.yaml").read_text())
    raw["deployment"] = {"mode": "dedicated", **QUEUE}
    (root / "ocr_cls").mkdir()
    (root / "ocr_cls" / "config.yaml").write_text(yaml.safe_dump(raw))
    (root / "ocr_cls" / "1").symlink_to(Path(REPOSITORY) / "ocr_cls" / "1")
    run_applications({"repository": str(root)}, name="overload", route_prefix=PREFIX)
    url = f"{serve_instance}{PREFIX}"
    wait_ready(url)
    yield url
    delete_server("overload")


def test_four_times_saturation_keeps_throughput_and_sheds_the_rest_with_retry_after(overload_server):
    x = np.random.default_rng(0).random((1, 3, 48, 192), dtype=np.float32)
    workload = make_workload("ocr_cls", overload_server, "ocr_cls", "x", x, binary=True)
    run([(workload, SATURATING_CLIENTS)], duration_s=1.0, warmup_s=1.0)  # warm the path up
    saturated, overloaded = (run([(workload, c)], duration_s=4.0, warmup_s=1.0)[0]
                             for c in (SATURATING_CLIENTS, 4 * SATURATING_CLIENTS))

    # Every answer was a 200 or a proper shed (503 + Retry-After + error body): none lost.
    for result in (saturated, overloaded):
        assert set(result.error_statuses) <= {"503"}, result.error_statuses
    assert overloaded.error_statuses.get("503", 0) > 0, "4x load should overflow the queues"
    assert overloaded.qps >= 0.5 * saturated.qps, (saturated, overloaded)


def test_a_shed_request_says_why_and_when_to_come_back(overload_server):
    """One request over the limit, read in full: status, headers, body."""
    from concurrent.futures import ThreadPoolExecutor

    x = np.random.default_rng(1).random((1, 3, 48, 192), dtype=np.float32)
    body = {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
    with ThreadPoolExecutor(48) as pool:
        responses = list(pool.map(lambda _: requests.post(
            f"{overload_server}/v2/models/ocr_cls/infer", json=body, timeout=120), range(96)))
    shed = [r for r in responses if r.status_code == 503]
    assert {r.status_code for r in responses} <= {200, 503} and shed
    # the replica's estimate of the work ahead, within 1..60 s, the same in the header and the text
    retry = shed[0].headers["Retry-After"]
    assert 1 <= int(retry) <= 60 and is_shed(shed[0].headers, shed[0].content)
    assert shed[0].json()["error"].endswith(f"; retry after {retry} s")
    assert "overloaded" in shed[0].json()["error"] and f"limit {QUEUE['max_queued_requests']}" in shed[0].json()["error"]
