"""What the cluster benchmark reports: its claims checked (goals), cluster.md and cluster.png.

Everything is read from the results, so a report can be made again from ``cluster.json``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from _harness import report
from _harness.report import DASH, TIMES, MiB, size_label, spread, table

#: How the tables name the strategies (cluster.py's), in table order.
STRATEGIES: dict[str, str] = {
    "by_value": "by value",
    "per_call_put": "per-call put",
    "refshare_first": "refshare first sight",
    "refshare_repeat": "refshare repeat",
    "deep": "deep, first sight",
}


def write(results: dict[str, Any], out: Path) -> list[str]:
    """Add the goals to ``results`` and write cluster.json, cluster.md and cluster.png to ``out``;
    return the names written."""
    results["goals"] = goals(results)
    return report.write_report(out, "cluster", results, markdown, plot)


def _strategies(results: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The broadcast's strategies and the batch's, in the order they ran."""
    return list(results["broadcast"]["strategies"]), list(results["batch"]["strategies"])


# -- the goals ----------------------------------------------------------------------------------


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
    broadcast_strategies, batch_strategies = _strategies(results)
    holders, remote = topo["worker_nodes"], topo["remote_workers"]
    moved = {s: [r["moved"] for r in _records(st[s])] for s in broadcast_strategies}

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
            for r in _call_records(step[s], batch["calls"][-1]["name"])
        ),
    ]
    deep_step = [
        sum(run[c]["moved"] for c in run) for run in [*step["deep"]["timed"], step["deep"]["held"]]
    ]
    distinct = batch["distinct_bytes"]
    located = [
        (r["located"], r["moved"])
        for s in broadcast_strategies
        for r in _records(st[s])
        if r["located"] is not None
    ] + [
        (r["located"], r["moved"])
        for s in batch_strategies
        for c in step[s]["held"]
        for r in _call_records(step[s], c)
        if r["located"] is not None
    ]
    received = [r["received_ok"] for s in broadcast_strategies for r in _records(st[s])] + [
        r["received_ok"]
        for s in batch_strategies
        for c in step[s]["held"]
        for r in _call_records(step[s], c)
    ]
    repeatable = all(_same(v) is not None for v in moved.values()) and all(
        _same([r["moved"] for r in _call_records(step[s], c)]) is not None
        for s in batch_strategies
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


def markdown(results: dict[str, Any]) -> str:
    """cluster.md."""
    config, topo, bc = (results[k] for k in ("config", "topology", "broadcast"))
    size = bc["object_bytes"]
    labels = list(topo["workers_on"])
    lines = [
        "# refshare at cluster scale",
        "",
        *report.machine_lines(results["meta"]),
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
    broadcast_strategies = _strategies(results)[0]
    rows = []
    for s in broadcast_strategies:
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
    st, batch_strategies = batch["strategies"], _strategies(results)[1]
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
                    for s in batch_strategies
                ),
            ]
        )
        time_rows.append(
            [
                name,
                *(
                    spread([step[name]["seconds"] for step in st[s]["timed"]])
                    for s in batch_strategies
                ),
            ]
        )
    totals = {
        s: [sum(run[c]["moved"] for c in run) for run in [*st[s]["timed"], st[s]["held"]]]
        for s in batch_strategies
    }
    sent = sum(c["nbytes"] for c in calls)
    moved_rows.append(
        [
            "**whole step**",
            f"{sent / MiB:.1f}",
            *(f"**{_span(totals[s], MiB)}**" for s in batch_strategies),
        ]
    )
    step_seconds = {
        s: [sum(run[c]["seconds"] for c in run) for run in st[s]["timed"]] for s in batch_strategies
    }
    time_rows.append(["**whole step**", *(spread(step_seconds[s]) for s in batch_strategies)])
    peak_rows = [
        [STRATEGIES[s], *(f"{st[s]['peak'][label] / MiB:.1f}" for label in labels)]
        for s in batch_strategies
    ]
    n, rows, seq = topo["workers"], batch["rows"], batch["seq"]
    names = ", ".join(c["name"] for c in calls)
    return [
        "## Growing batch, DP-chunked",
        "",
        f"The step's calls ({names}) send a dict of [{rows}, {seq}] arrays, int64 "
        f"({', '.join(calls[0]['keys'])}) then float32 as keys are added, split by rows into {n} "
        f"chunks, chunk i to worker i (verl's DP dispatch): every worker gets different rows, so "
        f"nothing is shared within a call, and what moves is the whole batch. Distinct arrays "
        f"in the step: {batch['distinct_bytes'] / MiB:.1f} MiB. refshare first sight and deep "
        "start each step with an empty cache (new data each step, as in training); refshare "
        "repeat sends a step it sent before.",
        "",
        "MiB copied between nodes per call:",
        "",
        *table(["call", "batch MiB", *(STRATEGIES[s] for s in batch_strategies)], moved_rows),
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
        *table(["call", *(STRATEGIES[s] for s in batch_strategies)], time_rows),
    ]


# -- the plot -----------------------------------------------------------------------------------


def plot(results: dict[str, Any], path: Path) -> None:
    """cluster.png: bytes between nodes and store use per node, for both workloads."""
    plt = report.pyplot()
    topo, bc, batch = results["topology"], results["broadcast"], results["batch"]
    broadcast_strategies, batch_strategies = _strategies(results)
    labels = list(topo["workers_on"])
    size = bc["object_bytes"]
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    colors = {s: f"C{i}" for i, s in enumerate(STRATEGIES)}

    ax = axes[0, 0]
    for i, s in enumerate(broadcast_strategies):
        moved = bc["strategies"][s]["held"]["moved"] / size
        ax.bar(i, moved, color=colors[s])
        ax.text(i, moved, f"{moved:.2f}", ha="center", va="bottom")
    for n, what in ((topo["worker_nodes"], "worker nodes"), (topo["remote_workers"], "workers")):
        ax.axhline(n, ls="--", color="gray", lw=0.8)
        ax.text(len(broadcast_strategies) - 0.5, n, f"{n} = {what}", va="bottom", ha="right")
    ax.set_xticks(range(len(broadcast_strategies)))
    ax.set_xticklabels([STRATEGIES[s] for s in broadcast_strategies])
    ax.set_ylabel(f"copies of S ({size_label(bc['nbytes'])})")
    ax.set_title("broadcast: bytes copied between nodes per call")

    _peaks(axes[0, 1], labels, bc, broadcast_strategies, colors, size, "copies of S")
    axes[0, 1].set_title("broadcast: peak store use per node while tasks run")

    ax = axes[1, 0]
    names = [c["name"] for c in batch["calls"]]
    for s in batch_strategies:
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

    _peaks(axes[1, 1], labels, batch, batch_strategies, colors, MiB, "MiB")
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
