"""The load generator checks answers, not only statuses (``bench.loadgen.Expected``): a 200 whose
outputs are missing, empty, of another shape or of other values counts as an error."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from bench import echo
from bench.loadgen import HEADER_LENGTH, Expected, expected_from_onnx, make_workload, run

TINY_CNN = Path(__file__).resolve().parents[2] / "engines" / "tiny_cnn" / "1" / "model.onnx"


def binary_answer(name: str, datatype: str, shape: list[int], raw: bytes) -> tuple[bytes, dict[str, str]]:
    head = json.dumps({"model_name": "m", "outputs": [{"name": name, "datatype": datatype, "shape": shape,
                                                      "parameters": {"binary_data_size": len(raw)}}]}).encode()
    return head + raw, {HEADER_LENGTH: str(len(head))}


def json_answer(name: str, datatype: str, shape: list[int], data: list) -> tuple[bytes, dict[str, str]]:
    return json.dumps({"outputs": [{"name": name, "datatype": datatype, "shape": shape, "data": data}]}).encode(), {}


EXPECTED = Expected.of({"y": np.arange(6, dtype=np.float32).reshape(2, 3)}, {"y": "FP32"})


def test_a_right_answer_binary_or_json_has_no_problem():
    values = np.arange(6, dtype=np.float32)
    assert EXPECTED.problem(*binary_answer("y", "FP32", [2, 3], values.tobytes()), compare=True) is None
    assert EXPECTED.problem(*json_answer("y", "FP32", [2, 3], values.tolist()), compare=True) is None


def test_an_answer_with_empty_outputs_is_wrong():
    """The case that made this check: a server answering 200 with 0-byte outputs."""
    problem = EXPECTED.problem(*binary_answer("y", "FP32", [2, 3], b""), compare=False)
    assert problem == "output 'y' carries 0 bytes, expected 24"


@pytest.mark.parametrize("answer, words", [
    (binary_answer("z", "FP32", [2, 3], bytes(24)), "no output 'y'"),
    (binary_answer("y", "FP32", [3, 2], bytes(24)), "expected FP32 [2, 3]"),
    (binary_answer("y", "INT32", [2, 3], bytes(24)), "expected FP32 [2, 3]"),
    (binary_answer("y", "FP32", [2, 3], bytes(20)), "output 'y' carries 20 bytes, expected 24"),
    (json_answer("y", "FP32", [2, 3], [0.0] * 5), "unparseable answer"),
    ((b"not json", {}), "unparseable answer"),
])
def test_a_wrong_output_is_named(answer, words):
    assert words in EXPECTED.problem(*answer, compare=False)


def test_values_are_compared_only_when_sampled():
    wrong = binary_answer("y", "FP32", [2, 3], np.ones(6, np.float32).tobytes())
    assert EXPECTED.problem(*wrong, compare=False) is None
    assert EXPECTED.problem(*wrong, compare=True) == "output 'y' differs from the reference"


def test_the_reference_is_the_model_file_run_in_process():
    x = np.random.default_rng(0).random((1, 3, 224, 224), dtype=np.float32)
    expected = expected_from_onnx(str(TINY_CNN), x)
    ((name, (datatype, shape)),) = expected.outputs.items()
    assert datatype == "FP32" and shape == expected.values[name].shape and shape[0] == 1
    raw = expected.values[name].tobytes()
    assert expected.problem(*binary_answer(name, "FP32", list(shape), raw), compare=True) is None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def wrong_server():
    """An HTTP server answering every infer 200 with the echo's output, but empty."""
    port = free_port()
    body, headers = binary_answer("echo", "FP32", [1], b"")
    loop = asyncio.new_event_loop()
    started = threading.Event()

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=body, headers=headers)

    async def serve() -> web.AppRunner:
        app = web.Application()
        app.router.add_post("/v2/models/{name}/infer", answer)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    def main() -> None:
        runner = loop.run_until_complete(serve())
        started.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    assert started.wait(30)
    yield f"http://127.0.0.1:{port}"
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)


def test_the_load_generator_counts_an_empty_200_as_an_error_not_a_success(wrong_server):
    x = np.zeros((1, 3, 8, 8), np.float32)
    checked = make_workload("checked", wrong_server, "m", "input", x, binary=True, expected=echo.expected())
    unchecked = make_workload("unchecked", wrong_server, "m", "input", x, binary=True)
    good, bad = run([(unchecked, 1), (checked, 1)], duration_s=0.5, warmup_s=0.1)
    assert good.requests > 0 and good.errors == 0
    assert bad.requests == 0 and bad.errors > 0
    assert list(bad.error_statuses) == ["wrong answer: output 'echo' carries 0 bytes, expected 4"]
