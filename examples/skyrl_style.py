"""SkyRL 0.4.0's default forward pass, mirrored: one batch for critic, reference and policy.

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

So a step puts each DP chunk of the reference's full batch once, and each mini-batch chunk
twice (critic and policy); the next step, with equal data, puts them all again. (The
training step, ``_execute_training_step``, stages its chunks the same way.)
``refshare.enable("skyrl")`` wraps ``PPORayActorGroup.async_run_ray_method`` and
``MeshDispatch.stage_chunks``; here those two are wrapped on the mirror, as ``enable`` names
them. refshare keys SkyRL's batch by a fingerprint registered for its module path, which the
mirror does not have: the mirror's class is registered the same way, with
``register_tensor_batch`` (the simplest faithful option: the mirror is then keyed, sized and
never split exactly as SkyRL's class is). Keying it reads its tensors in place and never runs
its ``__getstate__``; on a miss it is put as it is, and Ray pickles it as by value.

Where torch is missing, the batch holds numpy arrays instead (SkyRL's never does), keyed by a
fingerprint of this example's own: the arrays' elements, as its ``__getstate__`` sends them.
The serialization counter in ``__getstate__`` is the example's, not SkyRL's.

Run: python examples/skyrl_style.py
"""

from __future__ import annotations

import io
import os
import sys
import zlib
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import ray

import refshare
from refshare._integrations import skyrl as skyrl_integration

try:
    import torch
except ImportError:  # numpy arrays stand in for CPU tensors
    torch = None

#: Under REFSHARE_VERIFY=1 refshare also serializes each argument by value, to check it.
VERIFYING = os.environ.get("REFSHARE_VERIFY", "") == "1"
PUTS: Counter[str] = Counter()  # the example's counter, for the "without refshare" column
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
            # The example's counter, not SkyRL's, looked up where it lives: named as a
            # global, it would travel with this class (sent by value from a script).
            sys.modules[__name__].SERIALIZED[chunk_label(self)] += 1
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


# -- the workers and the steps -----------------------------------------------------------------

