"""Model control as Triton has it (``model_control_mode: explicit``), on a running server: a model
folder added to the repository after start is loaded, serves, and is unloaded; a dedicated
model is unloaded and loaded again; a bad config is refused; meanwhile every request to the
other models succeeds. Over plain HTTP and with ``tritonclient.http`` unmodified.

A second application ("control", under /control) serves a small repository: ``tiny_cnn``
(pool, loaded at start), ``spare_cnn`` (pool, not in ``startup_models``), ``simple_dedicated``
(Triton's ``simple`` on a dedicated deployment) and ``spare_dedicated`` (the same, with dynamic
batching, not in ``startup_models``).
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import requests
import yaml

from .conftest import REPOSITORY, _free_port, wait_ready

pytestmark = pytest.mark.integration

PREFIX = "/control"
X = np.random.default_rng(7).random((2, 3, 224, 224), dtype=np.float32)
PAIR = (np.arange(16, dtype=np.int32)[None], np.full((1, 16), 3, np.int32))


def copy_model(root: Path, source: str, name: str, **changes) -> None:
    """``root/name``: ``source``'s config (with ``changes``) and a copy of its model file."""
    raw = yaml.safe_load((Path(REPOSITORY) / source / "config.yaml").read_text())
    raw.update(changes)
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.yaml").write_text(yaml.safe_dump(raw))
    shutil.copy(Path(REPOSITORY) / source / "1" / "model.onnx", root / name / "1" / "model.onnx")


GRPC_PORT = _free_port()  # the control application's gRPC port


@pytest.fixture(scope="module")
def control(serve_instance, tmp_path_factory):
    """(base URL, repository root) of the explicit-control application (gRPC on ``GRPC_PORT``)."""
    from deployments.app import delete_server, run_applications

    root = tmp_path_factory.mktemp("control-repo")
    copy_model(root, "tiny_cnn", "tiny_cnn")
    copy_model(root, "tiny_cnn", "spare_cnn")
    copy_model(root, "simple", "simple_dedicated", deployment={"mode": "dedicated"})
    copy_model(root, "simple", "spare_dedicated", deployment={"mode": "dedicated"},
               dynamic_batching={"max_queue_delay_ms": 2, "preferred_batch_size": [4]})
    run_applications({"repository": str(root), "model_control_mode": "explicit",
                         "startup_models": ["tiny_cnn", "simple_dedicated"], "grpc_port": GRPC_PORT},
              name="control", route_prefix=PREFIX)
    url = f"{serve_instance}{PREFIX}"
    wait_ready(url)
    yield url, root
    delete_server("control")


class Statuses(list):
    """The statuses of one model's background requests; ``timed``: (sent, answered, status) each."""

    def __init__(self) -> None:
        super().__init__()
        self.timed: list[tuple[float, float, int]] = []


@pytest.fixture
def background(control):
    """Requests to tiny_cnn and simple_dedicated sent one after another in a thread while the
    test runs; yields ``{model: [status, ...]}`` (``Statuses``: with their times)."""
    url, _ = control
    statuses: dict[str, Statuses] = {"tiny_cnn": Statuses(), "simple_dedicated": Statuses()}
    stop = threading.Event()

    def send() -> None:
        while not stop.is_set():
            for model, body in (("tiny_cnn", cnn_body(X[:1])), ("simple_dedicated", simple_body())):
                sent = time.monotonic()
                status = requests.post(f"{url}/v2/models/{model}/infer", json=body).status_code
                statuses[model].append(status)
                statuses[model].timed.append((sent, time.monotonic(), status))

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    yield statuses
    stop.set()
    thread.join(timeout=60)


def cnn_body(x: np.ndarray) -> dict:
    return {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}


def simple_body() -> dict:
    return {"inputs": [{"name": f"INPUT{i}", "shape": [1, 16], "datatype": "INT32", "data": PAIR[i].ravel().tolist()}
                       for i in range(2)]}


