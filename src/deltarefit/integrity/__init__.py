"""Hashes, tensor digests and checkpoint fingerprints.

Construction (see FORMAT.md, "Fingerprints"):

* A tensor's raw bytes are cut into segments of ``SEGMENT_BYTES`` (1 MiB; the last may be shorter).
  Each segment hashes to ``seg_hash = BLAKE3(segment)[:16]``.
* ``tensor_digest = BLAKE3(b"deltarefit.tensor.v1\\0" || dtype || b"\\0" || u32 ndim || u64 dims...
  || u64 nbytes || seg_hash_0 || seg_hash_1 || ...)`` (32 bytes).
* ``fingerprint = BLAKE3(b"deltarefit.checkpoint.v1\\0" || u64 count || for each tensor in sorted
  name order: u32 len(name) || name (UTF-8) || tensor_digest)`` (32 bytes, shown as hex).

Why BLAKE3 and segments: segment hashes are independent, so a GPU (or many threads) computes them at
memory bandwidth, and BLAKE3 is itself a tree over 1 KiB blocks, so one segment parallelizes too. The
delta's chunks are exactly these segments, so the per-chunk pre/post hashes of a delta are the very
segment hashes the fingerprint is built from: applying a delta yields the target digest without
re-reading unchanged data twice.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence

import blake3
import numpy as np

SEGMENT_BYTES = 1 << 20
SEG_HASH_BYTES = 16
DIGEST_BYTES = 32
_TENSOR_DOMAIN = b"deltarefit.tensor.v1\0"
_CKPT_DOMAIN = b"deltarefit.checkpoint.v1\0"


def seg_hash(buf) -> bytes:
    """16-byte BLAKE3 hash of one segment (any bytes-like object or contiguous numpy array)."""
    if isinstance(buf, np.ndarray):
        buf = memoryview(np.ascontiguousarray(buf)).cast("B")
    return blake3.blake3(buf).digest(SEG_HASH_BYTES)


def n_segments(nbytes: int) -> int:
    return (nbytes + SEGMENT_BYTES - 1) // SEGMENT_BYTES


def segment_hashes(raw: np.ndarray) -> list[bytes]:
    """Hashes of every segment of a tensor's raw bytes (a 1-D uint8 array, e.g. an mmap view)."""
    return [seg_hash(raw[i : i + SEGMENT_BYTES]) for i in range(0, raw.size, SEGMENT_BYTES)]


def tensor_digest_from_segments(dtype: str, shape: Sequence[int], nbytes: int, seg_hashes: Iterable[bytes]) -> bytes:
    segs = b"".join(seg_hashes)
    if len(segs) != n_segments(nbytes) * SEG_HASH_BYTES:
        raise ValueError(f"expected {n_segments(nbytes)} segment hashes for {nbytes} bytes, "
                         f"got {len(segs) / SEG_HASH_BYTES:g}")
    head = struct.pack(f"<I{len(shape)}QQ", len(shape), *map(int, shape), int(nbytes))
    return blake3.blake3(_TENSOR_DOMAIN + dtype.encode("ascii") + b"\0" + head + segs).digest(DIGEST_BYTES)


def tensor_digest(dtype: str, shape: Sequence[int], raw: np.ndarray) -> bytes:
    """Digest of one tensor from its raw bytes (1-D uint8 array)."""
    return tensor_digest_from_segments(dtype, shape, raw.size, segment_hashes(raw))


def fingerprint_from_digests(digests: dict[str, bytes]) -> str:
    """Checkpoint fingerprint (hex) from ``{name: tensor_digest}``; independent of file layout."""
    return fingerprint_from_sorted(len(digests), ((n, digests[n]) for n in sorted(digests, key=lambda n: n.encode("utf-8"))))


def fingerprint_from_sorted(count: int, items: Iterable[tuple[str, bytes]]) -> str:
    """``fingerprint_from_digests`` of ``count`` ``(name, digest)`` pairs given in the order of their
    names' UTF-8 bytes, each name once (not checked): no dict of names is built."""
    h = blake3.blake3(_CKPT_DOMAIN)
    h.update(struct.pack("<Q", count))
    for name, digest in items:
        b = name.encode("utf-8")
        h.update(struct.pack("<I", len(b)) + b + digest)
    return h.hexdigest(DIGEST_BYTES)
