"""enable() and disable(): refshare on the worker groups of RL frameworks, as installed.

Each framework has a module of its own here, naming for its current release the methods
whose one call makes all the puts and ``.remote()`` calls of one fan-out, and the batch
types it sends; ``enable`` wraps those methods with ``patch_methods``. Nothing of a
framework is imported until it is asked for.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

from .. import _env
from .._options import Options
from . import nemo_rl, openrlhf, roll, skyrl, verl
from . import tensordict as tensordict  # registers TensorDict's fingerprint
from .framework import Framework
from .methods import patch_methods, unpatch_methods

logger = logging.getLogger("refshare")

#: Comma-separated framework names that :func:`worker_setup` enables.
ENABLE_ENV = _env.ENABLE

#: What ``enable`` knows, by name.
FRAMEWORKS: dict[str, Framework] = {
    module.FRAMEWORK.name: module.FRAMEWORK for module in (verl, nemo_rl, openrlhf, skyrl, roll)
}
#: framework name -> the (owner, method) pairs enable() wrapped.
_enabled: dict[str, list[tuple[Any, str]]] = {}


def _check_names(frameworks: tuple[str, ...]) -> None:
    unknown = [name for name in frameworks if name not in FRAMEWORKS]
    if unknown:
        raise ValueError(
            f"unknown framework {', '.join(map(repr, unknown))}: refshare knows "
            f"{', '.join(map(repr, FRAMEWORKS))}. For another worker group, use "
            "refshare.patch_methods(YourGroup, 'method', ...)"
        )


def _resolve(framework: Framework) -> list[tuple[Any, tuple[str, ...]]] | str:
    """The owners and methods to wrap, or what is missing, as a sentence."""
    problems = []
    for layout in framework.layouts:
        found: list[tuple[Any, tuple[str, ...]]] = []
        try:
            for target in layout:
                module = importlib.import_module(target.module)
                owner = getattr(module, target.owner) if target.owner else module
                missing = [m for m in target.methods if not hasattr(owner, m)]
                if missing:
                    where = f"{target.module}.{target.owner}" if target.owner else target.module
                    raise AttributeError(f"{where} has no {', '.join(missing)}")
                found.append((owner, target.methods))
        except Exception as error:  # ImportError, AttributeError, or the module's own
            problems.append(f"{type(error).__name__}: {error}")
            continue
        return found
    return "; ".join(dict.fromkeys(problems))  # layouts in one module fail alike: say it once


def enable(*frameworks: str, **options: Any) -> list[str]:
    """Turn refshare on for the worker groups of ``frameworks``, as installed.

    Names: ``"verl"``, ``"nemo_rl"``, ``"openrlhf"``, ``"skyrl"``, ``"roll"``. Each one's fan-out
    methods are wrapped with ``shared_args(**options)``, so the framework's own
    ``ray.put`` calls and ``.remote()`` arguments are stored once by content, across
    groups and calls. Idempotent; undone by :func:`disable`. A framework that is not
    installed, or whose methods are not where refshare expects them, gets one warning
    naming what is missing and is left unchanged. Returns the ``Class.method`` names
    wrapped. Raises ``ValueError`` for an unknown name, and the errors of
    :func:`shared_args` for bad options, before changing anything.
    """
    _check_names(frameworks)
    Options(**options)  # bad options fail here, before anything is patched
    wrapped: list[str] = []
    for name in frameworks:
        framework = FRAMEWORKS[name]
        found = _resolve(framework)
        if isinstance(found, str):
            logger.warning(
                "refshare.enable(%r): left unchanged, %s (refshare knows %s's layout)",
                name,
                found,
                framework.release,
            )
            continue
        done = _enabled.setdefault(name, [])
        for owner, methods in found:
            wrapped.extend(patch_methods(owner, *methods, **options))
            done.extend((owner, method) for method in methods if (owner, method) not in done)
    return wrapped


def disable(*frameworks: str) -> list[str]:
    """Undo :func:`enable` for ``frameworks`` (all enabled ones, if none are given)."""
    _check_names(frameworks)
    restored: list[str] = []
    for name in frameworks or tuple(_enabled):
        for owner, method in _enabled.pop(name, []):
            restored.extend(unpatch_methods(owner, method))
    return restored


def worker_setup() -> None:
    """Enable the frameworks named in ``REFSHARE_ENABLE`` (comma-separated).

    Meant as Ray's ``worker_process_setup_hook``, for trainers whose controller runs in an
    actor (verl's ``TaskRunner``), where a patch made in the driver script never runs::

        ray.init(runtime_env={
            "worker_process_setup_hook": "refshare.worker_setup",
            "env_vars": {"REFSHARE_ENABLE": "verl"},
        })

    It never stops a worker from starting: a name it does not know, or a failure to
    enable one, is logged as a warning, and the worker runs without that framework.
    """
    names = _env.names(ENABLE_ENV)
    unknown = [name for name in names if name not in FRAMEWORKS]
    if unknown:
        logger.warning(
            "%s=%r: unknown framework %s, left out (refshare knows %s, comma-separated)",
            ENABLE_ENV,
            os.environ.get(ENABLE_ENV),
            ", ".join(map(repr, unknown)),
            ", ".join(map(repr, FRAMEWORKS)),
        )
    known = tuple(name for name in names if name in FRAMEWORKS)
    if known:
        try:
            enable(*known)
        except Exception:
            logger.warning("%s: could not enable %s", ENABLE_ENV, known, exc_info=True)
