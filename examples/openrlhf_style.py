"""OpenRLHF 0.11.2's RayActorGroup, mirrored: one rollout for four model groups, with refshare.

Mirrored from OpenRLHF 0.11.2 (openrlhf/trainer/ray/launcher.py, the same at main 3c3be623;
trainer/ppo_utils/experience_maker.py; trainer/ppo_trainer.py). ``async_run_method_batch``
slices each list kwarg into one chunk per data-parallel actor and ``ray.put``s each chunk;
``async_run_method`` sends its arguments by value. ``make_experience`` sends the same lists
to the actor, critic and reference groups (and sequences with attention masks to the reward
model), and the trainer then sends the experiences to the actor and the critic. refshare
wraps the two methods ``refshare.enable("openrlhf")`` wraps.

Run: python examples/openrlhf_style.py
"""

from __future__ import annotations

import itertools
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray

import refshare

PUTS: Counter[str] = Counter()  # the example's counter, for the "without refshare" column


def ray_put(value: Any) -> Any:  # the mirror calls this where OpenRLHF calls ray.put
    PUTS["ray.put"] += 1
    return ray.put(value)


# -- OpenRLHF 0.11.2, mirrored -------------------------------------------------------------


@dataclass
class Experience:  # (fields abridged; no pickling of its own)
    sequences: Any = None
    attention_mask: Any = None
    action_mask: Any = None
    action_log_probs: Any = None
    base_action_log_probs: Any = None
    values: Any = None
    rewards: Any = None
    info: dict = field(default_factory=dict)


class BaseModelActor:
    def execute_batch(self, method_name: str, all_data, start_idx, end_idx):
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


class RayActorGroup:
    def __init__(self, actors, duplicate_actors: int = 1) -> None:
        self._actor_handlers, self.duplicate_actors = actors, duplicate_actors

    def async_run_method(self, method_name, *args, **kwargs):
        refs = []
        for actor in self._actor_handlers:
            method = getattr(actor, method_name)
            refs.append(method.remote(*args, **kwargs))
        return refs

    def async_run_method_batch(self, method_name, **kwargs):
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


def _dispatch_forward(group, sync_condition, **kwargs):
    ref = group.async_run_method_batch(method_name="forward", **kwargs)
    if sync_condition:
        ray.get(ref)
        ray.get(group.async_run_method(method_name="empty_cache"))
    return ref


def _flatten_results(refs, duplicate_factor):
    return list(itertools.chain.from_iterable(ray.get(refs)[::duplicate_factor]))


def make_experience(groups, samples_list):  # (text only, not colocated, no dummy_ref use)
    reward, actor, critic, initial = groups
    sequences_list = [s.sequences for s in samples_list]
    attention_mask_list = [s.attention_mask for s in samples_list]
    action_mask_list = [s.action_mask for s in samples_list]
    forward_kwargs = dict(
        sequences=sequences_list, action_mask=action_mask_list, attention_mask=attention_mask_list
    )

    r_refs = _dispatch_forward(
        reward, False, sequences=sequences_list, attention_mask=attention_mask_list,
        pad_sequence=[True] * len(samples_list),
    )  # fmt: skip
    action_log_probs_ref = _dispatch_forward(actor, False, **forward_kwargs)
    value_ref = _dispatch_forward(critic, False, **forward_kwargs)
    base_action_log_probs_ref = _dispatch_forward(initial, False, **forward_kwargs)

    action_log_probs_list = _flatten_results(action_log_probs_ref, 1)
    base_action_log_probs_list = _flatten_results(base_action_log_probs_ref, 1)
    value_list = _flatten_results(value_ref, 1)
    rewards_list = _flatten_results(r_refs, 1)
    for i, samples in enumerate(samples_list):  # (then kl, from the two log-probs)
        samples.rewards = rewards_list[i]
        samples.action_log_probs = action_log_probs_list[i]
        samples.base_action_log_probs = base_action_log_probs_list[i]
        samples.values = value_list[i]
    return samples_list


# -- the workers and the step ------------------------------------------------------------------


