"""Keying a whole value: a pickling pass that hashes instead of storing, or Ray's own pickle.

Containers, plain objects and registered types are keyed by a protocol-5 pickling pass
whose output is hashed and never kept: leaves (arrays, tensors, bytes) are replaced by
their own digests, out-of-band buffers are hashed where they lie. A value whose pickling
runs code of its own would cost as much to key this way as to send, so it is pickled once
with Ray's pickler and keyed by that pickle (see ``refshare._wire.serialized``).
"""

from __future__ import annotations

import logging
import pickle
import sys
import types
from typing import Any, NamedTuple

import xxhash

from .._hashing import SEED, BufferHasher, tagged
from .._rules import Classes, Kind, pickles_by_own_code
from .._wire import serialized
from .._wire.arrays import memory_order
from .leaves import Unfingerprintable, ndarray_head, tensor_digest, tensor_state
from .stamps import STAMP_MIN_BYTES
from .tables import Key, Memo, pickle_order

logger = logging.getLogger("refshare")


class NeedsSerializing(Exception):
    """Raised inside a fingerprint pass for an object whose pickling runs code of its own:
    fingerprinting it by pickling would cost as much as sending it, so the caller pickles it
    once with Ray's pickler instead."""


class Identified(NamedTuple):
    """A value, keyed."""

    key: Key
    #: The pickle the key was taken from, if the value had to be pickled to be keyed.
    serialized: serialized.Serialized | None
    #: Whether keying it ran pickling code of the value's own: worth not keying it again.
    costly: bool
    #: Whether torch's pickling would send tensors inside it: worth pickling it with
    #: refshare's own pickler, its tensors as their bytes.
    tensors: bool


class _HashFile:
    """A write-only file that hashes what a pickler writes, and holds nothing."""

    __slots__ = ("hasher",)

    def __init__(self) -> None:
        self.hasher = xxhash.xxh3_128(b"pickle", SEED)

    def write(self, data: Any) -> int:
        self.hasher.update(data)
        return len(data)


def _class_digest(cls: type) -> Key:
    """A class Ray sends by value, keyed by what it sends: cloudpickle's pickle of it."""
    from ray import cloudpickle

    stream = _HashFile()
    pickler: Any = cloudpickle.CloudPickler(stream, protocol=5)  # type: ignore[no-untyped-call]
    pickler.dump(cls)
    return stream.hasher.digest()


# The stand-ins a fingerprint pass writes in place of what it keyed itself; never called.


def _from_digest(*parts: object) -> None:
    """A value refshare hashed itself."""


def _from_user_fingerprint(*parts: object) -> None:
    """A registered type's normalized form."""


def _from_class(*parts: object) -> None:
    """A class Ray sends by value."""


#: An array of more Python objects than this is keyed by the pickle Ray sends (which a miss
#: then puts): its elements must be pickled to be keyed, so that pickle is not done twice.
SERIALIZE_OBJECT_ARRAYS_FROM = 10_000
#: The stand-ins themselves, pickled by name into the hashed stream with no question asked.
_STAND_INS = frozenset((_from_digest, _from_user_fingerprint, _from_class))
_LEAF, _READ, _PLAIN, _NAMED = Kind.LEAF, Kind.READ, Kind.PLAIN, Kind.NAMED
_HANDLE, _CODE = Kind.HANDLE, Kind.CODE


