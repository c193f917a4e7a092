"""Faults injected into a live server: each must give a clear error and heal by itself.

- ``pool_kill_mid_load``: a request for a cold pool model starts its load; once the repository
  index says ``LOADING``, the pool replica is killed (SIGKILL); a load done before the index
  showed it is tried again, with ``resnet18`` made cold. The request is answered (200
  after the router's one retry on the replacement, or 503 naming the model; in one hop,
  HAProxy -> pool replica, HAProxy's JSON 502 "send it again": its one retry reaches the dead
  replica, ``deployments/haproxy.py``), and the model serves again once Serve has replaced the
  replica.
- ``router_kill_under_load``: clients send requests back to back (``simple``'s infer, or with
  ``index`` the repository index: in one hop no model's request crosses the router); the router
  replica is killed. Every request is answered, those in flight in the killed replica included, and the
  server serves again by itself. Through HAProxy (``make serve``) a request in flight is sent
  again once (``deployments/haproxy.py``, ``RETRIES``) and answered 200 by another router
  replica, or, with one router replica (the retry reaches the dead one before HAProxy marks it
  down), answered 502/503 ``{"error": ...}`` with ``Retry-After``; later requests go to Ray's
  fallback proxy, which waits for the new router. Through Ray's Python proxy (``FAST=0``, the integration tests) it is answered 500 "Internal Server Error"
  in plain text (Ray's own answer, ``python_proxy=True``). ``lost`` counts requests with no
  HTTP answer, a wrong answer, or an answer outside those.
- ``damaged_model_file``: a pool model's ONNX file is truncated before its first load: its
  requests answer 400 ``{"error": "model 'm': its model file m/1/model.onnx is not a valid ONNX
  model: ..."}`` (the file's content is whoever put it there's; no full path, no traceback), the other models keep serving, and once the file is repaired the next
  request loads it, without a restart.
- The plan folder's disk filling during ``make engines`` is an offline fault: it is tested in
  ``tests/unit/test_faults.py`` (ENOSPC injected at ``write_atomic``, and on a real 64 KiB
  tmpfs where the machine lets the tests mount one).

Each scenario returns a ``FaultResult``; ``run_all`` runs every scenario ``rounds`` times.

    python -m bench.faults --rounds 3        # starts its own server over a scratch repository
    python -m bench.faults --rounds 3 --router-pad-bytes 32768   # router-kill requests of 32 KiB

- The model control campaign (``--campaign control``, ``run_control``; an application with
  explicit model control whose loads are slow: warmups of batches of 32): the control replica
  killed between two changes and during a load (``control_kill``), the pool replica killed
  while a new model loads and while a loaded one takes a new version with requests to it in
  flight (``pool_kill_during_loads``), a load that outlives ``request_timeout_s``
  (``load_times_out``). For each: every 200 answer carries the outputs of the version its
  ``model_version`` names, the repository index and infer agree at the end with the changes
  asked for, and no change is lost (``lost`` counts each breach).

The short form (one round) runs in ``make test`` (``tests/integration/test_campaigns.py``).

    python -m bench.faults --campaign control --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import requests

from bench.replicas import kill_replica, replica_pids

ROOT = Path(__file__).resolve().parents[1]
SIMPLE_BODY = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))},
                          {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [1] * 16}]}
SIMPLE_SUM = [i + 1 for i in range(16)]


def tensor_body() -> dict[str, Any]:
    """A valid JSON request of zeros for the (1, 3, 224, 224) FP32 CNNs of the repository."""
    return {"inputs": [{"name": "input", "shape": [1, 3, 224, 224], "datatype": "FP32", "data": [0.0] * 150528}]}


@dataclass
class FaultResult:
    """One injected fault: its name, the answers seen while it was in effect (status -> count;
    ``None`` for no HTTP answer), those of the requests in flight when a process was killed,
    one error text per status, whether and how fast the server served again by itself, and the
    requests lost (no answer, or an error outside the table)."""

    fault: str
    answers: dict[str, int] = field(default_factory=dict)
    in_flight: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    recovered: bool = False
    recovery_s: float | None = None
    lost: int = 0
    detail: str = ""

    def record(self, status: int | None, error: str | None) -> None:
        self.answers[str(status)] = self.answers.get(str(status), 0) + 1
        if error is not None:
            self.errors.setdefault(str(status), error[:300])


def _post(url: str, body: dict[str, Any], timeout_s: float = 90.0,
          pad_bytes: int = 0) -> tuple[int | None, str | None, dict | None]:
    """(status, error text of a non-200 answer, JSON of a 200 answer); status None: no answer.
    ``pad_bytes``: that many spaces after the JSON (the same request, a larger body)."""
    try:
        if pad_bytes:
            r = requests.post(url, data=json.dumps(body) + " " * pad_bytes, timeout=timeout_s,
                              headers={"Content-Type": "application/json"})
        else:
            r = requests.post(url, json=body, timeout=timeout_s)
    except requests.RequestException as e:
        return None, f"{type(e).__name__}: {e}", None
    if r.status_code == 200:
        return 200, None, r.json() if r.content else None  # a load / unload answers an empty body
    try:
        return r.status_code, str(r.json()["error"]), None
    except (ValueError, KeyError, TypeError):
        return r.status_code, f"not an error body: {r.text[:200]!r}", None


def _wait_serving(url: str, body: dict[str, Any], timeout_s: float) -> float | None:
    """Seconds until ``body`` at ``url`` answers 200 (polled every 0.5 s); None if it never did."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if _post(url, body, 30.0)[0] == 200:
            return round(time.monotonic() - start, 1)
        time.sleep(0.5)
    return None


