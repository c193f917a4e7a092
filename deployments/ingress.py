"""The router: the Serve deployment for every route no model replica answers, dispatch by model name.

Routes (Open Inference Protocol, plus Triton's repository index), by the module that answers them:
    GET  /v2/health/live, /v2/health/ready, /v2                                   ``routes``
    GET  /v2/models/{name}[/versions/{version}][/ready|/config]                   ``routes``
    POST /v2/models/{name}[/versions/{version}]/infer                             ``routes``
    GET  /v2/models[/{name}[/versions/{version}]]/stats, /metrics                 ``routes`` (``deployments.observe``)
    POST /v2/repository/index, /v2/repository/models/{name}/load|unload           ``repository_routes`` (router only)
    GET  /v2/memory                                                               ``repository_routes`` (router only)
    POST /v1/embeddings, GET /v1/models[/{model}] (OpenAI-compatible)             ``openai_routes`` (router only)
    GET|POST /v2/systemsharedmemory|cudasharedmemory/...  (Triton's shared memory) ``shared_memory_routes`` (router only)
Infer speaks JSON and Triton's binary tensor data extension (``protocol.binary``); request
bodies may be gzip/deflate compressed and responses are, as Accept-Encoding asks (``protocol.compression``).
Every error answers ``{"error": "..."}`` with the status from ``protocol.errors``.

``RouterApp`` composes the route table every replica serves (``routes.V2Routes``), the
repository and model-control routes (``repository_routes``) and readiness watching
(``readiness``) over a repository and a ``ModelClient`` (tests run it under
``starlette.testclient.TestClient`` with a fake client); ``Router``, at the bottom, is the Ray
Serve deployment around it. Each dedicated model and pipeline is also its own Serve application
at ``/v2/models/<name>`` (``deployments.app.applications``), whose replicas answer its routes
(``replica_routes.ModelRoutes``), so the ingress (HAProxy or Serve's proxy, longest route prefix
first) sends its requests straight to a replica that decodes, runs and answers them, with no
router hop; ``replica_routes.PoolRoutes`` is the same for the multiplexed pool, at
``/v2/models``: every model without an application of its own reaches a pool replica in one hop.
The router checks only what routing needs (model, version, body size, readiness); the replica
that runs a request validates its tensors.
"""

from __future__ import annotations

import asyncio
from typing import Any, Iterable

from ray import serve
from starlette.applications import Starlette

from . import grpc_service
from .client import ModelClient, handle, model_handles, pool_handle
from .control import Desired
from .node import node_id
from .loopback import replica_grpc_on_loopback
from .logs import ready_line, ready_logger, show_on_terminal
from .observe.options import bind_host
from .readiness import ReadinessWatch
from .openai_routes import OpenAIRoutes
from .regions import process_shared_memory
from .repository_routes import RepositoryRoutes
from .routes import RouterOptions, router_observer
from .shared_memory_routes import SharedMemoryRoutes
from .runtime.contract.repository import ModelEntry, ModelRepository
from .states import Status


class RouterApp(SharedMemoryRoutes, OpenAIRoutes, RepositoryRoutes, ReadinessWatch):
    """The router's routes without Ray: the KServe v2 route table (``routes.V2Routes``, whose
    arguments it takes), the repository and model-control routes (``RepositoryRoutes``), the
    OpenAI-compatible embeddings routes (``OpenAIRoutes``), Triton's shared-memory routes
    (``SharedMemoryRoutes``, over ``shared_memory``) and readiness watching
    (``ReadinessWatch``), over a model repository and a ``ModelClient``."""


