"""Content fingerprints of task arguments: equal exactly when Ray would send equal data."""

from __future__ import annotations

import functools
import logging
import pickle
import sys
import types
import weakref
from collections.abc import Callable
from typing import Any

import xxhash

from . import _serialized, _strings, _tensors
from ._dispatch import TypeTable
from ._hashing import PARALLEL_MIN_BYTES, SEED, digest_buffer
from ._sizing import SizeFn, register_size

logger = logging.getLogger("refshare")

Key = bytes
FingerprintFn = Callable[[Any], Any]
LeafFn = Callable[[Any], "Key | None"]
#: Digests a leaf, with the per-call memo and whether digests may be kept across calls.
DigestFn = Callable[[Any, "Memo | None", bool], "Key | None"]
#: How far an object's digest may be kept across calls (see ``leaf_digest``).
NEVER, PROMISED, ALWAYS = 0, 1, 2
#: A stamp that changes when an object changes, and how far the object can be trusted not
#: to change; ``None`` where refshare has no cheap way to tell.
Stamp = tuple[object, int] | None
#: What the per-call memo holds for one object: the object itself, or the tensor a view
#: views (held, so that no ``id()`` or memory is recycled while the memo lives), a stamp
#: that changes when it is mutated, and its digest.
MemoEntry = tuple[object, object, Key]
#: Keyed by ``id(obj)``, or by a tuple naming what was hashed (a tensor's own elements, a
#: storage several views share).
Memo = dict[object, MemoEntry]
#: A key, the pickle it was taken from (if the value was pickled to be keyed), whether
#: keying it ran the value's own pickling code, and whether torch's pickling would send
#: tensors inside it (worth pickling it with refshare's own pickler, see ``_tensors``).
Identified = tuple[Key, "_serialized.Serialized | None", bool, bool]


class Unfingerprintable(Exception):
    """Raised inside a fingerprint pass for a value refshare cannot hash itself."""


class NeedsSerializing(Exception):
    """Raised inside a fingerprint pass for an object whose pickling runs code of its own:
    fingerprinting it by pickling would cost as much as sending it, so the caller pickles it
    once with Ray's pickler instead (see ``_serialized``)."""


# -- leaf digests: types whose content refshare hashes itself -----------------------------


def _tagged(tag: str, *meta: object) -> xxhash.xxh3_128:
    return xxhash.xxh3_128(repr((tag, *meta)).encode(), SEED)


def _head_and_body(head: xxhash.xxh3_128, body: Any) -> Key:
    """``head`` followed by a C-contiguous buffer: one pass for a small buffer, the
    parallel chunked digest for a large one."""
    if memoryview(body).nbytes <= PARALLEL_MIN_BYTES:
        head.update(body)
        return head.digest()
    return _combine(head, digest_buffer(body))


def _combine(head: xxhash.xxh3_128, body: bytes) -> Key:
    head.update(body)
    return head.digest()


def _digest_bytes(obj: bytes | bytearray) -> Key:
    return _head_and_body(_tagged(type(obj).__name__, len(obj)), obj)


def _digest_str(obj: str) -> Key:
    data = obj.encode("utf-8", "surrogatepass")
    return _head_and_body(_tagged("str", len(data)), data)


def _digest_memoryview(obj: memoryview) -> Key:
    data = obj if obj.c_contiguous else memoryview(obj.tobytes())
    head = _tagged("memoryview", obj.format, obj.shape, obj.nbytes)
    return _combine(head, digest_buffer(data))


def _ndarray_layout(arr: Any) -> tuple[str, Any]:
    """Name the layout Ray's pickling keeps ('C', 'F' or a copy in C order) and a flat view."""
    if arr.flags.c_contiguous:
        return "C", arr.reshape(-1).view("u1")
    if arr.flags.f_contiguous:
        return "F", arr.T.reshape(-1).view("u1")
    import numpy as np

    return "N", np.ascontiguousarray(arr).reshape(-1).view("u1")


#: Tokens of builtin dtypes, by identity: ``id -> (dtype, token)``, the dtype held so that
#: its id is not recycled. Only builtin dtypes are kept: they have no fields, no metadata and
#: nothing that can be changed in place (a structured dtype's ``names`` can).
_dtype_tokens: dict[int, tuple[Any, bytes]] = {}


