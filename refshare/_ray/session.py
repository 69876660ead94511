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
    worker: Any = ray._private.worker.global_worker
    if getattr(worker, "connected", False):
        # What ``ray.get_runtime_context()`` reads, read directly: it runs on every
        # argument refshare stores, where Ray's public path costs several times more.
        return worker.current_node_id.hex(), worker.current_job_id.hex()
    if not ray.is_initialized():  # not connected, or connected through Ray Client
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


def local_store_used() -> int | None:
    """The bytes the driver's node's object store must keep now (what Ray would spill to
    make room, not what it can evict), or ``None`` if Ray does not say.

    The raylet's own count of primary copies where its gRPC service can be asked (one call
    of about 2 ms; the ``grpcio`` that ``ray[default]`` brings); else the objects this
    process holds a reference to, each with its size, from its own core worker (no RPC):
    what the program and refshare hold, without what other processes put on the node."""
    try:
        return _raylet_store_used()
    except Exception:
        pass
    try:
        return _referenced_bytes()
    except Exception:
        return None


_raylet: tuple[object, Any] | None = None


def _raylet_store_used() -> int:
    """The raylet's count, through a channel opened once per Ray session."""
    global _raylet
    from ray.core.generated import node_manager_pb2

    session = current_session()
    if _raylet is None or _raylet[0] != session:
        _raylet = (session, _raylet_stub())
    request = node_manager_pb2.GetNodeStatsRequest(  # type: ignore[attr-defined]
        include_memory_info=False
    )
    stats = _raylet[1].GetNodeStats(request, timeout=5.0).store_stats
    # Primary copies are what Ray spills and cannot evict; the rest of what the store holds
    # (copies no reference keeps) it evicts when it needs the room.
    return int(stats.object_store_bytes_primary_copy)


def _raylet_stub() -> Any:
    # Ray's own channel: it carries the cluster's authentication token, where there is one.
    from ray._private.grpc_utils import init_grpc_channel
    from ray.core.generated import node_manager_pb2_grpc

    node: Any = ray._private.worker.global_worker.node
    channel = init_grpc_channel(f"{node.node_ip_address}:{node.node_manager_port}")
    return node_manager_pb2_grpc.NodeManagerServiceStub(channel)  # type: ignore[no-untyped-call]


def _referenced_bytes() -> int:
    from ray.experimental import get_local_object_locations

    core = ray._private.worker.global_worker.core_worker  # type: ignore[attr-defined]
    ids = core.get_all_reference_counts()
    refs: list[Any] = [ray.ObjectRef(bytes.fromhex(i.decode())) for i in ids]
    found = get_local_object_locations(refs)
    return sum(int((found.get(ref) or {}).get("object_size") or 0) for ref in refs)
