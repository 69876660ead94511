"""Replaying an RL step: refshare on per strategy, each call timed, the strategies interleaved
step by step, the bytes each stored, and what every worker received."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.util
import math
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import ray

from _harness import ideal, options, report, session
from _harness.report import REPO, MiB, log, ms
from _harness.stats import median, median_interval, quartiles, ratio_interval, rotated

#: refshare's default mode (``deep=None``: it chooses per argument, whole or member by
#: member), what ``refshare.enable(framework)`` does; it keeps a cache of its own (see
#: :class:`Sharing`).
AUTO = "auto"
AUTO_OPTIONS: dict[str, Any] = {}
#: refshare's audit mode: keyed as the default would, sent by value (its report counts what
#: sharing would save); and the ideal, a perfect memoizer's floor (see ``_harness.ideal``).
AUDIT, IDEAL = "audit", "ideal"
#: The framework as it is; top-level sharing (``deep=False``); ``deep=True``; the default;
#: the audit; the ideal; and the framework as it is again, timed as one more strategy: what
#: it measures against plain is the run's own noise.
STRATEGIES = ("plain", "refshare", "deep", AUTO, AUDIT, IDEAL, "control")
WITH_AUTO = STRATEGIES
#: The order the turns of a step run in (each leads in turn; the tables keep the order of
#: :data:`STRATEGIES`). The turns measured against plain by value (the audit, plain again)
#: run right after plain, and plain right after the ideal, whose puts die with its turn: each
#: meets an object store that no sharing strategy's cache has just filled. After one that
#: has, Ray's puts land on memory the driver has not touched yet: on verl's legacy flow an
#: audit turn right after the default's, its keying switched off, took 33,000 more page
#: faults and 86 ms more CPU time a step than plain, a cost no audit-only job pays.
RUN_ORDER = ("refshare", "deep", AUTO, IDEAL, "plain", AUDIT, "control")
#: The untimed pass of the step just before the ideal's turn (see ``_harness.ideal``): not a
#: strategy, nor reported, but its workers' checksums are compared with plain's too.
RECORD = "record"
#: The options refshare is turned on with, per strategy.
OPTIONS: dict[str, dict[str, Any]] = {
    "refshare": {"deep": False},
    "deep": {"deep": True},
    AUTO: AUTO_OPTIONS,
    AUDIT: {**AUTO_OPTIONS, "audit": True},
}
#: Strategies that run the framework untouched.
UNTOUCHED = ("plain", "control")
#: Strategies whose Ray stores what plain's does: the step counts it as plain's (untimed).
BY_VALUE = (*UNTOUCHED, AUDIT)
#: How tables name the strategies.
LABELS = {"plain": "plain", "refshare": "top-level", "deep": "deep", AUTO: "default",
          AUDIT: "audit", IDEAL: "ideal", "control": "plain again"}  # fmt: skip
#: The report's counts a turn keeps, summed over its call sites (the times: an audit's).
REPORTED = ("bytes_sent", "bytes_repeated", "bytes_distinct", "puts", "hits", "by_value",
            "would_save_ms", "sending_ms")  # fmt: skip


class Sharing:
    """How each strategy sends, for one turn at a time: refshare on with that strategy's
    :data:`OPTIONS`, off after; plain and control untouched; the ideal and its record
    through ``_harness.ideal``.

    ``targets`` are ``(class or module, method names)``. With ``framework``, refshare is
    turned on with ``refshare.enable(framework, **options)`` and off with ``disable``, and the
    targets are only checked (wrapped while on, the originals back after); without, with
    ``patch_methods`` / ``unpatch_methods`` on the targets. Switch between turns only.

    Each strategy gets a ``RefCache`` of its own, kept from turn to turn: sharing one,
    a strategy would find what another's turn of the same step stored (equal content is
    keyed alike in every mode), and they would count each other's misses. The strategies
    that share split the default cache's budget (a quarter of the store) between them, so
    that together they fill the store as one program's cache would: each with a whole
    quarter, their caches alone would pass the mark where refshare lets go (see
    ``refshare._pressure``), and the replay would time a store no single program has.
    """

    def __init__(self, targets: Sequence[tuple[Any, Sequence[str]]], framework: str = "") -> None:
        import refshare  # here, so that workers importing this module never import it

        self.refshare, self.targets, self.framework = refshare, targets, framework
        self.originals = {(o, n): o.__dict__[n] for o, names in targets for n in names}
        where = ", ".join(f"{_name(o)}.{n}" for o, n in self.originals)
        self.how = (
            f"refshare.enable({framework!r}, deep=...) (wraps {where}), then "
            f"refshare.disable({framework!r})"
            if framework
            else f"refshare.patch_methods(..., deep=...) on {where}, then unpatch_methods"
        )
        self.caches: dict[str, Any] = {}
        #: Each cache's budget; ``None``: the strategies that share split the default's.
        self.budget: int | None = None
        self.record: ideal.Record | None = None  # the ideal's next turn swaps in its refs

    def _wrapped(self) -> list[str]:
        return [f"{_name(o)}.{n}" for (o, n), f in self.originals.items() if o.__dict__[n] is not f]

    @contextlib.contextmanager
    def on(self, strategy: str) -> Iterator[Turn]:
        """The strategy's turn, timed in the :class:`Turn` it yields; refshare's report
        reset first, so that the turn's counts (:data:`REPORTED`) are its own."""
        self.refshare.reset_report()
        if strategy in OPTIONS:
            clock = keying_clock() if strategy == AUDIT else contextlib.nullcontext([0.0])
            with self._refshare_on(strategy), clock as spent:
                turn = Turn(strategy)
                yield turn
            turn.keying_seconds = spent[0]
            turn.reported = _totals(self.refshare.report())
            if strategy not in BY_VALUE:
                turn.stored_by_refshare()
            return
        if self._wrapped():
            raise RuntimeError(f"{strategy} turn, but still wrapped: {self._wrapped()}")
        if strategy == RECORD:
            turn = Turn(strategy)
            self.record = ideal.Record(lambda: turn.calling)
            with ideal.sending(self.record):
                yield turn
            turn.serialized = self.record.serialize_seconds
        elif strategy == IDEAL:
            record, self.record = self.record, None
            if record is None:
                raise RuntimeError("the ideal's turn comes right after its record")
            swap = ideal.Swap(record)
            with ideal.sending(swap):
                turn = Turn(strategy)
                yield turn
            swap.check()
            turn.put_seconds = swap.put_seconds
            for call, nbytes in record.stored_calls.items():
                turn.store(call, nbytes)
            distinct = len(record.by_content)
            turn.reported = {"puts": distinct, "hits": record.large - distinct, "by_value": 0}
        else:
            turn = Turn(strategy)
            yield turn

    @contextlib.contextmanager
    def _refshare_on(self, strategy: str) -> Iterator[None]:
        cache = self.caches.get(strategy)
        if cache is None:
            sharing = [s for s in OPTIONS if not OPTIONS[s].get("audit")]
            budget = self.budget or self.refshare.RefCache().max_bytes // len(sharing)
            cache = self.caches[strategy] = self.refshare.RefCache(max_bytes=budget)
        options = {"cache": cache, **OPTIONS[strategy]}
        if self.framework:
            self.refshare.enable(self.framework, **options)
        for owner, names in () if self.framework else self.targets:
            self.refshare.patch_methods(owner, *names, **options)
        try:
            if len(self._wrapped()) != len(self.originals):
                raise RuntimeError(f"{self.how}: only {self._wrapped()} were wrapped")
            yield
        finally:
            if self.framework:
                self.refshare.disable(self.framework)
            for owner, names in () if self.framework else self.targets:
                self.refshare.unpatch_methods(owner, *names)
            if self._wrapped():
                raise RuntimeError(f"{self.how}: {self._wrapped()} were not restored")


