"""Defaults that fit the machine: ONNX Runtime threads from the cores and the app's contexts."""

from __future__ import annotations

from pathlib import Path

import pytest

from deployments.app import AppArgs, execution_contexts, intra_op_threads, ray_options
from deployments.runtime.contract.repository import ModelRepository

REPOSITORY = str(Path(__file__).resolve().parents[2] / "engines")


def test_contexts_count_dedicated_replicas_and_the_pool_s_largest_models():
    args = AppArgs(repository=REPOSITORY, pool={"max_num_models_per_replica": 2, "num_replicas": 3})
    entries = ModelRepository(REPOSITORY).entries()
    # ocr_det, ocr_cls, ocr_rec, all-MiniLM-L6-v2: 1 replica x 1 instance; pool: 3 replicas x (2 + 2) instances
    assert execution_contexts(args, entries) == 4 + 3 * 4


@pytest.mark.parametrize("cores,threads", [(2, 1), (16, 1), (64, 6)])
def test_threads_share_the_cores_among_every_context(cores, threads, monkeypatch):
    monkeypatch.delenv("ORT_INTRA_OP_THREADS", raising=False)
    args = AppArgs(repository=REPOSITORY)  # 4 dedicated contexts + the pool's 3 models x 2 = 10
    assert intra_op_threads(cores, args, ModelRepository(REPOSITORY).entries()) == threads


def test_an_explicit_thread_count_wins(monkeypatch):
    monkeypatch.setenv("ORT_INTRA_OP_THREADS", "3")
    assert intra_op_threads(2, AppArgs(repository=REPOSITORY), ModelRepository(REPOSITORY).entries()) == 3


def test_deployments_get_bounded_queues_with_retry_after():
    options = ray_options(AppArgs().pool, use_gpus=False, env={"ORT_INTRA_OP_THREADS": "1"})
    assert options["max_ongoing_requests"] == 512 and options["max_queued_requests"] == 512
    dedicated = ray_options(ModelRepository(REPOSITORY).get("ocr_cls").config.deployment, use_gpus=False)
    assert dedicated["max_ongoing_requests"] == 512 and dedicated["max_queued_requests"] == 128
    assert options["backpressure_config"] == {"retry_after_s": 1.0}
    assert options["ray_actor_options"]["runtime_env"] == {
        "env_vars": {"ORT_INTRA_OP_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}}  # no GPU reserved: none visible


def test_router_replicas_autoscale_by_default_from_one_to_half_the_cores():
    from deployments.app import ROUTER_AUTOSCALING, cores, router_max_replicas

    options = ray_options(AppArgs().router, use_gpus=False)
    assert "num_replicas" not in options
    assert options["autoscaling_config"] == ROUTER_AUTOSCALING.model_dump(exclude_none=True)
    assert options["autoscaling_config"]["min_replicas"] == 1
    assert options["autoscaling_config"]["max_replicas"] == router_max_replicas(cores())
    assert (options["max_ongoing_requests"], options["max_queued_requests"]) == (1024, 1024)
    assert options["ray_actor_options"]["num_cpus"] == 0.2


def test_a_router_replica_count_is_fixed_and_keeps_the_routers_other_defaults():
    router = AppArgs(router={"num_replicas": 3}).router
    assert router.autoscaling is None and router.num_replicas == 3
    assert (router.num_cpus, router.max_ongoing_requests, router.max_queued_requests) == (0.2, 1024, 1024)
    assert ray_options(router, use_gpus=False)["num_replicas"] == 3
    assert AppArgs(router={"autoscaling": None}).router.autoscaling is None


def test_router_autoscaling_fields_given_go_over_the_routers_defaults():
    from deployments.app import ROUTER_AUTOSCALING

    scaling = AppArgs(router={"autoscaling": {"max_replicas": 8, "upscale_delay_s": 1}}).router.autoscaling
    assert (scaling.max_replicas, scaling.upscale_delay_s) == (8, 1)
    assert scaling.target_ongoing_requests == ROUTER_AUTOSCALING.target_ongoing_requests
    assert scaling.downscale_delay_s == ROUTER_AUTOSCALING.downscale_delay_s


@pytest.mark.parametrize("router,message", [
    ({"num_replicas": 2, "autoscaling": {"max_replicas": 3}}, "router: Value error, give num_replicas"),
    ({"autoscaling": {"min_replicas": 9}}, "router.autoscaling: Value error, need min_replicas"),
])
def test_a_bad_router_section_names_its_field(router, message):
    from deployments.app import AppConfigError, build_app

    with pytest.raises(AppConfigError, match=message):
        build_app({"repository": REPOSITORY, "router": router})


@pytest.mark.parametrize("cores,replicas", [(1, 1), (2, 1), (4, 2), (16, 8), (64, 8)])
def test_the_router_may_grow_to_half_the_cores_at_most_8(cores, replicas):
    from deployments.app import router_max_replicas

    assert router_max_replicas(cores) == replicas


@pytest.mark.parametrize("path", ["serve_config.yaml", "serve_config.gpu.yaml", "cluster/rayservice.yaml"])
def test_every_shipped_config_gives_the_router_its_autoscaling_default(path):
    import yaml

    raw = yaml.safe_load((Path(REPOSITORY).parent / path).read_text())
    if raw.get("kind") == "RayService":
        raw = yaml.safe_load(raw["spec"]["serveConfigV2"])
    [router] = [app for app in raw["applications"] if "model" not in app["args"]]
    assert AppArgs.model_validate(router["args"]).router == AppArgs().router
