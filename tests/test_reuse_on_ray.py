"""What a cache keeps across a training loop on a real Ray follows the loop, not its budget:
chunks of past steps that never come back go, chunks that do come back stay. What it holds
is read from Ray's side too (the object store's bytes in use once the loop is done)."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest
import ray
from reliability_kit import MiB, marked, sinks, summary
from test_lifetimes import eventually, plasma_mib

import refshare
from refshare._scope import store as store_module

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray", "fresh")]

#: The cache's budget: far more than a step, so only the horizons bound what it keeps.
BUDGET = 96 * MiB
CHUNK = 2 * MiB
STEPS = 30  # 180 MiB of chunks: past the warm-up (half the budget) by far
#: Arguments sent in all: two sends a step, to two workers, of the weights and three chunks.
SENT = STEPS * 2 * 2 * 4
#: The steps a cache of :data:`BUDGET` takes to store half of it (past it, at most one more).
WARM = 9


@pytest.fixture(scope="module")
def group() -> list[Any]:
    return sinks(2)


def _loop(group: list[Any], batch_of: Any) -> tuple[refshare.RefCache, int, int]:
    """``STEPS`` steps: each sends the weights and the step's batch of three chunks to both
    workers (the batch twice, as a step's calls send it again); return the cache, the most
    it held at the end of a step once past its warm-up, and the MiB the object store holds
    once the loop is done, past what it held before."""
    cache = refshare.RefCache(max_bytes=BUDGET)
    weights = marked(1, MiB)

    @refshare.shared_args(cache=cache)
    def send(*arrays: np.ndarray) -> list[Any]:
        return ray.get([w.apply.remote(summary, *arrays) for w in group], timeout=60)

    gc.collect()
    eventually(lambda: plasma_mib() == 0, timeout=10)  # what the test before kept, let go of
    before = plasma_mib()
    most = 0
    for step in range(STEPS):
        batch = batch_of(step)
        for _ in range(2):
            assert send(weights, *batch) == [summary(weights, *batch)] * 2
        del batch
        if step >= WARM:
            most = max(most, cache.nbytes)
    held = (cache.nbytes + MiB - 1) // MiB
    assert eventually(lambda: plasma_mib() - before <= held + 1), (plasma_mib(), before, held)
    return cache, most, plasma_mib() - before


def test_chunks_of_past_steps_that_never_come_back_go(group: list[Any]) -> None:
    """A new batch every step: the cache keeps the weights, the step's batch and about half
    a step more, not half its budget of chunks never sent again (which it held while
    nothing went for its age below half its budget)."""
    _, most, in_store = _loop(
        group, lambda step: [marked(100 + 3 * step + i, CHUNK) for i in range(3)]
    )
    stats = refshare.stats()
    assert stats.puts == 1 + 3 * STEPS  # the weights once, each chunk once
    assert stats.hits == SENT - stats.puts  # every other argument sent: no put again
    step = 3 * CHUNK
    assert most <= MiB + step + 1.5 * step + MiB, most / MiB
    assert most < BUDGET // 4
    assert in_store <= 20, in_store  # MiB, as the store counts them


def test_chunks_that_come_back_stay(group: list[Any]) -> None:
    """Four batches sent in turn: each comes back three steps after it was last sent, and
    the cache keeps them all (put in the first round only), though what it holds is more
    than a step and a half of the loop above."""
    batches = [[marked(500 + 3 * b + i, CHUNK) for i in range(3)] for b in range(4)]
    cache, _, in_store = _loop(group, lambda step: batches[step % 4])
    stats = refshare.stats()
    assert stats.puts == 1 + 3 * 4  # the weights and each batch once: every step after hits
    assert stats.hits == SENT - stats.puts
    assert cache.nbytes >= MiB + 4 * 3 * CHUNK
    assert in_store >= 24, in_store


def test_what_went_unused_goes_before_the_next_steps_first_put(
    group: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As verl's step sends them: the weights, two calls' new chunks, the second call's sent
    again at the step's end, none of them after. Those hits show, only at the first step's
    end, how far apart chunks come back: the first call's chunks, never sent again, go
    before the next step's first put, so the store does not hold them beside it (it held the
    whole first step then when they went only once the put was in the cache: 1.24 times by
    value's peak on verl's long replay). The weights, not sent again yet when the hits
    taught that, still hit."""
    cache = refshare.RefCache(max_bytes=24 * MiB)  # the 14 MiB step passes its warm-up
    weights = marked(1, 2 * MiB)

    @refshare.shared_args(cache=cache)
    def send(*arrays: np.ndarray) -> list[Any]:
        return ray.get([w.apply.remote(summary, *arrays) for w in group], timeout=60)

    gc.collect()
    eventually(lambda: plasma_mib() == 0, timeout=10)
    before = plasma_mib()
    at_puts: list[int] = []  # what the cache held as each put was made
    settled: list[bool] = []  # whether the store came down to it, read from Ray's side
    put = store_module.put_stored

    def watched(stored: Any, nbytes: int) -> Any:
        held = cache.nbytes
        at_puts.append(held)
        if len(at_puts) == 8:  # the second step's first chunk
            mib = (held + MiB - 1) // MiB
            settled.append(eventually(lambda: plasma_mib() - before <= mib, timeout=5))
        return put(stored, nbytes)

    monkeypatch.setattr(store_module, "put_stored", watched)
    for step in range(2):
        first = [marked(1000 + 10 * step + i, CHUNK) for i in range(3)]
        second = [marked(2000 + 10 * step + i, CHUNK) for i in range(3)]
        for arrays in ([weights], first, second, second):
            assert send(*arrays) == [summary(*arrays)] * 2
    assert refshare.stats().puts == len(at_puts) == 1 + 2 * 6  # nothing put again
    # The weights, the second call's chunks, and the first call's last (stored 3 chunks
    # before the step's end, within the 4-chunk distance of the farthest hit, with a margin).
    assert at_puts[7] <= 2 * MiB + 4 * CHUNK + 4096, at_puts[7] / MiB
    assert settled == [True], (plasma_mib() - before, at_puts[7] / MiB)
