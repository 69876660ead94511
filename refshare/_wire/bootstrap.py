"""The code a worker runs to rebuild what refshare stored; Ray ships it by value.

Ray's cloudpickle sends this module's functions as code, so a worker without refshare
still runs them. Each gives the worker exactly what Ray's own unpickling of the value would
have: keep this module free of imports from refshare.
"""

from __future__ import annotations

import hashlib
import io
import marshal
import pickle
from typing import Any, Literal


def rebuild_tensor(
    data: Any, dtype: Any, offset: int, size: Any, stride: Any, requires_grad: bool
) -> Any:
    """A CPU tensor from its storage's bytes, as torch's own unpickling would give it: on a
    writable storage of its own, with the same offset, size, stride and requires_grad, and
    the empty ``_backward_hooks`` torch's pickle sends in place of any hooks."""
    import collections
    import ctypes

    import numpy as np
    import torch

    source = np.frombuffer(data, dtype=np.uint8)
    storage = torch.empty(source.size, dtype=torch.uint8)
    if source.size:  # copied by address: through .numpy() torch could no longer resize it
        ctypes.memmove(storage.data_ptr(), source.ctypes.data, source.size)
    tensor = torch.empty(0, dtype=dtype).set_(storage.untyped_storage(), offset, size, stride)
    tensor._backward_hooks = collections.OrderedDict()
    return tensor.requires_grad_() if requires_grad else tensor


def rebuild_strings(text: str, shape: Any, order: Literal["C", "F"], index: Any = None) -> Any:
    """An array of strings from their NUL-joined text, as numpy's unpickling would give it:
    a writable array of its own, of the same shape and memory order. With ``index``, the
    text holds each distinct string object once and ``index`` says which fills each element
    (in ``order``): those elements are one object, as pickle's memo makes them."""
    import numpy as np

    out = np.empty(shape, dtype=object, order=order)
    flat = out.reshape(-1, order=order)  # a view: filling it fills ``out``
    strings = text.split("\0")
    if index is None:
        flat[:] = strings
    else:
        distinct = np.empty(len(strings), dtype=object)
        distinct[:] = strings
        np.take(distinct, index, out=flat, mode="clip")  # copies references: repeats alias
    return out


def _around(native: bytes | None, objects: Any) -> Any:
    """The value Ray's own deserialization rebuilds: for an exact dict or list, its msgpack
    around the objects pickled beside it (see ``refshare._wire.serialized.native_split``)."""
    if native is None:
        return objects
    from ray._private.serialization import MessagePackSerializer  # type: ignore[attr-defined]

    return MessagePackSerializer.loads(native, objects.__getitem__)


def rebuild_native(native: bytes, inband: Any, buffers: list[Any]) -> Any:
    """An exact dict or list refshare pickled itself, as Ray's own unpickling gives it."""
    return _around(native, pickle.loads(inband, buffers=buffers))


class _SkeletonUnpickler(pickle.Unpickler):
    """Unpickles a skeleton, putting each member and handle back where it was taken out."""

    def __init__(
        self, inband: bytes, members: list[Any], handles: list[Any], buffers: list[Any]
    ) -> None:
        super().__init__(io.BytesIO(inband), buffers=buffers)
        self.members = members
        self.handles = handles

    def persistent_load(self, pid: int) -> Any:
        return self.members[pid] if pid >= 0 else self.handles[~pid]


def rebuild_skeleton(
    native: bytes | None,
    inband: bytes,
    objects: list[Any],
    members: list[Any],
    handles: list[Any],
    buffers: list[Any],
) -> Any:
    """A deep-shared argument: every stored object it names fetched once, in one batched
    get, then the rest unpickled around its members, as by value would unpickle the whole.

    ``objects`` names each stored object once. A member is ``i``, the ``i``-th object, or
    ``(i, at)``, the ``at``-th of several members stored in that object, each as its pickle
    and buffers (see ``refshare._wire.serialized.bundle_form``), of which only those named
    are unpickled: linear in the members, however many share one object. Each place a
    member fills gets an object of its own, as by value, where equal values that refshare
    stored once arrive as distinct objects."""
    import ray
    from ray._private import worker

    again = [i for i, seen in _repeats(members, len(objects)) if seen]
    # This get runs while Ray unpickles the task's arguments, before the method: an async
    # actor has no event loop to block, so Ray's warning about a blocking get does not apply.
    warned = getattr(worker, "blocking_get_inside_async_warned", None)
    if warned is not None:
        worker.blocking_get_inside_async_warned = True
    try:
        got = ray.get([*objects, *(objects[members[i]] for i in again)])
    finally:
        if warned is not None:
            worker.blocking_get_inside_async_warned = warned
    repeated = dict(zip(again, got[len(objects) :], strict=True))
    values = [
        _unbundled(*got[member[0]][member[1]])
        if type(member) is tuple
        else repeated.get(place, got[member])
        for place, member in enumerate(members)
    ]
    return _around(native, _SkeletonUnpickler(inband, values, handles, buffers).load())


def _repeats(members: list[Any], count: int) -> list[tuple[int, bool]]:
    """Each place of a member stored alone, and whether an earlier place named its object:
    fetched again, so that it arrives as an object of its own."""
    seen = [False] * count
    places = []
    for place, member in enumerate(members):
        if type(member) is not tuple:
            places.append((place, seen[member]))
            seen[member] = True
    return places


def _unbundled(*part: Any) -> Any:
    """One member of a bundle, as Ray's unpickling of it alone would give it: its pickle
    ``(inband, buffers)``, or an array's ``(dtype, shape, order, data)``."""
    if len(part) == 2:
        return pickle.loads(part[0], buffers=part[1])
    return rebuild_array(*part)


