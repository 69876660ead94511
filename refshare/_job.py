"""One report per job, the writing side: each process's rows in a file of its own, kept current.

With ``REFSHARE_REPORT`` naming a directory (``refshare run`` sets it), every process that
shares, audits or verifies starts a daemon thread on its first tally that rewrites its file
there, atomically, a moment after its counts change (at most once a second while they keep
changing), and once more at exit. A worker that Ray kills (a task's, an actor still held at
``ray.shutdown()``) runs no exit handler: it loses at most its last second. The file names
the process by host, pid and role: ``driver``, the actor's class, or the task's function.
``_job_report`` reads a directory of them back as one report.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import socket
import threading
import time
from typing import Any

from . import _env, _ledger
from ._report import report

logger = logging.getLogger("refshare")

#: Marks a file as one of these reports (and its layout's version).
FORMAT = "refshare_report"
VERSION = 1
#: How often the writer looks at the counts, and the least time between two writes while
#: they keep changing.
POLL_S = 0.25
MIN_GAP_S = 1.0


def report_directory() -> str | None:
    """The directory ``REFSHARE_REPORT`` names, or ``None`` (unset, off, or ``1``: that
    means "print at exit to standard error")."""
    return _env.directory(_env.REPORT)


def process_role() -> str:
    """``driver``, the actor's class name, the task's name (``task`` on a Ray that cannot
    say it, as 2.40), or ``process`` outside Ray (read on the thread that made the first
    tally, which runs the task)."""
    try:
        import ray

        worker = ray._private.worker.global_worker
        if not ray.is_initialized() or worker.mode == ray.SCRIPT_MODE:
            return "driver"
        context = ray.get_runtime_context()
        if context.get_actor_id():
            descriptor = context.current_actor._ray_actor_creation_function_descriptor
            return str(descriptor.class_name) or "actor"
        task_name = getattr(context, "get_task_name", None)
        return str((task_name and task_name()) or "task")
    except Exception:  # a Ray without these: the file still names host and pid
        return "process"


def row_fields(row: Any) -> dict[str, Any]:
    """A ``Row``'s fields by name, whatever fields it has, with ``saved``."""
    fields = dict(row._asdict()) if hasattr(row, "_asdict") else dict(vars(row))
    fields["saved"] = getattr(row, "saved", 0.0)
    return fields


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]+", "_", text)[:80] or "_"


class Writer:
    """Keeps one process's file in ``directory`` current."""

    def __init__(self, directory: str, role: str) -> None:
        self.host, self.pid, self.role = socket.gethostname(), os.getpid(), role
        self.path = os.path.join(directory, f"{_slug(self.host)}-{self.pid}-{_slug(role)}.json")
        self._lock = threading.Lock()
        self._written: list[dict[str, Any]] | None = None  # the rows last written
        self._seen: list[dict[str, Any]] | None = None  # the rows at the last look
        self._written_at = 0.0
        self._warned = False

    def contents(self, rows: list[dict[str, Any]], final: bool) -> dict[str, Any]:
        return {
            FORMAT: VERSION,
            "job": os.environ.get(_env.JOB, ""),
            "host": self.host,
            "pid": self.pid,
            "role": self.role,
            "audit": _env.on(_env.AUDIT),
            "verify": _env.mode(_env.VERIFY),
            "written": time.time(),
            "final": final,
            "rows": rows,
        }

    def look(self, *, final: bool = False, now: bool = False) -> bool:
        """Write the rows if they changed since the last write and have settled (the same as
        at the last look), or a second has passed, or this is the exit's write (``final``)
        or a call's end (``now``). Returns whether it wrote."""
        if os.getpid() != self.pid:
            return False  # a forked child: the file is its parent's
        with self._lock:
            rows = [row_fields(row) for row in report().rows]
            settled, self._seen = rows == self._seen, rows
            clock = time.monotonic()
            if rows == self._written or not (
                final or now or settled or clock - self._written_at >= MIN_GAP_S
            ):
                return False
            try:
                temporary = f"{self.path}.{self.pid}.tmp"
                with open(temporary, "w", encoding="utf-8") as out:
                    json.dump(self.contents(rows, final), out)
                os.replace(temporary, self.path)  # a reader never sees half a file
            except (OSError, TypeError, ValueError) as error:
                if not self._warned:
                    self._warned = True
                    logger.warning("refshare: cannot write the report %r: %s", self.path, error)
                return False
            self._written, self._written_at = rows, clock
            return True

    def run(self) -> None:
        while True:
            time.sleep(POLL_S)
            try:
                self.look()
            except Exception:  # never let the thread die of one bad look
                logger.debug("refshare: report writer", exc_info=True)

    def final(self) -> None:
        try:
            self.look(final=True)
        except Exception:
            logger.debug("refshare: report writer at exit", exc_info=True)

    def call_ended(self) -> None:
        """A call has ended in this Ray worker: its rows written now. Ray ends a released
        actor's process, or a task's worker at shutdown, without waiting for the writer's
        next look (on 2.40 at once)."""
        try:
            self.look(now=True)
        except Exception:
            logger.debug("refshare: report writer at a call's end", exc_info=True)


_writer: Writer | None = None


def start_writer() -> None:
    """Start this process's writer if ``REFSHARE_REPORT`` names a directory (called on the
    first tally, so ``process_role`` sees the task that made it). Never raises."""
    global _writer
    directory = report_directory()
    if directory is None or _writer is not None:
        return
    try:
        os.makedirs(directory, exist_ok=True)
        _writer = Writer(directory, process_role())
        threading.Thread(target=_writer.run, name="refshare-report", daemon=True).start()
        atexit.register(_writer.final)
        if _writer.role != "driver":
            _ledger.on_call_end.append(_writer.call_ended)
    except Exception as error:
        logger.warning("refshare: %s=%r: no report written: %s", _env.REPORT, directory, error)


_ledger.on_first_tally.append(start_writer)
