"""Fan-out benchmark: what sending one large argument to N Ray actors costs, by strategy.

Each measured call is ``ray.get([w.f.remote(x) for w in workers])`` with ``x`` sent as:

* **by value**: plain Ray, which serializes ``x`` into the object store once per call;
* **per-call put**: hand-written ``r = ray.put(x)`` then ``r`` to every worker, every call;
* **refshare first**: the fan-out decorated with ``@refshare.shared_args``, cache emptied
  before the call, so ``x`` is hashed and put (a first call with new content);
* **refshare repeat**: the same call again with the cache warm: ``x`` is hashed, found,
  and its existing ref is sent;
* **refshare reuse**: a repeat call with ``reuse_fingerprints=True``, which skips hashing
  tensors on memory torch allocated that refshare can tell are unchanged: the opt-in fast
  path, measured beside the default. NumPy arrays, read-only ones too, are hashed on every
  call either way, so on the float64 and dict payloads this is a repeat; its target is
  taken on the bf16 tensor, against its own floor (see ``measure_reuse_floor``);
* **ideal**: a ref put once before timing and reused: what dispatch alone costs.

The workers do no work with ``x``, so transport is what is measured. Yardsticks per
payload: a bare single-thread ``xxhash.xxh3_128`` and a memcpy (``np.copyto``) of the same
bytes, and ``refshare.fingerprint(x)`` itself. Also measured: the object-store bytes held
while the tasks are in flight, a cold first call before the store is warmed, and the
per-``.remote()`` overhead refshare adds to small arguments.

Everything runs in one process and one local Ray session; strategies are interleaved
round-robin within each repetition. Results go to ``fanout.md`` (tables and target
checks, see ``_fanout_report.py``), ``fanout.json`` (raw times) and ``fanout.png`` (log-log
plot) in ``--out``.

    python benchmarks/fanout.py            # full run (about 4 minutes on 2 cores)
    python benchmarks/fanout.py --quick    # about a minute
    python benchmarks/fanout.py --smoke    # seconds: for the test suite
    python benchmarks/fanout.py --profile  # pyinstrument of refshare repeat calls
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import _fanout_report
import numpy as np
import ray
import xxhash
from _fanout_report import TARGET_BYTES, TARGET_N
from _harness import options, report, session
from _harness.report import TIMES, GiB, KiB, MiB, log, ms, size_label
from _harness.stats import median, rotated

import refshare

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


FULL_SIZES = (10 * KiB, 32 * KiB, 100 * KiB, 320 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB)
MODES: dict[str, Config] = {
    "full": Config("full", (*FULL_SIZES, 256 * MiB), (1, 2, 4, 8), 9, 4 * GiB,
                   4, 64 * MiB, 64 * MiB, 64 * MiB, 4, MiB, 0.4, 400),
    "quick": Config("quick", (10 * KiB, 100 * KiB, MiB, 16 * MiB, 64 * MiB), (1, 2, 4, 8), 5, GiB,
                    4, 64 * MiB, 16 * MiB, 64 * MiB, 4, 64 * MiB, 0.25, 200),
    "smoke": Config("smoke", (10 * KiB, 256 * KiB), (1, 2), 2, 128 * MiB,
                    4, 256 * KiB, 256 * KiB, 256 * KiB, 2, 256 * KiB, 0.15, 10),
}  # fmt: skip


# -- payloads -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Payload:
    """One argument to fan out."""

    label: str
    kind: str  # "float64", "dict" or "bf16 tensor"
    nbytes: int
    make: Callable[[], Any]


def _random_array(nbytes: int, seed: int) -> np.ndarray:
    """Random float64s, read-only (which ``reuse_fingerprints`` does not trust: see above)."""
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
    dict_label = f"dict {config.dict_arrays}{TIMES}{per}"
    make_dict = functools.partial(_random_dict, config.dict_arrays, config.dict_bytes)
    found.append(Payload(dict_label, "dict", config.dict_bytes, make_dict))
    if importlib.util.find_spec("torch") is None:
        return found, ["bf16 tensor: torch is not importable"]
    tensor_label = f"bf16 tensor {size_label(config.tensor_bytes)}"
    make_tensor = functools.partial(_random_tensor, config.tensor_bytes)
    return [*found, Payload(tensor_label, "bf16 tensor", config.tensor_bytes, make_tensor)], []


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
        return session.touch(x)

    def small(self, *args: Any) -> int:
        return len(args)


def fan_out(workers: Sequence[Any], x: Any, hold_s: float = 0.0) -> list[int]:
    """Send ``x`` to every worker and wait for all of them."""
    if hold_s:
        return ray.get([w.hold.remote(x, hold_s) for w in workers])
    return ray.get([w.f.remote(x) for w in workers])


#: The same fan-out with refshare. ``min_bytes=0`` shares every payload, so the size sweep
#: shows where sharing stops paying (the crossover that calibrates the default min_bytes).
shared_fan_out = refshare.shared_args(min_bytes=0)(fan_out)
#: The opt-in identity fast path: unchanged tensors torch allocated are not rehashed.
reuse_fan_out = refshare.shared_args(min_bytes=0, reuse_fingerprints=True)(fan_out)


def submit_small(workers: Sequence[Any], *args: Any) -> tuple[list[Any], float]:
    """Submit ``args`` to every worker; return the refs and the time the submits took."""
    start = time.perf_counter()
    refs = [w.small.remote(*args) for w in workers]
    return refs, time.perf_counter() - start


#: With the default options: every small argument stays under min_bytes.
shared_submit_small = refshare.shared_args(submit_small)


# -- strategies: an untimed preparation, then the timed call ----------------------------------


class Case:
    """One payload fanned out to one set of workers, with the ideal strategy's ref."""

    def __init__(self, payload: Payload, value: Any, workers: Sequence[Any]) -> None:
        self.payload, self.value, self.workers = payload, value, workers
        self.ideal_ref: Any = None

    def reset(self) -> None:
        """Drop every copy of the value this case made in the object store."""
        refshare.clear()
        self.ideal_ref = None

    def check(self, results: list[int]) -> None:
        expected = [len(self.value)] * len(self.workers)
        if results != expected:
            raise RuntimeError(f"{self.payload.label}: workers returned {results}, not {expected}")


