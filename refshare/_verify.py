"""Verify mode: every argument sent by ref checked against what Ray by value would send.

The rule verify holds refshare to is the product's promise: a worker receives what Ray by
value gives it. For each argument refshare replaces (a ref, or a skeleton naming its
members), verify serializes the argument as Ray would by value and digests that
serialization (its in-band bytes and out-of-band buffers):

- the first time a stored object is sent, what a worker would receive of it (the object
  fetched and deserialized on the driver, a skeleton rebuilt from its members, as on a
  worker) must serialize as what it would receive by value (the argument put and fetched
  by Ray's own ``ray.put``) does; the by-value digest is then kept with the object;
- every later send of that object (a ref, or a skeleton with the same key) must have the
  same by-value digest: equal keys, equal serializations.

What a worker receives is compared by its state where its class's pickling is its own
(``__getstate__``, ``__reduce__``, a hook on the instance): re-serializing both objects
through that code could hide a difference (a hook that reads a global, say); an object
whose state cannot be described so is compared by its serialization.

A difference is a mismatch: logged as an error naming the value's type, the call site and
the argument, counted (``stats().mismatches``), and that argument goes by value. A class
whose pickling is not deterministic (the same value, pickled twice, gives other bytes) is
reported too, and is safe: it goes by value. Verify costs what sending by value costs and
more; it is meant for a run when refshare is adopted or a framework upgraded.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import io
import logging
import os
import pickle
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import ray

from . import _stats
from ._hashing import Buffer, BufferHasher
from ._ray.submit import raw_put
from ._rules import instance_hooks, pickles_by_own_code, slot_names
from ._wire.serialized import native_split
from ._wire.tensors import pickled_as_storage, storage_bytes

logger = logging.getLogger("refshare")

#: Setting this environment variable to 1 turns verify mode on in every scope.
VERIFY_ENV = "REFSHARE_VERIFY"
#: How many stored objects' by-value digests are kept; the oldest are checked again.
MAX_ENTRIES = 1 << 16


def verify_by_env() -> bool:
    return os.environ.get(VERIFY_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _array(*description: object) -> None:
    """Stands for an array in a by-value digest; never called."""


def _describe_array(arr: Any) -> tuple[Any, tuple[Any, ...]]:
    """An array as its pickle sends it (dtype, shape, memory order, bytes, read-only), its
    dtype described by value: unpickled apart, two members' dtypes are two objects where
    one pickle of both makes one, a difference nothing but ``is`` can see."""
    dtype = arr.dtype
    token = pickle.dumps(dtype, protocol=5)  # all of it: metadata, byte order, fields
    flags = arr.flags
    order = "F" if flags.f_contiguous and not flags.c_contiguous else "C"
    head = (token, arr.shape, order, flags.writeable)
    if dtype.hasobject:
        return _array, (*head, arr.ravel(order=order).tolist())  # elements, aliasing kept
    if flags.c_contiguous or flags.f_contiguous:
        return _array, (*head, pickle.PickleBuffer(arr))
    return _array, (*head, arr.tobytes(order="C"))


class _Storage:
    """Stands for one tensor's storage in a by-value digest. Pickle sends each tensor with
    a storage of its own (two views of one storage arrive as two copies), so a tensor's
    token is not shared with another's; one tensor object sent twice is one object of the
    dump, as pickle's memo keeps it."""

    __slots__ = ("data",)

    def __init__(self, data: Any) -> None:
        self.data = data

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _array, ("storage", pickle.PickleBuffer(self.data))


def _tensor(*description: object) -> None:
    """Stands for a tensor in a by-value digest; never called."""


def _handle(*description: object) -> None:
    """Stands for an ``ObjectRef`` or an actor handle in a by-value digest; never called."""


def _state(*description: object) -> None:
    """Stands for an object described by its class and state; never called."""


def _described_state(obj: Any) -> tuple[Any, ...] | None:
    """``obj`` as its class and state (its ``__dict__`` and slots), for an object whose
    pickling runs code of its own; ``None`` for any other, or one with no state to read."""
    cls = type(obj)
    if not (instance_hooks(obj) or pickles_by_own_code(cls)):
        return None
    state = getattr(obj, "__dict__", None)
    slots = slot_names(cls)
    if type(state) is not dict and not slots:
        return None  # a C type's state: only its pickling shows it
    present = {name: getattr(obj, name) for name in slots if hasattr(obj, name)}
    return _state, (cls,), (state if type(state) is dict else None, present)


@functools.cache
def _describer(by_state: bool = False) -> type[pickle.Pickler]:
    """Ray's pickler, describing arrays and CPU tensors by what their pickling sends but
    not where it lies: torch's pickle of a tensor holds its storage's address, which
    differs between two equal tensors. Refs and actor handles are described by their ids:
    pickled outside a task's serialization, Ray would keep what they name alive for good.
    ``by_state``: objects whose pickling runs code of their own are described by their
    state (see :func:`_described_state`), to compare what two workers received."""
    from ray import cloudpickle

    base: type[Any] = cloudpickle.CloudPickler

    class Describer(base):  # type: ignore[misc]
        def reducer_override(self, obj: Any) -> Any:
            cls = type(obj)
            numpy = sys.modules.get("numpy")
            if numpy is not None and cls is numpy.ndarray:
                return _describe_array(obj)
            torch = sys.modules.get("torch")
            if torch is not None and cls is torch.Tensor and pickled_as_storage(obj, True):
                return self.describe_tensor(obj)
            if isinstance(obj, ray.ObjectRef):  # what a worker receives: a ref to this object
                return _handle, ("ref", obj.binary())
            if isinstance(obj, ray.actor.ActorHandle):  # and a handle to this actor
                return _handle, ("actor", obj._actor_id.binary())
            if by_state and not isinstance(obj, type):
                described = _described_state(obj)
                if described is not None:
                    return described
            return super().reducer_override(obj)

        def describe_tensor(self, t: Any) -> tuple[Any, tuple[Any, ...]]:
            token = _Storage(storage_bytes(t))
            layout = (str(t.dtype), tuple(t.shape), t.stride(), t.storage_offset())
            flags = (t.requires_grad, t.is_conj(), t.is_neg())
            return _tensor, (*layout, flags, token, getattr(t, "__dict__", None) or None)

    return Describer