def rebuild_array(dtype: Any, shape: Any, order: Literal["C", "F"], data: Any) -> Any:
    """An array as numpy's protocol-5 unpickling makes it (``numpy._core.numeric.
    _frombuffer``): a view of the buffer, read-only where the buffer is."""
    import numpy as np

    return np.frombuffer(data, dtype=dtype).reshape(shape, order=order)


class _TensorsKept(pickle.Pickler):
    """Pickles all but tensors and storages, which it keeps as they are."""

    def __init__(self, stream: io.BytesIO, kept: list[Any]) -> None:
        super().__init__(stream, protocol=pickle.HIGHEST_PROTOCOL)
        self.kept = kept

    def persistent_id(self, obj: Any) -> int | None:
        import torch

        if isinstance(obj, torch.Tensor | torch.UntypedStorage | torch.TypedStorage):
            self.kept.append(obj)
            return len(self.kept) - 1
        return None


def _as_loaded(batch: Any) -> Any:
    """``batch`` as ``torch.load`` gives it back, its tensors aside: all else (its keys,
    names, metadata) new objects, shared with nothing outside it. By value a batch travels
    as ``torch.save``'s bytes, a pickle of its own; rebuilt from a skeleton, its keys would
    be the very strings that other parts of the skeleton name."""
    stream = io.BytesIO()
    kept: list[Any] = []
    _TensorsKept(stream, kept).dump(batch)
    return _SkeletonUnpickler(stream.getvalue(), kept, [], []).load()


def code_digest(hook: Any) -> bytes | None:
    """What tells a class's hook on the worker from the one the driver read: a digest of
    its code (where it was defined left out), ``None`` for a hook that is not Python's."""
    code = getattr(getattr(hook, "__func__", hook), "__code__", None)
    if code is None:
        return None
    return hashlib.blake2b(marshal.dumps(code.replace(co_filename="")), digest_size=16).digest()


def _runs_as_read(cls: Any, setstate: bytes | None) -> bool:
    """Whether ``cls.__setstate__`` here is the code the driver's reduction modelled: else
    a worker patched it, and the rebuild runs it as by value would."""
    return setstate is not None and code_digest(getattr(cls, "__setstate__", None)) == setstate


def _saved(batch: Any) -> io.BytesIO:
    """``torch.save`` of a batch, as a ``DataProto``'s ``__getstate__`` sends it."""
    import torch

    buffer = io.BytesIO()
    torch.save(batch, buffer)
    buffer.seek(0)
    return buffer


def rebuild_dataproto(
    cls: Any,
    parts: Any,
    non_tensor_batch: Any,
    meta_info: Any,
    consolidate: bool,
    setstate: bytes | None = None,
) -> Any:
    """A verl ``DataProto`` from its tensors, as its own unpickling gives it: its
    ``__setstate__`` sets three attributes, its batch loaded as ``torch.save`` kept it
    (consolidated, where tensordict consolidates). Where this worker's ``__setstate__`` is
    not verl's code the driver read, it is run on the state verl's ``__getstate__`` sends."""
    from tensordict import TensorDict

    tensors, batch_size, device, names = parts
    batch = TensorDict(tensors, batch_size=batch_size, device=device, names=names)
    sent = batch.contiguous().consolidate() if consolidate else batch
    data = cls.__new__(cls)
    if not _runs_as_read(cls, setstate):
        data.__setstate__((_saved(sent).getvalue(), non_tensor_batch, meta_info))
        return data
    data.batch = _as_loaded(sent)
    data.non_tensor_batch, data.meta_info = non_tensor_batch, meta_info
    return data


def rebuild_consolidated(rebuild: Any, metadata: Any, pieces: list[Any], nbytes: int) -> Any:
    """A consolidated ``TensorDict`` from its storage's pieces (each leaf's bytes, and the
    padding between them), as its own unpickling rebuilds it from metadata and storage."""
    import collections
    import ctypes

    import numpy as np
    import torch

    memory = torch.UntypedStorage(nbytes)  # type: ignore[no-untyped-call]
    at = memory.data_ptr()
    for piece in pieces:
        source = np.frombuffer(piece, dtype=np.uint8)
        if source.size:
            ctypes.memmove(at, source.ctypes.data, source.size)
        at += source.size
    # As torch's unpickling makes the storage tensor: set_ on the storage (version 1), and
    # the empty backward hooks its pickle sends.
    storage = torch.empty(0, dtype=torch.uint8).set_(memory, 0, (nbytes,), (1,))
    storage._backward_hooks = collections.OrderedDict()
    return rebuild(metadata, storage)


def rebuild_roll_dataproto(cls: Any, fields: Any, setstate: bytes | None = None) -> Any:
    """A ROLL ``DataProto`` as its ``__setstate__`` leaves it: a new instance, never
    initialized, with each field its state holds set in that order (``_batch``,
    ``_non_tensor_batch``, ``_remote_batch``, ``meta_info``; before v0.3.0 ``batch``,
    ``non_tensor_batch``, ``meta_info``). Where this worker's ``__setstate__`` is not ROLL's
    code the driver read, it is run on the state ROLL's ``__getstate__`` sends (the batch
    ``torch.save``d first)."""
    data = cls.__new__(cls)
    batch, *rest = (value for _, value in fields)
    if not _runs_as_read(cls, setstate):
        data.__setstate__((_saved(batch), *rest))
        return data
    for (name, _), value in zip(fields, (_as_loaded(batch), *rest), strict=True):
        setattr(data, name, value)
    return data
