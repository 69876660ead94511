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
timed once more, whose ratio to plain is the run's own noise.

``--flow tensordict`` replays instead what verl 0.9.1's legacy trainer
(``trainer.use_v1=False``) sends, on the nd dispatch: no broadcast, and five calls
(``compute_log_prob``, ``compute_ref_log_prob``, the critic's ``infer_batch`` and
``train_mini_batch``, ``update_actor``), each converting the current ``DataProto`` afresh
(``to_tensordict``, ``left_right_2_no_padding``, ``assign_non_tensor`` with that call's flags;
``update_actor`` sets ``multi_turn`` and ``temperature`` first), which the dispatch chunks
into one consolidated TensorDict per DP rank and puts with ``parallel_put``. The batch grows
as the trainer's does: ``old_log_probs``, ``ref_log_prob``, ``values``, then the scores,
rewards, advantages and returns. Its strategies add **auto**, refshare's default mode
(``steps.AUTO_OPTIONS``: top-level sharing until refshare has such a mode). Needs tensordict.

Backends: **verl** (its ``RayWorkerGroup`` and ``@register`` on a CPU resource pool, and its
own conversions) and **mirror** (``tests/mirrors/verl_mirror.py``, no verl).

    python benchmarks/rl_step.py --backend verl --dispatch nd   # about 3 minutes
    python benchmarks/rl_step.py --smoke                        # tiny batch: seconds
    python benchmarks/rl_step.py --smoke --flow tensordict      # the same, legacy trainer
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import ray
import torch
from _harness import long_run, options, session, steps
from _harness.report import DASH, TIMES, MiB, cannot_plot, machine_lines
from _harness.step_report import goals, setup_lines, step_report
from _harness.steps import Turn

steps.mirrors_importable()  # the mirror, by reference in every worker, as verl's package is
import verl_mirror as mirror  # noqa: E402

