"""What a receiver has of a value: one canonical description of a received object graph.

Verify mode compares two received copies of an argument, what Ray by value gives and what
refshare's stored object gives, by this description (see ``refshare._verify``). It reads
objects as they are: a class's pickling code never runs, but that of Python's standard
library, numpy and torch, whose reductions only read. An object whose state it cannot read
so is :class:`CannotDescribe`, and verify then fails closed.

It imports nothing of refshare: Ray ships it by value to the workers (``verify="worker"``).
"""

from __future__ import annotations

import hashlib
import marshal
import sys
import types
import warnings
from collections import OrderedDict, defaultdict
from typing import Any, NamedTuple

#: Packages whose classes' reductions are read to describe their objects: they only read.
TRUSTED = frozenset(sys.stdlib_module_names) | {"numpy", "torch"}
#: What pickle calls to reduce an object; defined outside :data:`TRUSTED`, never run here.
HOOKS = ("__reduce_ex__", "__reduce__", "__getstate__", "__getnewargs_ex__", "__getnewargs__")
_HEAPTYPE = 1 << 9
_SHORT = 64  # atoms longer than this are described by their digest


class CannotDescribe(Exception):
    """An object whose state cannot be read without running code verify must not run."""


class Description(NamedTuple):
    """A digest of what a receiver has, and (``paths``) each token with where it lies."""

    digest: bytes
    tokens: list[tuple[str, tuple[Any, ...]]] | None


def describe(value: Any, paths: bool = False) -> Description:
    """The description of ``value`` as received; raises :class:`CannotDescribe` (or what
    reading it raised) where it cannot be described."""
    describer = _Describer(paths)
    describer.visit(value, "value")
    describer.finish()
    return Description(describer.hasher.digest(), describer.tokens)


def first_difference(expected: Description, got: Description) -> str:
    """Where two descriptions made with ``paths`` first differ, readably."""
    a, b = expected.tokens or [], got.tokens or []
    for (where, x), (_, y) in zip(a, b, strict=False):
        if x != y:
            return f"at {where}: by value {x!r:.300}, refshare {y!r:.300}"
    longer, side = (a, "by value") if len(a) > len(b) else (b, "refshare")
    where, token = longer[min(len(a), len(b))] if longer else ("value", ())
    return f"at {where}: only {side} has {token!r:.300}"


def _new_hasher() -> Any:
    try:
        import xxhash
    except ImportError:  # a worker without it: both sides are described in one process
        return hashlib.blake2b(digest_size=16)
    return xxhash.xxh3_128()


def _digest(data: Any) -> str:
    hasher = _new_hasher()
    hasher.update(data)
    return str(hasher.hexdigest())


def _name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', '?')}"


def _text(tag: str, value: Any, data: bytes) -> tuple[Any, ...]:
    return (tag, value) if len(data) <= _SHORT else (tag, len(data), _digest(data))


_ATOMS: dict[type, Any] = {
    type(None): lambda x: ("None",),
    bool: lambda x: ("bool", x),
    int: lambda x: ("int", x),
    float: lambda x: ("float", x.hex()),
    complex: lambda x: ("complex", x.real.hex(), x.imag.hex()),
    str: lambda x: _text("str", x, x.encode("utf-8", "surrogatepass")),
    bytes: lambda x: _text("bytes", x, x),
}
#: Builtin bases whose part of an instance is read directly (a subclass adds attributes).
_BASES = (OrderedDict, defaultdict, dict, list, tuple, set, frozenset, str, bytes, int, float,
          complex, bytearray, BaseException)  # fmt: skip


def _package(obj: Any) -> str:
    return str(getattr(obj, "__module__", None) or "").partition(".")[0]


def _hook_package(hook: Any, owner: type) -> str:
    """The package whose code a hook runs: a Python function's by its globals (a wrapper
    copies ``__module__``, not those), a C method's by its class."""
    function = getattr(hook, "__func__", hook)
    globals_ = getattr(function, "__globals__", None)
    if isinstance(globals_, dict):
        return str(globals_.get("__name__") or "").partition(".")[0]
    return _package(owner)


