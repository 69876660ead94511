"""The cluster benchmark runs end to end in its smallest mode, writes what it promises, and
its byte counts hold the project's claims: they are exact counts, not timings, so even the
smoke run must meet them. Timings are never checked.

It runs in a subprocess that starts its own simulated cluster, so it never meets the suite's
Ray in this process.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from helpers import in_background, output_dir
from test_benchmark_smoke import assert_wrote, run_smoke, table_after

# The benchmark's byte counting (Ray and the standard library only): says where it cannot run.
sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _cluster_counters as counters

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

pytestmark = [pytest.mark.scripts, pytest.mark.slow]

BROADCAST = ["by value", "per-call put", "refshare first sight", "refshare repeat"]
BATCH = [*BROADCAST, "deep, first sight"]
NODES = ["head (driver)", "node 1", "node 2", "node 3"]
CALLS = ["compute_log_prob", "compute_ref_log_prob", "compute_values", "update_critic",
         "update_actor"]  # fmt: skip
#: Goals that are byte counts or checks of what workers received: exact, so always met.
EXACT_GOALS = (
    "refshare repeat moves 0 bytes between nodes",
    "refshare repeat moves 0 bytes in the batch too",
    "refshare first sight moves at most",
    "by value moves",
    "deep moves each member once per step",
    "object locations agree with the counters",
    "byte counts repeat exactly",
    "every worker received exactly",
)


def _run() -> Future[Path]:
    """The benchmark's smoke run, in the background (see ``helpers.in_background``)."""
    return in_background(
        "cluster", lambda: run_smoke(BENCHMARKS / "cluster.py", output_dir("cluster"))
    )


def start_scripts(items: list[pytest.Item]) -> None:
    if counters.supported() is None:  # where its counters can run
        _run()


@pytest.fixture(scope="module")
def smoke_run() -> Path:
    reason = counters.supported()
    if reason is not None:
        pytest.skip(reason)
    return _run().result()


@pytest.fixture(scope="module")
def results(smoke_run: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((smoke_run / "cluster.json").read_text())
    return data


def test_writes_its_files(smoke_run: Path) -> None:
    assert_wrote(smoke_run, "cluster")


def test_json_has_every_measurement(results: dict[str, Any]) -> None:
    assert results.keys() >= {"meta", "config", "topology", "broadcast", "batch", "goals"}
    assert results["config"]["mode"] == "smoke"
    topology = results["topology"]
    assert topology["workers_on"] == {"head (driver)": 0, "node 1": 2, "node 2": 2, "node 3": 2}
    assert (topology["workers"], topology["worker_nodes"], topology["remote_workers"]) == (6, 3, 6)
    reps = results["config"]["reps"]
    for strategy in ("by_value", "per_call_put", "refshare_first", "refshare_repeat"):
        entry = results["broadcast"]["strategies"][strategy]
        assert len(entry["timed"]) == reps
        assert set(entry["peak"]) == set(NODES)
        for record in [*entry["timed"], entry["held"]]:
            assert set(record["created"]) == set(NODES)
            assert record["received_ok"] and record["seconds"] > 0
    batch = results["batch"]
    assert [c["name"] for c in batch["calls"]] == CALLS
    assert batch["distinct_bytes"] == batch["calls"][-1]["nbytes"]
    for entry in batch["strategies"].values():
        assert len(entry["timed"]) == reps
        assert list(entry["held"]) == CALLS and set(entry["peak"]) == set(NODES)


def test_byte_counts_hold_the_claims(results: dict[str, Any]) -> None:
    """The counts themselves, against the broadcast's size S as Ray stores it."""
    size = results["broadcast"]["object_bytes"]
    moved = {
        s: {r["moved"] for r in [*e["timed"], e["held"]]}
        for s, e in results["broadcast"]["strategies"].items()
    }
    assert moved == {
        "by_value": {6 * size},  # each worker pulls its own copy
        "per_call_put": {3 * size},  # each worker node pulls one
        "refshare_first": {3 * size},
        "refshare_repeat": {0},
    }
    steps = results["batch"]["strategies"]
    held = {s: [e["held"][c]["moved"] for c in CALLS] for s, e in steps.items()}
    assert held["refshare_repeat"] == [0] * 5
    assert held["refshare_first"][:4] == held["by_value"][:4] and held["refshare_first"][4] == 0
    assert held["deep"][4] == 0 and 0 < held["deep"][1] < held["deep"][0] / 4
    assert sum(held["deep"]) < 1.01 * results["batch"]["distinct_bytes"]
    goals = {g["text"]: g["ok"] for g in results["goals"]}
    for start in EXACT_GOALS:
        assert [ok for text, ok in goals.items() if text.startswith(start)] == [True], start


def test_markdown(smoke_run: Path, results: dict[str, Any]) -> None:
    markdown = (smoke_run / "cluster.md").read_text()
    assert markdown.startswith("# refshare at cluster scale")
    assert "Command: `python benchmarks/cluster.py --smoke" in markdown
    for heading in ("## Setup", "## How it was measured", "## Goals"):
        assert f"\n{heading}\n" in markdown, heading
    assert "cumulative_created_bytes" in markdown and "get_object_locations" in markdown
    nodes = table_after(markdown, "## Setup")
    assert nodes[0] == ["node", "address", "object store", "workers"]
    assert [row[0] for row in nodes[1:]] == NODES
    goals = [line for line in markdown.splitlines() if line.startswith("- ") and ": " in line]
    assert len([g for g in goals if g.endswith((": yes", ": NO"))]) == len(results["goals"])
    broadcast = table_after(markdown, "## Broadcast")
    assert broadcast[0][:3] == ["strategy", "copied between nodes", "stored on the driver's node"]
    assert [row[0] for row in broadcast[1:]] == BROADCAST
    batch = table_after(markdown, "## Growing batch")
    assert batch[0] == ["call", "batch MiB", *BATCH]
    assert [row[0].split(" +")[0] for row in batch[1:]] == [*CALLS, "**whole step**"]
    assert len(table_after(markdown, "Peak store use above rest")) == 1 + len(BATCH)
    assert len(table_after(markdown, "Milliseconds per call")) == 2 + len(CALLS)