def _totals(found: Any) -> dict[str, int]:
    """A ``refshare.report()``'s :data:`REPORTED` counts, summed over its call sites."""
    return {field: sum(getattr(row, field) or 0 for row in found.rows) for field in REPORTED}


def _name(owner: Any) -> str:
    return str(getattr(owner, "__qualname__", getattr(owner, "__name__", owner)))


def by_value_bytes(values: Iterable[Any]) -> int:
    """What Ray stores for arguments sent by value (or put by hand), once per ``.remote()``
    (or put): each one's serialized size, ``len(pickle.dumps(value, protocol=5))``."""
    return sum(len(pickle.dumps(value, protocol=5)) for value in values)


def mirror(name: str) -> ModuleType:
    """``tests/mirrors/<name>.py``, imported as a framework's installed package is: by
    reference, here and in every worker (see :func:`mirrors_importable`), so that Ray pickles
    its classes by name, as it pickles the framework's. Call it before Ray starts."""
    mirrors_importable()
    return importlib.import_module(name)


def mirrors_importable() -> None:
    """Make the mirrors of framework code (``tests/mirrors/``) importable here and in every Ray
    worker started from now on (they inherit ``PYTHONPATH``), so that a module there pickles
    by reference, as a framework's package does. Call it before Ray starts."""
    path = str(REPO / "tests" / "mirrors")
    if path not in sys.path:
        sys.path.append(path)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, path] if path not in paths else paths)


