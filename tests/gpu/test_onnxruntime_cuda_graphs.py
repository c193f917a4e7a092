"""CUDA graphs on ONNX Runtime's CUDA execution provider (``onnxruntime_cuda.cuda_graphs``, default
on): each context captures its batch sizes at load on a thread of its own, every answer equals the
same request without graphs (a size without a graph included), nothing is captured after the load,
so the process's GPU bytes stay within the measured footprint under requests from many threads,
and an unload gives them back; a model whose outputs the run shapes runs without.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from deployments.runtime.backends import onnxruntime_cuda
from deployments.runtime.backends.gpu_memory import process_gpu_bytes
from deployments.runtime.contract.config import DynamicBatching
from deployments.runtime.contract.errors import InferenceTimeout, ModelNotReady
from deployments.runtime.residency.host import ModelHost
from tests.gpu.test_onnxruntime_cuda import MB, assert_close, cpu_reference, with_cuda_options

REASON = onnxruntime_cuda.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"ONNX Runtime CUDA cannot run here: {REASON}")


def test_cuda_graphs_replay_each_batch_size_and_answer_as_without_them(model_repository):
    """Two contexts capture resnet18's sizes 1, 4 and 8 (preferred 4 and 8) at load; 8 threads
    send sizes alternating, 2 and 3 among them (no graph), and every answer equals the same
    request without graphs; sizes 1..17 on one context all answer right and capture nothing new; the process's
    GPU bytes stay within the loaded reading + 32 MB, every run happened on the contexts' own
    two threads, and the unload gives the bytes back."""
    entry = with_cuda_options(model_repository.get("resnet18"), use_tf32=False)
    entry = dataclasses.replace(entry, config=entry.config.model_copy(
        update={"instances": 2, "dynamic_batching": DynamicBatching(preferred_batch_size=[4, 8])}))
    rng = np.random.default_rng(3)
    batches = (1, 8, 2, 1, 8, 3, 1, 8) * 4
    xs = [rng.random((b, 3, 224, 224), dtype=np.float32) for b in batches]
    plain = ModelHost(with_cuda_options(entry, cuda_graphs=False), "onnxruntime_cuda").load()
    try:
        assert [c.graphs for c in plain._contexts] == [False, False]
        want = [plain.infer({"input": x})["logits"] for x in xs]
        plain_bytes = plain.footprint().context_bytes
    finally:
        plain.unload()
    onnxruntime_cuda.prime()
    before = process_gpu_bytes()
    host = ModelHost(entry, "onnxruntime_cuda").load()
    try:
        loaded = process_gpu_bytes()
        assert [(c.graphs, c.graphs_reason) for c in host._contexts] == [(True, "on")] * 2
        assert host.replayed_batches() == {1, 4, 8}
        threads_before = {t.name for t in threading.enumerate()}
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda x: host.infer({"input": x})["logits"], xs))
        for b, g, w in zip(batches, got, want):
            np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-4, err_msg=f"batch {b}")
        context = host._contexts[0]
        for batch in range(1, onnxruntime_cuda.MAX_GRAPHS + 2):
            feeds = {"input": rng.random((batch, 3, 224, 224), dtype=np.float32)}
            assert_close(context.infer(feeds), cpu_reference(entry, feeds), onnxruntime_cuda.TOLERANCE[False])
        assert len(context._graph_runs) == 3  # the sizes captured at load, no more
        served = process_gpu_bytes()
        print(f"resnet18 x2 with graphs: footprint {host.footprint()}, without {plain_bytes // MB} MB a context; "
              f"GPU before {before.bytes // MB} MB, loaded {loaded.bytes // MB}, after requests {served.bytes // MB}")
        assert served.bytes - loaded.bytes <= 32 * MB, (loaded, served)
        own = sorted(t.name for t in threading.enumerate() if t.name.startswith("ort-cuda-resnet18"))
        assert len(own) == 2 and set(own) <= threads_before, own
    finally:
        host.unload()
    assert not [t for t in threading.enumerate() if t.name.startswith("ort-cuda-resnet18")]
    after = process_gpu_bytes()
    assert after.bytes - before.bytes <= max(32 * MB, 0.1 * (loaded.bytes - before.bytes)), (before, loaded, after)


def test_a_model_with_shapes_known_only_from_requests_runs_without_graphs(model_repository):
    """ocr_det's image size comes with each request: nothing to capture at load, so the context
    runs without graphs, on its callers' threads, and says why."""
    host = ModelHost(model_repository.get("ocr_det"), "onnxruntime_cuda").load()
    try:
        assert {(c.graphs, c.graphs_reason, c.thread) for c in host._contexts} == {
            (False, onnxruntime_cuda.graphs_refused(host.engine.config), None)}
        assert host.replayed_batches() == frozenset()
    finally:
        host.unload()


def test_calls_run_on_the_contexts_own_threads_and_answer_right(model_repository):
    """``ModelHost.call`` from 24 coroutines at once: each request runs on a context's own thread
    (the one its graphs were captured on), with that context bound, and answers as ONNX Runtime's
    CPU provider does; work queued when the model unloads gets ModelNotReady."""
    entry = with_cuda_options(model_repository.get("resnet18"), use_tf32=False)
    host = ModelHost(entry, "onnxruntime_cuda").load()
    rng = np.random.default_rng(5)
    xs = [{"input": rng.random((b, 3, 224, 224), dtype=np.float32)} for b in (1, 2, 1, 3) * 6]
    ran_on: list[int] = []

    def work(feeds):
        ran_on.append(threading.get_ident())
        return host.run(feeds)

    async def main():
        return await asyncio.gather(*(host.call(work, x) for x in xs))

    try:
        assert host.threaded()
        got = asyncio.run(main())
        for x, g in zip(xs, got):
            assert_close(g, cpu_reference(entry, x), onnxruntime_cuda.TOLERANCE[False])
        assert set(ran_on) <= {c.thread._ident for c in host._contexts}, "a call ran off its context's thread"
        assert len(host._free) == entry.config.instances  # every context back

        held = [host._checkout(("held", i)) for i in range(entry.config.instances)]
        host.checkout_timeout_s = 0.2
        try:  # every context taken: a call waits its checkout timeout, then answers InferenceTimeout
            with pytest.raises(InferenceTimeout, match=r"no execution context free within 0.2 s \(2 instances\)"):
                asyncio.run(host.call(work, xs[0]))
        finally:
            host._check_in(held)
            host.checkout_timeout_s = 30.0
        assert len(host._free) == entry.config.instances and not host._waiting

        async def unload_while_queued():
            calls = [asyncio.ensure_future(host.call(work, x)) for x in xs[:8]]
            await asyncio.sleep(0)
            await asyncio.to_thread(host.unload)
            return await asyncio.gather(*calls, return_exceptions=True)

        outcomes = asyncio.run(unload_while_queued())
        assert all(isinstance(o, (dict, ModelNotReady)) for o in outcomes), outcomes
    finally:
        host.unload()
