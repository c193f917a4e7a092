"""Defaults that fit the machine: ONNX Runtime threads from the cores and the app's contexts."""

from __future__ import annotations

from pathlib import Path

import pytest

from deployments.app import AppArgs, execution_contexts, intra_op_threads, ray_options
from deployments.runtime.contract.repository import ModelRepository

REPOSITORY = str(Path(__file__).resolve().parents[2] / "engines")


def test_contexts_count_dedicated_replicas_and_the_pool_s_largest_models():
    args = AppArgs(repository=REPOSITORY, pool={"max_num_models_per_replica": 2, "num_replicas": 3})
    entries = ModelRepository(REPOSITORY).entries()
    # ocr_det, ocr_cls, ocr_rec: 1 replica x 1 instance; pool: 3 replicas x (2 + 2) instances
    assert execution_contexts(args, entries) == 3 + 3 * 4


@pytest.mark.parametrize("cores,threads", [(2, 1), (16, 1), (64, 7)])
def test_threads_share_the_cores_among_every_context(cores, threads, monkeypatch):
    monkeypatch.delenv("ORT_INTRA_OP_THREADS", raising=False)
    args = AppArgs(repository=REPOSITORY)  # 3 dedicated contexts + the pool's 3 models x 2 = 9
    assert intra_op_threads(cores, args, ModelRepository(REPOSITORY).entries()) == threads


def test_an_explicit_thread_count_wins(monkeypatch):
    monkeypatch.setenv("ORT_INTRA_OP_THREADS", "3")
    assert intra_op_threads(2, AppArgs(repository=REPOSITORY), ModelRepository(REPOSITORY).entries()) == 3


def test_deployments_get_bounded_queues_with_retry_after():
    options = ray_options(AppArgs().pool, use_gpus=False, env={"ORT_INTRA_OP_THREADS": "1"})
    assert options["max_ongoing_requests"] == 512 and options["max_queued_requests"] == 512
    dedicated = ray_options(ModelRepository(REPOSITORY).get("ocr_cls").config.deployment, use_gpus=False)
    assert dedicated["max_ongoing_requests"] == 512 and dedicated["max_queued_requests"] == 128
    assert options["backpressure_config"] == {"retry_after_s": 1.0}
    assert options["ray_actor_options"]["runtime_env"] == {
        "env_vars": {"ORT_INTRA_OP_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}}  # no GPU reserved: none visible
