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

Joining is the cost, and it is done in numpy where Python would loop: which elements are
one object, and whether each is an exact ``str``, are read from the pointers the elements'
list holds and the objects' type fields (CPython's layout, checked once on live objects).
What was joined is kept (see :class:`_Joins`, ``KEPT_BYTES``, until ``refshare.clear()``):
the key and, on a miss, the stored form come from one join, and an array holding the very
objects of one joined lately, in the same order (the array sent again, a copy of it), is
found by its pointers alone. The objects are held while kept, so that no other object can
take their addresses meanwhile, and a string never changes.
"""

from __future__ import annotations

import ctypes
import functools
import sys
import sysconfig
import threading
from collections import OrderedDict
from typing import Any, Literal, NamedTuple

import xxhash

from .._hashing import SEED, digest_with
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
    #: Digest of the index (if any) and the text's UTF-8: what a key holds besides the
    #: array's shape and order.
    digest: bytes


class _Kept(NamedTuple):
    """An array's strings joined, with the pointers it held and what holds those objects:
    while kept, no other object can be at any of those addresses."""

    holder: object
    pointers: Any
    joined: Joined


_WORD = ctypes.sizeof(ctypes.c_void_p)


class _Memory:
    """Machine words of the process's memory from ``start``, as numpy reads an array's data
    (no ctypes array type is made, which ctypes would keep for each length)."""

    def __init__(self, start: int, words: int) -> None:
        self.__array_interface__ = {
            "data": (start, True),  # read-only
            "shape": (words,),
            "typestr": f"<u{_WORD}",
            "version": 3,
        }


def _words(start: int, words: int, numpy: Any) -> Any:
    """A read-only array of the ``words`` machine words at ``start``: the caller keeps what
    lies there alive, and reads only what it holds."""
    return numpy.asarray(_Memory(start, words))


@functools.cache
def _layout() -> tuple[int, int] | None:
    """Where CPython keeps a list's item pointers and an object's type, in bytes from the
    list's and the object's address: for a build whose list and object headers have the
    sizes of CPython's with the GIL, checked once on live objects. ``None`` elsewhere (PyPy,
    a free-threaded build): the elements are then read one by one in Python."""
    if sys.implementation.name != "cpython" or sysconfig.get_config_var("Py_GIL_DISABLED"):
        return None
    if object.__basicsize__ != 2 * _WORD or list.__basicsize__ != 5 * _WORD:
        return None
    items_at, type_at = 3 * _WORD, _WORD  # after the list's header; after the refcount
    probe = [str(n) for n in range(1000, 1003)]
    read = ctypes.c_size_t.from_address
    start = read(id(probe) + items_at).value
    if [read(start + i * _WORD).value for i in range(3)] != list(map(id, probe)):
        return None
    return (items_at, type_at) if read(id(probe[0]) + type_at).value == id(str) else None


def _pointers(items: list[str], numpy: Any) -> tuple[Any, object]:
    """The pointers to the elements of ``items`` (the caller's own list, never changed nor
    handed out), and what keeps them valid: the list, or where its layout is not known, an
    array of the same objects."""
    layout = _layout()
    if layout is None:
        own = numpy.empty(len(items), dtype=object)
        own[:] = items
        return _held(own, numpy), own
    start = ctypes.c_size_t.from_address(id(items) + layout[0]).value
    return _words(start, len(items), numpy), items


def _held(flat: Any, numpy: Any) -> Any:
    """The pointers a flat contiguous array of objects holds, read-only: valid while the
    caller holds the array."""
    return _words(flat.__array_interface__["data"][0], flat.size, numpy)


def _all_str(items: list[str], pointers: Any, numpy: Any) -> bool:
    """Whether every element is an exact ``str``: the type of each object ``pointers``
    names (every object of ``items``, which holds them) read at once where the layout is
    known, else each element's in Python."""
    layout = _layout()
    aligned = int(numpy.bitwise_or.reduce(pointers)) % _WORD == 0  # as any allocator gives
    if layout is None or not aligned:
        return list(map(type, items)).count(str) == len(items)
    lo, hi = int(pointers.min()), int(pointers.max())
    words = numpy.subtract(pointers, numpy.uint64(lo))  # each object's offset, in words
    words >>= numpy.uint64(_WORD.bit_length() - 1)
    types = _words(lo + layout[1], (hi - lo) // _WORD + 1, numpy).take(words.view(numpy.intp))
    return bool((types == id(str)).all())


def _runs(pointers: Any, numpy: Any) -> Any:
    """Where each run of elements that are one object starts (verl's uids, each repeated
    in place for its samples): every element, when none repeats the one before it."""
    changes = pointers[1:] != pointers[:-1]
    if changes.all():
        return None
    return numpy.flatnonzero(numpy.concatenate(([True], changes)))


#: How many pointers, evenly spaced, are sorted first to see whether any object repeats.
SAMPLE = 2048


def _aliasing(pointers: Any, numpy: Any) -> tuple[Any, Any] | None:
    """For pointers no two neighbours of which are equal: where each distinct object first
    occurs and, for each element, the number of its object (numbered by first occurrence);
    ``None`` when every element is an object of its own. Pointers that ascend are distinct;
    others are sorted with each one's position packed below it in one integer, once it is
    known that some repeat (in a sample, else in all of them sorted to tell). Worked in
    two buffers: large temporaries are fresh pages from the system, a fault per 4 KiB."""
    np = numpy
    size = pointers.size
    descents = int(np.count_nonzero(pointers[1:] < pointers[:-1]))
    if not descents:
        return None
    # Timsort takes a few ascending runs in one pass or so; quicksort anything else.
    kind: Literal["stable", "quicksort"] = "stable" if descents * 32 < size else "quicksort"
    work = np.sort(pointers[:: max(1, size // SAMPLE)])  # a sample first: 16 KiB
    if (work[1:] == work[:-1]).any():
        work = np.empty_like(pointers)
    else:  # no repeat in the sample: all of them sorted, to tell
        work = np.sort(pointers, kind=kind)
        if not (work[1:] == work[:-1]).any():
            return None
    lo, hi = int(pointers.min()), int(pointers.max())
    np.subtract(pointers, np.uint64(lo), out=work)  # offsets, in the elements' order
    aligned = int(np.bitwise_or.reduce(work))
    shift = (aligned & -aligned).bit_length() - 1 if aligned else 0
    bits = (size - 1).bit_length()
    if ((hi - lo) >> shift).bit_length() + bits > 64:  # pragma: no cover - a vast address space
        work = np.argsort(pointers, kind="stable")
        return _numbered(pointers[work], work, np)
    # Each pointer with its position below it: sorted, each object's first comes first.
    work >>= np.uint64(shift)
    work <<= np.uint64(bits)
    positions = np.arange(size, dtype=np.uint64)
    work |= positions
    work.sort(kind=kind)
    np.bitwise_and(work, np.uint64((1 << bits) - 1), out=positions)
    work >>= np.uint64(bits)
    return _numbered(work, positions.view(np.intp), np)


def _numbered(ordered: Any, positions: Any, numpy: Any) -> tuple[Any, Any]:
    """From pointers sorted (``ordered``) and the position each came from (``positions``,
    ascending among equal pointers): where each distinct object first occurs, and each
    element's object numbered by first occurrence. ``ordered`` is written over."""
    np = numpy
    size = ordered.size
    starts = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))
    firsts = positions[starts]  # each object's first element
    first = np.zeros(size, dtype=bool)
    first[firsts] = True
    ranks = np.cumsum(first, out=ordered.view(np.intp))
    number = (ranks[firsts] - 1).astype(np.min_scalar_type(starts.size - 1))
    index = np.empty(size, dtype=number.dtype)
    index[positions] = np.repeat(number, np.diff(starts, append=size))
    return np.flatnonzero(first), index


def _in_runs(aliased: tuple[Any, Any] | None, runs: Any, size: int, numpy: Any) -> Any:
    """What ``_aliasing`` said of the runs' first elements, said of all ``size`` elements:
    each element is its run's object."""
    lengths = numpy.diff(runs, append=size)
    if aliased is None:  # each run another object
        number = numpy.arange(runs.size, dtype=numpy.min_scalar_type(runs.size - 1))
        return runs, numpy.repeat(number, lengths)
    positions, number = aliased
    return runs[positions], numpy.repeat(number, lengths)


def _plain_objects(dtype: Any, numpy: Any) -> bool:
    """Whether ``dtype`` pickles as numpy's own object dtype: that one, or one unpickled
    from it (numpy's unpickling makes a dtype anew, never the builtin one), but not one
    with metadata."""
    return dtype.isbuiltin == 1 or dtype_token(dtype) == dtype_token(numpy.dtype(object))


def _join(flat: Any, order: Literal["C", "F"], numpy: Any) -> _Kept | None:
    """Join a flat array of objects' strings; ``None`` unless every element is an exact
    ``str`` free of NUL."""
    items = flat.tolist()
    pointers, holder = _pointers(items, numpy)
    runs = _runs(pointers, numpy)
    heads = pointers if runs is None else pointers[runs]  # each run of one object, once
    aliased = _aliasing(heads, numpy)
    if runs is not None:
        aliased = _in_runs(aliased, runs, pointers.size, numpy)
    index = None
    strings = items
    distinct = pointers
    if aliased is not None:
        positions, index = aliased
        strings = list(map(items.__getitem__, positions.tolist()))
        distinct = pointers[positions]
    if not _all_str(items, distinct, numpy):  # each distinct object's type, once
        return None
    text = "\0".join(strings)
    data = text.encode("utf-8", "surrogatepass")
    raw = numpy.frombuffer(data, dtype=numpy.uint8)
    if raw.size - numpy.count_nonzero(raw) != len(strings) - 1:
        return None  # a string holds a NUL: the split would not give the same strings
    if index is None:
        digest = digest_with(xxhash.xxh3_128(b"strings", SEED), data)
    else:
        head = xxhash.xxh3_128(repr(("aliased", index.dtype.str, len(data))).encode(), SEED)
        head.update(index)
        digest = digest_with(head, data)
    return _Kept(holder, pointers, Joined(text, order, index, digest))


#: How many joins are kept (a batch's few arrays of text, each chunk of them), and how many
#: bytes they may hold at most (see ``_weight``); a larger one is not kept.
KEPT_JOINS = 32
KEPT_BYTES = 64 << 20


def _weight(kept: _Kept) -> int:
    """About what keeping a join holds in memory: its text, and its objects (a string's own
    header and text), which might otherwise have been freed."""
    return 2 * len(kept.joined.text) + 64 * int(kept.pointers.size)


class _Joins:
    """The last arrays of strings joined, by the pointers they held: an array holding the
    same objects in the same order is the same strings, joined alike."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.kept: OrderedDict[tuple[object, ...], tuple[_Kept, int]] = OrderedDict()
        self.nbytes = 0

    def get(self, where: tuple[object, ...], pointers: Any) -> Joined | None:
        with self.lock:
            found = self.kept.get(where)
            if found is None or not (found[0].pointers == pointers).all():
                return None
            self.kept.move_to_end(where)
            return found[0].joined

    def keep(self, where: tuple[object, ...], kept: _Kept) -> None:
        weight = _weight(kept)
        if weight > KEPT_BYTES:
            return
        with self.lock:
            old = self.kept.pop(where, None)
            self.nbytes += weight - (0 if old is None else old[1])
            self.kept[where] = (kept, weight)
            while len(self.kept) > KEPT_JOINS or self.nbytes > KEPT_BYTES:
                self.nbytes -= self.kept.popitem(last=False)[1][1]

    def clear(self) -> None:
        with self.lock:
            self.kept.clear()
            self.nbytes = 0


_joins = _Joins()


def forget_joins() -> None:
    """Let go of the strings joined lately (``refshare.clear()``)."""
    _joins.clear()


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
    held = _held(flat, numpy)
    where = (order, flat.size, xxhash.xxh3_64_intdigest(held, SEED))
    found = _joins.get(where, held)
    if found is not None:
        return found
    made = _join(flat, order, numpy)
    if made is None:
        return None
    _joins.keep(where, made)
    return made.joined


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
