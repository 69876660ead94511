"""The options of a decorator, a ``sharing`` block, ``enable`` or ``patch_methods``: declared
once here, checked once, where they are given.

Each option is a field of :class:`Options` with its default and its check; the fields also
make the signatures ``help()`` shows for ``shared_args`` and ``sharing`` (see :func:`signed`)
and what another process rebuilds the options from (:meth:`Options.spec`).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import field
from typing import Any, Literal, TypeVar

from ._cache import RefCache, process_cache

#: Ray's own inline limit: smaller arguments travel inside the task message and are not
#: stored, so sharing them would only add a put.
DEFAULT_MIN_BYTES = 100 * 1024

CacheOption = bool | RefCache
Check = Callable[[str, Any], None]


def _flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r}: pass True or False")


def _min_bytes(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(
            f"{name}={value!r}: pass a whole number of bytes >= 0 "
            f"(the default, None, is {DEFAULT_MIN_BYTES})"
        )


def _cache(name: str, value: Any) -> None:
    if not isinstance(value, (bool, RefCache)):
        raise TypeError(
            f"{name}={value!r}: pass True (the process-wide cache), False (share "
            "within one call only) or a refshare.RefCache"
        )


def _verify(name: str, value: Any) -> None:
    if not (isinstance(value, bool) or value == "worker"):
        raise TypeError(
            f"{name}={value!r}: pass False, True (checked on the driver) or 'worker' "
            "(checked on the workers that receive each argument)"
        )


def _deep(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, bool):
        raise TypeError(
            f"{name}={value!r}: pass None (the default: split where it pays), True or False"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """Validated options of one decorator or ``sharing`` block (see :func:`shared_args`)."""

    min_bytes: int | None = field(default=None, metadata={"check": _min_bytes})
    cache: CacheOption = field(default=True, metadata={"check": _cache})
    enabled: bool = field(default=True, metadata={"check": _flag})
    reuse_fingerprints: bool = field(default=False, metadata={"check": _flag})
    puts: bool = field(default=True, metadata={"check": _flag})
    deep: bool | None = field(default=None, metadata={"check": _deep})
    verify: bool | Literal["worker"] = field(default=False, metadata={"check": _verify})
    audit: bool = field(default=False, metadata={"check": _flag})

    def __post_init__(self) -> None:
        for option in dataclasses.fields(self):
            option.metadata["check"](option.name, getattr(self, option.name))

    @property
    def threshold(self) -> int:
        """``min_bytes``, resolved."""
        return DEFAULT_MIN_BYTES if self.min_bytes is None else self.min_bytes

    @property
    def ref_cache(self) -> RefCache | None:
        """The cache these options share through, or ``None`` for one call only."""
        if self.cache is True:
            return process_cache()
        return self.cache if isinstance(self.cache, RefCache) else None

    def spec(self) -> dict[str, Any]:
        """The options as keyword arguments, for another process: a cache of your own
        becomes that process's own cache there."""
        spec = {option.name: getattr(self, option.name) for option in dataclasses.fields(self)}
        if not isinstance(self.cache, bool):
            spec["cache"] = True
        return spec


_F = TypeVar("_F", bound=Callable[..., Any])


def signed(function: _F) -> _F:
    """Give ``function``, which takes the options as ``**options``, a signature naming each
    option with its default, for ``help()`` and editors."""
    signature = inspect.signature(function)
    kept = [p for p in signature.parameters.values() if p.kind != p.VAR_KEYWORD]
    options = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default)
        for f in dataclasses.fields(Options)
    ]
    function.__signature__ = signature.replace(parameters=kept + options)  # type: ignore[attr-defined]
    return function
