"""bench.frontdoors checks a gRPC answer as bench.loadgen checks an HTTP one: a ModelInferResponse
whose raw output is missing, short, of another shape or of other values is a wrong answer."""

from __future__ import annotations

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from bench.frontdoors import grpc_problem, shm_fits
from bench.loadgen import Expected

EXPECTED = Expected.of({"y": np.arange(6, dtype=np.float32).reshape(2, 3)}, {"y": "FP32"})


def response(raw: bytes | None, shape=(2, 3), datatype="FP32", name="y") -> pb.ModelInferResponse:
    answer = pb.ModelInferResponse(model_name="m")
    answer.outputs.add(name=name, datatype=datatype, shape=list(shape))
    if raw is not None:
        answer.raw_output_contents.append(raw)
    return answer


def test_a_right_grpc_answer_has_no_problem():
    assert grpc_problem(response(np.arange(6, dtype=np.float32).tobytes()), EXPECTED, compare=True) is None


def test_wrong_grpc_answers_are_named():
    right = np.arange(6, dtype=np.float32)
    assert grpc_problem(response(right.tobytes(), name="z"), EXPECTED, True) == "no output 'y' (answered: ['z'])"
    assert grpc_problem(response(b""), EXPECTED, True) == "output 'y' carries 0 bytes, expected 24"
    assert grpc_problem(response(None), EXPECTED, True) == "output 'y' carries data of shape None, expected [2, 3]"
    assert grpc_problem(response(right.tobytes(), shape=(3, 2)), EXPECTED, True) == (
        "output 'y' is FP32 [3, 2], expected FP32 [2, 3]")
    assert grpc_problem(response((right + 1).tobytes()), EXPECTED, True) == "output 'y' differs from the reference"
    assert grpc_problem(response((right + 1).tobytes()), EXPECTED, compare=False) is None  # values only when sampled


def test_shm_regions_per_client_only_where_half_of_dev_shm_holds_them():
    assert shm_fits(256, 606_208, free_bytes=2 * 256 * 606_208)
    assert not shm_fits(256, 606_208, free_bytes=64 * 2**20)