CALLS = ("sync_weights", "compute_log_prob", "compute_ref_log_prob", "compute_values")
CALLS += ("update_critic", "update_actor")
LEGACY_CALLS = tuple(name for name, _, _ in mirror.legacy_calls(0))
WORLD, TP = 4, 2  # on nd: workers 0, 1 are DP rank 0, workers 2, 3 DP rank 1
CHUNKS = {"dp": WORLD, "nd": WORLD // TP}  # chunks of a compute call: per worker, per DP rank
ACTOR_CPUS = 0.25  # 4 workers hold 1 of Ray's 2 CPUs
MESHES = {"compute_log_prob": "actor", "compute_ref_log_prob": "ref", "compute_values": "critic"}
MESHES |= {"update_critic": "critic", "update_actor": "actor"}
MESHES |= {name: mesh for name, mesh, _ in mirror.legacy_calls(0)}  # the same for shared names


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
    budget: str = "default"  # each cache's: see options.step_parser


MODES = {
    # 61 steps: on 2 cores a call's per-step ratio spreads over about ±0.15, and the medians of
    # 21 steps still moved by ±0.1 between runs.
    "full": Config("full", 256, 3072, 2048, 32 * MiB, steps=61, warmup=2, store_bytes=2 << 30),
    "quick": Config("quick", 256, 3072, 2048, 32 * MiB, steps=9, warmup=1, store_bytes=1 << 30),
    "smoke": Config("smoke", 16, 3072, 2048, 1 * MiB, steps=2, warmup=1, store_bytes=128 * MiB),
}


# -- the worker: receives, checksums, computes a new key cheaply ------------------------------


def worker_class(
    base: type, register: Any, one_to_all: Any, compute: Callable[[str], Any], data_proto: Any
) -> type:
    """The same worker for both backends, on their own base class, decorator and DataProto;
    ``compute(mesh)`` is the dispatch mode of a compute call. A ``DataProto`` is answered with
    one, the legacy trainer's TensorDict with a TensorDict."""

    class RLWorker(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            self.received: list[int] = []  # a checksum of everything this worker was sent
            for mesh in sorted(set(MESHES.values())):  # as verl's engine workers, on init
                dp_rank, tp_rank = divmod(self.rank, TP)
                self._register_dispatch_collect_info(mesh, dp_rank=dp_rank, is_collect=tp_rank == 0)

        def touch(self, array: np.ndarray) -> int:
            return session.touch(array)

        def reply(self, data: Any, key: str | None = None, value: Any = None) -> Any:
            self.received.append(mirror.checksum(data))
            if not hasattr(data, "batch"):
                out = {key: value} if key else {"loss": torch.zeros(len(data))}
                return type(data)(out, batch_size=[len(data)])
            metrics = {"metrics": {"checksum": self.received[-1]}}  # as verl collects metrics
            return data_proto.from_dict(tensors={key: value} if key else None, meta_info=metrics)

        @staticmethod
        def tensors(data: Any) -> Any:
            return data.batch if hasattr(data, "batch") else data

        @register(dispatch_mode=one_to_all)
        def take_received(self) -> list[int]:
            received, self.received = self.received, []
            return received

        @register(dispatch_mode=one_to_all)
        def sync_weights(self, state: torch.Tensor) -> int:
            self.state = state
            self.received.append(mirror.checksum(state))
            return self.received[-1]

        @register(dispatch_mode=compute(MESHES["compute_log_prob"]))
        def compute_log_prob(self, data: Any) -> Any:
            responses = self.tensors(data)["responses"]
            return self.reply(data, "old_log_probs", (responses % 1000).float() * -1e-3)

        @register(dispatch_mode=compute(MESHES["compute_ref_log_prob"]))
        def compute_ref_log_prob(self, data: Any) -> Any:
            return self.reply(data, "ref_log_prob", self.tensors(data)["old_log_probs"] * 0.9)

        @register(dispatch_mode=compute(MESHES["compute_values"]))
        def compute_values(self, data: Any) -> Any:
            return self.reply(data, "values", (data.batch["responses"] % 13).float() * 0.1)

        @register(dispatch_mode=compute(MESHES["infer_batch"]))
        def infer_batch(self, data: Any) -> Any:
            return self.reply(data, "values", (data["responses"] % 13).float() * 0.1)

        @register(dispatch_mode=compute(MESHES["update_critic"]))
        def update_critic(self, data: Any) -> Any:
            return self.reply(data)

        @register(dispatch_mode=compute(MESHES["train_mini_batch"]))
        def train_mini_batch(self, data: Any) -> Any:
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
    sharing: steps.Sharing
    chunks: int
    verl: Any  # convert(batch, flags) and chunk(tensordict, n), the framework's own


def verl_backend(dispatch: str) -> Backend:
    import verl
    from verl.protocol import BatchData, DataProto
    from verl.single_controller.base import Worker
    from verl.single_controller.base.decorator import Dispatch, register
    from verl.single_controller.base.decorator import make_nd_compute_dataproto_dispatch_fn as nd
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.utils import ray_utils
    from verl.utils import tensordict_utils as tu

    class CpuRayWorkerGroup(RayWorkerGroup):  # type: ignore[misc]
        def _get_master_addr_port(self, pg: Any, bundle_index: int = 0, **_: Any) -> None:
            # verl asks a 1-CPU task in bundle 0 for an address (and drops a master_addr given
            # as an argument); a 0.25-CPU bundle cannot run it. Nothing here uses it.
            self._master_addr, self._master_port = "127.0.0.1", "0"

    def convert(batch: Any, flags: dict[str, Any]) -> Any:
        from verl.workers.utils.padding import left_right_2_no_padding

        return tu.assign_non_tensor(left_right_2_no_padding(batch.to_tensordict()), **flags)

    # A CPU pool: one bundle of {"CPU": max_colocate_count} per worker (10 by default).
    pool = RayResourcePool([WORLD], use_gpu=False, max_colocate_count=ACTOR_CPUS)
    compute = (lambda mesh: Dispatch.DP_COMPUTE_PROTO) if dispatch == "dp" else nd
    worker = worker_class(Worker, register, Dispatch.ONE_TO_ALL, compute, DataProto)
    actor_cls = ray.remote(num_cpus=ACTOR_CPUS)(worker)
    group = CpuRayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(actor_cls))
    label = f"verl {verl.__version__}: its RayWorkerGroup, @register(dispatch_mode=...)"
    targets = [(RayWorkerGroup, ("execute_all_async",)), (ray_utils, ("parallel_put",))]
    sharing = steps.Sharing(targets[:1]) if dispatch == "dp" else steps.Sharing(targets, "verl")
    chunk = SimpleNamespace(convert=convert, chunk=lambda td, n: BatchData(td).chunk(chunks=n))
    return Backend("verl", label, DataProto, group, sharing, CHUNKS[dispatch], chunk)


def mirror_backend(dispatch: str) -> Backend:
    m = mirror
    nd = m.make_nd_compute_dataproto_dispatch_fn
    compute = (lambda mesh: m.Dispatch.DP_COMPUTE_PROTO) if dispatch == "dp" else nd
    worker = worker_class(m.Worker, m.register, m.Dispatch.ONE_TO_ALL, compute, m.DataProto)
    group = m.RayWorkerGroup(worker, WORLD, ACTOR_CPUS)
    label = f"mirror of {m.MIRRORS} (tests/mirrors/verl_mirror.py), batch as {m.BATCH_TYPE}"
    targets = [(m.RayWorkerGroup, ("execute_all_async",)), (m, ("parallel_put",))]
    sharing = steps.Sharing(targets[:1] if dispatch == "dp" else targets)
    own = SimpleNamespace(convert=m.convert, chunk=m.chunk_batch)
    return Backend("mirror", label, m.DataProto, group, sharing, CHUNKS[dispatch], own)


# -- one step: the DataProto flow ---------------------------------------------------------------


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


def run_step(backend: Backend, batch: Any, weights: torch.Tensor, strategy: str) -> Turn:
    """One PPO step under ``strategy``: each call's seconds, bytes stored, checksums."""
    group, dp = backend.group, backend.data_proto
    sent: dict[str, list[str]] = {}  # the keys each compute call sent (the batch grows)

    with backend.sharing.on(strategy) as turn:

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

    received(backend, turn)
    turn.distinct = weights.nbytes + sum(t.nbytes for t in batch.batch.values())
    if not turn.by_value:  # what refshare or the ideal stored is counted already
        return turn
    # What plain stores, counted now (untimed): the broadcast by value once per worker; each
    # chunk once per call, by value on dp, by the dispatch's own parallel_put on nd.
    turn.store("sync_weights", WORLD * steps.by_value_bytes([weights]))
    for name, keys in sent.items():
        data = dp.from_dict(
            {k: batch.batch[k] for k in keys}, batch.non_tensor_batch, batch.meta_info
        )
        turn.store(name, steps.by_value_bytes(data.chunk(backend.chunks)))
    return turn


def received(backend: Backend, turn: Turn) -> None:
    """What every worker received in the step, checked: one distinct chunk per DP rank."""
    turn.received = backend.group.take_received()
    if len({tuple(r) for r in turn.received}) != backend.chunks:  # nd: TP ranks get the same
        raise RuntimeError(f"expected {backend.chunks} different chunks per call: {turn.received}")


# -- one step: the legacy trainer's TensorDict flow ---------------------------------------------


def legacy_batch(data_proto: Any, config: Config, step: int) -> Any:
    """What the legacy trainer's first data call starts from, new every step (the same for
    every strategy of a step)."""
    prompt = config.seq_len - config.response_len
    return data_proto.from_dict(*mirror.rollout(config.batch, prompt, config.response_len, step))


def run_legacy_step(backend: Backend, batch: Any, strategy: str) -> Turn:
    """The legacy trainer's step under ``strategy``: before each call the batch is converted
    afresh, as the trainer does (in the step's time, not the call's)."""
    group, dp, own = backend.group, backend.data_proto, backend.verl
    sent: dict[str, Any] = {}  # the TensorDict each call sent
    added = {"compute_log_prob": "old_log_probs", "compute_ref_log_prob": "ref_log_prob"}
    added |= {"infer_batch": "values"}

    with backend.sharing.on(strategy) as turn:
        for name, _, flags in mirror.legacy_calls(len(batch)):
            if name == "train_mini_batch":  # compute_advantage, on the driver
                b = batch.batch
                scores = (b["responses"] % 7).float() * b["response_mask"]
                advantages = b["ref_log_prob"] - b["old_log_probs"]
                batch = batch.union(dp.from_dict({
                    "token_level_scores": scores, "token_level_rewards": scores,
                    "advantages": advantages, "returns": advantages + b["values"],
                }))  # fmt: skip
            if name == "update_actor":
                batch.meta_info.update(mirror.UPDATE_ACTOR_META)
            sent[name] = own.convert(batch, flags)
            out = turn.call(name, getattr(group, name), sent[name])
            if name in added:
                batch = batch.union(dp.from_dict({added[name]: out[added[name]]}))
        turn.finish()

    received(backend, turn)
    turn.distinct = distinct_bytes(sent["update_actor"])
    if not turn.by_value:  # what refshare or the ideal stored is counted already
        return turn
    # What plain stores, counted now (untimed): each chunk once per call, by parallel_put.
    for name, td in sent.items():
        turn.store(name, steps.by_value_bytes(own.chunk(td, backend.chunks)))
    return turn


def distinct_bytes(td: Any) -> int:
    """The bytes of each distinct tensor a TensorDict holds, once: a jagged one's values and
    offsets, a tensor inside ``NonTensorData``, one tensor under two keys once."""
    found: dict[int, torch.Tensor] = {}
    for key in td.keys():  # noqa: SIM118 (a TensorDict iterates over its rows)
        entry = td.get(key)
        if isinstance(entry, mirror.NonTensorData):
            entry = entry.data
        if isinstance(entry, torch.Tensor):
            parts = (entry.values(), entry.offsets()) if entry.is_nested else (entry,)
            found |= {id(t): t for t in parts}
    return sum(t.nbytes for t in found.values())


# -- the run ----------------------------------------------------------------------------------


def step_turns(backend: Backend, config: Config, flow: str) -> Callable[[str, int], Turn]:
    """One step of ``flow`` under a strategy: a new rollout every step, the same weights."""
    if flow == "tensordict":

        def turn(strategy: str, step: int) -> Turn:
            return run_legacy_step(
                backend, legacy_batch(backend.data_proto, config, step), strategy
            )

        return turn
    base = rollouts(config)
    weights = torch.randn(config.weights_bytes // 4, generator=torch.Generator().manual_seed(1))

    def dataproto_turn(strategy: str, step: int) -> Turn:
        return run_step(backend, step_batch(backend.data_proto, base, step), weights, strategy)

    return dataproto_turn


def run_backend(backend: Backend, config: Config, flow: str, long: int = 0) -> dict[str, Any]:
    """Warm up, then time every step under every strategy, interleaved; or (``long``) that
    many steps by value, then with refshare's defaults, the store read all along."""
    turn = step_turns(backend, config, flow)
    workers = backend.group.workers
    if long:
        found = long_run.long_replay(backend.name, workers, config, turn, backend.sharing, long)
        return {"label": backend.label, "patch": backend.sharing.how, **found}
    calls = LEGACY_CALLS if flow == "tensordict" else CALLS
    strategies = steps.WITH_AUTO if flow == "tensordict" else steps.STRATEGIES
    timed, record = steps.replay(
        backend.name, workers, config, turn, calls, strategies, backend.sharing
    )
    out = {"label": backend.label, "patch": backend.sharing.how, **record}
    if flow == "tensordict":
        return out | {"goals": goals(record["summary"], None)}
    hit = {
        s: all(
            t["turns"][s]["counts"]["sync_weights"]["puts"] == 0
            and t["turns"][s]["counts"]["sync_weights"]["hits"] == WORLD
            for t in timed
        )
        for s in ("refshare", "deep")
    }
    return out | {
        "broadcast_hit_every_step": hit,
        "goals": goals(record["summary"], hit["refshare"]),
    }


def report(results: dict[str, Any]) -> str:
    c, dispatch, flow = results["config"], results["dispatch"], results["flow"]
    batch, seq, resp = c["batch"], c["seq_len"], c["response_len"]
    how = {
        "dp": "`Dispatch.DP_COMPUTE_PROTO`: one chunk per worker, sent by value",
        "nd": "`make_nd_compute_dataproto_dispatch_fn(mesh_name=...)`: dp 2 "
        f"{TIMES} tp 2, one chunk per DP rank put by the dispatch's `parallel_put`, "
        "both TP ranks sent its ref",
    }[dispatch]
    title = "the legacy trainer's TensorDicts" if flow == "tensordict" else dispatch
    lines = [f"# RL-step replay: one verl PPO step ({title}), plain, refshare and deep", ""]
    strategies = steps.WITH_AUTO if flow == "tensordict" else steps.STRATEGIES
    lines += setup_lines(results, f"{WORLD} workers of {ACTOR_CPUS} CPU", strategies)
    if flow == "tensordict":
        lines += [
            f"Batch: {batch} sequences, as the legacy trainer (`trainer.use_v1=False`) holds "
            f"them: prompts [{batch}, {seq - resp}] left-padded, responses and response_mask "
            f"[{batch}, {resp}] right-padded (random lengths), input_ids, attention_mask, "
            f"position_ids [{batch}, {seq}] int64; uid, data_source, __num_turns__, reward_model; "
            "temperature, global_token_num, images_seqlens. Five calls, each on a fresh "
            "conversion (`to_tensordict`, `left_right_2_no_padding`, `assign_non_tensor` with "
            "the call's flags): the dispatch (nd, dp 2 "
            f"{TIMES} tp 2) chunks it into one consolidated TensorDict per DP rank and "
            "`parallel_put`s them. The batch gains old_log_probs, ref_log_prob and values, then "
            "the scores, rewards, advantages and returns; `update_actor` sets multi_turn and "
            "temperature first. The conversions are not in a call's time, only in the step's. "
            f"*auto* is refshare's default mode, until it has one the same options as "
            f"*refshare* ({steps.AUTO_OPTIONS or 'none'}). The critic's two calls are blocking "
            "here (verl makes them futures and waits at once).",
            "",
        ]
    else:
        lines += [
            f"Batch: {batch} sequences; input_ids, attention_mask, position_ids [{batch}, {seq}] "
            f"int64; responses, response_mask [{batch}, {resp}] int64; uid strings. Each compute "
            f"call adds a [{batch}, {resp}] float32 key; the driver adds advantages and returns. "
            f"Broadcast: one {c['weights_bytes'] // MiB} MiB float32 tensor, the same every step "
            f"(ONE_TO_ALL, by value). Compute calls: {how}. The batch is a `DataProto` either "
            "way (verl's trainer hands its engine workers `batch.to_tensordict()` without "
            "padding; the dispatch chunks both alike), so the two dispatches differ in dispatch "
            "only.",
            "",
        ]
    for name, r in results["backends"].items():
        same = all(r["checksums_same_every_step"])
        lines += [
            f"## {name}: {r['label']}",
            "",
            f"refshare on for its turns only, as {r['patch']}.",
            "",
            *step_report(r["summary"], {"step": "**whole step**"}, r["goals"]),
            f"- Checksums of everything each worker received, every step: "
            f"{'identical under every strategy' if same else 'DIFFER'}.",
        ]
        if flow != "tensordict":
            hit = r["broadcast_hit_every_step"]
            fresh = r["summary"]["distinct_bytes"] - c["weights_bytes"]
            deep = r["summary"]["stored_median"]["deep"]
            lines += [
                f"- Without the broadcast (stored once, then found every step), the distinct "
                f"bytes are {fresh / MiB:.1f} MiB a step; deep stored {deep / fresh:.2f}{TIMES} "
                "that.",
                f"- The broadcast hit the cache in every timed step (0 puts, {WORLD} hits): "
                + ", ".join(f"{s} {'yes' if hit[s] else 'no'}" for s in ("refshare", "deep"))
                + ".",
            ]
        lines.append("")
    lines += [
        "Times include dispatch (chunking), puts, serialization, transfer, the workers' "
        f"checksum and collection (concat); the whole step also the driver's unions {DASH} "
        "the same work under every strategy. refshare knows types by class: its handling of "
        "`verl.protocol.DataProto` (keying without pickling, and the tensors deep sharing "
        "takes out) does not apply to the mirror's class, which it sees as an unknown type "
        "whose pickling runs code of its own; on the mirror, deep sharing can only take out "
        "that pickle.",
        "",
    ]
    return "\n".join(lines)


def long_report(results: dict[str, Any]) -> str:
    """The report of ``--long``: what the store held over the steps, by value and refshare."""
    c, dispatch, flow = results["config"], results["dispatch"], results["flow"]
    ((name, r),) = results["backends"].items()
    title = "the legacy trainer's TensorDicts" if flow == "tensordict" else dispatch
    lines = [f"# Long RL-step replay: what the object store holds ({title})", ""]
    setup = [
        *machine_lines(results["meta"]),
        "",
        f"Ray: one local session, `ray.init(num_cpus=2, object_store_memory="
        f"{c['store_bytes'] // MiB} MiB)`, {WORLD} workers of {ACTOR_CPUS} CPU, store warmed "
        f"first. {name}: {r['label']}; refshare on for its steps as {r['patch']}, with a "
        "`refshare.RefCache()` of the default budget (a quarter of the store). Each step as "
        f"the short replay's ({c['batch']} sequences): a new rollout every step, the same "
        f"{c['weights_bytes'] // MiB} MiB of weights every step"
        + (" (no broadcast on this flow)." if flow == "tensordict" else "."),
        "",
    ]
    return "\n".join(lines + long_run.markdown(r, setup))


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    has_verl = importlib.util.find_spec("verl") is not None
    parser = options.step_parser(__doc__ or "")
    parser.add_argument(
        "--backend", choices=("verl", "mirror", "both"), default="verl" if has_verl else "mirror"
    )
    parser.add_argument(
        "--flow", choices=("dataproto", "tensordict"), default="dataproto",
        help="what the calls send: a DataProto, or the legacy trainer's TensorDicts (nd only)",
    )  # fmt: skip
    parser.add_argument("--dispatch", choices=("dp", "nd"), help="compute calls (default dp)")
    parser.add_argument("--no-tensordict", action="store_true", help="mirror: dict batches")
    parser.add_argument(
        "--long", type=int, default=0, metavar="N",
        help="N steps by value, then N with refshare's defaults, the store read all along",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.long and args.backend == "both":
        parser.error("--long replays one backend: --backend verl or mirror")
    if args.backend != "mirror" and not has_verl:
        parser.error("verl is not importable: use --backend mirror")
    if args.flow == "tensordict":
        if args.dispatch == "dp" or args.no_tensordict:
            parser.error("--flow tensordict sends TensorDicts on the nd dispatch")
        if not mirror.HAS_TENSORDICT:
            parser.error("--flow tensordict needs tensordict (pip install tensordict)")
    args.dispatch = args.dispatch or ("nd" if args.flow == "tensordict" else "dp")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    config = options.step_config(args, MODES)
    if args.no_tensordict:
        mirror.use_dict_batches()  # before Ray starts, so the workers do too
    names = ["verl", "mirror"] if args.backend == "both" else [args.backend]

    def measure() -> dict[str, Any]:
        backends = {}
        for name in names:
            backend = (verl_backend if name == "verl" else mirror_backend)(args.dispatch)
            try:
                backends[name] = run_backend(backend, config, args.flow, args.long)
            finally:
                session.stop_group(backend.group)
        return {"dispatch": args.dispatch, "flow": args.flow, "backends": backends}

    stem = {"dp": "rl_step", "nd": "rl_step_nd"}[args.dispatch]
    stem = "rl_step_tensordict" if args.flow == "tensordict" else stem
    if args.long:
        results = steps.run_replay("rl_step.py", config, measure, long_report, args.out,
                                   f"{stem}_long")  # fmt: skip
        (name,) = results["backends"]
        if cannot_plot("png") is None:
            long_run.plot(results["backends"][name], args.out / f"{stem}_long.png")
        return 0
    results = steps.run_replay("rl_step.py", config, measure, report, args.out, stem)
    same = all(all(r["checksums_same_every_step"]) for r in results["backends"].values())
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
