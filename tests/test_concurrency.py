"""Many threads and many asyncio tasks calling decorated functions at once, with distinct and
with shared arguments: every worker gets its own value (read back from a per-call marker in
the array content), and the cache stays within budget and consistent."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import internals
import numpy as np
import pytest
import ray
from reliability_kit import MiB, assert_cache_consistent, marked, sinks, summary

import refshare

pytestmark = pytest.mark.usefixtures("local_ray", "fresh")

OWN = 256 * 1024  # a distinct argument per call
SHARED = MiB  # one argument every call sends


@pytest.fixture(scope="module")
def group(local_ray: None) -> list[Any]:
    return sinks(3)


def test_threads_with_distinct_and_shared_arguments(group: list[Any]) -> None:
    cache = refshare.RefCache(max_bytes=4 * MiB)  # small: evictions race with lookups
    common = marked(1, SHARED)
    start = threading.Barrier(8)

    @refshare.shared_args(cache=cache)
    def call(marker: int) -> Any:
        own = marked(marker, OWN)
        worker = group[marker % len(group)]
        return ray.get(worker.apply.remote(summary, own, common), timeout=60)

    def thread(index: int) -> list[tuple[int, Any]]:
        start.wait(timeout=60)
        return [(m, call(m)) for m in range(1000 * (index + 1), 1000 * (index + 1) + 6)]

    with ThreadPoolExecutor(8) as pool:
        results = [r for f in [pool.submit(thread, i) for i in range(8)] for r in f.result(120)]

    assert len(results) == 48
    for marker, received in results:
        assert received == summary(marked(marker, OWN), common), marker
    stats = refshare.stats()
    assert stats.puts + stats.hits == 96
    assert stats.puts <= 48 + 8  # each distinct content once; the common one at most per thread
    assert stats.evictions > 0
    assert_cache_consistent(cache)


class Coordinator:
    """Driver-side async code: each call fans out and awaits the refs."""

    def __init__(self, workers: list[Any], common: Any) -> None:
        self.workers = workers
        self.common = common

    @refshare.shared_args
    async def run(self, marker: int) -> list[Any]:
        own = marked(marker, OWN)
        await asyncio.sleep(0)  # let the other tasks start their scopes in between
        refs = [w.apply.remote(summary, own, self.common) for w in self.workers]
        return await asyncio.gather(*refs)


def test_concurrent_asyncio_tasks_keep_their_own_arguments(group: list[Any]) -> None:
    common = marked(2, SHARED)
    coordinator = Coordinator(group, common)

    async def main() -> list[list[Any]]:
        calls = [coordinator.run(marker) for marker in range(100, 124)]
        results = await asyncio.wait_for(asyncio.gather(*calls), timeout=120)
        big = marked(3, OWN)
        assert ray.put(big) != ray.put(big)  # no scope leaks into the caller's task
        return results

    results = asyncio.run(main())
    for marker, received in zip(range(100, 124), results, strict=True):
        assert received == [summary(marked(marker, OWN), common)] * len(group), marker
    stats = refshare.stats()
    assert stats.puts == 24 + 1  # each own array once, the common one once
    assert stats.hits == 24 * 3 * 2 - stats.puts


def test_to_thread_inside_one_scope(group: list[Any]) -> None:
    # asyncio.to_thread copies the context: eight threads use one scope at the same time.
    common = marked(3, SHARED)

    def submit(marker: int) -> Any:
        return group[marker % 3].apply.remote(summary, marked(marker, OWN), common)

    @refshare.shared_args
    async def many() -> list[Any]:
        refs = await asyncio.gather(*(asyncio.to_thread(submit, m) for m in range(200, 216)))
        return await asyncio.gather(*refs)

    results = asyncio.run(asyncio.wait_for(many(), timeout=120))
    assert results == [summary(marked(m, OWN), common) for m in range(200, 216)]
    assert refshare.stats().puts >= 17  # the common array may be put by two racing threads
    assert_cache_consistent(internals.process_cache())


@ray.remote(num_cpus=0.1)
class AsyncFanOut:
    """An async actor whose decorated method fans out to other actors, many calls at once."""

    @refshare.shared_args
    async def run(self, workers: list[Any], marker: int) -> list[Any]:
        own = marked(marker, OWN)
        common = marked(4, SHARED)
        await asyncio.sleep(0.01)
        refs = [w.apply.remote(summary, own, common) for w in workers]
        return await asyncio.gather(*refs)

    def stats(self) -> tuple[int, ...]:
        return tuple(refshare.stats())


def test_an_async_actor_fanning_out_concurrently(group: list[Any]) -> None:
    actor = AsyncFanOut.options(max_concurrency=16).remote()
    results = ray.get([actor.run.remote(group, m) for m in range(300, 316)], timeout=120)
    for marker, received in zip(range(300, 316), results, strict=True):
        assert received == [summary(marked(marker, OWN), marked(4, SHARED))] * 3, marker
    puts, hits = ray.get(actor.stats.remote(), timeout=60)[:2]
    ray.kill(actor)
    assert puts + hits == 16 * 3 * 2
    assert puts <= 16 + 16  # own arrays once; the common one at most once per call


def test_a_pool_putting_chunks_that_share_a_member_stores_it_once(group: list[Any]) -> None:
    """verl's parallel_put: chunks put from a thread pool at once, each with new members and
    one content they all share (an all-ones mask). Split into members, the shared one is
    stored once, however the threads interleave, and each chunk arrives as by value."""
    common = marked(2, SHARED)
    start = threading.Barrier(4)

    @refshare.shared_args(deep=True)
    def parallel_put(chunks: list[dict[str, Any]]) -> list[Any]:
        def put(chunk: dict[str, Any]) -> Any:
            start.wait(timeout=30)
            return ray.put(chunk)

        with ThreadPoolExecutor(4) as pool:
            return list(pool.map(put, chunks))

    for step in range(3):
        chunks = [{"own": marked(10 * step + i, SHARED), "mask": common} for i in range(4)]
        refshare.clear()
        refshare.reset_stats()
        refs = parallel_put(chunks)
        stats = refshare.stats()
        # four own members and the mask once, in one or more objects; four skeletons
        assert stats.bytes_put < 5 * SHARED + 4 * 64 * 1024, (step, stats)
        received = [summary(c["own"], c["mask"]) for c in ray.get(refs)]
        assert received == [summary(c["own"], c["mask"]) for c in chunks]


def _fan_out_in_order(order: list[int], budget: int) -> list[tuple[int, int]]:
    """verl's ``parallel_put`` in a decorated call: each chunk put from a thread pool, the
    jobs let run one after another in ``order``. Four steps of four calls, each step a new
    batch of two chunks that share one member, each call adding a new member to both (the
    legacy trainer's growing batch). Per step: bytes repeated and puts, from the report;
    the chunks read back from their refs are checked against what was put."""
    cache = refshare.RefCache(max_bytes=budget)

    @refshare.shared_args(cache=cache)
    def parallel_put(chunks: list[dict[str, Any]]) -> list[Any]:
        turns = [threading.Event() for _ in chunks]

        def put(index: int) -> Any:
            turns[index].wait(timeout=60)
            ref = ray.put(chunks[index])
            after = order.index(index) + 1
            if after < len(order):
                turns[order[after]].set()
            return ref

        with ThreadPoolExecutor(len(chunks)) as pool:
            futures = [pool.submit(put, index) for index in range(len(chunks))]
            turns[order[0]].set()
            return [future.result(timeout=60) for future in futures]

    def content(seed: int, nbytes: int) -> Any:
        return np.random.default_rng(seed).integers(0, 255, nbytes, dtype=np.uint8)

    refshare.reset_report()
    per_step = []
    for step in range(4):
        shared = content(1000 + step, 190_000)
        a = {
            "shared": shared,
            "a1": content(10 * step, 300_000),
            "a2": content(10 * step + 1, 500_000),
        }
        b = {
            "shared": shared,
            "b1": content(10 * step + 2, 330_000),
            "b2": content(10 * step + 3, 540_000),
        }
        for call in range(4):
            a = {**a, f"new{call}": content(100 * step + 2 * call + 5, 60_000)}
            b = {**b, f"new{call}": content(100 * step + 2 * call + 6, 60_000)}
            for sent, got in zip((a, b), ray.get(parallel_put([a, b]), timeout=60), strict=True):
                assert sent.keys() == got.keys()
                assert all(np.array_equal(sent[k], got[k]) for k in sent)
        rows = refshare.report().rows
        per_step.append((sum(r.bytes_repeated for r in rows), sum(r.puts for r in rows)))
    return per_step


@pytest.mark.parametrize("budget", [64 * MiB, 6 * MiB])
def test_what_sharing_saves_does_not_depend_on_which_pool_put_ran_first(budget: int) -> None:
    """A pool's jobs are one moment: none learns from what its siblings sent (which kinds
    repeat), and the cache's clock is read once for all of them, so whichever the pool runs
    first, sharing keeps the same, and an audit (another run) can foretell it."""
    first = _fan_out_in_order([0, 1], budget)
    second = _fan_out_in_order([1, 0], budget)
    assert first == second
