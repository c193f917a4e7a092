"""``python -m deployments.run [serve_config.yaml]``: what ``make serve`` runs.

1. ``deployments.check`` on the config, before Ray starts: a bad config stops here with one
   line (file, field, what is allowed) and exit status 2.
2. Ray Serve's own ``serve run <config>`` (``ray.serve.scripts.run``), in this process.
3. Ctrl-C answers the requests in flight. ``serve run`` meets Ctrl-C with ``serve.shutdown()``,
   which kills the HAProxy ingress process at once (``HAProxyManager.stop`` sends SIGKILL)
   while the replicas still drain, so a request in flight through HAProxy was cut. Here the
   first Ctrl-C deletes the applications first (``serve.delete``: every replica finishes its
   requests while HAProxy still runs), then lets ``serve run`` shut Serve down as usual. A
   second Ctrl-C skips the wait.

Before any of it, the environment that keeps a local cluster on 127.0.0.1 (``deployments.loopback``:
Ray's single-machine mode, HAProxy's stats and Prometheus listeners on loopback at ports that
are free): nothing this command starts listens on another interface.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Sequence

import yaml

from . import check, loopback


def _delete_then_interrupt(app_names: list[str]):
    """A SIGINT handler: delete the applications (blocking), then ``KeyboardInterrupt``."""

    def handler(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C: stop waiting
        from ray import serve

        for name in app_names:
            try:
                serve.delete(name)
            except Exception:  # Serve not started yet, or already gone: nothing to drain
                pass
        raise KeyboardInterrupt

    return handler


def _stay_on_loopback() -> None:
    """Set ``loopback.local_env`` in this process's environment (before Ray is imported: it
    reads some of it at import) and say where HAProxy's side ports are."""
    added = loopback.local_env(os.environ)
    os.environ.update(added)
    if "RAY_SERVE_HAPROXY_BINARY_PATH" in added:
        print(f"HAProxy stats: http://{loopback.LOOPBACK}:{os.environ['RAY_SERVE_HAPROXY_STATS_PORT']}/stats, "
              f"Prometheus: http://{loopback.LOOPBACK}:{os.environ['RAY_SERVE_HAPROXY_METRICS_PORT']}/metrics",
              file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    path = Path(args[0] if args else "serve_config.yaml")
    _stay_on_loopback()
    status = check.main([str(path)])
    if status:
        return status
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    app_names = [app.name for app in schema.applications]
    signal.signal(signal.SIGINT, _delete_then_interrupt(app_names))
    from ray.serve.scripts import run

    run.main([str(path)], prog_name="serve run", standalone_mode=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
