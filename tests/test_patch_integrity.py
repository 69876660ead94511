"""install/uninstall round trips, other wrappers stacked on top of refshare's, and toggling
while calls run: Ray's methods are restored exactly, nobody's wrapper is lost, and every
worker still receives the right data."""

from __future__ import annotations

import functools
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import ray
import ray.actor
import ray.remote_function
import wrapt
from ray import cloudpickle
from reliability_kit import MiB, marked, sinks, summary

import refshare

pytestmark = pytest.mark.usefixtures("local_ray", "fresh")

CLASSES = (ray.actor.ActorMethod, ray.remote_function.RemoteFunction, ray.actor.ActorClass)


def current() -> dict[type, Any]:
    return {cls: cls.__dict__["_remote"] for cls in CLASSES}


def identical(a: dict[type, Any], b: dict[type, Any]) -> bool:
    """The very same objects (``==`` would not do: a wrapt proxy equals what it wraps)."""
    return all(a[cls] is b[cls] for cls in CLASSES)


@pytest.fixture(autouse=True)
def restore_targets() -> Iterator[dict[type, Any]]:
    """refshare installed, its wrappers on top again afterwards, whatever a test stacked."""
    refshare.install()
    installed = current()
    yield installed
    refshare.uninstall()
    for cls, attribute in installed.items():
        cls._remote = attribute
    refshare.install()
    assert identical(current(), installed)


@ray.remote(num_cpus=0.1)
class Holder:
    def __init__(self, data: Any) -> None:
        self.received = summary(data)

    def get(self) -> Any:
        return self.received


@ray.remote(num_cpus=0.1)
def summarize(data: Any) -> Any:
    return summary(data)


@pytest.fixture(scope="module")
def sink(local_ray: None) -> Any:
    return sinks(1)[0]


def every_path(sink: Any, data: Any) -> list[Any]:
    """Actor creation, an actor method and a task, each sent ``data``."""
    holder = Holder.remote(data)
    results = ray.get(
        [holder.get.remote(), sink.apply.remote(summary, data), summarize.remote(data)],
        timeout=120,
    )
    ray.kill(holder)
    return results


shared_every_path = refshare.shared_args(every_path)


def shared_counts(sink: Any, marker: int) -> tuple[int, int]:
    """Send a fresh content down every path in a decorated call; return (puts, hits) added."""
    before = refshare.stats()
    data = marked(marker, MiB)
    assert shared_every_path(sink, data) == [summary(data)] * 3
    after = refshare.stats()
    return after.puts - before.puts, after.hits - before.hits


def test_install_uninstall_install_round_trip(sink: Any) -> None:
    refshare.uninstall()
    originals = current()
    assert not any(isinstance(method, wrapt.ObjectProxy) for method in originals.values())

    refshare.install()
    assert all(current()[cls].__wrapped__ is originals[cls] for cls in CLASSES)
    assert shared_counts(sink, 1) == (1, 2)

    refshare.uninstall()
    assert identical(current(), originals)  # exactly Ray's own
    assert not refshare.is_installed()
    assert shared_counts(sink, 2) == (0, 0)  # a decorated call no longer reinstalls

    refshare.install()
    assert refshare.is_installed()
    assert shared_counts(sink, 3) == (1, 2)


def test_uninstall_restores_ray_before_refshare_was_imported() -> None:
    script = """
import ray.actor, ray.remote_function
classes = (ray.actor.ActorMethod, ray.remote_function.RemoteFunction, ray.actor.ActorClass)
before = [c.__dict__["_remote"] for c in classes]
import refshare
assert refshare.install()
assert all(c.__dict__["_remote"] is not b for c, b in zip(classes, before)), "not patched"
refshare.uninstall()
assert all(c.__dict__["_remote"] is b for c, b in zip(classes, before)), "not restored"
print("ok")
"""
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert run.stdout.strip() == "ok", run.stderr[-2000:]


