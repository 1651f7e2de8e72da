"""The held-digest plan of the one apply protocol (``apply.protocol``; FORMAT.md "Held digests"): a tensor whose
target holds the additive digest of what it holds is checked in O(changed elements), each chunk decoded
against its segment as it is and the digest moved by every change compared with the delta's; on a
collective target, a segment one process holds whole is decoded there alone, and a segment split
between processes is decoded by one of them, which sends its changes to the others."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..codec.chunk import Patch
from ..errors import BaseMismatchError, VerificationError
from ..format import ChunkRecord, TensorEntry
from .collective import GROUP_DECODE_REFUSED, GROUP_REFUSED, in_step  # noqa: F401 (their old home)
from .host import (
    _changes,
    _moved_by,
    _patch_bytes,
    _seg_len,
    _where,
)
from .plans import _ChunkPlan, _TensorPlan

# ``ap`` below is a ``protocol.Applier``, typed ``Any``: protocol imports this module.

class HeldPlans:
    """The held-digest plans of one ``Applier``, which holds this object (``Applier.held_plans``): they
    use its delta, target, capabilities, pools and memory budget."""

    def __init__(self, ap: Any) -> None:
        self.ap = ap

    def plan(self, pool, e: TensorEntry, held: bytes) -> _TensorPlan:
        """The held-digest plan of a ``same``/``patch`` tensor (module docstring): decode every chunk
        against the segment as it is, and require the digest moved by the changes to be the target's."""
        from ..integrity import additive

        ap = self.ap
        if held == e.target.sum and held != e.base.sum:  # already at the target (a rerun)
            if ap.moves is not None:  # its moves are not known here
                ap.moves.incomplete = True
            return _TensorPlan(e, "held", chunks=[_ChunkPlan(r, "done") for r in ap.d.chunks(e)],
                               sum=np.frombuffer(held, "<u8").astype(np.uint64))
        if held != e.base.sum:
            raise BaseMismatchError(f"{_where(e)}: the digest held of its bytes is not the delta's base (wrong base "
                                    "checkpoint, or modified since?)")

        def chunk(r: ChunkRecord, own: bool = False) -> _ChunkPlan:
            read = ap.segs.read_own if own else ap.segs.read_segment
            view = ap._view(read(e.name, r.chunk_index), e.base.dtype)
            patch = ap._decode_held(ap.d, e, r, view)
            if ap.progress:
                ap.progress(_seg_len(e.base.nbytes, r.chunk_index))
            ap._record_moves(e, r.chunk_index, view, patch)
            pos, new = _changes(patch, view)
            old = np.take(view, pos) if ap.ahead and not own and patch.dense is None else None
            return _ChunkPlan(r, "todo", patch, _moved_by(e, r, view, patch, pos, new), own, old=old)

        total = np.frombuffer(held, "<u8").astype(np.uint64)
        roles = ap._roles(e.name) if ap._roles is not None else None
        if roles is None:
            chunks = list(pool.map(chunk, ap.d.chunks(e)))
        else:
            chunks, moved = self._plan_shared(e, roles, chunk)
            total = additive.add(total, moved)
        for c in chunks:
            if c.moved is not None and not c.own and not c.split:
                total = additive.add(total, c.moved)
        if np.asarray(total, "<u8").tobytes() != e.target.sum:
            raise VerificationError(f"{ap.d.path}: {_where(e)}: its post-image, the held digest moved by the decoded "
                                    "changes, misses the delta's target digest (corrupt delta, or the elements it "
                                    "changes differ from its base)")
        ap._keep_within_budget(chunks)  # the rest is decoded again, and checked, when written
        return _TensorPlan(e, "held", chunks=chunks, sum=total)

    def _plan_shared(self, e: TensorEntry, roles: list[str],
                          chunk: Callable[..., _ChunkPlan]) -> tuple[list[_ChunkPlan], np.ndarray]:
        """The chunks of a shared tensor for a held-digest plan, and the group's sum of the digest moves
        of the chunks its processes hold whole. Those are decoded once, by their holder, on its threads;
        the chunks split between processes are decoded by each on this thread, in one order (their
        segments are assembled over the group). A failure in a chunk held whole does not change which
        collective calls a process makes: the group sum carries it, and every process refuses."""
        from ..integrity import additive

        ap = self.ap

        recs = ap.d.chunks(e)
        futs = {r.chunk_index: ap._own_pool.submit(chunk, r, True) for r in recs if roles[r.chunk_index] == "mine"}
        out: list[_ChunkPlan] = []
        err: BaseException | None = None
        group = [r for r in recs if roles[r.chunk_index] == "group"]
        grouped: dict[int, _ChunkPlan] = {}  # the plans of the chunks split between processes
        if ap._split:
            grouped, err = self._plan_split(e, group)
        else:  # every process assembles and decodes each one, in one order
            try:
                grouped = {c.rec.chunk_index: c for c in in_step(
                    chunk, lambda r: ap.segs.read_segment(e.name, r.chunk_index), group)}
            except Exception as ex:
                err = ex
        try:
            for r in recs:
                if roles[r.chunk_index] == "group":
                    if r.chunk_index in grouped:
                        out.append(grouped[r.chunk_index])
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
                if c.own or (c.split and c.moved is not None):
                    local = additive.add(local, c.moved)
        moved, ok = ap.segs.group_sum(local, err is None)
        if err is not None:
            raise err
        if not ok:
            raise VerificationError(GROUP_REFUSED)
        self._keep_split(out)
        return out, moved

    def split_changes(self, e: TensorEntry, r: ChunkRecord, region: np.ndarray):
        """(positions, target bits, digest move) of chunk ``r`` decoded against its assembled ``region``,
        by the process that decodes it."""
        ap = self.ap
        view = ap._view(region, e.base.dtype)
        patch = ap._decode_held(ap.d, e, r, view)
        if ap.progress:
            ap.progress(_seg_len(e.base.nbytes, r.chunk_index))
        ap._record_moves(e, r.chunk_index, view, patch)  # its decoder's book: it decodes this chunk every time
        pos, new = _changes(patch, view)
        return pos, new, _moved_by(e, r, view, patch, pos, new)

    def _plan_split(self, e: TensorEntry, recs: list[ChunkRecord]
                    ) -> tuple[dict[int, _ChunkPlan], BaseException | None]:
        """The plans of a shared tensor's chunks split between the group's processes (in ``recs``' order,
        the same in every process), and the first failure. A window of them (``split_window``, the
        group's) at a time: each assembled at the process that decodes it (``split_owner``), every
        process decoding its share of the window on its threads, then the changes sent to the group. A
        failure is known to every process in the same window (its decoder sends no changes): all of
        them stop there."""
        ap = self.ap
        out: dict[int, _ChunkPlan] = {}
        err: BaseException | None = None
        step = ap.segs.split_window
        for i in range(0, len(recs), step):
            win = recs[i:i + step]
            items = [(r.chunk_index, ap.segs.split_owner(e.name, r.chunk_index)) for r in win]
            regions = ap.segs.assemble_window(e.name, items)
            futs = [ap._own_pool.submit(self.split_changes, e, r, region) if region is not None else None
                    for r, region in zip(win, regions, strict=True)]
            got: list[tuple[np.ndarray, np.ndarray] | None] = []
            moved: list[np.ndarray | None] = []
            for f in futs:
                pos = new = mv = None
                if f is not None:
                    try:
                        pos, new, mv = f.result()
                    except Exception as ex:
                        err = err or ex
                got.append(None if pos is None else (pos, new))
                moved.append(mv)
            shared = ap.segs.share_window(e.name, [(ci, owner, g) for (ci, owner), g in zip(items, got,
                                                                                               strict=True)])
            for r, mv, sh in zip(win, moved, shared, strict=True):
                if sh is None:
                    if err is None:
                        err = VerificationError(f"{_where(e, r)}: the process of the group that decodes it refused "
                                                "or failed (see its log)")
                    continue
                out[r.chunk_index] = _ChunkPlan(r, "todo", Patch(sh[0], sh[1], None), mv, split=True)
            if err is not None:
                break
        return out, err

    def _keep_split(self, chunks: list[_ChunkPlan]) -> None:
        """``_keep_within_budget`` for the split chunks among ``chunks``, decided with the group (one
        collective call): a split chunk's changes are kept only where every process keeps them, so that
        every process sends them again, at the same chunk, when it is written."""
        ap = self.ap
        split = [c for c in chunks if c.split]
        if not split:
            return
        flags = [ap._reserve(_patch_bytes(c.patch)) for c in split]
        for c, keep, all_keep in zip(split, flags, ap.segs.agree_each(np.array(flags, bool)), strict=True):
            if not all_keep:
                if keep:
                    ap._reserve(-_patch_bytes(c.patch))
                c.patch = None
