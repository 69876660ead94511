"""The rules that keep refshare exact: what a value is to pickle, what a reader may key.

**Pickle's order, in one place.** Ray's pickler decides how a value is sent in a fixed
order: a class or function goes through cloudpickle's ``reducer_override`` (as code, or by
name); then the dispatch tables, for the exact class only (Ray's registered serializers,
cloudpickle's own reducers, ``copyreg``'s); then the value's ``__reduce_ex__``, found on the
instance before its class, then ``__reduce__``, ``__getstate__``, and the rest of
:data:`PICKLING_HOOKS`. :class:`PickleOrder` asks that question and names the answer
(:class:`Kind`); the fingerprint pass, the splitter, the structure stamp and the sizing
each act on the kind in their own way.

Two rules bound each fast path (a reader that keys a framework's batch without pickling it,
a reduction that splits it into members), which the type tables of readers apply:

- **A reader is an allow-list.** It returns what it has read in full of what the value's
  pickling sends, or ``NotImplemented``, which hands the value to the exact path (the
  pickling pass, or Ray's own pickle). A deep reduction splits only what the worker's
  rebuild reproduces exactly.
- **A reader registered for a class reads a subclass only if it pickles as the class
  does** (:func:`pickles_as`); the class only while its pickling is its own package's
  (:func:`pickling_is_its_packages`: no reducer registered, no hook assigned or wrapped by
  other code, :func:`code_package`); no instance with a hook of its own
  (:func:`instance_hooks`).

The third rule, what a stamp may vouch for within a call, lives with the stamps
(``refshare._keys.stamps.vouches_for``); the fourth, what verify compares, in ``_verify``.
"""

from __future__ import annotations

import copyreg
import enum
import os
import pickle
import sys
import types
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

#: What pickle consults to send an instance, after the dispatch tables (exact class only).
PICKLING_HOOKS = (
    "__reduce_ex__", "__reduce__", "__getstate__", "__setstate__", "__getnewargs_ex__",
    "__getnewargs__",
)  # fmt: skip
_SENDING_HOOKS = PICKLING_HOOKS[:3]  # (the others rebuild what is sent, or pass arguments)

# -- the dispatch tables ------------------------------------------------------------------------

_tables: list[Any] = [copyreg.dispatch_table]


def _dispatch_tables() -> list[Any]:
    """The tables pickle looks an exact class up in: ``copyreg``'s, and Ray's cloudpickle's."""
    if len(_tables) == 1:
        cloudpickle = sys.modules.get("ray.cloudpickle")
        pickler = getattr(cloudpickle, "CloudPickler", None)
        maps = getattr(getattr(pickler, "dispatch_table", None), "maps", None) or ()
        _tables.extend(table for table in maps if table is not copyreg.dispatch_table)
    return _tables


def pickling_epoch() -> tuple[int, ...]:
    """Changes whenever an entry is added to a dispatch table (a structure stamp holds it)."""
    return tuple(map(len, _dispatch_tables()))


def dispatch_entry(cls: type) -> Any:
    """The reducer a dispatch table holds for exactly ``cls``, or ``None``: Ray's
    registered serializers win over ``copyreg``'s, as in Ray's pickler."""
    found = None
    for table in _tables if len(_tables) > 1 else _dispatch_tables():
        found = table.get(cls, found)  # (the later table wins)
    return found


def registered_with_ray(entry: Any) -> bool:
    """Whether a dispatch-table entry is Ray's reducer for a serializer the program registered
    (``ray.util.register_serializer``): its deserializer makes what a worker receives."""
    code = getattr(entry, "__code__", None)
    return code is not None and "custom_serializer" in code.co_freevars


# -- whose code a hook or a reducer is ----------------------------------------------------------


def package_of(obj: object) -> str:
    """The top-level package an object (a class, a function) names as its own."""
    return str(getattr(obj, "__module__", None) or "").partition(".")[0]


_C_METHODS = (types.MethodDescriptorType, types.WrapperDescriptorType,
              types.ClassMethodDescriptorType)  # fmt: skip


