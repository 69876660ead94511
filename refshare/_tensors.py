"""How refshare stores a CPU tensor: its storage's bytes out of band, copied once.

Ray sends a tensor with torch's own pickling, which ``torch.save``s its storage into bytes
that Ray then copies into the pickle and the object store: on the driver that is three
copies, about 1 GB/s. Refshare puts the storage's bytes as one out-of-band buffer instead
(one copy, at memory speed), with its dtype, offset, size, stride and ``requires_grad``;
the worker rebuilds the tensor with :func:`refshare._bootstrap.rebuild_tensor`, which Ray
sends as code. The worker gets what torch's unpickling gives it: a tensor on a writable
storage of its own, of the same layout.

Used only where Ray would use torch's pickling: a plain CPU tensor, put on its own or inside
a value refshare pickles itself (see ``_serialized``), when no serializer for
``torch.Tensor`` is registered with Ray (``ray.util.register_serializer``,
``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS``).
"""

from __future__ import annotations

import pickle
import sys
from typing import Any

from . import _bootstrap

_shipped = False


def ship_bootstrap_by_value() -> None:
    """Have Ray's cloudpickle send ``_bootstrap`` as code, so workers need no refshare to
    rebuild what it holds."""
    global _shipped
    if not _shipped:
        from ray import cloudpickle

        cloudpickle.register_pickle_by_value(_bootstrap)  # type: ignore[no-untyped-call]
        _shipped = True


class TensorBytes:
    """A tensor as refshare stores it: pickles as its storage's bytes, out of band."""

    __slots__ = ("args",)

    def __init__(self, data: Any, dtype: Any, offset: int, size: Any, stride: Any, grad: bool):
        self.args = (pickle.PickleBuffer(data), dtype, offset, tuple(size), tuple(stride), grad)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _bootstrap.rebuild_tensor, self.args


def _ray_pickles_tensors_itself() -> bool:
    """Whether a serializer registered with Ray replaces torch's pickling of tensors."""
    from ray import cloudpickle

    torch = sys.modules["torch"]
    return torch.Tensor in cloudpickle.CloudPickler.dispatch


def _plain(t: Any) -> bool:
    """Whether ``t`` is a tensor that torch's pickling sends as a storage and a layout."""
    torch = sys.modules.get("torch")
    return (
        torch is not None
        and type(t) is torch.Tensor
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and not (t.is_quantized or t.is_nested or t.is_conj() or t.is_neg())
        and (t.is_leaf or not t.requires_grad)
        and not getattr(t, "__dict__", None)
        and not any(getattr(t, "names", None) or ())
        and not _ray_pickles_tensors_itself()
    )


def tensor_form(value: Any) -> TensorBytes | None:
    """A plain CPU tensor as its storage's bytes; ``None`` for anything else."""
    if not _plain(value):
        return None
    from ._fingerprint import _storage_bytes

    ship_bootstrap_by_value()
    t = value
    return TensorBytes(
        _storage_bytes(t), t.dtype, t.storage_offset(), t.shape, t.stride(), t.requires_grad
    )


def elements_form(t: Any) -> Any:
    """What to put for a tensor's own elements (see ``TensorElements``): a compact tensor
    as its bytes, or ``None`` when Ray's own pickling must send it."""
    if not _plain(t):
        return None
    from ._fingerprint import element_bytes

    ship_bootstrap_by_value()
    stride, step = [], 1
    for length in reversed(t.shape):
        stride.append(step)
        step *= max(length, 1)
    return TensorBytes(element_bytes(t), t.dtype, 0, t.shape, stride[::-1], t.requires_grad)
