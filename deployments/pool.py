"""The multiplexed pool deployment: the long tail of models, under a byte budget per replica.

The deployment is the ingress of its own application (``deployments.app.applications``): its
replicas answer the pool models' KServe v2 routes straight from the HTTP ingress
(``replica_routes.PoolRoutes``), HAProxy choosing the replica by the model's name
(``haproxy.hash_pool_models``) or, with ``placement: bytes``, by the pool's placement
(``deployments.placement``); the router and pipelines call it through handles, by
multiplexed model id.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from typing import Any, Iterable

import numpy as np
from ray import serve

from .client import POOL, handle, router_application
from .control import Desired, first_sync, follow, outcome, read_as_desired
from .admission import Admission
from .replica_routes import pool_routes
from .routes import RouterOptions
from .node import node_id
from .grpc_service import ServeGrpcMethods
from .loopback import replica_grpc_on_loopback
from .logs import show_on_terminal
from .placement import PlacementFollower, PoolReport, haproxy_server_name
from .observe.deployment import cache_recorder, observe_replica_infer, replica_recorder
from .protocol.answer import Answer, answer_body
from .protocol.errors import errors_as_values
from .runtime.backends.select import requested_backend, resolve_backend
from .runtime.backends.gpu_memory import process_gpu_bytes
from .runtime.contract.config import CacheOptions
from .runtime.contract.errors import ConfigError, ModelNotFound
from .runtime.contract.repository import ModelEntry, ModelRepository
from .runtime.residency.cache import ModelCache
from .runtime.residency.placement import RateMeter

logger = logging.getLogger("ray.serve")


def _backend_here(requested: str) -> str:
    """The backend the cache will load a model with on this machine (it resolves ``requested``
    the same way); ``requested`` itself when that cannot work here (its load will say why)."""
    try:
        return resolve_backend(requested)
    except ConfigError:
        return requested


@serve.deployment
@serve.ingress()
class PoolDeployment(ServeGrpcMethods):
    """Serves the models not given a dedicated deployment: their HTTP routes (``PoolRoutes``, the
    model named in the path), and calls through handles chosen by multiplexed model id.

    HAProxy sends a model's requests to a replica its placement names (``placement: bytes``, the
    default) or to the one its name hashes to (``hash``); Ray Serve's multiplexing
    routes a handle's calls to a replica that has the model and caps the models per replica
    by count (``max_num_models_per_replica``); what is actually resident is
    decided by the replica's ``ModelCache``: the same count cap plus ``memory_budget_mib``, with
    the chosen ``load_policy``, never evicting a model a request holds.

    Args:
        repository: model repository root.
        names: the models of the pool.
        backend: ``auto``, ``onnxruntime`` or ``tensorrt``.
        options: the pool's ``CacheOptions`` (``deployments.app.PoolOptions``), passed whole to
            the ``ModelCache``.
        routes: body limit and timeout of the pool models' routes (``RouterOptions``).
        metrics: ``deployments.observe.options.MetricsOptions`` as a dict (default: on).
        initial: the build-time desired state of explicit model control (None: off); the
            control deployment is the router application's (``client.router_application``).
        models: the models served, as read at build (``ModelRepository``'s ``entries``; None:
            every folder of the repository, read now); the routes answer for every one of them
            as the router does (an unknown model's 404 names them), and for one loaded later
            once it is (``apply``).
        max_ongoing_requests, max_queued_requests: the pool's; requests beyond both are shed
            with 503 (``admission.Admission``; ``max_queued_requests`` None: no bound).
        placement: ``bytes`` (default) or ``hash``: with ``bytes`` the replica reports to the router
            application's placement deployment and loads and releases models as it decides
            (``deployments.placement.PlacementFollower``).
    """

    async def __init__(self, repository: str, names: Iterable[str], backend: str, options: CacheOptions,
                       routes: RouterOptions, metrics: dict[str, Any] | None = None, initial: Desired | None = None,
                       models: list[ModelEntry] | None = None, max_ongoing_requests: int = 512,
                       max_queued_requests: int | None = None, placement: str = "bytes") -> None:
        show_on_terminal()
        replica_grpc_on_loopback()
        names = list(names)
        self.repo = repo = ModelRepository(repository, names, entries=models, node=node_id(), keep_files=True)
        self.backend_request = backend
        self.backends = {e.name: _backend_here(requested_backend(e.config, backend)) for e in repo.entries()}
        self.recorder = replica_recorder(metrics)
        self.entries = {n: repo.get(n) for n in names}  # what the cache serves of each model
        self.versions = {n: e.latest for n, e in self.entries.items()}
        self.keys = {key: (n, v) for n in names for key, v in repo.get(n).keys().items()}  # cache key -> model, version
        self.cache = ModelCache(
            repo, names, options, backend=backend,
            on_event=cache_recorder(self.recorder, options.budget_bytes),
            on_execution=self.recorder and self.recorder.on_execution)
        for name, state in (initial or {}).items():  # explicit model control: not loaded at start
            if name in self.versions and not state["loaded"]:
                self._unload(name)
        self.cache.start()
        self.admission = Admission(max_ongoing_requests, max_queued_requests, routes.request_timeout_s)
        router_app = router_application(POOL)
        self.routes = pool_routes(ModelRepository(repository, entries=models, node=node_id()), names, self.infer_body, self.models,
                                  routes, metrics, initial, router_app)
        self.routes.admission = self.admission
        control = handle(router_app, "control") if initial is not None else None
        self.routes.follower = follow(control, initial or {}, self.apply)

        async def register(name: str) -> str:  # a plain function: Ray keeps its routing LRU on it
            if name not in self.cache.names:
                raise ModelNotFound(f"model '{name}' is not in the multiplexed pool; pool: {self.cache.names}")
            return name  # residency is the cache's business, not Ray's

        cap = options.max_num_models_per_replica
        self._get_model = serve.multiplexed(max_num_models_per_replica=-1 if cap is None else cap)(register)
        await first_sync(self.routes.follower)  # routed only once it serves the current state
        self.rates = RateMeter()
        self.placement = None if placement != "bytes" else self._follow_placement(router_app, options)
        if self.placement is not None and self.routes.follower is not None:
            # a load or unload answers once the placement deployment has this replica's cache
            # after it (the repository index reads it there: READY at once after a load's 200)
            self.routes.follower.before_report = self.placement.sync

    def _follow_placement(self, router_app: str, options: CacheOptions) -> PlacementFollower:
        """Start following the router application's placement deployment (``placement: bytes``)."""
        replica_id = serve.get_replica_context().replica_id
        server = haproxy_server_name(replica_id)

        def report() -> PoolReport:
            served = [n for n in self.versions if self.cache.serves(n)]
            resident = set(self.cache.resident())
            footprints = {n: b for n in served if (b := self.cache.footprint_bytes(n)) is not None}
            estimates = {n: b for n in served if n not in footprints and (b := self.cache.estimated_bytes(n)) is not None}
            cached = {key: {"state": m["state"], "evictions": m["evictions"], "load_error": m["load_error"]}
                      for key, m in self.models().items() if self.keys.get(key, ("",))[0] in served
                      and (m["state"] != "absent" or m["evictions"] or m["load_error"])}
            return PoolReport(server, options.budget_bytes, options.max_num_models_per_replica, served,
                              sorted(n for n in served if n in resident), footprints, self.rates.rates(served),
                              estimates, cached, self.cache.gpu_growth_bytes)

        follower = PlacementFollower(handle(router_app, "placement"), replica_id.unique_id, report,
                                     self.cache.prefetch, self.cache.release)
        follower.task = asyncio.get_running_loop().create_task(follower.run())
        return follower

    @errors_as_values
    async def infer(self, inputs: dict[str, np.ndarray], outputs: list[str] | None = None,
                    version: int | None = None) -> dict[str, np.ndarray]:
        """Run one request on the model version named by the multiplexed model id (its cache
        key, ``ModelEntry.key``: the model name for its newest served version); ``version``: the
        version the caller labels the answer with (``ModelCache.infer_async`` checks it).

        The cache validates the request once, before any load (``ModelCache.infer_async``).

        Returns, not raises, a ``ServingError`` (``errors_as_values``): as ``ModelCache.infer_async``
        (``InvalidInput``, ``OverBudget``...).
        """
        return await self._run(serve.get_multiplexed_model_id(), inputs, outputs, version)

    @observe_replica_infer(lambda self, key, *_: self._model_version(key))
    async def _run(self, key: str, inputs: dict[str, np.ndarray], outputs: list[str] | None = None,
                   version: int | None = None) -> dict[str, np.ndarray]:
        """``infer``'s work for cache key ``key``, raising its errors (``infer_body`` runs it
        inside its own, with ``version``: the version its answer is labelled with, which the
        cache checks the engine against)."""
        with self.admission.request():
            name = await self._get_model(key)
            self.rates.add(self._model_version(name)[0])
            return await self.cache.infer_async(name, inputs, outputs, version)

    @errors_as_values
    async def infer_body(self, model: str, version: str, batched: bool, chunks: list[bytes],
                         header_length: str | None, default_timeout_s: float, key: str | None = None) -> Answer:
        """An infer request's body, as it arrived, for the version keyed ``key`` (its cache key,
        ``ModelEntry.key``; None: the multiplexed model id, a call through a handle): decoded
        here, run as ``infer`` (within the request's own ``parameters.timeout`` where shorter
        than ``default_timeout_s``, the routes' bound), and encoded for ``model`` at ``version``
        (``protocol.answer.answer_body``; ``batched``: the model's ``max_batch_size > 0``).

        Returns, not raises, a ``ServingError`` (``errors_as_values``): as ``answer`` and ``infer``
        (``InvalidInput`` for a malformed body; ``Overloaded`` past the pool's bounds).
        """
        run = functools.partial(self._run, serve.get_multiplexed_model_id() if key is None else key,
                                version=int(version))
        return await answer_body(model, version, batched, chunks, header_length, run, default_timeout_s,
                                 self.routes.shared_memory)

    def __serve_build_asgi_app__(self) -> Any:
        return self.routes.build_app()

    def apply(self, changed: Desired) -> dict[str, dict[str, Any]]:
        """Model control (``deployments.control``): load or unload the pool models in ``changed``
        in this replica's cache. A load reads the model's folder again, with the same validation
        as at start, for exactly what the router read (``control.read_as_desired``: the versions
        the state names, its config's hash; a folder changed since fails the load): a model not
        served yet (added to the repository after start) is added; one whose folder changed (a
        new version, another config) is unloaded (its requests in flight finish on the engine
        they were labelled for), takes the new entry and loads again, so that the engine, the
        labels, the metadata and the validation all follow the same reading; if that load
        fails, it serves what it served before (``_load_reading``). Blocking."""
        done = {}
        for name, state in changed.items():
            if state["placement"] != "pool":
                continue
            served = self.entries.get(name) if self.cache.serves(name) else None  # what it serves now
            try:
                if not state["loaded"]:
                    self.routes.model_unloaded(name, state.get("reason"))
                    if name in self.versions:
                        self._unload(name)
                    self.repo.release(name)  # the node cache may evict its files now
                    done[name] = outcome(None, False)
                    continue
                entry = read_as_desired(self.repo, name, state)
                self._load_reading(entry)
                self.routes.pool_model_loaded(entry, self.backends[name])
                done[name] = outcome(None, True, self.backends[name])
            except Exception as error:
                done[name] = outcome(error, False)
                if served is None or self.entries.get(name) != served or not self.cache.serves(name):
                    self.routes.model_unloaded(name, f"failed to load: {done[name]['error'].message}")
        return done

    def _load_reading(self, entry: ModelEntry) -> None:
        """Serve ``entry`` (its folder as the load read it) and load it. A model that serves
        another reading keeps it when this one fails, so a failed load changes nothing: the new
        versions' files are checked (``ModelEntry.check_files``) before the old versions are
        unloaded, and if the new engines still fail to load, the old reading is taken back and
        loaded again (one engine set at a time: both may not fit the pool's byte budget). Its
        requests meanwhile wait for the load (``ModelCache.replacing``) and run on what serves
        then, where it is the version they are labelled with. Blocking.

        Raises: as ``ModelCache.load``; ``LoadFault`` (``check_files``).
        """
        name = entry.name
        old = self.entries.get(name) if self.cache.serves(name) and entry != self.entries.get(name) else None
        if old is not None:
            entry.check_files()
        with self.cache.replacing(self._keys_of(name) if old is not None else ()):  # its requests wait meanwhile
            self.repo.take(entry)
            if entry != self.entries.get(name):
                self._take(entry)
            try:
                for key in self._keys_of(name):
                    self.cache.load(key)
            except Exception:
                if old is None:
                    raise
                self.repo.take(old)
                self._take(old)
                try:
                    for key in self._keys_of(name):
                        self.cache.load(key)
                except Exception:
                    self._unload(name)
                    logger.exception("model control: '%s' failed to load its versions %s again after the load of %s "
                                     "failed", name, list(old.served), list(entry.served))
                raise

    def _take(self, entry: ModelEntry) -> None:
        """Serve ``entry`` (a model new to this replica, or its folder read again with a new
        version or config) in place of what the cache holds for it: the old versions are
        unloaded first (``ModelCache.add`` replaces only unloaded entries). Blocking."""
        name = entry.name
        if name in self.entries:
            self._unload(name)
        self.cache.add(entry, enabled=False)
        self.entries[name], self.versions[name] = entry, entry.latest
        self.keys = {k: kv for k, kv in self.keys.items() if kv[0] != name}  # versions it no longer serves
        self.keys.update((key, (name, v)) for key, v in entry.keys().items())
        self.backends[name] = _backend_here(requested_backend(entry.config, self.backend_request))

    def _model_version(self, key: str) -> tuple[str, int | None]:
        """(model, version) of a cache key; (key, None) for a key this replica does not serve."""
        return self.keys.get(key, (key, None))

    def _keys_of(self, name: str) -> list[str]:
        """The cache keys of model ``name``'s served versions."""
        return [key for key, (model, _) in self.keys.items() if model == name]

    def _unload(self, name: str) -> None:
        for key in self._keys_of(name):
            self.cache.unload(key)

    def check_health(self) -> None:
        """Ray's periodic probe: fails (so Serve replaces the replica) when a loaded model's
        engine or device is unusable (``ModelCache.check_health``: a sticky CUDA error)."""
        self.cache.check_health()

    def models(self) -> dict[str, dict[str, Any]]:
        """Per served version of each pool model on this replica, by cache key (``ModelEntry.key``):
        ``state`` in the cache (``absent``, ``loading``, ``ready``, ``evicting``), ``evictions`` so
        far, the ``backend`` it runs (or will run) on, and ``load_error``: why its last load
        failed where another would fail alike (empty: none did, or one succeeded since)."""
        cached = self.cache.status()["models"]
        return {key: {"state": cached[key]["state"], "evictions": cached[key]["evictions"],
                      "backend": self.backends[name], "load_error": cached[key]["load_error"]}
                for key, (name, _) in self.keys.items() if key in cached}

    def memory(self) -> dict[str, Any]:
        """This replica's cache status and load/evict/reload timeline (JSON-ready), with its Ray
        ``node`` and ``request_rates``: its requests per second by model, decayed (``RateMeter``)."""
        context = serve.get_replica_context()
        status = {"replica": context.replica_id.unique_id, "pid": os.getpid(), "node": node_id(),
                  "request_rates": self.rates.rates(), **self.cache.status()}
        if any(m["device"] == "gpu" for m in status["models"].values()):
            reading = process_gpu_bytes()  # this replica's own GPU bytes (CUDA context included)
            status.update(process_gpu_bytes=reading.bytes, gpu_source=reading.source)
        if self.placement is not None:
            status["placement"] = self.placement.visible()
        return {**status, "events": self.cache.timeline()}
