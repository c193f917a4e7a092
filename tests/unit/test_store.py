"""The model repository in an object store (``runtime.contract.store``, ``node_cache``), read
from a real S3 server (SeaweedFS, ``tests/seaweed.py``) with no Ray: the same entries as the
same files in ``engines/``, one download per node shared by its processes, checked and atomic
downloads, the cache's byte bound and pins, and the store's faults (stopped, slow, truncated,
deleted, keys escaping the prefix), none of whose errors carries the credentials."""

from __future__ import annotations

import json
import multiprocessing
import shutil
import uuid
from pathlib import Path

import numpy as np
import pytest

from deployments.runtime.contract.errors import ConfigError, InvalidModelFile, LoadFault, OverBudget, StoreUnavailable
from deployments.runtime.contract.repository import ModelRepository
from deployments.runtime.contract.store import StoreOptions, safe_relative
from deployments.runtime.residency.host import ModelHost

from ..seaweed import DelayProxy


@pytest.fixture
def store_env(seaweedfs, monkeypatch, tmp_path):
    """The standard AWS environment of ``seaweedfs`` and a fresh cache folder; a fresh prefix
    (``prefix``) per test. Returns (prefix URL, cache folder)."""
    for key, value in seaweedfs.env.items():
        monkeypatch.setenv(key, value)
    cache = tmp_path / "cache"
    monkeypatch.setenv("TRT_SERVE_CACHE_DIR", str(cache))
    monkeypatch.setenv("TRT_SERVE_STORE_ATTEMPTS", "2")
    monkeypatch.setenv("TRT_SERVE_STORE_TIMEOUT_S", "2")
    prefix = f"t{uuid.uuid4().hex[:8]}"
    return f"s3://{seaweedfs.bucket}/{prefix}", prefix, cache


def _stats(cache: Path, node: str) -> dict:
    return json.loads((cache / node / "stats.json").read_text())


def _leaks(text: str, seaweedfs) -> bool:
    return seaweedfs.key_id in text or seaweedfs.secret in text


def test_a_remote_repository_reads_the_same_entries_as_the_same_files_on_disk(seaweedfs, store_env, prepared_engines):
    url, prefix, cache = store_env
    for name in ("tiny_cnn", "simple"):
        seaweedfs.upload(prepared_engines / name, f"{prefix}/{name}")
    remote = ModelRepository(url, node="n1")
    local = ModelRepository(prepared_engines, ["tiny_cnn", "simple"])
    assert remote.names() == ["simple", "tiny_cnn"]
    for name in remote.names():
        assert remote.get(name).config == local.get(name).config  # the same config, completed from the same files
        version = remote.get(name).latest  # each reading records its file's identity: the store's ETag, the disk's time
        assert remote.get(name).file_identity(version).startswith("etag:")
        assert local.get(name).file_identity(version).startswith("sha256:")
        assert remote.get(name).served == local.get(name).served
        assert remote.get(name).onnx_path().read_bytes() == local.get(name).onnx_path().read_bytes()
        assert cache / "n1" in remote.get(name).path.parents
    assert _stats(cache, "n1")["downloads"] == 2


def test_each_node_downloads_a_version_once_and_reads_it_from_its_cache_after(seaweedfs, store_env, prepared_engines):
    url, prefix, cache = store_env
    seaweedfs.upload(prepared_engines / "tiny_cnn", f"{prefix}/tiny_cnn")
    size = (prepared_engines / "tiny_cnn/1/model.onnx").stat().st_size
    for _ in range(3):  # six reads: the index's, then a peek's
        ModelRepository(url, node="n1").peek("tiny_cnn")
    ModelRepository(url, node="n2").peek("tiny_cnn")
    assert _stats(cache, "n1") == {"downloads": 1, "download_bytes": size, "hits": 5}
    assert _stats(cache, "n2")["downloads"] == 1
    status = ModelRepository(url, node="n1").store.status()
    assert [(n["node"], [(e["model"], e["version"]) for e in n["entries"]]) for n in status["nodes"]] == [
        ("n1", [("tiny_cnn", 1)]), ("n2", [("tiny_cnn", 1)])]


