"""The KServe v2 gRPC front door: Triton's ``inference.GRPCInferenceService``, answered through a
replica's own HTTP routes (``InferenceService``).

Every gRPC call shares one path (``/inference.GRPCInferenceService/ModelInfer``) with the model
name inside the message, and Ray Serve 2.60's gRPC routes by ``application`` metadata that
``tritonclient.grpc`` does not send. docs/architecture.md, "The gRPC front door", says what each
front costs and why; the two:

- With HAProxy (``make serve``): Serve serves gRPC in every ingress replica (``deployments.run``
  names ``add_kserve_v2_service`` in ``grpc_options``), HAProxy reads each ModelInfer's model
  name and sends the call to that model's replicas, every other call to the router's
  (``haproxy.route_grpc_models``), and the replica's method of the RPC's name answers it
  (``ServeGrpcMethods``, which every ingress deployment inherits): one hop, as over HTTP.
- Behind Serve's Python proxy: each router replica runs a ``grpc.aio`` server on its own event
  loop (``start``: the port of ``grpc_port`` in the application args, shared by the node's
  router replicas through SO_REUSEPORT, on 127.0.0.1 where the Ray node's IP is loopback).
  ``ModelInfer`` runs through ``V2Routes.infer``, the router's HTTP route (model lookup,
  versions, readiness, the one hop to the model's replica through its handle); where HAProxy is
  the HTTP ingress but Serve serves no gRPC, its body goes to HAProxy's HTTP frontend over
  kept-alive HTTP/1.1 connections (``IngressForward``) and takes an HTTP request's path.

Either way a ModelInfer becomes the body a ``tritonclient.http`` binary request would send
(``protocol.grpc.infer_body``), so the body limit, timeouts, metrics, statistics and request logs
are the HTTP path's own, and an error has the same text, with the gRPC code of its HTTP status
(``protocol.errors.grpc_code``). The shared-memory RPCs go through the shared-memory routes
(``shared_memory_routes``), and an infer's ``shared_memory_*`` parameters reach the replica as
over HTTP. Trace and log settings answer UNIMPLEMENTED.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, NamedTuple
from urllib.parse import quote, urlsplit

import grpc
import httptools
import psutil
from google.protobuf.message import DecodeError
from starlette.requests import Request
from starlette.responses import Response
from tritonclient.grpc import model_config_pb2, service_pb2 as pb, service_pb2_grpc as pb_grpc

from .haproxy import CLUSTER_HEADER, ERROR_ANSWERS
from .protocol.binary import HEADER_LENGTH
from .protocol.errors import grpc_code
from .protocol.grpc import (cuda_register_body, infer_body, infer_response, json_message, region_statuses,
                            repository_body, system_register_body)
from .protocol.answer import timeout_error
from .routes import EDGE_HEADER_BYTES, POOL_TIMEOUT_GRACE_S, V2Routes, error_response, misdirected
from .runtime.contract.errors import InvalidInput, ModelNotFound, PayloadTooLarge

logger = logging.getLogger("ray.serve")

# A ready probe's "not ready" answers (503; for a model also 404: unknown, or not loaded): ready
# false over gRPC, as Triton answers and as tritonclient.http reads any status but 200.
_NOT_READY = (503,)
_MODEL_NOT_READY = (404, 503)


def _http_request(method: str, path: str, path_params: dict[str, str], chunks: Iterable[bytes] = (),
                  headers: dict[str, str] | None = None, error: Exception | None = None,
                  added_bytes: int = 0) -> Request:
    """A Starlette request as the router's routes read it, from a gRPC call: ``chunks`` its
    body, of which ``added_bytes`` (the JSON header of an infer body) do not count against
    ``max_body_bytes`` (the message did, in grpcio); ``error`` is raised where the body is read
    (an input the gRPC edge could not turn into a body), so that the route answers it, after
    checking the model, as it answers a body it cannot decode."""
    body = list(chunks)

    async def receive() -> dict[str, Any]:
        if error is not None:
            raise error
        chunk = body.pop(0) if body else b""
        return {"type": "http.request", "body": chunk, "more_body": bool(body)}

    scope = {"type": "http", "http_version": "2", "method": method, "scheme": "http", "path": path,
             "raw_path": path.encode(), "root_path": "", "query_string": b"", "path_params": path_params,
             EDGE_HEADER_BYTES: added_bytes,
             "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]}
    return Request(scope, receive)


def _model_params(name: str, version: str = "") -> tuple[dict[str, str], str]:
    """Path parameters and path of a model's routes (``/v2/models/{name}[/versions/{version}]``)."""
    params = {"name": name} | ({"version": version} if version else {})
    return params, f"/v2/models/{name}" + (f"/versions/{version}" if version else "")


