"""Collectives of a rollout rank's tensor-parallel group, for ``sync_sharded``: every member calls each
one together, in the same order (a member that skips one hangs the group). Only integers and additive
digest limbs cross ranks, never pickled objects."""

from __future__ import annotations

import numpy as np

from .rollout import group_check, slice_digests


class TPGroup:
    """Collectives of a rollout TP group (None: a rank on its own)."""

    def __init__(self, group) -> None:
        self.group = group

    def agree(self, ok: bool) -> bool:
        if self.group is None:
            return ok
        import torch
        import torch.distributed as dist

        t = torch.tensor([int(ok)], dtype=torch.int64)
        dist.all_reduce(t, group=self.group, op=dist.ReduceOp.MIN)
        return bool(int(t[0]))

    def same(self, values: list[int]) -> bool:
        if self.group is None:
            return True
        import torch
        import torch.distributed as dist

        t = torch.tensor(values + [-x for x in values], dtype=torch.int64)
        dist.all_reduce(t, group=self.group, op=dist.ReduceOp.MAX)
        n = len(values)
        return all(int(t[i]) == -int(t[n + i]) for i in range(n))

    def check(self, tensors, layout, man: dict, which: str, alt: str | None = None) -> list[str]:
        """Tensors whose group-summed digest is not the manifest's ``which`` (nor ``alt``) digest."""
        if self.group is None:
            return []
        import torch
        import torch.distributed as dist

        from ..integrity import additive as D

        names = sorted(man["tensors"])
        mine = slice_digests(tensors, layout, man["tensors"])
        limbs = torch.from_numpy(np.stack([D.to_limbs(mine.get(n, D.ZERO)) for n in names]))
        dist.all_reduce(limbs, group=self.group)
        summed = {n: D.from_limbs(limbs[i].numpy()) for i, n in enumerate(names)}
        bad = group_check(summed, man, which)
        return bad if alt is None else sorted(set(bad) & set(group_check(summed, man, alt)))
