"""Every script in examples/ runs to the end on its own local Ray and prints refshare.stats().

Each example checks its own results with asserts, so exit code 0 means they held. Examples
run as subprocesses: each starts (and stops) a Ray of its own, apart from the suite's. They
run a few at a time, started as the session starts (see ``helpers.in_background``).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path

import pytest
from helpers import ROOT, in_background, output_dir, params, run_own_ray
from internals import read_job

pytestmark = pytest.mark.scripts

EXAMPLES_DIR = ROOT / "examples"
EXAMPLES = sorted(p for p in EXAMPLES_DIR.glob("*.py") if not p.name.startswith("_"))
#: What ``print(refshare.stats())`` writes.
STATS_LINE = re.compile(r"^Stats\(puts=\d+, hits=\d+, .*\)$", re.MULTILINE)
TIMEOUT_S = 180

#: Runs an example with ``import torch`` failing, as on a machine without torch.
WITHOUT_TORCH = (
    "import runpy, sys; sys.modules['torch'] = None; "
    "sys.argv = [sys.argv[1]]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


def run_example(path: Path, *, without_torch: bool = False) -> subprocess.CompletedProcess[str]:
    if without_torch:
        return run_own_ray("-c", WITHOUT_TORCH, str(path), timeout=TIMEOUT_S)
    return run_own_ray(str(path), timeout=TIMEOUT_S)


#: Examples that need torch, as the framework they mirror does (verl's DataProto pickles
#: through ``torch.save``, as ROLL's does; OpenRLHF sends CPU tensors under Ray's zero-copy
#: tensor serializer): never run without it.
NEED_TORCH = {"verl_style.py", "openrlhf_style.py", "roll_style.py"}
HAS_TORCH = importlib.util.find_spec("torch") is not None
#: (example, without torch) for every run the tests below check: each example as it is, and
#: those that use torch where it is also without it.
RUNS = [(p, False) for p in EXAMPLES] + [
    (p, True)
    for p in EXAMPLES
    if p.name not in NEED_TORCH and "torch" in p.read_text(encoding="utf-8")
]


def skipped(path: Path) -> str | None:
    """Why a run is skipped here, or ``None``."""
    if path.name in NEED_TORCH and not HAS_TORCH:
        return f"{path.name} needs torch, as the framework it mirrors does: not installed"
    return None


def _run(path: Path, without_torch: bool) -> Future[subprocess.CompletedProcess[str]]:
    """The run of ``path``, in the background (see ``helpers.in_background``)."""
    key = f"example {path.name}{' without torch' if without_torch else ''}"
    return in_background(key, run_example, path, without_torch=without_torch)


def _run_verified(path: Path) -> Future[tuple[Path, subprocess.CompletedProcess[str]]]:
    """The run of ``path`` through ``refshare run --verify``, in the background: where its
    job's report is, and the run."""

    def run() -> tuple[Path, subprocess.CompletedProcess[str]]:
        out = output_dir(f"verified {path.name}")
        command = ("-m", "refshare", "run", "--verify", "--report", str(out), "--")
        return out, run_own_ray(*command, sys.executable, str(path), timeout=TIMEOUT_S)

    return in_background(f"verified {path.name}", run)


def start_scripts(items: list[pytest.Item]) -> None:
    """The runs the selected tests check, started."""
    for item in items:
        found = params(item)
        if "without_torch" in found:
            _run(found["path"], found["without_torch"])
        elif "path" in found:
            _run_verified(found["path"])


#: What ``stats()`` prints of verify's mismatches.
MISMATCHES = re.compile(r"mismatches=(\d+)")


def check(result: subprocess.CompletedProcess[str]) -> None:
    output = f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr[-5000:]}"
    assert result.returncode == 0, output
    assert STATS_LINE.search(result.stdout), output
    # Under REFSHARE_VERIFY=1 (CI runs the examples so once), every example is verified.
    assert "refshare verify:" not in result.stderr, output
    assert set(MISMATCHES.findall(result.stdout)) <= {"0"}, output


def test_examples_exist() -> None:
    names = {p.name for p in EXAMPLES}
    frameworks = {f"{name}_style.py" for name in ("verl", "nemo", "openrlhf", "skyrl", "roll")}
    assert {"quickstart.py", *frameworks} <= names, names


@pytest.mark.parametrize(
    ("path", "without_torch"),
    [
        pytest.param(
            path,
            no_torch,
            id=path.name + (" without torch" if no_torch else ""),
            marks=[pytest.mark.skip(reason=why)] if (why := skipped(path)) else [],
        )
        for path, no_torch in RUNS
    ],
)
def test_example_runs(path: Path, without_torch: bool) -> None:
    check(_run(path, without_torch).result())


@pytest.mark.verify_off  # verified by the command itself: the verify lane need not run it again
@pytest.mark.parametrize(
    "path",
    [
        pytest.param(path, marks=[pytest.mark.skip(reason=why)] if (why := skipped(path)) else [])
        for path in EXAMPLES
    ],
    ids=lambda path: path.name,
)
def test_example_under_refshare_run_verify(path: Path) -> None:
    """``refshare run --verify``, with no line of the example changed: it runs to its end,
    and the job's report shows every argument sent by ref verified: none left unverified,
    no mismatch."""
    out, done = _run_verified(path).result()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    processes = read_job(str(out)).processes
    assert processes and all(process.verify == "1" for process in processes), processes
    shared = [row for process in processes for row in process.rows if not row["audit"]]
    assert sum(row["verified"] for row in shared) > 0, shared
    assert [(row["unverified"], row["mismatches"]) for row in shared] == [(0, 0)] * len(shared)
