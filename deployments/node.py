"""This process's Ray node id: the key of the node's model-file cache
(``runtime.contract.node_cache``), so that replicas of one node share a download and the
nodes of a local cluster, which share a filesystem, still fetch once each."""

from __future__ import annotations

import ray


def node_id() -> str | None:
    """The Ray node id of this process (None outside Ray: the cache keys by host name)."""
    if not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_node_id()
