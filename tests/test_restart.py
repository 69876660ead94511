"""Ray shut down and started again in the same process: refshare never hands out a ref from
an old session, and what a worker receives is right in every session."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import ray
from conftest import restart_local_ray, start_local_ray
from internals import process_cache
from reliability_kit import MiB, assert_cache_consistent, marked, sinks, summary

import refshare

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh")]

#: Object store per session (None: the suite's running Ray), so the default budget, a
#: quarter of it, can be told apart.
STORES = (None, 96 * MiB, 112 * MiB)
Restart = Callable[[int | None], None]


@pytest.fixture(scope="module")
def restart() -> Iterator[Restart]:
    """Stop whatever Ray runs and start a fresh local one with the given object store."""

    def restart_(store: int | None) -> None:
        if store is None:
            start_local_ray()
        else:
            restart_local_ray(store)

    yield restart_
    restart_local_ray()


def fan_out(actors: list[Any], *arrays: Any) -> list[Any]:
    return ray.get([a.apply.remote(summary, *arrays) for a in actors], timeout=60)


shared_fan_out = refshare.shared_args(fan_out)


def test_same_content_is_put_again_in_every_new_session(restart: Restart) -> None:
    mine = refshare.RefCache(max_bytes=8 * MiB)
    mine_fan_out = refshare.shared_args(cache=mine)(fan_out)
    a, b, c = marked(1, MiB), marked(2, MiB), marked(3, MiB)
    cache = process_cache()

    for store in STORES:
        restart(store)
        group = sinks(2)
        before = refshare.stats()

        assert shared_fan_out(group, a) == [summary(a)] * 2
        after = refshare.stats()
        # Put again in this session (the old session's ref is never reused), then shared.
        assert (after.puts, after.hits) == (before.puts + 1, before.hits + 1)
        # Only this session's entry is left: b and c of the last session are gone.
        assert list(cache) == [refshare.fingerprint(a)]
        assert cache.max_bytes == ray.cluster_resources()["object_store_memory"] // 4

        assert mine_fan_out(group, a) == [summary(a)] * 2
        assert list(mine) == [refshare.fingerprint(a)]
        assert refshare.stats().puts == after.puts + 1  # its own cache: put once more

        assert ray.get(refshare.share(a), timeout=60).tobytes() == a.tobytes()
        assert shared_fan_out(group, b, c) == [summary(b, c)] * 2
        assert len(cache) == 3
        assert_cache_consistent(cache)
        assert_cache_consistent(mine)
        for actor in group:
            ray.kill(actor)
    assert refshare.stats().puts == 4 * len(STORES)


def test_restart_inside_one_decorated_call(restart: Restart) -> None:
    restart(None)
    a = marked(4, MiB)

    @refshare.shared_args
    def across_a_restart() -> tuple[list[Any], list[Any]]:
        first = fan_out(sinks(1), a)
        restart(STORES[-1])
        second = fan_out(sinks(1), a)  # by value this works: Ray is running again
        return first, second

    assert across_a_restart() == ([summary(a)], [summary(a)])


def test_a_put_after_a_restart_inside_one_block_is_of_the_live_session(restart: Restart) -> None:
    restart(None)
    z = marked(6, MiB)
    with refshare.sharing():
        first = ray.put(z)
        assert ray.get(first, timeout=60).tobytes() == z.tobytes()
        restart(STORES[-1])
        again = ray.put(z)  # the scope's ref is of the old session: stored anew
        assert ray.get(again, timeout=60).tobytes() == z.tobytes()
        assert ray.put(z) == again  # and shared within the new session
    stats = refshare.stats()
    assert (stats.puts, stats.hits) == (2, 1)


def batch_summary(batch: dict[str, Any]) -> list[tuple[int, int, int]]:
    return summary(batch["a"], batch["b"])


def test_deep_members_are_stored_again_in_a_new_session(restart: Restart) -> None:
    @refshare.shared_args(deep=True)
    def deep_fan_out(actors: list[Any], batch: dict[str, Any]) -> list[Any]:
        return ray.get([a.apply.remote(batch_summary, batch) for a in actors], timeout=60)

    batch = {"a": marked(4, MiB), "b": marked(5, MiB), "step": 1}
    for store in STORES[:2]:
        restart(store)
        group = sinks(2)
        before = refshare.stats()
        assert deep_fan_out(group, batch) == [summary(batch["a"], batch["b"])] * 2
        after = refshare.stats()
        # Both members, put again in this session (together, in one object).
        assert after.puts - before.puts == 1
        assert after.bytes_put - before.bytes_put == batch["a"].nbytes + batch["b"].nbytes
