"""README.md and docs/ show the real product: a model's config.yaml shown is the file it names (or,
for a model the repository does not ship, a valid config), the config reference table lists every
field of config.yaml (ModelConfigFile) with its type and default, the application args table
every field of AppArgs, every curl request names a route the server has, every `make` target
exists, and every benchmark command's flags are the script's."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from starlette.routing import Match

from deployments.app import AppArgs
from deployments.check import reference
from deployments.runtime.contract.config import ModelConfigFile
from deployments.runtime.contract.repository import ModelRepository
from tests.unit.test_links import PAGES, ROOT
from tests.unit.test_router_routes import make_router

# The lab notes are history: their commands ran against the code of their day.
CURRENT = [p for p in PAGES if p.name != "lab-notes.md"]
CONFIGURATION = (ROOT / "docs" / "configuration.md").read_text()


def blocks(language: str) -> list[tuple[Path, str]]:
    """Every fenced code block of one language in the current pages, with its page."""
    return [(page, body) for page in CURRENT
            for body in re.findall(rf"^```{language}\n(.*?)^```", page.read_text(), re.S | re.M)]


def tracked(path: str) -> bool:
    return bool(subprocess.run(["git", "ls-files", "--error-unmatch", path], cwd=ROOT,
                               capture_output=True).returncode == 0)


def test_every_yaml_block_headed_by_a_config_path_is_that_file_or_a_valid_config(tmp_path):
    """A model the reader makes gets its model file as the page's own ``cp`` command says, then
    its config.yaml as shown, and must pass the start's validation (completed from that file)."""
    shown = [(page, re.match(r"# (engines/([a-z0-9_]+)/config\.yaml)\n", body), body) for page, body in blocks("yaml")]
    shown = [(page, m.group(1), m.group(2), body[m.end():]) for page, m, body in shown if m]
    assert {page.name for page, *_ in shown} >= {"README.md", "configuration.md"}
    for page, path, name, body in shown:
        if tracked(path):
            assert body == (ROOT / path).read_text(), f"{page.name}'s {path} differs from the file"
            continue
        copied = re.search(rf"cp (engines/\w+/1/model\.onnx) engines/{name}/1/model\.onnx", page.read_text())
        assert copied, f"{page.name} shows {path} but no `cp` command giving {name} its model file"
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "1" / "model.onnx").symlink_to(ROOT / copied.group(1))
        (tmp_path / name / "config.yaml").write_text(body)
        config = ModelRepository(tmp_path, [name]).get(name).config
        assert {k: getattr(config, k) for k in yaml.safe_load(body) if k != "deployment"} == {
            k: v for k, v in yaml.safe_load(body).items() if k != "deployment"}


def test_the_config_reference_table_lists_every_field_with_its_type_and_default():
    rows = re.findall(r"^\| `([^`]+)` \| `((?:[^`])+)` \| `([^`]+)` \|", CONFIGURATION, re.M)
    table = [(path, kind.replace("\\|", "|"), default) for path, kind, default in rows
             if path.split(".")[0].split("[")[0] in ModelConfigFile.model_fields]
    assert table == [(p, k.replace("\\|", "|"), d) for p, k, d in reference(ModelConfigFile)]


def test_the_application_args_table_names_every_field_of_app_args():
    section = CONFIGURATION.split("\n## Application args\n", 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"^\| `([a-z_]+)` \|", section, re.M)
    assert sorted(named) == sorted(AppArgs.model_fields)


@pytest.fixture(scope="module")
def routes():
    client, _ = make_router(ModelRepository(ROOT / "engines"))
    return client.app.routes


def curl_requests() -> list[tuple[str, str, str]]:
    """(page, method, path) of every curl to the API (port 8000) in the current pages' bash blocks."""
    found = []
    for page, body in blocks("bash"):
        for line in body.replace("\\\n", " ").splitlines():
            for m in re.finditer(r"curl ([^|;#]*?)(?:https?://)?(?:127\.0\.0\.1|localhost):8000(/[^\s'\";]*)", line):
                method = "POST" if re.search(r"-X POST|-d ", line) else "GET"
                found.append((page.name, method, m.group(2)))
    return found


def test_every_curl_in_the_docs_names_a_route_of_the_server(routes):
    requests = curl_requests()
    assert {page for page, *_ in requests} >= {"README.md", "models.md", "observability.md"}
    for page, method, path in requests:
        scope = {"type": "http", "path": path, "method": method}
        assert any(route.matches(scope)[0] == Match.FULL for route in routes), f"{page}: no route {method} {path}"


def test_every_make_target_in_the_docs_is_one_of_the_makefile():
    targets = set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.M))
    for page in CURRENT:
        for target in re.findall(r"`make ([a-z][a-z-]*)", page.read_text()):
            assert target in targets, f"{page.name}: make {target} is not a Makefile target"


def test_every_module_and_flag_of_a_python_command_in_the_docs_exists():
    commands = [(page.name, m) for page in CURRENT for m in re.finditer(
        r"python3? -m ((?:bench|deployments)(?:\.\w+)+)((?:[ \t]+(?:\\\n)?[^`\n|;#]*)*)", page.read_text())]
    assert commands
    for page, m in commands:
        module = ROOT / (m.group(1).replace(".", "/") + ".py")
        assert module.exists(), f"{page}: no module {m.group(1)}"
        source = module.read_text()
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", m.group(2)):
            assert f'"{flag}"' in source, f"{page}: python -m {m.group(1)} has no flag {flag}"


def test_the_shipped_models_table_gives_each_models_placement_as_its_config_says(prepared_engines):
    """docs/models.md's table of the models ``make models`` writes: placement ``pipeline`` for a
    pipeline model, else its ``deployment.mode`` (``pool`` or ``dedicated``)."""
    table = (ROOT / "docs" / "models.md").read_text().split("| model | placement |", 1)[1].split("\n\n", 1)[0]
    shown = dict(re.findall(r"^\| `([^`]+)` \| (\w+) \|", table, re.M))
    repository = ModelRepository(prepared_engines)
    assert shown == {e.name: "pipeline" if e.config.pipeline else e.config.deployment.mode
                     for e in repository.entries()}
