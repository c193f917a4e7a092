"""One hop to a dedicated model, as `make serve` runs it (HAProxy ingress): its requests reach
its own replicas with no router between, and while it has no replica (one that cannot be
placed, or lost and unable to load again) the router takes them and answers 503 at once
(``deployments.haproxy.router_backs_up_models``); every other model keeps serving.

One server for the module: ``python -m deployments.run`` with the Makefile's environment, in its
own session (so ``bench.replicas`` finds its replicas), on a repository of a pool model, a
dedicated model (``lost_cnn``) and a dedicated model that asks for a GPU the machine lacks
(``gpu_cnn``, ``use_gpus: true``), plus ``simple`` (a pool model whose requests cost little),
with the router's replicas scaling with load on delays of seconds (``ROUTER_SCALING``). Pool
models are one hop too: HAProxy -> the pool replica (the pool's application)."""

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

from bench.autoscale import start_runner
from bench.replicas import gone_at, interrupt_group, kill_replica, replica_pids

from .conftest import REPOSITORY, runner_config

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
# The router's autoscaling (deployments/app.py, ROUTER_AUTOSCALING) with delays of seconds, and
# room to grow on 2 cores (where its default is 1 replica).
ROUTER_SCALING = {"max_replicas": 4, "upscale_delay_s": 1, "downscale_delay_s": 5, "look_back_period_s": 2, "metrics_interval_s": 0.5}
X = np.random.default_rng(7).random((1, 3, 224, 224), dtype=np.float32)
BODY = {"inputs": [{"name": "input", "shape": [1, 3, 224, 224], "datatype": "FP32", "data": X.ravel().tolist()}]}


