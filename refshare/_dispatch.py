"""Tables keyed by type, whose numpy and torch entries are added only once those are in use."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Generic, TypeVar

V = TypeVar("V")


class TypeTable(Generic[V]):
    """Values keyed by class: looked up along the MRO, or for the exact class only.

    ``lazy`` maps a top-level package name ("numpy", "torch") to a function that fills in
    that package's entries. It runs when an object of that package is first looked up, so
    refshare never imports a package the user's own code has not. A function that returns
    ``False`` found the module it looks for not imported yet, and runs again next time.
    """

    def __init__(
        self, lazy: dict[str, Callable[[TypeTable[V]], bool | None]] | None = None
    ) -> None:
        self._entries: dict[type, V] = {}
        self._resolved: dict[type, V | None] = {}
        self._lazy = dict(lazy or {})

    def register(self, cls: type, value: V, *, replace: bool = True) -> None:
        if replace or cls not in self._entries:
            self._entries[cls] = value
            self._resolved.clear()

    def _load(self, cls: type) -> None:
        root = getattr(cls, "__module__", "").partition(".")[0]
        if root in self._lazy and root in sys.modules and self._lazy[root](self) is not False:
            del self._lazy[root]

    def exact(self, cls: type) -> V | None:
        """The value registered for ``cls`` itself (subclasses may carry state of their own)."""
        found = self._entries.get(cls)
        if found is None and self._lazy:
            self._load(cls)
            found = self._entries.get(cls)
        return found

    def add_lazy(self, root: str, fill: Callable[[TypeTable[V]], bool | None]) -> None:
        """Have ``fill`` add the entries of package ``root`` once that package is in use."""
        self._lazy[root] = fill
        self._resolved.clear()

    def lookup(self, cls: type) -> V | None:
        """The value for ``cls`` or its nearest registered base class, cached per class."""
        try:
            found = self._resolved[cls]
            if found is not None or not self._lazy:
                return found
        except KeyError:
            pass
        for base in cls.__mro__:
            self._load(base)
        found = next((self._entries[b] for b in cls.__mro__ if b in self._entries), None)
        self._resolved[cls] = found
        return found

    def __bool__(self) -> bool:
        return bool(self._entries)
