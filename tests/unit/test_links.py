"""Every link between the docs resolves, and every section the code cites exists.

- A relative link in README.md, bench/README.md or docs/*.md names a file that exists and, with a
  ``#anchor``, a heading of that file (GitHub's anchors: lower case, punctuation dropped, spaces
  as hyphens, ``-1``, ``-2`` for repeats).
- A section reference in code, tests, the Makefile and the configs, written
  ``<file>.md, "<Heading>"`` for this repository's README.md, bench/README.md and docs/*.md
  (the quoted text may wrap over comment or docstring lines), names a heading of that file:
  the whole heading, its part before ``: ``, or the heading without a trailing ``(...)``. The old forms that named no file (``README, "X"``, ``README "X"``) are
  refused, so a moved section cannot leave a dangling citation behind.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CITING = [p for pattern in ("deployments/**/*.py", "tests/**/*.py", "bench/*.py", "bench/*.sh", "cluster/*",
                            "Makefile", "Dockerfile", "pyproject.toml", "serve_config*.yaml")
          for p in sorted(ROOT.glob(pattern)) if p.is_file() and p.name != "test_links.py"]  # not the checker


def headings(page: Path) -> list[str]:
    """The headings of a markdown page, outside code blocks."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return [m.group(1).strip() for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)]


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: ``Stopping (Ctrl-C)`` -> ``stopping-ctrl-c``."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for heading in headings(page):
        base = anchor(heading)
        n = seen.get(base, 0)
        found.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return found


def names(heading: str) -> set[str]:
    """What a citation may quote of a heading: all of it, its part before ': ', or all of it
    but a trailing parenthesis."""
    plain = heading.replace("`", "")
    return {heading, plain, plain.split(": ", 1)[0], re.sub(r"\s*\([^()]*\)$", "", plain)}


def links(page: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return [m.group(1) for m in re.finditer(r"\]\(([^)\s]+)\)", text)
            if not re.match(r"[a-z]+:", m.group(1))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_to_a_file_and_heading(page):
    assert links(page) or page.name == "lab-notes.md", f"{page.name} links nowhere"
    for link in links(page):
        path, _, fragment = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        assert target.exists(), f"{page.relative_to(ROOT)}: {link}: no file {path}"
        if fragment:
            assert fragment in anchors(target), \
                f"{page.relative_to(ROOT)}: {link}: no heading #{fragment} in {path or page.name}"


def test_the_readme_links_every_docs_page():
    linked = {Path(link.partition("#")[0]).name for link in links(ROOT / "README.md")}
    assert {p.name for p in (ROOT / "docs").glob("*.md")} <= linked


def citations(text: str) -> list[tuple[str, str]]:
    """(file, section) of every ``<file>.md, "<Section>"`` in a source file's text, with the
    quoted text joined across wrapped comment or docstring lines."""
    found = []
    for m in re.finditer(r"(?<![\w/.-])((?:docs/[\w-]+|README|bench/README)\.md),\s*(?:#\s*)?\"([^\"]+)\"", text):
        found.append((m.group(1), re.sub(r"\s*\n\s*(?:#\s*)?", " ", m.group(2))))
    return found


def test_every_section_cited_in_code_is_a_heading_of_that_file():
    cited = [(source, path, section) for source in CITING for path, section in citations(source.read_text())]
    assert len(cited) >= 30
    for source, path, section in cited:
        target = ROOT / path
        assert target.exists(), f"{source.relative_to(ROOT)} cites {path}, which does not exist"
        quotable = set().union(*(names(h) for h in headings(target)))
        assert section in quotable, f"{source.relative_to(ROOT)} cites {path}, \"{section}\": no such heading"


def test_no_citation_names_a_section_without_its_file():
    for source in CITING:
        for m in re.finditer(r"\bREADME(?!\.md|'s)[,]?\s*\"([^\"]+)\"", source.read_text()):
            pytest.fail(f"{source.relative_to(ROOT)}: README \"{m.group(1)}\" names no file: "
                        "write <file>.md, \"Heading\"")


def test_the_checks_catch_what_they_are_for():
    assert anchor("Stopping (Ctrl-C)") == "stopping-ctrl-c"
    assert anchor("Ray's fast paths") == "rays-fast-paths"
    assert "Memory" in names("Memory: eager, lazy and lru under a byte budget")
    assert "Metrics on vs off" in names("Metrics on vs off (`bench/metrics_overhead.py`)")
    assert citations('(docs/performance.md, "Router\n    # replicas")') == [("docs/performance.md", "Router replicas")]
