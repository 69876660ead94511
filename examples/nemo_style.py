"""A NeMo-RL-style worker group over a named (dp x tp) mesh, with refshare.

``run_all_workers_single_data`` sends the same kwargs to every worker, and
``run_all_workers_sharded_data`` sends each worker the shard at its coordinates on the sharded
axes: every tp rank of one dp rank gets the same shard. With ``@refshare.shared_args`` on both,
each distinct large value goes into Ray's object store once and every other worker gets a ref.

Run: python examples/nemo_style.py
"""

from __future__ import annotations

import itertools
import zlib
from typing import Any

import numpy as np
import ray

import refshare


class BatchedDataDict(dict[str, Any]):
    """Arrays (or tensors) sharing a batch dimension, like NeMo-RL's BatchedDataDict."""

    @property
    def size(self) -> int:
        return len(next(iter(self.values())))

    def shard_by_batch_size(self, shards: int) -> list[BatchedDataDict]:
        rows = self.size // shards
        return [
            BatchedDataDict({k: _rows(v, i * rows, (i + 1) * rows) for k, v in self.items()})
            for i in range(shards)
        ]


def _rows(value: Any, start: int, stop: int) -> Any:
    """Rows start:stop. A torch slice would pickle its parent's whole storage: copy it."""
    part = value[start:stop]
    return part.clone() if hasattr(part, "clone") else part


def as_tensor(array: np.ndarray) -> Any:
    """A torch tensor when torch is installed (as in NeMo-RL), else the numpy array itself."""
    try:
        import torch
    except ImportError:
        return array
    return torch.from_numpy(array)


def checksum(value: Any) -> int:
    """CRC32 of an array's (or tensor's) bytes, or of a dict's values in key order."""
    if isinstance(value, dict):
        crc = 0
        for key in sorted(value):
            crc = zlib.crc32(np.ascontiguousarray(value[key]).tobytes(), crc)
        return crc
    return zlib.crc32(np.ascontiguousarray(value).tobytes())


@ray.remote(num_cpus=0.1)
class PolicyWorker:
    def __init__(self, rank: int, coords: dict[str, int]) -> None:
        self.rank = rank
        self.coords = coords

    def update_weights(self, state_dict: dict[str, Any]) -> int:
        self.state_dict = state_dict
        return checksum(state_dict)

    def train(
        self, data: BatchedDataDict, token_weights: Any, micro_batch_size: int
    ) -> dict[str, Any]:
        return {
            "coords": self.coords,
            "is_batch": isinstance(data, BatchedDataDict),
            "rows": data.size,
            "data": checksum(data),
            "token_weights": checksum(token_weights),
        }


class RayWorkerGroup:
    """One actor per point of a named mesh, e.g. ``dp=2, tp=2``: ranks in row-major order."""

    def __init__(self, worker_cls: Any, **mesh: int) -> None:
        self.axes = list(mesh)
        self.coords = [
            dict(zip(self.axes, point, strict=True))
            for point in itertools.product(*(range(size) for size in mesh.values()))
        ]
        self.workers = [worker_cls.remote(rank, c) for rank, c in enumerate(self.coords)]

    @refshare.shared_args
    def run_all_workers_single_data(self, method: str, **kwargs: Any) -> list[ray.ObjectRef]:
        """Call ``method(**kwargs)`` on every worker: each large kwarg is put once."""
        return [getattr(worker, method).remote(**kwargs) for worker in self.workers]

    @refshare.shared_args
    def run_all_workers_sharded_data(
        self,
        method: str,
        data: Any,
        in_sharded_axes: list[str],
        replicate_on_axes: list[str],
        common_kwargs: dict[str, Any] | None = None,
    ) -> list[ray.ObjectRef]:
        """Call ``method(data=shard, **common_kwargs)`` on every worker.

        ``data`` is a nested list indexed by ``in_sharded_axes`` in order; all workers that
        differ only along ``replicate_on_axes`` get the same shard, put once.
        """
        if sorted(in_sharded_axes + replicate_on_axes) != sorted(self.axes):
            raise ValueError(f"shard or replicate each of {self.axes} exactly once")
        futures = []
        for worker, coords in zip(self.workers, self.coords, strict=True):
            shard = data
            for axis in in_sharded_axes:
                shard = shard[coords[axis]]
            futures.append(getattr(worker, method).remote(data=shard, **(common_kwargs or {})))
        return futures


def main() -> None:
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        rng = np.random.default_rng(0)
        dp, tp = 2, 2
        group = RayWorkerGroup(PolicyWorker, dp=dp, tp=tp)

        # Broadcast: one 8 MiB state dict to all 4 workers -> 1 put, 3 hits.
        weights = {
            name: as_tensor(rng.standard_normal((1024, 1024), dtype=np.float32))
            for name in ("embed", "lm_head")
        }
        sums = ray.get(group.run_all_workers_single_data("update_weights", state_dict=weights))
        assert sums == [checksum(weights)] * dp * tp, sums

        # Sharded: 2 shards of 1 MiB for dp, replicated on tp -> 2 puts, 2 hits;
        # the 1 MiB token_weights common to all -> 1 put, 3 hits; micro_batch_size goes by value.
        batch = BatchedDataDict(
            input_ids=as_tensor(rng.integers(0, 262_144, (64, 4096), dtype=np.int64)),
            advantages=as_tensor(rng.standard_normal(64, dtype=np.float32)),
        )
        shards = batch.shard_by_batch_size(dp)
        token_weights = as_tensor(rng.random(262_144, dtype=np.float32))
        results = ray.get(
            group.run_all_workers_sharded_data(
                "train",
                data=shards,
                in_sharded_axes=["dp"],
                replicate_on_axes=["tp"],
                common_kwargs={"token_weights": token_weights, "micro_batch_size": 4},
            )
        )
        for result in results:
            shard = shards[result["coords"]["dp"]]
            assert result["is_batch"] and result["rows"] == shard.size, result
            assert result["data"] == checksum(shard), result
            assert result["token_weights"] == checksum(token_weights), result

        stats = refshare.stats()
        print(stats)
        # Puts: state dict + 2 shards + token_weights. Hits: 3 + 2 + 3 workers got a ref.
        assert stats.puts == 4 and stats.hits == 8, stats
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
