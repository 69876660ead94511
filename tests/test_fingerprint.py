"""Fingerprints, without Ray: what is equal, what is not, and what is hashed again."""

from __future__ import annotations

import copyreg
import threading
from typing import Any

import internals
import numpy as np
import pytest
from internals import PARALLEL_MIN_BYTES, digest_buffer, hashing_pool

import refshare
from refshare import estimate_size, fingerprint


def test_cycles_do_not_hang() -> None:
    loop: list[object] = [np.zeros(100, dtype=np.uint8)]
    loop.append(loop)
    assert estimate_size(loop) == 100
    key = fingerprint(loop)
    assert key is not None and key == fingerprint(loop)


def test_equal_content_equal_key_and_different_content_different_key() -> None:
    a = np.arange(1000, dtype=np.float64)
    assert fingerprint(a) == fingerprint(a.copy())
    b = a.copy()
    b[500] += 1
    assert fingerprint(a) != fingerprint(b)
    assert fingerprint({"x": a, "y": [1, 2]}) == fingerprint({"x": a.copy(), "y": [1, 2]})
    assert fingerprint({"x": a}) != fingerprint({"x": b})
    assert fingerprint(b"abc" * 100) == fingerprint(b"abc" * 100)
    assert fingerprint(b"abc" * 100) != fingerprint(bytearray(b"abc" * 100))


def test_type_dtype_shape_and_layout_are_part_of_the_key() -> None:
    a = np.arange(24, dtype=np.int64)
    variants = [
        a,
        a.astype(np.float64),
        a.view(np.float64),  # same bytes, other dtype
        a.reshape(4, 6),
        a.reshape(6, 4),
        np.asfortranarray(a.reshape(4, 6)),  # same values, sent in F order
        a.reshape(4, 6)[:, ::2],  # strided view
        a.astype(">i8"),  # other byte order
        a.tobytes(),
        a.view(np.ndarray).reshape(4, 6).T,
    ]
    keys = [fingerprint(v) for v in variants]
    assert None not in keys
    assert len(set(keys)) == len(keys)


def test_mutation_changes_the_key() -> None:
    a = np.zeros(1000)
    before = fingerprint(a)
    a[-1] = 1.0
    assert fingerprint(a) != before


def test_non_contiguous_arrays_hash_by_content() -> None:
    base = np.arange(10_000, dtype=np.float32).reshape(100, 100)
    view = base[::2, ::3]
    assert not view.flags.c_contiguous and not view.flags.f_contiguous
    assert fingerprint(view) == fingerprint(base.copy()[::2, ::3])
    broadcast = np.broadcast_to(np.arange(10.0), (1000, 10))
    assert fingerprint(broadcast) == fingerprint(np.broadcast_to(np.arange(10.0), (1000, 10)))
    assert fingerprint(broadcast) != fingerprint(np.ascontiguousarray(broadcast))


def test_large_buffers_hash_in_chunks_by_content_only() -> None:
    data = np.random.default_rng(0).integers(0, 255, PARALLEL_MIN_BYTES * 3, dtype=np.uint8)
    assert digest_buffer(data) == digest_buffer(data.copy())
    changed = data.copy()
    changed[-1] ^= 1
    assert digest_buffer(data) != digest_buffer(changed)
    assert digest_buffer(data) != digest_buffer(data[:-1])


def test_a_busy_hashing_pool_is_not_waited_for() -> None:
    """A large buffer hashed while every helper thread is busy with other work is hashed by
    the calling thread alone, to the same digest: it does not wait for them."""
    data = np.random.default_rng(1).integers(0, 255, PARALLEL_MIN_BYTES * 3, dtype=np.uint8)
    expected = digest_buffer(data)
    pool, release = hashing_pool(), threading.Event()
    blockers = [pool.submit(release.wait, 120) for _ in range(pool._max_workers)]
    got: list[bytes] = []
    hashing = threading.Thread(target=lambda: got.append(digest_buffer(data)))
    hashing.start()
    hashing.join(timeout=60)
    finished = not hashing.is_alive()
    release.set()
    hashing.join()
    for blocker in blockers:
        blocker.result()
    assert finished and got == [expected]


def test_memo_hashes_each_array_once_per_call() -> None:
    a = np.zeros(1 << 16)  # small arrays are hashed each time: cheaper than a stamp
    memo: internals.Memo = {}
    key = fingerprint(a, memo)
    assert memo[id(a)][0] is a and memo[id(a)][2] == key
    twin = a.copy()
    assert fingerprint({"a": a, "b": a}, memo) == fingerprint({"a": twin, "b": twin})
    # Aliasing is part of what a worker receives (d["a"] is d["b"]), so it is in the key.
    assert fingerprint({"a": a, "b": a}) != fingerprint({"a": a, "b": twin})