def _cache_state(base_url: str, model: str) -> str | None:
    """``model``'s state in the cache of the pool replica that answers ``/v2/memory`` (live:
    the index takes the pool's states from the replicas' reports, once a second, and can miss
    a load shorter than that)."""
    try:
        pool = requests.get(f"{base_url}/v2/memory", timeout=10).json().get("pool") or {}
    except (requests.RequestException, ValueError):
        return None
    return (pool.get("models", {}).get(model) or {}).get("state")


def _state(base_url: str, model: str) -> str | None:
    try:
        index = requests.post(f"{base_url}/v2/repository/index", timeout=10).json()
    except (requests.RequestException, ValueError):
        return None
    return next((m.get("state") for m in index if m.get("name") == model), None)


COLD_CANDIDATES = ("resnet18", "mid_cnn", "tiny_cnn")  # slowest load first


def _cold_model(base_url: str) -> str | None:
    """A pool CNN the repository index shows ``UNAVAILABLE``, ``resnet18`` (the slowest load)
    made cold first by asking for the two others (a pool of 2 models, the campaign's, evicts it)."""
    if _state(base_url, COLD_CANDIDATES[0]) != "UNAVAILABLE":
        for other in COLD_CANDIDATES[1:]:
            _post(f"{base_url}/v2/models/{other}/infer", tensor_body())
    return next((m for m in COLD_CANDIDATES if _state(base_url, m) == "UNAVAILABLE"), None)


def pool_kill_mid_load(base_url: str, session: int, app: str, recover_timeout_s: float = 90.0,
                       attempts: int = 8) -> FaultResult:
    """Kill the pool replica while a cold pool CNN (``_cold_model``) loads for a request (its
    cache's state ``loading`` in ``/v2/memory``: the campaign's pool has one replica). A load
    can finish before it is seen loading (on an idle machine a CNN loads in 80-300 ms, and a
    ``/v2/memory`` read can take as long): then its answer is recorded and a cold model is tried
    again, ``attempts`` times in all (3 missed every load once)."""
    result = FaultResult("kill a pool replica in the middle of a model load")
    body = tensor_body()
    url = None
    for attempt in range(1, attempts + 1):
        model = _cold_model(base_url)
        if model is None:
            result.detail = f"no cold model among {COLD_CANDIDATES}"
            result.lost += 1
            return result
        url = f"{base_url}/v2/models/{model}/infer"
        answer: list[tuple[int | None, str | None, dict | None]] = []
        sender = threading.Thread(target=lambda: answer.append(_post(url, body)))
        sender.start()
        deadline = time.monotonic() + 60
        killed = False
        while not killed:
            state = _cache_state(base_url, model)
            if state == "loading":
                pid = kill_replica(session, app, "pool")
                result.detail = f"killed pool replica pid {pid} while '{model}' was LOADING (attempt {attempt})"
                killed = True
            elif time.monotonic() > deadline or not sender.is_alive():
                result.detail = f"never saw '{model}' loading (state {state}) in {attempt} attempts"
                break
            else:
                time.sleep(0.02)
        sender.join(120)
        status, error, _ = answer[0] if answer else (None, "no answer within 120 s", None)
        result.record(status, error)
        # documented: 200 (the router retried on the replacement), 503 naming the model, or in one
        # hop (HAProxy -> pool replica) HAProxy's JSON 502 "send it again": its one retry went to
        # the dead replica (deployments/haproxy.py, RETRIES), or the body was over its buffer
        if not (status == 200 or (status == 503 and error is not None and f"model '{model}'" in error)
                or (status == 502 and error is not None and not error.startswith("not an error body"))):
            result.lost += 1
        if killed:
            break
    result.recovery_s = _wait_serving(url, body, recover_timeout_s)
    result.recovered = result.recovery_s is not None
    return result


