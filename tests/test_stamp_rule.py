"""The stamp rule, from the outside: within one call, only a leaf of 256 KiB or more is
trusted by its stamp (the documented blind spot); a smaller one is hashed each time it is
sent, at every depth and in every deep mode, so a change in place anywhere in it arrives.

Each change writes one element that the spot check does not read (it reads 512 evenly
spaced elements), so only a full hash sees it. What the worker describes of each send
through refshare is compared with what it describes of the same value sent by value at
that moment (a nested ``sharing(enabled=False)`` block).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import ray
from differential_kit import Probe, first_difference

import refshare

pytestmark = pytest.mark.usefixtures("local_ray", "fresh")

MIN_BYTES = 100 << 10  # refshare's default min_bytes, passed explicitly
STAMP_MIN_BYTES = 256 << 10  # the documented bound of the blind spot
SMALL = 200 << 10  # below the bound, above MIN_BYTES: a member of its own when split
SPOT_CHECK_ELEMENTS = 512
DEEP_MODES = pytest.mark.parametrize("deep", [False, None, True], ids=["flat", "auto", "deep"])

#: A value, and how to change it in place where no spot check looks.
Case = tuple[Any, Callable[[], None]]


@pytest.fixture(scope="module")
def probe(local_ray: None) -> Any:
    return Probe.remote()  # type: ignore[attr-defined]


def unsampled(size: int) -> int:
    """An element between two of the evenly spaced ones a spot check of ``size`` reads."""
    count = min(size, SPOT_CHECK_ELEMENTS)
    sampled = np.arange(count, dtype=np.intp) * (size - 1) // max(count - 1, 1)
    gaps = np.flatnonzero(np.diff(sampled) > 1)
    assert gaps.size, f"a spot check reads all {size} elements"
    index = int(sampled[gaps[gaps.size // 2]]) + 1  # mid-array, just past a sampled element
    assert index not in set(sampled.tolist())
    return index


def poke(arr: np.ndarray) -> Callable[[], None]:
    """Change one element of ``arr`` in place, where its spot check does not read."""
    flat = arr.reshape(-1)
    assert np.shares_memory(flat, arr)
    index = unsampled(flat.size)
    return lambda: flat.__setitem__(index, flat[index] + 1)


def large() -> np.ndarray:
    return np.arange(float(1 << 17))  # 1 MiB: a member of its own, and stamped


def small() -> np.ndarray:
    arr = np.arange(float(SMALL // 8))
    assert MIN_BYTES <= arr.nbytes < STAMP_MIN_BYTES
    return arr


def sent_then_changed(
    probe: Any, value: Any, change: Callable[[], None], **options: Any
) -> tuple[list[Any], list[Any]]:
    """Within one ``sharing`` block: send ``value``, change it in place, send it again.
    What the worker saw of each send through refshare, and of each sent by value then."""
    shared, by_value = [], []
    with refshare.sharing(min_bytes=MIN_BYTES, **options):
        for step in range(2):
            if step:
                change()
            shared.append(ray.get(probe.describe.remote(value), timeout=60))
            with refshare.sharing(enabled=False):
                by_value.append(ray.get(probe.describe.remote(value), timeout=60))
    assert by_value[0] != by_value[1], "the change must show by value"
    return shared, by_value


def assert_received_as_by_value(shared: list[Any], by_value: list[Any]) -> None:
    for step, (seen, expected) in enumerate(zip(shared, by_value, strict=True)):
        difference = first_difference(expected, seen)
        assert difference is None, f"send {step}: {difference[1] if difference else ''}"


# -- caught: a small leaf is hashed each time it is sent ---------------------------------------


def small_member() -> Case:
    """A 200 KiB array next to a large member: the dict is split, the array is a member."""
    value = {"big": large(), "small": small()}
    return value, poke(value["small"])


def small_inline() -> Case:
    """An array below ``min_bytes``, inlined in a split dict's skeleton."""
    value = {"big": large(), "tiny": np.arange(5000.0)}
    return value, poke(value["tiny"])


def small_nested() -> Case:
    """A 200 KiB array three levels down, in a list inside a dict inside a tuple."""
    inner = small()
    value = ({"big": large(), "rows": [np.arange(10.0), inner]}, "tag")
    return value, poke(inner)


def small_top_level() -> Case:
    value = small()
    return value, poke(value)


def small_with_attributes() -> Case:
    """An object (a class of this module, sent by name) holding a small array."""
    value = Holder(large(), small())
    return value, poke(value.small)


