"""SkyRL 0.4.0, mirrored where SkyRL is not installed: its batch and how the trainer sends it.

Mirrored from SkyRL 0.4.0 (the ``skyrl`` package, paths under ``skyrl/``):

* ``backends/skyrl_train/training_batch.py``: ``TrainingInputBatch`` (``TensorBatch``,
  164-516), a dict of tensors whose ``__reduce__`` (286-295) sends
  ``(_rebuild_tensor_batch, (type, __getstate__()))``; ``__getstate__`` (297-332) makes the
  batch contiguous in place, then sends each tensor with ``_serialize_tensor`` (38-67): its
  elements' bytes, shape and dtype (a numpy array for ``ZERO_COPY_KEYS``; ``torch.save`` for
  a dtype numpy lacks); the worker's ``__setstate__`` (334-356) gets fresh tensors.
  ``select`` (182-204) shares the tensors, ``chunk`` and ``slice`` (402-445) make views.
  (``TensorList`` and ``PackedTensor`` fields are left out: this batch has none.)
* ``backends/skyrl_train/distributed/dispatch.py``: ``MeshDispatch.dispatch`` (104-123)
  chunks the batch per DP rank and ``ray.put``s each chunk; ``stage_chunks`` (125-164), a
  classmethod, slices each mini-batch, chunks it and ``ray.put``s each chunk;
  ``dispatch_from_staged`` (166-194) sends those refs.
* ``backends/skyrl_train/workers/worker.py``: ``PPORayActorGroup.async_run_ray_method``
  (952-970); ``workers/worker_dispatch.py``: ``WorkerDispatch.forward`` (237-281),
  ``forward_from_staged`` (283-329), ``stage_data`` (331-352).
* ``train/trainer.py``: ``fwd_logprobs_values_reward`` (1334-1437) sends one
  ``data_fwd_pass`` to the critic, the reference and the policy through
  ``_execute_forward_pass`` (1271-1304): with ``recompute_old_logprobs_per_minibatch``
  (``train/config/config.py:1545``, default True), the critic and the policy stage it per
  mini-batch with ``stage_data``; the reference (no mini-batches) goes through ``forward``.

refshare keys SkyRL's batch by a fingerprint registered for its module path, which the mirror
does not have: the mirror's class is registered the same way, with ``register_tensor_batch``
(the mirror is then keyed, sized and never split exactly as SkyRL's class is). Where torch is
missing, the batch holds numpy arrays instead (SkyRL's never does), keyed by a fingerprint of
the mirror's own: the arrays' elements, as its ``__getstate__`` sends them.

Not SkyRL's: ``ray_put`` and ``PUTS`` count what SkyRL stores without refshare, the counter
``SERIALIZED`` in ``__getstate__`` how often the driver serialized each chunk, and
``checksum`` says what a worker received (examples/skyrl_style.py runs it,
benchmarks/skyrl_step.py times it).
"""

from __future__ import annotations

import io
import os
import zlib
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import ray

import refshare
from refshare._integrations import skyrl as skyrl_integration

#: Set where torch is missing (before Ray starts, so that workers inherit it): workers, which
#: import this module by name, then hold numpy arrays too, even where they have torch.
NUMPY_ENV = "SKYRL_MIRROR_NUMPY"
try:
    if os.environ.get(NUMPY_ENV) == "1":
        raise ImportError(f"{NUMPY_ENV}=1")
    import torch
except ImportError:  # numpy arrays stand in for CPU tensors
    torch = None
    os.environ[NUMPY_ENV] = "1"

#: Under REFSHARE_VERIFY=1 refshare also serializes each argument by value, to check it.
PUTS: Counter[str] = Counter()  # the examples' counter, for the "without refshare" column
#: How often the driver serialized each chunk in a step, by (first row, rows).
SERIALIZED: Counter[tuple[int, int]] = Counter()


def ray_put(value: Any) -> Any:  # the mirror calls this where SkyRL calls ray.put
    PUTS["ray.put"] += 1
    return ray.put(value)


def chunk_label(batch: dict[str, Any]) -> tuple[int, int]:
    """Which rows a batch holds: ``sequences[:, 0]`` is each row's index in the step."""
    sequences = dict.__getitem__(batch, "sequences")
    return int(sequences[0, 0]), len(sequences)


# -- skyrl/backends/skyrl_train/training_batch.py ---------------------------------------------


def _serialize_tensor(value, *, zero_copy=False):
    try:
        arr = value.numpy() if torch is not None else np.asarray(value)
    except TypeError:  # a dtype numpy lacks (bfloat16)
        buffer = io.BytesIO()
        torch.save(value, buffer)
        return {"format": "torch", "data": buffer.getvalue()}
    if zero_copy:
        return {"format": "numpy_view", "data": arr}
    return {"format": "numpy", "data": arr.tobytes(), "shape": arr.shape, "dtype": str(arr.dtype)}


