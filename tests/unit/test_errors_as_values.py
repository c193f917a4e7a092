"""A replica's errors leave it as values, holding none of the request's data
(``protocol.errors.detached``, ``errors_as_values``, ``raise_if_error``)."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from deployments.protocol.errors import detached, error_status, errors_as_values, raise_if_error
from deployments.runtime.contract.errors import InvalidInput, Overloaded


class Payload:
    """Stands for a request body or its decoded tensors (weak-referenceable)."""


def _decode(payload: Payload) -> None:
    raise InvalidInput("input 'x': bad shape")


def _caught_with_payload() -> tuple[BaseException, weakref.ref]:
    payload = Payload()
    try:
        try:
            _decode(payload)
        except InvalidInput as inner:
            raise InvalidInput(f"wrapped: {inner.message}") from inner
    except InvalidInput as exc:
        return exc, weakref.ref(payload)


def test_detached_drops_the_frames_locals_even_while_the_exception_lives():
    gc.disable()  # the point: no cycle collector to rely on
    try:
        exc, payload = _caught_with_payload()
        assert payload() is not None  # the traceback's frames hold it
        assert detached(exc) is exc
        assert payload() is None
        assert exc.__traceback__ is None and exc.__cause__ is None and exc.__context__ is None
        assert error_status(exc) == (400, "wrapped: input 'x': bad shape")
    finally:
        gc.enable()


def test_errors_as_values_returns_serving_errors_and_raises_faults():
    @errors_as_values
    async def method(kind: str) -> dict:
        if kind == "client":
            raise Overloaded("server overloaded: 9 requests already wait", 2.0)
        if kind == "fault":
            raise RuntimeError("engine exploded")
        return {"y": 1}

    assert raise_if_error(asyncio.run(method("ok"))) == {"y": 1}
    returned = asyncio.run(method("client"))
    assert isinstance(returned, Overloaded) and returned.retry_after_s == 2.0 and returned.__traceback__ is None
    with pytest.raises(Overloaded, match="9 requests already wait"):
        raise_if_error(returned)
    with pytest.raises(RuntimeError, match="engine exploded"):
        asyncio.run(method("fault"))
    assert method.__name__ == "method"  # Ray finds handle methods by name