def serialized_digest(value: Any, by_state: bool = False) -> bytes:
    """A digest of Ray's serialization of ``value``, as a task argument or a put sends it:
    the msgpack part, then the other objects pickled together by Ray's cloudpickle (its
    registered serializers included), in-band bytes and out-of-band buffers, arrays'
    dtypes by value. (Ray's own serialized bytes are not compared: their padding depends
    on where buffers lie.) ``by_state``: see :func:`_describer`."""
    native, objects = native_split(value)
    stream = io.BytesIO()
    buffers: list[pickle.PickleBuffer] = []
    _describer(by_state)(stream, protocol=5, buffer_callback=buffers.append).dump(objects)
    parts: list[Buffer] = [native or b"", stream.getbuffer()]
    parts += [buffer.raw() for buffer in buffers]
    return BufferHasher(b"by value").add_all(parts).digest()


_unpickling = threading.Lock()


@contextlib.contextmanager
def _classes_kept() -> Iterator[None]:
    """While verify deserializes on the driver, the classes this process defined and
    cloudpickle sends by value (a script's, a notebook's, a local class) keep their own
    attributes. Unpickling such a class where it was defined, cloudpickle finds the
    original and sets on it the copies of its methods the pickle carries, whose globals
    are copies too: a program that pickles an instance by reference afterwards fails. By
    value, that happens only where the program fetches such an object itself."""
    from ray.cloudpickle import cloudpickle

    setstate: Callable[[Any, Any], Any] | None = getattr(cloudpickle, "_class_setstate", None)
    tracked = getattr(cloudpickle, "_DYNAMIC_CLASS_TRACKER_BY_CLASS", None)
    if setstate is None or tracked is None:  # another cloudpickle: left as it is
        yield
        return
    with _unpickling:
        known = set(tracked)

        @functools.wraps(setstate)  # pickled meanwhile, it is named as the one it stands for
        def keep_known(cls: Any, state: Any) -> Any:
            return cls if cls in known else setstate(cls, state)

        cloudpickle._class_setstate = keep_known
        try:
            yield
        finally:
            cloudpickle._class_setstate = setstate


def _fetched(value: Any) -> Any:
    """``value`` as a worker receives it: a ref fetched, or a value (a skeleton) put and
    fetched, as its deserialization rebuilds it."""
    ref = value if isinstance(value, ray.ObjectRef) else raw_put(value)
    with _classes_kept():
        return ray.get(ref)


class Verifier:
    """The by-value digests of the objects sent by ref, in this process and session."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._digests: collections.OrderedDict[object, bytes] = collections.OrderedDict()
        self._session: object = None

    def check(self, value: Any, sent: Any, site: str, argument: str, session: object) -> Any:
        """``sent`` if a worker receives through it what it receives of ``value`` by value,
        else ``value`` itself (a mismatch, reported). ``site`` and ``argument`` name where
        it was sent (``Cls.method``, ``argument 'batch'``)."""
        try:
            expected = serialized_digest(value)
        except Exception:
            logger.debug("verify: cannot serialize %s", type(value).__qualname__, exc_info=True)
            return sent  # Ray cannot send it by value either: nothing to compare
        # What was sent stands for one stored content: a ref, or an inline skeleton's key.
        ident = sent.binary() if isinstance(sent, ray.ObjectRef) else getattr(sent, "key", None)
        with self._lock:
            if session != self._session:
                self._digests.clear()
                self._session = session
            known = None if ident is None else self._digests.get(ident)
        if known is None:
            why = self._compare_received(value, sent)
            if why is None and ident is not None:
                with self._lock:
                    self._digests[ident] = expected
                    if len(self._digests) > MAX_ENTRIES:
                        self._digests.popitem(last=False)
        else:
            why = None if known == expected else "its content differs from the stored value's"
        if why is None:
            return sent
        _stats.record_mismatch()
        logger.error(
            "refshare verify: %s sent as %s in %s would not reach the worker as by value "
            "(%s); sent by value",
            type(value).__qualname__,
            argument,
            site,
            why,
        )
        return value

    @staticmethod
    def _compare_received(value: Any, sent: Any) -> str | None:
        """Why a worker would receive other than by value through ``sent``, or ``None``."""
        try:
            by_value = _fetched(raw_put(value))
            expected = serialized_digest(by_value)
        except Exception:
            logger.debug("verify: by value fails for %s", type(value).__qualname__, exc_info=True)
            return None  # by value fails, or its result cannot be sent again: nothing to compare
        try:
            received = _fetched(sent)
            if serialized_digest(received) != expected:
                return "what the worker rebuilds differs"
        except Exception as error:
            return f"rebuilding it failed: {error!r}"
        try:
            alike = serialized_digest(received, True) == serialized_digest(by_value, True)
        except Exception:  # a state that cannot be described: its serialization says it
            logger.debug("verify: cannot describe %s", type(value).__qualname__, exc_info=True)
            return None
        return None if alike else "what the worker rebuilds differs in its state"


verifier = Verifier()