def _from_numpy(arr):
    return torch.from_numpy(arr) if torch is not None else arr


def _deserialize_tensor(value):
    if value.get("format") == "torch":
        return torch.load(io.BytesIO(value["data"]), weights_only=True)
    if value.get("format") == "numpy_view":
        return _from_numpy(value["data"])
    arr = np.frombuffer(value["data"], dtype=np.dtype(value["dtype"])).reshape(value["shape"])
    return _from_numpy(arr.copy())


def _rebuild_tensor_batch(cls, state):
    obj = dict.__new__(cls)
    obj.__setstate__(state)
    return obj


class TensorBatch(dict):
    metadata = None
    ZERO_COPY_KEYS: ClassVar[frozenset[str]] = frozenset(
        {"rollout_expert_indices", "rollout_sample_support"}
    )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._batch_size = None
        self._device = None
        self._check_consistency()

    def _check_consistency(self):
        keys = list(self.keys())
        if keys:
            self._batch_size = len(self[keys[0]])
        for key in keys:
            value = self[key]
            if value is None:
                continue
            self._device = getattr(value, "device", None) if self._device is None else self._device
            if len(value) != self._batch_size:
                raise ValueError(f"Batch size mismatch in {key}")

    def select(self, keys, metadata_keys=None):
        selected = {key: self[key] for key in keys}
        if metadata_keys is None:
            metadata = self.metadata
        else:
            metadata = {key: self.metadata[key] for key in metadata_keys}
        new_batch = self.__class__(selected)
        new_batch.metadata = metadata
        return new_batch

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index.start, index.stop, index.step)
        if isinstance(index, int):
            return self.slice(index, index + 1)
        return super().__getitem__(index)

    def __setitem__(self, key, value):
        if value is not None and getattr(self, "_batch_size", None) not in (None, len(value)):
            raise ValueError(f"Batch size mismatch in {key}.")
        super().__setitem__(key, value)
        if value is not None and hasattr(self, "_batch_size") and self._batch_size is None:
            self._batch_size = len(value)

    def contiguous(self):
        for key, value in self.items():
            if value is not None:
                self[key] = value.contiguous() if torch is not None else np.ascontiguousarray(value)
        return self

    def __reduce__(self):
        return (_rebuild_tensor_batch, (type(self), self.__getstate__()))

    def __getstate__(self):
        if "sequences" in self:
            SERIALIZED[chunk_label(self)] += 1  # the examples' counter, not SkyRL's
        self.contiguous()
        if self._device is not None and torch is not None:
            assert self._device == torch.device("cpu"), (
                "Tensors must be on CPU before serialization"
            )
        batch_dict = {}
        for key, value in self.items():
            zero_copy = key in self.ZERO_COPY_KEYS
            if value is None:
                batch_dict[key] = None
            else:
                batch_dict[key] = _serialize_tensor(value, zero_copy=zero_copy)
        return {
            "batch_dict": batch_dict,
            "batch_size": self._batch_size,
            "device": self._device,
            "metadata": self.metadata,
        }

    def __setstate__(self, state):
        for key, value in state["batch_dict"].items():
            self[key] = None if value is None else _deserialize_tensor(value)
        self._batch_size = state["batch_size"]
        self._device = state["device"]
        self.metadata = state["metadata"]
        self._check_consistency()
        return self

    def chunk(self, chunk_size):
        chunks = []
        for i in range(0, self._batch_size, chunk_size):
            chunk = self.__class__(
                {k: None if v is None else v[i : i + chunk_size] for k, v in self.items()}
            )
            chunk.metadata = self.metadata
            chunks.append(chunk)
        return chunks

    def slice(self, start, end, step=1):
        cut = slice(start, end, step)
        sliced = self.__class__({k: None if v is None else v[cut] for k, v in self.items()})
        sliced.metadata = self.metadata
        return sliced

    def __len__(self):
        return self._batch_size


class TrainingInputBatch(TensorBatch):
    pass


def _numpy_fingerprint(batch: TensorBatch) -> Any:
    """Without torch only: what the mirror's ``__getstate__`` sends of its numpy arrays."""
    fields = [(k, None if v is None else np.ascontiguousarray(v)) for k, v in batch.items()]
    return fields, batch._batch_size, batch.metadata


if torch is not None:
    skyrl_integration.register_tensor_batch(TensorBatch)
else:
    refshare.register_fingerprint(TensorBatch, _numpy_fingerprint)