class Holder:
    def __init__(self, big: np.ndarray, small: np.ndarray) -> None:
        self.big = big
        self.small = small


CASES = {
    "member": small_member,
    "inlined": small_inline,
    "nested": small_nested,
    "top-level": small_top_level,
    "attribute": small_with_attributes,
}


@DEEP_MODES
@pytest.mark.parametrize("case", CASES)
def test_a_small_array_changed_within_one_call_arrives_new(
    probe: Any, case: str, deep: bool | None
) -> None:
    value, change = CASES[case]()
    assert_received_as_by_value(*sent_then_changed(probe, value, change, deep=deep))


def torch_or_skip() -> Any:
    return pytest.importorskip("torch")


def behind_torchs_back(t: Any) -> Callable[[], None]:
    """A write through ``.numpy()``, which torch's version counter does not see."""
    before = t._version
    change = poke(t.numpy())

    def write() -> None:
        change()
        assert t._version == before

    return write


@DEEP_MODES
@pytest.mark.parametrize("where", ["member", "inlined", "top-level", "view"])
def test_a_small_tensor_changed_behind_torchs_back_arrives_new(
    probe: Any, where: str, deep: bool | None
) -> None:
    torch = torch_or_skip()
    if where == "inlined":
        t = torch.arange(5000.0)  # 20 KB: below min_bytes, in the skeleton
    elif where == "view":
        t = torch.arange(float(SMALL // 4))[: SMALL // 8]  # a view of a small storage
    else:
        t = torch.arange(float(SMALL // 4))  # float32: 200 KiB of storage
    assert t.untyped_storage().nbytes() < STAMP_MIN_BYTES
    change = behind_torchs_back(t._base if t._base is not None else t)
    value = t if where == "top-level" else {"big": large(), "t": t}
    assert_received_as_by_value(*sent_then_changed(probe, value, change, deep=deep))


@DEEP_MODES
def test_a_small_inference_mode_tensor_in_a_split_dict_arrives_new(
    probe: Any, deep: bool | None
) -> None:
    torch = torch_or_skip()
    with torch.inference_mode():
        t = torch.arange(float(SMALL // 4))
    value = {"big": large(), "t": t}
    index = unsampled(t.numel())

    def change() -> None:
        with torch.inference_mode():
            t[index] += 1  # no version counter to move

    assert_received_as_by_value(*sent_then_changed(probe, value, change, deep=deep))


@DEEP_MODES
def test_a_sparse_matrix_changed_within_one_call_arrives_new(probe: Any, deep: bool | None) -> None:
    sparse = pytest.importorskip("scipy.sparse")
    n = SMALL // 8
    matrix = sparse.csr_matrix(
        (np.arange(1.0, n + 1), np.arange(n) % 1000, np.arange(n + 1)), shape=(n, 1000)
    )
    assert matrix.data.nbytes < STAMP_MIN_BYTES
    value = {"big": large(), "m": matrix}
    assert_received_as_by_value(*sent_then_changed(probe, value, poke(matrix.data), deep=deep))


@DEEP_MODES
def test_a_small_array_changed_again_and_again_arrives_new_each_time(
    probe: Any, deep: bool | None
) -> None:
    value = {"big": large(), "small": small()}
    change = poke(value["small"])
    shared, by_value = [], []
    with refshare.sharing(min_bytes=MIN_BYTES, deep=deep):
        for step in range(4):
            if step % 2:
                change()
            shared.append(ray.get(probe.describe.remote(value), timeout=60))
            with refshare.sharing(enabled=False):
                by_value.append(ray.get(probe.describe.remote(value), timeout=60))
    assert by_value[0] != by_value[1] == by_value[2] != by_value[3]  # changed at 1 and 3
    assert_received_as_by_value(shared, by_value)


@DEEP_MODES
@pytest.mark.parametrize("change", ["requires_grad", "dtype"])
def test_a_large_tensors_metadata_changed_within_one_call_arrives_new(
    probe: Any, change: str, deep: bool | None
) -> None:
    # Neither moves the version counter, and the spot-checked bytes stay the same: the
    # stamp itself must cover them.
    torch = torch_or_skip()
    t = torch.zeros(STAMP_MIN_BYTES // 4)  # float32: just large enough to be stamped
    value = {"big": large(), "t": t}

    def flip() -> None:
        if change == "requires_grad":
            t.requires_grad_(True)
        else:
            t.data = t.data.view(torch.int32)

    assert_received_as_by_value(*sent_then_changed(probe, value, flip, deep=deep))


# -- not caught: the documented blind spot, a leaf of 256 KiB or more --------------------------


def large_top_level() -> Case:
    value = large()
    return value, poke(value)


def large_member() -> Case:
    value = {"big": large(), "other": large()}
    return value, poke(value["big"])


def tensor_set_on_another_tensors_storage() -> Case:
    torch = torch_or_skip()
    owner = torch.arange(float(1 << 17))  # float32, 512 KiB: stamped
    t = torch.empty(0).set_(owner.untyped_storage(), 0, owner.shape)  # a counter of its own
    index = unsampled(owner.numel())

    def write() -> None:  # through torch's own operation, on the other tensor
        before = t._version
        owner[index : index + 1].add_(1)
        assert t._version == before

    return {"t": t, "other": large()}, write


BLIND = {
    "top-level": large_top_level,
    "member": large_member,
    "tensor set_ on a storage": tensor_set_on_another_tensors_storage,
}


@pytest.mark.verify_off  # what refshare sends without verify; verify catches it
@DEEP_MODES
@pytest.mark.parametrize("case", BLIND)
def test_documented_blind_spot_a_large_array_changed_within_one_call(
    probe: Any, case: str, deep: bool | None
) -> None:
    # docs/guarantees.md, "A change in place within one call can be missed": an array of
    # 256 KiB or more, changed in place between two sends of one call where none of its
    # 512 spot-checked elements is, is trusted by its stamp and sent with its first content.
    value, change = BLIND[case]()
    shared, by_value = sent_then_changed(probe, value, change, deep=deep)
    assert shared == [by_value[0], by_value[0]] != by_value


@pytest.mark.mismatches_expected
@DEEP_MODES
@pytest.mark.parametrize("case", BLIND)
def test_verify_mode_closes_the_blind_spot(probe: Any, case: str, deep: bool | None) -> None:
    """Under verify, the same change is caught: a mismatch, and the second send by value."""
    value, change = BLIND[case]()
    refshare.reset_stats()
    shared, by_value = sent_then_changed(probe, value, change, deep=deep, verify=True)
    assert_received_as_by_value(shared, by_value)
    assert refshare.stats().mismatches >= 1


@DEEP_MODES
@pytest.mark.parametrize("case", BLIND)
def test_a_large_array_changed_between_two_calls_arrives_new(
    probe: Any, case: str, deep: bool | None
) -> None:
    value, change = BLIND[case]()
    shared, by_value = [], []
    for step in range(2):
        if step:
            change()
        with refshare.sharing(min_bytes=MIN_BYTES, deep=deep):
            shared.append(ray.get(probe.describe.remote(value), timeout=60))
        by_value.append(ray.get(probe.describe.remote(value), timeout=60))
    assert by_value[0] != by_value[1]
    assert_received_as_by_value(shared, by_value)


def put_then_changed(
    probe: Any, value: Any, changes: list[Callable[[], None]], deep: bool | None = None
) -> tuple[list[Any], list[Any]]:
    """Within one ``sharing`` block: ``ray.put`` ``value``, then after each change put it
    again; each ref's content as the worker sees it, against ``value`` by value then."""
    shared, by_value = [], []
    with refshare.sharing(min_bytes=MIN_BYTES, deep=deep):
        for change in [lambda: None, *changes]:
            change()
            shared.append(ray.get(probe.describe.remote(ray.put(value)), timeout=60))
            with refshare.sharing(enabled=False):
                by_value.append(ray.get(probe.describe.remote(ray.put(value)), timeout=60))
    return shared, by_value


@pytest.mark.verify_off  # its third put is the blind spot, which verify closes
def test_a_large_tensor_put_once_is_hashed_again_when_put_again(probe: Any) -> None:
    """A tensor first seen in a ``ray.put`` is not stamped then (most values are put once):
    put again, it is hashed again, so a change behind torch's back arrives; from then on it
    is stamped, and the documented blind spot applies to its later puts."""
    torch = torch_or_skip()
    t = torch.arange(float(1 << 18))  # float32: 1 MiB, stamped once seen twice
    change = behind_torchs_back(t)
    shared, by_value = put_then_changed(probe, t, [change, change])
    assert by_value[0] != by_value[1] != by_value[2]
    assert shared[:2] == by_value[:2]  # the first change, caught by hashing again
    assert shared[2] == shared[1] != by_value[2]  # the second one: the blind spot


@pytest.mark.verify_off  # its third put is the blind spot, which verify closes
def test_a_large_tensor_in_a_value_split_on_its_first_put_is_hashed_again_when_put_again(
    probe: Any,
) -> None:
    """The same for a tensor met as a member of a value split on its first put: hashed,
    not stamped; put again, hashed again; then stamped, as in the test above."""
    torch = torch_or_skip()
    t = torch.arange(float(1 << 18))
    value = {"t": t, "other": np.arange(1 << 16, dtype=np.float64)}
    change = behind_torchs_back(t)
    shared, by_value = put_then_changed(probe, value, [change, change], deep=True)
    assert by_value[0] != by_value[1] != by_value[2]
    assert shared[:2] == by_value[:2]  # the first change, caught by hashing again
    assert shared[2] == shared[1] != by_value[2]  # the second one: the blind spot


class Serial:
    """Pickles with a new serial each time, as a class whose pickling is not deterministic."""

    count = 0

    def __init__(self, data: np.ndarray) -> None:
        self.data = data

    def __reduce__(self) -> tuple[Any, ...]:
        Serial.count += 1
        return _with_serial, (self.data, Serial.count)


def _with_serial(data: np.ndarray, serial: int) -> tuple[str, int]:
    return "serial", serial


class Alike:
    """Pickles alike each time, through code of its own."""

    def __init__(self, data: np.ndarray) -> None:
        self.data = data

    def __reduce__(self) -> tuple[Any, ...]:
        return Alike, (self.data,)


@pytest.mark.mismatches_expected  # pickles anew each time: verify reports it, safely
def test_a_pickle_kept_within_a_call_vouches_only_for_classes_seen_to_pickle_alike(
    probe: Any,
) -> None:
    """A dict that pickled alike twice says nothing of a dict holding another class: each
    send of the second pickles it again, as by value does, with a new serial each time."""
    with refshare.sharing():
        taught = {"x": Alike(large())}
        ray.get([probe.describe.remote(taught) for _ in range(3)])  # dict and Alike: alike
        value = {"x": Serial(large())}
        got = [ray.get(probe.describe.remote(value)) for _ in range(3)]
    serials = [description[0][1] for description in got]
    assert len(set(map(repr, serials))) == 3, serials  # three pickles, as by value


# -- only what cannot change is an atom of a stamp ---------------------------------------------


class Zone(datetime.tzinfo):
    """A time zone whose offset is state of its own, which its pickling sends (``tzinfo``
    pickles as its class called with no argument, and its ``__dict__``)."""

    def __init__(self, minutes: int = 0) -> None:
        self.minutes = minutes

    def utcoffset(self, when: Any) -> datetime.timedelta:
        return datetime.timedelta(minutes=self.minutes)

    def __repr__(self) -> str:
        return f"Zone({self.minutes})"


def slice_of_tensors() -> Case:
    """A slice whose bounds are 0-d views of a ``cu_seqlens`` tensor, written in place by
    torch (its version counter moves)."""
    torch = torch_or_skip()
    cu_seqlens = torch.tensor([0, 5, 9, 14])
    rows = slice(cu_seqlens[1], cu_seqlens[2])

    def write() -> None:
        cu_seqlens[1:3].add_(1)

    return {"big": large(), "rows": rows, "alike": Alike(np.arange(4.0))}, write


def datetime_in_a_zone() -> Case:
    zone = Zone(60)
    when = datetime.datetime(2024, 1, 1, 12, tzinfo=zone)
    at = datetime.time(12, tzinfo=zone)
    return {
        "big": large(),
        "when": when,
        "at": at,
        "alike": Alike(np.arange(4.0)),
    }, lambda: setattr(zone, "minutes", 120)


ATOMS = {"slice of tensors": slice_of_tensors, "datetime in a zone": datetime_in_a_zone}


@DEEP_MODES
@pytest.mark.parametrize("case", ATOMS)
def test_an_immutable_value_whose_parts_changed_within_one_call_arrives_new(
    probe: Any, case: str, deep: bool | None
) -> None:
    """Sent twice unchanged (so that what was kept of it may stand for it: its pickle, its
    split), changed in place, sent again: each send as by value then."""
    value, change = ATOMS[case]()
    shared, by_value = [], []
    with refshare.sharing(min_bytes=MIN_BYTES, deep=deep):
        for step in range(3):
            if step == 2:
                change()
            shared.append(ray.get(probe.describe.remote(value), timeout=60))
            with refshare.sharing(enabled=False):
                by_value.append(ray.get(probe.describe.remote(value), timeout=60))
    assert by_value[0] == by_value[1] != by_value[2]
    assert_received_as_by_value(shared, by_value)
