"""Shared pieces of the reliability suite: marked payloads, a worker that describes exactly
what it received, and checks that compare a decorated call with the same call by value."""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import ray

import refshare

MiB = 1 << 20


def marked(marker: int, nbytes: int) -> np.ndarray:
    """An int64 array of ``nbytes`` whose every element is ``marker``: a per-call signature
    that the worker reads back from the content it actually received."""
    return np.full(nbytes // 8, marker, dtype=np.int64)


def _order(arr: np.ndarray) -> str:
    if arr.flags.c_contiguous:
        return "C"
    return "F" if arr.flags.f_contiguous else "N"


def describe(value: Any, _path: tuple[int, ...] = ()) -> Any:
    """What a process sees in ``value``: types, dtypes, shapes, layout and a checksum of every
    byte, recursively; cycles are named by the depth they point back to."""
    if id(value) in _path:
        return ("cycle", _path.index(id(value)))
    path = (*_path, id(value))
    if isinstance(value, np.ndarray):
        head = (type(value).__qualname__, value.dtype.str, repr(value.dtype), value.shape)
        extra = tuple(sorted((k, repr(v)) for k, v in getattr(value, "__dict__", {}).items()))
        if value.dtype.hasobject:
            return (*head, extra, describe(value.tolist(), path))
        return (*head, extra, _order(value), zlib.crc32(value.tobytes()))
    if isinstance(value, (bytes, bytearray)):
        return (type(value).__name__, len(value), zlib.crc32(value))
    if isinstance(value, memoryview):
        return ("memoryview", value.format, value.shape, zlib.crc32(value.tobytes()))
    if isinstance(value, str):
        return ("str", len(value), zlib.crc32(value.encode("utf-8", "surrogatepass")))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [describe(item, path) for item in value])
    if isinstance(value, dict):
        return ("dict", [(repr(k), describe(v, path)) for k, v in value.items()])
    if isinstance(value, ray.ObjectRef):
        return ("ObjectRef", describe(ray.get(value, timeout=60), path))
    if isinstance(value, ray.actor.ActorHandle):
        return ("ActorHandle",)
    if isinstance(value, (int, float, complex, bool, type(None))):
        return (type(value).__name__, value)
    state = getattr(value, "__dict__", None)
    if isinstance(state, dict):
        return (type(value).__qualname__, describe(state, path))
    return (type(value).__qualname__, repr(value)[:80])


def describe_args(*args: Any) -> Any:
    """:func:`describe` of every argument a worker received."""
    return describe(args)


def marker_of(value: np.ndarray) -> int:
    """The marker a worker finds in a :func:`marked` array."""
    return int(value[0]) if value.size else -1


def summary(*arrays: np.ndarray) -> list[tuple[int, int, int]]:
    """Per array: marker, element count and checksum, cheap enough for large payloads."""
    return [(marker_of(a), a.size, zlib.crc32(np.ascontiguousarray(a))) for a in arrays]


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
