"""Arrays of strings, stored joined (see ``refshare._wire.strings``), on a real Ray: a
worker gets what Ray by value gives it, down to which elements are one object.

Pickle's memo sends a string object once however many elements it fills, so an array
that repeats one object (verl's ``uid`` column: one uid per prompt, repeated for each
sample) arrives by value with those elements one object, and pickles again to a fraction
of the bytes. ``describe_fully`` takes strings as values, so each receiver also reports
the identity pattern of the array's elements and the size of its elements' pickle.
"""

from __future__ import annotations

import pickle
import random
import sys
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import ray
from differential_kit import describe_fully, first_difference

import refshare
from refshare import fingerprint

pytestmark = pytest.mark.usefixtures("local_ray", "fresh")

PROMPTS, SAMPLES = 256, 8
DEEP = [False, None, True]


def identity_pattern(arr: np.ndarray) -> list[int]:
    """Each element (in C order) as the index of the first element that is the same object."""
    first: dict[int, int] = {}
    return [first.setdefault(id(x), i) for i, x in enumerate(arr.ravel().tolist())]


def the_strings(value: Any) -> np.ndarray:
    """The array of strings a value is or holds (under ``"uids"``)."""
    arr = value["uids"] if isinstance(value, dict) else value
    assert isinstance(arr, np.ndarray)
    return arr


def observe(value: Any) -> tuple[Any, int, list[int]]:
    """What a receiver sees of a value: everything ``describe_fully`` reports, the pickle
    size of its strings as a list, and their identity pattern."""
    arr = the_strings(value)
    return describe_fully(value), len(pickle.dumps(arr.tolist())), identity_pattern(arr)


@ray.remote(num_cpus=0.05)
class Receiver:
    def observe(self, value: Any) -> tuple[Any, int, list[int]]:
        return observe(value)


@pytest.fixture(scope="module")
def receiver(local_ray: None) -> Any:
    actor = Receiver.remote()  # type: ignore[attr-defined]
    ray.get(actor.observe.remote(np.array(["warm"], dtype=object)), timeout=120)
    return actor


# -- the arrays ---------------------------------------------------------------------------


class Tag(str):
    """A str subclass: pickles with its class, so an array holding one is not joined."""


def fresh(text: str) -> str:
    """An equal string that is an object of its own (for more than one character)."""
    return "".join([text[:1], text[1:]])


def uid_column() -> np.ndarray:
    """verl's ``uid`` column after ``repeat(interleave=True)``: one uid object per prompt,
    the same object for each of its samples."""
    rng = random.Random(0)
    uids = np.array([str(uuid.UUID(int=rng.getrandbits(128))) for _ in range(PROMPTS)], object)
    return np.repeat(uids, SAMPLES)


def equal_but_distinct() -> np.ndarray:
    """Equal strings, each an object of its own: pickle sends every one."""
    return np.array([fresh("one answer, many times") for _ in range(PROMPTS * SAMPLES)], object)


def interned_literals() -> np.ndarray:
    """Short literals (the same object each time they are written) and interned strings."""
    words = ["yes" if i % 3 else "no" for i in range(900)]
    words += ["a", "", "\u00e9", "\u4e2d", sys.intern(fresh("interned-uid"))] * 60
    return np.array(words, object)


def f_order_2d() -> np.ndarray:
    return np.asfortranarray(uid_column().reshape(PROMPTS, SAMPLES))


def mixed() -> np.ndarray:
    """Repeated objects, equal distinct objects, unique strings, empty and non-ASCII ones,
    shuffled, in a non-contiguous view."""
    rng = random.Random(1)
    shared = [fresh(f"shared-\u00e9-{i}") for i in range(40)]
    items = [rng.choice(shared) for _ in range(1200)]
    items += [fresh("same text") for _ in range(300)]
    items += [f"unique-{i}-\u4e2d" for i in range(300)] + ["", "x"] * 100
    rng.shuffle(items)
    return np.array(items, object).reshape(50, 40)[:, ::2]