def index(url: str) -> dict[str, dict]:
    return {item["name"]: item for item in requests.post(f"{url}/v2/repository/index").json()}


def test_a_model_added_after_start_loads_serves_and_unloads_while_the_others_keep_serving(control, background):
    url, root = control
    copy_model(root, "tiny_cnn", "added_cnn")
    assert index(url)["added_cnn"] == {
        "name": "added_cnn", "state": "UNAVAILABLE",
        "reason": "not loaded: POST /v2/repository/models/added_cnn/load loads it"}
    r = requests.post(f"{url}/v2/repository/models/added_cnn/load")
    assert r.status_code == 200, r.text
    assert index(url)["added_cnn"]["state"] == "READY"
    r = requests.post(f"{url}/v2/models/added_cnn/infer", json=cnn_body(X))
    assert r.status_code == 200, r.text
    expected = ort.InferenceSession(str(root / "added_cnn" / "1" / "model.onnx")).run(None, {"input": X})[0]
    np.testing.assert_allclose(np.array(r.json()["outputs"][0]["data"], np.float32).reshape(expected.shape),
                               expected, rtol=1e-4, atol=1e-5)
    memory = requests.get(f"{url}/v2/memory").json()["pool"]
    assert memory["models"]["added_cnn"]["state"] == "ready"

    r = requests.post(f"{url}/v2/repository/models/added_cnn/unload", json={"parameters": {"unload_dependents": False}})
    assert r.status_code == 200, r.text
    r = requests.post(f"{url}/v2/models/added_cnn/infer", json=cnn_body(X[:1]))
    assert r.status_code == 503, r.text
    assert r.json()["error"].startswith("Request for unknown model: 'added_cnn' has no available versions")
    entry = index(url)["added_cnn"]
    placed = entry.pop("placement")  # the pool's default, placement: bytes, places an unloaded model nowhere
    assert entry == {"name": "added_cnn", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}
    assert (placed["policy"], placed["replicas"], placed["copies"]) == ("bytes", [], 0), placed
    assert placed["reason"] == "unloaded: placed on no replica until it is loaded", placed
    memory = requests.get(f"{url}/v2/memory").json()["pool"]
    assert memory["models"]["added_cnn"]["state"] == "absent" and memory["events"][-1]["event"] == "unload"
    for model, statuses in background.items():
        assert len(statuses) > 2 and set(statuses) == {200}, (model, statuses)


def test_tritonclient_unloads_and_loads_a_dedicated_model_and_reads_the_index(control, background):
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    url, _ = control
    client = httpclient.InferenceServerClient(url.removeprefix("http://"), network_timeout=120)
    assert client.is_model_ready("spare_cnn") is False  # in the repository, not in startup_models
    client.load_model("spare_cnn")
    assert client.is_model_ready("spare_cnn")
    client.unload_model("spare_cnn")
    assert client.is_model_ready("spare_cnn") is False

    unloading = time.monotonic()
    client.unload_model("simple_dedicated")
    assert client.is_model_ready("simple_dedicated") is False
    inputs = [httpclient.InferInput(f"INPUT{i}", [1, 16], "INT32") for i in range(2)]
    for i, tensor in enumerate(inputs):
        tensor.set_data_from_numpy(PAIR[i])
    with pytest.raises(InferenceServerException, match="has no available versions") as refused:
        client.infer("simple_dedicated", inputs)
    assert refused.value.status() == "503"
    states = {m["name"]: m for m in client.get_model_repository_index()}
    assert states["simple_dedicated"]["state"] == "UNAVAILABLE" and states["tiny_cnn"]["state"] == "READY"
    client.load_model("simple_dedicated")
    loaded = time.monotonic()
    assert client.is_model_ready("simple_dedicated")
    result = client.infer("simple_dedicated", inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), PAIR[0] + PAIR[1])
    deadline = time.monotonic() + 60
    while not any(sent > loaded for sent, _, _ in background["simple_dedicated"].timed):
        assert time.monotonic() < deadline, "no background request sent after the load"
        time.sleep(0.1)
    assert len(background["tiny_cnn"]) > 2 and set(background["tiny_cnn"]) == {200}
    # 200 before the unload and after the load; 503 only for a request that overlapped the time
    # it was unloaded
    timed = background["simple_dedicated"].timed
    assert all(status == 200 or (status == 503 and answered > unloading and sent < loaded)
               for sent, answered, status in timed), timed
    assert [status for sent, _, status in timed if sent > loaded] and all(
        status == 200 for sent, _, status in timed if sent > loaded), timed


