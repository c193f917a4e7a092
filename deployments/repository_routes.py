"""The repository and model-control routes (index, load, unload, memory) and the following of
model control's desired state that other routers changed (router only)."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .control import applied_everywhere, config_kept, read_as_desired, reading
from .placement import index_placement
from .protocol.parameters import check_flag, check_parameters
from .routes import V2Routes, answers_errors
from .runtime.contract.errors import (ConfigError, InferenceTimeout, InvalidInput, LoadFault, ModelNotFound,
                                      ModelNotReady, ServingError, StoreUnavailable)
from .runtime.contract.repository import ModelEntry, read_folder_config
from .runtime.contract.store import PBTXT_FILENAME
from .states import LOADED, Status

logger = logging.getLogger("ray.serve")

_CONTROL_POLL_S = 0.1  # how often a load / unload checks whether every replica applied it
# Repository index state and reason of a pool model, by its state in the pool replica's cache.
_POOL_STATES = {"ready": ("READY", "resident in the pool replica's cache"),
                "loading": ("LOADING", "loading into the pool replica's cache"),
                "evicting": ("UNLOADING", "being evicted from the pool replica's cache"),
                "absent": ("UNAVAILABLE", "not loaded yet; loads on first request")}
# The same across the pool (``placement: bytes``: ``placement.pool_cache``); READY names how many hold it.
_POOL_WIDE_STATES = {"ready": ("READY", "resident in the cache of {held} of {replicas} pool replica(s)"),
                     "loading": ("LOADING", "loading into a pool replica's cache; none holds it yet"),
                     "evicting": ("UNLOADING", "being evicted from a pool replica's cache; none other holds it"),
                     "absent": _POOL_STATES["absent"]}
_NEVER_CACHED = {"state": "absent", "evictions": 0}  # a pool model no replica reports (``PoolReport.cached``)


class RepositoryRoutes(V2Routes):
    """Triton's model repository extension over the routes: ``POST /v2/repository/index``,
    ``POST /v2/repository/models/{name}/load|unload`` (explicit model control,
    ``deployments.control``) and ``GET /v2/memory``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.changing: dict[str, str] = {}  # model -> LOADING / UNLOADING while a load or unload goes on
        self._control_locks: dict[str, asyncio.Lock] = {}  # model -> held while it loads or unloads
        # model -> its folder as read for a load not yet taken: this router's own that outlived
        # its request, or another router's (``follow_desired``), read again for what it named
        self._pending: dict[str, ModelEntry] = {}
        # model -> the generation (``{"incarnation", "revision"}``) whose reading this router
        # describes, or whose reading it could not make (UNAVAILABLE); none: the build's
        self._followed: dict[str, dict[str, Any]] = {}

    def routes(self) -> list[Route]:
        return super().routes() + [
            Route("/v2/repository/index", self.repository_index, methods=["POST"]),
            Route("/v2/repository/models/{name}/load", self.load, methods=["POST"]),
            Route("/v2/repository/models/{name}/unload", self.unload, methods=["POST"]),
            Route("/v2/memory", self.memory, methods=["GET"]),
        ]

    @answers_errors
    async def repository_index(self, request: Request) -> JSONResponse:
        """Triton's repository index: every model with its served version and state. A dedicated
        model READY once a replica loaded it (LOADING before); a pool model as the pool holds it:
        with ``placement: bytes`` from every pool replica's latest report to the placement
        deployment (``placement.pool_cache``: READY when any replica holds it resident, else
        LOADING when one loads it, else UNLOADING when one evicts it, else UNAVAILABLE, not loaded
        yet or evicted), so every call answers alike whichever router or pool replica answers;
        with ``placement: hash`` (or while the placement deployment does not answer) as one pool
        replica's cache holds it (the replica the hash sends it to holds it, the one asked may
        not); ``reason`` says which. With explicit model control, also every model folder on disk
        not loaded yet, models unloaded through the API (UNAVAILABLE, reason "unloaded") and
        models whose last load failed (UNAVAILABLE, reason "failed to load: ..."); a load still
        going on after its request answered 504 is LOADING (``follow_desired``). A remote
        repository is listed on each call (a thread: the event loop goes on); when its store
        does not answer, the index lists the models read before it (logged).
        With ``placement: bytes`` a pool model's line (its newest version) also has
        ``placement``: where the pool's placement puts it and why (``placement.index_placement``:
        ``policy``, ``revision``, ``replicas``, ``routed``, ``copies``, ``bytes``, ``rate_per_s``,
        ``reason``); Triton's fields are unchanged, so Triton's clients read the index as before.
        Body (optional): ``{"ready": true}`` lists only READY models."""
        only_ready = (await self._json_body(request, "index")).get("ready", False)
        if not isinstance(only_ready, bool):
            raise InvalidInput(f"repository index: 'ready' must be true or false, not {json.dumps(only_ready)[:40]}")
        by_bytes = getattr(self.client, "placement", None) is not None
        decision = await self._placement_decision() if by_bytes else None
        pool_wide = decision is not None and "cache" in decision
        pool = decision["cache"] if pool_wide else await self._pool_models()
        index = []
        for entry in self.repo.entries():
            for version in self._served(entry):
                cached = pool.get(entry.key(version))
                if pool_wide and entry.name in self.client.pool_models:
                    cached = {**(cached or _NEVER_CACHED), "replicas": len(decision["replicas"])}
                item = self._index_item(entry, version, cached)
                if by_bytes and entry.name in self.client.pool_models and entry.key(version) == entry.name:
                    item["placement"] = index_placement(decision, entry.name,
                                                        self.states.get(entry.name).status in LOADED)
                index.append(item)
        if self.initial is not None:  # folders added since start, not read yet (or loading)
            try:
                folders = await asyncio.to_thread(self.repo.folders)
            except StoreUnavailable as e:
                logger.warning("repository index: %s", e.message)
                folders = []
            index += [self._unread_item(name) for name in folders if name not in self.repo.names()]
            index.sort(key=lambda item: item["name"])
        return JSONResponse([item for item in index if item["state"] == "READY" or not only_ready])

    def _unread_item(self, name: str) -> dict[str, Any]:
        """The index line of a model folder this router has not taken (yet): LOADING while a
        load of it goes on, else UNAVAILABLE with why."""
        if name in self.changing:
            return {"name": name, "state": self.changing[name], "reason": "asked for through the repository API"}
        return {"name": name, "state": "UNAVAILABLE", "reason": self.states.get(name).index_reason}

    def _index_item(self, entry: ModelEntry, version: int, cached: dict[str, Any] | None) -> dict[str, Any]:
        """One version's index line; ``cached``: its pool cache state (None: not a pool model),
        one pool replica's (``PoolDeployment.models``) or, with ``replicas`` (how many report),
        the whole pool's (``placement.pool_cache``)."""
        state = self.states.get(entry.name)
        item = {"name": entry.name, "version": str(version),
                "state": "READY" if state.status is Status.READY else "LOADING"}
        if cached is not None and state.status is not Status.READY:  # as its requests: 503 until one runs
            item["state"], item["reason"] = "UNAVAILABLE", "the pool has no running replica; retry shortly"
        elif cached is not None:
            state_reason = (_POOL_WIDE_STATES if "replicas" in cached else _POOL_STATES)[cached["state"]]
            item["state"], item["reason"] = state_reason
            if "replicas" in cached and cached["state"] == "ready":
                item["reason"] = state_reason[1].format(held=len(cached["resident"]), replicas=cached["replicas"])
            if cached["state"] == "absent" and cached["evictions"]:
                item["reason"] = "evicted from the pool replica's cache; loads on next request"
            if cached["state"] == "absent" and cached.get("load_error"):  # as its readiness (``_load_failed``)
                item["reason"] = f"its last load failed: {cached['load_error']}; the next request tries again"
        if entry.name in self.changing:
            item["state"], item["reason"] = self.changing[entry.name], "asked for through the repository API"
        elif state.status not in LOADED:
            item["state"], item["reason"] = state.status.index_state, state.index_reason
        return item

    async def _serves(self, entry: ModelEntry) -> bool:
        """Whether a loaded model serves: not a pool model whose every load fails
        (``_load_failed``), of which a failed load cannot say "it serves ... as before"."""
        return await self._load_failed(entry) is None

    async def follow_desired(self, desired: dict[str, Any]) -> None:
        """Take the loads and unloads that other router replicas made, and the outcome of loads
        that outlived their request (``ControlDeployment.desired``): a model loaded under a
        generation this router does not describe yet (a new one, or a new version or config of
        one it serves) is read again for exactly what that load read (``control.read_as_desired``),
        and is LOADING until every running replica of its deployment applied it, then READY,
        described, labelled and routed as read; one whose load failed, or whose folder no longer
        reads as the load read it, is UNAVAILABLE with why (this router never describes a reading
        its replicas do not serve). A model this router is loading or unloading itself is left
        to that request."""
        for name, state in desired["models"].items():
            lock = self._control_locks.get(name)
            if lock is not None and lock.locked():
                continue
            if not state["loaded"]:
                self._settle_failed(name, self._pending.pop(name, None))
                now = self.states.get(name)
                unloaded_reason = now.reason if now.status is Status.UNLOADED else None
                if now.status in LOADED or name in self.changing or unloaded_reason != state.get("reason"):
                    self.changing.pop(name, None)
                    self._mark_unloaded(name, state.get("reason"))
                continue
            generation = {"incarnation": desired["incarnation"], "revision": state["generation"]}
            if state["generation"] == 0 or self._followed.get(name) == generation:
                continue  # the build's reading (every replica started from it), or one taken
            try:
                entry = await asyncio.to_thread(self._reading, name, state)  # a remote one may download
            except Exception as e:  # not what the load read: this router does not claim it
                reason = f"this router cannot read it as its load did: {getattr(e, 'message', e)}"
                logger.warning("model '%s': %s", name, reason, exc_info=not isinstance(e, ServingError))
                self._followed[name] = generation
                self.changing.pop(name, None)
                self._mark_unloaded(name, reason)
                continue
            if not applied_everywhere(*await self.client.control_applied(name, state["placement"], generation)):
                self.changing[name] = "LOADING"
                continue
            self.changing.pop(name, None)
            self._take(entry, state["placement"], None, generation)

    def _reading(self, name: str, state: dict[str, Any]) -> ModelEntry:
        """Model ``name``'s folder as its load (desired ``state``) read it: the reading already
        made for it (``_pending``) where it is that one, else read again (and kept there).

        Raises:
            as ``control.read_as_desired``.
        """
        entry = self._pending.get(name)
        if entry is None or ("versions" in state and reading(entry) != {k: state[k] for k in ("versions", "digest")}):
            entry = self._pending[name] = read_as_desired(self.repo, name, state)
        return entry

    def _take(self, entry: ModelEntry, placement: str, backend: str | None, generation: dict[str, Any]) -> None:
        """Describe, label and route ``entry`` (the reading of ``generation``'s load) from now on."""
        self._pending.pop(entry.name, None)
        self._followed[entry.name] = generation
        self.repo.take(entry)
        self._mark_loaded(entry, placement, backend)

    def _control(self, request: Request, verb: str) -> str:
        """The model name of a load / unload request.

        Raises:
            InvalidInput: model control is off (``model_control_mode: none``).
        """
        name = request.path_params["name"]
        if self.initial is None:
            raise InvalidInput(f"failed to {verb} '{name}': explicit model load / unload is not allowed: "
                               "model_control_mode is none (serve_config.yaml application args); "
                               "set model_control_mode: explicit")
        return name

    def _placement(self, entry: ModelEntry, verb: str) -> str:
        """``pool``, ``dedicated`` or ``pipeline``: where ``entry`` runs in this application.

        Raises:
            InvalidInput: a model that needs a deployment of its own that the application lacks.
        """
        if entry.name in self.client.dedicated:
            return "pipeline" if entry.config.pipeline else "dedicated"
        if entry.config.pipeline or entry.config.deployment.mode == "dedicated":
            config = read_folder_config(entry.path).path
            # a Triton config.pbtxt makes a model dedicated by its dynamic_batching (contract.triton_config)
            field = "dynamic_batching" if config.name == PBTXT_FILENAME else "deployment.mode"
            raise InvalidInput(
                f"failed to {verb} '{entry.name}': {config}: {field}: a "
                f"{'pipeline' if entry.config.pipeline else 'dedicated model'} needs a deployment of its own, "
                "made when the application is deployed (serve deploy); models added at run time load "
                "into the pool (deployment.mode: pool" + (", a config.pbtxt without dynamic_batching)"
                                                          if field == "dynamic_batching" else ")"))
        if self.client.pool is None:
            raise InvalidInput(f"failed to {verb} '{entry.name}': this application has no pool deployment "
                               "to load it into (it was built without pool models)")
        return "pool"

    def _settle_failed(self, name: str, entry: ModelEntry | None) -> None:
        """After a load of ``entry`` (its folder as the load read it; None: no load pending)
        failed: a model this router did not know yet is known from now on, so that its index
        line and its requests give the failure; a known one keeps the entry its replicas
        served (they did not take the new one)."""
        if entry is not None and name not in self.repo.names():
            self.repo.take(entry)

    def _keeps_deployed_config(self, entry: ModelEntry, placement: str) -> None:
        """Refuse a load that would change the config a deployment was built with
        (``control.config_kept``): a dedicated model's or pipeline's, and a pool model's that
        a pipeline calls as a step (the pipeline built its calls from that config).

        Raises:
            InvalidInput: see ``control.config_kept``.
        """
        if entry.name not in self.repo.names():
            return
        deployed = self.repo.get(entry.name).config
        if placement == "dedicated":
            config_kept(entry, deployed, "this dedicated model's deployment")
        elif placement == "pipeline":
            config_kept(entry, deployed, "this pipeline's deployment")
        else:
            users = [p.name for p in self.repo.entries() if p.name in self.client.dedicated
                     and entry.name in self._steps_of(p)]
            if users:
                config_kept(entry, deployed, f"the pipeline(s) {users} calling it as a step")

    async def _wait_applied(self, name: str, placement: str, state: dict[str, Any], verb: str) -> list[dict[str, Any]]:
        """The reports once every replica Serve counts RUNNING in the deployment serving
        ``name`` applied ``state`` (``{"incarnation", "revision"}``; ``control.applied_everywhere``).

        Raises:
            InferenceTimeout: not all within ``request_timeout_s`` (the change goes on).
            ModelNotReady: the deployment has no running replica.
        """
        deadline = asyncio.get_running_loop().time() + self.request_timeout_s
        while True:
            reports, running = await self.client.control_applied(name, placement, state)
            if applied_everywhere(reports, running):
                return [r for r in reports if r["replica"] in running]
            if asyncio.get_running_loop().time() > deadline:
                if not running:
                    raise ModelNotReady(f"failed to {verb} '{name}': its deployment has no running replica")
                done = len(running & {r["replica"] for r in reports})
                raise InferenceTimeout(f"failed to {verb} '{name}' within {self.request_timeout_s:g} s on every "
                                       f"replica ({done} of {len(running)} running replicas done); it goes on, "
                                       "and the repository index tells when it is done or why it failed")
            await asyncio.sleep(_CONTROL_POLL_S)

    @answers_errors
    async def load(self, request: Request) -> Response:
        """``POST /v2/repository/models/{name}/load``: read the model's folder again (the same
        validation as at start: a bad config is 400 naming the file and field, and nothing
        changes but a model not loaded's index line, which gives the failure: ``_refused``),
        then load it on every replica of its deployment (pool models: into every pool
        replica's cache); answers 200 with an empty body once all have it. This router's index,
        metadata and config routes describe the folder as read from then on, not before: a load
        that fails leaves them as they were (a model new to it is known from then on, with the
        failure as its reason).

        A load that fails on a replica (a new version's truncated or deleted file) changes
        nothing for a model that served: every replica serves the versions and config it served
        before (``ControlDeployment.report``); the answer is the error.

        A dedicated model or pipeline takes a new version folder, not a changed config: its
        replicas were built from the config it was deployed with, so a load of a changed one
        (or of a pool model a pipeline calls as a step) is 400 and changes nothing
        (``_keeps_deployed_config``)."""
        name = self._control(request, "load")
        parameters = (await self._json_body(request, "load")).get("parameters") or {}
        unsupported = sorted(parameters)
        if unsupported:
            raise InvalidInput(f"failed to load '{name}': load parameters {unsupported} are not supported "
                               "(a config or files sent with the request); put the model's folder in the repository")
        try:
            entry, placement = await self._read_to_load(name)
        except (InvalidInput, LoadFault) as e:
            await self._refused(name, e)
            if (self.states.is_loaded(name) and name in self.repo.names() and "changes nothing" not in e.message
                    and await self._serves(self.repo.get(name))):
                # as a load a replica failed ends (``load``): what serves goes on serving
                raise type(e)(f"{e.message}; it serves versions {list(self.repo.get(name).served)} as before") from None
            raise
        async with self._control_lock(name):
            served = self.repo.get(name) if self.states.is_ready(name) and name in self.repo.names() else None
            served = served if served is not None and await self._serves(served) else None
            self.changing[name] = "LOADING"
            going_on = False
            try:
                state = await self.client.control_set(name, True, placement, reading(entry),
                                                      served and reading(served))
                reports = await self._wait_applied(name, placement, state, "load")
                outcomes = [r["models"][name] for r in reports if name in r["models"]]
                errors = [o["error"] for o in outcomes if o["error"] is not None]
                if errors or not all(o["loaded"] for o in outcomes):
                    # the control deployment has rolled it back (``ControlDeployment.report``),
                    # with its reason: as Triton, a model that served keeps what it served (a
                    # failed load changes nothing), any other is unavailable
                    desired = (await self.client.control_desired())["models"].get(name, {})
                    if errors and served is not None and desired.get("loaded") and desired.get("versions") == list(
                            served.served):
                        raise type(errors[0])(f"failed to load '{name}': {errors[0].message}; it serves versions "
                                              f"{list(served.served)} as before")
                    reason = desired.get("reason")
                    self._settle_failed(name, entry)
                    self._mark_unloaded(name, reason or "unloaded while it loaded")
                    if errors:
                        raise type(errors[0])(f"failed to load '{name}': {errors[0].message}")
                    raise ModelNotReady(f"failed to load '{name}': {reason or 'it was unloaded while it loaded'}")
            except InferenceTimeout:  # it goes on: LOADING until follow_desired sees it done or failed
                going_on = True
                self._pending[name] = entry
                raise
            finally:
                if not going_on:
                    self.changing.pop(name, None)
            backend = "pipeline" if placement == "pipeline" else next((o["backend"] for o in outcomes if o["backend"]), None)
            self._take(entry, placement, backend, state)
        return Response(status_code=200)

    async def _read_to_load(self, name: str) -> tuple[ModelEntry, str]:
        """Model ``name``'s folder read again for a load (taken once every replica serves it; in
        a thread: a remote model may download), and where it runs (``_placement``).

        Raises:
            InvalidInput: its config (naming the file and field) or its model file is invalid,
                or it cannot load here (``_placement``, ``_keeps_deployed_config``).
            LoadFault: a model file it cannot read (the server's fault, 500).
            ModelNotFound: no such model folder.
        """
        try:
            entry = await asyncio.to_thread(self.repo.peek, name)
        except ConfigError as e:  # a config (or model file) the sender wrote: 400
            raise InvalidInput(f"failed to load '{name}': {e.message}") from None
        except LoadFault as e:  # a model file it cannot read: the server's, 500
            raise LoadFault(f"failed to load '{name}': {e.message}") from None
        except ModelNotFound as e:
            raise ModelNotFound(f"failed to load '{name}': {e.message}") from None
        placement = self._placement(entry, "load")
        self._keeps_deployed_config(entry, placement)
        return entry, placement

    async def _refused(self, name: str, error: ServingError) -> None:
        """A load refused before any replica tried it (``_read_to_load``): a model not loaded
        is UNAVAILABLE with the failure as its reason ("failed to load: ..."), as after a load a
        replica failed (``ControlDeployment.report``); the reason goes into the desired state,
        so every router's index and every replica's answers give it (this router's alone when
        the control replica does not answer). A model loaded keeps serving (a failed load
        changes nothing)."""
        async with self._control_lock(name):
            if self.states.is_loaded(name) or name in self.changing:
                return
            prefix = f"failed to load '{name}': "
            reason = f"failed to load: {error.message.removeprefix(prefix)}"
            try:
                known = (await self.client.control_desired())["models"].get(name)
                await self.client.control_set(name, False, known["placement"] if known else "pool", reason=reason)
            except Exception as e:  # the control replica is unavailable: the answer is still the load's error
                logger.warning("model control: the refused load of '%s' is not recorded: %r", name, e)
            self._mark_unloaded(name, reason)

    @answers_errors
    async def unload(self, request: Request) -> Response:
        """``POST /v2/repository/models/{name}/unload``: new requests for the model answer 503 at
        once; every replica waits for its requests in flight, then frees the engine (pool:
        unloads it from its cache); answers 200 once all have. ``parameters.unload_dependents``
        (a bool, as Triton's) is accepted and has no effect (a pipeline using the model answers 503
        for it); another parameter, or one of another type, is 400 naming it."""
        name = self._control(request, "unload")
        parameters = (await self._json_body(request, "unload")).get("parameters") or {}
        check_parameters(f"failed to unload '{name}'", parameters, ("unload_dependents",))
        check_flag(f"failed to unload '{name}'", parameters, "unload_dependents")
        if name not in self.repo.names():
            raise ModelNotFound(f"failed to unload '{name}': no such model; models: {self.repo.names()}")
        entry = self.repo.get(name)
        placement = "pool" if name in self.client.pool_models else self._placement(entry, "unload")
        async with self._control_lock(name):
            self._mark_unloaded(name)
            self.changing[name] = "UNLOADING"
            try:
                state = await self.client.control_set(name, False, placement)
                await self._wait_applied(name, placement, state, "unload")
            finally:
                self.changing.pop(name, None)
        return Response(status_code=200)

    def _control_lock(self, name: str) -> asyncio.Lock:
        """One load or unload of model ``name`` at a time on this router, in arrival order: the
        last to answer is the state this router, the control deployment and the replicas all
        keep (two at once could leave this router's view and the replicas' apart until the next
        ``follow_desired``: ready 200 while requests answered 503 "unloaded")."""
        return self._control_locks.setdefault(name, asyncio.Lock())

    @answers_errors
    async def memory(self, request: Request) -> JSONResponse:
        """Resident memory: the cache of one pool replica (status + load/evict timeline; the
        ``replica`` field names which), each ready dedicated model's footprint (one replica's)
        and, for a repository in an object store, the node caches of model files as this
        router's node sees them (``model_cache``: ``NodeCache.status``; null for a local one)."""
        engines = [n for n in sorted(self.client.dedicated)
                   if self.states.is_ready(n) and not self.repo.get(n).config.pipeline]
        calls = [self.client.memory(n) for n in engines]
        if self.client.pool is not None:
            calls.append(self.client.pool_memory())
        try:
            answers = await asyncio.wait_for(asyncio.gather(*calls), self.request_timeout_s)
        except asyncio.TimeoutError:
            raise InferenceTimeout(f"memory status did not arrive within {self.request_timeout_s:g} s") from None
        pool = answers.pop() if self.client.pool is not None else None
        cache = await asyncio.to_thread(self.repo.store.status)
        return JSONResponse({"pool": pool, "dedicated": dict(zip(engines, answers)), "model_cache": cache})
