"""Step 2 of the one apply protocol (``protocol``; FORMAT.md "Applying"): write a checked plan, chunk by
chunk. ``ChunkWriter`` takes its steps in order: open a journal slot per writer thread
(``open_journal``); write the torn chunks, alone and first, then the chunks to do (``write_run``), each
one journaled, written and read back (``write_chunk``: ``_expected``, ``_journal``, ``_store``, then
``verify.check_written``); a collective target's chunks in one order on this thread, with the group's
agreements between runs (``write_in_step``). ``chunk_counts`` tells the report what was done."""

from __future__ import annotations

import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..codec.chunk import Patch
from ..errors import VerificationError
from ..format import TensorEntry
from ..integrity import SEGMENT_BYTES
from .collective import settle
from .host import _changes, _moved, _patched_copy, _seg_len, _where
from .plans import _ChunkPlan, _TensorPlan
from .verify import check_written

# ``ap`` below is a ``protocol.Applier``, typed ``Any``: protocol imports this module.

# A collective target's write: chunks written between two agreements of the group, at most.
WRITE_AGREE_EVERY = 256

Todo = list[tuple[int, _TensorPlan, _ChunkPlan]]  # (tensor index, its plan, a chunk of it), in write order


def chunk_counts(plans: list[_TensorPlan]) -> tuple[int, int, int]:
    """(chunks applied, skipped as already done, recovered from the journal) of a written plan."""
    applied = skipped = recovered = 0
    for tp in (tp for tp in plans if tp.state in ("patch", "held")):
        applied += sum(1 for c in tp.chunks if c.state == "todo")
        skipped += sum(1 for c in tp.chunks if c.state == "done")
        recovered += sum(1 for c in tp.chunks if c.state == "torn")
    return applied, skipped, recovered


