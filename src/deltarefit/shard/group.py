"""The processes that must agree: one ``Group`` protocol for every collective deltarefit makes.

Three users hold a group: a vLLM worker's tensor-parallel group (``engines.vllm.group.WorkerGroup``,
over the CPU group vLLM keeps beside the device one), the collective live target it drives
(``engines.live.LiveTarget``: segments assembled, digest moves summed, steps agreed) and a rollout
rank's TP group in ``sync_sharded`` (``TPGroup``). Each speaks ``Group``; ``ALONE`` is the group of one
process, and ``TorchGroup`` the group of a ``torch.distributed`` process group (gloo: numpy arrays cross
as CPU tensors).

Every member calls each collective together, in the same order, with arrays of the same shape and
dtype (a member that skips one hangs the group). Only integers and additive digest limbs cross
processes, never pickled objects.
"""

from __future__ import annotations

import math
from typing import Any, Protocol, runtime_checkable

import numpy as np

from .rollout import group_check, slice_digests

__all__ = ["ALONE", "Alone", "Group", "TPGroup", "TorchGroup", "agree_each", "sum_and_agree"]


@runtime_checkable
class Group(Protocol):
    """The processes that must agree. ``rank`` in ``range(size)``; the calls below are collective (every
    member, together, same order, same shapes); in a group of one each is the identity."""

    @property
    def rank(self) -> int:
        """This process's rank in the group (0 in a group of one)."""
        ...

    @property
    def size(self) -> int:
        """How many processes the group has (1 for one alone)."""
        ...

    def sum(self, a: np.ndarray) -> np.ndarray:
        """The element-wise sum of ``a`` (int64) over the group, a new array; ``a`` is left as it is."""
        ...

    def min(self, a: np.ndarray) -> np.ndarray:
        """The element-wise minimum of ``a`` over the group, a new array."""
        ...

    def max(self, a: np.ndarray) -> np.ndarray:
        """The element-wise maximum of ``a`` over the group, a new array."""
        ...

    def reduce_in_place(self, a: np.ndarray) -> None:
        """``a`` (contiguous) replaced by its sum over the group, in every member."""
        ...

    def sum_to(self, a: np.ndarray, dst: int) -> None:
        """``a`` (contiguous) summed over the group into member ``dst``'s ``a``; the others' are left as
        they are or used as scratch."""
        ...

    def broadcast(self, a: np.ndarray, src: int) -> None:
        """Member ``src``'s ``a`` (contiguous) copied into every member's ``a``."""
        ...

    def agree(self, ok: bool) -> bool:
        """Whether every member reports ``ok``: one collective, so a failure anywhere fails every member
        at the same step."""
        ...

    def shared_buffer(self, nbytes: int) -> np.ndarray | None:
        """``nbytes`` that every member maps, or None in every member (none where the members cannot
        share memory)."""
        ...


class Alone:
    """``Group`` of one process: every collective is the identity, nothing crosses anything."""

    rank = 0
    size = 1

    def sum(self, a: np.ndarray) -> np.ndarray:
        return a.copy()

    def min(self, a: np.ndarray) -> np.ndarray:
        return a.copy()

    def max(self, a: np.ndarray) -> np.ndarray:
        return a.copy()

    def reduce_in_place(self, a: np.ndarray) -> None:
        pass

    def sum_to(self, a: np.ndarray, dst: int) -> None:
        pass

    def broadcast(self, a: np.ndarray, src: int) -> None:
        pass

    def agree(self, ok: bool) -> bool:
        return ok

    def shared_buffer(self, nbytes: int) -> np.ndarray | None:
        return None


ALONE = Alone()


