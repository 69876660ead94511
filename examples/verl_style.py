"""verl 0.9.1's dispatch, mirrored: one batch for actor, reference and critic, with refshare.

The mirror of verl 0.9.1 is tests/mirrors/verl_mirror.py (the tests and the benchmarks use it
too).
A group method is a ``Functor`` from ``func_generator``: dispatch, then ``execute_all`` ->
``execute_all_async``, which gives the i-th item of list arguments to the i-th worker.
ONE_TO_ALL sends ``[arg] * world_size`` by value; the nd-compute dispatch chunks the batch
per DP rank and ``parallel_put``s the chunks from a thread pool, so TP ranks share a ref, but
each group's call puts the same chunks again. refshare wraps the two names
``refshare.enable("verl")`` wraps.

Two flows, on dp 2 x tp 2:

1. a weight broadcast, then one ``DataProto`` sent to actor, reference and critic;
2. (where tensordict is installed) the legacy trainer's step (``trainer.use_v1=False``): five
   calls, each sending a TensorDict converted afresh from the growing ``DataProto``
   (``to_tensordict``, ``left_right_2_no_padding``, the call's flags), chunked by the dispatch
   into one consolidated TensorDict per DP rank.

Where verl imports, the same steps run again on verl's own code, and every worker must
receive the same. Needs torch, as verl does.

Run: python examples/verl_style.py
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import ray
import torch

import refshare

# CI cannot install verl's GPU stack: the mirror of its code beside the tests stands in for it,
# here and in Ray's workers (they inherit PYTHONPATH from the driver that starts Ray).
MIRROR_DIR = str(Path(__file__).resolve().parents[1] / "tests" / "mirrors")
sys.path.insert(0, MIRROR_DIR)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (MIRROR_DIR, os.environ.get("PYTHONPATH"))))
import verl_mirror as mirror  # noqa: E402

TALLY: Counter[str] = Counter()  # the example's counters, for the "without refshare" column
MiB = 1 << 20
# dp=2 x tp=2: workers 0, 1 get chunk 0, workers 2, 3 chunk 1. (verl asks the workers for this
# mapping on a mesh's first use, with a nested fan-out: _query_dispatch_info.)
DP, MAPPING = 2, [0, 0, 1, 1]
#: The groups of each flow and their methods; one process holds them all, as verl's
#: colocated workers do.
GROUPS = {
    "dataproto": {"actor": ("load_weights", "compute_log_prob"),
                  "reference": ("compute_ref_log_prob",), "critic": ("compute_values",)},
    "tensordict": {"actor": ("compute_log_prob", "update_actor"),
                   "reference": ("compute_ref_log_prob",),
                   "critic": ("infer_batch", "train_mini_batch")},
}  # fmt: skip


@ray.remote(num_cpus=0.1)
class Worker:
    """Says what it received: a checksum of the weights, the DataProto or the TensorDict."""

    def load_weights(self, weights: torch.Tensor) -> int:
        return mirror.checksum(weights)

    def compute_log_prob(self, data: Any) -> int:
        return mirror.checksum(data)

    compute_ref_log_prob = compute_values = compute_log_prob
    infer_batch = train_mini_batch = update_actor = compute_log_prob


def real_verl() -> Any:
    """verl's functions and classes of the mirror's names, or None where verl does not import."""
    try:
        from verl.protocol import DataProto
        from verl.single_controller.base import decorator
        from verl.single_controller.ray import base
    except ImportError:
        return None
    names = {**vars(decorator), **vars(base), "DataProto": DataProto}
    try:
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import left_right_2_no_padding
    except ImportError:  # no tensordict: the first flow only
        return SimpleNamespace(**names)

    def convert(batch: Any, flags: dict[str, Any]) -> Any:
        return tu.assign_non_tensor(left_right_2_no_padding(batch.to_tensordict()), **flags)

    return SimpleNamespace(**names, convert=convert)


def make_group(v: Any, workers: list[Any], *methods: str) -> Any:
    """What verl's ``_bind_worker_method`` builds: one Functor per method, on the instance."""
    group = v.RayWorkerGroup.__new__(v.RayWorkerGroup)
    group._workers, group._world_size, group.fused_worker_used = workers, len(workers), False
    for name in methods:
        nd = partial(v.dispatch_nd_compute_dataproto, MAPPING, DP)
        dispatch = v.dispatch_one_to_all if name == "load_weights" else nd
        collect = v.collect_all_to_all  # each worker's checksum
        func = v.func_generator(group, name, dispatch, collect, group.execute_all, True)
        setattr(group, name, func)
    return group


def snapshot() -> Counter[str]:
    return Counter({**TALLY, **refshare.stats()._asdict()})


