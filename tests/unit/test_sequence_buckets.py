"""Sequence-length buckets (``dynamic_batching.sequence_buckets``): requests of different lengths
join one batch of the real all-MiniLM-L6-v2 encoder on ONNX Runtime and each gets the answer it
gets alone; the padding waste is counted exactly."""

from __future__ import annotations

import multiprocessing
import os

import numpy as np
import onnxruntime as ort
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deployments.batching import BatchItem, BatchPolicy, BatchStats, SequenceAxis, run_batch
from deployments.observe import metrics as m
from deployments.runtime.contract.config import ModelConfig
from deployments.runtime.residency.host import ModelHost
from deployments.runtime.tools import prepare as prep

ENCODER = prep.MINILM
BUCKETS = [16, 32, 64, 128, 256]
SEQUENCE_TENSORS = ["attention_mask", "input_ids", "token_type_ids"]


def with_batching(config: ModelConfig, **batching) -> ModelConfig:
    raw = config.model_dump()
    raw["dynamic_batching"] = batching
    return ModelConfig.model_validate(raw)


@pytest.fixture(scope="module")
def encoder(model_repository):
    entry = model_repository.get(ENCODER)
    host = ModelHost(entry, backend="onnxruntime").load()
    yield host
    host.unload()


@pytest.fixture(scope="module")
def session(encoder):
    return ort.InferenceSession(str(encoder.entry.onnx_path()), providers=["CPUExecutionProvider"])


def tokens(rows: int, length: int, seed: int) -> dict[str, np.ndarray]:
    """``rows`` sequences of ``length`` tokens: [CLS] random ids [SEP], mask 1, types 0."""
    ids = np.random.default_rng(seed).integers(1000, 30000, (rows, length), dtype=np.int64)
    ids[:, 0], ids[:, -1] = 101, 102
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}


def test_the_sequence_tensors_are_those_with_the_files_symbol_on_axis_1_or_else_the_dynamic_ones(encoder):
    config = with_batching(encoder.config, sequence_buckets=BUCKETS)
    from_file = SequenceAxis.of(config, encoder.entry.onnx_path())
    assert sorted(from_file.inputs) == SEQUENCE_TENSORS and sorted(from_file.outputs) == ["last_hidden_state"]
    fallback = SequenceAxis.of(config)  # no file: the config's dynamic axis 1
    assert (fallback.inputs, fallback.outputs) == (from_file.inputs, from_file.outputs)
    assert [from_file.bucket(n) for n in (1, 16, 17, 200, 256, 300)] == [16, 16, 32, 256, 256, 300]
    assert SequenceAxis.of(with_batching(encoder.config), encoder.entry.onnx_path()) is None  # no buckets


@pytest.mark.parametrize("buckets, error", [
    ([32, 16], r"sequence_buckets must be positive lengths in ascending order, got \[32, 16\]"),
    ([16, 16], r"ascending order, got \[16, 16\]"),
    ([16, 600], r"sequence_buckets \[600\] outside input 'input_ids' axis 1 range \[1, 512\]"),
])
def test_buckets_must_ascend_within_the_models_bound_for_the_axis(encoder, buckets, error):
    with pytest.raises(ValueError, match=error):
        with_batching(encoder.config, sequence_buckets=buckets)


def test_buckets_need_a_dynamic_sequence_axis():
    with pytest.raises(ValueError, match=r"sequence_buckets needs an input with a dynamic sequence axis"):
        ModelConfig.model_validate({
            "name": "m", "max_batch_size": 8, "dynamic_batching": {"sequence_buckets": [16]},
            "inputs": [{"name": "x", "datatype": "FP32", "dims": [-1, 3]}],
            "outputs": [{"name": "y", "datatype": "FP32", "dims": [-1, 3]}]})


def test_buckets_apply_on_a_gpu_backend_or_when_forced_never_on_the_cpu_by_default(encoder):
    """On ONNX Runtime CPU a new length costs nothing and padding only wastes (``BatchPolicy.of``)."""
    config = with_batching(encoder.config, sequence_buckets=BUCKETS)
    assert BatchPolicy.of(config, "onnxruntime", encoder.entry.onnx_path()).sequence is None
    for backend in ("onnxruntime_cuda", "tensorrt"):
        assert BatchPolicy.of(config, backend, encoder.entry.onnx_path()).sequence.buckets == tuple(BUCKETS)
    forced = with_batching(encoder.config, sequence_buckets=BUCKETS, pad_to_preferred=True)
    assert BatchPolicy.of(forced, "onnxruntime", encoder.entry.onnx_path()).sequence.buckets == tuple(BUCKETS)
    off = with_batching(encoder.config, sequence_buckets=BUCKETS, pad_to_preferred=False)
    assert BatchPolicy.of(off, "onnxruntime_cuda", encoder.entry.onnx_path()).sequence is None


