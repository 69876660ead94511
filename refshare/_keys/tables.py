"""The tables refshare keys values by: leaf digests, stamps, and fingerprints by type."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, NamedTuple

from .._dispatch import TypeTable
from .._ray.pickling import sent_by_value
from .._rules import PickleOrder, pickles_as
from .._wire.serialized import ray_handle_types
from .sizes import SizeFn, register_size

Key = bytes


class Trust(enum.IntEnum):
    """How far an object hashed before can be trusted not to have changed."""

    NEVER = 0  #: anything may have written to it: hashed again on every call
    PROMISED = 1  #: only behind torch's back, which ``reuse_fingerprints`` rules out
    ALWAYS = 2  #: nothing can write to it (read-only down to an immutable buffer)


#: A stamp that changes when an object changes, and how far the object can be trusted;
#: ``None`` where nothing can vouch for the object (it is hashed each time it is sent).
Stamp = tuple[object, Trust] | None


class MemoEntry(NamedTuple):
    """What a call worked out about one object."""

    anchor: object  #: held, so that no ``id()`` or memory is recycled while the memo lives
    stamp: object
    digest: Key


#: Keyed by ``id(obj)``, or by a tuple naming what was hashed (a tensor's own elements, a
#: storage several views share).
Memo = dict[object, MemoEntry]


class Keyed(NamedTuple):
    """A value keyed: its key, what to put for it on a miss, and what it weighs."""

    key: Key
    stored: Any
    nbytes: int


#: What defines a registered type's content: any value refshare can fingerprint itself.
FingerprintFn = Callable[[Any], Any]
#: Digests a leaf, with the per-call memo and whether digests may be kept across calls.
DigestFn = Callable[[Any, Memo | None, bool], Key | None]
StampFn = Callable[[Any], Stamp]

#: Types whose content refshare hashes itself, in place (exact types only: a subclass may
#: carry state of its own).
leaf_digests: TypeTable[DigestFn] = TypeTable()
#: How to tell that an object may have changed since it was hashed (see ``stamps``).
stamps: TypeTable[StampFn] = TypeTable()
#: Users' own types, with what defines their content (see ``register_fingerprint``); a
#: subclass is read only if it pickles as the registered class (see ``refshare._rules``).
user_fingerprints: TypeTable[FingerprintFn] = TypeTable(pickles_as)
#: refshare's own fingerprints of the ecosystem's batch types (see ``refshare._integrations``),
#: registered for when their package is imported; a user's registration takes precedence.
#: Each is an allow-list: ``NotImplemented`` for a value it has not read in full.
builtin_fingerprints: TypeTable[FingerprintFn] = TypeTable(pickles_as)
#: Pickle's order as keys see it: leaves digested in place, then a user's readers, then
#: refshare's own (see ``refshare._rules``).
pickle_order = PickleOrder(
    leaf_digests, (user_fingerprints, builtin_fingerprints), ray_handle_types, sent_by_value
)


def register_fingerprint(
    cls: type, fingerprint: FingerprintFn, *, size: SizeFn | None = None
) -> None:
    """Teach refshare what defines the content of an instance of ``cls`` (or a subclass).

    ``fingerprint(obj)`` returns any value refshare can fingerprint itself, typically a tuple
    of the object's arrays, tensors and metadata, or ``NotImplemented`` for an instance it
    does not read in full (refshare then keys that one by its pickle). Two instances share
    a ref exactly when these values are equal in type, layout and bytes, so leave nothing
    out that a worker would see. A subclass is read with ``fingerprint`` only if it pickles
    as ``cls`` does: the same ``__reduce_ex__``, ``__reduce__``, ``__getstate__``,
    ``__setstate__``, ``__getnewargs_ex__``, ``__getnewargs__``, slots and ``copyreg``
    entry; ``cls`` itself only while its pickling is its own module's (no hook assigned,
    no reducer registered for it by other code), and no instance holding a hook of its own
    (see ``refshare._rules``). ``size`` is the same as :func:`register_size`.
    """
    if not isinstance(cls, type):
        raise TypeError(f"register_fingerprint() takes a class, got {cls!r}")
    if not callable(fingerprint):
        raise TypeError(
            f"register_fingerprint() takes a callable fingerprint function, got {fingerprint!r}"
        )
    user_fingerprints.register(cls, fingerprint)
    if size is not None:
        register_size(cls, size)
