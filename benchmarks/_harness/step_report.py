"""What a step replay reports: times per call and step against plain, bytes stored, goals."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from _harness.report import DASH, TIMES, TIMES_LE, MiB, machine_lines, ms, table
from _harness.stats import median
from _harness.steps import AUTO, LABELS


def setup_lines(results: dict[str, Any], workers: str, strategies: Sequence[str]) -> list[str]:
    """The Markdown that says where a replay ran and how: the machine, Ray, the steps."""
    c = results["config"]
    return [
        *machine_lines(results["meta"]),
        "",
        f"Ray: one local session, `ray.init(num_cpus=2, object_store_memory="
        f"{c['store_bytes'] // MiB} MiB)`, {workers}, store warmed before timing. "
        f"{c['steps']} timed steps after {c['warmup']} untimed, the {NUMBERS[len(strategies)]} "
        "strategies interleaved (each leads in turn; plain runs twice, the second time as the "
        "control); each turn gets its own copy of the step's batch, new content every step.",
        "",
    ]


NUMBERS = {4: "four", 5: "five"}


def goals(summary: dict[str, Any], broadcast_hit: bool | None) -> list[tuple[str, bool]]:
    """The project's targets for an RL step, each with whether it held."""
    r, stored = summary["ratio_to_plain"], summary["stored_median"]
    calls = [c for c in r["plain"] if c != "step"]
    worst = {s: max(r[s][c] for c in calls) for s in ("refshare", "deep")}
    top, deep, distinct = stored["refshare"], stored["deep"], summary["distinct_bytes"]
    out = [
        (f"top-level: no call above 1.05{TIMES} plain ({worst_call(summary, 'refshare')})",
         worst["refshare"] <= 1.05),
        (f"top-level: whole step {TIMES_LE} 1.0{TIMES} plain ({r['refshare']['step']:.2f})",
         r["refshare"]["step"] <= 1.0),
    ]  # fmt: skip
    if broadcast_hit is not None:
        out.append(("top-level: the repeated broadcast hit the cache in every step", broadcast_hit))
    if AUTO in r:
        out += auto_goals(summary)
    return [
        *out,
        (f"deep: stored per step {TIMES_LE} 1.15{TIMES} distinct ({deep / distinct:.2f})",
         deep <= 1.15 * distinct),
        (f"deep: at least 2{TIMES} fewer bytes than top-level ({top / max(deep, 1):.2f}{TIMES})",
         top >= 2 * deep),
        (f"deep: whole step {TIMES_LE} 0.6{TIMES} plain ({r['deep']['step']:.2f})",
         r["deep"]["step"] <= 0.6),
        (f"deep: whole step below top-level's ({r['deep']['step']:.2f} vs "
         f"{r['refshare']['step']:.2f} of plain)", r["deep"]["step"] < r["refshare"]["step"]),
        (f"deep: no call above 1.05{TIMES} plain ({worst_call(summary, 'deep')})",
         worst["deep"] <= 1.05),
    ]  # fmt: skip


def auto_goals(summary: dict[str, Any]) -> list[tuple[str, bool]]:
    """The default's targets: the better mode's time within 5%, the distinct bytes within
    15%, and no call above plain's by more than the run's noise."""
    r, stored = summary["ratio_to_plain"], summary["stored_median"]
    best = min(r["refshare"]["step"], r["deep"]["step"])
    calls = [c for c in r["plain"] if c != "step"]
    worst = max(calls, key=lambda c: r[AUTO][c])
    low, _high = summary["ratio_interval"][AUTO][worst]
    distinct = summary["distinct_bytes"]
    return [
        (f"default: whole step {TIMES_LE} 1.05{TIMES} the better of top-level and deep "
         f"({r[AUTO]['step']:.2f} vs {best:.2f} of plain)", r[AUTO]["step"] <= 1.05 * best),
        (f"default: stored per step {TIMES_LE} 1.15{TIMES} distinct "
         f"({stored[AUTO] / distinct:.2f})", stored[AUTO] <= 1.15 * distinct),
        (f"default: no call above plain beyond the run's noise ({worst_call(summary, AUTO)})",
         low <= 1.05),
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
    strategies = list(med)
    shared = strategies[1:]
    header = [
        "call",
        *(f"{LABELS[s]} (ms)" for s in strategies),
        *(f"{LABELS[s]} ÷ plain" for s in shared),
    ]
    rows = [
        [
            labels.get(c, c),
            *(ms(med[s][c] / 1e3) for s in strategies),
            *(f"{r[s][c]:.2f} ({q[s][c][0]:.2f}{DASH}{q[s][c][2]:.2f})" for s in shared),
        ]
        for c in med["plain"]
    ]
    calls = [c for c in med["plain"] if c != "step"]
    noise = [r["control"][c] for c in calls]
    distinct, stored = summary["distinct_bytes"], summary["stored_median"]
    counts = summary["counts_last_step"]
    storing = [s for s in strategies if s != "control"]  # the control stores what plain does
    brows = []
    for s in storing:
        c, every = counts[s]["step"], summary["stored_per_step"][s]
        spread = f" ({min(every) / MiB:.1f}{DASH}{max(every) / MiB:.1f})"
        steady = max(every) - min(every) < MiB / 20
        brows.append([
            LABELS[s], f"{stored[s] / MiB:.1f}" + ("" if steady else spread),
            f"{stored[s] / distinct:.2f}", f"{stored[s] / stored['plain']:.2f}",
            "" if s == "plain" else f"{c['puts']} / {c['hits']} / {c['by_value']}",
        ])  # fmt: skip
    per_call = summary["stored_per_call_median"]
    crows = [[labels.get(c, c), *(f"{per_call[s][c] / MiB:.1f}" for s in storing)] for c in calls]
    load = summary["load_during"]
    return [
        *table(header, rows),
        "",
        f"Medians over {len(load)} timed steps; ratios: of the medians, and in brackets the "
        "quartiles of each step's own ratio (the noise). *plain again* is the framework "
        "untouched, timed as one more strategy: against plain, its calls measured "
        f"{min(noise):.2f}{DASH}{max(noise):.2f}{TIMES}, the resolution of this run's medians; "
        "the goals give the worst call's 95% bootstrap interval, how far its ratio could move "
        "by noise alone. "
        f"1-min load average after each step {min(load)}{DASH}{max(load)} (median "
        f"{median(load)}; the run itself keeps the driver, the workers and Ray's daemons busy "
        "on 2 cores).",
        "",
        *table(
            ["strategy", "MiB stored per step", "÷ distinct", "÷ plain", "puts / hits / by value"],
            brows,
        ),
        "",
        f"Distinct bytes the step sends (each distinct tensor's elements once): "
        f"{distinct / MiB:.1f} MiB. Stored: plain, what Ray stores by value plus the "
        "framework's own puts (each argument's `pickle.dumps(..., protocol=5)` size, once per "
        "`.remote()` or put); the others, the `refshare.stats().bytes_put` of the step. "
        "puts / hits / by value: refshare's counts in the last timed step.",
        "",
        "MiB stored per call (medians):",
        "",
        *table(["call", *(LABELS[s] for s in storing)], crows),
        "",
        f"{goals_title}:",
        "",
        *(f"- {text}: {'yes' if ok else 'NO'}" for text, ok in held),
        "",
    ]
