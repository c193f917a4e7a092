"""The batch scheduler's decisions (``deployments.batching.BatchScheduler``), driven step by step:
a fake host whose ``run`` blocks until the test lets it go, so every assertion is about what
ran, never about how long anything took."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from deployments.batching import BatchItem, BatchPolicy, BatchScheduler, run_batch
from deployments.runtime.contract.config import ModelConfig
from deployments.runtime.contract.errors import InferenceError

WAIT_S = 60.0  # how long a test waits for the fake host to be entered (a deadline, never reached)
LONG_WINDOW_S = 3600.0  # a window that never passes within a test


def config(**overrides) -> ModelConfig:
    return ModelConfig.model_validate({
        "name": "m", "max_batch_size": 8,
        "inputs": [{"name": "x", "datatype": "FP32", "dims": [-1, 2]}],
        "outputs": [{"name": "y", "datatype": "FP32", "dims": [-1, 2]}], **overrides})


class BlockingHost:
    """Stands in for ``ModelHost``: y = 2x; each ``run`` records its rows, then blocks until
    ``release`` lets one run finish. A NaN input fails the run."""

    name = "m"

    def __init__(self) -> None:
        self.calls: list[int] = []
        self._entered = threading.Semaphore(0)
        self._go = threading.Semaphore(0)

    def run(self, inputs, outputs=None):
        x = inputs["x"]
        self.calls.append(x.shape[0])
        self._entered.release()
        assert self._go.acquire(timeout=WAIT_S), "the test never released this run"
        if np.isnan(x).any():
            raise InferenceError("model 'm': NaN input")
        return {"y": 2 * x}

    async def entered(self) -> None:
        """Wait until a run has started (one per call)."""
        assert await asyncio.to_thread(self._entered.acquire, timeout=WAIT_S), "no run started"

    def release(self) -> None:
        self._go.release()


def item(rows: int, value: float = 1.0) -> BatchItem:
    return BatchItem.of(config(), {"x": np.full((rows, 2), value, np.float32)}, None)


def scheduler(host: BlockingHost, *, slots: int = 1, max_rows: int = 8, wait_s: float = LONG_WINDOW_S,
              policy: BatchPolicy | None = None) -> BatchScheduler:
    return BatchScheduler(lambda items, loaded: run_batch(host, items, policy, loaded), max_rows, wait_s, slots)


def test_a_lone_request_runs_at_once_at_batch_1_even_with_padding_to_preferred_sizes():
    async def scenario():
        host = BlockingHost()
        padded = BatchPolicy.of(config(dynamic_batching={"preferred_batch_size": [4, 8]}), "onnxruntime_cuda")
        batcher = scheduler(host, policy=padded)
        answer = batcher.submit(item(1, 3.0))
        assert batcher.running == 1 and batcher.queued == 0  # decided at submit: no window waited
        await host.entered()
        assert host.calls == [1]  # batch 1 is among the padded sizes: no zero rows
        host.release()
        return (await answer)["y"]

    assert asyncio.run(scenario()).tolist() == [[6.0, 6.0]]


def test_while_every_context_is_busy_arrivals_join_one_batch_each_getting_its_own_rows():
    async def scenario():
        host = BlockingHost()
        batcher = scheduler(host)
        first = batcher.submit(item(1, 1.0))
        await host.entered()
        later = [batcher.submit(item(rows, value)) for rows, value in ((1, 2.0), (2, 3.0), (1, 4.0))]
        assert batcher.running == 1 and batcher.queued == 3 and host.calls == [1]
        host.release()  # the first batch ends; the three queued run as one
        await host.entered()
        assert host.calls == [1, 4] and batcher.queued == 0
        host.release()
        answers = [await f for f in [first, *later]]
        return answers, batcher.stats.as_dict()

    answers, stats = asyncio.run(scenario())
    assert [a["y"][:, 0].tolist() for a in answers] == [[2.0], [4.0], [6.0, 6.0], [8.0]]
    assert stats["calls_by_requests"] == {1: 1, 3: 1} and stats["rows"] == 5


def test_a_batch_holds_at_most_max_rows_and_the_rest_runs_next():
    async def scenario():
        host = BlockingHost()
        batcher = scheduler(host, max_rows=4)
        first = batcher.submit(item(1))
        await host.entered()
        later = [batcher.submit(item(2, v)) for v in (1.0, 2.0, 3.0)]  # 6 rows: 4 fit
        host.release()
        await host.entered()
        assert host.calls == [1, 4] and batcher.queued == 1
        host.release()
        await host.entered()
        assert host.calls == [1, 4, 2]
        host.release()
        return [(await f)["y"][:, 0].tolist() for f in [first, *later]]

    assert asyncio.run(scenario()) == [[2.0], [2.0, 2.0], [4.0, 4.0], [6.0, 6.0]]


def test_a_free_context_runs_a_request_at_once_while_another_is_busy():
    async def scenario():
        host = BlockingHost()
        batcher = scheduler(host, slots=2)
        first = batcher.submit(item(1))
        await host.entered()
        second = batcher.submit(item(1))  # a second context is free: no gathering
        assert batcher.running == 2 and batcher.queued == 0
        await host.entered()
        host.release()
        host.release()
        await first, await second
        return host.calls

    assert asyncio.run(scenario()) == [1, 1]


def test_the_window_closes_a_batch_so_later_arrivals_start_the_next():
    """Window 0: a request queued while every context is busy closes its batch at once, so the
    next arrival does not join it; both run in turn, oldest first."""
    async def scenario():
        host = BlockingHost()
        batcher = scheduler(host, wait_s=0.0)
        first = batcher.submit(item(1, 1.0))
        await host.entered()
        second = batcher.submit(item(1, 2.0))
        third = batcher.submit(item(2, 3.0))
        assert batcher.closed == 2 and batcher.running == 1  # closed, waiting for the context
        for _ in range(3):
            host.release()
            if len(host.calls) < 3:
                await host.entered()
        return host.calls, [(await f)["y"][:, 0].tolist() for f in (first, second, third)]

    calls, answers = asyncio.run(scenario())
    assert calls == [1, 1, 2] and answers == [[2.0], [4.0], [6.0, 6.0]]


def test_the_window_passing_while_busy_closes_the_open_batch():
    """The timer, not an arrival, closes the batch once its window passed (polled with a
    deadline: the assertion is on what happened, not on when)."""
    async def scenario():
        host = BlockingHost()
        batcher = scheduler(host, wait_s=0.01)
        first = batcher.submit(item(1))
        await host.entered()
        second = batcher.submit(item(1))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT_S
        while batcher.closed == 0 and loop.time() < deadline:
            await asyncio.sleep(0.005)
        closed = batcher.closed
        third = batcher.submit(item(1))  # opens a batch of its own
        host.release()
        await host.entered()
        host.release()
        await host.entered()
        host.release()
        await first, await second, await third
        return closed, host.calls

    assert asyncio.run(scenario()) == (1, [1, 1, 1])


def test_a_failing_request_fails_alone_and_its_batch_mates_get_their_answers():
    async def scenario():
        host = BlockingHost()
        batcher = scheduler(host)
        first = batcher.submit(item(1))
        await host.entered()
        good, bad = batcher.infer(item(1, 5.0)), batcher.infer(item(1, np.nan))
        tasks = [asyncio.ensure_future(good), asyncio.ensure_future(bad)]
        await asyncio.sleep(0)  # both coroutines submit
        host.release()
        for _ in range(3):  # the joined call, then each alone
            await host.entered()
            host.release()
        await first
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return host.calls, results, batcher.stats.retried_alone

    calls, (good, bad), retried = asyncio.run(scenario())
    assert calls == [1, 2, 1, 1] and retried == 2
    assert good["y"].tolist() == [[10.0, 10.0]] and isinstance(bad, InferenceError)


def test_a_request_that_went_away_before_its_batch_ran_is_not_run():
    async def scenario():
        host = BlockingHost()
        batcher = scheduler(host)
        first = batcher.submit(item(1))
        await host.entered()
        gone, kept = batcher.submit(item(1)), batcher.submit(item(2))
        gone.cancel()  # its client disconnected
        host.release()
        await host.entered()
        host.release()
        await first
        return host.calls, (await kept)["y"].shape

    assert asyncio.run(scenario()) == ([1, 2], (2, 2))


@pytest.mark.parametrize("rows", [1, 3])
def test_batches_of_other_signatures_wait_for_their_own_turn(rows):
    """Requests of another shape key are not joined; they run at the next free context."""
    other = ModelConfig.model_validate({
        "name": "m", "max_batch_size": 8,
        "inputs": [{"name": "x", "datatype": "FP32", "dims": [-1, -1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "dims": [-1, -1]}]})

    async def scenario():
        host = BlockingHost()
        batcher = scheduler(host)
        first = batcher.submit(BatchItem.of(other, {"x": np.ones((1, 2), np.float32)}, None))
        await host.entered()
        wide = batcher.submit(BatchItem.of(other, {"x": np.ones((rows, 3), np.float32)}, None))
        narrow = batcher.submit(BatchItem.of(other, {"x": np.ones((1, 2), np.float32)}, None))
        host.release()
        await host.entered()  # the oldest request's key first: the wide one, alone
        host.release()
        await host.entered()
        host.release()
        await first
        return host.calls, (await wide)["y"].shape, (await narrow)["y"].shape

    assert asyncio.run(scenario()) == ([1, rows, 1], (rows, 3), (1, 2))


def test_a_window_under_half_a_millisecond_works_under_uvloop():
    """uvloop's ``call_at`` answers a deadline under 0.5 ms away with a plain ``Handle`` (no
    ``when``): a request arriving while such a timer was armed failed with AttributeError (a
    500 for the embed pipeline under 16 clients)."""
    uvloop = pytest.importorskip("uvloop")

    async def scenario():
        host = BlockingHost()
        batcher = scheduler(host, wait_s=0.0004)
        first = batcher.submit(item(1, 1.0))
        await host.entered()
        second = batcher.submit(item(1, 2.0))  # waits; its timer is due in 0.4 ms
        third = batcher.submit(item(1, 3.0))
        for _ in range(3):
            host.release()
        return [(await f)["y"][0, 0] for f in (first, second, third)]

    assert uvloop.run(scenario()) == [2.0, 4.0, 6.0]


def test_a_loaded_replica_pads_even_a_lone_request_and_an_idle_one_runs_it_at_batch_1():
    """On ONNX Runtime CUDA a context that alternates batch 1 and its padded size rebuilds its
    cuDNN plans at every switch (3-5x slower than unbatched under load on the H200): a lone
    request runs at batch 1 only while the replica is idle."""
    async def scenario():
        host = BlockingHost()
        padded = BatchPolicy.of(config(dynamic_batching={"preferred_batch_size": [4]}), "onnxruntime_cuda")
        batcher = scheduler(host, policy=padded)
        first = batcher.submit(item(1))  # idle: batch 1
        await host.entered()
        joined = [batcher.submit(item(1)) for _ in range(2)]  # queued while busy: join, padded to 4
        host.release()
        await first
        await host.entered()
        host.release()
        await asyncio.gather(*joined)
        after_load = batcher.submit(item(1))  # alone, but the previous batch joined two: padded to 4
        await host.entered()
        host.release()
        await after_load
        idle_again = batcher.submit(item(1))  # the previous batch was a lone one: batch 1
        await host.entered()
        host.release()
        await idle_again
        return host.calls

    assert asyncio.run(scenario()) == [1, 4, 4, 1]


def test_preferring_batch_1_keeps_a_lone_request_unpadded_under_load():
    policy = BatchPolicy.of(config(dynamic_batching={"preferred_batch_size": [1, 4]}), "onnxruntime_cuda")
    assert policy.padded_rows(1, loaded=True) == 1 and policy.padded_rows(2, loaded=True) == 4
    padded = BatchPolicy.of(config(dynamic_batching={"preferred_batch_size": [4]}), "onnxruntime_cuda")
    assert padded.padded_rows(1) == 1 and padded.padded_rows(1, loaded=True) == 4
