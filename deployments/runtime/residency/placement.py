"""Placement of a pool's models on its replicas by bytes and load (``placement: bytes``).

``place`` maps each model to one or more replicas from what the replicas report (their byte
budget and count cap, what they hold now) and what each model costs and gets (its footprint in
bytes, its request rate). A pure function of its arguments, engine-free and Ray-free: the
pool's placement deployment (``deployments.placement``) calls it every few seconds and HAProxy
routes by its answer. Its promises (tests/unit/test_placement.py):

* **Fits.** The models placed on a replica fit its ``budget_bytes`` and ``max_models`` whenever
  some placement of every model's first copy fits (first-fit decreasing by bytes, which finds
  one in the cases it is used for: a handful of sizes, budgets of a few models each). A model
  that fits nowhere stays on the replica it had (its ``why`` says ``kept where it was``: elsewhere
  it would evict as well, and re-placing the tail at every recompute by rates that wobble moved
  models back and forth); a new one goes where it evicts least: the replica whose coldest
  models that would make room for it carry the least request rate (``why`` says ``evicts``).
* **Too large for every replica: placed nowhere.** A model whose bytes exceed every replica's
  ``budget_bytes`` is placed on no replica (``why`` says so, with its bytes and the largest
  budget): no replica could hold it, and placing it would count bytes no replica has.
* **Copies for hot models.** A model gets ``ceil(rate / (copy_share x fair))`` copies, ``fair``
  the rate one replica would get if load were even (total rate / replicas), at least 1, at
  most the replicas (or ``max_copies``); extra copies only where they fit without pushing any
  model out. So copies follow load: with ``copy_share`` 0.5 a model that alone takes more than
  half of one replica's fair share gets a second copy. A trickle is no load: a model gets at
  most one copy per ``copy_min_rate_per_s`` of its rate (the only model used, at a request every
  few seconds, kept a copy on every replica, taking a place under each one's count cap).
* **Hysteresis.** A model keeps its copies while its rate stays within ``hysteresis`` (a
  fraction) of the rate that changes them, and keeps the replicas it has while they still exist
  and fit: a placement recomputed from the same or slightly different reports is the same one.
* **Balance with hysteresis.** Models move from the most to the least loaded replica only once
  their loads (or, before any request, their bytes) differ by more than ``balance_start`` x
  their mean, and then until they are within ``hysteresis`` x it (step 6): rates still
  converging after a shift do not move a model at every recompute. A model still resident on
  the lighter replica (it moved off and the replica kept it while it had room) moves back as
  soon as they differ by more than ``hysteresis``, and before any other: moving it costs no load.
* **A replica goes or comes: only its models move.** Models on a replica that is gone are
  placed again; a new replica takes models placed afresh, new copies, and models moved to it
  by the balance step: no model moves between replicas that stay but by that step.
* **Deterministic.** Ties are broken by name and replica id, never by dict order or chance.

``RateMeter`` is what a replica keeps to report rates: requests per model, decayed.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from ..contract.units import format_mib


@dataclass(frozen=True)
class ReplicaView:
    """What one pool replica reports. ``budget_bytes``: its cache's byte budget (None: no byte
    limit); ``max_models``: its count cap (None: none); ``resident``: the models it holds now
    (placing a model where it is already loaded costs no load)."""

    budget_bytes: int | None = None
    max_models: int | None = None
    resident: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ModelDemand:
    """One model: ``bytes`` its footprint (engine + contexts, what a replica's cache counts),
    ``rate_per_s`` its requests per second over all replicas, ``measured`` whether ``bytes`` is
    a replica's measurement (False: an estimate for a model no replica has measured yet)."""

    bytes: int
    rate_per_s: float = 0.0
    measured: bool = True


@dataclass(frozen=True)
class PlacementOptions:
    """``copy_share``: a model gets one copy per this share of a replica's fair load (see the
    module docstring); ``hysteresis``: the fraction by which a model's rate must pass the rate
    that changes its copies before they change, and the band of the replicas' loads (a fraction
    of their mean) within which balance stops; ``balance_start``: the band past which balance
    starts moving models that cost a load (a model resident on the lighter replica moves back
    past ``hysteresis`` alone); ``max_copies``: at most this many copies (None: as many as
    replicas); ``copy_min_rate_per_s``: a model gets at most one copy per this rate (requests/s)."""

    copy_share: float = 0.5
    copy_min_rate_per_s: float = 1.0
    hysteresis: float = 0.25
    max_copies: int | None = None
    balance_start: float = 0.5


@dataclass(frozen=True)
class Placement:
    """``replicas``: model -> the replicas that hold it (first copy first; empty when there is
    no replica); ``why``: model -> ``{"bytes", "rate_per_s", "copies", "reason"}`` (JSON-ready)."""

    replicas: dict[str, tuple[str, ...]] = field(default_factory=dict)
    why: dict[str, dict[str, object]] = field(default_factory=dict)

    def on(self, replica: str) -> set[str]:
        """The models placed on ``replica``."""
        return {model for model, where in self.replicas.items() if replica in where}


def copies_for(rate_per_s: float, total_rate_per_s: float, replicas: int, options: PlacementOptions) -> int:
    """Copies a model of ``rate_per_s`` gets (no hysteresis): ``ceil(rate / (copy_share x
    total / replicas))``, within [1, replicas] (and ``max_copies``, and one per
    ``copy_min_rate_per_s``)."""
    most = replicas if options.max_copies is None else min(replicas, options.max_copies)
    most = min(most, max(1, math.floor(rate_per_s / options.copy_min_rate_per_s)))
    if replicas <= 0 or total_rate_per_s <= 0 or rate_per_s <= 0:
        return 1 if most >= 1 else 0
    share = options.copy_share * total_rate_per_s / replicas
    return max(1, min(most, math.ceil(rate_per_s / share - 1e-9)))


def _copies(rate: float, total: float, replicas: int, previous: int | None, options: PlacementOptions) -> int:
    """``copies_for`` with hysteresis: ``previous`` stands unless the rate passed the rate that
    changes it by ``hysteresis``."""
    if previous is None or previous < 1:
        return copies_for(rate, total, replicas, options)
    up = copies_for(rate / (1 + options.hysteresis), total, replicas, options)
    down = copies_for(rate * (1 + options.hysteresis), total, replicas, options)
    if up > previous:
        return up
    if down < previous:
        return down
    return min(previous, replicas if options.max_copies is None else min(replicas, options.max_copies))


class _Room:
    """One replica's bytes, count and load as copies are placed on it."""

    def __init__(self, view: ReplicaView) -> None:
        self.view = view
        self.models: dict[str, int] = {}  # model -> its bytes
        self.load = 0.0  # requests per second its copies are expected to take

    @property
    def used_bytes(self) -> int:
        return sum(self.models.values())

    def fits(self, nbytes: int) -> bool:
        budget, cap = self.view.budget_bytes, self.view.max_models
        return ((budget is None or self.used_bytes + nbytes <= budget)
                and (cap is None or len(self.models) + 1 <= cap))

    def free_bytes(self) -> float:
        budget = self.view.budget_bytes
        return math.inf if budget is None else budget - self.used_bytes

    def over(self) -> bool:
        budget, cap = self.view.budget_bytes, self.view.max_models
        return (budget is not None and self.used_bytes > budget) or (cap is not None and len(self.models) > cap)


def _eviction_cost(room: _Room, nbytes: int, rates: Mapping[str, float]) -> float:
    """The request rate of the coldest models on ``room`` that would make room for ``nbytes``
    more (the cache evicts the least recently used: the coldest, as a rule)."""
    budget, cap = room.view.budget_bytes, room.view.max_models
    need_bytes = 0 if budget is None else room.used_bytes + nbytes - budget
    need_count = 0 if cap is None else len(room.models) + 1 - cap
    cost = 0.0
    for model in sorted(room.models, key=lambda m: (rates.get(m, 0.0), m)):
        if need_bytes <= 0 and need_count <= 0:
            break
        cost += rates.get(model, 0.0)
        need_bytes -= room.models[model]
        need_count -= 1
    return cost


def place(models: Mapping[str, ModelDemand], replicas: Mapping[str, ReplicaView],
          previous: Placement | None = None, options: PlacementOptions = PlacementOptions()) -> Placement:
    """The placement of ``models`` on ``replicas`` (by id), starting from ``previous`` (the last
    decision, or None); see the module docstring for what it promises.

    Steps: (0) a model larger than every replica's budget is placed nowhere; (1) each model's copies (``_copies``, with hysteresis against ``previous``); (2) the
    previous copies on replicas that still exist are kept, up to the copies; (3) a replica over
    its limits drops its coldest kept models until it fits; (4) every model without a copy is
    placed, largest first, on a replica it fits (already resident there first, then the least
    loaded, then the most free bytes), else on the replica it had, else where it evicts least; (5) extra copies of hot
    models, hottest first, where they fit; (6) balance (``_balance``).
    """
    ids = sorted(replicas)
    rooms = {r: _Room(replicas[r]) for r in ids}
    budgets = [replicas[r].budget_bytes for r in ids]
    largest = None if not ids or None in budgets else max(b for b in budgets if b is not None)
    too_large = {m for m, d in models.items() if largest is not None and d.bytes > largest}
    rates = {m: max(0.0, d.rate_per_s) for m, d in models.items()}
    total = sum(rates.values())
    before = previous.replicas if previous is not None else {}
    wanted = {m: _copies(rates[m], total, len(ids), len(before[m]) if before.get(m) else None, options)
              for m in sorted(models)}
    reasons: dict[str, str] = {m: (f"larger than every replica's budget ({format_mib(models[m].bytes)} "
                                   f"{'measured' if models[m].measured else 'estimated'}, the largest budget "
                                   f"{format_mib(largest or 0)}): placed on no replica") for m in too_large}
    placed: dict[str, list[str]] = {m: [] for m in sorted(models)}

    def put(model: str, replica: str) -> None:
        placed[model].append(replica)
        rooms[replica].models[model] = models[model].bytes

    for model in sorted(set(models) - too_large):  # (2) keep
        for replica in before.get(model, ()):
            if replica in rooms and len(placed[model]) < wanted[model] and replica not in placed[model]:
                put(model, replica)
    for replica in ids:  # (3) a replica over its limits sheds its coldest models
        room = rooms[replica]
        while room.over():
            coldest = min(room.models, key=lambda m: (rates[m], -room.models[m], m))
            del room.models[coldest]
            placed[coldest].remove(replica)
            reasons[coldest] = f"moved: {replica} was over its limits"
    for replica in ids:
        room = rooms[replica]
        room.load = sum(rates[m] / max(1, wanted[m]) for m in room.models)

    def best(model: str, candidates: list[str]) -> str:
        resident = [r for r in candidates if model in rooms[r].view.resident]
        pool = resident or candidates
        return min(pool, key=lambda r: (rooms[r].load, -rooms[r].free_bytes(), r))

    for model in sorted(models, key=lambda m: (-models[m].bytes, -rates[m], m)):  # (4) first copies
        if placed[model] or not ids or model in too_large:
            continue
        nbytes = models[model].bytes
        fitting = [r for r in ids if rooms[r].fits(nbytes)]
        if fitting:
            target = best(model, fitting)
            reasons.setdefault(model, "fits")
        elif kept := [r for r in before.get(model, ()) if r in rooms]:  # stays: elsewhere it would evict too
            target = kept[0]
            reasons[model] = "fits no replica: kept where it was"
        else:
            target = min(ids, key=lambda r: (_eviction_cost(rooms[r], nbytes, rates), -rooms[r].free_bytes(),
                                             rooms[r].load, r))
            reasons[model] = (f"fits no replica: placed where it evicts least "
                              f"({_eviction_cost(rooms[target], nbytes, rates):.3g} requests/s of colder models)")
        put(model, target)
        rooms[target].load += rates[model] / max(1, wanted[model])
    for model in sorted(set(models) - too_large, key=lambda m: (-rates[m], m)):  # (5) extra copies
        while len(placed[model]) < wanted[model]:
            fitting = [r for r in ids if r not in placed[model] and rooms[r].fits(models[model].bytes)]
            if not fitting:
                reasons[model] = f"{len(placed[model])} of {wanted[model]} copies: no other replica has room"
                break
            target = best(model, fitting)
            put(model, target)
            rooms[target].load += rates[model] / max(1, wanted[model])
    moved = _balance(rooms, placed, models, rates, wanted, total, options)  # (6)
    for model, (source, target) in moved.items():
        reasons[model] = f"moved from {source} to {target}: balance"
    why = {m: {"bytes": models[m].bytes, "bytes_measured": models[m].measured, "rate_per_s": round(rates[m], 3),
               "copies": len(placed[m]), "reason": reasons.get(m, "kept" if before.get(m) else "fits")}
           for m in sorted(models)}
    for m in sorted(models):
        if len(placed[m]) > 1 and why[m]["reason"] in ("kept", "fits"):
            why[m]["reason"] = f"hot: {rates[m]:.3g} requests/s of {total:.3g}, {len(placed[m])} copies"
    return Placement({m: tuple(placed[m]) for m in sorted(models)}, why)


def _balance(rooms: dict[str, _Room], placed: dict[str, list[str]], models: Mapping[str, ModelDemand],
             rates: Mapping[str, float], wanted: Mapping[str, int], total: float,
             options: PlacementOptions) -> dict[str, tuple[str, str]]:
    """Step (6) of ``place``: once the heaviest replica (by expected load, or by placed bytes
    when no model has a rate) is heavier than the lightest by more than ``balance_start`` x the
    mean, and then while it is by more than ``hysteresis`` x the mean, move from it to the
    lightest the copy that fits there and best halves the gap, a copy already resident there
    first (it costs no load; such a move needs only the ``hysteresis`` band). A replica that
    came takes models this way; within the band nothing moves. Returns model -> (from, to) of the moves."""
    if len(rooms) < 2:
        return {}

    def share(model: str) -> float:  # a model of unknown bytes (never loaded) counts as one byte
        return rates[model] / max(1, wanted[model]) if total > 0 else float(max(1, models[model].bytes))

    def weight(room: _Room) -> float:
        return room.load if total > 0 else sum(share(m) for m in room.models)

    moved: dict[str, tuple[str, str]] = {}
    started = False  # past balance_start once in this call: models that cost a load move too
    for _ in range(sum(len(r.models) for r in rooms.values())):
        order = sorted(rooms, key=lambda r: (weight(rooms[r]), r))
        light, heavy = order[0], order[-1]
        gap = weight(rooms[heavy]) - weight(rooms[light])
        mean = sum(weight(r) for r in rooms.values()) / len(rooms)
        if gap <= options.hysteresis * mean or gap <= 0:
            break
        started = started or gap > options.balance_start * mean
        free = rooms[light].view.resident  # moving a model there costs no load
        candidates = [m for m in rooms[heavy].models if light not in placed[m] and m not in moved
                      and 0 < share(m) < gap and rooms[light].fits(models[m].bytes) and (started or m in free)]
        if not candidates:
            break
        model = min(candidates, key=lambda m: (m not in free, abs(share(m) - gap / 2), m))
        del rooms[heavy].models[model]
        rooms[heavy].load -= rates[model] / max(1, wanted[model])
        placed[model][placed[model].index(heavy)] = light
        rooms[light].models[model] = models[model].bytes
        rooms[light].load += rates[model] / max(1, wanted[model])
        moved[model] = (heavy, light)
    return moved


class RateMeter:
    """Requests per second per model, decayed exponentially with ``half_life_s`` (a rate
    halves that long after its requests stop; 5 s: after a popularity shift the rates are
    within 10% of the new ones in about 17 s, so copies and moves follow in one or two steps
    instead of chasing rates still converging). ``add(model)`` per request; ``rates()`` reads
    them. Thread-safe; ``clock`` for tests."""

    def __init__(self, half_life_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.half_life_s = half_life_s
        self._clock = clock
        self._lock = threading.Lock()
        self._counts: dict[str, tuple[float, float]] = {}  # model -> (decayed count, at)

    def _decayed(self, value: float, at: float, now: float) -> float:
        return value * 0.5 ** ((now - at) / self.half_life_s)

    def add(self, model: str, count: float = 1.0) -> None:
        now = self._clock()
        with self._lock:
            value, at = self._counts.get(model, (0.0, now))
            self._counts[model] = (self._decayed(value, at, now) + count, now)

    def rates(self, models: Iterable[str] | None = None) -> dict[str, float]:
        """Requests per second of each model (of ``models``; default every model seen): its
        decayed count over the mean life of a request in it (``half_life_s / ln 2``)."""
        now = self._clock()
        life_s = self.half_life_s / math.log(2)
        with self._lock:
            names = list(self._counts) if models is None else list(models)
            return {m: self._decayed(*self._counts[m], now) / life_s if m in self._counts else 0.0 for m in names}
