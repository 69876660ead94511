"""The differential suite's pieces: a worker-side description of everything a receiver can
observe of a value, the workers that return it, and recipes that build the values the suite
sends (rebuildable, so that every way of sending starts from the same value)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import inspect
import itertools
import pickle
import struct
import sys
import warnings
import weakref
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import ray


def _torch() -> Any:
    """torch if this process imported it (a worker does when it unpickles a tensor): the
    workers' own import of this module stays light."""
    return sys.modules.get("torch")


# -- what a receiver can observe ------------------------------------------------------------

_ATOMS = (int, float, complex, bool, str, bytes, type(None))


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def _atom(value: Any) -> Any:
    """An immutable value by type and value: 1, 1.0 and True differ; -0.0 is not 0.0."""
    if isinstance(value, float):
        return ("float", value.hex())
    if isinstance(value, bytes):
        return ("bytes", len(value), zlib.crc32(value))
    if isinstance(value, str):
        return ("str", len(value), zlib.crc32(value.encode("utf-8", "surrogatepass")))
    return (type(value).__name__, repr(value))


def _hashable(value: Any) -> Any:
    """A set member without identity (sets hold atoms and tuples of atoms)."""
    if isinstance(value, (tuple, frozenset)):
        return (type(value).__name__, sorted(map(repr, map(_hashable, value))))
    if isinstance(value, _ATOMS) and type(value) in _ATOMS:
        return _atom(value)
    return ("other", _qualname(type(value)), repr(value)[:100])


def _dtype(dtype: np.dtype[Any]) -> Any:
    """Everything of a dtype: its pickle covers metadata, byte order, alignment, record type."""
    metadata = dtype.metadata
    return (
        repr(dtype),
        _digest(pickle.dumps(dtype, protocol=5)),
        None if metadata is None else sorted((k, repr(v)) for k, v in metadata.items()),
        dtype.isalignedstruct,
        dtype.byteorder,
        dtype.type.__qualname__,
    )


def _field_bytes(arr: np.ndarray, order: str = "A") -> bytes:
    """The array's bytes in its own order (F for an F-contiguous one), field by field for a
    struct: padding between fields is not content (a copy leaves it uninitialized)."""
    names = arr.dtype.names
    if not names:
        return np.ndarray.tobytes(arr, order=order)  # type: ignore[arg-type]
    plain = arr.view(np.ndarray)
    return b"".join(_field_bytes(plain[name], order) for name in names)


def _size(value: Any) -> Any:
    """A size or stride of a tensor; a nested tensor's ragged one by its coefficient: the
    number torch names it by (``j1``) counts the nested tensors the process has made."""
    node = getattr(value, "node", None)
    if node is not None and node.is_nested_int():
        return ("ragged", node.nested_int_coeff())
    return value if isinstance(value, int) else repr(value)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_main(cls: type) -> bool:
    return cls.__module__ == "__main__"


#: What a batch class (TensorDict, its non-tensor kinds, DataProto) may answer through a
#: property or method and not hold as an attribute of that name.
#: The methods an actor may answer to say which actor it is (``Tagged.tag``).
ANSWERS = ("tag", "read")

OBSERVED = ("batch_size", "device", "is_locked", "is_consolidated", "names")


