"""Fuzz: thousands of generated requests, mutated from valid ones, against a live server.

Each case is valid infer request of a real model (JSON or Triton binary tensors; the models
``simple``, ``simple_string``, ``simple_identity``, ``ocr_cls``, ``tiny_cnn`` and the ``ocr``
pipeline on a small PNG), then one to three mutations drawn from ``MUTATIONS``: the JSON
document (datatypes, shapes, data, names, parameters, outputs, ids, missing and extra keys,
top-level type), its bytes (truncated, flipped, inserted, invalid UTF-8, emptied), the headers
(``Content-Type``, ``Inference-Header-Content-Length``, ``Content-Encoding`` gzip / deflate /
unknown / stacked, compressed garbage, ``Accept-Encoding``), binary tensor sizes and bytes, the
image bytes of the OCR input, and the route (unknown models and versions, path tricks, query
strings, wrong methods). A share of the cases (``BODY_ROUTE_SHARE``) is instead a valid request
of another route that reads a body (``BODY_ROUTES``: the repository index, load and unload of
``mid_cnn``), mutated by the mutations that apply to any JSON body (``BODY_ROUTE_MUTATIONS``);
load and unload parse their bodies with explicit model control (``main`` starts its server so),
else they answer 400 before reading them. Case ``i`` of seed ``s`` is always the same request
(``random.Random(f"{s}:{i}")``), so a finding reproduces from its index.

Every answer is checked (``check``):

- no 5xx: the server answers a client's mistake with 4xx, a request still valid with 200
  (a shed 503 with ``Retry-After`` would be allowed: none occurs at this load);
- no hang: an answer within ``client_timeout_s``, a whole HTTP response;
- every error body is ``{"error": "<text>"}`` and the text holds nothing internal
  (``INTERNAL_TEXT``: tracebacks, Python reprs of exceptions, file paths, addresses);
- the server is alive afterwards: ``/v2/health/live`` and a valid request answer 200.

    python -m bench.fuzz --requests 10000            # starts the server of serve_config.yaml
    python -m bench.fuzz --url http://127.0.0.1:8000 --requests 2000   # a server already running

The short form runs in ``make test`` (``tests/integration/test_campaigns.py``). Why not
Hypothesis: its strategies draw data for a test function run one example at a time and
shrink failures; a campaign of 10,000 requests at a steady concurrency against a server,
replayable by index, is better served by a seeded generator (the findings were small enough
to read without shrinking).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import copy
import functools
import gzip
import io
import json
import random
import re
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from bench.loadgen import HEADER_LENGTH

ROOT = Path(__file__).resolve().parents[1]

# Text that must never reach a client: a traceback, a Python exception's repr, a source file or
# a path of the machine, an object address, Ray's wrapped errors.
INTERNAL_TEXT = re.compile(
    r"Traceback|File \"|\.py\b|/work/|/home/|/tmp/|/usr/|site-packages|\bobject at 0x|<class '|"
    r"\b[A-Z][A-Za-z]*(Error|Exception)\(|RayTaskError|ray\.exceptions|onnxruntime_pybind11|"
    r"\[ONNXRuntimeError\]")

DATATYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
             "FP16", "FP32", "FP64", "BYTES", "BF16", "fp32", "", "FLOAT", "STRING"]
WEIRD_VALUES: list[Any] = [None, True, False, 0, -1, 1, 2**31, 2**63, 2**64 + 1, -(2**63) - 1, 1e308, -1e308,
                           1.5, "", "x", "1", "NaN", "\u0000", "\ud7ff\u00e9", [], {}, [[]], [1, [2]],
                           {"a": 1}, "a" * 300, 3.4e39, -0.0, 1e-320]


@dataclass
class Case:
    """One generated request: method, path (with query), headers, body bytes, and the
    mutations applied to the valid request it came from."""

    index: int
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    mutations: list[str] = field(default_factory=list)


# --- valid requests ---------------------------------------------------------------------------

def _png(width: int = 96, height: int = 32) -> bytes:
    """A small grey PNG with a dark bar (something the detector may or may not read)."""
    from PIL import Image

    img = Image.new("L", (width, height), 230)
    img.paste(20, (8, 10, width - 8, 20))
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()


def valid_requests() -> list[tuple[str, dict[str, Any], dict[str, np.ndarray]]]:
    """(model, JSON request, the tensors of its inputs by name) for every template."""
    rng = np.random.default_rng(0)
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 2, np.int32)
    cls = rng.random((1, 3, 48, 192), dtype=np.float32)
    tiny = rng.random((1, 3, 224, 224), dtype=np.float32)
    png = _png()

    def spec(name, x, datatype):
        return {"name": name, "shape": list(x.shape), "datatype": datatype}

    strings = np.array([[str(v) for v in a[0]]], dtype=object)
    return [
        ("simple", {"inputs": [{**spec("INPUT0", a, "INT32"), "data": a.ravel().tolist()},
                               {**spec("INPUT1", b, "INT32"), "data": b.ravel().tolist()}]},
         {"INPUT0": a, "INPUT1": b}),
        ("simple_string", {"inputs": [{**spec("INPUT0", a, "BYTES"), "data": [str(v) for v in a[0]]},
                                      {**spec("INPUT1", b, "BYTES"), "data": [str(v) for v in b[0]]}],
                           "outputs": [{"name": "OUTPUT0"}]},
         {"INPUT0": strings, "INPUT1": np.array([[str(v) for v in b[0]]], dtype=object)}),
        ("simple_identity", {"id": "fuzz", "inputs": [{**spec("INPUT0", a, "BYTES"),
                                                         "data": [f"w{v}" for v in a[0]]}]},
         {"INPUT0": np.array([[f"w{v}" for v in a[0]]], dtype=object)}),
        ("ocr_cls", {"inputs": [{**spec("x", cls, "FP32"), "data": cls.ravel().tolist()}],
                     "outputs": [{"name": "softmax_0.tmp_0"}]}, {"x": cls}),
        ("tiny_cnn", {"inputs": [{**spec("input", tiny, "FP32")}],  # sent as binary only
                      "outputs": [{"name": "logits", "parameters": {"classification": 3}}]}, {"input": tiny}),
        ("ocr", {"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES",
                             "parameters": {"content_type": "base64"}, "data": [base64.b64encode(png).decode()]}],
                 "outputs": [{"name": "text"}]}, {"image": np.array([png], dtype=object)}),
    ]


def _binary_section(x: np.ndarray, datatype: str) -> bytes:
    if datatype == "BYTES":
        out = b""
        for v in x.ravel():
            raw = v if isinstance(v, bytes) else str(v).encode()
            out += len(raw).to_bytes(4, "little") + raw
        return out
    return np.ascontiguousarray(x).tobytes()


def encode(model: str, doc: dict[str, Any], tensors: dict[str, np.ndarray], binary: bool) -> Case:
    """The valid request as a ``Case``: JSON, or the same with every input as binary data."""
    path = f"/v2/models/{model}/infer"
    if not binary:
        return Case(-1, "POST", path, {"Content-Type": "application/json"}, json.dumps(doc).encode())
    doc = copy.deepcopy(doc)
    raw = b""
    for spec in doc["inputs"]:
        section = _binary_section(tensors[spec["name"]], spec["datatype"])
        spec.pop("data", None)
        spec.setdefault("parameters", {}).pop("content_type", None)
        spec["parameters"]["binary_data_size"] = len(section)
        if not spec["parameters"]:
            spec.pop("parameters")
        raw += section
    doc["parameters"] = {"binary_data_output": True}
    head = json.dumps(doc).encode()
    return Case(-1, "POST", path, {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(head))},
                head + raw)


# --- mutations --------------------------------------------------------------------------------
# Each takes (rng, case, doc) where ``doc`` is the JSON document of the request (the header of a
# binary one), changes them in place, and returns a short name of what it did. ``_finish``
# re-serializes ``doc`` into the body unless a byte-level mutation ran last.

def _any_input(rng: random.Random, doc: dict[str, Any]) -> dict[str, Any] | None:
    inputs = doc.get("inputs")
    if isinstance(inputs, list) and inputs and isinstance(inputs[0], dict):
        return rng.choice([i for i in inputs if isinstance(i, dict)] or [inputs[0]])
    return None


def m_datatype(rng, case, doc):
    t = _any_input(rng, doc)
    if t is None:
        return "datatype: no input"
    t["datatype"] = rng.choice(DATATYPES + WEIRD_VALUES[:6])
    return f"datatype={t['datatype']!r}"


def m_shape(rng, case, doc):
    t = _any_input(rng, doc)
    if t is None:
        return "shape: no input"
    shape = list(t.get("shape") or [1])
    kind = rng.randrange(9)
    if kind == 0:
        shape[rng.randrange(len(shape))] = rng.choice([0, -1, -2**31, 2**31, 2**40, 2**63, 10**30])
    elif kind == 1:
        shape[rng.randrange(len(shape))] = rng.choice([1.5, "3", None, True, [1], {}])
    elif kind == 2:
        shape = shape + [1] * rng.randrange(1, 4)
    elif kind == 3:
        shape = shape[:-1]
    elif kind == 4:
        shape = []
    elif kind == 5:
        shape = rng.choice([None, "1,16", 7, {"a": 1}])
    elif kind == 6:
        shape = [d * rng.choice([2, 3, 8, 64]) if isinstance(d, int) else d for d in shape]
    elif kind == 7:
        shape = list(reversed(shape))
    else:
        shape = [rng.randrange(1, 9) for _ in range(rng.randrange(1, 6))]
    t["shape"] = shape
    return f"shape={str(shape)[:60]}"


def m_data(rng, case, doc):
    t = _any_input(rng, doc)
    if t is None:
        return "data: no input"
    data = t.get("data")
    kind = rng.randrange(9)
    if not isinstance(data, list) or not data:
        t["data"] = rng.choice(WEIRD_VALUES)
        return "data=weird"
    if kind == 0:
        t["data"] = data[: rng.randrange(len(data))]
    elif kind == 1:
        t["data"] = data + data[: rng.randrange(1, 8)]
    elif kind == 2:
        data = list(data)
        data[rng.randrange(len(data))] = rng.choice(WEIRD_VALUES)
        t["data"] = data
    elif kind == 3:
        t["data"] = [data]  # one level too deep
    elif kind == 4:
        t["data"] = [data[i:i + 4] for i in range(0, len(data), 4)]  # nested, wrong shape
    elif kind == 5:
        t["data"] = rng.choice(WEIRD_VALUES)
    elif kind == 6:
        t["data"] = [rng.choice(["1", "-5", "99999999999999999999", "1e3", " 7", "\u0663", "\udcff",
                                 "x" * 1000, ""]) for _ in data]
    elif kind == 7:
        t["data"] = [rng.choice([0, 1, -1, 2**31, 2**33, -(2**40), 1.5, 1e39, True]) for _ in data]
    else:
        t.pop("data")
    return f"data kind {kind}"


def m_name(rng, case, doc):
    t = _any_input(rng, doc)
    if t is None:
        return "name: no input"
    t["name"] = rng.choice(["", "x", "INPUT9", "../etc/passwd", "input\u0000", "ü" * 50, None, 5, ["x"]])
    return f"name={str(t['name'])[:20]!r}"


def m_parameters(rng, case, doc):
    where = rng.choice(["request", "input", "output"])
    key = rng.choice(["binary_data_size", "binary_data_output", "binary_data", "content_type", "classification",
                      "timeout", "priority", "sequence_id", "shared_memory_region", "unknown_param", ""])
    value = rng.choice(WEIRD_VALUES + ["base64", "text", "binary", 3, 1000, 10**12])
    if where == "request":
        target = doc
    elif where == "input":
        target = _any_input(rng, doc) or doc
    else:
        outs = doc.setdefault("outputs", [{"name": "OUTPUT0"}])
        target = outs[0] if isinstance(outs, list) and outs and isinstance(outs[0], dict) else doc
    params = target.get("parameters")
    if not isinstance(params, dict) or rng.random() < 0.1:
        params = target["parameters"] = {} if rng.random() < 0.8 else rng.choice(WEIRD_VALUES)
    if isinstance(params, dict):
        params[key] = value
    return f"{where} parameters[{key!r}]={str(value)[:20]!r}"


def m_outputs(rng, case, doc):
    kind = rng.randrange(6)
    if kind == 0:
        doc["outputs"] = rng.choice(WEIRD_VALUES)
    elif kind == 1:
        doc["outputs"] = [{"name": rng.choice(["nope", "", "OUTPUT0", "logits", "text"])}]
    elif kind == 2:
        doc["outputs"] = [{"name": "logits", "parameters": {"classification": rng.choice(WEIRD_VALUES + [0, 5000])}}]
    elif kind == 3:
        doc["outputs"] = [{"name": "OUTPUT0"}, {"name": "OUTPUT0"}]
    elif kind == 4:
        doc["outputs"] = [rng.choice(WEIRD_VALUES)]
    else:
        doc["outputs"] = []
    return f"outputs kind {kind}"


def m_structure(rng, case, doc):
    kind = rng.randrange(8)
    if kind == 0:
        doc.pop("inputs", None)
    elif kind == 1:
        doc["inputs"] = rng.choice(WEIRD_VALUES)
    elif kind == 2:
        doc["inputs"] = (doc.get("inputs") or []) * 2 if isinstance(doc.get("inputs"), list) else []
    elif kind == 3:
        doc[rng.choice(["extra", "id", "model_name", ""])] = rng.choice(WEIRD_VALUES)
    elif kind == 4:
        t = _any_input(rng, doc)
        if t is not None:
            t.pop(rng.choice(["name", "shape", "datatype"]), None)
    elif kind == 5:
        doc["id"] = rng.choice(WEIRD_VALUES)
    elif kind == 6:
        inputs = doc.get("inputs")
        if isinstance(inputs, list) and inputs:
            inputs[0] = rng.choice(WEIRD_VALUES)
    else:
        doc.clear()
        doc["__replace__"] = rng.choice([[], 1, "x", None, [{}]])
    return f"structure kind {kind}"


def m_bytes(rng, case, doc):
    _finish(case, doc)
    body = bytearray(case.body)
    kind = rng.randrange(7)
    if kind == 0 and body:
        body = body[: rng.randrange(len(body))]
    elif kind == 1 and body:
        for _ in range(rng.randrange(1, 8)):
            body[rng.randrange(len(body))] = rng.randrange(256)
    elif kind == 2:
        at = rng.randrange(len(body) + 1)
        body[at:at] = rng.choice([b"\x00", b"\xff\xfe", b"{", b"}", b"NaN", b"Infinity", b"1e999", b"\\u00",
                                  b"\xc3\x28", b'"', b",", b"[" * 2000])
    elif kind == 3:
        body = bytearray()
    elif kind == 4:
        body = bytearray(b"\xef\xbb\xbf" + bytes(body))  # UTF-8 byte order mark
    elif kind == 5:
        body = bytearray(rng.randbytes(rng.randrange(1, 4096)))
    else:
        body = bytearray(bytes(body).replace(b'"', b"'", 1))
    case.body = bytes(body)
    return f"bytes kind {kind}"


@functools.lru_cache(maxsize=1)
def _bomb() -> bytes:
    """80 MiB of zeros as deflate data (about 80 KB): over the default 64 MiB body limit."""
    return zlib.compress(b"\x00" * (80 * 2**20), 9)


def m_encoding(rng, case, doc):
    _finish(case, doc)
    kind = rng.randrange(9)
    if kind == 0:
        case.body, coding = gzip.compress(case.body), "gzip"
    elif kind == 1:
        case.body, coding = zlib.compress(case.body), "deflate"
    elif kind == 2:
        coding = rng.choice(["br", "zstd", "compress", "gzip;q=1", "*", "x-gzip, br", "\u00e9"])
        case.body = gzip.compress(case.body)
    elif kind == 3:
        case.body, coding = gzip.compress(zlib.compress(case.body)), "deflate, gzip"
    elif kind == 4:
        coding = rng.choice(["gzip", "deflate", "x-gzip"])  # not compressed at all
    elif kind == 5:
        data = gzip.compress(case.body)
        case.body, coding = data[: rng.randrange(len(data))], "gzip"  # truncated
    elif kind == 6:
        case.body, coding = gzip.compress(case.body) + b"trailing", "gzip"
    elif kind == 7:
        case.body, coding = _bomb(), "deflate"
    else:
        case.body, coding = case.body, "identity"
    case.headers["Content-Encoding"] = coding
    if rng.random() < 0.5:
        case.headers["Accept-Encoding"] = rng.choice(["gzip", "deflate;q=0.5, gzip;q=0", "*", "br", "gzip;q=x",
                                                      "identity;q=0", ";;;", "deflate"])
    return f"Content-Encoding={coding!r} kind {kind}"


def m_headers(rng, case, doc):
    kind = rng.randrange(6)
    if kind == 0:
        case.headers["Content-Type"] = rng.choice(["text/plain", "application/json; charset=latin-1",
                                                   "multipart/form-data", "", "application/octet-stream"])
    elif kind == 1:
        _finish(case, doc)
        case.headers[HEADER_LENGTH] = rng.choice(["-1", "0", "abc", "1e3", str(len(case.body) + 1), "99999999999999999999",
                                                  " 12", "\u0661\u0662", str(len(case.body)), "3"])
    elif kind == 2:
        case.headers.pop(HEADER_LENGTH, None)
    elif kind == 3:
        case.headers["Accept-Encoding"] = rng.choice(["gzip", "deflate", "br", "gzip;q=0", "*;q=0.1"])
    elif kind == 4:
        case.headers["X-Junk"] = "y" * rng.choice([10, 4000])
    else:
        case.headers["Inference-Header-Content-Length"] = case.headers.get(HEADER_LENGTH, "0")
    return f"headers kind {kind}"


def m_binary(rng, case, doc):
    t = _any_input(rng, doc)
    if t is None:
        return "binary: no input"
    params = t.setdefault("parameters", {}) if isinstance(t.get("parameters", {}), dict) else {}
    size = params.get("binary_data_size", 64)
    params["binary_data_size"] = rng.choice([0, -1, 1, (size or 1) - 1, (size or 1) + 1, 2**62, "12", 1.0, None,
                                             (size or 1) * 2])
    return f"binary_data_size={params['binary_data_size']!r}"


def m_image(rng, case, doc):
    if case.path != "/v2/models/ocr/infer":
        return "image: not ocr"
    t = _any_input(rng, doc)
    if t is None or not isinstance(t.get("data"), list) or not t["data"]:
        return "image: no data"
    png = bytearray(_png(rng.choice([8, 96, 500]), rng.choice([1, 32, 64])))
    kind = rng.randrange(6)
    if kind == 0:
        png = png[: rng.randrange(8, len(png))]
    elif kind == 1:
        for _ in range(rng.randrange(1, 16)):
            png[rng.randrange(8, len(png))] = rng.randrange(256)
    elif kind == 2:
        png = bytearray(b"GIF89a" + bytes(png[6:]))
    elif kind == 3:
        png = bytearray(rng.randbytes(200))
    elif kind == 4:
        t["data"] = [base64.b64encode(bytes(png)).decode()[:-3] + "!!"]  # bad base64
        return "image: bad base64"
    else:
        t.setdefault("parameters", {}).pop("content_type", None)  # raw text, not base64
        t["data"] = [png.decode("latin-1")]
        return "image: no content_type"
    t["data"] = [base64.b64encode(bytes(png)).decode()]
    return f"image kind {kind}"


def m_route(rng, case, doc):
    kind = rng.randrange(8)
    model = case.path.split("/")[3]
    if kind == 0:
        case.path = f"/v2/models/{rng.choice(['nope', '..%2F..%2Fetc', '%00', 'a' * 300, '%C3%A9', 'simple%2F1'])}/infer"
    elif kind == 1:
        case.path = f"/v2/models/{model}/versions/{rng.choice(['2', '0', '-1', 'x', '1.0', '99999999999999999999', '%2e%2e'])}/infer"
    elif kind == 2:
        case.path += rng.choice(["?", "?a=1", "?x=%ZZ", "?" + "a" * 2000, "#frag"])
    elif kind == 3:
        case.method = rng.choice(["GET", "PUT", "DELETE", "PATCH"])
    elif kind == 4:
        case.path = case.path.replace("/infer", rng.choice(["/infer/", "//infer", "/INFER", "/ready", "/config"]))
    elif kind == 5:
        case.path = rng.choice(["/v2/repository/index", "/v2/memory", "/v2/models/stats", "/v2", "/", "/metrics",
                                f"/v2/models/{model}/stats", "/v2/health/ready"])
    elif kind == 6:
        case.path = f"/v2/models/{model}/versions/1/infer"
    else:
        case.path = "/v2//models/" + model + "/infer"
    return f"route kind {kind}: {case.method} {case.path[:60]}"


def m_body_route(rng, case, doc):
    """A route of ``BODY_ROUTES`` changed: a model that is not one, path tricks, a query, GET."""
    kind = rng.randrange(4)
    if kind == 0 and "/models/" in case.path:
        name = rng.choice(["nope", "..%2F..%2Fetc", "%00", "a" * 300, "%C3%A9", "mid_cnn%2F1", "MID_CNN"])
        case.path = re.sub(r"/models/[^/]+/", f"/models/{name}/", case.path)
    elif kind == 1:
        case.path += rng.choice(["?", "?ready=1", "?x=%ZZ", "?" + "a" * 2000])
    elif kind == 2:
        case.method = rng.choice(["GET", "PUT", "DELETE"])
    else:
        case.path = case.path.replace("/v2/repository/", rng.choice(["/v2//repository/", "/v2/repository//"]), 1)
    return f"body route kind {kind}: {case.method} {case.path[:60]}"


MUTATIONS: list[Callable[..., str]] = [m_datatype, m_shape, m_data, m_name, m_parameters, m_outputs, m_structure,
                                       m_bytes, m_encoding, m_headers, m_binary, m_image, m_route]
_BYTE_LEVEL = {"m_bytes", "m_encoding"}

# Every other route that reads a body (``deployments/ingress.py``, ``_json_body``), with a valid
# body; ``mid_cnn`` is in no infer template, so its loads and unloads change no other case's answer.
BODY_ROUTES: list[tuple[str, dict[str, Any]]] = [
    ("/v2/repository/index", {"ready": True}),
    ("/v2/repository/models/mid_cnn/load", {"parameters": {}}),
    ("/v2/repository/models/mid_cnn/unload", {"parameters": {"unload_dependents": False}}),
]
BODY_ROUTE_MUTATIONS: list[Callable[..., str]] = [m_parameters, m_structure, m_bytes, m_encoding, m_headers,
                                                  m_body_route]
BODY_ROUTE_SHARE = 0.2


def _finish(case: Case, doc: dict[str, Any]) -> None:
    """Write ``doc`` back into ``case.body`` (keeping a binary request's raw section) once."""
    if doc.get("__finished__"):
        return
    replace = doc.get("__replace__", doc)
    text = json.dumps(replace, allow_nan=True).encode()
    if HEADER_LENGTH in case.headers and case.headers[HEADER_LENGTH].isdigit():
        raw = case.body[int(case.headers[HEADER_LENGTH]):]
        case.headers[HEADER_LENGTH] = str(len(text))
        case.body = text + raw
    else:
        case.body = text
    doc["__finished__"] = True


def generate(seed: int, index: int, templates: list[tuple[str, dict, dict]] | None = None) -> Case:
    """Case ``index`` of ``seed``: a valid request mutated 1-3 times (index % 25 == 0: unmutated):
    an infer request of ``templates`` (default ``valid_requests()``), or with probability
    ``BODY_ROUTE_SHARE`` one of ``BODY_ROUTES``."""
    rng = random.Random(f"{seed}:{index}")
    mutations = MUTATIONS
    if rng.random() < BODY_ROUTE_SHARE:
        path, doc = rng.choice(BODY_ROUTES)
        case = Case(index, "POST", path, {"Content-Type": "application/json"}, json.dumps(doc).encode())
        doc, mutations = copy.deepcopy(doc), BODY_ROUTE_MUTATIONS
    else:
        model, doc, tensors = rng.choice(templates or valid_requests())
        binary = model == "tiny_cnn" or rng.random() < 0.4  # tiny_cnn as JSON would be 1.5 MB a request
        case = encode(model, doc, tensors, binary)
        case.index = index
        doc = json.loads(case.body[:int(case.headers[HEADER_LENGTH])] if binary else case.body)
    if index % 25:
        for mutation in rng.sample(mutations, rng.choice([1, 1, 2, 3])):
            if doc.get("__finished__") and mutation.__name__ not in _BYTE_LEVEL | {"m_headers", "m_route", "m_body_route"}:
                continue  # the body is bytes now: document mutations no longer apply
            case.mutations.append(mutation(rng, case, doc))
    _finish(case, doc)
    return case


# --- checking ---------------------------------------------------------------------------------

@dataclass
class Finding:
    """A case whose answer broke a rule: which rule, the status, the body's start."""

    index: int
    rule: str
    status: int | None
    body: str
    mutations: list[str]
    request: str


def check(case: Case, status: int | None, headers: dict[str, str], body: bytes) -> list[str]:
    """The rules ``status`` and ``body`` break (empty: a good answer). ``status`` None: no answer."""
    if status is None:
        return ["hang or no HTTP answer"]
    broken = []
    asked_timeout = any("parameters['timeout']" in m for m in case.mutations)
    if status >= 500 and not (status == 503 and "Retry-After" in headers) and not (status == 504 and asked_timeout):
        broken.append("5xx")  # 504 is the answer a request asks for with its own tiny `timeout`
    if status >= 400:
        try:
            doc = json.loads(body)
            if not (isinstance(doc, dict) and set(doc) == {"error"} and isinstance(doc["error"], str) and doc["error"]):
                broken.append("error body is not {\"error\": text}")
            elif INTERNAL_TEXT.search(doc["error"]):
                broken.append("internal text in error")
        except ValueError:
            broken.append("error body is not JSON")
    return broken


@dataclass
class FuzzReport:
    requests: int
    seed: int
    by_status: dict[str, int]
    findings: list[Finding]
    alive_after: bool
    duration_s: float
    rules: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)  # distinct error texts (digits masked): count


