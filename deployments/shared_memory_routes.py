"""Triton's system and CUDA shared-memory routes (router only), over this process's
``SharedMemory`` (``V2Routes.shared_memory``: its ``Registry``):

    GET  /v2/systemsharedmemory[/region/{name}]/status
    POST /v2/systemsharedmemory/region/{name}/register    {"key", "offset", "byte_size"}
    POST /v2/systemsharedmemory[/region/{name}]/unregister
    GET  /v2/cudasharedmemory[/region/{name}]/status
    POST /v2/cudasharedmemory/region/{name}/register      {"raw_handle": {"b64"}, "device_id", "byte_size"}
    POST /v2/cudasharedmemory[/region/{name}]/unregister

An infer request uses a region wherever it runs (``protocol.answer.answer``, ``shm``)."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .protocol.shared_memory import CUDA, SYSTEM, Registry, check_region_name
from .routes import V2Routes, answers_errors
from .runtime.contract.errors import ModelNotFound

_PATHS = {SYSTEM: "/v2/systemsharedmemory", CUDA: "/v2/cudasharedmemory"}


class SharedMemoryRoutes(V2Routes):
    """The register, status and unregister routes of both shared-memory extensions."""

    def routes(self) -> list[Route]:
        table = []
        for path in _PATHS.values():
            table += [
                Route(f"{path}/status", self.shm_status, methods=["GET"]),
                Route(f"{path}/region/{{region}}/status", self.shm_status, methods=["GET"]),
                Route(f"{path}/region/{{region}}/register", self.shm_register, methods=["POST"]),
                Route(f"{path}/unregister", self.shm_unregister, methods=["POST"]),
                Route(f"{path}/region/{{region}}/unregister", self.shm_unregister, methods=["POST"]),
            ]
        return super().routes() + table

    def _registry(self, request: Request) -> tuple[Registry, str]:
        """This process's registry and the kind of region the route is for (``system``, ``cuda``).

        Raises:
            ModelNotFound: shared memory is not set up in this process (no route then).
        """
        if self.shared_memory is None:
            raise ModelNotFound(f"no route {request.method} {request.url.path}: shared memory is not served here")
        kind = CUDA if f"{_PATHS[CUDA]}/" in request.url.path else SYSTEM
        return self.shared_memory.registry, kind

    @answers_errors
    async def shm_status(self, request: Request) -> JSONResponse:
        """Triton's status: a list of region objects (one for ``/region/{name}/status``).

        Raises:
            RegionNotFound: as ``Registry.status`` (404).
        """
        registry, kind = self._registry(request)
        return JSONResponse(await asyncio.to_thread(registry.status, kind, request.path_params.get("region")))

    @answers_errors
    async def shm_register(self, request: Request) -> Response:
        """Register a region from its JSON body (``Registry.register``); answers 200, empty.

        Raises:
            SharedMemoryError: as ``Registry.register`` (400).
        """
        registry, kind = self._registry(request)
        name = check_region_name(request.path_params["region"])
        body = await self._json_body(request, f"{kind} shared memory register")
        await asyncio.to_thread(registry.register, kind, name, body)
        return Response(status_code=200)

    @answers_errors
    async def shm_unregister(self, request: Request) -> Response:
        """Unregister one region, or every region of the route's kind; answers 200, empty."""
        registry, kind = self._registry(request)
        await asyncio.to_thread(registry.unregister, kind, request.path_params.get("region"))
        return Response(status_code=200)
