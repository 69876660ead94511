"""Deep sharing, the driver's side: each large member of an argument is stored once, and the
argument travels as a small skeleton that names them.

The argument is pickled with a ``persistent_id`` that takes out each large array or tensor
(stored and cached by content, as a top-level argument would be) and each object ref or
actor handle (handed to Ray as they are, so Ray tracks their lifetimes). On the worker,
Ray's unpickling of the skeleton runs :func:`refshare._wire.bootstrap.rebuild_skeleton`,
shipped by value: it fetches the members in one batched get and unpickles the rest around
them, so the worker's code receives what it receives by value.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from typing import Any

from ._dispatch import TypeTable
from ._hashing import Buffer, BufferHasher
from ._keys.sizes import estimate_size
from ._keys.tables import leaf_digests
from ._ray.pickling import ship_by_value
from ._wire import bootstrap
from ._wire.serialized import native_split, pickler_classes, ray_handle_types

#: Leaves kept inside the skeleton, whatever their size: stored on their own, they would go
#: through Ray's msgpack, where a ``bytearray`` or a ``memoryview`` arrives as ``bytes``.
_INLINE = frozenset((str, bytearray, memoryview))
#: Stores a member by content and returns its ref, or ``None`` to leave it inline.
StoreFn = Callable[[Any, int], Any]
#: Types whose pickling hides their members from ``persistent_id`` (verl's ``DataProto``
#: ``torch.save``s its batch), each with a reduction that shows them.
deep_reducers: TypeTable[Callable[[Any], Any]] = TypeTable()


class Skeleton:
    """An argument with its large members taken out: what travels instead of it."""

    __slots__ = (
        "buffers",
        "handles",
        "inband",
        "key",
        "members",
        "members_nbytes",
        "native",
        "nbytes",
    )

    def __init__(
        self,
        native: bytes | None,
        inband: bytes,
        buffers: list[pickle.PickleBuffer],
        members: list[Any],
        handles: list[Any],
        members_nbytes: int,
    ) -> None:
        self.native = native
        self.inband = inband
        self.buffers = buffers
        self.members = members
        self.handles = handles
        #: What the members weigh: a stored skeleton keeps them alive.
        self.members_nbytes = members_nbytes
        raws = [buffer.raw() for buffer in buffers]
        self.nbytes = len(native or b"") + len(inband) + sum(raw.nbytes for raw in raws)
        parts: list[Buffer] = [native or b"", inband, *raws]
        hasher = BufferHasher(b"skeleton").add_all(parts)
        for ref in members:
            hasher.hasher.update(ref.binary())
        for handle in handles:
            hasher.hasher.update(_handle_id(handle))
        self.key = hasher.digest()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # The small members' buffers travel out of band, as Ray sends them by value: the
        # worker's arrays are then read-only views of Ray's buffers, as by value.
        parts = (self.native, self.inband, self.members, self.handles, self.buffers)
        return bootstrap.rebuild_skeleton, parts


def _handle_id(handle: Any) -> bytes:
    binary = getattr(handle, "binary", None)
    if binary is not None:
        return bytes(binary())
    return bytes(handle._actor_id.binary())  # an actor handle


class _Splitter:
    """One pickling pass of an argument that takes its large members out."""

    def __init__(self, store: StoreFn, min_bytes: int) -> None:
        self.store = store
        self.min_bytes = min_bytes
        self.handle_types = ray_handle_types()
        self.members: list[Any] = []
        self.members_nbytes = 0
        self.handles: list[Any] = []
        self.seen: dict[int, tuple[object, Any]] = {}

    def persistent_id(self, obj: Any) -> Any:
        cls = type(obj)
        if isinstance(obj, self.handle_types):
            return self._take(obj, "h", self.handles, obj)
        if leaf_digests.exact(cls) is None or cls in _INLINE:
            return None
        if getattr(getattr(obj, "dtype", None), "hasobject", False):
            return None  # an array of Python objects: pickled inline, element by element
        entry = self.seen.get(id(obj))
        if entry is not None and entry[0] is obj:
            return entry[1]
        nbytes = estimate_size(obj)
        if nbytes < self.min_bytes:
            return None
        ref = self.store(obj, nbytes)
        if ref is None:
            return None
        self.members_nbytes += nbytes
        return self._take(obj, "m", self.members, ref)

    def reduce(self, obj: Any) -> Any:
        """A reduction of ``obj`` that shows its members, for a type whose pickling hides
        them; ``None`` for any other."""
        reduce = deep_reducers.lookup(type(obj))
        return None if reduce is None else reduce(obj)

    def _take(self, obj: Any, kind: str, into: list[Any], item: Any) -> Any:
        entry = self.seen.get(id(obj))
        if entry is not None and entry[0] is obj:
            return entry[1]
        pid = (kind, len(into))
        into.append(item)
        self.seen[id(obj)] = (obj, pid)
        return pid

    def split(self, value: Any) -> Skeleton | None:
        native, pickled = native_split(value)
        stream = io.BytesIO()
        buffers: list[pickle.PickleBuffer] = []
        pickler: Any = pickler_classes()[1](stream, protocol=5, buffer_callback=buffers.append)
        pickler.splitter = self
        pickler.dump(pickled)
        if not self.members:
            return None
        ship_by_value(bootstrap)
        return Skeleton(
            native, stream.getvalue(), buffers, self.members, self.handles, self.members_nbytes
        )


def split(value: Any, store: StoreFn, min_bytes: int) -> Skeleton | None:
    """The skeleton of ``value``, its large members stored with ``store``; ``None`` if it
    has no large member (it then goes as a whole, as without deep sharing)."""
    return _Splitter(store, min_bytes).split(value)
