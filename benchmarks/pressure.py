"""Memory pressure: a training loop in one ``refshare.sharing()`` block on a small object store.

Ray starts with a 200 MiB object store. Each step sends a new 40 MiB batch (a dict of four
10 MiB numpy arrays) to 2 actors, ``[a.step.remote(batch, step) for a in actors]``; each
actor returns a digest of what it received and an 8 MiB result, and the program keeps its
last 8 results (64 MiB, about a third of the store) alive, waiting for them every step. The
same loop runs by value, then inside one ``refshare.sharing()`` block with the default
options (the process-wide cache emptied first), on the same batches.

Per strategy: the MiB Ray spilled to disk during the loop (the "Spilled N MiB" of
``ray._private.internal_api.memory_summary(stats_only=True)``, as
``tests/test_memory_pressure.py`` reads it), the errors raised by type (an
``ObjectStoreFullError``, ``OutOfDiskError``, a timeout ...: the loop goes on), and the
seconds the loop took (making the batches excluded). Every step's digests and the kept
results are compared with by value's: the script exits 1 if any differs.

    python benchmarks/pressure.py            # 30 steps per strategy
    python benchmarks/pressure.py --quick    # 10 steps
"""

from __future__ import annotations

import contextlib
import gc
import re
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import ray
import xxhash
from _harness import options, report, session
from _harness.report import MiB, log, table
from _harness.stats import median

import refshare

# -- configuration --------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    mode: str
    steps: int
    store_bytes: int = 200 * MiB
    batch_bytes: int = 40 * MiB
    batch_arrays: int = 4
    result_bytes: int = 8 * MiB
    keep: int = 8  # results the program holds: keep x result_bytes = a third of the store
    actors: int = 2
    timeout_s: float = 60.0


MODES = {"full": Config("full", 30), "quick": Config("quick", 10)}
STRATEGIES = ("by_value", "refshare")
LABELS = {"by_value": "by value", "refshare": "refshare (default options)"}
#: Errors a step may raise under pressure: counted by type, and the loop goes on.
ERRORS: tuple[type[BaseException], ...] = (ray.exceptions.RayError, TimeoutError)


# -- the loop -------------------------------------------------------------------------------


