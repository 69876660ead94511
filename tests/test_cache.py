"""RefCache on its own: LRU order, the byte budget, sessions, threads and bad options."""

from __future__ import annotations

import threading

import pytest

import refshare
from refshare import RefCache


def test_lru_within_a_byte_budget() -> None:
    cache = RefCache(max_bytes=100)
    cache.setdefault("a", "ref-a", 40)
    cache.setdefault("b", "ref-b", 40)
    assert cache.get("a") == "ref-a"  # a is now the most recently used
    before = refshare.stats().evictions
    cache.setdefault("c", "ref-c", 40)  # over budget: b goes, not a
    assert "b" not in cache and "a" in cache and "c" in cache
    assert len(cache) == 2 and cache.nbytes == 80 and cache.max_bytes == 100
    assert refshare.stats().evictions == before + 1
    assert repr(cache) == "RefCache(maxsize=100, currsize=80, len=2)"


def test_one_content_twice_in_an_object_is_one_entry_and_leaves_nothing_behind() -> None:
    """An argument whose members are equal (two masks of ones) stores one content twice in
    one object: the cache keeps one entry for it, and once that goes, keeps nothing alive
    (it used to count the object twice and let go of it once, pinning it for good)."""
    cache = RefCache(max_bytes=100)
    assert cache.setdefault_group("bundle", [("a", "first"), ("a", "again")], 60) == [
        "first",
        "first",
    ]
    assert len(cache) == 1 and cache.nbytes == 60
    cache.setdefault("b", "ref-b", 90)  # over budget: the bundle goes
    assert list(cache) == ["b"] and cache.nbytes == 90
    assert cache.shrink(90) == 90 and len(cache) == 0 and cache.nbytes == 0


def test_entries_stored_in_one_object_are_weighed_once_and_evicted_together() -> None:
    cache = RefCache(max_bytes=100)
    assert cache.setdefault_group("bundle", [("a", "part-a"), ("b", "part-b")], 60) == [
        "part-a",
        "part-b",
    ]
    assert cache.get("a") == cache.get("b") == "bundle"  # the ref of the object holding them
    assert cache.nbytes == 60  # the object, once: either part keeps all of it alive
    before = refshare.stats().evictions
    cache.setdefault("c", "ref-c", 50)  # a is least recent: b goes with it
    assert list(cache) == ["c"] and cache.nbytes == 50
    assert refshare.stats().evictions == before + 2
    # A group that cannot fit whole keeps none of it, and evicts nothing for it.
    assert cache.setdefault_group("big", [("p", "part-p"), ("q", "part-q")], 101) == [
        "part-p",
        "part-q",
    ]
    assert list(cache) == ["c"] and cache.nbytes == 50
    # A key already stored keeps its ref and stays out of the new group.
    cache.setdefault_group("other", [("c", "part-c"), ("d", "part-d")], 40)
    assert cache.get("c") == "ref-c" and cache.get("d") == "other" and cache.nbytes == 90


def test_an_object_kept_alive_by_several_entries_is_weighed_once() -> None:
    """A skeleton keeps its members alive: the cache weighs each stored object once, for as
    long as any entry keeps it."""
    cache = RefCache(max_bytes=1000)
    cache.setdefault("member", "m", 300)
    cache.setdefault("skeleton", "s", 10, keeps=[("m", 300), ("n", 200)])
    assert cache.nbytes == 510  # m, n and s, each once
    cache.popitem()  # the member's entry: the skeleton still keeps m alive
    assert list(cache) == ["skeleton"] and cache.nbytes == 510
    cache.popitem()
    assert cache.nbytes == 0


def test_a_value_larger_than_the_budget_is_not_cached() -> None:
    cache = RefCache(max_bytes=100)
    cache.setdefault("small", "ref", 10)
    assert cache.setdefault("huge", "big-ref", 101) == "big-ref"
    assert "huge" not in cache and "small" in cache


def test_second_writer_gets_the_first_ref() -> None:
    cache = RefCache(max_bytes=1000)
    assert cache.setdefault("k", "first", 10) == "first"
    assert cache.setdefault("k", "second", 10) == "first"
    assert cache.nbytes == 10


