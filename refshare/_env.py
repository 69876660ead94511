"""refshare's environment switches, read in one place."""

from __future__ import annotations

import os

#: 1: every scope is a pass-through.
DISABLE = "REFSHARE_DISABLE"
#: 1: verify mode in every scope.
VERIFY = "REFSHARE_VERIFY"
#: 1: audit mode in every scope.
AUDIT = "REFSHARE_AUDIT"
#: 1: write ``refshare.report()`` to standard error when the process exits.
REPORT = "REFSHARE_REPORT"
#: Comma-separated framework names that ``refshare.worker_setup`` enables.
ENABLE = "REFSHARE_ENABLE"

_ON = frozenset(("1", "true", "yes", "on"))


def value(name: str) -> str:
    """The switch's value, stripped and lower-cased; empty when it is not set."""
    return os.environ.get(name, "").strip().lower()


def on(name: str) -> bool:
    """Whether the switch is on: ``1``, ``true``, ``yes`` or ``on``, in any case."""
    return value(name) in _ON
