"""The ``metrics`` section of the application's args, and what each replica does with it."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field


class MetricsOptions(BaseModel):
    """``args.metrics`` in ``serve_config.yaml``.

    ``enabled``: record the series (``deployments.observe.metrics``) and answer ``/metrics``
    and the statistics routes. ``port``: every node that runs a replica serves its series on
    ``:port/metrics`` (Triton's default 8002; null: only the router's ``GET /metrics``).
    ``access_log``: one structured log line per successful request too (failures always).
    The port listens where Ray's own servers do: on 127.0.0.1 when the Ray node's IP is
    loopback (``make serve``: ``deployments.loopback``), else on every interface.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = True
    port: Optional[int] = Field(8002, ge=1, le=65535)
    access_log: bool = False


def start(options: dict[str, Any] | None) -> MetricsOptions | None:
    """In a replica: validate ``options``; when enabled, turn recording on and make sure this
    node serves ``:port/metrics``. Returns the options, or None when metrics are off."""
    parsed = MetricsOptions.model_validate(options or {})
    if not parsed.enabled:
        return None
    from .metrics import families, serve_node_metrics

    families()
    if parsed.port is not None:
        serve_node_metrics(parsed.port, bind_host())
    return parsed


def bind_host() -> str:
    """127.0.0.1 on a Ray node whose IP is loopback, else 0.0.0.0 (Ray's own agents choose so:
    ``ray/dashboard/agent.py``, ``get_localhost_ip() if is_localhost(ip) else ...``)."""
    import ipaddress

    import ray

    return "127.0.0.1" if ipaddress.ip_address(ray.util.get_node_ip_address()).is_loopback else "0.0.0.0"
