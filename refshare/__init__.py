"""Share large, repeated Ray task arguments by reference, with one decorator."""

from . import (
    _boot,
    _job,  # noqa: F401  (writes each process's report where REFSHARE_REPORT says)
)
from ._api import clear, share, shared_args, sharing
from ._cache import RefCache
from ._integrations import disable, enable, worker_setup
from ._integrations.methods import patch_methods, unpatch_methods
from ._keys import fingerprint
from ._keys.sizes import estimate_size, register_size
from ._keys.tables import register_fingerprint
from ._ray.submit import install, is_installed, uninstall
from ._report import Report, Row, report, reset_report
from ._stats import Stats, enable_metrics, reset_stats, stats

__version__ = "0.1.0"

_boot.boot()  # under ``refshare run``, where importing refshare imported Ray (a no-op else)

__all__ = [
    "RefCache",
    "Report",
    "Row",
    "Stats",
    "__version__",
    "clear",
    "disable",
    "enable",
    "enable_metrics",
    "estimate_size",
    "fingerprint",
    "install",
    "is_installed",
    "patch_methods",
    "register_fingerprint",
    "register_size",
    "report",
    "reset_report",
    "reset_stats",
    "share",
    "shared_args",
    "sharing",
    "stats",
    "uninstall",
    "unpatch_methods",
    "worker_setup",
]