def dtype_token(dtype: Any) -> bytes:
    """What Ray's pickling sends of ``dtype``: its pickle, exact where ``==`` is not (a dtype
    with ``metadata``, an aligned or ``np.record`` struct compare equal to the plain one)."""
    entry = _dtype_tokens.get(id(dtype))
    if entry is not None and entry[0] is dtype:
        return entry[1]
    token = pickle.dumps(dtype, protocol=5)
    if dtype.isbuiltin == 1:
        if len(_dtype_tokens) >= 1024:
            _dtype_tokens.clear()
        _dtype_tokens[id(dtype)] = (dtype, token)
    return token


#: Heads of contiguous arrays' digests: ``(id(dtype), shape, order) -> (dtype, head)``, for
#: builtin dtypes only (see ``_dtype_tokens``).
_heads: dict[tuple[int, tuple[int, ...], str], tuple[Any, bytes]] = {}


def _ndarray_head(dtype: Any, shape: tuple[int, ...], order: str) -> bytes:
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
    """An array of exact strings, by its strings joined (see ``_strings``)."""
    found = _strings.joined(arr)
    if found is None:
        return None
    text, order = found
    head = _tagged("strings", arr.shape, order)
    return _head_and_body(head, text.encode("utf-8", "surrogatepass"))


def _digest_ndarray(arr: Any) -> Key | None:
    if arr.dtype.hasobject:
        # Strings are keyed joined; other objects are pickled one by one, by the generic pass.
        return _digest_strings(arr)
    flags = arr.flags
    if arr.nbytes <= PARALLEL_MIN_BYTES and (flags.c_contiguous or flags.f_contiguous):
        # The common small case in one pass, without reshaping: a list of a thousand
        # small arrays costs about what hashing their bytes costs.
        order = "C" if flags.c_contiguous else "F"
        head = xxhash.xxh3_128(_ndarray_head(arr.dtype, arr.shape, order), SEED)
        try:
            head.update(arr if order == "C" else arr.T)
            return head.digest()
        except (BufferError, TypeError, ValueError):
            pass  # a dtype numpy exports no buffer for: through a byte view below
    order, flat = _ndarray_layout(arr)
    strides = arr.strides if order == "N" else None
    head = xxhash.xxh3_128(b"ndarray:" + dtype_token(arr.dtype), SEED)
    head.update(repr((arr.shape, order, strides)).encode())
    return _head_and_body(head, flat)


def _check_tensor(t: Any) -> None:
    import torch

    if t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized or t.is_nested:
        raise Unfingerprintable(f"{t.device.type} {t.layout} tensor")  # as Ray sends it
    if t.requires_grad and not t.is_leaf:
        raise Unfingerprintable("non-leaf tensor")  # not picklable: Ray raises by value
    if any(getattr(t, "names", None) or ()) or getattr(t, "__dict__", None):
        raise Unfingerprintable("tensor with names or attributes")  # rare: by value


