"""Admission: how many requests a model or pool replica holds at once, and which it sheds (503)."""

from __future__ import annotations

import collections
import time
from typing import Callable

from .protocol.errors import overloaded, past_deadline, retry_after_s


class Admission:
    """How many requests a replica holds for its model at once: ``max_ongoing_requests`` run or
    wait for an execution context (or a batch), ``max_queued_requests`` more wait; one more is
    shed at once (``Overloaded``: 503, ``Retry-After``, the error body the router's handle gave).
    It stands where Serve's own bounds stood when the router called the model: the replica is its
    model's ingress now, and Serve's direct-ingress shedding answers plain text. HTTP requests and
    calls through handles (a pipeline's steps) count alike. ``max_queued_requests`` None: no bound.

    With ``timeout_s`` (the application's ``request_timeout_s``) a request is also shed when the
    requests already held would take longer than ``SHED_FRACTION`` of it to clear at the rate
    this replica answers: it would only wait to be answered 504. The bounds count requests,
    and a slow model (the OCR pipeline on a small CPU machine) can hold more than it serves
    within the timeout: then every request is answered 504 and none 503. The margin covers the
    time a request spends before it is admitted (its body read by a busy replica: seconds under
    overload) and the rate falling as load grows.
    The rate is the current busy period's once ``RATE_MIN_DONE`` requests finished over
    ``RATE_MIN_S`` seconds of it, until then the last busy period's (the opening burst of an
    overload is judged by it); none before the first, or after ``RATE_STALE_S`` without an
    answer: then only the bounds shed.
    """

    RATE_MIN_DONE = 16
    RATE_MIN_S = 1.0
    RATE_STALE_S = 5.0
    SHED_FRACTION = 0.75

    def __init__(self, max_ongoing_requests: int, max_queued_requests: int | None,
                 timeout_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_ongoing_requests = max_ongoing_requests
        self.max_queued_requests = max_queued_requests
        self.timeout_s = timeout_s
        self.in_flight = 0
        self._clock = clock
        self._done: collections.deque[float] = collections.deque(maxlen=256)  # this busy period's answers
        self._last_rate: float | None = None  # the last busy period's, at its end

    def rate(self) -> float | None:
        """Requests answered per second over this busy period's last answers (at most 256), or
        None while too few, too brief or stale to say."""
        done = self._done
        if len(done) < self.RATE_MIN_DONE or self._clock() - done[-1] > self.RATE_STALE_S:
            return None
        span = done[-1] - done[0]
        return (len(done) - 1) / span if span >= self.RATE_MIN_S else None

    def expected_rate(self) -> float | None:
        """``rate()``, else the last busy period's."""
        rate = self.rate()
        return rate if rate is not None else self._last_rate

    def check(self) -> None:
        """Whether a request would be admitted now, holding nothing: the routes ask before they
        read and decode a body, so that shedding costs an overloaded replica almost nothing.

        Raises:
            Overloaded: as ``request``; its ``Retry-After`` is the time the requests held would
                take at the replica's rate, where it has one (``protocol.errors.retry_after_s``).
        """
        waiting = self.in_flight - self.max_ongoing_requests
        if self.max_queued_requests is not None and waiting >= self.max_queued_requests:
            rate = self.expected_rate()
            raise overloaded(waiting, self.max_queued_requests,
                             retry_after_s(self.in_flight / rate if rate is not None else None))
        rate = self.expected_rate() if self.timeout_s is not None and self.in_flight else None
        if rate is not None and self.in_flight / rate > self.SHED_FRACTION * self.timeout_s:
            raise past_deadline(self.in_flight, rate, self.timeout_s)

    def request(self) -> "Admission":
        """``with admission.request():`` holds one place for a request.

        Raises:
            Overloaded: ``max_queued_requests`` already wait, or the requests held would take
                more than ``SHED_FRACTION`` of ``timeout_s`` to clear at this replica's rate.
        """
        return self

    def __enter__(self) -> None:
        self.check()
        self.in_flight += 1

    def __exit__(self, *exc: object) -> None:
        self.in_flight -= 1
        if self.in_flight:
            self._done.append(self._clock())
        else:  # idle: the next busy period measures its own rate, judged by this one's until then
            self._last_rate = self.rate() or self._last_rate
            self._done.clear()
