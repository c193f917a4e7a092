"""The dedicated deployment of one hot model: every replica loads it at start.

Thin Ray layer: each replica owns a ``ModelHost`` and runs its blocking calls in worker threads,
so one replica serves ``instances`` requests at once. A request is validated here, once, by
the replica that runs it. The deployment is the ingress of its own application
(``deployments.app.applications``): its replicas answer the model's KServe v2 routes
(``replica_routes.ModelRoutes``) straight from the HTTP ingress, and pipelines call ``infer`` through
handles.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import numpy as np
from ray import serve

from .control import Desired, config_kept, first_sync, loaded_at_start, outcome, read_as_desired
from .admission import Admission
from .replica_routes import own_routes
from .routes import RouterOptions
from .node import node_id
from .grpc_service import ServeGrpcMethods
from .loopback import replica_grpc_on_loopback
from .logs import show_on_terminal
from .observe.deployment import observe_replica_infer, replica_recorder
from .protocol.errors import errors_as_values
from .batching import BatchItem, BatchPolicy, BatchRun, BatchScheduler, BatchStats, run_batch
from .runtime.backends.gpu_memory import process_gpu_bytes
from .runtime.contract.device import device_io
from .runtime.contract.errors import replaced_version
from .runtime.contract.repository import ModelEntry, ModelRepository
from .runtime.residency.gate import Gate
from .runtime.residency.host import ModelHost
from .runtime.residency.predict import predict

logger = logging.getLogger("ray.serve")


@serve.deployment
@serve.ingress()
class ModelDeployment(ServeGrpcMethods):
    """A dedicated deployment: every replica loads one model at start (eager).

    Args:
        repository: model repository root.
        name: the model.
        backend: ``auto``, ``onnxruntime``, ``onnxruntime_cuda`` or ``tensorrt``.
        routes: body limit and timeout of the model's routes (``RouterOptions``).
        metrics: ``MetricsOptions`` as a dict (default: on).
        initial: the build-time desired state of explicit model control (None: off); the
            control deployment is the router application's (``client.router_application``).
        max_ongoing_requests, max_queued_requests: the model's; requests beyond both are shed
            with 503 (``admission.Admission``; ``max_queued_requests`` None: no bound).
        models: the model's entry as read at build (``ModelRepository``'s ``entries``); None:
            its folder is read now.

    With ``dynamic_batching`` in the model's config, concurrent requests are batched by a
    ``BatchScheduler`` (see ``deployments.batching``), up to ``instances`` batches at once.
    The shapes batches run at (padded sizes, sequence buckets on a GPU) run once at load
    (``BatchPolicy.warm_shapes``, ``ModelHost.warm``), so no request pays a shape's first run.
    """

    async def __init__(self, repository: str, name: str, backend: str, routes: RouterOptions,
                       metrics: dict[str, Any] | None = None, initial: Desired | None = None,
                       max_ongoing_requests: int = 512, max_queued_requests: int | None = None,
                       models: list[ModelEntry] | None = None) -> None:
        show_on_terminal()
        replica_grpc_on_loopback()
        loaded = loaded_at_start(initial, name)
        self.repo = ModelRepository(repository, [name], entries=models, node=node_id(), keep_files=True)
        self.host = ModelHost(self.repo.get(name), backend)
        self.gate = Gate(name, open_=loaded)
        if loaded:
            self.host.load()
        self.admission = Admission(max_ongoing_requests, max_queued_requests, routes.request_timeout_s)
        self.routes = own_routes(self.repo.get(name), self.repo, self.infer, routes, metrics, initial,
                                 self.host.backend if loaded else None, self.apply)
        self.routes.admission = self.admission
        self.recorder = replica_recorder(metrics)
        if self.recorder is not None:
            self.host.on_execution = self.recorder.on_execution
        # Its padding depends on the backend, known once loaded (``_loaded_policy``, again at each
        # load); the batch queue's size and delay do not. A model not loaded at start (explicit
        # model control) has no backend yet: asking the host for it failed the constructor.
        self._policy = self._loaded_policy() if loaded else BatchPolicy.of(self.host.config)
        policy = self._policy
        self._batched = None if policy is None else BatchScheduler(
            lambda items, loaded: run_batch(self.host, items, self._policy, loaded), policy.max_rows, policy.wait_s,
            self.host.config.instances, self._batch_ran, lambda fn, *args: self.host.call(fn, *args))
        await first_sync(self.routes.follower)  # routed only once it serves the current state

    @errors_as_values
    @observe_replica_infer(lambda self, *_: (self.host.name, self.host.version))
    async def infer(self, inputs: dict[str, np.ndarray], outputs: list[str] | None = None,
                    version: int | None = None) -> dict[str, np.ndarray]:
        """Validate and run one request; see ``ModelHost.infer`` for shapes and raised errors.
        ``version``: the version the caller labels the answer with; a request labelled with
        another version than the one loaded (a load took a new one while it waited) answers
        ``ModelNotReady``.

        A ``ServingError`` is returned, not raised (``errors_as_values``): its callers, this
        replica's routes and other deployments' handles, raise it again.

        Validated once: by ``ModelHost.infer`` without batching, by ``BatchItem.of`` before a
        request joins the batch queue (the joined batch is not checked again). A request with
        tensors in CUDA shared memory runs alone, unbatched, where they lie.
        """
        with self.admission.request():
            async with self.gate.request():  # an unload waits for those inside; a new version's load holds new ones
                if version is not None and version != self.host.version:
                    raise replaced_version(self.host.name, version, f"version {self.host.version}")
                return await self._infer(inputs, outputs)

    async def _infer(self, inputs: dict[str, np.ndarray], outputs: list[str] | None) -> dict[str, np.ndarray]:
        if self._batched is None or device_io(inputs, outputs):  # CUDA shared memory runs where it lies
            if self.host.runs_inline():  # a short run: the hop to a thread costs more
                return self.host.infer(inputs, outputs)
            return await self.host.call(self.host.infer, inputs, outputs)
        item = BatchItem.of(self.host.config, inputs, outputs, self._policy.sequence)
        if item.rows > self._batched.max_rows:  # a request over the batch size runs alone
            return item.own(await self.host.call(self.host.run, item.inputs, item.outputs))
        if self.recorder is not None:
            self.recorder.batch_member(item)
        return await self._batched.infer(item)

    def _batch_ran(self, items: list[BatchItem], run: BatchRun, seconds: float) -> None:
        if self.recorder is not None:
            self.recorder.batch_ran(items, seconds)
            self.recorder.batch_padding(self.host.name, self.host.version, run)

    def apply(self, changed: Desired) -> dict[str, dict[str, Any]]:
        """Model control (``deployments.control``): load or unload this replica's model when it
        is in ``changed``. An unload refuses new requests (503), waits for those in flight (the
        batch queue included), then frees the engine. Blocking."""
        state = changed.get(self.host.name)
        if state is None:
            return {}
        try:
            if state["loaded"]:
                entry, replaced = self._take_new_version(state)
                try:
                    self.host.load()
                except Exception:
                    if replaced is not None:
                        self._serve_again(replaced)
                    raise
                self.repo.take(entry)  # its routes describe the version once it serves
                self._policy = self._loaded_policy()
                self.gate.open()
                self.routes.model_loaded(self.host.backend)
                return {self.host.name: outcome(None, True, self.host.backend)}
            self.routes.model_unloaded(state.get("reason"))
            self.gate.close()
            self.host.unload()
            self.repo.release(self.host.name)  # the node cache may evict its files now
            return {self.host.name: outcome(None, False)}
        except Exception as error:
            self.gate.settle()  # the requests a new version's load held: served again, or refused
            line = outcome(error, False)
            if not (self.host.ready and self.gate.is_open):  # one that serves keeps serving what it served
                self.routes.model_unloaded(f"failed to load: {line['error'].message}")
            return {self.host.name: line}

    def _serve_again(self, host: ModelHost) -> None:
        """After the load of a new version failed: serve ``host``, the version it replaced, again
        (loaded again, its batch shapes warmed), its files pinned in the node cache as before.
        Blocking. Logs and leaves the model unloaded when that load fails too."""
        self.host = host
        self.repo.take(self.repo.get(host.name))  # unpins the new version's files
        try:
            host.load()
            self._policy = self._loaded_policy()
        except Exception:
            logger.exception("model control: '%s' failed to load version %d again after a new version's load "
                             "failed", host.name, host.version)
            return
        self.gate.open()

    def _loaded_policy(self) -> BatchPolicy | None:
        """The batch policy for the loaded model's backend, its padded sizes warmed
        (``BatchPolicy.warm_shapes``, ``ModelHost.warm``). Blocking."""
        policy = BatchPolicy.of(self.host.config, self.host.backend, self.host.entry.onnx_path(self.host.version),
                                self.host.replayed_batches())
        shapes = policy.warm_shapes(self.host.config, self.host.backend) if policy is not None else []
        if shapes:
            self.host.warm(shapes)
        return policy

    def _take_new_version(self, state: dict[str, Any]) -> tuple[ModelEntry, ModelHost | None]:
        """Before a load: read the model's folder again for exactly what the router read
        (``control.read_as_desired``: the versions its desired ``state`` names, a version folder
        added since not among them) and serve the newest of them from now on, as the routers
        report it (docs/models.md, "Versions"). A loaded model changing version, or whose model
        file was written since its reading (``ModelEntry.files``), is unloaded first: new
        requests wait while it loads (``Gate.close(replacing=True)``), those in flight finish on
        the old version, and a request labelled with the old version is refused once the new
        one serves (``infer``: 503, "send the request again"). The config must be the one this
        replica started with (its batch queue was built from it; the router refuses a load of a
        changed one before it reaches a replica, and ``read_as_desired`` one changed since). The
        new version's file is checked before
        the old version is unloaded (``ModelEntry.check_files``: one engine at a time, as the
        replica's memory was sized for one). Returns the entry read and the loaded host it
        replaced (None: none), which ``apply`` serves again if the new one fails to load.

        Raises:
            ConfigError, InvalidInput, LoadFault, ModelNotFound: as ``control.read_as_desired``
                (a folder changed since the router read it); nothing changed here.
            InvalidInput: the config changed (``control.config_kept``); nothing changed here.
            LoadFault: the new version's model file does not read (``check_files``); nothing
                changed here.
        """
        entry = read_as_desired(self.repo, self.host.name, state)  # not served before it loads
        config_kept(entry, self.host.config, "this dedicated model's deployment")
        replaced = None
        if entry.latest != self.host.version or (  # a new version, or its file written since it was read
                entry.file_identity(entry.latest) != self.host.entry.file_identity(entry.latest)):
            if self.host.ready:
                entry.at(entry.latest).check_files()
                self.gate.close(replacing=True)  # new requests wait for the new version's load
                self.host.unload()
                replaced = self.host
            host = ModelHost(entry, self.host.backend_request, self.host.checkout_timeout_s)
            host.on_execution = self.host.on_execution
            self.host = host
        return entry, replaced

    def __serve_build_asgi_app__(self) -> Any:
        return self.routes.build_app()

    def batching(self) -> dict:
        """This replica's batch counters (``BatchStats.as_dict``); empty batches when off."""
        stats = self._batched.stats if self._batched is not None else BatchStats()
        return {"enabled": self._batched is not None, **stats.as_dict()}

    def backend(self) -> str:
        """The backend serving the model: ``onnxruntime``, ``onnxruntime_cuda`` or ``tensorrt``.

        The model loads in ``__init__``, so a replica that answers at all has it loaded: the
        router polls this to learn both that the model is ready and its platform.
        """
        return self.host.backend

    def memory(self) -> dict[str, Any]:
        """The loaded model's footprint in bytes (engine, per context, total for its instances).

        TensorRT reports context memory exactly; ONNX Runtime's is only known by measuring runs
        at the max profile, which a dedicated replica skips at start, so the graph prediction
        (``runtime.residency.predict.predict``) stands in and ``context_source`` says so.
        """
        footprint = self.host.footprint()
        context, source = footprint.context_bytes, "measured"
        if not context:
            context, source = predict(self.host.entry).context_bytes, "predicted"
        instances = self.host.config.instances
        out = {"backend": self.host.backend, "backend_reason": self.host.backend_reason,
               "device": footprint.device, "engine_bytes": footprint.engine_bytes,
               "context_bytes": context, "context_source": source, "instances": instances,
               "total_bytes": footprint.engine_bytes + instances * context, "cuda_graphs": self.host.cuda_graphs()}
        if footprint.device == "gpu":  # this replica's own GPU bytes (CUDA context included)
            reading = process_gpu_bytes()
            out.update(pid=os.getpid(), process_gpu_bytes=reading.bytes, gpu_source=reading.source)
        return out

    def check_health(self) -> None:
        """Ray's periodic probe: failing it makes Serve replace this replica.

        A model unloaded on purpose (model control: its gate is closed) is healthy.

        Raises:
            ModelNotReady: the model is not loaded and was not unloaded on purpose.
            EngineFault: its engine or device is unusable (a sticky CUDA error).
        """
        if self.gate.is_open or self.host.ready:
            self.host.check_health()