async def _send(session, base_url: str, case: Case, client_timeout_s: float) -> tuple[int | None, dict, bytes]:
    import aiohttp

    try:
        async with session.request(case.method, base_url + case.path, data=case.body if case.method != "GET" else None,
                                   headers=case.headers, timeout=aiohttp.ClientTimeout(total=client_timeout_s),
                                   auto_decompress=True) as r:
            return r.status, dict(r.headers), await r.read()
    except (asyncio.TimeoutError, aiohttp.ClientError) as e:
        return None, {}, f"{type(e).__name__}: {e}".encode()


async def _run(base_url: str, seed: int, start: int, count: int, concurrency: int, client_timeout_s: float,
               on_answer: Callable[[Case, int | None, dict, bytes], None]) -> None:
    import aiohttp

    templates = valid_requests()
    queue = iter(range(start, start + count))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency),
                                     skip_auto_headers=["Accept-Encoding"]) as session:
        async def worker() -> None:
            for i in queue:
                case = generate(seed, i, templates)
                status, headers, body = await _send(session, base_url, case, client_timeout_s)
                on_answer(case, status, headers, body)

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def alive(base_url: str) -> bool:
    """``/v2/health/live`` and the valid ``simple`` request both answer 200."""
    import requests

    try:
        model, doc, _ = valid_requests()[0]
        return (requests.get(f"{base_url}/v2/health/live", timeout=30).status_code == 200 and
                requests.post(f"{base_url}/v2/models/{model}/infer", json=doc, timeout=60).status_code == 200)
    except requests.RequestException:
        return False