def _compiled_in(code: types.CodeType, module: str) -> bool:
    """Whether ``code`` was compiled from the file of the module ``module`` (not checked for
    a module without a file, as a framework's code published under its names)."""
    where, file = code.co_filename, getattr(sys.modules.get(module), "__file__", None)
    stem = os.path.splitext
    return not file or where.startswith("<") or stem(where)[0] == stem(file)[0]


def code_package(hook: object) -> str | None:
    """The top-level package whose very code ``hook`` is (a plain function's ``__module__``,
    where it was compiled there; a C method's class's), by what a wrapper cannot copy:
    ``None`` for one (``functools.wraps``: ``__wrapped__``, a code object of its own; wrapt:
    a proxy type), or for any other callable."""
    if type(hook) is staticmethod or type(hook) is classmethod:
        hook = hook.__func__
    if type(hook) is types.FunctionType:
        code = hook.__code__
        name = getattr(code, "co_qualname", code.co_name)  # (Python 3.10: no co_qualname)
        own = hook.__qualname__ if hasattr(code, "co_qualname") else hook.__name__
        if "__wrapped__" in hook.__dict__ or name != own:
            return None
        module = hook.__module__ or ""
        return module.partition(".")[0] if _compiled_in(code, module) else None
    if isinstance(hook, _C_METHODS):
        return package_of(hook.__objclass__)
    if type(hook) is types.BuiltinFunctionType:
        owner = hook.__self__
        if isinstance(owner, types.ModuleType):
            return owner.__name__.partition(".")[0]
        return package_of(owner if isinstance(owner, type) else type(owner))
    return None


# -- a class's pickling -------------------------------------------------------------------------

_slot_names: dict[type, tuple[str, ...]] = {}


def slot_names(cls: type) -> tuple[str, ...]:
    """The ``__slots__`` members of ``cls`` and its bases, ``__dict__`` and ``__weakref__``
    left out (a slotted dataclass has no ``__dict__``); fixed once the class exists."""
    names = _slot_names.get(cls)
    if names is None:
        found: dict[str, None] = {}
        for base in cls.__mro__:
            slots = base.__dict__.get("__slots__", ())
            found.update(dict.fromkeys((slots,) if isinstance(slots, str) else slots))
        found.pop("__dict__", None)
        found.pop("__weakref__", None)
        names = _slot_names[cls] = tuple(found)
    return names


def pickling_of(cls: type) -> tuple[object, ...]:
    """Everything that decides how pickle sends an instance of ``cls``: its dispatch entry
    and each hook as it resolves them now (a program may assign a hook at any time), by
    identity (a wrapt proxy compares equal to what it wraps), its slots, its ``__dict__``."""
    parts = (dispatch_entry(cls), *[getattr(cls, name, None) for name in PICKLING_HOOKS])
    return tuple(map(id, parts)), parts, slot_names(cls), bool(cls.__dictoffset__)


_IMMUTABLE_TYPE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE: no code can assign a hook to it
#: Per class: its MRO, and the namespaces in it that code can change (of Python classes).
_namespaces: dict[type, tuple[tuple[type, ...], list[Any]]] = {}


def pickling_now(cls: type) -> object:
    """What tells a change to how ``cls`` pickles, cheaper than :func:`pickling_of`: its
    dispatch entry, and the hooks in each namespace of its MRO that code can change."""
    found = _namespaces.get(cls)
    if found is None or found[0] is not cls.__mro__:
        mutable = [b.__dict__ for b in cls.__mro__ if not b.__flags__ & _IMMUTABLE_TYPE]
        found = _namespaces[cls] = (cls.__mro__, mutable)
    hooks: list[Any] = [None]  # its dispatch entry, as dispatch_entry finds it (inlined)
    for table in _tables if len(_tables) > 1 else _dispatch_tables():
        hooks[0] = table.get(cls, hooks[0])
    if not found[1]:
        return id(hooks[0]), hooks
    for space in found[1]:
        hooks.extend(map(space.get, PICKLING_HOOKS))
    return tuple(map(id, hooks)), hooks, cls.__module__


