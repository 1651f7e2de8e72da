"""Apply a delta in place, safely: verify everything first, journal each chunk, verify the result.

Protocol (the crash-safety argument is in FORMAT.md, "Applying"):

1. **Plan (read only).** Hash every segment of every tensor the delta names. Each changed chunk must
   match its pre-image (to do), its post-image (already done by an earlier run) or, if torn by a kill
   mid-write, have a journal record from that run. Substituting pre-images for done chunks must give
   each tensor's base digest: a delta for another base is refused here, before any byte is written.
   Every chunk to do is decoded and its post-image hashed against the record, so a delta that decodes
   badly is refused here too.
2. **Write.** Per chunk: write its decoded patch to a journal slot, then scatter it into the mapped
   tensor, then compare the region with the post-image the plan hashed (built again in memory). Patches write target values (never XOR),
   so replaying a journal record over a torn chunk is idempotent.
3. **Verify.** Every tensor's digest and the checkpoint fingerprint must equal the delta's target;
   then the maps are flushed and the journal removed.

Structural changes (added, removed, re-typed tensors) rewrite the file holding them through a temp
file and an atomic rename; in-place patching covers everything else.

**Held digests** (``held=``, FORMAT.md "Held digests"): a target that keeps, for each tensor, the
additive digest (``shard.digest``) of exactly what it holds (a live engine, which computed it when
it last verified in full and moved it with every verified patch since) lets the plan skip the hashes.
A tensor is then checked in O(changed elements): each chunk is decoded against the segment as it is,
the digest moved by every change (old bits read from the target, new bits decoded) must give the
delta's additive target digest, and after the write every changed element is read back. Unchanged
elements are not re-read: their check is the held digest's own (``ApplyReport.held`` says how many
tensors were checked this way), and a full verification re-reads them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .checkpoint import INDEX_NAME, Checkpoint, TensorSource, open_checkpoint, write_safetensors
from .codec.chunk import Patch, decode_chunk, decode_new, scratch_array
from .dtypes import dtype
from .encode import default_threads, uint_view
from .errors import BaseMismatchError, UsageError, VerificationError
from .format import ChunkRecord, DeltaReader, TensorEntry, TensorMeta
from .integrity import (
    SEGMENT_BYTES,
    fingerprint_from_digests,
    n_segments,
    seg_hash,
    tensor_digest_from_segments,
)

log = logging.getLogger(__name__)

# Decoded patches kept from the plan phase for the write phase, so most chunks decode once.
DEFAULT_CACHE_BYTES = 512 << 20


class TensorTarget(Protocol):
    """What apply needs of a place holding tensors (a checkpoint, a dict of torch tensors).

    ``raw`` gives a tensor's bytes in checkpoint (row-major safetensors) order as one writable uint8
    array. A target whose tensors are not laid out that way (a live engine's parameters, where a
    checkpoint tensor may be rows of a fused parameter) implements ``SegmentTarget`` instead.
    """

    tensors: dict  # name -> object with .dtype (str), .shape (tuple), .nbytes (int)

    def raw(self, name: str) -> np.ndarray: ...


class SegmentTarget(Protocol):
    """A target read and written one segment at a time, in checkpoint coordinates.

    ``read_segment`` returns the bytes of segment ``ci`` of tensor ``name`` as they are now (a view or a
    gathered copy): its *region*. ``write_segment`` writes ``patch`` (target bits in segment element
    coordinates) into the tensor's storage; ``view`` is ``region`` seen as the dtype's unsigned integers
    (or as ``region_view`` below gives it), which the target may patch in place. It returns the
    segment's region as it is after the write, read back from the storage, which the applier hashes
    against the post-image. Only elements the patch names are written.

    Regions are host numpy bytes unless the target also has the region hooks (all optional; each one
    missing is the host's ``HOST_REGIONS`` method), for a target whose bytes live elsewhere (device
    memory) and are best hashed and decoded there:

    * ``hash_region(region) -> bytes``: the segment hash (``integrity.seg_hash``) of a region;
    * ``hash_segments(name) -> list[bytes]``: every segment hash of a tensor at once (then the plan
      reads only the regions of chunks it must decode);
    * ``region_view(region, dtype name)``: what ``decode_region``, ``post_image_hash`` and
      ``write_segment`` get as ``view``;
    * ``decode_region(delta, entry, record, view) -> patch``: a chunk decoded against its base view;
      the patch is the target's own (``positions`` and ``dense`` as in ``codec.chunk.Patch``);
    * ``post_image_hash(view, patch) -> bytes``: the hash ``view`` would have with ``patch`` applied,
      without writing it.

    The protocol (what is checked, and when) is the applier's alone. A journal needs host regions.
    """

    tensors: dict

    def read_segment(self, name: str, ci: int) -> np.ndarray: ...

    def write_segment(self, name: str, ci: int, region: np.ndarray, view: np.ndarray, patch: Patch) -> np.ndarray: ...


class RawSegments:
    """``SegmentTarget`` over a ``TensorTarget``: segments are slices of ``raw``, patched in place."""

    def __init__(self, target: TensorTarget) -> None:
        self.target = target
        self.tensors = target.tensors

    def read_segment(self, name: str, ci: int) -> np.ndarray:
        off = ci * SEGMENT_BYTES
        return self.target.raw(name)[off:off + SEGMENT_BYTES]

    def write_segment(self, name: str, ci: int, region: np.ndarray, view: np.ndarray, patch: Patch) -> np.ndarray:
        patch.apply_to(view)
        if view.ctypes.data != region.ctypes.data:  # misaligned data was patched in a copy
            region[:] = view.view(np.uint8)
        return region


def segments_of(target: TensorTarget | SegmentTarget) -> SegmentTarget:
    """The segment access the applier uses for ``target``."""
    return target if hasattr(target, "read_segment") else RawSegments(target)


@dataclass
class ApplyReport:
    target_fingerprint: str
    chunks_applied: int
    chunks_skipped: int  # already at their post-image (a rerun)
    chunks_recovered: int  # torn by an earlier kill, restored from the journal
    written_bytes: int
    seconds: float
    structural: list[str] = field(default_factory=list)  # tensors added, removed or replaced
    structural_ops: dict[str, str] = field(default_factory=dict)  # of those: name -> "add", "remove", "replace"
    # Tensors checked through the target's held digests (``run_apply(held=)``), not re-hashed, and the
    # additive digest each of them holds now (16 bytes).
    held: int = 0
    sums: dict[str, bytes] = field(default_factory=dict)
    # Chunks of a collective target's shared tensors that another process of the group holds whole:
    # decoded, checked and written there, not here (held-digest plans; ``LiveTarget.chunk_roles``).
    elsewhere: int = 0


@dataclass
class _ChunkPlan:
    rec: ChunkRecord
    state: str  # "todo", "done", "torn", "other" (held and written by another process of the group)
    patch: Patch | None = None
    moved: np.ndarray | None = None  # held-digest plan: how the chunk's changes move the tensor's digest
    own: bool = False  # a segment of a shared tensor that this process holds whole (no collective call)


@dataclass
class _TensorPlan:
    entry: TensorEntry
    state: str  # "patch", "held", "done", "add", "remove", "replace"
    segs: list[bytes] = field(default_factory=list)  # current segment hashes (patch tensors)
    chunks: list[_ChunkPlan] = field(default_factory=list)
    sum: np.ndarray | None = None  # "held": the additive digest after the patch


def _where(e: TensorEntry, r: ChunkRecord | None = None) -> str:
    return f"tensor {e.name!r}" + (f" chunk {r.chunk_index}" if r is not None else "")


def _matches(info: object, meta: TensorMeta) -> bool:
    return (info.dtype, tuple(info.shape)) == (meta.dtype, meta.shape)


def _digest(meta: TensorMeta, segs: list[bytes]) -> bytes:
    return tensor_digest_from_segments(meta.dtype, meta.shape, meta.nbytes, segs)


# ------------------------------------------------------------------------------------------- journal

JOURNAL_MAGIC = b"DRJRNL01"
_JHEAD = struct.Struct("<8s32sIIBIQ16s16s")  # magic, target fp, tensor idx, chunk idx, kind, n, len, post, hash
SLOT_BYTES = _JHEAD.size + SEGMENT_BYTES  # a record's body never exceeds one segment (see write)


class Journal:
    """Fixed slots, one per writer thread, each holding the patch of the chunk that thread is writing.

    Only a chunk whose slot record is complete (hash-checked) can be torn, because its region is
    written only after the record; replaying the record's target values over it is idempotent.
    """

    def __init__(self, path: str, target_fp: str) -> None:
        self.path = path
        self.fp = bytes.fromhex(target_fp)

    def read(self) -> dict[tuple[int, int], tuple[bytes, int, int, bytes]]:
        """Complete records for this delta's target: (tensor idx, chunk idx) -> (post hash, kind, n, body)."""
        out: dict[tuple[int, int], tuple[bytes, int, int, bytes]] = {}
        if not os.path.exists(self.path):
            return out
        with open(self.path, "rb") as f:
            while True:
                head = f.read(SLOT_BYTES)
                if len(head) < _JHEAD.size:
                    break
                magic, fp, ti, ci, kind, n, ln, post, h = _JHEAD.unpack_from(head)
                body = head[_JHEAD.size:_JHEAD.size + ln]
                if magic != JOURNAL_MAGIC or fp != self.fp or len(body) != ln or seg_hash(body) != h:
                    continue  # an empty, stale or half-written slot: its chunk was never touched
                out[(ti, ci)] = (post, kind, n, body)
        return out

    def open_for_write(self, slots: int) -> None:
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        self.slots = slots

    @staticmethod
    def record(patch: Patch, pre: np.ndarray) -> tuple[int, int, bytes]:
        """(kind, n, body) of a chunk's patch as the journal keeps it (``_journal_patch`` reads it back);
        ``pre`` is the chunk's current (pre-image) elements."""
        if patch.dense is None and patch.positions.size * (4 + patch.values.itemsize) > pre.nbytes:
            # A dense-ish sparse patch would outgrow its slot (and spill into the next one): record
            # the whole post-image instead, which is never larger than a segment.
            patch = Patch(None, None, _post_image(pre, patch))
        if patch.dense is not None:
            return 1, patch.dense.size, patch.dense.tobytes()
        return 0, patch.positions.size, patch.positions.astype("<u4").tobytes() + patch.values.tobytes()

    def write(self, slot: int, ti: int, ci: int, post: bytes, patch: Patch, pre: np.ndarray) -> None:
        """Journal a chunk's patch; ``pre`` is the chunk's current (pre-image) elements."""
        kind, n, body = self.record(patch, pre)
        if len(body) > SEGMENT_BYTES:
            raise AssertionError(f"journal record of {len(body)} bytes exceeds its slot")  # a bug, not bad input
        head = _JHEAD.pack(JOURNAL_MAGIC, self.fp, ti, ci, kind, n, len(body), post, seg_hash(body))
        os.pwrite(self._fd, head + body, slot * SLOT_BYTES)

    def remove(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)
            self._fd = None
        if os.path.exists(self.path):
            os.unlink(self.path)


