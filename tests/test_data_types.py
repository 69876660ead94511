"""The data types RL frameworks send, shared on a real Ray and checked from the outside.

For each type: workers receive exactly what Ray by value gives them (type, dtype, shape,
strides, flags, bytes), the content is the driver's, and ``refshare.stats()`` shows one put
per distinct value and a hit for every repeat.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
from collections import UserDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import ray
from differential_kit import class_of, describe_content, describe_fully, fields, tensor_layout

import refshare

pytestmark = pytest.mark.usefixtures("local_ray", "fresh")

N_PROBES = 3
MiB = 1 << 20


# -- what a worker saw --------------------------------------------------------------------


def describe(value: Any, layout: bool = True) -> Any:
    """The shared description of ``value``; without ``layout``, of its content only (to
    compare with the driver's own value, whose arrays are writable)."""
    return describe_fully(value) if layout else describe_content(value)


@ray.remote(num_cpus=0.1)
class Probe:
    def describe(self, value: Any) -> tuple[Any, Any]:
        return describe(value), describe(value, layout=False)


@pytest.fixture(scope="module")
def probes(local_ray: None) -> list[Any]:
    group = [Probe.remote() for _ in range(N_PROBES)]
    ray.get([p.describe.remote(0) for p in group])
    return group


def send(probes: list[Any], *values: Any) -> list[Any]:
    """Each value to every probe."""
    return ray.get([p.describe.remote(v) for v in values for p in probes])


#: Whole values, as each type is keyed (the default splits some into members: see test_auto).
shared_send = refshare.shared_args(deep=False)(send)


def check(probes: list[Any], *values: Any, puts: int, hits: int) -> None:
    """Send ``values`` shared, then by value; compare, and count refshare's puts and hits."""
    shared = shared_send(probes, *values)
    stats = refshare.stats()
    by_value = send(probes, *values)
    assert shared == by_value
    expected = [describe(v, layout=False) for v in values for _ in probes]
    assert [content for _, content in shared] == expected
    assert (stats.puts, stats.hits, stats.by_value) == (puts, hits, 0), stats


def assert_changed_within_one_call_is_sent_anew(
    probes: list[Any], value: Any, first: Any, change: Callable[[], object]
) -> None:
    """Send ``value``, ``change()`` it in place, send it again, all in one decorated call:
    the probes get ``first`` then the changed content, as by value."""

    @refshare.shared_args
    def two_steps() -> list[Any]:
        before = send(probes, value)
        change()
        return before + send(probes, value)

    seen = [content for _, content in two_steps()]
    expected_first = describe(first, False)
    assert seen == [expected_first] * N_PROBES + [describe(value, False)] * N_PROBES


def received(probes: list[Any], value: Any) -> Any:
    """What the first probe sees of ``value`` sent alone, by value: its description's root."""
    return ray.get(probes[0].describe.remote(value))[0][0]


# -- numpy --------------------------------------------------------------------------------


def numpy_batch(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "input_ids": rng.integers(0, 32_000, (256, 512), dtype=np.int64),  # 1 MiB
        "logprobs": rng.standard_normal((256, 512), dtype=np.float32),
        "mask": rng.random((256, 512)) > 0.5,
        "rewards": rng.standard_normal(256),
    }


def test_dict_of_numpy_arrays(probes: list[Any]) -> None:
    batch = numpy_batch()
    # Equal content in another dict: found again. Other content: a put of its own.
    check(probes, batch, copy.deepcopy(batch), numpy_batch(1), puts=2, hits=3 * N_PROBES - 2)


def test_non_contiguous_numpy_arrays(probes: list[Any]) -> None:
    a = np.random.default_rng(0).standard_normal((512, 1024), dtype=np.float32)  # 2 MiB
    views = [a, a.T, np.asfortranarray(a), a[:, ::2], a[::2], a[::-1]]
    check(probes, *views, a[:, ::2], puts=len(views), hits=len(views) * 2 + 3)


def words(count: int = 40_000) -> np.ndarray:
    accents = ("", "\u00e9", "\u4e2d")
    return np.array([f"uid-{i:06d}-{accents[i % 3]}" for i in range(count)], object)


def test_arrays_of_strings(probes: list[Any]) -> None:
    """Stored joined (see ``_strings``): every layout arrives as by value; an element that
    is not a plain string, or a string holding a NUL, is sent as Ray pickles it."""
    flat = words()
    grid = flat.reshape(200, -1)
    mixed, nul = flat.copy(), flat.copy()
    mixed[5], nul[3] = b"bytes", "a\0b"
    values = [flat, grid, np.asfortranarray(grid), grid[:, ::2], mixed, nul]
    check(probes, *values, flat.copy(), puts=len(values), hits=(len(values) + 1) * N_PROBES - 6)


def test_an_array_of_strings_changed_within_one_call_is_sent_anew(probes: list[Any]) -> None:
    value = words()
    first = value.copy()

    def change() -> None:
        value[-1] = "changed"

    assert_changed_within_one_call_is_sent_anew(probes, value, first, change)


def test_lists_of_numpy_shards(probes: list[Any]) -> None:
    data = np.arange(3 * 64 * 1024, dtype=np.float64).reshape(3 * 64, 1024)
    shards = np.array_split(data, N_PROBES)  # 512 KiB views

    check(probes, shards, puts=1, hits=N_PROBES - 1)  # the list as one argument

    @refshare.shared_args
    def rank_i_gets_shard_i(rounds: int) -> list[Any]:
        pairs = list(zip(probes, shards, strict=True)) * rounds
        return ray.get([p.describe.remote(s) for p, s in pairs])

    refshare.reset_stats()
    results = rank_i_gets_shard_i(2)
    assert [content for _, content in results] == [describe(s, False) for s in shards] * 2
    assert refshare.stats()[:2] == (N_PROBES, N_PROBES)  # puts, hits


def test_lists_of_small_arrays(probes: list[Any]) -> None:
    """Keyed in one pass (see ``_digest_array_list``); every layout, and one array twice,
    arrives as by value."""
    rng = np.random.default_rng(0)
    many = [rng.random(1024) for _ in range(200)]
    many += [np.asfortranarray(rng.random((32, 16))), rng.integers(0, 9, (16, 32)).T]
    twice = [many[0], many[0], *many[1:]]
    check(probes, many, [a.copy(order="K") for a in many], twice, puts=2, hits=3 * N_PROBES - 2)


class BatchedDataDict(dict[str, Any]):
    """Like NeMo-RL's: a dict of arrays with a batch dimension, and state of its own."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.micro_batch_indices: list[int] | None = None

    @property
    def size(self) -> int:
        return len(next(iter(self.values())))


class UserBatchedDataDict(UserDict[str, Any]):
    """The same on UserDict, which NeMo-RL's BatchedDataDict is built on."""


@pytest.mark.parametrize("cls", [BatchedDataDict, UserBatchedDataDict])
def test_batched_data_dict(probes: list[Any], cls: type) -> None:
    batch = cls(numpy_batch())
    assert class_of(received(probes, batch)) == f"{__name__}.{cls.__qualname__}"
    check(probes, batch, cls(numpy_batch()), puts=1, hits=2 * N_PROBES - 1)


def test_batched_data_dict_state_is_part_of_the_content(probes: list[Any]) -> None:
    first, second = BatchedDataDict(numpy_batch()), BatchedDataDict(numpy_batch())
    second.micro_batch_indices = [0, 128, 256]
    check(probes, first, second, puts=2, hits=2 * (N_PROBES - 1))
    ((name, (_, (_, indices, _))),) = received(probes, second)[1][3]  # its attributes
    assert (name, indices) == ("micro_batch_indices", [describe(i)[0] for i in (0, 128, 256)])


# -- torch --------------------------------------------------------------------------------


def torch_batch(seed: int = 0) -> dict[str, Any]:
    torch = pytest.importorskip("torch")
    generator = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, 32_000, (256, 512), generator=generator),  # 1 MiB
        "logprobs": torch.randn(256, 512, generator=generator),
        "mask": torch.rand(256, 512, generator=generator) > 0.5,
        "value_head": torch.nn.Parameter(torch.randn(512, 512, generator=generator)),
        "rewards": torch.randn(256, generator=generator, requires_grad=True),
    }


