"""The command line every benchmark shares: one mode at most, ``--out``, and for the step
replays ``--steps``."""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from _harness.report import RESULTS

T = TypeVar("T")

#: Where a quick or smoke run's results go unless ``--out`` says: not among the full runs'
#: committed results, which a shorter run would otherwise overwrite.
SCRATCH = Path(tempfile.gettempdir()) / "refshare-benchmarks"


class _Parser(argparse.ArgumentParser):
    """Options whose ``--out`` defaults by mode: a full run's to ``benchmarks/results``, a
    shorter run's to :data:`SCRATCH`."""

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        found = super().parse_args(args, namespace)
        if found.out is None:
            found.out = RESULTS if mode(found) == "full" else SCRATCH
        return found


def parser(doc: str, modes: dict[str, str]) -> argparse.ArgumentParser:
    """A benchmark's options: one of its ``modes`` (``--quick``, ``--smoke``, ...: flag name
    to help) at most, and ``--out``."""
    found = _Parser(description=doc.split("\n\n")[0])
    group = found.add_mutually_exclusive_group()
    for name, help_text in modes.items():
        group.add_argument(f"--{name}", action="store_true", help=help_text)
    found.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"where the results go (a full run: benchmarks/results; else {SCRATCH})",
    )
    return found


def mode(args: argparse.Namespace) -> str:
    """The mode the options chose: ``smoke``, ``quick`` or ``full``."""
    if getattr(args, "smoke", False):
        return "smoke"
    return "quick" if getattr(args, "quick", False) else "full"


def step_parser(doc: str) -> argparse.ArgumentParser:
    """The options every step replay takes: its mode, how many steps, where to write."""
    found = parser(doc, {"quick": "9 timed steps", "smoke": "tiny batch, 2 timed steps"})
    found.add_argument("--steps", type=int, help="timed steps (default: by mode)")
    found.add_argument(
        "--budget", choices=BUDGETS, default="default",
        help="each strategy's cache: a share of the default budget, or a quarter of the bytes "
        "a step sends (its distinct bytes), which makes the caches evict within a step",
    )  # fmt: skip
    return found


#: The cache budgets of a step replay (see :func:`step_parser`).
BUDGETS = ("default", "quarter")


def step_config(args: argparse.Namespace, modes: dict[str, T]) -> T:
    """A step replay's configuration: its mode's, with ``--steps`` and ``--budget`` if given."""
    config = modes[mode(args)]
    if args.steps:
        config = dataclasses.replace(config, steps=args.steps)  # type: ignore[type-var]
    if getattr(args, "budget", "default") != "default":
        config = dataclasses.replace(config, budget=args.budget)  # type: ignore[type-var]
    return config
