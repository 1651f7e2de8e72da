"""The fused compare-and-compact scan (encoder) and rank-to-position map (apply) on the device.

Contracts (``dt`` a ``dtypes.DType``; tensors are 1-D same-width integer views, ``gpu.encode._ints``):

* ``scan_batch(bb, tt, dt, count)``: ``bb``/``tt`` are the elements of ``count`` consecutive segments
  (the last may be short) of a base and a target. Returns ``(pos, ectx, rank, bvals, tvals, per_seg)``
  on the device: every changed element in position order, with its position in its segment, its
  context, its rank (``codec.kernels.ulp_scan``'s: the segment's elements of the same context before
  it), and the base and target bits; ``per_seg`` (host numpy) counts each segment's changes. The same
  arrays ``codec.kernels.ulp_scan`` fills on the host, so ``codec.chunk.encode_changes`` codes them
  into the host encoder's bytes.
* ``context_perm(seg, dt)``: for one segment's base elements, ``(perm, start, count)`` with
  ``perm[start[c] + r]`` the position of the r-th element of context ``c`` (``count[c]`` of them): a
  stable counting sort by context, which the apply uses to map decoded (context, rank) pairs back
  to positions.

Both run Triton kernels (``_scan_kernels``; its docstring has the algorithm): compiled on CUDA, or
through Triton's interpreter on CPU tensors when ``TRITON_INTERPRET=1`` is set (then keep it set
while they run). ``available(device)`` says whether they can run on a device; ``gpu.encode`` and
``gpu.apply`` fall back to torch ops (a stable sort) where they cannot (CPU tensors without the
interpreter, or no Triton).

Device memory per ``scan_batch``: a scratch area of ``12 + 2 * itemsize`` bytes per element of the
batch (written only where elements changed), ``4 * NCTX`` bytes per tile for the histograms, and
the compact output. The host syncs once per batch (to size the output).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from ..codec.chunk import _ctx
from ..dtypes import DType
from ..integrity import SEGMENT_BYTES

_STATE: dict = {"kernels": None, "error": None}  # the kernels module once imported, or why it is not


def _kernels():
    """The kernels module, imported on first use (Triton decides then whether it is interpreted)."""
    if _STATE["kernels"] is None and _STATE["error"] is None:
        try:
            from . import _scan_kernels
        except ImportError as e:  # triton absent or broken: the torch fallbacks still work
            _STATE["error"] = f"{type(e).__name__}: {e}"
        else:
            _STATE["kernels"] = _scan_kernels
    return _STATE["kernels"]


def _interpreted(k) -> bool:
    return type(k.scan_tile_kernel).__name__ == "InterpretedFunction"


def interpreted() -> bool:
    """Whether the kernels run through Triton's interpreter (numpy on the host) in this process: the
    module was imported with ``TRITON_INTERPRET=1``, which is still set. Never imports it otherwise."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    k = _kernels()
    return k is not None and _interpreted(k)


def available(device: torch.device) -> bool:
    """Whether the Triton kernels can run on tensors of ``device``: compiled on CUDA, interpreted on CPU."""
    if device.type == "cuda":
        k = _kernels()
        return k is not None and not _interpreted(k)
    return device.type == "cpu" and interpreted()


def unavailable_reason(device: torch.device) -> str:
    if _kernels() is None:
        return f"triton is not importable ({_STATE['error']})"
    if device.type == "cuda":
        return "the kernels were imported under TRITON_INTERPRET=1 and cannot run compiled on CUDA"
    return f"{device} tensors need Triton's interpreter (TRITON_INTERPRET=1 before the first import)"


@dataclass(frozen=True)
class ScanConfig:
    """Launch shape: ``block`` elements per sub-block (compared pairwise: ``block`` operations per
    element), ``tile`` elements per program (one ``NCTX``-bin histogram per tile), ``num_warps``.
    Powers of two, ``block <= tile <= 2^17``. The CUDA default is a guess not yet measured on a GPU
    (``scripts/gpu_encode_check.py --sweep`` times others)."""

    block: int = 64
    tile: int = 16384
    num_warps: int = 4

    def __post_init__(self) -> None:
        for v in (self.block, self.tile):
            if v <= 0 or v & (v - 1):
                raise ValueError(f"block and tile must be powers of two, got {self}")
        if not self.block <= self.tile <= 1 << 17:
            raise ValueError(f"need block <= tile <= 2^17, got {self}")


# The interpreter's cost is mostly per operation, not per element: big sub-blocks, few programs.
INTERPRETER_CONFIG = ScanConfig(block=1024, tile=1 << 17)