def run_steps(
    v: Any, workers: list[Any], flow: str, steps: list[Any], step: Callable[..., list[Any]]
) -> tuple[list[Any], list[Any]]:
    """Per step, what was counted and what the workers received (checksums)."""
    groups = {name: make_group(v, workers, *methods) for name, methods in GROUPS[flow].items()}
    counts, sums = [], []
    for data in steps:
        before = snapshot()
        sums.append(step(v, SimpleNamespace(**groups), *data))
        counts.append(snapshot() - before)
    return counts, sums


def dataproto_step(v: Any, g: Any, weights: torch.Tensor, tensors: dict[str, Any]) -> list[Any]:
    """Weights one-to-all, then one new DataProto (as the trainer makes) to the three groups."""
    batch = v.DataProto.from_dict(tensors, meta_info={"temperature": 1.0})
    sums = [g.actor.load_weights(weights), g.actor.compute_log_prob(batch)]
    return [*sums, g.reference.compute_ref_log_prob(batch), g.critic.compute_values(batch)]


def legacy_step(v: Any, g: Any, start: dict[str, Any], later: dict[str, Any]) -> list[Any]:
    """The legacy trainer's five data calls, each on a fresh conversion of the batch, which
    gains a key after each of the first three calls and four before the critic's update."""
    batch = v.DataProto.from_dict(*(dict(part) for part in start))  # update_actor changes it
    sums = []
    for name, _, flags in mirror.legacy_calls(len(batch)):
        if name == "update_actor":
            batch.meta_info.update(mirror.UPDATE_ACTOR_META)
        group = next(k for k, methods in GROUPS["tensordict"].items() if name in methods)
        sums.append(getattr(getattr(g, group), name)(v.convert(batch, flags)))
        if name in later:
            batch = batch.union(v.DataProto.from_dict(later[name]))
    return sums


