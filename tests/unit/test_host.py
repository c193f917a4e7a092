"""ModelHost on real ONNX Runtime: outputs equal a direct session run, the context pool under load."""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from deployments.runtime.backends.context_thread import ContextThread
from deployments.runtime.backends.onnxruntime import OnnxRuntimeEngine
from deployments.runtime.contract.errors import ConfigError, InferenceTimeout, InvalidInput, ModelNotReady
from deployments.runtime.residency.host import ModelHost
from deployments.runtime.contract.repository import ModelRepository

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def repo() -> ModelRepository:
    return ModelRepository(ROOT / "engines")


@pytest.fixture(scope="module")
def tiny(repo):
    host = ModelHost(repo.get("tiny_cnn"), backend="onnxruntime").load()
    yield host
    host.unload()


def reference(path: Path, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]


def test_infer_equals_a_direct_onnxruntime_run(tiny, repo):
    x = np.random.default_rng(0).standard_normal((3, 3, 224, 224), dtype=np.float32)
    out = tiny.infer({"input": x})
    assert list(out) == ["logits"] and out["logits"].shape == (3, 1000)
    np.testing.assert_allclose(out["logits"], reference(repo.get("tiny_cnn").onnx_path(), x), rtol=1e-5, atol=1e-6)
    assert tiny.backend == "onnxruntime" and tiny.ready


def test_concurrent_requests_beyond_the_pool_equal_serial_runs(tiny):
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((1, 3, 224, 224), dtype=np.float32) for _ in range(8)]
    serial = [tiny.infer({"input": x})["logits"] for x in xs]
    with ThreadPoolExecutor(8) as pool:  # 8 requests, 2 contexts
        parallel = list(pool.map(lambda x: tiny.infer({"input": x})["logits"], xs))
    for a, b in zip(serial, parallel):
        np.testing.assert_array_equal(a, b)
    assert tiny.in_flight == 0


@pytest.mark.parametrize("inputs,fragment", [
    ({"input": np.zeros((1, 3, 224, 225), np.float32)}, "axis 3 is 225, allowed 224"),
    ({"input": np.zeros((33, 3, 224, 224), np.float32)}, "axis 0 is 33, allowed [1, 32]"),
    ({"input": np.zeros((1, 3, 224, 224), np.float64)}, "datatype must be FP32"),
    ({"input": np.zeros((3, 224, 224), np.float32)}, "expected rank 4"),
    ({"image": np.zeros((1, 3, 224, 224), np.float32)}, "missing ['input'], unknown ['image']"),
])
def test_inputs_outside_the_contract_are_rejected_before_a_context_is_used(tiny, inputs, fragment):
    with pytest.raises(InvalidInput) as err:
        tiny.infer(inputs)
    assert fragment in err.value.message and "tiny_cnn" in err.value.message


def test_unknown_requested_output_is_invalid_input(tiny):
    with pytest.raises(InvalidInput, match=r"no outputs \['probs'\]"):
        tiny.infer({"input": np.zeros((1, 3, 224, 224), np.float32)}, ["probs"])


def test_unload_waits_for_the_request_in_flight_then_refuses_new_ones(repo):
    host = ModelHost(repo.get("resnet18"), backend="onnxruntime").load()
    x = np.random.default_rng(2).standard_normal((8, 3, 224, 224), dtype=np.float32)
    results: dict[str, np.ndarray] = {}
    worker = threading.Thread(target=lambda: results.setdefault("y", host.infer({"input": x})["logits"]))
    worker.start()
    deadline = time.monotonic() + 10
    while host.in_flight == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert host.in_flight == 1
    host.unload()  # returns only after the request finished
    assert "y" in results and results["y"].shape == (8, 1000)
    worker.join()
    assert not host.ready
    with pytest.raises(ModelNotReady, match="not loaded"):
        host.infer({"input": x[:1]})


def test_config_that_disagrees_with_the_onnx_file_fails_at_load(repo, tmp_path):
    entry = repo.get("tiny_cnn")
    bad = entry.config.model_copy(update={"inputs": (entry.config.inputs[0].model_copy(update={"name": "x"}),)})
    host = ModelHost(type(entry)(config=bad, path=entry.path, versions=entry.versions), backend="onnxruntime")
    with pytest.raises(ConfigError, match="config input 'x' is not in the ONNX file"):
        host.load()