def counting_wrapper(calls: list[str]) -> Callable[..., Any]:
    def wrapper(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        calls.append(type(instance).__name__)
        return wrapped(*args, **kwargs)

    return wrapper


def test_a_wrapt_wrapper_on_top_survives_uninstall_and_install(sink: Any) -> None:
    calls: list[str] = []
    for path in ("actor.ActorMethod._remote", "remote_function.RemoteFunction._remote"):
        module, _, name = path.rpartition(".")[0].partition(".")
        wrapt.wrap_function_wrapper(f"ray.{module}", f"{name}._remote", counting_wrapper(calls))
    theirs = current()
    wrapped = (ray.actor.ActorMethod, ray.remote_function.RemoteFunction)

    refshare.uninstall()
    assert all(current()[cls] is theirs[cls] for cls in wrapped)  # left in place
    assert isinstance(theirs[ray.actor.ActorClass], wrapt.FunctionWrapper)
    assert not isinstance(current()[ray.actor.ActorClass], wrapt.ObjectProxy)  # Ray's own
    assert shared_counts(sink, 4) == (0, 0)  # refshare's layer beneath passes through
    assert calls == ["ActorMethod", "ActorMethod", "RemoteFunction"]  # 2 actor calls, 1 task

    refshare.install()
    assert identical(current(), theirs)  # not clobbered
    assert shared_counts(sink, 5) == (1, 2)  # and sharing again beneath it
    assert len(calls) == 6


def plain_wrapper(cls: type, calls: list[str], *, wraps: bool) -> Callable[..., Any]:
    """A hand-written patch that calls the attribute it replaced, as many libraries do."""
    previous = cls._remote  # type: ignore[attr-defined]

    def _remote(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(cls.__name__)
        return previous(self, *args, **kwargs)

    return functools.wraps(previous)(_remote) if wraps else _remote


def stack_plain_wrappers(wraps: bool) -> tuple[list[str], Any]:
    """Put a plain wrapper on top of each submit method; return its call log and them."""
    calls: list[str] = []
    for cls in CLASSES:
        cls._remote = plain_wrapper(cls, calls, wraps=wraps)  # type: ignore[attr-defined]
    return calls, current()


@pytest.mark.parametrize("wraps", [True, False], ids=["functools.wraps", "bare"])
def test_a_plain_wrapper_on_top_survives_uninstall(sink: Any, wraps: bool) -> None:
    calls, theirs = stack_plain_wrappers(wraps)
    assert shared_counts(sink, 6) == (1, 2)  # refshare beneath theirs

    refshare.uninstall()
    assert identical(current(), theirs)
    assert shared_counts(sink, 7) == (0, 0)
    assert len(calls) == 8  # 4 submissions per round: creation, 2 actor calls, a task


@pytest.mark.parametrize("wraps", [True, False], ids=["functools.wraps", "bare"])
def test_a_plain_wrapper_on_top_survives_install(sink: Any, wraps: bool) -> None:
    calls, theirs = stack_plain_wrappers(wraps)
    refshare.uninstall()
    refshare.install()
    assert shared_counts(sink, 9) == (1, 2)
    assert len(calls) == 4
    assert identical(current(), theirs)


def test_a_wrapper_calling_the_raw_class_attribute_still_shares(sink: Any) -> None:
    raw = ray.actor.ActorMethod.__dict__["_remote"]

    def _remote(self: Any, *args: Any, **kwargs: Any) -> Any:
        return raw(self, *args, **kwargs)

    ray.actor.ActorMethod._remote = _remote
    data = marked(10, MiB)

    @refshare.shared_args
    def send() -> Any:
        return ray.get(sink.apply.remote(summary, data), timeout=60)

    assert send() == summary(data)  # right data either way
    assert refshare.stats().puts == 1


def test_uninstall_in_the_middle_of_a_decorated_call(sink: Any) -> None:
    first, second = marked(11, MiB), marked(12, MiB)

    @refshare.shared_args
    def both() -> list[Any]:
        a = sink.apply.remote(summary, first)
        refshare.uninstall()
        b = sink.apply.remote(summary, second)
        return ray.get([a, b], timeout=60)

    assert both() == [summary(first), summary(second)]
    assert refshare.stats().puts == 1  # the first only


def test_toggling_while_other_threads_call(sink: Any) -> None:
    stop = threading.Event()
    results: list[tuple[int, Any]] = []

    @refshare.shared_args
    def send(marker: int) -> Any:
        return ray.get(sink.apply.remote(summary, marked(marker, 256 * 1024)), timeout=60)

    def caller(offset: int) -> None:
        marker = offset
        while not stop.is_set() and marker < offset + 30:
            results.append((marker, send(marker)))
            marker += 1

    threads = [threading.Thread(target=caller, args=(1000 * i,)) for i in range(1, 4)]
    for thread in threads:
        thread.start()
    for _ in range(40):
        refshare.uninstall()
        refshare.install()
    stop.set()
    for thread in threads:
        thread.join(timeout=60)
    assert results and all(r == summary(marked(m, 256 * 1024)) for m, r in results)


def test_a_decorated_function_survives_cloudpickle() -> None:
    @refshare.shared_args
    def body() -> None:
        return None

    shipped = cloudpickle.loads(cloudpickle.dumps(body))
    assert isinstance(shipped, wrapt.FunctionWrapper)
