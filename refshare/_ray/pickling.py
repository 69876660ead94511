"""Ray's cloudpickle, as refshare relies on it: what it sends by value, refshare's own
functions shipped by value (pickled once per process), and decorated functions that must
pickle as themselves."""

from __future__ import annotations

import logging
import pickle
import threading
import types
from collections.abc import Callable
from typing import Any

import wrapt

logger = logging.getLogger("refshare")


def sent_by_value(obj: Any) -> bool:
    """Whether Ray's cloudpickle sends this class or function as code, not by name: defined
    in ``__main__`` or a notebook, inside a function, or in a module registered to be
    pickled by value. Its definition, its attributes and the globals its methods use then
    travel with every submission, and may change between two."""
    try:
        from ray.cloudpickle import cloudpickle

        return not cloudpickle._should_pickle_by_reference(obj)  # type: ignore[no-untyped-call]
    except Exception:  # cloudpickle moved its helper: the rule it implements
        return obj.__module__ == "__main__" or "<locals>" in obj.__qualname__


_shipped: set[str] = set()


def ship_by_value(module: types.ModuleType) -> None:
    """Have Ray's cloudpickle send ``module``'s functions as code, so that workers without
    refshare still run them (refshare's worker-side rebuilds)."""
    if module.__name__ not in _shipped:
        from ray import cloudpickle

        cloudpickle.register_pickle_by_value(module)  # type: ignore[no-untyped-call]
        _shipped.add(module.__name__)
    ensure_pickling_patch()


#: Each function of a module shipped by value, as cloudpickle pickles it on its own.
_pickled_once: dict[Any, bytes] = {}
_pickling_once = threading.local()


def _shipped_function(function: Any) -> tuple[Any, tuple[bytes]] | None:
    """A reduction of a function of a module shipped by value that unpickles its by-value
    pickle, made once per process: cloudpickle would pickle its code, and the helpers and
    classes it names, each time it is sent (0.3 ms for a skeleton's rebuild), and a worker
    rebuilds from these bytes exactly what it would rebuild from those. ``None`` for any
    other object, and while that pickle is being made."""
    if type(function) is not types.FunctionType or function.__module__ not in _shipped:
        return None
    if getattr(_pickling_once, "busy", False):
        return None  # making a pickle: cloudpickle's own by-value pickle, helpers included
    pickled = _pickled_once.get(function)
    if pickled is None:
        from ray import cloudpickle

        _pickling_once.busy = True
        try:
            pickled = cloudpickle.dumps(function, protocol=5)  # type: ignore[no-untyped-call]
        finally:
            _pickling_once.busy = False
        pickled = _pickled_once.setdefault(function, pickled)
    return pickle.loads, (pickled,)


# -- decorated functions shipped by value -------------------------------------------------

#: Wrapper types that must pickle as themselves. Proxies pass ``isinstance(obj,
#: FunctionType)``, so cloudpickle would otherwise pickle the bare function they wrap.
self_pickling_types: set[type] = set()
_patched = False
_lock = threading.Lock()


def _reducer_override(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    obj: Any = args[0] if args else None
    cls = type(obj)
    if cls in self_pickling_types:
        return obj.__reduce_ex__(5)
    if cls is types.FunctionType:
        shipped = _shipped_function(obj)
        if shipped is not None:
            return shipped
    if cls is wrapt.BoundFunctionWrapper and type(obj._self_parent) in self_pickling_types:
        # Looked up on a class (as Ray's actor machinery does) or bound to an instance.
        bound_to = obj._self_instance
        if bound_to is None:
            return _identity, (obj._self_parent,)
        return _bind, (obj._self_parent, bound_to)
    return wrapped(*args, **kwargs)


def _identity(obj: Any) -> Any:
    return obj


def _bind(function: Any, instance: Any) -> Any:
    return function.__get__(instance, type(instance))


def ensure_pickling_patch() -> None:
    """Have Ray's cloudpickle pickle refshare's decorators as themselves, and the functions
    of modules shipped by value from their pickle made once (once, idempotent).

    If cloudpickle is not what refshare expects, decorated functions shipped by value
    arrive undecorated, as before: their data still goes by value, correctly.
    """
    global _patched
    if _patched:
        return
    with _lock:
        if _patched:
            return
        _patched = True
        try:
            from ray import cloudpickle

            pickler = cloudpickle.CloudPickler
            original = pickler.__dict__["reducer_override"]
            wrapper = wrapt.FunctionWrapper(original, _reducer_override)
            setattr(pickler, "reducer_override", wrapper)  # noqa: B010
        except Exception as error:
            logger.warning(
                "Ray's cloudpickle is not what refshare expects (%s): a decorated function "
                "shipped by value to another process loses the decorator there",
                error,
            )
