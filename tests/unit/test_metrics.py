"""The metrics layer without Ray: two processes' counts summed, Triton's names and types, the
statistics JSON from the same series."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deployments.observe import metrics as m
from deployments.observe.statistics import statistics


def _elapsed(seconds: float) -> float:
    """Sleep ``seconds``; the seconds that really passed."""
    start = time.perf_counter()
    time.sleep(seconds)
    return time.perf_counter() - start


def _record(root: str, ok: int, rows: int) -> None:
    """One 'replica process': ``ok`` requests of ``rows`` rows on tiny_cnn v1, one failure."""
    os.environ["TRT_SERVE_METRICS_DIR"] = root
    router, replica = m.RouterRecorder(), m.ReplicaRecorder()
    for _ in range(ok):
        timing = m.RequestTiming(time.perf_counter())
        timing.compute_input_s = _elapsed(0.0001)  # phases that take their time, as a route's do
        with replica.request("tiny_cnn", 1):
            time.sleep(0.002)  # the request spends longer at the replica than its 1 ms run
            replica.on_execution("tiny_cnn", 1, rows, 0.001)
        timing.compute_output_s = _elapsed(0.0001)
        router.finished("tiny_cnn", "1", 200, timing)
    router.finished("tiny_cnn", "1", 400, m.RequestTiming(time.perf_counter()))
    router.finished("tiny_cnn", "1", 504, m.RequestTiming(time.perf_counter()))
    m.flush()  # what the flush thread and exit would do


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("metrics"))
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_record, args=(root, ok, rows)) for ok, rows in ((3, 1), (2, 4))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    directory = os.path.join(root, "default")
    text = m.render(directory).decode()
    # Triton's counters are written without the ``_total`` suffix, as Triton writes them.
    assert "\nnv_inference_request_success{" in text and "# TYPE nv_inference_count counter" in text
    return directory, {f.name: f for f in text_string_to_metric_families(text)}


def _value(family, **labels) -> float:
    """Sum of the family's value samples matching ``labels`` (the parser names counter
    samples ``<family>_total`` whatever the text said)."""
    names = (family.name, family.name + "_total")
    return sum(s.value for s in family.samples
               if s.name in names and all(s.labels.get(k) == v for k, v in labels.items()))


def test_two_processes_sum_under_triton_names_and_types(scraped):
    _, fams = scraped
    assert fams["nv_inference_request_success"].type == "counter"
    assert _value(fams["nv_inference_request_success"], model="tiny_cnn", version="1") == 5
    assert _value(fams["nv_inference_count"], model="tiny_cnn") == 3 * 1 + 2 * 4
    assert _value(fams["nv_inference_exec_count"], model="tiny_cnn") == 5
    failure = fams["nv_inference_request_failure"]
    assert _value(failure, reason="OTHER") == 2 and _value(failure, reason="REJECTED") == 2
    assert "nv_inference_pending_request_count" not in fams  # live gauges of ended processes go
    assert fams["trt_serve_request_duration_seconds"].type == "histogram"


def test_durations_add_up(scraped):
    _, fams = scraped
    parts = sum(_value(fams[f"nv_inference_{p}_duration_us"]) for p in
                ("queue", "compute_input", "compute_infer", "compute_output"))
    assert _value(fams["nv_inference_compute_infer_duration_us"]) == pytest.approx(5000)
    assert 0 < parts <= _value(fams["nv_inference_request_duration_us"]) + 1e-6


def test_statistics_json_has_tritons_shape_and_counts(scraped):
    directory, _ = scraped
    stats = statistics(m.node_families(directory), [("tiny_cnn", "1"), ("mid_cnn", "1")])
    tiny, mid = stats["model_stats"]
    assert (tiny["inference_count"], tiny["execution_count"]) == (11, 5)
    assert tiny["inference_stats"]["success"]["count"] == 5 and tiny["inference_stats"]["fail"]["count"] == 4
    assert tiny["inference_stats"]["compute_infer"]["ns"] == 5_000_000
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in tiny["batch_stats"]] == [(1, 3), (4, 2)]
    assert tiny["last_inference"] > 1.7e12
    assert mid["inference_stats"]["success"] == {"count": 0, "ns": 0} and mid["batch_stats"] == []


def _serve_and_log(root: str, access_log: bool) -> list[dict]:
    """In a fresh process: a starlette app with an observed infer route; returns the JSON
    request-log lines of one success, one 400 and one unknown model."""
    import json
    import logging

    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from deployments.observe.router import RouterObserver, observe_infer, phase

    os.environ["TRT_SERVE_METRICS_DIR"] = root
    lines: list[dict] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(json.loads(record.getMessage()))

    logger = logging.getLogger("ray.serve.requests")
    logger.addHandler(Capture())
    logger.setLevel(logging.INFO)

    class Ingress:
        observer = RouterObserver({"tiny_cnn": "1"}, access_log=access_log)

        @observe_infer
        async def infer(self, request):
            with phase(request, "compute_input_s"):
                body = await request.json()
            if body.get("bad"):
                return JSONResponse({"error": "input 'input': shape [1] is not [-1, 3, 224, 224]"}, 400)
            return JSONResponse({"outputs": []})

    ingress = Ingress()
    app = Starlette(routes=[Route("/v2/models/{name}/infer", ingress.infer, methods=["POST"])])
    client = TestClient(app)
    headers = {"x-request-id": "req-42"}
    assert client.post("/v2/models/tiny_cnn/infer", json={}, headers=headers).status_code == 200
    assert client.post("/v2/models/tiny_cnn/infer", json={"bad": 1}, headers=headers).status_code == 400
    client.post("/v2/models/nope/infer", json={"bad": 1})
    return lines


@pytest.mark.parametrize("access_log", [False, True])
def test_one_structured_log_line_per_failed_request_and_successes_only_with_access_log(tmp_path, access_log):
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        lines = pool.apply(_serve_and_log, (str(tmp_path), access_log))
    failed = [line for line in lines if line["event"] == "request_failed"]
    assert [(f["model"], f["version"], f["status"], f["reason"]) for f in failed] == [
        ("tiny_cnn", "1", 400, "OTHER"), ("nope", None, 400, "OTHER")]
    assert failed[0]["request_id"] == "req-42" and "shape [1]" in failed[0]["error"]
    assert failed[0]["duration_ms"] > 0
    ok = [line for line in lines if line["event"] == "request"]
    assert [(o["model"], o["status"]) for o in ok] == ([("tiny_cnn", 200)] if access_log else [])


def _versioned_routes(root: str) -> str:
    """In a fresh process: served and made-up versions of tiny_cnn through the router's
    observer, version 1 also spelled "01" and "001" (the routes read all three as version 1);
    returns /metrics text."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from deployments.observe.router import RouterObserver, observe_infer

    os.environ["TRT_SERVE_METRICS_DIR"] = root

    class Ingress:
        observer = RouterObserver({"tiny_cnn": "2"})

        @observe_infer
        async def infer(self, request):
            version = request.path_params["version"]
            if not version.isdigit() or int(version) not in (1, 2):
                return JSONResponse({"error": "version not served"}, 404)
            return JSONResponse({"model_version": str(int(version)), "outputs": []})

    client = TestClient(Starlette(routes=[Route("/v2/models/{name}/versions/{version}/infer",
                                                Ingress().infer, methods=["POST"])]))
    for version in ("1", "zz1", "zz2", "1", "01", "001"):
        client.post(f"/v2/models/tiny_cnn/versions/{version}/infer", json={})
    m.flush()
    return m.render(os.path.join(root, "default")).decode()


