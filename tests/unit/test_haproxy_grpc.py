"""deployments.haproxy.route_grpc_models on the real HAProxy, with Ray 2.60's own config for a
server whose Serve serves gRPC (``grpc_options``): a ModelInfer reaches the replicas of the model
its message names (a dedicated model's, the pool replica its name hashes to or its placement
names), every other call the router's; a compressed message, whose name HAProxy cannot read,
the router's; a ModelStreamInfer's first answer comes before the client ends its stream. Each
replica here is a small gRPC server answering with its own name."""

from __future__ import annotations

import contextlib
import queue
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import grpc
import pytest
from tritonclient.grpc import service_pb2 as pb

from deployments import haproxy

from .test_haproxy import _free_port, _real_haproxy, _until

# A replica: answers the health check Ray's config sends (a Healthz answer holding "success"),
# a ModelInfer with the model it names and its own name (``id``), a ModelStreamInfer likewise
# for each message as it comes, any other call with an empty message; every answer carries its
# name in the trailing metadata ``served-by``.
_REPLICA = r'''
import sys
from concurrent import futures

import grpc
from tritonclient.grpc import service_pb2 as pb

port, name = int(sys.argv[1]), sys.argv[2]


def answer(raw):
    request = pb.ModelInferRequest.FromString(raw)
    return pb.ModelInferResponse(model_name=request.model_name, id=name)


class Handler(grpc.GenericRpcHandler):
    def service(self, details):
        method = details.method
        if method.endswith("/Healthz"):
            return grpc.unary_unary_rpc_method_handler(lambda raw, context: b"\n\x07success")
        if method.endswith("/ModelStreamInfer"):
            def stream(raws, context):
                for raw in raws:
                    yield pb.ModelStreamInferResponse(infer_response=answer(raw)).SerializeToString()
            return grpc.stream_stream_rpc_method_handler(stream)

        def unary(raw, context):
            context.set_trailing_metadata((("served-by", name),))
            return answer(raw).SerializeToString() if method.endswith("/ModelInfer") else b""
        return grpc.unary_unary_rpc_method_handler(unary)


server = grpc.server(futures.ThreadPoolExecutor(8))
server.add_generic_rpc_handlers((Handler(),))
server.add_insecure_port(f"127.0.0.1:{port}")
server.start()
server.wait_for_termination()
'''


def _ray_grpc_config(folder: Path, front: int, grpc_front: int, apps: dict[str, tuple[str, dict[str, int]]]) -> str:
    """Ray's HAProxy config (Ray 2.60's code) with Serve's gRPC on ``grpc_front``: per application
    (name -> (route prefix, {server name: its gRPC port})) an HTTP and a gRPC backend, rewritten
    as the wrapper does."""
    from ray.serve._private.common import RequestProtocol
    from ray.serve._private.haproxy import BackendConfig, HAProxyApi, HAProxyConfig, ServerConfig
    from ray.serve.config import HTTPOptions, gRPCOptions

    from deployments.grpc_service import SERVE_SERVICER

    cfg = HAProxyConfig(http_options=HTTPOptions(host="127.0.0.1", port=front),
                        grpc_options=gRPCOptions(port=grpc_front, grpc_servicer_functions=[SERVE_SERVICER]),
                        socket_path=str(folder / "admin.sock"), server_state_base=str(folder),
                        server_state_file=str(folder / "server-state"), metrics_socket_path=str(folder / "metrics.sock"))
    api = HAProxyApi(cfg=cfg, config_file_path=str(folder / "haproxy.cfg"))
    backends = {}
    for app, (prefix, servers) in apps.items():
        for protocol in (RequestProtocol.HTTP, RequestProtocol.GRPC):
            name = f"{protocol.value.lower()}-{app}"
            backends[name] = BackendConfig(name=name, path_prefix=prefix, app_name=app, protocol=protocol, servers=[
                ServerConfig(server, "127.0.0.1", port if protocol == RequestProtocol.GRPC else _free_port())
                for server, port in servers.items()])
    api.set_backend_configs(backends)
    api._generate_config_file_internal()
    return haproxy.rewrite_config((folder / "haproxy.cfg").read_text())