def test_unfingerprintable_values_give_none() -> None:
    class Unpicklable:
        def __reduce__(self) -> object:
            raise RuntimeError("no")

    assert fingerprint(Unpicklable()) is None
    assert fingerprint(x for x in range(3)) is None


def test_a_function_sent_as_code_is_keyed_by_the_pickle_ray_sends() -> None:
    def make(offset: int) -> object:
        return lambda x: x + offset  # cloudpickle sends its code and the closure

    same = make(1)
    assert fingerprint([same]) is not None
    assert fingerprint([same]) == fingerprint([same])
    assert fingerprint([make(1)]) != fingerprint([make(2)])


def test_object_arrays_and_subclasses_use_their_pickled_form() -> None:
    objs = np.array([{"a": 1}, "text", 3], dtype=object)
    assert fingerprint(objs) == fingerprint(np.array([{"a": 1}, "text", 3], dtype=object))
    assert fingerprint(objs) != fingerprint(np.array([{"a": 2}, "text", 3], dtype=object))

    class Tagged(np.ndarray):  # type: ignore[type-arg]
        pass

    plain = np.arange(10.0)
    assert fingerprint(plain.view(Tagged)) != fingerprint(plain)
    masked = np.ma.masked_array(plain, mask=plain > 5)
    assert fingerprint(masked) != fingerprint(np.ma.masked_array(plain, mask=plain > 6))


def test_registered_fingerprint_and_size() -> None:
    class TensorDictLike:
        def __init__(self, data: dict[str, np.ndarray], batch: int) -> None:
            self._data = data
            self._batch = batch
            self._lock = object()  # what the default pass would stumble on, were it unpicklable

    refshare.register_fingerprint(
        TensorDictLike,
        lambda td: (td._batch, td._data),
        size=lambda td: sum(v.nbytes for v in td._data.values()),
    )
    x = np.arange(100.0)
    assert estimate_size(TensorDictLike({"x": x}, 10)) == 800
    assert fingerprint(TensorDictLike({"x": x}, 10)) == fingerprint(TensorDictLike({"x": x}, 10))
    assert fingerprint(TensorDictLike({"x": x}, 10)) != fingerprint(TensorDictLike({"x": x}, 5))
    with pytest.raises(TypeError, match="takes a class"):
        refshare.register_fingerprint("not a class", len)  # type: ignore[arg-type]


class Record:
    """Keyed by a registered reader that reads ``data`` and nothing else."""

    def __init__(self, data: np.ndarray, note: str) -> None:
        self.data = data
        self.note = note


class RecordLike(Record):
    """Pickles as ``Record``, until a test gives it pickling of its own."""


