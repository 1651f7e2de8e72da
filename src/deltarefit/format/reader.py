"""The delta container's reader: ``DeltaReader`` opens a delta file and validates everything it can
before returning. See FORMAT.md.

Validated up front: header hash, limits, section layout, index hash, the manifest's compressed and
expanded size and JSON shape, its schema (every tensor entry), every chunk record (ranges, order,
sizes, encodings), and the digests the delta must agree with itself on. Payload hashes are checked
as chunks are read (``read_payload``). Nothing here decodes chunks or touches checkpoints.
"""

from __future__ import annotations

import os

from ..codec.chunk import ENCODING_NAMES, OVERWRITE, max_payload_len
from ..dtypes import dtype
from ..errors import FormatError, IntegrityError, LimitError
from ..integrity import (
    SEGMENT_BYTES,
    fingerprint_from_sorted,
    n_segments,
    seg_hash,
    tensor_digest_from_segments,
)
from ..io.fsutil import open_input
from ..io.jsonlimits import brief
from .layout import (
    FLAG_MANIFEST_ZSTD,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_MANIFEST_BYTES,
    MAX_RECORDS,
    RECORD,
    RECORD_SIZE,
    VERSION_ENCODINGS,
    ChunkRecord,
    ManifestBudget,
    TensorEntry,
    check_encodings,
    check_version,
)
from .manifest import _hex, read_manifest


class DeltaReader:
    """An opened, validated delta file. ``read_payload`` returns hash-checked chunk payloads."""

    def __init__(self, path: str) -> None:
        self.path = path
        # A regular file only, opened so that a FIFO given as the delta is refused, not hung on.
        self._f = os.fdopen(open_input(path, what="delta", error=FormatError), "rb")
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
        #: The container format version (1 or 2; FORMAT.md, "Versions"): the header's, which the manifest's
        #: ``version`` must equal.
        self.version = check_version(ver, p)
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
        # Memory before trust: what is kept of the manifest and the table is charged against their size as
        # it is built (FORMAT.md); the manifest's text is never whole in memory.
        budget = ManifestBudget(man_len + tab_len, tab_len // RECORD_SIZE, p)
        man, tensors = read_manifest(memoryview(index)[:man_len], p, budget)
        #: The manifest's top-level values but ``tensors`` (see ``manifest.KEPT``); None where it is not
        #: a JSON object. Its entries are ``tensors``.
        self.manifest = man
        self.records = [ChunkRecord(*_unpack_record(index, man_len + i * RECORD_SIZE, p))
                        for i in range(tab_len // RECORD_SIZE)]
        del index
        #: Bytes of memory charged for the entries and records kept (at most ``layout.memory_budget``).
        self.charged = budget.used
        self._validate(man, tensors)

    def _validate(self, man: dict | None, tensors: list[TensorEntry] | None) -> None:
        p = self.path
        if not isinstance(man, dict) or man.get("format") != "deltarefit.delta":
            raise FormatError(f"{p}: manifest is not a deltarefit.delta manifest")
        if man.get("version") != self.version or type(man.get("version")) is not int:
            raise FormatError(f"{p}: manifest says version {brief(man.get('version'))}, the header "
                              f"{self.version}; a delta's two versions are one")
        if man.get("hash") != "blake3-128":
            raise FormatError(f"{p}: unknown chunk hash {brief(man.get('hash'))} (expected 'blake3-128')")
        if man.get("segment_bytes") != SEGMENT_BYTES:
            raise FormatError(f"{p}: segment size {man.get('segment_bytes')} is not {SEGMENT_BYTES}")
        self.base_fingerprint = _hex(man.get("base_fingerprint"), f"{p}: base_fingerprint")
        self.target_fingerprint = _hex(man.get("target_fingerprint"), f"{p}: target_fingerprint")
        if tensors is None:
            raise FormatError(f"{p}: manifest has no tensor list")
        # Names strictly increasing, record ranges consecutive: checked as the entries were read.
        self.tensors: list[TensorEntry] = tensors
        nxt = tensors[-1].first + tensors[-1].count if tensors else 0
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
        ts = self.tensors  # sorted by name, each once (checked as read): no dict of names is built
        base = fingerprint_from_sorted(sum(e.base is not None for e in ts),
                                       ((e.name, e.base.digest) for e in ts if e.base is not None))
        target = fingerprint_from_sorted(sum(e.target is not None for e in ts),
                                         ((e.name, e.target.digest) for e in ts if e.target is not None))
        if base != self.base_fingerprint:
            raise IntegrityError(f"{p}: tensor base digests do not make the base fingerprint (corrupt delta)")
        if target != self.target_fingerprint:
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
        allowed = VERSION_ENCODINGS[self.version]
        for r in recs:
            w = f"{where} chunk {r.chunk_index}"
            if r.tensor_index != ti:
                raise FormatError(f"{w}: record names tensor #{r.tensor_index}, expected #{ti}")
            if r.chunk_index <= prev or r.chunk_index >= nseg:
                raise FormatError(f"{w}: chunk index out of order or beyond the tensor's {nseg} chunks")
            prev = r.chunk_index
            if r.encoding not in allowed:
                check_encodings(self.version, (r.encoding,), w)
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


def _unpack_record(buf: bytes, off: int, p: str) -> tuple:
    (ti, ci, enc, r1, r2, nch, poff, plen, dlen, ph, pre, post) = RECORD.unpack_from(buf, off)
    if r1 or r2:
        raise FormatError(f"{p}: chunk record #{off // RECORD_SIZE}: reserved bytes are not zero")
    return (ti, ci, enc, nch, poff, plen, dlen, ph, pre, post)
