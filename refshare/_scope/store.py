"""The call's store: what one call found or put, by key, and what it keeps alive.

Content is looked up in what the call stored (``local``), then in the cache; on a miss its
stored form is put, once per key however many threads miss it at once (``PutLocks``), and
kept in both. What the call keeps lives in the object store until the call ends (whoever
still runs in its context), up to its budget (half the local store); past that, or when
the store fills (see ``refshare._pressure``), it lets go of it, and so does every other
live call of the process. An audit's store is the same, with a put that stores nothing
and weighs what Ray would have stored: it runs without Ray.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from .._cache import CacheEntry, PutLocks, RefCache
from .._deep import Bundled, Skeleton, bundled_key
from .._keys import Key, Keyed
from .._pressure import gauge, scope_budget
from .._ray.session import stored_bytes
from .._ray.submit import raw_put
from .._wire.serialized import Bundle, stored_form, stored_size

logger = logging.getLogger("refshare")

#: Puts a stored value (see ``stored_form``) that weighs ``nbytes``: its ref and what the
#: object store holds for it, or ``None`` if it could not be stored.
PutFn = Callable[[Any, int], "tuple[Any, int] | None"]

#: Every live call's store, weakly: when the object store fills, each lets go of what it keeps.
_live: weakref.WeakSet[CallStore] = weakref.WeakSet()


def _nothing() -> None:
    pass


class Got(NamedTuple):
    """The ref stored for a key: found (``found``, in this call's own store: ``in_call``),
    or put just now."""

    ref: Any
    found: bool
    in_call: bool = False


class CallStore:
    """What one call found or put by key, and what it keeps alive (``audit``: what an audit
    of it would have, putting nothing)."""

    __slots__ = ("__weakref__", "audit", "began", "bundles", "cache", "closed", "forgotten",
                 "held", "local", "put_locks", "sent", "session")  # fmt: skip

    def __init__(
        self, cache: RefCache | None, audit: bool = False, forgotten: Callable[[], None] = _nothing
    ) -> None:
        self.cache = cache
        self.audit = audit
        #: Called whenever the store lets go of what it keeps (the call's memo goes too).
        self.forgotten = forgotten
        self.local: dict[Key, Any] = {}
        #: The bundles ``local`` keeps a place of: each counted whole, once (see hold).
        self.bundles: set[Any] = set()
        self.held = 0
        #: An audit's: bytes its call sent by value that sharing would have stored (Ray's
        #: copies, in the store while their tasks run), and how full the store was when
        #: the call began, which bounds how much of them can still be there (see over).
        self.sent = 0
        self.began = (gauge.used() or 0) if audit else 0
        self.put_locks = cache.put_locks if cache is not None else PutLocks()
        self.session: tuple[str, str] | None = None
        #: The call has ended: what it finds or puts is no longer kept (see close).
        self.closed = False
        _live.add(self)

    # -- looking up ------------------------------------------------------------------------

    def stored(self, key: Key) -> bool:
        """Whether content is stored under ``key``, here or in the cache (nothing counted)."""
        return key in self.local or (self.cache is not None and key in self.cache)

    def find(self, key: Key) -> Got | None:
        """The ref stored under ``key`` here or in the cache, kept by this call from now on."""
        ref = self.local.get(key)
        in_call = ref is not None
        if ref is None and self.cache is not None:
            ref = self.kept(key, self.cache.entry(key))
        return None if ref is None else Got(ref, True, in_call)

    def find_many(self, keys: list[Key]) -> list[Got | None]:
        """:meth:`find` of many members' keys: those this call does not hold looked up in
        the cache at once."""
        found: list[Got | None] = [None] * len(keys)
        missed = []
        for i, key in enumerate(keys):
            ref = self.local.get(key)
            if ref is None:
                missed.append(i)
            else:
                found[i] = Got(ref, True, True)
        if missed and self.cache is not None:
            entries = self.cache.entries([keys[i] for i in missed])
            for i, entry in zip(missed, entries, strict=True):
                ref = self.kept(keys[i], entry)
                if ref is not None:
                    found[i] = Got(ref, True)
        return found

    def find_members(self, members: list[Keyed]) -> list[Got | None]:
        """Each of ``members``, stored alone or in a bundle, or ``None``."""
        found = self.find_many([m.key for m in members])
        alone = [i for i, got in enumerate(found) if got is None]
        if alone:
            bundled = self.find_many([bundled_key(members[i].key) for i in alone])
            for i, got in zip(alone, bundled, strict=True):
                found[i] = got
        return found

    def kept(self, key: Key, entry: CacheEntry | None) -> Any:
        """The ref of a cache ``entry`` found for ``key``, kept by this call from now on."""
        if entry is None:
            return None
        if not self.closed:
            self.hold(entry.ref, sum(nbytes for _, nbytes in entry.keeps))
            self.local[key] = entry.ref
        return entry.ref

    # -- putting ---------------------------------------------------------------------------

    def find_or_put(self, keyed: Keyed) -> Got | None:
        """The ref stored under ``keyed.key``, or ``keyed.stored`` put now (``None`` if it
        could not be). Threads (a pool putting chunks) and calls sharing the cache that miss
        one key at once wait for the first one's put instead of each putting it."""
        got = self.find(keyed.key)
        if got is not None:
            return got
        with self.put_locks.holding_one(keyed.key):
            got = self.find(keyed.key)
            if got is not None:
                return got
            ref = self.put(keyed)
            return None if ref is None else Got(ref, False)

    def put(self, keyed: Keyed) -> Any:
        """Put ``keyed.stored`` and keep its ref, here and in the cache; ``None`` if it could
        not be stored."""
        put = self.put_form(keyed.stored, keyed.nbytes)
        if put is None:
            return None
        ref, weight = put
        keeps = keyed.stored.keeps if isinstance(keyed.stored, Skeleton) else ()
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("put  %d bytes, key %s", keyed.nbytes, keyed.key.hex()[:12])
        if self.cache is not None:  # a skeleton's object keeps its members alive
            ref = self.cache.setdefault(keyed.key, ref, weight, keeps)
        if not self.closed:
            self.retain(weight + sum(nbytes for _, nbytes in keeps))
            self.local[keyed.key] = ref
        return ref

    def put_members(self, members: list[Keyed]) -> list[Got | None]:
        """Each of ``members`` (of a split value), found, or put now: the new ones in one
        object, a bundle, where there are several, each content once (a member equal to
        one before it is found in this call). As in :meth:`find_or_put`, threads and
        calls that miss one key at once wait for one put (two bundles never wait on each
        other, see ``PutLocks``)."""
        with self.put_locks.holding(member.key for member in members):
            found = self.find_members(members)
            missing: dict[Key, Keyed] = {}  # one content twice (two masks of ones): once
            for member, got in zip(members, found, strict=True):
                if got is None:
                    missing.setdefault(member.key, member)
            new = list(missing.values())
            refs = self.put_bundle(new) if len(new) > 1 else None
            if refs is None:
                refs = [self.put(member) for member in new]
            fresh = dict(zip(missing, refs, strict=True))
            for i, got in enumerate(found):
                if got is None:
                    ref = fresh[members[i].key]
                    again = missing[members[i].key] is not members[i]  # found in this call
                    found[i] = None if ref is None else Got(ref, again, again)
            return found

    def put_bundle(self, members: list[Keyed]) -> list[Any] | None:
        """Put new ``members`` in one object and keep each one's place in it, or ``None``
        if they cannot be stored so (each is then stored on its own)."""
        put = self.put_form(Bundle([m.stored for m in members]), sum(m.nbytes for m in members))
        if put is None:
            return None
        ref, weight = put
        logger.debug("put  %d members in one object", len(members))
        keys = [bundled_key(member.key) for member in members]
        places = [Bundled(ref, index, weight) for index in range(len(members))]
        if self.cache is not None:  # weighed whole, once: any part keeps all of it alive
            items = list(zip(keys, places, strict=True))
            places = self.cache.setdefault_group(ref, items, weight)
        if not self.closed:
            for place in places:
                self.hold(place, weight)
            self.local.update(zip(keys, places, strict=True))
        return places

    def put_form(self, stored: Any, nbytes: int, keyed: bool = True) -> tuple[Any, int] | None:
        """Put ``stored`` once what refshare keeps has made room for ``nbytes`` in the local
        object store (see ``refshare._pressure``). An audit's puts nothing: it weighs what
        Ray would store (a value put without keying, ``keyed=False``, whose pickling may run
        the program's code, by its estimate), and makes room as sharing would."""
        if self.cache is not None:  # what it lets go of for its age leaves before the put
            self.cache.age()
        if self.over(nbytes):
            self.make_room(nbytes)
        if self.audit:
            if not keyed:
                return Unsent(nbytes), nbytes
            # Weighing pickles what sharing would put, as its put would (into a counter):
            # sharing's time, which the audit's clock counts with its keying.
            weight = _weight(stored, nbytes)
            return Unsent(weight), weight
        put = put_stored(stored, nbytes)
        if put is not None:
            gauge.added(put[1])
        return put

    def over(self, nbytes: int) -> int:
        """By how many bytes ``nbytes`` more would pass the fill refshare yields at. For an
        audit, the store as sharing would have it: Ray's by-value copies of what the live
        audited calls would have shared taken out (each call's, at most what the store
        has grown by since it began: its tasks' copies go as they end), and what sharing
        would keep in their place put in (its cache, and what each of those calls keeps
        that the cache does not), each object once."""
        if not self.audit:
            return gauge.over(nbytes, self.session)
        stores = [store for store in list(_live) if store.audit]
        kept = sum(store.kept_alone() for store in stores)
        kept += self.cache.nbytes if self.cache is not None else 0
        used = gauge.used(nbytes + kept, self.session)  # read again sooner if that nears the mark
        if used is None:
            return 0
        copies = sum(min(store.sent, max(0, used - store.began)) for store in stores)
        return gauge.past(used + nbytes + kept - copies, self.session)

    def sent_by_value(self, shared: Any, nbytes: int) -> None:
        """Count a value of ``nbytes`` sent by value, an argument or Ray's own put: for an
        audit, one that sharing would have stored or found (``shared``, what it would have
        sent instead, is not ``None``), a copy Ray holds in its place (see over)."""
        if self.audit and shared is not None:
            self.sent += nbytes

    def kept_alone(self) -> int:
        """An audit's: the bytes sharing would keep alive for this call that its cache does
        not (the cache let go of them while the call holds them), each object once."""
        alone = {id(whole): whole for whole in self.alone() if type(whole) is Unsent}
        return sum(whole.nbytes for whole in alone.values())

    # -- what the call keeps ----------------------------------------------------------------

    def hold(self, ref: Any, nbytes: int) -> None:
        """Count what keeping ``ref`` keeps alive: a place in a bundle, the whole bundle,
        once however many of its places the call keeps."""
        if type(ref) is Bundled:
            if ref.ref in self.bundles:
                return
            self.bundles.add(ref.ref)
            nbytes = ref.nbytes
        self.retain(nbytes)

    def retain(self, nbytes: int) -> None:
        """Count ``nbytes`` more of object store this call keeps alive. Past its budget
        (half the local store), let go of everything kept so far: a value sent again is then
        keyed again and found in the cache, or put again."""
        if self.held and self.held + nbytes > scope_budget(self.session):
            self.forget()
        self.held += nbytes

    def make_room(self, nbytes: int) -> None:
        """Let go of what every live call of the process keeps (sharing's, or an audit's),
        then of the cache's least recently used, until ``nbytes`` more fit below the fill
        refshare yields at, or it keeps nothing more; each time it let go of an object,
        wait for Ray to free it (see ``_pressure``)."""
        stores = [store for store in list(_live) if store.audit == self.audit]
        frees = any(store.keeps_alone() for store in stores)
        held = sum(store.held for store in stores)
        for store in stores:
            store.forget()
        settle = frees and not self.audit  # an audit frees nothing to wait for
        over = gauge.settle(nbytes) if settle else self.over(nbytes)
        cache = self.cache
        freed = cache.shrink(over) if over and cache is not None else 0
        if freed and not self.audit:
            gauge.settle(nbytes)
        logger.debug(
            "the object store is filling%s: let go of %d bytes kept by %d calls, %d by the "
            "cache, %d bytes past the mark",
            " (an audit's, as sharing would)" if self.audit else "",
            held,
            len(stores),
            freed,
            over,
        )

    def keeps_alone(self) -> bool:
        """Whether this call keeps a ref the cache does not: forgetting it frees an object."""
        return next(self.alone(), None) is not None

    def alone(self) -> Iterator[Any]:
        """The stored objects this call keeps that the cache does not (a bundle's once for
        each of its places)."""
        cache = self.cache
        for key, ref in tuple(self.local.items()):  # taken at once: a pool may be sending
            if cache is None or not cache.keeps(key, ref):
                yield ref.ref if type(ref) is Bundled else ref

    def bind(self, session: tuple[str, str]) -> None:
        """Refs live only in the session that made them: in a new one (Ray restarted inside
        this call) the call forgets what it kept, and the cache empties itself."""
        if session != self.session:
            if self.session is not None:
                self.forget()
                self.sent = self.began = 0  # Ray's copies went with the old session
            self.session = session
            if self.cache is not None:
                self.cache.bind_session(session)

    def forget(self) -> None:
        """Let go of everything this call kept, and of what it worked out about its values."""
        self.local.clear()
        self.bundles.clear()
        self.held = 0
        self.forgotten()

    def close(self) -> None:
        """The call has ended: let go of what it kept, and keep nothing it finds or puts
        from now on (an asyncio task or a pool's job started in it may still send)."""
        self.closed = True
        self.forget()
        _live.discard(self)


def put_stored(stored: Any, nbytes: int) -> tuple[Any, int] | None:
    """Ray's ``ray.put`` of the stored form of ``stored``: its ref and the bytes the object
    store holds for it. ``None`` if Ray refused it: the caller then sends by value, so the
    user gets Ray's own error."""
    try:
        ref = raw_put(stored_form(stored))
    except Exception:
        logger.debug("ray.put failed; sending by value", exc_info=True)
        return None
    return ref, stored_bytes(ref, nbytes)


def _weight(stored: Any, nbytes: int) -> int:
    """What the object store would hold for ``stored``, put (``nbytes`` where that cannot be
    worked out)."""
    try:
        return stored_size(stored_form(stored))
    except Exception:
        return nbytes


class Unsent:
    """Stands for the ref of what an audit would have put: never sent, never stored;
    ``nbytes``, what the object store would have held for it."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
