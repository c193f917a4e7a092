"""The placement decision by bytes and load (deployments/runtime/residency/placement.py)."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from deployments.placement import PoolReport, demands
from deployments.runtime.residency.placement import (
    ModelDemand, Placement, PlacementOptions, RateMeter, ReplicaView, copies_for, place)

MIB = 1 << 20


def zipf_models(n: int, sizes_mib: tuple[int, ...] = (10, 40, 90), total_rate: float = 100.0) -> dict[str, ModelDemand]:
    """``n`` models of cycling sizes with Zipf (s = 1) rates summing to ``total_rate``."""
    harmonic = sum(1 / k for k in range(1, n + 1))
    return {f"m{k:02d}": ModelDemand(sizes_mib[k % len(sizes_mib)] * MIB, total_rate / (k + 1) / harmonic)
            for k in range(n)}


def replicas(n: int, budget_mib: int | None, max_models: int | None = None) -> dict[str, ReplicaView]:
    return {f"r{i}": ReplicaView(None if budget_mib is None else budget_mib * MIB, max_models) for i in range(n)}


def placed_bytes(placement: Placement, models: dict[str, ModelDemand]) -> dict[str, int]:
    out: dict[str, int] = {}
    for model, where in placement.replicas.items():
        for r in where:
            out[r] = out.get(r, 0) + models[model].bytes
    return out


def test_every_replica_keeps_its_placed_models_within_its_budget_when_the_whole_set_fits():
    models = zipf_models(40)  # 40 models, 1,880 MiB in all
    total_mib = sum(d.bytes for d in models.values()) // MIB
    budget_mib = total_mib // 4 + 60  # four replicas hold it all with a little room
    placement = place(models, replicas(4, budget_mib))
    assert all(len(where) >= 1 for where in placement.replicas.values())
    assert max(placed_bytes(placement, models).values()) <= budget_mib * MIB
    assert all(why["reason"] != "fits no replica" for why in placement.why.values())


def test_a_model_measured_larger_than_every_budget_is_placed_on_no_replica_and_says_so():
    # tiny_cnn measured 949.7 MiB against 700 MiB budgets (2 contexts x 475 MiB): placing it
    # counted bytes no replica has, and the models placed beside it thrashed
    models = {"tiny": ModelDemand(950 * MIB, 5.0), "r18": ModelDemand(450 * MIB, 1.0), "mid": ModelDemand(112 * MIB, 1.0)}
    previous = Placement({"tiny": ("r0",), "r18": ("r1",)})  # placed earlier, by a wrong guess
    placement = place(models, replicas(3, 700), previous)
    assert placement.replicas["tiny"] == () and "tiny" not in set().union(*(placement.on(r) for r in replicas(3, 700)))
    assert placement.why["tiny"]["copies"] == 0 and placement.why["tiny"]["bytes"] == 950 * MIB
    assert placement.why["tiny"]["reason"] == (
        "larger than every replica's budget (950.0 MiB measured, the largest budget 700.0 MiB): placed on no replica")
    assert placement.replicas["r18"] == ("r1",) and len(placement.replicas["mid"]) == 1
    # a replica without a byte budget holds anything: it is placed there
    views = {**replicas(2, 700), "r9": ReplicaView(None)}
    assert place(models, views).replicas["tiny"] == ("r9",)


def test_measured_bytes_replace_the_estimate_and_the_placed_bytes_fit_every_budget():
    # the user's pool: 3 replicas of 700 MiB, copies of resnet18 (~450 MiB), mid_cnn (~112 MiB)
    # and tiny_cnn (~950 MiB, refused as over budget), and small models never measured
    sizes = {"resnet18": 450, "resnet18_a": 450, "resnet18_b": 450, "mid_cnn": 112, "mid_cnn_a": 112,
             "mid_cnn_b": 112, "tiny_cnn": 950, "tiny_cnn_a": 950, "tiny_cnn_b": 950}
    names = [*sizes, "simple", "simple_identity"]
    # each replica measured some (tiny_cnn: refused as over budget, measured all the same) and
    # estimates the others as their first load would reserve (resnet18's graph: 633 MiB)
    reports = [PoolReport(f"srv-{r}", 700 * MIB, None, names, [],
                          {m: b * MIB for k, (m, b) in enumerate(sizes.items()) if k % 3 == r},
                          {}, {**{m: 633 * MIB for m in sizes}, "simple": 4096, "simple_identity": 8192})
               for r in range(3)]
    reports = [replace(r, estimates={m: b for m, b in r.estimates.items() if m not in r.footprints}) for r in reports]
    got = demands(reports)
    assert {m: got[m].bytes for m in sizes} == {m: b * MIB for m, b in sizes.items()}
    assert all(got[m].measured for m in sizes) and not got["simple"].measured and got["simple"].bytes == 4096
    # no estimate at all: the mean of the measured ones that fit some replica
    no_estimate = demands([replace(r, estimates={}) for r in reports])
    assert no_estimate["simple"].bytes == (3 * 450 + 3 * 112) * MIB // 6
    views = {f"r{r}": ReplicaView(700 * MIB) for r in range(3)}
    placement = place(got, views)
    assert {m for m, where in placement.replicas.items() if not where} == {"tiny_cnn", "tiny_cnn_a", "tiny_cnn_b"}
    assert max(placed_bytes(placement, got).values()) <= 700 * MIB, placed_bytes(placement, got)
    assert all(len(placement.replicas[m]) == 1 for m in sizes if not m.startswith("tiny"))


def test_the_count_cap_holds_too():
    models = {f"m{k}": ModelDemand(MIB) for k in range(9)}
    placement = place(models, replicas(3, None, max_models=3))
    assert sorted(len(placement.on(r)) for r in ("r0", "r1", "r2")) == [3, 3, 3]


def test_a_model_that_fits_nowhere_goes_where_it_evicts_the_least_rate():
    models = {"hot": ModelDemand(60 * MIB, 50.0), "cold": ModelDemand(60 * MIB, 0.1), "new": ModelDemand(60 * MIB, 1.0)}
    previous = Placement({"hot": ("r0",), "cold": ("r1",)})
    placement = place(models, replicas(2, 100), previous)
    assert placement.replicas["new"] == ("r1",)  # displaces 0.1 requests/s there, not 50 on r0
    assert "evicts least" in placement.why["new"]["reason"]


def test_hot_models_get_copies_in_proportion_to_their_load():
    models = {"hot": ModelDemand(10 * MIB, 60.0), "warm": ModelDemand(10 * MIB, 20.0),
              **{f"c{k}": ModelDemand(10 * MIB, 1.0) for k in range(20)}}  # total 100 requests/s
    placement = place(models, replicas(4, 1000))
    # fair share 25 requests/s a replica; a copy per 12.5: hot 60 -> 4 (all), warm 20 -> 2, cold 1
    assert len(placement.replicas["hot"]) == 4
    assert len(placement.replicas["warm"]) == 2
    assert all(len(placement.replicas[f"c{k}"]) == 1 for k in range(20))
    assert placement.why["hot"]["copies"] == 4 and "hot" in placement.why["hot"]["reason"]
    assert copies_for(60.0, 100.0, 4, PlacementOptions()) == 4


def test_a_trickle_gets_one_copy_however_large_its_share():
    # the only model used, once every few seconds: all of the load, none to spread
    trickle = place({"m": ModelDemand(MIB, 0.17), "idle": ModelDemand(MIB, 0.0)}, replicas(2, 100))
    assert len(trickle.replicas["m"]) == 1 and "hot" not in trickle.why["m"]["reason"]
    assert copies_for(0.17, 0.17, 2, PlacementOptions()) == 1
    assert copies_for(2.5, 2.5, 4, PlacementOptions()) == 2  # one copy per request/s
    assert copies_for(20.0, 20.0, 4, PlacementOptions()) == 4


def test_copies_are_added_only_where_they_fit():
    models = {"hot": ModelDemand(60 * MIB, 90.0), "other": ModelDemand(60 * MIB, 10.0)}
    placement = place(models, replicas(2, 100))
    assert len(placement.replicas["hot"]) == 1  # a second copy would push 'other' out
    assert "no other replica has room" in placement.why["hot"]["reason"]
    assert max(placed_bytes(placement, models).values()) <= 100 * MIB


def test_copies_do_not_flap_with_rates_inside_the_hysteresis_band():
    # 4 replicas, total 100: a second copy at more than 12.5 requests/s
    def with_rate(rate: float) -> dict[str, ModelDemand]:
        return {"m": ModelDemand(MIB, rate), "rest": ModelDemand(MIB, 100.0 - rate)}

    first = place(with_rate(13.0), replicas(4, 100))
    assert len(first.replicas["m"]) == 2
    wobble = place(with_rate(11.0), replicas(4, 100), first)  # below 12.5, above 12.5 / 1.25 = 10
    assert wobble.replicas["m"] == first.replicas["m"]
    dropped = place(with_rate(9.0), replicas(4, 100), wobble)
    assert len(dropped.replicas["m"]) == 1
    back = place(with_rate(14.0), replicas(4, 100), dropped)  # above 12.5 but below 12.5 x 1.25
    assert len(back.replicas["m"]) == 1
    assert len(place(with_rate(16.0), replicas(4, 100), back).replicas["m"]) == 2


def test_recomputing_from_changed_rates_moves_no_model_that_still_fits():
    models = zipf_models(30)
    first = place(models, replicas(4, 700))
    shifted = {m: ModelDemand(d.bytes, d.rate_per_s * (1.1 if i % 2 else 0.9)) for i, (m, d) in enumerate(models.items())}
    again = place(shifted, replicas(4, 700), first)
    assert {m: set(w) for m, w in again.replicas.items()} == {m: set(w) for m, w in first.replicas.items()}


def test_when_a_replica_goes_only_its_models_move():
    models = zipf_models(30)
    first = place(models, replicas(4, 900))
    gone = "r2"
    left = {r: v for r, v in replicas(4, 900).items() if r != gone}
    after = place(models, left, first)
    for model, where in first.replicas.items():
        if gone not in where:
            assert after.replicas[model] == where, model
        else:
            assert gone not in after.replicas[model] and after.replicas[model], model
    assert max(placed_bytes(after, models).values()) <= 900 * MIB


def test_when_a_replica_comes_models_move_only_to_it_until_the_loads_are_within_the_band():
    models = zipf_models(12)
    first = place(models, replicas(3, 2000))
    more = {**models, "late": ModelDemand(10 * MIB, 0.0)}
    after = place(more, replicas(4, 2000), first)
    moved = {m for m in models if after.replicas[m] != first.replicas[m]}
    assert moved, "the new replica took nothing"
    assert all(set(after.replicas[m]) - set(first.replicas[m]) == {"r3"} for m in moved)
    assert "r3" in after.replicas["late"] or after.on("r3")
    assert place(more, replicas(4, 2000), after).replicas == after.replicas  # settled: nothing moves again


def test_models_placed_before_a_second_replica_reported_spread_once_it_does():
    models = {f"m{k}": ModelDemand(10 * MIB) for k in range(6)}  # no rates yet: balanced by bytes
    alone = place(models, replicas(1, 1000))
    both = place(models, replicas(2, 1000), alone)
    assert sorted(len(both.on(r)) for r in ("r0", "r1")) == [3, 3]
    assert all("balance" in both.why[m]["reason"] for m in both.on("r1"))


def two_replicas(resident_on_r1: frozenset[str] = frozenset()) -> dict[str, ReplicaView]:
    return {"r0": ReplicaView(), "r1": ReplicaView(resident=resident_on_r1)}


def test_balance_waits_until_the_loads_differ_by_more_than_balance_start():
    # r0 carries 26 requests/s, r1 18: 36% of their mean apart, past hysteresis (25%), short of
    # balance_start (50%): moving c (6) would cost a load for a gap rates still converging can make
    models = {"a": ModelDemand(MIB, 10.0), "b": ModelDemand(MIB, 10.0), "c": ModelDemand(MIB, 6.0),
              "d": ModelDemand(MIB, 10.0), "e": ModelDemand(MIB, 8.0)}
    previous = Placement({"a": ("r0",), "b": ("r0",), "c": ("r0",), "d": ("r1",), "e": ("r1",)})
    assert place(models, two_replicas(), previous).replicas == previous.replicas
    assert place(models, two_replicas(), previous, PlacementOptions(balance_start=0.25)).replicas["c"] == ("r1",)


def test_once_started_balance_moves_until_the_loads_are_within_the_hysteresis_band():
    models = {"a": ModelDemand(MIB, 2.0), "b": ModelDemand(MIB, 4.0), "c": ModelDemand(MIB, 4.0),
              "d": ModelDemand(MIB, 4.0), "e": ModelDemand(MIB, 2.0)}  # r0 14, r1 2: 150% of their mean apart
    previous = Placement({"a": ("r0",), "b": ("r0",), "c": ("r0",), "d": ("r0",), "e": ("r1",)})
    after = place(models, two_replicas(), previous)
    # b (4) leaves r0 10 and r1 6, 50% apart: not past balance_start, but balance has started,
    # so a (2) follows: 8 and 8
    assert {r: sum(models[m].rate_per_s for m in after.on(r)) for r in ("r0", "r1")} == {"r0": 8.0, "r1": 8.0}
    assert {m for m in models if after.replicas[m] != previous.replicas[m]} == {"a", "b"}
    assert all("balance" in after.why[m]["reason"] for m in ("a", "b"))


def test_a_model_still_resident_on_the_lighter_replica_moves_back_within_balance_start():
    models = {"a": ModelDemand(MIB, 10.0), "b": ModelDemand(MIB, 10.0), "c": ModelDemand(MIB, 6.0),
              "d": ModelDemand(MIB, 10.0), "e": ModelDemand(MIB, 8.0)}  # 36% apart, as above
    previous = Placement({"a": ("r0",), "b": ("r0",), "c": ("r0",), "d": ("r1",), "e": ("r1",)})
    after = place(models, two_replicas(frozenset({"b", "c"})), previous)  # r1 kept b and c: no load
    assert after.replicas["c"] == ("r1",) and "balance" in after.why["c"]["reason"]
    assert all(after.replicas[m] == previous.replicas[m] for m in models if m != "c")


def test_a_replica_over_its_budget_sheds_its_coldest_model():
    models = {"a": ModelDemand(50 * MIB, 9.0), "b": ModelDemand(50 * MIB, 1.0)}
    previous = Placement({"a": ("r0",), "b": ("r0",)})
    placement = place(models, replicas(2, 80), previous)
    assert placement.replicas == {"a": ("r0",), "b": ("r1",)}
    assert "over its limits" in placement.why["b"]["reason"]


def test_a_model_already_resident_somewhere_is_placed_there():
    models = {"m": ModelDemand(MIB)}
    views = {"r0": ReplicaView(100 * MIB), "r1": ReplicaView(100 * MIB, resident=frozenset({"m"}))}
    assert place(models, views).replicas["m"] == ("r1",)


def test_the_decision_is_deterministic_whatever_the_order_of_its_inputs():
    models = zipf_models(25)
    views = replicas(4, 600)
    results = set()
    for order in itertools.islice(itertools.permutations(sorted(views)), 6):
        shuffled_models = dict(reversed(list(models.items())))
        placement = place(shuffled_models, {r: views[r] for r in order})
        results.add(tuple(sorted(placement.replicas.items())))
    assert len(results) == 1


def test_no_replica_places_nothing():
    placement = place({"m": ModelDemand(MIB)}, {})
    assert placement.replicas == {"m": ()}


def test_the_rate_meter_reports_a_steady_rate_and_decays_it():
    now = [0.0]
    meter = RateMeter(half_life_s=10.0, clock=lambda: now[0])
    for _ in range(600):  # 10 requests/s for 60 s
        now[0] += 0.1
        meter.add("m")
    assert meter.rates()["m"] == pytest.approx(10.0, rel=0.05)
    now[0] += 10.0
    assert meter.rates(["m", "other"]) == {"m": pytest.approx(5.0, rel=0.05), "other": 0.0}


def test_the_rate_meter_follows_a_doubled_rate_within_10_percent_in_20_s():
    now = [0.0]
    meter = RateMeter(clock=lambda: now[0])  # the pool replicas' meter
    for _ in range(1200):  # 10 requests/s for 120 s
        now[0] += 0.1
        meter.add("m")
    for _ in range(400):  # then 20 requests/s: a popularity shift
        now[0] += 0.05
        meter.add("m")
    assert meter.rates()["m"] == pytest.approx(20.0, rel=0.1)


# ---------------------------------------------------------------- the deployment's state (deployments/placement.py)

from deployments.placement import REPORT_FRESH_S, Decider, PlacementFollower, PoolReport, demands  # noqa: E402


def report(server: str, models: list[str], resident: list[str] = (), rates: dict[str, float] | None = None,
           budget_mib: int = 100) -> PoolReport:
    return PoolReport(server, budget_mib * MIB, None, models, list(resident),
                      {m: 30 * MIB for m in models}, rates or {})


def test_a_model_is_routed_to_a_replica_only_once_it_has_it_and_the_old_one_serves_meanwhile():
    now = [0.0]
    published = []
    decider = Decider(publish=published.append, clock=lambda: now[0])
    decider.report("r0", report("srv-0", ["a", "b"], resident=["a", "b"]))
    assert decider.recompute()
    first = decider.state()
    assert first["routed"] == first["target"] and published[-1] == {m: ["srv-0"] for m in ("a", "b")}
    now[0] += 1
    decider.report("r1", report("srv-1", ["a", "b"], rates={"a": 1.0, "b": 30.0}))
    decider.report("r0", report("srv-0", ["a", "b"], resident=["a", "b"], rates={"a": 1.0, "b": 30.0}))
    decider.recompute()
    gained = {m for m, where in decider.state()["target"].items() if "r1" in where}
    assert gained, decider.state()  # b is hot: a second copy, on r1
    assert all(decider.state()["routed"][m] == ["r0"] for m in gained)  # r1 does not have it yet
    now[0] += 1
    decider.report("r1", report("srv-1", ["a", "b"], resident=sorted(gained)))
    assert decider.recompute()
    assert all("r1" in decider.state()["routed"][m] for m in gained)
    assert all("srv-1" in published[-1][m] for m in gained)


def test_a_replica_that_stops_reporting_is_gone_and_only_its_models_move():
    now = [0.0]
    decider = Decider(clock=lambda: now[0])
    models = [f"m{k}" for k in range(6)]
    for r in ("r0", "r1", "r2"):
        decider.report(r, report(f"srv-{r}", models, budget_mib=70))
    decider.recompute()
    before = decider.state()["target"]
    now[0] += REPORT_FRESH_S + 1
    for r in ("r0", "r1"):  # r2 is gone
        decider.report(r, report(f"srv-{r}", models, budget_mib=100))
    decider.recompute()
    after = decider.state()
    assert after["replicas"] == ["r0", "r1"]
    assert all(after["target"][m] == where for m, where in before.items() if "r2" not in where)
    assert all("r2" not in where and where for where in after["target"].values())


def test_a_replica_gpu_growth_leaves_its_models_only_the_rest_of_its_budget():
    """A replica whose cache counts GPU growth against its budget (memory its process holds that
    no footprint covers) gets placed models that fit its budget less that growth: the 30 MiB
    models fill r0's 100 MiB to 90, r1's 100 MiB less 50 MiB of growth to 30."""
    decider = Decider(clock=lambda: 0.0)
    models = [f"m{k}" for k in range(4)]
    decider.report("r0", report("srv-0", models))
    decider.report("r1", replace(report("srv-1", models), growth_bytes=50 * MIB))
    decider.recompute()
    target = decider.state()["target"]
    on = {r: [m for m, where in target.items() if r in where] for r in ("r0", "r1")}
    assert len(on["r0"]) == 3 and len(on["r1"]) == 1, target
    assert replace(report("srv-1", models), growth_bytes=50 * MIB).room_bytes == 50 * MIB


def test_demands_sum_rates_and_guess_the_bytes_of_a_model_never_loaded():
    got = demands([PoolReport("a", None, None, ["x", "y"], [], {"x": 10}, {"x": 1.0}),
                   PoolReport("b", None, None, ["x", "y", "z"], [], {"x": 12, "z": 20}, {"x": 2.0, "y": 0.5})])
    assert got["x"].bytes == 12 and got["x"].rate_per_s == 3.0
    assert got["y"].bytes == 16 and got["y"].rate_per_s == 0.5  # the mean of the known ones


class FakeReplica:
    """A pool replica's cache for the follower: 30 MiB models under ``budget_mib``; ``calls``
    records prefetches and releases in order."""

    def __init__(self, models: list[str], resident: list[str], budget_mib: int = 100) -> None:
        self.models, self.resident, self.budget_mib, self.calls = models, list(resident), budget_mib, []

    def report(self) -> PoolReport:
        return report("srv", self.models, resident=self.resident, budget_mib=self.budget_mib)

    def prefetch(self, model: str, nbytes: int | None = None) -> bool:
        self.calls.append(("prefetch", model))
        self.resident.append(model)
        return True

    def release(self, model: str) -> None:
        self.calls.append(("release", model))
        self.resident.remove(model)

    def follower(self) -> PlacementFollower:
        return PlacementFollower(None, "r0", self.report, self.prefetch, self.release)


def decision(target: dict[str, list[str]], routed: dict[str, list[str]] | None = None,
             rates: dict[str, float] | None = None) -> dict:
    return {"target": target, "routed": routed or target, "revision": 1,
            "why": {m: {"rate_per_s": r} for m, r in (rates or {}).items()}}


def test_the_follower_prefetches_what_it_gained_and_keeps_what_it_lost_while_it_has_room():
    replica = FakeReplica(["a", "b", "c"], resident=["a"])
    follower = replica.follower()
    follower.apply(decision({"a": ["r0"], "b": ["r1"], "c": ["r1"]}))
    assert replica.calls == []  # a is resident already
    follower.apply(decision({"a": ["r1"], "b": ["r0"], "c": ["r1"]}, {"a": ["r0"], "b": ["r1"], "c": ["r1"]}))
    assert replica.calls == [("prefetch", "b")]
    follower.apply(decision({"a": ["r1"], "b": ["r0"], "c": ["r1"]}))
    assert replica.calls == [("prefetch", "b")]  # a moved off: 60 of 100 MiB, it stays
    assert replica.resident == ["a", "b"] and follower.left == {"a"}
    follower.apply(decision({"a": ["r0"], "b": ["r0"], "c": ["r1"]}))  # and moves back without a load
    assert replica.calls == [("prefetch", "b")] and follower.left == set()


def test_the_follower_releases_what_it_lost_coldest_first_only_to_make_room_for_what_it_gained():
    replica = FakeReplica(["a", "b", "c", "d"], resident=["a", "b", "c"])  # 90 of 100 MiB
    follower = replica.follower()
    follower.apply(decision({"a": ["r0"], "b": ["r0"], "c": ["r0"], "d": ["r1"]}))
    rates = {"a": 5.0, "b": 1.0, "c": 3.0, "d": 9.0}
    follower.apply(decision({"a": ["r1"], "b": ["r1"], "c": ["r0"], "d": ["r0"]}, rates=rates))
    assert replica.calls == [("release", "b"), ("prefetch", "d")]  # one 30 MiB model makes room: the coldest
    assert sorted(replica.resident) == ["a", "c", "d"] and follower.left == {"a"}


def test_a_model_first_placed_elsewhere_is_released_where_a_load_left_it_and_a_stray_one_later_is_not():
    # a load (model control, or load_policy eager) loads a model on every pool replica before
    # the placement names one: the replicas it does not name let it go at the first decision
    # that places it; one loaded later by a request sent by the hash (a server HAProxy has down,
    # another node's HAProxy) is left to the cache's LRU: releasing it would reload it per request
    calls = []
    resident = ["a", "b"]
    follower = PlacementFollower(None, "r0", lambda: report("srv", ["a", "b"], resident=resident),
                                 lambda m, nbytes: calls.append(("prefetch", m)), lambda m: calls.append(("release", m)))
    follower.apply({"target": {"a": ["r0"]}, "routed": {"a": ["r0"]}, "why": {}, "revision": 1})
    assert calls == []  # b is not placed yet: it stays
    follower.apply({"target": {"a": ["r0"], "b": ["r1"]}, "routed": {"a": ["r0"], "b": ["r1"]},
                    "why": {}, "revision": 2})
    assert calls == [("release", "b")]
    follower.apply({"target": {"a": ["r0"], "b": ["r1"]}, "routed": {"a": ["r0"], "b": ["r1"]},
                    "why": {}, "revision": 3})
    assert calls == [("release", "b")]  # b resident again (a hashed request): not released again


def test_when_the_set_does_not_fit_recomputing_from_changed_rates_moves_no_model():
    # two replicas each holding a third of the bytes (bench.placement --quick): the tail fits
    # nowhere; re-placing it by eviction cost at every recompute moved a few models between
    # the replicas each time (each move a load on one replica and a release on the other)
    models = zipf_models(30)
    budget_mib = sum(d.bytes for d in models.values()) // MIB // 3
    first = place(models, replicas(2, budget_mib))
    assert any("fits no replica" in why["reason"] for why in first.why.values())
    previous = first
    for step in range(6):
        noisy = {m: ModelDemand(d.bytes, d.rate_per_s * (1.3 if (i + step) % 3 == 0 else 0.8))
                 for i, (m, d) in enumerate(models.items())}
        again = place(noisy, replicas(2, budget_mib), previous)
        assert {m: set(w) for m, w in again.replicas.items()} == {m: set(w) for m, w in previous.replicas.items()}, step
        previous = again


# ---------------------------------------------------------------- what is shown of the decision

from deployments.placement import index_placement, model_placement  # noqa: E402


def _two_replica_decision() -> dict:
    """A decider's state after r0 reported models a and b resident and r1 reported none, both
    at 1 and 30 requests/s (b: 60 in all, hot): a on r0, b on r0 and (a copy, not resident
    yet) r1."""
    now = [0.0]
    decider = Decider(clock=lambda: now[0])
    rates = {"a": 1.0, "b": 30.0}
    decider.report("r0", report("srv-0", ["a", "b"], resident=["a", "b"], rates=rates))
    decider.report("r1", report("srv-1", ["a", "b"], rates=rates))
    decider.recompute()
    return decider.state()


def test_a_models_placement_names_its_replicas_routes_bytes_rate_copies_and_reason():
    decision = _two_replica_decision()
    b = model_placement(decision, "b")
    assert b == {"bytes": 30 * MIB, "bytes_measured": True, "rate_per_s": 60.0, "copies": 2, "reason": decision["why"]["b"]["reason"],
                 "replicas": decision["target"]["b"], "routed": ["r0"]}
    assert sorted(b["replicas"]) == ["r0", "r1"] and b["reason"].startswith("hot: ")
    assert model_placement(decision, "nope") is None
    assert decision["recomputes"] == 1


def test_the_index_line_says_why_a_model_is_not_placed():
    decision = _two_replica_decision()
    assert index_placement(decision, "a", loaded=True) == {
        "policy": "bytes", "revision": decision["revision"], **model_placement(decision, "a")}
    # an unloaded model still in the last decision is shown placed nowhere
    unloaded = index_placement(decision, "a", loaded=False)
    assert (unloaded["copies"], unloaded["replicas"], unloaded["routed"]) == (0, [], [])
    assert unloaded["reason"] == "unloaded: placed on no replica until it is loaded"
    assert index_placement(decision, "new", loaded=True)["reason"] == "not placed yet: the placement decides again every 2 s"
    gone = index_placement(None, "a", loaded=True)
    assert gone["revision"] is None and gone["copies"] == 0 and "did not answer" in gone["reason"]


# ---------------------------------------------------------------- routing follows placement


def test_a_model_is_routed_where_it_is_placed_once_the_replica_it_was_routed_to_no_longer_holds_it():
    # resnet18_a and _b were placed on r0 but routed to r1 (where they had been loaded), which
    # holds one of them at a time: they evicted each other there at every request while the
    # routes kept pointing at r1 (the decision stayed at one revision)
    stored = {"incarnation": "x", "revision": 7, "target": {"a": ["r0"], "b": ["r0"]},
              "routed": {"a": ["r1"], "b": ["r1"]}, "why": {}, "servers": {"r0": "srv-0", "r1": "srv-1"}}
    published = []
    decider = Decider(publish=published.append, clock=lambda: 0.0, stored=stored)
    sizes = {"a": 450 * MIB, "b": 450 * MIB}
    decider.report("r0", PoolReport("srv-0", 1000 * MIB, None, ["a", "b"], [], sizes, {}))
    decider.report("r1", PoolReport("srv-1", 1000 * MIB, None, ["a", "b"], ["b"], sizes, {}))
    assert decider.recompute()
    state = decider.state()
    # a goes where it is placed (r1 no longer holds it: a request there would load it outside
    # the placement); b, resident on r1, moves there (balance: a free move)
    assert state["target"] == state["routed"] == {"a": ["r0"], "b": ["r1"]}
    assert published[-1] == {"a": ["srv-0"], "b": ["srv-1"]} and state["revision"] == 8


def test_a_model_placed_on_no_replica_has_no_route():
    decider = Decider(clock=lambda: 0.0)
    sizes = {"tiny": 950 * MIB, "mid": 112 * MIB}
    decider.report("r0", PoolReport("srv-0", 700 * MIB, None, ["tiny", "mid"], [], sizes, {}))
    decider.recompute()
    state = decider.state()
    assert state["target"]["tiny"] == [] and state["routed"]["tiny"] == [] and state["routed"]["mid"] == ["r0"]
    assert "larger than every replica's budget" in state["why"]["tiny"]["reason"]


def test_the_follower_prefetches_a_model_by_the_bytes_another_replica_measured_or_says_why_not():
    # mid_cnn_a (112 MiB, measured elsewhere) was placed on a replica with 210 MiB free that
    # counted it at the largest footprint it knew (resnet18's 450 MiB): never prefetched, silently
    calls = []
    resident = ["r18"]
    sizes = {"r18": 490 * MIB}
    follower = PlacementFollower(
        None, "r0", lambda: PoolReport("srv", 700 * MIB, None, ["r18", "mid", "big"], list(resident), dict(sizes), {}),
        lambda m, nbytes: calls.append((m, nbytes)) or resident.append(m) or True, lambda m: calls.append(("release", m)))
    why = {"r18": {"bytes": 490 * MIB, "bytes_measured": True}, "mid": {"bytes": 112 * MIB, "bytes_measured": True},
           "big": {"bytes": 300 * MIB, "bytes_measured": True}}
    follower.apply({"target": {"r18": ["r0"], "mid": ["r0"], "big": ["r0"]}, "routed": {"r18": ["r0"]},
                    "why": why, "revision": 1, "replicas": ["r0"]})
    assert calls == [("mid", 112 * MIB)]  # big (300 MiB) does not fit beside 602 MiB
    follower.decision = {"target": {"r18": ["r0"], "mid": ["r0"], "big": ["r0"]}, "routed": {}, "why": why,
                         "revision": 1, "replicas": ["r0"]}
    waiting = follower.visible()["not_prefetched"]
    assert list(waiting) == ["big"] and waiting["big"].startswith("does not fit beside what this replica holds: needs 300.0 MiB")


from deployments.placement import pool_cache  # noqa: E402


def _cached_report(cached: dict) -> PoolReport:
    return PoolReport("s", None, None, sorted(cached), [k for k, c in cached.items() if c["state"] == "ready"],
                      cached=cached)


def test_a_key_resident_on_any_replica_is_ready_across_the_pool_whichever_replica_lacks_it():
    reports = {"r1": _cached_report({"m": {"state": "ready", "evictions": 0},
                                     "n": {"state": "absent", "evictions": 2}}),
               "r2": _cached_report({"m": {"state": "absent", "evictions": 1},
                                     "n": {"state": "loading", "evictions": 0},
                                     "o": {"state": "evicting", "evictions": 0}})}
    assert pool_cache(reports) == {
        "m": {"state": "ready", "evictions": 1, "resident": ["r1"], "loading": [], "load_error": ""},
        "n": {"state": "loading", "evictions": 2, "resident": [], "loading": ["r2"], "load_error": ""},
        "o": {"state": "evicting", "evictions": 0, "resident": [], "loading": [], "load_error": ""}}
    assert pool_cache({"r1": _cached_report({"m": {"state": "absent", "evictions": 3}})})["m"]["state"] == "absent"


def test_a_load_failed_on_any_replica_is_the_pools_until_one_holds_the_model():
    """The ready route reads ``load_error`` across the pool: a failure one replica reports
    stands whichever replica the route would have asked, unless another holds it resident."""
    failed = {"state": "absent", "evictions": 0, "load_error": "model file is not ONNX"}
    reports = {"r1": _cached_report({"m": failed}), "r2": _cached_report({})}
    assert pool_cache(reports)["m"]["load_error"] == "model file is not ONNX"
    reports["r2"] = _cached_report({"m": {"state": "ready", "evictions": 0, "load_error": ""}})
    assert pool_cache(reports)["m"]["load_error"] == ""
