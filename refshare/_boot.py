"""``refshare run`` inside each process of the job: what to enable, when, and Ray's workers.

:func:`boot` runs once Ray is imported (``_sitecustomize`` calls it in the driver and in a
local Ray's workers, which inherit the driver's environment; :func:`worker_hook` in the
workers of a cluster the driver connects to). It enables each framework named in
``REFSHARE_RUN_FRAMEWORKS`` once one of its modules has been imported and none is still
importing (so a framework that is not installed costs nothing, and one imported later is
still covered), wraps the ``module:Class.method`` targets of ``REFSHARE_RUN_METHODS`` the
same way, and wraps ``ray.init`` so that a driver connecting to a running cluster gives its
workers this setup through the job's ``runtime_env``. Nothing here stops a program: what
cannot be set up is a warning, and the program runs as it would without refshare.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import sys
import threading
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import wrapt

from . import _env
from ._integrations import FRAMEWORKS, enable
from ._integrations.methods import patch_methods, yielding

logger = logging.getLogger("refshare")

#: What a cluster's workers run at start (``worker_process_setup_hook``).
HOOK = "refshare._boot.worker_hook"


class Method(NamedTuple):
    """A ``module:Owner.method`` target (``module:function`` for a module's function)."""

    module: str
    owner: str
    name: str

    @classmethod
    def parse(cls, text: str) -> Method:
        """Raises ``ValueError`` naming the form expected."""
        module, _, path = text.strip().partition(":")
        owner, _, name = path.rpartition(".")
        parts = [*module.split("."), *path.split(".")]
        if not all(part.isidentifier() for part in parts):
            raise ValueError(
                f"method target {text!r}: expected module:Class.method or module:function, "
                "e.g. my_pkg.workers:WorkerGroup.run"
            )
        return cls(module, owner, name)

    def __str__(self) -> str:
        return f"{self.module}:{self.owner + '.' if self.owner else ''}{self.name}"


_lock = threading.RLock()  # a hook may fire as boot registers it, on its thread
_frameworks: set[str] = set()  # still to enable
_methods: list[Method] = []  # still to wrap
_finished: set[str] = set()  # watched modules whose code has run
_booted = False
_ray_started = False


def boot() -> None:
    """Set this process up as ``REFSHARE_RUN_*`` say, where ``REFSHARE_RUN`` is set.
    Idempotent; never raises."""
    global _booted
    with _lock:
        if _booted or not os.environ.get(_env.RUN):
            return
        _booted = True
        try:
            _frameworks.update(n for n in _env.names(_env.RUN_FRAMEWORKS) if n in FRAMEWORKS)
            for text in _env.names(_env.RUN_METHODS):
                try:
                    _methods.append(Method.parse(text))
                except ValueError as error:
                    logger.warning("refshare run: %s=...: %s, left out", _env.RUN_METHODS, error)
            modules = {t.module for n in _frameworks for layout in FRAMEWORKS[n].layouts
                       for t in layout} | {m.module for m in _methods}  # fmt: skip
            for module in sorted(modules - set(sys.modules)):
                wrapt.register_post_import_hook(_imported, module)
            _patch_ray_init()
        except Exception:
            logger.warning("refshare run: could not set this process up", exc_info=True)
    attempt()


def _imported(module: types.ModuleType) -> None:
    """A watched module's code has run (its import is still marked in progress)."""
    _finished.add(module.__name__)
    attempt()


def _importing(name: str) -> bool:
    """Whether module ``name`` has started importing and not finished."""
    spec = getattr(sys.modules.get(name), "__spec__", None)
    return name not in _finished and bool(getattr(spec, "_initializing", False))


def _ready(name: str) -> bool:
    if name == "__main__":  # the script's classes exist once it runs: from its ray.init on
        return _ray_started
    return name in sys.modules and not _importing(name)


def attempt() -> None:
    """Enable each framework one of whose modules is imported, and wrap each target whose
    module is, unless a module of theirs is still importing (then a later import or the
    first ``ray.init`` tries again)."""
    with _lock:  # taken off the lists here; enabled below, without the lock (imports)
        frameworks = [name for name in sorted(_frameworks) if _framework_ready(name)]
        _frameworks.difference_update(frameworks)
        methods = [method for method in _methods if _ready(method.module)]
        _methods[:] = [method for method in _methods if method not in methods]
    with yielding():  # to a program that enables refshare itself, with its own options
        for name in frameworks:
            try:
                enable(name)  # warns, itself, for what it does not find
            except Exception:
                logger.warning("refshare run: could not enable %r", name, exc_info=True)
        for method in methods:
            try:
                owner: Any = sys.modules[method.module]
                for part in filter(None, method.owner.split(".")):
                    owner = getattr(owner, part)
                patch_methods(owner, method.name)
            except Exception as error:
                logger.warning("refshare run: %s left unwrapped: %s", method, error)


def _framework_ready(name: str) -> bool:
    modules = {t.module for layout in FRAMEWORKS[name].layouts for t in layout}
    loaded = [m for m in modules if m in sys.modules]
    return bool(loaded) and not any(_importing(m) for m in loaded)


# -- Ray's workers ----------------------------------------------------------------------------


def worker_hook() -> None:
    """Ray's ``worker_process_setup_hook`` for the workers of a cluster the driver connects
    to: the same setup, from the ``REFSHARE_*`` variables the job's ``runtime_env`` gives."""
    boot()


class Chain:
    """refshare's worker setup, then the program's own ``worker_process_setup_hook``."""

    def __init__(self, then: Callable[[], object] | str) -> None:
        self.then = then
        name = then if isinstance(then, str) else getattr(then, "__name__", "hook")
        self.__name__ = f"refshare_then_{name}".replace(".", "_")

    def __call__(self) -> None:
        try:
            boot()
        except Exception:  # boot never raises; this is the hook's last guard
            logger.warning("refshare run: worker setup failed", exc_info=True)
        then = self.then
        if isinstance(then, str):
            module, _, name = then.rpartition(".")
            then = getattr(importlib.import_module(module), name)
        then()  # the program's hook: its errors are Ray's to report, as without refshare


def merged_runtime_env(given: Any, env_vars: dict[str, str]) -> dict[str, Any]:
    """``given`` (a ``runtime_env`` dict or ``RuntimeEnv``, or ``None``) with ``env_vars``
    added where it sets none of its own, and refshare's setup hook run before its own."""
    merged = dict(given or {})
    merged["env_vars"] = {**env_vars, **dict(merged.get("env_vars") or {})}
    theirs = merged.get("worker_process_setup_hook")
    merged["worker_process_setup_hook"] = HOOK if theirs is None else Chain(theirs)
    return merged


def _starts_local(address: Any, temp_dir: Any) -> bool:
    """Whether ``ray.init(address)`` starts a new local Ray (whose workers inherit this
    process's environment, ``PYTHONPATH`` included) rather than connect to one."""
    try:
        from ray._private.services import canonicalize_bootstrap_address

        return canonicalize_bootstrap_address(address, temp_dir) is None
    except Exception:  # a Ray that decides elsewhere, or a ray:// address: carry the setup
        return False


def _with_setup(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """``ray.init``'s keyword arguments carrying the setup to a cluster's workers, or
    ``None`` where there is nothing to carry (a new local Ray, Ray already started)."""
    import ray

    address = args[0] if args else kwargs.get("address")
    if ray.is_initialized() or _starts_local(address, kwargs.get("_temp_dir")):
        return None
    env = {k: v for k, v in os.environ.items() if k.startswith("REFSHARE_")}
    given = kwargs.get("runtime_env")
    job_config = kwargs.get("job_config")
    if given is None and job_config is not None:
        given = job_config.runtime_env or None  # ray.init's runtime_env would replace it
    return {**kwargs, "runtime_env": merged_runtime_env(given, env)}


def _patch_ray_init() -> None:
    import ray

    original = ray.init
    if getattr(original, "_refshare_run", False):
        return

    @functools.wraps(original)
    def init(*args: Any, **kwargs: Any) -> Any:
        global _ray_started
        try:
            changed = _with_setup(args, kwargs)
        except Exception:
            logger.warning("refshare run: cannot set up Ray's workers", exc_info=True)
            changed = None
        if changed is None:
            result = original(*args, **kwargs)
        else:
            try:
                result = original(*args, **changed)
            except Exception as error:
                logger.warning(
                    "refshare run: ray.init refused the runtime_env that sets refshare up in "
                    "the cluster's workers (%s): started again as the program asked, the "
                    "cluster's workers without refshare", error,
                )  # fmt: skip
                if ray.is_initialized():
                    ray.shutdown()
                result = original(*args, **kwargs)
        _ray_started = True
        attempt()
        return result

    init._refshare_run = True  # type: ignore[attr-defined]
    ray.init = init
