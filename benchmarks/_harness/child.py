"""A part of a benchmark run in a child process, connected to the parent's Ray, with some
modules made unimportable (``import grpc`` failing, as on a plain ``pip install ray``).

The parent calls :func:`run_child`; the child is this file run as a script, which installs a
``sys.meta_path`` blocker for the modules named before anything else is imported, then runs
the benchmark's script with the arguments given. The child can stop at checkpoints, where
the parent does what it must (read how much Ray spilled) before it goes on
(:func:`checkpoint`), and prints its results as JSON, as the last line of its standard output
(:func:`answer`).
"""

from __future__ import annotations

import importlib.abc
import json
import os
import runpy
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


class Blocker(importlib.abc.MetaPathFinder):
    """Makes ``import name`` (and its submodules) fail, as if it were not installed."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if any(name == n or name.startswith(f"{n}.") for n in self.names):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None


#: How a child's line on standard output names a checkpoint (see :func:`checkpoint`).
CHECKPOINT = "CHECKPOINT "


def run_child(
    script: Path,
    args: Sequence[str],
    without: Sequence[str] = (),
    at: Callable[[str], None] = lambda name: None,
    timeout: float = 600,
) -> dict[str, Any]:
    """Run ``script args`` in a child process with ``without`` unimportable, calling
    ``at(name)`` at each of its checkpoints (the child waits meanwhile); return the JSON it
    answered. Raises ``RuntimeError`` with its output if it failed."""
    command = [sys.executable, __file__, ",".join(without), str(script), *args]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    lines = []
    with (
        tempfile.TemporaryFile("w+") as errors,
        subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            env=env,
        ) as process,
    ):
        assert process.stdin is not None and process.stdout is not None
        for line in process.stdout:
            if line.startswith(CHECKPOINT):
                at(line[len(CHECKPOINT) :].strip())
                process.stdin.write("go\n")
                process.stdin.flush()
            else:
                lines.append(line.rstrip("\n"))
        code = process.wait(timeout)
        errors.seek(0)
        if code != 0 or not lines:
            raise RuntimeError(f"{script.name} {' '.join(args)} failed ({code}):\n"
                               f"{lines[-20:]}\n{errors.read()[-4000:]}")  # fmt: skip
    found: dict[str, Any] = json.loads(lines[-1])
    return found


def checkpoint(name: str) -> None:
    """In the child: tell the parent it reached ``name``, and wait until it has seen to it."""
    print(f"{CHECKPOINT}{name}", flush=True)
    sys.stdin.readline()


def answer(results: dict[str, Any]) -> None:
    """The child's results, to its parent: one line of JSON, last on standard output."""
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    blocked, script, *rest = sys.argv[1:]
    if blocked:
        sys.meta_path.insert(0, Blocker(blocked.split(",")))
    sys.argv = [script, *rest]
    sys.path[0] = str(Path(script).resolve().parent)
    runpy.run_path(script, run_name="__main__")
