"""refshare.enable("roll") and ROLL's ``DataProto``, on real Ray.

The ``DataProto`` under test is ROLL's own where ROLL imports (``PYTHONPATH=/path/to/ROLL``
in a venv with its dependencies), else the mirror of ROLL main 8eb27cc2 in
``tests/mirrors/roll_mirror.py``, published under ROLL's module names by its
``publish_as_roll()``. That is the simplest faithful option: refshare registers its ROLL
support, lazily, for the class ``roll.distributed.scheduler.protocol.DataProto``, and finds
the mirror's there exactly as it finds ROLL's, with no registration made for the tests; and
pickles name the mirror's classes by reference, as they name ROLL's. A worker publishes the
mirror too when it imports this module, which it does before it unpickles any argument of
the tasks and actors defined here (tests/ and tests/mirrors/ are on the workers' path). Where
tensordict is missing, the batch is the mirror's stand-in of tensordict 0.10.0's
``TensorDict``.

The clusters are the mirror's (``Cluster``, ``func_generator``, the DP-MP dispatch), wrapped
through ``enable("roll")`` pointed at them as tests/test_frameworks.py points it; where ROLL
imports, ``enable("roll")`` is also checked on ROLL's own ``Cluster``, and the mirror's
pickling and dispatch against ROLL's.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import os
import pickle
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import internals
import numpy as np
import pytest
import ray
import wrapt
from differential_kit import class_of, describe_content, describe_fully, fields

import refshare

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.usefixtures("local_ray", "fresh")

import roll_mirror as roll_style  # noqa: E402

PROTOCOL = "roll.distributed.scheduler.protocol"
# ROLL's logger writes to ./output/logs unless told otherwise, here and in workers.
os.environ.setdefault("ROLL_LOG_DIR", os.path.join(tempfile.gettempdir(), "roll-test-logs"))
REAL = roll_style.roll_is_installed()
if not REAL and "roll" not in sys.modules:
    roll_style.publish_as_roll()  # here, and in each worker, as it imports this module
protocol = importlib.import_module(PROTOCOL)
DataProto = protocol.DataProto
TensorDict = roll_style.TensorDict
HAS_TENSORDICT = roll_style.HAS_TENSORDICT
ROWS, COLS = 8, 8192  # an int64 (8, 8192) tensor: 512 KiB, over refshare's 100 KiB


def make(seed: int = 0, rows: int = ROWS) -> Any:
    """A ``DataProto`` as ROLL's pipeline holds one: tensors (one large), object arrays
    beside them, ``meta_info``."""
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "input_ids": torch.randint(0, 32_000, (rows, COLS), generator=g),
        "response_mask": torch.rand(rows, COLS, generator=g) > 0.3,
        "scores": torch.rand(rows, generator=g),
    }
    non_tensors = {"domain": np.array(["math"] * rows, dtype=object)}
    meta = {"global_step": seed, "loss_mask_keys": ["response_mask"], "_otel_ctx": {}}
    return DataProto(TensorDict(tensors, batch_size=[rows]), non_tensors, None, meta)


def key(value: Any) -> bytes:
    found = refshare.fingerprint(value)
    assert found is not None
    return found


@contextmanager
def counted_saves() -> Iterator[list[int]]:
    """How often ``torch.save`` runs meanwhile (a ``DataProto`` pickles through it)."""
    save, calls = torch.save, [0]

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return save(*args, **kwargs)

    torch.save = counting
    try:
        yield calls
    finally:
        torch.save = save


# -- what a worker receives ---------------------------------------------------------------------


def as_received(data: Any) -> Any:
    """What a worker can see of a ``DataProto`` (the shared describer: its fields, its batch's
    entries, every tensor's layout, bytes and storage, the arrays beside it, ``meta_info``),
    and what the describer leaves out: the order of its fields (it tells attributes by
    name), and which of its batch's keys are the very strings ``meta_info`` holds (it tells
    strings by value)."""
    return describe_fully(data), list(vars(data)), keys_named_elsewhere(data)


def attributes(seen: Any) -> dict[str, Any]:
    """The described fields of a received ``DataProto`` (see ``as_received``), by name."""
    (node, _), *_ = seen
    return dict(fields(node)["attributes"])


def meta_info_keys(seen: Any) -> list[Any]:
    """The described keys of a received ``DataProto``'s ``meta_info``."""
    _, (_, items, *_) = attributes(seen)["meta_info"]
    return [k for k, _ in items]


