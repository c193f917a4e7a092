"""Render printed-text test images for the OCR pipeline; writes ``tests/data/ocr_sample.png``.

``python tests/data/make_ocr_sample.py`` regenerates the committed sample (the README's curl
example sends it). The unit tests import ``render_text`` through ``tests/unit/conftest.py``.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Sequence

from PIL import Image, ImageDraw, ImageFont

FONT = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"
SAMPLE = Path(__file__).with_name("ocr_sample.png")
SAMPLE_LINES = ("Hello World 2026", "The quick brown fox")


def render_text(lines: Sequence[str], size: tuple[int, int] = (800, 600), font_px: int = 40,
                origin: tuple[int, int] = (40, 60), line_gap_px: int = 90, fmt: str = "PNG",
                mode: str = "RGB", upside_down: bool = False, jpeg_quality: int = 95) -> bytes:
    """Black DejaVu Sans text on white, one line every ``line_gap_px`` from ``origin``;
    returns the encoded file (``fmt`` PNG or JPEG), rotated 180 degrees if ``upside_down``."""
    image = Image.new(mode, size, "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.truetype(FONT, font_px)
    for i, line in enumerate(lines):
        draw.text((origin[0], origin[1] + i * line_gap_px), line, fill="black", font=font)
    if upside_down:
        image = image.rotate(180)
    out = io.BytesIO()
    options = {"quality": jpeg_quality} if fmt == "JPEG" else {"optimize": True}
    image.save(out, format=fmt, **options)
    return out.getvalue()


def render_sample() -> bytes:
    """The committed sample: two lines, 8-bit grey, 400 x 200 (no detector clamping)."""
    return render_text(SAMPLE_LINES, size=(400, 200), font_px=28, origin=(20, 50),
                       line_gap_px=60, mode="L")


if __name__ == "__main__":
    SAMPLE.write_bytes(render_sample())
    print(f"wrote {SAMPLE} ({SAMPLE.stat().st_size} bytes)")
