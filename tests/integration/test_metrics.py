"""Metrics and statistics over real HTTP: a known number of requests, counted exactly.

A second application ("observed", under /observed) serves tiny_cnn and mid_cnn from a pool of
two replicas and ocr_cls from two dedicated replicas with a 300 ms batching window (requests
sent together may share a batch). The test sends success and failure, JSON and binary, pooled and
dedicated, batched requests, then reads ``/observed/metrics`` with prometheus_client's parser
and the statistics extension with tritonclient.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException
import yaml
from prometheus_client.parser import text_string_to_metric_families

from .conftest import REPOSITORY, send_together, wait_ready

pytestmark = pytest.mark.integration

PREFIX = "/observed"
MODELS = ("tiny_cnn", "mid_cnn", "ocr_cls")
TRITON_COUNTERS = ("nv_inference_request_success", "nv_inference_request_failure", "nv_inference_count",
                   "nv_inference_exec_count", "nv_inference_request_duration_us", "nv_inference_queue_duration_us",
                   "nv_inference_compute_input_duration_us", "nv_inference_compute_infer_duration_us",
                   "nv_inference_compute_output_duration_us")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def observed(serve_instance, tmp_path_factory):
    """(base URL, node metrics port) of the app with two pool and two ocr_cls replicas."""
    from deployments.app import delete_server, run_applications

    root = tmp_path_factory.mktemp("observed-repo")
    for name in MODELS:
        raw = yaml.safe_load((Path(REPOSITORY) / name / "config.yaml").read_text())
        if name == "ocr_cls":
            raw["dynamic_batching"] = {"max_queue_delay_ms": 300}
            raw["deployment"] = {"mode": "dedicated", "num_replicas": 2, "max_ongoing_requests": 32}
        (root / name).mkdir()
        (root / name / "config.yaml").write_text(yaml.safe_dump(raw))
        (root / name / "1").symlink_to(Path(REPOSITORY) / name / "1")
    port = _free_port()
    run_applications({"repository": str(root), "pool": {"num_replicas": 2},
                         "metrics": {"port": port}}, name="observed", route_prefix=PREFIX)
    url = f"{serve_instance}{PREFIX}"
    wait_ready(url)
    yield url, port
    delete_server("observed")


def infer_json(url: str, model: str, x: np.ndarray, datatype: str = "FP32") -> requests.Response:
    name = "x" if model == "ocr_cls" else "input"
    body = {"inputs": [{"name": name, "shape": list(x.shape), "datatype": datatype, "data": x.ravel().tolist()}]}
    return requests.post(f"{url}/v2/models/{model}/infer", json=body, timeout=120)


def infer_binary(url: str, model: str, x: np.ndarray) -> int:
    """tritonclient's default: binary input and output. Returns 200 or the error's status."""
    client = httpclient.InferenceServerClient(url.split("//", 1)[1], network_timeout=120)
    tensor = httpclient.InferInput("x" if model == "ocr_cls" else "input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    try:
        client.infer(model, [tensor])
    except InferenceServerException as e:
        return int(e.status())
    return 200




def scrape(url: str) -> dict:
    response = requests.get(url, timeout=30)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return response.text, {f.name: f for f in text_string_to_metric_families(response.text)}


def value(family, sample_suffix: str = "", **labels) -> float:
    """Sum of a family's samples matching ``labels`` (the parser names counter samples
    ``<name>_total``; ``sample_suffix`` picks ``_count`` / ``_sum`` of a histogram)."""
    names = {family.name + sample_suffix} if sample_suffix else {family.name, family.name + "_total"}
    return sum(s.value for s in family.samples
               if s.name in names and all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.fixture(scope="module")
def sent(observed):
    """Send the known requests once; returns what each model should count."""
    url, _ = observed
    rng = np.random.default_rng(5)
    image = lambda n: rng.random((n, 3, 224, 224), dtype=np.float32)  # noqa: E731
    crops = lambda n: rng.random((n, 3, 48, 192), dtype=np.float32)  # noqa: E731
    statuses = [infer_json(url, "tiny_cnn", image(1)).status_code for _ in range(3)]
    statuses += [infer_binary(url, "tiny_cnn", image(2)) for _ in range(2)]
    statuses += [infer_binary(url, "mid_cnn", image(1)) for _ in range(2)]
    assert statuses == [200] * 7
    bad_shape = rng.random((1, 3, 100, 100), dtype=np.float32)
    assert [infer_json(url, "tiny_cnn", bad_shape).status_code for _ in range(2)] == [400, 400]
    assert infer_binary(url, "tiny_cnn", bad_shape) == 400
    assert infer_json(url, "no_such_model", image(1)).status_code == 404  # not a model: not counted
    calls = [lambda: infer_json(url, "ocr_cls", crops(1)).status_code for _ in range(4)]
    calls += [lambda: infer_binary(url, "ocr_cls", crops(3)) for _ in range(2)]
    calls += [lambda: infer_json(url, "ocr_cls", crops(1).astype(np.int32), "INT32").status_code]
    assert send_together(calls) == [200] * 6 + [400]
    expected = {  # model -> (success, failures with reason OTHER, rows run)
        "tiny_cnn": (5, 3, 3 + 2 * 2), "mid_cnn": (2, 0, 2), "ocr_cls": (6, 1, 4 + 2 * 3)}
    settle(url, expected)
    return expected


def settle(url: str, expected: dict, timeout_s: float = 30.0) -> None:
    """Wait until every replica process has written its counts (each writes its buffered values
    at most ``FLUSH_INTERVAL_S`` after a request): success and failure counts as ``expected``
    and no request pending. Exactness is asserted by the tests; this only waits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _, fams = scrape(f"{url}/metrics")
        if "nv_inference_pending_request_count" in fams and all(value(fams["nv_inference_request_success"], model=m) == ok
               and value(fams["nv_inference_request_failure"], model=m) == failed
               and value(fams["nv_inference_count"], model=m) == rows
               and value(fams["nv_inference_pending_request_count"], model=m) == 0
               for m, (ok, failed, rows) in expected.items()):
            return
        time.sleep(0.05)


