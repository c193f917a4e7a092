"""deployments.loopback: the environment a local cluster gets (``local_env``): Ray's
single-machine mode, and Ray's HAProxy run through ``deployments/haproxy.py`` on free ports."""

from __future__ import annotations

import os
import socket

from deployments import haproxy, loopback


def _real_haproxy() -> str:
    return haproxy.real_haproxy({})


def test_local_env_without_haproxy_is_rays_single_machine_mode():
    assert loopback.local_env({}) == {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    assert loopback.local_env({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}) == {}  # the user's choice stands


def test_local_env_with_haproxy_wraps_the_binary_ray_would_run_and_keeps_the_users_ports():
    env = loopback.local_env({"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_HAPROXY_STATS_PORT": "18404"})
    assert env["RAY_SERVE_HAPROXY_BINARY_PATH"] == str(haproxy.WRAPPER)
    assert env[haproxy.REAL_BINARY_ENV] == _real_haproxy() and os.access(env[haproxy.REAL_BINARY_ENV], os.X_OK)
    assert "RAY_SERVE_HAPROXY_STATS_PORT" not in env and int(env["RAY_SERVE_HAPROXY_METRICS_PORT"]) > 0
    again = loopback.local_env({"RAY_SERVE_ENABLE_HA_PROXY": "1", **env})  # wrapped once, not twice
    assert again[haproxy.REAL_BINARY_ENV] == env[haproxy.REAL_BINARY_ENV]
    assert env["RAY_SERVE_HAPROXY_HEALTH_CHECK_FALL"] == "6"  # a busy replica stays in rotation
    assert env["RAY_SERVE_HAPROXY_OBSERVE_ERROR_LIMIT"] == "1"  # a dead one leaves it at its first refusal
    users = loopback.local_env({"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_HAPROXY_HEALTH_CHECK_FALL": "3"})
    assert "RAY_SERVE_HAPROXY_HEALTH_CHECK_FALL" not in users  # the user's value stands


def test_a_port_held_on_any_interface_gives_way_to_a_free_one():
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        taken = held.getsockname()[1]
        chosen = haproxy.port_or_free(taken)
    assert chosen != taken and chosen > 0


def test_the_direct_ingress_ports_start_at_a_free_one():
    """Ray warned "Failed to start RequestProtocol.HTTP server on port 30000 ... Retrying" at every
    start while another server held 30000: the range now starts at a port free at start."""
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        taken = held.getsockname()[1]
        assert loopback.first_free_port(taken, taken + 10) != taken
        assert loopback.first_free_port(taken, taken + 1) == taken  # none free: Ray's own start
    env = loopback.local_env({"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": "31500"})
    assert "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT" not in env  # the user's value stands
    assert 40000 <= int(env["RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT"]) < 40500
