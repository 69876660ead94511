"""Keying within one call: a value unchanged since it was keyed or split in the call is not
keyed or split again.

Arrays and tensors hashed in the call are found again in the digest memo while their stamps
hold (see ``refshare._keys.stamps``); a value that had to be pickled to be keyed, and a
split value's skeleton, are found again under a stamp of their whole structure (see
``StampedMemo``), so each is serialized or split at most once per call. A value ``ray.put``
for the first time in the call is not stamped (most are put once, their ref being what
travels): only from its second put on.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, NamedTuple

from .._deep import NotSplittable, Split, split
from .._keys import Key, Keyed, Memo, identify
from .._keys.leaves import small_array, small_array_digest
from .._keys.pickler import learn_pickling, pickles_alike, pickling_classes
from .._keys.stamps import first_put
from .._keys.structure import StampedMemo, structure_stamp
from .._wire.serialized import stored_whole

logger = logging.getLogger("refshare")


class Pickled(NamedTuple):
    """A value keyed by its own pickle, within one call: its key, what it weighs, and the
    classes whose pickling decides whether it pickles alike again."""

    key: Key
    nbytes: int
    classes: frozenset[type]


class NotKeyed(NamedTuple):
    """Why a value cannot be keyed: it goes by value."""

    reason: str


class CallMemo:
    """What one call worked out about the values it sent, kept while they are unchanged."""

    __slots__ = ("deep", "differs", "digests", "min_bytes", "pickled", "put_once", "reuse",
                 "splits", "unkeyed")  # fmt: skip

    def __init__(self, reuse: bool, min_bytes: int, deep: bool | None) -> None:
        self.reuse = reuse
        self.min_bytes = min_bytes
        self.deep = deep
        self.digests: Memo = {}
        self.pickled = StampedMemo()
        self.splits = StampedMemo()
        #: Values ``ray.put`` once in this call, by id: stamped only when put again.
        self.put_once: set[int] = set()
        #: Values put without keying in this call, by id (see ``refshare._admission``).
        self.unkeyed: set[int] = set()
        #: Values kept in ``pickled`` seen to pickle differently, by id: sent by value.
        self.differs: set[int] = set()

    def key(self, value: Any, nbytes: int, put: bool = False) -> Keyed | NotKeyed:
        """``value`` keyed, with what to put for it on a miss and what it weighs.

        A value that had to be pickled to be keyed is stored as that pickle and weighs what
        it pickled to; within this call it is not pickled again while its structure stamp
        holds, once each class whose pickling it runs has shown that pickling an unchanged
        value gives the same bytes (see ``pickles_alike``); a value ``ray.put`` (``put``),
        only from its second put on."""
        kept: Pickled | None = self.pickled.get(value)
        if kept is not None and id(value) in self.differs:
            return NotKeyed("it pickles differently each time")
        if kept is not None and pickles_alike(kept.classes):
            return Keyed(kept.key, value, kept.nbytes)
        reasons: list[str] = []
        with self.first_sight(value, put):
            found = identify(value, self.digests, self.reuse, reasons)
        if found is None:
            return NotKeyed(reasons[0] if reasons else "cannot be keyed")
        if found.serialized is not None:
            nbytes = found.serialized.nbytes
        if kept is not None:
            learn_pickling(kept.classes, alike=found.key == kept.key)
            if found.key != kept.key:
                self.differs.add(id(value))
        if found.costly and self.stamps(value, put):
            stamp = structure_stamp(value)
            if stamp is not None:
                classes = pickling_classes(value, stamp.held)
                self.pickled.keep(value, Pickled(found.key, nbytes, classes), stamp)
        stored = stored_whole(value, tensors=found.tensors, pickled=found.serialized)
        return Keyed(found.key, stored, nbytes)

    def key_member(self, member: Any, nbytes: int) -> Keyed | None:
        """A member of a split value keyed (``None``: it stays inside the skeleton)."""
        digest = small_array_digest(member)  # the many small arrays of a batch: hashed now
        if digest is not None:
            return Keyed(digest, member, nbytes)
        keyed = self.key(member, nbytes)
        return keyed if isinstance(keyed, Keyed) else None

    def split(self, value: Any, put: bool = False) -> Split | None:
        """``value`` pickled with its large members taken out and keyed; ``None`` for a
        value without large members, or one that cannot be split. Within this call a value
        is split once while its structure stamp holds."""
        found: Split | None = self.splits.get(value)
        if found is not None:
            return found
        try:
            with self.first_sight(value, put):
                found = split(value, self.key_member, self.min_bytes, strict=self.deep is None)
        except NotSplittable:
            return None
        except Exception:
            logger.debug("cannot split %s; shared whole", type(value).__qualname__, exc_info=True)
            return None
        if found is not None and not found.handles and self.stamps(value, put):
            # (Not with handles: kept, they would live on.) Its small arrays were hashed by
            # the split a moment ago: the stamp reuses that.
            members = found.members
            hashed = {id(m.stored): (m.stored, m.key) for m in members if small_array(m.stored)}
            self.splits.keep(value, found, hashed=hashed)
        return found

    def stamps(self, value: Any, put: bool) -> bool:
        """Whether to stamp ``value``, to find it unchanged if it is sent again in this call
        (a stamp walks all of it once more): a task's argument always, as it usually goes to
        several workers; the value of a ``ray.put`` from its second put on, as most are put
        once (their ref is what travels)."""
        if not self.first_put(value, put):
            return True
        # Only its id is kept: an id recycled meanwhile at worst stamps a value.
        self.put_once.add(id(value))
        return False

    def first_put(self, value: Any, put: bool) -> bool:
        """Whether ``value`` is being ``ray.put`` (``put``) for the first time in this call."""
        return put and id(value) not in self.put_once

    def first_sight(self, value: Any, put: bool) -> contextlib.AbstractContextManager[None]:
        """Where ``value`` is keyed: the tensors of a value put for the first time in this
        call, whole or member by member, are stamped only once seen again (see
        ``refshare._keys.stamps.first_put``)."""
        return first_put() if self.first_put(value, put) else contextlib.nullcontext()

    def sent_unkeyed(self, value: Any) -> bool:
        """Whether ``value`` was put without keying before in this call; from now on, it was.
        (Only its id is kept: an id recycled meanwhile at worst keys a value.)"""
        if id(value) in self.unkeyed:
            return True
        self.unkeyed.add(id(value))
        return False

    def pickles_differently(self, value: Any) -> None:
        """``value``, kept as its own pickle, did not arrive so (verify says): its classes
        pickle an unchanged value differently, and it goes by value from now on."""
        kept: Pickled | None = self.pickled.get(value)
        if kept is not None:
            learn_pickling(kept.classes, alike=False)
            self.differs.add(id(value))

    def forget(self) -> None:
        """Forget everything worked out in this call."""
        self.digests.clear()
        self.pickled.clear()
        self.splits.clear()
        self.put_once.clear()
        self.unkeyed.clear()
        self.differs.clear()