def test_axis_that_must_be_a_multiple_is_checked_before_the_model_runs(repo):
    det = ModelHost(repo.get("ocr_det"), backend="onnxruntime").load()
    try:
        with pytest.raises(InvalidInput, match=r"axis 2 is 50, allowed \[32, 2016\] and a multiple of 32"):
            det.infer({"x": np.zeros((1, 3, 50, 64), np.float32)})
        assert det.infer({"x": np.zeros((1, 3, 64, 96), np.float32)})["sigmoid_0.tmp_0"].shape == (1, 1, 64, 96)
    finally:
        det.unload()


def test_a_request_goes_to_a_free_context_that_last_ran_its_shape(repo):
    """ONNX Runtime's CUDA convolutions rebuild their plans when a context's shape changes
    (``ModelHost`` docstring): warming gives each batch size a context, and requests of that
    size keep to it, while the answers stay those of a direct run."""
    host = ModelHost(repo.get("tiny_cnn"), backend="onnxruntime").load()
    used: list[tuple[int, int]] = []  # (context index, batch) per real run
    for index, context in enumerate(host._contexts):
        def spy(inputs, _run=context.infer, _index=index):
            used.append((_index, inputs["input"].shape[0]))
            return _run(inputs)
        context.infer = spy
    try:
        rng = np.random.default_rng(4)
        b1, b4 = (rng.standard_normal((n, 3, 224, 224), dtype=np.float32) for n in (1, 4))
        host.warm([1, 4])
        assert used == [(0, 1), (1, 4)]
        outs = [host.infer({"input": x})["logits"] for x in (b4, b1, b4, b1)]
        assert used[2:] == [(1, 4), (0, 1), (1, 4), (0, 1)]
        path = repo.get("tiny_cnn").onnx_path()
        for x, out in zip((b4, b1), outs):
            np.testing.assert_allclose(out, reference(path, x), rtol=1e-5, atol=1e-6)
        assert host.in_flight == 0
    finally:
        host.unload()


def test_a_freed_context_goes_to_the_longest_waiting_request_not_to_a_newcomer(repo):
    """First come, first served: a request that arrives as a context comes free queues behind
    the one already waiting (with ``Condition.wait_for`` alone it took the context, and the
    waiter waited again at the back: the 0.3-1.1 s tail of docs/lab-notes.md, "Overload")."""
    entry = repo.get("tiny_cnn")
    entry = dataclasses.replace(entry, config=entry.config.model_copy(update={"instances": 1}))
    host = ModelHost(entry, backend="onnxruntime").load()
    x = np.random.default_rng(5).standard_normal((1, 3, 224, 224), dtype=np.float32)
    order: list[str] = []
    [context] = host._contexts

    def spy(inputs, _run=context.infer):
        order.append("waiting request ran")
        return _run(inputs)

    context.infer = spy
    try:
        held = host._checkout(("held",))
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(host.infer, {"input": x})
            deadline = time.monotonic() + 10
            while not host._waiting:
                assert time.monotonic() < deadline, "the request never waited for the context"
                time.sleep(0.001)
            with host._slots:  # free the context and ask for it again before the waiter can run
                host._check_in([held])
                newcomer = host._checkout(("newcomer",))
                order.append("newcomer got the context")
            assert order == ["waiting request ran", "newcomer got the context"]
            np.testing.assert_allclose(waiting.result(timeout=10)["logits"], reference(entry.onnx_path(), x),
                                       rtol=1e-5, atol=1e-6)
            host._check_in([newcomer])
        assert host.in_flight == 0 and not host._waiting
    finally:
        host.unload()


def test_load_after_unload_serves_again_and_unload_twice_is_harmless(repo):
    host = ModelHost(repo.get("tiny_cnn"), backend="onnxruntime").load()
    host.unload()
    host.unload()
    x = np.ones((1, 3, 224, 224), np.float32)
    assert host.load().infer({"input": x})["logits"].shape == (1, 1000)
    host.unload()


def test_memory_says_which_batch_sizes_replay_as_cuda_graphs_and_why_not(repo):
    """``cuda_graphs()`` for ``/v2/memory``: None on a backend without CUDA graphs (ONNX Runtime
    on the CPU) or unloaded; on contexts that have them (stand-ins with the CUDA provider
    context's attributes), the sizes all replay and "on", or why one runs without."""
    host = ModelHost(repo.get("tiny_cnn"), backend="onnxruntime")
    assert host.cuda_graphs() is None  # not loaded
    host.load()
    real = host._contexts
    try:
        assert host.cuda_graphs() is None  # ONNX Runtime on the CPU

        def context(graphs, reason, batches):
            return type("Context", (), {"graphs": graphs, "graphs_reason": reason, "graph_batches": frozenset(batches)})()

        host._contexts = [context(True, "on", {1, 8})] * 2
        assert host.cuda_graphs() == {"batches": [1, 8], "reason": "on"}
        host._contexts = [context(False, "off (TRT_SERVE_CUDA_GRAPHS=0)", ())] * 2
        assert host.cuda_graphs() == {"batches": [], "reason": "off (TRT_SERVE_CUDA_GRAPHS=0)"}
        host._contexts = [context(True, "on", {None})]
        assert host.cuda_graphs() == {"batches": [], "reason": "on: the model's one shape (it has no batch axis)"}
    finally:
        host._contexts = real
        host.unload()


