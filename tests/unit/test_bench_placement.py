"""The pure parts of ``bench.placement``: Zipf popularity and sampling, the cache counters read
from ``/metrics``, the over-budget figures from ``/v2/memory`` and from ``nvidia-smi``, the
rows, and the GPU configuration it writes."""

from __future__ import annotations

import numpy as np
import pytest

import bench.placement as placement
from bench.placement import (Answer, GpuWatch, Sampler, Watch, cache_counters, cold_loads, compute_apps,
                             gpu_over_budget_bytes, nvml_summary, over_budget_bytes, parse_compute_apps, popularity,
                             row, verdict, window_stats, zipf_weights)


def test_zipf_weights_fall_as_one_over_rank_and_sum_to_one():
    w = zipf_weights(4, 1.0)
    harmonic = 1 + 1 / 2 + 1 / 3 + 1 / 4
    assert w == pytest.approx([1 / harmonic, 1 / 2 / harmonic, 1 / 3 / harmonic, 1 / 4 / harmonic])
    assert zipf_weights(3, 0.0) == pytest.approx([1 / 3] * 3)
    with pytest.raises(ValueError, match="at least one model"):
        zipf_weights(0)


def test_popularity_shift_rotates_the_ranking_so_the_cold_half_becomes_hot():
    models = ["a", "b", "c", "d"]
    assert max(popularity(models), key=popularity(models).get) == "a"
    shifted = popularity(models, shift=2)
    assert [m for m, _ in sorted(shifted.items(), key=lambda kv: -kv[1])] == ["c", "d", "a", "b"]
    assert sum(shifted.values()) == pytest.approx(1.0)


def test_sampler_draws_models_in_their_zipf_shares_and_follows_a_new_popularity():
    shares = popularity([f"m{k}" for k in range(10)])
    sampler = Sampler(shares, np.random.default_rng(0))
    n = 40_000
    counts = {m: 0 for m in shares}
    for _ in range(n):
        counts[sampler.draw()] += 1
    for model, share in shares.items():  # binomial: 4 standard deviations
        assert abs(counts[model] / n - share) < 4 * (share * (1 - share) / n) ** 0.5, (model, counts[model])
    sampler.set({"m3": 1.0, "m4": 0.0})
    assert {sampler.draw() for _ in range(200)} == {"m3"}


METRICS = """\
# HELP trt_serve_cache_loads_total Pool cache: first loads of a model
# TYPE trt_serve_cache_loads_total counter
trt_serve_cache_loads_total{model="m00",replica="r1"} 3.0
trt_serve_cache_loads_total{model="m01",replica="r1"} 1.0
trt_serve_cache_loads_total{model="m00",replica="r2"} 2.0
# HELP trt_serve_cache_reloads_total Pool cache: loads of a model after its eviction
# TYPE trt_serve_cache_reloads_total counter
trt_serve_cache_reloads_total{model="m01",replica="r2"} 5.0
# HELP trt_serve_cache_evictions_total Pool cache: evictions
# TYPE trt_serve_cache_evictions_total counter
trt_serve_cache_evictions_total{model="m01",replica="r2"} 6.0
# HELP trt_serve_cache_resident_bytes Pool cache: footprints of the resident models, bytes
# TYPE trt_serve_cache_resident_bytes gauge
trt_serve_cache_resident_bytes{replica="r1"} 100.0
trt_serve_cache_resident_bytes{replica="r2"} 250.0
# HELP trt_serve_cache_budget_bytes Pool cache: byte budget (absent: no budget)
# TYPE trt_serve_cache_budget_bytes gauge
trt_serve_cache_budget_bytes{replica="r1"} 200.0
trt_serve_cache_budget_bytes{replica="r2"} 200.0
# HELP nv_inference_count Number of inferences
# TYPE nv_inference_count counter
nv_inference_count{model="m00",version="1"} 99.0
"""


def test_cache_counters_sum_each_replicas_loads_reloads_and_evictions_over_models():
    counters = cache_counters(METRICS)
    assert counters == {"r1": {"loads": 4.0, "reloads": 0.0, "evictions": 0.0, "resident_bytes": 100.0, "budget_bytes": 200.0},
                        "r2": {"loads": 2.0, "reloads": 5.0, "evictions": 6.0, "resident_bytes": 250.0, "budget_bytes": 200.0}}
    assert cold_loads(counters) == 11.0


