"""``build_app(args)``: the bound Serve application that ``serve_config.yaml`` imports.

    applications:
      - name: models
        route_prefix: /
        import_path: deployments.app:build_app
        args: {repository: engines, pool: {max_num_models_per_replica: 3}}

One dedicated deployment per model whose config says ``mode: dedicated`` (pipelines included),
one multiplexed pool deployment for the rest, and the ``Router`` ingress in front.

A bad config raises ``AppConfigError``, a ``RayServeException``: Serve's build task reports it
as the application's DEPLOY_FAILED message at once instead of retrying the build (it retries
other exceptions three times). ``serve run serve_config.yaml`` keeps waiting after a failed
deploy, so ``make serve`` first runs ``python -m deployments.check`` (the same checks, before
Ray starts), which prints the one line and exits non-zero.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Iterable, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray.serve import Application
from ray.serve.exceptions import RayServeException

from .control import ControlDeployment, initial_state
from .ingress import Router, RouterOptions
from .model import ModelDeployment
from .pipeline import PipelineDeployment
from .observe.options import MetricsOptions
from .pool import PoolDeployment
from .runtime.contract.config import Backend, CacheOptions, DeploymentOptions, describe_validation_error
from .runtime.contract.errors import ConfigError
from .runtime.contract.repository import ModelEntry, ModelRepository
from .runtime.contract.units import mib_to_bytes

logger = logging.getLogger("ray.serve")

# Seconds a shed request is told to wait (``Retry-After`` of its 503).
RETRY_AFTER_S = 1.0

# Replicas whose deployment handles call other deployments (router, pipelines) retry a full
# replica every 25 ms, 50 ms, then every 50 ms, not up to Ray's default 0.5 s: a retry that
# sleeps longer than the replica takes to drain its queue leaves it idle (bench/README.md,
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
# deployment stopped (``RouterApp.stop_waiting``); this bound is the backstop. With HAProxy,
# Serve raises the router's to RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S + 5 s (35 s by default).
ROUTER_GRACEFUL_SHUTDOWN_TIMEOUT_S = 5.0


class AppConfigError(ConfigError, RayServeException):
    """A bad ``serve_config.yaml`` application args or model repository (one line: file, field,
    what is allowed). A ``RayServeException``, so Serve's build task does not retry it."""


class PoolOptions(DeploymentOptions, CacheOptions):
    """The multiplexed pool deployment: placement (``DeploymentOptions``) and what each replica
    keeps resident (``CacheOptions``: load policy, ``memory_budget_mib``, model count cap);
    passed whole to ``deployments.pool.PoolDeployment`` and its ``ModelCache``.

    ``max_queued_requests`` defaults to 512, not a dedicated model's 128: a multiplexed request
    waits in the router's handle until Ray has routed it to a replica holding its model, and at
    256 clients that wait alone held more than 128 while the replica had room for 512 (H200,
    tiny_cnn: 116-186 of ~1,600 requests shed with 128, none with 1024 at the same QPS;
    bench/README.md, "Overload on the GPU"). 512 holds every request of 512 clients, and with
    the replica's 512 stays within the router's 1024, so the pool's handle, not the router,
    is what sheds (with this app's error body)."""

    max_queued_requests: int = Field(512, ge=-1)


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
    request_timeout_s: float = Field(60.0, gt=0)
    # The router only decodes and awaits model calls: it takes every request the models' queues
    # can hold, so that shedding happens at the model handles, with this app's error body.
    router: DeploymentOptions = DeploymentOptions(num_cpus=0.2, max_ongoing_requests=1024, max_queued_requests=1024)
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


def _cluster_has_gpus() -> bool:
    import ray

    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0


