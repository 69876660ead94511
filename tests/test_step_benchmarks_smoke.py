"""The RL-step replays (verl-shaped: both dispatch paths and the legacy trainer's TensorDicts;
NeMo-RL-, ROLL- and SkyRL-shaped) and the type table run end to end in their smallest mode,
on their mirrors, and every worker receives the same checksums under every strategy (the
scripts exit non-zero otherwise), the audit and the ideal included, whose rows each replay's
report shows. Timings are never checked. The replays run a few at a time, beside the other
scripts (see ``helpers.in_background``)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT, in_background, output_dir, params, run_own_ray

BENCHMARKS = ROOT / "benchmarks"
CASES = {
    "rl_step dp": (["rl_step.py", "--smoke", "--backend", "mirror"], "rl_step"),
    "rl_step nd": (["rl_step.py", "--smoke", "--backend", "mirror", "--dispatch", "nd"], None),
    "rl_step tensordict": (
        ["rl_step.py", "--smoke", "--backend", "mirror", "--flow", "tensordict"],
        "rl_step_tensordict",
    ),
    "rl_step long": (
        ["rl_step.py", "--smoke", "--backend", "mirror", "--long", "6"],
        "rl_step_long",
    ),
    "nemo_step": (["nemo_step.py", "--smoke"], "nemo_step"),
    "nemo_step quarter": (["nemo_step.py", "--smoke", "--budget", "quarter"], "nemo_step"),
    "roll_step": (["roll_step.py", "--smoke"], "roll_step"),
    "skyrl_step": (["skyrl_step.py", "--smoke"], "skyrl_step"),
    "types": (["types.py", "--smoke"], "types"),
}

pytestmark = [pytest.mark.scripts, pytest.mark.slow]
pytest.importorskip("torch")  # the replays send torch batches, as the frameworks do


def _runnable(case: str) -> bool:
    return "tensordict" not in case or importlib.util.find_spec("tensordict") is not None


def _run(case: str) -> Future[tuple[Path, subprocess.CompletedProcess[str]]]:
    """The run of ``case``, in the background (see ``helpers.in_background``): where it
    wrote, and the run."""

    def run() -> tuple[Path, subprocess.CompletedProcess[str]]:
        args, out = CASES[case][0], output_dir(f"replay {case}")
        command = (str(BENCHMARKS / args[0]), *args[1:], "--out", str(out))
        return out, run_own_ray(*command, timeout=240)

    return in_background(f"replay {case}", run)


def start_scripts(items: list[pytest.Item]) -> None:
    """The runs the selected tests check, started."""
    for item in items:
        if "case" in (found := params(item)) and _runnable(found["case"]):
            _run(found["case"])


@pytest.mark.parametrize("case", list(CASES))
def test_step_benchmark_smoke(case: str) -> None:
    args, stem = CASES[case]
    if not _runnable(case):
        pytest.skip("the legacy trainer's flow sends TensorDicts: tensordict is not installed")
    tmp_path, done = _run(case).result()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    # Run under REFSHARE_VERIFY=1, no step finds a mismatch.
    assert "refshare verify:" not in done.stderr, done.stderr[-3000:]
    written = sorted(p.name for p in tmp_path.iterdir())
    assert any(name.endswith(".md") for name in written), written
    results = [p for p in tmp_path.iterdir() if p.suffix == ".json"]
    assert results and all(json.loads(p.read_text()) for p in results)
    if stem is not None:
        assert (tmp_path / f"{stem}.md").exists(), written
    if "--long" in args:  # what the store held over the steps, by value and refshare
        text = (tmp_path / f"{stem}.md").read_text()
        assert "| plain |" in text and "| default |" in text and "max MiB" in text, text
        summary = json.loads((tmp_path / f"{stem}.json").read_text())["backends"]["mirror"]
        assert len(summary["phases"]["auto"]["peak_bytes"]) == 6, summary["phases"]
        return
    if "quarter" in args:  # each cache a quarter of a step's bytes, the audit as exact
        summary = json.loads((tmp_path / f"{stem}.json").read_text())["result"]["summary"]
        assert summary["cache_budget"] > 0, summary["cache_budget"]
        assert "(`--budget quarter`)" in (tmp_path / f"{stem}.md").read_text()
    if args[0] != "types.py":
        for report in tmp_path.glob("*.md"):
            text = report.read_text()
            for row in ("| audit |", "| ideal |", "| **whole step** |", "default ÷ ideal"):
                assert row in text, (report.name, row)
            assert "| driver time over plain per step ÷ Ray's serialization" in text, report.name
            assert "| would save ÷ the default's saved bytes per step |" in text, report.name
            for summary in _summaries(json.loads(report.with_suffix(".json").read_text())):
                assert {"audit", "ideal"} <= set(summary["median_ms"]), report.name
                # What the audit would save is what the default saved (a quarter of a step's
                # bytes may hold nothing that repeats: then both are nothing).
                would, saved = summary["would_save"], summary["default_saved"]
                assert would > 0 or "quarter" in args, report.name
                assert abs(would - saved) <= 0.05 * saved, (report.name, would, saved)
                # The audit keys every large argument: its keying clock saw it run.
                assert summary["audit_keying_ms"] > 0, report.name


def _summaries(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each replayed flow's summary: one, or one per backend (``rl_step.py``)."""
    if "backends" in results:
        return [r["summary"] for r in results["backends"].values()]
    return [results["result"]["summary"]]
