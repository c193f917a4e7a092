"""The router's part: time each infer request's phases, count it, log its failure.

``observe_infer`` wraps the router's infer route (outside its error handler, so it sees the
final status); ``phase(request, "compute_input_s")`` times a block inside the route, and
``add_phases`` adds decode and encode times measured elsewhere. A request
for an unknown model or a version not served is not counted (Triton counts per model), only
logged.

Request logs (logger ``ray.serve.requests``, one JSON object per line): every failed request
with ``model``, ``version``, ``status``, ``reason`` (Triton's failure reason), ``error`` (the
message the client got), ``request_id`` (Ray Serve's, also sent back as ``X-Request-Id``) and
``duration_ms``; successful requests only with ``access_log: true``.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from typing import Any, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from .metrics import RequestTiming, RouterRecorder, reason_for

request_log = logging.getLogger("ray.serve.requests")  # a child of Serve's logger: lands in the replica log


class RouterObserver:
    """Counts and logs the router's infer requests. ``versions``: model name -> served version."""

    def __init__(self, versions: dict[str, str], access_log: bool = False) -> None:
        self.recorder = RouterRecorder()
        self.versions = versions
        self.access_log = access_log

    def finished(self, request: Request, response: Response, timing: RequestTiming) -> None:
        name = request.path_params.get("name", "")
        version = self.versions.get(name)
        status = response.status_code
        asked = request.path_params.get("version")
        label = _version_label(asked) if asked is not None else version
        if version is not None and not (asked is not None and status == 404):
            # a 404 on a versioned route is a version not served: a label per made-up version
            # would let clients grow the series without bound
            self.recorder.finished(name, label, status, timing)
        if status != 200 or self.access_log:
            self._log(request, response, name, label, timing)

    def _log(self, request: Request, response: Response, name: str, version: str | None,
             timing: RequestTiming) -> None:
        status = response.status_code
        line: dict[str, Any] = {"event": "request_failed" if status != 200 else "request",
                                "model": name, "version": version, "status": status}
        if status != 200:
            line["reason"] = reason_for(status)
            try:
                line["error"] = json.loads(bytes(response.body))["error"]
            except Exception:
                line["error"] = None
        line["request_id"] = _request_id(request)
        line["duration_ms"] = round((time.perf_counter() - timing.start) * 1e3, 3)
        (request_log.warning if status >= 500 else request_log.info)(json.dumps(line))


def _version_label(asked: str) -> str:
    """The label of a version as a path spells it: a served version has one label however it is
    spelled ("01" and "001" are version 1, as the routes read them), since a label per spelling
    would let clients grow the series without bound. Other text (a 404) is kept as it came."""
    return str(int(asked)) if len(asked) <= 18 and asked.isascii() and asked.isdigit() else asked


def _request_id(request: Request) -> str | None:
    """Ray Serve's id of the request (its proxy sends it back as ``X-Request-Id``); Ray 2.60 has
    no public getter, so the private one, else the client's ``X-Request-Id`` header."""
    try:
        from ray.serve.context import _get_serve_request_context

        found = _get_serve_request_context().request_id
    except Exception:  # outside a Serve replica
        found = ""
    return found or request.headers.get("x-request-id")


_TIMING_KEY = "trt_serve.timing"  # the request's RequestTiming in its ASGI scope (cheaper than request.state)


def observe_infer(route: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
    """Wrap an infer route of an object with an ``observer`` attribute (None: no recording)."""

    @functools.wraps(route)
    async def wrapper(self: Any, request: Request) -> Response:
        observer: RouterObserver | None = getattr(self, "observer", None)
        if observer is None:
            return await route(self, request)
        timing = request.scope[_TIMING_KEY] = RequestTiming(time.perf_counter())
        response = await route(self, request)
        observer.finished(request, response, timing)
        return response

    return wrapper


def add_phases(request: Request, compute_input_s: float, compute_output_s: float) -> None:
    """Add decode and encode seconds measured elsewhere (``protocol.answer.Answer``: here, or in
    the pool replica that decoded the body) to the request's ``RequestTiming`` (if observed)."""
    timing: RequestTiming | None = request.scope.get(_TIMING_KEY)
    if timing is not None:
        timing.compute_input_s += compute_input_s
        timing.compute_output_s += compute_output_s


class phase:
    """``with phase(request, "compute_input_s"):`` adds the block's seconds to that field of the
    request's ``RequestTiming`` (if observed). A class, not ``contextlib.contextmanager``: it
    runs twice per request, and a generator-based one cost about 1.5 us each."""

    __slots__ = ("_timing", "_field", "_start")

    def __init__(self, request: Request, field: str) -> None:
        self._timing: RequestTiming | None = request.scope.get(_TIMING_KEY)
        self._field = field

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        timing = self._timing
        if timing is not None:
            setattr(timing, self._field, getattr(timing, self._field) + time.perf_counter() - self._start)
