"""Deep sharing: each large member of a batch stored once, the batch sent as a skeleton.

Checked from the outside: what each worker received equals what Ray by value gives it,
and refshare's counters show that a grown batch stores only its new members.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import gc
import time
from collections import UserDict
from typing import Any

import numpy as np
import pytest
import ray
from differential_kit import describe_fully as describe

import refshare

pytestmark = pytest.mark.usefixtures("local_ray", "fresh")

N = 3
MEMBER = 1 << 17  # float64 elements: 1 MiB


@ray.remote(num_cpus=0.1)
class Reader:
    def read(self, value: Any) -> Any:
        return describe(value)


@ray.remote(num_cpus=0.1)
class Holder:
    def read(self) -> str:
        return "holder"


@pytest.fixture(scope="module")
def readers(local_ray: None) -> list[Any]:
    group = [Reader.remote() for _ in range(N)]
    ray.get([r.read.remote(0) for r in group])
    return group


def fan_out(readers: list[Any], value: Any) -> list[Any]:
    return ray.get([r.read.remote(value) for r in readers])


deep_fan_out = refshare.shared_args(deep=True)(fan_out)


def member(fill: float) -> np.ndarray:
    return np.full(MEMBER, fill)


@dataclasses.dataclass
class Rollout:
    tokens: np.ndarray
    rewards: np.ndarray
    note: str = "rollout"


class BatchedDataDict(UserDict):  # type: ignore[type-arg]
    """NeMo-RL's batch type is a UserDict subclass with attributes of its own."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.micro_batch_indices = [[0, 4]]


class Plain:
    def __init__(self) -> None:
        self.weights = member(6.0)
        self.step = 3


def batches() -> list[Any]:
    return [
        {"a": member(1.0), "b": member(2.0).reshape(256, 512).T, "small": np.arange(10)},
        [member(1.0), (member(3.0), "text")],
        Rollout(member(4.0), np.ones(MEMBER, dtype=np.float32)),
        BatchedDataDict({"input_ids": member(5.0), "mask": np.ones(100, dtype=bool)}),
        Plain(),
    ]


@pytest.mark.parametrize("index", range(5), ids=["dict", "list", "dataclass", "userdict", "obj"])
def test_workers_receive_what_they_receive_by_value(readers: list[Any], index: int) -> None:
    value = batches()[index]
    assert deep_fan_out(readers, value) == fan_out(readers, value)
    stats = refshare.stats()
    assert stats.puts >= 1 and stats.by_value == 0, stats


def test_aliasing_read_only_flags_and_views(readers: list[Any]) -> None:
    a = member(7.0)
    value = {"a": a, "alias": a, "view": member(8.0)[::2], "small": np.zeros(4)}
    shared = deep_fan_out(readers, value)
    assert shared == fan_out(readers, value)
    for seen in shared:  # one object under two keys, as by value
        items = dict(seen[0][1][1])
        assert items[describe("alias")[0]] == ("same", items[describe("a")[0]][0])
    stats = refshare.stats()  # a once, the view (a C copy, as by value) once: in one object
    assert (stats.puts, stats.bytes_put) == (1, MEMBER * 8 + MEMBER * 4), stats


class Point:
    def __init__(self, x: int) -> None:
        self.x = x


@pytest.mark.parametrize("deep", [None, False, True], ids=["default", "top-level", "deep"])
def test_objects_of_one_class_are_each_pickled_as_they_pickle(
    readers: list[Any], deep: bool | None
) -> None:
    # A split asks once per class whether pickle's own reduction sends its objects; an
    # object with a pickling hook of its own is still sent as its hook says. To 3 workers
    # in a call, in two calls.
    hooked = Point(3)
    hooked.__reduce_ex__ = lambda protocol: (str, (f"hooked {hooked.x}",))  # type: ignore[method-assign]
    value = {"m": member(1.0), "points": [Point(1), Point(2), hooked, Point(4)],
             "scalars": [np.int32(5), np.float64(2.5), np.int32(6)]}  # fmt: skip
    by_value = fan_out(readers, value)
    shared_fan_out = refshare.shared_args(deep=deep)(fan_out)
    for _ in range(2):
        assert shared_fan_out(readers, value) == by_value
        assert refshare.stats().puts == 1
    items = dict(by_value[0][0][1][1])  # the dict's items, by their described keys
    points = items[describe("points")[0]][1][1]  # each point described
    assert describe("hooked 3")[0] in points


