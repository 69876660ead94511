"""Differential suite: what a worker receives through refshare against Ray by value.

Every generated value is built afresh for each way of sending it, sent by value and through
refshare (top-level and deep, ``min_bytes`` small so that small values count as large),
twice across two ``sharing`` blocks and twice within one block to two workers, or put three
times within one block (``ray.put``, its ref sent), with a change in place after the first
send; the worker's :func:`describe_fully` of each submission must equal that of a by-value
send of the value as it was at that moment.

The default run is derandomized and bounded for CI; ``REFSHARE_DIFFERENTIAL=long`` runs 20
times the examples, randomly, for nightly runs.
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import gc
import os
import pickle
import time
from typing import Any

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import ray
from differential_kit import (
    NP_DTYPES,
    OBJECT_DTYPES,
    TORCH_DTYPES,
    Actor,
    Arr,
    Atom,
    Big,
    Box,
    Buf,
    Counted,
    Cycle,
    Main,
    Node,
    ObjArr,
    OwnPickling,
    Probe,
    Ref,
    Same,
    Tagged,
    Tensor,
    View,
    build,
    first_difference,
    main_class,
    pickled_by_value,
)
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import refshare

pytestmark = [
    pytest.mark.usefixtures("local_ray", "fresh"),
    pytest.mark.filterwarnings("ignore:Generating overly large repr"),
]

try:
    import torch
except ImportError:
    torch = None  # type: ignore[assignment]

EXAMPLES = 100
LONG = os.environ.get("REFSHARE_DIFFERENTIAL", "").strip().lower() == "long"
_COMMON: dict[str, Any] = {
    "deadline": None,
    "phases": [Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    "suppress_health_check": [
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
}
settings.register_profile(
    "refshare-differential", max_examples=EXAMPLES, derandomize=True, database=None, **_COMMON
)
settings.register_profile(
    "refshare-differential-long", max_examples=20 * EXAMPLES, print_blob=True, **_COMMON
)
#: Applied to each test here, not loaded: other modules keep their own settings.
SETTINGS = settings.get_profile("refshare-differential-long" if LONG else "refshare-differential")

#: ``Ray by value`` as a description: ``("ok", what the worker saw)`` or what it raised.
Outcome = tuple[str, Any]

# -- the workers -------------------------------------------------------------------------------


class Workers:
    """A worker for the by-value reference, two for refshare, and actors to hand around."""

    def __init__(self, reference: Any, first: Any, second: Any, actors: list[Any]) -> None:
        self.reference = reference
        self.first = first
        self.second = second
        self.actors = actors

    def __repr__(self) -> str:
        return "Workers(...)"  # actor ids: noise in a falsifying example


@pytest.fixture(scope="module")
def workers(local_ray: None) -> Workers:
    probes = [Probe.remote() for _ in range(3)]
    actors = [Tagged.remote(f"actor-{i}") for i in range(2)]
    ray.get([p.ping.remote() for p in probes] + [a.tag.remote() for a in actors], timeout=120)
    return Workers(*probes, actors=actors)


def submit(probe: Any, value: Any, twice: bool = False) -> Any:
    """``probe.describe.remote(value)`` (and the value again as a keyword): the pending ref,
    or the name of what the submission raised."""
    try:
        if twice:
            return probe.describe.remote(value, again=value)
        return probe.describe.remote(value)
    except Exception as error:
        return f"submission raised {type(error).__name__}"


def by_value(probe: Any, value: Any, twice: bool = False, send: Any = submit) -> Any:
    """``send`` (:func:`submit`, or :func:`submit_put`) by value, also from inside a
    ``sharing`` block."""
    with refshare.sharing(enabled=False):
        return send(probe, value, twice)


def submit_put(probe: Any, value: Any, twice: bool = False) -> Any:
    """``ray.put(value)``, its ref sent as :func:`submit` sends a value; or the name of what
    the put raised."""
    try:
        ref = ray.put(value)
    except Exception as error:
        return f"put raised {type(error).__name__}"
    return submit(probe, ref, twice)


def outcome(pending: Any) -> Outcome:
    """What the worker saw, or the type of what the call raised (its cause for a task)."""
    if isinstance(pending, str):
        return "raised", pending
    try:
        return "ok", ray.get(pending, timeout=120)
    except ray.exceptions.RayTaskError as error:
        return "raised", type(getattr(error, "cause", error)).__name__
    except Exception as error:
        return "raised", type(error).__name__


def difference(expected: Any, got: Any, what: str) -> tuple[str, str] | None:
    """How a refshare submission's outcome differs from the by-value one: a label naming
    what differs and a readable account; ``None`` when the worker saw the same."""
    want, have = outcome(expected), outcome(got)
    if want[0] != have[0]:  # one raised, the other did not
        account = f"by value {want!r:.300}\n    refshare {have!r:.300}"
        return f"{have[0]} only with refshare", f"{what}: {account}"
    found = first_difference(want, have)
    return None if found is None else (found[0], f"{what}: {found[1]}")


#: What a scenario found: for each submission that differed, a label and an account.
Differences = list[tuple[str, str]]


def assert_same(expected: Any, got: Any, what: str) -> None:
    """The outcome of a refshare submission equals the by-value one."""
    found = difference(expected, got, what)
    assert found is None, found[1]


# -- values --------------------------------------------------------------------------------------

ATOMS = st.one_of(
    st.integers(-3, 3),
    st.sampled_from([1.0, -0.0, 1.5, float("inf"), True, False, None, 2**70, 1j, ""]),
    st.sampled_from(
        [
            decimal.Decimal("1.10"),
            datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc),
            np.float32(1.0),
            np.int64(1),
            np.bool_(True),
            np.datetime64("2020-01-01"),
            range(3),
            Ellipsis,
        ]
    ),
    st.text(max_size=3),
    st.binary(max_size=3),
)
KEYS = st.sampled_from(
    [
        *(1, 1.0, True, 0, False, -0.0, None, (1, 2), frozenset({1, 2}), "k", b"k", 2**70),
        *(("a", (1,)), np.int64(1), np.float32(1.0), decimal.Decimal("1.10")),
    ]
)
SHAPES = st.one_of(
    hnp.array_shapes(min_dims=0, max_dims=5, min_side=1, max_side=3),
    st.sampled_from([(0,), (2, 0), (7,)]),
)
ARRAY_LAYOUTS = ["C", "C", "F", "T", "step", "rev", "offset", "bcast", "0d", "ro", "ro_own"]
SUBCLASSES = ["ndarray", "ndarray", "ndarray", "recarray", "masked", "matrix"]
np_arrays = st.builds(
    Arr,
    dtype=st.sampled_from(sorted(NP_DTYPES)),
    shape=SHAPES,
    layout=st.sampled_from(ARRAY_LAYOUTS),
    seed=st.integers(0, 3),
    sub=st.sampled_from(SUBCLASSES),
)
object_items = st.one_of(
    st.lists(st.text(max_size=4), min_size=1, max_size=4),  # strings only: stored joined
    st.lists(st.one_of(ATOMS, st.tuples(st.integers(0, 2))), min_size=1, max_size=4),
)
object_arrays = st.builds(
    ObjArr,
    dtype=st.sampled_from(sorted(OBJECT_DTYPES)),
    items=object_items.map(tuple),
    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=3),
    layout=st.sampled_from(["C", "F", "T", "step", "ro"]),
)
TENSOR_LAYOUTS = ["C", "C", "slice", "T", "expand", "conj", "neg", "sparse"]
TENSOR_MODES = ["plain", "plain", "inference", "grad", "param", "attr"]
tensors = st.one_of(
    st.builds(
        Tensor,
        dtype=st.sampled_from(TORCH_DTYPES),
        shape=hnp.array_shapes(min_dims=0, max_dims=4, min_side=1, max_side=3),
        layout=st.sampled_from(TENSOR_LAYOUTS),
        mode=st.sampled_from(TENSOR_MODES),
        seed=st.integers(0, 3),
    ),
    st.builds(
        Tensor,
        dtype=st.sampled_from(TORCH_DTYPES),
        shape=hnp.array_shapes(min_dims=4, max_dims=4, min_side=1, max_side=3),
        layout=st.just("channels_last"),
        mode=st.sampled_from(TENSOR_MODES),
    ),
)
leaves = st.one_of(
    np_arrays,
    object_arrays,
    *([tensors] if torch is not None else []),
    ATOMS.map(Atom),
    st.builds(Same, st.integers(0, 7)),
    st.builds(Same, st.integers(0, 7)),
    st.builds(Cycle, st.integers(0, 3)),
    st.builds(View, st.integers(0, 7)),
    st.builds(Actor, st.integers(0, 1)),
    st.builds(
        Buf,
        st.sampled_from(["bytearray", "view", "bytes_view"]),
        st.integers(0, 16),
        st.integers(0, 2),
        st.sampled_from(["B", "d", "i"]),
    ),
    st.builds(Big, st.sampled_from(["array", "f_array", "strings", "tensor"]), st.integers(0, 2)),
)


def _mapping(kind: str, pairs: list[tuple[Any, Any]]) -> Node:
    return Node(kind, tuple(value for _, value in pairs), tuple(key for key, _ in pairs))


def _containers(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    children = st.lists(inner, max_size=3).map(tuple)
    return st.one_of(
        st.builds(Node, st.sampled_from(["list", "tuple"]), children),
        st.builds(
            _mapping,
            st.sampled_from(["dict", "dict", "odict", "defaultdict", "own", "batch"]),
            st.lists(st.tuples(KEYS, inner), max_size=3),
        ),
        st.builds(Node, st.sampled_from(["box", "frozenbox", "plain", "slotted"]), children),
        st.builds(
            Node, st.sampled_from(["set", "frozenset"]), keys=st.lists(KEYS, max_size=3).map(tuple)
        ),
        st.builds(
            Main, st.sampled_from(["plain", "dataclass", "slots", "type"]), children, ATOMS, ATOMS
        ),
        st.builds(Ref, inner),
    )


values = st.recursive(leaves, _containers, max_leaves=6)


@dataclasses.dataclass(frozen=True)
class Case:
    """A value to send, the change in place between two sends (an index into the changes
    the value allows), whether it goes as two arguments, and refshare's ``min_bytes``."""

    recipe: Any
    change: int | None
    twice: bool
    min_bytes: int


