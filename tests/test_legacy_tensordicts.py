"""What verl 0.9.1's legacy trainer sends: TensorDicts holding jagged nested tensors and
non-tensor entries, chunked and consolidated. Equal content built twice gets one key, any
change another, and every worker receives what it receives by value.

The nested tensors need torch only; the TensorDict cases run where tensordict imports
(``.ci/run`` installs it in a venv of its own). The conversions are mirrored here from verl
0.9.1 (``DataProto.to_tensordict``, ``verl/workers/utils/padding.py``
``left_right_2_no_padding``, ``verl/utils/tensordict_utils.py`` ``chunk_tensordict``).
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest
import ray
from differential_kit import describe_fully

import refshare

pytestmark = pytest.mark.usefixtures("local_ray", "fresh")

torch = pytest.importorskip("torch")
ROWS, PROMPT, RESPONSE = 16, 64, 64


@ray.remote(num_cpus=0.1)
def received(value: Any) -> Any:
    return describe_fully(value)


def both_ways(value: Any, **options: Any) -> tuple[list[Any], list[Any]]:
    """What two workers received of ``value``, by value and through refshare."""

    def send() -> list[Any]:
        return ray.get([received.remote(value) for _ in range(2)])

    return send(), refshare.shared_args(**options)(send)()


def verl_mirror() -> Any:
    """The one mirror of verl 0.9.1 (tests/mirrors/verl_mirror.py); its TensorDict parts need
    tensordict, its rollouts torch only."""
    import verl_mirror

    return verl_mirror


def padded_batch(seed: int = 0) -> dict[str, Any]:
    """A rollout's tensors: prompts left-padded, responses right-padded."""
    return dict(verl_mirror().rollout(ROWS, PROMPT, RESPONSE, seed=seed)[0])


def jagged(batch: dict[str, Any]) -> tuple[Any, Any, Any]:
    """Nested tensors made the two ways verl makes them, without tensordict: input_ids from
    the flat valid tokens and int32 cumulative offsets, position_ids from a list of rows."""
    mask = batch["attention_mask"]
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    lengths = mask.sum(dim=-1, dtype=torch.int32)
    offsets = torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    values = batch["input_ids"].reshape(-1)[indices]
    input_ids = torch.nested.nested_tensor_from_jagged(values, offsets=offsets)
    rows = [batch["position_ids"][i][mask[i].bool()] for i in range(mask.shape[0])]
    position_ids = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    return input_ids, position_ids, indices


def test_a_nested_tensor_is_keyed_by_its_content() -> None:
    a, b = jagged(padded_batch()), jagged(padded_batch())  # equal content, built twice
    for x, y in zip(a[:2], b[:2], strict=True):
        assert x is not y
        assert refshare.fingerprint(x) is not None
        assert refshare.fingerprint(x) == refshare.fingerprint(y)
    changed = padded_batch()
    assert changed["attention_mask"][3, PROMPT] == 1  # every response has a first token
    changed["input_ids"][3, PROMPT] += 1
    assert refshare.fingerprint(jagged(changed)[0]) != refshare.fingerprint(a[0])
    other = padded_batch(seed=1)
    assert refshare.fingerprint(jagged(other)[1]) != refshare.fingerprint(a[1])


@pytest.mark.parametrize("options", [{"min_bytes": 0}, {"min_bytes": 0, "deep": True}])
def test_a_nested_tensor_arrives_as_by_value(options: dict[str, Any]) -> None:
    input_ids, position_ids, _ = jagged(padded_batch())
    for value in (input_ids, position_ids, {"input_ids": input_ids, "ids": position_ids}):
        by_value, shared = both_ways(value, **options)
        assert shared == by_value


@pytest.fixture(scope="module")
def mirror() -> Any:
    pytest.importorskip("tensordict")
    return verl_mirror()


def converted(mirror: Any, seed: int = 0, **flags: Any) -> Any:
    """What one of the legacy trainer's data calls sends, made afresh from a rollout."""
    tensors, non_tensors, meta = mirror.rollout(ROWS, PROMPT, RESPONSE, seed=seed)
    batch = mirror.DataProto.from_dict(tensors, non_tensors, meta)
    return mirror.convert(batch, flags)


