"""Audit mode and the per-site report: an audit keys as sharing would and changes nothing
Ray sends (counted in Ray's own serializations, and in what each worker received); what it
says would be saved is what sharing then saves; the report names each call site and why a
value went by value; ``REFSHARE_REPORT=1`` writes it when a process exits, an actor's too."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import internals
import numpy as np
import pytest
import ray
from helpers import describe

import refshare

pytestmark = pytest.mark.usefixtures("local_ray", "fresh")

WORKERS = 3


@ray.remote(num_cpus=0.1)
class Reader:
    def read(self, *args: Any, **kwargs: Any) -> Any:
        return describe(list(args)), describe(kwargs)


@pytest.fixture(scope="module")
def readers(local_ray: None) -> list[Any]:
    group = [Reader.remote() for _ in range(WORKERS)]
    ray.get([r.read.remote() for r in group])
    return group


@pytest.fixture(autouse=True)
def _fresh_report() -> None:
    refshare.reset_report()


def step(readers: list[Any], batch: Any, step_no: int) -> list[Any]:
    """One step of a trainer: the batch to every worker, a weights dict that repeats across
    steps, and a per-step array sent to one worker."""
    weights = {"w": np.ones(1 << 16), "b": np.zeros(1 << 15)}
    fresh = np.full(1 << 15, float(step_no))
    calls = [r.read.remote(batch, weights=weights) for r in readers]
    calls.append(readers[0].read.remote(fresh))
    return ray.get(calls)


def run(readers: list[Any], **options: Any) -> list[Any]:
    fan_out = refshare.shared_args(**options)(step)
    batches = [np.full(1 << 17, 1.0), np.full(1 << 17, 1.0), np.full(1 << 17, 2.0)]
    return [fan_out(readers, batch, i) for i, batch in enumerate(batches)]


def test_an_audit_changes_nothing_ray_sends(
    readers: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every value Ray serializes to send, counted where Ray serializes it (its
    serialization context): the same values, as many times, audited as by value."""
    from ray._private.serialization import SerializationContext

    sent: list[str] = []
    original = SerializationContext.serialize

    def counted(self: Any, value: Any) -> Any:
        sent.append(type(value).__qualname__)
        return original(self, value)

    monkeypatch.setattr(SerializationContext, "serialize", counted)
    by_value = run(readers, enabled=False)
    sent_by_value, sent[:] = sorted(sent), []
    audited = run(readers, audit=True, cache=refshare.RefCache())
    assert audited == by_value
    assert sorted(sent) == sent_by_value and sent_by_value.count("ndarray") >= 3 * WORKERS
    assert refshare.stats()[:2] == (0, 0)  # no put, no hit: Ray sent everything itself

    row = refshare.report().rows[0]
    assert row.audit and row.site == "step" and row.calls == 3
    assert row.submissions == 3 * (WORKERS + 1)
    assert row.bytes_repeated > 0 and row.puts > 0  # what sharing would have done


@pytest.mark.verify_off  # verify's own serializations are not sharing's
@pytest.mark.parametrize("deep", [False, None, True])
def test_what_an_audit_would_save_is_what_sharing_saves(readers: list[Any], deep: Any) -> None:
    audited = run(readers, audit=True, deep=deep, cache=refshare.RefCache())
    shared = run(readers, deep=deep, cache=refshare.RefCache())
    assert audited == shared
    audit, sharing = refshare.report().rows
    assert (audit.audit, sharing.audit) == (True, False)
    assert sharing.bytes_repeated == refshare.stats().bytes_saved > 0
    assert abs(audit.bytes_repeated - sharing.bytes_repeated) <= 0.05 * sharing.bytes_repeated
    assert audit.bytes_distinct == sharing.bytes_distinct
    assert sharing.bytes_stored == refshare.stats().bytes_put
    report = refshare.report()  # the sums an example compares, by mode
    assert report.bytes_repeated(audit=True) == audit.bytes_repeated
    assert report.bytes_repeated() == sharing.bytes_repeated


