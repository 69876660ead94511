"""Classes whose pickling the rule tests change from outside (``test_pickling_rules.py``):
defined here, in a module of their own, so that a hook the tests assign is another
package's code, as a program patching a framework's class would assign it."""

from __future__ import annotations

from typing import Any

import numpy as np

#: Read by :class:`Scaled`'s pickling: state outside the value.
SCALE = 1


class Box:
    """A plain class a test registers a reader for: its array and its note."""

    def __init__(self, data: np.ndarray, note: str) -> None:
        self.data, self.note = data, note


class Relabelled:
    """What a hook on a :class:`Box` instance sends instead of the box."""

    def __init__(self, data: np.ndarray, label: str) -> None:
        self.data, self.label = data, label


def relabelled(data: np.ndarray, label: str) -> Relabelled:
    return Relabelled(data, label)


class Scaled:
    """A class whose pickling reads a module global: its state does not say what it sends."""

    def __init__(self, data: np.ndarray) -> None:
        self.data = data

    def __reduce__(self) -> tuple[Any, ...]:
        return scaled, (self.data, SCALE)


def scaled(data: np.ndarray, factor: int) -> Scaled:
    value = Scaled(data)
    value.factor = factor  # type: ignore[attr-defined]
    return value


class Proto:
    """A batch as verl's ``DataProto`` is one: its pickling hook sends its batch (a dict of
    tensors) and its ``meta``; a test registers a reader and a deep reduction for it."""

    def __init__(self, batch: dict[str, Any], meta: dict[str, Any]) -> None:
        self.batch, self.meta = batch, meta

    def __getstate__(self) -> dict[str, Any]:
        return {"batch": dict(self.batch), "meta": self.meta}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.batch, self.meta = state["batch"], state["meta"]


def proto(batch: dict[str, Any], meta: dict[str, Any]) -> Proto:
    return Proto(batch, meta)


#: The dtype the serializers below send arrays and tensors as: state outside the value.
WIRE = "float32"


def array_to_wire(arr: np.ndarray) -> tuple[bytes, str, tuple[int, ...]]:
    """A serializer a program registers for numpy arrays: their values, as :data:`WIRE`."""
    return arr.astype(WIRE).tobytes(), WIRE, arr.shape


def array_from_wire(parts: tuple[bytes, str, tuple[int, ...]]) -> np.ndarray:
    data, dtype, shape = parts
    return np.frombuffer(data, dtype=dtype).reshape(shape).copy()


def tensor_to_wire(t: Any) -> np.ndarray:
    """A serializer a program registers for tensors: their values, as :data:`WIRE`."""
    return t.detach().numpy().astype(WIRE)


def tensor_from_wire(arr: np.ndarray) -> Any:
    import torch

    return torch.from_numpy(arr)