def _put_ideal(case: Case) -> None:
    if case.ideal_ref is None:
        case.ideal_ref = ray.put(case.value)


Prepare = Callable[[Case], Any]
Call = Callable[[Case, float], list[int]]
#: name -> (untimed preparation, timed call), in table order.
PLANS: dict[str, tuple[Prepare, Call]] = {
    "by_value": (lambda case: None, lambda case, hold: fan_out(case.workers, case.value, hold)),
    "per_call_put": (
        lambda case: None,
        lambda case, hold: fan_out(case.workers, ray.put(case.value), hold),
    ),
    "refshare_first": (
        lambda case: refshare.clear(),
        lambda case, hold: shared_fan_out(case.workers, case.value, hold),
    ),
    "refshare_repeat": (
        lambda case: shared_fan_out(case.workers, case.value),
        lambda case, hold: shared_fan_out(case.workers, case.value, hold),
    ),
    "refshare_reuse": (
        lambda case: reuse_fan_out(case.workers, case.value),
        lambda case, hold: reuse_fan_out(case.workers, case.value, hold),
    ),
    "ideal": (_put_ideal, lambda case, hold: fan_out(case.workers, case.ideal_ref, hold)),
}
STRATEGIES = tuple(PLANS)
#: The strategies that go through refshare, whose puts and hits are counted.
SHARED = ("refshare_first", "refshare_repeat", "refshare_reuse")


# -- measuring ------------------------------------------------------------------------------


