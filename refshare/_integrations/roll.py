"""ROLL: its clusters' fan-out, and its ``DataProto``.

A ``Cluster`` binds each worker method when it is built, with a dispatch that chunks the
batch and ends in ``Cluster.execute_all_async`` (or ``execute_rank_zero_async``), looked up
on the class at call time: that is what ``enable("roll")`` wraps. The DP-MP compute
dispatch sends each data-parallel chunk by value to every tensor-parallel rank, with no
``ray.put`` anywhere on the path.

A ``DataProto`` (``roll/distributed/scheduler/protocol.py``) pickles as ``torch.save`` of
its batch (a ``TensorDict``, consolidated first only where ``tensordict.__version__ >=
"0.5.0"``, a string comparison that is False from tensordict 0.10 on), its non-tensor batch,
its remote batch (since v0.3.0) and its ``meta_info``. It is keyed by exactly that, read where
the tensors lie: each tensor by its whole storage and layout (as ``torch.save`` writes it),
and which tensors share a storage (``torch.save`` writes a storage once, so they arrive
aliased). Whatever this reading cannot vouch for (the consolidating gate True, a remote
batch, an entry other than a plain tensor) is keyed by its pickle, as any value with
pickling code of its own is; a subclass pickling its own way is never read as one.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from .._deep import deep_reducers
from .._keys.pickler import NeedsSerializing
from .._keys.sizes import metadata_size, sizes
from .._keys.tables import builtin_fingerprints
from .._wire import bootstrap
from .framework import Framework, Target

FRAMEWORK = Framework(
    "roll",
    "ROLL main 8eb27cc2 (2026-08)",
    (
        (
            Target(
                "roll.distributed.executor.cluster",
                "Cluster",
                ("execute_all_async", "execute_rank_zero_async"),
            ),
        ),
        (Target("roll.distributed.executor.cluster", "Cluster", ("execute_all_async",)),),
    ),
)

PROTOCOL = "roll.distributed.scheduler.protocol"
#: What ``DataProto.__setstate__`` sets, in its order: since v0.3.0 (protocol.py l.331-340 at
#: 8eb27cc2), and in v0.2.x, a dataclass whose state is a 3-tuple (l.235-243 at v0.2.0).
FIELDS = ("_batch", "_non_tensor_batch", "_remote_batch", "meta_info")
OLD_FIELDS = ("batch", "non_tensor_batch", "meta_info")

_layouts: dict[type, tuple[type, tuple[str, ...]] | None] = {}


def _read_layout(cls: type) -> tuple[type, tuple[str, ...]] | None:
    """Which of ROLL's two layouts ``cls`` pickles as. (A subclass pickling its own way
    never gets here: the type tables read only subclasses that pickle as the registered
    class, see ``refshare._rules``.)"""
    owner = next((base for base in cls.__mro__ if "__getstate__" in vars(base)), None)
    if (
        owner is None
        or (owner.__module__, owner.__qualname__) != (PROTOCOL, "DataProto")
        or "__setstate__" not in vars(owner)
    ):
        return None
    if isinstance(vars(owner).get("batch"), property):
        return owner, FIELDS
    if dataclasses.is_dataclass(owner):
        return owner, OLD_FIELDS
    return None


def _layout(data: Any) -> tuple[type, tuple[str, ...]]:
    """The class whose pickling ``data`` has, and the fields that pickling sends, in order;
    raises ``NeedsSerializing`` for a layout refshare has not read."""
    cls = type(data)
    if cls not in _layouts:
        _layouts[cls] = _read_layout(cls)
    found = _layouts[cls]
    if found is None:
        raise NeedsSerializing(f"{cls.__qualname__} pickles in a way of its own")
    return found


def _consolidates(owner: type) -> bool:
    """What ROLL's ``__getstate__`` tests before consolidating, evaluated as it evaluates it:
    ``tensordict.__version__ >= "0.5.0"``, the ``tensordict`` of the protocol's module."""
    tensordict = getattr(sys.modules.get(owner.__module__), "tensordict", None)
    version = getattr(tensordict, "__version__", None)
    if not isinstance(version, str):
        raise NeedsSerializing("no tensordict version to compare")
    return version >= "0.5.0"


