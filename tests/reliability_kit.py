"""Shared pieces of the reliability suite: marked payloads, a worker that describes exactly
what it received (the shared describer), and checks that compare a decorated call with the
same call by value."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import ray
from differential_kit import checksums as summary  # noqa: F401 (the suite's name for it)
from differential_kit import describe_fully as describe

import refshare

MiB = 1 << 20


def marked(marker: int, nbytes: int) -> np.ndarray:
    """An int64 array of ``nbytes`` whose every element is ``marker``: a per-call signature
    in the content the worker actually received (its ``summary`` differs per marker)."""
    return np.full(nbytes // 8, marker, dtype=np.int64)


def describe_args(*args: Any) -> Any:
    """:func:`describe` of every argument a worker received."""
    return describe(args)


@ray.remote(num_cpus=0.1)
class Sink:
    """Applies a module-level function to what it received and returns the result."""

    def apply(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    def later(self, delay: float, fn: Callable[..., Any], *args: Any) -> Any:
        """Sleep first, so the arguments stay in flight while the driver goes on."""
        time.sleep(delay)
        return fn(*args)

    def ping(self) -> bool:
        return True


def sinks(n: int) -> list[Any]:
    """``n`` ready Sink actors (each takes a tenth of a CPU)."""
    group = [Sink.remote() for _ in range(n)]
    ray.get([s.ping.remote() for s in group], timeout=120)
    return group


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    """``("ok", result)`` or ``("raised", exception type name)``."""
    try:
        return "ok", call()
    except Exception as error:
        return "raised", type(error).__name__


def by_value_and_shared(
    call: Callable[[], Any], **options: Any
) -> tuple[tuple[str, Any], tuple[str, Any]]:
    """The outcome of ``call`` without refshare, then inside a decorated call."""
    return outcome(call), outcome(refshare.shared_args(**options)(call))


def assert_cache_consistent(cache: refshare.RefCache) -> None:
    """Within budget, and every ref in the cache holds content with exactly its key."""
    assert cache.nbytes <= cache.max_bytes
    assert (cache.nbytes == 0) == (len(cache) == 0)
    for key in list(cache):
        ref = cache.get(key)
        if ref is not None:
            assert refshare.fingerprint(ray.get(ref, timeout=60)) == key
