"""Per call site: what refshare saved, or in audit mode would save, and what went by value.

``report()`` reads the ledger (``refshare._ledger``) as an immutable :class:`Report`, one
row per call site and mode. ``REFSHARE_REPORT=1`` writes that report to standard error when
the process exits, in every process that shared or audited (an actor's goes to its log).
"""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Iterable
from typing import Any, NamedTuple

from . import _env, _ledger


class Row(NamedTuple):
    """One call site's counts. In audit mode, what sharing *would* have done: nothing was
    put, every argument went by value. Bytes repeated and distinct are counted in the
    arguments' bytes, so that neither passes ``bytes_sent``."""

    site: str
    audit: bool  #: counted in audit mode (else: sharing)
    calls: int  #: scopes opened: calls of the function, ``sharing()`` blocks entered
    submissions: int  #: ``.remote()`` calls made inside them
    arguments: int  #: large arguments, ``ray.put`` and ``share()`` values seen
    bytes_sent: int  #: their bytes: what Ray serializes and stores of them by value
    bytes_repeated: int  #: of those, bytes sent before: saved (or, auditing, to save)
    bytes_repeated_in_call: int  #: of the repeated, found within the same call
    bytes_repeated_members: int  #: of the repeated, members of split values (deep sharing)
    bytes_distinct: int  #: of those, bytes stored once each (put, or auditing, to be put)
    bytes_stored: int  #: what was put weighs as stored (a pickle's overhead included)
    puts: int
    hits: int
    unkeyed: int  #: put without keying: of a kind that has not repeated lately
    put_calls: int  #: ``ray.put`` calls answered by content
    by_value: int  #: large arguments sent by value by refshare's choice, ``reasons`` says why
    verified: int  #: verify mode's: checked, and found exact
    unverified: int  #: verify mode's: could not be checked, sent by value
    mismatches: int  #: verify mode's: would differ from by value, sent by value
    evictions: int  #: cache entries its puts made room for (auditing: would have)
    #: Auditing, the milliseconds sharing would save: what Ray spent sending the repeated
    #: bytes by value, less what keying them took (``None`` while sharing).
    would_save_ms: float | None
    #: Auditing, the milliseconds Ray spent in the calls that sent large arguments.
    sending_ms: float | None
    reasons: tuple[tuple[str, int], ...]  #: why values went by value, most frequent first
    unverified_reasons: tuple[tuple[str, int], ...]  #: why verify could not check

    @property
    def saved(self) -> float:
        """The share of the large arguments' bytes not sent again (at most 1)."""
        return self.bytes_repeated / self.bytes_sent if self.bytes_sent else 0.0


def _row(tally: _ledger.Tally) -> Row:
    reasons = tally.reasons(_ledger.BY_VALUE)
    unverified = tally.reasons(_ledger.UNVERIFIED)
    counts: list[float | None] = list(tally.counts())
    if not tally.audit:  # timed only by an audit
        counts[_ledger.WOULD_SAVE_MS] = counts[_ledger.SENDING_MS] = None
    return Row._make((tally.site, tally.audit, *counts, reasons, unverified))


