"""The options of a decorator, a ``sharing`` block, ``enable`` or ``patch_methods``: checked
once, where they are given."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ._cache import RefCache, process_cache

#: Ray's own inline limit: smaller arguments travel inside the task message and are not
#: stored, so sharing them would only add a put.
DEFAULT_MIN_BYTES = 100 * 1024

CacheOption = bool | RefCache


def _check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r}: pass True or False")


@dataclass(frozen=True)
class Options:
    """Validated options of one decorator or ``sharing`` block (see :func:`shared_args`)."""

    min_bytes: int | None = None
    cache: CacheOption = True
    enabled: bool = True
    reuse_fingerprints: bool = False
    puts: bool = True
    deep: bool | None = None
    verify: bool | Literal["worker"] = False
    audit: bool = False

    def __post_init__(self) -> None:
        min_bytes = self.min_bytes
        if min_bytes is None:
            object.__setattr__(self, "min_bytes", DEFAULT_MIN_BYTES)
        elif isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(
                f"min_bytes={min_bytes!r}: pass a whole number of bytes >= 0 "
                f"(the default, None, is {DEFAULT_MIN_BYTES})"
            )
        if not isinstance(self.cache, (bool, RefCache)):
            raise TypeError(
                f"cache={self.cache!r}: pass True (the process-wide cache), False (share "
                "within one call only) or a refshare.RefCache"
            )
        for name in ("enabled", "reuse_fingerprints", "puts", "audit"):
            _check_flag(name, getattr(self, name))
        if not (isinstance(self.verify, bool) or self.verify == "worker"):
            raise TypeError(
                f"verify={self.verify!r}: pass False, True (checked on the driver) or "
                "'worker' (checked on the workers that receive each argument)"
            )
        if self.deep is not None and not isinstance(self.deep, bool):
            raise TypeError(
                f"deep={self.deep!r}: pass None (the default: split where it pays), True or False"
            )

    @property
    def threshold(self) -> int:
        """``min_bytes``, resolved."""
        assert self.min_bytes is not None
        return self.min_bytes

    @property
    def ref_cache(self) -> RefCache | None:
        """The cache these options share through, or ``None`` for one call only."""
        if self.cache is True:
            return process_cache()
        return self.cache if isinstance(self.cache, RefCache) else None

    def spec(self) -> dict[str, Any]:
        """The options as keyword arguments, for another process: a cache of your own
        becomes that process's own cache there."""
        return {
            "min_bytes": self.min_bytes,
            "cache": self.cache if isinstance(self.cache, bool) else True,
            "enabled": self.enabled,
            "reuse_fingerprints": self.reuse_fingerprints,
            "puts": self.puts,
            "deep": self.deep,
            "verify": self.verify,
            "audit": self.audit,
        }
