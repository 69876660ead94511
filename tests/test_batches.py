"""The batch types RL frameworks send: sizes that mean what Ray stores, and sharing that
costs one serialization per distinct value, against the real packages where installed.

verl's ``DataProto`` and ``tensordict`` are tested for real when they import (``.ci/run``
installs them in a venv of their own); torch cases run wherever torch does.
"""

from __future__ import annotations

import copy
import pickle
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import ray
from differential_kit import describe_fully as describe

import refshare

pytestmark = pytest.mark.usefixtures("local_ray", "fresh")

N = 4
torch = pytest.importorskip("torch")


@ray.remote(num_cpus=0.1)
class Reader:
    def read(self, value: Any) -> Any:
        return describe(value)


@pytest.fixture(scope="module")
def readers(local_ray: None) -> list[Any]:
    group = [Reader.remote() for _ in range(N)]
    ray.get([r.read.remote(0) for r in group])
    return group


def send_each(readers: list[Any], values: list[Any]) -> list[Any]:
    """One distinct value per reader, as data-parallel dispatch sends chunks."""
    return ray.get([r.read.remote(v) for r, v in zip(readers, values, strict=True)])


def broadcast(readers: list[Any], value: Any) -> list[Any]:
    return ray.get([r.read.remote(value) for r in readers])


shared_send_each = refshare.shared_args(send_each)
shared_broadcast = refshare.shared_args(broadcast)


# -- sizes --------------------------------------------------------------------------------


def test_a_torch_view_weighs_the_storage_its_pickle_sends() -> None:
    parent = torch.zeros(256, 1024)
    view = parent[:64]
    assert refshare.estimate_size(view) == parent.nbytes
    assert len(pickle.dumps(view)) >= parent.nbytes


def test_an_object_array_weighs_its_elements() -> None:
    uids = np.array([f"uid-{i:08d}-{'x' * 40}" for i in range(5000)], dtype=object)
    size = refshare.estimate_size(uids)
    assert size >= 5000 * 52 > uids.nbytes
    assert size <= len(pickle.dumps(uids))


# -- inference mode -----------------------------------------------------------------------


def test_inference_mode_tensors_are_shared_like_any_cpu_tensor(readers: list[Any]) -> None:
    with torch.inference_mode():
        log_probs = torch.randn(256, 1024)
        values = {"old_log_probs": log_probs, "values": torch.randn(256, 512)}
    assert log_probs.is_inference()
    assert shared_broadcast(readers, values) == broadcast(readers, values)
    stats = refshare.stats()
    assert (stats.puts, stats.hits, stats.by_value) == (1, N - 1, 0), stats
    assert (
        shared_broadcast(readers, {k: v.clone() for k, v in values.items()})[0]
        == (broadcast(readers, values)[0])
    )
    assert refshare.stats().puts == 1  # equal content in a new call: found again


def test_an_inference_tensor_changed_within_one_call_is_sent_anew(readers: list[Any]) -> None:
    with torch.inference_mode():
        t = torch.zeros(512, 512)

    @refshare.shared_args
    def change_midway() -> list[Any]:
        first = ray.get(readers[0].read.remote(t))
        with torch.inference_mode():
            t.add_(1.0)  # inference tensors have no version counter: the spot check sees it
        return [first, ray.get(readers[1].read.remote(t))]

    first, second = change_midway()
    with torch.inference_mode():
        zeros, ones = torch.zeros(512, 512), torch.ones(512, 512)
    assert [first, second] == ray.get([readers[0].read.remote(v) for v in (zeros, ones)])


# -- tensordict ---------------------------------------------------------------------------


def test_tensordict_chunks_are_shared_without_a_serialization_per_hit(
    readers: list[Any],
) -> None:
    tensordict = pytest.importorskip("tensordict")
    td = tensordict.TensorDict(
        {"input_ids": torch.randint(0, 1000, (64, 2048)), "mask": torch.ones(64, 2048)},
        batch_size=[64],
    )
    chunks = list(td.chunk(N))
    # Each chunk's pickle holds its parents' whole storages, and so does its size.
    assert refshare.estimate_size(chunks[0]) >= td["input_ids"].nbytes + td["mask"].nbytes
    assert shared_send_each(readers, chunks) == send_each(readers, chunks)
    assert shared_send_each(readers, list(td.clone().chunk(N))) == send_each(readers, chunks)
    stats = refshare.stats()
    assert (stats.puts, stats.hits, stats.by_value) == (N, N, 0), stats
    # A clone holds its attributes in another order, which its pickle sends: it shares a
    # key with the original exactly where Ray would send the two alike.
    from serialized_kit import serialized_digest

    clone = td.clone()
    alike = serialized_digest(clone) == serialized_digest(td)
    assert (refshare.fingerprint(clone) == refshare.fingerprint(td)) == alike


# -- verl's DataProto ---------------------------------------------------------------------


def dataproto_batch(rows: int = 64) -> Any:
    protocol = pytest.importorskip("verl.protocol")
    tensordict = pytest.importorskip("tensordict")
    batch = tensordict.TensorDict(
        {
            "input_ids": torch.randint(0, 32_000, (rows, 1024)),
            "attention_mask": torch.ones(rows, 1024, dtype=torch.int64),
            "responses": torch.randint(0, 32_000, (rows, 512)),
        },
        batch_size=[rows],
    )
    uids = np.array([f"uid-{i}" for i in range(rows)], dtype=object)
    return protocol.DataProto(batch=batch, non_tensor_batch={"uid": uids}, meta_info={"t": 1})


