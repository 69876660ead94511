"""Readers proven, not sampled: over SkyRL's ``TrainingInputBatch`` (its ``TensorBatch``) and
NeMo-RL's ``BatchedDataDict``, equal keys mean equal by-value serializations, and a worker
receives exactly what it receives by value, in all three deep modes.

Each example is a recipe for a batch: tensor fields of several dtypes and layouts (float32,
int64, bool, bfloat16; wide, transposed, strided, a contiguous row view at an offset in a
larger storage, the same elements in storages that differ elsewhere, the same tensor twice,
a view of another field), SkyRL's ``TensorList`` and ``PackedTensor`` fields, ``None``
fields, non-tensor entries (strings, lists, numpy arrays, object arrays whose strings are
one object repeated or equal objects), SkyRL's metadata (holding one of its fields, too),
an instance's own ``ZERO_COPY_KEYS`` and how the batch was built (its constructor, item by
item, or ``dict.update``, which leaves its batch size and device unset); NeMo-RL's
attributes (its micro-batch fields, one more, one removed, one that is a data entry). Each
is inside the class or a subclass that pickles as it does, one with
``__getstate__``/``__setstate__`` of its own, one pickled through ``copyreg``, one that
changes the batch's pickling otherwise (SkyRL: its ``contiguous``, its ``ZERO_COPY_KEYS``;
NeMo-RL: slots); alone, twice in one value, or as chunks of one batch; and it is compared
with its neighbours, recipes one change away (a field, one entry's part, an entry more or
less, an in-place edit), both built afresh and applied in place to the very object keyed
(and sent) before.

The classes are the frameworks' own where they import, else the repo's mirrors: SkyRL
0.4.0's in tests/test_skyrl.py (registered as refshare registers SkyRL's own class), and
NeMo-RL's in tests/mirrors/nemo_rl_mirror.py, published under NeMo-RL's module path
(``nemo_rl.distributed.batched_data_dict``), where refshare finds it as NeMo-RL's. A worker
publishes the mirror when it imports this module, which the receivers below make it do.
"""

from __future__ import annotations

import copyreg
import dataclasses
import importlib
import importlib.util
import itertools
import pickle
import sys
import types
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

THIS = "test_framework_properties"  # this module, as the workers import it
DTYPES = {
    "float32": torch.float32,
    "int64": torch.int64,
    "bool": torch.bool,
    "bfloat16": torch.bfloat16,
}

# -- the frameworks' classes, or the mirrors ----------------------------------------------------


def _skyrl() -> types.SimpleNamespace:
    """SkyRL's batch classes where the ``skyrl`` package imports (tests/skyrl_wheel.py makes
    its batch module importable), else the mirror of 0.4.0 in tests/test_skyrl.py."""
    try:
        import skyrl_wheel

        skyrl_wheel.stand_in()
        module = importlib.import_module("skyrl.backends.skyrl_train.training_batch")
        real = True
    except ImportError:
        module = importlib.import_module("test_skyrl")  # registers its mirror
        real = False
    try:
        packed = importlib.import_module("skyrl.backends.skyrl_train.utils.packed_tensor")
    except ImportError:  # the mirror, or a release without packed fields
        packed = module
    return types.SimpleNamespace(
        TensorBatch=module.TensorBatch,
        TrainingInputBatch=module.TrainingInputBatch,
        TensorList=getattr(module, "TensorList", None),
        PackedTensor=getattr(packed, "PackedTensor", None),
        real=real,
    )


NEMO_MODULE = "nemo_rl.distributed.batched_data_dict"


def publish_nemo_mirror() -> None:
    """Give the mirror of NeMo-RL's ``BatchedDataDict`` (tests/mirrors/nemo_rl_mirror.py)
    NeMo-RL's module path in this process, as ``roll_style.publish_as_roll`` does for ROLL: refshare
    then finds it, lazily, as NeMo-RL's class, and pickles name it by reference as they name
    NeMo-RL's. A worker must publish it too before it unpickles one."""
    if NEMO_MODULE in sys.modules:
        return
    if "nemo_rl" in sys.modules:
        raise RuntimeError("NeMo-RL is imported here: the mirror cannot take its names")
    import nemo_rl_mirror as nemo_style  # type: ignore[import-not-found]

    for name in ("nemo_rl", "nemo_rl.distributed", NEMO_MODULE):
        sys.modules[name] = types.ModuleType(name)
    for member in ("BatchedDataDict", "SlicedDataDict"):
        cls = getattr(nemo_style, member)
        cls.__module__ = NEMO_MODULE
        setattr(sys.modules[NEMO_MODULE], member, cls)


