"""Ray's cloudpickle, as refshare relies on it: what it sends by value, and decorated
functions that must pickle as themselves."""

from __future__ import annotations

import logging
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
    """Have Ray's cloudpickle pickle refshare's decorators as themselves (once, idempotent).

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
