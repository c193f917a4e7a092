"""What Triton's example HTTP clients (simple_http_*.py in triton-inference-server/client) do,
with tritonclient unmodified against the real server: Triton's quickstart models, query
parameters, JSON and binary inputs mixed, no requested outputs, compressed requests and
responses, concurrent sync/async/asyncio clients, BYTES numbers as text, Triton's error words."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import requests

pytestmark = pytest.mark.integration

QUERY = {"test_1": 1, "test_2": 2}  # the examples send these on every call


@pytest.fixture(scope="module")
def url(server) -> str:
    return server.removeprefix("http://")


@pytest.fixture(scope="module")
def client(url):
    import tritonclient.http as httpclient

    return httpclient.InferenceServerClient(url, network_timeout=120, concurrency=2)


def pair(batch: int = 1) -> tuple[np.ndarray, np.ndarray]:
    a = np.tile(np.arange(16, dtype=np.int32), (batch, 1))
    return a, np.full((batch, 16), -1, np.int32) * np.arange(1, batch + 1, dtype=np.int32)[:, None]


def simple_request(a: np.ndarray, b: np.ndarray, module=None, outputs: bool = True):
    """INPUT0 as JSON and INPUT1 binary; OUTPUT0 binary and OUTPUT1 JSON (the examples' mix)."""
    import tritonclient.http as httpclient

    module = module or httpclient
    inputs = [module.InferInput("INPUT0", list(a.shape), "INT32"), module.InferInput("INPUT1", list(b.shape), "INT32")]
    inputs[0].set_data_from_numpy(a, binary_data=False)
    inputs[1].set_data_from_numpy(b, binary_data=True)
    if not outputs:
        return inputs, None
    return inputs, [module.InferRequestedOutput("OUTPUT0", binary_data=True),
                    module.InferRequestedOutput("OUTPUT1", binary_data=False)]


def assert_sum_and_difference(result, a, b):
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


@pytest.mark.parametrize("outputs", [True, False], ids=["requested-outputs", "no-requested-outputs"])
def test_simple_with_query_params_and_mixed_json_binary_tensors(client, outputs):
    a, b = pair()
    inputs, requested = simple_request(a, b, outputs=outputs)
    result = client.infer("simple", inputs, outputs=requested, query_params=QUERY)
    assert_sum_and_difference(result, a, b)
    assert result.get_response()["model_name"] == "simple"


@pytest.mark.parametrize("request_coding, response_coding", [
    ("gzip", None), (None, "deflate"), ("deflate", "gzip"), ("gzip", "deflate")])
def test_compressed_requests_and_responses(client, request_coding, response_coding):
    a, b = pair(8)  # 8 rows: the JSON output is over the 500-byte compression threshold
    inputs, outputs = simple_request(a, b)
    result = client.infer("simple", inputs, outputs=outputs, query_params=QUERY,
                          request_compression_algorithm=request_coding,
                          response_compression_algorithm=response_coding)
    assert_sum_and_difference(result, a, b)


@pytest.mark.parametrize("coding, decode", [("deflate", zlib.decompress), ("gzip", gzip.decompress)])
def test_response_carries_the_asked_content_encoding(server, coding, decode):
    a, b = pair(8)
    body = {"inputs": [{"name": n, "shape": [8, 16], "datatype": "INT32", "data": x.ravel().tolist()}
                       for n, x in (("INPUT0", a), ("INPUT1", b))]}
    r = requests.post(f"{server}/v2/models/simple/infer", json=body, headers={"Accept-Encoding": coding}, stream=True)
    raw = r.raw.read(decode_content=False)
    assert r.status_code == 200 and r.headers["Content-Encoding"] == coding
    outputs = {o["name"]: o["data"] for o in json.loads(decode(raw))["outputs"]}
    assert outputs == {"OUTPUT0": (a + b).ravel().tolist(), "OUTPUT1": (a - b).ravel().tolist()}


def test_unknown_content_encoding_is_415_and_corrupt_gzip_is_400(server):
    r = requests.post(f"{server}/v2/models/simple/infer", data=b"{}", headers={"Content-Encoding": "br"})
    assert r.status_code == 415
    assert r.json()["error"] == "Content-Encoding 'br' is not supported; supported: ['deflate', 'gzip', 'identity']"
    r = requests.post(f"{server}/v2/models/simple/infer", data=b"not gzip", headers={"Content-Encoding": "gzip"})
    assert r.status_code == 400 and "not valid gzip data" in r.json()["error"]


def test_async_infer_with_two_requests_in_flight(client):
    a, b = pair()
    inputs, outputs = simple_request(a, b)
    pending = [client.async_infer("simple", inputs, outputs=outputs) for _ in range(2)]
    for request in pending:
        assert_sum_and_difference(request.get_result(), a, b)


def test_asyncio_client_infers_and_gets_tritons_unknown_model_words(url):
    import tritonclient.http.aio as aioclient
    from tritonclient.utils import InferenceServerException

    async def run():
        async with aioclient.InferenceServerClient(url) as aio:
            a, b = pair()
            inputs, outputs = simple_request(a, b, module=aioclient)
            result = await aio.infer("simple", inputs, outputs=outputs, query_params=QUERY,
                                     request_compression_algorithm="gzip", response_compression_algorithm="deflate")
            assert_sum_and_difference(result, a, b)
            with pytest.raises(InferenceServerException) as info:
                await aio.infer("wrong_model_name", inputs, outputs=outputs)
            return info.value.message()

    assert asyncio.run(run()).startswith("Request for unknown model: 'wrong_model_name' is not found; ")


def test_unknown_model_messages_start_with_tritons_words(client):
    from tritonclient.utils import InferenceServerException

    a, b = pair()
    inputs, outputs = simple_request(a, b)
    with pytest.raises(InferenceServerException) as info:
        client.infer("wrong_model_name", inputs, outputs=outputs, query_params=QUERY)
    assert info.value.message().startswith("Request for unknown model: 'wrong_model_name' is not found; available")
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("wrong_model_name", query_params=QUERY)
    assert "Request for unknown model" in info.value.message()


def text(values: np.ndarray) -> np.ndarray:
    return np.array([str(v).encode() for v in values.reshape(-1)], dtype=object).reshape(values.shape)


def test_simple_string_sums_numbers_held_as_strings(client):
    import tritonclient.http as httpclient

    a, b = pair()
    inputs = [httpclient.InferInput("INPUT0", [1, 16], "BYTES"), httpclient.InferInput("INPUT1", [1, 16], "BYTES")]
    inputs[0].set_data_from_numpy(text(a), binary_data=True)
    inputs[1].set_data_from_numpy(text(b), binary_data=False)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
               httpclient.InferRequestedOutput("OUTPUT1", binary_data=False)]
    result = client.infer("simple_string", inputs, outputs=outputs)
    assert [int(x) for x in result.as_numpy("OUTPUT0").ravel()] == (a + b).ravel().tolist()
    assert [int(x) for x in result.as_numpy("OUTPUT1").ravel()] == (a - b).ravel().tolist()