cases = st.builds(
    Case,
    recipe=values,
    change=st.one_of(st.none(), st.integers(0, 15), st.integers(0, 15)),
    twice=st.booleans(),
    min_bytes=st.sampled_from([0, 0, 0, 64, 1024]),
)


#: Values alike that Ray sends differently: equal under ``==``, or empty of another type.
EQUAL_ATOMS: list[list[Any]] = [
    [1, 1.0, True, 1 + 0j, np.int64(1), np.float32(1.0), np.bool_(True), decimal.Decimal("1.10")],
    [0, 0.0, -0.0, False, 0j],
    ["", b""],
    [decimal.Decimal("1.10"), decimal.Decimal("1.1")],
]
NODE_KINDS = [
    ["dict", "odict", "defaultdict", "batch", "own"],
    ["list", "tuple"],
    ["box", "frozenbox", "plain", "slotted"],
    ["set", "frozenset"],
]
#: Dtypes of one itemsize: arrays of one seed and shape hold the same bytes under each.
SAME_SIZE = {
    name: sorted(n for n, d in NP_DTYPES.items() if d.itemsize == dtype.itemsize)
    for name, dtype in NP_DTYPES.items()
}


def _twin_atom(value: Any, draw: Any) -> Any:
    for group in EQUAL_ATOMS:
        if any(type(value) is type(x) and value == x for x in group):
            return draw(st.sampled_from(group))
    return value


