"""The patch of Ray's submit path: lazy, idempotent, undoable, and harmless when refused."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
import pytest
import ray
from helpers import receive
from internals import submit as _patch

import refshare

BIG = np.zeros(300_000, dtype=np.uint8)


def same(found: dict[str, object], expected: dict[str, object]) -> bool:
    """Identity, not ``==``: a wrapt proxy compares equal to the function it wraps."""
    return found.keys() == expected.keys() and all(found[k] is expected[k] for k in found)


def targets() -> dict[str, object]:
    import ray.actor
    import ray.remote_function

    classes = (ray.actor.ActorMethod, ray.remote_function.RemoteFunction, ray.actor.ActorClass)
    return {cls.__name__: cls.__dict__["_remote"] for cls in classes}


@pytest.fixture
def pristine() -> Iterator[dict[str, object]]:
    """Ray's own methods, with refshare installed again afterwards as the suite expects."""
    refshare.uninstall()
    originals = targets()
    yield originals
    refshare.install()


def test_install_is_idempotent_and_uninstall_restores_ray(pristine: dict[str, object]) -> None:
    assert not refshare.is_installed()
    assert refshare.install() and refshare.install()
    installed = targets()
    assert all(installed[name] is not pristine[name] for name in pristine)
    assert all(installed[name].__wrapped__ is pristine[name] for name in pristine)
    refshare.uninstall()
    refshare.uninstall()
    assert same(targets(), pristine) and not refshare.is_installed()


@pytest.mark.usefixtures("local_ray", "fresh")
def test_explicit_uninstall_is_respected_by_later_scopes(pristine: dict[str, object]) -> None:
    with refshare.sharing():
        ray.get(receive.remote(BIG))
    assert refshare.stats().puts == 0 and same(targets(), pristine)
    refshare.install()
    with refshare.sharing():
        ray.get(receive.remote(BIG))
    assert refshare.stats().puts == 1


@pytest.mark.usefixtures("local_ray", "fresh")
def test_outside_a_scope_calls_go_by_value() -> None:
    assert refshare.is_installed()
    assert ray.get(receive.remote(BIG)) == ray.get(receive.remote(BIG))
    assert refshare.stats() == refshare.Stats()


@pytest.mark.usefixtures("local_ray", "fresh")
def test_unexpected_ray_internals_warn_once_and_leave_ray_alone(
    pristine: dict[str, object],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(_patch, "_refused", False)
    monkeypatch.setattr(_patch, "_patches", [])
    moved = (*_patch.SUBMIT_SITES, _patch.Site("ray.actor", "ActorMethod", "_remote_v3"))
    monkeypatch.setattr(_patch, "SUBMIT_SITES", moved)
    with caplog.at_level(logging.WARNING, logger="refshare"):
        assert not refshare.install()
        assert not refshare.install()
    warnings = [r for r in caplog.records if "not supported" in r.getMessage()]
    assert len(warnings) == 1
    assert same(targets(), pristine) and not refshare.is_installed()
    with refshare.sharing():
        assert ray.get(receive.remote(BIG)) == ray.get(receive.remote(BIG))
    assert refshare.stats().puts == 0
