"""The router / ingress deployment: KServe v2 REST routes, validation, dispatch by model name.

Routes (Open Inference Protocol, plus Triton's repository index):
    GET  /v2/health/live, /v2/health/ready, /v2
    GET  /v2/models/{name}[/versions/{version}][/ready|/config]
    POST /v2/models/{name}[/versions/{version}]/infer
    POST /v2/repository/index, /v2/repository/models/{name}/load, /v2/repository/models/{name}/unload
    GET  /v2/memory
    GET  /v2/models[/{name}[/versions/{version}]]/stats, /metrics (``deployments.observe``)
Infer speaks JSON and Triton's binary tensor data extension (``protocol.binary``); request
bodies may be gzip/deflate compressed and responses are, as Accept-Encoding asks (``protocol.compression``).
Every error answers ``{"error": "..."}`` with the status from ``protocol.errors``.

``RouterApp`` holds the routes and builds the Starlette app from a repository and a
``ModelClient`` (tests run it under ``starlette.testclient.TestClient`` with a fake client);
``Router``, at the bottom, is the Ray Serve deployment around it. ``ModelRoutes`` is the same
routes over one model in its own replica (``ReplicaClient``): each dedicated model and pipeline
is also its own Serve application at ``/v2/models/<name>`` (``deployments.app.applications``), so
the ingress (HAProxy or Serve's proxy, longest route prefix first) sends its requests straight to
a replica that decodes, runs and answers them, with no router hop. ``PoolRoutes`` is the same
for the multiplexed pool, at ``/v2/models``: every model without an application of its own
reaches a pool replica (``PoolClient``) in one hop. The router checks only what routing needs
(model, version, body size, readiness); the replica that runs a request validates its tensors.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable, Iterator, Sequence
from urllib.parse import unquote

from ray import serve
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from . import __version__
from .client import POOL, ModelClient, handle, model_application, model_handles, pool_handle, router_application
from .loopback import replica_grpc_on_loopback
from .logs import ready_logger, show_on_terminal
from .observe.metrics import node_directory, node_families, render as render_metrics
from .observe.options import start as start_metrics
from .observe.router import RouterObserver, add_phases, observe_infer
from .observe.statistics import statistics
from .protocol.answer import answer, request_bound, timeout_error
from .protocol.binary import HEADER_LENGTH
from .protocol.compression import CompressionMiddleware, decompress
from .protocol.errors import detached, error_status, overloaded, past_deadline, raise_if_error, retry_after_headers
from .protocol.triton import model_configuration, platform_of
from .protocol.v2 import InferRequest, model_metadata
from .control import Desired, Follower, applied_everywhere, follow
from .runtime.contract.errors import (ConfigError, InferenceTimeout, InvalidInput, MethodNotAllowed, ModelNotFound,
                                      ModelNotReady, PayloadTooLarge, RequestTimeout, ServingError, unknown_model,
                                      unloaded_model)
from .runtime.contract.repository import ModelEntry, ModelRepository
from .states import LOADED, ModelStates, Status

logger = logging.getLogger("ray.serve")

SERVER_NAME = "trt-serve"
EXTENSIONS = ["model_repository", "model_configuration", "binary_tensor_data", "classification",
              "statistics"]
_READY_POLL_S = 1.0
_CONTROL_POLL_S = 0.1  # how often a load / unload checks whether every replica applied it
_STOPPING_POLL_S = 0.1  # while the application is being deleted: how soon waiting requests get their 503
_STOPPED_IDLE_S = 1.0  # ... once their model has finished no call for this long (ModelClient.cut_unassigned)
# A pool replica bounds a request's run itself (it decodes the request, so only it knows the
# request's own parameters.timeout); the router's bound waits this much longer, as a backstop.
POOL_TIMEOUT_GRACE_S = 5.0
_MODEL_ROUTES = "/v2/models/{name}[/versions/{version}][/ready|/config|/infer|/stats]"
_SERVER_ROUTES = ("GET /v2, GET /v2/health/live, GET /v2/health/ready, POST /v2/repository/index (lists the "
                  "models), POST /v2/repository/models/{name}/load|unload, GET /v2/models/stats, GET /v2/memory, "
                  "GET /metrics")
# A request body that sends nothing for this long is answered 408 (the time between two
# chunks, as nginx's client_body_timeout: a slow upload that keeps sending is not cut). HAProxy's
# own `timeout http-request` (deployments/loopback.py) covers only the headers and the first
# 16 KiB of body, so without this a client that stalls after them held a slot of the replica
# (and of the router's max_ongoing_requests) without end.
BODY_STALL_TIMEOUT_S = 30.0
# Repository index state and reason of a pool model, by its state in the pool replica's cache.
_POOL_STATES = {"ready": ("READY", "resident in the pool replica's cache"),
                "loading": ("LOADING", "loading into the pool replica's cache"),
                "evicting": ("UNLOADING", "being evicted from the pool replica's cache"),
                "absent": ("UNAVAILABLE", "not loaded yet; loads on first request")}


def _answers_errors(route: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
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


@dataclass(frozen=True)
class RouterOptions:
    """The router's options (their defaults live in ``deployments.app.AppArgs``).

    ``max_body_bytes``: request bodies above this get 413. ``request_timeout_s``: a model call
    taking longer gets 504.
    """

    max_body_bytes: int
    request_timeout_s: float


class RouterApp:
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
    """

    admission: "Admission | None" = None
    follower: "Follower | None" = None

    def __init__(self, repo: ModelRepository, client: ModelClient, options: RouterOptions,
                 observer: RouterObserver | None = None, initial: Desired | None = None) -> None:
        self.repo = repo
        self.observer = observer
        self.client = client
        self.max_body_bytes = options.max_body_bytes
        self.request_timeout_s = options.request_timeout_s
        # Backend per model (onnxruntime, onnxruntime_cuda, tensorrt, pipeline): dedicated replicas
        # report theirs when ready, the pool the one its replicas use (asked on first need).
        self.backends: dict[str, str] = {}
        self._seen_running: set[str] = set()  # models Serve has counted with a RUNNING replica
        self.missing: set[str] = set()  # dedicated models whose application is not deployed (note_missing)
        self._running: dict[str, int] = {}  # model -> RUNNING replicas in the latest count
        # Model control (``deployments.control``): None in model_control_mode none, where every
        # model of the repository serves and load / unload are refused.
        self.initial = initial
        # Pipeline -> its step models, where the pipeline itself says (its replica: the built
        # pipeline's ``steps``, defaults included); else its config's ``parameters.steps``.
        self.steps: dict[str, Sequence[str]] = {}
        # Dedicated deployments are LOADING until a replica answers; pool models load on demand.
        self.states = ModelStates(repo.names() if initial is None else [
            name for name, state in initial.items() if state["loaded"]], self.client.pool_models)
        self.changing: dict[str, str] = {}  # model -> LOADING / UNLOADING while this router acts
        self._probes: dict[str, asyncio.Future[bool]] = {}  # model -> the backend call in flight
        self._control_locks: dict[str, asyncio.Lock] = {}  # model -> held while it loads or unloads

    def build_app(self) -> Starlette:
        app = Starlette(routes=[
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
            Route("/v2/repository/index", self.repository_index, methods=["POST"]),
            Route("/v2/repository/models/{name}/load", self.load, methods=["POST"]),
            Route("/v2/repository/models/{name}/unload", self.unload, methods=["POST"]),
            Route("/v2/memory", self.memory, methods=["GET"]),
            Route("/v2/models/{name}/stats", self.statistics, methods=["GET"]),
            Route("/v2/models/{name}/versions/{version}/stats", self.statistics, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ], exception_handlers={404: self._not_found, 405: self._not_allowed},
            middleware=[Middleware(CompressionMiddleware)])
        app.router.redirect_slashes = False  # a trailing slash is an unknown route (404), not a redirect
        return app

    # --- readiness -------------------------------------------------------------------------
    async def poll_ready(self) -> None:
        """Mark each dedicated model ready once a replica answers; returns when all have."""
        pending = {name for name in self.client.dedicated if self.states.is_loaded(name)}  # explicit control
        while pending:
            pending = {name for name in pending if self.states.is_loaded(name)}
            for name in sorted(pending):
                if await self._probe(name):
                    pending.discard(name)
            if pending:
                await asyncio.sleep(_READY_POLL_S)

    async def _probe(self, name: str) -> bool:
        """Ask dedicated model ``name``'s replicas for their backend (waiting at most
        ``_READY_POLL_S``); on an answer, mark it ready. Concurrent callers share one call.

        Returns:
            Whether a replica answered.
        """
        task = self._probes.get(name)
        if task is None or task.done():
            task = self._probes[name] = asyncio.ensure_future(self._ask_backend(name))
        return await asyncio.shield(task)

    async def _ask_backend(self, name: str) -> bool:
        try:
            self.backends[name] = await asyncio.wait_for(self.client.backend(name), _READY_POLL_S)
        except Exception:  # no replica yet, or still loading
            return False
        self.states.answered(name)
        return True

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

    async def watch_replicas(self) -> None:
        """Every ``_READY_POLL_S`` (``_STOPPING_POLL_S`` while the application is being
        deleted), ``refresh_ready`` from the client's replica counts, and the client's
        ``cut_unassigned`` for models whose deployment is being deleted (runs forever)."""
        while True:
            deleting = False
            try:
                answered = set(self.backends)  # models a replica answered before this snapshot is asked for
                counts = await self.client.replica_counts()
                self.refresh_ready(counts.running, answered, counts.stopped)
                self.note_missing(counts.missing)
                self.client.cut_unassigned(counts.stopped, _STOPPED_IDLE_S)
                deleting = counts.deleting
                if self.initial is not None:
                    await self.follow_desired(await self.client.control_desired())
            except Exception as e:  # the controller did not answer: keep what we know
                if isinstance(e, RuntimeError) and "after shutdown" in str(e):
                    return  # the loop's executor is shut down: this replica is stopping
                logger.warning("readiness: Serve's replica counts are unavailable", exc_info=True)
            await asyncio.sleep(_STOPPING_POLL_S if deleting else _READY_POLL_S)

    def note_missing(self, missing: Iterable[str]) -> None:
        """Models whose application Serve does not list (``ReplicaCounts.missing``: a dedicated
        model's own, or the pool's for pool models): their requests reach the router (no route
        prefix of theirs exists) and answer 503 naming the application the Serve config lacks;
        logged once each."""
        missing = set(missing) & (set(self.client.dedicated) | self.client.pool_models)
        for name in sorted(missing - self.missing):
            logger.error("model '%s': %s", name, self._missing_text(name))
        self.missing = missing

    def _missing_text(self, name: str) -> str:
        pooled = name in self.client.pool_models
        handle = self.client.pool if pooled else self.client.dedicated.get(name)
        app = getattr(handle, "app_name", f"<router application>.{POOL if pooled else name}")
        return (f"its application '{app}' is not deployed: the Serve config must list it "
                "(python -m deployments.check --write serve_config.yaml writes it)")

    async def follow_desired(self, desired: dict[str, Any]) -> None:
        """Take the loads and unloads that other router replicas made, and the outcome of loads
        that outlived their request (``ControlDeployment.desired``): a model to be loaded is
        LOADING until every running replica of its deployment applied it, then READY; one whose
        load failed is UNAVAILABLE with the failure as its reason. A model this router is
        loading or unloading itself is left to that request."""
        for name, state in desired["models"].items():
            lock = self._control_locks.get(name)
            if lock is not None and lock.locked():
                continue
            if not state["loaded"]:
                now = self.states.get(name)
                unloaded_reason = now.reason if now.status is Status.UNLOADED else None
                if now.status in LOADED or name in self.changing or unloaded_reason != state.get("reason"):
                    self.changing.pop(name, None)
                    self._mark_unloaded(name, state.get("reason"))
                continue
            if self.states.is_loaded(name):
                continue
            try:
                entry = self.repo.get(name) if name in self.repo.names() else self.repo.read(name)
            except Exception:  # unreadable here: it stays unavailable on this router
                logger.warning("model '%s' was loaded but this router cannot read it", name, exc_info=True)
                continue
            generation = {"incarnation": desired["incarnation"], "revision": state["generation"]}
            if not applied_everywhere(*await self.client.control_applied(name, state["placement"], generation)):
                self.changing[name] = "LOADING"
                continue
            self.changing.pop(name, None)
            self._mark_loaded(entry, state["placement"], None)

    def refresh_ready(self, running: dict[str, int], answered: Iterable[str] = (),
                      stopped: Iterable[str] = ()) -> None:
        """Readiness after first load follows the replicas: a model (dedicated once it answered
        ``poll_ready``, or pooled) that Serve has counted with a RUNNING replica is ready while
        it has one, so ready routes and requests answer 503 when it lost them all and 200 again
        once a replacement runs. A count of 0 for a model never seen running (a deployment
        still starting, or a snapshot older than its first replica) changes nothing, unless a
        replica of it answered before the snapshot was asked for (``answered``): Serve routes
        only to replicas it counts RUNNING, so that replica ran, and has gone (it can die before
        any snapshot counted it: then the model stayed ready with no replica).

        Args:
            running: model name -> RUNNING replicas (``ModelClient.replica_counts``).
            answered: models a replica answered (``backends``) before ``running`` was asked for.
            stopped: models whose application is being deleted (``ReplicaCounts.stopped``): their
                loss is the plan (Ctrl-C), logged at INFO, not as a warning on the terminal.
        """
        answered, stopped = set(answered), set(stopped)
        self._running = dict(running)
        for name, count in running.items():
            if count:
                self._seen_running.add(name)
                if name in self.client.dedicated and name not in self.backends:
                    continue  # never answered yet: poll_ready decides
                self.states.answered(name)
            elif (name in self._seen_running or name in answered) and self.states.lost(name):
                logger.log(logging.INFO if name in stopped else logging.WARNING,
                           "model '%s' has no running replica: not ready (503) until one runs", name)

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
        state = self.states.get(entry.name)
        if state.status not in LOADED:
            if state.status is Status.UNLOADED:
                return unloaded_model(entry.name, state.reason)
            return unknown_model(entry.name, f"it is in the repository but not loaded: "
                                 f"POST /v2/repository/models/{entry.name}/load loads it")
        if entry.name in self.missing:
            return ModelNotReady(f"model '{entry.name}' is not served: {self._missing_text(entry.name)}")
        if down := self._unloaded_steps(entry):
            return ModelNotReady(f"model '{entry.name}' is not ready: its step model(s) {down} are not loaded; "
                                 f"POST /v2/repository/models/{down[0]}/load loads it")
        if state.status is Status.READY:
            return None
        return ModelNotReady(
            f"model '{entry.name}' is not ready: its deployment is starting, stopping or has no "
            "running replica; retry shortly (GET /v2/models/{name}/ready tells when)".replace(
                "{name}", entry.name))

    def _unloaded_steps(self, entry: ModelEntry) -> list[str]:
        """A pipeline's step models (``steps``, else its config's ``parameters.steps``) that are
        not loaded now (explicit model control: unloaded, or never loaded); the pipeline is not
        ready while one is, as its requests could only fail at that step."""
        if self.initial is None or not entry.config.pipeline:
            return []
        steps = self.steps.get(entry.name) or (entry.config.parameters or {}).get("steps") or []
        return [step for step in steps if isinstance(step, str) and not self.states.is_loaded(step)]

    def _require_ready(self, entry: ModelEntry) -> None:
        error = self._not_ready(entry)
        if error is not None:
            raise error

    def _unseen(self, name: str) -> bool:
        """Whether ``name`` is a loaded dedicated model (or pipeline) this router has never seen
        answer: Serve can report the application RUNNING, and send requests here, before
        ``poll_ready``'s next pass has seen its replica, so callers ask it first (``_probe``)."""
        return (name in self.client.dedicated and self.states.status(name) is Status.LOADING
                and name not in self.backends)

    async def _ready_error(self, entry: ModelEntry) -> ServingError | None:
        """``_not_ready``, after asking the replicas of a model this router has never seen
        answer (``_unseen``; at most ``_READY_POLL_S``)."""
        if self._unseen(entry.name):
            await self._probe(entry.name)
        return self._not_ready(entry)

    async def _await_ready(self, entry: ModelEntry) -> None:
        """``_ready_error`` for an infer request; while Serve's latest count has a RUNNING replica
        of a model this router has never seen answer (``_unseen``), it is asked again until it
        answers (within ``request_timeout_s``): this router's handle learns of a new replica a
        moment after Serve counts it, later than one probe on a busy machine.

        Raises:
            ModelNotReady, ModelNotFound: as ``_not_ready``.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.request_timeout_s
        while (error := await self._ready_error(entry)) is not None:
            if not (self._unseen(entry.name) and self._running.get(entry.name)) or loop.time() >= deadline:
                raise error
            await asyncio.sleep(_CONTROL_POLL_S)

    # --- routes ------------------------------------------------------------------------------
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
        return error_response(MethodNotAllowed(
            f"method {request.method} not allowed on {request.url.path}; allowed: {allow}"), {"Allow": allow})

    async def live(self, request: Request) -> JSONResponse:
        return JSONResponse({"live": True})

    @_answers_errors
    async def server_ready(self, request: Request) -> Response:
        unseen = [name for name in self.repo.names() if self._unseen(name)]
        if unseen:
            await asyncio.gather(*map(self._probe, unseen))
        if self.missing:
            return error_response(ModelNotReady(f"server not ready: models {sorted(self.missing)} are not served: "
                                                "their applications are not deployed; the Serve config must list "
                                                "them (python -m deployments.check --write serve_config.yaml writes "
                                                "them)"), log=False)
        loading = sorted(set(self.repo.names()) & self.states.names(Status.LOADING))
        if loading:  # a probe's answer, not a failure: kept off the terminal (deployments.logs)
            return error_response(ModelNotReady(f"server not ready: models still loading: {loading}"), log=False)
        return JSONResponse({"ready": True})

    async def server_metadata(self, request: Request) -> JSONResponse:
        return JSONResponse({"name": SERVER_NAME, "version": __version__, "extensions": EXTENSIONS})

    @_answers_errors
    async def metadata(self, request: Request) -> JSONResponse:
        entry = self._entry(request)
        backend = await self._backend(entry)
        return JSONResponse(model_metadata(entry.config, self._served(entry), platform_of(backend), backend or None))

    @_answers_errors
    async def model_config(self, request: Request) -> JSONResponse:
        """Triton's model configuration (``protocol.triton.model_configuration``)."""
        entry = self._entry(request)
        return JSONResponse(model_configuration(entry.config, await self._backend(entry)))

    @_answers_errors
    async def model_ready(self, request: Request) -> Response:
        entry = self._entry(request)
        error = await self._ready_error(entry)
        if error is not None:  # a probe's answer, not a failure
            return error_response(error, log=False)
        return JSONResponse({"name": entry.name, "ready": True})

    @_answers_errors
    async def repository_index(self, request: Request) -> JSONResponse:
        """Triton's repository index: every model with its served version and state. A dedicated
        model READY once a replica loaded it (LOADING before); a pool model as one pool replica's
        cache holds it (READY resident, UNAVAILABLE not loaded or evicted, LOADING, UNLOADING;
        ``reason`` says which). With explicit model control, also every model folder on disk
        not loaded yet, models unloaded through the API (UNAVAILABLE, reason "unloaded") and
        models whose last load failed (UNAVAILABLE, reason "failed to load: ..."); a load still
        going on after its request answered 504 is LOADING (``follow_desired``).
        Body (optional): ``{"ready": true}`` lists only READY models."""
        only_ready = (await self._json_body(request, "index")).get("ready", False)
        if not isinstance(only_ready, bool):
            raise InvalidInput(f"repository index: 'ready' must be true or false, not {json.dumps(only_ready)[:40]}")
        pool = await self._pool_models()
        index = []
        for entry in self.repo.entries():
            for version in self._served(entry):
                index.append(self._index_item(entry, version, pool.get(entry.key(version))))
        if self.initial is not None:  # folders added since start, not read yet
            index += [{"name": name, "state": "UNAVAILABLE", "reason": self.states.get(name).index_reason}
                      for name in self.repo.folders() if name not in self.repo.names()]
            index.sort(key=lambda item: item["name"])
        return JSONResponse([item for item in index if item["state"] == "READY" or not only_ready])

    def _index_item(self, entry: ModelEntry, version: int, cached: dict[str, Any] | None) -> dict[str, Any]:
        """One version's index line; ``cached``: its pool cache state (None: not a pool model)."""
        state = self.states.get(entry.name)
        item = {"name": entry.name, "version": str(version),
                "state": "READY" if state.status is Status.READY else "LOADING"}
        if cached is not None and state.status is not Status.READY:  # as its requests: 503 until one runs
            item["state"], item["reason"] = "UNAVAILABLE", "the pool has no running replica; retry shortly"
        elif cached is not None:
            item["state"], item["reason"] = _POOL_STATES[cached["state"]]
            if cached["state"] == "absent" and cached["evictions"]:
                item["reason"] = "evicted from the pool replica's cache; loads on next request"
        if entry.name in self.changing:
            item["state"], item["reason"] = self.changing[entry.name], "asked for through the repository API"
        elif state.status not in LOADED:
            item["state"], item["reason"] = state.status.index_state, state.index_reason
        return item

    # --- model control (Triton's model repository extension; deployments.control) ----------
    def _control(self, request: Request, verb: str) -> str:
        """The model name of a load / unload request.

        Raises:
            InvalidInput: model control is off (``model_control_mode: none``).
        """
        name = request.path_params["name"]
        if self.initial is None:
            raise InvalidInput(f"failed to {verb} '{name}': explicit model load / unload is not allowed: "
                               "model_control_mode is none (serve_config.yaml application args); "
                               "set model_control_mode: explicit")
        return name

    def _placement(self, entry: ModelEntry, verb: str) -> str:
        """``pool``, ``dedicated`` or ``pipeline``: where ``entry`` runs in this application.

        Raises:
            InvalidInput: a model that needs a deployment of its own that the application lacks.
        """
        if entry.name in self.client.dedicated:
            return "pipeline" if entry.config.pipeline else "dedicated"
        config = entry.path / "config.yaml"
        if entry.config.pipeline or entry.config.deployment.mode == "dedicated":
            raise InvalidInput(
                f"failed to {verb} '{entry.name}': {config}: deployment.mode: a "
                f"{'pipeline' if entry.config.pipeline else 'dedicated model'} needs a deployment of its own, "
                "made when the application is deployed (serve deploy); models added at run time load "
                "into the pool (deployment.mode: pool)")
        if self.client.pool is None:
            raise InvalidInput(f"failed to {verb} '{entry.name}': this application has no pool deployment "
                               "to load it into (it was built without pool models)")
        return "pool"

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

    async def _wait_applied(self, name: str, placement: str, state: dict[str, Any], verb: str) -> list[dict[str, Any]]:
        """The reports once every replica Serve counts RUNNING in the deployment serving
        ``name`` applied ``state`` (``{"incarnation", "revision"}``; ``control.applied_everywhere``).

        Raises:
            InferenceTimeout: not all within ``request_timeout_s`` (the change goes on).
            ModelNotReady: the deployment has no running replica.
        """
        deadline = asyncio.get_running_loop().time() + self.request_timeout_s
        while True:
            reports, running = await self.client.control_applied(name, placement, state)
            if applied_everywhere(reports, running):
                return [r for r in reports if r["replica"] in running]
            if asyncio.get_running_loop().time() > deadline:
                if not running:
                    raise ModelNotReady(f"failed to {verb} '{name}': its deployment has no running replica")
                done = len(running & {r["replica"] for r in reports})
                raise InferenceTimeout(f"failed to {verb} '{name}' within {self.request_timeout_s:g} s on every "
                                       f"replica ({done} of {len(running)} running replicas done); it goes on, "
                                       "and the repository index tells when it is done or why it failed")
            await asyncio.sleep(_CONTROL_POLL_S)

    @_answers_errors
    async def load(self, request: Request) -> Response:
        """``POST /v2/repository/models/{name}/load``: read the model's folder again (the same
        validation as at start: a bad config is 400 naming the file and field, and nothing
        changes), then load it on every replica of its deployment (pool models: into every pool
        replica's cache); answers 200 with an empty body once all have it."""
        name = self._control(request, "load")
        parameters = (await self._json_body(request, "load")).get("parameters") or {}
        unsupported = sorted(parameters)
        if unsupported:
            raise InvalidInput(f"failed to load '{name}': load parameters {unsupported} are not supported "
                               "(a config or files sent with the request); put the model's folder in the repository")
        try:
            entry = self.repo.read(name)
        except ConfigError as e:
            raise InvalidInput(f"failed to load '{name}': {e.message}") from None
        except ModelNotFound as e:
            raise ModelNotFound(f"failed to load '{name}': {e.message}") from None
        placement = self._placement(entry, "load")
        async with self._control_lock(name):
            self.changing[name] = "LOADING"
            going_on = False
            try:
                state = await self.client.control_set(name, True, placement)
                reports = await self._wait_applied(name, placement, state, "load")
                outcomes = [r["models"][name] for r in reports if name in r["models"]]
                errors = [o["error"] for o in outcomes if o["error"] is not None]
                if errors or not all(o["loaded"] for o in outcomes):
                    # as Triton, a failed load leaves the model unavailable: the control
                    # deployment has rolled it back (``ControlDeployment.report``), with its reason
                    reason = (await self.client.control_desired())["models"].get(name, {}).get("reason")
                    self._mark_unloaded(name, reason or "unloaded while it loaded")
                    if errors:
                        raise type(errors[0])(f"failed to load '{name}': {errors[0].message}")
                    raise ModelNotReady(f"failed to load '{name}': {reason or 'it was unloaded while it loaded'}")
            except InferenceTimeout:  # it goes on: LOADING until follow_desired sees it done or failed
                going_on = True
                raise
            finally:
                if not going_on:
                    self.changing.pop(name, None)
            backend = "pipeline" if placement == "pipeline" else next((o["backend"] for o in outcomes if o["backend"]), None)
            self._mark_loaded(entry, placement, backend)
        return Response(status_code=200)

    @_answers_errors
    async def unload(self, request: Request) -> Response:
        """``POST /v2/repository/models/{name}/unload``: new requests for the model answer 503 at
        once; every replica waits for its requests in flight, then frees the engine (pool:
        unloads it from its cache); answers 200 once all have. ``parameters.unload_dependents``
        is accepted and has no effect (a pipeline using the model answers 503 for it)."""
        name = self._control(request, "unload")
        await self._json_body(request, "unload")
        if name not in self.repo.names():
            raise ModelNotFound(f"failed to unload '{name}': no such model; models: {self.repo.names()}")
        entry = self.repo.get(name)
        placement = "pool" if name in self.client.pool_models else self._placement(entry, "unload")
        async with self._control_lock(name):
            self._mark_unloaded(name)
            self.changing[name] = "UNLOADING"
            try:
                state = await self.client.control_set(name, False, placement)
                await self._wait_applied(name, placement, state, "unload")
            finally:
                self.changing.pop(name, None)
        return Response(status_code=200)

    def _control_lock(self, name: str) -> asyncio.Lock:
        """One load or unload of model ``name`` at a time on this router, in arrival order: the
        last to answer is the state this router, the control deployment and the replicas all
        keep (two at once could leave this router's view and the replicas' apart until the next
        ``follow_desired``: ready 200 while requests answered 503 "unloaded")."""
        return self._control_locks.setdefault(name, asyncio.Lock())

    @_answers_errors
    async def memory(self, request: Request) -> JSONResponse:
        """Resident memory: the cache of one pool replica (status + load/evict timeline; the
        ``replica`` field names which) and each ready dedicated model's footprint (one replica's)."""
        engines = [n for n in sorted(self.client.dedicated)
                   if self.states.is_ready(n) and not self.repo.get(n).config.pipeline]
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
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(BODY_STALL_TIMEOUT_S) as stall:
                async for chunk in request.stream():
                    stall.reschedule(loop.time() + BODY_STALL_TIMEOUT_S)
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
            InvalidInput: a body that is not a JSON object, ``parameters`` that is not one (as an
                infer request's: a falsy value counts as none), or a client that left before its end.
            PayloadTooLarge, RequestTimeout: as ``_read_body``.
        """
        body = b"".join(await self._read_body(request))
        if not body.strip():
            return {}
        try:
            value = json.loads(body)
        except ValueError:
            value = None
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
        try:
            return await asyncio.wait_for(call, timeout_s + grace_s)
        except asyncio.TimeoutError:
            if not self.states.is_ready(name):  # it lost its replicas while the request waited
                self._require_ready(self.repo.get(name))
            raise timeout_error(name, timeout_s, asked) from None

    @observe_infer
    @_answers_errors
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

            done = await answer(entry.name, str(version), batched, chunks, header_length, run)
        add_phases(request, done.compute_input_s, done.compute_output_s)
        return Response(done.content, headers=done.headers)

    # --- observability (deployments.observe) -----------------------------------------------
    def _metrics_off(self) -> None:
        if self.observer is None:
            raise ModelNotFound("metrics are off (application args: metrics.enabled false)")

    @_answers_errors
    async def metrics(self, request: Request) -> Response:
        """This node's series in Prometheus text format (the node of the replica answering)."""
        self._metrics_off()
        body = await asyncio.to_thread(render_metrics)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @_answers_errors
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


class ReplicaClient:
    """The ``ModelClient`` of ``ModelRoutes``: model ``name`` runs in this process through
    ``infer`` (the replica's own ``infer(inputs, outputs)``); no pool, no handles."""

    pool = None

    def __init__(self, name: str, infer: Callable[..., Awaitable[dict]]) -> None:
        self.dedicated: dict[str, Any] = {name: None}
        self.pool_models: set[str] = set()
        self._infer = infer

    async def infer(self, name: str, inputs: dict, outputs: list[str] | None = None, key: str | None = None,
                    version: int | None = None) -> dict:
        return raise_if_error(await self._infer(inputs, outputs, version))


class ModelRoutes(RouterApp):
    """The KServe v2 model routes of one dedicated model (or pipeline), served by its own
    replica: ``GET /v2/models/{name}[/versions/{v}][/ready|/config|/stats]`` and
    ``POST .../infer``, with the router's code, errors and checks (body limit, timeout, readiness,
    explicit model control). The deployment reports its model's state with ``model_loaded(backend)``
    and ``model_unloaded()``; under explicit model control its requests answer 503 until its
    ``follower`` has applied the desired state once (``Follower.synced``).
    """

    def __init__(self, entry: ModelEntry, repo: ModelRepository, infer: Callable[..., Awaitable[dict]],
                 options: RouterOptions, observer: RouterObserver | None = None,
                 initial: Desired | None = None) -> None:
        super().__init__(repo, ReplicaClient(entry.name, infer), options, observer, initial)
        self.name = entry.name
        self.follower: Follower | None = None  # explicit model control (``own_routes``)

    def model_loaded(self, backend: str) -> None:
        """The replica has the model loaded and serves it (at start, or after a load)."""
        self._mark_loaded(self.repo.get(self.name), "dedicated", backend)

    def model_unloaded(self, reason: str | None = None) -> None:
        """The model was unloaded through the repository API (or its load failed: ``reason``
        says why): new requests answer 503."""
        self._mark_unloaded(self.name, reason)

    def step_changed(self, name: str, loaded: bool) -> None:
        """A step model of this pipeline was loaded or unloaded through the repository API: the
        pipeline answers 503 naming it while it is not loaded (``_unloaded_steps``)."""
        if loaded:
            self.states.loaded(name)
        else:
            self.states.unloaded(name)

    def build_app(self) -> Starlette:
        app = super().build_app()
        app.add_middleware(FullPath, suffix=f"/v2/models/{self.name}")
        return app


class PoolClient:
    """The ``ModelClient`` of ``PoolRoutes``: the pool's models run in this process, through the
    pool replica's own ``infer_body`` (keyed by the version's cache key) and ``models``; no
    handles. ``pool`` is the client itself: the routes treat the pool as present."""

    def __init__(self, pool_models: Iterable[str], infer_body: Callable[..., Awaitable[Any]],
                 states: Callable[[], dict[str, dict[str, Any]]]) -> None:
        self.dedicated: dict[str, Any] = {}
        self.pool = self
        self.pool_models = set(pool_models)
        self._infer_body = infer_body
        self._states = states

    async def infer_body(self, name: str, key: str | None, version: str, batched: bool, chunks: list[bytes],
                         header_length: str | None, default_timeout_s: float) -> Any:
        return raise_if_error(await self._infer_body(name, version, batched, chunks, header_length,
                                                     default_timeout_s, key))

    async def pool_states(self) -> dict[str, dict[str, Any]]:
        return self._states()


class PoolRoutes(RouterApp):
    """The KServe v2 model routes of the pool models, served by a pool replica (``PoolClient``):
    ``GET /v2/models/{name}[/versions/{v}][/ready|/config|/stats]`` and ``POST .../infer``, with
    the router's code, errors and checks, over the whole repository (a model of another
    application reaching it answers as the router would: not ready). The deployment reports
    loads and unloads of explicit model control with ``pool_model_loaded`` and ``model_unloaded``.
    """

    router_app = "<router application>"  # the router application's name (``pool_routes``)

    def _not_ready(self, entry: ModelEntry) -> ServingError | None:
        """As the router's, and for a model that is not the pool's (a dedicated model or
        pipeline: its own application's route is longer), 503 naming that application: it is
        not routed, so not deployed, or starting or stopping."""
        if self.states.is_loaded(entry.name) and entry.name not in self.client.pool_models:
            app = model_application(self.router_app, entry.name)
            return ModelNotReady(
                f"model '{entry.name}' is not served: its application '{app}' "
                "is not deployed or not routed yet (starting or stopping): the Serve config must list it "
                "(python -m deployments.check --write serve_config.yaml writes it); retry shortly if it is starting")
        return super()._not_ready(entry)

    def pool_model_loaded(self, entry: ModelEntry, backend: str) -> None:
        """Pool model ``entry`` was loaded through the repository API, as the replica's cache
        read its folder (it may be new, or have a new version or config): the routes describe,
        label and validate that reading from now on, and serve its requests."""
        self.repo.take(entry)
        self._mark_loaded(entry, "pool", backend)

    def model_unloaded(self, name: str, reason: str | None = None) -> None:
        """Pool model ``name`` was unloaded through the repository API (or its load failed:
        ``reason`` says why): new requests answer 503 "unloaded", as the router's; a model new
        to this replica is read first, so that its name is known (a folder that cannot be read
        stays unknown: 404)."""
        if name not in self.repo.names():
            with contextlib.suppress(ConfigError, ModelNotFound):
                self.repo.read(name)
        self._mark_unloaded(name, reason)

    def build_app(self) -> Starlette:
        app = super().build_app()
        app.add_middleware(FullPath, suffix="/v2/models")
        return app


def pool_routes(repo: ModelRepository, pool_models: Iterable[str], infer_body: Callable[..., Awaitable[Any]],
                states: Callable[[], dict[str, dict[str, Any]]], options: RouterOptions,
                metrics: dict[str, Any] | None, initial: Desired | None, router_app: str) -> PoolRoutes:
    """In a pool replica: the ``PoolRoutes`` of ``repo`` (every served model) for ``pool_models``,
    run by ``infer_body`` (``PoolDeployment.infer_body``) and described by ``states``
    (``PoolDeployment.models``), beside router application ``router_app``."""
    routes = PoolRoutes(repo, PoolClient(pool_models, infer_body, states), options,
                        router_observer(repo, metrics), initial)
    routes.router_app = router_app
    return routes


def own_routes(entry: ModelEntry, repo: ModelRepository, infer: Callable[..., Awaitable[dict]],
               options: RouterOptions, metrics: dict[str, Any] | None, initial: Desired | None,
               backend: str | None, apply: Callable[[Desired], dict[str, dict[str, Any]]]) -> ModelRoutes:
    """In a dedicated model's (or pipeline's) replica: its ``ModelRoutes``, marked loaded with
    ``backend`` (None: not loaded at start), following explicit model control through the
    router application's control deployment with ``apply`` (``deployments.control.follow``)."""
    routes = ModelRoutes(entry, repo, infer, options, router_observer(repo, metrics), initial)
    if backend is not None:
        routes.model_loaded(backend)
    if initial is not None:
        routes.follower = follow(handle(router_application(entry.name), "control"), initial, apply)
    return routes


class Admission:
    """How many requests a replica holds for its model at once: ``max_ongoing_requests`` run or
    wait for an execution context (or a batch), ``max_queued_requests`` more wait; one more is
    shed at once (``Overloaded``: 503, ``Retry-After``, the error body the router's handle gave).
    It stands where Serve's own bounds stood when the router called the model: the replica is its
    model's ingress now, and Serve's direct-ingress shedding answers plain text. HTTP requests and
    calls through handles (a pipeline's steps) count alike. ``max_queued_requests`` None: no bound.

    With ``timeout_s`` (the application's ``request_timeout_s``) a request is also shed when the
    requests already held would take longer than ``SHED_FRACTION`` of it to clear at the rate
    this replica answers: it would only wait to be answered 504. The bounds count requests,
    and a slow model (the OCR pipeline on 2 cores: ~3.4 images/s) holds more than it serves in
    60 s (300 concurrent images: 88 answered 504 after 60 s, none 503). The margin covers the
    time a request spends before it is admitted (its body read by a busy replica: seconds under
    overload) and the rate falling as load grows (2.8 images/s at 40 clients, 1.8-2.3 at 250).
    The rate is the current busy period's once ``RATE_MIN_DONE`` requests finished over
    ``RATE_MIN_S`` seconds of it, until then the last busy period's (the opening burst of an
    overload is judged by it); none before the first, or after ``RATE_STALE_S`` without an
    answer: then only the bounds shed.
    """

    RATE_MIN_DONE = 16
    RATE_MIN_S = 1.0
    RATE_STALE_S = 5.0
    SHED_FRACTION = 0.75

    def __init__(self, max_ongoing_requests: int, max_queued_requests: int | None,
                 timeout_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_ongoing_requests = max_ongoing_requests
        self.max_queued_requests = max_queued_requests
        self.timeout_s = timeout_s
        self.in_flight = 0
        self._clock = clock
        self._done: collections.deque[float] = collections.deque(maxlen=256)  # this busy period's answers
        self._last_rate: float | None = None  # the last busy period's, at its end

    def rate(self) -> float | None:
        """Requests answered per second over this busy period's last answers (at most 256), or
        None while too few, too brief or stale to say."""
        done = self._done
        if len(done) < self.RATE_MIN_DONE or self._clock() - done[-1] > self.RATE_STALE_S:
            return None
        span = done[-1] - done[0]
        return (len(done) - 1) / span if span >= self.RATE_MIN_S else None

    def expected_rate(self) -> float | None:
        """``rate()``, else the last busy period's."""
        rate = self.rate()
        return rate if rate is not None else self._last_rate

    def check(self) -> None:
        """Whether a request would be admitted now, holding nothing: the routes ask before they
        read and decode a body, so that shedding costs an overloaded replica almost nothing.

        Raises:
            Overloaded: as ``request``.
        """
        waiting = self.in_flight - self.max_ongoing_requests
        if self.max_queued_requests is not None and waiting >= self.max_queued_requests:
            raise overloaded(waiting, self.max_queued_requests)
        rate = self.expected_rate() if self.timeout_s is not None and self.in_flight else None
        if rate is not None and self.in_flight / rate > self.SHED_FRACTION * self.timeout_s:
            raise past_deadline(self.in_flight, rate, self.timeout_s)

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        """Hold one place for a request.

        Raises:
            Overloaded: ``max_queued_requests`` already wait, or the requests held would take
                more than ``SHED_FRACTION`` of ``timeout_s`` to clear at this replica's rate.
        """
        self.check()
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight:
                self._done.append(self._clock())
            else:  # idle: the next busy period measures its own rate, judged by this one's until then
                self._last_rate = self.rate() or self._last_rate
                self._done.clear()


class FullPath:
    """ASGI middleware: route on the full path. Serve mounts an application at its route prefix
    (``scope["root_path"]``: e.g. ``/v2/models/ocr_cls``), and Starlette matches routes on the
    path after it; ``ModelRoutes`` and ``PoolRoutes`` keep the router's full-path routes (the same table, the
    same ``{name}`` parameters), so the prefix's ``suffix`` is taken off ``root_path`` again."""

    def __init__(self, app: Callable, suffix: str) -> None:
        self.app = app
        self.suffix = suffix

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        root = scope.get("root_path", "")
        if scope["type"] in ("http", "websocket") and root.endswith(self.suffix):
            scope = {**scope, "root_path": root[:-len(self.suffix)]}
        await self.app(scope, receive, send)


def router_observer(repo: ModelRepository, metrics: dict[str, Any] | None) -> RouterObserver | None:
    """In the router replica: start metrics (``observe.options.start``) and return the observer
    of ``repo``'s models; None when ``metrics`` (``MetricsOptions`` as a dict) turns them off."""
    options = start_metrics(metrics)
    if options is None:
        return None
    versions = {e.name: str(e.latest) for e in repo.entries()}
    return RouterObserver(versions, access_log=options.access_log)


@serve.deployment
@serve.ingress()
class Router(RouterApp):
    """The ``RouterApp`` as a Ray Serve ingress deployment, calling models through handles.

    Args:
        repository: model repository root.
        dedicated: model name -> name of its dedicated deployment (pipelines included), each in
            its own application (``client.model_application``).
        pool_models: names served by the pool (its own application, ``client.pool_handle``).
        options: ``RouterOptions``.
        models: the models served at build (None: every folder of the repository); one loaded
            later is read on its load (``follow_desired``).
        metrics: ``deployments.observe.options.MetricsOptions`` as a dict (default: on).
        control: handle of ``deployments.control.ControlDeployment`` (explicit model control).
        initial: the build-time desired state (None: model control is off).
    """

    def __init__(self, repository: str, dedicated: dict[str, str], pool_models: Iterable[str],
                 options: RouterOptions, models: list[str] | None = None,
                 metrics: dict[str, Any] | None = None, control: Any | None = None,
                 initial: Desired | None = None) -> None:
        repo = ModelRepository(repository, models)
        app = serve.get_replica_context().app_name
        # The handles are made here, so that they take this cluster's default transport (gRPC
        # under RAY_SERVE_THROUGHPUT_OPTIMIZED=1): one made where the application was built has
        # that process's default, fixed when it imported Ray Serve (bench.throughput's server
        # imported it before setting the environment: every pool body went by reference,
        # through the object store, 42% of the router's event loop).
        pool_models = list(pool_models)
        pool = pool_handle(app) if pool_models else None
        client = ModelClient(model_handles(app, dedicated), pool, pool_models, control)
        super().__init__(repo, client, options, router_observer(repo, metrics), initial)
        show_on_terminal()
        replica_grpc_on_loopback()
        loop = asyncio.get_running_loop()
        self._poller = loop.create_task(self._announce_when_ready())
        self._watcher = loop.create_task(self.watch_replicas())

    def __serve_build_asgi_app__(self) -> Starlette:
        return self.build_app()

    async def _announce_when_ready(self) -> None:
        """``poll_ready``, then the ready line (``deployments.logs``: it reaches the ``serve run``
        terminal)."""
        await self.poll_ready()
        url = await self._base_url()
        ready_logger.info("ready: %d models %s; KServe v2 at %s/v2 (POST %s/v2/models/{name}/infer)",
                          len(self.repo.names()), self.repo.names(), url, url)

    async def _base_url(self) -> str:
        """``http://host:port`` of Serve's HTTP ingress (``http_options`` of the Serve config)."""
        try:  # the controller's HTTP options; Serve has no public getter for them
            from ray.serve.context import _get_global_client

            options = await asyncio.to_thread(lambda: _get_global_client().http_config)
            return f"http://{options.host}:{options.port}"
        except Exception:
            return "http://<http_options.host>:<http_options.port>"