def _error(response: Response) -> str:
    """The message of an error answer (``{"error": ...}``)."""
    try:
        return json.loads(bytes(response.body))["error"]
    except Exception:
        return bytes(response.body).decode("utf-8", "replace")


async def _abort(context: grpc.aio.ServicerContext, response: Response) -> None:
    """End the call with the gRPC code of ``response``'s HTTP status and its error text (and
    ``retry-after`` trailing metadata for a shed request)."""
    retry = response.headers.get("retry-after")
    if retry is not None:
        context.set_trailing_metadata((("retry-after", retry),))
    await context.abort(grpc_code(response.status_code), _error(response))


def _answers_errors(method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """An exception a method raises ends its call with the code and text of the one error table
    (a real fault: INTERNAL and a generic text, logged)."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            await _abort(context, error_response(e))

    return wrapper


# Seconds the gRPC edge sends no ModelInfer to an HTTP ingress it could not connect to (it
# answers them through the router meanwhile), e.g. a node whose HAProxy has not started.
INGRESS_DOWN_S = 5.0
# Seconds a kept-alive connection to the ingress may idle and still be used: below HAProxy's own
# keep-alive timeout (90 s), so that HAProxy seldom closes one as a request is sent on it.
KEEP_ALIVE_S = 15.0
# What the forwarded request asks: the binary answer as the replica writes it, never compressed
# (gRPC compresses its own messages).
_FORWARD_HEADERS = "Content-Type: application/octet-stream\r\nAccept-Encoding: identity\r\n"
_ANSWER_HEADERS = (HEADER_LENGTH, "retry-after", "content-type")
# HAProxy's own answers (deployments/haproxy.py, ``answer_replica_deaths``) for a request no
# replica answered: the one holding it died and HAProxy could not send it again (a body past its
# buffer, ``retry_body_mib``; its one retry spent on a dead replica), or none could take it.
_INGRESS_GAVE_UP = {status: json.dumps({"error": ERROR_ANSWERS[status]}).encode() for status in (502, 503)}
# A replica's answer to a request that HAProxy sent to another server's replica on this host
# (``routes.ClusterGuard``): not run; the router's handles reach this cluster's own replicas.
_MISDIRECTED = 421


class _Answer(NamedTuple):
    status: int
    headers: dict[str, str]
    body: bytes
    keep_alive: bool


class _Connection(asyncio.Protocol):
    """One kept-alive HTTP/1.1 connection to the ingress, one request at a time (``send``), its
    answer read by ``httptools`` (the parser uvicorn serves with)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._answer: asyncio.Future[_Answer] | None = None
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []

    def send(self, data: list[bytes]) -> asyncio.Future[_Answer]:
        """Write one request (``data``: its pieces); the future of its answer (ConnectionError:
        the connection closed before the whole answer came).

        The pieces go in one ``writelines``: on uvloop (a router replica's loop) one ``writev``
        of them all, without joining them into a copy, so that HAProxy is woken once for the
        whole request; a write per piece cost a system call and a wake-up of HAProxy each (the
        request line alone, then the JSON header, then each input), and joining a 602 KB body
        a copy."""
        assert self.transport is not None
        self._answer = asyncio.get_running_loop().create_future()
        self.transport.writelines(data)
        return self._answer

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(ConnectionError(f"the ingress's answer is not HTTP/1.1: {e}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(ConnectionError("the ingress closed the connection before answering"))

    def _fail(self, error: Exception) -> None:
        if self._answer is not None and not self._answer.done():
            self._answer.set_exception(error)

    # httptools' callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        if key in _ANSWER_HEADERS:
            self._headers[key] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        answer = _Answer(self._parser.get_status_code(), self._headers, b"".join(self._body),
                         self._parser.should_keep_alive())
        self._headers, self._body = {}, []
        if self._answer is not None and not self._answer.done():
            self._answer.set_result(answer)


class IngressForward:
    """An infer body's one hop through the node's HTTP ingress (HAProxy): POSTed to
    ``base_url`` (the HAProxy frontend, on loopback, an IP literal) over a pool of kept-alive
    HTTP/1.1 connections, so that HAProxy sends it to the model's replica as it sends an HTTP
    client's (a dedicated model's replica, the pool replica its hash or placement names, the
    router as backup; its retry of a dead replica; the replica's admission, checks, timeouts and
    counting: the router counts nothing of it). A call waits up to ``request_timeout_s`` (the
    application's) plus ``POOL_TIMEOUT_GRACE_S``, so that the replica's own 504, naming its
    bound, arrives first.

    The connections are asyncio's own (TCP_NODELAY) and the answer is parsed by ``httptools``:
    one request costs the edge's event loop a fraction of what an HTTP client library's does
    (docs/performance.md, "Where the gRPC edge's time went")."""

    def __init__(self, base_url: str, request_timeout_s: float) -> None:
        address = urlsplit(base_url)
        self.host, self.port = address.hostname or "127.0.0.1", address.port or 80
        self.request_timeout_s = request_timeout_s
        self._host_header = address.netloc
        self._idle: list[_Connection] = []  # the most recently used last
        self._down_until = 0.0

    def usable(self) -> bool:
        """False for ``INGRESS_DOWN_S`` after a connection to the ingress failed."""
        return asyncio.get_running_loop().time() >= self._down_until

    async def _connection(self) -> _Connection:
        """An idle kept-alive connection (one idle for over ``KEEP_ALIVE_S`` is closed), or a new one.

        Raises:
            OSError: the ingress cannot be connected to.
        """
        loop = asyncio.get_running_loop()
        while self._idle:
            connection = self._idle.pop()
            if not connection.closed and loop.time() - connection.idle_since < KEEP_ALIVE_S:
                return connection
            connection.close()
        _, connection = await loop.create_connection(_Connection, self.host, self.port)
        return connection

    async def infer(self, model: str, path: str, chunks: list[bytes], header_length: int) -> Response | None:
        """The ingress's answer to ``chunks`` (an infer body whose JSON header is
        ``header_length`` bytes) POSTed to ``path``; None where no replica answered it (no
        connection, or one closed before the answer, as HAProxy closes idle connections on a
        reload; HAProxy's own 502 / 503 for a request whose replica died, ``_INGRESS_GAVE_UP``;
        421 from another server's replica that HAProxy sent it to, ``_MISDIRECTED``):
        the caller takes the router's path instead (a request that had reached a replica runs
        again, as HAProxy's own retry of a dead replica runs it: an infer is a pure function of
        its request, and the dead replica answered nothing).

        Raises:
            InferenceTimeout: no answer in time (504, naming ``model`` and ``request_timeout_s``).
        """
        head = (f"POST {path} HTTP/1.1\r\nHost: {self._host_header}\r\n{_FORWARD_HEADERS}"
                f"{HEADER_LENGTH}: {header_length}\r\nContent-Length: {sum(map(len, chunks))}\r\n\r\n")
        connection: _Connection | None = None
        answer: _Answer | None = None
        try:
            async with asyncio.timeout(self.request_timeout_s + POOL_TIMEOUT_GRACE_S):
                try:
                    connection = await self._connection()
                except OSError:
                    self._down_until = asyncio.get_running_loop().time() + INGRESS_DOWN_S
                    return None
                answer = await connection.send([head.encode("latin-1"), *chunks])
                if _INGRESS_GAVE_UP.get(answer.status) == answer.body or answer.status == _MISDIRECTED:
                    return None
                return Response(answer.body, status_code=answer.status, headers=answer.headers)
        except TimeoutError:
            raise timeout_error(model, self.request_timeout_s, False) from None
        except ConnectionError:
            return None
        finally:
            if connection is not None:
                if answer is not None and answer.keep_alive and not connection.closed:
                    connection.idle_since = asyncio.get_running_loop().time()
                    self._idle.append(connection)
                else:  # a request still on it (a timeout, a cancelled call), or the ingress ends it
                    connection.close()

    async def close(self) -> None:
        while self._idle:
            self._idle.pop().close()


class InferenceService(pb_grpc.GRPCInferenceServiceServicer):
    """``inference.GRPCInferenceService`` over the router's routes (``routes``: the router's
    ``RouterApp``, or any ``RepositoryRoutes``); ``forward``: where ModelInfer goes through the
    node's HTTP ingress (None: through the router's infer route)."""

    def __init__(self, routes: V2Routes, forward: IngressForward | None = None) -> None:
        self.routes = routes
        self.forward = forward

    def _forwards(self, forward: IngressForward, request: Any, chunks: list[bytes]) -> bool:
        """Whether ``request`` goes through ``forward``: while it is usable, a model and version
        of the repository (the router answers any other name at once) whose body fits
        ``max_body_bytes`` (one within its JSON header of the limit passes only through the
        router, which leaves the header out of the count as for a message of the limit)."""
        if not forward.usable():
            return False
        try:
            self.routes.repo.get(request.model_name, request.model_version or None)
        except ModelNotFound:
            return False
        return sum(map(len, chunks)) <= self.routes.max_body_bytes

    async def _json(self, route: Callable[[Request], Awaitable[Response]], request: Request,
                    context: grpc.aio.ServicerContext) -> Any:
        """The JSON answer of ``route`` for ``request``; an error answer ends the call."""
        response = await route(request)
        if response.status_code != 200:
            await _abort(context, response)
        return json.loads(bytes(response.body)) if response.body else None

    async def _ready(self, route: Callable[[Request], Awaitable[Response]], request: Request,
                     context: grpc.aio.ServicerContext, not_ready: tuple[int, ...] = _NOT_READY) -> bool:
        """A ready route's answer: True (200), False (a status in ``not_ready``), else the error
        ends the call."""
        response = await route(request)
        if response.status_code != 200 and response.status_code not in not_ready:
            await _abort(context, response)
        return response.status_code == 200

    async def infer(self, request: Any) -> Response:
        """``ModelInfer`` through the node's HTTP ingress (``forward``, where ``_forwards``) or
        the router's infer route (module docstring)."""
        try:
            chunks, length = infer_body(request)
            headers, error = {HEADER_LENGTH: str(length)}, None
        except InvalidInput as e:
            chunks, length, headers, error = [], 0, {}, e
        params, path = _model_params(request.model_name, request.model_version)
        if self.forward is not None and error is None and self._forwards(self.forward, request, chunks):
            quoted = _model_params(quote(request.model_name, safe=""), quote(request.model_version, safe=""))[1]
            answer = await self.forward.infer(request.model_name, f"{quoted}/infer", chunks, length)
            if answer is not None:
                return answer
        return await self.routes.infer(_http_request("POST", f"{path}/infer", params, chunks, headers, error, length))

    @_answers_errors
    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        response = await self.infer(request)
        if response.status_code != 200:
            await _abort(context, response)
        return infer_response(bytes(response.body), response.headers)

    async def ModelStreamInfer(self, request_iterator: AsyncIterator[Any],
                               context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        """Each request of the stream in turn; an error answers that request's
        ``error_message`` with its ``infer_response.id`` (the request's ``id``, so the client
        knows which request failed), and the stream goes on (as Triton's
        ``stream_infer_handler.cc``)."""
        async for request in request_iterator:
            answer = None
            try:
                response = await self.infer(request)
                if response.status_code == 200:
                    answer = pb.ModelStreamInferResponse(infer_response=infer_response(bytes(response.body),
                                                                                       response.headers))
            except Exception as e:
                response = error_response(e)
            yield answer if answer is not None else pb.ModelStreamInferResponse(
                error_message=_error(response), infer_response=pb.ModelInferResponse(id=request.id))

    @_answers_errors
    async def ServerLive(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        live = await self._json(self.routes.live, _http_request("GET", "/v2/health/live", {}), context)
        return pb.ServerLiveResponse(live=live["live"])

    @_answers_errors
    async def ServerReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        ready = await self._ready(self.routes.server_ready, _http_request("GET", "/v2/health/ready", {}), context)
        return pb.ServerReadyResponse(ready=ready)

    @_answers_errors
    async def ModelReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        params, path = _model_params(request.name, request.version)
        ready = await self._ready(self.routes.model_ready, _http_request("GET", f"{path}/ready", params), context,
                                  _MODEL_NOT_READY)
        return pb.ModelReadyResponse(ready=ready)

    @_answers_errors
    async def ServerMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        value = await self._json(self.routes.server_metadata, _http_request("GET", "/v2", {}), context)
        return json_message(value, pb.ServerMetadataResponse())

    @_answers_errors
    async def ModelMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        params, path = _model_params(request.name, request.version)
        value = await self._json(self.routes.metadata, _http_request("GET", path, params), context)
        return json_message(value, pb.ModelMetadataResponse())

    @_answers_errors
    async def ModelConfig(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        params, path = _model_params(request.name, request.version)
        value = await self._json(self.routes.model_config, _http_request("GET", f"{path}/config", params), context)
        return pb.ModelConfigResponse(config=json_message(value, model_config_pb2.ModelConfig()))

    @_answers_errors
    async def ModelStatistics(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        params, path = _model_params(request.name, request.version) if request.name else ({}, "/v2/models")
        value = await self._json(self.routes.statistics, _http_request("GET", f"{path}/stats", params), context)
        return json_message(value, pb.ModelStatisticsResponse())

    def _repository(self, request: Any) -> None:
        """Raises InvalidInput for a named repository: this server has one, named by none."""
        if request.repository_name:
            raise InvalidInput(f"repository '{request.repository_name}': this server has one model repository; "
                               "leave repository_name empty")

    @_answers_errors
    async def RepositoryIndex(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self._repository(request)
        body = [json.dumps({"ready": request.ready}).encode()]
        value = await self._json(self.routes.repository_index,
                                 _http_request("POST", "/v2/repository/index", {}, body), context)
        return json_message({"models": value}, pb.RepositoryIndexResponse())

    async def _control(self, verb: str, request: Any, context: grpc.aio.ServicerContext) -> None:
        """A load or unload through its HTTP route (``repository_routes``)."""
        self._repository(request)
        route = self.routes.load if verb == "load" else self.routes.unload  # type: ignore[attr-defined]
        body = repository_body(request.parameters)
        await self._json(route, _http_request(
            "POST", f"/v2/repository/models/{request.model_name}/{verb}", {"name": request.model_name},
            [json.dumps(body).encode()] if body else []), context)

    @_answers_errors
    async def RepositoryModelLoad(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._control("load", request, context)
        return pb.RepositoryModelLoadResponse()

    @_answers_errors
    async def RepositoryModelUnload(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._control("unload", request, context)
        return pb.RepositoryModelUnloadResponse()

    async def _shm(self, kind: str, verb: str, name: str, context: grpc.aio.ServicerContext,
                   body: dict[str, Any] | None = None) -> Any:
        """A shared-memory call through its HTTP route (``shared_memory_routes``): ``kind``
        ``system`` or ``cuda``, ``verb`` ``status``, ``register`` or ``unregister``, for region
        ``name`` (empty: every region of its kind, for status and unregister)."""
        routes: Any = self.routes
        route = {"status": routes.shm_status, "register": routes.shm_register, "unregister": routes.shm_unregister}[verb]
        base = f"/v2/{kind}sharedmemory"
        path, params = (f"{base}/region/{name}/{verb}", {"region": name}) if name or verb == "register" else \
            (f"{base}/{verb}", {})
        chunks = [json.dumps(body).encode()] if body else []
        return await self._json(route, _http_request("GET" if verb == "status" else "POST", path, params, chunks),
                                context)

    @_answers_errors
    async def SystemSharedMemoryStatus(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        regions = await self._shm("system", "status", request.name, context)
        return region_statuses(regions, pb.SystemSharedMemoryStatusResponse())

    @_answers_errors
    async def SystemSharedMemoryRegister(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._shm("system", "register", request.name, context, system_register_body(request))
        return pb.SystemSharedMemoryRegisterResponse()

    @_answers_errors
    async def SystemSharedMemoryUnregister(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._shm("system", "unregister", request.name, context)
        return pb.SystemSharedMemoryUnregisterResponse()

    @_answers_errors
    async def CudaSharedMemoryStatus(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        regions = await self._shm("cuda", "status", request.name, context)
        return region_statuses(regions, pb.CudaSharedMemoryStatusResponse())

    @_answers_errors
    async def CudaSharedMemoryRegister(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._shm("cuda", "register", request.name, context, cuda_register_body(request))
        return pb.CudaSharedMemoryRegisterResponse()

    @_answers_errors
    async def CudaSharedMemoryUnregister(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._shm("cuda", "unregister", request.name, context)
        return pb.CudaSharedMemoryUnregisterResponse()

    async def _unimplemented(self, context: grpc.aio.ServicerContext, message: str) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, message)

    async def TraceSetting(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._unimplemented(context, "trace settings are not supported: request logs and metrics are "
                                           "configured in the application args (metrics)")

    async def LogSettings(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._unimplemented(context, "log settings are not supported: the replicas log through Ray Serve "
                                           "(its logging_config)")


# Seconds a stopping router replica gives its gRPC calls in flight (its HTTP requests have
# drained by then: Serve waits for them before the replica's destructor runs).
STOP_GRACE_S = 5.0


class _HandlerCapture:
    """Stands in for a server to collect the generated ``add_..._to_server``'s generic handler
    (every tritonclient version registers one; newer ones also register the same handlers by
    method, which the generic one already serves)."""

    def __init__(self) -> None:
        self.generic: list[grpc.GenericRpcHandler] = []

    def add_generic_rpc_handlers(self, handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        self.generic.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        pass


class _Call:
    def __init__(self, method: str) -> None:
        self.method = method


def _parsed_in_the_call(name: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """``handler`` taking the raw message and parsing it itself, so a message that is not a
    valid protobuf of its type ends the call INVALID_ARGUMENT with what was wrong (grpcio
    answers a failing deserializer UNKNOWN "Unexpected DecodeError")."""
    parse = handler.request_deserializer

    async def parsed(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            return parse(raw)
        except DecodeError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the {name} request is not a valid protobuf message of its type ({e})")

    if handler.unary_unary is not None:
        unary = handler.unary_unary

        async def unary_unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            return await unary(await parsed(raw, context), context)

        return handler._replace(request_deserializer=None, unary_unary=unary_unary)
    stream = handler.stream_stream

    async def stream_stream(raws: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async def requests() -> AsyncIterator[Any]:
            async for raw in raws:
                yield await parsed(raw, context)

        async for answer in stream(requests(), context):
            yield answer

    return handler._replace(request_deserializer=None, stream_stream=stream_stream)


def service_handler(routes: V2Routes, forward: IngressForward | None = None) -> grpc.GenericRpcHandler:
    """``InferenceService(routes, forward)``'s methods as one handler, each parsing its own message."""
    capture = _HandlerCapture()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceService(routes, forward), capture)
    (generated,) = capture.generic
    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    return grpc.method_handlers_generic_handler(service.full_name, {
        method.name: _parsed_in_the_call(method.name, generated.service(_Call(f"/{service.full_name}/{method.name}")))
        for method in service.methods})


def _raylet(process: psutil.Process) -> str:
    """The raylet a process belongs to: Ray's ``RAY_RAYLET_PID`` in a worker's environment, else
    its parent (the raylet starts the workers)."""
    return process.environ().get("RAY_RAYLET_PID", str(process.ppid()))


def foreign_listeners(port: int, title: str | None = None) -> list[str]:
    """The processes listening on TCP ``port`` other than this one and its siblings, each as
    ``pid N (command)``; ``unknown process`` where the socket's owner cannot be read. A sibling
    belongs to this process's raylet (the same node) and has the process title ``title`` (a
    router replica's ``ray::ServeReplica:<application>:<deployment>``, to which Ray appends
    ``.<method>`` while one runs; None: this process's own title). SO_REUSEPORT lets any process
    of the same user bind a port another one listens on, and the kernel then spreads
    connections among them: a second server on the port would answer some of this one's calls."""
    me = psutil.Process()
    node, title = _raylet(me), title or me.cmdline()[0]
    found = []
    for connection in psutil.net_connections(kind="tcp"):
        if connection.status != psutil.CONN_LISTEN or connection.laddr.port != port or connection.pid == me.pid:
            continue
        if connection.pid is None:
            found.append("unknown process")
            continue
        try:
            other = psutil.Process(connection.pid)
            named = other.cmdline()[0].rstrip()
            if _raylet(other) == node and (named == title or named.startswith(f"{title}.")):
                continue
            found.append(f"pid {connection.pid} ({' '.join(other.cmdline()).rstrip()[:120]})")
        except (psutil.Error, IndexError):
            found.append(f"pid {connection.pid}")
    return sorted(set(found))


async def start(routes: V2Routes, port: int, host: str, max_message_bytes: int, title: str | None = None,
                forward: IngressForward | None = None) -> grpc.aio.Server:
    """Serve ``InferenceService(routes, forward)`` on ``host:port`` from this event loop; messages up to
    ``max_message_bytes`` (``max_body_mib``: grpcio answers a larger one RESOURCE_EXHAUSTED).
    SO_REUSEPORT (grpcio's default on Linux, set here explicitly) lets every router replica of
    the node listen on the same port; the kernel spreads connections among them. Any other
    process on the port (``foreign_listeners``, ``title`` naming the replicas that share it) would
    get a share of the calls: the server is stopped again and the start fails.

    Raises:
        RuntimeError: the port cannot be bound (held by a process without SO_REUSEPORT), or
            another server listens on it too.
    """
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", max_message_bytes),
                                      ("grpc.max_send_message_length", -1), ("grpc.so_reuseport", 1)])
    server.add_generic_rpc_handlers((service_handler(routes, forward),))
    server.add_insecure_port(f"{host}:{port}")
    await server.start()
    others = foreign_listeners(port, title)
    if others:
        await server.stop(None)
        raise RuntimeError(f"another server listens on port {port} too, and would answer some of its calls: "
                           + ", ".join(others))
    return server


# Where HAProxy is the ingress (``make serve``), Ray Serve serves gRPC itself: ``deployments.run``
# gives the Serve config ``grpc_options`` naming this function, each ingress replica (the
# router's, a dedicated model's, a pipeline's, a pool replica) runs Serve's gRPC server on a
# port of its own, and HAProxy's gRPC frontend sends a ModelInfer to the replicas of the model
# its message names (``haproxy.route_grpc_models``) and every other call to the router's: one
# hop, as over HTTP. Serve's server calls the deployment's method of the RPC's name
# (``ServeGrpcMethods``).
SERVE_SERVICER = "deployments.grpc_service.add_kserve_v2_service"
_CLUSTER_METADATA = CLUSTER_HEADER.lower()


def add_kserve_v2_service(servicer: Any, server: Any) -> None:
    """The servicer function of Serve's ``grpc_options`` (``SERVE_SERVICER``): every method of
    ``inference.GRPCInferenceService`` on ``server`` (Serve's gRPC server, which sends each call
    to the deployment's method of the same name), taking the message's raw bytes, so that the
    method parses it itself: a message that is not protobuf ends INVALID_ARGUMENT, and one over
    ``max_body_mib`` RESOURCE_EXHAUSTED naming the limit (Serve's server takes up to 2 GiB).
    ``servicer`` is Serve's stand-in, unused."""
    capture = _HandlerCapture()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(pb_grpc.GRPCInferenceServiceServicer(), capture)
    (generated,) = capture.generic
    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, {
        method.name: generated.service(_Call(f"/{service.full_name}/{method.name}"))._replace(request_deserializer=None)
        for method in service.methods}),))


def serves_kserve_grpc(options: Any) -> bool:
    """Whether Serve's ``gRPCOptions`` (``options``; None: none) serve KServe v2 gRPC
    (``SERVE_SERVICER`` among its servicer functions)."""
    return options is not None and SERVE_SERVICER in (options.grpc_servicer_functions or ())


class _ServeCall:
    """The part of grpc.aio's call context ``InferenceService`` uses, over the context Ray Serve
    gives a deployment's gRPC method (``RayServegRPCContext``): ``abort`` sets its code and
    details and ends the method with grpc.aio's ``AbortError``, which the method answers with an
    empty message (Serve then sends the code and details it was given)."""

    def __init__(self, context: Any) -> None:
        self.context = context

    def set_trailing_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.context.set_trailing_metadata(list(metadata))

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.context.set_code(code)
        self.context.set_details(details)
        raise grpc.aio.AbortError()


async def _parse(method: str, message_type: Any, raw: bytes, call: _ServeCall) -> Any:
    """``raw`` as a ``message_type``; one that is not ends the call INVALID_ARGUMENT, in the
    words of ``_parsed_in_the_call``."""
    try:
        return message_type.FromString(raw)
    except DecodeError as e:
        await call.abort(grpc.StatusCode.INVALID_ARGUMENT,
                         f"the {method} request is not a valid protobuf message of its type ({e})")


async def _within_limit(service: InferenceService, method: str, raw: bytes, call: _ServeCall) -> None:
    """Ends the call RESOURCE_EXHAUSTED naming the limit where message ``raw`` is over
    ``max_body_bytes`` (Serve's server takes up to 2 GiB)."""
    limit = service.routes.max_body_bytes
    if len(raw) > limit:
        await _abort(call, error_response(PayloadTooLarge(f"the {method} message is {len(raw)} bytes; the limit is "
                                                          f"{limit} bytes")))


async def _check_cluster(service: InferenceService, grpc_context: Any, call: _ServeCall, method: str) -> None:
    """Ends the call UNAVAILABLE (421's text, ``routes.misdirected``) where HAProxy stamped it
    with another Ray cluster's id (``haproxy.CLUSTER_HEADER``, as an HTTP request's header): it
    came from another server's HAProxy on this host through a port this replica holds now."""
    sent = dict(grpc_context.invocation_metadata()).get(_CLUSTER_METADATA)
    error = misdirected(service.routes.cluster, sent, method)
    if error is not None:
        await _abort(call, error_response(error, log=False))


def _serve_method(method: Any) -> Callable[..., Any]:
    """The deployment method that answers RPC ``method`` (a method descriptor of the service)
    when Serve's gRPC server calls it: the raw message parsed, then ``InferenceService``'s
    method of the same name over the deployment's routes (``ServeGrpcMethods``)."""
    name, request_type = method.name, getattr(pb, method.input_type.name)
    empty = getattr(pb, method.output_type.name)

    if method.client_streaming:
        async def stream(self: Any, requests: AsyncIterator[bytes], grpc_context: Any) -> AsyncIterator[Any]:
            call = _ServeCall(grpc_context)

            service = self.kserve_service()

            async def parsed() -> AsyncIterator[Any]:
                async for raw in requests:
                    await _within_limit(service, name, raw, call)
                    yield await _parse(name, request_type, raw, call)

            try:
                await _check_cluster(service, grpc_context, call, name)
                async for answer in getattr(service, name)(parsed(), call):
                    yield answer
            except grpc.aio.AbortError:
                return

        stream.__name__ = name
        return stream

    async def unary(self: Any, raw: bytes, grpc_context: Any) -> Any:
        call = _ServeCall(grpc_context)
        service = self.kserve_service()
        try:
            await _check_cluster(service, grpc_context, call, name)
            await _within_limit(service, name, raw, call)
            return await getattr(service, name)(await _parse(name, request_type, raw, call), call)
        except grpc.aio.AbortError:
            return empty()

    unary.__name__ = name
    return unary


class ServeGrpcMethods:
    """A method per RPC of ``inference.GRPCInferenceService``, each answering as the router's
    gRPC server does (``InferenceService``) over the deployment's own routes
    (``kserve_routes``), for Serve's gRPC server (``add_kserve_v2_service``): an ingress
    deployment (the router, a dedicated model, a pipeline, the pool) inherits it, and HAProxy
    sends it the calls it serves (``haproxy.route_grpc_models``)."""

    def kserve_routes(self) -> V2Routes:
        """The routes the methods answer through: a model replica's ``routes``."""
        return self.routes  # type: ignore[attr-defined, no-any-return]

    def kserve_service(self) -> InferenceService:
        """The ``InferenceService`` over ``kserve_routes``, made at the first call: a ModelInfer
        that reached this replica runs here (no hop through the HTTP ingress)."""
        service = self.__dict__.get("_kserve_service")
        if service is None:
            service = self.__dict__["_kserve_service"] = InferenceService(self.kserve_routes())
        return service


for _method in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
    setattr(ServeGrpcMethods, _method.name, _serve_method(_method))