def test_dict_of_torch_tensors(probes: list[Any]) -> None:
    batch = torch_batch()
    value_head = received(probes, batch)[1][1][3][1]
    assert class_of(value_head) == "torch.nn.parameter.Parameter"
    check(probes, batch, copy.deepcopy(batch), torch_batch(1), puts=2, hits=3 * N_PROBES - 2)


def test_batched_data_dict_of_tensors(probes: list[Any]) -> None:
    check(probes, BatchedDataDict(torch_batch()), puts=1, hits=N_PROBES - 1)


@dataclass
class Rollout:
    tokens: Any
    logprobs: Any
    advantages: Any
    step: int


def test_dataclass_of_tensors(probes: list[Any]) -> None:
    torch = pytest.importorskip("torch")
    rollout = Rollout(
        tokens=torch.randint(0, 32_000, (128, 1024)),  # 1 MiB
        logprobs=torch.randn(128, 1024),
        advantages=torch.randn(128),
        step=3,
    )
    later = copy.copy(rollout)
    later.step = 4  # same tensors, other metadata: other content
    assert class_of(received(probes, rollout)) == f"{__name__}.Rollout"
    check(probes, rollout, copy.deepcopy(rollout), later, puts=2, hits=3 * N_PROBES - 2)


def test_lists_of_tensor_shards(probes: list[Any]) -> None:
    torch = pytest.importorskip("torch")
    data = torch.arange(3 * 64 * 1024, dtype=torch.float64).reshape(3 * 64, 1024)
    shards = list(torch.chunk(data, N_PROBES))  # views: each pickles the whole storage
    check(probes, shards, puts=1, hits=N_PROBES - 1)
    refshare.reset_stats()
    check(probes, *shards, puts=N_PROBES, hits=N_PROBES * (N_PROBES - 1))


