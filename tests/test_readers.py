"""The batch readers are allow-lists: against the real verl 0.9.1 and tensordict, each case a
hostile user would try arrives as by value, in all three deep modes, across calls and within
one call, with verify on finding no mismatch. Runs where verl and tensordict import."""

from __future__ import annotations

import copy
import copyreg
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import ray
from differential_kit import Probe, describe_fully, first_difference

import refshare

torch = pytest.importorskip("torch")
tensordict = pytest.importorskip("tensordict")
protocol = pytest.importorskip("verl.protocol")

from tensordict import NonTensorStack, TensorDict  # noqa: E402
from verl.protocol import DataProto  # noqa: E402

pytestmark = pytest.mark.usefixtures("local_ray", "fresh")

DEEP = (False, None, True)
ROWS = 16


@pytest.fixture(scope="module")
def probes(local_ray: None) -> list[Any]:
    group = [Probe.remote() for _ in range(2)]
    ray.get([p.ping.remote() for p in group])
    return group


def tensors(seed: int = 0) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, 1000, (ROWS, 128), generator=generator),
        "mask": torch.ones(ROWS, 128, dtype=torch.bool),
    }


def dataproto(batch: Any, **non_tensor: Any) -> Any:
    return DataProto(batch=batch, non_tensor_batch=dict(non_tensor), meta_info={"step": 1})


def by_value(probes: list[Any], value: Any) -> list[Any]:
    return ray.get([p.describe.remote(value) for p in probes])


def assert_as_by_value(probes: list[Any], make: list[Callable[[], Any]], deep: Any) -> None:
    """Send each value made, in order, by value and through refshare: across calls (one
    block each, the cache shared) and within one call (one block for all of them)."""
    expected = [by_value(probes, build()) for build in make]
    for build, want in zip(make, expected, strict=True):
        with refshare.sharing(min_bytes=1 << 10, deep=deep, verify=True):
            got = ray.get([p.describe.remote(build()) for p in probes])
        assert got == want, first_difference(got[0], want[0])
    with refshare.sharing(min_bytes=1 << 10, deep=deep, verify=True):
        for build, want in zip(make, expected, strict=True):
            got = ray.get([p.describe.remote(build()) for p in probes])
            assert got == want, first_difference(got[0], want[0])
    assert refshare.stats().mismatches == 0


def with_non_tensor(value: Any) -> Callable[[], Any]:
    def build() -> Any:
        batch = TensorDict(tensors(), batch_size=[ROWS])
        batch.set_non_tensor("flag", value)
        return dataproto(batch)

    return build


@pytest.mark.parametrize("deep", DEEP)
def test_a_non_tensor_entry_is_never_left_out_of_the_key(probes: list[Any], deep: Any) -> None:
    make = [with_non_tensor(v) for v in ("first", "second", 1, 1.0)]
    assert_as_by_value(probes, make, deep)


@pytest.mark.parametrize("deep", DEEP)
def test_a_non_tensor_stack_arrives(probes: list[Any], deep: Any) -> None:
    def build(words: str) -> Callable[[], Any]:
        def make() -> Any:
            batch = TensorDict(tensors(), batch_size=[ROWS])
            batch["words"] = NonTensorStack(*[words] * ROWS, batch_size=[ROWS])
            return dataproto(batch)

        return make

    assert_as_by_value(probes, [build("wxyz"), build("abcd")], deep)


@pytest.mark.parametrize("deep", DEEP)
def test_a_nested_tensordict_keeps_its_own_size_and_names(probes: list[Any], deep: Any) -> None:
    def build(inner_size: list[int], names: list[str] | None) -> Callable[[], Any]:
        def make() -> Any:
            inner = TensorDict(
                {"x": torch.arange(ROWS * 64.0).reshape(ROWS, 64)}, batch_size=inner_size
            )
            if names is not None:
                inner.names = names
            batch = TensorDict({**tensors(), "inner": inner}, batch_size=[ROWS])
            return dataproto(batch)

        return make

    make = [build([ROWS], None), build([ROWS, 64], None), build([ROWS], ["rows"])]
    assert_as_by_value(probes, make, deep)


