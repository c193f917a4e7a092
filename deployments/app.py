"""``build_app(args)``: the bound Serve application that ``serve_config.yaml`` imports.

    applications:
      - name: models
        route_prefix: /
        import_path: deployments.app:build_app
        args: {repository: engines, pool: {max_num_models_per_replica: 3}}

One dedicated deployment per model whose config says ``mode: dedicated`` (pipelines included),
one multiplexed pool deployment for the rest, and the ``Router`` ingress in front.
"""

from __future__ import annotations

import logging
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray.serve import Application

from .ingress import Router, RouterOptions
from .model import ModelDeployment
from .pipeline import PipelineDeployment
from .pool import PoolDeployment
from .runtime.contract.config import Backend, CacheOptions, DeploymentOptions, describe_validation_error
from .runtime.contract.errors import ConfigError
from .runtime.contract.repository import ModelRepository

logger = logging.getLogger("ray.serve")


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
    # Per model, fields of its config's `deployment:` section to override for this cluster
    # (e.g. {ocr_cls: {num_replicas: 4, num_gpus: 0.125}}), without editing the repository.
    deployments: dict[str, dict[str, Any]] = {}


def _cluster_has_gpus() -> bool:
    import ray

    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0


def ray_options(options: DeploymentOptions, use_gpus: bool) -> dict[str, Any]:
    """Deployment options for ``.options(...)`` from a model's (or the pool's) config."""
    actor: dict[str, Any] = {"num_cpus": options.num_cpus}
    if use_gpus and options.num_gpus:
        actor["num_gpus"] = options.num_gpus
    else:
        # Ray (since 2.4x) leaves CUDA_VISIBLE_DEVICES alone for actors without GPUs, so such a
        # replica would see every GPU and `backend: auto` would run on one it never reserved.
        actor["runtime_env"] = {"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}
    out: dict[str, Any] = {"ray_actor_options": actor, "max_ongoing_requests": options.max_ongoing_requests}
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
        ConfigError: invalid args or model repository, naming the file and field.
    """
    try:
        app_args = AppArgs.model_validate(args or {})
    except ValidationError as e:
        raise ConfigError(f"serve_config.yaml application args: {describe_validation_error(e)}") from None
    entries = ModelRepository(app_args.repository, app_args.models).entries()
    placement = deployment_options(entries, app_args.deployments)
    use_gpus = _cluster_has_gpus() if app_args.use_gpus == "auto" else app_args.use_gpus
    if not use_gpus:
        logger.info("no GPU resources in the cluster: models' num_gpus are not reserved")

    pool_models = [e.name for e in entries if placement[e.name].mode == "pool" and not e.config.pipeline]
    pool = None
    if pool_models:
        pool = PoolDeployment.options(name="pool", **ray_options(app_args.pool, use_gpus)).bind(
            app_args.repository, pool_models, app_args.backend, app_args.pool)
    dedicated: dict[str, Any] = {}
    for e in entries:
        if e.name in pool_models or e.config.pipeline:
            continue
        dedicated[e.name] = ModelDeployment.options(
            name=f"model-{e.name}", **ray_options(placement[e.name], use_gpus)).bind(
            app_args.repository, e.name, app_args.backend)
    steps = dict(dedicated)
    for e in entries:
        if e.config.pipeline:
            dedicated[e.name] = PipelineDeployment.options(
                name=f"pipeline-{e.name}", **ray_options(placement[e.name], use_gpus)).bind(
                app_args.repository, e.name, steps, pool, pool_models)
    return Router.options(name="router", **ray_options(app_args.router, False)).bind(
        app_args.repository, dedicated, pool, pool_models,
        RouterOptions(max_body_bytes=int(app_args.max_body_mib * (1 << 20)),
                      request_timeout_s=app_args.request_timeout_s, backend=app_args.backend),
        models=app_args.models)