class _Describer:
    """One description pass: objects reached twice are named by their first visit."""

    def __init__(self, layout: bool = True) -> None:
        self.layout = layout  # without it: what the value holds, not how (see describe_content)
        self.digests: dict[tuple[int, int], str] = {}  # a storage's bytes, read once a pass
        self.first: dict[int, int] = {}
        self.held: list[Any] = []  # what was visited: no id is recycled during the pass
        self.storages: dict[int, int] = {}
        self.actors: dict[bytes, int] = {}
        self.refs: dict[bytes, int] = {}
        self.arrays: list[tuple[int, np.ndarray]] = []

    def visit(self, value: Any) -> Any:
        if isinstance(value, _ATOMS) and type(value) in _ATOMS:
            return _atom(value)
        index = self.first.get(id(value))
        if index is not None:
            return ("same", index)
        index = self.first[id(value)] = len(self.held)
        self.held.append(value)
        return (index, self.body(value, index))

    def body(self, value: Any, index: int) -> Any:
        cls = type(value)
        if isinstance(value, np.ndarray):
            return self.ndarray(value, index)
        if isinstance(value, np.dtype):
            return ("dtype", _dtype(value))
        if isinstance(value, np.generic):
            return ("scalar", _qualname(cls), _dtype(value.dtype), _digest(value.tobytes()))
        torch = _torch()
        if torch is not None and isinstance(value, torch.Tensor):
            return self.tensor(value, index)
        if torch is not None and isinstance(value, torch.SymInt):
            return ("SymInt", _size(value))
        if isinstance(value, ray.ObjectRef):
            same = self.refs.setdefault(value.binary(), index)
            inner = _Describer().visit(ray.get(value, timeout=60))
            return ("ObjectRef", same, inner)
        if isinstance(value, ray.actor.ActorHandle):
            same = self.actors.setdefault(value._actor_id.binary(), index)
            return ("ActorHandle", same, self.answer(value))
        if isinstance(value, type):
            return ("type", _qualname(value), self.main_class(value))
        if isinstance(value, bytearray):
            return ("bytearray", len(value), _digest(bytes(value)))
        if isinstance(value, memoryview):
            shape = (value.format, value.shape, value.strides, value.readonly)
            return ("memoryview", shape, _digest(value.tobytes()))
        if isinstance(value, (set, frozenset)):
            return (_qualname(cls), sorted(map(repr, map(_hashable, value))), self.state(value))
        if isinstance(value, (list, tuple)):
            return (_qualname(cls), [self.visit(item) for item in value], self.state(value))
        if isinstance(value, dict):
            items = [(self.visit(k), self.visit(v)) for k, v in value.items()]
            factory = getattr(value, "default_factory", None)
            extra = None if factory is None else _qualname(factory)
            return (_qualname(cls), items, extra, self.state(value))
        if isinstance(value, weakref.ref):  # its address is no content: what it points to
            target = value()
            return ("weakref", None if target is None else self.visit(target))
        state = self.state(value)
        if not state and not hasattr(value, "__dict__"):
            state = [("repr", repr(value)[:200])]  # a C-level value: Decimal, datetime
        observed = self.observed(value)
        if observed:
            state = [*state, ("observed", observed)]
        return ("object", _qualname(cls), state, self.main_class(cls, value))

    @staticmethod
    def answer(handle: Any) -> Any:
        """What an actor behind a handle answers to the first of ``ANSWERS`` it has (an
        actor without one is told by its class): which actor arrived."""
        for name in ANSWERS:
            method = getattr(handle, name, None)
            if method is not None:
                return (name, ray.get(method.remote(), timeout=60))
        return ("class", handle._ray_actor_creation_function_descriptor.class_name)

    def state(self, value: Any) -> Any:
        """Attributes (``__dict__`` in its order, which pickle keeps, then slots), as a
        by-value receiver sees them."""
        attrs = getattr(value, "__dict__", None)
        found = [] if not isinstance(attrs, dict) else list(attrs.items())
        for base in type(value).__mro__:
            slots = base.__dict__.get("__slots__", ())
            for name in (slots,) if isinstance(slots, str) else slots:
                if name not in ("__dict__", "__weakref__"):
                    found.append((name, getattr(value, name, "<unset>")))
        return [(name, self.visit(item)) for name, item in found]

    def main_class(self, cls: type, instance: Any = None) -> Any:
        """For a class sent by value: its plain class attributes, and what its ``probe``
        method (which reads a global of its module) returns."""
        if not _is_main(cls):
            return None
        attrs = sorted(
            (name, _atom(item))
            for name, item in vars(cls).items()
            if not name.startswith("__") and isinstance(item, _ATOMS)
        )
        probe = vars(cls).get("probe")
        return (attrs, None if probe is None else _atom(probe(instance)))

    def ndarray(self, arr: np.ndarray, index: int) -> Any:
        flags = arr.flags
        how = (
            arr.strides,
            bool(flags.c_contiguous),
            bool(flags.f_contiguous),
            bool(flags.writeable),
            bool(flags.aligned),
        )
        head = (
            "ndarray",
            _qualname(type(arr)),
            self.visit(arr.dtype),  # an object of its own: pickle's memo shares it
            arr.shape,
            *(how if self.layout else (None,) * len(how)),
        )
        if arr.dtype.hasobject:
            plain = arr.view(np.ndarray)
            body: Any = [self.visit(plain[i]) for i in np.ndindex(plain.shape)]
        else:
            body = _digest(_field_bytes(arr, "A" if self.layout else "C"))
            if arr.nbytes and self.layout:
                self.arrays.append((index, arr))
        return (*head, body, self.state(arr) if type(arr) is not np.ndarray else None)

    def tensor(self, t: Any, index: int) -> Any:
        import torch

        head = (
            "tensor",
            _qualname(type(t)),
            str(t.dtype),
            str(t.layout),
            tuple(map(_size, t.shape)),
            t.requires_grad,
            t.is_leaf,
            t.grad_fn is None,
            t.is_inference(),
        )
        state = self.state(t)
        if t.is_nested:
            return (*head, self.nested(t), state)
        if t.layout != torch.strided:
            if t.layout == torch.sparse_coo:
                indices, values = self.visit(t._indices()), self.visit(t._values())
                parts = (t.is_coalesced(), t._nnz(), indices, values)
                return (*head, parts, state)
            return (*head, repr(t), state)
        plain = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
        elements = plain.view(torch.uint8) if plain.dtype != torch.bool else plain.to(torch.uint8)
        content = _digest(elements.numpy().tobytes())
        if not self.layout:
            return (*head, None, (None, content, None), state, None)
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        shared = self.storages.setdefault(storage.data_ptr(), index) if nbytes else None
        layout = (
            t.stride(),
            t.storage_offset(),
            nbytes,
            t.is_contiguous(),
            t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last),
            t.is_conj(),
            t.is_neg(),
            None if t.is_inference() else t._version,
        )
        body = (self.storage_digest(storage), content, shared)
        return (*head, layout, body, state, tensor_state(t))

    def nested(self, t: Any) -> Any:
        """A nested tensor's parts: a jagged one's values, offsets, lengths, ragged dimension
        and cached sizes; a strided one's components."""
        import torch

        if t.layout != torch.jagged:
            return ("components", [self.visit(part) for part in t.unbind()])
        cache = getattr(t, "_metadata_cache", None) or {}
        return (
            "jagged",
            self.visit(t._values),
            self.visit(t._offsets),
            None if t._lengths is None else self.visit(t._lengths),
            t._ragged_idx,
            sorted((key, self.visit(item)) for key, item in cache.items()),
        )

    def storage_digest(self, storage: Any) -> str:
        """The digest of a storage's bytes, read once however many tensors view it (a
        consolidated batch is one storage under every tensor)."""
        key = (storage.data_ptr(), storage.nbytes())
        found = self.digests.get(key)
        if found is None:
            found = self.digests[key] = _digest(storage_bytes(storage))
        return found

    def observed(self, value: Any) -> Any:
        """What a batch class answers beyond its attributes (a TensorDict's size, device,
        lock and consolidation are read through its methods), where its class defines them."""
        found = []
        for name in OBSERVED:
            if inspect.getattr_static(type(value), name, None) is None:
                continue
            try:
                item = getattr(value, name)
                item = item() if callable(item) else item
            except Exception as error:
                found.append((name, ("raises", type(error).__name__)))
                continue
            found.append((name, repr(tuple(item) if name == "batch_size" else item)[:200]))
        return found

    def memory_sharing(self) -> list[tuple[int, int]]:
        """Which of the arrays visited share memory that one of them can write: a write
        through one would show through the other. (Read-only arrays of one buffer cannot
        tell; Ray gives those for one ref passed twice.)"""
        found = []
        for (i, a), (j, b) in itertools.combinations(self.arrays[:16], 2):
            if not (a.flags.writeable or b.flags.writeable):
                continue
            if np.may_share_memory(a, b) and np.shares_memory(a, b, max_work=10**6):
                found.append((i, j))
        return found


