"""What the tests send to workers, and workers that report what they received."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import ray
from differential_kit import describe_fully as describe

#: The repository's root: the examples and benchmarks run from there.
ROOT = Path(__file__).resolve().parent.parent


def run_python(
    *command: str, timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python COMMAND...`` from the repository's root, its output captured."""
    return subprocess.run(
        [sys.executable, *command],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def run_own_ray(*command: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """:func:`run_python` on a new local Ray of its own (``RAY_ADDRESS=local``: even where
    one from ``ray start`` runs nearby)."""
    env = {**os.environ, "RAY_ADDRESS": "local", "RAY_USAGE_STATS_ENABLED": "0"}
    return run_python(*command, timeout=timeout, env=env)


T = TypeVar("T")

#: How many scripts the ``scripts`` tests run at once: most of a script's time is its own Ray
#: starting and stopping, and waiting on it (``pytest -m scripts`` took 343 s so, where it
#: took 460 s running each module's scripts in turn, on 2 cores).
SCRIPTS_AT_ONCE = 2
_scripts = ThreadPoolExecutor(SCRIPTS_AT_ONCE, thread_name_prefix="script")
_started: dict[str, Future[Any]] = {}
_scripts_lock = threading.Lock()
_outputs: list[Path] = []  # made on first use: Ray's workers import this module too


def in_background(key: str, run: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
    """``run(*args, **kwargs)``, a script's run, started in the background once per ``key``;
    a test waits for it when it checks it. A module of such tests starts its runs as the
    session starts (its ``start_scripts``, see ``conftest``), so that the runs of one module
    go on while the tests of the one before check theirs."""
    with _scripts_lock:
        found = _started.get(key)
        if found is None:
            found = _started[key] = _scripts.submit(run, *args, **kwargs)
        return found


def params(item: Any) -> dict[str, Any]:
    """The parameters of a collected test (none where it is not parametrized)."""
    callspec = getattr(item, "callspec", None)
    return dict(callspec.params) if callspec is not None else {}


def output_dir(key: str) -> Path:
    """A new directory for what the script run ``key`` writes, removed at the session's end."""
    with _scripts_lock:
        if not _outputs:
            _outputs.append(Path(tempfile.mkdtemp(prefix="refshare-scripts-")))
    found = _outputs[0] / key.replace(" ", "_").replace("/", "_")
    found.mkdir()
    return found


def stop_scripts() -> None:
    """The session ends: drop the runs no test waited for, wait for those under way."""
    _scripts.shutdown(wait=True, cancel_futures=True)
    for made in _outputs:
        shutil.rmtree(made, ignore_errors=True)


class Payload:
    """A large value whose serializations by Ray's driver are counted (refshare's own
    fingerprint pass pickles it too, but through plain pickle, which is not counted)."""

    serialized = 0
    _lock = threading.Lock()

    def __init__(self, data: np.ndarray) -> None:
        self.data = data

    @classmethod
    def filled(cls, fill: int, nbytes: int = 1 << 20) -> Payload:
        return cls(np.full(nbytes, fill, dtype=np.uint8))


def _serialize(payload: Payload) -> np.ndarray:
    with Payload._lock:
        Payload.serialized += 1
    return payload.data


def _deserialize(data: np.ndarray) -> Payload:
    return Payload(data)


def count_payload_serializations() -> None:
    """Route Ray's serialization of Payload through a counter (in this process only)."""
    ray.util.register_serializer(Payload, serializer=_serialize, deserializer=_deserialize)


@ray.remote(num_cpus=0.1)
class Worker:
    """Reports what it was constructed with and what each call received."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.init = describe((args, kwargs))

    def received_at_init(self) -> Any:
        return self.init

    def receive(self, *args: Any, **kwargs: Any) -> Any:
        return describe((args, kwargs))


@ray.remote(num_cpus=0.1)
def receive(*args: Any, **kwargs: Any) -> Any:
    return describe((args, kwargs))


@ray.remote(num_cpus=0.1)
class Controller:
    """A worker group driven from inside an actor, as RL trainers often are."""

    def broadcast(self, group: list[Any], batch: Any) -> Any:
        import refshare

        with refshare.sharing():  # a decorator on this method would not survive shipping
            received = ray.get([w.receive.remote(batch) for w in group])
        return received, tuple(refshare.stats())


class SelfPickling(dict):  # type: ignore[type-arg]
    """A batch whose pickling runs code of its own, as verl's DataProto and SkyRL's
    TensorBatch do: ``__reduce__`` saves its arrays into one bytes blob. Counts the calls
    in this process, so a test sees how often the driver serialized it."""

    reduced = 0
    _lock = threading.Lock()

    def __reduce__(self) -> tuple[Any, ...]:
        import io

        with SelfPickling._lock:
            SelfPickling.reduced += 1
        blob = io.BytesIO()
        np.savez(blob, **self)
        return (_load_self_pickling, (blob.getvalue(),))


def _load_self_pickling(blob: bytes) -> SelfPickling:
    import io

    with np.load(io.BytesIO(blob)) as arrays:
        return SelfPickling({key: arrays[key] for key in arrays.files})


@ray.remote(num_cpus=0.1)
class WithoutRefshare:
    """A worker process where refshare cannot be imported, as on a cluster whose workers'
    environment lacks it."""

    def __init__(self) -> None:
        import sys

        for name in [m for m in sys.modules if m == "refshare" or m.startswith("refshare.")]:
            sys.modules[name] = None  # type: ignore[assignment]
        sys.modules["refshare"] = None  # type: ignore[assignment]

    def receive(self, *args: Any, **kwargs: Any) -> Any:
        return describe((args, kwargs))


class Restamped:
    """A value whose pickling gives a new payload each time: the number of the pickle, as
    a value stamped with the time of sending would. By value, every task gets its own."""

    count = 0
    _lock = threading.Lock()

    def __init__(self, data: np.ndarray) -> None:
        self.data = data

    def __reduce__(self) -> tuple[Any, ...]:
        with Restamped._lock:
            Restamped.count += 1
            stamp = Restamped.count
        return (_load_restamped, (stamp, self.data.tobytes()))


def _load_restamped(stamp: int, data: bytes) -> tuple[int, int]:
    return stamp, len(data)
