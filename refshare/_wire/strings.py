"""How refshare keys and stores a numpy array of Python strings: joined, not one by one.

Ray pickles an array of objects element by element, and keying such an array by that
pickle would cost as much again on every repeat: for 100,000 short uids, milliseconds. An array
whose elements are all exact ``str`` is keyed instead by its shape, its order and its
strings joined with NUL separators, and stored as that one joined string. The worker splits
it back with :func:`refshare._wire.bootstrap.rebuild_strings` and gets what numpy's
unpickling gives it: a writable array of equal strings, of the same shape and memory order.
Only the identity of equal strings (``a[0] is a[1]``) may differ from by value; Python does
not define it for strings either.

Any other element (bytes, ``None``, a ``str`` subclass), a string holding a NUL, or a dtype
with metadata, and the array is keyed and sent as Ray pickles it.
"""

from __future__ import annotations

import sys
from typing import Any, Literal

from .._ray.pickling import ship_by_value
from . import bootstrap
from .arrays import pickle_order


def joined(arr: Any) -> tuple[str, Literal["C", "F"]] | None:
    """The strings of an array of objects joined by NUL, in the order numpy pickles them,
    and that order; ``None`` unless every element is an exact ``str`` free of NUL (and for
    an empty array, which is small anyway)."""
    numpy = sys.modules.get("numpy")
    if numpy is None or type(arr) is not numpy.ndarray or not arr.size:
        return None
    if arr.dtype.kind != "O" or arr.dtype.isbuiltin != 1:
        return None  # not objects, or objects with metadata (h5py's vlen strings) to keep
    order = pickle_order(arr)
    items = arr.ravel(order=order).tolist()
    if list(map(type, items)).count(str) != len(items):
        return None
    text = "\0".join(items)
    if text.count("\0") != len(items) - 1:
        return None  # a string holds a NUL: the split would not give the same strings
    return text, order


class StringArray:
    """An array of strings as refshare stores it: one joined string, split on the worker."""

    __slots__ = ("args",)

    def __init__(self, text: str, shape: tuple[int, ...], order: Literal["C", "F"]) -> None:
        self.args = (text, shape, order)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return bootstrap.rebuild_strings, self.args


def strings_form(value: Any) -> StringArray | None:
    """An array of exact strings as one joined string; ``None`` for anything else."""
    found = joined(value)
    if found is None:
        return None
    ship_by_value(bootstrap)
    text, order = found
    return StringArray(text, tuple(value.shape), order)