@st.composite
def twins(draw: Any, recipe: Any) -> Any:
    """A value like ``recipe`` with parts swapped for lookalikes: an ``==`` dtype with other
    metadata, alignment or record type (same bytes), another subclass, layout or tensor
    mode, an equal atom of another type (``1``, ``1.0``, ``True``), a sibling class."""

    def twin(r: Any) -> Any:
        kind = type(r)
        if kind is Arr:
            return dataclasses.replace(
                r,
                dtype=draw(st.sampled_from(SAME_SIZE[r.dtype])),
                sub=draw(st.sampled_from([r.sub, r.sub, *SUBCLASSES])),
                layout=draw(st.sampled_from([r.layout, r.layout, "C", "F", "ro"])),
            )
        if kind is ObjArr:
            return dataclasses.replace(r, dtype=draw(st.sampled_from(sorted(OBJECT_DTYPES))))
        if kind is Tensor:
            modes = [r.mode, r.mode, *TENSOR_MODES]
            layouts = [r.layout, r.layout, "C", "conj", "neg"]
            return dataclasses.replace(
                r, mode=draw(st.sampled_from(modes)), layout=draw(st.sampled_from(layouts))
            )
        if kind is Atom:
            return Atom(_twin_atom(r.value, draw))
        if kind is Node:
            group = next(g for g in NODE_KINDS if r.kind in g)
            return Node(
                draw(st.sampled_from(group)),
                tuple(map(twin, r.children)),
                tuple(_twin_atom(key, draw) for key in r.keys),
            )
        if kind is Main:
            return Main(r.kind, tuple(map(twin, r.children)), _twin_atom(r.factor, draw), r.scale)
        if kind is Ref:
            return Ref(twin(r.child))
        return r

    return twin(recipe)


