"""Verify's oracle on a real Ray (issue 40): what it must catch, what it must pass, where it
runs, and that it observes without acting.

Each case sends values through ``sharing(verify=...)``, and checks what the workers received
against a by-value send (``differential_kit``), and what verify counted (``stats()``,
``report()``) and logged."""

from __future__ import annotations

import logging
import sys
import threading
import time
import weakref
from typing import Any

import numpy as np
import pytest
import ray
from differential_kit import Probe, first_difference
from test_stamp_rule import assert_received_as_by_value, large, poke, sent_then_changed

import refshare

pytestmark = pytest.mark.usefixtures("local_ray", "fresh")
mismatches_expected = pytest.mark.mismatches_expected
DEEP = pytest.mark.parametrize("deep", [False, None, True], ids=["flat", "auto", "deep"])
MODES = pytest.mark.parametrize("verify", [True, "worker"], ids=["driver", "worker"])


@pytest.fixture(scope="module")
def probe(local_ray: None) -> Any:
    found = Probe.remote()  # type: ignore[attr-defined]
    ray.get(found.ping.remote())
    return found


def describe(probe: Any, value: Any, **options: Any) -> Any:
    """What ``probe`` receives of ``value`` in a ``sharing`` block with ``options``."""
    with refshare.sharing(min_bytes=1 << 10, **options):
        return ray.get(probe.describe.remote(value), timeout=60)


def counted(field: str, at_least: int, timeout: float = 30.0) -> int:
    """``stats()``'s ``field`` once it reaches ``at_least`` (a worker's report is on its way
    to the driver's ledger a little after the task ran), or when ``timeout`` has passed."""
    deadline = time.monotonic() + timeout
    while True:
        found = int(getattr(refshare.stats(), field))
        if found >= at_least or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


# -- what a partial reader makes stale, caught --------------------------------------------------


class Labelled:
    """Data and metadata; the tests below register readers that leave the metadata out."""

    def __init__(self, data: np.ndarray, meta_info: dict[str, Any]) -> None:
        self.data, self.meta_info = data, meta_info


class WithLogger(Labelled):
    """As verl's ``meta_info``, holding a logger with a handler."""


class SharedByOption(Labelled):
    """Each test registers its own partial reader, for a class of its own."""


class SharedByEnvironment(Labelled):
    pass


class CheckedOnDriver(Labelled):
    pass


class CheckedOnWorker(Labelled):
    pass


def partial(cls: type) -> tuple[Any, Any]:
    """Two values of ``cls`` that a reader of their data alone gives one key."""
    refshare.register_fingerprint(cls, lambda value: value.data)
    data = np.arange(1 << 14, dtype=np.float64)
    return cls(data, {"label": "first"}), cls(data.copy(), {"label": "second"})


@mismatches_expected
def test_a_logger_beside_what_a_partial_reader_leaves_out_is_no_blind_spot(probe: Any) -> None:
    """Issue 40, 4: an object whose state could not be pickled as a raw ``__dict__`` (a
    logger with a handler) turned the comparison off; it is described by what it reduces to."""
    logger = logging.getLogger("test_verify_oracle.batch")
    logger.addHandler(logging.StreamHandler())
    first, second = partial(WithLogger)
    first.meta_info["logger"] = second.meta_info["logger"] = logger
    third = WithLogger(first.data.copy(), {"label": "third", "logger": logger})
    assert describe(probe, first, verify=True) == ray.get(probe.describe.remote(first))
    got = describe(probe, second, verify=True)
    assert got == ray.get(probe.describe.remote(second)), "the stale label reached the worker"
    refshare.clear()
    describe(probe, first)  # stored without verify: the next check is that ref's first
    assert describe(probe, third, verify=True) == ray.get(probe.describe.remote(third))
    assert (refshare.stats().mismatches, refshare.stats().unverified) == (2, 0)


