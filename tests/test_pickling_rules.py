"""Pickling hooks that change how one value, or one class, is sent: pickle finds a hook on
the instance before its class's, and a hook assigned to a class, or a reducer registered
with ``copyreg``, from then on. No reader keys such a value by what it knows of the class,
no stamp vouches for it across the change, and verify sees what a hook hides.

The classes live in ``pickling_cases.py``: the hooks assigned here are this module's code,
not theirs, as a program patching a framework's class assigns its own."""

from __future__ import annotations

import copyreg
import logging
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pickling_cases as cases
import pytest
import ray
from differential_kit import Probe, first_difference

import refshare
from refshare._deep import deep_reducers
from refshare._keys.tables import user_fingerprints
from refshare._rules import instance_hooks, pickles_as, pickling_is_its_packages

pytestmark = pytest.mark.usefixtures("local_ray", "fresh")
mismatches_expected = pytest.mark.mismatches_expected

DEEP = (False, None, True)
N = 1 << 14  # float64: 128 KiB, a member of its own under min_bytes below


@pytest.fixture(scope="module")
def probes(local_ray: None) -> list[Any]:
    group = [Probe.remote() for _ in range(2)]
    ray.get([p.ping.remote() for p in group])
    return group


@pytest.fixture(scope="module", autouse=True)
def box_reader() -> None:
    """A reader that reads a ``Box`` in full: its array and its note."""
    refshare.register_fingerprint(cases.Box, lambda box: (box.data, box.note))


def by_value(probes: list[Any], value: Any) -> list[Any]:
    """What the workers receive of ``value`` by value, also inside a block."""
    with refshare.sharing(enabled=False):
        return ray.get([p.describe.remote(value) for p in probes])


def send(probes: list[Any], value: Any) -> list[Any]:
    return ray.get([p.describe.remote(value) for p in probes])


def box(fill: float, note: str = "n") -> cases.Box:
    return cases.Box(np.full(N, fill), note)


def relabel(value: cases.Box, label: str) -> None:
    """Give one box a ``__reduce_ex__`` of its own, as a program may."""
    value.__reduce_ex__ = lambda protocol: (  # type: ignore[method-assign]
        cases.relabelled,
        (value.data, label),
    )


def assert_as_by_value(probes: list[Any], values: list[Any], deep: Any) -> None:
    """Each value, in order, arrives as by value: across calls (a block each, the cache
    shared) and within one call."""
    expected = [by_value(probes, value) for value in values]
    for value, want in zip(values, expected, strict=True):
        with refshare.sharing(min_bytes=1 << 10, deep=deep):
            got = send(probes, value)
        assert got == want, first_difference(got[0], want[0])
    with refshare.sharing(min_bytes=1 << 10, deep=deep):
        for value, want in zip(values, expected, strict=True):
            got = send(probes, value)
            assert got == want, first_difference(got[0], want[0])


@pytest.mark.parametrize("deep", DEEP)
def test_an_instance_with_a_hook_of_its_own_is_not_read_by_its_class_reader(
    probes: list[Any], deep: Any
) -> None:
    """An equal box is sent first; the hooked one, with the same array and note, must not
    share its key: by value it arrives as what its hook sends."""
    plain, hooked, other = box(1.0), box(1.0), box(1.0)
    relabel(hooked, "first")
    relabel(other, "second")
    assert instance_hooks(hooked) and not instance_hooks(plain)
    assert_as_by_value(probes, [plain, hooked, other, {"in": hooked, "x": plain.data}], deep)


@pytest.mark.parametrize("hook", ["__getstate__", "__reduce__"])
@pytest.mark.parametrize("deep", DEEP)
def test_a_getstate_on_an_instance_is_not_read_by_its_class_reader(
    probes: list[Any], deep: Any, hook: str
) -> None:
    plain, hooked = box(2.0), box(2.0)
    if hook == "__getstate__":
        hooked.__getstate__ = lambda: {"data": hooked.data, "note": "from the hook"}  # type: ignore[method-assign]
    else:  # object's __reduce_ex__ calls an instance's __reduce__ only where the class has one
        hooked.__reduce__ = lambda: (cases.relabelled, (hooked.data, "x"))  # type: ignore[method-assign]
    assert_as_by_value(probes, [plain, hooked], deep)


def _outside_getstate(self: Any) -> dict[str, Any]:
    return {"data": self.data, "note": f"patched: {self.note}"}


@pytest.fixture
def patched_box() -> Iterator[None]:
    """``Box.__getstate__`` assigned by this module, as a program patches a framework."""
    cases.Box.__getstate__ = _outside_getstate  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        del cases.Box.__getstate__


def test_a_class_whose_hook_other_code_assigned_is_not_its_own(patched_box: None) -> None:
    assert not pickling_is_its_packages(cases.Box)
    assert not pickles_as(cases.Box, cases.Box)
    assert user_fingerprints.lookup(cases.Box) is None


def test_a_class_pickles_as_its_own_package_says() -> None:
    assert pickling_is_its_packages(cases.Box) and pickling_is_its_packages(cases.Scaled)
    assert user_fingerprints.lookup(cases.Box) is not None