@dataclasses.dataclass(frozen=True)
class Pair:
    """Two lookalike values, sent one after the other."""

    first: Any
    second: Any
    min_bytes: int


pairs = values.flatmap(
    lambda recipe: st.builds(
        Pair, st.just(recipe), twins(recipe), st.sampled_from([0, 0, 64, 1 << 20])
    )
)


def lookalikes(
    workers: Workers, pair: Pair, across: bool, put: bool, **options: Any
) -> Differences:
    """Send ``pair.first`` to one worker and ``pair.second`` to another: in one ``sharing``
    block or one each (``across``), as arguments or as refs put in the block (``put``)."""
    refshare.clear()
    sent = [build(pair.first, workers.actors).value, build(pair.second, workers.actors).value]

    def argument(value: Any) -> Any:
        if put and not isinstance(value, ray.ObjectRef):
            return ray.put(value)  # inside a block, a put of refshare's
        return value

    expected = [by_value(workers.reference, argument(value)) for value in sent]
    targets = (workers.first, workers.second)
    got = []
    if across:
        for target, value in zip(targets, sent, strict=True):
            with refshare.sharing(min_bytes=pair.min_bytes, **options):
                got.append(submit(target, argument(value)))
    else:
        with refshare.sharing(min_bytes=pair.min_bytes, **options):
            got = [submit(t, argument(v)) for t, v in zip(targets, sent, strict=True)]
    found = [
        difference(expected[0], got[0], "the first value"),
        difference(expected[1], got[1], "its lookalike"),
    ]
    return [f for f in found if f is not None]


def across_calls(workers: Workers, case: Case, **options: Any) -> Differences:
    """Two ``sharing`` blocks, each sending the value once, a change in place between: how
    each submission differs from by value."""
    refshare.clear()  # each example on its own: what it finds, it put itself
    built = build(case.recipe, workers.actors)
    value = built.value
    expected = by_value(workers.reference, value, case.twice)
    with refshare.sharing(min_bytes=case.min_bytes, **options):
        got = submit(workers.first, value, case.twice)
    changed = built.mutate(case.change)
    expected_after = by_value(workers.reference, value, case.twice)
    with refshare.sharing(min_bytes=case.min_bytes, **options):
        got_after = submit(workers.first, value, case.twice)
    found = [
        difference(expected, got, "first call"),
        difference(expected_after, got_after, f"second call, after changing {changed}"),
    ]
    return [f for f in found if f is not None]


