"""Members scaling: what a dict of N large arrays costs to send to 2 actors, by strategy.

Each measured call is ``ray.get([a.f.remote(batch) for a in actors])`` with ``batch`` a dict
of N numpy uint8 arrays of distinct random content, sent:

* **by value**: plain Ray;
* **top-level**: refshare with ``deep=False``: the dict keyed and stored whole;
* **deep**: refshare with ``deep=True``: split into members, each keyed, the new ones stored
  together in one bundle, a skeleton naming them sent with the task;
* **default**: refshare with ``deep=None``, which decides per argument;
* **ray.put**, the floor: a hand-written ``ray.put`` of the batch, its ref sent to both
  actors; on a first call put in the call, on a repeat put once before timing (what a
  perfect memoizer reaches: no keying, no put).

Members of 1 KiB (``min_bytes`` lowered to 1 KiB, so each counts as large) for N up to
20,000, and of 128 KiB (the default ``min_bytes``) for N up to 1,000. Two cases per N:
**first** (a new batch of fresh content every repetition, each strategy's cache emptied
before its call: every member new) and **repeat** (the same batch again, every member
unchanged). Each strategy has its own ``refshare.RefCache()``. One untimed round, then the
repetitions, strategies interleaved (each leads in turn); medians. Yardstick: one
``xxhash.xxh3_128`` pass over the members' bytes on the driver.

Targets: a first call within max(1.3 x by value, by value + 1.3 x xxh3 pass); a repeat
within by value (within 0.5 x by value for 128 KiB members). Every actor returns a digest of
what it received (keys, types, dtypes, shapes, read-only flags, bytes), compared with what
by value gave for the same batch: the script exits 1 if any differs. A fresh actor per
strategy reports its peak RSS (``ru_maxrss``) after receiving the largest first batch (full
run only).

    python benchmarks/members.py            # full run
    python benchmarks/members.py --quick    # N up to 1000, 3 repetitions, no memory
    python benchmarks/members.py --smoke    # seconds: for the test suite
"""

from __future__ import annotations

import gc
import resource
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray
import xxhash
from _harness import options, report, session
from _harness.report import TIMES, TIMES_LE, GiB, KiB, MiB, log, ms, size_label, table
from _harness.stats import median, rotated
from pressure import spilled_mib

import refshare

# -- configuration --------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """What one run measures."""

    mode: str
    small_ns: tuple[int, ...]  # member counts of 1 KiB members
    large_ns: tuple[int, ...]  # member counts of 128 KiB members
    reps: int
    store_bytes: int
    memory: bool  # measure each strategy's worker peak RSS (fresh actors)


SMALL = KiB
LARGE = 128 * KiB
ACTORS = 2
MODES: dict[str, Config] = {
    "full": Config("full", (10, 100, 1000, 5000, 20000), (10, 100, 1000), 7, GiB, True),
    "quick": Config("quick", (10, 100, 1000), (10, 100, 1000), 3, GiB, False),
    "smoke": Config("smoke", (10, 100), (10,), 2, 128 * MiB, False),
}  # fmt: skip

#: name -> label, in table order.
LABELS = {"by_value": "by value", "put": "ray.put", "top": "top-level", "deep": "deep",
          "default": "default"}  # fmt: skip
STRATEGIES = tuple(LABELS)
SHARED = ("top", "deep", "default")
DEEP = {"top": False, "deep": True, "default": None}
#: Target factors: a first call within max(FIRST x by value, by value + FIRST x xxh3).
FIRST = 1.3
#: A repeat within this fraction of by value, by member size.
REPEAT = {SMALL: 1.0, LARGE: 0.5}


def min_bytes_for(member: int) -> int | None:
    """1 KiB members need ``min_bytes`` lowered to count as large; 128 KiB ones do not."""
    return member if member < 100 * KiB else None


# -- batches and what a worker makes of them ------------------------------------------------


def batch(n: int, member: int, seed: int) -> dict[str, np.ndarray]:
    """``n`` uint8 arrays of ``member`` bytes each, of distinct random content."""
    data = np.random.default_rng(seed).integers(0, 256, n * member, dtype=np.uint8)
    return {f"m{i:05d}": data[i * member : (i + 1) * member].copy() for i in range(n)}


