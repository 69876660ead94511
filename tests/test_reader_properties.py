"""Readers proven, not sampled: over verl's ``DataProto`` and tensordict's ``TensorDict``
state space, equal keys mean equal by-value serializations, and a worker receives exactly
what it receives by value, in all three deep modes.

Each example is a recipe for a batch (tensor entries of several dtypes and shapes,
non-tensor entries, a nested ``TensorDict`` with its own size and names, names, a lock,
a consolidation that came back unpickled and was edited since, a column of strings with
repeats) inside a ``DataProto`` or a subclass with and without pickling of its own, and a
second recipe one change away from it. Runs where verl and tensordict import."""

from __future__ import annotations

import copyreg
import dataclasses
import pickle
from typing import Any

import numpy as np
import pytest
import ray
from differential_kit import Probe, first_difference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serialized_kit import serialized_digest

import refshare

torch = pytest.importorskip("torch")
pytest.importorskip("tensordict")
pytest.importorskip("verl.protocol")

from tensordict import TensorDict  # noqa: E402
from verl.protocol import DataProto  # noqa: E402

DTYPES = {"float32": torch.float32, "int64": torch.int64, "bool": torch.bool}


class Plain(DataProto):  # type: ignore[misc]
    """Pickles as its base: read as one."""


class Tagged(DataProto):  # type: ignore[misc]
    """Its own pickling sends a tag."""

    def __getstate__(self) -> Any:
        return super().__getstate__(), getattr(self, "tag", None)

    def __setstate__(self, state: Any) -> None:
        base, self.tag = state
        super().__setstate__(base)


class Registered(DataProto):  # type: ignore[misc]
    """Pickled through copyreg, with a tag."""


def _reduce_registered(data: Registered) -> tuple[Any, ...]:
    return _rebuild_registered, (data.batch, data.non_tensor_batch, getattr(data, "tag", None))


def _rebuild_registered(batch: Any, non_tensor: Any, tag: Any) -> Registered:
    data = Registered(batch=batch, non_tensor_batch=non_tensor, meta_info={})
    data.tag = tag
    return data


