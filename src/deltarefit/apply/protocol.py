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

This module plans (``Applier.plan``) and runs the steps (``plan_apply``, ``commit``, ``run_apply``); the
write is ``write.ChunkWriter``, the checks after the plan ``verify``, a collective target's agreements
``collective``, held-digest plans ``held``, and what a target must and may implement ``targets``.

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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from ..codec.chunk import moves_of_patch
from ..dtypes import dtype
from ..encode import default_threads, uint_view
from ..errors import BaseMismatchError, UsageError, VerificationError
from ..format import ChunkRecord, DeltaReader, TensorEntry, TensorMeta
from ..history_book import HistoryBook, MovesRecorder
from ..integrity import n_segments, seg_hash, tensor_digest_from_segments
from . import host as regions
from . import verify
from .collective import Inline, agreed, in_step
from .collective import Inline as _Inline  # noqa: F401 (its old name here)
from .held import HeldPlans
from .host import _decode, _patch_bytes, _post_image_hash, _seg_len, _where
from .journal import Journal, _journal_patch
from .plans import _ChunkPlan, _TensorPlan
from .targets import TensorTarget, capabilities, segments_of
from .verify import _digest
from .write import WRITE_AGREE_EVERY, ChunkWriter, chunk_counts  # noqa: F401 (WRITE_AGREE_EVERY: its old home)

log = logging.getLogger(__name__)

# Decoded patches kept from the plan phase for the write phase, so most chunks decode once.
DEFAULT_CACHE_BYTES = 512 << 20


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


class Applier:
    """One application of one delta to one ``TensorTarget`` or ``SegmentTarget``: ``plan``, then
    ``write``, then ``target_digests``.

    A target with ``collective = True`` (segments assembled from the parts several processes hold) is
    driven in one fixed order on the calling thread, so that every process reads and writes the same
    segments in the same order; after each tensor's plan and each run of chunk writes
    (``ChunkWriter.write_in_step``) the target's ``agree(ok)`` tells whether every process succeeded, so
    that a refusal in one stops all of them at the same point, a refusal in the plan before any write.
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
        self.caps = caps = capabilities(self.segs, regions.HOST_REGIONS, journal=journal,
                                        held=held is not None, history=history is not None or moves is not None)
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
        self._decode_held = regions.held_decode(self._decode)  # held-digest plans' decode
        self.journal = journal
        self.threads = threads or default_threads()
        self.cache_left = cache_bytes
        self._cache_lock = threading.Lock()  # tensors are planned on several threads
        self.progress = progress
        self.recovered = journal.read() if journal else {}
        self.collective = caps.collective
        self._pool = Inline if self.collective else ThreadPoolExecutor
        self._roles = caps.chunk_roles
        self._own_pool: ThreadPoolExecutor | None = None
        # Held-digest plans decode a segment split between the group's processes in one of them, which
        # sends the others its changes (``HeldPlans._plan_split``). Those processes journal the changes
        # without the segment, so a journal that needs pre-images (a file journal) keeps the older way:
        # every process assembles and decodes the whole segment.
        self._split = caps.split
        # The held-digest plans: an object this applier holds, which uses its state (``held.HeldPlans``).
        self.held_plans = HeldPlans(self)

    def _record_moves(self, e: TensorEntry, ci: int, view, patch) -> None:
        """Record a chunk's moves, decoded in the plan against its base ``view`` (host regions), where a
        book is kept and the target does not record them itself."""
        if self.moves is not None and not self._target_moves:
            self.moves.add(e.name, ci, moves_of_patch(dtype(e.base.dtype), view, patch))

    def _agreed(self, fn, *args):
        """``fn(*args)``; for a collective target, also the group's agreement that nobody failed
        (``collective.agreed``)."""
        return agreed(self.caps, self.segs, fn, *args)

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
        # whole (held-digest plans) are decoded on its own threads meanwhile (``HeldPlans._plan_shared``).
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
                return self.held_plans.plan(pool, e, held)
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
        """Step 2 (module docstring; ``write.ChunkWriter``): a journal slot per writer thread, then the torn
        chunks, alone and first, then the chunks to do, each journaled, written and read back.
        (chunks applied, skipped, recovered; bytes written)."""
        w = ChunkWriter(self, plans)
        w.open_journal()
        written = w.write_run("torn") + w.write_run("todo")
        return (*chunk_counts(plans), written)

    def recheck_held(self, plans: list[_TensorPlan]) -> None:
        """A plan made ahead of time, checked again before its first write (``verify.recheck_held``)."""
        verify.recheck_held(self, plans)

    # -- verify ----------------------------------------------------------------------------------

    def target_digests(self, plans: list[_TensorPlan]) -> dict[str, bytes]:
        """Step 3: every tensor's digest after the write, checked (``verify.target_digests``)."""
        return verify.target_digests(plans)


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
           recheck: bool = False, after_write: Callable[[], None] | None = None) -> ApplyReport:
    """Write a prepared plan, then verify (``run_apply``'s steps 2 and 3); once per plan. The report's
    seconds count from the plan's start. ``recheck``: the plan was made a while ago (``plan_apply`` ahead
    of time); first, with nothing written yet, every element a held-digest chunk changes is read again
    and must hold the bits the plan moved the digest from (``Applier.recheck_held``). ``after_write()``
    runs once the in-place writes are done, before the structural rewrite and the verification (a file
    target takes its identity there, to find a writer that came after its own last write)."""
    if prep.committed:
        raise UsageError("this prepared apply was committed already")
    prep.committed = True
    ap, plans, delta = prep.ap, prep.plans, prep.ap.d
    if recheck:
        ap.recheck_held(plans)
    if before_write is not None:
        before_write()
    applied, skipped, recovered, written = ap.write(plans)
    if after_write is not None:
        after_write()
    struct_todo = any(tp.state in ("add", "remove", "replace") for tp in plans)
    names = prep.structural(delta, plans) if struct_todo and prep.structural is not None else []
    fp = verify.check_fingerprint(ap.target_digests(plans), delta)
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
              moves: MovesRecorder | None = None, after_write: Callable[[], None] | None = None) -> ApplyReport:
    """Plan, write, verify (see the module docstring): ``plan_apply`` then ``commit``. ``structural``
    performs added/removed/re-typed tensors after the in-place patches; ``structural_check`` may refuse
    them, before any write.
    ``held``: tensor name -> the additive digest of what the target holds now, which the caller
    vouches for (module docstring, "Held digests"); tensors it names are checked through it when the
    delta carries their additive target digest. ``before_write()`` runs once the plan passed, before
    the first write; it may refuse (raise), and then nothing is written (a subscriber that planned on
    a part still downloading checks the whole part against its record there). ``history``: the
    book ``ulp_hist`` chunks decode against; ``moves``: records each decoded chunk's moves (marked
    incomplete where a chunk was found already applied). ``after_write()``: as in ``commit``."""
    prep = plan_apply(delta, target, journal=journal, threads=threads, cache_bytes=cache_bytes, progress=progress,
                      structural=structural, structural_check=structural_check, held=held, history=history,
                      moves=moves)
    return commit(prep, before_write=before_write, after_write=after_write)
