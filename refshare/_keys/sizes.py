"""How many bytes an argument will serialize to, estimated without serializing it."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from itertools import chain, islice
from typing import Any

from .._dispatch import TypeTable
from .._ray.pickling import sent_by_value
from .._rules import Classes, Kind, PickleOrder, slot_names
from .._wire.serialized import ray_handle_types
from .._wire.tensors import TensorElements

logger = logging.getLogger("refshare")

SizeFn = Callable[[Any], int]

#: How many objects a size estimate visits at most: a list of a million small items is sized
#: from its first ones, so the estimate costs at most a millisecond or so, whatever the
#: argument.
SIZE_VISIT_BUDGET = 10_000
#: How many elements of an array of Python objects are visited to size it.
OBJECT_ARRAY_SAMPLE = 32
#: How many members of each container a sampled estimate visits (see :func:`measure`).
CONTAINER_SAMPLE = 16
#: What one scalar (int, float, ...) is taken to weigh.
SCALAR_BYTES = 8
#: Values too small to share, whatever their number: sized, stamped and sent as they are.
SCALARS = frozenset((int, float, complex, bool, type(None)))

#: Sizes by type, looked up along the MRO; a negative size means "walk its members".
sizes: TypeTable[SizeFn] = TypeTable()
#: Pickle's order as sizing needs it: sizes come from their own table, along the MRO.
_size_order = PickleOrder(None, (), ray_handle_types, sent_by_value)
#: What a ref or an actor handle weighs: Ray sends its id and its owner's address.
HANDLE_BYTES = 64


@sizes.registers_lazy("numpy", "ndarray")
def _ndarray_size(a: Any) -> int:
    # An array of Python objects pickles each object: it is sized by walking them.
    return -1 if a.dtype.hasobject else int(a.nbytes)


@sizes.registers_lazy("numpy", "generic")
def _scalar_size(s: Any) -> int:
    return int(s.nbytes)


@sizes.registers_lazy("torch", "Tensor")
def tensor_nbytes(t: Any) -> int:
    """What pickling a tensor sends: its whole storage, even for a small view of it."""
    if t.device.type != "cpu":
        return 0  # never shared, whatever its size
    try:
        return int(t.untyped_storage().nbytes())
    except Exception:
        return int(t.element_size() * t.nelement())


@sizes.registers_lazy("torch.nested._internal.nested_tensor", "NestedTensor")
def _nested_nbytes(nt: Any) -> int:
    """A jagged nested tensor sends its values, offsets and lengths."""
    parts = (nt._values, nt._offsets, getattr(nt, "_lengths", None))
    return sum(tensor_nbytes(part) for part in parts if part is not None)


@sizes.registers(TensorElements)
def _elements_size(wrapper: TensorElements) -> int:
    return int(wrapper.tensor.nelement() * wrapper.tensor.element_size())


def register_size(cls: type, size: SizeFn) -> None:
    """Teach refshare how many bytes an instance of ``cls`` (or a subclass) will serialize to.

    ``size(obj)`` must be cheap: it runs on every argument before anything is hashed. A
    negative size means "walk its members instead".
    """
    if not isinstance(cls, type):
        raise TypeError(f"register_size() takes a class, got {cls!r}")
    if not callable(size):
        raise TypeError(f"register_size() takes a callable size function, got {size!r}")
    sizes.register(cls, size)


def _leaf_size(obj: object) -> int | None:
    """The size of a scalar, string or buffer-backed value; ``None`` for anything else."""
    cls = type(obj)
    if cls in SCALARS:
        return SCALAR_BYTES
    if cls is bytes or cls is str or cls is bytearray:
        return len(obj)  # type: ignore[arg-type]
    size = sizes.lookup(cls)
    if size is None:
        return None
    found = size(obj)
    return None if found < 0 else found


def _arrays_nbytes(items: Any, ndarray: Any) -> int | None:
    """The bytes of the items of a container, all numeric numpy arrays (shards, a batch's
    columns), in one tight loop, as the walk would count them; ``None`` as soon as one is
    anything else, or without numpy (``ndarray``: :func:`plain_ndarray`)."""
    if ndarray is None:
        return None
    total = 0
    for arr in items:
        if type(arr) is not ndarray or arr.dtype.hasobject:
            return None
        total += arr.nbytes
    return total


def _flat_size(items: Any) -> tuple[int, int] | None:
    """The bytes and visits :meth:`_Sizing.add_members` counts for a container's members
    when they are all scalars, all strings, all bytes, or all tuples of scalars (a batch's
    row bounds), counted in a few passes in C instead of a step each; ``None`` for any
    other mix."""
    kinds = set(map(type, items))
    if kinds <= SCALARS:
        return SCALAR_BYTES * len(items), len(items)
    if kinds == {str} or kinds == {bytes}:
        return sum(map(len, items)), len(items)
    if kinds == {tuple} and SCALARS.issuperset(map(type, chain.from_iterable(items))):
        scalars = sum(map(len, items))
        return SCALAR_BYTES * scalars, len(items) + scalars
    return None


def plain_ndarray() -> type | None:
    """``numpy.ndarray`` where numpy is imported and its arrays are sized by the table's own
    rule (their ``nbytes``), not by a size of the program's; else ``None``."""
    ndarray = getattr(sys.modules.get("numpy"), "ndarray", None)
    return ndarray if ndarray is not None and sizes.lookup(ndarray) is _ndarray_size else None


