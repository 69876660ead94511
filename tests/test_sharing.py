"""End to end on a real Ray: what the driver serializes, what workers receive, what is cached."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

import internals
import numpy as np
import pytest
import ray
from differential_kit import arguments, fields, first_difference
from helpers import Controller, Payload, Worker, count_payload_serializations, receive

import refshare

pytestmark = pytest.mark.usefixtures("local_ray", "fresh")

N_WORKERS = 4


@pytest.fixture(scope="module")
def workers(local_ray: None) -> list[Any]:
    count_payload_serializations()
    group = [Worker.remote() for _ in range(N_WORKERS)]
    ray.get([w.receive.remote() for w in group])
    return group


@pytest.fixture
def serializations() -> Iterator[Any]:
    """Call it to read how many times Ray serialized a Payload since the test began."""
    start = Payload.serialized
    yield lambda: Payload.serialized - start


def fan_out(workers: list[Any], *args: Any, **kwargs: Any) -> list[Any]:
    return ray.get([w.receive.remote(*args, **kwargs) for w in workers])


@refshare.shared_args
def shared_fan_out(workers: list[Any], *args: Any, **kwargs: Any) -> list[Any]:
    return fan_out(workers, *args, **kwargs)


@pytest.mark.verify_off  # counts serializations, which verify adds to
def test_a_fan_out_serializes_a_large_argument_once(workers: list[Any], serializations) -> None:
    payload = Payload.filled(7)
    expected = fan_out(workers, payload)
    assert serializations() == N_WORKERS  # Ray alone: once per .remote()

    assert shared_fan_out(workers, payload) == expected
    # Keyed by its own pickle: once to key and store, once more (the second send) to learn
    # that it pickles alike; the other sends reuse that pickle's key.
    assert serializations() == N_WORKERS + 2
    assert refshare.stats()[:2] == (1, N_WORKERS - 1)  # puts, hits

    # Same content again, even as another object: pickled once to key it (in a new call,
    # the first send keys it), found in the cache, not stored again.
    assert shared_fan_out(workers, Payload.filled(7)) == expected
    assert serializations() == N_WORKERS + 3
    assert refshare.stats()[:2] == (1, 2 * N_WORKERS - 1)  # puts, hits


@pytest.mark.verify_off  # counts serializations, which verify adds to
def test_different_methods_share_one_cache(workers: list[Any], serializations) -> None:
    @refshare.shared_args
    def other_method(x: Payload) -> Any:
        return ray.get(workers[0].receive.remote(x))

    shared_fan_out(workers, Payload.filled(3))
    other_method(Payload.filled(3))
    # Keyed by its own pickle: twice in the fan-out (key and store, then learn it pickles
    # alike), once in the other method to key it, which finds it cached.
    assert serializations() == 3
    assert refshare.stats()[:2] == (1, N_WORKERS)  # puts, hits: one put for both methods
    assert len(internals.process_cache()) == 1


def test_workers_receive_exactly_what_ray_by_value_gives(workers: list[Any]) -> None:
    rng = np.random.default_rng(1)
    args = (
        rng.random((256, 128)),
        np.asfortranarray(rng.random((128, 256))),
        rng.random((512, 512))[::2, ::3],
        np.arange(200_000, dtype=">i4"),
        b"\x01" * 300_000,
        "t" * 300_000,
        {"obs": rng.random(40_000), "step": 3},
        [rng.random(20_000), rng.random(20_000)],
        42,
        "small",
    )
    by_value = fan_out(workers, *args, flag=np.ones(50_000))
    shared = shared_fan_out(workers, *args, flag=np.ones(50_000))
    assert shared == by_value
    received_args, _ = arguments(shared[0])
    assert fields(received_args[0])["writeable"] is False  # read-only arrays, as by value
    assert fields(received_args[1])["F-contiguous"] is True  # F order kept
    assert refshare.stats().puts == 9  # every large argument once: 8 positional + flag
    assert refshare.stats().hits == 9 * (N_WORKERS - 1)


def test_body_still_sees_the_original_values(workers: list[Any]) -> None:
    seen = []

    @refshare.shared_args
    def train(batch: np.ndarray) -> None:
        ray.get(workers[0].receive.remote(batch))
        seen.append((type(batch), batch.shape, float(batch[1:4].sum())))

    batch = np.arange(100_000.0)
    train(batch)
    assert seen == [(np.ndarray, (100_000,), 6.0)]


@pytest.mark.verify_off  # counts serializations, which verify adds to
def test_every_submission_path_is_shared(workers: list[Any], serializations) -> None:
    payload = Payload.filled(5)

    def every_path() -> list[Any]:
        worker = Worker.remote(payload, key=payload)  # actor creation, positional and keyword
        calls = [
            worker.received_at_init.remote(),
            worker.receive.remote(payload),
            worker.receive.options(name="named").remote(data=payload),
            receive.remote(payload),
            receive.options(num_cpus=0.05).remote(data=payload),
        ]
        found = ray.get(calls)
        ray.kill(worker)
        return found

    with refshare.sharing():
        results = every_path()
    # Keyed by its own pickle: once to key and store, once more (its second send, the
    # keyword of the same actor creation) to learn that it pickles alike.
    assert serializations() == 2
    expected = every_path()  # by value, outside the scope
    assert results == expected, first_difference(results, expected)


def test_refs_and_small_values_pass_through(workers: list[Any]) -> None:
    ref = ray.put(np.ones(200_000))
    result = shared_fan_out(workers, ref, 1, None, "x", np.zeros(10), b"\x00" * 1000)
    assert result == fan_out(workers, ref, 1, None, "x", np.zeros(10), b"\x00" * 1000)
    assert refshare.stats() == refshare.Stats()


def test_a_nested_ref_is_never_introduced(workers: list[Any]) -> None:
    # Only top-level arguments are replaced: Ray does not resolve refs inside containers.
    batch = {"x": np.ones(200_000)}
    assert shared_fan_out(workers, batch) == fan_out(workers, batch)
    assert shared_fan_out(workers, [batch]) == fan_out(workers, [batch])
    assert "ObjectRef" not in repr(shared_fan_out(workers, [batch]))


@pytest.mark.verify_off  # counts serializations, which verify adds to
def test_one_call_puts_once_with_cache_false(workers: list[Any], serializations) -> None:
    @refshare.shared_args(cache=False)
    def uncached(x: Payload) -> list[Any]:
        return fan_out(workers, x)

    uncached(Payload.filled(9))
    uncached(Payload.filled(9))
    # Keyed by its own pickle: in the first call once to key and store and once more to
    # learn it pickles alike, in the second once to key and store; nothing kept between.
    assert serializations() == 3
    assert refshare.stats()[:2] == (2, 2 * (N_WORKERS - 1))  # puts, hits: one put per call
    assert len(internals.process_cache()) == 0


def test_a_cache_of_your_own(workers: list[Any]) -> None:
    mine = refshare.RefCache(max_bytes=10 << 20)

    @refshare.shared_args(cache=mine)
    def cached(x: Any) -> list[Any]:
        return fan_out(workers, x)

    cached(np.zeros(1 << 20, dtype=np.uint8))
    cached(np.ones(1 << 20, dtype=np.uint8))
    # Each weighs what the object store holds: its bytes and the few hundred Ray adds.
    assert len(mine) == 2 and 2 << 20 < mine.nbytes < (2 << 20) + 4096
    assert len(internals.process_cache()) == 0
    cached(np.zeros(1 << 20, dtype=np.uint8))
    assert refshare.stats().puts == 2


def test_min_bytes_sets_the_threshold(workers: list[Any]) -> None:
    @refshare.shared_args(min_bytes=1 << 20)
    def picky(x: Any) -> list[Any]:
        return fan_out(workers, x)

    picky(np.zeros(500_000, dtype=np.uint8))
    assert refshare.stats().puts == 0
    picky(np.zeros(1 << 20, dtype=np.uint8))
    assert refshare.stats().puts == 1


def test_an_array_changed_in_place_between_calls_is_sent_anew(workers: list[Any]) -> None:
    weights = np.zeros(200_000)
    first = shared_fan_out(workers, weights)
    weights += 1.0
    second = shared_fan_out(workers, weights)
    assert first == fan_out(workers, np.zeros(200_000)) != second  # each as by value
    assert second == fan_out(workers, np.ones(200_000))
    assert refshare.stats().puts == 2


def by_value_fills(workers: list[Any], size: int) -> list[Any]:
    """What each worker receives, by value, of an array of ``size`` filled with its index."""
    return ray.get([w.receive.remote(np.full(size, float(i))) for i, w in enumerate(workers)])


def test_temporaries_never_reuse_a_recycled_id(workers: list[Any]) -> None:
    @refshare.shared_args
    def per_worker() -> list[Any]:
        # Each temporary could be freed and its id() reused by the next one.
        return ray.get([w.receive.remote(np.full(50_000, float(i))) for i, w in enumerate(workers)])

    results = per_worker()
    assert results == by_value_fills(workers, 50_000)
    assert refshare.stats().puts == N_WORKERS


def test_nested_scopes_apply_the_innermost_options(workers: list[Any]) -> None:
    x = np.zeros(300_000, dtype=np.uint8)
    with refshare.sharing():
        with refshare.sharing(enabled=False):
            fan_out(workers, x)
        assert refshare.stats().puts == 0
        with refshare.sharing(min_bytes=1 << 30):
            fan_out(workers, x)
        assert refshare.stats().puts == 0
        fan_out(workers, x)
    assert refshare.stats().puts == 1
    fan_out(workers, x)  # outside every scope: by value
    assert refshare.stats().hits == N_WORKERS - 1


def test_disable_environment_variable_is_read_when_a_scope_starts(
    workers: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    x = np.zeros(300_000, dtype=np.uint8)
    monkeypatch.setenv("REFSHARE_DISABLE", "1")
    assert shared_fan_out(workers, x) == fan_out(workers, x)
    assert refshare.stats().puts == 0
    monkeypatch.setenv("REFSHARE_DISABLE", "0")
    shared_fan_out(workers, x)
    assert refshare.stats().puts == 1


def test_threads_each_get_their_own_arguments(workers: list[Any]) -> None:
    results: dict[int, Any] = {}

    def run(i: int) -> None:
        for _ in range(3):
            results[i] = shared_fan_out(workers, np.full(100_000, float(i)))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, result in results.items():
        assert result == fan_out(workers, np.full(100_000, float(i)))
    assert refshare.stats().puts == 6


def test_a_thread_started_in_the_body_does_not_inherit_the_scope(workers: list[Any]) -> None:
    @refshare.shared_args
    def spawn() -> None:
        t = threading.Thread(target=fan_out, args=(workers, np.zeros(300_000, dtype=np.uint8)))
        t.start()
        t.join()

    spawn()
    assert refshare.stats().puts == 0


def test_share_is_a_content_addressed_put() -> None:
    a = refshare.share(np.arange(100_000.0))
    b = refshare.share(np.arange(100_000.0))
    c = refshare.share(np.arange(1.0, 100_001.0))
    assert a == b and a != c
    np.testing.assert_array_equal(ray.get(a), np.arange(100_000.0))
    small = refshare.share(3)
    assert ray.get(small) == 3 and refshare.share(3) == small
    assert ray.get(refshare.share(lambda: 5))() == 5  # not fingerprintable: a plain put


def test_an_argument_ray_cannot_serialize_fails_as_it_does_without_refshare(
    workers: list[Any],
) -> None:
    class Unpicklable:
        def __init__(self) -> None:
            self.lock = threading.Lock()
            self.data = np.zeros(300_000)

    with pytest.raises(Exception) as by_value:
        fan_out(workers, Unpicklable())
    with pytest.raises(Exception) as shared:
        shared_fan_out(workers, Unpicklable())
    assert type(shared.value) is type(by_value.value)
    assert refshare.stats().by_value == 1  # the first .remote() raised, as by value


@pytest.mark.verify_off  # counts serializations, which verify adds to
def test_nemo_shaped_worker_group(workers: list[Any], serializations) -> None:
    """DP x TP mesh: each DP shard goes to its TP replicas; broadcast kwargs go to all."""
    dp, tp = 2, 2
    mesh = [[workers[d * tp + t] for t in range(tp)] for d in range(dp)]

    @refshare.shared_args
    def run_all_workers_sharded_data(data: list[Any], **common_kwargs: Any) -> list[Any]:
        calls = [
            mesh[d][t].receive.remote(data=data[d], **common_kwargs)
            for d in range(dp)
            for t in range(tp)
        ]
        return ray.get(calls)

    shards = [{"input_ids": Payload.filled(d + 1)} for d in range(dp)]
    config = Payload.filled(100)
    results = run_all_workers_sharded_data(shards, config=config, step=1)
    # Each keyed by its own pickle (a shard is a dict holding a Payload: pickled whole).
    # Shard 0 twice: key and store, then learn that a dict holding a Payload pickles alike
    # (both classes learned); shard 1 and the config once each, as both are learned.
    assert serializations() == 2 + (dp - 1) + 1
    for d in range(dp):
        by_value = ray.get(mesh[d][0].receive.remote(data=shards[d], config=config, step=1))
        for t in range(tp):
            assert results[d * tp + t] == by_value
    assert refshare.stats().puts == dp + 1


def test_inline_threshold_arguments_are_untouched_when_disabled(workers: list[Any]) -> None:
    @refshare.shared_args(enabled=False)
    def off(x: Any) -> list[Any]:
        return fan_out(workers, x)

    off(np.zeros(300_000))
    assert refshare.stats() == refshare.Stats()
    assert os.environ.get("REFSHARE_DISABLE") in (None, "", "0")


def test_a_buffer_refilled_between_submissions_is_sent_anew(workers: list[Any]) -> None:
    @refshare.shared_args
    def refill_per_worker() -> list[Any]:
        buffer = np.empty(100_000)
        calls = []
        for i, w in enumerate(workers):
            buffer[:] = float(i)  # by value, each worker would get its own fill
            calls.append(w.receive.remote(buffer))
        return ray.get(calls)

    results = refill_per_worker()
    assert results == by_value_fills(workers, 100_000)
    assert refshare.stats().puts == N_WORKERS


def test_sharing_inside_an_actor(workers: list[Any]) -> None:
    controller = Controller.remote()
    batch = np.arange(100_000.0)
    received, stats = ray.get(controller.broadcast.remote(workers, batch))
    assert received == fan_out(workers, batch)
    assert stats[:2] == (1, N_WORKERS - 1)  # puts, hits, counted in the actor's process
    ray.kill(controller)


def test_arrays_from_ray_get_are_immutable_and_hashed_once(workers: list[Any]) -> None:
    rollout = ray.get(ray.put(np.arange(200_000.0)))  # read-only, over the object store
    assert internals.array_trust(rollout) == internals.Trust.ALWAYS
    assert shared_fan_out(workers, rollout) == fan_out(workers, rollout)
    assert id(rollout) in internals.digests_kept_across_calls
    shared_fan_out(workers, rollout)
    assert refshare.stats().puts == 1 and refshare.stats().hits == 2 * N_WORKERS - 1


def test_one_debug_line_per_put_and_per_hit(
    workers: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="refshare"):
        shared_fan_out(workers, np.zeros(200_000, dtype=np.uint8))
    lines = [r.getMessage() for r in caplog.records if r.name == "refshare"]
    assert len(lines) == N_WORKERS
    assert lines[0].startswith("put  200000 bytes, key ")
    assert all(line.startswith("hit  200000 bytes, key ") for line in lines[1:])
    assert len({line.rsplit(" ", 1)[1] for line in lines}) == 1  # one key prefix


def test_a_long_list_of_small_items_is_sized_by_extrapolation_and_shared(
    workers: list[Any],
) -> None:
    tokens = list(range(300_000))  # estimated at 2.4 MB from its first 10,000 items
    assert shared_fan_out(workers, tokens) == fan_out(workers, tokens)
    assert refshare.stats()[:2] == (1, N_WORKERS - 1)