def test_metrics_count_every_request_under_tritons_names_and_types(observed, sent):
    url, _ = observed
    text, fams = scrape(f"{url}/metrics")
    for name in TRITON_COUNTERS:
        assert fams[name].type == "counter", name
        assert f"\n{name}{{" in text  # written without "_total", as Triton writes it
    assert fams["nv_inference_pending_request_count"].type == "gauge"
    assert fams["trt_serve_request_duration_seconds"].type == "histogram"
    for model, (success, failures, rows) in sent.items():
        labels = {"model": model, "version": "1"}
        assert value(fams["nv_inference_request_success"], **labels) == success, model
        assert value(fams["nv_inference_request_failure"], reason="OTHER", **labels) == failures, model
        assert value(fams["nv_inference_request_failure"], **labels) == failures, model
        assert value(fams["nv_inference_count"], **labels) == rows, model
        assert value(fams["trt_serve_request_duration_seconds"], "_count", **labels) == success
        assert value(fams["nv_inference_pending_request_count"], **labels) == 0
    assert value(fams["nv_inference_exec_count"], model="tiny_cnn") == 5
    assert value(fams["nv_inference_exec_count"], model="mid_cnn") == 2
    batched = value(fams["nv_inference_exec_count"], model="ocr_cls")
    # Sent together, they may share executions or (on a slow machine, arriving apart) run alone:
    # whether they join is test_batching's; here each execution and row is counted once.
    assert 1 <= batched <= 6
    by_size = {s.labels["batch_size"]: s.value for s in fams["trt_serve_batch_exec_count"].samples
               if s.labels.get("model") == "ocr_cls" and s.name.endswith("_total")}
    assert sum(by_size.values()) == batched and sum(int(k) * v for k, v in by_size.items()) == 10
    assert "no_such_model" not in text


def test_durations_are_positive_and_add_up(observed, sent):
    url, _ = observed
    _, fams = scrape(f"{url}/metrics")
    for model in sent:
        request = value(fams["nv_inference_request_duration_us"], model=model)
        parts = [value(fams[f"nv_inference_{p}_duration_us"], model=model)
                 for p in ("queue", "compute_input", "compute_infer", "compute_output")]
        assert request > 0 and all(p > 0 for p in parts), (model, parts)
        assert sum(parts) <= request, (model, parts, request)


def test_cache_series_count_pool_loads_per_replica(observed, sent):
    url, _ = observed
    _, fams = scrape(f"{url}/metrics")
    loads = fams["trt_serve_cache_loads"]
    assert loads.type == "counter"
    assert value(loads, model="tiny_cnn") >= 1 and value(loads, model="mid_cnn") >= 1
    resident = fams["trt_serve_cache_resident_bytes"]
    assert len({s.labels["replica"] for s in resident.samples}) == 2  # one series per pool replica
    assert value(resident) > 0
    assert value(fams["trt_serve_cache_load_duration_seconds"], "_count") == (
        value(loads) + value(fams["trt_serve_cache_reloads"]) if "trt_serve_cache_reloads" in fams else value(loads))


def test_node_port_serves_the_same_series(observed, sent):
    url, port = observed
    _, fams = scrape(f"http://127.0.0.1:{port}/metrics")
    # Every application on the node, summed: at least this application's counts.
    assert value(fams["nv_inference_request_success"], model="tiny_cnn") >= sent["tiny_cnn"][0]


def test_tritonclient_reads_the_statistics_extension(observed, sent):
    url, _ = observed
    client = httpclient.InferenceServerClient(url.split("//", 1)[1])
    assert "statistics" in client.get_server_metadata()["extensions"]
    (tiny,) = client.get_inference_statistics("tiny_cnn")["model_stats"]
    success, failures, rows = sent["tiny_cnn"]
    assert (tiny["name"], tiny["version"]) == ("tiny_cnn", "1")
    assert tiny["inference_stats"]["success"]["count"] == success
    assert tiny["inference_stats"]["fail"]["count"] == failures
    assert (tiny["inference_count"], tiny["execution_count"]) == (rows, 5)
    assert tiny["inference_stats"]["success"]["ns"] > tiny["inference_stats"]["compute_infer"]["ns"] > 0
    assert tiny["last_inference"] > 0
    (cls,) = client.get_inference_statistics("ocr_cls", "1")["model_stats"]
    assert sum(b["batch_size"] * b["compute_infer"]["count"] for b in cls["batch_stats"]) == 10
    every = client.get_inference_statistics()["model_stats"]
    assert sorted(m["name"] for m in every) == sorted(sent)
    missing = requests.get(f"{url}/v2/models/no_such_model/stats", timeout=10)
    assert missing.status_code == 404 and "no_such_model" in missing.json()["error"]
