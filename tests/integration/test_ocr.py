"""The OCR pipeline over HTTP: a real image in, the printed text out, as rapidocr reads it."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
import requests
from PIL import Image, ImageDraw, ImageFont

pytestmark = pytest.mark.integration

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "ocr_sample.png"
FONT = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"


def ocr(server: str, image: bytes, request_id: str | None = None) -> requests.Response:
    body = {"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES",
                        "parameters": {"content_type": "base64"}, "data": [base64.b64encode(image).decode()]}]}
    if request_id:
        body["id"] = request_id
    return requests.post(f"{server}/v2/models/ocr/infer", json=body, timeout=120)


def outputs(response: requests.Response) -> dict[str, dict]:
    assert response.status_code == 200, response.text
    return {o["name"]: o for o in response.json()["outputs"]}


def jpeg_of(lines: list[str]) -> bytes:
    image = Image.new("RGB", (640, 200), "white")
    draw = ImageDraw.Draw(image)
    for i, line in enumerate(lines):
        draw.text((30, 40 + 80 * i), line, fill="black", font=ImageFont.truetype(FONT, 36))
    buf = io.BytesIO()
    image.save(buf, "JPEG", quality=95)
    return buf.getvalue()


def test_png_sample_returns_its_text_in_reading_order_like_rapidocr(server):
    from rapidocr_onnxruntime import RapidOCR

    image = SAMPLE.read_bytes()
    out = outputs(ocr(server, image, "ocr-1"))
    assert out["text"]["data"] == ["Hello World 2026", "The quick brown fox"]
    reference, _ = RapidOCR()(image)
    assert out["text"]["data"] == [r[1] for r in reference]
    boxes = np.array(out["boxes"]["data"], np.float32).reshape(out["boxes"]["shape"])
    assert boxes.shape == (2, 4, 2) and out["boxes"]["datatype"] == "FP32"
    np.testing.assert_allclose(boxes, np.array([r[0] for r in reference], np.float32), atol=2.0)
    assert out["scores"]["shape"] == [2] and all(0.5 < s <= 1.0 for s in out["scores"]["data"])


def rapidocr_texts(image: bytes) -> list[str]:
    from rapidocr_onnxruntime import RapidOCR

    result, _ = RapidOCR()(image)
    return [r[1] for r in result or []]


def test_jpeg_reads_like_rapidocr(server):
    image = jpeg_of(["Ray Serve 42", "KServe v2 protocol"])
    texts = outputs(ocr(server, image))["text"]["data"]
    assert texts == rapidocr_texts(image)
    assert " ".join(texts) == "Ray Serve 42 KServe v2 protocol"


def test_upside_down_image_is_flipped_by_the_angle_classifier(server):
    buf = io.BytesIO()
    Image.open(SAMPLE).rotate(180).save(buf, "PNG")
    texts = outputs(ocr(server, buf.getvalue()))["text"]["data"]
    assert texts == rapidocr_texts(buf.getvalue()) == ["The quick brown fox", "Hello World 2026"]


def test_blank_image_returns_empty_outputs(server):
    buf = io.BytesIO()
    Image.new("RGB", (320, 240), "white").save(buf, "PNG")
    out = outputs(ocr(server, buf.getvalue()))
    assert out["text"]["shape"] == [0] and out["boxes"]["shape"] == [0, 4, 2] and out["scores"]["shape"] == [0]


def test_tritonclient_sends_the_image_as_bytes(server):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.removeprefix("http://"))
    tensor = httpclient.InferInput("image", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([SAMPLE.read_bytes()], dtype=np.object_), binary_data=True)
    result = client.infer("ocr", [tensor], outputs=[httpclient.InferRequestedOutput("text", binary_data=False)])
    assert [t.decode() if isinstance(t, bytes) else t for t in result.as_numpy("text")] == \
        ["Hello World 2026", "The quick brown fox"]


def test_the_pipelines_statistics_count_its_requests_as_triton_counts_an_ensembles(server):
    """An ensemble's statistics in Triton: one inference and one execution per request (its
    success count). Counts reach the statistics within a flush interval: polled."""
    import time

    def counts() -> tuple[int, int, int]:
        stats = requests.get(f"{server}/v2/models/ocr/stats", timeout=30).json()["model_stats"][0]
        return stats["inference_stats"]["success"]["count"], stats["inference_count"], stats["execution_count"]

    time.sleep(1.0)  # the earlier tests' counts flushed
    before = counts()
    for _ in range(2):
        outputs(ocr(server, SAMPLE.read_bytes()))
    deadline = time.monotonic() + 30
    while True:
        grown = [a - b for a, b in zip(counts(), before)]
        if min(grown) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert grown == [2, 2, 2]


@pytest.fixture(scope="module")
def strict_ocr(serve_instance, tmp_path_factory):
    """The OCR pipeline of a repository whose recognizer takes only widths that are multiples
    of 64 (``strict_recognizer_repository``), its steps in the pool (fewer deployments), at
    /ocrstep."""
    from deployments.app import delete_server, run_applications

    from ..unit.test_ocr_pipeline import strict_recognizer_repository
    from .conftest import wait_ready

    repo = strict_recognizer_repository(tmp_path_factory.mktemp("strict-ocr"))
    run_applications({"repository": str(repo.root), "pool": {"max_num_models_per_replica": 3},
                      "deployments": {step: {"mode": "pool"} for step in ("ocr_det", "ocr_cls", "ocr_rec")}},
                     name="ocrstep", route_prefix="/ocrstep")
    url = f"{serve_instance}/ocrstep"
    wait_ready(url)
    yield url
    delete_server("ocrstep")


def test_a_step_refusing_what_the_pipeline_made_of_the_image_answers_400_naming_the_step(strict_ocr):
    """It answered 500 ("pipeline 'ocr': step 'ocr_rec' rejected shape ..."): the recognizer's
    refusal (a line of this image comes out at a width it does not take) is the request's, 400."""
    r = ocr(strict_ocr, SAMPLE.read_bytes())
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error == ("model 'ocr': its step 'ocr_rec' refused what the pipeline made of this request (shapes "
                     "{'x': [2, 3, 48, 476]}): unexpected shape for input 'x' for model 'ocr_rec'. Expected "
                     "[-1,3,48,-1], got [2,3,48,476]; model 'ocr_rec' input 'x': axis 3 is 476, allowed [32, 3200] "
                     "and a multiple of 64 (shape [2, 3, 48, 476])"), error
    blank = io.BytesIO()
    Image.new("RGB", (320, 240), "white").save(blank, "PNG")  # no line: the recognizer is not called
    assert outputs(ocr(strict_ocr, blank.getvalue()))["text"]["shape"] == [0]  # it keeps serving
