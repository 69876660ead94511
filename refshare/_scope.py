"""One call's bookkeeping: where a task's argument becomes a ref.

Read top to bottom, this is the path of every large argument: :meth:`Scope.rewrite` calls
:meth:`Scope.share` on each, which sizes it, splits it into members if deep sharing is on,
and :meth:`Scope.store`\\ s it: keyed (see ``refshare._keys``), looked up in the scope and
the cache, or put in its stored form (see ``refshare._wire``).
"""

from __future__ import annotations

import contextlib
import enum
import logging
from typing import Any, NamedTuple

from ray import ObjectRef

from . import _admission, _report, _stats
from ._admission import Admission, Splitting
from ._cache import CacheEntry, PutLocks, RefCache, audit_cache, scope_budget
from ._deep import Bundled, NotSplittable, Skeleton, Split, bundled_key, never_split, split
from ._keys import Key, Keyed, Memo, identify
from ._keys.leaves import small_array, small_array_digest
from ._keys.pickler import learn_pickling, pickles_alike, pickling_classes
from ._keys.sizes import SCALARS, estimate_size, measure
from ._keys.stamps import first_put
from ._keys.structure import StampedMemo, structure_stamp
from ._keys.tables import leaf_digests, user_fingerprints
from ._options import Options
from ._pressure import gauge
from ._ray.session import current_session, stored_bytes
from ._ray.submit import raw_put
from ._rules import pickles_by_own_code
from ._verify import verifier, verify_by_env
from ._wire.serialized import PickleOnPut, bundle_form, stored_form

logger = logging.getLogger("refshare")


class Route(enum.Enum):
    """How an argument is sent (see :meth:`Scope.route`)."""

    WHOLE = "keyed whole: looked up, or put"
    COLD = "put as it is, not keyed: its kind has not repeated lately"
    SPLIT = "split: its large members stored one by one, and a skeleton naming them"
    PROBE = "split to look: whole, unless a member was sent before"


class Pickled(NamedTuple):
    """A value keyed by its own pickle, within one scope: its key, what it weighs, and the
    classes whose pickling decides whether it pickles alike again."""

    key: Key
    nbytes: int
    classes: frozenset[type]


class Unsent:
    """Stands for the ref of what an audit would have put: never sent, never stored."""

    __slots__ = ()


