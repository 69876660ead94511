"""The local object store: its size, how full it is, and the budgets of what refshare keeps.

Letting go first: what refshare keeps alive yields to what the program holds.

Ray spills objects to disk once its object store is 80% full, and refuses a put it can
neither fit nor spill. What refshare keeps alive (the values a scope sent, the cache's) is
kept only to be sent again, so before each put refshare checks how full the local store
would be and, past :data:`YIELD_FILL`, lets go of what it keeps: the scope's values first,
then the cache's, least recently used first. It never makes Ray spill what the program
holds, where by value would not have.

Ray frees an object some milliseconds after its last reference goes, not at once: a put
made right after letting go could find the store as full as before and make Ray spill. So
after letting go, if the put would take the store past :data:`SETTLE_FILL`, where Ray
spills, refshare reads the store again until what it let go of has left (the count has
fallen and holds still), the put fits below it, or :data:`SETTLE_AT_MOST` has passed. Below
it there is nothing to wait for: the put spills nothing, as by value's own puts do not.

How full the store is comes from Ray (see :func:`refshare._ray.session.local_store_used`):
read at most every :data:`READ_EVERY` seconds while it is well below the mark (at most every
:data:`READ_AT_MOST_EVERY` past :data:`NEAR_FILL`), and between readings estimated from what
refshare put since.
"""

from __future__ import annotations

import threading
import time

from ._ray.session import current_session, local_object_store_bytes, local_store_used

#: Share of the local object store the process-wide cache may hold when no budget is given.
DEFAULT_STORE_FRACTION = 0.25
#: Share of the local object store one scope may keep alive (see ``scope_budget``).
SCOPE_STORE_FRACTION = 0.5
#: Budget used when the object store's size cannot be read.
FALLBACK_MAX_BYTES = 2 << 30
#: Fill of the local object store past which refshare lets go of what it keeps, counted in
#: the primary copies Ray must keep: well below the 80% at which Ray starts spilling, since
#: the store also holds what processes still read (a worker's argument, mapped), which Ray
#: can neither evict nor spill, and a put that does not fit makes it spill at once.
YIELD_FILL = 0.6
#: Seconds between readings of the store while puts go on and it is well below the mark.
READ_EVERY = 0.25
#: Seconds between readings at the least, near the mark: each reading asks the raylet.
READ_AT_MOST_EVERY = 0.02
#: Past this fill, estimated, the store is near the mark: what the program puts between
#: readings (refshare sees only its own puts) can cross it within :data:`READ_EVERY`.
NEAR_FILL = 0.4
#: Fill past which a put waits, after refshare let go, for Ray to free what it let go of:
#: where Ray starts spilling (its ``object_spilling_threshold``, 0.8 unless set).
SETTLE_FILL = 0.8
#: Seconds refshare waits at most, after letting go, for Ray to free what it let go of.
SETTLE_AT_MOST = 0.25
#: Seconds between readings while it waits.
SETTLE_EVERY = 0.005


_store: tuple[object, int | None] | None = None


def local_store_bytes(session: tuple[str, str] | None = None) -> int | None:
    """The size of the local node's object store, read once per Ray session (``None`` when
    it cannot be read). ``session``: the current one, where the caller has just read it."""
    global _store
    if session is None:
        session = current_session()
    if _store is None or _store[0] != session:
        _store = (session, local_object_store_bytes() if session is not None else None)
    return _store[1]


def default_budget(session: tuple[str, str] | None = None) -> int:
    """A quarter of the local node's object store. ``session``: as for
    :func:`local_store_bytes`."""
    store = local_store_bytes(session)
    return int(store * DEFAULT_STORE_FRACTION) if store else FALLBACK_MAX_BYTES


def scope_budget(session: tuple[str, str] | None = None) -> int:
    """What one scope may keep alive of the values it sent, whatever the cache's budget:
    half the local object store, so that with the cache's quarter it stays below the fill
    level at which Ray starts spilling objects to disk (80%). ``session``: as for
    :func:`local_store_bytes`."""
    store = local_store_bytes(session)
    return int(store * SCOPE_STORE_FRACTION) if store else FALLBACK_MAX_BYTES


class StoreGauge:
    """How full the local object store is, read from Ray now and then, estimated between."""

    __slots__ = ("_blind", "_lock", "_read_at", "_session", "_since", "_used")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._session: object = None
        self._read_at = -1.0
        self._used = 0  #: bytes the store held at the last reading
        self._since = 0  #: bytes refshare put since
        #: Ray did not say at the last reading (a Ray without ``log_plasma_usage``, 2.40):
        #: then nothing is estimated, and the budgets alone bound what refshare keeps.
        self._blind = False

    def over(self, nbytes: int, session: tuple[str, str] | None = None) -> int:
        """By how many bytes the local store would pass :data:`YIELD_FILL` with ``nbytes``
        more put (0 if it would not, or if Ray does not say). ``session``: the current
        one, where the caller has read it (it is read here otherwise), as below."""
        session = session or current_session()
        used = self.used(nbytes, session)
        return 0 if used is None else self.past(used + nbytes, session)

    def past(self, fill: int, session: tuple[str, str] | None = None) -> int:
        """By how many bytes a local store holding ``fill`` bytes passes :data:`YIELD_FILL`
        (0 if it does not, or if its size is not known)."""
        store = local_store_bytes(session)
        return max(0, fill - int(store * YIELD_FILL)) if store else 0

    def used(self, nbytes: int = 0, session: tuple[str, str] | None = None) -> int | None:
        """The bytes the local store holds now: as last read, with what refshare put since;
        read again when due (sooner near the mark, with ``nbytes`` about to be put).
        ``None`` if Ray does not say."""
        session = session or current_session()
        store = local_store_bytes(session)
        if not store:
            return None
        now = time.monotonic()
        with self._lock:
            if session != self._session:
                self._session, self._read_at, self._used, self._since = session, -1.0, 0, 0
                self._blind = False
            since_read = now - self._read_at
            near = self._used + self._since + nbytes > store * NEAR_FILL
            if since_read > READ_EVERY or (near and since_read > READ_AT_MOST_EVERY):
                used = local_store_used()
                self._blind = used is None
                self._used, self._since, self._read_at = used or 0, 0, now
            return None if self._blind else self._used + self._since

    def settle(self, nbytes: int) -> int:
        """Read the store until what refshare just let go of has left it: the count has
        fallen below the last reading and held still for two readings, or ``nbytes`` more
        fit below :data:`SETTLE_FILL`, or :data:`SETTLE_AT_MOST` has passed. Return by how
        many bytes the store would then pass the mark (see :meth:`over`)."""
        store = local_store_bytes()
        if not store:
            return 0
        limit, room = int(store * YIELD_FILL), int(store * SETTLE_FILL)
        with self._lock:
            before = self._used + self._since
        deadline = time.monotonic() + SETTLE_AT_MOST
        readings: list[int] = []
        while True:
            used = local_store_used()
            if used is None:
                return 0
            readings.append(used)
            fallen = used < before and readings[-3:] == [used] * 3
            if used + nbytes <= room or fallen or time.monotonic() >= deadline:
                break
            time.sleep(SETTLE_EVERY)
        with self._lock:
            self._used, self._since, self._read_at = used, 0, time.monotonic()
        return max(0, used + nbytes - limit)

    def added(self, nbytes: int) -> None:
        """Count ``nbytes`` refshare just put, until the next reading."""
        with self._lock:
            self._since += nbytes


gauge = StoreGauge()
