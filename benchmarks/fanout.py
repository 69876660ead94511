"""Fan-out benchmark: what sending one large argument to N Ray actors costs, by strategy.

Each measured call is ``ray.get([w.f.remote(x) for w in workers])`` with ``x`` sent as:

* **by value**: plain Ray, which serializes ``x`` into the object store once per call;
* **per-call put**: hand-written ``r = ray.put(x)`` then ``r`` to every worker, every call;
* **refshare first**: the fan-out decorated with ``@refshare.shared_args``, cache emptied
  before the call, so ``x`` is hashed and put (a first call with new content);
* **refshare repeat**: the same call again with the cache warm: ``x`` is hashed, found,
  and its existing ref is sent;
* **refshare reuse**: a repeat call with ``reuse_fingerprints=True``, which skips hashing
  objects refshare can prove unchanged (the arrays here are read-only, tensors are
  versioned): the opt-in fast path, measured beside the default;
* **ideal**: a ref put once before timing and reused: what dispatch alone costs.

The workers do no work with ``x``, so transport is what is measured. Yardsticks per
payload: a bare single-thread ``xxhash.xxh3_128`` and a memcpy (``np.copyto``) of the same
bytes, and ``refshare.fingerprint(x)`` itself. Also measured: the object-store bytes held
while the tasks are in flight, a cold first call before the store is warmed, and the
per-``.remote()`` overhead refshare adds to small arguments.

Everything runs in one process and one local Ray session; strategies are interleaved
round-robin within each repetition. Results go to ``fanout.md`` (tables and target
checks), ``fanout.json`` (raw times) and ``fanout.png`` (log-log plot) in ``--out``.

    python benchmarks/fanout.py            # full run (about 10 minutes on 2 cores)
    python benchmarks/fanout.py --quick    # about a minute
    python benchmarks/fanout.py --smoke    # seconds: for the test suite
    python benchmarks/fanout.py --profile  # pyinstrument of refshare repeat calls
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import _harness as bench
import numpy as np
import ray
import xxhash
from _harness import (
    DASH,
    TIMES,
    GiB,
    KiB,
    MiB,
    StoreMonitor,
    log,
    median,
    ms,
    rotated,
    size_label,
    table,
)

import refshare

#: Strategies in table order, with their display labels.
STRATEGIES: dict[str, str] = {
    "by_value": "by value",
    "per_call_put": "per-call put",
    "refshare_first": "refshare first",
    "refshare_repeat": "refshare repeat",
    "refshare_reuse": "refshare reuse",
    "ideal": "ideal",
}
#: Physical yardsticks timed on the driver alone, per payload.
YARDSTICKS: dict[str, str] = {
    "xxh3_128": "xxh3_128 (1 thread)",
    "memcpy": "memcpy (np.copyto)",
    "fingerprint": "refshare.fingerprint",
}
#: (label, numerator, denominator) of the ratio columns: > 1 means the denominator is faster.
RATIOS: tuple[tuple[str, str, str], ...] = (
    ("by value / repeat", "by_value", "refshare_repeat"),
    ("per-call put / repeat", "per_call_put", "refshare_repeat"),
    ("repeat / ideal", "refshare_repeat", "ideal"),
    ("first / per-call put", "refshare_first", "per_call_put"),
    ("reuse / ideal", "refshare_reuse", "ideal"),
)
#: The project's targets at 64 MiB, N=4, warm: (ratio label, "min" or "max", bound).
TARGET_PAYLOAD = "64 MiB"
TARGET_N = 4
TARGETS: tuple[tuple[str, str, float], ...] = (
    ("by value / repeat", "min", 3.5),
    ("per-call put / repeat", "min", 1.5),
    ("repeat / ideal", "max", 1.5),
    ("first / per-call put", "max", 1.15),
)
FINGERPRINT_TARGET = 0.85  # fingerprint speed relative to bare single-thread xxh3_128
SMALL_ARGS_TARGET = 1.05  # decorated / undecorated fan-out time with small arguments


# -- configuration --------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """What one run measures."""

    mode: str
    sizes: tuple[int, ...]  # float64 array payloads, in bytes
    workers: tuple[int, ...]  # fan-out widths N
    reps: int
    store_bytes: int  # object_store_memory of the Ray session
    dict_arrays: int  # the dict payload: this many float64 arrays ...
    dict_bytes: int  # ... making this many bytes in all
    tensor_bytes: int  # CPU bfloat16 tensor payload (if torch is importable)
    cold_size: int  # the cold measurement: this payload ...
    cold_n: int  # ... to this many workers
    memory_min_bytes: int  # store usage in flight is sampled for payloads this large
    hold_s: float  # how long workers hold their argument while store usage is sampled
    small_reps: int  # fan-outs per variant in the small-argument overhead test


MODES: dict[str, Config] = {
    "full": Config(
        mode="full",
        sizes=(
            10 * KiB,
            32 * KiB,
            100 * KiB,
            320 * KiB,
            MiB,
            4 * MiB,
            16 * MiB,
            64 * MiB,
            256 * MiB,
        ),
        workers=(1, 2, 4, 8),
        reps=9,
        store_bytes=4 * GiB,
        dict_arrays=4,
        dict_bytes=64 * MiB,
        tensor_bytes=64 * MiB,
        cold_size=64 * MiB,
        cold_n=4,
        memory_min_bytes=MiB,
        hold_s=0.4,
        small_reps=400,
    ),
    "quick": Config(
        mode="quick",
        sizes=(10 * KiB, 100 * KiB, MiB, 16 * MiB, 64 * MiB),
        workers=(1, 2, 4, 8),
        reps=5,
        store_bytes=GiB,
        dict_arrays=4,
        dict_bytes=64 * MiB,
        tensor_bytes=16 * MiB,
        cold_size=64 * MiB,
        cold_n=4,
        memory_min_bytes=64 * MiB,
        hold_s=0.25,
        small_reps=200,
    ),
    "smoke": Config(
        mode="smoke",
        sizes=(10 * KiB, 256 * KiB),
        workers=(1, 2),
        reps=2,
        store_bytes=128 * MiB,
        dict_arrays=4,
        dict_bytes=256 * KiB,
        tensor_bytes=256 * KiB,
        cold_size=256 * KiB,
        cold_n=2,
        memory_min_bytes=256 * KiB,
        hold_s=0.15,
        small_reps=10,
    ),
}


# -- payloads -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Payload:
    """One argument to fan out."""

    label: str
    kind: str  # "float64", "dict" or "bf16 tensor"
    nbytes: int
    make: Callable[[], Any]


def _random_array(nbytes: int, seed: int) -> np.ndarray:
    """Random float64s, read-only so that ``reuse_fingerprints`` may trust them."""
    array = np.random.default_rng(seed).random(nbytes // 8)
    array.flags.writeable = False
    return array


def _random_dict(count: int, nbytes: int) -> dict[str, np.ndarray]:
    return {f"w{i}": _random_array(nbytes // count, seed=100 + i) for i in range(count)}


def _random_tensor(nbytes: int) -> Any:
    import torch

    return torch.rand(nbytes // 2, dtype=torch.float32).to(torch.bfloat16)


def payloads(config: Config) -> tuple[list[Payload], list[str]]:
    """The payloads of a run, and a note for each one skipped."""
    found = [
        Payload(size_label(n), "float64", n, functools.partial(_random_array, n, seed=n))
        for n in config.sizes
    ]
    per = size_label(config.dict_bytes // config.dict_arrays)
    found.append(
        Payload(
            f"dict {config.dict_arrays}{TIMES}{per}",
            "dict",
            config.dict_bytes,
            lambda: _random_dict(config.dict_arrays, config.dict_bytes),
        )
    )
    skipped = []
    if importlib.util.find_spec("torch") is None:
        skipped.append("bf16 tensor: torch is not importable")
    else:
        found.append(
            Payload(
                f"bf16 tensor {size_label(config.tensor_bytes)}",
                "bf16 tensor",
                config.tensor_bytes,
                lambda: _random_tensor(config.tensor_bytes),
            )
        )
    return found, skipped


def raw_buffers(value: Any) -> list[np.ndarray]:
    """The bytes of a payload as flat uint8 arrays (views, no copy)."""
    if isinstance(value, dict):
        return [buf for item in value.values() for buf in raw_buffers(item)]
    if isinstance(value, np.ndarray):
        return [value.reshape(-1).view(np.uint8)]
    import torch

    return [value.view(torch.int16).numpy().reshape(-1).view(np.uint8)]


# -- workers and fan-out functions ----------------------------------------------------------


@ray.remote(num_cpus=0.1)
class Worker:
    """Receives an argument and does (almost) nothing with it."""

    def f(self, x: Any) -> int:
        return len(x)

    def hold(self, x: Any, seconds: float) -> int:
        time.sleep(seconds)
        return len(x)

    def touch(self, x: np.ndarray) -> int:
        """Read one byte of every page of ``x``, so this process has them all mapped."""
        return int(x.reshape(-1).view(np.uint8)[::4096].sum())

    def small(self, *args: Any) -> int:
        return len(args)


def new_worker() -> Any:
    return Worker.remote()  # type: ignore[attr-defined]


def fan_out(workers: Sequence[Any], x: Any, hold_s: float = 0.0) -> list[int]:
    """Send ``x`` to every worker and wait for all of them."""
    if hold_s:
        return ray.get([w.hold.remote(x, hold_s) for w in workers])
    return ray.get([w.f.remote(x) for w in workers])


#: The same fan-out with refshare. ``min_bytes=0`` shares every payload, so the size sweep
#: shows where sharing stops paying (the crossover that calibrates the default min_bytes).
shared_fan_out = refshare.shared_args(min_bytes=0)(fan_out)
#: The opt-in identity fast path: unchanged (read-only or versioned) values are not rehashed.
reuse_fan_out = refshare.shared_args(min_bytes=0, reuse_fingerprints=True)(fan_out)


def submit_small(workers: Sequence[Any], *args: Any) -> tuple[list[Any], float]:
    """Submit ``args`` to every worker; return the refs and the time the submits took."""
    start = time.perf_counter()
    refs = [w.small.remote(*args) for w in workers]
    return refs, time.perf_counter() - start


#: With the default options: every small argument stays under min_bytes.
shared_submit_small = refshare.shared_args(submit_small)


# -- strategies -----------------------------------------------------------------------------


class Case:
    """One payload fanned out to one set of workers, with the ideal strategy's ref."""

    def __init__(self, payload: Payload, value: Any, workers: Sequence[Any]) -> None:
        self.payload = payload
        self.value = value
        self.workers = workers
        self.ideal_ref: Any = None

    def reset(self) -> None:
        """Drop every copy of the value this case made in the object store."""
        refshare.clear()
        self.ideal_ref = None


