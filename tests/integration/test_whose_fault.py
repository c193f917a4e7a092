"""Whose fault an error is, on a running server, over HTTP: a client's mistake that only the model
runtime would have met is a 400 naming it, counted as a client's failure in the metrics; a load
that fails on the server's side is a 500, one whose config is bad a 400; and a config.yaml edited
into an invalid one after the start stops no replica that starts later (a replacement).

An application ("faults", under /faults) serves a small repository with explicit model control:
``tokens`` (pool) and ``tokens_dedicated`` (its own deployment), both token-id models built with
``onnx.helper`` (``tests/token_models.py``).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.token_models import WIDTH, token_config, write_token_model

from .conftest import wait_ready

pytestmark = pytest.mark.integration

PREFIX = "/faults"
MODELS = ("tokens", "tokens_dedicated")
TABLE = np.arange(10 * WIDTH, dtype=np.float32).reshape(10, WIDTH)


@pytest.fixture(scope="module")
def faults(serve_instance, tmp_path_factory):
    """(base URL, repository root) of the application."""
    from deployments.app import delete_server, run_applications

    root = tmp_path_factory.mktemp("faults-repo")
    write_token_model(root, "tokens")
    write_token_model(root, "tokens_dedicated", deployment={"mode": "dedicated"})
    run_applications({"repository": str(root), "model_control_mode": "explicit", "startup_models": list(MODELS)},
                     name="faults", route_prefix=PREFIX)
    url = f"{serve_instance}{PREFIX}"
    wait_ready(url)
    yield url, root
    delete_server("faults")


def token_body(ids: list[list[int]], mask_length: int | None = None) -> dict:
    length = len(ids[0]) if mask_length is None else mask_length
    return {"inputs": [
        {"name": "input_ids", "shape": [len(ids), len(ids[0])], "datatype": "INT64",
         "data": [t for row in ids for t in row]},
        {"name": "attention_mask", "shape": [len(ids), length], "datatype": "INT64", "data": [1] * len(ids) * length}]}


def infer(url: str, model: str, body: dict) -> requests.Response:
    return requests.post(f"{url}/v2/models/{model}/infer", json=body, timeout=60)


def failures(url: str, model: str) -> dict[str, float]:
    """``nv_inference_request_failure`` of ``model`` by reason (none before a first failure)."""
    text = requests.get(f"{url}/metrics", timeout=30).text
    samples = [s for f in text_string_to_metric_families(text) if f.name == "nv_inference_request_failure"
               for s in f.samples]
    out: dict[str, float] = {}
    for sample in samples:
        if sample.labels.get("model") == model:
            out[sample.labels["reason"]] = out.get(sample.labels["reason"], 0) + sample.value
    return out


@pytest.mark.parametrize("model", MODELS)
def test_a_clients_inputs_the_runtime_would_refuse_are_400_naming_the_fault_and_counted_as_the_clients(
        faults, model):
    """Seen: two INT64 inputs whose sequence lengths differ, and a token id past the embedding
    table, answered 500 "ONNX Runtime run failed (Fail)" / "(InvalidArgument)", counted as
    backend failures."""
    url, _ = faults
    r = infer(url, model, token_body([[1, 2, 9]]))
    assert r.status_code == 200, r.text
    np.testing.assert_array_equal(np.array(r.json()["outputs"][0]["data"], np.float32).reshape(1, 3, WIDTH),
                                  TABLE[[[1, 2, 9]]])
    before = failures(url, model)
    r = infer(url, model, token_body([[1, 2, 3]], mask_length=4))
    assert (r.status_code, r.json()) == (400, {"error": (
        f"model '{model}': inputs must agree on the dimension the model names 'sequence': "
        "'input_ids' axis 1 is 3, 'attention_mask' axis 1 is 4")})
    r = infer(url, model, token_body([[1, 2, 10]]))
    assert (r.status_code, r.json()) == (400, {"error": (
        f"model '{model}' input 'input_ids': element 2 is 10, past the 10 entries of the table it indexes "
        "(node 'embed'); allowed 0 to 9 (or -10 to -1, counted from the end)")})
    assert infer(url, model, token_body([[4]])).status_code == 200  # still serving
    deadline = time.monotonic() + 30
    while (after := failures(url, model)).get("OTHER", 0) < before.get("OTHER", 0) + 2:
        assert time.monotonic() < deadline, (before, after)
        time.sleep(0.2)
    assert after.get("OTHER", 0) == before.get("OTHER", 0) + 2
    assert after.get("BACKEND", 0) == before.get("BACKEND", 0)


def test_a_load_is_400_for_a_model_file_that_does_not_parse_and_for_a_bad_config(faults):
    """The model file and the config are the content of whoever put them in the repository:
    both 400, naming the file (a truncated file answered 500, and, with no config.yaml, named a
    config.yaml that did not exist)."""
    url, root = faults
    folder = write_token_model(root, "damaged")
    data = (folder / "1" / "model.onnx").read_bytes()
    (folder / "1" / "model.onnx").write_bytes(data[: len(data) // 2])
    r = requests.post(f"{url}/v2/repository/models/damaged/load", timeout=120)
    assert r.status_code == 400, r.text
    assert r.json()["error"].startswith("failed to load 'damaged': model 'damaged': its model file "
                                        "damaged/1/model.onnx is not a valid ONNX model")
    assert str(root) not in r.json()["error"]

    (root / "bare" / "1").mkdir(parents=True)  # no config.yaml: completed from a file that cannot be read
    (root / "bare" / "1" / "model.onnx").write_bytes(data[: len(data) // 2])
    r = requests.post(f"{url}/v2/repository/models/bare/load", timeout=120)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == ("failed to load 'bare': model 'bare': its model file bare/1/model.onnx is not a valid "
                                 "ONNX model: it does not parse as one (damaged, truncated or another format)")

    folder = write_token_model(root, "renamed")
    raw = token_config("renamed")
    raw["inputs"][0]["name"] = "ids"
    (folder / "config.yaml").write_text(yaml.safe_dump(raw))
    r = requests.post(f"{url}/v2/repository/models/renamed/load", timeout=120)
    assert r.status_code == 400, r.text
    assert "config.yaml: inputs: ['ids', 'attention_mask'] are not the inputs of " in r.json()["error"]
    assert infer(url, "tokens", token_body([[1]])).status_code == 200


def replicas(app: str, deployment: str) -> list[dict]:
    from ray.serve.context import _get_global_client

    details = _get_global_client().get_serve_details()["applications"].get(app)
    return [] if details is None else details["deployments"][deployment]["replicas"]


def test_a_replica_replaced_after_its_config_was_edited_invalid_starts_on_the_deployed_config(faults):
    """Seen: a config.yaml edited into an invalid one after the start, for a model served since
    the start, stopped every new replica (a replacement, a scale-out) in its constructor, and
    Serve restarted it forever. Kills the pool replica and the dedicated model's replica: each
    replacement runs and serves the model as deployed."""
    import ray

    url, root = faults
    kept = {}
    for name in MODELS:
        path = root / name / "config.yaml"
        kept[path] = path.read_text()
        path.write_text(kept[path] + "max_batch_sise: 4\n")  # an unknown field: invalid
    try:
        for app, deployment in (("faults.pool", "pool"), ("faults.tokens_dedicated", "model-tokens_dedicated")):
            (old,) = [r for r in replicas(app, deployment) if r["state"] == "RUNNING"]
            ray.kill(ray.get_actor(old["actor_name"], namespace="serve"))
            deadline = time.monotonic() + 120
            while not any(r["state"] == "RUNNING" and r["replica_id"] != old["replica_id"]
                          for r in replicas(app, deployment)):
                assert time.monotonic() < deadline, f"no replacement {deployment} replica running: " \
                                                    f"{replicas(app, deployment)}"
                time.sleep(0.2)
        for model in MODELS:
            deadline, last = time.monotonic() + 60, None
            while True:  # until HAProxy and the router see the replacement
                try:
                    r = infer(url, model, token_body([[3, 4]]))
                    if r.status_code == 200:
                        break
                    last = (r.status_code, r.text)
                except (requests.ConnectionError, requests.Timeout) as e:
                    last = repr(e)
                assert time.monotonic() < deadline, (model, last)
                time.sleep(0.2)
            np.testing.assert_array_equal(np.array(r.json()["outputs"][0]["data"], np.float32).reshape(1, 2, WIDTH),
                                          TABLE[[[3, 4]]])
    finally:
        for path, text in kept.items():
            path.write_text(text)