def test_a_converted_batch_is_keyed_by_its_content(mirror: Any) -> None:
    first, again = converted(mirror), converted(mirror)
    assert refshare.fingerprint(first) is not None
    assert refshare.fingerprint(first) == refshare.fingerprint(again)
    assert refshare.fingerprint(converted(mirror, compute_loss=True)) != refshare.fingerprint(first)
    assert refshare.fingerprint(converted(mirror, seed=1)) != refshare.fingerprint(first)
    chunked = mirror.chunk_batch
    one, two = chunked(converted(mirror), 2), chunked(converted(mirror), 2)
    assert [c.is_consolidated() for c in one] == [True, True]
    assert [refshare.fingerprint(c) for c in one] == [refshare.fingerprint(c) for c in two]
    assert refshare.fingerprint(one[0]) != refshare.fingerprint(one[1])


@pytest.mark.parametrize("options", [{"min_bytes": 0}, {"min_bytes": 0, "deep": True}])
def test_a_converted_batch_and_its_chunks_arrive_as_by_value(
    mirror: Any, options: dict[str, Any]
) -> None:
    for value in (converted(mirror), *mirror.chunk_batch(converted(mirror), 2)):
        by_value, shared = both_ways(value, **options)
        assert shared == by_value


@pytest.mark.parametrize("deep", [False, None])
def test_the_same_chunks_sent_by_two_groups_are_put_once(mirror: Any, deep: bool | None) -> None:
    @refshare.shared_args(min_bytes=0, deep=deep)
    def group_call(chunks: list[Any]) -> list[Any]:
        refs = [ray.put(c) for c in chunks]  # parallel_put, then execute_all_async
        return ray.get([received.remote(r) for r in refs])

    first = group_call(mirror.chunk_batch(converted(mirror), 2))  # one group
    stored = refshare.stats().puts
    # another group, the same batch converted again (a chunking of its own)
    second = group_call(mirror.chunk_batch(converted(mirror), 2))
    by_value = ray.get([received.remote(c) for c in mirror.chunk_batch(converted(mirror), 2)])
    assert first == second == by_value
    stats = refshare.stats()
    assert stats.puts == stored and stats.hits >= 2, stats  # the second group stores nothing
    if deep is False:
        assert (stats.puts, stats.hits) == (2, 2), stats  # each chunk whole, once


def test_a_consolidated_chunk_is_sized_close_to_what_it_pickles_to(mirror: Any) -> None:
    """Its storage is sized in full, its metadata from a sample of each container's members
    (a non-tensor entry per row, by the hundred): here strings of every length, half the
    chunk's bytes, sized within a sample's error (a full walk: within 1%)."""
    rows = 256
    tensors, non_tensors, meta = mirror.rollout(rows, PROMPT, RESPONSE, seed=0)
    lengths = np.random.default_rng(0).integers(0, 4000, rows)
    non_tensors["raw_prompt"] = np.array(["p" * int(n) for n in lengths], dtype=object)
    non_tensors["sorted"] = np.array(["s" * (8 * i) for i in range(rows)], dtype=object)
    batch = mirror.DataProto.from_dict(tensors, non_tensors, meta)
    for chunk in mirror.chunk_batch(mirror.convert(batch, {"compute_loss": False}), 2):
        assert chunk.is_consolidated()
        pickled = len(pickle.dumps(chunk, protocol=5))
        assert abs(refshare.estimate_size(chunk) - pickled) < 0.05 * pickled


def test_deep_sharing_stores_each_leaf_of_a_chunk_once_per_step(mirror: Any) -> None:
    """The next call of a step sends the same rows with one key more: deep sharing stores
    only that key's bytes, each consolidated chunk's leaves being members of their own (here
    of at least 1 KiB, for a batch small enough for the suite)."""
    tensors, non_tensors, meta = mirror.rollout(4 * ROWS, PROMPT, RESPONSE, seed=0)
    batch = mirror.DataProto.from_dict(tensors, non_tensors, meta)

    @refshare.shared_args(deep=True, min_bytes=1024)
    def group_call(chunks: list[Any]) -> list[Any]:
        return ray.get([received.remote(ray.put(c)) for c in chunks])

    first = mirror.chunk_batch(mirror.convert(batch, {"compute_loss": False}), 2)
    by_value = ray.get([received.remote(c) for c in first])
    assert group_call(first) == by_value
    stored = refshare.stats().bytes_put
    extra = torch.randn(4 * ROWS, RESPONSE)
    batch.batch["old_log_probs"] = extra
    second = mirror.chunk_batch(mirror.convert(batch, {"compute_loss": False}), 2)
    assert group_call(second) == ray.get([received.remote(c) for c in second])
    added = refshare.stats().bytes_put - stored
    assert extra.nbytes <= added < extra.nbytes + (stored // 4)  # the new key, and little else