def scalar() -> np.ndarray:
    arr = np.empty((), object)
    arr[()] = fresh("a 0-d array")
    return arr


def unpickled() -> np.ndarray:
    """The uid column as it comes back from a worker: its dtype made anew, not builtin."""
    return pickle.loads(pickle.dumps(uid_column(), protocol=5))


CASES: dict[str, Callable[[], np.ndarray]] = {
    "uid-column": uid_column,
    "unpickled": unpickled,
    "equal-but-distinct": equal_but_distinct,
    "interned-literals": interned_literals,
    "f-order-2d": f_order_2d,
    "mixed": mixed,
    "0-d": scalar,
}
WRAPS: dict[str, Callable[[np.ndarray], Any]] = {
    "top": lambda arr: arr,
    "in-dict": lambda arr: {"uids": arr, "x": np.arange(1 << 17, dtype=np.float64)},
}


def test_the_cases_are_what_they_say() -> None:
    """The cases cover both forms: repeated objects (an index) and distinct ones (none)."""
    from refshare._wire.strings import strings_form

    for name, make in CASES.items():
        form = strings_form(make())
        assert form is not None, name
        repeats = name not in ("equal-but-distinct", "0-d")
        assert (form.args[3] is not None) == repeats, name
    column = uid_column()
    assert column[0] is column[SAMPLES - 1] and column[0] is not column[SAMPLES]
    assert unpickled().dtype.isbuiltin == 0


def test_an_unpickled_column_is_keyed_as_the_original() -> None:
    """A column back from a worker pickles as the one sent: it is found again (it was keyed
    by its pickle, apart, because its dtype is not numpy's builtin one)."""
    column = uid_column()
    assert pickle.dumps(unpickled(), protocol=5) == pickle.dumps(column, protocol=5)
    assert refshare.fingerprint(unpickled()) == refshare.fingerprint(column)


# -- what a worker receives -----------------------------------------------------------------


def assert_received_alike(expected: Any, got: Any, what: str) -> None:
    description, size, pattern = got
    want_description, want_size, want_pattern = expected
    found = first_difference(want_description, description)
    assert found is None, f"{what}: {found[1]}"
    assert pattern == want_pattern, f"{what}: identity pattern differs"
    assert size == want_size, f"{what}: its strings pickle to {size} bytes, by value {want_size}"


@pytest.mark.parametrize("deep", DEEP, ids=["top-level", "deep-auto", "deep"])
@pytest.mark.parametrize("wrap", sorted(WRAPS))
@pytest.mark.parametrize("case", list(CASES))
def test_received_as_by_value(receiver: Any, case: str, wrap: str, deep: bool | None) -> None:
    """By value and through refshare (a put, then a hit), the worker sees the same: the
    description, the identity pattern of the strings and the size of their pickle."""
    value = WRAPS[wrap](CASES[case]())
    with refshare.sharing(enabled=False):
        expected = ray.get(receiver.observe.remote(value), timeout=120)
    assert expected[2] == identity_pattern(the_strings(value))  # by value keeps the memo's
    got = []
    for _ in range(2):  # two blocks: a put, then a hit of the process-wide cache
        with refshare.sharing(min_bytes=0, deep=deep):
            got.append(ray.get(receiver.observe.remote(value), timeout=120))
    stats = refshare.stats()
    assert stats.puts >= 1 and stats.hits >= 1, stats  # it went through refshare
    for i, received in enumerate(got):
        assert_received_alike(expected, received, f"{case} {wrap} deep={deep}, send {i}")


def test_the_uid_column_arrives_small(receiver: Any) -> None:
    """verl's case in numbers: by value and through refshare, the worker's uids re-pickle to
    a fraction of what as many distinct strings take."""
    column = uid_column()
    with refshare.sharing(min_bytes=0):
        _, size, pattern = ray.get(receiver.observe.remote(column), timeout=120)
    distinct = len(pickle.dumps([fresh(x) for x in column.tolist()]))
    assert size == len(pickle.dumps(column.tolist())) and size * 4 < distinct
    assert len(set(pattern)) == PROMPTS