def _trusted(cls: type) -> bool:
    """Whether ``cls`` and each pickling hook it resolves are of a trusted package."""
    if _package(cls) not in TRUSTED:
        return False
    for hook in HOOKS:
        for base in cls.__mro__:
            if hook in base.__dict__:
                if base is not object and _hook_package(base.__dict__[hook], base) not in TRUSTED:
                    return False
                break
    return True


def _python_layout(cls: type, stop: type) -> bool:
    """Whether each class from ``cls`` down to ``stop`` adds to an instance nothing but its
    ``__dict__``, weak references and slots: no state that only C code can read."""
    while cls is not stop and cls is not object:
        base = cls.__base__
        assert base is not None
        if cls.__basicsize__ != base.__basicsize__ or cls.__itemsize__ != base.__itemsize__:
            if not cls.__flags__ & _HEAPTYPE:
                return False
            slots = sum(type(v) is types.MemberDescriptorType for v in vars(cls).values())
            if not 0 <= cls.__basicsize__ - base.__basicsize__ - 8 * slots <= 16:
                return False
        cls = base
    return True


def _slot_names(cls: type) -> list[tuple[type, str]]:
    found = []
    for base in cls.__mro__:
        slots = base.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__"):
                mangled = f"_{base.__name__.lstrip('_')}{name}" if name.startswith("__") else name
                found.append((base, mangled))
    return found


