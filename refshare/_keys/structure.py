"""Stamps of whole values: telling cheaply, within one call, that a value is unchanged."""

from __future__ import annotations

import datetime
import decimal
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

from .._rules import Kind, pickling_epoch, pickling_now, slot_names
from .._wire.arrays import dtype_token
from .leaves import small_array_digest
from .sizes import SCALARS
from .stamps import leaf_token
from .tables import StampFn, pickle_order, stamps

#: How many objects a structure stamp visits at most; a larger value gets no stamp and is
#: keyed again each time it is sent.
STRUCTURE_VISIT_BUDGET = 100_000

#: Immutable values, all of them, stamped by identity (the walk holds them, so ids are not
#: recycled): a ``range`` holds ints only, a ``timezone`` an offset and a name.
_ATOMS = SCALARS | {
    str, bytes, range, type(Ellipsis), type(NotImplemented), decimal.Decimal,
    datetime.date, datetime.timedelta, datetime.timezone,
}  # fmt: skip
#: Immutable values that hold what may change: their identity, then those parts, walked.
#: A ``slice``'s bounds may be tensors (``cu_seqlens``); a ``datetime``'s or ``time``'s
#: ``tzinfo`` an object with state.
_WITH_PARTS: dict[type, Callable[[Any], tuple[object, ...]]] = {
    slice: lambda s: (s.start, s.stop, s.step),
    datetime.datetime: lambda d: (d.tzinfo,),
    datetime.time: lambda t: (t.tzinfo,),
}
#: Immutable objects without a ``__dict__`` (numpy's and torch's; a zone of ``zoneinfo``,
#: read from its key), by module and name.
_IMMUTABLE = frozenset(
    ("torch.dtype", "torch.device", "torch.layout", "torch.memory_format", "zoneinfo.ZoneInfo")
)
#: Built-in types an object's class may derive from and still keep all its state where the
#: walk looks: immutable values, the containers it walks item by item, and ``tzinfo``,
#: which holds nothing.
_WALKED_BASES = frozenset(
    (object, int, float, complex, str, bytes, tuple, frozenset, dict, list, set, datetime.tzinfo)
)
_HANDLE, _CODE, _NAMED = Kind.HANDLE, Kind.CODE, Kind.NAMED
_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class defined in Python


