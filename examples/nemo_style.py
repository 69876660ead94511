"""NeMo-RL's RayWorkerGroup: log-probs, reference log-probs and train, with refshare.

On the mirror of NeMo-RL main (commit 7ea279a) in tests/mirrors/nemo_rl_mirror.py: its
``run_all_workers_sharded_data`` ``ray.put``s every DP shard when a replicated axis (TP, CP,
PP) has more than one rank. A GRPO step shards one ``logprob_data`` for the policy's and the
reference's log-probs (fresh copies each time), then trains on ``train_data``, which adds
those log-probs. refshare wraps the four ``run_*`` methods that ``refshare.enable("nemo_rl")``
wraps. The batches hold numpy arrays here, so that this runs without torch.

Run: python examples/nemo_style.py
"""

from __future__ import annotations

import os
import sys
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import ray

import refshare

# CI cannot install NeMo-RL: the mirror of its code beside the tests stands in for it, here and
# in Ray's workers (they inherit PYTHONPATH from the driver that starts Ray).
MIRROR_DIR = str(Path(__file__).resolve().parents[1] / "tests" / "mirrors")
sys.path.insert(0, MIRROR_DIR)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (MIRROR_DIR, os.environ.get("PYTHONPATH"))))
from nemo_rl_mirror import PUTS, NamedSharding, RayWorkerGroup, grpo_step  # noqa: E402

# -- a worker and the steps -----------------------------------------------------------------


def checksum(data: Any) -> int:
    crc = 0
    for key in sorted(data):
        crc = zlib.crc32(np.ascontiguousarray(data[key]).tobytes(), crc)
    return crc


@ray.remote(num_cpus=0.1)
class PolicyWorker:
    def __init__(self) -> None:
        self.received: list[int] = []  # a checksum of every shard this worker was sent

    def get_logprobs(self, data: Any, **_: Any) -> dict[str, np.ndarray]:
        self.received.append(checksum(data))
        return {"logprobs": -np.log1p(data["input_ids"] % 97).astype(np.float32)}

    def get_reference_policy_logprobs(self, data: Any, **_: Any) -> dict[str, np.ndarray]:
        return {"reference_logprobs": self.get_logprobs(data)["logprobs"] - 0.01}

    def train(self, data: Any, **_: Any) -> dict[str, float]:
        self.received.append(checksum(data))
        return {"global_loss": float(data["prev_logprobs"].mean()), "grad_norm": 1.0}

    def take_received(self) -> list[int]:
        received, self.received = self.received, []
        return received


def run_steps(group: RayWorkerGroup, steps: list[dict[str, np.ndarray]]) -> tuple[Any, Any]:
    counts = []
    for rollout in steps:
        before = Counter({**PUTS, **refshare.stats()._asdict()})
        grpo_step(group, rollout)
        counts.append(Counter({**PUTS, **refshare.stats()._asdict()}) - before)
    return counts, ray.get([worker.take_received.remote() for worker in group.workers])


def main() -> None:
    ray.init(address="local", num_cpus=2, object_store_memory=256 << 20, include_dashboard=False)
    try:
        rng = np.random.default_rng(0)
        layout = np.arange(4).reshape(1, -1, 1, 2)  # pp=1, dp=2, cp=1, tp=2, as lm_policy.py
        names = ["pipeline_parallel", "data_parallel", "context_parallel", "tensor_parallel"]
        group = RayWorkerGroup(
            [PolicyWorker.remote() for _ in range(4)], NamedSharding(layout, names)
        )
        rollouts = [  # 256 sequences of 2048 tokens: 4 MiB of input_ids, 2 MiB per DP shard
            {
                "input_ids": rng.integers(0, 32_000, (256, 2048)),
                "input_lengths": np.full(256, 2048),
                "token_mask": np.ones((256, 2048), dtype=np.uint8),
                "sample_mask": np.ones(256, dtype=np.float32),
                "advantages": rng.standard_normal((256, 2048), dtype=np.float32),
            }
            for _ in range(2)
        ]
        labels = ["1 new data", "2 same", "3 same", "4 new data"]
        steps = [rollouts[i] for i in (0, 0, 0, 1)]

        plain, plain_received = run_steps(group, steps)
        methods = ("run_all_workers_single_data", "run_all_workers_multiple_data",
                   "run_all_workers_sharded_data", "run_single_worker_single_data")  # fmt: skip
        # An audit first (keyed as sharing keys, sent by value), then on, as
        # refshare.enable("nemo_rl", audit=True) and refshare.enable("nemo_rl") do.
        refshare.patch_methods(RayWorkerGroup, *methods, audit=True)
        _, audited_received = run_steps(group, steps)
        refshare.unpatch_methods(RayWorkerGroup, *methods)
        refshare.patch_methods(RayWorkerGroup, *methods)
        shared, shared_received = run_steps(group, steps)
        assert shared_received == audited_received == plain_received, "workers received other data"
        report = refshare.report()
        would, saved = report.bytes_repeated(audit=True), report.bytes_repeated()
        assert abs(would - saved) <= 0.05 * saved, report  # the audit foretold it
        # The two TP ranks of a DP rank got the same shards; the two DP ranks, different ones.
        assert plain_received[0] == plain_received[1] != plain_received[2] == plain_received[3]

        print("NeMo-RL main (7ea279a) mirror, dp=2 x tp=2; per step: get_logprobs,")
        print("get_reference_policy_logprobs and train, each sharded over DP")
        print("step         stored without refshare (ray.put)    stored with refshare    hits")
        print("                           objects     MiB          objects     MiB")
        for label, old, new in zip(labels, plain, shared, strict=True):
            print(
                f"{label:<12} {old['ray.put']:>17} {old['ray.put bytes'] / 2**20:>7.1f}"
                f" {new['puts']:>16} {new['bytes_put'] / 2**20:>7.1f} {new['hits']:>7}"
            )
        mib = [row["bytes_put"] / 2**20 for row in shared]
        plain_mib = [row["ray.put bytes"] / 2**20 for row in plain]
        # New data: each distinct tensor once (the train shards add their new keys only, from
        # the second batch on); the same data again: nothing.
        assert mib[1] == mib[2] == 0, mib
        assert mib[0] < plain_mib[0] and mib[3] < 0.7 * plain_mib[3], (mib, plain_mib)
        print(f"the audit said sharing would not send {would / 2**20:.1f} MiB again;"
              f" sharing did not send {saved / 2**20:.1f} MiB again")  # fmt: skip
        print(report)
        print(refshare.stats())
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