def test_tritonclient_grpc_loads_and_unloads_with_the_http_routes_words(control):
    """RepositoryModelLoad / Unload / Index over gRPC answer as the HTTP routes do (what
    Triton's simple_grpc_model_control.py calls)."""
    import tritonclient.grpc as grpcclient

    from .test_grpc import error_of

    with grpcclient.InferenceServerClient(f"127.0.0.1:{GRPC_PORT}") as client:
        deadline = time.monotonic() + 60
        while True:  # the router's gRPC server starts with the router
            try:
                assert client.is_server_live(client_timeout=5)
                break
            except Exception:
                assert time.monotonic() < deadline, "no gRPC answer within 60 s"
                time.sleep(0.2)
        index = {m.name: m for m in client.get_model_repository_index().models}
        assert index["spare_cnn"].state == "UNAVAILABLE" and index["simple_dedicated"].state == "READY"
        assert client.is_model_ready("spare_cnn") is False
        client.load_model("spare_cnn")
        assert client.is_model_ready("spare_cnn")
        tensor = grpcclient.InferInput("input", list(X.shape), "FP32")
        tensor.set_data_from_numpy(X)
        expected = ort.InferenceSession(f"{REPOSITORY}/tiny_cnn/1/model.onnx").run(None, {"input": X})[0]
        np.testing.assert_allclose(client.infer("spare_cnn", [tensor]).as_numpy("logits"), expected, rtol=1e-4, atol=1e-5)
        client.unload_model("spare_cnn")
        assert client.is_model_ready("spare_cnn") is False
        status, message = error_of(lambda: client.infer("spare_cnn", [tensor]))
        assert status == "StatusCode.UNAVAILABLE" and "has no available versions" in message
        status, message = error_of(lambda: client.load_model("wrong_model_name"))
        assert status == "StatusCode.NOT_FOUND" and message.startswith("failed to load 'wrong_model_name': ")
        status, message = error_of(lambda: client.load_model("spare_cnn", config='{"max_batch_size": 16}'))
        assert status == "StatusCode.INVALID_ARGUMENT"
        assert message.startswith("failed to load 'spare_cnn': load parameters ['config'] are not supported")


def test_a_dedicated_model_left_out_of_startup_models_starts_unloaded_and_serves_once_loaded(control):
    """Its replica starts with the model not loaded (the constructor asked the unloaded host for
    its backend, to pick the batch padding, and failed: the whole deploy failed), answers 404
    "not loaded" until a load, then the right sums, through its batch queue."""
    url, _ = control
    r = requests.post(f"{url}/v2/models/spare_dedicated/infer", json=simple_body())
    assert r.status_code == 404 and "it is in the repository but not loaded" in r.json()["error"], r.text
    assert requests.post(f"{url}/v2/repository/models/spare_dedicated/load").status_code == 200
    r = requests.post(f"{url}/v2/models/spare_dedicated/infer", json=simple_body())
    assert r.status_code == 200, r.text
    outputs = {o["name"]: o["data"] for o in r.json()["outputs"]}
    assert outputs["OUTPUT0"] == (PAIR[0] + PAIR[1]).ravel().tolist()
    assert outputs["OUTPUT1"] == (PAIR[0] - PAIR[1]).ravel().tolist()