DP, ROWS, TOKENS = 2, 128, 4096
MINI_BATCHES = [(0, ROWS // 2), (ROWS // 2, ROWS)]  # policy and critic mini-batch size 64


def checksum(batch: TensorBatch) -> int:
    """What a worker says it received: every field's name, dtype, shape and elements."""
    crc = zlib.crc32(repr((len(batch), batch.metadata)).encode())
    for key in sorted(batch):
        value = batch[key]
        arr = np.asarray(value.contiguous() if torch is not None else value)
        crc = zlib.crc32(repr((key, str(value.dtype), tuple(value.shape))).encode(), crc)
        crc = zlib.crc32(np.ascontiguousarray(arr).tobytes(), crc)
    return crc


@ray.remote(num_cpus=0.1)
class Worker:
    """A policy, critic or reference worker: logs a checksum of every batch it is sent."""

    def __init__(self) -> None:
        self.received: list[int] = []

    def forward(self, data: TensorBatch) -> np.ndarray:
        self.received.append(checksum(data))
        sequences = np.asarray(data["sequences"])
        return -np.log1p(sequences[:, 1] % 97)

    def empty_cache(self) -> None:
        pass

    def take_received(self) -> list[int]:
        received, self.received = self.received, []
        return received


def expected_received(data_fwd_pass: TensorBatch) -> list[list[int]]:
    """What each worker (critic's, reference's, policy's) must log in one step."""
    staged = [data_fwd_pass[s:e].chunk((e - s) // DP) for s, e in MINI_BATCHES]
    full = data_fwd_pass.chunk(ROWS // DP)
    by_model = {
        "critic": [[checksum(mb[dp]) for mb in staged] for dp in range(DP)],
        "ref": [[checksum(full[dp])] for dp in range(DP)],
        "policy": [[checksum(mb[dp]) for mb in staged] for dp in range(DP)],
    }
    return [received for model in ("critic", "ref", "policy") for received in by_model[model]]


def make_training_input(arrays: dict[str, Any]) -> TrainingInputBatch:
    """A new batch each step, as the trainer makes (``convert_to_training_input``)."""
    if torch is not None:
        arrays = {k: torch.from_numpy(v.copy()) for k, v in arrays.items()}
    training_input = TrainingInputBatch(arrays)
    training_input.metadata = {
        "response_length": TOKENS // 4,
        "policy_mini_batch_boundaries": MINI_BATCHES,
        "critic_mini_batch_boundaries": MINI_BATCHES,
    }
    return training_input


def run_steps(groups: dict[str, PPORayActorGroup], steps: list[Any]) -> list[Any]:
    dispatch = WorkerDispatch(groups)
    actors = [actor for group in groups.values() for actor in group._actor_handlers]
    rows = []
    for arrays in steps:
        before = Counter({**PUTS, **refshare.stats()._asdict()})
        training_input = make_training_input(arrays)
        data_fwd_pass = training_input.select(["sequences", "attention_mask"], ["response_length"])
        expected = expected_received(data_fwd_pass)
        SERIALIZED.clear()
        outputs = fwd_logprobs_values_reward(dispatch, training_input)
        assert all(len(value) == len(training_input) for value in outputs.values())
        received = ray.get([actor.take_received.remote() for actor in actors])
        assert received == expected, "a worker received other data than it was sent"
        counts = Counter({**PUTS, **refshare.stats()._asdict()}) - before
        rows.append((counts, dict(SERIALIZED)))
    return rows


def per_chunk(serialized: dict[tuple[int, int], int]) -> str:
    """The reference's chunks' counts, then the mini-batch chunks', in row order."""
    ref = [serialized.get((row, ROWS // DP), 0) for row in range(0, ROWS, ROWS // DP)]
    rows = ROWS // len(MINI_BATCHES) // DP
    staged = [serialized.get((row, rows), 0) for row in range(0, ROWS, rows)]
    return f"{' '.join(map(str, ref))} | {' '.join(map(str, staged))}"


def main() -> None:
    ray.init(address="local", num_cpus=2, object_store_memory=256 << 20, include_dashboard=False)
    try:
        rng = np.random.default_rng(0)
        groups = {
            m: PPORayActorGroup([Worker.remote() for _ in range(DP)], dp_size=DP)
            for m in ("critic", "ref", "policy")
        }
        batches = []  # 128 sequences of 4096 tokens and their mask: 4 MiB per reference chunk
        for _ in range(2):
            sequences = rng.integers(0, 32_000, (ROWS, TOKENS))
            sequences[:, 0] = np.arange(ROWS)  # each row's index: says which chunk is which
            batches.append(
                {
                    "sequences": sequences,
                    "attention_mask": np.ones((ROWS, TOKENS), dtype=np.int64),
                    "advantages": rng.standard_normal((ROWS, TOKENS // 4), dtype=np.float32),
                }
            )
        labels = ["1 new data", "2 same", "3 same", "4 new data"]
        steps = [batches[i] for i in (0, 0, 0, 1)]

        plain = run_steps(groups, steps)
        # An audit first (keyed as sharing keys, sent by value), then on, as
        # refshare.enable("skyrl", audit=True) and refshare.enable("skyrl") do.
        targets = skyrl_integration.FRAMEWORK.layouts[0]  # what enable("skyrl") wraps
        for audit in (True, False):
            for target in targets:
                refshare.patch_methods(globals()[target.owner], *target.methods, audit=audit)
            shared = run_steps(groups, steps)
            if audit:
                for target in targets:
                    refshare.unpatch_methods(globals()[target.owner], *target.methods)
        report = refshare.report()
        would, saved = report.bytes_repeated(audit=True), report.bytes_repeated()
        assert abs(would - saved) <= 0.05 * saved, report  # the audit foretold it

        kind = "torch tensors" if torch is not None else "numpy arrays (no torch)"
        print(f"SkyRL 0.4.0 mirror, {kind}: one forward batch to critic (staged per mini-batch),")
        print("ref (mesh dispatch) and policy (staged), dp=2, 2 mini-batches")
        print("serialized per chunk (the reference's 2 | the 4 mini-batch chunks), objects stored")
        head = f"{'step':<12} {'without refshare':<18} {'stored':>6}   {'with enable()':<18}"
        print(f"{head} stored hits")
        for label, (old, old_counts), (new, new_counts) in zip(labels, plain, shared, strict=True):
            print(
                f"{label:<12} {per_chunk(old_counts):<18} {old['ray.put']:>6}   "
                f"{per_chunk(new_counts):<18} {new['puts']:>6} {new['hits']:>4}"
            )
        # Without refshare: the reference's 2 chunks once, the 4 mini-batch chunks twice
        # (critic and policy), every step. With it: each distinct chunk once, then never.
        assert [row[0]["ray.put"] for row in plain] == [10] * 4, plain
        assert all(set(row[1].values()) == {1, 2} for row in plain), plain
        # Verify serializes each argument by value too, to check it: that runs the batch's
        # own pickling, which makes its tensors contiguous in place, as by value does.
        if not VERIFYING:
            assert [row[0]["puts"] for row in shared] == [6, 0, 0, 6], shared
            assert [set(row[1].values()) for row in shared] == [{1}, set(), set(), {1}], shared
        print(f"the audit said sharing would not send {would / 2**20:.1f} MiB again;"
              f" sharing did not send {saved / 2**20:.1f} MiB again")  # fmt: skip
        print(refshare.stats())
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
