"""The Ray-free OCR pipeline against real models (ModelHost, ONNX Runtime) and rapidocr itself."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import cv2
import numpy as np
import pytest
import yaml
from PIL import Image
from rapidocr_onnxruntime import RapidOCR

from deployments.pipelines import create_pipeline
from deployments.pipelines.ocr import (
    OcrParameters,
    OcrPipeline,
    decode_image,
    det_input_size,
    read_character_list,
)
from deployments.runtime.contract.errors import (ConfigError, InferenceError, InferenceTimeout, InvalidInput,
                                                 OverBudget)
from deployments.runtime.contract.repository import ModelRepository
from deployments.runtime.residency.host import ModelHost

ENGINES = Path(__file__).resolve().parents[2] / "engines"
HELLO = "Hello World 2026"
FOX = "The quick brown fox"
DOG = "jumps over the lazy dog"
NOT_AN_IMAGE = "input 'image' is not a decodable PNG or JPEG image"


class RecordingModels:
    """``infer`` backed by one ModelHost per OCR model; records each call's model and shape."""

    def __init__(self, repository) -> None:
        self.hosts = {n: ModelHost(repository.get(n), backend="onnxruntime").load()
                      for n in ("ocr_det", "ocr_cls", "ocr_rec")}
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    async def __call__(self, name: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        (array,) = inputs.values()
        self.calls.append((name, array.shape))
        return await asyncio.to_thread(self.hosts[name].infer, inputs)  # validates the profile

    def shapes(self, name: str) -> list[tuple[int, ...]]:
        return [shape for model, shape in self.calls if model == name]


@pytest.fixture(scope="module")
def models(model_repository):
    recording = RecordingModels(model_repository)
    yield recording
    for host in recording.hosts.values():
        host.unload()


@pytest.fixture
def pipeline(model_repository, models) -> OcrPipeline:
    models.calls.clear()
    return create_pipeline(model_repository, "ocr", models)


@pytest.fixture(scope="module")
def characters(model_repository) -> list[str]:
    return read_character_list(model_repository.get("ocr_rec").onnx_path())


@pytest.fixture(scope="module")
def rapidocr() -> RapidOCR:
    return RapidOCR()


def run(pipeline: OcrPipeline, data: bytes) -> dict[str, np.ndarray]:
    return asyncio.run(pipeline.run(data))


def texts(result: dict[str, np.ndarray]) -> list[str]:
    return [t.decode("utf-8") for t in result["text"]]


def reference(rapidocr: RapidOCR, data: bytes) -> tuple[list[str], np.ndarray, np.ndarray]:
    lines, _ = rapidocr(data)
    lines = lines or []
    return ([line[1] for line in lines], np.array([line[0] for line in lines], np.float32).reshape(-1, 4, 2),
            np.array([line[2] for line in lines], np.float32))


def assert_outputs_well_formed(result: dict[str, np.ndarray]) -> None:
    n = len(result["text"])
    assert result["text"].dtype == np.object_ and result["text"].shape == (n,)
    assert all(isinstance(t, bytes) for t in result["text"])
    assert result["boxes"].dtype == np.float32 and result["boxes"].shape == (n, 4, 2)
    assert result["scores"].dtype == np.float32 and result["scores"].shape == (n,)
    assert ((result["scores"] > 0) & (result["scores"] <= 1)).all()


def assert_calls_fit_profiles(models: RecordingModels, pipeline: OcrPipeline) -> None:
    for _, _, h, w in models.shapes("ocr_det"):
        assert h % 32 == 0 and w % 32 == 0 and 32 <= h <= 2016 and 32 <= w <= 2016
    for batch, *_ in models.shapes("ocr_cls"):
        assert batch <= pipeline.cls.max_batch_size
    for batch, _, _, w in models.shapes("ocr_rec"):
        assert batch <= 6 and w <= 3200


@pytest.mark.parametrize("lines, fmt, mode", [
    ([HELLO], "PNG", "RGB"),
    ([HELLO, FOX, DOG], "PNG", "RGB"),
    ([HELLO, FOX, DOG], "JPEG", "RGB"),
    ([DOG, FOX], "PNG", "L"),
], ids=["png-one-line", "png-three-lines", "jpeg-three-lines", "png-grey"])
def test_printed_lines_read_as_rendered_and_as_rapidocr(pipeline, models, rapidocr, image_maker, lines, fmt, mode):
    data = image_maker.render_text(lines, fmt=fmt, mode=mode)
    result = run(pipeline, data)
    ref_texts, ref_boxes, ref_scores = reference(rapidocr, data)

    assert texts(result) == lines == ref_texts
    assert_outputs_well_formed(result)
    np.testing.assert_allclose(result["boxes"], ref_boxes, atol=1.0)
    np.testing.assert_allclose(result["scores"], ref_scores, atol=1e-4)
    assert_calls_fit_profiles(models, pipeline)
    assert [m for m, _ in models.calls] == ["ocr_det", "ocr_cls", "ocr_rec"]


def test_boxes_are_corner_points_in_input_pixels(pipeline, image_maker):
    result = run(pipeline, image_maker.render_text([HELLO], size=(800, 600), origin=(40, 60)))
    (box,) = result["boxes"]
    x0, y0 = box.min(axis=0)
    x1, y1 = box.max(axis=0)
    assert 30 <= x0 <= 45 and 55 <= y0 <= 70      # text drawn from (40, 60), ~40 px high
    assert 300 <= x1 <= 400 and 95 <= y1 <= 110
    assert box[0, 0] < box[1, 0] and box[1, 1] < box[2, 1]   # top-left, top-right, bottom-right, ...


def test_upside_down_lines_are_turned_by_the_angle_classifier(pipeline, models, rapidocr, image_maker, characters):
    data = image_maker.render_text([HELLO, FOX], upside_down=True)
    result = run(pipeline, data)
    ref_texts, ref_boxes, _ = reference(rapidocr, data)

    assert texts(result) == [FOX, HELLO] == ref_texts         # upside down: FOX is now on top
    np.testing.assert_allclose(result["boxes"], ref_boxes, atol=1.0)
    assert models.shapes("ocr_cls") == [(2, 3, 48, 192)]

    never_turn = OcrPipeline(models, characters, det=pipeline.det, cls=pipeline.cls, rec=pipeline.rec,
                             parameters={"cls_thresh": 1.0})
    assert texts(run(never_turn, data)) != [FOX, HELLO]   # the classifier is what fixes it


def test_wide_strip_is_scaled_into_the_detector_profile(pipeline, models, rapidocr, image_maker):
    # rapidocr scales the shorter side to 736: 900x200 -> 3328x736, beyond the profile's 2016.
    data = image_maker.render_text([HELLO], size=(900, 200), font_px=48, origin=(40, 70))
    result = run(pipeline, data)
    ref_texts, ref_boxes, ref_scores = reference(rapidocr, data)

    assert models.shapes("ocr_det") == [(1, 3, 448, 2016)]
    assert texts(result) == [HELLO] == ref_texts
    np.testing.assert_allclose(result["boxes"], ref_boxes, atol=6.0)
    np.testing.assert_allclose(result["scores"], ref_scores, atol=0.05)


def test_recognizer_batches_follow_rec_batch_size_and_classifier_max_batch(pipeline, models, rapidocr, image_maker):
    lines = [f"Line {n} of eight" for n in ("one", "two", "three", "four", "five", "six", "seven", "eight")]
    data = image_maker.render_text(lines, size=(600, 800), font_px=36, origin=(40, 30), line_gap_px=95)
    result = run(pipeline, data)

    assert texts(result) == lines == reference(rapidocr, data)[0]
    assert [s[0] for s in models.shapes("ocr_cls")] == [8]        # max_batch_size 32
    assert sorted(s[0] for s in models.shapes("ocr_rec")) == [2, 6]   # rec_batch_size 6, as rapidocr


def test_committed_sample_png_reads_its_two_lines(pipeline, image_maker):
    data = image_maker.SAMPLE.read_bytes()
    assert len(data) < 8_000
    assert texts(run(pipeline, data)) == list(image_maker.SAMPLE_LINES)


def test_blank_image_gives_empty_outputs(pipeline, image_maker):
    result = run(pipeline, image_maker.render_text([], size=(300, 200)))
    assert_outputs_well_formed(result)
    assert len(result["text"]) == 0


def test_tensor_form_takes_image_bytes_of_shape_1(pipeline, image_maker):
    data = image_maker.render_text([HELLO])
    result = asyncio.run(pipeline.infer({"image": np.array([data], dtype=np.object_)}))
    assert texts(result) == [HELLO]
    with pytest.raises(InvalidInput, match=r"shape must be \[1\]"):
        asyncio.run(pipeline.infer({"image": np.array([data, data], dtype=np.object_)}))
    with pytest.raises(InvalidInput, match="expects inputs"):
        asyncio.run(pipeline.infer({"picture": np.array([data], dtype=np.object_)}))


def _encoded(array: np.ndarray, ext: str) -> bytes:
    ok, buf = cv2.imencode(ext, array)
    assert ok
    return buf.tobytes()


@pytest.mark.parametrize("data", [
    b"",
    b"hello, not an image",
    b"\x89PNG\r\n\x1a\n" + b"\0" * 40,                      # PNG signature, garbage after
    _encoded(np.full((20, 20, 3), 255, np.uint8), ".bmp"),   # decodable, but not PNG/JPEG
], ids=["empty", "text", "broken-png", "bmp"])
def test_undecodable_bytes_raise_invalid_input(pipeline, data):
    with pytest.raises(InvalidInput, match=NOT_AN_IMAGE):
        run(pipeline, data)


def test_truncated_png_raises_invalid_input(pipeline, image_maker):
    data = image_maker.render_text([HELLO])
    with pytest.raises(InvalidInput, match=NOT_AN_IMAGE):
        run(pipeline, data[: len(data) // 3])


def test_oversized_image_is_refused_before_decoding():
    data = _encoded(np.zeros((1000, 1000), np.uint8), ".png")
    with pytest.raises(InvalidInput, match="1000x1000 pixels; at most 999,999"):
        decode_image(data, max_pixels=999_999)


def test_decode_composites_alpha_over_white_and_expands_grey_and_16_bit():
    rgba = Image.new("RGBA", (4, 2), (0, 0, 0, 0))
    rgba.putpixel((0, 0), (255, 0, 0, 255))
    out = io.BytesIO()
    rgba.save(out, format="PNG")
    image = decode_image(out.getvalue())
    assert image.shape == (2, 4, 3) and image.dtype == np.uint8
    assert image[0, 0].tolist() == [0, 0, 255]       # BGR red
    assert image[1, 3].tolist() == [255, 255, 255]   # transparent -> white

    grey16 = _encoded(np.full((3, 5), 0x8000, np.uint16), ".png")
    image = decode_image(grey16)
    assert image.shape == (3, 5, 3) and image.dtype == np.uint8 and (image == 0x80).all()


def test_character_list_fits_the_recognizer_classes(model_repository, characters):
    assert len(characters) + 2 == model_repository.get("ocr_rec").config.outputs[0].dims[-1] == 6625
    with pytest.raises(ConfigError, match="no 'character' metadata"):
        read_character_list(model_repository.get("ocr_cls").onnx_path())


@pytest.mark.parametrize("h, w, expected", [
    (600, 800, (736, 992)),      # rapidocr's size: shorter side 736, multiples of 32
    (200, 400, (736, 1472)),
    (2000, 1500, (1984, 1504)),  # already large: only rounded (half to even) to multiples of 32
    (200, 900, (448, 2016)),     # rapidocr: 736 x 3328 -> scaled to fit the 2016 max
    (2000, 300, (2016, 288)),    # tall receipt
    (30, 240, (224, 2016)),
])
def test_det_input_size_is_rapidocr_size_within_the_profile(model_repository, h, w, expected):
    bounds = model_repository.get("ocr_det").config.inputs[0].bounds()
    assert det_input_size(h, w, OcrParameters(), bounds) == expected


def strict_recognizer_repository(root: Path) -> ModelRepository:
    """A repository of the OCR models whose recognizer takes only widths that are multiples of
    64, a constraint the pipeline does not adapt its lines to (it does for the profile's range):
    a line's width then depends on the image, and the recognizer refuses most (400)."""
    for name in ("ocr", "ocr_det", "ocr_cls", "ocr_rec"):
        raw = yaml.safe_load((ENGINES / name / "config.yaml").read_text())
        if name == "ocr_rec":
            raw["inputs"][0]["multiple_of"] = [1, 1, 1, 64]
        (root / name).mkdir()
        (root / name / "config.yaml").write_text(yaml.safe_dump(raw))
        if name != "ocr":
            (root / name / "1").mkdir()
            (root / name / "1" / "model.onnx").symlink_to(ENGINES / name / "1" / "model.onnx")
    return ModelRepository(root)


def test_a_step_refusing_what_the_pipeline_made_of_the_image_is_400_naming_the_step(tmp_path, image_maker):
    """It was an InferenceError (500 "step 'ocr_rec' rejected shape"): the step's refusal is
    about this request's image, and the client's fault stays 400, with the step named."""
    repo = strict_recognizer_repository(tmp_path)
    models = RecordingModels(repo)
    pipeline = create_pipeline(repo, "ocr", models)
    with pytest.raises(InvalidInput) as refused:
        run(pipeline, image_maker.render_text([HELLO]))
    ((_, (_, _, _, width)),) = [c for c in models.calls if c[0] == "ocr_rec"]
    assert width % 64
    assert refused.value.message.startswith(
        f"model 'ocr': its step 'ocr_rec' refused what the pipeline made of this request (shapes "
        f"{{'x': [1, 3, 48, {width}]}}): unexpected shape for input 'x' for model 'ocr_rec'")
    assert refused.value.message.endswith(f"axis 3 is {width}, allowed [32, 3200] and a multiple of 64 "
                                          f"(shape [1, 3, 48, {width}])")


@pytest.mark.parametrize("error, status", [
    (OverBudget("model 'ocr_det' needs 90.0 MiB, more than the budget"), 503),
    (InferenceTimeout("model 'ocr_det': no execution context within 1 s"), 504),
    (InferenceError("model 'ocr_det': ONNX Runtime run failed"), 500),
])
def test_a_steps_capacity_timeout_and_fault_pass_on_with_their_status(model_repository, image_maker, error, status):
    from deployments.protocol.errors import error_status

    async def failing(name, inputs):
        raise error

    with pytest.raises(type(error)) as raised:
        run(create_pipeline(model_repository, "ocr", failing), image_maker.render_text([HELLO]))
    assert error_status(raised.value, log=False) == (status, error.message)


def test_unknown_parameter_is_a_config_error(pipeline, models, characters):
    with pytest.raises(ConfigError, match="parameters.cls_treshold"):
        OcrPipeline(models, characters, det=pipeline.det, cls=pipeline.cls, rec=pipeline.rec,
                    parameters={"cls_treshold": 0.5})


def test_character_list_not_matching_the_recognizer_is_a_config_error(pipeline, models, characters):
    with pytest.raises(ConfigError, match="6625 output classes"):
        OcrPipeline(models, characters[:-1], det=pipeline.det, cls=pipeline.cls, rec=pipeline.rec)


def test_detector_profile_without_a_multiple_of_32_is_a_config_error(pipeline, models, characters):
    p = pipeline
    spec = p.det.inputs[0]
    narrow = spec.model_copy(update={"profile": spec.profile.model_copy(
        update={"min": (1, 3, 33, 33), "opt": (1, 3, 40, 40), "max": (1, 3, 63, 63)})})
    det = p.det.model_copy(update={"inputs": (narrow,)})
    with pytest.raises(ConfigError, match="multiples of 32"):
        OcrPipeline(models, characters, det=det, cls=p.cls, rec=p.rec)


@pytest.mark.parametrize("ratios, width", [
    ([2.0, 5.0], 320),      # rapidocr's floor: 48 x 320/48
    ([9.5], 456),           # 48 x the widest line's aspect ratio
    ([66.0, 200.0], 3200),  # clamped to the profile's max width; wider lines are squeezed
])
def test_recognizer_batch_width_stays_within_the_profile(pipeline, ratios, width):
    assert int(48 * pipeline._rec_ratio(ratios)) == width


# ---------------------------------------------------------------------------- transparency, EXIF


def words(result: dict[str, np.ndarray]) -> list[str]:
    """The lines without spaces: whether PP-OCR's recognizer emits a space between two words
    depends on the rendering's pixels, which these tests vary (transparency, JPEG, rotation)."""
    return [t.replace(" ", "") for t in texts(result)]


def _png(image: Image.Image, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG", **options)
    return out.getvalue()


def _white_text_on_transparent(mode: str, lines=(HELLO,), size=(800, 200)) -> bytes:
    """White DejaVu text on a fully transparent background, stored as ``mode``."""
    from PIL import ImageDraw, ImageFont

    font = ImageFont.truetype("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf", 40)
    if mode == "P":  # a palette: index 0 transparent black, index 1 white
        image = Image.new("P", size, 0)
        image.putpalette([0, 0, 0, 255, 255, 255])
        ImageDraw.Draw(image).text((40, 60), lines[0], fill=1, font=font)
        return _png(image, transparency=0)
    image = Image.new("RGBA", size, (0, 0, 0, 0))
    draw = ImageDraw.Draw(image)
    for i, line in enumerate(lines):
        draw.text((40, 60 + 90 * i), line, fill=(255, 255, 255, 255), font=font)
    if mode == "RGBA16":  # 16 bits per channel, through OpenCV (Pillow writes no 16-bit RGBA)
        rgba = np.asarray(image).astype(np.uint16) * 257
        return _encoded(cv2.cvtColor(rgba, cv2.COLOR_RGBA2BGRA), ".png")
    return _png(image.convert(mode))


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P", "RGBA16"])
def test_white_text_on_a_transparent_background_is_read(pipeline, mode):
    data = _white_text_on_transparent(mode)
    assert words(run(pipeline, data)) == [HELLO.replace(" ", "")]


def test_dark_text_on_transparent_and_an_opaque_card_with_transparent_margins_still_read(pipeline):
    from PIL import ImageDraw, ImageFont

    font = ImageFont.truetype("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf", 40)
    dark = Image.new("RGBA", (800, 200), (255, 255, 255, 0))
    ImageDraw.Draw(dark).text((40, 60), HELLO, fill=(0, 0, 0, 255), font=font)
    card = Image.new("RGBA", (800, 200), (0, 0, 0, 0))
    ImageDraw.Draw(card).rounded_rectangle((10, 10, 790, 190), radius=40, fill=(250, 250, 240, 255))
    ImageDraw.Draw(card).text((40, 60), FOX, fill=(20, 20, 20, 255), font=font)
    assert words(run(pipeline, _png(dark))) == [HELLO.replace(" ", "")]
    assert words(run(pipeline, _png(card))) == [FOX.replace(" ", "")]
    assert decode_image(_png(card))[100, 400].tolist() == [240, 250, 250]  # the card keeps its colour


# PIL.ImageOps.exif_transpose's turn per orientation, and its inverse (how a camera stores it).
_STORE = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
          5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_90, 7: Image.Transpose.TRANSVERSE,
          8: Image.Transpose.ROTATE_270}


def _stored_with_orientation(displayed: Image.Image, orientation: int, fmt: str) -> bytes:
    stored = displayed.transpose(_STORE[orientation]) if orientation in _STORE else displayed
    exif = Image.Exif()
    exif[0x0112] = orientation
    out = io.BytesIO()
    stored.save(out, format=fmt, exif=exif, **({"quality": 95} if fmt == "JPEG" else {}))
    return out.getvalue()


@pytest.mark.parametrize("orientation", range(1, 9))
def test_decode_applies_every_exif_orientation_as_pil_exif_transpose(orientation):
    from PIL import ImageOps

    pixels = np.random.default_rng(orientation).integers(0, 256, (3, 5, 3), dtype=np.uint8)
    displayed = Image.fromarray(pixels)
    data = _stored_with_orientation(displayed, orientation, "PNG")
    want = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))[:, :, ::-1]
    np.testing.assert_array_equal(decode_image(data), want)
    np.testing.assert_array_equal(decode_image(data), pixels[:, :, ::-1])
    stored = decode_image(data, exif_orientation=False)
    assert stored.shape == (np.asarray(displayed.transpose(_STORE[orientation])) if orientation in _STORE
                            else pixels).shape


def test_decode_reads_size_and_orientation_without_decoding_pixels_in_pillow(monkeypatch):
    """An image over the pixel limit is refused from its header, and the EXIF orientation of a
    PNG or JPEG is read without Pillow decoding its pixels (OpenCV decodes them, once): a small
    PNG declaring 20 million pixels was decoded whole by ``getexif()`` before."""
    from PIL import ImageFile

    def no_pixels(self):
        raise AssertionError("Pillow decoded the pixels")

    over = _png(Image.new("L", (5000, 4000), 255))
    displayed = Image.fromarray(np.random.default_rng(0).integers(0, 256, (3, 5, 3), dtype=np.uint8))
    sideways = {fmt: _stored_with_orientation(displayed, 6, fmt) for fmt in ("PNG", "JPEG")}
    monkeypatch.setattr(ImageFile.ImageFile, "load", no_pixels)
    with pytest.raises(InvalidInput, match=r"^input 'image' is 5000x4000 pixels; at most 16,777,216 pixels are accepted$"):
        decode_image(over)
    for data in sideways.values():
        assert decode_image(data).shape == (3, 5, 3)  # stored 5 x 3, displayed 3 rows x 5 columns


def test_a_side_over_opencvs_limit_is_named_not_called_undecodable():
    strip = _png(Image.new("L", (1_100_000, 1), 255))  # 1.1 M pixels: within the pixel limit
    with pytest.raises(InvalidInput, match=r"^input 'image' is 1100000x1 pixels; a side of at most 1,048,576 "
                                          r"pixels is accepted$"):
        decode_image(strip)


@pytest.mark.parametrize("orientation", [6, 8, 5])  # all eight: test_decode_applies_every_exif_orientation
def test_a_jpeg_stored_sideways_reads_with_boxes_in_the_displayed_frame(pipeline, image_maker, orientation):
    displayed = Image.open(io.BytesIO(image_maker.render_text([HELLO, FOX], size=(800, 300))))
    upright = run(pipeline, _stored_with_orientation(displayed, 1, "JPEG"))
    turned = run(pipeline, _stored_with_orientation(displayed, orientation, "JPEG"))
    assert words(turned) == words(upright) == [HELLO.replace(" ", ""), FOX.replace(" ", "")]
    np.testing.assert_allclose(turned["boxes"], upright["boxes"], atol=4.0)


# ---------------------------------------------------------------------------- strips

STRIP_TEXT = "The quick brown fox jumps over the lazy dog 0123456789 and more words here"


def _strip(width: int, height: int, vertical: bool) -> bytes:
    """One line of 36-pixel text in a ``width`` x ``height`` strip; turned 90 degrees
    counter-clockwise (a ``height`` x ``width`` tall strip) when ``vertical``."""
    from PIL import ImageDraw, ImageFont

    image = Image.new("RGB", (width, height), "white")
    font = ImageFont.truetype("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf", 36)
    ImageDraw.Draw(image).text((10, (height - 36) // 2 - 2), STRIP_TEXT, fill="black", font=font)
    if vertical:
        image = image.rotate(90, expand=True)
    return _png(image)


@pytest.mark.parametrize("width, height, vertical", [
    (1600, 60, False), (2100, 60, False), (1600, 60, True), (2100, 60, True)],
    ids=["1600x60", "2100x60", "60x1600", "60x2100"])
def test_one_line_in_a_long_strip_is_read_whole(pipeline, models, width, height, vertical):
    # The angle classifier squeezed the whole line into 48 x 192 and took it for upside down
    # (1600x60: nothing sensible; rapidocr fails on 2100x60); a tall strip had no margin and
    # came apart into letters (rapidocr too).
    import difflib

    result = run(pipeline, _strip(width, height, vertical))
    assert len(result["text"]) == 1, texts(result)
    similarity = difflib.SequenceMatcher(None, words(result)[0], STRIP_TEXT.replace(" ", "")).ratio()
    assert similarity >= 0.95, texts(result)
    assert_calls_fit_profiles(models, pipeline)
    x, y = result["boxes"][0][:, 0], result["boxes"][0][:, 1]
    assert (x >= 0).all() and (x <= (height if vertical else width)).all()
    assert (y >= 0).all() and (y <= (width if vertical else height)).all()
