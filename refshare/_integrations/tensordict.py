"""tensordict's ``TensorDict``, as verl and others send it."""

from __future__ import annotations

from typing import Any

from .._keys.tables import builtin_fingerprints


@builtin_fingerprints.registers_lazy("tensordict._td", "TensorDict")
def tensordict_fingerprint(td: Any) -> Any:
    """What pickling a ``TensorDict`` sends: its attributes (its tensors send their whole
    storages, as in any pickle), taken in sorted order, since a ``clone()`` holds the same
    attributes in another order, which the worker's unpickling cannot tell apart."""
    return sorted(td.__getstate__().items())
