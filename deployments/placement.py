"""The pool's placement by bytes and load (``pool: {placement: bytes}``): the deployment that
decides where each pool model lives, and a pool replica's side of it.

One small deployment, ``placement`` (one replica in the router application, no CPU reserved),
holds the decision. Every pool replica calls ``PlacementDeployment.sync`` every ``SYNC_S``
with what it has (``PoolReport``: budget, count cap, resident models, footprints, request rates
from its ``RateMeter``) and gets the decision back. Every ``PLACE_S`` the deployment recomputes
it from the fresh reports (``residency.placement.place``, with the last decision as the
starting point: hysteresis), and:

* ``target``: model -> the replicas that should hold it;
* ``routed``: model -> the replicas HAProxy sends it to: the target replicas that report it
  resident, or, while none does yet, the replicas it was routed to before that still hold it,
  or the target itself when there are none (none for a model placed on no replica: hashed).
  So a replica loads a model it gains (``prefetch``) before requests arrive, and requests keep
  reaching the replica that has it meanwhile, never one that has let it go.
* a replica releases a model once it is neither a target nor routed there (``ModelCache.release``:
  never while a request holds it).

``routed`` goes to HAProxy as a map (``haproxy.placement_map``, ``haproxy.publish_placement``:
the file beside Ray's config and, at once, the running HAProxy's map) on the node of the
placement replica. The decision is kept in Ray's GCS key-value store (``control.GcsStore``,
namespace ``trt_serve_placement``), so a placement replica started again continues from it.
A replica whose report is older than ``REPORT_FRESH_S`` is gone: only its models move.

With Serve's Python proxy (no HAProxy) nothing is published: the router's handle calls go
where Serve's multiplexing sends them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

from ray import serve

from .control import GcsStore, sync_forever
from .loopback import replica_grpc_on_loopback
from .observe.deployment import placement_recorder
from .runtime.contract.units import format_mib
from .runtime.residency.placement import ModelDemand, Placement, PlacementOptions, ReplicaView, place

logger = logging.getLogger("ray.serve")

SYNC_S = 1.0  # how often a pool replica reports and reads the decision
PLACE_S = 2.0  # how often the decision is recomputed
REPORT_FRESH_S = 6.0  # a replica whose last report is older is gone
KV_NAMESPACE = "trt_serve_placement"


@dataclass(frozen=True)
class PoolReport:
    """What a pool replica tells the placement deployment (JSON-ready). ``server``: its HAProxy
    server name (``haproxy_server_name``); ``models``: the pool models it serves (not
    unloaded); ``resident``: those loaded now; ``footprints``: model -> bytes its loads
    measured (a model refused as alone over the budget too: it was measured); ``rates``: model
    -> requests per second it answered; ``estimates``: model -> the bytes its first load would
    reserve (``ModelCache.estimated_bytes``), for the models not in ``footprints``; ``cached``:
    cache key (``ModelEntry.key``: every served version) -> ``{"state", "evictions", "load_error"}``
    in its cache (``ModelCache.status``: ``loading``, ``ready``, ``evicting``, or ``absent`` once
    evicted), for the keys not absent, never evicted and never failed left out (what the
    repository index and the ready route read: ``pool_cache``)."""

    server: str
    budget_bytes: int | None
    max_models: int | None
    models: list[str]
    resident: list[str]
    footprints: dict[str, int] = field(default_factory=dict)
    rates: dict[str, float] = field(default_factory=dict)
    estimates: dict[str, int] = field(default_factory=dict)
    cached: dict[str, dict[str, Any]] = field(default_factory=dict)
    growth_bytes: int = 0  # the cache's GPU growth no model accounts for (``ModelCache.gpu_growth_bytes``)

    @property
    def room_bytes(self) -> int | None:
        """The bytes this replica's models can have: its budget less its GPU growth (which its
        cache counts against the budget: placing models by the whole budget overfills a
        replica whose process holds memory no footprint covers); None: no byte limit."""
        return None if self.budget_bytes is None else max(0, self.budget_bytes - self.growth_bytes)


# A cache state across the pool: the first any replica has, in this order.
_POOL_ORDER = ("ready", "loading", "evicting", "absent")


def pool_cache(reports: dict[str, PoolReport]) -> dict[str, dict[str, Any]]:
    """Each cache key's state across the whole pool, from the replicas' latest ``reports``
    (replica id -> ``PoolReport``): ``state`` ``ready`` when any replica holds it resident, else
    ``loading`` when one loads it, else ``evicting`` when one is evicting it, else ``absent``;
    ``evictions`` (summed over the replicas), ``resident`` and ``loading`` (the replica ids that
    hold it, or load it), ``load_error`` (why a replica's last load of it failed where another
    would fail alike; "" when none did or it is resident anywhere). A key no report names is
    absent, never evicted and never failed: not in the result."""
    out: dict[str, dict[str, Any]] = {}
    for replica, report in sorted(reports.items()):
        for key, cached in report.cached.items():
            pooled = out.setdefault(key, {"state": "absent", "evictions": 0, "resident": [], "loading": [],
                                          "load_error": ""})
            pooled["evictions"] += cached["evictions"]
            pooled["load_error"] = pooled["load_error"] or cached.get("load_error", "")
            state = cached["state"]
            if _POOL_ORDER.index(state) < _POOL_ORDER.index(pooled["state"]):
                pooled["state"] = state
            if state in ("ready", "loading"):
                pooled["resident" if state == "ready" else "loading"].append(replica)
    for pooled in out.values():
        if pooled["resident"]:  # a replica serves it: readiness does not depend on another's failure
            pooled["load_error"] = ""
    return out


def haproxy_server_name(replica_id: Any) -> str:
    """The name Ray's HAProxy config gives the server of replica ``replica_id`` (a Serve
    ``ReplicaID``): its actor name made safe, as ``HAProxyManager`` does (Ray 2.60)."""
    from ray.serve._private.haproxy import HAProxyManager

    return HAProxyManager.get_safe_name(replica_id.to_full_id_str())


def demands(reports: Iterable[PoolReport]) -> dict[str, ModelDemand]:
    """Each model served by any of ``reports``: its bytes (the largest footprint a replica
    measured, loaded or refused as over its budget; a model no replica measured, ``measured``
    False: the largest estimate a replica gave (what its first load would reserve), else the
    mean of the measured ones that fit the largest budget, else 0) and its rate (summed)."""
    reports = list(reports)
    names = sorted({m for r in reports for m in r.models})
    measured: dict[str, int] = {}
    estimated: dict[str, int] = {}
    for report in reports:
        for model, nbytes in report.footprints.items():
            measured[model] = max(measured.get(model, 0), nbytes)
        for model, nbytes in report.estimates.items():
            estimated[model] = max(estimated.get(model, 0), nbytes)
    budgets = [r.room_bytes for r in reports]
    largest = None if not budgets or None in budgets else max(b for b in budgets if b is not None)
    fitting = [b for b in measured.values() if largest is None or b <= largest]
    guess = int(sum(fitting) / len(fitting)) if fitting else 0
    return {m: ModelDemand(measured.get(m, estimated.get(m, guess)), sum(r.rates.get(m, 0.0) for r in reports),
                           m in measured) for m in names}


def routed(target: Placement, previous: dict[str, tuple[str, ...]], reports: dict[str, PoolReport]) -> dict[str, tuple[str, ...]]:
    """Where HAProxy should send each model now (module docstring): its target replicas that
    have it resident; else its previous routes that still hold it (the old replica serves while
    the new one prefetches); else its target. A previous route that no longer holds the model
    is dropped: a request there would load it as well, outside the placement, where the
    placement did not count its bytes (two models routed to a replica they do not fit together
    evicted each other at every request while the replica they were placed on never got them).
    A model placed on no replica has no route (HAProxy hashes it)."""
    out = {}
    for model, where in target.replicas.items():
        ready = tuple(r for r in where if model in reports[r].resident)
        kept = tuple(r for r in previous.get(model, ()) if r in reports and model in reports[r].resident)
        out[model] = (ready or kept or where) if where else ()
    return out


def model_placement(decision: dict[str, Any], model: str) -> dict[str, Any] | None:
    """Model ``model``'s part of ``decision`` (``Decider.state``'s form): its ``why``
    (``bytes``, ``rate_per_s``, ``copies``, ``reason``) with ``replicas`` (the replica ids it
    is placed on) and ``routed`` (those HAProxy sends it to); None when the decision does not
    place it."""
    why = decision["why"].get(model)
    if why is None:
        return None
    return {**why, "replicas": list(decision["target"].get(model, [])),
            "routed": list(decision["routed"].get(model, []))}


def index_placement(decision: dict[str, Any] | None, model: str, loaded: bool) -> dict[str, Any]:
    """The ``placement`` field of a pool model's repository index line under ``placement:
    bytes``: ``policy``, the decision's ``revision`` and the model's part of it
    (``model_placement``). A model the decision does not place has ``copies`` 0, no
    ``replicas`` and a ``reason``: unloaded (``loaded`` False: placed nowhere until a load), not
    placed yet (a model loaded since the last decision), or no decision (``decision`` None: the
    placement deployment did not answer)."""
    if decision is None:
        return {"policy": "bytes", "revision": None, "copies": 0, "replicas": [], "routed": [],
                "reason": "the placement decision is unavailable (the placement deployment did not answer)"}
    placed = model_placement(decision, model) if loaded else None
    if placed is None:
        reason = ("unloaded: placed on no replica until it is loaded" if not loaded else
                  f"not placed yet: the placement decides again every {PLACE_S:g} s")
        placed = {"copies": 0, "replicas": [], "routed": [], "reason": reason}
    return {"policy": "bytes", "revision": decision["revision"], **placed}


class Decider:
    """The placement deployment's state without Ray: reports in, decision out.

    Args:
        options: ``PlacementOptions``.
        publish: called with model -> HAProxy server names whenever ``routed`` changes.
        clock: ``time.monotonic`` (tests pass their own).
        stored: a decision taken from the store (``state()``'s form), or None.
    """

    def __init__(self, options: PlacementOptions = PlacementOptions(),
                 publish: Callable[[dict[str, list[str]]], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, stored: dict[str, Any] | None = None) -> None:
        self.options, self.publish, self.clock = options, publish, clock
        self.reports: dict[str, tuple[float, PoolReport]] = {}
        self.incarnation = uuid.uuid4().hex if stored is None else stored["incarnation"]
        self.revision = 0 if stored is None else stored["revision"]
        self.recomputes = 0  # decisions made by this replica (a new revision or not)
        self.target = Placement({m: tuple(r) for m, r in (stored or {}).get("target", {}).items()},
                                (stored or {}).get("why", {}))
        self.routes: dict[str, tuple[str, ...]] = {m: tuple(r) for m, r in (stored or {}).get("routed", {}).items()}
        self.servers: dict[str, str] = dict((stored or {}).get("servers", {}))

    def report(self, replica: str, report: PoolReport) -> None:
        self.reports[replica] = (self.clock(), report)
        self.servers[replica] = report.server

    def fresh(self) -> dict[str, PoolReport]:
        now = self.clock()
        return {r: report for r, (at, report) in sorted(self.reports.items()) if now - at < REPORT_FRESH_S}

    def recompute(self) -> bool:
        """A new decision from the fresh reports; True when where a model is placed or routed
        changed (a new revision; published when the routes changed)."""
        self.recomputes += 1
        reports = self.fresh()
        views = {r: ReplicaView(rep.room_bytes, rep.max_models, frozenset(rep.resident)) for r, rep in reports.items()}
        before = self.target.replicas
        previous = Placement({m: tuple(r for r in where if r in reports) for m, where in before.items()})
        self.target = place(demands(reports.values()), views, previous, self.options)
        routes = routed(self.target, self.routes, reports)
        if routes == self.routes and self.target.replicas == before:
            return False
        changed, self.routes, self.revision = routes != self.routes, routes, self.revision + 1
        if changed and self.publish is not None:
            self.publish({m: [self.servers[r] for r in where] for m, where in routes.items()})
        return True

    def state(self) -> dict[str, Any]:
        """The decision (JSON-ready): ``incarnation``, ``revision``, ``recomputes`` (decisions
        this placement replica made, a new revision or not), ``target`` and ``routed`` (model ->
        replica ids), ``why`` (model -> bytes, rate, copies, reason), ``servers`` (replica id ->
        HAProxy server name) and ``replicas`` (the ids reporting now)."""
        return {"incarnation": self.incarnation, "revision": self.revision, "recomputes": self.recomputes,
                "target": {m: list(r) for m, r in self.target.replicas.items()},
                "routed": {m: list(r) for m, r in self.routes.items()}, "why": self.target.why,
                "servers": dict(self.servers), "replicas": sorted(self.fresh())}


def haproxy_publisher() -> Callable[[dict[str, list[str]]], None] | None:
    """Publishing to this node's HAProxy (``haproxy.publish_placement``) where Serve runs it
    (``RAY_SERVE_ENABLE_HA_PROXY=1``), at Ray's config path and admin socket for this node
    (``<folder>/<node id>/<file>``, as Ray's ``HAProxyManager`` places them); else None."""
    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") != "1":
        return None
    from ray.serve._private.constants import RAY_SERVE_HAPROXY_CONFIG_FILE_LOC, RAY_SERVE_HAPROXY_SOCKET_PATH

    import ray

    from .haproxy import PLACEMENT_MAP_SUFFIX, placement_map, publish_placement

    def here(path: str) -> str:  # Ray 2.60 puts each node's HAProxy files under its node id
        folder, name = os.path.split(path)
        return os.path.join(folder, ray.get_runtime_context().get_node_id(), name)

    def publish(servers: dict[str, list[str]]) -> None:
        error = publish_placement(here(RAY_SERVE_HAPROXY_CONFIG_FILE_LOC) + PLACEMENT_MAP_SUFFIX,
                                  here(RAY_SERVE_HAPROXY_SOCKET_PATH), placement_map(servers))
        if error is not None:
            logger.warning("placement: HAProxy's running map was not updated (%s); its file was", error)

    return publish


@serve.deployment
class PlacementDeployment:
    """The pool's placement (module docstring): ``sync`` from every pool replica, a decision
    every ``PLACE_S``.

    Args:
        build_id: the build that deployed it (names its stored decision).
        options: ``PlacementOptions`` fields as a dict.
        metrics: ``deployments.observe.options.MetricsOptions`` as a dict (default: on): each
            decision is written as the ``trt_serve_placement_*`` series.
    """

    def __init__(self, build_id: str = "", options: dict[str, Any] | None = None,
                 metrics: dict[str, Any] | None = None) -> None:
        replica_grpc_on_loopback()
        self.store = GcsStore(serve.get_replica_context().app_name, build_id, KV_NAMESPACE)
        self.decider = Decider(PlacementOptions(**(options or {})), haproxy_publisher(), stored=self.store.load())
        self.recorder = placement_recorder(metrics)
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(PLACE_S)
            try:
                if self.decider.recompute():
                    self.store.save(self.decider.state())
                    logger.info("placement: revision %d: %s", self.decider.revision,
                                {m: len(r) for m, r in self.decider.routes.items()})
                if self.recorder is not None:
                    self.recorder.decided(self.decider.state())
            except Exception:
                logger.exception("placement: the decision failed; the last one stands")

    def sync(self, replica: str, report: dict[str, Any]) -> dict[str, Any]:
        """A pool replica's ``PoolReport`` (as a dict); returns the decision (``Decider.state``)."""
        self.decider.report(replica, PoolReport(**report))
        return self.decider.state()

    def decision(self) -> dict[str, Any]:
        """The decision (``Decider.state``) with ``cache``: each cache key's state across the
        pool, from every replica's latest report (``pool_cache``), for the repository index."""
        return {**self.decider.state(), "cache": pool_cache(self.decider.fresh())}


class PlacementFollower:
    """A pool replica's side: every ``SYNC_S`` report (``report()``: a ``PoolReport``), read
    the decision, then in a worker thread prefetch the models it gained (a target here, not
    resident) and release, to make room for them, the models it lost (neither a target nor
    routed here): a model that moved off stays resident while the replica has room, so the
    placement can move it back (``ReplicaView.resident``) without a load.

    Args:
        placement: handle of ``PlacementDeployment``.
        replica: this replica's id.
        report: builds this replica's ``PoolReport``.
        prefetch: ``ModelCache.prefetch`` of a model with the bytes to count it at when this
            replica never measured it (the decision's); True when it loaded (blocking).
        release: ``ModelCache.release`` of a model (blocking).
    """

    def __init__(self, placement: Any, replica: str, report: Callable[[], PoolReport],
                 prefetch: Callable[[str, int | None], Any], release: Callable[[str], Any]) -> None:
        self.placement, self.replica, self.report = placement, replica, report
        self.prefetch, self.release = prefetch, release
        self.decision: dict[str, Any] | None = None
        self.mine: set[str] = set()  # models placed or routed here in the last decision applied
        self.placed: set[str] = set()  # models the last decision applied placed anywhere
        self.left: set[str] = set()  # models that moved off and are still resident here
        self.waiting: dict[str, str] = {}  # model placed here, not resident: why it was not prefetched
        self.task: asyncio.Task | None = None
        self._applying: asyncio.Future | None = None

    def here(self, decision: dict[str, Any]) -> tuple[set[str], set[str]]:
        """(target here, routed here) of ``decision``."""
        target = {m for m, where in decision["target"].items() if self.replica in where}
        routes = {m for m, where in decision["routed"].items() if self.replica in where}
        return target, routes

    def apply(self, decision: dict[str, Any]) -> None:
        """Release what this replica holds of the models placed for the first time elsewhere (a
        load through model control, or ``load_policy: eager``, loaded them on every replica);
        keep what it lost (``left``); prefetch what it gained (blocking), each after releasing
        as many of ``left`` as its room needs, coldest first (``_make_room``). A model loaded
        here later by a request the hash sent (a server HAProxy counts down, another node's
        HAProxy) is left to the cache: released, each such request would load it again."""
        target, routes = self.here(decision)
        report = self.report()
        resident = set(report.resident)
        first_placed = set(decision["target"]) - self.placed
        for model in sorted((first_placed & resident) - target - routes - self.mine):
            self.release(model)
        self.left = ((self.left | self.mine) & resident) - target - routes
        waiting = {}
        for model in sorted(target - resident):
            try:
                short = self._make_room(model, decision)
                if short is None and not self.prefetch(model, self._bytes(model, decision)):
                    short = ("the cache did not load it: no room beside what it holds and reserves (a prefetch "
                             "never evicts), or a request's load of it is under way")
            except Exception as error:  # its request will say why; the others still load
                short = f"failed: {error}"
                logger.warning("placement: prefetch of %s failed: %s", model, error)
            if short is not None and model not in set(self.report().resident):
                waiting[model] = short
        self.waiting = waiting
        self.mine, self.placed = target | routes, set(decision["target"])

    @staticmethod
    def _bytes(model: str, decision: dict[str, Any]) -> int | None:
        """``model``'s bytes in ``decision`` (the largest footprint a replica measured), None
        when no replica measured it."""
        why = decision["why"].get(model) or {}
        return why.get("bytes") if why.get("bytes_measured", True) else None

    def _make_room(self, model: str, decision: dict[str, Any]) -> str | None:
        """Release models of ``left``, coldest first (by the decision's rates), until ``model``
        fits beside the rest of what this replica holds (its budget and count cap; ``model``
        counts at this replica's own measurement, else the decision's bytes, else the largest
        footprint known here), or none is left. Returns None when it fits, else why not."""
        while True:
            report = self.report()
            resident = set(report.resident)
            self.left &= resident
            sizes = report.footprints
            need = sizes.get(model) or self._bytes(model, decision) or max(sizes.values(), default=0)
            used = sum(sizes.get(m, 0) for m in resident)
            fits = ((report.room_bytes is None or used + need <= report.room_bytes)
                    and (report.max_models is None or len(resident) + 1 <= report.max_models))
            if fits:
                return None
            if not self.left:
                return (f"does not fit beside what this replica holds: needs {format_mib(need)}, "
                        f"{format_mib(used)} of {format_mib(report.room_bytes)} held by {sorted(resident)} "
                        f"(a prefetch never evicts; its first request here loads it)")
            coldest = min(self.left, key=lambda m: ((decision["why"].get(m) or {}).get("rate_per_s", 0.0), m))
            self.left.discard(coldest)
            self.release(coldest)

    async def sync(self) -> None:
        """Report and read; apply the decision in a thread unless the last one is still being
        applied (its loads may take longer than the reports may pause: a replica that stops
        reporting for ``REPORT_FRESH_S`` counts as gone)."""
        decision = await self.placement.sync.remote(self.replica, asdict(self.report()))
        self.decision = decision
        if self._applying is None or self._applying.done():
            self._applying = asyncio.ensure_future(asyncio.to_thread(self.apply, decision))

    async def run(self) -> None:
        await sync_forever(self.sync, SYNC_S, "placement: the decision is unavailable")

    def visible(self) -> dict[str, Any]:
        """For ``/v2/memory``: the decision this replica follows, and its part of it."""
        if self.decision is None:
            return {"policy": "bytes", "revision": None}
        target, routes = self.here(self.decision)
        return {"policy": "bytes", "replica": self.replica, "revision": self.decision["revision"],
                "recomputes": self.decision.get("recomputes"),
                "replicas": self.decision["replicas"],
                "placed_here": sorted(target), "routed_here": sorted(routes), "left_here": sorted(self.left),
                "not_prefetched": dict(self.waiting),
                "models": {m: model_placement(self.decision, m) for m in self.decision["why"]}}
