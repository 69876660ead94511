"""``refshare run`` on a Ray program that never imports refshare (tests/job_kit.py): sharing
in the driver, in controller actors and in a task's training loop, with no line changed;
the job's one report; the program's exit code and output kept.

The program's fan-outs go through ``Group.broadcast``, named with ``--methods`` as a
framework's worker-group method is named in refshare's table. Each run is a subprocess with
a Ray of its own (the local runs) or connecting to a cluster this module starts; the three
run at once, started when the first test asks for its result.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import job_kit
import pytest
from conftest import start_cluster
from helpers import run_python
from internals import FRAMEWORKS, JobReport, read_job
from ray.runtime_context import RuntimeContext

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
PROGRAM = ["-c", "import job_kit; job_kit.main()"]
SITE = "Group.broadcast"
#: The job's parts, and the roles that name their processes: a task's is its name, where Ray
#: can say it (2.40 cannot: "task").
PARTS = {"driver", "Controller", "HeldController", "train_loop"}
TASK_ROLE = "train_loop" if hasattr(RuntimeContext, "get_task_name") else "task"
ROLES = PARTS - {"train_loop"} | {TASK_ROLE}
MiB = 1 << 20
#: What else a job stores beside the batches: actor handles, small arguments, the counters'
#: own traffic.
SLACK_BYTES = MiB
TIMEOUT_S = 300


def environment() -> dict[str, str]:
    """This environment without refshare's switches (the command sets them), with the
    tests (job_kit) and this checkout (refshare) on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REFSHARE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(ROOT), env.get("PYTHONPATH", "")])
    env.update(RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    return env


def refshare(
    *args: str, timeout: float = TIMEOUT_S, path: Path | None = None
) -> subprocess.CompletedProcess[str]:
    env = environment()
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(path), env["PYTHONPATH"]])
    return run_python("-m", "refshare", *args, timeout=timeout, env=env)


class Run(NamedTuple):
    done: subprocess.CompletedProcess[str]
    report: JobReport
    printed: dict[str, Any]  #: the program's own JSON line

    def check(self) -> None:
        output = f"--- stdout\n{self.done.stdout}\n--- stderr\n{self.done.stderr[-6000:]}"
        assert self.done.returncode == 0, output
        assert "refshare job report" in self.done.stderr, output
        # Every user's workers received the batch as by value.
        results = self.printed["results"]
        assert set(results) == PARTS and all(r["as_by_value"] for r in results.values()), output


def run_job(directory: Path, *options: str, address: str | None = None) -> Run:
    where = ["--address", address] if address else []
    done = refshare(
        "run", *options, "--methods", f"job_kit:{SITE}", "--report", str(directory),
        "--", sys.executable, *PROGRAM, *where,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    printed = json.loads(lines[-1]) if lines else {}
    return Run(done, read_job(str(directory)), printed)


#: The jobs count what the object stores created through the raylets' gRPC counters.
needs_counters = pytest.mark.skipif(
    job_kit.counters.supported() is not None, reason=str(job_kit.counters.supported())
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Run]]]:
    with ThreadPoolExecutor(3) as pool:
        found = {
            "sharing": pool.submit(run_job, tmp_path_factory.mktemp("sharing")),
            "audit": pool.submit(run_job, tmp_path_factory.mktemp("audit"), "--audit"),
        }
        cluster = start_cluster({"num_cpus": 2, "include_dashboard": False})
        try:
            directory = tmp_path_factory.mktemp("cluster")
            found["cluster"] = pool.submit(run_job, directory, address=cluster.address)
            yield found
            found["cluster"].exception()  # the cluster outlives its job
        finally:
            cluster.shutdown()


def rows_by_role(report: JobReport) -> dict[str, dict[str, Any]]:
    """The one row of each process, by role."""
    found = {}
    for process in report.processes:
        (row,) = process.rows
        assert row["site"] == SITE, row
        found[process.role] = row
    return found


@pytest.mark.slow  # the runs: three jobs, each a Ray of its own or on a cluster
@needs_counters
def test_run_shares_in_the_driver_a_controller_actor_and_a_task(
    runs: dict[str, Future[Run]],
) -> None:
    run = runs["sharing"].result()
    run.check()
    rows = rows_by_role(run.report)
    # Each process fanned one batch out twice to three workers: stored once, sent by ref.
    assert set(rows) == ROLES, run.report
    for row in rows.values():
        assert not row["audit"] and row["calls"] == job_kit.CALLS, row
        assert row["bytes_sent"] == 3 * job_kit.CALLS * job_kit.BATCH_BYTES, row
        assert (row["bytes_distinct"], row["puts"]) == (job_kit.BATCH_BYTES, 1), row
    # What the object store created, counted by the raylet: one copy per process.
    distinct = sum(row["bytes_distinct"] for row in rows.values())
    assert distinct <= run.printed["created"] <= distinct + SLACK_BYTES, run.printed
    assert "(sharing): 4 processes" in run.done.stderr


