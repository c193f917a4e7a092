"""ONNX Runtime's CUDA execution provider end to end (``backend: onnxruntime_cuda``) on the real
models: outputs against the CPU provider within ``TOLERANCE``, contexts running concurrently,
a request at the profile max, the footprint in GPU bytes, and eviction returning GPU memory.

Skipped, with the reason, where the provider cannot run (the CPU ``onnxruntime`` build, no
visible CUDA device, no cuda-python). On the H200 machine: ``onnxruntime-gpu`` carried there
(docs/h200.md, "onnxruntime-gpu in chunks").
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnxruntime as ort
import pytest

from deployments.runtime.backends import onnxruntime_cuda
from deployments.runtime.backends import gpu_memory
from deployments.runtime.backends.gpu_memory import process_gpu_bytes
from deployments.runtime.backends.select import choose_backend
from deployments.runtime.contract.config import CacheOptions, Warmup
from deployments.runtime.contract.errors import DeviceOutOfMemory
from deployments.runtime.contract.shapes import max_profile_shapes
from deployments.runtime.residency import footprints
from deployments.runtime.residency.cache import ModelCache
from deployments.runtime.residency.host import ModelHost

REASON = onnxruntime_cuda.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"ONNX Runtime CUDA cannot run here: {REASON}")
MB = 1_000_000


def with_cuda_options(entry, **options):
    """``entry`` with its config's ``onnxruntime_cuda`` section changed."""
    config = entry.config.model_copy(update={"onnxruntime_cuda": entry.config.onnxruntime_cuda.model_copy(update=options)})
    return dataclasses.replace(entry, config=config)


def cpu_reference(entry, feeds):
    session = ort.InferenceSession(str(entry.onnx_path()), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def assert_close(got, want, tolerance):
    """|got - want| <= tolerance * max(1, |want|), elementwise (``TOLERANCE``'s definition)."""
    for name, expected in want.items():
        assert got[name].shape == expected.shape, name
        excess = np.abs(got[name] - expected) - tolerance * np.maximum(1.0, np.abs(expected))
        assert excess.max() <= 0, f"{name}: max |diff| {np.abs(got[name] - expected).max():.3g}"


def feeds_for(entry, rng, batch=None, **overrides):
    shapes = max_profile_shapes(entry.config, batch)
    shapes.update(overrides)
    return {n: rng.random(s, dtype=np.float32) for n, s in shapes.items()}


def test_auto_picks_the_cuda_provider_and_says_why():
    choice = choose_backend("auto")
    assert choice.backend == "onnxruntime_cuda", choice
    assert "CUDAExecutionProvider" in choice.reason and "compute capability" in choice.reason


# (model, input shapes at a typical size): CNNs at batch 4, OCR at the shapes the pipeline sends
CASES = [
    ("tiny_cnn", {"input": (4, 3, 224, 224)}),
    ("resnet18", {"input": (4, 3, 224, 224)}),
    ("ocr_cls", {"x": (6, 3, 48, 192)}),
    ("ocr_rec", {"x": (6, 3, 48, 320)}),
    ("ocr_det", {"x": (1, 3, 736, 736)}),
]


@pytest.mark.parametrize("tf32", [True, False], ids=["tf32", "fp32"])
@pytest.mark.parametrize("name,shapes", CASES, ids=[c[0] for c in CASES])
def test_outputs_match_the_cpu_provider_within_tolerance(model_repository, name, shapes, tf32):
    entry = with_cuda_options(model_repository.get(name), use_tf32=tf32)
    rng = np.random.default_rng(0)
    feeds = {n: rng.random(s, dtype=np.float32) for n, s in shapes.items()}
    host = ModelHost(entry, "onnxruntime_cuda").load()
    try:
        assert host.backend == "onnxruntime_cuda"
        got = host.infer(feeds)
        assert_close(got, cpu_reference(entry, feeds), onnxruntime_cuda.TOLERANCE[tf32])
        diff = max(float(np.abs(got[k] - v).max()) for k, v in cpu_reference(entry, feeds).items())
        print(f"{name} tf32={tf32}: max |GPU - CPU| = {diff:.3g}")
    finally:
        host.unload()


@pytest.mark.parametrize("name", ["resnet18", "ocr_rec", "ocr_det"])
def test_a_request_at_the_profile_max_runs_and_matches(model_repository, name):
    entry = with_cuda_options(model_repository.get(name), use_tf32=False)
    feeds = feeds_for(entry, np.random.default_rng(1))
    host = ModelHost(entry, "onnxruntime_cuda").load()
    try:
        assert_close(host.infer(feeds), cpu_reference(entry, feeds), onnxruntime_cuda.TOLERANCE[False])
    finally:
        host.unload()


def test_contexts_run_concurrently_and_each_request_gets_its_own_rows(model_repository):
    entry = with_cuda_options(model_repository.get("resnet18"), use_tf32=False)
    entry = dataclasses.replace(entry, config=entry.config.model_copy(update={"instances": 4}))
    rng = np.random.default_rng(2)
    xs = [rng.random((b, 3, 224, 224), dtype=np.float32) for b in (1, 3, 8, 32, 2, 5, 16, 1) * 2]
    host = ModelHost(entry, "onnxruntime_cuda").load()
    try:
        contexts = host._contexts
        assert len({c.stream.handle for c in contexts}) == 4  # one stream per context
        allocations = [[b.allocations for b in c._inputs.values()] for c in contexts]
        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda x: host.infer({"input": x})["logits"], xs))
        reference = ort.InferenceSession(str(entry.onnx_path()), providers=["CPUExecutionProvider"])
        for x, out in zip(xs, outs):
            want = reference.run(None, {"input": x})[0]
            np.testing.assert_allclose(out, want, atol=onnxruntime_cuda.TOLERANCE[False], rtol=1e-3)
        # the max-profile buffers were never reallocated by smaller or equal requests
        assert [[b.allocations for b in c._inputs.values()] for c in contexts] == allocations
    finally:
        host.unload()


