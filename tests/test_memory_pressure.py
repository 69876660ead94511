"""A small object store and a stream of distinct large arguments far beyond the cache budget:
the cache stays within budget and evicts, and every worker still receives the right data."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import re
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from conftest import restart_local_ray
from internals import process_cache
from reliability_kit import MiB, assert_cache_consistent, marked, sinks, summary

import refshare

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh")]

STORE = 200 * MiB
BUDGET = 50 * MiB
ITEM = 16 * MiB


def _store_readable() -> bool:
    from ray._raylet import CoreWorker

    return hasattr(CoreWorker, "log_plasma_usage")


#: Cases of letting go for another scope or for the program: they need Ray to say how full
#: its store is.
reads_the_store = pytest.mark.skipif(
    not _store_readable(),
    reason="this Ray's core worker cannot say how full the store is (no log_plasma_usage, "
    "as on 2.40): refshare's budgets alone bound what it keeps",
)


@pytest.fixture(scope="module")
def group() -> Iterator[list[Any]]:
    """Two workers on a local Ray whose object store is only 200 MiB."""
    restart_local_ray(STORE)
    yield sinks(2)
    restart_local_ray()


def test_a_stream_far_beyond_the_budget(group: list[Any]) -> None:
    cache = refshare.RefCache(max_bytes=BUDGET)

    @refshare.shared_args(cache=cache)
    def send(data: Any) -> list[Any]:
        return ray.get([w.apply.remote(summary, data) for w in group], timeout=60)

    for marker in range(40):  # 640 MiB in all: 13 budgets, 3 object stores
        data = marked(marker, ITEM)
        assert send(data) == [summary(data)] * 2
        assert cache.nbytes <= cache.max_bytes == BUDGET
    stats = refshare.stats()
    assert (stats.puts, stats.hits) == (40, 40)
    assert stats.evictions == 40 - BUDGET // ITEM
    assert len(cache) == BUDGET // ITEM
    assert_cache_consistent(cache)

    # The most recent content is still shared; an evicted one is put again.
    for marker, puts in ((39, 40), (0, 41)):
        data = marked(marker, ITEM)
        assert send(data) == [summary(data)] * 2
        assert refshare.stats().puts == puts


def test_eviction_while_tasks_are_in_flight_loses_nothing(group: list[Any]) -> None:
    cache = refshare.RefCache(max_bytes=BUDGET)

    @refshare.shared_args(cache=cache)
    def submit(worker: Any, data: Any) -> Any:
        return worker.later.remote(0.3, summary, data)  # the worker reads it only later

    expected, pending = [], []
    for marker in range(10):
        data = marked(100 + marker, ITEM)
        expected.append(summary(data))
        pending.append(submit(group[marker % 2], data))
        del data
    gc.collect()
    # Most refs were evicted (and the driver dropped its arrays) before any worker read them:
    # past the budget, and more as the tasks in flight filled the store.
    assert refshare.stats().evictions >= 10 - BUDGET // ITEM
    assert ray.get(pending, timeout=120) == expected
    assert_cache_consistent(cache)


def test_one_call_with_more_than_the_budget_in_flight(group: list[Any]) -> None:
    cache = refshare.RefCache(max_bytes=BUDGET)

    @refshare.shared_args(cache=cache)
    def many(arrays: list[Any]) -> list[Any]:
        refs = [group[i % 2].later.remote(0.1, summary, a) for i, a in enumerate(arrays)]
        refs += [group[i % 2].apply.remote(summary, a) for i, a in enumerate(arrays)]
        return ray.get(refs, timeout=120)

    # 64 MiB: more than the cache's budget, well within what refshare may keep of the store.
    arrays = [marked(200 + i, ITEM) for i in range(4)]
    assert many(arrays) == [summary(a) for a in arrays] * 2
    stats = refshare.stats()
    # Each content put once in the call, even the one the cache had already evicted.
    assert (stats.puts, stats.hits) == (4, 4)
    assert cache.nbytes <= BUDGET
    assert_cache_consistent(cache)


def test_a_value_larger_than_the_budget_is_shared_within_the_call_only(
    group: list[Any],
) -> None:
    cache = refshare.RefCache(max_bytes=BUDGET)
    big = marked(7, 64 * MiB)

    @refshare.shared_args(cache=cache)
    def send(data: Any) -> list[Any]:
        return ray.get([w.apply.remote(summary, data) for w in group], timeout=60)

    assert send(big) == [summary(big)] * 2
    assert send(big) == [summary(big)] * 2
    assert len(cache) == 0 and cache.nbytes == 0
    assert refshare.stats()[:2] == (2, 2)  # puts, hits: once per call, never cached


def test_the_process_cache_takes_a_quarter_of_this_store(group: list[Any]) -> None:
    @refshare.shared_args
    def send(data: Any) -> Any:
        return ray.get(group[0].apply.remote(summary, data), timeout=60)

    cache = process_cache()
    for marker in range(8):
        data = marked(300 + marker, ITEM)
        assert send(data) == summary(data)
        assert cache.nbytes <= cache.max_bytes == STORE // 4
    assert refshare.stats().evictions == 8 - (STORE // 4) // ITEM
    assert_cache_consistent(cache)


def test_a_long_block_keeps_no_more_than_the_store_of_what_it_sent(group: list[Any]) -> None:
    """A training loop inside one ``sharing()`` block sends a new batch each step and drops
    it: once the values the scope keeps pass the object store's size, it forgets them, so
    neither the driver's memory nor the store fills with every batch ever sent."""
    sent = []
    with refshare.sharing(cache=refshare.RefCache(max_bytes=BUDGET)):
        for marker in range(30):  # 480 MiB in all: 2.4 object stores
            data = marked(300 + marker, ITEM)
            sent.append(weakref.ref(data))
            assert ray.get(group[0].apply.remote(summary, data), timeout=60) == summary(data)
            del data
        gc.collect()
        alive = sum(ref() is not None for ref in sent)
    assert 1 <= alive <= STORE // ITEM + 1, alive
    assert refshare.stats().puts == 30


