"""Read-only library calls: fingerprint and verify checkpoints, inspect deltas."""

from __future__ import annotations

from typing import Any

from .checkpoint.read import fingerprint_checkpoint, open_checkpoint
from .codec.chunk import ENCODING_NAMES
from .dtypes import dtype
from .errors import UsageError, VerificationError
from .format import DeltaReader


def fingerprint(checkpoint: str, *, threads: int | None = None, progress=None) -> str:
    """The layout-independent fingerprint (hex) of a checkpoint file or directory. ``progress(n)``: told
    the bytes hashed, adding up to the tensors' bytes."""
    with open_checkpoint(checkpoint) as ck:
        return fingerprint_checkpoint(ck, threads=threads, progress=progress)[0]


def verify(checkpoint: str, expected: str, *, threads: int | None = None) -> str:
    """Raise VerificationError unless the checkpoint's fingerprint is ``expected``; returns it."""
    exp = expected.strip().lower()
    if len(exp) != 64 or any(c not in "0123456789abcdef" for c in exp):
        raise UsageError(f"expected fingerprint must be 64 hex digits, got {expected!r}; 'deltarefit fingerprint "
                         "CHECKPOINT' prints one")
    got = fingerprint(checkpoint, threads=threads)
    if got != exp:
        raise VerificationError(f"{checkpoint}: fingerprint {got} does not match expected {exp}")
    return got


def inspect(delta: str) -> dict[str, Any]:
    """Summary of a delta file (validated, payloads not decoded), JSON-ready.

    Per tensor: op, dtype, shape, elements, changed elements and fraction, encoded bytes and chunk count
    per encoding; totals (``encodings``: chunks per encoding name over the delta), the format version (the
    header's, which the manifest's equals), and the ratio of the target checkpoint's raw bytes to the delta
    file's size.
    """
    import os

    with DeltaReader(delta) as d:
        size = os.path.getsize(delta)
        tensors = []
        tot_el = tot_ch = full = 0
        counts: dict[str, int] = {}
        for e in d.tensors:
            meta = e.target or e.base
            n = meta.nbytes // dtype(meta.dtype).itemsize
            recs = d.chunks(e)
            enc: dict[str, int] = {}
            for r in recs:
                name = ENCODING_NAMES.get(r.encoding, f"encoding {r.encoding}")
                enc[name] = enc.get(name, 0) + 1
                counts[name] = counts.get(name, 0) + 1
            tensors.append({
                "name": e.name, "op": e.op, "dtype": meta.dtype, "shape": list(meta.shape), "elements": n,
                "changed": e.changed, "changed_fraction": e.changed / n if n else 0.0,
                "bytes": sum(r.payload_len for r in recs), "encodings": enc,
            })
            if e.target is not None:
                tot_el += n
                full += e.target.nbytes
            tot_ch += e.changed
        return {
            "path": delta, "format_version": d.version, "encodings": dict(sorted(counts.items())),
            "base_fingerprint": d.base_fingerprint, "target_fingerprint": d.target_fingerprint,
            "delta_bytes": size, "full_bytes": full, "ratio": full / size if size else 0.0,
            "total_elements": tot_el, "changed_elements": tot_ch,
            "changed_fraction": tot_ch / tot_el if tot_el else 0.0, "tensors": tensors,
        }