def within_one_call(workers: Workers, case: Case, put: bool = False, **options: Any) -> Differences:
    """One ``sharing`` block sending the value to two workers, a change in place between:
    how each submission differs from by value. With ``put``, each send is a ``ray.put`` of
    the value and its ref, and a third follows, unchanged: a value put for the first time in
    a call is keyed without stamps, hashed again when put again, and stamped from then on."""
    send = submit_put if put else submit
    refshare.clear()
    built = build(case.recipe, workers.actors)
    value = built.value
    with refshare.sharing(min_bytes=case.min_bytes, **options):
        expected = by_value(workers.reference, value, case.twice, send)
        got = send(workers.first, value, case.twice)
        changed = built.mutate(case.change)
        expected_after = by_value(workers.reference, value, case.twice, send)
        after = [send(workers.second, value, case.twice)]
        if put:
            after.append(send(workers.first, value, case.twice))
    found = [difference(expected, got, "first send")]
    found += [
        difference(expected_after, got_after, f"send {n}, after changing {changed}")
        for n, got_after in enumerate(after, start=2)
    ]
    return [f for f in found if f is not None]


#: Each way of sending, by name: what the property tests and the exploration run.
SCENARIOS = {
    "top-across-calls": lambda w, c: across_calls(w, c),
    "deep-across-calls": lambda w, c: across_calls(w, c, deep=True),
    "top-within-one-call": lambda w, c: within_one_call(w, c),
    "deep-within-one-call": lambda w, c: within_one_call(w, c, deep=True),
    "puts-within-one-call": lambda w, c: within_one_call(w, c, put=True),
    "deep-puts-within-one-call": lambda w, c: within_one_call(w, c, put=True, deep=True),
}


#: Lookalike pairs, by name.
PAIR_SCENARIOS = {
    "top-one-call": lambda w, p: lookalikes(w, p, across=False, put=False),
    "deep-one-call": lambda w, p: lookalikes(w, p, across=False, put=False, deep=True),
    "top-across-calls": lambda w, p: lookalikes(w, p, across=True, put=False),
    "puts-one-call": lambda w, p: lookalikes(w, p, across=False, put=True),
    "deep-puts-one-call": lambda w, p: lookalikes(w, p, across=False, put=True, deep=True),
}


def assert_none(found: Differences) -> None:
    assert not found, "\n".join(text for _, text in found)


@SETTINGS
@given(case=cases)
def test_by_value_is_deterministic(workers: Workers, case: Case) -> None:
    """The yardstick: two builds sent by value to two workers are described alike, before
    and after the same change, so any difference the suite reports is refshare's."""
    one, two = build(case.recipe, workers.actors), build(case.recipe, workers.actors)
    assert_same(
        submit(workers.reference, one.value, case.twice),
        submit(workers.first, two.value, case.twice),
        "two by-value sends",
    )
    assert one.mutate(case.change) == two.mutate(case.change)
    assert_same(
        submit(workers.reference, one.value, case.twice),
        submit(workers.second, two.value, case.twice),
        "two by-value sends after a change",
    )


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@SETTINGS
@given(case=cases)
def test_worker_receives_what_by_value_gives(workers: Workers, scenario: str, case: Case) -> None:
    """Each submission of each way of sending is described as by value describes it."""
    assert_none(SCENARIOS[scenario](workers, case))


@pytest.mark.parametrize("scenario", list(PAIR_SCENARIOS))
@SETTINGS
@given(pair=pairs)
def test_lookalikes_are_told_apart(workers: Workers, scenario: str, pair: Pair) -> None:
    """Two values alike but for what ``==`` ignores each reach their worker as by value."""
    assert_none(PAIR_SCENARIOS[scenario](workers, pair))


def test_classes_made_here_are_sent_by_value() -> None:
    """The suite's "``__main__``" classes really travel as code, with their state."""
    for kind in ("plain", "dataclass", "slots"):
        cls, _ = main_class("Made", kind, 1, 2)
        assert pickled_by_value(cls), kind
    built = build(Main("plain", (Atom(1),), factor=3, scale=4), [])
    assert built.value.probe() == 4 and type(built.value).factor == 3


# -- known bugs, one small case each -------------------------------------------------------------

MiB = 1 << 20