def _prepare_nothing(case: Case) -> None:
    pass


def _prepare_cold_cache(case: Case) -> None:
    refshare.clear()


def _prepare_warm_cache(case: Case) -> None:
    shared_fan_out(case.workers, case.value)


def _prepare_warm_reuse(case: Case) -> None:
    reuse_fan_out(case.workers, case.value)


def _prepare_ideal(case: Case) -> None:
    if case.ideal_ref is None:
        case.ideal_ref = ray.put(case.value)


def _call_by_value(case: Case, hold_s: float) -> list[int]:
    return fan_out(case.workers, case.value, hold_s)


def _call_per_call_put(case: Case, hold_s: float) -> list[int]:
    ref = ray.put(case.value)
    return fan_out(case.workers, ref, hold_s)


def _call_shared(case: Case, hold_s: float) -> list[int]:
    return shared_fan_out(case.workers, case.value, hold_s)


def _call_reuse(case: Case, hold_s: float) -> list[int]:
    return reuse_fan_out(case.workers, case.value, hold_s)


def _call_ideal(case: Case, hold_s: float) -> list[int]:
    return fan_out(case.workers, case.ideal_ref, hold_s)


#: name -> (untimed preparation, timed call)
PLANS: dict[str, tuple[Callable[[Case], None], Callable[[Case, float], list[int]]]] = {
    "by_value": (_prepare_nothing, _call_by_value),
    "per_call_put": (_prepare_nothing, _call_per_call_put),
    "refshare_first": (_prepare_cold_cache, _call_shared),
    "refshare_repeat": (_prepare_warm_cache, _call_shared),
    "refshare_reuse": (_prepare_warm_reuse, _call_reuse),
    "ideal": (_prepare_ideal, _call_ideal),
}