class _Describer:
    """One pass: an object reached twice is named by its first visit; the digest covers
    a token stream that delimits every object, so no two graphs give one stream."""

    def __init__(self, paths: bool = False) -> None:
        self.hasher = _new_hasher()
        self.tokens: list[tuple[str, tuple[Any, ...]]] | None = [] if paths else None
        self.trail: list[Any] = []
        self.first: dict[int, int] = {}
        self.held: list[Any] = []  # what was visited: no id is recycled during the pass
        self.storages: dict[int, int] = {}
        self.regions: list[tuple[int, int, int, bool, Any]] = []
        self.dtypes: dict[int, str] = {}
        self.trust: dict[type, bool] = {}

    def emit(self, *token: Any) -> None:
        self.hasher.update(repr(token).encode("utf-8", "surrogatepass") + b"\n")
        if self.tokens is not None:
            where = "".join(x if isinstance(x, str) else f"[{x[0]!r}]" for x in self.trail)
            self.tokens.append((where, token))

    def visit(self, obj: Any, label: Any) -> None:
        self.trail.append(label)
        try:
            atom = _ATOMS.get(type(obj))
            if atom is not None:
                self.emit(*atom(obj))
                return
            index = self.first.get(id(obj))
            if index is not None:
                self.emit("same", index)
                return
            index = self.first[id(obj)] = len(self.held)
            self.held.append(obj)
            self.body(obj, type(obj), index)
        finally:
            self.trail.pop()

    def items(self, items: Any) -> None:
        items = list(items)
        self.emit("items", len(items))
        for i, item in enumerate(items):
            self.visit(item, (i,))

    def pairs(self, pairs: Any) -> None:
        pairs = list(pairs)
        self.emit("pairs", len(pairs))
        for key, item in pairs:
            self.visit(key, ".key")
            self.visit(item, (key,) if type(key) in _ATOMS else "[...]")

    def multiset(self, items: Any) -> None:
        """A set's members in an order of their content: its own order follows hashes,
        which for identity-hashed objects are addresses."""
        items = list(items)
        order = sorted(range(len(items)), key=lambda i: self.standalone(items[i]))
        self.emit("members", len(items))
        for i in order:
            self.visit(items[i], "{member}")

    @staticmethod
    def standalone(item: Any) -> bytes:
        alone = _Describer()
        alone.visit(item, "")
        return bytes(alone.hasher.digest())

    def body(self, obj: Any, cls: type, index: int) -> None:
        numpy, torch = sys.modules.get("numpy"), sys.modules.get("torch")
        if cls is list or cls is tuple:
            self.emit(cls.__name__)
            self.items(obj)
        elif cls is dict:
            self.emit("dict")
            self.pairs(dict.items(obj))
        elif cls is set or cls is frozenset:
            self.emit(cls.__name__)
            self.multiset(obj)
        elif numpy is not None and isinstance(obj, numpy.generic):
            self.emit("scalar", _name(cls))
            self.array(numpy.asarray(obj), index)
        elif numpy is not None and isinstance(obj, numpy.ndarray):
            self.emit("ndarray", _name(cls))
            plain = obj if cls is numpy.ndarray else numpy.ndarray.view(obj, numpy.ndarray)
            self.array(plain, index)
            self.state(obj, cls)
        elif torch is not None and isinstance(obj, torch.Tensor):
            self.emit("tensor", _name(cls))
            nested = self.tensor(obj, index)
            # A nested tensor's sizes hold its ragged dimension's id, new in each process's
            # each unpickling: its parts say what it holds.
            self.state(obj, cls, ("_size", "_strides") if nested else ())
        elif isinstance(obj, type):
            self.emit("type", _name(obj))
        elif cls is types.FunctionType:
            self.function(obj)
        elif cls is types.BuiltinFunctionType:
            self.emit("builtin", _name(obj))
            if not isinstance(obj.__self__, types.ModuleType | None):
                self.visit(obj.__self__, ".__self__")
        elif cls is types.ModuleType:
            self.emit("module", obj.__name__)
        elif not self.ray_handle(obj, cls):
            self.instance(obj, cls)

    def ray_handle(self, obj: Any, cls: type) -> bool:
        """An ``ObjectRef`` or an actor handle, by what it names."""
        ray = sys.modules.get("ray")
        if ray is None:
            return False
        if isinstance(obj, ray.ObjectRef):
            self.emit("ObjectRef", _name(cls), obj.binary().hex())
        elif isinstance(obj, ray.actor.ActorHandle):
            self.emit("ActorHandle", obj._actor_id.hex())
        else:
            return False
        return True

    def function(self, f: Any) -> None:
        self.emit("function", _name(f), _digest(marshal.dumps(f.__code__)))
        self.visit(f.__defaults__, "__defaults__")
        self.visit(f.__kwdefaults__, "__kwdefaults__")
        cells = f.__closure__ or ()
        self.emit("closure", len(cells))
        for i, cell in enumerate(cells):
            try:
                content = cell.cell_contents
            except ValueError:
                self.emit("empty cell")
            else:
                self.visit(content, f"<cell {i}>")
        self.visit(f.__dict__, "__dict__")

    def instance(self, obj: Any, cls: type) -> None:
        base = next((b for b in cls.__mro__ if b in _BASES), object)
        try:
            attributes = object.__getattribute__(obj, "__dict__")
        except AttributeError:
            attributes = {}
        hooked = any(name in attributes for name in HOOKS)
        trusted = self.trust.get(cls)
        if trusted is None:
            trusted = self.trust[cls] = _trusted(cls)
        if trusted and not hooked:
            self.reduced(obj, cls)
            return
        if not _python_layout(cls, base):
            raise CannotDescribe(f"{_name(cls)} holds state only its own pickling reads")
        self.emit("object", _name(cls), base.__name__)
        if base is not object:
            self.base_part(obj, base)
        self.state(obj, cls)

    def reduced(self, obj: Any, cls: type) -> None:
        """An object of a trusted class, by its own reduction (which only reads)."""
        try:
            reduce_ex: Any = cls.__reduce_ex__
            reduction = reduce_ex(obj, 4)
        except Exception as error:
            raise CannotDescribe(f"{_name(cls)}: {error}") from error
        if isinstance(reduction, str):
            self.emit("global", _name(cls), reduction)
            return
        self.emit("reduced", _name(cls), len(reduction))
        for i, part in enumerate(reduction):
            if i in (3, 4) and part is not None:
                part = list(part)  # iterators of list items and dict items
            self.visit(part, f"<reduce {i}>")

    def base_part(self, obj: Any, base: Any) -> None:
        """The part of ``obj`` its builtin ``base`` holds, read through the base's methods."""
        if issubclass(base, dict):
            self.pairs(base.items(obj))
            if base is defaultdict:
                self.visit(vars(defaultdict)["default_factory"].__get__(obj), "default_factory")
        elif base in (list, tuple):
            self.items(base.__iter__(obj))
        elif base in (set, frozenset):
            self.multiset(base.__iter__(obj))
        elif base is bytearray:
            self.emit("bytearray", len(obj), _digest(memoryview(obj)))
        elif base is BaseException:
            self.visit(vars(BaseException)["args"].__get__(obj), "args")
        else:
            self.visit(base.__getnewargs__(obj)[0], "value")

    def state(self, obj: Any, cls: type, skip: tuple[str, ...] = ()) -> None:
        """An instance's ``__dict__`` and slots, read without running its code."""
        try:
            attributes = object.__getattribute__(obj, "__dict__")
        except AttributeError:
            attributes = None
        if attributes:
            self.emit("attributes")
            self.pairs((k, v) for k, v in dict.items(attributes) if k not in skip)
        for owner, name in _slot_names(cls):
            slot = owner.__dict__.get(name)
            if type(slot) is not types.MemberDescriptorType:
                continue
            try:
                value = slot.__get__(obj, cls)
            except AttributeError:
                self.emit("unset slot", name)
                continue
            self.emit("slot", name)
            self.visit(value, f".{name}")

    # -- arrays and tensors ---------------------------------------------------------------

    def array(self, arr: Any, index: int) -> None:
        """A plain ndarray view: layout, the flags a receiver has, dtype by value, content."""
        self.held.append(arr)  # a view made here: its address is not recycled in the pass
        flags = arr.flags
        self.emit("layout", arr.shape, arr.strides, flags.writeable, flags.aligned,
                  flags.c_contiguous, flags.f_contiguous)  # fmt: skip
        self.dtype(arr.dtype)
        self.content(arr)
        if not arr.dtype.hasobject and arr.nbytes:
            numpy = sys.modules["numpy"]
            low, high = numpy.lib.array_utils.byte_bounds(arr)
            self.regions.append((low, high, index, bool(flags.writeable), arr))

    def dtype(self, dtype: Any) -> None:
        """A dtype by value (all of it: metadata, byte order, fields), through its own
        reduction; arrays unpickled apart have equal dtypes that are not one object."""
        found = self.dtypes.get(id(dtype))
        if found is None:
            alone = _Describer()
            alone.visit(dtype, "")
            found = self.dtypes[id(dtype)] = alone.hasher.hexdigest()
            self.held.append(dtype)
        self.emit("dtype", str(dtype), found)

    def content(self, arr: Any) -> None:
        """An array's elements: field by field (padding is no content), Python objects one
        by one, else its bytes through a uint8 view (datetime64 has no buffer of its own)."""
        numpy = sys.modules["numpy"]
        dtype = arr.dtype
        if dtype.names is not None:
            for name in dtype.names:
                self.emit("field", name)
                self.content(arr[name])
        elif dtype.hasobject:
            self.emit("elements", arr.size)
            for i, item in enumerate(arr.reshape(-1)):
                self.visit(item, (i,))
        elif not arr.nbytes:
            self.emit("bytes", 0)
        else:
            flags = arr.flags
            flat = arr if flags.c_contiguous else arr.T if flags.f_contiguous else None
            flat = numpy.ascontiguousarray(arr) if flat is None else flat
            self.emit("bytes", arr.nbytes, _digest(flat.reshape(-1).view(numpy.uint8)))

    def tensor(self, t: Any, index: int) -> bool:
        """A tensor as torch's own code reads it (a subclass's ``__torch_function__`` does
        not run); whether it is nested."""
        torch = sys.modules["torch"]
        with torch._C.DisableTorchFunctionSubclass(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.emit("tensor", str(t.dtype), str(t.layout), str(t.device), t.requires_grad,
                      t.is_leaf, t.is_inference())  # fmt: skip
            if t.is_quantized:
                self.quantized(t)
            elif t.is_nested:
                parts = t.unbind()
                self.emit("nested", len(parts))
                for part in parts:
                    self.elements(part)
            elif t.layout == torch.strided:
                self.strided(t, index)
            else:
                self.sparse(t)
            self.visit(torch._C.TensorBase.grad.__get__(t), ".grad")
            self.visit(t._backward_hooks, "._backward_hooks")
            return bool(t.is_nested)

    def strided(self, t: Any, index: int) -> None:
        """A strided tensor: its layout and its whole storage, as torch's pickling sends it."""
        torch = sys.modules["torch"]
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        start = storage.data_ptr()
        shared = self.storages.setdefault(start, index) if nbytes else None
        version = None if t.is_inference() else t._version
        self.emit("strided", tuple(t.shape), t.stride(), t.storage_offset(), nbytes,
                  t.is_conj(), t.is_neg(), version, shared)  # fmt: skip
        if storage.device.type != "cpu":
            storage = storage.cpu()
        data = torch.empty(0, dtype=torch.uint8).set_(storage).numpy() if nbytes else b""
        self.emit("storage", _digest(data))
        if nbytes and shared == index:
            self.regions.append((start, start + nbytes, index, True, None))

    def elements(self, t: Any) -> None:
        """A tensor's elements and shape alone (a part of a nested or quantized one)."""
        torch = sys.modules["torch"]
        plain = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
        data = plain.view(torch.uint8).numpy() if plain.numel() else b""
        self.emit("elements", str(t.dtype), tuple(t.shape), t.stride(), _digest(data))

    def quantized(self, t: Any) -> None:
        torch = sys.modules["torch"]
        scheme = t.qscheme()
        self.emit("quantized", str(scheme), tuple(t.shape), t.stride(), t.storage_offset())
        if scheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            self.emit("qparams", float(t.q_scale()).hex(), int(t.q_zero_point()))
        elif scheme in (torch.per_channel_affine, torch.per_channel_symmetric,
                        torch.per_channel_affine_float_qparams):  # fmt: skip
            self.emit("axis", t.q_per_channel_axis())
            self.elements(t.q_per_channel_scales())
            self.elements(t.q_per_channel_zero_points())
        else:
            raise CannotDescribe(f"a quantized tensor of scheme {scheme}")
        self.elements(t.int_repr())

    def sparse(self, t: Any) -> None:
        torch = sys.modules["torch"]
        layout = t.layout
        parts: tuple[Any, ...]
        if layout == torch.sparse_coo:
            self.emit("coo", tuple(t.shape), t.sparse_dim(), t.dense_dim(), t.is_coalesced())
            parts = (t._indices(), t._values())
        elif layout in (torch.sparse_csr, torch.sparse_bsr):
            self.emit("compressed", tuple(t.shape))
            parts = (t.crow_indices(), t.col_indices(), t.values())
        elif layout in (torch.sparse_csc, torch.sparse_bsc):
            self.emit("compressed", tuple(t.shape))
            parts = (t.ccol_indices(), t.row_indices(), t.values())
        else:
            raise CannotDescribe(f"a tensor of layout {layout}")
        for part in parts:
            self.elements(part)

    def finish(self) -> None:
        """Memory shared between the arrays and tensors visited, where one of them can be
        written: a write through one shows through the other. (Read-only arrays of one
        buffer cannot tell; Ray gives those for one ref fetched twice.)"""
        numpy = sys.modules.get("numpy")
        self.trail.append("value")
        active: list[tuple[int, int, int, bool, Any]] = []
        for region in sorted(self.regions, key=lambda r: (r[0], r[2])):
            low, _, index, writeable, arr = region
            active = [r for r in active if r[1] > low]
            for other in active:
                if not (writeable or other[3]):
                    continue
                if numpy is not None and arr is not None and other[4] is not None:
                    try:
                        if not numpy.shares_memory(arr, other[4], max_work=1 << 20):
                            continue
                    except numpy.exceptions.TooHardError:
                        pass  # cannot tell: taken as shared, on both sides alike
                self.emit("shares memory", other[2], index)
            active.append(region)
