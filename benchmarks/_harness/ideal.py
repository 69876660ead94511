"""The ideal: a step whose every large argument a perfect memoizer puts once, the first time
the step sends it, and whose repeats it knows in advance, so that the turn does nothing but
one ``ray.put`` per distinct content and hand Ray refs.

What it measures is a floor, not a strategy anyone can run: the step's dispatch, the
framework's own work (chunking, gathering), one put of each distinct large argument (what
any memoizer must pay: Ray's serialization and copy into the store, once) and the workers'
fetch from the store, with no keying, no splitting, no bookkeeping and no serialization of a
repeat. The seconds its puts take are kept apart (``Swap.put_seconds``): the turn less them
is the floor of a memoizer whose puts were made before the step.

How: an untimed pass of the step (the *record*, on an equal copy of the step's batch) runs
the framework as plain does, with Ray's submit path, ``ray.put`` and thread-pool submission
wrapped. It notes where the step sends each value: the name of the actor method, remote
function or ``ray.put``, and how many of that name its context sent before, inside the
thread-pool task it runs in (``parallel_put``'s threads put in any order, but are submitted
in order). Every task argument Ray would store (above its 100 KiB inline limit) and every
value put is timed through Ray's own serializer (what plain spends serializing it), and
numbered by its content: equal content as ``refshare.fingerprint`` keys it (by identity
where it cannot key it). In the ideal's turn the same wrappers put a content the first time
the turn sends it (its own copy of the batch's value) and swap in that ref at every later
place, one dict lookup per submission. Every worker's checksums are compared with plain's
as for every strategy: that check is what shows the swapped refs carry the step's own data.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import ray
import ray.actor
import ray.remote_function

#: Ray sends a by-value argument up to this size inline, in the task message, unstored.
INLINE_BYTES = 100 * 1024

Where = tuple[Any, ...]
#: Where the next submission is: the pool tasks it runs inside, and how many submissions of
#: each name this context made; ``None`` outside a record or ideal turn.
_position: contextvars.ContextVar[tuple[Where, dict[str, int]] | None] = contextvars.ContextVar(
    "ideal_position", default=None
)
_NOT_STORED = (ray.ObjectRef, ray.actor.ActorHandle, int, float, bool, type(None))


def _where(name: str) -> Where | None:
    found = _position.get()
    if found is None:
        return None
    prefix, counts = found
    counts[name] = count = counts.get(name, 0) + 1
    return (*prefix, name, count)


class Pass(Protocol):
    """What one turn does with what the step sends: see :class:`Record` and :class:`Swap`."""

    def submit(self, where: Where, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """The task's ``args`` and ``kwargs`` as Ray is to get them."""

    def put(self, where: Where, value: Any) -> Any:
        """The ref ``ray.put(value)`` returns, or ``None`` for Ray's own put."""


class Record:
    """The untimed pass: each large argument and put value serialized as Ray would (timed),
    and numbered by its content, by where the step sends it.

    ``calling`` names the call each value was sent in (the bytes put count per call)."""

    def __init__(self, calling: Callable[[], str]) -> None:
        import refshare

        self.fingerprint, self.calling = refshare.fingerprint, calling
        self.context = ray._private.worker.global_worker.get_serialization_context()
        self.contents: dict[Where, list[tuple[int | str, int]]] = {}  # a task's large arguments
        self.puts: dict[Where, int] = {}
        self.by_content: dict[Any, int] = {}  # content key -> its number
        self.kept: list[Any] = []  # what is keyed by identity, alive while it is
        self.serialize_seconds = 0.0
        self.stored_calls: dict[str, int] = {}  # bytes put, by the call that first sent them
        self.large = 0  # large arguments and put values sent

    def submit(self, where: Where, args: Any, kwargs: Any) -> tuple[Any, Any]:
        sent = [*enumerate(args or ()), *(kwargs or {}).items()]
        contents = [(at, c) for at, value in sent if (c := self.content(value)) is not None]
        if contents:
            self.contents[where] = contents
        return args, kwargs  # by value, as plain

    def put(self, where: Where, value: Any) -> Any:
        content = self.content(value)
        if content is not None:
            self.puts[where] = content
        return None  # Ray's own put, as plain

    def content(self, value: Any) -> int | None:
        """The number of ``value``'s content; ``None`` for what Ray does not store
        (inline-sized values, refs, handles). What this does is not the step's: its own
        thread-pool tasks (``fingerprint`` hashes large buffers in a pool) are not counted
        among the step's sends."""
        if isinstance(value, _NOT_STORED):
            return None
        token = _position.set(None)
        try:
            return self._content(value)
        finally:
            _position.reset(token)

    def _content(self, value: Any) -> int | None:
        start = time.perf_counter()
        nbytes = self.context.serialize(value).total_bytes
        seconds = time.perf_counter() - start
        if nbytes <= INLINE_BYTES:
            return None
        self.serialize_seconds += seconds
        self.large += 1
        key = self.fingerprint(value)
        if key is None:
            key = ("id", id(value))
            self.kept.append(value)
        content = self.by_content.get(key)
        if content is None:
            content = self.by_content[key] = len(self.by_content)
            call = self.calling()
            self.stored_calls[call] = self.stored_calls.get(call, 0) + nbytes
        return content


