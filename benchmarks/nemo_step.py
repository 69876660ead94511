"""NeMo-RL step replay: policy log-probs, reference log-probs and train, plain, refshare, deep.

NeMo-RL ships no package to install here, so the parts that decide transport are mirrored
from NeMo-RL main (commit 7ea279a), in ``tests/mirrors/nemo_rl_mirror.py`` (used here with
batches of torch tensors, as NeMo-RL's are): ``nemo_rl/distributed/batched_data_dict.py``
(``BatchedDataDict``, a ``collections.UserDict``; ``shard_by_batch_size`` without dynamic
batching, which copies each shard's rows) and ``nemo_rl/distributed/worker_groups.py``
(``RayWorkerGroup.run_all_workers_sharded_data``, which ``ray.put``s every DP shard when a
replicated axis has more than one rank, and the other three ``run_*`` methods). The policy
calls are ``lm_policy.Policy``'s: shard by DP, run on every worker, gather from TP rank 0.

One GRPO step on dp 2 x tp 2 (4 workers), with a batch of 256 sequences: input_ids,
attention_mask, position_ids, token_mask [256, 2048] int64, advantages [256, 2048] float32,
input_lengths and sample_mask [256]. The batch gains a [256, 2048] float32 key after each
call: ``get_logprobs`` (then ``prev_logprobs``), ``get_reference_policy_logprobs`` (then
``reference_policy_logprobs``), ``train``. Workers only checksum what they received and
compute the new key cheaply. Strategies, interleaved per step: **plain**, **refshare** and
**deep** (``deep=True``), both as ``refshare.patch_methods`` of the four ``run_*`` names,
which is what ``refshare.enable("nemo_rl")`` wraps; and **plain again**, NeMo-RL untouched
timed once more, whose ratio to plain is the run's own noise.

    python benchmarks/nemo_step.py           # about 3 minutes
    python benchmarks/nemo_step.py --smoke   # tiny batch: seconds
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch
import xxhash
from _harness import session, steps
from _harness.report import TIMES, MiB
from _harness.step_report import goals, setup_lines, step_report
from _harness.steps import Turn

CALLS = ("get_logprobs", "get_reference_policy_logprobs", "train")
RUN_METHODS = ("run_all_workers_single_data", "run_all_workers_multiple_data")
RUN_METHODS += ("run_all_workers_sharded_data", "run_single_worker_single_data")
AXES = ["pipeline_parallel", "data_parallel", "context_parallel", "tensor_parallel"]
REPLICATED = ["context_parallel", "tensor_parallel", "pipeline_parallel"]
LAYOUT = np.arange(4).reshape(1, 2, 1, 2)  # pp 1, dp 2, cp 1, tp 2, as lm_policy.py lays out
DP, WORLD, ACTOR_CPUS = 2, 4, 0.25
INT_KEYS = ("input_ids", "attention_mask", "position_ids", "token_mask")  # [batch, seq] int64


@dataclass(frozen=True)
class Config:
    mode: str
    batch: int  # sequences
    seq_len: int  # every [batch, seq_len] key
    steps: int  # timed steps
    warmup: int  # untimed steps first
    store_bytes: int
    budget: str = "default"  # each cache's: see options.step_parser


MODES = {
    "full": Config("full", 256, 2048, steps=61, warmup=2, store_bytes=2 << 30),  # see rl_step
    "quick": Config("quick", 256, 2048, steps=9, warmup=1, store_bytes=1 << 30),
    "smoke": Config("smoke", 16, 2048, steps=2, warmup=1, store_bytes=128 * MiB),
}


# -- NeMo-RL main (7ea279a), mirrored once, in tests/mirrors/nemo_rl_mirror.py ----------------

nemo = steps.mirror("nemo_rl_mirror")
BatchedDataDict, NamedSharding, RayWorkerGroup = (
    nemo.BatchedDataDict,
    nemo.NamedSharding,
    nemo.RayWorkerGroup,
)


def policy_call(group: RayWorkerGroup, method: str, data: BatchedDataDict, **common: Any) -> Any:
    """What ``lm_policy.Policy``'s methods do: shard by DP, run everywhere, gather TP rank 0."""
    futures = group.run_all_workers_sharded_data(
        method, data=data.shard_by_batch_size(DP, batch_size=None),
        in_sharded_axes=["data_parallel"], replicate_on_axes=REPLICATED,
        output_is_replicated=REPLICATED, common_kwargs=common,
    )  # fmt: skip
    results = group.get_all_worker_results(futures)
    return BatchedDataDict.from_batches(results) if method != "train" else results


# -- the worker: receives, checksums, computes a new key cheaply ------------------------------


def checksum(data: Any) -> int:
    """xxh3-64 of a shard: its type, attributes, and every tensor's name, dtype, shape, bytes."""
    h = xxhash.xxh3_64(f"{type(data).__name__} {sorted(vars(data).items())!r}".encode())
    for key in sorted(data):
        tensor = data[key]
        h.update(f"{key} {tensor.dtype} {tuple(tensor.shape)}".encode())
        h.update(tensor.contiguous().numpy())
    return h.intdigest()