def test_bfloat16_tensors(probes: list[Any]) -> None:
    torch = pytest.importorskip("torch")
    weights = torch.randn(1024, 1024).to(torch.bfloat16)  # 2 MiB
    same_bytes = weights.view(torch.float16)  # equal bytes, another dtype: another value
    assert fields(received(probes, weights))["dtype"] == "torch.bfloat16"
    check(probes, weights, weights.clone(), same_bytes, puts=2, hits=3 * N_PROBES - 2)


def test_non_contiguous_tensors(probes: list[Any]) -> None:
    torch = pytest.importorskip("torch")
    base = torch.randn(512, 1024)  # 2 MiB
    views = [base, base.T, base[:, ::2], base[::2], base[1:], base.T.contiguous()]
    seen = tensor_layout(received(probes, base.T))
    assert seen["is_contiguous"] is False  # not contiguous: Ray keeps the strides
    check(probes, *views, base[::2], puts=len(views), hits=len(views) * 2 + 3)


@ray.remote(num_cpus=0.1)
class ProbeWithoutRefshare:
    """A probe in a process where refshare cannot be imported."""

    def __init__(self) -> None:
        for name in [m for m in sys.modules if m == "refshare" or m.startswith("refshare.")]:
            sys.modules[name] = None  # type: ignore[assignment]

    def describe(self, value: Any) -> Any:
        aliased = isinstance(value, dict) and value.get("a") is value.get("alias")
        return describe(value), aliased


@pytest.mark.verify_off  # counts serializations, which verify adds to
def test_tensors_reach_a_worker_without_refshare(monkeypatch: pytest.MonkeyPatch) -> None:
    """refshare stores a tensor as its storage's bytes, alone or inside a value it pickles
    itself, and an array of strings joined; the code that rebuilds them travels with them,
    so a worker without refshare gets what Ray by value gives it."""
    torch = pytest.importorskip("torch")
    probe = ProbeWithoutRefshare.remote()
    base = torch.randn(512, 1024)
    values = [base, base[128:256], base.T, base.to(torch.bfloat16), torch.ones(256, 512)]
    values.append(torch.randn(256, 512, requires_grad=True))
    values.append({"a": base, "alias": base, "rows": base[1:], "ids": np.arange(10), "n": 3})
    values.append(BatchedDataDict(torch_batch()))
    values += [words(), np.asfortranarray(words().reshape(200, -1))]  # joined strings

    @refshare.shared_args
    def shared() -> list[Any]:
        return ray.get([probe.describe.remote(v) for v in values])

    storages = torch.storage.TypedStorage
    saved: list[int] = []  # storages torch's pickling saves, in this process
    reduce = storages.__reduce__
    monkeypatch.setattr(storages, "__reduce__", lambda s: saved.append(1) or reduce(s))
    received = shared()
    assert saved == []  # every tensor went as its bytes, none through torch.save
    assert received == ray.get([probe.describe.remote(v) for v in values])
    assert len(saved) >= len(values)
    assert received[6][1] is True  # one tensor under two keys arrives as one, as by value
    assert refshare.stats().puts == len(values)
    ray.kill(probe)


