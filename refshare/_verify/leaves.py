"""Arrays and tensors as a receiver has them: a part of verify's description (``received``).

Imports nothing of refshare: Ray ships it by value to the workers, with ``received``.
"""

from __future__ import annotations

import hashlib
import sys
import warnings
from typing import Any, Protocol


class CannotDescribe(Exception):
    """An object whose state cannot be read without running code verify must not run."""


class Describer(Protocol):
    """What these functions need of a description pass (``received._Describer``)."""

    held: list[Any]
    storages: dict[int, int]
    regions: list[tuple[int, int, int, bool, Any]]
    dtypes: dict[int, str]
    trail: list[Any]

    def emit(self, *token: Any) -> None: ...

    def visit(self, obj: Any, label: Any) -> None: ...

    def standalone(self, item: Any) -> bytes: ...


def new_hasher() -> Any:
    try:
        import xxhash
    except ImportError:  # a worker without it: both sides are described in one process
        return hashlib.blake2b(digest_size=16)
    return xxhash.xxh3_128()


def digest(data: Any) -> str:
    hasher = new_hasher()
    hasher.update(data)
    return str(hasher.hexdigest())


def array(d: Describer, arr: Any, index: int) -> None:
    """A plain ndarray view: layout, the flags a receiver has, dtype by value, content."""
    d.held.append(arr)  # a view made here: its address is not recycled in the pass
    flags = arr.flags
    layout = (arr.shape, arr.strides, flags.c_contiguous, flags.f_contiguous)
    d.emit("layout", *layout, flags.writeable, flags.aligned)
    _dtype(d, arr.dtype)
    _content(d, arr)
    if not arr.dtype.hasobject and arr.nbytes:
        numpy = sys.modules["numpy"]
        low, high = numpy.lib.array_utils.byte_bounds(arr)
        d.regions.append((low, high, index, bool(flags.writeable), arr))


def _dtype(d: Describer, dtype: Any) -> None:
    """A dtype by value (all of it: metadata, byte order, fields), through its own
    reduction; arrays unpickled apart have equal dtypes that are not one object."""
    found = d.dtypes.get(id(dtype))
    if found is None:
        found = d.dtypes[id(dtype)] = d.standalone(dtype).hex()
        d.held.append(dtype)
    d.emit("dtype", str(dtype), found)


def _content(d: Describer, arr: Any) -> None:
    """An array's elements: field by field (padding is no content), Python objects one
    by one, else its bytes through a uint8 view (datetime64 has no buffer of its own)."""
    numpy = sys.modules["numpy"]
    dtype = arr.dtype
    if dtype.names is not None:
        for name in dtype.names:
            d.emit("field", name)
            _content(d, arr[name])
    elif dtype.hasobject:
        d.emit("elements", arr.size)
        for i, item in enumerate(arr.reshape(-1)):
            d.visit(item, (i,))
    elif not arr.nbytes:
        d.emit("bytes", 0)
    else:
        flags = arr.flags
        flat = arr if flags.c_contiguous else arr.T if flags.f_contiguous else None
        flat = numpy.ascontiguousarray(arr) if flat is None else flat
        d.emit("bytes", arr.nbytes, digest(flat.reshape(-1).view(numpy.uint8)))


