"""Leaf digests: the values whose content refshare hashes itself, where they lie.

Each digest covers what Ray's pickling of the value sends: bytes and strings whole; an
array's dtype (as it pickles), shape, memory order and bytes; a tensor's type, dtype,
layout, flags and whole storage (a view pickles its whole storage too).
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import xxhash

from .._hashing import PARALLEL_MIN_BYTES, SEED, digest_buffer, digest_with, tagged
from .._rules import instance_hooks
from .._wire.arrays import dtype_token, flat_bytes, memory_order
from .._wire.strings import joined
from .._wire.tensors import TensorElements, element_bytes, pickled_as_storage, storage_bytes
from .stamps import elements_stamp, leaf_digest, storage_stamp, unstamped, vouches_for
from .tables import DigestFn, Key, Memo, leaf_digests


class Unfingerprintable(Exception):
    """Raised inside a fingerprint pass for a value refshare cannot hash itself."""


def _memoized(leaf: Any) -> DigestFn:
    def digest(obj: Any, memo: Memo | None, reuse: bool) -> Key | None:
        return leaf_digest(obj, leaf, memo, reuse)

    return digest


def _digest_bytes(obj: bytes | bytearray) -> Key:
    return digest_with(tagged(type(obj).__name__, len(obj)), obj)


def _digest_str(obj: str) -> Key:
    data = obj.encode("utf-8", "surrogatepass")
    return digest_with(tagged("str", len(data)), data)


def _digest_memoryview(obj: memoryview) -> Key:
    data = obj if obj.c_contiguous else memoryview(obj.tobytes())
    head = tagged("memoryview", obj.format, obj.shape, obj.nbytes)
    head.update(digest_buffer(data))
    return head.digest()


for _cls, _digest in ((bytes, _digest_bytes), (bytearray, _digest_bytes), (str, _digest_str)):
    leaf_digests.register(_cls, _memoized(_digest))
leaf_digests.register(memoryview, _memoized(_digest_memoryview))


#: Heads of contiguous arrays' digests: ``(id(dtype), shape, order) -> (dtype, head)``, for
#: builtin dtypes only, which cannot change (see ``refshare._wire.arrays.dtype_token``).
_heads: dict[tuple[int, tuple[int, ...], str], tuple[Any, bytes]] = {}


def ndarray_head(dtype: Any, shape: tuple[int, ...], order: str) -> bytes:
    """What a contiguous array's digest starts with: its dtype, shape and order (kept, since
    a list of a thousand arrays usually has a handful of shapes)."""
    key = (id(dtype), shape, order)
    found = _heads.get(key)
    if found is not None and found[0] is dtype:
        return found[1]
    head = b"ndarray:" + dtype_token(dtype) + repr((shape, order, None)).encode()
    if dtype.isbuiltin == 1:
        if len(_heads) >= 4096:
            _heads.clear()
        _heads[key] = (dtype, head)
    return head


def _digest_strings(arr: Any) -> Key | None:
    """An array of exact strings, by its strings joined and which of its elements are one
    object (see ``refshare._wire.strings``)."""
    found = joined(arr)
    if found is None:
        return None
    head = tagged("strings", arr.shape, found.order)
    head.update(found.digest)
    return head.digest()


def _digest_ndarray(arr: Any) -> Key | None:
    if arr.dtype.hasobject:
        # Strings are keyed joined; other objects are pickled one by one, by the generic pass.
        return _digest_strings(arr)
    order = memory_order(arr)
    if arr.nbytes <= PARALLEL_MIN_BYTES and order != "N":
        # The common small case in one pass, without reshaping: a list of a thousand
        # small arrays costs about what hashing their bytes costs.
        head = xxhash.xxh3_128(ndarray_head(arr.dtype, arr.shape, order), SEED)
        try:
            head.update(arr if order == "C" else arr.T)
            return head.digest()
        except (BufferError, TypeError, ValueError):
            pass  # a dtype numpy exports no buffer for: through a byte view below
    order, flat = flat_bytes(arr)
    strides = arr.strides if order == "N" else None
    head = xxhash.xxh3_128(b"ndarray:" + dtype_token(arr.dtype), SEED)
    head.update(repr((arr.shape, order, strides)).encode())
    return digest_with(head, flat)


@leaf_digests.registers_lazy("numpy", "ndarray")
def _ndarray_digest(arr: Any, memo: Memo | None, reuse: bool) -> Key | None:
    if not vouches_for(arr.nbytes):
        return _digest_ndarray(arr)  # no stamp could stand for it: straight to the hash
    return leaf_digest(arr, _digest_ndarray, memo, reuse)


@leaf_digests.registers_lazy("torch", "device")
def _device_digest(device: Any, memo: Memo | None, reuse: bool) -> Key:
    """A ``torch.device`` (a batch's, in its reader's content), by the type and index its
    pickling sends, which ``str()`` names: pickle's own pass would look its class up by
    name, through cloudpickle, on every key. Its class is immutable; a reducer registered
    for it (``copyreg``, Ray's ``register_serializer``) makes it no leaf (``refshare._rules``)."""
    return xxhash.xxh3_128_digest(b"torch.device:" + str(device).encode(), SEED)


def small_array(arr: Any) -> bool:
    """Whether ``arr`` is an exact numpy array of fixed-size elements too small for a stamp
    to vouch for (see ``vouches_for``): it is hashed every time it is sent."""
    numpy = sys.modules.get("numpy")
    return (
        numpy is not None
        and type(arr) is numpy.ndarray
        and not arr.dtype.hasobject
        and not vouches_for(arr.nbytes)
    )


def small_array_digest(arr: Any) -> Key | None:
    """The digest of a :func:`small_array`, as keying it any other way gives it; ``None``
    for any other value. A shortcut for the many small members of a deep-shared argument:
    nothing is looked up or kept for it."""
    return _digest_ndarray(arr) if small_array(arr) else None


def _check_tensor(t: Any, with_state: bool = False) -> None:
    if not pickled_as_storage(t, with_state):
        raise Unfingerprintable(f"{t.device.type} {t.layout} tensor, as Ray sends it")
    if with_state and instance_hooks(t):
        raise Unfingerprintable("a tensor with pickling of its own")


def tensor_state(t: Any) -> dict[str, Any] | None:
    """The attributes of a tensor's own (torch's dynamo marks, say), which torch's
    pickling sends beside its storage; ``None`` when it has none."""
    return getattr(t, "__dict__", None) or None


def _tensor_head(t: Any, *extra: object) -> xxhash.xxh3_128:
    return tagged(
        type(t).__qualname__,
        str(t.dtype),
        tuple(t.shape),
        t.stride(),
        t.storage_offset(),
        t.requires_grad,
        t.is_conj(),
        t.is_neg(),
        *extra,
    )


def _digest_storage(t: Any) -> Key:
    return digest_buffer(memoryview(storage_bytes(t)))


@functools.lru_cache(maxsize=4096)
def _elements_head(dtype: Any, shape: tuple[int, ...], requires_grad: bool) -> bytes:
    """What a digest of a tensor's own elements starts with (as ``tagged`` makes it), made
    once per dtype, shape and ``requires_grad``: a batch's chunks have a handful of shapes."""
    return repr(("elements", str(dtype), shape, requires_grad)).encode()


def _digest_elements(t: Any) -> Key:
    head = _elements_head(t.dtype, tuple(t.shape), t.requires_grad)
    return digest_with(xxhash.xxh3_128(head, SEED), element_bytes(t))


def _base(t: Any) -> Any:
    """The tensor whose memory ``t`` views (``t`` itself if it is no view): what a digest
    of its memory is kept against, so that a view made anew (a batch chunked again, on
    each call) finds it."""
    base = t._base
    return t if base is None else base


@leaf_digests.registers_lazy("torch", "Tensor")
@leaf_digests.registers_lazy("torch.nn", "Parameter")
def tensor_digest(t: Any, memo: Memo | None, reuse: bool) -> Key | None:
    """What pickling a CPU tensor sends: its whole storage, offset, size and stride (its
    attributes, if any, are the pickling pass's to add; see ``tensor_state``).

    Views of one storage (the chunks of a batch) hash that storage once per call, if a
    stamp may vouch for it (see ``vouches_for``); a smaller one, each time it is sent."""
    _check_tensor(t, with_state=True)
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    body: Key | None
    if not vouches_for(nbytes):
        body = _digest_storage(t)  # no stamp could stand for it: straight to the hash
    else:
        key = ("storage", storage.data_ptr(), nbytes)
        lazy = unstamped(reuse)
        body = leaf_digest(t, _digest_storage, memo, reuse, key, storage_stamp, _base(t), lazy)
    if body is None:
        return None
    head = _tensor_head(t, nbytes)
    head.update(body)
    return head.digest()


@leaf_digests.registers(TensorElements)
def _elements_digest(wrapper: TensorElements, memo: Memo | None, reuse: bool) -> Key | None:
    """A tensor's own elements; the same rows of one base, viewed again, are hashed once
    (if a stamp may vouch for them, see ``vouches_for``)."""
    t = wrapper.tensor
    _check_tensor(t)
    if not vouches_for(t.nelement() * t.element_size()):
        return _digest_elements(t)  # no stamp could stand for it: straight to the hash
    base = _base(t)
    layout = (t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.requires_grad)
    key = ("elements", id(base), layout, t.is_conj(), t.is_neg())
    lazy = unstamped(reuse)
    return leaf_digest(t, _digest_elements, memo, reuse, key, elements_stamp, base, lazy)
