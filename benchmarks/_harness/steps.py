"""Replaying an RL step: refshare on per strategy, each call timed, the strategies interleaved
step by step, the bytes each stored, and what every worker received."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.util
import os
import pickle
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import ray

from _harness import options, report, session
from _harness.report import REPO, MiB, log, ms
from _harness.stats import median, quartiles, ratio_interval, rotated

#: refshare's default mode (``deep=None``: it chooses per argument, whole or member by
#: member), what ``refshare.enable(framework)`` does; it keeps a cache of its own (see
#: :class:`Sharing`).
AUTO = "auto"
AUTO_OPTIONS: dict[str, Any] = {}
#: The framework as it is; top-level sharing (``deep=False``); ``deep=True``; the default;
#: and the framework as it is again, timed as one more strategy: what it measures against
#: plain is the run's own noise.
STRATEGIES = ("plain", "refshare", "deep", AUTO, "control")
WITH_AUTO = STRATEGIES
#: The options refshare is turned on with, per strategy.
OPTIONS: dict[str, dict[str, Any]] = {
    "refshare": {"deep": False},
    "deep": {"deep": True},
    AUTO: AUTO_OPTIONS,
}
#: Strategies that run the framework untouched.
UNTOUCHED = ("plain", "control")
#: How tables name the strategies.
LABELS = {"plain": "plain", "refshare": "top-level", "deep": "deep", AUTO: "default",
          "control": "plain again"}  # fmt: skip


class Sharing:
    """refshare on for one strategy's turn, off after, with that strategy's :data:`OPTIONS`;
    ``"plain"`` and ``"control"`` untouched.

    ``targets`` are ``(class or module, method names)``. With ``framework``, refshare is
    turned on with ``refshare.enable(framework, **options)`` and off with ``disable``, and the
    targets are only checked (wrapped while on, the originals back after); without, with
    ``patch_methods`` / ``unpatch_methods`` on the targets. Switch between turns only.

    Each strategy gets a ``RefCache`` of its own, kept from turn to turn: sharing one,
    a strategy would find what another's turn of the same step stored (equal content is
    keyed alike in every mode), and they would count each other's misses.
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

    def _wrapped(self) -> list[str]:
        return [f"{_name(o)}.{n}" for (o, n), f in self.originals.items() if o.__dict__[n] is not f]

    @contextlib.contextmanager
    def on(self, strategy: str) -> Iterator[None]:
        if strategy in UNTOUCHED:
            if self._wrapped():
                raise RuntimeError(f"plain turn, but still wrapped: {self._wrapped()}")
            yield
            return
        cache = self.caches.setdefault(strategy, self.refshare.RefCache())
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


def _name(owner: Any) -> str:
    return str(getattr(owner, "__qualname__", getattr(owner, "__name__", owner)))


def by_value_bytes(values: Iterable[Any]) -> int:
    """What Ray stores for arguments sent by value (or put by hand), once per ``.remote()``
    (or put): each one's serialized size, ``len(pickle.dumps(value, protocol=5))``."""
    return sum(len(pickle.dumps(value, protocol=5)) for value in values)


def example(name: str) -> ModuleType:
    """``examples/<name>.py``, imported: the frameworks' dispatch code is mirrored there, once.
    Ray sends its classes by value, as it would a script's, so workers need not import it."""
    from ray import cloudpickle

    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)
    return module


def examples_importable() -> None:
    """Make ``examples/`` importable here and in every Ray worker started from now on (they
    inherit ``PYTHONPATH``), so that a module there pickles by reference, as a framework's
    package does. Call it before Ray starts."""
    path = str(REPO / "examples")
    if path not in sys.path:
        sys.path.append(path)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, path] if path not in paths else paths)


class Turn:
    """One strategy's run of one step: each call's seconds and refshare's counts."""

    def __init__(self) -> None:
        import refshare

        self.stats = refshare.stats
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, dict[str, int]] = {}
        self.stored = 0  # bytes the driver stored in the step
        self.stored_calls: dict[str, int] = {}  # the same, per call
        self.distinct = 0  # bytes of the distinct tensors the step sent (set by the benchmark)
        self.received: Any = None  # checksums of what each worker received
        self._start, self._before = time.perf_counter(), self.stats()

    def call(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        before, start = self.stats(), time.perf_counter()
        out = fn(*args, **kwargs)
        self.seconds[name] = time.perf_counter() - start
        self.counts[name] = _delta(before, self.stats())
        return out

    def finish(self) -> None:
        self.seconds["step"] = time.perf_counter() - self._start
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
        keys = ("seconds", "counts", "stored", "stored_calls", "distinct")
        return {k: getattr(self, k) for k in keys}


def _delta(before: Any, after: Any) -> dict[str, int]:
    return {f: getattr(after, f) - getattr(before, f) for f in after._fields}


def interleave(
    label: str,
    steps: int,
    turn: Callable[[str, int], Turn],
    strategies: Sequence[str] = STRATEGIES,
) -> list[dict[str, Any]]:
    """Run ``steps`` steps, every strategy once per step (each leads in turn), with the 1-min
    load average sampled after each step; checks that every worker received the same."""
    out = []
    for step in range(steps):
        turns = {}
        for strategy in rotated(strategies, step):
            gc.collect()
            turns[strategy] = turn(strategy, step)
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
        "load_during": [t["load"] for t in steps],
    }


def replay(
    label: str,
    workers: Sequence[Any],
    config: Any,
    turn: Callable[[str, int], Turn],
    calls: Sequence[str],
    strategies: Sequence[str] = STRATEGIES,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Warm the store, then ``config.warmup`` untimed and ``config.steps`` timed steps of
    every strategy, interleaved: the timed steps, and what a report keeps of them."""
    log(f"{label}: warming the store")
    warm_seconds = session.warm_store(workers, config.store_bytes)
    every = interleave(label, config.warmup + config.steps, turn, strategies)
    timed = every[config.warmup :]
    return timed, {
        "warm_store_seconds": round(warm_seconds, 1),
        "summary": summarize(timed, calls, strategies),
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