def test_a_version_not_served_adds_no_series_and_a_served_one_has_one_label(tmp_path):
    """A made-up version adds no series; ``/versions/01/infer`` is version 1: one series, not one
    per spelling a client makes up."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        text = pool.apply(_versioned_routes, (str(tmp_path),))
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert _value(fams["nv_inference_request_success"], model="tiny_cnn", version="1") == 4
    assert "zz" not in text  # no series, success or failure, for the made-up versions
    assert 'version="01"' not in text and 'version="001"' not in text


def _pipeline_steps(root: str) -> str:
    """In a fresh process: two good and one bad step call of a pipeline; returns /metrics text."""
    import asyncio

    from deployments.observe.deployment import observed_steps
    from deployments.runtime.contract.errors import InvalidInput

    os.environ["TRT_SERVE_METRICS_DIR"] = root

    async def infer(name, inputs):
        if inputs.get("bad"):
            raise InvalidInput("no")
        return {"y": 1}

    step = observed_steps(infer, {"port": None}, {"ocr_det": "1"})

    async def calls():
        await step("ocr_det", {})
        await step("ocr_det", {})
        with pytest.raises(InvalidInput):
            await step("ocr_det", {"bad": True})

    asyncio.run(calls())
    m.flush()
    return m.render(m.node_directory()).decode()


def test_pipeline_steps_count_as_requests_of_their_models(tmp_path):
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        text = pool.apply(_pipeline_steps, (str(tmp_path),))
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert _value(fams["nv_inference_request_success"], model="ocr_det", version="1") == 2
    assert _value(fams["nv_inference_request_failure"], model="ocr_det", reason="OTHER") == 1


def _buffered_and_direct(root: str) -> tuple[str, str]:
    """In a fresh process: the same observations through a buffered histogram cell and through
    ``Histogram.observe``; returns both series' bucket, count and sum samples, and the text
    before the buffer's flush."""
    from prometheus_client import Histogram

    os.environ["TRT_SERVE_METRICS_DIR"] = root
    b = m.buffer()
    b.interval_s = 3600.0  # no write but the explicit one below
    buckets = m.LATENCY_BUCKETS_S
    direct = Histogram("direct_seconds", "", ["model"], buckets=buckets, registry=None).labels("x")
    cell = b.histogram(Histogram("buffered_seconds", "", ["model"], buckets=buckets, registry=None).labels("x"))
    counter = b.counter(m.families().success.labels("x", "1"))
    for v in (0.0001, 0.0005, 0.0006, 0.002, 0.5, 10.0, 11.0, 0.0005):  # on, between and above bounds
        direct.observe(v)
        with b.lock:
            cell.observe(v)
            counter.add(1)
    before = m.render(m.node_directory()).decode()
    m.flush()
    m.flush()  # a second flush writes nothing twice
    return before, m.render(m.node_directory()).decode()


