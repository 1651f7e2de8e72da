"""The delta container: fixed header, payload, JSON manifest, binary chunk table. See FORMAT.md.

``DeltaWriter`` streams payloads to a temp file and renames it into place only when complete.
``DeltaReader`` validates everything it can before returning: header hash, limits, index hash,
manifest schema, every chunk record (ranges, order, sizes); payload hashes are checked as chunks are
read. Nothing here decodes chunks or touches checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from dataclasses import dataclass
from typing import Any

import zstandard

from .codec.chunk import ENCODING_NAMES, OVERWRITE, max_payload_len
from .dtypes import DTYPES, dtype
from .errors import FormatError, IntegrityError, LimitError, UnsupportedVersionError
from .fsutil import fsync_dir
from .integrity import (
    DIGEST_BYTES,
    SEG_HASH_BYTES,
    SEGMENT_BYTES,
    fingerprint_from_digests,
    n_segments,
    seg_hash,
    tensor_digest_from_segments,
)
from .jsonlimits import brief, json_shape_problem

MAGIC = b"DRDELTA\x00"
VERSION = 1
HEADER = struct.Struct("<8sHHIQQQQQQ16s16s")
HEADER_SIZE = HEADER.size  # 96
RECORD = struct.Struct("<IIBBHIQII16s16s16s")
RECORD_SIZE = RECORD.size  # 80
SUM_BYTES = 16  # an additive digest (shard.digest): two 64-bit lanes
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
    # Optional additive digest (``shard.digest``, 16 bytes) of the same bits: lets a target that tracks
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


# --------------------------------------------------------------------------------------------- writer


class DeltaWriter:
    """Writes a delta file: ``add_chunk`` in table order, then ``finish``; the file appears atomically.
    ``durable=False`` skips the fsyncs: for a file that is staged to be copied elsewhere (the copy is
    made durable there) and read back by this process only; the rename stays atomic either way."""

    def __init__(self, path: str, *, durable: bool = True) -> None:
        self.path = path
        self.durable = durable
        self.tmp = f"{path}.tmp-{os.getpid()}"
        _remove_stale_temps(path)
        # Payloads average a few KiB: a 1 MiB buffer makes their writes a few large system calls.
        self._f = open(self.tmp, "wb", buffering=1 << 20)
        self._f.write(bytes(HEADER_SIZE))
        self._off = 0
        # Records go straight into the packed table: the encoder adds one per changed MiB, on the thread
        # that also feeds its workers, so a record costs one struct.pack and no object.
        self._table = bytearray()
        self.n_records = 0

    def add_chunk(self, tensor_index: int, chunk_index: int, encoding: int, n_changed: int, payload: bytes,
                  decoded_len: int, pre_hash: bytes, post_hash: bytes) -> None:
        self._f.write(payload)
        self._table += _pack_record(tensor_index, chunk_index, encoding, n_changed, self._off, len(payload),
                                    decoded_len, seg_hash(payload), pre_hash, post_hash)
        self.n_records += 1
        self._off += len(payload)

    @property
    def payload_bytes(self) -> int:
        return self._off

    def finish(self, manifest: dict[str, Any]) -> int:
        """Write manifest, table and header, fsync and rename into place. Returns the file size."""
        man = json.dumps(manifest, separators=(",", ":"), sort_keys=True).encode("utf-8")
        if len(man) > MAX_MANIFEST_BYTES:
            raise LimitError(f"{self.path}: manifest of {len(man)} bytes exceeds {MAX_MANIFEST_BYTES}")
        problem = json_shape_problem(man, max_depth=MANIFEST_MAX_DEPTH,
                                     bytes_per_container=MANIFEST_BYTES_PER_CONTAINER)
        if problem:  # what readers would refuse is never written
            raise LimitError(f"{self.path}: manifest {problem}")
        raw_len = len(man)
        # Level 1: on real manifests it came out smaller than level 9, and 5x faster.
        man = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(man)
        if raw_len > manifest_limit(len(man)):
            raise LimitError(f"{self.path}: manifest of {raw_len} bytes compresses to {len(man)}, past the "
                             f"expansion readers accept ({manifest_limit(len(man))} bytes)")
        table = bytes(self._table)
        self._f.write(man)
        self._f.write(table)
        payload_off = HEADER_SIZE
        man_off = payload_off + self._off
        head = HEADER.pack(MAGIC, VERSION, FLAG_MANIFEST_ZSTD, HEADER_SIZE, payload_off, self._off, man_off, len(man),
                           man_off + len(man), len(table), seg_hash(man + table), ZERO_HASH)
        head = head[:-16] + seg_hash(head[:-16])
        self._f.seek(0)
        self._f.write(head)
        self._f.flush()
        if self.durable:
            os.fsync(self._f.fileno())
        size = man_off + len(man) + len(table)
        self._f.close()
        os.replace(self.tmp, self.path)
        if self.durable:
            fsync_dir(os.path.dirname(os.path.abspath(self.path)))
        return size

    def abort(self) -> None:
        try:
            self._f.close()
        finally:
            if os.path.exists(self.tmp):
                os.unlink(self.tmp)


def _remove_stale_temps(path: str) -> None:
    """Remove ``path.tmp-PID`` files left by writers that were killed (their PID no longer runs)."""
    import glob

    for tmp in glob.glob(glob.escape(path) + ".tmp-*"):
        pid = tmp.rsplit("-", 1)[-1]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        except PermissionError:
            pass  # another user's live process


# --------------------------------------------------------------------------------------------- reader


class DeltaReader:
    """An opened, validated delta file. ``read_payload`` returns hash-checked chunk payloads."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self._f = open(path, "rb")
        except OSError as e:
            raise FormatError(f"{path}: cannot open delta ({e.strerror})") from None
        try:
            self._load()
        except BaseException:
            self._f.close()
            raise

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> DeltaReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _load(self) -> None:
        p = self.path
        size = os.fstat(self._f.fileno()).st_size
        head = self._f.read(HEADER_SIZE)
        if len(head) < 8 or head[:8] != MAGIC:
            raise FormatError(f"{p}: not a deltarefit delta (bad magic)")
        if len(head) < HEADER_SIZE:
            raise FormatError(f"{p}: truncated header ({len(head)} of {HEADER_SIZE} bytes)")
        (_, ver, flags, hsize, pay_off, pay_len, man_off, man_len, tab_off, tab_len, idx_hash,
         head_hash) = HEADER.unpack(head)
        if ver != VERSION:
            raise UnsupportedVersionError(f"{p}: format version {ver} is not supported (this build reads {VERSION})")
        if seg_hash(head[:-16]) != head_hash:
            raise IntegrityError(f"{p}: header hash mismatch (corrupt header)")
        if flags != FLAG_MANIFEST_ZSTD or hsize != HEADER_SIZE:
            raise FormatError(f"{p}: unknown header flags {flags:#x} or size {hsize}")
        if man_len > MAX_MANIFEST_BYTES:
            raise LimitError(f"{p}: manifest declares {man_len} bytes, limit {MAX_MANIFEST_BYTES}")
        if tab_len % RECORD_SIZE or tab_len // RECORD_SIZE > MAX_RECORDS:
            raise LimitError(f"{p}: chunk table of {tab_len} bytes is not a whole number of records or too large")
        if not (pay_off == HEADER_SIZE and man_off == pay_off + pay_len and tab_off == man_off + man_len
                and tab_off + tab_len == size):
            raise FormatError(
                f"{p}: section layout does not match the file size {size} "
                f"(payload {pay_off}+{pay_len}, manifest {man_off}+{man_len}, table {tab_off}+{tab_len}); "
                "truncated or appended to?"
            )
        self.payload_off, self.payload_len = pay_off, pay_len
        self._f.seek(man_off)
        index = self._f.read(man_len + tab_len)
        if len(index) != man_len + tab_len or seg_hash(index) != idx_hash:
            raise IntegrityError(f"{p}: manifest/table hash mismatch (corrupt or tampered index)")
        man_raw = _unzstd_manifest(index[:man_len], p)
        problem = json_shape_problem(man_raw, max_depth=MANIFEST_MAX_DEPTH,
                                     bytes_per_container=MANIFEST_BYTES_PER_CONTAINER)
        if problem:
            raise LimitError(f"{p}: manifest {problem}")
        try:
            man = json.loads(man_raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            # ValueError covers JSONDecodeError and integers past Python's digit limit; RecursionError
            # deep nesting. Hostile manifests must fail as format errors, not crash the reader.
            raise FormatError(f"{p}: manifest is not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None
        self.manifest = man
        self.records = [ChunkRecord(*_unpack_record(index, man_len + i * RECORD_SIZE, p))
                        for i in range(tab_len // RECORD_SIZE)]
        self._validate(man)

    def _validate(self, man: Any) -> None:
        p = self.path
        if not isinstance(man, dict) or man.get("format") != "deltarefit.delta" or man.get("version") != VERSION:
            raise FormatError(f"{p}: manifest is not a deltarefit.delta v{VERSION} manifest")
        if man.get("hash") != "blake3-128":
            raise FormatError(f"{p}: unknown chunk hash {brief(man.get('hash'))} (expected 'blake3-128')")
        if man.get("segment_bytes") != SEGMENT_BYTES:
            raise FormatError(f"{p}: segment size {man.get('segment_bytes')} is not {SEGMENT_BYTES}")
        self.base_fingerprint = _hex(man.get("base_fingerprint"), f"{p}: base_fingerprint")
        self.target_fingerprint = _hex(man.get("target_fingerprint"), f"{p}: target_fingerprint")
        ts = man.get("tensors")
        if not isinstance(ts, list):
            raise FormatError(f"{p}: manifest has no tensor list")
        self.tensors: list[TensorEntry] = []
        seen: set[str] = set()
        nxt = 0
        for i, t in enumerate(ts):
            e = _tensor_entry(t, f"{p}: tensor #{i}")
            if e.name in seen:
                raise FormatError(f"{p}: tensor {e.name!r} listed twice")
            seen.add(e.name)
            if e.first != nxt:
                raise FormatError(f"{p}: tensor {e.name!r}: chunk records start at {e.first}, expected {nxt}")
            nxt += e.count
            self.tensors.append(e)
        if nxt != len(self.records):
            raise FormatError(f"{p}: tensors claim {nxt} chunk records, table holds {len(self.records)}")
        off = 0
        for ti, e in enumerate(self.tensors):
            self._validate_chunks(ti, e, off)
            off += sum(r.payload_len for r in self.records[e.first:e.first + e.count])
        if off != self.payload_len:
            raise FormatError(f"{p}: chunk payloads cover {off} bytes, payload section holds {self.payload_len}")
        self._validate_digests()

    def _validate_digests(self) -> None:
        """The delta must agree with itself: tensor digests make the fingerprints, and the chunks of
        added or replaced tensors make their target digests. (A patched tensor's target digest also
        depends on its unchanged segments, so apply checks it against the checkpoint before writing.)"""
        p = self.path
        base = {e.name: e.base.digest for e in self.tensors if e.base is not None}
        target = {e.name: e.target.digest for e in self.tensors if e.target is not None}
        if fingerprint_from_digests(base) != self.base_fingerprint:
            raise IntegrityError(f"{p}: tensor base digests do not make the base fingerprint (corrupt delta)")
        if fingerprint_from_digests(target) != self.target_fingerprint:
            raise IntegrityError(f"{p}: tensor target digests do not make the target fingerprint (corrupt delta)")
        for e in self.tensors:
            if e.op in ("add", "replace"):
                posts = [r.post_hash for r in self.chunks(e)]
                if tensor_digest_from_segments(e.target.dtype, e.target.shape, e.target.nbytes, posts) != e.target.digest:
                    raise IntegrityError(f"{p}: tensor {e.name!r}: chunk post-images do not make its target digest "
                                         "(corrupt delta)")

    def _validate_chunks(self, ti: int, e: TensorEntry, off: int) -> None:
        p = self.path
        recs = self.records[e.first:e.first + e.count]
        meta = e.target if e.op in ("add", "replace") else e.base
        where = f"{p}: tensor {e.name!r}"
        if e.op in ("same", "remove") and recs:
            raise FormatError(f"{where}: op {e.op!r} cannot carry chunk records")
        if meta is None:
            return
        dt = dtype(meta.dtype)
        nseg = n_segments(meta.nbytes)
        if e.op in ("add", "replace") and len(recs) != nseg:
            raise FormatError(f"{where}: {e.op} needs all {nseg} chunks, has {len(recs)}")
        prev = -1
        changed = 0
        for r in recs:
            w = f"{where} chunk {r.chunk_index}"
            if r.tensor_index != ti:
                raise FormatError(f"{w}: record names tensor #{r.tensor_index}, expected #{ti}")
            if r.chunk_index <= prev or r.chunk_index >= nseg:
                raise FormatError(f"{w}: chunk index out of order or beyond the tensor's {nseg} chunks")
            prev = r.chunk_index
            if r.encoding not in ENCODING_NAMES or (e.op != "patch" and r.encoding != OVERWRITE):
                raise FormatError(f"{w}: encoding {r.encoding} not allowed for op {e.op!r}")
            n = min(SEGMENT_BYTES, meta.nbytes - r.chunk_index * SEGMENT_BYTES) // dt.itemsize
            if r.payload_len > max_payload_len(dt, n):
                raise LimitError(f"{w}: payload of {r.payload_len} bytes exceeds the limit {max_payload_len(dt, n)}")
            if r.decoded_len > 2 * n * dt.itemsize + 64:
                raise LimitError(f"{w}: declares {r.decoded_len} decoded bytes for {n} elements")
            if not (0 < r.n_changed <= n) and not (e.op != "patch" and 0 <= r.n_changed <= n):
                raise FormatError(f"{w}: {r.n_changed} changed elements in a chunk of {n}")
            if r.payload_offset != off:
                raise FormatError(f"{w}: payload at {r.payload_offset}, expected {off} (holes or overlap)")
            off += r.payload_len
            changed += r.n_changed
        if e.op == "patch" and changed != e.changed:
            raise FormatError(f"{where}: chunks change {changed} elements, manifest says {e.changed}")

    def read_payload(self, r: ChunkRecord, where: str) -> bytes:
        """A chunk's payload bytes, checked against the record's hash."""
        data = os.pread(self._f.fileno(), r.payload_len, self.payload_off + r.payload_offset)
        if len(data) != r.payload_len or seg_hash(data) != r.payload_hash:
            raise IntegrityError(f"{self.path}: {where}: payload hash mismatch (corrupt or truncated delta)")
        return data

    def chunks(self, e: TensorEntry) -> list[ChunkRecord]:
        return self.records[e.first:e.first + e.count]


def manifest_limit(compressed_len: int) -> int:
    """The most bytes a manifest stored in ``compressed_len`` bytes may expand to (see FORMAT.md)."""
    return min(MAX_MANIFEST_BYTES, MANIFEST_FLOOR + MANIFEST_EXPANSION * compressed_len)


def _unzstd_manifest(data: bytes, p: str) -> bytes:
    limit = manifest_limit(len(data))
    try:
        size = zstandard.get_frame_parameters(data).content_size
        if size == zstandard.CONTENTSIZE_UNKNOWN:
            raise FormatError(f"{p}: manifest zstd frame does not declare its content size")
        if size > limit:
            raise LimitError(f"{p}: manifest expands to {size} bytes from {len(data)}, limit {limit} "
                             f"(1 MiB + {MANIFEST_EXPANSION}x its compressed size, at most {MAX_MANIFEST_BYTES})")
        # The declared size is checked, and the output is capped too: a frame that lies about its
        # size fails here instead of growing.
        out = zstandard.ZstdDecompressor().decompress(data, max_output_size=limit)
        if len(out) != size:
            raise FormatError(f"{p}: manifest expands to {len(out)} bytes, its frame declares {size}")
        return out
    except zstandard.ZstdError as e:
        raise FormatError(f"{p}: manifest is not a valid zstd frame ({e})") from None


def _unpack_record(buf: bytes, off: int, p: str) -> tuple:
    (ti, ci, enc, r1, r2, nch, poff, plen, dlen, ph, pre, post) = RECORD.unpack_from(buf, off)
    if r1 or r2:
        raise FormatError(f"{p}: chunk record #{off // RECORD_SIZE}: reserved bytes are not zero")
    return (ti, ci, enc, nch, poff, plen, dlen, ph, pre, post)


def _hex(v: Any, where: str) -> str:
    if not isinstance(v, str) or len(v) != 2 * DIGEST_BYTES:
        raise FormatError(f"{where}: expected a {2 * DIGEST_BYTES}-digit hex digest")
    try:
        bytes.fromhex(v)
    except ValueError:
        raise FormatError(f"{where}: not hex") from None
    return v


def _meta(v: Any, where: str) -> TensorMeta | None:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise FormatError(f"{where}: expected an object")
    dt = v.get("dtype")
    if not isinstance(dt, str) or dt not in DTYPES:
        raise FormatError(f"{where}: unsupported dtype {brief(dt)}")
    shape = v.get("shape")
    if (not isinstance(shape, list) or len(shape) > MAX_NDIM
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 48 for d in shape)):
        raise FormatError(f"{where}: bad shape {brief(shape)}")
    add = v.get("sum")
    if add is not None and (not isinstance(add, str) or len(add) != 2 * SUM_BYTES
                            or any(c not in "0123456789abcdef" for c in add)):
        raise FormatError(f"{where}: additive digest 'sum' must be {2 * SUM_BYTES} lowercase hex digits")
    m = TensorMeta(dt, tuple(shape), bytes.fromhex(_hex(v.get("digest"), f"{where} digest")),
                   bytes.fromhex(add) if add is not None else None)
    if m.nbytes >= 1 << 50:
        raise LimitError(f"{where}: tensor of {m.nbytes} bytes exceeds the limit of {(1 << 50) - 1}")
    return m


def _tensor_entry(t: Any, where: str) -> TensorEntry:
    if not isinstance(t, dict) or not isinstance(t.get("name"), str):
        raise FormatError(f"{where}: expected an object with a name")
    where = f"{where.rsplit(':', 1)[0]}: tensor {t['name']!r}"
    op = t.get("op")
    if op not in OPS:
        raise FormatError(f"{where}: unknown op {brief(op)}")
    base, target = _meta(t.get("base"), f"{where} base"), _meta(t.get("target"), f"{where} target")
    need = {"same": (1, 1), "patch": (1, 1), "add": (0, 1), "remove": (1, 0), "replace": (1, 1)}[op]
    if (base is not None, target is not None) != (bool(need[0]), bool(need[1])):
        raise FormatError(f"{where}: op {op!r} needs base={bool(need[0])} target={bool(need[1])}")
    if op in ("same", "patch") and (base.dtype, base.shape) != (target.dtype, target.shape):
        raise FormatError(f"{where}: op {op!r} cannot change dtype or shape")
    if op == "same" and base.digest != target.digest:
        raise FormatError(f"{where}: op 'same' with different digests")
    ints = [t.get(k) for k in ("changed", "first", "count")]
    if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 62 for x in ints):
        raise FormatError(f"{where}: changed/first/count must be non-negative integers below 2**62, got {brief(ints)}")
    return TensorEntry(t["name"], op, base, target, *ints)