@pytest.mark.verify_off  # counts serializations, which verify adds to
def test_a_serializer_registered_with_ray_for_tensors_is_used(probes: list[Any]) -> None:
    torch = pytest.importorskip("torch")
    calls: list[int] = []

    def serialize(t: Any) -> Any:
        calls.append(1)
        return t.numpy().copy()

    ray.util.register_serializer(torch.Tensor, serializer=serialize, deserializer=torch.from_numpy)
    try:
        weights = torch.randn(512, 1024)
        check(probes, weights, puts=1, hits=N_PROBES - 1)
        # Keyed by what the serializer sends: pickled for the first send (and put), again
        # for the second (which shows that it pickles alike), then not within the call;
        # then by value to every probe.
        assert len(calls) == 2 + N_PROBES
    finally:
        ray.util.deregister_serializer(torch.Tensor)


def test_a_tensor_changed_in_place_between_calls_is_sent_anew(probes: list[Any]) -> None:
    torch = pytest.importorskip("torch")
    weights = torch.zeros(512, 1024)
    check(probes, weights, puts=1, hits=N_PROBES - 1)
    weights.add_(1.0)
    refshare.reset_stats()
    check(probes, weights, puts=1, hits=N_PROBES - 1)


def test_a_tensor_changed_in_place_within_one_call_is_sent_anew(probes: list[Any]) -> None:
    torch = pytest.importorskip("torch")
    weights = torch.zeros(512, 1024)
    # Through a view: the tensor's version counter moves too.
    assert_changed_within_one_call_is_sent_anew(
        probes, weights, torch.zeros(512, 1024), lambda: weights[0].fill_(1.0)
    )


