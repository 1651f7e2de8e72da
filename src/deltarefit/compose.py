"""Compose a chain of deltas into one: applying it equals applying them in order, bit for bit.

Our chunks encode ulp distances in the context of the base's values, so decoding needs the base:
``compose`` reads the checkpoint the chain starts from (never writes it) and walks it chunk by chunk,
applying each delta's patch for that chunk in memory and re-encoding the end result against the
base. Memory is O(chunk); the chain is checked link by link (each delta's base is the previous
one's target) and every intermediate chunk against its pre-image hash.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import numpy as np

from .checkpoint.read import open_checkpoint
from .codec.chunk import ENCODING_NAMES, decode_chunk, encode_chunk
from .dtypes import dtype
from .encode import EncodeReport, tensor_meta, uint_view
from .errors import BaseMismatchError, UsageError, VerificationError
from .format import RELEASE, VERSION, DeltaReader, DeltaWriter, TensorEntry, check_version
from .integrity import SEGMENT_BYTES, fingerprint_from_digests, seg_hash


def compose(deltas: list[str], out: str, *, base: str, progress: Callable[[int], None] | None = None,
            format_version: int = VERSION) -> EncodeReport:
    """Write to ``out`` the delta equal to applying ``deltas`` in order to checkpoint ``base``.
    ``progress`` gets the bytes of ``base`` gone through (their sum is the checkpoint's size).
    ``format_version``: of the composed delta (2 by default, 1 for readers of version 1 only); the
    deltas composed may be of either."""
    fmt = check_version(format_version, "format_version")
    if not deltas:
        raise UsageError("compose needs at least one delta")
    t0 = time.perf_counter()
    readers = [DeltaReader(p) for p in deltas]
    try:
        for a, b in itertools.pairwise(readers):
            if a.target_fingerprint != b.base_fingerprint:
                raise UsageError(f"{b.path} does not apply to the target of {a.path}: not a chain; nothing was "
                                 "written. Give the deltas in the order they apply, the oldest first")
        for r in readers:
            odd = [e for e in r.tensors if e.op not in ("same", "patch")]
            if odd:
                raise UsageError(f"{r.path}: tensor {odd[0].name!r} is {odd[0].op}d; compose handles in-place "
                                 "changes only")
        first, last = readers[0], readers[-1]
        entries_by = [{e.name: e for e in r.tensors} for r in readers]
        recs_by = [{(e.name, c.chunk_index): c for e in r.tensors for c in r.chunks(e)} for r in readers]
        writer = DeltaWriter(out)
        try:
            with open_checkpoint(base) as ck:
                if set(ck.tensors) != set(entries_by[0]):
                    raise BaseMismatchError(f"{base}: its tensors are not the base of {first.path}")
                entries, counts, changed_total = _compose(ck, readers, entries_by, recs_by, writer, progress, fmt)
            base_d = {e.name: e.base.digest for e in entries}
            target_d = {e.name: e.target.digest for e in entries}
            if fingerprint_from_digests(base_d) != first.base_fingerprint:
                raise BaseMismatchError(f"{base}: fingerprint is not the base of {first.path}")
            if fingerprint_from_digests(target_d) != last.target_fingerprint:
                raise VerificationError(f"composed result does not reach the target of {last.path}")
            total = sum(int(np.prod(e.target.shape, dtype=np.int64)) for e in entries)
            full = sum(e.target.nbytes for e in entries)
            size = writer.finish({
                "format": "deltarefit.delta", "version": fmt, "segment_bytes": SEGMENT_BYTES,
                "hash": "blake3-128", "base_fingerprint": first.base_fingerprint,
                "target_fingerprint": last.target_fingerprint, "tensors": [e.to_json() for e in entries],
                "stats": {"changed_elements": changed_total, "target_elements": total, "target_bytes": full,
                          "encoder": f"deltarefit {RELEASE} compose of {len(readers)}"},
            })
        except BaseException:
            writer.abort()
            raise
    finally:
        for r in readers:
            r.close()
    return EncodeReport(out, first.base_fingerprint, last.target_fingerprint, size, full, changed_total, total,
                        time.perf_counter() - t0, counts)


def _compose(ck, readers, entries_by, recs_by, writer, progress=None, fmt=VERSION):
    entries: list[TensorEntry] = []
    counts = {n: 0 for n in ENCODING_NAMES.values()}
    changed_total = 0
    for ti, name in enumerate(sorted(entries_by[0], key=lambda n: n.encode("utf-8"))):
        e0 = entries_by[0][name]
        info = ck.tensors[name]
        if (info.dtype, tuple(info.shape)) != (e0.base.dtype, e0.base.shape):
            raise BaseMismatchError(f"tensor {name!r}: checkpoint holds {info.dtype}{list(info.shape)}, the chain "
                                    f"starts from {e0.base.dtype}{list(e0.base.shape)}")
        dt = dtype(info.dtype)
        raw = ck.raw(name)
        first_rec = writer.n_records
        pre_segs, post_segs, changed = [], [], 0
        for ci, off in enumerate(range(0, info.nbytes, SEGMENT_BYTES)):
            seg = raw[off:off + SEGMENT_BYTES]
            pre = seg_hash(seg)
            base_view = uint_view(seg, info.dtype)
            cur = base_view
            for k, r in enumerate(readers):
                rec = recs_by[k].get((name, ci))
                if rec is None:
                    continue
                if seg_hash(cur) != rec.pre_hash:
                    raise BaseMismatchError(f"{r.path}: tensor {name!r} chunk {ci}: the chain's bytes before this "
                                            "delta are not its pre-image")
                patch = decode_chunk(dt, cur, rec.encoding, r.read_payload(rec, f"tensor {name!r} chunk {ci}"),
                                     rec.n_changed, rec.decoded_len, f"{r.path}: tensor {name!r} chunk {ci}")
                cur = cur.copy()
                patch.apply_to(cur)
                if seg_hash(cur) != rec.post_hash:
                    raise VerificationError(f"{r.path}: tensor {name!r} chunk {ci}: decodes to bytes that miss the "
                                            "post-image hash")
            post = seg_hash(cur) if cur is not base_view else pre
            pre_segs.append(pre)
            post_segs.append(post)
            if post != pre:
                enc = encode_chunk(dt, base_view, cur, fmt=fmt)
                writer.add_chunk(ti, ci, enc.encoding, enc.n_changed, enc.payload, enc.decoded_len, pre, post)
                counts[ENCODING_NAMES[enc.encoding]] += 1
                changed += enc.n_changed
            if progress is not None:
                progress(seg.size)
        bmeta, tmeta = tensor_meta(info, pre_segs), tensor_meta(info, post_segs)
        count = writer.n_records - first_rec
        entries.append(TensorEntry(name, "patch" if count else "same", bmeta, tmeta, changed, first_rec, count))
        changed_total += changed
    return entries, counts, changed_total
