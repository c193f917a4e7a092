"""The OCR pipeline: decode -> detect (``ocr_det``) -> crop -> classify angle (``ocr_cls``) ->
recognize (``ocr_rec``), like a Triton ensemble. Ray-free: the models are reached through an
async ``infer(model_name, inputs)`` callable that the caller supplies (the Ray layer passes one
that calls the model deployments; tests pass one backed by ``ModelHost``).

Contract (``engines/ocr/config.yaml``)::

    input  image   BYTES [1]        one PNG or JPEG file's bytes
    output text    BYTES [N]        UTF-8 text of each line (numpy object array of bytes)
           boxes   FP32  [N, 4, 2]  corner points (x, y) in input-image pixels: top-left,
                                    top-right, bottom-right, bottom-left
           scores  FP32  [N]        mean per-character probability, in [text_score, 1]
    lines in reading order (top to bottom, then left to right).

The pre/post-processing is rapidocr-onnxruntime 1.4.4's own code (Apache-2.0), reused rather
than rewritten so results match ``rapidocr_onnxruntime.RapidOCR()(image)``:

* ``RapidOCR.preprocess`` (``reduce_max_side``/``increase_min_side``), ``maybe_add_letterbox``,
  ``sorted_boxes``, ``get_crop_img_list`` (perspective crop of each rotated box),
  ``_get_origin_points`` (boxes back to input pixels) -- ``rapidocr_onnxruntime/main.py``;
* ``DetPreProcess.normalize/permute``, ``DBPostProcess`` (DB binarization, unclip) and
  ``TextDetector.filter_tag_det_res`` -- ``ch_ppocr_det/``;
* ``TextClassifier.resize_norm_img`` and ``ClsPostProcess`` -- ``ch_ppocr_cls/``;
* ``TextRecognizer.resize_norm_img`` and ``CTCLabelDecode`` -- ``ch_ppocr_rec/``.

Their methods are called on instances built without an ONNX Runtime session (see
``_without_session``): only the attributes those methods read are set.

Differences from rapidocr, each forced by the serving contract:

* Every model call fits its config's optimization profile. Detection: rapidocr scales the
  shorter side to 736 (rounded to multiples of 32), which for a wide strip or a tall receipt gives
  sides beyond the profile max (2016); the pipeline then scales down further so both sides fit
  (multiples of 32, aspect kept). Recognition: the batch width ``48 x max aspect ratio`` is
  clamped to the profile's max width; wider lines are squeezed into it, as rapidocr's
  ``resize_norm_img`` does for lines wider than the batch width.
* Decoding uses ``cv2.imdecode`` and accepts only PNG and JPEG (``decode_image``). Transparency
  (RGBA, grey + alpha, a palette with transparency, 16-bit RGBA) is flattened so the text stays
  readable: over white, except when everything opaque is light (white text on a transparent
  background), where the alpha channel is the ink, giving dark text on white; rapidocr inverts some RGBA
  images only and erases white text in grey + alpha images. Palette PNGs are expanded to colour
  (rapidocr reads their palette indices as grey levels).
* Long strips (one line of text in 1600x60, 2100x60, or the same turned upright): the angle
  classifier sees a line more than 16 times as wide as high as up to 8 windows of its own 4:1
  aspect and averages them (rapidocr squeezes the whole line into 192 pixels, reads it as upside
  down and turns it: 1600x60 then gave no sensible text here, 2100x60 none in rapidocr); a tall
  strip gets left and right margins as rapidocr gives a wide one top and bottom ones (without
  them its letters came apart, in rapidocr too).
* EXIF orientation is honoured (``apply_exif_orientation``, default true; rapidocr ignores it):
  the image is turned as a viewer displays it (all eight orientations, mirrored ones included,
  as ``PIL.ImageOps.exif_transpose``), and ``boxes`` are in that displayed frame.
"""

from __future__ import annotations

import asyncio
import io
import math
import warnings
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, Optional, Sequence, TypeVar