# --- ModelHost.call: every context has a thread of its own (``ContextThread``) ----------------------
# The host's own for ONNX Runtime's CPU contexts; the backend's for CUDA contexts with graphs, which
# must run there (tests/gpu; here a backend's thread is imitated by giving the contexts one).

@pytest.fixture
def threaded(repo):
    """tiny_cnn on ONNX Runtime's CPU provider, 2 contexts, each with the host's own thread."""
    host = ModelHost(repo.get("tiny_cnn"), backend="onnxruntime").load()
    try:
        assert host.threaded() and len(host._own_threads) == host.config.instances == 2
        yield host
    finally:
        host.unload()


def _threads_named(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


def test_a_load_starts_a_thread_per_context_and_the_unload_ends_them(repo):
    host = ModelHost(repo.get("tiny_cnn"), backend="onnxruntime")
    before = len(_threads_named("ctx-tiny_cnn"))
    for _ in range(3):
        host.load()
        assert len(_threads_named("ctx-tiny_cnn")) == before + 2
        assert {id(c) for c in host._contexts} == set(host._threads)
        host.unload()
        assert len(_threads_named("ctx-tiny_cnn")) == before and not host.threaded()


def test_contexts_with_a_thread_of_their_backends_run_there_and_not_inline(repo, monkeypatch):
    threads: list[ContextThread] = []
    create = OnnxRuntimeEngine.create_context

    def with_thread(engine):  # as ONNX Runtime CUDA's contexts with graphs
        context = create(engine)
        context.thread = ContextThread(f"backend-context-{len(threads)}")
        threads.append(context.thread)
        return context

    monkeypatch.setattr(OnnxRuntimeEngine, "create_context", with_thread)
    host = ModelHost(repo.get("simple"), backend="onnxruntime").load()
    x = {"INPUT0": np.arange(16, dtype=np.int32).reshape(1, 16), "INPUT1": np.ones((1, 16), np.int32)}
    ran_on: list[int] = []
    try:
        assert host.threaded() and host._own_threads == [] and len(threads) == host.config.instances
        host.recent_run_s = 1e-6  # short enough to run inline, were the contexts not pinned to their threads
        assert not host.runs_inline()
        out = asyncio.run(host.call(lambda: ran_on.append(threading.get_ident()) or host.run(x)))
        np.testing.assert_array_equal(out["OUTPUT0"], x["INPUT0"] + 1)
        assert ran_on and set(ran_on) <= {t._ident for t in threads}
    finally:
        host.unload()
        for thread in threads:
            thread.stop()


def test_calls_run_on_the_contexts_threads_with_the_context_bound_and_answer_right(threaded, repo):
    rng = np.random.default_rng(7)
    xs = [{"input": rng.standard_normal((b, 3, 224, 224), dtype=np.float32)} for b in (1, 2, 1, 3) * 4]
    ran_on: list[int] = []
    request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id")

    def work(feeds, expected_id):
        assert request_id.get() == expected_id  # the caller's context variables
        ran_on.append(threading.get_ident())
        return threaded.run(feeds)

    async def one(i, feeds):
        request_id.set(f"request-{i}")
        return await threaded.call(work, feeds, f"request-{i}")

    async def main():
        return await asyncio.gather(*(one(i, x) for i, x in enumerate(xs)))

    got = asyncio.run(main())
    path = repo.get("tiny_cnn").onnx_path()
    for x, g in zip(xs, got):
        np.testing.assert_allclose(g["logits"], reference(path, x["input"]), rtol=1e-5, atol=1e-6)
    assert set(ran_on) <= {t._ident for t in threaded._own_threads} and len(ran_on) == len(xs)
    assert len(threaded._free) == 2 and not threaded._waiting and threaded.in_flight == 0


def test_queued_calls_start_in_arrival_order_as_contexts_come_free(threaded):
    x = {"input": np.zeros((1, 3, 224, 224), np.float32)}
    order: list[int] = []

    def work(i):
        order.append(i)
        return threaded.run(x)

    async def main():
        held = [threaded._checkout(("held", i)) for i in range(2)]
        calls = [asyncio.ensure_future(threaded.call(work, i)) for i in range(6)]
        await asyncio.sleep(0.05)
        assert order == [] and len(threaded._waiting) == 6
        threaded._check_in(held[:1])  # one context: the six run one after another, first come first
        await asyncio.gather(*calls)
        threaded._check_in(held[1:])

    asyncio.run(main())
    assert order == [0, 1, 2, 3, 4, 5]
    assert len(threaded._free) == 2 and not threaded._waiting


def test_a_call_left_waiting_past_its_checkout_timeout_is_an_inference_timeout(threaded):
    held = [threaded._checkout(("held", i)) for i in range(2)]
    threaded.checkout_timeout_s = 0.2
    ran: list[bool] = []
    try:
        with pytest.raises(InferenceTimeout, match=r"no execution context free within 0.2 s \(2 instances\)"):
            asyncio.run(threaded.call(lambda: ran.append(True)))
    finally:
        threaded._check_in(held)
    assert ran == [] and not threaded._waiting and len(threaded._free) == 2


def test_a_call_whose_caller_went_away_never_runs_and_frees_no_context_twice(threaded):
    ran: list[str] = []

    async def main():
        held = [threaded._checkout(("held", i)) for i in range(2)]
        gone = asyncio.ensure_future(threaded.call(lambda: ran.append("gone")))
        kept = asyncio.ensure_future(threaded.call(lambda: ran.append("kept") or "answer"))
        await asyncio.sleep(0.05)
        gone.cancel()
        threaded._check_in(held)
        assert await kept == "answer"
        with pytest.raises(asyncio.CancelledError):
            await gone

    asyncio.run(main())
    assert ran == ["kept"]
    deadline = time.monotonic() + 10  # the dropped call's context comes back from its thread
    while len(threaded._free) < 2:
        assert time.monotonic() < deadline, f"{len(threaded._free)} of 2 contexts free"
        time.sleep(0.001)
    assert len(threaded._free) == 2 and not threaded._waiting


def test_an_error_the_work_raises_reaches_its_caller_and_the_context_comes_back(threaded):
    bad = {"input": np.zeros((1, 3, 224, 225), np.float32)}
    with pytest.raises(InvalidInput, match="axis 3 is 225, allowed 224"):
        asyncio.run(threaded.call(threaded.infer, bad))
    assert len(threaded._free) == 2 and threaded.in_flight == 0


def test_calls_queued_when_the_model_unloads_get_model_not_ready(threaded):
    x = {"input": np.zeros((1, 3, 224, 224), np.float32)}

    async def main():
        held = [threaded._checkout(("held", i)) for i in range(2)]
        calls = [asyncio.ensure_future(threaded.call(threaded.run, x)) for _ in range(4)]
        await asyncio.sleep(0.05)
        unloading = asyncio.ensure_future(asyncio.to_thread(threaded.unload))
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        threaded._check_in(held)
        await unloading
        return outcomes

    outcomes = asyncio.run(main())
    assert [type(o) for o in outcomes] == [ModelNotReady] * 4
    assert all("model 'tiny_cnn' is not loaded" in o.message for o in outcomes)


def test_a_context_thread_calls_in_order_raises_what_the_work_raised_and_stops_once():
    thread = ContextThread("test-thread")
    assert thread.call(threading.get_ident) == thread._ident != threading.get_ident()
    with pytest.raises(ZeroDivisionError):
        thread.call(lambda: 1 / 0)
    seen: list[int] = []
    for i in range(100):
        thread.submit(seen.append, i)
    thread.submit(lambda: 1 / 0)  # logged; the thread serves on
    assert thread.call(lambda: list(seen)) == list(range(100))
    thread.stop()
    thread.stop()
    assert not thread._thread.is_alive()
    with pytest.raises(RuntimeError, match="context thread test-thread is stopped"):
        thread.submit(seen.append, 0)


def test_work_that_raises_stop_iteration_fails_its_caller_instead_of_leaving_it_waiting(threaded):
    """An asyncio future refuses StopIteration as an exception (TypeError in the loop's callback):
    the caller waited for ever."""
    with pytest.raises(RuntimeError, match="the work raised StopIteration"):
        asyncio.run(asyncio.wait_for(threaded.call(lambda: next(iter(()))), 10))
    assert len(threaded._free) == 2
