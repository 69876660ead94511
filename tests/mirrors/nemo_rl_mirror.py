"""NeMo-RL main, mirrored where NeMo-RL is not installed: how its worker group sends data.

Mirrored from NeMo-RL main (commit 7ea279a, 2026-08): nemo_rl/distributed/worker_groups.py,
batched_data_dict.py and the calls of models/policy/lm_policy.py and algorithms/grpo.py.
Data goes as kwargs; ``run_all_workers_sharded_data`` ``ray.put``s every DP shard when a
replicated axis (TP, CP, PP) has more than one rank, and ``run_all_workers_single_data`` puts
every kwarg. A GRPO step shards one ``logprob_data`` for the policy's and the reference's
log-probs (fresh copies each time), then trains on ``train_data``, which adds those log-probs.
``refshare.enable("nemo_rl")`` wraps the four ``run_*`` methods.

``ray_put`` and ``PUTS`` are not NeMo-RL's: they count what it stores without refshare.
(examples/nemo_style.py runs it; benchmarks/nemo_step.py times it.)
"""

from __future__ import annotations

import math
from collections import Counter, UserDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

import refshare

PUTS: Counter[str] = Counter()  # the examples' counter, for the "without refshare" column
REPLICATED = ["context_parallel", "tensor_parallel", "pipeline_parallel"]


def ray_put(value: Any) -> Any:  # the mirror calls this where NeMo-RL calls ray.put
    PUTS["ray.put"] += 1
    PUTS["ray.put bytes"] += refshare.estimate_size(value)
    return ray.put(value)


# -- NeMo-RL main, mirrored ----------------------------------------------------------------


class NamedSharding:
    def __init__(self, layout, names):
        self._layout, self.names = np.array(layout), list(names)

    def get_worker_coords(self, worker_id):
        indices = np.where(self._layout == worker_id)
        return {name: int(indices[i][0]) for i, name in enumerate(self.names)}

    def get_axis_size(self, name):
        return self._layout.shape[self.names.index(name)]


class BatchedDataDict(UserDict):  # no pickling of its own: it sends its __dict__
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.micro_batch_indices = None
        self.micro_batch_lengths = None
        self.elem_counts_per_gb = None

    @classmethod
    def from_batches(cls, batches):
        return cls({k: _cat([b[k] for b in batches]) for k in batches[0]})

    def shard_by_batch_size(self, shards, batch_size=None):  # the path without dynamic batching
        total_batch_size = len(next(iter(self.data.values())))
        batch_size = batch_size or total_batch_size
        num_chunks, shard_size = total_batch_size // batch_size, batch_size // shards
        aggregated_shards = [SlicedDataDict() for _ in range(shards)]
        for shard_idx in range(shards):
            shard_ranges = []
            for chunk_idx in range(num_chunks):
                shard_start = chunk_idx * batch_size + shard_idx * shard_size
                shard_ranges.append((shard_start, shard_start + shard_size))
            for k, v in self.data.items():  # copies of the rows, as in NeMo-RL
                aggregated_shards[shard_idx][k] = _cat([v[s:e] for s, e in shard_ranges])
        return aggregated_shards


def _cat(parts):
    """A copy of the parts joined: NeMo-RL's batches hold torch tensors; the example's hold
    numpy arrays, so that it runs without torch (benchmarks/nemo_step.py sends tensors)."""
    if type(parts[0]).__module__.partition(".")[0] == "torch":
        import torch

        return torch.cat(parts)
    return np.concatenate(parts)


class SlicedDataDict(BatchedDataDict):
    pass


@dataclass
class MultiWorkerFuture:
    futures: list[ray.ObjectRef]
    return_from_workers: list[int] | None = None
    called_workers: list[int] | None = None