def test_a_bad_config_on_load_is_400_naming_file_and_field_and_changes_nothing(control):
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    url, root = control
    copy_model(root, "tiny_cnn", "bad_cnn", max_batch_sise=4)
    r = requests.post(f"{url}/v2/repository/models/bad_cnn/load", json={})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error.startswith("failed to load 'bad_cnn': ") and f"{root}/bad_cnn/config.yaml: max_batch_sise: unknown field" in error
    assert index(url)["bad_cnn"]["state"] == "UNAVAILABLE"
    assert requests.post(f"{url}/v2/models/bad_cnn/infer", json=cnn_body(X[:1])).status_code == 404
    client = httpclient.InferenceServerClient(url.removeprefix("http://"))
    with pytest.raises(InferenceServerException, match="failed to load 'no_such_model'"):
        client.load_model("no_such_model")
    assert requests.post(f"{url}/v2/models/tiny_cnn/infer", json=cnn_body(X[:1])).status_code == 200


def test_a_model_file_that_is_not_onnx_is_400_and_listed_with_the_failure_as_its_reason(control):
    """A load of a folder whose file is not ONNX answered 400, then the index still listed it as
    "not loaded: POST .../load loads it" (the router refused it reading its config, completed
    from that file, and recorded nothing). Now the failure is its reason, whether the router
    refuses it or the pool replica does (a complete config: the file is read at load), and the
    server keeps serving the others."""
    url, root = control
    (root / "nc_bad" / "1").mkdir(parents=True)
    (root / "nc_bad" / "config.yaml").write_text("max_batch_size: 8\n")  # completed from the file
    copy_model(root, "tiny_cnn", "nc_bad_full")
    for name in ("nc_bad", "nc_bad_full"):
        (root / name / "1" / "model.onnx").write_bytes(b"this is not an ONNX model")
        r = requests.post(f"{url}/v2/repository/models/{name}/load")
        assert r.status_code == 400, r.text
        prefix = f"failed to load '{name}': "
        error = r.json()["error"]
        assert error.startswith(f"{prefix}model '{name}': its model file ") and "is not a valid ONNX model" in error, error
        line = {k: v for k, v in index(url)[name].items() if k in ("name", "state", "reason")}
        assert line == {"name": name, "state": "UNAVAILABLE", "reason": f"failed to load: {error.removeprefix(prefix)}"}
    r = requests.post(f"{url}/v2/models/tiny_cnn/infer", json=cnn_body(X[:1]))
    assert r.status_code == 200, r.text