class WithTag(DataProto):  # type: ignore[misc]
    """A subclass whose own pickling sends a tag the base class knows nothing of."""

    def __getstate__(self) -> Any:
        return super().__getstate__(), getattr(self, "tag", None)

    def __setstate__(self, state: Any) -> None:
        base, self.tag = state
        super().__setstate__(base)


class ThroughCopyreg(DataProto):  # type: ignore[misc]
    """A subclass pickled through copyreg, with a tag."""


def _reduce_through_copyreg(data: ThroughCopyreg) -> tuple[Any, ...]:
    return _rebuild_through_copyreg, (data.batch, data.non_tensor_batch, data.tag)


def _rebuild_through_copyreg(batch: Any, non_tensor: Any, tag: Any) -> ThroughCopyreg:
    data = ThroughCopyreg(batch=batch, non_tensor_batch=non_tensor, meta_info={})
    data.tag = tag
    return data


copyreg.pickle(ThroughCopyreg, _reduce_through_copyreg)


@pytest.mark.parametrize("cls", [WithTag, ThroughCopyreg])
@pytest.mark.parametrize("deep", DEEP)
def test_a_subclass_with_pickling_of_its_own_is_not_read_as_its_base(
    probes: list[Any], deep: Any, cls: type
) -> None:
    def build(tag: str) -> Callable[[], Any]:
        def make() -> Any:
            data = cls(batch=TensorDict(tensors(), batch_size=[ROWS]), meta_info={})
            data.tag = tag
            return data

        return make

    assert_as_by_value(probes, [build("first"), build("second")], deep)


class Plain(DataProto):  # type: ignore[misc]
    """A subclass that pickles as its base: read as one."""


def test_a_subclass_that_pickles_as_its_base_is_read_as_one() -> None:
    from refshare._keys.tables import builtin_fingerprints

    assert builtin_fingerprints.lookup(Plain) is builtin_fingerprints.lookup(DataProto)
    assert builtin_fingerprints.lookup(WithTag) is None
    assert builtin_fingerprints.lookup(ThroughCopyreg) is None


@pytest.mark.parametrize("deep", DEEP)
def test_a_consolidated_tensordict_whose_entries_moved_on_arrives_as_by_value(
    probes: list[Any], deep: Any
) -> None:
    """Unpickled, a consolidated TensorDict keeps its consolidated storage; tensordict
    decides whether its pickle sends it (0.10: as it is; 0.15: consolidated again)."""

    def unpickled() -> Any:
        return pickle.loads(pickle.dumps(TensorDict(tensors(), batch_size=[ROWS]).consolidate()))

    def replaced() -> Any:
        td = unpickled()
        td["input_ids"] = torch.zeros(ROWS, 128, dtype=torch.int64)
        return td

    def added() -> Any:
        td = unpickled()
        td["extra"] = torch.full((ROWS, 64), 7.0)
        return td

    def deleted() -> Any:
        td = unpickled()
        del td["mask"]
        return td

    assert_as_by_value(probes, [unpickled, replaced, added, deleted], deep)
    assert_as_by_value(probes, [lambda f=f: dataproto(f()) for f in (replaced, added)], deep)


def test_a_dataproto_copied_or_unpickled_is_keyed_as_the_original() -> None:
    """A deep copy or an unpickled ``DataProto`` has a consolidated batch; its pickle is the
    original's (``contiguous()`` drops the consolidation), and so is its key."""
    data = dataproto(TensorDict(tensors(), batch_size=[ROWS]))
    for other in (copy.deepcopy(data), pickle.loads(pickle.dumps(data))):
        assert other.batch._consolidated
        assert pickle.dumps(other) == pickle.dumps(data)
        assert refshare.fingerprint(other) == refshare.fingerprint(data)
    assert not getattr(data.batch.consolidate().contiguous(), "_consolidated", None)