def storages(seen: Any) -> list[int]:
    """Per tensor a worker received, in order, which storage it views (named by the first
    tensor seen on it): the batch's aliasing."""

    def tensors(node: Any) -> Iterator[Any]:
        if isinstance(node, tuple) and len(node) == 2 and isinstance(node[0], int):
            body = node[1]
            if isinstance(body, tuple) and body[:1] == ("tensor",):
                yield fields(node)
                return
        if isinstance(node, (list, tuple)):
            for item in node:
                yield from tensors(item)

    return [t["storage, elements, shared storage"][2] for t in tensors(seen[0][0])]


def keys_named_elsewhere(data: Any) -> list[str]:
    """The batch's keys that are the very string objects ``meta_info`` holds: by value,
    none (the batch travels as ``torch.save``'s bytes, a pickle of its own)."""
    batch = vars(data).get("_batch", vars(data).get("batch"))
    elsewhere = [id(s) for s in strings_in(data.meta_info)]
    return [] if batch is None else [k for k in batch.keys() if id(k) in elsewhere]  # noqa: SIM118


def strings_in(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in (*value.keys(), *value.values()):
            yield from strings_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from strings_in(item)


@ray.remote(num_cpus=0.05)
def received(data: Any) -> Any:
    return as_received(data)


def both_ways(value: Any, **options: Any) -> tuple[list[Any], list[Any]]:
    """What two workers received of ``value``: by value, and through ``shared_args``."""

    def send() -> list[Any]:
        return ray.get([received.remote(value) for _ in range(2)])

    return send(), refshare.shared_args(**options)(send)()


def views() -> Any:
    """A batch of row views of larger tensors, not cloned: each sends its whole storage."""
    parent = make(rows=2 * ROWS)
    return DataProto(parent._batch[ROWS:], {"domain": parent._non_tensor_batch["domain"][ROWS:]},
                     None, parent.meta_info)  # fmt: skip


def aliased() -> Any:
    """Two tensors viewing one storage: ``torch.save`` writes it once, the worker gets them
    aliased."""
    x = torch.arange(2 * ROWS * COLS).reshape(2 * ROWS, COLS)
    return DataProto(TensorDict({"a": x[:ROWS], "b": x[ROWS:]}, batch_size=[ROWS]))


def apart() -> Any:
    """``aliased()``'s layouts and bytes, on two storages."""
    x = torch.arange(2 * ROWS * COLS).reshape(2 * ROWS, COLS)
    return DataProto(TensorDict({"a": x.clone()[:ROWS], "b": x.clone()[ROWS:]}, batch_size=[ROWS]))


def odd_layouts() -> Any:
    """A transposed int32, a bfloat16, a leaf that requires grad, a nested TensorDict."""
    g = torch.Generator().manual_seed(3)
    inner = TensorDict({"values": torch.rand(ROWS, COLS, generator=g)}, batch_size=[ROWS])
    tensors = {
        "transposed": torch.randint(0, 9, (COLS, ROWS), generator=g, dtype=torch.int32).t(),
        "bf16": torch.rand(ROWS, COLS, generator=g).to(torch.bfloat16),
        "grad": torch.rand(ROWS, COLS // 2, generator=g).requires_grad_(),
        "inner": inner,
    }
    return DataProto(TensorDict(tensors, batch_size=[ROWS]), meta_info={"temperature": 0.7})


CASES: dict[str, Callable[[], Any]] = {
    "a chunk": lambda: make(rows=2 * ROWS).chunk(2)[1],
    "row views": views,
    "aliased tensors": aliased,
    "meta only": lambda: DataProto(batch=None, meta_info=make().meta_info),
    "odd layouts": odd_layouts,
}


@pytest.mark.parametrize("options", [{}, {"deep": True}, {"deep": False}], ids=repr)
@pytest.mark.parametrize("case", list(CASES))
def test_a_worker_receives_what_it_receives_by_value(case: str, options: dict[str, Any]) -> None:
    value = CASES[case]()
    by_value, shared = both_ways(value, min_bytes=0, **options)
    assert shared == by_value
    assert class_of(by_value[0][0][0]) == f"{PROTOCOL}.DataProto"
    if case == "aliased tensors":  # the check sees aliasing: both tensors on one storage
        first, second = storages(by_value[0])
        assert first == second
        first, second = storages(both_ways(apart())[0][0])
        assert first != second


def test_deep_sharing_stores_each_tensor_once() -> None:
    """A batch that grew by one tensor, sent again deep: only the new tensor is stored."""
    first = make()
    grown = DataProto(first._batch.clone(), dict(first._non_tensor_batch), None, first.meta_info)
    grown._batch["old_log_probs"] = torch.rand(ROWS, COLS)
    by_value = ray.get([received.remote(first), received.remote(grown)])

    @refshare.shared_args(deep=True)
    def send(data: Any) -> Any:
        return ray.get(received.remote(data))

    assert send(first) == by_value[0]
    before = refshare.stats()
    assert send(grown) == by_value[1]
    after = refshare.stats()
    new = ROWS * COLS * 4  # old_log_probs, float32
    assert after.hits - before.hits >= 1  # input_ids, found again by content
    assert new <= after.bytes_put - before.bytes_put < new + (ROWS * COLS * 8) // 2


# -- keys -------------------------------------------------------------------------------------


def test_equal_content_built_twice_gets_one_key_without_pickling() -> None:
    with counted_saves() as saves:
        assert key(make()) == key(make())
        assert key(make()) != key(make(seed=1))
    assert saves == [0]  # keyed where the tensors lie, never saved


def changed(edit: Callable[[Any], None]) -> Any:
    data = make()
    edit(data)
    return data


def _setitem(data: Any, name: str, value: Any) -> None:
    data._batch[name] = value


CHANGES: dict[str, Callable[[Any], None]] = {
    "an input id": lambda d: d._batch["input_ids"][3, 5].add_(1),
    "a mask element": lambda d: d._batch["response_mask"][7, COLS - 1].logical_not_(),
    "a score": lambda d: d._batch["scores"][0].add_(1e-3),
    "a dtype": lambda d: _setitem(d, "input_ids", d._batch["input_ids"].to(torch.int32)),
    "a stride": lambda d: _setitem(d, "input_ids", d._batch["input_ids"].t().contiguous().t()),
    "a tensor added": lambda d: _setitem(d, "values", torch.zeros(ROWS)),
    "a non-tensor item": lambda d: d._non_tensor_batch["domain"].__setitem__(2, "code"),
    "a non-tensor key": lambda d: d._non_tensor_batch.update(tag=np.array([""] * ROWS, object)),
    "a meta_info value": lambda d: d.meta_info.update(global_step=1),
    "a meta_info key": lambda d: d.meta_info.update(disable_adapter=True),
    "the trace context": lambda d: d.meta_info.update(_otel_ctx={"traceparent": "00-1-2-01"}),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_any_change_gets_another_key(change: str) -> None:
    assert key(changed(CHANGES[change])) != key(make())


def test_clones_and_chunks_made_again_are_found_again() -> None:
    data = make()
    clone = DataProto(data._batch.clone(), {k: v.copy() for k, v in data._non_tensor_batch.items()},
                      None, dict(data.meta_info))  # fmt: skip
    # A clone's batch holds its attributes in another order, which torch.save writes: it
    # shares a key with the original exactly where Ray would send the two alike.
    from serialized_kit import serialized_digest

    assert (key(clone) == key(data)) == (serialized_digest(clone) == serialized_digest(data))
    one, two = make(rows=2 * ROWS).chunk(2), make(rows=2 * ROWS).chunk(2)
    assert [key(c) for c in one] == [key(c) for c in two]
    assert key(one[0]) != key(one[1])
    # A view sends its parent's whole storage, a chunk (cloned) its own rows only.
    assert key(views()) != key(make(rows=2 * ROWS).chunk(2)[1])


def test_which_tensors_share_a_storage_is_part_of_the_key() -> None:
    assert key(aliased()) != key(apart())
    # torch.save keys a storage by itself, not its address: two storages over one numpy
    # array are written twice, as two tensors on storages of their own are.
    array = np.arange(ROWS * COLS).reshape(ROWS, COLS)
    twice = DataProto(TensorDict({"a": torch.from_numpy(array), "b": torch.from_numpy(array)},
                                 batch_size=[ROWS]))  # fmt: skip
    t = torch.from_numpy(array.copy())
    copies = DataProto(TensorDict({"a": t, "b": t.clone()}, batch_size=[ROWS]))
    once = DataProto(TensorDict({"a": t, "b": t}, batch_size=[ROWS]))
    assert key(twice) == key(copies) != key(once)
    assert both_ways(twice) == (both_ways(copies)[0],) * 2


def test_what_refshare_does_not_read_is_keyed_by_its_pickle(monkeypatch: Any) -> None:
    remote = make()
    remote._remote_batch = SimpleNamespace(rows=ROWS)  # a RemoteBatch pickles its own way
    with counted_saves() as saves:
        assert key(remote) != key(make())
    assert saves == [1]
    if not HAS_TENSORDICT:
        return
    # Where ROLL's gate is True (tensordict 0.5 to 0.9), __getstate__ consolidates the batch
    # in place: refshare runs it, as by value would.
    old = SimpleNamespace(__version__="0.9.1")
    monkeypatch.setattr(protocol, "tensordict", old)
    monkeypatch.setattr(roll_style, "tensordict", old)
    data = make()
    with counted_saves() as saves:
        assert key(data) == key(make())
    assert saves == [2] and data._batch.is_consolidated()
    by_value, shared = both_ways(make(), min_bytes=0, deep=True)
    assert shared == by_value


# -- ROLL v0.2's layout ---------------------------------------------------------------------


@dataclasses.dataclass
class OldDataProto(DataProto):  # type: ignore[misc,valid-type]
    """ROLL v0.2.0's ``DataProto`` (3077befc, protocol.py l.160-243): a dataclass of
    ``batch``, ``non_tensor_batch`` and ``meta_info``, pickled as a 3-tuple. (A subclass of
    today's, named as ROLL names it, so that refshare's registration applies.)"""

    # ROLL's defaults are field(default_factory=dict): a default of None shadows the
    # properties of today's DataProto, and __post_init__ makes it a dict.
    batch: Any = None
    non_tensor_batch: Any = None
    meta_info: Any = None

    def __post_init__(self) -> None:
        self.non_tensor_batch = {} if self.non_tensor_batch is None else self.non_tensor_batch
        self.meta_info = {} if self.meta_info is None else self.meta_info

    def __getstate__(self) -> Any:
        saved = io.BytesIO()
        torch.save(self.batch, saved)  # (tensordict >= 0.10: the gate is False)
        return saved, self.non_tensor_batch, self.meta_info

    def __setstate__(self, state: Any) -> None:
        saved, non_tensor_batch, meta_info = state
        saved.seek(0)
        self.batch = torch.load(saved, weights_only=False, map_location="cpu")
        self.non_tensor_batch, self.meta_info = non_tensor_batch, meta_info


OldDataProto.__module__, OldDataProto.__qualname__ = PROTOCOL, "DataProto"
for _hook in (OldDataProto.__getstate__, OldDataProto.__setstate__):
    _hook.__module__ = PROTOCOL  # ROLL's own pickling, as where v0.2 is installed


def _register_as_installed() -> None:
    """Where ROLL v0.2 is installed, refshare's registration for the class at
    ``PROTOCOL.DataProto`` resolves to this one; beside today's, it is a subclass with
    pickling of its own, which the subclass rule keeps from being read as today's."""
    from refshare._deep import deep_reducers
    from refshare._integrations import roll
    from refshare._keys.sizes import sizes
    from refshare._keys.tables import builtin_fingerprints

    builtin_fingerprints.register(OldDataProto, roll.dataproto_fingerprint)
    sizes.register(OldDataProto, roll.dataproto_size)
    deep_reducers.register(OldDataProto, roll.dataproto_members)


_register_as_installed()


def old(seed: int = 0) -> Any:
    new = make(seed)
    return OldDataProto(new._batch, new._non_tensor_batch, new.meta_info)


def test_the_v02_layout_is_keyed_and_sent_as_its_pickling_sends_it() -> None:
    with counted_saves() as saves:
        assert key(old()) == key(old()) != key(old(seed=1))
    assert saves == [0]
    edited = old()
    edited.meta_info["global_step"] = 5
    assert key(edited) != key(old())
    for options in ({}, {"deep": True}):
        by_value, shared = both_ways(old(), min_bytes=0, **options)
        order = by_value[0][1]
        assert shared == by_value and order == ["batch", "non_tensor_batch", "meta_info"]


# -- pickling changed from outside ROLL ---------------------------------------------------------


def hook_setstate() -> None:
    """Wrap ``DataProto.__setstate__`` in this process, as a platform that post-processes
    each batch it loads would."""
    original = DataProto.__setstate__

    def hooked(data: Any, state: Any) -> None:
        original(data, state)
        data.meta_info = {**data.meta_info, "seen_by_hook": True}

    DataProto.__setstate__ = hooked


@ray.remote(num_cpus=0.05)
class Patched:
    """A worker whose ``DataProto.__setstate__`` a hook of its own wraps: by value,
    unpickling runs the hook. (Its methods name this module's functions only: Ray sends an
    actor class by value, and a worker imports this module, which publishes the mirror,
    before it can name ROLL's classes.)"""

    def __init__(self) -> None:
        hook_setstate()

    def received(self, data: Any) -> Any:
        return as_received(data)


@pytest.mark.parametrize("deep", [None, True, False])
def test_a_setstate_the_worker_patched_runs_as_by_value(deep: Any) -> None:
    """The deep rebuild sets ROLL's fields itself only where the worker's ``__setstate__`` is
    the code the driver read; else it runs the worker's on the state ROLL sends."""
    worker = Patched.remote()  # type: ignore[attr-defined]
    try:
        expected = ray.get(worker.received.remote(make()))
        assert describe_content("seen_by_hook")[0] in meta_info_keys(expected)
        with refshare.sharing(min_bytes=0, deep=deep):
            assert ray.get(worker.received.remote(make())) == expected
    finally:
        ray.kill(worker)


def _user_deserializer(state: Any) -> Any:
    data = DataProto.__new__(DataProto)
    data.__setstate__(state)
    data.meta_info = {**data.meta_info, "through_ray_serializer": True}
    return data


@pytest.mark.parametrize("deep", [None, True, False])
def test_a_serializer_registered_with_ray_is_what_is_sent(deep: Any) -> None:
    """A serializer registered with Ray replaces the class's unpickling by its deserializer,
    ROLL's own ``__getstate__`` as serializer or not: no reader reads the class then."""
    first, _ = both_ways(make(), min_bytes=0, deep=deep)  # read, and cached
    ray.util.register_serializer(
        DataProto, serializer=DataProto.__getstate__, deserializer=_user_deserializer
    )
    try:
        by_value, shared = both_ways(make(), min_bytes=0, deep=deep)
    finally:
        ray.util.deregister_serializer(DataProto)
    marked = describe_content("through_ray_serializer")[0]
    assert all(marked in meta_info_keys(seen) for seen in by_value) and by_value != first
    assert shared == by_value


# -- enable("roll") ---------------------------------------------------------------------------


class Member(roll_style.Worker):
    """A rank of a mirrored cluster, dp-major (rank = dp_rank * TP + tp_rank)."""

    def __init__(self, worker_config: Any) -> None:
        super().__init__(worker_config)
        tp, rank = roll_style.TP, self.rank
        self.rank_info = roll_style.RankInfo(world_size=self.world_size, tp_size=tp,
                                             dp_size=self.world_size // tp, rank=rank,
                                             tp_rank=rank % tp, dp_rank=rank // tp)  # fmt: skip
        self.received: list[Any] = []

    @roll_style.register(dispatch_mode=roll_style.Dispatch.ONE_TO_ALL)
    def initialize(self, pipeline_config: Any) -> None:
        self.pipeline_config = pipeline_config

    @roll_style.register(dispatch_mode=roll_style.Dispatch.DP_MP_COMPUTE)
    def compute(self, data: Any) -> list[Any]:
        self.received.append(as_received(data))
        return [len(data)]

    @roll_style.register(dispatch_mode=roll_style.Dispatch.ONE_TO_ALL)
    def take_received(self) -> list[Any]:
        received, self.received = self.received, []
        return received


@pytest.fixture(scope="module")
def cluster(local_ray: None) -> Any:
    """A mirrored cluster of dp 2 x tp 2, initialized, before anything is patched."""
    config = roll_style.WorkerConfig(name="critic", world_size=4)
    built = roll_style.Cluster("critic", Member, None, config)
    built.initialize(pipeline_config=None)
    return built


def per_chunk(cluster: Any, data: Any) -> list[int]:
    """How often the driver pickled each DP chunk of ``data`` in one call (each known by its
    first input id), the call's output checked."""
    save, firsts = torch.save, []

    def noting(obj: Any, *args: Any, **kwargs: Any) -> Any:
        firsts.append(int(obj["input_ids"][0, 0]))
        return save(obj, *args, **kwargs)

    torch.save = noting
    try:
        assert cluster.compute(data) == [ROWS // 2, ROWS // 2]  # the tp 0 ranks' outputs
    finally:
        torch.save = save
    return [firsts.count(int(c._batch["input_ids"][0, 0])) for c in data.chunk(2)]


@pytest.mark.verify_off  # counts serializations, which verify adds to
def test_enable_and_disable_roll_on_a_mirrored_cluster(cluster: Any, monkeypatch: Any) -> None:
    methods = ("execute_all_async", "execute_rank_zero_async")
    target = internals.Target("roll_mirror", "Cluster", methods)
    monkeypatch.setitem(
        internals.FRAMEWORKS, "roll", internals.Framework("roll", "test", ((target,),))
    )
    originals = [roll_style.Cluster.__dict__[m] for m in methods]
    assert per_chunk(cluster, make()) == [2, 2]  # by value: once per tp rank
    by_value = cluster.take_received()
    wrapped = ["Cluster.execute_all_async", "Cluster.execute_rank_zero_async"]
    assert refshare.enable("roll") == wrapped
    try:
        assert refshare.enable("roll") == wrapped  # idempotent: one layer
        assert per_chunk(cluster, make()) == [1, 1]  # each chunk pickled once, put
        assert per_chunk(cluster, make()) == [0, 0]  # then found again
        stats = refshare.stats()
        assert (stats.puts, stats.hits) == (2, 6), stats
        assert cluster.take_received() == [rank * 2 for rank in by_value]
    finally:
        assert refshare.disable("roll") == wrapped
    assert [roll_style.Cluster.__dict__[m] for m in methods] == originals
    assert per_chunk(cluster, make()) == [2, 2]
    assert cluster.take_received() == by_value


def test_enable_roll_wraps_the_cluster_where_roll_defines_it() -> None:
    cluster_module = importlib.import_module("roll.distributed.executor.cluster")
    owner = cluster_module.Cluster
    wrapped = ["Cluster.execute_all_async", "Cluster.execute_rank_zero_async"]
    assert refshare.enable("roll") == wrapped
    try:
        assert isinstance(owner.__dict__["execute_all_async"], wrapt.FunctionWrapper)
        assert not isinstance(owner.__dict__["execute_all"], wrapt.FunctionWrapper)
    finally:
        assert refshare.disable("roll") == wrapped
    assert not isinstance(owner.__dict__["execute_all_async"], wrapt.FunctionWrapper)


# -- the mirror against ROLL itself ---------------------------------------------------------

needs_roll = pytest.mark.skipif(not REAL, reason="ROLL does not import here")


def mirrored(data: Any) -> Any:
    """ROLL's ``DataProto`` made again as the mirror's."""
    return roll_style.DataProto(data._batch, data._non_tensor_batch, None, data.meta_info)


def but_class(data: Any) -> Any:
    """All ``as_received`` tells of ``data`` but its class (the mirror's is another): its
    fields, their order, the memory they share, the keys named elsewhere."""
    (node, sharing), *rest = as_received(data)
    return fields(node)["attributes"], sharing, rest


@needs_roll
def test_the_mirror_pickles_as_roll() -> None:
    for data in (make(), aliased(), views(), DataProto(batch=None, meta_info={"k": 1})):
        ours, theirs = mirrored(data).__getstate__(), data.__getstate__()
        assert ours[0].getvalue() == theirs[0].getvalue()  # torch.save's bytes
        assert pickle.dumps(ours[1:]) == pickle.dumps(theirs[1:])


@needs_roll
def test_the_mirror_chunks_and_dispatches_as_roll() -> None:
    from roll.distributed.executor.worker import RankInfo
    from roll.distributed.scheduler import decorator

    data = make(rows=3 * ROWS + 1)  # uneven: np.array_split sizes
    for ours, theirs in zip(mirrored(data).chunk(3), data.chunk(3), strict=True):
        assert but_class(ours) == but_class(theirs)
        assert ours.meta_info is theirs.meta_info is data.meta_info

    infos = [RankInfo(world_size=4, tp_size=2, dp_size=2, rank=r, tp_rank=r % 2, dp_rank=r // 2)
             for r in range(4)]  # fmt: skip
    cluster = SimpleNamespace(dp_size=2, world_size=4, get_rank_info=lambda rank: infos[rank])
    for first in (False, True):
        (ours,), _ = roll_style._dispatch_dp_mp_compute(cluster, first, mirrored(make()))
        (theirs,), _ = decorator._dispatch_dp_mp_compute(cluster, first, make())
        assert [but_class(d) for d in ours] == [but_class(d) for d in theirs]
        assert [id(d) for d in ours[:2]].count(id(ours[0])) == (1 if first else 2)
        assert [id(d) for d in theirs[:2]].count(id(theirs[0])) == (1 if first else 2)
