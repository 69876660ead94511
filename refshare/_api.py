"""The front door: ``@shared_args``, ``sharing()``, ``share()`` and ``clear()``."""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Callable
from typing import Any, TypeVar, cast, overload

import ray
import wrapt

from . import _env, _ledger
from ._cache import audit_cache, process_cache
from ._context import Frame, current_scope, enter, innermost, leave
from ._keys.pickler import forget_pickling
from ._options import Options, signed
from ._ray.pickling import ensure_pickling_patch, self_pickling_types
from ._ray.submit import ensure_installed, raw_put
from ._scope import Scope
from ._wire.strings import forget_joins

logger = logging.getLogger("refshare")

_F = TypeVar("_F", bound=Callable[..., Any])
#: The options of a ``share()`` outside any scope: every size, the process-wide cache.
_SHARE = Options(min_bytes=0)


def clear() -> None:
    """Empty the process-wide cache (Ray frees each object once no task still uses it), and
    forget what refshare learned of which values repeat and which classes pickle alike, and
    the strings it joined lately."""
    for cache in (process_cache(), audit_cache(process_cache())):
        cache.clear()
    forget_pickling()
    forget_joins()


def _ray_client_test() -> Callable[[], object] | None:
    try:
        from ray._private.client_mode_hook import client_mode_should_convert
    except Exception:  # Ray moved it: no way to tell, so no Ray Client
        return None
    return cast(Callable[[], object], client_mode_should_convert)


#: Ray's own test of whether this thread talks to Ray through Ray Client.
_client_mode = _ray_client_test()

_warned_client = False


def _over_ray_client() -> bool:
    """Whether this thread talks to Ray through Ray Client (``ray://``), where submissions
    and puts go through the client's own stubs, which refshare does not patch."""
    global _warned_client
    try:
        client = _client_mode is not None and bool(_client_mode())
    except Exception:
        return False
    if client and not _warned_client:
        _warned_client = True
        logger.warning(
            "refshare does not share over Ray Client (ray://): every call goes by value, "
            "as without refshare. Run the driver on the cluster to share arguments."
        )
    return client


def _enter(options: Options, owner: object, site: str) -> Frame:
    """Enter a new scope (or none, when disabled) in this context; ``site`` names it (the
    decorated function, the block) in what verify mode reports."""
    if not options.enabled or _env.on(_env.DISABLE) or _over_ray_client():
        return enter(None, owner)
    ensure_installed()
    return enter(Scope(options, site), owner)


def _leave(frame: Frame) -> None:
    """Leave ``frame``; the scope it entered ends with it, whoever still runs in its
    context (an asyncio task, a pool's job): what it kept is let go of."""
    leave(frame)
    if isinstance(frame.scope, Scope):
        frame.scope.close()
    for hook in _ledger.on_call_end:
        hook()


class sharing:
    """Share large arguments of every Ray submission made inside a ``with`` block.

    Takes the same options as :func:`shared_args`. Reusable and re-entrant, from several
    threads or asyncio tasks at once; each entry starts a fresh scope, and the innermost
    scope's options apply. Leaving the block restores what was current before it was
    entered. Tasks submitted to a ``ThreadPoolExecutor`` inside the block run in it too;
    threads started by hand do not.
    """

    @signed
    def __init__(self, **options: Any) -> None:
        self._options = Options(**options)

    def __enter__(self) -> sharing:
        caller = sys._getframe(1)
        _enter(self._options, self, f"sharing() at {caller.f_code.co_filename}:{caller.f_lineno}")
        return self

    def __exit__(self, *exc_info: object) -> None:
        frame = innermost(self)
        if frame is not None:
            _leave(frame)


def _site(wrapped: Any) -> str:
    return str(getattr(wrapped, "__qualname__", None) or repr(wrapped))


