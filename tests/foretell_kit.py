"""Runs an example with the process-wide cache of another budget, recording what each
``refshare.report()`` it reads says: the bytes an audit would save, and those sharing saved.

    python tests/foretell_kit.py BUDGET_BYTES OUT.json examples/NAME.py

An example checks that the audit foretold what sharing saved right after it reads the
report; the checks that follow it (puts per step, bytes stored) are the default budget's,
which a smaller one changes: an ``AssertionError`` the example raises after that is recorded
in ``OUT.json``, not raised. Anything else the example raises, the kit raises.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback
from typing import Any

import refshare
from refshare import _cache, _report


def main(budget: int, out: str, script: str) -> None:
    _cache._process_cache = refshare.RefCache(max_bytes=budget)
    pairs: list[tuple[int, int, str]] = []
    read = _report.report

    def recording() -> Any:
        found = read()
        if {row.audit for row in found.rows} == {True, False}:
            pairs.append((found.bytes_repeated(audit=True), found.bytes_repeated(), str(found)))
        return found

    refshare.report = _report.report = recording
    # As `python examples/NAME.py` runs it: its directory first on the path, for Ray's
    # workers too (they start from this environment).
    where = os.path.dirname(os.path.abspath(script))
    sys.argv, sys.path[0] = [script], where
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (where, os.environ.get("PYTHONPATH"))))
    failed = None
    try:
        runpy.run_path(script, run_name="__main__")
    except AssertionError as error:
        if not pairs:  # before its first report: the data workers received, say
            raise
        failed = "".join(traceback.format_exception(error))
    with open(out, "w", encoding="utf-8") as file:
        json.dump({"pairs": pairs, "failed_after_report": failed}, file)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
