"""The patch of Ray's submit path: install(), uninstall(), is_installed().

Every ``.remote()`` and ``.options(...).remote()`` ends in one of Ray's ``_remote`` methods,
and every ``ray.put`` in ``ray.put``: refshare wraps them once, and each wrapper asks the
current scope (see ``refshare._context``) what to send. Outside a scope a wrapper costs one
context-variable lookup.
"""

from __future__ import annotations

import contextvars
import importlib
import inspect
import logging
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import wrapt

from .._context import SubmitScope, current_scope

logger = logging.getLogger("refshare")

Wrapper = Callable[[Callable[..., Any], Any, Any, Any], Any]


class Site(NamedTuple):
    """A method of one of Ray's classes (or a function of a module) that refshare wraps."""

    module: str
    owner: str  # a class of ``module``; empty for a function of the module itself
    attribute: str


#: Ray's submit methods. Each takes the task's ``args`` and ``kwargs`` as its first two
#: parameters, which Ray passes sometimes by position and sometimes by keyword.
SUBMIT_SITES = (
    Site("ray.actor", "ActorMethod", "_remote"),  # actor method calls
    Site("ray.remote_function", "RemoteFunction", "_remote"),  # task submissions
    Site("ray.actor", "ActorClass", "_remote"),  # actor creation
)
_SUBMIT_PARAMETERS = ["self", "args", "kwargs"]
#: ``ray.put`` inside a scope is content-addressed; its first parameter is the value.
PUT_SITE = Site("ray", "", "put")
#: Tasks submitted to a thread pool from inside a scope run in a copy of the submitter's
#: context, as ``asyncio.to_thread`` does, so frameworks that put from a pool are shared.
POOL_SITE = Site("concurrent.futures", "ThreadPoolExecutor", "submit")


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


def _make_submit(owner: type) -> Wrapper:
    """The wrapper of ``owner._remote``."""

    def submit(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
        scope = current_scope()
        if scope is None or not _installed:
            return wrapped(*args, **kwargs)
        skip = 1 if instance is None and args and isinstance(args[0], owner) else 0
        timing = scope.timing()  # an audit's: its keying, then Ray sending by value
        try:
            shared_args, shared_kwargs = _rewrite_call(scope, args, kwargs, skip)
        except Exception:  # never break a call that works by value
            logger.debug("submitting by value after an internal error", exc_info=True)
            return wrapped(*args, **kwargs)
        if shared_args is args and shared_kwargs is kwargs:
            if timing is not None:
                return timing.call(wrapped, *args, **kwargs)
            return wrapped(*args, **kwargs)
        try:
            return wrapped(*shared_args, **shared_kwargs)
        except Exception:
            # Ray refused a ref (say, one from a session restarted inside this call): the
            # call goes by value, and raises exactly what it raises without refshare.
            logger.debug("Ray refused the shared arguments; submitting by value", exc_info=True)
            return wrapped(*args, **kwargs)

    return submit


def _put(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """The wrapper of ``ray.put``."""
    scope = current_scope()
    if scope is None or not _installed or len(args) != 1:
        return wrapped(*args, **kwargs)
    timing = scope.timing()  # an audit's: its keying, then Ray's own put
    try:
        ref = scope.ray_put(args[0], **kwargs)
    except Exception:  # never break a put that works
        logger.debug("putting as Ray would after an internal error", exc_info=True)
        ref = None
    if ref is not None:
        return ref
    return wrapped(*args, **kwargs) if timing is None else timing.call(wrapped, *args, **kwargs)


def _pool_submit(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """The wrapper of ``ThreadPoolExecutor.submit``: inside a scope, the task runs in a copy
    of the submitter's context (a fresh copy per task: one context cannot run in two
    threads), marked as one of the scope's pool jobs (see ``_admission.Moments``)."""
    scope = current_scope()
    if scope is None or not _installed or not args:
        return wrapped(*args, **kwargs)
    context = contextvars.copy_context()
    context.run(scope.moments.submitted)
    return wrapped(context.run, *args, **kwargs)


class _Patch:
    """One attribute refshare replaces: where it lives, the original, and the wrapper."""

    __slots__ = ("attribute", "left_on_top", "original", "owner", "wrapper")

    def __init__(self, owner: Any, attribute: str, original: Any, wrapper: Wrapper) -> None:
        self.owner = owner  # a class, or the ``ray`` module for ``ray.put``
        self.attribute = attribute
        self.original = original
        self.wrapper = wrapt.FunctionWrapper(original, wrapper)
        #: What another library had put on top of refshare's wrapper at uninstall().
        self.left_on_top: Any = None

    def current(self) -> Any:
        return self.owner.__dict__.get(self.attribute)


_lock = threading.Lock()
_patches: list[_Patch] = []
_original_put: Callable[[Any], Any] | None = None
_installed = False
_auto_installed = False
_refused = False  # Ray's internals were not what refshare expects; warned once


def _own(site: Site) -> tuple[Any, Any]:
    """The class (or module) of ``site`` and its own attribute, not an inherited one."""
    module = importlib.import_module(site.module)
    owner = getattr(module, site.owner) if site.owner else module
    return owner, owner.__dict__[site.attribute]


def _find_targets() -> list[_Patch]:
    """Locate each target in Ray and check its shape; raise if anything is off."""
    found = []
    for site in SUBMIT_SITES:
        owner, original = _own(site)
        parameters = list(inspect.signature(original).parameters)[:3]
        if parameters != _SUBMIT_PARAMETERS:
            raise TypeError(f"{site} takes {parameters}, expected {_SUBMIT_PARAMETERS}")
        found.append(_Patch(owner, site.attribute, original, _make_submit(owner)))
    module, put = _own(PUT_SITE)
    first = next(iter(inspect.signature(put).parameters), None)
    if first != "value":
        raise TypeError(f"ray.put takes {first!r} first, expected 'value'")
    found.append(_Patch(module, PUT_SITE.attribute, put, _put))
    pool, submit = _own(POOL_SITE)
    found.append(_Patch(pool, POOL_SITE.attribute, submit, _pool_submit))
    return found


def raw_put(value: Any) -> Any:
    """``ray.put`` beneath refshare's patch: what scopes store with."""
    if _original_put is not None:
        return _original_put(value)
    import ray

    return ray.put(value)


def in_chain(current: Any, wrapper: Any) -> bool:
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
    global _installed, _refused, _original_put
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
            _patches.extend(targets)
            _original_put = next(p.original for p in targets if p.attribute == "put")
        for patch in _patches:
            current = patch.current()
            buried = current is patch.left_on_top or in_chain(current, patch.wrapper)
            if not buried:
                setattr(patch.owner, patch.attribute, patch.wrapper)
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
                setattr(patch.owner, patch.attribute, patch.original)
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