def test_torch_members_bf16_views_and_inference_mode(readers: list[Any]) -> None:
    torch = pytest.importorskip("torch")
    parent = torch.randn(512, 1024)
    with torch.inference_mode():
        log_probs = torch.randn(256, 1024)
    value = {
        "bf16": torch.randn(256, 1024).to(torch.bfloat16),
        "view": parent[:128],  # pickled with its parent's whole storage, as by value
        "log_probs": log_probs,
        "small": torch.ones(3),
    }
    assert deep_fan_out(readers, value) == fan_out(readers, value)
    stats = refshare.stats()  # the three large members in one object, the view's parent whole
    bf16, parent, log_probs = 256 * 1024 * 2, 512 * 1024 * 4, 256 * 1024 * 4
    assert (stats.puts, stats.bytes_put) == (1, bf16 + parent + log_probs), stats


def test_nested_refs_and_actor_handles_keep_working(readers: list[Any]) -> None:
    holder = Holder.remote()
    inner = ray.put(np.arange(5))
    value = {"weights": member(9.0), "ref": inner, "actor": holder}
    assert deep_fan_out(readers, value) == fan_out(readers, value)
    del value
    assert ray.get(inner).tolist() == [0, 1, 2, 3, 4]  # the driver's ref is still good
    assert ray.get(holder.read.remote()) == "holder"


def test_a_grown_batch_stores_only_its_new_members(readers: list[Any]) -> None:
    batch = {"input_ids": member(1.0), "attention_mask": member(2.0)}
    deep_fan_out(readers, batch)
    stats = refshare.stats()  # both new: stored together, in one object
    assert (stats.puts, stats.bytes_put) == (1, 2 * MEMBER * 8), stats
    grown = dict(batch, old_log_probs=member(3.0))  # batch.union(...) in verl terms
    refshare.reset_stats()
    assert deep_fan_out(readers, grown) == fan_out(readers, grown)
    stats = refshare.stats()
    assert (stats.puts, stats.bytes_put) == (1, MEMBER * 8), stats
    # The first worker's send finds the two unchanged members again by content; each next
    # worker's finds the whole batch, its three members, split already in this call.
    assert stats.hits == 2 + (N - 1) * 3
    assert stats.bytes_saved == (2 + (N - 1) * 3) * MEMBER * 8
    again = copy.deepcopy(grown)  # equal content, new objects (a slice made again)
    refshare.reset_stats()
    deep_fan_out(readers, again)
    assert refshare.stats().puts == 0


@pytest.mark.verify_off  # counts serializations, which verify adds to
def test_each_tensor_with_a_serializer_of_its_own_is_serialized_once_per_call(
    readers: list[Any],
) -> None:
    """Counted with a serializer registered with Ray for tensors, which decides what they
    are sent as (so refshare keys them by what it sends, not by their bytes): once per
    tensor a call, whatever the number of workers, a grown batch's old tensors too."""
    torch = pytest.importorskip("torch")
    serialized: list[tuple[int, ...]] = []

    def serialize(t: Any) -> Any:
        serialized.append(tuple(t.shape))
        return t.numpy().copy()

    ray.util.register_serializer(torch.Tensor, serializer=serialize, deserializer=torch.from_numpy)
    try:
        batch = {"input_ids": torch.ones(256, 512), "mask": torch.zeros(512, 256), "step": 1}
        assert deep_fan_out(readers, batch) == fan_out(readers, batch)
        # Once each for deep sharing, then once each per worker by value:
        assert serialized == [(256, 512), (512, 256)] + [(256, 512), (512, 256)] * N
        serialized.clear()
        grown = dict(batch, old_log_probs=torch.full((128, 1024), 3.0))
        deep_fan_out(readers, grown)
        assert serialized == [(256, 512), (512, 256), (128, 1024)]
    finally:
        ray.util.deregister_serializer(torch.Tensor)


