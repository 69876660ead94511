"""Process-wide counts of what refshare shared: the ledger summed, read as a snapshot."""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

from . import _ledger


class Stats(NamedTuple):
    """What refshare did in this process since it started (or since :func:`reset_stats`),
    summed over every call site that shared (audits are left out).

    ``puts`` and ``bytes_put`` count values refshare stored with ``ray.put``; ``hits`` and
    ``bytes_saved`` count arguments that travelled as an existing ref instead of being
    serialized again; ``evictions`` counts refs dropped to stay within a cache's budget;
    ``by_value`` counts large arguments refshare could not fingerprint or put, which went
    to Ray unchanged; ``put_calls`` counts ``ray.put`` calls made inside a scope that
    refshare answered by content (each also counts as a put or a hit); ``unkeyed`` counts
    the puts of values refshare did not key, being of a kind that has not repeated lately;
    in verify mode, ``mismatches`` counts arguments found not to reach the worker as by
    value, ``unverified`` those verify could not check (both sent by value instead), and
    ``verified`` those checked and found exact.
    """

    puts: int = 0
    hits: int = 0
    bytes_put: int = 0
    bytes_saved: int = 0
    evictions: int = 0
    by_value: int = 0
    put_calls: int = 0
    unkeyed: int = 0
    mismatches: int = 0
    unverified: int = 0
    verified: int = 0


#: The ledger's field behind each of :class:`Stats`'s.
_SOURCES = (
    _ledger.PUTS,
    _ledger.HITS,
    _ledger.BYTES_STORED,
    _ledger.BYTES_REPEATED,
    _ledger.EVICTIONS,
    _ledger.BY_VALUE,
    _ledger.PUT_CALLS,
    _ledger.UNKEYED,
    _ledger.MISMATCHES,
    _ledger.UNVERIFIED,
    _ledger.VERIFIED,
)
_lock = threading.Lock()
#: What the ledger's sums were at the last :func:`reset_stats`.
_baseline: list[float] = [0] * len(_ledger.FIELDS)


def stats() -> Stats:
    """Return a snapshot of refshare's counts for this process."""
    totals = _ledger.sharing_totals()
    with _lock:
        return Stats(*(int(totals[i] - _baseline[i]) for i in _SOURCES))


def reset_stats() -> None:
    """Set every count back to zero (``report()`` keeps its own)."""
    totals = _ledger.sharing_totals()
    with _lock:
        _baseline[:] = totals


_DESCRIPTIONS = {
    "puts": "Values refshare stored with ray.put",
    "hits": "Arguments sent as an existing ref instead of being serialized again",
    "bytes_put": "Bytes refshare stored with ray.put",
    "bytes_saved": "Bytes not serialized again thanks to a hit",
    "evictions": "Refs dropped to keep a cache within its budget",
    "by_value": "Large arguments refshare could not share, sent by value",
    "put_calls": "ray.put calls inside a scope answered by content",
    "unkeyed": "Values put without keying: of a kind that has not repeated lately",
    "mismatches": "Arguments verify mode found would differ from by value, sent by value",
    "unverified": "Arguments verify mode could not check, sent by value",
    "verified": "Arguments verify mode checked and found exact",
}


def enable_metrics(enabled: bool = True) -> None:
    """Also export refshare's counts as Ray metrics (``ray.util.metrics.Counter``).

    They appear on Ray's metrics endpoint and dashboard as ``refshare_puts``,
    ``refshare_hits``, ``refshare_bytes_put``, ``refshare_bytes_saved``,
    ``refshare_evictions``, ``refshare_by_value``, ``refshare_put_calls``,
    ``refshare_unkeyed``, ``refshare_mismatches``, ``refshare_unverified`` and
    ``refshare_verified``, counted from the moment they are on.
    """
    if not enabled:
        _ledger.set_metrics(None)
        return
    from ray.util.metrics import Counter

    counters: dict[int, Any] = {
        source: Counter(f"refshare_{field}", description=_DESCRIPTIONS[field])
        for field, source in zip(Stats._fields, _SOURCES, strict=True)
    }

    def export(pairs: tuple[tuple[int, float], ...]) -> None:
        for field, amount in pairs:
            counter = counters.get(field)
            if counter is not None and amount > 0:
                counter.inc(amount)

    _ledger.set_metrics(export)
