"""Model control (``model_control_mode: explicit``): which models should serve, and what each
replica did about it.

How a load or unload reaches every replica (Ray Serve handles route a call to one replica, so
there is no broadcast): one small deployment, ``control`` (one replica, no CPU reserved), holds
the desired state: an ``incarnation`` (a random id), a ``revision`` number and per model
``{"loaded", "placement", "generation"}`` (``placement``: ``pool``, ``dedicated`` or
``pipeline``; ``generation``: the revision of its last load; ``versions`` and ``digest``, set by
a load: what the router that made it read in the model's folder, its served versions and a
hash of its completed config, ``reading``; ``reason``, after a load that failed: why). The
router changes it (``POST /v2/repository/models/{m}/load|unload``); every
pool and dedicated replica follows it (``Follower``): every ``POLL_S`` it reads the state,
applies what changed since the state it last applied (a load, an unload: waiting for its
requests in flight, as an eviction does) and reports the state it applied with its models'
outcome. The router answers once every replica Serve counts RUNNING in the model's deployment
has reported that state, by replica id (``applied_everywhere``). A replica that starts later
(autoscaling, a replacement) reads the current state in its constructor (``first_sync``).

What a load serves is what its router read: every replica reads the folder again for exactly
the versions the state names and checks the config's hash (``read_as_desired``), so a version
folder added since is not served, and one gone or a config changed since fails the load; every
other router re-reads it the same way before it describes or labels that generation
(``repository_routes.RepositoryRoutes.follow_desired``). A generation of 0 is the build's
reading, which every replica and router started from.

A load that fails on a replica (at once or after the router's request timed out) is rolled
back by the control deployment itself when that replica reports it (``ControlDeployment.report``):
a model that served when the load was asked for serves the reading it served before again (its
versions and config: the router passes it as ``kept``), a new version's failure changing nothing;
any other becomes not loaded. The failure is its ``reason``, which the routers' index and a not
loaded model's requests give; a later load is a new generation, which every replica tries again.

Restarts: the state is kept in Ray's GCS key-value store (``GcsStore``), written before a change
is answered, under the router application's name and the id of the build that deployed it. A
control replica that Serve starts again (after a crash, on any node) takes the state from there,
incarnation and revision included: run-time loads and unloads survive it, and the replicas,
which already applied that state, have nothing to do. A new deploy (``serve run``, ``serve
deploy``: a new build id) starts from the build-time state (``startup_models``) under a new
incarnation; replicas that applied another incarnation's state apply the differences from it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import replace
from typing import Any, Awaitable, Callable, Iterable, Protocol

from ray import serve

from .logs import Outage
from .loopback import replica_grpc_on_loopback
from .runtime.contract.config import ModelConfig
from .runtime.contract.errors import ConfigError, InferenceError, InvalidInput, ServingError
from .runtime.contract.repository import CONFIG_FILENAME, ModelEntry, ModelRepository

logger = logging.getLogger("ray.serve")

POLL_S = 0.25  # how often a replica reads the desired state
# How long a starting replica waits to read the desired state before Serve may route to it (its
# constructor awaits ``Follower.first_sync``, then applying it, however long its loads take);
# past it (the control replica unreachable) the replica serves, answering 503 for its models
# until it has synced.
FIRST_SYNC_S = 15.0
BEFORE_REPORT_S = 6.0  # the longest a replica's report of a change waits for ``Follower.before_report``
REPORT_FRESH_S = 5.0  # reports older than this are a replica's that stopped: not counted
KV_NAMESPACE = "trt_serve_control"  # the GCS key-value namespace of the desired states

# model -> {"loaded": bool, "placement": str, "generation": int[, "versions": [int], "digest": str]
#           [, "kept": {"versions", "digest"}][, "reason": str]}
Desired = dict[str, dict[str, Any]]


class StateStore(Protocol):
    """Where the control deployment keeps its state across restarts (a JSON-ready dict)."""

    def load(self) -> dict[str, Any] | None: ...

    def save(self, state: dict[str, Any]) -> None: ...


class GcsStore:
    """The state in Ray's GCS key-value store (``ray.experimental.internal_kv``, reachable from
    any node of the cluster; it lives as long as the cluster's GCS), under
    ``<router application>/<build id>`` in ``namespace`` (model control's by default; the pool's
    placement keeps its decision in its own). Opening it deletes the states of the application's
    earlier builds."""

    def __init__(self, app: str, build_id: str, namespace: str = KV_NAMESPACE) -> None:
        from ray.experimental import internal_kv

        self._kv, self.namespace = internal_kv, namespace
        self.key = f"{app}/{build_id}".encode()
        for key in internal_kv._internal_kv_list(f"{app}/".encode(), namespace=namespace):
            if key != self.key:
                internal_kv._internal_kv_del(key, namespace=namespace)

    def load(self) -> dict[str, Any] | None:
        raw = self._kv._internal_kv_get(self.key, namespace=self.namespace)
        return None if raw is None else json.loads(raw)

    def save(self, state: dict[str, Any]) -> None:
        self._kv._internal_kv_put(self.key, json.dumps(state).encode(), overwrite=True, namespace=self.namespace)


@serve.deployment
class ControlDeployment:
    """The desired state of the models and the replicas' reports of what they applied.

    Args:
        models: the build-time state: per model ``{"loaded", "placement", "generation": 0}``.
        build_id: the build that deployed it (``deployments.app.control_options``: random per
            build), which names its stored state.
        store: where the state is kept (default: ``GcsStore`` of this application and build).
    """

    def __init__(self, models: Desired, build_id: str = "", store: StateStore | None = None) -> None:
        if store is None:
            replica_grpc_on_loopback()
            store = GcsStore(serve.get_replica_context().app_name, build_id)
        self.store = store
        stored = store.load()
        if stored is None:
            self.incarnation, self.revision, self.models = uuid.uuid4().hex, 0, dict(models)
            store.save(self._state())
        else:
            self.incarnation, self.revision, self.models = stored["incarnation"], stored["revision"], stored["models"]
            logger.info("model control: state of revision %d taken from the GCS store", self.revision)
        self.reports: dict[str, dict[str, Any]] = {}  # replica id -> its last report

    def _state(self) -> dict[str, Any]:
        return {"incarnation": self.incarnation, "revision": self.revision, "models": self.models}

    def desired(self) -> dict[str, Any]:
        """``{"incarnation": str, "revision": int, "models": Desired}``."""
        return self._state()

    def _change(self, name: str, entry: dict[str, Any]) -> dict[str, Any]:
        """Set model ``name``'s entry under the next revision: stored first, so that a change
        answered is never lost to a restart. Returns ``{"incarnation", "revision"}``."""
        models = {**self.models, name: entry}
        self.store.save({"incarnation": self.incarnation, "revision": self.revision + 1, "models": models})
        self.revision, self.models = self.revision + 1, models
        return {"incarnation": self.incarnation, "revision": self.revision}

    def set(self, name: str, loaded: bool, placement: str, read: dict[str, Any] | None = None,
            kept: dict[str, Any] | None = None, reason: str | None = None) -> dict[str, Any]:
        """Model ``name`` should (not) serve from ``placement``; a load serves ``read``
        (``reading``: what the router read in its folder; None: whatever each replica reads).
        ``kept``: the reading served now, of a model loaded now (``reading``), which ``report``
        restores if this load fails. ``reason``, not loaded: why its load failed before any
        replica tried it (the router refused it: its folder does not read, or cannot serve
        here), kept as a replica's failure is. Returns the new state's ``{"incarnation",
        "revision"}`` (what ``applied`` takes)."""
        if not loaded:
            generation = self.models.get(name, {}).get("generation", 0)
            why = {"reason": reason} if reason is not None else {}
            return self._change(name, {"loaded": False, "placement": placement, "generation": generation, **why})
        keep = {"kept": kept} if kept is not None and self.models.get(name, {}).get("loaded") else {}
        return self._change(name, {"loaded": True, "placement": placement, "generation": self.revision + 1,
                                   **(read or {}), **keep})

    def report(self, replica: str, deployment: str, state: dict[str, Any], models: dict[str, dict[str, Any]]) -> None:
        """A replica applied ``state`` (``{"incarnation", "revision"}``); ``models``: per model of
        its own, ``{"loaded": bool, "backend": str, "error": ServingError | None}``. A load this
        report says failed (the model's current generation) is rolled back: a model that served
        another reading when it was asked for (``set``'s ``kept``) serves that one again, under a
        new generation; any other is not loaded. Either way the error is its ``reason``; a
        rollback is never rolled back again (the replica that failed keeps reporting why)."""
        self.reports[replica] = {"replica": replica, "deployment": deployment, **state,
                                 "models": models, "time": time.monotonic()}
        if state["incarnation"] != self.incarnation:
            return
        for name, line in models.items():
            entry = self.models.get(name)
            if (line["error"] is None or entry is None or not entry["loaded"] or "reason" in entry
                    or state["revision"] < entry["generation"]):
                continue
            reason = f"failed to load: {line['error'].message}"
            if "kept" in entry:
                logger.warning("model control: the load of '%s' failed on replica %s; it serves versions %s "
                               "again: %s", name, replica, entry["kept"]["versions"], line["error"].message)
                self._change(name, {"loaded": True, "placement": entry["placement"],
                                    "generation": self.revision + 1, **entry["kept"], "reason": reason})
                continue
            logger.warning("model control: the load of '%s' failed on replica %s; it is not loaded: %s",
                           name, replica, line["error"].message)
            self._change(name, {**entry, "loaded": False, "reason": reason})

    def applied(self, deployment: str, state: dict[str, Any]) -> list[dict[str, Any]]:
        """The fresh reports of ``deployment``'s replicas that applied ``state``
        (``{"incarnation", "revision"}``) or a later revision of its incarnation."""
        now = time.monotonic()
        return [r for r in self.reports.values() if r["deployment"] == deployment
                and r["incarnation"] == state["incarnation"] and r["revision"] >= state["revision"]
                and now - r["time"] < REPORT_FRESH_S]


def applied_everywhere(reports: Iterable[dict[str, Any]], running: Iterable[str]) -> bool:
    """Whether every replica in ``running`` (the ids Serve counts RUNNING; at least one) is among
    the replicas of ``reports`` (``ControlDeployment.applied``). A count would not do: reports of
    replicas starting or draining would stand in for a running replica that has not applied."""
    running = set(running)
    return bool(running) and running <= {r["replica"] for r in reports}


def initial_state(placements: dict[str, str], loaded: set[str]) -> Desired:
    """The build-time desired state: every model's placement, ``loaded`` for those in ``loaded``."""
    return {name: {"loaded": name in loaded, "placement": placement, "generation": 0}
            for name, placement in placements.items()}


def reading(entry: ModelEntry) -> dict[str, Any]:
    """What a load read in ``entry``'s folder, as the desired state carries it (JSON-ready):
    ``{"versions": its served versions, "digest": the hash of its completed config and model
    files (``ModelEntry.digest``), "config_digest": its config's alone, "files": [[version,
    identity], ...]}``."""
    return {"versions": list(entry.served), "digest": entry.digest, "config_digest": entry.config_digest,
            "files": [list(f) for f in entry.files]}


def read_as_desired(repo: ModelRepository, name: str, state: dict[str, Any]) -> ModelEntry:
    """Model ``name``'s folder read again (``repo.peek``) for exactly what its desired ``state``
    names (``reading``; a state without one, the build's or a test's: as the folder is now):
    the versions it names, whatever version folders were added since, and the config whose
    hash it carries. A replica loads this entry and a router describes it; neither may serve
    another reading under that generation.

    Raises:
        InvalidInput: the config changed since the load read it (400: whoever changed the
            folder; a new load reads it again). A replica that starts later (a scale-out)
            reads it too: its failure rolls the load back as any replica's.
        ConfigError: a version folder it names is gone, or the folder no longer reads.
        LoadFault, ModelNotFound: as ``ModelRepository.peek``.
    """
    if "versions" not in state:
        return repo.peek(name)
    entry = repo.peek(name, tuple(state["versions"]))
    if state.get("loaded") and "reason" in state and "files" in state:
        # A rollback to the reading served before a failed load (``ControlDeployment.report``):
        # its files may have been written since (the load that failed read them), so its config
        # is checked, and the entry keeps the files it served: a replica still holding them
        # serves on, one that must load them again refuses other bytes (``ModelHost.load``).
        if entry.config_digest != state.get("config_digest", entry.config_digest):
            raise InvalidInput(f"{entry.path / CONFIG_FILENAME} changed since the load of '{name}' read it (config "
                               f"hash {entry.config_digest}, the load read {state['config_digest']}); nothing is "
                               "served under that reading: load it again")
        return replace(entry, files=tuple((int(v), str(i)) for v, i in state["files"]))
    if entry.digest != state["digest"]:
        raise InvalidInput(f"{entry.path / CONFIG_FILENAME} (or the model file it is completed from) changed "
                           f"since the load of '{name}' read it (config hash {entry.digest}, the load read "
                           f"{state['digest']}); nothing is served under that reading: load it again")
    return entry


def outcome(error: BaseException | None, loaded: bool, backend: str = "") -> dict[str, Any]:
    """One model's line of a report. ``error`` travels as a ``ServingError`` (Ray pickles those
    whole), with the status of whose fault it is: a ``ConfigError`` (a config the one who asked
    for the load wrote, e.g. one that disagrees with its model file) becomes ``InvalidInput``
    (400); a server fault keeps its type (``LoadFault`` 500: an unreadable model file, a failed
    warm-up; ``OverBudget`` / ``DeviceOutOfMemory`` 503: capacity); anything else not typed an
    ``InferenceError`` (500; its text stays in this replica's log)."""
    if isinstance(error, ConfigError):
        error = InvalidInput(error.message)
    elif error is not None and not isinstance(error, ServingError):
        logger.error("model control: a load failed", exc_info=error)
        error = InferenceError("the model failed to load; the replica's log has the details")
    return {"loaded": loaded and error is None, "backend": backend, "error": error}


def config_kept(entry: ModelEntry, deployed: ModelConfig, what: str) -> None:
    """Check that a load of ``entry`` (its folder read again) keeps ``deployed``, the config a
    deployment was built with, where that deployment cannot take another: a dedicated model's
    replicas built their batch queue, admission and validation from it, a pipeline's its steps'
    calls (``what`` says which, for the message). A new version folder with the same config
    loads; any other change (the config completed from the model file included) needs a new
    deploy.

    Raises:
        InvalidInput: the config differs (400: the one who asked for the load changed the
            folder); names the file, the fields that changed and what can be loaded.
    """
    if entry.config == deployed:
        return
    now, then = entry.config.model_dump(), deployed.model_dump()
    fields = sorted(k for k in now.keys() | then.keys() if now.get(k) != then.get(k))
    raise InvalidInput(
        f"failed to load '{entry.name}': {entry.path / CONFIG_FILENAME} changed since {what} was deployed "
        f"(fields {fields}, as completed from its model file); its replicas keep the config they were deployed "
        "with, so this load changes nothing: a config change needs a new deploy (serve deploy, or restart the "
        "server); a load takes a new version folder whose config is unchanged")


async def sync_forever(sync: Callable[[], Awaitable[Any]], every_s: float, unavailable: str) -> None:
    """Call ``sync`` every ``every_s`` seconds, for ever: a failure (the deployment it reads is
    restarting, or stopping with the application) is logged as ``unavailable`` once per outage
    (``logs.Outage``) and tried again at the next turn."""
    outage = Outage(logger, unavailable)
    while True:
        try:
            await sync()
        except Exception:
            outage.failed()
        else:
            outage.answered()
        await asyncio.sleep(every_s)


class Follower:
    """A replica's side of model control: ``run`` polls the control deployment forever.

    Args:
        control: handle of ``ControlDeployment``.
        initial: the build-time desired state (what this replica loaded at start).
        apply: ``apply(changed)`` gets the models whose desired entry changed (name -> entry),
            loads and unloads them (blocking: it runs in a worker thread) and returns their
            ``outcome`` lines.
        replica, deployment: this replica's id and deployment (default: the replica context's).
    """

    def __init__(self, control: Any, initial: Desired, apply: Callable[[Desired], dict[str, dict[str, Any]]],
                 replica: str | None = None, deployment: str | None = None) -> None:
        if replica is None or deployment is None:
            context = serve.get_replica_context()
            replica, deployment = context.replica_id.unique_id, context.deployment
        self.replica, self.deployment = replica, deployment
        self.control = control
        self.applied: Desired = dict(initial)
        self.state: dict[str, Any] | None = None  # {"incarnation", "revision"} applied; None before the first
        self.outcomes: dict[str, dict[str, Any]] = {}
        self.apply = apply
        self.task: asyncio.Task | None = None  # ``run``, started by ``follow``
        # awaited after a change is applied, before it is reported: what must know of it before
        # its load or unload answers (a pool replica's report to the placement deployment,
        # which the repository index reads); set by the replica, None: nothing
        self.before_report: Callable[[], Awaitable[Any]] | None = None
        self._read = asyncio.Event()  # set once the desired state has been read
        self._first = asyncio.Event()  # set once the desired state has been applied

    @property
    def synced(self) -> bool:
        """Whether this replica has applied the desired state once (until then it serves the
        build-time state, which a load or unload made since may have changed)."""
        return self.state is not None

    async def sync(self) -> None:
        """One round: read the state, apply what changed, report. A state is known by its
        incarnation and revision together: a control deployment deployed again starts a new
        incarnation, whose revision 1 is not the revision 1 this replica may have applied."""
        desired = await self.control.desired.remote()
        self._read.set()
        state = {"incarnation": desired["incarnation"], "revision": desired["revision"]}
        if state != self.state:
            changed = {name: entry for name, entry in desired["models"].items() if self.applied.get(name) != entry}
            if changed:
                for name, line in (await asyncio.to_thread(self.apply, changed)).items():
                    previous = self.outcomes.get(name)
                    if "reason" in changed[name] and previous is not None and previous["error"] is not None:
                        continue  # the rollback of this replica's own failed load: its report keeps why
                    self.outcomes[name] = line
                await self._before_report()
            self.applied, self.state = dict(desired["models"]), state
        self._first.set()
        await self.control.report.remote(self.replica, self.deployment, self.state, self.outcomes)

    async def _before_report(self) -> None:
        """``before_report``, within ``BEFORE_REPORT_S``; its failure is logged, and the change
        is reported all the same (what it tells then follows within its own next round)."""
        if self.before_report is None:
            return
        try:
            await asyncio.wait_for(self.before_report(), BEFORE_REPORT_S)
        except Exception as e:
            logger.warning("model control: before reporting a change applied: %r", e)

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
        await sync_forever(self.sync, POLL_S, "model control: the desired state is unavailable")


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