def test_evictions_are_counted_against_the_site_whose_put_made_room(
    readers: list[Any],
) -> None:
    """Two sites on one cache that holds one 1 MiB value: each new value a site puts evicts
    the one before, and the report names the site that put it."""
    cache = refshare.RefCache(max_bytes=(1 << 20) + (1 << 19))

    @refshare.shared_args(cache=cache)
    def first(value: Any) -> Any:
        return ray.get(readers[0].read.remote(value))

    @refshare.shared_args(cache=cache)
    def second(value: Any) -> Any:
        return ray.get(readers[1].read.remote(value))

    first(np.full(1 << 17, 1.0))
    second(np.full(1 << 17, 2.0))  # evicts first's
    second(np.full(1 << 17, 3.0))  # evicts its own
    first(np.full(1 << 17, 4.0))  # evicts second's
    rows = {row.site.rpartition(".")[2]: row for row in refshare.report().rows}
    assert (rows["first"].evictions, rows["second"].evictions) == (1, 2)
    assert refshare.stats().evictions == 3 and len(cache) == 1
    assert "evicted" in str(refshare.report())


def test_the_report_says_why_a_value_went_by_value(readers: list[Any]) -> None:
    held = ray.put(1)
    with_ref = [np.ones(1 << 15), held]  # a ref inside: Ray alone must keep it alive

    @refshare.shared_args(deep=False)
    def send(value: Any) -> Any:
        return ray.get(readers[0].read.remote(value))

    send(with_ref)
    with refshare.sharing():
        ray.get(readers[1].read.remote(np.ones(1 << 15)))
    rows = {row.site: row for row in refshare.report().rows}
    assert set(rows) >= {"test_the_report_says_why_a_value_went_by_value.<locals>.send"}
    sent = rows["test_the_report_says_why_a_value_went_by_value.<locals>.send"]
    assert sent.by_value == 1
    ((reason, count),) = sent.reasons
    assert count == 1 and reason.startswith("list: holds a") and "ObjectRef" in reason
    block = next(row for site, row in rows.items() if site.startswith("sharing() at "))
    assert block.arguments == 1 and block.puts == 1
    table = str(refshare.report())
    assert "send" in table and "sharing() at" in table and "holds a" in table
    numbers = refshare.report().to_dict()
    assert numbers[sent.site]["by_value"] == 1 and 0.0 <= numbers[sent.site]["saved"] <= 1.0


