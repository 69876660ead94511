"""What a receiver has of a value: one canonical description of a received object graph.

Verify mode compares two received copies of an argument, what Ray by value gives and what
refshare's stored object gives, by this description (see ``refshare._verify``). It reads
objects as they are: a class's pickling code never runs, but that of Python's standard
library, numpy and torch, whose reductions only read. An object whose state it cannot read
so is :class:`CannotDescribe`, and verify then fails closed.

It imports nothing of refshare but ``leaves`` (arrays and tensors): Ray ships both by value
to the workers (``verify="worker"``).
"""

from __future__ import annotations

import _thread
import marshal
import sys
import types
import weakref
from collections import OrderedDict, defaultdict
from typing import Any, NamedTuple

from .leaves import CannotDescribe, array, digest, new_hasher, shared_memory, tensor

#: Packages whose classes' reductions are read to describe their objects: they only read.
TRUSTED = frozenset(sys.stdlib_module_names) | {"numpy", "torch"}
#: What pickle calls to reduce an object; defined outside :data:`TRUSTED`, never run here.
HOOKS = ("__reduce_ex__", "__reduce__", "__getstate__", "__getnewargs_ex__", "__getnewargs__")
_HEAPTYPE = 1 << 9
_SHORT = 64  # atoms longer than this are described by their digest
__all__ = ["CannotDescribe", "Description", "describe", "first_difference"]


class Description(NamedTuple):
    """A digest of what a receiver has, and (``paths``) each token with where it lies."""

    digest: bytes
    tokens: list[tuple[str, tuple[Any, ...]]] | None


def describe(value: Any, paths: bool = False) -> Description:
    """The description of ``value`` as received; raises :class:`CannotDescribe` (or what
    reading it raised) where it cannot be described."""
    describer = _Describer(paths)
    describer.visit(value, "value")
    shared_memory(describer)
    return Description(describer.hasher.digest(), describer.tokens)


def first_difference(expected: Description, got: Description) -> str:
    """Where two descriptions made with ``paths`` first differ, readably."""
    a, b = expected.tokens or [], got.tokens or []
    for (where, x), (_, y) in zip(a, b, strict=False):
        if x != y:
            return f"at {where}: by value {x!r:.300}, refshare {y!r:.300}"
    longer, side = (a, "by value") if len(a) > len(b) else (b, "refshare")
    where, token = longer[min(len(a), len(b))] if longer else ("value", ())
    return f"at {where}: only {side} has {token!r:.300}"


def _name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', '?')}"


def _text(tag: str, value: Any, data: bytes) -> tuple[Any, ...]:
    return (tag, value) if len(data) <= _SHORT else (tag, len(data), digest(data))


_ATOMS: dict[type, Any] = {
    type(None): lambda x: ("None",),
    bool: lambda x: ("bool", x),
    int: lambda x: ("int", x),
    float: lambda x: ("float", x.hex()),
    complex: lambda x: ("complex", x.real.hex(), x.imag.hex()),
    str: lambda x: _text("str", x, x.encode("utf-8", "surrogatepass")),
    bytes: lambda x: _text("bytes", x, x),
}
#: Builtin bases whose part of an instance is read directly (a subclass adds attributes).
_BASES = (OrderedDict, defaultdict, dict, list, tuple, set, frozenset, str, bytes, int, float,
          complex, bytearray, BaseException)  # fmt: skip


def _package(obj: Any) -> str:
    return str(getattr(obj, "__module__", None) or "").partition(".")[0]


def _hook_package(hook: Any, owner: type) -> str:
    """The package whose code a hook runs: a Python function's by its globals (a wrapper
    copies ``__module__``, not those), a C method's by its class."""
    function = getattr(hook, "__func__", hook)
    globals_ = getattr(function, "__globals__", None)
    if isinstance(globals_, dict):
        return str(globals_.get("__name__") or "").partition(".")[0]
    return _package(owner)


def _trusted(cls: type) -> bool:
    """Whether ``cls`` and each pickling hook it resolves are of a trusted package."""
    if _package(cls) not in TRUSTED:
        return False
    for hook in HOOKS:
        for base in cls.__mro__:
            if hook in base.__dict__:
                if base is not object and _hook_package(base.__dict__[hook], base) not in TRUSTED:
                    return False
                break
    return True