POOL = ("pool-a", "pool-b", "pool-c")


@contextlib.contextmanager
def _grpc_haproxy(tmp_path: Path, map_file: Path | None = None, router: bool = True) -> Iterator[str]:
    """The real HAProxy on the rewritten config of a router (``router``; False: not routed, as
    while the server starts), a dedicated model (``ocr``) and a pool of three replicas
    (``POOL``), each a ``_REPLICA`` (with ``map_file``: the pool placed by that map); yields the
    gRPC frontend's address once every server is up."""
    ports = {name: _free_port() for name in ("router", "ocr", *POOL)}
    front, grpc_front, stats, prometheus = (_free_port() for _ in range(4))
    apps = {"models": ("/", {"router": ports["router"]}), "models.ocr": ("/v2/models/ocr", {"ocr": ports["ocr"]}),
            "models.pool": ("/v2/models", {name: ports[name] for name in POOL})}
    if not router:
        del apps["models"]
    config = _ray_grpc_config(tmp_path, front, grpc_front, apps)
    config = config if map_file is None else haproxy.place_pool_models(config, str(map_file))
    config = (config.replace("*:8404", f"127.0.0.1:{stats}").replace("127.0.0.1:8404", f"127.0.0.1:{stats}")
              .replace("127.0.0.1:9101", f"127.0.0.1:{prometheus}"))
    (tmp_path / "grpc.cfg").write_text(config)
    (tmp_path / "replica.py").write_text(_REPLICA)
    processes = [subprocess.Popen([sys.executable, str(tmp_path / "replica.py"), str(port), name])
                 for name, port in ports.items()]
    processes.append(subprocess.Popen([_real_haproxy(), "-db", "-f", str(tmp_path / "grpc.cfg")]))
    address = f"127.0.0.1:{grpc_front}"
    try:
        with grpc.insecure_channel(address) as channel:
            infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")

            def every_replica_answers() -> bool:
                try:  # each server UP in HAProxy's view: its health checks pass (rise 2)
                    return {_infer(infer, f"m{i}") for i in range(24)} | {_infer(infer, "ocr")} >= {*POOL, "ocr"}
                except grpc.RpcError:
                    return False

            _until(every_replica_answers, 60)
        yield address
    finally:
        for process in processes:
            process.kill()
            process.wait()


def _infer(call, model: str, **kwargs) -> str:
    """The name of the replica that answered a ModelInfer for ``model``."""
    return pb.ModelInferResponse.FromString(
        call(pb.ModelInferRequest(model_name=model, raw_input_contents=[b"\x00" * 64]).SerializeToString(),
             timeout=10, **kwargs)).id


def test_a_model_infer_reaches_the_replicas_of_the_model_it_names_and_the_rest_the_router(tmp_path):
    with _grpc_haproxy(tmp_path) as address, grpc.insecure_channel(address) as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        assert {_infer(infer, "ocr") for _ in range(5)} == {"ocr"}
        chosen = {}
        for i in range(16):  # each pool model's calls to one replica; the models spread
            answers = {_infer(infer, f"m{i}") for _ in range(4)}
            assert len(answers) == 1 and answers <= set(POOL), (i, answers)
            chosen[f"m{i}"] = answers.pop()
        assert len(set(chosen.values())) >= 2, chosen
        big = pb.ModelInferRequest(model_name="ocr", raw_input_contents=[b"\x01" * 602_112]).SerializeToString()
        assert pb.ModelInferResponse.FromString(infer(big, timeout=10)).id == "ocr"  # a message of many frames
        assert _infer(infer, "ocr", compression=grpc.Compression.Gzip) == "router"  # its name unreadable
        live = channel.unary_unary("/inference.GRPCInferenceService/ServerLive")
        _, call = live.with_call(b"", timeout=10)
        assert dict(call.trailing_metadata())["served-by"] == "router"
        named = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")  # Ray's own routing stands
        assert _infer(named, "m0", metadata=(("application", "models.ocr"),)) == "ocr"