def test_over_budget_takes_the_most_any_event_or_the_present_held_beyond_the_budget():
    memory = {"budget_bytes": 1000, "resident_bytes": 900,
              "events": [{"resident_bytes": 800}, {"resident_bytes": 1150}, {"resident_bytes": 700}]}
    assert over_budget_bytes(memory) == 150
    assert over_budget_bytes({**memory, "events": []}) == 0
    assert over_budget_bytes({**memory, "budget_bytes": None}) == 0
    assert over_budget_bytes(None) == 0


def test_a_row_counts_cold_loads_per_thousand_answered_requests_of_its_window():
    answers = [Answer(0.0, 1.0, "m0", "200"), Answer(1.0, 1.1, "m1", "200"), Answer(1.5, 1.6, "m0", "503"),
               Answer(2.0, 2.3, "m2", "wrong answer: output 'x' differs from the reference"),
               Answer(2.0, 2.5, "m0", "200"), Answer(9.0, 10.5, "m0", "200")]  # last one answered after the window
    stats = window_stats(answers, 0.5, 10.0)
    assert stats["requests"] == 3 and stats["qps"] == round(3 / 9.5, 2)
    assert stats["errors"] == {"503": 1, "wrong answer: output 'x' differs from the reference": 1}
    assert stats["p50_ms"] == pytest.approx(500.0)
    r = row("bytes", 16, stats, cold_before=10, cold_after=13, over_bytes=0)
    assert r["cold_loads_per_1000"] == 1000.0 and r["cold_loads"] == 3
    assert (r["placement"], r["clients"], r["max_resident_over_budget_bytes"]) == ("bytes", 16, 0)
    assert row("hash", 16, window_stats([], 0, 1), 0, 0, 0)["cold_loads_per_1000"] is None


def test_verdict_needs_half_the_cold_loads_a_p99_within_a_tenth_and_no_replica_over_budget():
    hash_row = {"placement": "hash", "clients": 16, "cold_loads_per_1000": 40.0, "p99_ms": 100.0,
                "max_resident_over_budget_bytes": 0}
    wins = {**hash_row, "placement": "bytes", "cold_loads_per_1000": 20.0, "p99_ms": 110.0}
    assert verdict([hash_row, wins]) == {"16": {"half_the_cold_loads": True, "p99_within_1.1x": True,
                                                "never_over_budget": True, "bytes_wins": True}}
    over = {**wins, "max_resident_over_budget_bytes": 1}
    slow = {**wins, "p99_ms": 111.0}
    assert verdict([hash_row, over])["16"]["bytes_wins"] is False
    assert verdict([hash_row, slow])["16"]["p99_within_1.1x"] is False


def test_the_anchors_metrics_read_back_as_each_replicas_loads_and_most_bytes_held():
    """``bench.multiplexed`` reports its loader's counts in the form ``cache_counters`` reads, so
    the anchor's row counts cold loads and bytes over budget as the other policies' do."""
    from bench.multiplexed import prometheus_text

    replicas = {"a": {"loads": 10, "reloads": 3, "evictions": 2, "resident_bytes": 300, "budget_bytes": 200},
                "b": {"loads": 9, "reloads": 0, "evictions": 0, "resident_bytes": 150, "budget_bytes": 200}}
    counters = cache_counters(prometheus_text(replicas))
    assert counters == {r: {k: float(v) for k, v in state.items()} for r, state in replicas.items()}
    assert cold_loads(counters) == 22.0


def test_the_replicas_own_gpu_reading_over_budget_is_the_most_any_event_shows_and_none_without_one():
    memory = {"budget_bytes": 1000, "events": [{"gpu_over_baseline_bytes": 900}, {"gpu_over_baseline_bytes": 1100},
                                               {"resident_bytes": 5000}]}
    assert gpu_over_budget_bytes(memory) == 100
    assert gpu_over_budget_bytes({**memory, "events": [{"gpu_over_baseline_bytes": 999}]}) == 0
    assert gpu_over_budget_bytes({**memory, "events": [{"resident_bytes": 5000}]}) is None  # a CPU backend's events
    assert gpu_over_budget_bytes({**memory, "budget_bytes": None}) is None
    assert gpu_over_budget_bytes(None) is None