def _twins(first: np.dtype[Any], second: np.dtype[Any]) -> tuple[np.ndarray, np.ndarray]:
    """Two arrays of equal bytes whose dtypes are ``==`` but pickle differently."""
    assert first == second and first.itemsize == second.itemsize
    raw = np.arange(MiB, dtype=np.uint8)[: MiB - MiB % first.itemsize]
    return raw.view(first).copy(), raw.view(second).copy()


PAIR = [("a", "u1"), ("b", "<i4")]
PACKED = [("a", "<i4"), ("b", "<f4")]  # no padding: aligned or not, the same 8 bytes
EQUAL_DTYPES = {
    "metadata": (np.dtype("<f4"), np.dtype("<f4", metadata={"a": 1})),
    "aligned": (np.dtype(PACKED), np.dtype(PACKED, align=True)),
    "record": (np.dtype(PAIR), np.dtype((np.record, PAIR))),
}


def _pickles_differently(a: np.dtype[Any], b: np.dtype[Any]) -> bool:
    return pickle.dumps(a, protocol=5) != pickle.dumps(b, protocol=5)


@pytest.mark.parametrize("deep", [False, True], ids=["top", "deep"])
@pytest.mark.parametrize("pair", sorted(EQUAL_DTYPES))
def test_equal_dtypes_that_pickle_differently_in_one_call(
    workers: Workers, pair: str, deep: bool
) -> None:
    """(a) ``np.dtype('f4')`` and ``np.dtype('f4', metadata={'a': 1})`` (or an aligned, or
    an ``np.record``, struct) are ``==``: sent in one call, each worker still gets its own."""
    a, b = _twins(*EQUAL_DTYPES[pair])
    assert _pickles_differently(a.dtype, b.dtype)
    wrap = (lambda x: {"x": x}) if deep else (lambda x: x)
    expected = [by_value(workers.reference, wrap(x)) for x in (a, b)]
    with refshare.sharing(deep=deep):
        got = [submit(w, wrap(x)) for w, x in ((workers.first, a), (workers.second, b))]
    assert_same(expected[0], got[0], "first worker")
    assert_same(expected[1], got[1], f"second worker ({pair})")


def test_equal_dtypes_with_and_without_metadata_in_one_call(workers: Workers) -> None:
    """(a) The bare case from the brief: f4 with and without metadata, equal bytes."""
    plain, with_metadata = _twins(np.dtype("f4"), np.dtype("f4", metadata={"a": 1}))
    assert with_metadata.dtype.metadata == {"a": 1}
    expected = by_value(workers.reference, with_metadata)
    with refshare.sharing():
        submit(workers.first, plain)
        got = submit(workers.second, with_metadata)
    assert_same(expected, got, "the array with metadata")


