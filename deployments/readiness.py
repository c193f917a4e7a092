"""Readiness watching: which models' replicas run and answer, as Serve counts them (router only)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Iterable

from starlette.requests import Request
from starlette.responses import Response

from .client import POOL
from .logs import Outage
from .routes import V2Routes, answers_errors, error_response
from .runtime.contract.errors import ModelNotReady, ServingError
from .runtime.contract.repository import ModelEntry
from .states import Status

logger = logging.getLogger("ray.serve")

_READY_POLL_S = 1.0
_UNSEEN_POLL_S = 0.1  # how often an infer request asks again for a replica Serve counts but this router has not seen
_STOPPING_POLL_S = 0.1  # while the application is being deleted: how soon waiting requests get their 503
_STOPPED_IDLE_S = 1.0  # ... once their model has finished no call for this long (ModelClient.cut_unassigned)


class ReadinessWatch(V2Routes):
    """The router's readiness: a dedicated model is READY once a replica answered (``poll_ready``,
    ``_probe``), follows Serve's replica counts after (``watch_replicas``, ``refresh_ready``),
    answers 503 while its application is not deployed (``note_missing``); each pass also hands
    model control's desired state to ``follow_desired`` (``repository_routes``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._seen_running: set[str] = set()  # models Serve has counted with a RUNNING replica
        self.missing: set[str] = set()  # models whose application is not deployed (note_missing)
        self._running: dict[str, int] = {}  # model -> RUNNING replicas in the latest count
        self._probes: dict[str, asyncio.Future[bool]] = {}  # model -> the backend call in flight

    async def follow_desired(self, desired: dict[str, Any]) -> None:
        """Take model control's desired state (``ControlDeployment.desired``): the router's
        model control does (``repository_routes``); here nothing."""

    async def poll_ready(self) -> None:
        """Mark each dedicated model ready once a replica answers; returns when all have."""
        pending = {name for name in self.client.dedicated if self.states.is_loaded(name)}  # explicit control
        while pending:
            pending = {name for name in pending if self.states.is_loaded(name)}
            for name in sorted(pending):
                if await self._probe(name):
                    pending.discard(name)
            if pending:
                await asyncio.sleep(_READY_POLL_S)

    async def _probe(self, name: str) -> bool:
        """Ask dedicated model ``name``'s replicas for their backend (waiting at most
        ``_READY_POLL_S``); on an answer, mark it ready. Concurrent callers share one call.

        Returns:
            Whether a replica answered.
        """
        task = self._probes.get(name)
        if task is None or task.done():
            task = self._probes[name] = asyncio.ensure_future(self._ask_backend(name))
        return await asyncio.shield(task)

    async def _ask_backend(self, name: str) -> bool:
        try:
            self.backends[name] = await asyncio.wait_for(self.client.backend(name), _READY_POLL_S)
        except Exception:  # no replica yet, or still loading
            return False
        self.states.answered(name)
        return True

    async def watch_replicas(self) -> None:
        """Every ``_READY_POLL_S`` (``_STOPPING_POLL_S`` while the application is being
        deleted), ``refresh_ready`` from the client's replica counts, and the client's
        ``cut_unassigned`` for models whose deployment is being deleted (runs forever)."""
        outage = Outage(logger, "readiness: Serve's replica counts or the model control state are unavailable")
        while True:
            deleting = False
            try:
                answered = set(self.backends)  # models a replica answered before this snapshot is asked for
                counts = await self.client.replica_counts()
                self.refresh_ready(counts.running, answered, counts.stopped)
                self.note_missing(counts.missing)
                self.client.cut_unassigned(counts.stopped, _STOPPED_IDLE_S)
                deleting = counts.deleting
                if self.initial is not None:
                    await self.follow_desired(await self.client.control_desired())
            except Exception as e:  # the controller did not answer: keep what we know
                if isinstance(e, RuntimeError) and "after shutdown" in str(e):
                    return  # the loop's executor is shut down: this replica is stopping
                outage.failed(quiet=deleting)  # the control deployment may stop before this replica
            else:
                outage.answered()
            await asyncio.sleep(_STOPPING_POLL_S if deleting else _READY_POLL_S)

    def note_missing(self, missing: Iterable[str]) -> None:
        """Models whose application Serve does not list (``ReplicaCounts.missing``: a dedicated
        model's own, or the pool's for pool models): their requests reach the router (no route
        prefix of theirs exists) and answer 503 naming the application the Serve config lacks;
        logged once each."""
        missing = set(missing) & (set(self.client.dedicated) | self.client.pool_models)
        for name in sorted(missing - self.missing):
            logger.error("model '%s': %s", name, self._missing_text(name))
        self.missing = missing

    def _missing_text(self, name: str) -> str:
        pooled = name in self.client.pool_models
        handle = self.client.pool if pooled else self.client.dedicated.get(name)
        app = getattr(handle, "app_name", f"<router application>.{POOL if pooled else name}")
        return (f"its application '{app}' is not deployed: the Serve config must list it "
                "(python -m deployments.check --write serve_config.yaml writes it)")

    def refresh_ready(self, running: dict[str, int], answered: Iterable[str] = (),
                      stopped: Iterable[str] = ()) -> None:
        """Readiness after first load follows the replicas: a model (dedicated once it answered
        ``poll_ready``, or pooled) that Serve has counted with a RUNNING replica is ready while
        it has one, so ready routes and requests answer 503 when it lost them all and 200 again
        once a replacement runs. A count of 0 for a model never seen running (a deployment
        still starting, or a snapshot older than its first replica) changes nothing, unless a
        replica of it answered before the snapshot was asked for (``answered``): Serve routes
        only to replicas it counts RUNNING, so that replica ran, and has gone (it can die before
        any snapshot counted it: then the model stayed ready with no replica).

        Args:
            running: model name -> RUNNING replicas (``ModelClient.replica_counts``).
            answered: models a replica answered (``backends``) before ``running`` was asked for.
            stopped: models whose application is being deleted (``ReplicaCounts.stopped``): their
                loss is the plan (Ctrl-C), logged at INFO, not as a warning on the terminal.
        """
        answered, stopped = set(answered), set(stopped)
        self._running = dict(running)
        for name, count in running.items():
            if count:
                self._seen_running.add(name)
                if name in self.client.dedicated and name not in self.backends:
                    continue  # never answered yet: poll_ready decides
                self.states.answered(name)
            elif (name in self._seen_running or name in answered) and self.states.lost(name):
                logger.log(logging.INFO if name in stopped else logging.WARNING,
                           "model '%s' has no running replica: not ready (503) until one runs", name)

    def _unseen(self, name: str) -> bool:
        """Whether ``name`` is a loaded dedicated model (or pipeline) this router has never seen
        answer: Serve can report the application RUNNING, and send requests here, before
        ``poll_ready``'s next pass has seen its replica, so callers ask it first (``_probe``)."""
        return (name in self.client.dedicated and self.states.status(name) is Status.LOADING
                and name not in self.backends)

    async def _ready_error(self, entry: ModelEntry) -> ServingError | None:
        """``_not_ready``, after asking the replicas of a model this router has never seen
        answer (``_unseen``; at most ``_READY_POLL_S``)."""
        if self._unseen(entry.name):
            await self._probe(entry.name)
        return self._not_ready(entry)

    async def _await_ready(self, entry: ModelEntry) -> None:
        """``_ready_error`` for an infer request; while Serve's latest count has a RUNNING replica
        of a model this router has never seen answer (``_unseen``), it is asked again until it
        answers (within ``request_timeout_s``): this router's handle learns of a new replica a
        moment after Serve counts it, later than one probe on a busy machine.

        Raises:
            ModelNotReady, ModelNotFound: as ``_not_ready``.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.request_timeout_s
        while (error := await self._ready_error(entry)) is not None:
            if not (self._unseen(entry.name) and self._running.get(entry.name)) or loop.time() >= deadline:
                raise error
            await asyncio.sleep(_UNSEEN_POLL_S)

    def _not_served(self, entry: ModelEntry) -> ServingError | None:
        if entry.name in self.missing:
            return ModelNotReady(f"model '{entry.name}' is not served: {self._missing_text(entry.name)}")
        return None

    @answers_errors
    async def server_ready(self, request: Request) -> Response:
        unseen = [name for name in self.repo.names() if self._unseen(name)]
        if unseen:
            await asyncio.gather(*map(self._probe, unseen))
        if self.missing:
            return error_response(ModelNotReady(f"server not ready: models {sorted(self.missing)} are not served: "
                                                "their applications are not deployed; the Serve config must list "
                                                "them (python -m deployments.check --write serve_config.yaml writes "
                                                "them)"), log=False)
        return await super().server_ready(request)
