"""BENCHMARK ONLY: what the shared-memory region store costs an infer request, in one process.

A local Ray (its GCS, as in the served app: ``deployments.regions.GcsRegionStore``), an input
region of resnet18's size (1x3x224x224 FP32, 602,112 bytes) and an output region (1x1000 FP32),
registered once; then ``--requests`` requests naming both, one after another, each answered as a
replica answers it (``protocol.answer.answer``: decode, run, encode) with a run that returns the
output without a model, so that only the protocol edge and the store are timed. Every call of the
store's methods is counted and timed (``time.perf_counter``) around the real GCS call.

Prints, per request: the store's calls and the time in them (p50 and mean), and ``answer``'s
p50 and mean. Runs against whichever ``deployments`` is first on ``sys.path`` (a checkout's own
with ``PYTHONPATH=.``), so two checkouts compare with the same command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from collections import Counter
from typing import Any

import numpy as np


def timed_store(store: Any, counts: Counter, seconds: list[float]) -> Any:
    """``store`` with each of its methods counted in ``counts`` and timed into ``seconds``."""
    for name in ("get", "generation", "regions"):
        method = getattr(store, name, None)
        if method is None:
            continue

        def wrapped(*args, _method=method, _name=name):
            start = time.perf_counter()
            try:
                return _method(*args)
            finally:
                seconds.append(time.perf_counter() - start)
                counts[_name] += 1

        setattr(store, name, wrapped)
    return store


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=100)
    a = parser.parse_args(argv)

    import ray
    import tritonclient.utils.shared_memory as shm_client

    import deployments
    from deployments.protocol.answer import answer
    from deployments.protocol.shared_memory import SYSTEM, SharedMemory
    from deployments.regions import GcsRegionStore

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224), dtype=np.float32)
    y = np.zeros((1, 1000), np.float32)
    run_id = uuid.uuid4().hex[:8]
    keys = {"in": f"/bench_shm_store_in_{run_id}", "out": f"/bench_shm_store_out_{run_id}"}
    handles = [shm_client.create_shared_memory_region("in", keys["in"], x.nbytes),
               shm_client.create_shared_memory_region("out", keys["out"], y.nbytes)]
    shm_client.set_shared_memory_region(handles[0], [x])
    counts: Counter = Counter()
    seconds: list[float] = []
    memory = SharedMemory(timed_store(GcsRegionStore(), counts, seconds))
    names = {k: f"bench_{k}_{run_id}" for k in keys}
    memory.registry.register(SYSTEM, names["in"], {"key": keys["in"], "byte_size": x.nbytes})
    memory.registry.register(SYSTEM, names["out"], {"key": keys["out"], "byte_size": y.nbytes})
    body = json.dumps({
        "inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape), "parameters": {
            "shared_memory_region": names["in"], "shared_memory_byte_size": x.nbytes}}],
        "outputs": [{"name": "logits", "parameters": {
            "shared_memory_region": names["out"], "shared_memory_byte_size": y.nbytes}}]}).encode()

    async def run(request: Any) -> dict[str, np.ndarray]:
        return {"logits": y}

    async def measure() -> list[tuple[float, int, float]]:
        rows = []
        for i in range(a.warmup + a.requests):
            counts.clear()
            seconds.clear()
            start = time.perf_counter()
            await answer("resnet18", "1", True, [body], None, run, memory)
            if i >= a.warmup:
                rows.append((time.perf_counter() - start, sum(counts.values()), sum(seconds)))
        return rows

    try:
        rows = asyncio.run(measure())
    finally:
        memory.registry.unregister(SYSTEM)
        memory.close()
        for handle in handles:
            shm_client.destroy_shared_memory_region(handle)
        ray.shutdown()
    walls, calls, store_s = zip(*rows)
    print(f"deployments from {deployments.__file__}")
    print(f"{a.requests} requests: store calls a request {statistics.mean(calls):.2f}, "
          f"store time a request p50 {statistics.median(store_s) * 1e3:.3f} ms, "
          f"mean {statistics.mean(store_s) * 1e3:.3f} ms; answer p50 {statistics.median(walls) * 1e3:.3f} ms, "
          f"mean {statistics.mean(walls) * 1e3:.3f} ms")


if __name__ == "__main__":
    main(sys.argv[1:])
