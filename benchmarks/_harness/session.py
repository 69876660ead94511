"""A small local Ray, its object store warmed, and the store's use sampled while tasks run."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import ray

T = TypeVar("T")
S = TypeVar("S")
MiB = 1 << 20


def start_ray(store_bytes: int, num_cpus: int = 2) -> None:
    """One local Ray session, sized for a 2-core machine: actors take fractions of a CPU."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        address="local",
        num_cpus=num_cpus,
        object_store_memory=store_bytes,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )


def warm_store(workers: Sequence[Any], store_bytes: int) -> float:
    """Write every page of the object store once, and map it in every worker.

    Fills 90% of the store with objects kept alive at once (so none reuses another's pages)
    and has each worker read them (``worker.touch.remote(array)``, which should read one byte
    per page: :func:`touch`), then frees them. Returns the seconds it took.
    """
    start = time.perf_counter()
    chunk_bytes = min(64 * MiB, store_bytes // 16)
    chunk = np.ones(chunk_bytes // 8)
    refs = [ray.put(chunk) for _ in range(int(0.9 * store_bytes) // chunk_bytes)]
    ray.get([w.touch.remote(ref) for ref in refs for w in workers])
    del refs
    return time.perf_counter() - start


def touch(array: np.ndarray) -> int:
    """What a worker's ``touch`` does: read one byte of every page of ``array``."""
    return int(array.reshape(-1).view(np.uint8)[::4096].sum())


def sample_during(
    action: Callable[[], T], sample: Callable[[], S], interval: float = 0.02
) -> tuple[T, list[S]]:
    """Run ``action`` while a thread calls ``sample`` every ``interval`` seconds; return its
    result and every sample, including one before and one after."""
    samples = [sample()]
    done = threading.Event()

    def sampler() -> None:
        while not done.wait(interval):
            samples.append(sample())

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    try:
        result = action()
    finally:
        done.set()
        thread.join()
    samples.append(sample())
    return result, samples


class StoreMonitor:
    """Reads the object store's usage from the cluster's available resources.

    The raylet reports usage about every 100 ms, so readings lag by that much.
    """

    def __init__(self) -> None:
        resources = ray.cluster_resources()  # type: ignore[no-untyped-call]
        self.capacity = float(resources["object_store_memory"])

    def used(self) -> float:
        available = ray.available_resources()  # type: ignore[no-untyped-call]
        return self.capacity - float(available.get("object_store_memory", 0.0))

    def settled(self, seconds: float) -> float:
        """Usage after ``seconds`` of quiet (frees and reports take that long to land)."""
        time.sleep(seconds)
        return self.used()

    def wait_until_idle(self, fraction: float = 0.05, timeout: float = 15.0) -> float:
        """Wait until at most ``fraction`` of the store is in use; return the seconds waited."""
        start = time.perf_counter()
        while self.used() > fraction * self.capacity and time.perf_counter() - start < timeout:
            time.sleep(0.1)
        return time.perf_counter() - start

    def peak_during(self, action: Callable[[], Any], interval: float = 0.02) -> float:
        """The highest usage seen while ``action`` runs."""
        return max(sample_during(action, self.used, interval)[1])


def stop_group(group: Any) -> None:
    """Kill a worker group's actors (``group.workers``) and free the placement groups of its
    ``group.resource_pool``, if it has one (verl's groups do)."""
    for actor in group.workers:
        ray.kill(actor)
    for pg in getattr(getattr(group, "resource_pool", None), "pgs", None) or ():
        ray.util.remove_placement_group(pg)
