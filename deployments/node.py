"""This process's Ray node id: the key of the node's model-file cache
(``runtime.contract.node_cache``), so that replicas of one node share a download and the
nodes of a local cluster, which share a filesystem, still fetch once each; and its heap after a
replica's start (``freeze_start_heap``)."""

from __future__ import annotations

import gc

import ray


def node_id() -> str | None:
    """The Ray node id of this process (None outside Ray: the cache keys by host name)."""
    if not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_node_id()


def freeze_start_heap() -> None:
    """At the end of a model replica's start: the objects made so far (Ray's, the model's
    config and engine wrappers: over 100,000) leave the cycle collector's generations
    (``gc.freeze``), so that the full collections that requests' objects trigger walk only what
    was made since. They were collected at each full collection, never freed: none is garbage
    that a later collection would have freed (a cycle made at start is found by one collection
    before the freeze)."""
    gc.collect()
    gc.freeze()
