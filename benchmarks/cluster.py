"""Cluster benchmark: bytes copied between nodes and object-store memory per node, by strategy.

A cluster simulated on one machine with ``ray.cluster_utils.Cluster``: a head node that runs
the driver and no worker (``num_cpus=0``, as a real driver node), and worker nodes with an
object store each and two actors each, pinned to their node by a custom resource. Two
workloads:

* **broadcast**: one float64 array of S bytes sent to every worker, each call;
* **growing batch**: an RL step's batch, a dict of arrays (``input_ids``,
  ``attention_mask``, ``position_ids``, ``responses``) that gains ``old_log_probs``,
  ``ref_log_probs``, then ``values`` and ``advantages`` between calls, the last call sending
  the same batch again. Each call splits it in one chunk of rows per worker and sends chunk
  i to worker i, as verl's DP dispatch does.

Each sent as:

* **by value**: plain Ray (it stores each argument once per ``.remote()``);
* **per-call put**: ``r = ray.put(x)`` (each chunk for the batch), then ``r``, every call;
* **refshare first sight**: ``@refshare.shared_args``, cache emptied (``refshare.clear()``)
  before the call (for the batch: before the step, so its repeated last call hits);
* **refshare repeat**: the same call (the whole step for the batch) made once before, so the
  cache is warm;
* **deep** (batch only): ``@refshare.shared_args(deep=True)``, cache emptied before the step:
  each large member of a chunk is stored on its own (a single array has no members).

Measured per call: the bytes copied between nodes (the growth of each raylet's
``cumulative_created_bytes`` on every node but the driver's, see ``_cluster_counters.py``),
cross-checked against object locations wherever the driver can see the refs; the peak
object-store use of each node while the workers hold their arguments; wall time (context
only: every node shares one machine). Results go to ``cluster.md``, ``cluster.json`` and
``cluster.png`` in ``--out``.

    python benchmarks/cluster.py            # full run (a few minutes on 2 cores)
    python benchmarks/cluster.py --quick    # fewer repetitions, half the batch
    python benchmarks/cluster.py --smoke    # small sizes, one repetition: for the tests
"""

from __future__ import annotations

import gc
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import _cluster_counters as counters
import _harness as bench
import numpy as np
import ray
import xxhash
from _harness import DASH, TIMES, KiB, MiB, log, median, ms, rotated, size_label, table
from ray.cluster_utils import Cluster

import refshare

T = TypeVar("T")
#: Strategies in table order, with their labels; the broadcast has no deep column.
STRATEGIES: dict[str, str] = {
    "by_value": "by value",
    "per_call_put": "per-call put",
    "refshare_first": "refshare first sight",
    "refshare_repeat": "refshare repeat",
    "deep": "deep, first sight",
}
BROADCAST_STRATEGIES = ("by_value", "per_call_put", "refshare_first", "refshare_repeat")
BATCH_STRATEGIES = tuple(STRATEGIES)
MIN_BYTES = 100 * KiB  # refshare's default, stated so the cross-check knows what deep stores

#: The batch's keys: those it starts with (int64 tokens) and those calls add (float32).
BASE_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")
#: The step, as verl's PPO trainer makes it: (call, keys added to the batch before it).
CALLS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("compute_log_prob", ()),
    ("compute_ref_log_prob", ("old_log_probs",)),
    ("compute_values", ("ref_log_probs",)),
    ("update_critic", ("values", "advantages")),
    ("update_actor", ()),
)


@dataclass(frozen=True)
class Config:
    """What one run measures."""

    mode: str
    worker_nodes: int
    actors_per_node: int
    head_store_bytes: int  # the driver's node
    node_store_bytes: int  # each worker node
    broadcast_bytes: int
    rows: int  # batch rows, a multiple of the number of workers
    seq: int  # tokens per row
    reps: int  # timed repetitions of each strategy
    warm_up: bool  # an untimed round first
    hold_s: float  # how long each worker holds its argument while store use is sampled


MODES: dict[str, Config] = {
    "full": Config("full", 3, 2, 1 << 30, 512 * MiB, 64 * MiB, 384, 4096, 9, True, 0.3),
    "quick": Config("quick", 3, 2, 1 << 30, 512 * MiB, 64 * MiB, 192, 4096, 3, True, 0.3),
    "smoke": Config("smoke", 3, 2, 256 * MiB, 128 * MiB, 2 * MiB, 48, 4096, 1, False, 0.1),
}


# -- workers ----------------------------------------------------------------------------------