class PolicyWorker:
    def __init__(self) -> None:
        self.received: list[int] = []

    def touch(self, array: np.ndarray) -> int:
        return session.touch(array)

    def get_logprobs(self, data: Any, **_: Any) -> dict[str, torch.Tensor]:
        self.received.append(checksum(data))
        return {"logprobs": (data["input_ids"] % 97).float() * -1e-2}

    def get_reference_policy_logprobs(self, data: Any, **_: Any) -> dict[str, torch.Tensor]:
        self.received.append(checksum(data))
        return {"reference_logprobs": data["prev_logprobs"] * 0.9}

    def train(self, data: Any, **_: Any) -> dict[str, float]:
        self.received.append(checksum(data))
        return {"loss": float(data["advantages"][:, 0].mean()), "grad_norm": 1.0}

    def take_received(self) -> list[int]:
        received, self.received = self.received, []
        return received


# -- one step ---------------------------------------------------------------------------------


def rollout(config: Config, step: int) -> BatchedDataDict:
    """New content every step (the same for every strategy of a step)."""
    g = torch.Generator().manual_seed(step)
    shape = (config.batch, config.seq_len)
    data = {k: torch.randint(0, 32_000, shape, generator=g) for k in INT_KEYS}
    data["advantages"] = torch.randn(shape, generator=g)
    data["input_lengths"] = torch.full((config.batch,), config.seq_len)
    data["sample_mask"] = torch.ones(config.batch)
    return BatchedDataDict(data)


def run_step(group: RayWorkerGroup, data: BatchedDataDict, strategy: str, sharing: Any) -> Any:
    """One GRPO step under ``strategy``: each call's seconds, bytes stored, checksums."""
    sent: dict[str, list[str]] = {}  # the keys each call sent (the batch grows)
    with sharing.on(strategy) as turn:

        def call(name: str, **common: Any) -> Any:
            sent[name] = list(data)
            return turn.call(name, policy_call, group, name, data, **common)

        data["prev_logprobs"] = call("get_logprobs")["logprobs"]
        ref = call("get_reference_policy_logprobs", micro_batch_size=4)
        data["reference_policy_logprobs"] = ref["reference_logprobs"]
        call("train", loss_fn="ClippedPGLossFn", eval_mode=False, gbs=len(data["input_ids"]))
        turn.finish()
    turn.received = ray.get([w.take_received.remote() for w in group.workers])
    if not turn.received[0] == turn.received[1] != turn.received[2] == turn.received[3]:
        raise RuntimeError("the TP ranks of a DP rank should receive the same shards, and only")
    turn.distinct = sum(v.nbytes for v in data.values())
    if not turn.by_value:  # what refshare or the ideal stored is counted already
        return turn
    # What plain stores, counted now (untimed): each DP shard once per call, by NeMo-RL's puts.
    for name, keys in sent.items():
        shards = BatchedDataDict({k: data[k] for k in keys}).shard_by_batch_size(DP)
        turn.store(name, steps.by_value_bytes(shards))
    return turn


def run(config: Config) -> dict[str, Any]:
    actor_cls = ray.remote(num_cpus=ACTOR_CPUS)(PolicyWorker)
    workers = [actor_cls.remote() for _ in range(WORLD)]
    group = RayWorkerGroup(workers, NamedSharding(LAYOUT, AXES))
    sharing = steps.Sharing([(RayWorkerGroup, RUN_METHODS)])

    def turn(strategy: str, step: int) -> Turn:
        return run_step(group, rollout(config, step), strategy, sharing)

    try:
        _, record = steps.replay("nemo", workers, config, turn, CALLS, sharing=sharing)
    finally:
        session.stop_group(group)
    return {"patch": sharing.how, **record, "goals": goals(record["summary"], broadcast_hit=None)}


def report(results: dict[str, Any]) -> str:
    c, r = results["config"], results["result"]
    same = all(r["checksums_same_every_step"])
    lines = ["# NeMo-RL step replay: log-probs, reference log-probs, train", ""]
    workers = f"{WORLD} workers of {ACTOR_CPUS} CPU (dp {DP} {TIMES} tp {WORLD // DP})"
    lines += setup_lines(results, workers, steps.STRATEGIES)
    lines += [
        f"Batch: a `BatchedDataDict` of {c['batch']} sequences: {', '.join(INT_KEYS)} "
        f"[{c['batch']}, {c['seq_len']}] int64, advantages [{c['batch']}, {c['seq_len']}] "
        "float32, input_lengths and sample_mask; `prev_logprobs` added after `get_logprobs`, "
        "`reference_policy_logprobs` after `get_reference_policy_logprobs` (float32, same "
        "shape). Each call shards it by DP (copies of the rows) and `ray.put`s each shard, as "
        "`run_all_workers_sharded_data` does with tp > 1; both TP ranks get the shard's ref.",
        "",
        f"Mirror of NeMo-RL main (7ea279a), in this file; refshare on for its turns only, "
        f'as {r["patch"]} (what `refshare.enable("nemo_rl")` wraps).',
        "",
        *step_report(
            r["summary"], {"step": "**whole step**"}, r["goals"], "Goals (the RL-step ones)"
        ),
        f"- Checksums of every shard each worker received, every step: "
        f"{'identical under every strategy' if same else 'DIFFER'}.",
        "",
        "Times include sharding (NeMo-RL copies each shard's rows), puts, serialization, "
        "transfer, the workers' checksum and gathering (`from_batches`). Every call's shards "
        "are new content as a whole (the batch gained a key), so top-level sharing finds no "
        "repeat within a step; deep sharing stores the unchanged tensors once.",
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    return steps.replay_main("nemo_step.py", __doc__ or "", MODES, run, report, argv)


if __name__ == "__main__":
    # Run from the module, not __main__, so that its classes pickle by reference (as NeMo-RL's
    # do from its package) instead of by value with every put and skeleton.
    import nemo_step

    sys.exit(nemo_step.main())
