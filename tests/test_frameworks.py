"""Content-addressed ray.put in a scope, patch_methods(), enable() and worker_setup().

Frameworks put their own chunks with ray.put before they fan out; the same chunks go to
several groups (actor, critic, reference). These tests count, from the outside, how often
the driver serialized each chunk.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import internals
import numpy as np
import pytest
import ray
import wrapt
from conftest import init_local_ray, restart_local_ray
from helpers import Payload, count_payload_serializations

import refshare

pytestmark = pytest.mark.usefixtures("local_ray", "fresh")

N = 3


@ray.remote(num_cpus=0.1)
class Member:
    def total(self, chunk: Any) -> float:
        return float(chunk.data.sum())


@pytest.fixture(scope="module")
def members(local_ray: None) -> list[Any]:
    count_payload_serializations()
    group = [Member.remote() for _ in range(N)]
    ray.get([m.total.remote(Payload.filled(0, 8)) for m in group])
    return group


class Group:
    """A worker group shaped like the frameworks' today: put each chunk, then fan out."""

    def __init__(self, members: list[Any]) -> None:
        self.members = members

    def run(self, chunks: list[Payload]) -> list[float]:
        refs = [ray.put(chunk) for chunk in chunks]
        return ray.get([m.total.remote(r) for m, r in zip(self.members, refs, strict=True)])


def chunks(fill: int = 1) -> list[Payload]:
    return [Payload.filled(fill + i) for i in range(N)]


def serializations(call: Any, *args: Any) -> tuple[Any, int]:
    before = Payload.serialized
    result = call(*args)
    return result, Payload.serialized - before


# -- ray.put in a scope -------------------------------------------------------------------


def test_equal_content_put_twice_in_a_scope_gives_one_ref(members: list[Any]) -> None:
    big = np.arange(1 << 17, dtype=np.float64)
    with refshare.sharing():
        first, second = ray.put(big), ray.put(big.copy())
        other = ray.put(big + 1)
    assert first == second and first != other
    assert (ray.get(first) == big).all()
    stats = refshare.stats()
    assert (stats.put_calls, stats.puts, stats.hits) == (3, 2, 1), stats


def test_puts_refshare_leaves_to_ray(members: list[Any]) -> None:
    big = np.ones(1 << 17)

    def put_owned() -> Any:  # _owner was removed in Ray 2.56: then Ray raises, as ever
        try:
            return ray.put(big, _owner=members[0])
        except Exception as error:
            return type(error)

    outside = put_owned()
    with refshare.sharing():
        small = [ray.put(np.ones(8)), ray.put(np.ones(8))]
        owned = [put_owned(), put_owned()]
        with pytest.raises(TypeError):
            ray.put(small[0])  # Ray's own error for putting a ref, unchanged
    assert small[0] != small[1]
    if isinstance(outside, type):
        assert owned == [outside, outside]
    else:
        assert owned[0] != owned[1]  # each an owned put of its own, as Ray made it
    with refshare.sharing(puts=False):
        assert ray.put(big) != ray.put(big)
    assert ray.put(big) != ray.put(big)  # outside every scope: Ray's put
    assert refshare.stats().put_calls == 0


@pytest.mark.verify_off  # counts serializations, which verify adds to
def test_puts_from_a_thread_pool_inside_a_scope_are_shared(members: list[Any]) -> None:
    values = [Payload.filled(7) for _ in range(8)]  # equal content, eight objects

    @refshare.shared_args
    def parallel_put() -> list[Any]:  # as verl's parallel_put does it
        with ThreadPoolExecutor(max_workers=4) as pool:
            return list(pool.map(ray.put, values))

    refs, count = serializations(parallel_put)
    # Keyed by its own pickle: each of the eight objects is pickled once to be keyed.
    assert len(set(refs)) == 1 and count == 8
    stats = refshare.stats()  # threads that miss at once wait for one put
    assert (stats.puts, stats.hits) == (1, 7), stats
    assert refshare.stats().put_calls == 8
    assert ray.get(refs[-1]).data.tolist() == values[0].data.tolist()


# -- patch_methods ------------------------------------------------------------------------