def test_unloaded_and_failed_models_answer_metadata_and_config_as_their_infer_does_and_again_once_loaded(control):
    """Metadata and config of a pool model and of a dedicated model after an unload answer what
    their infer answers (503 "has no available versions", gRPC UNAVAILABLE; tritonclient's
    get_model_metadata / get_model_config raise it), as do those of a model whose load failed;
    once loaded again they answer 200 with the model's metadata and config as before."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    from .test_grpc import error_of

    url, root = control
    copy_model(root, "tiny_cnn", "described_cnn")
    assert requests.post(f"{url}/v2/repository/models/described_cnn/load").status_code == 200
    bodies = {"described_cnn": cnn_body(X[:1]), "simple_dedicated": simple_body()}
    metadata = {m: requests.get(f"{url}/v2/models/{m}") for m in bodies}
    configs = {m: requests.get(f"{url}/v2/models/{m}/config") for m in bodies}
    for model in bodies:
        assert metadata[model].status_code == configs[model].status_code == 200, (metadata[model].text, configs[model].text)
        assert metadata[model].json()["name"] == configs[model].json()["name"] == model
        assert metadata[model].json()["platform"] == "onnxruntime_onnx", metadata[model].text
    http = httpclient.InferenceServerClient(url.removeprefix("http://"), network_timeout=120)
    with grpcclient.InferenceServerClient(f"127.0.0.1:{GRPC_PORT}") as grpc_client:
        for model, body in bodies.items():
            assert requests.post(f"{url}/v2/repository/models/{model}/unload").status_code == 200
            refused = requests.post(f"{url}/v2/models/{model}/infer", json=body)
            assert refused.status_code == 503, refused.text
            for route in ("", "/config", "/versions/1", "/versions/1/config"):
                r = requests.get(f"{url}/v2/models/{model}{route}")
                assert (r.status_code, r.json()) == (503, refused.json()), (route, r.text)
            for call in (http.get_model_metadata, http.get_model_config):
                with pytest.raises(InferenceServerException, match="has no available versions; it is unloaded") as e:
                    call(model)
                assert e.value.status() == "503"
            for call in (grpc_client.get_model_metadata, grpc_client.get_model_config):
                status, message = error_of(lambda: call(model))
                assert status == "StatusCode.UNAVAILABLE" and "has no available versions" in message, message
            assert requests.post(f"{url}/v2/repository/models/{model}/load").status_code == 200
            assert requests.get(f"{url}/v2/models/{model}").json() == metadata[model].json()
            assert requests.get(f"{url}/v2/models/{model}/config").json() == configs[model].json()
            assert grpc_client.get_model_metadata(model).name == model
            assert grpc_client.get_model_config(model).config.name == model
            assert requests.post(f"{url}/v2/models/{model}/infer", json=body).status_code == 200

    copy_model(root, "tiny_cnn", "broken_cnn")
    (root / "broken_cnn" / "1" / "model.onnx").write_bytes(b"not an onnx model")
    assert requests.post(f"{url}/v2/repository/models/broken_cnn/load").status_code >= 400
    refused = requests.post(f"{url}/v2/models/broken_cnn/infer", json=cnn_body(X[:1]))
    assert refused.status_code in (404, 503), refused.text
    for route in ("", "/config"):
        r = requests.get(f"{url}/v2/models/broken_cnn{route}")
        assert (r.status_code, r.json()) == (refused.status_code, refused.json()), (route, r.text)


def pool_replicas() -> list[dict]:
    """The control application's pool replicas as the Serve controller reports them."""
    from ray.serve.context import _get_global_client

    app = _get_global_client().get_serve_details()["applications"].get("control.pool")
    return [] if app is None else app["deployments"]["pool"]["replicas"]


def test_a_pool_replica_started_after_a_load_is_routed_only_once_it_serves_the_load(control):
    """A replica that starts after a run-time load (here a replacement for a killed pool replica)
    catches up before Serve routes to it: its constructor awaits the first sync of the desired
    state. ``late_cnn``'s warmup makes its load take seconds on these cores; a replica routed
    before its sync answered 404 (a model it had not read yet) or 503 "reading the model
    control state" meanwhile."""
    import ray

    url, root = control
    copy_model(root, "tiny_cnn", "late_cnn", warmup={"batch_sizes": [32] * 8, "data": "random"})
    assert requests.post(f"{url}/v2/repository/models/late_cnn/load").status_code == 200
    expected = ort.InferenceSession(str(root / "late_cnn" / "1" / "model.onnx")).run(None, {"input": X[:1]})[0]
    (old,) = [r for r in pool_replicas() if r["state"] == "RUNNING"]
    ray.kill(ray.get_actor(old["actor_name"], namespace="serve"))
    deadline = time.monotonic() + 120
    while not any(r["state"] == "RUNNING" and r["replica_id"] != old["replica_id"] for r in pool_replicas()):
        assert time.monotonic() < deadline, "no replacement pool replica running"
        time.sleep(0.1)
    answers = []
    for _ in range(100):  # the replacement is running: it has applied the load
        r = requests.post(f"{url}/v2/models/late_cnn/infer", json=cnn_body(X[:1]))
        answers.append((r.status_code, r.text))
        if len([a for a in answers if a[0] == 200]) >= 20:
            break
        time.sleep(0.05)
    assert not [a for a in answers if "reading the model control state" in a[1]], answers[:3]
    # until HAProxy and the router see the replacement, a request may get "not ready" (or HAProxy's
    # 502/503 for the dead server)
    first = next(i for i, a in enumerate(answers) if a[0] == 200)
    assert all(a[0] in (502, 503) for a in answers[:first]), answers[:first]
    assert all(a[0] == 200 for a in answers[first:]), answers[first:]
    np.testing.assert_allclose(np.array(json.loads(answers[-1][1])["outputs"][0]["data"], np.float32).reshape(
        expected.shape), expected, rtol=1e-4, atol=1e-5)


