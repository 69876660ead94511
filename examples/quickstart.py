"""refshare in one minute: fan a 64 MiB array out to four actors, without and with sharing."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import ray

import refshare


@ray.remote(num_cpus=0.25)
class Trainer:
    def train(self, batch: np.ndarray) -> float:
        return float(batch[:1000].sum())


class WorkerGroup:
    def __init__(self, size: int) -> None:
        self.workers = [Trainer.remote() for _ in range(size)]

    def train(self, batch: np.ndarray) -> list[float]:
        return ray.get([w.train.remote(batch) for w in self.workers])

    @refshare.shared_args  # the one added line
    def train_shared(self, batch: np.ndarray) -> list[float]:
        return ray.get([w.train.remote(batch) for w in self.workers])


def timed(label: str, call: Callable[[], list[float]]) -> list[float]:
    start = time.perf_counter()
    result = call()
    print(f"{label:<28} {(time.perf_counter() - start) * 1e3:8.1f} ms")
    return result


def main() -> None:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    group = WorkerGroup(size=4)
    batch = np.random.default_rng(0).random(8 << 20)  # 64 MiB of float64
    group.train(batch[:10])  # start the actors before timing

    for step in range(3):
        by_value = timed(f"step {step}: by value", lambda: group.train(batch))
        shared = timed(f"step {step}: @shared_args", lambda: group.train_shared(batch))
        assert shared == by_value

    print(refshare.stats())
    ray.shutdown()


if __name__ == "__main__":
    main()
