"""OpenAI-compatible routes (router only): ``POST /v1/embeddings``, ``GET /v1/models`` and
``GET /v1/models/{model}``.

A thin protocol edge (``protocol.openai`` parses and encodes): the texts go to an embed
pipeline model (``pipeline: embed`` in its config, e.g. ``embed``) as its KServe v2 input ``text``,
through the same readiness, timeout and model call as ``POST /v2/models/embed/infer``, and the
pipeline's replica validates and runs them. ``/v1`` is not under a model's route prefix, so these
requests reach the router application (route prefix ``/``), which calls the pipeline's
deployment: one hop more than ``/v2/models/embed/infer``, which reaches a pipeline replica
directly. Errors answer in OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``)
with the status of the one error table.
"""

from __future__ import annotations

import json

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .protocol.openai import (embeddings_response, error_body, model_object, models_response,
                              parse_embeddings_request, unknown_embedding_model)
from .protocol.errors import detached, retry_after_headers
from .protocol.v2 import parse_json
from .routes import V2Routes
from .runtime.contract.errors import InvalidParameter, ModelNotFound, ServingError
from .runtime.contract.repository import ModelEntry

EMBED_PIPELINE = "embed"  # the pipeline kind whose models /v1/embeddings serves
EMBED_INPUT, EMBED_OUTPUTS = "text", ["embedding", "tokens"]


OPENAI_ROUTES = "POST /v1/embeddings, GET /v1/models, GET /v1/models/{model}"


def openai_error(exc: BaseException, param: str | None = None, headers: dict[str, str] | None = None,
                 route: bool = False) -> Response:
    """``exc`` answered in OpenAI's error shape (``protocol.openai.error_body``), as
    ``routes.error_response`` answers the v2 shape: ``Retry-After`` for a shed request,
    ASCII-escaped JSON, the exception detached from the request's data."""
    status, body = error_body(exc, param, route)
    detached(exc)
    return Response(json.dumps(body), status_code=status, media_type="application/json",
                    headers={**retry_after_headers(exc), **(headers or {})})


def is_openai_path(request: Request) -> bool:
    """Whether the request's path (under the application's route prefix) is ``/v1`` or under it."""
    path = request.url.path.removeprefix(request.scope.get("root_path", "").rstrip("/"))
    return path == "/v1" or path.startswith("/v1/")


class OpenAIRoutes(V2Routes):
    """``POST /v1/embeddings``, ``GET /v1/models`` and ``GET /v1/models/{model}`` over the router's routes."""

    def routes(self) -> list[Route]:
        return super().routes() + [
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            Route("/v1/models", self.openai_models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.openai_model, methods=["GET"]),
        ]

    async def _not_found(self, request: Request, exc: Exception) -> Response:
        """An unknown path under ``/v1``: 404 in OpenAI's shape naming the ``/v1`` routes."""
        if not is_openai_path(request):
            return await super()._not_found(request, exc)
        return openai_error(ModelNotFound(f"no route {request.method} {request.url.path}; OpenAI-compatible "
                                          f"routes: {OPENAI_ROUTES}"), route=True)

    def _route_error(self, request: Request, error: ServingError, headers: dict[str, str]) -> Response:
        """A ``/v1`` route's 405 in OpenAI's shape (``Allow`` kept)."""
        if not is_openai_path(request):
            return super()._route_error(request, error, headers)
        return openai_error(error, headers=headers, route=True)

    def embedding_models(self) -> list[ModelEntry]:
        """The served embed pipeline models, by name."""
        return [e for e in self.repo.entries() if e.config.pipeline == EMBED_PIPELINE]

    def _embedding_model(self, name: str) -> ModelEntry:
        """The embedding model ``name``; raises ModelNotFound naming the ones there are."""
        models = {e.name: e for e in self.embedding_models()}
        if name not in models:
            raise unknown_embedding_model(name, sorted(models))
        return models[name]

    @staticmethod
    def _model_object(entry: ModelEntry) -> dict:
        """OpenAI's model object of ``entry`` (``created``: its config file's mtime, else 0)."""
        config = entry.path.joinpath("config.yaml")
        return model_object(entry.name, int(config.stat().st_mtime) if config.is_file() else 0)

    async def openai_models(self, request: Request) -> Response:
        """OpenAI's model list: the embedding models that serve now (ready, their step models
        loaded: ``_not_ready``); one unloaded, still loading or whose load failed is not listed,
        as ``POST /v1/embeddings`` would answer it 503."""
        return JSONResponse(models_response(self._model_object(e) for e in self.embedding_models()
                                            if self._not_ready(e) is None))

    async def openai_model(self, request: Request) -> Response:
        """OpenAI's retrieve-model route: an embedding model's object while it serves; for one
        that does not (``_not_ready``) that error (503, or 404 never loaded), and 404 for any
        other name, in OpenAI's shape."""
        try:
            entry = self._embedding_model(request.path_params["model"])
            if (error := self._not_ready(entry)) is not None:
                raise error
            return JSONResponse(self._model_object(entry))
        except Exception as e:
            return openai_error(e, "model")

    async def embeddings(self, request: Request) -> Response:
        """Embed ``input`` with model ``model``; errors in OpenAI's shape (module docstring).
        A 4xx from the pipeline (its texts: count, UTF-8, length) names ``input``."""
        try:
            body = parse_json(b"".join(await self._read_body(request)))
            parsed = parse_embeddings_request(body)
            entry = self._embedding_model(parsed.model)
            width = next((t.dims[-1] for t in entry.config.outputs if t.name == "embedding"), -1)
            if parsed.dimensions is not None and parsed.dimensions != width:
                raise InvalidParameter(f"'dimensions' is {parsed.dimensions}; model '{entry.name}' gives "
                                       f"embeddings of {width} dimensions only", "dimensions")
            texts = np.empty(len(parsed.texts), np.object_)
            # a lone surrogate (JSON "\ud800") stays invalid UTF-8, which the pipeline refuses naming the text
            texts[:] = [t.encode("utf-8", "surrogatepass") for t in parsed.texts]
        except Exception as e:
            return openai_error(e)
        try:
            await self._await_ready(entry)
            outputs = await self._call_model(entry.name, {EMBED_INPUT: texts}, EMBED_OUTPUTS,
                                             key=entry.key(), version=entry.latest)
        except Exception as e:
            return openai_error(e, "input")
        return Response(json.dumps(embeddings_response(entry.name, outputs["embedding"], outputs["tokens"],
                                                       parsed.encoding_format), separators=(",", ":")),
                        media_type="application/json")
