"""Bytes copied between the nodes of a Ray cluster, from each raylet's object-store counters.

Every raylet counts the bytes of every object created in its store
(``cumulative_created_bytes`` of ``GetNodeStats``): the driver's puts and by-value arguments
on the driver's node, and on any other node the copies it pulled to run its tasks. While
workers put nothing and return small values (inlined in the task reply, never in a store),
the bytes one node received in a call are the growth of its counter, and the bytes copied
between nodes are that growth summed over every node but the driver's. A copy already on a
node is used again without a pull, so it counts 0. (Starting an actor stores a few bytes on
its node: count once the workers have started.)

Object locations (``ray.experimental.get_object_locations``) give the same figure for the
refs the driver can see (its puts, refshare's refs): the nodes that gained a copy times the
object's size. Here only Ray and the standard library are imported, so the tests can count
with the very code the cluster benchmark uses.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import ray

T = TypeVar("T")


@dataclass(frozen=True)
class Node:
    """One raylet: where to ask for its counters, and its object store's capacity."""

    node_id: str
    address: str
    port: int
    store_bytes: int


@dataclass(frozen=True)
class Reading:
    """One raylet's object-store counters at one moment."""

    created_bytes: int  # cumulative_created_bytes: every object ever created in the store
    created_objects: int
    used_bytes: int  # object_store_bytes_used: what the store holds now
    pulls_queued: bool


def cluster_nodes() -> list[Node]:
    """The alive nodes of the connected cluster, the driver's first."""
    driver = driver_node_id()
    found = [
        Node(n["NodeID"], n["NodeManagerAddress"], int(n["NodeManagerPort"]),
             int(n["Resources"].get("object_store_memory", 0)))
        for n in ray.nodes()  # type: ignore[no-untyped-call]
        if n["Alive"]
    ]  # fmt: skip
    return sorted(found, key=lambda n: n.node_id != driver)


def driver_node_id() -> str:
    return str(ray.get_runtime_context().get_node_id())


def supported() -> str | None:
    """Why the counters cannot be read on this Ray (``None`` when they can)."""
    try:
        from ray._private.internal_api import node_stats  # noqa: F401
        from ray.core.generated import node_manager_pb2, node_manager_pb2_grpc  # noqa: F401
    except ImportError as error:  # no grpcio: Ray 2.40 installs it only with ray[default]
        return f"cannot ask the raylets for their counters on Ray {ray.__version__}: {error}"
    stats = node_manager_pb2.ObjectStoreStats  # type: ignore[attr-defined]
    fields = {f.name for f in stats.DESCRIPTOR.fields}
    missing = {"cumulative_created_bytes", "object_store_bytes_used"} - fields
    if missing:
        return f"Ray {ray.__version__}'s ObjectStoreStats lacks {sorted(missing)}"
    return None


def read(nodes: Iterable[Node]) -> dict[str, Reading]:
    """Every node's counters now, by node id (one gRPC call to each raylet)."""
    from ray._private.internal_api import node_stats

    out = {}
    for node in nodes:
        reply = node_stats(  # type: ignore[no-untyped-call]
            node.address, node.port, include_memory_info=False
        )
        stats = reply.store_stats
        out[node.node_id] = Reading(
            int(stats.cumulative_created_bytes),
            int(stats.cumulative_created_objects),
            int(stats.object_store_bytes_used),
            bool(stats.object_pulls_queued),
        )
    return out


def settled(
    nodes: Sequence[Node], interval: float = 0.02, timeout: float = 10.0
) -> dict[str, Reading]:
    """Counters once no pull is queued and two readings ``interval`` apart agree on what
    every store created, or after ``timeout`` (a pull is counted by the time its task has
    run; this also waits out any straggler)."""
    deadline = time.monotonic() + timeout
    last = read(nodes)
    while True:
        time.sleep(interval)
        now = read(nodes)
        calm = not any(r.pulls_queued for r in now.values())
        same = all(now[k].created_bytes == last[k].created_bytes for k in now)
        if (calm and same) or time.monotonic() > deadline:
            return now
        last = now


def created(before: Mapping[str, Reading], after: Mapping[str, Reading]) -> dict[str, int]:
    """Bytes each node's store created between two readings."""
    return {k: after[k].created_bytes - before[k].created_bytes for k in after}


def between_nodes(created_bytes: Mapping[str, int], driver: str) -> int:
    """Bytes copied between nodes: what every node but the driver's created (pulled)."""
    return sum(n for node_id, n in created_bytes.items() if node_id != driver)


def counted(nodes: Sequence[Node], action: Callable[[], T]) -> tuple[T, dict[str, int]]:
    """Run ``action`` (which must wait for its tasks) and return its result with the bytes
    each node's store created meanwhile, read once the counters settled."""
    before = settled(nodes)
    result = action()
    return result, created(before, settled(nodes))


# -- the same figure from object locations, for the refs the driver can see --------------------


def locations(refs: Iterable[Any]) -> dict[Any, tuple[frozenset[str], int]]:
    """For each ref: the nodes holding a copy, and the object's size (data and metadata)."""
    refs = list(refs)
    if not refs:
        return {}
    found = ray.experimental.get_object_locations(refs)
    return {
        ref: (frozenset(found[ref]["node_ids"]), int(found[ref]["object_size"] or 0))
        for ref in refs
        if ref in found
    }


def copied(
    before: Mapping[Any, tuple[frozenset[str], int]],
    after: Mapping[Any, tuple[frozenset[str], int]],
    driver: str,
) -> int:
    """Bytes copied to other nodes than the driver's, by the locations of the refs in
    ``after``: each node that holds a copy now and did not before (a ref absent from
    ``before`` was made since) adds the object's size once."""
    total = 0
    for ref, (holders, size) in after.items():
        earlier = before.get(ref, (frozenset(), 0))[0]
        total += size * len(holders - earlier - {driver})
    return total


def copied_settled(
    refs: Sequence[Any],
    before: Mapping[Any, tuple[frozenset[str], int]],
    driver: str,
    interval: float = 0.02,
    timeout: float = 5.0,
) -> int:
    """:func:`copied` for ``refs``, read until two readings ``interval`` apart agree: each
    node reports a copy to the object's owner on its own schedule."""
    deadline = time.monotonic() + timeout
    last = copied(before, locations(refs), driver)
    while True:
        time.sleep(interval)
        now = copied(before, locations(refs), driver)
        if now == last or time.monotonic() > deadline:
            return now
        last = now