def fuzz(base_url: str, requests_n: int, seed: int = 0, concurrency: int = 4, client_timeout_s: float = 30.0,
         start: int = 0, log: Callable[[str], None] = lambda s: None) -> FuzzReport:
    """Send cases ``start .. start + requests_n - 1`` of ``seed`` to ``base_url``; check every answer."""
    by_status: dict[str, int] = {}
    findings: list[Finding] = []
    rules: dict[str, int] = {}
    errors: dict[str, int] = {}
    t0 = time.monotonic()

    def on_answer(case: Case, status: int | None, headers: dict, body: bytes) -> None:
        key = str(status)
        by_status[key] = by_status.get(key, 0) + 1
        done = sum(by_status.values())
        if done % 1000 == 0:
            log(f"{done} requests, {len(findings)} findings, {time.monotonic() - t0:.0f} s")
        if status is not None and status >= 400:
            text = f"{status} " + re.sub(r"\d+", "N", body[:200].decode(errors="replace"))
            errors[text] = errors.get(text, 0) + 1
        for rule in check(case, status, headers, body):
            rules[rule] = rules.get(rule, 0) + 1
            findings.append(Finding(case.index, rule, status, body[:300].decode(errors="replace"), case.mutations,
                                    f"{case.method} {case.path[:80]} {dict(list(case.headers.items())[:4])} "
                                    f"{case.body[:160]!r}"))

    asyncio.run(_run(base_url.rstrip("/"), seed, start, requests_n, concurrency, client_timeout_s, on_answer))
    return FuzzReport(sum(by_status.values()), seed, by_status, findings, alive(base_url.rstrip("/")),
                      round(time.monotonic() - t0, 1), rules, errors)