def _tensor_head(t: Any, *extra: object) -> xxhash.xxh3_128:
    return _tagged(
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
    return digest_buffer(memoryview(_storage_bytes(t)))


def _storage_bytes(t: Any) -> Any:
    """The tensor's whole storage as a flat uint8 numpy array, without a copy.

    Read through the storage's address, not ``.numpy()``: that would mark the storage as
    shared with numpy, which torch then refuses to resize, here and for the user."""
    import numpy as np

    return np.asarray(_StorageView(t.untyped_storage()))


class _StorageView:
    """A storage's memory as numpy sees it, holding the storage alive meanwhile."""

    __slots__ = ("__array_interface__", "storage")

    def __init__(self, storage: Any) -> None:
        self.storage = storage
        self.__array_interface__ = {
            "data": (storage.data_ptr(), False),
            "shape": (storage.nbytes(),),
            "typestr": "|u1",
            "version": 3,
        }


def element_bytes(t: Any) -> Any:
    """A CPU tensor's own elements in row-major order as a flat uint8 numpy array: a view
    of its storage when it is contiguous, else a copy (what ``t.contiguous()`` would send)."""
    if not t.is_contiguous():
        t = t.contiguous()
    start = t.storage_offset() * t.element_size()
    return _storage_bytes(t)[start : start + t.nelement() * t.element_size()]


class TensorElements:
    """A tensor whose own elements, not its storage, are what its container sends.

    Built-in fingerprints of batch types that pickle ``tensor.contiguous()`` (verl's
    ``DataProto``) return these, so a chunk hashes its rows and not its parent's storage.
    """

    __slots__ = ("tensor",)

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor

    def compact(self) -> Any:
        """The tensor with its own elements only: itself, or a contiguous copy of a view."""
        t = self.tensor
        whole = t.is_contiguous() and t.storage_offset() == 0
        if whole and t.untyped_storage().nbytes() == t.nelement() * t.element_size():
            return t
        return t.detach().contiguous().clone().requires_grad_(t.requires_grad)

    def __reduce_ex__(self, protocol: Any) -> Any:
        form = _tensors.elements_form(self.tensor)
        if form is not None:
            return form.__reduce__()  # the elements' bytes, rebuilt as a compact tensor
        return self.compact().__reduce_ex__(protocol)  # sent as that tensor


register_size(
    TensorElements, lambda wrapper: wrapper.tensor.nelement() * wrapper.tensor.element_size()
)


def _digest_elements(t: Any) -> Key:
    head = _tagged("elements", str(t.dtype), tuple(t.shape), t.requires_grad)
    return _head_and_body(head, element_bytes(t))


# -- stamps: telling cheaply that an object hashed before may have changed ---------------

#: How many evenly spaced elements a spot check reads (4 KiB of float64).
SPOT_CHECK_ELEMENTS = 512


@functools.lru_cache(maxsize=64)
def _spot_index(size: int) -> Any:
    import numpy as np

    return np.unique(np.linspace(0, size - 1, min(size, SPOT_CHECK_ELEMENTS)).astype(np.intp))


def _spot_check(arr: Any) -> int:
    """Digest of a sample of ``arr``'s elements: all of a small array, 512 of a large one."""
    if arr.size == 0:
        return 0
    if arr.flags.c_contiguous:
        sample = arr.reshape(-1)[_spot_index(arr.size)]
    elif arr.flags.f_contiguous:
        sample = arr.T.reshape(-1)[_spot_index(arr.size)]
    else:
        sample = arr.flat[_spot_index(arr.size)]
    return xxhash.xxh3_64_intdigest(sample.view("u1").tobytes(), SEED)


def _elements_of(flat: Any, itemsize: int) -> Any:
    """A flat uint8 view as elements of ``itemsize`` bytes, so that a spot check compares
    whole elements: a float32 going from 1.0 to 2.0 changes none of its sampled bytes at
    the element's start."""
    if itemsize == 1 or flat.size % itemsize:
        return flat
    return flat.view(_ELEMENT_CODES.get(itemsize) or f"V{itemsize}")


_ELEMENT_CODES = {2: "u2", 4: "u4", 8: "u8"}


#: Buffers nobody can write to: what an immutable array rests on.
_IMMUTABLE_BUFFERS = frozenset({"builtins.bytes", "ray._raylet.Buffer", "ray._raylet.SubBuffer"})


def _array_trust(arr: Any) -> int:
    """How far an array can be trusted not to change.

    ``ALWAYS`` when it is read-only all the way down to an immutable buffer (``bytes``, or
    the object-store buffer under an array ``ray.get`` returned): numpy refuses to make any
    array in that chain writeable again. Any other array, ``NEVER``: one marked read-only
    may still be written through a view made before, or made writeable again.
    """
    import numpy as np

    node = arr
    while True:
        if isinstance(node, np.ndarray):
            if node.flags.writeable or node.base is None:
                return NEVER
            node = node.base
        elif isinstance(node, memoryview):
            if not node.readonly:
                return NEVER
            node = node.obj
        else:
            cls = type(node)
            immutable = f"{cls.__module__}.{cls.__qualname__}" in _IMMUTABLE_BUFFERS
            return ALWAYS if immutable else NEVER


def _ndarray_stamp(arr: Any) -> Stamp:
    if arr.dtype.hasobject:
        return None
    where = (arr.__array_interface__["data"][0], arr.shape, arr.strides, dtype_token(arr.dtype))
    return (where, _spot_check(arr)), _array_trust(arr)


def _tensor_trust(t: Any) -> int:
    """``PROMISED`` for a tensor on memory torch allocated, whose version counter sees
    torch's own writes through it and its views; ``NEVER`` for memory torch shares with
    another owner (``torch.from_numpy``, ``frombuffer``, DLPack), written unseen."""
    return PROMISED if t.untyped_storage().resizable() else NEVER


def _tensor_stamp(t: Any) -> Stamp:
    """Torch's version counter catches its own in-place operations; the spot check of its
    elements, most writes through ``.numpy()`` or ``.data`` views, which the counter does
    not see. A tensor made under ``torch.inference_mode()`` has no version counter, and so
    no stamp: it is hashed each time it is sent."""
    if t.device.type != "cpu" or t.layout is not _strided() or t.is_inference():
        return None
    where = (t._version, t.data_ptr(), tuple(t.shape), t.stride())
    spot = _spot_check(_elements_of(_storage_bytes(t), t.element_size()))
    return (where, spot), _tensor_trust(t)


def _elements_stamp(t: Any) -> Stamp:
    """As :func:`_tensor_stamp`, spot-checking the tensor's own elements (what a
    ``TensorElements`` sends): a chunk's rows, still in the cache after being hashed, not
    its parent's whole storage."""
    if not t.is_contiguous():
        return _tensor_stamp(t)
    if t.is_inference():
        return None
    where = (t._version, t.data_ptr(), tuple(t.shape), t.stride())
    spot = _spot_check(_elements_of(element_bytes(t), t.element_size()))
    return (where, spot), _tensor_trust(t)


def _storage_stamp(t: Any) -> Stamp:
    """A storage is stamped through any tensor on it; views share its version counter."""
    if t.device.type != "cpu" or t.is_inference():
        return None
    storage = t.untyped_storage()
    where = (t._version, storage.data_ptr(), storage.nbytes())
    spot = _spot_check(_elements_of(_storage_bytes(t), t.element_size()))
    return (where, spot), _tensor_trust(t)


@functools.cache
def _strided() -> Any:
    import torch

    return torch.strided


# -- dispatch tables ----------------------------------------------------------------------

#: Arrays smaller than this are hashed each time they are seen: reading them costs less
#: than stamping them, and a list of a thousand small arrays stays as cheap as its bytes.
STAMP_MIN_BYTES = 256 << 10


def _memoized(leaf: LeafFn) -> DigestFn:
    def digest(obj: Any, memo: Memo | None, reuse: bool) -> Key | None:
        return leaf_digest(obj, leaf, memo, reuse)

    return digest


def _ndarray_digest(arr: Any, memo: Memo | None, reuse: bool) -> Key | None:
    if arr.nbytes < STAMP_MIN_BYTES and not arr.dtype.hasobject:
        return _digest_ndarray(arr)
    return leaf_digest(arr, _digest_ndarray, memo, reuse)


def _base(t: Any) -> Any:
    """The tensor whose memory ``t`` views (``t`` itself if it is no view): what a digest
    of its memory is kept against, so that a view made anew (a batch chunked again, on
    each call) finds it."""
    base = t._base
    return t if base is None else base


def _tensor_digest(t: Any, memo: Memo | None, reuse: bool) -> Key | None:
    """What pickling a CPU tensor sends: its whole storage, offset, size and stride.

    Views of one storage (the chunks of a batch) hash that storage once per call."""
    _check_tensor(t)
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    key = ("storage", storage.data_ptr(), nbytes)
    body = leaf_digest(t, _digest_storage, memo, reuse, key, _storage_stamp, _base(t))
    return None if body is None else _combine(_tensor_head(t, nbytes), body)


def _elements_digest(wrapper: TensorElements, memo: Memo | None, reuse: bool) -> Key | None:
    """A tensor's own elements; the same rows of one base, viewed again, are hashed once."""
    t = wrapper.tensor
    _check_tensor(t)
    base = _base(t)
    layout = (t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.requires_grad)
    key = ("elements", id(base), layout, t.is_conj(), t.is_neg())
    return leaf_digest(t, _digest_elements, memo, reuse, key, _elements_stamp, base)


def _numpy_digests(table: TypeTable[DigestFn]) -> None:
    import numpy as np

    table.register(np.ndarray, _ndarray_digest)  # exact type only: subclasses carry state


def _numpy_stamps(table: TypeTable[Callable[[Any], Stamp]]) -> None:
    import numpy as np

    table.register(np.ndarray, _ndarray_stamp)


def _torch_digests(table: TypeTable[DigestFn]) -> None:
    import torch

    for cls in (torch.Tensor, torch.nn.Parameter):
        table.register(cls, _tensor_digest)


def _torch_stamps(table: TypeTable[Callable[[Any], Stamp]]) -> None:
    import torch

    for cls in (torch.Tensor, torch.nn.Parameter):
        table.register(cls, _tensor_stamp)


#: Types whose content refshare hashes itself, in place (exact types only).
_leaf_digests: TypeTable[DigestFn] = TypeTable({"numpy": _numpy_digests, "torch": _torch_digests})
for _cls, _digest in ((bytes, _digest_bytes), (bytearray, _digest_bytes), (str, _digest_str)):
    _leaf_digests.register(_cls, _memoized(_digest))
_leaf_digests.register(memoryview, _memoized(_digest_memoryview))
_leaf_digests.register(TensorElements, _elements_digest)
#: How to tell that an object may have changed since it was hashed (see ``leaf_digest``).
_stamps: TypeTable[Callable[[Any], Stamp]] = TypeTable(
    {"numpy": _numpy_stamps, "torch": _torch_stamps}
)
#: Users' own types, with what defines their content (see ``register_fingerprint``).
_user_fingerprints: TypeTable[FingerprintFn] = TypeTable()
#: refshare's own fingerprints of the ecosystem's batch types (see ``_batches``), filled in
#: when their package is first seen; a user's registration takes precedence.
builtin_fingerprints: TypeTable[FingerprintFn] = TypeTable()


def register_fingerprint(
    cls: type, fingerprint: FingerprintFn, *, size: SizeFn | None = None
) -> None:
    """Teach refshare what defines the content of an instance of ``cls`` (or a subclass).

    ``fingerprint(obj)`` returns any value refshare can fingerprint itself, typically a tuple
    of the object's arrays, tensors and metadata. Two instances share a ref exactly when these
    values are equal in type, layout and bytes, so leave nothing out that a worker would see.
    ``size`` is the same as :func:`register_size`.
    """
    if not isinstance(cls, type):
        raise TypeError(f"register_fingerprint() takes a class, got {cls!r}")
    if not callable(fingerprint):
        raise TypeError(
            f"register_fingerprint() takes a callable fingerprint function, got {fingerprint!r}"
        )
    _user_fingerprints.register(cls, fingerprint)
    if size is not None:
        register_size(cls, size)


# -- which objects pickle cheaply ---------------------------------------------------------

#: Packages whose pickling code only rearranges what the object holds (no serialization
#: of its own): their objects are walked by the fingerprint pass.
TRUSTED_PICKLING = frozenset(
    {
        "builtins", "collections", "copyreg", "dataclasses", "datetime", "decimal", "enum",
        "fractions", "functools", "ipaddress", "pathlib", "re", "types", "typing", "uuid",
        "numpy", "torch", "tensordict", "ray",
    }
)  # fmt: skip
_own_pickling: dict[type, bool] = {}


def runs_own_pickling(cls: type) -> bool:
    """Whether pickling ``cls`` runs code from outside :data:`TRUSTED_PICKLING`: a
    ``__reduce__``, ``__reduce_ex__`` or ``__getstate__`` that may serialize on its own."""
    found = _own_pickling.get(cls)
    if found is None:
        found = _own_pickling[cls] = any(
            _defined_outside_trusted(cls, name)
            for name in ("__reduce_ex__", "__reduce__", "__getstate__")
        )
    return found


def _defined_outside_trusted(cls: type, name: str) -> bool:
    for base in cls.__mro__:
        if name in base.__dict__:
            if base is object:
                return False
            module = getattr(base.__dict__[name], "__module__", None) or base.__module__
            return str(module).partition(".")[0] not in TRUSTED_PICKLING
    return False


# -- fingerprints -------------------------------------------------------------------------


def _from_digest(*parts: object) -> None:
    """Stands in a fingerprint pass for a value refshare hashed itself; never called."""


def _from_user_fingerprint(*parts: object) -> None:
    """Stands in a fingerprint pass for a registered type's normalized form; never called."""


def _from_class(*parts: object) -> None:
    """Stands in a fingerprint pass for a class Ray sends by value; never called."""


def sent_by_value(obj: Any) -> bool:
    """Whether Ray's cloudpickle sends this class or function as code, not by name: defined
    in ``__main__`` or a notebook, inside a function, or in a module registered to be
    pickled by value. Its definition, its attributes and the globals its methods use then
    travel with every submission, and may change between two."""
    try:
        from ray.cloudpickle import cloudpickle

        return not cloudpickle._should_pickle_by_reference(obj)  # type: ignore[no-untyped-call]
    except Exception:  # cloudpickle moved its helper: the rule it implements
        return obj.__module__ == "__main__" or "<locals>" in obj.__qualname__


def _class_digest(cls: type) -> Key:
    """A class Ray sends by value, keyed by what it sends: cloudpickle's pickle of it."""
    from ray import cloudpickle

    stream = _HashFile()
    pickler: Any = cloudpickle.CloudPickler(stream, protocol=5)  # type: ignore[no-untyped-call]
    pickler.dump(cls)
    return stream.hasher.digest()


class _HashFile:
    """A write-only file that hashes what the pickler writes, and holds nothing."""

    __slots__ = ("hasher",)

    def __init__(self) -> None:
        self.hasher = xxhash.xxh3_128(b"pickle", SEED)

    def write(self, data: Any) -> int:
        self.hasher.update(data)
        return len(data)


#: An array of more Python objects than this is keyed by the pickle Ray sends (which a miss
#: then puts): its elements must be pickled to be keyed, so that pickle is not done twice.
SERIALIZE_OBJECT_ARRAYS_FROM = 10_000


class _FingerprintPickler(pickle.Pickler):
    """Pickles only to hash: out-of-band buffers are hashed where they lie, and arrays,
    tensors and registered types are replaced by their own digests.

    ``strict`` stops the pass (``NeedsSerializing``) at an object whose pickling runs code
    of its own; otherwise that code runs, and its output is hashed like the rest."""

    def __init__(self, memo: Memo, reuse: bool, strict: bool) -> None:
        self.stream = _HashFile()
        self.buffers = xxhash.xxh3_128(b"buffers", SEED)
        self.digests = memo
        self.reuse = reuse
        self.strict = strict
        self.tensors = False  # whether a tensor was hashed as torch's pickling sends it
        super().__init__(self.stream, protocol=5, buffer_callback=self._hash_buffer)

    def _hash_buffer(self, buffer: pickle.PickleBuffer) -> None:
        raw = buffer.raw()
        self.buffers.update(raw.nbytes.to_bytes(8, "little"))
        self.buffers.update(digest_buffer(raw))

    def reducer_override(self, obj: Any) -> Any:
        cls = type(obj)
        if isinstance(obj, _serialized.ray_handle_types()):
            raise _serialized.HoldsRayHandles(cls.__qualname__)
        leaf = _leaf_digests.exact(cls)
        if leaf is not None:
            digest = leaf(obj, self.digests, self.reuse)
            if digest is not None:
                self.tensors = self.tensors or leaf is _tensor_digest
                return _from_digest, (digest,)
            if self.strict and getattr(obj, "size", 0) > SERIALIZE_OBJECT_ARRAYS_FROM:
                raise NeedsSerializing("a large array of Python objects")
            return NotImplemented
        known = _user_fingerprints.lookup(cls) if _user_fingerprints else None
        if known is None:
            known = builtin_fingerprints.lookup(cls)
        if known is not None:
            return _from_user_fingerprint, (f"{cls.__module__}.{cls.__qualname__}", known(obj))
        if (isinstance(obj, type) or cls is types.FunctionType) and sent_by_value(obj):
            if cls is types.FunctionType:
                raise Unfingerprintable(f"function {obj.__qualname__} is sent as code")
            return _from_class, (_class_digest(obj),)
        if self.strict and runs_own_pickling(cls):
            raise NeedsSerializing(cls.__qualname__)
        return NotImplemented

    def key(self) -> Key:
        head = self.stream.hasher
        head.update(self.buffers.digest())
        return head.digest()


#: Digests of unchanged objects, across calls, for ``reuse=True``: memo key -> (weakref,
#: stamp, digest). The weakref both proves the object is the one hashed (ids are recycled)
#: and removes the entry when the object dies.
_seen: dict[object, tuple[weakref.ref[Any], object, Key]] = {}


def _remember(key: object, obj: object, stamp: object, digest: Key) -> None:
    def forget(ref: weakref.ref[Any]) -> None:
        entry = _seen.get(key)
        if entry is not None and entry[0] is ref:
            del _seen[key]

    _seen[key] = (weakref.ref(obj, forget), stamp, digest)


def leaf_digest(
    obj: object,
    leaf: LeafFn,
    memo: Memo | None,
    reuse: bool = False,
    memo_key: object = None,
    stamp_fn: Callable[[Any], Stamp] | None = None,
    anchor: object = None,
) -> Key | None:
    """Digest ``obj`` with ``leaf``, reusing an earlier digest where that is safe.

    Within one call (``memo``), an array or tensor hashed before is not hashed again while
    its stamp holds: same memory, shape and strides, same torch version counter, and the
    same content at 512 evenly spaced elements (a spot check of a few KiB). Across calls,
    digests are kept under the same stamp for arrays that cannot change (read-only down to
    an immutable buffer) and, with ``reuse``, for objects the user promises not to change
    behind numpy's or torch's back: tensors, and read-only arrays owning their memory.
    Bytes and strings are immutable but cannot be weakly referenced, so they are hashed
    each time they are seen. ``memo_key`` (default ``id(obj)``) and ``stamp_fn`` name
    another digest of the same object: a tensor's storage, or its own elements.
    ``anchor`` (default ``obj``) is the object the digest is kept against, held or weakly
    referenced so that its memory cannot be freed and reused unseen: for a view, the
    tensor it views, so that the same memory viewed again is found.
    """
    if stamp_fn is None:
        stamp_fn = _stamps.exact(type(obj))
    if stamp_fn is None:
        return leaf(obj)
    if memo_key is None:
        memo_key = id(obj)
    if anchor is None:
        anchor = obj
    if (memo is None or memo_key not in memo) and memo_key not in _seen:
        # Seen for the first time: hash first, then stamp while the memory is still in the
        # cache. Stamped first, the spot check of cold memory cost as much as the hash.
        digest = leaf(obj)
        if digest is not None:
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
        if entry is not None and entry[0] is anchor and entry[1] == stamp:
            return entry[2]
    if trust == ALWAYS or (reuse and trust == PROMISED):
        seen = _seen.get(memo_key)
        if seen is not None and seen[0]() is anchor and seen[1] == stamp:
            if memo is not None:
                memo[memo_key] = (anchor, stamp, seen[2])
            return seen[2]
    digest = leaf(obj)
    if digest is not None:
        _keep(memo, memo_key, anchor, stamped, digest, reuse)
    return digest


def _keep(
    memo: Memo | None, memo_key: object, anchor: object, stamped: Any, digest: Key, reuse: bool
) -> None:
    """Keep a digest under its stamp, against ``anchor``: for this call, and across calls
    where the object can be trusted not to change."""
    stamp, trust = stamped
    if memo is not None:
        memo[memo_key] = (anchor, stamp, digest)
    if trust == ALWAYS or (reuse and trust == PROMISED):
        _remember(memo_key, anchor, stamp, digest)


def _digest_array_list(items: list[Any] | tuple[Any, ...]) -> Key | None:
    """A list or tuple of distinct small contiguous arrays in one streaming pass, or
    ``None``. The pickler cannot be asked about a list, so a list of a thousand arrays
    would cost a trip through the pass per array, 2.4x what hashing their bytes costs."""
    numpy = sys.modules.get("numpy")
    ndarray = getattr(numpy, "ndarray", None)
    if not items or type(items[0]) is not ndarray:
        return None
    head = _tagged("arrays", type(items).__name__, len(items))
    update = head.update
    for arr in items:
        if type(arr) is not ndarray or arr.nbytes >= STAMP_MIN_BYTES or arr.dtype.hasobject:
            return None
        flags = arr.flags
        if flags.c_contiguous:
            update(_ndarray_head(arr.dtype, arr.shape, "C"))
            update(arr)
        elif flags.f_contiguous:
            update(_ndarray_head(arr.dtype, arr.shape, "F"))
            update(arr.T)
        else:
            return None
    if len(set(map(id, items))) != len(items):
        return None  # an array twice arrives as one object twice: the pass keeps that
    return head.digest()


def fingerprint_pass(obj: object, memo: Memo, reuse: bool, strict: bool) -> tuple[Key, bool]:
    """The fingerprint of ``obj`` without serializing it, and whether it holds tensors
    (other than itself); raises what the pass raised.

    With ``strict``, raises ``NeedsSerializing`` or ``Unfingerprintable`` for values that
    only a real serialization can key (see :func:`identify`)."""
    cls = type(obj)
    leaf = _leaf_digests.exact(cls)
    if leaf is not None:
        digest = leaf(obj, memo, reuse)
        if digest is not None:
            return digest, False
    elif cls is list or cls is tuple:
        digest = _digest_array_list(obj)  # type: ignore[arg-type]
        if digest is not None:
            return digest, False
    pickler = _FingerprintPickler(memo, reuse, strict)
    pickler.dump(obj)
    return pickler.key(), pickler.tensors


def identify(obj: object, memo: Memo | None = None, reuse: bool = False) -> Identified | None:
    """Key ``obj``, serializing it at most once; ``None`` when it must go by value.

    Returns the key, the pickle it was taken from (or ``None``), whether keying it ran
    pickling code of the value's own (so it is worth not keying it again within a call),
    and whether it holds tensors that torch's pickling would send.

    Values made of arrays, tensors, containers, plain objects and known batch types are
    keyed without serializing them. A value whose pickling runs code of its own, or holds
    what refshare cannot hash (a GPU tensor, a function sent as code), is pickled once with
    Ray's pickler and keyed by that pickle, which is then what ``ray.put`` stores. Values
    holding object refs or actor handles are left to Ray's own serialization (as is
    everything, when Ray's pickler is not what refshare expects): their pickling code runs
    in a fingerprint pass, and ``ray.put`` serializes them again.
    """
    if memo is None:
        memo = {}
    name = type(obj).__qualname__
    try:
        try:
            key, tensors = fingerprint_pass(obj, memo, reuse, strict=True)
            return key, None, False, tensors
        except (NeedsSerializing, Unfingerprintable) as why:
            logger.debug("%s is keyed by its pickle (%s)", name, why)
        if _serialized.available():
            serialized = _serialized.serialize(obj)
            return serialized.key, serialized, True, False
        return fingerprint_pass(obj, memo, reuse, strict=False)[0], None, True, False
    except _serialized.HoldsRayHandles as held:
        # Stored, the refs or handles inside would live as long as refshare keeps the
        # value, not as long as by value keeps them: an actor would outlive its last handle.
        logger.debug("%s holds a %s: sent by value", name, held)
    except RecursionError:
        logger.debug("%s is nested too deeply to fingerprint", name)
    except Exception:
        logger.debug("cannot fingerprint %s", name, exc_info=True)
    return None


def fingerprint(obj: object, memo: Memo | None = None, reuse: bool = False) -> Key | None:
    """Return a key that is equal for two values exactly when Ray would send equal data.

    The key covers the type, dtype, shape, layout and every byte, hashed with seeded
    xxh3-128. Arrays, tensors, bytes and strings are hashed in place; containers, plain
    objects and known batch types through a pickle protocol-5 pass that hashes instead of
    storing; values that run pickling code of their own by the pickle Ray would send.
    Returns ``None`` for values that cannot be fingerprinted: they go to Ray by value.
    ``memo`` and ``reuse`` are explained in :func:`leaf_digest`.
    """
    found = identify(obj, memo, reuse)
    return None if found is None else found[0]


__all__ = [
    "Identified",
    "Key",
    "Memo",
    "TensorElements",
    "fingerprint",
    "identify",
    "leaf_digest",
    "register_fingerprint",
]