@pytest.mark.parametrize("items", [
    np.array([b"he\x00llo"] * 16, dtype=object).reshape(1, 16),
    np.array([b"\x00\x01\x02\x03"] * 16, dtype=np.bytes_).reshape(1, 16),
], ids=["nul-inside", "numpy-S4"])
@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_simple_identity_returns_the_same_strings(client, items, binary):
    import tritonclient.http as httpclient

    tensor = httpclient.InferInput("INPUT0", list(items.shape), "BYTES")
    tensor.set_data_from_numpy(items, binary_data=binary)
    result = client.infer("simple_identity", [tensor], outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)])
    got = [x if isinstance(x, bytes) else x.encode() for x in result.as_numpy("OUTPUT0").ravel()]
    assert got == [bytes(x) for x in items.ravel()]


def test_bytes_that_are_not_utf8_are_400_for_a_string_model(server):
    element = b"a\xffb"
    header = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": 16 * (4 + len(element))}}]}).encode()
    body = header + (len(element).to_bytes(4, "little") + element) * 16
    r = requests.post(f"{server}/v2/models/simple_identity/infer", data=body,
                      headers={"Inference-Header-Content-Length": str(len(header))})
    assert r.status_code == 400
    assert "input 'INPUT0': element 0 is not valid UTF-8 (byte 1 is 0xff)" in r.json()["error"]


def test_a_known_model_with_a_route_this_server_lacks_is_an_unknown_route_not_an_unknown_model(server):
    r = requests.get(f"{server}/v2/models/simple/no_such_route", params=QUERY)
    assert r.status_code == 404
    assert r.json()["error"] == ("no route GET /v2/models/simple/no_such_route; "
                                "model routes: /v2/models/{name}[/versions/{version}][/ready|/config|/infer|/stats]")


# Triton's own example clients, run unmodified where a checkout of its client repository's
# src/python/examples is named by TRITON_CLIENT_EXAMPLES (they are not copied into this one).
EXAMPLES = os.environ.get("TRITON_CLIENT_EXAMPLES", "")


@pytest.mark.skipif(not EXAMPLES or not Path(EXAMPLES).is_dir(),
                    reason="TRITON_CLIENT_EXAMPLES names no checkout of Triton's client examples")
@pytest.mark.parametrize("example", ["simple_http_shm_client.py", "simple_http_shm_string_client.py",
                                     "reuse_infer_objects_client.py"])  # the last one's HTTP part (its default)
def test_tritons_shared_memory_examples_exit_0(url, example):
    done = subprocess.run([sys.executable, example, "-u", url], cwd=EXAMPLES, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


@pytest.mark.skipif(not EXAMPLES or not Path(EXAMPLES).is_dir(),
                    reason="TRITON_CLIENT_EXAMPLES names no checkout of Triton's client examples")
@pytest.mark.parametrize("example", [
    ["simple_grpc_infer_client.py"], ["simple_grpc_infer_client.py", "--grpc-compression-algorithm", "gzip"],
    ["simple_grpc_async_infer_client.py"], ["simple_grpc_aio_infer_client.py"],
    ["simple_grpc_string_infer_client.py"], ["simple_grpc_custom_args_client.py"],
    ["simple_grpc_keepalive_client.py"], ["simple_grpc_shm_client.py"], ["simple_grpc_shm_string_client.py"],
    ["reuse_infer_objects_client.py", "-i", "grpc"]], ids=lambda args: " ".join(args))
def test_tritons_grpc_examples_exit_0(server, grpc_port, example):
    done = subprocess.run([sys.executable, *example, "-u", f"127.0.0.1:{grpc_port}"], cwd=EXAMPLES,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