@pytest.mark.parametrize("deep", DEEP)
def test_a_dataproto_with_a_consolidated_batch_arrives_as_by_value(
    probes: list[Any], deep: Any
) -> None:
    def original() -> Any:
        return dataproto(TensorDict(tensors(), batch_size=[ROWS]))

    def written() -> Any:
        data = copy.deepcopy(original())
        data.batch["input_ids"][0, 0] = -1  # through the view, into the consolidated storage
        return data

    def consolidated() -> Any:
        return dataproto(TensorDict(tensors(1), batch_size=[ROWS]).consolidate())

    make = [original, lambda: copy.deepcopy(original()), written, consolidated]
    assert_as_by_value(probes, make, deep)


@pytest.mark.parametrize("deep", DEEP)
def test_chunks_of_a_batch_arrive_as_by_value(probes: list[Any], deep: Any) -> None:
    def chunks() -> list[Any]:
        data = dataproto(TensorDict(tensors(), batch_size=[ROWS]))
        return data.chunk(4)

    make = [lambda i=i: chunks()[i] for i in range(4)]
    assert_as_by_value(probes, make, deep)


@ray.remote(num_cpus=0.05)
def keys_named_in_meta_info(data: Any) -> list[str]:
    """The batch's keys that are the very string objects ``meta_info`` holds."""
    named = {id(s) for s in data.meta_info["keys"]}
    return [key for key in data.batch.keys() if id(key) in named]  # noqa: SIM118 (rows)


@pytest.mark.parametrize("deep", DEEP)
def test_a_batch_shares_no_string_with_meta_info_as_by_value(deep: Any) -> None:
    """By value the batch travels as ``torch.save``'s bytes, a pickle of its own: its keys
    are strings of their own, even where ``meta_info`` names the very same objects."""
    data = dataproto(TensorDict(tensors(), batch_size=[ROWS]))
    data.meta_info["keys"] = list(data.batch.keys())
    expected = ray.get(keys_named_in_meta_info.remote(data))
    with refshare.sharing(min_bytes=1 << 10, deep=deep):
        got = ray.get([keys_named_in_meta_info.remote(data) for _ in range(2)])
    assert got == [expected, expected] == [[], []]


def hook_setstate() -> None:
    """Wrap ``DataProto.__setstate__`` in this process, as a platform that post-processes
    each batch it loads would."""
    original = DataProto.__setstate__

    def hooked(data: Any, state: Any) -> None:
        original(data, state)
        data.meta_info = {**data.meta_info, "seen_by_hook": True}

    DataProto.__setstate__ = hooked


@ray.remote(num_cpus=0.05)
class Patched:
    """A worker whose ``DataProto.__setstate__`` a hook of its own wraps."""

    def __init__(self) -> None:
        hook_setstate()

    def describe(self, value: Any) -> Any:
        return describe_fully(value)


@pytest.mark.parametrize("deep", DEEP)
def test_a_setstate_the_worker_patched_runs_as_by_value(probes: list[Any], deep: Any) -> None:
    """verl's deep rebuild sets the fields itself only where the worker's ``__setstate__``
    is the code the driver read; else it runs the worker's on the state verl sends."""
    worker = Patched.remote()  # type: ignore[attr-defined]
    try:
        value = dataproto(TensorDict(tensors(), batch_size=[ROWS]))
        expected = ray.get(worker.describe.remote(value))
        assert expected != by_value(probes, value)[0]  # the hook ran
        with refshare.sharing(min_bytes=1 << 10, deep=deep, verify=True):
            got = ray.get(worker.describe.remote(value))
        assert got == expected, first_difference(got, expected)
    finally:
        ray.kill(worker)
