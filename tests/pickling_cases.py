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
