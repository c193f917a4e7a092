"""Shared fixtures: the real model repository, prepared once per session.

``prepared_engines`` runs ``deployments.runtime.tools.prepare`` on ``engines/`` (idempotent: about 0.3 s when
the files are already there; the first time it downloads the rapidocr wheel from PyPI).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from deployments.runtime.tools.prepare import prepare
from deployments.runtime.contract.repository import ModelRepository

REPO_ROOT = Path(__file__).resolve().parents[1]
ENGINES = REPO_ROOT / "engines"
WHEEL_CACHE = ENGINES / ".cache"


@pytest.fixture(scope="session")
def prepared_engines() -> Path:
    """``engines/`` with every model file fetched or generated."""
    prepare(ENGINES, WHEEL_CACHE, progress=lambda line: None)
    return ENGINES


@pytest.fixture(scope="session")
def model_repository(prepared_engines: Path) -> ModelRepository:
    """``ModelRepository`` over the prepared ``engines/``."""
    return ModelRepository(prepared_engines)


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory):
    """A real S3 server (``tests/seaweed.py``: SeaweedFS on loopback ports, random credentials,
    bucket ``models``), stopped by its process id at the end of the session."""
    from .seaweed import SeaweedFS

    store = SeaweedFS(tmp_path_factory.mktemp("seaweedfs")).start()
    yield store
    store.stop()
