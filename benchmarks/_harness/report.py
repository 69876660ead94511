"""Units, number formats and tables; the record of a run (machine, software, revision); writing
its Markdown, JSON and plots."""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ray

from _harness.stats import median

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TIMES = "\u00d7"  # multiplication sign
DASH = "\u2013"  # en dash
TIMES_LE = "\u2264"  # less-than or equal
REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


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


def spread(seconds: Sequence[float]) -> str:
    """``median (min-max)`` in milliseconds."""
    return f"{ms(median(seconds))} ({ms(min(seconds))}{DASH}{ms(max(seconds))})"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


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


def _portable(arg: str) -> str:
    """``arg`` as the record shows it: a path in the repository relative to it, any other
    absolute path as ``DIR`` (the record speaks of the project, not of the machine)."""
    if not os.path.isabs(arg):
        return arg
    try:
        return str(Path(arg).resolve().relative_to(REPO))
    except ValueError:
        return "DIR"


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
        "command": shlex.join(["python", f"benchmarks/{script}", *map(_portable, sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "versions": versions,
        "git": git_state(),
        "load_average": [round(x, 2) for x in os.getloadavg()],  # 1, 5 and 15 minutes
        **extra,
    }


def finished(meta: dict[str, Any], started: float) -> None:
    """Record in ``meta`` how long the run took and the load it ended on (a shared machine?)."""
    meta["seconds"] = round(time.perf_counter() - started, 1)
    meta["load_average_end"] = [round(x, 2) for x in os.getloadavg()]


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
    """``stem.json`` and ``stem.md`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown)


def write_report(
    out: Path,
    stem: str,
    results: dict[str, Any],
    markdown: Callable[[dict[str, Any]], str],
    plot: Callable[[dict[str, Any], Path], None],
) -> list[str]:
    """``stem.json``, ``stem.md`` and, where matplotlib is installed, ``stem.png`` in ``out``
    (where it is not, ``results["skipped"]`` says so); returns the names written."""
    why = cannot_plot(f"{stem}.png")
    if why:
        results["skipped"].append(why)
    write_results(out, stem, results, markdown(results))
    if why:
        return [f"{stem}.md", f"{stem}.json"]
    plot(results, out / f"{stem}.png")
    return [f"{stem}.md", f"{stem}.json", f"{stem}.png"]