def test_nvidia_smi_compute_apps_read_as_bytes_per_pid_summed_over_gpus_and_hidden_figures_left_out():
    text = "1234, 812\n1234, 100\n  99 , 2048 \n77, [N/A]\n88, [Not Supported]\n\n"
    assert parse_compute_apps(text) == {1234: 912 * 2**20, 99: 2048 * 2**20}
    assert parse_compute_apps("") == {}


def test_without_nvidia_smi_nothing_is_sampled_and_the_nvml_figures_are_none(monkeypatch):
    monkeypatch.setattr(placement.shutil, "which", lambda name: None)
    assert compute_apps() == {}
    with GpuWatch(lambda: [1, 2], interval_s=0.01) as gpu:
        gpu.sample()
    assert not gpu._thread.is_alive() and gpu.samples == 0
    summary = gpu.summary(1000)
    assert summary["max_nvml_process_bytes"] is None and summary["max_nvml_over_budget_bytes"] is None
    assert summary["nvml"]["samples"] == 0 and summary["nvml"]["pool_pid_bytes"] == {}


def test_a_failing_nvidia_smi_reads_as_no_processes(monkeypatch, tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{placement.os.environ['PATH']}")
    assert compute_apps() == {}


def test_the_gpu_watch_keeps_each_pids_most_and_the_summary_judges_only_pool_replicas(monkeypatch, tmp_path):
    """A stand-in ``nvidia-smi`` (a script answering as the real one does) lists two pool
    replicas and another process; the pool replica's most bytes are set against the budget."""
    readings = tmp_path / "readings"
    readings.write_text("0")
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"""#!/bin/sh
n=$(cat {readings}); echo $((n + 1)) > {readings}
if [ "$n" = 0 ]; then printf '10, 600\\n11, 500\\n99, 9000\\n'; else printf '10, 700\\n11, 400\\n'; fi
""")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{placement.os.environ['PATH']}")
    gpu = GpuWatch(lambda: [10, 11])
    gpu.sample()
    gpu.sample()
    summary = gpu.summary(650 * 2**20)
    assert summary["max_nvml_process_bytes"] == 700 * 2**20
    assert summary["max_nvml_over_budget_bytes"] == 50 * 2**20
    assert summary["nvml"]["pool_pid_bytes"] == {"10": 700 * 2**20, "11": 500 * 2**20}
    assert summary["nvml"]["other_pid_bytes"] == {"99": 9000 * 2**20}
    assert summary["nvml"]["samples"] == 2 and summary["nvml"]["budget_bytes"] == 650 * 2**20
    assert nvml_summary({10: 100}, [10], 650 * 2**20, 1)["max_nvml_over_budget_bytes"] == 0
    assert summary["max_nvml_over_budget_less_primed_bytes"] is None  # no primed figure given
    primed = gpu.summary(650 * 2**20, primed_bytes=30 * 2**20)
    assert primed["max_nvml_over_budget_less_primed_bytes"] == 20 * 2**20
    assert primed["nvml"]["primed_process_bytes"] == 30 * 2**20
    assert gpu.summary(650 * 2**20, primed_bytes=60 * 2**20)["max_nvml_over_budget_less_primed_bytes"] == 0


def test_without_a_cuda_provider_the_primed_process_figure_is_none(monkeypatch):
    """The process that primes ONNX Runtime's CUDA provider fails here (no GPU): no figure, no hang."""
    monkeypatch.setattr(placement.shutil, "which", lambda name: None)
    assert placement.primed_process_bytes(timeout_s=60) is None


