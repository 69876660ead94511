"""Stamps of whole values: telling cheaply, within one call, that a value is unchanged."""

from __future__ import annotations

import sys
from typing import Any

from . import _fingerprint
from ._sizing import _slot_names

#: How many objects a structure stamp visits at most; a larger value gets no stamp and is
#: keyed again each time it is sent.
STRUCTURE_VISIT_BUDGET = 10_000

_ATOMS = frozenset((int, float, complex, bool, type(None), str, bytes))
#: Packages whose objects without ``__dict__`` (dtypes, devices) are immutable.
_IMMUTABLE_ROOTS = frozenset(("numpy", "torch"))


class _TooLarge(Exception):
    pass


class _Walk:
    __slots__ = ("budget", "held", "tokens")

    def __init__(self) -> None:
        self.budget = STRUCTURE_VISIT_BUDGET
        self.tokens: list[object] = []
        #: Every object visited, held so that no id in the tokens is recycled meanwhile.
        self.held: list[object] = []

    def add(self, obj: object) -> None:
        self.budget -= 1
        if self.budget < 0:
            raise _TooLarge
        cls = type(obj)
        self.held.append(obj)
        if cls in _ATOMS or isinstance(obj, type):
            self.tokens.append(id(obj))
            return
        stamp_fn = _fingerprint._stamps.exact(cls)
        if stamp_fn is not None:
            stamped = stamp_fn(obj)
            if stamped is not None:
                self.tokens.append((id(obj), stamped[0]))
                return
        size = len(obj) if isinstance(obj, (dict, list, tuple, set, frozenset)) else 0
        if cls.__module__ == "numpy" and cls.__name__ == "ndarray":  # of Python objects
            size = obj.size  # type: ignore[attr-defined]
        if size > self.budget:
            raise _TooLarge  # known too large before walking a single member
        if cls.__module__ == "numpy" and cls.__name__ == "ndarray":
            self.tokens.append((id(obj), obj.shape, obj.strides))  # type: ignore[attr-defined]
            self.add_all(obj.ravel().tolist())  # type: ignore[attr-defined]
        elif isinstance(obj, dict):
            self.tokens.append((id(obj), cls, len(obj)))
            for key, value in obj.items():
                self.add(key)
                self.add(value)
            self.add_state(obj)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            self.tokens.append((id(obj), cls, len(obj)))
            self.add_all(obj)
            self.add_state(obj)
        elif not self.add_state(obj):
            root = cls.__module__.partition(".")[0]
            if root not in _IMMUTABLE_ROOTS or root not in sys.modules:
                raise _TooLarge  # an object refshare cannot look into: no stamp
            self.tokens.append(id(obj))

    def add_all(self, items: Any) -> None:
        for item in items:
            self.add(item)

    def add_state(self, obj: object) -> bool:
        """Add the attributes of ``obj``; whether it has any place to keep them."""
        state = getattr(obj, "__dict__", None)
        slots = _slot_names(type(obj))
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


def structure_stamp(obj: object) -> tuple[list[object], list[object]] | None:
    """A stamp of everything reachable from ``obj``, or ``None`` if it is too large to walk.

    The stamp lists each container's identity and length, each attribute's name, the
    identity of each immutable atom, and each array's or tensor's own stamp (address,
    layout, version counter and a spot check of its elements). Two stamps of one object
    are equal only if nothing a pickle would see has been replaced, resized or (within
    what a spot check reads) written to. The second list holds what was visited.
    """
    walk = _Walk()
    try:
        walk.add(obj)
    except (_TooLarge, RecursionError):
        return None
    except Exception:
        return None
    return walk.tokens, walk.held


class StampedMemo:
    """What was worked out for a value within one call, kept while its structure stamp
    holds: a value sent again unchanged is not pickled or split again."""

    __slots__ = ("entries",)

    def __init__(self) -> None:
        #: id -> (the value, held so its id is not recycled; its stamp; the result)
        self.entries: dict[int, tuple[object, Any, Any]] = {}

    def get(self, value: object) -> Any:
        """The result kept for ``value`` if it is unchanged since, else ``None``."""
        entry = self.entries.get(id(value))
        if entry is None or entry[0] is not value:
            return None
        stamp = structure_stamp(value)
        return entry[2] if stamp is not None and stamp[0] == entry[1][0] else None

    def clear(self) -> None:
        self.entries.clear()

    def keep(self, value: object, result: Any) -> None:
        stamp = structure_stamp(value)
        if stamp is not None:
            self.entries[id(value)] = (value, stamp, result)