def storage_bytes(storage: Any) -> bytes:
    """``bytes(storage)``, read in one copy: ``bytes()`` iterates a storage one byte a Python
    call (seconds a MiB). A storage off the CPU is read as ``bytes()`` reads it."""
    import torch

    if storage.device.type != "cpu":
        return bytes(storage)
    whole: bytes = torch.empty(0, dtype=torch.uint8).set_(storage).numpy().tobytes()
    return whole


@functools.cache
def _tensor_attributes() -> tuple[str, ...]:
    """Every attribute torch defines on a tensor in C or as a property, found by rule (its
    data descriptors) rather than listed: what pickling may leave different."""
    import torch

    kinds = ("getset_descriptor", "member_descriptor", "property")
    return tuple(
        name
        for name in sorted(dir(torch.Tensor))
        if not name.startswith("__")
        and name not in ("_cdata", "volatile")  # an address; removed, and it warns
        and type(inspect.getattr_static(torch.Tensor, name)).__name__ in kinds
    )


def tensor_state(t: Any) -> list[tuple[str, Any]]:
    """Each of a tensor's attributes (see ``_tensor_attributes``): a tensor by its type (its
    content derives from the tensor's, described apart), what raises by the error's type,
    anything else by ``repr``; then its storage's attributes, size and resizability, and
    torch's metadata of it (its conjugate and negative bits)."""
    import torch

    found: list[tuple[str, Any]] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in _tensor_attributes():
            try:
                item = getattr(t, name)
            except Exception as error:
                found.append((name, ("raises", type(error).__name__)))
                continue
            is_tensor = isinstance(item, torch.Tensor)
            found.append((name, _qualname(type(item)) if is_tensor else repr(item)[:200]))
        try:
            storage = t.untyped_storage()
            attrs = sorted((k, repr(v)[:200]) for k, v in vars(storage).items())
            found.append(("storage", (attrs, storage.nbytes(), storage.resizable())))
        except Exception as error:
            found.append(("storage", ("raises", type(error).__name__)))
        found.append(("metadata", repr(torch._C._get_tensor_metadata(t))))
    return found


def describe_fully(value: Any) -> Any:
    """Everything a by-value receiver can observe of ``value``: types, dtypes (their pickle),
    layouts, flags, bytes, attributes, the state of classes sent by value, aliasing (an
    object reached twice, an array's dtype among them, is named by the index of its first
    visit) and memory shared
    between its arrays or tensors; nested refs by what ``ray.get`` gives, actor handles by
    what they answer."""
    describer = _Describer()
    return describer.visit(value), describer.memory_sharing()


def describe_content(value: Any) -> Any:
    """What ``value`` holds, as :func:`describe_fully` tells it, without how it is laid out
    (strides, flags, storage, torch's state, shared memory): for comparing what a worker
    received with the driver's own value, whose arrays are writable where the worker's are
    read-only."""
    describer = _Describer(layout=False)
    return describer.visit(value), None


def checksums(*values: Any) -> list[Any]:
    """Per value, described apart, what :func:`describe_content` tells of it (an array by its
    class, dtype, shape and a digest of its bytes): for large payloads, where a worker's
    read-only array is to be compared with the driver's writable one."""
    return [describe_content(value)[0] for value in values]


def fields(node: Any) -> dict[str, Any]:
    """The fields of one described array, tensor or object (a ``(index, body)`` node of a
    description), by the names in ``FIELDS``."""
    body = node[1]
    return dict(zip(FIELDS.get(body[0], ()), body, strict=False))


def class_of(node: Any) -> str:
    """The qualified class of one described value (a ``(index, body)`` node)."""
    body = node[1]
    return str(body[1] if body[0] in FIELDS else body[0])


def tensor_layout(node: Any) -> dict[str, Any]:
    """The layout of one described strided tensor, by the names in ``TENSOR_LAYOUT``."""
    return dict(zip(TENSOR_LAYOUT, node[1][9], strict=True))


