"""Placement by bytes (``pool: {placement: bytes}``) as `make serve` runs it: HAProxy sends a
pool model's requests to the replicas its placement names, and when a pool replica goes only
its models move.

One server for the module: ``python -m deployments.run`` (HAProxy on) on a repository of six
pool models (tiny_cnn's model under other names), two pool replicas. The replicas' caches are
read through ``/v2/memory`` (one replica's a call: read until both have answered). That a held
model is never released is ``tests/unit/test_cache.py``'s (``ModelCache.release``)."""

from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import requests

from bench.autoscale import start_runner
from bench.replicas import interrupt_group, kill_replica

from deployments.runtime.contract.units import MIB

from .conftest import REPOSITORY, runner_config

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
MODELS = [f"p{k}" for k in range(6)]
A, B = np.arange(16, dtype=np.int32).reshape(1, 16), np.full((1, 16), 3, dtype=np.int32)
BODY = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": A.ravel().tolist()},
                   {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": B.ravel().tolist()}]}


def until(condition, what: str, timeout_s: float = 120.0):
    """Poll ``condition`` until it returns something true (returned); a request that times out
    or finds no listener counts as not yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = condition()
            if value:
                return value
        except (requests.ConnectionError, requests.Timeout):
            pass
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s"
        time.sleep(0.5)


@contextlib.contextmanager
def placement_server(tmp: Path, sources: dict[str, str] | None = None, pool: dict | None = None, **args):
    """(process, base URL, config path) of the runner on a repository in ``tmp`` of ``sources``
    (model -> the shipped model it copies; default ``MODELS``, copies of simple), two pool
    replicas under ``placement: bytes`` (the pool's options updated with ``pool``), the
    application's ``args`` updated with ``args``; once every model is ready."""
    root = tmp / "engines"
    sources = sources or {name: "simple" for name in MODELS}
    for name, source in sources.items():
        (root / name / "1").mkdir(parents=True)
        shutil.copy(f"{REPOSITORY}/{source}/config.yaml", root / name / "config.yaml")
        (root / name / "1" / "model.onnx").symlink_to(f"{REPOSITORY}/{source}/1/model.onnx")
    path, port = runner_config(tmp, repository=str(root), request_timeout_s=30,
                               pool={"num_gpus": 0, "num_replicas": 2, "placement": "bytes",
                                     "max_num_models_per_replica": 6, **(pool or {})}, **args)
    log = tmp / "out.log"
    proc = start_runner(path, log)
    url = f"http://127.0.0.1:{port}"
    try:
        until(lambda: proc.poll() is None and all(
            requests.get(f"{url}/v2/models/{m}/ready", timeout=5).status_code == 200 for m in sources)
            or (proc.poll() is not None and pytest.fail(log.read_text()[-3000:])), "the pool models ready", 300)
        yield proc, url, path
    finally:
        interrupt_group(proc)


@pytest.fixture(scope="module")
def placed(tmp_path_factory):
    """(process, base URL) of the runner on the module's repository."""
    with placement_server(tmp_path_factory.mktemp("placement")) as (proc, url, _):
        yield proc, url


def memory(url: str) -> dict | None:
    """One pool replica's ``/v2/memory`` status; None while it is not answered (503 while a
    killed replica is replaced)."""
    r = requests.get(f"{url}/v2/memory", timeout=30)
    return r.json()["pool"] if r.status_code == 200 else None


def pool_replicas(url: str, replicas: int = 2, models: list[str] = MODELS) -> dict[str, dict]:
    """Replica id -> its ``/v2/memory`` pool status, once ``replicas`` replicas with a settled
    placement (every model routed where it is placed) that covers every one of ``models`` and
    names that many reporting replicas have answered."""
    seen: dict[str, dict] = {}

    def read():
        pool = memory(url)
        if pool is None:
            return False
        placement = pool.get("placement", {})
        settled = all(w["routed"] == w["replicas"] for w in placement.get("models", {}).values())
        if (placement.get("revision") and len(placement["replicas"]) == replicas
                and set(placement["models"]) == set(models) and settled):
            seen[pool["replica"]] = pool
        return len(seen) >= replicas and set(next(iter(seen.values()))["placement"]["replicas"]) == set(seen)

    until(read, f"{replicas} pool replicas with a placement")
    return seen


def answer(url: str, model: str) -> dict | None:
    """``model``'s outputs by name for ``BODY`` (None: not 200), checked against A + B and A - B."""
    r = requests.post(f"{url}/v2/models/{model}/infer", json=BODY, timeout=60)
    if r.status_code != 200:
        return None
    outputs = {o["name"]: o for o in r.json()["outputs"]}
    assert outputs["OUTPUT0"]["shape"] == outputs["OUTPUT1"]["shape"] == [1, 16]
    assert outputs["OUTPUT0"]["data"] == (A + B).ravel().tolist() and outputs["OUTPUT1"]["data"] == (A - B).ravel().tolist()
    return outputs


def _settled(url: str) -> bool:
    """Every model ready on the replicas the decision routes it to (prefetched where placed),
    and elsewhere only where it moved off and was left while that replica has room (its
    placement's ``left_here``)."""
    now = pool_replicas(url)
    routed = {m: set(w["routed"]) for m, w in next(iter(now.values()))["placement"]["models"].items()}
    ready = {m: {r for r in now if now[r]["models"][m]["state"] == "ready"} for m in MODELS}
    left = {m: {r for r in now if m in now[r]["placement"].get("left_here", ())} for m in MODELS}
    return all(routed[m] <= ready[m] <= routed[m] | left[m] for m in MODELS)


def _request_loads(status: dict, model: str, since: float) -> list[dict]:
    """The loads of ``model`` a request made (not a placement's prefetch: detail ``prefetch``)
    in one pool replica's ``/v2/memory`` ``status`` at or after unix time ``since``."""
    return [e for e in status.get("events", ()) if e["model"] == model and e["event"] in ("load", "reload")
            and e["unix_time"] >= since and e["detail"] != "prefetch"]


def _revision(url: str) -> int:
    return next(iter(pool_replicas(url).values()))["placement"]["revision"]


def test_a_pool_models_requests_reach_only_the_replicas_its_placement_names(placed):
    _, url = placed
    # The decision settled (the same revision two recomputes apart, every model ready where it is
    # placed), so HAProxy's map holds it before the requests: until then requests are hashed.
    until(lambda: _settled(url) and (lambda first: (time.sleep(5), _revision(url) == first)[1])(_revision(url)),
          "a settled placement", 90)
    replicas = pool_replicas(url)
    routed = {m: set(w["routed"]) for m, w in next(iter(replicas.values()))["placement"]["models"].items()}
    assert all(len(where) == 1 for where in routed.values()), routed  # no load yet: one copy each
    assert len(set().union(*routed.values())) == 2, routed  # both replicas hold some
    start = time.time()
    for _ in range(4):
        for model in MODELS:
            assert answer(url, model) is not None
    after = pool_replicas(url)
    # The decision may move a model while the requests run (its rate rose): a replica it names
    # then loads it (prefetch), which is placement, not hashing; only a request's own load
    # says a request reached a replica that did not hold its model.
    routed_after = {m: set(w["routed"]) for m, w in next(iter(after.values()))["placement"]["models"].items()}
    by_request = {m: {r for r in after if _request_loads(after[r], m, start)} - routed[m] - routed_after[m]
                  for m in MODELS}
    # hashing by name would have sent some models to the replica that does not hold them, which loads them too
    assert all(not where for where in by_request.values()), (
        by_request, routed, routed_after, {m: [_request_loads(after[r], m, start) for r in where]
                                           for m, where in by_request.items() if where})
    until(lambda: _settled(url), "every model ready where it is placed, elsewhere only where it was left", 30)


def test_when_a_pool_replica_goes_only_its_models_move_and_every_model_answers(placed):
    proc, url = placed
    before = pool_replicas(url)
    placement = next(iter(before.values()))["placement"]
    killed = kill_replica(proc.pid, "models", "pool")
    [gone] = [r for r, pool in before.items() if pool["pid"] == killed]
    kept = {m: w["replicas"] for m, w in placement["models"].items() if gone not in w["replicas"]}
    assert kept and len(kept) < len(MODELS), placement["models"]

    def moved():
        now = (memory(url) or {}).get("placement", {})
        return now if now.get("revision") and gone not in now["replicas"] and all(
            w["replicas"] and gone not in w["replicas"] for w in now["models"].values()) else None

    after = until(moved, "a placement without the killed replica", 120)
    # the kept models stay where they were; Serve's replacement for the killed replica may have
    # reported already, and a replica that comes takes models (balance): only to it may one move
    joined = set(after["replicas"]) - set(placement["replicas"])
    assert all(set(after["models"][m]["replicas"]) <= set(kept[m]) | joined for m in kept), (
        kept, joined, {m: after["models"][m] for m in kept})

    for model in MODELS:
        until(lambda: answer(url, model), f"{model} answering", 60)


# ------------------------------------------------- models of real size under a small byte budget

MID = [f"mid_{k}" for k in range(4)]  # mid_cnn's model: 112-215 MiB measured (RSS)
BUDGET_MIB = 500  # two of them per replica; tiny_cnn's model (~950 MiB: 2 x 475 MiB contexts) fits none
IMAGE = {"inputs": [{"name": "input", "shape": [1, 3, 224, 224], "datatype": "FP32",
                     "data": np.zeros(3 * 224 * 224, dtype=np.float32).tolist()}]}


@pytest.fixture(scope="module")
def sized(tmp_path_factory):
    """(process, base URL) of the runner on four copies of mid_cnn and one of tiny_cnn ("big"),
    two pool replicas of ``BUDGET_MIB`` each."""
    with placement_server(tmp_path_factory.mktemp("sized"), {**{m: "mid_cnn" for m in MID}, "big": "tiny_cnn"},
                          pool={"memory_budget_mib": BUDGET_MIB}) as (proc, url, _):
        yield proc, url


def test_a_model_larger_than_every_budget_is_placed_nowhere_by_its_measured_bytes(sized):
    _, url = sized
    r = requests.post(f"{url}/v2/models/big/infer", json=IMAGE, timeout=120)
    assert r.status_code == 503, r.text
    assert "more than this replica's memory budget of 500.0 MiB" in r.json()["error"]

    def measured():
        big = next(iter(pool_replicas(url, models=[*MID, "big"]).values()))["placement"]["models"]["big"]
        return big if big["bytes_measured"] else None

    big = until(measured, "big's measured bytes in the decision", 60)
    assert big["bytes"] > BUDGET_MIB * MIB and big["replicas"] == big["routed"] == [] and big["copies"] == 0
    assert big["reason"].startswith("larger than every replica's budget (") and "MiB measured" in big["reason"]
    index = requests.post(f"{url}/v2/repository/index", timeout=30).json()
    [line] = [line for line in index if line["name"] == "big"]
    # the decision's bytes are the largest measurement the replicas report now: a replica that
    # measures it again (RSS, refused anew at each request) may report another figure meanwhile
    assert line["placement"]["replicas"] == [] and line["placement"]["bytes"] > BUDGET_MIB * MIB, line


def test_requests_go_where_each_model_is_placed_and_no_model_reloads_while_the_set_fits(sized):
    _, url = sized
    for model in MID:  # each measured once (its first load), wherever it is placed
        r = requests.post(f"{url}/v2/models/{model}/infer", json=IMAGE, timeout=120)
        assert r.status_code == 200, r.text

    def measured_and_settled():
        now = pool_replicas(url, models=[*MID, "big"])
        models = next(iter(now.values()))["placement"]["models"]
        ready = {m: {r for r in now if now[r]["models"][m]["state"] == "ready"} for m in MID}
        return now if all(models[m]["bytes_measured"] and set(models[m]["routed"]) <= ready[m] for m in MID) else None

    before = until(measured_and_settled, "every model measured and ready where it is routed", 120)
    placement = next(iter(before.values()))["placement"]
    placed = {r: sum(placement["models"][m]["bytes"] for m in MID if r in placement["models"][m]["replicas"])
              for r in before}
    assert all(b <= BUDGET_MIB * MIB for b in placed.values()), placed
    start = time.time()
    for _ in range(3):
        for model in MID:
            r = requests.post(f"{url}/v2/models/{model}/infer", json=IMAGE, timeout=120)
            assert r.status_code == 200, r.text
    after = pool_replicas(url, models=[*MID, "big"])
    for r in after:
        for m in MID:
            loads, evictions = after[r]["models"][m]["loads"], after[r]["models"][m]["evictions"]
            assert loads <= 2 and evictions <= 1, (r, m, loads, evictions)  # no thrash: the set fits
    # the requests were answered where the decision routed them: no request loaded a model on a
    # replica (the hash would have sent some to the replica that does not hold them; a replica
    # a new decision places a model on prefetches it before it is routed there)
    decided = [next(iter(after.values()))["placement"]["models"], placement["models"]]
    for m in MID:
        allowed = {r for d in decided for r in (*d[m]["routed"], *d[m]["replicas"])}
        by_request = {r: _request_loads(after[r], m, start) for r in set(after) - allowed}
        assert not any(by_request.values()), (
            m, by_request, [{k: d[m][k] for k in ("routed", "replicas", "reason")} for d in decided])
