"""Per call site: what refshare saved, or in audit mode would save, and what went by value.

A call site is what opened the scope: the decorated function, the ``Class.method``
``enable`` or ``patch_methods`` wrapped, or a ``sharing()`` block (by file and line). Each
scope counts into its site's :class:`Tally` as it goes (a few additions under one lock per
large argument, as ``stats()`` costs); :func:`report` reads them all as an immutable
:class:`Report`. ``REFSHARE_REPORT=1`` writes that report to standard error when the
process exits, in every process that shared or audited (an actor's goes to its log).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple

from ._context import current_scope

AUDIT_ENV = "REFSHARE_AUDIT"
REPORT_ENV = "REFSHARE_REPORT"
_TRUE = ("1", "true", "yes", "on")


def audit_by_env() -> bool:
    """Whether ``REFSHARE_AUDIT`` turns audit mode on for every scope of this process."""
    return os.environ.get(AUDIT_ENV, "").strip().lower() in _TRUE


class Row(NamedTuple):
    """One call site's counts. In audit mode, what sharing *would* have done: nothing was
    put, every argument went by value."""

    site: str
    audit: bool  #: counted in audit mode (else: sharing)
    calls: int  #: scopes opened: calls of the function, ``sharing()`` blocks entered
    submissions: int  #: ``.remote()`` calls made inside them
    arguments: int  #: large arguments and ``ray.put`` values seen
    bytes_sent: int  #: their bytes: what Ray serializes and stores of them by value
    bytes_repeated: int  #: of those, bytes sent before: saved (or, auditing, to save)
    bytes_repeated_in_call: int  #: of the repeated, found within the same call
    bytes_repeated_members: int  #: of the repeated, members of split values (deep sharing)
    bytes_distinct: int  #: bytes stored once each (put, or auditing, to be put)
    puts: int
    hits: int
    unkeyed: int  #: put without keying: of a kind that has not repeated lately
    by_value: int  #: large arguments sent by value by refshare's choice, ``reasons`` says why
    mismatches: int  #: verify mode's
    evictions: int  #: cache entries its puts made room for (auditing: would have)
    verified: int  #: verify mode's: sends found to reach the worker as by value
    unverified: int  #: verify mode's: sends it could not compare (sent by value)
    reasons: tuple[tuple[str, int], ...]  #: why values went by value, most frequent first
    unverified_reasons: tuple[tuple[str, int], ...]  #: why sends were unverified

    @property
    def saved(self) -> float:
        """The share of the large arguments' bytes not sent again."""
        return self.bytes_repeated / self.bytes_sent if self.bytes_sent else 0.0


class Report(NamedTuple):
    """What each call site of this process did, since it started or :func:`reset_report`."""

    rows: tuple[Row, ...]

    def to_dict(self) -> dict[str, Any]:
        """The numbers, by site, to log or plot (``saved`` included)."""
        return {row.site: {**row._asdict(), "saved": row.saved} for row in self.rows}

    def bytes_repeated(self, *, audit: bool = False) -> int:
        """The bytes not sent again, over every call site sharing (``audit``: that an audit
        says sharing would not send again): an audit's and a run's to compare."""
        return sum(row.bytes_repeated for row in self.rows if row.audit == audit)

    def __str__(self) -> str:
        if not self.rows:
            return "refshare: no call site shared or audited anything"
        head = ("call site", "mode", "calls", "sent", "repeated", "saved", "distinct",
                "by value", "evicted")  # fmt: skip
        lines = [head]
        for r in self.rows:
            lines.append(
                (r.site, "audit" if r.audit else "sharing", str(r.calls), _mib(r.bytes_sent),
                 _mib(r.bytes_repeated), f"{r.saved:.0%}", _mib(r.bytes_distinct),
                 str(r.by_value), str(r.evictions))
            )  # fmt: skip
        widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
        out = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                         enumerate(zip(line, widths, strict=True)))
               for line in lines]  # fmt: skip
        out.insert(1, "  ".join("-" * w for w in widths))
        notes = [
            f"  {r.site}: {count} by value: {reason}"
            for r in self.rows
            for reason, count in r.reasons
        ]
        notes += [
            f"  {r.site}: verify: {r.verified} verified, {r.mismatches} mismatches, "
            f"{r.unverified} unverified"
            + "".join(f"; {n}: {why}" for why, n in r.unverified_reasons)
            for r in self.rows
            if r.verified or r.mismatches or r.unverified
        ]
        audit = any(r.audit for r in self.rows)
        tail = ["(audit: what sharing would save; nothing was changed)"] if audit else []
        return "\n".join(out + notes + tail)


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