def cnn_outputs(r: requests.Response) -> np.ndarray:
    return np.array(r.json()["outputs"][0]["data"], np.float32).reshape(2, -1)


def test_a_new_version_of_a_loaded_pool_model_serves_under_its_own_label_after_a_load(control):
    """``engines/m/2/`` added to a loaded pool model, then a load: infer answered
    ``model_version: "2"`` computed by version 1's engine (the pool's cache kept it), and
    requests were validated against the config read at start. Now the answer's label, its
    values, the metadata and the index all say version 2."""
    import onnx

    from deployments.runtime.tools.prepare import build_tiny_cnn

    url, root = control
    copy_model(root, "tiny_cnn", "grow_cnn")
    assert requests.post(f"{url}/v2/repository/models/grow_cnn/load").status_code == 200
    r = requests.post(f"{url}/v2/models/grow_cnn/infer", json=cnn_body(X))
    assert (r.status_code, r.json().get("model_version")) == (200, "1"), r.text

    (root / "grow_cnn" / "2").mkdir()
    onnx.save(build_tiny_cnn(5), root / "grow_cnn" / "2" / "model.onnx")  # other weights
    expected = {v: ort.InferenceSession(str(root / "grow_cnn" / str(v) / "model.onnx")).run(None, {"input": X})[0]
                for v in (1, 2)}
    assert not np.allclose(expected[1], expected[2])
    r = requests.post(f"{url}/v2/repository/models/grow_cnn/load")
    assert r.status_code == 200, r.text
    for route in ("grow_cnn", "grow_cnn/versions/2"):
        r = requests.post(f"{url}/v2/models/{route}/infer", json=cnn_body(X))
        assert (r.status_code, r.json().get("model_version")) == (200, "2"), r.text
        np.testing.assert_allclose(cnn_outputs(r), expected[2].reshape(2, -1), rtol=1e-4, atol=1e-5)
    r = requests.post(f"{url}/v2/models/grow_cnn/versions/1/infer", json=cnn_body(X))
    assert r.status_code == 404 and "served versions: [2]" in r.json()["error"], r.text
    assert requests.get(f"{url}/v2/models/grow_cnn").json()["versions"] == ["2"]
    assert [(i["version"], i["state"]) for i in requests.post(f"{url}/v2/repository/index").json()
            if i["name"] == "grow_cnn"] in ([("2", "READY")], [("2", "UNAVAILABLE")],
                                              [("2", "LOADING")])  # a pool report of up to 1 s ago


def control_replica() -> dict | None:
    """The RUNNING replica of the control application's model control deployment."""
    from ray.serve.context import _get_global_client

    app = _get_global_client().get_serve_details()["applications"]["control"]
    return next((r for r in app["deployments"]["control"]["replicas"] if r["state"] == "RUNNING"), None)


def desired() -> dict:
    """The control deployment's state (``ControlDeployment.desired``)."""
    from ray import serve

    return serve.get_deployment_handle("control", app_name="control").desired.remote().result(timeout_s=60)


def kill_control_replica() -> None:
    """Kill the control replica (SIGKILL, as a crash) and wait for Serve to run another."""
    import ray

    old = control_replica()
    ray.kill(ray.get_actor(old["actor_name"], namespace="serve"))
    deadline = time.monotonic() + 120
    while (new := control_replica()) is None or new["replica_id"] == old["replica_id"]:
        assert time.monotonic() < deadline, "no new control replica running"
        time.sleep(0.1)


