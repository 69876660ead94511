"""Verify on the workers (``verify="worker"``): the worker compares what it receives both ways.

A task's argument travels as refshare's ref (or inline skeleton) beside the ref of Ray's own
put of the value, the by-value copy; the worker's unpickling of the argument runs
:func:`check_received`, which fetches both, compares them with the description of
``received.py``, and gives the method refshare's object where they are equal, else the
by-value one. What it found goes to the driver's :class:`Ledger` and, for a mismatch, to the
worker's log. It judges what the worker really runs: its own packages' versions, a
``__setstate__`` patched there. Ray ships this module by value: it imports nothing of
refshare.
"""

from __future__ import annotations

import logging
from typing import Any

from .received import describe, first_difference

VERIFIED, MISMATCH, UNVERIFIED = "verified", "mismatch", "unverified"


def compared(expected: Any, got: Any) -> tuple[str, str]:
    """Whether a receiver has the same of ``got`` as of ``expected`` (by value): an outcome
    and, unless verified, why; what cannot be described is unverified."""
    try:
        if describe(expected).digest == describe(got).digest:
            return VERIFIED, ""
        return MISMATCH, first_difference(describe(expected, True), describe(got, True))
    except Exception as error:
        return UNVERIFIED, cannot_describe(error)


def cannot_describe(error: BaseException) -> str:
    """Why a value could not be described, short enough to count alike in a report."""
    return f"cannot describe it ({type(error).__name__}: {error})"[:200]


def fetched(ref: Any) -> Any:
    """``ray.get`` of ``ref`` while Ray unpickles a task's arguments, before the method
    runs: an async actor has no event loop to block yet, so Ray's warning does not apply."""
    import ray
    from ray._private import worker

    warned = getattr(worker, "blocking_get_inside_async_warned", None)
    if warned is not None:
        worker.blocking_get_inside_async_warned = True
    try:
        return ray.get(ref)
    finally:
        if warned is not None:
            worker.blocking_get_inside_async_warned = warned


def check_received(how: tuple[Any, ...], copy: Any, site: str, argument: str, ledger: Any) -> Any:
    """The argument a worker's method gets: what it receives of refshare's stored object
    (``how``: ``("get", ref)``, or ``("rebuild", function, arguments)`` for an inline
    skeleton) where a receiver has the same of it as of the by-value ``copy``, else the
    by-value object. Fetching ``copy`` raises what by value raises."""
    by_value = fetched(copy)
    try:
        ours = fetched(how[1]) if how[0] == "get" else how[1](*how[2])
    except Exception as error:
        outcome, reason, ours = MISMATCH, f"rebuilding it failed: {error!r}", None
    else:
        outcome, reason = compared(by_value, ours)
    if outcome == MISMATCH:
        logging.getLogger("refshare").error(
            "refshare verify: %s sent as %s in %s did not reach this worker as by value "
            "(%s); the by-value copy was used",
            type(by_value).__qualname__,
            argument,
            site,
            reason,
        )
    try:
        ledger.record.remote(site, argument, type(by_value).__qualname__, outcome, reason)
    except Exception:  # the driver's count is lost; the method still gets the right value
        logging.getLogger("refshare").debug("cannot report to the driver", exc_info=True)
    return ours if outcome == VERIFIED else by_value


class Ledger:
    """What the workers' checks found, until the driver that made this actor drains it."""

    def __init__(self) -> None:
        self.found: list[tuple[str, str, str, str, str]] = []

    def record(self, site: str, argument: str, kind: str, outcome: str, reason: str) -> None:
        self.found.append((site, argument, kind, outcome, reason))

    def drain(self) -> list[tuple[str, str, str, str, str]]:
        found, self.found = self.found, []
        return found
