"""SkyRL's own batch module from its wheel, on every Python the suite runs on.

SkyRL 0.4.0 asks for Python 3.12: its ``skyrl.backends`` package imports, in its
``__init__``, the Tinker engine, whose pydantic models need 3.12's ``TypedDict``. The batch
module (``skyrl.backends.skyrl_train.training_batch``) and the dispatch module run on 3.11
as they are. Where that ``__init__`` cannot import, a bare package stands in for
``skyrl.backends`` in the test process and in its Ray workers (the suite's Ray runs
:func:`stand_in` at each worker's start), so that its submodules load from the wheel
unchanged. The tests alone do this, never refshare.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

PACKAGE = "skyrl.backends"


def installed() -> bool:
    """Whether the ``skyrl`` package is installed."""
    return importlib.util.find_spec("skyrl") is not None


def stand_in() -> None:
    """Make ``skyrl.backends``' submodules importable: its own ``__init__`` where it imports,
    else a bare package over the same directory. Does nothing without SkyRL."""
    if PACKAGE in sys.modules or not installed():
        return
    try:
        importlib.import_module(PACKAGE)
    except Exception:  # Python < 3.12: the Tinker engine's pydantic models refuse it
        sys.modules.pop(PACKAGE, None)
        spec = importlib.util.find_spec("skyrl")
        assert spec is not None and spec.submodule_search_locations is not None
        package = types.ModuleType(PACKAGE)
        package.__path__ = [f"{spec.submodule_search_locations[0]}/backends"]
        sys.modules[PACKAGE] = package
