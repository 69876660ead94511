"""With a cache that cannot hold a step, the examples' audits still foretell what sharing
saves: each example runs with the process-wide cache's budget a quarter of the bytes one of
its steps sends (its distinct bytes, from its report at the default budget), and every
report it reads has the audit's "would save" within 5% of what sharing saved in the same
run. (At the default budget, each example checks that itself.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_own_ray
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


@pytest.mark.verify_off  # verify's copies take room in the store, which a tight budget feels
@pytest.mark.parametrize("name", list(BUDGETS))
def test_the_audit_foretells_with_a_quarter_step_budget(name: str, tmp_path: Path) -> None:
    if name in NEED_TORCH and not HAS_TORCH:
        pytest.skip(f"{name} needs torch, as the framework it mirrors does: not installed")
    out = tmp_path / "foretold.json"
    done = run_own_ray(
        str(KIT), str(BUDGETS[name]), str(out), str(EXAMPLES_DIR / name), timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    found = json.loads(out.read_text())
    assert found["pairs"], "the example read no report with an audit and a run"
    for would, saved, report in found["pairs"]:
        assert abs(would - saved) <= 0.05 * saved, report