@pytest.mark.verify_off  # counts serializations, which verify adds to
def test_patch_methods_round_trip(members: list[Any]) -> None:
    groups = [Group(members) for _ in range(3)]  # actor, critic, reference
    data = chunks()
    expected = [float(c.data.sum()) for c in data]

    def step() -> list[Any]:
        return [g.run(data) for g in groups]

    plain, count = serializations(step)
    assert plain == [expected] * 3 and count == 3 * N
    assert refshare.patch_methods(Group, "run") == ["Group.run"]
    assert refshare.patch_methods(Group, "run") == ["Group.run"]  # idempotent: one layer
    shared, count = serializations(step)
    # Keyed by its own pickle: each chunk is pickled once per call that puts it (once per
    # group), as it is put once in a call; each distinct chunk is stored once per step.
    assert shared == plain and count == 3 * N
    stored = refshare.stats()
    assert (stored.puts, stored.hits) == (N, 2 * N), stored
    again, count = serializations(step)
    assert again == plain and count == 3 * N  # each put keyed by its pickle, none stored
    stats = refshare.stats()  # a step repeating the same data stores nothing
    assert (stats.puts, stats.bytes_put, stats.hits) == (
        stored.puts,
        stored.bytes_put,
        stored.hits + 3 * N,
    ), stats
    assert refshare.unpatch_methods(Group, "run") == ["Group.run"]
    assert "run" in Group.__dict__ and not isinstance(Group.__dict__["run"], wrapt.FunctionWrapper)
    _, count = serializations(step)
    assert count == 3 * N