@pytest.mark.verify_off  # counts pickles, which verify adds to
def test_the_workers_rebuild_is_pickled_by_value_once_per_process(
    readers: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The function a worker rebuilds a skeleton with travels by value (the worker needs no
    refshare), and cloudpickle would pickle its code and helpers each time a skeleton is
    pickled: it is pickled once per process, and every skeleton carries that pickle."""
    from ray.cloudpickle import cloudpickle

    pickled: list[str] = []
    original = cloudpickle.Pickler._dynamic_function_reduce

    def counted(self: Any, function: Any) -> Any:
        if function.__module__ == "refshare._wire.bootstrap":
            pickled.append(function.__name__)
        return original(self, function)

    monkeypatch.setattr(cloudpickle.Pickler, "_dynamic_function_reduce", counted)
    for step in range(4):  # new content each call: a new skeleton put each time
        batch = {"a": member(float(step)), "b": member(-float(step)), "note": "x"}
        assert deep_fan_out(readers, batch) == fan_out(readers, batch)
    # Each call: its two members in one bundle; the skeleton, small, goes inline with each
    # of the call's tasks, pickled by Ray once per task.
    assert refshare.stats().puts == 4
    assert pickled.count("rebuild_skeleton") <= 1


class Tally:
    """Counts how many times the driver pickles it: once per split of what holds it."""

    pickled = 0

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        Tally.pickled += 1
        return Tally, ()


@pytest.mark.verify_off  # counts pickles, which verify adds to
def test_a_batch_of_many_thousand_members_is_split_once_per_call(readers: list[Any]) -> None:
    """Past ten thousand objects to walk (6,000 members and their names), sent to every
    worker of one call: split once, not once per ``.remote()``, and every worker receives
    what it receives by value."""
    members = {f"m{i:05d}": np.full(1024, i % 251, dtype=np.uint8) for i in range(6000)}
    batch = {"members": members, "tally": Tally()}
    expected = fan_out(readers, batch)
    Tally.pickled = 0
    with refshare.sharing(deep=True, min_bytes=1024, cache=refshare.RefCache()):
        assert fan_out(readers, batch) == expected
    assert Tally.pickled == 1
    assert refshare.stats().puts == 2  # the members in one bundle, and the skeleton


def test_members_are_freed_without_waiting_for_the_cycle_collector(
    readers: list[Any],
) -> None:
    """Once the cache drops them, Ray's reference counts of the members fall to nothing,
    with Python's cycle collector off: no cycle in refshare keeps a member's ref."""
    core = ray._private.worker.global_worker.core_worker
    held_before = set(core.get_all_reference_counts())
    gc.disable()
    try:
        deep_fan_out(readers, {"a": member(1.0), "b": member(2.0), "step": 1})
        assert refshare.stats().puts == 1  # the members; the small skeleton goes inline
        refshare.clear()
        deadline = time.monotonic() + 10
        while set(core.get_all_reference_counts()) - held_before and time.monotonic() < deadline:
            time.sleep(0.05)  # the workers' borrowed refs are released asynchronously
        assert set(core.get_all_reference_counts()) - held_before == set()
    finally:
        gc.enable()


def test_a_member_changed_within_one_call_is_sent_anew(readers: list[Any]) -> None:
    batch = {"x": member(1.0), "y": member(2.0)}

    @refshare.shared_args(deep=True)
    def change_midway() -> list[Any]:
        first = ray.get(readers[0].read.remote(batch))
        batch["x"][:] = 5.0
        return [first, ray.get(readers[1].read.remote(batch))]

    first, second = change_midway()
    assert first == ray.get(readers[0].read.remote({"x": member(1.0), "y": member(2.0)}))
    assert second == ray.get(readers[1].read.remote({"x": member(5.0), "y": member(2.0)}))


def test_puts_in_a_deep_scope_store_members(readers: list[Any]) -> None:
    batch = {"a": member(1.0), "b": member(2.0)}
    with refshare.sharing(deep=True):
        first = ray.put(batch)
        grown = ray.put(dict(batch, c=member(3.0)))
    by_value = ray.put(dict(batch, c=member(3.0)))  # outside the scope: Ray's own put
    assert describe(ray.get(grown)) == describe(ray.get(by_value))
    assert describe(ray.get(first)) == describe(ray.get(ray.put(batch)))
    stats = refshare.stats()  # a and b together, c alone, two skeletons
    assert (stats.puts, stats.hits) == (2 + 2, 2), stats
    assert stats.bytes_put - 3 * MEMBER * 8 < 4096, stats


@pytest.mark.parametrize("how", ["fan-out", "put"])
def test_a_split_value_sent_again_in_a_call_counts_as_saved(readers: list[Any], how: str) -> None:
    """Sent to N workers (or put N times) in one call, a split value is stored once: the
    N - 1 sends after the first save what by value would store again, and are counted so,
    whether the scope splits it again or finds it split already."""
    batch = {"a": member(1.0), "b": member(2.0), "tag": "step"}
    members = 2 * MEMBER * 8

    @refshare.shared_args(deep=True)
    def send() -> Any:
        if how == "put":
            refs = [ray.put(batch) for _ in readers]
            return ray.get([r.read.remote(ref) for r, ref in zip(readers, refs, strict=True)])
        return fan_out(readers, batch)

    refshare.reset_report()
    assert send() == fan_out(readers, batch)
    stats, row = refshare.stats(), refshare.report().rows[0]
    assert stats.puts == (2 if how == "put" else 1)  # the members together; a put's skeleton
    assert stats.bytes_saved == row.bytes_repeated == row.bytes_repeated_in_call
    assert (N - 1) * members <= stats.bytes_saved < (N - 1) * (members + 4096)
    assert row.bytes_repeated_members == (N - 1) * members


def test_a_value_put_again_after_a_change_is_put_as_it_is_now(readers: list[Any]) -> None:
    """A value put once is stamped only when it is put again (most are put once: their ref
    is what travels); put again after a change, it is put as it is now, and put a third
    time unchanged, it is the second put's ref."""
    batch = {"a": member(1.0), "b": member(2.0)}
    with refshare.sharing(deep=True):
        first = ray.put(batch)
        batch["a"][0] = -1.0
        second = ray.put(batch)
        third = ray.put(batch)
    assert ray.get(first)["a"][0] == 1.0
    assert ray.get(second)["a"][0] == -1.0 and ray.get(third)["a"][0] == -1.0
    assert second != first and third == second


def test_members_a_small_cache_cannot_hold_together_are_stored_again(
    readers: list[Any],
) -> None:
    # Room for one member: its bytes and the few hundred Ray stores with them.
    cache = refshare.RefCache(max_bytes=MEMBER * 8 + 4096)
    deep = refshare.shared_args(deep=True, cache=cache)(fan_out)
    batch = {"a": member(1.0), "b": member(2.0)}
    puts = []
    for _ in range(2):
        assert deep(readers, batch) == fan_out(readers, batch)
        puts.append(refshare.stats().puts)
    # a and b were stored in one object: the cache, with room for one, kept neither (nor
    # evicted anything for them), as keeping one would keep both alive. What it did not
    # keep is stored again: never a dangling ref.
    assert puts == [1, 2], puts
    assert refshare.stats().evictions == 0 and len(cache) == 0 and cache.nbytes == 0


@ray.remote(num_cpus=0.1)
class AsyncReader:
    async def read(self, value: Any) -> Any:
        from ray._private import worker

        await asyncio.sleep(0)
        return sorted(value), worker.blocking_get_inside_async_warned


def test_async_actors_get_it_without_a_blocking_get_warning() -> None:
    actor = AsyncReader.remote()
    batch = {"a": member(1.0), "b": member(2.0)}

    @refshare.shared_args(deep=True)
    def send() -> list[Any]:
        return ray.get([actor.read.remote(batch) for _ in range(4)])

    assert send() == [(["a", "b"], False)] * 4
    ray.kill(actor)


def test_a_worker_without_refshare_rebuilds_a_deep_shared_argument() -> None:
    from helpers import WithoutRefshare

    worker = WithoutRefshare.remote()
    batch = {"a": member(1.0), "b": member(2.0), "step": 3}

    @refshare.shared_args(deep=True)
    def send() -> Any:
        return ray.get(worker.receive.remote(batch))

    assert send() == ray.get(worker.receive.remote(batch))  # as by value, without refshare
    assert refshare.stats().puts == 1  # both members, stored together
    ray.kill(worker)