@serve.deployment
@serve.ingress()
class Router(grpc_service.ServeGrpcMethods, RouterApp):
    """The ``RouterApp`` as a Ray Serve ingress deployment, calling models through handles; its
    KServe v2 gRPC: its own ``grpc.aio`` server on ``grpc_port`` behind Serve's Python proxy,
    Serve's gRPC server behind HAProxy (``_serve_grpc``).

    Args:
        repository: model repository root.
        dedicated: model name -> name of its dedicated deployment (pipelines included), each in
            its own application (``client.model_application``).
        pool_models: names served by the pool (its own application, ``client.pool_handle``).
        options: ``RouterOptions``.
        models: the models served, as read at build (``ModelRepository``'s ``entries``; None:
            every folder of the repository, read now); one loaded later is read on its load
            (``follow_desired``).
        metrics: ``deployments.observe.options.MetricsOptions`` as a dict (default: on).
        control: handle of ``deployments.control.ControlDeployment`` (explicit model control).
        initial: the build-time desired state (None: model control is off).
        placement: handle of ``deployments.placement.PlacementDeployment`` (``placement:
            bytes``), bound here so that Serve runs it; the pool replicas call it, and the
            repository index reads its decision.
    """

    def __init__(self, repository: str, dedicated: dict[str, str], pool_models: Iterable[str],
                 options: RouterOptions, models: list[ModelEntry] | None = None,
                 metrics: dict[str, Any] | None = None, control: Any | None = None,
                 initial: Desired | None = None, placement: Any | None = None) -> None:
        repo = ModelRepository(repository, entries=models, node=node_id())
        app = serve.get_replica_context().app_name
        # The handles are made here, so that they take this cluster's default transport (gRPC
        # under RAY_SERVE_THROUGHPUT_OPTIMIZED=1): one made where the application was built has
        # that process's default, fixed when it imported Ray Serve (bench.throughput's server
        # imported it before setting the environment: every pool body went by reference,
        # through the object store, a large share of the router's event loop).
        pool_models = list(pool_models)
        pool = pool_handle(app) if pool_models else None
        client = ModelClient(model_handles(app, dedicated), pool, pool_models, control,
                             handle(app, "placement") if placement is not None else None)
        super().__init__(repo, client, options, router_observer(repo, metrics), initial)
        show_on_terminal()
        replica_grpc_on_loopback()
        self.shared_memory = process_shared_memory()
        loop = asyncio.get_running_loop()
        self._poller = loop.create_task(self._announce_when_ready())
        self._watcher = loop.create_task(self.watch_replicas())
        self._grpc: Any = None  # grpc.aio.Server, once started
        self._forward: grpc_service.IngressForward | None = None
        if options.grpc_port is not None:
            self._grpc_start = loop.create_task(self._serve_grpc(options.grpc_port, options.max_body_bytes))

    def kserve_routes(self) -> RouterApp:
        return self

    async def _serve_grpc(self, port: int, max_body_bytes: int) -> None:
        """Serve KServe v2 gRPC on ``port`` (``deployments.grpc_service``); a port this replica
        cannot bind is logged (to the ``serve run`` terminal) and HTTP serves on. Where Serve
        serves it (its ``grpc_options`` name ``grpc_service.SERVE_SERVICER``: HAProxy binds the
        port and sends the router the calls no model replica takes), none of its own."""
        from ray.serve._private.constants import RAY_SERVE_ENABLE_HA_PROXY

        host = bind_host()
        try:
            served = grpc_service.serves_kserve_grpc(await self._grpc_options())
        except Exception as e:  # neither the router's server nor Serve's known: none, and say why
            ready_logger.error("gRPC: Serve's grpc_options could not be read (%s): no gRPC on %s:%d. HTTP serves on.",
                               e, host, port)
            return
        if served and RAY_SERVE_ENABLE_HA_PROXY:
            ready_logger.info("gRPC (KServe v2) on %s:%d, through HAProxy to each model's replicas", host, port)
            return
        if served:  # Serve's Python proxy would route by `application` metadata, which tritonclient never sends
            ready_logger.error("gRPC: this Serve config's grpc_options serve KServe v2 gRPC on port %d, which "
                               "needs HAProxy (RAY_SERVE_ENABLE_HA_PROXY=1, `make serve`); without it remove "
                               "grpc_options and the router serves grpc_port itself", port)
            return
        self._forward = await self._ingress_forward()
        try:
            replica = serve.get_replica_context()
            title = f"ray::ServeReplica:{replica.app_name}:{replica.deployment}"  # what Ray names its process
            self._grpc = await grpc_service.start(self, port, host, max_body_bytes, title, self._forward)
        except Exception as e:
            ready_logger.error("gRPC: cannot serve on %s:%d (%s); set grpc_port in the application args to a "
                               "free port, or null for none. HTTP serves on.", host, port, e)
            return
        ready_logger.info("gRPC (KServe v2) on %s:%d", host, port)

    async def _ingress_forward(self) -> grpc_service.IngressForward | None:
        """Where HAProxy is the HTTP ingress (``RAY_SERVE_ENABLE_HA_PROXY``), the gRPC edge's way
        to it: its frontend on this node (``http_options``; on loopback where it binds every
        interface). None under Serve's own proxy, where a hop through it would cost more than
        the router's own handle call."""
        from ray.serve._private.constants import RAY_SERVE_ENABLE_HA_PROXY

        if not RAY_SERVE_ENABLE_HA_PROXY:
            return None
        try:
            options = await self._http_options()
        except Exception as e:
            ready_logger.warning("gRPC: the HTTP ingress's address is unknown (%s); ModelInfer goes through the "
                                 "router's handles", e)
            return None
        host = "127.0.0.1" if options.host in ("0.0.0.0", "::", "") else options.host
        return grpc_service.IngressForward(f"http://{f'[{host}]' if ':' in host else host}:{options.port}",
                                           self.request_timeout_s)

    async def __del__(self) -> None:
        """Serve calls it when this replica stops, once its HTTP requests have drained: the
        gRPC server takes no new call and gives those in flight ``STOP_GRACE_S``."""
        if self._grpc is not None:
            await self._grpc.stop(grpc_service.STOP_GRACE_S)
        if self._forward is not None:
            await self._forward.close()

    def __serve_build_asgi_app__(self) -> Starlette:
        return self.build_app()

    async def _announce_when_ready(self) -> None:
        """``poll_ready``, then the ready line (``deployments.logs.ready_line``: it reaches the
        ``serve run`` terminal), which counts only the models that serve now."""
        await self.poll_ready()
        url = await self._base_url()
        try:
            cached = await self._pool_models()
        except Exception:  # no answer from the pool: none of its models counts as serving
            cached = {}
        resident = {key for key, model in cached.items() if model["state"] == "ready" and "@" not in key}
        ready_logger.info("%s", ready_line(url, self.repo.names(), self.states.names(Status.LOADING, Status.READY),
                                           self.states.names(Status.READY), self.client.pool_models, resident))

    async def _http_options(self) -> Any:
        """Serve's ``HTTPOptions`` (``http_options`` of the Serve config), from the controller:
        Serve has no public getter for them."""
        from ray.serve.context import _get_global_client

        return await asyncio.to_thread(lambda: _get_global_client().http_config)

    async def _grpc_options(self, attempts: int = 10) -> Any:
        """Serve's ``gRPCOptions`` (``grpc_options`` of the Serve config), from the controller,
        asked up to ``attempts`` times a second apart; the last failure is raised."""
        import ray
        from ray.serve.context import _get_global_client

        for attempt in range(attempts):
            try:
                return await asyncio.to_thread(lambda: ray.get(_get_global_client()._controller.get_grpc_config.remote(),
                                                               timeout=10))
            except Exception:
                if attempt == attempts - 1:
                    raise
                await asyncio.sleep(1.0)

    async def _base_url(self) -> str:
        """``http://host:port`` of Serve's HTTP ingress (``http_options`` of the Serve config)."""
        try:
            options = await self._http_options()
            return f"http://{options.host}:{options.port}"
        except Exception:
            return "http://<http_options.host>:<http_options.port>"
