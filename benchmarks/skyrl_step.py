"""SkyRL step replay: critic, reference and policy forwards, critic and policy training.

SkyRL 0.4.0's dispatch is mirrored once, in ``tests/mirrors/skyrl_mirror.py``
(``TrainingInputBatch``, ``MeshDispatch``, ``PPORayActorGroup``, ``WorkerDispatch``,
``fwd_logprobs_values_reward``). The training step, which that mirror leaves out, is
mirrored here, from the ``skyrl`` package: ``train/trainer.py`` (the step, 416-442;
``compute_advantages_and_returns``, 1151-1261; ``fwd_logprobs_values_reward``'s end,
1400-1411; ``_normalize_advantages``, 1497-1537; ``_execute_training_step``, 1539-1584;
``train_critic_and_policy``, 1586-1612) and ``backends/skyrl_train/workers/worker_dispatch.py``
(``forward_backward_from_staged``, 400-444; ``optim_step``, 446-461; ``_save_memory_snapshot``,
538-542; ``empty_cache``, 615-623).

One PPO step, with a critic, a reference and a policy of 2 DP ranks each (6 workers), on a batch
of 128 sequences of 4096 tokens (1024 of response), as ``convert_to_training_input`` makes it:
sequences and attention_mask [128, 4096] int64, response_mask [128, 1024] int64, rewards and
loss_mask [128, 1024] float32; 2 mini-batches of 64. ``fwd_logprobs_values_reward`` stages
sequences and attention_mask per mini-batch for the critic, dispatches them to the reference,
stages them again for the policy, and adds values and both log-probs; then advantages and
returns, and ``train_critic_and_policy``: each model stages the whole batch per mini-batch and
DP rank, the policy with its advantages normalized first, and runs ``forward_backward`` and
``optim_step`` per mini-batch. Workers only checksum what they receive and answer cheaply.
Strategies, interleaved per step: **plain**, **refshare** (``deep=False``), **deep**
(``deep=True``) and the **default**, all as ``refshare.patch_methods`` of what
``refshare.enable("skyrl")`` wraps (``PPORayActorGroup.async_run_ray_method`` and the
classmethod ``MeshDispatch.stage_chunks``); and **plain again**, SkyRL untouched timed once
more, whose ratio to plain is the run's own noise.

    python benchmarks/skyrl_step.py           # about 2 minutes
    python benchmarks/skyrl_step.py --smoke   # 16 sequences: seconds
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch
from _harness import session, steps
from _harness.report import MiB
from _harness.step_report import goals, setup_lines, step_report
from _harness.steps import Turn

CALLS = ("fwd_logprobs_values_reward", "critic_train", "policy_train")  # SkyRL's own timers
MODELS = ("critic", "ref", "policy")
SCALES = {"critic": 0.5, "ref": -1.1, "policy": -1.0}  # so each model's outputs differ
DP, ACTOR_CPUS = 2, 0.1
MINI_BATCHES = 2  # per step, for critic and policy
SAMPLES_PER_PROMPT = 8  # (SkyRL's default is 5; 8 divides the batch)
UPDATE_EPOCHS = 1  # trainer.update_epochs_per_batch
FWD_KEYS = ["sequences", "attention_mask"]  # (the optional fields are None here, so left out)


@dataclass(frozen=True)
class Config:
    mode: str
    batch: int  # sequences
    seq_len: int  # sequences and attention_mask
    response_len: int  # response_mask, rewards, loss_mask and every key the step adds
    steps: int  # timed steps
    warmup: int  # untimed steps first
    store_bytes: int
    budget: str = "default"  # each cache's: see options.step_parser


MODES = {
    # 61 steps, as rl_step; 3 GiB, as each of the three caches may keep a quarter of it
    "full": Config("full", 128, 4096, 1024, steps=61, warmup=2, store_bytes=3 << 30),
    "quick": Config("quick", 128, 4096, 1024, steps=9, warmup=1, store_bytes=1 << 30),
    # smoke: few rows, but chunks above refshare's 100 KiB threshold, so that it shares them
    "smoke": Config("smoke", 16, 4096, 1024, steps=2, warmup=1, store_bytes=128 * MiB),
}


# -- SkyRL 0.4.0, mirrored once, in tests/mirrors/skyrl_mirror.py ----------------------------

skyrl = steps.mirror("skyrl_mirror")
TrainingInputBatch, MeshDispatch, PPORayActorGroup, WorkerDispatch = (
    skyrl.TrainingInputBatch,
    skyrl.MeshDispatch,
    skyrl.PPORayActorGroup,
    skyrl.WorkerDispatch,
)
#: What ``refshare.enable("skyrl")`` wraps, on the mirror's classes.
TARGETS = [
    (getattr(skyrl, target.owner), target.methods)
    for target in skyrl.skyrl_integration.FRAMEWORK.layouts[0]
]


# -- SkyRL 0.4.0's training step, mirrored here -----------------------------------------------


class TrainDispatch(WorkerDispatch):  # type: ignore[misc,valid-type]
    """``WorkerDispatch`` with its training calls (no colocation to offload, no LoRA adapter)."""

    def forward_backward_from_staged(self, model: str, chunk_refs: list[Any]) -> dict[str, float]:
        actor_infos = self._actor_groups[model].actor_infos
        refs = MeshDispatch.dispatch_from_staged(
            actor_infos, "forward_backward", chunk_refs=chunk_refs
        )
        status: dict[str, float] = ray.get(refs)[0]  # WorkerOutput.cat: all-reduced already
        self._save_memory_snapshot(model, "forward_backward")
        return status

    def optim_step(self, model: str) -> float | None:
        refs = self._actor_groups[model].async_run_ray_method("pass_through", "optim_step")
        grad_norm: float | None = ray.get(refs)[0]
        self._save_memory_snapshot(model, "optim_step")
        return grad_norm

    def _save_memory_snapshot(self, model: str, tag: str) -> None:
        tag = f"{model}_{tag}"
        group = self._actor_groups[model]
        ray.get(group.async_run_ray_method("pass_through", "save_memory_snapshot", tag=tag))

    def empty_cache(self, model: str | None = None) -> None:
        if model is not None:
            super().empty_cache(model)
            return
        groups = self._actor_groups.values()
        ray.get([r for g in groups for r in g.async_run_ray_method("pass_through", "empty_cache")])


def forward_pass(dispatch: TrainDispatch, data: Any) -> Any:
    """``fwd_logprobs_values_reward``: the mirror's three forwards, then every group's cache
    emptied and the outputs added to the batch."""
    outputs = skyrl.fwd_logprobs_values_reward(dispatch, data)
    dispatch.empty_cache()
    rows = len(data["sequences"])
    data["base_action_log_probs"] = torch.from_numpy(outputs["ref"][:rows])
    data["action_log_probs"] = torch.from_numpy(outputs["policy"][:rows])
    data["values"] = torch.from_numpy(outputs["values"][:rows])
    return data


def compute_advantages_and_returns(data: Any) -> Any:
    """Adds ``returns`` and ``advantages`` and their metrics, as SkyRL does; the estimator is
    a cheap one of the same shapes (GAE with gamma = lambda = 1)."""
    rewards, mask = data["rewards"], data["response_mask"]
    returns = rewards.flip(-1).cumsum(-1).flip(-1) * mask
    data["returns"] = returns
    data["advantages"] = (returns - data["values"]) * mask
    valid = torch.masked_select(data["advantages"], mask.bool())
    data.metadata.setdefault("metrics", {}).update(
        avg_final_rewards=rewards.sum(-1).mean().item(),
        avg_response_length=data.metadata["avg_response_length"],
        avg_advantages=valid.mean().item(),
        avg_advantages_abs=valid.abs().mean().item(),
    )
    return data


def normalize_advantages(data: Any, boundaries: list[tuple[int, int]]) -> Any:
    """``_normalize_advantages`` with SkyRL's defaults (no batch normalization, loss reduction
    ``token_mean``): a new tensor, each mini-batch's advantages over its loss tokens."""
    normalized = torch.zeros_like(data["advantages"])
    for start, end in boundaries:
        mini_batch = data[start:end]
        tokens = mini_batch["loss_mask"].sum().clamp(min=1)
        normalized[start:end] = mini_batch["advantages"] / tokens
    data["advantages"] = normalized
    return data


