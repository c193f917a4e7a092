"""The one error table: typed serving errors -> HTTP status (and that status -> gRPC code), and
the ``{"error": ...}`` body.

Ray Serve's ``BackPressureError`` (a deployment handle refused a call because the model's
``max_queued_requests`` callers already wait) is translated to ``Overloaded`` here: 503 with
``Retry-After`` (``retry_after_headers``), in the same body shape as every other error.

When the router replica itself cannot answer (it died holding the request, or none runs),
HAProxy answers 502/503/504 in the same shape: ``deployments/haproxy.py``, ``ERROR_ANSWERS``.
"""

from __future__ import annotations

import functools
import logging
import math
import traceback
from typing import Any, Awaitable, Callable, TypeVar

import grpc
from ray.serve.exceptions import BackPressureError

from ..runtime.contract.errors import (
    ConfigError,
    DeviceOutOfMemory,
    InferenceError,
    InferenceTimeout,
    InvalidInput,
    InvalidModelFile,
    LoadFault,
    MethodNotAllowed,
    MisdirectedRequest,
    ModelNotFound,
    ModelNotReady,
    OverBudget,
    Overloaded,
    PayloadTooLarge,
    RegionNotFound,
    RequestTimeout,
    ServingError,
    SharedMemoryError,
    StoreUnavailable,
    UnsupportedMediaType,
)

logger = logging.getLogger("ray.serve")  # a name only: lands in the replica's Serve log

# Seconds a shed request is told to wait (``Retry-After`` of its 503) where the server has no
# estimate of its queued work; where it has one (``Admission``), the estimate within these bounds.
RETRY_AFTER_S = 1.0
RETRY_AFTER_MAX_S = 60.0


def retry_after_s(estimate_s: float | None) -> float:
    """Seconds a shed request is told to wait: ``estimate_s`` (the server's estimate of the work
    ahead of it) rounded up within [``RETRY_AFTER_S``, ``RETRY_AFTER_MAX_S``], or
    ``RETRY_AFTER_S`` without an estimate."""
    if estimate_s is None:
        return RETRY_AFTER_S
    return float(min(max(math.ceil(estimate_s), RETRY_AFTER_S), RETRY_AFTER_MAX_S))

STATUS_BY_ERROR: dict[type[ServingError], int] = {
    InvalidInput: 400,
    SharedMemoryError: 400,
    ModelNotFound: 404,
    RegionNotFound: 404,
    MethodNotAllowed: 405,
    RequestTimeout: 408,
    MisdirectedRequest: 421,
    PayloadTooLarge: 413,
    UnsupportedMediaType: 415,
    ModelNotReady: 503,
    StoreUnavailable: 503,
    OverBudget: 503,
    DeviceOutOfMemory: 503,
    Overloaded: 503,
    InferenceTimeout: 504,
    InferenceError: 500,
    ConfigError: 500,
    InvalidModelFile: 400,
    LoadFault: 500,
}


# The gRPC code of each HTTP status above (the gRPC front door, ``deployments.grpc_service``,
# answers with the HTTP path's own error text): the codes of the KServe v2 gRPC protocol's
# statuses as Triton answers them.
GRPC_CODE_BY_STATUS: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    405: grpc.StatusCode.UNIMPLEMENTED,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    415: grpc.StatusCode.INVALID_ARGUMENT,
    421: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
    500: grpc.StatusCode.INTERNAL,
}


def grpc_code(status: int) -> grpc.StatusCode:
    """The gRPC code of an HTTP status (``GRPC_CODE_BY_STATUS``; another 4xx is
    INVALID_ARGUMENT, another 5xx INTERNAL)."""
    return GRPC_CODE_BY_STATUS.get(status, grpc.StatusCode.INTERNAL if status >= 500 else
                                   grpc.StatusCode.INVALID_ARGUMENT)


def unwrap(exc: BaseException) -> BaseException:
    """The original exception behind Ray's wrappers (``RayTaskError.cause``)."""
    seen = 0
    while getattr(exc, "cause", None) is not None and seen < 8:
        exc = exc.cause  # type: ignore[attr-defined]
        seen += 1
    return exc


def _serving_error(exc: BaseException) -> BaseException:
    """``exc`` unwrapped; Ray's ``BackPressureError`` becomes ``Overloaded``."""
    exc = unwrap(exc)
    if isinstance(exc, BackPressureError):
        queued, limit = exc.args[:2]  # BackPressureError(num_queued_requests, max_queued_requests, ...)
        return overloaded(queued, limit, exc.retry_after_s if exc.retry_after_s is not None else RETRY_AFTER_S)
    return exc


def overloaded(queued: int, limit: int, retry_after_s: float = RETRY_AFTER_S) -> Overloaded:
    """The error of a request shed because ``queued`` requests already wait (``limit``)."""
    return Overloaded(f"server overloaded: {queued} requests already wait for this model (limit {limit}); "
                      f"retry after {math.ceil(retry_after_s)} s", retry_after_s)


