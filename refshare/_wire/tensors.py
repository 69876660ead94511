"""How refshare reads and stores a CPU tensor: its storage's bytes, out of band, copied once.

Ray sends a tensor with torch's own pickling, which ``torch.save``s its storage into bytes
that Ray then copies into the pickle and the object store: three copies on the driver.
refshare puts the storage's bytes as one out-of-band buffer instead
(one copy, at memory speed), in torch's own reduction of the tensor: the worker runs
torch's rebuild function on the arguments torch sends (see
:func:`refshare._wire.bootstrap.rebuild_tensor`), the storage made as ``torch.load`` makes
it, and gets what torch's unpickling gives it, down to its empty backward hooks.

This applies to a plain CPU tensor, put on its own or inside a value refshare pickles
itself, where Ray would use torch's pickling or its own zero-copy reducer
(``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS``, which OpenRLHF turns on): that reducer hands each
task a writable view of its own object, and refshare shares one object between tasks, so
it stores tensors as their bytes and each worker gets memory of its own. The tensor it gets
is then the one that reducer's deserializer makes (``torch.from_numpy`` of the elements'
bytes, viewed as the dtype and shaped: contiguous, without ``requires_grad``), on that
memory. A serializer the program registered for ``torch.Tensor``
(``ray.util.register_serializer``) is left to it.
"""

from __future__ import annotations

import collections
import functools
import pickle
import sys
from typing import Any

from .._ray.pickling import ship_by_value
from . import bootstrap


class _StorageView:
    """``nbytes`` of a storage's memory from byte ``start``, as numpy sees it, holding the
    storage alive meanwhile."""

    __slots__ = ("__array_interface__", "storage")

    def __init__(self, storage: Any, start: int, nbytes: int) -> None:
        self.storage = storage
        self.__array_interface__ = {
            "data": (storage.data_ptr() + start, False),
            "shape": (nbytes,),
            "typestr": "|u1",
            "version": 3,
        }


def _bytes_of(storage: Any, start: int, nbytes: int) -> Any:
    """``nbytes`` of ``storage`` from byte ``start`` as a flat uint8 numpy array, without a
    copy. Read through the storage's address, not ``.numpy()``: that would mark the storage
    as shared with numpy, which torch then refuses to resize, for refshare and for the user."""
    import numpy as np

    return np.asarray(_StorageView(storage, start, nbytes))


def storage_bytes(t: Any) -> Any:
    """The tensor's whole storage as a flat uint8 numpy array, without a copy."""
    storage = t.untyped_storage()
    return _bytes_of(storage, 0, storage.nbytes())


def element_bytes(t: Any) -> Any:
    """A CPU tensor's own elements in row-major order as a flat uint8 numpy array: a view
    of its storage when it is contiguous, else a copy (what ``t.contiguous()`` would send)."""
    if not t.is_contiguous():
        t = t.contiguous()
    size = t.element_size()
    return _bytes_of(t.untyped_storage(), t.storage_offset() * size, t.nelement() * size)


def pickled_as_storage(t: Any, with_state: bool = False) -> bool:
    """Whether torch's pickling sends ``t`` as its storage and a layout, so that refshare
    can read what it sends in place: a strided CPU tensor, neither quantized nor nested,
    picklable (a leaf, or not requiring grad), without names, and (unless ``with_state``)
    without attributes of its own, which torch's pickling sends beside it."""
    torch = sys.modules["torch"]
    return (
        t.device.type == "cpu"
        and t.layout == torch.strided
        and not (t.is_quantized or t.is_nested)
        and (t.is_leaf or not t.requires_grad)
        and (with_state or not getattr(t, "__dict__", None))
        and not any(getattr(t, "names", None) or ())
    )


def plain_tensor(t: Any) -> bool:
    """Whether ``t`` is a tensor a reader reads in full from its dtype, shape, strides,
    ``requires_grad`` and bytes: an exact ``torch.Tensor`` that torch pickles as its
    storage (see :func:`pickled_as_storage`), without attributes of its own, and with
    neither its conjugate nor its negative bit set."""
    torch = sys.modules.get("torch")
    return (
        torch is not None
        and type(t) is torch.Tensor
        and pickled_as_storage(t)
        and not (t.is_conj() or t.is_neg())
    )


def _serializer_of_ours() -> bool:
    """Whether Ray sends tensors through torch's pickling, or through its own zero-copy
    reducer (``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS``), where refshare's form is what keeps
    them apart: with that reducer each task's tensors view its own object's memory,
    writably, so one ref shared between tasks would let one worker's in-place write reach
    the others. A serializer the program registered for tensors is left to do its work."""
    reducer = _tensor_reducer()
    return reducer is None or _deserializer_of(reducer) is not None


def _tensor_reducer() -> Any:
    """What Ray's pickler's dispatch table holds for ``torch.Tensor`` now, or ``None``."""
    from ray import cloudpickle

    return cloudpickle.CloudPickler.dispatch.get(sys.modules["torch"].Tensor)


def _zero_copy_deserializer() -> Any:
    """Ray's zero-copy tensor deserializer while its reducer is the one registered for
    tensors; else ``None`` (tensors then go through torch's pickling, or the program's)."""
    reducer = _tensor_reducer()
    return None if reducer is None else _deserializer_of(reducer)