@pytest.mark.parametrize("deep", DEEP, ids=["top-level", "deep-auto", "deep"])
def test_equal_text_other_aliasing_is_not_a_hit(receiver: Any, deep: bool | None) -> None:
    """Arrays of one text, one repeating objects and one not, in one block; then in another
    block the first again and the second changed in place to repeat an object (its text
    unchanged): each worker gets what by value gives it."""
    aliased = uid_column()
    distinct = np.array([fresh(x) for x in aliased.tolist()], object)

    def send(value: np.ndarray) -> Any:
        return ray.get(receiver.observe.remote({"uids": value}), timeout=120)

    with refshare.sharing(enabled=False):
        expected = [send(aliased), send(distinct), send(aliased)]
    with refshare.sharing(min_bytes=0, deep=deep):
        got = [send(aliased), send(distinct)]
    distinct[1] = distinct[0]
    with refshare.sharing(enabled=False):
        expected.append(send(distinct))
    with refshare.sharing(min_bytes=0, deep=deep):
        got += [send(aliased), send(distinct)]
    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        assert_received_alike(want, have, f"value {i}, deep={deep}")
    assert expected[0][2] != expected[1][2] != expected[3][2]
    assert refshare.stats().hits >= 1


# -- keys ------------------------------------------------------------------------------------


def test_the_key_carries_the_aliasing() -> None:
    """Same text, other aliasing: another key (pickle sends them differently). Same text and
    same aliasing in other objects: the same key."""
    aliased = uid_column()
    distinct = np.array([fresh(x) for x in aliased.tolist()], object)
    # The same pattern in objects of their own: each uid made afresh, repeated as before.
    again = np.repeat(np.array([fresh(x) for x in aliased[::SAMPLES].tolist()], object), SAMPLES)
    assert identity_pattern(again) == identity_pattern(aliased)
    assert aliased.tolist() == distinct.tolist() == again.tolist()
    assert fingerprint(aliased) == fingerprint(again) != fingerprint(distinct)
    assert fingerprint(distinct) == fingerprint(np.array(distinct.tolist(), object))
    big = np.zeros(1 << 17)
    assert fingerprint({"uids": aliased, "x": big}) == fingerprint({"uids": again, "x": big})
    assert fingerprint({"uids": aliased, "x": big}) != fingerprint({"uids": distinct, "x": big})
    # One text, "xx yy xx yy", sent three ways: four objects, two, three.
    x, y = fresh("xx"), fresh("yy")
    texts = ([x, y, fresh(x), fresh(y)], [x, y, x, y], [x, y, fresh(x), y])
    assert len({fingerprint(np.array(items, object)) for items in texts}) == 3
    # One text and one set of distinct strings, "xx" twice: other elements are one object.
    x2 = fresh(x)
    assert fingerprint(np.array([x, x2, x, x2], object)) != fingerprint(
        np.array([x, x2, x2, x], object)
    )
    a, b = fresh(x), fresh(y)
    assert fingerprint(np.array([x, y, x, y], object)) == fingerprint(
        np.array([a, b, a, b], object)
    )
    # Layouts: the F-order and the C-order array of one pattern are other arrays.
    grid = aliased.reshape(PROMPTS, SAMPLES)
    assert fingerprint(grid) != fingerprint(np.asfortranarray(grid))
    assert fingerprint(np.asfortranarray(grid)) == fingerprint(np.asfortranarray(grid.copy()))


# -- what is kept of a join ------------------------------------------------------------------


def afresh(arr: np.ndarray) -> tuple[Any, Any]:
    """The key and stored form of ``arr`` as a first sight makes them: nothing joined kept."""
    from refshare._wire.strings import forget_joins, strings_form

    forget_joins()
    form = strings_form(arr)
    forget_joins()
    return fingerprint(arr), None if form is None else form.args


