"""Two servers on one host (two ``make serve`` runners, two Ray clusters), each serving a
dedicated model named ``cnn``: A's from tiny_cnn's file, B's from mid_cnn's. A's HAProxy is
pointed at B's replica port (its admin socket's ``set server addr``, as a stale server entry or
a port B's replica took between Ray's choice and A's bind leaves it): A's client gets a clear
421 naming why, never B's answer under a 200 (``routes.ClusterGuard``, ``haproxy.mark_cluster``)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import requests
import yaml

from bench.autoscale import start_runner
from bench.replicas import interrupt_group, session_processes
from deployments.haproxy import admin_command

from .conftest import REPOSITORY, runner_config

pytestmark = pytest.mark.integration

X = np.random.default_rng(11).random((1, 3, 224, 224), dtype=np.float32)
BODY = {"inputs": [{"name": "input", "shape": [1, 3, 224, 224], "datatype": "FP32", "data": X.ravel().tolist()}]}
BACKEND = "http-models.cnn"  # Ray's backend of application models.cnn (the dedicated model)


def _server(tmp: Path, source: str):
    """Start a runner serving ``cnn`` (``source``'s model file, dedicated); (process, URL, log)."""
    root = tmp / "engines"
    (root / "cnn" / "1").mkdir(parents=True)
    (root / "cnn" / "1" / "model.onnx").symlink_to(f"{REPOSITORY}/{source}/1/model.onnx")
    raw = yaml.safe_load(Path(f"{REPOSITORY}/{source}/config.yaml").read_text())
    raw["deployment"] = {"mode": "dedicated"}
    (root / "cnn" / "config.yaml").write_text(yaml.safe_dump(raw))
    path, port = runner_config(tmp, repository=str(root), request_timeout_s=30)
    log = tmp / "out.log"
    return start_runner(path, log), f"http://127.0.0.1:{port}", log


def _ready(servers) -> None:
    deadline = time.monotonic() + 300
    pending = list(servers)
    while pending:
        proc, url, log = pending[0]
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        try:
            if requests.get(f"{url}/v2/models/cnn/ready", timeout=5).status_code == 200:
                pending.pop(0)
                continue
        except (requests.ConnectionError, requests.Timeout):
            pass
        time.sleep(0.5)


def _haproxy_config(proc) -> str:
    """The config file the runner's HAProxy runs (``haproxy -db -f <config>``)."""
    for p in session_processes(proc.pid):
        match = re.search(r"haproxy\s.*-f\s+(\S+haproxy\.cfg)", p.title)
        if match:
            return Path(match[1]).read_text()
    raise AssertionError("no HAProxy process in the runner's session")


def _servers(config: str, backend: str) -> dict[str, tuple[str, int]]:
    """``backend``'s non-backup servers in ``config``: name -> (host, port)."""
    section = config.split(f"backend {backend}\n")[1].split("\nbackend ")[0]
    return {m[1]: (m[2], int(m[3])) for m in re.finditer(r"^\s+server\s+(\S+)\s+([\d.]+):(\d+)(.*)$", section, re.M)
            if "backup" not in m[4].split()}


def _admin(config: str, command: str) -> str:
    return admin_command(re.search(r"stats socket (\S+)", config)[1], command + "\n", timeout_s=5)


def _logits(source: str) -> np.ndarray:
    return ort.InferenceSession(f"{REPOSITORY}/{source}/1/model.onnx").run(None, {"input": X})[0]


def test_a_request_haproxy_sends_to_another_servers_replica_is_refused_421_never_answered_with_its_model(tmp_path):
    a = _server(tmp_path / "a", "tiny_cnn")
    b = _server(tmp_path / "b", "mid_cnn")
    try:
        _ready([a, b])
        (_, a_url, _), (_, b_url, _) = a, b
        for url, source in ((a_url, "tiny_cnn"), (b_url, "mid_cnn")):  # each answers with its own model
            r = requests.post(f"{url}/v2/models/cnn/infer", json=BODY, timeout=60)
            assert r.status_code == 200, r.text
            np.testing.assert_allclose(r.json()["outputs"][0]["data"], _logits(source).ravel(), rtol=1e-4, atol=1e-5)
        deadline = time.monotonic() + 60  # B's replica, as B's HAProxy lists it (none while Ray renders it anew)
        while len(b_servers := _servers(_haproxy_config(b[0]), BACKEND)) != 1:
            assert time.monotonic() < deadline, f"B's HAProxy lists {b_servers} for cnn"
            time.sleep(0.5)
        [(b_host, b_port)] = b_servers.values()
        refused = rounds = 0
        while refused < 3 and rounds < 20:  # Ray may render and reload A's HAProxy meanwhile: point it at B again
            rounds += 1
            a_config = _haproxy_config(a[0])
            answers = [_admin(a_config, f"set server {BACKEND}/{name} addr {b_host} port {b_port}")
                       for name in _servers(a_config, BACKEND)]  # A's HAProxy now lists B's replica port for cnn
            if any(answer.startswith("No such server.") for answer in answers):  # the file is newer than the running
                time.sleep(0.5)  # HAProxy (Ray mid-reload): read it again
                continue
            for changed in answers:
                assert f"to '{b_port}'" in changed or "no need to change the port" in changed, changed
            r = requests.post(f"{a_url}/v2/models/cnn/infer", json=BODY, timeout=60)
            if r.status_code == 200:  # a reload put A's own replica back: A's model, never B's
                np.testing.assert_allclose(r.json()["outputs"][0]["data"], _logits("tiny_cnn").ravel(),
                                           rtol=1e-4, atol=1e-5)
                continue
            assert r.status_code == 421, r.text[:300]
            assert "this replica belongs to another Ray cluster" in r.json()["error"]
            assert "stale or shared port" in r.json()["error"]
            refused += 1
        assert refused == 3, f"A's HAProxy reached B's replica {refused} times in {rounds} rounds"
        r = requests.post(f"{b_url}/v2/models/cnn/infer", json=BODY, timeout=60)  # B serves on
        assert r.status_code == 200
        np.testing.assert_allclose(r.json()["outputs"][0]["data"], _logits("mid_cnn").ravel(), rtol=1e-4, atol=1e-5)
    finally:
        for proc, _, _ in (a, b):
            interrupt_group(proc)
