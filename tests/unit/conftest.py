"""Unit-test fixtures: text-image rendering for the OCR tests; the application's and Serve's
loggers as each test found them."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from types import ModuleType

import pytest

DATA = Path(__file__).resolve().parents[1] / "data"


def _load_image_maker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_ocr_sample", DATA / "make_ocr_sample.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def image_maker() -> ModuleType:
    """``tests/data/make_ocr_sample.py``: ``render_text(lines, ...) -> bytes``, ``SAMPLE``,
    ``SAMPLE_LINES``."""
    return _load_image_maker()


@pytest.fixture(autouse=True)
def _loggers_restored():
    """A test that builds a replica in this process (``ModelDeployment``, the pool) routes the
    application's log lines through Serve's logger (``deployments.logs.show_on_terminal``:
    ``propagate`` off, a forwarding handler); restored after each test, so a later test's
    ``caplog`` sees each record once."""
    loggers = [logging.getLogger(name) for name in ("deployments", "ray.serve")]
    saved = [(lg, lg.handlers[:], lg.filters[:], lg.level, lg.propagate) for lg in loggers]
    yield
    for lg, handlers, filters, level, propagate in saved:
        lg.handlers[:] = handlers
        lg.filters[:] = filters
        lg.setLevel(level)
        lg.propagate = propagate
