"""verl: its worker group's fan-out, and its ``DataProto``.

verl 0.9.1's legacy trainer (``trainer.use_v1=False``) sends every batch through
``RayWorkerGroup.execute_all_async``, the nd-compute dispatch putting each chunk first with
``verl.utils.ray_utils.parallel_put`` (from a thread pool). Its default trainer moves
batches through TransferQueue instead, where the driver holds no batch to share.
"""

from __future__ import annotations

import itertools
import os
import sys
from typing import Any

from .._deep import deep_reducers
from .._keys.sizes import metadata_size, sizes
from .._keys.tables import builtin_fingerprints
from .._rules import pickling_is_its_packages
from .._wire import bootstrap
from .._wire.tensors import TensorElements, plain_tensor
from .framework import Framework, Target

FRAMEWORK = Framework(
    "verl",
    "verl 0.9.1",
    (
        (
            # Every by-value fan-out (ONE_TO_ALL, DP_COMPUTE_PROTO, ...) ends here.
            Target("verl.single_controller.ray.base", "RayWorkerGroup", ("execute_all_async",)),
            # The nd-compute dispatch puts each chunk from a thread pool here.
            Target("verl.utils.ray_utils", "", ("parallel_put",)),
        ),
    ),
)


def _tensor_items(batch: Any) -> list[tuple[object, Any]]:
    return list(batch.items(include_nested=True, leaves_only=True))


def _plain_entries(batch: Any) -> list[tuple[str, Any]] | None:
    """The entries of a batch whose pickling refshare reads in full, in order, else
    ``None``: an exact ``TensorDict``, every entry a plain tensor.

    ``DataProto.__getstate__`` then ``torch.save``s a fresh ``contiguous().consolidate()``
    of it, which holds exactly these entries' dtypes, shapes and elements, and the batch's
    size, device and names. That holds for a consolidated batch too (every batch a
    ``DataProto`` is unpickled or deep-copied with): ``TensorDict.contiguous()`` builds a
    new, unconsolidated ``TensorDict`` of the current entries (tensordict 0.10.0, 0.15.3), so
    the batch's own consolidated storage, current or stale, is never what is sent. Anything
    else (a non-tensor entry, a nested or lazily stacked ``TensorDict``, a tensor subclass
    or one with attributes) is left to the exact path: Ray's pickle."""
    tensordict = sys.modules.get("tensordict")
    td = getattr(tensordict, "TensorDict", None)
    if type(batch) is not td or not pickling_is_its_packages(type(batch)):
        return None
    entries = getattr(batch, "_tensordict", None)
    if type(entries) is not dict:
        return None
    if not all(type(key) is str and plain_tensor(t) for key, t in entries.items()):
        return None
    return list(entries.items())


def _batch_layout(batch: Any) -> tuple[Any, ...]:
    """What a consolidated batch's metadata says of the batch itself."""
    names = batch.names if batch.batch_dims else None
    return tuple(batch.batch_size), batch.device, names, batch.is_locked


@builtin_fingerprints.registers_lazy("verl.protocol", "DataProto")
def dataproto_fingerprint(data: Any) -> Any:
    """What pickling a ``DataProto`` sends: its batch as ``torch.save`` writes a fresh
    consolidation of it (each tensor's own elements, not its parent's storage), and
    ``non_tensor_batch`` and ``meta_info``; ``NotImplemented`` for a batch refshare does
    not read in full (see ``_plain_entries``) or verl's numpy serialization."""
    if os.getenv("VERL_DATAPROTO_SERIALIZATION_METHOD") == "numpy":
        return NotImplemented
    batch = data.batch
    if batch is not None:
        entries = _plain_entries(batch)
        if entries is None:
            return NotImplemented
        tensors = [(key, TensorElements(tensor)) for key, tensor in entries]
        batch = (_batch_layout(batch), tensors)
    return batch, data.non_tensor_batch, data.meta_info


@sizes.registers_lazy("verl.protocol", "DataProto")
def dataproto_size(data: Any) -> int:
    """A ``DataProto`` sends its tensors' elements, not the storages they are views of."""
    total = 0
    if data.batch is not None:
        for _key, tensor in _tensor_items(data.batch):
            total += tensor.nelement() * tensor.element_size()
    return total + metadata_size(data.non_tensor_batch) + metadata_size(data.meta_info)


def _consolidates() -> bool:
    """Whether a ``DataProto``'s pickling consolidates its batch: with tensordict 0.5 or
    newer, as ``protocol.py`` checks it."""
    version = getattr(sys.modules.get("tensordict"), "__version__", "0")
    numbers = []
    for part in version.split(".")[:2]:
        digits = "".join(itertools.takewhile(str.isdigit, part))
        numbers.append(int(digits or 0))
    return tuple(numbers) >= (0, 5)


@deep_reducers.registers_lazy("verl.protocol", "DataProto")
def dataproto_members(data: Any) -> Any:
    """A ``DataProto`` reduced so that deep sharing sees its tensors: each is sent with its
    own elements, and the worker's batch is consolidated where the ``DataProto``'s own
    pickling would have consolidated it, so it receives what it receives by value. Only
    a batch read in full (see ``_plain_entries``) and unlocked, which the rebuild makes
    anew; any other ``DataProto`` is stored whole."""
    batch = data.batch
    if os.getenv("VERL_DATAPROTO_SERIALIZATION_METHOD") == "numpy" or batch is None:
        return NotImplemented
    entries = _plain_entries(batch)
    if entries is None or batch.is_locked:
        return NotImplemented
    names = batch.names if batch.batch_dims else None
    tensors = {key: TensorElements(tensor) for key, tensor in entries}
    parts = (tensors, tuple(batch.batch_size), batch.device, names)
    consolidate = _consolidates() and len(entries) > 0
    setstate = bootstrap.code_digest(getattr(type(data), "__setstate__", None))
    state = (type(data), parts, data.non_tensor_batch, data.meta_info, consolidate, setstate)
    return bootstrap.rebuild_dataproto, state
