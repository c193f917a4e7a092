"""The echo ceiling: a Serve ingress replica that answers every KServe v2 infer, no model.

``bench.throughput`` serves it beside the product in the same Ray cluster (application
``echo`` at ``/echo``, as many replicas as the product's), through the same ingress (HAProxy in
the ``fast`` config), and measures it with the very requests the product gets (prefix
``/echo``): ingress -> one replica -> answer is the most any path through this cluster can
reach on this machine, so every product figure is also reported as a fraction of it.

The replica reads the whole request body (the bytes cross the same sockets as the product's)
and answers a fixed one-element FP32 output named ``echo`` under the requested model's name:
Triton binary tensor data when the request is binary (it carries
``Inference-Header-Content-Length``), JSON otherwise. Nothing is decoded or validated.

    POST /v2/models/{name}[/versions/{version}]/infer   200, the fixed response
    GET  /v2/health/live, /v2/health/ready              200
"""

from __future__ import annotations

import functools
import json
from typing import Any

import numpy as np

from ray import serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from deployments.loopback import replica_grpc_on_loopback
from deployments.protocol.binary import HEADER_LENGTH

APP_NAME = "echo"
ROUTE_PREFIX = "/echo"
OUTPUT = b"\x00\x00\x00\x00"  # one FP32 zero


def expected():
    """What every echo answer holds (``bench.loadgen.Expected``): ``echo``, FP32 [1], zero."""
    from bench.loadgen import Expected

    return Expected.of({"echo": np.zeros(1, np.float32)}, {"echo": "FP32"})


@functools.lru_cache(maxsize=256)
def response_for(model: str, binary: bool) -> tuple[bytes, dict[str, str]]:
    """(body, headers) of the fixed answer for ``model``: output ``echo``, FP32, shape [1]."""
    tensor: dict[str, Any] = {"name": "echo", "datatype": "FP32", "shape": [1]}
    if not binary:
        body = {"model_name": model, "outputs": [{**tensor, "data": [0.0]}]}
        return json.dumps(body, separators=(",", ":")).encode(), {"content-type": "application/json"}
    head = json.dumps({"model_name": model, "outputs": [{**tensor, "parameters": {"binary_data_size": len(OUTPUT)}}]},
                      separators=(",", ":")).encode()
    return head + OUTPUT, {"content-type": "application/octet-stream", HEADER_LENGTH: str(len(head))}


async def infer(request: Request) -> Response:
    await request.body()
    body, headers = response_for(request.path_params["name"], HEADER_LENGTH.lower() in request.headers)
    return Response(body, headers=headers)


async def healthy(request: Request) -> Response:
    return Response(b"", status_code=200)


def create_app() -> Starlette:
    """The echo routes as a Starlette app (no Ray: tests drive it with ``TestClient``)."""
    return Starlette(routes=[
        Route("/v2/models/{name}/infer", infer, methods=["POST"]),
        Route("/v2/models/{name}/versions/{version}/infer", infer, methods=["POST"]),
        Route("/v2/health/live", healthy, methods=["GET"]),
        Route("/v2/health/ready", healthy, methods=["GET"]),
    ])


@serve.deployment(max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0.01})
@serve.ingress()
class Echo:
    """``create_app`` as a Ray Serve ingress deployment (the way ``deployments.ingress.Router`` is)."""

    def __init__(self) -> None:
        replica_grpc_on_loopback()  # as every product deployment: nothing listens beyond 127.0.0.1
        self.asgi = create_app()

    def __serve_build_asgi_app__(self) -> Starlette:
        return self.asgi


def app(replicas: int) -> Any:
    """The echo application with ``replicas`` replicas (``serve.run(app(k), name=APP_NAME,
    route_prefix=ROUTE_PREFIX)``)."""
    return Echo.options(num_replicas=replicas).bind()