#: The strategies that go through refshare, whose puts and hits are counted.
SHARED = ("refshare_first", "refshare_repeat", "refshare_reuse")


def _check(case: Case, results: list[int]) -> None:
    expected = [len(case.value)] * len(case.workers)
    if results != expected:
        raise RuntimeError(f"{case.payload.label}: workers returned {results}, not {expected}")


def _checked_call(call: Callable[[Case, float], list[int]], case: Case, hold_s: float) -> None:
    _check(case, call(case, hold_s))


def time_case(case: Case, reps: int) -> tuple[dict[str, list[float]], dict[str, dict[str, int]]]:
    """Time every strategy ``reps`` times, interleaved; also count what refshare did.

    An untimed round comes first: first calls pay one-time costs (a worker importing torch
    to deserialize a tensor, say) that are not transport.
    """
    names = list(STRATEGIES)
    for name in names:
        prepare, call = PLANS[name]
        prepare(case)
        _check(case, call(case, 0.0))
    times: dict[str, list[float]] = {name: [] for name in names}
    counts = {name: {"puts": 0, "hits": 0} for name in SHARED}
    for rep in range(reps):
        for name in rotated(names, rep):
            prepare, call = PLANS[name]
            prepare(case)
            before = refshare.stats()
            start = time.perf_counter()
            results = call(case, 0.0)
            times[name].append(time.perf_counter() - start)
            after = refshare.stats()
            _check(case, results)
            if name in counts:
                counts[name]["puts"] += after.puts - before.puts
                counts[name]["hits"] += after.hits - before.hits
    return times, counts


