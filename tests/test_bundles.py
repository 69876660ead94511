"""Bundles: the new members of a split argument stored in one object, which the worker
fetches once however many members it holds, and which the cache weighs whole, as Ray's
object store holds it (read from Ray's reference table and object sizes, not refshare's
counters), under eviction and with scopes on several threads sharing one cache."""

from __future__ import annotations

import gc
import threading
import time
from collections import deque
from typing import Any

import numpy as np
import pytest
import ray
from differential_kit import Probe, first_difference

import refshare
from refshare._deep import Bundled, Skeleton, split
from refshare._keys.tables import Keyed

pytestmark = pytest.mark.usefixtures("local_ray", "fresh")

MiB = 1 << 20


@pytest.fixture(scope="module")
def probes(local_ray: None) -> list[Any]:
    group = [Probe.remote() for _ in range(2)]
    ray.get([p.ping.remote() for p in group])
    return group


def members(n: int, fill: float = 0.0) -> dict[str, np.ndarray]:
    """``n`` members of 1 KiB each."""
    return {f"m{i}": np.full(128, i + fill) for i in range(n)}


def by_value(probes: list[Any], value: Any) -> list[Any]:
    return ray.get([p.describe.remote(value) for p in probes])


@pytest.mark.parametrize("deep", [True, None], ids=["deep", "default"])
def test_a_thousand_members_of_one_bundle_arrive_as_by_value(
    probes: list[Any], deep: bool | None
) -> None:
    """Under the default the batch is stored whole the first time, and split, its new
    member bundled with nothing else, once it grew; then a whole new batch is bundled."""
    first = members(1000)
    grown = {**first, "extra": np.arange(128.0)}
    changed = members(1000, fill=0.5)
    for value in (first, grown, grown, changed):
        expected = by_value(probes, value)
        with refshare.sharing(min_bytes=1 << 10, deep=deep):
            got = by_value(probes, value)
        assert first_difference(expected, got) is None


def test_a_skeleton_names_each_stored_object_once() -> None:
    """The form a worker rebuilds from: the bundle named once (the worker's one get
    fetches and deserializes it once), each member by its place in it."""
    value = members(500)
    keyed: list[Keyed] = []

    def key(member: Any, nbytes: int) -> Keyed:
        keyed.append(Keyed(bytes([len(keyed) % 256, len(keyed) // 256]), member, nbytes))
        return keyed[-1]

    found = split(value, key, min_bytes=1 << 10)
    assert found is not None and len(found.members) == 500
    bundle = ray.put("one object for all of them")
    skeleton = Skeleton(found, [Bundled(bundle, at, 500 << 10) for at in range(500)])
    rebuild, parts = skeleton.__reduce__()
    objects, places = parts[2], parts[3]
    assert objects == [bundle]
    assert places == [(0, at) for at in range(500)]
    assert skeleton.keeps == ((bundle, 500 << 10),)  # weighed whole, once
    assert rebuild is not None


# -- what the cache weighs, against what Ray's store holds ------------------------------------


def _held_by_driver() -> dict[str, int]:
    """Every object this process's Ray worker holds a reference to (its own, and those
    contained in them), by id, with the bytes the object store holds for it."""
    from ray.experimental import get_object_locations

    core = ray._private.worker.global_worker.core_worker  # type: ignore[attr-defined]
    ids = list(core.get_all_reference_counts())
    refs = [ray.ObjectRef(bytes.fromhex(i.decode())) for i in ids]
    located = get_object_locations(refs)
    return {ref.hex(): int(located[ref].get("object_size") or 0) for ref in refs}


def _settled_extra(before: dict[str, int], expected: int, timeout: float = 10.0) -> int:
    """The bytes of the objects held now and not ``before``, once Ray has let go of what
    finished tasks used (it does so shortly after they reply)."""
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        now = _held_by_driver()
        extra = sum(n for i, n in now.items() if i not in before)
        if extra == expected or time.monotonic() > deadline:
            return extra
        time.sleep(0.05)


def test_a_bundle_too_large_for_the_cache_is_not_pinned_by_a_small_part(
    probes: list[Any],
) -> None:
    """A 128 KiB member and a 64 MiB one bundled together, under a 20 MiB cache: neither
    the bundle nor the skeleton that keeps it alive fits, so the cache keeps nothing,
    and the store holds nothing for it once the call is done."""
    cache = refshare.RefCache(max_bytes=20 * MiB)
    before = _held_by_driver()
    value = {"w": np.ones(16 << 10), "buffer": deque([np.ones(8 * MiB)])}
    expected = by_value(probes, value)
    with refshare.sharing(cache=cache, deep=True):
        got = by_value(probes, value)
    assert first_difference(expected, got) is None
    assert cache.nbytes == 0
    assert _settled_extra(before, 0) == 0


def test_what_the_cache_weighs_is_what_the_store_holds_for_it(probes: list[Any]) -> None:
    """Skeletons, their bundles and members stored alone, through eviction: at each step
    the cache's weight is what Ray holds for the objects the cache keeps alive."""
    cache = refshare.RefCache(max_bytes=24 * MiB)
    before = _held_by_driver()
    shared = np.ones(MiB // 8)  # 1 MiB, in every batch: stored alone once it repeats
    for step in range(8):
        value = {"shared": shared, "own": np.full(MiB // 8, step), "big": np.full(MiB, step)}
        with refshare.sharing(cache=cache, deep=True):
            by_value(probes, value)
        del value
        held = _settled_extra(before, cache.nbytes)
        assert held == cache.nbytes, f"step {step}: Ray holds {held}, cache says {cache.nbytes}"
        assert cache.nbytes <= cache.max_bytes
    assert refshare.stats().evictions > 0
    cache.clear()
    assert _settled_extra(before, 0) == 0


def test_scopes_on_threads_sharing_a_cache_put_a_shared_member_once(probes: list[Any]) -> None:
    """Eight threads, each in its own scope on one cache, send a new 24 MiB array they all
    share and a 1 MiB array of their own at the same moment: one of them puts the shared
    array, the others find it, and the cache weighs what the store holds."""
    cache = refshare.RefCache(max_bytes=200 * MiB)
    shared = np.ones(3 * MiB)  # 24 MiB
    before = _held_by_driver()
    start = threading.Barrier(8)
    errors: list[BaseException] = []

    def send(own: int) -> None:
        try:
            value = {"shared": shared, "own": np.full(MiB // 8, own)}
            start.wait()
            with refshare.sharing(cache=cache, deep=True):
                ray.get(probes[own % 2].describe.remote(value))
        except BaseException as error:  # reported below, in the test's thread
            errors.append(error)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    held = _settled_extra(before, cache.nbytes)
    assert held == cache.nbytes
    # The shared array once, and those of each one's own arrays the cache still keeps: none
    # is sent again, and the cache lets go of what went unused past its reuse horizon.
    assert 24 * MiB <= held < 2 * 24 * MiB
