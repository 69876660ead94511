"""One call's decision: how each large argument of what it submits travels.

Read top to bottom, this is the path of every large argument: :meth:`Scope.rewrite` calls
:meth:`Scope.share` on each, which sizes it and decides its :class:`Route`: keyed whole
(found by content, or put), put as it is (a kind that has not repeated lately), or split
into members and a skeleton (deep sharing). Keying within the call is the memo's
(``memo.CallMemo``), storing the store's (``store.CallStore``), counting the ledger's.
"""

from __future__ import annotations

import enum
import logging
import time
from operator import is_not
from typing import Any

from ray import ObjectRef

from .. import _admission, _env
from .._admission import Admission, Kind, Moment, Moments, Splitting
from .._cache import audit_cache
from .._deep import Bundled, Skeleton, Split, never_split
from .._keys import Keyed
from .._keys.sizes import SCALARS, estimate_size, size_if_large
from .._keys.tables import leaf_digests, user_fingerprints
from .._ledger import Ledger, Tab, Timing, not_keying
from .._options import Options
from .._ray.session import current_session
from .._rules import pickles_by_own_code
from .._verify import MISMATCH, Mode, verifier, verify_by_env
from .._wire.serialized import Serialized, stored_whole
from .memo import CallMemo, NotKeyed
from .store import CallStore

logger = logging.getLogger("refshare")


class Route(enum.Enum):
    """How an argument is sent (see :meth:`Scope.route`)."""

    WHOLE = "keyed whole: looked up, or put"
    COLD = "put as it is, not keyed: its kind has not repeated lately"
    SPLIT = "split: its large members stored one by one, and a skeleton naming them"
    PROBE = "split to look: whole, unless a member was sent before"


