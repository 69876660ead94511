"""The @shared_args decorator, the sharing() block and share(): where arguments become refs."""

from __future__ import annotations

import inspect
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast, overload

import ray
import wrapt
from ray import ObjectRef

from . import _admission, _serialized, _stats
from ._cache import RefCache, scope_budget
from ._deep import Skeleton, ship_bootstrap_by_value, split
from ._fingerprint import Key, Memo, _leaf_digests, identify, runs_own_pickling
from ._patch import (
    Frame,
    current_scope,
    ensure_installed,
    ensure_pickling_patch,
    enter,
    exit_frame,
    innermost,
    raw_put,
    self_pickling_types,
)
from ._session import current_session, stored_bytes
from ._sizing import estimate_size, measure
from ._structure import StampedMemo

logger = logging.getLogger("refshare")

_F = TypeVar("_F", bound=Callable[..., Any])
CacheOption = bool | RefCache

#: Ray's own inline limit: smaller arguments travel inside the task message and are not
#: stored, so sharing them would only add a put.
DEFAULT_MIN_BYTES = 100 * 1024
#: Setting this environment variable to 1 makes every scope a pass-through.
DISABLE_ENV = "REFSHARE_DISABLE"

_process_cache = RefCache()
_SMALL_TYPES = frozenset((int, float, bool, complex, type(None)))


def process_cache() -> RefCache:
    """The process-wide cache that ``cache=True`` uses."""
    return _process_cache


def clear() -> None:
    """Empty the process-wide cache (Ray frees each object once no task still uses it), and
    forget what refshare learned of which values repeat and which classes pickle alike."""
    _process_cache.clear()
    _pickling_alike.clear()


def _disabled_by_env() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


class Options:
    """Validated options of one decorator or ``sharing`` block."""

    __slots__ = (
        "_cache_option",
        "cache",
        "deep",
        "enabled",
        "min_bytes",
        "puts",
        "reuse_fingerprints",
    )

    def __init__(
        self,
        min_bytes: int | None = None,
        cache: CacheOption = True,
        enabled: bool = True,
        reuse_fingerprints: bool = False,
        puts: bool = True,
        deep: bool = False,
    ) -> None:
        if min_bytes is None:
            min_bytes = DEFAULT_MIN_BYTES
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(
                f"min_bytes={min_bytes!r}: pass a whole number of bytes >= 0 "
                f"(the default, None, is {DEFAULT_MIN_BYTES})"
            )
        if not isinstance(cache, (bool, RefCache)):
            raise TypeError(
                f"cache={cache!r}: pass True (the process-wide cache), False (share within "
                "one call only) or a refshare.RefCache"
            )
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled={enabled!r}: pass True or False")
        if not isinstance(reuse_fingerprints, bool):
            raise TypeError(f"reuse_fingerprints={reuse_fingerprints!r}: pass True or False")
        if not isinstance(puts, bool):
            raise TypeError(f"puts={puts!r}: pass True or False")
        if not isinstance(deep, bool):
            raise TypeError(f"deep={deep!r}: pass True or False")
        if deep:
            ship_bootstrap_by_value()
        self.deep = deep
        self.puts = puts
        self._cache_option = cache
        self.reuse_fingerprints = reuse_fingerprints
        self.min_bytes = min_bytes
        self.cache: RefCache | None = (
            _process_cache if cache is True else (cache if isinstance(cache, RefCache) else None)
        )
        self.enabled = enabled

    def spec(self) -> dict[str, Any]:
        """The options as keyword arguments, for another process: a cache of your own
        becomes that process's own cache there."""
        return {
            "min_bytes": self.min_bytes,
            "cache": self._cache_option if isinstance(self._cache_option, bool) else True,
            "enabled": self.enabled,
            "reuse_fingerprints": self.reuse_fingerprints,
            "puts": self.puts,
            "deep": self.deep,
        }


