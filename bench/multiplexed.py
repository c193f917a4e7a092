"""Ray Serve's plain ``@serve.multiplexed`` routing with a count cap: issue 31's anchor for
``bench.placement`` (its ``multiplexed`` policy).

What runs (``python -m bench.multiplexed``, started by ``bench.placement`` in a session of its
own, with the same Ray and HAProxy environment as ``make serve``): application ``models.pool``
at route prefix ``/``:

* ``ingress`` (``INGRESS_REPLICAS`` replicas): takes ``POST /v2/models/<m>/infer`` and calls the
  pool through its handle with ``multiplexed_model_id=<m>`` (the router hop: Serve's routing of
  multiplexed models works only through a handle), answers ``/v2/health/ready`` and
  ``/metrics`` (the loads the pool replicas counted, as ``bench.placement.cache_counters`` reads
  them);
* ``pool`` (``--replicas``): its ``@serve.multiplexed(max_num_models_per_replica=K)`` loader
  opens ``<repository>/<m>/1/model.onnx`` in an ONNX Runtime session (CPU, or CUDA with
  ``--gpu-fraction``: then each replica holds that fraction of a GPU, as the pool's do); the request is
  decoded and answered with the project's codec (``deployments.protocol.binary``), so the
  answers are checked as the other policies' are. Serve evicts the least recently used model
  past K (by count: the bytes are only counted here, from the footprints ``bench.placement``
  measured, to report what the cap let a replica hold against the byte budget).

Every load is counted by the loader (a second load of a model on the same replica is a reload)
and reported with the replica's resident bytes to a named actor (``LoadCounts``), which the
ingress reads for ``/metrics``: ``trt_serve_cache_loads`` / ``_reloads`` / ``_evictions``
counters and the ``trt_serve_cache_resident_bytes`` gauge (the most the replica held since it
started) and ``_budget_bytes``, per ``replica`` label.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
from typing import Any, Sequence

COUNTS_ACTOR = "placement_bench_loads"
NAMESPACE = "placement_bench"
APP = "models.pool"
INGRESS_REPLICAS = 2


def prometheus_text(replicas: dict[str, dict[str, float]]) -> str:
    """The counters and gauges of ``replicas`` (replica -> ``loads``, ``reloads``,
    ``evictions``, ``resident_bytes``, ``budget_bytes``) in Prometheus's text format."""
    kinds = {"loads": "counter", "reloads": "counter", "evictions": "counter",
             "resident_bytes": "gauge", "budget_bytes": "gauge"}
    lines = []
    for key, kind in kinds.items():
        name = f"trt_serve_cache_{key}"
        lines.append(f"# TYPE {name} {kind}")
        suffix = "_total" if kind == "counter" else ""
        lines += [f'{name}{suffix}{{replica="{r}"}} {float(state.get(key, 0))}' for r, state in sorted(replicas.items())]
    return "\n".join(lines) + "\n"