def time_case(case: Case, reps: int) -> tuple[dict[str, list[float]], dict[str, dict[str, int]]]:
    """Time every strategy ``reps`` times, interleaved; also count what refshare did.

    An untimed round comes first: first calls pay one-time costs (a worker importing torch
    to deserialize a tensor, say) that are not transport.
    """
    for prepare, call in PLANS.values():
        prepare(case)
        case.check(call(case, 0.0))
    times: dict[str, list[float]] = {name: [] for name in STRATEGIES}
    counts = {name: {"puts": 0, "hits": 0} for name in SHARED}
    for rep in range(reps):
        for name in rotated(STRATEGIES, rep):
            prepare, call = PLANS[name]
            prepare(case)
            before = refshare.stats()
            start = time.perf_counter()
            results = call(case, 0.0)
            times[name].append(time.perf_counter() - start)
            after = refshare.stats()
            case.check(results)
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
    case.check(fan_out(workers, kept))
    times["per_call_put"] = time.perf_counter() - start
    refshare.clear()
    for name, fn in (
        ("refshare_first", shared_fan_out),
        ("refshare_repeat", shared_fan_out),
        ("refshare_reuse", reuse_fan_out),
    ):
        start = time.perf_counter()
        case.check(fn(workers, value))
        times[name] = time.perf_counter() - start
    case.ideal_ref = ray.put(value)
    for name, x in (("ideal", case.ideal_ref), ("by_value", value)):
        start = time.perf_counter()
        case.check(fan_out(workers, x))
        times[name] = time.perf_counter() - start
    del kept
    case.reset()
    return {name: times[name] for name in STRATEGIES}


def measure_reuse_floor(case: Case, reps: int) -> dict[str, list[float]]:
    """The reuse fast path against its own floor: the same fan-out of a ref to refshare's
    stored form of the tensor, put beforehand (``refshare.share``), which the worker
    rebuilds as it does a shared argument. The ideal is no floor for a tensor: Ray pickles
    it through torch, whose unpickling on the worker costs more than refshare's bytes. An
    untimed round first, then both interleaved."""
    floor_ref = refshare.share(case.value)
    calls: dict[str, Callable[[], list[int]]] = {
        "refshare_reuse": lambda: reuse_fan_out(case.workers, case.value),
        "floor": lambda: fan_out(case.workers, floor_ref),
    }
    for call in calls.values():
        case.check(call())
    times: dict[str, list[float]] = {name: [] for name in calls}
    for rep in range(reps):
        for name in rotated(list(calls), rep):
            start = time.perf_counter()
            results = calls[name]()
            times[name].append(time.perf_counter() - start)
            case.check(results)
    case.reset()
    return times


def measure_in_flight(case: Case, monitor: session.StoreMonitor, hold_s: float) -> dict[str, float]:
    """Object-store bytes each strategy holds while its tasks are in flight."""
    held: dict[str, float] = {}
    for name, (prepare, call) in PLANS.items():
        case.reset()
        base = monitor.settled(max(0.15, hold_s / 2))
        prepare(case)
        peak = monitor.peak_during(lambda call=call: case.check(call(case, hold_s)))
        held[name] = max(0.0, peak - base)
    case.reset()
    return held


def warm_store(workers: Sequence[Any], store_bytes: int, value: Any) -> float:
    """Warm the object store and every worker's mapping of it (``session.warm_store``), then
    make two by-value fan-outs of ``value``. Returns the seconds it took."""
    start = time.perf_counter()
    session.warm_store(workers, store_bytes)
    for _ in range(2):
        fan_out(workers, value)
    return time.perf_counter() - start


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


def run(config: Config) -> dict[str, Any]:
    """Run every measurement of ``config``; return the raw results."""
    found, skipped = payloads(config)
    ray_init = {"num_cpus": 2, "object_store_memory": config.store_bytes, "actor_num_cpus": 0.1}
    meta = report.machine("fanout.py", ray_init=ray_init)  # before measuring: what was imported
    started = time.perf_counter()
    session.start_ray(config.store_bytes)
    try:
        workers = [Worker.remote() for _ in range(max(config.workers))]  # type: ignore[attr-defined]
        ray.get([w.f.remote(b"") for w in workers])
        results = measure_all(config, found, workers)
    finally:
        ray.shutdown()
    report.finished(meta, started)
    return {"meta": meta, **results, "skipped": skipped}


