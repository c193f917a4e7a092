"""OpenAI's embeddings API as a protocol edge: parse ``POST /v1/embeddings`` bodies into texts,
and encode embeddings, model lists and errors as OpenAI's API answers them (the shapes the
``openai`` Python client reads: ``openai.types.CreateEmbeddingResponse``, ``Model``).

The texts run through the embed pipeline as any KServe v2 request does (``openai_routes``):
this module only translates.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any, Iterable, Literal

import numpy as np

from ..runtime.contract.errors import InvalidInput, InvalidParameter, ModelNotFound
from .errors import error_status, unwrap

EncodingFormat = Literal["float", "base64"]
TOKEN_IDS_FIX = ("this server tokenizes text itself: send the texts as strings (LangChain's OpenAIEmbeddings: "
                 "pass check_embedding_ctx_length=False, which sends strings instead of tiktoken token ids)")


@dataclass(frozen=True)
class EmbeddingsRequest:
    """A parsed ``POST /v1/embeddings`` body: ``model``, the ``texts`` (a single ``input``
    string becomes one), ``encoding_format`` and ``dimensions`` (None: not asked)."""

    model: str
    texts: list[str]
    encoding_format: EncodingFormat
    dimensions: int | None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def json_type(value: Any) -> str:
    """JSON's name for the type of a decoded value (``5`` -> number, ``[]`` -> array)."""
    if isinstance(value, bool):
        return "boolean"
    return {str: "string", int: "number", float: "number", list: "array", dict: "object"}.get(type(value), "null")


def parse_texts(value: Any) -> list[str]:
    """``input``: a string or a list of strings -> the texts.

    Raises:
        InvalidParameter (param ``input``): an empty list, token ids (a list of integers, or of
            lists of integers: what LangChain's ``OpenAIEmbeddings`` sends by default), or another type.
    """
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        if not value:
            raise InvalidParameter("'input' is an empty list; send a string or a list of at least one string", "input")
        if all(isinstance(item, str) for item in value):
            return value
        if (all(_is_int(item) for item in value)
                      or all(isinstance(item, list) and all(_is_int(t) for t in item) for item in value)):
            raise InvalidParameter(f"'input' holds token ids; {TOKEN_IDS_FIX}", "input")
        bad = next(i for i, item in enumerate(value) if not isinstance(item, str))
        raise InvalidParameter(f"'input'[{bad}] is {json.dumps(value[bad])[:40]}; 'input' must be a string or a "
                               "list of strings", "input")
    raise InvalidParameter(f"'input' must be a string or a list of strings, got {json_type(value)}", "input")


def parse_embeddings_request(body: Any) -> EmbeddingsRequest:
    """A decoded JSON body -> ``EmbeddingsRequest``.

    Raises:
        InvalidParameter: naming the field and, for a wrong type, the JSON type sent: ``model``
            or ``input`` missing or of the wrong type, an ``encoding_format`` other than float or
            base64, ``dimensions`` not a positive integer, ``user`` not a string.
    """
    if not isinstance(body, dict):
        raise InvalidInput('the request body must be a JSON object, e.g. {"model": "embed", "input": "text"}')
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidParameter(f"'model' must be a string, the name of an embedding model (GET /v1/models lists "
                               f"them), got {json_type(model)}", "model")
    if not model:
        raise InvalidParameter("'model' is required: the name of an embedding model (GET /v1/models lists them)",
                               "model")
    if "input" not in body:
        raise InvalidParameter("'input' is required: a string or a list of strings", "input")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidParameter(f"'user' must be a string, got {json_type(user)}", "user")
    encoding = body.get("encoding_format")
    encoding = "float" if encoding is None else encoding
    if not isinstance(encoding, str):
        raise InvalidParameter(f"'encoding_format' must be a string, 'float' or 'base64', got {json_type(encoding)}",
                               "encoding_format")
    if encoding not in ("float", "base64"):
        raise InvalidParameter(f"'encoding_format' is {json.dumps(encoding)[:40]}; allowed: 'float', 'base64'",
                               "encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is not None and not (_is_int(dimensions) and dimensions > 0):
        raise InvalidParameter(f"'dimensions' is {json.dumps(dimensions)[:40]} (a {json_type(dimensions)}); it must be "
                               "a positive integer",
                               "dimensions")
    return EmbeddingsRequest(model, parse_texts(body["input"]), encoding, dimensions)


def encode_embedding(row: np.ndarray, encoding: EncodingFormat) -> list[float] | str:
    """One embedding as floats, or as base64 of its little-endian float32 bytes (what the
    ``openai`` client decodes with ``numpy.frombuffer(..., dtype="float32")``)."""
    if encoding == "base64":
        return base64.b64encode(np.ascontiguousarray(row, "<f4").tobytes()).decode("ascii")
    return row.astype(np.float32).tolist()


def embeddings_response(model: str, embedding: np.ndarray, tokens: np.ndarray,
                        encoding: EncodingFormat) -> dict[str, Any]:
    """The response body of ``POST /v1/embeddings`` for ``(N, H)`` embeddings and the ``(N,)``
    tokens each text used."""
    used = int(np.asarray(tokens).sum())
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": encode_embedding(row, encoding)}
                 for i, row in enumerate(embedding)],
        "model": model,
        "usage": {"prompt_tokens": used, "total_tokens": used},
    }


def model_object(name: str, created: int) -> dict[str, Any]:
    """One entry of ``GET /v1/models`` (``openai.types.Model``)."""
    return {"id": name, "object": "model", "created": created, "owned_by": "trt-serve"}


def models_response(models: Iterable[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "list", "data": list(models)}


def unknown_embedding_model(name: str, known: list[str]) -> ModelNotFound:
    """The 404 of an unknown (or not an embedding) ``model``."""
    return ModelNotFound(f"The model '{name}' does not exist or is not an embedding model; embedding models: {known} "
                         "(GET /v1/models)")


def error_body(exc: BaseException, param: str | None = None, route: bool = False) -> tuple[int, dict[str, Any]]:
    """Status and OpenAI's error body ``{"error": {"message", "type", "param", "code"}}`` of an
    exception, with the status and message of the one error table (``protocol.errors``).
    ``param``: the field to name where the error does not (``InvalidParameter`` does).
    ``route``: the error is the path's or method's (404 unknown route, 405), no model's: code null."""
    status, message = error_status(exc)
    param = getattr(unwrap(exc), "param", None) or param
    if status == 404 and not route:
        kind, code = "invalid_request_error", "model_not_found"
    elif status < 500:
        kind, code = "invalid_request_error", None
    else:
        kind, code = "server_error", None
    return status, {"error": {"message": message, "type": kind, "param": param if status < 500 else None,
                              "code": code}}
