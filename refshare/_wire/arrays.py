"""What numpy's pickling sends of an array: its dtype, its memory order, its bytes."""

from __future__ import annotations

import pickle
import sys
from typing import Any, Literal

#: The memory layout of an array: C or F contiguous, or neither (a strided view).
Order = Literal["C", "F", "N"]

#: Tokens of builtin dtypes, by identity: ``id -> (dtype, token)``, the dtype held so that
#: its id is not recycled. Only builtin dtypes are kept: they have no fields, no metadata and
#: nothing that can be changed in place (a structured dtype's ``names`` can).
_dtype_tokens: dict[int, tuple[Any, bytes]] = {}


def dtype_token(dtype: Any) -> bytes:
    """What Ray's pickling sends of ``dtype``: its pickle, exact where ``==`` is not (a dtype
    with ``metadata``, an aligned or ``np.record`` struct compare equal to the plain one)."""
    entry = _dtype_tokens.get(id(dtype))
    if entry is not None and entry[0] is dtype:
        return entry[1]
    token = pickle.dumps(dtype, protocol=5)
    if dtype.isbuiltin == 1:
        if len(_dtype_tokens) >= 1024:
            _dtype_tokens.clear()
        _dtype_tokens[id(dtype)] = (dtype, token)
    return token


def memory_order(arr: Any) -> Order:
    """``"C"`` or ``"F"`` for a contiguous array (C first, for one that is both), else
    ``"N"``."""
    flags = arr.flags
    if flags.c_contiguous:
        return "C"
    return "F" if flags.f_contiguous else "N"


def pickle_order(arr: Any) -> Literal["C", "F"]:
    """The order numpy pickles an array's elements in: F for an F-contiguous array, else C."""
    return "F" if memory_order(arr) == "F" else "C"


def flat_bytes(arr: Any) -> tuple[Order, Any]:
    """The array's layout and its bytes as a flat uint8 array in that order: a view of a
    contiguous array, a copy in C order of any other (what numpy's pickling sends)."""
    order = memory_order(arr)
    if order == "C":
        return order, arr.reshape(-1).view("u1")
    if order == "F":
        return order, arr.T.reshape(-1).view("u1")
    import numpy as np

    return order, np.ascontiguousarray(arr).reshape(-1).view("u1")


def array_bytes(arr: Any) -> tuple[Literal["C", "F"], bool, Any] | None:
    """What numpy's protocol-5 pickling sends of an exact array of fixed-size elements: the
    order it rebuilds it in, whether it rebuilds an array of its own from a copy sent
    in-band (a strided array, or one that exports no buffer: a datetime's) rather than a
    view of the bytes sent out of band, and those bytes (see :func:`flat_bytes`). ``None``
    for any other array, and anything else."""
    numpy = sys.modules.get("numpy")
    if numpy is None or type(arr) is not numpy.ndarray:
        return None
    if arr.dtype.hasobject or not arr.dtype.itemsize:
        return None
    order, data = flat_bytes(arr)
    if order == "N":
        return "C", True, data
    try:
        pickle.PickleBuffer(arr)
    except (BufferError, ValueError):  # as numpy's own reduction falls back
        return order, True, data
    return order, False, data