@mismatches_expected
@pytest.mark.parametrize("switch", ["option", "environment"])
def test_share_is_verified(switch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 40, 3: ``share()`` answered by content is checked like a put, inside
    ``sharing(verify=True)`` and under ``REFSHARE_VERIFY=1``; on a mismatch its answer is
    Ray's own put of the value."""
    first, second = partial(SharedByOption if switch == "option" else SharedByEnvironment)
    if switch == "environment":
        monkeypatch.setenv("REFSHARE_VERIFY", "1")
    with refshare.sharing(verify=switch == "option"):
        refs = [refshare.share(first), refshare.share(second)]
    assert refs[0] != refs[1]
    assert [ray.get(ref).meta_info["label"] for ref in refs] == ["first", "second"]
    assert (refshare.stats().verified, refshare.stats().mismatches) == (1, 1)


@mismatches_expected
@MODES
def test_a_partial_reader_is_caught_in_both_modes(probe: Any, verify: Any) -> None:
    refshare.reset_report()
    first, second = partial(CheckedOnDriver if verify is True else CheckedOnWorker)
    assert describe(probe, first, verify=verify) == ray.get(probe.describe.remote(first))
    assert describe(probe, second, verify=verify) == ray.get(probe.describe.remote(second))
    assert counted("mismatches", 1) == 1
    assert refshare.report().rows[-1].mismatches == 1


# -- what a stamp or a serializer makes stale, caught -------------------------------------------


@mismatches_expected
@DEEP
def test_a_datetime64_column_does_not_turn_verify_off(probe: Any, deep: Any) -> None:
    """Issue 40, 1: a ``datetime64`` array beside a large array changed within one call (the
    documented blind spot): verify reads its bytes through a uint8 view, and catches it."""
    value = {"created_at": np.arange(4096).astype("M8[s]"), "big": large()}
    shared, by_value = sent_then_changed(probe, value, poke(value["big"]), deep=deep, verify=True)
    assert_received_as_by_value(shared, by_value)
    assert refshare.stats().mismatches >= 1
    assert refshare.stats().unverified == 0


def test_a_registered_serializer_whose_output_changes_is_sent_anew(probe: Any) -> None:
    """Issue 40, 2: a serializer registered with Ray for tensors sends them in a wire dtype
    the program switches; the tensor's bytes do not change. A tensor of a class with a
    serializer registered is keyed by what that serializer sends (its pickle), so the new
    dtype reaches the worker, and verify, comparing what the worker receives both ways,
    passes it."""
    torch = pytest.importorskip("torch")
    wire = {"dtype": torch.float32}

    def serialize(t: Any) -> Any:
        return t.to(wire["dtype"]).numpy().copy()

    ray.util.register_serializer(torch.Tensor, serializer=serialize, deserializer=torch.from_numpy)
    try:
        weights = torch.randn(256, 256, dtype=torch.float64)
        got = []
        for dtype in (torch.float32, torch.float16):
            wire["dtype"] = dtype
            got.append(describe(probe, weights, verify=True))
            assert got[-1] == ray.get(probe.describe.remote(weights))
    finally:
        ray.util.deregister_serializer(torch.Tensor)
    assert got[0] != got[1]
    assert refshare.stats().mismatches == 0 and refshare.stats().verified >= 2


# -- what is right, passed --------------------------------------------------------------------


class Member:
    """Hashed by identity: a set of these iterates in address order."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __repr__(self) -> str:  # what the test kit describes a set's members by
        return f"Member({self.n})"


class Linked:
    """Holds a weak reference to its owner, which its pickling leaves out and its
    ``__setstate__`` makes again (as a TensorDict's parents)."""

    def __init__(self, data: np.ndarray) -> None:
        self.data = data
        self.owner = weakref.ref(self)

    def __getstate__(self) -> dict[str, Any]:
        return {"data": self.data}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.data = state["data"]
        self.owner = weakref.ref(self)


def right_values() -> dict[str, list[Any]]:
    """Issue 40, 5 and 6: equal content each sent twice, by a route that once gave a false
    mismatch."""
    torch = pytest.importorskip("torch")
    arr = np.arange(1 << 15, dtype=np.float64)
    returned = ray.get(ray.put(arr.copy()))  # what a worker returns: read-only
    assert not returned.flags.writeable
    quantized = torch.quantize_per_tensor(torch.rand(256, 256), 0.1, 10, torch.quint8)
    subclass = type("Tagged", (torch.Tensor,), {})
    members = {Member(n) for n in range(16)}
    values = {
        "writable, then read-only": [{"x": arr}, {"x": returned}],
        "a tensor subclass": [torch.ones(1 << 15).as_subclass(subclass)] * 2,
        "a quantized tensor": [quantized] * 2,
        "a set of identity-hashed objects": [members | {arr.tobytes()}] * 2,
        "the same in a dict": [{"members": members, "x": arr}] * 2,
        "a weak reference made again": [Linked(arr)] * 2,
    }
    assert tuple(values) == RIGHT
    return values


RIGHT = ("writable, then read-only", "a tensor subclass", "a quantized tensor",
         "a set of identity-hashed objects", "the same in a dict",
         "a weak reference made again")  # fmt: skip


@DEEP
@pytest.mark.parametrize("case", RIGHT)
def test_what_is_right_is_verified(probe: Any, case: str, deep: Any) -> None:
    values = right_values()[case]
    for value in values:
        describe(probe, value, verify=True, deep=deep)
    stats = refshare.stats()
    assert (stats.mismatches, stats.unverified) == (0, 0), refshare.report()
    assert stats.verified == len(values)
    assert stats.hits >= 1  # the second send was a hit, and verified as one


def test_what_is_right_arrives_as_by_value(probe: Any) -> None:
    value = {"members": {Member(n) for n in range(16)}, "x": np.arange(1 << 15)}
    got = describe(probe, value, verify=True)
    expected = ray.get(probe.describe.remote(value))
    assert got == expected, first_difference(expected[0], got[0])


# -- what cannot be described, unverified -------------------------------------------------------


class Hashing:
    """Rebuilt with a hasher, whose state only its own C code reads."""

    def __init__(self, data: np.ndarray) -> None:
        self.data = data

    def __getstate__(self) -> dict[str, Any]:
        return {"data": self.data}

    def __setstate__(self, state: dict[str, Any]) -> None:
        import xxhash

        self.data, self.hasher = state["data"], xxhash.xxh3_64()


@pytest.mark.unverified_expected
def test_what_verify_cannot_describe_is_unverified_and_goes_by_value() -> None:
    """Fail closed: the copy is sent, and the send is counted apart, with its reason."""
    refshare.reset_report()

    @ray.remote(num_cpus=0.05)
    def used(value: Hashing) -> float:
        return float(value.data.sum())

    value = Hashing(np.ones(1 << 15))
    with refshare.sharing(min_bytes=1 << 10, verify=True):
        assert ray.get([used.remote(value) for _ in range(2)]) == [1 << 15] * 2
    stats = refshare.stats()
    assert (stats.unverified, stats.verified, stats.mismatches) == (2, 0, 0)
    row = refshare.report().rows[-1]
    assert row.unverified == 2
    (reason, count), *_ = row.unverified_reasons
    assert count == 2 and "xxhash" in reason
    assert "2 unverified" in str(refshare.report())


# -- on the workers: what the driver cannot see -----------------------------------------------


@ray.remote(num_cpus=0.05)
class OtherNumpy:
    """A worker whose numpy rebuilds an unpickled array of objects its own way, as another
    version might: each array its unpickling makes is of a subclass of its own."""

    def __init__(self) -> None:
        import importlib

        module = importlib.import_module(
            np.ndarray.__reduce_ex__(np.empty(1, object), 5)[0].__module__
        )
        original = module._reconstruct

        class Rebuilt(np.ndarray):
            pass

        def rebuild(*args: Any) -> Any:
            return original(*args).view(Rebuilt)

        module._reconstruct = rebuild

    def kind(self, arr: Any) -> str:
        return type(arr).__name__


@mismatches_expected
def test_the_workers_check_judges_the_code_the_worker_runs() -> None:
    """Issue 40, 7: refshare rebuilds an array of strings from its joined text, where by
    value the worker's numpy unpickles it. On the driver both compare equal; on this worker
    they do not, and only ``verify="worker"`` gives the method what it gets by value."""
    worker = OtherNumpy.remote()  # type: ignore[attr-defined]
    uids = np.array([f"uid-{i}" for i in range(5000)], dtype=object)
    assert ray.get(worker.kind.remote(uids)) == "Rebuilt"  # by value
    with refshare.sharing(min_bytes=1 << 10, verify=True):
        assert ray.get(worker.kind.remote(uids)) == "ndarray"  # the driver cannot see it
    assert refshare.stats().verified == 1
    with refshare.sharing(min_bytes=1 << 10, verify="worker"):
        assert ray.get(worker.kind.remote(uids)) == "Rebuilt"
    assert counted("mismatches", 1) == 1
    assert refshare.stats().verified == 1
    ray.kill(worker)


@ray.remote(num_cpus=0.05)
class WithoutRefshare:
    """A worker where refshare cannot be imported."""

    def __init__(self) -> None:
        for name in [m for m in sys.modules if m == "refshare" or m.startswith("refshare.")]:
            sys.modules[name] = None  # type: ignore[assignment]

    def total(self, value: dict[str, np.ndarray]) -> float:
        return float(value["big"].sum())


@mismatches_expected
def test_the_workers_check_travels_to_a_worker_without_refshare() -> None:
    """The description and the check are shipped by value: a large array changed within one
    call (the documented blind spot) is caught on a worker that cannot import refshare."""
    worker = WithoutRefshare.remote()  # type: ignore[attr-defined]
    value = {"big": large(), "other": large()}
    change = poke(value["big"])
    with refshare.sharing(verify="worker"):
        before = ray.get(worker.total.remote(value))
        change()
        assert ray.get(worker.total.remote(value)) == before + 1
    assert counted("mismatches", 1) == 1
    assert counted("verified", 1) == 1
    ray.kill(worker)


def test_the_workers_check_passes_what_is_right(probe: Any) -> None:
    value = {"x": np.arange(1 << 15), "members": {Member(n) for n in range(4)}}
    for _ in range(2):
        got = describe(probe, value, verify="worker")
        assert got == ray.get(probe.describe.remote(value))
    assert counted("verified", 2) == 2
    assert (refshare.stats().mismatches, refshare.stats().unverified) == (0, 0)


def test_verify_takes_worker_and_refuses_other_values(monkeypatch: pytest.MonkeyPatch) -> None:
    refshare.sharing(verify="worker")
    with pytest.raises(TypeError, match=r"verify='workers'.*'worker'"):
        refshare.sharing(verify="workers")  # type: ignore[arg-type]
    from refshare._scope import Scope

    monkeypatch.setenv("REFSHARE_VERIFY", "worker")
    assert Scope(refshare.sharing()._options).verify == "worker"
    assert Scope(refshare.sharing(verify=True)._options).verify == "worker"


# -- observes, never acts -----------------------------------------------------------------------


class Serial:
    """Each pickle carries the next serial, and its receiver gets it."""

    count = 0
    lock = threading.Lock()

    def __init__(self, data: np.ndarray) -> None:
        self.data = data

    def __reduce__(self) -> tuple[Any, ...]:
        with Serial.lock:
            Serial.count += 1
            return _serial, (self.data, Serial.count)


def _serial(data: np.ndarray, serial: int) -> int:
    return serial


@ray.remote(num_cpus=0.05)
def received(value: Any) -> Any:
    return value


@mismatches_expected  # its first send: the stored pickle is not the copy
def test_a_value_that_pickles_anew_each_time_arrives_as_by_value_does() -> None:
    """Issue 40, 8: verify runs a value's pickling once per send, as by value does, beside
    the one put sharing makes; once the value is seen to pickle differently, it goes by
    value unkeyed. By value the workers get 1, 2, 3; verified, 2, 3, 4."""
    value = Serial(np.ones(1 << 16))
    start = Serial.count
    with refshare.sharing(min_bytes=1 << 10, verify=True):
        got = [ray.get(received.remote(value)) - start for _ in range(3)]
    assert got == [2, 3, 4]
    assert Serial.count - start == 4
    assert refshare.stats().by_value == 2
