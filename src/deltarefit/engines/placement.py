"""Where a checkpoint tensor's elements live in engine parameters (``Placement``: a parameter and a
``geometry.projection.Piece``), read and written there: the runs a piece maps (``contiguous_run``,
``row_runs``, ``row_local``), a parameter's elements as one flat array (``_Flat``: numpy views of CPU
memory, torch indexing elsewhere), and what a segment split between the processes of a group costs and
how its decoded changes are sent (``SPLIT_AHEAD``, ``RESULT_BYTES``, ``_pack_changes``). The pieces of
``engines.live.LiveTarget``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import UsageError
from ..geometry.projection import Piece

# Split segments in flight per process of a group, unless its caller says (``LiveTarget.split_window``),
# and in all (their slots cost 2 MiB each of shared memory).
SPLIT_AHEAD = 4
SPLIT_WINDOW_MAX = 32
# Bytes of a split segment's decoded changes sent through a group's shared memory (more go by broadcast).
RESULT_BYTES = 1 << 20
__all__ = ["RESULT_BYTES", "SPLIT_AHEAD", "SPLIT_WINDOW_MAX", "Placement", "contiguous_run", "row_local", "row_runs"]


@dataclass(frozen=True)
class Placement:
    """Where a box of checkpoint tensor ``piece.name`` lives: in parameter ``param`` (``piece.local_shape``)."""

    param: str
    piece: Piece


@dataclass(frozen=True)
class _Info:
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def contiguous_run(p: Piece) -> tuple[int, int, int] | None:
    """(checkpoint flat start, local flat start, count) when the piece maps a run of consecutive checkpoint
    elements onto a run of consecutive local ones in the same order; None otherwise."""

    def run(shape: Sequence[int], coords: Sequence[tuple[int, int]]) -> int | None:
        # A box (per dim: start, length) is one run iff the dims after the first with length > 1 are full.
        seen = False
        for n, (off, ln) in zip(shape, coords, strict=True):
            if seen and (off != 0 or ln != n):
                return None
            if ln > 1:
                seen = True
        return int(np.ravel_multi_index([off for off, _ in coords], shape)) if all(n for n in shape) else 0

    axes = sorted(p.axes, key=lambda a: a.dst_dim)
    if any(a.length > 1 and (a.dst_stride != 1 or a.src_stride != 1) for a in p.axes) or p.count == 0:
        return None
    # Same element order on both sides: the local dims, in order, must run along checkpoint dims in order.
    moving = [a.dst_dim for a in p.axes if a.length > 1]
    if moving != sorted(moving):
        return None
    c0 = run(p.shape, [(a.dst_off, a.length) for a in axes])
    l0 = run(p.local_shape, [(a.src_off, a.length) for a in p.axes])
    if c0 is None or l0 is None:
        return None
    return c0, l0, p.count


def _row_axis(p: Piece):
    """The piece's last axis when it runs along the checkpoint's last dimension in order with stride 1
    on both sides (each checkpoint row of its box is one local run), else None."""
    last = p.axes[-1]
    return last if last.dst_dim == len(p.shape) - 1 and last.dst_stride == 1 and last.src_stride == 1 else None


def row_runs(p: Piece, a: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The piece's elements among checkpoint flat elements ``[a, b)`` as runs (checkpoint start, local
    start, length: int64 arrays), one per checkpoint row of its box (the rows of the last dimension),
    when its last local axis runs along the checkpoint's last dimension in order with stride 1 on both
    sides (a TP column slice, a fused row block); None otherwise. Costs O(rows), not O(elements)."""
    last = _row_axis(p)
    if last is None or b <= a:
        return None
    width = p.shape[-1]
    starts = np.arange(a // width, (b - 1) // width + 1, dtype=np.int64) * width + last.dst_off
    loc = p.to_local(starts)
    keep = loc >= 0
    starts, loc = starts[keep], loc[keep]
    lo, hi = np.maximum(starts, a), np.minimum(starts + last.length, b)
    keep = lo < hi
    return lo[keep], (loc + lo - starts)[keep], (hi - lo)[keep]


def row_local(p: Piece, ck: np.ndarray) -> np.ndarray | None:
    """``p.to_local(ck)`` (-1 outside the piece) for a piece ``row_runs`` takes, with ``to_local`` run once
    per run of equal checkpoint rows in ``ck`` instead of once per element (sorted positions, the
    changes of a patch, have few rows); None for another piece."""
    last = _row_axis(p)
    if last is None:
        return None
    ck = np.asarray(ck, np.int64)
    if ck.size == 0:
        return np.empty(0, np.int64)
    width = p.shape[-1]
    rows = ck // width
    first = np.flatnonzero(np.diff(rows, prepend=rows[0] - 1))
    at = np.repeat(p.to_local(rows[first] * width + last.dst_off), np.diff(np.append(first, ck.size)))
    d = ck - rows * width - last.dst_off
    return np.where((at >= 0) & (d >= 0) & (d < last.length), at + d, -1)


def _pack_changes(buf: np.ndarray, pos: np.ndarray, vals: np.ndarray) -> None:
    """A segment's changes into bytes ``buf`` (exactly their size): ``u32 positions ‖ target bits``."""
    n = pos.size
    buf[:4 * n] = np.asarray(pos, "<u4").view(np.uint8)
    buf[4 * n:] = np.ascontiguousarray(vals).view(np.uint8)


def _unpack_changes(buf: np.ndarray, n: int, uint: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """``_pack_changes``'s ``n`` changes from ``buf``: (int64 positions, target bits), copies."""
    return buf[:4 * n].view("<u4").astype(np.int64), buf[4 * n:n * (4 + uint.itemsize)].view(uint).copy()


class _Flat:
    """A parameter's elements as one flat array of the dtype's unsigned integers."""

    def __init__(self, name: str, t, uint: np.dtype) -> None:
        import torch

        if not t.is_contiguous():
            raise UsageError(f"parameter {name!r} is not contiguous; live apply needs contiguous parameters")
        self.t = t
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        flat = t.detach().reshape(-1).view(ints)
        self.cpu = t.device.type == "cpu"
        self.np = flat.numpy().view(uint) if self.cpu else None
        self.torch = flat
        self.uint = uint

    def take(self, idx: np.ndarray) -> np.ndarray:
        if self.cpu:
            return self.np[idx]
        import torch

        return self.torch[torch.from_numpy(idx).to(self.torch.device)].cpu().numpy().view(self.uint)

    def put(self, idx: np.ndarray, vals: np.ndarray) -> None:
        if self.cpu:
            self.np[idx] = vals
            return
        import torch

        dev = self.torch.device
        signed = np.ascontiguousarray(vals).view(_signed(np.dtype(vals.dtype)))
        self.torch[torch.from_numpy(idx).to(dev)] = torch.from_numpy(signed).to(dev)

    def read_run(self, l0: int, n: int) -> np.ndarray:
        if self.cpu:
            return self.np[l0:l0 + n]
        return self.torch[l0:l0 + n].cpu().numpy().view(self.uint)


def _signed(u: np.dtype) -> np.dtype:
    return np.dtype(np.uint8) if u.itemsize == 1 else np.dtype(f"<i{u.itemsize}")


def owned_in(places: Sequence[tuple[Placement, tuple[int, int, int] | None]], a: int, b: int) -> int:
    """How many of checkpoint elements ``[a, b)`` the owner pieces of ``places`` hold (a tensor's
    placements in this process, each with its ``contiguous_run``)."""
    n = 0
    for pl, run in places:
        if not pl.piece.owner:
            continue
        if run is not None:
            n += max(0, min(b, run[0] + run[2]) - max(a, run[0]))
        else:
            n += int(np.count_nonzero(pl.piece.to_local(np.arange(a, b, dtype=np.int64)) >= 0))
    return n
