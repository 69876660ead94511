"""RL-step replay: one verl PPO step's dispatch and transport, plain and with refshare.

One step as verl's PPO trainer makes it, on a group of 4 workers, with a batch of 256
sequences (input_ids, attention_mask, position_ids [256, 3072] int64; responses,
response_mask [256, 2048] int64; uid strings in non_tensor_batch):

* ``sync_weights(state)``: the same 32 MiB tensor to every worker (ONE_TO_ALL), every step;
* ``compute_log_prob``, ``compute_ref_log_prob``, ``compute_values`` (DP_COMPUTE_PROTO: one
  chunk per worker), each result, a [256, 2048] float32 key, ``union``-ed into the batch;
* advantages and returns added on the driver; ``update_critic``, then ``update_actor``.

Workers only checksum what they received (returned as verl returns metrics) and compute the
new key cheaply, so the times are the driver's dispatch, serialization and transfer. Every
step has new rollouts; the weights are the same tensor every step. Strategies, interleaved
per step: **plain** (the framework as it is) and **refshare** (the group class's
``execute_all_async`` wrapped, then restored). Backends: **verl** (verl's ``RayWorkerGroup``
and ``@register`` on a CPU resource pool) and **mirror** (``_verl_mirror.py``, no verl).

    python benchmarks/rl_step.py --backend both   # verl and the mirror (about a minute)
    python benchmarks/rl_step.py --smoke          # tiny batch, 2 steps: seconds
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import _harness as bench
import numpy as np
import ray
import torch
import xxhash
from _harness import MiB

import refshare

STRATEGIES = ("plain", "refshare")
CALLS = ("sync_weights", "compute_log_prob", "compute_ref_log_prob", "compute_values")
CALLS += ("update_critic", "update_actor")
WORLD = 4
ACTOR_CPUS = 0.25  # 4 workers hold 1 of Ray's 2 CPUs


@dataclass(frozen=True)
class Config:
    mode: str
    batch: int  # sequences
    seq_len: int  # input_ids, attention_mask, position_ids: [batch, seq_len]
    response_len: int  # responses, response_mask and every computed key: [batch, response_len]
    weights_bytes: int  # the tensor broadcast every step
    steps: int  # timed steps
    warmup: int  # untimed steps first
    store_bytes: int


MODES = {
    "full": Config("full", 256, 3072, 2048, 32 * MiB, steps=21, warmup=2, store_bytes=2 << 30),
    "quick": Config("quick", 256, 3072, 2048, 32 * MiB, steps=9, warmup=1, store_bytes=1 << 30),
    "smoke": Config("smoke", 16, 3072, 2048, 1 * MiB, steps=2, warmup=1, store_bytes=128 * MiB),
}


# -- the worker: receives, checksums, computes a new key cheaply ------------------------------


def checksum(value: Any) -> int:
    """xxh3-64 of everything a worker received: tensors, uids and meta_info."""
    h = xxhash.xxh3_64()
    if isinstance(value, torch.Tensor):
        h.update(value.contiguous().numpy())
        return h.intdigest()
    for key in sorted(value.batch.keys()):
        tensor = value.batch[key]
        h.update(f"{key} {tensor.dtype} {tuple(tensor.shape)}".encode())
        h.update(tensor.contiguous().numpy())
    for key in sorted(value.non_tensor_batch):
        h.update("\0".join(map(str, value.non_tensor_batch[key])).encode())
    h.update(repr(sorted(value.meta_info.items())).encode())
    return h.intdigest()


def worker_class(base: type, register: Any, dispatch: Any, data_proto: Any) -> type:
    """The same worker for both backends, on their own base class, decorator and DataProto."""

    def reply(data: Any, key: str | None = None, value: Any = None) -> Any:
        metrics = {"metrics": {"checksum": checksum(data)}}  # collected as verl collects metrics
        return data_proto.from_dict(tensors={key: value} if key else None, meta_info=metrics)

    class RLWorker(base):  # type: ignore[misc, valid-type]
        def touch(self, array: np.ndarray) -> int:
            return bench.touch(array)

        @register(dispatch_mode=dispatch.ONE_TO_ALL)
        def sync_weights(self, state: torch.Tensor) -> int:
            self.state = state
            return checksum(state)

        @register(dispatch_mode=dispatch.DP_COMPUTE_PROTO)
        def compute_log_prob(self, data: Any) -> Any:
            return reply(data, "old_log_probs", (data.batch["responses"] % 1000).float() * -1e-3)

        @register(dispatch_mode=dispatch.DP_COMPUTE_PROTO)
        def compute_ref_log_prob(self, data: Any) -> Any:
            return reply(data, "ref_log_prob", data.batch["old_log_probs"] * 0.9)

        @register(dispatch_mode=dispatch.DP_COMPUTE_PROTO)
        def compute_values(self, data: Any) -> Any:
            return reply(data, "values", (data.batch["responses"] % 13).float() * 0.1)

        @register(dispatch_mode=dispatch.DP_COMPUTE_PROTO)
        def update_critic(self, data: Any) -> Any:
            return reply(data)

        @register(dispatch_mode=dispatch.DP_COMPUTE_PROTO)
        def update_actor(self, data: Any) -> Any:
            return reply(data)

    return RLWorker


# -- backends ---------------------------------------------------------------------------------


@dataclass
class Backend:
    name: str
    label: str
    data_proto: Any
    group_cls: type  # whose execute_all_async refshare wraps
    group: Any


def verl_backend() -> Backend:
    import verl
    from verl.protocol import DataProto
    from verl.single_controller.base import Worker
    from verl.single_controller.base.decorator import Dispatch, register
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    class CpuRayWorkerGroup(RayWorkerGroup):  # type: ignore[misc]
        def _get_master_addr_port(self, pg: Any, bundle_index: int = 0, **_: Any) -> None:
            # verl asks a 1-CPU task in bundle 0 for an address (and drops a master_addr given
            # as an argument); a 0.25-CPU bundle cannot run it. Nothing here uses it.
            self._master_addr, self._master_port = "127.0.0.1", "0"

    # A CPU pool: one bundle of {"CPU": max_colocate_count} per worker (10 by default).
    pool = RayResourcePool([WORLD], use_gpu=False, max_colocate_count=ACTOR_CPUS)
    worker = worker_class(Worker, register, Dispatch, DataProto)
    actor_cls = ray.remote(num_cpus=ACTOR_CPUS)(worker)
    group = CpuRayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(actor_cls))
    label = f"verl {verl.__version__}: its RayWorkerGroup, @register(dispatch_mode=...)"
    return Backend("verl", label, DataProto, RayWorkerGroup, group)


def mirror_backend() -> Backend:
    import _verl_mirror as m

    worker = worker_class(object, m.register, m.Dispatch, m.DataProto)
    group = m.RayWorkerGroup(worker, WORLD, ACTOR_CPUS)
    label = f"mirror of {m.MIRRORS} (benchmarks/_verl_mirror.py), batch as {m.BATCH_TYPE}"
    return Backend("mirror", label, m.DataProto, m.RayWorkerGroup, group)


# -- one step ---------------------------------------------------------------------------------


def rollouts(config: Config) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    prompt, response = (config.batch, config.seq_len), (config.batch, config.response_len)
    shapes = dict.fromkeys(("input_ids", "attention_mask", "position_ids"), prompt)
    shapes |= dict.fromkeys(("responses", "response_mask"), response)
    return {k: torch.randint(0, 32_000, s, generator=g) for k, s in shapes.items()}


def step_batch(data_proto: Any, base: dict[str, torch.Tensor], step: int) -> Any:
    """New content every step (the same for both strategies of a step), 8 responses a uid."""
    uid = np.array([f"s{step}-p{i // 8}" for i in range(len(base["responses"]))], dtype=object)
    tensors = {k: v + step for k, v in base.items()}
    return data_proto.from_dict(tensors, {"uid": uid}, {"temperature": 1.0, "step": step})


def run_step(backend: Backend, batch: Any, weights: torch.Tensor) -> dict[str, Any]:
    """One PPO step: per call, its seconds, refshare's counts, MiB per worker, checksums."""
    group, dp, record = backend.group, backend.data_proto, {}

    def chunk_mib(data: Any) -> float:
        return sum(t.numel() * t.element_size() for t in data.batch.values()) / MiB / WORLD

    def call(name: str, *args: Any) -> Any:
        sent = weights.nbytes / MiB if name == "sync_weights" else chunk_mib(batch)
        before = refshare.stats()
        start = time.perf_counter()
        out = getattr(group, name)(*args)
        seconds = time.perf_counter() - start
        after = refshare.stats()
        sums = out if name == "sync_weights" else out.meta_info.pop("metrics")["checksum"]
        counts = {f: getattr(after, f) - getattr(before, f) for f in after._fields}
        record[name] = {"seconds": seconds, "stats": counts, "mib_per_worker": sent, "sums": sums}
        return out

    start = time.perf_counter()
    call("sync_weights", weights)
    batch = batch.union(call("compute_log_prob", batch))
    batch = batch.union(call("compute_ref_log_prob", batch))
    batch = batch.union(call("compute_values", batch))
    advantages = batch.batch["ref_log_prob"] - batch.batch["old_log_probs"]
    returns = advantages + batch.batch["values"]
    batch = batch.union(dp.from_dict({"advantages": advantages, "returns": returns}))
    call("update_critic", batch)
    call("update_actor", batch)
    record["step"] = {"seconds": time.perf_counter() - start}
    return record


