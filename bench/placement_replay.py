"""A replay of placement by bytes across a popularity shift, without Ray: the placement
deployment's ``Decider``, one ``PlacementFollower`` per pool replica, each replica a byte-bounded
LRU cache (prefetch never evicts, as ``ModelCache.prefetch``) with its own ``RateMeter``, and
Poisson requests drawn with ``bench.placement``'s Zipf popularity, sent to a copy the decision
routes them to (a random one; before any decision, a replica by the model's index). Reports
every ``SYNC_S``, decisions every ``PLACE_S``, as the deployments do.

Prints the loads (prefetches and loads by a request) per 1,000 requests per 10 s around the
shift, summed over ``--seeds`` runs:

    .venv/bin/python -m bench.placement_replay --qps 70 --seeds 10 [--half-life-s 10]
"""

from __future__ import annotations

import argparse
import collections
from typing import Sequence

import numpy as np

from bench.placement import MAX_BATCHES, model_names, popularity
from deployments.placement import PLACE_S, SYNC_S, Decider, PlacementFollower, PoolReport
from deployments.runtime.residency.placement import PlacementOptions, RateMeter

MIB = 2**20
FOOTPRINT_MIB = dict(zip(MAX_BATCHES, (7, 10, 15, 27)))  # ocr_cls's copies, as plan measure takes them


class Replica:
    """A pool replica's cache for the replay: ``resident`` in LRU order under ``budget``;
    ``loads``: (time, model, 'prefetch' | 'request')."""

    def __init__(self, name: str, sizes: dict[str, int], budget: int, meter: RateMeter, clock) -> None:
        self.name, self.sizes, self.budget, self.meter, self.clock = name, sizes, budget, meter, clock
        self.resident: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.loads: list[tuple[float, str, str]] = []

    def used(self) -> int:
        return sum(self.sizes[m] for m in self.resident)

    def acquire(self, model: str, why: str = "request") -> None:
        if model in self.resident:
            self.resident.move_to_end(model)
            return
        while self.resident and self.used() + self.sizes[model] > self.budget:
            self.resident.popitem(last=False)
        self.resident[model] = None
        self.loads.append((self.clock(), model, why))

    def prefetch(self, model: str) -> bool:
        if model in self.resident or self.used() + self.sizes[model] > self.budget:
            return False
        self.acquire(model, "prefetch")
        return True

    def release(self, model: str) -> None:
        self.resident.pop(model, None)

    def report(self) -> PoolReport:
        names = list(self.sizes)
        return PoolReport(self.name, self.budget, None, names, sorted(self.resident), dict(self.sizes),
                          self.meter.rates(names))


def replay(models: int, replicas: int, qps: float, shift_s: float, end_s: float, seed: int,
           half_life_s: float | None = None, options: PlacementOptions = PlacementOptions(),
           dt_s: float = 0.05) -> tuple[np.ndarray, list[tuple[float, str, str]]]:
    """One run: the requests' times and every load (time, model, why); the shift at ``shift_s``
    (the ranking rotated by half, as ``bench.placement``'s)."""
    names = model_names(models)
    sizes = {m: FOOTPRINT_MIB[MAX_BATCHES[k % len(MAX_BATCHES)]] * MIB for k, m in enumerate(names)}
    budget = sum(sizes.values()) // 3
    now = [0.0]
    clock = lambda: now[0]  # noqa: E731
    meter = (lambda: RateMeter(clock=clock)) if half_life_s is None else (lambda: RateMeter(half_life_s, clock))
    pool = {f"r{i}": Replica(f"r{i}", sizes, budget, meter(), clock) for i in range(replicas)}
    decider = Decider(options, clock=clock)
    followers = {r: PlacementFollower(None, r, p.report, p.prefetch, p.release) for r, p in pool.items()}
    rng = np.random.default_rng(seed)
    shares, shifted = popularity(names), False
    requests, next_sync, next_place = [], 0.0, PLACE_S
    while now[0] < end_s:
        if not shifted and now[0] >= shift_s:
            shares, shifted = popularity(names, shift=models // 2), True
        if now[0] >= next_sync:
            for r, p in pool.items():
                decider.report(r, p.report())
            if decider.routes:
                for follower in followers.values():
                    follower.apply(decider.state())
            next_sync += SYNC_S
        if now[0] >= next_place:
            decider.recompute()
            next_place += PLACE_S
        order = list(shares)
        for model in rng.choice(order, rng.poisson(qps * dt_s), p=[shares[m] for m in order]):
            where = decider.routes.get(model) or (sorted(pool)[names.index(model) % replicas],)
            replica = pool[where[rng.integers(len(where))]]
            replica.meter.add(model)
            replica.acquire(model)
            requests.append(now[0])
        now[0] = round(now[0] + dt_s, 6)
    return np.array(requests), [load for p in pool.values() for load in p.loads]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=int, default=48)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--qps", type=float, default=100.0)
    parser.add_argument("--shift-s", type=float, default=60.0)
    parser.add_argument("--after-s", type=float, default=60.0)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--half-life-s", type=float, help="the rate meters' (default: RateMeter's)")
    parser.add_argument("--balance-start", type=float, help="PlacementOptions.balance_start (default: its own)")
    a = parser.parse_args(argv)
    options = PlacementOptions() if a.balance_start is None else PlacementOptions(balance_start=a.balance_start)
    edges = np.arange(a.shift_s - 30, a.shift_s + a.after_s + 1e-9, 10.0)
    requests, loads = np.zeros(len(edges) - 1), np.zeros(len(edges) - 1)
    for seed in range(a.seeds):
        times, done = replay(a.models, a.replicas, a.qps, a.shift_s, a.shift_s + a.after_s, seed, a.half_life_s, options)
        requests += np.histogram(times, edges)[0]
        loads += np.histogram([t for t, _, _ in done], edges)[0]
    for k in range(len(edges) - 1):
        print(f"{edges[k] - a.shift_s:+4.0f}..{edges[k + 1] - a.shift_s:+4.0f} s: "
              f"{1000 * loads[k] / max(1.0, requests[k]):5.2f} loads per 1,000 ({int(loads[k])} of {int(requests[k])})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
