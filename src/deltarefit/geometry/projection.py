"""Affine maps from a rank's local tensor to checkpoint tensors, and their intersections.

A **piece** says where a box of a local tensor lives in one checkpoint tensor: per local dimension an
``Axis`` (local offset and stride, length, the checkpoint dimension it runs along, checkpoint offset
and stride). The checkpoint dimensions of the axes are a permutation, so transposes are pieces too.
A local tensor is a small list of pieces: one for a plain shard, several for a fused parameter (a
trainer's fused ``qkv_proj`` rows are three pieces into ``q_proj``/``k_proj``/``v_proj``).

A **box** is the image of a piece in checkpoint coordinates: per checkpoint dimension an arithmetic
progression ``(offset, stride, length)``. Box order (row-major over the box, in checkpoint dimension
order) is the element order of everything that travels, so two ranks with different local layouts
agree on it without talking.

Everything here is pure and vectorized (numpy int64 index arrays); nothing touches tensor data.
Index conventions: *flat* indices are row-major over the full local tensor or the full checkpoint
tensor; *order* indices ``k`` count 0..count-1 within a piece or box.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from ..errors import UsageError

__all__ = ["AP", "Axis", "Box", "Piece", "box_indices", "chunk_range", "fused_pieces", "intersect_ap", "intersect_boxes",
           "intersect_pieces", "placement_box", "shard_pieces", "whole_piece"]


# ------------------------------------------------------------------------------ 1-D progressions

@dataclass(frozen=True)
class AP:
    """Indices ``off + stride * i`` for ``0 <= i < length`` along one checkpoint dimension."""

    off: int
    stride: int
    length: int

    @property
    def last(self) -> int:
        return self.off + self.stride * (self.length - 1)


def intersect_ap(a: AP, b: AP) -> AP | None:
    """The common indices of two progressions (a progression, stride lcm), or None when disjoint."""
    if a.length <= 0 or b.length <= 0:
        return None
    g = math.gcd(a.stride, b.stride)
    if (b.off - a.off) % g:
        return None
    lcm = a.stride // g * b.stride
    m = b.stride // g
    inv = pow(a.stride // g, -1, m) if m > 1 else 0
    x0 = a.off + a.stride * (((b.off - a.off) // g * inv) % m)  # x0 = a.off mod a.s, = b.off mod b.s
    lo, hi = max(a.off, b.off), min(a.last, b.last)
    first = x0 + -(-(lo - x0) // lcm) * lcm
    if first > hi:
        return None
    return AP(first, lcm, (hi - first) // lcm + 1)


# ------------------------------------------------------------------------------------------- box

@dataclass(frozen=True)
class Box:
    """A strided box of a checkpoint tensor of ``shape``: one AP per checkpoint dimension."""

    shape: tuple[int, ...]
    aps: tuple[AP, ...]

    @property
    def count(self) -> int:
        return math.prod(ap.length for ap in self.aps)

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(ap.length for ap in self.aps)

    def flat(self, k: np.ndarray) -> np.ndarray:
        """Checkpoint flat indices of box-order indices ``k`` (int64 array)."""
        idx = np.unravel_index(np.asarray(k, np.int64), self.lengths)
        coords = [ap.off + ap.stride * i for ap, i in zip(self.aps, idx, strict=True)]
        return np.ravel_multi_index(coords, self.shape).astype(np.int64, copy=False)

    def order(self, flat: np.ndarray) -> np.ndarray:
        """Box-order indices of checkpoint flat indices; -1 where an index is not in the box."""
        coords = np.unravel_index(np.asarray(flat, np.int64), self.shape)
        ok = np.ones(np.shape(flat), bool)
        rel = []
        for ap, c in zip(self.aps, coords, strict=True):
            d = c - ap.off
            i = d // ap.stride
            ok &= (d >= 0) & (d % ap.stride == 0) & (i < ap.length)
            rel.append(np.where(ok, i, 0))
        k = np.ravel_multi_index(rel, self.lengths).astype(np.int64, copy=False) if self.count else \
            np.zeros(np.shape(flat), np.int64)
        return np.where(ok, k, -1)

    def is_contiguous_grid(self) -> bool:
        return all(ap.stride == 1 or ap.length <= 1 for ap in self.aps)

    def to_json(self) -> list[list[int]]:
        return [[ap.off, ap.stride, ap.length] for ap in self.aps]

    @staticmethod
    def from_json(shape: Sequence[int], j) -> Box:
        return Box(tuple(int(d) for d in shape), tuple(AP(int(o), int(s), int(n)) for o, s, n in j))


def intersect_boxes(a: Box, b: Box) -> Box | None:
    """Common elements of two boxes of the same checkpoint tensor, or None."""
    if a.shape != b.shape:
        raise UsageError(f"boxes of different tensors: shapes {a.shape} and {b.shape}")
    aps = []
    for x, y in zip(a.aps, b.aps, strict=True):
        z = intersect_ap(x, y)
        if z is None:
            return None
        aps.append(z)
    return Box(a.shape, tuple(aps))


# ----------------------------------------------------------------------------------------- piece

@dataclass(frozen=True)
class Axis:
    """One local dimension of a piece: local ``src_off + src_stride * i`` -> checkpoint dimension
    ``dst_dim`` at ``dst_off + dst_stride * i``, for ``0 <= i < length``."""

    src_off: int
    length: int
    dst_dim: int
    dst_off: int
    dst_stride: int = 1
    src_stride: int = 1


@dataclass(frozen=True)
class Piece:
    """Where a box of a local tensor (``local_shape``) lives in checkpoint tensor ``name`` (``shape``).

    ``owner`` is False for a replica another rank also holds: it is written on apply but neither
    published nor counted in digest sums (exactly one rank owns each checkpoint element).
    """

    name: str
    shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    axes: tuple[Axis, ...]
    owner: bool = True

    def __post_init__(self) -> None:
        if not (len(self.axes) == len(self.local_shape) == len(self.shape)) or not self.shape:
            raise UsageError(f"piece of {self.name!r}: local rank {len(self.local_shape)}, {len(self.axes)} axes, "
                             f"checkpoint rank {len(self.shape)} must be equal and >= 1")
        if sorted(a.dst_dim for a in self.axes) != list(range(len(self.shape))):
            raise UsageError(f"piece of {self.name!r}: destination dims {[a.dst_dim for a in self.axes]} "
                             "are not a permutation")
        for d, a in enumerate(self.axes):
            if a.length < 0 or a.src_stride < 1 or a.dst_stride < 1:
                raise UsageError(f"piece of {self.name!r}: bad axis {a}")
            if a.length and not (a.src_off >= 0 and a.src_off + a.src_stride * (a.length - 1) < self.local_shape[d]
                                 and a.dst_off >= 0
                                 and a.dst_off + a.dst_stride * (a.length - 1) < self.shape[a.dst_dim]):
                raise UsageError(f"piece of {self.name!r}: axis {d} {a} leaves local shape {self.local_shape} "
                                 f"or checkpoint shape {self.shape}")

    @property
    def count(self) -> int:
        return math.prod(a.length for a in self.axes)

    def box(self) -> Box:
        aps = [AP(0, 1, 0)] * len(self.shape)
        for a in self.axes:
            aps[a.dst_dim] = AP(a.dst_off, a.dst_stride, a.length)
        return Box(self.shape, tuple(aps))

    def to_ckpt(self, local_flat: np.ndarray) -> np.ndarray:
        """Checkpoint flat indices of local flat indices (which must lie in the piece)."""
        idx = np.unravel_index(np.asarray(local_flat, np.int64), self.local_shape)
        coords: list = [None] * len(self.shape)
        for a, i in zip(self.axes, idx, strict=True):
            d = i - a.src_off
            j = d // a.src_stride
            if np.any((d < 0) | (d % a.src_stride != 0) | (j >= a.length)):
                raise UsageError(f"piece of {self.name!r}: local index outside the piece")
            coords[a.dst_dim] = a.dst_off + a.dst_stride * j
        return np.ravel_multi_index(coords, self.shape).astype(np.int64, copy=False)

    def to_local(self, ckpt_flat: np.ndarray) -> np.ndarray:
        """Local flat indices of checkpoint flat indices; -1 where an index is not in the piece."""
        coords = np.unravel_index(np.asarray(ckpt_flat, np.int64), self.shape)
        ok = np.ones(np.shape(ckpt_flat), bool)
        loc = []
        for a in self.axes:
            d = coords[a.dst_dim] - a.dst_off
            j = d // a.dst_stride
            ok &= (d >= 0) & (d % a.dst_stride == 0) & (j < a.length)
            loc.append(np.where(ok, a.src_off + a.src_stride * j, 0))
        flat = np.ravel_multi_index([np.where(ok, x, 0) for x in loc], self.local_shape).astype(np.int64, copy=False)
        return np.where(ok, flat, -1)

    def restrict(self, box: Box) -> Piece | None:
        """The part of this piece whose checkpoint image lies in ``box`` (a piece), or None."""
        if box.shape != self.shape:
            raise UsageError(f"box of shape {box.shape} is not of tensor {self.name!r} {self.shape}")
        axes = []
        for a in self.axes:
            got = intersect_ap(AP(a.dst_off, a.dst_stride, a.length), box.aps[a.dst_dim])
            if got is None:
                return None
            j0 = (got.off - a.dst_off) // a.dst_stride
            step = got.stride // a.dst_stride
            axes.append(Axis(a.src_off + a.src_stride * j0, got.length, a.dst_dim, got.off, got.stride,
                             a.src_stride * step))
        return replace(self, axes=tuple(axes))


INDEX_BLOCK = 1 << 15  # elements per pass of value conversion in the publisher (bounds its temporaries)


def box_indices(box: Box, piece: Piece, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    """(checkpoint flat, local flat) int64 indices of box-order elements ``[a, b)`` of ``box``, which
    must lie in ``piece``. Both are sums of per-dimension terms, so they are built as outer sums of
    the rows the range touches: one add per element, memory O(b - a + last dimension)."""
    lens = box.lengths
    nd = len(lens)
    if b <= a:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    cstr = [math.prod(box.shape[d + 1:]) for d in range(nd)]
    lstr = [math.prod(piece.local_shape[d + 1:]) for d in range(nd)]
    axis_of = {ax.dst_dim: (i, ax) for i, ax in enumerate(piece.axes)}

    def terms(d: int, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ap = box.aps[d]
        i, ax = axis_of[d]
        c = ap.off + ap.stride * idx
        rel = c - ax.dst_off
        j = rel // ax.dst_stride
        if idx.size and (rel.min() < 0 or (rel % ax.dst_stride).any() or j.max() >= ax.length):
            raise UsageError(f"box {box.to_json()} is not inside the piece of {piece.name!r}")
        return c * cstr[d], (ax.src_off + ax.src_stride * j) * lstr[i]

    n_last = lens[-1]
    o0, o1 = a // n_last, (b - 1) // n_last
    outer = np.arange(o0, o1 + 1, dtype=np.int64)
    c_out = np.zeros(outer.size, np.int64)
    l_out = np.zeros(outer.size, np.int64)
    if nd > 1:
        for d, idx in enumerate(np.unravel_index(outer, lens[:-1])):
            ct, lt = terms(d, idx.astype(np.int64))
            c_out += ct
            l_out += lt
    i0 = a - o0 * n_last
    if o0 == o1:  # one row: only the needed part of it
        ct, lt = terms(nd - 1, np.arange(i0, i0 + (b - a), dtype=np.int64))
        return c_out[0] + ct, l_out[0] + lt
    ct, lt = terms(nd - 1, np.arange(n_last, dtype=np.int64))
    flat = (c_out[:, None] + ct[None, :]).reshape(-1)[i0:i0 + (b - a)]
    loc = (l_out[:, None] + lt[None, :]).reshape(-1)[i0:i0 + (b - a)]
    return flat, loc


def intersect_pieces(p: Piece, q: Piece) -> tuple[Box, np.ndarray, np.ndarray] | None:
    """Elements two pieces (of one checkpoint tensor, any local layouts) share: (box, p's local flat
    indices, q's local flat indices), both in box order; None when disjoint."""
    if p.name != q.name or p.shape != q.shape:
        raise UsageError(f"pieces of different tensors: {p.name!r}{p.shape} and {q.name!r}{q.shape}")
    box = intersect_boxes(p.box(), q.box())
    if box is None:
        return None
    flat = box.flat(np.arange(box.count, dtype=np.int64))
    return box, p.to_local(flat), q.to_local(flat)


def whole_piece(name: str, shape: Sequence[int], owner: bool = True) -> Piece:
    """A local tensor that is exactly checkpoint tensor ``name``."""
    shape = tuple(int(d) for d in shape)
    return Piece(name, shape, shape, tuple(Axis(0, n, d, 0) for d, n in enumerate(shape)), owner)


def transposed_piece(name: str, shape: Sequence[int], perm: Sequence[int]) -> Piece:
    """A local tensor holding checkpoint tensor ``name`` permuted: local dim d is checkpoint dim perm[d]."""
    shape = tuple(int(d) for d in shape)
    local = tuple(shape[p] for p in perm)
    return Piece(name, shape, local, tuple(Axis(0, local[d], perm[d], 0) for d in range(len(perm))))


def fused_pieces(parts: Sequence[tuple[str, Sequence[int]]], dim: int) -> list[Piece]:
    """Pieces of a parameter that concatenates checkpoint tensors ``parts`` along ``dim``."""
    shapes = [tuple(int(d) for d in s) for _, s in parts]
    for s in shapes[1:]:
        if len(s) != len(shapes[0]) or any(x != y for i, (x, y) in enumerate(zip(s, shapes[0], strict=True))
                                           if i != dim):
            raise UsageError(f"fused parts {[n for n, _ in parts]} differ outside dim {dim}: {shapes}")
    total = sum(s[dim] for s in shapes)
    local = list(shapes[0])
    local[dim] = total
    out, off = [], 0
    for (name, _), s in zip(parts, shapes, strict=True):
        axes = tuple(Axis(off if d == dim else 0, n, d, 0) for d, n in enumerate(s))
        out.append(Piece(name, s, tuple(local), axes))
        off += s[dim]
    return out


# ------------------------------------------------------------------------- shards and placements

def chunk_range(n: int, parts: int, i: int) -> tuple[int, int]:
    """``torch.chunk`` semantics (what DTensor ``Shard`` uses): chunks of ceil(n/parts), the last
    ones shorter or empty. Returns [lo, hi) of chunk ``i``."""
    size = -(-n // parts) if parts else 0
    lo = min(n, size * i)
    return lo, min(n, lo + size)


def _placement(p) -> tuple[str, int]:
    """("shard", dim) or ("replicate", -1) from a torch placement object or a plain spec.

    Plain specs: ``"R"``, ``"replicate"``, ``"S0"``/``"S(0)"``, ``("shard", 0)``, ``{"shard": 0}``.
    """
    if isinstance(p, str):
        s = p.strip().lower()
        if s in ("r", "replicate"):
            return "replicate", -1
        if s.startswith("s"):
            return "shard", int(s.strip("shard()"))
    elif isinstance(p, tuple) and len(p) == 2 and p[0] == "shard":
        return "shard", int(p[1])
    elif isinstance(p, dict) and set(p) == {"shard"}:
        return "shard", int(p["shard"])
    try:
        from torch.distributed.tensor import Replicate, Shard
    except ImportError:  # pragma: no cover
        Replicate = Shard = ()
    if Shard and type(p) is Shard:  # _StridedShard subclasses Shard and lays out differently
        return "shard", int(p.dim)
    if Replicate and isinstance(p, Replicate):
        return "replicate", -1
    raise UsageError(f"placement {p!r} is not supported (Shard(dim) and Replicate are; Partial must be "
                     "reduced and _StridedShard described with an explicit spec)")


def placement_box(global_shape: Sequence[int], mesh_shape: Sequence[int], coords: Sequence[int],
                  placements: Sequence) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
    """(offsets, local shape, owner) of a DTensor-style shard of a tensor of ``global_shape``.

    One placement per mesh dimension, applied in mesh-dimension order (``Shard(d)`` twice splits the
    already-split range again, as DTensor does). ``owner`` is True on the one rank with coordinate 0
    on every replicated mesh dimension.
    """
    if not (len(mesh_shape) == len(coords) == len(placements)):
        raise UsageError("mesh_shape, coords and placements must have one entry per mesh dimension")
    lo = [0] * len(global_shape)
    hi = [int(d) for d in global_shape]
    owner = True
    for m, c, p in zip(mesh_shape, coords, placements, strict=True):
        kind, d = _placement(p)
        if not 0 <= c < m:
            raise UsageError(f"mesh coordinate {c} outside mesh dimension of size {m}")
        if kind == "replicate":
            owner &= c == 0
            continue
        if not 0 <= d < len(global_shape):
            raise UsageError(f"Shard({d}) of a {len(global_shape)}-d tensor")
        a, b = chunk_range(hi[d] - lo[d], m, c)
        lo[d], hi[d] = lo[d] + a, lo[d] + b
    return tuple(lo), tuple(h - x for h, x in zip(hi, lo, strict=True)), owner


def shard_pieces(pieces: Sequence[Piece], offsets: Sequence[int], local_shape: Sequence[int],
                 owner: bool = True) -> list[Piece]:
    """Pieces of a local shard: the rows/columns ``[offsets, offsets + local_shape)`` of a parameter
    whose own (global) pieces are ``pieces``. Empty intersections are dropped."""
    local_shape = tuple(int(d) for d in local_shape)
    out = []
    for p in pieces:
        axes = []
        for d, a in enumerate(p.axes):
            lo, hi = offsets[d], offsets[d] + local_shape[d]
            # indices i with lo <= src_off + src_stride*i < hi
            i0 = max(0, -(-(lo - a.src_off) // a.src_stride))
            i1 = min(a.length, -(-(hi - a.src_off) // a.src_stride))
            if i1 <= i0:
                break
            axes.append(Axis(a.src_off + a.src_stride * i0 - lo, i1 - i0, a.dst_dim,
                             a.dst_off + a.dst_stride * i0, a.dst_stride, a.src_stride))
        else:
            out.append(Piece(p.name, p.shape, local_shape, tuple(axes), p.owner and owner))
    return out
