"""Deep sharing: each large member of an argument is stored once, and the argument travels
as a small skeleton that names them.

On the driver, the argument is pickled with a ``persistent_id`` that takes out each large
array or tensor (stored and cached by content, as a top-level argument would be) and each
object ref or actor handle (handed to Ray as they are, so Ray tracks their lifetimes).
On the worker, Ray's unpickling of the skeleton fetches the members in one batched get and
unpickles the rest around them: the worker's code receives what it receives by value.
"""

from __future__ import annotations

import functools
import io
import logging
import pickle
from collections.abc import Callable
from typing import Any

import xxhash

from . import _bootstrap, _tensors
from ._dispatch import TypeTable
from ._fingerprint import _leaf_digests
from ._hashing import SEED, digest_buffer
from ._sizing import estimate_size

logger = logging.getLogger("refshare")

#: Stores a member by content and returns its ref, or ``None`` to leave it inline.
StoreFn = Callable[[Any, int], Any]
#: Types whose pickling hides their members from ``persistent_id`` (verl's ``DataProto``
#: ``torch.save``s its batch), each with a reduction that shows them (see ``_batches``).
deep_reducers: TypeTable[Callable[[Any], Any]] = TypeTable()


class Skeleton:
    """An argument with its large members taken out: what travels instead of it."""

    __slots__ = ("buffers", "handles", "inband", "key", "members", "members_nbytes", "nbytes")

    def __init__(
        self,
        inband: bytes,
        buffers: list[pickle.PickleBuffer],
        members: list[Any],
        handles: list[Any],
        members_nbytes: int,
    ) -> None:
        self.inband = inband
        self.buffers = buffers
        self.members = members
        self.handles = handles
        #: What the members weigh: a stored skeleton keeps them alive.
        self.members_nbytes = members_nbytes
        hasher = xxhash.xxh3_128(b"skeleton", SEED)
        hasher.update(digest_buffer(inband))
        self.nbytes = len(inband)
        for buffer in buffers:
            raw = buffer.raw()
            self.nbytes += raw.nbytes
            hasher.update(raw.nbytes.to_bytes(8, "little"))
            hasher.update(digest_buffer(raw))
        for ref in members:
            hasher.update(ref.binary())
        for handle in handles:
            hasher.update(_handle_id(handle))
        self.key = hasher.digest()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # The small members' buffers travel out of band, as Ray sends them by value: the
        # worker's arrays are then read-only views of Ray's buffers, as by value.
        return _bootstrap.rebuild, (self.inband, self.members, self.handles, self.buffers)


def _handle_id(handle: Any) -> bytes:
    binary = getattr(handle, "binary", None)
    if binary is not None:
        return bytes(binary())
    return bytes(handle._actor_id.binary())  # an actor handle


class _Splitter:
    """One pickling pass of an argument that takes its large members out."""

    def __init__(self, store: StoreFn, min_bytes: int) -> None:
        import ray

        self.store = store
        self.min_bytes = min_bytes
        self.handle_types = (ray.ObjectRef, ray.actor.ActorHandle)
        self.members: list[Any] = []
        self.members_nbytes = 0
        self.handles: list[Any] = []
        self.seen: dict[int, tuple[object, Any]] = {}

    def persistent_id(self, obj: Any) -> Any:
        cls = type(obj)
        if isinstance(obj, self.handle_types):
            return self._take(obj, "h", self.handles, obj)
        if _leaf_digests.exact(cls) is None or cls is str:
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

    def _take(self, obj: Any, kind: str, into: list[Any], item: Any) -> Any:
        entry = self.seen.get(id(obj))
        if entry is not None and entry[0] is obj:
            return entry[1]
        pid = (kind, len(into))
        into.append(item)
        self.seen[id(obj)] = (obj, pid)
        return pid

    def split(self, value: Any) -> Skeleton | None:
        stream = io.BytesIO()
        buffers: list[pickle.PickleBuffer] = []
        pickler = _pickler_class()(stream, protocol=5, buffer_callback=buffers.append)
        pickler.splitter = self
        pickler.dump(value)
        if not self.members:
            return None
        return Skeleton(
            stream.getvalue(), buffers, self.members, self.handles, self.members_nbytes
        )


@functools.cache
def _pickler_class() -> Any:
    """Ray's cloudpickle pickler, asking a ``_Splitter`` which objects to take out.

    One class for every split, holding no splitter: a class made per split would form a
    cycle with it, and keep its members' refs (and their store memory) alive until Python's
    cycle collector ran."""
    from ray import cloudpickle

    class SplitPickler(cloudpickle.CloudPickler):
        splitter: _Splitter

        def persistent_id(self, obj: Any) -> Any:
            return self.splitter.persistent_id(obj)

        def reducer_override(self, obj: Any) -> Any:
            reduce = deep_reducers.lookup(type(obj))
            if reduce is not None:
                return reduce(obj)
            return super().reducer_override(obj)  # type: ignore[no-untyped-call]

    return SplitPickler


def split(value: Any, store: StoreFn, min_bytes: int) -> Skeleton | None:
    """The skeleton of ``value``, its large members stored with ``store``; ``None`` if it
    has no large member (it then goes as a whole, as without ``deep``)."""
    return _Splitter(store, min_bytes).split(value)


class _Unpickler(pickle.Unpickler):
    def __init__(
        self, inband: bytes, members: list[Any], handles: list[Any], buffers: list[Any]
    ) -> None:
        super().__init__(io.BytesIO(inband), buffers=buffers)
        self.members = members
        self.handles = handles

    def persistent_load(self, pid: Any) -> Any:
        kind, index = pid
        return self.members[index] if kind == "m" else self.handles[index]


def rebuild_skeleton(inband: bytes, refs: list[Any], handles: list[Any], buffers: list[Any]) -> Any:
    """On the worker: fetch every member in one batched get, then unpickle around them."""
    return _Unpickler(inband, _fetch(refs), handles, buffers).load()


def _fetch(refs: list[Any]) -> list[Any]:
    """``ray.get`` of the members, without the warning Ray gives a blocking get in an async
    actor: this get runs while Ray unpickles the task's arguments, before the method."""
    import ray
    from ray._private import worker

    warned = getattr(worker, "blocking_get_inside_async_warned", None)
    if warned is not None:
        worker.blocking_get_inside_async_warned = True
    try:
        return list(ray.get(list(refs)))
    finally:
        if warned is not None:
            worker.blocking_get_inside_async_warned = warned


_announced = False


def ship_bootstrap_by_value() -> None:
    """Have Ray's cloudpickle send ``_bootstrap`` as code, and say once what deep sharing
    needs of the workers."""
    global _announced
    _tensors.ship_bootstrap_by_value()
    if not _announced:
        _announced = True
        logger.info(
            "deep sharing is on: workers rebuild deep-shared arguments with refshare, which "
            "must be importable where they run (else they fail saying so; deep=False avoids it)"
        )
