"""A digest of Ray's by-value serialization of a value, for the tests that check keys
against it: equal keys exactly where Ray would send the same bytes.

(Verify mode compares what receivers get, not serializations: see
``refshare._verify.received``. This is the stricter property the keys hold to.)"""

from __future__ import annotations

import functools
import io
import pickle
import sys
from typing import Any

import ray

from refshare._hashing import Buffer, BufferHasher
from refshare._wire.serialized import native_split
from refshare._wire.tensors import pickled_as_storage, storage_bytes


def _array(*description: object) -> None:
    """Stands for an array in a digest; never called."""


def _tensor(*description: object) -> None:
    """Stands for a tensor in a digest; never called."""


def _handle(*description: object) -> None:
    """Stands for an ``ObjectRef`` or an actor handle in a digest; never called."""


def _describe_array(arr: Any) -> tuple[Any, tuple[Any, ...]]:
    """An array as its pickle sends it (dtype, shape, memory order, bytes, read-only), its
    dtype by value."""
    dtype = arr.dtype
    token = pickle.dumps(dtype, protocol=5)
    flags = arr.flags
    order = "F" if flags.f_contiguous and not flags.c_contiguous else "C"
    head = (token, arr.shape, order, flags.writeable)
    if dtype.hasobject:
        return _array, (*head, arr.ravel(order=order).tolist())
    if flags.c_contiguous or flags.f_contiguous:
        return _array, (*head, pickle.PickleBuffer(arr))
    return _array, (*head, arr.tobytes(order="C"))


class _Storage:
    """One tensor's storage: pickle sends each tensor with a storage of its own."""

    __slots__ = ("data",)

    def __init__(self, data: Any) -> None:
        self.data = data

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _array, ("storage", pickle.PickleBuffer(self.data))


@functools.cache
def _describer() -> type[pickle.Pickler]:
    """Ray's pickler, describing arrays and CPU tensors by what their pickling sends but not
    where it lies, and refs and actor handles by their ids."""
    from ray import cloudpickle

    base: type[Any] = cloudpickle.CloudPickler

    class Describer(base):  # type: ignore[misc]
        def reducer_override(self, obj: Any) -> Any:
            cls = type(obj)
            numpy = sys.modules.get("numpy")
            if numpy is not None and cls is numpy.ndarray:
                return _describe_array(obj)
            torch = sys.modules.get("torch")
            if torch is not None and cls is torch.Tensor and pickled_as_storage(obj, True):
                t = obj
                layout = (str(t.dtype), tuple(t.shape), t.stride(), t.storage_offset())
                flags = (t.requires_grad, t.is_conj(), t.is_neg())
                state = getattr(t, "__dict__", None) or None
                return _tensor, (*layout, flags, _Storage(storage_bytes(t)), state)
            if isinstance(obj, ray.ObjectRef):
                return _handle, ("ref", obj.binary())
            if isinstance(obj, ray.actor.ActorHandle):
                return _handle, ("actor", obj._actor_id.binary())
            return super().reducer_override(obj)

    return Describer


def serialized_digest(value: Any) -> bytes:
    """A digest of Ray's serialization of ``value``, as a task argument or a put sends it:
    the msgpack part, then the other objects pickled together by Ray's cloudpickle (its
    registered serializers included), in-band bytes and out-of-band buffers."""
    native, objects = native_split(value)
    stream = io.BytesIO()
    buffers: list[pickle.PickleBuffer] = []
    _describer()(stream, protocol=5, buffer_callback=buffers.append).dump(objects)
    parts: list[Buffer] = [native or b"", stream.getbuffer()]
    parts += [buffer.raw() for buffer in buffers]
    return BufferHasher(b"by value").add_all(parts).digest()
