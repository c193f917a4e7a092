"""Placement by bytes made visible (issue 31, item 4), and what load and unload mean under it
(item 0), as `make serve` runs it: the repository index and the Prometheus series show each pool
model where ``/v2/memory``'s ``placement`` section places it, with its bytes, rate and copies.

One server for the module (``test_placement.placement_server``: six pool models, two pool
replicas, ``placement: bytes``) under explicit model control, every model loaded at start."""

from __future__ import annotations

import pytest
import requests
import tritonclient.http as triton_http
import yaml
from prometheus_client.parser import text_string_to_metric_families

from .test_placement import MODELS, _settled, answer, memory, placement_server, pool_replicas, until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(base URL, node metrics URL, gRPC port) of the module's runner."""
    with placement_server(tmp_path_factory.mktemp("placement_visible"), model_control_mode="explicit",
                          startup_models=["*"]) as (_, url, path):
        args = yaml.safe_load(path.read_text())["applications"][0]["args"]
        yield url, f"http://127.0.0.1:{args['metrics']['port']}/metrics", args["grpc_port"]


def index(url: str) -> dict[str, dict]:
    r = requests.post(f"{url}/v2/repository/index", json={}, timeout=30)
    assert r.status_code == 200, r.text
    return {item["name"]: item for item in r.json()}


def series(metrics_url: str) -> dict[tuple[str, tuple], float]:
    """The ``trt_serve_placement_*`` samples of a scrape: (sample name, sorted labels) -> value."""
    r = requests.get(metrics_url, timeout=30)
    assert r.status_code == 200, r.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(r.text) if f.name.startswith("trt_serve_placement_")
            for s in f.samples}


def placement(url: str) -> dict | None:
    """One pool replica's ``/v2/memory`` ``placement`` section (None: not answered yet)."""
    pool = memory(url)
    return pool["placement"] if pool is not None and pool["placement"].get("revision") else None


def agreeing(url: str, metrics_url: str) -> tuple[dict, dict, dict] | None:
    """(``/v2/memory``'s placement, the index by name, the scrape) once they describe one
    decision: the same revision, and the index's placement of each model as ``/v2/memory``'s
    (a pool replica reads the decision every second; its ``reason`` and rates may change
    without a new revision); None until then."""
    shown = placement(url)
    items, scraped = index(url), series(metrics_url)
    if shown is None or scraped.get(("trt_serve_placement_revision", ())) != shown["revision"]:
        return None
    if any(items[m].get("placement") != {"policy": "bytes", "revision": shown["revision"], **where}
           for m, where in shown["models"].items()):
        return None
    return shown, items, scraped


def _bytes_reported(url: str) -> bool:
    """The decision's bytes of each model are at least what the replica it is placed on measured."""
    caches = pool_replicas(url)
    shown = next(iter(caches.values()))["placement"]
    return all(where["replicas"] and where["bytes"] >= caches[where["replicas"][0]]["models"][model]["bytes"]
               for model, where in shown["models"].items())


def test_the_index_and_the_metrics_show_each_pool_model_where_v2_memory_places_it(server):
    url, node_metrics, _ = server
    # Settled, and the decision made after every replica reported its measured footprints (a
    # decision every 2 s, reports every second: its bytes can lag a load by one recompute).
    until(lambda: _settled(url) and _bytes_reported(url), "a settled placement with the measured bytes", 120)
    caches = pool_replicas(url)
    for metrics_url in (f"{url}/metrics", node_metrics):  # the router's and the node's
        shown, items, scraped = until(lambda: agreeing(url, metrics_url), f"{metrics_url} at /v2/memory's revision", 60)
        value = lambda name, **labels: scraped.get(("trt_serve_placement_" + name, tuple(sorted(labels.items()))))  # noqa: E731
        assert set(shown["models"]) == set(MODELS)
        on = {r: [m for m, w in shown["models"].items() if r in w["replicas"]] for r in shown["replicas"]}
        assert len(shown["replicas"]) == 2 and all(on.values()), on  # both replicas hold some
        for model, where in shown["models"].items():
            item = items[model]
            # Triton's fields as before; placement beside them
            assert set(item) == {"name", "version", "state", "reason", "placement"} and item["version"] == "1"
            assert item["placement"] == {"policy": "bytes", "revision": shown["revision"], **where}
            assert where["copies"] == len(where["replicas"]) == 1
            # its bytes: the largest footprint a replica measured (ONNX Runtime: RSS growth at load)
            assert where["bytes"] >= caches[where["replicas"][0]]["models"][model]["bytes"] >= 0
            assert where["rate_per_s"] == 0.0  # no inference request yet
            assert value("copies", model=model) == 1 and value("bytes", model=model) == where["bytes"]
            assert value("rate_per_s", model=model) == 0.0
            assert value("placed", model=model, replica=where["replicas"][0]) == 1
        for replica, models in on.items():
            assert value("replica_models", replica=replica) == len(models)
            assert value("replica_bytes", replica=replica) == sum(shown["models"][m]["bytes"] for m in models)
        assert value("replicas") == 2
        assert value("recomputes_total") >= shown["recomputes"] >= shown["revision"]
    # Triton's own client reads the index as before
    listed = triton_http.InferenceServerClient(url.removeprefix("http://")).get_model_repository_index()
    assert {item["name"] for item in listed} >= set(MODELS)

    for _ in range(3):  # requests give the models a rate, in the decision, the index and the series
        for model in MODELS[:2]:
            assert answer(url, model) is not None

    def rated():
        seen = agreeing(url, f"{url}/metrics")
        if seen is None or not all(seen[0]["models"][m]["rate_per_s"] > 0 for m in MODELS[:2]):
            return None
        return seen

    shown, items, scraped = until(rated, "the requests' rates shown", 60)
    for model in MODELS[:2]:
        assert items[model]["placement"]["rate_per_s"] == shown["models"][model]["rate_per_s"] > 0
        assert scraped[("trt_serve_placement_rate_per_s", (("model", model),))] > 0