class Scope:
    """One decorated call or ``sharing`` block: shares the arguments of what it submits.

    The memo lets an array or tensor sent again be reused without hashing while its stamp
    holds (see ``refshare._keys.stamps``); ``pickled`` and ``splits`` do the same for values
    that had to be pickled to be keyed and for deep-shared values' skeletons, under a stamp
    of their whole structure (see ``StampedMemo``), so each is serialized or split at most
    once per call. ``local`` lets each content be put once per scope even when no cache is
    used or the value exceeds the cache budget; ``put_locks`` (the cache's, when there is
    one) make threads and scopes that miss one key at once wait for one put; ``unkeyed``
    names the values put without keying (see ``refshare._admission``), so that one sent
    again within the call makes its kind keyed again.

    ``local`` keeps what the scope stored alive in the object store. A long block (a
    training loop inside ``sharing()``) would keep every batch it sent, so once what it
    keeps passes half the local object store (with the cache's quarter, below where Ray
    starts spilling), the scope forgets it all (see :meth:`retain`); the cache keeps what
    repeats.
    """

    __slots__ = (
        "audit",
        "bundles",
        "cache",
        "deep",
        "held",
        "local",
        "memo",
        "min_bytes",
        "pickled",
        "put_locks",
        "put_once",
        "puts",
        "reuse",
        "session",
        "site",
        "splits",
        "splitting",
        "tally",
        "unkeyed",
        "verify",
    )

    def __init__(self, options: Options, site: str = "") -> None:
        #: What the scope is (the decorated function, the block), for what verify reports.
        self.site = site
        #: Audit mode: key as sharing would, send everything by value (see _report).
        self.audit = options.audit or _report.audit_by_env()
        self.verify = (options.verify or verify_by_env()) and not self.audit
        self.min_bytes = options.threshold
        cache = options.ref_cache
        self.cache: RefCache | None = (
            audit_cache(cache) if cache is not None and self.audit else cache
        )
        self.tally = _report.tally(site, self.audit)
        self.tally.add((_report.CALLS, 1))
        self.reuse = options.reuse_fingerprints
        self.puts = options.puts
        self.deep = options.deep
        self.memo: Memo = {}
        self.pickled = StampedMemo()
        self.splits = StampedMemo()
        self.local: dict[Key, Any] = {}
        #: The bundles ``local`` keeps a place of: each counted whole, once (see hold).
        self.bundles: set[Any] = set()
        self.put_locks = self.cache.put_locks if self.cache is not None else PutLocks()
        self.unkeyed: set[int] = set()
        #: Values ``ray.put`` once in this call, by id: stamped only when put again.
        self.put_once: set[int] = set()
        #: What is learned of which kinds of values have members sent again (deep=None).
        self.splitting = self.cache.splitting if self.cache is not None else Splitting()
        self.held = 0
        self.session: tuple[str, str] | None = None

    # -- a task's arguments, and ray.put ----------------------------------------------------

    def rewrite(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """Return the task's ``args`` and ``kwargs`` with large values replaced by refs.

        Returns the very same objects when nothing was replaced, so Ray sees no copy.
        """
        self.tally.add((_report.SUBMISSIONS, 1))
        new_args = args
        for index, value in enumerate(args or ()):
            shared = self.share(value, index)
            if shared is not value:
                if new_args is args:
                    new_args = list(args)
                new_args[index] = shared
        new_kwargs = kwargs
        for name, value in (kwargs or {}).items():
            shared = self.share(value, name)
            if shared is not value:
                if new_kwargs is kwargs:
                    new_kwargs = dict(kwargs)
                new_kwargs[name] = shared
        return new_args, new_kwargs

    def share(self, value: Any, argument: int | str = 0) -> Any:
        """Return a ref for ``value`` if it is large and shareable, else ``value`` itself;
        ``argument`` names it (its position or keyword) in what verify mode reports."""
        if type(value) in SCALARS or isinstance(value, ObjectRef):
            return value
        nbytes = self.size_if_large(value)
        if nbytes is None or not self.ready():
            return value  # small, or Ray is not running yet: it starts on this very call
        self.tally.add((_report.ARGUMENTS, 1), (_report.BYTES_SENT, nbytes))
        shared = self.store_argument(value, nbytes, fallback=value)
        if self.audit:
            return value  # keyed and counted; Ray sends it as it is
        if self.verify and shared is not value:
            label = f"argument {argument!r}"
            shared = verifier.check(value, shared, self.site, label, self.session)
            if shared is value:
                self.tally.add((_report.MISMATCHES, 1))
        return shared

    def ray_put(self, value: Any, **options: Any) -> Any:
        """The ref for ``ray.put(value, **options)`` made inside this scope: found by
        content or stored now; ``None`` leaves the put to Ray (small values, options such
        as ``_owner``, ``puts=False``, values holding refs or actor handles)."""
        if not self.puts or any(v is not None for v in options.values()):
            return None
        if type(value) in SCALARS or isinstance(value, ObjectRef):
            return None  # Ray's own error for a ref, unchanged
        nbytes = self.size_if_large(value)
        if nbytes is None or not self.ready():
            return None
        self.tally.add((_report.ARGUMENTS, 1), (_report.BYTES_SENT, nbytes))
        ref = self.store_argument(value, nbytes, fallback=None, put=True)
        if self.audit:
            return None  # keyed and counted; Ray's own put
        if ref is not None and self.verify:
            ref = verifier.check(value, ref, self.site, "ray.put", self.session)
            if ref is value:
                self.tally.add((_report.MISMATCHES, 1))
            ref = ref if ref is not value else None  # a mismatch: Ray's own put
        if ref is not None:
            _stats.record_put_call()
        return ref

    def store_argument(self, value: Any, nbytes: int, fallback: Any, put: bool = False) -> Any:
        """The ref of a task's argument or a ``ray.put``'s value: whole, or its large members
        one by one and a skeleton naming them (deep sharing), as :meth:`route` decides.

        A value split to probe it (``Route.PROBE``) is stored whole unless one of its members
        was sent before (or the very content was stored whole before). A skeleton too small
        to store, or holding refs or handles, is returned, to travel with its task; for a
        ``ray.put`` (``put``), a skeleton is always stored, and one holding refs or handles
        is left to Ray's own put.
        """
        kind = _admission.kind(value, nbytes)
        admission = self.cache.admission if self.cache is not None else None
        way, asked = self.route(value, kind, admission)
        if way is Route.WHOLE:
            return self.store(value, nbytes, fallback, admission, kind, asked, put)
        if way is Route.COLD:
            assert admission is not None  # only the admission says cold
            return self.store_cold(value, nbytes, fallback, admission, kind)
        deep = way is Route.SPLIT
        learned = self.splitting
        found = self.split(value, put)
        if found is not None and found.result is not None:
            self.sent_again(found)
            return found.result  # this very value, split and stored before in this call
        if found is None:  # no large member: keyed whole
            return self.store(value, nbytes, fallback, admission, kind, not deep, put)
        members = [member.key for member in found.members]
        if self.deep is None and not found.handles:  # stored whole, refs would outlive it
            stored = PickleOnPut(value) if found.tensors else value
            whole = Keyed(found.key(b"whole"), stored, nbytes)
            if self.stored(whole.key):  # the very content was stored whole before
                if admission is not None:
                    admission.record(kind, hit=True)
                return self.store_keyed(whole, fallback)
            if not deep:
                sent_before = [key for key in members if self.stored(key) or learned.seen(key)]
                if not sent_before:
                    learned.remember(members, kind)
                    if admission is not None:
                        admission.record(kind, hit=False)
                    return self.store_keyed(whole, fallback)
                learned.found_again(sent_before)
        learned.remember(members, kind)
        if put and found.handles:
            return None  # Ray's own put: the refs and handles live as long as its object
        result = self.store_split(found, fallback, inline=not put)
        if result is not fallback:
            found.result = result
        return result

    def sent_again(self, found: Split) -> None:
        """Count a split value sent again unchanged within this call as splitting it anew
        would: each member a hit, and its skeleton too where it was stored."""
        members = sum(member.nbytes for member in found.members)
        self.hit(len(found.members), members, members, members)
        if not isinstance(found.result, Skeleton):
            self.hit(1, found.nbytes, found.nbytes, 0)

    def route(
        self, value: Any, kind: _admission.Kind, admission: Admission | None
    ) -> tuple[Route, bool]:
        """How an argument is sent, decided before anything is split, and whether the
        admission was asked (asking counts a probe: it is asked once). The first rule that
        applies, in this order:

        - ``deep=True``, or (``deep=None``) its kind has had members sent again: ``WHOLE``
          for a type keyed whole (see :meth:`whole`), else ``SPLIT``;
        - its kind has not repeated lately (see ``refshare._admission``): ``COLD``, asked
          before the type's tables, as most values of a flow that sends a new batch on every
          call are cold, and a cold value is put whatever its type;
        - ``deep=False``, or a type keyed whole: ``WHOLE``;
        - anything else: ``PROBE``.
        """
        cls = type(value)
        if self.deep is True or (self.deep is None and self.splitting.repeats(kind)):
            return (Route.WHOLE if self.whole(cls) else Route.SPLIT), False
        if admission is not None and not admission.keyed(kind):
            return Route.COLD, True
        asked = admission is not None
        if self.deep is False or self.whole(cls):
            return Route.WHOLE, asked
        return Route.PROBE, asked

    def whole(self, cls: type) -> bool:
        """Whether values of ``cls`` are keyed whole, never split: a leaf, a type never
        split, or (``deep=None``) a type taught by ``register_fingerprint``."""
        if leaf_digests.exact(cls) is not None or never_split(cls):
            return True
        return self.deep is None and user_fingerprints.lookup(cls) is not None

    def store_split(self, found: Split, fallback: Any, inline: bool) -> Any:
        """Store each member of ``found`` by content (several that no scope or cache holds
        together, in one object), then its skeleton; with ``inline``, a skeleton that is
        small or holds refs or handles is returned instead, to travel inside the task
        message, as Ray inlines a small value, or with the task, so that the refs and
        handles in it live as long as by value."""
        refs = self.lookup_members(found.members)
        new: dict[Key, list[int]] = {}  # members no scope or cache holds: key -> where
        for index, (member, ref) in enumerate(zip(found.members, refs, strict=True)):
            if ref is None:
                new.setdefault(member.key, []).append(index)
        stored = self.store_new([found.members[where[0]] for where in new.values()])
        if any(ref is None for ref in stored):
            return fallback  # a member Ray refused: the argument goes by value
        for where, ref in zip(new.values(), stored, strict=True):
            for index in where:
                refs[index] = ref
        skeleton = Skeleton(found, refs)
        if inline and (found.nbytes < self.min_bytes or found.handles):
            return skeleton
        return self.store_keyed(Keyed(skeleton.key, skeleton, found.nbytes), fallback)

    def store_new(self, members: list[Keyed]) -> list[Any]:
        """Store ``members`` that no scope or cache held: several in one object. As in
        :meth:`store_keyed`, threads and scopes that miss one key at once wait for one put
        (see ``PutLocks``: two bundles never wait on each other)."""
        with self.put_locks.holding(member.key for member in members):
            refs = self.lookup_members(members)
            missing = [m for m, r in zip(members, refs, strict=True) if r is None]
            stored = self.put_bundle(missing) if len(missing) > 1 else None
            fresh = iter(stored or [self.put(member, None) for member in missing])
            return [next(fresh) if r is None else r for r in refs]

    def lookup_members(self, members: list[Keyed]) -> list[Any]:
        """The ref of each of ``members``, stored alone or in a bundle (hits), or ``None``."""
        refs: list[Any] = self.lookup_many([m.key for m in members], [m.nbytes for m in members])
        alone = [i for i, ref in enumerate(refs) if ref is None]
        if alone:
            keys = [bundled_key(members[i].key) for i in alone]
            found = self.lookup_many(keys, [members[i].nbytes for i in alone])
            for i, ref in zip(alone, found, strict=True):
                refs[i] = ref
        return refs

    def put_bundle(self, members: list[Keyed]) -> list[Any] | None:
        """Put new ``members`` in one object and keep each one's place in it, or ``None``
        if they cannot be stored so (each is then stored on its own)."""
        nbytes = sum(member.nbytes for member in members)
        form = () if self.audit else bundle_form([member.stored for member in members])
        put = self.put_stored(form, nbytes) if form is not None else None
        if put is None:
            return None
        ref, weight = put
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("put  %d bytes, %d members in one object", nbytes, len(members))
        keys = [bundled_key(member.key) for member in members]
        places = [Bundled(ref, index, weight) for index in range(len(members))]
        if self.cache is not None:  # weighed whole, once: any part keeps all of it alive
            items = list(zip(keys, places, strict=True))
            places = self.cache.setdefault_group(ref, items, weight)
        for place in places:
            self.hold(place, weight)
        self.local.update(zip(keys, places, strict=True))
        return places

    def size_if_large(self, value: Any) -> int | None:
        """The size of ``value`` if it reaches ``min_bytes``, else ``None``."""
        nbytes, complete = measure(value, self.min_bytes)
        if nbytes < self.min_bytes:
            return None
        # The estimate stopped at min_bytes: sized in full, for stats and the cache's budget.
        return nbytes if complete else estimate_size(value)

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

    def split(self, value: Any, put: bool = False) -> Split | None:
        """``value`` pickled with its large members taken out and keyed; ``None`` for a
        value without large members. Within this scope a value is split once while its
        structure stamp holds (a value ``ray.put``, ``put``: from its second put on, see
        :meth:`stamps`; its members' tensors stamped as :meth:`first_sight` says)."""
        found: Split | None = self.splits.get(value)
        if found is not None:
            return found
        try:
            with self.first_sight(value, put):
                found = split(value, self.key_member, self.min_bytes, strict=self.deep is None)
        except NotSplittable:
            return None
        except Exception:
            logger.debug("cannot split %s; shared whole", type(value).__qualname__, exc_info=True)
            return None
        if found is not None and not found.handles and self.stamps(value, put):
            # (Not with handles: kept, they would live on.) Its small arrays were hashed by
            # the split a moment ago: the stamp reuses that.
            members = found.members
            hashed = {id(m.stored): (m.stored, m.key) for m in members if small_array(m.stored)}
            self.splits.keep(value, found, hashed=hashed)
        return found

    def stamps(self, value: Any, put: bool) -> bool:
        """Whether to stamp ``value``, to find it unchanged if it is sent again in this call
        (a stamp walks all of it once more): a task's argument always, as it usually goes to
        several workers; the value of a ``ray.put`` from its second put on, as most are put
        once (their ref is what travels)."""
        if not self.put_first(value, put):
            return True
        # Only its id is kept: an id recycled meanwhile at worst stamps a value.
        self.put_once.add(id(value))
        return False

    def put_first(self, value: Any, put: bool) -> bool:
        """Whether ``value`` is being ``ray.put`` (``put``) for the first time in this call."""
        return put and id(value) not in self.put_once

    def first_sight(self, value: Any, put: bool) -> contextlib.AbstractContextManager[None]:
        """Where ``value`` is keyed: the tensors of a value put for the first time in this
        call, whole or member by member, are stamped only once seen again (see
        ``refshare._keys.stamps.first_put``)."""
        return first_put() if self.put_first(value, put) else contextlib.nullcontext()

    def key_member(self, member: Any, nbytes: int) -> Keyed | None:
        digest = small_array_digest(member)  # the many small arrays of a batch: hashed now
        if digest is not None:
            return Keyed(digest, member, nbytes)
        return self.key(member, nbytes)

    # -- one value: keyed, looked up, or put --------------------------------------------------

    def store(
        self,
        value: Any,
        nbytes: int,
        fallback: Any,
        admission: Admission | None = None,
        kind: _admission.Kind | None = None,
        asked: bool = False,
        put: bool = False,
    ) -> Any:
        """The ref for ``value``'s content: found in the scope or cache, or put now.

        With an ``admission`` (a task's argument, a ``ray.put``), a value of a ``kind`` the
        cache has not seen repeat lately is put without being keyed (see
        ``refshare._admission``); ``asked``: the admission has already said to key it;
        ``put``: the value of a ``ray.put`` (see :meth:`key`)."""
        if admission is not None and kind is not None and not (asked or admission.keyed(kind)):
            return self.store_cold(value, nbytes, fallback, admission, kind)
        why: list[str] = []
        keyed = self.key(value, nbytes, why, put)
        if keyed is None:
            reason = why[0] if why else "cannot be keyed"
            self.tally.by_value(f"{type(value).__qualname__}: {reason}")
            if not self.audit:
                _stats.record_by_value()
            return fallback
        if admission is not None and kind is not None:
            admission.record(kind, hit=self.stored(keyed.key))
        return self.store_keyed(keyed, fallback)

    def store_cold(
        self, value: Any, nbytes: int, fallback: Any, admission: Admission, kind: _admission.Kind
    ) -> Any:
        """A value of a kind that has not repeated lately: put as it is, unless it is sent
        again within this call, which shows that its kind repeats after all."""
        if id(value) not in self.unkeyed:
            # Only its id is kept: an id recycled meanwhile at worst keys a value.
            self.unkeyed.add(id(value))
            return self.put_unkeyed(value, nbytes, fallback)
        admission.record(kind, hit=True)
        return self.store(value, nbytes, fallback)

    def key(
        self, value: Any, nbytes: int, why: list[str] | None = None, put: bool = False
    ) -> Keyed | None:
        """Key ``value``, or ``None`` for by value (``why`` then gets the reason).

        A value that had to be pickled to be keyed is stored as that pickle and weighs what
        it pickled to; within this scope it is not pickled again while its structure stamp
        holds, once each class whose pickling it runs has shown that pickling an unchanged
        value gives the same bytes (see :func:`pickles_alike`); a value ``ray.put``
        (``put``) only from its second put on (see :meth:`stamps`); its tensors are stamped as
        :meth:`first_sight` says."""
        kept: Pickled | None = self.pickled.get(value)
        if kept is not None and pickles_alike(kept.classes):
            return Keyed(kept.key, value, kept.nbytes)
        with self.first_sight(value, put):
            found = identify(value, self.memo, self.reuse, why)
        if found is None:
            return None
        if found.serialized is not None:
            nbytes = found.serialized.nbytes
        if kept is not None:
            learn_pickling(kept.classes, alike=found.key == kept.key)
        if found.costly and self.stamps(value, put):
            stamp = structure_stamp(value)
            if stamp is not None:
                classes = pickling_classes(value, stamp.held)
                self.pickled.keep(value, Pickled(found.key, nbytes, classes), stamp)
        if found.serialized is not None:
            return Keyed(found.key, found.serialized, nbytes)
        return Keyed(found.key, PickleOnPut(value) if found.tensors else value, nbytes)

    def store_keyed(self, keyed: Keyed, fallback: Any) -> Any:
        """The ref stored under ``keyed.key`` in the scope or cache, or ``keyed.stored`` put.

        Threads (a pool putting chunks) and scopes sharing the cache that miss one key at
        the same moment wait for the first one's put instead of each putting the same
        content."""
        ref = self.lookup(keyed.key, keyed.nbytes)
        if ref is not None:
            return ref
        with self.put_locks.holding_one(keyed.key):
            ref = self.lookup(keyed.key, keyed.nbytes)
            if ref is not None:
                return ref
            return self.put(keyed, fallback)

    def stored(self, key: Key) -> bool:
        """Whether content is stored under ``key``, in the scope or cache (no hit counted)."""
        return key in self.local or (self.cache is not None and key in self.cache)

    def lookup(self, key: Key, nbytes: int, member: bool = False) -> Any:
        """The ref already stored under ``key`` in the scope or cache (a hit), or ``None``;
        ``member``: the content is a member of a split value."""
        ref = self.local.get(key)
        in_call = ref is not None
        if ref is None and self.cache is not None:
            ref = self.kept(key, self.cache.entry(key))
        if ref is not None:
            self.hit(1, nbytes, nbytes if in_call else 0, nbytes if member else 0)
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("hit  %d bytes, key %s", nbytes, key.hex()[:12])
        return ref

    def lookup_many(self, keys: list[Key], sizes: list[int]) -> list[Any]:
        """:meth:`lookup` of many members' keys: those the scope does not hold looked up in
        the cache at once."""
        refs = [self.local.get(key) for key in keys]
        in_call = sum(nbytes for ref, nbytes in zip(refs, sizes, strict=True) if ref is not None)
        missed = [i for i, ref in enumerate(refs) if ref is None]
        if missed and self.cache is not None:
            entries = self.cache.entries([keys[i] for i in missed])
            for i, entry in zip(missed, entries, strict=True):
                refs[i] = self.kept(keys[i], entry)
        hits = [nbytes for ref, nbytes in zip(refs, sizes, strict=True) if ref is not None]
        if hits:  # counted at once
            self.hit(len(hits), sum(hits), in_call, sum(hits))
            logger.debug("hit  %d members, %d bytes", len(hits), sum(hits))
        return refs

    def kept(self, key: Key, entry: CacheEntry | None) -> Any:
        """The ref of a cache ``entry`` found for ``key``, kept by this scope from now on."""
        if entry is None:
            return None
        self.hold(entry.ref, sum(nbytes for _, nbytes in entry.keeps))
        self.local[key] = entry.ref
        return entry.ref

    def hit(self, count: int, nbytes: int, in_call: int, members: int) -> None:
        """Count ``count`` hits of ``nbytes`` in all, ``in_call`` of them found in what this
        call sent, ``members`` of them members of split values."""
        self.tally.add(
            (_report.HITS, count),
            (_report.BYTES_REPEATED, nbytes),
            (_report.BYTES_IN_CALL, in_call),
            (_report.BYTES_MEMBERS, members),
        )
        if not self.audit:
            _stats.record_hits(count, nbytes)

    def put(self, keyed: Keyed, fallback: Any) -> Any:
        """Put ``keyed.stored`` and keep its ref, in this scope and the cache."""
        put = self.put_stored(keyed.stored, keyed.nbytes)
        if put is None:
            return fallback
        ref, weight = put
        keeps = keyed.stored.keeps if isinstance(keyed.stored, Skeleton) else ()
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("put  %d bytes, key %s", keyed.nbytes, keyed.key.hex()[:12])
        if self.cache is not None:  # a skeleton's object keeps its members alive
            ref = self.cache.setdefault(keyed.key, ref, weight, keeps)
        self.retain(weight + sum(nbytes for _, nbytes in keeps))
        self.local[keyed.key] = ref
        return ref

    def put_unkeyed(self, value: Any, nbytes: int, fallback: Any) -> Any:
        """Put ``value`` as it is, neither keyed nor cached, in the form a miss would store:
        a tensor as its bytes, a container through refshare's own pickler (its tensors as
        their bytes), a value with pickling of its own (a ``DataProto``) as Ray pickles it."""
        cls = type(value)
        plain = leaf_digests.exact(cls) is not None or pickles_by_own_code(cls)
        put = self.put_stored(value if plain else PickleOnPut(value), nbytes)
        if put is None:
            return fallback
        self.tally.add((_report.UNKEYED, 1))
        if not self.audit:
            _stats.record_unkeyed()
        return put[0]

    # -- what the scope keeps -------------------------------------------------------------------

    def put_stored(self, stored: Any, nbytes: int) -> tuple[Any, int] | None:
        """:func:`put_stored`, once what refshare keeps has made room for ``nbytes`` in the
        local object store (see ``refshare._pressure``). Auditing, nothing is put: what
        would be stored is counted, under a stand-in for its ref."""
        self.tally.add((_report.PUTS, 1), (_report.BYTES_DISTINCT, nbytes))
        if self.audit:
            return Unsent(), nbytes
        if gauge.over(nbytes):
            self.make_room(nbytes)
        put = put_stored(stored, nbytes)
        if put is None:
            self.tally.by_value("Ray refused its put")
        else:
            gauge.added(put[1])
        return put

    def make_room(self, nbytes: int) -> None:
        """Let go of what this scope keeps, then of the cache's least recently used, until
        ``nbytes`` more fit below the fill refshare yields at, or it keeps nothing more;
        each time it let go of an object, wait for Ray to free it (see ``_pressure``)."""
        held, cache, frees = self.held, self.cache, self.keeps_alone()
        self.forget()
        over = gauge.settle(nbytes) if frees else gauge.over(nbytes)
        freed = cache.shrink(over) if over and cache is not None else 0
        if freed:
            gauge.settle(nbytes)
        logger.debug(
            "the object store is filling: let go of %d bytes kept by the scope, %d by the cache",
            held,
            freed,
        )

    def keeps_alone(self) -> bool:
        """Whether this scope keeps a ref the cache does not: forgetting it frees an object."""
        cache = self.cache
        kept = tuple(self.local.items())  # taken at once: other threads may be sending
        return any(cache is None or not cache.keeps(key, ref) for key, ref in kept)

    def hold(self, ref: Any, nbytes: int) -> None:
        """Count what keeping ``ref`` keeps alive: a place in a bundle, the whole bundle,
        once however many of its places the scope keeps."""
        if type(ref) is Bundled:
            if ref.ref in self.bundles:
                return
            self.bundles.add(ref.ref)
            nbytes = ref.nbytes
        self.retain(nbytes)

    def retain(self, nbytes: int) -> None:
        """Count ``nbytes`` more of object store this scope keeps alive. Past its budget
        (half the local store), forget everything kept so far: a value sent again is then
        keyed again and found in the cache, or put again."""
        if self.held and self.held + nbytes > scope_budget(self.session):
            self.forget()
        self.held += nbytes

    def forget(self) -> None:
        """Let go of everything this scope kept."""
        self.memo.clear()
        self.pickled.clear()
        self.splits.clear()
        self.local.clear()
        self.bundles.clear()
        self.unkeyed.clear()
        self.put_once.clear()
        self.held = 0


def put_stored(stored: Any, nbytes: int) -> tuple[Any, int] | None:
    """``ray.put`` of the stored form of ``stored``, counted as a put: the ref and the bytes
    the object store holds for it. ``None`` if Ray refused it: the caller then sends by
    value, so the user gets Ray's own error."""
    try:
        ref = raw_put(stored_form(stored))
    except Exception:
        logger.debug("ray.put failed; sending by value", exc_info=True)
        _stats.record_by_value()
        return None
    _stats.record_put(nbytes)
    return ref, stored_bytes(ref, nbytes)
