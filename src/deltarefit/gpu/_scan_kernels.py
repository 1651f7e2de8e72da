"""Triton kernels for the fused compare-and-compact scan and its inverse (imported only by ``gpu.scan``).

The codec's ulp encoding codes each changed element of a chunk (a 1 MiB segment) by its context (the
base's exponent field, ``(u >> man_bits) & (2^exp_bits - 1)``; one context for non-floats) and its
*rank*: the number of elements of the same context before it in the segment, changed or not
(FORMAT.md, "Encoding 1: ulp"; ``codec.kernels.ulp_scan`` on the host). Both directions stand on one
decomposition of a segment into tiles of ``TILE`` elements, each walked as sub-blocks of ``BLOCK``:

    rank(i) = prefix[tile(i), c] + run[c] + (index of i among its sub-block's elements of context c)

where ``run`` is the tile's histogram of the sub-blocks before i's (kept in registers across the
walk, read at each element's context with ``tl.gather``) and ``prefix`` the exclusive scan, over the
tiles of the segment, of the per-tile histograms. Inside a sub-block the index among same-context
elements is a ``[BLOCK, BLOCK]`` comparison (``BLOCK`` operations per element, so ``BLOCK`` is small
on a GPU: 32 to 128; no sort anywhere).

Kernels:

* ``scan_tile_kernel`` (encoder; one pass over base and target): per tile, compare the bit patterns,
  compute contexts, the tile's histogram, and each changed element's rank within the tile; write the
  tile's changes (in position order) into the tile's slots of a scratch area, its histogram and its
  change count. ``compact_kernel`` then adds ``prefix`` to each rank and moves every tile's changes
  to their place in the compact output (exclusive scan of the change counts): it reads only the
  scratch entries that hold changes.
* ``hist_kernel`` + ``perm_kernel`` (apply): the tiles' histograms of a base segment, then, with
  ``dest[tile, c] = start[c] + prefix[tile, c]`` (``start`` the exclusive scan of the segment's
  histogram), ``perm[dest + rank(i)] = i`` for every element: a stable counting sort of the segment
  by context, so the r-th element of context c is ``perm[start[c] + r]``.

Hazards:

* Only ``triton.language`` builtins and this module's own ``@triton.jit`` helpers are called (sums and
  prefix sums through ``tl.reduce`` / ``tl.associative_scan`` with Triton's ``_sum_combine``), never
  the ``@triton.jit`` functions of Triton's standard library (``tl.sum``, ``tl.zeros``, ...): those
  are decorated when Triton is first imported, which may have happened with ``TRITON_INTERPRET``
  unset, and then refuse to run inside an interpreted kernel.

* Contexts are computed on same-width integer views: signed for 2/4/8 bytes (an arithmetic shift,
  whose smeared sign bits the mask removes), unsigned for 1 byte. 8-byte elements are shifted as
  int64 before the cast to int32.
* Masked lanes (past the end of the buffer) take context ``NCTX`` for the histogram and the
  comparison (outside every bin, equal to no real element's context) and ``0`` for ``tl.gather``
  indices; their results are never stored.
* ``TILE`` divides the elements per segment (a power of two, at most 2^17 for 8-byte elements) and
  ``BLOCK`` divides ``TILE``; offsets in the batch are int64.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Triton's own combine function for sums: the interpreter runs reductions and scans with it as one numpy
# call (any other combine function, per element in Python), and never calls it.
_sum_combine = tl.standard._sum_combine


@triton.jit
def _sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _sum_combine)


@triton.jit
def _cumsum(x):
    return tl.associative_scan(x, 0, _sum_combine)


@triton.jit
def _contexts(b, SHIFT: tl.constexpr, MASK: tl.constexpr, WIDE: tl.constexpr):
    if WIDE:
        return ((b.to(tl.int64) >> SHIFT) & MASK).to(tl.int32)
    return (b.to(tl.int32) >> SHIFT) & MASK


@triton.jit
def _sub_block_ranks(ctx, valid, NCTX: tl.constexpr, BLOCK: tl.constexpr):
    """The sub-block's histogram and each element's index among the sub-block's elements of its
    context (a [BLOCK, BLOCK] comparison: BLOCK operations per element, so BLOCK stays small)."""
    lane = tl.arange(0, BLOCK)
    hist = tl.histogram(ctx, NCTX, mask=valid)
    before = (ctx[:, None] == ctx[None, :]) & (lane[None, :] < lane[:, None])
    return hist, _sum(before.to(tl.int32), 1)


@triton.jit
def scan_tile_kernel(base_ptr, target_ptr, n, pos_ptr, ctx_ptr, rank_ptr, bval_ptr, tval_ptr,
                     hist_ptr, count_ptr,
                     SHIFT: tl.constexpr, MASK: tl.constexpr, WIDE: tl.constexpr, NCTX: tl.constexpr,
                     TILE: tl.constexpr, BLOCK: tl.constexpr, TPS: tl.constexpr):
    """One program per tile of the batch (``n`` elements, segments of ``TPS`` tiles). Writes the tile's
    m changes to scratch slots ``tile * TILE + 0 .. m-1`` in position order: position within the
    segment, context, rank within the tile, base and target bits; then ``hist[tile, :]`` and
    ``count[tile] = m``."""
    t = tl.program_id(0)
    t0 = t.to(tl.int64) * TILE
    in_seg = (t % TPS).to(tl.int64) * TILE
    lane = tl.arange(0, BLOCK)
    run = tl.full([NCTX], 0, tl.int32)
    done = tl.full([], 0, tl.int32)
    n_sub = tl.minimum((n - t0 + BLOCK - 1) // BLOCK, TILE // BLOCK)
    for s in range(0, n_sub):
        off = t0 + s * BLOCK + lane
        valid = off < n
        b = tl.load(base_ptr + off, mask=valid, other=0)
        v = tl.load(target_ptr + off, mask=valid, other=0)
        changed = (b != v) & valid
        ctx = _contexts(b, SHIFT, MASK, WIDE)
        hist, sub_rank = _sub_block_ranks(tl.where(valid, ctx, NCTX), valid, NCTX, BLOCK)
        ctx = tl.where(valid, ctx, 0)
        ch = changed.to(tl.int32)
        dst = t0 + done + _cumsum(ch) - ch  # slot: the change's index among the tile's changes
        tl.store(pos_ptr + dst, (in_seg + s * BLOCK + lane).to(tl.int32), mask=changed)
        tl.store(ctx_ptr + dst, ctx, mask=changed)
        tl.store(rank_ptr + dst, tl.gather(run, ctx, 0) + sub_rank, mask=changed)
        tl.store(bval_ptr + dst, b, mask=changed)
        tl.store(tval_ptr + dst, v, mask=changed)
        run += hist
        done += _sum(ch, 0)
    tl.store(hist_ptr + t.to(tl.int64) * NCTX + tl.arange(0, NCTX), run)
    tl.store(count_ptr + t, done)


@triton.jit
def compact_kernel(pos_ptr, ctx_ptr, rank_ptr, bval_ptr, tval_ptr, count_ptr, start_ptr, prefix_ptr,
                   opos_ptr, octx_ptr, orank_ptr, obval_ptr, otval_ptr,
                   NCTX: tl.constexpr, TILE: tl.constexpr, BLOCK: tl.constexpr):
    """One program per tile: its ``count[tile]`` scratch entries, ranks completed with
    ``prefix[tile, ctx]`` (the segment's elements of that context in earlier tiles), moved to output
    entries ``start[tile] ..``."""
    t = tl.program_id(0)
    t0 = t.to(tl.int64) * TILE
    m = tl.load(count_ptr + t)
    o = tl.load(start_ptr + t)
    for j0 in range(0, m, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        ok = j < m
        c = tl.load(ctx_ptr + t0 + j, mask=ok, other=0)
        r = tl.load(rank_ptr + t0 + j, mask=ok, other=0) + \
            tl.load(prefix_ptr + t.to(tl.int64) * NCTX + c, mask=ok, other=0)
        tl.store(opos_ptr + o + j, tl.load(pos_ptr + t0 + j, mask=ok, other=0), mask=ok)
        tl.store(octx_ptr + o + j, c, mask=ok)
        tl.store(orank_ptr + o + j, r, mask=ok)
        tl.store(obval_ptr + o + j, tl.load(bval_ptr + t0 + j, mask=ok, other=0), mask=ok)
        tl.store(otval_ptr + o + j, tl.load(tval_ptr + t0 + j, mask=ok, other=0), mask=ok)


@triton.jit
def hist_kernel(base_ptr, n, hist_ptr, SHIFT: tl.constexpr, MASK: tl.constexpr, WIDE: tl.constexpr,
                NCTX: tl.constexpr, TILE: tl.constexpr, BLOCK: tl.constexpr):
    """``hist[tile, :]``: the context histogram of each tile of the ``n`` base elements."""
    t = tl.program_id(0)
    t0 = t.to(tl.int64) * TILE
    lane = tl.arange(0, BLOCK)
    run = tl.full([NCTX], 0, tl.int32)
    n_sub = tl.minimum((n - t0 + BLOCK - 1) // BLOCK, TILE // BLOCK)
    for s in range(0, n_sub):
        off = t0 + s * BLOCK + lane
        valid = off < n
        b = tl.load(base_ptr + off, mask=valid, other=0)
        run += tl.histogram(_contexts(b, SHIFT, MASK, WIDE), NCTX, mask=valid)
    tl.store(hist_ptr + t.to(tl.int64) * NCTX + tl.arange(0, NCTX), run)


@triton.jit
def perm_kernel(base_ptr, n, dest_ptr, perm_ptr, SHIFT: tl.constexpr, MASK: tl.constexpr,
                WIDE: tl.constexpr, NCTX: tl.constexpr, TILE: tl.constexpr, BLOCK: tl.constexpr):
    """``perm[dest[tile, c] + rank within the tile] = i`` for every element ``i`` of context ``c``."""
    t = tl.program_id(0)
    t0 = t.to(tl.int64) * TILE
    run = tl.full([NCTX], 0, tl.int32)
    lane = tl.arange(0, BLOCK)
    n_sub = tl.minimum((n - t0 + BLOCK - 1) // BLOCK, TILE // BLOCK)
    for s in range(0, n_sub):
        off = t0 + s * BLOCK + lane
        valid = off < n
        b = tl.load(base_ptr + off, mask=valid, other=0)
        ctx = _contexts(b, SHIFT, MASK, WIDE)
        hist, sub_rank = _sub_block_ranks(tl.where(valid, ctx, NCTX), valid, NCTX, BLOCK)
        ctx = tl.where(valid, ctx, 0)
        d = tl.load(dest_ptr + t.to(tl.int64) * NCTX + ctx, mask=valid, other=0)
        tl.store(perm_ptr + d + tl.gather(run, ctx, 0) + sub_rank, off.to(tl.int32), mask=valid)
        run += hist
