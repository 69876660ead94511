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


def rebuild_tensor(rebuild: Any, pieces: list[Any], dtype: Any, *args: Any) -> Any:
    """A CPU tensor as torch's own unpickling gives it: torch's ``rebuild`` function
    (``_rebuild_tensor_v2``) run on the arguments torch's pickling sends, on a storage made
    from the bytes ``pieces`` hold in turn (see :func:`rebuild_storage`)."""
    return rebuild(rebuild_storage(pieces, dtype), *args)


def from_zero_copy(storage: Any, deserialize: Any, *args: Any) -> Any:
    """A tensor as Ray's zero-copy deserializer (``deserialize``) makes it by value, from
    ``torch.from_numpy`` of its elements' bytes, here those of ``storage``: memory of the
    worker's own, where by value it views its own object's."""
    import torch

    data = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
    return deserialize(data, *args)


def rebuild_storage(pieces: list[Any], dtype: Any) -> Any:
    """A storage as ``torch.load`` makes the one it unpickles: ``UntypedStorage(nbytes)``,
    marked ``_torch_load_uninitialized``, its bytes read in (here copied from ``pieces``), and
    wrapped in a ``TypedStorage`` of ``dtype`` unless ``dtype`` is ``None``. Writable, and
    resizable: copied by address, where ``.numpy()`` would pin it."""
    import ctypes

    import numpy as np
    import torch

    sources = [np.frombuffer(piece, dtype=np.uint8) for piece in pieces]
    storage = torch.UntypedStorage(sum(source.size for source in sources))  # type: ignore[no-untyped-call]
    storage._torch_load_uninitialized = True  # type: ignore[attr-defined]
    at = storage.data_ptr()
    for source in sources:
        if source.size:
            ctypes.memmove(at, source.ctypes.data, source.size)
        at += source.size
    if dtype is None:
        return storage
    return torch.storage.TypedStorage(  # type: ignore[no-untyped-call]
        wrap_storage=storage, dtype=dtype, _internal=True
    )


def rebuild_strings(
    text: str, shape: Any, order: Literal["C", "F"], index: Any = None, dtype: Any = object
) -> Any:
    """An array of strings from their NUL-joined text, as numpy's unpickling would give it:
    a writable array of its own, of the same shape and memory order, on ``dtype`` (the
    object dtype the pickle names). With ``index``, the text holds each distinct string
    object once and ``index`` says which fills each element (in ``order``): those elements
    are one object, as pickle's memo makes them."""
    import numpy as np

    out = np.empty(shape, dtype=dtype, order=order)
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
    """Unpickles a skeleton, putting each member and handle back where it was taken out:
    each member rebuilt once, where the skeleton first names it."""

    def __init__(
        self, inband: bytes, rebuild: Any, places: int, handles: list[Any], buffers: list[Any]
    ) -> None:
        super().__init__(io.BytesIO(inband), buffers=buffers)
        self.rebuild = rebuild
        self.values: list[Any] = [_UNSET] * places
        self.handles = handles

    def persistent_load(self, pid: Any) -> Any:
        # An array's place comes with its dtype, unpickled here: one object wherever the
        # value names it, as pickle's memo makes it by value.
        place, dtype = pid if type(pid) is tuple else (pid, None)
        if place < 0:
            return self.handles[~place]
        value = self.values[place]
        if value is _UNSET:
            value = self.values[place] = self.rebuild(place, dtype)
        return value


