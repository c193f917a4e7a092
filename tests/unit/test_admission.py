"""``admission.Admission``: the request bounds of a model replica, and the shedding of requests that
could only time out (the held requests would take longer than ``request_timeout_s`` to clear)."""

from __future__ import annotations

import contextlib

import pytest

from deployments.admission import Admission
from deployments.protocol.errors import error_status, retry_after_headers
from deployments.runtime.contract.errors import Overloaded


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def hold(admission: Admission, stack: contextlib.ExitStack) -> contextlib.ExitStack:
    """Admit one request and keep it until ``stack`` is closed; returns its own stack."""
    own = contextlib.ExitStack()
    own.enter_context(admission.request())
    stack.callback(own.close)
    return own


def answer_one_a_second(held: list[contextlib.ExitStack], clock: Clock) -> None:
    for request in held:
        clock.now += 1.0
        request.close()


def test_the_bounds_count_requests():
    admission = Admission(2, 1)
    with contextlib.ExitStack() as stack:
        for _ in range(3):
            hold(admission, stack)
        with pytest.raises(Overloaded, match=r"1 requests already wait for this model \(limit 1\)"):
            hold(admission, stack)
    assert admission.in_flight == 0


@pytest.fixture
def timed() -> tuple[Clock, Admission]:
    """An admission with a 10 s timeout on a clock the test moves."""
    clock = Clock()
    return clock, Admission(512, None, timeout_s=10.0, clock=clock)


def test_a_request_that_could_only_time_out_is_shed_at_once(timed):
    """A replica answering 1 request/s with a 10 s timeout: 11 held -> the next would wait ~11 s;
    shed from 3/4 of the timeout (``SHED_FRACTION``: 7.5 s here)."""
    clock, admission = timed
    with contextlib.ExitStack() as stack:
        held = [hold(admission, stack) for _ in range(30)]
        assert admission.rate() is None  # nothing answered yet: only the bounds shed
        hold(admission, stack).close()
        answer_one_a_second(held[:19], clock)  # 19 answers while the rest wait
        assert admission.in_flight == 11 and admission.rate() == pytest.approx(1.0)
        with pytest.raises(Overloaded) as shed:
            hold(admission, stack)
        assert error_status(shed.value) == (503, "server overloaded: the 11 requests ahead of this one would take "
                                                 "about 11 s at the 1.0 requests/s this replica answers, too close to "
                                                 "request_timeout_s (10 s); retry after 11 s")
        assert retry_after_headers(shed.value) == {"Retry-After": "11"}  # when those ahead would have cleared
        for request in held[19:23]:
            request.close()  # 7 held: they clear in ~7 s
        hold(admission, stack)
        clock.now += Admission.RATE_STALE_S + 1  # no answer for a while: the rate is unknown again
        assert admission.rate() is None
        for _ in range(5):
            hold(admission, stack)
    assert admission.in_flight == 0


def test_a_burst_after_idle_is_judged_by_the_last_busy_periods_rate(timed):
    """The opening burst of an overload comes before the busy period has a rate of its own."""
    clock, admission = timed
    with contextlib.ExitStack() as stack:
        answer_one_a_second([hold(admission, stack) for _ in range(20)], clock)
    assert admission.in_flight == 0 and admission.rate() is None and admission.expected_rate() == pytest.approx(1.0)
    clock.now += 3600
    with contextlib.ExitStack() as stack:
        for _ in range(8):  # 7.5 s of work at 1/s: the 9th is shed at once
            hold(admission, stack)
        with pytest.raises(Overloaded, match=r"the 8 requests ahead of this one would take about 8 s at the 1\.0 "):
            hold(admission, stack)



def test_retry_after_follows_the_estimate_of_the_queued_work_within_1_to_60_s():
    """Told 1 s while tens of seconds of work waited, shed clients came back into the same
    queue: a full queue at a known rate says when the requests held would have cleared."""
    clock = Clock()
    admission = Admission(1, 2, clock=clock)
    with contextlib.ExitStack() as stack:
        for _ in range(3):
            hold(admission, stack)
        with pytest.raises(Overloaded, match=r"retry after 1 s") as shed:
            hold(admission, stack)
        assert retry_after_headers(shed.value) == {"Retry-After": "1"}  # no rate yet: no estimate
    with contextlib.ExitStack() as stack:
        held = [hold(admission, stack), hold(admission, stack)]
        for _ in range(Admission.RATE_MIN_DONE):  # 1 request/s, within its bounds
            clock.now += 1.0
            held.pop(0).close()
            held.append(hold(admission, stack))
        hold(admission, stack)
        with pytest.raises(Overloaded, match=r"2 requests already wait for this model \(limit 2\); retry after 3 s"):
            hold(admission, stack)
    clock = Clock()
    admission = Admission(512, None, timeout_s=100.0, clock=clock)
    with contextlib.ExitStack() as stack:
        answer_one_a_second([hold(admission, stack) for _ in range(20)], clock)
        for _ in range(76):  # 76 s of work at 1/s, over 3/4 of the 100 s timeout
            hold(admission, stack)
        with pytest.raises(Overloaded, match=r"would take about 76 s .*; retry after 60 s") as shed:
            hold(admission, stack)
        assert retry_after_headers(shed.value) == {"Retry-After": "60"}
