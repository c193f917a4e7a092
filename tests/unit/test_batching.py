"""Dynamic batching: policy from config, grouping by shape, splitting outputs, failures stay per request."""

from __future__ import annotations

import logging

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from deployments.batching import BatchItem, BatchPolicy, BatchStats, run_batch, total_rows
from deployments.runtime.contract.config import ModelConfig
from deployments.runtime.contract.errors import InferenceError, InferenceTimeout, InvalidInput
from deployments.runtime.residency.host import ModelHost
from deployments.runtime.contract.repository import ModelRepository


def config(**overrides) -> ModelConfig:
    raw = {"name": "m", "max_batch_size": 8,
           "inputs": [{"name": "x", "datatype": "FP32", "dims": [-1, 2]}],
           "outputs": [{"name": "y", "datatype": "FP32", "dims": [-1, 2]},
                       {"name": "s", "datatype": "FP32", "dims": [-1]}]}
    raw.update(overrides)
    return ModelConfig.model_validate(raw)


class DoublingHost:
    """Stands in for ``ModelHost``: y = 2x, s = row sums; a NaN anywhere fails the call."""

    name = "m"

    def __init__(self, fail_with: Exception | None = None, drop_a_row: bool = False) -> None:
        self.calls: list[int] = []
        self.fail_with = fail_with
        self.drop_a_row = drop_a_row

    def run(self, inputs, outputs=None):
        x = inputs["x"]
        self.calls.append(x.shape[0])
        if self.fail_with is not None:
            raise self.fail_with
        if np.isnan(x).any():
            raise InferenceError("model 'm': NaN input")
        if self.drop_a_row and x.shape[0] > 1:
            x = x[1:]
        result = {"y": 2 * x, "s": x.sum(axis=1)}
        return result if outputs is None else {n: result[n] for n in outputs}


def item(cfg: ModelConfig, rows: int, value: float = 1.0, outputs=None) -> BatchItem:
    return BatchItem.of(cfg, {"x": np.full((rows, 2), value, np.float32)}, outputs)


def test_policy_caps_rows_at_the_largest_preferred_size_else_max_batch_size():
    assert BatchPolicy.of(config()) is None
    assert BatchPolicy.of(config(dynamic_batching={"max_queue_delay_ms": 5})) == BatchPolicy(8, 5.0)
    assert BatchPolicy.of(config(dynamic_batching={"preferred_batch_size": [2, 4]})).max_rows == 4
    assert BatchPolicy.of(config(dynamic_batching={"enabled": False})) is None
    assert BatchPolicy.of(config(max_batch_size=1, dynamic_batching={})) is None
    assert BatchPolicy(8, 2.5).wait_s == 0.0025


def test_padding_is_automatic_on_the_cuda_provider_only_and_can_be_forced(caplog):
    sizes = {"preferred_batch_size": [8, 2]}
    assert BatchPolicy.of(config(dynamic_batching=sizes), "onnxruntime_cuda").pad_to == (1, 2, 8)  # 1: a lone row
    assert BatchPolicy.of(config(dynamic_batching=sizes), "onnxruntime").pad_to == ()
    assert BatchPolicy.of(config(dynamic_batching=sizes), "tensorrt").pad_to == ()
    forced = {**sizes, "pad_to_preferred": True}
    assert BatchPolicy.of(config(dynamic_batching=forced), "onnxruntime").pad_to == (1, 2, 8)
    off = {**sizes, "pad_to_preferred": False}
    assert BatchPolicy.of(config(dynamic_batching=off), "onnxruntime_cuda").pad_to == ()
    # auto without preferred sizes has nothing to pad to, and says what that costs on the GPU
    with caplog.at_level(logging.WARNING, logger="deployments.batching"):
        assert BatchPolicy.of(config(dynamic_batching={}), "onnxruntime_cuda").pad_to == ()
        assert BatchPolicy.of(config(dynamic_batching={}), "onnxruntime").pad_to == ()
    assert [r.getMessage() for r in caplog.records] == [
        "model 'm': dynamic_batching has no preferred_batch_size, so its batches run at every size from 1 to 8 on "
        "onnxruntime_cuda, where a model's convolutions rebuild their cuDNN plans at each change of size and only "
        "batch 1 replays a CUDA graph; set preferred_batch_size (e.g. [8]) to pad batches to a few sizes"]
    # contexts replaying every batch size up to the batch's rows rebuild nothing: auto does not pad, forced still does
    assert BatchPolicy.of(config(dynamic_batching=sizes), "onnxruntime_cuda", replayed=range(1, 9)).pad_to == ()
    assert BatchPolicy.of(config(dynamic_batching=forced), "onnxruntime_cuda", replayed=range(1, 9)).pad_to == (1, 2, 8)
    # a size without its graph (7 of 1..8) would rebuild the plans: auto pads again
    assert BatchPolicy.of(config(dynamic_batching=sizes), "onnxruntime_cuda",
                          replayed={1, 2, 3, 4, 5, 6, 8, 32}).pad_to == (1, 2, 8)


