"""refshare.enable("verl") on the real verl 0.9.1, set up by worker_setup in a controller
actor as verl's TaskRunner is. Runs where verl imports (``.ci/run`` has a venv for it)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import ray
from conftest import init_local_ray, restart_local_ray

pytest.importorskip("verl.utils.ray_utils")
pytest.importorskip("verl.single_controller.ray.base")


@pytest.fixture
def ray_with_setup_hook() -> Iterator[None]:
    """A Ray session whose workers run refshare.worker_setup (a job-level setting only)."""
    ray.shutdown()
    init_local_ray(
        runtime_env={
            "worker_process_setup_hook": "refshare.worker_setup",
            "env_vars": {"REFSHARE_ENABLE": "verl"},
        },
    )
    yield
    restart_local_ray()


N = 3


@ray.remote(num_cpus=0.1)
class Member:
    def total(self, chunk: Any) -> float:
        return float(np.asarray(chunk).sum())


@ray.remote(num_cpus=0.1)
class TaskRunner:
    """A controller in an actor: three groups receive the same chunks, as in one step."""

    def step(self, members: list[Any], chunks: list[np.ndarray], big: np.ndarray) -> Any:
        from verl.single_controller.ray.base import RayWorkerGroup
        from verl.utils.ray_utils import parallel_put

        import refshare

        refshare.reset_stats()
        group = RayWorkerGroup.__new__(RayWorkerGroup)  # the fan-out state only
        group._workers, group.fused_worker_used = members, False
        totals = []
        for _ in range(3):  # actor, critic, reference: verl's nd dispatch puts each chunk
            refs = parallel_put(chunks, max_workers=2)
            totals.append(ray.get(group.execute_all_async("total", refs)))
        broadcast = ray.get(group.execute_all_async("total", big))  # by value, one-to-all
        return totals, broadcast, refshare.stats()._asdict(), refshare.is_installed()


@pytest.mark.usefixtures("ray_with_setup_hook")
def test_worker_setup_enables_verl_inside_a_controller_actor() -> None:
    members = [Member.remote() for _ in range(N)]
    chunks = [np.full(1 << 16, float(i)) for i in range(N)]
    big = np.ones(1 << 18)
    runner = TaskRunner.remote()
    totals, broadcast, stats, installed = ray.get(runner.step.remote(members, chunks, big))
    expected = [float(c.sum()) for c in chunks]
    assert totals == [expected] * 3 and broadcast == [float(big.sum())] * N
    puts, hits, put_calls = stats["puts"], stats["hits"], stats["put_calls"]
    assert installed and put_calls == 3 * N
    assert puts == N + 1  # each chunk once for the three groups, the broadcast once
    assert hits == 2 * N + N - 1
