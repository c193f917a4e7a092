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

import json
import logging
import sys
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Sequence, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from .runtime.contract.config import _model_in, describe_validation_error
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
        raise ConfigError(f"{path}: {describe_validation_error(e, ServeDeploySchema)}") from None
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


def _type_name(annotation: Any) -> str:
    """``int``, ``'auto' | 'onnxruntime'``, ``list of TensorSpec``... for the reference table."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return " \\| ".join(repr(a) if isinstance(a, str) else str(a).lower() for a in args)
    if origin in (Union, UnionType):
        return " \\| ".join(_type_name(a) for a in args if a is not type(None))
    if origin in (tuple, list):
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return f"mapping of {_type_name(args[1])}" if _model_in(annotation) else "mapping"
    return getattr(annotation, "__name__", str(annotation))


def reference(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str]]:
    """(field path, type, default) for every field of ``model`` and of the models inside it,
    in declaration order; ``[]`` marks a list item, "required" a field without default."""
    rows = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        inner = _model_in(field.annotation)
        default = ("required" if field.is_required() else "{}" if field.default_factory is dict
                   else "its fields' defaults" if isinstance(field.default, BaseModel)
                   else json.dumps(field.default))
        rows.append((path, _type_name(field.annotation), default))
        if inner is not None:
            item = get_args(field.annotation)[0] if get_origin(field.annotation) in (tuple, list) else None
            keyed = get_origin(item) is dict  # e.g. tensorrt.profiles: a list of {input name: Profile}
            rows += reference(inner, f"{path}{'[]' if item is not None else ''}{'.<input>' if keyed else ''}.")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    from . import app  # noqa: F401  (imports ray.serve, which sets its logger's level)

    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # the builder's INFO lines are for replicas
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["--reference"]:
        from .runtime.contract.config import ModelConfig

        for row in reference(ModelConfig):
            print("| " + " | ".join(f"`{c}`" for c in row) + " |")
        return 0
    path = Path(args[0] if args else "serve_config.yaml")
    try:
        print(check(path))
    except ConfigError as e:
        print(f"config error: {e.message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