class _FingerprintPickler(pickle.Pickler):
    """Pickles only to hash: out-of-band buffers are hashed where they lie, and arrays,
    tensors and registered types are replaced by their own digests.

    ``strict`` stops the pass (``NeedsSerializing``) at an object whose pickling runs code
    of its own; otherwise that code runs, and its output is hashed like the rest."""

    def __init__(self, memo: Memo, reuse: bool, strict: bool, kinds: Classes) -> None:
        self.stream = _HashFile()
        self.buffers = BufferHasher(b"buffers")
        self.digests = memo
        self.reuse = reuse
        self.strict = strict
        self.kinds = kinds
        self.tensors = False  # whether a tensor was hashed as torch's pickling sends it
        self.class_keys: dict[type, object] = {}  # see class_key
        super().__init__(self.stream, protocol=5, buffer_callback=self._hash_buffer)

    def _hash_buffer(self, buffer: pickle.PickleBuffer) -> None:
        self.buffers.add(buffer.raw())

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is types.FunctionType and obj in _STAND_INS:
            return NotImplemented
        rule = self.kinds.of(obj)
        kind = rule.kind
        if kind is _LEAF:
            leaf = rule.entry
            digest = leaf(obj, self.digests, self.reuse)
            if digest is not None:
                if leaf is tensor_digest:
                    self.tensors = True
                    state = tensor_state(obj)
                    if state is not None:
                        return _from_digest, (digest, state)
                return _from_digest, (digest,)
            if self.strict and getattr(obj, "size", 0) > SERIALIZE_OBJECT_ARRAYS_FROM:
                raise NeedsSerializing("a large array of Python objects")
            return NotImplemented
        if kind is _READ:
            content = rule.entry(obj)
            if content is not NotImplemented:  # else not read in full: the exact path
                return _from_user_fingerprint, (self.class_key(type(obj)), content)
            kind = rule.unread
        if kind is _PLAIN:  # pickled as a trusted reducer says (Ray's tables), or pickle
            return NotImplemented if rule.reducer is None else rule.reducer(obj)
        if kind is _NAMED:
            return NotImplemented
        if kind is _HANDLE:
            raise serialized.HoldsRayHandles(type(obj).__qualname__)
        if kind is _CODE:
            if type(obj) is types.FunctionType:
                raise Unfingerprintable(f"function {obj.__qualname__} is sent as code")
            return _from_class, (_class_digest(obj),)
        if self.strict:  # hooked, or its own code: pickled as that code says
            raise NeedsSerializing(f"{type(obj).__qualname__}: {kind.value}")
        return NotImplemented

    def class_key(self, cls: type) -> object:
        """What a reader's content is keyed with of its class: the name Ray sends it by,
        or for a class Ray sends as code, that code (its attributes and globals too)."""
        found = self.class_keys.get(cls)
        if found is None:
            name = f"{cls.__module__}.{cls.__qualname__}"
            by_value = self.kinds.sent_by_value(cls)
            found = self.class_keys[cls] = _class_digest(cls) if by_value else name
        return found

    def key(self) -> Key:
        head = self.stream.hasher
        head.update(self.buffers.digest())
        return head.digest()


def _digest_array_list(
    items: list[Any] | tuple[Any, ...], kinds: Classes | None = None
) -> Key | None:
    """A list or tuple of distinct small contiguous arrays in one streaming pass, or
    ``None``. The pickler cannot be asked about a list, so through the pass each array of
    a list of a thousand would cost a round trip of its own, more than its bytes' hash."""
    numpy = sys.modules.get("numpy")
    ndarray = getattr(numpy, "ndarray", None)
    if not items or type(items[0]) is not ndarray:
        return None
    if (kinds or pickle_order.walk()).leaf(items[0]) is None:
        return None  # a serializer of the program's sends each array
    head = tagged("arrays", type(items).__name__, len(items))
    update = head.update
    for arr in items:
        if type(arr) is not ndarray or arr.nbytes >= STAMP_MIN_BYTES or arr.dtype.hasobject:
            return None
        order = memory_order(arr)
        if order == "N":
            return None
        update(ndarray_head(arr.dtype, arr.shape, order))
        update(arr if order == "C" else arr.T)
    if len(set(map(id, items))) != len(items):
        return None  # an array twice arrives as one object twice: the pass keeps that
    return head.digest()


def fingerprint_pass(obj: object, memo: Memo, reuse: bool, strict: bool) -> tuple[Key, bool]:
    """The fingerprint of ``obj`` without serializing it, and whether it holds tensors
    (other than itself); raises what the pass raised.

    With ``strict``, raises ``NeedsSerializing`` or ``Unfingerprintable`` for values that
    only a real serialization can key (see :func:`identify`)."""
    cls = type(obj)
    kinds = None
    leaf = pickle_order.leaf(obj)  # an array, a tensor, a string: no walk
    if leaf is None:
        kinds = pickle_order.walk()
        leaf = kinds.leaf(obj)
    if leaf is not None and not (leaf is tensor_digest and tensor_state(obj)):
        digest = leaf(obj, memo, reuse)
        if digest is not None:
            return digest, False
    elif cls is list or cls is tuple:
        digest = _digest_array_list(obj, kinds)  # type: ignore[arg-type]
        if digest is not None:
            return digest, False
    pickler = _FingerprintPickler(memo, reuse, strict, kinds or pickle_order.walk())
    pickler.dump(obj)
    return pickler.key(), pickler.tensors


