"""The router / ingress deployment: KServe v2 REST routes, validation, dispatch by model name.

Routes (Open Inference Protocol, plus Triton's repository index):
    GET  /v2/health/live, /v2/health/ready, /v2
    GET  /v2/models/{name}[/versions/{version}][/ready]
    POST /v2/models/{name}[/versions/{version}]/infer
    POST /v2/repository/index
Infer speaks JSON and Triton's binary tensor data extension (``protocol.binary``).
Every error answers ``{"error": "..."}`` with the status from ``protocol.errors``.

``RouterApp`` holds the routes and builds the Starlette app from a repository and a
``ModelClient`` (tests run it under ``starlette.testclient.TestClient`` with a fake client);
``Router``, at the bottom, is the Ray Serve deployment around it. The router checks only what
routing needs (model, version, body size, readiness); the replica that runs a request
validates its tensors.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable

from ray import serve
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from . import __version__
from .client import ModelClient
from .protocol.binary import HEADER_LENGTH, decode_body, encode_response
from .protocol.errors import error_status
from .protocol.v2 import model_metadata
from .runtime.contract.errors import InferenceTimeout, InvalidInput, MethodNotAllowed, ModelNotFound, ModelNotReady, PayloadTooLarge
from .runtime.contract.repository import ModelEntry, ModelRepository

logger = logging.getLogger("ray.serve")

SERVER_NAME = "trt-serve"
EXTENSIONS = ["model_repository", "binary_tensor_data"]
_READY_POLL_S = 1.0
_MODEL_PATH = re.compile(r"^/v2/models/(?P<name>.+?)(?:/versions/[^/]*)?(?:/ready|/infer)?/?$")
# KServe / Triton platform names by backend.
# ONNX Runtime on CPU and on CUDA share Triton's platform name; metadata's ``backend`` tells them apart.
PLATFORMS = {"onnxruntime": "onnxruntime_onnx", "onnxruntime_cuda": "onnxruntime_onnx",
             "tensorrt": "tensorrt_plan", "pipeline": "ensemble"}


def _answers_errors(route: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
    """Turn any exception a route raises into its ``{"error": ...}`` response (one error table)."""

    @functools.wraps(route)
    async def wrapper(self: Any, request: Request) -> Response:
        try:
            return await route(self, request)
        except Exception as e:
            return error_response(e)

    return wrapper


def error_response(exc: BaseException, headers: dict[str, str] | None = None) -> Response:
    """``{"error": ...}`` with the status from the one error table; ASCII-escaped JSON, so a
    message quoting any client text always renders."""
    status, message = error_status(exc)
    return Response(json.dumps({"error": message}), status_code=status, media_type="application/json",
                    headers=headers)


@dataclass(frozen=True)
class RouterOptions:
    """The router's options (their defaults live in ``deployments.app.AppArgs``).

    ``max_body_bytes``: request bodies above this get 413. ``request_timeout_s``: a model call
    taking longer gets 504. ``backend``: the configured backend, reported as the platform of
    pool models.
    """

    max_body_bytes: int
    request_timeout_s: float
    backend: str


class RouterApp:
    """The KServe v2 HTTP routes over a model repository and a ``ModelClient``; no Ray.

    Args:
        repo: the served models (each router reads the configs, never the models).
        client: calls the models (``ModelClient``, or a fake with its interface in tests).
        options: ``RouterOptions``.
    """

    def __init__(self, repo: ModelRepository, client: ModelClient, options: RouterOptions) -> None:
        self.repo = repo
        self.client = client
        self.max_body_bytes = options.max_body_bytes
        self.request_timeout_s = options.request_timeout_s
        # Platform per model for metadata; dedicated replicas report theirs when ready.
        self.platforms = {name: PLATFORMS.get(options.backend, options.backend) for name in self.client.pool_models}
        self.backends: dict[str, str] = {}  # dedicated models: the backend their replica runs
        # Dedicated deployments are "loading" until a replica answers; pool models load on demand.
        self.ready_models: set[str] = set(self.client.pool_models)

    def build_app(self) -> Starlette:
        app = Starlette(routes=[
            Route("/v2/health/live", self.live, methods=["GET"]),
            Route("/v2/health/ready", self.server_ready, methods=["GET"]),
            Route("/v2", self.server_metadata, methods=["GET"]),
            Route("/v2/models/{name}", self.metadata, methods=["GET"]),
            Route("/v2/models/{name}/versions/{version}", self.metadata, methods=["GET"]),
            Route("/v2/models/{name}/ready", self.model_ready, methods=["GET"]),
            Route("/v2/models/{name}/versions/{version}/ready", self.model_ready, methods=["GET"]),
            Route("/v2/models/{name}/infer", self.infer, methods=["POST"]),
            Route("/v2/models/{name}/versions/{version}/infer", self.infer, methods=["POST"]),
            Route("/v2/repository/index", self.repository_index, methods=["POST"]),
            Route("/v2/memory", self.memory, methods=["GET"]),
        ], exception_handlers={404: self._not_found, 405: self._not_allowed})
        app.router.redirect_slashes = False  # a trailing slash is an unknown route (404), not a redirect
        return app

    # --- readiness -------------------------------------------------------------------------
    async def poll_ready(self) -> None:
        """Ask each dedicated model for its backend until all answered (loaded); returns then."""
        pending = set(self.client.dedicated)
        while pending:
            for name in sorted(pending):
                try:
                    backend = await asyncio.wait_for(self.client.backend(name), _READY_POLL_S)
                    self.platforms[name] = PLATFORMS.get(backend, backend)
                    self.backends[name] = backend
                    self.ready_models.add(name)
                    pending.discard(name)
                except Exception:  # no replica yet, or still loading: poll again
                    pass
            if pending:
                await asyncio.sleep(_READY_POLL_S)

    def _entry(self, request: Request) -> ModelEntry:
        params = request.path_params
        return self.repo.get(params["name"], params.get("version"))

    def _require_ready(self, entry: ModelEntry) -> None:
        if entry.name not in self.ready_models:
            raise ModelNotReady(
                f"model '{entry.name}' is not ready: its deployment is still loading or has no "
                "running replica; retry shortly (GET /v2/models/{name}/ready tells when)".replace(
                    "{name}", entry.name))

    # --- routes ------------------------------------------------------------------------------
    async def _not_found(self, request: Request, exc: Exception) -> Response:
        # A model name holding '/' (e.g. "../x" sent as "..%2Fx") matches no route: answer it
        # exactly as any unknown model name, without touching the filesystem.
        match = _MODEL_PATH.match(request.url.path)
        if match:
            return error_response(ModelNotFound(
                f"unknown model '{match.group('name')}'; available models: {self.repo.names()}"))
        return error_response(ModelNotFound(
            f"no route {request.method} {request.url.path}; see the KServe v2 REST API"))

    async def _not_allowed(self, request: Request, exc: Exception) -> Response:
        allow = (getattr(exc, "headers", None) or {}).get("Allow", "")
        return error_response(MethodNotAllowed(
            f"method {request.method} not allowed on {request.url.path}; allowed: {allow}"), {"Allow": allow})

    async def live(self, request: Request) -> JSONResponse:
        return JSONResponse({"live": True})

    @_answers_errors
    async def server_ready(self, request: Request) -> JSONResponse:
        loading = sorted(set(self.repo.names()) - self.ready_models)
        if loading:
            raise ModelNotReady(f"server not ready: models still loading: {loading}")
        return JSONResponse({"ready": True})

    async def server_metadata(self, request: Request) -> JSONResponse:
        return JSONResponse({"name": SERVER_NAME, "version": __version__, "extensions": EXTENSIONS})

    @_answers_errors
    async def metadata(self, request: Request) -> JSONResponse:
        entry = self._entry(request)
        return JSONResponse(model_metadata(entry.config, (entry.latest,), self.platforms.get(entry.name, ""),
                                           self.backends.get(entry.name)))

    @_answers_errors
    async def model_ready(self, request: Request) -> JSONResponse:
        entry = self._entry(request)
        self._require_ready(entry)
        return JSONResponse({"name": entry.name, "ready": True})

    async def repository_index(self, request: Request) -> JSONResponse:
        index = []
        for entry in self.repo.entries():
            item = {"name": entry.name, "version": str(entry.latest),
                    "state": "READY" if entry.name in self.ready_models else "LOADING"}
            if entry.name in self.client.pool_models:
                item["reason"] = "multiplexed pool: loads on first request"
            index.append(item)
        return JSONResponse(index)

    @_answers_errors
    async def memory(self, request: Request) -> JSONResponse:
        """Resident memory: the cache of one pool replica (status + load/evict timeline; the
        ``replica`` field names which) and each ready dedicated model's footprint (one replica's)."""
        engines = [n for n in sorted(self.client.dedicated)
                   if n in self.ready_models and not self.repo.get(n).config.pipeline]
        calls = [self.client.memory(n) for n in engines]
        if self.client.pool is not None:
            calls.append(self.client.pool_memory())
        try:
            answers = await asyncio.wait_for(asyncio.gather(*calls), self.request_timeout_s)
        except asyncio.TimeoutError:
            raise InferenceTimeout(f"memory status did not arrive within {self.request_timeout_s:g} s") from None
        pool = answers.pop() if self.client.pool is not None else None
        return JSONResponse({"pool": pool, "dedicated": dict(zip(engines, answers))})

    async def _read_body(self, request: Request) -> list[bytes]:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise PayloadTooLarge(
                f"request body is {int(declared)} bytes; the limit is {self.max_body_bytes} bytes")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise PayloadTooLarge(f"request body exceeds the limit of {self.max_body_bytes} bytes")
                chunks.append(chunk)
        except ClientDisconnect:  # a client mistake, not a server fault: no 5xx, no error log
            raise InvalidInput(f"the client disconnected after {size} bytes of the request body") from None
        return chunks

    async def _call_model(self, name: str, inputs: dict, outputs: list[str] | None) -> dict:
        try:
            return await asyncio.wait_for(self.client.infer(name, inputs, outputs), self.request_timeout_s)
        except asyncio.TimeoutError:
            raise InferenceTimeout(f"model '{name}' did not answer within {self.request_timeout_s:g} s") from None

    @_answers_errors
    async def infer(self, request: Request) -> Response:
        entry = self._entry(request)
        chunks = await self._read_body(request)
        infer_request = decode_body(chunks, request.headers.get(HEADER_LENGTH))
        self._require_ready(entry)
        outputs = await self._call_model(entry.name, infer_request.inputs, infer_request.outputs)
        content, headers = encode_response(entry.name, str(entry.latest), infer_request, outputs)
        return Response(content, headers=headers)


@serve.deployment
@serve.ingress()
class Router(RouterApp):
    """The ``RouterApp`` as a Ray Serve ingress deployment, calling models through handles.

    Args:
        repository: model repository root.
        dedicated: model name -> handle of its dedicated deployment (pipelines included).
        pool: handle of the multiplexed pool deployment, or None.
        pool_models: names served by the pool.
        options: ``RouterOptions``.
        models: the served subset of the repository (None: all).
    """

    def __init__(self, repository: str, dedicated: dict[str, Any], pool: Any | None,
                 pool_models: Iterable[str], options: RouterOptions, models: list[str] | None = None) -> None:
        super().__init__(ModelRepository(repository, models), ModelClient(dedicated, pool, pool_models), options)
        self._poller = asyncio.get_running_loop().create_task(self.poll_ready())

    def __serve_build_asgi_app__(self) -> Starlette:
        return self.build_app()
