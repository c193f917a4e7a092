"""``build_app(args)``: the bound Serve application that ``serve_config.yaml`` imports.

    applications:
      - name: models
        route_prefix: /
        import_path: deployments.app:build_app
        args: {repository: engines, pool: {max_num_models_per_replica: 3}}

The router application (``args`` without ``model``): the ``Router`` ingress for every route and
the control deployment of explicit model control. One application per dedicated model (pipelines
included), ``args`` with ``model: <name>``, named ``<router application>.<name>`` at route prefix
``<router prefix>/v2/models/<name>``: its replicas are the ingress of that model's routes
(``replica_routes.ModelRoutes``), so a request for a hot model reaches a replica that runs it in one hop.
With pool models (``mode: pool``), the multiplexed pool's application, ``args`` with ``model:
pool``, named ``<router application>.pool`` at ``<router prefix>/v2/models``: the ingress (longest
route prefix first) sends every other model's requests to a pool replica, which decodes, runs and
answers them (``replica_routes.PoolRoutes``), and HAProxy picks the replica by the model's name
(``haproxy.hash_pool_models``), so a model's requests find the replica that has it loaded.
``applications`` lists them all; ``python -m deployments.check`` checks that ``serve_config.yaml``
lists the same (``--write`` writes them), and the router finds the others by those names.

    applications:
      - name: models
        route_prefix: /
        import_path: deployments.app:build_app
        args: &args {repository: engines}
      - name: models.ocr_cls
        route_prefix: /v2/models/ocr_cls
        import_path: deployments.app:build_app
        args: {<<: *args, model: ocr_cls}

A bad config raises ``AppConfigError``, a ``RayServeException``: Serve's build task reports it
as the application's DEPLOY_FAILED message at once instead of retrying the build (it retries
other exceptions three times). ``serve run serve_config.yaml`` keeps waiting after a failed
deploy, so ``make serve`` first runs ``python -m deployments.check`` (the same checks, before
Ray starts), which prints the one line and exits non-zero.
"""

from __future__ import annotations

import logging
import os
import re
import time
import uuid
from typing import Any, Iterable, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from ray.serve import Application
from ray.serve.exceptions import RayServeException

from .client import POOL, deployment_name, model_application
from .control import ControlDeployment, Desired, initial_state
from .ingress import Router
from .routes import RouterOptions
from .node import node_id
from .model import ModelDeployment
from .pipeline import PipelineDeployment
from .observe.options import MetricsOptions
from .placement import PlacementDeployment
from .pool import PoolDeployment
from .protocol.errors import RETRY_AFTER_S
from .runtime.contract.config import Autoscaling, Backend, CacheOptions, DeploymentOptions, describe_validation_error
from .runtime.contract.errors import ConfigError, LoadFault
from .runtime.contract.repository import ModelEntry, ModelRepository
from .runtime.contract.units import mib_to_bytes

logger = logging.getLogger("ray.serve")

# Replicas whose deployment handles call other deployments (router, pipelines) retry a full
# replica every 25 ms, 50 ms, then every 50 ms, not up to Ray's default 0.5 s: a retry that
# sleeps longer than the replica takes to drain its queue leaves it idle (docs/lab-notes.md,
# "Overload"). A value in the environment wins.
HANDLE_ENV = {name: os.environ.get(name, default) for name, default in (
    ("RAY_SERVE_ROUTER_RETRY_MAX_BACKOFF_S", "0.05"),)}

