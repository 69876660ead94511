"""The members-scaling and memory-pressure benchmarks run end to end in their smallest modes.

Each runs in a subprocess with its own Ray, so it never meets the suite's Ray in this process.
Only the shape of the output is checked, never the timings; that every worker received what
by value gives it is checked by the benchmarks themselves (a digest from every actor), which
exit 1 on a difference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import in_background, output_dir
from test_benchmark_smoke import assert_wrote, table_after

# Timed benchmarks: under REFSHARE_VERIFY=1 they would time verify; the step replays run there.
pytestmark = [pytest.mark.scripts, pytest.mark.slow, pytest.mark.verify_off]

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
STRATEGIES = ["by value", "ray.put", "top-level", "deep", "default"]
TIMES_HEADER = ["members", "case", *STRATEGIES, "xxh3 pass", "target", "result"]
#: What ``members.py --smoke`` measures: (N, member label), each first and repeat.
SMOKE_CASES = [("10", "1 KiB"), ("100", "1 KiB"), ("10", "128 KiB")]
PRESSURE_HEADER = [
    "case",
    "strategy",
    "steps",
    "spilled MiB",
    "errors",
    "total s",
    "step ms (median)",
    "reading ms",
    "refshare puts / hits / evictions",
    "same as by value",
]
PRESSURE_CASES = [
    f"{case}, {variant}"
    for case in ("one block", "two scopes", "5,000 refs")  # --smoke's
    for variant in ("with grpcio", "without grpcio")
]


def run(
    script: str, mode: str, out: Path, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """Run ``benchmarks/script mode --out out`` in a subprocess of its own Ray."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), mode, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "OTHER DATA" not in proc.stderr
    return proc


def _members() -> Path:
    out = output_dir("members")
    run("members.py", "--smoke", out)
    return out


def _pressure() -> tuple[Path, str]:
    out = output_dir("pressure")
    # Eight child processes connect to its Ray, each starting two actors: minutes when busy.
    return out, run("pressure.py", "--smoke", out, timeout=600).stdout


def start_scripts(items: list[pytest.Item]) -> None:
    """Both benchmarks' smoke runs, in the background (see ``helpers.in_background``)."""
    in_background("members", _members)
    in_background("pressure", _pressure)


@pytest.fixture(scope="module")
def members_run() -> Path:
    return in_background("members", _members).result()


@pytest.fixture(scope="module")
def pressure_run() -> tuple[Path, str]:
    return in_background("pressure", _pressure).result()


def test_members_writes_its_files(members_run: Path) -> None:
    assert_wrote(members_run, "members")


def test_members_table_has_every_strategy_and_case(members_run: Path) -> None:
    markdown = (members_run / "members.md").read_text()
    assert markdown.startswith("# refshare members-scaling benchmark")
    times = table_after(markdown, "## Times")
    assert times[0] == TIMES_HEADER
    expected = [
        [f"{n} \u00d7 {size}", case] for n, size in SMOKE_CASES for case in ("first", "repeat")
    ]
    assert [row[:2] for row in times[1:]] == expected
    for row in times[1:]:
        assert len(row) == len(TIMES_HEADER)
        assert row[-1] == "PASS" or row[-1].startswith("FAIL: "), row
    assert "spilled" in markdown


def test_members_json_counts(members_run: Path) -> None:
    """Every strategy timed every repetition; a repeat stores nothing new, a first call does."""
    results: dict[str, Any] = json.loads((members_run / "members.json").read_text())
    reps = results["config"]["reps"]
    for case in results["cases"]:
        assert set(case["times"]) == {"by_value", "put", "top", "deep", "default"}
        assert all(len(t) == reps and min(t) > 0 for t in case["times"].values())
        for name, counts in case["refshare_counts"].items():
            if case["case"] == "repeat":
                assert counts["puts"] == 0, (case["n"], case["member"], name, counts)
                assert counts["hits"] > 0, (case["n"], case["member"], name, counts)
            else:
                assert counts["puts"] >= reps, (case["n"], case["member"], name, counts)


def test_pressure_table(pressure_run: tuple[Path, str]) -> None:
    out, stdout = pressure_run
    markdown = (out / "pressure.md").read_text()
    assert stdout.strip().endswith(markdown.strip().splitlines()[-1])
    rows = table_after(markdown, "## Per case")
    assert rows[0] == PRESSURE_HEADER
    strategies = ["by value", "refshare (default options)"]
    assert [row[:2] for row in rows[1:]] == [[c, s] for c in PRESSURE_CASES for s in strategies]
    for row in rows[1:]:
        assert row[2] == "3" and int(row[3]) >= 0 and float(row[5]) > 0
        assert float(row[7]) > 0  # refshare reads the store, with grpcio or without
        assert row[-1] == "yes"
    results: dict[str, Any] = json.loads((out / "pressure.json").read_text())
    assert list(results["runs"]) == PRESSURE_CASES
    for case, loops in results["runs"].items():
        assert set(loops) == {"by_value", "refshare"}
        assert all(r["same_as_by_value"] for r in loops.values())
        assert loops["refshare"]["refshare_counts"]["puts"] > 0
        # Without grpcio, the child never imported it (refshare did not need it either).
        assert not any(r["grpc_imported"] for r in loops.values()) or "with grpc" in case