def past_deadline(held: int, rate_per_s: float, timeout_s: float) -> Overloaded:
    """The error of a request shed because the ``held`` requests ahead of it would take too
    much of ``timeout_s`` (the application's ``request_timeout_s``) at ``rate_per_s``; it is
    told to come back when they would have cleared (``retry_after_s``)."""
    wait_s = retry_after_s(held / rate_per_s)
    return Overloaded(f"server overloaded: the {held} requests ahead of this one would take about "
                      f"{held / rate_per_s:.0f} s at the {rate_per_s:.1f} requests/s this replica answers, too "
                      f"close to request_timeout_s ({timeout_s:g} s); retry after {wait_s:.0f} s", wait_s)


def retry_after_headers(exc: BaseException) -> dict[str, str]:
    """``{"Retry-After": seconds}`` (RFC 9110 delay-seconds, rounded up) for a shed request
    (``Overloaded`` or Ray's ``BackPressureError``); empty for any other error."""
    exc = _serving_error(exc)
    if isinstance(exc, Overloaded):
        return {"Retry-After": str(max(0, math.ceil(exc.retry_after_s)))}
    return {}


def table_status(exc: BaseException) -> int | None:
    """The HTTP status the error table gives ``exc`` (unwrapped; 500 for a ``ServingError`` not
    in it), or None for an exception that is not a ``ServingError`` (a real fault). Logs nothing."""
    exc = _serving_error(exc)
    if not isinstance(exc, ServingError):
        return None
    return next((STATUS_BY_ERROR[c] for c in type(exc).__mro__ if c in STATUS_BY_ERROR), 500)


# The longest error message sent: one quoting a client's text (a model or region name of 20,000
# characters) grew past gRPC's 8 KiB limit on a trailer's metadata, and the client got
# RESOURCE_EXHAUSTED "Stream removed" instead of the error.
MAX_ERROR_CHARS = 2000


def _bounded(message: str) -> str:
    if len(message) <= MAX_ERROR_CHARS:
        return message
    return f"{message[:MAX_ERROR_CHARS]}... ({len(message) - MAX_ERROR_CHARS} more characters)"


def error_status(exc: BaseException, log: bool = True) -> tuple[int, str]:
    """HTTP status and client-safe message for an exception (at most ``MAX_ERROR_CHARS`` of it).

    A ``ServingError`` keeps its message; anything else is a real fault: 500 with a generic
    message (the exception is logged, never sent). Client errors (4xx) are not logged as errors;
    ``log=False`` keeps a 5xx that is an answer by design (a readiness probe's 503) out of the log.
    """
    exc = _serving_error(exc)
    if isinstance(exc, ServingError):
        status, message = table_status(exc) or 500, _bounded(exc.message)
        if status >= 500 and log and not isinstance(exc, Overloaded):  # shedding is the plan, not a fault
            logger.warning("serving error %d: %s", status, message)
        return status, message
    logger.error("internal error", exc_info=exc)
    return 500, "internal server error; the server log has the details"


def detached(exc: BaseException) -> BaseException:
    """``exc`` holding nothing but itself: the locals of every finished frame of its traceback,
    and of the exceptions chained to it, cleared; then its traceback and chain dropped.

    An exception kept in a reference cycle (Ray's request path keeps the one a replica method
    raised in its own frame; a frame that keeps an exception it caught) holds every frame it
    passed, with their locals: a failed request's body and decoded tensors, until Python's cycle
    collector runs, which large float and bytes payloads never trigger. Measured on 2 cores
    before this: a pool replica kept about 150 MB per 12 MB bad request (1.1 GB after five), the
    OCR pipeline 650 MB per oversized image. Frames still running (the caller's) are left as
    they are.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        current = current.__cause__ or current.__context__
    exc.__traceback__ = None
    exc.__cause__ = exc.__context__ = None
    return exc


T = TypeVar("T")


def errors_as_values(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T | ServingError]]:
    """For a replica method called through a deployment handle: a ``ServingError`` it raises is
    returned, ``detached``, instead of raised across the handle (raised, it stays in a cycle
    with Ray's frames and their copy of the request until the cycle collector runs); the
    caller raises it again (``raise_if_error``). Other exceptions (real faults) are raised."""

    @functools.wraps(method)
    async def wrapper(*args: Any, **kwargs: Any) -> T | ServingError:
        try:
            return await method(*args, **kwargs)
        except ServingError as exc:
            return detached(exc)  # type: ignore[return-value]

    return wrapper


def raise_if_error(result: T | ServingError) -> T:
    """``result`` of an ``errors_as_values`` method, or its error raised here."""
    if isinstance(result, ServingError):
        raise result
    return result
