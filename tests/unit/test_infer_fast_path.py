"""An infer request skips Starlette's middleware stack and route matching (``routes.V2App``): every
answer, good or bad, is byte for byte the one the Starlette app gives the same request.

Triton's ``simple`` (OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1) in a dedicated replica
without Ray, on ONNX Runtime CPU; each request is sent twice, through the fast path and with it
turned off (``infer_params`` answering None sends every request through the Starlette app).
"""

from __future__ import annotations

import asyncio
import gzip
import json

import numpy as np
import pytest
from starlette.testclient import TestClient

from deployments import routes
from deployments.haproxy import CLUSTER_HEADER
from deployments.model import ModelDeployment
from deployments.protocol.binary import HEADER_LENGTH
from deployments.routes import RouterOptions

Deployment = ModelDeployment.func_or_class  # the class under Serve's decorator
X0 = np.arange(16, dtype=np.int32).reshape(1, 16)
X1 = np.full((1, 16), 3, dtype=np.int32)
BODY = {"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": X0.ravel().tolist()},
                   {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": X1.ravel().tolist()}]}
BODY8 = {"inputs": [{"name": n, "datatype": "INT32", "shape": [8, 16], "data": list(range(128))}
                    for n in ("INPUT0", "INPUT1")]}  # an answer over the 500 bytes a compressed one needs
LIMIT_BYTES = 1 << 20


def binary_body() -> tuple[bytes, dict[str, str]]:
    """The binary tensor extension's body of ``BODY``, outputs asked for in binary."""
    head = json.dumps({"inputs": [{"name": n, "datatype": "INT32", "shape": [1, 16],
                                   "parameters": {"binary_data_size": 64}} for n in ("INPUT0", "INPUT1")],
                       "parameters": {"binary_data_output": True}}).encode()
    return head + X0.tobytes() + X1.tobytes(), {HEADER_LENGTH: str(len(head)),
                                               "content-type": "application/octet-stream"}


def cases() -> dict[str, tuple[str, str, dict]]:
    binary, headers = binary_body()
    wrong_type = {"inputs": [dict(BODY["inputs"][0], datatype="FP32"), BODY["inputs"][1]]}
    return {
        "json": ("POST", "/v2/models/simple/infer", {"json": BODY}),
        "binary": ("POST", "/v2/models/simple/infer", {"content": binary, "headers": headers}),
        "version 1": ("POST", "/v2/models/simple/versions/1/infer", {"json": BODY}),
        "version not served": ("POST", "/v2/models/simple/versions/7/infer", {"json": BODY}),
        "an output by name": ("POST", "/v2/models/simple/infer", {"json": {**BODY, "outputs": [{"name": "OUTPUT1"}]}}),
        "gzip answer": ("POST", "/v2/models/simple/infer", {"json": BODY8, "headers": {"accept-encoding": "gzip"}}),
        "deflate answer": ("POST", "/v2/models/simple/infer", {"json": BODY8, "headers": {"accept-encoding": "deflate"}}),
        "unknown coding": ("POST", "/v2/models/simple/infer", {"json": BODY8, "headers": {"accept-encoding": "br"}}),
        "gzip body": ("POST", "/v2/models/simple/infer", {"content": gzip.compress(json.dumps(BODY).encode()),
                                                          "headers": {"content-encoding": "gzip",
                                                                      "content-type": "application/json"}}),
        "not json": ("POST", "/v2/models/simple/infer", {"content": b"{not json"}),
        "wrong datatype": ("POST", "/v2/models/simple/infer", {"json": wrong_type}),
        "unknown output": ("POST", "/v2/models/simple/infer", {"json": {**BODY, "outputs": [{"name": "nope"}]}}),
        "header length past the body": ("POST", "/v2/models/simple/infer",
                                        {"content": binary, "headers": {**headers, HEADER_LENGTH: str(len(binary) + 1)}}),
        "declared too large": ("POST", "/v2/models/simple/infer",
                               {"content": b"{}", "headers": {"content-length": str(LIMIT_BYTES + 1)}}),
        "unknown model": ("POST", "/v2/models/nope/infer", {"json": BODY}),
        "trailing slash": ("POST", "/v2/models/simple/infer/", {"json": BODY}),
        "GET on infer": ("GET", "/v2/models/simple/infer", {}),
        "another cluster": ("POST", "/v2/models/simple/infer", {"json": BODY, "headers": {CLUSTER_HEADER: "other"}}),
    }


@pytest.fixture
def replica(prepared_engines):
    """Per test, after the loggers' snapshot (``conftest._loggers_restored``): building a replica
    routes the application's log through Serve's logger, which a later test's ``caplog`` must not see."""
    replica = Deployment.__new__(Deployment)
    asyncio.run(Deployment.__init__(replica, str(prepared_engines), "simple", "onnxruntime",
                                    RouterOptions(max_body_bytes=LIMIT_BYTES, request_timeout_s=60.0),
                                    {"enabled": False}))
    replica.routes.cluster = "this-cluster"  # as in a Ray cluster: a stamp of another is refused
    yield replica
    replica.host.unload()


def answer(client: TestClient, method: str, path: str, kwargs: dict) -> tuple[int, list, bytes]:
    r = client.request(method, path, **kwargs)
    return r.status_code, sorted((k.lower(), v) for k, v in r.headers.multi_items()), r.content


@pytest.mark.parametrize("case", list(cases()))
def test_an_infer_request_answers_as_through_the_starlette_app(replica, monkeypatch, case):
    method, path, kwargs = cases()[case]
    client = TestClient(replica.__serve_build_asgi_app__(), raise_server_exceptions=False)
    fast = answer(client, method, path, kwargs)
    monkeypatch.setattr(routes, "infer_params", lambda path: None)  # every request through Starlette's stack
    slow = answer(client, method, path, kwargs)
    assert fast == slow
    status, headers, content = fast
    expected = {"json": 200, "binary": 200, "version 1": 200, "version not served": 404, "an output by name": 200,
                "gzip answer": 200, "deflate answer": 200, "unknown coding": 200, "gzip body": 200, "not json": 400,
                "wrong datatype": 400, "unknown output": 400, "header length past the body": 400,
                "declared too large": 413, "unknown model": 404, "trailing slash": 404, "GET on infer": 405,
                "another cluster": 421}[case]
    assert status == expected, content[:300]
    if case in ("json", "gzip body"):
        assert {o["name"]: o["data"] for o in json.loads(content)["outputs"]} == {
            "OUTPUT0": (X0 + X1).ravel().tolist(), "OUTPUT1": (X0 - X1).ravel().tolist()}
    if case == "binary":
        start = int(dict(headers)[HEADER_LENGTH.lower()])
        np.testing.assert_array_equal(np.frombuffer(content[start:start + 64], np.int32), (X0 + X1).ravel())
    if case in ("gzip answer", "deflate answer", "unknown coding"):  # the client decompressed it
        assert json.loads(content)["outputs"][0]["data"] == [2 * v for v in range(128)]
        assert dict(headers).get("content-encoding") == {"unknown coding": None}.get(case, case.split()[0])
        assert dict(headers)["vary"] == "Accept-Encoding"


async def mounted(app, path: str, body: bytes) -> tuple[int, bytes]:
    """POST ``path`` to ``app`` as Serve hands it a request under the model's route prefix: the
    prefix in ``root_path``, the full path in ``path``."""
    scope = {"type": "http", "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
             "raw_path": path.encode(), "root_path": "/v2/models/simple", "query_string": b"",
             "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 1234),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    sent = iter([{"type": "http.request", "body": body, "more_body": False}])
    messages: list[dict] = []

    async def receive() -> dict:
        return next(sent, {"type": "http.disconnect"})

    async def send(message: dict) -> None:
        messages.append(message)

    await app(scope, receive, send)
    return messages[0]["status"], b"".join(m.get("body", b"") for m in messages[1:])


@pytest.mark.parametrize("path,status", [("/v2/models/simple/infer", 200), ("/v2/models/simple/versions/1/infer", 200),
                                         ("/v2/models/simple/versions/2/infer", 404)])
def test_under_serves_route_prefix_the_fast_path_matches_the_full_path(replica, monkeypatch, path, status):
    """Serve mounts a model's application at ``/v2/models/{name}``: the routes still match the full
    path, through the fast path and through Starlette's stack alike."""
    app, body = replica.__serve_build_asgi_app__(), json.dumps(BODY).encode()
    fast = asyncio.run(mounted(app, path, body))
    monkeypatch.setattr(routes, "infer_params", lambda path: None)
    assert asyncio.run(mounted(app, path, body)) == fast
    assert fast[0] == status, fast[1][:300]