class _Sizing:
    """One walk over an argument's members, with a visit budget and cycle guard."""

    __slots__ = ("budget", "kinds", "limit", "ndarray", "sample", "seen", "stopped", "total")

    def __init__(self, limit: int, sample: int = sys.maxsize) -> None:
        self.limit = limit
        self.sample = sample  # members visited per container, the rest extrapolated
        self.stopped = False  # stopped at the limit, before the end
        self.total = 0
        self.budget = SIZE_VISIT_BUDGET
        self.seen: set[int] | None = None  # made on the first container
        self.ndarray: Any = False  # plain_ndarray(), looked up on the first container
        self.kinds: Classes | None = None  # made on the first object of no size of its own

    def add(self, obj: object) -> None:
        self.budget -= 1
        size = _leaf_size(obj)
        if size is not None:
            self.total += size
        else:
            self.walk(obj)

    def walk(self, obj: object) -> None:
        """Add ``obj``, of no size of its own (see :func:`_leaf_size`), by its members."""
        if self.seen is None:
            self.seen = set()
        elif id(obj) in self.seen:
            return
        self.seen.add(id(obj))
        if isinstance(obj, (dict, list, tuple, set, frozenset)):
            items = obj.values() if isinstance(obj, dict) else obj
            fits = 0 < len(obj) <= self.budget
            step = _stride(len(obj), self.sample)
            flat = _flat_size(items) if fits and step == 1 else None
            if flat is not None and flat[1] <= self.budget and self.total + flat[0] < self.limit:
                # (Else walked: the walk stops at the limit, or extrapolates past the budget.)
                self.total += flat[0]
                self.budget -= flat[1]
                return
            if self.ndarray is False:
                self.ndarray = plain_ndarray()
            arrays = _arrays_nbytes(items, self.ndarray) if fits else None
            if arrays is not None:
                self.budget -= len(obj)
                self.total += arrays
            else:
                self.add_members(items if step == 1 else islice(items, 0, None, step), len(obj))
        elif isinstance(obj, memoryview):
            self.total += obj.nbytes
        elif getattr(getattr(obj, "dtype", None), "hasobject", False):  # numpy, of objects
            # Sized from a sample: such arrays (uids, prompts) are nearly uniform. A strided
            # slice reads only the sample, where skipping element by element reads them all.
            step = _stride(obj.size, OBJECT_ARRAY_SAMPLE)  # type: ignore[attr-defined]
            self.add_members(obj.flat[::step], obj.size)  # type: ignore[attr-defined]
        else:
            if self.kinds is None:
                self.kinds = _size_order.walk()
            if self.kinds.rule(type(obj)).kind is Kind.HANDLE:
                self.total += HANDLE_BYTES  # not what it names: Ray keeps that where it is
                return
            state = getattr(obj, "__dict__", None)
            slots = slot_names(type(obj))
            if isinstance(state, dict):
                self.add_members(state.values(), len(state))
            if slots:
                present = [name for name in slots if hasattr(obj, name)]
                self.add_members((getattr(obj, name) for name in present), len(present))
            elif not isinstance(state, dict):
                self.total += sys.getsizeof(obj, SCALAR_BYTES)

    def add_members(self, items: Any, count: int) -> None:
        """Add ``items``, all or a sample of a container's ``count`` members. Those not
        visited (left out of the sample, or left when the visit budget runs out) are taken
        to weigh what the visited ones did on average: a list of two million ints is sized
        at 16 MB after ten thousand visits."""
        start = self.total
        visited = 0
        for item in items:
            if self.total >= self.limit:
                self.stopped = True
                return
            if self.budget <= 0:
                break
            visited += 1
            # The scalars and strings a batch's metadata holds by the thousand, counted
            # here as _leaf_size counts them, without a call each.
            cls = type(item)
            if cls in SCALARS:
                self.budget -= 1
                self.total += SCALAR_BYTES
            elif cls is str or cls is bytes:
                self.budget -= 1
                self.total += len(item)
            elif cls is tuple and SCALARS.issuperset(map(type, item)):
                # A row's bounds, a shape: no container of its own to walk or to see again.
                self.budget -= 1 + len(item)
                self.total += SCALAR_BYTES * len(item)
            else:
                self.add(item)
        if visited < count:
            self.total += (self.total - start) * (count - visited) // max(visited, 1)


