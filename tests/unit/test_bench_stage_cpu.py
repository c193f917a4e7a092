"""bench.stage_cpu and bench.replica_cpu: the arithmetic of CPU per request by stage."""

import json

from bench import replica_cpu, stage_cpu


def test_stages_split_decode_body_into_header_and_tensor_bytes_per_request(tmp_path):
    before = {"decode_body": [10, 0.010], "join": [10, 0.002], "tensor": [10, 0.001], "model": [10, 0.040]}
    after = {"decode_body": [110, 0.060], "join": [110, 0.022], "tensor": [110, 0.011], "model": [110, 0.440],
             "encode": [300, 0.009], "metrics": [200, 0.002]}
    # 100 requests: decode 30 ms in all (join 20 + tensors 10), header the other 20 ms of decode_body
    assert stage_cpu.stages_us(before, after, 100) == {
        "header": 200.0, "decode": 300.0, "model": 4000.0, "encode": 90.0, "metrics": 20.0}
    assert stage_cpu.calls(before, after, "decode_body") == 100


def test_read_sums_the_replicas_files_and_skips_a_missing_one(tmp_path):
    (tmp_path / "1.json").write_text(json.dumps({"model": [3, 0.5]}))
    (tmp_path / "2.json").write_text(json.dumps({"model": [1, 0.25], "encode": [1, 0.1]}))
    assert stage_cpu.read(tmp_path, [1, 2, 3]) == {"model": [4, 0.75], "encode": [1, 0.1]}


def test_timed_wrapper_counts_each_call_and_returns_the_result():
    stage_cpu._totals.clear()
    twice = stage_cpu._timed("probe", lambda x: 2 * x)
    assert [twice(1), twice(4)] == [2, 8]
    assert stage_cpu._totals["probe"][0] == 2
    stage_cpu._totals.clear()


def test_summary_takes_medians_and_outside_model_over_rounds():
    rounds = [{"qps": q, "cpu_us_per_request": c, "replica_cores": 1.0, "outside_model_us": o,
               "stages_us": {"model": m, "rest": r}}
              for q, c, o, m, r in [(100, 5000, 1500, 3500, 1000), (120, 4000, 1300, 2700, 900), (90, 6000, 1700, 4300, 1100)]]
    summary = replica_cpu.summarize(rounds)
    assert summary["qps"] == 100 and summary["cpu_us_per_request"] == 5000
    assert summary["outside_model_us"] == 1500 and summary["stages_us"] == {"model": 3500, "rest": 1000}


def test_a_collection_inside_a_stage_counts_as_gc_not_as_the_stage(monkeypatch):
    clock = iter([0.0, 1.0, 1.5, 4.0])  # stage starts; collection from 1.0 to 1.5 s; stage ends
    monkeypatch.setattr(stage_cpu.time, "thread_time", lambda: next(clock))
    stage_cpu._totals.clear()

    def step() -> str:
        stage_cpu._collection("start", {})
        stage_cpu._collection("stop", {})
        return "done"

    assert stage_cpu._timed("probe", step)() == "done"
    assert stage_cpu._totals == {"gc": [1, 0.5], "probe": [1, 3.5]}
    stage_cpu._totals.clear()
    assert stage_cpu.stages_us({}, {"gc": [1, 0.5], "model": [1, 0.25]}, 1000) == {"model": 250.0, "gc": 500.0}