# -- skyrl/backends/skyrl_train/distributed/dispatch.py, workers/worker.py -------------------


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
    def stage_chunks(cls, dp_size, data, mini_batch_boundaries):
        all_chunk_refs = []
        for start, end in mini_batch_boundaries:
            mini_batch = data[start:end]
            # (SkyRL pads a mini-batch to a multiple of dp_size here: step-wise training only.)
            assert len(mini_batch) % dp_size == 0
            chunks = mini_batch.chunk(len(mini_batch) // dp_size)
            all_chunk_refs.append([ray_put(chunk) for chunk in chunks])
        return all_chunk_refs

    @classmethod
    def dispatch_from_staged(cls, actor_infos, method, chunk_refs, **kwargs):
        object_refs = []
        for actor_info in actor_infos:
            chunk_ref = chunk_refs[actor_info.rank.dp]
            object_refs.append(getattr(actor_info.handle, method).remote(chunk_ref, **kwargs))
        return object_refs

    @classmethod
    def validate_dispatch_args(cls, *args, **kwargs):
        data = args[0] if args else kwargs.pop("data")
        if not isinstance(data, TrainingInputBatch):
            raise ValueError(f"For MeshDispatch, `data` should be a TrainingInputBatch: {data!r}")
        return (data,), kwargs


class PassThroughDispatch:
    @classmethod
    def dispatch(cls, actor_infos, method, *args, **kwargs):
        return [getattr(info.handle, method).remote(*args, **kwargs) for info in actor_infos]

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

    def async_run_ray_method(self, dispatch_type, method_name, *args, **kwargs):
        dispatch_class = DispatchRegistry.get(dispatch_type)
        # validate the dispatch args to be sent to `.dispatch`
        args, kwargs = dispatch_class.validate_dispatch_args(*args, **kwargs)

        # Dispatch the method call
        object_refs = dispatch_class.dispatch(self.actor_infos, method_name, *args, **kwargs)
        return object_refs


# -- workers/worker_dispatch.py and train/trainer.py --------------------------------------------

RECOMPUTE_OLD_LOGPROBS_PER_MINIBATCH = True  # trainer.recompute_old_logprobs_per_minibatch


class WorkerDispatch:
    def __init__(self, groups):
        self._actor_groups = groups

    def forward(self, model, data):
        refs = self._actor_groups[model].async_run_ray_method("mesh", "forward", data=data)
        return np.concatenate(ray.get(refs))  # WorkerOutput.cat, over DP ranks

    def forward_from_staged(self, model, chunk_refs):
        actor_infos = self._actor_groups[model].actor_infos
        refs = MeshDispatch.dispatch_from_staged(actor_infos, "forward", chunk_refs=chunk_refs)
        return np.concatenate(ray.get(refs))

    def stage_data(self, model, data, mini_batch_boundaries):
        dp_size = self._actor_groups[model].actor_infos[0].rank.dp_size
        return MeshDispatch.stage_chunks(dp_size, data, mini_batch_boundaries)

    def empty_cache(self, model):
        ray.get(self._actor_groups[model].async_run_ray_method("pass_through", "empty_cache"))


def _execute_forward_pass(dispatch, model, data_fwd_pass, mini_batch_boundaries):
    if RECOMPUTE_OLD_LOGPROBS_PER_MINIBATCH and mini_batch_boundaries:
        all_chunk_refs = dispatch.stage_data(model, data_fwd_pass, mini_batch_boundaries)
        outputs = [dispatch.forward_from_staged(model, refs) for refs in all_chunk_refs]
        return np.concatenate(outputs)
    return dispatch.forward(model, data_fwd_pass)


def fwd_logprobs_values_reward(dispatch, training_input):  # RayPPOTrainer
    fwd_keys = ["sequences", "attention_mask"]  # (+ optional fields this batch lacks)
    data_fwd_pass = training_input.select(keys=fwd_keys, metadata_keys=["response_length"])
    boundaries = training_input.metadata
    values = _execute_forward_pass(
        dispatch, "critic", data_fwd_pass, boundaries.get("critic_mini_batch_boundaries")
    )
    base_log_probs = _execute_forward_pass(dispatch, "ref", data_fwd_pass, None)
    dispatch.empty_cache("ref")
    action_log_probs = _execute_forward_pass(
        dispatch, "policy", data_fwd_pass, boundaries.get("policy_mini_batch_boundaries")
    )
    return {"values": values, "ref": base_log_probs, "policy": action_log_probs}


def checksum(batch: TensorBatch) -> int:
    """What a worker says it received: every field's name, dtype, shape and elements."""
    crc = zlib.crc32(repr((len(batch), batch.metadata)).encode())
    for key in sorted(batch):
        value = batch[key]
        arr = np.asarray(value.contiguous() if torch is not None else value)
        crc = zlib.crc32(repr((key, str(value.dtype), tuple(value.shape))).encode(), crc)
        crc = zlib.crc32(np.ascontiguousarray(arr).tobytes(), crc)
    return crc