def _journal_patch(rec: tuple[bytes, int, int, bytes], dt_name: str, n_elems: int) -> Patch | None:
    """A journal record as a patch for a chunk of ``n_elems`` elements, or None if it cannot be one."""
    _, kind, n, body = rec
    dt = dtype(dt_name)
    if kind == 1:
        if len(body) != n_elems * dt.itemsize:
            return None
        return Patch(None, None, np.frombuffer(body, dt.uint))
    if kind != 0 or not 0 < n <= n_elems or len(body) != n * (4 + dt.itemsize):
        return None
    pos = np.frombuffer(body, "<u4", n).astype(np.int64)
    if np.any(np.diff(pos) <= 0) or pos[-1] >= n_elems:
        return None
    return Patch(pos, np.frombuffer(body, dt.uint, n, 4 * n), None)


def journal_path(checkpoint_path: str) -> str:
    p = os.path.abspath(checkpoint_path)
    return os.path.join(p, ".deltarefit-journal") if os.path.isdir(p) else p + ".deltarefit-journal"


# ---------------------------------------------------------------------------------------------- plan


def _decode(delta: DeltaReader, e: TensorEntry, r: ChunkRecord, base_seg: np.ndarray | None) -> Patch:
    """Decode a chunk against its base segment, or (``base_seg`` None) a chunk of a new tensor."""
    where = f"{delta.path}: {_where(e, r)}"
    payload = delta.read_payload(r, _where(e, r))
    if base_seg is None:
        dt = dtype(e.target.dtype)
        n = min(SEGMENT_BYTES, e.target.nbytes - r.chunk_index * SEGMENT_BYTES) // dt.itemsize
        return Patch(None, None, decode_new(dt, n, r.encoding, payload, where))
    return decode_chunk(dtype(e.base.dtype), base_seg, r.encoding, payload, r.n_changed, r.decoded_len, where)


