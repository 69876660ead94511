"""patch_methods() and unpatch_methods(): @shared_args on code you do not own."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import types
from collections.abc import Iterator
from typing import Any, NamedTuple

from .._api import SharedFunction
from .._options import Options
from .._ray.pickling import ensure_pickling_patch
from .._ray.submit import in_chain


class _Patched(NamedTuple):
    original: Any  #: the attribute refshare replaced, or ``_INHERITED``
    wrapper: SharedFunction  #: the wrapper it put there
    yields: bool = False  #: put there by ``refshare run``: see :func:`yielding`


#: (owner, name) -> what refshare replaced there.
_patched: dict[tuple[Any, str], _Patched] = {}
_lock = threading.Lock()
logger = logging.getLogger("refshare")


class _RunPatching(threading.local):
    on = False  #: in this thread, ``refshare run`` is wrapping (see :func:`yielding`)


_run_patching = _RunPatching()


@contextlib.contextmanager
def yielding() -> Iterator[None]:
    """Methods wrapped inside give way to the program's own wrapping: ``refshare run``
    turns a framework on with the default options (its modes are switches every scope
    reads), and a program that enables it itself, with options of its own (an audit of
    one turn, say), gets them, as it would without the command."""
    _run_patching.on = True
    try:
        yield
    finally:
        _run_patching.on = False


def _label(owner: Any, name: str) -> str:
    return f"{getattr(owner, '__qualname__', getattr(owner, '__name__', owner))}.{name}"


def _own_attribute(owner: Any, name: str) -> tuple[Any, Any]:
    """The attribute as stored (not bound), and the class or module it is stored on.

    A base class's method that refshare already wraps is taken unwrapped, so that the
    options given for ``owner`` are the ones that apply to it, before and after the base
    is unpatched."""
    if isinstance(owner, types.ModuleType):
        stored_on = owner if name in owner.__dict__ else None
    else:
        stored_on = next((base for base in owner.__mro__ if name in base.__dict__), None)
    if stored_on is None:
        raise AttributeError(f"{_label(owner, name)} does not exist: check the name")
    attribute = stored_on.__dict__[name]
    entry = _patched.get((stored_on, name))
    if stored_on is not owner and entry is not None and attribute is entry.wrapper:
        attribute = entry.wrapper.__wrapped__
    if isinstance(attribute, property) or not callable(getattr(attribute, "__func__", attribute)):
        raise TypeError(
            f"{_label(owner, name)} is a {type(attribute).__name__}, not a method: "
            "patch_methods wraps methods and functions only"
        )
    return attribute, stored_on


def patch_methods(owner: type | types.ModuleType, *names: str, **options: Any) -> list[str]:
    """Wrap ``owner``'s methods (or a module's functions) with ``shared_args(**options)``.

    For a worker group you do not own: every call of those methods on any instance, old
    or new, runs in a sharing scope. Idempotent (a method already wrapped is left as it
    is, save one ``refshare run`` wrapped: see :func:`yielding`) and undone by
    :func:`unpatch_methods`. Returns the ``Class.method`` names wrapped.
    A subclass patched with options of its own keeps them, whatever is patched or unpatched
    on its bases. Raises ``AttributeError`` for a missing method, ``TypeError`` for an
    attribute that is not a method (a property), and the errors of :func:`shared_args` for
    bad options, before changing anything.
    """
    if not names:
        raise TypeError("patch_methods() needs at least one method name")
    resolved = Options(**options)
    found = [(name, *_own_attribute(owner, name)) for name in names]
    ensure_pickling_patch()
    wrapped = []
    with _lock:
        for name, original, _stored_on in found:
            entry = _patched.get((owner, name))
            kept = original if _stored_on is owner else _INHERITED
            if entry is not None and in_chain(owner.__dict__.get(name), entry.wrapper):
                if not _gives_way(owner, name, entry, resolved):
                    _kept(owner, name, entry.wrapper._self_options, resolved)
                    wrapped.append(_label(owner, name))
                    continue
                original, kept = entry.wrapper.__wrapped__, entry.original
            wrapper = SharedFunction(original, resolved)
            setattr(owner, name, wrapper)
            _patched[(owner, name)] = _Patched(kept, wrapper, _run_patching.on)
            wrapped.append(_label(owner, name))
    return wrapped


def _gives_way(owner: Any, name: str, entry: _Patched, asked: Options) -> bool:
    """Whether ``entry``, ``refshare run``'s, is replaced by the program's own options
    (where nothing was wrapped on top of it since)."""
    return (
        entry.yields
        and not _run_patching.on
        and owner.__dict__.get(name) is entry.wrapper
        and entry.wrapper._self_options != asked
    )


def _kept(owner: Any, name: str, kept: Options, asked: Options) -> None:
    """Warn that a method already shared keeps its options where others were asked for (a
    program that enables one framework twice, with other options the second time)."""
    differ = [
        f.name
        for f in dataclasses.fields(Options)
        if getattr(kept, f.name) != getattr(asked, f.name)
    ]
    if differ:
        logger.warning(
            "refshare: %s is already shared with %s; kept them, not %s (unpatch or "
            "disable it first to share it with other options)",
            _label(owner, name),
            ", ".join(f"{n}={getattr(kept, n)!r}" for n in differ),
            ", ".join(f"{n}={getattr(asked, n)!r}" for n in differ),
        )


#: Stands for "the method was inherited": unpatching deletes refshare's attribute.
_INHERITED = object()


def unpatch_methods(owner: type | types.ModuleType, *names: str) -> list[str]:
    """Undo :func:`patch_methods` for ``names`` (all of ``owner``'s, if none are given).

    A method that another library wrapped on top of refshare since is left in place; the
    refshare layer under it keeps working. Returns the names restored.
    """
    restored = []
    with _lock:
        targets = names or tuple(name for (o, name) in _patched if o is owner)
        for name in targets:
            entry = _patched.get((owner, name))
            if entry is None:
                continue
            original, wrapper = entry.original, entry.wrapper
            if owner.__dict__.get(name) is not wrapper:
                continue  # someone wrapped it since: leave their wrapper working
            if original is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
            del _patched[(owner, name)]
            restored.append(_label(owner, name))
    return restored
