"""What `make serve` runs (``python -m deployments.run``), end to end as a subprocess in its own
process group as a terminal runs it: Ray's `serve status` works against it with the command
line of `make status`, and Ctrl-C (SIGINT to the group) stops it with exit status 0 and
no "failed to shut down" warning (the requests in flight: ``bench/stop_time.py``)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import yaml

from .conftest import _free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _make_line(target: str, needle: str) -> list[str]:
    lines = subprocess.run(["make", "-n", "-s", target], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    [line] = [line for line in lines if needle in line]
    return shlex.split(line)


def _env(words: list[str]) -> dict[str, str]:
    return dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("."))


@pytest.fixture(scope="module")
def make_serve(tmp_path_factory):
    """``make serve``'s command line and environment on a two-model repository and a free port;
    yields (process, base URL, dashboard URL, output file)."""
    from deployments.check import write

    tmp = tmp_path_factory.mktemp("make_serve")
    root = tmp / "engines"
    for name in ("tiny_cnn", "mid_cnn"):
        (root / name / "1").mkdir(parents=True)
        shutil.copy(ROOT / "engines" / name / "config.yaml", root / name / "config.yaml")
        (root / name / "1" / "model.onnx").symlink_to(ROOT / "engines" / name / "1" / "model.onnx")
    port = _free_port()
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config["http_options"]["port"] = port
    config["applications"] = config["applications"][:1]  # two pool models: the pool's application only
    config["applications"][0]["args"]["repository"] = str(root)
    path = tmp / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    write(path)
    words = _make_line("serve", "-m deployments.run ")
    env = dict(os.environ, PYTHONPATH=str(ROOT), **_env(words))
    env.pop("RAY_ADDRESS", None)
    log = tmp / "out.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "deployments.run", str(path)], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            try:  # Ray's proxy refuses connections until Serve has started
                if requests.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=5).status_code == 200:
                    break
            except (requests.ConnectionError, requests.Timeout):  # or a slow first answer
                pass
            time.sleep(0.5)
        else:
            raise AssertionError(f"make serve's runner not ready: {log.read_text()[-3000:]}")
        plain = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text())  # Ray colours the address
        dashboard = re.search(r"dashboard at (?:http://)?([0-9.]+:[0-9]+)", plain).group(1)
        yield proc, f"http://127.0.0.1:{port}", f"http://{dashboard}", log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_serve_status_answers_with_make_status_environment(make_serve):
    _, _, dashboard, _ = make_serve
    words = _make_line("status", "serve status")
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    result = subprocess.run([str(ROOT / ".venv" / "bin" / "serve"), "status", "-a", dashboard], cwd=ROOT,
                            env=dict(env, **_env(words)), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    status = yaml.safe_load(result.stdout)
    assert status["applications"]["models"]["status"] == "RUNNING"


def test_ctrl_c_exits_0_without_a_warning(make_serve):
    proc, url, _, log = make_serve
    body = {"inputs": [{"name": "input", "shape": [1, 3, 224, 224], "datatype": "FP32",
                        "data": [0.5] * (3 * 224 * 224)}]}
    assert requests.post(f"{url}/v2/models/mid_cnn/infer", json=body, timeout=60).status_code == 200
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    assert proc.wait(timeout=120) == 0
    output = log.read_text()
    assert "Got KeyboardInterrupt, shutting down" in output
    assert "failed to shut down" not in output and "deploy failed" not in output, output[-3000:]
