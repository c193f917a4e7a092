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
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray.serve import Application
from ray.serve.exceptions import RayServeException

from .ingress import Router, RouterOptions
from .model import ModelDeployment
from .pipeline import PipelineDeployment
from .pool import PoolDeployment
from .runtime.contract.config import Backend, CacheOptions, DeploymentOptions, describe_validation_error
from .runtime.contract.errors import ConfigError
from .runtime.contract.repository import ModelRepository
from .runtime.contract.units import mib_to_bytes

logger = logging.getLogger("ray.serve")

# Replicas that are not the ingress wait this long between checks for their last requests when
# stopping (Serve's default is 2 s, paid once per tier of the graph on every Ctrl-C).
GRACEFUL_SHUTDOWN_WAIT_LOOP_S = 0.2
# The router being stopped waits at most this long for its requests (Serve's default: 20 s).
# Deleting the application (what `make serve` does on Ctrl-C, deployments/run.py) stops every
# deployment at once, so a request the router accepted after that waits for a model replica that
# is gone; without this bound it held the router, and Ctrl-C, for the full 20 s. With HAProxy,
# Serve raises it to RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S + 5 s (35 s by default).
ROUTER_GRACEFUL_SHUTDOWN_TIMEOUT_S = 5.0


class AppConfigError(ConfigError, RayServeException):
    """A bad ``serve_config.yaml`` application args or model repository (one line: file, field,
    what is allowed). A ``RayServeException``, so Serve's build task does not retry it."""


class PoolOptions(DeploymentOptions, CacheOptions):
    """The multiplexed pool deployment: placement (``DeploymentOptions``) and what each replica
    keeps resident (``CacheOptions``: load policy, ``memory_budget_mib``, model count cap);
    passed whole to ``deployments.pool.PoolDeployment`` and its ``ModelCache``."""


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
    router: DeploymentOptions = DeploymentOptions(num_cpus=0.2, max_ongoing_requests=256)
    pool: PoolOptions = PoolOptions()
    models: Optional[list[str]] = None  # serve only these models (default: all in the repository)


def _cluster_has_gpus() -> bool:
    import ray

    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0


def ray_options(options: DeploymentOptions, use_gpus: bool) -> dict[str, Any]:
    """Deployment options for ``.options(...)`` from a model's (or the pool's) config."""
    actor = {"num_cpus": options.num_cpus}
    if use_gpus and options.num_gpus:
        actor["num_gpus"] = options.num_gpus
    out: dict[str, Any] = {"ray_actor_options": actor, "max_ongoing_requests": options.max_ongoing_requests,
                           "graceful_shutdown_wait_loop_s": GRACEFUL_SHUTDOWN_WAIT_LOOP_S}
    if options.autoscaling is not None:
        out["autoscaling_config"] = options.autoscaling.model_dump(exclude_none=True)
    else:
        out["num_replicas"] = options.num_replicas
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
    use_gpus = _cluster_has_gpus() if app_args.use_gpus == "auto" else app_args.use_gpus
    if not use_gpus:
        logger.info("no GPU resources in the cluster: models' num_gpus are not reserved")

    pool_models = [e.name for e in entries if e.config.deployment.mode == "pool" and not e.config.pipeline]
    pool = None
    if pool_models:
        pool = PoolDeployment.options(name="pool", **ray_options(app_args.pool, use_gpus)).bind(
            app_args.repository, pool_models, app_args.backend, app_args.pool)
    dedicated: dict[str, Any] = {}
    for e in entries:
        if e.name in pool_models or e.config.pipeline:
            continue
        dedicated[e.name] = ModelDeployment.options(
            name=f"model-{e.name}", **ray_options(e.config.deployment, use_gpus)).bind(
            app_args.repository, e.name, app_args.backend)
    steps = dict(dedicated)
    for e in entries:
        if e.config.pipeline:
            dedicated[e.name] = PipelineDeployment.options(
                name=f"pipeline-{e.name}", **ray_options(e.config.deployment, use_gpus)).bind(
                app_args.repository, e.name, steps, pool, pool_models)
    return Router.options(name="router", graceful_shutdown_timeout_s=ROUTER_GRACEFUL_SHUTDOWN_TIMEOUT_S,
                          **ray_options(app_args.router, False)).bind(
        app_args.repository, dedicated, pool, pool_models,
        RouterOptions(max_body_bytes=mib_to_bytes(app_args.max_body_mib),
                      request_timeout_s=app_args.request_timeout_s),
        models=app_args.models)
