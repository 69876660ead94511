"""verl 0.9.1's dispatch, mirrored: one batch for actor, reference and critic, with refshare.

As in verl 0.9.1 (and main at 1dda039), a group method is a ``Functor`` from
``func_generator``: dispatch, then ``execute_all`` -> ``execute_all_async``, which gives the
i-th item of list arguments to the i-th worker. ONE_TO_ALL sends ``[arg] * world_size`` by
value; the nd-compute dispatch chunks the ``DataProto`` per DP rank and ``parallel_put``s the
chunks from a thread pool, so TP ranks share a ref, but each group's call puts the same chunks
again. refshare wraps the two names ``refshare.enable("verl")`` wraps; where verl imports, the
same steps run again on verl's own code.

Run: python examples/verl_style.py
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
import zlib
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace
from typing import Any

import numpy as np
import ray

import refshare

TALLY: Counter[str] = Counter()  # the example's counters, for the "without refshare" column
# dp=2 x tp=2: workers 0, 1 get chunk 0, workers 2, 3 chunk 1. (verl asks the workers for this
# mapping on a mesh's first use, with a nested fan-out: _query_dispatch_info.)
DP, MAPPING = 2, [0, 0, 1, 1]

# -- verl 0.9.1, mirrored (protocol.py, utils/ray_utils.py, single_controller/) -------------


@dataclass
class DataProto:
    batch: Any = None  # a TensorDict in verl; a dict of numpy arrays here
    non_tensor_batch: dict = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)

    def chunk(self, chunks):
        parts = {key: np.array_split(val, chunks) for key, val in self.batch.items()}
        return [
            type(self)({k: p[i] for k, p in parts.items()}, {}, self.meta_info)
            for i in range(chunks)
        ]


def parallel_put(data_list, max_workers=None):
    assert len(data_list) > 0, "data_list must not be empty"
    TALLY["ray.put"] += len(data_list)  # the example's counter: one put per item, below

    def put_data(index, data):
        return index, ray.put(data)

    if max_workers is None:
        max_workers = min(len(data_list), 16)

    with concurrent.futures.ThreadPoolExecutor(max_workers=max_workers) as executor:
        data_list_f = [executor.submit(put_data, i, data) for i, data in enumerate(data_list)]
        res_lst = []
        for future in concurrent.futures.as_completed(data_list_f):
            res_lst.append(future.result())
        output = [None for _ in range(len(data_list))]
        for index, data_ref in res_lst:
            output[index] = data_ref
    return output


def dispatch_one_to_all(worker_group, *args, **kwargs):
    args = tuple([arg] * worker_group.world_size for arg in args)
    kwargs = {k: [v] * worker_group.world_size for k, v in kwargs.items()}
    return args, kwargs


def collect_all_to_all(worker_group, output):
    return output


def dispatch_nd_compute_dataproto(dp_rank_mapping, dp_size, worker_group, *args, **kwargs):
    args = [arg.chunk(chunks=dp_size) for arg in args]  # _split_args_kwargs_data_proto
    kwargs = {k: v.chunk(chunks=dp_size) for k, v in kwargs.items()}
    # dispatch_nd_compute:
    max_workers = max(1, min(len(args[0]), os.cpu_count()))
    args = [parallel_put(arg, max_workers=max_workers) for arg in args]
    kwargs = {k: parallel_put(v, max_workers=max_workers) for k, v in kwargs.items()}
    ranks = range(worker_group.world_size)
    all_args = tuple([arg[dp_rank_mapping[i]] for i in ranks] for arg in args)
    return all_args, {k: [v[dp_rank_mapping[i]] for i in ranks] for k, v in kwargs.items()}


def func_generator(self, method_name, dispatch_fn, collect_fn, execute_fn, blocking):
    class Functor:
        def __call__(this, *args, **kwargs):
            args, kwargs = dispatch_fn(self, *args, **kwargs)
            output = execute_fn(method_name, *args, **kwargs)
            if blocking:
                output = ray.get(output)
            return collect_fn(self, output)  # (verl also drops auto-padding rows here)

    return type(method_name, (Functor,), {})()


class RayWorkerGroup:
    """The fan-out part of verl's RayWorkerGroup (no resource pools, no fused workers)."""

    world_size = property(lambda self: self._world_size)

    def _execute_remote_single_worker(self, worker, method_name: str, *args, **kwargs):
        big = [a for a in (*args, *kwargs.values()) if refshare.estimate_size(a) > 100 << 10]
        TALLY["by value"] += len(big)  # the example's counter: Ray stores each one per task
        remote_call = getattr(worker, method_name)
        return remote_call.remote(*args, **kwargs)

    def execute_all(self, method_name: str, *args, **kwargs):
        return self.execute_all_async(method_name, *args, **kwargs)

    def execute_all_async(self, method_name: str, *args, **kwargs):
        length = len(self._workers)
        if all(isinstance(arg, list) for arg in args) and all(  # noqa: SIM102 (as in verl)
            isinstance(kwarg, list) for kwarg in kwargs.values()
        ):
            if all(len(arg) == length for arg in args) and all(
                len(kwarg) == length for kwarg in kwargs.values()
            ):
                result = []
                for i in range(length):
                    sliced_args = tuple(arg[i] for arg in args)
                    sliced_kwargs = {k: v[i] for k, v in kwargs.items()}
                    result.append(
                        self._execute_remote_single_worker(
                            self._workers[i], method_name, *sliced_args, **sliced_kwargs
                        )
                    )
                return result

        return [
            self._execute_remote_single_worker(worker, method_name, *args, **kwargs)
            for worker in self._workers
        ]