def digest(value: Any) -> str:
    """What a worker received: keys, types, dtypes, shapes, read-only flags and bytes."""
    h = xxhash.xxh3_128()
    h.update(type(value).__qualname__.encode())
    for key in sorted(value):
        array = value[key]
        about = (key, type(array).__qualname__, array.dtype.str, array.shape,
                 array.strides, array.flags.writeable)  # fmt: skip
        h.update(repr(about).encode())
        h.update(np.ascontiguousarray(array).data)
    return h.hexdigest()


def xxh3_pass(value: dict[str, np.ndarray]) -> None:
    for array in value.values():
        xxhash.xxh3_128(array.data).digest()


@ray.remote(num_cpus=0.1)
class Worker:
    def f(self, x: Any) -> str:
        return digest(x)

    def touch(self, x: np.ndarray) -> int:
        return session.touch(x)

    def maxrss(self) -> int:
        """Peak resident memory of this worker process so far, in bytes (Linux: KiB)."""
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def fan_out(actors: Sequence[Any], x: Any) -> list[str]:
    return ray.get([a.f.remote(x) for a in actors])


def put_fan_out(actors: Sequence[Any], x: Any) -> list[str]:
    return fan_out(actors, ray.put(x))


def fan_outs(min_bytes: int | None, caches: dict[str, refshare.RefCache]) -> dict[str, Callable]:
    """Each strategy's fan-out, each refshare one on its own cache (``min_bytes=None``: the
    default, 100 KiB)."""
    found: dict[str, Callable] = {"by_value": fan_out, "put": put_fan_out}
    for name in SHARED:
        found[name] = refshare.shared_args(cache=caches[name], deep=DEEP[name],
                                           min_bytes=min_bytes)(fan_out)  # fmt: skip
    return found


# -- measuring ------------------------------------------------------------------------------


class Mismatch(RuntimeError):
    pass


def check(label: str, got: dict[str, list[str]]) -> None:
    """Every worker under every strategy received what by value gave them."""
    expected = got["by_value"]
    if len(set(expected)) != 1:
        raise Mismatch(f"{label}: by value's workers received different data: {expected}")
    for name, digests in got.items():
        if digests != expected:
            raise Mismatch(f"{label}: {name} workers received {digests}, by value {expected}")


def time_case(
    actors: Sequence[Any], n: int, member: int, case: str, reps: int, seed: int
) -> dict[str, Any]:
    """Time every strategy ``reps`` times on ``case`` ("first" or "repeat"), interleaved."""
    label = f"{n} {TIMES} {size_label(member)}, {case}"
    min_bytes = min_bytes_for(member)
    caches = {name: refshare.RefCache() for name in SHARED}
    calls = fan_outs(min_bytes, caches)
    times: dict[str, list[float]] = {name: [] for name in STRATEGIES}
    counts = {name: {"puts": 0, "hits": 0} for name in SHARED}
    same = batch(n, member, seed)
    if case == "repeat":  # the floor: the ref of a batch put before timing
        held = ray.put(same)
        calls["put"] = lambda actors, _value: fan_out(actors, held)
    for rep in range(-1, reps):  # rep -1: the untimed round
        value = same if case == "repeat" else batch(n, member, seed + 1 + rep)
        got: dict[str, list[str]] = {}
        gc.collect()
        gc.disable()  # a collection (about 0.1 s here) must not land inside a timed call
        for name in rotated(STRATEGIES, max(rep, 0)):
            if case == "first" and name in caches:
                caches[name].clear()
            before = refshare.stats()
            start = time.perf_counter()
            got[name] = calls[name](actors, value)
            elapsed = time.perf_counter() - start
            after = refshare.stats()
            if rep >= 0:
                times[name].append(elapsed)
                if name in counts:
                    counts[name]["puts"] += after.puts - before.puts
                    counts[name]["hits"] += after.hits - before.hits
        gc.enable()
        check(label, got)
        del value, got
    yard = []
    for _ in range(max(3 * reps, 5)):
        start = time.perf_counter()
        xxh3_pass(same)
        yard.append(time.perf_counter() - start)
    for cache in caches.values():
        cache.clear()
    log(f"{label}: " + ", ".join(f"{LABELS[s]} {ms(median(t))} ms" for s, t in times.items()))
    return {"n": n, "member": member, "case": case, "times": times, "xxh3": yard,
            "refshare_counts": counts}  # fmt: skip


