"""The ``refshare`` command: run a program with refshare on, and read a job's report.

``refshare run [--audit | --verify[=worker]] [--frameworks ...] [--methods ...] [--report
DIR] -- python train.py ARGS`` starts the program with the environment that turns refshare
on in it and in its Ray workers (``_sitecustomize`` on ``PYTHONPATH``, ``REFSHARE_*``
variables: see ``_boot``), waits for it, prints the job's report to standard error and exits
with the program's exit code. The program's standard streams are its own. ``refshare report
DIR [--json]`` prints the report a job left in ``DIR``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Sequence

from . import __version__, _env
from ._boot import Method
from ._integrations import FRAMEWORKS
from ._job_report import read_job

logger = logging.getLogger("refshare")

PACKAGE = os.path.dirname(os.path.abspath(__file__))
#: The directory ``refshare run`` puts first on the program's ``PYTHONPATH``.
SITECUSTOMIZE = os.path.join(PACKAGE, "_sitecustomize")
#: Signals passed on to the program (SIGINT reaches it from the terminal by itself).
FORWARDED = ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")


def _warn(message: str) -> None:
    sys.stderr.write(f"refshare run: {message}\n")


def _installed(name: str) -> bool:
    tops = {t.module.partition(".")[0] for layout in FRAMEWORKS[name].layouts for t in layout}
    return any(importlib.util.find_spec(top) is not None for top in tops)


def _frameworks(given: str | None) -> list[str]:
    """The frameworks to watch for: those named (unknown names left out, with a warning;
    those not installed here named in a warning), or all refshare knows."""
    if given is None:
        return list(FRAMEWORKS)
    names = [n.strip() for n in given.split(",") if n.strip()]
    for name in names:
        if name not in FRAMEWORKS:
            _warn(f"--frameworks: unknown framework {name!r}, left out "
                  f"(refshare knows {', '.join(FRAMEWORKS)})")  # fmt: skip
        elif not _installed(name):
            _warn(f"--frameworks: {name!r} is not installed here: nothing of it to enable")
    return [n for n in names if n in FRAMEWORKS]


def _methods(given: Sequence[str]) -> list[str]:
    found = []
    for text in (part for value in given for part in value.split(",") if part.strip()):
        try:
            found.append(str(Method.parse(text)))
        except ValueError as error:
            _warn(f"--methods: {error}; left out")
    return found


def environment(args: argparse.Namespace, report_dir: str | None, job: str) -> dict[str, str]:
    """The program's environment: this one, and what turns refshare on in the job."""
    env = dict(os.environ)
    env[_env.RUN] = "1"
    env[_env.RUN_FRAMEWORKS] = ",".join(_frameworks(args.frameworks))
    env[_env.RUN_METHODS] = ",".join(_methods(args.methods))
    env[_env.RUN_ROOT] = os.path.dirname(PACKAGE)
    env[_env.JOB] = job
    if os.path.isfile(os.path.join(SITECUSTOMIZE, "sitecustomize.py")):
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (SITECUSTOMIZE, env.get("PYTHONPATH", "")) if p
        )
    else:
        _warn(f"{SITECUSTOMIZE} is missing: refshare is not turned on in the program")
    if args.audit:
        env[_env.AUDIT] = "1"
    if args.verify is not None:
        env[_env.VERIFY] = args.verify
    if report_dir is not None:
        env[_env.REPORT] = report_dir
    return env


def _report_dir(given: str | None) -> tuple[str | None, bool]:
    """Where the job's processes write (``given``, or a new temporary directory), and
    whether it is temporary; ``None`` when it cannot be made."""
    try:
        if given is None:
            return tempfile.mkdtemp(prefix="refshare-report-"), True
        os.makedirs(given, exist_ok=True)
        return os.path.abspath(given), False
    except OSError as error:
        _warn(f"--report {given!r}: {error}; the job's report is not kept")
        return None, False


