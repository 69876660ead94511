"""A long step replay: hundreds of steps of one flow by value, then with refshare's defaults,
and what the object store holds all along, read from Ray's side.

A short replay shows what a step costs; a long one shows what a job keeps. Each strategy
runs its steps one after another (not interleaved: what one strategy keeps in the store
would be counted in the other's samples), by value first, then refshare with its default
options and a cache of the default budget (a quarter of the store), new from the first step.
A thread reads the local object store every :data:`SAMPLE_EVERY` seconds
(``refshare._ray.session.plasma_usage``: the store's own ``bytes in use`` and ``objects in
use``, what it cannot evict); each step keeps the largest reading taken during it and the
one at its end, with its time and refshare's puts and hits. Step times are compared within
refshare's run: every :data:`CONTROL_EVERY` steps, a step by value is timed beside it (its
readings left out), so that a machine whose load changed between the two runs does not
show as a difference.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from _harness import report, session
from _harness.report import DASH, TIMES, TIMES_LE, MiB, log, ms, table
from _harness.stats import median
from _harness.steps import AUTO, LABELS, Sharing, Turn

#: Seconds between two readings of the store.
SAMPLE_EVERY = 0.02
#: The strategies of a long replay, in the order they run.
STRATEGIES = ("plain", AUTO)
#: Percentiles the report gives of each step's largest reading.
PERCENTILES = (50, 90, 99, 100)
#: refshare's peak may pass by value's by this much (issue 41).
PEAK_BOUND = 1.2
#: Every this many steps of refshare's run, a step by value is timed beside it.
CONTROL_EVERY = 4
#: What each step keeps: its seconds, the store at its peak and at its end, refshare's counts.
KEPT = ("seconds", "peak_bytes", "peak_objects", "end_bytes", "end_objects", "puts", "hits")


class StoreSampler:
    """Reads the local object store on a thread of its own, noting the step it is in."""

    def __init__(self) -> None:
        from refshare._ray.session import plasma_usage

        self.read = plasma_usage
        self.step = -1
        self.samples: list[tuple[float, int, int, int]] = []  # (seconds, step, bytes, objects)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="store-sampler", daemon=True)
        self._start = time.perf_counter()

    def reading(self) -> tuple[int, int]:
        usage = self.read()
        return usage.get("bytes in use", 0), usage.get("objects in use", 0)

    def _run(self) -> None:
        while not self._done.wait(SAMPLE_EVERY):
            nbytes, objects = self.reading()
            self.samples.append((time.perf_counter() - self._start, self.step, nbytes, objects))

    def __enter__(self) -> StoreSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._done.set()
        self._thread.join()

    def during(self, step: int) -> tuple[int, int]:
        """The largest bytes and objects read while ``step`` ran."""
        found = [(b, o) for _, s, b, o in self.samples if s == step]
        return max((b for b, _ in found), default=0), max((o for _, o in found), default=0)


def phase(
    strategy: str, steps: int, turn: Callable[[str, int], Turn], sharing: Sharing
) -> dict[str, Any]:
    """``steps`` steps of ``strategy``, one after another, the store read all along."""
    if strategy == AUTO:  # the default budget, not the short replay's share of it
        sharing.caches[AUTO] = sharing.refshare.RefCache()
    out: dict[str, list[Any]] = {k: [] for k in (*KEPT, "control_seconds")}
    with StoreSampler() as sampler:
        for step in range(steps):
            if strategy == AUTO and step % CONTROL_EVERY == 0:  # its readings left out
                out["control_seconds"].append(turn("plain", step).seconds["step"])
            sampler.step = step
            done = turn(strategy, step)
            counts = done.counts["step"]
            sampler.step = -1
            end = sampler.reading()
            peak = sampler.during(step)
            for key, value in zip(KEPT, (done.seconds["step"], max(peak[0], end[0]),
                                        max(peak[1], end[1]), *end, counts["puts"],
                                        counts["hits"]), strict=True):  # fmt: skip
                out[key].append(value)
            if step % 25 == 0 or step == steps - 1:
                log(f"long {LABELS[strategy]}: step {step}: {ms(done.seconds['step'])} ms, "
                    f"store {end[0] / MiB:.0f} MiB in {end[1]} objects (peak "
                    f"{peak[0] / MiB:.0f} MiB), {counts['puts']} puts, "
                    f"{counts['hits']} hits")  # fmt: skip
    cache = sharing.caches.get(AUTO) if strategy == AUTO else None
    return {
        **out,
        "samples": len(sampler.samples),
        "cache_bytes_at_end": cache.nbytes if cache is not None else 0,
        "cache_entries_at_end": len(cache) if cache is not None else 0,
        "evictions": sharing.refshare.stats().evictions if strategy == AUTO else 0,
    }


def long_replay(
    label: str,
    workers: Sequence[Any],
    config: Any,
    turn: Callable[[str, int], Turn],
    sharing: Sharing,
    steps: int,
) -> dict[str, Any]:
    """Warm the store, then ``steps`` steps by value and ``steps`` with refshare's defaults."""
    log(f"{label}: warming the store")
    session.warm_store(workers, config.store_bytes)
    monitor = session.StoreMonitor()
    phases = {}
    for strategy in STRATEGIES:
        monitor.wait_until_idle()
        evictions = sharing.refshare.stats().evictions
        phases[strategy] = phase(strategy, steps, turn, sharing)
        phases[strategy]["evictions"] -= evictions if strategy == AUTO else 0
    sharing.caches.clear()
    return {"steps": steps, "phases": phases, "summary": summarize(phases)}