def _nemo() -> types.SimpleNamespace:
    """NeMo-RL's ``BatchedDataDict`` where ``nemo_rl`` imports, else the mirror, published."""
    real = importlib.util.find_spec("nemo_rl") is not None and NEMO_MODULE not in sys.modules
    if not real:
        publish_nemo_mirror()
    module = importlib.import_module(NEMO_MODULE)
    return types.SimpleNamespace(
        BatchedDataDict=module.BatchedDataDict, SlicedDataDict=module.SlicedDataDict, real=real
    )


SK = _skyrl()
NE = _nemo()

# -- SkyRL subclasses ---------------------------------------------------------------------------


class SkPlain(SK.TrainingInputBatch):  # type: ignore[misc,name-defined]
    """Pickles as its base: read as one (its ``tag`` is not sent)."""


class SkTagged(SK.TrainingInputBatch):  # type: ignore[misc,name-defined]
    """Its own state: the base's, and a tag (the base's ``__reduce__`` sends it)."""

    def __getstate__(self) -> Any:
        return super().__getstate__(), getattr(self, "tag", None)

    def __setstate__(self, state: Any) -> Any:
        base, self.tag = state
        return super().__setstate__(base)


class SkRegistered(SK.TrainingInputBatch):  # type: ignore[misc,name-defined]
    """Pickled through copyreg: its raw fields (as torch pickles tensors) and its state."""


def _reduce_sk_registered(batch: Any) -> tuple[Any, ...]:
    state = (batch._batch_size, batch._device, batch.metadata, getattr(batch, "tag", None))
    return _rebuild_sk_registered, (dict(batch), state)


def _rebuild_sk_registered(fields: dict[str, Any], state: Any) -> Any:
    batch = dict.__new__(SkRegistered)
    dict.update(batch, fields)
    batch._batch_size, batch._device, batch.metadata, batch.tag = state
    return batch


copyreg.pickle(SkRegistered, _reduce_sk_registered)


class SkOwnContiguous(SK.TrainingInputBatch):  # type: ignore[misc,name-defined]
    """Leaves its fields as they are where SkyRL makes them contiguous: not read."""

    def contiguous(self) -> Any:
        return self


class SkZeroCopy(SK.TrainingInputBatch):  # type: ignore[misc,name-defined]
    """Sends every field as a numpy array (where the release has ``ZERO_COPY_KEYS``)."""

    ZERO_COPY_KEYS = frozenset({"a", "b", "c"})


SK_CLASSES = {
    "TensorBatch": SK.TensorBatch,
    "TrainingInputBatch": SK.TrainingInputBatch,
    "Plain": SkPlain,
    "Tagged": SkTagged,
    "Registered": SkRegistered,
    "OwnContiguous": SkOwnContiguous,
    "ZeroCopy": SkZeroCopy,
}

# -- NeMo-RL subclasses -------------------------------------------------------------------------


class NePlain(NE.BatchedDataDict):  # type: ignore[misc,name-defined]
    """Pickles as its base: read as one."""


class NeTagged(NE.BatchedDataDict):  # type: ignore[misc,name-defined]
    """Its own state: its attributes but the tag, and the tag."""

    def __getstate__(self) -> Any:
        state = dict(vars(self))
        return state, state.pop("tag", None)

    def __setstate__(self, state: Any) -> None:
        attributes, tag = state
        self.__dict__.update(attributes)
        self.tag = tag


class NeRegistered(NE.BatchedDataDict):  # type: ignore[misc,name-defined]
    """Pickled through copyreg: its data, then its other attributes."""


def _reduce_ne_registered(batch: Any) -> tuple[Any, ...]:
    attributes = {k: v for k, v in vars(batch).items() if k != "data"}
    return _rebuild_ne_registered, (batch.data, attributes)


def _rebuild_ne_registered(data: Any, attributes: dict[str, Any]) -> Any:
    batch = NeRegistered.__new__(NeRegistered)
    batch.data = data
    batch.__dict__.update(attributes)
    return batch


copyreg.pickle(NeRegistered, _reduce_ne_registered)


class NeSlotted(NE.BatchedDataDict):  # type: ignore[misc,name-defined]
    """A slot beside its ``__dict__``: pickled as both, so not read."""

    __slots__ = ("tag",)