# -- the example ------------------------------------------------------------------------------


def real_verl() -> Any:
    """verl's functions and classes of the names above, or None where verl does not import."""
    try:
        import torch
        from verl.protocol import DataProto as VerlDataProto
        from verl.single_controller.base import decorator
        from verl.single_controller.ray import base
    except ImportError:
        return None

    def make_batch(arrays: dict[str, np.ndarray]) -> Any:
        tensors = {key: torch.from_numpy(array) for key, array in arrays.items()}
        return VerlDataProto.from_dict(tensors, meta_info={"temperature": 1.0})

    return SimpleNamespace(**{**vars(decorator), **vars(base), "make_batch": make_batch})


def make_batch(arrays: dict[str, np.ndarray]) -> DataProto:
    return DataProto(arrays, {}, {"temperature": 1.0})


def checksum(arrays: Any) -> int:
    crc = 0
    for key in sorted(arrays.keys()):
        crc = zlib.crc32(np.ascontiguousarray(np.asarray(arrays[key])).tobytes(), crc)
    return crc


@ray.remote(num_cpus=0.1)
class Worker:
    """One process holding actor, critic and reference, as verl's colocated workers do."""

    def load_weights(self, weights: dict[str, np.ndarray]) -> int:
        return checksum(weights)

    def compute_log_prob(self, data: Any) -> int:
        return checksum(data.batch)

    compute_ref_log_prob = compute_values = compute_log_prob


def make_group(v: Any, workers: list[Any], *methods: str) -> Any:
    """What verl's ``_bind_worker_method`` builds: one Functor per method, on the instance."""
    group = v.RayWorkerGroup.__new__(v.RayWorkerGroup)
    group._workers, group._world_size, group.fused_worker_used = workers, len(workers), False
    for name in methods:
        nd = partial(v.dispatch_nd_compute_dataproto, MAPPING, DP)
        dispatch = v.dispatch_one_to_all if name == "load_weights" else nd
        func = v.func_generator(
            group, name, dispatch, v.collect_all_to_all, group.execute_all, True
        )
        setattr(group, name, func)
    return group


def snapshot() -> Counter[str]:
    return Counter({**TALLY, **refshare.stats()._asdict()})


def run_steps(v: Any, workers: list[Any], steps: list[Any]) -> tuple[list[Any], list[Any]]:
    """Per step, what was counted and what the workers received (checksums)."""
    actor = make_group(v, workers, "load_weights", "compute_log_prob")
    reference = make_group(v, workers, "compute_ref_log_prob")
    critic = make_group(v, workers, "compute_values")
    counts, sums = [], []
    for weights, arrays in steps:
        before = snapshot()
        batch = v.make_batch(arrays)  # a new DataProto each step, as the trainer makes
        sums.append([actor.load_weights(weights), actor.compute_log_prob(batch)])
        sums[-1] += [reference.compute_ref_log_prob(batch), critic.compute_values(batch)]
        counts.append(snapshot() - before)
    return counts, sums


def main() -> None:
    ray.init(address="local", num_cpus=2, object_store_memory=256 << 20, include_dashboard=False)
    try:
        rng = np.random.default_rng(0)
        workers = [Worker.remote() for _ in MAPPING]
        weights = [{"lm_head": rng.random(1 << 20, dtype=np.float32)} for _ in range(2)]  # 4 MiB
        batches = [{"input_ids": rng.integers(0, 32_000, (512, 2048))} for _ in range(2)]  # 8 MiB
        labels = ["1 new data", "2 same", "3 same", "4 new data"]
        steps = [(weights[i], batches[i]) for i in (0, 0, 0, 1)]

        mirror = sys.modules[__name__]
        plain, plain_sums = run_steps(mirror, workers, steps)
        refshare.patch_methods(RayWorkerGroup, "execute_all_async")  # as enable("verl") does
        refshare.patch_methods(mirror, "parallel_put")
        shared, shared_sums = run_steps(mirror, workers, steps)
        assert shared_sums == plain_sums, "workers received different data"
        chunks = [checksum(chunk.batch) for chunk in make_batch(batches[0]).chunk(DP)]
        assert plain_sums[0][1:] == [[chunks[dp] for dp in MAPPING]] * 3, plain_sums[0]

        print("verl 0.9.1 mirror, per step: weights to 4 workers, one batch to 3 groups")
        print("step         stored without refshare       stored with refshare   hits")
        for label, old, new in zip(labels, plain, shared, strict=True):
            without = f"{old['ray.put'] + old['by value']} ({old['ray.put']} ray.put + "
            without += f"{old['by value']} by value)"
            print(f"{label:<12} {without:<29} {new['puts']:>20} {new['hits']:>6}")
        # Each distinct value is stored once (weights + 2 chunks), and none on a repeated step.
        assert [row["puts"] for row in shared] == [1 + DP, 0, 0, 1 + DP], shared

        verl = real_verl()
        if verl is not None:
            refshare.clear()  # start the real run from an empty cache
            wrapped = refshare.enable("verl")
            print(f"\nverl {sys.modules['verl'].__version__} itself, enable() wrapped {wrapped}")
            real, real_sums = run_steps(verl, workers, steps)
            assert real_sums == plain_sums, "workers received different data from verl"
            print("step         verl's ray.put calls          stored with refshare   hits")
            for label, row in zip(labels, real, strict=True):
                print(f"{label:<12} {row['put_calls']:<29} {row['puts']:>20} {row['hits']:>6}")
            assert [(r["puts"], r["hits"]) for r in real] == [
                (r["puts"], r["hits"]) for r in shared
            ]

        print(refshare.stats())
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