# Ray's Python proxy's answer to a request whose ingress replica died (``FAST=0``): not ours to shape.
PYTHON_PROXY_500 = "not an error body: 'Internal Server Error'"


def documented_router_kill_answer(status: int | None, error: str | None, in_flight: bool,
                                  python_proxy: bool = False) -> bool:
    """Whether an answer to a request sent while the router replica was killed is one docs/api.md
    documents: 200; 502, 503 or 504 with an ``{"error": ...}`` body (HAProxy's answers,
    ``deployments/haproxy.py``, or the server's own); with Ray's Python proxy in front, a
    plain-text 500 for a request that was in flight in the killed replica."""
    if status == 200:
        return True
    if status in (502, 503, 504):
        return error is not None and not error.startswith("not an error body")
    return python_proxy and in_flight and status == 500 and error == PYTHON_PROXY_500


def router_kill_under_load(base_url: str, session: int, app: str, threads: int = 4,
                           recover_timeout_s: float = 90.0, python_proxy: bool = False,
                           pad_bytes: int = 0, index: bool = False) -> FaultResult:
    """Kill the router replica while ``threads`` clients send ``simple`` requests back to back;
    ``python_proxy``: the server's ingress is Ray's Python proxy, not HAProxy
    (``documented_router_kill_answer``); ``pad_bytes``: spaces after each JSON body (over
    HAProxy's 16 KiB buffer, HAProxy cannot send a request again). ``index``: the clients ask
    the repository index instead (the router's own route: with the models' applications routed,
    one hop, no model's requests cross the router), and an answer must list ``simple``."""
    result = FaultResult("kill the router replica under load")
    url = f"{base_url}/v2/repository/index" if index else f"{base_url}/v2/models/simple/infer"
    body = {} if index else SIMPLE_BODY

    def right(out: Any) -> bool:  # a 200's answer: the index lists simple, or simple's sum is right
        if index:
            return "simple" in {m["name"] for m in out}
        return {o["name"]: o["data"] for o in out["outputs"]}["OUTPUT0"] == SIMPLE_SUM

    stop = threading.Event()
    killed_at: list[float] = []
    lock = threading.Lock()
    seen: list[tuple[float, float, int | None, str | None]] = []  # sent, done, status, error

    def client() -> None:
        while not stop.is_set():
            sent = time.monotonic()
            status, error, out = _post(url, body, 60.0, pad_bytes)
            if status == 200 and not right(out):
                status, error = None, "wrong answer"
            with lock:
                seen.append((sent, time.monotonic(), status, error))

    workers = [threading.Thread(target=client, daemon=True) for _ in range(threads)]
    for w in workers:
        w.start()
    time.sleep(3)
    pid = replica_pids(session, app, "router")[0]
    killed_at.append(time.monotonic())  # [0]: right before the kill, [1]: right after it
    os.kill(pid, signal.SIGKILL)
    killed_at.append(time.monotonic())
    result.detail = f"killed router replica pid {pid}"
    recovered = None
    while time.monotonic() - killed_at[0] < recover_timeout_s:
        with lock:
            ok_after = [s for s in seen if s[0] > killed_at[1] and s[2] == 200]
        if len(ok_after) >= 10:
            recovered = min(s[1] for s in ok_after) - killed_at[0]
            break
        time.sleep(0.25)
    time.sleep(1)
    stop.set()
    for w in workers:
        w.join(70)
    for sent, done, status, error in seen:
        result.record(status, error)
        in_flight = sent <= killed_at[1] and done >= killed_at[0]  # held by the killed process when it died
        if in_flight:
            result.in_flight[str(status)] = result.in_flight.get(str(status), 0) + 1
        if not documented_router_kill_answer(status, error, in_flight, python_proxy):
            result.lost += 1
    result.recovered = recovered is not None
    result.recovery_s = None if recovered is None else round(recovered, 1)
    return result


