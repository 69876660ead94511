"""Properties of the fingerprint, without Ray: two values share a key exactly when Ray would
send them the same way (type, dtype, shape, layout, bytes), and keys are per process."""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
from typing import Any

import hypothesis.extra.numpy as hnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import refshare

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])

DTYPES = [
    np.dtype(t)
    for t in ("u1", "i2", "<i4", ">i4", "<i8", ">i8", "<f4", "<f8", ">f8", "c16", "?", "M8[s]")
] + [np.dtype([("a", "<i4"), ("b", ">f8")])]


def sent(value: Any) -> tuple[bytes, tuple[bytes, ...]]:
    """What Ray sends for ``value``: its pickle protocol 5 stream and out-of-band buffers."""
    buffers: list[pickle.PickleBuffer] = []
    stream = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    return stream, tuple(bytes(b.raw()) for b in buffers)


def layout(arr: np.ndarray) -> Any:
    """The layout Ray keeps: C or F order, or (for any other view) the strides it had."""
    if arr.flags.c_contiguous:
        return "C"
    return "F" if arr.flags.f_contiguous else ("strided", arr.strides)


def same(a: Any, b: Any) -> bool:
    """Same type, dtype, shape, layout and bytes as Ray sends them."""
    return type(a) is type(b) and layout(a) == layout(b) and sent(a) == sent(b)


def fp(value: Any) -> bytes:
    key = refshare.fingerprint(value)
    assert key is not None
    return key


def arrays_of(min_dims: int = 0, min_side: int = 0) -> st.SearchStrategy[np.ndarray]:
    shapes = hnp.array_shapes(min_dims=min_dims, max_dims=3, min_side=min_side, max_side=4)
    return st.sampled_from(DTYPES).flatmap(lambda dtype: hnp.arrays(dtype, shapes))


arrays = arrays_of()


def variants(base: np.ndarray) -> list[np.ndarray]:
    """Views and copies of ``base`` in every layout Ray can be handed."""
    out = [base, base.copy(), np.ascontiguousarray(base), np.asfortranarray(base)]
    out.append(base.astype(base.dtype.newbyteorder()))  # '<f8' <-> '>f8': equal values
    if base.ndim:
        out += [base.T, base[::2], base[::-1], base.reshape(-1), base[..., :0]]
        out.append(np.broadcast_to(base, (2, *base.shape)))  # zero stride
    if base.size:
        out.append(np.array(base.reshape(-1)[0]))  # 0-d
        out.append(base.reshape(-1)[:1].reshape(()))  # 0-d view
    if base.dtype.itemsize in (2, 4, 8) and base.ndim and base.flags.c_contiguous:
        out.append(base.view(f"<u{base.dtype.itemsize}"))  # same bytes, another dtype
    return out


@SETTINGS
@given(arrays, st.data())
def test_same_key_exactly_when_ray_sends_the_same(base: np.ndarray, data: st.DataObject) -> None:
    family = variants(base)
    a = data.draw(st.sampled_from(family))
    b = data.draw(st.sampled_from(family))
    # One key exactly when Ray would send the two the same way.
    assert (fp(a) == fp(b)) == same(a, b)


def test_equal_dtypes_spelled_differently_share_a_key() -> None:
    native = np.arange(50_000, dtype="i4")
    swapped = native.astype(">i4")
    back = swapped.byteswap().view(swapped.dtype.newbyteorder())  # numpy's usual idiom
    assert same(back, native) and back.dtype == native.dtype
    assert fp(back) == fp(native)


@SETTINGS
@given(arrays)
def test_layout_variants_never_collide(base: np.ndarray) -> None:
    family = variants(base)
    keys = [fp(v) for v in family]
    for i, a in enumerate(family):
        for j, b in enumerate(family):
            assert (keys[i] == keys[j]) == same(a, b), (i, j)


def test_c_and_f_order_of_equal_values_differ() -> None:
    values = np.arange(12.0).reshape(3, 4)
    fortran = np.asfortranarray(values)
    assert (fortran == values).all()
    assert fp(fortran) != fp(values)
    assert fp(fortran) == fp(np.asfortranarray(values.copy()))
    little, big = np.arange(6, dtype="<f8"), np.arange(6, dtype=">f8")
    assert (little == big).all() and fp(little) != fp(big)


@SETTINGS
@given(arrays.filter(lambda a: a.size > 0), st.data())
def test_any_mutation_changes_the_key(base: np.ndarray, data: st.DataObject) -> None:
    arr = data.draw(st.sampled_from([base, np.asfortranarray(base), base.T]))
    arr = arr.copy(order="K")
    original, before = arr.copy(order="K"), fp(arr)
    raw = arr.view(np.uint8) if arr.flags.c_contiguous and arr.ndim else None
    index = data.draw(st.integers(0, arr.nbytes - 1))
    if raw is not None and raw.size == arr.nbytes:
        raw.reshape(-1)[index] ^= 0xFF
    else:
        flat = arr.reshape(-1, order="A")  # a view for C or F order
        item = flat[index // arr.itemsize : index // arr.itemsize + 1].view(np.uint8)
        item[index % arr.itemsize] ^= 0xFF
    assert not same(arr, original)  # the flip landed in the array itself
    assert fp(arr) != before


@SETTINGS
@given(arrays_of(min_dims=1, min_side=2), st.data())
def test_mutating_the_base_changes_the_key_of_a_view(base: np.ndarray, data: st.DataObject) -> None:
    base = base.copy()
    view = data.draw(st.sampled_from([base[::2], base[:1], base.T, base[::-1], base[1:]]))
    original, before = view.copy(order="K"), fp(view)
    corner = view[(slice(0, 1),) * view.ndim]  # one element of the view, still a view
    flipped = corner.copy()
    flipped.view(np.uint8).reshape(-1)[0] ^= 0xFF
    corner[...] = flipped  # same dtype: the bytes are copied as they are
    assert not same(view, original)
    assert fp(view) != before


leaves = (
    st.integers(-5, 5)
    | st.text(max_size=4)
    | st.binary(max_size=4)
    | st.none()
    | hnp.arrays(st.sampled_from(DTYPES[:8]), hnp.array_shapes(max_dims=2, max_side=3))
)
nested = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=2), inner, max_size=3)
    ),
    max_leaves=8,
)


@SETTINGS
@given(nested, nested)
def test_containers_share_a_key_only_when_sent_alike(x: Any, y: Any) -> None:
    assert fp(x) == fp(copy.deepcopy(x))
    if fp(x) == fp(y):
        assert sent(x) == sent(y)


@SETTINGS
@given(st.binary(min_size=1, max_size=64))
def test_bytes_like_types_never_collide(raw: bytes) -> None:
    forms = [raw, bytearray(raw), raw.decode("latin-1"), memoryview(raw)]
    forms.append(np.frombuffer(raw, dtype=np.uint8))
    assert len({fp(f) for f in forms}) == len(forms)


def test_keys_are_stable_within_a_process() -> None:
    value = np.arange(1_000_000, dtype=np.float64)  # hashed in parallel chunks
    assert fp(value) == fp(value.copy()) == fp(np.arange(1_000_000, dtype=np.float64))


def test_two_processes_give_different_keys_for_the_same_value() -> None:
    # The seed is drawn per process: a key cannot be computed, or a collision crafted, offline.
    script = "import numpy, refshare;print(refshare.fingerprint(numpy.arange(1000)).hex())"
    runs = [
        subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
        ).stdout.split()
        for _ in range(2)
    ]
    (key_a,), (key_b,) = runs
    assert key_a != key_b
    assert refshare.fingerprint(np.arange(1000)).hex() not in (key_a, key_b)
