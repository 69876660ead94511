"""How far apart a cache's hits come: what a cache keeps follows the working set it sees.

A cache that keeps each entry until its budget is full holds, in a training loop that sends
a new rollout every step, a quarter of the object store of chunks never sent again. So a
cache measures reuse distances: the bytes stored through it between two uses of an entry.

Each entry that has been used again is kept for as long as its own longest reuse distance,
with a margin: the weights sent once a step stay from step to step, while a rollout's chunk,
sent again by the next calls of its step and then never, goes soon after the step's last
call (a horizon common to all entries would keep every chunk for as long as the weights are
kept: a step and a half of them). An entry not used again since it was stored is kept for as
long as the longest first reuse seen lately (the distance from an entry's store to its
first use again), with the same margin; a distance counts as seen lately until the cache has
stored three times as much since (a pattern that repeats shows it again by then). Until a
first reuse is seen, nothing is evicted for its age: the budget alone bounds the cache.

An evicted entry sent again is remembered (its key, a ghost), so that its miss still teaches
the distance it would have needed: from then on it is kept that long, and if it had never
been used again, entries not used again are kept that long too.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Hashable, Iterable

#: An entry is kept for its longest reuse distance (or the longest first reuse seen lately)
#: times this, plus :data:`SLACK`.
MARGIN = 1.5
#: Bytes added to every horizon, so that what is weighed a few bytes apart (an audit's
#: estimate of what the store holds, and the store's own count) is evicted alike.
SLACK = 64 << 10
#: A distance seen at some point stops counting once this many times it has been stored since.
MEMORY = 3
#: Evicted keys remembered at most (the oldest are forgotten).
MAX_GHOSTS = 4096


def _kept_for(distance: float) -> float:
    return distance * MARGIN + SLACK


class Reuse:
    """The reuse distances of one cache's entries (not thread-safe: the cache's lock)."""

    __slots__ = ("_clock", "_expiries", "_fresh", "_ghosts", "_last", "_order", "_own", "_seen")

    def __init__(self) -> None:
        self._clock = 0  #: bytes stored through the cache so far
        self._last: dict[Hashable, int] = {}  #: key -> the clock when it was last used
        #: key -> its longest reuse distance, for the keys used again since they were stored
        self._own: dict[Hashable, int] = {}
        #: The keys not used again since they were stored, the oldest first.
        self._fresh: OrderedDict[Hashable, None] = OrderedDict()
        #: (when it expires, order, key) of the keys used again; an item is out of date once
        #: its key was used since (see :meth:`expired`).
        self._expiries: list[tuple[float, int, Hashable]] = []
        self._order = itertools.count()
        #: Evicted key -> its last use and its longest reuse distance (-1: never used again).
        self._ghosts: OrderedDict[Hashable, tuple[int, int]] = OrderedDict()
        #: First reuses seen lately as (distance, clock when seen), the distances decreasing:
        #: each one seen later than the ones before it, and shorter, else it would have
        #: replaced them.
        self._seen: list[tuple[int, int]] = []

    @property
    def clock(self) -> int:
        """The bytes stored through the cache so far."""
        return self._clock

    def stored(self, keys: Iterable[Hashable], nbytes: int) -> None:
        """``keys`` were stored, in objects weighing ``nbytes`` in all."""
        keys = list(keys)
        for key in keys:
            ghost = self._ghosts.pop(key, None)
            if ghost is not None:  # evicted too early: the horizon it would have needed
                last, own = ghost
                distance = self._clock - last
                if own < 0:
                    self._see(distance)
                self._own[key] = max(own, distance)
        self._clock += nbytes
        for key in keys:
            self._last[key] = self._clock
            if key in self._own:
                self._expires(key)
            else:
                self._fresh[key] = None
                self._fresh.move_to_end(key)

    def used(self, key: Hashable) -> None:
        """``key`` was found (a hit)."""
        last = self._last.get(key)
        if last is None:
            return
        distance = self._clock - last
        own = self._own.get(key)
        if own is None:  # its first reuse
            self._fresh.pop(key, None)
            self._see(distance)
        self._own[key] = distance if own is None else max(own, distance)
        self._last[key] = self._clock
        self._expires(key)

    def _expires(self, key: Hashable) -> None:
        """Note when ``key``, just used, goes past its own horizon."""
        when = self._last[key] + _kept_for(self._own[key])
        heapq.heappush(self._expiries, (when, next(self._order), key))

    def evicted(self, key: Hashable) -> None:
        last = self._last.pop(key, None)
        own = self._own.pop(key, -1)
        self._fresh.pop(key, None)
        if last is not None:
            self._ghosts[key] = (last, own)
            if len(self._ghosts) > MAX_GHOSTS:
                self._ghosts.popitem(last=False)

    def expired(self) -> list[Hashable]:
        """The keys gone unused past their horizon since the last call, each given once
        (the cache evicts them, or keeps them for another key of their object)."""
        found = []
        horizon = self.horizon()
        fresh, last = self._fresh, self._last
        while horizon is not None and fresh:
            key = next(iter(fresh))
            if self._clock - last[key] <= horizon:
                break
            del fresh[key]
            found.append(key)
        expiries = self._expiries
        while expiries and expiries[0][0] < self._clock:
            when, _, key = heapq.heappop(expiries)
            own = self._own.get(key)
            if own is not None and last[key] + _kept_for(own) == when:  # else used since
                found.append(key)
        return found

    def within(self, key: Hashable) -> bool:
        """Whether ``key`` is likely to be sent again: it has been used within its horizon
        (``False`` for an entry not used again since it was stored, before any first
        reuse: nothing says it will come back)."""
        last = self._last.get(key)
        if last is None:
            return False
        own = self._own.get(key)
        horizon = self.horizon() if own is None else _kept_for(own)
        return horizon is not None and self._clock - last <= horizon

    def horizon(self) -> float | None:
        """How long an entry not used again since it was stored may go unused and still be
        kept; ``None`` before any reuse."""
        seen, clock = self._seen, self._clock
        while seen and clock - seen[0][1] > MEMORY * seen[0][0] + SLACK:
            seen.pop(0)
        return _kept_for(seen[0][0]) if seen else None

    def _see(self, distance: int) -> None:
        seen = self._seen
        while seen and seen[-1][0] <= distance:
            seen.pop()
        seen.append((distance, self._clock))

    def clear(self) -> None:
        self._clock = 0
        self._last.clear()
        self._own.clear()
        self._fresh.clear()
        self._expiries.clear()
        self._ghosts.clear()
        self._seen.clear()
