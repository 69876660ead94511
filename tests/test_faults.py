"""Faults around a decorated call: a worker killed mid fan-out, a failing ``ray.put``, an
internal error, a body that raises. The caller sees what Ray alone gives, the other workers
get the right data, and the cache stays consistent and usable."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import internals
import numpy as np
import pytest
import ray
from conftest import init_local_ray, start_local_ray
from internals import process_cache
from reliability_kit import (
    MiB,
    assert_cache_consistent,
    by_value_and_shared,
    marked,
    sinks,
    summary,
)

import refshare


def fan_out_killing(actors: list[Any], victim: Any, data: Any, in_flight: bool) -> list[Any]:
    """Send ``data`` to every actor; kill ``victim`` before its call, or while it runs."""
    refs = []
    for actor in actors:
        if actor is victim and not in_flight:
            ray.kill(victim, no_restart=True)
        refs.append(actor.later.remote(0.5 if in_flight else 0.0, summary, data))
    if in_flight:
        ray.kill(victim, no_restart=True)
    return refs


def outcomes(refs: list[Any]) -> list[Any]:
    results = []
    for ref in refs:
        try:
            results.append(ray.get(ref, timeout=60))
        except Exception as error:
            results.append(error)
    return results


@pytest.mark.usefixtures("local_ray", "fresh")
class TestOnTheSuitesRay:
    @pytest.fixture(scope="class")
    def survivors(self, local_ray: None) -> list[Any]:
        return sinks(2)

    @pytest.mark.parametrize("in_flight", [False, True], ids=["before", "in-flight"])
    def test_an_actor_killed_mid_fan_out(self, survivors: list[Any], in_flight: bool) -> None:
        data = marked(11, MiB)
        results = {}
        for mode in ("by value", "shared"):
            victim = sinks(1)[0]
            actors = [survivors[0], victim, survivors[1]]
            call = refshare.shared_args(fan_out_killing) if mode == "shared" else fan_out_killing
            results[mode] = outcomes(call(actors, victim, data, in_flight))

        for mode, (first, died, last) in results.items():
            assert first == last == summary(data), mode
            assert isinstance(died, ray.exceptions.RayActorError), mode
        assert type(results["shared"][1]) is type(results["by value"][1])

        # The cache holds the one content, and the next call is served from it.
        cache = process_cache()
        assert list(cache) == [refshare.fingerprint(data)]
        assert_cache_consistent(cache)
        puts = refshare.stats().puts
        again = refshare.shared_args(fan_out_killing)(
            [*survivors, sinks(1)[0]], None, marked(11, MiB), False
        )
        assert ray.get(again, timeout=60) == [summary(data)] * 3
        assert refshare.stats().puts == puts == 1

    def test_a_failing_put_goes_by_value(
        self, survivors: list[Any], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        def full(*args: Any, **kwargs: Any) -> Any:
            raise ray.exceptions.ObjectStoreFullError("injected")

        data = marked(12, MiB)

        @refshare.shared_args
        def send() -> list[Any]:
            return ray.get([w.apply.remote(summary, data) for w in survivors], timeout=60)

        monkeypatch.setattr(internals.call_store, "raw_put", full)  # Ray's put, beneath refshare
        assert send() == [summary(data)] * 2
        assert refshare.stats().by_value == 2 and refshare.stats().puts == 0
        assert len(process_cache()) == 0

        monkeypatch.undo()
        assert send() == [summary(data)] * 2
        assert refshare.stats()[:2] == (1, 1)  # puts, hits: working again

    def test_an_internal_error_goes_by_value(
        self, survivors: list[Any], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("injected")

        monkeypatch.setattr(internals.call_memo, "identify", broken)
        data = marked(13, MiB)
        by_value, shared = by_value_and_shared(
            lambda: ray.get(survivors[0].apply.remote(summary, data), timeout=60)
        )
        assert shared == by_value == ("ok", summary(data))
        assert refshare.stats() == refshare.Stats()

    def test_a_task_that_raises_leaves_the_cache_usable(self, survivors: list[Any]) -> None:
        data = marked(14, MiB)
        by_value, shared = by_value_and_shared(
            lambda: ray.get(survivors[0].apply.remote(np.reshape, data, (7, -1)), timeout=60)
        )
        assert shared[0] == by_value[0] == "raised"
        assert shared == by_value  # the same RayTaskError(ValueError)
        assert refshare.stats().puts == 1
        _, shared = by_value_and_shared(
            lambda: ray.get(survivors[1].apply.remote(summary, data), timeout=60)
        )
        assert shared == ("ok", summary(data))
        assert refshare.stats()[:2] == (1, 1)

    def test_a_body_that_raises_ends_its_scope(self, survivors: list[Any]) -> None:
        data = marked(15, MiB)

        @refshare.shared_args
        def fails_after_submitting() -> None:
            survivors[0].apply.remote(summary, data)
            raise KeyError("boom")

        with pytest.raises(KeyError):
            fails_after_submitting()
        assert refshare.stats().puts == 1
        # Outside any scope again: by value, nothing more counted.
        assert ray.get(survivors[1].apply.remote(summary, data), timeout=60) == summary(data)
        assert refshare.stats().puts == 1 and refshare.stats().hits == 0


@pytest.mark.slow
@pytest.mark.usefixtures("fresh")
class TestAStoreThatCannotHoldTheArgument:
    """An 80 MiB object store whose disk counts as full: a 120 MiB argument cannot be stored,
    by value or by ``ray.put``."""

    @pytest.fixture(scope="class")
    def full_store(self) -> Iterator[Any]:
        ray.shutdown()
        init_local_ray(
            num_cpus=1,
            object_store_memory=80 * MiB,
            _system_config={"local_fs_capacity_threshold": 0.0},
        )
        yield sinks(1)[0]
        ray.shutdown()
        start_local_ray()

    def test_the_caller_gets_the_error_ray_by_value_gives(self, full_store: Any) -> None:
        huge = marked(16, 120 * MiB)
        by_value, shared = by_value_and_shared(
            lambda: ray.get(full_store.apply.remote(summary, huge), timeout=60)
        )
        assert by_value == ("raised", "OutOfDiskError")
        assert shared == by_value
        assert refshare.stats().by_value == 1 and refshare.stats().puts == 0
        assert len(process_cache()) == 0

        # What fits is still shared, and received right.
        small = marked(17, 8 * MiB)
        by_value, shared = by_value_and_shared(
            lambda: ray.get(full_store.apply.remote(summary, small), timeout=60)
        )
        assert shared == by_value == ("ok", summary(small))
        assert refshare.stats().puts == 1
        assert_cache_consistent(process_cache())
