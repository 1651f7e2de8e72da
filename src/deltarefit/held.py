"""The held-digest plan of the one apply protocol (``applier``; FORMAT.md "Held digests"): a tensor whose
target holds the additive digest of what it holds is checked in O(changed elements), each chunk decoded
against its segment as it is and the digest moved by every change compared with the delta's; on a
collective target, a segment one process holds whole is decoded there alone."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .errors import BaseMismatchError, VerificationError
from .format import ChunkRecord, TensorEntry
from .plans import _ChunkPlan, _TensorPlan
from .regions import (
    _changes,
    _moved,
    _seg_len,
    _where,
)


class HeldPlans:
    """``Applier``'s held-digest plans (they use its delta, target, pools and budget)."""

    def _plan_held(self, pool, e: TensorEntry, held: bytes) -> _TensorPlan:
        """The held-digest plan of a ``same``/``patch`` tensor (module docstring): decode every chunk
        against the segment as it is, and require the digest moved by the changes to be the target's."""
        from .shard import digest as additive

        if held == e.target.sum and held != e.base.sum:  # already at the target (a rerun)
            if self.moves is not None:  # its moves are not known here
                self.moves.incomplete = True
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
            self._record_moves(e, r.chunk_index, view, patch)
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
        segments are assembled over the group). A failure in a chunk held whole does not change which
        collective calls a process makes: the group sum carries it, and every process refuses."""
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
