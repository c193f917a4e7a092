"""The deployment of a composed model (``pipeline:`` in its config): its steps are other models.

Like a dedicated model's, it is the ingress of its own application: its replicas answer the
pipeline's KServe v2 routes (``replica_routes.ModelRoutes``) and call the steps through handles (each
step's application, or the router application's pool).
"""

from __future__ import annotations

import time
from typing import Any, Iterable

import numpy as np
from ray import serve

from .client import ModelClient, model_handles, pool_handle, router_application
from .control import Desired, first_sync, loaded_at_start
from .admission import Admission
from .replica_routes import own_routes
from .routes import RouterOptions
from .node import node_id
from .grpc_service import ServeGrpcMethods
from .loopback import replica_grpc_on_loopback
from .logs import show_on_terminal
from .observe.deployment import observed_steps, replica_recorder
from .pipelines import create_pipeline
from .protocol.errors import errors_as_values
from .runtime.contract.device import refuse_device_io
from .runtime.contract.errors import ModelNotReady
from .runtime.contract.outputs import Outputs, parameters_of
from .runtime.contract.repository import ModelEntry, ModelRepository
from .runtime.contract.validation import validate_request


@serve.deployment
@serve.ingress()
class PipelineDeployment(ServeGrpcMethods):
    """A composed model (like a Triton ensemble) whose steps call other model deployments.

    It validates the pipeline model's own request (the steps' replicas validate theirs).

    Args:
        repository: model repository root.
        name: the pipeline model.
        dedicated: model name -> deployment name of each dedicated model (its steps among them).
        pool_models: models the router application's pool serves.
        models: the models served, as read at build (``ModelRepository``'s ``entries``; None:
            every folder of the repository, read now).
        routes, metrics, initial, max_ongoing_requests, max_queued_requests: as
            ``ModelDeployment``'s.
    """

    async def __init__(self, repository: str, name: str, dedicated: dict[str, str], pool_models: Iterable[str],
                       routes: RouterOptions, metrics: dict[str, Any] | None = None, initial: Desired | None = None,
                       max_ongoing_requests: int = 512, max_queued_requests: int | None = None,
                       models: list[ModelEntry] | None = None) -> None:
        show_on_terminal()
        replica_grpc_on_loopback()
        repo = ModelRepository(repository, entries=models, node=node_id())
        entry = repo.get(name)
        self.config = entry.config
        self.version = entry.latest
        self.recorder = replica_recorder(metrics)  # the pipeline's own executions, as Triton counts an ensemble's
        router_app = router_application(name)
        pool = pool_handle(router_app) if pool_models else None
        client = ModelClient(model_handles(router_app, dedicated), pool, pool_models)
        steps = observed_steps(client.infer, metrics, {e.name: str(e.latest) for e in repo.entries()})
        self.pipeline = create_pipeline(repo, name, steps)
        self.admission = Admission(max_ongoing_requests, max_queued_requests, routes.request_timeout_s)
        self.routes = own_routes(entry, ModelRepository(repository, [name], entries=[entry], node=node_id()),
                                 self.infer, routes, metrics, initial,
                                 "pipeline" if loaded_at_start(initial, name) else None, self.apply)
        self.routes.admission = self.admission
        self.routes.steps[name] = self.pipeline.steps  # its parameters' defaults included
        await first_sync(self.routes.follower)  # routed only once it serves the current state

    def __serve_build_asgi_app__(self) -> Any:
        return self.routes.build_app()

    def apply(self, changed: Desired) -> dict[str, dict[str, Any]]:
        """Model control: the pipeline answers its routes (loaded) or 503 (unloaded); its
        steps are loaded and unloaded as models of their own, and while one is not loaded the
        pipeline answers 503 naming it."""
        state = changed.get(self.routes.name)
        if state is not None and state["loaded"]:
            self.routes.model_loaded("pipeline")
        elif state is not None:
            self.routes.model_unloaded(state.get("reason"))
        for step in set(self.pipeline.steps) & set(changed):
            self.routes.step_changed(step, changed[step]["loaded"])
        return {}

    @errors_as_values
    async def infer(self, inputs: dict[str, np.ndarray], outputs: list[str] | None = None,
                    version: int | None = None) -> dict[str, np.ndarray]:
        """Run one request through the pipeline; returns the requested outputs by name.
        ``version``: the one the caller labels the answer with (a pipeline has one version, 1).

        Returns, not raises (``errors_as_values``):
            InvalidInput: the inputs or requested outputs do not fit the pipeline model's config.
            SharedMemoryError: an input or output in CUDA shared memory (400).
            Overloaded: the pipeline's queue is full (``admission.Admission``).
        """
        with self.admission.request():
            if version is not None and version != self.version:
                raise ModelNotReady(f"model '{self.config.name}' version {version} is not served by this replica "
                                    f"(it serves version {self.version})")
            refuse_device_io(inputs, outputs, f"model '{self.config.name}' is a pipeline, whose steps run in other "
                                              "replicas and take their tensors from the host")
            wanted = validate_request(self.config, inputs, outputs)
            start = time.perf_counter()
            result = await self.pipeline.infer(inputs)
            if self.recorder is not None:  # one execution per request, of its rows (Triton's ensembles)
                rows = next(iter(inputs.values())).shape[0] if self.config.max_batch_size else 1
                self.recorder.on_execution(self.config.name, self.version, rows, time.perf_counter() - start)
            return result if outputs is None else Outputs({n: result[n] for n in wanted}, parameters_of(result))

    def backend(self) -> str:
        """``pipeline`` (see ``ModelDeployment.backend``)."""
        return "pipeline"