def _peek_in_process(url: str, env: dict, barrier) -> str:
    import os

    os.environ.update(env)
    barrier.wait()
    return ModelRepository(url, ["tiny_cnn"], node="n1", keep_files=True).get("tiny_cnn").digest


def test_processes_reading_one_model_at_once_download_it_once(seaweedfs, store_env, prepared_engines):
    url, prefix, cache = store_env
    seaweedfs.upload(prepared_engines / "tiny_cnn", f"{prefix}/tiny_cnn")
    env = {**seaweedfs.env, "TRT_SERVE_CACHE_DIR": str(cache)}
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        barrier = manager.Barrier(4)
        with context.Pool(4) as pool:
            digests = pool.starmap(_peek_in_process, [(url, env, barrier)] * 4)
    assert len(set(digests)) == 1
    stats = _stats(cache, "n1")
    assert (stats["downloads"], stats["hits"]) == (1, 3)


def test_a_new_version_uploaded_is_read_by_the_next_peek_under_its_own_number(seaweedfs, store_env, prepared_engines):
    url, prefix, cache = store_env
    seaweedfs.upload(prepared_engines / "tiny_cnn", f"{prefix}/tiny_cnn")
    repo = ModelRepository(url, node="n1", keep_files=True)
    assert repo.get("tiny_cnn").served == (1,)
    seaweedfs.upload(prepared_engines / "tiny_cnn/1", f"{prefix}/tiny_cnn/2")
    entry = repo.peek("tiny_cnn")
    assert (entry.versions, entry.served) == ((1, 2), (2,))
    assert entry.onnx_path().is_file() and entry.onnx_path().parent.name == "2"
    repo.take(entry)  # version 1 is no longer served here: unpinned
    assert repo.store.cache.pinned() == [("tiny_cnn", 2)]


