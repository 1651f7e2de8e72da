"""Encode from torch tensors where they live: the device compares and compacts, the host entropy-codes.

``encode_tensors(base, target, out)`` writes the same delta, byte for byte, as ``deltarefit.encode`` of
the two state dicts saved as safetensors files. Per tensor, in batches of segments, the device:

1. compares the bit patterns of base and target (``!=`` on same-width integer views),
2. computes every element's context (the base's exponent field) and each changed element's rank among
   its segment's elements of that context: the fused Triton scan of ``gpu.scan`` (per-tile context
   histograms, an exclusive scan over the tiles of each segment, a compaction), or, where Triton
   cannot run (CPU tensors outside its interpreter), one stable sort of (segment, context) keys,
3. gathers the changed positions, contexts, ranks, and base and target bits, and
4. hashes every segment of both tensors (BLAKE3 segment hashes: Triton on CUDA, the host's BLAKE3 on CPU).

Only that compact stream (about 14 bytes per changed element) and 32 bytes of hashes per MiB cross to
the host, where ``codec.chunk.encode_changes`` codes each segment on the encoder's thread pool, while
the device goes on to the next tensor. In format 2 (the default), where the Triton kernels run, the
device also codes each segment's ``ulp2`` candidate itself (``gpu.ulp2.encode_chunks``: counts, then
the rANS lanes backwards; only the payloads cross), and the host only weighs it against the
whole-segment and sparse candidates (``codec.chunk._choose``), so the bytes stay the host encoder's. A segment changed so densely that a whole-segment encoding may
win (8% of its elements) is copied to the host whole, as the CPU encoder would read it.

The same code runs on CPU tensors: through the sort fallback with torch's CPU kernels, or through the
Triton kernels under Triton's interpreter (``TRITON_INTERPRET=1``), which is how CI checks both
without a GPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from ..apply.tensors import safetensors_dtype
from ..codec.chunk import ULP1_MAX_CHANGES, Changes, EncodedChunk, _choose, _ctx, encode_changes
from ..codec.ulp2 import encode_ulp2
from ..dtypes import dtype
from ..encode import EncodeReport, Work, encode_checkpoints
from ..errors import UsageError
from ..format.layout import VERSION, check_version
from ..integrity import SEGMENT_BYTES, seg_hash
from . import scan as device_scan
from . import ulp2 as device_ulp2

# Signed views of each width: torch compares and shifts these; numpy reinterprets them as unsigned.
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class _Info:
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


class _TensorSet:
    """The ``Checkpoint`` surface ``encode_checkpoints`` needs, over a dict of tensors on any device.
    ``raw`` copies a device tensor to the host; the encoder uses it only for added, removed or
    re-typed tensors."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.torch: dict[str, torch.Tensor] = {}
        self.tensors: dict[str, _Info] = {}
        for name, t0 in tensors.items():
            if not isinstance(t0, torch.Tensor) or t0.layout != torch.strided:
                raise UsageError(f"tensor {name!r}: expected a dense torch.Tensor")
            t = t0.detach()
            if t.is_conj() or t.is_neg():
                t = t.resolve_conj().resolve_neg()
            t = t.contiguous()
            self.torch[name] = t
            self.tensors[name] = _Info(safetensors_dtype(t.dtype), tuple(int(d) for d in t.shape),
                                       t.numel() * t.element_size())

    def raw(self, name: str) -> np.ndarray:
        t = self.torch[name]
        if t.numel() == 0:
            return np.zeros(0, np.uint8)
        return t.reshape(-1).view(torch.uint8).cpu().numpy()


