"""The delta container's layout: header and chunk-record structs, limits, and the records and manifest
entries as typed values. See FORMAT.md.

What the writer (``format.writer``) and the reader (``format.reader``) share, and nothing that does
I/O: the byte layout of the fixed header and of a chunk record, the bounds a reader enforces (which
the writer also keeps, so that what readers refuse is never written), and the dataclasses a manifest's
tensor entries and a table's records become.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from ..dtypes import DTYPES
from ..integrity import SEG_HASH_BYTES

# The library's release (``deltarefit.__version__``, pyproject.toml's ``version``), which every delta names
# in its manifest's ``encoder``. It lives here, below the package's ``__init__``, so that the encoder
# (``encode``, ``compose``) names it without importing the package that imports the encoder.
RELEASE = "0.1.0"
MAGIC = b"DRDELTA\x00"
VERSION = 1  # the container format's version (the header's), not the release
HEADER = struct.Struct("<8sHHIQQQQQQ16s16s")
HEADER_SIZE = HEADER.size  # 96
RECORD = struct.Struct("<IIBBHIQII16s16s16s")
RECORD_SIZE = RECORD.size  # 80
SUM_BYTES = 16  # an additive digest (integrity.additive): two 64-bit lanes
MAX_MANIFEST_BYTES = 256 << 20
# A manifest's expanded size is also bounded by its compressed size: at most 1 MiB + 1024 times it.
# Real manifests expand 5-10x (each tensor has a digest of 32 random bytes), and about 220x at worst
# (100k tensors sharing one digest); a small file can't make the reader build hundreds of MiB.
MANIFEST_FLOOR = 1 << 20
MANIFEST_EXPANSION = 1024
# Shape bounds checked before the JSON is parsed (see jsonlimits): real manifests nest 5 levels and
# hold one array/object per 50-70 bytes.
MANIFEST_MAX_DEPTH = 8
MANIFEST_BYTES_PER_CONTAINER = 16
MAX_RECORDS = 1 << 26  # 64 Mi chunks = 64 TiB of tensor bytes in one delta
MAX_NDIM = 64
FLAG_MANIFEST_ZSTD = 1  # the manifest section is one zstd frame (the only layout v1 writes or reads)
OPS = ("same", "patch", "add", "remove", "replace")
ZERO_HASH = bytes(SEG_HASH_BYTES)


@dataclass(frozen=True)
class ChunkRecord:
    tensor_index: int
    chunk_index: int
    encoding: int
    n_changed: int
    payload_offset: int
    payload_len: int
    decoded_len: int
    payload_hash: bytes
    pre_hash: bytes
    post_hash: bytes

    def pack(self) -> bytes:
        return _pack_record(self.tensor_index, self.chunk_index, self.encoding, self.n_changed, self.payload_offset,
                            self.payload_len, self.decoded_len, self.payload_hash, self.pre_hash, self.post_hash)


def _pack_record(tensor_index: int, chunk_index: int, encoding: int, n_changed: int, payload_offset: int,
                 payload_len: int, decoded_len: int, payload_hash: bytes, pre_hash: bytes, post_hash: bytes) -> bytes:
    """A chunk record's table bytes (the two reserved fields zero)."""
    return RECORD.pack(tensor_index, chunk_index, encoding, 0, 0, n_changed, payload_offset, payload_len,
                       decoded_len, payload_hash, pre_hash, post_hash)


@dataclass(frozen=True)
class TensorMeta:
    dtype: str
    shape: tuple[int, ...]
    digest: bytes
    # Optional additive digest (``integrity.additive``, 16 bytes) of the same bits: lets a target that tracks
    # the digest of what it holds check a patch in O(changed elements) (FORMAT.md, "Held digests").
    sum: bytes | None = None

    @property
    def nbytes(self) -> int:
        n = DTYPES[self.dtype].itemsize
        for d in self.shape:
            n *= d
        return n

    def to_json(self) -> dict[str, Any]:
        out = {"dtype": self.dtype, "shape": list(self.shape), "digest": self.digest.hex()}
        if self.sum is not None:
            out["sum"] = self.sum.hex()
        return out


@dataclass(frozen=True)
class TensorEntry:
    name: str
    op: str
    base: TensorMeta | None
    target: TensorMeta | None
    changed: int  # changed elements (all target elements for add/replace)
    first: int  # index of its first chunk record
    count: int  # number of chunk records

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "op": self.op, "changed": self.changed, "first": self.first, "count": self.count,
            "base": self.base.to_json() if self.base else None,
            "target": self.target.to_json() if self.target else None,
        }


def manifest_limit(compressed_len: int) -> int:
    """The most bytes a manifest stored in ``compressed_len`` bytes may expand to (see FORMAT.md)."""
    return min(MAX_MANIFEST_BYTES, MANIFEST_FLOOR + MANIFEST_EXPANSION * compressed_len)
