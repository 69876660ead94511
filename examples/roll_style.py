"""ROLL's Cluster: one batch to reference, critic and actor_train, with refshare.

On the mirror of ROLL main 8eb27cc2 in tests/mirrors/roll_mirror.py. A ``Cluster`` creates one
Ray actor per rank and binds every ``@register``ed worker method when it is built.
``DP_MP_COMPUTE`` chunks a ``DataProto`` once per data-parallel rank and gives chunk ``d`` to
every rank of DP group ``d``: by value, so each tensor-parallel rank's ``.remote()`` pickles
the chunk again, and each cluster's call chunks and pickles the batch anew. A ``DataProto``
pickles as ``torch.save`` of its ``TensorDict`` (tensordict's own where it is installed, else
the mirror's stand-in of tensordict 0.10.0's).

Per step, the same batch goes to three clusters of dp 2 x tp 2, each method registered
``DP_MP_COMPUTE``, as ROLL's critic ``compute_values``, reward ``compute_rewards`` and infer
``generate`` are (``pipeline/base_worker.py``; its actor's ``compute_log_probs`` and
``train_step`` are ``DP_MP_DISPATCH_FIRST``: the chunk to tensor-parallel rank 0 only). Two
steps of equal data run by value, then two through ``refshare.enable("roll")``; printed per
step: the driver's pickles of each chunk, the objects stored, refshare's hits, the step's
time. The mirror is published under ROLL's module names (here, and in each worker as it
starts), so that ``enable("roll")`` finds its ``Cluster``, and refshare its ``DataProto``,
where it finds ROLL's. Where ROLL imports (``PYTHONPATH=/path/to/ROLL``), the same steps run
again on ROLL's own code, in a process of their own: the counts and every worker's checksums
must be the same.

Run: python examples/roll_style.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import ray
import torch

import refshare

# CI cannot install ROLL: the mirror of its code beside the tests stands in for it, here and in
# Ray's workers (they inherit PYTHONPATH from the driver that starts Ray).
MIRROR_DIR = str(Path(__file__).resolve().parents[1] / "tests" / "mirrors")
sys.path.insert(0, MIRROR_DIR)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (MIRROR_DIR, os.environ.get("PYTHONPATH"))))
import roll_mirror  # noqa: E402
from roll_mirror import (  # noqa: E402
    DP,
    HAS_TENSORDICT,
    MIRRORS,
    TP,
    checksum,
    inject_trace_context,
    make_batch,
    tensordict,
)

# -- the workers and the steps -----------------------------------------------------------------


def toy_worker(roll: Any) -> type:
    """A worker of ``roll``'s classes (the mirror's or ROLL's own), ranked dp-major as
    Megatron ranks (rank = dp_rank * TP + tp_rank), logging a checksum of each batch."""

    class ToyWorker(roll.Worker):  # type: ignore[name-defined,misc]
        def __init__(self, worker_config: Any) -> None:
            super().__init__(worker_config=worker_config)
            self.rank_info = roll.RankInfo(world_size=self.world_size, tp_size=TP, dp_size=DP,
                                           rank=self.rank, tp_rank=self.rank % TP,
                                           dp_rank=self.rank // TP)  # fmt: skip
            self.received: list[int] = []

        @roll.register(dispatch_mode=roll.Dispatch.ONE_TO_ALL)
        def initialize(self, pipeline_config: Any) -> None:
            self.pipeline_config = pipeline_config  # (Worker.initialize reads model args)

        @roll.register(dispatch_mode=roll.Dispatch.DP_MP_COMPUTE)
        def compute(self, data: Any) -> Any:
            self.received.append(checksum(data))
            values = (data._batch["input_ids"] % 97).float().mean(dim=1)
            return roll.DataProto.from_dict(tensors={"values": values})

        @roll.register(dispatch_mode=roll.Dispatch.ONE_TO_ALL)
        def take_received(self) -> list[int]:
            received, self.received = self.received, []
            return received

    return ToyWorker


SERIALIZED: Counter[int] = Counter()  # batches pickled in the driver, by chunk


def counting() -> Any:
    """Count each ``torch.save`` of a batch in the driver (a ``DataProto`` pickles through
    it), by chunk: its first ``prompt_id`` // its rows. Returns the undo."""
    save = torch.save

    def counted(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        if obj is not None and "prompt_id" in obj.keys():  # noqa: SIM118
            SERIALIZED[int(obj["prompt_id"][0]) // len(obj)] += 1
        return save(obj, f, *args, **kwargs)

    torch.save = counted
    return lambda: setattr(torch, "save", save)


def run_steps(roll: Any, clusters: dict[str, Any], steps: list[Any]) -> tuple[Any, Any]:
    """Per step: a new DataProto, each cluster's ``compute`` on it (not blocking, as RLVR
    calls its critic), the outputs fetched; what was counted, and what the workers got."""
    counts = []
    for parts in steps:
        before = Counter(refshare.stats()._asdict())
        SERIALIZED.clear()
        start = time.perf_counter()
        batch = roll.DataProto.from_dict(*parts)
        refs = [cluster.compute(batch, blocking=False) for cluster in clusters.values()]
        outputs = [roll.DataProto.materialize_concat(r) for r in refs]
        assert all(len(out) == len(batch) for out in outputs)
        row = Counter(refshare.stats()._asdict()) - before
        row["ms"] = round(1000 * (time.perf_counter() - start))
        counts.append((row, [SERIALIZED[d] for d in range(DP)]))
    return counts, {name: c.take_received() for name, c in clusters.items()}


def build_clusters(roll: Any, real: bool) -> dict[str, Any]:
    """Three clusters of dp 2 x tp 2, initialized; on ROLL's own code, a CPU-only
    ResourceManager holds their actors (its named shared storage actor made first)."""
    manager = None
    if real:
        from roll.distributed.scheduler.resource_manager import ResourceManager
        from roll.distributed.scheduler.transfer_backend import init_transfer_backend

        init_transfer_backend(None)
        manager = ResourceManager(num_gpus_per_node=0, num_nodes=1)
    worker = toy_worker(roll)
    clusters = {
        name: roll.Cluster(name, worker, manager, roll.WorkerConfig(name=name, world_size=DP * TP))
        for name in ("reference", "critic", "actor_train")
    }
    for cluster in clusters.values():
        cluster.initialize(pipeline_config=None)
    return clusters


def run(roll: Any, real: bool) -> dict[str, Any]:
    """A warm-up step, then equal data twice by value, and twice through ``enable("roll")``;
    checks that each rank received its DP group's chunk, the same both ways."""
    clusters = build_clusters(roll, real)
    steps = [make_batch(1), make_batch(1)]  # a new batch each step, of equal content
    refshare.disable("roll")  # by value first, even where `refshare run` turned it on
    undo = counting()
    run_steps(roll, clusters, [make_batch(0, rows=8)])  # the workers' first calls, uncounted
    plain, plain_received = run_steps(roll, clusters, steps)
    refshare.reset_report()
    try:
        refshare.enable("roll", audit=True)  # an audit first: keyed as sharing keys, by value
        _, audited_received = run_steps(roll, clusters, steps)
        refshare.disable("roll")
        wrapped = refshare.enable("roll")
        shared, shared_received = run_steps(roll, clusters, steps)
    finally:
        refshare.disable("roll")
        undo()
    assert shared_received == audited_received == plain_received, "workers received other data"
    report = refshare.report()
    would, saved = report.bytes_repeated(audit=True), report.bytes_repeated()
    assert abs(would - saved) <= 0.05 * saved, report  # the audit foretold it
    expected = roll.DataProto.from_dict(*make_batch(1))
    inject_trace_context(expected.meta_info)  # as the Cluster's method does
    chunks = [checksum(chunk) for chunk in expected.chunk(DP)]
    for received in plain_received.values():  # rank i: chunk i // TP, in both steps
        assert received == [[chunks[i // TP]] * len(steps) for i in range(DP * TP)], received
    return {
        "wrapped": wrapped,
        "foretold": (would, saved),
        "plain": [(dict(row), pickled) for row, pickled in plain],
        "shared": [(dict(row), pickled) for row, pickled in shared],
        "received": plain_received,
    }


def agreed(result: dict[str, Any]) -> Any:
    """What the mirror and ROLL itself must agree on: pickles per chunk, puts and hits,
    and every checksum the workers logged."""
    counts = [(row.get("puts", 0), row.get("hits", 0), c) for key in ("plain", "shared")
              for row, c in result[key]]  # fmt: skip
    return counts, result["received"]


def show(title: str, result: dict[str, Any]) -> None:
    """One row per step. By value, each pickle of a chunk (over 100 KiB) is one object Ray
    stores; through refshare, each put is."""
    print(title)
    print("step        pickles per chunk   stored without -> with refshare   hits   step ms")
    for label, (old, old_chunks), (new, new_chunks) in zip(
        ("1 new data", "2 same"), result["plain"], result["shared"], strict=True
    ):
        pickled = f"{old_chunks} -> {new_chunks}"
        stored = f"{sum(old_chunks)} -> {new.get('puts', 0)}"
        print(f"{label:<12}{pickled:<20}{stored:>18}{new.get('hits', 0):>22}"
              f"   {old['ms']} -> {new['ms']}")  # fmt: skip


RESULT = "RESULT "


def real_main() -> None:
    """The steps on ROLL's own code, printing what they measured last, as JSON. A process of
    its own: the mirror holds ROLL's module names in the one that runs ``main``."""
    from roll.configs.worker_config import WorkerConfig
    from roll.distributed.executor.cluster import Cluster
    from roll.distributed.executor.worker import RankInfo, Worker
    from roll.distributed.scheduler.decorator import Dispatch, register
    from roll.distributed.scheduler.protocol import DataProto
    from roll.utils.constants import RAY_NAMESPACE

    roll = SimpleNamespace(WorkerConfig=WorkerConfig, Cluster=Cluster, RankInfo=RankInfo,
                           Worker=Worker, Dispatch=Dispatch, register=register,
                           DataProto=DataProto)  # fmt: skip
    ray.init(address="local", num_cpus=2, namespace=RAY_NAMESPACE,
             object_store_memory=256 << 20, include_dashboard=False)  # fmt: skip
    try:
        result = run(roll, real=True)
    finally:
        ray.shutdown()
    where = os.path.dirname(os.path.dirname(sys.modules["roll"].__file__ or ""))
    print(RESULT + json.dumps({**result, "where": where, "tensordict": tensordict.__version__}))


def run_real() -> dict[str, Any]:
    """``real_main`` in a new process, its logs in a temporary directory; what it measured."""
    with tempfile.TemporaryDirectory() as logs:
        done = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--real"],
            cwd=logs,
            env={**os.environ, "ROLL_LOG_DIR": logs, "RAY_ADDRESS": "local"},
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode or not lines:
        raise RuntimeError(f"ROLL's own run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    found: dict[str, Any] = json.loads(lines[-1][len(RESULT) :])
    return found


def main() -> None:
    if sys.argv[1:] == ["--real"]:
        real_main()
        return
    installed = roll_mirror.roll_is_installed()
    roll_mirror.publish_as_roll()
    names = [n for ns in roll_mirror.ROLL_MODULES.values() for n in ns]
    mirror = SimpleNamespace(**{n: getattr(roll_mirror, n) for n in names})
    # Each worker publishes the mirror as it starts, importing it from tests/mirrors.
    hook = {"worker_process_setup_hook": f"{roll_mirror.IMPORTABLE_AS}.publish_as_roll",
            "env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}}  # fmt: skip
    ray.init(address="local", num_cpus=2, object_store_memory=256 << 20,
             include_dashboard=False, runtime_env=hook)  # fmt: skip
    try:
        result = run(mirror, real=False)
        batch_type = f"tensordict {tensordict.__version__}" if HAS_TENSORDICT else "stand-in"
        print(f"{MIRRORS} mirror ({batch_type} TensorDict); per step: one batch to reference, "
              f"critic and actor_train (dp {DP} x tp {TP}, DP_MP_COMPUTE)")  # fmt: skip
        show(f"enable('roll') wrapped {result['wrapped']}", result)
        # By value, each rank of each cluster pickles its chunk: 3 clusters x TP ranks.
        assert [c for _, c in result["plain"]] == [[3 * TP] * DP] * 2, result["plain"]
        # Through refshare: each distinct chunk pickled and stored once, then not again
        # (verify mode serializes each argument by value too, to check it).
        if os.environ.get("REFSHARE_VERIFY", "") != "1":
            assert [c for _, c in result["shared"]] == [[1] * DP, [0] * DP], result["shared"]
        assert [row.get("puts", 0) for row, _ in result["shared"]] == [DP, 0], result["shared"]
        would, saved = result["foretold"]
        print(f"the audit said sharing would not send {would / 2**20:.1f} MiB again;"
              f" sharing did not send {saved / 2**20:.1f} MiB again")  # fmt: skip
        print(refshare.stats())
    finally:
        ray.shutdown()
    if installed:
        real = run_real()
        title = f"\nROLL itself ({real['where']}, tensordict {real['tensordict']})"
        show(f"{title}, enable('roll') wrapped {real['wrapped']}", real)
        assert agreed(real) == agreed(json.loads(json.dumps(result))), "ROLL differs"
    else:
        print("\n(ROLL is not importable here: PYTHONPATH=/path/to/ROLL to run it too)")


if __name__ == "__main__":
    main()
