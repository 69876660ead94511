"""A Ray cluster simulated on one machine: the driver on a head node that runs no worker,
worker nodes with an object store each, actors pinned to their node; and the way back to rest
between turns."""

from __future__ import annotations

import gc
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import _cluster_counters as counters
import ray
from ray.cluster_utils import Cluster

from _harness.report import MiB, log
from _harness.session import sample_during

T = TypeVar("T")


@dataclass
class Setup:
    """The running cluster: its nodes (driver's first), labels and workers."""

    cluster: Cluster
    nodes: list[counters.Node]
    driver: str
    labels: dict[str, str]  # node id -> "head (driver)", "node 1", ...
    workers: list[Any]
    workers_on: dict[str, int]  # label -> workers on that node
    idle: dict[str, int] = field(default_factory=dict)  # node id -> store bytes used at rest

    def by_label(self, per_node: dict[str, T]) -> dict[str, T]:
        """``per_node`` keyed by label, head first."""
        return {label: per_node[k] for k, label in self.labels.items()}


def start_cluster(
    worker_cls: Any, nodes: int, per_node: int, head_store_bytes: int, node_store_bytes: int
) -> Setup:
    """The head (driver, no CPU for workers) and ``nodes`` worker nodes, each with
    ``per_node`` actors of ``worker_cls`` (which has a ``node()`` method returning its node
    id); the driver attached to the head."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "object_store_memory": head_store_bytes,
            "include_dashboard": False,
        },
    )
    try:
        for i in range(1, nodes + 1):
            cluster.add_node(
                num_cpus=1,
                object_store_memory=node_store_bytes,
                resources={f"node{i}": per_node},
                **own_address(i),
            )
        head = cluster.head_node
        assert head is not None
        ray.init(
            address=cluster.address,
            log_to_driver=False,
            configure_logging=False,
            _node_ip_address=head.node_ip_address,
        )
        cluster.wait_for_nodes()
        if counters.driver_node_id() != head.node_id:
            raise RuntimeError("the driver attached to a worker node, not to the head")
        workers, labels = [], {head.node_id: "head (driver)"}
        for i in range(1, nodes + 1):
            group = [
                worker_cls.options(resources={f"node{i}": 1}).remote() for _ in range(per_node)
            ]
            for node_id in ray.get([w.node.remote() for w in group]):
                labels[node_id] = f"node {i}"
            workers += group
        found = counters.cluster_nodes()
        if {n.node_id for n in found} != set(labels):
            raise RuntimeError(f"nodes {[n.node_id for n in found]} are not {labels}")
        on = {label: 0 for label in labels.values()}
        for i in range(1, nodes + 1):
            on[f"node {i}"] = per_node
        setup = Setup(cluster, found, head.node_id, labels, workers, on)
        setup.idle = {k: r.used_bytes for k, r in counters.settled(found).items()}
        return setup
    except BaseException:
        stop_cluster(cluster)
        raise


def own_address(i: int) -> dict[str, str]:
    """``node_ip_address`` for worker node ``i``: a loopback address of its own where the
    machine routes all of 127.0.0.0/8 (Linux does), so that only the head has the driver's
    address (Ray 2.40 attaches a driver to any node at its address; newer Ray prefers the
    head). Elsewhere, nothing: the nodes share one address."""
    address = f"127.0.0.{i + 1}"
    try:
        with socket.socket() as probe:
            probe.bind((address, 0))
    except OSError:
        return {}
    return {"node_ip_address": address}


def stop_cluster(cluster: Cluster) -> None:
    ray.shutdown()
    cluster.shutdown()  # type: ignore[no-untyped-call]


def reset(setup: Setup, timeout: float = 30.0) -> None:
    """Drop every object the last turn kept (refshare's cache, puts) and wait until every
    node's store is back to its idle use, so each turn starts from the same state."""
    import refshare

    refshare.clear()
    gc.collect()  # refs that refshare's structures hold in reference cycles go only now
    deadline = time.monotonic() + timeout
    while True:
        used = {k: r.used_bytes for k, r in counters.read(setup.nodes).items()}
        if all(used[k] <= setup.idle[k] + MiB for k in used):
            return
        if time.monotonic() > deadline:
            log(f"stores not idle after {timeout:.0f} s: {setup.by_label(used)}")
            return
        time.sleep(0.05)


def held(setup: Setup, action: Callable[[], T]) -> tuple[T, dict[str, int]]:
    """Run ``action`` while each node's store use is sampled; return its result and each
    node's peak use above idle (by label)."""
    result, samples = sample_during(action, lambda: counters.read(setup.nodes))
    peak = {k: max(s[k].used_bytes for s in samples) - setup.idle[k] for k in setup.labels}
    return result, setup.by_label(peak)