def damaged_model_file(base_url: str, repository: Path, model: str = "simple_identity",
                       recover_timeout_s: float = 60.0) -> FaultResult:
    """Truncate ``model``'s ONNX file in ``repository`` (a scratch copy the server serves; the
    model must not be loaded yet), request it, repair the file, request again."""
    result = FaultResult("truncate a model file on disk before its load")
    path = repository / model / "1" / "model.onnx"
    if path.is_symlink():  # never damage the shared original: the scratch copy gets a real file
        data = path.read_bytes()
        path.unlink()
        path.write_bytes(data)
    good = path.read_bytes()
    url = f"{base_url}/v2/models/{model}/infer"
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "BYTES", "data": [f"w{i}" for i in range(16)]}]}
    try:
        path.write_bytes(good[: len(good) // 2])
        for _ in range(2):  # twice: a failed load is not remembered as a state
            status, error, _ = _post(url, body)
            result.record(status, error)
            if not (status == 400 and error and error.startswith(f"model '{model}': its model file {model}/1/model.onnx "
                                                                 "is not a valid ONNX model")):
                result.lost += 1
        other = _post(f"{base_url}/v2/models/simple/infer", SIMPLE_BODY)
        result.record(other[0], other[1])
        if other[0] != 200:
            result.lost += 1
            result.detail = "another model stopped serving"
    finally:
        path.write_bytes(good)
    result.recovery_s = _wait_serving(url, body, recover_timeout_s)
    result.recovered = result.recovery_s is not None
    return result


# --- model control (model_control_mode: explicit) -----------------------------------------------

CONTROL_X_SEED = 3


def control_input() -> list[float]:
    """The (1, 3, 224, 224) FP32 input of every model control check, as JSON data."""
    import numpy as np

    return np.random.default_rng(CONTROL_X_SEED).random((1, 3, 224, 224), dtype=np.float32).ravel().tolist()


def add_control_model(repository: Path, name: str, seeds: dict[int, int], warmup_batches: int = 0) -> dict[int, Any]:
    """Model folder ``repository/name``: tiny_cnn's config (with a warmup of ``warmup_batches``
    random batches of 32: a slow load), version ``v`` built with seed ``seeds[v]`` (other
    weights, other outputs). Returns each version's expected outputs (ONNX Runtime run here)."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    import yaml

    from deployments.runtime.tools.prepare import build_tiny_cnn

    folder = repository / name
    raw = yaml.safe_load((ROOT / "engines" / "tiny_cnn" / "config.yaml").read_text())
    raw.pop("warmup", None)
    if warmup_batches:
        raw["warmup"] = {"batch_sizes": [32] * warmup_batches, "data": "random"}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(raw))
    x = np.array(control_input(), np.float32).reshape(1, 3, 224, 224)
    expected = {}
    for version, seed in seeds.items():
        (folder / str(version)).mkdir(exist_ok=True)
        onnx.save(build_tiny_cnn(seed), folder / str(version) / "model.onnx")
        expected[version] = ort.InferenceSession(str(folder / str(version) / "model.onnx")).run(None, {"input": x})[0]
    return expected


class Labels:
    """Checks that every 200 answer of a model names a version whose outputs it carries."""

    def __init__(self, expected: dict[int, Any]) -> None:
        self.expected = expected
        self.wrong: list[str] = []

    def check(self, out: dict | None) -> str | None:
        """The answer's version (None for a wrong label, recorded in ``wrong``)."""
        import numpy as np

        version = str((out or {}).get("model_version"))
        want = self.expected.get(int(version)) if version.isdigit() else None
        got = np.array(out["outputs"][0]["data"], np.float32) if out and out.get("outputs") else None
        if want is None or got is None or not np.allclose(got, want.ravel(), rtol=1e-4, atol=1e-5):
            self.wrong.append(f"model_version {version}: outputs not that version's")
            return None
        return version


def _infer(base_url: str, name: str, labels: Labels, result: FaultResult) -> tuple[int | None, str | None, str | None]:
    """One request to ``name``: (status, error, version of a 200 whose label is right)."""
    body = {"inputs": [{"name": "input", "shape": [1, 3, 224, 224], "datatype": "FP32", "data": control_input()}]}
    status, error, out = _post(f"{base_url}/v2/models/{name}/infer", body, 60.0)
    result.record(status, error)
    return status, error, labels.check(out) if status == 200 else None


def _control(base_url: str, verb: str, name: str, result: FaultResult, timeout_s: float = 180.0) -> int | None:
    status, error, _ = _post(f"{base_url}/v2/repository/models/{name}/{verb}", {}, timeout_s)
    result.record(status, error)
    return status


def _load_again(base_url: str, name: str, result: FaultResult, timeout_s: float = 180.0) -> bool:
    """Load ``name`` again after a load that a kill cut short, as its 503 asks ("retry shortly":
    the deployment has no running replica until the replacement has applied the state)."""
    deadline = time.monotonic() + timeout_s
    while (status := _control(base_url, "load", name, result)) == 503 and time.monotonic() < deadline:
        time.sleep(1.0)
    return status == 200


def _index_item(base_url: str, name: str) -> dict[str, Any]:
    try:
        return next((m for m in requests.post(f"{base_url}/v2/repository/index", timeout=30).json()
                     if m.get("name") == name), {})
    except (requests.RequestException, ValueError):
        return {}


def _settled(base_url: str, name: str, timeout_s: float = 120.0) -> dict[str, Any]:
    """The index line of ``name`` once it is not LOADING / UNLOADING (or the last seen)."""
    deadline = time.monotonic() + timeout_s
    item = _index_item(base_url, name)
    while item.get("state") in (None, "LOADING", "UNLOADING") and time.monotonic() < deadline:
        time.sleep(0.25)
        item = _index_item(base_url, name)
    return item


def _truthful_end(base_url: str, name: str, labels: Labels, result: FaultResult, version: str,
                  loaded: bool = True) -> None:
    """The index and infer at the end agree with the state the changes asked for: ``loaded``,
    serving ``version`` under its own label (READY, or UNAVAILABLE evicted from the pool cache),
    else 503 naming the unload; a disagreement counts as lost (a change lost or a lie)."""
    item = _settled(base_url, name)
    status, error, seen = _infer(base_url, name, labels, result)
    if loaded:
        untrue = (item.get("state") not in ("READY", "UNAVAILABLE") or "unloaded" in item.get("reason", "")
                  or "failed" in item.get("reason", "") or status != 200 or seen != version
                  or item.get("version") != version)
    else:
        untrue = item.get("state") != "UNAVAILABLE" or status != 503 or "unloaded" not in (error or "")
    if untrue:
        result.lost += 1
        result.detail += f"; at the end: index {item}, infer {status} {seen or error}"


def _wait_new_replica(session: int, app: str, deployment: str, old_pid: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if [p for p in replica_pids(session, app, deployment) if p != old_pid]:
            return
        time.sleep(0.2)


def _kill_when_loading(base_url: str, session: int, app: str, deployment: str, name: str, verb: str,
                       result: FaultResult) -> list[int | None]:
    """``verb`` (load) ``name`` in a thread; kill a replica of ``deployment`` once the index
    shows it LOADING, and wait for its replacement. Returns the change's status (in a list)."""
    answer: list[int | None] = []
    worker = threading.Thread(target=lambda: answer.append(_control(base_url, verb, name, result)))
    worker.start()
    deadline = time.monotonic() + 60
    while _index_item(base_url, name).get("state") != "LOADING":
        if time.monotonic() > deadline or not worker.is_alive():
            result.detail += f"; never saw '{name}' LOADING"
            worker.join(180)
            return answer
        time.sleep(0.02)
    pid = kill_replica(session, app, deployment)
    result.detail += f"; killed {deployment} pid {pid} while '{name}' was LOADING"
    _wait_new_replica(session, app, deployment, pid)
    worker.join(180)
    return answer


def control_kill(base_url: str, session: int, app: str, repository: Path) -> FaultResult:
    """Kill the control replica between two changes, then during a load: both changes and the
    next ones reach every replica, and the index says what serves."""
    result = FaultResult("kill the model control replica between changes and during a load")
    labels = Labels(add_control_model(repository, "mc_kept", {1: 0}))
    if _control(base_url, "load", "mc_kept", result) != 200:
        result.lost += 1
    pid = kill_replica(session, app, "control")
    result.detail = f"killed control pid {pid} after a load"
    _wait_new_replica(session, app, "control", pid)
    unloaded = _control(base_url, "unload", "mc_kept", result)
    _truthful_end(base_url, "mc_kept", labels, result, "1", loaded=False)
    result.lost += unloaded != 200
    mid = Labels(add_control_model(repository, "mc_mid", {1: 0}, warmup_batches=8))
    (status,) = _kill_when_loading(base_url, session, app, "control", "mc_mid", "load", result) or [None]
    if status not in (200, 504):  # 504: the load outlived request_timeout_s, and goes on
        result.lost += 1
    _truthful_end(base_url, "mc_mid", mid, result, "1")
    result.lost += len(labels.wrong) + len(mid.wrong)
    result.recovered = not result.lost
    return result


def pool_kill_during_loads(base_url: str, session: int, app: str, repository: Path) -> FaultResult:
    """Kill the pool replica while a new model loads, then while a loaded model takes a new
    version (requests to it sent all along): every 200 carries its version's own outputs, the
    index ends truthful, and a later load (if the killed one failed) serves the new version."""
    result = FaultResult("kill a pool replica during a load and during a version change")
    fresh = Labels(add_control_model(repository, "mc_fresh", {1: 0}, warmup_batches=8))
    (status,) = _kill_when_loading(base_url, session, app, "pool", "mc_fresh", "load", result) or [None]
    if status != 200 and not _load_again(base_url, "mc_fresh", result):  # a later load retries
        result.lost += 1
    _truthful_end(base_url, "mc_fresh", fresh, result, "1")

    expected = add_control_model(repository, "mc_ver", {1: 0}, warmup_batches=8)
    if _control(base_url, "load", "mc_ver", result) != 200:
        result.lost += 1
    stop = threading.Event()
    labels = Labels({**expected, **add_control_model(repository, "mc_ver", {2: 5}, warmup_batches=8)})
    versions: list[str | None] = []

    def send() -> None:
        while not stop.is_set():
            versions.append(_infer(base_url, "mc_ver", labels, result)[2])

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    (status,) = _kill_when_loading(base_url, session, app, "pool", "mc_ver", "load", result) or [None]
    if status != 200 and not _load_again(base_url, "mc_ver", result):
        result.lost += 1
    stop.set()
    sender.join(90)
    _truthful_end(base_url, "mc_ver", labels, result, "2")
    result.detail += f"; answers by version during the change: {{'1': {versions.count('1')}, '2': {versions.count('2')}}}"
    result.lost += len(fresh.wrong) + len(labels.wrong)
    if fresh.wrong or labels.wrong:
        result.detail += f"; wrong labels: {(fresh.wrong + labels.wrong)[:3]}"
    result.recovered = not result.lost
    return result


def load_times_out(base_url: str, repository: Path, warmup_batches: int = 24) -> FaultResult:
    """A load slower than ``request_timeout_s`` answers 504 and goes on: the index says LOADING,
    then READY once every replica has it (or UNAVAILABLE with the reason, had it failed), and
    the model serves under its own label; an unload after it is not lost."""
    result = FaultResult("a load that outlives its request")
    labels = Labels(add_control_model(repository, "mc_slow", {1: 0}, warmup_batches=warmup_batches))
    status = _control(base_url, "load", "mc_slow", result)
    states = {_index_item(base_url, "mc_slow").get("state")}
    result.detail = f"load answered {status}; index while it went on: {sorted(map(str, states))}"
    if status not in (200, 504) or (status == 504 and states != {"LOADING"}):
        result.lost += 1
    _truthful_end(base_url, "mc_slow", labels, result, "1")
    if _control(base_url, "unload", "mc_slow", result) != 200:
        result.lost += 1
    _truthful_end(base_url, "mc_slow", labels, result, "1", loaded=False)
    result.lost += len(labels.wrong)
    result.recovered = not result.lost
    return result


def run_control(base_url: str, session: int, app: str, repository: Path, rounds: int = 1,
                log: Callable[[str], None] = lambda s: None) -> list[FaultResult]:
    """The model control campaign, ``rounds`` times (each round's models are new folders)."""
    results = []
    for r in range(rounds):
        for scenario in (lambda: load_times_out(base_url, repository),
                         lambda: control_kill(base_url, session, app, repository),
                         lambda: pool_kill_during_loads(base_url, session, app, repository)):
            results.append(scenario())
            log(f"round {r + 1}: {json.dumps(asdict(results[-1]))}")
            wait_replicas(session, app, ("router", "pool", "control"))
        for model in ("mc_kept", "mc_mid", "mc_fresh", "mc_ver", "mc_slow"):  # the next round adds them anew
            requests.post(f"{base_url}/v2/repository/models/{model}/unload", timeout=120)
            shutil.rmtree(repository / model, ignore_errors=True)
    return results


# The model control campaign's application: explicit model control, a request timeout that a
# load with a long warmup outlives.
CONTROL_APP_ARGS = {"model_control_mode": "explicit", "startup_models": ["simple", "tiny_cnn"],
                    "request_timeout_s": 8.0, "pool": {"max_num_models_per_replica": 4}}


def scratch_repository(dest: Path, source: Path = ROOT / "engines") -> Path:
    """``dest`` with every model of ``source``: configs copied, version folders linked, except
    the files a fault damages (``damaged_model_file`` copies before it truncates)."""
    for model in sorted(p for p in source.iterdir() if (p / "config.yaml").is_file()):
        (dest / model.name).mkdir(parents=True)
        shutil.copy(model / "config.yaml", dest / model.name / "config.yaml")
        for version in (v for v in model.iterdir() if v.is_dir() and v.name.isdigit()):
            (dest / model.name / version.name).mkdir()
            for f in version.iterdir():
                (dest / model.name / version.name / f.name).symlink_to(f.resolve())
    return dest


def run_all(base_url: str, session: int, app: str, repository: Path, rounds: int = 1,
            log: Callable[[str], None] = lambda s: None, router_pad_bytes: int = 0) -> list[FaultResult]:
    """Every scenario, ``rounds`` times, one after another (each waits for the server to heal);
    ``router_pad_bytes``: ``router_kill_under_load``'s ``pad_bytes``."""
    results = []
    for r in range(rounds):
        for scenario in (lambda: damaged_model_file(base_url, repository),
                         lambda: pool_kill_mid_load(base_url, session, app),
                         lambda: router_kill_under_load(base_url, session, app, pad_bytes=router_pad_bytes,
                                                        index=True)):
            results.append(scenario())
            log(f"round {r + 1}: {json.dumps(asdict(results[-1]))}")
            wait_replicas(session, app, ("router", "pool"))
    return results


def wait_replicas(session: int, app: str, deployments: Sequence[str], timeout_s: float = 90.0) -> None:
    """Wait until each deployment has a running replica process (after a kill)."""
    deadline = time.monotonic() + timeout_s
    while any(not replica_pids(session, app, d) for d in deployments) and time.monotonic() < deadline:
        time.sleep(0.5)


def main(argv: Sequence[str]) -> int:
    import tempfile

    from bench.overload import default_app_args
    from bench.throughput import Server

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--router-pad-bytes", type=int, default=0,
                   help="spaces after each JSON body of the router kill's requests (default 0: ~400 bytes)")
    p.add_argument("--campaign", choices=("faults", "control"), default="faults",
                   help="faults: the scenarios above; control: the model control campaign (run_control) on "
                        "an application with explicit model control (CONTROL_APP_ARGS)")
    a = p.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="faults-"))
    repository = scratch_repository(scratch / "engines")
    app_args = {**default_app_args(ROOT / "serve_config.yaml"), "repository": str(repository)}
    results: list[FaultResult] = []
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    try:
        if a.campaign == "control":
            with Server("ray", repository, app_args={**app_args, **CONTROL_APP_ARGS}) as server:
                results = run_control(server.url, server.process.pid, "models", repository, a.rounds, log=log)
        else:
            # One fault at a time needs a cold model per round: the pool's count cap (2) evicts it.
            app_args["pool"] = {**app_args.get("pool", {}), "max_num_models_per_replica": 2}
            with Server("ray", repository, app_args=app_args) as server:
                results = run_all(server.url, server.process.pid, "models", repository, a.rounds, log=log,
                                  router_pad_bytes=a.router_pad_bytes)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"faults-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"command": "python -m bench.faults " + " ".join(argv),
                                "results": [asdict(r) for r in results]}, indent=2))
    for r in results:
        in_flight = f" (in flight at the kill: {r.in_flight})" if r.in_flight else ""
        print(f"{r.fault}: answers {r.answers}{in_flight}, recovered {r.recovered} after {r.recovery_s} s, "
              f"lost {r.lost}; {r.detail}; errors {r.errors}")
    print(f"wrote {path}", file=sys.stderr)
    return 0 if all(r.recovered and not r.lost for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
