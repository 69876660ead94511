"""The type table: for each kind of value a program sends, what does refshare cost on first
sight (``share`` misses: hash and put) and on a repeat (``share`` of an equal copy hits: hash
only), next to a plain ``ray.put``, a fresh ``refshare.fingerprint`` and one bare ``xxh3_128``
pass over the value's raw bytes? Goals: miss <= max(1.15 x put, put + 1.3 x xxh3), hit <= 0.5
x put (0.8 for an object array of strings). Medians of interleaved repetitions, warm store,
each timing started with the value's memory out of the CPU's caches.

    python benchmarks/types.py [--quick | --smoke] [--reps N] [--out DIR] [--profile ROW]
"""

from __future__ import annotations

import collections
import copy
import cProfile
import dataclasses
import gc
import importlib.util
import logging
import pickle
import pstats
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import ray
import xxhash
from _harness import options, report, session, steps
from _harness.report import TIMES, KiB, MiB, log
from _harness.stats import median, rotated

import refshare

try:
    import torch
except ImportError:
    torch = None

MEASURES = ("put", "fingerprint", "xxh3", "miss", "hit")
HEADER = ["value", "sent MiB", "put ms", "fingerprint ms", "xxh3 ms (MiB)", "share miss ms"]
HEADER += ["share hit ms", "miss goal", "hit goal", "keyed by", "miss: puts", "hit: hits"]
LEGEND = (
    f"Goals: miss \u2264 max(1.15{TIMES} put, put + 1.3{TIMES} xxh3), hit \u2264 0.5{TIMES} put "
    f"(0.8{TIMES} for the object array of strings). *sent*: what Ray's serialization weighs. "
    "*xxh3*: one pass over each array's or tensor's own elements (or `pickle.dumps` of what is "
    "not an array), and the MiB hashed. *keyed by*: `walk` (without serializing) or `pickle` "
    "(by Ray's pickle, which a miss then puts). *miss: puts*: "
    "`refshare.stats().puts` added by each miss. *hit: hits*: 1 if every hit added one hit and "
    "returned the ref already cached."
)


@dataclasses.dataclass(frozen=True)
class Config:
    mode: str
    unit: int  # bytes of most rows
    reps: int
    store_bytes: int  # 90% of it is put and freed first: puts into untouched pages are slow
    list_items: tuple[int, int]  # the list row: this many arrays of this many bytes
    strings: int  # the object-array row
    text_bytes: int  # the str row


MODES = {
    "full": Config("full", 16 * MiB, 15, 2 << 30, (1000, 32 * KiB), 100_000, 16 * MiB),
    "quick": Config("quick", 4 * MiB, 9, 1 << 30, (1000, 8 * KiB), 30_000, 4 * MiB),
    "smoke": Config("smoke", 256 * KiB, 2, 256 * MiB, (100, 4 * KiB), 2000, 256 * KiB),
}


# -- the values -------------------------------------------------------------------------------


class BatchedDataDictLike(collections.UserDict):  # type: ignore[type-arg]
    """NeMo-RL's ``BatchedDataDict`` as it pickles: a ``UserDict`` with no pickling of its own."""


@dataclasses.dataclass
class Arrays:
    a: np.ndarray
    b: np.ndarray
    c: np.ndarray
    d: np.ndarray


# A program's own classes live in a module, which Ray pickles by reference; a script's are in
# __main__, which it pickles by value on every put. Name this module as a program would.
sys.modules.setdefault("types_benchmark", sys.modules[__name__])
Arrays.__module__ = BatchedDataDictLike.__module__ = "types_benchmark"


@dataclasses.dataclass
class Row:
    name: str
    value: Any
    copy: Any  # equal content, a new object: what the hit shares
    note: str = ""
    hit_limit: float = 0.5
    goals: bool = True  # False: a row that measures refshare's fixed cost per call


def twice(value: Any) -> tuple[Any, Any]:
    return value, copy.deepcopy(value)