def _saved_tensors(batch: Any, found: list[Any] | None = None) -> list[Any]:
    """The tensors ``torch.save`` writes of a batch, in order: its ``TensorDict``'s entries,
    nested ``TensorDict``s' included. Raises ``NeedsSerializing`` for any other entry (a
    non-tensor entry, a tensor subclass, a nested or sparse tensor)."""
    torch = sys.modules["torch"]
    entries = getattr(batch, "_tensordict", None)
    if type(batch).__name__ != "TensorDict" or not isinstance(entries, dict):
        raise NeedsSerializing(f"a batch of type {type(batch).__qualname__}")
    found = [] if found is None else found
    for value in entries.values():
        if type(value) is type(batch):
            _saved_tensors(value, found)
        elif type(value) is torch.Tensor and value.layout == torch.strided:
            found.append(value)
        else:
            raise NeedsSerializing(f"a batch entry of type {type(value).__qualname__}")
    return found


def _storages(tensors: list[Any]) -> tuple[tuple[int, ...], list[int]]:
    """Which storage each tensor is written with, by ``torch.save``'s own key (the storage
    itself, not its address: two storages over one memory are written twice), and the
    bytes of each storage. Raises ``NeedsSerializing`` where ``torch.save`` raises (one
    memory viewed as two dtypes), so that the pickle raises as by value would."""
    index: dict[int, int] = {}
    nbytes: list[int] = []
    dtypes: dict[int, Any] = {}
    pattern = []
    for t in tensors:
        storage = t.untyped_storage()
        address = storage.data_ptr()
        if address and dtypes.setdefault(address, t.dtype) != t.dtype:
            raise NeedsSerializing("one memory saved as two dtypes")
        at = index.setdefault(storage._cdata, len(index))
        if at == len(nbytes):
            nbytes.append(int(storage.nbytes()))
        pattern.append(at)
    return tuple(pattern), nbytes


def _state(data: Any) -> tuple[type, tuple[str, ...], list[Any]]:
    owner, fields = _layout(data)
    attributes = vars(data)
    return owner, fields, [attributes[name] for name in fields]


@builtin_fingerprints.registers_lazy(PROTOCOL, "DataProto")
def dataproto_fingerprint(data: Any) -> Any:
    """What pickling a ROLL ``DataProto`` sends: its fields, its batch as ``torch.save``
    writes it (the ``TensorDict`` keyed by its attributes, each tensor by its whole storage
    and layout), and which of its tensors share a storage."""
    owner, fields, state = _state(data)
    batch = state[0]
    if "_remote_batch" in fields and state[2] is not None:
        raise NeedsSerializing("a remote batch")  # RemoteBatch pickles its own way, or raises
    pattern: tuple[int, ...] = ()
    if batch is not None:
        if _consolidates(owner):
            raise NeedsSerializing("__getstate__ consolidates the batch, in place")
        pattern = _storages(_saved_tensors(batch))[0]
    return fields, batch, pattern, *state[1:]


@sizes.registers_lazy(PROTOCOL, "DataProto")
def dataproto_size(data: Any) -> int:
    """A ``DataProto`` sends each storage of its batch once, whole (a view's parent's too),
    and its non-tensor batch and ``meta_info``; ``-1`` (walk it) for a layout not read."""
    try:
        _, _, state = _state(data)
        batch = state[0]
        stored = 0 if batch is None else sum(_storages(_saved_tensors(batch))[1])
    except (NeedsSerializing, KeyError):
        return -1
    return stored + sum(metadata_size(value) for value in state[1:])


@deep_reducers.registers_lazy(PROTOCOL, "DataProto")
def dataproto_members(data: Any) -> Any:
    """A ``DataProto`` reduced so that deep sharing sees its batch's tensors (each stored
    once by content, whole storage and layout), rebuilt on the worker as its
    ``__setstate__`` leaves it. Sent whole (``NotImplemented``) where that could differ from
    by value: a batch whose tensors share a storage (``torch.save`` keeps them aliased), one
    not on the CPU, a remote batch, the consolidating gate True."""
    try:
        owner, fields, state = _state(data)
        batch = state[0]
        if batch is None or ("_remote_batch" in fields and state[2] is not None):
            return NotImplemented
        if _consolidates(owner):
            return NotImplemented
        tensors = _saved_tensors(batch)
        pattern = _storages(tensors)[0]
    except (NeedsSerializing, KeyError):
        return NotImplemented
    if len(set(pattern)) != len(pattern) or any(t.device.type != "cpu" for t in tensors):
        return NotImplemented
    setstate = bootstrap.code_digest(getattr(type(data), "__setstate__", None))
    rebuild = (type(data), tuple(zip(fields, state, strict=True)), setstate)
    return bootstrap.rebuild_roll_dataproto, rebuild
