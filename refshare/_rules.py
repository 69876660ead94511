"""The rules that keep refshare exact: what a reader may key, which classes it may read.

Each fast path of refshare (a reader that keys a framework's batch without pickling it, a
reduction that splits it into members) models one class's pickling. Two rules bound them,
and every type table of readers applies them (see ``refshare._dispatch.TypeTable``):

- **A reader is an allow-list.** It returns what it has read in full of everything the
  value's pickling sends, or ``NotImplemented`` for anything it does not model (a
  non-tensor entry, a nested container, a field it does not know). ``NotImplemented``
  hands the value to the exact path: the pickling pass, or Ray's own pickle of it. A
  reduction for deep sharing does the same: it splits only what the worker's rebuild
  reproduces exactly, and returns ``NotImplemented`` to store the value whole.
- **A reader registered for a class reads a subclass only if the subclass pickles as the
  class does** (:func:`pickles_as`): pickle decides how an instance is sent in a fixed order
  (Ray's registered serializers and ``copyreg.dispatch_table``, for the exact class; then
  ``__reduce_ex__``, ``__reduce__``, ``__getstate__``/``__setstate__``,
  ``__getnewargs_ex__``/``__getnewargs__``, and the slots the default state holds), and a
  subclass that changes any of them is not read. Nor is the class itself once its pickling
  is no longer its own package's (:func:`own_pickling`): a reducer registered for it, or a
  hook assigned to it, by other code. Nor is an instance that holds a hook of its own
  (:func:`instance_hooks`): pickle finds ``obj.__reduce_ex__`` on the instance first.

The third rule, what a stamp may vouch for within a call, lives with the stamps
(``refshare._keys.stamps.vouches_for``); the fourth, what verify mode compares, in
``refshare._verify``.
"""

from __future__ import annotations

import copyreg
import sys
from typing import Any

#: What pickle consults to send an instance, after the dispatch tables (exact class only).
PICKLING_HOOKS = (
    "__reduce_ex__",
    "__reduce__",
    "__getstate__",
    "__setstate__",
    "__getnewargs_ex__",
    "__getnewargs__",
)

#: A class's pickling: its dispatch-table entry, each hook as the class resolves it along
#: its MRO, and the names of its slots.
Pickling = tuple[object, ...]

_slots_of: dict[type, frozenset[str]] = {}


_tables: list[Any] = [copyreg.dispatch_table]


def _dispatch_tables() -> list[Any]:
    """The tables pickle looks an exact class up in before its hooks: ``copyreg``'s, and
    Ray's cloudpickle's own (where ``ray.util.register_serializer`` writes)."""
    if len(_tables) == 1:
        cloudpickle = sys.modules.get("ray.cloudpickle")
        pickler = getattr(cloudpickle, "CloudPickler", None)
        maps = getattr(getattr(pickler, "dispatch_table", None), "maps", None) or ()
        _tables.extend(table for table in maps if table is not copyreg.dispatch_table)
    return _tables


def pickling_epoch() -> tuple[int, ...]:
    """Changes whenever an entry is added to a dispatch table: what was cached of a class's
    pickling (``refshare._keys.pickler.runs_own_pickling``) is then worked out again."""
    return tuple(map(len, _dispatch_tables()))


def dispatch_entry(cls: type) -> Any:
    """The reducer a dispatch table holds for exactly ``cls``, or ``None``: Ray's
    registered serializers win over ``copyreg``'s, as in Ray's pickler."""
    for table in reversed(_dispatch_tables()):
        found = table.get(cls)
        if found is not None:
            return found
    return None


def registered_serializer(cls: type) -> bool:
    """Whether a serializer registered for exactly ``cls`` (``ray.util.register_serializer``,
    ``copyreg``) makes what a worker receives of an array or a tensor, which a digest of its
    bytes cannot see: such a value is keyed by its pickle and stored as it. Ray's zero-copy
    tensor reducer is not one here: refshare's tensor form runs its deserializer
    (``_wire.tensors``)."""
    entry = dispatch_entry(cls)
    return entry is not None and getattr(entry, "__module__", None) != _RAY_ZERO_COPY


_RAY_ZERO_COPY = "ray._private.tensor_serialization_utils"
_UNSET = object()


def _slots(cls: type) -> frozenset[str]:
    names: set[str] = set()
    for base in cls.__mro__:
        slots = base.__dict__.get("__slots__", ())
        names.update((slots,) if isinstance(slots, str) else slots)
    return frozenset(names)


