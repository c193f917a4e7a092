"""deployments.loopback: Ray's own HAProxy config (rendered by Ray 2.60's code) keeps its stats and
Prometheus listeners on 127.0.0.1 and stays valid for the real HAProxy; the environment a
local cluster gets; the wrapper as Ray runs it."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from deployments import loopback

WRAPPER = Path(loopback.__file__)


def _ray_haproxy_config(tmp_path: Path, host: str) -> Path:
    """The config file Ray Serve's HAProxyApi writes for an API on ``host``:8000."""
    from ray.serve._private.haproxy import HAProxyApi, HAProxyConfig
    from ray.serve.config import HTTPOptions

    cfg = HAProxyConfig(http_options=HTTPOptions(host=host, port=8000), socket_path=str(tmp_path / "admin.sock"),
                        server_state_base=str(tmp_path), server_state_file=str(tmp_path / "server-state"),
                        metrics_socket_path=str(tmp_path / "metrics.sock"))
    api = HAProxyApi(cfg=cfg, config_file_path=str(tmp_path / "haproxy.cfg"))
    api._generate_config_file_internal()
    return tmp_path / "haproxy.cfg"


def _binds(config: str) -> list[str]:
    return [line.split()[1] for line in config.splitlines() if line.strip().startswith("bind ")]


def _real_haproxy() -> str:
    return loopback._real_haproxy({})


def test_rays_template_binds_stats_and_prometheus_on_every_interface(tmp_path):
    binds = _binds(_ray_haproxy_config(tmp_path, "127.0.0.1").read_text())
    assert "*:8404" in binds and ":9101" in binds and "127.0.0.1:8000" in binds


def test_bind_loopback_moves_only_stats_and_prometheus_and_haproxy_accepts_it(tmp_path):
    path = _ray_haproxy_config(tmp_path, "0.0.0.0")
    original = path.read_text()
    rewritten = loopback.bind_loopback(original)
    assert sorted(_binds(rewritten)) == ["*:8000", "127.0.0.1:8404", "127.0.0.1:9101"]  # the API: as asked
    assert len(rewritten.splitlines()) == len(original.splitlines())
    assert loopback.bind_loopback(rewritten) == rewritten
    path.write_text(rewritten)
    check = subprocess.run([_real_haproxy(), "-c", "-f", str(path)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize("section", loopback.WILDCARD_SECTIONS)
def test_bind_loopback_refuses_a_config_without_a_section_it_must_move(section):
    config = "".join(f"{s}\n    bind *:{1000 + i}\n" for i, s in enumerate(loopback.WILDCARD_SECTIONS) if s != section)
    with pytest.raises(ValueError, match=section):
        loopback.bind_loopback(config)


def test_the_wrapper_rewrites_the_config_then_runs_the_real_haproxy_with_rays_arguments(tmp_path):
    path = _ray_haproxy_config(tmp_path, "127.0.0.1")
    env = dict(os.environ, **{loopback.REAL_BINARY_ENV: _real_haproxy()})
    done = subprocess.run([str(WRAPPER), "-c", "-f", str(path)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(_binds(path.read_text())) == ["127.0.0.1:8000", "127.0.0.1:8404", "127.0.0.1:9101"]


def test_the_wrapper_exits_2_naming_what_is_missing(tmp_path):
    path = tmp_path / "haproxy.cfg"
    path.write_text("listen stats\n  bind *:8404\n")
    env = dict(os.environ, **{loopback.REAL_BINARY_ENV: _real_haproxy()})
    done = subprocess.run([str(WRAPPER), "-db", "-f", str(path)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "frontend prometheus" in done.stderr
    bare = {k: v for k, v in os.environ.items() if k != loopback.REAL_BINARY_ENV}
    done = subprocess.run([str(WRAPPER), "-db", "-f", str(path)], env=bare, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and loopback.REAL_BINARY_ENV in done.stderr


def test_local_env_without_haproxy_is_rays_single_machine_mode():
    assert loopback.local_env({}) == {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    assert loopback.local_env({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}) == {}  # the user's choice stands


def test_local_env_with_haproxy_wraps_the_binary_ray_would_run_and_keeps_the_users_ports():
    env = loopback.local_env({"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_HAPROXY_STATS_PORT": "18404"})
    assert env["RAY_SERVE_HAPROXY_BINARY_PATH"] == str(WRAPPER.resolve())
    assert env[loopback.REAL_BINARY_ENV] == _real_haproxy() and os.access(env[loopback.REAL_BINARY_ENV], os.X_OK)
    assert "RAY_SERVE_HAPROXY_STATS_PORT" not in env and int(env["RAY_SERVE_HAPROXY_METRICS_PORT"]) > 0
    again = loopback.local_env({"RAY_SERVE_ENABLE_HA_PROXY": "1", **env})  # wrapped once, not twice
    assert again[loopback.REAL_BINARY_ENV] == env[loopback.REAL_BINARY_ENV]


def test_a_port_held_on_any_interface_gives_way_to_a_free_one():
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        taken = held.getsockname()[1]
        chosen = loopback._port_or_free(taken)
    assert chosen != taken and chosen > 0
