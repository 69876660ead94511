"""How far apart a cache's hits come: what a cache keeps follows the working set it sees.

A cache that keeps each entry until its budget is full holds, in a training loop that sends
a new rollout every step, a quarter of the object store of chunks never sent again. So a
cache measures reuse distances: the bytes stored through it between two uses of an entry.

What an entry used ``n`` times so far is likely to do next is what entries used ``n`` times
did lately: an entry not used again since it was stored is kept for as long as the first
reuses seen lately came (the distance from an entry's store to its first use again), one
used once for as long as the second reuses came, and so on, with a margin. A distance speaks
for other entries once two have shown it among the last reuses of that count: the weights,
one entry sent once a step, come back a step after they were stored and again a step later,
and alone they would keep every chunk used as often for a step and a half. An entry used
again is also kept for as long as its own longest reuse distance, with the margin, and once
used :data:`OWN_FROM` times, for that alone. So the weights sent once a step stay from step
to step; a rollout's chunk sent again by the next calls of its step and then never goes soon
after the step's last call; NeMo-RL's batch, sent again at once (the reference's log-probs
right after the policy's) and then after a longer gap (train), stays for the gap its
predecessors showed; and verl's, sent by each of a step's five calls, each reuse farther
from the one before than its own had come (the driver stores the step's new keys between
them), stays for each of its step's calls. Before any first reuse is seen, an entry never
used again is not evicted for its age (the budget alone bounds the cache); an entry whose
kind of next use no two entries have shown is kept for its own distances. What is counted is
the last reuses of each count, however long ago: a loop that slows down, or stops sending,
keeps what it learned.

The clock is read once per moment (see ``_admission.Moment``): what the jobs a scope submits
to a thread pool at once store and find is stamped with the clock as it was when the first
of them came, so that the distances, and what goes for its age, do not depend on which job
the pool ran first. Outside a pool's jobs, the clock is read as it is.

An evicted entry sent again is remembered (its key, a ghost), so that its miss still teaches
the distance it would have needed: from then on it is kept that long, and entries used as
many times as it had been are kept that long too.
"""

from __future__ import annotations

import collections
import heapq
import itertools
from collections import OrderedDict
from collections.abc import Hashable, Iterable

#: An entry is kept for its longest reuse distance (or the next reuses seen lately)
#: times this, plus :data:`SLACK`.
MARGIN = 1.5
#: Bytes added to every horizon, so that what is weighed a few bytes apart (an audit's
#: estimate of what the store holds, and the store's own count) is evicted alike.
SLACK = 64 << 10
#: The reuses of each count remembered (the last ones).
SEEN = 32
#: How many entries must have shown a distance among them for it to speak for others.
AGREE = 2
#: Evicted keys remembered at most (the oldest are forgotten).
MAX_GHOSTS = 4096
#: An entry used again this many times is kept for its own distances alone: they speak for it
#: better than what others did. Below it, how far the next reuses of entries used as often
#: came keeps it too: verl's batch is sent by each of a step's five calls, each reuse more
#: than :data:`MARGIN` times farther than the one before (at 2, its chunks went before their
#: fourth and fifth calls and were put again every step).
OWN_FROM = 8


def _kept_for(distance: float) -> float:
    return distance * MARGIN + SLACK


