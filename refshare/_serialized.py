"""Serialize a value once, as Ray would, so that its fingerprint and its put share that pass.

A value whose pickling runs code of its own (a ``__getstate__`` that ``torch.save``s, say)
costs as much to fingerprint through pickling as to send. For such values refshare pickles
once with Ray's own pickler (so Ray's registered serializers apply), hashes the in-band
bytes and out-of-band buffers where they lie, and on a miss puts that very pickle: Ray
stores it as two buffers, and the worker's unpickling of the argument rebuilds the value
with ``pickle.loads``, so what the worker receives is what Ray by value gives it. Plain CPU
tensors inside go as their bytes (see ``_tensors``), so the pickle costs one copy of them,
and arrays of strings as one joined string (see ``_strings``).

A container holding tensors, keyed without serializing it, is pickled this way on a miss
too (see ``Scope.put_new``): it is then one copy of its tensors instead of torch's three.
"""

from __future__ import annotations

import functools
import io
import logging
import pickle
import threading
from typing import Any

import xxhash

from ._hashing import SEED, digest_buffer
from ._strings import strings_form
from ._tensors import tensor_form

logger = logging.getLogger("refshare")


class HoldsRayHandles(Exception):
    """The value holds object refs or actor handles: only Ray's own serialization may
    pickle those, since it tracks their lifetimes."""


class Serialized:
    """A value pickled once: its key, its size, and the pickle that ``ray.put`` stores.

    Pickling a ``Serialized`` sends the pickle as out-of-band buffers (no copy on the
    driver); unpickling it returns the original value, rebuilt by ``pickle.loads``.
    """

    __slots__ = ("buffers", "inband", "key", "nbytes")

    def __init__(self, inband: bytes, buffers: list[pickle.PickleBuffer], keyed: bool) -> None:
        self.inband = inband
        self.buffers = buffers
        raws = [buffer.raw() for buffer in buffers]
        self.nbytes = len(inband) + sum(raw.nbytes for raw in raws)
        self.key = b""
        if not keyed:
            return  # to be put, not looked up (see ``_admission``)
        hasher = xxhash.xxh3_128(b"serialized", SEED)
        hasher.update(len(inband).to_bytes(8, "little"))
        hasher.update(digest_buffer(inband))
        for raw in raws:
            hasher.update(raw.nbytes.to_bytes(8, "little"))
            hasher.update(digest_buffer(raw))
        self.key = hasher.digest()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        loads = functools.partial(pickle.loads, buffers=self.buffers)
        return loads, (pickle.PickleBuffer(self.inband),)


_pickler_class: type[pickle.Pickler] | None = None
_state_lock = threading.Lock()
_checked = False


@functools.cache
def ray_handle_types() -> tuple[type, ...]:
    """Object refs and actor handles: Ray tracks their lifetimes through its own
    serialization, so refshare never stores a value holding one."""
    import ray

    return ray.ObjectRef, ray.actor.ActorHandle


def _make_pickler_class() -> type[pickle.Pickler]:
    """Ray's cloudpickle pickler, refusing what only Ray's serialization may handle."""
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

    return RayPickler


def own_form(obj: Any) -> Any:
    """What refshare stores for ``obj`` where it has a cheaper form than Ray's pickling: a
    plain CPU tensor as its bytes, an array of strings joined; else ``None``."""
    return tensor_form(obj) or strings_form(obj)


def _dumps(pickler_class: type[pickle.Pickler], value: Any, keyed: bool = True) -> Serialized:
    buffers: list[pickle.PickleBuffer] = []
    stream = io.BytesIO()
    pickler_class(stream, protocol=5, buffer_callback=buffers.append).dump(value)
    return Serialized(stream.getvalue(), buffers, keyed)


class _Probe:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def __getstate__(self) -> dict[str, Any]:
        return {"data": self.data}


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


def serialize(value: Any, keyed: bool = True) -> Serialized:
    """Pickle ``value`` as Ray would, once, and key it unless ``keyed`` is false; raises
    :class:`HoldsRayHandles` for refs inside.

    Call only after :func:`available` returned True.
    """
    assert _pickler_class is not None
    return _dumps(_pickler_class, value, keyed)
