"""The decorator and the sharing() block: shapes they wrap, what survives, bad options."""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
from typing import Any

import numpy as np
import pytest
import ray
from helpers import receive

import refshare

BIG = np.zeros(300_000, dtype=np.uint8)


def submit_twice(x: Any) -> Any:
    return ray.get([receive.remote(x), receive.remote(x)])


class Group:
    @refshare.shared_args
    def method(self, x: Any) -> Any:
        """Method docstring."""
        return submit_twice(x)

    @classmethod
    @refshare.shared_args
    def class_method(cls, x: Any) -> Any:
        return submit_twice(x)

    @refshare.shared_args
    @classmethod
    def class_method_outer(cls, x: Any) -> Any:
        return submit_twice(x)

    @staticmethod
    @refshare.shared_args
    def static_method(x: Any) -> Any:
        return submit_twice(x)

    @refshare.shared_args
    @staticmethod
    def static_method_outer(x: Any) -> Any:
        return submit_twice(x)

    @refshare.shared_args(min_bytes=1000)
    async def async_method(self, x: Any) -> Any:
        return await asyncio.gather(receive.remote(x), receive.remote(x))


@refshare.shared_args
def plain(x: Any, *, scale: int = 1) -> Any:
    """Plain docstring."""
    return submit_twice(x)


CALLS = {
    "function": lambda: plain(BIG),
    "method": lambda: Group().method(BIG),
    "classmethod": lambda: Group.class_method(BIG),
    "classmethod (outer)": lambda: Group.class_method_outer(BIG),
    "staticmethod": lambda: Group.static_method(BIG),
    "staticmethod (outer)": lambda: Group.static_method_outer(BIG),
    "staticmethod via instance": lambda: Group().static_method(BIG),
    "async method": lambda: asyncio.run(Group().async_method(BIG)),
}


@pytest.mark.usefixtures("local_ray", "fresh")
@pytest.mark.parametrize("call", list(CALLS), ids=list(CALLS))
def test_every_kind_of_callable_shares(call: str) -> None:
    result = CALLS[call]()
    assert result[0] == result[1] == ray.get(receive.remote(BIG))
    assert refshare.stats().puts == 1 and refshare.stats().hits == 1


def test_signature_name_docstring_and_inspect_survive() -> None:
    assert plain.__name__ == "plain" and plain.__doc__ == "Plain docstring."
    assert str(inspect.signature(plain)) == "(x: 'Any', *, scale: 'int' = 1) -> 'Any'"
    assert Group.method.__qualname__ == "Group.method"
    assert Group().method.__doc__ == "Method docstring."
    assert inspect.iscoroutinefunction(Group.async_method)
    assert inspect.iscoroutinefunction(Group().async_method)
    assert not inspect.iscoroutinefunction(plain)
    assert inspect.isfunction(plain)


@pytest.mark.parametrize("bad", [-1, 1.5, "100KiB", True])
def test_bad_min_bytes_fails_at_decoration(bad: object) -> None:
    with pytest.raises(ValueError, match=r"min_bytes=.*whole number of bytes"):
        refshare.shared_args(min_bytes=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_bytes"):
        refshare.sharing(min_bytes=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [None, 1, "yes", {}])
def test_bad_cache_fails_at_decoration(bad: object) -> None:
    with pytest.raises(TypeError, match=r"cache=.*RefCache"):
        refshare.shared_args(cache=bad)  # type: ignore[arg-type]


def test_bad_enabled_and_bad_targets_fail_at_decoration() -> None:
    with pytest.raises(TypeError, match="enabled"):
        refshare.shared_args(enabled="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="function or method"):
        refshare.shared_args(42)  # type: ignore[type-var]

    def gen() -> Any:
        yield 1

    with pytest.raises(TypeError, match="sharing"):
        refshare.shared_args(gen)


def in_a_scope() -> bool:
    """Whether this thread shares now, seen from outside: inside a scope, two puts of one
    large value give one ref."""
    return ray.put(BIG) == ray.put(BIG)


@pytest.mark.usefixtures("local_ray", "fresh")
def test_sharing_is_reusable_and_reentrant() -> None:
    block = refshare.sharing(min_bytes=10)
    with block, block:
        assert in_a_scope()
    assert not in_a_scope()


@pytest.mark.usefixtures("local_ray", "fresh")
def test_the_scope_ends_when_the_body_raises() -> None:
    @refshare.shared_args
    def fails() -> None:
        assert in_a_scope()
        raise KeyError("boom")

    with pytest.raises(KeyError):
        fails()
    assert not in_a_scope()


@pytest.mark.usefixtures("local_ray", "fresh")
def test_one_block_entered_by_many_threads_at_once() -> None:
    block = refshare.sharing()
    inside, leave = threading.Barrier(4), threading.Barrier(4)

    def run() -> tuple[bool, bool]:
        with block:
            inside.wait(timeout=60)  # all four threads are inside the one block
            shared = in_a_scope()
            leave.wait(timeout=60)
        return shared, in_a_scope()

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outcomes = [f.result(timeout=120) for f in [pool.submit(run) for _ in range(4)]]
    assert outcomes == [(True, False)] * 4
    assert not in_a_scope()


@pytest.mark.usefixtures("local_ray", "fresh")
def test_asyncio_tasks_entering_one_block_each_leave_their_own_entry() -> None:
    block = refshare.sharing()

    async def run(delay: float) -> tuple[bool, bool]:
        with block:
            await asyncio.sleep(delay)  # the tasks leave in another order than they entered
            shared = in_a_scope()
        return shared, in_a_scope()

    async def main() -> list[tuple[bool, bool]]:
        return await asyncio.gather(*(run(0.01 * (3 - i)) for i in range(3)))

    assert asyncio.run(main()) == [(True, False)] * 3


@pytest.mark.usefixtures("local_ray", "fresh")
def test_a_block_left_out_of_order_is_never_entered_again() -> None:
    def generator() -> Any:
        with refshare.sharing():
            yield in_a_scope()
            yield in_a_scope()

    held = generator()
    assert next(held)  # the generator's block is entered, in this thread's context
    with refshare.sharing(enabled=False):
        assert not in_a_scope()  # the innermost block applies
        held.close()  # leaves the generator's block, which is not the innermost
        assert not in_a_scope()
    assert not in_a_scope()  # every block has closed


@pytest.mark.usefixtures("local_ray", "fresh")
def test_concurrent_asyncio_tasks_keep_their_own_scopes() -> None:
    @refshare.shared_args(cache=False)
    async def one(i: int) -> Any:
        await asyncio.sleep(0)
        return await receive.remote(np.full(50_000, float(i)))

    async def main() -> list[Any]:
        return await asyncio.gather(*(one(i) for i in range(8)))

    results = asyncio.run(main())
    assert results == ray.get([receive.remote(np.full(50_000, float(i))) for i in range(8)])
    assert refshare.stats().puts == 8


@ray.remote(num_cpus=0.1)
def total(x: np.ndarray) -> float:
    return float(x.sum())


@pytest.mark.usefixtures("local_ray", "fresh")
def test_a_value_over_the_budget_is_still_put_once_per_call() -> None:
    value = np.ones(4 << 17)  # 4 MiB, with a cache of 1 MiB: never cached
    cache = refshare.RefCache(max_bytes=1 << 20)
    with refshare.sharing(cache=cache):
        sums = ray.get([total.remote(value) for _ in range(4)])
    assert sums == [float(value.size)] * 4
    stats = refshare.stats()
    assert (stats.puts, stats.hits) == (1, 3), stats
    assert len(cache) == 0
