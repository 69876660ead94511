"""Verify mode on a real Ray: it passes what is exact, and catches what is not.

Each case sends values through ``sharing(verify=True)`` and checks what the workers received
against a by-value send, and what verify counted (``stats().mismatches``) and logged."""

from __future__ import annotations

import gc
import itertools
import logging
import time
from typing import Any

import numpy as np
import pytest
import ray
from differential_kit import Probe, first_difference

import refshare

pytestmark = pytest.mark.usefixtures("local_ray", "fresh")
mismatches_expected = pytest.mark.mismatches_expected

DEEP = (False, None, True)


@pytest.fixture(scope="module")
def probes(local_ray: None) -> list[Any]:
    group = [Probe.remote() for _ in range(2)]
    ray.get([p.ping.remote() for p in group])
    return group


def by_value(probes: list[Any], value: Any) -> list[Any]:
    return ray.get([p.describe.remote(value) for p in probes])


def shared(probes: list[Any], value: Any, **options: Any) -> list[Any]:
    with refshare.sharing(min_bytes=1 << 10, **options):
        return ray.get([p.describe.remote(value) for p in probes])


class Point:
    """A plain class: two parts, both sent by value."""

    def __init__(self, data: np.ndarray, label: Any) -> None:
        self.data, self.label = data, label


class Stamped:
    """A class whose pickling is not deterministic: each pickle carries a new serial."""

    serial = itertools.count()

    def __init__(self, data: np.ndarray) -> None:
        self.data = data

    def __reduce__(self) -> tuple[Any, ...]:
        return Stamped._rebuild, (self.data, next(Stamped.serial))

    @staticmethod
    def _rebuild(data: np.ndarray, serial: int) -> Stamped:
        return Stamped(data)


def values() -> list[Any]:
    """Values whose exactness verify must confirm, each sent twice."""
    rng = np.random.default_rng(0)
    arrays = [rng.random(1 << 13) for _ in range(3)]
    uids = np.array([f"uid-{i // 4}" for i in range(4096)], dtype=object)
    return [
        arrays[0],
        np.asfortranarray(rng.random((64, 128))),
        {"a": arrays[0], "b": arrays[1], "same": arrays[0], "n": 3},
        [arrays[2], arrays[2][::2], "label"],
        Point(arrays[1], ("x", 1.0)),
        {"uid": uids, "x": arrays[0]},
    ]


@pytest.mark.parametrize("deep", DEEP)
def test_verify_finds_no_mismatch_where_refshare_is_exact(probes: list[Any], deep: Any) -> None:
    for value in values():
        expected = by_value(probes, value)
        for _ in range(2):  # a first send, then a hit
            got = shared(probes, value, deep=deep, verify=True)
            assert got == expected, first_difference(got[0], expected[0])
    assert refshare.stats().mismatches == 0
    assert refshare.stats().hits > 0


