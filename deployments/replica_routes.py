"""What a dedicated model's (or pipeline's) replica and a pool replica serve: the KServe v2 route
table (``routes.V2Routes``) for their own models, run in process through the replica adapters
(``adapters``), mounted at their application's route prefix (``routes.V2App``)."""

from __future__ import annotations

import contextlib
from typing import Any, Awaitable, Callable, Iterable

from .adapters import PoolAdapter, ReplicaAdapter
from .client import handle, model_application, router_application
from .control import Desired, Follower, follow
from .observe.router import RouterObserver
from .regions import process_shared_memory
from .routes import RouterOptions, V2Routes, router_observer
from .runtime.contract.errors import ConfigError, LoadFault, ModelNotFound, ModelNotReady, ServingError
from .runtime.contract.repository import ModelEntry, ModelRepository


class ModelRoutes(V2Routes):
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
        super().__init__(repo, ReplicaAdapter(entry.name, infer), options, observer, initial)
        self.name = entry.name
        self.mount_suffix = f"/v2/models/{entry.name}"
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


class PoolRoutes(V2Routes):
    """The KServe v2 model routes of the pool models, served by a pool replica (``PoolAdapter``):
    ``GET /v2/models/{name}[/versions/{v}][/ready|/config|/stats]`` and ``POST .../infer``, with
    the router's code, errors and checks, over the whole repository (a model of another
    application reaching it answers as the router would: not ready). The deployment reports
    loads and unloads of explicit model control with ``pool_model_loaded`` and ``model_unloaded``.
    """

    router_app = "<router application>"  # the router application's name (``pool_routes``)
    mount_suffix = "/v2/models"

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
            with contextlib.suppress(ConfigError, LoadFault, ModelNotFound):
                self.repo.read(name)
        self._mark_unloaded(name, reason)


def pool_routes(repo: ModelRepository, pool_models: Iterable[str], infer_body: Callable[..., Awaitable[Any]],
                states: Callable[[], dict[str, dict[str, Any]]], options: RouterOptions,
                metrics: dict[str, Any] | None, initial: Desired | None, router_app: str) -> PoolRoutes:
    """In a pool replica: the ``PoolRoutes`` of ``repo`` (every served model) for ``pool_models``,
    run by ``infer_body`` (``PoolDeployment.infer_body``) and described by ``states``
    (``PoolDeployment.models``), beside router application ``router_app``, with this process's
    ``SharedMemory`` (``regions.process_shared_memory``)."""
    routes = PoolRoutes(repo, PoolAdapter(pool_models, infer_body, states), options,
                        router_observer(repo, metrics), initial)
    routes.router_app = router_app
    routes.shared_memory = process_shared_memory()
    return routes


def own_routes(entry: ModelEntry, repo: ModelRepository, infer: Callable[..., Awaitable[dict]],
               options: RouterOptions, metrics: dict[str, Any] | None, initial: Desired | None,
               backend: str | None, apply: Callable[[Desired], dict[str, dict[str, Any]]]) -> ModelRoutes:
    """In a dedicated model's (or pipeline's) replica: its ``ModelRoutes``, marked loaded with
    ``backend`` (None: not loaded at start), following explicit model control through the
    router application's control deployment with ``apply`` (``deployments.control.follow``), with
    this process's ``SharedMemory`` (``regions.process_shared_memory``)."""
    routes = ModelRoutes(entry, repo, infer, options, router_observer(repo, metrics), initial)
    routes.shared_memory = process_shared_memory()
    if backend is not None:
        routes.model_loaded(backend)
    if initial is not None:
        routes.follower = follow(handle(router_application(entry.name), "control"), initial, apply)
    return routes