def _config(dt: DType, config: ScanConfig | None) -> ScanConfig:
    cfg = config or (INTERPRETER_CONFIG if _STATE["kernels"] is not None and _interpreted(_STATE["kernels"]) else ScanConfig())
    per = SEGMENT_BYTES // dt.itemsize
    tile = min(cfg.tile, per)
    return ScanConfig(min(cfg.block, tile), tile, cfg.num_warps)


def _ctx_args(dt: DType) -> dict:
    shift, mask, nctx = _ctx(dt)
    # Two bins at least: a one-bin histogram is a corner the kernels need not exercise (bin 1 stays 0).
    return {"SHIFT": shift, "MASK": mask, "WIDE": dt.itemsize == 8, "NCTX": max(nctx, 2)}


def _require(device: torch.device) -> None:
    if not available(device):
        raise RuntimeError(f"the scan kernels cannot run here: {unavailable_reason(device)}")


def scan_batch(bb: torch.Tensor, tt: torch.Tensor, dt: DType, count: int, *,
               config: ScanConfig | None = None):
    """The changes of ``count`` segments (see the module docstring)."""
    _require(bb.device)
    k = _kernels()
    cfg = _config(dt, config)
    per = SEGMENT_BYTES // dt.itemsize
    n = bb.numel()
    tps = per // cfg.tile
    ca = _ctx_args(dt)
    nb = ca["NCTX"]
    dev = bb.device
    grid = (n + cfg.tile - 1) // cfg.tile
    i32 = torch.int32
    s_pos, s_ctx, s_rank = (torch.empty(grid * cfg.tile, dtype=i32, device=dev) for _ in range(3))
    s_b, s_t = torch.empty(grid * cfg.tile, dtype=bb.dtype, device=dev), torch.empty(grid * cfg.tile, dtype=bb.dtype,
                                                                                      device=dev)
    hist = torch.zeros(count * tps, nb, dtype=i32, device=dev)
    cnt = torch.zeros(count * tps, dtype=i32, device=dev)
    if grid:
        k.scan_tile_kernel[(grid,)](bb, tt, n, s_pos, s_ctx, s_rank, s_b, s_t, hist, cnt, TILE=cfg.tile,
                                    BLOCK=cfg.block, TPS=tps, num_warps=cfg.num_warps, **ca)
    # The exclusive scans: of the tiles' histograms over the tiles of each segment, and of the tiles'
    # change counts over the batch (where each tile's changes go in the output).
    h3 = hist.view(count, tps, nb)
    prefix = (torch.cumsum(h3, 1, dtype=i32) - h3).reshape(count * tps, nb).contiguous()
    ends = torch.cumsum(cnt, 0, dtype=torch.int64)
    starts = ends - cnt
    m = int(ends[-1]) if ends.numel() else 0
    out = [torch.empty(m, dtype=i32, device=dev) for _ in range(3)] + \
        [torch.empty(m, dtype=bb.dtype, device=dev) for _ in range(2)]
    if m:
        k.compact_kernel[(grid,)](s_pos, s_ctx, s_rank, s_b, s_t, cnt, starts, prefix, *out, NCTX=nb,
                                  TILE=cfg.tile, BLOCK=cfg.block, num_warps=cfg.num_warps)
    per_seg = cnt.view(count, tps).sum(1).cpu().numpy().astype(np.int64)
    return (*out, per_seg)


def context_perm(seg: torch.Tensor, dt: DType, *, config: ScanConfig | None = None):
    """``(perm, start, count)`` of one segment's base elements (see the module docstring); ``start``
    and ``count`` are int64 tensors of the dtype's contexts (one for non-floats)."""
    _require(seg.device)
    k = _kernels()
    cfg = _config(dt, config)
    n = seg.numel()
    ca = _ctx_args(dt)
    nb = ca["NCTX"]
    nctx = _ctx(dt)[2]
    dev = seg.device
    grid = (n + cfg.tile - 1) // cfg.tile
    hist = torch.zeros(max(grid, 1), nb, dtype=torch.int32, device=dev)
    perm = torch.empty(n, dtype=torch.int32, device=dev)
    if grid:
        k.hist_kernel[(grid,)](seg, n, hist, TILE=cfg.tile, BLOCK=cfg.block, num_warps=cfg.num_warps, **ca)
    counts = hist.sum(0, dtype=torch.int64)
    start = torch.cumsum(counts, 0) - counts
    dest = (start[None, :] + torch.cumsum(hist, 0, dtype=torch.int64) - hist).to(torch.int32).contiguous()
    if grid:
        k.perm_kernel[(grid,)](seg, n, dest, perm, TILE=cfg.tile, BLOCK=cfg.block,
                               num_warps=cfg.num_warps, **ca)
    return perm, start[:nctx], counts[:nctx]