def _spawn(command: list[str], env: dict[str, str]) -> int:
    """Run ``command`` to its end, passing signals on; its exit code (``-N``: signal N)."""
    try:
        child = subprocess.Popen(command, env=env)
    except FileNotFoundError:
        sys.stderr.write(f"refshare run: {command[0]}: command not found\n")
        return 127
    except PermissionError as error:
        sys.stderr.write(f"refshare run: {command[0]}: {error.strerror}\n")
        return 126
    for name in FORWARDED:
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), lambda signum, _frame: child.send_signal(signum))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal sends it to the program
    return child.wait()


def _exit_as(code: int) -> int:
    """Exit as the program did: by the same signal if a signal ended it."""
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code
    return code


def run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        sys.stderr.write("refshare run: name the program to run, e.g. refshare run -- "
                         "python train.py\n")  # fmt: skip
        return 2
    job = uuid.uuid4().hex[:12]
    report_dir, temporary = _report_dir(args.report)
    try:
        env = environment(args, report_dir, job)
    except Exception as error:  # never keep the program from running
        _warn(f"cannot set refshare up ({type(error).__name__}: {error}); running without it")
        env, report_dir = dict(os.environ), None
    code = _spawn(command, env)
    if report_dir is not None:
        try:
            sys.stderr.write(f"{read_job(report_dir, job)}\n")
            if not temporary:
                sys.stderr.write(f"(each process's file: {report_dir})\n")
        except Exception as error:
            _warn(f"cannot read the job's report in {report_dir!r}: {error}")
        if temporary:
            shutil.rmtree(report_dir, ignore_errors=True)
    sys.stderr.flush()
    return _exit_as(code)


def report(args: argparse.Namespace) -> int:
    try:
        found = read_job(args.directory, args.job)
    except OSError as error:
        sys.stderr.write(f"refshare report: cannot read {args.directory!r}: {error}\n")
        return 1
    if args.json:
        print(json.dumps(found.to_dict(), indent=1))
    else:
        print(found)
    return 0 if found.processes else 1


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="refshare", description="Share large, repeated Ray task arguments by reference."
    )
    top.add_argument("--version", action="version", version=f"refshare {__version__}")
    commands = top.add_subparsers(dest="action", required=True)
    run_ = commands.add_parser(
        "run",
        help="run a program with refshare on, in its driver and its Ray workers",
        description="Run a program with refshare on for the frameworks it uses, in the "
        "driver and in every Ray worker of the job, without changing a line of it; print "
        "the job's report to standard error at its exit; exit with its exit code.",
    )
    modes = run_.add_mutually_exclusive_group()
    modes.add_argument(
        "--audit",
        action="store_true",
        help="change nothing Ray sends; report what sharing would save",
    )
    modes.add_argument(
        "--verify",
        nargs="?",
        const="1",
        choices=("1", "worker"),
        help="check each argument sent by ref against by value (--verify=worker: on the workers)",
    )
    run_.add_argument(
        "--frameworks",
        metavar="NAMES",
        help=f"comma-separated, of {', '.join(FRAMEWORKS)} (default: every one "
        "the program imports)",
    )
    run_.add_argument(
        "--methods",
        metavar="module:Class.method",
        action="append",
        default=[],
        help="also wrap these worker-group methods (comma-separated or repeated)",
    )
    run_.add_argument(
        "--report",
        metavar="DIR",
        help="keep each process's report in DIR (default: a temporary directory)",
    )
    run_.add_argument("command", nargs=argparse.REMAINDER, help="-- the program and its arguments")
    run_.set_defaults(func=run)
    report_ = commands.add_parser("report", help="print the report of a job run with --report")
    report_.add_argument("directory", metavar="DIR")
    report_.add_argument("--json", action="store_true", help="the numbers, as JSON")
    report_.add_argument("--job", help="the job whose files to read (default: the latest)")
    report_.set_defaults(func=report)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    code: int = args.func(args)
    return code