def run_backend(backend: Backend, config: Config) -> dict[str, Any]:
    """Warm up, then time every step under both strategies, interleaved."""
    sharing = bench.Sharing(backend.group_cls, "execute_all_async")
    base = rollouts(config)
    weights = torch.randn(config.weights_bytes // 4, generator=torch.Generator().manual_seed(1))
    bench.log(f"{backend.name}: warming the store")
    warm_seconds = bench.warm_store(backend.group.workers, config.store_bytes)
    steps: list[dict[str, Any]] = []
    for step in range(config.warmup + config.steps):
        turns = {}
        for strategy in bench.rotated(STRATEGIES, step):
            batch = step_batch(backend.data_proto, base, step)
            gc.collect()
            with sharing.on(strategy == "refshare"):
                turns[strategy] = run_step(backend, batch, weights)
        steps.append(turns)
        took = ", ".join(f"{s} {bench.ms(t['step']['seconds'])} ms" for s, t in turns.items())
        bench.log(f"{backend.name}: step {step}: {took}")
    timed = steps[config.warmup :]
    mismatched = [
        f"step {i} {name}"
        for i, turns in enumerate(steps)
        for name in CALLS
        if turns["plain"][name]["sums"] != turns["refshare"][name]["sums"]
    ]
    per_step = [
        {
            **{f: sum(t["refshare"][n]["stats"][f] for n in CALLS) for f in refshare.Stats._fields},
            "broadcast": t["refshare"]["sync_weights"]["stats"],
        }
        for t in timed
    ]
    return {
        "label": backend.label,
        "patch": sharing.how,
        "warm_store_seconds": round(warm_seconds, 1),
        "times": {
            s: {n: [t[s][n]["seconds"] for t in timed] for n in (*CALLS, "step")}
            for s in STRATEGIES
        },
        "mib_per_worker": {n: timed[0]["plain"][n]["mib_per_worker"] for n in CALLS},
        "per_call_stats": {n: timed[-1]["refshare"][n]["stats"] for n in CALLS},
        "refshare_per_step": per_step,
        "broadcast_hit_every_step": all(
            s["broadcast"]["puts"] == 0 and s["broadcast"]["hits"] == WORLD for s in per_step
        ),
        "checksums_compared": len(steps) * len(CALLS) * WORLD,
        "checksum_mismatches": mismatched,
    }


# -- report -----------------------------------------------------------------------------------


def backend_section(name: str, r: dict[str, Any]) -> list[str]:
    header = ["call", "MiB per worker", "plain (ms)", "refshare (ms)", "refshare ÷ plain"]
    rows = []
    for call in (*CALLS, "step"):
        plain, shared = (bench.median(r["times"][s][call]) for s in STRATEGIES)
        c = r["per_call_stats"][call] if call in CALLS else r["refshare_per_step"][-1]
        sent = f"{r['mib_per_worker'][call]:.2f}" if call in CALLS else ""
        label = call if call in CALLS else "**whole step**"
        counts = f"{c['puts']} / {c['hits']}", f"{c['bytes_put'] / MiB:.1f}"
        rows.append(
            [label, sent, bench.ms(plain), bench.ms(shared), f"{shared / plain:.2f}", *counts]
        )
    runs = [
        f"{s['puts']} / {s['hits']} / {s['bytes_put'] / MiB:.1f} / {s['by_value']} "
        f"({s['broadcast']['puts']} / {s['broadcast']['hits']})"
        for s in r["refshare_per_step"]
    ]
    steps = f"{runs[0]} in every one" if len(set(runs)) == 1 else "; ".join(runs)
    bad = r["checksum_mismatches"]
    checks = "identical under both strategies" if not bad else f"DIFFER: {', '.join(bad)}"
    hit = "yes" if r["broadcast_hit_every_step"] else "no"
    return [
        f"## {name}: {r['label']}",
        "",
        f"refshare on for the refshare turn of each step only, as `{r['patch']}`.",
        "",
        *bench.table([*header, "refshare puts / hits", "refshare MiB put"], rows),
        "",
        "Medians over the timed steps; refshare's puts / hits and MiB put (its `bytes_put`) "
        "are counted in the last timed step.",
        "",
        f"- Checksums of what each worker received, every call of every step "
        f"({r['checksums_compared']} in all): {checks}.",
        f"- The broadcast hit refshare's cache in every timed step (0 puts, {WORLD} hits): {hit}.",
        f"- refshare per timed step, puts / hits / MiB put / by value (broadcast puts / hits): "
        f"{steps}.",
        "",
    ]


def report(results: dict[str, Any]) -> str:
    c, meta = results["config"], results["meta"]
    batch, seq, resp = c["batch"], c["seq_len"], c["response_len"]
    lines = ["# RL-step replay: one verl PPO step, plain and with refshare", ""]
    lines += [*bench.machine_lines(meta), ""]  # where, when, at which revision
    lines += [
        f"Ray: one local session, `ray.init(num_cpus=2, object_store_memory="
        f"{c['store_bytes'] // MiB} MiB)`, {WORLD} workers of {ACTOR_CPUS} CPU, store warmed "
        f"before timing. {c['steps']} timed steps after {c['warmup']} untimed, the two "
        "strategies interleaved (each leads in turn); each turn gets its own copy of the step's "
        "batch, new content every step.",
        "",
        f"Batch: {batch} sequences; input_ids, attention_mask, position_ids [{batch}, {seq}] "
        f"int64; responses, response_mask [{batch}, {resp}] int64; uid strings. Each compute "
        f"call adds a [{batch}, {resp}] float32 key; the driver adds advantages and returns. "
        f"Broadcast: one {c['weights_bytes'] // MiB} MiB float32 tensor, the same every step.",
        "",
    ]
    for name, r in results["backends"].items():
        lines += backend_section(name, r)
    lines += [
        "Times include dispatch (chunking), serialization, transfer, the workers' checksum "
        f"and collection (concat); the whole step also the driver's unions {bench.DASH} the same "
        "work under both strategies. MiB per worker counts the elements of one chunk; "
        "refshare's `bytes_put` is its own size estimate of what it put. refshare knows types "
        "by class: built-in handling it has for `verl.protocol.DataProto` does not apply to "
        "the mirror's class, which it sees as an unknown type; that is where the two "
        "backends' refshare columns can differ.",
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    has_verl = importlib.util.find_spec("verl") is not None
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="9 timed steps")
    mode.add_argument("--smoke", action="store_true", help="tiny batch, 2 timed steps")
    parser.add_argument("--steps", type=int, help="timed steps (default: by mode)")
    parser.add_argument(
        "--backend", choices=("verl", "mirror", "both"), default="verl" if has_verl else "mirror"
    )
    parser.add_argument("--no-tensordict", action="store_true", help="mirror: dict batches")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    config = MODES["smoke" if args.smoke else "quick" if args.quick else "full"]
    if args.steps:
        config = Config(**{**asdict(config), "steps": args.steps})
    if args.backend != "mirror" and not has_verl:
        parser.error("verl is not importable: use --backend mirror")
    if args.no_tensordict:
        os.environ["VERL_MIRROR_DICT"] = "1"  # before Ray starts, so the workers see it too
    names = ["verl", "mirror"] if args.backend == "both" else [args.backend]
    meta = bench.machine(
        "rl_step.py", ray_init={"num_cpus": 2, "object_store_memory": config.store_bytes}
    )
    started = time.perf_counter()
    bench.start_ray(config.store_bytes)
    results: dict[str, Any] = {"meta": meta, "config": asdict(config), "backends": {}}
    try:
        for name in names:
            backend = verl_backend() if name == "verl" else mirror_backend()
            try:
                results["backends"][name] = run_backend(backend, config)
            finally:
                bench.stop_group(backend.group)
    finally:
        ray.shutdown()
    meta["seconds"] = round(time.perf_counter() - started, 1)
    meta["load_average_end"] = [round(x, 2) for x in os.getloadavg()]  # a shared machine?
    bench.write_results(args.out, "rl_step", results, report(results))
    print((args.out / "rl_step.md").read_text())
    bad = any(r["checksum_mismatches"] for r in results["backends"].values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