@pytest.fixture
def getstate_calls() -> Iterator[list[int]]:
    """Counts the driver's serializations of DataProto (calls of its own ``__getstate__``)
    with a profiler: a hook wrapped to count would be other code's pickling, which refshare
    rightly keys otherwise."""
    protocol = pytest.importorskip("verl.protocol")
    code = protocol.DataProto.__getstate__.__code__
    calls = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is code:
            calls[0] += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(previous)


def test_a_dataproto_chunk_weighs_its_own_rows() -> None:
    data = dataproto_batch()
    chunk = data.chunk(N)[1]
    rows = sum(t.nbytes for t in chunk.batch.values())
    assert chunk.batch["input_ids"].untyped_storage().nbytes() == data.batch["input_ids"].nbytes
    assert rows <= refshare.estimate_size(chunk) <= rows + (64 << 10)
    assert abs(len(pickle.dumps(chunk)) - refshare.estimate_size(chunk)) < 64 << 10


@pytest.mark.verify_off  # counts __getstate__ calls, which verify adds to
def test_dataproto_chunks_are_serialized_once_each(
    readers: list[Any], getstate_calls: list[int]
) -> None:
    data = dataproto_batch()
    chunks = data.chunk(N)
    by_value = send_each(readers, chunks)
    assert getstate_calls[0] == N
    getstate_calls[0] = 0
    assert shared_send_each(readers, chunks) == by_value
    # At most once per distinct chunk: keyed without serializing, stored in a form of
    # refshare's own (which runs no __getstate__) or as Ray pickles it.
    assert getstate_calls[0] <= N
    first = refshare.stats()
    assert first.puts >= 1 and first.by_value == 0, first
    again = copy.deepcopy(data).chunk(N)  # deepcopy pickles it: before counting
    getstate_calls[0] = 0
    assert shared_send_each(readers, again) == by_value
    assert getstate_calls[0] == 0  # equal content, new objects: nothing serialized
    stats = refshare.stats()
    assert (stats.puts, stats.by_value) == (first.puts, 0), stats  # nothing stored again
    assert stats.hits >= first.hits + N, stats


def test_a_grown_dataproto_is_new_content(readers: list[Any]) -> None:
    protocol = pytest.importorskip("verl.protocol")
    data = dataproto_batch()
    shared_send_each(readers, data.chunk(N))
    before = refshare.stats()
    extra = protocol.DataProto.from_dict({"old_log_probs": torch.randn(64, 512)})
    grown = data.union(extra)
    assert shared_send_each(readers, grown.chunk(N)) == send_each(readers, grown.chunk(N))
    after = refshare.stats()
    # Its new field stored (whole chunks again, or only their new members: deep sharing).
    assert after.puts > before.puts
    assert after.bytes_put - before.bytes_put >= extra.batch["old_log_probs"].nbytes


@pytest.mark.verify_off  # counts __getstate__ calls, which verify adds to
def test_a_dataproto_broadcast_is_keyed_once_per_call(
    readers: list[Any], getstate_calls: list[int]
) -> None:
    data = dataproto_batch()
    assert shared_broadcast(readers, data) == broadcast(readers, data)
    assert getstate_calls[0] == 1 + N  # refshare's one put, then Ray by value N times
    stats = refshare.stats()
    assert (stats.puts, stats.hits) == (1, N - 1), stats


# -- deep sharing of DataProto ------------------------------------------------------------


def test_a_grown_dataproto_deep_shares_only_its_new_key(readers: list[Any]) -> None:
    protocol = pytest.importorskip("verl.protocol")
    deep_send_each = refshare.shared_args(deep=True)(send_each)
    data = dataproto_batch(rows=256)  # every chunk's tensors above min_bytes
    assert deep_send_each(readers, data.chunk(N)) == send_each(readers, data.chunk(N))
    first = refshare.stats()
    # Three tensors per chunk, each chunk's own rows, its new ones put in one object; the
    # all-ones attention mask has one content in every chunk, so it is stored once.
    assert (first.puts, first.hits) == (N, N - 1), first
    batch = data.batch
    distinct = batch["input_ids"].nbytes + batch["responses"].nbytes
    assert first.bytes_put == distinct + batch["attention_mask"].nbytes // N
    extra = protocol.DataProto.from_dict({"old_log_probs": torch.randn(256, 512)})
    grown = data.union(extra)
    refshare.reset_stats()
    assert deep_send_each(readers, grown.chunk(N)) == send_each(readers, grown.chunk(N))
    stats = refshare.stats()
    assert stats.puts == N and stats.bytes_put == extra.batch["old_log_probs"].nbytes
    assert stats.hits == 3 * N  # every unchanged member, found again by content


@ray.remote(num_cpus=0.1)
def dataproto_as_received(data: Any) -> Any:
    """Everything a worker's code can see of a DataProto (its batch's size, device, lock and
    consolidation among it), and whether its batch is consolidated."""
    return describe(data), data.batch.is_consolidated()


def test_a_deep_shared_dataproto_arrives_as_by_value() -> None:
    data = dataproto_batch(rows=256)

    def send(chunks: list[Any]) -> list[Any]:
        return ray.get([dataproto_as_received.remote(c) for c in chunks])

    by_value = send(data.chunk(N))
    assert by_value[0][1]  # by value, the batch arrives consolidated
    assert refshare.shared_args(deep=True)(send)(data.chunk(N)) == by_value
    stats = refshare.stats()
    whole = sum(t.nbytes for t in data.batch.values())
    # As members: the attention mask, one content in every chunk, stored once.
    assert stats.hits >= N - 1 and stats.bytes_put < whole, stats
