"""The wheel a fresh clone builds: its license, its project URLs, the command, and a
description that reads on the package index (no link into a folder it does not have)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


#: What a clone does not have: what builds, tests and checkers leave behind.
LEFT_BEHIND = shutil.ignore_patterns(
    ".git", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".venv*"
)


def test_the_wheel_carries_its_license_urls_command_and_absolute_links(tmp_path: Path) -> None:
    clone = tmp_path / "clone"  # setuptools builds in the tree: not in this one
    shutil.copytree(ROOT, clone, ignore=LEFT_BEHIND)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(tmp_path), str(clone)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = tmp_path.glob("refshare-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = next(n for n in names if n.endswith(".dist-info/METADATA")).rsplit("/", 1)[0]
        metadata = archive.read(f"{info}/METADATA").decode()
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
        license_text = archive.read(f"{info}/licenses/LICENSE").decode()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "License-File: LICENSE" in metadata
    assert {"Homepage", "Source", "Documentation"} <= set(
        re.findall(r"^Project-URL: (\w+), https://", metadata, re.MULTILINE)
    )
    assert "refshare = refshare._cli:main" in entry_points
    assert "refshare/_sitecustomize/sitecustomize.py" in names
    description = metadata.split("\n\n", 1)[1]
    targets = re.findall(r"\]\(([^)\s]+)\)", description)
    assert targets and all(t.startswith(("https://", "http://", "#")) for t in targets), targets
