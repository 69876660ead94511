"""SkyRL's PPORayActorGroup, mirrored: one forward batch for critic, reference and policy.

Mirrored from SkyRL 0.3.0 (the ``skyrl`` package: skyrl/backends/skyrl_train/workers/worker.py,
distributed/dispatch.py, training_batch.py; skyrl/train/trainer.py); skyrl-train 0.4.0 and
main (a9564572) dispatch the same way. ``async_run_ray_method("mesh", ...)`` chunks a
``TrainingInputBatch`` per DP rank and ``ray.put``s each chunk; ``"pass_through"`` sends its
arguments by value. ``fwd_logprobs_values_reward`` sends the same ``data_fwd_pass`` to the
critic, the reference and the policy. (The training step's staged chunks are put once per
mini-batch and bypass the group.) refshare wraps the method ``refshare.enable("skyrl")`` wraps.

Run: python examples/skyrl_style.py
"""

from __future__ import annotations

import zlib
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import ray

import refshare

PUTS: Counter[str] = Counter()  # the example's counter, for the "without refshare" column


def ray_put(value: Any) -> Any:  # the mirror calls this where SkyRL calls ray.put
    PUTS["ray.put"] += 1
    return ray.put(value)


# -- SkyRL 0.3.0, mirrored -------------------------------------------------------------------


def _rebuild_tensor_batch(cls, state):
    obj = dict.__new__(cls)
    obj.__setstate__(state)
    return obj


class TensorBatch(dict):  # numpy arrays stand in for CPU tensors
    metadata = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        keys = list(self.keys())  # _check_consistency
        self._batch_size = len(self[keys[0]]) if keys else None

    def __len__(self):
        return self._batch_size

    def __reduce__(self):  # pickles each tensor's bytes, not the dict's items
        return (_rebuild_tensor_batch, (type(self), self.__getstate__()))

    def __getstate__(self):
        batch_dict = {
            k: {"format": "numpy", "data": v.tobytes(), "shape": v.shape, "dtype": str(v.dtype)}
            for k, v in self.items()
        }
        return {"batch_dict": batch_dict, "batch_size": self._batch_size, "metadata": self.metadata}

    def __setstate__(self, state):
        for key, v in state["batch_dict"].items():
            self[key] = np.frombuffer(v["data"], dtype=v["dtype"]).reshape(v["shape"])
        self._batch_size, self.metadata = state["batch_size"], state["metadata"]

    def select(self, keys, metadata_keys=None):
        new_batch = self.__class__({key: self[key] for key in keys})
        new_batch.metadata = {key: self.metadata[key] for key in metadata_keys or ()}
        return new_batch

    def chunk(self, chunk_size):
        chunks = []
        for i in range(0, self._batch_size, chunk_size):
            chunk = self.__class__({k: v[i : i + chunk_size] for k, v in self.items()})
            chunk.metadata = self.metadata
            chunks.append(chunk)
        return chunks


class TrainingInputBatch(TensorBatch):
    pass


@dataclass
class MeshRank:  # (sp, tp, pp and their sizes left out)
    dp: int
    dp_size: int


@dataclass
class ActorInfo:
    handle: Any
    rank: MeshRank


class MeshDispatch:
    @classmethod
    def dispatch(cls, actor_infos, method, data, **kwargs):
        object_refs = []
        dp_size = actor_infos[0].rank.dp_size
        assert len(data) % dp_size == 0, "data batch size must be divisible by dp_size"
        chunk_size = len(data) // dp_size
        data_chunks = data.chunk(chunk_size)

        # Put each unique chunk in object store ONCE to avoid redundant serialization
        # when the same chunk is sent to multiple workers (e.g., SP/TP replicas)
        chunk_refs = [ray_put(chunk) for chunk in data_chunks]

        for actor_info in actor_infos:
            chunk_ref = chunk_refs[actor_info.rank.dp]
            object_refs.append(getattr(actor_info.handle, method).remote(chunk_ref, **kwargs))
        return object_refs

    @classmethod
    def validate_dispatch_args(cls, *args, **kwargs):
        data = args[0] if args else kwargs.pop("data")
        assert isinstance(data, TrainingInputBatch), type(data)
        return (data,), kwargs


class PassThroughDispatch:
    @classmethod
    def dispatch(cls, actor_infos, method, *args, **kwargs):
        return [
            getattr(actor_info.handle, method).remote(*args, **kwargs) for actor_info in actor_infos
        ]

    @classmethod
    def validate_dispatch_args(cls, *args, **kwargs):
        return args, kwargs


