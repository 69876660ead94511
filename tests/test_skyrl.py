"""SkyRL's ``TensorBatch`` keyed by refshare's SkyRL fingerprint, and ``enable("skyrl")``.

On a mirror of SkyRL 0.4.0 (below; workers import it from this module), and where the
``skyrl`` package imports, on SkyRL's own classes: equal content gives an equal key, any
change a different one, a chunk made again the same key, and keying never changes the
batch. Through Ray: a worker receives from refshare exactly what it receives by value, and
three groups each putting the same batch's two DP chunks serialize each chunk once in a
step and never on a repeat (counted in the mirror's ``__getstate__``, which runs in the
driver only).
"""

from __future__ import annotations

import enum
import importlib
import io
import pickle
import random
from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, ClassVar

import internals
import numpy as np
import pytest
import ray
from differential_kit import describe_fully as describe

import refshare

torch = pytest.importorskip("torch")

# What is under test, for registering the mirror as refshare registers SkyRL's own class
# (by module path, which the mirror does not have). Private: tests/internals.py is the place
# for it, once that file has it.
from internals import register_tensor_batch  # noqa: E402

# -- SkyRL 0.4.0, mirrored ---------------------------------------------------------------------
# skyrl/backends/skyrl_train/training_batch.py (TensorFormat, _serialize_tensor,
# _deserialize_tensor, TensorList, _rebuild_tensor_batch, TensorBatch, TrainingInputBatch) and
# utils/packed_tensor.py (PackedTensor), as 0.4.0 has them, with what these tests do not use
# left out. TensorFormat is a StrEnum there (Python 3.11+).

#: How often the driver serialized each batch, by its label (see ``label``).
SERIALIZED: Counter[tuple[int, int]] = Counter()


def label(batch: dict[str, Any]) -> tuple[int, int]:
    """Which chunk a batch is: its first row (``sequences[:, 0]`` holds each row's index in
    the whole batch) and its number of rows."""
    sequences = dict.__getitem__(batch, "sequences")
    return int(sequences[0, 0]), len(sequences)


class TensorFormat(str, enum.Enum):
    NUMPY = "numpy"
    NUMPY_VIEW = "numpy_view"
    TORCH = "torch"
    TENSOR_LIST = "tensor_list"
    PACKED_TENSOR = "packed_tensor"


def _serialize_tensor(value: Any, *, zero_copy: bool = False) -> dict[str, Any]:
    try:
        arr = value.numpy()
    except TypeError:
        buffer = io.BytesIO()
        torch.save(value, buffer)
        return {"format": TensorFormat.TORCH, "data": buffer.getvalue()}
    if zero_copy:
        return {"format": TensorFormat.NUMPY_VIEW, "data": arr}
    return {
        "format": TensorFormat.NUMPY,
        "data": arr.tobytes(),
        "shape": arr.shape,
        "dtype": str(arr.dtype),
    }


def _deserialize_tensor(value: dict[str, Any]) -> Any:
    tensor_format = value.get("format")
    if tensor_format == TensorFormat.TORCH:
        return torch.load(io.BytesIO(value["data"]), weights_only=True)
    if tensor_format == TensorFormat.NUMPY_VIEW:
        return torch.from_numpy(value["data"])
    arr = np.frombuffer(value["data"], dtype=np.dtype(value["dtype"])).reshape(value["shape"])
    return torch.from_numpy(arr.copy())


class TensorList:
    def __init__(self, tensors: list[Any]) -> None:
        if len(tensors) == 0:
            raise ValueError("Cannot create a TensorList with no tensors.")
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.tensors)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return TensorList(self.tensors[index])
        return self.tensors[index]

    def contiguous(self) -> TensorList:
        return TensorList([t.contiguous() for t in self.tensors])

    @property
    def device(self) -> Any:
        return self.tensors[0].device if self.tensors else None


