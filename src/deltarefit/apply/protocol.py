"""Apply a delta in place, safely: verify everything first, journal each chunk, verify the result.

Protocol (the crash-safety argument is in FORMAT.md, "Applying"):

1. **Plan (read only).** Hash every segment of every tensor the delta names. Each changed chunk must
   match its pre-image (to do), its post-image (already done by an earlier run) or, if torn by a kill
   mid-write, have a journal record from that run. Substituting pre-images for done chunks must give
   each tensor's base digest: a delta for another base is refused here, before any byte is written.
   Every chunk to do is decoded and its post-image hashed against the record, so a delta that decodes
   badly is refused here too.
2. **Write.** Per chunk: write its decoded patch to a journal slot, then write the post-image the plan
   hashed (built again in memory) through the checkpoint's file (or scatter the patch, into a target
   without one), then compare the region with that post-image. Patches write target values (never
   XOR), so replaying a journal record over a torn chunk is idempotent.
3. **Verify.** Every tensor's digest and the checkpoint fingerprint must equal the delta's target;
   then the maps are flushed and the journal removed.

Structural changes (added, removed, re-typed tensors) rewrite the file holding them through a temp
file and an atomic rename; in-place patching covers everything else.

**Held digests** (``held=``, FORMAT.md "Held digests"): a target that keeps, for each tensor, the
additive digest (``integrity.additive``) of exactly what it holds (a live engine, which computed it when
it last verified in full and moved it with every verified patch since) lets the plan skip the hashes.
A tensor is then checked in O(changed elements): each chunk is decoded against the segment as it is,
the digest moved by every change (old bits read from the target, new bits decoded) must give the
delta's additive target digest, and after the write every changed element is read back. Unchanged
elements are not re-read: their check is the held digest's own (``ApplyReport.held`` says how many
tensors were checked this way), and a full verification re-reads them.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from ..codec import elements
from ..codec.chunk import Patch, moves_of_patch
from ..dtypes import dtype
from ..encode import default_threads, uint_view
from ..errors import BaseMismatchError, DecodeError, UsageError, VerificationError
from ..format import ChunkRecord, DeltaReader, TensorEntry, TensorMeta
from ..history_book import HistoryBook, MovesRecorder
from ..integrity import (
    SEGMENT_BYTES,
    fingerprint_from_digests,
    n_segments,
    seg_hash,
    tensor_digest_from_segments,
)
from . import host as regions
from .held import GROUP_DECODE_REFUSED, GROUP_REFUSED, HeldPlans, in_step
from .host import (
    _changes,
    _decode,
    _moved,
    _patch_bytes,
    _patched_copy,
    _post_image_hash,
    _seg_len,
    _where,
)
from .journal import Journal, _journal_patch
from .plans import _ChunkPlan, _TensorPlan
from .targets import TensorTarget, capabilities, segments_of

log = logging.getLogger(__name__)



# Decoded patches kept from the plan phase for the write phase, so most chunks decode once.
DEFAULT_CACHE_BYTES = 512 << 20
# A collective target's write: chunks written between two agreements of the group, at most.
WRITE_AGREE_EVERY = 256


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
    # Chunks of shared tensors split between the group's processes (held-digest plans), and how many of
    # them this process decoded for the group (``HeldPlans._plan_split``).
    split_chunks: int = 0
    split_decoded: int = 0
    # The checkpoint files' identity (``Checkpoint.identity``) from the handles the apply verified
    # through, taken after its last write; empty where the target has no files (set by ``apply``).
    identity: tuple = ()


def _matches(info: object, meta: TensorMeta) -> bool:
    return (info.dtype, tuple(info.shape)) == (meta.dtype, meta.shape)


def _digest(meta: TensorMeta, segs: list[bytes]) -> bytes:
    return tensor_digest_from_segments(meta.dtype, meta.shape, meta.nbytes, segs)


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


class Applier(HeldPlans):
    """One application of one delta to one ``TensorTarget`` or ``SegmentTarget``: ``plan``, then
    ``write``, then ``target_digests``.

    A target with ``collective = True`` (segments assembled from the parts several processes hold) is
    driven in one fixed order on the calling thread, so that every process reads and writes the same
    segments in the same order; after each tensor's plan and each run of chunk writes (``_write_in_step``)
    the target's ``agree(ok)`` tells whether every process succeeded, so that a refusal in one stops all
    of them at the same point, a refusal in the plan before any write.
    """

    def __init__(self, delta: DeltaReader, target: TensorTarget, *, journal: Journal | None,
                 threads: int | None = None, cache_bytes: int = DEFAULT_CACHE_BYTES,
                 progress: Callable[[int], None] | None = None,
                 held: Mapping[str, bytes] | None = None, history: HistoryBook | None = None,
                 moves: MovesRecorder | None = None, ahead: bool = False) -> None:
        self.d = delta
        # Planned ahead of its write (``plan_apply``): held-digest chunks keep the bits their changed
        # elements held, for ``recheck_held``.
        self.ahead = ahead
        self.t = target
        self.segs = segments_of(target)
        # What the target can do, found once (``targets.Capabilities``); refused here what it cannot.
        self.caps = caps = capabilities(self.segs, journal=journal, held=held is not None,
                                        history=history is not None or moves is not None)
        self._hash, self._view, self._decode, self._post_hash = (
            caps.hash_region, caps.region_view, caps.decode_region, caps.post_image_hash)
        self._hash_all = caps.hash_segments
        self.held = held
        # A history book: ulp_hist chunks decode against it, and every chunk decoded here records its
        # moves into ``moves`` (host regions only: the moves come from the host patch and base). In a
        # collective target's group each process keeps its own book, of the chunks it decodes: the
        # held-digest plan gives every chunk one decoder, the same at every version (the roles and split
        # owners come from the layout), so that book holds each such chunk's history.
        self.moves = moves
        # A target with region hooks that decodes against a book itself (``decodes_history``: it was
        # given the book, and records each decoded chunk's moves into ``moves``).
        self._target_moves = caps.decodes_history
        if (history is not None or moves is not None) and not self._target_moves:
            self._decode = functools.partial(regions._decode, history=history)
        # Host regions are confirmed after a write by comparing them with the post-image the plan hashed,
        # built again from the patch (FORMAT.md, "Applying", step 2); a target with its own region hooks
        # (a device) re-hashes the region there.
        self._read_back = caps.host
        # ... and such a post-image is written whole where the target writes through its file
        # (``RawSegments.write_image``: cheaper than patching pages the plan mapped read-only).
        self._writes_images = caps.writes_images
        self.journal = journal
        self.threads = threads or default_threads()
        self.cache_left = cache_bytes
        self._cache_lock = threading.Lock()  # tensors are planned on several threads
        self.progress = progress
        self.recovered = journal.read() if journal else {}
        self.collective = caps.collective
        self._pool = _Inline if self.collective else ThreadPoolExecutor
        self._roles = caps.chunk_roles
        self._own_pool: ThreadPoolExecutor | None = None
        # Held-digest plans decode a segment split between the group's processes in one of them, which
        # sends the others its changes (``HeldPlans._plan_split``). Those processes journal the changes
        # without the segment, so a journal that needs pre-images (a file journal) keeps the older way:
        # every process assembles and decodes the whole segment.
        self._split = caps.split

    def _record_moves(self, e: TensorEntry, ci: int, view, patch) -> None:
        """Record a chunk's moves, decoded in the plan against its base ``view`` (host regions), where a
        book is kept and the target does not record them itself."""
        if self.moves is not None and not self._target_moves:
            self.moves.add(e.name, ci, moves_of_patch(dtype(e.base.dtype), view, patch))

    def _agreed(self, fn, *args):
        """``fn(*args)``; for a collective target, also the group's agreement that nobody failed."""
        if not self.collective:
            return fn(*args)
        try:
            out = fn(*args)
        except Exception as ex:
            self._settle(ex)
        self._settle(None)
        return out

    def _settle(self, err: BaseException | None) -> None:
        """The group's agreement on whether every process got here without a failure (``err``): raises
        ``err`` where it failed, ``VerificationError`` in the others, when any did. Where one process
        refused to decode (``DecodeError``: a corrupt payload, or a history its book does not hold),
        every process raises ``DecodeError``, so that all of them take the same way out (a subscriber
        starts its book over and plans again on that error alone)."""
        if self.caps.agree_each is not None:
            ok, decodes = (bool(x) for x in self.caps.agree_each(np.array([err is None, not isinstance(err, DecodeError)])))
        else:
            ok, decodes = self.segs.agree(err is None), True
        if err is not None and (decodes or isinstance(err, DecodeError)):
            raise err
        if not decodes:
            raise DecodeError(GROUP_DECODE_REFUSED + (f": {err}" if err is not None else "")) from err
        if not ok:
            raise VerificationError(GROUP_REFUSED)

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
                if self.moves is not None:  # applied by an earlier run: its moves are not known here
                    self.moves.incomplete = True
                return h, _ChunkPlan(r, "done")
            if h == r.pre_hash:
                view = self._view(region if region is not None else self.segs.read_segment(e.name, ci),
                                  e.base.dtype)
                patch = self._decode(self.d, e, r, view)
                if self._post_hash(view, patch) != r.post_hash:
                    raise VerificationError(f"{self.d.path}: {_where(e, r)}: decodes to bytes that miss the "
                                            "post-image hash (corrupt delta)")
                self._record_moves(e, ci, view, patch)
                return h, _ChunkPlan(r, "todo", patch)
            rec = self.recovered.get((ti, ci))
            if rec is not None and rec[0] == r.post_hash:  # a journal: host regions, read above
                view = uint_view(region, e.base.dtype)
                patch = _journal_patch(rec, e.base.dtype, view.size)
                if self.moves is not None:  # a torn chunk's base is gone
                    self.moves.incomplete = True
                if patch is not None and _post_image_hash(view, patch) == r.post_hash:
                    return h, _ChunkPlan(r, "torn", patch)
            raise BaseMismatchError(f"{_where(e, r)}: bytes match neither the delta's base nor its target "
                                    "(wrong base checkpoint, or modified since?)")

        if self.collective and known is None:  # (``seg`` reads each segment from the group once)
            results = in_step(seg, lambda ci: self.segs.read_segment(e.name, ci), range(n_segments(e.base.nbytes)))
        else:
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
            if c.patch is None or c.split:  # held and written elsewhere; split: decided with the group
                continue
            if not self._reserve(_patch_bytes(c.patch) + (c.old.nbytes if c.old is not None else 0)):
                c.patch = c.old = None

    def _reserve(self, size: int) -> bool:
        """Take ``size`` bytes of the plan's memory budget for a kept patch, if that much is left
        (``size < 0`` gives bytes back)."""
        with self._cache_lock:
            if size > self.cache_left:
                return False
            self.cache_left -= size
            return True

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
            # A slot per writer thread (the torn chunks' one thread, then the pool's, or this thread), each
            # allocated for the largest record a chunk to write can need (a record never outgrows its chunk).
            sizes = [SEGMENT_BYTES if c.split else _seg_len(tp.entry.base.nbytes, c.rec.chunk_index)
                     for tp in plans if tp.state in ("patch", "held") for c in tp.chunks
                     if c.state in ("todo", "torn")]
            if sizes:
                self.journal.open_for_write(min(self.threads, len(sizes)) + 1, record_bytes=max(sizes))
            else:
                self.journal.open_for_write(self.threads + 1, record_bytes=0)

        def do(tp: _TensorPlan, ti: int, c: _ChunkPlan) -> int:
            e, r = tp.entry, c.rec
            if c.state == "other":  # held whole, and written, by another process of the group
                return 0
            if c.split:
                return write_split(tp, ti, c)
            region = (self.segs.read_own if c.own else self.segs.read_segment)(e.name, r.chunk_index)
            view = self._view(region, e.base.dtype)
            patch = c.patch or self._decode(self.d, e, r, view)
            img = None
            if tp.state == "held":
                pos, new = _changes(patch, view)  # before the write: ``view`` may be the target's memory
                # decoded again (outside the memory budget): it must move the digest as the checked plan did
                if c.patch is None and not np.array_equal(_moved(e, r, view, pos, new), c.moved):
                    raise VerificationError(f"{_where(e, r)}: decodes differently from its checked plan")
            elif self._read_back:  # the post-image the plan checked, built again (a copy, not a hash)
                img = _patched_copy(view, patch)
            if c.state == "todo" and self.journal:
                self.journal.write(slot(), ti, r.chunk_index, r.post_hash, patch, view)
            if img is not None and self._writes_images:  # the checked post-image, written whole
                region = self.segs.write_image(e.name, r.chunk_index, region, img)
            else:
                region = (self.segs.write_own if c.own else self.segs.write_segment)(e.name, r.chunk_index, region,
                                                                                     view, patch)
            if tp.state == "held":  # O(changed elements): what was written is read back
                if not elements.equal_at(self._view(region, e.base.dtype), pos, new):
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

        def write_split(tp: _TensorPlan, ti: int, c: _ChunkPlan, journal_only: bool = False) -> int:
            e, r = tp.entry, c.rec
            patch = c.patch or self._split_again(e, c)
            if self.journal:
                self.journal.write(slot(), ti, r.chunk_index, r.post_hash, patch, None)
            if journal_only:
                return 0
            if not self.segs.write_split(e.name, r.chunk_index, patch.positions, patch.values):
                raise VerificationError(f"{_where(e, r)}: changed elements read back differ from the patch after "
                                        "writing")
            c.patch = None
            return _seg_len(e.base.nbytes, r.chunk_index)

        for state in ("torn", "todo"):
            # Torn chunks go first and alone: their only copy is a journal slot that the next new
            # chunk written by the same slot number would overwrite.
            # Another process's chunks take their turn here too (doing nothing), so that every process
            # of a group agrees after the same steps.
            todo = [(ti, tp, c) for ti, tp in enumerate(plans) if tp.state in ("patch", "held") for c in tp.chunks
                    if c.state == state or (state == "todo" and c.state == "other")]
            if self.collective:
                written += self._write_in_step(do, todo, functools.partial(write_split, journal_only=True))
                continue
            with ThreadPoolExecutor(self.threads if state == "todo" else 1, thread_name_prefix="apply") as pool:
                futs = [pool.submit(do, tp, ti, c) for ti, tp, c in todo]
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

    def recheck_held(self, plans: list[_TensorPlan]) -> None:
        """Before the first write of a plan made ahead of time: the elements each held-digest chunk whose
        patch the plan kept changes must hold the bits they held when planned (compared bit for bit where
        the plan kept them, ``ahead``; else the digest they move must be the one planned), so that the
        digest moves as checked (O(changed elements); refused with nothing written otherwise). Chunks the
        plan did not keep are checked so when decoded again for the write."""
        def check(e: TensorEntry, c: _ChunkPlan) -> None:
            view = self._view(self.segs.read_segment(e.name, c.rec.chunk_index), e.base.dtype)
            pos, new = _changes(c.patch, view)
            same = (elements.equal_at(view, pos, c.old) if c.old is not None and c.patch.dense is None
                    else np.array_equal(_moved(e, c.rec, view, pos, new), c.moved))
            if not same:
                raise VerificationError(f"{_where(e, c.rec)}: an element it changes no longer holds the bits "
                                        "the prepared plan read (modified since; nothing written)")

        todo = [(tp.entry, c) for tp in plans if tp.state == "held" for c in tp.chunks
                if c.state == "todo" and c.patch is not None and not c.own and not c.split and c.moved is not None]
        if self.collective or self.threads == 1:
            for e, c in todo:
                check(e, c)
            return
        # (one pass over each touched cache line of the weights: memory-bound, so spread over the threads)
        with ThreadPoolExecutor(self.threads, thread_name_prefix="recheck") as pool:
            for f in [pool.submit(check, e, c) for e, c in todo]:
                f.result()

    def _write_in_step(self, do: Callable[[_TensorPlan, int, _ChunkPlan], int],
                       todo: list[tuple[int, _TensorPlan, _ChunkPlan]],
                       journal_split: Callable[[_TensorPlan, int, _ChunkPlan], int]) -> int:
        """Write a collective target's chunks ``todo`` on this thread, in their order (the same in every
        process of the group); the bytes written. The group agrees after each tensor's run of chunks that
        one process writes alone (at most ``WRITE_AGREE_EVERY`` of them): one collective call per run, not
        per chunk. A process that fails writes nothing more, and every process stops at the same
        agreement; the others may have written the rest of the run, each chunk checked by its writer's
        plan and journaled by it, so a rerun completes it, as after any failure mid-write. A split chunk
        (every process writes its part) may then be torn across processes, and each needs a journal record
        of it: a process that failed still journals the run's split chunks (``journal_split``), without
        writing them. A chunk whose write makes collective calls (its segment read over the group, or
        its changes sent again) gets an agreement of its own."""
        written, run, err = 0, 0, None
        prev = -1

        def settle() -> None:
            nonlocal run
            if run:
                run = 0
                self._settle(err)

        for ti, tp, c in todo:
            if self._writes_collectively(tp, c):
                settle()
                written += self._agreed(do, tp, ti, c)
                continue
            if ti != prev:
                settle()
                prev = ti
            if err is None:
                try:
                    written += do(tp, ti, c)
                except Exception as ex:
                    err = ex
            elif c.split:
                journal_split(tp, ti, c)
            run += 1
            if run >= WRITE_AGREE_EVERY:
                settle()
        settle()
        return written

    def _writes_collectively(self, tp: _TensorPlan, c: _ChunkPlan) -> bool:
        """Whether writing chunk ``c`` makes collective calls: a segment of a shared tensor read and written
        over the group, or a split chunk's changes decoded and sent again. The same answer in every
        process: roles, and which split chunks keep their changes, are the group's."""
        if self._roles is None or self._roles(tp.entry.name) is None:
            return False
        return not (c.own or c.state == "other" or (c.split and c.patch is not None))

    def _split_again(self, e: TensorEntry, c: _ChunkPlan) -> Patch:
        """A split chunk's changes, dropped after its plan (the memory budget), decoded again by the same
        process and sent again (collective calls, at the same chunk in every process); the decoder
        refuses them unless they move the digest exactly as the checked plan did."""
        r = c.rec
        owner = self.segs.split_owner(e.name, r.chunk_index)
        region = self.segs.assemble_window(e.name, [(r.chunk_index, owner)])[0]
        got, err = None, None
        if region is not None:
            try:
                pos, new, moved = self._split_changes(e, r, region)
                if not np.array_equal(moved, c.moved):
                    raise VerificationError(f"{_where(e, r)}: decodes differently from its checked plan")
                got = (pos, new)
            except Exception as ex:
                err = ex
        shared = self.segs.share_window(e.name, [(r.chunk_index, owner, got)])[0]
        if err is not None:
            raise err
        if shared is None:
            raise VerificationError(f"{_where(e, r)}: the process of the group that decodes it refused or failed "
                                    "(see its log)")
        return Patch(shared[0], shared[1], None)

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