def tensor(d: Describer, t: Any, index: int) -> bool:
    """A tensor as torch's own code reads it (a subclass's ``__torch_function__`` does
    not run); whether it is nested."""
    torch = sys.modules["torch"]
    with torch._C.DisableTorchFunctionSubclass(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kind = (str(t.dtype), str(t.layout), str(t.device))
        d.emit("tensor", *kind, t.requires_grad, t.is_leaf, t.is_inference())
        if t.is_quantized:
            _quantized(d, t)
        elif t.is_nested:
            parts = t.unbind()
            d.emit("nested", len(parts))
            for part in parts:
                _elements(d, part)
        elif t.layout == torch.strided:
            _strided(d, t, index)
        else:
            _sparse(d, t)
        d.visit(torch._C.TensorBase.grad.__get__(t), ".grad")
        d.visit(t._backward_hooks, "._backward_hooks")
        return bool(t.is_nested)


def _strided(d: Describer, t: Any, index: int) -> None:
    """A strided tensor: its layout and its whole storage, as torch's pickling sends it."""
    torch = sys.modules["torch"]
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    start = storage.data_ptr()
    shared = d.storages.setdefault(start, index) if nbytes else None
    layout = (tuple(t.shape), t.stride(), t.storage_offset(), nbytes, t.is_conj(), t.is_neg())
    d.emit("strided", *layout, None if t.is_inference() else t._version, shared)
    if storage.device.type != "cpu":
        storage = storage.cpu()
    data = torch.empty(0, dtype=torch.uint8).set_(storage).numpy() if nbytes else b""
    d.emit("storage", digest(data))
    if nbytes and shared == index:
        d.regions.append((start, start + nbytes, index, True, None))


def _elements(d: Describer, t: Any) -> None:
    """A tensor's elements and shape alone (a part of a nested or quantized one)."""
    torch = sys.modules["torch"]
    plain = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    data = plain.view(torch.uint8).numpy() if plain.numel() else b""
    d.emit("elements", str(t.dtype), tuple(t.shape), t.stride(), digest(data))


def _quantized(d: Describer, t: Any) -> None:
    torch = sys.modules["torch"]
    scheme = t.qscheme()
    d.emit("quantized", str(scheme), tuple(t.shape), t.stride(), t.storage_offset())
    if scheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        d.emit("qparams", float(t.q_scale()).hex(), int(t.q_zero_point()))
    elif scheme in (
        torch.per_channel_affine,
        torch.per_channel_symmetric,
        torch.per_channel_affine_float_qparams,
    ):
        d.emit("axis", t.q_per_channel_axis())
        _elements(d, t.q_per_channel_scales())
        _elements(d, t.q_per_channel_zero_points())
    else:
        raise CannotDescribe(f"a quantized tensor of scheme {scheme}")
    _elements(d, t.int_repr())


def _sparse(d: Describer, t: Any) -> None:
    torch = sys.modules["torch"]
    layout = t.layout
    parts: tuple[Any, ...]
    if layout == torch.sparse_coo:
        d.emit("coo", tuple(t.shape), t.sparse_dim(), t.dense_dim(), t.is_coalesced())
        parts = (t._indices(), t._values())
    elif layout in (torch.sparse_csr, torch.sparse_bsr):
        d.emit("compressed", tuple(t.shape))
        parts = (t.crow_indices(), t.col_indices(), t.values())
    elif layout in (torch.sparse_csc, torch.sparse_bsc):
        d.emit("compressed", tuple(t.shape))
        parts = (t.ccol_indices(), t.row_indices(), t.values())
    else:
        raise CannotDescribe(f"a tensor of layout {layout}")
    for part in parts:
        _elements(d, part)


def shared_memory(d: Describer) -> None:
    """Memory shared between the arrays and tensors visited, where one of them can be
    written: a write through one shows through the other. (Read-only arrays of one
    buffer cannot tell; Ray gives those for one ref fetched twice.)"""
    numpy = sys.modules.get("numpy")
    d.trail.append("value")
    active: list[tuple[int, int, int, bool, Any]] = []
    for region in sorted(d.regions, key=lambda r: (r[0], r[2])):
        low, _, index, writeable, arr = region
        active = [r for r in active if r[1] > low]
        for other in active:
            if not (writeable or other[3]):
                continue
            if numpy is not None and arr is not None and other[4] is not None:
                try:
                    if not numpy.shares_memory(arr, other[4], max_work=1 << 20):
                        continue
                except numpy.exceptions.TooHardError:
                    pass  # cannot tell: taken as shared, on both sides alike
            d.emit("shares memory", other[2], index)
        active.append(region)
