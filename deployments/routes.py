"""The KServe v2 route table every replica serves (health, metadata, config, ready, infer, stats,
metrics), request body reading and the answer of an error; no Ray.

``V2Routes`` answers them over a model repository and a ``ModelClient``: the router
(``ingress.RouterApp``) adds the repository and model-control routes and readiness watching; a
model or pool replica (``replica_routes``) serves them for its own models. A route that raises
answers ``{"error": "..."}`` with the status from ``protocol.errors``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence
from urllib.parse import unquote

from starlette._utils import get_route_path  # Starlette's own reading of a route's path
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from . import __version__
from .admission import Admission
from .client import ModelClient
from .control import Desired, Follower
from .haproxy import CLUSTER_HEADER, cluster_id
from .observe.metrics import node_directory, node_families, render as render_metrics
from .observe.options import start as start_metrics
from .observe.router import RouterObserver, add_phases, observe_infer
from .observe.statistics import statistics
from .protocol.answer import answer, answered_within, request_bound, timeout_error
from .protocol.binary import HEADER_LENGTH
from .protocol.compression import CompressionMiddleware, decompress, preferred_coding
from .protocol.errors import detached, error_status, retry_after_headers
from .protocol.shared_memory import SharedMemory
from .protocol.triton import model_configuration, platform_of
from .protocol.v2 import InferRequest, model_metadata, parse_json
from .runtime.contract.errors import (InferenceTimeout, InvalidInput, MethodNotAllowed, MisdirectedRequest,
                                      ModelNotFound, ModelNotReady,
                                      PayloadTooLarge, RequestTimeout, ServingError, unknown_model, unloaded_model)
from .runtime.contract.repository import ModelEntry, ModelRepository
from .states import LOADED, ModelStates, Status

SERVER_NAME = "trt-serve"
EXTENSIONS = ["model_repository", "model_configuration", "binary_tensor_data", "classification",
              "statistics", "system_shared_memory", "cuda_shared_memory"]
# A pool replica bounds a request's run itself (it decodes the request, so only it knows the
# request's own parameters.timeout); the router's bound waits this much longer, as a backstop.
POOL_TIMEOUT_GRACE_S = 5.0
_MODEL_ROUTES = "/v2/models/{name}[/versions/{version}][/ready|/config|/infer|/stats]"
_SERVER_ROUTES = ("GET /v2, GET /v2/health/live, GET /v2/health/ready, POST /v2/repository/index (lists the "
                  "models), POST /v2/repository/models/{name}/load|unload, GET /v2/models/stats, GET /v2/memory, "
                  "GET /metrics, GET /v2/systemsharedmemory|cudasharedmemory[/region/{name}]/status, POST "
                  "/v2/systemsharedmemory|cudasharedmemory[/region/{name}]/register|unregister, POST /v1/embeddings, "
                  "GET /v1/models, GET /v1/models/{model}")
# A request body that sends nothing for this long is answered 408 (the time between two
# chunks, as nginx's client_body_timeout: a slow upload that keeps sending is not cut). HAProxy's
# own `timeout http-request` (deployments/haproxy.py) covers only the headers and the first
# 16 KiB of body, so without this a client that stalls after them held a slot of the replica
# (and of the router's max_ongoing_requests) without end.
BODY_STALL_TIMEOUT_S = 30.0
# In a request's ASGI scope: bytes of its body that a protocol edge added and the client never
# sent (the gRPC edge's JSON header, ``deployments.grpc_service``), left out of ``max_body_bytes``.
EDGE_HEADER_BYTES = "trt_serve.edge_header_bytes"


def answers_errors(route: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
    """Turn any exception a route raises into its ``{"error": ...}`` response (one error table)."""

    @functools.wraps(route)
    async def wrapper(self: Any, request: Request) -> Response:
        try:
            return await route(self, request)
        except Exception as e:
            return error_response(e)

    return wrapper


def error_response(exc: BaseException, headers: dict[str, str] | None = None, log: bool = True) -> Response:
    """``{"error": ...}`` with the status from the one error table (and ``Retry-After`` for a
    shed request); ASCII-escaped JSON, so a message quoting any client text always renders.
    ``log``: as in ``error_status``."""
    status, message = error_status(exc, log)
    detached(exc)  # a cycle that keeps the exception must not keep the request's data
    return Response(json.dumps({"error": message}), status_code=status, media_type="application/json",
                    headers={**retry_after_headers(exc), **(headers or {})})


_CLUSTER_HEADER = CLUSTER_HEADER.lower().encode()  # as ASGI spells header names


def first_header(scope: dict, name: bytes) -> str | None:
    """The first value of header ``name`` (lowercase, as ASGI gives names) in ``scope``; None
    where the request has none (``Headers.get``'s reading, without building ``Headers``)."""
    return next((value.decode("latin-1") for key, value in scope.get("headers", ()) if key == name), None)


class ClusterGuard:
    """ASGI middleware: a request that HAProxy stamped with another Ray cluster's id
    (``haproxy.CLUSTER_HEADER``; ``deployments/haproxy.py``, ``mark_cluster``) is answered 421
    (``MisdirectedRequest``) and not run: it came from another server's HAProxy on this host
    through a port this replica holds now. A request without the header (Serve's Python proxy
    mode, a handle, a test calling the app) and every request where ``cluster`` is None (this
    process's cluster unknown) pass."""

    def __init__(self, app: Callable, cluster: str | None) -> None:
        self.app = app
        self.cluster = cluster

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            sent = first_header(scope, _CLUSTER_HEADER)
            error = misdirected(self.cluster, sent, scope.get("path", "?"))
            if error is not None:
                await error_response(error, log=False)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def same_cluster(cluster: str | None, sent: str | None) -> bool:
    """Whether a request HAProxy stamped with Ray cluster ``sent`` (None: not stamped) may run in
    a replica of ``cluster`` (None: unknown): not stamped, unknown, or the same."""
    return sent is None or cluster is None or sent == cluster


def misdirected(cluster: str | None, sent: str | None, what: str) -> MisdirectedRequest | None:
    """The error (421, logged) for a request (``what``: its path or method) that HAProxy stamped
    with Ray cluster ``sent`` (its ``CLUSTER_HEADER``; None: none) reaching a replica of
    ``cluster`` (None: unknown): None where ``same_cluster`` (``ClusterGuard``; a gRPC call's
    metadata, ``grpc_service.ServeGrpcMethods``)."""
    if same_cluster(cluster, sent):
        return None
    logging.getLogger("ray.serve").warning(
        "421: a request for %s from the HAProxy of Ray cluster '%s' reached this replica of '%s'", what, sent, cluster)
    return MisdirectedRequest(
        f"this replica belongs to another Ray cluster ('{cluster}', not '{sent}', whose HAProxy "
        "sent the request): it reached it through a stale or shared port (another server runs on "
        "this host); the request was not run: send it again")


class V2App:
    """The ASGI app of a ``V2Routes`` (``build_app``): ``app``, its Starlette app, behind two
    steps every request takes first.

    - Where Serve mounts the routes under a route prefix that ends in ``suffix`` (a model's own
      application at ``/v2/models/{name}``, the pool's at ``/v2/models``), the suffix is taken
      off ``root_path`` again, so that the routes match the full path (the router's table, the
      same ``{name}`` parameters).
    - An infer request (``POST /v2/models/{name}[/versions/{version}]/infer``, ``infer_params``)
      goes straight to the infer route (``V2Routes.infer``: the same checks, errors and metrics)
      through the same response compression (``CompressionMiddleware.responder``), without
      Starlette's middleware stack and route matching, which cost a replica more CPU per request
      than decoding it. One HAProxy stamped for another Ray cluster goes through the app, whose
      ``ClusterGuard`` answers it 421.
    """

    def __init__(self, app: Callable, routes: "V2Routes", suffix: str = "") -> None:
        self.app = app
        self.v2 = routes
        self.suffix = suffix
        self.compression = CompressionMiddleware(app)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        kind = scope["type"]
        if kind != "http" and kind != "websocket":
            await self.app(scope, receive, send)
            return
        root = scope.get("root_path", "")
        if self.suffix and root.endswith(self.suffix):
            scope = {**scope, "root_path": root[:-len(self.suffix)]}
        if kind == "http" and scope["method"] == "POST" and scope["path"].endswith("/infer"):
            params = infer_params(get_route_path(scope))
            if params is not None and same_cluster(self.v2.cluster, first_header(scope, _CLUSTER_HEADER)):
                scope = {**scope, "path_params": params}
                coding = preferred_coding(first_header(scope, b"accept-encoding"))
                if coding is None:
                    await self._infer(scope, receive, send, vary=True)
                else:
                    await self.compression.responder(self._infer, coding)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    @property
    def routes(self) -> list[Any]:
        """The Starlette app's route table (as ``Starlette.routes``)."""
        return self.app.routes

    @property
    def router(self) -> Any:
        """The Starlette app's router (Serve reads ``router.redirect_slashes`` to name a request's route)."""
        return self.app.router

    async def _infer(self, scope: dict, receive: Callable, send: Callable, vary: bool = False) -> None:
        """The infer route's answer; ``vary``: uncompressed, not through a responder, with the
        ``Vary`` header the identity responder would add."""
        response = await self.v2.infer(Request(scope, receive))
        if vary and len(response.body) >= self.compression.minimum_size:
            response.headers.add_vary_header("Accept-Encoding")
        await response(scope, receive, send)


def infer_params(path: str) -> dict[str, str] | None:
    """The path parameters of an infer route's path (``V2Routes.routes``: ``{"name": ...}`` and
    ``"version"`` on a versioned one), as Starlette's route matching gives them; None for
    another path."""
    parts = path.split("/")
    if parts[-1] != "infer" or len(parts) not in (5, 7) or parts[1] != "v2" or parts[2] != "models" or not parts[3] \
            or parts[0]:
        return None
    if len(parts) == 5:
        return {"name": parts[3]}
    if parts[4] != "versions" or not parts[5]:
        return None
    return {"name": parts[3], "version": parts[5]}


@dataclass(frozen=True)
class RouterOptions:
    """The router's options (their defaults live in ``deployments.app.AppArgs``).

    ``max_body_bytes``: request bodies above this get 413 (gRPC messages RESOURCE_EXHAUSTED).
    ``request_timeout_s``: a model call taking longer gets 504. ``grpc_port``: where each router
    replica serves KServe v2 gRPC (``deployments.grpc_service``; None: no gRPC).
    """

    max_body_bytes: int
    request_timeout_s: float
    grpc_port: int | None = None


class V2Routes:
    """The KServe v2 HTTP routes over a model repository and a ``ModelClient``; no Ray.

    Args:
        repo: the served models (each router reads the configs, never the models).
        client: calls the models (``ModelClient``, or a fake with its interface in tests).
        options: ``RouterOptions``.
        observer: counts and logs infer requests (``observe.router.RouterObserver``); None:
            metrics are off, and ``/metrics`` and the statistics routes answer 404.
        initial: the build-time desired state of explicit model control
            (``deployments.control.initial_state``); None: ``model_control_mode: none``.

    ``admission``: where the routes run in their model's replica (``ModelRoutes``, ``PoolRoutes``),
    its ``Admission``, asked before an infer body is read (None: the router; the model's replica
    admits). ``follower``: there, under explicit model control, the replica's ``Follower``: its
    requests answer 503 until it has applied the desired state once (``Follower.synced``; the
    constructor awaits it, ``Follower.first_sync``, so only where the control replica was out of reach).
    ``shared_memory``: this process's ``SharedMemory`` (``deployments.regions``), through which
    the infer requests it decodes read and write tensors in shared memory (None: refused).
    ``cluster``: this process's Ray cluster (``haproxy.cluster_id``): a request HAProxy stamped
    with another's is answered 421 (``ClusterGuard``, which ``build_app`` puts before every route).
    """

    admission: Admission | None = None
    follower: Follower | None = None
    mount_suffix = ""  # what Serve's route prefix of these routes ends in (``V2App``)
    shared_memory: SharedMemory | None = None
    cluster: str | None = None

    def __init__(self, repo: ModelRepository, client: ModelClient, options: RouterOptions,
                 observer: RouterObserver | None = None, initial: Desired | None = None) -> None:
        self.repo = repo
        self.cluster = cluster_id(os.environ)
        self.observer = observer
        self.client = client
        self.max_body_bytes = options.max_body_bytes
        self.request_timeout_s = options.request_timeout_s
        # Backend per model (onnxruntime, onnxruntime_cuda, tensorrt, pipeline): dedicated replicas
        # report theirs when ready, the pool the one its replicas use (asked on first need).
        self.backends: dict[str, str] = {}
        # Model control (``deployments.control``): None in model_control_mode none, where every
        # model of the repository serves and load / unload are refused.
        self.initial = initial
        # Pipeline -> its step models, where the pipeline itself says (its replica: the built
        # pipeline's ``steps``, defaults included); else its config's ``parameters.steps``.
        self.steps: dict[str, Sequence[str]] = {}
        # Dedicated deployments are LOADING until a replica answers; pool models load on demand.
        self.states = ModelStates(repo.names() if initial is None else [
            name for name, state in initial.items() if state["loaded"]], self.client.pool_models)

    def routes(self) -> list[Route]:
        """The route table (``build_app``), in match order."""
        return [
            Route("/v2/models/stats", self.statistics, methods=["GET"]),  # before /v2/models/{name}
            Route("/v2/health/live", self.live, methods=["GET"]),
            Route("/v2/health/ready", self.server_ready, methods=["GET"]),
            Route("/v2", self.server_metadata, methods=["GET"]),
            Route("/v2/models/{name}", self.metadata, methods=["GET"]),
            Route("/v2/models/{name}/versions/{version}", self.metadata, methods=["GET"]),
            Route("/v2/models/{name}/ready", self.model_ready, methods=["GET"]),
            Route("/v2/models/{name}/versions/{version}/ready", self.model_ready, methods=["GET"]),
            Route("/v2/models/{name}/config", self.model_config, methods=["GET"]),
            Route("/v2/models/{name}/versions/{version}/config", self.model_config, methods=["GET"]),
            Route("/v2/models/{name}/infer", self.infer, methods=["POST"]),
            Route("/v2/models/{name}/versions/{version}/infer", self.infer, methods=["POST"]),
            Route("/v2/models/{name}/stats", self.statistics, methods=["GET"]),
            Route("/v2/models/{name}/versions/{version}/stats", self.statistics, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ]

    def build_app(self) -> V2App:
        app = Starlette(routes=self.routes(), exception_handlers={404: self._not_found, 405: self._not_allowed},
                        middleware=[Middleware(ClusterGuard, cluster=self.cluster), Middleware(CompressionMiddleware)])
        app.router.redirect_slashes = False  # a trailing slash is an unknown route (404), not a redirect
        return V2App(app, self, self.mount_suffix)

    async def _backend(self, entry: ModelEntry) -> str:
        """The backend serving ``entry``: ``pipeline``, the one a dedicated replica loaded
        (``""`` while none has), or for a pool model the one its replicas use.

        Raises:
            InferenceTimeout: the pool did not answer within ``request_timeout_s``.
        """
        if entry.config.pipeline:
            return "pipeline"
        if entry.name not in self.backends and entry.name in self.client.pool_models:
            self.backends.update({name: m["backend"] for name, m in (await self._pool_models()).items()})
        return self.backends.get(entry.name, "")

    async def _pool_models(self) -> dict[str, dict[str, Any]]:
        """One pool replica's ``PoolDeployment.models()`` ({} without a pool).

        Raises:
            InferenceTimeout: the pool did not answer within ``request_timeout_s``.
        """
        if self.client.pool is None:
            return {}
        try:
            return await asyncio.wait_for(self.client.pool_states(), self.request_timeout_s)
        except asyncio.TimeoutError:
            raise InferenceTimeout(f"the pool did not answer within {self.request_timeout_s:g} s") from None

    async def _placement_decision(self) -> dict[str, Any] | None:
        """The pool's placement decision (``placement: bytes``: ``placement.Decider.state``);
        None when the placement deployment did not answer within ``request_timeout_s`` (logged:
        the caller answers without it)."""
        try:
            return await asyncio.wait_for(self.client.placement_decision(), self.request_timeout_s)
        except Exception as e:
            logger.warning("the placement decision is unavailable: %r", e)
            return None

    async def _load_failed(self, entry: ModelEntry) -> ServingError | None:
        """For a pool model loaded on first use: ``ModelNotReady`` while its last load failed in
        a way the next would repeat (``ModelCache`` status ``load_error``), so readiness never
        says ready for a model whose every load fails; None otherwise, or when the pool does not
        answer (readiness then stands as it is). With ``placement: bytes`` from every pool
        replica's report (``placement.pool_cache``: failed on one, resident on none), as the
        repository index reads it, so every call answers alike whichever replica is asked; with
        ``placement: hash`` as one pool replica reports it."""
        if entry.name not in self.client.pool_models:
            return None
        try:
            decision = await self._placement_decision() if getattr(self.client, "placement", None) is not None else None
            pool = decision["cache"] if decision is not None and "cache" in decision else await self._pool_models()
            failed = pool.get(entry.key(), {}).get("load_error")
        except Exception:  # the pool is busy or restarting: its own readiness says so
            return None
        if not failed:
            return None
        return ModelNotReady(f"model '{entry.name}' is not ready: its last load failed: {failed}; the next request "
                             "tries again")

    def _entry(self, request: Request) -> ModelEntry:
        """The model a request names (its version checked: ``_entry_version``).

        Raises:
            ModelNotFound: as ``_entry_version``.
        """
        return self._entry_version(request)[0]

    def _entry_version(self, request: Request) -> tuple[ModelEntry, int]:
        """The model and the version a request names (``_version``).

        Raises:
            ModelNotFound: unknown model, or a version it does not serve (the message names
                the served versions).
        """
        params = request.path_params
        entry = self.repo.get(params["name"], params.get("version"))
        return entry, self._version(request, entry)

    def _served(self, entry: ModelEntry) -> tuple[int, ...]:
        """The versions ``entry`` serves here: its ``version_policy``'s for a pool model; a
        dedicated model (or pipeline) serves its newest served version only (docs/models.md, "Versions")."""
        return entry.served if entry.name in self.client.pool_models and entry.served else (entry.latest,)

    def _version(self, request: Request, entry: ModelEntry) -> int:
        """The version a request names (the newest served on an unversioned route).

        Raises:
            ModelNotFound: a version this application does not serve.
        """
        asked = request.path_params.get("version")
        if asked is None:
            return entry.latest
        served = self._served(entry)
        if int(asked) not in served:
            raise unknown_model(entry.name, f"version {asked} of model '{entry.name}' is not served; served "
                                f"versions: {list(served)} (a dedicated model serves its newest only)", asked)
        return int(asked)

    def _not_ready(self, entry: ModelEntry) -> ServingError | None:
        """The 503 error for a model whose deployment has no loaded replica yet or that is
        unloaded, 404 for one never loaded (explicit model control), else None."""
        if self.follower is not None and not self.follower.synced:
            return ModelNotReady(f"model '{entry.name}' is not ready: this replica is reading the model "
                                 "control state (a load or unload made since it started); retry shortly")
        if (error := self._not_loaded(entry)) is not None:
            return error
        if (error := self._not_served(entry)) is not None:
            return error
        if down := self._unloaded_steps(entry):
            return ModelNotReady(f"model '{entry.name}' is not ready: its step model(s) {down} are not loaded; "
                                 f"POST /v2/repository/models/{down[0]}/load loads it")
        if self.states.is_ready(entry.name):
            return None
        return ModelNotReady(
            f"model '{entry.name}' is not ready: its deployment is starting, stopping or has no "
            "running replica; retry shortly (GET /v2/models/{name}/ready tells when)".replace(
                "{name}", entry.name))

    def _not_loaded(self, entry: ModelEntry) -> ServingError | None:
        """The error for a model with no version loaded (explicit model control), as its
        requests, ready, metadata and config routes all answer it: 503 ``unloaded_model`` for
        one unloaded or whose load failed, 404 for one never loaded; None for a loaded one."""
        state = self.states.get(entry.name)
        if state.status in LOADED:
            return None
        if state.status is Status.UNLOADED:
            return unloaded_model(entry.name, state.reason)
        return unknown_model(entry.name, f"it is in the repository but not loaded: "
                             f"POST /v2/repository/models/{entry.name}/load loads it")

    def _loaded_entry(self, request: Request) -> ModelEntry:
        """``_entry`` of a model that has a version loaded (metadata, config).

        Raises:
            ModelNotFound: as ``_entry``, or a model never loaded.
            ModelNotReady: a model unloaded, or whose load failed (``_not_loaded``).
        """
        entry = self._entry(request)
        if (error := self._not_loaded(entry)) is not None:
            raise error
        return entry

    def _unloaded_steps(self, entry: ModelEntry) -> list[str]:
        """A pipeline's step models (``steps``, else its config's ``parameters.steps``) that are
        not loaded now (explicit model control: unloaded, or never loaded); the pipeline is not
        ready while one is, as its requests could only fail at that step."""
        if self.initial is None:
            return []
        return [step for step in self._steps_of(entry) if not self.states.is_loaded(step)]

    def _steps_of(self, entry: ModelEntry) -> list[str]:
        """A pipeline's step models (``steps``, else its config's ``parameters.steps``); [] for
        a model that is not a pipeline."""
        if not entry.config.pipeline:
            return []
        steps = self.steps.get(entry.name) or (entry.config.parameters or {}).get("steps") or []
        return [step for step in steps if isinstance(step, str)]

    def _not_served(self, entry: ModelEntry) -> ServingError | None:
        """The 503 error for a loaded model no replica can serve for a reason of the deployment
        (the router's: its application is not deployed, ``readiness``); here None."""
        return None

    def _require_ready(self, entry: ModelEntry) -> None:
        error = self._not_ready(entry)
        if error is not None:
            raise error

    async def _ready_error(self, entry: ModelEntry) -> ServingError | None:
        """``_not_ready`` for a ready route (the router asks the replicas first: ``readiness``)."""
        return self._not_ready(entry)

    async def _await_ready(self, entry: ModelEntry) -> None:
        """``_require_ready`` for an infer request (the router waits for a replica it has never
        seen answer: ``readiness``).

        Raises:
            ModelNotReady, ModelNotFound: as ``_not_ready``.
        """
        self._require_ready(entry)

    async def _not_found(self, request: Request, exc: Exception) -> Response:
        # Under /v2/models/, the first path segment as the client sent it is the model name: a
        # name holding '/' (e.g. "../x" sent as "..%2Fx") is answered as any unknown name, without
        # touching the filesystem; after a known name, an unknown suffix is an unknown route.
        raw = request.scope.get("raw_path", request.url.path.encode()).decode("latin-1").split("?")[0]
        prefix = request.scope.get("root_path", "").rstrip("/")  # the app's route_prefix, if any
        raw = raw.removeprefix(prefix)
        if raw.startswith("/v2/models/"):
            name = unquote(raw[len("/v2/models/"):].split("/")[0])
            if name not in self.repo.names():
                return error_response(unknown_model(name, f"available models: {self.repo.names()}"))
            return error_response(ModelNotFound(
                f"no route {request.method} {request.url.path}; model routes: {_MODEL_ROUTES}"))
        return error_response(ModelNotFound(
            f"no route {request.method} {request.url.path}; server routes: {_SERVER_ROUTES}; model routes: "
            f"{_MODEL_ROUTES}"))

    async def _not_allowed(self, request: Request, exc: Exception) -> Response:
        allow = ", ".join(sorted(m.strip() for m in (getattr(exc, "headers", None) or {}).get("Allow", "").split(",")
                                 if m.strip()))  # Starlette's comes from a set: the same order in every replica
        return self._route_error(request, MethodNotAllowed(
            f"method {request.method} not allowed on {request.url.path}; allowed: {allow}"), {"Allow": allow})

    def _route_error(self, request: Request, error: ServingError, headers: dict[str, str]) -> Response:
        """The answer to a request its route refuses before running (405); a protocol edge with
        its own error shape answers its own paths in it (``OpenAIRoutes``)."""
        return error_response(error, headers)

    async def live(self, request: Request) -> JSONResponse:
        return JSONResponse({"live": True})

    @answers_errors
    async def server_ready(self, request: Request) -> Response:
        loading = sorted(set(self.repo.names()) & self.states.names(Status.LOADING))
        if loading:  # a probe's answer, not a failure: kept off the terminal (deployments.logs)
            return error_response(ModelNotReady(f"server not ready: models still loading: {loading}"), log=False)
        return JSONResponse({"ready": True})

    async def server_metadata(self, request: Request) -> JSONResponse:
        return JSONResponse({"name": SERVER_NAME, "version": __version__, "extensions": EXTENSIONS})

    @answers_errors
    async def metadata(self, request: Request) -> JSONResponse:
        """The model's metadata; a model with no version loaded answers as its requests do
        (``_not_loaded``: Triton answers an error for it too, not a description)."""
        entry = self._loaded_entry(request)
        backend = await self._backend(entry)
        return JSONResponse(model_metadata(entry.config, self._served(entry), platform_of(backend), backend or None))

    @answers_errors
    async def model_config(self, request: Request) -> JSONResponse:
        """Triton's model configuration (``protocol.triton.model_configuration``); a model with
        no version loaded answers as its metadata does (``_loaded_entry``)."""
        entry = self._loaded_entry(request)
        return JSONResponse(model_configuration(entry.config, await self._backend(entry)))

    @answers_errors
    async def model_ready(self, request: Request) -> Response:
        entry = self._entry(request)
        error = await self._ready_error(entry) or await self._load_failed(entry)
        if error is not None:  # a probe's answer, not a failure
            return error_response(error, log=False)
        return JSONResponse({"name": entry.name, "ready": True})

    def _mark_loaded(self, entry: ModelEntry, placement: str, backend: str | None) -> None:
        if placement == "pool":
            self.client.pool_models.add(entry.name)
        if backend:
            self.backends[entry.name] = backend
        if self.observer is not None:
            self.observer.versions[entry.name] = str(entry.latest)
        self.states.loaded(entry.name)

    def _mark_unloaded(self, name: str, reason: str | None = None) -> None:
        """``reason``: why its load failed (None: unloaded through the API)."""
        self.states.unloaded(name, reason)

    async def _read_body(self, request: Request) -> list[bytes]:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise PayloadTooLarge(
                f"request body is {int(declared)} bytes; the limit is {self.max_body_bytes} bytes")
        chunks, size = [], -request.scope.get(EDGE_HEADER_BYTES, 0)
        loop = asyncio.get_running_loop()
        moved = loop.time()
        try:
            async with asyncio.timeout(BODY_STALL_TIMEOUT_S) as stall:
                async for chunk in request.stream():
                    # The stall timer moves at most every tenth of its bound, not per chunk (each move
                    # makes a timer handle and cancels one; measured in
                    # docs/performance.md, "A replica's CPU per request by stage"); a stall is then
                    # told 0.9-1.0 bounds after the last byte.
                    now = loop.time()
                    if now - moved >= BODY_STALL_TIMEOUT_S / 10:
                        stall.reschedule(now + BODY_STALL_TIMEOUT_S)
                        moved = now
                    size += len(chunk)
                    if size > self.max_body_bytes:
                        raise PayloadTooLarge(f"request body exceeds the limit of {self.max_body_bytes} bytes")
                    chunks.append(chunk)
        except ClientDisconnect:  # a client mistake, not a server fault: no 5xx, no error log
            raise InvalidInput(f"the client disconnected after {size} bytes of the request body") from None
        except TimeoutError:
            expected = f" of the {declared} its Content-Length declares" if declared is not None else ""
            raise RequestTimeout(
                f"the request body stalled: no bytes for {BODY_STALL_TIMEOUT_S:g} s after {size} bytes{expected}; "
                "send the whole body, exactly as long as its Content-Length says (chunked: through the last, "
                "zero-length chunk)") from None
        encoding = request.headers.get("content-encoding")
        if encoding is not None:
            chunks = [decompress(b"".join(chunks), encoding, self.max_body_bytes)]
        return chunks

    async def _json_body(self, request: Request, what: str) -> dict[str, Any]:
        """The optional JSON object body of a repository request ({} when empty), read as an
        infer body is (``_read_body``: the body limit, the stall timeout, a client that leaves).

        Raises:
            InvalidInput: a body that is not JSON (parsed as an infer body is: ``parse_json``,
                nesting too deep included), not a JSON object, ``parameters`` that is not one
                (as an infer request's: a falsy value counts as none), or a client that left
                before its end.
            PayloadTooLarge, RequestTimeout: as ``_read_body``.
        """
        body = b"".join(await self._read_body(request))
        if not body.strip():
            return {}
        value = parse_json(body)  # its error reads as an infer body's: "request body is not valid JSON: ..."
        if not isinstance(value, dict):
            raise InvalidInput(f"the {what} request body must be a JSON object, e.g. {{\"parameters\": {{}}}}")
        if not isinstance(value.get("parameters") or {}, dict):
            raise InvalidInput(f"the {what} request's 'parameters' must be a JSON object, got "
                               f"{json.dumps(value['parameters'])[:40]}")
        return value

    async def _call_model(self, name: str, inputs: dict, outputs: list[str] | None, timeout_s: float | None = None,
                          key: str | None = None, version: int | None = None) -> dict:
        """Run a request on model ``name`` (``key``: the version's, ``ModelEntry.key``; ``version``:
        the one its answer is labelled with, which the replica checks its engine against)."""
        return await self._within_timeout(name, self.client.infer(name, inputs, outputs, key, version), timeout_s)

    async def _within_timeout(self, name: str, call: Awaitable[Any], timeout_s: float | None = None,
                              grace_s: float = 0.0) -> Any:
        """``call`` to model ``name``, bounded by ``timeout_s`` (a request's own) where shorter
        than ``request_timeout_s``, else by ``request_timeout_s``; ``grace_s`` more where the
        called replica applies the bound itself (a pool replica: ``protocol.answer.answer_body``),
        so that its answer, naming the bound, arrives first.

        Raises:
            InferenceTimeout: the bound passed (``ModelNotReady`` instead when the model lost its
                replicas while the request waited).
        """
        timeout_s, asked = request_bound(timeout_s, self.request_timeout_s)
        answered, result = await answered_within(call, timeout_s + grace_s)
        if answered:
            return result
        if not self.states.is_ready(name):  # it lost its replicas while the request waited
            self._require_ready(self.repo.get(name))
        raise timeout_error(name, timeout_s, asked) from None

    @observe_infer
    @answers_errors
    async def infer(self, request: Request) -> Response:
        """A pool model's body goes to the pool replica as bytes, which decodes, runs and
        encodes it (``PoolDeployment.infer_body``; in the pool replica itself on the one-hop
        path, ``PoolRoutes``): the router only routes. A dedicated model's request is decoded
        here (in its own replica on the one-hop path, ``ModelRoutes``)."""
        entry, version = self._entry_version(request)
        if self.admission is not None:
            self.admission.check()  # before the body is read and decoded: shedding costs nothing
        chunks = await self._read_body(request)
        header_length = request.headers.get(HEADER_LENGTH)
        batched = entry.config.max_batch_size > 0
        if entry.name in self.client.pool_models:
            await self._await_ready(entry)
            done = await self._within_timeout(entry.name, self.client.infer_body(
                entry.name, entry.key(version), str(version), batched, chunks, header_length, self.request_timeout_s),
                grace_s=POOL_TIMEOUT_GRACE_S)
        else:
            async def run(infer_request: InferRequest) -> dict:
                await self._await_ready(entry)
                return await self._call_model(entry.name, infer_request.inputs, infer_request.outputs,
                                              infer_request.timeout_s, entry.key(version), version)

            done = await answer(entry.name, str(version), batched, chunks, header_length, run, self.shared_memory)
        add_phases(request, done.compute_input_s, done.compute_output_s)
        return Response(done.content, headers=done.headers)

    # --- observability (deployments.observe) -----------------------------------------------
    def _metrics_off(self) -> None:
        if self.observer is None:
            raise ModelNotFound("metrics are off (application args: metrics.enabled false)")

    @answers_errors
    async def metrics(self, request: Request) -> Response:
        """This node's series in Prometheus text format (the node of the replica answering)."""
        self._metrics_off()
        body = await asyncio.to_thread(render_metrics)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @answers_errors
    async def statistics(self, request: Request) -> JSONResponse:
        """Triton's statistics extension: every model, one model, or one version of it."""
        self._metrics_off()
        if "name" in request.path_params:
            entry, version = self._entry_version(request)  # "01" is version 1: its series' label is "1"
            models = [(entry.name, str(version))]
        else:
            models = [(e.name, str(v)) for e in self.repo.entries() for v in self._served(e)]
        families = await asyncio.to_thread(node_families, node_directory())
        return JSONResponse(statistics(families, models))


def router_observer(repo: ModelRepository, metrics: dict[str, Any] | None) -> RouterObserver | None:
    """In the router replica: start metrics (``observe.options.start``) and return the observer
    of ``repo``'s models; None when ``metrics`` (``MetricsOptions`` as a dict) turns them off."""
    options = start_metrics(metrics)
    if options is None:
        return None
    versions = {e.name: str(e.latest) for e in repo.entries()}
    return RouterObserver(versions, access_log=options.access_log)
