"""The patch of Ray's submit path: install(), uninstall(), is_installed()."""

from __future__ import annotations

import contextvars
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

    def put(self, value: Any, **options: Any) -> Any:
        """The ref for a ``ray.put(value, **options)`` made in the scope, or ``None`` to
        leave that put to Ray."""


class Frame:
    """One entry into a scope (a decorated call, a ``sharing`` block): its scope, or ``None``
    where the entry turned sharing off, and the frame it was entered over.

    Frames exit in any order (a generator holding a block may be closed inside another
    block): an exited frame is skipped, never made current again."""

    __slots__ = ("closed", "owner", "parent", "scope")

    def __init__(self, scope: SubmitScope | None, parent: Frame | None, owner: object) -> None:
        self.scope = scope
        self.parent = parent
        self.owner = owner
        self.closed = False


#: The innermost frame entered in this context; ``None`` outside every scope. asyncio tasks
#: copy it when they are created, and so do tasks submitted to a ``ThreadPoolExecutor`` from
#: inside a scope (see ``_pool_submit``).
_frames: ContextVar[Frame | None] = ContextVar("refshare_frames", default=None)


def current_scope() -> SubmitScope | None:
    """The scope whose ``.remote()`` calls are being shared here, if any."""
    frame = _frames.get()
    while frame is not None and frame.closed:
        frame = frame.parent
    return None if frame is None else frame.scope


def enter(scope: SubmitScope | None, owner: object) -> Frame:
    """Make ``scope`` current in this context, over whatever was (``None``: not sharing)."""
    frame = Frame(scope, _frames.get(), owner)
    _frames.set(frame)
    return frame


def exit_frame(frame: Frame) -> None:
    """Leave ``frame``: the context is back in the innermost frame still open beneath it."""
    frame.closed = True
    if _frames.get() is frame:
        parent = frame.parent
        while parent is not None and parent.closed:
            parent = parent.parent
        _frames.set(parent)


def innermost(owner: object) -> Frame | None:
    """The innermost open frame in this context that ``owner`` entered."""
    frame = _frames.get()
    while frame is not None and (frame.closed or frame.owner is not owner):
        frame = frame.parent
    return frame

#: Ray's submit methods: every ``.remote()`` and ``.options(...).remote()`` ends in one.
#: Each takes the task's ``args`` and ``kwargs`` as its first two parameters, which Ray
#: passes sometimes by position and sometimes by keyword.
TARGETS: tuple[tuple[str, str, str], ...] = (
    ("ray.actor", "ActorMethod", "_remote"),  # actor method calls
    ("ray.remote_function", "RemoteFunction", "_remote"),  # task submissions
    ("ray.actor", "ActorClass", "_remote"),  # actor creation
)
_EXPECTED_PARAMETERS = ["self", "args", "kwargs"]
#: ``ray.put`` inside a scope is content-addressed; its first parameter is the value.
PUT_TARGET = ("ray", "put")
#: Tasks submitted to a thread pool from inside a scope run in a copy of the submitter's
#: context, as ``asyncio.to_thread`` does, so frameworks that put from a pool are shared.
POOL_TARGET = ("concurrent.futures", "ThreadPoolExecutor", "submit")


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
        scope = current_scope()
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


def _put(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``ray.put``: outside a scope, one context-variable lookup."""
    scope = current_scope()
    if scope is None or not _installed or len(args) != 1:
        return wrapped(*args, **kwargs)
    try:
        ref = scope.put(args[0], **kwargs)
    except Exception:  # never break a put that works
        logger.debug("putting as Ray would after an internal error", exc_info=True)
        ref = None
    return wrapped(*args, **kwargs) if ref is None else ref


def _pool_submit(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``ThreadPoolExecutor.submit``: inside a scope, the task runs in a copy of the
    submitter's context (a fresh copy per task: one context cannot run in two threads)."""
    if current_scope() is None or not _installed or not args:
        return wrapped(*args, **kwargs)
    context = contextvars.copy_context()
    return wrapped(context.run, *args, **kwargs)


def raw_put(value: Any) -> Any:
    """``ray.put`` beneath refshare's patch (what the scope itself stores with)."""
    for patch in _patches:
        if patch.cls.__name__ == PUT_TARGET[0] and patch.attribute == PUT_TARGET[1]:
            return patch.original(value)
    import ray

    return ray.put(value)


class _Patch:
    __slots__ = ("attribute", "cls", "left_on_top", "original", "wrapper")

    def __init__(self, cls: Any, attribute: str, original: Any, wrapper: Any = None) -> None:
        self.cls = cls
        self.attribute = attribute
        self.original = original
        self.wrapper = wrapt.FunctionWrapper(original, wrapper or _make_submit(cls))
        #: What another library had put on top of refshare's wrapper at uninstall().
        self.left_on_top: Any = None

    def current(self) -> Any:
        return self.cls.__dict__.get(self.attribute)


_lock = threading.Lock()
_patches: list[_Patch] = []
_installed = False
_auto_installed = False
_refused = False  # Ray's internals were not what refshare expects; warned once


def _find_targets() -> list[_Patch]:
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
        found.append(_Patch(cls, attribute, original))
    module = importlib.import_module(PUT_TARGET[0])
    put = module.__dict__[PUT_TARGET[1]]
    first = next(iter(inspect.signature(put).parameters), None)
    if first != "value":
        raise TypeError(f"ray.put takes {first!r} first, expected 'value'")
    found.append(_Patch(module, PUT_TARGET[1], put, _put))
    pool = getattr(importlib.import_module(POOL_TARGET[0]), POOL_TARGET[1])
    found.append(_Patch(pool, POOL_TARGET[2], pool.__dict__[POOL_TARGET[2]], _pool_submit))
    return found


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
            _patches.extend(targets)
        for patch in _patches:
            current = patch.current()
            buried = current is patch.left_on_top or in_chain(current, patch.wrapper)
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


# -- decorated functions shipped by value -------------------------------------------------

#: Wrapper types that must pickle as themselves. Proxies pass ``isinstance(obj,
#: FunctionType)``, so cloudpickle would otherwise pickle the bare function they wrap.
self_pickling_types: set[type] = set()
_pickling_patched = False


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
    global _pickling_patched
    if _pickling_patched:
        return
    with _lock:
        if _pickling_patched:
            return
        _pickling_patched = True
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
