"""One ledger: what each call site did, each event counted once.

A call site is what opened a scope: the decorated function, the ``Class.method`` that
``enable`` or ``patch_methods`` wrapped, or a ``sharing()`` block. Each scope counts into its
site's :class:`Tally` (a few additions under one lock per large argument); ``report()``
reads the tallies as they are, and ``stats()`` sums those of sharing (not of audits).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ._clocks import SENDS, copying, unpickling
from ._context import current_scope
from ._wire.serialized import put_as_bytes

#: What a tally counts, in the report's order.
FIELDS = (
    "calls",  #: scopes opened: calls of the function, ``sharing()`` blocks entered
    "submissions",  #: ``.remote()`` calls made inside them
    "arguments",  #: large arguments, ``ray.put`` and ``share()`` values seen
    "bytes_sent",  #: their bytes: what Ray serializes and stores of them by value
    "bytes_repeated",  #: of those, bytes sent before: not stored again
    "bytes_repeated_in_call",  #: of the repeated, found in what the same call sent
    "bytes_repeated_members",  #: of the repeated, members of split values (deep sharing)
    "bytes_distinct",  #: of those, bytes stored (put) once each
    "bytes_stored",  #: what was put weighs, stored (a pickle's overhead, a skeleton included)
    "puts",  #: objects put
    "hits",  #: stored objects found again (a split value's members each count)
    "unkeyed",  #: values put without keying: of a kind that has not repeated lately
    "put_calls",  #: ``ray.put`` calls answered by content
    "by_value",  #: large arguments sent by value by refshare's choice (``reasons`` says why)
    "verified",  #: arguments verify mode checked and found exact
    "unverified",  #: arguments verify mode could not check, sent by value (``reasons``)
    "mismatches",  #: arguments verify mode found would differ, sent by value
    "evictions",  #: cache entries this site's puts made room for
    "would_save_ms",  #: an audit's: the time sharing would save (see :class:`Timing`)
    "sending_ms",  #: an audit's: the time Ray spent sending calls with large arguments
)
(CALLS, SUBMISSIONS, ARGUMENTS, BYTES_SENT, BYTES_REPEATED, BYTES_IN_CALL, BYTES_MEMBERS,
 BYTES_DISTINCT, BYTES_STORED, PUTS, HITS, UNKEYED, PUT_CALLS, BY_VALUE, VERIFIED, UNVERIFIED,
 MISMATCHES, EVICTIONS, WOULD_SAVE_MS, SENDING_MS) = range(len(FIELDS))  # fmt: skip
#: The fields counted in milliseconds, as floats; the others count whole events and bytes.
TIMES = (WOULD_SAVE_MS, SENDING_MS)


@dataclass
class Tab:
    """What one argument did, counted into the ledger once it is sent (see
    :meth:`Ledger.argument`). Bytes repeated and distinct are counted as the stored objects
    found or put weigh (a split value's members, its skeleton), and capped there at the
    argument's own bytes, so that no argument repeats more than it sends."""

    nbytes: int
    hits: int = 0
    repeated: int = 0
    in_call: int = 0
    members: int = 0
    puts: int = 0
    distinct: int = 0
    #: Of the distinct, bytes put in a form of refshare's own (tensors as their bytes), which
    #: costs a copy where by value runs torch's pickling (an audit's :class:`Timing`).
    as_bytes: int = 0
    #: Bytes sent, found or put, in that form: its receiver reads them where by value's
    #: unpickles them through torch.
    tensors: int = 0
    unkeyed: int = 0
    put_call: bool = False
    #: Whether the tensors are counted: an audit's alone (sharing's calls never ask).
    audit: bool = False

    def hit(
        self, count: int, nbytes: int, in_call: int = 0, members: int = 0, stored: Any = None
    ) -> None:
        """``count`` stored objects found, weighing ``nbytes``; ``stored``: what was put for
        them, if one object (an audit counts its tensors)."""
        self.hits += count
        self.repeated += nbytes
        self.in_call += in_call
        self.members += members
        self._tensors(nbytes, stored)

    def put(self, nbytes: int, stored: Any = None) -> None:
        """``stored`` put, weighing ``nbytes``."""
        self.puts += 1
        self._distinct(nbytes, stored)

    def member(self, nbytes: int, stored: Any, found: bool, in_call: bool) -> None:
        """A split value's member: found, or put in a bundle (whose put counts once)."""
        if found:
            self.hit(1, nbytes, nbytes if in_call else 0, nbytes, stored)
        else:
            self._distinct(nbytes, stored)

    def _distinct(self, nbytes: int, stored: Any) -> None:
        self.distinct += nbytes
        if self._tensors(nbytes, stored):
            self.as_bytes += nbytes

    def _tensors(self, nbytes: int, stored: Any) -> bool:
        """An audit's: count ``nbytes`` as tensors if ``stored`` is put as their bytes."""
        if not self.audit or stored is None or not put_as_bytes(stored):
            return False
        self.tensors += nbytes
        return True


class Tally:
    """The running counts of one call site, in one mode (sharing or audit)."""

    __slots__ = ("_counts", "_lock", "_reasons", "audit", "site")

    def __init__(self, site: str, audit: bool) -> None:
        self.site = site
        self.audit = audit
        self._lock = threading.Lock()
        self._counts: list[float] = [0] * len(FIELDS)
        #: (field, reason) -> how many: why values went by value, or were not verified
        self._reasons: Counter[tuple[int, str]] = Counter()

    def add(self, *pairs: tuple[int, float]) -> None:
        """Add each ``(field, amount)``."""
        with self._lock:
            counts = self._counts
            for field, amount in pairs:
                counts[field] += amount
        if _metrics is not None and not self.audit:
            _metrics(pairs)

    def note(self, field: int, reason: str) -> None:
        """Count one event of ``field`` (by value, unverified), and why."""
        with self._lock:
            self._counts[field] += 1
            self._reasons[(field, reason)] += 1
        if _metrics is not None and not self.audit:
            _metrics(((field, 1),))

    def verdict(self, outcome: str, reason: str = "") -> None:
        """Count what verify found of one send: ``verified``, ``mismatch`` or ``unverified``
        (with its reason)."""
        if outcome == "unverified":
            self.note(UNVERIFIED, reason)
        elif outcome in _VERDICTS:
            self.add((_VERDICTS[outcome], 1))

    def counts(self) -> list[float]:
        with self._lock:
            return list(self._counts)

    def reasons(self, field: int) -> tuple[tuple[str, int], ...]:
        """Why events of ``field`` happened, most frequent first."""
        with self._lock:
            found = Counter({why: n for (f, why), n in self._reasons.items() if f == field})
        return tuple(found.most_common())


class _Sending(threading.local):
    """What the call Ray is about to send on this thread carries, for :class:`Timing`: the
    bytes of its large arguments, of those repeated, and of the others those sharing would
    store in a form of its own; and the seconds refshare spent meanwhile on what sharing
    would spend them on too (an audit weighing what it would put)."""

    sent = 0
    repeated = 0
    as_bytes = 0
    tensors = 0
    not_keying = 0.0


_sending = _Sending()


def not_keying(seconds: float) -> None:
    """Count ``seconds`` (this thread's CPU time) an audit spent on what is not sharing's
    keying."""
    _sending.not_keying += seconds


R = TypeVar("R")


class Timing:
    """An audit's clock around one of Ray's calls that send (``.remote()``, ``ray.put``):
    from its start, what refshare spent keying the call's arguments; then Ray's own call,
    serializing and storing them by value. Of Ray's time, the share of the repeated bytes
    among the large arguments' is what sharing would not spend, and so is the share of the
    bytes sharing would store as their bytes (tensors, which by value pickles through torch:
    three copies) but for one copy; less the keying, which sharing would spend, it is what
    the driver would save (see :meth:`Ledger.sent`). Its receiver would save rebuilding
    the tensors through torch's unpickling (:func:`unpickling`): the receivers of one
    scope's calls do so side by side, so the scope counts the slowest one's (see
    :meth:`Ledger.close`).

    The keying is this thread's CPU time: work sharing would do, where a wall clock would
    also count the wait for the interpreter while another thread pickles an argument by
    value, a wait sharing (which puts nothing there) would not have. Ray's call is read off
    :data:`~refshare._clocks.SENDS`, which shares the wall time among the sends of several
    threads at once. A call sent another way (by sharing, or not at all) is never timed."""

    __slots__ = ("ledger", "start")

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        _sending.sent = _sending.repeated = _sending.as_bytes = _sending.tensors = 0
        _sending.not_keying = 0.0
        self.start = time.thread_time()

    def call(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """``fn(*args, **kwargs)``, Ray's own call, timed."""
        keying = time.thread_time() - self.start
        start = SENDS.enter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.ledger.sent(keying, SENDS.leave() - start)


class Ledger:
    """What one scope counts into its site's tally."""

    __slots__ = ("receiving", "tally")

    def __init__(self, site: str, audit: bool) -> None:
        self.tally = tally(site, audit)
        self.tally.add((CALLS, 1))
        #: An audit's: the most one receiver of this scope's calls would save (seconds).
        self.receiving = 0.0

    @property
    def audit(self) -> bool:
        return self.tally.audit

    def tab(self, nbytes: int, put_call: bool = False) -> Tab:
        """What one argument of ``nbytes`` does, to count with :meth:`argument`."""
        return Tab(nbytes, put_call=put_call, audit=self.tally.audit)

    def submission(self) -> None:
        self.tally.add((SUBMISSIONS, 1))

    def argument(self, tab: Tab) -> None:
        """Count one argument sent: its bytes, and what its storing found and put."""
        sent = tab.nbytes
        repeated = min(tab.repeated, sent)
        self.tally.add(
            (ARGUMENTS, 1),
            (BYTES_SENT, sent),
            (BYTES_REPEATED, repeated),
            (BYTES_IN_CALL, min(tab.in_call, repeated)),
            (BYTES_MEMBERS, min(tab.members, repeated)),
            (BYTES_DISTINCT, min(tab.distinct, sent - repeated)),
            (BYTES_STORED, tab.distinct),
            (PUTS, tab.puts),
            (HITS, tab.hits),
            (UNKEYED, tab.unkeyed),
            (PUT_CALLS, int(tab.put_call)),
        )
        if self.tally.audit:
            _sending.sent += sent
            _sending.repeated += repeated
            _sending.as_bytes += min(tab.as_bytes, sent - repeated)
            _sending.tensors += min(tab.tensors, sent)

    def timing(self) -> Timing | None:
        """A clock for the call about to be sent (auditing only: see :class:`Timing`)."""
        return Timing(self) if self.tally.audit else None

    def sent(self, keying: float, sending: float) -> None:
        """Count a call Ray sent in ``sending`` seconds, after ``keying`` seconds of the
        audit's: Ray's time shared among the large arguments by their bytes, the repeated
        ones' share saved, the share of those sharing stores as their bytes saved but for
        a copy, the keying spent. A call without large arguments is left out."""
        found = _sending
        if found.sent:
            keying -= found.not_keying
            share = sending * (found.repeated + found.as_bytes) / found.sent
            saved = share - copying(found.as_bytes) - keying
            self.tally.add((WOULD_SAVE_MS, saved * 1e3), (SENDING_MS, sending * 1e3))
            self.receiving = max(self.receiving, unpickling(found.tensors))
        found.sent = found.repeated = found.as_bytes = found.tensors = 0
        found.not_keying = 0.0

    def close(self) -> None:
        """The scope has ended: an audit counts what its slowest receiver would save."""
        if self.receiving:
            self.tally.add((WOULD_SAVE_MS, self.receiving * 1e3))
            self.receiving = 0.0

    def by_value(self, reason: str) -> None:
        self.tally.note(BY_VALUE, reason)

    def verdict(self, outcome: str, reason: str = "") -> None:
        self.tally.verdict(outcome, reason)


#: verify's outcomes, counted alone (``unverified`` is counted with its reason).
_VERDICTS = {"verified": VERIFIED, "mismatch": MISMATCHES}

_tallies: dict[tuple[str, bool], Tally] = {}
_tallies_lock = threading.Lock()
#: Counts of tallies forgotten by ``reset()``, so that sums read over the tallies go on.
_retired: list[float] = [0] * len(FIELDS)
#: Called with each batch of ``(field, amount)`` counted while sharing (see ``_stats``).
_metrics: Callable[[tuple[tuple[int, float], ...]], None] | None = None
#: Called when the first tally is made (see ``_report``: the report written at exit).
on_first_tally: list[Callable[[], None]] = []
#: Called when a decorated call or ``sharing`` block ends (see ``_job``: a Ray worker's
#: process writes its report then, as Ray may end it before the writer looks again).
on_call_end: list[Callable[[], None]] = []
#: Called before the tallies are read, to count what is on its way (the verdicts of
#: ``verify="worker"``, reported by the workers: see ``_verify``).
before_read: list[Callable[[], None]] = []

#: Where evictions outside any scope are counted (a cache used directly).
OUTSIDE = "(outside any scope)"


def tally(site: str, audit: bool) -> Tally:
    """The tally of ``site`` in that mode, made on first use."""
    found = _tallies.get((site, audit))
    if found is None:
        with _tallies_lock:
            first = not _tallies
            found = _tallies.setdefault((site, audit), Tally(site, audit))
        if first:
            for hook in on_first_tally:
                hook()
    return found


def tallies() -> list[Tally]:
    """Every tally, in the order the sites were first used (what is on its way counted
    first: see :data:`before_read`)."""
    for hook in list(before_read):
        hook()
    with _tallies_lock:
        return list(_tallies.values())


def sharing_totals() -> list[float]:
    """Every field summed over the tallies of sharing (audits left out), those forgotten
    by :func:`reset` included: what ``stats()`` reads."""
    totals = list(_retired)
    for found in tallies():
        if not found.audit:
            totals = [a + b for a, b in zip(totals, found.counts(), strict=True)]
    return totals


def reset() -> None:
    """Forget every call site (their counts still add up in :func:`sharing_totals`)."""
    with _tallies_lock:
        for found in _tallies.values():
            if not found.audit:
                _retired[:] = [a + b for a, b in zip(_retired, found.counts(), strict=True)]
        _tallies.clear()


def count_eviction() -> None:
    """Count an eviction against the call site whose scope is current in this context: the
    one whose put made room (a cache evicts only to make room, on the putting thread)."""
    ledger: Any = getattr(current_scope(), "ledger", None)
    found = ledger.tally if isinstance(ledger, Ledger) else tally(OUTSIDE, False)
    found.add((EVICTIONS, 1))


def set_metrics(export: Callable[[tuple[tuple[int, float], ...]], None] | None) -> None:
    """Also hand what sharing counts to ``export`` (Ray metrics), or stop (``None``)."""
    global _metrics
    _metrics = export