class Turn:
    """One strategy's run of one step: each call's seconds and refshare's counts."""

    def __init__(self, strategy: str) -> None:
        import refshare

        self.strategy = strategy
        self.stats = refshare.stats
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, dict[str, int]] = {}
        self.reported: dict[str, int] = {}  # refshare's report of the turn (the ideal's own)
        self.serialized = 0.0  # the record's: Ray serializing the step's large arguments
        self.put_seconds = 0.0  # the ideal's: its puts of the step's distinct contents
        self.calling = "step"  # the call running now
        self.stored = 0  # bytes the driver stored in the step
        self.stored_calls: dict[str, int] = {}  # the same, per call
        self.distinct = 0  # bytes of the distinct tensors the step sent (set by the benchmark)
        self.received: Any = None  # checksums of what each worker received
        self.cpu_seconds = 0.0  # the driver process's CPU time in the step, all its threads
        self.keying_seconds = 0.0  # the audit's: its threads' CPU time keying (keying_clock)
        self._start, self._before = time.perf_counter(), self.stats()
        self._cpu = time.process_time()

    @property
    def by_value(self) -> bool:
        """Whether Ray stored what it stores by value (:data:`BY_VALUE`), for the step to
        count once the turn is over; the other strategies' bytes are counted already."""
        return self.strategy in BY_VALUE

    def call(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.calling = name
        before, start = self.stats(), time.perf_counter()
        out = fn(*args, **kwargs)
        self.seconds[name] = time.perf_counter() - start
        self.counts[name] = _delta(before, self.stats())
        self.calling = "step"
        return out

    def finish(self) -> None:
        self.seconds["step"] = time.perf_counter() - self._start
        self.cpu_seconds = time.process_time() - self._cpu
        self.counts["step"] = _delta(self._before, self.stats())

    def stored_by_refshare(self) -> None:
        """What refshare stored (its ``bytes_put``), per call and in the step."""
        self.stored_calls = {c: n["bytes_put"] for c, n in self.counts.items() if c != "step"}
        self.stored = self.counts["step"]["bytes_put"]

    def store(self, call: str, nbytes: int) -> None:
        """Count ``nbytes`` stored by ``call`` without refshare (counted after the step)."""
        self.stored_calls[call] = self.stored_calls.get(call, 0) + nbytes
        self.stored += nbytes

    def record(self) -> dict[str, Any]:
        keys = ("seconds", "cpu_seconds", "keying_seconds", "counts", "reported", "serialized",
                "put_seconds", "stored", "stored_calls", "distinct")  # fmt: skip
        return {k: getattr(self, k) for k in keys}


@contextlib.contextmanager
def keying_clock() -> Iterator[list[float]]:
    """The CPU time (``time.thread_time()``) the driver's threads spend in refshare's keying
    while it runs: in its two entry points, ``Scope.rewrite`` (a task's arguments) and
    ``Scope.ray_put``, and in its hashing pool's share of a buffer over 8 MiB. Where an
    audit's cost goes: beside the step's CPU time over plain's, which also holds what Ray's
    own work (its puts) costs more or less in that turn. Timed from outside refshare, by
    wrapping those three functions for the turn."""
    from refshare import _hashing, _scope

    spent = [0.0]
    lock = threading.Lock()

    def timing(fn: Callable[..., Any], pool_only: bool = False) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if pool_only and not threading.current_thread().name.startswith("refshare-hash"):
                return fn(*args, **kwargs)  # the calling thread's share: timed already
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                with lock:
                    spent[0] += time.thread_time() - start

        return timed

    wrapped = [(_scope.Scope, "rewrite", False), (_scope.Scope, "ray_put", False)]
    wrapped.append((_hashing, "_chunk_digests", True))
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in wrapped]
    for owner, name, pool_only in wrapped:
        setattr(owner, name, timing(getattr(owner, name), pool_only))
    try:
        yield spent
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def _delta(before: Any, after: Any) -> dict[str, int]:
    return {f: getattr(after, f) - getattr(before, f) for f in after._fields}