def test_requests_of_different_lengths_join_one_batch_and_each_gets_its_answer_alone(encoder, session):
    config = with_batching(encoder.config, sequence_buckets=BUCKETS, pad_to_preferred=True)  # buckets on the CPU too
    policy = BatchPolicy.of(config, "onnxruntime", encoder.entry.onnx_path())
    requests = [tokens(1, 5, 1), tokens(2, 12, 2), tokens(1, 16, 3), tokens(1, 20, 4), tokens(1, 300, 5)]
    items = [BatchItem.of(config, r, None, policy.sequence) for r in requests]
    assert [(i.length, i.bucket) for i in items] == [(5, 16), (12, 16), (16, 16), (20, 32), (300, 300)]
    run = run_batch(encoder, items, policy)
    assert run.calls == [(3, 4), (1, 1), (1, 1)]  # lengths 5, 12, 16 joined in bucket 16
    for request, result in zip(requests, run.results):
        (alone,) = session.run(["last_hidden_state"], request)
        assert result["last_hidden_state"].shape == alone.shape  # cut back to its own length
        np.testing.assert_allclose(result["last_hidden_state"], alone, rtol=0, atol=1e-5)


def test_padding_waste_counts_rows_and_sequence_positions_of_a_known_mix(encoder):
    """Preferred size 4, padded: bucket 16 holds 4 rows (lengths 5, 12, 12, 16) run as 4 x 16;
    bucket 32 holds 2 rows of length 20 run as 4 x 32 (2 zero rows). Real positions
    5 + 24 + 16 + 40 = 85 of the 4 x 16 + 4 x 32 = 192 run."""
    config = with_batching(encoder.config, sequence_buckets=BUCKETS, preferred_batch_size=[4],
                           pad_to_preferred=True)
    policy = BatchPolicy.of(config, "onnxruntime", encoder.entry.onnx_path())
    requests = [tokens(1, 5, 1), tokens(2, 12, 2), tokens(1, 16, 3), tokens(2, 20, 4)]
    items = [BatchItem.of(config, r, None, policy.sequence) for r in requests]
    run = run_batch(encoder, items, policy)
    assert run.calls == [(3, 4), (1, 2)] and run.padded_rows == 2
    assert (run.positions, run.padded_positions) == (85, 192 - 85)
    stats = BatchStats()
    stats.record(items, run)
    counts = {k: stats.as_dict()[k] for k in ("rows", "padded_rows", "positions", "padded_positions")}
    assert counts == {"rows": 6, "padded_rows": 2, "positions": 85, "padded_positions": 107}
    assert _exported(run) == {"trt_serve_batch_rows": 6, "trt_serve_batch_padded_rows": 2,
                              "trt_serve_batch_positions": 85, "trt_serve_batch_padded_positions": 107}


def _record(root: str, run) -> None:
    os.environ["TRT_SERVE_METRICS_DIR"] = root
    m.ReplicaRecorder().batch_padding(ENCODER, 1, run)
    m.flush()


def _exported(run) -> dict[str, float]:
    """The padding counters as a scrape shows them, recorded in a process of their own
    (multiprocess metrics are per process)."""
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        process = multiprocessing.get_context("spawn").Process(target=_record, args=(root, run))
        process.start()
        process.join(60)
        assert process.exitcode == 0
        text = m.render(os.path.join(root, "default")).decode()
    names = {"trt_serve_batch_rows", "trt_serve_batch_padded_rows", "trt_serve_batch_positions",
             "trt_serve_batch_padded_positions"}
    return {f.name: sum(s.value for s in f.samples if s.labels.get("model") == ENCODER)
            for f in text_string_to_metric_families(text) if f.name in names}


def test_buckets_are_warmed_on_the_gpu_at_the_batch_sizes_and_skipped_on_the_cpu(encoder):
    config = with_batching(encoder.config, sequence_buckets=[16, 64])
    policy = BatchPolicy.of(config, "tensorrt", encoder.entry.onnx_path())
    shapes = policy.warm_shapes(config, "tensorrt")
    assert [s["input_ids"] for s in shapes] == [(32, 64), (32, 16), (1, 64), (1, 16)]  # largest first
    assert all(s["input_ids"] == s["attention_mask"] == s["token_type_ids"] for s in shapes)
    assert policy.warm_shapes(config, "onnxruntime") == []
    encoder.warm(shapes[-2:])  # the host runs shapes given per input
