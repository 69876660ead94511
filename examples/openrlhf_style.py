"""OpenRLHF 0.11.2's RayActorGroup: one rollout for four model groups, with refshare.

On the mirror of OpenRLHF 0.11.2 in tests/mirrors/openrlhf_mirror.py: ``make_experience``
sends the same lists of CPU tensors, one per micro-batch, to the actor, critic and reference
groups (and the sequences with attention masks to the reward model) through
``async_run_method_batch``, which ``ray.put``s each actor's chunk; ``train_step`` sends the
experiences to the actor and the critic. OpenRLHF's launcher (``train_ppo_ray.py:19-32``) runs
``ray.init(runtime_env={"env_vars": {..., "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}})``, Ray's
zero-copy tensor serializer in every worker: under it a task's tensors are writable views of
its object in the object store.

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
import sys  # noqa: E402
import zlib  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

import ray  # noqa: E402
import torch  # noqa: E402

import refshare  # noqa: E402

# CI cannot install OpenRLHF: the mirror of its code beside the tests stands in for it, here and
# in Ray's workers (they inherit PYTHONPATH from the driver that starts Ray).
MIRROR_DIR = str(Path(__file__).resolve().parents[1] / "tests" / "mirrors")
sys.path.insert(0, MIRROR_DIR)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (MIRROR_DIR, os.environ.get("PYTHONPATH"))))
from openrlhf_mirror import PUTS, BaseModelActor, Experience, RayActorGroup, ppo_step  # noqa: E402

# -- the workers and the steps -----------------------------------------------------------------


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
