"""verl 0.9.1, mirrored where verl is not installed: what decides how a batch travels.

Three parts, each naming the verl file it follows (paths under ``verl/``):

* **the data protocol** (``protocol.py``): ``DataProto``, whose pickling ``torch.save``s its
  batch made contiguous and consolidated, ``chunk`` (views, one per worker), ``union`` and
  ``concat``, and ``to_tensordict``;
* **the legacy trainer's conversions** (``trainer.use_v1=False``: ``trainer/ppo/ray_trainer.py``
  converts afresh before every worker-group call): ``to_tensordict``, then
  ``left_right_2_no_padding`` (``workers/utils/padding.py``), then ``assign_non_tensor`` with
  that call's flags (``utils/tensordict_utils.py``); the dispatch then chunks the TensorDict
  with ``BatchData.chunk`` (``protocol.py``: ``chunk_tensordict``, ``contiguous``,
  ``consolidate``);
* **the Ray dispatch** (``single_controller/``): a group method is a ``Functor`` from
  ``func_generator``: dispatch, ``execute_all`` -> ``execute_all_async`` (the i-th item of list
  arguments to the i-th worker, anything else to all), ``ray.get``, collect. ``ONE_TO_ALL``
  sends one value to every worker by value, ``DP_COMPUTE_PROTO`` a chunk per worker by value,
  and the engine workers' nd-compute dispatch asks the workers for their DP ranks on a mesh's
  first use, chunks per DP rank and puts the chunks with ``parallel_put``
  (``utils/ray_utils.py``, a thread pool), looked up at call time as verl's import inside the
  dispatch does. ``execute_all_async`` and ``parallel_put`` are what ``refshare.enable("verl")``
  wraps.

Needs torch. A ``DataProto``'s batch is a ``TensorDict`` where tensordict is installed (the
conversions need it), else a dict of tensors, whose pickling ``.clone()``s each tensor where
verl consolidates: both copy only a chunk's own elements. ``checksum`` is not verl's: it says
what a worker received, to compare runs.
"""

from __future__ import annotations

import concurrent.futures
import enum
import io
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import ray
import torch
import torch.nn.functional as F
import xxhash

#: Set to 1 (before Ray starts, so workers inherit it) to use plain dicts even where
#: tensordict is installed.
DICT_ENV = "VERL_MIRROR_DICT"
try:
    from tensordict import TensorDict
    from tensordict.tensorclass import NonTensorData, NonTensorStack
except ImportError:
    TensorDict = NonTensorData = NonTensorStack = None
HAS_TENSORDICT = TensorDict is not None
BATCH_AS_TENSORDICT = HAS_TENSORDICT and os.environ.get(DICT_ENV) != "1"

MIRRORS = "verl 0.9.1"
BATCH_TYPE = "tensordict.TensorDict" if BATCH_AS_TENSORDICT else "dict of tensors"


def use_dict_batches() -> None:
    """Make batches dicts of tensors from now on, here and in the Ray workers started after
    (they inherit the environment)."""
    global BATCH_AS_TENSORDICT, BATCH_TYPE
    os.environ[DICT_ENV] = "1"
    BATCH_AS_TENSORDICT, BATCH_TYPE = False, "dict of tensors"


# -- the data protocol (protocol.py) ----------------------------------------------------------


@dataclass
class DataProto:
    batch: Any = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, tensors: Any = None, non_tensors: Any = None, meta_info: Any = None) -> Any:
        batch = dict(tensors) if tensors else None
        if batch and BATCH_AS_TENSORDICT:
            batch = TensorDict(batch, batch_size=[len(next(iter(batch.values())))])
        return cls(batch, dict(non_tensors or {}), dict(meta_info or {}))

    def __len__(self) -> int:
        return len(next(iter(self.batch.values())))

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

    def to_tensordict(self) -> Any:
        """protocol.py L1099-1123: the batch's tensors in its key order, each non-tensor key
        as a ``NonTensorStack`` of one ``NonTensorData`` per row, ``meta_info`` items as
        ``NonTensorData``."""
        tensors: dict[str, Any] = dict(self.batch.items())
        for key, values in self.non_tensor_batch.items():
            tensors[key] = _stack(values)
        return get_tensordict(tensors, self.meta_info)

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


# -- the legacy trainer's conversions (utils/tensordict_utils.py, workers/utils/padding.py) ----


