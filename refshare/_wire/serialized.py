"""A value's own pickle: serialized once, as Ray would, so that keying and storing share it.

A value whose pickling runs code of its own (a ``__getstate__`` that ``torch.save``s, say)
costs as much to key through pickling as to send. For such values refshare pickles once
with Ray's own pickler (so Ray's registered serializers apply), hashes the in-band bytes
and out-of-band buffers where they lie, and on a miss puts that very pickle: Ray stores it
as two buffers, and the worker's unpickling of the argument rebuilds the value with
``pickle.loads``, so what the worker receives is what Ray by value gives it. Plain CPU
tensors inside go as their bytes (see ``tensors``), and arrays of strings joined (see
``strings``), so the pickle costs one copy of them.

A container holding tensors, keyed without serializing it, is pickled this way on a miss
(see :class:`PickleOnPut`): one copy of its tensors instead of the three torch's pickling
makes.
"""

from __future__ import annotations

import array
import functools
import io
import logging
import pickle
import threading
from typing import Any

from .._hashing import Buffer, BufferHasher
from .._ray.pickling import ship_by_value
from . import bootstrap
from .arrays import array_bytes
from .strings import strings_form
from .tensors import TensorElements, bytes_form, storable_as_bytes, tensor_form

logger = logging.getLogger("refshare")


class HoldsRayHandles(Exception):
    """The value holds object refs or actor handles: Ray tracks their lifetimes through its
    own serialization of the task, so refshare never stores such a value itself."""


@functools.cache
def ray_handle_types() -> tuple[type, ...]:
    """Object refs and actor handles."""
    import ray

    return ray.ObjectRef, ray.actor.ActorHandle


def own_form(obj: Any) -> Any:
    """What refshare stores for ``obj`` where it has a cheaper form than Ray's pickling: a
    plain CPU tensor as its bytes, an array of strings joined; else ``None``."""
    return tensor_form(obj) or strings_form(obj)


def native_split(value: Any) -> tuple[bytes | None, Any]:
    """Ray's own first step in serializing ``value``: the part msgpack carries (exact dicts
    and lists, strings, bytes, numbers, copied wherever they occur; a ``bytearray`` arrives
    as ``bytes``), and the list of every other object met, which Ray pickles in one go.
    Returns ``(None, value)`` for a value that is itself such an object."""
    if type(value) is not dict and type(value) is not list:
        return None, value
    from ray._private.serialization import MessagePackSerializer  # type: ignore[attr-defined]

    objects: list[Any] = []

    def collect(obj: Any) -> int:
        objects.append(obj)
        return len(objects) - 1

    return MessagePackSerializer.dumps(value, collect), objects


class Serialized:
    """A value pickled once, as Ray would: its key, its size, and what ``ray.put`` stores.

    Pickling a ``Serialized`` sends the pickle as out-of-band buffers (no copy on the
    driver); unpickling it returns the original value: ``pickle.loads``, and for an exact
    dict or list, Ray's own msgpack around it (see :func:`native_split`).
    """

    __slots__ = ("buffers", "inband", "key", "native", "nbytes")

    def __init__(
        self,
        native: bytes | None,
        inband: bytes,
        buffers: list[pickle.PickleBuffer],
        keyed: bool,
    ) -> None:
        self.native = native
        self.inband = inband
        self.buffers = buffers
        raws = [buffer.raw() for buffer in buffers]
        self.nbytes = len(native or b"") + len(inband) + sum(raw.nbytes for raw in raws)
        #: Empty for a pickle made to be put, not looked up (see ``refshare._admission``).
        parts: list[Buffer] = [native or b"", inband, *raws]
        self.key = BufferHasher(b"serialized").add_all(parts).digest() if keyed else b""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        if self.native is None:
            loads = functools.partial(pickle.loads, buffers=self.buffers)
            return loads, (pickle.PickleBuffer(self.inband),)
        ship_by_value(bootstrap)
        inband = pickle.PickleBuffer(self.inband)
        return bootstrap.rebuild_native, (self.native, inband, self.buffers)