def tensors(cols: int) -> dict[str, Any]:
    """An RL batch of 256 rows weighing [256, cols] float32: int64 ids and mask, float32."""
    return {
        "input_ids": torch.randint(0, 32000, (256, cols // 8)),
        "attention_mask": torch.ones(256, cols // 8, dtype=torch.int64),
        "old_log_probs": torch.randn(256, cols // 4),
        "values": torch.randn(256, cols // 4),
    }


def batch_classes() -> tuple[Any, str, Any, str]:
    """``BatchedDataDict`` and ``DataProto``, each the real one if importable, and which."""
    try:
        from nemo_rl.distributed.batched_data_dict import BatchedDataDict

        bdd, bdd_is = BatchedDataDict, "real nemo_rl BatchedDataDict"
    except ImportError:
        bdd, bdd_is = BatchedDataDictLike, "BatchedDataDictLike, a UserDict subclass (no nemo_rl)"
    try:
        import verl
        from verl.protocol import DataProto

        dp, dp_is = DataProto, f"real verl {verl.__version__} DataProto"
    except ImportError:
        steps.mirrors_importable()
        import verl_mirror as mirror

        dp, dp_is = mirror.DataProto, f"mirror of {mirror.MIRRORS} (batch: {mirror.BATCH_TYPE})"
    return bdd, bdd_is, dp, dp_is


def rows(cfg: Config) -> Iterator[Callable[[], Row]]:
    """One builder per row, so that one row's values are alive at a time."""
    rng, cols, (count, item) = np.random.default_rng(0), cfg.unit // 1024, cfg.list_items

    def floats(*shape: int) -> np.ndarray:
        return rng.random(shape, np.float32)

    def strided() -> Row:
        a = floats(256, 2 * cols)
        return Row("numpy view `a[:, ::2]`", a[:, ::2], a.copy()[:, ::2], "Ray sends a C copy")

    def strings() -> Row:
        value = np.array([f"uid-{i:08d}-{i * 7919 % 100_003}" for i in range(cfg.strings)], object)
        return Row("numpy object array of str", *twice(value), f"{cfg.strings:,} strings", 0.8)

    def text() -> Row:
        value = ("refshare" * (cfg.text_bytes // 8 + 1))[: cfg.text_bytes]
        return Row(f"str of {cfg.text_bytes / MiB:g} MiB", value, value[:1] + value[1:])

    yield lambda: Row("numpy float32, C order", *twice(floats(256, cols)))
    yield lambda: Row(
        "numpy float32, 16 KiB", *twice(floats(4096)), "below min_bytes: no goal", goals=False
    )
    yield lambda: Row(f"numpy float32, {4 * cfg.unit // MiB} MiB", *twice(floats(1024, cols)))
    yield lambda: Row("numpy float32, F order", *twice(np.asfortranarray(floats(256, cols))))
    yield strided
    yield lambda: Row(
        "list of numpy arrays",
        *twice([floats(item // 4) for _ in range(count)]),
        f"{count:,} arrays of {item // KiB} KiB",
    )
    yield strings
    yield text
    yield lambda: Row(
        "dataclass of 4 numpy arrays", *twice(Arrays(*[floats(256, cols // 4) for _ in range(4)]))
    )
    if torch is None:
        yield lambda: Row("torch and batch types", None, None, "skipped: torch is not installed")
        return
    yield lambda: Row("torch float32", *twice(torch.randn(256, cols)))
    yield lambda: Row("torch bfloat16", *twice(torch.randn(256, 2 * cols).bfloat16()))
    note = f"Ray sends the whole storage, 4{TIMES} the view"
    yield lambda: Row(
        "torch view `t[:64]` of [256, N]", *twice(torch.randn(256, 2 * cols)[:64]), note
    )

    def inference() -> Row:
        with torch.inference_mode():
            t = torch.randn(256, cols)
            return Row("torch, made in inference_mode", t, t.clone())

    yield inference
    yield lambda: Row(
        "dict of 8 torch tensors", *twice({f"t{i}": torch.randn(256, cols // 8) for i in range(8)})
    )
    bdd, bdd_is, dataproto, dp_is = batch_classes()
    yield lambda: Row("BatchedDataDict", *twice(bdd(tensors(cols))), bdd_is)
    if importlib.util.find_spec("tensordict") is None:
        yield lambda: Row("TensorDict", None, None, "skipped: tensordict is not installed")
    else:
        from tensordict import TensorDict

        def tensordict(piece: bool) -> Row:
            td, td2 = (TensorDict(batch, batch_size=[256]) for batch in twice(tensors(cols)))
            if piece:
                note = "a view: its tensors pickle their parents' whole storages"
                return Row("TensorDict `.chunk(4)[0]`", td.chunk(4)[0], td2.chunk(4)[0], note)
            same = refshare.fingerprint(td.clone()) == refshare.fingerprint(td)
            clone = "alike" if same else "apart: its attributes pickle in another order"
            note = f"the copy is made by the constructor; a `.clone()` is keyed {clone}"
            return Row("TensorDict", td, td2, note)

        yield lambda: tensordict(False)
        yield lambda: tensordict(True)

    def dataproto_row(piece: bool) -> Row:
        uids = np.array([f"uid-{i}" for i in range(256)], object)
        dp = dataproto.from_dict(tensors(cols), {"uid": uids}, {"step": 0, "temperature": 1.0})
        if piece:
            return Row("DataProto `.chunk(4)[0]`", dp.chunk(4)[0], twice(dp)[1].chunk(4)[0], dp_is)
        return Row("DataProto", *twice(dp), dp_is)

    yield lambda: dataproto_row(False)
    yield lambda: dataproto_row(True)
    yield lambda: training_input_row(cols)
    yield lambda: roll_dataproto_row(cols)


def roll_dataproto_row(cols: int) -> Row:
    """ROLL's ``DataProto``, the real one if importable, else the mirror of main 8eb27cc2 in
    ``tests/mirrors/roll_mirror.py`` under ROLL's module names (as refshare then finds it): the
    same tensors, uids beside them and ``meta_info``, pickled through ``torch.save``."""
    try:
        from roll.distributed.scheduler.protocol import DataProto

        cls, note = DataProto, "real ROLL DataProto"
    except ImportError:
        steps.mirrors_importable()
        import roll_mirror

        roll_mirror.publish_as_roll()
        cls = roll_mirror.DataProto
        note = "mirror of ROLL main 8eb27cc2 (tests/mirrors/roll_mirror.py)"
    uids = np.array([f"uid-{i}" for i in range(256)], object)

    def batch() -> Any:
        fields = {k: v.clone() for k, v in tensors(cols).items()}
        return cls.from_dict(fields, {"uid": uids.copy()}, {"global_step": 0})

    torch.manual_seed(0)
    first = batch()
    torch.manual_seed(0)
    return Row("ROLL DataProto", first, batch(), note)


def training_input_row(cols: int) -> Row:
    """SkyRL's ``TrainingInputBatch``, the real one if importable, else the mirror of 0.4.0
    in ``tests/mirrors/skyrl_mirror.py``: four fields and its metadata, pickled by its own
    ``__reduce__``."""
    try:
        from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch

        cls, note = TrainingInputBatch, "real skyrl TrainingInputBatch"
    except ImportError:
        steps.mirrors_importable()
        import skyrl_mirror

        cls = skyrl_mirror.TrainingInputBatch
        note = "mirror of SkyRL 0.4.0 (tests/mirrors/skyrl_mirror.py)"

    def batch() -> Any:
        made = cls({k: v.clone() for k, v in fields.items()})
        made.metadata = {"response_length": cols // 8, "uids": [f"uid-{i}" for i in range(256)]}
        return made

    fields = tensors(cols)
    return Row("SkyRL TrainingInputBatch", batch(), batch(), note)


# -- what a row weighs, and how refshare keys it ----------------------------------------------


def raw_buffers(v: Any, out: list[Any]) -> list[Any]:
    """Each array's or tensor's own elements as a C buffer (a copy if it is not contiguous, as
    Ray makes too), or a pickle of anything else."""
    if isinstance(v, np.ndarray) and not v.dtype.hasobject:
        out.append(np.ascontiguousarray(v.T if v.flags.f_contiguous else v).reshape(-1).view("u1"))
    elif torch is not None and isinstance(v, torch.Tensor):
        out.append(v.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    elif type(v).__module__.startswith("tensordict"):
        for t in v.values(include_nested=True, leaves_only=True):
            raw_buffers(t, out)
    elif isinstance(v, (list, tuple, dict, collections.UserDict)):
        for item in v.values() if hasattr(v, "values") else v:
            raw_buffers(item, out)
    elif dataclasses.is_dataclass(v):
        for field in dataclasses.fields(v):
            raw_buffers(getattr(v, field.name), out)
    else:
        out.append(pickle.dumps(v, protocol=5))
    return out


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class _OwnPickling:
    """A value whose pickling runs code of its own, which refshare keys by its pickle."""

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return _OwnPickling, ()


def keyed_by(v: Any) -> str:
    """How refshare keys ``v``: ``walk`` (without serializing it), ``pickle`` (by Ray's pickle
    of it), ``by value`` (not at all), or ``?`` if this refshare does not say."""
    if _keyed_by(_OwnPickling()) != "pickle":  # this refshare logs no such line
        return "?"
    return _keyed_by(v)


def _keyed_by(v: Any) -> str:
    # The public API tells only whether a value can be keyed; which way, refshare says in the
    # debug line it logs when it keys a value by its pickle.
    logger, records = logging.getLogger("refshare"), _Records()
    level = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.DEBUG)
    try:
        key = refshare.fingerprint(v)
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    if key is None:
        return "by value"
    return "pickle" if any("keyed by its pickle" in m for m in records.messages) else "walk"


def sent_bytes(v: Any) -> int:
    """What Ray's own serialization of ``v`` weighs: what ``ray.put`` stores."""
    context = ray._private.worker.global_worker.get_serialization_context()
    return int(context.serialize(v).total_bytes)


# -- measuring --------------------------------------------------------------------------------


def settle(timeout: float = 30.0) -> float:
    """Wait until the CPUs are 90% idle (Ray starts idle workers after ``ray.init``, which take
    seconds of CPU to import); returns the seconds waited."""
    start, stat = time.perf_counter(), Path("/proc/stat")
    while time.perf_counter() - start < timeout and stat.exists():
        before = [int(x) for x in stat.read_text().split()[1:9]]
        time.sleep(0.5)
        ticks = [int(x) - y for x, y in zip(stat.read_text().split()[1:9], before, strict=True)]
        if ticks[3] + ticks[4] >= 0.9 * sum(ticks):  # idle and iowait
            break
    return time.perf_counter() - start


#: Written over before each timing, so that every measure meets the value's memory as a program
#: does a large value it made a while ago: out of the CPU's caches (twice their size and more).
_SCRATCH = np.zeros(64 * MiB, dtype=np.uint8)


def timed(fn: Callable[[], Any], profiler: cProfile.Profile | None = None) -> tuple[float, Any]:
    _SCRATCH[:] += 1
    gc.disable()
    start = time.perf_counter()
    out = fn() if profiler is None else profiler.runcall(fn)
    seconds = time.perf_counter() - start
    gc.enable()
    return seconds, out


def shared(row: Row, what: str, profiler: cProfile.Profile | None = None) -> tuple[float, Any]:
    """Time one ``share`` miss of ``row.value`` or hit of ``row.copy``; what stats() counted."""
    refshare.clear()
    first = refshare.share(row.value) if what == "hit" else None  # the cache holds its ref
    before = refshare.stats()
    seconds, ref = timed(lambda: refshare.share(row.value if first is None else row.copy), profiler)
    after = refshare.stats()
    count = {k: getattr(after, k) - getattr(before, k) for k in ("puts", "hits", "by_value")}
    refshare.clear()
    return seconds, count if first is None else {**count, "same_ref": ref == first}


def measure(row: Row, reps: int) -> dict[str, Any]:
    """Interleaved repetitions of the five measurements, after one untimed repetition."""
    v, buffers = row.value, raw_buffers(row.value, [])
    times: dict[str, list[float]] = {m: [] for m in MEASURES}
    counts: dict[str, list[dict[str, Any]]] = {"miss": [], "hit": []}

    def count(what: str) -> float:
        seconds, counted = shared(row, what)
        counts[what].append(counted)
        return seconds

    run: dict[str, Callable[[], float]] = {
        "put": lambda: timed(lambda: ray.put(v))[0],
        "fingerprint": lambda: timed(lambda: refshare.fingerprint(v))[0],
        "xxh3": lambda: timed(lambda: [xxhash.xxh3_128_digest(b) for b in buffers])[0],
        "miss": lambda: count("miss"),
        "hit": lambda: count("hit"),
    }
    for rep in range(-1, reps):
        for name in rotated(MEASURES, max(rep, 0)):
            seconds = run[name]()
            if rep >= 0:
                times[name].append(seconds)
    counts = {what: found[1:] for what, found in counts.items()}  # the untimed repetition
    med = {m: median(times[m]) for m in MEASURES}
    ratios = {what: med[what] / med["put"] for what in ("miss", "hit")}
    limits = {"miss": max(1.15, 1 + 1.3 * med["xxh3"] / med["put"]), "hit": row.hit_limit}
    goals = {
        w: {"ratio": ratios[w], "limit": limits[w], "met": ratios[w] <= limits[w]} for w in limits
    }
    goals = goals if row.goals else {}
    result = {"name": row.name, "note": row.note, "keyed_by": keyed_by(v), "goals": goals}
    hashed = sum(memoryview(b).nbytes for b in buffers)
    result |= {"sent_bytes": sent_bytes(v), "hashed_bytes": hashed}
    return result | {"medians": med, "times": times, "stats": counts}


def profile(row: Row, reps: int) -> None:
    """Print cProfile's top functions over ``reps`` misses, then ``reps`` hits, of ``row``."""
    for what in ("miss", "hit"):
        profiler = cProfile.Profile()
        for _ in range(reps):
            shared(row, what, profiler)
        print(f"\n== {row.name}: {reps} x share, a {what} each; by own time ==")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(14)


# -- the report -------------------------------------------------------------------------------


def table_row(r: dict[str, Any]) -> list[str]:
    m, miss, hit = r["medians"], r["stats"]["miss"], r["stats"]["hit"]
    puts = "/".join(sorted({str(c["puts"]) for c in miss}))
    puts += ", by value" if any(c["by_value"] for c in miss) else ""
    hits = "1" if all(c["hits"] == 1 and c["same_ref"] for c in hit) else "NO"
    goals = [] if r["goals"] else ["-", "-"]
    for g in r["goals"].values():  # a third decimal where two would show the limit itself
        d = 3 if f"{g['ratio']:.2f}" == f"{g['limit']:.2f}" else 2
        verdict = "yes" if g["met"] else "NO"
        goals.append(f"{verdict} ({g['ratio']:.{d}f}{TIMES} put, limit {g['limit']:.{d}f}{TIMES})")
    cells = [r["name"], f"{r['sent_bytes'] / MiB:.1f}", *(report.ms(m[k]) for k in MEASURES)]
    cells[4] += f" ({r['hashed_bytes'] / MiB:.1f})"  # the MiB xxh3 hashed
    return [*cells, *goals, r["keyed_by"], puts, hits]


def rest(m: dict[str, float]) -> float:
    """A miss less its put and its fingerprint (medians): what else refshare does on the
    call, where what it puts is Ray's own put of the value (a numpy array)."""
    return m["miss"] - m["put"] - m["fingerprint"]


def misses_explained(done: list[dict[str, Any]]) -> list[str]:
    """Where the misses over their goal spend their time, read from the table's medians."""
    over = [r for r in done if r["goals"] and not r["goals"]["miss"]["met"]]
    if not over:
        return []
    floats = [
        r for r in done if r["name"].startswith("numpy float32,") and "F order" not in r["name"]
    ]
    big = max(floats, key=lambda r: r["hashed_bytes"])
    big_met = "meets" if big["goals"]["miss"]["met"] else "does not meet"
    fixed = ", ".join(
        f"{report.size_label(r['hashed_bytes'])} {report.ms(rest(r['medians']))} ms"
        for r in sorted(floats, key=lambda r: r["hashed_bytes"])
    )
    lines = [
        "## Where a miss over its goal spends its time",
        "",
        "A miss is a fingerprint, a put and the rest of refshare's work on the call. What the "
        "goal leaves beyond the put and one bare xxh3 pass is for the fingerprint's work beyond "
        "that pass and for the rest together; each row over its goal:",
        "",
    ]
    for r in over:
        m = r["medians"]
        limit = r["goals"]["miss"]["limit"] * m["put"]
        lines.append(
            f"- {r['name']}: {report.ms(m['miss'] - limit)} ms over; the goal leaves "
            f"{report.ms(limit - m['put'] - m['xxh3'])} ms; the fingerprint took "
            f"{report.ms(m['fingerprint'] - m['xxh3'])} ms beyond a bare pass, the rest "
            f"{report.ms(rest(m))} ms"
        )
    lines += [
        "",
        f"The rest is a cost per call, not per byte: for float32 arrays (whose put is Ray's own "
        f"put of the array) {fixed}. So is the fingerprint's work beyond a bare pass, its walk "
        "of the value's structure (a list's arrays, a dataclass's fields, a DataProto's batch "
        "and meta_info), "
        "save for a str, whose bytes Python hands out only as a UTF-8 copy. What the goal "
        "leaves grows with the value and is smaller than these fixed costs where a put is fast "
        "(a numpy array is one copy) and the value not large (the "
        f"{report.size_label(big['hashed_bytes'])} row {big_met} it). A "
        "profile of the rest (docs/performance.md): a few hundred Python calls (the scope, Ray's "
        "session, the cache's insert, the stored size read back from Ray, the ledger), each "
        "meeting code and data that the value's own pass has just pushed out of the CPU's "
        "caches, several times slower than the same calls run in a loop.",
        "",
    ]
    return lines


def markdown(results: dict[str, Any]) -> str:
    cfg, done = results["config"], [r for r in results["rows"] if "skipped" not in r]
    notes = [f"- {r['name']}: {r.get('skipped') or r['note']}" for r in results["rows"]]
    intro = (
        f"What refshare costs per kind of value: medians of {cfg['reps']} interleaved repetitions "
        f"on a warm object store, each timing started with the value's memory out of the CPU's "
        f"caches (as a program meets a large value it made a while ago), in milliseconds "
        f"({cfg['mode']} mode)."
    )
    lines = ["# refshare type table", "", intro, "", *report.machine_lines(results["meta"]), ""]
    lines += [*report.table(HEADER, [table_row(r) for r in done]), "", LEGEND, ""]
    lines += [*(n for n in notes if not n.endswith(": ")), ""]
    return "\n".join([*lines, *misses_explained(done)])


def main() -> None:
    parser = options.parser(
        __doc__ or "", {"quick": "smaller values", "smoke": "tiny values, 2 repetitions"}
    )
    parser.add_argument("--reps", type=int, help="repetitions (default: 15, --quick 9)")
    parser.add_argument("--profile", metavar="ROW", help="cProfile rows whose name has ROW")
    args = parser.parse_args()
    cfg = MODES[options.mode(args)]
    cfg = dataclasses.replace(cfg, reps=args.reps or cfg.reps)
    start = time.perf_counter()
    session.start_ray(cfg.store_bytes)
    warm = session.warm_store([], cfg.store_bytes)
    timeout = 5 if args.smoke else 30
    waited = settle(timeout)
    busy = " and they are still busy: expect noise" if waited >= timeout else ""
    log(f"warmed the object store in {warm:.1f} s, waited {waited:.1f} s for idle CPUs{busy}")
    results: dict[str, Any] = {"config": dataclasses.asdict(cfg), "rows": []}
    for build in rows(cfg):
        row = build()
        if args.profile:
            if args.profile.lower() in row.name.lower() and row.value is not None:
                profile(row, cfg.reps)
            continue
        log(f"{row.name}: {cfg.reps} repetitions")
        skipped = {"name": row.name, "skipped": row.note} if row.value is None else None
        results["rows"].append(skipped or measure(row, cfg.reps))
        del row
        gc.collect()
    if args.profile:
        return
    results["meta"] = report.machine(
        "types.py", seconds=round(time.perf_counter() - start), idle_wait_s=round(waited, 1)
    )
    text = markdown(results)
    report.write_results(args.out, "types", results, text)
    print(text)
    ray.shutdown()


if __name__ == "__main__":
    main()