def _stack(values: Any) -> Any:
    return NonTensorStack.from_list([NonTensorData(item) for item in values])


def get_tensordict(tensors: dict[str, Any], non_tensors: dict[str, Any] | None = None) -> Any:
    """tensordict_utils.py L377-455: lists become stacks, ``non_tensors`` ``NonTensorData``
    after everything else; the batch size is the first entry's length."""
    tensors, rows = dict(tensors), None
    for key, value in tensors.items():
        if isinstance(value, list | np.ndarray):
            tensors[key] = _stack(value)
        if rows is None:
            rows = value.size(0) if isinstance(value, torch.Tensor) else len(value)
    for key, value in (non_tensors or {}).items():
        tensors[key] = NonTensorData(value)
    return TensorDict(source=tensors, batch_size=[] if rows is None else [rows])


def assign_non_tensor(td: Any, **values: Any) -> Any:
    """tensordict_utils.py L76-107: each value as ``NonTensorData`` (a list as a stack)."""
    for key, value in values.items():
        if isinstance(value, NonTensorData | NonTensorStack):
            td[key] = value
        else:
            td[key] = _stack(value) if isinstance(value, list) else NonTensorData(value)
    return td


def left_right_2_no_padding(td: Any) -> Any:
    """padding.py L23-94, for text (1-D position ids, no routed experts or teacher): the
    padded ``input_ids`` become a jagged tensor of the valid tokens (moved to the end),
    ``position_ids`` one in place, the flat indices of the valid tokens (``unpad_input``'s
    pure-torch path, attention_utils.py L37-50) and the padded lengths ``NonTensorData``,
    and ``loss_mask`` the ``response_mask`` itself."""
    input_ids = td.pop("input_ids")
    mask, position_ids = td["attention_mask"], td["position_ids"]
    td["max_seq_len"] = NonTensorData(input_ids.shape[1])
    td["max_response_len"] = NonTensorData(td["response_mask"].shape[1])
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(
        torch.cumsum(mask.sum(dim=-1, dtype=torch.int32), 0, dtype=torch.int32), (1, 0)
    )
    td["indices"] = NonTensorData(indices)
    valid = input_ids.unsqueeze(-1).reshape(-1, 1)[indices].squeeze(-1)
    td["input_ids"] = torch.nested.nested_tensor_from_jagged(valid, offsets=cu_seqlens)
    rows = [position_ids[i][mask[i].bool()] for i in range(mask.shape[0])]
    td["position_ids"] = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    td["loss_mask"] = td["response_mask"]
    return td


def chunk_tensordict(td: Any, chunks: int) -> list[Any]:
    """tensordict_utils.py L302-374, for 1-D rows: ``TensorDict.chunk`` of the plain entries
    (views), each jagged key rebuilt per chunk from its rows (new tensors). The jagged keys
    are a set, as in verl: their order follows ``PYTHONHASHSEED``."""
    size = len(td) // chunks
    nested = {
        key for key, value in td.items() if isinstance(value, torch.Tensor) and value.is_nested
    }
    plain = {key: value for key, value in td.items() if key not in nested}
    parts = TensorDict(plain, batch_size=td.batch_size, device=td.device).chunk(chunks=chunks)
    for key in nested:
        rows = td[key].unbind(dim=0)
        for i, part in enumerate(parts):
            part[key] = torch.nested.as_nested_tensor(
                list(rows[i * size : (i + 1) * size]), layout=torch.jagged
            )
    return list(parts)


def contiguous(td: Any) -> Any:
    """tensordict_utils.py L883-907: a new TensorDict, tensors made contiguous, every
    ``NonTensorData`` after the tensors and stacks."""
    tensors, non_tensors = {}, {}
    for key in td.keys():  # noqa: SIM118 (a TensorDict iterates over its rows)
        value = td.get(key)
        if isinstance(value, NonTensorData):
            non_tensors[key] = value
        else:
            tensors[key] = value if isinstance(value, NonTensorStack) else value.contiguous()
    return get_tensordict(tensors, non_tensors)


def chunk_batch(data: Any, chunks: int) -> list[Any]:
    """``BatchData(data).chunk`` (protocol.py L1268-1278): a TensorDict into consolidated
    chunks, one storage each; a ``DataProto`` by its own ``chunk``. Chunk a TensorDict once:
    consolidating locks the stacks' items, which are the parent's, and a second chunking
    would pickle them as locked."""
    if HAS_TENSORDICT and isinstance(data, TensorDict):
        return [contiguous(part).consolidate() for part in chunk_tensordict(data, chunks)]
    return data.chunk(chunks=chunks)