class ChunkWriter:
    """The write of one ``Applier``'s checked plan ``plans`` (it uses the applier's delta, target,
    capabilities, journal and threads)."""

    def __init__(self, ap: Any, plans: list[_TensorPlan]) -> None:
        self.ap = ap
        self.plans = plans
        self._slots: dict[int, int] = {}
        self._lock = threading.Lock()

    def _slot(self) -> int:
        """This writer thread's journal slot."""
        tid = threading.get_ident()
        with self._lock:
            return self._slots.setdefault(tid, len(self._slots))

    def open_journal(self) -> None:
        """A slot per writer thread (the torn chunks' one thread, then the pool's, or this thread), each
        allocated for the largest record a chunk to write can need (a record never outgrows its chunk)."""
        ap = self.ap
        if not ap.journal:
            return
        sizes = [SEGMENT_BYTES if c.split else _seg_len(tp.entry.base.nbytes, c.rec.chunk_index)
                 for tp in self.plans if tp.state in ("patch", "held") for c in tp.chunks
                 if c.state in ("todo", "torn")]
        if sizes:
            ap.journal.open_for_write(min(ap.threads, len(sizes)) + 1, record_bytes=max(sizes))
        else:
            ap.journal.open_for_write(ap.threads + 1, record_bytes=0)

    def write_run(self, state: str) -> int:
        """Write the plan's chunks in ``state`` ("torn", then "todo"); the bytes written. Torn chunks go
        first and alone: their only copy is a journal slot that the next new chunk written by the same
        slot number would overwrite. Another process's chunks take their turn with the chunks to do
        (doing nothing), so that every process of a group agrees after the same steps."""
        ap = self.ap
        todo = [(ti, tp, c) for ti, tp in enumerate(self.plans) if tp.state in ("patch", "held") for c in tp.chunks
                if c.state == state or (state == "todo" and c.state == "other")]
        if ap.collective:
            return self.write_in_step(todo)
        written = 0
        with ThreadPoolExecutor(ap.threads if state == "todo" else 1, thread_name_prefix="apply") as pool:
            futs = [pool.submit(self.write_chunk, tp, ti, c) for ti, tp, c in todo]
            try:
                for f in futs:
                    written += f.result()
            finally:
                for f in futs:
                    f.cancel()
        return written

    # -- one chunk -------------------------------------------------------------------------------

    def write_chunk(self, tp: _TensorPlan, ti: int, c: _ChunkPlan) -> int:
        """Journal chunk ``c``, write it and read it back (FORMAT.md "Applying", step 2); the bytes written."""
        ap = self.ap
        e, r = tp.entry, c.rec
        if c.state == "other":  # held whole, and written, by another process of the group
            return 0
        if c.split:
            return self.write_split(tp, ti, c)
        region = (ap.segs.read_own if c.own else ap.segs.read_segment)(e.name, r.chunk_index)
        view = ap._view(region, e.base.dtype)
        patch = c.patch or ap._decode(ap.d, e, r, view)
        changes, image = self._expected(tp, c, view, patch)
        if c.state == "todo":
            self._journal(ti, c, patch, view)
        region = self._store(c, e, region, view, patch, image)
        check_written(ap, tp, c, region, changes, image)
        if tp.state != "held":
            tp.segs[r.chunk_index] = r.post_hash
        c.patch = None
        return _seg_len(e.base.nbytes, r.chunk_index)

    def _expected(self, tp: _TensorPlan, c: _ChunkPlan, view: Any, patch: Any
                  ) -> tuple[tuple[np.ndarray, np.ndarray] | None, np.ndarray | None]:
        """What must land, taken before the write (``view`` may be the target's memory): a held-digest
        chunk's changes (positions, target bits; where decoded again, outside the memory budget, they
        must move the digest as the checked plan did), or a host region's post-image the plan checked,
        built again (a copy, not a hash); neither for a region elsewhere (re-hashed)."""
        e, r = tp.entry, c.rec
        if tp.state == "held":
            pos, new = _changes(patch, view)
            if c.patch is None and not np.array_equal(_moved(e, r, view, pos, new), c.moved):
                raise VerificationError(f"{_where(e, r)}: decodes differently from its checked plan")
            return (pos, new), None
        if self.ap.caps.host:
            return None, _patched_copy(view, patch)
        return None, None

    def _journal(self, ti: int, c: _ChunkPlan, patch: Any, view: Any) -> None:
        """The chunk's patch into this thread's journal slot, before its write."""
        if self.ap.journal:
            self.ap.journal.write(self._slot(), ti, c.rec.chunk_index, c.rec.post_hash, patch, view)

    def _store(self, c: _ChunkPlan, e: TensorEntry, region: Any, view: Any, patch: Any,
               image: np.ndarray | None) -> Any:
        """Write the chunk into the target: its checked post-image whole where the target writes through
        its file (``ImageWrites``), else its patch; the region as it reads after the write."""
        ap, ci = self.ap, c.rec.chunk_index
        if image is not None and ap.caps.writes_images:
            return ap.segs.write_image(e.name, ci, region, image)
        return (ap.segs.write_own if c.own else ap.segs.write_segment)(e.name, ci, region, view, patch)

    def write_split(self, tp: _TensorPlan, ti: int, c: _ChunkPlan, journal_only: bool = False) -> int:
        """A chunk split between the group's processes: its changes journaled, then (unless
        ``journal_only``) the part landing here written and read back; the bytes written."""
        ap = self.ap
        e, r = tp.entry, c.rec
        patch = c.patch or self.split_again(e, c)
        if ap.journal:
            ap.journal.write(self._slot(), ti, r.chunk_index, r.post_hash, patch, None)
        if journal_only:
            return 0
        if not ap.segs.write_split(e.name, r.chunk_index, patch.positions, patch.values):
            raise VerificationError(f"{_where(e, r)}: changed elements read back differ from the patch after "
                                    "writing")
        c.patch = None
        return _seg_len(e.base.nbytes, r.chunk_index)

    # -- a collective target ---------------------------------------------------------------------

    def write_in_step(self, todo: Todo) -> int:
        """Write a collective target's chunks ``todo`` on this thread, in their order (the same in every
        process of the group); the bytes written. The group agrees after each tensor's run of chunks that
        one process writes alone (at most ``WRITE_AGREE_EVERY`` of them): one collective call per run, not
        per chunk. A process that fails writes nothing more, and every process stops at the same
        agreement; the others may have written the rest of the run, each chunk checked by its writer's
        plan and journaled by it, so a rerun completes it, as after any failure mid-write. A split chunk
        (every process writes its part) may then be torn across processes, and each needs a journal record
        of it: a process that failed still journals the run's split chunks, without writing them. A chunk
        whose write makes collective calls (its segment read over the group, or its changes sent again)
        gets an agreement of its own."""
        ap = self.ap
        journal_split = functools.partial(self.write_split, journal_only=True)
        written, run, err = 0, 0, None
        prev = -1

        def agree() -> None:
            nonlocal run
            if run:
                run = 0
                settle(ap.caps, ap.segs, err)

        for ti, tp, c in todo:
            if self.writes_collectively(tp, c):
                agree()
                written += ap._agreed(self.write_chunk, tp, ti, c)
                continue
            if ti != prev:
                agree()
                prev = ti
            if err is None:
                try:
                    written += self.write_chunk(tp, ti, c)
                except Exception as ex:
                    err = ex
            elif c.split:
                journal_split(tp, ti, c)
            run += 1
            if run >= WRITE_AGREE_EVERY:
                agree()
        agree()
        return written

    def writes_collectively(self, tp: _TensorPlan, c: _ChunkPlan) -> bool:
        """Whether writing chunk ``c`` makes collective calls: a segment of a shared tensor read and written
        over the group, or a split chunk's changes decoded and sent again. The same answer in every
        process: roles, and which split chunks keep their changes, are the group's."""
        roles = self.ap.caps.chunk_roles
        if roles is None or roles(tp.entry.name) is None:
            return False
        return not (c.own or c.state == "other" or (c.split and c.patch is not None))

    def split_again(self, e: TensorEntry, c: _ChunkPlan) -> Patch:
        """A split chunk's changes, dropped after its plan (the memory budget), decoded again by the same
        process and sent again (collective calls, at the same chunk in every process); the decoder
        refuses them unless they move the digest exactly as the checked plan did."""
        ap, r = self.ap, c.rec
        owner = ap.segs.split_owner(e.name, r.chunk_index)
        region = ap.segs.assemble_window(e.name, [(r.chunk_index, owner)])[0]
        got, err = None, None
        if region is not None:
            try:
                pos, new, moved = ap.held_plans.split_changes(e, r, region)
                if not np.array_equal(moved, c.moved):
                    raise VerificationError(f"{_where(e, r)}: decodes differently from its checked plan")
                got = (pos, new)
            except Exception as ex:
                err = ex
        shared = ap.segs.share_window(e.name, [(r.chunk_index, owner, got)])[0]
        if err is not None:
            raise err
        if shared is None:
            raise VerificationError(f"{_where(e, r)}: the process of the group that decodes it refused or failed "
                                    "(see its log)")
        return Patch(shared[0], shared[1], None)
