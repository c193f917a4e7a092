"""The Python the project claims is the Python its code needs, and an older one is refused with
one line: at import of the package (``serve run`` bypasses make) and by the Makefile."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import deployments

ROOT = Path(__file__).resolve().parents[2]
OLD = (3, 10, 12, "final", 0)  # Ubuntu 22.04's python3
REFUSAL = (r"^trt-serve needs Python 3\.11 or newer; this is Python 3\.10\.12 \(.*\)\. With make: "
           r"make serve PYTHON=python3\.11 \(after `make clean` if \.venv exists\)$")


def claimed_minimum() -> tuple[int, int]:
    """(major, minor) of pyproject.toml's ``requires-python = ">=X.Y"``."""
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    found = re.fullmatch(r">=\s*(\d+)\.(\d+)", spec.strip())
    assert found, f"requires-python {spec!r} is not of the form '>=X.Y'"
    return int(found[1]), int(found[2])


def test_the_package_and_pyproject_claim_the_same_minimum_python():
    assert deployments.MIN_PYTHON == claimed_minimum()


def test_the_code_needs_no_newer_python_than_pyproject_claims():
    """vermin reads the code for the standard library and syntax it uses (``asyncio.timeout`` is
    3.11): every use newer than requires-python is a violation, listed in the message."""
    major, minor = claimed_minimum()
    vermin = Path(sys.executable).with_name("vermin")  # the test extra's console script
    run = subprocess.run([str(vermin), f"-t={major}.{minor}-", "--violations", "--no-tips", "--eval-annotations",
                          "deployments", "bench"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr


def _import_as_old_python(code: str = "import deployments") -> subprocess.CompletedProcess:
    fake = f"import sys; sys.version_info = {OLD!r}; {code}"
    return subprocess.run([sys.executable, "-c", fake], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_importing_the_package_on_an_older_python_exits_with_one_line():
    run = _import_as_old_python()
    assert run.returncode == 1
    assert re.fullmatch(REFUSAL, run.stderr.strip()), run.stderr
    assert run.stderr.count("\n") == 1  # one line, no traceback


def test_importing_a_deployment_module_on_an_older_python_is_refused_the_same_way():
    """``serve run deployments.app:...`` imports a submodule: the package's check runs first."""
    run = _import_as_old_python("import deployments.app")
    assert run.returncode == 1
    assert re.fullmatch(REFUSAL, run.stderr.strip()), run.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_make_refuses_an_older_python_before_making_a_virtual_environment(tmp_path):
    """``make test`` with ``PYTHON`` an interpreter that says it is 3.10: one line, exit 2, no
    ``.venv`` made."""
    python = tmp_path / "python3.10"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} -c \"import sys; sys.version_info = {OLD!r}; "
                      "import deployments\"\n")
    python.chmod(0o755)
    venv = tmp_path / "venv"
    run = subprocess.run(["make", "--no-print-directory", "test", f"PYTHON={python}", f"VENV={venv}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert re.search(REFUSAL.strip("^$"), run.stderr), run.stderr
    assert not venv.exists()