def concat_batch(items: list[Any]) -> Any:
    """``BatchData(items).concat`` (protocol.py): TensorDicts by ``cat``, else ``concat``."""
    if HAS_TENSORDICT and isinstance(items[0], TensorDict):
        return torch.cat(items, dim=0)
    return DataProto.concat(items)


# -- one step of the legacy trainer (trainer/ppo/ray_trainer.py) ------------------------------


def legacy_calls(mini_batch_size: int) -> list[tuple[str, str, dict[str, Any]]]:
    """The data calls of one step of ``RayPPOTrainer.fit``, in order: each worker-group
    method, its mesh, and the flags its ``_compute_*`` or ``_update_*`` method assigns
    (ray_trainer.py L1252-1411; _generated_ppo_trainer.yaml's defaults, ``mini_batch_size``
    standing for ppo_mini_batch_size times rollout.n). ``_update_actor`` first sets
    :data:`UPDATE_ACTOR_META` in the batch's ``meta_info``."""
    train = {"global_batch_size": mini_batch_size, "mini_batch_size": mini_batch_size,
             "epochs": 1, "seed": 42, "dataloader_kwargs": {"shuffle": False}}  # fmt: skip
    actor = {"calculate_entropy": False, "distillation_use_topk": False,
             "distillation_only": False, **train, "compute_loss": True}  # fmt: skip
    return [
        ("compute_log_prob", "actor",
         {"calculate_entropy": True, "calculate_sum_pi_squared": False, "compute_loss": False}),
        ("compute_ref_log_prob", "ref", {"calculate_entropy": False, "compute_loss": False}),
        ("infer_batch", "train", {"compute_loss": False}),  # the critic's values
        ("train_mini_batch", "train", train),  # the critic's update
        ("update_actor", "actor", actor),
    ]  # fmt: skip


UPDATE_ACTOR_META = {"multi_turn": False, "temperature": 1.0}