@functools.cache
def pickler_classes() -> tuple[type[pickle.Pickler], type[pickle.Pickler]]:
    """Ray's cloudpickle pickler, as refshare pickles with it: one that stores tensors and
    strings in refshare's own forms and refuses what only Ray may serialize, and one that a
    deep-sharing splitter asks which members to take out (see ``refshare._deep``)."""
    from ray import cloudpickle

    refused = ray_handle_types()
    base: type[Any] = cloudpickle.CloudPickler

    class RayPickler(base):  # type: ignore[misc]
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, refused):
                raise HoldsRayHandles(type(obj).__qualname__)
            form = own_form(obj)
            if form is not None:
                return form.__reduce__()
            return super().reducer_override(obj)

    class SplitPickler(base):  # type: ignore[misc]
        """Holds no splitter of its own between dumps: a class per split would form a
        cycle with it, keeping its members' refs alive until the cycle collector ran."""

        splitter: Any

        def reducer_override(self, obj: Any) -> Any:
            reduced = self.splitter.reduce(obj)
            if reduced is not None:  # NotImplemented included: pickled as pickle does
                return reduced
            form = own_form(obj)  # a small tensor, left inside the skeleton: as its bytes
            if form is not None:
                return form.__reduce__()
            return super().reducer_override(obj)

    return RayPickler, SplitPickler


def _dumps(pickler_class: type[pickle.Pickler], value: Any, keyed: bool = True) -> Serialized:
    ship_by_value(bootstrap)  # before pickling: the forms name its functions, by value
    native, pickled = native_split(value)
    buffers: list[pickle.PickleBuffer] = []
    stream = io.BytesIO()
    pickler_class(stream, protocol=5, buffer_callback=buffers.append).dump(pickled)
    return Serialized(native, stream.getvalue(), buffers, keyed)


class _Probe:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def __getstate__(self) -> dict[str, Any]:
        return {"data": self.data}


_state_lock = threading.Lock()
_pickler_class: type[pickle.Pickler] | None = None
_checked = False


def available() -> bool:
    """Whether Ray's pickler is what refshare expects; checked once, warns if it is not.

    Without it, values that run their own pickling code are fingerprinted by a pickling
    pass of their own and then serialized again by ``ray.put``: correct, but twice the work.
    """
    global _pickler_class, _checked
    if _checked:
        return _pickler_class is not None
    with _state_lock:
        if not _checked:
            try:
                pickler_class = _make_pickler_class()
                probe = _dumps(pickler_class, _Probe(b"refshare" * 64))
                back = pickle.loads(pickle.dumps(probe, protocol=5))
                if not (isinstance(back, _Probe) and back.data == b"refshare" * 64):
                    raise TypeError("a pickle made by Ray's pickler did not load back")
                _pickler_class = pickler_class
            except Exception as error:
                import ray

                logger.warning(
                    "Ray %s's pickler is not what refshare expects (%s): values with "
                    "their own pickling code are serialized twice on first sight",
                    getattr(ray, "__version__", "?"),
                    error,
                )
            _checked = True
    return _pickler_class is not None


def _make_pickler_class() -> type[pickle.Pickler]:
    return pickler_classes()[0]


def serialize(value: Any, keyed: bool = True) -> Serialized:
    """Pickle ``value`` as Ray would, once, and key it unless ``keyed`` is false; raises
    :class:`HoldsRayHandles` for refs inside.

    Call only after :func:`available` returned True.
    """
    assert _pickler_class is not None
    return _dumps(_pickler_class, value, keyed)


