"""The code a worker runs to rebuild what refshare stored; shipped by value.

Ray's cloudpickle sends this module's functions as code, so a worker without refshare
still runs them: it rebuilds tensors stored as bytes, and for a deep-shared argument fails
with one line that says what to do instead of a bare ``ModuleNotFoundError`` from deep
inside Ray. Keep it free of imports from refshare.
"""

from __future__ import annotations

from typing import Any, Literal

MISSING = (
    "this argument was deep-shared by refshare, which the Ray worker cannot import ({}): "
    "install refshare where the workers run (the driver's environment, or "
    "runtime_env={{'pip': ['refshare']}}), or turn deep sharing off (deep=False)"
)


def rebuild(*parts: Any) -> Any:
    """Rebuild a deep-shared argument with refshare's own code on the worker."""
    try:
        from refshare._deep import rebuild_skeleton
    except ImportError as error:
        raise ImportError(MISSING.format(error)) from None
    return rebuild_skeleton(*parts)


def rebuild_tensor(
    data: Any, dtype: Any, offset: int, size: Any, stride: Any, requires_grad: bool
) -> Any:
    """A CPU tensor from its storage's bytes, as torch's own unpickling would give it: on a
    writable storage of its own, with the same offset, size, stride and requires_grad."""
    import ctypes

    import numpy as np
    import torch

    source = np.frombuffer(data, dtype=np.uint8)
    storage = torch.empty(source.size, dtype=torch.uint8)
    if source.size:  # copied by address: through .numpy() torch could no longer resize it
        ctypes.memmove(storage.data_ptr(), source.ctypes.data, source.size)
    tensor = torch.empty(0, dtype=dtype).set_(storage.untyped_storage(), offset, size, stride)
    return tensor.requires_grad_() if requires_grad else tensor


def rebuild_strings(text: str, shape: Any, order: Literal["C", "F"]) -> Any:
    """An array of strings from their NUL-joined text, as numpy's unpickling would give it:
    a writable array of its own, of the same shape and memory order."""
    import numpy as np

    out = np.empty(shape, dtype=object, order=order)
    out.reshape(-1, order=order)[:] = text.split("\0")
    return out
