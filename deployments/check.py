"""``python -m deployments.check [serve_config.yaml]``: check a Serve config and its model
repository before Ray starts (``make serve`` runs it first).

The checks are the ones the application builder runs (``deployments.app.build_app``: the
application ``args``, every ``engines/<model>/config.yaml``, the model files), after Ray's own
schema for the file (``ray.serve.schema.ServeDeploySchema``, what ``serve run`` and
``serve deploy`` read). Relative paths resolve against the current directory, as under
``serve run``.

Exit status 0 with one line naming the models and the URL; 2 with one line
``config error: <file>: <field>: <what is wrong and what is allowed>`` on stderr.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Sequence

import yaml
from pydantic import ValidationError

from .runtime.contract.config import describe
from .runtime.contract.errors import ConfigError

APP_IMPORT_PATH = "deployments.app:build_app"


def check(path: Path) -> str:
    """Validate the Serve config at ``path``; returns the summary line.

    Raises:
        ConfigError: unreadable YAML, a field Ray's schema refuses, or a bad application
            ``args`` / model repository (the message names the file and field).
    """
    from ray.serve.schema import ServeDeploySchema

    from .app import AppArgs, build_app
    from .runtime.contract.repository import ModelRepository

    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: cannot read YAML ({e})") from None
    try:
        schema = ServeDeploySchema.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(f"{path}: {describe(e, ServeDeploySchema)}") from None
    models: list[str] = []
    for app in schema.applications:
        if app.import_path != APP_IMPORT_PATH:
            continue
        try:
            build_app(app.args)
        except ConfigError as e:
            raise ConfigError(e.message.replace("serve_config.yaml", str(path), 1)) from None
        args = AppArgs.model_validate(app.args or {})
        models += ModelRepository(args.repository, args.models).names()
    http = schema.http_options
    return (f"{path}: OK, {len(models)} models {models}; serving at http://{http.host}:{http.port}/v2 "
            "once ready")


def main(argv: Sequence[str] | None = None) -> int:
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # the builder's INFO lines are for replicas
    args = list(sys.argv[1:] if argv is None else argv)
    path = Path(args[0] if args else "serve_config.yaml")
    try:
        print(check(path))
    except ConfigError as e:
        print(f"config error: {e.message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
