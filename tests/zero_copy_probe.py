"""Run as a script: what workers receive of one tensor, in turn, under Ray's zero-copy tensor
serializer, by value and through refshare; and, for tensors of each layout, the first
difference between what a worker receives of them both ways. Prints one JSON line."""

from __future__ import annotations

import json
import os
import sys

os.environ["RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"] = "1"  # read when ray is imported

import ray
import torch
from differential_kit import describe_fully, first_difference

import refshare


@ray.remote(num_cpus=0.1)
class Worker:
    def write_then_read(self, t: torch.Tensor) -> float:
        t.add_(1.0)  # a worker's in-place write to what it received
        return float(t.sum())

    def read(self, t: torch.Tensor) -> float:
        return float(t.sum())

    def describe(self, value: object) -> object:
        return describe_fully(value)


def cases() -> dict[str, object]:
    """Tensors as a batch holds them: whole, a view into a larger storage, transposed, with
    ``requires_grad``, of other dtypes, one tensor twice and two views of one storage."""
    base = torch.arange(1 << 16, dtype=torch.float32).reshape(256, 256)
    shared = torch.arange(1 << 16, dtype=torch.int64)
    return {
        "whole": torch.ones(1 << 16),
        "a view at an offset": base[64:],
        "transposed": base.T,
        "requires_grad": torch.ones(1 << 16, requires_grad=True),
        "int64 and bool": [torch.arange(1 << 14), torch.rand(1 << 16) > 0.5],
        "one tensor twice": {"a": base, "b": base},
        "two views of one storage": (shared[: 1 << 15], shared[1 << 15 :]),
    }


def main() -> None:
    ray.init(
        address="local",
        num_cpus=1,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={
            "env_vars": {
                "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1",
                "PYTHONPATH": os.path.dirname(os.path.abspath(__file__)),  # differential_kit
            }
        },
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
    describer = Worker.remote()

    @refshare.shared_args(min_bytes=0)
    def shared_view(value: object) -> object:
        return ray.get(describer.describe.remote(value))

    differences = {
        name: first_difference(ray.get(describer.describe.remote(value)), shared_view(value))
        for name, value in cases().items()
    }
    summary = [zero_copy, by_value, within_one_call, across_calls, batch.sum().item()]
    print(json.dumps([*summary, differences]))
    ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