def cores() -> int:
    """CPU cores this process may run on (the node building the app)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


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
    except ConfigError as e:
        raise AppConfigError(e.message) from None


def _build(args: dict[str, Any] | None) -> Application:
    try:
        app_args = AppArgs.model_validate(args or {})
    except ValidationError as e:
        raise ConfigError(f"serve_config.yaml application args: {describe_validation_error(e, AppArgs)}") from None
    entries = ModelRepository(app_args.repository, app_args.models).entries()
    placement = deployment_options(entries, app_args.deployments)
    use_gpus = _cluster_has_gpus() if app_args.use_gpus == "auto" else app_args.use_gpus
    if not use_gpus:
        logger.info("no GPU resources in the cluster: models' num_gpus are not reserved")

    threads = intra_op_threads(cores(), app_args, entries)
    env = {"ORT_INTRA_OP_THREADS": str(threads), **HANDLE_ENV}
    logger.info("ONNX Runtime: %d intra-op thread(s) per execution context on %d cores", threads, cores())

    metrics = app_args.metrics.model_dump()
    pool_models = [e.name for e in entries if placement[e.name].mode == "pool" and not e.config.pipeline]
    control = control_options(app_args, entries, pool_models)
    pool = None
    if pool_models:
        pool = PoolDeployment.options(name="pool", **ray_options(app_args.pool, use_gpus, env)).bind(
            app_args.repository, pool_models, app_args.backend, app_args.pool, metrics=metrics, **control)
    dedicated: dict[str, Any] = {}
    for e in entries:
        if e.name in pool_models or e.config.pipeline:
            continue
        dedicated[e.name] = ModelDeployment.options(
            name=f"model-{e.name}", **ray_options(placement[e.name], use_gpus, env)).bind(
            app_args.repository, e.name, app_args.backend, metrics=metrics, **control)
    steps = dict(dedicated)
    for e in entries:
        if e.config.pipeline:
            dedicated[e.name] = PipelineDeployment.options(
                name=f"pipeline-{e.name}", graceful_shutdown_timeout_s=ROUTER_GRACEFUL_SHUTDOWN_TIMEOUT_S,
                **ray_options(placement[e.name], use_gpus, HANDLE_ENV)).bind(
                app_args.repository, e.name, steps, pool, pool_models, metrics=metrics)
    return Router.options(name="router", graceful_shutdown_timeout_s=ROUTER_GRACEFUL_SHUTDOWN_TIMEOUT_S,
                          **ray_options(app_args.router, False, HANDLE_ENV)).bind(
        app_args.repository, dedicated, pool, pool_models,
        RouterOptions(max_body_bytes=mib_to_bytes(app_args.max_body_mib),
                      request_timeout_s=app_args.request_timeout_s),
        models=app_args.models, metrics=metrics, **control)


def control_options(app_args: AppArgs, entries: list[ModelEntry], pool_models: list[str]) -> dict[str, Any]:
    """The ``control`` handle and ``initial`` state the router and model deployments take
    (``deployments.control``); {} with ``model_control_mode: none``.

    Raises:
        ConfigError: ``startup_models`` without explicit mode, or naming models not served.
    """
    names = [e.name for e in entries]
    if app_args.model_control_mode == "none":
        if app_args.startup_models:
            raise ConfigError("serve_config.yaml application args: startup_models: needs "
                              "model_control_mode: explicit")
        return {}
    unknown = sorted(set(app_args.startup_models) - set(names) - {"*"})
    if unknown:
        raise ConfigError(f"serve_config.yaml application args: startup_models: {unknown} are not served "
                          f"models; served: {names} (or \"*\" for all)")
    loaded = set(names) if "*" in app_args.startup_models else set(app_args.startup_models)
    placements = {e.name: "pipeline" if e.config.pipeline else "pool" if e.name in pool_models else "dedicated"
                  for e in entries}
    initial = initial_state(placements, loaded)
    control = ControlDeployment.options(
        name="control", num_replicas=1, ray_actor_options={"num_cpus": 0},
        graceful_shutdown_wait_loop_s=GRACEFUL_SHUTDOWN_WAIT_LOOP_S).bind(initial)
    return {"control": control, "initial": initial}
