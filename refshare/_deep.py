"""Deep sharing, the driver's side: each large member of an argument is stored once, and the
argument travels as a small skeleton that names them.

The argument is pickled with a ``persistent_id`` that takes out each large array or tensor
(stored and cached by content, as a top-level argument would be; the new ones of one
argument together, in one object, a :class:`Bundled` each) and each object ref or actor
handle (handed to Ray as they are, so Ray tracks their lifetimes). On the worker,
Ray's unpickling of the skeleton runs :func:`refshare._wire.bootstrap.rebuild_skeleton`,
shipped by value: it fetches the members in one batched get and unpickles the rest around
them, so the worker's code receives what it receives by value.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from ._dispatch import TypeTable
from ._hashing import Buffer, BufferHasher
from ._keys.leaves import tensor_digest
from ._keys.sizes import estimate_size, plain_ndarray
from ._keys.tables import Key, Keyed, leaf_digests
from ._ray.pickling import sent_by_value, ship_by_value
from ._rules import Kind, PickleOrder, pickles_as
from ._wire import bootstrap
from ._wire.serialized import native_split, pickler_classes, ray_handle_types

#: Leaves kept inside the skeleton, whatever their size: stored on their own, they would go
#: through Ray's msgpack, where a ``bytearray`` or a ``memoryview`` arrives as ``bytes``.
_INLINE = frozenset((str, bytearray, memoryview))
#: Exact types that are never a member, a ref or a handle: no further look.
_PASSED = frozenset((str, int, float, bool, type(None), tuple, list, dict, set, frozenset))
#: Keys a member, or returns ``None`` to leave it inline.
KeyFn = Callable[[Any, int], "Keyed | None"]
#: Types whose pickling hides their members from ``persistent_id`` (verl's ``DataProto``
#: ``torch.save``s its batch), each with a reduction that shows them, or ``NotImplemented``
#: where the worker's rebuild would not reproduce the value exactly (it is stored whole).
#: A subclass is reduced so only if it pickles as the registered class (``refshare._rules``).
deep_reducers: TypeTable[Callable[[Any], Any]] = TypeTable(pickles_as)
#: Pickle's order as a split sees it: leaves taken out as members, then the deep reducers.
split_order = PickleOrder(leaf_digests, (deep_reducers,), ray_handle_types, sent_by_value)
_LEAF, _HANDLE, _READ, _PLAIN = Kind.LEAF, Kind.HANDLE, Kind.READ, Kind.PLAIN
_HOOKED, _OWN_CODE = Kind.HOOKED, Kind.OWN_CODE


class NotSplittable(Exception):
    """A split refused: the value holds an object whose pickling runs code of its own, which
    a split would run only to find no member in its output, before the value is pickled
    again whole."""


def kept_whole(value: Any) -> Any:
    """The deep reducer of a type never split into members (SkyRL's batch, whose pickling
    sends copies it makes only by running it): a value of that type is routed whole before
    any split is tried, and a split of a value holding one is refused."""
    raise NotSplittable(type(value).__qualname__)


def never_split(cls: type) -> bool:
    """Whether values of ``cls`` are kept whole (:func:`kept_whole`)."""
    return deep_reducers.lookup(cls) is kept_whole


@dataclass
class Split:
    """An argument pickled with its large members taken out and keyed, none stored yet."""

    native: bytes | None  #: Ray's msgpack of an exact dict or list (see ``native_split``)
    inband: bytes
    buffers: list[pickle.PickleBuffer]
    members: list[Keyed]
    handles: list[Any]
    #: Whether a member is a plain tensor: the argument, stored whole, is then pickled by
    #: refshare with its tensors as their bytes.
    tensors: bool
    #: What its scope sent for it, once its members and skeleton are stored.
    result: Any = None

    @property
    def nbytes(self) -> int:
        """What the skeleton weighs, its members left out."""
        raws = sum(buffer.raw().nbytes for buffer in self.buffers)
        return len(self.native or b"") + len(self.inband) + raws

    def key(self, tag: bytes) -> Key:
        """A key of the argument's content: its skeleton's bytes and its members' keys.
        ``tag`` tells apart what is stored under it: the skeleton, or the argument whole."""
        parts: list[Buffer] = [self.native or b"", self.inband]
        hasher = BufferHasher(tag).add_all(parts + [buffer.raw() for buffer in self.buffers])
        for member in self.members:
            hasher.hasher.update(member.key)
        for handle in self.handles:
            hasher.hasher.update(_handle_id(handle))
        return hasher.digest()


class Bundled(NamedTuple):
    """Member ``at`` of a bundle: the new members of one argument, stored in one object
    (one put instead of one each: Ray's put costs per object as well as per byte)."""

    ref: Any
    at: int
    nbytes: int  #: what the object store holds for the whole bundle


def bundled_key(key: Key) -> Key:
    """What a member stored in a bundle is cached under; one stored alone is under ``key``."""
    return key + b"/bundled"


class Skeleton:
    """An argument with its large members taken out, stored: what travels instead of it."""

    __slots__ = ("buffers", "handles", "inband", "keeps", "key", "members", "native")

    def __init__(self, split: Split, refs: list[Any]) -> None:
        self.native = split.native
        self.inband = split.inband
        self.buffers = split.buffers
        self.members = refs
        self.handles = split.handles
        #: The stored objects a stored skeleton keeps alive, each once with its bytes: the
        #: members stored alone, and each bundle whole.
        keeps = {r.ref: r.nbytes for r in refs if type(r) is Bundled}
        for member, ref in zip(split.members, refs, strict=True):
            if type(ref) is not Bundled:
                keeps[ref] = member.nbytes
        self.keeps = tuple(keeps.items())
        self.key = split.key(b"skeleton")

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # The small members' buffers travel out of band, as Ray sends them by value: the
        # worker's arrays are then read-only views of Ray's buffers, as by value.
        # Each stored object named once (a bundle holds many members): the worker fetches
        # and deserializes it once, not once per member.
        index: dict[Any, int] = {}
        members = [
            (index.setdefault(m.ref, len(index)), m.at)
            if type(m) is Bundled
            else index.setdefault(m, len(index))
            for m in self.members
        ]
        parts = (self.native, self.inband, list(index), members, self.handles, self.buffers)
        return bootstrap.rebuild_skeleton, parts


def _handle_id(handle: Any) -> bytes:
    binary = getattr(handle, "binary", None)
    if binary is not None:
        return bytes(binary())
    return bytes(handle._actor_id.binary())  # an actor handle


class _Splitter:
    """One pickling pass of an argument that takes its large members out and keys them.

    ``strict`` refuses values holding objects whose pickling runs code of their own (see
    :class:`NotSplittable`) where no reduction showing their members is registered."""

    def __init__(self, key: KeyFn, min_bytes: int, strict: bool = False) -> None:
        self.key = key
        self.min_bytes = min_bytes
        self.strict = strict
        self.kinds = split_order.walk()
        self.members: list[Keyed] = []
        self.handles: list[Any] = []
        self.tensors = False
        self.seen: dict[int, tuple[object, Any]] = {}
        #: ``numpy.ndarray`` while its arrays are leaves sized by their ``nbytes``: the
        #: common member, taken out without a further look.
        ndarray = plain_ndarray()
        leaf = ndarray is not None and self.kinds.rule(ndarray).kind is _LEAF
        self.ndarray = ndarray if leaf else None

    def persistent_id(self, obj: Any) -> Any:
        cls = type(obj)
        if cls in _PASSED:
            return None
        if cls is self.ndarray:  # most members: sized as the size table sizes them
            if obj.dtype.hasobject:
                return None  # an array of Python objects: pickled inline, one by one
            nbytes = obj.nbytes
        else:
            kind = self.kinds.rule(cls).kind
            if kind is _HANDLE:
                return self._take(obj, self.handles, obj, handle=True)
            if kind is not _LEAF or cls in _INLINE or self.kinds.of(obj).kind is not _LEAF:
                return None
            if cls is bytes:  # the padding between a consolidated storage's leaves, say
                nbytes = len(obj)
            elif getattr(getattr(obj, "dtype", None), "hasobject", False):
                return None
            else:
                nbytes = estimate_size(obj)
        entry = self.seen.get(id(obj))
        if entry is not None and entry[0] is obj:
            return entry[1]
        if nbytes < self.min_bytes:
            return None
        keyed = self.key(obj, nbytes)
        if keyed is None:
            return None  # cannot be keyed: left inline, as by value
        self.tensors = self.tensors or self.kinds.rule(cls).entry is tensor_digest
        # An array's dtype stays in the skeleton, next to where the array was: pickled
        # there, it is one object with every other place that names it, as by value.
        dtype = obj.dtype if cls is self.ndarray else None
        return self._take(obj, self.members, keyed, dtype=dtype)

    def reduce(self, obj: Any) -> Any:
        """A reduction of ``obj`` that shows its members, for a type whose pickling hides
        them; ``NotImplemented`` for an object pickle's own reduction sends as Ray's
        pickler would (plain, by trusted code); ``None`` for any other: a class or
        function (cloudpickle's), a leaf (refshare's own forms), one pickled by code of
        its own (refused where ``strict``)."""
        rule = self.kinds.of(obj)
        kind = rule.kind
        if kind is _PLAIN:
            return NotImplemented
        if kind is _READ:
            reduced = rule.entry(obj)
            if reduced is not NotImplemented:
                return reduced
            kind = rule.unread
        if self.strict and (kind is _HOOKED or kind is _OWN_CODE):
            raise NotSplittable(type(obj).__qualname__)  # (see NotSplittable)
        return None

    def _take(
        self, obj: Any, into: list[Any], item: Any, handle: bool = False, dtype: Any = None
    ) -> Any:
        entry = self.seen.get(id(obj))
        if entry is not None and entry[0] is obj:
            return entry[1]
        # An int: pickled as it is, where a tuple would be pickled item by item, each item
        # asked for a persistent id again (an array's dtype, pickled by pickle's memo).
        pid: Any = ~len(into) if handle else len(into)
        if dtype is not None:
            pid = (pid, dtype)
        into.append(item)
        self.seen[id(obj)] = (obj, pid)
        return pid

    def split(self, value: Any) -> Split | None:
        # Before pickling: a reduction naming bootstrap's functions must name them by value
        # in every split, or equal content would pickle, and key, two ways.
        ship_by_value(bootstrap)
        native, pickled = native_split(value)
        stream = io.BytesIO()
        buffers: list[pickle.PickleBuffer] = []
        pickler: Any = pickler_classes()[1](stream, protocol=5, buffer_callback=buffers.append)
        pickler.splitter = self
        pickler.persistent_id = self.persistent_id  # the C pickler calls it for every object
        pickler.dump(pickled)
        if not self.members:
            return None
        return Split(native, stream.getvalue(), buffers, self.members, self.handles, self.tensors)


def split(value: Any, key: KeyFn, min_bytes: int, strict: bool = False) -> Split | None:
    """``value`` pickled with its large members taken out, each keyed with ``key``; ``None``
    if it has no large member (it then goes as a whole, as without deep sharing). Raises
    :class:`NotSplittable` where ``strict`` refuses it."""
    return _Splitter(key, min_bytes, strict).split(value)