def _stride(count: int, sample: int) -> int:
    """Every how many of ``count`` members a sample of about ``sample`` visits one."""
    return max(1, -(-count // sample))


def estimate_size(obj: object, limit: int = sys.maxsize) -> int:
    """Estimate the bytes ``obj`` serializes to, without serializing it.

    Arrays and tensors report their buffer size, containers and plain objects the sum of
    their members. The walk stops once the total reaches ``limit`` (the result is then a
    lower bound) or after ``SIZE_VISIT_BUDGET`` objects (the rest of the container being
    walked is extrapolated from the members visited).
    """
    return measure(obj, limit)[0]


def metadata_size(obj: object) -> int:
    """The size of what a framework's batch sends beside its tensors (a ``DataProto``'s
    non-tensor batch and ``meta_info``, a consolidated ``TensorDict``'s metadata, a SkyRL
    batch's metadata), sized from a sample of each container's members: a small entry per
    row or mini-batch, by the hundred, beside megabytes of tensors."""
    return measure(obj, sample=CONTAINER_SAMPLE)[0]


def size_if_large(obj: object, floor: int) -> int | None:
    """The bytes ``obj`` serializes to if they reach ``floor``, else ``None``: what a scope
    asks of every argument of every call. A scalar, string, array or registered type is
    sized in one step; anything else is walked until it reaches ``floor``, then in full
    (for the stats and the cache's budget)."""
    try:
        size = _leaf_size(obj)
    except Exception:
        logger.debug("could not size %s", type(obj).__qualname__, exc_info=True)
        return None
    if size is None:
        size, complete = measure(obj, floor, no_leaf=True)
        if size >= floor and not complete:
            size = estimate_size(obj)
    return size if size >= floor else None


def measure(
    obj: object, limit: int = sys.maxsize, sample: int = sys.maxsize, no_leaf: bool = False
) -> tuple[int, bool]:
    """:func:`estimate_size`, and whether the walk went to its end rather than stopping at
    ``limit``: a value sized in one step (an array, a registered type) is sized in full.

    ``sample`` (``CONTAINER_SAMPLE``, say) visits that many members of each container and
    extrapolates the rest from them: for metadata whose containers hold a small, nearly
    uniform entry per row (uids, lengths) beside the buffers that make up its bytes.
    ``no_leaf``: the caller found ``obj`` has no size of its own, so it is walked at once."""
    sizing = _Sizing(limit, sample)
    try:
        if no_leaf:
            sizing.budget -= 1  # its visit, as add() counts it
            sizing.walk(obj)
        else:
            sizing.add(obj)
    except RecursionError:
        pass  # nested too deeply to walk: what was seen so far is the lower bound
    except Exception:
        logger.debug("could not size %s", type(obj).__qualname__, exc_info=True)
        return 0, True
    return sizing.total, not sizing.stopped
