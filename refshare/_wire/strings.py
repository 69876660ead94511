"""How refshare keys and stores a numpy array of Python strings: joined, not one by one.

Ray pickles an array of objects element by element, and keying such an array by that
pickle would cost as much again on every repeat: for 100,000 short uids, milliseconds. An array
whose elements are all exact ``str`` is keyed instead by its shape, its order, its strings
joined with NUL separators and which of its elements are one object.

Pickle's memo sends an object once however many elements hold it: an array that repeats
one string object (verl's ``uid`` column, one uid per prompt repeated for each sample)
arrives by value with those elements one object, and equal strings that are distinct
objects arrive distinct. So when every element is an object of its own, refshare stores
the joined strings alone; when some object fills several elements, each distinct object's
text once, joined, and an index array saying which of them each element is. The worker
rebuilds it with :func:`refshare._wire.bootstrap.rebuild_strings` and gets what numpy's
unpickling gives it: a writable array of its own, of the same shape and memory order, of
equal strings, its elements one object exactly where by value's are. (There, as after any
unpickling, the empty string and one-character Latin-1 strings are CPython's shared
objects.) Not kept: identity between an element and an object outside the array (the same
string in another array sent beside it), since the array is rebuilt on its own.

Any other element (bytes, ``None``, a ``str`` subclass), a string holding a NUL, or a dtype
with metadata, and the array is keyed and sent as Ray pickles it.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any, Literal, NamedTuple

from .._ray.pickling import ship_by_value
from . import bootstrap
from .arrays import dtype_token, pickle_order


class Joined(NamedTuple):
    """An array's strings as refshare keys and stores them."""

    #: The strings joined by NUL: every element's, or with ``index`` each distinct object's.
    text: str
    order: Literal["C", "F"]
    #: ``None`` when every element is an object of its own; else, for each element in
    #: ``order``, which of the distinct objects (numbered by first occurrence) it is.
    index: Any


def _aliasing(flat: Any) -> tuple[Any, Any] | None:
    """For a flat contiguous array of objects: where each distinct object first occurs and,
    for each element, the number of its object (numbered by first occurrence); ``None``
    when every element is an object of its own. Compares the pointers the array holds, no
    Python object per element: one pass when they ascend (objects made one after another),
    else a sort."""
    import numpy as np

    # A view of the array's own pointers (the caller holds ``flat``): never written to.
    held = (ctypes.c_size_t * flat.size).from_address(flat.ctypes.data)
    pointers = np.frombuffer(held, dtype=np.uintp)
    pointers.setflags(write=False)
    after, before = pointers[1:], pointers[:-1]
    descents = np.count_nonzero(after < before)
    # Timsort takes a few ascending runs in one pass or so; quicksort anything else.
    kind: Literal["stable", "quicksort"] = "stable" if descents * 32 < after.size else "quicksort"
    repeats = bool((after == before).any())
    if descents and not repeats:
        ordered = np.sort(pointers, kind=kind)
        repeats = bool((ordered[1:] == ordered[:-1]).any())
    if not repeats:
        return None
    perm = np.argsort(pointers, kind=kind)
    ordered = pointers[perm]
    starts = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))
    firsts = np.minimum.reduceat(perm, starts)  # each object's first element
    by_first = np.argsort(firsts)
    number = np.empty(starts.size, dtype=np.min_scalar_type(starts.size - 1))
    number[by_first] = np.arange(starts.size)
    index = np.empty(pointers.size, dtype=number.dtype)
    index[perm] = np.repeat(number, np.diff(starts, append=pointers.size))
    return firsts[by_first], index


def _nuls(text: str) -> int:
    """How many NULs ``text`` holds; for ASCII text, counted by numpy over its bytes (a
    fraction of what ``str.count`` takes)."""
    if not text.isascii():
        return text.count("\0")
    import numpy as np

    raw = np.frombuffer(text.encode("ascii"), dtype=np.uint8)
    return raw.size - int(np.count_nonzero(raw))


def _plain_objects(dtype: Any, numpy: Any) -> bool:
    """Whether ``dtype`` pickles as numpy's own object dtype: that one, or one unpickled
    from it (numpy's unpickling makes a dtype anew, never the builtin one), but not one
    with metadata."""
    return dtype.isbuiltin == 1 or dtype_token(dtype) == dtype_token(numpy.dtype(object))


def joined(arr: Any) -> Joined | None:
    """An array of objects as its strings joined by NUL, in the order numpy pickles them,
    and which elements are one object; ``None`` unless every element is an exact ``str``
    free of NUL (and for an empty array, which is small anyway)."""
    numpy = sys.modules.get("numpy")
    if numpy is None or type(arr) is not numpy.ndarray or not arr.size:
        return None
    if arr.dtype.kind != "O" or not _plain_objects(arr.dtype, numpy):
        return None  # not objects, or objects with metadata (h5py's vlen strings) to keep
    order = pickle_order(arr)
    flat = arr.ravel(order=order)
    items = flat.tolist()
    if list(map(type, items)).count(str) != len(items):
        return None
    aliased = _aliasing(flat)
    index = None
    if aliased is not None:
        positions, index = aliased
        items = flat[positions].tolist()
    text = "\0".join(items)
    if _nuls(text) != len(items) - 1:
        return None  # a string holds a NUL: the split would not give the same strings
    return Joined(text, order, index)


class StringArray:
    """An array of strings as refshare stores it: one joined string (and the index of
    repeated objects), split on the worker."""

    __slots__ = ("args",)

    def __init__(
        self,
        text: str,
        shape: tuple[int, ...],
        order: Literal["C", "F"],
        index: Any = None,
        dtype: Any = object,
    ) -> None:
        # The dtype object itself: pickled where the array is, it is one object with every
        # other place the value names it, as numpy's pickling makes it by value.
        self.args = (text, shape, order, index, dtype)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return bootstrap.rebuild_strings, self.args


def strings_form(value: Any) -> StringArray | None:
    """An array of exact strings as one joined string; ``None`` for anything else."""
    found = joined(value)
    if found is None:
        return None
    ship_by_value(bootstrap)
    return StringArray(found.text, tuple(value.shape), found.order, found.index, value.dtype)
