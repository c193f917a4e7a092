"""Fuzz the KServe v2 gRPC service (``deployments/grpc_service.py``) as ``bench.fuzz`` fuzzes HTTP.

Each case starts from one of ``bench.fuzz``'s valid requests (``valid_requests``: ``simple``,
``simple_string``, ``simple_identity``, ``ocr_cls``, ``tiny_cnn``, the ``ocr`` pipeline), with
its tensors as ``raw_input_contents`` or as typed ``contents``, then takes one to three
mutations: ``bench.fuzz``'s own on the request document where a protobuf message can carry the
result (datatypes, shapes, names, parameters, requested outputs, ids; a value the message
cannot hold is written as the nearest one it can: text for a name, a JSON string for a
parameter), and the gRPC ones (``GRPC_MUTATIONS``: raw contents truncated, extended, flipped,
emptied or one entry short; raw and typed contents together; typed contents of the wrong field,
count or range; unknown models and versions; gzip or deflate message compression). Case ``i``
of seed ``s`` is always the same (``random.Random(f"grpc:{s}:{i}")``).

Every answer is checked (``check``): no INTERNAL or UNKNOWN code (a client's mistake is
INVALID_ARGUMENT, NOT_FOUND or RESOURCE_EXHAUSTED; UNAVAILABLE only for a shed request, with
``retry-after``), an answer within the deadline, a message holding nothing internal
(``bench.fuzz.INTERNAL_TEXT``); and after the campaign the server still answers ServerLive
and a valid request.

    python -m bench.grpc_fuzz --url 127.0.0.1:8001 --requests 2000
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import grpc
import numpy as np

from bench.fuzz import (INTERNAL_TEXT, WEIRD_VALUES, _binary_section, m_datatype, m_name, m_outputs, m_parameters,
                        m_shape, valid_requests)

# Codes a client's mistake may get (UNAVAILABLE: shed, with retry-after; DEADLINE_EXCEEDED:
# the request's own tiny parameters.timeout).
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.RESOURCE_EXHAUSTED}
TYPED = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
         "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
         "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents"}


@dataclass
class GrpcCase:
    """One generated call: the model and version, the request document (``bench.fuzz``'s JSON
    form), each input's raw bytes or typed values, message compression, and what was mutated."""

    index: int
    model: str
    doc: dict[str, Any]
    raw: list[bytes] | None
    typed: dict[str, tuple[str, list]] = field(default_factory=dict)  # input name -> (field, values)
    version: str = ""
    compression: grpc.Compression = grpc.Compression.NoCompression
    mutations: list[str] = field(default_factory=list)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _shape(value: Any) -> list[int]:
    """A shape a message can carry: int64 dims (others written as 0, which the server refuses)."""
    if not isinstance(value, list):
        return []
    return [d if isinstance(d, int) and not isinstance(d, bool) and -(1 << 63) <= d < (1 << 63) else 0
            for d in value]


def message(case: GrpcCase) -> Any:
    """The ``ModelInferRequest`` of ``case``."""
    from deployments.protocol.grpc import set_parameter
    from tritonclient.grpc import service_pb2 as pb

    doc = case.doc
    request = pb.ModelInferRequest(model_name=case.model, model_version=case.version, id=_text(doc.get("id", "")))
    for key, value in (doc.get("parameters") or {}).items() if isinstance(doc.get("parameters"), dict) else ():
        set_parameter(request.parameters[_text(key)], value)
    for spec in doc.get("inputs") or [] if isinstance(doc.get("inputs"), list) else []:
        spec = spec if isinstance(spec, dict) else {}
        tensor = request.inputs.add(name=_text(spec.get("name", "")), datatype=_text(spec.get("datatype", "")),
                                    shape=_shape(spec.get("shape")))
        for key, value in (spec.get("parameters") or {}).items() if isinstance(spec.get("parameters"), dict) else ():
            set_parameter(tensor.parameters[_text(key)], value)
        if tensor.name in case.typed:
            name, values = case.typed[tensor.name]
            try:
                getattr(tensor.contents, name).extend(values)
            except (TypeError, ValueError):  # a value the field cannot hold: the field left empty
                tensor.contents.SetInParent()
    outputs = doc.get("outputs")
    for spec in outputs if isinstance(outputs, list) else []:
        spec = spec if isinstance(spec, dict) else {"name": spec}
        output = request.outputs.add(name=_text(spec.get("name", "")))
        for key, value in (spec.get("parameters") or {}).items() if isinstance(spec.get("parameters"), dict) else ():
            set_parameter(output.parameters[_text(key)], value)
    if case.raw is not None:
        request.raw_input_contents.extend(case.raw)
    return request