import cv2
import numpy as np
import onnx
from google.protobuf.message import DecodeError
from PIL import Image, UnidentifiedImageError
from pydantic import Field
from rapidocr_onnxruntime.ch_ppocr_cls.text_cls import TextClassifier
from rapidocr_onnxruntime.ch_ppocr_cls.utils import ClsPostProcess
from rapidocr_onnxruntime.ch_ppocr_det.text_detect import TextDetector
from rapidocr_onnxruntime.ch_ppocr_det.utils import DBPostProcess, DetPreProcess
from rapidocr_onnxruntime.ch_ppocr_rec.text_recognize import TextRecognizer
from rapidocr_onnxruntime.ch_ppocr_rec.utils import CTCLabelDecode
from rapidocr_onnxruntime.main import RapidOCR
from rapidocr_onnxruntime.utils.process_img import ResizeImgError, add_round_letterbox

from . import PipelineParameters, map_bounded
from ..runtime.contract.config import ModelConfig, TensorSpec
from ..runtime.contract.errors import ConfigError, InvalidInput
from ..runtime.contract.repository import ModelRepository

InferFn = Callable[[str, dict[str, np.ndarray]], Awaitable[dict[str, np.ndarray]]]
"""``await infer(model_name, {input_name: array}) -> {output_name: array}``."""

T = TypeVar("T")
_CLS_MAX_WINDOWS = 8  # angle-classifier windows per long line (``OcrPipeline._cls_windows``)
_CLS_SQUEEZE_MAX = 4  # a line up to 4x the classifier's aspect is classified whole, as rapidocr does
CHARACTER_METADATA_KEY = "character"
IMAGE_FORMATS = ("PNG", "JPEG", "MPO")  # Pillow names camera JPEGs with a preview "MPO"


class OcrParameters(PipelineParameters):
    """The ``parameters`` of ``engines/ocr/config.yaml``; defaults are rapidocr-onnxruntime
    1.4.4's ``config.yaml`` (``Global``, ``Det``, ``Cls``, ``Rec`` sections)."""

    steps: tuple[str, str, str] = ("ocr_det", "ocr_cls", "ocr_rec")
    # Global
    text_score: float = Field(0.5, ge=0, le=1)
    min_height: int = Field(30, ge=1)
    width_height_ratio: float = 8
    max_side_len: int = Field(2000, ge=32)
    min_side_len: int = Field(30, ge=1)
    max_image_pixels: int = Field(16_777_216, ge=1)
    apply_exif_orientation: bool = True  # turn the image as its EXIF Orientation tag says
    # Det
    limit_side_len: int = Field(736, ge=32)
    limit_type: str = Field("min", pattern="^(min|max)$")
    det_thresh: float = Field(0.3, ge=0, le=1)
    box_thresh: float = Field(0.5, ge=0, le=1)
    max_candidates: int = Field(1000, ge=1)
    unclip_ratio: float = Field(1.6, gt=0)
    use_dilation: bool = True
    score_mode: str = Field("fast", pattern="^(fast|slow)$")
    # Cls
    cls_image_shape: tuple[int, int, int] = (3, 48, 192)
    cls_thresh: float = Field(0.9, ge=0, le=1)
    label_list: tuple[str, str] = ("0", "180")
    cls_batch_size: Optional[int] = Field(None, ge=1)  # None: ocr_cls's max_batch_size
    # Rec
    rec_image_shape: tuple[int, int, int] = (3, 48, 320)
    rec_batch_size: Optional[int] = Field(6, ge=1)  # rapidocr's rec_batch_num; None: max_batch_size



def read_character_list(onnx_path: str | Path) -> list[str]:
    """The recognizer's character list from the ONNX metadata key ``character`` (one per line).

    Read as rapidocr does (``str.splitlines``); ``CTCLabelDecode`` adds the CTC blank (index 0)
    and a space (last), so the model's class axis is ``len(list) + 2`` (6,625 for PP-OCRv4).

    Raises:
        ConfigError: the file cannot be read as ONNX or has no ``character`` metadata.
    """
    try:
        model = onnx.load(str(onnx_path), load_external_data=False)
    except (OSError, DecodeError) as e:
        raise ConfigError(f"{onnx_path}: cannot read ONNX model ({type(e).__name__})") from None
    for prop in model.metadata_props:
        if prop.key == CHARACTER_METADATA_KEY:
            return prop.value.splitlines()
    raise ConfigError(f"{onnx_path}: no '{CHARACTER_METADATA_KEY}' metadata; is this the OCR recognizer?")


