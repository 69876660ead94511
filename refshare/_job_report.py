"""One report per job, the reading side: a directory of per-process files as one table.

Each row is one call site in one process. Columns a row does not carry are left out of the
table (verify's ``verified`` and ``unverified``, the audit's time estimate), so a report
written by an older or newer refshare still reads.
"""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

from ._job import FORMAT
from ._report import format_table

#: The time an audit says sharing would save, and the time spent sending arguments, in ms,
#: where rows carry them.
TIME_FIELD = "would_save_ms"
SENDING_FIELD = "sending_ms"
#: Verify's counts, where rows carry them.
VERIFY_FIELDS = ("verified", "unverified", "mismatches")
#: The counts a job's totals add up.
SUMMED = (
    "calls", "submissions", "arguments", "bytes_sent", "bytes_repeated",
    "bytes_repeated_in_call", "bytes_repeated_members", "bytes_distinct", "puts", "hits",
    "unkeyed", "by_value", "mismatches", "evictions", "verified", "unverified", TIME_FIELD,
    SENDING_FIELD,
)  # fmt: skip


class Process(NamedTuple):
    """What one process wrote: who it is, its switches, and its rows."""

    host: str
    pid: int
    role: str
    job: str
    audit: bool
    verify: str
    written: float
    rows: tuple[dict[str, Any], ...]

    @property
    def mode(self) -> str:
        """How this process ran: sharing, audit, verify, or verify on workers."""
        if self.audit:
            return "audit"
        if self.verify:
            return "verify on workers" if self.verify == "worker" else "verify"
        return "sharing"

    def label(self, one_host: bool) -> str:
        return f"{self.role}:{self.pid}" if one_host else f"{self.role}@{self.host}:{self.pid}"


class JobReport(NamedTuple):
    """Every process of one job that wrote a report, read from ``directory``."""

    directory: str
    job: str
    processes: tuple[Process, ...]
    other_jobs: tuple[str, ...]  #: jobs whose files the directory also holds, left out
    unreadable: tuple[str, ...]  #: files that could not be read, with why

    @property
    def mode(self) -> str:
        modes = dict.fromkeys(_row_mode(p, row) for p in self.processes for row in p.rows)
        return ", ".join(modes or dict.fromkeys(p.mode for p in self.processes)) or "none"

    def totals(self) -> dict[str, dict[str, Any]]:
        """The counts summed over every process and call site, per mode."""
        out: dict[str, dict[str, Any]] = {}
        for process in self.processes:
            for row in process.rows:
                total = out.setdefault(_row_mode(process, row), {})
                for field in SUMMED:
                    if isinstance(row.get(field), (int, float)):
                        total[field] = total.get(field, 0) + row[field]
        for total in out.values():
            sent = total.get("bytes_sent", 0)
            total["saved"] = total.get("bytes_repeated", 0) / sent if sent else 0.0
        return out

    def to_dict(self) -> dict[str, Any]:
        """The numbers: each process with its rows, and the totals."""
        return {
            "directory": self.directory,
            "job": self.job,
            "mode": self.mode,
            "processes": [p._asdict() for p in self.processes],
            "totals": self.totals(),
            "other_jobs": list(self.other_jobs),
            "unreadable": list(self.unreadable),
        }

    def __str__(self) -> str:
        if not any(p.rows for p in self.processes):
            return "\n".join(
                ["refshare: no process of the job shared, audited or verified anything"]
                + [f"unreadable: {what}" for what in self.unreadable]
            )
        hosts = {p.host for p in self.processes}
        where = f" ({next(iter(hosts))})" if len(hosts) == 1 else ""
        lines = [
            f"refshare job report ({self.mode}): {_some(len(self.processes), 'process')} on "
            f"{_some(len(hosts), 'host')}{where}"
        ]
        entries = sorted(
            ((row, p) for p in self.processes for row in p.rows),
            key=lambda e: (str(e[0].get("site")), e[1].role, e[1].host, e[1].pid),
        )
        lines.append(_table(entries, self.totals(), len(hosts) == 1))
        for row, process in entries:
            for field, value in row.items():
                if field == "reasons" or field.endswith("_reasons"):
                    what = "by value" if field == "reasons" else field[: -len("_reasons")]
                    for reason, count in value or ():
                        lines.append(
                            f"  {row.get('site')} ({process.label(len(hosts) == 1)}): "
                            f"{count} {what.replace('_', ' ')}: {reason}"
                        )
        if any(row.get("audit") for row, _ in entries):
            lines.append("(audit: what sharing would save; nothing was changed)")
        if self.other_jobs:
            lines.append(
                f"left out: the files of {len(self.other_jobs)} other job(s) in "
                f"{self.directory} (refshare report {self.directory} --job ID)"
            )
        lines.extend(f"unreadable: {what}" for what in self.unreadable)
        return "\n".join(lines)


