"""Unit-test fixtures: text-image rendering for the OCR tests."""

from __future__ import annotations

import importlib.util
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