def summary(report: FuzzReport) -> str:
    lines = [f"fuzzed {report.requests} requests (seed {report.seed}) in {report.duration_s:.0f} s: "
             f"statuses {dict(sorted(report.by_status.items()))}; findings {len(report.findings)} {report.rules}; "
             f"server alive after: {report.alive_after}"]
    seen: set[tuple[str, int | None, str]] = set()
    for f in report.findings:
        key = (f.rule, f.status, re.sub(r"\d+", "N", f.body)[:80])
        if key not in seen:
            seen.add(key)
            lines.append(f"  case {f.index}: {f.rule} ({f.status}) {f.body[:200]!r}\n    {f.mutations}\n    {f.request[:300]}")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server; default: start serve_config.yaml's application")
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start", type=int, default=0, help="first case index (replay: --start i --requests 1)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = p.parse_args(argv)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    if a.url:
        report = fuzz(a.url, a.requests, a.seed, a.concurrency, start=a.start, log=log)
    else:
        from bench.overload import default_app_args
        from bench.throughput import Server

        app_args = default_app_args(ROOT / "serve_config.yaml")
        # load and unload read their bodies only with model control on (else: 400 at once)
        app_args.update(model_control_mode="explicit", startup_models=["*"])
        with Server("ray", Path(app_args["repository"]), app_args=app_args) as server:
            report = fuzz(server.url, a.requests, a.seed, a.concurrency, start=a.start, log=log)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"fuzz-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"command": "python -m bench.fuzz " + " ".join(argv), **asdict(report)}, indent=2))
    print(summary(report))
    print(f"wrote {path}", file=sys.stderr)
    return 0 if report.alive_after and not report.findings else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
