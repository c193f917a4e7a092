"""Model control (``model_control_mode: explicit``): which models should serve, and what each
replica did about it.

How a load or unload reaches every replica (Ray Serve handles route a call to one replica, so
there is no broadcast): one small deployment, ``control`` (one replica, no CPU reserved), holds
the desired state, a ``revision`` number and per model ``{"loaded", "placement", "generation"}``
(``placement``: ``pool``, ``dedicated`` or ``pipeline``; ``generation``: the revision of its last
load). The router changes it (``POST /v2/repository/models/{m}/load|unload``); every pool and
dedicated replica follows it (``Follower``): every ``POLL_S`` it reads the state, applies what
changed since the state it last applied (a load, an unload: waiting for its requests in
flight, as an eviction does) and reports the revision it applied with its models' outcome. The
router answers once every RUNNING replica of the model's deployment has reported that revision
(``ControlDeployment.applied``). A replica that starts later (autoscaling, a replacement)
starts from the state the application was built with and catches up at its first poll.

Limits: the state lives in the control replica's memory; if that replica dies, Serve starts a
new one from the build-time state (``startup_models``), and the replicas follow it there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from ray import serve

from .loopback import replica_grpc_on_loopback
from .runtime.contract.errors import ConfigError, InferenceError, InvalidInput, ServingError

logger = logging.getLogger("ray.serve")

POLL_S = 0.25  # how often a replica reads the desired state
# How long a starting replica waits to read the desired state before Serve may route to it (its
# constructor awaits ``Follower.first_sync``, then applying it, however long its loads take);
# past it (the control replica unreachable) the replica serves, answering 503 for its models
# until it has synced.
FIRST_SYNC_S = 15.0
REPORT_FRESH_S = 5.0  # reports older than this are a replica's that stopped: not counted

Desired = dict[str, dict[str, Any]]  # model -> {"loaded": bool, "placement": str, "generation": int}


@serve.deployment
class ControlDeployment:
    """The desired state of the models and the replicas' reports of what they applied.

    Args:
        models: the build-time state: per model ``{"loaded", "placement", "generation": 0}``.
    """

    def __init__(self, models: Desired) -> None:
        replica_grpc_on_loopback()
        self.revision = 0
        self.models: Desired = dict(models)
        self.reports: dict[str, dict[str, Any]] = {}  # replica id -> its last report

    def desired(self) -> dict[str, Any]:
        """``{"revision": int, "models": Desired}``."""
        return {"revision": self.revision, "models": self.models}

    def set(self, name: str, loaded: bool, placement: str) -> int:
        """Model ``name`` should (not) serve from ``placement``; returns the new revision."""
        self.revision += 1
        generation = self.revision if loaded else self.models.get(name, {}).get("generation", 0)
        self.models = {**self.models, name: {"loaded": loaded, "placement": placement, "generation": generation}}
        return self.revision

    def report(self, replica: str, deployment: str, revision: int, models: dict[str, dict[str, Any]]) -> None:
        """A replica applied ``revision``; ``models``: per model of its own, ``{"loaded": bool,
        "backend": str, "error": ServingError | None}``."""
        self.reports[replica] = {"replica": replica, "deployment": deployment, "revision": revision,
                                 "models": models, "time": time.monotonic()}

    def applied(self, deployment: str, revision: int) -> list[dict[str, Any]]:
        """The fresh reports of ``deployment``'s replicas that applied ``revision`` or later."""
        now = time.monotonic()
        return [r for r in self.reports.values() if r["deployment"] == deployment
                and r["revision"] >= revision and now - r["time"] < REPORT_FRESH_S]


def initial_state(placements: dict[str, str], loaded: set[str]) -> Desired:
    """The build-time desired state: every model's placement, ``loaded`` for those in ``loaded``."""
    return {name: {"loaded": name in loaded, "placement": placement, "generation": 0}
            for name, placement in placements.items()}


