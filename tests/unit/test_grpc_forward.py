"""The gRPC edge's hop through the HTTP ingress (``grpc_service.IngressForward``), against a real
HTTP server on loopback standing in for HAProxy (aiohttp's): what it is sent (path, headers,
the binary body the router's route would read), what its answer becomes, and when a call goes
through the router's own route instead (no ingress, an unknown model, a body over the limit)."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import numpy as np
import pytest
from aiohttp import web
from starlette.responses import Response
from tritonclient.grpc import service_pb2 as pb

from deployments.grpc_service import INGRESS_DOWN_S, IngressForward, InferenceService
from deployments.haproxy import ERROR_ANSWERS
from deployments.protocol.binary import HEADER_LENGTH, decode_body, encode_response
from deployments.protocol.grpc import infer_body, infer_response
from deployments.runtime.contract.errors import unknown_model

A = np.arange(16, dtype=np.int32).reshape(1, 16)


class Repo:
    """``ModelRepository.get`` for one model, ``simple``, version 1."""

    def get(self, name: str, version: str | None = None) -> Any:
        if name != "simple" or version not in (None, "1"):
            raise unknown_model(name, "available models: ['simple']")
        return object()


class Routes:
    """The router's routes as the edge uses them: ``repo``, ``max_body_bytes``, and ``infer``,
    which records the paths it was called for and answers 200 with no outputs."""

    def __init__(self, max_body_bytes: int = 1 << 20) -> None:
        self.repo, self.max_body_bytes, self.called = Repo(), max_body_bytes, []

    async def infer(self, request: Any) -> Response:
        self.called.append(request.url.path)
        return Response(json.dumps({"model_name": "simple", "model_version": "1", "outputs": []}))


def message(model: str = "simple", version: str = "", size: int = 16) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, model_version=version, id="req-7")
    request.inputs.add(name="INPUT0", datatype="INT32", shape=[1, size])
    request.raw_input_contents.append(np.arange(size, dtype=np.int32).tobytes())
    return request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def ingress(answer: Any) -> tuple[web.AppRunner, str, list[dict]]:
    """An HTTP server on loopback answering every POST with ``await answer(request)``; (its
    runner, base URL, what it received: raw path, headers, body)."""
    seen: list[dict] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        seen.append({"path": request.raw_path, "headers": dict(request.headers), "body": await request.read()})
        return await answer(request)

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = _free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}", seen


def test_model_infer_posts_the_routers_binary_body_to_the_ingress_and_answers_its_bytes():
    async def answer(request: web.Request) -> web.Response:
        sent = decode_body([await request.read()], request.headers[HEADER_LENGTH])
        body, headers = encode_response("simple", "1", sent, {"OUTPUT0": A + 1})
        return web.Response(body=body, headers=headers)

    async def main() -> tuple[Any, list[dict], Routes]:
        runner, url, seen = await ingress(answer)
        routes = Routes()
        forward = IngressForward(url, 30.0)
        try:
            response = await InferenceService(routes, forward).infer(message(version="1"))
        finally:
            await forward.close()
            await runner.cleanup()
        return response, seen, routes

    response, seen, routes = asyncio.run(main())
    assert routes.called == []
    [sent] = seen
    chunks, length = infer_body(message(version="1"))
    assert sent["path"] == "/v2/models/simple/versions/1/infer"
    assert sent["body"] == b"".join(chunks)
    assert sent["headers"][HEADER_LENGTH] == str(length)
    assert sent["headers"]["Accept-Encoding"] == "identity"  # the answer uncompressed: gRPC compresses its own
    result = infer_response(bytes(response.body), response.headers)
    assert result.id == "req-7" and result.outputs[0].name == "OUTPUT0"
    assert np.frombuffer(result.raw_output_contents[0], np.int32).tolist() == (A + 1).ravel().tolist()


def test_an_error_answer_of_the_ingress_keeps_its_status_text_and_retry_after():
    text = "model 'simple' is overloaded: 8 requests in flight; retry after 1 s"

    async def answer(request: web.Request) -> web.Response:
        return web.json_response({"error": text}, status=503, headers={"Retry-After": "1"})

    async def main() -> Response:
        runner, url, _ = await ingress(answer)
        forward = IngressForward(url, 30.0)
        try:
            return await InferenceService(Routes(), forward).infer(message())
        finally:
            await forward.close()
            await runner.cleanup()

    response = asyncio.run(main())
    assert response.status_code == 503
    assert json.loads(bytes(response.body)) == {"error": text}
    assert response.headers["retry-after"] == "1"


@pytest.mark.parametrize("status", [502, 503])
def test_haproxys_own_answer_for_a_replica_that_died_sends_the_call_through_the_router(status):
    """HAProxy's JSON 502 / 503 (``haproxy.ERROR_ANSWERS``, as its ``http-error`` line writes
    it): no replica answered (the one holding the request died and HAProxy could not send it
    again, e.g. a body past its buffer), so the router's route runs it; the ingress stays usable."""
    async def answer(request: web.Request) -> web.Response:
        return web.Response(body=json.dumps({"error": ERROR_ANSWERS[status]}).encode(), status=status,
                            content_type="application/json", headers={"Retry-After": "1"})

    async def main() -> tuple[Response, list[str], bool, int]:
        runner, url, seen = await ingress(answer)
        routes = Routes()
        forward = IngressForward(url, 30.0)
        try:
            response = await InferenceService(routes, forward).infer(message())
            return response, routes.called, forward.usable(), len(seen)
        finally:
            await forward.close()
            await runner.cleanup()

    response, called, usable, sent = asyncio.run(main())
    assert (response.status_code, called, usable, sent) == (200, ["/v2/models/simple/infer"], True, 1)