# --- gRPC mutations: (rng, case) -> what was done ---------------------------------------------

def g_raw(rng: random.Random, case: GrpcCase) -> str:
    if not case.raw:
        return "raw: none"
    i = rng.randrange(len(case.raw))
    data = bytearray(case.raw[i])
    kind = rng.randrange(6)
    if kind == 0 and data:
        data = data[:rng.randrange(len(data))]
    elif kind == 1:
        data += rng.randbytes(rng.choice([1, 3, 4, 64]))
    elif kind == 2 and data:
        for _ in range(rng.randrange(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif kind == 3:
        data = bytearray()
    elif kind == 4:
        case.raw.pop(i)
        return "raw: one entry short"
    else:
        case.raw.append(rng.randbytes(8))
        return "raw: one entry more"
    case.raw[i] = bytes(data)
    return f"raw kind {kind} of entry {i}"


def g_typed(rng: random.Random, case: GrpcCase) -> str:
    if not case.typed:
        name = next(iter(case.doc.get("inputs") or [{}]), {}).get("name") if isinstance(case.doc.get("inputs"), list) \
            and case.doc["inputs"] and isinstance(case.doc["inputs"][0], dict) else None
        if isinstance(name, str):
            case.typed[name] = (rng.choice(list(TYPED.values())), [0, 1])
        return "typed: added beside raw"
    name = rng.choice(list(case.typed))
    field_name, values = case.typed[name]
    kind = rng.randrange(5)
    if kind == 0:
        case.typed[name] = (field_name, values[:rng.randrange(len(values) + 1)])
    elif kind == 1:
        case.typed[name] = (field_name, values + values[:rng.randrange(1, 4)])
    elif kind == 2:
        case.typed[name] = (rng.choice(list(set(TYPED.values()) - {field_name})), values)
    elif kind == 3:
        extreme = {"int_contents": [2**31 - 1, -(2**31)], "uint_contents": [2**32 - 1], "int64_contents": [2**63 - 1],
                   "uint64_contents": [2**64 - 1], "fp32_contents": [float("nan"), float("inf")],
                   "fp64_contents": [float("-inf")], "bool_contents": [True], "bytes_contents": [b"\xff" * 300]}
        case.typed[name] = (field_name, [rng.choice(extreme[field_name]) for _ in values])
    else:
        case.typed[name] = (field_name, [])
    return f"typed kind {kind} of {name!r}"


def g_model(rng: random.Random, case: GrpcCase) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        case.model = rng.choice(["nope", "", "../../etc", "simple/1", "a" * 300, "\u00e9", "SIMPLE"])
    elif kind == 1:
        case.version = rng.choice(["2", "0", "-1", "x", "1.0", "99999999999999999999", "01", ".."])
    else:
        case.version = "1"
    return f"model={case.model[:20]!r} version={case.version!r}"


def g_compression(rng: random.Random, case: GrpcCase) -> str:
    case.compression = rng.choice([grpc.Compression.Gzip, grpc.Compression.Deflate])
    return f"compression {case.compression.name}"


DOC_MUTATIONS: list[Callable[..., str]] = [m_datatype, m_shape, m_name, m_parameters, m_outputs]
GRPC_MUTATIONS: list[Callable[..., str]] = [g_raw, g_typed, g_model, g_compression]


def generate(seed: int, index: int, templates: list[tuple[str, dict, dict]] | None = None) -> GrpcCase:
    """Case ``index`` of ``seed``: a valid call (index % 25 == 0), else mutated 1-3 times."""
    rng = random.Random(f"grpc:{seed}:{index}")
    model, doc, tensors = rng.choice(templates or valid_requests())
    doc = copy.deepcopy(doc)
    raw: list[bytes] | None = None
    typed: dict[str, tuple[str, list]] = {}
    if rng.random() < 0.5 or model == "tiny_cnn":  # raw, as tritonclient sends
        raw = [_binary_section(tensors[spec["name"]], spec["datatype"]) for spec in doc["inputs"]]
    else:
        for spec in doc["inputs"]:
            x = tensors[spec["name"]]
            values = [v if isinstance(v, bytes) else str(v).encode() for v in x.ravel()] \
                if spec["datatype"] == "BYTES" else x.ravel().tolist()
            typed[spec["name"]] = (TYPED[spec["datatype"]], values)
    for spec in doc["inputs"]:
        spec.pop("data", None)
        (spec.get("parameters") or {}).pop("content_type", None)  # raw BYTES: bytes, not base64
    case = GrpcCase(index, model, doc, raw, typed)
    if index % 25:
        for mutation in rng.sample(DOC_MUTATIONS + GRPC_MUTATIONS, rng.choice([1, 1, 2, 3])):
            case.mutations.append(mutation(rng, case) if mutation in GRPC_MUTATIONS else mutation(rng, None, doc))
    return case


def check(code: grpc.StatusCode, details: str, trailing: dict[str, str], case: GrpcCase) -> list[str]:
    """The rules an answer breaks (empty: a good answer)."""
    broken = []
    asked_timeout = any("parameters['timeout']" in m for m in case.mutations)
    if code not in ALLOWED and not (code == grpc.StatusCode.UNAVAILABLE and "retry-after" in trailing) \
            and not (code == grpc.StatusCode.DEADLINE_EXCEEDED and asked_timeout):
        broken.append(f"code {code.name}")
    if code != grpc.StatusCode.OK and (not details or INTERNAL_TEXT.search(details)):
        broken.append("no message, or internal text in it")
    return broken


@dataclass
class Report:
    sent: int = 0
    codes: dict[str, int] = field(default_factory=dict)
    findings: list[dict[str, Any]] = field(default_factory=list)
    alive_after: bool = False


def fuzz(url: str, requests_n: int, seed: int = 0, deadline_s: float = 60.0) -> Report:
    """Send ``requests_n`` cases to the gRPC service at ``url`` one after another; then check
    that it is alive (ServerLive, a valid ``simple`` request)."""
    from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc as pb_grpc

    report = Report()
    templates = valid_requests()
    with grpc.insecure_channel(url, options=[("grpc.max_send_message_length", -1),
                                             ("grpc.max_receive_message_length", -1)]) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for index in range(requests_n):
            case = generate(seed, index, templates)
            try:
                _, call = stub.ModelInfer.with_call(message(case), timeout=deadline_s, compression=case.compression)
                code, details, trailing = call.code(), "", {}
            except grpc.RpcError as e:
                code, details = e.code(), e.details() or ""
                trailing = dict(e.trailing_metadata() or ())
            report.sent += 1
            report.codes[code.name] = report.codes.get(code.name, 0) + 1
            broken = check(code, details, trailing, case)
            if broken:
                report.findings.append({"index": index, "rules": broken, "code": code.name, "details": details[:300],
                                        "mutations": case.mutations})
        live = stub.ServerLive(pb.ServerLiveRequest(), timeout=deadline_s).live
        ok = generate(seed, 0, templates[:1])  # index 0: unmutated, ``simple``
        answer = stub.ModelInfer(message(ok), timeout=deadline_s)
        expected = (np.arange(16, dtype=np.int32) + 2).tobytes()
        report.alive_after = live and answer.raw_output_contents[0] == expected
    return report


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="127.0.0.1:8001")
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    report = fuzz(args.url, args.requests, args.seed)
    print(json.dumps({"sent": report.sent, "codes": report.codes, "alive_after": report.alive_after,
                      "findings": report.findings[:20]}, indent=1))
    return 0 if not report.findings and report.alive_after else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
