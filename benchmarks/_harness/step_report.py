"""What a step replay reports: times per call and step against plain, bytes stored, goals."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from _harness.report import DASH, TIMES, TIMES_LE, MiB, machine_lines, ms, table
from _harness.stats import median
from _harness.steps import AUDIT, AUTO, IDEAL, LABELS


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
        "control; the audit and the control run right after plain, plain right after the "
        "ideal, so that none of them meets a store a sharing strategy's cache has just "
        "filled; the ideal's turn follows an untimed record of the step, see below); each "
        "turn gets its own copy of the step's batch, new content every step.",
        "",
    ]


NUMBERS = {4: "four", 5: "five", 6: "six", 7: "seven"}


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
        if s in (AUDIT, IDEAL):  # the audit's would-be counts, the ideal's own
            c = summary["reported_last_step"][s]
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
        "`.remote()` or put), and so the audit's; the ideal, Ray's serialized size of each "
        "distinct argument it put; the others, the `refshare.stats().bytes_put` "
        "of the step. puts / hits / by value: refshare's counts in the last timed step (the "
        "audit's, from its report, what sharing would have done; the ideal's, its distinct "
        "arguments and the repeats it swapped in).",
        "",
        "MiB stored per call (medians):",
        "",
        *table(["call", *(LABELS[s] for s in storing)], crows),
        "",
        *(ideal_and_audit(summary, labels) if "audit_cost" in summary else []),
        f"{goals_title}:",
        "",
        *(f"- {text}: {'yes' if ok else 'NO'}" for text, ok in held),
        "",
    ]


def time_rows(summary: dict[str, Any]) -> list[list[str]]:
    """The audit's time estimate against what the default saved, where it was measured."""
    if "would_save_ms" not in summary:
        return []
    ratio, would, saved = (summary[k] for k in ("would_to_saved_ms", "would_save_ms",
                                                 "default_saved_ms"))  # fmt: skip
    low, _, high = summary.get("default_saved_quartiles_ms", (saved, saved, saved))
    return [
        ["would save (time): the audit's estimate ÷ the time the default saved per step "
         "(the mean of plain's and plain again's step less the default's)",
         f"{ratio:.2f}{TIMES} ({would:.1f} vs {saved:.1f} ms, each step's saving "
         f"{low:.1f}{DASH}{high:.1f} ms between its quartiles; Ray's calls that sent large "
         f"arguments took {summary['sending_ms']:.1f} ms of the audit's step; plain again "
         f"saved {summary['control_saved_ms']:.1f} ms, the noise)",
         "within 25%", estimate_verdict(summary)],
    ]  # fmt: skip


def estimate_verdict(summary: dict[str, Any]) -> str:
    """``yes`` where the audit's estimate is within 25% of the median saving; ``NO`` where it
    is not within 25% of any saving in the median's 95% interval either; else the run could
    not tell, and says why (a saving near nothing, or steps too spread)."""
    would, saved = summary["would_save_ms"], summary["default_saved_ms"]
    if saved and abs(would / saved - 1) <= 0.25:
        return "yes"
    interval = summary.get("default_saved_interval_ms")
    if interval is None:
        return "NO"
    low, high = interval
    near = sorted((would / 1.25, would / 0.75))  # the savings the estimate is within 25% of
    if near[1] < low or near[0] > high:
        return "NO"
    return (
        f"cannot tell: the median saving's 95% interval, {low:.1f}{DASH}{high:.1f} ms, "
        f"holds savings the estimate is within 25% of"
    )