@dataclass
class PreparedApply:
    """A plan that passed (``plan_apply``): nothing written yet. ``commit`` writes and verifies it; it holds
    the delta's reader, which must stay open until then, and the decoded patches the plan's memory budget
    kept. Valid only while the target holds exactly what it held when planned: the caller vouches for
    that (a live engine, whose only writer is its own apply, counts its applies)."""

    ap: Applier
    plans: list[_TensorPlan]
    structural: Callable[[DeltaReader, list[_TensorPlan]], list[str]] | None
    t0: float
    committed: bool = False


def plan_apply(delta: DeltaReader, target: TensorTarget, *, journal: Journal | None, threads: int | None = None,
               cache_bytes: int = DEFAULT_CACHE_BYTES, progress: Callable[[int], None] | None = None,
               structural: Callable[[DeltaReader, list[_TensorPlan]], list[str]] | None = None,
               structural_check: Callable[[list[_TensorPlan]], None] | None = None,
               held: Mapping[str, bytes] | None = None, history: HistoryBook | None = None,
               moves: MovesRecorder | None = None, ahead: bool = False) -> PreparedApply:
    """``run_apply``'s plan, read-only (its arguments are ``run_apply``'s): every check before the first
    write, refused with nothing written. ``commit`` then writes it. ``ahead``: planned a while before the
    write (``commit(recheck=True)``); held-digest chunks keep the old bits of the elements they change
    (2 bytes per change in bf16, within the plan's memory budget) for that recheck."""
    t0 = time.perf_counter()
    ap = Applier(delta, target, journal=journal, threads=threads, cache_bytes=cache_bytes, progress=progress,
                 held=held, history=history, moves=moves, ahead=ahead)
    plans = ap.plan()
    struct_todo = [tp for tp in plans if tp.state in ("add", "remove", "replace")]
    if struct_todo and structural is None:
        raise UsageError(f"tensor {struct_todo[0].entry.name!r} is {struct_todo[0].entry.op}d by this delta, "
                         "which this target cannot do in place")
    if struct_todo and structural_check is not None:
        structural_check(struct_todo)
    return PreparedApply(ap, plans, structural, t0)


