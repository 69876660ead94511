"""ROLL step replay: reference log-probs, critic values and actor train, plain and refshare.

ROLL ships no package to install here, so the parts that decide transport are mirrored from
ROLL main (commit 8eb27cc2), in ``tests/mirrors/roll_mirror.py``: ``roll/distributed/executor/
cluster.py`` (``Cluster``: one actor per rank, each ``@register``ed method bound at build,
the fan-out in ``execute_all_async``), ``roll/distributed/scheduler/decorator.py`` (the
DP-MP dispatches) and ``roll/distributed/scheduler/protocol.py`` (``DataProto``: ``chunk``
clones each chunk's rows; it pickles as ``torch.save`` of its ``TensorDict``, tensordict's
own where installed, else a stand-in of 0.10.0's). The mirror is published under ROLL's
module names, in the driver and in every worker as it imports this module, so that
``refshare.enable("roll")`` finds its ``Cluster`` and refshare keys its ``DataProto`` as
ROLL's.

One step of RLVR with GAE (``roll/pipeline/rlvr/rlvr_pipeline.py``) on three clusters of
dp 2 x tp 2 (12 workers), with a batch as ``roll_mirror.make_batch`` has it: 64 rows of 1024
prompt and 3072 response tokens (prompts, responses, input_ids, attention_mask,
response_mask, position_ids int64 and prompt_id; domain and sample_uuid object arrays;
``meta_info``). ``reference.compute_log_probs``, its ``log_probs`` renamed ``ref_log_probs``
and ``union``-ed into the batch; ``critic.compute_values``, ``values`` union-ed in;
``actor_train.train_step`` on the grown batch. Each call as RLVR makes it
(``blocking=False``, then ``DataProto.materialize_concat``), with ROLL's dispatch for it:
the actor worker's methods (the reference cluster's too) ``DP_MP_DISPATCH_FIRST``, the chunk
to TP rank 0 and ``meta_info`` alone to the other; the critic's ``DP_MP_COMPUTE``, the chunk
to both. Workers only checksum what they received and compute the new key cheaply.
Strategies, interleaved per step: **plain**; **refshare** (top-level, ``deep=False``),
**deep** (``deep=True``) and the **default**, each through ``refshare.enable("roll")``; and
**plain again**, ROLL untouched timed once more, whose ratio to plain is the run's noise.

    python benchmarks/roll_step.py           # about 2 minutes
    python benchmarks/roll_step.py --smoke   # tiny batch: seconds
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from _harness import session, steps
from _harness.report import TIMES, MiB
from _harness.step_report import goals, setup_lines, step_report
from _harness.steps import Turn

steps.mirrors_importable()  # the mirror, by reference in every worker, as ROLL's package is
import roll_mirror  # noqa: E402
from roll_mirror import (  # noqa: E402
    Cluster,
    DataProto,
    Dispatch,
    RankInfo,
    TensorDict,
    Worker,
    WorkerConfig,
    register,
)


def publish() -> None:
    """The mirror under ROLL's module names in this process, once (this module runs twice in
    the driver: as ``__main__``, then imported)."""
    cluster = sys.modules.get("roll.distributed.executor.cluster")
    if getattr(cluster, "Cluster", None) is not Cluster:
        roll_mirror.publish_as_roll()


publish()  # here, so that each worker has it before it unpickles a DataProto

DP, TP = roll_mirror.DP, roll_mirror.TP
WORLD = DP * TP  # ranks per cluster, dp-major: rank = dp_rank * TP + tp_rank
ACTOR_CPUS = 0.01  # what the mirror's Cluster gives each rank, as ROLL's does
INLINE_BYTES = 100 * 1024  # Ray sends a by-value argument up to this size inline, unstored
#: The step's calls, in order: each one's cluster, and the dispatch its method is registered
#: with in ROLL.
CALLS: dict[str, tuple[str, Dispatch]] = {
    "compute_log_probs": ("reference", Dispatch.DP_MP_DISPATCH_FIRST),
    "compute_values": ("critic", Dispatch.DP_MP_COMPUTE),
    "train_step": ("actor_train", Dispatch.DP_MP_DISPATCH_FIRST),
}
#: The keys a call's output adds to the batch, renamed as RLVR renames them.
ADDS = {"compute_log_probs": {"log_probs": "ref_log_probs"}, "compute_values": {"values": "values"}}
LABELS = {name: f"{cluster} `{name}`" for name, (cluster, _) in CALLS.items()}


@dataclass(frozen=True)
class Config:
    mode: str
    rows: int  # sequences
    prompt: int  # prompt tokens a row
    response: int  # response tokens a row
    steps: int  # timed steps
    warmup: int  # untimed steps first
    store_bytes: int
    budget: str = "default"  # each cache's: see options.step_parser


MODES = {
    # 61 steps, as rl_step (which says why): about 100 s here, the batch being small.
    "full": Config("full", 64, 1024, 3072, steps=61, warmup=2, store_bytes=2 << 30),
    "quick": Config("quick", 64, 1024, 3072, steps=9, warmup=1, store_bytes=1 << 30),
    "smoke": Config("smoke", 8, 1024, 3072, steps=2, warmup=1, store_bytes=128 * MiB),
}


# -- the worker: receives, checksums, computes its key cheaply --------------------------------


class RLVRWorker(Worker):
    """A rank of any of the three clusters, with the methods RLVR calls on each."""

    def __init__(self, worker_config: WorkerConfig) -> None:
        super().__init__(worker_config=worker_config)
        self.rank_info = RankInfo(world_size=self.world_size, tp_size=TP, dp_size=DP,
                                  rank=self.rank, tp_rank=self.rank % TP,
                                  dp_rank=self.rank // TP)  # fmt: skip
        self.received: list[int] = []

    def touch(self, array: np.ndarray) -> int:
        return session.touch(array)

    def receive(self, data: DataProto) -> bool:
        """Log a checksum of ``data``; whether it holds a batch (dispatching first, only TP
        rank 0's does: the others compute on what it broadcasts)."""
        self.received.append(roll_mirror.checksum(data))
        return data._batch is not None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def initialize(self, pipeline_config: Any) -> None:
        self.pipeline_config = pipeline_config

    @register(dispatch_mode=Dispatch.DP_MP_DISPATCH_FIRST)
    def compute_log_probs(self, data: DataProto) -> DataProto:
        if not self.receive(data):
            return DataProto(meta_info={})
        log_probs = (data.batch["input_ids"][:, 1:] % 97).float() * -1e-2
        return DataProto.from_dict(tensors={"log_probs": log_probs})

    @register(dispatch_mode=Dispatch.DP_MP_COMPUTE)
    def compute_values(self, data: DataProto) -> DataProto:
        self.receive(data)
        values = (data.batch["input_ids"][:, 1:] % 13).float() * 0.1
        return DataProto.from_dict(tensors={"values": values})

    @register(dispatch_mode=Dispatch.DP_MP_DISPATCH_FIRST)
    def train_step(self, data: DataProto) -> DataProto:
        loss = float(data.batch["values"][:, 0].mean()) if self.receive(data) else 0.0
        return DataProto(meta_info={"metrics": {"actor/loss": loss}})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def take_received(self) -> list[int]:
        received, self.received = self.received, []
        return received


# -- one step ---------------------------------------------------------------------------------


def make_batch(config: Config, step: int) -> DataProto:
    """New content every step (the same for every strategy of a step)."""
    parts = roll_mirror.make_batch(step, config.rows, config.prompt, config.response)
    return DataProto.from_dict(*parts)


def call(cluster: Cluster, method: str, batch: DataProto) -> DataProto:
    """A cluster's method as RLVR calls these: ``blocking=False``, then every rank's output
    fetched and the collected ones concatenated."""
    return DataProto.materialize_concat(getattr(cluster, method)(batch, blocking=False))


def union(batch: DataProto, output: DataProto, renamed: dict[str, str]) -> None:
    """``output.rename(...)`` then ``batch.union(output)`` (protocol.py l.705-790), as RLVR
    takes a call's keys in: the tensors added to the batch's TensorDict, in place."""
    for key, value in output._batch.items():
        batch._batch[renamed[key]] = value


def sent_copy(batch: DataProto) -> DataProto:
    """The batch as a call sent it: its tensors and ``meta_info`` then (the batch grows)."""
    tensors = TensorDict(dict(batch._batch.items()), batch_size=batch._batch.batch_size)
    return DataProto(tensors, batch._non_tensor_batch, None, dict(batch.meta_info))


def run_step(clusters: dict[str, Cluster], batch: DataProto, strategy: str, sharing: Any) -> Turn:
    """One RLVR step under ``strategy``: each call's seconds, bytes stored, checksums."""
    sent: dict[str, DataProto] = {}
    with sharing.on(strategy) as turn:
        for name, (cluster, _) in CALLS.items():
            output = turn.call(name, call, clusters[cluster], name, batch)
            sent[name] = sent_copy(batch)
            if name in ADDS:
                union(batch, output, ADDS[name])
        turn.finish()
    turn.received = {name: cluster.take_received() for name, cluster in clusters.items()}
    check_received(turn.received)
    turn.distinct = sum(t.nbytes for _, t in batch._batch.items())
    if not turn.by_value:  # what refshare or the ideal stored is counted already
        return turn
    # What plain stores, counted now (untimed): what each rank's .remote() got by value, once
    # per rank, where it is too large to go inline.
    for name, data in sent.items():
        cluster, dispatch = CALLS[name]
        dispatch_fn = roll_mirror.predefined_dispatch_mode_fn[dispatch]["dispatch_fn"]
        (per_rank,), _ = dispatch_fn(clusters[cluster], data)
        sizes = [steps.by_value_bytes([chunk]) for chunk in per_rank]
        turn.store(name, sum(size for size in sizes if size > INLINE_BYTES))
    return turn


def check_received(received: dict[str, list[list[int]]]) -> None:
    """Each cluster's DP ranks got different chunks, and the other ranks of a DP group its
    chunk (``DP_MP_COMPUTE``) or not (dispatching first, ``meta_info`` alone)."""
    dispatch = dict(CALLS.values())
    for cluster, ranks in received.items():
        leads = [ranks[rank - rank % TP] for rank in range(WORLD)]
        same = [ranks[rank] == leads[rank] for rank in range(WORLD) if rank % TP]
        shares = dispatch[cluster] is Dispatch.DP_MP_COMPUTE
        if len({tuple(lead) for lead in leads}) != DP or not all(s == shares for s in same):
            raise RuntimeError(f"{cluster}: ranks received unexpected chunks: {ranks}")


def run(config: Config) -> dict[str, Any]:
    clusters = {
        name: Cluster(name, RLVRWorker, None, WorkerConfig(name=name, world_size=WORLD))
        for name, _ in CALLS.values()
    }
    sharing = steps.Sharing([(Cluster, ("execute_all_async", "execute_rank_zero_async"))], "roll")
    try:
        for cluster in clusters.values():
            cluster.initialize(pipeline_config=None)
        workers = [worker for cluster in clusters.values() for worker in cluster.workers]

        def turn(strategy: str, step: int) -> Turn:
            return run_step(clusters, make_batch(config, step), strategy, sharing)

        _, record = steps.replay("roll", workers, config, turn, tuple(CALLS), sharing=sharing)
    finally:
        for cluster in clusters.values():
            session.stop_group(cluster)
    batch_type = "stand-in" if not roll_mirror.HAS_TENSORDICT else "tensordict"
    return {
        "patch": sharing.how,
        "tensordict": f"{batch_type} {roll_mirror.tensordict.__version__}",
        **record,
        "goals": goals(record["summary"], broadcast_hit=None),
    }


def report(results: dict[str, Any]) -> str:
    c, r = results["config"], results["result"]
    same = all(r["checksums_same_every_step"])
    rows, seq = c["rows"], c["prompt"] + c["response"]
    labels = {"step": "**whole step**", **LABELS}
    lines = ["# ROLL step replay: reference log-probs, critic values, actor train", ""]
    workers = (
        f"{3 * WORLD} workers of {ACTOR_CPUS} CPU (three clusters, reference, critic and "
        f"actor_train, each dp {DP} {TIMES} tp {TP})"
    )
    lines += setup_lines(results, workers, steps.STRATEGIES)
    lines += [
        f"Batch: a `DataProto` of {rows} rows ({r['tensordict']} TensorDict): prompts "
        f"[{rows}, {c['prompt']}], responses and response_mask [{rows}, {c['response']}], "
        f"input_ids, attention_mask, position_ids [{rows}, {seq}] int64, prompt_id; domain and "
        f"sample_uuid object arrays; `meta_info`. `ref_log_probs` [{rows}, {seq - 1}] float32 "
        "added after reference `compute_log_probs` (its `log_probs`, renamed), `values` "
        "(the same shape) after critic `compute_values`; then actor_train `train_step`. Each "
        "call is RLVR's (`blocking=False`, then `DataProto.materialize_concat`): the dispatch "
        f"chunks the batch once per DP rank (`chunk` clones the rows) and sends each chunk by "
        "value: to TP rank 0 only for the actor worker's methods (`DP_MP_DISPATCH_FIRST`, the "
        "other rank gets `meta_info` alone), to both TP ranks for the critic's "
        "(`DP_MP_COMPUTE`).",
        "",
        f"Mirror of {roll_mirror.MIRRORS}, in `tests/mirrors/roll_mirror.py`, published under "
        f'ROLL\'s module names; refshare on for its turns only, through `refshare.enable("roll")`: '
        f"{r['patch']}.",
        "",
        *step_report(r["summary"], labels, r["goals"], "Goals (the RL-step ones)"),
        f"- Checksums of everything each worker received, every step: "
        f"{'identical under every strategy' if same else 'DIFFER'}.",
        "",
        "Times include chunking (ROLL clones each chunk's rows), serialization (`torch.save` "
        "of each chunk, once per rank it goes to), puts, transfer, the workers' checksum and "
        "the concatenation of the collected outputs. Each call chunks the batch anew and it "
        "gained a key since the last, so top-level sharing finds a repeat only where both TP "
        "ranks get one chunk (the critic's); deep sharing stores the unchanged tensors once a "
        "step, whichever call sends them.",
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    return steps.replay_main("roll_step.py", __doc__ or "", MODES, run, report, argv)


if __name__ == "__main__":
    # Run from the module, not __main__, so that its worker pickles by reference (as ROLL's
    # do from its package) and each worker publishes the mirror as it imports it.
    import roll_step

    sys.exit(roll_step.main())
