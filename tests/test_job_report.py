"""One report per job: each process's rows written as it goes, named by host, pid and role,
and a directory of them read back as one table (tests/test_cli.py runs a whole job)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
from helpers import Worker
from internals import Chain, Method, merged_runtime_env, read_job
from internals import job_writer as _job

import refshare

pytestmark = pytest.mark.usefixtures("local_ray", "fresh")


@pytest.fixture(autouse=True)
def _fresh_report() -> None:
    refshare.reset_report()


def fan_out() -> None:
    workers = [Worker.remote() for _ in range(2)]
    batch = np.ones(1 << 17)
    with refshare.sharing():
        ray.get([w.receive.remote(batch) for w in workers])


def test_the_writer_keeps_the_file_current_and_writes_only_what_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = _job.Writer(str(tmp_path), "driver")
    fan_out()
    assert writer.look(final=True)
    assert not writer.look(final=True)  # nothing changed: nothing written
    (process,) = read_job(str(tmp_path)).processes
    assert (process.host, process.pid) == (socket.gethostname(), os.getpid())
    assert process.role == "driver"
    assert [row["site"] for row in process.rows] == [r.site for r in refshare.report().rows]
    assert process.rows[0]["bytes_sent"] == 2 * (1 << 20), process.rows
    # While the counts change, a write waits for them to settle (the same at two looks)...
    monkeypatch.setattr(_job, "MIN_GAP_S", 3600.0)
    fan_out()
    assert not writer.look()
    assert writer.look()
    assert read_job(str(tmp_path)).processes[0].rows[0]["calls"] == 2
    # ... or for a second to pass since the last: a killed process loses at most that.
    monkeypatch.setattr(_job, "MIN_GAP_S", 0.0)
    fan_out()
    assert writer.look()
    assert read_job(str(tmp_path)).processes[0].rows[0]["calls"] == 3
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(writer.path)]


@ray.remote(num_cpus=0.05)
class Controller:
    def role(self) -> str:
        return _job.process_role()


@ray.remote(num_cpus=0.05)
def training_loop() -> str:
    return _job.process_role()


def test_a_process_is_named_by_its_role() -> None:
    assert _job.process_role() == "driver"
    assert ray.get(Controller.remote().role.remote()) == "Controller"
    task_names = hasattr(ray.runtime_context.RuntimeContext, "get_task_name")  # not on 2.40
    assert ray.get(training_loop.remote()) == ("training_loop" if task_names else "task")


@pytest.mark.parametrize(
    ("value", "directory"),
    [("", None), ("1", None), ("true", None), ("0", None), ("off", None), ("/r/job", "/r/job")],
)
def test_refshare_report_names_a_directory_or_means_print_at_exit(
    monkeypatch: pytest.MonkeyPatch, value: str, directory: str | None
) -> None:
    monkeypatch.setenv("REFSHARE_REPORT", value)
    assert _job.report_directory() == directory


# -- the job's table ----------------------------------------------------------------------------


def row(site: str, **fields: Any) -> dict[str, Any]:
    counts = {"calls": 2, "submissions": 6, "arguments": 6, "bytes_sent": 6 << 20,
              "bytes_repeated": 5 << 20, "bytes_distinct": 1 << 20, "puts": 1, "hits": 5,
              "by_value": 0, "mismatches": 0, "evictions": 0, "reasons": []}  # fmt: skip
    return {"site": site, "audit": False, **counts, "saved": 5 / 6, **fields}


def write(directory: Path, pid: int, role: str, rows: list[dict[str, Any]], **fields: Any) -> None:
    data = {"refshare_report": 1, "job": "j1", "host": "h", "pid": pid, "role": role,
            "audit": False, "verify": "", "written": 1.0, "final": True, "rows": rows}  # fmt: skip
    data.update(fields)
    (directory / f"h-{pid}-{role}.json").write_text(json.dumps(data))


def test_the_table_adds_each_process_and_marks_the_mode(tmp_path: Path) -> None:
    write(tmp_path, 1, "driver", [row("Group.run", reasons=[["holds a ref", 2]])])
    write(tmp_path, 2, "TaskRunner", [row("Group.run")])
    write(tmp_path, 3, "old", [row("Group.run")], job="j0", written=0.5)  # an earlier job
    (tmp_path / "h-4-x.json.4.tmp").write_text("{")  # a write under way
    (tmp_path / "other.json").write_text(json.dumps({"not": "ours"}))
    (tmp_path / "broken.json").write_text("{")
    found = read_job(str(tmp_path))
    assert (found.job, found.other_jobs) == ("j1", ("j0",))
    assert [p.role for p in found.processes] == ["driver", "TaskRunner"]
    assert found.totals()["sharing"]["bytes_distinct"] == 2 << 20
    text = str(found)
    assert text.startswith("refshare job report (sharing): 2 processes on 1 host (h)")
    assert "TaskRunner:2" in text and "driver:1" in text and "total" in text
    assert "Group.run (driver:1): 2 by value: holds a ref" in text
    assert "verified" not in text and "would save" not in text  # rows without them
    assert "broken.json" in text and "1 other job" in text
    assert read_job(str(tmp_path), job="j0").processes[0].role == "old"


def test_verify_and_audit_runs_are_marked_with_their_columns(tmp_path: Path) -> None:
    write(tmp_path, 1, "driver", [row("a", verified=6, unverified=1,
          unverified_reasons=[["a bytearray", 1]])], verify="worker")  # fmt: skip
    text = str(read_job(str(tmp_path)))
    assert "(verify on workers)" in text
    assert "verified  unverified  mismatches" in text
    assert "a (driver:1): 1 unverified: a bytearray" in text
    write(tmp_path, 1, "driver", [row("a", audit=True, would_save_ms=86.0, sending_ms=100.0)],
          audit=True)  # fmt: skip
    text = str(read_job(str(tmp_path)))
    assert "(audit)" in text and "~86 ms (86%)" in text and "verified" not in text


# -- a cluster's workers ------------------------------------------------------------------------


def theirs() -> None:
    os.environ["REFSHARE_TEST_THEIRS"] = "ran"


def test_the_runtime_env_carries_the_setup_and_keeps_the_programs_own() -> None:
    mine = {"REFSHARE_RUN": "1", "REFSHARE_AUDIT": "1"}
    assert merged_runtime_env(None, mine) == {
        "env_vars": mine,
        "worker_process_setup_hook": "refshare._boot.worker_hook",
    }
    given = ray.runtime_env.RuntimeEnv(env_vars={"REFSHARE_AUDIT": "0", "A": "b"}, pip=["x"])
    merged = merged_runtime_env(given, mine)
    assert merged["pip"] == given["pip"]
    assert merged["env_vars"] == {"REFSHARE_RUN": "1", "REFSHARE_AUDIT": "0", "A": "b"}
    for hook in (theirs, f"{__name__}.theirs"):
        chained = merged_runtime_env({"worker_process_setup_hook": hook}, mine)
        chain = chained["worker_process_setup_hook"]
        assert isinstance(chain, Chain) and chain.__name__.startswith("refshare_then_")
        os.environ.pop("REFSHARE_TEST_THEIRS", None)
        chain()  # refshare's setup (already done in this process), then theirs
        assert os.environ.pop("REFSHARE_TEST_THEIRS") == "ran"


def test_method_targets_are_module_class_method() -> None:
    assert Method.parse("pkg.mod:Group.run") == Method("pkg.mod", "Group", "run")
    assert Method.parse("pkg:put") == Method("pkg", "", "put")
    assert str(Method.parse("a:B.C.d")) == "a:B.C.d"
    for bad in ("pkg.Group.run", "pkg:", ":run", "pkg:Group.", "a b:c"):
        with pytest.raises(ValueError, match=r"module:Class\.method"):
            Method.parse(bad)
