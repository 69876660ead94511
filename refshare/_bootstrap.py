"""The first code a worker runs for a deep-shared argument; shipped by value.

Ray's cloudpickle sends this module's functions as code, so a worker without refshare
still runs them, and fails with one line that says what to do instead of a bare
``ModuleNotFoundError`` from deep inside Ray. Keep it free of imports from refshare.
"""

from __future__ import annotations

from typing import Any

MISSING = (
    "this argument was deep-shared by refshare, which the Ray worker cannot import ({}): "
    "install refshare where the workers run (the driver's environment, or "
    "runtime_env={{'pip': ['refshare']}}), or turn deep sharing off (deep=False)"
)


def rebuild(*parts: Any) -> Any:
    """Rebuild a deep-shared argument with refshare's own code on the worker."""
    try:
        from refshare._deep import rebuild_skeleton
    except ImportError as error:
        raise ImportError(MISSING.format(error)) from None
    return rebuild_skeleton(*parts)