def kept(arr: np.ndarray) -> tuple[Any, Any]:
    """The key and stored form of ``arr`` with what was joined lately kept."""
    from refshare._wire.strings import strings_form

    form = strings_form(arr)
    return fingerprint(arr), None if form is None else form.args


def assert_same_form(got: tuple[Any, Any], want: tuple[Any, Any], what: str) -> None:
    assert got[0] == want[0], f"{what}: key"
    if want[1] is None:
        assert got[1] is None, what
        return
    (
        (text, shape, order, index, dtype),
        (want_text, want_shape, want_order, want_index, want_dtype),
    ) = (
        got[1],
        want[1],
    )
    assert (text, shape, order, dtype) == (want_text, want_shape, want_order, want_dtype), what
    if want_index is None:
        assert index is None, what
    else:
        assert index is not None and index.dtype == want_index.dtype, what
        assert np.array_equal(index, want_index), what


def test_a_kept_join_answers_only_for_the_very_objects() -> None:
    """An array holding the objects of one joined lately, in the same order (the array
    again, a copy, a view), is found by its pointers; once any element is replaced (by an
    equal string of its own, by another element's object, by other text, by other text at
    the very address the old object was freed from, by what is not a plain string), its key
    and stored form are what a first sight gives."""
    rng = random.Random(2)
    arr = np.array([fresh(f"uid-{i % 97:02d}-\u00e9") for i in range(3000)], object)
    arr[7::7] = arr[0]
    for step in range(60):
        i, j = rng.randrange(1, arr.size), rng.randrange(arr.size)
        change = step % 6
        if change == 0:
            arr[i] = fresh(arr[i])  # equal text, an object of its own
        elif change == 1:
            arr[i] = arr[j]  # one object in two places
        elif change == 2:
            arr[i] = fresh(f"changed-{step}")
        elif change == 3:
            # A long string freed, then other text of its size made at once: were nothing
            # else holding the old one, the new one would take its address (malloc hands
            # the block just freed back).
            other = fresh(f"long-{step:02d}-" + "x" * 600)
            arr[i] = other.swapcase()
            kept(arr)
            other = arr[i].replace("LONG", "long")
            arr[i] = None
            arr[i] = other.swapcase()  # LONG-..-xxx, where it was LONG-..-XXX
        elif change == 4 and step % 12 == 4:
            arr[i] = Tag(arr[i])  # a subclass: not joined, until replaced again
        kept(arr)  # joined now, or found
        for view in (arr, arr.copy(), arr.reshape(60, 50)[:, ::2], np.asfortranarray(arr)):
            assert_same_form(kept(view), afresh(view), f"step {step}")
        if change == 4 and step % 12 == 4:
            arr[i] = fresh("plain again")


def test_the_layout_read_in_python_gives_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the list and object layouts are not known, the elements are read one by one:
    the same keys and forms, the same arrays refused."""
    from refshare._wire import strings

    refused = []
    for other in (Tag("x"), np.str_("x"), b"x", None, "a\0b"):
        arr = uid_column()
        arr[1000::97] = other
        refused.append(arr)
    arrays = [make() for make in CASES.values()] + refused
    fast = [afresh(arr) for arr in arrays]
    monkeypatch.setattr(strings, "_layout", lambda: None)
    for arr, want in zip(arrays, fast, strict=True):
        assert_same_form(afresh(arr), want, repr(arr.ravel()[:3]))
    assert all(found[1] is None for found in fast[len(CASES) :])


def test_clear_lets_go_of_the_strings_joined() -> None:
    """What was joined is held (its objects' addresses cannot be reused while kept), until
    ``refshare.clear()``."""
    text = fresh("held by the array, and by what refshare joined")
    arr = np.array([text] * 300 + [fresh(f"x{i}") for i in range(300)], object)
    alone = sys.getrefcount(text)
    fingerprint(arr)
    assert sys.getrefcount(text) > alone
    refshare.clear()
    assert sys.getrefcount(text) == alone