def measure_cold(case: Case) -> dict[str, float]:
    """One call per strategy before the store is warmed.

    The objects of earlier strategies are kept alive until the end, so each allocation
    lands on pages the store has not handed out before.
    """
    workers, value = case.workers, case.value
    times: dict[str, float] = {}
    start = time.perf_counter()
    kept = ray.put(value)
    _check(case, fan_out(workers, kept))
    times["per_call_put"] = time.perf_counter() - start
    refshare.clear()
    for name, fn in (
        ("refshare_first", shared_fan_out),
        ("refshare_repeat", shared_fan_out),
        ("refshare_reuse", reuse_fan_out),
    ):
        start = time.perf_counter()
        _check(case, fn(workers, value))
        times[name] = time.perf_counter() - start
    case.ideal_ref = ray.put(value)
    start = time.perf_counter()
    _check(case, fan_out(workers, case.ideal_ref))
    times["ideal"] = time.perf_counter() - start
    start = time.perf_counter()
    _check(case, fan_out(workers, value))
    times["by_value"] = time.perf_counter() - start
    del kept
    case.reset()
    return {name: times[name] for name in STRATEGIES}


# -- object store ---------------------------------------------------------------------------


def measure_in_flight(case: Case, monitor: StoreMonitor, hold_s: float) -> dict[str, float]:
    """Object-store bytes each strategy holds while its tasks are in flight."""
    held: dict[str, float] = {}
    for name in STRATEGIES:
        prepare, call = PLANS[name]
        case.reset()
        base = monitor.settled(max(0.15, hold_s / 2))
        prepare(case)
        peak = monitor.peak_during(functools.partial(_checked_call, call, case, hold_s))
        held[name] = max(0.0, peak - base)
    case.reset()
    return held


def warm_store(workers: Sequence[Any], store_bytes: int, value: Any) -> float:
    """Warm the object store and every worker's mapping of it (``bench.warm_store``), then
    make two by-value fan-outs of ``value``. Returns the seconds it took."""
    start = time.perf_counter()
    bench.warm_store(workers, store_bytes)
    for _ in range(2):
        fan_out(workers, value)
    return time.perf_counter() - start


# -- yardsticks and small-argument overhead -------------------------------------------------


def time_yardsticks(value: Any, reps: int) -> dict[str, list[float]]:
    """Time a bare hash, a memcpy and refshare's fingerprint of ``value``, interleaved."""
    sources = raw_buffers(value)
    targets = [np.ones_like(buf) for buf in sources]  # pages touched before timing

    def hash_bare() -> None:
        for buf in sources:
            xxhash.xxh3_128_digest(buf.data)

    def copy() -> None:
        for src, dst in zip(sources, targets, strict=True):
            np.copyto(dst, src)

    def fingerprint() -> None:
        if refshare.fingerprint(value) is None:
            raise RuntimeError("refshare could not fingerprint the payload")

    actions = {"xxh3_128": hash_bare, "memcpy": copy, "fingerprint": fingerprint}
    times: dict[str, list[float]] = {name: [] for name in actions}
    for rep in range(reps):
        for name in rotated(list(actions), rep):
            start = time.perf_counter()
            actions[name]()
            times[name].append(time.perf_counter() - start)
    return times


SMALL_ARGS: tuple[Any, ...] = (np.zeros(16), "tag", {"lr": 0.1, "steps": 10}, (1, 2, 3), 7)


def time_small_args(workers: Sequence[Any], reps: int) -> dict[str, dict[str, list[float]]]:
    """Fan-outs of small arguments with and without the decorator, interleaved.

    Records each fan-out's total time and its per-``.remote()`` submit time.
    """
    variants = {"undecorated": submit_small, "decorated": shared_submit_small}
    for fn in variants.values():  # first calls pay one-time costs
        for _ in range(5):
            ray.get(fn(workers, *SMALL_ARGS)[0])
    result: dict[str, dict[str, list[float]]] = {
        name: {"fan_out": [], "per_remote": []} for name in variants
    }
    for rep in range(reps):
        for name in rotated(list(variants), rep):
            start = time.perf_counter()
            refs, submit = variants[name](workers, *SMALL_ARGS)
            ray.get(refs)
            result[name]["fan_out"].append(time.perf_counter() - start)
            result[name]["per_remote"].append(submit / len(workers))
    return result


# -- the run --------------------------------------------------------------------------------


def start_ray(config: Config) -> None:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        address="local",
        num_cpus=2,
        object_store_memory=config.store_bytes,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )


def run(config: Config) -> dict[str, Any]:
    """Run every measurement of ``config``; return the raw results."""
    found, skipped = payloads(config)
    # Before measuring: the refshare revision that was imported.
    meta = bench.machine(
        "fanout.py",
        ray_init={
            "num_cpus": 2,
            "object_store_memory": config.store_bytes,
            "actor_num_cpus": 0.1,
        },
    )
    started = time.perf_counter()
    start_ray(config)
    try:
        all_workers = [new_worker() for _ in range(max(config.workers))]
        ray.get([w.f.remote(b"") for w in all_workers])
        results = measure_all(config, found, all_workers)
    finally:
        ray.shutdown()
    meta["seconds"] = round(time.perf_counter() - started, 1)
    return {"meta": meta, **results, "skipped": skipped}