class Swap:
    """The ideal's turn: each content its record numbered put the first time the turn sends
    it, and its ref swapped in wherever the step sends it."""

    def __init__(self, record: Record) -> None:
        self.contents, self.puts = record.contents, record.puts
        self.refs: dict[int, Any] = {}  # content number -> the ref this turn put
        self.swapped = 0
        self.put_seconds = 0.0

    def _ref(self, content: int, value: Any) -> Any:
        ref = self.refs.get(content)
        if ref is None:
            start = time.perf_counter()
            ref = self.refs[content] = _original_put(value)
            self.put_seconds += time.perf_counter() - start
        return ref

    def submit(self, where: Where, args: Any, kwargs: Any) -> tuple[Any, Any]:
        contents = self.contents.get(where)
        if contents is None:
            return args, kwargs
        args, kwargs = list(args or ()), dict(kwargs or {})
        for at, content in contents:
            if isinstance(at, int):
                args[at] = self._ref(content, args[at])
            else:
                kwargs[at] = self._ref(content, kwargs[at])
        self.swapped += 1
        return args, kwargs

    def put(self, where: Where, value: Any) -> Any:
        content = self.puts.get(where)
        if content is None:
            return None
        self.swapped += 1
        return self._ref(content, value)

    def check(self) -> None:
        """Raise unless the turn sent from every place its record did."""
        if self.swapped != len(self.contents) + len(self.puts):
            raise RuntimeError(
                f"the ideal's turn swapped {self.swapped} submissions and puts, its record "
                f"had {len(self.contents) + len(self.puts)}: the step sent otherwise"
            )


_active: Pass | None = None
_original_put: Callable[..., Any] = ray.put


def _submitting(original: Callable[..., Any], name: Callable[[Any], str]) -> Callable[..., Any]:
    def _remote(self: Any, args: Any = None, kwargs: Any = None, *rest: Any, **options: Any) -> Any:
        where = _where(name(self))
        if where is not None and _active is not None:
            args, kwargs = _active.submit(where, args, kwargs)
        return original(self, args, kwargs, *rest, **options)

    return _remote


def _putting(original: Callable[..., Any]) -> Callable[..., Any]:
    def put(value: Any, *args: Any, **kwargs: Any) -> Any:
        way = None if args or kwargs else _active  # a put with options is Ray's own
        where = None if way is None else _where("ray.put")
        ref = None if way is None or where is None else way.put(where, value)
        return original(value, *args, **kwargs) if ref is None else ref

    return put


def _pooling(original: Callable[..., Any]) -> Callable[..., Any]:
    def submit(self: Any, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        where = _where("pool")
        if where is None:
            return original(self, fn, *args, **kwargs)
        context = contextvars.copy_context()  # the task counts its own sends, from there
        context.run(_position.set, (where, {}))
        return original(self, context.run, fn, *args, **kwargs)

    return submit


#: What is wrapped: owner, attribute, the wrapper made from the original.
TARGETS: tuple[tuple[Any, str, Callable[[Any], Callable[..., Any]]], ...] = (
    (ray.actor.ActorMethod, "_remote", lambda f: _submitting(f, lambda m: m._method_name)),
    (ray.remote_function.RemoteFunction, "_remote",
     lambda f: _submitting(f, lambda r: r._function_name)),
    (ray, "put", _putting),
    (concurrent.futures.ThreadPoolExecutor, "submit", _pooling),
)  # fmt: skip


@contextlib.contextmanager
def sending(way: Pass) -> Iterator[None]:
    """Ray's submit path, ``ray.put`` and thread-pool submission wrapped for one turn, each
    send handed to ``way``; the originals back after."""
    global _active, _original_put
    originals = [(owner, name, owner.__dict__[name]) for owner, name, _ in TARGETS]
    wrappers = [wrap(owner.__dict__[name]) for owner, name, wrap in TARGETS]
    _original_put = ray.__dict__["put"]
    for (owner, name, _), wrapper in zip(originals, wrappers, strict=True):
        setattr(owner, name, wrapper)
    _active, token = way, _position.set(((), {}))
    try:
        yield
    finally:
        _position.reset(token)
        _active = None
        for (owner, name, original), wrapper in zip(originals, wrappers, strict=True):
            if owner.__dict__[name] is not wrapper:
                raise RuntimeError(f"{owner.__name__}.{name} was wrapped again meanwhile")
            setattr(owner, name, original)