class PickleOnPut:
    """A value holding tensors, keyed without serializing it: on a miss refshare pickles it
    with Ray's pickler and its tensors as their bytes, one copy of them instead of the
    three torch's pickling makes."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def put_as_bytes(stored: Any) -> bool:
    """Whether ``stored`` is put with its tensors as their bytes: a tensor (see
    :func:`tensor_form`), a tensor's elements taken out of a batch that pickles them through
    ``torch.save`` (see ``TensorElements``), or a value holding tensors (see
    :class:`PickleOnPut`)."""
    if type(stored) is TensorElements:
        return storable_as_bytes(stored.tensor)
    return type(stored) is PickleOnPut or storable_as_bytes(stored)


def stored_whole(value: Any, *, tensors: bool, pickled: Serialized | None = None) -> Any:
    """What to put for ``value`` stored whole (see :func:`stored_form`): the pickle it was
    keyed by, if it had to be pickled to be keyed; else, where it may hold tensors that
    torch's pickling would send (``tensors``), the value pickled on put by refshare, its
    tensors as their bytes; else the value as it is, for Ray to serialize."""
    if pickled is not None:
        return pickled
    return PickleOnPut(value) if tensors else value


#: Pieces of a bundle under this many bytes are joined into one buffer, larger ones kept as
#: out-of-band buffers of their own, copied once: Ray costs about as much per buffer (5 us
#: to put, 2 us for each reader to get) as a copy of 16 KiB, and a worker's get of a bundle
#: is then linear in its large pieces only, at most one per 16 KiB of it.
JOIN_BELOW = 16 << 10
#: Padding that aligns a joined piece as Ray aligns an out-of-band buffer.
_ZEROS = bytes(64)


class _Bundle:
    """The members of a bundle laid out for ``bootstrap.unbundled``: an index of int64
    words (the member count, where each member's entry starts, the entries), the small
    pieces joined, and the large ones."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.entries: list[int] = []
        self.small: list[Any] = []
        self.joined = 0
        self.large: list[pickle.PickleBuffer] = []

    def piece(self, data: Any) -> tuple[int, int, int]:
        """Where ``data``'s bytes lie: ``(-1, start, stop)`` in the joined buffer, at an
        offset aligned as Ray aligns a buffer of its size (64 bytes from 2 KiB, else 8), so
        that an array on it is aligned as by value; ``(i, 0, nbytes)`` for large piece i."""
        raw = pickle.PickleBuffer(data).raw()
        nbytes = raw.nbytes
        if nbytes >= JOIN_BELOW:
            self.large.append(pickle.PickleBuffer(raw))
            return len(self.large) - 1, 0, nbytes
        pad = -self.joined % (64 if nbytes >= 2048 else 8)
        if pad:
            self.small.append(_ZEROS[:pad])
        start = self.joined + pad
        self.small.append(raw)
        self.joined = start + nbytes
        return -1, start, self.joined

    def add(self, kind: int, pieces: list[Any], words: tuple[int, ...] = ()) -> None:
        """A member of ``kind`` from its ``pieces``, and for an array its layout ``words``
        (whether in F order, whether copied, ndim and shape)."""
        self.starts.append(len(self.entries))
        self.entries += (kind, len(pieces))
        for data in pieces:
            self.entries += self.piece(data)
        self.entries += words

    def form(self) -> tuple[Any, ...]:
        """What ``ray.put`` stores: ``(index, joined, large)``, each out of band."""
        head = 1 + len(self.starts)
        index = array.array("q", [len(self.starts), *(head + at for at in self.starts)])
        index.extend(self.entries)
        joined = b"".join(self.small)
        return pickle.PickleBuffer(index), pickle.PickleBuffer(joined), self.large


def bundle_form(members: list[Any]) -> tuple[Any, ...] | None:
    """Several members of a deep-shared argument as one object to store, laid out so that a
    worker deserializes it in time independent of its members and rebuilds only those its
    skeleton names (see ``bootstrap.rebuild_skeleton``): each member as Ray would pickle it
    alone (its tensors as their bytes), in pieces (its in-band pickle, its buffers), the
    small pieces joined into one buffer, the large ones kept apart (see
    :data:`JOIN_BELOW`). A plain array is sent as numpy's pickling sends it, its order,
    shape and bytes, on the dtype its skeleton names (``_deep``); a plain tensor as
    torch's reduction with its storage's bytes. ``None`` where one cannot be pickled so."""
    if not available():
        return None
    bundle = _Bundle()
    for stored in members:
        found = array_bytes(stored)
        if found is not None:
            order, copied, data = found
            layout = (order == "F", copied, stored.ndim, *stored.shape)
            bundle.add(bootstrap.ARRAY, [data], layout)
            continue
        form = bytes_form(stored)
        if form is not None:  # torch's reduction of it, less its storage's pieces
            rebuild, pieces, *args = form.args
            bundle.add(bootstrap.TENSOR, [pickle.dumps((rebuild, *args), protocol=5), *pieces])
            continue
        pickled = stored if isinstance(stored, Serialized) else None
        try:
            if pickled is None:
                value = stored.value if isinstance(stored, PickleOnPut) else stored
                pickled = serialize(value, keyed=False)
        except Exception:
            logger.debug("cannot bundle %s", type(stored).__qualname__, exc_info=True)
            return None
        if pickled.native is not None:
            return None  # (a member is an array or a tensor: never a dict or a list)
        bundle.add(bootstrap.PICKLE, [pickled.inband, *pickled.buffers])
    return bundle.form()


class Bundle:
    """New members of one split value, to be stored together (see :func:`bundle_form`)."""

    __slots__ = ("members",)

    def __init__(self, members: list[Any]) -> None:
        self.members = members


class _Counted:
    """A write-only file that counts what a pickler writes, and keeps nothing."""

    __slots__ = ("nbytes",)

    def __init__(self) -> None:
        self.nbytes = 0

    def write(self, data: Any) -> int:
        self.nbytes += len(data)
        return len(data)


#: What Ray's object store adds to an object, over its msgpack and pickle parts: the object's
#: header and metadata, and per out-of-band buffer, its entry and alignment (measured on Ray
#: 2.40 to 2.60: within a few hundred bytes of what ``ray.put`` stores, whatever the form).
OBJECT_FRAMING = 64
BUFFER_FRAMING = 24


def stored_size(form: Any) -> int:
    """The bytes the object store would hold for ``form`` put now, worked out by pickling it
    as Ray would, into a counter: its buffers are measured where they lie, never copied.
    For refshare's own forms and values keyed without pickling code of their own only: their
    pickling runs no code of the program's."""
    from ray import cloudpickle

    native, objects = native_split(form)
    counted, buffers = _Counted(), list[pickle.PickleBuffer]()
    pickler: Any = cloudpickle.CloudPickler
    pickler(counted, protocol=5, buffer_callback=buffers.append).dump(objects)
    raws = [-(-buffer.raw().nbytes // 8) * 8 for buffer in buffers]
    return (
        len(native or b"")
        + counted.nbytes
        + sum(raws)
        + BUFFER_FRAMING * len(raws)
        + OBJECT_FRAMING
    )


def stored_form(stored: Any) -> Any:
    """What ``ray.put`` stores for ``stored``: a plain CPU tensor as its storage's bytes, an
    array of strings joined, a value holding tensors as refshare's own pickle of it, a
    :class:`Bundle` as :func:`bundle_form` (``ValueError`` where it cannot be made),
    anything else as it is."""
    if isinstance(stored, Bundle):
        form = bundle_form(stored.members)
        if form is None:
            raise ValueError("these members cannot be stored together")
        return form
    if isinstance(stored, PickleOnPut):
        if not available():
            return stored.value
        try:
            return serialize(stored.value, keyed=False)  # its key is known
        except Exception:
            logger.debug("cannot pickle %s itself", type(stored.value).__qualname__, exc_info=True)
            return stored.value  # Ray's own serialization, and its own error if any
    form = own_form(stored)
    return stored if form is None else form