def legacy_batch(seed: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A batch as the legacy trainer's first data call gets it, and the keys each call adds
    after it."""
    start = mirror.rollout(64, 256, 256, seed)
    g, mask = torch.Generator().manual_seed(seed), start[0]["response_mask"]

    def floats() -> torch.Tensor:
        return torch.randn(mask.shape, generator=g) * mask

    scores = floats()
    later = {"compute_log_prob": {"old_log_probs": floats()},
             "compute_ref_log_prob": {"ref_log_prob": floats()},
             "infer_batch": {"values": floats(), "token_level_scores": scores,
                             "token_level_rewards": scores, "advantages": floats(),
                             "returns": floats()}}  # fmt: skip
    return start, later


def counted_mirror() -> Callable[[], None]:
    """Count, in the mirror, what verl stores without refshare: each ``parallel_put`` item,
    and each large argument sent by value (Ray stores one per task). Returns the undo."""
    group, put = mirror.RayWorkerGroup, mirror.parallel_put
    single = group.__dict__["_execute_remote_single_worker"]

    def parallel_put(data_list: list[Any], max_workers: int | None = None) -> list[Any]:
        TALLY["ray.put"] += len(data_list)
        TALLY["bytes"] += sum(map(refshare.estimate_size, data_list))
        return put(data_list, max_workers)

    def execute_single(self: Any, worker: Any, method_name: str, *args: Any, **kw: Any) -> Any:
        big = [a for a in (*args, *kw.values()) if refshare.estimate_size(a) > 100 << 10]
        TALLY["by value"] += len(big)
        TALLY["bytes"] += sum(map(refshare.estimate_size, big))
        return single(self, worker, method_name, *args, **kw)

    mirror.parallel_put, group._execute_remote_single_worker = parallel_put, execute_single

    def undo() -> None:
        mirror.parallel_put, group._execute_remote_single_worker = put, single

    return undo


def show(title: str, labels: list[str], plain: list[Any], shared: list[Any]) -> None:
    print(title)
    print("step         stored without refshare               stored with refshare     hits")
    for label, old, new in zip(labels, plain, shared, strict=True):
        without = f"{old['ray.put'] + old['by value']} ({old['ray.put']} ray.put + "
        without += f"{old['by value']} by value), {old['bytes'] / MiB:.1f} MiB"
        print(f"{label:<12} {without:<37} {new['puts']:>6}, {new['bytes_put'] / MiB:5.1f} MiB"
              f" {new['hits']:>6}")  # fmt: skip


def show_real(title: str, labels: list[str], real: list[Any]) -> None:
    print(title)
    print("step         verl's ray.put calls          stored with refshare   hits")
    for label, row in zip(labels, real, strict=True):
        print(f"{label:<12} {row['put_calls']:<29} {row['puts']:>20} {row['hits']:>6}")


def main() -> None:
    ray.init(address="local", num_cpus=2, object_store_memory=256 << 20, include_dashboard=False)
    try:
        g = torch.Generator().manual_seed(0)
        workers = [Worker.remote() for _ in MAPPING]  # type: ignore[attr-defined]
        weights = [torch.rand(1 << 20, generator=g) for _ in range(2)]  # 4 MiB
        batches = [{"input_ids": torch.randint(0, 32_000, (512, 2048), generator=g)}
                   for _ in range(2)]  # 8 MiB  # fmt: skip
        flows = {
            "dataproto": (["1 new data", "2 same", "3 same", "4 new data"],
                          [(weights[i], batches[i]) for i in (0, 0, 0, 1)], dataproto_step),
        }  # fmt: skip
        if mirror.HAS_TENSORDICT:
            legacy = [legacy_batch(seed) for seed in (0, 0, 1)]
            flows["tensordict"] = (["1 new data", "2 same", "3 new data"], legacy, legacy_step)

        undo, runs, foretold = counted_mirror(), {}, {}
        for flow, (_, steps, step) in flows.items():
            plain, plain_sums = run_steps(mirror, workers, flow, steps, step)
            refshare.reset_report()
            for audit in (True, False):  # an audit first: keyed as sharing keys, sent by value
                refshare.patch_methods(mirror.RayWorkerGroup, "execute_all_async", audit=audit)
                refshare.patch_methods(mirror, "parallel_put", audit=audit)  # as enable("verl")
                shared, shared_sums = run_steps(mirror, workers, flow, steps, step)
                refshare.unpatch_methods(mirror.RayWorkerGroup, "execute_all_async")
                refshare.unpatch_methods(mirror, "parallel_put")
                assert shared_sums == plain_sums, f"{flow}: workers received different data"
            runs[flow] = plain, shared, plain_sums
            report = refshare.report()
            foretold[flow] = report.bytes_repeated(audit=True), report.bytes_repeated()
            assert abs(foretold[flow][0] - foretold[flow][1]) <= 0.05 * foretold[flow][1], report
            refshare.clear()
        undo()

        labels = flows["dataproto"][0]
        title = "verl 0.9.1 mirror, per step: weights to 4 workers, one batch to 3 groups"
        show(title, labels, *runs["dataproto"][:2])
        first = mirror.DataProto.from_dict(batches[0], meta_info={"temperature": 1.0})
        chunks = [mirror.checksum(chunk) for chunk in first.chunk(DP)]
        assert runs["dataproto"][2][0][1:] == [[chunks[dp] for dp in MAPPING]] * 3
        # Each distinct value is stored once (weights + 2 chunks), and none on a repeated step.
        assert [row["puts"] for row in runs["dataproto"][1]] == [1 + DP, 0, 0, 1 + DP]
        if "tensordict" in runs:
            title = "\nthe legacy trainer's step, mirrored: 5 calls, each a fresh TensorDict"
            show(title, flows["tensordict"][0], *runs["tensordict"][:2])
            # No two calls send equal chunks, but each call's chunks hold the rows of the
            # one before with a key more: their leaves are stored once, as members (fewer
            # bytes than plain stores); a step sent again stores nothing.
            plain_rows, shared_rows = runs["tensordict"][:2]
            assert shared_rows[1]["puts"] == 0, shared_rows
            for new, old in ((shared_rows[0], plain_rows[0]), (shared_rows[2], plain_rows[2])):
                assert new["bytes_put"] < old["bytes"], (new, old)
        else:
            print("\n(the legacy trainer's step needs tensordict: pip install tensordict)")

        for flow, (would, saved) in foretold.items():
            print(f"{flow}: the audit said sharing would not send {would / MiB:.1f} MiB again;"
                  f" sharing did not send {saved / MiB:.1f} MiB again")  # fmt: skip

        verl = real_verl()
        if verl is not None:
            wrapped = refshare.enable("verl")
            print(f"\nverl {sys.modules['verl'].__version__} itself, enable() wrapped {wrapped}")
            for flow, (names, steps, step) in flows.items():
                if flow == "tensordict" and not hasattr(verl, "convert"):
                    continue
                real, real_sums = run_steps(verl, workers, flow, steps, step)
                _, shared, plain_sums = runs[flow]
                assert real_sums == plain_sums, f"{flow}: workers received other data from verl"
                show_real(f"{flow}:", names, real)
                same = [(r["puts"], r["hits"]) for r in shared]
                assert [(r["puts"], r["hits"]) for r in real] == same, flow
                refshare.clear()

        print(refshare.stats())
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
