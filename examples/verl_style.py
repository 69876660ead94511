"""A verl-style worker group: ``@register(dispatch_mode=...)`` methods, with refshare.

The dispatch layer turns each group call into one argument list per worker: ``[arg] * world``
for ONE_TO_ALL, chunks for DP_COMPUTE. Every mode then goes through ``execute_all_async``,
the generic fan-out, and that is the one place ``@refshare.shared_args`` goes: the dispatch
code is unchanged. The broadcast value is put once, each chunk once; the same batch chunked
again for a later call is found again by content.

Run: python examples/verl_style.py
"""

from __future__ import annotations

import inspect
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypeVar

import numpy as np
import ray

import refshare

F = TypeVar("F", bound=Callable[..., Any])


class Dispatch(Enum):
    ONE_TO_ALL = "one_to_all"
    DP_COMPUTE = "dp_compute"


def register(dispatch_mode: Dispatch) -> Callable[[F], F]:
    """Mark a worker method with how its group call is fanned out and collected."""

    def decorate(func: F) -> F:
        func.dispatch_mode = dispatch_mode  # type: ignore[attr-defined]
        return func

    return decorate


@dataclass
class DataProto:
    """A batch of arrays plus metadata, like verl's DataProto."""

    batch: dict[str, np.ndarray]
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(next(iter(self.batch.values())))

    def chunk(self, chunks: int) -> list[DataProto]:
        split = {key: np.array_split(value, chunks) for key, value in self.batch.items()}
        return [
            DataProto({k: s[i] for k, s in split.items()}, self.meta_info) for i in range(chunks)
        ]

    @staticmethod
    def concat(items: list[DataProto]) -> DataProto:
        keys = items[0].batch
        return DataProto({k: np.concatenate([item.batch[k] for item in items]) for k in keys})


# -- the dispatch layer: knows nothing of refshare --------------------------------------


def dispatch_one_to_all(world: int, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    return tuple([a] * world for a in args), {k: [v] * world for k, v in kwargs.items()}


def dispatch_dp_compute(world: int, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    return tuple(a.chunk(world) for a in args), {k: v.chunk(world) for k, v in kwargs.items()}


DISPATCH: dict[Dispatch, tuple[Callable[..., Any], Callable[[list[Any]], Any]]] = {
    Dispatch.ONE_TO_ALL: (dispatch_one_to_all, lambda outputs: outputs),
    Dispatch.DP_COMPUTE: (dispatch_dp_compute, DataProto.concat),
}


class RayWorkerGroup:
    """``world`` actors of ``worker_cls``, with one group method per registered method."""

    def __init__(self, worker_cls: type, world: int) -> None:
        actor_cls = ray.remote(num_cpus=0.1)(worker_cls)
        self.workers = [actor_cls.remote(rank, world) for rank in range(world)]
        for name, method in inspect.getmembers(worker_cls, inspect.isfunction):
            mode = getattr(method, "dispatch_mode", None)
            if mode is not None:
                setattr(self, name, self._bind(name, mode))

    def _bind(self, name: str, mode: Dispatch) -> Callable[..., Any]:
        dispatch, collect = DISPATCH[mode]

        def call(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = dispatch(len(self.workers), *args, **kwargs)
            return collect(ray.get(self.execute_all_async(name, *args, **kwargs)))

        return call

    @refshare.shared_args  # the only refshare line: every dispatch mode ends here
    def execute_all_async(self, method: str, *args: list[Any], **kwargs: list[Any]) -> list[Any]:
        futures = []
        for rank, worker in enumerate(self.workers):
            rank_args = [a[rank] for a in args]
            rank_kwargs = {k: v[rank] for k, v in kwargs.items()}
            futures.append(getattr(worker, method).remote(*rank_args, **rank_kwargs))
        return futures


# -- a worker ---------------------------------------------------------------------------


class ActorWorker:
    def __init__(self, rank: int, world: int) -> None:
        self.rank = rank

    @register(Dispatch.ONE_TO_ALL)
    def load_weights(self, weights: dict[str, np.ndarray]) -> int:
        self.weights = weights
        return zlib.crc32(weights["token_bias"].tobytes())

    @register(Dispatch.DP_COMPUTE)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        log_prob = self.weights["token_bias"][data.batch["input_ids"]].sum(axis=1)
        return DataProto({"log_prob": log_prob})

    @register(Dispatch.DP_COMPUTE)
    def update_actor(self, data: DataProto) -> DataProto:
        return DataProto({"tokens": np.array([data.batch["input_ids"].size])})


def main() -> None:
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        rng = np.random.default_rng(0)
        world = 4
        group: Any = RayWorkerGroup(ActorWorker, world)

        # ONE_TO_ALL: [weights] * 4 -> 1 put, 3 hits.
        weights = {"token_bias": rng.standard_normal(262_144, dtype=np.float32)}  # 1 MiB
        assert group.load_weights(weights) == [zlib.crc32(weights["token_bias"].tobytes())] * world

        # DP_COMPUTE: 4 chunks of 512 KiB -> 4 puts; the same batch again -> 4 hits.
        ids = rng.integers(0, 262_144, (256, 1024), dtype=np.int64)  # 2 MiB
        batch = DataProto({"input_ids": ids}, {"temperature": 1.0})
        log_prob = group.compute_log_prob(batch).batch["log_prob"]
        assert np.allclose(log_prob, weights["token_bias"][ids].sum(axis=1))
        assert group.update_actor(batch).batch["tokens"].sum() == ids.size

        stats = refshare.stats()
        print(stats)
        assert stats.puts == 1 + world and stats.hits == (world - 1) + world, stats
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