def test_a_stream_is_answered_message_by_message_before_the_client_ends_it(tmp_path):
    """No buffering of a stream's body (``option http-buffer-request`` held it 30 s): the first
    answer comes while the client's stream is still open."""
    with _grpc_haproxy(tmp_path) as address, grpc.insecure_channel(address) as channel:
        stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
        sent: queue.Queue = queue.Queue()
        done = threading.Event()

        def requests():
            while not done.is_set():
                try:
                    yield sent.get(timeout=0.1)
                except queue.Empty:
                    continue

        answers = stream(requests(), timeout=20)
        try:
            sent.put(pb.ModelInferRequest(model_name="ocr", id="first").SerializeToString())
            first = pb.ModelStreamInferResponse.FromString(next(answers))
            assert first.infer_response.id == "router" and first.infer_response.model_name == "ocr"
        finally:
            done.set()


def test_without_the_router_routed_its_calls_are_unavailable_in_https_words_and_models_answer(tmp_path):
    """As the server starts (the models' applications routed before the router's): a call the
    router would take answers UNAVAILABLE with HTTP's 503 text (Ray's template: NOT_FOUND
    "Application metadata not set"), a named model's ModelInfer reaches its replica."""
    with _grpc_haproxy(tmp_path, router=False) as address, grpc.insecure_channel(address) as channel:
        live = channel.unary_unary("/inference.GRPCInferenceService/ServerReady")
        with pytest.raises(grpc.RpcError) as info:
            live(b"", timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert info.value.details() == haproxy.ROUTER_UNROUTED_ANSWER.format(
            path="/inference.GRPCInferenceService/ServerReady", apps="'models'")
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        assert _infer(infer, "ocr") == "ocr" and _infer(infer, "m1") in POOL


def test_a_placed_pool_model_goes_to_its_replica(tmp_path):
    """With placement, a ModelInfer goes where the map names, as an HTTP request does."""
    placement = tmp_path / "placement.map"
    entries = haproxy.placement_map({"m0": ["pool-b"], "m1": ["pool-c"], "m2": ["pool-a"]})
    placement.write_text("".join(f"{model} {servers}\n" for model, servers in entries.items()))
    with _grpc_haproxy(tmp_path, placement) as address, grpc.insecure_channel(address) as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        assert [{_infer(infer, f"m{i}") for _ in range(4)} for i in range(3)] == [{"pool-b"}, {"pool-c"}, {"pool-a"}]


@pytest.mark.parametrize("config", ["no grpc frontend", "routed"])
def test_route_grpc_models_is_idempotent_and_leaves_a_config_without_grpc(tmp_path, config):
    if config == "no grpc frontend":
        from .test_haproxy import _ray_haproxy_config

        rays = haproxy.rewrite_config(_ray_haproxy_config(tmp_path, "127.0.0.1", {"models": "/"}).read_text())
        assert haproxy.GRPC_MODEL_MARKER not in rays and haproxy.route_grpc_models(rays) == rays
        return
    routed = _ray_grpc_config(tmp_path, _free_port(), _free_port(), {"models": ("/", {"router": 9})})
    assert routed.count(haproxy.GRPC_MODEL_MARKER) == 2 and haproxy.route_grpc_models(routed) == routed


def test_a_dotted_models_backends_are_backed_up_by_the_router_not_a_model_whose_name_it_extends(tmp_path):
    """``models.ocr.v2``'s backends (HTTP and gRPC) get the router's servers as backups, not
    ``models.ocr``'s (the longest backend name its name began with, before)."""
    config = _ray_grpc_config(tmp_path, _free_port(), _free_port(), {
        "models": ("/", {"router": 9}), "models.ocr": ("/v2/models/ocr", {"ocr": 10}),
        "models.ocr.v2": ("/v2/models/ocr.v2", {"ocr-v2": 11})})
    for protocol in ("http", "grpc"):
        section = config.split(f"backend {protocol}-models.ocr.v2\n")[1].split("\nbackend ")[0]
        backups = [line.split()[1] for line in section.splitlines() if line.strip().startswith("server ")
                   and "backup" in line.split()]
        assert "trt-router-router" in backups and "trt-router-ocr" not in backups, (protocol, backups)