def arguments(description: Any) -> tuple[list[Any], list[Any]]:
    """The described positional arguments and keyword items of a description of a call's
    ``(args, kwargs)``, as ``Probe.describe`` returns it."""
    args, kwargs = description[0][1][1]
    return args[1][1], kwargs[1][1]


#: Names of the fields of each kind of description, for readable differences.
FIELDS = {
    "ndarray": ("kind", "type", "dtype", "shape", "strides", "C-contiguous", "F-contiguous",
                "writeable", "aligned", "bytes or items", "attributes"),
    "tensor": ("kind", "type", "dtype", "layout", "shape", "requires_grad", "is_leaf",
               "no grad_fn", "is_inference", "strides etc. (sparse: indices, values)",
               "storage, elements, shared storage", "attributes", "torch state"),
    "object": ("kind", "class", "attributes", "class state"),
    "ObjectRef": ("kind", "same ref as", "content"),
    "ActorHandle": ("kind", "same actor as", "answer"),
    "scalar": ("kind", "type", "dtype", "bytes"),
    "type": ("kind", "name", "class state"),
}  # fmt: skip
DTYPE_FIELDS = ("repr", "pickle", "metadata", "isalignedstruct", "byteorder", "scalar type")
TENSOR_LAYOUT = ("stride", "storage_offset", "storage nbytes", "is_contiguous",
                 "channels_last", "is_conj", "is_neg", "_version")  # fmt: skip


def _field(node: Any, index: int) -> str:
    """The name of ``node[index]`` in a description."""
    tag = node[0] if node and isinstance(node[0], str) else None
    names = FIELDS.get(tag or "")
    if names is not None and index < len(names):
        return names[index]
    if len(node) == 6 and isinstance(node[0], str) and node[0].startswith("dtype("):
        return f"dtype.{DTYPE_FIELDS[index]}"
    if len(node) == 8 and isinstance(node[2], int) and isinstance(node[3], bool):
        return TENSOR_LAYOUT[index]
    return str(index)


def first_difference(a: Any, b: Any) -> tuple[str, str] | None:
    """Where two descriptions first differ: a label naming the field (``ndarray.dtype``,
    ``aliasing``) and a readable account of both sides; ``None`` when they are equal."""
    if a == b:
        return None
    path: list[str] = []
    label = "value"
    while isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if "same" in (a[:1] + b[:1]):
            label = "aliasing"  # one object reached twice on one side only
            break
        if len(a) != len(b):
            break
        index = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
        name = _field(a, index)
        if not name.isdigit():
            tag = a[0] if a and isinstance(a[0], str) and a[0] in FIELDS else None
            label = f"{tag}.{name}" if tag else name
            path.append(label)
        elif a and isinstance(a[0], str) and "." in a[0]:
            path.append(a[0].rpartition(".")[2])  # a container or object, by class
        a, b = a[index], b[index]
    where = " > ".join(path) or "top"
    return label, f"{label} (in {where}): by value {a!r:.500}\n    refshare {b!r:.500}"


# -- workers ---------------------------------------------------------------------------------


@ray.remote(num_cpus=0.05)
class Probe:
    """Describes what each call received; ``keep`` holds it, for a later ``kept``."""

    def __init__(self) -> None:
        self.held: Any = None

    def describe(self, *args: Any, **kwargs: Any) -> Any:
        return describe_fully((args, kwargs))

    def keep(self, *args: Any) -> bool:
        self.held = args
        return True

    def kept(self) -> Any:
        value, self.held = self.held, None
        return describe_fully(value)

    def ping(self) -> bool:
        return True


@ray.remote(num_cpus=0.01)
class Tagged:
    """An actor that answers its tag: what a worker finds behind an actor handle."""

    def __init__(self, tag: str) -> None:
        self._tag = tag

    def tag(self) -> str:
        return self._tag


# -- classes the values are made of (importable by the workers) ------------------------------


@dataclasses.dataclass
class Box:
    a: Any
    b: Any = None


@dataclasses.dataclass(frozen=True)
class FrozenBox:
    a: Any
    b: Any = None


class Plain:
    def __init__(self, a: Any, b: Any = None) -> None:
        self.a = a
        self.b = b


class Slotted:
    __slots__ = ("a", "b")

    def __init__(self, a: Any, b: Any = None) -> None:
        self.a = a
        self.b = b


class Batch(collections.UserDict):  # type: ignore[type-arg]
    """A ``UserDict`` batch, as NeMo-RL's ``BatchedDataDict``."""


class OwnPickling(dict):  # type: ignore[type-arg]
    """A dict whose pickling runs code of its own (as verl's ``DataProto``)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_own_pickling, (dict(self),))


def _own_pickling(items: dict[Any, Any]) -> OwnPickling:
    return OwnPickling(items)


_reductions = itertools.count()


class Counted:
    """Pickles to a new payload each time: the number of reductions so far, and its data."""

    def __init__(self, data: Any) -> None:
        self.data = data
        self.serial = -1

    def __reduce__(self) -> tuple[Any, ...]:
        return (_counted, (self.data, next(_reductions)))


def _counted(data: Any, serial: int) -> Counted:
    made = Counted(data)
    made.serial = serial
    return made


PROBE_SOURCE = "def probe(self):\n    return SCALE\n"


def main_class(name: str, kind: str, factor: Any, scale: Any) -> tuple[type, dict[str, Any]]:
    """A class that Ray's cloudpickle sends by value, as one defined in a script: its
    ``__module__`` is ``__main__``, its class attribute ``factor``, and its ``probe`` method
    returns the global ``SCALE`` of its own module globals (returned, to be changed)."""
    module_globals: dict[str, Any] = {"__name__": "__main__", "SCALE": scale}
    exec(PROBE_SOURCE, module_globals)
    namespace: dict[str, Any] = {
        "__module__": "__main__",
        "__qualname__": name,
        "factor": factor,
        "probe": module_globals["probe"],
    }
    if kind == "slots":
        namespace["__slots__"] = ("a", "b")
    if kind == "dataclass":
        namespace["__annotations__"] = {"a": Any, "b": Any}
        return dataclasses.dataclass(type(name, (), namespace)), module_globals
    cls = type(name, (), namespace)
    return cls, module_globals


def pickled_by_value(cls: type) -> bool:
    """Whether Ray's cloudpickle sends ``cls`` as code (with its state), not by name."""
    from ray import cloudpickle

    return not cloudpickle.cloudpickle._should_pickle_by_reference(cls)


