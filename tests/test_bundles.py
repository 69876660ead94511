"""Bundles: the new members of a split argument stored in one object, which the worker
fetches once however many members it holds, deserializes in time independent of them, and
rebuilds only the members its skeleton names, each as by value (arrays on the dtype object
the rest of the value names, tensors in torch's own state); and which the cache weighs
whole, as Ray's object store holds it (read from Ray's reference table and object sizes,
not refshare's counters), under eviction and with scopes on several threads sharing one
cache."""

from __future__ import annotations

import gc
import sys
import threading
import time
from collections import deque
from typing import Any

import numpy as np
import pytest
import ray
from differential_kit import Probe, first_difference, tensor_state

import refshare
from refshare._deep import Bundled, Skeleton, split
from refshare._keys.tables import Keyed
from refshare._wire.serialized import JOIN_BELOW, bundle_form
from refshare._wire.tensors import elements_form, tensor_form

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


def test_a_bundle_is_three_buffers_and_one_per_large_piece() -> None:
    """What a worker's get deserializes: the index, the small pieces joined and each large
    piece, however many small members the bundle holds (Ray's cost per buffer is what made
    a skeleton naming 10 of 40,000 members cost the whole bundle)."""
    small = [np.full(128, i) for i in range(1000)]
    large = [np.ones(JOIN_BELOW // 8), np.ones(JOIN_BELOW)]
    form = bundle_form([*small, *large])
    assert form is not None
    _, joined, apart = form
    assert [piece.raw().nbytes for piece in apart] == [JOIN_BELOW, 8 * JOIN_BELOW]
    assert sum(a.nbytes for a in small) <= joined.raw().nbytes < 2 * sum(a.nbytes for a in small)


def mixed(n: int, fill: float = 0.0) -> dict[str, Any]:
    """Members of every kind a bundle lays out: arrays C, F and strided, of a structured,
    a byte-swapped and a datetime dtype; ``bytes``; tensors; small ones and large ones."""
    record = np.dtype([("a", "<i4"), ("b", ">f8")])
    value: dict[str, Any] = {}
    for i in range(n):
        kind = i % 7
        if kind == 0:
            value[f"c{i}"] = np.full(128, i + fill)
        elif kind == 1:
            value[f"f{i}"] = np.asfortranarray(np.full((16, 8), i + fill))
        elif kind == 2:
            value[f"n{i}"] = np.full((32, 8), i + fill)[:, ::2]
        elif kind == 3:
            value[f"s{i}"] = np.array([(i, i + fill)] * 128, dtype=record)
        elif kind == 4:
            value[f"w{i}"] = np.full(3000 if i % 2 else 128, i + fill, dtype=">f8")
        elif kind == 5:
            value[f"d{i}"] = np.arange(128).astype("M8[s]") + i
        else:
            value[f"b{i}"] = bytes([i % 256]) * 1024
    value["large"] = np.full(JOIN_BELOW, fill)
    torch = sys.modules.get("torch")
    if torch is not None:
        value["t"] = torch.full((64, 4), fill)
        value["t-view"] = torch.arange(4096.0)[100:600:2]
        value["t-bf16"] = torch.full((JOIN_BELOW,), fill, dtype=torch.bfloat16)
        value["t-grad"] = torch.full((64,), fill, requires_grad=True)
    return value


@pytest.mark.parametrize("deep", [True, None], ids=["deep", "default"])
def test_a_few_members_of_a_large_bundle_arrive_as_by_value(
    probes: list[Any], deep: bool | None
) -> None:
    """A batch stored as one bundle, then batches naming a few of its members (the first,
    the last, the large ones, the tensors), then the whole batch again."""
    pytest.importorskip("torch")
    whole = mixed(700)
    names = list(whole)
    picks = [names[:3], names[-5:], names[300:310], ["large", "n2", "s3", "d5"]]
    for value in (whole, *({k: whole[k] for k in pick} for pick in picks), whole):
        expected = by_value(probes, value)
        with refshare.sharing(min_bytes=1 << 10, deep=deep):
            got = by_value(probes, value)
        assert first_difference(expected, got) is None


# -- what a member arrives as -----------------------------------------------------------------


def dtyped(n: int) -> dict[str, Any]:
    """Arrays sharing a dtype object, and the dtypes themselves as values."""
    record = np.dtype([("a", "<i4"), ("b", ">f8")], metadata={"unit": "m"})
    rows = np.zeros(n, dtype=record)
    return {
        "a": np.full(n, 1.0),
        "dt": np.dtype("float64"),  # the one float64 dtype numpy hands out
        "b": np.full(n, 2.0),
        "small": np.full(4, 3.0),
        "strided": np.full((n, 2), 4.0)[:, 0],
        "rows": rows,
        "more rows": rows.copy(),  # its own dtype object? numpy decides: as by value
        "record": rows.dtype,
    }


@pytest.mark.parametrize("deep", [True, None], ids=["deep", "default"])
def test_members_keep_the_dtype_object_the_value_names(
    probes: list[Any], deep: bool | None
) -> None:
    """By value one pickle makes one dtype object of each dtype object the value names
    (``v["dt"] is v["a"].dtype``); split, an array's dtype stays in the skeleton. Members
    stored alone (sent before), in a bundle, found again, and inline, in one value."""
    value = dtyped(1 << 12)
    again = {"b": value["b"], "dt": value["b"].dtype}
    for sent in ({"a": value["a"]}, value, value, again):
        expected = by_value(probes, sent)
        with refshare.sharing(min_bytes=1 << 10, deep=deep):
            got = by_value(probes, sent)
        assert first_difference(expected, got) is None


@ray.remote
def dtypes_are_one(value: dict[str, Any]) -> bool:
    return all(t.dtype is value["dt"] for t in value["tensors"])


def test_tensor_dtypes_are_torchs_own_objects(probes: list[Any]) -> None:
    """``torch.dtype`` objects pickle by name, as torch's singletons: a tensor's dtype is
    the value's dtype object both ways, however it was stored."""
    torch = pytest.importorskip("torch")
    tensors = [torch.ones(1 << 12), torch.zeros(1 << 12), torch.ones(4)]
    value = {"tensors": tensors, "dt": torch.float32}
    assert ray.get(dtypes_are_one.remote(value))
    for deep in (True, None):
        with refshare.sharing(min_bytes=1 << 10, deep=deep):
            assert ray.get(dtypes_are_one.remote(value))


def tensors() -> list[Any]:
    """Plain CPU tensors of the dtypes and layouts torch pickles from a storage."""
    torch = pytest.importorskip("torch")
    base = torch.arange(4096.0)
    return [
        base,
        base[100:700:3],
        base.reshape(64, 64).t(),
        torch.ones(2048, dtype=torch.bfloat16),
        torch.ones(4096, dtype=torch.bool),
        torch.ones(512, dtype=torch.complex64),
        torch.ones(2048, requires_grad=True),
        torch.tensor(3.0),
        torch.ones(0),
    ]


def test_a_tensor_rebuilt_from_its_bytes_is_in_torchs_own_state() -> None:
    """Everything torch's own unpickling sets, compared attribute by attribute (every data
    descriptor of ``torch.Tensor``, its ``__dict__``, its storage's attributes, torch's
    metadata): rebuilt from refshare's form (whole storage, or its own elements) against
    unpickled from torch's pickle."""
    import pickle

    for t in tensors():
        by_torch = pickle.loads(pickle.dumps(t, protocol=5))
        ours = pickle.loads(pickle.dumps(tensor_form(t), protocol=5))
        assert tensor_state(ours) == tensor_state(by_torch), t
        assert vars(ours) == vars(by_torch) and ours._version == by_torch._version
        compact = pickle.loads(pickle.dumps(t.contiguous(), protocol=5))
        elements = pickle.loads(pickle.dumps(elements_form(t), protocol=5))
        assert tensor_state(elements) == tensor_state(compact), t


@pytest.mark.parametrize("deep", [False, True, None], ids=["top-level", "deep", "default"])
def test_tensors_arrive_in_torchs_own_state_on_every_route(
    probes: list[Any], deep: bool | None
) -> None:
    """Stored alone, as members alone and in bundles, and inline in a skeleton (under
    ``min_bytes``): each as by value, its torch state included."""
    torch = pytest.importorskip("torch")
    value = {f"t{i}": t for i, t in enumerate(tensors())}
    for sent in (value["t0"], {"t0": value["t0"]}, value, {**value, "new": torch.zeros(4096)}):
        expected = by_value(probes, sent)
        with refshare.sharing(min_bytes=1 << 10, deep=deep):
            got = by_value(probes, sent)
        assert first_difference(expected, got) is None


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


def test_equal_members_are_stored_once_and_the_cache_lets_go_of_them(
    probes: list[Any],
) -> None:
    """Two distinct, equal members in each batch (two masks of ones), new every step, under
    a budget that evicts: each content is stored once, each arrives as its own array, and
    what Ray holds is what the cache weighs, within budget; emptied, the store holds
    nothing for it (refshare used to count such a bundle twice and let go of it once,
    pinning it, until the cache was over budget with nothing in it)."""
    cache = refshare.RefCache(max_bytes=6 * MiB)
    before = _held_by_driver()
    for step in range(6):
        value = {"a": np.full(MiB // 8, step), "b": np.full(MiB // 8, step), "c": np.arange(step)}
        expected = by_value(probes, value)
        counted = refshare.stats()
        with refshare.sharing(cache=cache, deep=True):
            got = by_value(probes, value)
        assert first_difference(expected, got) is None
        stats = refshare.stats()  # the second mask found in the call, not counted as put
        assert stats.bytes_put - counted.bytes_put < 2 * MiB, f"step {step}"
        assert stats.hits - counted.hits >= 1, f"step {step}"
        del value
        held = _settled_extra(before, cache.nbytes)
        assert held == cache.nbytes <= cache.max_bytes, f"step {step}: Ray holds {held}"
    assert cache.shrink(cache.nbytes) > 0 and len(cache) == 0 and cache.nbytes == 0
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
