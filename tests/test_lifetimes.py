"""Lifetimes stay Ray's: what refshare keeps is weighed by what the object store holds for
it, and a value holding refs or actor handles never outlives what by value would keep."""

from __future__ import annotations

import gc
import re
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import ray
from reliability_kit import MiB, marked, sinks

import refshare

pytestmark = pytest.mark.usefixtures("local_ray", "fresh")


def plasma_mib() -> int:
    """MiB of object store in use on this node, as Ray reports it."""
    from ray._private.internal_api import memory_summary

    address = ray.get_runtime_context().gcs_address
    found = re.search(r"Plasma memory usage (\d+) MiB", memory_summary(address, stats_only=True))
    return int(found.group(1)) if found else 0


def eventually(condition: Callable[[], bool], timeout: float = 30.0) -> bool:
    """Whether ``condition`` holds within ``timeout`` seconds (Ray frees asynchronously)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


@ray.remote(num_cpus=0.01)
class Probe:
    """A named actor: alive exactly while some handle to it lives."""

    def ping(self) -> bool:
        return True


def actor_alive(name: str) -> bool:
    try:
        ray.get_actor(name)
    except ValueError:
        return False
    return True


@ray.remote(num_cpus=0.05)
def touch(value: Any) -> int:
    """Use what was received: the handle and the array inside a list."""
    handle, data = value
    return int(ray.get(handle.ping.remote())) + int(data.size > 0)


@pytest.mark.parametrize(
    "options", [{"deep": False}, {}, {"deep": True}], ids=["top-level", "default", "deep"]
)
def test_dropping_the_last_handle_ends_the_actor_as_by_value(options: dict[str, Any]) -> None:
    for round_, shared in enumerate((False, True)):
        name = f"probe-{options.get('deep', False)}-{round_}"
        handle = Probe.options(name=name).remote()
        value = [handle, np.ones(1 << 18)]  # 2 MiB, and the handle inside

        def send(value: Any = value) -> list[int]:
            return ray.get([touch.remote(value) for _ in range(2)], timeout=60)

        result = refshare.shared_args(**options)(send)() if shared else send()
        assert result == [2, 2]
        del handle, value, send
        gc.collect()
        assert eventually(lambda name=name: not actor_alive(name)), (name, shared)
    # Split (by default too: what holds the handle goes with the task), the array is a member.
    assert refshare.stats().puts == (0 if options.get("deep") is False else 1)


@ray.remote(num_cpus=0.05)
def open_inner(value: Any) -> float:
    return float(ray.get(value[0]).sum()) + float(value[1].sum())


@pytest.mark.parametrize(
    "options", [{"deep": False}, {}, {"deep": True}], ids=["top-level", "default", "deep"]
)
def test_an_object_nested_in_a_sent_value_is_freed_when_the_program_drops_it(
    options: dict[str, Any],
) -> None:
    gc.collect()
    before = plasma_mib()
    for shared in (False, True):
        inner = ray.put(np.ones(48 * MiB // 8))
        value = [inner, np.ones(1 << 18)]

        def send(value: Any = value) -> list[float]:
            return ray.get([open_inner.remote(value) for _ in range(2)], timeout=60)

        result = refshare.shared_args(**options)(send)() if shared else send()
        assert result == [48 * MiB / 8 + (1 << 18)] * 2
        del inner, value, send
        gc.collect()
        assert eventually(lambda: plasma_mib() < before + 24), (before, plasma_mib(), shared)


def test_the_budget_counts_what_the_store_holds_for_a_value() -> None:
    """A list whose size estimate stops at its first ten thousand items weighs what Ray
    stored of it, so the cache stays within its budget."""
    cache = refshare.RefCache(max_bytes=20 * MiB)
    group = sinks(1)

    @refshare.shared_args(cache=cache)
    def send(value: Any) -> Any:
        return ray.get(group[0].apply.remote(len, value), timeout=60)

    gc.collect()
    before = plasma_mib()
    for marker in range(8):
        # Sized from its first ten thousand items: about 300 KiB, where Ray stores 8 MiB.
        value = [marked(marker, 256 << 10), *range(10_000), marked(marker, 8 * MiB)]
        assert refshare.estimate_size(value) < MiB
        assert send(value) == len(value)
        assert cache.nbytes <= cache.max_bytes
    del value
    gc.collect()
    assert len(cache) == 2  # two values of 8.3 MiB fit in 20 MiB
    assert eventually(lambda: plasma_mib() <= before + 20), (before, plasma_mib())


@ray.remote(num_cpus=0.05)
def sizes(batch: dict[str, Any]) -> list[int]:
    return [batch["big"].size, len(batch["small"])]


def test_a_deep_skeleton_weighs_the_members_it_keeps_alive() -> None:
    cache = refshare.RefCache(max_bytes=64 * MiB)
    deep = refshare.shared_args(deep=True, cache=cache)(
        lambda batch: ray.get(sizes.remote(batch), timeout=60)
    )
    # Many small members stay inside the skeleton, so it is stored and cached itself; its
    # object holds the refs of the large member, which lives as long as the skeleton does.
    small = [np.full(64, float(i)) for i in range(400)]
    batch = {"big": marked(1, 8 * MiB), "small": small}
    assert deep(batch) == [MiB, 400]
    assert len(cache) == 2  # the member, and the skeleton
    # The member once: the skeleton keeps it alive, but the store holds it once.
    assert 8 * MiB <= cache.nbytes < 8 * MiB + (512 << 10)
