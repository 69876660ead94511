"""The command line every benchmark shares: one mode at most, ``--out``, and for the step
replays ``--steps``."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import TypeVar

from _harness.report import RESULTS

T = TypeVar("T")


def parser(doc: str, modes: dict[str, str]) -> argparse.ArgumentParser:
    """A benchmark's options: one of its ``modes`` (``--quick``, ``--smoke``, ...: flag name
    to help) at most, and ``--out``."""
    found = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    group = found.add_mutually_exclusive_group()
    for name, help_text in modes.items():
        group.add_argument(f"--{name}", action="store_true", help=help_text)
    found.add_argument(
        "--out", type=Path, default=RESULTS, help="where the results go (benchmarks/results)"
    )
    return found


def mode(args: argparse.Namespace) -> str:
    """The mode the options chose: ``smoke``, ``quick`` or ``full``."""
    return "smoke" if args.smoke else "quick" if args.quick else "full"


def step_parser(doc: str) -> argparse.ArgumentParser:
    """The options every step replay takes: its mode, how many steps, where to write."""
    found = parser(doc, {"quick": "9 timed steps", "smoke": "tiny batch, 2 timed steps"})
    found.add_argument("--steps", type=int, help="timed steps (default: by mode)")
    return found


def step_config(args: argparse.Namespace, modes: dict[str, T]) -> T:
    """A step replay's configuration: its mode's, with ``--steps`` if given."""
    config = modes[mode(args)]
    return dataclasses.replace(config, steps=args.steps) if args.steps else config  # type: ignore[type-var]