class PackedTensor:
    def __init__(self, values: Any, cu_seqlens: Any) -> None:
        if cu_seqlens.dtype != torch.int32 or cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens must be int32 and hold at least two offsets")
        if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != values.shape[0]:
            raise ValueError("cu_seqlens must run from 0 to the packed rows")
        self.values = values
        self.cu_seqlens = cu_seqlens

    @property
    def device(self) -> Any:
        return self.values.device

    def __len__(self) -> int:
        return int(self.cu_seqlens.numel()) - 1

    def __getitem__(self, index: slice) -> PackedTensor:
        start, stop, _ = index.indices(len(self))
        offsets = self.cu_seqlens[start : max(start, stop) + 1]
        return PackedTensor(self.values[int(offsets[0]) : int(offsets[-1])], offsets - offsets[0])

    def contiguous(self) -> PackedTensor:
        return PackedTensor(self.values.contiguous(), self.cu_seqlens.contiguous())


BATCH_FIELD_TYPES = (torch.Tensor, TensorList, PackedTensor)


def _rebuild_tensor_batch(cls: type, state: dict[str, Any]) -> Any:
    obj = dict.__new__(cls)
    obj.__setstate__(state)
    return obj


class TensorBatch(dict):  # type: ignore[type-arg]
    metadata: dict[str, Any] | None = None
    ZERO_COPY_KEYS: frozenset[str] = frozenset({"rollout_expert_indices", "rollout_sample_support"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._batch_size: int | None = None
        self._device: Any = None
        self._check_consistency()

    def select(self, keys: list[str], metadata_keys: list[str] | None = None) -> Any:
        selected = {key: self[key] for key in keys}
        if metadata_keys is None:
            metadata = self.metadata
        else:
            metadata = {key: self.metadata[key] for key in metadata_keys}  # type: ignore[index]
        new_batch = self.__class__(selected)
        new_batch.metadata = metadata
        return new_batch

    def _check_consistency(self) -> None:
        keys = list(self.keys())
        if len(keys) == 0:
            return
        batch_size = len(self[keys[0]])
        self._batch_size = batch_size
        for key in keys:
            value = self[key]
            if value is None:
                continue
            if not isinstance(value, BATCH_FIELD_TYPES):
                raise ValueError(f"Field {key} must be a batch field, got {type(value)}")
            self._device = value.device if self._device is None else self._device
            if len(value) != batch_size:
                raise ValueError(f"Batch size mismatch in {key}")
            if value.device != self._device:
                raise ValueError(f"Device mismatch in {key}")

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self.slice(index.start, index.stop, index.step)
        if isinstance(index, int):
            return self.slice(index, index + 1)
        return super().__getitem__(index)

    def __setitem__(self, key: str, value: Any) -> None:
        if value is None:
            super().__setitem__(key, value)
            return
        if not isinstance(value, BATCH_FIELD_TYPES):
            raise ValueError(f"Field {key} must be a batch field, got {type(value)}")
        if getattr(self, "_batch_size", None) is not None and len(value) != self._batch_size:
            raise ValueError(f"Batch size mismatch in {key}.")
        super().__setitem__(key, value)
        if hasattr(self, "_batch_size") and self._batch_size is None:
            self._batch_size = len(value)

    def contiguous(self) -> TensorBatch:
        for key, value in self.items():
            if value is None:
                continue
            assert isinstance(value, BATCH_FIELD_TYPES)
            self[key] = value.contiguous()
        return self

    def __reduce__(self) -> Any:
        return (_rebuild_tensor_batch, (type(self), self.__getstate__()))

    def __getstate__(self) -> dict[str, Any]:
        if "sequences" in self:
            SERIALIZED[label(self)] += 1  # the test's counter, not SkyRL's
        self.contiguous()
        if self._device is not None:
            assert self._device == torch.device("cpu"), "Tensors must be on CPU"
        batch_dict: dict[str, Any] = {}
        for key, value in self.items():
            zero_copy = key in self.ZERO_COPY_KEYS
            if value is None:
                batch_dict[key] = None
            elif isinstance(value, TensorList):
                batch_dict[key] = {
                    "format": TensorFormat.TENSOR_LIST,
                    "items": [_serialize_tensor(t) for t in value.tensors],
                }
            elif isinstance(value, PackedTensor):
                batch_dict[key] = {
                    "format": TensorFormat.PACKED_TENSOR,
                    "values": _serialize_tensor(value.values, zero_copy=zero_copy),
                    "cu_seqlens": _serialize_tensor(value.cu_seqlens),
                }
            else:
                batch_dict[key] = _serialize_tensor(value, zero_copy=zero_copy)
        return {
            "batch_dict": batch_dict,
            "batch_size": self._batch_size,
            "device": self._device,
            "metadata": self.metadata,
        }

    def __setstate__(self, state: dict[str, Any]) -> TensorBatch:
        for key, value in state["batch_dict"].items():
            if value is None:
                self[key] = None
            elif value.get("format") == TensorFormat.TENSOR_LIST:
                self[key] = TensorList([_deserialize_tensor(item) for item in value["items"]])
            elif value.get("format") == TensorFormat.PACKED_TENSOR:
                values = _deserialize_tensor(value["values"])
                self[key] = PackedTensor(values, _deserialize_tensor(value["cu_seqlens"]))
            else:
                self[key] = _deserialize_tensor(value)
        self._batch_size = state["batch_size"]
        self._device = state["device"]
        self.metadata = state["metadata"]
        self._check_consistency()
        return self

    def chunk(self, chunk_size: int) -> list[Any]:
        chunks = []
        for i in range(0, self._batch_size or 0, chunk_size):
            data = {k: None if v is None else v[i : i + chunk_size] for k, v in self.items()}
            chunk = self.__class__(data)
            chunk.metadata = self.metadata
            chunks.append(chunk)
        return chunks

    def slice(self, start: int, end: int, step: int | None = None) -> Any:
        cut = slice(start, end, step)
        sliced = self.__class__({k: None if v is None else v[cut] for k, v in self.items()})
        sliced.metadata = self.metadata
        return sliced

    def __len__(self) -> int:
        return self._batch_size or 0


class TrainingInputBatch(TensorBatch):
    pass


register_tensor_batch(TensorBatch)  # as for SkyRL's own, by module path


# skyrl/backends/skyrl_train/distributed/dispatch.py (MeshRank with dp and dp_size only;
# stage_chunks without the step-wise padding) and workers/worker.py (PPORayActorGroup).


@dataclass
class MeshRank:
    dp: int
    dp_size: int


@dataclass
class ActorInfo:
    handle: Any
    rank: MeshRank


class MeshDispatch:
    @classmethod
    def dispatch(cls, actor_infos: list[ActorInfo], method: str, data: Any, **kwargs: Any) -> Any:
        dp_size = actor_infos[0].rank.dp_size
        assert len(data) % dp_size == 0
        chunk_refs = [ray.put(chunk) for chunk in data.chunk(len(data) // dp_size)]
        return [
            getattr(info.handle, method).remote(chunk_refs[info.rank.dp], **kwargs)
            for info in actor_infos
        ]

    @classmethod
    def stage_chunks(cls, dp_size: int, data: Any, boundaries: list[tuple[int, int]]) -> Any:
        all_chunk_refs = []
        for start, end in boundaries:
            mini_batch = data[start:end]
            assert (end - start) % dp_size == 0  # SkyRL pads here (step-wise training only)
            chunks = mini_batch.chunk(len(mini_batch) // dp_size)
            all_chunk_refs.append([ray.put(chunk) for chunk in chunks])
        return all_chunk_refs

    @classmethod
    def dispatch_from_staged(
        cls, actor_infos: list[ActorInfo], method: str, chunk_refs: list[Any], **kwargs: Any
    ) -> Any:
        return [
            getattr(info.handle, method).remote(chunk_refs[info.rank.dp], **kwargs)
            for info in actor_infos
        ]

    @classmethod
    def validate_dispatch_args(cls, *args: Any, **kwargs: Any) -> Any:
        data = args[0] if args else kwargs.pop("data")
        assert isinstance(data, TrainingInputBatch), type(data)
        return (data,), kwargs


class DispatchRegistry:
    _registry: ClassVar[dict[str, Any]] = {"mesh": MeshDispatch}

    @classmethod
    def get(cls, name: str) -> Any:
        return cls._registry[name]


class PPORayActorGroup:
    def __init__(self, actors: list[Any]) -> None:
        self.actor_infos = [ActorInfo(a, MeshRank(i, len(actors))) for i, a in enumerate(actors)]

    def async_run_ray_method(self, dispatch_type: str, method: str, *args: Any, **kw: Any) -> Any:
        dispatch_class = DispatchRegistry.get(dispatch_type)
        args, kw = dispatch_class.validate_dispatch_args(*args, **kw)
        return dispatch_class.dispatch(self.actor_infos, method, *args, **kw)


# -- the batches -------------------------------------------------------------------------------

MIRROR = SimpleNamespace(
    name="mirror of SkyRL 0.4.0",
    TrainingInputBatch=TrainingInputBatch,
    TensorList=TensorList,
    PackedTensor=PackedTensor,
)


def real_skyrl() -> SimpleNamespace:
    """SkyRL's own classes, where they import (skyrl 0.4.0 in the research venv)."""
    batches = pytest.importorskip("skyrl.backends.skyrl_train.training_batch")
    packed = pytest.importorskip("skyrl.backends.skyrl_train.utils.packed_tensor")
    version = importlib.metadata.version("skyrl")
    return SimpleNamespace(
        name=f"skyrl {version}",
        TrainingInputBatch=batches.TrainingInputBatch,
        TensorList=batches.TensorList,
        PackedTensor=packed.PackedTensor,
    )


@pytest.fixture(params=["mirror", "skyrl"])
def kinds(request: pytest.FixtureRequest) -> SimpleNamespace:
    return MIRROR if request.param == "mirror" else real_skyrl()


ROWS, TOKENS = 8, 4096


def training_input(
    kinds: SimpleNamespace, seed: int = 0, rows: int = ROWS, extra: bool = False
) -> Any:
    """A batch as SkyRL's trainer sends it: ``sequences[:, 0]`` is each row's index.

    With ``extra``, also every other way a field is sent: a dtype numpy lacks (as a row view
    and transposed), a non-contiguous tensor, a ``TensorList``, a ``PackedTensor`` in
    ``ZERO_COPY_KEYS``, and a ``None``."""
    g = torch.Generator().manual_seed(seed)
    sequences = torch.randint(0, 32_000, (rows, TOKENS), generator=g)
    sequences[:, 0] = torch.arange(rows)
    fields: dict[str, Any] = {
        "sequences": sequences,
        "attention_mask": torch.ones(rows, TOKENS, dtype=torch.int64),
        "loss_mask": torch.ones(rows, TOKENS // 2),
        "advantages": torch.randn(rows, TOKENS // 2, generator=g),
    }
    if extra:
        fields["rollout_logprobs"] = torch.randn(2 * rows, 64, generator=g).bfloat16()[:rows]
        fields["kl"] = torch.randn(16, rows, generator=g).bfloat16().t()
        fields["returns"] = torch.randn(64, rows, generator=g).t()
        fields["pixel_values"] = kinds.TensorList(
            [torch.randn(1 + i % 3, 8, generator=g) for i in range(rows)]
        )
        lengths = torch.tensor([0] + [1 + i % 4 for i in range(rows)], dtype=torch.int32)
        cu_seqlens = torch.cumsum(lengths, 0, dtype=torch.int32)
        values = torch.randint(0, 64, (int(cu_seqlens[-1]), 2, 2), dtype=torch.int32, generator=g)
        fields["rollout_expert_indices"] = kinds.PackedTensor(values, cu_seqlens)
        fields["values"] = None
    batch = kinds.TrainingInputBatch(fields)
    batch.metadata = {"response_length": TOKENS // 2, "uids": [f"uid-{i}" for i in range(rows)]}
    return batch


def key(batch: Any) -> bytes | None:
    return refshare.fingerprint(batch)


def keyed_in_place(batch: Any) -> bool:
    """Whether refshare keyed ``batch`` without pickling it, and will put it as it is."""
    found = internals.identify(batch)
    return found is not None and found.serialized is None and not found.tensors


def pickled(batch: Any) -> bytes:
    """What SkyRL's pickling of ``batch`` sends, from a shallow copy (it changes the batch)."""
    copy = dict.__new__(type(batch))
    dict.update(copy, batch)
    copy.__dict__.update(batch.__dict__)
    return pickle.dumps(copy, protocol=5)


def layout(batch: Any) -> list[Any]:
    return [
        (k, None if not isinstance(v, torch.Tensor) else (v.data_ptr(), v.stride()))
        for k, v in batch.items()
    ]


# -- keys --------------------------------------------------------------------------------------


def test_equal_content_gives_an_equal_key_read_in_place(kinds: SimpleNamespace) -> None:
    for extra in (False, True):
        first, second = training_input(kinds, extra=extra), training_input(kinds, extra=extra)
        assert keyed_in_place(first)
        assert key(first) == key(second) is not None
        assert key(first) != key(training_input(kinds, seed=1, extra=extra))


def test_any_change_gives_another_key(kinds: SimpleNamespace) -> None:
    original = key(training_input(kinds, extra=True))

    def changed(change: Any) -> bytes | None:
        batch = training_input(kinds, extra=True)
        change(batch)
        return key(batch)

    def tensors(batch: Any) -> list[Any]:
        found = []
        for value in batch.values():
            if isinstance(value, kinds.TensorList):
                found.extend(value.tensors)
            elif isinstance(value, kinds.PackedTensor):
                found.append(value.values)
            elif value is not None:
                found.append(value)
        return found

    count = len(tensors(training_input(kinds, extra=True)))

    def last_element(batch: Any, i: int) -> Any:  # a view of it, however the tensor is laid out
        t = tensors(batch)[i]
        return t[(-1,) * t.ndim]

    for i in range(count):
        assert changed(lambda b, i=i: last_element(b, i).add_(1)) != original, i
    keys = [original]
    keys.append(changed(lambda b: b.metadata.update(response_length=7)))
    keys.append(changed(lambda b: b.metadata["uids"].append("one more")))
    keys.append(changed(lambda b: setattr(b, "metadata", None)))
    keys.append(changed(lambda b: dict.__setitem__(b, "values", b["loss_mask"])))
    keys.append(changed(lambda b: dict.__setitem__(b, "advantages", b["advantages"].double())))
    keys.append(key(training_input(kinds, rows=ROWS // 2, extra=True)))  # batch size
    keys.append(key(training_input(kinds, extra=False)))
    packed = training_input(kinds, extra=True)["rollout_expert_indices"]
    shifted = packed.cu_seqlens.clone()
    shifted[1] += 1
    keys.append(
        changed(
            lambda b: dict.__setitem__(
                b, "rollout_expert_indices", kinds.PackedTensor(packed.values, shifted)
            )
        )
    )
    assert None not in keys and len(set(keys)) == len(keys)


def test_a_chunk_made_again_is_found_again(kinds: SimpleNamespace) -> None:
    batch = training_input(kinds, extra=True)
    memo: internals.Memo = {}
    chunks = [c for _ in range(2) for c in batch.chunk(ROWS // 2)]
    keys = [internals.identify(c, memo).key for c in chunks]  # type: ignore[union-attr]
    assert keys[:2] == keys[2:] and keys[0] != keys[1]
    again = training_input(kinds, extra=True).chunk(ROWS // 2)
    assert [key(c) for c in again] == keys[:2]
    # A mini-batch's chunk is the same rows as the chunk of a chunk.
    assert key(batch[0 : ROWS // 2].chunk(ROWS // 4)[1]) == key(
        batch.chunk(ROWS // 2)[0].chunk(ROWS // 4)[1]
    )
    assert key(batch.chunk(ROWS // 2)[0]) != key(batch)


def test_keying_leaves_the_batch_as_it_was(kinds: SimpleNamespace) -> None:
    batch = training_input(kinds, extra=True)
    before = layout(batch)
    assert not batch["kl"].is_contiguous()
    for chunk in [batch, *batch.chunk(ROWS // 2)]:
        assert key(chunk) is not None
    assert layout(batch) == before  # __getstate__ would have made "kl" contiguous


def test_what_pickling_refuses_goes_by_value(kinds: SimpleNamespace) -> None:
    for change in (
        lambda b: b["advantages"].requires_grad_(),
        lambda b: setattr(b, "_device", torch.device("meta")),
        lambda b: setattr(b, "_batch_size", ROWS + 1),
        lambda b: dict.__setitem__(b, "loss_mask", torch.ones(ROWS - 1)),
        lambda b: dict.__setitem__(b, "loss_mask", np.ones(ROWS)),
    ):
        batch = training_input(kinds)
        change(batch)
        assert key(batch) is None
        with pytest.raises((AssertionError, ValueError, RuntimeError)):
            pickled(batch)
    batch = training_input(kinds)
    dict.__setitem__(batch, "c", torch.randn(ROWS, 4, dtype=torch.complex64).conj())
    assert key(batch) is None


def test_keys_are_equal_exactly_where_pickles_are(kinds: SimpleNamespace) -> None:
    """Small batches made from a few choices, so that many are alike: two keys are equal
    exactly when SkyRL's pickling of the two gives the same bytes."""
    rng = random.Random(0)
    base = torch.arange(64 * 6, dtype=torch.float32).reshape(64, 6) % 5

    def field(rows: int) -> Any:
        t = base.to(rng.choice([torch.float32, torch.bfloat16]))
        t = rng.choice([t[:rows], t[:rows].clone(), t[1:][:rows], t[:rows, ::2]])
        if rng.random() < 0.1:
            t = t.clone()
            t[0, 0] += 1
        return t

    def batch() -> Any:
        rows = rng.choice([2, 4])
        fields: dict[str, Any] = {}
        for name in rng.choice([["a"], ["rollout_expert_indices"], ["pl"], ["a", "pl"]]):
            if name == "pl":
                fields[name] = kinds.TensorList([field(1 + i % 2) for i in range(rows)])
            elif rng.random() < 0.5:
                offsets = torch.arange(0, 2 * rows + 1, 2, dtype=torch.int32)
                fields[name] = kinds.PackedTensor(field(2 * rows), offsets)
            else:
                fields[name] = field(rows)
        made = kinds.TrainingInputBatch(fields)
        made.metadata = rng.choice([None, {"x": 1}])
        return made

    batches = [batch() for _ in range(200)]
    keys = [key(b) for b in batches]
    pickles = [pickled(b) for b in batches]
    assert None not in keys
    alike = [(i, j) for i in range(200) for j in range(i) if pickles[i] == pickles[j]]
    assert len(alike) > 20  # (39 here)
    assert alike == [(i, j) for i in range(200) for j in range(i) if keys[i] == keys[j]]


def test_size_is_what_the_pickle_carries(kinds: SimpleNamespace) -> None:
    batch = training_input(kinds, extra=True)
    for value in (batch, *batch.chunk(ROWS // 2)):
        size, carried = refshare.estimate_size(value), len(pickled(value))
        assert 0.9 * carried < size <= carried, (size, carried)


def test_enable_wraps_skyrls_own_methods() -> None:
    worker = pytest.importorskip("skyrl.backends.skyrl_train.workers.worker")
    pytest.importorskip("skyrl.backends.skyrl_train.distributed.dispatch")
    try:
        wrapped = refshare.enable("skyrl")
        assert wrapped == ["PPORayActorGroup.async_run_ray_method", "MeshDispatch.stage_chunks"]
    finally:
        assert refshare.disable("skyrl") == wrapped
    assert "async_run_ray_method" in worker.PPORayActorGroup.__dict__


# -- through Ray -------------------------------------------------------------------------------


@ray.remote(num_cpus=0.1)
class Worker:
    """A SkyRL worker's ``forward``: says what it received."""

    def forward(self, data: Any) -> Any:
        return describe(data)


@pytest.fixture(scope="module")
def workers(local_ray: None) -> list[Any]:
    found = [Worker.remote() for _ in range(2)]
    ray.get([w.forward.remote(training_input(MIRROR, rows=2)) for w in found])
    return found


@pytest.fixture
def enabled(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``enable("skyrl")`` with SkyRL's own layout, pointed at this module's mirror."""
    real = internals.FRAMEWORKS["skyrl"]
    layout = tuple(internals.Target(__name__, t.owner, t.methods) for t in real.layouts[0])
    monkeypatch.setitem(internals.FRAMEWORKS, "skyrl", real._replace(layouts=(layout,)))
    try:
        yield refshare.enable("skyrl")
    finally:
        refshare.disable("skyrl")


def per_chunk(chunks: list[Any]) -> list[int]:
    return [SERIALIZED[label(c)] for c in chunks]


@pytest.mark.usefixtures("fresh")
def test_a_worker_receives_what_it_receives_by_value(workers: list[Any]) -> None:
    # By value, as SkyRL sends a chunk: ray.put without refshare, then the ref.
    batch = training_input(MIRROR, extra=True)
    by_value = [ray.get(workers[0].forward.remote(ray.put(c))) for c in batch.chunk(ROWS // 2)]
    batch = training_input(MIRROR, extra=True)  # putting made the first one contiguous
    with refshare.sharing():
        refs = [ray.put(c) for c in batch.chunk(ROWS // 2)]  # missed: put as it is
        again = [ray.put(c) for c in training_input(MIRROR, extra=True).chunk(ROWS // 2)]
    assert refs == again and refshare.stats().hits == 2
    shared = [ray.get(workers[1].forward.remote(r)) for r in refs]
    assert shared == by_value


@pytest.mark.verify_off  # counts serializations, which verify adds to
@pytest.mark.usefixtures("fresh")
def test_three_groups_serialize_each_chunk_once_in_a_step_and_never_again(
    workers: list[Any], enabled: list[str]
) -> None:
    assert enabled == ["PPORayActorGroup.async_run_ray_method", "MeshDispatch.stage_chunks"]
    groups = [PPORayActorGroup(workers) for _ in range(3)]
    counts = []
    for step in range(2):  # a new batch of equal content each step, as the trainer makes
        batch = training_input(MIRROR)
        chunks = batch.chunk(ROWS // 2)
        expected = [describe(pickle.loads(pickled(c))) for c in chunks]
        SERIALIZED.clear()
        received = [ray.get(g.async_run_ray_method("mesh", "forward", data=batch)) for g in groups]
        counts.append(per_chunk(chunks))
        assert received == [expected] * 3, step  # every rank of every group
    assert counts == [[1, 1], [0, 0]]
    stats = refshare.stats()
    assert (stats.puts, stats.hits) == (2, 10), stats


@pytest.mark.verify_off  # counts serializations, which verify adds to
@pytest.mark.usefixtures("fresh")
def test_staged_mini_batches_are_shared_too(workers: list[Any], enabled: list[str]) -> None:
    """The trainer's default forward pass: critic and policy staged per mini-batch, the
    reference by the mesh dispatch; each distinct chunk serialized once, then never."""
    critic, ref, policy = (PPORayActorGroup(workers) for _ in range(3))
    boundaries = [(0, ROWS // 2), (ROWS // 2, ROWS)]
    counts = []
    for _ in range(2):
        batch = training_input(MIRROR)
        SERIALIZED.clear()
        for group in (critic, ref, policy):
            if group is ref:
                ray.get(group.async_run_ray_method("mesh", "forward", data=batch))
                continue
            for chunk_refs in MeshDispatch.stage_chunks(2, batch, boundaries):
                ray.get(MeshDispatch.dispatch_from_staged(group.actor_infos, "forward", chunk_refs))
        counts.append(dict(SERIALIZED))
    quarter, half = ROWS // 4, ROWS // 2
    staged = {(row, quarter): 1 for row in range(0, ROWS, quarter)}
    assert counts == [{(0, half): 1, (half, half): 1, **staged}, {}]


@pytest.mark.verify_off  # counts serializations, which verify adds to
@pytest.mark.usefixtures("fresh")
@pytest.mark.parametrize("deep", [None, True])
def test_a_batch_is_never_split_into_members(workers: list[Any], deep: bool | None) -> None:
    """Deep sharing leaves a SkyRL batch whole: its members are bytes only its own pickling
    makes. Three puts of each chunk, in three scopes: each chunk serialized once."""
    batch = training_input(MIRROR)
    chunks = batch.chunk(ROWS // 2)
    SERIALIZED.clear()
    for _ in range(3):
        with refshare.sharing(deep=deep):
            refs = [ray.put(c) for c in training_input(MIRROR).chunk(ROWS // 2)]
    assert per_chunk(chunks) == [1, 1]
    expected = [describe(pickle.loads(pickled(c))) for c in chunks]
    assert ray.get([workers[i].forward.remote(r) for i, r in enumerate(refs)]) == expected


@pytest.mark.usefixtures("local_ray", "fresh")
def test_skyrls_own_staged_chunks_are_serialized_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """SkyRL's own ``MeshDispatch.stage_chunks``, wrapped by ``enable("skyrl")``, staging one
    batch for three groups: each chunk serialized once, and not again on a repeat step."""
    kinds = real_skyrl()
    dispatch = pytest.importorskip("skyrl.backends.skyrl_train.distributed.dispatch")
    pytest.importorskip("skyrl.backends.skyrl_train.workers.worker")
    base = kinds.TrainingInputBatch.__mro__[1]
    counted: Counter[tuple[int, int]] = Counter()
    getstate = base.__getstate__

    def counting(self: Any) -> Any:
        counted[label(self)] += 1
        return getstate(self)

    monkeypatch.setattr(base, "__getstate__", counting)
    boundaries = [(0, ROWS // 2), (ROWS // 2, ROWS)]
    counts = []
    assert "MeshDispatch.stage_chunks" in refshare.enable("skyrl")
    try:
        for _ in range(2):
            batch = training_input(kinds)
            staged = [dispatch.MeshDispatch.stage_chunks(2, batch, boundaries) for _ in range(3)]
            counts.append(dict(counted))
            chunks = [c for start, end in boundaries for c in batch[start:end].chunk(ROWS // 4)]
            expected = [describe(pickle.loads(pickled(c))) for c in chunks]
            counted.clear()  # (those pickles counted too)
            for refs in staged:
                assert [describe(ray.get(r)) for mb in refs for r in mb] == expected
    finally:
        refshare.disable("skyrl")
    quarter = ROWS // 4
    assert counts == [{(row, quarter): 1 for row in range(0, ROWS, quarter)}, {}]


def test_skyrl_train_031_batches_are_keyed_by_what_they_send() -> None:
    """skyrl-train 0.3.1's ``TensorBatch`` sends its items and ``torch.save`` blobs of them:
    two keys are equal exactly when two batches unpickle alike (its pickles differ in
    torch's storage keys, which are addresses)."""
    old = pytest.importorskip("skyrl_train.training_batch")
    rng = random.Random(0)
    base = torch.arange(64 * 6, dtype=torch.float32).reshape(64, 6) % 5

    def batch() -> Any:
        rows = rng.choice([2, 4])
        fields: dict[str, Any] = {}
        for name in rng.choice([["a"], ["b"], ["a", "b"]]):
            t = base.to(rng.choice([torch.float32, torch.bfloat16]))
            fields[name] = rng.choice([t[:rows], t[:rows].clone(), t[1:][:rows], t[:rows, ::2]])
        made = old.TrainingInputBatch(fields)
        made.metadata = rng.choice([None, {"x": 1}])
        return made

    batches = [batch() for _ in range(200)]
    keys = [key(b) for b in batches]
    sent = [describe(pickle.loads(pickled(b))) for b in batches]
    assert None not in keys
    alike = [(i, j) for i in range(200) for j in range(i) if sent[i] == sent[j]]
    assert len(alike) > 20
    assert alike == [(i, j) for i in range(200) for j in range(i) if keys[i] == keys[j]]
    half = old.TrainingInputBatch({"s": torch.zeros(256, 1024)}).chunk(128)[0]
    assert refshare.estimate_size(half) <= len(pickled(half)) < 1.01 * refshare.estimate_size(half)
