"""A small mirror of verl 0.9.1's data protocol and Ray dispatch, for machines without verl.

It keeps what decides transport: ``DataProto.__getstate__`` ``torch.save``s the batch made
contiguous and consolidated (verl/protocol.py), ``chunk`` hands each worker a view of the
batch, and a group call runs dispatch -> ``execute_all`` -> ``execute_all_async`` ->
``ray.get`` -> collect, with ``execute_all_async`` giving the i-th element of list arguments
to the i-th worker and anything else to all (verl/single_controller/{base/decorator.py,
ray/base.py}). The nd-compute dispatch of the engine workers
(``make_nd_compute_dataproto_dispatch_fn``) asks the workers for their DP ranks on a mesh's
first use (``_query_dispatch_info``, ``_query_collect_info``), chunks per DP rank, and puts
the chunks with ``parallel_put`` (a thread pool, verl/utils/ray_utils.py), looked up at call
time as verl's import inside the dispatch does. Without tensordict the batch is a plain dict
of tensors, and ``.clone()`` stands in for ``consolidate()``: both copy only the chunk's own
elements.
"""

from __future__ import annotations

import concurrent.futures
import enum
import io
import os
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import ray
import torch

#: Set to 1 (before Ray starts, so workers inherit it) to use plain dicts even where
#: tensordict is installed.
DICT_ENV = "VERL_MIRROR_DICT"
try:
    from tensordict import TensorDict
except ImportError:
    TensorDict = None
if os.environ.get(DICT_ENV) == "1":
    TensorDict = None

MIRRORS = "verl 0.9.1"
BATCH_TYPE = "tensordict.TensorDict" if TensorDict is not None else "dict of tensors"


class Dispatch(enum.Enum):
    ONE_TO_ALL = "one_to_all"
    DP_COMPUTE_PROTO = "dp_compute_proto"


def register(dispatch_mode: Dispatch) -> Any:
    def decorate(func: Any) -> Any:
        func.dispatch_mode = dispatch_mode
        return func

    return decorate


@dataclass
class DataProto:
    batch: Any = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, tensors: Any = None, non_tensors: Any = None, meta_info: Any = None) -> Any:
        batch = dict(tensors) if tensors else None
        if batch and TensorDict is not None:
            batch = TensorDict(batch, batch_size=[len(next(iter(batch.values())))])
        return cls(batch, dict(non_tensors or {}), dict(meta_info or {}))

    def chunk(self, chunks: int) -> list[DataProto]:
        if isinstance(self.batch, dict):
            parts = [{k: v.chunk(chunks)[i] for k, v in self.batch.items()} for i in range(chunks)]
        else:
            parts = self.batch.chunk(chunks=chunks, dim=0)
        split = {k: np.array_split(v, chunks) for k, v in self.non_tensor_batch.items()}
        nons = [{k: s[i] for k, s in split.items()} for i in range(chunks)]
        return [type(self)(parts[i], nons[i], self.meta_info) for i in range(chunks)]

    def union(self, other: DataProto) -> DataProto:
        for key, value in other.batch.items() if other.batch is not None else ():
            if key in self.batch.keys():  # noqa: SIM118 (TensorDict refuses `in`)
                assert self.batch[key].equal(value), key
            else:
                self.batch[key] = value
        for key, array in other.non_tensor_batch.items():
            assert key not in self.non_tensor_batch or np.array_equal(
                self.non_tensor_batch[key], array
            ), key
            self.non_tensor_batch[key] = array
        for key, value in other.meta_info.items():
            assert self.meta_info.get(key, value) == value, key
            self.meta_info[key] = value
        return self

    @staticmethod
    def concat(items: list[DataProto]) -> DataProto:
        batches = [item.batch for item in items]
        if batches[0] is None:
            batch = None
        elif isinstance(batches[0], dict):
            batch = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
        else:
            batch = torch.cat(batches, dim=0)
        keys = items[0].non_tensor_batch
        nons = {k: np.concatenate([item.non_tensor_batch[k] for item in items]) for k in keys}
        meta = {k: v for k, v in items[0].meta_info.items() if k != "metrics"}
        metrics = [item.meta_info["metrics"] for item in items if "metrics" in item.meta_info]
        if metrics:
            meta["metrics"] = {k: [m[k] for m in metrics] for k in metrics[0]}
        return DataProto(batch, nons, meta)

    def __getstate__(self) -> tuple[bytes, dict[str, np.ndarray], dict[str, Any]]:
        batch = self.batch
        if isinstance(batch, dict):
            batch = {k: v.clone() for k, v in batch.items()}  # consolidate(): own elements only
        elif batch is not None and len(batch.keys()) > 0:
            batch = batch.contiguous().consolidate()
        buffer = io.BytesIO()
        torch.save(batch, buffer)
        return buffer.getvalue(), self.non_tensor_batch, self.meta_info

    def __setstate__(self, state: tuple[bytes, dict[str, np.ndarray], dict[str, Any]]) -> None:
        data, self.non_tensor_batch, self.meta_info = state
        self.batch = torch.load(io.BytesIO(data), weights_only=False, map_location="cpu")


def _one_to_all(group: RayWorkerGroup, *args: Any, **kwargs: Any) -> Any:
    n = group.world_size
    return tuple([a] * n for a in args), {k: [v] * n for k, v in kwargs.items()}


def _dp_compute_proto(group: RayWorkerGroup, *args: Any, **kwargs: Any) -> Any:
    n = group.world_size
    return [a.chunk(n) for a in args], {k: v.chunk(n) for k, v in kwargs.items()}