def measure_all(config: Config, found: list[Payload], all_workers: list[Any]) -> dict[str, Any]:
    monitor = StoreMonitor()
    cold_payload = next(p for p in found if p.kind == "float64" and p.nbytes == config.cold_size)
    cold_value = cold_payload.make()
    log(f"cold: {cold_payload.label}, N={config.cold_n}")
    cold = measure_cold(Case(cold_payload, cold_value, all_workers[: config.cold_n]))
    largest = max(found, key=lambda p: p.nbytes)
    warm_seconds = warm_store(all_workers, config.store_bytes, largest.make())
    idle_seconds = monitor.wait_until_idle()  # the warm-up's objects are freed asynchronously
    log(f"store warmed in {warm_seconds:.1f} s, idle {idle_seconds:.1f} s later")

    cases, yardsticks = [], []
    for payload in found:
        value = cold_value if payload is cold_payload else payload.make()
        log(f"{payload.label}: yardsticks")
        yardsticks.append(
            {
                "payload": payload.label,
                "kind": payload.kind,
                "nbytes": payload.nbytes,
                "times": time_yardsticks(value, max(3 * config.reps, 5)),
            }
        )
        for n in config.workers:
            log(f"{payload.label}: N={n}")
            case = Case(payload, value, all_workers[:n])
            times, counts = time_case(case, config.reps)
            held = None
            if payload.nbytes >= config.memory_min_bytes:
                held = measure_in_flight(case, monitor, config.hold_s)
            case.reset()
            cases.append(
                {
                    "payload": payload.label,
                    "kind": payload.kind,
                    "nbytes": payload.nbytes,
                    "n": n,
                    "times": times,
                    "refshare_counts": counts,
                    "store_in_flight": held,
                }
            )
        del value
    log("small-argument overhead")
    small = time_small_args(all_workers, config.small_reps)
    return {
        "config": asdict(config),
        "cold": {
            "payload": cold_payload.label,
            "nbytes": cold_payload.nbytes,
            "n": config.cold_n,
            "times": cold,
        },
        "warmup_seconds": warm_seconds,
        "cases": cases,
        "yardsticks": yardsticks,
        "small_args": {"n": len(all_workers), "args": repr(SMALL_ARGS), "times": small},
    }


# -- analysis -------------------------------------------------------------------------------


def case_ratios(times: dict[str, list[float]]) -> dict[str, float]:
    return {label: median(times[a]) / median(times[b]) for label, a, b in RATIOS}


def find_case(results: dict[str, Any], payload: str, n: int) -> dict[str, Any] | None:
    return next((c for c in results["cases"] if c["payload"] == payload and c["n"] == n), None)


def crossover(results: dict[str, Any], strategy: str, n: int) -> dict[str, int | None]:
    """The smallest float64 size from which ``strategy`` beats by value at every larger size.

    ``faster_from`` is None when it never does; ``not_faster_at`` is the next smaller
    size measured (None when it wins at the smallest size too).
    """
    sweep = sorted(
        (c for c in results["cases"] if c["kind"] == "float64" and c["n"] == n),
        key=lambda c: c["nbytes"],
    )
    faster_from: int | None = None
    not_faster_at: int | None = None
    for case in reversed(sweep):
        if median(case["times"][strategy]) < median(case["times"]["by_value"]):
            faster_from = case["nbytes"]
        else:
            not_faster_at = case["nbytes"]
            break
    return {"faster_from": faster_from, "not_faster_at": not_faster_at}


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """The target checks and crossovers, as stored in the JSON and printed in the summary."""
    target_case = find_case(results, TARGET_PAYLOAD, TARGET_N)
    ratios = case_ratios(target_case["times"]) if target_case else {}
    targets = []
    for label, kind, bound in TARGETS:
        value = ratios.get(label)
        passed = None if value is None else (value >= bound if kind == "min" else value <= bound)
        targets.append(
            {"ratio": label, "value": value, "kind": kind, "bound": bound, "pass": passed}
        )
    fingerprint = next((y for y in results["yardsticks"] if y["payload"] == TARGET_PAYLOAD), None)
    fp_speed = (
        median(fingerprint["times"]["xxh3_128"]) / median(fingerprint["times"]["fingerprint"])
        if fingerprint
        else None
    )
    small = results["small_args"]["times"]
    small_ratio = median(small["decorated"]["fan_out"]) / median(small["undecorated"]["fan_out"])
    others = [
        {
            "ratio": "fingerprint speed / bare xxh3_128",
            "value": fp_speed,
            "kind": "min",
            "bound": FINGERPRINT_TARGET,
            "pass": None if fp_speed is None else fp_speed >= FINGERPRINT_TARGET,
        },
        {
            "ratio": "reuse / ideal (reuse_fingerprints=True, 64 MiB, N=4)",
            "value": ratios.get("reuse / ideal"),
            "kind": "max",
            "bound": TARGETS[2][2],
            "pass": None if not ratios else ratios["reuse / ideal"] <= TARGETS[2][2],
        },
        {
            "ratio": "small args: decorated / undecorated fan-out",
            "value": small_ratio,
            "kind": "max",
            "bound": SMALL_ARGS_TARGET,
            "pass": small_ratio <= SMALL_ARGS_TARGET,
        },
    ]
    breakdown = None
    if target_case and fingerprint:
        breakdown = {
            name: median(target_case["times"][name]) for name in ("refshare_repeat", "ideal")
        } | {name: median(fingerprint["times"][name]) for name in ("fingerprint", "xxh3_128")}
    workers = results["config"]["workers"]
    return {
        "targets": targets,
        "other_targets": others,
        "breakdown": breakdown,
        "crossover": {
            strategy: {str(n): crossover(results, strategy, n) for n in workers}
            for strategy in ("refshare_repeat", "refshare_first")
        },
    }


