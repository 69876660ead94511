"""ROLL main, mirrored where ROLL is not installed: its Cluster, dispatch and DataProto.

Mirrored from ROLL main 8eb27cc2 (2026-08-19; ``cluster.py`` and ``decorator.py`` as at
v0.3.0, 7f9d4d38), each piece naming the file and lines it follows (under ``roll/``). A
``Cluster`` creates one Ray actor per rank and binds every ``@register``ed worker method when
it is built: ``func_generator`` closes over the dispatch, the collect and the bound
``execute_all`` (captured then), which looks ``execute_all_async`` up on the class at call
time. ``DP_MP_COMPUTE`` chunks a ``DataProto`` once per data-parallel rank and gives chunk
``d`` to every rank of DP group ``d``: by value, so each tensor-parallel rank's ``.remote()``
pickles the chunk again, and each cluster's call chunks and pickles the batch anew. A
``DataProto`` pickles as ``torch.save`` of its ``TensorDict``: tensordict's own where it is
installed, else a stand-in of tensordict 0.10.0's, so that this runs with torch alone.

``publish_as_roll`` gives the mirror ROLL's module names (here, and in each worker as it
starts), so that ``refshare.enable("roll")`` finds its ``Cluster``, and refshare its
``DataProto``, where it finds ROLL's. Not ROLL's: ``DP``, ``TP`` (the layout the example and
the benchmark use), ``checksum`` (what a worker received) and ``make_batch`` (a batch as
RLVR's step has it). examples/roll_style.py runs it; benchmarks/roll_step.py times it.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib.util
import io
import itertools
import os
import sys
import types
import zlib
from types import SimpleNamespace
from typing import Any

import numpy as np
import ray
import torch

MIRRORS = "ROLL main 8eb27cc2"
DP, TP = 2, 2
#: The name workers import this module by (tests/mirrors on their path): they publish the
#: mirror from it, and ``torch.load`` finds the stand-in TensorDict's class by it.
IMPORTABLE_AS = "roll_mirror"

try:
    import tensordict
    from tensordict import TensorDict

    HAS_TENSORDICT = True
except ImportError:  # the stand-in below
    HAS_TENSORDICT = False
    tensordict = SimpleNamespace(__version__="0.10.0")  # type: ignore[assignment]

    class TensorDict:  # type: ignore[no-redef]
        """tensordict 0.10.0's ``TensorDict`` as far as ROLL's ``DataProto`` uses it: tensors
        sharing a first dimension. Pickled by its attributes, as tensordict pickles one
        that is not consolidated (``tensordict/_reductions.py`` ``_reduce_td``)."""

        def __init__(self, source: Any, batch_size: Any, device: Any = None) -> None:
            self._tensordict = dict(source)
            self._batch_size = torch.Size(batch_size)
            self._device = device

        @property
        def batch_size(self) -> torch.Size:
            return self._batch_size

        def __len__(self) -> int:
            return self._batch_size[0]

        def keys(self) -> Any:
            return self._tensordict.keys()

        def items(self) -> Any:
            return self._tensordict.items()

        def __getitem__(self, index: Any) -> Any:
            if isinstance(index, str):
                return self._tensordict[index]
            rows = len(range(len(self))[index])  # a slice of rows
            return TensorDict({k: v[index] for k, v in self.items()}, [rows], self._device)

        def __setitem__(self, key: str, value: Any) -> None:
            self._tensordict[key] = value

        def clone(self) -> Any:
            clones = {k: v.clone() for k, v in self.items()}
            return TensorDict(clones, self._batch_size, self._device)

        @classmethod
        def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None):
            if func is not torch.cat:
                return NotImplemented
            parts = args[0]
            joined = {k: torch.cat([p[k] for p in parts]) for k in parts[0].keys()}  # noqa: SIM118
            return cls(joined, [sum(len(p) for p in parts)])

    TensorDict.__module__ = IMPORTABLE_AS


# -- roll/distributed/scheduler/protocol.py (and what it imports) -----------------------------


def divide_by_chunk_size(data: Any, chunk_sizes: list[int]) -> list[Any]:
    """roll/utils/functionals.py l.95-117: consecutive row slices (views) of these sizes."""
    bounds = [0, *itertools.accumulate(chunk_sizes)]
    return [data[start:stop] for start, stop in itertools.pairwise(bounds)]


def inject_trace_context(meta_info: dict[str, Any]) -> None:
    """roll/utils/telemetry.py l.87-97 with no tracer configured: the caller's ``meta_info``
    gains an empty carrier (a span's ``traceparent`` where one is)."""
    meta_info["_otel_ctx"] = {}


class BatchProxy:
    """remote_protocol.py l.133-156: what ``DataProto.batch`` returns (not a TensorDict)."""

    def __init__(self, batch: Any, remote_batch: Any, batch_size: int) -> None:
        self._batch, self._remote_batch, self._batch_size = batch, remote_batch, batch_size

    def __getitem__(self, key: str) -> Any:
        if self._batch is None or key not in self._batch.keys():  # noqa: SIM118
            raise KeyError(f"Key '{key}' not found in batch or remote_batch")
        return self._batch[key]

    def keys(self) -> Any:
        return self._batch.keys() if self._batch is not None else ()


class DataProto:
    """ROLL's batch: a TensorDict, object arrays beside it, a remote batch (TransferQueue's,
    left out: always ``None`` here) and ``meta_info``."""

    def __init__(  # l.161-174 (NPU casts of __post_init__ left out)
        self,
        batch: Any = None,
        non_tensor_batch: Any = None,
        remote_batch: Any = None,
        meta_info: Any = None,
    ) -> None:
        self._batch = batch
        self._non_tensor_batch = {} if non_tensor_batch is None else non_tensor_batch
        self._remote_batch = remote_batch
        self.meta_info = {} if meta_info is None else meta_info
        self.check_consistency()

    @property
    def batch(self) -> BatchProxy:  # l.176-180
        return BatchProxy(self._batch, self._remote_batch, len(self))

    @property
    def non_tensor_batch(self) -> BatchProxy:  # l.203-207
        return BatchProxy(self._non_tensor_batch, self._remote_batch, len(self))

    def __len__(self) -> int:  # l.245-252
        if self._batch is not None:
            return len(self._batch)
        if self._non_tensor_batch:
            return len(next(iter(self._non_tensor_batch.values())))
        return 0

    def __getstate__(self) -> Any:  # l.321-329
        # ROLL compares version strings: "0.10.0" >= "0.5.0" is False, so from tensordict
        # 0.10 on the batch is saved as it is, each tensor with its whole storage.
        consolidate = tensordict.__version__ >= "0.5.0"
        if consolidate and self._batch is not None:  # in place, on the sender's object
            self._batch = self._batch.contiguous().consolidate()
        saved = io.BytesIO()
        torch.save(self._batch, saved)
        return saved, self._non_tensor_batch, self._remote_batch, self.meta_info

    def __setstate__(self, state: Any) -> None:  # l.331-340 (no GPU: loaded to the CPU)
        saved, non_tensor_batch, remote_batch, meta_info = state
        saved.seek(0)
        self._batch = torch.load(saved, weights_only=False, map_location="cpu")
        self._non_tensor_batch = non_tensor_batch
        self._remote_batch = remote_batch
        self.meta_info = meta_info

    def check_consistency(self) -> None:  # l.342-370, the local checks
        if self._batch is not None:
            assert len(self._batch.batch_size) == 1, "only support num_batch_dims=1"
        for key, value in self._non_tensor_batch.items():
            assert isinstance(value, np.ndarray) and value.dtype == object, key
            assert self._batch is None or len(value) == len(self._batch), key

    @classmethod
    def from_dict(cls, tensors: Any, non_tensors: Any = None, meta_info: Any = None) -> Any:
        """l.396-431: one TensorDict of the tensors, each non-tensor as an object array."""
        batch_size = next(iter(tensors.values())).shape[:1]
        non_tensors = dict(non_tensors or {})
        for key, value in non_tensors.items():
            non_tensors[key] = np.empty(len(value), dtype=object)
            non_tensors[key][:] = value
        return cls(TensorDict(tensors, batch_size=batch_size), non_tensors, None, meta_info)

    def chunk(self, chunks: int) -> list[Any]:
        """l.835-883: ``np.array_split`` sizes, row slices, each TensorDict slice cloned (so
        a chunk owns its storage), the same ``meta_info`` object in every chunk."""
        sizes = [len(part) for part in np.array_split(np.arange(len(self)), chunks)]
        batches = [None] * chunks
        if self._batch is not None:
            batches = [part.clone() for part in divide_by_chunk_size(self._batch, sizes)]
        non_tensors: list[dict[str, Any]] = [{} for _ in range(chunks)]
        for key, value in self._non_tensor_batch.items():
            for i, part in enumerate(divide_by_chunk_size(value, sizes)):
                non_tensors[i][key] = part
        parts = zip(batches, non_tensors, strict=True)
        return [DataProto(b, n, None, self.meta_info) for b, n in parts]

    @staticmethod
    def concat(data: list[Any]) -> Any:
        """l.885-964: tensors by ``torch.cat``, arrays joined, ``meta_info`` from the first
        (its ``global_keys`` aggregation left out)."""
        if len(data) == 1:
            return data[0]
        batches = [d._batch for d in data if d._batch is not None]
        keys = data[0]._non_tensor_batch.keys()
        joined = {k: np.concatenate([d._non_tensor_batch[k] for d in data]) for k in keys}
        batch = torch.cat(batches, dim=0) if batches else None
        return DataProto(batch, joined, None, dict(data[0].meta_info))

    @staticmethod
    def materialize_concat(data_refs: list[Any]) -> Any:
        """l.1078-1118: fetch every rank's output, concatenate the collected ones."""
        fetched = ray.get([ref.obj_ref for ref in data_refs])
        pairs = zip(fetched, data_refs, strict=True)
        return DataProto.concat([data for data, ref in pairs if ref.collected])


class ObjectRefWrap:  # l.1196-1199
    def __init__(self, obj_ref: Any, collected: bool = False) -> None:
        self.obj_ref, self.collected = obj_ref, collected


# -- roll/distributed/scheduler/decorator.py --------------------------------------------------

BIND_WORKER_METHOD_FLAG = "BIND_WORKER_METHOD_FLAG"  # l.25


class Dispatch(enum.Enum):  # l.28-38 (ONE_TO_ALL_ONE, ALL_TO_ALL, ..._COLLECT_ALL left out)
    ONE_TO_ALL = enum.auto()
    DP_MP_COMPUTE = enum.auto()
    DP_MP_DISPATCH_FIRST = enum.auto()


class Execute(enum.Enum):  # l.41-43
    ALL = 0
    RANK_ZERO = 1


def _split_args_kwargs(chunks: int, *args: Any, **kwargs: Any) -> tuple[list[Any], Any]:
    """l.46-66: each argument's ``chunk(chunks)`` (a list: sliced into equal parts)."""

    def split(arg: Any) -> Any:
        if isinstance(arg, list):
            size = len(arg) // chunks
            return [arg[i : i + size] for i in range(0, len(arg), size)]
        return arg.chunk(chunks=chunks)

    return [split(a) for a in args], {k: split(v) for k, v in kwargs.items()}


def dispatch_one_to_all(cluster: Any, *args: Any, **kwargs: Any) -> Any:  # l.69-75
    return tuple([a] * cluster.world_size for a in args), {
        k: [v] * cluster.world_size for k, v in kwargs.items()
    }


def collect_all_to_all(cluster: Any, output: Any) -> Any:  # l.78-83
    assert len(output) == cluster.world_size
    return output


def _dispatch_dp_mp_compute(cluster: Any, dispatch_first: bool, *args: Any, **kwargs: Any):
    """l.111-145: chunk once per DP rank; rank ``i`` gets the chunk of its DP rank, the same
    object for every rank of one DP group. Dispatching first, ranks other than
    (tp 0, cp 0, pp 0) get a new ``DataProto`` of the chunk's ``meta_info`` only."""
    split_args, split_kwargs = _split_args_kwargs(cluster.dp_size, *args, **kwargs)

    def for_rank(chunks: Any, info: Any) -> Any:
        chunk = chunks[info.dp_rank]
        first = info.tp_rank == 0 and info.cp_rank == 0 and info.pp_rank == 0
        if dispatch_first and isinstance(chunk, DataProto) and not first:
            return DataProto(batch=None, meta_info=chunk.meta_info)
        return chunk

    def per_rank(chunks: Any) -> list[Any]:
        assert len(chunks) == cluster.dp_size
        return [for_rank(chunks, cluster.get_rank_info(rank=i)) for i in range(cluster.world_size)]

    return tuple(per_rank(c) for c in split_args), {k: per_rank(c) for k, c in split_kwargs.items()}


def dispatch_dp_mp_compute(cluster: Any, *args: Any, **kwargs: Any) -> Any:  # l.148-149
    return _dispatch_dp_mp_compute(cluster, False, *args, **kwargs)


def dispatch_dp_mp_dispatch_first(cluster: Any, *args: Any, **kwargs: Any) -> Any:  # l.152-153
    return _dispatch_dp_mp_compute(cluster, True, *args, **kwargs)


def need_collect_dp_mp_compute(info: Any) -> bool:  # l.155-156
    return info.tp_rank == 0 and info.is_pipeline_last_stage and info.cp_rank == 0


def collect_dp_mp_compute(cluster: Any, output: Any) -> Any:
    """l.158-183: the outputs of tp 0 / last pp stage / cp 0: lists chained, DataProtos
    concatenated, refs (``blocking=False``) wrapped with whether they are collected."""
    infos = [cluster.get_rank_info(rank=i) for i in range(cluster.world_size)]
    if isinstance(output[0], ray.ObjectRef):
        pairs = zip(output, infos, strict=True)
        return [ObjectRefWrap(o, need_collect_dp_mp_compute(info)) for o, info in pairs]
    kept = [o for o, info in zip(output, infos, strict=True) if need_collect_dp_mp_compute(info)]
    if isinstance(output[0], list):
        return list(itertools.chain.from_iterable(kept))
    if isinstance(output[0], DataProto):
        return DataProto.concat(kept)
    raise NotImplementedError(f"output type {type(output[0])}")


predefined_dispatch_mode_fn = {  # l.186-211
    Dispatch.ONE_TO_ALL: {"dispatch_fn": dispatch_one_to_all, "collect_fn": collect_all_to_all},
    Dispatch.DP_MP_COMPUTE: {
        "dispatch_fn": dispatch_dp_mp_compute,
        "collect_fn": collect_dp_mp_compute,
    },
    Dispatch.DP_MP_DISPATCH_FIRST: {
        "dispatch_fn": dispatch_dp_mp_dispatch_first,
        "collect_fn": collect_dp_mp_compute,
    },
}
predefined_execute_mode_fn = {  # l.218-221
    Execute.ALL: {"execute_fn_name": "execute_all"},
    Execute.RANK_ZERO: {"execute_fn_name": "execute_rank_zero"},
}


def func_generator(cls: Any, method_name: str, dispatch_fn: Any, collect_fn: Any, execute_fn: Any):
    """l.232-255: the Cluster's method: trace context into each DataProto's ``meta_info``,
    dispatch, the captured ``execute_fn``, ``ray.get`` when blocking, collect."""

    def func(*args: Any, blocking: bool = True, **kwargs: Any) -> Any:
        if method_name == "initialize":
            cls.initialized = True
        for arg in (*args, *kwargs.values()):
            if isinstance(arg, DataProto):
                inject_trace_context(arg.meta_info)
        args, kwargs = dispatch_fn(cls, *args, **kwargs)
        output = execute_fn(method_name, *args, **kwargs)
        if blocking:
            output = ray.get(output)  # (the roll_RPC_TIMEOUT environment variable left out)
        return collect_fn(cls, output)

    return func


def register(dispatch_mode: Any = Dispatch.ONE_TO_ALL, execute_mode: Any = Execute.ALL):
    """l.272-371: the worker function wrapped (ROLL's wrapper traces, prefetches and clears
    caches around the call) and flagged with its dispatch and execute modes."""

    def decorator(func: Any) -> Any:
        @functools.wraps(func)
        def inner(*args: Any, **kwargs: Any) -> Any:
            return func(*args, **kwargs)

        setattr(inner, BIND_WORKER_METHOD_FLAG, {"dispatch_mode": dispatch_mode,
                                                 "execute_mode": execute_mode})  # fmt: skip
        return inner

    return decorator


# -- roll/distributed/executor/worker.py, roll/configs/worker_config.py -----------------------


@dataclasses.dataclass
class RankInfo:  # worker.py l.26-42
    world_size: int = 1
    tp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    cp_size: int = 1
    rank: int = 0
    tp_rank: int = 0
    dp_rank: int = 0
    pp_rank: int = 0
    cp_rank: int = 0

    @property
    def is_pipeline_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


@dataclasses.dataclass
class WorkerConfig:  # worker_config.py l.88-140, the fields a CPU Cluster reads
    name: str = ""
    world_size: int = 1
    system_envs: dict[str, str] = dataclasses.field(default_factory=dict)


class Worker:
    """worker.py l.45-137: its rank from the environment the Cluster gave it (the shared
    storage actor, master address and port, and model setup left out)."""

    def __init__(self, worker_config: WorkerConfig) -> None:
        self.worker_config = worker_config
        self.cluster_name = os.environ.get("CLUSTER_NAME")
        self.rank = int(os.environ.get("RANK", 0))
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.rank_info = RankInfo(world_size=self.world_size, rank=self.rank,
                                  dp_rank=self.rank, dp_size=self.world_size)  # fmt: skip

    def get_rank_info(self) -> RankInfo:
        return self.rank_info


# -- roll/distributed/executor/cluster.py ----------------------------------------------------


class Cluster:
    """One Ray actor per rank, and one method per registered worker method, bound at build."""

    def __init__(self, name: str, worker_cls: Any, resource_manager: Any, worker_config: Any):
        self.cluster_name = name  # l.33-72 (placement groups, devices and nodes left out)
        has_actor_class = hasattr(worker_cls, "__ray_actor_class__")
        self.worker_cls = worker_cls if has_actor_class else ray.remote(worker_cls)
        self.resource_manager = resource_manager
        self.worker_config = worker_config
        self.world_size = worker_config.world_size
        self.workers: list[Any] = []
        self._create_workers()
        self._bind_worker_method()
        self._worker_rank_info: list[Any] | None = None
        self.initialized = False
        del self.worker_cls  # so that a Cluster can be sent to an actor

    @property
    def dp_size(self) -> int:  # l.74-76
        return self.worker_rank_info[0].dp_size

    @property
    def worker_rank_info(self) -> list[Any]:  # l.97-102: asked again until initialized
        if not self._worker_rank_info or not self.initialized:
            self._worker_rank_info = self.execute_all_sync(method_name="get_rank_info")
        return self._worker_rank_info

    def get_rank_info(self, rank: int) -> Any:  # l.104-106
        assert 0 <= rank < self.world_size, f"rank must be from [0, world_size), Got {rank}"
        return self.worker_rank_info[rank]

    def _create_workers(self) -> None:
        """l.108-179: each rank's actor, its rank in its environment, a hundredth of a CPU."""
        for rank in range(self.world_size):
            worker_name = f"{self.cluster_name}-{rank}"
            env_vars = {"WORLD_SIZE": str(self.world_size), "RANK": str(rank),
                        "LOCAL_RANK": "0", "CLUSTER_NAME": self.cluster_name,
                        "WORKER_NAME": worker_name, **self.worker_config.system_envs}  # fmt: skip
            options = {"runtime_env": {"env_vars": env_vars}, "num_cpus": 0.01,
                       "max_concurrency": 1}  # fmt: skip
            worker = self.worker_cls.options(**options).remote(worker_config=self.worker_config)
            self.workers.append(worker)

    def _bind_worker_method(self) -> None:
        """l.181-233: for each flagged worker method, a function from ``func_generator`` set
        on this instance, holding the dispatch, collect and bound ``execute_all`` of now."""
        for method_name in dir(self.worker_cls):
            if method_name.startswith("_"):
                continue
            try:
                method = getattr(self.worker_cls, method_name)
            except Exception:
                continue
            attribute = getattr(method, BIND_WORKER_METHOD_FLAG, None)
            if attribute is None:
                continue
            fns = predefined_dispatch_mode_fn[attribute["dispatch_mode"]]
            execute = predefined_execute_mode_fn[attribute["execute_mode"]]["execute_fn_name"]
            execute_fn = getattr(self, execute)
            func = func_generator(self, method_name, fns["dispatch_fn"], fns["collect_fn"],
                                  execute_fn)  # fmt: skip
            setattr(self, method_name, func)

    # l.235-263: the fan-out. execute_all and execute_rank_zero look the *_async up at call
    # time: what refshare.enable("roll") wraps.
    def execute_rank_zero_sync(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        return ray.get(self.execute_rank_zero_async(method_name, *args, **kwargs))

    def execute_rank_zero_async(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.workers[0], method_name).remote(*args, **kwargs)

    def execute_rank_zero(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        return self.execute_rank_zero_async(method_name, *args, **kwargs)

    def execute_all(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        return self.execute_all_async(method_name, *args, **kwargs)

    def execute_all_sync(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        return ray.get(self.execute_all_async(method_name, *args, **kwargs))

    def execute_all_async(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Lists of one item per worker are sliced, worker ``i`` getting the ``i``-th items;
        any other arguments go whole to every worker."""
        n = len(self.workers)
        values = (*args, *kwargs.values())
        if all(isinstance(v, list) and len(v) == n for v in values):
            return [
                getattr(worker, method_name).remote(
                    *(a[i] for a in args), **{k: v[i] for k, v in kwargs.items()}
                )
                for i, worker in enumerate(self.workers)
            ]
        return [getattr(w, method_name).remote(*args, **kwargs) for w in self.workers]


#: Where ROLL defines what the mirror defines (the stand-in TensorDict stays this file's).
ROLL_MODULES = {
    "roll.configs.worker_config": ("WorkerConfig",),
    "roll.distributed.scheduler.protocol": ("DataProto", "ObjectRefWrap", "tensordict"),
    "roll.distributed.scheduler.remote_protocol": ("BatchProxy",),
    "roll.distributed.scheduler.decorator": ("Dispatch", "Execute", "register"),
    "roll.distributed.executor.worker": ("Worker", "RankInfo"),
    "roll.distributed.executor.cluster": ("Cluster",),
}


def roll_is_installed() -> bool:
    """Whether ROLL itself can be imported here (``PYTHONPATH=/path/to/ROLL``)."""
    if isinstance(sys.modules.get("roll"), types.ModuleType) and not hasattr(
        sys.modules["roll"], "__path__"
    ):
        return False  # the mirror, published
    spec = importlib.util.find_spec("roll")
    return spec is not None and any(
        os.path.exists(os.path.join(p, "distributed", "executor", "cluster.py"))
        for p in spec.submodule_search_locations or ()
    )


def publish_as_roll() -> None:
    """Give the mirror ROLL's module names in this process, so that ``refshare.enable("roll")``
    finds its Cluster and refshare keys its DataProto as ROLL's. Pickles then name its
    classes as ROLL's, by reference, as they name ROLL's: each worker must publish it too,
    before it unpickles one (``main`` makes this Ray's ``worker_process_setup_hook``)."""
    if "roll" in sys.modules:
        raise RuntimeError("ROLL is imported here: the mirror cannot take its names")
    names = {n.rsplit(".", depth)[0] for n in ROLL_MODULES for depth in range(n.count(".") + 1)}
    for name in sorted(names, key=len):
        sys.modules[name] = types.ModuleType(name)
    for name, members in ROLL_MODULES.items():
        for member in members:
            value = globals()[member]
            setattr(sys.modules[name], member, value)
            if isinstance(value, type):  # the class and its methods, as ROLL's own
                value.__module__ = name
                for attribute in vars(value).values():
                    function = getattr(attribute, "__func__", attribute)
                    if isinstance(function, types.FunctionType):
                        function.__module__ = name


# -- not ROLL's: what a worker received, and a batch ------------------------------------------


def checksum(data: Any) -> int:
    """What a worker received of a DataProto (not ROLL's): each tensor's key, dtype, shape,
    stride and bytes, the non-tensor arrays, the ``meta_info``."""
    crc = 0
    batch = data._batch
    for key in batch.keys() if batch is not None else ():
        t = batch[key]
        crc = zlib.crc32(f"{key} {t.dtype} {tuple(t.shape)} {t.stride()}".encode(), crc)
        crc = zlib.crc32(t.contiguous().view(-1).view(torch.uint8).numpy(), crc)
    for key, value in data._non_tensor_batch.items():
        crc = zlib.crc32(f"{key} {value.tolist()}".encode(), crc)
    return zlib.crc32(repr(sorted(data.meta_info.items())).encode(), crc)


def make_batch(seed: int, rows: int = 64, prompt: int = 1024, response: int = 3072) -> Any:
    """A batch as RLVR's step has it before its log-probs (rlvr_pipeline.py l.555-572):
    prompts, responses of random lengths, their masks and positions, ids, object arrays
    beside them, ``meta_info``."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(response // 4, response + 1, (rows,), generator=g)
    response_mask = (torch.arange(response) < lengths[:, None]).long()
    attention_mask = torch.cat([torch.ones(rows, prompt, dtype=torch.int64), response_mask], 1)
    tensors = {
        "prompts": torch.randint(0, 32_000, (rows, prompt), generator=g),
        "responses": torch.randint(0, 32_000, (rows, response), generator=g) * response_mask,
        "attention_mask": attention_mask,
        "response_mask": response_mask,
        "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
        "prompt_id": torch.arange(rows),
    }
    tensors["input_ids"] = torch.cat([tensors["prompts"], tensors["responses"]], dim=1)
    non_tensors = {"domain": ["math"] * rows, "sample_uuid": [f"{seed}-{i}" for i in range(rows)]}
    meta = {"global_step": seed, "_broadcast_non_tensor_batch": True, "is_offload_states": False}
    return tensors, non_tensors, meta