def test_clear_and_session_binding() -> None:
    cache = RefCache(max_bytes=1000)
    cache.bind_session(("s1", "job1"))
    cache.setdefault("k", "ref", 10)
    cache.bind_session(("s1", "job1"))
    assert len(cache) == 1
    cache.bind_session(("s2", "job1"))  # another Ray session: its refs are dead
    assert len(cache) == 0 and cache.nbytes == 0
    cache.setdefault("k", "ref", 10)
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0


def test_threads_keep_the_accounting_exact() -> None:
    cache = RefCache(max_bytes=5000)

    def fill(worker: int) -> None:
        for i in range(2000):
            key = (worker * 7 + i) % 300
            cache.setdefault(key, f"ref-{key}", 50)
            cache.get((key * 13) % 300)

    threads = [threading.Thread(target=fill, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cache.nbytes == 50 * len(cache) <= 5000
    assert all(cache.get(key) == f"ref-{key}" for key in list(cache))


@pytest.mark.parametrize("bad", [-1, 1.5, "1GB", True])
def test_bad_budget_is_a_value_error(bad: object) -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        RefCache(max_bytes=bad)  # type: ignore[arg-type]


MiB = 1 << 20


@pytest.fixture
def horizon_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reuse horizon without the warm-up during which nothing goes for its age."""
    monkeypatch.setattr(refshare._cache, "WARM_UP", 0.0)


def _loop_step(cache: RefCache, step: int, reused: dict[str, int]) -> None:
    """One step of a training loop: the weights sent again, then new rollout chunks."""
    if cache.get("weights") is None:
        reused["weights"] = reused.get("weights", 0) + 1  # a miss: put again
        cache.setdefault("weights", "w", MiB)
    for i in range(3):
        cache.setdefault(f"rollout-{step}-{i}", f"r{step}{i}", 10 * MiB)
        assert cache.get(f"rollout-{step}-{i}") is not None  # sent on within the step


def test_what_it_keeps_follows_how_far_apart_its_hits_come(horizon_alone: None) -> None:
    """New rollouts every step, the same weights every step: the cache keeps the weights and
    about a step's worth of the rest (the longest reuse distance it saw, with a margin),
    not its whole budget of chunks that are never sent again."""
    cache = RefCache(max_bytes=10_000 * MiB)
    misses: dict[str, int] = {}
    for step in range(60):
        _loop_step(cache, step, misses)
    # Put, and once more: without the warm-up, nothing had shown a reuse a step apart when
    # the weights went unused longer than the chunks' reuses; their miss teaches it.
    assert misses == {"weights": 2}
    assert cache.nbytes <= (1.5 * 30 + 1 + 30) * MiB  # a step and a half, the weights, a step
    assert "rollout-0-0" not in cache and "rollout-59-2" in cache


def test_a_chunk_sent_again_within_its_step_only_goes_with_the_step(horizon_alone: None) -> None:
    """As verl's PPO step sends them: the weights once a step; four new 9 MiB chunks, each
    sent again by the step's last call and never after; now and then a value of a kind sent
    once. Each entry is kept as long as its own reuses were apart, so the cache holds the
    weights, the step's chunks and at most one of the step before (the chunk sent again
    farthest from its store), not every chunk of the last step and a half, which a horizon
    common to all entries (the weights') kept."""
    cache = RefCache(max_bytes=10_000 * MiB)
    misses = 0
    held = []
    for step in range(40):
        if cache.get("weights") is None:
            misses += 1
            cache.setdefault("weights", "w", 32 * MiB)
        if step % 5 == 0:
            cache.setdefault(f"once-{step}", f"o{step}", 7 * MiB)  # never sent again
        chunks = [f"chunk-{step}-{i}" for i in range(4)]
        for chunk in chunks:
            cache.setdefault(chunk, chunk, 9 * MiB)
        for chunk in chunks:  # the last call sends the batch again
            assert cache.get(chunk) is not None
        held.append(cache.nbytes)
    assert misses == 1
    assert max(held[10:]) <= (32 + 4 * 9 + 9 + 7) * MiB, [h // MiB for h in held]
    assert "once-30" not in cache and f"chunk-{step - 1}-3" not in cache


def test_one_entry_sent_once_a_step_does_not_keep_the_step_for_the_others(
    horizon_alone: None,
) -> None:
    """As verl's replay sends them: the weights once a step; sixteen new chunks a step, of
    which the last four are sent again at the step's end and none after. The weights come
    back a step after they were stored, and again a step later, but they are one entry:
    that does not keep the other chunks a step and a half (when it did, the cache held up
    to 236 MiB in the first steps, and the replay's store 1.4 to 1.9 times by value's peak
    for eight steps). From the second step on, it holds the weights and the step's chunks,
    and the four sent again until the next step's first."""
    cache = RefCache(max_bytes=10_000 * MiB)
    sizes = [6 * MiB] * 4 + [7 * MiB] * 8 + [9 * MiB] * 4
    peaks = []
    for step in range(12):
        if cache.get("weights") is None:
            cache.setdefault("weights", "w", 32 * MiB)
        chunks = [f"chunk-{step}-{i}" for i in range(len(sizes))]
        peak = 0
        for chunk, nbytes in zip(chunks, sizes, strict=True):
            cache.setdefault(chunk, chunk, nbytes)
            peak = max(peak, cache.nbytes)
        for chunk in chunks[-4:]:
            assert cache.get(chunk) is not None
        peaks.append(peak // MiB)
    assert max(peaks[1:]) <= (32 * MiB + sum(sizes)) // MiB, peaks
    assert "weights" in cache and "chunk-10-0" not in cache


def test_a_batch_sent_again_at_once_then_later_stays_for_the_later_call(
    horizon_alone: None,
) -> None:
    """As NeMo-RL's GRPO step sends its batch: the policy's log-probs store it, the
    reference's send it again at once, train sends it after the two new log-prob keys. A hit
    at a short distance does not shorten the batch's stay below what the batches before it
    showed: once two steps have shown it, train finds every batch (and each goes in the next
    step)."""
    cache = RefCache(max_bytes=10_000 * MiB)
    misses = []
    for step in range(30):
        batch = [f"batch-{step}-{i}" for i in range(7)]
        for key in batch:  # get_logprobs
            cache.setdefault(key, key, 2 * MiB)
        for key in batch:  # get_reference_policy_logprobs, then its own new key
            assert cache.get(key) is not None
        cache.setdefault(f"prev-{step}", "p", 2 * MiB)
        cache.setdefault(f"ref-{step}", "r", 2 * MiB)
        found = [cache.get(key) is not None for key in batch]  # train
        misses.append(found.count(False))
        for key, hit in zip(batch, found, strict=True):
            if not hit:
                cache.setdefault(key, key, 2 * MiB)
    assert not any(misses[2:]), misses
    assert "batch-27-0" not in cache and cache.nbytes <= (2 * (14 + 4) + 4) * MiB


def test_entries_stored_in_one_object_go_when_none_is_sent_again(horizon_alone: None) -> None:
    """A bundle's entries are kept while one of them is still within its horizon, and go
    together once none is."""
    cache = RefCache(max_bytes=10_000 * MiB)
    cache.setdefault_group("bundle", [("a", "ra"), ("b", "rb")], 8 * MiB)
    for step in range(30):
        cache.setdefault(f"new-{step}", f"n{step}", MiB)
        if step < 20:
            assert cache.get("a") is not None  # "a" is sent again every step, "b" never
        assert ("a" in cache and "b" in cache) or step >= 20  # "b" stays, in a's object
    assert "a" not in cache and "b" not in cache  # "a" stopped: both went


def test_a_reuse_farther_apart_than_the_horizon_is_learned_from_its_miss(
    horizon_alone: None,
) -> None:
    """An entry evicted for its age and sent again is remembered: its miss teaches the
    cache how far apart it comes, and from then on it is kept."""
    cache = RefCache(max_bytes=10_000 * MiB)
    misses: dict[str, int] = {}
    rare = 0
    for step in range(60):
        _loop_step(cache, step, misses)
        if step % 5 == 0 and cache.get("rare") is None:  # sent every fifth step, missed
            rare += 1
            cache.setdefault("rare", "x", MiB)
    assert rare == 2  # its first send, and once evicted before its reuse was seen
    assert misses == {"weights": 2}  # likewise


def _first_steps(cache: RefCache) -> int:
    """A step sent twice, as NeMo-RL's example sends it: the first call sends the batch, a
    mask and the batch again (a short first reuse), the second sends new log-probs, the
    third the batch and a loss. Return how many puts the second step made."""
    sizes = {"batch": 4 * MiB, "mask": 2 * MiB, "logprobs": 5 * MiB, "loss": MiB}
    puts = 0
    for step in range(2):
        for key in ["batch", "mask", "batch", "logprobs", "batch", "loss"]:
            if cache.get(key) is None:
                puts += step
                cache.setdefault(key, key, sizes[key])
    return puts


def test_while_it_warms_up_a_loop_comes_round_before_anything_goes_for_its_age(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The horizon learned from the first step (the batch sent again at once) is shorter
    than the step: without the warm-up, the batch goes before the step's last call, and the
    second step puts it again; with it, a cache that has stored little keeps it."""
    assert _first_steps(RefCache(max_bytes=1_000 * MiB)) == 0
    monkeypatch.setattr(refshare._cache, "WARM_UP", 0.0)
    assert _first_steps(RefCache(max_bytes=1_000 * MiB)) > 0


def test_once_warm_what_it_holds_follows_the_loop_not_its_budget() -> None:
    """With the default warm-up: a loop that sends the weights every step and new chunks,
    each sent again within its step and never after. Once it has stored half its budget,
    the cache holds about a step and a half, however large its budget; a cache that kept
    everything below half its budget held half of it."""
    for budget in (200 * MiB, 2_000 * MiB):
        cache = RefCache(max_bytes=budget)
        misses: dict[str, int] = {}
        steps = budget // (30 * MiB) + 5  # past the warm-up: 30 MiB of chunks a step
        for step in range(steps):
            _loop_step(cache, step, misses)
        assert misses == {"weights": 1}
        assert cache.nbytes <= (1 + 1.5 * 30 + 30) * MiB, (budget // MiB, cache.nbytes // MiB)


def test_without_reuse_the_budget_alone_bounds_it() -> None:
    cache = RefCache(max_bytes=1_000)
    for i in range(100):
        cache.setdefault(f"k{i}", i, 100)
    assert len(cache) == 10 and cache.nbytes == 1_000


def test_a_batch_sent_by_every_call_of_its_step_stays_for_its_last_calls(
    horizon_alone: None,
) -> None:
    """As verl's PPO step sends its batch: chunks stored by the first call and found by
    each of the next four, the later ones farther apart (the driver stores the step's new
    keys between them: log-probs, values, advantages). Each later reuse comes more than
    1.5 times farther than the chunk's own before it; once two chunks have shown such a
    reuse, every chunk is kept for it. It was put again every step (on verl's replay 8.5 MiB
    a step, 1.24 times the step's distinct bytes), and the step's chunks still go before the
    next step's are stored."""
    cache = RefCache(max_bytes=10_000 * MiB)
    misses = []
    for step in range(20):
        if cache.get("weights") is None:
            cache.setdefault("weights", "w", 32 * MiB)
        chunks = [f"chunk-{step}-{i}" for i in range(4)]
        for chunk in chunks:
            cache.setdefault(chunk, chunk, MiB)
        missed = 0
        for call, filler in enumerate([1, 2, 5, 12]):  # MiB of new keys before the call
            cache.setdefault(f"new-{step}-{call}", f"n{step}{call}", filler * MiB)
            for chunk in chunks:
                if cache.get(chunk) is None:
                    missed += 1
                    cache.setdefault(chunk, chunk, MiB)
        misses.append(missed)
    assert not any(misses[1:]), misses
    assert "chunk-10-0" not in cache and "weights" in cache
