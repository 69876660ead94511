"""Pickle's order, in one place (``refshare._rules``): what refshare says a value is, to
pickle, agrees with what Ray's pickler does with it; and the rules it holds, from the
outside: a hook that other code wrapped is not its package's (``functools.wraps`` and wrapt
copy the name it carries), and a serializer the program registered for a class, leaves
included, decides what its values are sent as.

The classes live in ``pickling_cases.py``: the hooks and serializers this module installs
are its code, not theirs, as a program patching a framework's class installs its own."""

from __future__ import annotations

import collections
import contextlib
import copyreg
import dataclasses
import datetime
import functools
import io
import logging
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pickling_cases as cases
import pytest
import ray
import wrapt
from differential_kit import Probe, first_difference

import refshare
from refshare._deep import deep_reducers
from refshare._keys.tables import pickle_order
from refshare._rules import TRUSTED_PICKLING, Kind, pickling_is_its_packages

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.usefixtures("local_ray", "fresh")

DEEP = (False, None, True)


@pytest.fixture(scope="module")
def probe(local_ray: None) -> Any:
    return Probe.remote()  # type: ignore[attr-defined]


@pytest.fixture(scope="module", autouse=True)
def proto_reader() -> None:
    """A reader and a deep reduction for ``Proto``, as refshare has for verl's batch; a
    reader for ``Box``."""
    refshare.register_fingerprint(cases.Box, lambda box: (box.data, box.note))
    refshare.register_fingerprint(cases.Proto, lambda p: (p.batch, p.meta))
    deep_reducers.register(cases.Proto, lambda p: (cases.proto, (p.batch, p.meta)))


# -- what refshare says, against what Ray's pickler does ---------------------------------------


class _Seen(collections.ChainMap):  # type: ignore[type-arg]
    """Ray's dispatch tables, noting each class pickle found a reducer for."""

    def __init__(self, *maps: Any) -> None:
        super().__init__(*maps)
        self.hits: list[type] = []

    def __getitem__(self, cls: Any) -> Any:
        found = super().__getitem__(cls)
        self.hits.append(cls)
        return found


#: Packages whose code may run while Ray pickles anything: Python's, and Ray's own.
#: Code that runs in the interpreter while a value is pickled and is not its pickling: the
#: standard library, refshare, and the test tools' own hooks (hypothesis's, which a
#: garbage collection during the dump can call).
_PYTHON = TRUSTED_PICKLING | sys.stdlib_module_names | {"refshare", "hypothesis", "_pytest"}


def pickled_by_ray(value: Any) -> tuple[str, set[str]]:
    """How Ray's pickler sends ``value``: what decided it (``"reducer_override"``: a class
    or function reduced by cloudpickle, ``"table"``: a dispatch-table entry, ``"name"``: a
    class or function by name, ``"own"``: the value's own reduction), and the packages
    from outside Python's and the trusted ones whose code ran (a hook, a reducer)."""
    from ray import cloudpickle

    base: Any = cloudpickle.CloudPickler
    seen = _Seen(*base.dispatch_table.maps)
    first: list[Any] = []

    class Recorder(base):  # type: ignore[misc, valid-type]
        dispatch_table = seen

        def reducer_override(self, obj: Any) -> Any:
            reduced = super().reducer_override(obj)
            if obj is value:
                first.append(reduced)
            return reduced

    ran: set[str] = set()
    own_code = {Recorder.reducer_override.__code__, _Seen.__getitem__.__code__}

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code not in own_code:
            ran.add(str(frame.f_globals.get("__name__", "")).partition(".")[0])

    sys.setprofile(profile)
    try:
        Recorder(io.BytesIO(), protocol=5).dump(value)
    finally:
        sys.setprofile(None)
    ran = {name for name in ran - _PYTHON if not name.startswith("namedtuple_")}
    if first and first[0] is not NotImplemented:
        return "reducer_override", ran
    if type(value) in seen.hits:
        return "table", ran
    if isinstance(value, (type, types.FunctionType)):
        return "name", ran
    return "own", ran


#: What decides how Ray's pickler sends a value of each kind.
DECIDED_BY = {
    Kind.HANDLE: {"table"},
    Kind.CODE: {"reducer_override"},
    Kind.NAMED: {"name"},
    Kind.LEAF: {"own"},
    Kind.READ: {"own"},
    Kind.PLAIN: {"own", "table"},
    Kind.HOOKED: {"own"},
    Kind.OWN_CODE: {"own", "table"},
}


def _local_class() -> type:
    class Local:
        pass

    return Local


@dataclasses.dataclass(frozen=True, slots=True)
class Slotted:
    x: int


def _hooked_box() -> Any:
    box = cases.Box(np.zeros(4), "n")
    box.__reduce_ex__ = lambda protocol: (cases.relabelled, (box.data, "x"))  # type: ignore[method-assign]
    return box


