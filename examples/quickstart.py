"""refshare in one minute: a 64 MiB array to four actors, by value and with @shared_args.

The store and the actors are warmed first and the calls interleaved, so the medians show
what a long job sees, even on a busy machine.

Run: python examples/quickstart.py
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import ray

import refshare

MiB = 1 << 20


@ray.remote(num_cpus=0.25)
class Trainer:
    def train(self, batch: np.ndarray) -> float:
        return float(batch[:1000].sum())

    def touch(self, array: np.ndarray) -> int:
        return int(array.reshape(-1).view(np.uint8)[::4096].sum())  # a byte of every page


class WorkerGroup:
    def __init__(self, size: int) -> None:
        self.workers = [Trainer.remote() for _ in range(size)]

    def train(self, batch: np.ndarray) -> list[float]:
        return ray.get([w.train.remote(batch) for w in self.workers])

    @refshare.shared_args  # the one added line
    def train_shared(self, batch: np.ndarray) -> list[float]:
        return ray.get([w.train.remote(batch) for w in self.workers])


def warm_up(group: WorkerGroup, batch: np.ndarray) -> None:
    """Start the actors and map the store's pages in every process, as a long job has."""
    arrays = [ray.put(np.ones_like(batch)) for _ in range(6)]  # 384 MiB alive at once
    ray.get([w.touch.remote(array) for array in arrays for w in group.workers])
    del arrays
    group.train(batch)
    group.train_shared(batch)  # refshare's first call stores the batch; the next ones find it


def main() -> None:
    ray.init(address="local", num_cpus=2, object_store_memory=512 * MiB, include_dashboard=False)
    try:
        group = WorkerGroup(size=4)
        batch = np.random.default_rng(0).random(64 * MiB // 8)  # 64 MiB of float64
        expected = [float(batch[:1000].sum())] * 4
        # Before turning it on, an audit: keyed as sharing would key it, sent by value.
        refshare.shared_args(audit=True)(WorkerGroup.train)(group, batch)
        warm_up(group, batch)  # its @shared_args call is sharing's first
        report = refshare.report()
        would, saved = report.bytes_repeated(audit=True), report.bytes_repeated()
        assert abs(would - saved) <= 0.05 * saved, report  # the audit foretold that call

        times: dict[str, list[float]] = {"by value": [], "@shared_args": []}
        calls = {"by value": group.train, "@shared_args": group.train_shared}
        for rep in range(5):  # interleaved, each leading in turn: both see the same machine
            for label in sorted(calls, reverse=rep % 2 == 1):
                start = time.perf_counter()
                assert calls[label](batch) == expected
                times[label].append(time.perf_counter() - start)

        by_value, shared = (statistics.median(t) * 1e3 for t in times.values())
        print("64 MiB to 4 actors, median of 5 calls each, warm store:")
        print(f"  by value       {by_value:7.1f} ms")
        print(f"  @shared_args   {shared:7.1f} ms   ({by_value / shared:.1f}x faster)")
        stats = refshare.stats()  # every @shared_args call: the warm-up's and the timed ones
        stored = "once" if stats.puts == 1 else f"{stats.puts} times"
        print(f"@shared_args sent the batch {stats.puts + stats.hits} times and stored it "
              f"{stored}: {stats.bytes_saved / MiB:.0f} MiB not serialized again")  # fmt: skip
        print(stats)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
