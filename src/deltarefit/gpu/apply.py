"""Apply a delta in place to torch tensors where they live (CUDA, or CPU through the same code).

``apply_to_device_tensors(delta, tensors)`` follows the core's apply protocol, with the device doing
the work that touches whole segments and the host only what is compact:

* **plan** (nothing written): every segment of every patched tensor is hashed on the device; a chunk
  whose segment hashes to its post-image is done (a rerun), one at its pre-image is to do, anything
  else is refused (``BaseMismatchError`` naming the tensor). The base digest is checked from those
  hashes. Each chunk to do is decoded and its post-image hashed on the device, so a delta that
  decodes to anything but its recorded target is refused before any write;
* **write**: the decoded (positions, values) are scattered into the tensor, and the segment is hashed
  again on the device and checked against its post-image;
* **verify**: the tensor digests, then the fingerprint, must be the delta's target.

Decoding the ulp encoding in compact form: the host decodes the group section (each change's context
and rank; no base needed); the device maps (context, rank) to positions with one stable sort of the
segment's contexts and sends back the positions (4 bytes per change) and the base bits there; the host
decodes the signed ulp distances in position order and computes the target bits; those go up to the
device (positions and values only). Chunks of the other encodings (rare: dense or non-float changes)
are decoded on the host from a copy of their segment.

Memory is O(one segment) beyond the tensors, plus the compact patches of the chunks to do (about
10-16 bytes per changed element). In-memory tensors need no journal: a process killed mid-apply loses
the tensors with it; a rerun on tensors half-applied by an exception completes them.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from ..apply import ApplyReport
from ..codec import kernels as K
from ..codec.chunk import ULP, _ctx, _kind, decode_chunk
from ..dtypes import dtype
from ..errors import BaseMismatchError, DecodeError, UsageError, VerificationError
from ..format import ChunkRecord, DeltaReader, TensorEntry
from ..integrity import SEGMENT_BYTES, fingerprint_from_digests, tensor_digest_from_segments
from ..torch_api import safetensors_dtype
from .encode import _ints, _seg_hashes


@dataclass
class _Todo:
    rec: ChunkRecord
    pos: torch.Tensor  # int64 element indices within the segment, on the tensor's device
    val: torch.Tensor  # target bits there (signed integer view of the dtype's width)


def _to_device_ints(vals: np.ndarray, itemsize: int, dev: torch.device) -> torch.Tensor:
    """Unsigned target bits as the signed (1 byte: unsigned) integer view ``_ints`` gives a tensor."""
    view = np.uint8 if itemsize == 1 else np.dtype(f"<i{itemsize}")
    return torch.from_numpy(np.ascontiguousarray(vals).view(view).copy()).to(dev)


def _where(e: TensorEntry, r: ChunkRecord | None = None) -> str:
    return f"tensor {e.name!r}" + (f" chunk {r.chunk_index}" if r is not None else "")


def _hash1(seg: torch.Tensor, impl: str) -> bytes:
    return _seg_hashes(seg, impl)[0] if seg.numel() else b""


def _decode_ulp(seg: torch.Tensor, dt, payload: bytes, m: int, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, target bits) of one ulp chunk, decoded with the device holding the segment."""
    n = seg.numel()
    shift, mask, nctx = _ctx(dt)
    buf = np.frombuffer(payload, np.uint8)
    gbeg, gend = np.zeros(nctx, np.int64), np.zeros(nctx, np.int64)
    granks, gctx = np.empty(max(m, 1), np.int64), np.empty(max(m, 1), np.int32)
    st, state = K.ulp_decode_groups(buf, m, n, nctx, gbeg, gend, granks, gctx)
    if st:
        raise DecodeError(f"{where}: {K.STATUS.get(st, f'status {st}')}")
    dev = seg.device
    # Device: the r-th element of context c is order[start[c] + r] (a stable sort keeps positions ascending).
    e = ((seg.to(torch.int64) if dt.itemsize < 8 else seg) >> shift) & mask if nctx > 1 else \
        torch.zeros(n, dtype=torch.int64, device=dev)
    order = torch.sort(e, stable=True).indices
    counts = torch.bincount(e, minlength=nctx)
    starts = torch.cumsum(counts, 0) - counts
    ctx_d = torch.from_numpy(gctx[:m].astype(np.int64)).to(dev)
    rank_d = torch.from_numpy(granks[:m]).to(dev)
    if bool((rank_d >= counts[ctx_d]).any()):
        raise DecodeError(f"{where}: {K.STATUS[-3]}")
    pos_group = order[starts[ctx_d] + rank_d]
    pos_h = pos_group.cpu().numpy()
    perm = np.argsort(pos_h, kind="stable")
    pos_sorted, ectx = pos_h[perm], gctx[:m][perm]
    neg, mag = np.empty(m, np.uint8), np.empty(m, np.uint64)
    st = K.ulp_decode_deltas(buf, state, ectx, dt.bits, nctx, neg, mag)
    if st:
        raise DecodeError(f"{where}: {K.STATUS.get(st, f'status {st}')}")
    pos_d = torch.from_numpy(pos_sorted).to(dev)
    base_at = seg[pos_d].cpu().numpy().view(dt.uint)
    val = np.empty(m, dt.uint)
    K.ulp_apply_deltas(base_at, np.arange(m, dtype=np.int64), neg, mag, dt.bits, _kind(dt), val)
    return pos_d, _to_device_ints(val, dt.itemsize, dev)