NE_CLASSES = {
    "BatchedDataDict": NE.BatchedDataDict,
    "SlicedDataDict": NE.SlicedDataDict,
    "Plain": NePlain,
    "Tagged": NeTagged,
    "Registered": NeRegistered,
    "Slotted": NeSlotted,
}

# -- building the values ------------------------------------------------------------------------

TENSOR_FORMS = [
    "plain", "wide", "transposed", "rowview", "strided", "tail", "gaps", "alias", "aliasview"
]  # fmt: skip


def _valid(entries: tuple[tuple[str, str, str, int], ...]) -> bool:
    """A batch's entries as the strategies make them: unique names, the first a tensor."""
    names = [entry[0] for entry in entries]
    return bool(entries) and len(set(names)) == len(names) and entries[0][1] in TENSOR_FORMS[:-2]


def _values(dtype: str, shape: tuple[int, ...], seed: int) -> Any:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 3, shape, generator=generator).to(DTYPES[dtype])


def _tensor(form: str, dtype: str, rows: int, seed: int, first: Any) -> Any:
    """A tensor field; ``first`` is the value's first tensor so far, for the aliasing forms."""
    if form == "alias" and first is not None:
        return first  # the same tensor twice
    if form == "aliasview" and first is not None:  # a view of it
        return first[:, 1:] if first.dim() == 2 else first.unsqueeze(-1)
    if form == "wide":
        return _values(dtype, (rows, 3), seed)
    if form == "transposed":
        return _values(dtype, (3, rows), seed).t()
    if form == "rowview":  # contiguous, at an offset in a storage twice its size
        return _values(dtype, (2 * rows, 3), seed)[rows:]
    if form == "strided":
        return _values(dtype, (2 * rows,), seed)[::2]
    if form == "tail":  # the same elements for every seed; the rest of its storage is not
        return torch.cat([_values(dtype, (rows, 3), seed), _values(dtype, (rows, 3), 9)])[rows:]
    if form == "gaps":  # the same, strided: every other element of a storage
        return torch.stack([_values(dtype, (rows,), 9), _values(dtype, (rows,), seed)], 1)[:, 0]
    return _values(dtype, (rows,), seed)


