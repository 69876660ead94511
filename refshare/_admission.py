"""Which values are worth keying: a cache's admission of the kinds of values that repeat.

Keying a value costs a hash of its bytes and a pass over its structure, which a value sent
once never pays back, and a worker-group method that sends a new batch on every call sends
nothing else. So a cache counts, per kind of value (its type and its size, to within an
eighth), how many values in a row found nothing cached. After ``COLD_AFTER`` such misses it
stops keying that kind: each value of it is put as it is, once per submission, the way a
hand-written ``ray.put`` would, and is not cached. Every ``PROBE_EVERY``-th value of a cold
kind is still keyed and cached, and the first of those to find its content cached makes the
kind keyed again; so does any hit.

This decides only how much work refshare does, never what a worker receives: a value that
is not keyed is put fresh.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

#: Values of one kind that find nothing cached, in a row, before the kind is not keyed.
COLD_AFTER = 16
#: While a kind is not keyed, every this-many-th value of it is keyed anyway.
PROBE_EVERY = 8
#: Kinds remembered at most (the least recently seen are forgotten: keyed again).
MAX_KINDS = 4096

#: A value's type and its size, to within an eighth (see :func:`kind`).
Kind = tuple[type, int, int]


def kind(value: object, nbytes: int) -> Kind:
    """The kind of ``value``: its type and its size rounded down to its top four bits, so
    that batches whose sizes differ by a few bytes (uids of another length) are one kind."""
    bits = nbytes.bit_length()
    return type(value), bits, nbytes >> max(bits - 4, 0)


class Admission:
    """Per kind of value: misses in a row, and how many values went by since it turned cold
    (put without keying, or keyed as a probe)."""

    __slots__ = ("_kinds", "_lock")

    def __init__(self) -> None:
        self._kinds: OrderedDict[Kind, list[int]] = OrderedDict()
        self._lock = threading.Lock()

    def keyed(self, kind: Kind) -> bool:
        """Whether to key the next value of ``kind`` (asking changes nothing)."""
        with self._lock:
            counts = self._kinds.get(kind)
            return counts is None or counts[0] < COLD_AFTER or (counts[1] + 1) % PROBE_EVERY == 0

    def passed(self, kind: Kind) -> None:
        """Count a value of a cold ``kind`` put without being keyed."""
        with self._lock:
            counts = self._kinds.get(kind)
            if counts is not None:
                counts[1] += 1

    def record(self, kind: Kind, hit: bool) -> None:
        """Count a keyed value of ``kind`` that found its content cached, or did not."""
        with self._lock:
            if hit:
                self._kinds.pop(kind, None)
                return
            counts = self._kinds.get(kind)
            if counts is None:
                if len(self._kinds) >= MAX_KINDS:
                    self._kinds.popitem(last=False)
                counts = self._kinds[kind] = [0, 0]
            else:
                self._kinds.move_to_end(kind)
            if counts[0] >= COLD_AFTER:
                counts[1] += 1  # a probe: the next one is PROBE_EVERY values on
            counts[0] += 1

    def cold(self) -> list[Kind]:
        """The kinds not keyed now."""
        with self._lock:
            return [kind for kind, counts in self._kinds.items() if counts[0] >= COLD_AFTER]

    def clear(self) -> None:
        with self._lock:
            self._kinds.clear()


#: Members remembered at most, by key (the least recently sent are forgotten).
MAX_MEMBERS = 1 << 16


class Splitting:
    """Which kinds of values have large members that are sent again, in a later argument:
    a batch that grows between calls, or goes to several groups. Such a kind is split into
    members by default; any other is stored whole, in one put."""

    __slots__ = ("_lock", "_repeating", "_seen")

    def __init__(self) -> None:
        #: member key -> the kind of the value it was sent in
        self._seen: OrderedDict[bytes, Kind] = OrderedDict()
        self._repeating: OrderedDict[Kind, None] = OrderedDict()
        self._lock = threading.Lock()

    def repeats(self, kind: Kind) -> bool:
        """Whether values of ``kind`` have had members sent again."""
        return kind in self._repeating

    def seen(self, key: bytes) -> bool:
        """Whether a member with content ``key`` was sent before."""
        return key in self._seen

    def remember(self, keys: list[bytes], kind: Kind) -> None:
        """Members with content ``keys`` were sent, in a value of ``kind``."""
        with self._lock:
            for key in keys:
                self._seen[key] = kind
                self._seen.move_to_end(key)
            while len(self._seen) > MAX_MEMBERS:
                self._seen.popitem(last=False)

    def found_again(self, keys: list[bytes]) -> None:
        """Members with content ``keys`` are sent again: the kinds they were sent in repeat."""
        with self._lock:
            for key in keys:
                kind = self._seen.get(key)
                if kind is not None:
                    self._repeating[kind] = None
                    self._repeating.move_to_end(kind)
            while len(self._repeating) > MAX_KINDS:
                self._repeating.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._seen.clear()
            self._repeating.clear()
