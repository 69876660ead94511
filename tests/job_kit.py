"""A Ray program that never imports refshare, for ``refshare run`` to run (tests/test_cli.py).

A worker group as frameworks write them (``Group.broadcast`` fans one batch out to three
actors), used four ways: by the driver; by a controller actor, released once its loop is
done (verl's ``TaskRunner``); by one still held at ``ray.shutdown()``; and by a training
loop run in a Ray task (SkyRL's ``skyrl_entrypoint``). Run as
``python -c "import job_kit; job_kit.main()" [--address ADDRESS]``, it prints one JSON line:
what each fan-out's workers received, and the bytes the object stores created meanwhile,
counted by the raylets (``benchmarks/_cluster_counters.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _cluster_counters as counters

MiB = 1 << 20
BATCH_BYTES = 4 * MiB
CALLS = 2  #: fan-outs of one batch per user: the second finds what the first stored
#: What the program waits before ``ray.shutdown()``, which kills the task's worker and the
#: held actor: a killed process's report loses at most its last second.
SLACK_S = 1.5
#: The program's own runtime_env, given when it connects to a cluster.
MARK_ENV = "JOB_KIT_MARK"
SETUP_RAN_ENV = "JOB_KIT_SETUP_RAN"


def mark_setup() -> None:
    """The program's own ``worker_process_setup_hook``."""
    os.environ[SETUP_RAN_ENV] = "1"


@ray.remote(num_cpus=0.01)
class Worker:
    def receive(self, batch: np.ndarray) -> tuple[float, bool]:
        return float(batch[::4096].sum()), bool(batch.flags.writeable)


class Group:
    """One method, one fan-out: ``refshare run --methods job_kit:Group.broadcast`` wraps it."""

    def __init__(self, workers: list[Any]) -> None:
        self.workers = workers

    def broadcast(self, batch: np.ndarray) -> list[tuple[float, bool]]:
        return ray.get([w.receive.remote(batch) for w in self.workers])


def batch(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random(BATCH_BYTES // 8)


def train(workers: list[Any], seed: int) -> dict[str, Any]:
    """A training loop's fan-outs, what they received, and the process's environment."""
    group, data = Group(workers), batch(seed)
    received = [group.broadcast(data) for _ in range(CALLS)]
    expected = [[(float(data[::4096].sum()), False)] * len(workers)] * CALLS
    env = {name: os.environ.get(name) for name in (MARK_ENV, SETUP_RAN_ENV)}
    return {"as_by_value": received == expected, "env": env}


@ray.remote(num_cpus=0.01)
class Controller:
    def run(self, workers: list[Any], seed: int) -> dict[str, Any]:
        return train(workers, seed)


@ray.remote(num_cpus=0.01)
class HeldController:
    def run(self, workers: list[Any], seed: int) -> dict[str, Any]:
        return train(workers, seed)


@ray.remote(num_cpus=0.01)
def train_loop(workers: list[Any], seed: int) -> dict[str, Any]:
    return train(workers, seed)


def start_local_ray() -> None:
    """A local Ray, tried again when it does not come up in time, as tests/conftest.py does
    (on 2 busy cores its GCS now and then misses its deadline; a second start succeeds)."""
    for attempt in range(3):
        try:
            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
            return
        except Exception as error:
            if "timed out" not in str(error).lower() or attempt == 2:
                raise
            ray.shutdown()
            time.sleep(2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", help="a running cluster's (default: start a local Ray)")
    args = parser.parse_args()
    if args.address:
        ray.init(
            address=args.address,
            runtime_env={
                "env_vars": {MARK_ENV: "theirs"},
                "worker_process_setup_hook": "job_kit.mark_setup",
            },
        )
    else:
        start_local_ray()
    workers = [Worker.remote() for _ in range(3)]
    ray.get([w.receive.remote(np.zeros(1)) for w in workers])  # started before counting
    controller, held = Controller.remote(), HeldController.remote()
    nodes = counters.cluster_nodes()
    before = counters.settled(nodes)
    results = {"driver": train(workers, 0)}
    results["Controller"] = ray.get(controller.run.remote(workers, 1))
    del controller  # released: its process ends
    results["HeldController"] = ray.get(held.run.remote(workers, 2))
    results["train_loop"] = ray.get(train_loop.remote(workers, 3))
    created = sum(counters.created(before, counters.settled(nodes)).values())
    print(json.dumps({"results": results, "created": created}), flush=True)
    time.sleep(SLACK_S)
    ray.shutdown()  # kills the task's worker and the held controller
