"""Stamps: telling cheaply that an array or tensor hashed before may have changed since.

Within one call, an object hashed before is not hashed again while its stamp holds; across
calls, only while nothing but torch's own version counter could have changed it and that
counter has not moved, or while nothing can change it at all (see :func:`leaf_digest`).
Only a leaf of ``STAMP_MIN_BYTES`` or more gets a stamp at all (see :func:`vouches_for`),
and a tensor first met in a value put once, only when it is seen again (see
:func:`first_put`).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, NamedTuple

import xxhash

from .._hashing import SEED
from .._wire.arrays import dtype_token, flat_bytes, memory_order
from .._wire.tensors import element_bytes, pickled_as_storage, storage_bytes
from .tables import Key, Memo, MemoEntry, Stamp, StampFn, Trust, stamps

#: How many evenly spaced elements a spot check reads (4 KiB of float64).
SPOT_CHECK_ELEMENTS = 512
#: The smallest leaf a stamp may vouch for (see :func:`vouches_for`).
STAMP_MIN_BYTES = 256 << 10


def vouches_for(nbytes: int) -> bool:
    """Whether a stamp may stand, within one call, for a leaf whose digest reads ``nbytes``
    (an array's bytes; a tensor's storage, or its own elements for a ``TensorElements``).

    This is the blind spot docs/guarantees.md names: a leaf of ``STAMP_MIN_BYTES`` or more
    that keeps its memory, shape, strides, torch version counter and the content of its
    512 spot-checked elements is taken as unchanged, so a write in place elsewhere in it,
    between two sends of one call, is not seen. A smaller leaf is never vouched for: it is
    hashed each time it is sent, at any depth, in any deep mode (a structure stamp holds its
    full digest, see :func:`leaf_token`); below this size a hash costs no more than a
    stamp. Every stamp function asks this, and so :func:`leaf_digest` through them; the
    structure walk asks it in :func:`leaf_token`.
    """
    return nbytes >= STAMP_MIN_BYTES


@functools.lru_cache(maxsize=64)
def _spot_index(size: int) -> Any:
    """The elements a spot check of ``size`` reads: all of them up to 512, else 512 evenly
    spaced from the first to the last (in integers: exact, and distinct without a sort,
    which costs more than the check when a batch's sizes vary from call to call)."""
    import numpy as np

    if size <= SPOT_CHECK_ELEMENTS:
        return np.arange(size, dtype=np.intp)
    return np.arange(SPOT_CHECK_ELEMENTS, dtype=np.intp) * (size - 1) // (SPOT_CHECK_ELEMENTS - 1)


def spot_check(arr: Any) -> int:
    """Digest of a sample of ``arr``'s elements: all of a small array, 512 of a large one."""
    if arr.size == 0:
        return 0
    order = memory_order(arr)
    if order == "C":
        sample = arr.reshape(-1)[_spot_index(arr.size)]
    elif order == "F":
        sample = arr.T.reshape(-1)[_spot_index(arr.size)]
    else:
        sample = arr.flat[_spot_index(arr.size)]
    return xxhash.xxh3_64_intdigest(sample.view("u1").tobytes(), SEED)


_ELEMENT_CODES = {2: "u2", 4: "u4", 8: "u8"}


def _elements_of(flat: Any, itemsize: int) -> Any:
    """A flat uint8 view as elements of ``itemsize`` bytes, so that a spot check compares
    whole elements: a float32 going from 1.0 to 2.0 changes none of its sampled bytes at
    the element's start."""
    if itemsize == 1 or flat.size % itemsize:
        return flat
    return flat.view(_ELEMENT_CODES.get(itemsize) or f"V{itemsize}")


#: Buffers nobody can write to: what an immutable array rests on.
_IMMUTABLE_BUFFERS = frozenset({"builtins.bytes", "ray._raylet.Buffer", "ray._raylet.SubBuffer"})


def array_trust(arr: Any) -> Trust:
    """``ALWAYS`` for an array read-only all the way down to an immutable buffer (``bytes``,
    or the object-store buffer under an array ``ray.get`` returned): numpy refuses to make
    any array in that chain writeable again. Any other array, ``NEVER``: one marked
    read-only may still be written through a view made before, or made writeable again."""
    import numpy as np

    node = arr
    while True:
        if isinstance(node, np.ndarray):
            if node.flags.writeable or node.base is None:
                return Trust.NEVER
            node = node.base
        elif isinstance(node, memoryview):
            if not node.readonly:
                return Trust.NEVER
            node = node.obj
        else:
            cls = type(node)
            immutable = f"{cls.__module__}.{cls.__qualname__}" in _IMMUTABLE_BUFFERS
            return Trust.ALWAYS if immutable else Trust.NEVER


def tensor_trust(t: Any) -> Trust:
    """``PROMISED`` for a tensor on memory torch allocated, whose version counter sees
    torch's own writes through it and its views; ``NEVER`` for memory torch shares with
    another owner (``torch.from_numpy``, ``frombuffer``, DLPack, ``.numpy()``), which can
    be written unseen."""
    return Trust.PROMISED if t.untyped_storage().resizable() else Trust.NEVER


def _array_where(arr: Any) -> tuple[object, ...]:
    return arr.__array_interface__["data"][0], arr.shape, arr.strides, dtype_token(arr.dtype)


@stamps.registers_lazy("numpy", "ndarray")
def ndarray_stamp(arr: Any) -> Stamp:
    if arr.dtype.hasobject or not vouches_for(arr.nbytes):
        return None
    return (_array_where(arr), spot_check(arr)), array_trust(arr)


def _stampable(t: Any) -> bool:
    """Whether anything vouches for a tensor: one that torch pickles as its storage, with a
    version counter (a tensor made under ``torch.inference_mode()`` has none)."""
    return pickled_as_storage(t) and not t.is_inference()


def _tensor_where(t: Any) -> tuple[object, ...]:
    # dtype and requires_grad too: both are sent, and changing either (``.data =``,
    # ``requires_grad_()``) moves no version counter.
    return t._version, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.requires_grad


@stamps.registers_lazy("torch", "Tensor")
@stamps.registers_lazy("torch.nn", "Parameter")
def tensor_stamp(t: Any) -> Stamp:
    """Torch's version counter catches its own in-place operations; the spot check of its
    elements, most writes through ``.numpy()`` or ``.data`` views, which the counter does
    not see."""
    if not _stampable(t) or not vouches_for(t.untyped_storage().nbytes()):
        return None
    spot = spot_check(_elements_of(storage_bytes(t), t.element_size()))
    return (_tensor_where(t), spot), tensor_trust(t)


def elements_stamp(t: Any) -> Stamp:
    """As :func:`tensor_stamp`, spot-checking the tensor's own elements (what a
    ``TensorElements`` sends): a chunk's rows, not its parent's whole storage."""
    if not _stampable(t) or not vouches_for(t.nelement() * t.element_size()):
        return None
    # A strided tensor's elements would have to be copied to be read: its storage is read.
    data = element_bytes(t) if t.is_contiguous() else storage_bytes(t)
    spot = spot_check(_elements_of(data, t.element_size()))
    return (_tensor_where(t), spot), tensor_trust(t)


def storage_stamp(t: Any) -> Stamp:
    """A storage, stamped through any tensor on it: views share its version counter."""
    storage = t.untyped_storage()
    if not _stampable(t) or not vouches_for(storage.nbytes()):
        return None
    where = (t._version, storage.data_ptr(), storage.nbytes())
    spot = spot_check(_elements_of(storage_bytes(t), t.element_size()))
    return (where, spot), tensor_trust(t)


def leaf_token(obj: Any, stamp_fn: StampFn) -> object | None:
    """What a structure stamp records of an array or tensor (a subclass too): for a leaf
    :func:`vouches_for` rules out, a digest of all of what pickling it sends, so that a
    write anywhere in it changes the structure stamp (and a small leaf does not leave its
    whole value without a stamp); for a larger one, its stamp. ``None`` where neither can
    be had: an array of objects, a tensor not pickled as its storage, a large tensor
    without a version counter."""
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(obj, numpy.ndarray):
        if obj.dtype.hasobject:
            return None
        if not vouches_for(obj.nbytes):
            return _array_content(obj)
    elif not pickled_as_storage(obj):  # a tensor, the only other leaf with a stamp
        return None
    elif not vouches_for(obj.untyped_storage().nbytes()):
        return _tensor_content(obj)
    stamped = stamp_fn(obj)
    return None if stamped is None else stamped[0]


def _array_content(arr: Any) -> object:
    """A small array as numpy's pickling sends it: its dtype, layout and all its bytes."""
    layout = (arr.shape, arr.strides, dtype_token(arr.dtype))
    return layout, xxhash.xxh3_128_digest(flat_bytes(arr)[1], SEED)


def _tensor_content(t: Any) -> object:
    """A tensor on a small storage as torch's pickling sends it: its layout, flags and its
    whole storage; read whole, it needs no version counter (inference mode is fine)."""
    layout = (t.dtype, tuple(t.shape), t.stride(), t.storage_offset())
    flags = (t.requires_grad, t.is_conj(), t.is_neg())
    return layout, flags, xxhash.xxh3_128_digest(storage_bytes(t), SEED)


class _Kept(NamedTuple):
    """A digest kept across calls, against a weak reference to what it is the digest of:
    the reference both proves the object is the one hashed (ids are recycled) and removes
    the entry when the object dies."""

    anchor: weakref.ref[Any]
    stamp: object
    digest: Key


#: Digests of unchanged objects, across calls, by memo key.
_seen: dict[object, _Kept] = {}


def _remember(key: object, obj: object, stamp: object, digest: Key) -> None:
    def forget(ref: weakref.ref[Any]) -> None:
        entry = _seen.get(key)
        if entry is not None and entry.anchor is ref:
            del _seen[key]

    _seen[key] = _Kept(weakref.ref(obj, forget), stamp, digest)


def _trusted(trust: Trust, reuse: bool) -> bool:
    return trust == Trust.ALWAYS or (reuse and trust == Trust.PROMISED)


#: Whether the value being keyed is one ``ray.put`` for the first time in its call (see
#: :func:`first_put`).
_first_put: ContextVar[bool] = ContextVar("refshare_first_put", default=False)


@contextlib.contextmanager
def first_put() -> Iterator[None]:
    """Key a value ``ray.put`` for the first time in this call: its tensors are hashed, and
    stamped only if they are seen again in the call (the second time they are hashed again,
    then stamped). Most values put are put once, their ref being what travels, and a
    stamp no later look compares costs a spot check for nothing; a value sent to several
    workers is a task's argument, stamped at first sight."""
    token = _first_put.set(True)
    try:
        yield
    finally:
        _first_put.reset(token)


def unstamped(reuse: bool) -> bool:
    """Whether a tensor seen for the first time in this call is left without a stamp (see
    :func:`first_put`): not where digests are kept across calls (``reuse``)."""
    return not reuse and _first_put.get()


def leaf_digest(
    obj: object,
    leaf: Callable[[Any], Key | None],
    memo: Memo | None,
    reuse: bool = False,
    memo_key: object = None,
    stamp_fn: Callable[[Any], Stamp] | None = None,
    anchor: object = None,
    lazy: bool = False,
) -> Key | None:
    """Digest ``obj`` with ``leaf``, reusing an earlier digest where that is safe.

    Within one call (``memo``), an array or tensor hashed before is not hashed again while
    its stamp holds: same memory, shape and strides, same torch version counter, and the
    same content at 512 evenly spaced elements (a spot check of a few KiB). Only a leaf of
    ``STAMP_MIN_BYTES`` or more gets a stamp (see :func:`vouches_for`): a smaller one is
    hashed each time it is seen. Across calls, digests are kept under the same stamp for
    arrays that cannot change (read-only down to an immutable buffer) and, with ``reuse``,
    for tensors the user promises not to change behind torch's back. Bytes and strings are
    immutable but cannot be weakly referenced, so they are hashed each time they are seen.
    ``memo_key`` (default ``id(obj)``) and ``stamp_fn`` name another digest of the same
    object: a tensor's storage, or its own elements. ``anchor`` (default ``obj``) is the
    object the digest is kept against, held or weakly referenced so that its memory cannot
    be freed and reused unseen: for a view, the tensor it views, so that the same memory
    viewed again is found. ``lazy`` (see :func:`unstamped`): seen for the first time, the
    object is hashed and kept in ``memo`` without a stamp, which no later look matches.
    """
    if stamp_fn is None:
        stamp_fn = stamps.exact(type(obj))
    if stamp_fn is None:
        return leaf(obj)
    if memo_key is None:
        memo_key = id(obj)
    if anchor is None:
        anchor = obj
    if (memo is None or memo_key not in memo) and memo_key not in _seen:
        # Seen for the first time: hash first, then stamp while the memory is still in the
        # CPU's cache, where the spot check costs next to nothing.
        digest = leaf(obj)
        if digest is not None:
            if lazy and memo is not None:  # a stamp is taken if it is seen again
                memo[memo_key] = MemoEntry(anchor, None, digest)
                return digest
            stamped = stamp_fn(obj)
            if stamped is not None:
                _keep(memo, memo_key, anchor, stamped, digest, reuse)
        return digest
    stamped = stamp_fn(obj)
    if stamped is None:
        return leaf(obj)
    stamp, trust = stamped
    if memo is not None:
        entry = memo.get(memo_key)
        if entry is not None and entry.anchor is anchor and entry.stamp == stamp:
            return entry.digest
    if _trusted(trust, reuse):
        seen = _seen.get(memo_key)
        if seen is not None and seen.anchor() is anchor and seen.stamp == stamp:
            if memo is not None:
                memo[memo_key] = MemoEntry(anchor, stamp, seen.digest)
            return seen.digest
    digest = leaf(obj)
    if digest is not None:
        _keep(memo, memo_key, anchor, stamped, digest, reuse)
    return digest


def _keep(
    memo: Memo | None,
    memo_key: object,
    anchor: object,
    stamped: tuple[object, Trust],
    digest: Key,
    reuse: bool,
) -> None:
    """Keep a digest under its stamp, against ``anchor``: for this call, and across calls
    where the object can be trusted not to change."""
    stamp, trust = stamped
    if memo is not None:
        memo[memo_key] = MemoEntry(anchor, stamp, digest)
    if _trusted(trust, reuse):
        _remember(memo_key, anchor, stamp, digest)
