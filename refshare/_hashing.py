"""Seeded xxh3-128 digests of raw buffers, in parallel chunks when they are large."""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import xxhash

Buffer = bytes | bytearray | memoryview

#: Per-process random seed: a key cannot be precomputed offline, so nobody can craft an
#: argument that collides with another one. Keys are therefore stable within a process only.
SEED: int = secrets.randbits(64)

#: Buffers up to this size are hashed in one call; larger ones as a tree of chunk digests.
PARALLEL_MIN_BYTES = 8 << 20
#: Chunk size of the tree. Fixed, so the digest of a buffer depends on its bytes only.
CHUNK_BYTES = 4 << 20
#: Threads that hash one large buffer, the calling one included. xxh3 runs near memory
#: speed, so more threads than cores (or than memory channels) gain nothing.
HASH_THREADS = max(1, min(8, os.cpu_count() or 1))

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _get_pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(HASH_THREADS - 1, thread_name_prefix="refshare-hash")
    return _pool


def _chunk_digests(flat: memoryview, parts: list[bytes], claim: Iterator[int]) -> None:
    """Hash the chunks of ``flat`` that this thread claims, one at a time, into ``parts``,
    until none is left: a thread that starts late or runs slowly takes fewer of them."""
    digest = xxhash.xxh3_128_digest
    for i in claim:  # one iterator shared by the threads: each chunk is claimed once
        start = i * CHUNK_BYTES
        parts[i] = digest(flat[start : start + CHUNK_BYTES], SEED)


def digest_buffer(buf: Buffer) -> bytes:
    """Return the 16-byte digest of a C-contiguous buffer, hashed where it lies.

    xxhash releases the GIL on large inputs, so a large buffer is cut into fixed chunks that
    the calling thread and a small pool hash at once, each taking the next chunk left; the
    chunk digests are hashed again. The calling thread waits only for chunks a pool thread
    is hashing: a pool thread that has not started by then (busy with another buffer) is
    not waited for.
    """
    flat = memoryview(buf)
    if flat.ndim != 1 or flat.itemsize != 1:
        flat = flat.cast("B")  # only where needed: a cast costs more than a small hash
    size = flat.nbytes
    if size <= PARALLEL_MIN_BYTES:
        return xxhash.xxh3_128_digest(flat, SEED)
    chunks = -(-size // CHUNK_BYTES)
    parts = [b""] * chunks
    claim = iter(range(chunks))
    helpers = min(HASH_THREADS, chunks) - 1
    futures = [_get_pool().submit(_chunk_digests, flat, parts, claim) for _ in range(helpers)]
    _chunk_digests(flat, parts, claim)
    for future in futures:
        if not future.cancel():  # started: it may be hashing a chunk still
            future.result()
    tree = xxhash.xxh3_128(size.to_bytes(8, "little"), SEED)
    tree.update(b"".join(parts))
    return tree.digest()


def tagged(tag: str, *meta: object) -> xxhash.xxh3_128:
    """A hasher started with ``tag`` and the repr of ``meta``: the head of a digest."""
    return xxhash.xxh3_128(repr((tag, *meta)).encode(), SEED)


def digest_with(head: xxhash.xxh3_128, body: Any) -> bytes:
    """The digest of ``head`` followed by a C-contiguous buffer: in one pass for a small
    buffer, through the parallel chunked digest for a large one."""
    if memoryview(body).nbytes <= PARALLEL_MIN_BYTES:
        head.update(body)
    else:
        head.update(digest_buffer(body))
    return head.digest()


class BufferHasher:
    """Digests a sequence of buffers, each by its length and its own digest: two sequences
    agree only if every buffer does, wherever one ends and the next begins."""

    __slots__ = ("hasher",)

    def __init__(self, tag: bytes) -> None:
        self.hasher = xxhash.xxh3_128(tag, SEED)

    def add(self, buffer: Buffer) -> None:
        raw = memoryview(buffer)
        self.hasher.update(raw.nbytes.to_bytes(8, "little"))
        self.hasher.update(digest_buffer(raw))

    def add_all(self, buffers: Iterable[Buffer]) -> BufferHasher:
        for buffer in buffers:
            self.add(buffer)
        return self

    def digest(self) -> bytes:
        return self.hasher.digest()