def test_a_killed_control_replica_keeps_run_time_loads_and_the_next_change_reaches_every_replica(control):
    """Between changes: its state came back as the build-time state with revision 0, so the
    pool replica, which had applied revision 1, skipped the next change (an unload answered 200
    while the model went on serving)."""
    url, root = control
    copy_model(root, "tiny_cnn", "kept_cnn")
    assert requests.post(f"{url}/v2/repository/models/kept_cnn/load").status_code == 200
    kill_control_replica()
    assert desired()["models"]["kept_cnn"]["loaded"] is True  # the replacement took the stored state
    r = requests.post(f"{url}/v2/models/kept_cnn/infer", json=cnn_body(X[:1]))
    assert r.status_code == 200, r.text
    assert requests.post(f"{url}/v2/repository/models/kept_cnn/unload").status_code == 200
    r = requests.post(f"{url}/v2/models/kept_cnn/infer", json=cnn_body(X[:1]))
    assert r.status_code == 503 and "it is unloaded" in r.json()["error"], r.text


def test_a_control_replica_killed_during_a_load_loses_nothing(control):
    """Mid-change: the load's calls to the control deployment are sent again to its
    replacement, which has the stored state; the load answers 200 and the model serves."""
    url, root = control
    copy_model(root, "tiny_cnn", "midway_cnn", warmup={"batch_sizes": [32] * 4, "data": "random"})
    answer: list[requests.Response] = []
    loader = threading.Thread(target=lambda: answer.append(
        requests.post(f"{url}/v2/repository/models/midway_cnn/load", timeout=120)))
    loader.start()
    deadline = time.monotonic() + 30
    while index(url).get("midway_cnn", {}).get("state") != "LOADING":
        assert time.monotonic() < deadline and loader.is_alive(), "the load was never seen LOADING"
        time.sleep(0.02)
    kill_control_replica()
    loader.join(120)
    assert answer and answer[0].status_code == 200, answer and answer[0].text
    r = requests.post(f"{url}/v2/models/midway_cnn/infer", json=cnn_body(X[:1]))
    assert r.status_code == 200, r.text
    assert desired()["models"]["midway_cnn"]["loaded"] is True


def test_a_changed_config_of_a_dedicated_model_is_refused_on_load_and_a_new_version_loads(control):
    """The router read the changed config.yaml and its index, metadata and config described it
    (200) while the replica went on validating against the config it was deployed with. Now the
    load is 400 naming the redeploy, and everything keeps describing what serves; a new version
    folder with the config unchanged loads and answers under its own label."""
    url, root = control
    config = root / "simple_dedicated" / "config.yaml"
    deployed = config.read_text()
    config.write_text(yaml.safe_dump({**yaml.safe_load(deployed), "max_batch_size": 4}))
    try:
        r = requests.post(f"{url}/v2/repository/models/simple_dedicated/load")
        assert r.status_code == 400, r.text
        assert r.json()["error"].startswith(f"failed to load 'simple_dedicated': {config} changed since this dedicated "
                                            "model's deployment was deployed (fields ['max_batch_size']")
        assert "a config change needs a new deploy (serve deploy, or restart the server)" in r.json()["error"]
    finally:
        config.write_text(deployed)
    assert requests.get(f"{url}/v2/models/simple_dedicated/config").json()["max_batch_size"] == 8
    assert index(url)["simple_dedicated"]["state"] == "READY"
    eight = {"inputs": [{"name": f"INPUT{i}", "shape": [8, 16], "datatype": "INT32",
                         "data": np.repeat(PAIR[i], 8, axis=0).ravel().tolist()} for i in range(2)]}
    assert requests.post(f"{url}/v2/models/simple_dedicated/infer", json=eight).status_code == 200

    (root / "simple_dedicated" / "2").mkdir()
    shutil.copy(root / "simple_dedicated" / "1" / "model.onnx", root / "simple_dedicated" / "2" / "model.onnx")
    assert requests.post(f"{url}/v2/repository/models/simple_dedicated/load").status_code == 200
    r = requests.post(f"{url}/v2/models/simple_dedicated/infer", json=simple_body())
    assert (r.status_code, r.json().get("model_version")) == (200, "2"), r.text
    assert requests.get(f"{url}/v2/models/simple_dedicated").json()["versions"] == ["2"]
    assert index(url)["simple_dedicated"]["version"] == "2"