def interleave(
    label: str,
    steps: int,
    turn: Callable[[str, int], Turn],
    strategies: Sequence[str] = STRATEGIES,
    first: int = 0,
) -> list[dict[str, Any]]:
    """Run ``steps`` steps from step ``first`` on, every strategy once per step (each leads
    in turn, in the order of :data:`RUN_ORDER`; the ideal's record right before it), with
    the 1-min load average sampled after each step; checks that every worker received the
    same."""
    out = []
    order = sorted(strategies, key=lambda s: RUN_ORDER.index(s) if s in RUN_ORDER else -1)
    for step in range(first, first + steps):
        turns = {}
        for strategy in rotated(order, step):
            for each in (RECORD, strategy) if strategy == IDEAL else (strategy,):
                gc.collect()
                turns[each] = turn(each, step)
        same = all(t.received == turns["plain"].received for t in turns.values())
        load = round(os.getloadavg()[0], 2)
        out.append({"turns": {s: t.record() for s, t in turns.items()}, "same": same, "load": load})
        took = ", ".join(
            f"{s} {ms(t.seconds['step'])} ms {t.stored / MiB:.1f} MiB" for s, t in turns.items()
        )
        log(f"{label}: step {step}: {took}; load {load}" + ("" if same else "; CHECKSUMS DIFFER"))
    return out


def summarize(
    steps: list[dict[str, Any]], calls: Sequence[str], strategies: Sequence[str] = STRATEGIES
) -> dict[str, Any]:
    """Medians (ms), ratios to plain and bytes stored per step over the timed ``steps``."""
    names = (*calls, "step")
    times = {
        s: {c: [t["turns"][s]["seconds"][c] for t in steps] for c in names} for s in strategies
    }
    med = {s: {c: median(v) * 1e3 for c, v in by.items()} for s, by in times.items()}
    stored = {s: [t["turns"][s]["stored"] for t in steps] for s in strategies}
    paired = {  # each step's own ratio: its spread shows the noise
        s: {c: [a / b for a, b in zip(times[s][c], times["plain"][c], strict=True)] for c in names}
        for s in strategies
    }
    return {
        "times": times,
        "median_ms": med,
        "ratio_to_plain": {s: {c: med[s][c] / med["plain"][c] for c in names} for s in strategies},
        "ratio_interval": {
            s: {c: ratio_interval(times[s][c], times["plain"][c]) for c in names}
            for s in strategies
        },
        "paired_ratio_quartiles": {
            s: {c: quartiles(v) for c, v in by.items()} for s, by in paired.items()
        },
        "stored_per_step": stored,
        "stored_median": {s: median(v) for s, v in stored.items()},
        "stored_per_call_median": {
            s: {c: median([t["turns"][s]["stored_calls"].get(c, 0) for t in steps]) for c in calls}
            for s in strategies
        },
        "distinct_bytes": steps[-1]["turns"]["plain"]["distinct"],
        "counts_last_step": {s: steps[-1]["turns"][s]["counts"] for s in strategies},
        "reported_last_step": {s: steps[-1]["turns"][s]["reported"] for s in strategies},
        "load_during": [t["load"] for t in steps],
        **(
            against_ideal(times, steps) | audited(steps)
            if {AUDIT, IDEAL} <= set(strategies)
            else {}
        ),
    }


