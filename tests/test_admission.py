"""Admission: kinds of values that never repeat are put without being keyed.

Checked from the outside: what the workers received (as by value), how often a registered
fingerprint function ran, what ``refshare.stats()`` counts and what the cache holds.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import ray
from helpers import Worker
from internals import COLD_AFTER, MAX_KINDS, PROBE_EVERY, Admission, kind, process_cache
from test_data_types import Probe
from test_data_types import describe as layout

import refshare

pytestmark = pytest.mark.usefixtures("local_ray", "fresh")

SIZE = 256 << 10


class Counted:
    """A value whose registered fingerprint counts how often refshare keyed it."""

    keyed = 0

    def __init__(self, fill: int) -> None:
        self.data = np.full(SIZE, fill, dtype=np.uint8)


def _count(value: Counted) -> Any:
    Counted.keyed += 1
    return value.data


refshare.register_fingerprint(Counted, _count)


@pytest.fixture(scope="module")
def worker(local_ray: None) -> Iterator[Any]:
    actor = Worker.remote()
    yield actor
    ray.kill(actor)


def by_value(workers: list[Any], value: Any) -> list[Any]:
    return ray.get([w.receive.remote(value) for w in workers])


send = refshare.shared_args(by_value)


def make_cold(worker: Any, fill: int = 0) -> None:
    """Send ``COLD_AFTER`` distinct arrays of ``SIZE`` bytes, one worker each: a cold kind."""
    for i in range(COLD_AFTER):
        send([worker], np.full(SIZE, fill + i, dtype=np.uint8))


# -- the counting, without Ray -------------------------------------------------------------


def test_a_kind_turns_cold_after_misses_in_a_row_and_is_probed() -> None:
    admission, kind = Admission(), (bytes, 7, 100)
    for _ in range(COLD_AFTER - 1):
        assert admission.keyed(kind)
        admission.record(kind, hit=False)
    admission.record(kind, hit=False)
    assert admission.cold() == [kind]
    keyed = []
    for _ in range(3 * PROBE_EVERY):
        keyed.append(admission.keyed(kind))
        assert admission.keyed(kind) is keyed[-1]  # asking again: the same answer
        if keyed[-1]:
            admission.record(kind, hit=False)  # a probe that found nothing
        else:
            admission.passed(kind)  # a value put without keying
    assert keyed.count(True) == 3 and keyed[PROBE_EVERY - 1]  # every PROBE_EVERY-th
    admission.record(kind, hit=True)
    assert admission.cold() == [] and admission.keyed(kind)
    admission.record(kind, hit=False)  # one miss after a hit: still keyed
    assert admission.keyed(kind)


def test_kinds_remembered_are_bounded() -> None:
    admission = Admission()
    for size in range(MAX_KINDS + 10):
        admission.record((bytes, 0, size), hit=False)
    assert len(admission._kinds) == MAX_KINDS
    assert (bytes, 0, 0) not in admission._kinds  # the least recently seen went first


def test_sizes_within_an_eighth_are_one_kind() -> None:
    assert kind(b"", 1000) == kind(b"", 1010) != kind(b"", 1200)
    assert kind(b"", 1 << 20) != kind(b"", (1 << 20) - 1) != kind("", (1 << 20) - 1)


# -- on Ray -------------------------------------------------------------------------------


def test_values_that_never_repeat_are_put_without_keying(worker: Any) -> None:
    Counted.keyed = 0
    values = [Counted(i) for i in range(COLD_AFTER + 2 * PROBE_EVERY)]
    seen = [send([worker], v) for v in values]
    assert seen == [by_value([worker], v) for v in values]
    probes = 2  # the 8th and 16th values after the kind turned cold are keyed anyway
    assert Counted.keyed == COLD_AFTER + probes
    stats = refshare.stats()
    assert (stats.puts, stats.hits, stats.unkeyed) == (len(values), 0, len(values) - Counted.keyed)
    assert len(process_cache()) == COLD_AFTER + probes  # values not keyed are not cached


def test_a_probe_that_finds_its_content_makes_the_kind_keyed_again(worker: Any) -> None:
    make_cold(worker)
    assert process_cache().admission.cold() != []
    again = np.full(SIZE, 255, dtype=np.uint8)
    for _ in range(2 * PROBE_EVERY):  # equal content, a new array each time
        assert send([worker], again.copy()) == by_value([worker], again)
    assert process_cache().admission.cold() == []  # the second probe found the first
    before = refshare.stats()
    assert send([worker], again.copy()) == by_value([worker], again)
    after = refshare.stats()
    assert (after.hits - before.hits, after.puts - before.puts) == (1, 0)


def test_a_value_sent_to_several_workers_keeps_its_kind_keyed(worker: Any) -> None:
    others = [Worker.remote() for _ in range(2)]
    group = [worker, *others]
    for i in range(2 * COLD_AFTER):  # new content each call, to every worker
        value = np.full(SIZE, i, dtype=np.uint8)
        assert send(group, value) == by_value(group, value)
    stats = refshare.stats()
    assert (stats.puts, stats.hits, stats.unkeyed) == (2 * COLD_AFTER, 4 * COLD_AFTER, 0)
    for actor in others:
        ray.kill(actor)


def test_a_value_not_keyed_sent_again_in_one_call_makes_its_kind_keyed(worker: Any) -> None:
    make_cold(worker)
    others = [Worker.remote() for _ in range(2)]
    group, value = [worker, *others], np.full(SIZE, 200, dtype=np.uint8)
    before = refshare.stats()
    assert send(group, value) == by_value(group, value)
    after = refshare.stats()
    # Put without keying once, then keyed and put once more, then found.
    assert (after.puts - before.puts, after.unkeyed - before.unkeyed) == (2, 1)
    assert after.hits - before.hits == 1
    assert process_cache().admission.cold() == []
    for actor in others:
        ray.kill(actor)


def test_share_always_keys(worker: Any) -> None:
    make_cold(worker)
    value = np.full(SIZE, 77, dtype=np.uint8)
    assert refshare.share(value) == refshare.share(value.copy())


def test_clear_forgets_which_kinds_repeat(worker: Any) -> None:
    make_cold(worker)
    refshare.clear()
    refshare.reset_stats()
    send([worker], np.full(SIZE, 1, dtype=np.uint8))
    assert refshare.stats().unkeyed == 0


def test_values_not_keyed_arrive_as_by_value() -> None:
    """A value not keyed is stored in the form a miss stores: containers through refshare's
    own pickler (tensors as their bytes, strings joined), leaves as they are."""
    torch = pytest.importorskip("torch")
    probe = Probe.remote()

    def batch(i: int) -> dict[str, Any]:
        return {
            "ids": torch.full((64, 1024), i, dtype=torch.int64),
            "rows": torch.arange(i, i + 128 * 1024, dtype=torch.float32).reshape(128, -1)[::2],
            "uids": np.array([f"uid-{i:03d}-{j:04d}" for j in range(2000)], dtype=object),
            "mask": np.full((256, 256), i % 2 == 0),
        }

    values = [batch(i) for i in range(COLD_AFTER + 3)]
    shared = refshare.shared_args(lambda v: ray.get(probe.describe.remote(v)))
    seen = [shared(v) for v in values]
    assert refshare.stats().unkeyed == 3  # the kind turned cold: the last three not keyed
    assert seen == [ray.get(probe.describe.remote(v)) for v in values]
    assert seen[-1][1] == layout(values[-1], layout=False)
    ray.kill(probe)


class OwnPickling:
    """Pickles through code of its own, as verl's ``DataProto`` does: put as Ray pickles it."""

    def __init__(self, data: np.ndarray) -> None:
        self.data = data

    def __getstate__(self) -> dict[str, Any]:
        return {"data": self.data.tobytes(), "dtype": self.data.dtype.str}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.data = np.frombuffer(state["data"], dtype=state["dtype"])