def test_a_reader_serves_a_subclass_only_while_it_pickles_as_its_base(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The reader reads ``data`` alone (its contract says it must read all the pickle sends;
    here it does not, on purpose): a subclass that pickles as the base gets the base's
    key, and once a hook is assigned to it, after it was read, it is keyed by its pickle."""
    refshare.register_fingerprint(Record, lambda r: r.data)
    data = np.arange(100.0)
    assert fingerprint(RecordLike(data, "a")) == fingerprint(RecordLike(data, "b"))

    monkeypatch.setattr(RecordLike, "__getstate__", lambda self: (self.note, self.data))
    monkeypatch.setattr(RecordLike, "__setstate__", lambda self, s: None, raising=False)
    assert fingerprint(RecordLike(data, "a")) != fingerprint(RecordLike(data, "b"))

    monkeypatch.undo()
    assert fingerprint(RecordLike(data, "a")) == fingerprint(RecordLike(data, "b"))


def frozen(values: np.ndarray) -> np.ndarray:
    values.flags.writeable = False
    return values


def test_reuse_rehashes_read_only_arrays_that_a_view_could_still_change() -> None:
    a = np.arange(1_000_000.0)
    early = a[:]  # a writable view made before the array is marked read-only
    frozen(a)
    first = fingerprint(a, reuse=True)
    early[1] = -1.0  # an element the spot check does not read
    assert fingerprint(a, reuse=True) == fingerprint(a) != first

    writeable = np.arange(1000.0)
    before = fingerprint(writeable, reuse=True)
    writeable[0] = -1.0
    assert fingerprint(writeable, reuse=True) != before


def test_a_read_only_view_of_a_writeable_array_is_not_frozen() -> None:
    base = np.arange(1000.0)
    view = frozen(base[:])
    before = fingerprint(view, reuse=True)
    base[0] = -1.0
    assert fingerprint(view, reuse=True) != before
    trust = internals.array_trust
    over_bytearray = frozen(np.frombuffer(bytearray(8000), dtype=np.float64))
    assert trust(over_bytearray) == internals.Trust.NEVER
    assert trust(frozen(np.zeros(10))) == internals.Trust.NEVER


def test_arrays_over_immutable_buffers_are_hashed_once_without_asking() -> None:
    data = np.arange(1_000_000.0).tobytes()
    a = np.frombuffer(data, dtype=np.float64)[::2]  # a view of a view of bytes
    assert internals.array_trust(a) == internals.Trust.ALWAYS
    with pytest.raises(ValueError):
        a.flags.writeable = True  # numpy itself forbids it: nothing can change this array
    first = fingerprint(a)
    entry = internals.digests_kept_across_calls[id(a)]
    assert entry[0]() is a and entry[2] == first
    assert fingerprint(a) == first


def test_reuse_never_matches_a_recycled_id() -> None:
    for i in range(200):
        temporary = frozen(np.full(100, float(i)))
        assert fingerprint(temporary, reuse=True) == fingerprint(temporary.copy())
        del temporary
    assert len(internals.digests_kept_across_calls) < 10  # entries leave with their objects


def test_tensor_keys_follow_storage_layout_and_version() -> None:
    torch = pytest.importorskip("torch")
    t = torch.arange(1000, dtype=torch.bfloat16).reshape(10, 100)
    assert fingerprint(t) == fingerprint(t.clone())
    assert fingerprint(t) != fingerprint(t.float())
    assert fingerprint(t.t()) != fingerprint(t.t().contiguous())  # stride is sent as is
    assert fingerprint(t[::2]) != fingerprint(t[::2].clone())  # a view sends its storage
    before = fingerprint(t, reuse=True)
    t.add_(1)  # in place: the version counter moves, so reuse hashes again
    assert fingerprint(t, reuse=True) != before
    assert fingerprint(torch.nn.Parameter(t.float())) != fingerprint(t.float())


def count_hashing(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Which of refshare's tensor hashes ran: a tensor's whole storage, or its own elements."""
    ran: list[str] = []
    for name in ("_digest_storage", "_digest_elements"):
        real = getattr(internals.leaf_digests, name)

        def counted(t: object, real: Any = real, name: str = name) -> Any:
            ran.append(name)
            return real(t)

        monkeypatch.setattr(internals.leaf_digests, name, counted)
    return ran


def test_views_of_one_tensor_hash_its_memory_once_per_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch = pytest.importorskip("torch")
    from internals import Memo, TensorElements, identify

    t = torch.randn(256, 1024)
    expected = [fingerprint(chunk) for chunk in t.chunk(4)]
    rows = [fingerprint(TensorElements(chunk)) for chunk in t.chunk(4)]
    ran, memo = count_hashing(monkeypatch), Memo()
    # Each chunk pickles t's whole storage: one call hashes it once, for all four.
    assert [(identify(c, memo) or [None])[0] for c in t.chunk(4)] == expected
    assert ran == ["_digest_storage"]
    # Each chunk's own rows, once each, even when the batch is chunked again in the call.
    ran.clear()
    for _ in range(2):
        assert [(identify(TensorElements(c), memo) or [None])[0] for c in t.chunk(4)] == rows
    assert ran == ["_digest_elements"] * 4


def test_views_of_a_first_put_hash_their_memory_at_most_twice_per_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A value ``ray.put`` for the first time: its tensor is not stamped when first seen,
    so the second view of the same memory hashes it again, and stamps it for the rest."""
    torch = pytest.importorskip("torch")
    from internals import Memo, first_put, identify

    t = torch.randn(256, 1024)
    expected = [fingerprint(chunk) for chunk in t.chunk(4)]
    ran, memo = count_hashing(monkeypatch), Memo()
    with first_put():
        assert [(identify(c, memo) or [None])[0] for c in t.chunk(4)] == expected
    assert ran == ["_digest_storage"] * 2


def test_a_torch_device_is_keyed_by_what_its_pickling_sends() -> None:
    torch = pytest.importorskip("torch")
    devices = ["cpu", "cuda", "cuda:0", "cuda:1", "meta"]
    keys = [fingerprint(("on", torch.device(name))) for name in devices]
    assert None not in keys and len(set(keys)) == len(devices)
    assert fingerprint(("on", torch.device("cuda", 1))) == keys[devices.index("cuda:1")]
    # A reducer registered for it is what Ray sends: the key follows that reducer.
    tag = ["a"]
    copyreg.pickle(torch.device, lambda d: (str, (f"{tag[0]}:{d}",)))
    try:
        before = fingerprint(("on", torch.device("cpu")))
        tag[0] = "b"
        after = fingerprint(("on", torch.device("cpu")))
    finally:
        del copyreg.dispatch_table[torch.device]
    assert None not in (before, after) and len({before, after, keys[0]}) == 3
    assert fingerprint(("on", torch.device("cpu"))) == keys[0]


def test_rows_too_small_for_a_stamp_are_hashed_at_every_send_of_a_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch = pytest.importorskip("torch")
    from internals import Memo, TensorElements, identify

    t = torch.zeros(64, 256)
    assert t[:16].nelement() * t.element_size() < 256 << 10  # no stamp vouches for it
    ran, memo = count_hashing(monkeypatch), Memo()
    first = (identify(TensorElements(t[:16]), memo) or [None])[0]
    t.numpy()[3, 5] = 1.0  # behind torch's back: no version counter moves
    again = (identify(TensorElements(t[:16]), memo) or [None])[0]
    assert first is not None and again not in (first, None)
    assert ran == ["_digest_elements"] * 2
    # Equal bytes, told apart by what the digest's head holds: dtype, shape, requires_grad.
    zeros = [
        torch.zeros(16, 256),
        torch.zeros(16, 256, dtype=torch.int32),
        torch.zeros(256, 16),
        torch.zeros(4096),
        torch.zeros(16, 256, requires_grad=True),
    ]
    keys = [fingerprint(TensorElements(z)) for z in zeros]
    assert None not in keys and len(set(keys)) == len(keys)


def test_reuse_finds_views_made_again_until_their_tensor_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch = pytest.importorskip("torch")
    from internals import TensorElements

    t = torch.randn(256, 1024)
    first = fingerprint(TensorElements(t[:64]), reuse=True)
    whole = fingerprint(t[:64], reuse=True)
    ran = count_hashing(monkeypatch)
    assert fingerprint(TensorElements(t[:64]), reuse=True) == first  # a new view, not hashed
    assert fingerprint(t[:64], reuse=True) == whole
    assert ran == []
    t.add_(1)  # in place: the version counter, shared by every view, moves
    assert fingerprint(TensorElements(t[:64]), reuse=True) not in (first, None)
    assert fingerprint(t[:64], reuse=True) not in (whole, None)


def test_reuse_never_trusts_memory_torch_shares_with_numpy() -> None:
    torch = pytest.importorskip("torch")
    buffer = np.zeros(1 << 18, dtype=np.float32)
    a, b = torch.from_numpy(buffer), torch.from_numpy(buffer)  # two tensors, one memory
    first = fingerprint(a, reuse=True)
    b[1] += 1.0  # in place through the other tensor: a's version counter does not move
    assert fingerprint(a, reuse=True) == fingerprint(a) != first
    t = torch.zeros(1 << 18)
    view = t.numpy()  # once exported to numpy, writes can go around the version counter
    first = fingerprint(t, reuse=True)
    view[1] = 1.0
    assert fingerprint(t, reuse=True) != first


def test_a_spot_check_compares_elements_not_bytes() -> None:
    torch = pytest.importorskip("torch")
    t = torch.ones(1 << 18)  # 1.0 and 2.0 differ in float32's last two bytes only
    memo: internals.Memo = {}
    first = internals.identify(t, memo)
    t.numpy()[0] = 2.0  # behind torch's back: the version counter does not move
    assert internals.identify(t, memo) != first


def test_inference_mode_tensors_are_hashed_each_time_they_are_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch = pytest.importorskip("torch")
    with torch.inference_mode():
        t = torch.zeros(1 << 18)
    memo: internals.Memo = {}
    ran = count_hashing(monkeypatch)
    first = internals.identify(t, memo)
    with torch.inference_mode():
        t[1] = 1.0  # no version counter to move
    assert internals.identify(t, memo) != first
    assert ran == ["_digest_storage"] * 2


def test_tensors_off_the_cpu_are_neither_sized_nor_hashed() -> None:
    torch = pytest.importorskip("torch")
    # No GPU here: a "meta" tensor takes the same path as a CUDA one, any device but the CPU.
    off_cpu = torch.empty(1 << 20, device="meta")
    assert estimate_size(off_cpu) == 0  # never reaches min_bytes: goes by value, unchanged
    # Inside a container, it is keyed by the pickle Ray would send (see _serialized).
    batch = {"weights": off_cpu, "x": np.zeros(10)}
    assert fingerprint(batch) is not None
    assert fingerprint(batch) == fingerprint({"weights": off_cpu.clone(), "x": np.zeros(10)})


def test_a_large_object_array_is_keyed_by_the_pickle_ray_sends() -> None:
    from internals import SERIALIZE_OBJECT_ARRAYS_FROM, identify

    uids = np.empty(SERIALIZE_OBJECT_ARRAYS_FROM + 1, dtype=object)
    uids[:] = [f"uid-{i}".encode() for i in range(uids.size)]  # bytes: not joined as strings
    key, pickled, _, _ = identify(uids) or (None, None, None, None)
    assert pickled is not None and key == pickled.key  # one pickle: keyed, then stored
    assert key == fingerprint(uids.copy()) and key != fingerprint(uids[::-1].copy())
    few = np.array(["a", 1], dtype=object)  # small, inside a batch: keyed by a pass
    found = identify({"uids": few, "x": np.zeros(10)})
    assert found is not None and found[1] is None


class Tag(str):
    """A str subclass: pickles with its class, so it is not keyed as a plain string."""


def test_arrays_of_strings_are_keyed_by_their_strings_without_pickling() -> None:
    from internals import SERIALIZE_OBJECT_ARRAYS_FROM, identify

    words = np.array([f"uid-{i}-\u00e9" for i in range(SERIALIZE_OBJECT_ARRAYS_FROM * 2)], object)
    found = identify(words)
    assert found is not None and found[1] is None  # keyed joined, not by a pickle
    assert found[0] == fingerprint(words.copy()) != fingerprint(words[::-1].copy())
    grid = words.reshape(100, -1)
    keys = {fingerprint(v) for v in (words, grid, np.asfortranarray(grid), grid[:, ::2])}
    assert len(keys) == 4  # shape and the order Ray sends are part of the content
    # Where joining would lose what Ray sends, the array is keyed by its pickle, as before.
    for other in ("a\0b", Tag("x"), b"x", None):
        changed = words.copy()
        changed[7] = other
        found = identify(changed)
        assert found is not None and found[1] is not None, other
        assert found[0] != fingerprint(words)
    # Strings that would join alike unless their count and separators were kept.
    assert fingerprint(np.array(["ab", "c"], object)) != fingerprint(np.array(["a", "bc"], object))
    assert fingerprint(np.array([""], object)) != fingerprint(np.array(["", ""], object))


def test_a_list_of_small_arrays_is_keyed_in_one_pass() -> None:
    from internals import _digest_array_list

    rng = np.random.default_rng(0)
    arrays = [rng.random(1000) for _ in range(300)] + [np.asfortranarray(np.eye(40, 20))]
    assert _digest_array_list(arrays) is not None  # the one-pass path, not the pass
    assert fingerprint(arrays) == fingerprint([a.copy(order="K") for a in arrays])
    assert fingerprint(arrays) != fingerprint(tuple(arrays))
    assert fingerprint(arrays) != fingerprint(arrays[::-1])
    eye = arrays[-1]
    for other in (np.ascontiguousarray(eye), eye.astype(np.float32), eye.reshape(20, 40)):
        assert fingerprint(arrays) != fingerprint([*arrays[:-1], other])
    # Bytes that would hash alike if shapes and dtypes were not part of the stream.
    a = np.arange(8, dtype=np.int64)
    assert fingerprint([a[:4].copy(), a[4:].copy()]) != fingerprint([a[:2].copy(), a[2:].copy()])
    assert fingerprint([a]) != fingerprint([a.view(np.float64)])
    # One array twice arrives as one object twice: keyed by the pass, which keeps that.
    assert _digest_array_list([a, a]) is None
    assert fingerprint([a, a]) != fingerprint([a, a.copy()])
    # Anything else in the list, and the pass keys it, as before.
    others = (lambda: a.copy()[::2], lambda: np.zeros(1 << 16), lambda: np.array(["x"], object))
    for make in (*others, lambda: 3):
        assert _digest_array_list([a, make()]) is None
        assert fingerprint([a, make()]) == fingerprint([a.copy(), make()])