def test_an_unloaded_pool_model_is_placed_nowhere_until_loaded_and_a_load_answers_once_placed_replicas_have_it(server):
    url, _, _ = server
    model = MODELS[-1]  # no request yet: one copy (a hot one would have one on every replica)
    until(lambda: _settled(url), "a settled placement", 120)
    r = requests.post(f"{url}/v2/repository/models/{model}/unload", json={}, timeout=60)
    assert r.status_code == 200, r.text

    def unplaced():
        shown = placement(url)
        return shown if shown is not None and model not in shown["models"] else None

    first = until(unplaced, f"a decision without {model}", 30)
    line = index(url)[model]
    assert line["state"] == "UNAVAILABLE" and line["reason"] == "unloaded"
    assert line["placement"]["copies"] == 0 and line["placement"]["replicas"] == []
    assert line["placement"]["reason"] == "unloaded: placed on no replica until it is loaded"
    until(lambda: series(f"{url}/metrics").get(("trt_serve_placement_copies", (("model", model),))) == 0,
          f"{model}'s copies 0 in the series", 30)

    # never placed again, nor loaded anywhere, over three more decisions
    seen: dict[str, dict] = {}

    def three_more():
        pool = memory(url)
        if pool is None or pool["placement"]["recomputes"] < first["recomputes"]:
            return False  # this replica has not read a decision made after the unload yet (once a second)
        seen[pool["replica"]] = pool
        assert model not in pool["placement"]["models"], pool["placement"]
        assert pool["models"][model]["state"] != "ready", (pool["replica"], pool["models"][model])
        return len(seen) == 2 and pool["placement"]["recomputes"] >= first["recomputes"] + 3

    until(three_more, "three decisions after the unload", 60)

    r = requests.post(f"{url}/v2/repository/models/{model}/load", json={}, timeout=60)
    assert r.status_code == 200, r.text
    # placed again (one copy: no request yet), ready on its placed replica and released by the other
    until(lambda: _settled(url), f"{model} placed again and ready on exactly its placed replicas", 60)
    shown = placement(url)
    assert shown["models"][model]["copies"] == len(shown["models"][model]["replicas"]) == 1
    line = index(url)[model]
    assert line["placement"]["replicas"] == shown["models"][model]["replicas"]
    assert answer(url, model) is not None


def test_a_pool_model_resident_on_one_of_two_replicas_is_ready_in_every_index_over_http_and_grpc(server):
    """The index gives a pool model's state from the whole pool (every replica's latest report
    to the placement deployment), not from whichever pool replica answers: a model resident on
    exactly one of the two replicas is READY in every read, listed by ``{"ready": true}`` every
    time, and gRPC's RepositoryIndex says the same."""
    import tritonclient.grpc as triton_grpc
    from tritonclient.grpc import service_pb2

    url, _, grpc_port = server
    until(lambda: _settled(url), "a settled placement", 120)
    caches = pool_replicas(url)
    holders = {m: [r for r, pool in caches.items() if pool["models"][m]["state"] == "ready"] for m in MODELS}
    model = next((m for m in MODELS if len(holders[m]) == 1), None)
    assert model is not None, holders  # one copy each (no request yet): each on one replica
    for _ in range(8):
        line = index(url)[model]
        assert line["state"] == "READY", line
        assert line["reason"].startswith("resident in the cache of "), line
        r = requests.post(f"{url}/v2/repository/index", json={"ready": True}, timeout=30)
        assert r.status_code == 200 and model in {item["name"] for item in r.json()}, r.text
    with triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}") as client:
        until(lambda: client.is_server_live(client_timeout=5), "the router's gRPC server", 60)
        for _ in range(8):  # tritonclient's call sends ready false; the stub's sends true
            states = {m.name: m.state for m in client.get_model_repository_index().models}
            assert states[model] == "READY", states
            only_ready = client._client_stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(ready=True), timeout=30)
            assert model in {m.name for m in only_ready.models}, only_ready
