"""One apply target over an engine's parts (``TargetUnion``: live placements beside host copies), and a
tensor's digests as a ``SegmentTarget`` reads it (``state_through``, ``digest_through``; what a live
engine is checked against at init and by ``verify``), and ``apply_live``: a delta through the one apply
protocol into such a target."""

from __future__ import annotations

import numpy as np

from ..codec.chunk import Patch
from ..dtypes import dtype as lookup_dtype
from ..errors import UsageError
from ..integrity import SEGMENT_BYTES
from ..shard.group import ALONE, agree_each, sum_and_agree
from .placement import SPLIT_AHEAD

__all__ = ["TargetUnion", "apply_live", "digest_through", "state_through"]


class TargetUnion:
    """One ``SegmentTarget`` over several disjoint ones (live placements beside host copies of the
    tensors an engine reloads), each tensor read and written through the target that holds it."""

    def __init__(self, *targets: object) -> None:
        from ..apply.targets import segments_of

        self.tensors: dict = {}
        self._of: dict[str, object] = {}
        for t in targets:
            seg = segments_of(t)
            for n, info in t.tensors.items():
                if n in self.tensors:
                    raise UsageError(f"tensor {n!r} is held by two targets")
                self.tensors[n] = info
                self._of[n] = seg
        # A union with a collective part is collective: the applier must drive it in one order on one
        # thread, or the group's processes issue their collectives in different orders and hang.
        self._group = [seg for seg in map(segments_of, targets) if getattr(seg, "collective", False)]
        if len(self._group) > 1:
            raise UsageError("a target union may hold one collective target at most")
        self.collective = bool(self._group)

    def agree(self, ok: bool) -> bool:
        """The collective part's agreement (``LiveTarget.agree``); ``ok`` itself without one."""
        return self._group[0].agree(ok) if self._group else ok

    def read_segment(self, name: str, ci: int) -> np.ndarray:
        return self._of[name].read_segment(name, ci)

    def write_segment(self, name: str, ci: int, region: np.ndarray, view: np.ndarray, patch: Patch) -> np.ndarray:
        return self._of[name].write_segment(name, ci, region, view, patch)

    def chunk_roles(self, name: str) -> list[str] | None:
        """The collective part's ``LiveTarget.chunk_roles`` for the tensors it holds; None for the others."""
        roles = getattr(self._of[name], "chunk_roles", None)
        return roles(name) if roles is not None else None

    def read_own(self, name: str, ci: int) -> np.ndarray:
        return self._of[name].read_own(name, ci)

    # The collective part's calls for segments split between its processes (``LiveTarget``; a union
    # holds at most one collective target, and only its tensors have split segments).
    @property
    def rank(self) -> int:
        return self._group[0].rank if self._group else 0

    @property
    def size(self) -> int:
        return self._group[0].size if self._group else 1

    def agree_each(self, flags: np.ndarray) -> np.ndarray:
        return self._group[0].agree_each(flags) if self._group else agree_each(ALONE, flags)

    @property
    def split_window(self) -> int:
        return self._group[0].split_window if self._group else SPLIT_AHEAD

    def split_owner(self, name: str, ci: int) -> int:
        return self._of[name].split_owner(name, ci)

    def assemble_window(self, name: str, items) -> list:
        return self._of[name].assemble_window(name, items)

    def share_window(self, name: str, items) -> list:
        return self._of[name].share_window(name, items)

    def write_split(self, name: str, ci: int, pos: np.ndarray, new: np.ndarray) -> bool:
        return self._of[name].write_split(name, ci, pos, new)

    def write_own(self, name: str, ci: int, region: np.ndarray, view: np.ndarray, patch: Patch) -> np.ndarray:
        return self._of[name].write_own(name, ci, region, view, patch)

    def group_sum(self, moved: np.ndarray, ok: bool) -> tuple[np.ndarray, bool]:
        """The collective part's ``LiveTarget.group_sum``."""
        if not self._group:
            return sum_and_agree(ALONE, moved, ok)
        return self._group[0].group_sum(moved, ok)


def digest_through(target: object, name: str) -> bytes:
    """Tensor digest of ``name`` as a ``SegmentTarget`` reads it (every segment hashed)."""
    return state_through(target, name)[0]


def state_through(target: object, name: str) -> tuple[bytes, bytes]:
    """(tensor digest, additive digest) of ``name`` as a ``SegmentTarget`` reads it, in one pass over
    its segments: what a held-digest apply (``applier.run_apply(held=)``) is given, taken together with
    the full check it rests on."""
    from ..apply.targets import segments_of
    from ..integrity import additive, n_segments, seg_hash, tensor_digest_from_segments

    target = segments_of(target)
    info = target.tensors[name]
    dt = lookup_dtype(info.dtype)
    seed = additive.seeds(name, info.dtype, info.shape)
    per = SEGMENT_BYTES // dt.itemsize
    segs, acc = [], additive.ZERO.copy()
    for ci in range(n_segments(info.nbytes)):
        region = target.read_segment(name, ci)
        segs.append(seg_hash(region))
        acc = additive.add(acc, additive.partial_run(seed, ci * per, region.view(dt.uint)))
    return tensor_digest_from_segments(info.dtype, info.shape, info.nbytes, segs), np.asarray(acc, "<u8").tobytes()


def apply_live(delta_path: str, target: object, *, threads: int | None = None):
    """Apply a delta into a live target (``LiveTarget``, ``TargetUnion``) through the one apply protocol:
    base verified, every post-image checked, then only changed elements written, then verified. No
    journal: the target is memory, and a rerun after any failure completes it (chunks already at their
    post-image are skipped). Deltas that add, remove or re-type tensors are refused before any write."""
    from ..apply.protocol import run_apply
    from ..format import DeltaReader

    with DeltaReader(delta_path) as d:
        return run_apply(d, target, journal=None, threads=threads)