def test_another_clusters_replica_refusing_the_call_sends_it_through_the_router():
    """HAProxy sent the forwarded body to a replica of another server on this host, which
    answered 421 without running it (``routes.ClusterGuard``): the router's handles, which reach
    only this cluster's replicas, run it; the ingress stays usable."""
    async def answer(request: web.Request) -> web.Response:
        return web.json_response({"error": "this replica belongs to another Ray cluster"}, status=421)

    async def main() -> tuple[Response, list[str], bool]:
        runner, url, _ = await ingress(answer)
        routes = Routes()
        forward = IngressForward(url, 30.0)
        try:
            response = await InferenceService(routes, forward).infer(message())
            return response, routes.called, forward.usable()
        finally:
            await forward.close()
            await runner.cleanup()

    response, called, usable = asyncio.run(main())
    assert (response.status_code, called, usable) == (200, ["/v2/models/simple/infer"], True)


def test_an_ingress_that_cannot_be_reached_leaves_the_calls_to_the_router_for_a_while():
    async def main() -> tuple[list[str], bool, float, float]:
        routes = Routes()
        forward = IngressForward(f"http://127.0.0.1:{_free_port()}", 30.0)  # nothing listens there
        service = InferenceService(routes, forward)
        try:
            response = await service.infer(message())
            usable = forward.usable()
            await service.infer(message())  # not even tried: through the router at once
        finally:
            await forward.close()
        return routes.called, usable and response.status_code == 200, forward._down_until, \
            asyncio.get_running_loop().time()

    called, usable, down_until, now = asyncio.run(main())
    assert called == ["/v2/models/simple/infer"] * 2
    assert not usable
    assert now < down_until <= now + INGRESS_DOWN_S


@pytest.mark.parametrize("request_, max_body_bytes", [
    (message(model="nope"), 1 << 20),  # the router names the models at once
    (message(version="7"), 1 << 20),  # and the versions
    (message(size=64), 256),  # 256 B of tensor and the JSON header: over the limit only with the header
], ids=["unknown model", "unknown version", "body over the limit with its header"])
def test_calls_the_ingress_should_not_take_go_through_the_router(request_, max_body_bytes):
    async def answer(request: web.Request) -> web.Response:
        raise AssertionError("the ingress was called")

    async def main() -> tuple[list[str], list[dict]]:
        runner, url, seen = await ingress(answer)
        routes = Routes(max_body_bytes)
        forward = IngressForward(url, 30.0)
        try:
            await InferenceService(routes, forward).infer(request_)
        finally:
            await forward.close()
            await runner.cleanup()
        return routes.called, seen

    called, seen = asyncio.run(main())
    assert len(called) == 1 and seen == []


def _answer_simple(status: int = 200, **headers: str) -> Any:
    async def answer(request: web.Request) -> web.Response:
        body, binary_headers = encode_response("simple", "1", decode_body([await request.read()],
                                                                          request.headers[HEADER_LENGTH]), {"OUTPUT0": A})
        return web.Response(body=body, status=status, headers={**binary_headers, **headers})
    return answer