def test_audit_is_turned_on_by_the_environment(
    readers: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REFSHARE_AUDIT", "1")
    with refshare.sharing():
        ray.get([r.read.remote(np.ones(1 << 15)) for r in readers])
    (row,) = refshare.report().rows
    assert row.audit and row.hits == WORKERS - 1
    assert refshare.stats()[:2] == (0, 0)


@pytest.mark.parametrize("deep", [False, None, True])
@pytest.mark.parametrize("size", ["tiny", "large"])
def test_what_is_saved_never_passes_what_was_sent(readers: list[Any], deep: Any, size: str) -> None:
    """Repeated and distinct bytes are counted in the arguments' own bytes: a tiny batch
    whose skeleton and members weigh more stored than the batch does still saves at most
    all of it."""
    n = 4 if size == "tiny" else 1 << 16
    batch = {"a": np.arange(n), "b": np.ones(n), "tag": "step"}
    with refshare.sharing(min_bytes=0, deep=deep):
        for _ in range(2):
            ray.get([r.read.remote(batch) for r in readers])
    (row,) = refshare.report().rows
    assert row.hits > 0
    assert row.bytes_repeated <= row.bytes_sent and row.saved <= 1.0
    assert row.bytes_repeated + row.bytes_distinct <= row.bytes_sent
    assert row.bytes_repeated_in_call <= row.bytes_repeated
    assert row.bytes_repeated_members <= row.bytes_repeated


@pytest.mark.parametrize("where", ["scope", "environment"])
def test_share_in_an_audit_is_rays_own_put(
    readers: list[Any], where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An audit changes nothing a call gives back: ``share()`` returns what ``ray.put``
    would, a ref a task can be given, and counts what sharing would do."""
    value = np.arange(1 << 15)
    if where == "environment":
        monkeypatch.setenv("REFSHARE_AUDIT", "1")
        refs = [refshare.share(value) for _ in range(2)]
    else:
        with refshare.sharing(audit=True):
            refs = [refshare.share(value) for _ in range(2)]
    assert all(isinstance(ref, ray.ObjectRef) for ref in refs) and refs[0] != refs[1]
    assert np.array_equal(ray.get(refs[1]), value)
    assert ray.get(readers[0].read.remote(refs[0])) == ray.get(readers[0].read.remote(value))
    assert refshare.stats().puts == 0
    if where == "scope":
        (row,) = refshare.report().rows
        assert row.audit and (row.puts, row.hits) == (1, 1)


def test_an_audit_of_tensors_runs_none_of_the_programs_own_hooks(
    readers: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An audit times what a receiver spends rebuilding tensors without going through the
    program's ``torch.save`` (ROLL's example wraps it to count its batches, and a wrapper
    that expects a batch failed on the audit's own probe): the program's hook runs as often
    under audit as by value, and the estimate counts the receivers."""
    torch = pytest.importorskip("torch")
    calls: list[str] = []
    save = torch.save

    def counted(obj: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(type(obj).__name__)
        return save(obj, *args, **kwargs)

    monkeypatch.setattr(torch, "save", counted)
    batch = {"x": torch.ones(1 << 20), "y": torch.arange(1 << 18)}  # 6 MiB of tensors
    nbytes = sum(t.numel() * t.element_size() for t in batch.values())

    def fan_out() -> list[Any]:
        return ray.get([r.read.remote(batch) for r in readers])

    by_value = fan_out()
    by_value_saves = len(calls)
    calls.clear()
    audited = refshare.shared_args(audit=True, cache=refshare.RefCache())(fan_out)()
    assert audited == by_value
    assert len(calls) == by_value_saves > 0, calls
    (row,) = refshare.report().rows
    assert row.audit and row.bytes_repeated == (WORKERS - 1) * nbytes
    assert row.would_save_ms is not None and row.would_save_ms > 0


def test_an_audit_counts_a_batchs_tensor_elements_as_stored_as_their_bytes() -> None:
    """A batch that pickles its tensors through ``torch.save`` (verl's ``DataProto``, SkyRL's
    batches) is split into its tensors' elements, which sharing stores as their bytes: one
    copy where by value runs ``torch.save``. The audit's time estimate counts that saving
    for them as for a tensor (it counted nothing: on a quick replay of verl's step the
    estimate read 0.77x what sharing saved, 1.12x once counted); a tensor Ray must pickle
    itself (its conjugate bit set) is not."""
    torch = pytest.importorskip("torch")
    elements = internals.TensorElements(torch.ones(1 << 16)[::2])  # a view: its own elements
    assert internals.serialized.put_as_bytes(elements)
    conjugate = internals.TensorElements(torch.ones(8, dtype=torch.complex64).conj())
    assert not internals.serialized.put_as_bytes(conjugate)


def test_sends_side_by_side_are_charged_their_wall_time_once() -> None:
    """Two threads sending at once (verl's ``parallel_put`` puts each rank's chunk from a
    thread pool) spend the wall time once: each is charged half of it while both are in
    flight, so the charges sum to no more than the wall time they took, where each thread's
    own clock counted it twice (an audit of verl's ND dispatch foretold 1.49 times what
    sharing saved)."""
    clock, both = internals.SharedClock(), threading.Barrier(2)
    charged: list[float] = []

    def send() -> None:
        both.wait()
        start = clock.enter()
        time.sleep(0.2)
        charged.append(clock.leave() - start)

    started = time.perf_counter()
    threads = [threading.Thread(target=send) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    assert len(charged) == 2 and clock.in_flight == 0
    assert 0.2 <= sum(charged) <= wall  # each thread's own clock: 0.4 s
    assert all(c >= 0.1 for c in charged)


def test_an_audit_charges_its_keying_in_cpu_time_not_in_waits() -> None:
    """What an audit charges for keying is the thread's CPU time: sharing would spend that
    work, but not the wait for the interpreter while another thread pickles an argument by
    value (a wall clock charged verl's TensorDict flow 126 ms a step of keying where
    sharing's keying took 54). Here the keying waits 0.2 s and Ray's call takes 0.1 s, its
    argument all repeated: sharing would save the call, not lose the wait."""
    ledger = internals.Ledger("keying that waits", audit=True)
    timing = ledger.timing()
    assert timing is not None
    time.sleep(0.2)  # a wait, as for the interpreter: no CPU time
    tab = ledger.tab(1 << 20)
    tab.hit(1, 1 << 20)  # all of it repeated
    ledger.argument(tab)
    timing.call(time.sleep, 0.1)
    row = next(r for r in refshare.report().rows if r.site == "keying that waits")
    refshare.reset_report()
    assert row.sending_ms is not None and row.would_save_ms is not None
    assert 100 <= row.sending_ms < 200
    assert row.sending_ms - 10 <= row.would_save_ms <= row.sending_ms  # a wall clock: < 0


@pytest.mark.verify_off  # times what Ray spends sending, which verify adds to
def test_an_audit_times_what_ray_spends_sending_and_what_would_repeat(
    readers: list[Any],
) -> None:
    """An audit times Ray's own calls that carry large arguments (``.remote()`` and
    ``ray.put``), and of each call's time counts its repeated bytes' share, less its keying,
    as what sharing would save: never more than Ray spent, nothing where nothing repeats.
    A call without large arguments is not counted; sharing's rows carry no estimate."""
    batch = np.ones(1 << 20)  # 8 MiB, to every worker: all but the first send repeat

    @refshare.shared_args(audit=True, cache=refshare.RefCache())
    def audited() -> list[Any]:
        ray.get([r.read.remote() for r in readers])  # nothing large: not timed
        refshare.share(batch)  # Ray's own put, timed: no clock is left running
        return ray.get([r.read.remote(batch) for r in readers] + [ray.put(batch)])

    @refshare.shared_args(audit=True, cache=refshare.RefCache())
    def distinct() -> list[Any]:  # a batch of its own to each worker: nothing repeats
        return ray.get([r.read.remote(np.full(1 << 20, i)) for i, r in enumerate(readers)])

    @refshare.shared_args(cache=refshare.RefCache())
    def shared() -> list[Any]:
        return ray.get([r.read.remote(batch) for r in readers])

    audited()
    distinct()
    shared()
    audit, unrepeated, sharing = refshare.report().rows
    assert audit.audit and audit.sending_ms is not None and audit.would_save_ms is not None
    assert audit.bytes_repeated == (WORKERS + 1) * batch.nbytes  # of WORKERS + 2 sends
    assert internals.sends_clock.in_flight == 0
    # Each call's share is its own (the first send's is 0, the put's 1), so the sum is
    # bounded by what Ray spent on all, not by the bytes' share of it.
    assert 0 < audit.would_save_ms <= audit.sending_ms
    assert unrepeated.bytes_repeated == 0 and unrepeated.sending_ms
    assert unrepeated.would_save_ms is not None and unrepeated.would_save_ms <= 0
    assert sharing.would_save_ms is None and sharing.sending_ms is None
    text = str(refshare.report())
    assert "would save" in text and "ms a call" in text and "Ray spent sending" in text
    assert refshare.report().to_dict()[f"{audit.site} (audit)"]["sending_ms"] == audit.sending_ms


def test_bad_audit_option_fails_at_decoration() -> None:
    with pytest.raises(TypeError, match="audit='yes'"):
        refshare.shared_args(audit="yes")  # type: ignore[arg-type]


_CONTROLLER = """
import os, sys
import numpy as np, ray, refshare

@ray.remote(num_cpus=0.1)
class Sink:
    def read(self, x):
        return x.size

@ray.remote(num_cpus=0.1)
class Controller:
    @refshare.shared_args
    def step(self, sinks):
        batch = np.ones(1 << 16)
        return ray.get([s.read.remote(batch) for s in sinks])

    def pid(self):
        return os.getpid()

    def stop(self):
        ray.actor.exit_actor()

ray.init(address="local", num_cpus=1, include_dashboard=False, runtime_env={
    "worker_process_setup_hook": "refshare.worker_setup",
    "env_vars": {"REFSHARE_REPORT": "1", "REFSHARE_ENABLE": ""},
})
sinks = [Sink.remote() for _ in range(2)]
controller = Controller.remote()
assert ray.get(controller.step.remote(sinks)) == [1 << 16] * 2
pid = ray.get(controller.pid.remote())
logs = ray._private.worker._global_node.get_logs_dir_path()
try:
    ray.get(controller.stop.remote())
except ray.exceptions.RayActorError:
    pass
print(pid, logs)
"""


@pytest.mark.slow
def test_a_controller_actor_writes_its_report_to_its_log_at_exit(tmp_path: Path) -> None:
    """A trainer's controller runs in an actor (verl's ``TaskRunner``): started with
    ``REFSHARE_REPORT=1`` through ``worker_setup``, it writes its table to its own log."""
    script = tmp_path / "controller.py"
    script.write_text(textwrap.dedent(_CONTROLLER))
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    pid, logs = done.stdout.split()[-2:]
    import time

    deadline = time.monotonic() + 30
    found: list[str] = []
    while not found and time.monotonic() < deadline:
        found = [
            path.read_text(errors="replace") for path in Path(logs).glob(f"worker-*-{pid}.err")
        ]
        found = [text for text in found if f"refshare report (pid {pid})" in text]
        time.sleep(0.5)
    assert found, f"no report in the controller's log under {logs}"
    assert "Controller.step" in found[0] and "sharing" in found[0]
