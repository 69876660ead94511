"""SkyRL: its actor group's fan-out, its pre-staged chunk puts, and its ``TensorBatch``.

SkyRL 0.3.0 to 0.4.0 (the ``skyrl`` package): ``PPORayActorGroup.async_run_ray_method``
with the mesh dispatch puts each DP chunk of a batch (``MeshDispatch.dispatch``), the
pass-through dispatch sends its arguments by value; on the default training path
(``trainer.recompute_old_logprobs_per_minibatch``) the trainer's critic and policy forwards
and every training step put their chunks through ``MeshDispatch.stage_chunks`` (one put
per mini-batch and DP rank) instead, outside the group. The older ``skyrl_train`` package
(0.3.1, its last release) sends each mesh chunk by value from ``MeshDispatch.dispatch``.

A ``TensorBatch`` (``TrainingInputBatch``) pickles through code of its own; its key covers
exactly what that code sends, read where the tensors lie, without running it: its
``__getstate__`` makes the batch contiguous in place, which keying must not do. On a miss
the batch is put as it is, and Ray pickles it as it would by value.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

from .._deep import deep_reducers, kept_whole
from .._keys.leaves import Unfingerprintable, tensor_digest, tensor_state
from .._keys.sizes import metadata_size, sizes
from .._keys.tables import Key, Memo, builtin_fingerprints, leaf_digests
from .._wire.tensors import TensorElements
from .framework import Framework, Target

FRAMEWORK = Framework(
    "skyrl",
    "SkyRL 0.3.0 to 0.4.0 (and skyrl-train 0.3.1)",
    (
        (
            Target(
                "skyrl.backends.skyrl_train.workers.worker",
                "PPORayActorGroup",
                ("async_run_ray_method",),
            ),
            # A classmethod: the trainer's staged forwards and training steps put here.
            Target(
                "skyrl.backends.skyrl_train.distributed.dispatch",
                "MeshDispatch",
                ("stage_chunks",),
            ),
        ),
        (  # the older skyrl-train package, 0.3.1: no staging; async_run_method is a coroutine
            Target(
                "skyrl_train.workers.worker",
                "PPORayActorGroup",
                ("async_run_ray_method", "run_method", "async_run_method"),
            ),
        ),
    ),
)

#: Where each package defines ``TensorBatch`` (``TrainingInputBatch`` and
#: ``TrainingOutputBatch`` derive from it).
BATCH_MODULE = "skyrl.backends.skyrl_train.training_batch"
OLD_BATCH_MODULE = "skyrl_train.training_batch"

#: What a batch's pickling calls besides its pickling hooks (which only a subclass that
#: pickles as ``TensorBatch`` inherits, see ``refshare._rules``): refshare's reading of it
#: holds only while a subclass leaves these as ``TensorBatch`` defines them too.
_PICKLING = ("contiguous", "__setitem__", "items")


def _base(cls: type) -> type:
    """The ``TensorBatch`` whose pickling ``cls`` has; raises if a subclass changed it."""
    base = next(
        (c for c in cls.__mro__ if c.__name__ == "TensorBatch" and "__getstate__" in c.__dict__),
        None,
    )
    if base is None or any(getattr(cls, name) is not getattr(base, name) for name in _PICKLING):
        raise Unfingerprintable(f"{cls.__qualname__} pickles in a way of its own")
    return base


def _plain(t: Any) -> Any:
    """``t`` if SkyRL's serialization reads it as refshare does: a plain strided CPU tensor.
    Raises ``Unfingerprintable`` (the batch is keyed by Ray's pickle of it) for any other,
    and ``ValueError`` (sent by value, as Ray would send it) for one that requires grad or
    has its conjugate or negative bit set, on which ``.numpy()`` raises."""
    torch = sys.modules["torch"]
    if not isinstance(t, torch.Tensor):
        raise Unfingerprintable(f"a batch field holds a {type(t).__qualname__}")
    if (
        type(t) is not torch.Tensor
        or t.layout != torch.strided
        or not t.is_cpu  # of an exact tensor, what t.device.type == "cpu" says, cheaper
        or t.is_quantized
        or t.is_nested
        or tensor_state(t) is not None
    ):
        raise Unfingerprintable(f"a {t.device.type} {t.layout} {type(t).__qualname__}")
    if t.requires_grad or t.is_conj() or t.is_neg():
        raise ValueError("a tensor .numpy() refuses (requires grad, conjugate or negative bit)")
    return t


_numpy_dtypes: dict[Any, bool] = {}


def _numpy_has(dtype: Any) -> bool:
    """Whether ``.numpy()`` takes tensors of ``dtype`` (bfloat16 and float8 it does not)."""
    found = _numpy_dtypes.get(dtype)
    if found is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "ComplexHalf support is experimental"
            try:
                sys.modules["torch"].empty(0, dtype=dtype).numpy()
                found = True
            except TypeError:
                found = False
        _numpy_dtypes[dtype] = found
    return found


class SavedTensor:
    """A tensor as ``torch.save`` writes it: its whole storage (a row view's parent's too),
    its dtype, offset, size and stride. Keyed like the tensor itself, but not a tensor to the
    key pass: the batch holding it is still put as it is."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor


@leaf_digests.registers(SavedTensor)
def _saved_digest(saved: SavedTensor, memo: Memo | None, reuse: bool) -> Key | None:
    return tensor_digest(saved.tensor, memo, reuse)


def _tensor_state(t: Any, zero_copy: bool) -> tuple[str, Any]:
    """What ``_serialize_tensor(t.contiguous(), zero_copy=...)`` (0.3.0 to 0.4.0) sends:
    with numpy, the elements in C order, shape and dtype (``numpy``: as bytes; ``numpy_view``:
    as the array itself); for a dtype numpy lacks, ``torch.save`` of the contiguous tensor."""
    t = _plain(t)
    if _numpy_has(t.dtype):
        return ("numpy_view" if zero_copy else "numpy"), TensorElements(t)
    if t.is_contiguous():
        return "torch", SavedTensor(t)
    return "torch compact", TensorElements(t)  # contiguous() copies: its own elements only


def _checked_size(value: Any, batch_size: int | None) -> int | None:
    """``contiguous()`` stores every field again through ``__setitem__``, which checks its
    length against the batch size, or sets the batch size if it is still unset."""
    if type(value) is sys.modules["torch"].Tensor and value.dim():
        length = value.shape[0]  # what len() gives, without torch's __len__ in Python
    else:
        length = len(value)  # (a 0-d tensor raises, as in __setitem__)
    if batch_size is not None and length != batch_size:
        raise ValueError(f"a batch field of {length} rows in a batch of {batch_size}")
    return length if batch_size is None else batch_size


def _field_state(value: Any, zero_copy: bool, tensor_list: Any, packed: Any) -> Any:
    """One field as ``__getstate__`` sends it: a tensor, or a ``TensorList``'s tensors, or a
    ``PackedTensor``'s values and offsets (``tensor_list``, ``packed``: those classes of the
    batch's own module, exactly, where it has them)."""
    if tensor_list is not None and isinstance(value, tensor_list):
        if type(value) is not tensor_list:
            raise Unfingerprintable(f"a {type(value).__qualname__}")
        return "tensor_list", [_tensor_state(t, False) for t in value.tensors]
    if packed is not None and isinstance(value, packed):
        if type(value) is not packed:
            raise Unfingerprintable(f"a {type(value).__qualname__}")
        values = _tensor_state(value.values, zero_copy)
        return "packed_tensor", values, _tensor_state(value.cu_seqlens, False)
    return _tensor_state(value, zero_copy)


@builtin_fingerprints.registers_lazy(BATCH_MODULE, "TensorBatch")
def tensor_batch_fingerprint(batch: Any) -> Any:
    """What pickling a SkyRL 0.3.0 to 0.4.0 ``TensorBatch`` sends, field by field: its
    ``__reduce__`` gives ``(_rebuild_tensor_batch, (type, __getstate__()))``, and that state
    is each field made contiguous (a tensor, a ``TensorList``'s tensors, a ``PackedTensor``'s
    values and offsets, as ``_tensor_state`` says), then the batch size, device and metadata.
    A batch whose pickling would fail (a field of another length or type, a device other
    than the CPU) raises, and goes by value, where Ray raises the same."""
    base = _base(type(batch))
    module = sys.modules[base.__module__]
    if not hasattr(module, "_serialize_tensor") or "__reduce__" not in base.__dict__:
        raise Unfingerprintable("a TensorBatch of a layout refshare has not read")
    zero_copy_keys: frozenset[str] = getattr(batch, "ZERO_COPY_KEYS", frozenset())  # 0.4.0 on
    tensor_list = getattr(module, "TensorList", None)
    packed = getattr(module, "PackedTensor", None)
    batch_size = batch._batch_size
    fields: list[tuple[Any, Any]] = []
    for key, value in batch.items():
        if value is None:
            fields.append((key, None))
            continue
        batch_size = _checked_size(value, batch_size)
        state = _field_state(value, key in zero_copy_keys, tensor_list, packed)
        fields.append((key, state))
    device = batch._device
    if device is not None and device != sys.modules["torch"].device("cpu"):
        raise ValueError("Tensors must be on CPU before serialization")
    return fields, batch_size, device, batch.metadata


# A SkyRL batch is never split into members: its pickling sends copies of its tensors'
# bytes (``torch.save`` blobs in skyrl-train), made only by running it, and a worker must
# receive what that pickling gives. It is stored whole, keyed by its fingerprint, and a value
# holding one is stored whole too.
deep_reducers.register_lazy(BATCH_MODULE, "TensorBatch", kept_whole)
deep_reducers.register_lazy(OLD_BATCH_MODULE, "TensorBatch", kept_whole)


def _sent_nbytes(t: Any, torch_format: bool) -> int:
    if torch_format and t.is_contiguous():
        return int(t.untyped_storage().nbytes())  # torch.save writes the whole storage
    return int(t.nelement() * t.element_size())


def _tensor_nbytes(t: Any) -> int:
    torch = sys.modules["torch"]
    if type(t) is torch.Tensor:  # most fields: is_cpu says what device.type does, cheaper
        if not t.is_cpu:
            return 0
    elif not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        return 0
    return _sent_nbytes(t, not _numpy_has(t.dtype))


@sizes.registers_lazy(BATCH_MODULE, "TensorBatch")
def tensor_batch_size(batch: Any) -> int:
    """A SkyRL 0.3.0 to 0.4.0 batch sends its fields' own elements (a chunk's rows, not its
    parent's storage), a dtype numpy lacks its whole storage, and its metadata."""
    total = 0
    for value in batch.values():
        if value is None:
            continue
        tensors = getattr(value, "tensors", None)
        if tensors is None:
            packed = getattr(value, "cu_seqlens", None)
            if packed is None:
                total += _tensor_nbytes(value)  # a tensor: most fields
                continue
            tensors = [value.values, packed]
        total += sum(map(_tensor_nbytes, tensors))
    return total + metadata_size(batch.metadata)


def _saved_state(t: Any) -> Any:
    """What skyrl-train 0.3.1 sends of a field ``t``: ``t.contiguous()``, as the dict's item
    (torch's pickling) and through ``torch.save``: both its whole storage and its layout."""
    t = _plain(t)
    if t.is_contiguous():
        return t  # itself: a tensor, so a miss stores it as its bytes (see PickleOnPut)
    return "compact", TensorElements(t)  # a new tensor of its own elements


@builtin_fingerprints.registers_lazy(OLD_BATCH_MODULE, "TensorBatch")
def old_tensor_batch_fingerprint(batch: Any) -> Any:
    """What pickling a skyrl-train 0.3.1 ``TensorBatch`` sends: a dict subclass without a
    ``__reduce__``, so its items (made contiguous by its ``__getstate__``) and that state:
    ``torch.save`` of each item, the batch size, device and metadata. The worker's
    ``__setstate__`` replaces each item with what ``torch.load`` gives."""
    base = _base(type(batch))
    module = sys.modules[base.__module__]
    if "__reduce__" in base.__dict__ or not hasattr(module, "TensorBatch"):
        raise Unfingerprintable("a TensorBatch of a layout refshare has not read")
    batch_size = batch._batch_size
    fields: list[tuple[Any, Any]] = []
    for key, value in batch.items():
        if value is not None:
            batch_size = _checked_size(value, batch_size)
            value = _saved_state(value)
        fields.append((key, value))
    device = batch._device
    if device is not None and device != sys.modules["torch"].device("cpu"):
        raise ValueError("Tensors must be on CPU before serialization")
    return fields, batch_size, device, batch.metadata


@sizes.registers_lazy(OLD_BATCH_MODULE, "TensorBatch")
def old_tensor_batch_size(batch: Any) -> int:
    """A skyrl-train 0.3.1 batch sends each tensor twice (item and ``torch.save``), each time
    its whole storage when it is contiguous (a chunk: its parent's), and its metadata."""
    torch = sys.modules["torch"]
    total = 0
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.device.type == "cpu":
            total += 2 * _sent_nbytes(value, torch_format=True)
    return total + metadata_size(batch.metadata)


def register_tensor_batch(cls: type) -> None:
    """Key ``cls``, and its subclasses, as SkyRL 0.3.0 to 0.4.0's ``TensorBatch`` is keyed
    (its fingerprint and size, and never split by deep sharing): for a class that pickles
    as that one does but lives in another module, as a mirror of it does."""
    builtin_fingerprints.register(cls, tensor_batch_fingerprint)
    sizes.register(cls, tensor_batch_size)
    deep_reducers.register(cls, kept_whole)
