"""How refshare keys and stores a numpy array of Python strings: joined, not one by one.

Ray pickles an array of objects element by element: 100,000 short strings take about 8 ms
to pickle, and keying the array by that pickle cost as much again on every repeat. An array
whose elements are all exact ``str`` is keyed instead by its shape, its order and its
strings joined with NUL separators (about 1.5 ms), and stored as that one joined string.
The worker splits it back with :func:`refshare._bootstrap.rebuild_strings`, which Ray sends
as code, and gets what numpy's unpickling gives it: a writable array of equal strings, of
the same shape and memory order. Only the identity of equal strings (``a[0] is a[1]``) may
differ from by value; Python does not define it for strings either.

Any other element (bytes, ``None``, a ``str`` subclass), or a string holding a NUL, and the
array is keyed and sent as before, by its pickle.
"""

from __future__ import annotations

import sys
from typing import Any, Literal

from . import _bootstrap
from ._tensors import ship_bootstrap_by_value

#: The memory order numpy pickles an array in.
Order = Literal["C", "F"]


def joined(arr: Any) -> tuple[str, Order] | None:
    """The strings of an array of objects joined by NUL, in the order numpy pickles them,
    and that order ('C' or 'F'); ``None`` unless every element is an exact ``str`` free of
    NUL (and for an empty array, which is small anyway)."""
    numpy = sys.modules.get("numpy")
    if numpy is None or type(arr) is not numpy.ndarray or not arr.size:
        return None
    if arr.dtype.kind != "O" or arr.dtype.isbuiltin != 1:
        return None  # not objects, or objects with metadata (h5py's vlen strings) to keep
    flags = arr.flags
    order: Order = "F" if flags.f_contiguous and not flags.c_contiguous else "C"
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

    def __init__(self, text: str, shape: tuple[int, ...], order: Order) -> None:
        self.args = (text, shape, order)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _bootstrap.rebuild_strings, self.args


def strings_form(value: Any) -> StringArray | None:
    """An array of exact strings as one joined string; ``None`` for anything else."""
    found = joined(value)
    if found is None:
        return None
    ship_bootstrap_by_value()
    text, order = found
    return StringArray(text, tuple(value.shape), order)
