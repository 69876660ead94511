"""OpenRLHF 0.11.2's RayActorGroup, mirrored: one rollout for four model groups, with refshare.

Mirrored from OpenRLHF 0.11.2:

* ``openrlhf/trainer/ray/launcher.py`` (the same at main 3c3be623):
  ``BaseModelActor.execute_batch`` (67-101), ``RayActorGroup.async_run_method`` (312-317),
  which sends its arguments by value, and ``async_run_method_batch`` (319-373), which slices
  each list kwarg into one chunk per data-parallel actor and ``ray.put``s each chunk;
* ``openrlhf/trainer/ppo_utils/experience_maker.py``: ``_dispatch_forward`` (100-106),
  ``_flatten_results`` (108-111) and ``make_experience`` (113-233), which send the same lists of
  CPU tensors, one per micro-batch, to the actor, critic and reference groups (and the
  sequences with attention masks to the reward model), each group's calls waited on in turn
  when all models share the GPUs (``colocate_all``);
* ``openrlhf/trainer/ppo_trainer.py``: ``train_step`` (213-264), which sends the
  ``List[Experience]`` (``ppo_utils/experience.py:28-69``, a plain dataclass of tensors) to the
  actor and the critic, and ``ppo_train`` (266-298), ``fit`` by value;
* ``openrlhf/cli/train_ppo_ray.py:19-32``: ``ray.init(runtime_env={"env_vars": {...,
  "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}})``, Ray's zero-copy tensor serializer in every
  worker. Under it a task's tensors are writable views of its object in the object store.

In OpenRLHF the trainer (``PPOTrainer``, ``@ray.remote``, ppo_trainer.py:449) is itself a Ray
worker, so it has the variable from the runtime_env; here the driver plays the trainer, so the
variable is put in its environment before ``ray`` is imported, where Ray reads it. (To use
refshare in OpenRLHF, enable it in that actor: ``worker_process_setup_hook=
"refshare.worker_setup"`` with ``REFSHARE_ENABLE=openrlhf``.) refshare wraps the two methods
``refshare.enable("openrlhf")`` wraps, and stores CPU tensors as their bytes: each worker gets
memory of its own, as by value, though one ref goes to every group.

The check: every worker receives the same with refshare as without it, and when one group's
worker adds 1 in place to a tensor it received, the next groups' workers receive it unchanged.
Needs torch, as OpenRLHF does.

Run: python examples/openrlhf_style.py
"""

from __future__ import annotations

import os

#: OpenRLHF's launcher's env_vars (train_ppo_ray.py:26-30): in the trainer's environment
#: before ``ray`` is imported, and in the runtime_env for the model actors.
ENV_VARS = {
    "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "true"),
    "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"),
    "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": os.environ.get("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1"),
}
os.environ.update(ENV_VARS)

import importlib.util  # noqa: E402
import itertools  # noqa: E402
import zlib  # noqa: E402
from collections import Counter  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

import ray  # noqa: E402
import torch  # noqa: E402

import refshare  # noqa: E402

PUTS: Counter[str] = Counter()  # the example's counters, for the "without refshare" columns


def ray_put(value: Any) -> Any:  # the mirror calls this where OpenRLHF calls ray.put
    PUTS["ray.put"] += 1
    PUTS["ray.put bytes"] += refshare.estimate_size(value)
    return ray.put(value)


# -- OpenRLHF 0.11.2, mirrored -------------------------------------------------------------


@dataclass
class Experience:  # ppo_utils/experience.py:28-69 (fields abridged; no pickling of its own)
    sequences: torch.Tensor | None = None  # (B, T) token ids
    attention_mask: torch.Tensor | None = None  # (B, T)
    action_mask: torch.Tensor | None = None  # (B, A)
    action_log_probs: torch.Tensor | None = None  # (B, A)
    base_action_log_probs: torch.Tensor | None = None  # (B, A)
    values: torch.Tensor | None = None  # (B, A)
    returns: torch.Tensor | None = None  # (B, A)
    advantages: torch.Tensor | None = None  # (B, A)
    kl: torch.Tensor | None = None  # (B, A)
    rewards: torch.Tensor | None = None  # (B,)
    info: dict[str, torch.Tensor] = field(default_factory=dict)


class BaseModelActor:  # launcher.py:54-101 (without the checks and tqdm)
    def execute_batch(
        self, method_name: str, all_data: dict[str, Any], start_idx: int, end_idx: int
    ) -> list[Any]:
        kwargs = {key: value[start_idx:end_idx] for key, value in all_data.items()}
        first_param = next(iter(kwargs.values()))
        list_length = len(first_param)
        func = getattr(self, method_name)
        results = []
        for i in range(list_length):
            sample_kwargs = {
                param_name: param_value[i] for param_name, param_value in kwargs.items()
            }
            results.append(func(**sample_kwargs))
        return results


