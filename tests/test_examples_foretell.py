"""With a cache that cannot hold a step, the examples' audits still foretell what sharing
saves: each example runs with the process-wide cache's budget a quarter of the bytes one of
its steps sends (its distinct bytes, from its report at the default budget), and every
report it reads has the audit's "would save" within 5% of what sharing saved in the same
run. (At the default budget, each example checks that itself.) The runs go a few at a time,
as the examples' own do (see ``helpers.in_background``)."""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import Future
from pathlib import Path

import pytest
from helpers import in_background, output_dir, params, run_own_ray
from test_examples import EXAMPLES_DIR, HAS_TORCH, NEED_TORCH

pytestmark = [pytest.mark.scripts, pytest.mark.slow]

MiB = 1 << 20
KIT = Path(__file__).resolve().parent / "foretell_kit.py"
#: A quarter of the distinct bytes one step of each example sends: its sharing report's
#: bytes_distinct at the default budget, over its steps of new data.
BUDGETS = {
    "quickstart.py": 64 * MiB // 4,  # one 64 MiB batch
    "verl_style.py": 12 * MiB // 4,  # 24 MiB over 2 steps of new data
    "nemo_style.py": 27 * MiB // 8,  # 27 MiB over 2
    "openrlhf_style.py": 23 * MiB // 8,  # 23 MiB over 2
    "roll_style.py": 9 * MiB // 4,  # 9 MiB, one batch sent twice
    "skyrl_style.py": 32 * MiB // 8,  # 32 MiB over 2
}


def _run(name: str) -> Future[tuple[Path, subprocess.CompletedProcess[str]]]:
    """The run of example ``name`` with its budget, in the background (see
    ``helpers.in_background``): where it wrote what it read, and the run."""

    def run() -> tuple[Path, subprocess.CompletedProcess[str]]:
        out = output_dir(f"foretold {name}") / "foretold.json"
        command = (str(KIT), str(BUDGETS[name]), str(out), str(EXAMPLES_DIR / name))
        return out, run_own_ray(*command, timeout=300)

    return in_background(f"foretold {name}", run)


def _runnable(name: str) -> bool:
    return name not in NEED_TORCH or HAS_TORCH


def start_scripts(items: list[pytest.Item]) -> None:
    """The runs the selected tests check, started."""
    for item in items:
        if "name" in (found := params(item)) and _runnable(found["name"]):
            _run(found["name"])


@pytest.mark.verify_off  # verify's copies take room in the store, which a tight budget feels
@pytest.mark.parametrize("name", list(BUDGETS))
def test_the_audit_foretells_with_a_quarter_step_budget(name: str) -> None:
    if not _runnable(name):
        pytest.skip(f"{name} needs torch, as the framework it mirrors does: not installed")
    out, done = _run(name).result()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    found = json.loads(out.read_text())
    assert found["pairs"], "the example read no report with an audit and a run"
    for would, saved, report in found["pairs"]:
        assert abs(would - saved) <= 0.05 * saved, report
