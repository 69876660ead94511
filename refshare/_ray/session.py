"""What refshare reads from the running Ray: its session, its object store, stored sizes."""

from __future__ import annotations

from typing import Any

import ray


def current_session() -> tuple[str, str] | None:
    """Name the connected Ray session, or return ``None`` when Ray is not running.

    Refs die with the driver connection that made them. The job id alone repeats across
    sessions (every new cluster starts at job 1), and the node id alone repeats when a
    driver reconnects to the same cluster; the pair is unique to one connection.
    """
    if not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    return context.get_node_id(), context.get_job_id()


def local_object_store_bytes() -> int | None:
    """Size of the object store on the driver's node, or ``None`` if Ray does not say."""
    try:
        node_id = ray.get_runtime_context().get_node_id()
        for node in ray.nodes():  # type: ignore[no-untyped-call]
            if node.get("NodeID") == node_id:
                return int(node["Resources"]["object_store_memory"])
    except Exception:
        return None
    return None


def stored_bytes(ref: Any, default: int) -> int:
    """The bytes Ray's object store holds for an object this process just put (read from
    this process's own core worker, no RPC); ``default`` where Ray does not say."""
    try:
        from ray.experimental import get_local_object_locations

        return int(get_local_object_locations([ref])[ref]["object_size"])
    except Exception:
        return default
