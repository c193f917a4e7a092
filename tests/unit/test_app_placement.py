"""Placement from the app args, without starting Ray: per-model ``deployments`` overrides and
the GPU visibility of replicas that reserve no GPU."""

from __future__ import annotations

import pytest

from deployments.app import deployment_options, ray_options
from deployments.runtime.contract.config import DeploymentOptions
from deployments.runtime.contract.errors import ConfigError


def test_overrides_replace_only_the_named_fields(model_repository):
    entries = model_repository.entries()
    placement = deployment_options(entries, {"ocr_cls": {"num_replicas": 4, "num_gpus": 0.125}})
    cls = placement["ocr_cls"]
    assert (cls.mode, cls.num_replicas, cls.num_gpus) == ("dedicated", 4, 0.125)
    assert placement["ocr_det"] == model_repository.get("ocr_det").config.deployment


@pytest.mark.parametrize("overrides,fragment", [
    ({"nope": {"num_replicas": 2}}, "deployments: ['nope'] are not served models"),
    ({"ocr_cls": {"num_gpus": -1}}, "deployments.ocr_cls: num_gpus"),
    ({"ocr_cls": {"replicas": 2}}, "deployments.ocr_cls: replicas"),
])
def test_bad_overrides_name_the_model_and_field(model_repository, overrides, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        deployment_options(model_repository.entries(), overrides)


def test_a_replica_without_a_gpu_reservation_sees_no_gpu():
    options = DeploymentOptions(num_gpus=0.25)
    assert ray_options(options, use_gpus=True)["ray_actor_options"] == {"num_cpus": 0.1, "num_gpus": 0.25}
    actor = ray_options(options, use_gpus=False)["ray_actor_options"]
    assert "num_gpus" not in actor and actor["runtime_env"] == {"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}