def registered_with_ray(entry: Any) -> bool:
    """Whether a dispatch-table entry is Ray's reducer for a serializer registered with
    ``ray.util.register_serializer``: its deserializer, not the class's unpickling, makes
    what a worker receives."""
    code = getattr(entry, "__code__", None)
    return code is not None and "custom_serializer" in code.co_freevars


def reducer_package(entry: Any) -> str:
    """The package whose code a dispatch-table entry runs: for a serializer registered with
    Ray (``ray.util.register_serializer``), the package of the program's serializer that
    Ray's reducer calls, not Ray's."""
    if registered_with_ray(entry) and entry.__closure__:
        code = entry.__code__
        entry = entry.__closure__[code.co_freevars.index("custom_serializer")].cell_contents
    return package_of(entry)


def pickling_of(cls: type) -> Pickling:
    """Everything that decides how pickle sends an instance of ``cls``, in pickle's order.

    Read afresh each time (a few dictionary look-ups): a program, or its test, may assign a
    class's ``__getstate__`` at any time. Only the slots are kept, being fixed once the
    class exists."""
    slots = _slots_of.get(cls)
    if slots is None:
        slots = _slots_of[cls] = _slots(cls)
    return (dispatch_entry(cls), *_hooks(cls), slots)


def _hooks(cls: type) -> list[object]:
    """Each of :data:`PICKLING_HOOKS` as ``cls`` resolves it along its MRO (``None`` where
    no class defines it): each class's namespace read once for all six names."""
    found: list[object] = [_UNSET] * len(PICKLING_HOOKS)
    missing = len(PICKLING_HOOKS)
    for base in cls.__mro__:
        namespace = base.__dict__
        for index, name in enumerate(PICKLING_HOOKS):
            if found[index] is _UNSET and name in namespace:
                found[index] = namespace[name]  # (``None`` too: it hides the bases' hook)
                missing -= 1
        if not missing:
            break
    return [None if hook is _UNSET else hook for hook in found]


def package_of(obj: object) -> str:
    """The top-level package an object (a class, a function) was defined in."""
    return str(getattr(obj, "__module__", None) or "").partition(".")[0]


#: Packages whose functions may stand as a class's pickling hooks without being its own:
#: Python's defaults, and the hooks ``dataclasses`` and ``copyreg`` make for a class.
_HOOK_MAKERS = frozenset(("", "builtins", "copyreg", "dataclasses"))


def _hook_package(hook: object) -> str:
    """The package whose code a hook runs (a static or class method's function's)."""
    return package_of(getattr(hook, "__func__", hook))


def own_pickling(cls: type) -> bool:
    """Whether ``cls`` pickles as the code that defined it says: its dispatch entry, if
    any, is its own package's (as tensordict registers one for ``TensorDict``), and each
    hook it resolves along its MRO was defined in the package of the class that holds it,
    or is one of Python's. A reducer registered, or a hook assigned, by other code (the
    program patching ``DataProto.__getstate__``) is not what a reader of ``cls`` models; nor
    is a serializer registered with Ray, whatever its functions (a deserializer runs on the
    worker instead of the class's unpickling)."""
    entry = dispatch_entry(cls)
    if entry is not None and (
        registered_with_ray(entry) or reducer_package(entry) != package_of(cls)
    ):
        return False
    for name in PICKLING_HOOKS:
        for base in cls.__mro__:
            hook = base.__dict__.get(name)
            if hook is not None:
                package = _hook_package(hook)
                if package not in _HOOK_MAKERS and package != package_of(base):
                    return False
                break
    return True


def instance_hooks(obj: object) -> bool:
    """Whether ``obj`` holds a pickling hook in its own ``__dict__``, which pickle finds
    before its class's: such an instance is sent as that hook says, not as its class
    pickles, and no reader of its class may read it."""
    state = getattr(obj, "__dict__", None)
    return type(state) is dict and any(name in state for name in PICKLING_HOOKS)


def pickles_as(cls: type, registered: type) -> bool:
    """Whether a reader registered for ``registered`` may read an instance of ``cls``.

    ``registered`` must pickle as its own package says (:func:`own_pickling`), and ``cls``
    exactly as ``registered`` does (the same dispatch entry, hooks and slots). An instance
    with hooks of its own is refused where it is read (:func:`instance_hooks`)."""
    if not own_pickling(registered):
        return False
    return cls is registered or pickling_of(cls) == pickling_of(registered)