def build(repository: str, replicas: int, max_models: int, footprints: dict[str, int], budget_bytes: int,
          gpu_fraction: float = 0.0) -> Any:
    """The application (module docstring)."""
    import ray
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response

    @ray.remote(num_cpus=0)
    class LoadCounts:
        def __init__(self) -> None:
            self.replicas: dict[str, dict[str, float]] = {}

        def report(self, replica: str, state: dict[str, float]) -> None:
            self.replicas[replica] = state

        def all(self) -> dict[str, dict[str, float]]:
            return self.replicas

    counts = LoadCounts.options(name=COUNTS_ACTOR, namespace=NAMESPACE, lifetime="detached",
                                get_if_exists=True).remote()

    class Loaded:
        """One model's ONNX Runtime session; tells the replica when Serve evicts it (``__del__``)."""

        def __init__(self, name: str, session: Any, gone: Any) -> None:
            self.name, self.session, self._gone = name, session, gone

        def __del__(self) -> None:  # Serve calls it at eviction, Python again when the object goes
            gone, self._gone = self._gone, None
            if gone is not None:
                gone(self.name)

    providers = ["CUDAExecutionProvider"] if gpu_fraction else ["CPUExecutionProvider"]

    @serve.deployment(name="pool", num_replicas=replicas,
                      ray_actor_options={"num_cpus": 0, **({"num_gpus": gpu_fraction} if gpu_fraction else {})})
    class Pool:
        def __init__(self) -> None:
            self.replica = serve.get_replica_context().replica_id.unique_id
            self.seen: set[str] = set()
            self.resident: set[str] = set()
            self.state = {"loads": 0, "reloads": 0, "evictions": 0, "resident_bytes": 0, "budget_bytes": budget_bytes}
            self._report()

        def _report(self) -> None:
            counts.report.remote(self.replica, dict(self.state))

        def _gone(self, name: str) -> None:
            self.resident.discard(name)
            self.state["evictions"] += 1
            self._report()

        @serve.multiplexed(max_num_models_per_replica=max_models)
        async def get_model(self, name: str) -> Loaded:
            import onnxruntime as ort

            path = os.path.join(repository, name, "1", "model.onnx")
            session = await asyncio.to_thread(ort.InferenceSession, path, providers=providers)
            self.state["reloads" if name in self.seen else "loads"] += 1
            self.seen.add(name)
            self.resident.add(name)
            held = sum(footprints.get(m, 0) for m in self.resident)
            self.state["resident_bytes"] = max(self.state["resident_bytes"], held)
            self._report()
            return Loaded(name, session, self._gone)

        async def infer(self, body: bytes, header_length: str | None) -> tuple[bytes, dict[str, str]]:
            from deployments.protocol.binary import decode_body, encode_response

            name = serve.get_multiplexed_model_id()
            model = await self.get_model(name)
            request = decode_body([body], header_length)
            names = [o.name for o in model.session.get_outputs()]
            values = await asyncio.to_thread(model.session.run, names, request.inputs)
            return encode_response(name, "1", request, dict(zip(names, values)))

    @serve.deployment(name="ingress", num_replicas=INGRESS_REPLICAS, ray_actor_options={"num_cpus": 0})
    class Ingress:
        def __init__(self, pool: Any) -> None:
            self.pool = pool

        async def __call__(self, request: Request) -> Response:
            from deployments.protocol.binary import HEADER_LENGTH

            parts = request.url.path.split("/")
            if request.url.path == "/v2/health/ready":
                return PlainTextResponse("ready")
            if request.url.path == "/metrics":
                return PlainTextResponse(prometheus_text(await counts.all.remote()))
            if request.method == "POST" and len(parts) == 5 and parts[1:3] == ["v2", "models"] and parts[4] == "infer":
                body, headers = await self.pool.options(multiplexed_model_id=parts[3]).infer.remote(
                    await request.body(), request.headers.get(HEADER_LENGTH))
                return Response(body, headers=headers)
            return JSONResponse({"error": f"no route {request.url.path}"}, status_code=404)

    return Ingress.bind(Pool.bind())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repository", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--replicas", type=int, required=True)
    parser.add_argument("--max-models", type=int, required=True)
    parser.add_argument("--budget-bytes", type=int, required=True)
    parser.add_argument("--footprints", required=True, help="JSON: model -> bytes")
    parser.add_argument("--gpu-fraction", type=float, default=0.0, help="each pool replica's num_gpus (0: CPU)")
    a = parser.parse_args(argv)
    from deployments import loopback

    os.environ.update(loopback.local_env(os.environ))
    import ray
    from ray import serve

    ray.init(include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": a.port})
    serve.run(build(a.repository, a.replicas, a.max_models, json.loads(a.footprints), a.budget_bytes,
                    a.gpu_fraction),
              name=APP, route_prefix="/")
    print(f"serving on 127.0.0.1:{a.port}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    serve.shutdown()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
