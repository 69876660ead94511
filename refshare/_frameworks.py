"""enable() and disable(): refshare on the worker groups of RL frameworks, as installed.

Each framework's entry names, for its current release, the methods whose one call makes
all the puts and ``.remote()`` calls of one fan-out; ``enable`` wraps them with
``patch_methods``. Nothing is imported until asked for.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any, NamedTuple

from ._methods import patch_methods, unpatch_methods
from ._scope import Options

logger = logging.getLogger("refshare")

#: Comma-separated framework names that :func:`worker_setup` enables.
ENABLE_ENV = "REFSHARE_ENABLE"


class Target(NamedTuple):
    """Methods of one class (or functions of one module, when ``owner`` is empty)."""

    module: str
    owner: str
    methods: tuple[str, ...]


#: Per framework: the release its targets were read from, and the targets. Where a
#: framework moved its code, each alternative is a tuple of targets; the first whose
#: module imports is used.
FRAMEWORKS: dict[str, tuple[str, tuple[tuple[Target, ...], ...]]] = {
    "verl": (
        "verl 0.9.1",
        (
            (
                # Every by-value fan-out (ONE_TO_ALL, DP_COMPUTE_PROTO, ...) ends here.
                Target("verl.single_controller.ray.base", "RayWorkerGroup", ("execute_all_async",)),
                # The nd-compute dispatch puts each chunk from a thread pool here.
                Target("verl.utils.ray_utils", "", ("parallel_put",)),
            ),
        ),
    ),
    "nemo_rl": (
        "NeMo-RL main (2026-08)",
        (
            (
                Target(
                    "nemo_rl.distributed.worker_groups",
                    "RayWorkerGroup",
                    (
                        "run_all_workers_single_data",
                        "run_all_workers_multiple_data",
                        "run_all_workers_sharded_data",
                        "run_single_worker_single_data",
                    ),
                ),
            ),
        ),
    ),
    "openrlhf": (
        "OpenRLHF 0.11.2",
        (
            (
                Target(
                    "openrlhf.trainer.ray.launcher",
                    "RayActorGroup",
                    ("async_run_method_batch", "async_run_method"),
                ),
            ),
        ),
    ),
    "skyrl": (
        "SkyRL 0.3.0 to 0.4.0",
        (
            (
                Target(
                    "skyrl.backends.skyrl_train.workers.worker",
                    "PPORayActorGroup",
                    ("async_run_ray_method",),
                ),
            ),
            (  # the older skyrl-train package
                Target(
                    "skyrl_train.workers.worker",
                    "PPORayActorGroup",
                    ("async_run_ray_method", "run_method"),
                ),
            ),
        ),
    ),
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


def _resolve(name: str) -> list[tuple[Any, tuple[str, ...]]] | str:
    """The owners and methods to wrap for ``name``, or what is missing, as a sentence."""
    problems = []
    for alternative in FRAMEWORKS[name][1]:
        found: list[tuple[Any, tuple[str, ...]]] = []
        try:
            for target in alternative:
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
    return "; ".join(problems)


def enable(*frameworks: str, **options: Any) -> list[str]:
    """Turn refshare on for the worker groups of ``frameworks``, as installed.

    Names: ``"verl"``, ``"nemo_rl"``, ``"openrlhf"``, ``"skyrl"``. Each one's fan-out
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
        found = _resolve(name)
        if isinstance(found, str):
            logger.warning(
                "refshare.enable(%r): left unchanged, %s (refshare knows %s's layout)",
                name,
                found,
                FRAMEWORKS[name][0],
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
    names = [n.strip() for n in os.environ.get(ENABLE_ENV, "").split(",") if n.strip()]
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