class Tally:
    """The running counts of one call site."""

    __slots__ = ("_counts", "_lock", "_reasons", "_unverified", "audit", "site")

    def __init__(self, site: str, audit: bool) -> None:
        self.site = site
        self.audit = audit
        self._lock = threading.Lock()
        self._counts = [0] * _COUNTED
        self._reasons: Counter[str] = Counter()
        self._unverified: Counter[str] = Counter()

    def add(self, *pairs: tuple[int, int]) -> None:
        """Add each ``(field, amount)`` (fields are the indices below)."""
        with self._lock:
            counts = self._counts
            for field, amount in pairs:
                counts[field] += amount

    def by_value(self, reason: str) -> None:
        with self._lock:
            self._counts[BY_VALUE] += 1
            self._reasons[reason] += 1

    def unverified(self, reason: str) -> None:
        with self._lock:
            self._counts[UNVERIFIED] += 1
            self._unverified[reason] += 1

    def row(self) -> Row:
        with self._lock:
            reasons = tuple(self._reasons.most_common())
            unverified = tuple(self._unverified.most_common())
            return Row._make((self.site, self.audit, *self._counts, reasons, unverified))


#: The fields a Tally counts, in Row's order (between ``audit`` and ``reasons``).
(CALLS, SUBMISSIONS, ARGUMENTS, BYTES_SENT, BYTES_REPEATED, BYTES_IN_CALL, BYTES_MEMBERS,
 BYTES_DISTINCT, PUTS, HITS, UNKEYED, BY_VALUE, MISMATCHES, EVICTIONS, VERIFIED,
 UNVERIFIED) = range(16)  # fmt: skip
_COUNTED = 16

_tallies: dict[tuple[str, bool], Tally] = {}
#: Run before the tallies are read: verify's workers' reports, counted (see _verify).
before_read: list[Callable[[], None]] = []
_tallies_lock = threading.Lock()


def tally(site: str, audit: bool) -> Tally:
    """The tally of ``site`` in that mode, made on first use."""
    found = _tallies.get((site, audit))
    if found is None:
        with _tallies_lock:
            found = _tallies.setdefault((site, audit), Tally(site, audit))
            _register_exit_report()
    return found


def count_eviction() -> None:
    """Count an eviction against the call site whose scope is current in this context:
    the one whose put made room (a cache evicts only to make room, on the putting thread)."""
    found = getattr(current_scope(), "tally", None)
    if isinstance(found, Tally):
        found.add((EVICTIONS, 1))


def report() -> Report:
    """What each call site did in this process: one row per site (and mode), in the order
    they were first used. In audit mode, what sharing would have saved."""
    for collect in before_read:
        collect()
    with _tallies_lock:
        tallies = list(_tallies.values())
    return Report(tuple(t.row() for t in tallies))


def reset_report() -> None:
    """Forget every call site's counts."""
    with _tallies_lock:
        _tallies.clear()


_exit_registered = False


def _register_exit_report() -> None:
    global _exit_registered
    if not _exit_registered and os.environ.get(REPORT_ENV, "").strip().lower() in _TRUE:
        _exit_registered = True
        atexit.register(write_report)


def write_report() -> None:
    """Write :func:`report` to standard error, headed by this process's id."""
    found = report()
    if found.rows:
        sys.stderr.write(f"refshare report (pid {os.getpid()}):\n{found}\n")
        sys.stderr.flush()