# -- report ---------------------------------------------------------------------------------


def spread(values: Sequence[float]) -> str:
    """``median (min-max)`` in milliseconds."""
    return f"{ms(median(values))} ({ms(min(values))}{DASH}{ms(max(values))})"


def held_cell(held: dict[str, float] | None, name: str, nbytes: int) -> str:
    """Store bytes held in flight, in MiB and in copies of the payload."""
    if held is None:
        return "-"
    mib = held[name] / MiB
    return f"{mib:.{0 if mib >= 10 else 2}f} MiB ({held[name] / nbytes:.1f}{TIMES})"


def summary_lines(summary: dict[str, Any]) -> list[str]:
    def verdict(entry: dict[str, Any]) -> list[str]:
        sign = ">=" if entry["kind"] == "min" else "<="
        value = "n/a" if entry["value"] is None else f"{entry['value']:.2f}{TIMES}"
        result = {True: "PASS", False: "FAIL", None: "not measured"}[entry["pass"]]
        return [entry["ratio"], value, f"{sign} {entry['bound']:g}{TIMES}", result]

    lines = [f"## Summary: {TARGET_PAYLOAD} float64, N={TARGET_N}, warm store", ""]
    lines += table(
        ["ratio", "measured", "target", "result"], [verdict(t) for t in summary["targets"]]
    )
    lines += ["", "Other targets (fingerprint at 64 MiB; small arguments under min_bytes):", ""]
    lines += table(
        ["ratio", "measured", "target", "result"], [verdict(t) for t in summary["other_targets"]]
    )
    if summary["breakdown"]:
        b = summary["breakdown"]
        lines += [
            "",
            f"Where the repeat call's time goes: refshare repeat {ms(b['refshare_repeat'])} ms "
            f"- ideal {ms(b['ideal'])} ms = {ms(b['refshare_repeat'] - b['ideal'])} ms over "
            f"dispatch; refshare.fingerprint of the payload alone takes "
            f"{ms(b['fingerprint'])} ms (bare 1-thread xxh3_128: {ms(b['xxh3_128'])} ms).",
        ]
    lines += ["", "Crossover (float64 sweep, medians; refshare with min_bytes=0):", ""]
    for strategy, per_n in summary["crossover"].items():
        for n, found in per_n.items():
            lines.append(f"- {STRATEGIES[strategy]} vs by value, N={n}: {crossover_text(found)}")
    return lines


def crossover_text(found: dict[str, int | None]) -> str:
    if found["faster_from"] is None:
        return "not faster at any size measured"
    text = f"faster from {size_label(found['faster_from'])} up"
    if found["not_faster_at"] is None:
        return text + " (every size measured)"
    return text + f"; not faster at {size_label(found['not_faster_at'])}"


def report(results: dict[str, Any], summary: dict[str, Any]) -> str:
    """fanout.md."""
    meta, config = results["meta"], results["config"]
    versions = ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
    lines = [
        "# refshare fan-out benchmark",
        "",
        f"Command: `{meta['command']}` ({config['mode']} mode, {meta['date']}, "
        f"{meta['seconds']} s)",
        "",
        f"Machine: {meta['cpu']}, {meta['cores']} cores; {meta['platform']}; {versions}.",
        "",
        f"Revision: `{meta['git']['head'] or 'unknown'}`.",
        "",
        f"Ray: one local session, `ray.init(num_cpus=2, object_store_memory="
        f"{size_label(config['store_bytes'])})`, actors with num_cpus=0.1; "
        f"{config['reps']} repetitions per case, strategies interleaved round-robin; "
        f"store warmed before timing ({results['warmup_seconds']:.1f} s).",
        "",
    ]
    if results["skipped"]:
        lines += ["Skipped: " + "; ".join(results["skipped"]) + ".", ""]
    lines += summary_lines(summary)
    lines += ["", *times_section(results), "", *memory_section(results), ""]
    lines += [*yardstick_section(results), "", *cold_section(results), ""]
    lines += [*small_args_section(results), "", *notes()]
    return "\n".join(lines) + "\n"