@pytest.mark.slow
@needs_counters
def test_run_audit_sends_by_value_and_reports_what_sharing_would_save(
    runs: dict[str, Future[Run]],
) -> None:
    audit, sharing = runs["audit"].result(), runs["sharing"].result()
    audit.check()
    rows, shared = rows_by_role(audit.report), rows_by_role(sharing.report)
    assert set(rows) == ROLES, audit.report
    for role, row in rows.items():
        assert row["audit"] and row["puts"] == 1, row  # would have put once
        assert row["bytes_repeated"] == shared[role]["bytes_repeated"], (row, shared[role])
    # Ray stored every argument by value.
    sent = sum(row["bytes_sent"] for row in rows.values())
    assert sent <= audit.printed["created"] <= sent + SLACK_BYTES, audit.printed
    assert "(audit)" in audit.done.stderr and "nothing was changed" in audit.done.stderr


@pytest.mark.slow
@pytest.mark.verify_off  # counts the bytes the job stores, which verify's copies add to
@needs_counters
def test_run_on_a_running_cluster_sets_up_its_workers_through_the_runtime_env(
    runs: dict[str, Future[Run]],
) -> None:
    run = runs["cluster"].result()
    run.check()
    # The cluster's workers started with its environment, not the driver's: the program's
    # own runtime_env and setup hook still took effect, after refshare's.
    for role, result in run.printed["results"].items():
        if role != "driver":
            assert result["env"] == {"JOB_KIT_MARK": "theirs", "JOB_KIT_SETUP_RAN": "1"}
    rows = rows_by_role(run.report)
    assert set(rows) == ROLES, run.report
    # Each process wrote as one of this job (the command's REFSHARE_* reached them all).
    assert not run.report.other_jobs and len({p.job for p in run.report.processes}) == 1
    distinct = sum(row["bytes_distinct"] for row in rows.values())
    assert distinct <= run.printed["created"] <= distinct + SLACK_BYTES, run.printed


@pytest.mark.slow
@needs_counters
def test_report_prints_the_job_and_its_numbers(
    runs: dict[str, Future[Run]], tmp_path: Path
) -> None:
    run = runs["sharing"].result()
    directory = run.report.directory
    table = refshare("report", directory, timeout=60)
    assert table.returncode == 0, table.stderr
    assert table.stdout.strip() == str(run.report)
    numbers = refshare("report", directory, "--json", timeout=60)
    found = json.loads(numbers.stdout)
    total = found["totals"]["sharing"]
    assert total["bytes_distinct"] == 4 * job_kit.BATCH_BYTES, total
    assert {p["role"] for p in found["processes"]} == ROLES
    empty = refshare("report", str(tmp_path), timeout=60)
    assert empty.returncode == 1 and "no process" in empty.stdout


# -- the program as it is -----------------------------------------------------------------------


def test_the_programs_exit_code_and_output_are_its_own() -> None:
    program = "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"
    done = refshare("run", "--", sys.executable, "-c", program, timeout=60)
    assert done.returncode == 3
    assert done.stdout == "out\n"
    assert done.stderr.startswith("err\n"), done.stderr
    killed = refshare(
        "run", "--", sys.executable, "-c", "import os; os.kill(os.getpid(), 15)", timeout=60
    )
    assert killed.returncode == -signal.SIGTERM, killed.stderr  # ended by the same signal
    missing = refshare("run", "--", "no-such-program-here", timeout=60)
    assert missing.returncode == 127 and "command not found" in missing.stderr


