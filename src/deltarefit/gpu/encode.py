"""Encode from torch tensors where they live: the device compares and compacts, the host entropy-codes.

``encode_tensors(base, target, out)`` writes the same delta, byte for byte, as ``deltarefit.encode`` of
the two state dicts saved as safetensors files. Per tensor, in batches of segments, the device:

1. compares the bit patterns of base and target (``!=`` on same-width integer views),
2. computes every element's context (the base's exponent field) and, by one stable sort of
   (segment, context) keys, each changed element's rank among its segment's elements of that context,
3. gathers the changed positions, contexts, ranks, and base and target bits, and
4. hashes every segment of both tensors (BLAKE3 segment hashes: Triton on CUDA, the host's BLAKE3 on CPU).

Only that compact stream (about 14 bytes per changed element) and 32 bytes of hashes per MiB cross to
the host, where ``codec.chunk.encode_changes`` codes each segment on the encoder's thread pool, while
the device goes on to the next tensor. A segment changed so densely that a whole-segment encoding may
win (8% of its elements) is copied to the host whole, as the CPU encoder would read it.

The same code runs on CPU tensors (torch's CPU kernels), which is how CI checks it without a GPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from ..codec.chunk import Changes, _ctx, encode_changes
from ..dtypes import dtype
from ..encode import EncodeReport, Work, encode_checkpoints
from ..errors import UsageError
from ..integrity import SEGMENT_BYTES, seg_hash
from ..torch_api import safetensors_dtype

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


def scan_segments(base: torch.Tensor, target: torch.Tensor, dt_name: str, first: int, count: int) -> list[Changes]:
    """Compact changes of segments ``first .. first+count-1`` of two same-shape tensors (any device)."""
    dt = dtype(dt_name)
    per = SEGMENT_BYTES // dt.itemsize
    b, t = _ints(base), _ints(target)
    lo, hi = first * per, min(b.numel(), (first + count) * per)
    bb, tt = b[lo:hi], t[lo:hi]
    changed = torch.nonzero(bb != tt).reshape(-1)  # ascending flat positions in the batch
    shift, mask, nctx = _ctx(dt)
    seg = changed // per
    if nctx == 1:
        ectx = torch.zeros_like(changed, dtype=torch.int32)
        rank = (changed - seg * per).to(torch.int32)
    else:
        wide = bb.to(torch.int64) if dt.itemsize < 8 else bb
        key = (torch.arange(hi - lo, device=bb.device) // per) * nctx + ((wide >> shift) & mask)
        order = torch.sort(key, stable=True).indices
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=bb.device)
        counts = torch.bincount(key, minlength=count * nctx)
        starts = torch.cumsum(counts, 0) - counts
        kc = key[changed]
        rank = (inv[changed] - starts[kc]).to(torch.int32)
        ectx = (kc % nctx).to(torch.int32)
    pos = (changed - seg * per).to(torch.int32)
    uint = dt.uint
    host = [x.cpu().numpy() for x in (seg, pos, ectx, rank, bb[changed], tt[changed])]
    seg_h, pos_h, ectx_h, rank_h = host[:4]
    bv, tv = host[4].view(uint), host[5].view(uint)
    cuts = np.searchsorted(seg_h, np.arange(count + 1))
    out = []
    for k in range(count):
        a, z = cuts[k], cuts[k + 1]
        n = min(per, b.numel() - (first + k) * per)
        out.append(Changes(int(n), pos_h[a:z], ectx_h[a:z], rank_h[a:z], bv[a:z], tv[a:z]))
    return out


def _dense(base: torch.Tensor, target: torch.Tensor, dt_name: str, k: int):
    dt = dtype(dt_name)
    per = SEGMENT_BYTES // dt.itemsize

    def load() -> tuple[np.ndarray, np.ndarray]:
        sl = slice(k * per, (k + 1) * per)
        return (_ints(base)[sl].cpu().numpy().view(dt.uint), _ints(target)[sl].cpu().numpy().view(dt.uint))

    return load


def _patch_works(bset: _TensorSet, tset: _TensorSet, batch_segments: int, impl: str):
    def works(name: str, bi: _Info, ti: _Info) -> list[Work]:
        b, t = bset.torch[name], tset.torch[name]
        if b.device != t.device:
            raise UsageError(f"tensor {name!r}: base on {b.device}, target on {t.device}")
        n_seg = (bi.nbytes + SEGMENT_BYTES - 1) // SEGMENT_BYTES
        if n_seg == 0:
            return []
        pre, post = _seg_hashes(b, impl), _seg_hashes(t, impl)
        changes: list[Changes] = []
        for first in range(0, n_seg, batch_segments):
            changes += scan_segments(b, t, bi.dtype, first, min(batch_segments, n_seg - first))
        dt = dtype(bi.dtype)

        def work(k: int) -> Work:
            def run():
                return pre[k], post[k], encode_changes(dt, changes[k], _dense(b, t, bi.dtype, k))

            return run

        return [work(k) for k in range(n_seg)]

    return works


def encode_tensors(base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], out: str, *,
                   threads: int | None = None, batch_segments: int = 64, impl: str = "auto") -> EncodeReport:
    """Write the delta from state dict ``base`` to ``target`` (tensors on CPU or CUDA) to ``out``: the
    same bytes as ``deltarefit.encode`` of the two saved as safetensors. ``batch_segments`` bounds the
    device's scratch memory (about 40 bytes per element of a batch for the sort)."""
    bset, tset = _TensorSet(base), _TensorSet(target)
    with torch.no_grad():
        return encode_checkpoints(bset, tset, out, threads=threads,  # type: ignore[arg-type]
                                  patch_works=_patch_works(bset, tset, batch_segments, impl))
