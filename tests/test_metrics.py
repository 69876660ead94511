"""Ray metrics, when asked for: refshare's counters on the node's Prometheus endpoint.

Needs Ray's metrics agent, which comes with ``ray[default]``; CI installs it for this file.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

#: A Ray of its own in a subprocess: left to `pytest -m slow` (.ci/run runs it).
pytestmark = pytest.mark.slow

pytest.importorskip("prometheus_client", reason="Ray's metrics agent needs ray[default]")

SCRIPT = textwrap.dedent(
    """
    import os, socket, time, urllib.request
    os.environ["RAY_metrics_report_interval_ms"] = "300"
    import numpy as np, ray, refshare

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
             _metrics_export_port=port)
    refshare.enable_metrics()

    @ray.remote(num_cpus=0.1)
    def f(x):
        return x.shape

    with refshare.sharing():
        ray.get([f.remote(np.ones(100_000)) for _ in range(3)])

    wanted = {"ray_refshare_puts_total": 1.0, "ray_refshare_hits_total": 2.0,
              "ray_refshare_bytes_saved_total": 1.6e6}
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
            body = page.read().decode()
        except OSError:
            body = ""
        seen = {line.split("{")[0]: float(line.rsplit(" ", 1)[1])
                for line in body.splitlines() if line.startswith("ray_refshare_")}
        if all(seen.get(name) == value for name, value in wanted.items()):
            print("METRICS OK", seen)
            break
        time.sleep(0.5)
    else:
        raise SystemExit(f"metrics not exported: {seen}")
    ray.shutdown()
    """
)


def test_counters_reach_rays_metrics_endpoint() -> None:
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=180
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "METRICS OK" in run.stdout
