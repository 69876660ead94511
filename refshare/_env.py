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
#: Set by ``refshare run`` in every process of the job it runs (see ``_boot``, ``_cli``):
RUN = "REFSHARE_RUN"  #: "1"
RUN_FRAMEWORKS = "REFSHARE_RUN_FRAMEWORKS"  #: the frameworks to enable, comma-separated
RUN_METHODS = "REFSHARE_RUN_METHODS"  #: ``module:Class.method`` targets, comma-separated
RUN_ROOT = "REFSHARE_RUN_ROOT"  #: where refshare is, for a program whose path misses it
JOB = "REFSHARE_JOB"  #: which job the process belongs to, in the report directory

_ON = frozenset(("1", "true", "yes", "on"))
_OFF = frozenset(("", "0", "false", "no", "off"))


def value(name: str) -> str:
    """The switch's value, stripped and lower-cased; empty when it is not set."""
    return os.environ.get(name, "").strip().lower()


def on(name: str) -> bool:
    """Whether the switch is on: ``1``, ``true``, ``yes`` or ``on``, in any case."""
    return value(name) in _ON


def names(name: str) -> list[str]:
    """The switch's comma-separated names, stripped (as set: not lower-cased)."""
    return [part.strip() for part in os.environ.get(name, "").split(",") if part.strip()]


def directory(name: str) -> str | None:
    """The directory the switch names; ``None`` when it is unset, on or off (for
    ``REFSHARE_REPORT``, ``1`` means "print at exit", not a directory)."""
    found = os.environ.get(name, "").strip()
    return None if found.lower() in _ON | _OFF else found


def mode(name: str) -> str:
    """A switch that is off (``""``), on (``"1"``) or names a mode (``"worker"``)."""
    found = value(name)
    if found in _OFF:
        return ""
    return "1" if found in _ON else found
