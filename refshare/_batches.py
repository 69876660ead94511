"""Built-in fingerprints and sizes of the batch types RL frameworks send.

Each is registered when its module is first in use, never imported by refshare. Each
fingerprint names what that type's pickling sends, so a value is keyed without being
serialized, and a repeat costs one hash of its bytes:

- verl's ``DataProto`` pickles ``batch.contiguous().consolidate()`` through ``torch.save``,
  plus ``non_tensor_batch`` and ``meta_info``: its key covers each tensor's own elements
  (a chunk's rows, not its parent's storage) and those two dicts.
- NeMo-RL's ``BatchedDataDict`` is a ``collections.UserDict`` with no pickling of its own:
  it pickles its attributes, so that is what its key covers.
- ``tensordict.TensorDict`` pickles its attributes (its tensors send their whole storages,
  as in any pickle); its key takes them in sorted order, since a ``clone()`` holds the same
  attributes in another order, which the worker's unpickling cannot tell apart.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ._deep import deep_reducers
from ._dispatch import TypeTable
from ._fingerprint import FingerprintFn, TensorElements, builtin_fingerprints
from ._sizing import SizeFn, _sizes, estimate_size

# -- verl ---------------------------------------------------------------------------------


def _tensor_items(batch: Any) -> list[tuple[object, Any]]:
    return list(batch.items(include_nested=True, leaves_only=True))


def dataproto_fingerprint(data: Any) -> Any:
    """What pickling a verl ``DataProto`` sends, with each tensor's elements as a leaf."""
    batch = data.batch
    if batch is not None:
        names = getattr(batch, "names", None) if batch.batch_dims else None
        batch = (
            type(batch).__qualname__,
            tuple(batch.batch_size),
            str(batch.device),
            tuple(names) if names is not None else None,
            [(key, TensorElements(tensor)) for key, tensor in _tensor_items(batch)],
        )
    method = os.getenv("VERL_DATAPROTO_SERIALIZATION_METHOD")
    return method, batch, data.non_tensor_batch, data.meta_info


def dataproto_size(data: Any) -> int:
    """A ``DataProto`` sends its tensors' elements, not the storages they are views of."""
    total = 0
    if data.batch is not None:
        for _key, tensor in _tensor_items(data.batch):
            total += tensor.nelement() * tensor.element_size()
    return total + estimate_size(data.non_tensor_batch) + estimate_size(data.meta_info)


def dataproto_members(data: Any) -> Any:
    """A ``DataProto`` reduced so that deep sharing sees its tensors: each is sent with its
    own elements, as the ``DataProto``'s pickling would send it."""
    batch = data.batch
    if batch is None or any(isinstance(key, tuple) for key, _ in _tensor_items(batch)):
        return NotImplemented  # nested keys: sent whole
    names = getattr(batch, "names", None) if batch.batch_dims else None
    tensors = {key: TensorElements(tensor) for key, tensor in _tensor_items(batch)}
    parts = (tensors, tuple(batch.batch_size), batch.device, names)
    return rebuild_dataproto, (type(data), parts, data.non_tensor_batch, data.meta_info)


def rebuild_dataproto(cls: type, parts: Any, non_tensor_batch: Any, meta_info: Any) -> Any:
    """On the worker: the ``DataProto`` a by-value call would have given it."""
    from tensordict import TensorDict

    tensors, batch_size, device, names = parts
    batch = TensorDict(tensors, batch_size=batch_size, device=device, names=names)
    return cls(batch=batch, non_tensor_batch=non_tensor_batch, meta_info=meta_info)


# -- NeMo-RL ------------------------------------------------------------------------------


def attributes_fingerprint(obj: Any) -> Any:
    """What the default pickling of a ``UserDict`` subclass sends: its attributes."""
    return vars(obj)


# -- tensordict ----------------------------------------------------------------------------


def tensordict_fingerprint(td: Any) -> Any:
    """What pickling a ``TensorDict`` sends: its attributes, in an order of their own."""
    return sorted(td.__getstate__().items())


# -- registration -------------------------------------------------------------------------

#: (module, class name, fingerprint, size or None): what is registered once the module
#: is imported by the program.
BATCH_TYPES: tuple[tuple[str, str, FingerprintFn, SizeFn | None], ...] = (
    ("verl.protocol", "DataProto", dataproto_fingerprint, dataproto_size),
    ("nemo_rl.distributed.batched_data_dict", "BatchedDataDict", attributes_fingerprint, None),
    ("tensordict._td", "TensorDict", tensordict_fingerprint, None),
)


#: How deep sharing sees the members of a batch type whose pickling hides them.
DEEP_REDUCERS = {("verl.protocol", "DataProto"): dataproto_members}


def _filler(root: str) -> Any:
    wanted = [entry for entry in BATCH_TYPES if entry[0].partition(".")[0] == root]

    def fill(table: TypeTable[FingerprintFn]) -> bool:
        done = True
        for module_name, class_name, fingerprint, size in wanted:
            module = sys.modules.get(module_name)
            cls = getattr(module, class_name, None)
            if not isinstance(cls, type):
                done = False  # imported later, or moved: looked for again next time
                continue
            table.register(cls, fingerprint, replace=False)
            members = DEEP_REDUCERS.get((module_name, class_name))
            if members is not None:
                deep_reducers.register(cls, members, replace=False)
            if size is not None:
                _sizes.register(cls, size, replace=False)
        return done

    return fill


def register_batch_types() -> None:
    """Add the lazy entries of every known batch type (refshare does this on import)."""
    for root in {entry[0].partition(".")[0] for entry in BATCH_TYPES}:
        builtin_fingerprints.add_lazy(root, _filler(root))
        deep_reducers.add_lazy(root, _also_fills(root))
        # Sizes are looked up first: have them look for the same modules.
        _sizes.add_lazy(root, _also_fills(root))


def _also_fills(root: str) -> Any:
    """For the other tables: fill every table of ``root`` the way ``_filler`` does."""
    fill = _filler(root)

    def fill_all(table: object) -> bool:
        return bool(fill(builtin_fingerprints))

    return fill_all


register_batch_types()
