"""RL-step replay: one verl PPO step's dispatch and transport, plain, refshare and deep.

One step as verl's PPO trainer makes it, on 4 workers, with a batch of 256 sequences
(input_ids, attention_mask, position_ids [256, 3072] int64; responses, response_mask
[256, 2048] int64; uids): ``sync_weights``, the same 32 MiB tensor to every worker
(ONE_TO_ALL) every step; ``compute_log_prob``, ``compute_ref_log_prob``, ``compute_values``,
each result, a [256, 2048] float32 key, ``union``-ed into the batch; advantages and returns
added on the driver; ``update_critic``, then ``update_actor``. Workers only checksum what they
received and compute the new key cheaply: the times are the driver's dispatch,
serialization and transfer. New rollouts every step; the same weights every step.

The compute calls go one of two ways (``--dispatch``): **dp**, ``Dispatch.DP_COMPUTE_PROTO``,
one chunk per worker by value; or **nd**, the engine workers' dispatch
(``make_nd_compute_dataproto_dispatch_fn(mesh_name=...)``) on dp 2 x tp 2, which asks the
workers for their DP ranks on a mesh's first use and ``parallel_put``s one chunk per DP rank,
whose two TP ranks get the same ref. Strategies, interleaved per step: **plain**,
**refshare** (top-level) and **deep** (``deep=True``): on dp, ``patch_methods`` of
``execute_all_async``; on nd, ``refshare.enable("verl")`` (``execute_all_async`` and
``parallel_put``; the same two on the mirror); and **plain again**, the framework untouched
timed once more, whose ratio to plain is the run's own noise. Backends: **verl** (its
``RayWorkerGroup`` and ``@register`` on a CPU resource pool) and **mirror**
(``_verl_mirror.py``, no verl).

    python benchmarks/rl_step.py --backend verl --dispatch nd   # about 3 minutes
    python benchmarks/rl_step.py --smoke                        # tiny batch: seconds
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import _harness as bench
import numpy as np
import ray
import torch
import xxhash
from _harness import MiB

CALLS = ("sync_weights", "compute_log_prob", "compute_ref_log_prob", "compute_values")
CALLS += ("update_critic", "update_actor")
WORLD, TP = 4, 2  # on nd: workers 0, 1 are DP rank 0, workers 2, 3 DP rank 1
CHUNKS = {"dp": WORLD, "nd": WORLD // TP}  # chunks of a compute call: per worker, per DP rank
ACTOR_CPUS = 0.25  # 4 workers hold 1 of Ray's 2 CPUs
MESHES = {"compute_log_prob": "actor", "compute_ref_log_prob": "ref", "compute_values": "critic"}
MESHES |= {"update_critic": "critic", "update_actor": "actor"}


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
    # 61 steps: on 2 cores a call's per-step ratio spreads over about ±0.15, and the medians of
    # 21 steps still moved by ±0.1 between runs.
    "full": Config("full", 256, 3072, 2048, 32 * MiB, steps=61, warmup=2, store_bytes=2 << 30),
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


def worker_class(
    base: type, register: Any, one_to_all: Any, compute: Callable[[str], Any], data_proto: Any
) -> type:
    """The same worker for both backends, on their own base class, decorator and DataProto;
    ``compute(mesh)`` is the dispatch mode of a compute call."""

    class RLWorker(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            self.received: list[int] = []  # a checksum of everything this worker was sent
            for mesh in sorted(set(MESHES.values())):  # as verl's engine workers, on init
                dp_rank, tp_rank = divmod(self.rank, TP)
                self._register_dispatch_collect_info(mesh, dp_rank=dp_rank, is_collect=tp_rank == 0)

        def touch(self, array: np.ndarray) -> int:
            return bench.touch(array)

        def reply(self, data: Any, key: str | None = None, value: Any = None) -> Any:
            self.received.append(checksum(data))
            metrics = {"metrics": {"checksum": self.received[-1]}}  # as verl collects metrics
            return data_proto.from_dict(tensors={key: value} if key else None, meta_info=metrics)

        @register(dispatch_mode=one_to_all)
        def take_received(self) -> list[int]:
            received, self.received = self.received, []
            return received

        @register(dispatch_mode=one_to_all)
        def sync_weights(self, state: torch.Tensor) -> int:
            self.state = state
            self.received.append(checksum(state))
            return self.received[-1]

        @register(dispatch_mode=compute(MESHES["compute_log_prob"]))
        def compute_log_prob(self, data: Any) -> Any:
            return self.reply(
                data, "old_log_probs", (data.batch["responses"] % 1000).float() * -1e-3
            )

        @register(dispatch_mode=compute(MESHES["compute_ref_log_prob"]))
        def compute_ref_log_prob(self, data: Any) -> Any:
            return self.reply(data, "ref_log_prob", data.batch["old_log_probs"] * 0.9)

        @register(dispatch_mode=compute(MESHES["compute_values"]))
        def compute_values(self, data: Any) -> Any:
            return self.reply(data, "values", (data.batch["responses"] % 13).float() * 0.1)

        @register(dispatch_mode=compute(MESHES["update_critic"]))
        def update_critic(self, data: Any) -> Any:
            return self.reply(data)

        @register(dispatch_mode=compute(MESHES["update_actor"]))
        def update_actor(self, data: Any) -> Any:
            return self.reply(data)

    return RLWorker


# -- backends ---------------------------------------------------------------------------------


@dataclass
class Backend:
    name: str
    label: str
    data_proto: Any
    group: Any
    sharing: bench.Sharing
    chunks: int


def verl_backend(dispatch: str) -> Backend:
    import verl
    from verl.protocol import DataProto
    from verl.single_controller.base import Worker
    from verl.single_controller.base.decorator import Dispatch, register
    from verl.single_controller.base.decorator import make_nd_compute_dataproto_dispatch_fn as nd
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.utils import ray_utils

    class CpuRayWorkerGroup(RayWorkerGroup):  # type: ignore[misc]
        def _get_master_addr_port(self, pg: Any, bundle_index: int = 0, **_: Any) -> None:
            # verl asks a 1-CPU task in bundle 0 for an address (and drops a master_addr given
            # as an argument); a 0.25-CPU bundle cannot run it. Nothing here uses it.
            self._master_addr, self._master_port = "127.0.0.1", "0"

    # A CPU pool: one bundle of {"CPU": max_colocate_count} per worker (10 by default).
    pool = RayResourcePool([WORLD], use_gpu=False, max_colocate_count=ACTOR_CPUS)
    compute = (lambda mesh: Dispatch.DP_COMPUTE_PROTO) if dispatch == "dp" else nd
    worker = worker_class(Worker, register, Dispatch.ONE_TO_ALL, compute, DataProto)
    actor_cls = ray.remote(num_cpus=ACTOR_CPUS)(worker)
    group = CpuRayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(actor_cls))
    label = f"verl {verl.__version__}: its RayWorkerGroup, @register(dispatch_mode=...)"
    targets = [(RayWorkerGroup, ("execute_all_async",)), (ray_utils, ("parallel_put",))]
    sharing = bench.Sharing(targets[:1]) if dispatch == "dp" else bench.Sharing(targets, "verl")
    return Backend("verl", label, DataProto, group, sharing, CHUNKS[dispatch])


def mirror_backend(dispatch: str) -> Backend:
    import _verl_mirror as m

    nd = m.make_nd_compute_dataproto_dispatch_fn
    compute = (lambda mesh: m.Dispatch.DP_COMPUTE_PROTO) if dispatch == "dp" else nd
    worker = worker_class(m.Worker, m.register, m.Dispatch.ONE_TO_ALL, compute, m.DataProto)
    group = m.RayWorkerGroup(worker, WORLD, ACTOR_CPUS)
    label = f"mirror of {m.MIRRORS} (benchmarks/_verl_mirror.py), batch as {m.BATCH_TYPE}"
    targets = [(m.RayWorkerGroup, ("execute_all_async",)), (m, ("parallel_put",))]
    sharing = bench.Sharing(targets[:1] if dispatch == "dp" else targets)
    return Backend("mirror", label, m.DataProto, group, sharing, CHUNKS[dispatch])


# -- one step ---------------------------------------------------------------------------------


def rollouts(config: Config) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    prompt, response = (config.batch, config.seq_len), (config.batch, config.response_len)
    shapes = dict.fromkeys(("input_ids", "attention_mask", "position_ids"), prompt)
    shapes |= dict.fromkeys(("responses", "response_mask"), response)
    return {k: torch.randint(0, 32_000, s, generator=g) for k, s in shapes.items()}


def step_batch(data_proto: Any, base: dict[str, torch.Tensor], step: int) -> Any:
    """New content every step (the same for every strategy of a step), 8 responses a uid."""
    uid = np.array([f"s{step}-p{i // 8}" for i in range(len(base["responses"]))], dtype=object)
    tensors = {k: v + step for k, v in base.items()}
    return data_proto.from_dict(tensors, {"uid": uid}, {"temperature": 1.0, "step": step})


def run_step(backend: Backend, batch: Any, weights: torch.Tensor, strategy: str) -> bench.Turn:
    """One PPO step under ``strategy``: each call's seconds, bytes stored, checksums."""
    group, dp = backend.group, backend.data_proto
    sent: dict[str, list[str]] = {}  # the keys each compute call sent (the batch grows)

    with backend.sharing.on(strategy):
        turn = bench.Turn()

        def call(name: str, data: Any) -> Any:
            sent[name] = list(data.batch.keys())
            out = turn.call(name, getattr(group, name), data)
            out.meta_info.pop("metrics")  # the checksums, as verl's trainer pops metrics
            return out

        turn.call("sync_weights", group.sync_weights, weights)
        batch = batch.union(call("compute_log_prob", batch))
        batch = batch.union(call("compute_ref_log_prob", batch))
        batch = batch.union(call("compute_values", batch))
        advantages = batch.batch["ref_log_prob"] - batch.batch["old_log_probs"]
        returns = advantages + batch.batch["values"]
        batch = batch.union(dp.from_dict({"advantages": advantages, "returns": returns}))
        call("update_critic", batch)
        call("update_actor", batch)
        turn.finish()

    turn.received = group.take_received()
    if len({tuple(r) for r in turn.received}) != backend.chunks:  # nd: TP ranks get the same
        raise RuntimeError(f"expected {backend.chunks} different chunks per call: {turn.received}")
    turn.distinct = weights.nbytes + sum(t.nbytes for t in batch.batch.values())
    if strategy not in bench.UNTOUCHED:
        turn.stored = turn.counts["step"]["bytes_put"]
        return turn
    # What plain stores, counted now (untimed): the broadcast by value once per worker; each
    # chunk once per call, by value on dp, by the dispatch's own parallel_put on nd.
    turn.stored = WORLD * bench.by_value_bytes([weights])
    for keys in sent.values():
        data = dp.from_dict(
            {k: batch.batch[k] for k in keys}, batch.non_tensor_batch, batch.meta_info
        )
        turn.stored += bench.by_value_bytes(data.chunk(backend.chunks))
    return turn