def test_a_host_replays_the_batch_sizes_every_context_captured(model_repository):
    """ONNX Runtime on the CPU has no graphs; a host is judged by all its contexts, and an
    unloaded one by none."""
    from deployments.runtime.residency.host import ModelHost

    host = ModelHost(model_repository.get("tiny_cnn"), "onnxruntime")
    assert host.replayed_batches() == frozenset()  # not loaded
    host.load()
    real = host._contexts
    try:
        assert host.replayed_batches() == frozenset()
        host._contexts = [type("Graphs", (), {"graph_batches": frozenset({1, 2, 4})})()] * 2
        assert host.replayed_batches() == {1, 2, 4}
        host._contexts.append(type("Fewer", (), {"graph_batches": frozenset({1, 4, 8})})())
        assert host.replayed_batches() == {1, 4}
        host._contexts.append(type("NoGraphs", (), {})())
        assert host.replayed_batches() == frozenset()
    finally:
        host._contexts = real
        host.unload()
    with pytest.raises(ValueError, match="pad_to_preferred needs preferred_batch_size"):
        config(dynamic_batching={"pad_to_preferred": True})


def test_a_batch_runs_at_the_smallest_preferred_size_that_holds_it():
    policy = BatchPolicy(8, 2.0, pad_to=(2, 8))
    assert [policy.padded_rows(r) for r in (1, 2, 3, 8)] == [2, 2, 8, 8]
    assert BatchPolicy(8, 2.0).padded_rows(3) == 3


def test_padded_batches_run_at_the_preferred_size_and_answer_only_real_rows():
    cfg, host = config(), DoublingHost()
    policy = BatchPolicy(8, 2.0, pad_to=(4, 8))
    items = [item(cfg, 1, 1.0), item(cfg, 2, 3.0, ["s"])]
    run = run_batch(host, items, policy)
    assert host.calls == [4] and run.calls == [(2, 3)] and run.padded_rows == 1
    assert run.results[0]["y"].tolist() == [[2.0, 2.0]]
    assert list(run.results[1]) == ["s"] and run.results[1]["s"].tolist() == [6.0, 6.0]
    alone = run_batch(host, [item(cfg, 2, 5.0)], policy)  # a lone request is padded to a warmed size
    assert host.calls[-1] == 4 and alone.padded_rows == 2 and alone.results[0]["s"].tolist() == [10.0, 10.0]
    one_row = run_batch(host, [item(cfg, 1, 5.0)], BatchPolicy.of(config(dynamic_batching={
        "preferred_batch_size": [4, 8]}), "onnxruntime_cuda"))
    assert host.calls[-1] == 1 and one_row.padded_rows == 0  # batch 1 is a warmed size: no padding
    full = run_batch(host, [item(cfg, 4, 1.0)], policy)  # already a preferred size: no padding
    assert host.calls[-1] == 4 and full.padded_rows == 0


def test_a_failing_padded_batch_retries_each_request_unpadded():
    cfg, host = config(), DoublingHost()
    run = run_batch(host, [item(cfg, 1, 1.0), item(cfg, 1, np.nan)], BatchPolicy(8, 2.0, pad_to=(8,)))
    assert host.calls == [8, 1, 1] and run.padded_rows == 0 and run.retried_alone == 2
    assert isinstance(run.results[1], InferenceError) and run.results[0]["y"].tolist() == [[2.0, 2.0]]


def test_padding_changes_no_output_of_a_real_model(model_repository: ModelRepository, prepared_engines: Path):
    host = ModelHost(model_repository.get("tiny_cnn"), "onnxruntime").load()
    try:
        cfg = host.config
        rng = np.random.default_rng(3)
        xs = [rng.standard_normal((rows, 3, 224, 224), dtype=np.float32) for rows in (1, 2)]
        run = run_batch(host, [BatchItem.of(cfg, {"input": x}, None) for x in xs], BatchPolicy(8, 2.0, pad_to=(4,)))
    finally:
        host.unload()
    assert run.calls == [(2, 3)] and run.padded_rows == 1
    session = ort.InferenceSession(str(prepared_engines / "tiny_cnn" / "1" / "model.onnx"),
                                   providers=["CPUExecutionProvider"])
    for x, result in zip(xs, run.results):
        (expected,) = session.run(None, {"input": x})
        assert result["logits"].shape == expected.shape
        np.testing.assert_allclose(result["logits"], expected, rtol=1e-4, atol=1e-5)


