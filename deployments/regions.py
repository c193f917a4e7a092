"""Where the registered shared-memory regions live: Ray's GCS key-value store, one key per region.

Register and unregister reach every replica of the cluster this way, the router, dedicated model
and pool replicas alike, one started later included: a request that names a region reads the
store's ``generation`` key once (one GCS read a request, however many tensors it names), which
every register and unregister writes anew before it answers, and a replica reads a region's own
key only when the generation changed since it last read it (``protocol.shared_memory.RegionCache``),
so a region registered a moment ago through any router is usable at once, and one unregistered,
or registered again over another key, offset or size, is refused or used anew at once. Model
control's desired state (``deployments.control``) is followed by polling instead,
because a load must wait for every replica to apply it; a region needs no work from a replica
before its first use (its object is opened then), so reading it on use makes register and unregister
take effect everywhere when they answer, as Triton's do, with no replica to wait for.

A name is registered once across the cluster: ``add`` stores its key only if absent (the GCS's own
check), so two routers cannot both register it. Each process closes the CUDA handles it opened of
a region unregistered through another router within ``SWEEP_S`` (``SharedMemory.sweep``, only
while it has one open; a system region holds nothing open between requests). Regions live as long as the cluster's GCS: a ``serve deploy`` keeps them
(Triton forgets them when it restarts); ``POST /v2/systemsharedmemory/unregister`` clears them.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from .logs import Outage
from .protocol.shared_memory import Region, SharedMemory

logger = logging.getLogger("ray.serve")

KV_NAMESPACE = "trt_serve_shared_memory"
_PREFIX = b"region/"
_GENERATION = b"generation"  # changed by every add and remove (``RegionStore.generation``)
SWEEP_S = 2.0  # how often a process with CUDA handles open closes those unregistered elsewhere


class GcsRegionStore:
    """The regions in Ray's GCS key-value store (``ray.experimental.internal_kv``), key
    ``region/<name>``, value the region as JSON (``Region.to_json``); key ``generation``, a
    random 16 bytes written anew after each add and remove."""

    def __init__(self) -> None:
        from ray.experimental import internal_kv

        self._kv = internal_kv

    def generation(self) -> bytes | None:
        return self._kv._internal_kv_get(_GENERATION, namespace=KV_NAMESPACE)

    def _next_generation(self) -> None:
        self._kv._internal_kv_put(_GENERATION, uuid.uuid4().bytes, overwrite=True, namespace=KV_NAMESPACE)

    def get(self, name: str) -> Region | None:
        raw = self._kv._internal_kv_get(_PREFIX + name.encode(), namespace=KV_NAMESPACE)
        return None if raw is None else Region.from_json(raw)

    def add(self, region: Region) -> bool:
        exists = self._kv._internal_kv_put(_PREFIX + region.name.encode(), region.to_json(), overwrite=False,
                                           namespace=KV_NAMESPACE)
        if not exists:
            self._next_generation()
        return not exists

    def remove(self, name: str) -> None:
        self._kv._internal_kv_del(_PREFIX + name.encode(), namespace=KV_NAMESPACE)
        self._next_generation()

    def regions(self) -> list[Region]:
        keys = self._kv._internal_kv_list(_PREFIX, namespace=KV_NAMESPACE)
        found = (self._kv._internal_kv_get(key, namespace=KV_NAMESPACE) for key in keys)
        return [Region.from_json(raw) for raw in found if raw is not None]


_PROCESS: SharedMemory | None = None


def process_shared_memory() -> SharedMemory:
    """In a replica's constructor: this process's ``SharedMemory`` over the GCS store, one per
    process (a CUDA region's handle is opened once in it), its ``sweep`` run every ``SWEEP_S`` on the event
    loop that runs the constructor (a replica's; none in a unit test that builds routes alone)."""
    global _PROCESS
    if _PROCESS is None:
        _PROCESS = SharedMemory(GcsRegionStore())
        try:
            asyncio.get_running_loop().create_task(_sweep_forever(_PROCESS))
        except RuntimeError:  # no event loop: nothing is served here
            pass
    return _PROCESS


async def _sweep_forever(shm: SharedMemory) -> None:
    outage = Outage(logger, "shared memory: the registered regions are unavailable")
    while True:
        await asyncio.sleep(SWEEP_S)
        try:
            await asyncio.to_thread(shm.sweep)
        except Exception as e:  # the GCS is restarting: try again
            if isinstance(e, RuntimeError) and "shutdown" in str(e):  # "cannot schedule new futures after
                return  # shutdown": the process stops
            outage.failed()
        else:
            outage.answered()