def _changes(patch: Patch, view: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(positions, target bits) of the elements ``patch`` changes in ``view`` (a dense patch: where
    it differs)."""
    if patch.dense is not None:
        pos = np.flatnonzero(patch.dense != view)
        return pos, patch.dense[pos]
    return patch.positions, patch.values


def _patched_copy(view: np.ndarray, patch: Patch) -> np.ndarray:
    """``view`` with ``patch`` applied, in this thread's scratch buffer (not a write to any target)."""
    img = scratch_array("post-image", view.size, view.dtype)
    if patch.dense is not None:
        img[:] = patch.dense
        return img
    img[:] = view
    if patch.positions is not None and patch.positions.size:
        img[patch.positions] = patch.values
    return img


def _moved(e: TensorEntry, r: ChunkRecord, view: np.ndarray, pos: np.ndarray, new: np.ndarray) -> np.ndarray:
    """How chunk ``r``'s changes (``pos`` in it, from ``view[pos]`` to ``new``) move tensor ``e``'s
    additive digest."""
    from .shard import digest as additive

    seed = additive.seeds(e.name, e.base.dtype, e.base.shape)
    return additive.change(seed, pos + r.chunk_index * (SEGMENT_BYTES // view.itemsize), view[pos], new)


def _post_image(seg: np.ndarray, patch: Patch) -> np.ndarray:
    img = seg.copy()
    patch.apply_to(img)
    return img


def _post_image_hash(seg: np.ndarray, patch: Patch) -> bytes:
    """Hash of ``seg`` with ``patch`` applied, built in this thread's scratch buffer (a fresh MiB per
    chunk costs page faults and an unmap)."""
    img = scratch_array("post-image", seg.size, seg.dtype)
    img[:] = seg
    patch.apply_to(img)
    return seg_hash(img)


class HostRegions:
    """The region hooks of a ``SegmentTarget`` whose regions are host numpy bytes (see its docstring)."""

    hash_region = staticmethod(seg_hash)
    region_view = staticmethod(uint_view)
    decode_region = staticmethod(_decode)
    post_image_hash = staticmethod(_post_image_hash)


HOST_REGIONS = HostRegions()


def _seg_len(nbytes: int, ci: int) -> int:
    return min(SEGMENT_BYTES, nbytes - ci * SEGMENT_BYTES)


def _patch_bytes(patch) -> int:
    """Memory a decoded patch holds (about 10 bytes per position of a sparse one)."""
    return patch.dense.nbytes if patch.dense is not None else len(patch.positions) * 10


class _Inline:
    """A stand-in for a thread pool that runs each task at once, on the calling thread, in order."""

    def __init__(self, *_a, **_k) -> None:
        self.failed: BaseException | None = None

    def __enter__(self) -> _Inline:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def map(self, fn, it):
        return [fn(x) for x in it]

    def submit(self, fn, *args):
        f: Future = Future()
        if self.failed is not None:  # after a failure the rest is not run (results are taken in order)
            f.set_exception(self.failed)
            return f
        try:
            f.set_result(fn(*args))
        except BaseException as e:  # delivered by result(), as a pool would
            self.failed = e
            f.set_exception(e)
        return f


class Applier:
    """One application of one delta to one ``TensorTarget`` or ``SegmentTarget``: ``plan``, then
    ``write``, then ``target_digests``.

    A target with ``collective = True`` (segments assembled from the parts several processes hold) is
    driven in one fixed order on the calling thread, so that every process reads and writes the same
    segments in the same order; after each tensor's plan and each chunk's write the target's
    ``agree(ok)`` tells whether every process succeeded, so that a refusal in one stops all of them at
    the same point, before any write.
    """

    def __init__(self, delta: DeltaReader, target: TensorTarget, *, journal: Journal | None,
                 threads: int | None = None, cache_bytes: int = DEFAULT_CACHE_BYTES,
                 progress: Callable[[int], None] | None = None,
                 held: Mapping[str, bytes] | None = None) -> None:
        self.d = delta
        self.t = target
        self.segs = segments_of(target)
        hooks = ("hash_region", "region_view", "decode_region", "post_image_hash")
        self._hash, self._view, self._decode, self._post_hash = (
            getattr(self.segs, h, getattr(HOST_REGIONS, h)) for h in hooks)
        self._hash_all = getattr(self.segs, "hash_segments", None)
        if journal is not None and any(hasattr(self.segs, h) for h in (*hooks, "hash_segments")):
            raise UsageError("a journal needs a target with host regions (journal records are host patches)")
        if held is not None and any(hasattr(self.segs, h) for h in (*hooks, "hash_segments")):
            raise UsageError("held digests need a target with host regions")
        self.held = held
        # Host regions are confirmed after a write by comparing them with the post-image the plan hashed,
        # built again from the patch (FORMAT.md, "Applying", step 2); a target with its own region hooks
        # (a device) re-hashes the region there.
        self._read_back = not any(hasattr(self.segs, h) for h in (*hooks, "hash_segments"))
        self.journal = journal
        self.threads = threads or default_threads()
        self.cache_left = cache_bytes
        self._cache_lock = threading.Lock()  # tensors are planned on several threads
        self.progress = progress
        self.recovered = journal.read() if journal else {}
        self.collective = bool(getattr(self.segs, "collective", False))
        self._pool = _Inline if self.collective else ThreadPoolExecutor
        self._roles = getattr(self.segs, "chunk_roles", None) if self.collective else None
        self._own_pool: ThreadPoolExecutor | None = None

    def _agreed(self, fn, *args):
        """``fn(*args)``; for a collective target, also the group's agreement that nobody failed."""
        if not self.collective:
            return fn(*args)
        try:
            out = fn(*args)
        except Exception:
            self.segs.agree(False)
            raise
        if not self.segs.agree(True):
            raise VerificationError("another process of the group refused or failed at the same step of this apply "
                                    "(see its log)")
        return out

    # -- plan ------------------------------------------------------------------------------------

    def plan(self) -> list[_TensorPlan]:
        known = {e.name for e in self.d.tensors}
        extra = [n for n in self.t.tensors if n not in known]
        if extra:
            raise BaseMismatchError(f"checkpoint holds tensor {extra[0]!r}, which the delta's base does not have "
                                    "(wrong base checkpoint?)")
        # Segments go to ``pool``; tensors are planned ``2 x threads`` at a time (``outer``), so that a
        # checkpoint of many one-segment tensors still keeps every core busy. Results are taken in
        # tensor order, so the error reported is the first bad tensor's, whatever the timing.
        # A collective target is planned on this thread, in one order; the segments a process holds
        # whole (held-digest plans) are decoded on its own threads meanwhile (``_plan_held_shared``).
        own = ThreadPoolExecutor(self.threads, thread_name_prefix="plan-own") if self._roles is not None else None
        self._own_pool = own
        with self._pool(self.threads, thread_name_prefix="plan") as pool, \
                self._pool(2 * self.threads, thread_name_prefix="plan-tensor") as outer:
            futs = [outer.submit(self._agreed, self._plan_tensor, pool, ti, e) for ti, e in enumerate(self.d.tensors)]
            try:
                return [f.result() for f in futs]
            finally:
                for f in futs:
                    f.cancel()
                if own is not None:
                    own.shutdown(wait=True, cancel_futures=True)
                self._own_pool = None

    def _plan_tensor(self, pool: ThreadPoolExecutor, ti: int, e: TensorEntry) -> _TensorPlan:
        info = self.t.tensors.get(e.name)
        w = _where(e)
        if e.op in ("same", "patch"):
            if info is None or not _matches(info, e.base):
                found = "missing" if info is None else f"{info.dtype}{list(info.shape)}"
                raise BaseMismatchError(f"{w}: expected {e.base.dtype}{list(e.base.shape)}, found {found} "
                                        "(wrong base checkpoint?)")
            held = self.held.get(e.name) if self.held is not None else None
            if held is not None and e.base.sum is not None and e.target.sum is not None:
                return self._plan_held(pool, e, held)
            return self._plan_patch(pool, ti, e)
        if e.op == "add":
            if info is None:
                return self._plan_new(pool, ti, e, "add")
            return self._plan_existing_target(pool, e, info)
        if e.op == "remove":
            if info is None:
                return _TensorPlan(e, "done")
            self._check_digest(pool, e, info, e.base, "base")
            return _TensorPlan(e, "remove")
        # replace
        if info is not None and _matches(info, e.base) and self._digest_of(pool, e.name) == e.base.digest:
            return self._plan_new(pool, ti, e, "replace")
        if info is None:
            raise BaseMismatchError(f"{w}: missing from the checkpoint (wrong base checkpoint?)")
        return self._plan_existing_target(pool, e, info)

    def _plan_existing_target(self, pool, e: TensorEntry, info) -> _TensorPlan:
        if not _matches(info, e.target):
            raise BaseMismatchError(f"{_where(e)}: found {info.dtype}{list(info.shape)}, which is neither the "
                                    "delta's base nor its target")
        self._check_digest(pool, e, info, e.target, "target")
        return _TensorPlan(e, "done")

    def _digest_of(self, pool, name: str) -> bytes:
        info = self.t.tensors[name]
        if self._hash_all is not None:
            segs = self._hash_all(name)
        else:
            segs = list(pool.map(lambda ci: self._hash(self.segs.read_segment(name, ci)),
                                 range(n_segments(info.nbytes))))
        return tensor_digest_from_segments(info.dtype, tuple(info.shape), info.nbytes, segs)

    def _check_digest(self, pool, e: TensorEntry, info, meta: TensorMeta, what: str) -> None:
        if self._digest_of(pool, e.name) != meta.digest:
            raise BaseMismatchError(f"{_where(e)}: bytes differ from the delta's {what} (wrong base checkpoint?)")

    def _plan_new(self, pool, ti: int, e: TensorEntry, state: str) -> _TensorPlan:
        def check(r: ChunkRecord) -> _ChunkPlan:
            patch = _decode(self.d, e, r, None)
            if seg_hash(patch.dense) != r.post_hash:
                raise VerificationError(f"{self.d.path}: {_where(e, r)}: decodes to bytes that miss the post-image "
                                        "hash (corrupt delta)")
            return _ChunkPlan(r, "todo", None)

        return _TensorPlan(e, state, chunks=list(pool.map(check, self.d.chunks(e))))

    def _plan_patch(self, pool, ti: int, e: TensorEntry) -> _TensorPlan:
        recs = {r.chunk_index: r for r in self.d.chunks(e)}
        known = self._hash_all(e.name) if self._hash_all is not None else None

        def seg(ci: int) -> tuple[bytes, _ChunkPlan | None]:
            region = None
            if known is None:
                region = self.segs.read_segment(e.name, ci)
                h = self._hash(region)
            else:
                h = known[ci]
            if self.progress:
                self.progress(_seg_len(e.base.nbytes, ci))
            r = recs.get(ci)
            if r is None:
                return h, None
            if h == r.post_hash:
                return h, _ChunkPlan(r, "done")
            if h == r.pre_hash:
                view = self._view(region if region is not None else self.segs.read_segment(e.name, ci),
                                  e.base.dtype)
                patch = self._decode(self.d, e, r, view)
                if self._post_hash(view, patch) != r.post_hash:
                    raise VerificationError(f"{self.d.path}: {_where(e, r)}: decodes to bytes that miss the "
                                            "post-image hash (corrupt delta)")
                return h, _ChunkPlan(r, "todo", patch)
            rec = self.recovered.get((ti, ci))
            if rec is not None and rec[0] == r.post_hash:  # a journal: host regions, read above
                view = uint_view(region, e.base.dtype)
                patch = _journal_patch(rec, e.base.dtype, view.size)
                if patch is not None and _post_image_hash(view, patch) == r.post_hash:
                    return h, _ChunkPlan(r, "torn", patch)
            raise BaseMismatchError(f"{_where(e, r)}: bytes match neither the delta's base nor its target "
                                    "(wrong base checkpoint, or modified since?)")

        results = list(pool.map(seg, range(n_segments(e.base.nbytes))))
        segs = [h for h, _ in results]
        chunks = [c for _, c in results if c is not None]
        # Base check: with pre-images in place of chunks already done, the digest must be the base's.
        pre = list(segs)
        for c in chunks:
            pre[c.rec.chunk_index] = c.rec.pre_hash
        if _digest(e.base, pre) != e.base.digest:
            raise BaseMismatchError(f"{_where(e)}: bytes differ from the delta's base (wrong base checkpoint?)")
        post = list(pre)
        for c in chunks:
            post[c.rec.chunk_index] = c.rec.post_hash
        if _digest(e.target, post) != e.target.digest:
            raise VerificationError(f"{self.d.path}: {_where(e)}: chunk post-images do not make the target digest "
                                    "(corrupt delta)")
        # keep decoded patches within the memory budget, re-decode the rest later (a torn chunk's patch,
        # from the journal, cannot be re-decoded: it is always kept)
        self._keep_within_budget([c for c in chunks if c.patch is not None and c.state == "todo"])
        return _TensorPlan(e, "patch", segs, chunks)

    def _keep_within_budget(self, chunks: list[_ChunkPlan]) -> None:
        """Keep the decoded patches of ``chunks`` while the plan's memory budget lasts; drop the rest
        (their chunks are decoded again when written)."""
        for c in chunks:
            if c.patch is None:  # held and written elsewhere
                continue
            size = _patch_bytes(c.patch)
            with self._cache_lock:
                keep = size <= self.cache_left
                if keep:
                    self.cache_left -= size
            if not keep:
                c.patch = None

    def _plan_held(self, pool, e: TensorEntry, held: bytes) -> _TensorPlan:
        """The held-digest plan of a ``same``/``patch`` tensor (module docstring): decode every chunk
        against the segment as it is, and require the digest moved by the changes to be the target's."""
        from .shard import digest as additive

        if held == e.target.sum and held != e.base.sum:  # already at the target (a rerun)
            return _TensorPlan(e, "held", chunks=[_ChunkPlan(r, "done") for r in self.d.chunks(e)],
                               sum=np.frombuffer(held, "<u8").astype(np.uint64))
        if held != e.base.sum:
            raise BaseMismatchError(f"{_where(e)}: the digest held of its bytes is not the delta's base (wrong base "
                                    "checkpoint, or modified since?)")

        def chunk(r: ChunkRecord, own: bool = False) -> _ChunkPlan:
            read = self.segs.read_own if own else self.segs.read_segment
            view = self._view(read(e.name, r.chunk_index), e.base.dtype)
            patch = self._decode(self.d, e, r, view)
            if self.progress:
                self.progress(_seg_len(e.base.nbytes, r.chunk_index))
            return _ChunkPlan(r, "todo", patch, _moved(e, r, view, *_changes(patch, view)), own)

        total = np.frombuffer(held, "<u8").astype(np.uint64)
        roles = self._roles(e.name) if self._roles is not None else None
        if roles is None:
            chunks = list(pool.map(chunk, self.d.chunks(e)))
        else:
            chunks, moved = self._plan_held_shared(e, roles, chunk)
            total = additive.add(total, moved)
        for c in chunks:
            if c.moved is not None and not c.own:
                total = additive.add(total, c.moved)
        if np.asarray(total, "<u8").tobytes() != e.target.sum:
            raise VerificationError(f"{self.d.path}: {_where(e)}: its post-image, the held digest moved by the decoded "
                                    "changes, misses the delta's target digest (corrupt delta, or the elements it "
                                    "changes differ from its base)")
        self._keep_within_budget(chunks)  # the rest is decoded again, and checked, when written
        return _TensorPlan(e, "held", chunks=chunks, sum=total)

    def _plan_held_shared(self, e: TensorEntry, roles: list[str],
                          chunk: Callable[..., _ChunkPlan]) -> tuple[list[_ChunkPlan], np.ndarray]:
        """The chunks of a shared tensor for a held-digest plan, and the group's sum of the digest moves
        of the chunks its processes hold whole. Those are decoded once, by their holder, on its threads;
        the chunks split between processes are decoded by each on this thread, in one order (their
        segments are assembled over the group). Every process makes the same collective calls whatever
        fails, then refuses if any did."""
        from .shard import digest as additive

        recs = self.d.chunks(e)
        futs = {r.chunk_index: self._own_pool.submit(chunk, r, True) for r in recs if roles[r.chunk_index] == "mine"}
        out: list[_ChunkPlan] = []
        err: BaseException | None = None
        try:
            for r in recs:
                if roles[r.chunk_index] == "group":
                    out.append(chunk(r))
                elif roles[r.chunk_index] == "other":
                    out.append(_ChunkPlan(r, "other"))
                else:
                    try:
                        out.append(futs[r.chunk_index].result())
                    except Exception as ex:
                        err = err or ex
        finally:
            for f in futs.values():
                f.cancel()
        local = additive.ZERO.copy()
        if err is None:
            for c in out:
                if c.own:
                    local = additive.add(local, c.moved)
        moved, ok = self.segs.group_sum(local, err is None)
        if err is not None:
            raise err
        if not ok:
            raise VerificationError("another process of the group refused or failed at the same step of this apply "
                                    "(see its log)")
        return out, moved

    # -- write -----------------------------------------------------------------------------------

    def write(self, plans: list[_TensorPlan]) -> tuple[int, int, int, int]:
        applied = skipped = recovered = written = 0
        slots: dict[int, int] = {}
        lock = threading.Lock()

        def slot() -> int:
            tid = threading.get_ident()
            with lock:
                return slots.setdefault(tid, len(slots))

        if self.journal:
            self.journal.open_for_write(self.threads)

        def do(tp: _TensorPlan, ti: int, c: _ChunkPlan) -> int:
            e, r = tp.entry, c.rec
            if c.state == "other":  # held whole, and written, by another process of the group
                return 0
            region = (self.segs.read_own if c.own else self.segs.read_segment)(e.name, r.chunk_index)
            view = self._view(region, e.base.dtype)
            patch = c.patch or self._decode(self.d, e, r, view)
            if tp.state == "held":
                pos, new = _changes(patch, view)  # before the write: ``view`` may be the target's memory
                # decoded again (outside the memory budget): it must move the digest as the checked plan did
                if c.patch is None and not np.array_equal(_moved(e, r, view, pos, new), c.moved):
                    raise VerificationError(f"{_where(e, r)}: decodes differently from its checked plan")
            elif self._read_back:  # the post-image the plan checked, built again (a copy, not a hash)
                img = _patched_copy(view, patch)
            if c.state == "todo" and self.journal:
                self.journal.write(slot(), ti, r.chunk_index, r.post_hash, patch, view)
            region = (self.segs.write_own if c.own else self.segs.write_segment)(e.name, r.chunk_index, region, view,
                                                                                 patch)
            if tp.state == "held":  # O(changed elements): what was written is read back
                if not np.array_equal(self._view(region, e.base.dtype)[pos], new):
                    raise VerificationError(f"{_where(e, r)}: changed elements read back differ from the patch "
                                            "after writing")
            elif self._read_back:
                # What landed must be the post-image the plan hashed: compared with it, byte for byte.
                if not np.array_equal(self._view(region, e.base.dtype), img):
                    raise VerificationError(f"{_where(e, r)}: region differs from its checked post-image after "
                                            "writing")
            elif self._hash(region) != r.post_hash:
                raise VerificationError(f"{_where(e, r)}: region does not hash to the post-image after writing")
            if tp.state != "held":
                tp.segs[r.chunk_index] = r.post_hash
            c.patch = None
            return _seg_len(e.base.nbytes, r.chunk_index)

        for state in ("torn", "todo"):
            # Torn chunks go first and alone: their only copy is a journal slot that the next new
            # chunk written by the same slot number would overwrite.
            with self._pool(self.threads if state == "todo" else 1, thread_name_prefix="apply") as pool:
                # Another process's chunks take their turn here too (doing nothing), so that every process
                # of a group agrees after the same steps.
                futs = [pool.submit(self._agreed, do, tp, ti, c) for ti, tp in enumerate(plans)
                        if tp.state in ("patch", "held") for c in tp.chunks
                        if c.state == state or (state == "todo" and c.state == "other")]
                try:
                    for f in futs:
                        written += f.result()
                finally:
                    for f in futs:
                        f.cancel()
        for tp in (tp for tp in plans if tp.state in ("patch", "held")):
            applied += sum(1 for c in tp.chunks if c.state == "todo")
            skipped += sum(1 for c in tp.chunks if c.state == "done")
            recovered += sum(1 for c in tp.chunks if c.state == "torn")
        return applied, skipped, recovered, written

    # -- verify ----------------------------------------------------------------------------------

    def target_digests(self, plans: list[_TensorPlan]) -> dict[str, bytes]:
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
            # back after the write (``_plan_held``, ``write``)
            out[e.name] = e.target.digest
        return out


def run_apply(delta: DeltaReader, target: TensorTarget, *, journal: Journal | None, threads: int | None = None,
              cache_bytes: int = DEFAULT_CACHE_BYTES, progress: Callable[[int], None] | None = None,
              structural: Callable[[DeltaReader, list[_TensorPlan]], list[str]] | None = None,
              structural_check: Callable[[list[_TensorPlan]], None] | None = None,
              held: Mapping[str, bytes] | None = None,
              before_write: Callable[[], None] | None = None) -> ApplyReport:
    """Plan, write, verify (see the module docstring). ``structural`` performs added/removed/re-typed
    tensors after the in-place patches; ``structural_check`` may refuse them, before any write.
    ``held``: tensor name -> the additive digest of what the target holds now, which the caller
    vouches for (module docstring, "Held digests"); tensors it names are checked through it when the
    delta carries their additive target digest. ``before_write()`` runs once the plan passed, before
    the first write; it may refuse (raise), and then nothing is written (a subscriber that planned on
    a part still downloading checks the whole part against its record there)."""
    t0 = time.perf_counter()
    ap = Applier(delta, target, journal=journal, threads=threads, cache_bytes=cache_bytes, progress=progress,
                 held=held)
    plans = ap.plan()
    struct_todo = [tp for tp in plans if tp.state in ("add", "remove", "replace")]
    if struct_todo and structural is None:
        raise UsageError(f"tensor {struct_todo[0].entry.name!r} is {struct_todo[0].entry.op}d by this delta, "
                         "which this target cannot do in place")
    if struct_todo and structural_check is not None:
        structural_check(struct_todo)
    if before_write is not None:
        before_write()
    applied, skipped, recovered, written = ap.write(plans)
    names = structural(delta, plans) if struct_todo else []
    digests = ap.target_digests(plans)
    fp = fingerprint_from_digests(digests)
    if fp != delta.target_fingerprint:
        raise VerificationError(f"fingerprint after apply {fp[:16]}… is not the delta's target "
                                f"{delta.target_fingerprint[:16]}…")
    held_plans = [tp for tp in plans if tp.state == "held"]
    return ApplyReport(fp, applied, skipped, recovered, written, time.perf_counter() - t0, names, held=len(held_plans),
                       sums={tp.entry.name: np.asarray(tp.sum, "<u8").tobytes() for tp in held_plans},
                       elsewhere=sum(c.state == "other" for tp in held_plans for c in tp.chunks))


# ------------------------------------------------------------------------------- safetensors on disk


REPLACED_LIST = ".deltarefit-replaced.json"


def _indexed(ck: Checkpoint) -> str | None:
    """The index file of a Hugging Face directory checkpoint, or None."""
    idx = os.path.join(ck.path, INDEX_NAME)
    return idx if os.path.isdir(ck.path) and os.path.exists(idx) else None


def _check_structural(ck: Checkpoint, todo: list[_TensorPlan]) -> None:
    if len(ck.files()) != 1 and _indexed(ck) is None:
        e = todo[0].entry
        raise UsageError(f"{ck.path}: tensor {e.name!r} is {e.op}d by this delta; adding, removing or re-typing "
                         "tensors needs a single-file checkpoint or a directory with "
                         f"{INDEX_NAME}, and this one has several files and no index")


def _source(name: str, meta: TensorMeta, chunks: Callable[[], object]) -> TensorSource:
    return TensorSource(name, meta.dtype, meta.shape, meta.nbytes, chunks)


def _raw_chunks(raw: np.ndarray) -> Callable[[], Iterator[np.ndarray]]:
    return lambda: (raw[o:o + SEGMENT_BYTES] for o in range(0, raw.size, SEGMENT_BYTES))


def _rewrite_indexed_dir(ck: Checkpoint, delta: DeltaReader, plans: list[_TensorPlan]) -> list[str]:
    """Structural changes in a directory with an index: only the shards they touch are rewritten, under
    new names; then the index is replaced (the commit point: before it the old shards and index are
    intact, after it the new ones are); then the replaced shards are deleted. A kill between the
    commit and the deletes leaves them listed in ``.deltarefit-replaced.json`` for the next run."""
    import json

    from .fsutil import write_atomic

    idx_path = _indexed(ck)
    with open(idx_path) as f:
        index = json.load(f)
    tag = delta.target_fingerprint[:12]
    by_name = {tp.entry.name: tp for tp in plans}
    file_of = {n: os.path.basename(i.file) for n, i in ck.tensors.items()}
    touched = sorted({file_of[n] for n, tp in by_name.items() if tp.state in ("remove", "replace")})
    new_name = {f: f"{f.removesuffix('.safetensors')}.dr-{tag}.safetensors" for f in touched}
    groups: dict[str, list[TensorSource]] = {}
    weight_map: dict[str, str] = {}
    changed: list[str] = []
    for e in delta.tensors:
        tp = by_name[e.name]
        if tp.state in ("add", "remove", "replace"):
            changed.append(e.name)
        if e.target is None:
            continue
        if tp.state == "add":
            dest = f"model-added.dr-{tag}.safetensors"
        else:
            dest = new_name.get(file_of[e.name], file_of[e.name])
        weight_map[e.name] = dest
        if dest == file_of.get(e.name) and tp.state != "replace":
            continue  # untouched shard: stays as it is
        chunks = (lambda e=e: _new_tensor_chunks(delta, e)) if tp.state in ("add", "replace") \
            else _raw_chunks(ck.raw(e.name))
        groups.setdefault(dest, []).append(_source(e.name, e.target, chunks))
    for dest, sources in groups.items():
        old = next((f for f, n in new_name.items() if n == dest), None)
        meta = _metadata_of(os.path.join(ck.path, old)) if old else None
        # A rewritten shard keeps its old file's mode; a new one (added tensors) takes the index's.
        write_safetensors(os.path.join(ck.path, dest), sources, metadata=meta,
                          mode=_mode_of(os.path.join(ck.path, old) if old else idx_path))
    write_atomic(os.path.join(ck.path, REPLACED_LIST), json.dumps(touched).encode())
    write_atomic(idx_path, json.dumps({"metadata": index.get("metadata", {}), "weight_map": weight_map},
                                      indent=2, sort_keys=True).encode(), mode=_mode_of(idx_path))
    remove_replaced_shards(ck.path)
    return changed


def remove_replaced_shards(directory: str) -> None:
    """Delete shards a committed structural rewrite replaced (those its index no longer names)."""
    import json

    listing = os.path.join(directory, REPLACED_LIST)
    if not os.path.exists(listing):
        return
    with open(listing) as f:
        replaced = json.load(f)
    with open(os.path.join(directory, INDEX_NAME)) as f:
        live = set(json.load(f).get("weight_map", {}).values())
    for name in replaced:
        if isinstance(name, str) and name not in live and "/" not in name and name.endswith(".safetensors"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))
    os.unlink(listing)


def _rewrite_file(ck: Checkpoint, delta: DeltaReader, plans: list[_TensorPlan]) -> list[str]:
    """Structural changes in a single-file checkpoint: write the target file whole, then rename it in."""
    files = ck.files()
    by_name = {tp.entry.name: tp for tp in plans}
    sources: list[TensorSource] = []
    changed: list[str] = []
    for e in delta.tensors:
        tp = by_name[e.name]
        if e.target is None:
            if tp.state == "remove":
                changed.append(e.name)
            continue
        if tp.state in ("add", "replace"):
            changed.append(e.name)
            sources.append(_source(e.name, e.target, lambda e=e: _new_tensor_chunks(delta, e)))
        else:
            sources.append(_source(e.name, e.target, _raw_chunks(ck.raw(e.name))))
    write_safetensors(files[0], sources, metadata=_metadata_of(files[0]), mode=_mode_of(files[0]))
    return changed


def _mode_of(file: str) -> int:
    """Permission bits a rewritten file keeps (a 0600 checkpoint must not become 0644)."""
    return stat.S_IMODE(os.stat(file).st_mode)


def _new_tensor_chunks(delta: DeltaReader, e: TensorEntry) -> Iterator[bytes]:
    for r in delta.chunks(e):
        patch = _decode(delta, e, r, None)
        data = patch.dense.tobytes()
        if seg_hash(data) != r.post_hash:
            raise VerificationError(f"{_where(e, r)}: decoded bytes miss the post-image hash")
        yield data


def _metadata_of(file: str) -> dict[str, str] | None:
    import json

    with open(file, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
    meta = head.get("__metadata__")
    return meta if isinstance(meta, dict) else None


def checkpoint_lock(checkpoint_path: str) -> contextlib.AbstractContextManager[None]:
    """The exclusive lock of a checkpoint (file or directory) that apply, check and sync hold: a second
    run on it is refused with ``LockedError`` instead of racing the first one's journal and temps."""
    from .locks import exclusive, lock_path_beside

    return exclusive(lock_path_beside(checkpoint_path), f"checkpoint {checkpoint_path}")


# Temp files the structural rewrite leaves when killed (write_safetensors / write_atomic naming).
_DIR_TEMPS = (r".+\.safetensors", re.escape(INDEX_NAME), re.escape(REPLACED_LIST))


def remove_dead_temps_of(checkpoint_path: str) -> list[str]:
    """Remove temp files a killed apply left in or beside the checkpoint (a shard-sized
    ``NAME.tmp-PID`` of a structural rewrite), those whose writer is dead. Call under its lock."""
    from .locks import remove_dead_temps, temp_pattern

    p = os.path.abspath(checkpoint_path)
    if os.path.isdir(p):
        removed = remove_dead_temps(p, temp_pattern(*_DIR_TEMPS))
    else:
        removed = remove_dead_temps(os.path.dirname(p), temp_pattern(re.escape(os.path.basename(p))))
    for r in removed:
        log.info("removed %s, left by a killed run", r)
    return removed


def apply(delta_path: str, checkpoint_path: str, *, threads: int | None = None,
          cache_bytes: int = DEFAULT_CACHE_BYTES, progress: Callable[[int], None] | None = None,
          lock: bool = True, reader: DeltaReader | None = None,
          before_write: Callable[[], None] | None = None) -> ApplyReport:
    """Apply the delta file to the checkpoint in place; idempotent, crash-safe, verified at the end.
    Holds the checkpoint's lock (``checkpoint_lock``) throughout. ``lock=False``: another process holds
    it on this one's behalf (an engine's workers apply while their driver holds it, see
    ``engines.vllm.refit_engine``) and serializes the appliers itself. ``reader``: an open reader of
    ``delta_path`` to apply through (closed at the end), and ``before_write``: as in ``run_apply``."""
    with checkpoint_lock(checkpoint_path) if lock else contextlib.nullcontext():
        return _apply_locked(delta_path, checkpoint_path, threads=threads, cache_bytes=cache_bytes,
                             progress=progress, reader=reader, before_write=before_write)


def _apply_locked(delta_path: str, checkpoint_path: str, *, threads: int | None, cache_bytes: int,
                  progress: Callable[[int], None] | None, reader: DeltaReader | None = None,
                  before_write: Callable[[], None] | None = None) -> ApplyReport:
    if os.path.exists(checkpoint_path):
        remove_dead_temps_of(checkpoint_path)
    if os.path.isdir(checkpoint_path):
        remove_replaced_shards(checkpoint_path)  # finish a structural rewrite killed after its commit
    with reader if reader is not None else DeltaReader(delta_path) as d:
        with open_checkpoint(checkpoint_path, writable=True) as ck:
            journal = Journal(journal_path(checkpoint_path), d.target_fingerprint)
            structural_done: list[str] = []
            ops: dict[str, str] = {}

            def structural(delta: DeltaReader, plans: list[_TensorPlan]) -> list[str]:
                ck.flush()  # in-place patches first become durable, then the files are rewritten
                rewrite = _rewrite_indexed_dir if _indexed(ck) else _rewrite_file
                ops.update((tp.entry.name, tp.state) for tp in plans if tp.state in ("add", "remove", "replace"))
                structural_done.extend(rewrite(ck, delta, plans))
                return structural_done

            rep = run_apply(d, ck, journal=journal, threads=threads, cache_bytes=cache_bytes, progress=progress,
                            structural=structural, structural_check=lambda todo: _check_structural(ck, todo),
                            before_write=before_write)
            rep.structural_ops = {n: ops[n] for n in rep.structural if n in ops}
            ck.flush()
        journal.remove()
    log.info("applied %s to %s: %d chunks (%d skipped, %d recovered), %d tensors added/removed/replaced in %.2f s",
             delta_path, checkpoint_path, rep.chunks_applied, rep.chunks_skipped, rep.chunks_recovered,
             len(rep.structural), rep.seconds)
    return rep


def check(delta_path: str, checkpoint_path: str, *, threads: int | None = None) -> None:
    """Everything apply verifies before writing, and nothing else: raises if the delta would not apply.
    Holds the checkpoint's lock, so it never reads a checkpoint another run is writing."""
    with checkpoint_lock(checkpoint_path), DeltaReader(delta_path) as d, open_checkpoint(checkpoint_path) as ck:
        Applier(d, ck, journal=None, threads=threads, cache_bytes=0).plan()
