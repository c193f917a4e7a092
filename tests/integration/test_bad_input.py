"""Bad input gets the right status and an {"error": ...} body; the server keeps serving."""

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


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_tokens_are_400(server, token):
    body = '{"inputs":[{"name":"input","shape":[1],"datatype":"FP32","data":[%s]}]}' % token
    assert_error(post(server, "/v2/models/tiny_cnn/infer", body), 400, token, "not allowed")


def test_unknown_model_and_version_are_404(server):
    assert_error(post(server, "/v2/models/nope/infer", {"inputs": [GOOD]}), 404, "unknown model 'nope'")
    assert_error(requests.get(f"{server}/v2/models/nope"), 404, "unknown model 'nope'")
    assert_error(post(server, "/v2/models/tiny_cnn/versions/7/infer", {"inputs": [GOOD]}), 404,
                 "no version '7'", "versions: [1]")
    assert_error(requests.get(f"{server}/v2/models/tiny_cnn/versions/x"), 404, "no version 'x'")


@pytest.mark.parametrize("path", [
    "/v2/models/../x", "/v2/models/..%2Fx", "/v2/models/%2e%2e%2fx/ready", "/v2/models/a/b",
    "/v2/models/a%2Fb/versions/1", "/v2/models/..%2F..%2Fetc%2Fpasswd",
])
def test_path_like_model_names_are_404_like_any_unknown_name(server, path):
    status, body = raw_get(server, path)
    assert status == 404
    assert body["error"].startswith("unknown model '"), body


def test_wrong_datatype_is_400_naming_the_input(server):
    r = post(server, "/v2/models/tiny_cnn/infer", {"inputs": [tensor(datatype="INT32", data=[0] * (3 * 224 * 224))]})
    assert_error(r, 400, "input 'input'", "FP32")


def test_element_count_mismatch_is_400(server):
    r = post(server, "/v2/models/tiny_cnn/infer", {"inputs": [tensor(data=[0.0] * 10)]})
    assert_error(r, 400, "input 'input'", "needs 150528 elements", "has 10")


@pytest.mark.parametrize("shape,fragment", [
    ([1, 3, -224, 224], "axis 2 is -224"),
    ([0, 3, 224, 224], "axis 0 is 0"),
    ([1, 3, 224.5, 224], "axis 2 is 224.5"),
    ([1, 3, "224", 224], "axis 2 is \"224\""),
])
def test_negative_zero_and_non_integer_dims_are_400(server, shape, fragment):
    assert_error(post(server, "/v2/models/tiny_cnn/infer", {"inputs": [tensor(shape=shape)]}), 400, fragment)


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
    assert_error(post(server, "/v2/models/tiny_cnn/infer", {"inputs": []}), 400, "non-empty 'inputs'")
    assert_error(post(server, "/v2/models/tiny_cnn/infer", [1, 2]), 400, "JSON object")


def test_body_over_limit_is_413(server):
    body = b" " * (64 * 1024 * 1024 + 1)
    assert_error(post(server, "/v2/models/tiny_cnn/infer", body), 413, "limit is 67108864 bytes")


def test_undecodable_image_is_400(server):
    body = {"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", "data": ["bm90IGFuIGltYWdl"],
                        "parameters": {"content_type": "base64"}}]}
    assert_error(post(server, "/v2/models/ocr/infer", body), 400, "image", "PNG or JPEG")


def test_bad_base64_is_400(server):
    body = {"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", "data": ["***"],
                        "parameters": {"content_type": "base64"}}]}
    assert_error(post(server, "/v2/models/ocr/infer", body), 400, "not valid base64")


def test_wrong_method_is_405_naming_the_allowed_one(server):
    r = requests.get(f"{server}/v2/models/tiny_cnn/infer")
    assert_error(r, 405, "method GET not allowed", "allowed: POST")
    assert r.headers["Allow"] == "POST"


def test_trailing_slash_is_404_not_a_redirect(server):
    r = requests.post(f"{server}/v2/models/tiny_cnn/infer/", json={"inputs": [GOOD]}, allow_redirects=False)
    assert_error(r, 404, "no route POST /v2/models/tiny_cnn/infer/")


def test_booleans_among_numbers_are_400(server):
    data = [True] + [0.5] * (3 * 224 * 224 - 1)
    assert_error(post(server, "/v2/models/tiny_cnn/infer", {"inputs": [tensor(data=data)]}), 400, "not true/false")


@pytest.mark.parametrize("data,fragment", [
    ([[0.5] * 150527, [0.5]], "data has 2 items, shape [1, 3, 224, 224] needs 1 on axis 0"),
    ([[[[0.5] * 448] * 112] * 3], "data[0][0] has 112 items, shape [1, 3, 224, 224] needs 224 on axis 2"),
])
def test_nested_data_must_follow_the_shape(server, data, fragment):
    assert_error(post(server, "/v2/models/tiny_cnn/infer", {"inputs": [tensor(data=data)]}), 400, fragment)


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


def test_lone_surrogate_in_a_name_is_400_with_a_json_body(server):
    body = '{"inputs":[{"name":"\\ud800","shape":[1],"datatype":"FP32","data":[1]}]}'
    assert_error(post(server, "/v2/models/tiny_cnn/infer", body), 400, "not valid Unicode")


def test_number_overflowing_the_datatype_is_400(server):
    assert_error(post(server, "/v2/models/tiny_cnn/infer", {"inputs": [tensor(data=[1e39] * (3 * 224 * 224))]}),
                 400, "input 'input'", "overflow FP32")
    assert_error(post(server, "/v2/models/tiny_cnn/infer", '{"inputs": [1e999]}'), 400, "overflows to Infinity")


def test_detector_sizes_must_be_multiples_of_32(server):
    body = {"inputs": [{"name": "x", "shape": [1, 3, 50, 64], "datatype": "FP32", "data": [0.0] * (3 * 50 * 64)}]}
    assert_error(post(server, "/v2/models/ocr_det/infer", body), 400, "axis 2 is 50", "multiple of 32")


def test_output_parameters_that_are_not_an_object_are_400(server):
    assert_error(post(server, "/v2/models/tiny_cnn/infer", {"inputs": [GOOD], "outputs": [{"name": "logits",
                 "parameters": [1]}]}), 400, "'parameters' must be an object")


def test_server_keeps_serving_after_bad_input(server):
    for _ in range(3):
        post(server, "/v2/models/tiny_cnn/infer", b"{")
    r = post(server, "/v2/models/tiny_cnn/infer", {"inputs": [GOOD]})
    assert r.status_code == 200
    assert np.isfinite(r.json()["outputs"][0]["data"]).all()
