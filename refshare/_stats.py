"""Process-wide counters of what refshare shared, read as an immutable snapshot."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NamedTuple


class Stats(NamedTuple):
    """What refshare did in this process since it started (or since :func:`reset_stats`).

    ``puts`` and ``bytes_put`` count values refshare stored with ``ray.put``; ``hits`` and
    ``bytes_saved`` count arguments that travelled as an existing ref instead of being
    serialized again; ``evictions`` counts refs dropped to stay within a cache's budget;
    ``by_value`` counts large arguments refshare could not fingerprint or put, which went
    to Ray unchanged; ``put_calls`` counts ``ray.put`` calls made inside a scope that
    refshare answered by content (each also counts as a put or a hit); ``unkeyed`` counts
    the puts of values refshare did not key, being of a kind that has not repeated lately;
    ``mismatches`` counts arguments that verify mode found would not reach the worker as
    by value, and sent by value instead; ``verified`` those it found would, ``unverified``
    those it could not compare (sent by value too; ``report()`` says why).
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
    verified: int = 0
    unverified: int = 0


_lock = threading.Lock()
_counts = [0] * len(Stats._fields)
(_PUTS, _HITS, _BYTES_PUT, _BYTES_SAVED, _EVICTIONS, _BY_VALUE, _PUT_CALLS, _UNKEYED,
 _MISMATCHES, _VERIFIED, _UNVERIFIED) = range(len(Stats._fields))  # fmt: skip
#: Run before the counts are read: verify's workers' reports, counted (see _verify).
before_read: list[Callable[[], None]] = []


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
    "verified": "Arguments verify mode found reach the worker as by value",
    "unverified": "Arguments verify mode could not compare, sent by value",
}

#: Ray metric counters, one per field, once :func:`enable_metrics` was called.
_metrics: list[Any] | None = None


def enable_metrics(enabled: bool = True) -> None:
    """Also export refshare's counters as Ray metrics (``ray.util.metrics.Counter``).

    They appear on Ray's metrics endpoint and dashboard as ``refshare_puts``,
    ``refshare_hits``, ``refshare_bytes_put``, ``refshare_bytes_saved``,
    ``refshare_evictions``, ``refshare_by_value``, ``refshare_put_calls``,
    ``refshare_unkeyed``, ``refshare_mismatches``, ``refshare_verified`` and
    ``refshare_unverified``, counted from the moment they are on.
    """
    global _metrics
    if not enabled:
        _metrics = None
        return
    from ray.util.metrics import Counter

    _metrics = [
        Counter(f"refshare_{field}", description=_DESCRIPTIONS[field]) for field in Stats._fields
    ]


def _add(index: int, nbytes_index: int | None = None, nbytes: int = 0, count: int = 1) -> None:
    with _lock:
        _counts[index] += count
        if nbytes_index is not None:
            _counts[nbytes_index] += nbytes
    metrics = _metrics
    if metrics is not None:
        metrics[index].inc(count)
        if nbytes_index is not None and nbytes > 0:
            metrics[nbytes_index].inc(nbytes)


def record_put(nbytes: int) -> None:
    _add(_PUTS, _BYTES_PUT, nbytes)


def record_hits(count: int, nbytes: int) -> None:
    """``count`` hits of ``nbytes`` in all (a split argument's members)."""
    if count:
        _add(_HITS, _BYTES_SAVED, nbytes, count)


def record_eviction() -> None:
    _add(_EVICTIONS)


def record_by_value() -> None:
    _add(_BY_VALUE)


def record_put_call() -> None:
    _add(_PUT_CALLS)


def record_unkeyed() -> None:
    _add(_UNKEYED)


def record_mismatch() -> None:
    _add(_MISMATCHES)


def record_verified() -> None:
    _add(_VERIFIED)


def record_unverified() -> None:
    _add(_UNVERIFIED)


def stats() -> Stats:
    """Return a snapshot of refshare's counters for this process."""
    for collect in before_read:
        collect()
    with _lock:
        return Stats(*_counts)


def reset_stats() -> None:
    """Set every counter back to zero."""
    with _lock:
        _counts[:] = [0] * len(_counts)