@pytest.fixture(scope="module")
def one_hop(tmp_path_factory):
    """(process, base URL, repository) of ``make serve``'s runner on the module's repository."""
    tmp = tmp_path_factory.mktemp("one_hop")
    root = tmp / "engines"
    (root / "tiny_cnn" / "1").mkdir(parents=True)
    shutil.copy(f"{REPOSITORY}/tiny_cnn/config.yaml", root / "tiny_cnn" / "config.yaml")
    (root / "tiny_cnn" / "1" / "model.onnx").symlink_to(f"{REPOSITORY}/tiny_cnn/1/model.onnx")
    for name, gpus in (("lost_cnn", 0), ("gpu_cnn", 1)):  # tiny_cnn's model, dedicated
        (root / name / "1").mkdir(parents=True)
        shutil.copy(f"{REPOSITORY}/tiny_cnn/1/model.onnx", root / name / "1" / "model.onnx")
        raw = yaml.safe_load((root / "tiny_cnn" / "config.yaml").read_text())
        raw["deployment"] = {"mode": "dedicated", "num_gpus": gpus}
        (root / name / "config.yaml").write_text(yaml.safe_dump(raw))
    (root / "simple" / "1").mkdir(parents=True)
    shutil.copy(f"{REPOSITORY}/simple/config.yaml", root / "simple" / "config.yaml")
    (root / "simple" / "1" / "model.onnx").symlink_to(f"{REPOSITORY}/simple/1/model.onnx")
    # use_gpus: true on a machine without GPUs: gpu_cnn's replica can never be placed (the pool
    # and lost_cnn reserve none).
    path, port = runner_config(tmp, repository=str(root), use_gpus=True, request_timeout_s=30,
                               pool={"num_gpus": 0}, router={"autoscaling": ROUTER_SCALING})
    log = tmp / "out.log"
    proc = start_runner(path, log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                if all(requests.get(f"{url}/v2/models/{m}/ready", timeout=5).status_code == 200
                       for m in ("lost_cnn", "tiny_cnn")):
                    break
            except (requests.ConnectionError, requests.Timeout):  # HAProxy starts with Serve; a busy replica answers late
                pass
            time.sleep(0.5)
        yield proc, url, root
    finally:
        interrupt_group(proc)


def until(condition, what: str, timeout_s: float = 120.0) -> None:
    """Poll ``condition`` until true; a request that times out or finds no listener counts as
    not yet (while a killed replica is replaced HAProxy may hold a request in Ray's fallback)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if condition():
                return
        except requests.RequestException:
            pass
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s"
        time.sleep(0.5)


def logits(url: str, model: str) -> np.ndarray:
    for _ in range(3):  # a 502 is HAProxy's "send it again" (seen once under CI load right after a kill)
        r = requests.post(f"{url}/v2/models/{model}/infer", json=BODY, timeout=60)
        if r.status_code != 502:
            break
        time.sleep(0.2)
    assert r.status_code == 200, r.text
    [out] = r.json()["outputs"]
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def test_a_dedicated_model_answers_with_the_router_replica_down(one_hop):
    proc, url, root = one_hop
    expected = ort.InferenceSession(str(root / "lost_cnn" / "1" / "model.onnx")).run(None, {"input": X})[0]
    np.testing.assert_allclose(logits(url, "lost_cnn"), expected, rtol=1e-4, atol=1e-5)
    killed = kill_replica(proc.pid, "models", "router")
    answers = [logits(url, "lost_cnn") for _ in range(5)]
    # no router ran while they were answered: Serve replaces a killed router in seconds
    assert killed not in replica_pids(proc.pid, "models", "router")
    assert replica_pids(proc.pid, "models", "router") == [], "a new router started too soon to tell"
    for answer in answers:
        np.testing.assert_allclose(answer, expected, rtol=1e-4, atol=1e-5)


def test_a_model_whose_replica_cannot_be_placed_answers_503_through_the_router(one_hop):
    _, url, _ = one_hop
    until(lambda: "gpu_cnn" in requests.get(f"{url}/v2/health/ready", timeout=10).text,  # the router answers again
          "the router answering again")
    r = requests.post(f"{url}/v2/models/gpu_cnn/infer", json=BODY, timeout=60)
    assert r.status_code == 503, r.text
    assert "model 'gpu_cnn' is not ready" in r.json()["error"]
    r = requests.get(f"{url}/v2/health/ready", timeout=10)
    assert r.status_code == 503 and "gpu_cnn" in r.json()["error"]
    assert requests.get(f"{url}/v2/models/gpu_cnn/ready", timeout=10).status_code == 503
    assert requests.post(f"{url}/v2/models/tiny_cnn/infer", json=BODY, timeout=60).status_code == 200
    assert requests.post(f"{url}/v2/models/lost_cnn/infer", json=BODY, timeout=60).status_code == 200


def test_router_replicas_grow_under_load_shrink_after_it_and_the_pool_replica_counts_every_answer(one_hop):
    """32 clients on the router's own route (the repository index, a call to the pool's handle
    each) through HAProxy, straight to the router replicas' own ports: the router's count rises
    from 1 and comes back to 1 after the load. Meanwhile 4 clients on a pool model reach the
    pool replica in one hop, no router on the way, and ``/v2/models/simple/stats`` counts every
    answer."""
    from bench.autoscale import Load, request_body

    proc, url, _ = one_hop
    body, headers = request_body("simple")
    r = requests.post(f"{url}/v2/models/simple/infer", data=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    assert len(replica_pids(proc.pid, "models", "router")) == 1
    index = Load(f"{url}/v2/repository/index", b"{}", {"Content-Type": "application/json"}, clients=32)
    pool = Load(f"{url}/v2/models/simple/infer", body, headers, clients=4)
    for load in (index, pool):
        load.active = load.clients
        load.thread.start()
    try:
        until(lambda: len(replica_pids(proc.pid, "models", "router")) > 1, "a second router replica under load")
    finally:
        for load in (index, pool):
            load.active = 0
            load.stop.set()
            load.thread.join(timeout=90)
    for load in (index, pool):
        assert not load.thread.is_alive()
        statuses = [status for _, status in load.done]
        assert statuses and set(statuses) == {200}, (load.url, {s: statuses.count(s) for s in set(statuses)})
    until(lambda: len(replica_pids(proc.pid, "models", "router")) == 1, "back to one router replica", 180)
    [stats] = requests.get(f"{url}/v2/models/simple/stats", timeout=10).json()["model_stats"]
    assert stats["inference_stats"]["success"]["count"] == len(pool.done) + 1  # + the first request


def _success_count(url: str, model: str) -> float:
    """``nv_inference_request_success`` of ``model`` in the router's ``GET /metrics`` (this
    node's series of the application: every replica process's, summed)."""
    from prometheus_client.parser import text_string_to_metric_families

    r = requests.get(f"{url}/metrics", timeout=30)
    assert r.status_code == 200, r.text
    return sum(s.value for f in text_string_to_metric_families(r.text) if f.name == "nv_inference_request_success"
               for s in f.samples if s.labels.get("model") == model)


@pytest.mark.parametrize("model", ["tiny_cnn", "lost_cnn"])  # a pool model, a dedicated one: both one hop
def test_scrapes_after_the_answers_count_every_one_once(one_hop, model):
    """N answers, then scrapes see all N, whichever replica process answered them, and never
    more. A request's counts are written ``FLUSH_INTERVAL_S`` after its answer on an idle
    machine; the wait here is far longer, since a loaded machine delays the writer thread (a
    bound in time is a benchmark's, not a test's)."""
    _, url, _ = one_hop
    before = _success_count(url, model)
    for _ in range(5):
        r = requests.post(f"{url}/v2/models/{model}/infer", json=BODY, timeout=60)
        assert r.status_code == 200, r.text
    deadline = time.monotonic() + 60
    seen = [_success_count(url, model) - before]
    while seen[-1] < 5 and time.monotonic() < deadline:
        time.sleep(0.02)
        seen.append(_success_count(url, model) - before)
    assert seen[-1] == 5, seen
    assert all(n <= 5 for n in seen), seen


def test_a_pool_replica_killed_under_load_answers_every_request_and_the_pool_heals(one_hop):
    """Two clients on a pool model in one hop (HAProxy -> the pool replica), requests within
    HAProxy's 16 KiB buffer (``simple``); the pool replica is killed. Every request gets an HTTP
    answer: the right sums (HAProxy sends one the killed replica held again, to the router,
    whose servers back up the pool's backend while it has no replica), a JSON 502 / 503 with
    Retry-After from HAProxy, or the router's JSON 503 "not ready" while Serve counts no pool
    replica; then the new pool replica answers in one hop. A request in flight at the kill (sent
    before the killed process was gone, answered after the kill was sent) may get no answer or one cut short: HAProxy closes a reused client
    connection it cannot answer on (docs/reliability.md, "Faults"), and one whose answer the
    replica was writing when killed gets it cut after its headers; every other request gets a
    full answer of those kinds."""
    from bench.faults import SIMPLE_BODY, SIMPLE_SUM

    proc, url, _ = one_hop
    stop, seen = threading.Event(), []

    def client() -> None:
        with requests.Session() as session:  # a reused connection, as tritonclient's
            while not stop.is_set():
                sent = time.monotonic()
                try:
                    r = session.post(f"{url}/v2/models/simple/infer", json=SIMPLE_BODY, timeout=120)
                    seen.append((sent, time.monotonic(), r.status_code, r.headers.get("content-type"),
                                 r.headers.get("retry-after"), r.text))
                except requests.RequestException as e:
                    seen.append((sent, time.monotonic(), None, None, None, repr(e)))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        time.sleep(2)
        killing = time.monotonic()
        killed = kill_replica(proc.pid, "models", "pool")
        killed_at = gone_at(killed)  # the kill takes effect when the process is next scheduled
        try:
            until(lambda: set(replica_pids(proc.pid, "models", "pool")) - {killed}
                  and sum(1 for s in list(seen) if s[0] > killed_at and s[2] == 200) >= 20, "the pool serving again")
        except AssertionError as e:
            after = [(round(s[0] - killed_at, 1), s[2], s[5][:120]) for s in list(seen) if s[0] > killed_at - 5]
            raise AssertionError(f"{e}; pool replicas {replica_pids(proc.pid, 'models', 'pool')} (killed {killed}); "
                                 f"answers since 5 s before the kill: {after[:40]}") from None
    finally:
        stop.set()
        for t in threads:
            t.join(150)
    assert not any(t.is_alive() for t in threads)
    for sent, done, status, kind, retry_after, text in seen:
        # in flight at the kill: no answer, or one cut short (docstring); ``killed_at`` is when a
        # poll of /proc saw the process gone, and HAProxy sees its sockets close a moment apart
        # from that: a request sent within 0.1 s after it can still have reached the replica
        if status is None and sent <= killed_at + 0.1 and done >= killing:
            continue
        assert status is not None, (round(sent - killed_at, 2), text)  # not in flight: a full answer
        if status == 200:
            outputs = {o["name"]: o["data"] for o in json.loads(text)["outputs"]}
            assert outputs["OUTPUT0"] == SIMPLE_SUM, text
        else:  # HAProxy's 502 / 503 (with Retry-After), or the router's 503 while the pool has no replica
            assert status in (502, 503) and kind == "application/json" and "error" in json.loads(text), (
                round(sent - killed_at, 2), status, kind, text[:300])
            assert retry_after or "is not ready" in text, (round(sent - killed_at, 2), status, text[:300])


def test_a_model_that_lost_its_replicas_answers_503_at_once(one_hop):
    """The replica dies and its replacement cannot load (the model file is gone): readiness
    and requests answer 503 from the router, not a wait for a replica that never comes."""
    proc, url, root = one_hop
    (root / "lost_cnn" / "1" / "model.onnx").unlink()  # a replacement replica cannot load it
    kill_replica(proc.pid, "models", "model-lost_cnn")
    until(lambda: "is not ready" in requests.get(f"{url}/v2/models/lost_cnn/ready", timeout=10).text,
          "lost_cnn not ready")
    r = requests.get(f"{url}/v2/models/lost_cnn/ready", timeout=10)
    assert r.status_code == 503 and "model 'lost_cnn' is not ready" in r.json()["error"]
    r = requests.post(f"{url}/v2/models/lost_cnn/infer", json=BODY, timeout=60)
    assert r.status_code == 503 and "model 'lost_cnn' is not ready" in r.json()["error"], r.text
    assert requests.post(f"{url}/v2/models/tiny_cnn/infer", json=BODY, timeout=60).status_code == 200