def identify(
    obj: object, memo: Memo | None = None, reuse: bool = False, reasons: list[str] | None = None
) -> Identified | None:
    """Key ``obj``, serializing it at most once; ``None`` when it must go by value.

    Values made of arrays, tensors, containers, plain objects and known batch types are
    keyed without serializing them. A value whose pickling runs code of its own, or holds
    what refshare cannot hash (a GPU tensor, a function sent as code), is pickled once with
    Ray's pickler and keyed by that pickle, which is then what ``ray.put`` stores. Values
    holding object refs or actor handles go by value, so that Ray alone decides how long
    what they hold lives; so does everything that cannot be keyed (``reasons`` gets
    why, for the report).
    """
    reason = "cannot be fingerprinted"
    if memo is None:
        memo = {}
    name = type(obj).__qualname__
    try:
        try:
            key, tensors = fingerprint_pass(obj, memo, reuse, strict=True)
            return Identified(key, None, False, tensors)
        except (NeedsSerializing, Unfingerprintable) as why:
            logger.debug("%s is keyed by its pickle (%s)", name, why)
        if serialized.available():
            pickled = serialized.serialize(obj)
            return Identified(pickled.key, pickled, True, False)
        return Identified(fingerprint_pass(obj, memo, reuse, strict=False)[0], None, True, False)
    except serialized.HoldsRayHandles as held:
        # Stored, the refs or handles inside would live as long as refshare keeps the
        # value, not as long as by value keeps them: an actor would outlive its last handle.
        logger.debug("%s holds a %s: sent by value", name, held)
        reason = f"holds a {held}, which Ray alone must keep alive"
    except RecursionError:
        logger.debug("%s is nested too deeply to fingerprint", name)
        reason = "nested too deeply to fingerprint"
    except Exception as error:
        logger.debug("cannot fingerprint %s", name, exc_info=True)
        reason = f"cannot be fingerprinted ({type(error).__name__}: {error})"
    if reasons is not None:
        reasons.append(reason)
    return None


def fingerprint(obj: object, memo: Memo | None = None, reuse: bool = False) -> Key | None:
    """Return a key that is equal for two values exactly when Ray would send equal data.

    The key covers the type, dtype, shape, layout and every byte, hashed with seeded
    xxh3-128. Arrays, tensors, bytes and strings are hashed in place; containers, plain
    objects and known batch types through a pickle protocol-5 pass that hashes instead of
    storing; values that run pickling code of their own by the pickle Ray would send.
    Returns ``None`` for values that cannot be fingerprinted: they go to Ray by value.
    ``memo`` and ``reuse`` are explained in :func:`refshare._keys.stamps.leaf_digest`.
    """
    found = identify(obj, memo, reuse)
    return None if found is None else found.key


#: Per class whose values are keyed by their own pickle: whether pickling an unchanged value
#: twice gave the same bytes. Until one is sent again in a call, it is not known.
_pickling_alike: dict[type, bool] = {}


def pickling_classes(value: object, held: list[object]) -> frozenset[type]:
    """The classes whose pickling decides whether ``value`` pickles alike twice: its own,
    and every class among the objects ``held`` in it (a structure walk's) that runs
    pickling code of its own. A dict that pickles alike says nothing of the next dict."""
    found = {type(value)}
    found.update(cls for cls in set(map(type, held)) if pickles_by_own_code(cls))
    return frozenset(found)


def pickles_alike(classes: frozenset[type]) -> bool:
    """Whether an unchanged value made of ``classes`` (see :func:`pickling_classes`) may be
    sent again as the pickle made of it before: once each class was seen to pickle an
    unchanged value twice to the same bytes (see ``Scope.key``)."""
    return all(_pickling_alike.get(cls, False) for cls in classes)


def learn_pickling(classes: frozenset[type], alike: bool) -> None:
    """Record whether pickling an unchanged value made of ``classes`` twice gave the same
    bytes. A class that did not is pickled on every submission, as by value."""
    if len(_pickling_alike) >= 4096:
        _pickling_alike.clear()
    for cls in classes:
        if _pickling_alike.get(cls) is not False:
            _pickling_alike[cls] = alike


def forget_pickling() -> None:
    """Forget what was learned of which classes pickle alike."""
    _pickling_alike.clear()
