"""BENCHMARK ONLY: what reading an input from, and writing an output into, a system shared-memory
region costs a replica, in one process, without Ray or a model.

An input region of resnet18's size (1x3x224x224 FP32, 602,112 bytes) and an output region (1x1000
FP32, 4,000 bytes) over objects in /dev/shm, registered once in an in-memory store; then
``--requests`` rounds of ``SharedMemory.read_input`` (then one pass over the input's values, as a
model's first read of them) and ``SharedMemory.write_outputs``, each timed on its own
(``time.perf_counter``).

Prints the p50 and mean of each step. Runs against whichever ``deployments`` is first on
``sys.path`` (a checkout's own with ``PYTHONPATH=.``), so two checkouts compare with the same
command, e.g. ``cd /work/main && PYTHONPATH=. python /path/to/bench/shm_copy.py``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid

import numpy as np


class MemoryStore:
    """A ``RegionStore`` in a dict: the store is not what is measured here (bench/shm_store.py)."""

    def __init__(self) -> None:
        self.items: dict = {}
        self.token = uuid.uuid4().bytes

    def get(self, name):
        return self.items.get(name)

    def add(self, region):
        self.items[region.name] = region
        self.token = uuid.uuid4().bytes
        return True

    def remove(self, name):
        self.items.pop(name, None)
        self.token = uuid.uuid4().bytes

    def regions(self):
        return list(self.items.values())

    def generation(self):
        return self.token


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    a = parser.parse_args(argv)

    import tritonclient.utils.shared_memory as shm_client

    import deployments
    from deployments.protocol.shared_memory import SYSTEM, SharedMemory

    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224), dtype=np.float32)
    y = np.random.default_rng(1).standard_normal((1, 1000), dtype=np.float32)
    run_id = uuid.uuid4().hex[:8]
    keys = {"in": f"/bench_shm_copy_in_{run_id}", "out": f"/bench_shm_copy_out_{run_id}"}
    handles = [shm_client.create_shared_memory_region("in", keys["in"], x.nbytes),
               shm_client.create_shared_memory_region("out", keys["out"], y.nbytes)]
    shm_client.set_shared_memory_region(handles[0], [x])
    memory = SharedMemory(MemoryStore())
    memory.registry.register(SYSTEM, "in", {"key": keys["in"], "byte_size": x.nbytes})
    memory.registry.register(SYSTEM, "out", {"key": keys["out"], "byte_size": y.nbytes})
    in_params = {"shared_memory_region": "in", "shared_memory_byte_size": x.nbytes}
    out_params = {"logits": {"shared_memory_region": "out", "shared_memory_byte_size": y.nbytes}}
    reads, touches, writes = [], [], []
    try:
        for i in range(a.warmup + a.requests):
            t0 = time.perf_counter()
            got = memory.read_input("input 'input'", "FP32", x.shape, in_params)
            t1 = time.perf_counter()
            float(got.sum())  # the model's first read of the input's bytes
            t2 = time.perf_counter()
            memory.write_outputs(out_params, {"logits": y})
            t3 = time.perf_counter()
            if i >= a.warmup:
                reads.append(t1 - t0)
                touches.append(t2 - t1)
                writes.append(t3 - t2)
        np.testing.assert_array_equal(got, x)
        np.testing.assert_array_equal(shm_client.get_contents_as_numpy(handles[1], np.float32, y.shape), y)
    finally:
        memory.registry.unregister(SYSTEM)
        memory.close()
        for handle in handles:
            shm_client.destroy_shared_memory_region(handle)
    print(f"deployments from {deployments.__file__}")
    for label, values in (("read_input", reads), ("first read of the input", touches), ("write_outputs", writes)):
        print(f"{label}: p50 {statistics.median(values) * 1e6:.1f} us, mean {statistics.mean(values) * 1e6:.1f} us")


if __name__ == "__main__":
    main(sys.argv[1:])