@pytest.mark.parametrize("deep", [False, True], ids=["top", "deep"])
@pytest.mark.parametrize("what", ["class attribute", "global"])
def test_main_class_changed_between_calls(workers: Workers, what: str, deep: bool) -> None:
    """(b) An instance of a class sent by value: its class attribute (or a global its method
    reads) changed between two calls reaches the second worker, as by value."""
    cls, module_globals = main_class("Settings", "plain", "before", "before")
    assert pickled_by_value(cls)
    obj = cls()
    obj.a = np.arange(MiB // 8, dtype=np.float64)
    obj.b = "small"
    value = {"obj": obj} if deep else obj
    with refshare.sharing(deep=deep):
        ray.get(submit(workers.first, value))
    if what == "class attribute":
        cls.factor = "after"
    else:
        module_globals["SCALE"] = "after"
    expected = by_value(workers.reference, value)
    with refshare.sharing(deep=deep):
        got = submit(workers.first, value)
    assert_same(expected, got, f"after the {what} changed")


@pytest.mark.parametrize("deep", [False, True], ids=["top", "deep"])
def test_main_class_itself_changed_between_calls(workers: Workers, deep: bool) -> None:
    """(b) A class sent by value as a value of its own (a factory, say): a class attribute
    changed between two calls reaches the second worker."""
    cls, _ = main_class("Factory", "plain", "before", "before")
    value = [cls, np.zeros(1000)]
    with refshare.sharing(deep=deep, min_bytes=0):
        ray.get(submit(workers.first, value))
    cls.factor = "after"
    expected = by_value(workers.reference, value)
    with refshare.sharing(deep=deep, min_bytes=0):
        got = submit(workers.first, value)
    assert_same(expected, got, "after the class attribute changed")


def _needs_torch() -> Any:
    return pytest.importorskip("torch")


def test_tensor_changed_through_numpy_within_one_call(workers: Workers) -> None:
    """(c) A float32 tensor changed via ``t.numpy()[0] = 2.0`` (from 1.0) between two
    ``.remote()`` of one call: the second worker sees 2.0, as by value."""
    torch = _needs_torch()
    t = torch.ones(MiB // 4)
    with refshare.sharing():
        submit(workers.first, t)
        t.numpy()[0] = 2.0
        expected = by_value(workers.reference, t)
        got = submit(workers.second, t)
    assert_same(expected, got, "after t.numpy()[0] = 2.0")


def test_inference_tensor_changed_within_one_call(workers: Workers) -> None:
    """(c) A tensor made under ``torch.inference_mode()`` changed in place (it has no
    version counter) between two ``.remote()`` of one call."""
    torch = _needs_torch()
    with torch.inference_mode():
        t = torch.ones(MiB // 4)
    with refshare.sharing():
        submit(workers.first, t)
        with torch.inference_mode():
            t[0] = 2.0
        expected = by_value(workers.reference, t)
        got = submit(workers.second, t)
    assert_same(expected, got, "after t[0] = 2.0 in inference mode")


def _recarray() -> np.ndarray:
    rec = np.zeros(MiB // 8, dtype=[("a", "<i4"), ("b", "<f4")]).view(np.recarray)
    rec.a[:] = 1
    return rec


def _masked() -> np.ndarray:
    data = np.ones(MiB // 8)
    return np.ma.MaskedArray(data, mask=np.arange(data.size) % 3 == 0)


def _change_recarray(rec: np.ndarray) -> None:
    rec.a[0] = 2


def _change_masked(arr: np.ndarray) -> None:
    arr.data[0] = 2.0


SUBCLASS_CASES = {
    "recarray": (_recarray, _change_recarray),
    "masked": (_masked, _change_masked),
}


@pytest.mark.parametrize("how", ["deep", "own pickling"])
@pytest.mark.parametrize("kind", sorted(SUBCLASS_CASES))
def test_subclass_in_a_dict_changed_within_one_call(workers: Workers, kind: str, how: str) -> None:
    """(d) An ``np.recarray`` (or masked array) inside a dict, changed in place between two
    submissions of one call, deep-shared or in a wrapper with pickling of its own."""
    make, change = SUBCLASS_CASES[kind]
    arr = make()
    value: Any = {"arr": arr, "tag": "t"}
    if how == "own pickling":
        value = OwnPickling(value)
    with refshare.sharing(deep=how == "deep"):
        submit(workers.first, value)
        change(arr)
        expected = by_value(workers.reference, value)
        got = submit(workers.second, value)
    assert_same(expected, got, f"after changing the {kind} in place")


@pytest.mark.parametrize("deep", [False, True], ids=["top", "deep"])
def test_sparse_tensor_changed_within_one_call(workers: Workers, deep: bool) -> None:
    """A sparse COO tensor whose values change in place between two ``.remote()`` of one
    call: the second worker sees the new values, as by value."""
    torch = _needs_torch()
    dense = torch.zeros(1000, 300)
    dense[0, 0] = 1.0
    sparse = dense.to_sparse()
    value = {"s": sparse} if deep else sparse
    with refshare.sharing(deep=deep, min_bytes=0):
        submit(workers.first, value)
        with torch.no_grad():
            sparse._values()[0] = 5.0
        expected = by_value(workers.reference, value)
        got = submit(workers.second, value)
    assert_same(expected, got, "after changing the sparse values")


@pytest.mark.mismatches_expected  # pickles anew each time: verify reports it, safely
def test_reduce_with_a_new_payload_each_time(workers: Workers) -> None:
    """(e) A ``__reduce__`` that returns a new payload each time (a counter): by value each
    of two workers in one call sees its own payload."""
    value = Counted(np.zeros(MiB // 8))
    expected = [by_value(w, value) for w in (workers.reference, workers.first)]
    assert outcome(expected[0]) != outcome(expected[1])  # by value: two payloads
    with refshare.sharing():
        got = [submit(w, value) for w in (workers.first, workers.second)]
    first, second = outcome(got[0]), outcome(got[1])
    assert first != second, "both workers got the same payload"


def _dict_of_array() -> Any:
    return {"x": np.ones(MiB // 8)}


def _dict_of_tensor() -> Any:
    return {"t": _needs_torch().ones(MiB // 4)}


@pytest.mark.parametrize(
    ("make", "deep"),
    [(_dict_of_array, True), (_dict_of_tensor, False), (_dict_of_tensor, True)],
    ids=["arrays-deep", "tensors-top", "tensors-deep"],
)
def test_plain_dict_reached_twice_arrives_as_by_value(
    workers: Workers, make: Any, deep: bool
) -> None:
    """``{"a": d, "b": d}`` with ``d`` a plain dict: Ray by value sends plain dicts and lists
    through msgpack, so the worker gets two dicts (sharing the arrays inside); refshare's own
    pickling (deep, or a value holding tensors) must not make them one object."""
    d = make()
    value = {"a": d, "b": d}
    expected = by_value(workers.reference, value)
    with refshare.sharing(deep=deep):
        got = submit(workers.first, value)
    assert_same(expected, got, "a plain dict reached twice")


def _bytearray_in_a_dataclass() -> Any:
    return Box(bytearray(MiB))


def _bytearray_beside_a_tensor() -> Any:
    return [bytearray(b"small"), _needs_torch().ones(MiB // 4)]


@pytest.mark.parametrize(
    ("make", "deep"),
    [(_bytearray_in_a_dataclass, True), (_bytearray_beside_a_tensor, False)],
    ids=["member-deep", "beside-a-tensor-top"],
)
def test_bytearray_arrives_as_by_value(workers: Workers, make: Any, deep: bool) -> None:
    """A ``bytearray`` inside an object arrives as a ``bytearray`` by value (pickled), one in
    a plain list as ``bytes`` (msgpack): refshare must give the same type in both places."""
    value = make()
    expected = by_value(workers.reference, value)
    with refshare.sharing(deep=deep):
        got = submit(workers.first, value)
    assert_same(expected, got, "a bytearray")


# -- lifetimes: nested refs and actor handles live as long as by value keeps them -----------------


def _kept_after_the_driver_let_go(keeper: Any, options: dict[str, Any] | None) -> Outcome:
    """A worker keeps a value holding a nested ref and an actor handle; the driver drops its
    own copies (and refshare its cache); then the worker describes what it kept."""
    value: Any = {
        "ref": ray.put(np.arange(1000)),
        "actor": Tagged.remote("kept"),
        "big": np.ones(MiB // 8),
    }
    if options is None:
        ray.get(keeper.keep.remote(value), timeout=120)
    else:
        with refshare.sharing(min_bytes=0, **options):
            ray.get(keeper.keep.remote(value), timeout=120)
    del value
    refshare.clear()
    gc.collect()
    time.sleep(0.5)  # let Ray release what nothing holds
    return outcome(keeper.kept.remote())


@pytest.fixture(scope="module")
def kept_by_value(workers: Workers) -> Outcome:
    found = _kept_after_the_driver_let_go(workers.second, None)
    assert found[0] == "ok", found
    return found


@pytest.mark.parametrize(
    "options",
    [{}, {"deep": True}, {"cache": False}, {"deep": True, "cache": False}],
    ids=["top", "deep", "top-uncached", "deep-uncached"],
)
def test_nested_refs_and_handles_outlive_the_driver_copies(
    workers: Workers, kept_by_value: Outcome, options: dict[str, Any]
) -> None:
    """A kept nested ref and actor handle stay usable after the driver dropped its own
    copies, exactly as by value."""
    expected = kept_by_value
    got = _kept_after_the_driver_let_go(workers.second, options)
    found = first_difference(expected, got)
    assert found is None, found[1]
