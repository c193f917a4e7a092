"""The gRPC service under ``bench.grpc_fuzz``'s mutated requests (``bench.fuzz``'s mutations where a
protobuf message carries them, and gRPC's own): no INTERNAL or UNKNOWN for a client's mistake,
no message with internal text, and the server serves afterwards."""

from __future__ import annotations

import pytest

from bench import grpc_fuzz

pytestmark = pytest.mark.integration

CASES = 150


def test_mutated_grpc_requests_get_client_errors_and_the_server_keeps_serving(grpc_url):
    report = grpc_fuzz.fuzz(grpc_url, CASES, seed=0)
    assert report.sent == CASES
    assert report.findings == []
    assert report.alive_after
    # not vacuous: valid calls passed and mutated ones were refused as the client's mistakes
    assert report.codes.get("OK", 0) >= CASES // 25 and report.codes.get("INVALID_ARGUMENT", 0) > CASES // 4
    assert report.codes.get("NOT_FOUND", 0) > 0
