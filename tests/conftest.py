"""Shared fixtures: one local Ray for the whole session, restarted by tests that stop it."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import helpers
import pytest
import ray
import skyrl_wheel
from ray.cluster_utils import Cluster

import refshare
from refshare._verify import verify_by_env

T = TypeVar("T")

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Workers start from the raylet's environment: let them import the test modules whose
# classes and functions the tests send them, and the mirrors of framework code (mirrors/,
# imported here and there by module name, as the frameworks' own packages are).
_TESTS = os.path.dirname(os.path.abspath(__file__))
_MIRRORS = os.path.join(_TESTS, "mirrors")
sys.path.insert(0, _MIRRORS)
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (_TESTS, _MIRRORS, os.environ.get("PYTHONPATH", "")) if p
)

skyrl_wheel.stand_in()
#: Where SkyRL is installed, its workers import its batch module as the tests do.
_RUNTIME_ENV = (
    {"worker_process_setup_hook": "skyrl_wheel.stand_in"} if skyrl_wheel.installed() else None
)

#: Small enough for 2 cores; actors take fractions of a CPU.
NUM_CPUS = 2
OBJECT_STORE_BYTES = 1 << 30


#: Tries at starting a local Ray: on 2 cores, after many restarts in one process, its GCS
#: now and then fails to come up in time ("timed out during startup", "Timed out waiting
#: for file ...gcs_server_port"), leaving no log; a second start succeeds.
STARTS = 3


def _started(start: Callable[[], T], undo: Callable[[], object]) -> T:
    """``start()``, tried again (after ``undo()``) when Ray does not come up in time (see
    :data:`STARTS`)."""
    for _ in range(STARTS - 1):
        try:
            return start()
        except Exception as error:
            if "timed out" not in str(error).lower():
                raise
            logging.getLogger(__name__).warning("Ray did not start (%s); again", error)
            undo()
            time.sleep(2)
    return start()


def init_local_ray(**options: Any) -> None:
    """``ray.init`` of a new local cluster with the suite's settings and ``options`` over
    them, tried again when its GCS does not come up in time (see :data:`STARTS`)."""
    settings: dict[str, Any] = {
        "address": "local",  # a new local cluster, never one found on the machine
        "num_cpus": NUM_CPUS,
        "object_store_memory": OBJECT_STORE_BYTES,
        "include_dashboard": False,
        "log_to_driver": False,
        "configure_logging": False,
        "runtime_env": _RUNTIME_ENV,
    }
    settings.update(options)
    _started(lambda: ray.init(**settings), ray.shutdown)


def start_cluster(head: dict[str, Any], *nodes: dict[str, Any]) -> Cluster:
    """A several-node cluster on this machine (head first, driver not attached), each node
    tried again when it does not register in time, as :func:`init_local_ray` does (a node that
    failed is not the cluster's: its processes stay until this process exits)."""
    cluster = _started(lambda: Cluster(initialize_head=True, head_node_args=head), lambda: None)
    try:
        for args in nodes:
            _started(lambda args=args: cluster.add_node(**args), lambda: None)
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


def start_local_ray(object_store_bytes: int = OBJECT_STORE_BYTES) -> None:
    """Start the suite's local Ray unless one is already running."""
    if not ray.is_initialized():
        init_local_ray(object_store_memory=object_store_bytes)


def restart_local_ray(object_store_bytes: int = OBJECT_STORE_BYTES) -> None:
    """Stop the Ray this process runs and start a new local one, with that object store."""
    ray.shutdown()
    start_local_ray(object_store_bytes)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the script runs that the selected ``scripts`` tests check, in the order the
    tests come (each module's ``start_scripts(items)``, with its tests not skipped): they run
    a few at a time in the background (see ``helpers.in_background``)."""
    if session.config.option.collectonly:
        return
    modules: dict[Any, list[pytest.Item]] = {}
    for item in session.items:
        if item.get_closest_marker("scripts") and not item.get_closest_marker("skip"):
            modules.setdefault(getattr(item, "module", None), []).append(item)
    for module, items in modules.items():
        start = getattr(module, "start_scripts", None)
        if start is not None:
            start(items)


def pytest_sessionfinish(session: pytest.Session) -> None:
    helpers.stop_scripts()


@pytest.fixture(scope="session", autouse=True)
def _shutdown_at_end() -> Iterator[None]:
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """A running local Ray: started once, and again for any module after one that stopped it.

    A test that stops Ray or starts another cluster must call ``start_local_ray()`` when done.
    """
    start_local_ray()
    yield


@pytest.fixture
def fresh() -> Iterator[None]:
    """Empty process-wide cache and zeroed stats, so counts are this test's own."""
    refshare.clear()
    refshare.reset_stats()
    yield
    refshare.clear()


class _Verdicts(logging.Handler):
    """Collects what verify mode logs, whatever a test does to the stats: its mismatches
    (errors) and its unverified sends (warnings)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.mismatches: list[str] = []
        self.unverified: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("refshare verify:"):
            found = self.mismatches if record.levelno >= logging.ERROR else self.unverified
            found.append(message)


_verdicts = _Verdicts()
logging.getLogger("refshare").addHandler(_verdicts)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``REFSHARE_VERIFY=1`` (CI runs the suite so once), a test marked ``verify_off``
    is skipped, saying so: it measures refshare's own cost (serializations counted, bytes in
    the store), which verify's by-value serializations and fetches add to, or what refshare
    does without verify."""
    if not verify_by_env():
        return
    skip = pytest.mark.skip(reason="REFSHARE_VERIFY=1: measures what verify mode adds to")
    for item in items:
        if item.get_closest_marker("verify_off"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_verify_mismatch(request: pytest.FixtureRequest) -> Iterator[None]:
    """Under ``REFSHARE_VERIFY=1``, no test may make verify find a mismatch, nor leave a
    send unverified, but those that do so on purpose (``mismatches_expected``,
    ``unverified_expected``). (What the workers found under ``verify="worker"`` is counted
    when the stats are read: read here.)"""
    before = len(_verdicts.mismatches), len(_verdicts.unverified)
    yield
    if ray.is_initialized():
        refshare.stats()
    found = _verdicts.mismatches[before[0] :]
    if found and not request.node.get_closest_marker("mismatches_expected"):
        pytest.fail(f"verify found {len(found)} mismatches, the first: {found[0]}")
    found = _verdicts.unverified[before[1] :]
    if found and not request.node.get_closest_marker("unverified_expected"):
        pytest.fail(f"verify left {len(found)} sends unverified, the first: {found[0]}")