def test_buffered_values_reach_the_file_on_flush_with_observes_buckets(tmp_path):
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        before, after = pool.apply(_buffered_and_direct, (str(tmp_path),))
    fams = {f.name: f for f in text_string_to_metric_families(before)}
    assert _value(fams["nv_inference_request_success"]) == 0  # buffered, not written yet
    assert [s.value for s in fams["buffered_seconds"].samples if s.name.endswith("_count")] == [0]
    fams = {f.name: f for f in text_string_to_metric_families(after)}
    assert _value(fams["nv_inference_request_success"], model="x") == 8
    direct = [(s.name.replace("direct", "x"), s.labels, s.value) for s in fams["direct_seconds"].samples]
    buffered = [(s.name.replace("buffered", "x"), s.labels, s.value) for s in fams["buffered_seconds"].samples]
    assert buffered == direct and ("x_seconds_count", {"model": "x"}, 8.0) in buffered


def _placement_decisions(root: str) -> str:
    """In a fresh process: two placement decisions recorded (b hot on r0 and r1, a on r0; then a
    unloaded and r0 gone: b on r1 alone); returns the scrape."""
    os.environ["TRT_SERVE_METRICS_DIR"] = root
    recorder = m.PlacementRecorder()
    why = {"a": {"bytes": 10, "rate_per_s": 0.5, "copies": 1, "reason": "fits"},
           "b": {"bytes": 30, "rate_per_s": 9.0, "copies": 2, "reason": "hot"}}
    recorder.decided({"revision": 3, "replicas": ["r0", "r1"], "why": why,
                      "target": {"a": ["r0"], "b": ["r0", "r1"]}, "routed": {"a": ["r0"], "b": ["r0"]}})
    recorder.decided({"revision": 4, "replicas": ["r1"], "why": {"b": {**why["b"], "copies": 1}},
                      "target": {"b": ["r1"]}, "routed": {"b": ["r1"]}})
    return m.render(m.node_directory()).decode()


def test_placement_series_follow_the_last_decision_and_read_zero_where_a_model_or_replica_left(tmp_path):
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        text = pool.apply(_placement_decisions, (str(tmp_path),))
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    value = lambda name, **labels: _value(fams["trt_serve_placement_" + name], **labels)  # noqa: E731
    assert value("revision") == 4 and value("replicas") == 1 and value("recomputes") == 2
    assert value("copies", model="b") == 1 and value("copies", model="a") == 0  # a: unloaded
    assert value("bytes", model="b") == 30 and value("bytes", model="a") == 10  # a's last figure
    assert value("rate_per_s", model="b") == 9.0 and value("rate_per_s", model="a") == 0
    assert value("placed", model="b", replica="r1") == 1
    assert value("placed", model="b", replica="r0") == value("placed", model="a", replica="r0") == 0
    assert value("routed", model="b", replica="r1") == 1 and value("routed", model="b", replica="r0") == 0
    assert value("replica_bytes", replica="r1") == 30 and value("replica_models", replica="r1") == 1
    assert value("replica_bytes", replica="r0") == value("replica_models", replica="r0") == 0