def test_footprint_is_gpu_bytes_and_unload_returns_them(model_repository):
    entry = model_repository.get("resnet18")
    onnxruntime_cuda.prime()
    before = process_gpu_bytes()
    host = ModelHost(entry, "onnxruntime_cuda").load()
    loaded = process_gpu_bytes()
    footprint = host.footprint()
    print(f"resnet18 x{entry.config.instances}: before {before}, loaded {loaded}, footprint {footprint}")
    assert footprint.device == "gpu" and footprint.context_bytes > 10 * MB  # weights alone: 47 MB
    host.check_health()  # the device probe passes on a healthy GPU
    grown = loaded.bytes - before.bytes  # the footprint bounds it (each context's max growth x instances)
    assert 0.5 * footprint.total(entry.config.instances) <= grown <= footprint.total(entry.config.instances) + 32 * MB
    host.unload()
    after = process_gpu_bytes()
    print(f"after unload: {after}")
    assert after.bytes - before.bytes <= max(32 * MB, 0.1 * grown), (before, loaded, after)


def test_a_profile_over_the_arena_cap_fails_at_load_naming_the_cap(model_repository):
    entry = with_cuda_options(model_repository.get("resnet18"), gpu_mem_limit_mib=20)
    with pytest.raises(DeviceOutOfMemory, match="gpu_mem_limit_mib 20"):  # capacity: 503
        ModelHost(entry, "onnxruntime_cuda").load()