def _decode(d: DeltaReader, e: TensorEntry, r: ChunkRecord, seg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dt = dtype(e.base.dtype)
    where = f"{d.path}: {_where(e, r)}"
    payload = d.read_payload(r, _where(e, r))
    if r.encoding == ULP:
        return _decode_ulp(seg, dt, payload, r.n_changed, where)
    host = seg.cpu().numpy().view(dt.uint)  # rare encodings: decoded on the host from a copy
    patch = decode_chunk(dt, host, r.encoding, payload, r.n_changed, r.decoded_len, where)
    if patch.dense is not None:
        pos = np.flatnonzero(patch.dense != host)
        val = patch.dense[pos]
    else:
        pos, val = patch.positions, patch.values
    return torch.from_numpy(pos.astype(np.int64)).to(seg.device), _to_device_ints(val, dt.itemsize, seg.device)


def _check_targets(d: DeltaReader, tensors: Mapping[str, torch.Tensor]) -> None:
    known = {e.name for e in d.tensors}
    extra = sorted(n for n in tensors if n not in known)
    if extra:
        raise BaseMismatchError(f"tensor {extra[0]!r} is not in the delta's base (wrong base?)")
    for e in d.tensors:
        if e.op not in ("same", "patch"):
            raise UsageError(f"{d.path}: tensor {e.name!r} is {e.op}d by this delta, which cannot be done in "
                             "place in device tensors; apply it to a checkpoint and reload")
        t = tensors.get(e.name)
        if t is None:
            raise BaseMismatchError(f"{_where(e)}: missing (wrong base?)")
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or not t.is_contiguous():
            raise UsageError(f"{_where(e)}: expected a contiguous dense torch.Tensor")
        got = (safetensors_dtype(t.dtype), tuple(int(x) for x in t.shape))
        if got != (e.base.dtype, tuple(e.base.shape)):
            raise BaseMismatchError(f"{_where(e)}: expected {e.base.dtype}{list(e.base.shape)}, found "
                                    f"{got[0]}{list(got[1])} (wrong base?)")


def apply_to_device_tensors(delta_path: str, tensors: dict[str, torch.Tensor], *,
                            impl: str = "auto") -> ApplyReport:
    """Apply the delta in place into ``tensors`` (CUDA or CPU, contiguous; the delta's base, or partly
    applied by an interrupted call). Refuses, before any write, wrong bases and deltas that do not
    decode to their target; ends with the target fingerprint verified. ``impl`` picks the segment
    hash kernel on CUDA ("auto", "triton", "torch")."""
    t0 = time.perf_counter()
    with DeltaReader(delta_path) as d, torch.no_grad():
        _check_targets(d, tensors)
        plans: list[tuple[TensorEntry, list[bytes], list[_Todo]]] = []
        skipped = 0
        for e in d.tensors:  # plan: read only
            t = tensors[e.name]
            flat = _ints(t)
            per = SEGMENT_BYTES // t.element_size()
            segs = _seg_hashes(t, impl)
            pre, todo = list(segs), []
            for r in d.chunks(e):
                h = segs[r.chunk_index]
                if h == r.post_hash:
                    pre[r.chunk_index] = r.pre_hash
                    skipped += 1
                    continue
                if h != r.pre_hash:
                    raise BaseMismatchError(f"{_where(e, r)}: bytes match neither the delta's base nor its target "
                                            "(wrong base, or modified since?)")
                seg = flat[r.chunk_index * per:(r.chunk_index + 1) * per]
                pos, val = _decode(d, e, r, seg)
                img = seg.clone()
                img[pos] = val
                if _hash1(img, impl) != r.post_hash:
                    raise VerificationError(f"{d.path}: {_where(e, r)}: decodes to bytes that miss the post-image "
                                            "hash (corrupt delta)")
                todo.append(_Todo(r, pos, val))
            if tensor_digest_from_segments(e.base.dtype, tuple(e.base.shape), e.base.nbytes, pre) != e.base.digest:
                raise BaseMismatchError(f"{_where(e)}: bytes differ from the delta's base (wrong base?)")
            plans.append((e, segs, todo))
        written = 0
        for e, segs, todo in plans:  # write, re-hash each written segment
            flat = _ints(tensors[e.name])
            per = SEGMENT_BYTES // tensors[e.name].element_size()
            for c in todo:
                seg = flat[c.rec.chunk_index * per:(c.rec.chunk_index + 1) * per]
                seg[c.pos] = c.val
                if _hash1(seg, impl) != c.rec.post_hash:
                    raise VerificationError(f"{_where(e, c.rec)}: segment does not hash to its post-image after "
                                            "writing")
                segs[c.rec.chunk_index] = c.rec.post_hash
                written += seg.numel() * seg.element_size()
        digests = {}
        for e, segs, _ in plans:
            got = tensor_digest_from_segments(e.target.dtype, tuple(e.target.shape), e.target.nbytes, segs)
            if got != e.target.digest:
                raise VerificationError(f"{_where(e)}: digest after apply does not match the delta's target")
            digests[e.name] = got
        fp = fingerprint_from_digests(digests)
        if fp != d.target_fingerprint:
            raise VerificationError(f"fingerprint after apply {fp[:16]}… is not the delta's target "
                                    f"{d.target_fingerprint[:16]}…")
        applied = sum(len(todo) for _, _, todo in plans)
        return ApplyReport(fp, applied, skipped, 0, written, time.perf_counter() - t0)
