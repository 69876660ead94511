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

import itertools
import threading
from collections import OrderedDict
from collections.abc import Iterable
from contextvars import ContextVar
from typing import NamedTuple

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

_moments = itertools.count(1)


class Moment(NamedTuple):
    """When a value is sent, as far as what is learned of it goes: the jobs a scope submits
    to a thread pool between two of its own sends (verl's ``parallel_put``) are one moment,
    whichever of them the pool runs first; each send of the scope's own is a moment."""

    at: int
    #: Which of the moment's pool jobs sends (0: the scope's own thread).
    job: int = 0


#: The moment of the pool's job that runs in this context (``None``: not a pool's job).
job_moment: ContextVar[Moment | None] = ContextVar("refshare_moment", default=None)


def pooled_moment() -> int | None:
    """The moment of the pool's job that runs in this context, if it is one."""
    job = job_moment.get()
    return None if job is None else job.at


class Moments:
    """A scope's moments (see :class:`Moment`): its pool's jobs are marked when submitted."""

    __slots__ = ("_at", "_jobs", "_lock")

    def __init__(self) -> None:
        self._at = 0
        self._jobs = 0
        self._lock = threading.Lock()  # a job may submit to a pool too (refshare's hashing)

    def own(self) -> Moment:
        """The moment of a send of the scope's own: one of its own."""
        with self._lock:
            self._jobs = 0
        return Moment(next(_moments))

    def job(self) -> Moment:
        """The moment of a job submitted to a thread pool now: that of the jobs submitted
        since the scope last sent."""
        with self._lock:
            if not self._jobs:
                self._at = next(_moments)
            self._jobs += 1
            return Moment(self._at, self._jobs)

    def submitted(self) -> None:
        """A job is being submitted to a thread pool: mark the job's context (this one, a
        copy the job runs in) with the moment it sends in."""
        job_moment.set(self.job())

    def now(self) -> Moment:
        """The moment of a send from this context: its pool job's (a scope entered inside
        the job sends as part of it), or one of the scope's own."""
        return job_moment.get() or self.own()


class _Sent:
    """Where a member was sent: in moment ``at``, each job's kind of value (``jobs``), and
    the kinds it was sent in at the last moment before (``before``)."""

    __slots__ = ("at", "before", "jobs")

    def __init__(self, at: int) -> None:
        self.at = at
        self.before: tuple[Kind, ...] = ()
        self.jobs: dict[int, Kind] = {}


class Splitting:
    """Which kinds of values have large members that are sent again, in a later argument:
    a batch that grows between calls, or goes to several groups. Such a kind is split into
    members by default; any other is stored whole, in one put.

    What a moment's pool jobs send is learned from the next moment on: a job does not see
    what its siblings sent, so what is learned does not depend on which the pool ran first.
    Two of them sending one member is learned as any member sent again is."""

    __slots__ = ("_lock", "_repeating", "_seen")

    def __init__(self) -> None:
        self._seen: OrderedDict[bytes, _Sent] = OrderedDict()
        #: kind -> the moment it was found to repeat in
        self._repeating: OrderedDict[Kind, int] = OrderedDict()
        self._lock = threading.Lock()

    def repeats(self, kind: Kind, now: Moment) -> bool:
        """Whether values of ``kind`` have had members sent again, before moment ``now``."""
        at = self._repeating.get(kind)
        return at is not None and at != now.at

    def seen(self, key: bytes, now: Moment) -> bool:
        """Whether a member with content ``key`` was sent before, as seen at ``now``."""
        sent = self._seen.get(key)
        if sent is None:
            return False
        return sent.at != now.at or bool(sent.before) or now.job in sent.jobs

    def remember(self, keys: list[bytes], kind: Kind, now: Moment) -> None:
        """Members with content ``keys`` were sent at ``now``, in a value of ``kind``."""
        with self._lock:
            for key in keys:
                sent = self._seen.get(key)
                if sent is None:
                    sent = self._seen[key] = _Sent(now.at)
                elif sent.at != now.at:
                    sent.before = tuple(dict.fromkeys(sent.jobs.values()))
                    sent.at, sent.jobs = now.at, {}
                elif any(job != now.job for job in sent.jobs):  # a sibling job sent it too
                    self._repeat([*sent.jobs.values(), kind], now)
                sent.jobs[now.job] = kind
                self._seen.move_to_end(key)
            while len(self._seen) > MAX_MEMBERS:
                self._seen.popitem(last=False)

    def found_again(self, keys: list[bytes], now: Moment) -> None:
        """Members with content ``keys`` are sent again at ``now``: the kinds they were sent
        in repeat."""
        with self._lock:
            for key in keys:
                sent = self._seen.get(key)
                if sent is None:
                    continue
                if sent.at != now.at:
                    self._repeat(sent.jobs.values(), now)
                else:
                    own = sent.jobs.get(now.job)
                    self._repeat(sent.before if own is None else (*sent.before, own), now)

    def _repeat(self, kinds: Iterable[Kind], now: Moment) -> None:
        for kind in kinds:
            self._repeating.setdefault(kind, now.at)
            self._repeating.move_to_end(kind)
        while len(self._repeating) > MAX_KINDS:
            self._repeating.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._seen.clear()
            self._repeating.clear()
