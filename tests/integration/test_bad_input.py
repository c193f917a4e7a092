"""Bad input gets the right status and an {"error": ...} body; the server keeps serving.

End to end on real Ray Serve: the checks a model replica makes (validation against the config,
images, outputs) and a few router ones. The router's HTTP-level cases (404/405/413, bodies,
decoding) run without Ray in ``tests/unit/test_router_routes.py``.
"""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

import numpy as np
import pytest
import requests

pytestmark = pytest.mark.integration

GOOD = {"name": "input", "shape": [1, 3, 224, 224], "datatype": "FP32", "data": [0.0] * (3 * 224 * 224)}


def tensor(**changes):
    t = dict(GOOD)
    t.update(changes)
    return t


def post(server, path, body) -> requests.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return requests.post(f"{server}{path}", data=data, headers={"Content-Type": "application/json"})


def assert_error(r: requests.Response, status: int, *fragments: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert list(body) == ["error"]
    for f in fragments:
        assert f in body["error"], body["error"]
    assert "Traceback" not in body["error"]


def raw_get(server, path) -> tuple[int, dict]:
    """GET without client-side path normalisation (``..`` and ``%2F`` reach the server as sent)."""
    url = urlsplit(server)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    conn.request("GET", path)
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read())


def test_malformed_json_is_400(server):
    assert_error(post(server, "/v2/models/tiny_cnn/infer", b"{not json"), 400, "not valid JSON")


def test_unknown_model_and_version_are_404(server):
    assert_error(post(server, "/v2/models/nope/infer", {"inputs": [GOOD]}), 404,
                 "Request for unknown model: 'nope' is not found")
    assert_error(requests.get(f"{server}/v2/models/nope"), 404, "Request for unknown model: 'nope' is not found")
    assert_error(post(server, "/v2/models/tiny_cnn/versions/7/infer", {"inputs": [GOOD]}), 404,
                 "no version '7'", "versions: [1]")
    assert_error(requests.get(f"{server}/v2/models/tiny_cnn/versions/x"), 404, "no version 'x'")


@pytest.mark.parametrize("path", ["/v2/models/../x", "/v2/models/..%2F..%2Fetc%2Fpasswd"])
def test_path_like_model_names_are_404_like_any_unknown_name(server, path):
    status, body = raw_get(server, path)
    assert status == 404
    assert body["error"].startswith("Request for unknown model: '"), body


def test_wrong_datatype_is_400_naming_the_input(server):
    r = post(server, "/v2/models/tiny_cnn/infer", {"inputs": [tensor(datatype="INT32", data=[0] * (3 * 224 * 224))]})
    assert_error(r, 400, "input 'input'", "FP32")


def test_shape_outside_profile_is_400_naming_axis_and_range(server):
    r = post(server, "/v2/models/tiny_cnn/infer",
             {"inputs": [tensor(shape=[1, 3, 225, 224], data=[0.0] * (3 * 225 * 224))]})
    assert_error(r, 400, "input 'input'", "axis 2 is 225", "allowed 224")


def test_batch_over_max_is_400(server):
    r = post(server, "/v2/models/tiny_cnn/infer",
             {"inputs": [tensor(shape=[33, 3, 224, 224], data=[0.0] * (33 * 3 * 224 * 224))]})
    assert_error(r, 400, "axis 0 is 33", "[1, 32]")


def test_unknown_and_missing_inputs_and_outputs_are_400(server):
    assert_error(post(server, "/v2/models/tiny_cnn/infer", {"inputs": [tensor(name="image")]}), 400,
                 "expects inputs ['input']", "missing ['input']", "unknown ['image']")
    assert_error(post(server, "/v2/models/tiny_cnn/infer", {"inputs": [GOOD], "outputs": [{"name": "probs"}]}),
                 400, "no outputs ['probs']", "['logits']")


def test_undecodable_image_is_400(server):
    body = {"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", "data": ["bm90IGFuIGltYWdl"],
                        "parameters": {"content_type": "base64"}}]}
    assert_error(post(server, "/v2/models/ocr/infer", body), 400, "image", "PNG or JPEG")


def test_bad_base64_is_400(server):
    body = {"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", "data": ["***"],
                        "parameters": {"content_type": "base64"}}]}
    assert_error(post(server, "/v2/models/ocr/infer", body), 400, "not valid base64")


def test_output_overflowing_to_infinity_is_400_suggesting_binary(server):
    r = post(server, "/v2/models/tiny_cnn/infer", {"inputs": [tensor(data=[3.4e38] * (3 * 224 * 224))]})
    assert_error(r, 400, "output 'logits' holds NaN or Infinity", "binary")


def test_unknown_bytes_content_type_is_400(server):
    body = {"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", "data": ["abc"],
                        "parameters": {"content_type": "hex"}}]}
    assert_error(post(server, "/v2/models/ocr/infer", body), 400, "content_type \"hex\" is not one of")


def test_image_sent_without_base64_says_how_to_send_it(server):
    body = {"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", "data": ["not an image"]}]}
    assert_error(post(server, "/v2/models/ocr/infer", body), 400, "not a decodable PNG or JPEG", "base64")


def test_detector_sizes_must_be_multiples_of_32(server):
    body = {"inputs": [{"name": "x", "shape": [1, 3, 50, 64], "datatype": "FP32", "data": [0.0] * (3 * 50 * 64)}]}
    assert_error(post(server, "/v2/models/ocr_det/infer", body), 400, "axis 2 is 50", "multiple of 32")


def test_server_keeps_serving_after_bad_input(server):
    for _ in range(3):
        post(server, "/v2/models/tiny_cnn/infer", b"{")
    r = post(server, "/v2/models/tiny_cnn/infer", {"inputs": [GOOD]})
    assert r.status_code == 200
    assert np.isfinite(r.json()["outputs"][0]["data"]).all()
