"""``refshare run``'s start-up hook: refshare turns on in this Python process when it imports Ray.

``refshare run`` puts this directory first on ``PYTHONPATH`` (as ``opentelemetry-instrument``
does), so Python runs this file at the start of the program and of every Python process that
inherits its environment: a local Ray's workers among them. Most of those never import Ray
(a compiler's workers, a ``pip``), so this file imports nothing but the standard library:
it asks to be told when Ray is imported, and only then imports ``refshare._boot``. Then it
runs the ``sitecustomize`` it hides, if there is one further on the path. Nothing here may
stop a program: whatever fails is one line on standard error.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from typing import Any

#: Set by ``refshare run``; without it this file does nothing but run the one it hides.
RUN_ENV = "REFSHARE_RUN"
#: Where ``refshare run`` found refshare, for a program whose path does not reach it.
ROOT_ENV = "REFSHARE_RUN_ROOT"


def _warn(what: str, error: BaseException) -> None:
    sys.stderr.write(f"refshare run: {what} ({type(error).__name__}: {error}); "
                     "this process runs without refshare\n")  # fmt: skip


def _boot() -> None:
    refshare = sys.modules.get("refshare")
    if getattr(getattr(refshare, "__spec__", None), "_initializing", False):
        return  # importing refshare imported Ray: refshare boots once it is whole
    try:
        from refshare._boot import boot

        boot()
    except Exception as error:
        _warn("cannot turn refshare on", error)


class _ThenBoot:
    """Ray's own loader, then ``_boot`` once Ray's top module has run."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        module.__loader__ = module.__spec__.loader = self._loader  # leave no trace
        _boot()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _WhenRayImported:
    """A finder that finds nothing itself: for ``ray``, it asks the others and wraps the
    loader they give, once."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "ray":
            return None
        sys.meta_path.remove(self)
        spec: Any = importlib.util.find_spec(name)
        if spec is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenBoot(spec.loader)
        return spec


def _watch() -> None:
    if not os.environ.get(RUN_ENV):
        return
    try:
        root = os.environ.get(ROOT_ENV)
        if root and importlib.util.find_spec("refshare") is None:
            sys.path.append(root)  # last: it shadows nothing the program finds
        if "ray" in sys.modules:
            _boot()
        else:
            sys.meta_path.insert(0, _WhenRayImported())
    except Exception as error:
        _warn("cannot watch for Ray's import", error)


def _run_hidden() -> None:
    """Run the ``sitecustomize`` this one hides (a distribution's, a virtualenv's)."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


_watch()
_run_hidden()