def _wrapped(hook: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(hook)
    def __getstate__(self: Any) -> Any:
        return hook(self)

    return __getstate__


@contextlib.contextmanager
def _assigned(cls: type, name: str, hook: Any) -> Iterator[None]:
    original = cls.__dict__[name]
    setattr(cls, name, hook)
    try:
        yield
    finally:
        setattr(cls, name, original)


@contextlib.contextmanager
def _copyreg(cls: type, reducer: Any) -> Iterator[None]:
    copyreg.pickle(cls, reducer)
    try:
        yield
    finally:
        del copyreg.dispatch_table[cls]


@contextlib.contextmanager
def _serializer(cls: type, to: Any, back: Any) -> Iterator[None]:
    ray.util.register_serializer(cls, serializer=to, deserializer=back)
    try:
        yield
    finally:
        ray.util.deregister_serializer(cls)


def _with_instance_hook(t: Any) -> Any:
    t.__reduce_ex__ = lambda protocol: (torch.zeros, (3,))
    return t


def _proto() -> Any:
    return cases.Proto({"x": torch.arange(4.0)}, {"step": 1})


_nothing = contextlib.nullcontext
#: Each case: the value (made at the time), the kind refshare must say, and what is
#: installed meanwhile (a hook, a reducer, a serializer of this module's).
CASES: dict[str, tuple[Callable[[], Any], Kind, Callable[[], Any]]] = {
    "object ref": (lambda: ray.put(1), Kind.HANDLE, _nothing),
    "class by name": (lambda: cases.Box, Kind.NAMED, _nothing),
    "function by name": (lambda: cases.relabelled, Kind.NAMED, _nothing),
    "class as code": (_local_class, Kind.CODE, _nothing),
    "function as code": (lambda: lambda: 1, Kind.CODE, _nothing),
    "array": (lambda: np.arange(4.0), Kind.LEAF, _nothing),
    "tensor": (lambda: torch.arange(4.0), Kind.LEAF, _nothing),
    "parameter": (lambda: torch.nn.Parameter(torch.ones(2)), Kind.LEAF, _nothing),
    "read": (lambda: cases.Box(np.zeros(4), "n"), Kind.READ, _nothing),
    "read, hook of its package": (_proto, Kind.READ, _nothing),
    "hooked instance": (_hooked_box, Kind.HOOKED, _nothing),
    "tensor with a hook of its own": (
        lambda: _with_instance_hook(torch.arange(4.0)),
        Kind.HOOKED,
        _nothing,
    ),
    "own reduce": (lambda: cases.Scaled(np.zeros(4)), Kind.OWN_CODE, _nothing),
    "hook wrapped with functools.wraps": (
        _proto,
        Kind.OWN_CODE,
        lambda: _assigned(cases.Proto, "__getstate__", _wrapped(cases.Proto.__getstate__)),
    ),
    "hook wrapped with wrapt": (
        _proto,
        Kind.OWN_CODE,
        lambda: _assigned(
            cases.Proto,
            "__getstate__",
            wrapt.FunctionWrapper(cases.Proto.__getstate__, lambda w, i, a, k: w(*a, **k)),
        ),
    ),
    "copyreg reducer": (
        lambda: cases.Box(np.zeros(4), "n"),
        Kind.OWN_CODE,
        lambda: _copyreg(cases.Box, lambda box: (cases.relabelled, (box.data, "r"))),
    ),
    "serializer for arrays": (
        lambda: np.arange(4.0),
        Kind.OWN_CODE,
        lambda: _serializer(np.ndarray, cases.array_to_wire, cases.array_from_wire),
    ),
    "serializer for tensors": (
        lambda: torch.arange(4.0),
        Kind.OWN_CODE,
        lambda: _serializer(torch.Tensor, cases.tensor_to_wire, cases.tensor_from_wire),
    ),
    "plain object": (lambda: cases.Relabelled(np.zeros(2), "l"), Kind.PLAIN, _nothing),
    "slotted dataclass": (lambda: Slotted(1), Kind.PLAIN, _nothing),
    "datetime": (lambda: datetime.datetime(2024, 1, 1), Kind.PLAIN, _nothing),
    "logger (a reducer of Ray's)": (
        lambda: logging.getLogger("refshare.test"),
        Kind.PLAIN,
        _nothing,
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_what_refshare_says_a_value_is_agrees_with_what_rays_pickler_does(case: str) -> None:
    make, kind, installed = CASES[case]
    with installed():
        value = make()
        said = pickle_order.walk().of(value).kind
        did = pickled_by_ray(value)
    decided_by, ran = did
    assert said is kind, f"{case}: refshare says {said}"
    assert decided_by in DECIDED_BY[kind], f"{case}: {kind}, but Ray's pickler: {did}"
    if kind is Kind.HOOKED or kind is Kind.OWN_CODE:
        assert ran, f"{case}: {kind}, but only trusted code ran"
    elif kind is Kind.READ:  # what its reader models: its own package's code, if any
        assert ran <= {type(value).__module__.partition(".")[0]}, f"{case}: {ran} ran"
    else:
        assert not ran, f"{case}: {kind}, but {ran} ran"


# -- a hook wrapped by other code is not its package's ------------------------------------------


def to_bfloat16(state: dict[str, Any]) -> dict[str, Any]:
    """What the program's wrapper of ``Proto.__getstate__`` sends instead: bfloat16."""
    batch = {key: t.to(torch.bfloat16) for key, t in state["batch"].items()}
    return {"batch": batch, "meta": state["meta"]}


def wraps_wrapper() -> Any:
    original = cases.Proto.__getstate__

    @functools.wraps(original)
    def __getstate__(self: Any) -> Any:
        return to_bfloat16(original(self))

    return _assigned(cases.Proto, "__getstate__", __getstate__)


@contextlib.contextmanager
def wrapt_wrapper() -> Iterator[None]:
    original = cases.Proto.__dict__["__getstate__"]
    wrapt.wrap_function_wrapper(
        cases, "Proto.__getstate__", lambda wrapped, _, args, kwargs: to_bfloat16(wrapped())
    )
    try:
        yield
    finally:
        cases.Proto.__getstate__ = original  # type: ignore[method-assign]


def send(probe: Any, value: Any) -> Any:
    return ray.get(probe.describe.remote(value), timeout=60)


def by_value(probe: Any, value: Any) -> Any:
    with refshare.sharing(enabled=False):
        return send(probe, value)


def batch(seed: int = 0) -> Any:
    rows = torch.Generator().manual_seed(seed)
    return cases.Proto({"x": torch.randn(1 << 16, generator=rows)}, {"step": 1})  # 256 KiB


@pytest.mark.parametrize("wrap", [wraps_wrapper, wrapt_wrapper], ids=["functools", "wrapt"])
@pytest.mark.parametrize("deep", DEEP)
def test_a_hook_other_code_wrapped_is_neither_read_nor_split(
    probe: Any, deep: Any, wrap: Callable[[], Any]
) -> None:
    """Sent once as its package pickles it (read, or split, by refshare), then with its
    ``__getstate__`` wrapped to send bfloat16: across calls and within one, each send
    arrives as by value then."""
    value = batch()
    with refshare.sharing(min_bytes=1 << 10, deep=deep):
        first = send(probe, value)
        assert first == by_value(probe, value)
        with wrap():
            assert not pickling_is_its_packages(cases.Proto)
            within = send(probe, value)
            expected = by_value(probe, value)
    with wrap(), refshare.sharing(min_bytes=1 << 10, deep=deep):
        across = send(probe, value)
    assert expected != first, "the wrapper must change what is sent"
    for got in (within, across):
        assert got == expected, first_difference(expected, got)


# -- a serializer registered for a class decides what its values are sent as -----------------


@pytest.fixture
def wire() -> Iterator[None]:
    yield
    cases.WIRE = "float32"


SERIALIZED = {
    "tensor": (torch.Tensor, cases.tensor_to_wire, cases.tensor_from_wire),
    "array": (np.ndarray, cases.array_to_wire, cases.array_from_wire),
}


@pytest.mark.parametrize("leaf", SERIALIZED)
@pytest.mark.parametrize("where", ["top-level", "member"])
@pytest.mark.parametrize("deep", DEEP)
def test_a_serializer_registered_for_a_leaf_class_decides_what_it_is_sent_as(
    probe: Any, wire: None, leaf: str, where: str, deep: Any
) -> None:
    """The serializer sends values as ``cases.WIRE`` says, switched between two calls: the
    second call's worker receives what by value gives it then, not the first call's."""
    cls, to, back = SERIALIZED[leaf]
    data: Any = torch.arange(float(1 << 16)) if leaf == "tensor" else np.arange(float(1 << 15))
    data /= 1024  # (within float16's range)
    value = data if where == "top-level" else {"data": data, "other": torch.ones(1 << 16)}
    got, expected = [], []
    with _serializer(cls, to, back):
        for dtype in ("float32", "float16"):
            cases.WIRE = dtype
            expected.append(by_value(probe, value))
            with refshare.sharing(min_bytes=1 << 10, deep=deep):
                got.append(send(probe, value))
    assert expected[0] != expected[1], "the serializer must change what is sent"
    for step in range(2):
        assert got[step] == expected[step], first_difference(expected[step], got[step])