def measure_all(config: Config, found: list[Payload], all_workers: list[Any]) -> dict[str, Any]:
    monitor = session.StoreMonitor()
    cold_payload = next(p for p in found if p.kind == "float64" and p.nbytes == config.cold_size)
    cold_value = cold_payload.make()
    log(f"cold: {cold_payload.label}, N={config.cold_n}")
    cold = measure_cold(Case(cold_payload, cold_value, all_workers[: config.cold_n]))
    largest = max(found, key=lambda p: p.nbytes)
    warm_seconds = warm_store(all_workers, config.store_bytes, largest.make())
    idle_seconds = monitor.wait_until_idle()  # the warm-up's objects are freed asynchronously
    log(f"store warmed in {warm_seconds:.1f} s, idle {idle_seconds:.1f} s later")

    cases, yardsticks, reuse_floor = [], [], None
    for payload in found:
        value = cold_value if payload is cold_payload else payload.make()
        about = {"payload": payload.label, "kind": payload.kind, "nbytes": payload.nbytes}
        log(f"{payload.label}: yardsticks")
        yardsticks.append({**about, "times": time_yardsticks(value, max(3 * config.reps, 5))})
        for n in config.workers:
            log(f"{payload.label}: N={n}")
            case = Case(payload, value, all_workers[:n])
            times, counts = time_case(case, config.reps)
            held = None
            if payload.nbytes >= config.memory_min_bytes:
                held = measure_in_flight(case, monitor, config.hold_s)
            case.reset()
            cases.append({**about, "n": n, "times": times, "refshare_counts": counts,
                          "store_in_flight": held})  # fmt: skip
        if payload.kind == "bf16 tensor":
            n = min(TARGET_N, len(all_workers))
            log(f"{payload.label}: reuse against its floor, N={n}")
            floor_case = Case(payload, value, all_workers[:n])
            reuse_floor = {**about, "n": n, "times": measure_reuse_floor(floor_case, config.reps)}
        del value
    log("small-argument overhead")
    small = time_small_args(all_workers, config.small_reps)
    cold_about = {"payload": cold_payload.label, "nbytes": cold_payload.nbytes}
    return {
        "config": asdict(config),
        "cold": {**cold_about, "n": config.cold_n, "times": cold},
        "warmup_seconds": warm_seconds,
        "cases": cases,
        "yardsticks": yardsticks,
        "reuse_floor": reuse_floor,
        "small_args": {"n": len(all_workers), "args": repr(SMALL_ARGS), "times": small},
    }


def profile(out: Path, calls: int = 100) -> None:
    """Profile fan-outs at 64 MiB, N=4 with pyinstrument: refshare repeat, and refshare
    reuse and ideal for comparison, interleaved call by call as in the benchmark (each
    strategy's profiler accumulates its own calls). Writes ``profile.txt``."""
    from pyinstrument import Profiler

    config = MODES["quick"]
    names = ("refshare_repeat", "refshare_reuse", "ideal")
    session.start_ray(config.store_bytes)
    try:
        workers = [Worker.remote() for _ in range(TARGET_N)]  # type: ignore[attr-defined]
        value = _random_array(TARGET_BYTES, seed=1)
        warm_store(workers, config.store_bytes, value)
        label = size_label(TARGET_BYTES)
        case = Case(Payload(label, "float64", TARGET_BYTES, lambda: value), value, workers)
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
        f"=== {calls} {_fanout_report.LABELS[name]} calls, 64 MiB, N=4, interleaved: median "
        f"{ms(median(seconds[name]))} ms each (under the profiler)\n"
        + profilers[name].output_text(unicode=False, color=False)
        for name in names
    ]
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.txt").write_text("\n".join(sections))
    print("\n".join(sections))


def main(argv: Sequence[str] | None = None) -> int:
    modes = {
        "quick": "about a minute",
        "smoke": "seconds: tiny sizes, N=1,2",
        "profile": "pyinstrument of refshare repeat, reuse and ideal calls at 64 MiB, N=4",
    }
    args = options.parser(__doc__ or "", modes).parse_args(argv)
    if args.profile:
        profile(args.out)
        return 0
    results = run(MODES[options.mode(args)])
    written = _fanout_report.write(results, args.out)
    log(f"wrote {', '.join(str(args.out / name) for name in written)}")
    print((args.out / "fanout.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