def test_the_config_gives_each_pool_replica_its_gpu_share_and_every_model_the_backend(tmp_path):
    import yaml

    from bench.throughput import _base_config

    raw = _base_config(placement.ROOT / "engines", placement.BASE)
    raw.update(deployment={"mode": "pool"})
    (tmp_path / "engines" / "m00" / "1").mkdir(parents=True)
    (tmp_path / "engines" / "m00" / "config.yaml").write_text(yaml.safe_dump(raw))
    (tmp_path / "engines" / "m00" / "1" / "model.onnx").symlink_to(
        placement.ROOT / "engines" / placement.BASE / "1" / "model.onnx")
    path = placement.write_config(tmp_path, tmp_path / "engines", "bytes", 4, 100 * 2**20, 30, 8123, 8124,
                                  gpu_fraction=0.2, backend="onnxruntime_cuda")
    args = yaml.safe_load(path.read_text())["applications"][0]["args"]
    assert args["backend"] == "onnxruntime_cuda"
    assert args["pool"]["num_gpus"] == 0.2 and args["pool"]["num_replicas"] == 4
    assert args["pool"]["placement"] == "bytes" and args["pool"]["memory_budget_mib"] == 100.0
    cpu = yaml.safe_load(placement.write_config(tmp_path, tmp_path / "engines", "hash", 4, 2**20, 30, 1, 2)
                         .read_text())["applications"][0]["args"]
    assert cpu["pool"]["num_gpus"] == 0 and cpu["backend"] == "auto"  # the file's own


def test_the_loads_after_a_shift_are_sorted_by_whether_a_revision_placed_them_there():
    watch = Watch("http://unused")
    watch.revisions = [
        {"unix_time": 100.0, "revision": 7, "replicas": ["r0", "r1"], "target": {"a": ["r0"], "b": ["r1"]},
         "reasons": {"a": "kept", "b": "kept"}},
        {"unix_time": 104.0, "revision": 8, "replicas": ["r0", "r1"], "target": {"a": ["r1"], "b": ["r1"]},
         "reasons": {"a": "moved from r0 to r1: balance", "b": "kept"}}]
    watch.events = {("r1", 1): {"unix_time": 103.5, "event": "load", "model": "a", "detail": ""},  # seen late
                    ("r0", 2): {"unix_time": 105.0, "event": "evict", "model": "a", "detail": "released"},
                    ("r0", 3): {"unix_time": 106.0, "event": "reload", "model": "b", "detail": ""},
                    ("r0", 4): {"unix_time": 120.0, "event": "load", "model": "b", "detail": ""}}  # outside
    got = watch.loads_between(100.0, 110.0)
    assert (got["placed_here"], got["moved"], got["not_placed_here"], got["evictions"]) == (1, 1, 1, 1)
    assert got["loads"] == ["a@r1: moved from r0 to r1: balance", "b@r0: not placed here"]
    assert got["revisions"] == [(7, 2), (8, 2)] and got["moves"] == ["a: moved from r0 to r1: balance"]


def test_the_figure_reads_each_policys_resident_mib_budget_copies_and_cold_loads_over_the_shift(tmp_path):
    from bench.placement_figure import main, series

    mib = 2**20
    rows = [{"placement": p, "clients": 16, "budget_bytes": 100 * mib, "cold_loads_per_1000": cold,
             "resident_bytes_by_replica": {"a": 60 * mib, "b": 90 * mib}, "copies": {"m00": 2} if p == "bytes" else {},
             "after_shift": [{"from_s": 0.0, "cold_loads_per_1000": 3.0}, {"from_s": 10.0, "cold_loads_per_1000": 0.5}]}
            for p, cold in (("hash", 20.0), ("bytes", 0.0))]
    got = series(rows + [{**rows[0], "clients": 64}], 16)
    assert got["bytes"] == {"resident_mib": [90.0, 60.0], "budget_mib": 100.0, "copies": {"m00": 2},
                            "times_s": [-10.0, 5.0, 15.0], "cold_per_1000": [0.0, 3.0, 0.5]}
    assert got["hash"]["cold_per_1000"][0] == 20.0
    with pytest.raises(ValueError, match="hash at 16 clients has no after_shift"):
        series([{**rows[0], "after_shift": []}], 16)
    run = tmp_path / "run.json"
    run.write_text(__import__("json").dumps({"rows": rows}))
    assert main([str(run), str(tmp_path / "p.png")]) == 0 and (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
