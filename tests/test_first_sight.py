"""One serialization on first sight: values whose pickling runs code of their own.

refshare keys such a value by one pickle made with Ray's pickler and stores that very
pickle, so the driver serializes each distinct value once (not once to key it and once
more to put it), and at most once per decorated call to find it again.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import ray
from helpers import Restamped, SelfPickling
from internals import serialized as _serialized

import refshare

pytestmark = pytest.mark.usefixtures("local_ray", "fresh")

N = 4


@ray.remote(num_cpus=0.1)
class Reader:
    def read(self, batch: Any) -> Any:
        return type(batch).__name__, {
            k: (v.dtype.str, v.shape, float(v.sum())) for k, v in batch.items()
        }


@pytest.fixture(scope="module")
def readers(local_ray: None) -> list[Any]:
    group = [Reader.remote() for _ in range(N)]
    ray.get([r.read.remote({}) for r in group])
    return group


def batch(fill: float = 1.0) -> SelfPickling:
    return SelfPickling(x=np.full(1 << 17, fill), y=np.arange(1 << 16, dtype=np.int32))


def fan_out(readers: list[Any], value: Any) -> list[Any]:
    return ray.get([r.read.remote(value) for r in readers])


shared_fan_out = refshare.shared_args(fan_out)


def reductions(call: Any, *args: Any) -> tuple[Any, int]:
    before = SelfPickling.reduced
    result = call(*args)
    return result, SelfPickling.reduced - before


@pytest.mark.verify_off  # counts serializations, which verify adds to
def test_a_self_pickling_value_is_serialized_once_for_the_whole_fan_out(readers: list[Any]) -> None:
    value = batch()
    by_value, sent = reductions(fan_out, readers, value)
    assert sent == N
    shared, twice = reductions(shared_fan_out, readers, value)
    assert shared == by_value
    # Pickled to be keyed, then once more when first sent again, to learn that the class
    # pickles an unchanged value alike; from then on, once per fan-out.
    assert twice == 2
    stats = refshare.stats()
    assert (stats.puts, stats.hits, stats.by_value) == (1, N - 1, 0), stats
    other = batch(2.0)
    assert reductions(shared_fan_out, readers, other) == (fan_out(readers, other), 1)
    # What was stored is what it pickled to, not what its arrays hold.
    assert stats.bytes_put > value["x"].nbytes + value["y"].nbytes


@pytest.mark.verify_off  # counts serializations, which verify adds to
def test_a_repeat_call_keys_it_again_and_stores_nothing(readers: list[Any]) -> None:
    value = batch()
    shared_fan_out(readers, value)
    refshare.reset_stats()
    result, again = reductions(shared_fan_out, readers, batch())  # equal content, new object
    assert again == 1
    assert result == fan_out(readers, value)
    stats = refshare.stats()
    assert (stats.puts, stats.hits) == (0, N), stats


def test_a_value_changed_between_two_remote_calls_of_one_call_is_sent_anew(
    readers: list[Any],
) -> None:
    value = batch()

    @refshare.shared_args
    def change_midway() -> list[Any]:
        first = ray.get(readers[0].read.remote(value))
        value["x"][:] = 7.0  # in place, same dict, same array object
        second = ray.get(readers[1].read.remote(value))
        value["z"] = np.zeros(1 << 15)  # a new key
        third = ray.get(readers[2].read.remote(value))
        return [first, second, third]

    first, second, third = change_midway()
    assert first[1]["x"][2] == float(1 << 17)
    assert second[1]["x"][2] == 7.0 * (1 << 17)
    assert "z" in third[1] and "z" not in second[1]
    assert refshare.stats().puts == 3


def test_equal_content_in_other_objects_shares_one_ref(readers: list[Any]) -> None:
    values = [batch(2.0), batch(2.0), batch(3.0)]

    @refshare.shared_args
    def send_each() -> list[Any]:
        return [ray.get(r.read.remote(v)) for v in values for r in readers]

    assert send_each() == [ray.get(r.read.remote(v)) for v in values for r in readers]
    stats = refshare.stats()
    assert (stats.puts, stats.hits) == (2, 3 * N - 2), stats


def test_refs_inside_such_a_value_send_it_by_value(readers: list[Any]) -> None:
    @ray.remote(num_cpus=0.1)
    def first_of(items: list[Any]) -> float:
        value, ref = items
        return float(value["x"][0]) + float(ray.get(ref)[0])

    inner = ray.put(np.full(4, 5.0))
    value = [batch(), inner]  # a container that holds a ref and a self-pickling value

    @refshare.shared_args
    def run() -> list[float]:
        return ray.get([first_of.remote(value) for _ in range(2)])

    assert run() == [6.0, 6.0]
    stats = refshare.stats()
    # Stored, the ref would live as long as the cache kept it, not as long as by value does.
    assert (stats.puts, stats.hits, stats.by_value) == (0, 0, 2), stats


@pytest.mark.verify_off  # counts serializations, which verify adds to
def test_when_rays_pickler_differs_it_warns_once_and_serializes_twice(
    readers: list[Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def drifted() -> Any:
        raise AttributeError("module 'ray.cloudpickle' has no attribute 'CloudPickler'")

    monkeypatch.setattr(_serialized, "_make_pickler_class", drifted)
    monkeypatch.setattr(_serialized, "_checked", False)
    monkeypatch.setattr(_serialized, "_pickler_class", None)
    value = batch(4.0)
    with caplog.at_level(logging.WARNING, logger="refshare"):
        shared, count = reductions(shared_fan_out, readers, value)
        _, count_again = reductions(shared_fan_out, readers, batch(5.0))
    assert shared == fan_out(readers, value)
    # One pickling pass to key it, one to learn that it pickles alike, one ray.put; then
    # one to key and one to put.
    assert (count, count_again) == (3, 2)
    warnings = [r for r in caplog.records if "pickler is not what refshare expects" in r.message]
    assert len(warnings) == 1
    assert (refshare.stats().puts, refshare.stats().hits) == (2, 2 * N - 2)


@ray.remote(num_cpus=0.1)
def unwrap(value: Any) -> Any:
    return value


@pytest.mark.verify_off  # counts serializations, which verify adds to
def test_a_value_that_pickles_anew_each_time_reaches_each_worker_as_by_value() -> None:
    value = Restamped(np.zeros(1 << 18))

    def send() -> list[Any]:
        return ray.get([unwrap.remote(value) for _ in range(N)])

    by_value = send()
    shared = refshare.shared_args(send)()
    # By value every task got a pickle of its own; so does every task through refshare.
    assert [stamp for stamp, _ in by_value] == list(range(by_value[0][0], by_value[0][0] + N))
    assert [stamp for stamp, _ in shared] == list(range(shared[0][0], shared[0][0] + N))
    assert [size for _, size in shared] == [size for _, size in by_value]
