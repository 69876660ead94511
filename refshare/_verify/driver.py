"""Verify, the driver's side: each send by ref compared with what Ray by value gives, per send.

For each argument, ``ray.put`` and ``share()`` refshare answers by content, verify makes the
one by-value serialization of that send, Ray's own put of the value (the copy), and compares
what a receiver gets of it (``ray.get``) with what a receiver gets of what refshare sends
(the stored object fetched, an inline skeleton put and fetched), by the description of
``received.py``. The description of a stored object is kept by its ref (stored objects are
immutable); nothing verify keeps holds a ref.

- equal: refshare's ref is sent, and the copy dropped at once (*verified*);
- different: the copy is sent, as by value would send it; for a put or ``share()``, the
  copy is the answer (a *mismatch*, logged as an error);
- anything verify cannot fetch, describe or compare fails closed: the copy is sent, and the
  send is *unverified*, with its reason (logged as a warning).

With ``verify="worker"`` a task's argument carries both refs, and the worker compares (see
``worker.py``); puts and ``share()`` are still checked here, as their ref is the program's.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, Literal, NamedTuple

import ray

from .. import _env, _ledger
from .._ray.pickling import ship_by_value
from .._ray.submit import raw_put
from . import leaves, received, worker
from .received import describe, first_difference
from .worker import MISMATCH, UNVERIFIED, VERIFIED, cannot_describe

logger = logging.getLogger("refshare")

#: How many stored objects' descriptions are kept; the oldest are described again.
MAX_ENTRIES = 1 << 16
#: The outcome of a send whose check is left to the worker that receives it.
ON_WORKER = "on the worker"

Mode = bool | Literal["worker"]
_warned_env: list[str] = []


def verify_by_env() -> Mode:
    """``REFSHARE_VERIFY``: ``True`` (1, true, yes, on), ``"worker"``, else ``False``."""
    setting = _env.mode(_env.VERIFY)
    if setting == "1":
        return True
    if setting == "worker":
        return "worker"
    if setting and setting not in _warned_env:
        _warned_env.append(setting)
        logger.warning(
            "%s=%r: pass 1 (on the driver) or worker; verify is off", _env.VERIFY, setting
        )
    return False


class Verdict(NamedTuple):
    """What verify decided for one send: what to send instead, and how it went."""

    sent: Any
    outcome: str  #: VERIFIED, MISMATCH, UNVERIFIED or ON_WORKER
    reason: str = ""


def _log(outcome: str, kind: str, argument: str, site: str, reason: str, where: str) -> None:
    if outcome == MISMATCH:
        logger.error(
            "refshare verify: %s sent as %s in %s would not reach the worker as by value "
            "(%s%s); sent by value",
            kind,
            argument,
            site,
            reason,
            where,
        )
    elif outcome == UNVERIFIED:
        logger.warning(
            "refshare verify: %s sent as %s in %s is unverified (%s%s); sent by value",
            kind,
            argument,
            site,
            reason,
            where,
        )


_unpickling = threading.Lock()


@contextlib.contextmanager
def _classes_kept() -> Iterator[None]:
    """While verify deserializes on the driver, the classes this process defined and
    cloudpickle sends by value (a script's, a notebook's, a local class) keep their own
    attributes. Unpickling such a class where it was defined, cloudpickle finds the
    original and sets on it the copies of its methods the pickle carries, whose globals
    are copies too: a program that pickles an instance by reference afterwards fails. By
    value, that happens only where the program fetches such an object itself."""
    from ray.cloudpickle import cloudpickle

    setstate: Callable[[Any, Any], Any] | None = getattr(cloudpickle, "_class_setstate", None)
    tracked = getattr(cloudpickle, "_DYNAMIC_CLASS_TRACKER_BY_CLASS", None)
    if setstate is None or tracked is None:  # another cloudpickle: left as it is
        yield
        return
    with _unpickling:
        known = set(tracked)

        @functools.wraps(setstate)  # pickled meanwhile, it is named as the one it stands for
        def keep_known(cls: Any, state: Any) -> Any:
            return cls if cls in known else setstate(cls, state)

        cloudpickle._class_setstate = keep_known
        try:
            yield
        finally:
            cloudpickle._class_setstate = setstate


def _fetched(sent: Any) -> Any:
    """What a worker receives of ``sent``: a ref fetched, or a value (an inline skeleton)
    put and fetched, as its deserialization rebuilds it."""
    ref = sent if isinstance(sent, ray.ObjectRef) else raw_put(sent)
    with _classes_kept():
        return ray.get(ref)


def _described(sent: Any, paths: bool = False) -> received.Description:
    """The description of what a receiver has of ``sent``; the object is dropped here."""
    got = _fetched(sent)
    return describe(got, paths)


def _identity(sent: Any) -> object:
    """What names the stored content a receiver gets of ``sent``: its ref, or for an inline
    skeleton its key (its own bytes, its members' keys) with the refs of its members."""
    if isinstance(sent, ray.ObjectRef):
        return sent.binary()
    key = getattr(sent, "key", None)
    members = getattr(sent, "members", None)
    if key is None or members is None:
        return None
    named = tuple(
        m.binary() if isinstance(m, ray.ObjectRef) else (m.ref.binary(), m.at) for m in members
    )
    return (key, named)


class Checked:
    """A task's argument under ``verify="worker"``: refshare's ref (or inline skeleton) and
    the by-value copy's ref; the worker's unpickling compares the two (``worker.py``)."""

    __slots__ = ("argument", "copy", "ledger", "sent", "site")

    def __init__(self, sent: Any, copy: Any, site: str, argument: str, ledger: Any) -> None:
        self.sent, self.copy, self.ledger = sent, copy, ledger
        self.site, self.argument = site, argument

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        sent = self.sent
        how = ("get", sent) if isinstance(sent, ray.ObjectRef) else ("rebuild", *sent.__reduce__())
        return worker.check_received, (how, self.copy, self.site, self.argument, self.ledger)


class Verifier:
    """The descriptions of the objects sent by ref, in this process and session, and the
    ledger the workers report to."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: collections.OrderedDict[object, bytes] = collections.OrderedDict()
        self._session: object = None
        self._ledger: Any = None

    def check(
        self, value: Any, sent: Any, site: str, argument: str, session: object, on_worker: bool
    ) -> Verdict:
        """What to send for ``value`` instead of ``sent`` (refshare's ref or inline
        skeleton), and how it went. ``site`` and ``argument`` name where it was sent
        (``Cls.method``, ``argument 'batch'``); ``on_worker`` leaves the check of a task's
        argument to the worker. Where by value itself fails, ``value``: Ray's own error."""
        kind = type(value).__qualname__
        try:
            copy = raw_put(value)
        except Exception as error:
            reason = f"by value fails too ({type(error).__name__}: {error})"[:200]
            return self._verdict(value, UNVERIFIED, reason, kind, argument, site)
        self._bind(session)
        if on_worker:
            checked = Checked(sent, copy, site, argument, self._ledger_for(session))
            return Verdict(checked, ON_WORKER)
        try:
            expected = _described(copy).digest
        except Exception as error:
            return self._verdict(copy, UNVERIFIED, cannot_describe(error), kind, argument, site)
        ident = _identity(sent)
        with self._lock:
            known = None if ident is None else self._known.get(ident)
        if known is None:
            try:
                got = _fetched(sent)
            except Exception as error:
                reason = f"rebuilding it failed: {error!r}"
                return self._verdict(copy, MISMATCH, reason, kind, argument, site)
            try:
                known = describe(got).digest
            except Exception as error:
                return self._verdict(copy, UNVERIFIED, cannot_describe(error), kind, argument, site)
            del got
            self._keep(ident, known)
        if known == expected:
            return Verdict(sent, VERIFIED)
        return self._verdict(copy, MISMATCH, _difference(copy, sent), kind, argument, site)

    @staticmethod
    def _verdict(
        sent: Any, outcome: str, reason: str, kind: str, argument: str, site: str
    ) -> Verdict:
        _log(outcome, kind, argument, site, reason, "")
        return Verdict(sent, outcome, reason)

    def _bind(self, session: object) -> None:
        """Forget what was known of another session's objects (refs live in one)."""
        with self._lock:
            if session != self._session:
                self._known.clear()
                self._session = session
                self._ledger = None

    def _keep(self, ident: object, known: bytes) -> None:
        if ident is None:
            return
        with self._lock:
            self._known[ident] = known
            if len(self._known) > MAX_ENTRIES:
                self._known.popitem(last=False)

    def _ledger_for(self, session: object) -> Any:
        """The driver's ledger actor for this session, made on first use: owned by the
        driver, it ends with it. The workers' checks report to it; ``stats()`` and
        ``report()`` drain it."""
        with self._lock:
            if self._ledger is None:
                for module in (leaves, received, worker):
                    ship_by_value(module)
                self._ledger = ray.remote(num_cpus=0)(worker.Ledger).remote()
                if self.drain not in _ledger.before_read:
                    _ledger.before_read.append(self.drain)
            return self._ledger

    def drain(self) -> None:
        """Count what the workers found since the last drain (a report still on its way
        from a worker is counted at the next)."""
        with self._lock:
            ledger = self._ledger
        if ledger is None:
            return
        try:
            found = ray.get(ledger.drain.remote(), timeout=60)
        except Exception:
            logger.debug("verify: the workers' ledger cannot be read", exc_info=True)
            return
        for site, argument, kind, outcome, reason in found:
            _ledger.tally(site, False).verdict(outcome, reason)
            _log(outcome, kind, argument, site, reason, ", on a worker")


def _difference(copy: Any, sent: Any) -> str:
    """Where what a receiver gets of ``sent`` first differs from the by-value ``copy``."""
    try:
        return first_difference(_described(copy, True), _described(sent, True))
    except Exception:
        return "what the worker receives differs"


verifier = Verifier()
