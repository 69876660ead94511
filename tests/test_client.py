"""Ray Client (``ray://``): refshare says once that it does not share there, and every call
goes by value, unchanged. Needs gRPC (``grpcio``, in the test extra).

A driver in a subprocess connects with ``ray.init("ray://...")`` to a client server that
this process serves on top of the suite's Ray, as a user's laptop connects to a cluster.
"""

from __future__ import annotations

import inspect
import json
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("grpc")

pytestmark = pytest.mark.usefixtures("local_ray")

DRIVER = textwrap.dedent(
    """
    import json, logging, sys
    import numpy as np
    import ray
    import refshare

    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("refshare").addHandler(handler)
    ray.init(sys.argv[1])

    @ray.remote(num_cpus=0.1)
    def total(x):
        return float(x.sum())

    batch = np.arange(1 << 17, dtype=np.float64)

    @refshare.shared_args
    def fan_out():
        stored = [ray.put(batch), ray.put(batch)]
        return ray.get([total.remote(batch) for _ in range(3)] + stored[:1]), stored

    first, stored = fan_out()
    second, _ = fan_out()
    print(json.dumps({
        "results": [first[:3], second[:3]],
        "stored_equal": bool((first[3] == batch).all()),
        "distinct_puts": stored[0] != stored[1],
        "stats": list(refshare.stats()),
        "warnings": [w for w in warnings if "Ray Client" in w],
    }))
    """
)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def client_address() -> Iterator[str]:
    import ray.util.client.server.server as client_server

    port = _free_port()

    def connect(job_config: Any = None, **kwargs: Any) -> None:
        return None  # the suite's Ray is already connected in this process

    if "port" in inspect.signature(client_server.serve).parameters:
        server = client_server.serve("127.0.0.1", port, ray_connect_handler=connect)
    else:  # Ray before 2.44 takes one "host:port"
        server = client_server.serve(f"127.0.0.1:{port}", ray_connect_handler=connect)
    try:
        yield f"ray://127.0.0.1:{port}"
    finally:
        server.stop(0)


def test_over_ray_client_every_call_goes_by_value(client_address: str) -> None:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, client_address],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    expected = float(sum(range(1 << 17)))
    assert seen["results"] == [[expected] * 3] * 2
    assert seen["stored_equal"] and seen["distinct_puts"]  # Ray's own puts, untouched
    assert seen["stats"] == [0] * len(seen["stats"])
    assert len(seen["warnings"]) == 1
