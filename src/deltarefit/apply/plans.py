"""The records of an apply plan: per tensor (``_TensorPlan``) and per chunk (``_ChunkPlan``), what the
plan found and decided, which the write and the final check act on."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..codec.chunk import Patch
from ..format import ChunkRecord, TensorEntry


@dataclass
class _ChunkPlan:
    rec: ChunkRecord
    state: str  # "todo", "done", "torn", "other" (held and written by another process of the group)
    patch: Patch | None = None
    moved: np.ndarray | None = None  # held-digest plan: how the chunk's changes move the tensor's digest
    own: bool = False  # a segment of a shared tensor that this process holds whole (no collective call)
    # A segment split between the processes of a group, decoded by one of them (held-digest plans): the
    # patch is its changes as that process sent them; ``moved`` is set there alone.
    split: bool = False
    # A plan made ahead of its write (``plan_apply(ahead=True)``): the bits the changed elements held when
    # decoded, which they must still hold when the write begins (``Applier.recheck_held``).
    old: np.ndarray | None = None


@dataclass
class _TensorPlan:
    entry: TensorEntry
    state: str  # "patch", "held", "done", "add", "remove", "replace"
    segs: list[bytes] = field(default_factory=list)  # current segment hashes (patch tensors)
    chunks: list[_ChunkPlan] = field(default_factory=list)
    sum: np.ndarray | None = None  # "held": the additive digest after the patch
