"""The delta container's layout: header and chunk-record structs, limits, and the records and manifest
entries as typed values. See FORMAT.md.

What the writer (``format.writer``) and the reader (``format.reader``) share, and nothing that does
I/O: the byte layout of the fixed header and of a chunk record, the bounds a reader enforces (which
the writer also keeps, so that what readers refuse is never written), and the dataclasses a manifest's
tensor entries and a table's records become.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .._release import RELEASE as _RELEASE
from ..dtypes import DTYPES
from ..errors import FormatError, LimitError, UnsupportedVersionError
from ..integrity import SEG_HASH_BYTES

# The library's release (``deltarefit.__version__``, pyproject.toml's ``version``), which every delta names
# in its manifest's ``encoder`` (``encode``, ``compose``); defined in ``deltarefit._release``, which imports
# nothing.
RELEASE = _RELEASE
MAGIC = b"DRDELTA\x00"
VERSION = 2  # the container format's version (the header's) that writers write by default, not the release
VERSIONS = (1, 2)  # the container format versions this build reads (and writes, on request)
# The chunk encodings a delta of each format version may use (FORMAT.md, "Versions"): version 2 adds 6
# ``ulp2`` and 7 ``ulp2_hist``; a version 1 delta with either is refused.
VERSION_ENCODINGS = {1: frozenset({1, 2, 3, 4, 5}), 2: frozenset({1, 2, 3, 4, 5, 6, 7})}
HEADER = struct.Struct("<8sHHIQQQQQQ16s16s")
HEADER_SIZE = HEADER.size  # 96
RECORD = struct.Struct("<IIBBHIQII16s16s16s")
RECORD_SIZE = RECORD.size  # 80
SUM_BYTES = 16  # an additive digest (integrity.additive): two 64-bit lanes
MAX_MANIFEST_BYTES = 256 << 20  # the compressed manifest (the header's manifest_len)
# A manifest's expanded text is bounded by its compressed size: at most 1 MiB + 1024 times it, and 1 GiB
# (a manifest of 1M tensors is about 400 MB). Real manifests expand 5-10x (each tensor has a digest of 32
# random bytes), and 100-300x when many tensors share one digest. The text is never whole in memory (the
# reader decodes it as it is decompressed): this bounds the reader's time, not its memory.
MAX_MANIFEST_TEXT = 1 << 30
MANIFEST_FLOOR = 1 << 20
MANIFEST_EXPANSION = 1024
MANIFEST_WINDOW = 8 << 20  # the zstd window a manifest frame may need (level 19 needs 8 MiB, level 1 512 KiB)
MANIFEST_VALUE_CHARS = 256 << 10  # one tensor entry or one top-level value, as text (real ones: under 1 KiB)
# Memory before trust: what the reader keeps of a delta's manifest and chunk table (tensor entries and
# records, charged by ``ManifestBudget`` as they are built) is at most 32 MiB + 32 times the bytes of the
# manifest and table sections. Real deltas need 5-20 bytes per byte (an unshared digest is 32 random
# bytes in the file); the 32 MiB holds about 100k tensors that share one dtype, shape and digest.
MEMORY_FLOOR = 32 << 20
MEMORY_PER_INDEX_BYTE = 32
# Shape bounds checked before the JSON is parsed (see jsonlimits): real manifests nest 5 levels and
# hold one array/object per 50-70 bytes.
MANIFEST_MAX_DEPTH = 8
MANIFEST_BYTES_PER_CONTAINER = 16
MAX_RECORDS = 1 << 26  # 64 Mi chunks = 64 TiB of tensor bytes in one delta
MAX_NDIM = 64
FLAG_MANIFEST_ZSTD = 1  # the manifest section is one zstd frame (the only layout v1 writes or reads)
OPS = ("same", "patch", "add", "remove", "replace")
ZERO_HASH = bytes(SEG_HASH_BYTES)


@dataclass(frozen=True, slots=True)
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


@dataclass(frozen=True, slots=True)
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


@dataclass(frozen=True, slots=True)
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


def versions_read() -> str:
    """The versions this build reads, as the refusal of another names them: "1 and 2"."""
    return ", ".join(map(str, VERSIONS[:-1])) + " and " + str(VERSIONS[-1])


def check_version(version: object, where: str, what: str = "format version") -> int:
    """``version`` if this build reads it, else ``UnsupportedVersionError`` in one line naming the
    version found and the versions read."""
    if type(version) is not int or version not in VERSIONS:
        shown = repr(version)[:24] if type(version) is not int else str(version)
        raise UnsupportedVersionError(f"{where}: {what} {shown} is not supported; this build reads format versions "
                                      f"{versions_read()}")
    return version


def check_encodings(version: int, encodings: Iterable[int], where: str, what: str = "delta") -> None:
    """``FormatError`` naming the first of ``encodings`` that a ``what`` of format ``version`` may not hold."""
    odd = sorted(set(encodings) - VERSION_ENCODINGS[version])
    if odd:
        raise FormatError(f"{where}: encoding {odd[0]} is not one of a format version {version} {what}'s "
                          f"({', '.join(map(str, sorted(VERSION_ENCODINGS[version])))})")


def manifest_limit(compressed_len: int) -> int:
    """The most bytes a manifest stored in ``compressed_len`` bytes may expand to (see FORMAT.md)."""
    return min(MAX_MANIFEST_TEXT, MANIFEST_FLOOR + MANIFEST_EXPANSION * compressed_len)


def memory_budget(index_bytes: int) -> int:
    """The most bytes of entries and records a reader keeps for a delta whose manifest and chunk table
    sections hold ``index_bytes`` bytes (see FORMAT.md, "Memory before trust")."""
    return MEMORY_FLOOR + MEMORY_PER_INDEX_BYTE * index_bytes


# What the reader's objects cost (CPython 3.11, 64-bit, ``sys.getsizeof`` with its GC header), rounded
# up: an upper bound, so that what is charged is never less than what is kept. Each int is charged as a
# separate object (small ones are shared, which only makes the charge generous).
_INT = 36  # an int below 2**64
RECORD_COST = 112 + 8 + 3 * 49 + 7 * _INT + 16  # slots object, list slot, three 16-byte hashes, seven ints: 535
_ENTRY_COST = 88 + 8 + 3 * _INT + 24  # slots object, list slot (and growth), changed/first/count: 228
_META_COST = 64 + 65 + 40 + 16  # slots object, 32-byte digest, shape tuple: 185
_DIM_COST = 8 + _INT
_SUM_COST = 49


class ManifestBudget:
    """Charges the memory a reader keeps for a delta's records and tensor entries against
    ``memory_budget``; ``charge`` refuses (``LimitError``) the entry that would pass it. Reader and writer
    charge the same entries the same way (the writer never writes what readers refuse).

    A tensor's base and target metadata are charged once each, except where they are shared: the reader
    keeps one object for a target equal to its base, and for metadata equal to the previous entry's
    (``share``), and the charge follows it."""

    def __init__(self, index_bytes: int, n_records: int, where: str) -> None:
        self.where = where
        self.limit = memory_budget(index_bytes)
        self.index_bytes = index_bytes
        self.used = n_records * RECORD_COST
        self._prev: tuple = ()

    def share(self, metas: tuple) -> tuple:
        """``metas`` (an entry's base and target, ``TensorMeta`` or None, or any equal-comparing keys)
        with each replaced by the equal one kept before, where there is one: the previous entry's
        metadata, or its own base for the target. Charges the ones that are new."""
        out: list = []
        for m in metas:
            kept = m
            if m is not None:
                for k in (*out, *self._prev):
                    if k is not None and k == m:
                        kept = k
                        break
                else:
                    self.used += _meta_cost(m)
            out.append(kept)
        self._prev = tuple(out)
        return self._prev

    def charge(self, name: str, metas: tuple) -> tuple:
        """Charge a tensor entry named ``name`` with metadata ``metas`` (see ``share``, whose result
        this returns). Raises ``LimitError`` past the limit."""
        self.used += _ENTRY_COST + _str_cost(name)
        metas = self.share(metas)
        if self.used > self.limit:
            raise LimitError(f"{self.where}: manifest and chunk table ({self.index_bytes} bytes) need more than "
                             f"{self.limit} bytes of memory to read, the limit ({MEMORY_FLOOR >> 20} MiB + "
                             f"{MEMORY_PER_INDEX_BYTE}x their size; FORMAT.md, memory before trust)")
        return metas


def _str_cost(s: str) -> int:
    return 49 + len(s) if s.isascii() else 80 + 4 * len(s)


def _meta_cost(m) -> int:
    """A ``TensorMeta`` or its JSON form ``(dtype, shape, digest, sum)`` (the writer's key)."""
    shape, add = (m.shape, m.sum) if isinstance(m, TensorMeta) else (m[1], m[3])
    return _META_COST + _DIM_COST * len(shape) + (_SUM_COST if add is not None else 0)
