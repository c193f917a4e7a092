"""Faults at the file boundary: a model file damaged before its load, a disk that fills during a
plan build. Each gives a clear error naming the model, and the next attempt after the cause is
gone succeeds by itself (the reliability campaign of issue 12; the live-server faults are in
tests/integration/test_campaigns.py)."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from deployments.runtime.contract.config import CacheOptions
from deployments.runtime.contract.errors import InvalidModelFile
from deployments.runtime.contract.repository import ModelRepository
from deployments.runtime.residency.cache import ModelCache

ENGINES = Path(__file__).resolve().parents[2] / "engines"


@pytest.fixture
def simple_repo(prepared_engines, tmp_path: Path) -> Path:
    """A repository with a copy of Triton's ``simple`` model (a few hundred bytes of ONNX)."""
    shutil.copytree(prepared_engines / "simple", tmp_path / "simple")
    return tmp_path


def _simple_request() -> dict[str, np.ndarray]:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    return {"INPUT0": a, "INPUT1": np.ones((1, 16), np.int32)}


@pytest.mark.parametrize("damage", ["truncated", "emptied", "garbage"])
def test_a_model_file_damaged_before_its_load_is_a_clear_error_and_loads_once_repaired(simple_repo, damage):
    model = simple_repo / "simple" / "1" / "model.onnx"
    good = model.read_bytes()
    model.write_bytes({"truncated": good[: len(good) // 2], "emptied": b"", "garbage": os.urandom(300)}[damage])
    cache = ModelCache(ModelRepository(simple_repo), ["simple"], CacheOptions(load_policy="lru")).start()
    try:
        with pytest.raises(InvalidModelFile) as raised:  # 400: the content of whoever put it there
            cache.infer("simple", _simple_request())
        message = raised.value.message
        assert message.startswith("model 'simple': its model file simple/1/model.onnx is ")
        assert "not a valid ONNX model" in message or "is empty" in message, message
        assert str(simple_repo) not in message and "Traceback" not in message  # no path or internals to clients
        assert cache.status()["models"]["simple"]["state"] == "absent"  # nothing half-loaded stays
        model.write_bytes(good)  # repaired: the next request loads it, no restart
        out = cache.infer("simple", _simple_request())
        np.testing.assert_array_equal(out["OUTPUT0"], np.arange(16).reshape(1, 16) + 1)
    finally:
        cache.close()


# --- the plan directory's disk fills during a build -----------------------------------------

build = pytest.importorskip("deployments.runtime.tools.build")
pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed (pip install -e '.[tensorrt]')")


@pytest.fixture
def two_models(tmp_path: Path) -> Path:
    from tests.unit.test_build import conv_model, write_config

    for i, name in enumerate(("first", "second")):
        write_config(tmp_path / name)
        conv_model(tmp_path / name / "1" / "model.onnx", seed=i)
    return tmp_path


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*") if p.is_file() and p.suffix != ".onnx" and p.name != "config.yaml"
                  and ".timing" not in p.name)


@pytest.mark.parametrize("fails", ["plan", "manifest"])
def test_a_disk_that_fills_during_a_build_fails_that_model_clearly_and_the_next_build_recovers(
        two_models, monkeypatch, fails):
    """ENOSPC injected at the write boundary (``write_atomic``, which every plan, manifest and
    timing-cache write goes through): the model whose write fails is reported failed with a
    one-line reason naming the folder, no partial file and no plan without its manifest stays,
    the other model builds, and the next build after "freeing space" builds the failed one."""
    from deployments.runtime.contract import files

    real_write = files.write_atomic
    full = {"on": True}

    def write_atomic(path, data):
        path = Path(path)
        hit = path.suffix == (".plan" if fails == "plan" else ".json") and path.parent.parent.name == "first"
        if full["on"] and hit:
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_bytes(b"partial")  # what a full disk leaves: part of the file, then ENOSPC
            tmp.unlink()  # write_atomic's own clean-up of its temporary file
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))
        return real_write(path, data)

    for module in (build, build.__dict__.get("plans")):
        if module is not None and hasattr(module, "write_atomic"):
            monkeypatch.setattr(module, "write_atomic", write_atomic)
    from deployments.runtime.backends import plans

    monkeypatch.setattr(plans, "write_atomic", write_atomic)
    results = {r.model: r for r in build.build_all(two_models, flavour="tensorrt_rtx")}
    assert results["second"].status == "built"
    assert results["first"].status == "failed"
    message = results["first"].error.message
    assert message == (f"model 'first': No space left on device while writing into {two_models / 'first' / '1'} "
                       "(the plan, its manifest or the timing cache); nothing partial was kept: free space there "
                       "and run `make engines` again")
    assert _leftovers(two_models / "first") == []  # no partial file, no plan without its manifest
    full["on"] = False
    again = {r.model: r for r in build.build_all(two_models, flavour="tensorrt_rtx")}
    assert again["first"].status == "built" and again["second"].status == "fresh"


