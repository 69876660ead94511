"""How far apart a cache's hits come: what a cache keeps follows the working set it sees.

A cache that keeps each entry until its budget is full holds, in a training loop that sends
a new rollout every step, a quarter of the object store of chunks never sent again. So a
cache measures the reuse distance of each hit: the bytes stored through it since that entry
was last used. An entry unused for longer than the horizon (the longest reuse distance seen
lately, with a margin) will likely not be sent again, and is evicted on the next
insert. A distance counts as seen lately until the cache has stored three times as much
since (a pattern that repeats shows it again by then). An evicted entry sent again is
remembered (its key, a ghost), so that its miss still teaches the distance it would have
needed: the horizon grows back when a longer reuse appears. Until the first reuse is seen,
nothing is evicted for its age: the budget alone bounds the cache.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable

#: The horizon is the longest reuse distance seen lately, times this, plus :data:`SLACK`.
MARGIN = 1.5
#: Bytes added to every horizon, so that what is weighed a few bytes apart (an audit's
#: estimate of what the store holds, and the store's own count) is evicted alike.
SLACK = 64 << 10
#: A distance seen at some point stops counting once this many times it has been stored since.
MEMORY = 3
#: Evicted keys remembered at most (the oldest are forgotten).
MAX_GHOSTS = 4096


class Reuse:
    """The reuse distances of one cache's entries (not thread-safe: the cache's lock)."""

    __slots__ = ("_clock", "_ghosts", "_last", "_seen")

    def __init__(self) -> None:
        self._clock = 0  #: bytes stored through the cache so far
        self._last: dict[Hashable, int] = {}  #: key -> the clock when it was last used
        self._ghosts: OrderedDict[Hashable, int] = OrderedDict()  #: evicted key -> last use
        #: (distance, clock when seen), the distances decreasing: each one seen later than
        #: the ones before it, and shorter, else it would have replaced them.
        self._seen: list[tuple[int, int]] = []

    def stored(self, keys: Iterable[Hashable], nbytes: int) -> None:
        """``keys`` were stored, in objects weighing ``nbytes`` in all."""
        keys = list(keys)
        for key in keys:
            ghost = self._ghosts.pop(key, None)
            if ghost is not None:  # evicted too early: the horizon it would have needed
                self._see(self._clock - ghost)
        self._clock += nbytes
        for key in keys:
            self._last[key] = self._clock

    def used(self, key: Hashable) -> None:
        """``key`` was found (a hit)."""
        last = self._last.get(key)
        if last is not None:
            self._see(self._clock - last)
        self._last[key] = self._clock

    def evicted(self, key: Hashable) -> None:
        last = self._last.pop(key, None)
        if last is not None:
            self._ghosts[key] = last
            if len(self._ghosts) > MAX_GHOSTS:
                self._ghosts.popitem(last=False)

    def stale(self, key: Hashable) -> bool:
        """Whether ``key`` has gone unused past the horizon."""
        horizon = self.horizon()
        last = self._last.get(key)
        return horizon is not None and last is not None and self._clock - last > horizon

    def horizon(self) -> float | None:
        """How long an entry may go unused and still be kept; ``None`` before any reuse."""
        seen, clock = self._seen, self._clock
        while seen and clock - seen[0][1] > MEMORY * seen[0][0] + SLACK:
            seen.pop(0)
        return seen[0][0] * MARGIN + SLACK if seen else None

    def _see(self, distance: int) -> None:
        seen = self._seen
        while seen and seen[-1][0] <= distance:
            seen.pop()
        seen.append((distance, self._clock))

    def clear(self) -> None:
        self._clock = 0
        self._last.clear()
        self._ghosts.clear()
        self._seen.clear()
