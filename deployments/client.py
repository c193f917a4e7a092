"""ModelClient: call a model by name through its deployment handle (dedicated or pooled).

The router and the pipelines use it; it knows handles, not HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import DeploymentUnavailableError, RayServeException, RequestCancelledError

from .protocol.answer import Answer
from .protocol.errors import raise_if_error
from .runtime.contract.device import refuse_device_io
from .runtime.contract.errors import ConfigError, ModelNotReady, unknown_model

logger = logging.getLogger("ray.serve")

_REPLICA_LOST_RETRIES = 1  # sends again of a request whose model replica died holding it
_CONTROL_LOST_RETRIES = 3  # sends again of a call whose control replica died holding it

# Requests whose inputs hold at least this many bytes go to the replica by reference (Ray's
# object store: shared memory on one node) even where handles default to gRPC, which copies
# and was 5x slower for a 4.9 MB tensor (docs/placement.md, "Ray's fast paths").
BY_REFERENCE_MIN_BYTES = 1 << 20


def payload_bytes(inputs: dict[str, np.ndarray]) -> int:
    """Bytes the arrays carry (BYTES elements counted by their length)."""
    return sum(sum(len(x) for x in a.flat) if a.dtype == object else a.nbytes for a in inputs.values())


def deployment_name(model: str, pipeline: bool = False) -> str:
    """The deployment serving dedicated model (or pipeline) ``model`` in its application."""
    return f"{'pipeline' if pipeline else 'model'}-{model}"


def model_application(router_app: str, model: str) -> str:
    """The application of dedicated model ``model`` beside router application ``router_app``
    (``deployments.app.applications`` deploys it so; a router application's name has no '.').

    Raises:
        ConfigError: ``router_app`` holds a '.'.
    """
    if "." in router_app:
        raise ConfigError(f"application name '{router_app}': a router application's name must not contain "
                          "'.' (its models' applications are named '<router application>.<model>')")
    return f"{router_app}.{model}"


# The multiplexed pool's deployment, in its own application ``<router application>.pool`` (a
# model application's name: no dedicated model may be named so, ``deployments.app``).
POOL = "pool"


def deployment_application(router_app: str, deployment: str) -> str:
    """The application running ``deployment`` (``router``, ``pool``, ``model-<m>``,
    ``pipeline-<m>``...) of the server whose router application is ``router_app``."""
    if deployment == POOL:
        return model_application(router_app, POOL)
    kind, _, model = deployment.partition("-")
    return model_application(router_app, model) if kind in ("model", "pipeline") and model else router_app


def pool_handle(router_app: str) -> Any:
    """The handle of the multiplexed pool of the server whose router application is ``router_app``."""
    return handle(model_application(router_app, POOL), POOL)


def router_application(model: str) -> str:
    """In a replica of dedicated model ``model``'s application: the router application's name."""
    return serve.get_replica_context().app_name.removesuffix(f".{model}")


def handle(app: str, deployment: str) -> Any:
    """The handle of ``deployment`` in application ``app``; one that does not run yet is fine:
    a call waits for it."""
    return serve.get_deployment_handle(deployment, app_name=app, _check_exists=False)


def model_handles(router_app: str, deployments: dict[str, str]) -> dict[str, Any]:
    """Model name -> handle of its deployment (``deployments``: model -> deployment name), each
    in its own application beside router application ``router_app`` (``model_application``)."""
    return {name: handle(model_application(router_app, name), deployment) for name, deployment in deployments.items()}


@dataclass(frozen=True)
class ReplicaCounts:
    """What ``ModelClient.replica_counts`` reads from Serve's instance details (``replica_counts``).

    ``running``: model name -> RUNNING replicas (``running_ids``: their replica ids).
    ``stopped``: models whose application is being deleted (Ctrl-C of ``make serve``, ``serve delete``, ``serve shutdown``): Serve then lists
    none of its deployments and every replica is draining or gone, so a call that no replica
    has taken yet never runs. ``deleting``: the application is being deleted. ``missing``: dedicated
    models whose own application (``model_application``) Serve does not list while none of the
    server's applications is being deleted: the Serve config lacks it.
    """

    running: dict[str, int]
    stopped: frozenset[str] = frozenset()
    deleting: bool = False
    missing: frozenset[str] = frozenset()  # models whose application Serve does not list, none deleting
    running_ids: dict[str, frozenset[str]] = field(default_factory=dict, compare=False)  # model -> their ids


class ModelClient:
    """Calls a model by name through its deployment handle: dedicated or pooled.

    Used by the router and by pipelines; the arrays travel to the replica as Ray objects
    (no re-encoding between deployments): over gRPC where the cluster makes that the handle
    default (``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``, see the Makefile's ``serve``), by reference
    for inputs of ``BY_REFERENCE_MIN_BYTES`` and more.
    """

    def __init__(self, dedicated: dict[str, Any], pool: Any | None, pool_models: Iterable[str],
                 control: Any | None = None, placement: Any | None = None) -> None:
        self.dedicated = dedicated
        self.pool = pool
        self.pool_models = set(pool_models)  # grows when a model added to the repository is loaded
        self.control = control  # ``deployments.control.ControlDeployment`` (explicit model control)
        self.placement = placement  # ``deployments.placement.PlacementDeployment`` (``placement: bytes``)
        self._waiting: dict[str, set[Any]] = {}  # model name -> its handle responses in flight
        self._cut: set[Any] = set()  # responses cut_unassigned cancelled
        self._last_done: dict[str, float] = {}  # model name -> time.monotonic() its last call finished

    def handle(self, name: str, key: str | None = None) -> Any:
        """The deployment handle serving ``name`` (for the pool: the version whose cache key,
        ``ModelEntry.key``, is ``key``; default the newest served).

        Raises:
            ModelNotFound: no deployment serves this model.
        """
        if name in self.dedicated:
            return self.dedicated[name]
        if name in self.pool_models and self.pool is not None:
            return self.pool.options(multiplexed_model_id=key or name)
        raise unknown_model(name, "no deployment serves it")

    async def infer(self, name: str, inputs: dict[str, np.ndarray], outputs: list[str] | None = None,
                    key: str | None = None, version: int | None = None) -> dict[str, np.ndarray]:
        """Run ``inputs`` on model ``name`` (pool: its version keyed ``key``, as ``handle``);
        returns its outputs by name. ``version``: the version the caller labels the answer with;
        the replica refuses (``ModelNotReady``) to run it on another (a load took a new one).

        A replica that dies holding the request surfaces as ``ray.exceptions.RayActorError``
        (``ActorDiedError``); Serve has dropped it from routing by then, so the request is sent
        once more, to a live or replacement replica (inference has no side effects). A caller
        that stops waiting (cancelled: the request timed out, its client left, or a sibling step
        call failed) cancels the call too, so that it never runs or stops where it runs; awaiting
        a handle response alone leaves it to run.

        Raises:
            ModelNotFound: no deployment serves ``name``.
            ModelNotReady: the replica died again on the second try, or the model's deployment
                is being deleted or failed to deploy (Serve's ``DeploymentUnavailableError``,
                or ``cut_unassigned``).
            ServingError: whatever the model replica raised (``InvalidInput``, ``OverBudget``...).
        """
        refuse_device_io(inputs, outputs, f"this request reached a process that calls model '{name}' in another "
                                          "(the router), so it does not run here; the model's own replicas answer "
                                          "its route on the one-hop path (HAProxy ingress, make serve)")
        extra = () if version is None else (version,)
        return await self._call(name, key, payload_bytes(inputs), "infer", inputs, outputs, *extra)

    async def infer_body(self, name: str, key: str | None, version: str, batched: bool, chunks: list[bytes],
                         header_length: str | None, default_timeout_s: float) -> Answer:
        """Pass an infer request's body (``chunks``, as it arrived) to a pool replica of model
        ``name``'s version keyed ``key``, which decodes, runs and encodes it
        (``PoolDeployment.infer_body``); returns its ``Answer``. Retries and raises as ``infer``
        (``InvalidInput`` for a malformed body too)."""
        return await self._call(name, key, sum(map(len, chunks)), "infer_body", name, version, batched, chunks,
                                header_length, default_timeout_s)

    async def _call(self, name: str, key: str | None, nbytes: int, method: str, *args: Any) -> Any:
        """``method(*args)`` on a replica serving ``name`` (``infer``'s retry and errors)."""
        handle = self.handle(name, key)
        if nbytes >= BY_REFERENCE_MIN_BYTES:
            handle = handle.options(_by_reference=True)
        waiting = self._waiting.setdefault(name, set())
        for attempt in range(_REPLICA_LOST_RETRIES + 1):
            response = getattr(handle, method).remote(*args)
            waiting.add(response)
            try:
                result = await response
                self._last_done[name] = time.monotonic()
                return raise_if_error(result)  # replica methods return their errors (errors_as_values)
            except asyncio.CancelledError:  # the caller stopped waiting: a timeout, its client left, a sibling failed
                response.cancel()  # Serve drops it from the queue, or cancels it at the replica that runs it
                raise
            except RequestCancelledError:
                if response not in self._cut:
                    raise
                raise ModelNotReady(f"model '{name}' stopped before a replica took the request: the "
                                    "server is shutting down") from None
            except DeploymentUnavailableError:  # Serve refuses calls to a deployment being deleted
                raise ModelNotReady(f"model '{name}' is unavailable: its deployment is stopping "
                                    "(the server is shutting down) or failed to deploy") from None
            except RayActorError:
                if attempt == _REPLICA_LOST_RETRIES:
                    break
                logger.warning("model '%s': replica died during a request; sending it again", name)
            finally:
                waiting.discard(response)
                self._cut.discard(response)
        raise ModelNotReady(f"model '{name}': its replica stopped while serving the request; retry shortly")

    def cut_unassigned(self, names: Iterable[str], idle_s: float) -> None:
        """Cancel the calls to models in ``names`` that no replica has taken yet, where no call
        to that model has finished for ``idle_s`` seconds: they answer ``ModelNotReady`` (503)
        at once. For a model whose application is being deleted (``ReplicaCounts.stopped``):
        Serve keeps such a call queued for a replica that will never come, until the caller's
        replica is killed (Ctrl-C of ``make serve`` waited out the router's whole grace
        period). Calls a replica took are left to finish, and so are queued calls while the
        model still finishes calls: a draining replica keeps taking queued calls (cutting them
        at once answered 503 to requests sent before Ctrl-C, docs/lab-notes.md, "Stopping").
        Whether a replica took a call is the handle response's assignment future
        (``DeploymentResponse._replica_result_future``, Ray 2.60, pinned)."""
        now = time.monotonic()
        for name in names:
            if now - self._last_done.get(name, 0.0) < idle_s:
                continue
            for response in self._waiting.get(name, ()):
                assigned = getattr(response, "_replica_result_future", None)
                if assigned is not None and not assigned.done():
                    self._cut.add(response)
                    response.cancel()

    async def backend(self, name: str) -> str:
        """The backend of dedicated model ``name`` (``onnxruntime``, ``tensorrt``, ``pipeline``);
        answers only once a replica has loaded the model.

        Raises:
            KeyError: ``name`` has no dedicated deployment.
        """
        return await self.dedicated[name].backend.remote()

    async def memory(self, name: str) -> dict[str, Any]:
        """``ModelDeployment.memory`` of one replica of dedicated model ``name``.

        Raises:
            KeyError: ``name`` has no dedicated deployment.
        """
        return await self.dedicated[name].memory.remote()

    async def replica_counts(self) -> "ReplicaCounts":
        """Per model, the RUNNING replicas of the deployment serving it (pool models: the
        pool's), and whether its application is being deleted (``ReplicaCounts``); from
        Serve's instance details (``_replica_counts``: a call to Serve's controller, made in a
        worker thread).

        Raises:
            Exception: the controller did not answer (Ray's own exceptions).
        """
        handles = dict(self.dedicated)
        if self.pool is not None:
            handles.update((name, self.pool) for name in self.pool_models)
        return await asyncio.to_thread(_replica_counts, handles)

    async def control_desired(self) -> dict[str, Any]:
        """``ControlDeployment.desired``: ``{"incarnation", "revision", "models"}``."""
        return await self._control("desired")

    async def control_set(self, name: str, loaded: bool, placement: str, read: dict[str, Any] | None = None,
                          kept: dict[str, Any] | None = None, reason: str | None = None) -> dict[str, Any]:
        """``ControlDeployment.set``: model ``name`` should (not) serve (a load: what ``read``
        names, ``control.reading``; ``kept``: the reading it serves now, served again if the
        load fails; not loaded: ``reason``, why a load the router refused failed); returns the
        state's ``{"incarnation", "revision"}``."""
        return await self._control("set", name, loaded, placement, read, kept, reason)

    async def control_applied(self, name: str, placement: str,
                              state: dict[str, Any]) -> tuple[list[dict[str, Any]], frozenset[str]]:
        """The reports of the replicas serving ``name`` (the pool's for ``placement`` ``pool``)
        that applied ``state`` (``ControlDeployment.applied``), and the ids of the replicas
        Serve counts RUNNING in that deployment (``control.applied_everywhere`` compares them)."""
        handle = self.pool if placement == "pool" else self.dedicated[name]
        reports = await self._control("applied", handle.deployment_name, state)
        running = await asyncio.to_thread(_replica_counts, {name: handle})
        return reports, running.running_ids[name]

    async def _control(self, method: str, *args: Any) -> Any:
        """``method(*args)`` on the control deployment, sent again while its replica dies under
        the call (Serve starts another, which takes the stored state: ``deployments.control``).
        ``set`` sent again is harmless: the same entry under a later revision."""
        for attempt in range(_CONTROL_LOST_RETRIES + 1):
            try:
                return await getattr(self.control, method).remote(*args)
            except RayActorError:
                if attempt == _CONTROL_LOST_RETRIES:
                    raise ModelNotReady("the model control replica stopped during the call and its "
                                        "replacement did not answer; retry shortly") from None
                logger.warning("model control: the control replica died during '%s'; sending it again", method)

    async def pool_memory(self) -> dict[str, Any]:
        """``PoolDeployment.memory`` of one pool replica (the pool must exist)."""
        return await self.pool.memory.remote()

    async def placement_decision(self) -> dict[str, Any]:
        """The pool's placement decision (``deployments.placement.Decider.state``; the placement
        deployment must exist)."""
        return await self.placement.decision.remote()

    async def pool_states(self) -> dict[str, dict[str, Any]]:
        """``PoolDeployment.models`` of one pool replica: per pool model its cache ``state``,
        ``evictions`` and ``backend`` (the pool must exist)."""
        return await self.pool.models.remote()


def _replica_counts(handles: dict[str, Any]) -> ReplicaCounts:
    """``ReplicaCounts`` of the deployments behind ``handles`` (name -> handle), from Serve's
    instance details (a blocking call to Serve's controller). The details as the controller
    sends them (``ServeControllerClient.get_serve_details``, Ray 2.60, pinned), not
    ``serve.status()``, which builds them into pydantic models first: 11 ms against 2 ms for one
    application on 2 cores, and with the router's applications, every second, 5% of a core
    of the router replica's (docs/lab-notes.md, "The pool path through the router")."""
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    details = client.get_serve_details() if client is not None else {}
    try:  # this replica's own application: being deleted (or gone) means the server stops
        own: str | None = serve.get_replica_context().app_name
    except RayServeException:  # not in a replica: the handles say it
        own = None
    return replica_counts(details, {name: (h.app_name, h.deployment_name) for name, h in handles.items()}, own)


def replica_counts(details: dict[str, Any], deployments: dict[str, tuple[str, str]],
                   own_app: str | None = None) -> ReplicaCounts:
    """``ReplicaCounts`` of ``deployments`` (name -> (application, deployment)) in Serve's
    instance ``details`` (``{"applications": {app: {"status", "deployments": {name:
    {"replicas": [{"state", "replica_id"}, ...]}}}}}``, states as Serve's str enums or their values);
    ``own_app``: the calling replica's application (None outside a replica)."""
    applications = details.get("applications") or {}
    running, ids, gone = {}, {}, set()
    deleting = False
    for name, (app_name, deployment_name) in deployments.items():
        app = applications.get(app_name)
        deployment = (app.get("deployments") or {}).get(deployment_name) if app is not None else None
        replicas = (deployment.get("replicas") or []) if deployment is not None else []
        up = [r for r in replicas if _state(r.get("state")) == "RUNNING"]
        running[name], ids[name] = len(up), frozenset(r.get("replica_id") for r in up)
        if app is None:
            gone.add(name)
        elif _state(app.get("status")) == "DELETING":
            deleting = True
            gone.add(name)
    if own_app is not None:
        own = applications.get(own_app)
        deleting = deleting or own is None or _state(own.get("status")) == "DELETING"
    if deleting:
        return ReplicaCounts(running, frozenset(gone), True, running_ids=ids)
    return ReplicaCounts(running, missing=frozenset(gone), running_ids=ids)


def _state(value: Any) -> Any:
    """A Serve status (a str enum in the controller's details) as its plain value."""
    return getattr(value, "value", value)