def execute_training_step(dispatch: TrainDispatch, model: str, data: Any) -> dict[str, float]:
    """``_execute_training_step``: every mini-batch's DP chunks staged first, then per
    mini-batch ``forward_backward`` and an optimizer step."""
    boundaries = data.metadata[f"{model}_mini_batch_boundaries"]
    if model == "policy":
        data = normalize_advantages(data, boundaries)
    metrics: dict[str, list[float]] = defaultdict(list)
    all_chunk_refs = dispatch.stage_data(model, data, boundaries)
    for _epoch in range(UPDATE_EPOCHS):
        for chunk_refs in all_chunk_refs:
            status = dispatch.forward_backward_from_staged(model, chunk_refs)
            for k, v in status.items():
                metrics[k].append(v)
            grad_norm = dispatch.optim_step(model)
            if grad_norm is not None:
                metrics["grad_norm"].append(grad_norm)
    return {k: sum(v) / len(v) for k, v in metrics.items()}  # reduce_metrics


# -- the worker: receives, checksums, answers cheaply -----------------------------------------


class Worker:
    """A critic, reference or policy worker: logs skyrl_mirror's checksum of every batch."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.received: list[int] = []

    def touch(self, array: np.ndarray) -> int:
        return session.touch(array)

    def forward(self, data: Any) -> np.ndarray:
        self.received.append(skyrl.checksum(data))
        response = np.asarray(data["sequences"][:, -data.metadata["response_length"] :])
        out: np.ndarray = (np.log1p(response % 97) * self.scale).astype(np.float32)
        return out

    def forward_backward(self, data: Any) -> dict[str, float]:
        self.received.append(skyrl.checksum(data))
        return {"policy_loss": float(data["advantages"].sum()) * self.scale}

    def optim_step(self) -> float:
        return 1.0

    def save_memory_snapshot(self, tag: str = "") -> None:
        pass  # trainer.record_memory is off by default

    def empty_cache(self) -> None:
        pass

    def take_received(self) -> list[int]:
        received, self.received = self.received, []
        return received


# -- one step ---------------------------------------------------------------------------------


def rollout(config: Config, step: int) -> Any:
    """A new batch every step (the same for every strategy of a step), laid out as
    ``convert_to_training_input`` lays it out: left-padded sequences, right-aligned responses."""
    g = torch.Generator().manual_seed(step)
    rows, total, response = config.batch, config.seq_len, config.response_len
    response_lens = torch.randint(response // 4, response + 1, (rows, 1), generator=g)
    prompt_lens = torch.randint(total // 8, total - response + 1, (rows, 1), generator=g)
    real_lens = prompt_lens + response_lens
    attention_mask = (torch.arange(total) >= total - real_lens).long()
    response_mask = (torch.arange(response) >= response - response_lens).long()
    rewards = torch.zeros(rows, response)
    rewards[:, -1] = torch.rand(rows, generator=g)  # an outcome reward, on the last token
    data = TrainingInputBatch({
        "sequences": torch.randint(1, 32_000, (rows, total), generator=g) * attention_mask,
        "attention_mask": attention_mask,
        "response_mask": response_mask,
        "rewards": rewards,
        "loss_mask": response_mask.float(),
    })  # fmt: skip
    size = rows // MINI_BATCHES
    mini_batches = [(start, start + size) for start in range(0, rows, size)]
    data.metadata = {
        "uids": [f"{step}-{row // SAMPLES_PER_PROMPT}" for row in range(rows)],
        "policy_mini_batch_boundaries": mini_batches,
        "policy_prompt_boundaries": [
            (start, start + SAMPLES_PER_PROMPT) for start in range(0, rows, SAMPLES_PER_PROMPT)
        ],
        "critic_mini_batch_boundaries": mini_batches,
        "response_length": response,
        "avg_response_length": response_lens.float().mean().item(),
    }
    return data


def staged(data: Any, boundaries: list[tuple[int, int]]) -> list[Any]:
    """The chunks ``MeshDispatch.stage_chunks`` puts: each mini-batch's, one per DP rank."""
    return [chunk for s, e in boundaries for chunk in data[s:e].chunk((e - s) // DP)]


def run_step(
    dispatch: TrainDispatch,
    workers: Sequence[Any],
    data: Any,
    step: int,
    strategy: str,
    sharing: steps.Sharing,
) -> Turn:
    """One PPO step under ``strategy``: each call's seconds, bytes stored, checksums."""
    with sharing.on(strategy) as turn:
        turn.call("fwd_logprobs_values_reward", forward_pass, dispatch, data)
        compute_advantages_and_returns(data)
        data.pop("rewards")
        data.metadata.pop("uids")
        data.metadata["global_step"] = step  # train_critic_and_policy from here
        critic_sent = data.select(list(data))  # the policy's advantages are replaced after it
        turn.call("critic_train", execute_training_step, dispatch, "critic", data)
        turn.call("policy_train", execute_training_step, dispatch, "policy", data)
        dispatch.empty_cache()
        turn.finish()
    turn.received = ray.get([w.take_received.remote() for w in workers])
    staged_twice = MINI_BATCHES * (1 + UPDATE_EPOCHS)  # a forward, then training
    per_model = {"critic": staged_twice, "ref": 1, "policy": staged_twice}
    if [len(r) for r in turn.received] != [per_model[m] for m in MODELS for _ in range(DP)]:
        raise RuntimeError(f"each worker should receive its chunks once: {turn.received}")
    fwd_sent = data.select(FWD_KEYS, metadata_keys=["response_length"])
    sent = {id(t): t for batch in (fwd_sent, critic_sent, data) for t in batch.values()}
    turn.distinct = sum(t.nbytes for t in sent.values())
    if not turn.by_value:  # what refshare or the ideal stored is counted already
        return turn
    # What plain stores, counted now (untimed): every chunk SkyRL puts, once per put.
    meta = data.metadata
    fwd = [
        *staged(fwd_sent, meta["critic_mini_batch_boundaries"]),
        *fwd_sent.chunk(len(fwd_sent) // DP),  # the reference's, by MeshDispatch.dispatch
        *staged(fwd_sent, meta["policy_mini_batch_boundaries"]),
    ]
    turn.store("fwd_logprobs_values_reward", steps.by_value_bytes(fwd))
    critic = staged(critic_sent, meta["critic_mini_batch_boundaries"])
    turn.store("critic_train", steps.by_value_bytes(critic))
    policy = staged(data, meta["policy_mini_batch_boundaries"])
    turn.store("policy_train", steps.by_value_bytes(policy))
    return turn


def run(config: Config) -> dict[str, Any]:
    actor_cls = ray.remote(num_cpus=ACTOR_CPUS)(Worker)
    groups = {
        model: PPORayActorGroup([actor_cls.remote(SCALES[model]) for _ in range(DP)], dp_size=DP)
        for model in MODELS
    }
    workers = [worker for group in groups.values() for worker in group._actor_handlers]
    dispatch = TrainDispatch(groups)
    sharing = steps.Sharing(TARGETS)

    def turn(strategy: str, step: int) -> Turn:
        return run_step(dispatch, workers, rollout(config, step), step, strategy, sharing)

    try:
        _, record = steps.replay("skyrl", workers, config, turn, CALLS, sharing=sharing)
    finally:
        for worker in workers:
            ray.kill(worker)
    return {"patch": sharing.how, **record, "goals": goals(record["summary"], broadcast_hit=None)}


def report(results: dict[str, Any]) -> str:
    c, r = results["config"], results["result"]
    rows, total, response = c["batch"], c["seq_len"], c["response_len"]
    same = all(r["checksums_same_every_step"])
    lines = ["# SkyRL step replay: forwards, critic and policy training", ""]
    workers = f"{len(MODELS) * DP} workers of {ACTOR_CPUS} CPU (critic, reference, policy: dp {DP})"
    lines += setup_lines(results, workers, steps.STRATEGIES)
    lines += [
        f"Batch: a `TrainingInputBatch` of {rows} sequences: sequences and attention_mask "
        f"[{rows}, {total}] int64, response_mask [{rows}, {response}] int64, rewards and "
        f"loss_mask [{rows}, {response}] float32; {MINI_BATCHES} mini-batches of "
        f"{rows // MINI_BATCHES} for critic and policy. `fwd_logprobs_values_reward` sends "
        "sequences and attention_mask to the critic (staged per mini-batch), the reference "
        "(mesh dispatch: one chunk per DP rank) and the policy (staged), and adds values, "
        f"base_action_log_probs and action_log_probs [{rows}, {response}] float32; then "
        "returns and advantages are added and rewards dropped. `critic_train` and "
        "`policy_train` (`_execute_training_step`) each stage the whole batch per mini-batch "
        "and DP rank, the policy's with its advantages normalized (a new tensor), and run "
        "`forward_backward`, `optim_step` and the memory-snapshot calls per mini-batch.",
        "",
        "Mirror of SkyRL 0.4.0 (`tests/mirrors/skyrl_mirror.py`, its training step in this file); "
        f"refshare on for its turns only, as {r['patch']} (what "
        '`refshare.enable("skyrl")` wraps; `stage_chunks` is a classmethod).',
        "",
        *step_report(
            r["summary"], {"step": "**whole step**"}, r["goals"], "Goals (the RL-step ones)"
        ),
        f"- Checksums of every chunk each worker received, every step: "
        f"{'identical under every strategy' if same else 'DIFFER'}.",
        "",
        "Times include slicing and chunking (views), SkyRL's puts (its batch pickles its "
        "tensors' bytes), transfer, the workers' unpickling and checksum, and gathering the "
        "outputs. Within a step, only the policy's staged forward chunks repeat an earlier "
        "put (the critic's); the reference's chunks cover other rows, and the training chunks "
        "carry the new keys (the policy's its new advantages too). refshare never splits a "
        "SkyRL batch into its tensors (its pickling sends copies of their bytes), so deep "
        "sharing stores each chunk whole, as top-level does; each of the three keeps a "
        "`RefCache` of its own, so that none finds what another stored in the same step.",
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    return steps.replay_main("skyrl_step.py", __doc__ or "", MODES, run, report, argv)


if __name__ == "__main__":
    # Run from the module, not __main__, so that its classes pickle by reference (as SkyRL's
    # do from its package) instead of by value with every put.
    import skyrl_step

    sys.exit(skyrl_step.main())