class RayActorGroup:  # launcher.py:202-373 (the actors made by the caller)
    def __init__(self, actors: list[Any], duplicate_actors: int = 1) -> None:
        self._actor_handlers, self.duplicate_actors = actors, duplicate_actors

    def async_run_method(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        refs = []
        for actor in self._actor_handlers:
            method = getattr(actor, method_name)
            refs.append(method.remote(*args, **kwargs))
        return refs

    def async_run_method_batch(self, method_name: str, **kwargs: Any) -> list[Any]:
        # (checks left out: every kwarg has the same length, at least one item per actor)
        first_param = next(iter(kwargs.values()))
        total_length = len(first_param)
        num_actors = len(self._actor_handlers)
        effective_actors = num_actors // self.duplicate_actors
        chunk_size = total_length // effective_actors
        if total_length % effective_actors != 0:
            chunk_size += 1

        # Pre-slice data before ray.put so each worker only receives its chunk.
        refs = []
        for chunk_idx in range(effective_actors):
            start_idx = chunk_idx * chunk_size
            end_idx = min((chunk_idx + 1) * chunk_size, total_length)

            chunk_data = {key: value[start_idx:end_idx] for key, value in kwargs.items()}
            chunk_ref = ray_put(chunk_data)

            for j in range(self.duplicate_actors):
                actor_idx = chunk_idx * self.duplicate_actors + j
                actor = self._actor_handlers[actor_idx]
                refs.append(
                    actor.execute_batch.remote(method_name, chunk_ref, 0, end_idx - start_idx)
                )

        return refs


def _dispatch_forward(group: RayActorGroup, sync_condition: bool, **kwargs: Any) -> list[Any]:
    ref = group.async_run_method_batch(method_name="forward", **kwargs)
    if sync_condition:
        ray.get(ref)
        ray.get(group.async_run_method(method_name="empty_cache"))
    return ref


def _flatten_results(refs: list[Any], duplicate_factor: int) -> list[Any]:
    return list(itertools.chain.from_iterable(ray.get(refs)[::duplicate_factor]))


@torch.no_grad()
def make_experience(
    groups: list[RayActorGroup], samples_list: list[Experience], colocate_all: bool
) -> list[Experience]:  # (text only, no dummy_ref; one colocate flag for all four groups)
    reward, actor, critic, initial = groups
    sequences_list = [s.sequences for s in samples_list]
    attention_mask_list = [s.attention_mask for s in samples_list]
    action_mask_list = [s.action_mask for s in samples_list]
    forward_kwargs = dict(
        sequences=sequences_list, action_mask=action_mask_list, attention_mask=attention_mask_list
    )

    r_refs = _dispatch_forward(
        reward, colocate_all, sequences=sequences_list, attention_mask=attention_mask_list,
        pad_sequence=[True] * len(samples_list),
    )  # fmt: skip
    action_log_probs_ref = _dispatch_forward(actor, colocate_all, **forward_kwargs)
    value_ref = _dispatch_forward(critic, colocate_all, **forward_kwargs)
    base_action_log_probs_ref = _dispatch_forward(initial, colocate_all, **forward_kwargs)

    action_log_probs_list = _flatten_results(action_log_probs_ref, 1)
    base_action_log_probs_list = _flatten_results(base_action_log_probs_ref, 1)
    value_list = _flatten_results(value_ref, 1)
    rewards_list = _flatten_results(r_refs, 1)
    for i, samples in enumerate(samples_list):
        samples.rewards = rewards_list[i]
        samples.info["reward"] = rewards_list[i]
    for samples, action_log_probs, base_action_log_probs, value in zip(
        samples_list, action_log_probs_list, base_action_log_probs_list, value_list, strict=True
    ):
        kl = action_log_probs - base_action_log_probs  # compute_approx_kl, "k1"
        samples.action_log_probs = action_log_probs
        samples.base_action_log_probs = base_action_log_probs
        samples.values = value
        samples.kl = kl
        samples.info["kl"] = kl.mean(dim=-1)
    return samples_list


@torch.no_grad()
def compute_advantages_and_returns(experiences: list[Experience]) -> list[Experience]:
    # experience_maker.py:236-330, abridged to "reinforce": the reward on the last action
    # token, less the KL penalty, summed backwards.
    for experience in experiences:
        assert experience.rewards is not None and experience.kl is not None
        reward = -0.01 * experience.kl
        reward[:, -1] += experience.rewards
        experience.returns = reward.flip(-1).cumsum(-1).flip(-1)
        experience.advantages = experience.returns.clone()
        experience.info["return"] = reward.sum(dim=-1)
        experience.kl = None
    return experiences


# -- the workers and the step ------------------------------------------------------------------


def checksum(*tensors: torch.Tensor | None) -> int:
    crc = 0
    for tensor in tensors:
        if tensor is not None:
            crc = zlib.crc32(tensor.contiguous().numpy().tobytes(), crc)
    return crc


@ray.remote(num_cpus=0.1)
class ModelActor(BaseModelActor):
    """Actor, critic, reference or reward model (one class for the four of launcher.py,
    ppo_actor.py and ppo_critic.py): logs a checksum of everything it is sent, and returns
    CPU tensors, as theirs do (``.to("cpu")``)."""

    def __init__(self, modulus: int = 97) -> None:
        self.modulus = modulus  # tells the critic's stand-in values from the log-probs
        self.received: list[int] = []
        self.writes_in_place, self.writes = False, 0

    def write_in_place(self, flag: bool) -> int:
        """Be a hostile but legal worker: add 1 to the sequences it receives, after use.
        Returns how many it wrote to so far."""
        self.writes_in_place = flag
        return self.writes

    def forward(
        self,
        sequences: torch.Tensor,
        action_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        pad_sequence: bool = False,
    ) -> torch.Tensor:
        self.received.append(checksum(sequences, attention_mask, action_mask))
        if action_mask is None:  # the reward model: one score per sequence
            out = (sequences % 7).float().mean(dim=-1)
        else:  # log-probs (actor, reference) or values (critic)
            out = -torch.log1p((sequences[:, -action_mask.shape[1] :] % self.modulus).float())
        if self.writes_in_place:
            sequences.add_(1)
            self.writes += 1
        return out

    def append(self, experience: Experience) -> None:
        self.received.append(
            checksum(experience.sequences, experience.action_log_probs, experience.returns)
        )

    def fit(self, kl_ctl: float = 0) -> dict[str, float]:
        return {"kl_ctl": kl_ctl}

    def empty_cache(self) -> None:  # torch.cuda.empty_cache() in OpenRLHF
        pass

    def take_received(self) -> list[int]:
        received, self.received = self.received, []
        return received


def ppo_step(
    groups: list[RayActorGroup], rollout: list[dict[str, torch.Tensor]], colocate_all: bool
) -> None:
    samples_list = [  # (the samples as split_rollout_samples concatenates them)
        Experience(sample["sequences"], sample["attention_mask"], sample["action_mask"])
        for sample in rollout
    ]
    experiences = make_experience(groups, samples_list, colocate_all)
    experiences = compute_advantages_and_returns(experiences)
    # PPOTrainer.train_step: push the experiences to the actor and critic shards, then fit.
    refs = groups[1].async_run_method_batch(method_name="append", experience=experiences)
    refs.extend(groups[2].async_run_method_batch(method_name="append", experience=experiences))
    ray.get(refs)
    refs = groups[2].async_run_method(method_name="fit")  # by value: nothing large here
    ray.get(refs + groups[1].async_run_method(method_name="fit", kl_ctl=0.01))


Step = tuple[list[dict[str, torch.Tensor]], bool, bool]  # rollout, colocate_all, a worker writes


def run_steps(
    groups: list[RayActorGroup], steps: list[Step]
) -> tuple[list[Counter[str]], list[list[list[int]]]]:
    """Objects stored in each step, and what each worker received in each step."""
    actors = [actor for group in groups for actor in group._actor_handlers]
    writer = groups[1]._actor_handlers[0]  # the actor group's worker 0
    counts, received = [], []
    for rollout, colocate_all, writes in steps:
        ray.get(writer.write_in_place.remote(writes))
        before = Counter({**PUTS, **refshare.stats()._asdict()})
        ppo_step(groups, rollout, colocate_all)
        counts.append(Counter({**PUTS, **refshare.stats()._asdict()}) - before)
        received.append(ray.get([actor.take_received.remote() for actor in actors]))
    return counts, received


def main() -> None:
    ray.init(
        address="local", num_cpus=2, object_store_memory=256 << 20, include_dashboard=False,
        runtime_env={"env_vars": ENV_VARS},  # train_ppo_ray.py:24-32
    )  # fmt: skip
    try:
        g = torch.Generator().manual_seed(0)
        # (group size, modulus): the reference is the actor's initial weights, the critic not.
        sizes = {"reward": (1, 97), "actor": (2, 97), "critic": (2, 89), "reference": (2, 97)}
        groups = [
            RayActorGroup([ModelActor.remote(modulus) for _ in range(n)])  # type: ignore[attr-defined]
            for n, modulus in sizes.values()
        ]
        rollouts = [  # 4 micro-batches of 16 x 4096 tokens; 2 micro-batches per chunk
            [
                {
                    "sequences": torch.randint(0, 32_000, (16, 4096), generator=g),
                    "attention_mask": torch.ones((16, 4096), dtype=torch.long),
                    "action_mask": torch.ones((16, 2048), dtype=torch.bool),
                }
                for _ in range(4)
            ]
            for _ in range(2)
        ]
        sent = [checksum(*sample.values()) for rollout in rollouts for sample in rollout]
        labels = ["1 new data", "2 same", "3 same", "4 new data"]
        steps: list[Step] = [(rollouts[i], False, False) for i in (0, 0, 0, 1)]
        # Then step 1's rollout again, the groups in turn (colocate_all), and the actor
        # group's worker 0 adding 1 to the sequences it receives before critic and reference.
        steps.append((rollouts[0], True, True))

        plain, plain_received = run_steps(groups, steps)
        methods = ("async_run_method_batch", "async_run_method")
        # An audit first (keyed as sharing keys, sent by value), then on, as
        # refshare.enable("openrlhf", audit=True) and refshare.enable("openrlhf") do.
        refshare.patch_methods(RayActorGroup, *methods, audit=True)
        _, audited_received = run_steps(groups, steps)
        refshare.unpatch_methods(RayActorGroup, *methods)
        refshare.patch_methods(RayActorGroup, *methods)
        shared, shared_received = run_steps(groups, steps)
        assert shared_received == audited_received == plain_received, "workers received other data"
        report = refshare.report()
        would, saved = report.bytes_repeated(audit=True), report.bytes_repeated()
        assert abs(would - saved) <= 0.05 * saved, report  # the audit foretold it
        writer = groups[1]._actor_handlers[0]  # wrote to its 2 micro-batches, in each run
        assert ray.get(writer.write_in_place.remote(False)) == 6, "the worker did not write"
        # Everything logged before the write, and critic and reference after it: all as step 1.
        assert plain_received[4] == plain_received[0], "a write reached another group by value"
        assert shared_received[4] == shared_received[0], "a write reached another group"
        assert sent == [checksum(*s.values()) for r in rollouts for s in r], "the driver's changed"
        from ray import cloudpickle  # (Ray registers its reducer when it first serializes)

        variable = ENV_VARS["RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"]
        zero_copy = torch.Tensor in cloudpickle.CloudPickler.dispatch
        has_it = importlib.util.find_spec("ray._private.tensor_serialization_utils") is not None
        assert zero_copy or variable != "1" or not has_it, "Ray's zero-copy serializer is off"

        print(f"OpenRLHF 0.11.2 mirror; RAY_ENABLE_ZERO_COPY_TORCH_TENSORS={variable}", end="")
        print(f" (Ray's zero-copy tensor serializer {'on' if zero_copy else 'off'})")
        print("per step: forward on reward (1 actor), actor, critic, reference (2 actors each),")
        print("then the experiences appended to actor and critic")
        print("stored per step:  without refshare (ray.put)     with refshare")
        print("step               objects       MiB          objects       MiB    hits")
        for label, old, new in zip(labels, plain, shared, strict=False):
            old_mib, new_mib = old["ray.put bytes"] / (1 << 20), new["bytes_put"] / (1 << 20)
            print(f"{label:<12} {old['ray.put']:>13} {old_mib:>9.1f} {new['puts']:>16}"
                  f" {new_mib:>9.1f} {new['hits']:>7}")  # fmt: skip
        # refshare stores each distinct large tensor once (4 sequences, 1 attention mask of
        # ones, then the experiences' log-probs, values, returns), plus small skeletons naming
        # them: the counts move with its heuristics, the bytes must not. A step with new data
        # stores under half of what the puts store; one with the same data only skeletons.
        for step, (old, new) in enumerate(zip(plain, shared, strict=True), start=1):
            same = step in (2, 3, 5)  # step 1's rollout again
            limit = 4 << 10 if same else old["ray.put bytes"] // 2
            assert new["bytes_put"] <= limit, (old, new)
        print("5: step 1's rollout again, the groups in turn, and the actor group's worker 0")
        print("   adds 1 to the sequences it received: critic and reference receive them")
        print(f"   unchanged without refshare ({plain[4]['ray.put']} stored) and with it"
              f" ({shared[4]['puts']} stored, {shared[4]['hits']} hits)")  # fmt: skip
        print(f"the audit said sharing would not send {would / (1 << 20):.1f} MiB again;"
              f" sharing did not send {saved / (1 << 20):.1f} MiB again")  # fmt: skip
        print(refshare.stats())
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
