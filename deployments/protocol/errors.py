"""The one error table: typed serving errors -> HTTP status, and the ``{"error": ...}`` body."""

from __future__ import annotations

import logging

from ..runtime.contract.errors import (
    ConfigError,
    InferenceError,
    InferenceTimeout,
    InvalidInput,
    MethodNotAllowed,
    ModelNotFound,
    ModelNotReady,
    OverBudget,
    PayloadTooLarge,
    ServingError,
    UnsupportedMediaType,
)

logger = logging.getLogger("ray.serve")  # a name only: lands in the replica's Serve log

STATUS_BY_ERROR: dict[type[ServingError], int] = {
    InvalidInput: 400,
    ModelNotFound: 404,
    MethodNotAllowed: 405,
    PayloadTooLarge: 413,
    UnsupportedMediaType: 415,
    ModelNotReady: 503,
    OverBudget: 503,
    InferenceTimeout: 504,
    InferenceError: 500,
    ConfigError: 500,
}


def unwrap(exc: BaseException) -> BaseException:
    """The original exception behind Ray's wrappers (``RayTaskError.cause``)."""
    seen = 0
    while getattr(exc, "cause", None) is not None and seen < 8:
        exc = exc.cause  # type: ignore[attr-defined]
        seen += 1
    return exc


def error_status(exc: BaseException) -> tuple[int, str]:
    """HTTP status and client-safe message for an exception.

    A ``ServingError`` keeps its message; anything else is a real fault: 500 with a generic
    message (the exception is logged, never sent). Client errors (4xx) are not logged as errors.
    """
    exc = unwrap(exc)
    if isinstance(exc, ServingError):
        for cls in type(exc).__mro__:
            if cls in STATUS_BY_ERROR:
                status = STATUS_BY_ERROR[cls]
                break
        else:
            status = 500
        if status >= 500:
            logger.warning("serving error %d: %s", status, exc.message)
        return status, exc.message
    logger.error("internal error", exc_info=exc)
    return 500, "internal server error; the server log has the details"