def percentile(values: Sequence[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def summarize(phases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Percentiles of what each step held at its peak, step times, and the goals' figures."""
    plain, auto = phases["plain"], phases[AUTO]
    quarter = max(1, len(auto["hits"]) // 4)

    def steady(values: Sequence[float]) -> float:  # the last quarter against the first
        first = median(values[1 : quarter + 1] or values[:1])
        return median(values[-quarter:]) / first if first else 1.0

    def spread(key: str) -> dict[str, dict[int, float]]:
        return {s: {p: percentile(r[key], p) for p in PERCENTILES} for s, r in phases.items()}

    return {
        "peak_bytes": spread("peak_bytes"),
        "peak_objects": spread("peak_objects"),
        "end_bytes_median": {s: median(r["end_bytes"]) for s, r in phases.items()},
        "step_ms": {s: median(r["seconds"]) * 1e3 for s, r in phases.items()},
        "peak_ratio": max(auto["peak_bytes"]) / max(max(plain["peak_bytes"]), 1),
        "peak_ratio_p99": percentile(auto["peak_bytes"], 99) / max(max(plain["peak_bytes"]), 1),
        "peak_step": auto["peak_bytes"].index(max(auto["peak_bytes"])),
        "time_ratio": median(auto["seconds"]) / median(plain["seconds"]),
        "time_ratio_beside": median(auto["seconds"]) / median(auto["control_seconds"]),
        "hits_steady": steady(auto["hits"]),
        "time_steady": {s: steady(r["seconds"]) for s, r in phases.items()},
    }


def goals(summary: dict[str, Any]) -> list[tuple[str, bool]]:
    peak, hits = summary["peak_ratio"], summary["hits_steady"]
    steady = summary["time_steady"][AUTO]
    p99 = summary["peak_ratio_p99"]
    return [
        (f"the store holds at most {PEAK_BOUND}{TIMES} what by value holds at its peak, at "
         f"every step ({peak:.2f}{TIMES}, at step {summary['peak_step']})", peak <= PEAK_BOUND),
        (f"the same, in 99 steps of 100 ({p99:.2f}{TIMES})", p99 <= PEAK_BOUND),
        (f"the same hits at the end as at the start: last quarter's median ÷ first quarter's "
         f"({hits:.2f})", hits >= 0.99),
        (f"step time steady: last quarter's median ÷ first quarter's {TIMES_LE} 1.1 "
         f"({steady:.2f})", steady <= 1.1),
    ]  # fmt: skip


def markdown(result: dict[str, Any], setup: list[str]) -> list[str]:
    """The long replay's part of a report: percentiles, step times, goals."""
    s, phases = result["summary"], result["phases"]
    rows = []
    for name, r in phases.items():
        by = s["peak_bytes"][name]
        objects = s["peak_objects"][name]
        rows.append([
            LABELS[name], *(f"{by[p] / MiB:.0f}" for p in PERCENTILES),
            f"{s['end_bytes_median'][name] / MiB:.0f}",
            f"{objects[50]:.0f} / {objects[100]:.0f}",
            ms(s["step_ms"][name] / 1e3),
            f"{median(r['puts']):.0f} ({min(r['puts'])}{DASH}{max(r['puts'])})",
            f"{median(r['hits']):.0f} ({min(r['hits'])}{DASH}{max(r['hits'])})",
        ])  # fmt: skip
    header = ["strategy", *(f"p{p} MiB" if p < 100 else "max MiB" for p in PERCENTILES),
              "at step end (median) MiB", "objects (median / max)", "step ms (median)",
              "puts a step", "hits a step"]  # fmt: skip
    auto = phases[AUTO]
    return [
        *setup,
        f"{result['steps']} steps of each strategy, one after another (by value first); the "
        f"object store read every {SAMPLE_EVERY * 1e3:.0f} ms from Ray's side (the store's "
        "own `bytes in use` and `objects in use`, `refshare._ray.session.plasma_usage`). "
        "Per step, the largest reading during it (its peak); the percentiles are over the "
        "steps.",
        "",
        *table(header, rows),
        "",
        f"refshare's cache at the end: {auto['cache_entries_at_end']} entries, "
        f"{auto['cache_bytes_at_end'] / MiB:.0f} MiB; {auto['evictions']} evictions over the "
        f"run. Step time, refshare ÷ by value: {s['time_ratio_beside']:.2f}{TIMES} against the "
        f"{len(auto['control_seconds'])} steps by value timed beside refshare's (one every "
        f"{CONTROL_EVERY}), {s['time_ratio']:.2f}{TIMES} against by value's own run (medians).",
        "",
        "Goals:",
        "",
        *(f"- {text}: {'yes' if ok else 'NO'}" for text, ok in goals(s)),
        "",
    ]


def plot(result: dict[str, Any], path: Path) -> None:
    """What the store held over the steps, by value and refshare, bytes and objects."""
    plt = report.pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    for (name, r), color in zip(result["phases"].items(), ("C0", "C1"), strict=True):
        steps = range(len(r["peak_bytes"]))
        top.plot(steps, [b / MiB for b in r["peak_bytes"]], color=color, linewidth=0.9,
                 label=f"{LABELS[name]}: peak")  # fmt: skip
        top.plot(steps, [b / MiB for b in r["end_bytes"]], ":", color=color, linewidth=0.9,
                 label=f"{LABELS[name]}: at the step's end")  # fmt: skip
        bottom.plot(steps, r["peak_objects"], color=color, label=LABELS[name], linewidth=0.9)
    bound = PEAK_BOUND * max(result["phases"]["plain"]["peak_bytes"]) / MiB
    top.axhline(bound, color="gray", linestyle="--", linewidth=0.8,
                label=f"{PEAK_BOUND}{TIMES} by value's peak")  # fmt: skip
    top.set_ylabel("object store in use (MiB)")
    bottom.set_ylabel("objects in use (peak)")
    bottom.set_xlabel("step")
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"What the object store holds over {result['steps']} steps, read from Ray")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