def spilled_mib() -> int:
    """MiB Ray has spilled to disk in this session so far."""
    from ray._private.internal_api import memory_summary

    address = ray.get_runtime_context().gcs_address
    found = re.search(r"Spilled (\d+) MiB", memory_summary(address=address, stats_only=True))
    return int(found.group(1)) if found else 0


@pytest.mark.verify_off
def test_a_training_loop_inside_one_block_spills_no_more_than_by_value(
    group: list[Any],
) -> None:
    """By value, each step's batch lives while its two tasks run; the scope must let go of
    what it sent before the store fills, or Ray spills and every step slows down."""

    def loop() -> list[Any]:
        seen = []
        for marker in range(30):  # 600 MiB of new batches: 3 object stores
            data = marked(400 + marker, 20 * MiB)
            seen.append(ray.get([w.apply.remote(summary, data) for w in group], timeout=60))
        return seen

    before = spilled_mib()
    by_value = loop()
    assert spilled_mib() == before  # the loop fits by value
    with refshare.sharing():
        shared = loop()
    assert shared == by_value
    assert spilled_mib() == before


def result_of(data: Any) -> Any:
    """What a worker returns: 8 MiB, stored in the object store and held by the driver."""
    import numpy as np

    return np.full(MiB, int(data[0]), dtype=np.int64)