def rollout(
    rows: int, prompt_len: int, response_len: int, seed: int, per_prompt: int = 8
) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray], dict[str, Any]]:
    """Not verl's: a batch as its agent loop hands text rollouts to the legacy trainer, for
    ``DataProto.from_dict``: prompts left-padded and responses right-padded to random lengths,
    the masks and position ids; uid (``per_prompt`` responses a prompt), data_source,
    __num_turns__, reward_model; temperature, global_token_num, images_seqlens."""
    g = torch.Generator().manual_seed(seed)
    p_valid = torch.randint(prompt_len // 4, prompt_len + 1, (rows,), generator=g)
    r_valid = torch.randint(1, response_len + 1, (rows,), generator=g)
    p_mask = (torch.arange(prompt_len)[None, :] >= (prompt_len - p_valid)[:, None]).long()
    r_mask = (torch.arange(response_len)[None, :] < r_valid[:, None]).long()
    mask = torch.cat([p_mask, r_mask], 1)
    prompts = torch.randint(1, 32_000, (rows, prompt_len), generator=g) * p_mask
    responses = torch.randint(1, 32_000, (rows, response_len), generator=g) * r_mask
    tensors = {"prompts": prompts, "responses": responses, "response_mask": r_mask,
               "input_ids": torch.cat([prompts, responses], 1), "attention_mask": mask,
               "position_ids": torch.clamp(torch.cumsum(mask, 1) - 1, min=0)}  # fmt: skip
    non_tensors = {
        "uid": np.array([f"{seed}-{i // per_prompt}" for i in range(rows)], dtype=object),
        "data_source": np.array(["openai/gsm8k"] * rows, dtype=object),
        "__num_turns__": np.full(rows, 2, dtype=np.int32),
        "reward_model": np.array([{"ground_truth": str(i)} for i in range(rows)], dtype=object),
    }
    meta = {"temperature": 1.0, "global_token_num": mask.sum(-1).tolist(), "images_seqlens": []}
    return tensors, non_tensors, meta


def convert(batch: DataProto, flags: dict[str, Any]) -> Any:
    """What each of the legacy trainer's data calls sends its worker group, made afresh from
    the current batch."""
    return assign_non_tensor(left_right_2_no_padding(batch.to_tensordict()), **flags)


# -- the Ray dispatch (single_controller/base/decorator.py, utils/ray_utils.py) ---------------


class Dispatch(enum.Enum):
    ONE_TO_ALL = "one_to_all"
    DP_COMPUTE_PROTO = "dp_compute_proto"


def register(dispatch_mode: Any, blocking: bool = True) -> Callable[[Any], Any]:
    def decorate(func: Any) -> Any:
        func.dispatch_mode, func.blocking = dispatch_mode, blocking
        return func

    return decorate


def dispatch_one_to_all(worker_group: Any, *args: Any, **kwargs: Any) -> Any:
    n = worker_group.world_size
    return tuple([arg] * n for arg in args), {k: [v] * n for k, v in kwargs.items()}


def collect_all_to_all(worker_group: Any, output: Any) -> Any:
    return output


def dispatch_dp_compute_data_proto(worker_group: Any, *args: Any, **kwargs: Any) -> Any:
    n = worker_group.world_size
    return [a.chunk(n) for a in args], {k: v.chunk(n) for k, v in kwargs.items()}


def collect_dp_compute_data_proto(worker_group: Any, output: Any) -> Any:
    return concat_batch(output)


DISPATCH = {
    Dispatch.ONE_TO_ALL: {"dispatch_fn": dispatch_one_to_all, "collect_fn": collect_all_to_all},
    Dispatch.DP_COMPUTE_PROTO: {
        "dispatch_fn": dispatch_dp_compute_data_proto,
        "collect_fn": collect_dp_compute_data_proto,
    },
}


def parallel_put(data_list: list[Any], max_workers: int | None = None) -> list[Any]:
    """ray_utils.py L51-84: ``ray.put`` every item from a thread pool; the refs in order."""
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


def dispatch_nd_compute_dataproto(
    dp_rank_mapping: list[int], dp_size: int, worker_group: Any, *args: Any, **kwargs: Any
) -> Any:
    """decorator.py L71-88 and L202-233: chunk per DP rank, put the chunks, and give every
    worker its DP rank's ref (so the TP ranks of one DP rank share it)."""
    args = [chunk_batch(arg, dp_size) for arg in args]  # _split_args_kwargs_data_proto
    kwargs = {k: chunk_batch(v, dp_size) for k, v in kwargs.items()}
    max_workers = max(1, min(len(args[0]), os.cpu_count() or 1))  # dispatch_nd_compute
    args = [parallel_put(arg, max_workers=max_workers) for arg in args]
    kwargs = {k: parallel_put(v, max_workers=max_workers) for k, v in kwargs.items()}
    ranks = range(worker_group.world_size)
    all_args = tuple([arg[dp_rank_mapping[i]] for i in ranks] for arg in args)
    return all_args, {k: [v[dp_rank_mapping[i]] for i in ranks] for k, v in kwargs.items()}


def collect_nd_compute_dataproto(collect_mask: list[bool], worker_group: Any, output: Any) -> Any:
    return concat_batch([out for out, keep in zip(output, collect_mask, strict=True) if keep])


def _dispatch_lazy(mesh_name: str, worker_group: Any, *args: Any, **kwargs: Any) -> Any:
    if mesh_name not in worker_group._dispatch_info:
        worker_group._dispatch_info[mesh_name] = worker_group._query_dispatch_info(mesh_name)
    mapping = worker_group._dispatch_info[mesh_name]
    return dispatch_nd_compute_dataproto(mapping, max(mapping) + 1, worker_group, *args, **kwargs)


def _collect_lazy(mesh_name: str, worker_group: Any, output: Any) -> Any:
    if mesh_name not in worker_group._collect_info:
        worker_group._collect_info[mesh_name] = worker_group._query_collect_info(mesh_name)
    return collect_nd_compute_dataproto(worker_group._collect_info[mesh_name], worker_group, output)


def make_nd_compute_dataproto_dispatch_fn(mesh_name: str) -> dict[str, Any]:
    """decorator.py L266-304: the DP ranks asked of the workers on the mesh's first use."""
    return {
        "dispatch_fn": partial(_dispatch_lazy, mesh_name),
        "collect_fn": partial(_collect_lazy, mesh_name),
    }


# -- workers and worker groups (single_controller/base/worker.py, ray/base.py) ----------------


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


def func_generator(
    self: Any, method_name: str, dispatch_fn: Any, collect_fn: Any, execute_fn: Any, blocking: bool
) -> Any:
    """ray/base.py L49-67 (without auto-padding): one group method."""

    class Functor:
        def __call__(this, *args: Any, **kwargs: Any) -> Any:
            args, kwargs = dispatch_fn(self, *args, **kwargs)
            output = execute_fn(method_name, *args, **kwargs)
            if blocking:
                output = ray.get(output)
            return collect_fn(self, output)

    return type(method_name, (Functor,), {})()


class RayWorkerGroup:
    """The fan-out part of verl's ``RayWorkerGroup``: ``world_size`` actors of a
    :class:`Worker` subclass (the i-th of rank i), one group method per registered method
    (as ``_bind_worker_method`` makes them); no resource pools, no fused workers."""

    def __init__(self, worker_cls: type, world_size: int, num_cpus: float) -> None:
        actor_cls = ray.remote(num_cpus=num_cpus)(worker_cls)
        self._workers = [actor_cls.remote(rank) for rank in range(world_size)]
        self._dispatch_info: dict[str, list[int]] = {}
        self._collect_info: dict[str, list[bool]] = {}
        for name in dir(worker_cls):
            method = getattr(worker_cls, name)
            mode = getattr(method, "dispatch_mode", None)
            if mode is not None:
                fns = DISPATCH[mode] if isinstance(mode, Dispatch) else mode
                method = func_generator(
                    self, name, **fns, execute_fn=self.execute_all, blocking=method.blocking
                )
                setattr(self, name, method)

    @property
    def world_size(self) -> int:
        return len(self._workers)

    @property
    def workers(self) -> list[Any]:
        return self._workers

    def _execute_remote_single_worker(
        self, worker: Any, method_name: str, *args: Any, **kwargs: Any
    ) -> Any:
        return getattr(worker, method_name).remote(*args, **kwargs)

    def execute_all(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self.execute_all_async(method_name, *args, **kwargs)

    def execute_all_async(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        """ray/base.py L862-890: list arguments of ``world_size`` items are sliced, one item
        to each worker; anything else goes to every worker."""
        n = len(self._workers)
        values = [*args, *kwargs.values()]
        if all(isinstance(v, list) for v in values) and all(len(v) == n for v in values):
            return [
                self._execute_remote_single_worker(
                    worker,
                    method_name,
                    *(a[i] for a in args),
                    **{k: v[i] for k, v in kwargs.items()},
                )
                for i, worker in enumerate(self._workers)
            ]
        return [
            self._execute_remote_single_worker(worker, method_name, *args, **kwargs)
            for worker in self._workers
        ]


# -- what a worker received ---------------------------------------------------------------------


def checksum(value: Any) -> int:
    """xxh3-64 of everything a worker received: a tensor; a ``DataProto`` (each tensor's
    name, dtype, shape and bytes, its non-tensor arrays and ``meta_info``); a TensorDict
    (each entry by name: tensors, jagged tensors by their values and offsets, the data of
    ``NonTensorData`` and stacks)."""
    h = xxhash.xxh3_64()
    if isinstance(value, torch.Tensor):
        _update(h, value)
    elif HAS_TENSORDICT and isinstance(value, TensorDict):
        for key in sorted(value.keys()):
            entry = value.get(key)
            h.update(key.encode())
            if isinstance(entry, torch.Tensor):
                _update(h, entry)
            elif isinstance(entry, NonTensorStack):
                h.update(repr(entry.tolist()).encode())
            elif isinstance(entry.data, torch.Tensor):
                _update(h, entry.data)
            else:
                h.update(repr(entry.data).encode())
    else:
        for key in sorted(value.batch.keys()):
            tensor = value.batch[key]
            h.update(f"{key} {tensor.dtype} {tuple(tensor.shape)}".encode())
            h.update(tensor.contiguous().numpy())
        for key in sorted(value.non_tensor_batch):
            h.update("\0".join(map(str, value.non_tensor_batch[key])).encode())
        h.update(repr(sorted(value.meta_info.items())).encode())
    return h.intdigest()


def _update(h: Any, tensor: torch.Tensor) -> None:
    if tensor.is_nested:
        for part in (tensor.values(), tensor.offsets()):
            _update(h, part)
        return
    h.update(f"{tensor.dtype} {tuple(tensor.shape)}".encode())
    h.update(tensor.contiguous().view(-1).view(torch.uint8).numpy())