def ideal_and_audit(summary: dict[str, Any], labels: dict[str, str]) -> list[str]:
    """The default against the ideal, per call and step; the audit's cost and count against
    the issue's targets."""
    med, ratio = summary["median_ms"], summary["default_to_ideal"]
    q = summary["default_to_ideal_quartiles"]
    rows = [
        [labels.get(c, c), ms(med[IDEAL][c] / 1e3), ms(med[AUTO][c] / 1e3),
         f"{ratio[c]:.2f} ({q[c][0]:.2f}{DASH}{q[c][2]:.2f})"]
        for c in med["plain"]
    ]  # fmt: skip
    cost, agree = summary["audit_cost"], summary["would_to_saved"]
    cpu = summary["audit_cpu_cost"]
    low, high = summary["would_to_saved_range"]
    audit = [
        ["driver time over plain per step ÷ Ray's serialization of the step's large "
         "arguments", f"{cost:.2f}{TIMES} ({summary['audit_over_plain_ms']:.1f} ms over plain, "
         f"{summary['serialize_ms']:.1f} ms serializing; plain again over plain "
         f"{summary['control_over_plain_ms']:.1f} ms)", f"{TIMES_LE} 0.3{TIMES}",
         "yes" if cost <= 0.3 else "NO"],
        ["driver CPU time over plain per step ÷ the same serialization",
         f"{cpu:.2f}{TIMES} ({summary['audit_cpu_over_plain_ms']:.1f} ms over plain; plain "
         f"again over plain {summary['control_cpu_over_plain_ms']:.1f} ms)",
         f"{TIMES_LE} 0.3{TIMES}", "yes" if cpu <= 0.3 else "NO"],
        ["of which refshare's keying: its threads' CPU time in it per step ÷ the same "
         "serialization", f"{summary.get('audit_keying_cost', 0.0):.2f}{TIMES} "
         f"({summary.get('audit_keying_ms', 0.0):.1f} ms)", "(where the cost goes)", ""],
        ["would save ÷ the default's saved bytes per step",
         f"{agree:.3f}{TIMES} ({summary['would_save'] / MiB:.1f} vs "
         f"{summary['default_saved'] / MiB:.1f} MiB; each step {low:.3f}{DASH}{high:.3f})",
         "within 5%", "yes" if abs(agree - 1) <= 0.05 else "NO"],
        *time_rows(summary),
    ]  # fmt: skip
    return [
        "Against the ideal (medians, ms; in brackets the quartiles of each step's own ratio):",
        "",
        *table(["call", "ideal", "default", "default ÷ ideal"], rows),
        "",
        f"Of the ideal's step, its puts: {summary['ideal_puts_ms']:.1f} ms (median); the "
        f"default against the ideal less its puts (puts made before the step): "
        f"{summary['default_to_ideal_unput']:.2f}{TIMES}.",
        "",
        "The ideal is a floor, not a strategy: an untimed record of the step right before its "
        "turn (an equal copy of its batch, the framework as plain runs it) numbers every "
        "argument Ray would store (over 100 KiB) and every value the framework puts by its "
        "content (equal as `refshare.fingerprint` keys it); in its turn each content is put "
        "once, the first time the step sends it, and its ref handed to Ray wherever the step "
        "sends it (one dict lookup per `.remote()` or `ray.put`): one put of each distinct "
        "content, what any memoizer pays, and no keying, splitting or bookkeeping. Its "
        "workers' checksums are compared with plain's as every strategy's are. The ideal "
        "stores each argument whole, as Ray pickles it (a tensor through torch's pickling), so "
        "its workers unpickle what plain's do, where refshare's stored forms (a tensor's "
        "bytes, members split out) can make a call cheaper for the workers than the ideal's.",
        "",
        "The audit (`audit=True`, refshare's default mode otherwise), against the targets:",
        "",
        *table(["audit", "measured", "target", "met"], audit),
        "",
        "Over plain: the median of each step's difference. Driver time: the step's wall "
        "clock, the workers' waits included; driver CPU time: what the driver process spent "
        "in all its threads (`time.process_time()`), which the workers' and Ray's daemons' "
        "share of the cores does not blur; refshare's keying: the CPU time of the threads "
        "in its two entry points (`Scope.rewrite`, `Scope.ray_put`) and its hashing pool, "
        "each by `time.thread_time()`, the rest of the CPU time over plain being what Ray's "
        "own puts cost more or less in that turn. Serializing: the median per step "
        "of `SerializationContext.serialize` timed over each argument Ray stores and each "
        "value put, once per `.remote()` or put, as plain sends them (in the ideal's record, "
        "on the same content: plain's own turn stays untouched); it leaves out Ray's copy "
        "into the object store. Bytes: the report's repeated bytes of the audit's turn and "
        "of the default's, each turn's report its own (`refshare.reset_report()` before it). "
        "Time: the audit's report, `would_save_ms` (its calls' time in Ray's own `.remote()` "
        "and `ray.put`, shared among their large arguments by bytes: the repeated ones' share, "
        "and that of the tensors sharing would store as their bytes less one copy of them, "
        "less the audit's keying), against the median of each step's by-value step time (the "
        "mean of plain's and plain again's) less the default's." + budget_line(summary),
        "",
    ]


def budget_line(summary: dict[str, Any]) -> str:
    budget = summary.get("cache_budget")
    if budget is None:
        return ""
    return (
        f" Caches: each strategy's holds {budget / MiB:.1f} MiB, a quarter of the distinct "
        "bytes of a step (`--budget quarter`)."
    )