copyreg.pickle(Registered, _reduce_registered)
CLASSES = {"DataProto": DataProto, "Plain": Plain, "Tagged": Tagged, "Registered": Registered}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A batch, and what wraps it."""

    rows: int
    entries: tuple[tuple[str, str, int, int], ...]  # name, dtype, columns, seed
    non_tensor: Any  # a NonTensorData's value, or None for none
    nested: tuple[int | None, bool] | None  # the inner batch's second dim, names; or none
    names: bool
    locked: bool
    consolidated: str | None  # None, or an edit after an unpickled consolidation
    uids: str | None  # None, "distinct" or "repeated"
    cls: str
    tag: str
    step: int


def _tensor(dtype: str, rows: int, columns: int, seed: int) -> Any:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 3, (rows, columns), generator=generator)
    return values.to(DTYPES[dtype])


def build_batch(recipe: Recipe) -> Any:
    rows = recipe.rows
    batch = TensorDict(
        {name: _tensor(dtype, rows, cols, seed) for name, dtype, cols, seed in recipe.entries},
        batch_size=[rows],
    )
    if recipe.nested is not None:
        columns, named = recipe.nested
        size = [rows] if columns is None else [rows, columns]
        inner = TensorDict({"x": torch.ones(rows, columns or 2)}, batch_size=size)
        if named:
            inner.names = ["r"] + [None] * (len(size) - 1)
        batch["inner"] = inner
    if recipe.non_tensor is not None:
        batch.set_non_tensor("flag", recipe.non_tensor)
    if recipe.names:
        batch.names = ["rows"]
    if recipe.consolidated is not None:
        batch = pickle.loads(pickle.dumps(batch.consolidate()))
        edit = recipe.consolidated
        if edit == "replace" and recipe.entries:
            batch[recipe.entries[0][0]] = torch.full((rows, 2), 9.0)
        elif edit == "add":
            batch["added"] = torch.full((rows,), 5.0)
        elif edit == "delete" and recipe.entries:
            del batch[recipe.entries[0][0]]
    if recipe.locked:
        batch.lock_()
    return batch


def build(recipe: Recipe) -> Any:
    non_tensor: dict[str, Any] = {}
    if recipe.uids is not None:
        uids = [f"uid-{i}" for i in range(recipe.rows // 2)]
        if recipe.uids == "repeated":  # one object per prompt, repeated per sample
            items = [uids[i // 2] for i in range(recipe.rows)]
        else:
            items = [f"uid-{i // 2}" for i in range(recipe.rows)]
        non_tensor["uid"] = np.array(items, dtype=object)
    data = CLASSES[recipe.cls](
        batch=build_batch(recipe), non_tensor_batch=non_tensor, meta_info={"step": recipe.step}
    )
    if recipe.cls != "DataProto":
        data.tag = recipe.tag
    return data


NAMES = st.sampled_from(["a", "b", "c"])
ENTRY = st.tuples(
    NAMES, st.sampled_from(sorted(DTYPES)), st.sampled_from([1, 3]), st.integers(0, 2)
)
RECIPES = st.builds(
    Recipe,
    rows=st.sampled_from([2, 4]),
    entries=st.lists(ENTRY, min_size=1, max_size=3, unique_by=lambda e: e[0]).map(tuple),
    non_tensor=st.sampled_from([None, "x", "y", 1, 1.0, True]),
    nested=st.none() | st.tuples(st.sampled_from([None, 2]), st.booleans()),
    names=st.booleans(),
    locked=st.booleans(),
    consolidated=st.sampled_from([None, None, "none", "replace", "add", "delete"]),
    uids=st.sampled_from([None, "distinct", "repeated"]),
    cls=st.sampled_from(sorted(CLASSES)),
    tag=st.sampled_from(["first", "second"]),
    step=st.integers(0, 1),
)
#: Fields a mutation may change, each to another value its strategy draws.
FIELDS = [field.name for field in dataclasses.fields(Recipe)]


@st.composite
def pairs(draw: Any) -> tuple[Recipe, Recipe]:
    """A recipe, and another one field away from it (or the same, a third of the time)."""
    first = draw(RECIPES)
    if draw(st.integers(0, 2)) == 0:
        return first, first
    other = draw(RECIPES)
    name = draw(st.sampled_from(FIELDS))
    return first, dataclasses.replace(first, **{name: getattr(other, name)})


def key_and_digest(value: Any) -> tuple[bytes | None, bytes | None]:
    key = refshare.fingerprint(value)
    try:
        digest = serialized_digest(value)
    except Exception:
        digest = None  # by value raises (a conjugate tensor, say): so must refshare
    return key, digest


SETTINGS = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@SETTINGS
@given(pair=pairs(), wrapped=st.booleans())
def test_equal_keys_mean_equal_by_value_serializations(
    pair: tuple[Recipe, Recipe], wrapped: bool
) -> None:
    make = build if wrapped else build_batch
    (key_a, digest_a), (key_b, digest_b) = map(key_and_digest, map(make, pair))
    if key_a is not None and key_a == key_b:
        assert digest_a == digest_b, pair
    if pair[0] == pair[1] and digest_a is not None:
        assert key_a == key_b is not None  # the same content keys alike: it is found again


# -- what a worker receives ---------------------------------------------------------------


@pytest.fixture(scope="module")
def probes(local_ray: None) -> list[Any]:
    group = [Probe.remote() for _ in range(2)]
    ray.get([p.ping.remote() for p in group])
    return group


def _received(probes: list[Any], value: Any, **options: Any) -> list[Any]:
    with refshare.sharing(**options):
        return ray.get([p.describe.remote(value) for p in probes])


@pytest.mark.usefixtures("local_ray", "fresh")
@pytest.mark.parametrize("deep", [False, None, True])
def test_a_worker_receives_what_it_receives_by_value(probes: list[Any], deep: Any) -> None:
    @settings(SETTINGS, max_examples=6)
    @given(pair=pairs())
    def check(pair: tuple[Recipe, Recipe]) -> None:
        for recipe in pair:  # the second after the first: found again, or not
            want = _received(probes, build(recipe), enabled=False)
            got = _received(probes, build(recipe), min_bytes=0, deep=deep, verify=True)
            assert got == want, first_difference(got[0], want[0])
        assert refshare.stats().mismatches == 0

    check()


# -- ROLL's DataProto (its mirror, or ROLL itself where it imports) --------------------------


def _roll_dataproto() -> Any:
    """ROLL's ``DataProto`` class, as test_roll.py publishes its mirror (or ROLL's own)."""
    import importlib
    import os
    import sys
    import tempfile

    import roll_mirror as roll_style

    os.environ.setdefault("ROLL_LOG_DIR", os.path.join(tempfile.gettempdir(), "roll-test-logs"))
    if not roll_style.roll_is_installed() and "roll" not in sys.modules:
        roll_style.publish_as_roll()
    return importlib.import_module("roll.distributed.scheduler.protocol").DataProto


@SETTINGS
@given(pair=pairs())
def test_roll_equal_keys_mean_equal_by_value_serializations(pair: tuple[Recipe, Recipe]) -> None:
    roll = _roll_dataproto()

    def build_roll(recipe: Recipe) -> Any:
        data = build(recipe)
        return roll(data.batch, data.non_tensor_batch, None, data.meta_info)

    (key_a, digest_a), (key_b, digest_b) = map(key_and_digest, map(build_roll, pair))
    if key_a is not None and key_a == key_b:
        assert digest_a == digest_b, pair
    if pair[0] == pair[1] and digest_a is not None:
        assert key_a == key_b is not None