def _kept_per_class(work_out: Callable[[type], bool]) -> Callable[[type], bool]:
    """``work_out``, its answer for each class kept while :func:`pickling_now` holds."""
    kept: dict[type, tuple[object, bool]] = {}

    def answer(cls: type) -> bool:
        now = pickling_now(cls)
        found = kept.get(cls)
        if found is None or found[0] != now:
            found = kept[cls] = (now, work_out(cls))
        return found[1]

    return answer


#: Packages whose functions may stand as a class's pickling hooks without being its own:
#: Python's defaults, and the hooks ``dataclasses`` and ``copyreg`` make for a class.
_HOOK_MAKERS = frozenset(("builtins", "copyreg", "dataclasses"))


def _hooks_of_its_package(cls: type) -> bool:
    """Whether each hook ``cls`` resolves is its holder's package's very code, or Python's."""
    for name in PICKLING_HOOKS:
        for base in cls.__mro__:
            hook = base.__dict__.get(name)
            if hook is not None:
                package = code_package(hook)
                if package not in _HOOK_MAKERS and package != package_of(base):
                    return False
                break
    return True


_hooks_are_its_packages = _kept_per_class(_hooks_of_its_package)


def pickling_is_its_packages(cls: type) -> bool:
    """Whether ``cls`` pickles as the code that defined it says (the safe answer): its
    dispatch entry, if any, is its own package's (tensordict's for ``TensorDict``), and each
    hook it resolves is the very code of the package of the class that holds it, or
    Python's; not a reducer registered, or a hook assigned or wrapped, by other code."""
    entry = dispatch_entry(cls)
    if entry is not None and _reducer_package(entry) != package_of(cls):
        return False
    return _hooks_are_its_packages(cls)


#: Packages whose pickling code only rearranges what an object holds: walked by keys.
TRUSTED_PICKLING = frozenset(
    {
        "builtins", "collections", "copyreg", "dataclasses", "datetime", "decimal", "enum",
        "fractions", "functools", "ipaddress", "pathlib", "re", "types", "typing", "uuid",
        "numpy", "torch", "tensordict", "ray",
    }
)  # fmt: skip


def _reducer_package(entry: Any) -> str | None:
    """The package whose very code a dispatch entry is; ``None`` for a serializer registered
    with Ray (the program's, whatever it calls) or a wrapper."""
    return None if registered_with_ray(entry) else code_package(entry)


def _by_own_code(cls: type) -> bool:
    """Whether pickling ``cls`` runs code from outside :data:`TRUSTED_PICKLING`."""
    entry = dispatch_entry(cls)
    if entry is not None:  # pickle asks it before any hook
        return _reducer_package(entry) not in TRUSTED_PICKLING
    for name in _SENDING_HOOKS:
        for base in cls.__mro__:
            if name in base.__dict__:
                if base is not object and code_package(base.__dict__[name]) not in TRUSTED_PICKLING:
                    return True
                break
    return False


#: Whether pickling ``cls`` runs code from outside :data:`TRUSTED_PICKLING` (the unsafe
#: answer): a reducer registered for it (``copyreg``, Ray's), or else a ``__reduce_ex__``,
#: ``__reduce__`` or ``__getstate__`` that may serialize on its own, or wraps one.
pickles_by_own_code = _kept_per_class(_by_own_code)


def instance_hooks(obj: object) -> bool:
    """Whether ``obj`` holds a pickling hook in its own ``__dict__``, which pickle finds
    before its class's (no reader of its class may read it)."""
    state = getattr(obj, "__dict__", None)
    return type(state) is dict and bool(state) and not state.keys().isdisjoint(PICKLING_HOOKS)


def pickles_as(cls: type, registered: type) -> bool:
    """Whether a reader registered for ``registered`` may read an instance of ``cls``:
    ``registered`` pickles as its own package says, and ``cls`` exactly as it does."""
    if not pickling_is_its_packages(registered):
        return False
    return cls is registered or pickling_of(cls) == pickling_of(registered)


