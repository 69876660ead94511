"""RefCache: a byte-bounded, thread-safe LRU of object refs keyed by content fingerprint."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

from . import _ledger
from ._admission import Admission, Splitting, pooled_moment
from ._pressure import default_budget
from ._reuse import Reuse

#: How much a cache stores, as a share of its budget, before anything goes for its age: a
#: horizon learned in a loop's first step, before the loop came round once, is often shorter
#: than the loop (a batch sent again at once, then again next step).
WARM_UP = 0.5


def _check_max_bytes(max_bytes: object) -> int | None:
    if max_bytes is None:
        return None
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise ValueError(
            f"RefCache(max_bytes={max_bytes!r}): pass a whole number of bytes >= 0, "
            "or None for a quarter of the local object store"
        )
    return max_bytes


#: A stored object an entry keeps alive, and what the object store holds for it.
Kept = tuple[Hashable, int]


class CacheEntry(NamedTuple):
    ref: Any
    #: The stored objects this entry keeps alive (its own first), each with what the object
    #: store holds for it, recorded when it was stored: a skeleton keeps its members.
    keeps: tuple[Kept, ...]
    #: The object it is stored in with other entries (deep sharing's bundles), or ``None``.
    group: Hashable | None = None

    @property
    def holder(self) -> Any:
        """The ref of the object that holds this entry's content."""
        return self.ref if self.group is None else self.group


#: How many locks the keys being put are spread over (see :class:`PutLocks`).
PUT_LOCKS = 64