def _row_mode(process: Process, row: dict[str, Any]) -> str:
    return "audit" if row.get("audit") else ("sharing" if process.audit else process.mode)


def _some(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}{'es' if noun[-1] == 's' else 's'}"


def _mib(nbytes: Any) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


def _count(value: Any) -> str:
    return "-" if value is None else str(value)


def _time(row: dict[str, Any]) -> str:
    would, sending = row.get(TIME_FIELD), row.get(SENDING_FIELD)
    if would is None:
        return "-"
    share = f" ({would / sending:.0%})" if sending else ""
    return f"~{would:.0f} ms{share}"


def _table(
    entries: list[tuple[dict[str, Any], Process]],
    totals: dict[str, dict[str, Any]],
    one_host: bool,
) -> str:
    rows = [row for row, _ in entries]
    verified = any(
        "verified" in row or "unverified" in row or row.get("mismatches") for row in rows
    ) or any(p.verify for _, p in entries)
    verify = list(VERIFY_FIELDS) if verified else []
    timed = any(row.get(TIME_FIELD) is not None for row in rows)
    head = ["call site", "process", "mode", "calls", "sent", "repeated", "saved", "distinct",
            "by value", "evicted", *verify, *(["would save"] if timed else [])]  # fmt: skip

    def cells(row: dict[str, Any], site: str, process: str, mode: str) -> list[str]:
        return [site, process, mode, _count(row.get("calls")), _mib(row.get("bytes_sent", 0)),
                _mib(row.get("bytes_repeated", 0)), f"{row.get('saved', 0.0):.0%}",
                _mib(row.get("bytes_distinct", 0)), _count(row.get("by_value")),
                _count(row.get("evictions")), *(_count(row.get(f)) for f in verify),
                *([_time(row)] if timed else [])]  # fmt: skip

    body = [cells(row, str(row.get("site")), p.label(one_host), _row_mode(p, row))
            for row, p in entries]  # fmt: skip
    count = len({(p.host, p.pid) for _, p in entries})
    foot = [cells(total, "total", _some(count, "process"), mode) for mode, total in totals.items()]
    return format_table(head, body, foot, left=3)


def _process(data: dict[str, Any]) -> Process:
    return Process(
        str(data.get("host", "?")), int(data.get("pid", 0)), str(data.get("role", "?")),
        str(data.get("job", "")), bool(data.get("audit")), str(data.get("verify", "")),
        float(data.get("written", 0.0)), tuple(dict(r) for r in data.get("rows", ())),
    )  # fmt: skip


def read_job(directory: str, job: str | None = None) -> JobReport:
    """The report of ``job`` (by default the one written to last) from the files in
    ``directory``; files of other jobs are counted in ``other_jobs``. Raises ``OSError``
    when the directory cannot be listed."""
    found: dict[str, list[Process]] = {}
    unreadable = []
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(directory, name), encoding="utf-8") as file:
                data = json.load(file)
            if not isinstance(data, dict) or data.get(FORMAT) is None:
                continue  # not one of refshare's
            process = _process(data)
        except (OSError, ValueError, TypeError) as error:
            unreadable.append(f"{name} ({type(error).__name__}: {error})")
            continue
        found.setdefault(process.job, []).append(process)
    if job is None:
        job = max(found, key=lambda j: max(p.written for p in found[j]), default="")
    processes = tuple(sorted(found.get(job, ()), key=lambda p: (p.host, p.pid)))
    others = tuple(j for j in found if j != job)
    return JobReport(directory, job, processes, others, tuple(unreadable))