def test_the_cache_bound_evicts_unpinned_versions_and_refuses_one_that_does_not_fit(seaweedfs, store_env,
                                                                                     prepared_engines, monkeypatch):
    url, prefix, cache = store_env
    for name in ("tiny_cnn", "ocr_cls"):
        seaweedfs.upload(prepared_engines / name, f"{prefix}/{name}")
    tiny = (prepared_engines / "tiny_cnn/1/model.onnx").stat().st_size
    cls = (prepared_engines / "ocr_cls/1/model.onnx").stat().st_size
    monkeypatch.setenv("TRT_SERVE_CACHE_MAX_BYTES", str(max(tiny, cls) + min(tiny, cls) // 2))
    holder = ModelRepository(url, ["tiny_cnn"], node="n1", keep_files=True)  # a replica serving tiny_cnn
    with pytest.raises(OverBudget) as refused:
        ModelRepository(url, ["ocr_cls"], node="n1", keep_files=True)
    assert "model 'ocr_cls' version 1" in refused.value.message and "TRT_SERVE_CACHE_MAX_BYTES" in refused.value.message
    assert (cache / "n1").glob("*/tiny_cnn/1/model.onnx")  # the pinned version stayed
    assert len(list((cache / "n1").glob("*/tiny_cnn/1/model.onnx"))) == 1
    holder.release("tiny_cnn")  # the replica unloaded it
    ModelRepository(url, ["ocr_cls"], node="n1", keep_files=True)
    assert list((cache / "n1").glob("*/tiny_cnn/1")) == []
    assert len(list((cache / "n1").glob("*/ocr_cls/1/model.onnx"))) == 1
    assert _stats(cache, "n1")["evictions"] == 1


def test_a_stopped_store_fails_after_bounded_tries_naming_model_and_store_not_credentials(seaweedfs, store_env,
                                                                                          prepared_engines, monkeypatch):
    url, prefix, cache = store_env
    seaweedfs.upload(prepared_engines / "tiny_cnn", f"{prefix}/tiny_cnn")
    proxy = DelayProxy(("127.0.0.1", seaweedfs.port))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    repo = ModelRepository(url, node="n1")
    proxy.close()  # the store is gone
    with pytest.raises(StoreUnavailable) as gone:
        repo.peek("tiny_cnn")
    message = gone.value.message
    assert message.startswith("model 'tiny_cnn': the model store " + url) and proxy.endpoint in message
    assert "did not answer in 2 tries" in message and not _leaks(message, seaweedfs)
    assert repo.get("tiny_cnn").onnx_path().is_file()  # what was read keeps serving


def test_a_slow_store_fails_the_listing_of_the_index_too(seaweedfs, store_env, prepared_engines, monkeypatch):
    url, prefix, cache = store_env
    seaweedfs.upload(prepared_engines / "tiny_cnn", f"{prefix}/tiny_cnn")
    proxy = DelayProxy(("127.0.0.1", seaweedfs.port))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    repo = ModelRepository(url, node="n1")
    proxy.set(delay_s=4.0)
    with pytest.raises(StoreUnavailable, match="^the repository's models: the model store"):
        repo.folders()  # not an empty repository
    with pytest.raises(StoreUnavailable, match="^model 'tiny_cnn': the model store"):
        repo.peek("tiny_cnn")  # not "no model folder 'tiny_cnn'"
    proxy.close()


def test_a_slow_store_fails_after_the_timeout_per_try(seaweedfs, store_env, prepared_engines, monkeypatch):
    url, prefix, cache = store_env
    seaweedfs.upload(prepared_engines / "tiny_cnn", f"{prefix}/tiny_cnn")
    proxy = DelayProxy(("127.0.0.1", seaweedfs.port))
    proxy.set(delay_s=4.0)  # over TRT_SERVE_STORE_TIMEOUT_S (2 s)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    with pytest.raises(StoreUnavailable) as slow:
        ModelRepository(url, node="n1")
    assert "ReadTimeout" in slow.value.message and not _leaks(slow.value.message, seaweedfs)
    assert proxy.connections == 2  # TRT_SERVE_STORE_ATTEMPTS
    proxy.close()


def test_a_download_cut_short_is_refused_and_never_seen_in_the_cache(seaweedfs, store_env, prepared_engines,
                                                                      monkeypatch):
    url, prefix, cache = store_env
    seaweedfs.upload(prepared_engines / "tiny_cnn", f"{prefix}/tiny_cnn")
    proxy = DelayProxy(("127.0.0.1", seaweedfs.port))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    repo = ModelRepository(url, node="n1")
    shutil.rmtree(next((cache / "n1").glob("*/tiny_cnn/1")))
    proxy.set(cut_after=100_000)  # the answer to the download stops part way
    with pytest.raises((LoadFault, StoreUnavailable)):
        repo.peek("tiny_cnn")
    proxy.close()
    assert list((cache / "n1").glob("*/tiny_cnn/1")) == []
    assert list((cache / "n1").glob("*/tiny_cnn/.1.*.tmp")) == []


def test_a_truncated_object_fails_the_read_and_changes_nothing(seaweedfs, store_env, prepared_engines):
    url, prefix, cache = store_env
    seaweedfs.upload(prepared_engines / "tiny_cnn", f"{prefix}/tiny_cnn")
    repo = ModelRepository(url, node="n1")
    before = repo.get("tiny_cnn")
    data = (prepared_engines / "tiny_cnn/1/model.onnx").read_bytes()
    seaweedfs.filesystem().pipe(f"{seaweedfs.bucket}/{prefix}/tiny_cnn/2/model.onnx", data[:len(data) // 2])
    entry = repo.peek("tiny_cnn")  # what a load reads: version 2, whole as the store has it
    assert entry.served == (2,) and entry.onnx_path().stat().st_size == len(data) // 2
    with pytest.raises(InvalidModelFile) as bad:  # the user's content: a 400, as from a local folder
        ModelHost(entry, "onnxruntime").load()
    assert bad.value.message.startswith("model 'tiny_cnn': its model file tiny_cnn/2/model.onnx is not a valid ONNX model")
    assert repo.get("tiny_cnn") == before


def test_an_object_deleted_after_the_listing_fails_the_fetch(seaweedfs, store_env, prepared_engines):
    url, prefix, cache = store_env
    seaweedfs.upload(prepared_engines / "tiny_cnn", f"{prefix}/tiny_cnn")
    repo = ModelRepository(url, node="n1")
    seaweedfs.upload(prepared_engines / "tiny_cnn/1", f"{prefix}/tiny_cnn/2")
    listing = repo.store.listing("tiny_cnn")
    seaweedfs.filesystem().rm(f"{seaweedfs.bucket}/{prefix}/tiny_cnn/2/model.onnx")
    with pytest.raises(LoadFault) as gone:
        repo.store.fetch(listing, [2])
    assert gone.value.message == f"model 'tiny_cnn': 2/model.onnx is gone from the model store {repo.store.where}"
    assert list((cache / "n1").glob("*/tiny_cnn/2")) == []


def test_an_object_replaced_after_the_listing_fails_the_fetch(seaweedfs, store_env, prepared_engines):
    url, prefix, cache = store_env
    seaweedfs.upload(prepared_engines / "tiny_cnn", f"{prefix}/tiny_cnn")
    repo = ModelRepository(url, node="n1")
    seaweedfs.upload(prepared_engines / "tiny_cnn/1", f"{prefix}/tiny_cnn/2")
    listing = repo.store.listing("tiny_cnn")
    seaweedfs.filesystem().pipe(f"{seaweedfs.bucket}/{prefix}/tiny_cnn/2/model.onnx", b"x" * 10)
    with pytest.raises(LoadFault, match="changed in the model store since it was listed"):
        repo.store.fetch(listing, [2])
    assert list((cache / "n1").glob("*/tiny_cnn/2")) == []


@pytest.mark.parametrize("key", ["../x", "a/../../x", "/etc/passwd", "a//b", "./a", "a\\..\\b"])
def test_a_key_that_would_escape_the_prefix_is_refused(key):
    with pytest.raises(ConfigError, match="would escape the model's folder"):
        safe_relative(key, "model 'm'")


def test_a_store_url_with_credentials_or_an_unknown_scheme_is_refused(store_env):
    with pytest.raises(ConfigError, match="carries no credentials"):
        ModelRepository("s3://key:secret@models/x")
    with pytest.raises(ConfigError, match="scheme 'gs' is not supported"):
        ModelRepository("gs://models/x")


def test_store_options_come_from_the_environment():
    options = StoreOptions.from_env({"TRT_SERVE_CACHE_DIR": "/c", "TRT_SERVE_CACHE_MAX_BYTES": "1e9",
                                     "TRT_SERVE_STORE_ATTEMPTS": "5", "TRT_SERVE_STORE_TIMEOUT_S": "2.5"})
    assert options == StoreOptions(Path("/c"), 1_000_000_000, 5, 2.5)
    with pytest.raises(ConfigError, match="TRT_SERVE_CACHE_MAX_BYTES"):
        StoreOptions.from_env({"TRT_SERVE_CACHE_MAX_BYTES": "lots"})


def test_outputs_from_the_cached_copy_equal_those_from_engines(seaweedfs, store_env, prepared_engines):
    import onnxruntime as ort

    url, prefix, cache = store_env
    seaweedfs.upload(prepared_engines / "tiny_cnn", f"{prefix}/tiny_cnn")
    remote = ModelRepository(url, node="n1").get("tiny_cnn")
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
    outputs = []
    for path in (remote.onnx_path(), prepared_engines / "tiny_cnn/1/model.onnx"):
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        outputs.append(session.run(None, {session.get_inputs()[0].name: x})[0])
    np.testing.assert_array_equal(outputs[0], outputs[1])