def test_config_refuses_batching_without_batch_axis_or_above_max_batch_size():
    with pytest.raises(ValueError, match="needs a batch axis"):
        config(max_batch_size=0, inputs=[{"name": "x", "datatype": "FP32", "dims": [2]}],
               outputs=[{"name": "y", "datatype": "FP32", "dims": [2]}], dynamic_batching={})
    with pytest.raises(ValueError, match=r"preferred_batch_size \[16\] outside \[1, max_batch_size 8\]"):
        config(dynamic_batching={"preferred_batch_size": [4, 16]})


def test_items_are_validated_before_they_join_a_batch():
    cfg = config()
    with pytest.raises(InvalidInput, match="axis 1"):
        BatchItem.of(cfg, {"x": np.zeros((1, 3), np.float32)}, None)
    with pytest.raises(InvalidInput, match="no outputs"):
        BatchItem.of(cfg, {"x": np.zeros((1, 2), np.float32)}, ["nope"])
    assert total_rows([item(cfg, 3), item(cfg, 2)]) == 5


def test_requests_of_one_shape_run_as_one_call_and_get_their_own_rows_back():
    cfg, host = config(), DoublingHost()
    items = [item(cfg, 1, 1.0), item(cfg, 3, 2.0, ["s"]), item(cfg, 2, 3.0, ["y"])]
    run = run_batch(host, items)
    assert host.calls == [6] and run.calls == [(3, 6)] and run.retried_alone == 0
    first, second, third = run.results
    np.testing.assert_array_equal(first["y"], np.full((1, 2), 2.0))
    assert list(second) == ["s"] and second["s"].tolist() == [4.0, 4.0, 4.0]
    assert list(third) == ["y"] and third["y"].shape == (2, 2) and (third["y"] == 6.0).all()


def test_one_failing_request_fails_alone_and_the_rest_of_its_batch_succeeds():
    cfg, host = config(), DoublingHost()
    items = [item(cfg, 1, 1.0), item(cfg, 2, np.nan), item(cfg, 1, 5.0)]
    run = run_batch(host, items)
    assert host.calls == [4, 1, 2, 1]  # the joined call, then each alone
    assert isinstance(run.results[1], InferenceError)
    assert (run.results[0]["y"] == 2.0).all() and (run.results[2]["y"] == 10.0).all()
    assert run.retried_alone == 3 and run.calls == [(1, 1), (1, 2), (1, 1)]


def test_a_failure_no_request_owns_fails_the_group_without_retries():
    cfg, host = config(), DoublingHost(fail_with=InferenceTimeout("no context free"))
    run = run_batch(host, [item(cfg, 1), item(cfg, 1)])
    assert host.calls == [2] and all(isinstance(r, InferenceTimeout) for r in run.results)
    assert run.calls == []


def test_outputs_that_do_not_keep_the_batch_rows_are_run_per_request():
    cfg, host = config(), DoublingHost(drop_a_row=True)
    run = run_batch(host, [item(cfg, 1, 1.0), item(cfg, 1, 2.0)])
    assert host.calls == [2, 1, 1] and run.retried_alone == 2
    assert run.results[1]["y"].tolist() == [[4.0, 4.0]]


def test_stats_count_model_calls_by_requests_and_rows():
    cfg, host, stats = config(), DoublingHost(), BatchStats()
    first = [item(cfg, 2), item(cfg, 1)]
    stats.record(first, run_batch(host, first))
    second = [item(cfg, 1, np.nan)]
    stats.record(second, run_batch(host, second))
    assert stats.as_dict() == {"batches": 2, "requests": 3, "max_requests": 2, "max_rows": 3,
                               "calls_by_requests": {1: 1, 2: 1}, "calls_by_rows": {1: 1, 3: 1},
                               "retried_alone": 0, "rows": 4, "padded_rows": 0, "positions": 0,
                               "padded_positions": 0}


@pytest.fixture(scope="module")
def ocr_rec(model_repository: ModelRepository):
    host = ModelHost(model_repository.get("ocr_rec"), "onnxruntime").load()
    yield host
    host.unload()


def test_ocr_rec_widths_are_batched_only_with_their_own_width(ocr_rec, prepared_engines: Path):
    cfg = ocr_rec.config
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((rows, 3, 48, width), dtype=np.float32)
              for rows, width in [(1, 160), (2, 320), (1, 160), (1, 320), (2, 160)]]
    run = run_batch(ocr_rec, [BatchItem.of(cfg, {"x": x}, None) for x in inputs])
    assert sorted(run.calls) == [(2, 3), (3, 4)]  # width 320: 3 rows; width 160: 4 rows
    session = ort.InferenceSession(str(prepared_engines / "ocr_rec" / "1" / "model.onnx"),
                                   providers=["CPUExecutionProvider"])
    for x, result in zip(inputs, run.results):
        (expected,) = session.run(None, {"x": x})
        np.testing.assert_allclose(result["softmax_11.tmp_0"], expected, rtol=1e-4, atol=1e-5)
