"""Ray's own CLI against a running cluster with token authentication (what `serve run` starts):
refused without RAY_AUTH_MODE, answered with the Makefile's `make status` command line."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_ray_status_needs_the_auth_mode_make_status_sets(serve_instance):
    import ray

    if os.environ.get("RAY_AUTH_MODE") != "token":
        pytest.skip("this Ray cluster runs without token authentication")
    address = ray.get_runtime_context().gcs_address
    [line] = [line for line in subprocess.run(["make", "-n", "-s", "status"], cwd=ROOT, capture_output=True,
                                              text=True, check=True).stdout.splitlines() if "ray status" in line]
    *assignments, binary, command = shlex.split(line)
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    bare = subprocess.run([str(ROOT / binary), command, "--address", address], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert bare.returncode != 0 and "AuthenticationError" in bare.stdout + bare.stderr
    wired = subprocess.run([str(ROOT / binary), command, "--address", address], cwd=ROOT, timeout=120,
                           env=dict(env, **dict(a.split("=", 1) for a in assignments)), capture_output=True, text=True)
    assert wired.returncode == 0, wired.stderr
    assert "Resources" in wired.stdout