class DispatchRegistry:
    _registry: ClassVar[dict[str, Any]] = {
        "mesh": MeshDispatch,
        "pass_through": PassThroughDispatch,
    }

    @classmethod
    def get(cls, name):
        return cls._registry[name]


class PPORayActorGroup:
    def __init__(self, actors, dp_size):  # SkyRL asks each actor for its get_mesh_rank()
        self._actor_handlers = actors
        self.actor_infos = [
            ActorInfo(a, MeshRank(i * dp_size // len(actors), dp_size))
            for i, a in enumerate(actors)
        ]

    def async_run_ray_method(self, dispatch_type: str, method_name: str, *args, **kwargs):
        dispatch_class = DispatchRegistry.get(dispatch_type)
        # validate the dispatch args to be sent to `.dispatch`
        args, kwargs = dispatch_class.validate_dispatch_args(*args, **kwargs)

        # Dispatch the method call
        object_refs = dispatch_class.dispatch(self.actor_infos, method_name, *args, **kwargs)
        return object_refs


def fwd_logprobs_values_reward(groups, training_input):  # RayPPOTrainer, via WorkerDispatch
    data_fwd_pass = training_input.select(
        keys=["sequences", "attention_mask"], metadata_keys=["response_length"]
    )
    outputs = {}
    for model in ("critic", "ref", "policy"):
        refs = groups[model].async_run_ray_method("mesh", "forward", data=data_fwd_pass)
        outputs[model] = np.concatenate(ray.get(refs))  # WorkerDispatch.forward
        if model == "ref":
            ray.get(groups[model].async_run_ray_method("pass_through", "empty_cache"))
    return outputs


# -- the workers and the steps -----------------------------------------------------------------


@ray.remote(num_cpus=0.1)
class Worker:
    """A policy, critic or reference worker: logs a checksum of every batch it is sent."""

    def __init__(self) -> None:
        self.received: list[int] = []

    def forward(self, data: TensorBatch) -> np.ndarray:
        crc = 0
        for key in sorted(data):
            crc = zlib.crc32(np.ascontiguousarray(data[key]).tobytes(), crc)
        self.received.append(crc)
        return -np.log1p(data["sequences"] % 97)

    def empty_cache(self) -> None:
        pass

    def take_received(self) -> list[int]:
        received, self.received = self.received, []
        return received


def run_steps(groups: dict[str, PPORayActorGroup], steps: list[Any]) -> tuple[Any, Any]:
    counts = []
    for arrays in steps:
        before = Counter({**PUTS, **refshare.stats()._asdict()})
        training_input = TrainingInputBatch(arrays)  # a new batch each step, as the trainer makes
        training_input.metadata = {"response_length": 1024}
        outputs = fwd_logprobs_values_reward(groups, training_input)
        assert all(len(value) == len(training_input) for value in outputs.values())
        counts.append(Counter({**PUTS, **refshare.stats()._asdict()}) - before)
    actors = [actor for group in groups.values() for actor in group._actor_handlers]
    return counts, ray.get([actor.take_received.remote() for actor in actors])


def main() -> None:
    ray.init(address="local", num_cpus=2, object_store_memory=256 << 20, include_dashboard=False)
    try:
        rng = np.random.default_rng(0)
        groups = {
            m: PPORayActorGroup([Worker.remote() for _ in range(2)], dp_size=2)
            for m in ("critic", "ref", "policy")
        }
        batches = [  # 128 sequences of 4096 tokens, plus masks and advantages: 4 MiB per DP chunk
            {
                "sequences": rng.integers(0, 32_000, (128, 4096)),
                "attention_mask": np.ones((128, 4096), dtype=np.int64),
                "advantages": rng.standard_normal((128, 1024), dtype=np.float32),
            }
            for _ in range(2)
        ]
        labels = ["1 new data", "2 same", "3 same", "4 new data"]
        steps = [batches[i] for i in (0, 0, 0, 1)]

        plain, plain_received = run_steps(groups, steps)
        refshare.patch_methods(PPORayActorGroup, "async_run_ray_method")  # as enable("skyrl")
        shared, shared_received = run_steps(groups, steps)
        assert shared_received == plain_received, "workers received different data"

        print("SkyRL 0.3.0 mirror; per step: one forward batch to critic, ref and policy (dp=2)")
        print("step         stored without refshare (ray.put)   stored with refshare   hits")
        for label, old, new in zip(labels, plain, shared, strict=True):
            print(f"{label:<12} {old['ray.put']:>33} {new['puts']:>22} {new['hits']:>6}")
        # The 2 DP chunks of data_fwd_pass are stored once in a step, and not again after.
        assert [row["puts"] for row in shared] == [2, 0, 0, 2], shared
        print(refshare.stats())
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