def _strings(rows: int, seed: int, repeated: bool) -> Any:
    """A column of uids, one per prompt, two samples each: one object repeated, or equal
    objects made apart (by value, pickle's memo sends those twice and these once)."""
    if repeated:
        uids = [f"uid-{seed}-{i}" for i in range(rows // 2)]
        return np.array([uids[i // 2] for i in range(rows)], dtype=object)
    return np.array([f"uid-{seed}-{i // 2}" for i in range(rows)], dtype=object)


def _first_tensor(mapping: Any) -> tuple[str | None, Any]:
    for name, value in mapping.items():
        if isinstance(value, torch.Tensor):
            return name, value
    return None, None


#: The rows of a chunk (at least two: differential_kit's description of a tensor cannot read
#: one whose single row has a stride other than one, as a chunk of a strided column has).
CHUNK_ROWS = 2


def _rows(values: Any) -> int:
    """How many rows a batch's fields have (2, for one that has none left)."""
    return next((len(v) for v in values if v is not None and not isinstance(v, dict)), 2)


def _bump(t: Any) -> None:
    """Change a tensor in place (its views and aliases see it)."""
    if t.dtype == torch.bool:
        t.logical_not_()
    else:
        t.add_(1)


# -- SkyRL ------------------------------------------------------------------------------------

SK_FORMS = [*TENSOR_FORMS, "list", "packed", "none"]
SK_NAMES = ["a", "b", "c", "rollout_expert_indices"]  # the last a ZERO_COPY_KEYS one in 0.4.0


@dataclasses.dataclass(frozen=True)
class SkRecipe:
    """A SkyRL batch, how it was made and changed, and its class."""

    rows: int
    fields: tuple[tuple[str, str, str, int], ...]  # name, form, dtype, seed
    metadata: str
    made: str  # "init", "setitem" or "update" (dict.update: no batch size, no device)
    zero_copy: bool  # an instance's own ZERO_COPY_KEYS: not sent, but decides what is
    cls: str
    tag: str
    edit: str | None


def _sk_field(form: str, dtype: str, rows: int, seed: int, first: Any) -> Any:
    if form == "none":
        return None
    if form == "list" and SK.TensorList is not None:
        return SK.TensorList(
            [_values(dtype, (1 + (i + seed) % 3, 2), seed + i) for i in range(rows)]
        )
    if form == "packed" and SK.PackedTensor is not None:
        lengths = torch.tensor([0] + [1 + (i + seed) % 3 for i in range(rows)])
        offsets = torch.cumsum(lengths, 0).to(torch.int32)
        return SK.PackedTensor(_values(dtype, (int(offsets[-1]), 2), seed), offsets)
    return _tensor(form, dtype, rows, seed, first)


def _sk_metadata(kind: str, rows: int, first: Any) -> Any:
    if kind == "empty":
        return {}
    if kind == "length":
        return {"response_length": rows, "boundaries": [(0, rows)]}
    if kind in ("repeated", "distinct"):
        # The names are strings of their own: one object both in an array of strings and
        # elsewhere in the value arrives as two (docs/guarantees.md, "Strings are aliased
        # within one array, not across values"), where the array goes in refshare's form.
        uids = _strings(rows, 0, kind == "repeated")
        return {"uids": uids, "names": [f"uid-0-{i // 2}" for i in range(rows)]}
    if kind == "alias":  # one of its fields again: pickled as torch pickles it, uncompacted
        return {"mask": first}
    if kind == "tensor":
        return {"mask": _values("float32", (3, rows), 1).t()}
    return None


def build_skyrl(recipe: SkRecipe) -> Any:
    rows, first = recipe.rows, None
    fields: dict[str, Any] = {}
    for name, form, dtype, seed in recipe.fields:
        value = _sk_field(form, dtype, rows, seed, first)
        if first is None and isinstance(value, torch.Tensor):
            first = value
        fields[name] = value
    cls = SK_CLASSES[recipe.cls]
    if recipe.made == "init":
        batch = cls(fields)
    else:
        batch = cls()
        if recipe.made == "update":
            dict.update(batch, fields)
        else:
            for name, value in fields.items():
                batch[name] = value
    if recipe.metadata != "unset":
        batch.metadata = _sk_metadata(recipe.metadata, rows, first)
    if recipe.zero_copy:
        batch.ZERO_COPY_KEYS = frozenset(SK_NAMES[1:])
    if recipe.cls not in ("TensorBatch", "TrainingInputBatch"):
        batch.tag = recipe.tag
    edit_skyrl(batch, recipe.edit)
    return batch


def edit_skyrl(batch: Any, edit: str | None) -> None:
    """One change in place, to a batch made (and maybe sent) before."""
    name, first = _first_tensor(batch)
    rows = _rows(dict.values(batch))
    if edit == "bump" and first is not None:
        _bump(first)
    elif edit == "replace" and name is not None:
        batch[name] = torch.full((rows, 2), 7.0)
    elif edit == "none" and dict.__len__(batch) > 1:  # (a first None: no worker rebuilds it)
        batch[list(batch)[-1]] = None
    elif edit == "delete":
        del batch[list(batch)[-1]]
    elif edit == "add":
        batch["added"] = torch.arange(rows)
    elif edit == "metadata":
        if isinstance(batch.metadata, dict):
            batch.metadata["step"] = 1
        else:
            batch.metadata = {"step": 1}
    elif edit == "mismatch":  # a field of another length, past __setitem__: pickling raises
        dict.__setitem__(batch, "bad", torch.zeros(rows + 1))
    elif edit == "clear":  # no fields left: its batch size is all that says how many rows
        dict.clear(batch)
    elif edit == "device":
        batch._device = torch.device("cpu") if batch._device is None else None


SK_FIELD = st.tuples(
    st.sampled_from(SK_NAMES),
    st.sampled_from(SK_FORMS),
    st.sampled_from(sorted(DTYPES)),
    st.integers(0, 2),
)
SK_RECIPES = st.builds(
    SkRecipe,
    rows=st.sampled_from([2, 4]),
    fields=st.lists(SK_FIELD, min_size=1, max_size=3, unique_by=lambda f: f[0])
    .map(tuple)
    .filter(_valid),
    metadata=st.sampled_from(
        ["unset", "none", "empty", "length", "repeated", "distinct", "alias", "tensor"]
    ),
    made=st.sampled_from(["init", "init", "setitem", "update"]),
    zero_copy=st.booleans(),
    cls=st.sampled_from(sorted(SK_CLASSES)),
    tag=st.sampled_from(["first", "second"]),
    edit=st.sampled_from(
        [
            None,
            None,
            "bump",
            "replace",
            "none",
            "delete",
            "clear",
            "add",
            "metadata",
            "mismatch",
            "device",
        ]
    ),
)


def wrap_skyrl(batch: Any, wrap: str) -> Any:
    if wrap == "twice":
        return {"data": batch, "again": batch}
    if wrap == "chunks":  # SkyRL's DP chunks: views of the batch's tensors
        try:
            return batch.chunk(CHUNK_ROWS)
        except Exception:  # a first field of None: a chunk cannot be made
            return [batch]
    return batch


# -- NeMo-RL ----------------------------------------------------------------------------------

NE_FORMS = [*TENSOR_FORMS, "strings", "repeated", "distinct", "ints", "numpy", "none", "nested"]


@dataclasses.dataclass(frozen=True)
class NeRecipe:
    """A NeMo-RL batch, its attributes, its class, and one change made to it."""

    rows: int
    entries: tuple[tuple[str, str, str, int], ...]  # name, form, dtype, seed
    attributes: tuple[str, ...]  # which of its attributes are set, and how (ATTRIBUTES)
    cls: str
    tag: str
    edit: str | None


def _ne_entry(form: str, dtype: str, rows: int, seed: int, first: Any) -> Any:
    if form == "none":
        return None
    if form == "strings":
        return [f"s{(i + seed) % 2}" for i in range(rows)]
    if form in ("repeated", "distinct"):
        return _strings(rows, seed, form == "repeated")
    if form == "ints":
        return list(range(seed, seed + rows))
    if form == "numpy":
        return np.arange(2 * rows, dtype=np.float32).reshape(rows, 2) + seed
    if form == "nested":
        return {"x": _values(dtype, (rows,), seed), "note": "n"}
    return _tensor(form, dtype, rows, seed, first)


def build_nemo(recipe: NeRecipe) -> Any:
    rows, first = recipe.rows, None
    data: dict[str, Any] = {}
    for name, form, dtype, seed in recipe.entries:
        value = _ne_entry(form, dtype, rows, seed, first)
        if first is None and isinstance(value, torch.Tensor):
            first = value
        data[name] = value
    batch = NE_CLASSES[recipe.cls](data)
    flags = set(recipe.attributes)
    if "indices" in flags:
        batch.micro_batch_indices = [[[0, rows // 2], [rows // 2, rows]]]
    if "lengths" in flags:
        batch.micro_batch_lengths = [[3, 3]]
    if "shared" in flags:  # an attribute that is one of its entries
        batch.micro_batch_lengths = next(iter(data.values()))
    if "counts" in flags:
        batch.elem_counts_per_gb = [rows]
    if "missing" in flags:
        del batch.elem_counts_per_gb
    if "extra" in flags:
        batch.note = "extra"
    if recipe.cls not in ("BatchedDataDict", "SlicedDataDict"):
        batch.tag = recipe.tag
    edit_nemo(batch, recipe.edit)
    return batch


def edit_nemo(batch: Any, edit: str | None) -> None:
    """One change in place, to a batch made (and maybe sent) before."""
    name, first = _first_tensor(batch.data)
    rows = _rows(batch.data.values())
    if edit == "bump" and first is not None:
        _bump(first)
    elif edit == "replace" and name is not None:
        batch[name] = torch.full((rows, 2), 7.0)
    elif edit == "delete":
        del batch[list(batch)[-1]]
    elif edit == "add":
        batch["added"] = torch.arange(rows)
    elif edit == "append":  # a list entry grown in place
        lists = [v for v in batch.data.values() if isinstance(v, list)]
        if lists:
            lists[0].append("more")
    elif edit == "attribute":
        batch.micro_batch_indices = [[[0, rows]]]
    elif edit == "data":  # a new dict of the same entries
        batch.data = dict(batch.data)
    elif edit == "clear":
        batch.data.clear()


ATTRIBUTES = ["indices", "lengths", "shared", "counts", "missing", "extra"]
NE_ENTRY = st.tuples(
    st.sampled_from(["input_ids", "mask", "uid", "extra"]),
    st.sampled_from(NE_FORMS),
    st.sampled_from(sorted(DTYPES)),
    st.integers(0, 2),
)
NE_RECIPES = st.builds(
    NeRecipe,
    rows=st.sampled_from([2, 4]),
    entries=st.lists(NE_ENTRY, min_size=1, max_size=4, unique_by=lambda e: e[0])
    .map(tuple)
    .filter(_valid),
    attributes=st.lists(st.sampled_from(ATTRIBUTES), unique=True, max_size=3).map(
        lambda flags: tuple(sorted(flags))
    ),
    cls=st.sampled_from(sorted(NE_CLASSES)),
    tag=st.sampled_from(["first", "second"]),
    edit=st.sampled_from(
        [None, None, "bump", "replace", "delete", "clear", "add", "append", "attribute", "data"]
    ),
)


def wrap_nemo(batch: Any, wrap: str) -> Any:
    if wrap == "twice":
        return {"data": batch, "again": batch}
    if wrap == "chunks":  # two shards, of views of its tensors and slices of its lists
        rows, shards = _rows(batch.data.values()), []
        for cut in (slice(start, start + CHUNK_ROWS) for start in range(0, rows, CHUNK_ROWS)):
            shard = type(batch)()
            for key, value in batch.data.items():
                shard[key] = value if value is None or isinstance(value, dict) else value[cut]
            shards.append(shard)
        return shards
    return batch


# -- the properties ---------------------------------------------------------------------------

WRAPS = st.sampled_from(["bare", "bare", "twice", "chunks"])


def neighbours(recipes: Any, entries: str) -> Any:
    """A recipe, and others one change away from it: each of its fields in turn drawn again
    (from one other recipe, so some are the same recipe again), each entry with another seed
    (a ``tail`` or ``gaps`` one: the same elements in another storage) and without it, and
    a few changes to one part of its ``entries`` field (one entry's name, form, dtype or
    seed; an entry dropped or added) or, for NeMo-RL, one attribute flag toggled."""

    @st.composite
    def nudge(draw: Any, first: Any) -> Any:
        if hasattr(first, "attributes") and draw(st.integers(0, 3)) == 0:
            flags = set(first.attributes) ^ {draw(st.sampled_from(ATTRIBUTES))}
            return dataclasses.replace(first, attributes=tuple(sorted(flags)))
        parts = list(getattr(first, entries))
        more = draw(recipes.map(lambda other: getattr(other, entries)[0]))
        i = draw(st.integers(0, len(parts) - 1))
        change = draw(st.sampled_from(["part", "part", "part", "drop", "add"]))
        if change == "part":
            j = draw(st.integers(0, 3))
            parts[i] = (*parts[i][:j], more[j], *parts[i][j + 1 :])
        elif change == "drop":
            del parts[i]
        else:
            parts.insert(i + 1, more)
        return (
            dataclasses.replace(first, **{entries: tuple(parts)}) if _valid(tuple(parts)) else first
        )

    @st.composite
    def draw_all(draw: Any) -> tuple[Any, ...]:
        first, other = draw(recipes), draw(recipes)
        swapped = [
            dataclasses.replace(first, **{f.name: getattr(other, f.name)})
            for f in dataclasses.fields(first)
        ]
        parts = getattr(first, entries)
        for i, (name, form, dtype, seed) in enumerate(parts):  # each entry's seed, and without it
            reseeded = (*parts[:i], (name, form, dtype, (seed + 1) % 3), *parts[i + 1 :])
            swapped.append(dataclasses.replace(first, **{entries: reseeded}))
            if _valid(parts[:i] + parts[i + 1 :]):
                swapped.append(dataclasses.replace(first, **{entries: parts[:i] + parts[i + 1 :]}))
        nudged = draw(st.lists(nudge(first), min_size=1, max_size=NUDGES))
        order = draw(st.permutations([*swapped, *nudged]))  # which one the in-place edit takes
        return first, *order

    return draw_all()


#: How many changes to its entries each example makes to a recipe, beside its fields'.
NUDGES = 3

KINDS: dict[str, tuple[Any, Any, Any, Any]] = {
    "skyrl": (neighbours(SK_RECIPES, "fields"), build_skyrl, edit_skyrl, wrap_skyrl),
    "nemo_rl": (neighbours(NE_RECIPES, "entries"), build_nemo, edit_nemo, wrap_nemo),
}


def key_and_digest(value: Any) -> tuple[bytes | None, bytes | None]:
    key = refshare.fingerprint(value)  # first: a SkyRL batch's pickling changes it in place
    try:
        digest = serialized_digest(value)
    except Exception:
        digest = None  # by value raises (a field of another length, say): so must refshare
    return key, digest


SETTINGS = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)


def _unedited(recipe: Any) -> Any:
    return dataclasses.replace(recipe, edit=None)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_equal_keys_mean_equal_by_value_serializations(kind: str) -> None:
    recipe_sets, build, edit, wrap = KINDS[kind]

    @SETTINGS
    @given(recipes=recipe_sets, how=WRAPS)
    def check(recipes: tuple[Any, ...], how: str) -> None:
        found = [key_and_digest(wrap(build(recipe), how)) for recipe in recipes]
        for (a, (key_a, digest_a)), (b, (key_b, digest_b)) in itertools.combinations(
            zip(recipes, found, strict=True), 2
        ):
            if key_a is not None and key_a == key_b:
                assert digest_a == digest_b, (a, b)
            if a == b and digest_a is not None:
                assert key_a == key_b is not None, a  # the same content keys alike
        # One object keyed (and pickled), changed in place as a neighbour says, keyed again:
        # what was learnt of it before must not stand for it now.
        value = build(_unedited(recipes[0]))
        key_a, digest_a = key_and_digest(wrap(value, how))
        try:
            edit(value, recipes[1].edit)
        except Exception:
            return  # the change cannot be made to this batch
        key_b, digest_b = key_and_digest(wrap(value, how))
        if key_a is not None and key_a == key_b:
            assert digest_a == digest_b, (recipes[0], recipes[1].edit, "in place")

    check()


# -- what a worker receives ---------------------------------------------------------------


@ray.remote(num_cpus=0.05)
class Receiver(Probe.__ray_actor_class__):  # type: ignore[misc,name-defined]
    """A ``Probe`` whose worker imports this module first: that publishes the NeMo-RL mirror
    there, before any argument naming its classes is unpickled."""

    def __init__(self) -> None:
        importlib.import_module(THIS)
        super().__init__()


@pytest.fixture(scope="module")
def probes(local_ray: None) -> list[Any]:
    group = [Receiver.remote() for _ in range(2)]
    ray.get([p.ping.remote() for p in group])
    return group


def _received(probes: list[Any], value: Any, **options: Any) -> list[Any]:
    with refshare.sharing(**options):
        return ray.get([p.describe.remote(value) for p in probes])


def _rebuilds(value: Any) -> bool:
    """Whether a worker can rebuild ``value`` by value (a SkyRL batch whose fields' lengths
    differ pickles, past its own ``contiguous``, but is refused where it is rebuilt)."""
    try:
        pickle.loads(ray.cloudpickle.dumps(value))  # type: ignore[no-untyped-call]
    except Exception:
        return False
    return True


@pytest.mark.usefixtures("local_ray", "fresh")
@pytest.mark.parametrize("deep", [False, None, True])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_worker_receives_what_it_receives_by_value(
    probes: list[Any], kind: str, deep: Any
) -> None:
    recipe_sets, build, edit, wrap = KINDS[kind]
    shared = {"min_bytes": 0, "deep": deep, "verify": True}

    def compare(recipes: tuple[Any, ...], how: str) -> None:
        for recipe in recipes[:2]:  # the second after the first: found again, or not
            if not _rebuilds(wrap(build(recipe), how)):
                continue  # no worker receives it by value (the first test covers its key)
            want = _received(probes, wrap(build(recipe), how), enabled=False)
            got = _received(probes, wrap(build(recipe), how), **shared)
            assert got == want, first_difference(got[0], want[0])
        # One object sent, changed in place as the second recipe says, sent again.
        value, twin = build(_unedited(recipes[0])), build(_unedited(recipes[0]))
        try:
            edit(twin, recipes[1].edit)
        except Exception:
            return  # the change cannot be made to this batch
        if not _rebuilds(wrap(twin, how)):
            return
        _received(probes, wrap(value, how), **shared)
        edit(value, recipes[1].edit)
        got = _received(probes, wrap(value, how), **shared)
        want = _received(probes, wrap(value, how), enabled=False)
        assert got == want, first_difference(got[0], want[0])

    @settings(SETTINGS, max_examples=6)
    @given(recipes=recipe_sets, how=WRAPS)
    def check(recipes: tuple[Any, ...], how: str) -> None:
        mismatches = refshare.stats().mismatches  # this example's own (for shrinking)
        compare(recipes, how)
        assert refshare.stats().mismatches == mismatches

    check()
    assert refshare.stats().mismatches == 0