def receipt(value: Any, full: bool) -> list[tuple[str, str, tuple[int, ...], str]]:
    """What a worker received: per array (its key, dtype, shape, xxh3-64 of its bytes). Only
    about 4,096 evenly spaced elements are hashed unless ``full``: timed calls stay transport."""
    items = sorted(value.items()) if isinstance(value, dict) else [("", value)]
    out = []
    for key, array in items:
        flat = array.reshape(-1)
        data = flat if full else flat[:: max(1, flat.size // 4096)]
        digest = xxhash.xxh3_64_hexdigest(np.ascontiguousarray(data).data)
        out.append((key, str(array.dtype), tuple(array.shape), digest))
    return out


@ray.remote(num_cpus=0)
class Worker:
    """Holds its argument for a while, then says what it received."""

    def node(self) -> str:
        return str(ray.get_runtime_context().get_node_id())

    def receive(self, value: Any, hold_s: float = 0.0, full: bool = False) -> Any:
        time.sleep(hold_s)
        return receipt(value, full)


def fan_out(workers: Sequence[Any], values: Sequence[Any], hold_s: float, full: bool) -> Any:
    """Send ``values[i]`` to ``workers[i]`` and wait for all of them."""
    return ray.get(
        [w.receive.remote(v, hold_s, full) for w, v in zip(workers, values, strict=True)]
    )


shared_fan_out = refshare.shared_args(min_bytes=MIN_BYTES)(fan_out)
deep_fan_out = refshare.shared_args(min_bytes=MIN_BYTES, deep=True)(fan_out)


# -- the cluster --------------------------------------------------------------------------------


@dataclass
class Setup:
    """The running cluster: its nodes (driver's first), labels and workers."""

    cluster: Cluster
    nodes: list[counters.Node]
    driver: str
    labels: dict[str, str]  # node id -> "head (driver)", "node 1", ...
    workers: list[Any]
    workers_on: dict[str, int]  # label -> workers on that node
    idle: dict[str, int] = field(default_factory=dict)  # node id -> store bytes used at rest

    def by_label(self, per_node: dict[str, T]) -> dict[str, T]:
        """``per_node`` keyed by label, head first."""
        return {label: per_node[k] for k, label in self.labels.items()}


def start_cluster(config: Config) -> Setup:
    """The head (driver, no CPU for workers) and ``config.worker_nodes`` worker nodes, each
    with ``config.actors_per_node`` actors; the driver attached to the head."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "object_store_memory": config.head_store_bytes,
            "include_dashboard": False,
        },
    )
    try:
        for i in range(1, config.worker_nodes + 1):
            node: dict[str, Any] = {
                "num_cpus": 1,
                "object_store_memory": config.node_store_bytes,
                "resources": {f"node{i}": config.actors_per_node},
                **own_address(i),
            }
            cluster.add_node(**node)
        head = cluster.head_node
        assert head is not None
        ray.init(
            address=cluster.address,
            log_to_driver=False,
            configure_logging=False,
            _node_ip_address=head.node_ip_address,
        )
        cluster.wait_for_nodes()
        if counters.driver_node_id() != head.node_id:
            raise RuntimeError("the driver attached to a worker node, not to the head")
        workers, labels = [], {head.node_id: "head (driver)"}
        for i in range(1, config.worker_nodes + 1):
            group = [
                Worker.options(resources={f"node{i}": 1}).remote()
                for _ in range(config.actors_per_node)
            ]
            for node_id in ray.get([w.node.remote() for w in group]):
                labels[node_id] = f"node {i}"
            workers += group
        nodes = counters.cluster_nodes()
        if {n.node_id for n in nodes} != set(labels):
            raise RuntimeError(f"nodes {[n.node_id for n in nodes]} are not {labels}")
        on = {label: 0 for label in labels.values()}
        for i in range(1, config.worker_nodes + 1):
            on[f"node {i}"] = config.actors_per_node
        setup = Setup(cluster, nodes, head.node_id, labels, workers, on)
        setup.idle = {k: r.used_bytes for k, r in counters.settled(nodes).items()}
        return setup
    except BaseException:
        stop_cluster(cluster)
        raise


def own_address(i: int) -> dict[str, str]:
    """``node_ip_address`` for worker node ``i``: a loopback address of its own where the
    machine routes all of 127.0.0.0/8 (Linux does), so that only the head has the driver's
    address (Ray 2.40 attaches a driver to any node at its address; newer Ray prefers the
    head). Elsewhere, nothing: the nodes share one address."""
    address = f"127.0.0.{i + 1}"
    try:
        with socket.socket() as probe:
            probe.bind((address, 0))
    except OSError:
        return {}
    return {"node_ip_address": address}


def stop_cluster(cluster: Cluster) -> None:
    ray.shutdown()
    cluster.shutdown()  # type: ignore[no-untyped-call]


def reset(setup: Setup, timeout: float = 30.0) -> None:
    """Drop every object the last turn kept (refshare's cache, puts) and wait until every
    node's store is back to its idle use, so each turn starts from the same state."""
    refshare.clear()
    gc.collect()  # refs that refshare's structures hold in reference cycles go only now
    deadline = time.monotonic() + timeout
    while True:
        used = {k: r.used_bytes for k, r in counters.read(setup.nodes).items()}
        if all(used[k] <= setup.idle[k] + MiB for k in used):
            return
        if time.monotonic() > deadline:
            log(f"stores not idle after {timeout:.0f} s: {setup.by_label(used)}")
            return
        time.sleep(0.05)


# -- one call, measured ---------------------------------------------------------------------------


@dataclass
class Record:
    """One measured call: time, what each node created, what moved between nodes."""

    seconds: float
    created: dict[str, int]  # by node label
    moved: int  # bytes copied between nodes (by the counters)
    located: int | None  # the same by object locations (None: the refs are not visible)
    received_ok: bool


#: A call, given the hold time and whether workers check every element: returns what the
#: workers received, the refs the driver can see (None: none), and whether they outlive it.
Call = Callable[[float, bool], tuple[list[Any], list[Any] | None, bool]]


def measure(
    setup: Setup,
    call: Call,
    expected: list[Any],
    known: dict[Any, tuple[frozenset[str], int]],
    hold_s: float = 0.0,
    full: bool = False,
    before: dict[str, counters.Reading] | None = None,
) -> tuple[Record, dict[str, counters.Reading]]:
    """Run ``call`` once and count it; return the record and the counters after it.

    ``known`` holds the refs refshare sent before and where their copies were (updated
    here), so that a copy made by an earlier call is not counted again; ``before`` is the
    counters' reading after the call before, if nothing ran since. With ``full``, workers
    check every element they received, not a sample."""
    before_locations = counters.locations(known)
    before = before or counters.settled(setup.nodes)
    start = time.perf_counter()
    received, refs, remember = call(hold_s, full)
    seconds = time.perf_counter() - start
    after = counters.settled(setup.nodes)
    created = counters.created(before, after)
    located = None
    if refs is not None:
        located = counters.copied_settled(refs, before_locations, setup.driver)
        if remember:
            known.update(counters.locations(refs))
    moved = counters.between_nodes(created, setup.driver)
    ok = received == expected
    return Record(seconds, setup.by_label(created), moved, located, ok), after


#: Each node's peak store use above rest (by label), when sampled.
Peak = dict[str, int] | None
#: The records of one step, by call.
Steps = dict[str, Record]


def held(setup: Setup, action: Callable[[], T]) -> tuple[T, dict[str, int]]:
    """Run ``action`` while each node's store use is sampled; return its result and each
    node's peak use above idle (by label)."""
    result, samples = bench.sample_during(action, lambda: counters.read(setup.nodes))
    peak = {k: max(s[k].used_bytes for s in samples) - setup.idle[k] for k in setup.labels}
    return result, setup.by_label(peak)


def shared_refs(values: Sequence[Any], deep: bool) -> list[Any]:
    """The refs refshare sent for ``values`` (or for each large member, with ``deep``),
    found in its cache by content: ``refshare.share`` of what is cached puts nothing."""
    puts = refshare.stats().puts
    members = [m for v in values for m in (v.values() if deep else (v,))]
    refs = [refshare.share(m) for m in members if refshare.estimate_size(m) >= MIN_BYTES]
    if refshare.stats().puts != puts:
        raise RuntimeError("a value refshare sent was not in its cache")
    return refs


def strategy_call(workers: Sequence[Any], values: Sequence[Any], strategy: str) -> Call:
    """``values[i]`` to ``workers[i]``, sent the way ``strategy`` sends them."""

    def call(hold_s: float, full: bool) -> tuple[list[Any], list[Any] | None, bool]:
        if strategy == "by_value":
            return fan_out(workers, values, hold_s, full), None, False
        distinct = list({id(v): v for v in values}.values())  # a value sent twice, once
        if strategy == "per_call_put":
            refs = {id(v): ray.put(v) for v in distinct}
            sent = [refs[id(v)] for v in values]
            return fan_out(workers, sent, hold_s, full), list(refs.values()), False
        deep = strategy == "deep"
        received = (deep_fan_out if deep else shared_fan_out)(workers, values, hold_s, full)
        return received, shared_refs(distinct, deep), True

    return call


# -- workload (a): broadcast --------------------------------------------------------------------


def rounds(
    what: str,
    strategies: Sequence[str],
    config: Config,
    turn: Callable[[str], T],
    line: Callable[[T], str],
) -> dict[str, list[T]]:
    """An untimed round (unless ``config.warm_up`` is off), then ``config.reps`` rounds of
    every strategy, each round led by the next one; each logged in a line."""
    for strategy in strategies if config.warm_up else ():
        turn(strategy)
    records: dict[str, list[T]] = {s: [] for s in strategies}
    for rep in range(config.reps):
        for strategy in rotated(strategies, rep):
            records[strategy].append(turn(strategy))
        log(f"{what} rep {rep}: " + ", ".join(f"{s} {line(records[s][-1])}" for s in strategies))
    return records


def timed_then_held(
    setup: Setup,
    what: str,
    strategies: Sequence[str],
    config: Config,
    turn: Callable[..., tuple[T, Peak]],
    line: Callable[[T], str],
    record: Callable[[T], Any],
) -> dict[str, Any]:
    """``config.reps`` interleaved rounds of ``turn`` (see :func:`rounds`), then one held
    turn per strategy: each strategy's timed records and held record, written out with
    ``record``, and its peak store use while held."""
    records = rounds(what, strategies, config, lambda s: turn(s)[0], line)
    holds = {s: turn(s, config.hold_s, True) for s in strategies}
    reset(setup)
    return {
        s: {
            "timed": [record(r) for r in records[s]],
            "held": record(holds[s][0]),
            "peak": holds[s][1],
        }
        for s in strategies
    }


def run_broadcast(setup: Setup, config: Config) -> dict[str, Any]:
    """The broadcast, every strategy ``config.reps`` times interleaved, then once held."""
    x = np.random.default_rng(1).random(config.broadcast_bytes // 8)
    values = [x] * len(setup.workers)
    expected = {full: [receipt(x, full)] * len(values) for full in (False, True)}

    def turn(strategy: str, hold_s: float = 0.0, full: bool = False) -> tuple[Record, Peak]:
        """One call from rest (after a warm-up call for refshare repeat); with ``full``,
        held and checked in full, and each node's store use sampled while it runs."""
        reset(setup)
        call = strategy_call(setup.workers, values, strategy)
        known: dict[Any, tuple[frozenset[str], int]] = {}
        if strategy == "refshare_repeat":
            call(0.0, False)
            known = counters.locations(shared_refs([x], deep=False))

        def one() -> Record:
            return measure(setup, call, expected[full], known, hold_s, full)[0]

        return held(setup, one) if full else (one(), None)

    strategies = timed_then_held(
        setup,
        "broadcast",
        BROADCAST_STRATEGIES,
        config,
        turn,
        lambda r: f"{r.moved / MiB:.1f} MiB {ms(r.seconds)} ms",
        asdict,
    )
    size_ref = ray.put(x)
    object_bytes = counters.locations([size_ref])[size_ref][1]
    del size_ref
    reset(setup)
    return {
        "nbytes": x.nbytes,
        "object_bytes": object_bytes,
        "strategies": strategies,
    }


# -- workload (b): the growing batch --------------------------------------------------------------


def make_batch(rows: int, seq: int) -> dict[str, np.ndarray]:
    """Every key the step's batch ever holds: int64 tokens, float32 per-token values."""
    rng = np.random.default_rng(2)
    data: dict[str, np.ndarray] = {
        key: rng.integers(0, 50_000, (rows, seq), dtype=np.int64) for key in BASE_KEYS
    }
    for _, added in CALLS:
        for key in added:
            data[key] = rng.standard_normal((rows, seq), dtype=np.float32)
    return data


def step_batches(data: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """The batch each call of the step sends: a new dict each time, as ``union`` makes."""
    keys, out = list(BASE_KEYS), []
    for _, added in CALLS:
        keys += added
        out.append({key: data[key] for key in keys})
    return out


def chunks(batch: dict[str, np.ndarray], n: int) -> list[dict[str, np.ndarray]]:
    """Rows split in ``n`` equal chunks, made anew on each call (views, as a split is)."""
    rows = len(next(iter(batch.values()))) // n
    return [{k: v[i * rows : (i + 1) * rows] for k, v in batch.items()} for i in range(n)]


def run_batch(setup: Setup, config: Config) -> dict[str, Any]:
    """The growing batch: a step per strategy, ``config.reps`` steps interleaved, then one
    held step per strategy with each node's store use sampled throughout."""
    data = make_batch(config.rows, config.seq)
    batches = step_batches(data)
    n = len(setup.workers)
    expected = {
        full: [[receipt(c, full) for c in chunks(b, n)] for b in batches] for full in (False, True)
    }
    names = [name for name, _ in CALLS]

    def step(strategy: str, hold_s: float = 0.0, full: bool = False) -> tuple[Steps, Peak]:
        """One step from rest (after a warm-up step for refshare repeat); with ``full``,
        held and checked in full, and each node's store use sampled throughout."""
        reset(setup)
        known: dict[Any, tuple[frozenset[str], int]] = {}
        if strategy == "refshare_repeat":
            for batch in batches:
                strategy_call(setup.workers, chunks(batch, n), strategy)(0.0, False)
            for batch in batches:
                known |= counters.locations(shared_refs(chunks(batch, n), deep=False))

        def calls() -> Steps:
            out, reading = {}, None
            for name, batch, want in zip(names, batches, expected[full], strict=True):
                call = strategy_call(setup.workers, chunks(batch, n), strategy)
                out[name], reading = measure(setup, call, want, known, hold_s, full, before=reading)
            return out

        return held(setup, calls) if full else (calls(), None)

    strategies = timed_then_held(
        setup,
        "batch",
        BATCH_STRATEGIES,
        config,
        step,
        lambda one: f"{sum(r.moved for r in one.values()) / MiB:.1f} MiB",
        lambda one: {c: asdict(r) for c, r in one.items()},
    )
    return {
        "rows": config.rows,
        "seq": config.seq,
        "calls": [
            {"name": name, "keys": list(b), "added": list(added), "nbytes": _nbytes(b)}
            for (name, added), b in zip(CALLS, batches, strict=True)
        ],
        "distinct_bytes": _nbytes(data),
        "strategies": strategies,
    }


def _nbytes(arrays: dict[str, np.ndarray]) -> int:
    return sum(a.nbytes for a in arrays.values())


# -- analysis -----------------------------------------------------------------------------------


def _records(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """Every measured call of one broadcast strategy: the timed ones and the held one."""
    return [*entry["timed"], entry["held"]]


def _call_records(entry: dict[str, Any], call: str) -> list[dict[str, Any]]:
    """Every measured run of one call of the step under one batch strategy."""
    return [*(step[call] for step in entry["timed"]), entry["held"][call]]


def _same(values: Sequence[int]) -> int | None:
    """The value if all are equal (a repeatable count), else None."""
    return values[0] if len(set(values)) == 1 else None


def goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The project's claims at cluster scale, each measured: text, whether it held."""
    topo, bc, batch = results["topology"], results["broadcast"], results["batch"]
    size, st = bc["object_bytes"], bc["strategies"]
    holders, remote = topo["worker_nodes"], topo["remote_workers"]
    moved = {s: [r["moved"] for r in _records(st[s])] for s in BROADCAST_STRATEGIES}

    def copies(nbytes: float) -> str:
        return f"{nbytes / size:.2f} {TIMES} S"

    def peaks_are(strategy: str, want: dict[str, int]) -> tuple[bool, str]:
        peak = st[strategy]["peak"]
        ok = all(abs(peak[label] / size - n) < 0.05 for label, n in want.items())
        return ok, ", ".join(f"{label} {peak[label] / size:.2f}" for label in want)

    one_each = {label: 1 for label in topo["workers_on"]}
    per_worker = {  # the driver's node stores every worker's argument
        label: topo["workers"] if label == topo["driver"] else n
        for label, n in topo["workers_on"].items()
    }
    first_ok, first_text = peaks_are("refshare_first", one_each)
    repeat_ok, repeat_text = peaks_are("refshare_repeat", one_each)
    value_ok, value_text = peaks_are("by_value", per_worker)
    step = batch["strategies"]
    repeats_zero = [
        all(
            r["moved"] == 0
            for c in step["refshare_repeat"]["held"]
            for r in _call_records(step["refshare_repeat"], c)
        ),
        all(
            r["moved"] == 0
            for s in ("refshare_first", "deep")
            for r in _call_records(step[s], CALLS[-1][0])
        ),
    ]
    deep_step = [
        sum(run[c]["moved"] for c in run) for run in [*step["deep"]["timed"], step["deep"]["held"]]
    ]
    distinct = batch["distinct_bytes"]
    located = [
        (r["located"], r["moved"])
        for s in BROADCAST_STRATEGIES
        for r in _records(st[s])
        if r["located"] is not None
    ] + [
        (r["located"], r["moved"])
        for s in BATCH_STRATEGIES
        for c in step[s]["held"]
        for r in _call_records(step[s], c)
        if r["located"] is not None
    ]
    received = [r["received_ok"] for s in BROADCAST_STRATEGIES for r in _records(st[s])] + [
        r["received_ok"]
        for s in BATCH_STRATEGIES
        for c in step[s]["held"]
        for r in _call_records(step[s], c)
    ]
    repeatable = all(_same(v) is not None for v in moved.values()) and all(
        _same([r["moved"] for r in _call_records(step[s], c)]) is not None
        for s in BATCH_STRATEGIES
        for c in step[s]["held"]
    )
    out = [
        (
            "refshare repeat moves 0 bytes between nodes (broadcast: "
            f"{_span(moved['refshare_repeat'])} bytes in every call)",
            all(m == 0 for m in moved["refshare_repeat"]),
        ),
        (
            "refshare repeat moves 0 bytes in the batch too: every call of a step seen before, "
            "and the step's last call (the batch of the call before, sent again) under refshare "
            "and deep",
            all(repeats_zero),
        ),
        (
            f"refshare first sight moves at most (worker nodes) {TIMES} S = {holders} {TIMES} S: "
            f"the driver's node holds no worker, so each of the {holders} worker nodes pulls one "
            "copy "
            f"(measured {copies(max(moved['refshare_first']))})",
            all(m <= holders * size for m in moved["refshare_first"]),
        ),
        (
            f"by value moves (workers on other nodes) {TIMES} S = {remote} {TIMES} S (measured "
            f"{copies(max(moved['by_value']))})",
            all(m == remote * size for m in moved["by_value"]),
        ),
        (
            f"store while tasks run, refshare: one copy per node (first sight: {first_text}; "
            f"repeat: {repeat_text} copies)",
            first_ok and repeat_ok,
        ),
        (
            f"store while tasks run, by value: one copy per worker, all of them on the driver's "
            f"node ({value_text} copies)",
            value_ok,
        ),
        (
            f"deep moves each member once per step: {_span(deep_step, MiB)} MiB against "
            f"{distinct / MiB:.1f} MiB of distinct arrays ({max(deep_step) / distinct:.4f}{TIMES})",
            max(deep_step) <= 1.01 * distinct,
        ),
        (
            f"object locations agree with the counters to the byte for every call whose refs the "
            f"driver sees ({sum(a == b for a, b in located)} of {len(located)})",
            all(a == b for a, b in located),
        ),
        ("byte counts repeat exactly: every run of a call moved the same bytes", repeatable),
        (
            "every worker received exactly the arrays sent, by every strategy (dtype, shape "
            f"and xxh3-64 as computed on the driver; {sum(received)} of {len(received)} calls)",
            all(received),
        ),
    ]
    return [{"text": text, "ok": bool(ok)} for text, ok in out]


def _span(values: Sequence[float], unit: float = 1) -> str:
    """``values`` in ``unit`` (bytes whole, else to 0.1): one number if all agree, else a range."""
    digits = 0 if unit == 1 else 1
    low, high = (f"{v / unit:.{digits}f}" for v in (min(values), max(values)))
    return low if low == high else f"{low}{DASH}{high}"


# -- the report ---------------------------------------------------------------------------------


def spread(seconds: Sequence[float]) -> str:
    return f"{ms(median(seconds))} ({ms(min(seconds))}{DASH}{ms(max(seconds))})"


def report(results: dict[str, Any]) -> str:
    """cluster.md."""
    config, topo, bc = (results[k] for k in ("config", "topology", "broadcast"))
    size = bc["object_bytes"]
    labels = list(topo["workers_on"])
    lines = [
        "# refshare at cluster scale",
        "",
        *bench.machine_lines(results["meta"]),
        "",
        "## Setup",
        "",
        f"A cluster simulated on one machine with `ray.cluster_utils.Cluster` ({config['mode']} "
        "mode): every node has a raylet, an object store and (where the machine allows) an "
        "address of its own, and objects move between them as between machines, over "
        "loopback. The driver attaches to the head, which runs no worker (`num_cpus=0`), as "
        f"on a real driver node; {topo['workers']} actors, {config['actors_per_node']} per "
        "worker node, pinned with a custom resource per node.",
        "",
        *table(
            ["node", "address", "object store", "workers"],
            [
                [
                    label,
                    topo["addresses"][label],
                    size_label(topo["store_bytes"][label]),
                    str(topo["workers_on"][label]),
                ]
                for label in labels
            ],
        ),
        "",
        "## How it was measured",
        "",
        *method_lines(results),
        "",
        "## Goals",
        "",
        *(f"- {g['text']}: {'yes' if g['ok'] else 'NO'}" for g in results["goals"]),
        "",
        *broadcast_section(results, labels, size),
        "",
        *batch_section(results, labels),
    ]
    if results["skipped"]:
        lines += ["", "Skipped: " + "; ".join(results["skipped"]) + "."]
    return "\n".join(lines) + "\n"


def method_lines(results: dict[str, Any]) -> list[str]:
    config = results["config"]
    return [
        "- **Bytes copied between nodes**: each raylet's own counter of the bytes created in "
        "its object store (`store_stats.cumulative_created_bytes` of `GetNodeStats`, read "
        "with `ray._private.internal_api.node_stats`), read before and after each call once "
        "no pull is queued and two readings 20 ms apart agree. On a worker node every object "
        "created is a copy pulled from another node (workers put nothing and return a few "
        "hundred bytes, which Ray inlines in the reply); a copy already on a node is used "
        "without a pull and counts 0. The sum over every node but the driver's is the "
        "figure; the driver's node's own growth is what the driver stored (puts and by-value "
        "arguments).",
        "- **Cross-check**: for the refs the driver sees (per-call puts; refshare's refs, "
        "found again in its cache with `refshare.share`, which puts nothing for a cached "
        "value), `ray.experimental.get_object_locations` before and after the call: each "
        "node other than the driver's that gained a copy adds the object's size. By value, "
        "Ray's refs are internal, so only the counters see them.",
        f"- **Store use**: each node's `store_stats.object_store_bytes_used`, sampled every "
        f"20 ms by a thread while every worker holds its argument for {config['hold_s']} s "
        "(one held call per strategy, a whole held step for the batch), minus the node's use "
        "at rest. Between turns every object is dropped and each store waits until it is "
        "back at rest.",
        "- **Received values**: every worker returns the dtype, shape and xxh3-64 of each "
        "array it received (of every element in the held runs, of 4,096 evenly spaced "
        "ones in the timed runs), compared with the same computed on the driver.",
        f"- **Wall time**: the median of {config['reps']} calls (steps) per strategy, "
        "interleaved round-robin"
        + (", after an untimed round" if config["warm_up"] else "")
        + "; context only, since every node shares one machine and loopback.",
    ]


def broadcast_section(results: dict[str, Any], labels: list[str], size: int) -> list[str]:
    bc, topo = results["broadcast"], results["topology"]
    rows = []
    for s in BROADCAST_STRATEGIES:
        entry = bc["strategies"][s]
        records = _records(entry)
        moved = [r["moved"] for r in records]
        stored = [r["created"][labels[0]] for r in records]
        peak = entry["peak"]
        located = [r["located"] for r in records]
        rows.append(
            [
                STRATEGIES[s],
                f"{_span(moved, MiB)} ({max(moved) / size:.2f})",
                f"{_span(stored, MiB)} ({max(stored) / size:.2f})",
                *(f"{peak[label] / MiB:.1f} ({peak[label] / size:.2f})" for label in labels),
                spread([r["seconds"] for r in entry["timed"]]),
                "-"
                if located[0] is None
                else (
                    "yes" if located == moved else f"NO: {_span([x or 0 for x in located], MiB)}"
                ),
            ]
        )
    return [
        f"## Broadcast: S = {size_label(bc['nbytes'])} to all {topo['workers']} workers",
        "",
        f"One float64 array of {size_label(bc['nbytes'])} (as Ray stores it, with its "
        f"metadata: {size:,} bytes = S) sent to every worker each call. MiB, and in brackets "
        "copies of S; every run of a strategy counted the same bytes unless a range is given. "
        "refshare repeat's copies were made by the call before and stay on each node while "
        "the ref is cached: that is what it reuses.",
        "",
        *table(
            [
                "strategy",
                "copied between nodes",
                "stored on the driver's node",
                *(f"peak store: {label}" for label in labels),
                "ms per call: median (min" + DASH + "max)",
                "object locations agree",
            ],
            rows,
        ),
    ]


def batch_section(results: dict[str, Any], labels: list[str]) -> list[str]:
    batch, topo = results["batch"], results["topology"]
    st = batch["strategies"]
    calls = batch["calls"]
    moved_rows, time_rows = [], []
    for c in calls:
        name = c["name"]
        added = f" + {', '.join(c['added'])}" if c["added"] else ""
        moved_rows.append(
            [
                f"{name}{added}",
                f"{c['nbytes'] / MiB:.1f}",
                *(
                    _span([r["moved"] for r in _call_records(st[s], name)], MiB)
                    for s in BATCH_STRATEGIES
                ),
            ]
        )
        time_rows.append(
            [
                name,
                *(
                    spread([step[name]["seconds"] for step in st[s]["timed"]])
                    for s in BATCH_STRATEGIES
                ),
            ]
        )
    totals = {
        s: [sum(run[c]["moved"] for c in run) for run in [*st[s]["timed"], st[s]["held"]]]
        for s in BATCH_STRATEGIES
    }
    sent = sum(c["nbytes"] for c in calls)
    moved_rows.append(
        [
            "**whole step**",
            f"{sent / MiB:.1f}",
            *(f"**{_span(totals[s], MiB)}**" for s in BATCH_STRATEGIES),
        ]
    )
    step_seconds = {
        s: [sum(run[c]["seconds"] for c in run) for run in st[s]["timed"]] for s in BATCH_STRATEGIES
    }
    time_rows.append(["**whole step**", *(spread(step_seconds[s]) for s in BATCH_STRATEGIES)])
    peak_rows = [
        [STRATEGIES[s], *(f"{st[s]['peak'][label] / MiB:.1f}" for label in labels)]
        for s in BATCH_STRATEGIES
    ]
    n, rows, seq = topo["workers"], batch["rows"], batch["seq"]
    names = ", ".join(c["name"] for c in calls)
    return [
        "## Growing batch, DP-chunked",
        "",
        f"The step's calls ({names}) send a dict of [{rows}, {seq}] arrays, int64 "
        f"({', '.join(BASE_KEYS)}) then float32 as keys are added, split by rows into {n} "
        f"chunks, chunk i to worker i (verl's DP dispatch): every worker gets different rows, so "
        f"nothing is shared within a call, and what moves is the whole batch. Distinct arrays "
        f"in the step: {batch['distinct_bytes'] / MiB:.1f} MiB. refshare first sight and deep "
        "start each step with an empty cache (new data each step, as in training); refshare "
        "repeat sends a step it sent before.",
        "",
        "MiB copied between nodes per call:",
        "",
        *table(["call", "batch MiB", *(STRATEGIES[s] for s in BATCH_STRATEGIES)], moved_rows),
        "",
        "Peak store use above rest over a held step, MiB per node. refshare's cache keeps "
        "every batch it sent (until evicted or cleared), deep each member once. By value and "
        "per-call put need only the current call's batch, but Ray frees an object "
        "asynchronously, here 0.3 to 1 s after its last use, so over a step of held calls "
        "several calls' batches are alive at once:",
        "",
        *table(["strategy", *labels], peak_rows),
        "",
        "Milliseconds per call: median (min" + DASH + "max) over the timed steps:",
        "",
        *table(["call", *(STRATEGIES[s] for s in BATCH_STRATEGIES)], time_rows),
    ]


# -- the plot -----------------------------------------------------------------------------------


def plot(results: dict[str, Any], path: Path) -> None:
    """cluster.png: bytes between nodes and store use per node, for both workloads."""
    plt = bench.pyplot()
    topo, bc, batch = results["topology"], results["broadcast"], results["batch"]
    labels = list(topo["workers_on"])
    size = bc["object_bytes"]
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    colors = {s: f"C{i}" for i, s in enumerate(STRATEGIES)}

    ax = axes[0, 0]
    for i, s in enumerate(BROADCAST_STRATEGIES):
        moved = bc["strategies"][s]["held"]["moved"] / size
        ax.bar(i, moved, color=colors[s])
        ax.text(i, moved, f"{moved:.2f}", ha="center", va="bottom")
    for n, what in ((topo["worker_nodes"], "worker nodes"), (topo["remote_workers"], "workers")):
        ax.axhline(n, ls="--", color="gray", lw=0.8)
        ax.text(len(BROADCAST_STRATEGIES) - 0.5, n, f"{n} = {what}", va="bottom", ha="right")
    ax.set_xticks(range(len(BROADCAST_STRATEGIES)))
    ax.set_xticklabels([STRATEGIES[s] for s in BROADCAST_STRATEGIES])
    ax.set_ylabel(f"copies of S ({size_label(bc['nbytes'])})")
    ax.set_title("broadcast: bytes copied between nodes per call")

    _peaks(axes[0, 1], labels, bc, BROADCAST_STRATEGIES, colors, size, "copies of S")
    axes[0, 1].set_title("broadcast: peak store use per node while tasks run")

    ax = axes[1, 0]
    names = [c["name"] for c in batch["calls"]]
    for s in BATCH_STRATEGIES:
        run = batch["strategies"][s]["held"]
        total = np.cumsum([run[c]["moved"] / MiB for c in names])
        wide = {"lw": 5, "alpha": 0.4} if s == "by_value" else {}  # per-call put lies on it
        ax.plot(names, total, marker="o", color=colors[s], label=STRATEGIES[s], **wide)
    ax.axhline(batch["distinct_bytes"] / MiB, ls="--", color="gray", lw=0.8)
    ax.text(0, batch["distinct_bytes"] / MiB, "distinct arrays", va="bottom")
    ax.set_ylabel("MiB copied between nodes, cumulative")
    ax.set_title("growing batch, DP-chunked: one step")
    ax.tick_params(axis="x", labelrotation=20)
    ax.legend(fontsize="small")

    _peaks(axes[1, 1], labels, batch, BATCH_STRATEGIES, colors, MiB, "MiB")
    axes[1, 1].set_title("growing batch: peak store use per node over a step")
    axes[1, 1].legend(fontsize="small")
    fig.suptitle(
        f"refshare on a simulated cluster ({results['config']['mode']} mode): driver on the "
        f"head, {topo['workers']} workers on {topo['worker_nodes']} nodes"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _peaks(
    ax: Any,
    labels: Sequence[str],
    workload: dict[str, Any],
    strategies: Sequence[str],
    colors: dict[str, str],
    unit: float,
    ylabel: str,
) -> None:
    """A workload's peak store use per node, in ``unit`` bytes: bars grouped by node, one
    per strategy."""
    width = 0.8 / len(strategies)
    for i, s in enumerate(strategies):
        peak = workload["strategies"][s]["peak"]
        xs = [j + (i - (len(strategies) - 1) / 2) * width for j in range(len(labels))]
        ys = [peak[label] / unit for label in labels]
        ax.bar(xs, ys, width, color=colors[s], label=STRATEGIES[s])
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels)
    ax.set_ylabel(ylabel)


# -- command line -------------------------------------------------------------------------------


def run(config: Config) -> dict[str, Any]:
    """Start the cluster, measure both workloads, stop it; return the raw results."""
    meta = bench.machine(
        "cluster.py",
        cluster={
            "head": {"num_cpus": 0, "object_store_memory": config.head_store_bytes},
            "worker_node": {"num_cpus": 1, "object_store_memory": config.node_store_bytes},
        },
    )
    started = time.perf_counter()
    setup = start_cluster(config)
    gc.freeze()  # what exists now lives to the end: the collections in reset() skip it
    try:
        log(f"cluster up: {len(setup.nodes)} nodes, {len(setup.workers)} workers")
        broadcast = run_broadcast(setup, config)
        batch = run_batch(setup, config)
    finally:
        stop_cluster(setup.cluster)
    meta["seconds"] = round(time.perf_counter() - started, 1)
    meta["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    on = setup.workers_on
    topology = {
        "driver": setup.labels[setup.driver],
        "workers": len(setup.workers),
        "worker_nodes": sum(1 for n in on.values() if n),
        "remote_workers": sum(n for label, n in on.items() if label != setup.labels[setup.driver]),
        "workers_on": on,
        "store_bytes": setup.by_label({n.node_id: n.store_bytes for n in setup.nodes}),
        "addresses": setup.by_label({n.node_id: n.address for n in setup.nodes}),
    }
    return {
        "meta": meta,
        "config": asdict(config),
        "topology": topology,
        "broadcast": broadcast,
        "batch": batch,
        "skipped": [],
    }


def main(argv: Sequence[str] | None = None) -> int:
    modes = {"quick": "fewer repetitions, half the batch", "smoke": "small sizes, one repetition"}
    args = bench.parser(__doc__ or "", modes).parse_args(argv)
    why = counters.supported()
    if why is not None:
        print(f"cluster.py needs per-node store counters: {why}", file=sys.stderr)
        return 2
    config = MODES[bench.mode(args)]
    results = run(config)
    results["goals"] = goals(results)
    cannot_plot = bench.cannot_plot("cluster.png")
    if cannot_plot:
        results["skipped"].append(cannot_plot)
    bench.write_results(args.out, "cluster", results, report(results))
    if not cannot_plot:
        plot(results, args.out / "cluster.png")
    log(f"wrote {args.out / 'cluster.md'}, cluster.json" + ("" if cannot_plot else ", cluster.png"))
    print((args.out / "cluster.md").read_text())
    received = next(g for g in results["goals"] if g["text"].startswith("every worker received"))
    return 0 if received["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
