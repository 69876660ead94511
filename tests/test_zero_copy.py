"""Ray's zero-copy tensor serializer (``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1``, which
OpenRLHF's launcher turns on) hands each task a writable view of its own object. refshare
shares one object between tasks, so it stores tensors as their bytes: a worker writing to
what it received changes nothing another worker receives, as by value; and what it receives
is what by value gives it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("ray._private.tensor_serialization_utils")  # Ray without it: nothing to do
pytestmark = pytest.mark.slow


def test_a_write_by_one_worker_reaches_no_other() -> None:
    script = Path(__file__).with_name("zero_copy_probe.py")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    zero_copy, by_value, within_one_call, across_calls, driver, differences = json.loads(
        done.stdout.strip().splitlines()[-1]
    )
    n = float(1 << 18)
    assert zero_copy  # the serializer was on in the driver
    assert by_value == [2 * n, n]  # each task had its own copy
    assert within_one_call == by_value
    assert across_calls == by_value
    assert driver == n  # and the driver's tensor is untouched
    # Each tensor arrives as that serializer's deserializer makes it by value (contiguous,
    # without requires_grad, on numpy's memory, version 0), on memory of its own.
    assert len(differences) == 7
    assert {name: d for name, d in differences.items() if d is not None} == {}