def times_section(results: dict[str, Any]) -> list[str]:
    header = [
        "payload",
        "N",
        *STRATEGIES.values(),
        *(label for label, _, _ in RATIOS),
        "store in flight: by value",
        "store in flight: refshare repeat",
    ]
    rows = []
    for case in results["cases"]:
        times, held = case["times"], case["store_in_flight"]
        ratios = case_ratios(times)
        rows.append(
            [
                case["payload"],
                str(case["n"]),
                *(spread(times[name]) for name in STRATEGIES),
                *(f"{ratios[label]:.2f}" for label, _, _ in RATIOS),
                held_cell(held, "by_value", case["nbytes"]),
                held_cell(held, "refshare_repeat", case["nbytes"]),
            ]
        )
    return [
        "## Fan-out times, warm store",
        "",
        f"Milliseconds per fan-out: median ({'min' + DASH + 'max'}). Ratios of medians.",
        "",
        *table(header, rows),
    ]


def memory_section(results: dict[str, Any]) -> list[str]:
    rows = [
        [
            case["payload"],
            str(case["n"]),
            *(held_cell(case["store_in_flight"], name, case["nbytes"]) for name in STRATEGIES),
        ]
        for case in results["cases"]
        if case["store_in_flight"] is not None
    ]
    return [
        "## Object store held while tasks are in flight",
        "",
        "Peak store usage above the idle level while every worker holds its argument "
        f"({results['config']['hold_s']} s), in MiB and in copies of the payload.",
        "",
        *table(["payload", "N", *STRATEGIES.values()], rows),
    ]


def yardstick_section(results: dict[str, Any]) -> list[str]:
    rows = []
    for entry in results["yardsticks"]:
        times = entry["times"]
        gbs = entry["nbytes"] / median(times["xxh3_128"]) / 1e9
        speed = median(times["xxh3_128"]) / median(times["fingerprint"])
        rows.append(
            [
                entry["payload"],
                *(spread(times[name]) for name in YARDSTICKS),
                f"{gbs:.1f}",
                f"{speed:.2f}",
            ]
        )
    header = ["payload", *YARDSTICKS.values(), "xxh3_128 GB/s", "fingerprint speed / xxh3_128"]
    return [
        "## Hashing and copying yardsticks (driver only)",
        "",
        "Milliseconds: median (min" + DASH + "max).",
        "",
        *table(header, rows),
    ]


def cold_section(results: dict[str, Any]) -> list[str]:
    cold = results["cold"]
    warm = find_case(results, cold["payload"], cold["n"])
    rows = [
        [label, ms(cold["times"][name]), spread(warm["times"][name]) if warm else "-"]
        for name, label in STRATEGIES.items()
    ]
    return [
        f"## Cold store: {cold['payload']}, N={cold['n']}",
        "",
        "One call each before the store was warmed, in the order per-call put, refshare "
        "first, refshare repeat, refshare reuse, ideal, by value; earlier objects kept alive "
        "so each allocation landed on fresh pages. Milliseconds.",
        "",
        *table(["strategy", "cold", "warm median (min" + DASH + "max)"], rows),
    ]


def small_args_section(results: dict[str, Any]) -> list[str]:
    small = results["small_args"]
    times = small["times"]
    rows = []
    for name in ("undecorated", "decorated"):
        rows.append(
            [name, spread(times[name]["fan_out"]), f"{median(times[name]['per_remote']) * 1e6:.1f}"]
        )
    extra = (
        median(times["decorated"]["per_remote"]) - median(times["undecorated"]["per_remote"])
    ) * 1e6
    ratio = median(times["decorated"]["fan_out"]) / median(times["undecorated"]["fan_out"])
    return [
        "## Small arguments (under min_bytes): refshare's per-call overhead",
        "",
        f"N={small['n']} workers, args `{small['args']}`, default decorator options, "
        f"{len(times['decorated']['fan_out'])} fan-outs each, interleaved.",
        "",
        *table(
            [
                "variant",
                "fan-out ms: median (min" + DASH + "max)",
                "submit us per .remote() (median)",
            ],
            rows,
        ),
        "",
        f"Decorated / undecorated fan-out: {ratio:.3f}{TIMES}; "
        f"refshare adds {extra:.1f} us per .remote().",
    ]


def notes() -> list[str]:
    return [
        "## How it was measured",
        "",
        "- Each worker method returns `len(x)`: the argument is deserialized (zero-copy from "
        "the store for arrays) and nothing else is done with it.",
        "- refshare first: `refshare.clear()` (untimed) before each call, so the content is "
        "new to the cache. refshare repeat: an untimed call first, so the cache is warm.",
        "- refshare reuse: as refshare repeat, with `reuse_fingerprints=True`. The arrays "
        "are read-only (tensors are versioned), so their digests are kept across calls. "
        "The project's targets are on refshare repeat, the default.",
        "- ideal: one `ray.put` per case, before timing; the timed call only dispatches.",
        "- Store in flight: `ray.available_resources()['object_store_memory']`, sampled "
        "every 20 ms while workers sleep with their argument; the raylet reports it about "
        "every 100 ms.",
        "- The store is warmed by filling 90% of it with objects alive at once, having "
        "every worker read a byte of each page, then two by-value fan-outs of the largest "
        "payload.",
    ]