def decode_image(data: bytes, max_pixels: int = 16_777_216, exif_orientation: bool = True) -> np.ndarray:
    """Decode a PNG or JPEG file into a BGR image ``(H, W, 3)`` uint8, as displayed.

    Grey is expanded to BGR, 16-bit is reduced to 8-bit, transparency is flattened
    (``flatten_alpha``), and with ``exif_orientation`` the EXIF Orientation tag (1-8) is applied
    (``(H, W)`` are then the displayed height and width).

    Raises:
        InvalidInput: empty bytes, another format, undecodable data, more than ``max_pixels`` or
            a side over ``MAX_SIDE`` (checked from the header, before any pixel is decoded).
    """
    not_image = (f"input 'image' is not a decodable PNG or JPEG image ({len(data)} bytes); send the "
                 "file's bytes base64-encoded with parameters {\"content_type\": \"base64\"} in JSON, "
                 "or as binary tensor data")
    too_big = f"input 'image' declares too many pixels; at most {max_pixels:,} pixels are accepted"
    if not data:
        raise InvalidInput("input 'image' is not a decodable PNG or JPEG image (it is empty)")
    try:  # header only: the format, the size and the orientation, before any pixel is decoded
        with warnings.catch_warnings():  # Pillow's bomb warning: the size is checked here, with an answer
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            header = Image.open(io.BytesIO(data))
        with header:
            fmt, (width, height) = header.format, header.size
            if fmt not in IMAGE_FORMATS:
                raise InvalidInput(f"input 'image' is not a decodable PNG or JPEG image (it is {fmt})")
            if width * height > max_pixels:
                raise InvalidInput(
                    f"input 'image' is {width}x{height} pixels; at most {max_pixels:,} pixels are accepted")
            orientation = _orientation(header) if exif_orientation else 1
    except Image.DecompressionBombError:
        raise InvalidInput(too_big) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise InvalidInput(not_image) from None
    if max(width, height) > MAX_SIDE:  # OpenCV's own limit (CV_IO_MAX_IMAGE_WIDTH / _HEIGHT)
        raise InvalidInput(f"input 'image' is {width}x{height} pixels; a side of at most {MAX_SIDE:,} pixels is accepted")
    image = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
    if image is None or image.size == 0:
        raise InvalidInput(not_image)
    if image.dtype == np.uint16:
        image = (image >> 8).astype(np.uint8)
    if image.ndim == 2:
        image = cv2.cvtColor(image, cv2.COLOR_GRAY2BGR)
    elif image.shape[2] == 4:  # RGBA, grey + alpha and palettes with transparency all come as BGRA
        image = flatten_alpha(image)
    return orient(image, orientation)


_EXIF_ORIENTATION = 0x0112
MAX_SIDE = 1 << 20  # pixels; OpenCV's decoders refuse a wider or taller image


def _orientation(header: Image.Image) -> int:
    """The EXIF Orientation tag of an opened, not decoded, PNG or JPEG (1 when absent or
    unreadable). A PNG's eXIf chunk is read as Pillow found it while opening (the chunk goes
    before the image data): Pillow's ``getexif()`` on a PNG decodes every pixel first, looking
    for one after them (a 657 KB PNG of 13000 x 13000 cost 650 MB and 2 s that way)."""
    try:
        if header.format == "PNG":
            raw = header.info.get("exif")
            if not raw:
                return 1
            exif = Image.Exif()
            exif.load(raw)
        else:
            exif = header.getexif()  # JPEG: the APP1 segment, no pixels
        value = exif.get(_EXIF_ORIENTATION, 1)
    except Exception:  # a corrupt EXIF block: shown as stored, as viewers do
        return 1
    return value if isinstance(value, int) else 1