def measure_memory(sizes: Sequence[tuple[int, int]], seed: int) -> list[dict[str, Any]]:
    """Peak RSS of a fresh actor per strategy and batch size ``(n, member)``, before and after
    it receives one new batch. The actors all start at once (their start-ups overlap)."""
    fresh = [{name: Worker.remote() for name in STRATEGIES} for _ in sizes]  # type: ignore[attr-defined]
    warm = batch(4, SMALL, seed)  # imports numpy and runs digest once in every actor
    ray.get([a.f.remote(warm) for group in fresh for a in group.values()])
    found = []
    for (n, member), group in zip(sizes, fresh, strict=True):
        log(f"worker peak memory: {n} {TIMES} {size_label(member)}")
        value = batch(n, member, seed + n)
        caches = {name: refshare.RefCache() for name in SHARED}
        calls = fan_outs(min_bytes_for(member), caches)
        got, peak = {}, {}
        for name in STRATEGIES:
            base = ray.get(group[name].maxrss.remote())
            got[name] = calls[name]([group[name]], value)
            peak[name] = {"before": base, "after": ray.get(group[name].maxrss.remote())}
        check(f"memory, {n} {TIMES} {size_label(member)}", got)
        for cache in caches.values():
            cache.clear()
        for actor in group.values():
            ray.kill(actor)
        found.append({"n": n, "member": member, "batch_bytes": n * member, "maxrss": peak})
    return found


# -- the run --------------------------------------------------------------------------------


def run(config: Config) -> dict[str, Any]:
    ray_init = {"num_cpus": 2, "object_store_memory": config.store_bytes, "actor_num_cpus": 0.1}
    meta = report.machine("members.py", ray_init=ray_init)
    started = time.perf_counter()
    session.start_ray(config.store_bytes)
    cases: list[dict[str, Any]] = []
    memory: list[dict[str, Any]] = []
    try:
        actors = [Worker.remote() for _ in range(ACTORS)]  # type: ignore[attr-defined]
        ray.get([a.f.remote(batch(2, SMALL, 0)) for a in actors])
        log(f"store warmed in {session.warm_store(actors, config.store_bytes):.1f} s")
        session.StoreMonitor().wait_until_idle()
        spilled_warming = spilled_mib()  # warming fills 90% of the store: Ray spills from 80%
        seed = 1000
        for member, ns in ((SMALL, config.small_ns), (LARGE, config.large_ns)):
            for n in ns:
                for case in ("first", "repeat"):
                    cases.append(time_case(actors, n, member, case, config.reps, seed))
                    seed += config.reps + 2
        if config.memory:
            sizes = [(max(config.small_ns), SMALL), (max(config.large_ns), LARGE)]
            memory = measure_memory(sizes, seed)
        spilled = spilled_mib() - spilled_warming
    finally:
        ray.shutdown()
    report.finished(meta, started)
    return {"meta": meta, "config": asdict(config), "cases": cases, "memory": memory,
            "spilled_mib": spilled, "skipped": []}  # fmt: skip


# -- the report -----------------------------------------------------------------------------


def target(case: dict[str, Any]) -> float:
    """The bound, in seconds, each refshare strategy's median must be within."""
    by_value = median(case["times"]["by_value"])
    if case["case"] == "first":
        return max(FIRST * by_value, by_value + FIRST * median(case["xxh3"]))
    return REPEAT[case["member"]] * by_value


def verdicts(case: dict[str, Any]) -> dict[str, bool]:
    bound = target(case)
    return {name: median(case["times"][name]) <= bound for name in SHARED}


def target_label(case: dict[str, Any]) -> str:
    if case["case"] == "first":
        return f"{ms(target(case))} (max({FIRST:g}{TIMES}bv, bv+{FIRST:g}{TIMES}xxh3))"
    factor = REPEAT[case["member"]]
    return f"{ms(target(case))} ({TIMES_LE}{'' if factor == 1 else f' {factor:g}{TIMES}'}bv)"


