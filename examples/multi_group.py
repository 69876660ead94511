"""One batch, four worker groups (actor, critic, reference, reward): put once in all.

Each group's call is its own ``@refshare.shared_args`` call; refshare's process-wide cache
finds the batch again by content, so the first call puts it and every later worker, in any
group, gets the same ref. Each worker receives the whole batch and works on its own rows:
free with refshare, a copy per worker without it.

Run: python examples/multi_group.py
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import ray

import refshare


def checksum(batch: dict[str, np.ndarray]) -> int:
    crc = 0
    for key in sorted(batch):
        crc = zlib.crc32(batch[key].tobytes(), crc)
    return crc


@ray.remote(num_cpus=0.1)
class RoleWorker:
    def __init__(self, role: str, rank: int, world: int) -> None:
        self.role, self.rank, self.world = role, rank, world

    def process(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        rows = batch["input_ids"][self.rank :: self.world]  # this worker's share of the batch
        return {"checksum": checksum(batch), "rows": len(rows), "tokens": int(rows.sum())}


class WorkerGroup:
    def __init__(self, role: str, world: int) -> None:
        self.role = role
        self.workers = [RoleWorker.remote(role, rank, world) for rank in range(world)]

    @refshare.shared_args
    def run(self, method: str, batch: dict[str, np.ndarray]) -> list[dict[str, Any]]:
        return ray.get([getattr(worker, method).remote(batch) for worker in self.workers])


def main() -> None:
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        rng = np.random.default_rng(0)
        sizes = {"actor": 2, "critic": 2, "reference": 1, "reward": 1}
        groups = [WorkerGroup(role, world) for role, world in sizes.items()]
        batch = {
            "input_ids": rng.integers(0, 32_000, (128, 2048), dtype=np.int64),  # 2 MiB
            "attention_mask": np.ones((128, 2048), dtype=np.int8),
        }

        for group in groups:  # four separate decorated calls
            results = group.run("process", batch)
            assert all(r["checksum"] == checksum(batch) for r in results), group.role
            assert sum(r["rows"] for r in results) == len(batch["input_ids"]), group.role
            assert sum(r["tokens"] for r in results) == batch["input_ids"].sum(), group.role

        stats = refshare.stats()
        print(stats)
        # 6 workers in 4 groups: the first one's call puts the batch, the other 5 get its ref.
        assert stats.puts == 1 and stats.hits == sum(sizes.values()) - 1, stats
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