def test_what_cannot_be_set_up_is_a_warning_and_the_program_runs() -> None:
    program = "import ray, job_kit; print(type(vars(job_kit.Group)['broadcast']).__name__)"
    done = refshare(
        "run", "--frameworks", "verl,torchrl", "--methods", "job_kit:Group.missing,not a target",
        "--methods", f"job_kit:{SITE}", "--", sys.executable, "-c", program, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    # A module imported after Ray is wrapped as it is imported, before any ray.init.
    assert done.stdout.split() == ["SharedFunction"], done.stdout
    assert "unknown framework 'torchrl'" in done.stderr
    if importlib.util.find_spec("verl") is None:
        assert "'verl' is not installed here" in done.stderr
    assert "'not a target'" in done.stderr
    assert "job_kit:Group.missing left unwrapped" in done.stderr


def stand_in(root: Path, framework: str) -> list[str]:
    """A package laid out as refshare's table says ``framework`` is (its first layout), each
    module importing Ray first, as a framework's do; the ``module:owner.method`` names."""
    names = []
    for target in FRAMEWORKS[framework].layouts[0]:
        *packages, module = target.module.split(".")
        folder = root.joinpath(*packages)
        for depth in range(len(packages)):
            init = root.joinpath(*packages[: depth + 1], "__init__.py")
            init.parent.mkdir(parents=True, exist_ok=True)
            init.touch()
        methods = "".join(f"    def {m}(self): pass\n" for m in target.methods)
        code = (
            f"class {target.owner}:\n{methods}"
            if target.owner
            else "".join(f"def {m}(): pass\n" for m in target.methods)
        )
        (folder / f"{module}.py").write_text(f"import ray\n{code}")
        names += [f"{target.module}:{target.owner + '.' if target.owner else ''}{m}"
                  for m in target.methods]  # fmt: skip
    return names


#: Prints the type of each method named on its command line, importing its module.
SHOW_TYPES = """
import importlib, sys, ray
for name in sys.argv[1:]:
    module, _, path = name.partition(":")
    owner = importlib.import_module(module)
    *owners, method = path.split(".")
    for part in owners:
        owner = getattr(owner, part)
    print(type(vars(owner)[method]).__name__)
"""


def test_a_framework_is_enabled_as_its_modules_are_imported(tmp_path: Path) -> None:
    names = stand_in(tmp_path, "verl")
    program = [sys.executable, "-c", SHOW_TYPES, *names]
    found = refshare("run", "--", *program, path=tmp_path, timeout=120)
    assert found.returncode == 0, found.stderr
    assert found.stdout.split() == ["SharedFunction"] * len(names), found.stderr
    other = refshare("run", "--frameworks", "nemo_rl", "--", *program, path=tmp_path, timeout=120)
    assert other.stdout.split() == ["function"] * len(names), other.stderr


#: A program that shares its worker group's method itself, with an audit, as the ROLL
#: example does; before and after, what the method is and whether its scope audits.
OWN_OPTIONS = """
import logging, refshare, group
logging.basicConfig()
def show():
    method = vars(group.Group)["broadcast"]
    print(type(method).__name__, getattr(getattr(method, "_self_options", None), "audit", None))
show()
refshare.patch_methods(group.Group, "broadcast", audit=True)
show()
"""


@pytest.mark.parametrize("first", ["", "import ray"])
def test_a_program_that_shares_a_method_itself_gets_its_own_options(
    tmp_path: Path, first: str
) -> None:
    """``refshare run`` wraps the method it is told of as the group's module is imported,
    whether the program imports Ray first or refshare (which imports Ray); the program's
    own ``patch_methods`` (or ``enable()``) then applies its own options, as it would
    without the command, where a second call of the program's own keeps the first."""
    (tmp_path / "group.py").write_text("class Group:\n    def broadcast(self): pass\n")
    program = [sys.executable, "-c", f"{first}\n{OWN_OPTIONS}"]
    done = refshare("run", "--methods", "group:Group.broadcast", "--", *program, path=tmp_path)
    assert done.returncode == 0, done.stderr
    shown = done.stdout.split()
    assert shown == ["SharedFunction", "False", "SharedFunction", "True"], done.stderr
    assert "already shared" not in done.stderr and "refshare run:" not in done.stderr


def test_the_modes_reach_the_program_as_its_environment() -> None:
    program = "import os; print(os.environ.get('REFSHARE_AUDIT'), os.environ['REFSHARE_VERIFY'])"
    for mode, printed in (("--verify", "None 1"), ("--verify=worker", "None worker")):
        done = refshare("run", mode, "--", sys.executable, "-c", program, timeout=60)
        assert done.stdout.strip() == printed, done.stderr
    # Without "--", a word after --verify would be read as its value: it is refused instead.
    wrong = refshare("run", "--verify", sys.executable, "-c", program, timeout=60)
    assert wrong.returncode == 2 and "invalid choice" in wrong.stderr