class Reuse:
    """The reuse distances of one cache's entries (not thread-safe: the cache's lock)."""

    __slots__ = (
        "_clock",
        "_expiries",
        "_fresh",
        "_ghosts",
        "_horizons",
        "_last",
        "_moment",
        "_now",
        "_order",
        "_own",
        "_pooled",
        "_seen",
        "_start",
        "_uses",
    )

    def __init__(self) -> None:
        self._clock = 0  #: bytes stored through the cache so far
        #: The clock as read now: as it was when the current moment's first job came.
        self._now = 0
        self._pooled = False  #: whether what comes now comes from a pool's job
        self._moment = 0  #: the last moment whose jobs came, and the clock when they began
        self._start = 0
        self._last: dict[Hashable, int] = {}  #: key -> the clock when it was last used
        #: key -> its longest reuse distance, for the keys used again since they were stored
        self._own: dict[Hashable, int] = {}
        #: key -> how many times it was used again since it was stored (none: not yet)
        self._uses: dict[Hashable, int] = {}
        #: The keys not used again since they were stored, the oldest first.
        self._fresh: OrderedDict[Hashable, None] = OrderedDict()
        #: (when it expires, order, key, its last use) of the keys used again; an item is out
        #: of date once its key was used since (see :meth:`expired`).
        self._expiries: list[tuple[float, int, Hashable, int]] = []
        self._order = itertools.count()
        #: Evicted key -> its last use, its longest reuse distance (-1: never used again) and
        #: its uses.
        self._ghosts: OrderedDict[Hashable, tuple[int, int, int]] = OrderedDict()
        #: n -> the distances of the last n-th reuses
        self._seen: dict[int, collections.deque[int]] = {}
        #: n -> the horizon they give, worked out when asked, forgotten when one is seen
        self._horizons: dict[int, float] = {}

    @property
    def clock(self) -> int:
        """The bytes stored through the cache so far, as read now (see :meth:`at`)."""
        return self._now

    def at(self, moment: int | None) -> None:
        """What comes next is stored or used in ``moment`` (``None``: outside a pool's jobs):
        the clock is read as it was when the moment's first job came."""
        self._pooled = moment is not None
        if moment is None:
            self._now = self._clock
            return
        if moment != self._moment:
            self._moment, self._start = moment, self._clock
        self._now = self._start

    def stored(self, keys: Iterable[Hashable], nbytes: int) -> None:
        """``keys`` were stored, in objects weighing ``nbytes`` in all."""
        keys = list(keys)
        for key in keys:
            ghost = self._ghosts.pop(key, None)
            if ghost is not None:  # evicted too early: the horizon it would have needed
                last, own, uses = ghost
                distance = self._now - last
                self._see(uses + 1, distance)
                self._own[key] = max(own, distance)
                self._uses[key] = uses + 1
        self._clock += nbytes
        if not self._pooled:
            self._now = self._clock
        for key in keys:
            self._last[key] = self._now
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
        distance = self._now - last
        uses = self._uses.get(key, 0) + 1
        self._see(uses, distance)
        if uses == 1:
            self._fresh.pop(key, None)
        self._own[key] = max(self._own.get(key, 0), distance)
        self._uses[key] = uses
        self._last[key] = self._now
        self._expires(key)

    def _expires(self, key: Hashable) -> None:
        """Note when ``key``, just used, goes past its own horizon (:meth:`expired` looks
        again then: the next reuses seen meanwhile may keep it longer)."""
        last = self._last[key]
        when = last + _kept_for(self._own[key])
        heapq.heappush(self._expiries, (when, next(self._order), key, last))

    def evicted(self, key: Hashable) -> None:
        last = self._last.pop(key, None)
        own = self._own.pop(key, -1)
        uses = self._uses.pop(key, 0)
        self._fresh.pop(key, None)
        if last is not None:
            self._ghosts[key] = (last, own, uses)
            if len(self._ghosts) > MAX_GHOSTS:
                self._ghosts.popitem(last=False)

    def expired(self) -> list[Hashable]:
        """The keys gone unused past their horizon since the last call, each given once
        (the cache evicts them, or keeps them for another key of their object)."""
        found = []
        horizon = self.horizon(1)
        fresh, last = self._fresh, self._last
        while horizon is not None and fresh:
            key = next(iter(fresh))
            if self._now - last[key] <= horizon:
                break
            del fresh[key]
            found.append(key)
        expiries = self._expiries
        while expiries and expiries[0][0] < self._now:
            _, _, key, used = heapq.heappop(expiries)
            if last.get(key) != used or key not in self._own:  # used since, or evicted
                continue
            until = used + self._kept(key)
            if until < self._now:
                found.append(key)
            else:  # the next reuses seen lately came later than its own
                heapq.heappush(expiries, (until, next(self._order), key, used))
        return found

    def within(self, key: Hashable) -> bool:
        """Whether ``key`` is likely to be sent again: it has been used within its horizon
        (``False`` for an entry not used again since it was stored, before any first
        reuse: nothing says it will come back)."""
        last = self._last.get(key)
        if last is None:
            return False
        horizon = self._kept(key) if key in self._own else self.horizon(1)
        return horizon is not None and self._now - last <= horizon

    def _kept(self, key: Hashable) -> float:
        """How long ``key``, used again since it was stored, may go unused: its own horizon,
        or, until it has been used :data:`OWN_FROM` times, that of the next reuses seen
        lately if that is longer."""
        own = _kept_for(self._own[key])
        uses = self._uses[key]
        then = self.horizon(uses + 1) if uses < OWN_FROM else None
        return own if then is None else max(own, then)

    def horizon(self, nth: int = 1) -> float | None:
        """How long an entry used ``nth - 1`` times may go unused and still be kept, from
        the last ``nth`` reuses seen: the :data:`AGREE`-th longest, with the margin.
        ``None`` if they do not say: before any reuse of that count, or, for entries used
        again, before :data:`AGREE` of them (their own distances then keep them). One first
        reuse does for entries never used again: else nothing would, and they would stay
        until the budget is full."""
        horizon = self._horizons.get(nth)
        seen = self._seen.get(nth)
        if horizon is None and seen and (nth == 1 or len(seen) >= AGREE):
            longest = sorted(seen, reverse=True)
            horizon = self._horizons[nth] = _kept_for(longest[min(AGREE, len(seen)) - 1])
        return horizon

    def _see(self, nth: int, distance: int) -> None:
        """An ``nth`` reuse came ``distance`` after the use before it."""
        if nth > OWN_FROM:
            return  # asked of no entry
        seen = self._seen.get(nth)
        if seen is None:
            seen = self._seen[nth] = collections.deque(maxlen=SEEN)
        seen.append(distance)
        self._horizons.pop(nth, None)

    def clear(self) -> None:
        self._clock = self._now = self._moment = self._start = 0
        self._pooled = False
        self._last.clear()
        self._own.clear()
        self._uses.clear()
        self._fresh.clear()
        self._expiries.clear()
        self._ghosts.clear()
        self._seen.clear()
        self._horizons.clear()
