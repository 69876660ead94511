"""The default (``deep=None``): a value is split into its members where they are sent again,
and stored whole, in one put, where they are not; what a worker receives is the same."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import ray
from helpers import Worker

import refshare

pytestmark = pytest.mark.usefixtures("local_ray", "fresh")

MEMBER = 1 << 17  # float64 elements: 1 MiB


def member(fill: float) -> np.ndarray:
    return np.full(MEMBER, fill)


@pytest.fixture(scope="module")
def workers(local_ray: None) -> list[Any]:
    group = [Worker.remote() for _ in range(2)]
    ray.get([w.receive.remote() for w in group])
    return group


def fan_out(workers: list[Any], batch: Any) -> list[Any]:
    return ray.get([w.receive.remote(batch) for w in workers])


default = refshare.shared_args(fan_out)


def step(workers: list[Any], seed: float) -> list[tuple[int, int, int]]:
    """One RL step: a new batch, then the same batch with one key more. Per call: objects
    put, hits, and members' worth of bytes put."""
    counts = []
    batch = {"input_ids": member(seed), "attention_mask": member(seed + 0.5)}
    for key in ("old_log_probs", "values"):
        before = refshare.stats()
        assert default(workers, batch) == fan_out(workers, batch)
        after = refshare.stats()
        members = (after.bytes_put - before.bytes_put) / (MEMBER * 8)
        counts.append((after.puts - before.puts, after.hits - before.hits, round(members)))
        batch = dict(batch, **{key: member(seed + len(batch))})
    return counts


def test_a_batch_growing_by_keys_is_split_once_its_members_are_sent_again(
    workers: list[Any],
) -> None:
    # The first batch is new: stored whole, in one put, found by the second worker. The
    # grown batch finds its members sent before (in the first batch): split, its three
    # members put together, in one object; the second worker is sent the same skeleton,
    # its three members found (what by value would store again).
    assert step(workers, 1.0) == [(1, 1, 2), (1, 3, 3)]
    # From the next step on, a batch of that kind is split from its first call (its new
    # members put in one object, found by the second worker), and the grown batch finds its
    # old members and puts only its new one.
    assert step(workers, 10.0) == [(1, 2, 2), (1, 5, 1)]


def test_values_whose_members_never_repeat_are_stored_whole(workers: list[Any]) -> None:
    for seed in range(6):
        batch = {"a": member(100.0 + seed), "b": member(200.0 + seed)}
        assert default(workers, batch) == fan_out(workers, batch)
    stats = refshare.stats()
    assert (stats.puts, stats.hits) == (6, 6)  # one put a value, found by the second worker


def test_deep_and_top_level_can_still_be_forced(workers: list[Any]) -> None:
    batch = {"a": member(300.0), "b": member(301.0)}
    refshare.shared_args(deep=True)(fan_out)(workers, batch)
    assert refshare.stats().puts == 1  # the members, in one object; the skeleton inline
    refshare.reset_stats()
    refshare.shared_args(deep=False)(fan_out)(workers, dict(batch, c=member(302.0)))
    assert refshare.stats().puts == 1  # the whole batch, though its members were stored


def test_the_default_is_an_option_like_the_others() -> None:
    with pytest.raises(TypeError, match="deep='yes'"):
        refshare.shared_args(deep="yes")  # type: ignore[arg-type]
    assert refshare.sharing(deep=None) is not None


def test_a_worker_without_refshare_receives_what_by_value_gives() -> None:
    from helpers import WithoutRefshare

    plain = WithoutRefshare.remote()

    def send(batch: Any) -> Any:
        return ray.get(plain.receive.remote(batch))

    batch = {"input_ids": member(7.0), "attention_mask": member(8.0)}
    for key in ("old_log_probs", "values", "advantages"):  # whole, then split, then split
        assert refshare.shared_args(send)(batch) == send(batch)
        batch = dict(batch, **{key: member(len(batch))})
    stats = refshare.stats()  # whole; split, its members new; split, three found again
    assert (stats.puts, stats.hits) == (3, 3), stats
    ray.kill(plain)
