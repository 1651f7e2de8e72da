"""The delta container's reader: ``DeltaReader`` opens a delta file and validates everything it can
before returning. See FORMAT.md.

Validated up front: header hash, limits, section layout, index hash, the manifest's compressed and
expanded size and JSON shape, its schema (every tensor entry), every chunk record (ranges, order,
sizes, encodings), and the digests the delta must agree with itself on. Payload hashes are checked
as chunks are read (``read_payload``). Nothing here decodes chunks or touches checkpoints.
"""

from __future__ import annotations

import json
import os
from typing import Any

import zstandard

from ..codec.chunk import ENCODING_NAMES, OVERWRITE, max_payload_len
from ..dtypes import DTYPES, dtype
from ..errors import FormatError, IntegrityError, LimitError, UnsupportedVersionError
from ..integrity import (
    DIGEST_BYTES,
    SEGMENT_BYTES,
    fingerprint_from_digests,
    n_segments,
    seg_hash,
    tensor_digest_from_segments,
)
from ..io.jsonlimits import brief, json_shape_problem
from .layout import (
    FLAG_MANIFEST_ZSTD,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MANIFEST_BYTES_PER_CONTAINER,
    MANIFEST_EXPANSION,
    MANIFEST_MAX_DEPTH,
    MAX_MANIFEST_BYTES,
    MAX_NDIM,
    MAX_RECORDS,
    OPS,
    RECORD,
    RECORD_SIZE,
    SUM_BYTES,
    VERSION,
    ChunkRecord,
    TensorEntry,
    TensorMeta,
    manifest_limit,
)


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
            man = json.loads(man_raw.decode("utf-8"), object_pairs_hook=_text_only)
        except _NotText as e:
            raise FormatError(f"{p}: manifest: {e}") from None
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
        raise FormatError(f"{where}: additive digest 'sum' must be {2 * SUM_BYTES} lowercase hex digits, got {brief(add)}")
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


class _NotText(ValueError):
    pass


def _text_only(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A manifest object, refused where a key or a string holds an unpaired surrogate escape: JSON
    can spell one, UTF-8 cannot encode it, so a tensor so named could be neither hashed, looked up
    in a checkpoint, nor written."""
    for k, v in pairs:
        for s in (k, v) if isinstance(v, str) else (k,):
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                raise _NotText(f"{ascii(s)[:80]} is not Unicode text (an unpaired surrogate escape)") from None
    return dict(pairs)