def plot(results: dict[str, Any], path: Path) -> None:
    """fanout.png: log-log time against size, one line per strategy, one panel per N."""
    plt = bench.pyplot()
    workers = results["config"]["workers"]
    cols = min(2, len(workers))
    rows = -(-len(workers) // cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(6 * cols, 4.2 * rows + 1), sharex=True, sharey=True, squeeze=False
    )
    yard = sorted(
        (y for y in results["yardsticks"] if y["kind"] == "float64"), key=lambda y: y["nbytes"]
    )
    for ax, n in zip(axes.flat, workers, strict=False):
        sweep = sorted(
            (c for c in results["cases"] if c["kind"] == "float64" and c["n"] == n),
            key=lambda c: c["nbytes"],
        )
        sizes = [c["nbytes"] for c in sweep]
        for name, label in STRATEGIES.items():
            med = [median(c["times"][name]) * 1e3 for c in sweep]
            lo = [min(c["times"][name]) * 1e3 for c in sweep]
            hi = [max(c["times"][name]) * 1e3 for c in sweep]
            (line,) = ax.plot(sizes, med, marker="o", markersize=3, label=label)
            ax.fill_between(sizes, lo, hi, color=line.get_color(), alpha=0.15)
            for case in results["cases"]:
                if case["kind"] != "float64" and case["n"] == n:
                    ax.plot(
                        case["nbytes"],
                        median(case["times"][name]) * 1e3,
                        marker="D",
                        fillstyle="none",
                        color=line.get_color(),
                    )
        for name, style in (("xxh3_128", ":"), ("memcpy", "--")):
            ax.plot(
                [y["nbytes"] for y in yard],
                [median(y["times"][name]) * 1e3 for y in yard],
                style,
                color="gray",
                label=YARDSTICKS[name],
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"N = {n}")
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("argument size (bytes)")
    for ax in axes[:, 0]:
        ax.set_ylabel("ms per fan-out")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize="small")
    fig.suptitle(
        f"refshare fan-out ({results['config']['mode']} mode): median, min-max band; "
        "diamonds: dict and tensor payloads"
    )
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(results: dict[str, Any], out: Path) -> None:
    summary = summarize(results)
    results["summary"] = summary
    cannot_plot = bench.cannot_plot("fanout.png")
    if cannot_plot:
        results["skipped"].append(cannot_plot)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fanout.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "fanout.md").write_text(report(results, summary))
    if not cannot_plot:
        plot(results, out / "fanout.png")


# -- profile --------------------------------------------------------------------------------


def profile(out: Path, calls: int = 100) -> None:
    """Profile fan-outs at 64 MiB, N=4 with pyinstrument: refshare repeat, and refshare
    reuse and ideal for comparison, interleaved call by call as in the benchmark (each
    strategy's profiler accumulates its own calls). Writes ``profile.txt``."""
    from pyinstrument import Profiler

    config = MODES["quick"]
    names = ("refshare_repeat", "refshare_reuse", "ideal")
    start_ray(config)
    try:
        workers = [new_worker() for _ in range(TARGET_N)]
        value = _random_array(64 * MiB, seed=1)
        warm_store(workers, config.store_bytes, value)
        case = Case(Payload(TARGET_PAYLOAD, "float64", 64 * MiB, lambda: value), value, workers)
        profilers = {name: Profiler(interval=0.0002) for name in names}
        seconds: dict[str, list[float]] = {name: [] for name in names}
        for rep in range(calls):
            for name in rotated(names, rep):
                prepare, call = PLANS[name]
                prepare(case)
                profilers[name].start()
                start = time.perf_counter()
                call(case, 0.0)
                seconds[name].append(time.perf_counter() - start)
                profilers[name].stop()
    finally:
        ray.shutdown()
    sections = [
        f"=== {calls} {STRATEGIES[name]} calls, 64 MiB, N=4, interleaved: median "
        f"{ms(median(seconds[name]))} ms each (under the profiler)\n"
        + profilers[name].output_text(unicode=False, color=False)
        for name in names
    ]
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.txt").write_text("\n".join(sections))
    print("\n".join(sections))


# -- command line ---------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    modes = {
        "quick": "about a minute",
        "smoke": "seconds: tiny sizes, N=1,2",
        "profile": "pyinstrument of refshare repeat, reuse and ideal calls at 64 MiB, N=4",
    }
    args = bench.parser(__doc__ or "", modes).parse_args(argv)
    if args.profile:
        profile(args.out)
        return 0
    config = MODES[bench.mode(args)]
    results = run(config)
    write_results(results, args.out)
    log(f"wrote {args.out / 'fanout.md'}, fanout.json, fanout.png")
    print((args.out / "fanout.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