def _plain_array(obj: object) -> bool:
    """Whether ``obj`` is an exact numpy array: it has no attributes of its own to walk."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and type(obj) is numpy.ndarray


class _TooLarge(Exception):
    """No stamp: too large to walk, or holding what a walk cannot vouch for."""


def _walkable(cls: type) -> bool:
    """Whether every instance of ``cls`` keeps all of its state where the walk looks: its
    ``__dict__``, its slots, and the items of a built-in container it derives from. A class
    built on another C type (``bytearray``, ``deque``) may change inside, unseen."""
    return all(base.__flags__ & _HEAP_TYPE or base in _WALKED_BASES for base in cls.__mro__)


#: Digests of small arrays just taken, by id: ``id -> (array, digest)`` (see ``Split``).
Hashed = dict[int, tuple[object, bytes]]


class _Walk:
    __slots__ = ("budget", "classes", "hashed", "held", "kinds", "tokens")

    def __init__(self, hashed: Hashed | None = None) -> None:
        self.hashed = hashed
        self.budget = STRUCTURE_VISIT_BUDGET
        #: What decides how each object pickles besides its state: the dispatch tables'
        #: entries (``pickling_epoch``), and each Python class's hooks, once per class.
        self.tokens: list[object] = [pickling_epoch()]
        self.classes: set[type] = set()
        #: Every object visited, held so that no id in the tokens is recycled meanwhile.
        self.held: list[object] = []
        self.kinds = pickle_order.walk()

    def add(self, obj: object) -> None:
        self.budget -= 1
        if self.budget < 0:
            raise _TooLarge
        cls = type(obj)
        self.held.append(obj)
        if cls in _ATOMS:
            self.tokens.append(id(obj))
            return
        parts = _WITH_PARTS.get(cls)
        if parts is not None:
            self.tokens.append(id(obj))
            for part in parts(obj):
                self.add(part)
            return
        entry = self.hashed.get(id(obj)) if self.hashed else None
        if entry is not None and entry[0] is obj:
            digest: bytes | None = entry[1]  # hashed a moment ago, by the same code
        else:
            digest = small_array_digest(obj)  # a small array: all of it, at once
        if digest is not None:
            self.tokens.append((id(obj), digest))
            return
        kind = self.kinds.rule(cls).kind
        if kind is _NAMED:
            if self.kinds.of(obj).kind is _CODE:
                raise _TooLarge  # its definition travels, and may have changed
            self.tokens.append(id(obj))  # sent by name
            return
        if kind is _HANDLE or self.kinds.sent_by_value(cls):
            raise _TooLarge  # what it names lives in Ray; or the class travels with it
        if cls.__flags__ & _HEAP_TYPE and cls not in self.classes:
            self.classes.add(cls)  # a hook assigned to the class since changes the stamp
            self.tokens.append(pickling_now(cls))
        stamp_fn = stamps.lookup(cls)
        if stamp_fn is not None:
            self.add_leaf(obj, stamp_fn)
        elif isinstance(obj, (dict, list, tuple, set, frozenset)) and _walkable(cls):
            self.add_container(obj)
        elif _walkable(cls):
            if not self.add_state(obj):
                self.tokens.append(id(obj))  # a bare object(): nothing to change
        elif self.immutable(obj):
            self.tokens.append(id(obj))
        else:
            raise _TooLarge

    def add_leaf(self, obj: Any, stamp_fn: StampFn) -> None:
        """An array or tensor (a subclass too): its stamp, or all its content if it is too
        small to be vouched for by one (see ``leaf_token``), then any attributes."""
        if getattr(getattr(obj, "dtype", None), "hasobject", False):
            if obj.size > self.budget:
                raise _TooLarge  # known too large before walking a single member
            self.tokens.append((id(obj), obj.shape, obj.strides))
            for item in obj.ravel().tolist():
                self.add(item)
        else:
            token = leaf_token(obj, stamp_fn)
            if token is None:
                raise _TooLarge  # nothing vouches for it (a large inference-mode tensor)
            self.tokens.append((id(obj), token))
        if not _plain_array(obj):
            self.add_state(obj)  # a subclass's own attributes (a masked array's mask)

    def add_container(self, obj: Any) -> None:
        if len(obj) > self.budget:
            raise _TooLarge  # known too large before walking a single member
        self.tokens.append((id(obj), type(obj), len(obj)))
        if isinstance(obj, dict):
            for key, value in obj.items():
                self.add(key)
                self.add(value)
            factory = getattr(obj, "default_factory", None)  # a defaultdict's
            if factory is not None:
                self.add(factory)
        else:
            for item in obj:
                self.add(item)
        self.add_state(obj)

    def add_state(self, obj: object) -> bool:
        """Add the attributes of ``obj``; whether it has any place to keep them."""
        state = getattr(obj, "__dict__", None)
        slots = slot_names(type(obj))
        if isinstance(state, dict):
            self.tokens.append(("attributes", len(state)))
            for name, value in state.items():
                self.tokens.append(name)
                self.add(value)
        for name in slots:
            present = hasattr(obj, name)
            self.tokens.append((name, present))
            if present:
                self.add(getattr(obj, name))
        return isinstance(state, dict) or bool(slots)

    def immutable(self, obj: object) -> bool:
        """Whether ``obj`` is an immutable object of numpy or torch: a scalar (not a
        structured one, which may view an array), a dtype, a device."""
        cls = type(obj)
        if f"{cls.__module__}.{cls.__qualname__}" in _IMMUTABLE:
            return True
        numpy = sys.modules.get("numpy")
        if numpy is None:
            return False
        if isinstance(obj, numpy.dtype):
            self.tokens.append(dtype_token(obj))  # a struct's names can change
            return True
        return isinstance(obj, numpy.generic) and not isinstance(obj, numpy.void)


class StructureStamp(NamedTuple):
    """What a walk of a value saw: its tokens, and every object visited, held meanwhile."""

    tokens: list[object]
    held: list[object]


def structure_stamp(obj: object, hashed: Hashed | None = None) -> StructureStamp | None:
    """A stamp of everything reachable from ``obj``, or ``None`` if it cannot be had.

    The stamp lists each container's identity and length, each attribute's name, the
    identity of each immutable atom, and each array's or tensor's own stamp (address,
    layout, version counter and a spot check of its elements), or for one below
    ``STAMP_MIN_BYTES`` a digest of all of it (see ``refshare._keys.stamps.vouches_for``);
    and each Python class's pickling hooks, and the dispatch tables' size. Two stamps of
    one object are equal only if nothing of it a pickle would see has been replaced,
    resized or written to (in a large leaf, within what a spot check reads), and no hook
    or reducer of its classes replaced or registered. What pickling code reads from outside
    the value (a module global, a class attribute) is not in the stamp. A
    value the walk cannot vouch for gets no stamp: one larger than its budget, one holding
    a class or function that Ray sends as code, an object of a C type the walk cannot look
    into, a large tensor without a version counter. ``hashed``: the digests of small
    arrays of ``obj`` taken a moment before, by :func:`small_array_digest` (a split's), not
    taken again.
    """
    walk = _Walk(hashed)
    try:
        walk.add(obj)
    except Exception:  # _TooLarge, RecursionError, or an object that refuses to be read
        return None
    return StructureStamp(walk.tokens, walk.held)


class _Kept(NamedTuple):
    value: object  #: held, so that its id is not recycled
    stamp: StructureStamp
    result: Any


class StampedMemo:
    """What was worked out for a value within one call, kept while its structure stamp
    holds: a value sent again unchanged is not pickled or split again."""

    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: dict[int, _Kept] = {}

    def get(self, value: object) -> Any:
        """The result kept for ``value`` if it is unchanged since, else ``None``."""
        entry = self.entries.get(id(value))
        if entry is None or entry.value is not value:
            return None
        stamp = structure_stamp(value)
        return entry.result if stamp is not None and stamp.tokens == entry.stamp.tokens else None

    def clear(self) -> None:
        self.entries.clear()

    def keep(
        self,
        value: object,
        result: Any,
        stamp: StructureStamp | None = None,
        hashed: Hashed | None = None,
    ) -> None:
        """Keep ``result`` for ``value`` under its structure stamp (``stamp``, if the caller
        took it already; ``hashed``, see :func:`structure_stamp`)."""
        stamp = structure_stamp(value, hashed) if stamp is None else stamp
        if stamp is not None:
            self.entries[id(value)] = _Kept(value, stamp, result)
