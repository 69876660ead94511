"""Two nodes on one machine: refs put by the driver reach actors on either node, and the bytes
copied between the nodes are what refshare promises, counted by each raylet."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
from conftest import start_cluster, start_local_ray
from helpers import Payload, Worker, count_payload_serializations
from ray.cluster_utils import Cluster

import refshare

# The cluster benchmark's byte counting (Ray and the standard library only), so that this test
# checks the very code the benchmark measures with.
sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _cluster_counters as counters

#: Several nodes on this machine: heavy, left to `pytest -m slow` (.ci/run runs it).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[Cluster]:
    ray.shutdown()
    cluster = start_cluster(
        {"num_cpus": 1, "object_store_memory": 256 << 20, "resources": {"head": 1}},
        {"num_cpus": 1, "object_store_memory": 256 << 20, "resources": {"second": 1}},
    )
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    cluster.wait_for_nodes()
    count_payload_serializations()
    yield cluster
    ray.shutdown()
    cluster.shutdown()
    start_local_ray()


@pytest.mark.verify_off  # counts serializations, which verify adds to
@pytest.mark.usefixtures("fresh")
def test_fan_out_across_two_nodes(two_nodes: Cluster) -> None:
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    group = [Worker.options(resources={node: 0.1}).remote() for node in ("head", "second") * 2]
    node_ids = ray.get(
        [w.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()) for w in group]
    )
    assert len(set(node_ids)) == 2

    @refshare.shared_args
    def broadcast(batch: Any, weights: np.ndarray) -> list[Any]:
        return ray.get([w.receive.remote(batch, weights=weights) for w in group])

    by_value = ray.get([w.receive.remote(Payload.filled(4), weights=np.arange(1e5)) for w in group])
    before = Payload.serialized
    for _ in range(2):
        assert broadcast(Payload.filled(4), np.arange(1e5)) == by_value
    # Keyed by its own pickle: in the first call once to key and store and once more to
    # learn it pickles alike; in the second, a new object with the same content, once to
    # key it, found in the cache.
    assert Payload.serialized - before == 3
    assert refshare.stats().puts == 2 and refshare.stats().hits == 2 * len(group) * 2 - 2
    for w in group:
        ray.kill(w)


@pytest.mark.usefixtures("fresh")
def test_deep_sharing_across_two_nodes(two_nodes: Cluster) -> None:
    group = [Worker.options(resources={node: 0.1}).remote() for node in ("head", "second")]
    batch = {"input_ids": np.arange(1 << 17), "mask": np.ones(1 << 17), "step": 3}

    @refshare.shared_args(deep=True)
    def broadcast(value: Any) -> list[Any]:
        return ray.get([w.receive.remote(value) for w in group])

    by_value = ray.get([w.receive.remote(batch) for w in group])
    assert broadcast(batch) == by_value
    grown = dict(batch, old_log_probs=np.zeros(1 << 17))
    assert broadcast(grown) == ray.get([w.receive.remote(grown) for w in group])
    stats = refshare.stats()  # two members, in one object, then only the new one
    assert (stats.puts, stats.bytes_put) == (2, 3 * 8 << 17), stats
    for w in group:
        ray.kill(w)


@pytest.mark.verify_off  # counts the bytes Ray stores, which verify's puts add to
@pytest.mark.usefixtures("fresh")
def test_bytes_copied_between_nodes(two_nodes: Cluster) -> None:
    """Both nodes hold workers, one of them also the driver. By value each worker on the
    other node pulls its own copy ((workers on other nodes) x size); refshare's first sight
    copies once to the other node ((nodes holding a worker - 1) x size); a repeat copies
    nothing. The raylets' counters say so, to the byte, and object locations agree."""
    reason = counters.supported()
    if reason is not None:
        pytest.skip(reason)
    group = [
        Worker.options(resources={node: 0.1}).remote() for node in ("head", "second", "second")
    ]
    node_of = ray.get(  # also waits for every actor to start (a start stores 8 bytes)
        [w.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()) for w in group]
    )
    nodes, driver = counters.cluster_nodes(), counters.driver_node_id()
    assert len(nodes) == 2 and nodes[0].node_id == driver and len(set(node_of)) == 2
    remote_workers = sum(node != driver for node in node_of)  # 2 if the driver is on the head
    value = np.random.default_rng(7).random(1 << 19)  # 4 MiB
    size_ref = ray.put(value)
    size = counters.locations([size_ref])[size_ref][1]
    assert value.nbytes < size < value.nbytes + 4096  # data and Ray's metadata
    del size_ref

    @refshare.shared_args
    def broadcast(x: np.ndarray) -> list[Any]:
        return ray.get([w.receive.remote(x) for w in group])

    by_value, created = counters.counted(
        nodes, lambda: ray.get([w.receive.remote(value) for w in group])
    )
    assert created[driver] == 3 * size  # Ray stores the argument once per .remote()
    assert counters.between_nodes(created, driver) == remote_workers * size

    refshare.clear()
    received, created = counters.counted(nodes, lambda: broadcast(value))
    assert received == by_value
    assert created[driver] == size
    assert counters.between_nodes(created, driver) == size
    ref = refshare.share(value)  # found in the cache: puts nothing
    assert refshare.stats().puts == 1
    assert counters.copied_settled([ref], {}, driver) == size

    before = counters.locations([ref])
    received, created = counters.counted(nodes, lambda: broadcast(value))
    assert received == by_value
    assert created == {node.node_id: 0 for node in nodes}
    assert counters.copied_settled([ref], before, driver) == 0
    for w in group:
        ray.kill(w)
