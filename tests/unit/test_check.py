"""`make serve`'s start: a bad config stops before Ray with one line; Ray's CLI gets the auth mode;
Ctrl-C does not wait out a load-balancer drain; the builder's config errors are not retried."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ray.serve.exceptions import RayServeException

from deployments.app import AppConfigError, build_app
from deployments.runtime.contract.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def repository(prepared_engines, tmp_path) -> Path:
    """A copy of two models of the real repository (ONNX files linked)."""
    root = tmp_path / "engines"
    for name in ("tiny_cnn", "mid_cnn"):
        (root / name / "1").mkdir(parents=True)
        shutil.copy(prepared_engines / name / "config.yaml", root / name / "config.yaml")
        (root / name / "1" / "model.onnx").symlink_to(prepared_engines / name / "1" / "model.onnx")
    return root


def serve_config(tmp_path: Path, repository: Path, **args) -> Path:
    """serve_config.yaml's router application over ``repository`` (its models are pool models:
    no model application belongs beside it)."""
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config["applications"] = config["applications"][:1]
    config["applications"][0]["args"].update(repository=str(repository), **args)
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run_check(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deployments.check", str(path)], capture_output=True, text=True,
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)


def test_serve_config_yaml_lists_the_application_of_every_dedicated_model_of_engines(prepared_engines):
    result = run_check(ROOT / "serve_config.yaml")
    assert result.returncode == 0, result.stderr
    names = [app["name"] for app in yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"]]
    assert names == ["models", "models.all-MiniLM-L6-v2", "models.embed", "models.ocr", "models.ocr_cls",
                     "models.ocr_det", "models.ocr_rec", "models.pool"]


def test_a_model_made_dedicated_is_named_missing_until_write_adds_its_application(repository, tmp_path):
    from deployments.check import WRITTEN_MARK

    path = tmp_path / "serve_config.yaml"  # the shipped file's router application, over ``repository``
    path.write_text((ROOT / "serve_config.yaml").read_text().split(WRITTEN_MARK)[0].replace(
        "repository: engines", f"repository: {repository}"))
    config_path = repository / "mid_cnn" / "config.yaml"
    config_path.write_text(config_path.read_text().replace("mode: pool", "mode: dedicated"))
    result = run_check(path)
    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert line.startswith(f"config error: {path}: applications: ") and "missing: ['models.mid_cnn', 'models.pool']" in line
    assert f"python -m deployments.check --write {path}" in line
    written = subprocess.run([sys.executable, "-m", "deployments.check", "--write", str(path)], capture_output=True,
                             text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert written.returncode == 0, written.stderr
    assert written.stdout.splitlines()[0] == f"{path}: wrote 2 model applications ['models.mid_cnn', 'models.pool']"
    apps = yaml.safe_load(path.read_text())["applications"]
    assert [(a["name"], a["route_prefix"]) for a in apps] == [("models", "/"), ("models.mid_cnn", "/v2/models/mid_cnn"),
                                                              ("models.pool", "/v2/models")]
    assert apps[1]["args"] == {**apps[0]["args"], "model": "mid_cnn"}
    assert "args: {<<: *models, model: mid_cnn}" in path.read_text()
    config_path.write_text(config_path.read_text().replace("mode: dedicated", "mode: pool"))  # and back
    result = run_check(path)
    assert result.returncode == 2 and "not dedicated models of the repository: ['models.mid_cnn']" in result.stderr


def test_a_misspelled_model_field_exits_2_with_one_line_naming_file_field_and_allowed(repository, tmp_path):
    config_path = repository / "tiny_cnn" / "config.yaml"
    config_path.write_text(config_path.read_text().replace("max_batch_size:", "max_batch_sise:"))
    result = run_check(serve_config(tmp_path, repository))
    assert result.returncode == 2 and result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith(f"config error: {config_path}: max_batch_sise: ")
    assert "unknown field" in line and "max_batch_size" in line.split("allowed:")[1], line


@pytest.mark.parametrize("which", ["model", "serve"])
def test_a_yaml_syntax_error_exits_2_with_one_line_naming_the_files_line_and_column(repository, tmp_path, which):
    """A model's config.yaml and serve_config.yaml alike (PyYAML's detail said ``"<unicode string>", line 1``)."""
    served = serve_config(tmp_path, repository)
    path = repository / "tiny_cnn" / "config.yaml" if which == "model" else served
    path.write_text(path.read_text() + "oops: [1\n")
    lines = path.read_text().count("\n")
    result = run_check(served)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [f"config error: {path}:{lines + 1}:1: cannot read YAML: expected ',' or "
                                          f"']', but got '<stream end>' (while parsing a flow sequence at line {lines})"]


def test_a_datatype_the_model_file_contradicts_exits_2_naming_config_field_and_model_file(repository, tmp_path):
    # Seen by a tester: a datatype other than the ONNX file's passed the check; every request got 500.
    config_path = repository / "tiny_cnn" / "config.yaml"
    config_path.write_text(config_path.read_text().replace("datatype: FP32", "datatype: FP16", 1))
    result = run_check(serve_config(tmp_path, repository))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        f"config error: {config_path}: inputs.0.datatype: FP16, but {repository / 'tiny_cnn' / '1' / 'model.onnx'} "
        "has input 'input' as FP32: the datatype must be the file's"]


def test_a_folder_with_only_a_model_file_passes_and_the_check_shows_its_completed_config(repository, tmp_path):
    from deployments.check import write

    (repository / "tiny_cnn" / "config.yaml").unlink()
    path = serve_config(tmp_path, repository)
    write(path)
    result = run_check(path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[1:] == [
        f"  tiny_cnn: completed from {repository / 'tiny_cnn' / '1' / 'model.onnx'}: {{max_batch_size: 4, inputs: "
        "[{name: input, datatype: FP32, dims: [-1, 3, 224, 224], profile: {min: [1, 3, 224, 224], opt: [4, 3, 224, "
        "224], max: [4, 3, 224, 224]}}], outputs: [{name: logits, datatype: FP32, dims: [-1, 1000]}]}"]


@pytest.mark.parametrize("name, message", [
    ("nc_garbage", "model 'nc_garbage': its model file nc_garbage/1/model.onnx is not a valid ONNX model: it does not "
                   "parse as one (damaged, truncated or another format)"),
    ("nc_custom_op", "model 'nc_custom_op': its model file nc_custom_op/1/model.onnx uses operator 'Frobnicate' of "
                     "domain 'com.example', which ONNX Runtime does not implement (custom operators and domains are "
                     "not supported); export the model with standard ONNX operators"),
])
def test_a_model_file_the_server_cannot_serve_exits_2_naming_it_and_no_config_yaml(repository, tmp_path, name, message):
    """Seen: random bytes were reported as ".../config.yaml: max_batch_size, inputs, outputs: left
    out, and ..." (there was no config.yaml); a custom-domain operator passed the check and failed
    at every load."""
    from tests.newcomer_models import write_model

    write_model(repository, name)
    result = run_check(serve_config(tmp_path, repository))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [f"config error: {message}"]


def test_a_bad_application_arg_exits_2_naming_the_field_and_the_choices(repository, tmp_path):
    path = serve_config(tmp_path, repository, pool={"load_policy": "fifo"})
    result = run_check(path)
    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert line.startswith(f"config error: {path} application args: pool.load_policy: ")
    assert "'eager', 'lazy' or 'lru'" in line


def test_a_good_config_prints_its_models_and_url(repository, tmp_path):
    from deployments.check import write

    path = serve_config(tmp_path, repository)
    result = run_check(path)
    assert result.returncode == 2 and "missing: ['models.pool']" in result.stderr  # the pool models' application
    write(path)
    result = run_check(path)
    assert result.returncode == 0, result.stderr
    assert "2 models ['mid_cnn', 'tiny_cnn']" in result.stdout and "http://127.0.0.1:8000/v2" in result.stdout


def test_a_dedicated_model_whose_name_clients_encode_is_a_config_error_and_a_pool_model_may_have_it(repository):
    """A dedicated model's name is its route prefix; tritonclient sends ``a@b`` as ``a%40b``,
    which no ingress matches against the prefix ``/v2/models/a@b``: refused at build, naming the
    folder and what is allowed. A pool model's name is matched by the pool's own routes."""
    (repository / "tiny_cnn").rename(repository / "tiny@cnn")
    config = repository / "tiny@cnn" / "config.yaml"
    config.write_text(config.read_text().replace("mode: pool", "mode: dedicated"))
    with pytest.raises(AppConfigError) as raised:
        build_app({"repository": str(repository), "model": "tiny@cnn"})
    assert str(raised.value).startswith(f"{repository / 'tiny@cnn'}")
    assert ("the name 'tiny@cnn' of a dedicated model or pipeline becomes its route prefix /v2/models/<name>, "
            "which the ingress matches as the client encodes it: use letters, digits, '.', '_', '-' or '~'") \
        in str(raised.value)
    config.write_text(config.read_text().replace("mode: dedicated", "mode: pool"))
    assert build_app({"repository": str(repository), "model": "pool"}) is not None


def test_the_builders_config_error_is_a_ray_serve_exception_so_serve_does_not_retry_it(repository):
    # Serve's build task returns a RayServeException's message as DEPLOY_FAILED at once; it
    # retries any other exception (ray.serve._private.application_state.build_serve_application).
    with pytest.raises(AppConfigError) as raised:
        build_app({"repository": str(repository), "models": ["nope"]})
    assert isinstance(raised.value, RayServeException) and "['nope']" in str(raised.value)


def make_dry_run(target: str) -> list[str]:
    return subprocess.run(["make", "-n", "-s", target], capture_output=True, text=True, cwd=ROOT,
                          check=True).stdout.splitlines()


def test_make_serve_runs_the_checking_runner_with_token_auth_and_no_drain_wait():
    lines = make_dry_run("serve")
    [run] = [i for i, line in enumerate(lines) if "-m deployments.run serve_config.yaml" in line]
    env = lines[run].split()
    assert "RAY_AUTH_MODE=token" in env and "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S=0" in env
    assert "RAY_SERVE_ENABLE_HA_PROXY=1" in env and "RAY_SERVE_THROUGHPUT_OPTIMIZED=1" in env


def test_make_status_runs_rays_tools_with_the_auth_mode_make_serve_sets():
    lines = make_dry_run("status")
    assert any(line.split()[-2:] == [".venv/bin/ray", "status"] for line in lines)
    assert any(line.split()[-2:] == [".venv/bin/serve", "status"] for line in lines)
    assert all(line.startswith("RAY_AUTH_MODE=token ") for line in lines)


def test_make_serves_runner_stops_on_a_bad_config_before_ray_starts(repository, tmp_path):
    config_path = repository / "mid_cnn" / "config.yaml"
    config_path.write_text(config_path.read_text().replace("mode: pool", "mode: shared"))
    result = subprocess.run([sys.executable, "-m", "deployments.run", str(serve_config(tmp_path, repository))],
                            capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                            timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        f"config error: {config_path}: deployment.mode: Input should be 'dedicated' or 'pool'"]


def test_deployments_stop_promptly_the_router_and_pipelines_within_their_bound(prepared_engines):
    from ray.serve._private.build_app import build_app as serve_build_app

    from deployments.app import GRACEFUL_SHUTDOWN_WAIT_LOOP_S, ROUTER_GRACEFUL_SHUTDOWN_TIMEOUT_S, applications

    built = {d.name: d._deployment_config for name, _, app in applications({"repository": str(prepared_engines)})
             for d in serve_build_app(app, name=name).deployments}
    assert {c.graceful_shutdown_wait_loop_s for c in built.values()} == {GRACEFUL_SHUTDOWN_WAIT_LOOP_S}
    callers = {name for name in built if name == "router" or name.startswith("pipeline-")}
    assert callers == {"router", "pipeline-ocr", "pipeline-embed"}
    assert {built[name].graceful_shutdown_timeout_s for name in callers} == {ROUTER_GRACEFUL_SHUTDOWN_TIMEOUT_S}


def test_make_serves_runner_names_a_failed_deploy_in_one_line():
    from types import SimpleNamespace

    from deployments.run import deploy_failure

    statuses = {"models": SimpleNamespace(status="DEPLOY_FAILED", message="config error: x.yaml: f: bad\n"),
                "other": SimpleNamespace(status="RUNNING", message="")}
    assert deploy_failure(statuses, ["other", "models"]) == "deploy failed: application 'models': config error: x.yaml: f: bad"
    assert deploy_failure({"models": SimpleNamespace(status="DEPLOYING", message="")}, ["models"]) is None
    assert deploy_failure({}, ["models"]) is None


def test_write_keeps_other_applications_and_refuses_model_applications_listed_by_hand(prepared_engines, tmp_path):
    from deployments.check import WRITTEN_MARK, write

    shipped = (ROOT / "serve_config.yaml").read_text().replace("repository: engines", f"repository: {prepared_engines}")
    path = tmp_path / "serve_config.yaml"
    echo = "  - name: echo\n    route_prefix: /echo\n    import_path: bench.echo:app\n"
    path.write_text(shipped + echo)  # an application of another import path after the written block
    write(path)
    apps = yaml.safe_load(path.read_text())["applications"]
    assert [a["name"] for a in apps] == ["models", "echo", "models.all-MiniLM-L6-v2", "models.embed", "models.ocr",
                                         "models.ocr_cls", "models.ocr_det", "models.ocr_rec", "models.pool"]  # kept; the written block ends the list
    by_hand = shipped.replace(WRITTEN_MARK + "\n", "")  # the same applications, without the mark
    path.write_text(by_hand)
    with pytest.raises(ConfigError, match=r"\['models.all-MiniLM-L6-v2', 'models.embed', 'models.ocr', 'models.ocr_cls', "
                                          r"'models.ocr_det', 'models.ocr_rec', 'models.pool'\] "
                                          "are listed without the mark"):
        write(path)
    assert path.read_text() == by_hand  # nothing written
    only_models = yaml.safe_load(shipped)
    only_models["applications"] = only_models["applications"][1:]  # no router application
    path.write_text(yaml.safe_dump(only_models))
    result = run_check(path)
    assert result.returncode == 2 and "not dedicated models of the repository: ['models.all-MiniLM-L6-v2'" in result.stderr


def test_without_haproxy_make_serve_gives_the_models_applications_no_route_prefix(prepared_engines, tmp_path):
    from deployments.run import config_for_proxy

    path = tmp_path / "serve_config.yaml"
    path.write_text((ROOT / "serve_config.yaml").read_text().replace("repository: engines",
                                                                      f"repository: {prepared_engines}"))
    assert config_for_proxy(path, {"RAY_SERVE_ENABLE_HA_PROXY": "1"}).name == ".serve_config.grpc.yaml"  # one hop
    copy = config_for_proxy(path, {})  # make serve FAST=0: Serve's Python proxy
    apps = yaml.safe_load(copy.read_text())["applications"]
    assert [(a["name"], a["route_prefix"]) for a in apps] == [("models", "/")] + [
        (f"models.{m}", None) for m in ("all-MiniLM-L6-v2", "embed", "ocr", "ocr_cls", "ocr_det", "ocr_rec", "pool")]
    assert apps[1:] == [dict(a, route_prefix=None) for a in yaml.safe_load(path.read_text())["applications"][1:]]
    assert run_check(copy).returncode == 0  # still in step: a null prefix is two hops


def test_with_haproxy_make_serve_has_serve_serve_kserve_grpc_on_the_routers_grpc_port(prepared_engines, tmp_path):
    """The copy ``serve run`` gets: ``grpc_options`` on ``grpc_port`` (8001 by default) with the
    KServe v2 servicer, beside any the config named; none with ``grpc_port: null``."""
    from deployments.grpc_service import SERVE_SERVICER
    from deployments.run import config_for_grpc

    path = tmp_path / "serve_config.yaml"
    shipped = (ROOT / "serve_config.yaml").read_text().replace("repository: engines", f"repository: {prepared_engines}")
    path.write_text(shipped)
    copy = config_for_grpc(path)
    config = yaml.safe_load(copy.read_text())
    assert config["grpc_options"] == {"port": 8001, "grpc_servicer_functions": [SERVE_SERVICER]}
    assert config["applications"] == yaml.safe_load(shipped)["applications"]
    assert run_check(copy).returncode == 0
    path.write_text(shipped.replace("grpc_port: 8001", "grpc_port: 9123") + "grpc_options:\n  grpc_servicer_functions: [a.b]\n")
    assert yaml.safe_load(config_for_grpc(path).read_text())["grpc_options"] == {
        "port": 9123, "grpc_servicer_functions": ["a.b", SERVE_SERVICER]}
    path.write_text(shipped.replace("grpc_port: 8001", "grpc_port: null"))
    assert config_for_grpc(path) == path


def test_make_serve_sizes_haproxys_buffer_to_send_again_a_body_of_retry_body_mib(prepared_engines, tmp_path):
    """HAProxy's ``tune.bufsize`` from the router's args: ``retry_body_mib`` (1 MiB by default),
    at most ``max_body_mib``, plus the header room, and HTTP/2 frames of that body (at most
    HTTP/2's 16 MiB - 1, at least its 16 KiB) with an 8 MiB window; a value the user set stands;
    none without HAProxy."""
    from deployments.haproxy import H2_WINDOW_BYTES, RETRY_HEADER_ROOM_BYTES
    from deployments.run import retry_buffer_env

    shipped = (ROOT / "serve_config.yaml").read_text().replace("repository: engines", f"repository: {prepared_engines}")
    path = tmp_path / "serve_config.yaml"
    on = {"RAY_SERVE_ENABLE_HA_PROXY": "1"}
    sizes = []
    for text in (shipped, shipped.replace("max_body_mib: 64", "max_body_mib: 64\n      retry_body_mib: 4"),
                 shipped.replace("max_body_mib: 64", "max_body_mib: 0.5\n      retry_body_mib: 4")):
        path.write_text(text)
        sizes.append(retry_buffer_env(path, on))
    assert sizes == [{"RAY_SERVE_HAPROXY_TUNE_BUFSIZE": str(int(mib * 2**20) + RETRY_HEADER_ROOM_BYTES),
                      "RAY_SERVE_HAPROXY_H2_MAX_FRAME_SIZE": str(int(mib * 2**20)),
                      "RAY_SERVE_HAPROXY_H2_FE_INITIAL_WINDOW_SIZE": str(H2_WINDOW_BYTES)} for mib in (1, 4, 0.5)]
    assert retry_buffer_env(path, {**on, "RAY_SERVE_HAPROXY_TUNE_BUFSIZE": "65536"}) == {
        "RAY_SERVE_HAPROXY_H2_FE_INITIAL_WINDOW_SIZE": str(H2_WINDOW_BYTES)}  # no frame size over the user's buffer
    path.write_text(shipped.replace("max_body_mib: 64", "max_body_mib: 64\n      retry_body_mib: 0"))
    assert retry_buffer_env(path, {**on, "RAY_SERVE_HAPROXY_H2_FE_INITIAL_WINDOW_SIZE": "65535"}) == {
        "RAY_SERVE_HAPROXY_TUNE_BUFSIZE": str(RETRY_HEADER_ROOM_BYTES), "RAY_SERVE_HAPROXY_H2_MAX_FRAME_SIZE": "16384"}
    assert retry_buffer_env(path, {}) == {}


def test_make_serve_on_a_taken_port_exits_2_naming_the_port_before_ray_starts(prepared_engines, tmp_path):
    """A second ``make serve`` while the first holds its port started Ray and hung silently
    (its proxy retried the bind forever); now one line and status 2, before Ray starts."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        config = yaml.safe_load((ROOT / "serve_config.yaml").read_text().replace(
            "repository: engines", f"repository: {prepared_engines}"))
        config["http_options"]["port"] = port
        path = tmp_path / "serve_config.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        done = subprocess.run([sys.executable, "-m", "deployments.run", str(path)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    [line] = [line for line in done.stderr.splitlines() if "is taken" in line]
    assert line.startswith(f"port {port} on 127.0.0.1 is taken (Address already in use): ")
    assert line.endswith(f"set another port in {path}'s http_options")
    assert "Started a local Ray instance" not in done.stdout + done.stderr  # Ray never started