# Replicas that are not the ingress wait this long between checks for their last requests when
# stopping (Serve's default is 2 s, paid once per tier of the graph on every Ctrl-C).
GRACEFUL_SHUTDOWN_WAIT_LOOP_S = 0.2
# A replica that calls other deployments (the router, pipelines) being stopped waits at most
# this long for its requests (Serve's default: 20 s). Deleting the application (what `make serve`
# does on Ctrl-C, deployments/run.py) stops every deployment at once, so a call still queued for a
# model whose replicas are gone waits for nothing; without this bound it held the router, and
# Ctrl-C, for the full 20 s. The router answers such calls 503 as soon as it sees the model's
# deployment stopped (``ModelClient.cut_unassigned``, from ``readiness.ReadinessWatch``); this
# bound is the backstop. With HAProxy,
# Serve raises the router's to RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S + 5 s (35 s by default).
ROUTER_GRACEFUL_SHUTDOWN_TIMEOUT_S = 5.0
# A dedicated model's name is its application's route prefix; HAProxy and Serve's proxy match a
# prefix against the path as sent, and clients percent-encode other characters (tritonclient
# quotes every name): RFC 3986's unreserved characters are the ones no client encodes.
ROUTE_SAFE_NAME = re.compile(r"[A-Za-z0-9._~-]+")
DELETE_POLL_S = 0.1  # seconds between checks that deleted applications are gone
DELETE_TIMEOUT_S = 60.0  # serve.delete's own bound
# Serve's limit of requests at once in a dedicated model's replica, which is its model's ingress:
# far above the bound ``ModelRoutes`` sheds at (the model's max_ongoing_requests +
# max_queued_requests), and no queue limit in Serve's handles (with the model's 8, Serve's own
# proxy shed requests at 4x saturation while its router assigned a burst), so that
# Serve, whose shedding answers plain text, never answers first: the routes shed with this app's
# error body.
INGRESS_MAX_ONGOING_REQUESTS = 1 << 16


class AppConfigError(ConfigError, RayServeException):
    """A bad ``serve_config.yaml`` application args or model repository (one line: file, field,
    what is allowed). A ``RayServeException``, so Serve's build task does not retry it."""


class PoolOptions(DeploymentOptions, CacheOptions):
    """The multiplexed pool deployment: placement (``DeploymentOptions``) and what each replica
    keeps resident (``CacheOptions``: load policy, ``memory_budget_mib``, model count cap);
    passed whole to ``deployments.pool.PoolDeployment`` and its ``ModelCache``.

    The pool's replicas are the ingress of its application (``deployments.app`` module
    docstring): like a dedicated model's, each holds ``max_ongoing_requests`` +
    ``max_queued_requests`` requests of its models together and sheds the next with this app's
    error body (``admission.Admission``; Serve's own bounds are set far above). ``max_queued_requests``
    defaults to 512, not a dedicated model's 128: one replica holds many models' clients, and
    on a GPU 128 shed requests that a longer queue served at the same rate (docs/lab-notes.md,
    "Overload on the GPU")."""

    max_queued_requests: int = Field(512, ge=-1)
    # Which replica holds a pool model (docs/placement.md, "Placement by bytes"): `hash`, the
    # replica HAProxy hashes its name to; `bytes`, the placement deployment's decision from the
    # replicas' budgets, footprints and request rates (copies for hot models).
    placement: Literal["hash", "bytes"] = "bytes"