# -- what a value is, to pickle -----------------------------------------------------------------


class Kind(enum.Enum):
    """What a value is to Ray's pickler, in the order its pickling decides it."""

    HANDLE = "an object ref or an actor handle: Ray alone keeps what it names alive"
    CODE = "a class or function Ray sends as code"
    NAMED = "a class or function Ray sends by name"
    LEAF = "a leaf refshare digests itself, pickled as its package says"
    HOOKED = "an instance holding a pickling hook of its own"
    READ = "an instance a registered reader reads"
    OWN_CODE = "an instance pickled by code of its own, outside the trusted packages"
    PLAIN = "a container or plain object, pickled by trusted code"


class Rule(NamedTuple):
    """What pickle does with an instance of one class, or with one value."""

    kind: Kind
    #: The leaf's digest (``LEAF``) or the reader (``READ``), from the walker's tables.
    entry: Any = None
    #: What an instance is when its reader declines it: ``OWN_CODE`` or ``PLAIN``.
    unread: Kind = Kind.PLAIN
    #: Whether the value may change the answer: a hook of its own, a class sent as code.
    per_value: bool = False
    #: The trusted dispatch entry pickle sends an instance with (its hooks then unasked).
    reducer: Any = None


_PLAIN, _HANDLE, _HOOKED = Rule(Kind.PLAIN), Rule(Kind.HANDLE), Rule(Kind.HOOKED)
_NAMED, _CODE, _OWN_CODE = Rule(Kind.NAMED, per_value=True), Rule(Kind.CODE), Rule(Kind.OWN_CODE)
#: Exact types pickle saves itself: no hook, no reducer, no ``reducer_override`` is asked.
_SAVED = frozenset((type(None), bool, int, float, str, bytes, bytearray, tuple, list, dict, set,
                    frozenset, pickle.PickleBuffer))  # fmt: skip


class Table(Protocol):
    """A table of a walker's: its leaf digests (exact classes), or its readers."""

    version: int

    def exact(self, cls: type) -> Any: ...

    def lookup(self, cls: type) -> Any: ...


