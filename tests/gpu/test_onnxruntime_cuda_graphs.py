"""CUDA graphs on ONNX Runtime's CUDA execution provider (``onnxruntime_cuda.cuda_graphs``): every
answer equal to the same request without graphs, shapes alternating on contexts that capture while
others run, the cap on graphs per context, and a model whose outputs the run shapes running without.

This file runs after test_onnxruntime_cuda.py on purpose: ONNX Runtime keeps a thread's graphs,
and their memory, past an unload (docs/gpu.md), and the tests there compare this process's GPU
bytes with its baseline.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from deployments.runtime.backends import onnxruntime_cuda
from deployments.runtime.residency.host import ModelHost
from tests.gpu.test_onnxruntime_cuda import assert_close, cpu_reference, with_cuda_options

REASON = onnxruntime_cuda.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"ONNX Runtime CUDA cannot run here: {REASON}")


def test_cuda_graphs_replay_each_shape_and_answer_as_without_them(model_repository):
    """``cuda_graphs`` on: each context captures one graph per input shape while the
    other contexts run (8 threads, 2 contexts, shapes alternating), and every answer equals the
    same request run without graphs; a shape past ``MAX_GRAPHS`` runs without one, correctly."""
    entry = with_cuda_options(model_repository.get("resnet18"), use_tf32=False, cuda_graphs=True)
    entry = dataclasses.replace(entry, config=entry.config.model_copy(update={"instances": 2}))
    rng = np.random.default_rng(3)
    batches = (1, 8, 2, 1, 8, 3, 1, 8) * 4
    xs = [rng.random((b, 3, 224, 224), dtype=np.float32) for b in batches]
    plain = ModelHost(with_cuda_options(entry, cuda_graphs=False), "onnxruntime_cuda").load()
    try:
        assert [c.graphs for c in plain._contexts] == [False, False]
        want = [plain.infer({"input": x})["logits"] for x in xs]
    finally:
        plain.unload()
    host = ModelHost(entry, "onnxruntime_cuda").load()
    try:
        assert [(c.graphs, c.graphs_reason) for c in host._contexts] == [(True, "on")] * 2
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda x: host.infer({"input": x})["logits"], xs))
        for b, g, w in zip(batches, got, want):
            np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-4, err_msg=f"batch {b}")
        context = host._contexts[0]
        for batch in range(1, onnxruntime_cuda.MAX_GRAPHS + 2):  # 17 shapes: the last past the cap
            feeds = {"input": rng.random((batch, 3, 224, 224), dtype=np.float32)}
            assert_close(context.infer(feeds), cpu_reference(entry, feeds), onnxruntime_cuda.TOLERANCE[False])
        assert len(context._graph_runs) == onnxruntime_cuda.MAX_GRAPHS
    finally:
        host.unload()


def test_a_model_with_outputs_shaped_by_the_run_runs_without_graphs(model_repository):
    """ocr_det's map is as large as its input image: the graph could not own its buffer, so the
    context runs without graphs and says why."""
    host = ModelHost(with_cuda_options(model_repository.get("ocr_det"), cuda_graphs=True), "onnxruntime_cuda").load()
    try:
        assert {(c.graphs, c.graphs_reason) for c in host._contexts} == {
            (False, "off: an output's shape is only known after the run")}
    finally:
        host.unload()
