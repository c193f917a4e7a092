"""``ModelClient.cut_unassigned``: when the application is being deleted, a call that no replica
has taken answers 503 once the model has finished no call for a while; a call a replica took
is left to finish. The handle is a stand-in
with the two parts of Serve's ``DeploymentResponse`` the client relies on: the assignment future
``_replica_result_future`` and ``cancel()``, after which awaiting raises ``RequestCancelledError``."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from ray.serve.exceptions import RequestCancelledError

from deployments.client import ModelClient
from deployments.runtime.contract.errors import ModelNotReady


class Response:
    def __init__(self, assigned: bool) -> None:
        self._replica_result_future = asyncio.get_running_loop().create_future()
        if assigned:
            self._replica_result_future.set_result("replica")
        self.answer = asyncio.get_running_loop().create_future()

    def cancel(self) -> None:
        self._replica_result_future.cancel()
        self.answer.cancel()

    def __await__(self):
        try:
            return (yield from self.answer.__await__())
        except asyncio.CancelledError:
            raise RequestCancelledError("r1") from None


class Handle:
    def __init__(self, assigned: bool) -> None:
        self.assigned, self.responses = assigned, []

    @property
    def infer(self):
        return self

    def remote(self, inputs, outputs):
        self.responses.append(Response(self.assigned))
        return self.responses[-1]


def test_only_calls_no_replica_took_are_cut_with_a_503_once_the_model_finishes_none():
    async def scenario():
        queued, taken = Handle(assigned=False), Handle(assigned=True)
        client = ModelClient({"ocr_det": queued, "ocr_cls": taken}, None, [])
        x = {"x": np.zeros((1, 3), np.float32)}
        waiting = asyncio.ensure_future(client.infer("ocr_det", x))
        running = asyncio.ensure_future(client.infer("ocr_cls", x))
        await asyncio.sleep(0)
        client._last_done["ocr_det"] = time.monotonic()  # a draining replica still finishes calls
        client.cut_unassigned(["ocr_det", "ocr_cls"], idle_s=60.0)
        assert not waiting.done()
        client.cut_unassigned(["ocr_det", "ocr_cls"], idle_s=0.0)
        with pytest.raises(ModelNotReady, match="model 'ocr_det' stopped before a replica took the request"):
            await waiting
        taken.responses[0].answer.set_result({"y": 1})
        assert await running == {"y": 1}
        assert client._waiting == {"ocr_det": set(), "ocr_cls": set()} and client._cut == set()

    asyncio.run(scenario())


def test_the_clients_calls_fit_the_signatures_of_the_deployments_they_call():
    """``ModelClient.infer`` / ``infer_body`` pass what ``PoolDeployment.infer`` / ``infer_body``
    take (a handle call is not type-checked: a missing argument failed every pool request)."""
    import inspect

    from deployments.client import ModelClient
    from deployments.pool import PoolDeployment

    sent = []

    class Handle:
        def options(self, **_):
            return self

        def __getattr__(self, method):
            class Method:
                def remote(self, *args):
                    sent.append((method, args))
                    future = asyncio.get_event_loop().create_future()
                    future.set_result(None)
                    return future
            return Method()

    client = ModelClient({}, Handle(), ["m"])
    asyncio.run(client.infer("m", {"x": np.zeros(1)}, None, "m"))
    asyncio.run(client.infer_body("m", "m", "1", True, [b"{}"], None, 60.0))
    for method, args in sent:
        inspect.signature(getattr(PoolDeployment.func_or_class, method)).bind(None, *args)  # raises TypeError if not
    assert [m for m, _ in sent] == ["infer", "infer_body"]


class Tracked(Response):
    """A ``Response`` that records whether the client called ``cancel()``; as Serve's, awaiting
    it in a task that is cancelled raises ``CancelledError`` unless ``cancel()`` was called."""

    def __init__(self, assigned: bool) -> None:
        super().__init__(assigned)
        self.cancel_called = False

    def cancel(self) -> None:
        self.cancel_called = True
        super().cancel()

    def __await__(self):
        try:
            return (yield from self.answer.__await__())
        except asyncio.CancelledError:
            if self.cancel_called:
                raise RequestCancelledError("r1") from None
            raise


@pytest.mark.parametrize("assigned", [False, True])
def test_a_call_whose_caller_stops_waiting_is_cancelled_at_serve_queued_or_running(assigned):
    """A request that timed out (or was shed, or whose client left) cancels its model call:
    awaiting a handle response alone leaves the call queued, then running, after the answer."""
    async def scenario():
        handle = Handle(assigned)
        handle.remote = lambda inputs, outputs: handle.responses.append(Tracked(assigned)) or handle.responses[-1]
        client = ModelClient({"all-MiniLM-L6-v2": handle}, None, [])
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(client.infer("all-MiniLM-L6-v2", {"x": np.zeros((1, 3), np.float32)}), 0.01)
        assert [r.cancel_called for r in handle.responses] == [True]
        assert client._waiting == {"all-MiniLM-L6-v2": set()}

    asyncio.run(scenario())