def cores() -> int:
    """CPU cores this process may run on (the node building the app)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def router_max_replicas(cores: int) -> int:
    """The router's default most replicas on a node of ``cores``: half of them, 1 to 8. A
    router replica uses at most one core, and the models need the rest: on 2 cores a second
    one added nothing (the cores were the limit) and cost 150 MiB (docs/performance.md, "Router
    replicas")."""
    return max(1, min(8, cores // 2))


# The router's replicas follow its load (docs/placement.md, "Router replicas scale with load"). The router
# holds every request it takes until the model answers, so its ongoing requests are the clients
# in flight through it, wherever the time goes. One replica saturates its core near 500 QPS,
# which a few clients reach (H200, docs/performance.md, "Router replicas"): the target keeps about 8 in flight per
# replica. Serve's delays (30 s up, 600 s down, 30 s look-back, pushes every 10 s) suit replicas
# that take long to load; a router starts in seconds. Computed where the app is built (on a
# cluster, the head: give max_replicas in serve_config.yaml where the router's nodes differ).
ROUTER_AUTOSCALING = Autoscaling(
    min_replicas=1, max_replicas=router_max_replicas(cores()), target_ongoing_requests=8, upscale_delay_s=10,
    downscale_delay_s=300, metrics_interval_s=2, look_back_period_s=10)


class RouterDeploymentOptions(DeploymentOptions):
    """The router deployment's placement (``args.router``): ``DeploymentOptions`` with the
    router's own defaults, autoscaling on (``ROUTER_AUTOSCALING``: 1 replica to half the cores).

    ``num_replicas: N`` alone is a fixed count (autoscaling off); ``autoscaling: {...}`` puts
    its fields over ``ROUTER_AUTOSCALING``'s (``{max_replicas: 8}`` keeps the router's target
    and delays); ``autoscaling: null`` is a fixed count as well (``num_replicas``, default 1).
    Both ``num_replicas`` and ``autoscaling`` given is an error, as in Serve. The router only
    routes and awaits model calls: it takes every request the models' queues can hold
    (``max_ongoing_requests``, ``max_queued_requests`` 1024), so that shedding happens at the
    model handles, with this app's error body."""

    num_cpus: float = Field(0.2, ge=0)
    max_ongoing_requests: int = Field(1024, ge=1)
    max_queued_requests: int = Field(1024, ge=-1)
    autoscaling: Optional[Autoscaling] = ROUTER_AUTOSCALING

    @model_validator(mode="before")
    @classmethod
    def _fixed_or_autoscaling(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if "num_replicas" in data and data.get("autoscaling") is not None:
            raise ValueError("give num_replicas (a fixed count) or autoscaling, not both")
        if "num_replicas" in data:
            return {**data, "autoscaling": None}
        if isinstance(data.get("autoscaling"), dict):
            return {**data, "autoscaling": {**ROUTER_AUTOSCALING.model_dump(exclude_none=True), **data["autoscaling"]}}
        return data


class AppArgs(BaseModel):
    """``args`` of the application in ``serve_config.yaml``.

    ``use_gpus``: ``auto`` reserves each model's ``num_gpus`` only when the cluster has GPU
    resources (so the same file runs on a laptop); ``true`` always reserves (use it on an
    autoscaling cluster whose GPU nodes start on demand); ``false`` never does.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    repository: str = "engines"
    backend: Backend = "auto"
    use_gpus: Union[Literal["auto"], bool] = "auto"
    max_body_mib: float = Field(64.0, gt=0)
    # A request whose body is at most this (and max_body_mib) is sent again by HAProxy when the
    # replica holding it dies: HAProxy's buffer holds it whole (`make serve` sets it before Ray
    # starts: deployments/run.py, retry_buffer_env); docs/configuration.md, "Application args".
    retry_body_mib: float = Field(1.0, ge=0)
    # Each router replica serves KServe v2 gRPC on this port (Triton's 8001; null: no gRPC).
    grpc_port: Optional[int] = Field(8001, ge=1, le=65535)
    request_timeout_s: float = Field(60.0, gt=0)
    router: RouterDeploymentOptions = RouterDeploymentOptions()  # autoscaling, 1 to ROUTER_AUTOSCALING's max
    pool: PoolOptions = PoolOptions()
    models: Optional[list[str]] = None  # serve only these models (default: all in the repository)
    # Per model, fields of its config's `deployment:` section to override for this cluster
    # (e.g. {ocr_cls: {num_replicas: 4, num_gpus: 0.125}}), without editing the repository.
    deployments: dict[str, dict[str, Any]] = {}
    metrics: MetricsOptions = MetricsOptions()  # Prometheus series, statistics, request logs
    # Triton's model control modes: `none` serves every model from the start and refuses load /
    # unload; `explicit` loads `startup_models` at start ("*": all) and the rest on
    # POST /v2/repository/models/{name}/load (deployments/control.py).
    model_control_mode: Literal["none", "explicit"] = "none"
    startup_models: list[str] = []
    # The application of one dedicated model (or pipeline) of the repository: its deployment
    # is the ingress of its routes at /v2/models/<model>; `pool`: the multiplexed pool's
    # application, ingress of the pool models' routes at /v2/models (None: the router application).
    model: Optional[str] = None


def _cluster_has_gpus() -> bool:
    import ray

    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0


def execution_contexts(app_args: AppArgs, entries: Iterable[ModelEntry]) -> int:
    """Execution contexts that can run at once: per dedicated model, replicas (the autoscaling
    maximum) x ``instances``; for the pool, replicas x the ``instances`` of the
    ``max_num_models_per_replica`` pool models with the most."""
    def replicas(options: DeploymentOptions) -> int:
        return options.autoscaling.max_replicas if options.autoscaling else options.num_replicas

    entries = [e for e in entries if not e.config.pipeline]
    pooled = sorted((e.config.instances for e in entries if e.config.deployment.mode == "pool"), reverse=True)
    dedicated = sum(replicas(e.config.deployment) * e.config.instances
                    for e in entries if e.config.deployment.mode == "dedicated")
    return dedicated + replicas(app_args.pool) * sum(pooled[:app_args.pool.max_num_models_per_replica])


def intra_op_threads(cores: int, app_args: AppArgs, entries: Iterable[ModelEntry]) -> int:
    """ONNX Runtime intra-op threads per execution context, so that every context of the app
    (``execution_contexts``) busy at once keeps to ``cores``: ``max(1, cores // contexts)``.
    ``ORT_INTRA_OP_THREADS`` in the environment wins. ``cores`` are the building node's (on a
    cluster, the head's: set ``ORT_INTRA_OP_THREADS`` there when workers differ)."""
    if os.environ.get("ORT_INTRA_OP_THREADS"):
        return int(os.environ["ORT_INTRA_OP_THREADS"])
    return max(1, cores // max(1, execution_contexts(app_args, entries)))


def ray_options(options: DeploymentOptions, use_gpus: bool, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Deployment options for ``.options(...)`` from a model's (or the pool's) config;
    ``env``: environment variables of its replicas."""
    actor: dict[str, Any] = {"num_cpus": options.num_cpus}
    if use_gpus and options.num_gpus:
        actor["num_gpus"] = options.num_gpus
    env_vars = dict(env or {})
    if not (use_gpus and options.num_gpus):
        # Ray (since 2.4x) leaves CUDA_VISIBLE_DEVICES alone for actors without GPUs, so such a
        # replica would see every GPU and `backend: auto` would run on one it never reserved.
        env_vars["CUDA_VISIBLE_DEVICES"] = ""
    if env_vars:
        actor["runtime_env"] = {"env_vars": env_vars}
    out: dict[str, Any] = {
        "ray_actor_options": actor, "max_ongoing_requests": options.max_ongoing_requests,
        "max_queued_requests": options.max_queued_requests,
        "backpressure_config": {"retry_after_s": RETRY_AFTER_S},
        "graceful_shutdown_wait_loop_s": GRACEFUL_SHUTDOWN_WAIT_LOOP_S}
    if options.autoscaling is not None:
        out["autoscaling_config"] = options.autoscaling.model_dump(exclude_none=True)
    else:
        out["num_replicas"] = options.num_replicas
    return out


def ingress_options(options: DeploymentOptions, use_gpus: bool,
                    env: dict[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """For a deployment that is its application's ingress (a dedicated model, a pipeline, the
    pool): its ``.options(...)`` (``ray_options``; with a queue bound, Serve's own bounds set far
    above: ``INGRESS_MAX_ONGOING_REQUESTS``, no queue limit) and the bounds its replicas shed at
    themselves (``admission.Admission``), as ``max_ongoing_requests`` / ``max_queued_requests``
    keyword arguments (``max_queued_requests`` None: no bound)."""
    serve_options = ray_options(options, use_gpus, env)
    if options.max_queued_requests != -1:
        serve_options.update(max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS, max_queued_requests=-1)
    return serve_options, {"max_ongoing_requests": options.max_ongoing_requests,
                           "max_queued_requests": None if options.max_queued_requests == -1
                           else options.max_queued_requests}


def deployment_options(entries: list[Any], overrides: dict[str, dict[str, Any]]) -> dict[str, DeploymentOptions]:
    """Each model's ``deployment`` section with ``overrides[model]``'s fields put over it.

    Raises:
        ConfigError: an override names a model not served, or makes an invalid section.
    """
    names = {e.name for e in entries}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ConfigError(f"serve_config.yaml application args: deployments: {unknown} are not served "
                          f"models; served: {sorted(names)}")
    out = {}
    for e in entries:
        if e.name not in overrides:
            out[e.name] = e.config.deployment
            continue
        try:
            out[e.name] = DeploymentOptions.model_validate(
                {**e.config.deployment.model_dump(exclude_unset=True), **overrides[e.name]})
        except ValidationError as err:
            fields = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in err.errors())
            raise ConfigError(f"serve_config.yaml application args: deployments.{e.name}: {fields}") from None
    return out


def build_app(args: dict[str, Any] | None = None) -> Application:
    """Bind the application graph from ``args`` (see ``AppArgs``).

    Raises:
        AppConfigError: invalid args or model repository, naming the file and field.
    """
    try:
        return _build(args)
    except (ConfigError, LoadFault) as e:  # a model file completion could not read stops the start too
        raise AppConfigError(e.message) from None


def _read(args: dict[str, Any] | None) -> tuple[AppArgs, list[ModelEntry], dict[str, DeploymentOptions], list[str]]:
    """``args`` parsed, the served models, each one's placement and the pool's models.

    Raises:
        ConfigError: invalid args or model repository.
    """
    try:
        app_args = AppArgs.model_validate(args or {})
    except ValidationError as e:
        raise ConfigError(f"serve_config.yaml application args: {describe_validation_error(e, AppArgs)}") from None
    entries = ModelRepository(app_args.repository, app_args.models, node=node_id()).entries()
    placement = deployment_options(entries, app_args.deployments)
    pool_models = [e.name for e in entries if placement[e.name].mode == "pool" and not e.config.pipeline]
    for entry in entries:
        if entry.name not in pool_models and not ROUTE_SAFE_NAME.fullmatch(entry.name):
            raise ConfigError(
                f"{entry.path}: the name '{entry.name}' of a dedicated model or pipeline becomes its route "
                "prefix /v2/models/<name>, which the ingress matches as the client encodes it: use letters, "
                "digits, '.', '_', '-' or '~' (rename the folder), or serve it from the pool (deployment.mode: pool)")
    if POOL in {e.name for e in entries} - set(pool_models):
        entry = next(e for e in entries if e.name == POOL)
        raise ConfigError(f"{entry.path}: a dedicated model or pipeline may not be named '{POOL}': its "
                          f"application's name, '<router application>.{POOL}', is the multiplexed pool's; rename "
                          "the folder (a model may also be served by the pool: deployment.mode: pool)")
    return app_args, entries, placement, pool_models


def _build(args: dict[str, Any] | None) -> Application:
    app_args, entries, placement, pool_models = _read(args)
    use_gpus = _cluster_has_gpus() if app_args.use_gpus == "auto" else app_args.use_gpus
    if not use_gpus:
        logger.info("no GPU resources in the cluster: models' num_gpus are not reserved")

    threads = intra_op_threads(cores(), app_args, entries)
    env = {"ORT_INTRA_OP_THREADS": str(threads), **HANDLE_ENV}
    logger.info("ONNX Runtime: %d intra-op thread(s) per execution context on %d cores", threads, cores())

    metrics = app_args.metrics.model_dump()
    initial = initial_control(app_args, entries, pool_models)
    routes = RouterOptions(max_body_bytes=mib_to_bytes(app_args.max_body_mib),
                           request_timeout_s=app_args.request_timeout_s, grpc_port=app_args.grpc_port)
    dedicated = {e.name: deployment_name(e.name, bool(e.config.pipeline)) for e in entries if e.name not in pool_models}
    # Every replica gets the models as read here, at build, and reads no folder when it starts:
    # a config.yaml edited since into an invalid one, or a folder added since (model control
    # reads it on its load), would stop every later replica (a replacement, a scale-out) in its
    # constructor, and Serve would restart it forever; and a replacement serves the config its
    # peers were deployed with.
    served = entries
    if app_args.model == POOL:
        if not pool_models:
            raise ConfigError(f"serve_config.yaml application args: model: {POOL}: the repository has no pool "
                              "models (deployment.mode: pool) for a pool application to serve")
        serve_options, bounds = ingress_options(app_args.pool, use_gpus, env)
        return PoolDeployment.options(name=POOL, **serve_options).bind(
            app_args.repository, pool_models, app_args.backend, app_args.pool, metrics=metrics, initial=initial,
            routes=routes, models=served, placement=app_args.pool.placement, **bounds)
    if app_args.model is not None:
        if app_args.model not in dedicated:
            raise ConfigError(f"serve_config.yaml application args: model: '{app_args.model}' is not a dedicated "
                              f"model or pipeline of the repository; those are: {sorted(dedicated)}, and "
                              f"'{POOL}' for the pool models' application")
        entry = next(e for e in entries if e.name == app_args.model)
        serve_options, bounds = ingress_options(placement[entry.name], use_gpus,
                                                HANDLE_ENV if entry.config.pipeline else env)
        model_args = dict(metrics=metrics, initial=initial, routes=routes, **bounds)
        if entry.config.pipeline:
            return PipelineDeployment.options(
                name=dedicated[entry.name], graceful_shutdown_timeout_s=ROUTER_GRACEFUL_SHUTDOWN_TIMEOUT_S,
                **serve_options).bind(app_args.repository, entry.name,
                                      {n: d for n, d in dedicated.items() if n != entry.name}, pool_models,
                                      models=served, **model_args)
        return ModelDeployment.options(name=dedicated[entry.name], **serve_options).bind(
            app_args.repository, entry.name, app_args.backend, models=[entry], **model_args)
    return Router.options(name="router", graceful_shutdown_timeout_s=ROUTER_GRACEFUL_SHUTDOWN_TIMEOUT_S,
                          **ray_options(app_args.router, False, HANDLE_ENV)).bind(
        app_args.repository, dedicated, pool_models, routes,
        models=served, metrics=metrics, **control_options(initial), **placement_options(app_args, pool_models))


def applications(args: dict[str, Any] | None, name: str = "models", route_prefix: str = "/",
                 one_hop: bool = True) -> list[tuple[str, str | None, Application]]:
    """Every application of one server, as ``serve_config.yaml`` lists them: ``(name,
    route_prefix, application)`` of the router application (``args``), then of each dedicated
    model and pipeline (``args`` + ``model``), named and routed as the router finds them
    (``model_application``). ``one_hop`` False: the models' applications get no route prefix,
    so the router answers their routes through its handles (two hops: what a server without
    HAProxy should run, docs/placement.md, "Where a request goes").

    Raises:
        AppConfigError: as ``build_app``.
    """
    out: list[tuple[str, str | None, Application]] = [(name, route_prefix, build_app(args))]
    for model, prefix in model_applications(args, route_prefix):
        out.append((model_application(name, model), prefix if one_hop else None,
                    build_app({**(args or {}), "model": model})))
    return out


def run_applications(args: dict[str, Any] | None, name: str = "models", route_prefix: str = "/",
                     wait: bool = True, one_hop: bool = True) -> None:
    """Deploy every application of one server (``applications``, ``one_hop`` as there) on the
    running Serve instance, as ``serve run serve_config.yaml`` does; ``wait``: until all run.

    Raises:
        AppConfigError: as ``build_app``.
    """
    from ray import serve

    serve.run_many([serve.RunTarget(app, name=app_name, route_prefix=prefix)
                    for app_name, prefix, app in applications(args, name, route_prefix, one_hop)],
                   wait_for_ingress_deployment_creation=wait, wait_for_applications_running=wait)


def delete_applications(app_names: list[str], wait: bool = True) -> None:
    """Delete the applications; ``wait``: return once Serve lists none of them (at most
    ``DELETE_TIMEOUT_S``): every replica has answered the requests it held by then."""
    from ray import serve

    for name in app_names:
        serve.delete(name, _blocking=False)
    if not wait:
        return
    deadline = time.monotonic() + DELETE_TIMEOUT_S
    while set(app_names) & set(serve.status().applications) and time.monotonic() < deadline:
        time.sleep(DELETE_POLL_S)


def delete_server(name: str = "models", wait: bool = True) -> None:
    """Delete router application ``name`` and its models' applications (``applications``);
    ``wait``: until Serve lists none of them (``delete_applications``)."""
    from ray import serve

    delete_applications([app for app in serve.status().applications if app == name or app.startswith(f"{name}.")],
                        wait)


def model_applications(args: dict[str, Any] | None, route_prefix: str = "/") -> list[tuple[str, str]]:
    """``(model, route prefix)`` of each dedicated model and pipeline the router application
    built from ``args`` at ``route_prefix`` serves (each its own application), then ``(POOL,
    <prefix>/v2/models)`` when it has pool models (the pool's application).

    Raises:
        AppConfigError: as ``build_app``.
    """
    try:
        _, entries, _, pool_models = _read(args)
    except (ConfigError, LoadFault) as e:
        raise AppConfigError(e.message) from None
    base = route_prefix.rstrip("/")
    out = [(e.name, f"{base}/v2/models/{e.name}") for e in entries if e.name not in pool_models]
    return out + ([(POOL, f"{base}/v2/models")] if pool_models else [])


def initial_control(app_args: AppArgs, entries: list[ModelEntry], pool_models: list[str]) -> Desired | None:
    """The build-time desired state of explicit model control (``deployments.control``); None
    with ``model_control_mode: none``.

    Raises:
        ConfigError: ``startup_models`` without explicit mode, or naming models not served.
    """
    names = [e.name for e in entries]
    if app_args.model_control_mode == "none":
        if app_args.startup_models:
            raise ConfigError("serve_config.yaml application args: startup_models: needs "
                              "model_control_mode: explicit")
        return None
    unknown = sorted(set(app_args.startup_models) - set(names) - {"*"})
    if unknown:
        raise ConfigError(f"serve_config.yaml application args: startup_models: {unknown} are not served "
                          f"models; served: {names} (or \"*\" for all)")
    loaded = set(names) if "*" in app_args.startup_models else set(app_args.startup_models)
    placements = {e.name: "pipeline" if e.config.pipeline else "pool" if e.name in pool_models else "dedicated"
                  for e in entries}
    return initial_state(placements, loaded)


def placement_options(app_args: AppArgs, pool_models: list[str]) -> dict[str, Any]:
    """The ``placement`` deployment the router application runs for a pool with ``placement:
    bytes`` (``deployments.placement``: the pool replicas find it by name), as the router's
    keyword argument; {} otherwise."""
    if app_args.pool.placement != "bytes" or not pool_models:
        return {}
    return {"placement": PlacementDeployment.options(
        name="placement", num_replicas=1, ray_actor_options={"num_cpus": 0},
        graceful_shutdown_wait_loop_s=GRACEFUL_SHUTDOWN_WAIT_LOOP_S).bind(
            uuid.uuid4().hex, metrics=app_args.metrics.model_dump())}


def control_options(initial: Desired | None) -> dict[str, Any]:
    """The ``control`` handle and ``initial`` state the router takes: {} with model control off
    (``initial`` None). The other applications' replicas find the control deployment by name
    (``client.router_application``). Each build gets its own id, which names the control
    deployment's stored state: a control replica started again finds its build's state (run-time
    loads and unloads included); a new deploy starts from ``initial``."""
    if initial is None:
        return {}
    control = ControlDeployment.options(
        name="control", num_replicas=1, ray_actor_options={"num_cpus": 0},
        graceful_shutdown_wait_loop_s=GRACEFUL_SHUTDOWN_WAIT_LOOP_S).bind(initial, uuid.uuid4().hex)
    return {"control": control, "initial": initial}