#: A place whose member is not rebuilt yet.
_UNSET: Any = object()


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
    ``(i, at)``, the ``at``-th member of a bundle (see :func:`unbundled`), of which only
    those named are rebuilt: linear in the members named, however many share one object.
    Each place a member fills gets an object of its own, as by value, where equal values
    that refshare stored once arrive as distinct objects."""
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

    opened: dict[int, Any] = {}  # each bundle's index and buffers, read once

    def rebuild(place: int, dtype: Any) -> Any:
        member = members[place]
        if type(member) is not tuple:
            return _on_dtype(repeated.get(place, got[member]), dtype)
        bundle = opened.get(member[0])
        if bundle is None:
            index, joined, large = got[member[0]]
            words = memoryview(index).cast("B").cast("q")
            bundle = opened[member[0]] = (words, memoryview(joined), large)
        return unbundled(bundle, member[1], dtype)

    unpickler = _SkeletonUnpickler(inband, rebuild, len(members), handles, buffers)
    return _around(native, unpickler.load())


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


#: The kinds of a bundle's members.
PICKLE, ARRAY, TENSOR = 0, 1, 2


def unbundled(bundle: Any, at: int, dtype: Any) -> Any:
    """Member ``at`` of a bundle (``refshare._wire.serialized.bundle_form``, its index read
    as int64 words), as Ray's unpickling of it alone would give it, in time and memory of
    its own size. The index says its kind and where each of its pieces lies (in the small
    pieces joined, or a large one of its own): an array is rebuilt on ``dtype`` from its
    bytes, a tensor by torch's reduction from its storage's bytes, any other member from
    its pickle."""
    words, joined, large = bundle
    entry = words[1 + at]
    kind, count = words[entry], words[entry + 1]
    pieces = []
    for where in range(entry + 2, entry + 2 + 3 * count, 3):
        source, start, stop = words[where : where + 3]
        pieces.append(joined[start:stop] if source < 0 else large[source])
    if kind == ARRAY:  # its layout: whether in F order, whether copied, ndim, shape
        fortran, copied, ndim = words[entry + 5 : entry + 8]
        shape = tuple(words[entry + 8 : entry + 8 + ndim])
        found = rebuild_array(dtype, shape, "F" if fortran else "C", pieces[0])
        # numpy sends some arrays as a copy in-band: by value they are arrays of their own.
        return found.copy(order="A") if copied else found
    if kind == TENSOR:
        rebuild, storage_dtype, *args = pickle.loads(pieces[0])
        return rebuild_tensor(rebuild, pieces[1:], storage_dtype, *args)
    return _on_dtype(pickle.loads(pieces[0], buffers=pieces[1:]), dtype)


def _on_dtype(value: Any, dtype: Any) -> Any:
    """``value``, an array its own pickle rebuilt (or ``ray.get`` fetched), on ``dtype``,
    the object its skeleton names: by value, one pickle makes one dtype object of all the
    places that name it. Each place has an array of its own: changing it in place keeps
    it what Ray gave, its flags and base included."""
    if dtype is not None and value.dtype is not dtype:
        value.dtype = dtype  # an equal dtype: the array's memory and layout stay
    return value


def rebuild_array(dtype: Any, shape: Any, order: Literal["C", "F"], data: Any) -> Any:
    """An array as numpy's protocol-5 unpickling makes it (``numpy._core.numeric.
    _frombuffer``): a view of the buffer, read-only where the buffer is."""
    import numpy as np

    return np.frombuffer(data, dtype=dtype).reshape(shape, order=order)


class _StoragesKept(pickle.Pickler):
    """Pickles all but storages, which it keeps as they are (the untyped storage, and the
    dtype of a typed one), each once however many tensors view it, as ``torch.save`` does:
    tensors by torch's own reduction, as ``torch.save`` pickles them."""

    def __init__(self, stream: io.BytesIO, kept: list[Any]) -> None:
        super().__init__(stream, protocol=pickle.HIGHEST_PROTOCOL)
        self.kept = kept
        self.places: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> int | None:
        import torch

        if isinstance(obj, torch.TypedStorage):
            storage, dtype = obj._untyped_storage, obj.dtype
        elif isinstance(obj, torch.UntypedStorage):
            storage, dtype = obj, None
        else:
            return None
        place = self.places.setdefault(storage._cdata, len(self.kept))
        if place == len(self.kept):
            self.kept.append((storage, dtype))
        return place


def _loaded_storage(storage: Any, dtype: Any) -> Any:
    """A storage as ``torch.load``'s reader of ``torch.save``'s files hands it to torch's
    rebuild, over ``storage``'s memory (a member rebuilt for this place, not copied again):
    a storage object of its own, not resizable (the reader's memory is not) and unmarked
    (only the reader of pickled storages marks its own), typed by ``dtype`` unless it is
    ``None``."""
    import torch

    memory = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()  # holds ``storage``
    loaded = torch.from_numpy(memory).untyped_storage()
    if dtype is None:
        return loaded
    return torch.storage.TypedStorage(  # type: ignore[no-untyped-call]
        wrap_storage=loaded, dtype=dtype, _internal=True
    )


def _as_loaded(batch: Any) -> Any:
    """``batch`` as ``torch.load`` gives it back, its storages aside: each tensor rebuilt by
    torch's own rebuild function, on the storage it had, and all else (its keys, names,
    metadata) new objects, shared with nothing outside it. By value a batch travels as
    ``torch.save``'s bytes, a pickle of its own; rebuilt from a skeleton, its keys would be
    the very strings that other parts of the skeleton name, and its tensors made by
    tensordict's or refshare's code, not by torch's unpickling."""
    stream = io.BytesIO()
    kept: list[Any] = []
    _StoragesKept(stream, kept).dump(batch)
    rebuild = lambda at, _: _loaded_storage(*kept[at])  # noqa: E731
    return _SkeletonUnpickler(stream.getvalue(), rebuild, len(kept), [], []).load()


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


def rebuild_consolidated(rebuild: Any, metadata: Any, storage: tuple[Any, ...]) -> Any:
    """A consolidated ``TensorDict`` as its own unpickling rebuilds it: tensordict's
    ``rebuild`` from its metadata and its storage, a uint8 tensor that torch's pickling
    sends (``storage``: the arguments of :func:`rebuild_tensor`, its bytes in pieces)."""
    return rebuild(metadata, rebuild_tensor(*storage))


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