def commit(prep: PreparedApply, *, before_write: Callable[[], None] | None = None,
           recheck: bool = False) -> ApplyReport:
    """Write a prepared plan, then verify (``run_apply``'s steps 2 and 3); once per plan. The report's
    seconds count from the plan's start. ``recheck``: the plan was made a while ago (``plan_apply`` ahead
    of time); first, with nothing written yet, every element a held-digest chunk changes is read again
    and must hold the bits the plan moved the digest from (``Applier.recheck_held``)."""
    if prep.committed:
        raise UsageError("this prepared apply was committed already")
    prep.committed = True
    ap, plans, delta = prep.ap, prep.plans, prep.ap.d
    if recheck:
        ap.recheck_held(plans)
    if before_write is not None:
        before_write()
    applied, skipped, recovered, written = ap.write(plans)
    struct_todo = any(tp.state in ("add", "remove", "replace") for tp in plans)
    names = prep.structural(delta, plans) if struct_todo and prep.structural is not None else []
    digests = ap.target_digests(plans)
    fp = fingerprint_from_digests(digests)
    if fp != delta.target_fingerprint:
        raise VerificationError(f"fingerprint after apply {fp[:16]}… is not the delta's target "
                                f"{delta.target_fingerprint[:16]}…")
    held_plans = [tp for tp in plans if tp.state == "held"]
    return ApplyReport(fp, applied, skipped, recovered, written, time.perf_counter() - prep.t0, names,
                       held=len(held_plans),
                       sums={tp.entry.name: np.asarray(tp.sum, "<u8").tobytes() for tp in held_plans},
                       elsewhere=sum(c.state == "other" for tp in held_plans for c in tp.chunks),
                       split_chunks=sum(c.split for tp in held_plans for c in tp.chunks),
                       split_decoded=sum(c.split and c.moved is not None for tp in held_plans for c in tp.chunks))