@reads_the_store
@pytest.mark.verify_off
def test_a_loop_whose_program_holds_a_third_of_the_store_spills_no_more_than_by_value(
    group: list[Any],
) -> None:
    """The program keeps its last eight results (64 MiB, a third of the store) while each
    step sends a new 40 MiB batch: by value nothing spills. What refshare keeps (the
    scope's batches, the cache's) yields to what the program holds: it spills no more and
    raises nothing."""

    def loop() -> tuple[list[Any], list[int]]:
        kept: list[Any] = []
        seen = []
        for marker in range(24):  # 960 MiB of new batches: almost 5 object stores
            data = marked(500 + marker, 40 * MiB)
            kept.append(group[marker % 2].apply.remote(result_of, data))
            seen.append(ray.get(group[(marker + 1) % 2].apply.remote(summary, data), timeout=60))
            kept = kept[-8:]
            ray.wait(kept, num_returns=len(kept), timeout=60)
        return seen, [int(r[0]) for r in ray.get(kept, timeout=60)]

    before = spilled_mib()
    by_value = loop()
    assert spilled_mib() == before  # the loop fits by value
    with refshare.sharing():
        shared = loop()
    assert shared == by_value
    assert spilled_mib() == before


def in_use() -> int:
    """The bytes the object store must keep now, as the store itself counts them."""
    from refshare._ray.session import plasma_usage

    return plasma_usage()["bytes in use"]


def settled(condition: Any, timeout: float = 10.0) -> bool:
    """Whether ``condition()`` holds within ``timeout`` seconds (Ray frees objects a few
    milliseconds after their last reference goes)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@reads_the_store
@pytest.mark.parametrize("level", [logging.NOTSET, logging.ERROR])
def test_reading_the_store_leaves_rays_log_as_it_was(group: list[Any], level: int) -> None:
    """Whether the program silenced Ray's core-worker log or not, the reading counts what the
    store holds, logs nothing, and leaves the logger's level as the program set it."""
    raylet = logging.getLogger("ray._raylet")
    records: list[logging.LogRecord] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    catch, before = Catch(), raylet.level
    raylet.setLevel(level)
    raylet.addHandler(catch)
    try:
        value = ray.put(marked(1300 + level, 4 * MiB))
        held = in_use()
        assert held >= 4 * MiB
        del value
        assert settled(lambda: in_use() <= held - 4 * MiB)
        assert raylet.level == level
    finally:
        raylet.removeHandler(catch)
        raylet.setLevel(before)
    assert not [r for r in records if "Plasma" in r.getMessage()]


@reads_the_store
@pytest.mark.verify_off
def test_a_scope_lets_go_of_what_another_idle_scope_keeps(group: list[Any]) -> None:
    """Two trainers in one driver: one sends a burst inside its block and then waits, the
    other loops. Past the mark, the looping one lets go of what the idle one keeps too:
    nothing spills, as by value."""
    burst_sent, loop_done = threading.Event(), threading.Event()

    def idle() -> None:
        with refshare.sharing(cache=False):
            for marker in range(6):  # 96 MiB kept by this block while it waits (half the store)
                data = marked(700 + marker, ITEM)
                ray.get(group[0].apply.remote(summary, data), timeout=60)
            burst_sent.set()
            loop_done.wait(120)

    def loop() -> None:
        with refshare.sharing(cache=False):
            for marker in range(6):  # 384 MiB of new batches, each a third of the store
                data = marked(800 + marker, 64 * MiB)
                ray.get(group[1].apply.remote(summary, data), timeout=60)

    before = spilled_mib()
    thread = threading.Thread(target=idle)
    thread.start()
    assert burst_sent.wait(120)
    loop()
    loop_done.set()
    thread.join(120)
    assert spilled_mib() == before
    assert settled(lambda: in_use() < ITEM)


@reads_the_store
@pytest.mark.verify_off
@pytest.mark.parametrize("how", ["asyncio task", "thread pool"])
def test_what_a_scope_keeps_ends_with_it_whoever_still_runs_in_it(
    group: list[Any], how: str
) -> None:
    """A task started inside a block outlives it: what the block kept is let go of when the
    block ends, not when that task ends (the cache keeps nothing here: by value, nothing
    stays in the store)."""
    release = threading.Event()

    def linger() -> None:
        release.wait(60)

    async def block() -> Any:
        with refshare.sharing(cache=False):
            data = marked(900, 60 * MiB)
            ray.get([w.apply.remote(summary, data) for w in group], timeout=60)
            if how == "asyncio task":
                task = asyncio.get_running_loop().create_task(asyncio.to_thread(linger))
            else:
                task = pool.submit(linger)
        assert settled(lambda: in_use() < ITEM)  # the block ended: its 60 MiB are gone
        release.set()
        return await task if how == "asyncio task" else task.result(60)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        asyncio.run(block())


