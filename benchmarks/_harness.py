"""What every benchmark here shares: a small local Ray, a warmed store, the store's usage
sampled while tasks run, interleaving, medians, size labels, the record of the machine and
revision, writing Markdown, JSON and plots, and for the RL-step replays: refshare on per
strategy, each call timed, bytes stored per step, the goals."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import importlib.util
import json
import os
import pickle
import platform
import shlex
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import ray

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TIMES = "\u00d7"  # multiplication sign
DASH = "\u2013"  # en dash
TIMES_LE = "\u2264"  # less-than or equal
REPO = Path(__file__).resolve().parent.parent
T = TypeVar("T")
S = TypeVar("S")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def start_ray(store_bytes: int, num_cpus: int = 2) -> None:
    """One local Ray session, sized for a 2-core machine: actors take fractions of a CPU."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        address="local",
        num_cpus=num_cpus,
        object_store_memory=store_bytes,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )


def warm_store(workers: Sequence[Any], store_bytes: int) -> float:
    """Write every page of the object store once, and map it in every worker.

    Fills 90% of the store with objects kept alive at once (so none reuses another's pages)
    and has each worker read them (``worker.touch.remote(array)``, which should read one byte
    per page), then frees them. Returns the seconds it took.
    """
    start = time.perf_counter()
    chunk_bytes = min(64 * MiB, store_bytes // 16)
    chunk = np.ones(chunk_bytes // 8)
    refs = [ray.put(chunk) for _ in range(int(0.9 * store_bytes) // chunk_bytes)]
    ray.get([w.touch.remote(ref) for ref in refs for w in workers])
    del refs
    return time.perf_counter() - start


def sample_during(
    action: Callable[[], T], sample: Callable[[], S], interval: float = 0.02
) -> tuple[T, list[S]]:
    """Run ``action`` while a thread calls ``sample`` every ``interval`` seconds; return its
    result and every sample, including one before and one after."""
    samples = [sample()]
    done = threading.Event()

    def sampler() -> None:
        while not done.wait(interval):
            samples.append(sample())

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    try:
        result = action()
    finally:
        done.set()
        thread.join()
    samples.append(sample())
    return result, samples


class StoreMonitor:
    """Reads the object store's usage from the cluster's available resources.

    The raylet reports usage about every 100 ms, so readings lag by that much.
    """

    def __init__(self) -> None:
        resources = ray.cluster_resources()  # type: ignore[no-untyped-call]
        self.capacity = float(resources["object_store_memory"])

    def used(self) -> float:
        available = ray.available_resources()  # type: ignore[no-untyped-call]
        return self.capacity - float(available.get("object_store_memory", 0.0))

    def settled(self, seconds: float) -> float:
        """Usage after ``seconds`` of quiet (frees and reports take that long to land)."""
        time.sleep(seconds)
        return self.used()

    def wait_until_idle(self, fraction: float = 0.05, timeout: float = 15.0) -> float:
        """Wait until at most ``fraction`` of the store is in use; return the seconds waited."""
        start = time.perf_counter()
        while self.used() > fraction * self.capacity and time.perf_counter() - start < timeout:
            time.sleep(0.1)
        return time.perf_counter() - start

    def peak_during(self, action: Callable[[], Any], interval: float = 0.02) -> float:
        """The highest usage seen while ``action`` runs."""
        return max(sample_during(action, self.used, interval)[1])


def stop_group(group: Any) -> None:
    """Kill a worker group's actors (``group.workers``) and free the placement groups of its
    ``group.resource_pool``, if it has one (verl's groups do)."""
    for actor in group.workers:
        ray.kill(actor)
    for pg in getattr(getattr(group, "resource_pool", None), "pgs", None) or ():
        ray.util.remove_placement_group(pg)


def touch(array: np.ndarray) -> int:
    """What a worker's ``touch`` does: read one byte of every page of ``array``."""
    return int(array.reshape(-1).view(np.uint8)[::4096].sum())


def rotated(names: Sequence[str], rep: int) -> list[str]:
    """Round-robin order for one repetition: each strategy leads in turn."""
    k = rep % len(names)
    return [*names[k:], *names[:k]]


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


#: Resamples behind a ratio's 95% interval; seeded, so a report is reproducible from its times.
BOOTSTRAP_RESAMPLES = 2000


def ratio_interval(times: Sequence[float], baseline: Sequence[float]) -> tuple[float, float]:
    """95% bootstrap interval of ``median(times) / median(baseline)``: how far the ratio of
    medians could move by noise alone, given the spread of each side's steps."""
    rng = np.random.default_rng(0)
    a, b = np.asarray(times), np.asarray(baseline)
    picks_a = rng.integers(0, len(a), (BOOTSTRAP_RESAMPLES, len(a)))
    picks_b = rng.integers(0, len(b), (BOOTSTRAP_RESAMPLES, len(b)))
    ratios = np.median(a[picks_a], axis=1) / np.median(b[picks_b], axis=1)
    low, high = np.quantile(ratios, [0.025, 0.975])
    return float(low), float(high)


def size_label(nbytes: int) -> str:
    """``10 KiB``, ``64 MiB``: the payload sizes as the tables show them."""
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if nbytes >= unit:
            return f"{nbytes / unit:g} {name}"
    return f"{nbytes} B"


def ms(seconds: float) -> str:
    value = seconds * 1e3
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}" if value >= 1 else f"{value:.3f}"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


RESULTS = REPO / "benchmarks" / "results"


def parser(doc: str, modes: dict[str, str]) -> argparse.ArgumentParser:
    """A benchmark's options: one of its ``modes`` (``--quick``, ``--smoke``, ...: flag name
    to help) at most, and ``--out``."""
    found = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    group = found.add_mutually_exclusive_group()
    for name, help_text in modes.items():
        group.add_argument(f"--{name}", action="store_true", help=help_text)
    found.add_argument(
        "--out", type=Path, default=RESULTS, help="where the results go (benchmarks/results)"
    )
    return found


def mode(args: argparse.Namespace) -> str:
    """The mode the options chose: ``smoke``, ``quick`` or ``full``."""
    return "smoke" if args.smoke else "quick" if args.quick else "full"


def step_config(args: argparse.Namespace, modes: dict[str, T]) -> T:
    """A step replay's configuration: its mode's, with ``--steps`` if given."""
    config = modes[mode(args)]
    return dataclasses.replace(config, steps=args.steps) if args.steps else config


def example(name: str) -> Any:
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


def step_parser(doc: str) -> argparse.ArgumentParser:
    """The options every step replay takes: its mode, how many steps, where to write."""
    found = parser(doc, {"quick": "9 timed steps", "smoke": "tiny batch, 2 timed steps"})
    found.add_argument("--steps", type=int, help="timed steps (default: by mode)")
    return found


def git_state() -> dict[str, str]:
    """The commit the benchmark ran at, and what differed from it (``git status --short``)."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True, timeout=10
        ).stdout.rstrip()

    try:
        return {"head": git("rev-parse", "HEAD"), "status": git("status", "--short")}
    except (OSError, subprocess.SubprocessError):
        return {"head": "", "status": ""}


def machine(script: str, **extra: Any) -> dict[str, Any]:
    """The machine, software and revision of a run; ``extra`` is added as it is."""
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {"python": platform.python_version(), "ray": ray.__version__}
    for name in ("numpy", "torch", "tensordict", "verl", "xxhash", "refshare"):
        if importlib.util.find_spec(name) is not None:
            module = __import__(name)
            versions[name] = getattr(module, "__version__", getattr(module, "VERSION", "?"))
    return {
        "command": shlex.join(["python", f"benchmarks/{script}", *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "versions": versions,
        "git": git_state(),
        "load_average": [round(x, 2) for x in os.getloadavg()],  # 1, 5 and 15 minutes
        **extra,
    }


def machine_lines(meta: dict[str, Any]) -> list[str]:
    """The Markdown lines that say where and at which revision a run was made."""
    versions = ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
    load = ", ".join(map(str, meta.get("load_average", ["?"])))
    if "load_average_end" in meta:
        load = f"{load} at the start, {', '.join(map(str, meta['load_average_end']))} at the end"
    status = meta["git"]["status"]
    changed = ", ".join(line.strip() for line in status.splitlines()) if status else "none"
    return [
        f"Command: `{meta['command']}` ({meta['date']}, {meta.get('seconds', '?')} s)",
        "",
        f"Machine: {meta['cpu']}, {meta['cores']} cores; {meta['platform']}; {versions}. "
        f"Load average (1, 5, 15 min): {load}.",
        "",
        f"Revision: `{meta['git']['head'] or 'unknown'}`; uncommitted changes: {changed}.",
    ]


def cannot_plot(name: str) -> str | None:
    """Why plot ``name`` cannot be drawn here (matplotlib is optional), or ``None``."""
    if importlib.util.find_spec("matplotlib") is None:
        return f"{name}: matplotlib is not installed (pip install .[bench])"
    return None


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend: plots go to files, no display needed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_results(out: Path, stem: str, results: dict[str, Any], markdown: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown)


#: The framework as it is; top-level sharing; deep=True; and the framework as it is again,
#: timed as one more strategy: what it measures against plain is the run's own noise.
STRATEGIES = ("plain", "refshare", "deep", "control")
#: Strategies that run the framework untouched.
UNTOUCHED = ("plain", "control")
#: How tables name the strategies.
LABELS = {"plain": "plain", "refshare": "refshare", "deep": "deep", "control": "plain again"}


class Sharing:
    """refshare on for one strategy's turn, off after: ``"refshare"`` top-level, ``"deep"``
    with ``deep=True``, ``"plain"`` and ``"control"`` untouched.

    ``targets`` are ``(class or module, method names)``. With ``framework``, refshare is
    turned on with ``refshare.enable(framework, deep=...)`` and off with ``disable``, and the
    targets are only checked (wrapped while on, the originals back after); without, with
    ``patch_methods`` / ``unpatch_methods`` on the targets. Switch between turns only.
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

    def _wrapped(self) -> list[str]:
        return [f"{_name(o)}.{n}" for (o, n), f in self.originals.items() if o.__dict__[n] is not f]

    @contextlib.contextmanager
    def on(self, strategy: str) -> Iterator[None]:
        if strategy in UNTOUCHED:
            if self._wrapped():
                raise RuntimeError(f"plain turn, but still wrapped: {self._wrapped()}")
            yield
            return
        deep = strategy == "deep"
        if self.framework:
            self.refshare.enable(self.framework, deep=deep)
        for owner, names in () if self.framework else self.targets:
            self.refshare.patch_methods(owner, *names, deep=deep)
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


# -- replaying an RL step: each call timed, strategies interleaved, bytes stored ---------------


class Turn:
    """One strategy's run of one step: each call's seconds and refshare's counts."""

    def __init__(self) -> None:
        import refshare

        self.stats = refshare.stats
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, dict[str, int]] = {}
        self.stored = 0  # bytes the driver stored in the step (set by the benchmark)
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

    def record(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("seconds", "counts", "stored", "distinct")}


def _delta(before: Any, after: Any) -> dict[str, int]:
    return {f: getattr(after, f) - getattr(before, f) for f in after._fields}


def interleave(label: str, steps: int, turn: Callable[[str, int], Turn]) -> list[dict[str, Any]]:
    """Run ``steps`` steps, every strategy once per step (each leads in turn), with the 1-min
    load average sampled after each step; checks that every worker received the same."""
    out = []
    for step in range(steps):
        turns = {}
        for strategy in rotated(STRATEGIES, step):
            gc.collect()
            turns[strategy] = turn(strategy, step)
        same = all(t.received == turns["plain"].received for t in turns.values())
        load = round(os.getloadavg()[0], 2)
        out.append({"turns": {s: t.record() for s, t in turns.items()}, "same": same, "load": load})
        took = ", ".join(f"{s} {ms(t.seconds['step'])} ms" for s, t in turns.items())
        log(f"{label}: step {step}: {took}; load {load}" + ("" if same else "; CHECKSUMS DIFFER"))
    return out


def summarize(steps: list[dict[str, Any]], calls: Sequence[str]) -> dict[str, Any]:
    """Medians (ms), ratios to plain and bytes stored per step over the timed ``steps``."""
    names = (*calls, "step")
    times = {
        s: {c: [t["turns"][s]["seconds"][c] for t in steps] for c in names} for s in STRATEGIES
    }
    med = {s: {c: median(v) * 1e3 for c, v in by.items()} for s, by in times.items()}
    stored = {s: [t["turns"][s]["stored"] for t in steps] for s in STRATEGIES}
    paired = {  # each step's own ratio: its spread shows the noise
        s: {c: [a / b for a, b in zip(times[s][c], times["plain"][c], strict=True)] for c in names}
        for s in STRATEGIES
    }
    return {
        "times": times,
        "median_ms": med,
        "ratio_to_plain": {s: {c: med[s][c] / med["plain"][c] for c in names} for s in STRATEGIES},
        "ratio_interval": {
            s: {c: ratio_interval(times[s][c], times["plain"][c]) for c in names}
            for s in STRATEGIES
        },
        "paired_ratio_quartiles": {
            s: {c: statistics.quantiles(v, n=4) if len(v) > 1 else v * 3 for c, v in by.items()}
            for s, by in paired.items()
        },
        "stored_per_step": stored,
        "stored_median": {s: median(v) for s, v in stored.items()},
        "distinct_bytes": steps[-1]["turns"]["plain"]["distinct"],
        "counts_last_step": {s: steps[-1]["turns"][s]["counts"] for s in STRATEGIES},
        "load_during": [t["load"] for t in steps],
    }


def goals(summary: dict[str, Any], broadcast_hit: bool | None) -> list[tuple[str, bool]]:
    """The project's targets for an RL step, each with whether it held."""
    r, stored = summary["ratio_to_plain"], summary["stored_median"]
    calls = [c for c in r["plain"] if c != "step"]
    worst = {s: max(r[s][c] for c in calls) for s in ("refshare", "deep")}
    top, deep, distinct = stored["refshare"], stored["deep"], summary["distinct_bytes"]
    out = [
        (f"refshare: no call above 1.05{TIMES} plain ({worst_call(summary, 'refshare')})",
         worst["refshare"] <= 1.05),
        (f"refshare: whole step {TIMES_LE} 1.0{TIMES} plain ({r['refshare']['step']:.2f})",
         r["refshare"]["step"] <= 1.0),
    ]  # fmt: skip
    if broadcast_hit is not None:
        out.append(("refshare: the repeated broadcast hit the cache in every step", broadcast_hit))
    return [
        *out,
        (f"deep: stored per step {TIMES_LE} 1.15{TIMES} distinct ({deep / distinct:.2f})",
         deep <= 1.15 * distinct),
        (f"deep: at least 2{TIMES} fewer bytes than refshare ({top / max(deep, 1):.2f}{TIMES})",
         top >= 2 * deep),
        (f"deep: whole step {TIMES_LE} 0.6{TIMES} plain ({r['deep']['step']:.2f})",
         r["deep"]["step"] <= 0.6),
        (f"deep: whole step below refshare's ({r['deep']['step']:.2f} vs "
         f"{r['refshare']['step']:.2f} of plain)", r["deep"]["step"] < r["refshare"]["step"]),
        (f"deep: no call above 1.05{TIMES} plain ({worst_call(summary, 'deep')})",
         worst["deep"] <= 1.05),
    ]  # fmt: skip


def worst_call(summary: dict[str, Any], strategy: str) -> str:
    """The strategy's slowest call against plain, with its 95% interval, beside the worst
    of plain again (the untouched framework): how much of it noise alone can make."""
    r, interval = summary["ratio_to_plain"], summary["ratio_interval"]
    calls = [c for c in r["plain"] if c != "step"]
    worst = max(calls, key=lambda c: r[strategy][c])
    low, high = interval[strategy][worst]
    control = max(calls, key=lambda c: r["control"][c])
    return (
        f"worst {worst} {r[strategy][worst]:.3f}, 95% interval {low:.2f}{DASH}{high:.2f}; "
        f"plain again's worst {control} {r['control'][control]:.3f}"
    )


def step_report(
    summary: dict[str, Any], labels: dict[str, str], held: list[Any], goals_title: str = "Goals"
) -> list[str]:
    """The Markdown of one replay: times per call and step, bytes stored, goals."""
    med, r, q = summary["median_ms"], summary["ratio_to_plain"], summary["paired_ratio_quartiles"]
    shared = ("refshare", "deep", "control")
    header = [
        "call",
        *(f"{LABELS[s]} (ms)" for s in STRATEGIES),
        *(f"{LABELS[s]} ÷ plain" for s in shared),
    ]
    rows = [
        [
            labels.get(c, c),
            *(ms(med[s][c] / 1e3) for s in STRATEGIES),
            *(f"{r[s][c]:.2f} ({q[s][c][0]:.2f}{DASH}{q[s][c][2]:.2f})" for s in shared),
        ]
        for c in med["plain"]
    ]
    calls = [c for c in med["plain"] if c != "step"]
    noise = [r["control"][c] for c in calls]
    distinct, stored = summary["distinct_bytes"], summary["stored_median"]
    counts = summary["counts_last_step"]
    brows = []
    for s in STRATEGIES[:3]:  # the control stores what plain does
        c, every = counts[s]["step"], summary["stored_per_step"][s]
        spread = f" ({min(every) / MiB:.1f}{DASH}{max(every) / MiB:.1f})"
        brows.append([
            s, f"{stored[s] / MiB:.1f}" + ("" if max(every) - min(every) < MiB / 20 else spread),
            f"{stored[s] / distinct:.2f}", f"{stored[s] / stored['plain']:.2f}",
            "" if s == "plain" else f"{c['puts']} / {c['hits']} / {c['by_value']}",
        ])  # fmt: skip
    load = summary["load_during"]
    return [
        *table(header, rows),
        "",
        f"Medians over {len(load)} timed steps; ratios: of the medians, and in brackets the "
        "quartiles of each step's own ratio (the noise). *plain again* is the framework "
        "untouched, timed as a fourth strategy: against plain, its calls measured "
        f"{min(noise):.2f}{DASH}{max(noise):.2f}{TIMES}, the resolution of this run's medians; "
        "the goals give the worst call's 95% bootstrap interval, how far its ratio could move "
        "by noise alone. "
        f"1-min load average after each step {min(load)}{DASH}{max(load)} (median "
        f"{median(load)}; the run itself keeps the driver, 4 workers and Ray's daemons busy on "
        "2 cores).",
        "",
        *table(
            ["strategy", "MiB stored per step", "÷ distinct", "÷ plain", "puts / hits / by value"],
            brows,
        ),
        "",
        f"Distinct bytes the step sends (each distinct tensor's elements once): "
        f"{distinct / MiB:.1f} MiB. Stored: plain, what Ray stores by value plus the "
        "framework's own puts (each argument's `pickle.dumps(..., protocol=5)` size, once per "
        "`.remote()` or put); refshare and deep, the `refshare.stats().bytes_put` of the step. "
        "puts / hits / by value: refshare's counts in the last timed step.",
        "",
        f"{goals_title}:",
        "",
        *(f"- {text}: {'yes' if ok else 'NO'}" for text, ok in held),
        "",
    ]