# EXIF Orientation -> the turn that displays the stored image (PIL.ImageOps.exif_transpose's table).
_ORIENT: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    2: lambda a: a[:, ::-1],                              # mirrored left-right
    3: lambda a: a[::-1, ::-1],                           # rotated 180
    4: lambda a: a[::-1],                                 # mirrored top-bottom
    5: lambda a: a.transpose(1, 0, 2),                    # transposed (mirror about the main diagonal)
    6: lambda a: cv2.rotate(a, cv2.ROTATE_90_CLOCKWISE),  # stored 90 degrees counter-clockwise
    7: lambda a: a.transpose(1, 0, 2)[::-1, ::-1],        # transversed (mirror about the other diagonal)
    8: lambda a: cv2.rotate(a, cv2.ROTATE_90_COUNTERCLOCKWISE),
}


def orient(image: np.ndarray, orientation: int) -> np.ndarray:
    """``image`` ``(H, W, C)`` turned as EXIF ``orientation`` (1-8) says a viewer displays it;
    1 and unknown values leave it as stored."""
    turn = _ORIENT.get(int(orientation) if isinstance(orientation, int) else 1)
    return image if turn is None else np.ascontiguousarray(turn(image))


def flatten_alpha(image: np.ndarray) -> np.ndarray:
    """BGRA ``(H, W, 4)`` uint8 -> BGR ``(H, W, 3)`` uint8 where the text stays readable.

    Composited over white, except when the image has transparent pixels and (almost) every
    opaque one is light: then the ink is light (white text on a transparent background), white
    would erase it, and the alpha channel is the ink: the result is ``255 - alpha`` in grey, dark
    text on white, its edges as anti-aliased as drawn. An image without transparent pixels, or
    with its own opaque background (at least 0.5 % of opaque pixels dark), is composited as is.
    """
    alpha = image[:, :, 3]
    opaque = alpha >= 128
    opaque_count = int(np.count_nonzero(opaque))
    if 0 < opaque_count < alpha.size:  # a fully opaque image keeps its colours
        grey = cv2.cvtColor(image[:, :, :3], cv2.COLOR_BGR2GRAY)
        if np.count_nonzero(grey[opaque] < 128) < 0.005 * opaque_count:  # light ink
            return cv2.cvtColor(255 - alpha, cv2.COLOR_GRAY2BGR)
    a = alpha[:, :, np.newaxis].astype(np.uint16)  # rounded, in 16-bit integers (no float copy)
    blended = image[:, :, :3].astype(np.uint16) * a + 255 * (255 - a) + 127
    return (blended // 255).astype(np.uint8)


def _without_session(cls: type[T], **attributes: Any) -> T:
    """An instance of a rapidocr class whose ``__init__`` (which opens an ONNX Runtime session)
    is skipped: only ``attributes`` are set, which are all that the reused methods read."""
    instance = object.__new__(cls)
    instance.__dict__.update(attributes)
    return instance


def _single(config: ModelConfig, kind: str, rank: int) -> TensorSpec:
    """The one input or output of a step model, of rank ``rank``.

    Raises:
        ConfigError: the model has several, or another rank.
    """
    specs = config.inputs if kind == "input" else config.outputs
    if len(specs) != 1 or len(specs[0].dims) != rank:
        raise ConfigError(
            f"model '{config.name}': the OCR pipeline needs exactly one {kind} of rank {rank}; "
            f"config has {[list(t.dims) for t in specs]}")
    return specs[0]


def _admits(spec: TensorSpec, shape: Sequence[int | None]) -> bool:
    """Whether ``spec``'s profile admits ``shape`` (None: any size on that axis)."""
    lo, hi = spec.bounds()
    return all(size is None or lo[axis] <= size <= hi[axis] for axis, size in enumerate(shape))


def _batch_limit(config: ModelConfig, requested: int | None) -> int:
    """Largest batch a step accepts: the request capped by max_batch_size and the profile."""
    spec = config.inputs[0]
    limit = min(config.max_batch_size or 1, spec.bounds()[1][0])
    return limit if requested is None else min(requested, limit)


def _batches(order: np.ndarray, size: int) -> list[list[int]]:
    """Consecutive groups of at most ``size`` indices from ``order``."""
    indices = [int(i) for i in order]
    return [indices[i:i + size] for i in range(0, len(indices), size)]


def det_input_size(height: int, width: int, parameters: OcrParameters,
                   bounds: tuple[tuple[int, ...], tuple[int, ...]]) -> tuple[int, int]:
    """Detector input ``(H, W)``: rapidocr's ``DetPreProcess.resize`` size (shorter side to
    ``limit_side_len``, multiples of 32), scaled down with its aspect ratio kept when a side
    exceeds the profile max, and raised to the profile min.

    Args:
        height, width: the (letterboxed) image size in pixels.
        bounds: the detector input's ``(min, max)`` shapes ``(N, C, H, W)``.
    """
    limit = parameters.limit_side_len
    if parameters.limit_type == "max":
        ratio = limit / max(height, width) if max(height, width) > limit else 1.0
    else:
        ratio = limit / min(height, width) if min(height, width) < limit else 1.0
    out_h = int(round(int(height * ratio) / 32) * 32)
    out_w = int(round(int(width * ratio) / 32) * 32)
    (_, _, min_h, min_w), (_, _, max_h, max_w) = bounds
    max_h, max_w = max_h // 32 * 32, max_w // 32 * 32
    if out_h > max_h or out_w > max_w:
        shrink = min(max_h / (height * ratio), max_w / (width * ratio))
        out_h = int(height * ratio * shrink) // 32 * 32
        out_w = int(width * ratio * shrink) // 32 * 32
    return max(out_h, -(-min_h // 32) * 32), max(out_w, -(-min_w // 32) * 32)


class OcrPipeline:
    """Detect, angle-classify and recognize text in one image through three model calls.

    Args:
        infer: ``await infer(model_name, {input: array}) -> {output: array}``; raises the
            runtime's ``ServingError`` subclasses.
        character: the recognizer's character list (``read_character_list``).
        det, cls, rec: the configs of the three step models (names, tensor names, profiles,
            ``max_batch_size``).
        parameters: ``OcrParameters`` or a mapping of its fields (``config.parameters``).

    Raises:
        ConfigError: a parameter is invalid, or a step's profile cannot hold what the
            pipeline sends (detector multiples of 32, classifier and recognizer heights, the
            character list against the recognizer's class axis).
    """

    def __init__(self, infer: InferFn, character: Sequence[str], *, det: ModelConfig,
                 cls: ModelConfig, rec: ModelConfig,
                 parameters: OcrParameters | Mapping[str, Any] | None = None, name: str = "ocr") -> None:
        if not isinstance(parameters, OcrParameters):
            parameters = OcrParameters.parse(parameters or {}, f"model '{name}'")
        self.name = name
        self.parameters = p = parameters
        self._infer = infer
        self.det, self.cls, self.rec = det, cls, rec
        self._det_in, self._cls_in, self._rec_in = (_single(c, "input", 4) for c in (det, cls, rec))
        self._det_out = _single(det, "output", 4).name
        self._cls_out = _single(cls, "output", 2).name
        self._rec_out = _single(rec, "output", 3).name
        self._det_bounds = self._det_in.bounds()
        self._cls_batch = _batch_limit(cls, p.cls_batch_size)
        self._rec_batch = _batch_limit(rec, p.rec_batch_size)
        self._rec_width_bounds = (self._rec_in.bounds()[0][3], self._rec_in.bounds()[1][3])
        self._check_profiles(len(character))

        self._ocr = _without_session(
            RapidOCR, max_side_len=p.max_side_len, min_side_len=p.min_side_len,
            min_height=p.min_height, width_height_ratio=p.width_height_ratio, text_score=p.text_score)
        self._det_pre = DetPreProcess(p.limit_side_len, p.limit_type)
        self._det_post = DBPostProcess(
            thresh=p.det_thresh, box_thresh=p.box_thresh, max_candidates=p.max_candidates,
            unclip_ratio=p.unclip_ratio, score_mode=p.score_mode, use_dilation=p.use_dilation)
        self._det_filter = _without_session(TextDetector)
        self._cls_steps = _without_session(TextClassifier, cls_image_shape=list(p.cls_image_shape))
        self._cls_post = ClsPostProcess(list(p.label_list))
        self._rec_steps = _without_session(TextRecognizer, rec_image_shape=list(p.rec_image_shape))
        self._ctc = CTCLabelDecode(character=list(character))  # copies: it inserts blank and space

    @classmethod
    def from_repository(cls, repository: ModelRepository, infer: InferFn, name: str = "ocr") -> "OcrPipeline":
        """Build from ``<root>/<name>/config.yaml`` (its ``parameters``, ``steps`` included), the
        step models' configs and the recognizer's character list.

        Raises:
            ModelNotFound: a step model is not in the repository.
            ConfigError: see the class docstring and ``read_character_list``.
        """
        parameters = OcrParameters.parse(repository.get(name).config.parameters, f"model '{name}'")
        det, cls_, rec = (repository.get(step) for step in parameters.steps)
        character = read_character_list(rec.onnx_path())
        return cls(infer, character, det=det.config, cls=cls_.config, rec=rec.config,
                   parameters=parameters, name=name)

    @property
    def steps(self) -> tuple[str, str, str]:
        """The model names this pipeline calls: detector, angle classifier, recognizer."""
        return self.det.name, self.cls.name, self.rec.name

    def _check_profiles(self, characters: int) -> None:
        """Raise ConfigError unless every step's profile admits what the pipeline sends."""
        lo, hi = self._det_bounds
        multiple_of_32 = all(-(-lo[axis] // 32) * 32 <= hi[axis] for axis in (2, 3))
        cls_shape, rec_shape = self.parameters.cls_image_shape, self.parameters.rec_image_shape
        for config, spec, shape, sent in (
            (self.det, self._det_in, (1, 3, None, None), "(1, 3, H, W), H and W multiples of 32"),
            (self.cls, self._cls_in, (1, *cls_shape), "(B, {}, {}, {})".format(*cls_shape)),
            (self.rec, self._rec_in, (1, *rec_shape[:2], None), "(B, {}, {}, W)".format(*rec_shape[:2])),
        ):
            if not _admits(spec, shape) or (config is self.det and not multiple_of_32):
                lo, hi = spec.bounds()
                raise ConfigError(
                    f"model '{config.name}': the OCR pipeline sends {sent}; its profile "
                    f"[{list(lo)}, {list(hi)}] does not admit that")
        classes = self.rec.outputs[0].dims[-1]
        if classes not in (-1, characters + 2):
            raise ConfigError(
                f"model '{self.rec.name}': {characters} characters + CTC blank + space do not "
                f"match its {classes} output classes")

    async def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Tensor form of ``run``: ``{"image": BYTES [1]} -> {"text", "boxes", "scores"}``.

        Raises:
            InvalidInput: ``image`` missing, not of shape [1], or not bytes; see ``run``.
        """
        image = inputs.get("image")
        extra = sorted(set(inputs) - {"image"})
        if image is None or extra:
            raise InvalidInput(f"model '{self.name}' expects inputs ['image']; got {sorted(inputs)}")
        if image.shape != (1,):
            raise InvalidInput(f"model '{self.name}' input 'image': shape must be [1], got {list(image.shape)}")
        data = image[0]
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidInput(f"model '{self.name}' input 'image': datatype must be BYTES (the image file's bytes)")
        return await self.run(bytes(data))

    async def run(self, image_bytes: bytes) -> dict[str, np.ndarray]:
        """OCR one PNG or JPEG file.

        Returns:
            ``text``: (N,) object array of UTF-8 ``bytes``; ``boxes``: (N, 4, 2) float32 corner
            points (x, y) in input-image pixels; ``scores``: (N,) float32 in
            [text_score, 1]; in reading order. N may be 0.

        Raises:
            InvalidInput: the bytes are not a decodable PNG or JPEG image, or it is too large
                or too thin to process, or a step refused what the pipeline made of it.
            InferenceError, ModelNotReady, OverBudget, InferenceTimeout: passed on from ``infer``
                (a step's fault, capacity, timeout).
        """
        p = self.parameters
        # CPU work runs in worker threads so the replica's event loop keeps serving.
        image, record, (raw_h, raw_w) = await asyncio.to_thread(self._prepare, image_bytes)
        boxes = await self._detect(image)
        if len(boxes) == 0:
            return self._result([], np.zeros((0, 4, 2), np.float32), [])
        boxes = self._ocr.sorted_boxes(boxes)
        crops = await asyncio.to_thread(self._ocr.get_crop_img_list, image, boxes)
        crops = await self._classify(crops)
        texts = await self._recognize(crops)
        points = self._ocr._get_origin_points(boxes, record, raw_h, raw_w)
        keep = [i for i, (_, score) in enumerate(texts) if score >= p.text_score]
        return self._result([texts[i][0] for i in keep], points[keep], [texts[i][1] for i in keep])

    def _prepare(self, image_bytes: bytes) -> tuple[np.ndarray, dict[str, Any], tuple[int, int]]:
        """Decode, resize and letterbox as rapidocr does; returns the image, the record that maps
        points back to the input, and the input's (height, width)."""
        p = self.parameters
        image = decode_image(image_bytes, p.max_image_pixels, p.apply_exif_orientation)
        raw_h, raw_w = image.shape[:2]
        try:
            image, ratio_h, ratio_w = self._ocr.preprocess(image)
        except ResizeImgError:
            raise InvalidInput(
                f"input 'image' is {raw_w}x{raw_h} pixels: too elongated; with its longer side "
                f"scaled to {p.max_side_len} pixels its shorter side vanishes") from None
        record: dict[str, Any] = {"preprocess": {"ratio_h": ratio_h, "ratio_w": ratio_w}}
        image, record = self._ocr.maybe_add_letterbox(image, record)
        h, w = image.shape[:2]
        if h / w > p.width_height_ratio:  # a tall strip: pad its width as rapidocr pads a wide one's height
            pad = self._ocr._get_padding_h(w, h)
            image = add_round_letterbox(image, (0, 0, pad, pad))
            record["padding_2"] = {"top": 0, "left": pad}
        return image, record, (raw_h, raw_w)

    @staticmethod
    def _result(texts: Sequence[str], boxes: np.ndarray, scores: Sequence[float]) -> dict[str, np.ndarray]:
        text = np.empty(len(texts), dtype=np.object_)
        text[:] = [t.encode("utf-8") for t in texts]
        return {
            "text": text,
            "boxes": np.asarray(boxes, np.float32).reshape(-1, 4, 2),
            "scores": np.asarray(scores, np.float32).reshape(-1),
        }

    async def _call(self, config: ModelConfig, input_name: str, output_name: str, batch: np.ndarray) -> np.ndarray:
        """One step call; its errors pass on as the step raised them (``create_pipeline`` names
        the step in a refusal: ``pipelines.step_caller``)."""
        outputs = await self._infer(config.name, {input_name: batch})
        return outputs[output_name]

    async def _detect(self, image: np.ndarray) -> np.ndarray:
        """Text boxes ``(K, 4, 2)`` float32 in ``image`` pixels (``K`` may be 0)."""
        h, w = image.shape[:2]
        out_h, out_w = det_input_size(h, w, self.parameters, self._det_bounds)
        resized = cv2.resize(image, (out_w, out_h))
        batch = self._det_pre.permute(self._det_pre.normalize(resized))[np.newaxis].astype(np.float32)
        prob = await self._call(self.det, self._det_in.name, self._det_out, batch)
        boxes, _ = await asyncio.to_thread(self._det_post, prob, (h, w))
        return self._det_filter.filter_tag_det_res(boxes, (h, w))

    def _cls_windows(self, crop: np.ndarray) -> list[np.ndarray]:
        """The pieces of ``crop`` the angle classifier sees: the crop itself, or, for a line more
        than ``_CLS_SQUEEZE_MAX`` times as elongated as the classifier's input (48 x 192: aspect
        4), up to
        ``_CLS_MAX_WINDOWS`` evenly spaced windows of the classifier's aspect. Squeezed whole
        into 192 pixels, a 1,500-pixel line becomes unreadable and was taken for upside down."""
        _, cls_h, cls_w = self.parameters.cls_image_shape
        h, w = crop.shape[:2]
        win = math.ceil(h * cls_w / cls_h)
        if w <= _CLS_SQUEEZE_MAX * win:  # as rapidocr: the whole crop, squeezed into 192 pixels
            return [crop]
        count = min(_CLS_MAX_WINDOWS, math.ceil(w / win))
        return [crop[:, int(x):int(x) + win] for x in np.linspace(0, w - win, count)]

    async def _classify(self, crops: list[np.ndarray]) -> list[np.ndarray]:
        """Rotate by 180 degrees the crops classified '180' with a score above ``cls_thresh``
        (a long line's score: the mean of its windows' probabilities, ``_cls_windows``)."""
        order = np.argsort([c.shape[1] / float(c.shape[0]) for c in crops])  # as rapidocr
        pieces = [(int(i), window) for i in order for window in self._cls_windows(crops[i])]
        groups = _batches(np.arange(len(pieces)), self._cls_batch)
        batches = [np.stack([self._cls_steps.resize_norm_img(pieces[j][1]) for j in g]).astype(np.float32)
                   for g in groups]
        probs = np.concatenate(await map_bounded(
            lambda b: self._call(self.cls, self._cls_in.name, self._cls_out, b), batches,
            self.parameters.step_calls_in_flight))
        owners = np.array([i for i, _ in pieces])
        crops = list(crops)
        for i in range(len(crops)):
            mean = probs[owners == i].mean(axis=0, keepdims=True)
            ((label, score),) = self._cls_post(mean)
            if "180" in label and score > self.parameters.cls_thresh:
                crops[i] = cv2.rotate(crops[i], cv2.ROTATE_180)
        return crops

    def _rec_ratio(self, ratios: Sequence[float]) -> float:
        """Batch aspect ratio as rapidocr computes it, clamped so the width ``int(H * ratio)``
        stays inside the recognizer profile's width range."""
        _, height, width = self.parameters.rec_image_shape
        lo, hi = self._rec_width_bounds
        ratio = max(width / height, *ratios)
        target = min(max(int(height * ratio), lo), hi)
        if target != int(height * ratio):
            ratio = target / height
            while int(height * ratio) < target:
                ratio = math.nextafter(ratio, math.inf)
            while int(height * ratio) > target:
                ratio = math.nextafter(ratio, 0.0)
        return ratio

    async def _recognize(self, crops: list[np.ndarray]) -> list[tuple[str, float]]:
        """``(text, score)`` per crop, in crop order; batches of similar aspect ratio."""
        ratios = [c.shape[1] / float(c.shape[0]) for c in crops]
        order = np.argsort(ratios)  # as rapidocr: same batches, same padding
        groups = _batches(order, self._rec_batch)
        batches = []
        for group in groups:
            ratio = self._rec_ratio([ratios[i] for i in group])
            batches.append(np.stack([self._rec_steps.resize_norm_img(crops[i], ratio) for i in group]).astype(np.float32))
        probs = await map_bounded(lambda b: self._call(self.rec, self._rec_in.name, self._rec_out, b), batches,
                                  self.parameters.step_calls_in_flight)
        results: list[tuple[str, float]] = [("", 0.0)] * len(crops)
        for group, prob in zip(groups, probs):
            for i, (text, score) in zip(group, self._ctc(prob)):
                results[i] = (text, float(score))
        return results
