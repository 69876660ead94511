"""The fan-out benchmark runs end to end in its smallest mode and writes what it promises.

It runs in a subprocess with its own Ray, so it never meets the suite's Ray in this process.
Only the shape of the output is checked, never the timings.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from helpers import in_background, output_dir

pytestmark = [pytest.mark.scripts, pytest.mark.slow]
BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "fanout.py"
STRATEGIES = [
    "by value",
    "per-call put",
    "refshare first",
    "refshare repeat",
    "refshare reuse",
    "ideal",
]
#: The project's four targets, in the summary: the last two against the strategy plus one
#: read of the payload (refshare reads a writeable argument once a call).
RATIOS = [
    "by value / repeat",
    "per-call put / repeat",
    "repeat / (ideal + one read)",
    "first / (per-call put + one read)",
]
TIMES_HEADER = [
    "payload",
    "N",
    *STRATEGIES,
    "by value / repeat",
    "per-call put / repeat",
    "repeat / ideal",
    "first / per-call put",
    "reuse / ideal",
    "store in flight: by value",
    "store in flight: refshare repeat",
]
JSON_KEYS = {
    "meta",
    "config",
    "cold",
    "warmup_seconds",
    "cases",
    "yardsticks",
    "small_args",
    "skipped",
    "summary",
}
STRATEGY_KEYS = {
    "by_value",
    "per_call_put",
    "refshare_first",
    "refshare_repeat",
    "refshare_reuse",
    "ideal",
}


def run_smoke(script: Path, out: Path) -> Path:
    """Run a benchmark ``--smoke`` in a subprocess of its own Ray; return ``out``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    proc = subprocess.run(
        [sys.executable, str(script), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, f"benchmark failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return out


def _run() -> Future[Path]:
    """The benchmark's smoke run, in the background (see ``helpers.in_background``)."""
    return in_background("fanout", lambda: run_smoke(BENCHMARK, output_dir("fanout")))


def start_scripts(items: list[pytest.Item]) -> None:
    _run()


@pytest.fixture(scope="module")
def smoke_run() -> Path:
    return _run().result()


def table_after(markdown: str, heading: str) -> list[list[str]]:
    """The rows (header first) of the first markdown table after ``heading``."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    rows = []
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
        elif rows:
            break
    return [rows[0], *rows[2:]]  # drop the |---| separator


@pytest.fixture(scope="module")
def results(smoke_run: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((smoke_run / "fanout.json").read_text())
    return data


def assert_wrote(out: Path, stem: str) -> None:
    """``stem.md`` and ``stem.json`` are there, and ``stem.png`` if matplotlib is."""
    for name in (f"{stem}.md", f"{stem}.json"):
        assert (out / name).stat().st_size > 0, name
    plot = out / f"{stem}.png"
    if importlib.util.find_spec("matplotlib") is None:  # the plot needs the bench extra
        assert not plot.exists()
    else:
        assert plot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_writes_its_files(smoke_run: Path) -> None:
    assert_wrote(smoke_run, "fanout")


def test_json_has_every_measurement(results: dict[str, Any]) -> None:
    assert results.keys() >= JSON_KEYS
    config = results["config"]
    assert config["mode"] == "smoke"
    payloads = {case["payload"] for case in results["cases"]}
    assert len(results["cases"]) == len(payloads) * len(config["workers"])
    for case in results["cases"]:
        assert set(case["times"]) == STRATEGY_KEYS
        assert all(len(t) == config["reps"] for t in case["times"].values())
        assert all(t > 0 for times in case["times"].values() for t in times)
        held = case["store_in_flight"]
        assert held is None or set(held) == STRATEGY_KEYS
    assert set(results["cold"]["times"]) == STRATEGY_KEYS
    for entry in results["yardsticks"]:
        assert set(entry["times"]) == {"xxh3_128", "memcpy", "fingerprint"}
    assert set(results["small_args"]["times"]) == {"undecorated", "decorated"}
    summary = results["summary"]
    assert [t["ratio"] for t in summary["targets"]] == RATIOS
    assert set(summary["crossover"]) == {"refshare_repeat", "refshare_first"}
    for key in ("command", "cpu", "cores", "versions"):
        assert key in results["meta"]


def test_refshare_shared_in_the_benchmark(results: dict[str, Any]) -> None:
    """The refshare strategies did what they are named for: first puts, repeats only hit."""
    reps = results["config"]["reps"]
    for case in results["cases"]:
        counts, n = case["refshare_counts"], case["n"]
        assert counts["refshare_first"] == {"puts": reps, "hits": reps * (n - 1)}
        assert counts["refshare_repeat"] == {"puts": 0, "hits": reps * n}
        assert counts["refshare_reuse"] == {"puts": 0, "hits": reps * n}


def test_markdown_tables(smoke_run: Path, results: dict[str, Any]) -> None:
    markdown = (smoke_run / "fanout.md").read_text()
    assert markdown.startswith("# refshare fan-out benchmark")
    assert "Command: `python " in markdown and "--smoke" in markdown
    assert "Machine: " in markdown

    summary = table_after(markdown, "## Summary")
    assert summary[0] == ["ratio", "measured", "target", "result"]
    assert [row[0] for row in summary[1:]] == RATIOS
    assert all(row[3] in ("PASS", "FAIL", "not measured") for row in summary[1:])
    assert "Crossover" in markdown

    times = table_after(markdown, "## Fan-out times")
    assert times[0] == TIMES_HEADER
    expected = [[case["payload"], str(case["n"])] for case in results["cases"]]
    assert [row[:2] for row in times[1:]] == expected
    assert all(len(row) == len(TIMES_HEADER) for row in times[1:])

    for heading in ("## Object store held", "## Hashing and copying", "## Cold store"):
        assert len(table_after(markdown, heading)) > 1, heading
    assert len(table_after(markdown, "## Small arguments")) == 3
