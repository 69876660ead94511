"""Size estimates, without Ray: buffers not getsizeof, members summed, bounded cost."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import internals
import numpy as np

import refshare
from refshare import estimate_size


def test_sizes_come_from_buffers_not_getsizeof() -> None:
    base = np.zeros(10_000_000)
    view = base[::1]
    assert sys.getsizeof(view) < 200  # what a naive size would see
    assert estimate_size(view) == 80_000_000
    assert estimate_size(b"x" * 1000) == 1000
    assert estimate_size(bytearray(2000)) == 2000
    assert estimate_size(memoryview(b"y" * 3000)) == 3000
    assert estimate_size("z" * 4000) == 4000


def test_containers_and_objects_sum_their_members() -> None:
    @dataclasses.dataclass
    class Batch:
        obs: np.ndarray
        act: np.ndarray

    class Holder:
        def __init__(self) -> None:
            self.data = np.zeros(1000, dtype=np.uint8)

    class BatchedDataDict(dict):  # type: ignore[type-arg]
        pass

    a, b = np.zeros(100, dtype=np.uint8), np.zeros(200, dtype=np.uint8)
    assert estimate_size({"a": a, "b": b}) == 300
    assert estimate_size([a, (b, b)]) == 500
    assert estimate_size(Batch(a, b)) == 300
    assert estimate_size(Holder()) == 1000
    assert estimate_size(BatchedDataDict(a=a, b=b)) == 300


def test_size_estimate_stops_early() -> None:
    many = [b"x" * 1000 for _ in range(1000)]
    assert 10_000 <= estimate_size(many, limit=10_000) < 12_000
    huge = list(range(2_000_000))
    calls, sizer = 0, estimate_size.__code__.co_filename

    def count(frame: Any, event: str, _arg: object) -> None:  # the sizer's own calls
        nonlocal calls
        calls += event == "call" and frame.f_code.co_filename == sizer

    sys.setprofile(count)
    try:
        size = estimate_size(huge, limit=1 << 40)
    finally:
        sys.setprofile(None)
    assert 0 < calls <= 3 * internals.SIZE_VISIT_BUDGET  # not one for each of two million
    # Visited up to the budget, the rest extrapolated: 8 bytes for each of the 2 million.
    assert size == 2_000_000 * internals.SCALAR_BYTES
    nested = [[1.0] * 100 for _ in range(10_000)]  # a million floats, in lists of 100
    assert 0.8e6 * 8 <= estimate_size(nested) <= 1.2e6 * 8


def test_a_list_of_arrays_is_summed_as_the_walk_would() -> None:
    shards = [np.zeros(n, dtype=np.float32) for n in (1000, 2000, 3000)]
    assert estimate_size(shards) == 24_000
    assert estimate_size(tuple(shards), limit=100) == 24_000  # summed whole, not stopped
    assert internals.measure(shards, limit=100) == (24_000, True)
    # An array of objects among them: walked, its strings counted.
    mixed = [*shards, np.array(["ab", "cd"], dtype=object)]
    assert estimate_size(mixed) == 24_004
    # The same array twice is sent twice, so it counts twice (as in any list).
    assert estimate_size([shards[0], shards[0]]) == 8_000


def test_a_registered_array_size_is_honoured_in_lists() -> None:
    class Tagged(np.ndarray):
        pass

    plain = np.zeros(100, dtype=np.uint8)
    tagged = plain.view(Tagged)
    refshare.register_size(Tagged, lambda a: 7)
    assert estimate_size([plain, tagged]) == 107  # a subclass: each member on its own


def test_a_size_registered_for_ndarray_itself_is_used_in_lists() -> None:
    arrays = [np.zeros(100, dtype=np.uint8), np.zeros(200, dtype=np.uint8)]
    refshare.register_size(np.ndarray, lambda a: 2 * a.nbytes)
    try:
        assert estimate_size(arrays) == 600
    finally:
        refshare.register_size(np.ndarray, internals._ndarray_size)
    assert estimate_size(arrays) == 300


def test_members_all_scalars_strings_or_row_bounds_count_as_the_walk_counts_them() -> None:
    scalar = internals.SCALAR_BYTES
    bounds = [(start, start + 8) for start in range(0, 128, 8)]  # a batch's row bounds
    assert estimate_size(bounds) == 16 * 2 * scalar
    assert estimate_size({"a": 1, "b": 2.0, "c": None, "d": True}) == 4 * scalar
    assert estimate_size(["ab", "cde"]) == 5
    assert estimate_size((b"ab", b"c")) == 3
    assert estimate_size(["ab", 1]) == 2 + scalar  # a mix: walked member by member
    assert estimate_size([(1, "x"), (2, "y")]) == 2 * (scalar + 1)
    assert estimate_size({"bounds": bounds, "step": 3}) == 33 * scalar
    # The limit still stops the count where the walk would have stopped.
    assert internals.measure(["x" * 10] * 100, limit=50) == (50, False)
    assert internals.measure([(1, 2)] * 100, limit=40) == (48, False)