@pytest.mark.parametrize("deep", DEEP)
def test_a_hook_assigned_to_a_registered_class_is_what_is_sent(
    probes: list[Any], deep: Any
) -> None:
    """Sent before and after the class's hook is assigned: the reader stops reading it."""
    first = box(3.0, "same")
    with refshare.sharing(min_bytes=1 << 10, deep=deep):
        assert send(probes, first) == by_value(probes, first)
    cases.Box.__getstate__ = _outside_getstate  # type: ignore[method-assign, assignment]
    try:
        again = box(3.0, "same")
        expected = by_value(probes, again)
        with refshare.sharing(min_bytes=1 << 10, deep=deep):
            got = send(probes, again)
        assert got == expected, first_difference(got[0], expected[0])
    finally:
        del cases.Box.__getstate__


@pytest.mark.parametrize("deep", DEEP)
def test_a_hook_assigned_within_one_call_is_seen(probes: list[Any], deep: Any) -> None:
    """A stamp of the value vouches for its classes' hooks too."""
    value = {"box": box(4.0), "rest": np.full(N, 4.0)}
    with refshare.sharing(min_bytes=1 << 10, deep=deep):
        assert send(probes, value) == by_value(probes, value)
        cases.Box.__getstate__ = _outside_getstate  # type: ignore[method-assign, assignment]
        try:
            expected = by_value(probes, value)
            got = send(probes, value)
        finally:
            del cases.Box.__getstate__
    assert got == expected, first_difference(got[0], expected[0])


def _scaled_through_copyreg(value: cases.Scaled) -> tuple[Any, ...]:
    return cases.scaled, (value.data, -1)


@pytest.mark.parametrize("deep", DEEP)
def test_a_reducer_registered_within_one_call_is_seen(probes: list[Any], deep: Any) -> None:
    value = {"scaled": cases.Scaled(np.full(N, 5.0)), "rest": np.full(N, 5.0)}
    with refshare.sharing(min_bytes=1 << 10, deep=deep):
        assert send(probes, value) == by_value(probes, value)
        copyreg.pickle(cases.Scaled, _scaled_through_copyreg)
        try:
            expected = by_value(probes, value)
            got = send(probes, value)
        finally:
            del copyreg.dispatch_table[cases.Scaled]
    assert got == expected, first_difference(got[0], expected[0])


@pytest.mark.verify_off
@pytest.mark.parametrize("deep", DEEP)
def test_documented_a_global_read_by_pickling_changed_within_one_call_is_not_seen(
    probes: list[Any], deep: Any
) -> None:
    """What docs/guarantees.md says: within one call, a value with pickling of its own is
    sent as its first pickle; state outside the value that its pickling code reads (a
    module global) is not in the stamp."""
    value = cases.Scaled(np.full(N, 6.0))
    with refshare.sharing(min_bytes=1 << 10, deep=deep):
        first = send(probes, value)
        send(probes, value)  # the class has shown it pickles alike
        cases.SCALE = 2
        try:
            assert by_value(probes, value) != first
            assert send(probes, value) == first
        finally:
            cases.SCALE = 1


@mismatches_expected
@pytest.mark.parametrize("deep", DEEP)
def test_verify_sees_a_global_read_by_pickling_changed_within_one_call(
    probes: list[Any], deep: Any
) -> None:
    """The documented case above, caught by verify in every mode (an inline skeleton's
    description is kept under its key, as a ref's is). Once caught, a value kept as its own
    pickle is known to pickle differently: by value, unkeyed, for the rest of the call."""
    value = cases.Scaled(np.full(N, 7.0))
    with refshare.sharing(min_bytes=1 << 10, deep=deep, verify=True):
        send(probes, value)
        send(probes, value)
        cases.SCALE = 3
        try:
            expected = by_value(probes, value)
            got = send(probes, value)
        finally:
            cases.SCALE = 1
    assert got == expected, first_difference(got[0], expected[0])
    stats = refshare.stats()
    assert stats.mismatches >= 1
    assert stats.mismatches + stats.by_value == len(probes)


def _wrong_scaled(value: cases.Scaled) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """A deep reduction that rebuilds a ``Scaled`` with another factor than its pickling
    sends: re-serialized, both would pickle alike (its pickling reads the global)."""
    return cases.scaled, (value.data, 0)


@pytest.fixture
def wrong_reduction() -> Iterator[None]:
    deep_reducers.register(cases.Scaled, _wrong_scaled)
    try:
        yield
    finally:
        deep_reducers._entries.pop(cases.Scaled, None)
        deep_reducers._owners.clear()
        deep_reducers._settled.clear()


@mismatches_expected
def test_verify_compares_what_arrives_by_its_state(
    probes: list[Any], wrong_reduction: None, caplog: pytest.LogCaptureFixture
) -> None:
    value = {"scaled": cases.Scaled(np.full(N, 8.0)), "rest": np.full(N, 8.0)}
    expected = by_value(probes, value)
    with (
        caplog.at_level(logging.ERROR, logger="refshare"),
        refshare.sharing(min_bytes=1 << 10, deep=True, verify=True),
    ):
        got = send(probes, value)
    assert got == expected, first_difference(got[0], expected[0])
    assert refshare.stats().mismatches == len(probes)
    assert "at value['scaled']['factor']" in caplog.records[-1].getMessage()
