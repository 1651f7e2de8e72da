"""The checks of the one apply protocol (``protocol``) around and after its write: a plan made ahead of
time checked again before the first write (``recheck_held``), each written chunk read back
(``check_written``, FORMAT.md "Applying" step 2), and step 3, every tensor's digest and the checkpoint
fingerprint against the delta's target (``target_digests``, ``check_fingerprint``)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..codec import elements
from ..errors import VerificationError
from ..format import DeltaReader, TensorEntry, TensorMeta
from ..integrity import fingerprint_from_digests, tensor_digest_from_segments
from .host import _changes, _moved, _where
from .plans import _ChunkPlan, _TensorPlan

# ``ap`` below is a ``protocol.Applier``, typed ``Any``: protocol imports this module.


def _digest(meta: TensorMeta, segs: list[bytes]) -> bytes:
    return tensor_digest_from_segments(meta.dtype, meta.shape, meta.nbytes, segs)


def recheck_held(ap: Any, plans: list[_TensorPlan]) -> None:
    """Before the first write of a plan made ahead of time: the elements each held-digest chunk whose
    patch the plan kept changes must hold the bits they held when planned (compared bit for bit where
    the plan kept them, ``ahead``; else the digest they move must be the one planned), so that the
    digest moves as checked (O(changed elements); refused with nothing written otherwise). Chunks the
    plan did not keep are checked so when decoded again for the write."""
    def check(e: TensorEntry, c: _ChunkPlan) -> None:
        view = ap._view(ap.segs.read_segment(e.name, c.rec.chunk_index), e.base.dtype)
        pos, new = _changes(c.patch, view)
        same = (elements.equal_at(view, pos, c.old) if c.old is not None and c.patch.dense is None
                else np.array_equal(_moved(e, c.rec, view, pos, new), c.moved))
        if not same:
            raise VerificationError(f"{_where(e, c.rec)}: an element it changes no longer holds the bits "
                                    "the prepared plan read (modified since; nothing written)")

    todo = [(tp.entry, c) for tp in plans if tp.state == "held" for c in tp.chunks
            if c.state == "todo" and c.patch is not None and not c.own and not c.split and c.moved is not None]
    if ap.collective or ap.threads == 1:
        for e, c in todo:
            check(e, c)
        return
    # (one pass over each touched cache line of the weights: memory-bound, so spread over the threads)
    with ThreadPoolExecutor(ap.threads, thread_name_prefix="recheck") as pool:
        for f in [pool.submit(check, e, c) for e, c in todo]:
            f.result()


def check_written(ap: Any, tp: _TensorPlan, c: _ChunkPlan, region: Any,
                  changes: tuple[np.ndarray, np.ndarray] | None, image: np.ndarray | None) -> None:
    """Chunk ``c`` of ``tp`` as it landed (``region``, read back from the target after its write): a
    held-digest chunk's ``changes`` (positions, target bits) must read back as written (O(changed
    elements)); a host region must equal the post-image the plan hashed (``image``, built again), byte
    for byte; a region elsewhere (a device) must hash to the chunk's post-image hash."""
    e, r = tp.entry, c.rec
    if changes is not None:
        if not elements.equal_at(ap._view(region, e.base.dtype), *changes):
            raise VerificationError(f"{_where(e, r)}: changed elements read back differ from the patch "
                                    "after writing")
    elif image is not None:
        if not np.array_equal(ap._view(region, e.base.dtype), image):
            raise VerificationError(f"{_where(e, r)}: region differs from its checked post-image after "
                                    "writing")
    elif ap._hash(region) != r.post_hash:
        raise VerificationError(f"{_where(e, r)}: region does not hash to the post-image after writing")


def target_digests(plans: list[_TensorPlan]) -> dict[str, bytes]:
    """Step 3: every tensor's digest after the write (name -> digest), each patched tensor's from its
    segment hashes, which must be the delta's target digest."""
    out: dict[str, bytes] = {}
    for tp in plans:
        e = tp.entry
        if e.target is None:
            continue
        if tp.state == "patch":
            got = _digest(e.target, tp.segs)
            if got != e.target.digest:
                raise VerificationError(f"{_where(e)}: digest after apply does not match the delta's target")
        # "held": checked through its additive digest in the plan, and each changed element read
        # back after the write (``HeldPlans.plan``, ``check_written``)
        out[e.name] = e.target.digest
    return out


def check_fingerprint(digests: dict[str, bytes], delta: DeltaReader) -> str:
    """Step 3: the fingerprint of ``digests``, which must be the delta's target fingerprint."""
    fp = fingerprint_from_digests(digests)
    if fp != delta.target_fingerprint:
        raise VerificationError(f"fingerprint after apply {fp[:16]}… is not the delta's target "
                                f"{delta.target_fingerprint[:16]}…")
    return fp