class RayWorkerGroup:
    def __init__(self, workers, sharding_annotations):
        self._workers, self.sharding_annotations = workers, sharding_annotations

    @property
    def workers(self):
        return self._workers

    def run_single_worker_single_data(self, method_name, worker_idx, *args, **kwargs):
        assert len(args) == 0
        return getattr(self.workers[worker_idx], method_name).remote(*args, **kwargs)

    def run_all_workers_multiple_data(self, method_name, *args, common_kwargs=None, **kwargs):
        assert len(args) == 0  # (and run_rank_0_only_axes): no put; each worker its own item
        common_kwargs = common_kwargs or {}
        return [
            getattr(worker, method_name).remote(
                **{k: v[i] for k, v in kwargs.items()}, **common_kwargs
            )
            for i, worker in enumerate(self.workers)
        ]

    def run_all_workers_single_data(self, method_name, *args, **kwargs):
        assert len(args) == 0  # (and run_rank_0_only_axes)
        kwargs = {key: ray_put(value) for key, value in kwargs.items()}
        return [getattr(worker, method_name).remote(*args, **kwargs) for worker in self.workers]

    def run_all_workers_sharded_data(
        self, method_name, *args, in_sharded_axes=None, replicate_on_axes=None,
        output_is_replicated=None, common_kwargs=None, **kwargs,
    ):  # fmt: skip
        assert len(args) == 0  # (make_dummy_calls_to_free_axes left out)
        common_kwargs, in_sharded_axes = common_kwargs or {}, in_sharded_axes or []
        replicate_on_axes = replicate_on_axes or []
        output_is_replicated = output_is_replicated or []
        replicate_degrees = math.prod(
            [self.sharding_annotations.get_axis_size(ax) for ax in replicate_on_axes]
        )
        if replicate_degrees > 1:
            # Use ray.put to serialize all the arguments. This can reduce the cost
            # of repeated serialization when we send same arguments to multiple workers.
            def _map_nested_value_list(nested_value_list, depth, map_fn):
                if depth == 0:
                    return map_fn(nested_value_list)
                return [_map_nested_value_list(v, depth - 1, map_fn) for v in nested_value_list]

            kwargs_after_ray_put = dict()
            for key, nested_value_list in kwargs.items():
                kwargs_after_ray_put[key] = _map_nested_value_list(
                    nested_value_list, len(in_sharded_axes), ray_put
                )
            kwargs = kwargs_after_ray_put

        futures, called_workers, return_from_workers = [], [], []
        for worker_idx, worker in enumerate(self._workers):
            worker_coords = self.sharding_annotations.get_worker_coords(worker_idx)
            should_receive_data = return_from_this_worker = True
            for axis in self.sharding_annotations.names:
                if axis not in in_sharded_axes + replicate_on_axes and worker_coords[axis] != 0:
                    should_receive_data = return_from_this_worker = False  # a free axis
                    break
                if axis in output_is_replicated and worker_coords[axis] != 0:
                    return_from_this_worker = False
            if return_from_this_worker:
                return_from_workers.append(worker_idx)
            if should_receive_data:
                worker_kwargs = kwargs
                for axis in in_sharded_axes:
                    worker_kwargs = {k: v[worker_coords[axis]] for k, v in worker_kwargs.items()}
                futures.append(
                    getattr(worker, method_name).remote(**worker_kwargs, **common_kwargs)
                )
                called_workers.append(worker_idx)
        return MultiWorkerFuture(futures, return_from_workers, called_workers)

    def get_all_worker_results(self, future_bundle):
        results = ray.get(future_bundle.futures)
        called = future_bundle.called_workers
        return [results[called.index(w)] for w in future_bundle.return_from_workers]


# -- lm_policy.Policy's calls and one GRPO step -------------------------------------------


def sharded_call(group: RayWorkerGroup, method: str, data: BatchedDataDict, **common: Any) -> Any:
    dp_size = group.sharding_annotations.get_axis_size("data_parallel")
    futures = group.run_all_workers_sharded_data(
        method, data=data.shard_by_batch_size(dp_size, batch_size=None),
        in_sharded_axes=["data_parallel"], replicate_on_axes=REPLICATED,
        output_is_replicated=REPLICATED, common_kwargs=common,
    )  # fmt: skip
    return group.get_all_worker_results(futures)


def grpo_step(group: RayWorkerGroup, rollout: dict[str, np.ndarray]) -> None:
    train_data = BatchedDataDict(rollout)
    keys = ("input_ids", "input_lengths", "token_mask", "sample_mask")
    logprob_data = BatchedDataDict({key: train_data[key] for key in keys})
    logprobs = sharded_call(group, "get_logprobs", logprob_data)
    train_data["prev_logprobs"] = BatchedDataDict.from_batches(logprobs)["logprobs"]
    ref = sharded_call(group, "get_reference_policy_logprobs", logprob_data, micro_batch_size=4)
    ref_logprobs = BatchedDataDict.from_batches(ref)["reference_logprobs"]
    train_data["reference_policy_logprobs"] = ref_logprobs
    sharded_call(group, "train", train_data, loss_fn="ClippedPGLossFn", eval_mode=False, mbs=4)
