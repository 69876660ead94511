"""Two nodes on one machine: refs put by the driver reach actors on either node."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import ray
from conftest import start_local_ray
from helpers import Payload, Worker, count_payload_serializations
from ray.cluster_utils import Cluster

import refshare


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[Cluster]:
    ray.shutdown()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "object_store_memory": 256 << 20, "resources": {"head": 1}},
    )
    cluster.add_node(num_cpus=1, object_store_memory=256 << 20, resources={"second": 1})
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    cluster.wait_for_nodes()
    count_payload_serializations()
    yield cluster
    ray.shutdown()
    cluster.shutdown()
    start_local_ray()


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
    assert Payload.serialized - before == 1
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
    assert refshare.stats().puts == 3  # two members, then only the new one
    for w in group:
        ray.kill(w)