class Scope:
    """One decorated call or ``sharing`` block: shares the arguments of what it submits.

    The memo lets an array or tensor sent again be reused without hashing while its stamp
    holds (see ``leaf_digest``); ``pickled`` and ``splits`` do the same for values that had
    to be pickled to be keyed and for deep-shared values' skeletons, under a stamp of their
    whole structure (see ``StampedMemo``), so each is serialized or split at most once per
    call. ``local`` lets each content be put once per scope even when no cache is used or
    the value exceeds the cache budget; ``pending`` makes threads that miss one key at once
    wait for one put; ``unkeyed`` names the values put without keying (see ``_admission``),
    so that one sent again within the call makes its kind keyed again.

    ``local`` keeps what the scope stored alive in the object store. A long block (a
    training loop inside ``sharing()``) would keep every batch it sent, so once what it
    keeps passes half the local object store (with the cache's quarter, below where Ray
    starts spilling), the scope forgets it all (see :meth:`retain`); the cache keeps what
    repeats.
    """

    __slots__ = (
        "cache",
        "deep",
        "held",
        "local",
        "memo",
        "min_bytes",
        "pending",
        "pickled",
        "puts",
        "reuse",
        "session",
        "splits",
        "unkeyed",
    )

    def __init__(self, options: Options) -> None:
        self.min_bytes = options.min_bytes
        self.cache = options.cache
        self.reuse = options.reuse_fingerprints
        self.puts = options.puts
        self.deep = options.deep
        self.splits = StampedMemo()
        self.pending: dict[Key, threading.Lock] = {}
        self.memo: Memo = {}
        self.pickled = StampedMemo()
        self.local: dict[Key, Any] = {}
        self.unkeyed: set[int] = set()
        self.held = 0
        self.session: tuple[str, str] | None = None

    def rewrite(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """Return the task's ``args`` and ``kwargs`` with large values replaced by refs.

        Returns the very same objects when nothing was replaced, so Ray sees no copy.
        """
        new_args = args
        for index, value in enumerate(args or ()):
            shared = self.share(value)
            if shared is not value:
                if new_args is args:
                    new_args = list(args)
                new_args[index] = shared
        new_kwargs = kwargs
        for name, value in (kwargs or {}).items():
            shared = self.share(value)
            if shared is not value:
                if new_kwargs is kwargs:
                    new_kwargs = dict(kwargs)
                new_kwargs[name] = shared
        return new_args, new_kwargs

    def share(self, value: Any) -> Any:
        """Return a ref for ``value`` if it is large and shareable, else ``value`` itself."""
        if type(value) in _SMALL_TYPES or isinstance(value, ObjectRef):
            return value
        nbytes = self.large(value)
        if nbytes is None or not self.ready():
            return value  # small, or Ray is not running yet: it starts on this very call
        if self.deep:
            skeleton = self.split(value)
            if skeleton is not None:
                if skeleton.nbytes < self.min_bytes or skeleton.handles:
                    # Inside the task message, as Ray inlines a small value; or sent with
                    # the task, so that the refs and handles in it live as long as by value.
                    return skeleton
                return self.store_as(skeleton.key, skeleton, skeleton.nbytes, skeleton)
        return self.store(value, nbytes, fallback=value, admit=True)

    def large(self, value: Any) -> int | None:
        """The size of ``value`` if it reaches ``min_bytes``, else ``None``."""
        nbytes, complete = measure(value, self.min_bytes)
        if nbytes < self.min_bytes:
            return None
        # The estimate stopped at min_bytes: sized in full, for stats and the cache's budget.
        return nbytes if complete else estimate_size(value)

    def split(self, value: Any) -> Skeleton | None:
        """``value``'s skeleton, its large members stored by content; ``None`` for a leaf or
        a value without large members. Within this scope a value is split once while its
        structure stamp holds."""
        if _leaf_digests.exact(type(value)) is not None:
            return None
        skeleton: Skeleton | None = self.splits.get(value)
        if skeleton is not None:
            return skeleton
        try:
            skeleton = split(value, self.store_member, self.min_bytes)
        except Exception:
            logger.debug("cannot split %s; shared whole", type(value).__qualname__, exc_info=True)
            return None
        if skeleton is not None and not skeleton.handles:
            self.splits.keep(value, skeleton)  # not one holding handles: they would live on
        return skeleton

    def store_member(self, member: Any, nbytes: int) -> Any:
        return self.store(member, nbytes, fallback=None)

    def put(self, value: Any, **options: Any) -> Any:
        """The ref for ``ray.put(value, **options)`` made inside this scope: found by
        content or stored now; ``None`` leaves the put to Ray (small values, options such
        as ``_owner``, ``puts=False``, values holding refs or actor handles)."""
        if not self.puts or any(v is not None for v in options.values()):
            return None
        if type(value) in _SMALL_TYPES or isinstance(value, ObjectRef):
            return None  # Ray's own error for a ref, unchanged
        nbytes = self.large(value)
        if nbytes is None or not self.ready():
            return None
        skeleton = self.split(value) if self.deep else None
        if skeleton is not None:
            if skeleton.handles:
                return None
            _stats.record_put_call()
            return self.store_as(skeleton.key, skeleton, skeleton.nbytes, None)
        ref = self.store(value, nbytes, fallback=None, admit=True)
        if ref is not None:
            _stats.record_put_call()
        return ref

    def ready(self) -> bool:
        """Whether Ray is running. Refs live only in the session that made them: in a new
        session (Ray restarted inside this scope) the scope forgets what it kept, and the
        cache empties itself."""
        session = current_session()
        if session is None:
            return False
        if session != self.session:
            if self.session is not None:
                self.forget()
            self.session = session
            if self.cache is not None:
                self.cache.bind_session(session)
        return True

    def identify(self, value: Any, nbytes: int) -> tuple[Key, Any, int] | None:
        """Key ``value``: ``(key, what to put, bytes it weighs)``, or ``None`` for by value.

        A value that had to be pickled to be keyed is stored as that pickle and weighs what
        it pickled to; within this scope it is not pickled again while its structure stamp
        holds, once its class has shown that pickling an unchanged value gives the same
        bytes (see :func:`pickles_alike`)."""
        kept: tuple[Key, int] | None = self.pickled.get(value)
        if kept is not None and pickles_alike(type(value)):
            return kept[0], value, kept[1]
        found = identify(value, self.memo, self.reuse)
        if found is None:
            return None
        key, serialized, costly, tensors = found
        if serialized is not None:
            nbytes = serialized.nbytes
        if kept is not None:
            learn_pickling(type(value), alike=key == kept[0])
        if costly:
            self.pickled.keep(value, (key, nbytes))
        if serialized is None:
            return key, PickleOnPut(value) if tensors else value, nbytes
        return key, serialized, nbytes

    def store(self, value: Any, nbytes: int, fallback: Any, admit: bool = False) -> Any:
        """The ref for ``value``'s content: found in the scope or cache, or put now.

        With ``admit`` (a task's argument, a ``ray.put``), a value of a kind the cache has
        not seen repeat lately is put without being keyed (see ``_admission``)."""
        admission = self.cache.admission if admit and self.cache is not None else None
        kind = _admission.kind(value, nbytes)
        if admission is not None and not admission.keyed(kind):
            if id(value) not in self.unkeyed:
                # Only its id is kept: an id recycled meanwhile at worst keys a value.
                self.unkeyed.add(id(value))
                return self.put_unkeyed(value, nbytes, fallback)
            admission.record(kind, hit=True)  # sent again within this call: it repeats
        found = self.identify(value, nbytes)
        if found is None:
            _stats.record_by_value()
            return fallback
        if admission is not None:
            ref = self.found(found[0], found[2])
            admission.record(kind, hit=ref is not None)
            if ref is not None:
                return ref
        return self.store_as(*found, fallback)

    def put_unkeyed(self, value: Any, nbytes: int, fallback: Any) -> Any:
        """Put ``value`` as it is, neither keyed nor cached, in the form a miss would store:
        a tensor as its bytes, a container through refshare's own pickler (its tensors as
        their bytes), a value with pickling of its own (a ``DataProto``) as Ray pickles it."""
        cls = type(value)
        plain = _leaf_digests.exact(cls) is not None or runs_own_pickling(cls)
        put = put_counted(value if plain else PickleOnPut(value), nbytes)
        if put is None:
            return fallback
        _stats.record_unkeyed()
        return put[0]

    def found(self, key: Key, nbytes: int) -> Any:
        """The ref already stored under ``key`` in the scope or cache (a hit), or ``None``."""
        ref = self.local.get(key)
        if ref is None and self.cache is not None:
            entry = self.cache.entry(key)
            if entry is not None:
                ref, weight = entry
                self.retain(weight)
                self.local[key] = ref
        if ref is not None:
            _stats.record_hit(nbytes)
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("hit  %d bytes, key %s", nbytes, key.hex()[:12])
        return ref

    def store_as(self, key: Key, stored: Any, nbytes: int, fallback: Any) -> Any:
        """The ref stored under ``key`` in the scope or cache, or ``stored`` put now.

        Threads of this scope (a pool putting chunks) that miss one key at the same moment
        wait for the first one's put instead of each putting the same content."""
        ref = self.found(key, nbytes)
        if ref is not None:
            return ref
        with self.pending.setdefault(key, threading.Lock()):
            ref = self.found(key, nbytes)
            if ref is not None:
                return ref
            return self.put_new(key, stored, nbytes, fallback)

    def put_new(self, key: Key, stored: Any, nbytes: int, fallback: Any) -> Any:
        put = put_counted(stored, nbytes)
        if put is None:
            return fallback
        ref, weight = put
        if isinstance(stored, Skeleton):
            weight += stored.members_nbytes  # its object keeps its members alive
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("put  %d bytes, key %s", nbytes, key.hex()[:12])
        if self.cache is not None:
            ref = self.cache.setdefault(key, ref, weight)
        self.retain(weight)
        self.local[key] = ref
        return ref

    def retain(self, nbytes: int) -> None:
        """Count ``nbytes`` more of object store this scope keeps alive. Past its budget
        (half the local store), forget everything kept so far: a value sent again is then
        keyed again and found in the cache, or put again."""
        if self.held and self.held + nbytes > scope_budget():
            self.forget()
        self.held += nbytes

    def forget(self) -> None:
        """Let go of everything this scope kept."""
        self.memo.clear()
        self.pickled.clear()
        self.splits.clear()
        self.local.clear()
        self.unkeyed.clear()
        self.pending.clear()
        self.held = 0


#: Per class whose values are keyed by their own pickle: whether pickling an unchanged value
#: twice gave the same bytes. Until one is sent again in a call, it is not known.
_pickling_alike: dict[type, bool] = {}


def pickles_alike(cls: type) -> bool:
    """Whether an unchanged value of ``cls`` may be sent again as the pickle made of it
    before: known once one value of ``cls`` was pickled twice (see :meth:`Scope.identify`)."""
    return _pickling_alike.get(cls, False)


def learn_pickling(cls: type, alike: bool) -> None:
    """Record whether pickling an unchanged value of ``cls`` twice gave the same bytes. A
    class that did not is pickled on every submission, as by value."""
    if _pickling_alike.get(cls) is not False:
        if len(_pickling_alike) >= 4096:
            _pickling_alike.clear()
        _pickling_alike[cls] = alike


def put_counted(stored: Any, nbytes: int) -> tuple[Any, int] | None:
    """``ray.put`` of :func:`stored_form` of ``stored``, counted as a put: the ref and the
    bytes the object store holds for it. ``None`` if Ray refused it: the caller then sends
    by value, so the user gets Ray's own error."""
    try:
        ref = raw_put(stored_form(stored))
    except Exception:
        logger.debug("ray.put failed; sending by value", exc_info=True)
        _stats.record_by_value()
        return None
    _stats.record_put(nbytes)
    return ref, stored_bytes(ref, nbytes)


class PickleOnPut:
    """A value holding tensors, keyed without serializing it: on a miss refshare pickles it
    with Ray's pickler and its tensors as their bytes (see ``_tensors``), one copy of them
    instead of the three torch's pickling makes."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def stored_form(stored: Any) -> Any:
    """What ``ray.put`` stores for ``stored``: a plain CPU tensor as its storage's bytes, an
    array of strings joined, a value holding tensors as refshare's own pickle of it,
    anything else as it is."""
    if isinstance(stored, PickleOnPut):
        if not _serialized.available():
            return stored.value
        try:
            return _serialized.serialize(stored.value, keyed=False)  # its key is known
        except Exception:
            logger.debug("cannot pickle %s itself", type(stored.value).__qualname__, exc_info=True)
            return stored.value  # refs inside, say: Ray's own serialization
    form = _serialized.own_form(stored)
    return stored if form is None else form


_warned_client = False


def _over_ray_client() -> bool:
    """Whether this thread talks to Ray through Ray Client (``ray://``), where submissions
    and puts go through the client's own stubs, which refshare does not patch."""
    global _warned_client
    try:
        from ray._private.client_mode_hook import client_mode_should_convert

        client = bool(client_mode_should_convert())  # type: ignore[no-untyped-call]
    except Exception:
        return False
    if client and not _warned_client:
        _warned_client = True
        logger.warning(
            "refshare does not share over Ray Client (ray://): every call goes by value, "
            "as without refshare. Run the driver on the cluster to share arguments."
        )
    return client


def _enter(options: Options, owner: object) -> Frame:
    """Enter a new scope (or none, when disabled) in this context."""
    if not options.enabled or _disabled_by_env() or _over_ray_client():
        return enter(None, owner)
    ensure_installed()
    return enter(Scope(options), owner)


class sharing:
    """Share large arguments of every Ray submission made inside a ``with`` block.

    Takes the same options as :func:`shared_args`. Reusable and re-entrant, from several
    threads or asyncio tasks at once; each entry starts a fresh scope, and the innermost
    scope's options apply. Leaving the block restores what was current before it was
    entered. Tasks submitted to a ``ThreadPoolExecutor`` inside the block run in it too;
    threads started by hand do not.
    """

    def __init__(
        self,
        *,
        min_bytes: int | None = None,
        cache: CacheOption = True,
        enabled: bool = True,
        reuse_fingerprints: bool = False,
        puts: bool = True,
        deep: bool = False,
    ) -> None:
        self._options = Options(min_bytes, cache, enabled, reuse_fingerprints, puts, deep)

    def __enter__(self) -> sharing:
        _enter(self._options, self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        frame = innermost(self)
        if frame is not None:
            exit_frame(frame)


def _runner(options: Options, asynchronous: bool) -> Callable[..., Any]:
    if asynchronous:

        async def run_async(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
            frame = _enter(options, wrapped)
            try:
                return await wrapped(*args, **kwargs)
            finally:
                exit_frame(frame)

        return run_async

    def run(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        frame = _enter(options, wrapped)
        try:
            return wrapped(*args, **kwargs)
        finally:
            exit_frame(frame)

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
def shared_args(
    *,
    min_bytes: int | None = None,
    cache: CacheOption = True,
    enabled: bool = True,
    reuse_fingerprints: bool = False,
    puts: bool = True,
    deep: bool = False,
) -> Callable[[_F], _F]: ...


def shared_args(
    func: _F | None = None,
    /,
    *,
    min_bytes: int | None = None,
    cache: CacheOption = True,
    enabled: bool = True,
    reuse_fingerprints: bool = False,
    puts: bool = True,
    deep: bool = False,
) -> _F | Callable[[_F], _F]:
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
        reuse_fingerprints: also skip hashing, across calls, objects refshare hashed
            before and can tell are unchanged: torch tensors whose version counter has not
            moved (and views of them made again, as a batch chunked anew on each call), and
            read-only numpy arrays that own their memory. (Arrays read-only down to
            ``bytes`` or to Ray's object store, like those ``ray.get`` returns, are skipped
            anyway: nothing can change them.) You promise not to change such memory
            behind torch's or numpy's back (through ``.numpy()``/``.data``/DLPack views of a
            tensor, or by making a read-only array writeable again); refshare could then
            send the old content.
        puts: ``True`` (the default) makes ``ray.put(value)`` inside the function
            content-addressed too: a large value equal to one already stored returns that
            ref instead of storing it again. Ray objects are immutable, so a shared ref
            is safe; only ``ray.put(...) is``/``==`` comparisons of refs can tell.
            Puts with ``_owner`` or other options, and small values, go to Ray untouched.
        deep: also share the large members of an argument (dict values, list items,
            attributes, ``TensorDict`` entries, ``DataProto`` tensors) one by one, and send
            the argument as a small skeleton naming them, so a batch that grows between
            calls sends only what is new. The worker rebuilds it while Ray unpickles the
            argument, which needs refshare importable where the workers run.

    Use bare (``@shared_args``) or with options (``@shared_args(min_bytes=1 << 20)``).
    Options are checked here, when decorating.
    """
    decorate = _make_decorator(Options(min_bytes, cache, enabled, reuse_fingerprints, puts, deep))
    return decorate if func is None else decorate(func)


def share(value: Any) -> ray.ObjectRef[Any]:
    """A content-addressed ``ray.put``: equal content gives the same ref.

    Uses the current scope's cache if called inside one, else the process-wide cache.
    Values refshare cannot fingerprint are put as they are.
    """
    current = current_scope()
    scope = current if isinstance(current, Scope) else Scope(Options(min_bytes=0))
    if _disabled_by_env() or not scope.ready():
        return cast("ray.ObjectRef[Any]", raw_put(value))
    ref = scope.store(value, estimate_size(value), fallback=None)
    return cast("ray.ObjectRef[Any]", raw_put(value) if ref is None else ref)