def _python_layout(cls: type, stop: type) -> bool:
    """Whether each class from ``cls`` down to ``stop`` adds to an instance nothing but its
    ``__dict__``, weak references and slots: no state that only C code can read."""
    while cls is not stop and cls is not object:
        base = cls.__base__
        assert base is not None
        if cls.__basicsize__ != base.__basicsize__ or cls.__itemsize__ != base.__itemsize__:
            if not cls.__flags__ & _HEAPTYPE:
                return False
            slots = sum(type(v) is types.MemberDescriptorType for v in vars(cls).values())
            if not 0 <= cls.__basicsize__ - base.__basicsize__ - 8 * slots <= 16:
                return False
        cls = base
    return True


def _slot_names(cls: type) -> list[tuple[type, str]]:
    found = []
    for base in cls.__mro__:
        slots = base.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__"):
                mangled = f"_{base.__name__.lstrip('_')}{name}" if name.startswith("__") else name
                found.append((base, mangled))
    return found


class _Describer:
    """One pass: an object reached twice is named by its first visit; the digest covers
    a token stream that delimits every object, so no two graphs give one stream."""

    def __init__(self, paths: bool = False) -> None:
        self.hasher = new_hasher()
        self.tokens: list[tuple[str, tuple[Any, ...]]] | None = [] if paths else None
        self.trail: list[Any] = []
        self.first: dict[int, int] = {}
        self.held: list[Any] = []  # what was visited: no id is recycled during the pass
        self.storages: dict[int, int] = {}
        self.regions: list[tuple[int, int, int, bool, Any]] = []
        self.dtypes: dict[int, str] = {}
        self.trust: dict[type, bool] = {}

    def emit(self, *token: Any) -> None:
        self.hasher.update(repr(token).encode("utf-8", "surrogatepass") + b"\n")
        if self.tokens is not None:
            where = "".join(x if isinstance(x, str) else f"[{x[0]!r}]" for x in self.trail)
            self.tokens.append((where, token))

    def visit(self, obj: Any, label: Any) -> None:
        self.trail.append(label)
        try:
            atom = _ATOMS.get(type(obj))
            if atom is not None:
                self.emit(*atom(obj))
                return
            index = self.first.get(id(obj))
            if index is not None:
                self.emit("same", index)
                return
            index = self.first[id(obj)] = len(self.held)
            self.held.append(obj)
            self.body(obj, type(obj), index)
        finally:
            self.trail.pop()

    def items(self, items: Any) -> None:
        items = list(items)
        self.emit("items", len(items))
        for i, item in enumerate(items):
            self.visit(item, (i,))

    def pairs(self, pairs: Any) -> None:
        pairs = list(pairs)
        self.emit("pairs", len(pairs))
        for key, item in pairs:
            self.visit(key, ".key")
            self.visit(item, (key,) if type(key) in _ATOMS else "[...]")

    def multiset(self, items: Any) -> None:
        """A set's members in an order of their content: its own order follows hashes,
        which for identity-hashed objects are addresses."""
        items = list(items)
        order = sorted(range(len(items)), key=lambda i: self.standalone(items[i]))
        self.emit("members", len(items))
        for i in order:
            self.visit(items[i], "{member}")

    @staticmethod
    def standalone(item: Any) -> bytes:
        alone = _Describer()
        alone.visit(item, "")
        return bytes(alone.hasher.digest())

    def body(self, obj: Any, cls: type, index: int) -> None:
        numpy, torch = sys.modules.get("numpy"), sys.modules.get("torch")
        if cls is list or cls is tuple:
            self.emit(cls.__name__)
            self.items(obj)
        elif cls is dict:
            self.emit("dict")
            self.pairs(dict.items(obj))
        elif cls is set or cls is frozenset:
            self.emit(cls.__name__)
            self.multiset(obj)
        elif numpy is not None and isinstance(obj, numpy.generic):
            self.emit("scalar", _name(cls))
            array(self, numpy.asarray(obj), index)
        elif numpy is not None and isinstance(obj, numpy.ndarray):
            self.emit("ndarray", _name(cls))
            plain = obj if cls is numpy.ndarray else numpy.ndarray.view(obj, numpy.ndarray)
            array(self, plain, index)
            self.state(obj, cls)
        elif torch is not None and isinstance(obj, torch.Tensor):
            self.emit("tensor", _name(cls))
            nested = tensor(self, obj, index)
            # A nested tensor's sizes hold its ragged dimension's id, new in each process's
            # each unpickling: its parts say what it holds.
            self.state(obj, cls, ("_size", "_strides") if nested else ())
        elif isinstance(obj, type):
            self.emit("type", _name(obj))
        elif cls is types.FunctionType:
            self.function(obj)
        elif cls is types.BuiltinFunctionType:
            self.emit("builtin", _name(obj))
            if not isinstance(obj.__self__, types.ModuleType | None):
                self.visit(obj.__self__, ".__self__")
        elif cls is types.ModuleType:
            self.emit("module", obj.__name__)
        elif cls is _thread.LockType or cls is _thread.RLock:  # a __setstate__ made it
            self.emit(cls.__name__, obj.locked() if cls is _thread.LockType else obj._is_owned())
        elif cls is weakref.ReferenceType:  # a __setstate__ made it: by what it points to
            self.emit("weakref")
            self.visit(obj(), "()")
        elif not self.ray_handle(obj, cls):
            self.instance(obj, cls)

    def ray_handle(self, obj: Any, cls: type) -> bool:
        """An ``ObjectRef`` or an actor handle, by what it names."""
        ray = sys.modules.get("ray")
        if ray is None:
            return False
        if isinstance(obj, ray.ObjectRef):
            self.emit("ObjectRef", _name(cls), obj.binary().hex())
        elif isinstance(obj, ray.actor.ActorHandle):
            self.emit("ActorHandle", obj._actor_id.hex())
        else:
            return False
        return True

    def function(self, f: Any) -> None:
        self.emit("function", _name(f), digest(marshal.dumps(f.__code__)))
        self.visit(f.__defaults__, "__defaults__")
        self.visit(f.__kwdefaults__, "__kwdefaults__")
        cells = f.__closure__ or ()
        self.emit("closure", len(cells))
        for i, cell in enumerate(cells):
            try:
                content = cell.cell_contents
            except ValueError:
                self.emit("empty cell")
            else:
                self.visit(content, f"<cell {i}>")
        self.visit(f.__dict__, "__dict__")

    def instance(self, obj: Any, cls: type) -> None:
        base = next((b for b in cls.__mro__ if b in _BASES), object)
        try:
            attributes = object.__getattribute__(obj, "__dict__")
        except AttributeError:
            attributes = {}
        hooked = any(name in attributes for name in HOOKS)
        trusted = self.trust.get(cls)
        if trusted is None:
            trusted = self.trust[cls] = _trusted(cls)
        if trusted and not hooked:
            self.reduced(obj, cls)
            return
        if not _python_layout(cls, base):
            raise CannotDescribe(f"{_name(cls)} holds state only its own pickling reads")
        self.emit("object", _name(cls), base.__name__)
        if base is not object:
            self.base_part(obj, base)
        self.state(obj, cls)

    def reduced(self, obj: Any, cls: type) -> None:
        """An object of a trusted class, by its own reduction (which only reads)."""
        try:
            reduce_ex: Any = cls.__reduce_ex__
            reduction = reduce_ex(obj, 4)
        except Exception as error:
            raise CannotDescribe(f"{_name(cls)}: {error}") from error
        if isinstance(reduction, str):
            self.emit("global", _name(cls), reduction)
            return
        self.emit("reduced", _name(cls), len(reduction))
        for i, part in enumerate(reduction):
            if i in (3, 4) and part is not None:
                part = list(part)  # iterators of list items and dict items
            self.visit(part, f"<reduce {i}>")

    def base_part(self, obj: Any, base: Any) -> None:
        """The part of ``obj`` its builtin ``base`` holds, read through the base's methods."""
        if issubclass(base, dict):
            self.pairs(base.items(obj))
            if base is defaultdict:
                self.visit(vars(defaultdict)["default_factory"].__get__(obj), "default_factory")
        elif base in (list, tuple):
            self.items(base.__iter__(obj))
        elif base in (set, frozenset):
            self.multiset(base.__iter__(obj))
        elif base is bytearray:
            self.emit("bytearray", len(obj), digest(memoryview(obj)))
        elif base is BaseException:
            self.visit(vars(BaseException)["args"].__get__(obj), "args")
        else:
            self.visit(base.__getnewargs__(obj)[0], "value")

    def state(self, obj: Any, cls: type, skip: tuple[str, ...] = ()) -> None:
        """An instance's ``__dict__`` and slots, read without running its code."""
        try:
            attributes = object.__getattribute__(obj, "__dict__")
        except AttributeError:
            attributes = None
        if attributes:
            self.emit("attributes")
            self.pairs((k, v) for k, v in dict.items(attributes) if k not in skip)
        for owner, name in _slot_names(cls):
            slot = owner.__dict__.get(name)
            if type(slot) is not types.MemberDescriptorType:
                continue
            try:
                value = slot.__get__(obj, cls)
            except AttributeError:
                self.emit("unset slot", name)
                continue
            self.emit("slot", name)
            self.visit(value, f".{name}")
