"""tests/mirrors/verl_mirror.py against the real verl 0.9.1: what the mirror sends is what verl
sends. Runs where verl and tensordict import (``.ci/run`` has a venv for them).

The legacy trainer's conversions and the dispatch's chunks are compared by their pickles, in
which only torch.save's storage keys (``str(storage._cdata)``, a C pointer, in each tensor's
legacy torch.save blob) may differ: they are replaced by their index before comparing. A
``DataProto``'s own pickling (``torch.save`` in zip format, whose keys are its indices) is
compared as it is.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import struct
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tensordict")
protocol = pytest.importorskip("verl.protocol")
padding = pytest.importorskip("verl.workers.utils.padding")
tu = pytest.importorskip("verl.utils.tensordict_utils")

import numpy as np  # noqa: E402
import verl_mirror as mirror  # noqa: E402

import refshare  # noqa: E402

ROWS, PROMPT, RESPONSE = 64, 256, 256
CALLS = {name: flags for name, _, flags in mirror.legacy_calls(ROWS)}


def parts() -> tuple[dict[str, Any], dict[str, np.ndarray], dict[str, Any]]:
    """A batch as it stands at ``update_actor``: the rollout and every key the step adds."""
    tensors, non_tensors, meta = mirror.rollout(ROWS, PROMPT, RESPONSE, seed=0)
    g, mask = torch.Generator().manual_seed(1), tensors["response_mask"]
    for key in ("old_log_probs", "ref_log_prob", "values", "advantages", "returns"):
        tensors[key] = torch.randn(mask.shape, generator=g) * mask
    tensors["token_level_scores"] = tensors["token_level_rewards"] = tensors["values"] * 0.5
    return tensors, non_tensors, meta


def verl_convert(flags: dict[str, Any]) -> Any:
    """The legacy trainer's conversion for one call, on verl's own functions."""
    batch = protocol.DataProto.from_dict(*parts())
    batch.meta_info.update(mirror.UPDATE_ACTOR_META)
    return tu.assign_non_tensor(padding.left_right_2_no_padding(batch.to_tensordict()), **flags)


def mirror_convert(flags: dict[str, Any]) -> Any:
    batch = mirror.DataProto.from_dict(*parts())
    batch.meta_info.update(mirror.UPDATE_ACTOR_META)
    return mirror.convert(batch, flags)


def storage_keys(blob: bytes) -> list[str]:
    """The storage keys of a legacy torch.save blob: the list pickled after its main pickle."""

    class Unpickler(pickle.Unpickler):
        def persistent_load(self, pid: Any) -> Any:
            return pid

    stream = io.BytesIO(blob)
    for _ in range(3):  # magic number, protocol version, system info
        pickle.load(stream)
    Unpickler(stream).load()
    keys: list[str] = pickle.load(stream)
    return keys


def normalized(value: Any) -> list[tuple[str, Any]]:
    """The opcodes and arguments of ``pickle.dumps(value)``, with every torch.save storage
    key replaced by its index (keys are addresses, not always of one length) and the frame
    lengths, which count the keys' lengths, left out."""
    ops = []
    for op, arg, _ in pickletools.genops(pickle.dumps(value)):
        if op.name == "FRAME":  # a frame's length counts the keys' lengths too
            continue
        if isinstance(arg, bytes) and arg.startswith(b"\x80") and len(arg) > 64:
            for i, key in enumerate(storage_keys(arg)):
                text = key.encode()
                for pickled in (b"X" + struct.pack("<I", len(text)), b"\x8c" + bytes([len(text)])):
                    arg = arg.replace(pickled + text, f"<storage {i}>".encode())
        ops.append((op.name, arg))
    return ops


def test_normalizing_keeps_what_differs() -> None:
    """The comparison is not vacuous: equal tensors compare equal, other bytes do not."""
    a, b = torch.arange(1000), torch.arange(1000)
    assert pickle.dumps(a) != pickle.dumps(b)  # their storage keys differ
    assert normalized(a) == normalized(b)
    assert normalized(a) != normalized(torch.arange(1, 1001))


@pytest.mark.parametrize("call", list(CALLS))
def test_converted_tensordict_is_verls(call: str) -> None:
    ours, theirs = mirror_convert(CALLS[call]), verl_convert(CALLS[call])
    keys = list(ours.keys())  # a TensorDict iterates over its rows, not its keys
    assert keys == list(theirs.keys())
    assert [type(ours.get(k)) for k in keys] == [type(theirs.get(k)) for k in keys]
    assert normalized(ours) == normalized(theirs)


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_chunks_are_verls(dp: int) -> None:
    """Each side converts afresh and chunks once, as the trainer's dispatch does."""
    flags = CALLS["update_actor"]
    ours = mirror.chunk_batch(mirror_convert(flags), dp)
    theirs = protocol.BatchData(verl_convert(flags)).chunk(chunks=dp)
    assert len(ours) == len(theirs) == dp
    for mine, verls in zip(ours, theirs, strict=True):
        assert mine.is_consolidated() and verls.is_consolidated()
        assert normalized(mine) == normalized(verls)
        assert refshare.fingerprint(mine) == refshare.fingerprint(verls) is not None


def test_dataproto_pickles_as_verls() -> None:
    """The DataProto flow: its chunks' own pickling, ``torch.save`` of the consolidated batch."""
    tensors, non_tensors, meta = parts()
    ours = mirror.DataProto.from_dict(tensors, non_tensors, meta)
    theirs = protocol.DataProto.from_dict(tensors, non_tensors, meta)
    for mine, verls in zip(ours.chunk(2), theirs.chunk(2), strict=True):
        (batch, nons, info), (verl_batch, verl_nons, verl_info) = (
            mine.__getstate__(),
            verls.__getstate__(),
        )
        assert batch == verl_batch
        assert pickle.dumps((nons, info)) == pickle.dumps((verl_nons, verl_info))
        assert mirror.checksum(pickle.loads(pickle.dumps(mine))) == mirror.checksum(verls)