def run_backend(backend: Backend, config: Config) -> dict[str, Any]:
    """Warm up, then time every step under every strategy, interleaved."""
    base = rollouts(config)
    weights = torch.randn(config.weights_bytes // 4, generator=torch.Generator().manual_seed(1))
    bench.log(f"{backend.name}: warming the store")
    warm_seconds = bench.warm_store(backend.group.workers, config.store_bytes)

    def turn(strategy: str, step: int) -> bench.Turn:
        return run_step(backend, step_batch(backend.data_proto, base, step), weights, strategy)

    steps = bench.interleave(backend.name, config.warmup + config.steps, turn)
    timed = steps[config.warmup :]
    summary = bench.summarize(timed, CALLS)
    hit = {
        s: all(
            t["turns"][s]["counts"]["sync_weights"]["puts"] == 0
            and t["turns"][s]["counts"]["sync_weights"]["hits"] == WORLD
            for t in timed
        )
        for s in ("refshare", "deep")
    }
    return {
        "label": backend.label,
        "patch": backend.sharing.how,
        "warm_store_seconds": round(warm_seconds, 1),
        "summary": summary,
        "broadcast_hit_every_step": hit,
        "goals": bench.goals(summary, hit["refshare"]),
        "checksums_same_every_step": [t["same"] for t in steps],
    }


# -- report -----------------------------------------------------------------------------------


def report(results: dict[str, Any]) -> str:
    c, meta, dispatch = results["config"], results["meta"], results["dispatch"]
    batch, seq, resp = c["batch"], c["seq_len"], c["response_len"]
    how = {
        "dp": "`Dispatch.DP_COMPUTE_PROTO`: one chunk per worker, sent by value",
        "nd": "`make_nd_compute_dataproto_dispatch_fn(mesh_name=...)`: dp 2 "
        f"{bench.TIMES} tp 2, one chunk per DP rank put by the dispatch's `parallel_put`, "
        "both TP ranks sent its ref",
    }[dispatch]
    lines = [f"# RL-step replay: one verl PPO step ({dispatch}), plain, refshare and deep", ""]
    lines += [*bench.machine_lines(meta), ""]  # where, when, at which revision
    lines += [
        f"Ray: one local session, `ray.init(num_cpus=2, object_store_memory="
        f"{c['store_bytes'] // MiB} MiB)`, {WORLD} workers of {ACTOR_CPUS} CPU, store warmed "
        f"before timing. {c['steps']} timed steps after {c['warmup']} untimed, the four "
        "strategies interleaved (each leads in turn; plain runs twice, the second time as the "
        "control); each turn gets its own copy of the step's batch, new content every step.",
        "",
        f"Batch: {batch} sequences; input_ids, attention_mask, position_ids [{batch}, {seq}] "
        f"int64; responses, response_mask [{batch}, {resp}] int64; uid strings. Each compute "
        f"call adds a [{batch}, {resp}] float32 key; the driver adds advantages and returns. "
        f"Broadcast: one {c['weights_bytes'] // MiB} MiB float32 tensor, the same every step "
        f"(ONE_TO_ALL, by value). Compute calls: {how}. The batch is a `DataProto` either way "
        "(verl's trainer hands its engine workers `batch.to_tensordict()` without padding; "
        "the dispatch chunks both alike), so the two dispatches differ in dispatch only.",
        "",
    ]
    for name, r in results["backends"].items():
        same, hit = all(r["checksums_same_every_step"]), r["broadcast_hit_every_step"]
        fresh = r["summary"]["distinct_bytes"] - c["weights_bytes"]
        deep = r["summary"]["stored_median"]["deep"]
        lines += [
            f"## {name}: {r['label']}",
            "",
            f"refshare on for its turns only, as {r['patch']}.",
            "",
            *bench.step_report(r["summary"], {"step": "**whole step**"}, r["goals"]),
            f"- Checksums of everything each worker received, every step: "
            f"{'identical under every strategy' if same else 'DIFFER'}.",
            f"- Without the broadcast (stored once, then found every step), the distinct bytes "
            f"are {fresh / MiB:.1f} MiB a step; deep stored {deep / fresh:.2f}{bench.TIMES} that.",
            f"- The broadcast hit the cache in every timed step (0 puts, {WORLD} hits): "
            + ", ".join(f"{s} {'yes' if hit[s] else 'no'}" for s in ("refshare", "deep"))
            + ".",
            "",
        ]
    lines += [
        "Times include dispatch (chunking), puts, serialization, transfer, the workers' "
        f"checksum and collection (concat); the whole step also the driver's unions {bench.DASH} "
        "the same work under every strategy. refshare knows types by class: its handling of "
        "`verl.protocol.DataProto` (keying without pickling, and the tensors deep sharing "
        "takes out) does not apply to the mirror's class, which it sees as an unknown type "
        "whose pickling runs code of its own; on the mirror, deep sharing can only take out "
        "that pickle.",
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    has_verl = importlib.util.find_spec("verl") is not None
    parser = bench.step_parser(__doc__ or "")
    parser.add_argument(
        "--backend", choices=("verl", "mirror", "both"), default="verl" if has_verl else "mirror"
    )
    parser.add_argument("--dispatch", choices=("dp", "nd"), default="dp", help="compute calls")
    parser.add_argument("--no-tensordict", action="store_true", help="mirror: dict batches")
    args = parser.parse_args(argv)
    config = bench.step_config(args, MODES)
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
    results: dict[str, Any] = {"meta": meta, "config": asdict(config), "dispatch": args.dispatch}
    results["backends"] = {}
    try:
        for name in names:
            make = verl_backend if name == "verl" else mirror_backend
            backend = make(args.dispatch)
            try:
                results["backends"][name] = run_backend(backend, config)
            finally:
                bench.stop_group(backend.group)
    finally:
        ray.shutdown()
    meta["seconds"] = round(time.perf_counter() - started, 1)
    meta["load_average_end"] = [round(x, 2) for x in os.getloadavg()]  # a shared machine?
    stem = "rl_step" if args.dispatch == "dp" else "rl_step_nd"
    bench.write_results(args.out, stem, results, report(results))
    print((args.out / f"{stem}.md").read_text())
    same = all(all(r["checksums_same_every_step"]) for r in results["backends"].values())
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
