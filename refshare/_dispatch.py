"""Tables keyed by type, whose entries for other packages' classes wait until those are in use."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Generic, TypeVar

V = TypeVar("V")
F = TypeVar("F")


#: Whether an entry registered for a class (the second) applies to a class (the first).
Applies = Callable[[type, type], bool]


class TypeTable(Generic[V]):
    """Values keyed by class: looked up along the MRO, or for the exact class only.

    An entry for a class of another package (numpy, torch, a framework) is registered by
    module and name with :meth:`register_lazy`, and filled in once that module is imported
    by the program: refshare never imports a package the user's own code has not.

    ``applies`` restricts what :meth:`lookup` finds: an entry registered for a class
    applies to a class only where ``applies(cls, registered)`` holds, asked on every
    look-up (the tables of readers use ``refshare._rules.pickles_as``).
    """

    def __init__(self, applies: Applies | None = None) -> None:
        self._applies = applies
        self._entries: dict[type, V] = {}
        #: Class -> the registered class whose entry it finds along its MRO.
        self._owners: dict[type, type] = {}
        #: Classes resolved for good: no entry waiting for a module could apply to them.
        self._settled: set[type] = set()
        #: Top-level package -> the entries waiting for one of its modules to be imported.
        self._lazy: dict[str, list[tuple[str, str, V]]] = {}
        #: Counts the changes to the table: what was worked out from it is then done again.
        self.version = 0

    def register(self, cls: type, value: V, *, replace: bool = True) -> None:
        if replace or cls not in self._entries:
            self._entries[cls] = value
            self._owners.clear()
            self._settled.clear()
            self.version += 1

    def register_lazy(self, module: str, name: str, value: V) -> None:
        """Register ``value`` for ``module.name`` once that module is in ``sys.modules``; an
        entry already registered for that class is kept."""
        self._lazy.setdefault(module.partition(".")[0], []).append((module, name, value))
        self._owners.clear()
        self._settled.clear()
        self.version += 1

    def registers(self, *classes: type) -> Callable[[F], F]:
        """Decorator: register the function it decorates for ``classes``."""

        def register(value: F) -> F:
            for cls in classes:
                self.register(cls, value)  # type: ignore[arg-type]
            return value

        return register

    def registers_lazy(self, module: str, *names: str) -> Callable[[F], F]:
        """Decorator: :meth:`register_lazy` the function it decorates for ``module.name``."""

        def register(value: F) -> F:
            for name in names:
                self.register_lazy(module, name, value)  # type: ignore[arg-type]
            return value

        return register

    def _load(self, cls: type) -> None:
        root = getattr(cls, "__module__", "").partition(".")[0]
        waiting = self._lazy.get(root)
        if not waiting:
            return
        left = []
        for module, name, value in waiting:
            found = getattr(sys.modules.get(module), name, None)
            if isinstance(found, type):
                self.register(found, value, replace=False)
            else:
                left.append((module, name, value))  # not imported yet, or moved
        if left:
            self._lazy[root] = left
        else:
            del self._lazy[root]

    def _waiting(self, cls: type) -> bool:
        """Whether an entry may still arrive for ``cls`` or one of its bases."""
        lazy = self._lazy
        return bool(lazy) and any(
            getattr(base, "__module__", "").partition(".")[0] in lazy for base in cls.__mro__
        )

    def exact(self, cls: type) -> V | None:
        """The value registered for ``cls`` itself (subclasses may carry state of their own)."""
        found = self._entries.get(cls)
        if found is None and self._lazy:
            self._load(cls)
            found = self._entries.get(cls)
        return found

    def lookup(self, cls: type) -> V | None:
        """The value for ``cls`` or its nearest registered base class, where it applies.

        Which base holds the entry is cached per class; whether it applies is asked each
        time, so a class whose pickling changed since is not read as it was."""
        owner = self._owners.get(cls)
        if owner is None and cls not in self._settled:
            for base in cls.__mro__:
                self._load(base)
            owner = next((b for b in cls.__mro__ if b in self._entries), None)
            if owner is not None:
                self._owners[cls] = owner
            if owner is not None or not self._waiting(cls):
                self._settled.add(cls)
        if owner is None or (self._applies is not None and not self._applies(cls, owner)):
            return None
        return self._entries[owner]

    def __bool__(self) -> bool:
        return bool(self._entries)