def checksum(*arrays: Any) -> int:
    crc = 0
    for array in arrays:
        if array is None:
            continue
        crc = zlib.crc32(np.ascontiguousarray(array).tobytes(), crc)
    return crc


@ray.remote(num_cpus=0.1)
class ModelActor(BaseModelActor):
    """Actor, critic, reference or reward model: logs a checksum of everything it is sent."""

    def __init__(self) -> None:
        self.received: list[int] = []

    def forward(
        self, sequences: Any, attention_mask: Any, action_mask: Any = None, **_: Any
    ) -> Any:
        self.received.append(checksum(sequences, attention_mask, action_mask))
        if action_mask is None:  # the reward model
            return float(sequences.sum())
        return -np.log1p(sequences[:, -action_mask.shape[1] :] % 97)  # log-probs or values

    def append(self, experience: Experience) -> None:
        self.received.append(
            checksum(experience.sequences, experience.action_log_probs, experience.values)
        )

    def fit(self, kl_ctl: float = 0) -> dict[str, float]:
        return {"kl_ctl": kl_ctl}

    def take_received(self) -> list[int]:
        received, self.received = self.received, []
        return received


def ppo_step(groups: list[RayActorGroup], rollout: list[dict[str, np.ndarray]]) -> None:
    experiences = make_experience(groups, [Experience(**sample) for sample in rollout])
    # PPOTrainer: push the experiences to the actor and critic shards, then fit.
    refs = groups[1].async_run_method_batch(method_name="append", experience=experiences)
    refs.extend(groups[2].async_run_method_batch(method_name="append", experience=experiences))
    ray.get(refs)
    refs = groups[2].async_run_method(method_name="fit")  # by value: nothing large here
    ray.get(refs + groups[1].async_run_method(method_name="fit", kl_ctl=0.01))


def run_steps(groups: list[RayActorGroup], steps: list[Any]) -> tuple[list[Any], list[Any]]:
    counts = []
    for rollout in steps:
        before = Counter({**PUTS, **refshare.stats()._asdict()})
        ppo_step(groups, rollout)
        counts.append(Counter({**PUTS, **refshare.stats()._asdict()}) - before)
    actors = [actor for group in groups for actor in group._actor_handlers]
    return counts, ray.get([actor.take_received.remote() for actor in actors])


def main() -> None:
    ray.init(address="local", num_cpus=2, object_store_memory=256 << 20, include_dashboard=False)
    try:
        rng = np.random.default_rng(0)
        sizes = {"reward": 1, "actor": 2, "critic": 2, "reference": 2}
        groups = [RayActorGroup([ModelActor.remote() for _ in range(n)]) for n in sizes.values()]
        rollouts = [  # 4 micro-batches of 16 x 4096 tokens; 2 micro-batches per chunk
            [
                {
                    "sequences": rng.integers(0, 32_000, (16, 4096)),
                    "attention_mask": np.ones((16, 4096), dtype=np.int64),
                    "action_mask": np.ones((16, 2048), dtype=bool),
                }
                for _ in range(4)
            ]
            for _ in range(2)
        ]
        labels = ["1 new data", "2 same", "3 same", "4 new data"]
        steps = [rollouts[i] for i in (0, 0, 0, 1)]

        plain, plain_received = run_steps(groups, steps)
        refshare.patch_methods(RayActorGroup, "async_run_method_batch", "async_run_method")
        shared, shared_received = run_steps(groups, steps)
        assert shared_received == plain_received, "actors received different data"

        print("OpenRLHF 0.11.2 mirror; per step: forward on reward (1 actor), actor, critic,")
        print("reference (2 actors each), then the experiences appended to actor and critic")
        print("step         stored without refshare (ray.put)   stored with refshare   hits")
        for label, old, new in zip(labels, plain, shared, strict=True):
            print(f"{label:<12} {old['ray.put']:>33} {new['puts']:>22} {new['hits']:>6}")
        # Reward's chunk (its own keys), 2 forward chunks, 2 experience chunks: each once.
        assert [row["puts"] for row in shared] == [5, 0, 0, 5], shared
        print(refshare.stats())
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
