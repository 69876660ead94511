"""What refshare reads from the running Ray: its session, its object store, stored sizes."""

from __future__ import annotations

import logging
import threading
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
    """The bytes the driver's node's object store must keep now: what is pinned (primary
    copies) or read (a worker's argument, mapped), which Ray can only spill, never evict;
    ``None`` if Ray does not say. One request to the node's object store (a quarter of a
    millisecond), whatever the number of refs the program holds (see :func:`plasma_usage`)."""
    try:
        return plasma_usage()["bytes in use"]
    except Exception:
        return None


class _Usage(logging.Filter):
    """Takes the one report of the object store's usage Ray logs, instead of logging it."""

    def __init__(self) -> None:
        super().__init__()
        self.text = ""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("Plasma Store Usage"):
            self.text = message
            return False
        return True


_usage_lock = threading.Lock()


def plasma_usage() -> dict[str, int]:
    """The local object store's own counts (``bytes in use``, ``bytes created by worker``,
    ...), asked of it directly by this process's core worker: one blocking request to the
    store, with no gRPC. Ray hands the answer to its log (``CoreWorker.log_plasma_usage``):
    it is taken from there, and not logged."""
    core = ray._private.worker.global_worker.core_worker  # type: ignore[attr-defined]
    raylet_logger = logging.getLogger("ray._raylet")
    usage = _Usage()
    with _usage_lock:
        # Setting a level clears every logger's cache: only where the record would be dropped.
        level = None if raylet_logger.isEnabledFor(logging.WARNING) else raylet_logger.level
        if level is not None:
            raylet_logger.setLevel(logging.WARNING)
        raylet_logger.addFilter(usage)
        try:
            core.log_plasma_usage()
        finally:
            raylet_logger.removeFilter(usage)
            if level is not None:
                raylet_logger.setLevel(level)
    counts = {}
    for line in usage.text.splitlines():
        name, colon, number = line.lstrip("- ").partition(": ")
        if colon and number.isdigit():
            counts[name] = int(number)
    return counts