def test_patching_again_with_other_options_keeps_the_first_and_says_so(
    members: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A method already shared keeps its options when asked again with others, and the
    second call says which it kept; asked again with the same ones, it says nothing. (What
    ``refshare run`` wrapped gives way instead: see test_cli.)"""

    class Audited(Group):
        pass

    refshare.patch_methods(Audited, "run", audit=True)
    try:
        with caplog.at_level(logging.WARNING, logger="refshare"):
            assert refshare.patch_methods(Audited, "run", audit=True)  # the same: silent
            assert not caplog.records
            assert refshare.patch_methods(Audited, "run")
        (record,) = caplog.records
        assert "Audited.run is already shared with audit=True" in record.getMessage()
        assert "not audit=False" in record.getMessage()
        refshare.reset_report()
        Audited(members).run(chunks())
        assert [row.audit for row in refshare.report().rows] == [True]
        assert refshare.stats().puts == 0  # an audit stores nothing
    finally:
        refshare.unpatch_methods(Audited, "run")


@pytest.mark.verify_off  # counts serializations, which verify adds to
def test_patch_methods_under_another_wrapper(members: list[Any]) -> None:
    class Mine(Group):
        pass

    refshare.patch_methods(Mine, "run")
    calls: list[int] = []

    @wrapt.decorator
    def traced(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        calls.append(1)
        return wrapped(*args, **kwargs)

    Mine.run = traced(Mine.__dict__["run"])  # another library wraps on top
    assert refshare.unpatch_methods(Mine, "run") == []  # theirs is left working
    group = Mine(members)
    _, count = serializations(lambda: [group.run(chunks(20)) for _ in range(2)])
    # Keyed by its own pickle: each chunk pickled once per run (once to key and store,
    # then once to key it in the second run, which finds it cached).
    assert calls == [1, 1] and count == 2 * N
    stats = refshare.stats()  # refshare's layer beneath still shares
    assert (stats.puts, stats.hits) == (N, N), stats


def test_patch_methods_checks_before_changing_anything() -> None:
    with pytest.raises(AttributeError, match=r"Group\.missing"):
        refshare.patch_methods(Group, "run", "missing")
    with pytest.raises(ValueError, match="min_bytes"):
        refshare.patch_methods(Group, "run", min_bytes=-1)
    with pytest.raises(TypeError, match="cache"):
        refshare.patch_methods(Group, "run", cache="yes")
    assert not isinstance(Group.__dict__["run"], wrapt.FunctionWrapper)


# -- enable -------------------------------------------------------------------------------


def test_enable_rejects_unknown_names_and_warns_for_missing_frameworks(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="'verl', 'nemo_rl', 'openrlhf', 'skyrl', 'roll'"):
        refshare.enable("torchrl")
    with pytest.raises(ValueError, match="min_bytes"):
        refshare.enable("verl", min_bytes=-1)
    # Not installed here (or pretend so): one warning naming what is missing, no change.
    monkeypatch.setitem(
        internals.FRAMEWORKS,
        "openrlhf",
        internals.Framework(
            "openrlhf", "OpenRLHF 0.11.2", ((internals.Target("no_such_module", "G", ("m",)),),)
        ),
    )
    with caplog.at_level(logging.WARNING, logger="refshare"):
        assert refshare.enable("openrlhf") == []
    (warning,) = [r for r in caplog.records if "enable('openrlhf')" in r.message]
    assert "no_such_module" in warning.message and "OpenRLHF 0.11.2" in warning.message
    # Two layouts that fail on one missing module: the error is said once.
    layout = (internals.Target("no_such_module", "G", ("m",)),)
    monkeypatch.setitem(
        internals.FRAMEWORKS, "roll", internals.Framework("roll", "ROLL", (layout, layout))
    )
    with caplog.at_level(logging.WARNING, logger="refshare"):
        assert refshare.enable("roll") == []
    (warning,) = [r for r in caplog.records if "enable('roll')" in r.message]
    assert warning.message.count("no_such_module") == 1, warning.message


@pytest.mark.verify_off  # counts serializations, which verify adds to
def test_enable_and_disable_a_framework_whose_layout_is_known(
    members: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The same machinery as a real framework, pointed at this module's Group.
    target = internals.Target(__name__, "Group", ("run",))
    framework = internals.Framework("verl", "test", ((target,),))
    monkeypatch.setitem(internals.FRAMEWORKS, "verl", framework)
    assert refshare.enable("verl") == ["Group.run"]
    try:
        groups = [Group(members) for _ in range(3)]
        _, count = serializations(lambda: [g.run(chunks(30)) for g in groups])
        # Keyed by its own pickle: each chunk pickled once per run (key and store in the
        # first group's run, key and find cached in the others').
        assert count == 3 * N
        stats = refshare.stats()
        assert (stats.puts, stats.hits) == (N, 2 * N), stats  # each chunk stored once
    finally:
        assert refshare.disable("verl") == ["Group.run"]
    assert not isinstance(Group.__dict__["run"], wrapt.FunctionWrapper)


@pytest.mark.verify_off  # counts serializations, which verify adds to
def test_a_subclass_patched_with_its_own_options_keeps_them(members: list[Any]) -> None:
    class Base(Group):
        pass

    class Sub(Base):
        pass

    refshare.patch_methods(Base, "run")
    refshare.patch_methods(Sub, "run", enabled=False)  # the subclass opts out
    try:
        data = chunks(40)
        _, count = serializations(lambda: [Sub(members).run(data) for _ in range(2)])
        assert count == 2 * N  # by value: its own options, not the base's
        assert refshare.stats() == refshare.Stats()  # no scope: refshare saw no put
        _, count = serializations(lambda: [Base(members).run(data) for _ in range(2)])
        # Keyed by its own pickle: each chunk pickled once per run (key and store, then
        # key and find cached), so the count alone no longer tells it from by value.
        assert count == 2 * N
        shared = refshare.stats()
        assert (shared.put_calls, shared.puts, shared.hits) == (2 * N, N, N), shared
        refshare.unpatch_methods(Base, "run")
        _, count = serializations(lambda: [Sub(members).run(data) for _ in range(2)])
        assert count == 2 * N  # and still its own once the base is unpatched
        assert refshare.stats() == shared  # by value: no put in a scope
    finally:
        refshare.unpatch_methods(Sub, "run")
        refshare.unpatch_methods(Base, "run")
    assert "run" not in Sub.__dict__ and "run" not in Base.__dict__


def test_patch_methods_refuses_what_is_not_a_method() -> None:
    class WithProperty(Group):
        @property
        def size(self) -> int:
            return len(self.members)

    with pytest.raises(TypeError, match=r"WithProperty\.size is a property"):
        refshare.patch_methods(WithProperty, "size")
    assert isinstance(WithProperty.__dict__["size"], property)


@ray.remote(num_cpus=0.05)
def worker_is_up() -> bool:
    return True


@pytest.mark.slow  # a Ray of its own, and the suite's started again
def test_a_bad_refshare_enable_never_stops_a_worker(caplog: pytest.LogCaptureFixture) -> None:
    names = "VERL, verl;nemo_rl"  # a name in capitals, and a separator refshare does not use
    # Ray's worker_process_setup_hook is a job-level setting: a Ray of its own for it.
    ray.shutdown()
    try:
        init_local_ray(
            object_store_memory=None,
            runtime_env={
                "worker_process_setup_hook": "refshare.worker_setup",
                "env_vars": {"REFSHARE_ENABLE": names},
            },
        )
        assert ray.get([worker_is_up.remote() for _ in range(2)], timeout=120) == [True] * 2
    finally:
        restart_local_ray()
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("REFSHARE_ENABLE", names)
    try:
        with caplog.at_level(logging.WARNING, logger="refshare"):
            refshare.worker_setup()  # as in each worker: one warning, nothing raised
    finally:
        monkeypatch.undo()
    (warning,) = [r for r in caplog.records if "REFSHARE_ENABLE" in r.message]
    assert "'VERL'" in warning.message and "'verl;nemo_rl'" in warning.message
