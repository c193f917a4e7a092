"""The package's import graph: no circles, and no arrow running back up a layer.

Every ``import`` / ``from ... import`` in ``deployments/`` counts, lazy ones inside functions
included (they hide circles, they do not remove them).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "deployments"

# Rooms of the engine layer, lowest first: a room may import only rooms before it.
ENGINE_ROOMS = ["contract", "backends", "residency", "tools"]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            # ``from . import cuda`` imports a module, not a name
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        graph[name] = {m for m in _imports(path) if m in files and m != name}
    return graph


def _room(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] == ["deployments", "runtime"] and len(parts) > 2:
        return parts[2]
    return None


def test_the_package_has_no_import_circle() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            # a package's __init__ importing its own submodule is not a circle through the package
            if nxt == node.rsplit(".", 1)[0]:
                continue
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_engine_rooms_import_only_rooms_below_them() -> None:
    wrong = []
    for module, targets in _graph().items():
        room = _room(module)
        if room not in ENGINE_ROOMS:
            continue
        for target in targets:
            target_room = _room(target)
            if not target.startswith("deployments.runtime"):
                wrong.append(f"{module} -> {target} (the engine layer imports nothing of the Ray layer)")
            elif target_room in ENGINE_ROOMS and ENGINE_ROOMS.index(target_room) > ENGINE_ROOMS.index(room):
                wrong.append(f"{module} -> {target} ({room} is below {target_room})")
    assert wrong == []


def test_the_engine_layer_never_imports_ray() -> None:
    offenders = sorted(
        f"{_module_name(p)} imports {m}" for p in (PACKAGE / "runtime").rglob("*.py")
        for m in _imports(p) if m == "ray" or m.startswith("ray."))
    assert offenders == []


def test_no_server_module_imports_a_command_line() -> None:
    """The command lines (``runtime.tools``) are for ``make``; replicas never load them."""
    offenders = sorted(f"{m} -> {t}" for m, targets in _graph().items() if _room(m) != "tools"
                       for t in targets if _room(t) == "tools")
    assert offenders == []


def test_every_room_says_what_it_owns() -> None:
    for room in ENGINE_ROOMS:
        doc = ast.get_docstring(ast.parse((PACKAGE / "runtime" / room / "__init__.py").read_text()))
        assert doc, f"deployments/runtime/{room}/__init__.py has no docstring"


# What only the router serves: the Serve deployment, readiness watching, the repository and
# model-control routes. A model, pipeline or pool replica carries only the route table.
ROUTER_ONLY = ["deployments.ingress", "deployments.readiness", "deployments.repository_routes"]
REPLICAS = ["deployments.model", "deployments.pipeline", "deployments.pool"]


def test_a_model_or_pool_replica_imports_nothing_only_the_router_serves() -> None:
    graph = _graph()

    def reach(module: str, seen: set[str]) -> set[str]:
        for target in graph[module] - seen:
            seen.add(target)
            reach(target, seen)
        return seen

    offenders = sorted(f"{replica} -> {m}" for replica in REPLICAS for m in reach(replica, set()) if m in ROUTER_ONLY)
    assert offenders == []