def run_apply(delta: DeltaReader, target: TensorTarget, *, journal: Journal | None, threads: int | None = None,
              cache_bytes: int = DEFAULT_CACHE_BYTES, progress: Callable[[int], None] | None = None,
              structural: Callable[[DeltaReader, list[_TensorPlan]], list[str]] | None = None,
              structural_check: Callable[[list[_TensorPlan]], None] | None = None,
              held: Mapping[str, bytes] | None = None,
              before_write: Callable[[], None] | None = None, history: HistoryBook | None = None,
              moves: MovesRecorder | None = None) -> ApplyReport:
    """Plan, write, verify (see the module docstring): ``plan_apply`` then ``commit``. ``structural``
    performs added/removed/re-typed tensors after the in-place patches; ``structural_check`` may refuse
    them, before any write.
    ``held``: tensor name -> the additive digest of what the target holds now, which the caller
    vouches for (module docstring, "Held digests"); tensors it names are checked through it when the
    delta carries their additive target digest. ``before_write()`` runs once the plan passed, before
    the first write; it may refuse (raise), and then nothing is written (a subscriber that planned on
    a part still downloading checks the whole part against its record there). ``history``: the
    book ``ulp_hist`` chunks decode against; ``moves``: records each decoded chunk's moves (marked
    incomplete where a chunk was found already applied)."""
    prep = plan_apply(delta, target, journal=journal, threads=threads, cache_bytes=cache_bytes, progress=progress,
                      structural=structural, structural_check=structural_check, held=held, history=history,
                      moves=moves)
    return commit(prep, before_write=before_write)
