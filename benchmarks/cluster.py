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
* **refshare first sight**: top-level sharing, ``@refshare.shared_args(deep=False)``, cache
  emptied (``refshare.clear()``) before the call (for the batch: before the step, so its
  repeated last call hits);
* **refshare repeat**: the same call (the whole step for the batch) made once before, so the
  cache is warm;
* **deep** (batch only): ``@refshare.shared_args(deep=True)``, cache emptied before the step:
  each large member of a chunk is stored once (a single array has no members).

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
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import _cluster_counters as counters
import _cluster_report
import numpy as np
import ray
import xxhash
from _harness import options, report
from _harness.cluster import Setup, held, start_cluster, stop_cluster
from _harness.cluster import reset as reset_stores
from _harness.report import KiB, MiB, log, ms
from _harness.stats import rotated

import refshare

T = TypeVar("T")
#: Strategies in table order (``_cluster_report.STRATEGIES`` names them); the broadcast has no
#: members for deep sharing to take out.
BROADCAST_STRATEGIES = ("by_value", "per_call_put", "refshare_first", "refshare_repeat")
BATCH_STRATEGIES = (*BROADCAST_STRATEGIES, "deep")
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


shared_fan_out = refshare.shared_args(min_bytes=MIN_BYTES, deep=False)(fan_out)
#: Deep sharing's cache, of its own: what it holds is what the deep turn stored.
DEEP_CACHE = refshare.RefCache()
deep_fan_out = refshare.shared_args(min_bytes=MIN_BYTES, deep=True, cache=DEEP_CACHE)(fan_out)


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


def reset(setup: Setup) -> None:
    """Drop what the last turn kept, deep sharing's cache too; wait for idle stores."""
    DEEP_CACHE.clear()
    reset_stores(setup)


def shared_refs(values: Sequence[Any], deep: bool) -> list[Any]:
    """The refs refshare sent for ``values``: found in its cache by content
    (``refshare.share`` of what is cached puts nothing); with ``deep``, every object deep
    sharing's own cache holds, emptied before each turn (its members, stored together)."""
    if deep:
        refs = list(dict.fromkeys(DEEP_CACHE.get(key) for key in DEEP_CACHE))
        if not refs:
            raise RuntimeError("deep sharing stored nothing")
        return refs
    puts = refshare.stats().puts
    refs = [refshare.share(v) for v in values if refshare.estimate_size(v) >= MIN_BYTES]
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


# -- command line -------------------------------------------------------------------------------


def run(config: Config) -> dict[str, Any]:
    """Start the cluster, measure both workloads, stop it; return the raw results."""
    meta = report.machine(
        "cluster.py",
        cluster={
            "head": {"num_cpus": 0, "object_store_memory": config.head_store_bytes},
            "worker_node": {"num_cpus": 1, "object_store_memory": config.node_store_bytes},
        },
    )
    started = time.perf_counter()
    setup = start_cluster(
        Worker,
        config.worker_nodes,
        config.actors_per_node,
        config.head_store_bytes,
        config.node_store_bytes,
    )
    gc.freeze()  # what exists now lives to the end: the collections in reset() skip it
    try:
        log(f"cluster up: {len(setup.nodes)} nodes, {len(setup.workers)} workers")
        broadcast = run_broadcast(setup, config)
        batch = run_batch(setup, config)
    finally:
        stop_cluster(setup.cluster)
    report.finished(meta, started)
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
    args = options.parser(__doc__ or "", modes).parse_args(argv)
    why = counters.supported()
    if why is not None:
        print(f"cluster.py needs per-node store counters: {why}", file=sys.stderr)
        return 2
    results = run(MODES[options.mode(args)])
    written = _cluster_report.write(results, args.out)
    log(f"wrote {', '.join(str(args.out / name) for name in written)}")
    print((args.out / "cluster.md").read_text())
    received = next(g for g in results["goals"] if g["text"].startswith("every worker received"))
    return 0 if received["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
