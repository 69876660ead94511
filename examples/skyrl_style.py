"""SkyRL 0.4.0's default forward pass: one batch for critic, reference and policy, with refshare.

On the mirror of SkyRL 0.4.0 in tests/mirrors/skyrl_mirror.py (``TrainingInputBatch``, its
dispatch, the trainer's forward pass). ``fwd_logprobs_values_reward`` sends one
``data_fwd_pass`` to the critic, the reference and the policy: with
``recompute_old_logprobs_per_minibatch`` (default True), the critic and the policy stage it
per mini-batch (``stage_chunks`` chunks each mini-batch and ``ray.put``s each chunk); the
reference (no mini-batches) goes through ``MeshDispatch.dispatch``, which puts each DP chunk.

So a step puts each DP chunk of the reference's full batch once, and each mini-batch chunk
twice (critic and policy); the next step, with equal data, puts them all again. (The
training step, ``_execute_training_step``, stages its chunks the same way.)
``refshare.enable("skyrl")`` wraps ``PPORayActorGroup.async_run_ray_method`` and
``MeshDispatch.stage_chunks``; here those two are wrapped on the mirror, as ``enable`` names
them. Where torch is missing, the batch holds numpy arrays instead (SkyRL's never does).

Run: python examples/skyrl_style.py
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import ray

import refshare
from refshare._integrations import skyrl as skyrl_integration

try:
    import torch
except ImportError:  # numpy arrays stand in for CPU tensors
    torch = None

# CI cannot install SkyRL: the mirror of its code beside the tests stands in for it, here and
# in Ray's workers (they inherit PYTHONPATH from the driver that starts Ray).
MIRROR_DIR = str(Path(__file__).resolve().parents[1] / "tests" / "mirrors")
sys.path.insert(0, MIRROR_DIR)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (MIRROR_DIR, os.environ.get("PYTHONPATH"))))
import skyrl_mirror  # noqa: E402
from skyrl_mirror import (  # noqa: E402
    PUTS,
    SERIALIZED,
    PPORayActorGroup,
    TensorBatch,
    TrainingInputBatch,
    WorkerDispatch,
    checksum,
    fwd_logprobs_values_reward,
)

#: Under REFSHARE_VERIFY=1 refshare also serializes each argument by value, to check it.
VERIFYING = os.environ.get("REFSHARE_VERIFY", "") == "1"

# -- the workers and the steps -----------------------------------------------------------------

DP, ROWS, TOKENS = 2, 128, 4096
MINI_BATCHES = [(0, ROWS // 2), (ROWS // 2, ROWS)]  # policy and critic mini-batch size 64


@ray.remote(num_cpus=0.1)
class Worker:
    """A policy, critic or reference worker: logs a checksum of every batch it is sent."""

    def __init__(self) -> None:
        self.received: list[int] = []

    def forward(self, data: TensorBatch) -> np.ndarray:
        self.received.append(checksum(data))
        sequences = np.asarray(data["sequences"])
        return -np.log1p(sequences[:, 1] % 97)

    def empty_cache(self) -> None:
        pass

    def take_received(self) -> list[int]:
        received, self.received = self.received, []
        return received


def expected_received(data_fwd_pass: TensorBatch) -> list[list[int]]:
    """What each worker (critic's, reference's, policy's) must log in one step."""
    staged = [data_fwd_pass[s:e].chunk((e - s) // DP) for s, e in MINI_BATCHES]
    full = data_fwd_pass.chunk(ROWS // DP)
    by_model = {
        "critic": [[checksum(mb[dp]) for mb in staged] for dp in range(DP)],
        "ref": [[checksum(full[dp])] for dp in range(DP)],
        "policy": [[checksum(mb[dp]) for mb in staged] for dp in range(DP)],
    }
    return [received for model in ("critic", "ref", "policy") for received in by_model[model]]


def make_training_input(arrays: dict[str, Any]) -> TrainingInputBatch:
    """A new batch each step, as the trainer makes (``convert_to_training_input``)."""
    if torch is not None:
        arrays = {k: torch.from_numpy(v.copy()) for k, v in arrays.items()}
    training_input = TrainingInputBatch(arrays)
    training_input.metadata = {
        "response_length": TOKENS // 4,
        "policy_mini_batch_boundaries": MINI_BATCHES,
        "critic_mini_batch_boundaries": MINI_BATCHES,
    }
    return training_input


def run_steps(groups: dict[str, PPORayActorGroup], steps: list[Any]) -> list[Any]:
    dispatch = WorkerDispatch(groups)
    actors = [actor for group in groups.values() for actor in group._actor_handlers]
    rows = []
    for arrays in steps:
        before = Counter({**PUTS, **refshare.stats()._asdict()})
        training_input = make_training_input(arrays)
        data_fwd_pass = training_input.select(["sequences", "attention_mask"], ["response_length"])
        expected = expected_received(data_fwd_pass)
        SERIALIZED.clear()
        outputs = fwd_logprobs_values_reward(dispatch, training_input)
        assert all(len(value) == len(training_input) for value in outputs.values())
        received = ray.get([actor.take_received.remote() for actor in actors])
        assert received == expected, "a worker received other data than it was sent"
        counts = Counter({**PUTS, **refshare.stats()._asdict()}) - before
        rows.append((counts, dict(SERIALIZED)))
    return rows


def per_chunk(serialized: dict[tuple[int, int], int]) -> str:
    """The reference's chunks' counts, then the mini-batch chunks', in row order."""
    ref = [serialized.get((row, ROWS // DP), 0) for row in range(0, ROWS, ROWS // DP)]
    rows = ROWS // len(MINI_BATCHES) // DP
    staged = [serialized.get((row, rows), 0) for row in range(0, ROWS, rows)]
    return f"{' '.join(map(str, ref))} | {' '.join(map(str, staged))}"


def main() -> None:
    ray.init(address="local", num_cpus=2, object_store_memory=256 << 20, include_dashboard=False)
    try:
        rng = np.random.default_rng(0)
        groups = {
            m: PPORayActorGroup([Worker.remote() for _ in range(DP)], dp_size=DP)
            for m in ("critic", "ref", "policy")
        }
        batches = []  # 128 sequences of 4096 tokens and their mask: 4 MiB per reference chunk
        for _ in range(2):
            sequences = rng.integers(0, 32_000, (ROWS, TOKENS))
            sequences[:, 0] = np.arange(ROWS)  # each row's index: says which chunk is which
            batches.append(
                {
                    "sequences": sequences,
                    "attention_mask": np.ones((ROWS, TOKENS), dtype=np.int64),
                    "advantages": rng.standard_normal((ROWS, TOKENS // 4), dtype=np.float32),
                }
            )
        labels = ["1 new data", "2 same", "3 same", "4 new data"]
        steps = [batches[i] for i in (0, 0, 0, 1)]

        plain = run_steps(groups, steps)
        # An audit first (keyed as sharing keys, sent by value), then on, as
        # refshare.enable("skyrl", audit=True) and refshare.enable("skyrl") do.
        targets = skyrl_integration.FRAMEWORK.layouts[0]  # what enable("skyrl") wraps
        for audit in (True, False):
            for target in targets:
                refshare.patch_methods(
                    getattr(skyrl_mirror, target.owner), *target.methods, audit=audit
                )
            shared = run_steps(groups, steps)
            if audit:
                for target in targets:
                    refshare.unpatch_methods(getattr(skyrl_mirror, target.owner), *target.methods)
        report = refshare.report()
        would, saved = report.bytes_repeated(audit=True), report.bytes_repeated()
        assert abs(would - saved) <= 0.05 * saved, report  # the audit foretold it

        kind = "torch tensors" if torch is not None else "numpy arrays (no torch)"
        print(f"SkyRL 0.4.0 mirror, {kind}: one forward batch to critic (staged per mini-batch),")
        print("ref (mesh dispatch) and policy (staged), dp=2, 2 mini-batches")
        print("serialized per chunk (the reference's 2 | the 4 mini-batch chunks), objects stored")
        head = f"{'step':<12} {'without refshare':<18} {'stored':>6}   {'with enable()':<18}"
        print(f"{head} stored hits")
        for label, (old, old_counts), (new, new_counts) in zip(labels, plain, shared, strict=True):
            print(
                f"{label:<12} {per_chunk(old_counts):<18} {old['ray.put']:>6}   "
                f"{per_chunk(new_counts):<18} {new['puts']:>6} {new['hits']:>4}"
            )
        # Without refshare: the reference's 2 chunks once, the 4 mini-batch chunks twice
        # (critic and policy), every step. With it: each distinct chunk once, then never.
        assert [row[0]["ray.put"] for row in plain] == [10] * 4, plain
        assert all(set(row[1].values()) == {1, 2} for row in plain), plain
        # Verify serializes each argument by value too, to check it: that runs the batch's
        # own pickling, which makes its tensors contiguous in place, as by value does.
        if not VERIFYING:
            assert [row[0]["puts"] for row in shared] == [6, 0, 0, 6], shared
            assert [set(row[1].values()) for row in shared] == [{1}, set(), set(), {1}], shared
        print(f"the audit said sharing would not send {would / 2**20:.1f} MiB again;"
              f" sharing did not send {saved / 2**20:.1f} MiB again")  # fmt: skip
        print(refshare.stats())
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
