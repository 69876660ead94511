"""share large, repeated Ray task arguments by reference, with one decorator."""

from . import _batches  # noqa: F401  (registers the batch types, lazily)
from ._cache import RefCache
from ._fingerprint import fingerprint, register_fingerprint
from ._frameworks import disable, enable, worker_setup
from ._methods import patch_methods, unpatch_methods
from ._patch import install, is_installed, uninstall
from ._scope import clear, share, shared_args, sharing
from ._sizing import estimate_size, register_size
from ._stats import Stats, enable_metrics, reset_stats, stats

__version__ = "0.1.0"

__all__ = [
    "RefCache",
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
    "reset_stats",
    "share",
    "shared_args",
    "sharing",
    "stats",
    "uninstall",
    "unpatch_methods",
    "worker_setup",
]
