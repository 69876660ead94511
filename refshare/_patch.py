"""The patch of Ray's submit path: install(), uninstall(), is_installed()."""

from __future__ import annotations

import importlib
import inspect
import logging
import threading
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, Protocol

import wrapt

logger = logging.getLogger("refshare")


class SubmitScope(Protocol):
    """What the submit path needs from an active scope."""

    def rewrite(self, args: Any, kwargs: Any) -> tuple[Any, Any]: ...


#: The scope whose ``.remote()`` calls are being shared; ``None`` outside every scope.
#: Threads do not inherit it; asyncio tasks copy it when they are created.
active_scope: ContextVar[SubmitScope | None] = ContextVar("refshare_scope", default=None)

#: Ray's submit methods: every ``.remote()`` and ``.options(...).remote()`` ends in one.
#: Each takes the task's ``args`` and ``kwargs`` as its first two parameters, which Ray
#: passes sometimes by position and sometimes by keyword.
TARGETS: tuple[tuple[str, str, str], ...] = (
    ("ray.actor", "ActorMethod", "_remote"),  # actor method calls
    ("ray.remote_function", "RemoteFunction", "_remote"),  # task submissions
    ("ray.actor", "ActorClass", "_remote"),  # actor creation
)
_EXPECTED_PARAMETERS = ["self", "args", "kwargs"]


def _rewrite_call(
    scope: SubmitScope, args: tuple[Any, ...], kwargs: dict[str, Any], skip: int
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Return ``(args, kwargs)`` for ``_remote`` with the task's arguments shared.

    ``skip`` is 1 when ``self`` is among ``args`` (the method was called through the class).
    """
    task_args = args[skip] if len(args) > skip else kwargs.get("args")
    task_kwargs = args[skip + 1] if len(args) > skip + 1 else kwargs.get("kwargs")
    new_args, new_kwargs = scope.rewrite(task_args, task_kwargs)
    if new_args is task_args and new_kwargs is task_kwargs:
        return args, kwargs
    positional = list(args)
    kwargs = dict(kwargs)
    for index, name, value in ((skip, "args", new_args), (skip + 1, "kwargs", new_kwargs)):
        if len(positional) > index:
            positional[index] = value
        elif value is not None:
            kwargs[name] = value
    return tuple(positional), kwargs


def _make_submit(owner: type) -> Callable[[Callable[..., Any], Any, Any, Any], Any]:
    """The wrapper for ``owner._remote``; outside a scope it is one context-variable lookup."""

    def submit(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
        scope = active_scope.get()
        if scope is None or not _installed:
            return wrapped(*args, **kwargs)
        skip = 1 if instance is None and args and isinstance(args[0], owner) else 0
        try:
            shared_args, shared_kwargs = _rewrite_call(scope, args, kwargs, skip)
        except Exception:  # never break a call that works by value
            logger.debug("submitting by value after an internal error", exc_info=True)
            return wrapped(*args, **kwargs)
        if shared_args is args and shared_kwargs is kwargs:
            return wrapped(*args, **kwargs)
        try:
            return wrapped(*shared_args, **shared_kwargs)
        except Exception:
            # Ray refused a ref (say, one from a session restarted inside this call): the
            # call goes by value, and raises exactly what it raises without refshare.
            logger.debug("Ray refused the shared arguments; submitting by value", exc_info=True)
            return wrapped(*args, **kwargs)

    return submit


class _Patch:
    __slots__ = ("attribute", "cls", "left_on_top", "original", "wrapper")

    def __init__(self, cls: type, attribute: str, original: Any) -> None:
        self.cls = cls
        self.attribute = attribute
        self.original = original
        self.wrapper = wrapt.FunctionWrapper(original, _make_submit(cls))
        #: What another library had put on top of refshare's wrapper at uninstall().
        self.left_on_top: Any = None

    def current(self) -> Any:
        return self.cls.__dict__.get(self.attribute)


_lock = threading.Lock()
_patches: list[_Patch] = []
_installed = False
_auto_installed = False
_refused = False  # Ray's internals were not what refshare expects; warned once


def _find_targets() -> list[tuple[type, str, Any]]:
    """Locate each target in Ray and check its shape; raise if anything is off."""
    found = []
    for module_name, class_name, attribute in TARGETS:
        cls = getattr(importlib.import_module(module_name), class_name)
        original = cls.__dict__[attribute]  # the class's own, not an inherited one
        parameters = list(inspect.signature(original).parameters)[:3]
        if parameters != _EXPECTED_PARAMETERS:
            raise TypeError(
                f"{module_name}.{class_name}.{attribute} takes {parameters}, "
                f"expected {_EXPECTED_PARAMETERS}"
            )
        found.append((cls, attribute, original))
    return found


def _in_chain(current: Any, wrapper: Any) -> bool:
    """Whether ``wrapper`` is ``current`` or lies under it in a chain of wrappers."""
    for _ in range(32):
        if current is wrapper:
            return True
        current = getattr(current, "__wrapped__", None)
        if current is None:
            return False
    return False


def install() -> bool:
    """Patch Ray's submit path; return whether refshare's patch is now active.

    Idempotent. Called for you when the first decorated call or ``sharing`` block starts.
    If Ray's internals are not what refshare expects, it warns once and leaves Ray as it
    is: every call then goes by value, as if refshare were not there.
    """
    global _installed, _refused
    with _lock:
        if _installed:
            return True
        if not _patches:
            try:
                targets = _find_targets()
            except Exception as error:
                if not _refused:
                    import ray

                    logger.warning(
                        "Ray %s is not supported (%s); Ray is left unpatched and "
                        "every argument goes by value",
                        getattr(ray, "__version__", "?"),
                        error,
                    )
                _refused = True
                return False
            _patches.extend(_Patch(cls, name, original) for cls, name, original in targets)
        for patch in _patches:
            current = patch.current()
            buried = current is patch.left_on_top or _in_chain(current, patch.wrapper)
            if not buried:
                setattr(patch.cls, patch.attribute, patch.wrapper)
        _installed = True
        return True


def uninstall() -> None:
    """Undo :func:`install`: restore each Ray method refshare replaced.

    A method that another library has wrapped on top of refshare since is left in place,
    so their wrapper keeps working; refshare's layer underneath passes every call through.
    """
    global _installed, _auto_installed
    with _lock:
        _auto_installed = True  # an explicit uninstall is not undone by the next scope
        for patch in _patches:
            current = patch.current()
            if current is patch.wrapper:
                setattr(patch.cls, patch.attribute, patch.original)
                patch.left_on_top = None
            elif current is not patch.original:
                patch.left_on_top = current  # ours lies beneath: it passes calls through
        _installed = False


def is_installed() -> bool:
    """Whether refshare's patch of Ray's submit path is active."""
    return _installed


def ensure_installed() -> None:
    """Install on first use only, so an explicit :func:`uninstall` is respected."""
    global _auto_installed
    if not _auto_installed:
        _auto_installed = True
        install()