def test_a_model_file_written_in_place_serves_from_the_next_load_on_every_path(control):
    """A served version's model.onnx overwritten in place (other weights, the same size): the
    load answered 200 and the pool went on with the old engine, and a dedicated replica too.
    Now the load serves the new file, over HTTP and gRPC, for a pool and a dedicated model."""
    import onnx
    import tritonclient.grpc as grpcclient

    from deployments.runtime.tools.prepare import build_tiny_cnn

    url, root = control
    copy_model(root, "tiny_cnn", "inplace_cnn")
    assert requests.post(f"{url}/v2/repository/models/inplace_cnn/load").status_code == 200
    path = root / "inplace_cnn" / "1" / "model.onnx"
    r = requests.post(f"{url}/v2/models/inplace_cnn/infer", json=cnn_body(X))
    old = ort.InferenceSession(str(path)).run(None, {"input": X})[0]
    np.testing.assert_allclose(cnn_outputs(r), old.reshape(2, -1), rtol=1e-4, atol=1e-5)

    size = path.stat().st_size
    onnx.save(build_tiny_cnn(7), path)  # in place: other weights
    assert path.stat().st_size == size
    new = ort.InferenceSession(str(path)).run(None, {"input": X})[0]
    assert not np.allclose(old, new)
    r = requests.post(f"{url}/v2/repository/models/inplace_cnn/load")
    assert r.status_code == 200, r.text
    r = requests.post(f"{url}/v2/models/inplace_cnn/infer", json=cnn_body(X))
    assert (r.status_code, r.json().get("model_version")) == (200, "1"), r.text
    np.testing.assert_allclose(cnn_outputs(r), new.reshape(2, -1), rtol=1e-4, atol=1e-5)
    tensor = grpcclient.InferInput("input", list(X.shape), "FP32")
    tensor.set_data_from_numpy(X)
    with grpcclient.InferenceServerClient(f"127.0.0.1:{GRPC_PORT}") as client:
        np.testing.assert_allclose(client.infer("inplace_cnn", [tensor]).as_numpy("logits"), new, rtol=1e-4, atol=1e-5)

    # a dedicated model: OUTPUT1 = INPUT1 - INPUT0 written over simple's file (INPUT0 - INPUT1), then a load
    from onnx import TensorProto, helper

    latest = max(int(d.name) for d in (root / "simple_dedicated").iterdir() if d.name.isdigit())  # the one it serves
    dedicated = root / "simple_dedicated" / str(latest) / "model.onnx"
    kept = dedicated.read_bytes()
    swapped = onnx.load(str(dedicated))
    swapped.graph.node[1].CopyFrom(helper.make_node("Sub", ["INPUT1", "INPUT0"], ["OUTPUT1"], name="sub"))
    assert all(t.type.tensor_type.elem_type == TensorProto.INT32 for t in swapped.graph.output)
    try:
        onnx.save(swapped, dedicated)
        assert requests.post(f"{url}/v2/repository/models/simple_dedicated/load").status_code == 200
        r = requests.post(f"{url}/v2/models/simple_dedicated/infer", json=simple_body())
        assert r.status_code == 200, r.text
        outputs = {o["name"]: o["data"] for o in r.json()["outputs"]}
        assert outputs["OUTPUT1"] == (PAIR[1] - PAIR[0]).ravel().tolist()  # the new file's, not the old
    finally:
        dedicated.write_bytes(kept)
        assert requests.post(f"{url}/v2/repository/models/simple_dedicated/load").status_code == 200
    r = requests.post(f"{url}/v2/models/simple_dedicated/infer", json=simple_body())
    assert {o["name"]: o["data"] for o in r.json()["outputs"]}["OUTPUT1"] == (PAIR[0] - PAIR[1]).ravel().tolist()
