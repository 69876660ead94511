"""Run as a script: what workers receive of one tensor, in turn, under Ray's zero-copy tensor
serializer, by value and through refshare. Prints one JSON line."""

from __future__ import annotations

import json
import os
import sys

os.environ["RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"] = "1"  # read when ray is imported

import ray
import torch

import refshare


@ray.remote(num_cpus=0.1)
class Worker:
    def write_then_read(self, t: torch.Tensor) -> float:
        t.add_(1.0)  # a worker's in-place write to what it received
        return float(t.sum())

    def read(self, t: torch.Tensor) -> float:
        return float(t.sum())


def main() -> None:
    ray.init(
        address="local",
        num_cpus=1,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}},
    )
    writer, reader = Worker.remote(), Worker.remote()
    batch = torch.ones(1 << 18)

    def in_turn() -> list[float]:
        first = ray.get(writer.write_then_read.remote(batch))
        return [first, ray.get(reader.read.remote(batch))]

    by_value = in_turn()
    within_one_call = refshare.shared_args(in_turn)()
    across_calls = [
        refshare.shared_args(lambda: ray.get(writer.write_then_read.remote(batch)))(),
        refshare.shared_args(lambda: ray.get(reader.read.remote(batch)))(),
    ]
    from ray import cloudpickle

    zero_copy = torch.Tensor in cloudpickle.CloudPickler.dispatch
    print(json.dumps([zero_copy, by_value, within_one_call, across_calls, batch.sum().item()]))
    ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