@functools.lru_cache(maxsize=8)
def _deserializer_of(reducer: Any) -> Any:
    """The deserializer of ``reducer`` if it is Ray's zero-copy reducer, else ``None``:
    worked out once per reducer, as each tensor asks."""
    try:
        from ray._private import tensor_serialization_utils as zero_copy
    except ImportError:
        return None
    if reducer is not zero_copy.zero_copy_tensors_reducer:
        return None
    return zero_copy._zero_copy_tensors_deserializer


def storable_as_bytes(t: Any) -> bool:
    """Whether refshare stores ``t`` as its storage's bytes: a plain tensor that Ray would
    send through torch's pickling (or its zero-copy reducer), whose conjugate and negative
    bits are unset, of a dtype torch rebuilds from a storage. The worker then gets a tensor
    on memory of its own."""
    return plain_tensor(t) and _serializer_of_ours() and _torch_rebuild(t.dtype) is not None


@functools.cache
def _torch_rebuild(dtype: Any) -> tuple[Any, Any, tuple[Any, ...]] | None:
    """How torch's own pickling rebuilds a CPU tensor of ``dtype``, read from its reduction
    of one: its rebuild function, the dtype of the typed storage it sends (``None`` for an
    untyped one), and what it sends after the tensor's backward hooks (``v3``'s dtype).
    ``None`` where that function is not ``_rebuild_tensor_v2`` or ``v3``, whose arguments
    torch keeps as they are for the files it saved long ago."""
    torch = sys.modules["torch"]
    try:
        rebuild, args = torch.empty(0, dtype=dtype).__reduce_ex__(5)
    except Exception:  # a dtype torch makes no plain tensor of: Ray's pickling sends it
        return None
    if rebuild not in (torch._utils._rebuild_tensor_v2, torch._utils._rebuild_tensor_v3):
        return None
    storage = args[0]
    typed = storage.dtype if isinstance(storage, torch.storage.TypedStorage) else None
    return rebuild, typed, tuple(args[6:])


def tensor_args(
    pieces: list[Any], dtype: Any, offset: int, size: Any, stride: Any, grad: bool
) -> tuple[Any, ...]:
    """What ``bootstrap.rebuild_tensor`` rebuilds a tensor from: torch's own reduction of
    it, its storage given as the bytes that ``pieces`` hold in turn. Under Ray's zero-copy
    reducer, that reducer's deserializer's arguments instead, ``pieces`` holding the
    elements in row-major order (see :func:`zero_copy`)."""
    deserialize = _zero_copy_deserializer()
    if deserialize is not None:
        return (bootstrap.from_zero_copy, pieces, None, deserialize, str(dtype), tuple(size), "cpu")
    found = _torch_rebuild(dtype)
    assert found is not None, "storable_as_bytes checks it"
    rebuild, typed, tail = found
    # torch never pickles hooks: each tensor sends an empty OrderedDict of its own.
    hooks: Any = collections.OrderedDict()
    return (rebuild, pieces, typed, offset, tuple(size), tuple(stride), grad, hooks, *tail)


def compact_stride(size: Any) -> tuple[int, ...]:
    """The strides of a row-major tensor of ``size`` (what ``t.contiguous()`` has)."""
    stride, step = [], 1
    for length in reversed(tuple(size)):
        stride.append(step)
        step *= max(length, 1)
    return tuple(stride[::-1])


class TensorBytes:
    """A tensor as refshare stores it: torch's own reduction of it, its storage as its
    bytes, out of band."""

    __slots__ = ("args",)

    def __init__(self, data: Any, dtype: Any, offset: int, size: Any, stride: Any, grad: bool):
        pieces = [pickle.PickleBuffer(data)]
        self.args = tensor_args(pieces, dtype, offset, size, stride, grad)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return bootstrap.rebuild_tensor, self.args


def zero_copy() -> bool:
    """Whether Ray sends tensors through its zero-copy reducer: a tensor is then stored as
    its elements' bytes, not its storage's (what that reducer sends)."""
    return _zero_copy_deserializer() is not None


def tensor_form(value: Any) -> TensorBytes | None:
    """A plain CPU tensor as its storage's bytes (as its elements', under Ray's zero-copy
    reducer); ``None`` for anything else."""
    if not storable_as_bytes(value):
        return None
    if zero_copy():
        return elements_form(value)
    ship_by_value(bootstrap)
    t = value
    return TensorBytes(
        storage_bytes(t), t.dtype, t.storage_offset(), t.shape, t.stride(), t.requires_grad
    )


def bytes_form(value: Any) -> TensorBytes | None:
    """What refshare stores for a tensor it stores as bytes: a plain CPU tensor's storage,
    or the elements a ``TensorElements`` sends; ``None`` for anything else."""
    if type(value) is TensorElements:
        return elements_form(value.tensor)
    return tensor_form(value)


def elements_form(t: Any) -> TensorBytes | None:
    """A tensor's own elements as the bytes of a compact tensor (see ``TensorElements``),
    or ``None`` when Ray's own pickling must send it."""
    if not storable_as_bytes(t):
        return None
    ship_by_value(bootstrap)
    stride = compact_stride(t.shape)
    return TensorBytes(element_bytes(t), t.dtype, 0, t.shape, stride, t.requires_grad)


class TensorElements:
    """A tensor whose own elements, not its storage, are what its container sends.

    Fingerprints of batch types that pickle ``tensor.contiguous()`` (verl's ``DataProto``)
    return these, so a chunk hashes and stores its rows and not its parent's storage.
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
        form = elements_form(self.tensor)
        if form is not None:
            return form.__reduce__()  # the elements' bytes, rebuilt as a compact tensor
        return self.compact().__reduce_ex__(protocol)  # sent as that tensor
