"""cluster/ manifests and serve_config.yaml, validated offline with Ray's own schemas and code.

- ``serve_config.yaml`` and the RayService's ``serveConfigV2``: ``ray.serve.schema.ServeDeploySchema``
  (what ``serve deploy`` and KubeRay submit to), and the application args build with our
  ``build_app`` against the real ``engines/`` (Ray's own application builder then lists the
  deployments and their options, as ``serve run`` would).
- ``cluster/rayservice.yaml``: KubeRay's CRD schema is not shipped by any PyPI package, so the
  fields KubeRay requires are checked here, and the ``rayClusterConfig`` goes through the code
  the Ray autoscaler runs on KubeRay to read a RayCluster spec (it derives each group's Ray
  resources and validates the result against ``ray-schema.json``).
- ``cluster/cluster.yaml``: ``ray-schema.json`` with jsonschema, then the offline steps of
  ``ray up`` (``prepare_config`` fills the AWS defaults, ``validate_config``).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml
from ray.serve.config import ProxyLocation
from ray.serve.schema import ServeDeploySchema

ROOT = Path(__file__).resolve().parents[2]
SERVE_CONFIG = ROOT / "serve_config.yaml"
RAYSERVICE = ROOT / "cluster" / "rayservice.yaml"
DASHBOARD = ROOT / "cluster" / "grafana-dashboard.json"
CLUSTER = ROOT / "cluster" / "cluster.yaml"
IMAGE_REPOSITORY = "/app/engines"  # where the project image holds the model repository
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def _load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def _built_deployments(args: dict[str, Any]) -> dict[str, Any]:
    """Deployment name -> Ray ``Deployment`` of our application, built as ``serve run`` does."""
    from ray.serve._private.build_app import build_app as serve_build_app

    from deployments.app import applications

    return {d.name: d for name, _, app in applications(args) for d in serve_build_app(app, name=name).deployments}


def _gpu_models() -> dict[str, float]:
    from deployments.runtime.contract.repository import ModelRepository

    return {f"model-{e.name}": e.config.deployment.num_gpus for e in ModelRepository(ROOT / "engines").entries()
            if e.config.deployment.mode == "dedicated" and e.config.deployment.num_gpus}


# serve_config.yaml ---------------------------------------------------------------------------

def test_serve_config_parses_with_rays_schema_puts_a_proxy_on_every_node_and_builds(prepared_engines):
    schema = ServeDeploySchema.model_validate(_load(SERVE_CONFIG))
    assert schema.proxy_location == ProxyLocation.EveryNode
    app, *models = schema.applications
    assert app.import_path == "deployments.app:build_app" and app.route_prefix == "/"
    # each dedicated model and pipeline in an application of its own, with the router's args;
    # the pool models' application at /v2/models
    assert [(m.name, m.route_prefix, m.args) for m in models] == [
        (f"models.{name}", f"/v2/models/{name}", {**app.args, "model": name})
        for name in ("all-MiniLM-L6-v2", "embed", "ocr", "ocr_cls", "ocr_det", "ocr_rec")
    ] + [("models.pool", "/v2/models", {**app.args, "model": "pool"})]
    args = dict(app.args, repository=str(ROOT / app.args["repository"]))
    deployments = _built_deployments(args)
    assert {"router", "pool", "pipeline-ocr", "model-ocr_cls", "model-ocr_det", "model-ocr_rec"} <= set(deployments)


# cluster/rayservice.yaml ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def rayservice() -> dict[str, Any]:
    return _load(RAYSERVICE)


def test_rayservice_has_the_fields_kuberay_requires(rayservice):
    assert rayservice["apiVersion"] == "ray.io/v1" and rayservice["kind"] == "RayService"
    assert DNS_LABEL.match(rayservice["metadata"]["name"]) and len(rayservice["metadata"]["name"]) <= 40
    spec = rayservice["spec"]
    assert isinstance(spec["serveConfigV2"], str), "serveConfigV2 is a YAML string"
    cluster = spec["rayClusterConfig"]
    assert cluster["rayVersion"] == ray.__version__
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        # rayStartParams: required before KubeRay 1.4; a map of strings (the CRD's type).
        assert all(isinstance(v, str) for v in group["rayStartParams"].values()), group["rayStartParams"]
        containers = group["template"]["spec"]["containers"]
        assert containers and all(DNS_LABEL.match(c["name"]) and c["image"] for c in containers)
    names = [g["groupName"] for g in cluster["workerGroupSpecs"]]
    assert len(set(names)) == len(names) and all(DNS_LABEL.match(n) for n in names)
    for group in cluster["workerGroupSpecs"]:
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    images = {c["image"] for g in groups for c in g["template"]["spec"]["containers"]}
    assert len(images) == 1, f"head and workers must run the same project image, got {images}"
    head_ports = {p["name"]: p["containerPort"] for p in
                  cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]}
    assert head_ports["serve"] == 8000 and head_ports["dashboard"] == 8265 and head_ports["gcs-server"] == 6379


def test_rayservice_gpu_workers_advertise_the_gpus_their_pods_request(rayservice):
    gpu_groups = [g for g in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
                  if "num-gpus" in g["rayStartParams"]]
    assert gpu_groups, "a worker group with GPUs"
    for group in gpu_groups:
        resources = group["template"]["spec"]["containers"][0]["resources"]
        gpus = resources["limits"]["nvidia.com/gpu"]
        assert int(gpus) >= 1 and group["rayStartParams"]["num-gpus"] == str(gpus)
        # Kubernetes requires extended resources' requests (when given) to equal their limits.
        assert resources.get("requests", {}).get("nvidia.com/gpu", gpus) == gpus


def test_rayservice_cluster_reads_as_ray_autoscaler_on_kuberay_reads_it(rayservice):
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

    cluster = rayservice["spec"]["rayClusterConfig"]
    ray_cluster = {"metadata": {"name": rayservice["metadata"]["name"], "namespace": "default"},
                   "spec": copy.deepcopy(cluster)}
    config = _derive_autoscaling_config_from_ray_cr(ray_cluster)  # validates with ray-schema.json
    types = config["available_node_types"]
    head = types.pop("headgroup")
    assert head["resources"]["CPU"] == int(cluster["headGroupSpec"]["rayStartParams"]["num-cpus"])
    assert "GPU" not in head["resources"], "GPU models belong on the GPU workers"
    [(name, gpu)] = types.items()
    group = cluster["workerGroupSpecs"][0]
    assert name == group["groupName"] and gpu["resources"]["GPU"] == 1
    assert (gpu["min_workers"], gpu["max_workers"]) == (group["minReplicas"], group["maxReplicas"])
    assert cluster["enableInTreeAutoscaling"] is True


def test_rayservice_serves_the_application_of_serve_config_yaml_with_gpus_reserved(rayservice, prepared_engines):
    schema = ServeDeploySchema.model_validate(yaml.safe_load(rayservice["spec"]["serveConfigV2"]))
    assert schema.proxy_location == ProxyLocation.EveryNode
    assert (schema.http_options.host, schema.http_options.port) == ("0.0.0.0", 8000)
    local = _load(SERVE_CONFIG)["applications"]
    embedded = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"]
    expected = copy.deepcopy(local)
    for app in expected:
        app["args"].update(repository=IMAGE_REPOSITORY, use_gpus=True)
        if "model" in app["args"]:  # no HAProxy on the cluster: the router answers the models' routes
            app["route_prefix"] = None
    assert embedded == expected, "cluster/rayservice.yaml's applications drifted from serve_config.yaml"

    app = schema.applications[0]  # the router application (the models' take its args)
    deployments = _built_deployments(dict(app.args, repository=str(ROOT / "engines")))
    gpu_models = _gpu_models()
    assert gpu_models, "the repository has dedicated GPU models"
    for name, num_gpus in gpu_models.items():
        assert deployments[name].ray_actor_options["num_gpus"] == num_gpus
    assert deployments["pool"].ray_actor_options["num_gpus"] == app.args["pool"]["num_gpus"] == 0.25
    assert sum(gpu_models.values()) + 0.25 <= 1.0, "the models and the pool fit one GPU"
    assert "num_gpus" not in deployments["router"].ray_actor_options


def test_rayservice_pods_are_scraped_on_the_metrics_port_the_app_serves(rayservice):
    from deployments.app import AppArgs

    app = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"][0]
    port = AppArgs.model_validate(app["args"]).metrics.port
    cluster = rayservice["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        template = group["template"]
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
        assert annotations["prometheus.io/port"] == str(port)
        ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
        assert ports["metrics"] == port


# cluster/grafana-dashboard.json --------------------------------------------------------------

def test_dashboard_queries_name_only_series_we_export():
    from deployments.observe.metrics import exported_series

    exported = exported_series()
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queries += [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    assert len(queries) >= 8
    named = set()
    for query in queries:
        series = set(re.findall(r"\b(?:nv|trt_serve)_[a-z0-9_]+", query))
        assert series, f"query names none of our series: {query}"
        named |= series
    assert named <= set(exported), f"not exported: {sorted(named - set(exported))}"
    # The panels: QPS, percentiles, queue vs compute, batch sizes, cache, GPU memory;
    # the placement's (issue 31): models per replica, copies, placed bytes against budget.
    for needed in ("nv_inference_request_success", "trt_serve_request_duration_seconds_bucket",
                   "nv_inference_queue_duration_us", "nv_inference_compute_infer_duration_us",
                   "nv_inference_exec_count", "trt_serve_cache_resident_bytes",
                   "trt_serve_cache_evictions_total", "nv_gpu_memory_used_bytes",
                   "trt_serve_placement_placed", "trt_serve_placement_copies",
                   "trt_serve_placement_replica_bytes", "trt_serve_cache_budget_bytes"):
        assert needed in named, needed


def _containers(cluster: dict[str, Any]) -> list[dict[str, Any]]:
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


def test_rayservice_exposes_nothing_outside_the_cluster_and_turns_on_rays_token_auth(rayservice):
    """Threat model (docs/security.md, "On a cluster"): KubeRay's Services stay ClusterIP with no Ingress (the dashboard
    and Jobs API are not reachable from outside), no pod port on its node's network, and Ray's
    token authentication on (KubeRay's authOptions, Ray 2.52+)."""
    spec = rayservice["spec"]
    cluster = spec["rayClusterConfig"]
    assert cluster["authOptions"] == {"mode": "token"}
    assert tuple(int(x) for x in cluster["rayVersion"].split(".")[:2]) >= (2, 52), "token auth needs Ray 2.52+"
    head = cluster["headGroupSpec"]
    assert head.get("serviceType", "ClusterIP") == "ClusterIP" and not head.get("enableIngress", False)
    assert spec.get("serveService", {}).get("spec", {}).get("type", "ClusterIP") == "ClusterIP"
    groups = [head, *cluster["workerGroupSpecs"]]
    for group in groups:
        pod = group["template"]["spec"]
        assert not pod.get("hostNetwork", False)
    for container in _containers(cluster):
        assert all("hostPort" not in port for port in container.get("ports", []))
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert env.get("RAY_AUTH_MODE", "token") == "token", "authOptions sets it; nothing may turn it off"
    assert yaml.safe_load(spec["serveConfigV2"])["http_options"]["port"] == 8000  # the one port for clients


# cluster/cluster.yaml ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def launcher() -> dict[str, Any]:
    return _load(CLUSTER)


def test_cluster_launcher_config_passes_rays_schema_and_ray_up_offline_checks(launcher):
    import jsonschema
    import ray.autoscaler
    from ray.autoscaler._private.util import prepare_config, validate_config

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(launcher, schema)
    prepared = prepare_config(copy.deepcopy(launcher))  # what `ray up` does before the cloud calls
    validate_config(prepared)
    types = prepared["available_node_types"]
    head = types[prepared["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0
    gpu_types = {n: t for n, t in types.items() if t["resources"].get("GPU")}
    assert gpu_types and all(t["min_workers"] >= 1 for t in gpu_types.values())
    assert sum(t["max_workers"] for t in gpu_types.values()) <= prepared["max_workers"]


def test_cluster_launcher_installs_the_project_on_every_node(launcher):
    from ray.autoscaler._private.util import prepare_config

    prepared = prepare_config(copy.deepcopy(launcher))
    assert launcher["file_mounts"]["~/trt-serve"] == ".", "the checkout (run `ray up` from the repo root)"
    assert ".venv" in launcher["rsync_exclude"]
    workers = [n for n in prepared["available_node_types"] if n != prepared["head_node_type"]]
    # A node type's own worker_setup_commands replace the merged global lists: check what runs.
    effective = {"head": prepared["head_setup_commands"],
                 **{n: prepared["available_node_types"][n].get("worker_setup_commands",
                                                               prepared["worker_setup_commands"])
                    for n in workers}}
    for node, commands in effective.items():
        assert "pip install -q -e ~/trt-serve" in commands, node
        assert any("deployments.runtime.tools.prepare" in c for c in commands), node
    for command in launcher["head_start_ray_commands"] + launcher["worker_start_ray_commands"]:
        if "ray start" in command:
            assert command.startswith("cd ~/trt-serve &&"), "relative `repository: engines` resolves there"
    image = launcher["docker"]["image"]
    assert image.startswith(f"rayproject/ray:{ray.__version__}-") and image.endswith("-gpu")


def test_cluster_launcher_keeps_the_dashboard_on_loopback_and_turns_on_rays_token_auth(launcher):
    """Threat model (docs/security.md, "On a cluster"): no `ray start` binds the dashboard (and its Jobs API) beyond the
    head's 127.0.0.1, and every container runs with RAY_AUTH_MODE=token and the same token."""
    starts = [c for c in launcher["head_start_ray_commands"] + launcher["worker_start_ray_commands"]
              if "ray start" in c]
    assert starts
    for command in starts:
        assert "--dashboard-host" not in command or "--dashboard-host=127.0.0.1" in command, command
        assert "0.0.0.0" not in command, command
    assert "--env RAY_AUTH_MODE=token" in launcher["docker"]["run_options"]
    assert launcher["file_mounts"].get("~/.ray/auth_token") == "~/.ray/auth_token"


# Dockerfile ----------------------------------------------------------------------------------

DOCKERFILE = ROOT / "Dockerfile"


def _dockerfile() -> dict[str, list[str]]:
    """Instruction -> its arguments, in order (comments and continuation-free lines only)."""
    out: dict[str, list[str]] = {}
    for line in DOCKERFILE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            instruction, _, rest = line.strip().partition(" ")
            out.setdefault(instruction.upper(), []).append(rest.strip())
    return out


def _pyproject() -> dict[str, Any]:
    """``version`` and ``dependencies`` of pyproject.toml's [project] (tomllib is 3.11+)."""
    text = (ROOT / "pyproject.toml").read_text()
    version = re.search(r'^version = "([^"]+)"', text, re.M).group(1)
    deps = re.search(r"^dependencies = \[(.*?)^\]", text, re.M | re.S).group(1)
    return {"version": version, "dependencies": re.findall(r'"([^"]+)"', deps)}


def test_the_image_recipe_builds_on_the_ray_image_of_the_pinned_ray(launcher):
    [base] = _dockerfile()["FROM"]
    pins = [d for d in _pyproject()["dependencies"] if d.startswith("ray[")]
    assert pins == [f"ray[serve]=={ray.__version__}"], "pyproject.toml pins the Ray the tests run"
    assert base == f"rayproject/ray:{ray.__version__}-py311-gpu"
    assert launcher["docker"]["image"] == base, "cluster.yaml's nodes run the same base image"


def test_the_image_recipe_installs_the_project_and_prepares_the_repository_the_rayservice_serves(
        rayservice, launcher):
    steps = _dockerfile()
    [workdir] = steps["WORKDIR"]
    assert IMAGE_REPOSITORY == f"{workdir}/engines"
    assert f"pip install --no-cache-dir {workdir}" in steps["RUN"]
    # `make models` with the image's repository (the Makefile's command, its root moved).
    makefile_models = next(line.strip() for line in (ROOT / "Makefile").read_text().splitlines()
                           if "tools.prepare --root engines" in line)
    assert makefile_models.replace("$(PY)", "python").replace("--root engines", f"--root {IMAGE_REPOSITORY}") \
        in steps["RUN"]
    # cluster.yaml's setup commands are the same two steps on its own checkout.
    assert any("deployments.runtime.tools.prepare --root engines" in c for c in launcher["setup_commands"])
    cluster = rayservice["spec"]["rayClusterConfig"]
    containers = [c for g in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
                  for c in g["template"]["spec"]["containers"]]
    assert {c["workingDir"] for c in containers} == {workdir}
    version = _pyproject()["version"]
    assert {c["image"] for c in containers} == {f"trt-serve:{version}"}
    assert f"docker build -t trt-serve:{version} ." in DOCKERFILE.read_text()
    assert "../Dockerfile" in RAYSERVICE.read_text() and "../Dockerfile" in CLUSTER.read_text()


def test_the_image_build_context_leaves_out_local_models_and_the_venv():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git", "engines/*/[0-9]*/", "engines/.cache"} <= set(ignored)
