"""tensordict's ``TensorDict``, as verl's legacy trainer sends them: sized, and split.

tensordict registers its own reduction with ``copyreg``, which Ray's cloudpickle follows:
a consolidated ``TensorDict`` (every chunk verl 0.9.1's dispatch puts) pickles as its
metadata and one uint8 storage, any other as its attributes. refshare's pickling pass
follows the same reduction, so a ``TensorDict`` (and a ``NonTensorData`` or
``NonTensorStack``, which pickle as their state) is keyed by exactly what it pickles as,
with no reader of its own: whether a consolidated one's storage is still current (0.15
re-consolidates a stale one, 0.10 sends it as it is) is tensordict's reduction's to say.
"""

from __future__ import annotations

import copyreg
from typing import Any

from .._deep import deep_reducers
from .._keys.sizes import metadata_size, sizes, tensor_nbytes
from .._wire import bootstrap
from .._wire.tensors import compact_stride, element_bytes, storable_as_bytes, tensor_args


def _consolidated(td: Any) -> dict[str, Any] | None:
    """The storage and metadata a consolidated ``TensorDict`` keeps, else ``None``."""
    found = getattr(td, "_consolidated", None)
    return found if found and found.get("metadata") is not None else None


@sizes.registers_lazy("tensordict._td", "TensorDict")
def tensordict_size(td: Any) -> int:
    """A consolidated ``TensorDict`` sends one storage (its leaves are views of it) and its
    metadata, sized from a sample of each container's members (a non-tensor entry holds a
    small value per row, by the hundred); any other is sized by walking its members."""
    consolidated = _consolidated(td)
    if consolidated is None:
        return -1
    return tensor_nbytes(consolidated["storage"]) + metadata_size(consolidated["metadata"])


def _leaf_ranges(metadata: dict[str, Any]) -> list[tuple[int, int]]:
    """Where each leaf lies in a consolidated storage, its nested TensorDicts' included."""
    ranges = [(leaf[2], leaf[3]) for leaf in metadata.get("leaves", {}).values()]
    for value in metadata.values():
        if isinstance(value, dict) and "leaves" in value:
            ranges += _leaf_ranges(value)
    return sorted(ranges)


@deep_reducers.registers_lazy("tensordict._td", "TensorDict")
def consolidated_members(td: Any) -> Any:
    """A consolidated ``TensorDict`` reduced so that deep sharing sees each leaf: its storage
    cut at the leaves' bounds, each leaf's bytes a member of its own and the padding between
    them inline, so that a leaf one chunk shares with another (the same rows, sent to the
    next worker group) is stored once. Only where tensordict's own reduction sends the
    consolidated storage (it decides whether that is current); any other ``TensorDict`` is
    pickled as usual."""
    if _consolidated(td) is None:
        return NotImplemented
    reduced: Any = copyreg.dispatch_table[type(td)](td)
    rebuild, args = reduced
    if getattr(rebuild, "__name__", "") != "_rebuild_tensordict_files_consolidated":
        return NotImplemented  # not sent as its consolidated storage
    metadata, storage = args
    if not storable_as_bytes(storage):
        return NotImplemented  # its storage not sent by torch's pickling, from the CPU
    flat = element_bytes(storage)
    pieces, at = [], 0
    for start, stop in _leaf_ranges(metadata):
        if start < at:
            return NotImplemented  # leaves that overlap: sent whole
        pieces += [flat[at:start].tobytes(), flat[start:stop]]
        at = stop
    pieces.append(flat[at:].tobytes())
    size, grad = storage.shape, storage.requires_grad
    sent = tensor_args(pieces, storage.dtype, 0, size, compact_stride(size), grad)
    return bootstrap.rebuild_consolidated, (rebuild, metadata, sent)