@ray.remote(num_cpus=0.1)
def contents(value: Any) -> Any:
    """What a worker finds in an ``OwnPickling`` or a dict holding a ref."""
    if isinstance(value, OwnPickling):
        return "OwnPickling", value.data.tobytes()
    return sorted(value), ray.get(value["ref"]).tolist(), value["data"].tobytes()


def test_values_with_their_own_pickling_are_put_as_ray_would() -> None:
    shared = refshare.shared_args(lambda v: ray.get(contents.remote(v)))
    values = [OwnPickling(np.full(SIZE, i, dtype=np.uint8)) for i in range(COLD_AFTER + 2)]
    seen = [shared(v) for v in values]
    assert refshare.stats().unkeyed == 2
    assert seen == [ray.get(contents.remote(v)) for v in values]


class Compact(OwnPickling):
    """Pickles to far fewer bytes than its array holds (a fill and a length), as a batch's
    chunk may pickle fewer bytes than refshare's estimate of its size reads."""

    def __getstate__(self) -> dict[str, Any]:
        return {"fill": int(self.data[0]), "n": self.data.size}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.data = np.full(state["n"], state["fill"], dtype=np.uint8)


def test_a_value_put_without_keying_counts_what_the_store_holds() -> None:
    shared = refshare.shared_args(lambda v: ray.get(contents.remote(v)))
    values = [Compact(np.full(SIZE, i, dtype=np.uint8)) for i in range(COLD_AFTER + 2)]
    for value in values[:COLD_AFTER]:
        shared(value)
    before = refshare.stats()
    seen = [shared(v) for v in values[COLD_AFTER:]]
    after = refshare.stats()
    assert after.unkeyed - before.unkeyed == 2
    assert seen == [ray.get(contents.remote(v)) for v in values[COLD_AFTER:]]
    own = [ray.put(v) for v in values[COLD_AFTER:]]  # Ray's own put of the same values
    found = ray.experimental.get_local_object_locations(own)
    held = sum(found[ref]["object_size"] for ref in own)
    assert held < SIZE  # what the store holds for both, against 256 KiB estimated for each
    assert after.bytes_put - before.bytes_put == held


def test_values_with_refs_inside_go_by_value_and_never_turn_a_kind_cold() -> None:
    inner = ray.put(np.arange(10))
    shared = refshare.shared_args(deep=False)(lambda v: ray.get(contents.remote(v)))
    values = [{"ref": inner, "data": np.full(SIZE, i, dtype=np.uint8)} for i in range(20)]
    seen = [shared(v) for v in values]
    assert refshare.stats()[:3] == (0, 0, 0)  # no put, no hit, nothing stored
    assert refshare.stats().by_value == len(values)
    assert seen == [ray.get(contents.remote(v)) for v in values]
    # By default, their large members are shared, and what holds the ref goes with the task.
    refshare.reset_stats()
    default = refshare.shared_args(lambda v: ray.get(contents.remote(v)))
    assert [default(v) for v in values] == seen
    assert refshare.stats().puts == len(values) and refshare.stats().by_value == 0