DISPATCH = {
    Dispatch.ONE_TO_ALL: {"dispatch_fn": _one_to_all, "collect_fn": lambda group, output: output},
    Dispatch.DP_COMPUTE_PROTO: {
        "dispatch_fn": _dp_compute_proto,
        "collect_fn": lambda group, output: DataProto.concat(output),
    },
}


def parallel_put(data_list: list[Any], max_workers: int | None = None) -> list[Any]:
    """``ray.put`` every item from a thread pool; the refs in the items' order."""
    assert len(data_list) > 0, "data_list must not be empty"

    def put_data(index: int, data: Any) -> tuple[int, Any]:
        return index, ray.put(data)

    if max_workers is None:
        max_workers = min(len(data_list), 16)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max_workers) as executor:
        futures = [executor.submit(put_data, i, data) for i, data in enumerate(data_list)]
        output: list[Any] = [None] * len(data_list)
        for future in concurrent.futures.as_completed(futures):
            index, ref = future.result()
            output[index] = ref
    return output


def _dispatch_nd(mesh_name: str, group: RayWorkerGroup, *args: Any, **kwargs: Any) -> Any:
    if mesh_name not in group._dispatch_info:
        group._dispatch_info[mesh_name] = group._query_dispatch_info(mesh_name)
    mapping = group._dispatch_info[mesh_name]
    dp_size = max(mapping) + 1
    args = [a.chunk(dp_size) for a in args]  # _split_args_kwargs_data_proto
    kwargs = {k: v.chunk(dp_size) for k, v in kwargs.items()}
    max_workers = max(1, min(len(args[0]), os.cpu_count() or 1))  # dispatch_nd_compute
    args = [parallel_put(a, max_workers=max_workers) for a in args]
    kwargs = {k: parallel_put(v, max_workers=max_workers) for k, v in kwargs.items()}
    ranks = range(group.world_size)
    all_args = tuple([a[mapping[i]] for i in ranks] for a in args)
    return all_args, {k: [v[mapping[i]] for i in ranks] for k, v in kwargs.items()}


def _collect_nd(mesh_name: str, group: RayWorkerGroup, output: list[Any]) -> Any:
    if mesh_name not in group._collect_info:
        group._collect_info[mesh_name] = group._query_collect_info(mesh_name)
    mask = group._collect_info[mesh_name]
    return DataProto.concat([out for out, keep in zip(output, mask, strict=True) if keep])


def make_nd_compute_dataproto_dispatch_fn(mesh_name: str) -> dict[str, Any]:
    return {
        "dispatch_fn": partial(_dispatch_nd, mesh_name),
        "collect_fn": partial(_collect_nd, mesh_name),
    }


class Worker:
    """What the engine workers use of verl's ``Worker``: the DP rank of each mesh."""

    def __init__(self, rank: int = 0) -> None:
        self._rank = rank
        self._dispatch_dp_rank: dict[str, int] = {}
        self._collect_dp_rank: dict[str, bool] = {}

    @property
    def rank(self) -> int:
        return self._rank

    def _register_dispatch_collect_info(
        self, mesh_name: str, dp_rank: int, is_collect: bool
    ) -> None:
        if mesh_name in self._dispatch_dp_rank or mesh_name in self._collect_dp_rank:
            raise ValueError(f"mesh_name {mesh_name} has been registered")
        self._dispatch_dp_rank[mesh_name] = dp_rank
        self._collect_dp_rank[mesh_name] = is_collect

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def _query_dispatch_info(self, mesh_name: str) -> int:
        return self._dispatch_dp_rank[mesh_name]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def _query_collect_info(self, mesh_name: str) -> bool:
        return self._collect_dp_rank[mesh_name]


class RayWorkerGroup:
    """``world_size`` actors of ``worker_cls`` (a :class:`Worker`; the i-th of rank i), with
    one group method per registered method."""

    def __init__(self, worker_cls: type, world_size: int, num_cpus: float) -> None:
        actor_cls = ray.remote(num_cpus=num_cpus)(worker_cls)
        self._workers = [actor_cls.remote(rank) for rank in range(world_size)]
        self._dispatch_info: dict[str, list[int]] = {}
        self._collect_info: dict[str, list[bool]] = {}
        for name in dir(worker_cls):
            mode = getattr(getattr(worker_cls, name), "dispatch_mode", None)
            if mode is not None:
                fns = DISPATCH[mode] if isinstance(mode, Dispatch) else mode
                setattr(self, name, self._bind(name, **fns))

    @property
    def world_size(self) -> int:
        return len(self._workers)

    @property
    def workers(self) -> list[Any]:
        return self._workers

    def _bind(self, name: str, dispatch_fn: Any, collect_fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = dispatch_fn(self, *args, **kwargs)
            return collect_fn(self, ray.get(self.execute_all(name, *args, **kwargs)))

        return call

    def execute_all(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self.execute_all_async(method_name, *args, **kwargs)

    def execute_all_async(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        n = len(self._workers)
        values = [*args, *kwargs.values()]
        if all(isinstance(v, list) and len(v) == n for v in values):
            calls = [getattr(w, method_name) for w in self._workers]
            return [
                call.remote(*[a[i] for a in args], **{k: v[i] for k, v in kwargs.items()})
                for i, call in enumerate(calls)
            ]
        return [getattr(w, method_name).remote(*args, **kwargs) for w in self._workers]
