"""Memory pressure: does refshare spill more, or raise, where by value does not, with grpcio
and without it?

Ray starts with a 200 MiB object store. A training step sends a new 40 MiB batch (a dict of
four 10 MiB numpy arrays) to 2 actors, ``[a.step.remote(batch, step) for a in actors]``; each
actor returns a digest of what it received and an 8 MiB result, and the program keeps its
last 8 results (64 MiB, about a third of the store) alive, waiting for them every step. Three
cases, each by value and inside ``refshare.sharing()`` with the default options:

- **one block**: the loop inside one block;
- **two scopes**: two trainers in one driver: a thread sends a burst of 2 new batches inside
  its own block and then idles with the block open, while the main thread loops in its own;
- **many refs**: the loop while the program holds 25,000 small refs (and 50,000), with the
  time of one reading of the store (``refshare._ray.session.local_store_used``), which must not
  grow with the refs held.

Each case runs with grpcio and without: each in a child process connected to this one's Ray
(``ray.init(address=...)``), by value then with refshare, the "without" one with ``import
grpc`` failing (a ``sys.meta_path`` blocker installed first, ``_harness/child.py``), as on a
plain ``pip install ray``. This process reads the MiB Ray spilled to disk before and after
each strategy's loop, while the child waits (the "Spilled N MiB" of
``memory_summary(stats_only=True)``, as ``tests/test_memory_pressure.py`` reads it: with
gRPC, which the child may not have). Per case, variant and strategy: spilled MiB,
errors by type (an ``ObjectStoreFullError``, ``OutOfDiskError``, a timeout: the loop goes on),
the loop's seconds and median step (making the batches excluded). Every step's digests and
the kept results are compared with by value's: the script exits 1 if any differs.

    python benchmarks/pressure.py            # 30 steps per loop
    python benchmarks/pressure.py --quick    # 10 steps
    python benchmarks/pressure.py --smoke    # 3 steps, 5,000 refs (the tests)
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import ray
import xxhash
from _harness import child, options, report, session
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
    burst: int = 2  # two scopes: the batches the idle trainer sent before idling
    many_refs: tuple[int, ...] = (25_000, 50_000)  # many refs: how many the program holds
    timeout_s: float = 60.0
    readings: int = 20  # readings of the store timed, per loop


MODES = {
    "full": Config("full", 30),
    "quick": Config("quick", 10),
    "smoke": Config("smoke", 3, many_refs=(5_000,)),  # what the tests run: each case once
}
STRATEGIES = ("by_value", "refshare")
LABELS = {"by_value": "by value", "refshare": "refshare (default options)"}
VARIANTS = {"with grpcio": (), "without grpcio": ("grpc",)}


def cases(config: Config) -> dict[str, int]:
    """Each case by name, and the small refs the program holds beside its loop."""
    return {"one block": 0, "two scopes": 0} | {f"{n:,} refs": n for n in config.many_refs}


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
    """MiB Ray has spilled to disk in this session so far (needs grpcio: the parent's)."""
    from ray._private.internal_api import memory_summary

    address = ray.get_runtime_context().gcs_address
    found = re.search(r"Spilled (\d+) MiB", memory_summary(address=address, stats_only=True))
    return int(found.group(1)) if found else 0


def scope(strategy: str) -> contextlib.AbstractContextManager[Any]:
    return refshare.sharing() if strategy == "refshare" else contextlib.nullcontext()


def loop(config: Config, actors: Sequence[Any], strategy: str) -> dict[str, Any]:
    """One training loop: ``config.steps`` steps, by value or inside one ``sharing()``."""
    errors: Counter[str] = Counter()
    digests: list[list[str] | None] = []
    step_seconds: list[float] = []
    kept: list[Any] = []
    with scope(strategy):
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
    return {"seconds": sum(step_seconds), "step_seconds": step_seconds, "errors": dict(errors),
            "digests": digests, "results": results}  # fmt: skip


def idle_trainer(config: Config, actors: Sequence[Any], strategy: str) -> tuple[Any, Any]:
    """The second trainer of "two scopes": a thread that sends a burst of new batches in its
    own block, then idles with the block open until told to stop. Returns the thread's stop
    event and its digests (filled in once the burst is sent)."""
    burst_sent, stop = threading.Event(), threading.Event()
    digests: list[list[str]] = []

    def trainer() -> None:
        with scope(strategy):
            for i in range(config.burst):
                batch = new_batch(config, 1_000 + i)
                digests.append(ray.get([a.step.remote(batch, i, 0)[0] for a in actors]))
            burst_sent.set()
            stop.wait(10 * config.timeout_s)

    threading.Thread(target=trainer, name="idle-trainer", daemon=True).start()
    if not burst_sent.wait(config.timeout_s):
        raise TimeoutError("the idle trainer's burst did not finish")
    return stop, digests


def reading_ms(config: Config) -> float | None:
    """The median time of one reading of the store, as refshare takes it (``None``: it
    cannot be read here)."""
    from refshare._ray.session import local_store_used

    if local_store_used() is None:
        return None
    times = []
    for _ in range(config.readings):
        start = time.perf_counter()
        local_store_used()
        times.append(time.perf_counter() - start)
    return median(times) * 1e3


def run_case(config: Config, case: str) -> dict[str, Any]:
    """One case, by value then with refshare, in this (child) process: actors, one untimed
    step, the program's many refs, then each strategy's loop with what the case adds beside
    it, from a checkpoint where the parent reads how much Ray has spilled."""
    actors = [Worker.remote() for _ in range(config.actors)]  # type: ignore[attr-defined]
    warm = new_batch(config, -1 % (1 << 32))  # one untimed step pays one-time costs
    ray.get([a.step.remote(warm, -1, config.result_bytes)[0] for a in actors])
    del warm
    held = [ray.put(i) for i in range(cases(config)[case])]  # the program's many small refs
    out = {}
    for strategy in STRATEGIES:
        child.checkpoint(strategy)
        refshare.clear()
        before = refshare.stats()
        stop, burst = idle_trainer(config, actors, strategy) if case == "two scopes" else (None, [])
        reading = reading_ms(config)
        found = loop(config, actors, strategy)
        if stop is not None:
            stop.set()
        after = refshare.stats()
        refshare.clear()  # the cache's last batch would hold the store past "idle" for good
        counts = {f: getattr(after, f) - getattr(before, f) for f in ("puts", "hits", "evictions")}
        out[strategy] = {**found, "burst_digests": burst, "refshare_counts": counts,
                         "reading_ms": reading, "grpc_imported": "grpc" in sys.modules}  # fmt: skip
    child.checkpoint("end")
    del held
    return out


# -- the parent: children per case, variant and strategy ------------------------------------


def run(config: Config) -> dict[str, Any]:
    ray_init = {"num_cpus": 2, "object_store_memory": config.store_bytes, "actor_num_cpus": 0.1}
    meta = report.machine("pressure.py", ray_init=ray_init)
    started = time.perf_counter()
    session.start_ray(config.store_bytes)
    runs: dict[str, dict[str, dict[str, Any]]] = {}
    try:
        address = ray.get_runtime_context().gcs_address
        monitor = session.StoreMonitor()
        if config.mode != "smoke":  # the first child would pay Ray starting worker processes
            warm = {"address": address, "case": "one block",
                    "config": asdict(replace(config, steps=1))}  # fmt: skip
            child.run_child(Path(__file__), ["--child", json.dumps(warm)])
        for case in cases(config):
            for variant, without in VARIANTS.items():
                spilled: dict[str, int] = {}  # at each checkpoint, once the store is idle
                spec = json.dumps({"address": address, "case": case, "config": asdict(config)})
                found = child.run_child(
                    Path(__file__), ["--child", spec], without, partial(read, monitor, spilled)
                )
                ends = [*STRATEGIES[1:], "end"]
                for strategy, end in zip(STRATEGIES, ends, strict=True):
                    found[strategy]["spilled_mib"] = spilled[end] - spilled[strategy]
                    log(f"{case}, {variant}, {strategy}: {summary(found[strategy])}")
                runs[f"{case}, {variant}"] = found
    finally:
        ray.shutdown()
    report.finished(meta, started)
    for loops in runs.values():
        for found in loops.values():
            found["same_as_by_value"] = same(found, loops["by_value"])
        for found in loops.values():
            del found["digests"], found["burst_digests"]  # compared; of no use in the JSON
    return {"meta": meta, "config": asdict(config), "runs": runs}


def read(monitor: session.StoreMonitor, spilled: dict[str, int], name: str) -> None:
    """At a child's checkpoint ``name``: what Ray has spilled, once the store is idle."""
    monitor.wait_until_idle()
    spilled[name] = spilled_mib()


def summary(found: dict[str, Any]) -> str:
    return (f"spilled {found['spilled_mib']} MiB, {found['seconds']:.2f} s, errors "
            f"{found['errors']}, reading {found['reading_ms']} ms, "
            f"{found['refshare_counts']}")  # fmt: skip


def same(found: dict[str, Any], base: dict[str, Any]) -> bool:
    """Whether every step both answered, and the kept results, are by value's."""
    pairs = zip(found["digests"], base["digests"], strict=True)
    return (
        all(d == b for d, b in pairs if None not in (d, b))
        and found["burst_digests"] == base["burst_digests"]
        and (not found["results"] or not base["results"] or found["results"] == base["results"])
    )


def markdown(results: dict[str, Any]) -> str:
    config = results["config"]
    lines = ["# refshare memory-pressure benchmark", "", *report.machine_lines(results["meta"])]
    lines += [
        "",
        f"A {config['store_bytes'] // MiB} MiB object store; {config['steps']} steps a loop, "
        f"each sending a new {config['batch_bytes'] // MiB} MiB batch to {config['actors']} "
        f"actors; the program keeps its last {config['keep']} results of "
        f"{config['result_bytes'] // MiB} MiB. Two scopes: beside the loop, a thread sent "
        f"{config['burst']} new batches in its own block and idles with it open. Many refs: "
        "the program holds that many small refs while it loops. Each run in a child process "
        "connected to the same Ray; without grpcio, its `import grpc` fails. Reading: the "
        "median time of one reading of the store as refshare takes it "
        "(`refshare._ray.session.local_store_used`), taken before the loop.",
        "",
        "## Per case",
        "",
    ]
    header = ["case", "strategy", "steps", "spilled MiB", "errors", "total s",
              "step ms (median)", "reading ms", "refshare puts / hits / evictions",
              "same as by value"]  # fmt: skip
    rows = []
    for case, loops in results["runs"].items():
        for name, run_ in loops.items():
            errors = ", ".join(f"{k} {v}" for k, v in run_["errors"].items()) or "0"
            counts = run_["refshare_counts"]
            reading = run_["reading_ms"]
            rows.append([case, LABELS[name], str(len(run_["step_seconds"])),
                         str(run_["spilled_mib"]), errors, f"{run_['seconds']:.2f}",
                         f"{median(run_['step_seconds']) * 1e3:.0f}",
                         "-" if reading is None else f"{reading:.2f}",
                         f"{counts['puts']} / {counts['hits']} / {counts['evictions']}",
                         "yes" if run_["same_as_by_value"] else "NO"])  # fmt: skip
    lines += table(header, rows)
    imported = {c for c, loops in results["runs"].items()
                if any(r["grpc_imported"] for r in loops.values())}  # fmt: skip
    lines += ["", f"grpc imported in the children of: {', '.join(sorted(imported)) or 'none'}."]
    return "\n".join(lines) + "\n"


def child_main(spec_text: str) -> int:
    """A child's part: connect to the parent's Ray, run one case."""
    spec = json.loads(spec_text)
    config = Config(**{**spec["config"], "many_refs": tuple(spec["config"]["many_refs"])})
    ray.init(address=spec["address"], log_to_driver=False, configure_logging=False)
    try:
        child.answer(run_case(config, spec["case"]))
    finally:
        ray.shutdown()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    modes = {"quick": "10 steps per loop", "smoke": "3 steps, 5,000 refs"}
    parser = options.parser(__doc__ or "", modes)
    parser.add_argument("--child", help="(internal) run one case in this process")
    args = parser.parse_args(argv)
    if args.child:
        return child_main(args.child)
    results = run(MODES[options.mode(args)])
    report.write_results(args.out, "pressure", results, markdown(results))
    print((args.out / "pressure.md").read_text())
    if not all(r["same_as_by_value"] for loops in results["runs"].values() for r in loops.values()):
        log("WORKERS RECEIVED OTHER DATA than by value")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