def new_batch(config: Config, step: int) -> dict[str, np.ndarray]:
    """Step ``step``'s batch: new content, the same for every strategy."""
    rng = np.random.default_rng(step)
    per = config.batch_bytes // config.batch_arrays
    return {f"key{i}": rng.integers(0, 1 << 62, per // 8, dtype=np.int64)
            for i in range(config.batch_arrays)}  # fmt: skip


def digest(value: Any) -> str:
    h = xxhash.xxh3_128()
    for key in sorted(value):
        array = value[key]
        h.update(repr((key, type(array).__qualname__, array.dtype.str, array.shape,
                       array.flags.writeable)).encode())  # fmt: skip
        h.update(array.data)
    return h.hexdigest()


@ray.remote(num_cpus=0.1)
class Worker:
    @ray.method(num_returns=2)
    def step(self, batch: Any, step: int, result_bytes: int) -> tuple[str, np.ndarray]:
        """A digest of the batch, and an 8 MiB result the program keeps."""
        return digest(batch), np.full(result_bytes // 8, step, dtype=np.int64)


def spilled_mib() -> int:
    """MiB Ray has spilled to disk in this session so far."""
    from ray._private.internal_api import memory_summary

    address = ray.get_runtime_context().gcs_address
    found = re.search(r"Spilled (\d+) MiB", memory_summary(address=address, stats_only=True))
    return int(found.group(1)) if found else 0


def raylet_readable() -> str:
    """Whether refshare can read the raylet's count of the store (how its memory yields to
    the program's; needs ``ray[default]``)."""
    try:
        from refshare._ray.session import _raylet_store_used

        return f"yes ({_raylet_store_used() / MiB:.0f} MiB primary copies now)"
    except Exception as error:
        return f"no ({type(error).__name__})"


def loop(config: Config, actors: Sequence[Any], strategy: str) -> dict[str, Any]:
    """One training loop: ``config.steps`` steps, by value or inside one ``sharing()``."""
    if strategy == "refshare":
        refshare.clear()
    scope = refshare.sharing() if strategy == "refshare" else contextlib.nullcontext()
    errors: Counter[str] = Counter()
    digests: list[list[str] | None] = []
    step_seconds: list[float] = []
    kept: list[Any] = []
    before = refshare.stats()
    spilled_before = spilled_mib()
    with scope:
        for step in range(config.steps):
            batch = new_batch(config, step)
            start = time.perf_counter()
            try:
                pairs = [a.step.remote(batch, step, config.result_bytes) for a in actors]
                digests.append(ray.get([d for d, _ in pairs], timeout=config.timeout_s))
                kept = [*kept, *(r for _, r in pairs)][-config.keep :]
                ray.wait(kept, num_returns=len(kept), timeout=config.timeout_s)
            except ERRORS as error:
                errors[type(error).__name__] += 1
                digests.append(None)
                log(f"{strategy}: step {step}: {type(error).__name__}: {error}")
            step_seconds.append(time.perf_counter() - start)
            del batch
        try:
            results = [int(r[0]) for r in ray.get(kept, timeout=config.timeout_s)]
        except ERRORS as error:
            errors[type(error).__name__] += 1
            results = []
    spilled = spilled_mib() - spilled_before
    after = refshare.stats()
    counts = {f: getattr(after, f) - getattr(before, f) for f in ("puts", "hits", "evictions")}
    del kept
    log(f"{strategy}: {sum(step_seconds):.2f} s, spilled {spilled} MiB, errors {dict(errors)}, "
        f"refshare {counts}")  # fmt: skip
    return {"seconds": sum(step_seconds), "step_seconds": step_seconds, "spilled_mib": spilled,
            "errors": dict(errors), "digests": digests, "results": results,
            "refshare_counts": counts}  # fmt: skip


def run(config: Config) -> dict[str, Any]:
    ray_init = {"num_cpus": 2, "object_store_memory": config.store_bytes, "actor_num_cpus": 0.1}
    meta = report.machine("pressure.py", ray_init=ray_init)
    started = time.perf_counter()
    session.start_ray(config.store_bytes)
    loops = {}
    try:
        actors = [Worker.remote() for _ in range(config.actors)]  # type: ignore[attr-defined]
        warm = new_batch(config, -1 % (1 << 32))  # one untimed step pays one-time costs
        ray.get([a.step.remote(warm, -1, config.result_bytes)[0] for a in actors])
        del warm
        readable = raylet_readable()
        log(f"refshare reads the raylet's store count: {readable}")
        monitor = session.StoreMonitor()
        for strategy in STRATEGIES:
            gc.collect()
            monitor.wait_until_idle()
            loops[strategy] = loop(config, actors, strategy)
        refshare.clear()
    finally:
        ray.shutdown()
    report.finished(meta, started)
    base = loops["by_value"]
    same = {
        s: all(
            d == b for d, b in zip(r["digests"], base["digests"], strict=True) if None not in (d, b)
        ) and (not r["results"] or not base["results"] or r["results"] == base["results"])
        for s, r in loops.items()
    }  # fmt: skip
    return {"meta": meta, "config": asdict(config), "raylet_readable": readable,
            "loops": loops, "same_as_by_value": same}  # fmt: skip


def markdown(results: dict[str, Any]) -> str:
    config = results["config"]
    lines = ["# refshare memory-pressure benchmark", "", *report.machine_lines(results["meta"])]
    lines += [
        "",
        f"A {config['store_bytes'] // MiB} MiB object store; {config['steps']} steps, each "
        f"sending a new {config['batch_bytes'] // MiB} MiB batch to {config['actors']} actors; "
        f"the program keeps its last {config['keep']} results of "
        f"{config['result_bytes'] // MiB} MiB. refshare can read the raylet's count: "
        f"{results['raylet_readable']}.",
        "",
        "## Per strategy",
        "",
    ]
    header = ["strategy", "steps", "spilled MiB", "errors", "total s", "step ms (median)",
              "refshare puts / hits / evictions", "same as by value"]  # fmt: skip
    rows = []
    for name, run_ in results["loops"].items():
        errors = ", ".join(f"{k} {v}" for k, v in run_["errors"].items()) or "0"
        counts = run_["refshare_counts"]
        rows.append([LABELS[name], str(len(run_["step_seconds"])), str(run_["spilled_mib"]),
                     errors, f"{run_['seconds']:.2f}",
                     f"{median(run_['step_seconds']) * 1e3:.0f}",
                     f"{counts['puts']} / {counts['hits']} / {counts['evictions']}",
                     "yes" if results["same_as_by_value"][name] else "NO"])  # fmt: skip
    lines += table(header, rows)
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = options.parser(__doc__ or "", {"quick": "10 steps per strategy"}).parse_args(argv)
    results = run(MODES["quick" if args.quick else "full"])
    for run_ in results["loops"].values():
        del run_["digests"]  # compared already; long and of no use in the JSON
    report.write_results(args.out, "pressure", results, markdown(results))
    print((args.out / "pressure.md").read_text())
    if not all(results["same_as_by_value"].values()):
        log("WORKERS RECEIVED OTHER DATA than by value")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