# -- recipes: values described as data, so that each can be built afresh ----------------------


def _struct(fields: Any, **options: Any) -> np.dtype[Any]:
    return np.dtype(fields, **options)


PAIR = [("a", "u1"), ("b", "<i4")]
NP_DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(spec)
    for name, spec in {
        "u1": "u1", "<i2": "<i2", ">i4": ">i4", "<i8": "<i8", ">u8": ">u8", "<f2": "<f2",
        "<f4": "<f4", ">f4": ">f4", "<f8": "<f8", ">f8": ">f8", "<c8": "<c8", ">c16": ">c16",
        "?": "?", "<M8[s]": "<M8[s]", ">M8[ns]": ">M8[ns]", "<m8[ms]": "<m8[ms]",
        "<M8[10D]": "<M8[10D]", "<U3": "<U3", ">U2": ">U2", "S4": "S4", "V6": "V6",
    }.items()
}  # fmt: skip
NP_DTYPES.update(
    {
        "struct": _struct([("a", "<i4"), ("b", ">f8")]),
        "pair": _struct(PAIR),
        "pair_aligned": _struct(PAIR, align=True),
        "pair_record": np.dtype((np.record, PAIR)),
        "pair_meta": _struct(PAIR, metadata={"k": "v"}),
        "offsets": _struct(
            {"names": ["x", "y"], "formats": ["u1", "<i2"], "offsets": [0, 4], "itemsize": 8}
        ),
        "titles": _struct([(("title A", "a"), "<i2"), ("b", "u1")]),
        "subarray": _struct([("a", "<f4", (2,)), ("b", "u1")]),
        "nested": _struct([("a", [("x", "u1"), ("y", ">i2")]), ("b", "<f4")]),
        "packed": _struct([("a", "<i4"), ("b", "<f4")]),
        "packed_aligned": _struct([("a", "<i4"), ("b", "<f4")], align=True),
        "f4_unit_m": np.dtype("<f4", metadata={"unit": "m"}),
        "f4_unit_s": np.dtype("<f4", metadata={"unit": "s"}),
        "i8_meta": np.dtype("<i8", metadata={"a": 1}),
    }
)
OBJECT_DTYPES = {"O": np.dtype("O"), "O_vlen": np.dtype("O", metadata={"vlen": str})}
NUMERIC_KINDS = "biufcmM?"
TORCH_DTYPES = (
    "float32", "float64", "bfloat16", "float16", "int8", "uint8", "int64", "bool", "complex64",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Arr:
    """A numpy array: dtype name, shape, layout, fill seed and ndarray subclass."""

    dtype: str
    shape: tuple[int, ...]
    layout: str = "C"
    seed: int = 0
    sub: str = "ndarray"


@dataclasses.dataclass(frozen=True)
class ObjArr:
    """A numpy array of Python objects."""

    dtype: str
    items: tuple[Any, ...]
    shape: tuple[int, ...]
    layout: str = "C"


@dataclasses.dataclass(frozen=True)
class Tensor:
    """A torch tensor: dtype, shape, layout (or view) and how it was made."""

    dtype: str
    shape: tuple[int, ...]
    layout: str = "C"
    mode: str = "plain"
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class Big:
    """A value above 100 KiB (Ray's inline limit): array, F-order array, tensor or strings."""

    kind: str
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class Atom:
    value: Any


@dataclasses.dataclass(frozen=True)
class Buf:
    """A ``bytearray``, or a ``memoryview`` of one (``cast`` to ``format``) or of bytes."""

    kind: str
    size: int = 8
    seed: int = 0
    format: str = "B"


@dataclasses.dataclass(frozen=True)
class Node:
    """A container or object of a known class holding ``children`` (under ``keys``)."""

    kind: str
    children: tuple[Any, ...] = ()
    keys: tuple[Any, ...] = ()


@dataclasses.dataclass(frozen=True)
class Main:
    """An instance of a class made "in ``__main__``", sent by value with its class."""

    kind: str
    children: tuple[Any, ...]
    factor: Any = 1
    scale: Any = 1


@dataclasses.dataclass(frozen=True)
class Same:
    """The object completed ``index``-th (modulo how many were): one object reached twice."""

    index: int


@dataclasses.dataclass(frozen=True)
class Cycle:
    """A container still being built, that this one sits in (modulo the depth): a cycle."""

    index: int


@dataclasses.dataclass(frozen=True)
class View:
    """A view of the array or tensor built ``index``-th, next to it in the value."""

    index: int


@dataclasses.dataclass(frozen=True)
class Ref:
    """An ``ObjectRef`` of the child, put when the value is built."""

    child: Any


@dataclasses.dataclass(frozen=True)
class Actor:
    """One of the suite's ``Tagged`` actors."""

    index: int


Mutation = tuple[str, Callable[[], None]]


class Built:
    """A value built from a recipe, with the changes in place that can be made to it."""

    def __init__(self, value: Any, sites: list[Mutation]) -> None:
        self.value = value
        self.sites = sites

    def mutate(self, choice: int | None) -> str | None:
        """Make the ``choice``-th change (modulo the number there are); its name."""
        if choice is None or not self.sites:
            return None
        name, change = self.sites[choice % len(self.sites)]
        change()
        return name


def _rng_bytes(seed: int, nbytes: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def _filled(dtype: np.dtype[Any], shape: tuple[int, ...], seed: int) -> np.ndarray:
    """A writable array of ``dtype`` (kept as it is, metadata and all) with seeded bytes."""
    count = int(np.prod(shape, dtype=np.int64))
    arr = np.empty(shape, dtype=dtype)
    if dtype.kind == "U":
        points = np.random.default_rng(seed).integers(32, 0x3000, count * dtype.itemsize // 4)
        raw = points.astype(">u4" if dtype.byteorder == ">" else "<u4").view(np.uint8)
    else:
        raw = np.frombuffer(_rng_bytes(seed, count * dtype.itemsize), dtype=np.uint8)
        raw = raw % 2 if dtype.kind == "b" else raw
    if count:
        arr.reshape(-1).view(np.uint8)[:] = raw
    return arr


def _flip_top_byte(arr: np.ndarray) -> None:
    """Change element 0 of ``arr`` in place: its most significant byte (the sign or exponent
    of a float), not only its lowest one. A read-only array that owns its memory is made
    writeable for the change and read-only again, as its owner may."""
    locked = not arr.flags.writeable
    if locked:
        arr.setflags(write=True)
    try:
        plain = arr.view(np.ndarray)
        while plain.dtype.names:  # a byte of its first field, not of padding
            plain = plain[plain.dtype.names[0]]
        corner = plain[(slice(0, 1),) * plain.ndim] if plain.ndim else plain[np.newaxis]
        raw = corner.view(np.uint8).reshape(-1)
        top = raw.size - 1 if plain.dtype.byteorder != ">" else 0
        raw[top] ^= 0x01 if plain.dtype.kind == "b" else 0x40
    finally:
        if locked:
            arr.setflags(write=False)


class Builder:
    """Builds a recipe into a value, deterministically, recording where it can change."""

    def __init__(self, actors: list[Any]) -> None:
        self.actors = actors
        self.done: list[Any] = []  # objects completed, in order
        self.open: list[Any] = []  # containers being filled, outermost first
        self.leaves: list[tuple[Any, Any]] = []  # (array or tensor, the base it views)
        self.sites: list[Mutation] = []
        self.classes = 0
        self.fresh = itertools.count()
        self.collecting = True

    def build(self, recipe: Any) -> Built:
        value = self.make(recipe)
        return Built(value, self.sites)

    def site(self, name: str, change: Callable[[], None]) -> None:
        if self.collecting:
            self.sites.append((name, change))

    def changed(self) -> str:
        return f"changed-{next(self.fresh)}"

    def make(self, recipe: Any) -> Any:
        kind = type(recipe)
        if kind is Atom:
            return recipe.value
        if kind is Arr:
            return self.array(recipe)
        if kind is ObjArr:
            return self.object_array(recipe)
        if kind is Tensor:
            return self.tensor(recipe)
        if kind is Big:
            return self.big(recipe)
        if kind is Buf:
            return self.buffer(recipe)
        if kind is Node:
            return self.node(recipe)
        if kind is Main:
            return self.main(recipe)
        if kind is Same:
            return self.done[recipe.index % len(self.done)] if self.done else None
        if kind is Cycle:
            return self.open[recipe.index % len(self.open)] if self.open else None
        if kind is View:
            return self.view(recipe.index)
        if kind is Ref:
            collecting, self.collecting = self.collecting, False
            try:
                inner = self.make(recipe.child)  # its content is fixed once put
                return ray.put([inner] if isinstance(inner, ray.ObjectRef) else inner)
            finally:
                self.collecting = collecting
        if kind is Actor:
            return self.actors[recipe.index % len(self.actors)]
        raise TypeError(f"not a recipe: {recipe!r}")

    @contextlib.contextmanager
    def filling(self, container: Any) -> Iterator[Any]:
        """While ``container``'s items are made, they may refer back to it (a cycle)."""
        self.open.append(container)
        try:
            yield container
        finally:
            self.open.pop()
        self.keep(container)

    def keep(self, value: Any, base: Any = None) -> Any:
        self.done.append(value)
        torch = _torch()
        if isinstance(value, np.ndarray) or (torch is not None and isinstance(value, torch.Tensor)):
            self.leaves.append((value, value if base is None else base))
        return value

    # numpy

    def array(self, recipe: Arr) -> np.ndarray:
        dtype = NP_DTYPES[recipe.dtype]
        base = _filled(dtype, recipe.shape, recipe.seed)
        arr, writable = self.array_layout(base, recipe.layout)
        sub = recipe.sub
        if sub == "recarray":
            arr = arr.view(np.recarray)
        elif sub == "matrix" and arr.ndim == 2 and dtype.kind in NUMERIC_KINDS and not dtype.names:
            arr = arr.view(np.matrix)
        elif sub == "masked" and dtype.kind in NUMERIC_KINDS and not dtype.names:
            mask = np.frombuffer(_rng_bytes(recipe.seed + 1, arr.size), np.uint8) % 3 == 0
            fill = arr.flat[0] if arr.size else None
            arr = np.ma.MaskedArray(arr, mask=mask.reshape(arr.shape), fill_value=fill)
            masked, data = arr, writable if writable is not None else arr.data
            if arr.size:
                self.site("masked data", lambda: _flip_top_byte(data))
                self.site("masked mask", lambda: masked.mask.reshape(-1).__setitem__(0, True))
            return self.keep(arr, base)
        if arr.size:
            target = writable if writable is not None else arr
            self.site(f"array {recipe.dtype} {recipe.layout}", lambda: _flip_top_byte(target))
        return self.keep(arr, base)

    @staticmethod
    def array_layout(base: np.ndarray, layout: str) -> tuple[np.ndarray, np.ndarray | None]:
        """The array in ``layout``, and the array to write to for a change in place (itself,
        or for a read-only one its writable base; ``None`` for itself)."""
        if layout == "F":
            return np.asfortranarray(base), None
        if base.ndim == 0:
            if layout == "ro":
                view = base.view()
                view.setflags(write=False)
                return view, base
            return base, None
        if layout == "T":
            return base.T, None
        if layout == "step":
            return base[::2], None
        if layout == "rev":
            return base[::-1], None
        if layout == "offset":
            return base[1:], None
        if layout == "bcast":
            return np.broadcast_to(base, (2, *base.shape)), base
        if layout == "0d" and base.size:
            return base.reshape(-1)[:1].reshape(()), None
        if layout == "ro":
            view = base.view()
            view.setflags(write=False)
            return view, base
        if layout == "ro_own":
            base.setflags(write=False)
            return base, base
        return base, None

    def object_array(self, recipe: ObjArr) -> np.ndarray:
        count = int(np.prod(recipe.shape, dtype=np.int64))
        arr = np.empty(recipe.shape, dtype=OBJECT_DTYPES[recipe.dtype])
        flat = [recipe.items[i % len(recipe.items)] if recipe.items else None for i in range(count)]
        for i, index in enumerate(np.ndindex(arr.shape)):
            arr[index] = flat[i]
        arr, _ = self.array_layout(arr, recipe.layout)
        if arr.size and arr.flags.writeable:
            target = arr
            corner = (0,) * arr.ndim

            def change() -> None:
                target[corner] = self.changed()

            self.site(f"object array {recipe.layout}", change)
        return self.keep(arr)

    # torch

    def tensor(self, recipe: Tensor) -> Any:
        try:
            import torch
        except ImportError:
            return None  # the torch cases are skipped
        dtype = getattr(torch, recipe.dtype)
        inference = recipe.mode == "inference"
        context = torch.inference_mode() if inference else torch.no_grad()
        with context:
            root = self.tensor_root(dtype, recipe.shape, recipe.seed)
            t = self.tensor_layout(root, recipe.layout)
        if t.layout == torch.strided and recipe.mode in ("grad", "param") and t.is_floating_point():
            t = torch.nn.Parameter(t) if recipe.mode == "param" else t.requires_grad_()
        elif recipe.mode == "attr":
            t.note = "an attribute"
        self.tensor_sites(t, root, recipe, inference)
        return self.keep(t, root)

    @staticmethod
    def tensor_root(dtype: Any, shape: tuple[int, ...], seed: int) -> Any:
        import torch

        generator = torch.Generator().manual_seed(seed)
        if dtype == torch.bool:
            return torch.randint(0, 2, shape, generator=generator).bool()
        if dtype.is_floating_point or dtype.is_complex:
            return (torch.rand(shape, generator=generator, dtype=torch.float64) * 4 - 2).to(dtype)
        return torch.randint(-100, 100, shape, generator=generator).to(dtype)

    @staticmethod
    def tensor_layout(root: Any, layout: str) -> Any:
        import torch

        dims = root.dim()
        if layout == "slice" and dims and root.shape[0] > 1:
            return root[1:]
        if layout == "T" and dims >= 2:
            return root.transpose(0, dims - 1)
        if layout == "channels_last" and dims == 4:
            return root.contiguous(memory_format=torch.channels_last)
        if layout == "expand":
            return root.unsqueeze(0).expand(2, *root.shape)
        if layout == "conj" and root.is_complex():
            return root.conj()
        if layout == "neg" and (root.is_floating_point() or root.is_complex()):
            return torch._neg_view(root)
        if layout == "sparse" and dims and root.dtype != torch.bool:
            return root.to_sparse()
        return root

    def tensor_sites(self, t: Any, root: Any, recipe: Tensor, inference: bool) -> None:
        import torch

        if t.numel() == 0:
            return
        context = torch.inference_mode if inference else torch.no_grad
        if t.layout != torch.strided:

            def change_values() -> None:
                with context():
                    values = t._values()
                    values[0] = values[0] + 1 if values.dtype != torch.bool else ~values[0]

            self.site(f"sparse values {recipe.dtype}", change_values)
            return
        # Through a numpy view of its storage (torch's version counter does not see it).
        element = t.element_size()
        offset = t.storage_offset() * element
        top = offset + element - 1

        def through_numpy() -> None:
            with context():
                raw = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).numpy()
                raw[top] ^= 0x01 if t.dtype == torch.bool else 0x40

        self.site(f"tensor {recipe.dtype} {recipe.layout} {recipe.mode} via numpy", through_numpy)
        target = root if recipe.layout == "expand" else t
        corner = (0,) * target.dim()

        def through_torch() -> None:
            with context():
                if target.dtype == torch.bool:
                    target[corner] = ~target[corner]
                else:
                    target[corner] = target[corner] + 1

        self.site(f"tensor {recipe.dtype} {recipe.layout} {recipe.mode} in torch", through_torch)

    # big values

    def big(self, recipe: Big) -> Any:
        seed = recipe.seed
        if recipe.kind == "strings":
            strings = [f"uid-{seed}-{i:07d}-" + "x" * 30 for i in range(3000)]
            arr = np.array(strings, dtype=object)
            self.site("big strings", lambda: arr.__setitem__(0, self.changed()))
            return self.keep(arr)
        torch = _torch()
        if recipe.kind == "tensor" and torch is not None:
            t = self.tensor_root(torch.float32, (40_000,), seed)
            self.tensor_sites(t, t, Tensor("float32", tuple(t.shape)), inference=False)
            return self.keep(t)
        arr = _filled(NP_DTYPES["<f8"], (160, 128), seed)
        if recipe.kind == "f_array":
            arr = np.asfortranarray(arr)
        target = arr
        self.site(f"big {recipe.kind}", lambda: _flip_top_byte(target))
        return self.keep(arr)

    def buffer(self, recipe: Buf) -> Any:
        raw = bytearray(_rng_bytes(recipe.seed, recipe.size))
        if recipe.kind == "bytes_view":
            return self.keep(memoryview(bytes(raw)))
        if raw:
            self.site(f"{recipe.kind} byte", lambda: raw.__setitem__(0, raw[0] ^ 0x40))
        if recipe.kind == "bytearray":
            return self.keep(raw)
        view = memoryview(raw)
        if recipe.format != "B" and recipe.size % struct.calcsize(recipe.format) == 0:
            view = view.cast(recipe.format)
        return self.keep(view)

    # containers and objects

    def node(self, recipe: Node) -> Any:
        kind, children, keys = recipe.kind, recipe.children, recipe.keys
        if kind in ("set", "frozenset"):
            made = (set if kind == "set" else frozenset)(keys)
            return self.keep(made)
        if kind in ("tuple", "frozenbox"):
            items = [self.make(child) for child in children]
            made = tuple(items) if kind == "tuple" else FrozenBox(*[*items, None][:2])
            return self.keep(made)
        if kind == "list":
            with self.filling([]) as out:
                out.extend(self.make(child) for child in children)
            if out:
                self.site("list item", lambda: out.__setitem__(0, self.changed()))
            return out
        if kind in ("dict", "odict", "defaultdict", "own", "batch"):
            mapping: Any = {
                "dict": dict,
                "odict": collections.OrderedDict,
                "defaultdict": lambda: collections.defaultdict(list),
                "own": OwnPickling,
                "batch": Batch,
            }[kind]()
            # A wrapper whose pickling copies itself cannot hold itself: no cycle through it.
            with self.filling(mapping) if kind != "own" else contextlib.nullcontext():
                for key, child in zip(keys, children, strict=False):
                    mapping[key] = self.make(child)
            if kind == "own":
                self.keep(mapping)
            if kind == "odict" and len(mapping) > 1:
                mapping.move_to_end(next(iter(mapping)))
            if mapping:
                first = next(iter(mapping))
                self.site(f"{kind} entry", lambda: mapping.__setitem__(first, self.changed()))
            return mapping
        cls = {"box": Box, "plain": Plain, "slotted": Slotted}[kind]
        obj = cls.__new__(cls)
        with self.filling(obj):
            items = [self.make(child) for child in children[:2]]
            items += [None] * (2 - len(items))
            obj.a, obj.b = items
        self.site(f"{kind} attribute", lambda: setattr(obj, "a", self.changed()))
        return obj

    def main(self, recipe: Main) -> Any:
        self.classes += 1
        cls, module_globals = main_class(
            f"Main{self.classes}", recipe.kind, recipe.factor, recipe.scale
        )
        self.site("__main__ class attribute", lambda: setattr(cls, "factor", self.changed()))
        self.site("__main__ global", lambda: module_globals.__setitem__("SCALE", self.changed()))
        if recipe.kind == "type":
            return self.keep(cls)  # the class itself, sent by value
        obj = cls.__new__(cls)
        with self.filling(obj):
            items = [self.make(child) for child in recipe.children[:2]]
            items += [None] * (2 - len(items))
            obj.a, obj.b = items
        self.site("__main__ attribute", lambda: setattr(obj, "a", self.changed()))
        return obj

    def view(self, index: int) -> Any:
        if not self.leaves:
            return None
        leaf, _ = self.leaves[index % len(self.leaves)]
        if isinstance(leaf, np.ndarray):
            view = leaf[1:] if leaf.ndim and leaf.shape[0] > 1 else leaf[...]
            return self.keep(view)
        if leaf.layout != _torch().strided:
            return leaf
        view = leaf[1:] if leaf.dim() and leaf.shape[0] > 1 else leaf.view(leaf.shape)
        return self.keep(view) if not (view.requires_grad and not view.is_leaf) else leaf


def build(recipe: Any, actors: list[Any]) -> Built:
    """Build ``recipe`` afresh."""
    return Builder(actors).build(recipe)