class TorchGroup:
    """``Group`` over a ``torch.distributed`` process group ``pg`` that takes CPU tensors (gloo); None:
    a process on its own (every call the identity, as ``Alone``). Arrays cross as CPU tensors sharing
    their memory. ``shared_buffer``: None (a subclass that can map memory says otherwise)."""

    def __init__(self, pg: Any | None) -> None:
        self.pg = pg
        if pg is None:
            self.rank, self.size = 0, 1
        else:
            import torch.distributed as dist

            self.rank, self.size = dist.get_rank(pg), dist.get_world_size(pg)

    def _reduce(self, a: np.ndarray, op: str) -> np.ndarray:
        """``a`` reduced by ``op`` (a ``ReduceOp`` name) over the group: in place where ``a`` is contiguous,
        the result returned."""
        if self.pg is None:
            return a
        import torch
        import torch.distributed as dist

        t = torch.from_numpy(np.ascontiguousarray(a))
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=self.pg)
        return t.numpy()

    def sum(self, a: np.ndarray) -> np.ndarray:
        return self._reduce(a.copy(), "SUM")

    def min(self, a: np.ndarray) -> np.ndarray:
        return self._reduce(a.copy(), "MIN")

    def max(self, a: np.ndarray) -> np.ndarray:
        return self._reduce(a.copy(), "MAX")

    def reduce_in_place(self, a: np.ndarray) -> None:
        if self.pg is not None:
            a[:] = self._reduce(a, "SUM")

    def sum_to(self, a: np.ndarray, dst: int) -> None:
        if self.pg is None:
            return
        import torch
        import torch.distributed as dist

        dist.reduce(torch.from_numpy(a), dst=dist.get_global_rank(self.pg, dst), op=dist.ReduceOp.SUM, group=self.pg)

    def broadcast(self, a: np.ndarray, src: int) -> None:
        if self.pg is None:
            return
        import torch
        import torch.distributed as dist

        dist.broadcast(torch.from_numpy(a), src=dist.get_global_rank(self.pg, src), group=self.pg)

    def agree(self, ok: bool) -> bool:
        # One int64 per member, its maximum: 0 where every member is ok.
        return bool(self._reduce(np.array([0 if ok else 1], np.int64), "MAX")[0] == 0)

    def shared_buffer(self, nbytes: int) -> np.ndarray | None:
        return None


def agree_each(group: Group, flags: np.ndarray) -> np.ndarray:
    """Per entry of ``flags`` (bools, the same length in every member), whether every member of
    ``group`` reports it true: one sum over the group (none for no flags)."""
    acc = (~np.asarray(flags, bool)).astype(np.int64)
    if acc.size:
        group.reduce_in_place(acc)
    return acc == 0


def sum_and_agree(group: Group, moved: np.ndarray, ok: bool) -> tuple[np.ndarray, bool]:
    """(the sum over ``group`` of ``moved``, uint64 lanes added modulo 2**64, flattened; whether every
    member reported ``ok``): one sum over the group, digest moves and failure together."""
    v = np.asarray(moved, np.uint64).reshape(-1)
    # Summed as 32-bit halves in int64, which no group of fewer than 2**31 processes overflows.
    acc = np.concatenate([(v & np.uint64(0xFFFFFFFF)).astype(np.int64), (v >> np.uint64(32)).astype(np.int64),
                          np.array([0 if ok else 1], np.int64)])
    group.reduce_in_place(acc)
    n = v.size
    lo, hi = acc[:n].astype(np.uint64), acc[n:2 * n].astype(np.uint64)
    return (lo + (hi << np.uint64(32))).astype(np.uint64), bool(acc[-1] == 0)


class TPGroup(TorchGroup):
    """A rollout rank's TP group in ``sync_sharded`` (``group``: its ``torch.distributed`` group, None for
    a rank on its own): ``agree``, and the checks that the ranks hold the same versions and, summed,
    the manifest's digests."""

    def same(self, values: list[int]) -> bool:
        """Whether every member passed the same ``values`` (one maximum of them and their negatives)."""
        if self.pg is None:
            return True
        t = self.max(np.array(values + [-x for x in values], np.int64))
        n = len(values)
        return all(int(t[i]) == -int(t[n + i]) for i in range(n))

    def check(self, tensors, layout, man: dict, which: str, alt: str | None = None) -> list[str]:
        """Tensors whose group-summed digest is not the manifest's ``which`` (nor ``alt``) digest. A rank
        on its own checks the tensors it owns every element of (the others it cannot tell alone)."""
        from ..integrity import additive as D

        names = sorted(man["tensors"])
        if self.pg is None:
            whole = {n: man["tensors"][n] for n in _owned_whole(layout, man["tensors"])}
            mine = slice_digests(tensors, layout, man["tensors"])
            bad = group_check(mine, {"tensors": whole}, which)
            return bad if alt is None else sorted(set(bad) & set(group_check(mine, {"tensors": whole}, alt)))
        mine = slice_digests(tensors, layout, man["tensors"])
        limbs = np.stack([D.to_limbs(mine.get(n, D.ZERO)) for n in names])
        self.reduce_in_place(limbs)
        summed = {n: D.from_limbs(limbs[i]) for i, n in enumerate(names)}
        bad = group_check(summed, man, which)
        return bad if alt is None else sorted(set(bad) & set(group_check(summed, man, alt)))


def _owned_whole(layout, meta) -> list[str]:
    """The manifest's tensors whose every element this rank's owner pieces hold."""
    owned: dict[str, int] = {}
    for lt in layout.values():
        for p in lt.pieces:
            if p.owner and p.count:
                owned[p.name] = owned.get(p.name, 0) + p.count
    return [n for n, c in owned.items() if n in meta and c == math.prod(int(d) for d in meta[n]["shape"])]