class Scope:
    """One decorated call or ``sharing`` block: shares the arguments of what it submits."""

    __slots__ = ("admission", "audit", "deep", "ledger", "memo", "min_bytes", "moments",
                 "puts", "session", "site", "splitting", "store", "verify")  # fmt: skip

    def __init__(self, options: Options, site: str = "") -> None:
        #: What the scope is (the decorated function, the block), for the report.
        self.site = site
        #: Audit mode: key as sharing would, send everything by value (see _report).
        self.audit = options.audit or _env.on(_env.AUDIT)
        verify, env = options.verify, verify_by_env()
        verify = "worker" if "worker" in (verify, env) else verify or env  # "worker" wins
        self.verify: Mode = verify if not self.audit else False
        self.min_bytes = options.threshold
        self.deep = options.deep
        self.puts = options.puts
        self.ledger = Ledger(site, self.audit)
        cache = options.ref_cache
        if cache is not None and self.audit:
            cache = audit_cache(cache)
        self.memo = CallMemo(options.reuse_fingerprints, self.min_bytes, self.deep)
        self.store = CallStore(cache, self.audit, self.memo.forget)
        self.admission: Admission | None = cache.admission if cache is not None else None
        #: What is learned of which kinds of values have members sent again (deep=None).
        self.splitting = cache.splitting if cache is not None else Splitting()
        self.moments = Moments()
        self.session: tuple[str, str] | None = None

    # -- a task's arguments, ray.put and share() ---------------------------------------------

    def timing(self) -> Timing | None:
        """An audit's clock for the call about to be sent (see ``_ledger.Timing``)."""
        return self.ledger.timing()

    def rewrite(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """The task's ``args`` and ``kwargs`` with large values replaced by refs: the very
        same objects when nothing was replaced, so Ray sees no copy."""
        self.ledger.submission()
        if args:
            shared = [self.share(value, index) for index, value in enumerate(args)]
            if any(map(is_not, shared, args)):
                args = shared
        if kwargs:
            named = {name: self.share(value, name) for name, value in kwargs.items()}
            if any(map(is_not, named.values(), kwargs.values())):
                kwargs = named
        return args, kwargs

    def share(self, value: Any, argument: int | str = 0) -> Any:
        """What to send for a task's argument: a ref (or an inline skeleton) if it is large
        and can be shared, else ``value`` itself; ``argument`` names it (its position or
        keyword) in what verify mode reports."""
        if type(value) in SCALARS or isinstance(value, ObjectRef):
            return value
        nbytes = size_if_large(value, self.min_bytes)
        if nbytes is None or not self.ready():
            return value  # small, or Ray is not running yet: it starts on this very call
        tab = self.ledger.tab(nbytes)
        shared = self.send(value, tab)
        self.ledger.argument(tab)
        if shared is None or self.audit:
            self.store.sent_by_value(shared, nbytes)  # auditing: keyed, counted, by value
            return value
        if self.verify:
            shared = self.verified(value, shared, f"argument {argument!r}", task=True)
        return shared

    def ray_put(self, value: Any, **options: Any) -> ObjectRef[Any] | None:
        """The ref for ``ray.put(value, **options)`` made inside this scope: found by
        content or stored now; ``None`` leaves the put to Ray (small values, options such
        as ``_owner``, ``puts=False``, values holding refs or actor handles, audits)."""
        if not self.puts or any(v is not None for v in options.values()):
            return None
        if type(value) in SCALARS or isinstance(value, ObjectRef):
            return None  # Ray's own error for a ref, unchanged
        nbytes = size_if_large(value, self.min_bytes)
        if nbytes is None or not self.ready():
            return None
        return self.put(value, nbytes, "ray.put")

    def content_put(self, value: Any) -> ObjectRef[Any] | None:
        """The ref of ``value``'s content (``refshare.share()``), whatever its size, keyed
        whole (equal content, the same ref); ``None`` leaves the put to Ray (a value that
        cannot be keyed, audits)."""
        if isinstance(value, ObjectRef) or not self.ready():
            return None
        return self.put(value, estimate_size(value), "share()", content=True)

    def put(
        self, value: Any, nbytes: int, label: str, content: bool = False
    ) -> ObjectRef[Any] | None:
        """A put of ``value`` answered by content (``content``: keyed whole, whatever its
        kind); ``None`` for Ray's own put. What it returns is always a ref."""
        tab = self.ledger.tab(nbytes, put_call=not content)
        ref = self.whole(value, tab, None, True) if content else self.send(value, tab, True)
        if not isinstance(ref, ObjectRef):  # by value; an audit's stand-in
            self.store.sent_by_value(ref, nbytes)  # auditing: Ray's own put
            tab.put_call = False
            ref = None
        self.ledger.argument(tab)
        if ref is not None and self.verify:
            ref = self.verified(value, ref, label)
            ref = ref if isinstance(ref, ObjectRef) else None  # a mismatch: Ray's own put
        return ref  # type: ignore[no-any-return]

    def verified(self, value: Any, sent: Any, label: str, task: bool = False) -> Any:
        """``sent``, or the by-value copy, as verify finds what a receiver gets of both (see
        ``refshare._verify``; ``task``: checked on the worker under ``verify="worker"``). A
        mismatch of a value kept as its own pickle: it pickles differently, by value now."""
        on_worker = task and self.verify == "worker"
        verdict = verifier.check(value, sent, self.site, label, self.session, on_worker)
        self.ledger.verdict(verdict.outcome, verdict.reason)
        if verdict.outcome == MISMATCH:
            self.memo.pickles_differently(value)
        return verdict.sent

    # -- the decision ----------------------------------------------------------------------

    def send(self, value: Any, tab: Tab, put: bool = False) -> Any:
        """What travels for ``value`` (``put``: the value of a ``ray.put``), as :meth:`route`
        decides: its ref (an audit's stand-in), an inline skeleton, or ``None`` for by value."""
        kind = _admission.kind(value, tab.nbytes)
        way = self.route(value, kind, now := self.moments.now())
        if way is Route.WHOLE:
            return self.whole(value, tab, kind, put)
        if way is Route.COLD:
            return self.cold(value, tab, kind, put)
        return self.split(value, tab, kind, put, now, probe=way is Route.PROBE)

    def route(self, value: Any, kind: Kind, now: Moment) -> Route:
        """How an argument is sent, decided before anything is split. The first rule that
        applies, in this order:

        - ``deep=True``, or (``deep=None``) its kind has had members sent again, and its
          type is not keyed whole (see :meth:`keyed_whole`): ``SPLIT``;
        - its kind has not repeated lately (see ``refshare._admission``): ``COLD``, asked
          before the type's tables, as most values of a flow that sends a new batch on every
          call are cold, and a cold value is put whatever its type;
        - ``deep`` other than ``None``, a kind with members sent again, or a type keyed
          whole: ``WHOLE``;
        - anything else: ``PROBE``.
        """
        cls = type(value)
        deep = self.deep is True or (self.deep is None and self.splitting.repeats(kind, now))
        if deep and not self.keyed_whole(cls):
            return Route.SPLIT
        if self.admission is not None and not self.admission.keyed(kind):
            return Route.COLD
        if deep or self.deep is False or self.keyed_whole(cls):
            return Route.WHOLE
        return Route.PROBE

    def keyed_whole(self, cls: type) -> bool:
        """Whether values of ``cls`` are keyed whole, never split: a leaf, a type never
        split, or (``deep=None``) a type taught by ``register_fingerprint``."""
        if leaf_digests.exact(cls) is not None or never_split(cls):
            return True
        return self.deep is None and user_fingerprints.lookup(cls) is not None

    def whole(self, value: Any, tab: Tab, kind: Kind | None, put: bool) -> Any:
        """``value`` keyed whole: found by content, or put."""
        start = time.thread_time() if self.audit else 0.0  # the audit's clock: CPU time
        keyed = self.memo.key(value, tab.nbytes, put)
        if isinstance(keyed, NotKeyed):
            self.ledger.by_value(f"{type(value).__qualname__}: {keyed.reason}")
            return None
        if not self.audit:
            return self.stored(keyed, tab, kind)
        keying, puts = time.thread_time() - start, tab.puts
        ref = self.stored(keyed, tab, kind)
        if tab.puts > puts and isinstance(keyed.stored, Serialized):
            not_keying(keying)  # keyed by its pickle, which sharing would put: by value's work
        return ref

    def stored(self, keyed: Keyed, tab: Tab, kind: Kind | None = None) -> Any:
        """``keyed`` found by content or put, and counted: in ``tab``, and as a hit or miss
        of its ``kind`` for the admission."""
        got = self.store.find_or_put(keyed)
        if got is None:
            self.ledger.by_value("Ray refused its put")
            return None
        if kind is not None and self.admission is not None:
            self.admission.record(kind, hit=got.found)
        if got.found:
            tab.hit(1, keyed.nbytes, keyed.nbytes if got.in_call else 0, stored=keyed.stored)
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("hit  %d bytes, key %s", keyed.nbytes, keyed.key.hex()[:12])
        else:
            tab.put(keyed.nbytes, keyed.stored)
        return got.ref

    def cold(self, value: Any, tab: Tab, kind: Kind, put: bool) -> Any:
        """A value of a kind that has not repeated lately: put as it is, unless it is sent
        again within this call, which shows that its kind repeats after all."""
        assert self.admission is not None  # only the admission says cold
        if not self.memo.sent_unkeyed(value):
            self.admission.passed(kind)
            plain = leaf_digests.exact(type(value)) is not None or pickles_by_own_code(type(value))
            stored = stored_whole(value, tensors=not plain)
            put_now = self.store.put_form(stored, tab.nbytes, keyed=False)
            if put_now is None:
                self.ledger.by_value("Ray refused its put")
                return None
            tab.put(put_now[1], stored)  # what the store holds, as a keyed put counts
            tab.unkeyed += 1
            return put_now[0]
        self.admission.record(kind, hit=True)
        return self.whole(value, tab, None, put)

    def split(self, value: Any, tab: Tab, kind: Kind, put: bool, now: Moment, probe: bool) -> Any:
        """``value``'s large members stored one by one and a skeleton naming them; or, to
        probe (``probe``), ``value`` stored whole unless a member was sent before (or the
        very content was stored whole before). A skeleton too small to store, or holding
        refs or handles, is returned, to travel inside the task message; for a put
        (``put``), a skeleton is always stored, and one holding refs or handles is left to
        Ray's own put."""
        found = self.memo.split(value, put)
        if found is None:  # no large member: keyed whole, if its kind is keyed
            if not probe and self.admission is not None and not self.admission.keyed(kind):
                return self.cold(value, tab, kind, put)
            return self.whole(value, tab, kind, put)
        if found.result is not None and (not put or isinstance(found.result, ObjectRef)):
            self.sent_again(found, tab)
            return found.result  # this very value, split and stored before in this call
        members = [member.key for member in found.members]
        learned = self.splitting
        if self.deep is None and not found.handles:  # stored whole, refs would outlive it
            whole = Keyed(found.key(b"whole"), stored_whole(value, tensors=found.tensors),
                          tab.nbytes)  # fmt: skip
            if self.store.stored(whole.key):  # the very content was stored whole before
                return self.stored(whole, tab, kind)
            if probe:
                stored = self.store.stored
                sent_before = [key for key in members if stored(key) or learned.seen(key, now)]
                if not sent_before:
                    learned.remember(members, kind, now)
                    if self.admission is not None:
                        self.admission.record(kind, hit=False)
                    return self.stored(whole, tab)
                learned.found_again(sent_before, now)
        learned.remember(members, kind, now)
        if put and found.handles:
            return None  # Ray's own put: the refs and handles live as long as its object
        result = self.skeleton(found, tab, inline=not put)
        if result is not None:
            found.result = result
        return result

    def skeleton(self, found: Split, tab: Tab, inline: bool) -> Any:
        """Each member of ``found`` found or stored (the new ones together), then its
        skeleton: stored, or with ``inline``, returned when it is small or holds refs or
        handles, to travel in the task message as Ray inlines a small value, or with the
        task, so that the refs and handles in it live as long as by value."""
        got = self.store.put_members(found.members)
        refs = []
        holders = set()  # the objects put: a bundle holds several members
        for g, member in zip(got, found.members, strict=True):
            if g is None:
                self.ledger.by_value("Ray refused a member's put")
                return None
            tab.member(member.nbytes, member.stored, g.found, g.in_call)
            if not g.found:
                holders.add(g.ref.ref if type(g.ref) is Bundled else g.ref)
            refs.append(g.ref)
        tab.puts += len(holders)
        if logger.isEnabledFor(logging.DEBUG) and tab.hits:
            logger.debug("hit  %d members, %d bytes", tab.hits, tab.members)
        skeleton = Skeleton(found, refs)
        if inline and (found.nbytes < self.min_bytes or found.handles):
            return skeleton
        return self.stored(Keyed(skeleton.key, skeleton, found.nbytes), tab)

    def sent_again(self, found: Split, tab: Tab) -> None:
        """Count a split value sent again unchanged within this call as splitting it anew
        would: each member a hit, and its skeleton too where it was stored."""
        members = sum(member.nbytes for member in found.members)
        tab.hit(len(found.members), members, members, members)
        if not isinstance(found.result, Skeleton):
            tab.hit(1, found.nbytes, found.nbytes)

    # -- what it needs ---------------------------------------------------------------------

    def close(self) -> None:
        """The call has ended: what it kept is let go of, an audit's receivers counted."""
        self.store.close()
        self.ledger.close()

    def ready(self) -> bool:
        """Whether Ray is running; bound to its session (see ``CallStore.bind``)."""
        session = current_session()
        if session is not None:
            self.store.bind(session)
            self.session = session
        return session is not None