@reads_the_store
@pytest.mark.verify_off
def test_an_audit_lets_go_under_pressure_as_sharing_would(group: list[Any]) -> None:
    """The program holds 130 MiB of a 200 MiB store, past the mark: sharing lets go of what
    it keeps at every put, and an audit says the same of what it would keep."""
    held = [ray.put(marked(1000 + i, 10 * MiB)) for i in range(13)]
    values = [marked(1100 + i, 8 * MiB) for i in range(3)]

    def rounds(**options: Any) -> int:
        refshare.reset_report()
        cache = refshare.RefCache(max_bytes=BUDGET)
        for _ in range(4):
            for data in values:
                with refshare.sharing(cache=cache, **options):
                    ray.get(group[0].apply.remote(summary, data), timeout=60)
        return refshare.report().bytes_repeated(audit=bool(options))

    audited, shared = rounds(audit=True), rounds()
    unpressed = 3 * 3 * 8 * MiB  # without the program's 130 MiB: every round but the first
    assert shared < unpressed and audited < unpressed
    assert abs(audited - shared) <= 8 * MiB
    del held


@reads_the_store
@pytest.mark.verify_off
def test_an_audit_does_not_take_rays_copies_for_pressure(group: list[Any]) -> None:
    """The program holds 50 MiB of a 200 MiB store and, in each call, puts one 10 MiB value
    eight times before sending another: sharing stores each once (70 MiB, below the mark of
    120), Ray's own puts store eight copies (130 MiB, past it). An audit, which leaves the
    puts to Ray, weighs the store as sharing would have it: it lets go of nothing, and
    says what sharing saves, to the byte."""
    held = [ray.put(marked(1300 + i, 10 * MiB)) for i in range(5)]
    copied, sent = marked(1310, 10 * MiB), marked(1311, 10 * MiB)

    def rounds(**options: Any) -> int:
        refshare.reset_report()
        cache = refshare.RefCache(max_bytes=BUDGET)
        for _ in range(3):
            with refshare.sharing(cache=cache, **options):
                refs = [ray.put(copied) for _ in range(8)]
                ray.get(group[0].apply.remote(summary, sent), timeout=60)
                del refs
            assert settled(lambda: in_use() < 75 * MiB)  # Ray's copies have gone
        return refshare.report().bytes_repeated(audit=bool(options))

    audited, shared = rounds(audit=True), rounds()
    assert shared == (7 + 8 + 8) * 10 * MiB + 2 * 10 * MiB  # nothing let go of
    assert audited == shared
    del held


@pytest.mark.verify_off
def test_an_audit_weighs_what_sharing_would_store(group: list[Any]) -> None:
    """Four values of a quarter of the cache's budget each, cycled: stored, each weighs a
    little more (Ray's metadata), so four do not fit and the cache evicts at every put. An
    audit weighs them as the store would, and says the same."""
    values = [marked(1200 + i, BUDGET // 4) for i in range(4)]  # the default budget's quarter

    def rounds(**options: Any) -> tuple[int, int]:
        refshare.clear()
        refshare.reset_report()
        for _ in range(5):
            for data in values:
                with refshare.sharing(**options):
                    ray.get(group[0].apply.remote(summary, data), timeout=60)
        rows = refshare.report().rows
        return sum(r.bytes_repeated for r in rows), sum(r.evictions for r in rows)

    assert process_cache().max_bytes == BUDGET
    audited, shared = rounds(audit=True), rounds()
    assert audited == shared and shared[1] > 0