def outcome(error: BaseException | None, loaded: bool, backend: str = "") -> dict[str, Any]:
    """One model's line of a report. ``error`` travels as a ``ServingError`` (Ray pickles those
    whole): a config error becomes ``InvalidInput`` (the request's repository is at fault, 400),
    anything else not typed an ``InferenceError`` (its text stays in this replica's log)."""
    if isinstance(error, ConfigError):
        error = InvalidInput(error.message)
    elif error is not None and not isinstance(error, ServingError):
        logger.error("model control: a load failed", exc_info=error)
        error = InferenceError("the model failed to load; the replica's log has the details")
    return {"loaded": loaded and error is None, "backend": backend, "error": error}


class Follower:
    """A replica's side of model control: ``run`` polls the control deployment forever.

    Args:
        control: handle of ``ControlDeployment``.
        initial: the build-time desired state (what this replica loaded at start).
        apply: ``apply(changed)`` gets the models whose desired entry changed (name -> entry),
            loads and unloads them (blocking: it runs in a worker thread) and returns their
            ``outcome`` lines.
    """

    def __init__(self, control: Any, initial: Desired,
                 apply: Callable[[Desired], dict[str, dict[str, Any]]]) -> None:
        context = serve.get_replica_context()
        self.replica, self.deployment = context.replica_id.unique_id, context.deployment
        self.control = control
        self.applied: Desired = dict(initial)
        self.revision = -1
        self.outcomes: dict[str, dict[str, Any]] = {}
        self.apply = apply
        self.task: asyncio.Task | None = None  # ``run``, started by ``follow``
        self._read = asyncio.Event()  # set once the desired state has been read
        self._first = asyncio.Event()  # set once the desired state has been applied

    @property
    def synced(self) -> bool:
        """Whether this replica has applied the desired state once (until then it serves the
        build-time state, which a load or unload made since may have changed)."""
        return self.revision >= 0

    async def sync(self) -> None:
        """One round: read the state, apply what changed, report."""
        desired = await self.control.desired.remote()
        self._read.set()
        if desired["revision"] != self.revision:
            changed = {name: entry for name, entry in desired["models"].items() if self.applied.get(name) != entry}
            if changed:
                self.outcomes.update(await asyncio.to_thread(self.apply, changed))
            self.applied, self.revision = dict(desired["models"]), desired["revision"]
        self._first.set()
        await self.control.report.remote(self.replica, self.deployment, self.revision, self.outcomes)

    async def first_sync(self, timeout_s: float = FIRST_SYNC_S) -> None:
        """Wait until this replica has applied the desired state once: at most ``timeout_s``
        seconds for the control replica to answer, then as long as applying it takes. A
        replica's constructor awaits it: Serve routes no request to a replica before its
        constructor returns, so one that starts after a load or unload (autoscaling, a
        replacement) serves the current state from its first request, instead of answering 503
        "reading the model control state" while it loads the models loaded since the build.
        The bound is for an unreachable control replica only: a load slower than it (a long
        ``warmup``) made a replacement pool replica answer every pool model 503 "reading the
        model control state" until that load ended (it was bounded by the whole apply)."""
        try:
            await asyncio.wait_for(self._read.wait(), timeout_s)
        except asyncio.TimeoutError:
            logger.warning("model control: the desired state could not be read within %.0f s; serving, "
                           "and answering 503 for this replica's models until it is applied", timeout_s)
            return
        await self._first.wait()

    async def run(self) -> None:
        while True:
            try:
                await self.sync()
            except Exception:  # the control replica is restarting: try again
                logger.warning("model control: the desired state is unavailable", exc_info=True)
            await asyncio.sleep(POLL_S)


def loaded_at_start(initial: Desired | None, name: str) -> bool:
    """Whether model ``name`` serves from the start (``initial`` None: model control is off)."""
    return (initial or {}).get(name, {"loaded": True})["loaded"]


def follow(control: Any, initial: Desired, apply: Callable[[Desired], dict[str, dict[str, Any]]]) -> Follower | None:
    """In a replica's constructor: start following ``control`` (None: model control is off);
    returns the ``Follower`` (its task in ``task``)."""
    if control is None:
        return None
    follower = Follower(control, initial, apply)
    follower.task = asyncio.get_running_loop().create_task(follower.run())
    return follower


async def first_sync(follower: Follower | None) -> None:
    """At the end of a replica's constructor: ``follower.first_sync()`` (None, model control
    off: nothing to wait for)."""
    if follower is not None:
        await follower.first_sync()
