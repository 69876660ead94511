"""What every benchmark here shares: a small local Ray, a warmed store, interleaving, medians,
the record of the machine and revision, and writing Markdown and JSON."""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import ray

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TIMES = "\u00d7"  # multiplication sign
DASH = "\u2013"  # en dash
REPO = Path(__file__).resolve().parent.parent


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


def ms(seconds: float) -> str:
    value = seconds * 1e3
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}" if value >= 1 else f"{value:.3f}"


def spread(values: Sequence[float]) -> str:
    """``median (min-max)`` in milliseconds."""
    return f"{ms(median(values))} ({ms(min(values))}{DASH}{ms(max(values))})"


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


def write_results(out: Path, stem: str, results: dict[str, Any], markdown: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown)


class Sharing:
    """refshare on one method of a class (``cls.__dict__[name]``), switched per strategy turn.

    :meth:`on` puts it on for a ``with`` block and takes it off after: with
    ``refshare.patch_methods`` / ``unpatch_methods`` where refshare has them, else by setting
    the class attribute to ``refshare.shared_args(original)`` and back. Switch between turns
    only, never while calls are running.
    """

    def __init__(self, cls: type, name: str) -> None:
        import refshare  # here, so that workers importing this module never import it

        self.refshare, self.cls, self.name = refshare, cls, name
        self.original = cls.__dict__[name]
        self.api = hasattr(refshare, "patch_methods") and hasattr(refshare, "unpatch_methods")
        label = f"{cls.__qualname__}, {name!r}"
        self.how = (
            f"refshare.patch_methods({label}), then refshare.unpatch_methods({label})"
            if self.api
            else f"{cls.__qualname__}.{name} = refshare.shared_args(original), then original"
        )
        self.wrapper = None if self.api else refshare.shared_args(self.original)

    @contextlib.contextmanager
    def on(self, enabled: bool) -> Iterator[None]:
        if not enabled:
            yield
            return
        if self.api:
            self.refshare.patch_methods(self.cls, self.name)
        else:
            setattr(self.cls, self.name, self.wrapper)
        try:
            if self.cls.__dict__[self.name] is self.original:
                raise RuntimeError(f"{self.how}: the method was not wrapped")
            yield
        finally:
            if self.api:
                self.refshare.unpatch_methods(self.cls, self.name)
            else:
                setattr(self.cls, self.name, self.original)
            if self.cls.__dict__[self.name] is not self.original:
                raise RuntimeError(f"{self.how}: the original method was not restored")