def against_ideal(
    times: dict[str, dict[str, list[float]]], steps: list[dict[str, Any]]
) -> dict[str, Any]:
    """The default against the ideal: the ratio of medians per call and step, and the
    quartiles of each step's own ratio; and the step against the ideal less its puts (the
    floor of a memoizer whose puts were made before the step)."""
    default, floor = times[AUTO], times[IDEAL]
    paired = {c: [a / b for a, b in zip(v, floor[c], strict=True)] for c, v in default.items()}
    puts = [t["turns"][IDEAL]["put_seconds"] for t in steps]
    unput = [a - b for a, b in zip(floor["step"], puts, strict=True)]
    return {
        "default_to_ideal": {c: median(v) / median(floor[c]) for c, v in default.items()},
        "default_to_ideal_quartiles": {c: quartiles(v) for c, v in paired.items()},
        "ideal_puts_ms": median(puts) * 1e3,
        "default_to_ideal_unput": median(default["step"]) / median(unput),
    }


def audited(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The audit's cost and count, step by step: its driver time over plain's against what
    Ray spends serializing the step's large arguments (timed in the ideal's record, on the
    same content), beside plain again's over plain (the noise); the same for the driver
    process's CPU time, which the workers' and Ray's daemons' share of the two cores does
    not blur; and the bytes it would save (its report's repeated bytes) against those the
    default saved in the same step."""

    def over_plain(strategy: str, clock: Callable[[dict[str, Any]], float]) -> float:
        turns = [t["turns"] for t in steps]
        return median([clock(t[strategy]) - clock(t["plain"]) for t in turns])

    def wall(turn: dict[str, Any]) -> float:
        return float(turn["seconds"]["step"])

    def cpu(turn: dict[str, Any]) -> float:
        return float(turn["cpu_seconds"])

    def by_value(turns: dict[str, Any]) -> float:
        """The step by value: the mean of plain's and plain again's, both untouched and
        both timed in the step, which halves the baseline's variance at no cost; a saving
        of a few percent of the step moved 3-52 ms between runs against plain's alone."""
        return (wall(turns["plain"]) + wall(turns["control"])) / 2

    serialized = median([t["turns"][RECORD]["serialized"] for t in steps])
    keying = median([t["turns"][AUDIT].get("keying_seconds", 0.0) for t in steps])
    would = [t["turns"][AUDIT]["reported"]["bytes_repeated"] for t in steps]
    saved = [t["turns"][AUTO]["reported"]["bytes_repeated"] for t in steps]
    each = [_ratio(w, s) for w, s in zip(would, saved, strict=True)]
    audit = [t["turns"][AUDIT]["reported"] for t in steps]
    would_ms = median([a.get("would_save_ms", 0.0) for a in audit])
    each_saved = [(by_value(t["turns"]) - wall(t["turns"][AUTO])) * 1e3 for t in steps]
    saved_ms = median(each_saved)  # what the default saved, in the same steps
    return {
        "would_save_ms": would_ms,
        "sending_ms": median([a.get("sending_ms", 0.0) for a in audit]),
        "default_saved_ms": saved_ms,
        "default_saved_quartiles_ms": quartiles(each_saved),
        "default_saved_interval_ms": median_interval(each_saved),
        "control_saved_ms": -over_plain("control", wall) * 1e3,
        "would_to_saved_ms": _ratio(would_ms, saved_ms),
        "audit_over_plain_ms": over_plain(AUDIT, wall) * 1e3,
        "control_over_plain_ms": over_plain("control", wall) * 1e3,
        "audit_cpu_over_plain_ms": over_plain(AUDIT, cpu) * 1e3,
        "control_cpu_over_plain_ms": over_plain("control", cpu) * 1e3,
        "serialize_ms": serialized * 1e3,
        "audit_cost": _ratio(over_plain(AUDIT, wall), serialized),
        "audit_cpu_cost": _ratio(over_plain(AUDIT, cpu), serialized),
        "audit_keying_ms": keying * 1e3,
        "audit_keying_cost": _ratio(keying, serialized),
        "would_save": median(would),
        "default_saved": median(saved),
        "would_to_saved": _ratio(median(would), median(saved)),
        "would_to_saved_range": [min(each), max(each)],
    }


def _ratio(a: float, b: float) -> float:
    return a / b if b else 1.0 if a == b else math.inf


def replay(
    label: str,
    workers: Sequence[Any],
    config: Any,
    turn: Callable[[str, int], Turn],
    calls: Sequence[str],
    strategies: Sequence[str] = STRATEGIES,
    sharing: Sharing | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Warm the store, then ``config.warmup`` untimed and ``config.steps`` timed steps of
    every strategy, interleaved: the timed steps, and what a report keeps of them. With
    ``config.budget == "quarter"``, each of ``sharing``'s caches holds a quarter of the
    bytes the last untimed step sent (its distinct bytes), made anew for the timed steps."""
    log(f"{label}: warming the store")
    warm_seconds = session.warm_store(workers, config.store_bytes)
    every = interleave(label, config.warmup, turn, strategies)
    budget = None
    if getattr(config, "budget", "default") == "quarter":
        if sharing is None or not every:
            raise ValueError("--budget quarter: the replay needs its Sharing and a warmup step")
        budget = sharing.budget = every[-1]["turns"]["plain"]["distinct"] // 4
        sharing.caches.clear()
        log(f"{label}: each cache's budget now {budget / MiB:.1f} MiB")
    every += interleave(label, config.steps, turn, strategies, first=config.warmup)
    timed = every[config.warmup :]
    return timed, {
        "warm_store_seconds": round(warm_seconds, 1),
        "summary": {**summarize(timed, calls, strategies), "cache_budget": budget},
        "checksums_same_every_step": [t["same"] for t in every],
    }


def run_replay(
    script: str,
    config: Any,
    measure: Callable[[], dict[str, Any]],
    markdown: Callable[[dict[str, Any]], str],
    out: Path,
    stem: str,
) -> dict[str, Any]:
    """One step replay from start to end: the record of the run, a local Ray for
    ``measure``, then ``stem.json`` and ``stem.md`` written to ``out`` (and printed)."""
    ray_init = {"num_cpus": 2, "object_store_memory": config.store_bytes}
    meta = report.machine(script, ray_init=ray_init)
    started = time.perf_counter()
    session.start_ray(config.store_bytes)
    try:
        results = {"meta": meta, "config": dataclasses.asdict(config), **measure()}
    finally:
        ray.shutdown()
    report.finished(meta, started)
    report.write_results(out, stem, results, markdown(results))
    print((out / f"{stem}.md").read_text())
    return results


def replay_main(
    script: str,
    doc: str,
    modes: dict[str, Any],
    run: Callable[[Any], dict[str, Any]],
    markdown: Callable[[dict[str, Any]], str],
    argv: Sequence[str] | None,
) -> int:
    """The command line of a replay of one flow: ``run`` it in the mode asked for, write its
    report; 1 if a worker received other data under any strategy."""
    args = options.step_parser(doc).parse_args(argv)
    config = options.step_config(args, modes)
    stem = Path(script).stem
    results = run_replay(script, config, lambda: {"result": run(config)}, markdown, args.out, stem)
    return 0 if all(results["result"]["checksums_same_every_step"]) else 1