def _ints(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as signed integers of the same width (a view, no copy)."""
    return t.reshape(-1).view(_INT_OF_WIDTH[t.element_size()])


def _seg_hashes(t: torch.Tensor, impl: str) -> list[bytes]:
    """Segment hashes of a tensor's bytes, computed where it lives."""
    raw = t.reshape(-1).view(torch.uint8)
    if raw.device.type == "cpu":
        a = raw.numpy()
        return [seg_hash(a[o:o + SEGMENT_BYTES]) for o in range(0, a.size, SEGMENT_BYTES)]
    from .blake3_triton import segment_hashes

    return [bytes(r) for r in segment_hashes(raw, impl=impl).cpu().numpy()]


_SCANS = ("auto", "triton", "torch")


def _scan_mode(mode: str, device: torch.device) -> str:
    """"triton" (the fused kernels, ``gpu.scan``) or "torch" (a stable sort, where they cannot run)."""
    if mode == "auto":
        return "triton" if device_scan.available(device) else "torch"
    if mode == "triton":
        if not device_scan.available(device):
            raise UsageError(f"scan='triton': {device_scan.unavailable_reason(device)}")
        return mode
    if mode == "torch":
        return mode
    raise UsageError(f"scan must be one of {', '.join(_SCANS)}, got {mode!r}")


def scan_segments(base: torch.Tensor, target: torch.Tensor, dt_name: str, first: int, count: int, *,
                  scan: str = "auto") -> list[Changes]:
    """Compact changes of segments ``first .. first+count-1`` of two same-shape tensors (any device).
    ``scan``: "triton" (the fused kernels), "torch" (the sort fallback), or "auto" (Triton where it runs)."""
    dt = dtype(dt_name)
    per = SEGMENT_BYTES // dt.itemsize
    b, t = _ints(base), _ints(target)
    lo, hi = first * per, min(b.numel(), (first + count) * per)
    bb, tt = b[lo:hi], t[lo:hi]
    if _scan_mode(scan, bb.device) == "triton":
        *dev, per_seg = device_scan.scan_batch(bb, tt, dt, count)
        cuts = np.concatenate([[0], np.cumsum(per_seg)])
    else:
        dev, seg_h = _sort_scan(bb, tt, dt, per, count)
        cuts = np.searchsorted(seg_h, np.arange(count + 1))
    pos_h, ectx_h, rank_h, bv, tv = (x.cpu().numpy() for x in dev)
    bv, tv = bv.view(dt.uint), tv.view(dt.uint)
    out = []
    for k in range(count):
        a, z = cuts[k], cuts[k + 1]
        n = min(per, b.numel() - (first + k) * per)
        out.append(Changes(int(n), pos_h[a:z], ectx_h[a:z], rank_h[a:z], bv[a:z], tv[a:z]))
    return out


def _sort_scan(bb: torch.Tensor, tt: torch.Tensor, dt, per: int, count: int):
    """The torch fallback of ``gpu.scan.scan_batch``: ranks from one stable sort of (segment, context)
    keys (about 40 bytes of scratch per element). Returns the five arrays and each change's segment."""
    changed = torch.nonzero(bb != tt).reshape(-1)  # ascending flat positions in the batch
    shift, mask, nctx = _ctx(dt)
    seg = changed // per
    if nctx == 1:
        ectx = torch.zeros_like(changed, dtype=torch.int32)
        rank = (changed - seg * per).to(torch.int32)
    else:
        wide = bb.to(torch.int64) if dt.itemsize < 8 else bb
        key = (torch.arange(bb.numel(), device=bb.device) // per) * nctx + ((wide >> shift) & mask)
        order = torch.sort(key, stable=True).indices
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=bb.device)
        counts = torch.bincount(key, minlength=count * nctx)
        starts = torch.cumsum(counts, 0) - counts
        kc = key[changed]
        rank = (inv[changed] - starts[kc]).to(torch.int32)
        ectx = (kc % nctx).to(torch.int32)
    pos = (changed - seg * per).to(torch.int32)
    return (pos, ectx, rank, bb[changed], tt[changed]), seg.cpu().numpy()


def _dense(base: torch.Tensor, target: torch.Tensor, dt_name: str, k: int):
    dt = dtype(dt_name)
    per = SEGMENT_BYTES // dt.itemsize

    def load() -> tuple[np.ndarray, np.ndarray]:
        sl = slice(k * per, (k + 1) * per)
        return (_ints(base)[sl].cpu().numpy().view(dt.uint), _ints(target)[sl].cpu().numpy().view(dt.uint))

    return load


def _format2(dt, ch: Changes, dense, ulp2: EncodedChunk | None) -> EncodedChunk | None:
    """The host encoder's format 2 choice for a chunk without history (``codec.chunk._encode2``) given
    its ulp2 coding: the smallest of it and the whole-chunk and sparse candidates (``_choose``), and for
    a chunk of few changes (``ULP1_MAX_CHANGES``) format 1's ulp coding too (ties: the first)."""
    got = _choose(dt, ch, dense, ulp2)
    if got is not None and ch.m <= ULP1_MAX_CHANGES:
        alt = encode_changes(dt, ch, dense, fmt=1)
        if alt is not None and len(alt.payload) < len(got.payload):
            got = alt
    return got


def _device_ulp2(dt, device: torch.device, scan: str, fmt: int) -> bool:
    """Whether format 2's ulp2 candidates are coded on the device (``gpu.ulp2``): where the scan runs
    its Triton kernels and the dtype is at most 32 bits wide."""
    return fmt == 2 and _scan_mode(scan, device) == "triton" and device_ulp2.supported(dt) \
        and device_ulp2.available(device)


def _patch_works(bset: _TensorSet, tset: _TensorSet, batch_segments: int, impl: str, scan: str, fmt: int):
    def works(name: str, bi: _Info, ti: _Info) -> list[Work]:
        b, t = bset.torch[name], tset.torch[name]
        if b.device != t.device:
            raise UsageError(f"tensor {name!r}: base on {b.device}, target on {t.device}")
        n_seg = (bi.nbytes + SEGMENT_BYTES - 1) // SEGMENT_BYTES
        if n_seg == 0:
            return []
        pre, post = _seg_hashes(b, impl), _seg_hashes(t, impl)
        dt = dtype(bi.dtype)
        on_device = _device_ulp2(dt, b.device, scan, fmt)
        per = SEGMENT_BYTES // dt.itemsize
        changes: list[Changes] = []
        ulp2: list[EncodedChunk | None] = []
        for first in range(0, n_seg, batch_segments):
            count = min(batch_segments, n_seg - first)
            changes += scan_segments(b, t, bi.dtype, first, count, scan=scan)
            if on_device:
                lo, hi = first * per, min(b.numel(), (first + count) * per)
                ulp2 += device_ulp2.encode_chunks(dt, _ints(b)[lo:hi], _ints(t)[lo:hi], per)

        def work(k: int) -> Work:
            def run():
                dense = _dense(b, t, bi.dtype, k)
                if fmt == 1 or changes[k].m == 0:
                    return pre[k], post[k], encode_changes(dt, changes[k], dense, fmt=fmt)
                if on_device:  # the host only weighs the other candidates against the device's coding
                    return pre[k], post[k], _format2(dt, changes[k], dense, ulp2[k])
                bh, th = dense()
                return pre[k], post[k], _format2(dt, changes[k], lambda: (bh, th), encode_ulp2(dt, bh, th))

            return run

        return [work(k) for k in range(n_seg)]

    return works


def encode_tensors(base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], out: str, *,
                   threads: int | None = None, batch_segments: int = 64, impl: str = "auto",
                   scan: str = "auto", format_version: int = VERSION) -> EncodeReport:
    """Write the delta from state dict ``base`` to ``target`` (tensors on CPU or CUDA) to ``out``: the
    same bytes as ``deltarefit.encode`` of the two saved as safetensors. ``batch_segments`` bounds the
    device's scratch memory (``12 + 2 * itemsize`` bytes per element of a batch for the fused scan,
    about 40 for the sort). ``scan`` picks the compare-and-compact step: "triton" (the fused kernels of
    ``gpu.scan``), "torch" (a stable sort), or "auto" (Triton wherever it can run: CUDA, or CPU tensors
    under ``TRITON_INTERPRET=1``); ``impl`` the CUDA segment hash ("auto", "triton", "torch").
    ``format_version``: 2 (default) or 1, as ``deltarefit.encode``'s; in format 2, where the Triton
    kernels run, the ulp2 coding itself is done on the device too (``gpu.ulp2``)."""
    if scan not in _SCANS:  # refused before anything is written
        raise UsageError(f"scan must be one of {', '.join(_SCANS)}, got {scan!r}")
    fmt = check_version(format_version, "format_version")
    bset, tset = _TensorSet(base), _TensorSet(target)
    with torch.no_grad():
        return encode_checkpoints(bset, tset, out, threads=threads,  # type: ignore[arg-type]
                                  patch_works=_patch_works(bset, tset, batch_segments, impl, scan, fmt),
                                  format_version=fmt)
