"""An audit's clocks: how long by value's sending takes, and what sharing would spend instead.

Ray's time in one call is read off a clock that several threads share: a program that sends
from a few threads at once (verl's ``parallel_put`` puts each data-parallel rank's chunk from
a thread pool) spends the wall time of its sends once, not once per thread. What sharing
spends instead (a copy of a tensor's bytes, a receiver's reading) is timed once per process.
"""

from __future__ import annotations

import functools
import io
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np


class SharedClock:
    """Wall time shared among the sends in flight at once: while ``n`` are, each is charged
    ``1/n`` of every second, so that what the sends are charged sums to the wall time during
    which any of them ran. Two puts of 70 ms side by side on two threads take 70 ms of the
    step, and sharing would save at most that: charged 140 ms, an audit of verl's
    ``parallel_put`` foretold 1.49 times what sharing saved."""

    __slots__ = ("_charged", "_in_flight", "_last", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight = 0
        self._last = time.perf_counter()
        self._charged = 0.0  # what one send in flight all along would have been charged

    def _reading(self) -> float:
        now = time.perf_counter()
        if self._in_flight:
            self._charged += (now - self._last) / self._in_flight
        self._last = now
        return self._charged

    @property
    def in_flight(self) -> int:
        """How many sends are in flight now."""
        return self._in_flight

    def enter(self) -> float:
        """A send starts: the reading it starts from."""
        with self._lock:
            reading = self._reading()
            self._in_flight += 1
            return reading

    def leave(self) -> float:
        """A send (one that entered) ends: the reading it ends at."""
        with self._lock:
            reading = self._reading()
            self._in_flight -= 1
            return reading


#: The clock every audit's :class:`~refshare._ledger.Timing` reads.
SENDS = SharedClock()


#: What the measures copy: large enough to leave the caches, small enough to take about 1 ms.
_COPY_PROBE = 8 << 20


def _least(fn: Callable[[], object], runs: int = 7) -> float:
    """The fewest CPU seconds this thread spent on one of a few runs of ``fn``, after one
    untimed run. The least, because what blurs a run only adds to it (another process on
    the core). Each run's result is kept until the last, so that every run allocates pages
    of its own, as a receiver does for what it keeps: whether the allocator handed a run
    pages already mapped or new ones to fault in varied from process to process, and moved
    the receivers' part of an audit's estimate 13-fold between two runs of one replay."""
    kept = [fn()]  # each run's result kept until the last: every run gets fresh pages
    took = []
    for _ in range(runs):
        start = time.thread_time()
        kept.append(fn())
        took.append(time.thread_time() - start)
    return min(took)


@functools.cache
def _copy_cost() -> float:
    """Seconds this process takes to copy a byte into memory already mapped, as a put
    copies into the object store's pages (mapped in each process once, then reused)."""
    source = np.ones(_COPY_PROBE, np.uint8)
    target = np.ones(_COPY_PROBE, np.uint8)  # written, so mapped: not ``zeros``' lazy pages
    return _least(lambda: np.copyto(target, source)) / _COPY_PROBE


def copying(nbytes: int) -> float:
    """About how many seconds putting ``nbytes`` of a tensor's bytes takes: one copy into
    the object store (timed once, on :data:`_COPY_PROBE` bytes)."""
    return nbytes * _copy_cost()


@functools.cache
def _unpickle_cost(torch: Any) -> float:
    """Seconds a receiver spends on a byte of a tensor sent by value more than on one sent
    as sharing sends it. By value, unpickling copies the storage's bytes out of the pickle
    into bytes of their own (one copy: :func:`copying`), which ``torch.load`` reads into a
    new storage; sharing's receiver copies them from the object store into a new storage
    (``bootstrap.rebuild_storage``). Timed here, on :data:`_COPY_PROBE` bytes: that copy,
    and ``torch.load``'s reading against that rebuild (its own work beyond a copy). Each
    part timed alone, each run on new storage kept (see :func:`_least`): both receivers
    make a storage of their own; timed whole, the path faulted in new pages in some
    processes and not in others, and the rate moved 10-fold between them."""
    from ._wire.bootstrap import rebuild_storage

    try:
        saved = io.BytesIO()
        probe = torch.ones(_COPY_PROBE // 4)._typed_storage()  # what a tensor pickles
        torch.serialization.save(probe, saved, _use_new_zipfile_serialization=False)
        data, raw = saved.getvalue(), np.ones(_COPY_PROBE, np.uint8)
        loading = _least(lambda: torch.serialization.load(io.BytesIO(data), weights_only=False))
        rebuilding = _least(lambda: rebuild_storage([raw], torch.float32))
    except Exception:  # another torch: count nothing for the receivers
        return 0.0
    return _copy_cost() + max(0.0, loading - rebuilding) / _COPY_PROBE


def unpickling(nbytes: int) -> float:
    """About how many seconds more a receiver spends on ``nbytes`` of tensors sent by value
    than on their bytes as sharing sends them (see :func:`_unpickle_cost`: timed once per
    process, through ``torch.serialization``'s own functions, so that a program that wraps
    ``torch.save`` to count its calls sees none of these). Nothing (0.0) where torch was
    never imported (no tensor was sent); no receivers' part where the timing fails."""
    torch = sys.modules.get("torch")
    return 0.0 if torch is None or not nbytes else nbytes * _unpickle_cost(torch)
