"""``grpc_service.ServeGrpcMethods``: the KServe v2 methods an ingress deployment answers when Ray
Serve's gRPC server (``add_kserve_v2_service``: every method takes the raw message) calls them
with its call context, over stand-in routes: a message parsed or refused INVALID_ARGUMENT, one
over the body limit RESOURCE_EXHAUSTED naming it, an error answer's code and text, a stream."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
from starlette.responses import Response
from tritonclient.grpc import service_pb2 as pb

from deployments.grpc_service import SERVE_SERVICER, ServeGrpcMethods, add_kserve_v2_service, serves_kserve_grpc
from deployments.routes import error_response
from deployments.runtime.contract.errors import unknown_model

from .test_grpc_forward import Routes, message


class Context:
    """What Ray Serve's ``RayServegRPCContext`` records of a call: code, details, trailing metadata."""

    def __init__(self, metadata: tuple = ()) -> None:
        self.code: Any = None
        self.details = ""
        self.trailing: list = []
        self.metadata = list(metadata)

    def invocation_metadata(self) -> list:
        return self.metadata

    def set_code(self, code: Any) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def set_trailing_metadata(self, metadata: list) -> None:
        self.trailing = metadata


class Deployment(ServeGrpcMethods):
    def __init__(self, routes: Any, cluster: str | None = None) -> None:
        self.routes = routes
        routes.cluster = cluster


class Failing(Routes):
    async def infer(self, request: Any) -> Response:
        return error_response(unknown_model("simple", "version 9 is not served"))


def call(deployment: Deployment, method: str, raw: bytes, metadata: tuple = ()) -> tuple[Any, Context]:
    context = Context(metadata)
    return asyncio.run(getattr(deployment, method)(raw, context)), context


def test_a_model_infer_runs_through_the_routes_and_answers_the_message():
    routes = Routes()
    answer, context = call(Deployment(routes), "ModelInfer", message().SerializeToString())
    assert routes.called == ["/v2/models/simple/infer"]
    assert isinstance(answer, pb.ModelInferResponse) and answer.model_name == "simple" and context.code is None


def test_a_message_that_is_not_protobuf_is_invalid_argument_with_an_empty_answer():
    routes = Routes()
    answer, context = call(Deployment(routes), "ModelInfer", b"\xff\xff\xff\xff not a protobuf")
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT
    assert context.details.startswith("the ModelInfer request is not a valid protobuf message of its type")
    assert answer == pb.ModelInferResponse() and routes.called == []


def test_a_message_over_the_body_limit_is_resource_exhausted_naming_the_limit():
    routes = Routes(max_body_bytes=100)
    raw = message(size=16).SerializeToString()
    assert len(raw) > 100
    answer, context = call(Deployment(routes), "ModelInfer", raw)
    assert context.code == grpc.StatusCode.RESOURCE_EXHAUSTED and routes.called == []
    assert context.details == f"the ModelInfer message is {len(raw)} bytes; the limit is 100 bytes"


def test_an_error_answer_has_its_grpc_code_and_the_http_text():
    answer, context = call(Deployment(Failing()), "ModelInfer", message().SerializeToString())
    assert context.code == grpc.StatusCode.NOT_FOUND
    http = json.loads(bytes(error_response(unknown_model("simple", "version 9 is not served")).body))["error"]
    assert context.details == http and http.startswith("Request for unknown model: 'simple'")
    assert answer == pb.ModelInferResponse()


def test_a_stream_answers_each_message_and_a_failing_one_by_its_id():
    routes = Routes()
    deployment = Deployment(routes)

    async def run() -> list:
        async def raws():
            yield message().SerializeToString()
            yield message(model="nope").SerializeToString()  # the stand-in routes answer any path 200

        return [answer async for answer in deployment.ModelStreamInfer(raws(), Context())]

    answers = asyncio.run(run())
    assert len(answers) == 2 and all(a.infer_response.model_name == "simple" for a in answers)
    assert routes.called == ["/v2/models/simple/infer", "/v2/models/nope/infer"]


def test_serve_registers_every_method_taking_the_raw_message():
    class Server:
        handlers: list = []

        def add_generic_rpc_handlers(self, handlers):
            self.handlers.extend(handlers)

    server = Server()
    add_kserve_v2_service(None, server)
    [handler] = server.handlers
    methods = handler._method_handlers
    assert len(methods) == len(pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods) == 20
    assert all(h.request_deserializer is None for h in methods.values())
    assert methods["/inference.GRPCInferenceService/ModelStreamInfer"].stream_stream is not None
    assert all(hasattr(ServeGrpcMethods, name.rsplit("/", 1)[1]) for name in methods)


def test_serves_kserve_grpc_reads_serves_grpc_options():
    from ray.serve.config import gRPCOptions

    assert serves_kserve_grpc(gRPCOptions(port=8001, grpc_servicer_functions=[SERVE_SERVICER]))
    assert not serves_kserve_grpc(gRPCOptions(port=8001)) and not serves_kserve_grpc(None)


def test_a_call_stamped_by_another_clusters_haproxy_is_unavailable_and_not_run():
    """As HTTP's 421 (``routes.ClusterGuard``): the stamp HAProxy puts on every call
    (``haproxy.CLUSTER_HEADER``) naming another Ray cluster than the replica's."""
    from deployments.haproxy import CLUSTER_HEADER

    routes = Routes()
    raw = message().SerializeToString()
    answer, context = call(Deployment(routes, "session_b"), "ModelInfer", raw, ((CLUSTER_HEADER.lower(), "session_a"),))
    assert context.code == grpc.StatusCode.UNAVAILABLE and routes.called == []
    assert context.details.startswith("this replica belongs to another Ray cluster ('session_b', not 'session_a'")
    for stamp in ((CLUSTER_HEADER.lower(), "session_b"),), ():  # its own cluster's, or none: run
        _, context = call(Deployment(routes, "session_b"), "ModelInfer", raw, stamp)
        assert context.code is None
    assert len(routes.called) == 2