def test_with_haproxy_a_taken_grpc_port_is_named_before_ray_starts(prepared_engines, tmp_path):
    """HAProxy binds the gRPC port (``config_for_grpc``): one that is taken would keep it from
    starting, so it is named as a taken HTTP port is; behind Serve's Python proxy (the router's
    own server, which says so itself) and with ``grpc_port: null`` it is not checked."""
    import socket

    from deployments.run import port_taken

    shipped = (ROOT / "serve_config.yaml").read_text().replace("repository: engines", f"repository: {prepared_engines}")
    path = tmp_path / "serve_config.yaml"
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        path.write_text(shipped.replace("grpc_port: 8001", f"grpc_port: {port}").replace("port: 8000", "port: 0"))
        line = port_taken(path, {"RAY_SERVE_ENABLE_HA_PROXY": "1"})
        assert line == (f"port {port} on 127.0.0.1 is taken (Address already in use): another server (an earlier "
                        f"`make serve`?) listens there; stop it, or set another port in {path}'s router "
                        "application's args, grpc_port")
        assert port_taken(path, {}) is None
        path.write_text(shipped.replace("grpc_port: 8001", "grpc_port: null").replace("port: 8000", "port: 0"))
        assert port_taken(path, {"RAY_SERVE_ENABLE_HA_PROXY": "1"}) is None


def test_a_taken_metrics_port_is_named_at_start_and_a_free_one_is_not(prepared_engines, tmp_path):
    """A scrape of :8002 held by another server read that server's series: the counts lagged this
    server's answers until the port was free (seconds), while the statistics extension was right."""
    import socket

    from deployments.run import metrics_port_taken

    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    path = tmp_path / "serve_config.yaml"
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        for app in config["applications"]:  # every application's args (the file's YAML merge key)
            app["args"]["metrics"] = {"port": port}
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        line = metrics_port_taken(path, {})
        assert line is not None and line.startswith(f"metrics port(s) [{port}] on 127.0.0.1 taken (Address already in use)")
        assert metrics_port_taken(path, {"RAY_ADDRESS": "auto"}) is None  # a running cluster's own ports
    assert metrics_port_taken(path, {}) is None  # free again
    for app in config["applications"]:
        app["args"]["metrics"] = {"port": None}
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    assert metrics_port_taken(path, {}) is None