class Report(NamedTuple):
    """What each call site of this process did, since it started or :func:`reset_report`."""

    rows: tuple[Row, ...]

    def to_dict(self) -> dict[str, Any]:
        """The numbers, by site, to log or plot (``saved`` included); a site's audit row
        under ``"SITE (audit)"``, beside its sharing row."""
        return {
            f"{row.site} (audit)" if row.audit else row.site: {**row._asdict(), "saved": row.saved}
            for row in self.rows
        }

    def bytes_repeated(self, *, audit: bool = False) -> int:
        """The bytes not sent again, over every call site sharing (``audit``: that an audit
        says sharing would not send again): an audit's and a run's to compare."""
        return sum(row.bytes_repeated for row in self.rows if row.audit == audit)

    def __str__(self) -> str:
        if not self.rows:
            return "refshare: no call site shared or audited anything"
        verify = any(r.verified or r.unverified or r.mismatches for r in self.rows)
        audit = any(r.audit for r in self.rows)
        head = ["call site", "mode", "calls", "sent", "repeated", "saved", "distinct",
                "by value", "evicted"]  # fmt: skip
        if verify:
            head += ["verified", "unverified", "mismatches"]
        if audit:
            head += ["would save"]
        lines = []
        for r in self.rows:
            line = [r.site, "audit" if r.audit else "sharing", str(r.calls), _mib(r.bytes_sent),
                    _mib(r.bytes_repeated), f"{r.saved:.0%}", _mib(r.bytes_distinct),
                    str(r.by_value), str(r.evictions)]  # fmt: skip
            if verify:
                line += [str(r.verified), str(r.unverified), str(r.mismatches)]
            if audit:
                line += [_time(r.would_save_ms, r.sending_ms)]
            lines.append(line)
        out = [format_table(head, lines)]
        notes = [
            f"  {r.site}: {count} {what}: {reason}"
            for r in self.rows
            for what, reasons in (("by value", r.reasons), ("unverified", r.unverified_reasons))
            for reason, count in reasons
        ]
        tail = [f"  {r.site}: {_in_time(r)}" for r in self.rows if r.audit and r.sending_ms]
        if audit:
            tail.append("(audit: what sharing would save; nothing was changed)")
        return "\n".join(out + notes + tail)


def format_table(
    head: list[str], body: list[list[str]], foot: Iterable[list[str]] = (), left: int = 1
) -> str:
    """Columns padded to their widest cell, the first ``left`` left-aligned and the others
    right-aligned, a rule under the head (and above the totals ``foot``, if any)."""
    foot = list(foot)
    widths = [max(len(line[i]) for line in [head, *body, *foot]) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        padded = [c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in
                  enumerate(zip(cells, widths, strict=True))]  # fmt: skip
        return "  ".join(padded).rstrip()

    rule = "  ".join("-" * w for w in widths)
    tail = [rule, *map(line, foot)] if foot else []
    return "\n".join([line(head), rule, *map(line, body), *tail])


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


def _time(would: float | None, sending: float | None) -> str:
    """``~N ms (M%)``: the time an audit says sharing would save, and its share of the time
    spent sending arguments (``-`` where it was not timed)."""
    if would is None or not sending:
        return "-"
    return f"~{would:.0f} ms ({would / sending:.0%})"


def _in_time(row: Row) -> str:
    """An audited site's time estimate, in words, per call and in all."""
    would, sending = row.would_save_ms or 0.0, row.sending_ms or 0.0
    each = would / max(row.calls, 1)
    verb = "would save" if would >= 0 else "would cost"
    return (
        f"sharing {verb} about {abs(each):.1f} ms a call ({abs(would) / sending:.0%} of the "
        f"{sending / max(row.calls, 1):.1f} ms Ray spent sending its arguments by value; "
        f"{abs(would):.0f} ms in all)"
    )


def report() -> Report:
    """What each call site did in this process: one row per site (and mode), in the order
    they were first used. In audit mode, what sharing would have saved."""
    return Report(tuple(_row(found) for found in _ledger.tallies()))


def reset_report() -> None:
    """Forget every call site's counts (``stats()`` keeps its own)."""
    _ledger.reset()


_exit_registered = False


def _register_exit_report() -> None:
    global _exit_registered
    if not _exit_registered and _env.on(_env.REPORT):
        _exit_registered = True
        atexit.register(write_report)


_ledger.on_first_tally.append(_register_exit_report)


def write_report() -> None:
    """Write :func:`report` to standard error, headed by this process's id."""
    found = report()
    if found.rows:
        sys.stderr.write(f"refshare report (pid {os.getpid()}):\n{found}\n")
        sys.stderr.flush()