@mismatches_expected
def test_verify_catches_a_reader_that_keys_less_than_the_pickle_sends(
    probes: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    refshare.register_fingerprint(Point, lambda point: point.data)  # leaves out the label
    data = np.arange(1 << 14, dtype=np.float64)
    first, second = Point(data, "first"), Point(data.copy(), "second")

    @refshare.shared_args(verify=True)
    def send(point: Point) -> Any:
        return ray.get([p.describe.remote(point) for p in probes])

    with caplog.at_level(logging.ERROR, logger="refshare"):
        assert send(first) == by_value(probes, first)
        assert refshare.stats().mismatches == 0
        # The partial reader gives `second` the key of `first`: verify sees the by-value
        # serializations differ, and sends `second` by value to both workers.
        assert send(second) == by_value(probes, second)
    assert refshare.stats().mismatches == len(probes)
    message = caplog.records[-1].getMessage()
    assert "Point" in message and "argument 0" in message and "send" in message


@pytest.mark.verify_off  # under REFSHARE_VERIFY=1 the partial reader is caught
def test_without_verify_the_partial_reader_does_send_stale_data(probes: list[Any]) -> None:
    """The reader above is wrong, and verify is what tells: without it, the stale value."""
    refshare.register_fingerprint(Point, lambda point: point.data)
    data = np.arange(1 << 14, dtype=np.float64)
    first, second = Point(data, "first"), Point(data.copy(), "second")
    shared(probes, first)
    assert shared(probes, second) == by_value(probes, first)
    assert refshare.stats().mismatches == 0


def test_a_class_that_pickles_differently_each_time_but_arrives_alike_is_verified(
    probes: list[Any],
) -> None:
    """Each pickle of a ``Stamped`` carries a new serial, which its rebuild drops: what a
    receiver has is the same both ways, and that is what verify compares."""
    value = Stamped(np.ones(1 << 14))
    expected = by_value(probes, value)
    for _ in range(2):
        assert shared(probes, value, verify=True) == expected
    assert (refshare.stats().mismatches, refshare.stats().unverified) == (0, 0)
    assert refshare.stats().verified == 2 * len(probes)


@mismatches_expected
def test_the_environment_turns_verify_on(
    probes: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REFSHARE_VERIFY", "1")
    refshare.register_fingerprint(Point, lambda point: point.data)
    data = np.arange(1 << 14, dtype=np.float64)
    shared(probes, Point(data, "first"))
    second = Point(data.copy(), "second")
    assert shared(probes, second) == by_value(probes, second)
    assert refshare.stats().mismatches == len(probes)


@mismatches_expected
def test_verify_checks_puts_too(probes: list[Any]) -> None:
    refshare.register_fingerprint(Point, lambda point: point.data)
    data = np.arange(1 << 14, dtype=np.float64)
    with refshare.sharing(verify=True):
        first = ray.put(Point(data, "first"))
        second = ray.put(Point(data.copy(), "second"))
    assert first != second  # the second is Ray's own put: its own object
    assert ray.get(second).label == "second"
    assert refshare.stats().mismatches == 1


def test_a_bad_verify_option_fails_where_it_is_given() -> None:
    with pytest.raises(TypeError, match=r"verify='yes': pass False, True .* or 'worker'"):
        refshare.shared_args(verify="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="verify=1"):
        refshare.sharing(verify=1)  # type: ignore[arg-type]


def received_alike(a: Any, b: Any) -> bool:
    """Whether a receiver has the same of ``a`` and ``b``, each as Ray by value gives it."""
    from refshare._verify.received import describe

    return bool(describe(ray.get(ray.put(a))) == describe(ray.get(ray.put(b))))


def test_the_description_tells_apart_what_a_worker_can() -> None:
    """Two equal values are described alike; values a receiver could tell apart are not."""
    a = np.arange(1 << 12)
    assert received_alike({"x": a}, {"x": a.copy()})
    assert not received_alike({"x": a}, {"x": a.astype(np.int32)})
    assert not received_alike([a, a], [a, a.copy()])  # aliasing
    assert not received_alike(a, np.asfortranarray(a.reshape(64, 64)))
    dates = np.arange(1 << 12).astype("M8[s]")
    assert received_alike(dates, dates.copy())
    assert not received_alike(dates, dates + 1)  # its bytes, through a uint8 view
    padded = np.zeros(8, dtype=np.dtype([("a", "u1"), ("b", "<f8")], align=True))
    assert received_alike(padded, padded.copy())  # fields, not the padding between them


def test_the_description_sees_tensor_aliasing_as_pickle_sends_it() -> None:
    """Pickle sends each tensor with a storage of its own: a view of another entry's storage
    arrives as a copy, so it is described as a copy is. One tensor sent twice is one object."""
    torch = pytest.importorskip("torch")
    a = torch.arange(1 << 12, dtype=torch.float32)
    assert received_alike({"a": a, "b": a[:16]}, {"a": a, "b": a.clone()[:16]})
    assert not received_alike([a, a], [a, a.clone()])


def test_the_description_reads_no_class_s_own_pickling() -> None:
    """Objects are read by their ``__dict__`` and slots: a ``__reduce__`` outside the trusted
    packages never runs (``Stamped`` counts its reductions), and sets are order-free."""
    from refshare._verify.received import describe

    value = {"s": Stamped(np.ones(4)), "members": {Point(np.ones(1), n) for n in range(8)}}
    before = next(Stamped.serial)
    assert describe(value) == describe(value)
    assert next(Stamped.serial) == before + 1


@pytest.mark.parametrize("deep", DEEP)
def test_views_of_one_storage_are_no_mismatch(probes: list[Any], deep: Any) -> None:
    """A view of another entry's storage, then its clone in that place: both arrive as by
    value, and verify reports neither (it did, when it digested storages as shared)."""
    torch = pytest.importorskip("torch")
    a = torch.arange(1 << 14, dtype=torch.float32)
    for value in ({"a": a, "b": a[: 1 << 12]}, {"a": a, "b": a.clone()[: 1 << 12]}):
        got = shared(probes, value, deep=deep, verify=True)
        want = by_value(probes, value)
        assert got == want, first_difference(got[0], want[0])
    assert refshare.stats().mismatches == 0


@ray.remote(num_cpus=0.01)
class Named:
    def ping(self) -> bool:
        return True


@ray.remote(num_cpus=0.05)
def use(value: Any) -> int:
    handle, ref, data = value
    return int(ray.get(handle.ping.remote())) + int(ray.get(ref).size > 0) + int(data.size > 0)


@pytest.mark.parametrize("deep", DEEP)
def test_verify_keeps_no_ref_or_handle_alive(deep: Any) -> None:
    """Verify's by-value copy holds the refs and handles as by value does, and is dropped
    once compared; the description names them by their ids: the actor ends with its last
    handle."""

    name = f"verify-named-{deep}"
    value = [Named.options(name=name).remote(), ray.put(np.ones(1 << 16)), np.ones(1 << 16)]
    with refshare.sharing(min_bytes=1 << 10, deep=deep, verify=True):
        assert ray.get([use.remote(value) for _ in range(2)], timeout=60) == [3, 3]
    assert refshare.stats().mismatches == 0
    del value
    gc.collect()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name)
        except ValueError:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the actor outlived its last handle")


def _local_class() -> type:
    class Local:  # defined in a function: cloudpickle sends it by value
        def __init__(self, data: np.ndarray) -> None:
            self.data = data

        def total(self) -> float:
            return float(self.data.sum())

    return Local


@ray.remote(num_cpus=0.05)
def total(value: Any) -> float:
    return float(value[0].total())


@pytest.mark.parametrize("deep", DEEP)
def test_verify_leaves_classes_sent_by_value_as_they_are(deep: Any) -> None:
    """Verify's fetch on the driver must not set the copies of a by-value class's methods
    onto the class itself, as cloudpickle's unpickling does where the class was defined: a
    plain pickle of an instance then fails ("not the same object")."""
    local = _local_class()
    method = local.total
    value = [local(np.ones(1 << 16)), np.ones(1 << 16)]
    with refshare.sharing(min_bytes=1 << 10, deep=deep, verify=True):
        assert ray.get(total.remote(value), timeout=60) == 1 << 16
    assert refshare.stats().mismatches == 0
    assert local.total is method