class RefCache:
    """A least-recently-used map from fingerprint to ``ray.ObjectRef``, bounded in bytes.

    What the cache weighs is what the object store holds for the objects its entries keep
    alive, each object counted once however many entries keep it: a bundle's parts, and a
    skeleton with the members it names (recorded when each was stored; a ref itself has no
    size). Eviction drops nothing but refshare's reference: Ray keeps the arguments of tasks
    already submitted alive. An entry larger than the whole budget is not cached. Entries
    stored in one object (a ``group``) are evicted together: none of its bytes is freed
    while one of them is kept.

    Within its budget, it keeps what is likely to be sent again: an entry unused for longer
    than the reuse distances its hits show is evicted before the next put (:meth:`age`) or
    on the next insert (see ``_reuse``), so that what it holds follows the working set it
    sees (the weights sent every step, a batch sent again by the step's calls), not its
    budget. Only while it warms up, until it has stored :data:`WARM_UP` of its budget in
    all since it was new (or cleared, or bound to a new session), does nothing go for its
    age: a loop's first step shows only reuses within the step, shorter than the loop, and
    a step sent again (NeMo-RL's, OpenRLHF's) would find its values gone. By the end of the
    warm-up, a loop that stores less than that in a step has come round, and its hits (the
    weights, the batch sent again) have shown how long it is; a longer loop's misses teach
    it (``_reuse``'s ghosts). The warm-up is counted in bytes stored, not held: once past
    it, a cache holding little still lets go of what has gone unused past its horizon.
    Whatever it keeps, a put that would fill the store lets go of it first (``_pressure``).

    ``max_bytes=None`` means a quarter of the object store of the node the driver runs on,
    read when the cache is first used in a Ray session. Refs are valid only in the Ray
    session that made them, so the cache empties itself when it sees a new one.

    ``admission`` counts which kinds of values repeat (see ``_admission``): scopes do not
    key, nor cache, values of a kind that has not repeated lately; ``splitting``, which
    kinds have members sent again, which scopes split into members by default.
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        self._max_bytes = _check_max_bytes(max_bytes)
        self._entries: OrderedDict[Hashable, CacheEntry] = OrderedDict()
        #: Group -> the keys of its entries.
        self._groups: dict[Hashable, list[Hashable]] = {}
        #: Each object an entry keeps alive -> how many entries keep it, and its bytes.
        self._alive: dict[Hashable, list[int]] = {}
        #: Held while a key's content is put: threads and scopes sharing this cache that
        #: miss one key at once wait for one put, bundles included.
        self.put_locks = PutLocks()
        self._nbytes = 0
        self._reuse = Reuse()
        self._session: tuple[str, str] | None = None
        self._lock = threading.RLock()
        self.admission = Admission()
        self.splitting = Splitting()

    @property
    def max_bytes(self) -> int:
        """The budget in bytes (resolved from the object store if none was given)."""
        if self._max_bytes is None:
            return default_budget()
        return self._max_bytes

    def _budget(self) -> int:
        """:attr:`max_bytes` in the session the cache is bound to, without reading Ray's
        (a put's path has just bound it, see :meth:`bind_session`)."""
        if self._max_bytes is None:
            return default_budget(self._session)
        return self._max_bytes

    @property
    def nbytes(self) -> int:
        """Bytes the object store holds for the objects the cache keeps alive, as recorded
        when each was stored: each object once."""
        return self._nbytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[Hashable]:
        with self._lock:
            return iter(list(self._entries))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(maxsize={self.max_bytes}, currsize={self._nbytes}, "
            f"len={len(self._entries)})"
        )

    def get(self, key: Hashable) -> Any | None:
        """Return the ref of the object holding the content stored for ``key`` and mark
        it recently used, or ``None``."""
        entry = self.entry(key)
        return None if entry is None else entry.holder

    def entry(self, key: Hashable) -> CacheEntry | None:
        """The entry stored for ``key``, marked recently used, or ``None``."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._reuse.at(pooled_moment())
                self._used(key)
            return entry

    def keeps(self, key: Hashable, ref: Any) -> bool:
        """Whether the cache keeps ``ref`` itself under ``key`` (recency left as it is)."""
        entry = self._entries.get(key)
        return entry is not None and entry.ref is ref

    def entries(self, keys: Sequence[Hashable]) -> list[CacheEntry | None]:
        """:meth:`entry` of each of ``keys``, under one hold of the lock (a split
        argument's thousands of members)."""
        with self._lock:
            found = [self._entries.get(key) for key in keys]
            self._reuse.at(pooled_moment())
            for key, entry in zip(keys, found, strict=True):
                if entry is not None:
                    self._used(key)
            return found

    def _used(self, key: Hashable) -> None:
        self._entries.move_to_end(key)
        self._reuse.used(key)

    def setdefault(self, key: Hashable, ref: Any, nbytes: int, keeps: Sequence[Kept] = ()) -> Any:
        """Store ``ref`` for ``key`` unless one is already there; return the stored ref.

        ``nbytes`` is what the object store holds for ``ref``; ``keeps``, the other stored
        objects it keeps alive (a skeleton's members). When two threads race to fill one
        key, the second takes the first one's ref, so callers never see two refs for one
        content."""
        with self._lock:
            self._reuse.at(pooled_moment())
            entry = self._entries.get(key)
            if entry is not None:
                self._used(key)
                return entry.ref
            self._insert([(key, CacheEntry(ref, ((ref, nbytes), *keeps)))])
            return ref

    def setdefault_group(
        self, group: Hashable, items: Sequence[tuple[Hashable, Any]], nbytes: int
    ) -> list[Any]:
        """Store the entries of one object, ``group`` (each ``(key, ref)``), which the
        object store holds ``nbytes`` for: all of them or none, the object counted once.
        A key already stored keeps its ref and stays out of the group; a key the group
        holds twice (one content twice in the object) is one entry, its first place.
        Returns the ref stored for each key."""
        with self._lock:
            self._reuse.at(pooled_moment())
            found = [self._entries.get(key) for key, _ in items]
            keeps = ((group, nbytes),)
            new: dict[Hashable, CacheEntry] = {}
            for (key, ref), e in zip(items, found, strict=True):
                if e is None and key not in new:
                    new[key] = CacheEntry(ref, keeps, group)
            if new and self._insert(list(new.items())):
                self._groups[group] = list(new)
            refs = []
            for (key, _), entry in zip(items, found, strict=True):
                if entry is not None:
                    self._used(key)
                refs.append(new[key].ref if entry is None else entry.ref)
            return refs

    def _insert(self, new: list[tuple[Hashable, CacheEntry]]) -> bool:
        """Add ``new`` entries, evicting the others that have gone unused past their horizon
        (see ``_reuse``; an object's entries once all of them have) once the cache has stored
        :data:`WARM_UP` of the budget in all, then the least recently used while it passes
        the budget; add none (and evict nothing) if they alone would not fit."""
        budget = self._budget()
        objects = dict(kept for _, entry in new for kept in entry.keeps)
        if sum(objects.values()) > budget:
            return False
        before = self._nbytes
        for key, entry in new:
            self._entries[key] = entry
            self._keep(entry)
        self._reuse.stored((key for key, _ in new), self._nbytes - before)
        self._age(budget)
        first = new[0][0]
        while self._nbytes > budget and next(iter(self._entries)) != first:
            self.popitem()  # the new entries came last
        return True

    def age(self) -> None:
        """Evict what has gone unused past its horizon: called before each put, so that the
        object store never holds the new object beside what the cache lets go of when it is
        stored (a loop's second step's first chunk beside the first step's, which the hits
        at that step's end showed were not coming back). What goes is what the insert after
        the put would evict, a put sooner: its clock, the bytes stored, is further on."""
        with self._lock:
            self._reuse.at(pooled_moment())
            self._age(self._budget())

    def _age(self, budget: int) -> None:
        """Evict the entries gone unused past their horizon (an object's once all of its
        entries have), once the cache has stored :data:`WARM_UP` of ``budget`` in all."""
        if self._reuse.clock <= budget * WARM_UP:
            return
        for key in self._reuse.expired():
            found = self._entries.get(key)
            mates = self._groups.get(found.group, ()) if found is not None else ()
            if found is not None and not any(map(self._reuse.within, mates)):
                self._evict(key, found)

    def _keep(self, entry: CacheEntry) -> None:
        for obj, nbytes in entry.keeps:
            count = self._alive.get(obj)
            if count is None:
                self._alive[obj] = [1, nbytes]
                self._nbytes += nbytes
            else:
                count[0] += 1

    def _release(self, entry: CacheEntry) -> None:
        for obj, _ in entry.keeps:
            count = self._alive[obj]
            count[0] -= 1
            if not count[0]:
                del self._alive[obj]
                self._nbytes -= count[1]

    def shrink(self, nbytes: int) -> int:
        """Evict least recently used entries until what the cache keeps alive is ``nbytes``
        less, or nothing is left; return the bytes let go of."""
        with self._lock:
            before = self._nbytes
            while self._entries and before - self._nbytes < nbytes:
                self.popitem()
            return before - self._nbytes

    def popitem(self) -> tuple[Hashable, Any]:
        """Evict the least recently used entry, and the others of its group; return the
        first's ``(key, ref)``."""
        with self._lock:
            key, entry = next(iter(self._entries.items()))
            self._evict(key, entry)
        return key, entry.holder

    def _evict(self, key: Hashable, entry: CacheEntry) -> None:
        """Evict ``key``'s ``entry``, and the others of its group."""
        del self._entries[key]
        self._evicted(key, entry)
        for other in self._groups.pop(entry.group, ()):  # no group: none
            evicted = self._entries.pop(other, None)
            if evicted is not None:
                self._evicted(other, evicted)

    def _evicted(self, key: Hashable, entry: CacheEntry) -> None:
        """Counted in the report of the call site whose put made room (an audit's: would
        have), and remembered for the horizon (see ``_reuse``)."""
        self._release(entry)
        self._reuse.evicted(key)
        _ledger.count_eviction()

    def clear(self) -> None:
        """Drop every ref (Ray frees each object once no task or caller still uses it),
        and what was counted of which values repeat."""
        with self._lock:
            self._entries.clear()
            self._groups.clear()
            self._alive.clear()
            self._nbytes = 0
            self._reuse.clear()
        self.admission.clear()
        self.splitting.clear()

    def bind_session(self, session: tuple[str, str] | None) -> None:
        """Empty the cache if its refs belong to another Ray session than ``session``."""
        if session != self._session:
            with self._lock:
                if session != self._session:
                    self.clear()
                    self._session = session


class PutLocks:
    """Locks held while the content of a key is put, so that whoever misses the same key
    meanwhile waits and finds it stored. Keys share a fixed number of locks: the table
    never grows, and two puts rarely wait for each other without need."""

    __slots__ = ("_locks",)

    def __init__(self) -> None:
        self._locks = [threading.RLock() for _ in range(PUT_LOCKS)]

    def holding_one(self, key: Hashable) -> threading.RLock:
        """The lock of ``key``, to hold (``with``): :meth:`holding` of one key, cheaper."""
        return self._locks[hash(key) % PUT_LOCKS]

    @contextlib.contextmanager
    def holding(self, keys: Iterable[Hashable]) -> Iterator[None]:
        """Hold the locks of ``keys``, taken in one order so that two holders of several
        never wait on each other."""
        with contextlib.ExitStack() as held:
            for index in sorted({hash(key) % PUT_LOCKS for key in keys}):
                held.enter_context(self._locks[index])
            yield


_process_cache = RefCache()
_audit_caches: weakref.WeakKeyDictionary[RefCache, RefCache] = weakref.WeakKeyDictionary()
_audit_lock = threading.Lock()


def audit_cache(cache: RefCache) -> RefCache:
    """The cache an audit of ``cache`` keys into: its budget, and stand-ins for refs, so
    that an audit counts what sharing through ``cache`` would find, and ``cache`` itself
    never holds a ref that was not put."""
    with _audit_lock:
        found = _audit_caches.get(cache)
        if found is None:
            found = _audit_caches[cache] = RefCache(cache._max_bytes)
        return found


def process_cache() -> RefCache:
    """The process-wide cache that ``cache=True`` uses."""
    return _process_cache