def _mount_tmpfs(folder: Path, size: str) -> bool:
    folder.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                          capture_output=True).returncode == 0


def test_a_real_full_file_system_under_the_plan_folder_fails_the_build_clearly(tmp_path):
    """The same on a real, size-limited file system: a 64 KiB tmpfs (needs mount rights, e.g.
    root in a container; skipped elsewhere) holds the model's ONNX file but not its plan."""
    from tests.unit.test_build import conv_model, write_config

    root = tmp_path / "repo"
    if not _mount_tmpfs(root, "64k"):
        pytest.skip("cannot mount a tmpfs here (needs CAP_SYS_ADMIN); the injected ENOSPC test covers it")
    try:
        write_config(root / "small")
        conv_model(root / "small" / "1" / "model.onnx")
        result = build.build_all(root, flavour="tensorrt_rtx")[0]
        assert result.status == "failed", result
        assert result.error.message.startswith("model 'small': No space left on device while writing into ")
        assert _leftovers(root) == []
    finally:
        subprocess.run(["umount", str(root)], check=False)


# --- text a graph parses as a number (found by bench/fuzz.py: 500 for a client's mistake) ----

@pytest.mark.parametrize("text,ok", [("12", True), (" 7", True), ("-5", True), ("+3", True), ("1.5", True),
                                     ("0x10", True), ("2147483647", True), ("-2147483648", True),
                                     ("2147483648", False), ("3000000000", False), ("-2147483649", False),
                                     ("9223372036854775807", False), ("x", False), ("", False),
                                     ("99999999999999999999", False), ("\u0663", False), ("- 1", False)])
def test_text_the_graph_casts_to_an_integer_is_checked_as_onnxruntime_parses_it(prepared_engines, text, ok):
    """``simple_string`` casts its string inputs to INT32: text ONNX Runtime's Cast cannot parse
    is a 400 naming input, element and text, not the run's RuntimeException (a 500); text it
    parses runs as before (the same rule: ``std::stoll``), unless its value is outside INT32, into
    which ONNX Runtime would wrap it ("3000000000" answered -1294967295)."""
    from deployments.runtime.contract.errors import InvalidInput
    from deployments.runtime.residency.host import ModelHost

    host = ModelHost(ModelRepository(prepared_engines).get("simple_string"), backend="onnxruntime").load()
    try:
        a = np.array([["1"] * 15 + [text]], dtype=object)
        b = np.array([["1"] * 16], dtype=object)
        if ok:
            out = host.infer({"INPUT0": a, "INPUT1": b})
            assert out["OUTPUT0"].shape == (1, 16)
        else:
            with pytest.raises(InvalidInput) as raised:
                host.infer({"INPUT0": a, "INPUT1": b})
            assert raised.value.message == (
                f"model 'simple_string' input 'INPUT0': element 15 is {text!r}, but the model reads it as a "
                "number (INT32): expected a decimal integer from -2147483648 to 2147483647")
    finally:
        host.unload()