def markdown(results: dict[str, Any]) -> str:
    lines = ["# refshare members-scaling benchmark", "", *report.machine_lines(results["meta"]), ""]
    lines += [
        f"A dict of N uint8 arrays to {ACTORS} actors; medians of {results['config']['reps']} "
        "interleaved repetitions, in ms; ratios to by value in parentheses. Target for a first "
        f"call: max({FIRST:g}{TIMES} by value, by value + {FIRST:g}{TIMES} xxh3 pass); for a "
        f"repeat: {TIMES_LE} by value (0.5{TIMES} for 128 KiB members). ray.put is the "
        "floor: a hand-written put in the call (first), or a ref put before timing (repeat).",
        "",
        "## Times",
        "",
    ]
    header = ["members", "case", *LABELS.values(), "xxh3 pass", "target", "result"]
    rows = []
    for case in results["cases"]:
        by_value = median(case["times"]["by_value"])
        cells = [ms(by_value)]
        for name in ("put", *SHARED):
            t = median(case["times"][name])
            cells.append(f"{ms(t)} ({t / by_value:.2f})")
        ok = verdicts(case)
        failed = [LABELS[n] for n, good in ok.items() if not good]
        result = "PASS" if not failed else "FAIL: " + ", ".join(failed)
        rows.append([f"{case['n']} {TIMES} {size_label(case['member'])}", case["case"], *cells,
                     ms(median(case["xxh3"])), target_label(case), result])  # fmt: skip
    lines += table(header, rows)
    lines += ["", f"Ray spilled {results['spilled_mib']} MiB to disk while measuring (after "
              "warming the store)."]  # fmt: skip
    if results["memory"]:
        lines += ["", "## Worker peak memory", "",
                  "A fresh actor per strategy receives one new batch; its peak RSS "
                  "(`ru_maxrss`) before and after, in MiB (pages of the object store it maps "
                  "count as they are read).", ""]  # fmt: skip
        header = ["members", "batch", *(f"{label}: peak (+growth)" for label in LABELS.values())]
        rows = []
        for entry in results["memory"]:
            cells = []
            for name in STRATEGIES:
                peak = entry["maxrss"][name]
                grew = (peak["after"] - peak["before"]) / MiB
                cells.append(f"{peak['after'] / MiB:.0f} (+{grew:.1f})")
            rows.append([f"{entry['n']} {TIMES} {size_label(entry['member'])}",
                         f"{entry['batch_bytes'] / MiB:.1f} MiB", *cells])  # fmt: skip
        lines += table(header, rows)
    else:
        lines += ["", "Worker peak memory: measured in the full run only."]
    for note in results["skipped"]:
        lines += ["", f"Skipped: {note}"]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    """ms against N, log-log, one line per strategy (solid: 1 KiB members, dashed: 128 KiB);
    first calls and repeats in two panels."""
    plt = report.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    palette = ("black", "tab:gray", "tab:blue", "tab:orange", "tab:green")
    colors = dict(zip(STRATEGIES, palette, strict=True))
    for ax, which in zip(axes, ("first", "repeat"), strict=True):
        for member, style in ((SMALL, "-"), (LARGE, "--")):
            cases = [c for c in results["cases"] if c["case"] == which and c["member"] == member]
            if not cases:
                continue
            ns = [c["n"] for c in cases]
            for name, label in LABELS.items():
                ax.plot(ns, [median(c["times"][name]) * 1e3 for c in cases], style, marker="o",
                        markersize=3, color=colors[name],
                        label=f"{label}, {size_label(member)}")  # fmt: skip
            ax.plot(ns, [median(c["xxh3"]) * 1e3 for c in cases], style, color="gray",
                    linewidth=0.8, label=f"xxh3 pass, {size_label(member)}")  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{which} call" if which == "first" else "repeat")
        ax.set_xlabel("members N")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel(f"ms per fan-out to {ACTORS} actors (median)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize="small")
    fig.suptitle(f"refshare members scaling ({results['config']['mode']} mode)")
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    modes = {"quick": "N up to 1000, 3 repetitions", "smoke": "seconds: tiny sizes"}
    args = options.parser(__doc__ or "", modes).parse_args(argv)
    try:
        results = run(MODES[options.mode(args)])
    except Mismatch as error:
        log(f"WORKERS RECEIVED OTHER DATA: {error}")
        return 1
    why = report.cannot_plot("members.png")
    written = report.write_report(args.out, "members", results, markdown, plot)
    if why:
        log(f"no plot: {why}")
    log(f"wrote {', '.join(str(args.out / name) for name in written)}")
    print((args.out / "members.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