class PickleOrder:
    """Pickle's order over one walker's tables: ``leaves`` (digests of exact classes) and
    ``readers`` (asked in turn, along the MRO); ``handles`` and ``by_value`` are Ray's
    (the types of refs and handles, and whether cloudpickle sends a class as code)."""

    def __init__(
        self,
        leaves: Table | None,
        readers: tuple[Table, ...],
        handles: Callable[[], tuple[type, ...]],
        by_value: Callable[[Any], bool],
    ) -> None:
        self.leaves = leaves
        self.readers = readers
        self.handles = handles
        self.by_value = by_value
        self.tables = readers if leaves is None else (leaves, *readers)
        #: Per class: its rule, with what it was worked out against (see :meth:`rule`).
        self.kept: dict[type, tuple[object, object, Rule]] = {}
        #: Per leaf class: its digest, its pickling then, if hookable, its table's version.
        self.leaves_kept: dict[type, tuple[Any, object, bool, int, Table]] = {}

    def walk(self) -> Classes:
        return Classes(self)

    def leaf(self, obj: object) -> Any:
        """The digest of ``obj`` if it is a leaf, asked without a walk (keying's first
        question): ``None`` where a walk must tell (:meth:`Classes.leaf`)."""
        cls = type(obj)
        kept = self.leaves_kept.get(cls)
        if kept is None or kept[3] != kept[4].version or pickling_now(cls) != kept[1]:
            return None
        return None if kept[2] and instance_hooks(obj) else kept[0]

    def epoch(self) -> tuple[int, ...]:  # what every class's rule depends on
        return (*pickling_epoch(), *[table.version for table in self.tables])

    def rule(self, cls: type, epoch: Callable[[], object]) -> Rule:
        """What pickle does with an instance of ``cls``, in Ray's pickler's order, kept
        while :func:`pickling_now` holds, and a leaf's digest, or the tables' ``epoch()``."""
        now = pickling_now(cls)
        kept = self.kept.get(cls)
        if kept is not None and kept[1] == now:
            rule = kept[2]
            if rule.kind is Kind.LEAF:
                if self.leaves is not None and self.leaves.exact(cls) is rule.entry:
                    return rule
            elif kept[0] == epoch():
                return rule
        rule = self.work_out(cls)
        self.kept[cls] = (epoch(), now, rule)
        if rule.kind is Kind.LEAF and self.leaves is not None:
            table = self.leaves
            self.leaves_kept[cls] = (rule.entry, now, rule.per_value, table.version, table)
        return rule

    def work_out(self, cls: type) -> Rule:
        leaf = None if self.leaves is None else self.leaves.exact(cls)
        if cls in _SAVED:  # (a copyreg entry for str or bytes is never consulted)
            return _PLAIN if leaf is None else Rule(Kind.LEAF, leaf)
        if issubclass(cls, self.handles()):
            return _HANDLE
        if issubclass(cls, type) or cls is types.FunctionType:
            return _NAMED  # cloudpickle's reducer_override: as code, or by name
        entry = dispatch_entry(cls)
        hookable = bool(cls.__dictoffset__)  # an instance may hold hooks of its own
        package = None if entry is None else _reducer_package(entry)
        # (A leaf's digest stands where Ray's own reducer sends it, zero-copy tensors, which
        # refshare stores in a form of its own: see refshare._wire.tensors.)
        ours = entry is None or package == "ray"
        if leaf is not None and ours and _hooks_are_its_packages(cls):
            return Rule(Kind.LEAF, leaf, per_value=hookable)  # (a hook patched: no leaf)
        if entry is not None and package not in TRUSTED_PICKLING:
            return _OWN_CODE  # the program's reducer, asked before any hook of the value
        hookable = hookable and entry is None  # (a reducer is asked before the value's hooks)
        unread = Kind.OWN_CODE if pickles_by_own_code(cls) else Kind.PLAIN
        for table in self.readers:
            reader = table.lookup(cls)
            if reader is not None:
                return Rule(Kind.READ, reader, unread, hookable, entry)
        return Rule(unread, None, unread, hookable, entry)


class Classes:
    """:class:`PickleOrder` as one walk asks it: each class met is worked out once."""

    __slots__ = ("epoch", "order", "rules", "sent")

    def __init__(self, order: PickleOrder) -> None:
        self.order = order
        self.epoch: object = None  # the order's, read on the first class met
        self.rules: dict[type, Rule] = {}
        self.sent: dict[Any, bool] = {}

    def rule(self, cls: type) -> Rule:
        """What pickle does with an instance of ``cls``."""
        found = self.rules.get(cls)
        if found is None:
            found = self.rules[cls] = self.order.rule(cls, self.tables)
        return found

    def tables(self) -> object:  # the order's epoch, read once in a walk
        if self.epoch is None:
            self.epoch = self.order.epoch()
        return self.epoch

    def of(self, obj: object) -> Rule:
        """What pickle does with ``obj``: its class's rule, unless ``obj`` holds a hook of
        its own (``HOOKED``) or is a class or function sent as code (``CODE``)."""
        rule = self.rules.get(type(obj)) or self.rule(type(obj))
        if not rule.per_value:
            return rule
        if rule.kind is Kind.NAMED:
            return _CODE if self.sent_by_value(obj) else rule
        return _HOOKED if instance_hooks(obj) else rule

    def leaf(self, obj: object) -> Any:
        """The digest of ``obj`` if it is a leaf (no hook of its own), else ``None``."""
        rule = self.rules.get(type(obj)) or self.rule(type(obj))
        if rule.kind is not Kind.LEAF or (rule.per_value and instance_hooks(obj)):
            return None
        return rule.entry

    def sent_by_value(self, obj: Any) -> bool:
        """Whether cloudpickle sends the class or function ``obj`` as code."""
        found = self.sent.get(obj)
        if found is None:
            found = self.sent[obj] = self.order.by_value(obj)
        return found
