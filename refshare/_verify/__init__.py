"""Verify mode: what receivers get of each send by ref, compared with what Ray by value gives.

``received`` describes a received object graph (it runs on the workers too), ``driver``
makes the by-value copy of each send and compares on the driver, ``worker`` compares on the
workers (``verify="worker"``). See docs/guarantees.md, "Verify mode".
"""

from __future__ import annotations

from .driver import ON_WORKER, Mode, Verdict, verifier, verify_by_env
from .worker import MISMATCH, UNVERIFIED, VERIFIED

__all__ = [
    "MISMATCH",
    "ON_WORKER",
    "UNVERIFIED",
    "VERIFIED",
    "Mode",
    "Verdict",
    "verifier",
    "verify_by_env",
]