def test_cache_eviction_frees_gpu_memory_and_stays_in_budget(model_repository, monkeypatch):
    """An LRU churn over three pool models under a budget that holds tiny_cnn and mid_cnn
    together only if the process's GPU growth outside the footprints (kernel modules, library
    workspaces: ``ModelCache`` ``gpu_growth_bytes``) is counted: the cache's accounting stays in
    the budget, so does this process's NVML reading over its baseline after every event and
    after the cache's growth check (which its own thread runs each second), and every eviction
    lowers the reading."""
    names = ["tiny_cnn", "resnet18", "mid_cnn"]
    onnxruntime_cuda.prime()
    # This test's baseline is the process's reading now: what earlier tests left in the process
    # (kernel modules their models loaded) is not this test's growth.
    monkeypatch.setattr(gpu_memory, "baseline", process_gpu_bytes())
    base = gpu_memory.baseline.bytes
    rng = np.random.default_rng(3)
    x = {"input": rng.random((2, 3, 224, 224), dtype=np.float32)}
    lefts = []
    for _ in range(2):  # the first measures each footprint (remembered for this process); the second repeats it
        measuring = ModelCache(model_repository, names, CacheOptions(load_policy="lru", max_num_models_per_replica=3),
                               backend="onnxruntime_cuda").start()
        try:
            for name in names:
                measuring.infer(name, x)
            totals = {n: footprints.measured_footprint(model_repository.get(n), "onnxruntime_cuda").total(
                model_repository.get(n).config.instances) for n in names}
        finally:
            measuring.close()
        lefts.append(process_gpu_bytes().bytes - base)
    # What the process keeps after its first loads (the CUDA modules of the kernels the models and
    # their graphs use) is taken once: a second round of the same loads and unloads keeps nothing more.
    left = lefts[0]
    assert left <= 128 * MB and lefts[1] - lefts[0] <= 16 * MB, lefts
    budget = totals["tiny_cnn"] + totals["mid_cnn"] + max(1 << 20, left // 2)
    cache = ModelCache(model_repository, names, CacheOptions(load_policy="lru", memory_budget_mib=budget / (1 << 20),
                                                             max_num_models_per_replica=3),
                       backend="onnxruntime_cuda").start()
    try:
        peak = 0
        for name in names * 3:
            cache.infer(name, x)
            cache.check_gpu_growth()  # a request's first run at a shape may load kernels: counted here
            peak = max(peak, process_gpu_bytes().bytes - base)
            assert cache.resident_bytes <= cache.budget_bytes
        events = cache.timeline()
        print(f"footprints MB {dict((n, t // MB) for n, t in totals.items())}, left after the first cache "
              f"{left / MB:.1f} MB, budget {budget / MB:.1f} MB, peak GPU over base {peak / MB:.1f} MB, growth "
              f"{cache.status()['gpu_growth_bytes'] / MB:.1f} MB; events",
              [(e["event"], e["model"], e["model_bytes"] // MB, e.get("gpu_over_baseline_bytes", 0) // MB) for e in events])
        assert all("process_gpu_bytes" in e for e in events if e["event"] in ("load", "reload", "evict"))
        over = [e for e in events if e.get("gpu_over_baseline_bytes", 0) > cache.budget_bytes]
        assert not over, f"GPU reading over the budget at {over}"
        evictions = [i for i, e in enumerate(events) if e["event"] == "evict"]
        assert evictions, "the budget forced no eviction"
        for i in evictions:  # the reading fell by at least half the evicted model's bytes
            assert events[i - 1]["process_gpu_bytes"] - events[i]["process_gpu_bytes"] >= events[i]["model_bytes"] // 2
        assert peak <= cache.budget_bytes
    finally:
        cache.close()
    assert process_gpu_bytes().bytes - base <= left + 16 * MB


def test_warmup_runs_on_every_cuda_context_and_the_first_request_matches(model_repository):
    """A ``warmup:`` section on the CUDA provider (issue 14): every context runs each warmup
    size at load (the host records each context's last shape as the last warmup's), and the
    first real request, at another batch size, still matches the CPU provider."""
    entry = with_cuda_options(model_repository.get("resnet18"), use_tf32=False)
    config = entry.config.model_copy(update={"instances": 2, "warmup": Warmup(batch_sizes=(1, 8))})
    entry = dataclasses.replace(entry, config=config)
    host = ModelHost(entry, "onnxruntime_cuda").load()
    try:
        assert host.backend == "onnxruntime_cuda" and host.warmup_ms > 0
        assert sorted(host._last_shapes) == sorted(id(c) for c in host._contexts)
        assert set(host._last_shapes.values()) == {(("input", (8, 3, 224, 224)),)}
        feeds = {"input": np.random.default_rng(4).random((3, 3, 224, 224), dtype=np.float32)}
        assert_close(host.infer(feeds), cpu_reference(entry, feeds), onnxruntime_cuda.TOLERANCE[False])
    finally:
        host.unload()


@pytest.mark.parametrize("mode,flag", [("blocking", 4), ("spin", 1)])
def test_the_process_waits_for_the_gpu_as_told(prepared_engines, mode, flag):
    """``TRT_SERVE_CUDA_WAIT`` reaches CUDA: a fresh process (the flag binds when its context is
    made) loads tiny_cnn on the provider, runs it, and reads the device's scheduling flag back
    (``cudaGetDeviceFlags``; CUDA's values: Spin 1, BlockingSync 4)."""
    code = (
        "import numpy as np\n"
        "from deployments.runtime.backends.cuda import _runtime\n"
        "from deployments.runtime.contract.repository import ModelRepository\n"
        "from deployments.runtime.residency.host import ModelHost\n"
        f"host = ModelHost(ModelRepository({str(prepared_engines)!r}).get('tiny_cnn'), 'onnxruntime_cuda').load()\n"
        "out = host.infer({host.config.inputs[0].name: np.zeros((1, 3, 224, 224), np.float32)})\n"
        "rt = _runtime()\n"
        "err, flags = rt.cudaGetDeviceFlags()\n"
        "print(int(err), int(flags) & int(rt.cudaDeviceScheduleMask), len(out))\n")
    env = {**os.environ, onnxruntime_cuda.CUDA_WAIT_ENV: mode}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=str(prepared_engines.parent))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-3:] == ["0", str(flag), "1"]


def test_a_first_load_makes_room_for_its_learned_figure_not_the_whole_budget(prepared_engines, tmp_path):
    """Models this process never measured (fresh copies of the files) load one after another
    under a budget that holds all three with room to spare: only the first one's load makes
    room for the whole budget (nothing is resident yet); the next ones reserve their graph
    prediction scaled by what the first measured on the GPU, so no load evicts the ones before
    it, and this process's NVML reading over its baseline stays within the budget throughout."""
    import shutil

    from deployments.runtime.contract.repository import ModelRepository

    names = ["tiny_cnn", "mid_cnn", "resnet18"]
    onnxruntime_cuda.prime()
    base = gpu_memory.baseline.bytes
    x = {"input": np.random.default_rng(4).random((2, 3, 224, 224), dtype=np.float32)}
    for copy in ("measured", "fresh"):
        for name in names:
            shutil.copytree(prepared_engines / name, tmp_path / copy / name)
    measuring = ModelCache(ModelRepository(tmp_path / "measured", names), names,
                           CacheOptions(load_policy="lru", max_num_models_per_replica=3),
                           backend="onnxruntime_cuda").start()
    try:
        for name in names:
            measuring.infer(name, x)
        totals = {n: m["bytes"] for n, m in measuring.status()["models"].items()}
    finally:
        measuring.close()
    budget = 2 * sum(totals.values())
    fresh = ModelRepository(tmp_path / "fresh", names)
    cache = ModelCache(fresh, names,
                       CacheOptions(load_policy="lru", memory_budget_mib=budget / (1 << 20), max_num_models_per_replica=3),
                       backend="onnxruntime_cuda").start()
    try:
        peak = 0
        for name in names:
            assert_close(cache.infer(name, x), cpu_reference(fresh.get(name), x), onnxruntime_cuda.TOLERANCE[True])
            peak = max(peak, process_gpu_bytes().bytes - base)
        events = [(e["event"], e["model"], e["footprint_source"]) for e in cache.timeline()]
        print(f"footprints MB {dict((n, t // MB) for n, t in totals.items())}, budget {budget / MB:.0f} MB, "
              f"peak GPU over base {peak / MB:.0f} MB; events {events}")
        assert events == [("load", n, "measured") for n in names]
        assert peak <= cache.budget_bytes
    finally:
        cache.close()


def test_gpu_growth_past_the_budget_evicts_the_least_recently_used_model(model_repository):
    """GPU memory this process takes outside every footprint while models are resident (here a
    64 MB ``cudaMalloc`` of its own, standing for kernels loaded at a request or a library's
    workspace) is found by the cache's growth check: it counts it as ``gpu_growth_bytes`` and,
    the accounting being past the budget, evicts the least recently used unheld model, so that
    NVML's reading over the baseline is back within the budget; the model evicted answers again
    (reloaded), matching the CPU provider."""
    from deployments.runtime.backends import cuda

    names = ["tiny_cnn", "mid_cnn"]
    onnxruntime_cuda.prime()
    base = gpu_memory.baseline.bytes
    x = {"input": np.random.default_rng(5).random((2, 3, 224, 224), dtype=np.float32)}
    cache = ModelCache(model_repository, names, CacheOptions(load_policy="lru", max_num_models_per_replica=2),
                       backend="onnxruntime_cuda").start()
    try:
        for name in names:
            cache.infer(name, x)
        used = process_gpu_bytes().bytes - base
        tiny = cache.status()["models"]["tiny_cnn"]["bytes"]
    finally:
        cache.close()
    size = max(tiny, 8 << 20)  # the growth below: evicting tiny_cnn makes room for it
    budget = used + size // 2  # both fit, with less room than that growth
    cache = ModelCache(model_repository, names, CacheOptions(load_policy="lru", memory_budget_mib=budget / (1 << 20),
                                                             max_num_models_per_replica=2),
                       backend="onnxruntime_cuda").start()
    try:
        for name in names:  # tiny_cnn is the least recently used
            cache.infer(name, x)
        assert sorted(cache.resident()) == sorted(names)
        before = cache.status()["gpu_growth_bytes"]
        extra = cuda.DeviceBuffer(size)
        try:
            assert cache.check_gpu_growth()
            growth = cache.status()["gpu_growth_bytes"]
            reading = process_gpu_bytes().bytes - base
            print(f"budget {budget / MB:.1f} MB, growth {before / MB:.1f} -> {growth / MB:.1f} MB, "
                  f"reading over base {reading / MB:.1f} MB, resident {cache.resident()}")
            assert growth - before >= size
            assert cache.resident() == ["mid_cnn"]
            last = cache.timeline()[-1]
            assert (last["event"], last["model"]) == ("evict", "tiny_cnn") and last["detail"].startswith("GPU growth")
            assert reading <= cache.budget_bytes
            assert cache.resident_bytes + growth <= cache.budget_bytes
        finally:
            extra.close()
        assert_close(cache.infer("tiny_cnn", x), cpu_reference(model_repository.get("tiny_cnn"), x),
                     onnxruntime_cuda.TOLERANCE[True])
    finally:
        cache.close()
