"""OpenRLHF 0.11.2, mirrored where OpenRLHF is not installed: how a rollout reaches its groups.

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

``ray_put`` and ``PUTS`` are not OpenRLHF's: they count what it stores without refshare
(examples/openrlhf_style.py runs it). Import this after setting the launcher's environment
(``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS``): Ray reads it when it is imported.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

import refshare

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


# -- ppo_trainer.py: a step (make_experience, then train_step) ----------------------------


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
