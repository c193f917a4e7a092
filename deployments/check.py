"""``python -m deployments.check [--write] [serve_config.yaml]``: check a Serve config and its
model repository before Ray starts (``make serve`` runs it first).

Each dedicated model and pipeline is an application of its own (``deployments.app``): the check
also says which of those the file lacks or lists in vain (a model folder added, removed or moved
to the pool since), and ``--write`` rewrites them from the router application's args and the
repository.

The checks are the ones the application builder runs (``deployments.app.build_app``: the
application ``args``, every ``engines/<model>/config.yaml``, the model files), after Ray's own
schema for the file (``ray.serve.schema.ServeDeploySchema``, what ``serve run`` and
``serve deploy`` read). Relative paths resolve against the current directory, as under
``serve run``.

Exit status 0 with one line naming the models and the URL, then one line per model whose config
was completed from its model file (what ``config.yaml`` leaves out, as YAML it could hold) and one
per field of a Triton ``config.pbtxt`` that is ignored; 2 with
one line ``config error: <file>: <field>: <what is wrong and what is allowed>`` on stderr.
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

from .runtime.contract.config import _model_in, describe_validation_error, read_yaml
from .runtime.contract.errors import ConfigError

APP_IMPORT_PATH = "deployments.app:build_app"


def check(path: Path) -> str:
    """Validate the Serve config at ``path``; returns the summary line, then a line per model
    whose config was completed from its model file (``completion_lines``).

    Raises:
        ConfigError: unreadable YAML, a field Ray's schema refuses, a bad application ``args``
            / model repository (the message names the file and field), or applications out of
            step with the repository (``model_applications_error``).
    """
    from .app import AppArgs, build_app
    from .runtime.contract.repository import ModelRepository

    schema = _schema(path)
    models: list[str] = []
    completed: list[str] = []
    routers, model_apps = _our_applications(schema)

    def build(apps: list[Any]) -> None:
        for app in apps:
            try:
                build_app(app.args)
            except ConfigError as e:
                raise ConfigError(e.message.replace("serve_config.yaml", str(path), 1)) from None

    build(routers)  # the routers, then the list in step with them, then the models
    if error := model_applications_error(path, schema):
        raise ConfigError(error)
    build(model_apps)
    for app in routers:
        args = AppArgs.model_validate(app.args or {})
        repo = ModelRepository(args.repository, args.models)
        models += repo.names()
        completed += completion_lines(repo)
    http = schema.http_options
    return "\n".join([f"{path}: OK, {len(models)} models {models}; serving at http://{http.host}:{http.port}/v2 "
                      "once ready", *completed])


def completion_lines(repo: Any) -> list[str]:
    """``  <model>: completed from <model file>: {field: value, ...}`` (flow YAML) for each model
    of ``repo`` (a ``ModelRepository``) whose config was completed from its model file, and
    ``  <model>: <config file>: <field>: ignored: ...`` for what its config file says that is
    not acted on (a Triton ``config.pbtxt``'s, ``repository.read_folder_config``)."""
    from .runtime.contract.completion import completed_fields
    from .runtime.contract.repository import read_folder_config

    lines = []
    for entry in repo.entries():
        read = read_folder_config(entry.path)
        lines += [f"  {entry.name}: {note}" for note in read.notes]
        fields = completed_fields(read.given, entry.config)
        if fields and not entry.config.pipeline:
            text = yaml.safe_dump(fields, default_flow_style=True, sort_keys=False, width=1 << 16).strip()
            lines.append(f"  {entry.name}: completed from {entry.onnx_path()}: {text}")
    return lines


def _schema(path: Path) -> Any:
    """``path`` read as Ray's ``ServeDeploySchema``.

    Raises:
        ConfigError: unreadable YAML or a field Ray's schema refuses.
    """
    from ray.serve.schema import ServeDeploySchema

    raw = read_yaml(path)
    try:
        return ServeDeploySchema.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(f"{path}: {describe_validation_error(e, ServeDeploySchema)}") from None


def _our_applications(schema: Any) -> tuple[list[Any], list[Any]]:
    """The config's applications of this project (``APP_IMPORT_PATH``): router applications
    (no ``args.model``) and model applications (a dedicated model's, or the pool's)."""
    ours = [app for app in schema.applications if app.import_path == APP_IMPORT_PATH]
    routers = [app for app in ours if (app.args or {}).get("model") is None]
    return routers, [app for app in ours if app not in routers]


def model_applications_of(path: Path) -> list[Any]:
    """The model applications (dedicated models' and the pool's) the config at ``path`` lists
    (``_our_applications``).

    Raises:
        ConfigError: as ``_schema``.
    """
    return _our_applications(_schema(path))[1]


def router_applications_of(path: Path) -> list[Any]:
    """The router applications the config at ``path`` lists (``_our_applications``).

    Raises:
        ConfigError: as ``_schema``.
    """
    return _our_applications(_schema(path))[0]


def expected_model_applications(schema: Any) -> list[dict[str, Any]]:
    """The application of each dedicated model and pipeline that the config's router
    applications (``import_path: deployments.app:build_app`` without ``args.model``) serve, as
    ``deployments.app.applications`` deploys them: ``{"name", "route_prefix", "import_path",
    "args"}`` (``args``: the router's plus ``model``)."""
    from .app import model_applications
    from .client import model_application

    out = []
    for app in _our_applications(schema)[0]:
        for model, prefix in model_applications(app.args, app.route_prefix or "/"):
            out.append({"name": model_application(app.name, model), "route_prefix": prefix,
                        "import_path": APP_IMPORT_PATH, "args": {**(app.args or {}), "model": model}})
    return out


def model_applications_error(path: Path, schema: Any) -> str | None:
    """What is out of step between the config's model applications and the repository (a
    dedicated model added, removed or switched to the pool since the file was written), or None."""
    expected = {a["name"]: a for a in expected_model_applications(schema)}
    listed = {a.name: a for a in _our_applications(schema)[1]}
    missing = sorted(set(expected) - set(listed))
    extra = sorted(set(listed) - set(expected))
    differing = sorted(name for name in set(expected) & set(listed)  # a null route_prefix: two hops, allowed
                       if listed[name].route_prefix not in (expected[name]["route_prefix"], None)
                       or listed[name].args != expected[name]["args"])
    if not (missing or extra or differing):
        return None
    parts = [f"{what}: {names}" for what, names in (("missing", missing), ("not dedicated models of the "
             "repository", extra), ("with another route_prefix or args than their router application's",
                                    differing)) if names]
    return (f"{path}: applications: each dedicated model and pipeline is its own application named "
            f"'<router application>.<model>' at route_prefix '<router prefix>/v2/models/<model>', and the pool "
            f"models' is '<router application>.pool' at '<router prefix>/v2/models' (or null: the router answers "
            f"their routes), with the router's args plus model; {'; '.join(parts)}. "
            f"`python -m deployments.check --write {path}` writes them")


WRITTEN_MARK = "# --- one application per dedicated model: written by `python -m deployments.check --write`"


def write(path: Path) -> str:
    """Rewrite the model applications of the config at ``path`` from its router application
    and the repository: the block under ``WRITTEN_MARK`` (made at the end of ``applications:``
    when absent; an application listed after it that is no model application of this project is
    kept). With one router application whose ``args:`` line has a YAML anchor (``args: &name``)
    each takes the router's args through it, else a copy. The new text is checked before it
    replaces the file. Returns the summary line.

    Raises:
        ConfigError: as ``check``; model applications listed outside the written block.
    """
    import re

    schema = _schema(path)
    routers, model_apps = _our_applications(schema)
    lines = path.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if re.match(r"applications:\s*(#.*)?$", line)), None)
    if start is None:
        raise ConfigError(f"{path}: no top-level 'applications:' to write the model applications into")
    end = next((i for i in range(start + 1, len(lines)) if re.match(r"[^\s#-]", lines[i])), len(lines))
    indent = next((m.group(1) for line in lines[start + 1:end] if (m := re.match(r"(\s*)- ", line))), "  ")
    written = {app.name for app in model_apps}
    if WRITTEN_MARK in lines[start:end]:  # the block written before: the mark and its items
        mark = lines.index(WRITTEN_MARK, start)
        stop = mark + 1
        while stop < end and (lines[stop].startswith(indent + "  ") or not lines[stop].strip()
                              or (lines[stop].startswith(indent + "- name: ")
                                  and lines[stop].split(":", 1)[1].strip() in written)):
            stop += 1
        del lines[mark:stop]
        end -= stop - mark
    elif written:
        raise ConfigError(f"{path}: applications: {sorted(written)} are listed without the mark of the written "
                          f"block ({WRITTEN_MARK!r}): remove them, then run --write again")
    while end > start + 1 and not lines[end - 1].strip():
        end -= 1
    anchor = re.search(r"^\s+args:\s*&([A-Za-z0-9_-]+)", "\n".join(lines[start:end]), re.MULTILINE)
    apps = expected_model_applications(schema)
    block = [WRITTEN_MARK]
    for app in apps:
        args = (f"{{<<: *{anchor.group(1)}, model: {app['args']['model']}}}" if anchor is not None
                and len(routers) == 1 else json.dumps(app["args"]))
        block += [f"{indent}- name: {app['name']}", f"{indent}  route_prefix: {app['route_prefix']}",
                  f"{indent}  import_path: {APP_IMPORT_PATH}", f"{indent}  args: {args}"]
    text = "\n".join(lines[:end] + block + lines[end:]) + "\n"
    scratch = path.with_name(f".{path.name}.written")
    scratch.write_text(text)
    try:
        error = model_applications_error(path, _schema(scratch))
    finally:
        scratch.unlink()
    if error:
        raise ConfigError(error + " (not written)")
    path.write_text(text)
    return f"{path}: wrote {len(apps)} model applications {[a['name'] for a in apps]}"


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
            given = [a for a in get_args(field.annotation) if a is not type(None)] \
                if get_origin(field.annotation) in (Union, UnionType) else [field.annotation]  # Optional[X]: X
            item = get_args(given[0])[0] if len(given) == 1 and get_origin(given[0]) in (tuple, list) else None
            keyed = get_origin(item) is dict  # e.g. tensorrt.profiles: a list of {input name: Profile}
            rows += reference(inner, f"{path}{'[]' if item is not None else ''}{'.<input>' if keyed else ''}.")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    from . import app  # noqa: F401  (imports ray.serve, which sets its logger's level)

    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # the builder's INFO lines are for replicas
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["--reference"]:
        from .runtime.contract.config import ModelConfigFile

        for row in reference(ModelConfigFile):
            print("| " + " | ".join(f"`{c}`" for c in row) + " |")
        return 0
    writing = "--write" in args
    args = [a for a in args if a != "--write"]
    path = Path(args[0] if args else "serve_config.yaml")
    try:
        if writing:
            print(write(path))
        print(check(path))
    except ConfigError as e:
        print(f"config error: {e.message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