def test_a_batch_chunked_anew_for_each_call(
    probes: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker group's dispatch chunks its batch on every call: new views of the same
    tensor. Their storage is hashed once per call, and with reuse_fingerprints not again
    on the next; a change in place through any view sends the new content."""
    from test_fingerprint import count_hashing

    torch = pytest.importorskip("torch")
    batch = torch.zeros(N_PROBES * 128, 1024)  # each chunk pickles the whole storage

    def dispatch() -> list[Any]:
        chunks = batch.chunk(N_PROBES)
        return ray.get([p.describe.remote(c) for p, c in zip(probes, chunks, strict=True)])

    shared = refshare.shared_args(reuse_fingerprints=True)(dispatch)
    hashed, counts = count_hashing(monkeypatch), []
    for step in range(3):
        before, start = refshare.stats(), len(hashed)
        assert shared() == dispatch()
        after = refshare.stats()
        counts.append((after.puts - before.puts, after.hits - before.hits, len(hashed) - start))
        if step == 1:
            batch.chunk(N_PROBES)[-1].fill_(1.0)  # the last rows, through a view of them
    assert counts == [(N_PROBES, 0, 1), (0, N_PROBES, 0), (N_PROBES, 0, 1)]


# -- a registered user type ---------------------------------------------------------------


class _TensorDictBase:
    """Like tensordict.TensorDict: named tensors with a common leading batch size."""

    def __init__(self, tensors: dict[str, Any], batch_size: tuple[int, ...]) -> None:
        self.tensors = tensors
        self.batch_size = batch_size

    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.tensors.values())


class RegisteredTensorDict(_TensorDictBase):
    pass


class PlainTensorDict(_TensorDictBase):
    """The same type, never registered."""


def tensordicts(cls: type[_TensorDictBase]) -> list[_TensorDictBase]:
    torch = pytest.importorskip("torch")
    obs, action = torch.randn(256, 1024), torch.randn(256, 8)  # 1 MiB + 8 KiB
    return [
        cls({"obs": obs, "action": action}, (256,)),
        cls({"obs": obs.clone(), "action": action.clone()}, (256,)),  # equal content
        cls({"obs": obs, "action": action}, (256, 1)),  # other batch size: other content
    ]


def test_a_registered_tensordict_like_type(probes: list[Any]) -> None:
    refshare.register_fingerprint(
        RegisteredTensorDict,
        lambda td: (td.tensors, td.batch_size),
        size=RegisteredTensorDict.nbytes,
    )
    values = tensordicts(RegisteredTensorDict)
    assert refshare.estimate_size(values[0]) == values[0].nbytes()
    assert class_of(received(probes, values[0])) == f"{__name__}.RegisteredTensorDict"
    check(probes, *values, puts=2, hits=len(values) * N_PROBES - 2)


def test_the_same_type_unregistered_still_arrives_intact(probes: list[Any]) -> None:
    values = tensordicts(PlainTensorDict)
    shared = shared_send(probes, *values)
    stats = refshare.stats()
    assert shared == send(probes, *values)
    assert [c for _, c in shared] == [describe(v, False) for v in values for _ in probes]
    # Fingerprinted by pickling, or else sent by value: never a wrong ref.
    assert (stats.puts, stats.hits) == (2, 7) or stats.by_value == len(values) * N_PROBES


# -- torch stays unimported ---------------------------------------------------------------

NO_TORCH_SCRIPT = textwrap.dedent(
    """
    import sys

    import numpy as np
    import ray

    import refshare

    assert "torch" not in sys.modules, "import refshare"
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)

    @ray.remote(num_cpus=0.1)
    def total(batch):
        return float(batch["x"].sum())

    @refshare.shared_args
    def fan_out(batch):
        return ray.get([total.remote(batch) for _ in range(2)])

    batch = {"x": np.ones(1 << 18), "y": np.zeros((256, 256), dtype=np.float32)}
    assert fan_out(batch) == [float(1 << 18)] * 2
    stats = refshare.stats()
    assert (stats.puts, stats.hits) == (1, 1), stats
    ray.shutdown()
    assert "torch" not in sys.modules, sorted(m for m in sys.modules if "torch" in m)
    print("torch never imported")
    """
)


@pytest.mark.slow  # a Ray of its own, in a subprocess
def test_sharing_numpy_does_not_import_torch() -> None:
    env = {**os.environ, "RAY_ADDRESS": "local", "RAY_USAGE_STATS_ENABLED": "0"}
    result = subprocess.run(
        [sys.executable, "-c", NO_TORCH_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-5000:]
    assert "torch never imported" in result.stdout


# -- cases that once sent stale or wrong data ----------------------------------------------


def test_a_numpy_array_changed_in_place_within_one_call_is_sent_anew(probes: list[Any]) -> None:
    weights = np.zeros((512, 256))  # 1 MiB
    assert_changed_within_one_call_is_sent_anew(
        probes, weights, np.zeros((512, 256)), lambda: np.add(weights, 1.0, out=weights)
    )


def test_a_tensor_written_through_numpy_within_one_call_is_sent_anew(probes: list[Any]) -> None:
    torch = pytest.importorskip("torch")
    weights = torch.zeros(512, 512)
    # Behind torch's back: the version counter does not move, the spot check sees it.
    assert_changed_within_one_call_is_sent_anew(
        probes, weights, torch.zeros(512, 512), lambda: weights.numpy().fill(1.0)
    )


def test_a_conjugate_view_is_not_its_base(probes: list[Any]) -> None:
    torch = pytest.importorskip("torch")
    z = torch.randn(256, 512, dtype=torch.complex64)  # 1 MiB
    check(probes, z, z.conj(), puts=2, hits=2 * N_PROBES - 2)


def test_python_attributes_of_a_tensor_are_part_of_its_content(probes: list[Any]) -> None:
    torch = pytest.importorskip("torch")
    plain = torch.randn(512, 512)
    tagged = plain.clone()
    tagged.role = "reference"  # keyed by the pickle Ray sends, attributes included
    assert shared_send(probes, plain, tagged) == send(probes, plain, tagged)
    stats = refshare.stats()
    assert (stats.puts, stats.hits, stats.by_value) == (2, 2 * N_PROBES - 2, 0), stats


def test_bytes_put_and_saved_count_a_whole_container(probes: list[Any]) -> None:
    batch = numpy_batch()
    shared_send(probes, batch)
    total = sum(array.nbytes for array in batch.values())
    stats = refshare.stats()
    assert (stats.bytes_put, stats.bytes_saved) == (total, total * (N_PROBES - 1)), stats


@dataclass(slots=True)
class SlottedRollout:
    tokens: Any
    step: int


def test_a_slotted_dataclass_of_arrays_is_shared(probes: list[Any]) -> None:
    rollout = SlottedRollout(np.zeros((256, 512)), step=1)  # 1 MiB
    check(probes, rollout, puts=1, hits=N_PROBES - 1)