async def _peers(answer: Any, calls: int, forward_args: tuple = (30.0,)) -> tuple[list[Any], list[Response]]:
    """``calls`` ModelInfers in turn through one ``IngressForward``; (the client address of each
    request the ingress saw, the answers)."""
    peers: list[Any] = []

    async def seen(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport.get_extra_info("peername"))
        return await answer(request)

    runner, url, _ = await ingress(seen)
    forward = IngressForward(url, *forward_args)
    try:
        return peers, [await InferenceService(Routes(), forward).infer(message()) for _ in range(calls)]
    finally:
        await forward.close()
        await runner.cleanup()


def test_calls_in_turn_share_one_kept_alive_connection_to_the_ingress():
    peers, answers = asyncio.run(_peers(_answer_simple(), 3))
    assert [a.status_code for a in answers] == [200] * 3
    assert len(peers) == 3 and len(set(peers)) == 1


@pytest.mark.parametrize("headers, keep", [({"Connection": "close"}, False), ({}, True)], ids=["close", "keep-alive"])
def test_an_answer_saying_connection_close_is_not_followed_by_another_request_on_it(headers, keep):
    peers, answers = asyncio.run(_peers(_answer_simple(**headers), 2))
    assert [a.status_code for a in answers] == [200, 200]
    assert (peers[0] == peers[1]) is keep


def test_a_connection_idle_past_keep_alive_s_is_not_used_again(monkeypatch):
    monkeypatch.setattr("deployments.grpc_service.KEEP_ALIVE_S", 0.0)
    peers, _ = asyncio.run(_peers(_answer_simple(), 2))
    assert peers[0] != peers[1]


def test_a_chunked_answer_is_read_whole():
    async def answer(request: web.Request) -> web.StreamResponse:
        body, headers = encode_response("simple", "1", decode_body([await request.read()], request.headers[HEADER_LENGTH]),
                                        {"OUTPUT0": A + 2})
        response = web.StreamResponse(headers=headers)
        response.enable_chunked_encoding()
        await response.prepare(request)
        for i in range(0, len(body), 7):
            await response.write(body[i:i + 7])
        await response.write_eof()
        return response

    _, [response] = asyncio.run(_peers(answer, 1))
    result = infer_response(bytes(response.body), response.headers)
    assert np.frombuffer(result.raw_output_contents[0], np.int32).tolist() == (A + 2).ravel().tolist()


def test_a_connection_the_ingress_closes_before_answering_sends_the_call_through_the_router():
    async def main() -> tuple[list[str], int, int]:
        received = []

        async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            received.append(await reader.readuntil(b"\r\n\r\n"))
            writer.close()

        server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        routes = Routes()
        forward = IngressForward(f"http://127.0.0.1:{port}", 30.0)
        try:
            response = await InferenceService(routes, forward).infer(message())
        finally:
            await forward.close()
            server.close()
        return routes.called, len(received), response.status_code

    called, received, status = asyncio.run(main())
    assert (called, received, status) == (["/v2/models/simple/infer"], 1, 200)


def test_an_ingress_that_answers_too_late_gives_504_naming_the_model_and_the_bound(monkeypatch):
    from deployments.runtime.contract.errors import InferenceTimeout

    monkeypatch.setattr("deployments.grpc_service.POOL_TIMEOUT_GRACE_S", 0.0)
    slow = _answer_simple()

    async def answer(request: web.Request) -> web.Response:
        if len(calls) == 2:
            await asyncio.sleep(2)
        return await slow(request)

    calls: list[int] = []

    async def main() -> tuple[str, list[Any], int]:
        peers: list[Any] = []

        async def seen(request: web.Request) -> web.StreamResponse:
            calls.append(1)
            peers.append(request.transport.get_extra_info("peername"))
            return await answer(request)

        runner, url, _ = await ingress(seen)
        forward = IngressForward(url, 0.5)
        service = InferenceService(Routes(), forward)
        try:
            await service.infer(message())  # a connection kept alive
            with pytest.raises(InferenceTimeout) as timeout:
                await service.infer(message())
            after = await service.infer(message())  # not on the connection the late answer would come on
        finally:
            await forward.close()
            await runner.cleanup()
        return str(timeout.value), peers, after.status_code

    text, peers, status = asyncio.run(main())
    assert text == "model 'simple' did not answer within 500 ms (request_timeout_s of the application args)"
    assert status == 200 and peers[0] == peers[1] != peers[2]