def _runner(options: Options, asynchronous: bool) -> Callable[..., Any]:
    if asynchronous:

        async def run_async(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
            frame = _enter(options, wrapped, _site(wrapped))
            try:
                return await wrapped(*args, **kwargs)
            finally:
                _leave(frame)

        return run_async

    def run(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        frame = _enter(options, wrapped, _site(wrapped))
        try:
            return wrapped(*args, **kwargs)
        finally:
            _leave(frame)

    return run


class SharedFunction(wrapt.FunctionWrapper):  # type: ignore[type-arg]
    """What ``@shared_args`` returns: the function, run inside a scope with its options.

    It pickles as itself, options included, so a decorated method of a class that
    cloudpickle ships by value (defined in ``__main__`` or a notebook, used in an actor)
    still shares in the process that unpickles it.
    """

    def __init__(self, wrapped: Any, options: Options) -> None:
        target = getattr(wrapped, "__func__", wrapped)
        super().__init__(wrapped, _runner(options, inspect.iscoroutinefunction(target)))
        self._self_options = options

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, tuple[Any, ...]]:
        return _rebuild, (self.__wrapped__, self._self_options.spec())


def _rebuild(wrapped: Any, spec: dict[str, Any]) -> Any:
    ensure_pickling_patch()
    return SharedFunction(wrapped, Options(**spec))


self_pickling_types.add(SharedFunction)


def _make_decorator(options: Options) -> Callable[[_F], _F]:
    def decorate(func: _F) -> _F:
        target = getattr(func, "__func__", func)  # see through classmethod/staticmethod
        if not callable(target):
            raise TypeError(f"@shared_args decorates a function or method, got {func!r}")
        if inspect.isgeneratorfunction(target) or inspect.isasyncgenfunction(target):
            raise TypeError(
                f"@shared_args cannot decorate the generator {target.__qualname__!r}: its body "
                "runs after the call returns. Use `with refshare.sharing():` inside it instead."
            )
        ensure_pickling_patch()
        return cast(_F, SharedFunction(func, options))

    return decorate


@overload
def shared_args(func: _F, /) -> _F: ...


@overload
def shared_args(**options: Any) -> Callable[[_F], _F]: ...


@signed
def shared_args(func: _F | None = None, /, **options: Any) -> _F | Callable[[_F], _F]:
    """Share the large arguments of every Ray call the decorated function submits.

    While the function runs, each top-level argument of each ``.remote()`` it makes (actor
    methods, remote functions, actor creation) that reaches ``min_bytes`` is fingerprinted
    and sent as an ``ObjectRef``: put once, then found again by content. The function's own
    body still sees the original values.

    Args:
        min_bytes: arguments smaller than this go by value (default: 100 KiB, Ray's inline
            limit).
        cache: ``True`` for the process-wide cache, ``False`` to share within one call
            only, or a :class:`RefCache` of your own.
        enabled: ``False`` makes the decorator a pass-through.
        reuse_fingerprints: also skip hashing, across calls, tensors refshare hashed before
            and can tell are unchanged: on memory torch allocated, whose version counter
            has not moved (and views of them made again, as a batch chunked anew on each
            call). (Arrays read-only down to ``bytes`` or to Ray's object store, like those
            ``ray.get`` returns, are skipped anyway: nothing can change them.) You promise
            that such memory is changed only by torch's own operations on that tensor and
            its views: not through ``.data``, nor through another tensor ``set_`` on the
            same storage; refshare could then send the old content.
        puts: ``True`` (the default) makes ``ray.put(value)`` inside the function
            content-addressed too: a large value equal to one already stored returns that
            ref instead of storing it again. Ray objects are immutable, so a shared ref
            is safe; only ``ray.put(...) is``/``==`` comparisons of refs can tell.
            Puts with ``_owner`` or other options, and small values, go to Ray untouched.
        deep: whether to share the large members of an argument (dict values, list items,
            attributes, ``TensorDict`` leaves, ``DataProto`` tensors) one by one, sending the
            argument as a small skeleton naming them, so that a batch that grows between
            calls sends only what is new. ``None`` (the default) decides per argument: its
            members one by one where one was sent before, or where values of its kind had
            members sent again later; else the argument whole, in one put. ``True`` or
            ``False`` always or never. What a worker receives is the same either way.
        verify: ``True`` compares, on each send by ref (arguments, puts, ``share()``), what
            a receiver gets with what it gets of Ray's own by-value copy of that send (see
            docs/guarantees.md), and sends the copy where they differ (logged as an error,
            counted in ``stats().mismatches``) or where it cannot compare (a warning,
            ``stats().unverified``). ``"worker"``: each task's argument is compared by the
            worker that receives it, with its own code. Costs about what by value costs: for
            a run on your own data when you adopt refshare or upgrade a framework.
            ``REFSHARE_VERIFY=1`` (or ``worker``) turns it on everywhere.
        audit: key every large argument and ``ray.put`` as sharing would, and change
            nothing Ray sends: every argument goes by value, every put is Ray's own.
            :func:`refshare.report` then says, per call site, what sharing would save and
            what would go by value, and why. ``REFSHARE_AUDIT=1`` turns it on everywhere.

    Use bare (``@shared_args``) or with options (``@shared_args(min_bytes=1 << 20)``).
    Options are checked here, when decorating.
    """
    decorate = _make_decorator(Options(**options))
    return decorate if func is None else decorate(func)


def share(value: Any) -> ray.ObjectRef[Any]:
    """A content-addressed ``ray.put``: equal content gives the same ref.

    Uses the current scope's cache if called inside one, else the process-wide cache.
    Values refshare cannot fingerprint are put as they are; in audit mode every value is
    (Ray's own put), what sharing would do counted in the report.
    """
    current = current_scope()
    scope = current if isinstance(current, Scope) else Scope(_SHARE, "share()")
    ref = None if _env.on(_env.DISABLE) else scope.content_put(value)
    return cast("ray.ObjectRef[Any]", raw_put(value) if ref is None else ref)
