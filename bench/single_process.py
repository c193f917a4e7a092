"""The single-process baseline: one starlette + uvicorn process, the same engine layer.

The reference design Ray Serve is measured against: every model is a ``ModelHost`` (engine
plus a pool of ``instances`` execution contexts) in this one process, HTTP is parsed in
Python on one event loop, and inference runs in a thread pool. It speaks the same KServe v2
infer route as the Router (JSON and Triton binary tensors through ``deployments.protocol``),
plus the health and model metadata routes a client needs.

    python -m bench.single_process --repository engines --port 8100 [--models tiny_cnn,ocr] [--backend B]

Pipeline models (``ocr``) run their steps on hosts of this process (loaded even when not listed).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from deployments.protocol.triton import platform_of
from deployments.pipelines import create_pipeline
from deployments.protocol.binary import HEADER_LENGTH, decode_body, encode_response
from deployments.protocol.errors import error_status
from deployments.protocol.v2 import model_metadata
from deployments.runtime.contract.errors import ModelNotFound, unknown_model
from deployments.runtime.contract.validation import validate_inputs
from deployments.runtime.residency.host import ModelHost
from deployments.runtime.contract.repository import ModelRepository

# Threads that run ``ModelHost.infer``: enough that a model waiting for a free context never
# holds up another model's requests.
INFER_THREADS = 64


def create_app(repository: str, models: Sequence[str] | None = None, backend: str = "auto") -> Starlette:
    """Load every model (eagerly) and return the ASGI app serving them."""
    repo = ModelRepository(repository, list(models) if models else None)
    entries = repo.entries()
    executor = ThreadPoolExecutor(INFER_THREADS, thread_name_prefix="infer")
    pipeline_entries = [e for e in entries if e.config.pipeline]
    full = ModelRepository(repository)  # a pipeline's steps load even when not listed
    steps = {s for e in pipeline_entries for s in e.config.parameters.get("steps", [])}
    hosts = {e.name: ModelHost(e, backend).load() for e in entries if not e.config.pipeline}
    hosts.update({n: ModelHost(full.get(n), backend).load() for n in steps if n not in hosts})

    async def run_step(name: str, inputs: dict) -> dict:
        return await asyncio.get_running_loop().run_in_executor(executor, hosts[name].infer, inputs)

    pipelines = {e.name: create_pipeline(full, e.name, run_step) for e in pipeline_entries}

    def host_of(request: Request) -> ModelHost:
        name = request.path_params["name"]
        if name not in hosts:
            raise unknown_model(name, f"available models: {sorted(hosts)}")
        return hosts[name]

    async def infer_pipeline(request: Request, name: str) -> Response:
        chunks = [chunk async for chunk in request.stream()]
        infer_request = decode_body(chunks, request.headers.get(HEADER_LENGTH))
        validate_inputs(full.get(name).config, infer_request.inputs)
        result = await pipelines[name].infer(infer_request.inputs)
        if infer_request.outputs is not None:
            result = {n: result[n] for n in infer_request.outputs}
        content, headers = encode_response(name, "1", infer_request, result)
        return Response(content, headers=headers)

    async def infer(request: Request) -> Response:
        try:
            if request.path_params["name"] in pipelines:
                return await infer_pipeline(request, request.path_params["name"])
            host = host_of(request)
            chunks = [chunk async for chunk in request.stream()]
            infer_request = decode_body(chunks, request.headers.get(HEADER_LENGTH))
            outputs = await asyncio.get_running_loop().run_in_executor(
                executor, host.infer, infer_request.inputs, infer_request.outputs)
            content, headers = encode_response(host.name, str(host.version), infer_request, outputs)
            return Response(content, headers=headers)
        except Exception as e:
            status, message = error_status(e)
            return JSONResponse({"error": message}, status_code=status)

    async def metadata(request: Request) -> JSONResponse:
        try:
            host = host_of(request)
        except ModelNotFound as e:
            return JSONResponse({"error": e.message}, status_code=404)
        return JSONResponse(model_metadata(host.config, (host.version,), platform_of(host.backend)))

    async def ready(request: Request) -> JSONResponse:
        return JSONResponse({"ready": True})

    return Starlette(routes=[
        Route("/v2/health/live", ready, methods=["GET"]),
        Route("/v2/health/ready", ready, methods=["GET"]),
        Route("/v2/models/{name}", metadata, methods=["GET"]),
        Route("/v2/models/{name}/infer", infer, methods=["POST"]),
    ])


def main(argv: Sequence[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repository", default="engines")
    parser.add_argument("--models", help="comma-separated subset (default: every non-pipeline model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--backend", default="auto", help="auto | onnxruntime | onnxruntime_cuda | tensorrt")
    args = parser.parse_args(argv)
    app = create_app(args.repository, args.models.split(",") if args.models else None, args.backend)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main(sys.argv[1:])
