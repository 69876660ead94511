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
from .._keys.sizes import estimate_size, sizes
from .._keys.tables import builtin_fingerprints
from .._wire import bootstrap
from .._wire.tensors import TensorElements
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


@builtin_fingerprints.registers_lazy("verl.protocol", "DataProto")
def dataproto_fingerprint(data: Any) -> Any:
    """What pickling a ``DataProto`` sends: ``batch.contiguous().consolidate()`` through
    ``torch.save``, so each tensor's own elements (a chunk's rows, not its parent's
    storage), and ``non_tensor_batch`` and ``meta_info``."""
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


@sizes.registers_lazy("verl.protocol", "DataProto")
def dataproto_size(data: Any) -> int:
    """A ``DataProto`` sends its tensors' elements, not the storages they are views of."""
    total = 0
    if data.batch is not None:
        for _key, tensor in _tensor_items(data.batch):
            total += tensor.nelement() * tensor.element_size()
    return total + estimate_size(data.non_tensor_batch) + estimate_size(data.meta_info)


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
    pickling would have consolidated it, so it receives what it receives by value."""
    batch = data.batch
    if os.getenv("VERL_DATAPROTO_SERIALIZATION_METHOD") == "numpy":
        return NotImplemented  # verl's own numpy layout: sent whole
    if batch is None or any(isinstance(key, tuple) for key, _ in _tensor_items(batch)):
        return NotImplemented  # nested keys: sent whole
    names = getattr(batch, "names", None) if batch.batch_dims else None
    tensors = {key: TensorElements(tensor) for key, tensor in _tensor_items(batch)}
    parts = (tensors, tuple(batch.batch_size), batch.device, names)
    consolidate = _consolidates() and len(batch.keys()) > 0
    state = (type(data), parts, data.non_tensor_batch, data.meta_info, consolidate)
    return bootstrap.rebuild_dataproto, state
