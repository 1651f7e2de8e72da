"""Apply a delta in place to torch tensors where they live (CUDA, or CPU through the same code).

``apply_to_device_tensors(delta, tensors)`` runs the core's one apply protocol (``apply.run_apply``:
plan read only, then write, then verify; see ``deltarefit.apply``) over ``DeviceTensors``, a
``SegmentTarget`` whose regions are device tensors, with the region hooks doing the work that
touches whole segments on the device and the host only what is compact:

* segment hashes: BLAKE3 on the device (``gpu.blake3_triton``: Triton on CUDA, else the torch
  reference; on CPU tensors the host's BLAKE3 over a view of their memory), all segments of a tensor
  in one call for the plan; 16 bytes per MiB cross to the host;
* decode: the ulp encoding in compact form (below); format 2's ``ulp2`` / ``ulp2_hist`` on the device
  itself (``gpu.ulp2``: the Triton rANS lanes decode into staging arrays, a status per chunk; the
  payload goes up, only the status comes back; ``ulp2_hist`` with the book's history bytes); chunks
  of the other encodings (rare: dense or non-float changes, ``ulp_hist``, and 6/7 of 8-byte dtypes or
  where the kernels cannot run) are decoded on the host from a copy of their segment and reduced to
  the positions they change;
* post-image hash: the decoded values scattered into a device copy of the segment, hashed there;
* write: only the patched positions are scattered into the tensor, and the segment (the storage
  itself) is hashed again on the device.

Decoding the ulp encoding in compact form: the host decodes the group section (each change's context
and rank; no base needed); the device maps (context, rank) to positions with the structure of the
encoder's fused scan (``gpu.scan.context_perm``: per-tile context histograms of the base segment, an
exclusive scan over the tiles, and a scatter of every element to its place in context order; where
Triton cannot run, a stable torch sort gives the same table), puts the positions in order by
flagging and compacting them (no sort), and sends back the base bits there; the host decodes the
signed ulp distances in position order and computes the target bits; those go up to the device
(positions and values only).

Memory is O(one segment per apply thread) beyond the tensors, plus the compact patches of the chunks
to do, kept up to the applier's cache budget (about 10-16 bytes per changed element). In-memory
tensors need no journal: a process killed mid-apply loses the tensors with it; a rerun on tensors
half-applied by an exception completes them.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from ..apply.protocol import ApplyReport, run_apply
from ..apply.tensors import safetensors_dtype
from ..codec import kernels as K
from ..codec.chunk import ULP, ULP_HIST, _ctx, _kind, decode_chunk
from ..codec.history import moves_of_changes
from ..dtypes import dtype
from ..errors import DecodeError, DeltaRefitError, UsageError
from ..format import ChunkRecord, DeltaReader, TensorEntry
from ..history_book import HistoryBook, MovesRecorder, advance_or_start_over
from ..integrity import SEGMENT_BYTES
from . import scan as device_scan
from . import ulp2 as device_ulp2
from .encode import _SCANS, _Info, _ints, _scan_mode, _seg_hashes

ENCODING_NAMES_2 = {device_ulp2.ULP2: "ulp2", device_ulp2.ULP2_HIST: "ulp2_hist"}


@dataclass
class DevicePatch:
    """A decoded chunk on the device: int64 element ``positions`` within the segment and the target
    bits there (``values``, the signed integer view of the dtype's width). Never dense."""

    positions: torch.Tensor
    values: torch.Tensor
    dense: None = None


def _to_device_ints(vals: np.ndarray, itemsize: int, dev: torch.device) -> torch.Tensor:
    """Unsigned target bits as the signed (1 byte: unsigned) integer view ``_ints`` gives a tensor."""
    view = np.uint8 if itemsize == 1 else np.dtype(f"<i{itemsize}")
    return torch.from_numpy(np.ascontiguousarray(vals).view(view).copy()).to(dev)


def _where(e: TensorEntry, r: ChunkRecord) -> str:
    return f"tensor {e.name!r} chunk {r.chunk_index}"


def _context_perm(seg: torch.Tensor, dt, scan: str, lock: threading.Lock):
    """(perm, start, count) of the segment's contexts: the Triton hist-scan-scatter (``gpu.scan``), or
    where it cannot run the same table from a stable torch sort."""
    if scan == "triton":
        with lock:  # one launch at a time, as the hashes (the interpreter is not thread-safe either)
            return device_scan.context_perm(seg, dt)
    shift, mask, nctx = _ctx(dt)
    e = ((seg.to(torch.int64) if dt.itemsize < 8 else seg) >> shift) & mask if nctx > 1 else \
        torch.zeros(seg.numel(), dtype=torch.int64, device=seg.device)
    counts = torch.bincount(e, minlength=nctx)
    return torch.sort(e, stable=True).indices, torch.cumsum(counts, 0) - counts, counts


def _decode_ulp(seg: torch.Tensor, dt, payload: bytes, m: int, where: str, scan: str,
                lock: threading.Lock) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]:
    """(positions, target bits) of one ulp chunk, decoded with the device holding the segment, and on
    the host the base and target bits there."""
    n = seg.numel()
    shift, mask, nctx = _ctx(dt)
    buf = np.frombuffer(payload, np.uint8)
    gbeg, gend = np.zeros(nctx, np.int64), np.zeros(nctx, np.int64)
    granks, gctx = np.empty(max(m, 1), np.int64), np.empty(max(m, 1), np.int32)
    st, state = K.ulp_decode_groups(buf, m, n, nctx, gbeg, gend, granks, gctx)
    if st:
        raise DecodeError(f"{where}: {K.STATUS.get(st, f'status {st}')}")
    dev = seg.device
    # Device: the r-th element of context c is perm[start[c] + r].
    perm, start, counts = _context_perm(seg, dt, scan, lock)
    ctx_d = torch.from_numpy(gctx[:m].astype(np.int64)).to(dev)
    rank_d = torch.from_numpy(granks[:m]).to(dev)
    if bool((rank_d >= counts[ctx_d]).any()):
        raise DecodeError(f"{where}: {K.STATUS[-3]}")
    # Position order without a sort: flag the (distinct) positions, then compact the flags.
    flags = torch.zeros(n, dtype=torch.bool, device=dev)
    flags[perm[start[ctx_d] + rank_d].long()] = True
    pos_d = torch.nonzero(flags).reshape(-1)
    if pos_d.numel() != m:  # two changes at one position: the group decoder's ascending ranks exclude it
        raise DecodeError(f"{where}: {K.STATUS[-3]}")
    base_at = seg[pos_d].cpu().numpy().view(dt.uint)
    ectx = ((base_at.astype(np.uint64) >> np.uint64(shift)) & np.uint64(mask)).astype(np.int32)
    neg, mag = np.empty(m, np.uint8), np.empty(m, np.uint64)
    st = K.ulp_decode_deltas(buf, state, ectx, dt.bits, nctx, neg, mag)
    if st:
        raise DecodeError(f"{where}: {K.STATUS.get(st, f'status {st}')}")
    val = np.empty(m, dt.uint)
    K.ulp_apply_deltas(base_at, np.arange(m, dtype=np.int64), neg, mag, dt.bits, _kind(dt), val)
    return pos_d, _to_device_ints(val, dt.itemsize, dev), base_at, val


def _decode_ulp2(seg: torch.Tensor, dt, r: ChunkRecord, payload: bytes, where: str, lock: threading.Lock,
                 history: HistoryBook | None, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, target bits) of a ulp2 / ulp2_hist chunk decoded by the device (``gpu.ulp2``) into
    staging arrays; ``DecodeError`` (nothing written) on any refusal."""
    if r.decoded_len != 0:
        raise DecodeError(f"{where}: {ENCODING_NAMES_2[r.encoding]} chunk declares a decoded length")
    states = None
    if r.encoding == device_ulp2.ULP2_HIST:
        if len(payload) < 16:
            raise DecodeError(f"{where}: ulp2_hist chunk is too short to name its history")
        want, payload = bytes(payload[:16]), payload[16:]
        n = seg.numel()
        hist = history.history(name, r.chunk_index, n) if history is not None else None
        if hist is None:
            raise DecodeError(f"{where}: chunk is coded against history {want.hex()}, and none is held here")
        if hist.n != n or hist.id != want:
            raise DecodeError(f"{where}: chunk is coded against history {want.hex()}, this decoder holds "
                              f"{hist.id.hex()} (a {hist.n}-element chunk)")
        states = torch.from_numpy(hist.states().copy()).to(seg.device)
    with lock:  # one launch at a time, as the hashes (the interpreter is not thread-safe either)
        return device_ulp2.decode_chunk(dt, seg, bytes(payload), r.n_changed, where, states)


def _decode(d: DeltaReader, e: TensorEntry, r: ChunkRecord, seg: torch.Tensor, scan: str,
            lock: threading.Lock, history: HistoryBook | None = None,
            moves: MovesRecorder | None = None) -> DevicePatch:
    """A chunk decoded against its segment on the device. ``history``: the book ``ulp_hist`` chunks
    decode against (on the host, from a copy of the segment, as the other rare encodings); ``moves``:
    where the chunk's moves go."""
    dt = dtype(e.base.dtype)
    where = f"{d.path}: {_where(e, r)}"
    payload = d.read_payload(r, _where(e, r))
    n = seg.numel()
    if r.encoding == ULP:
        if r.decoded_len != 0:  # decode_chunk's check, which the split ulp decode does not pass through
            raise DecodeError(f"{where}: ulp chunk declares a decoded length")
        pos_d, val_d, old, new = _decode_ulp(seg, dt, payload, r.n_changed, where, _scan_mode(scan, seg.device),
                                             lock)
        if moves is not None:
            moves.add(e.name, r.chunk_index, moves_of_changes(dt, n, pos_d.cpu().numpy(), old, new))
        return DevicePatch(pos_d, val_d)
    if r.encoding in (device_ulp2.ULP2, device_ulp2.ULP2_HIST) and device_ulp2.supported(dt) \
            and _scan_mode(scan, seg.device) == "triton" and device_ulp2.available(seg.device):
        pos_d, val_d = _decode_ulp2(seg, dt, r, payload, where, lock, history, e.name)
        if moves is not None:
            pos = pos_d.cpu().numpy()
            moves.add(e.name, r.chunk_index, moves_of_changes(dt, n, pos, seg[pos_d].cpu().numpy().view(dt.uint),
                                                              val_d.cpu().numpy().view(dt.uint)))
        return DevicePatch(pos_d, val_d)
    host = seg.cpu().numpy().view(dt.uint)  # rare encodings: decoded on the host from a copy
    hist = history.history(e.name, r.chunk_index, n) if r.encoding in (ULP_HIST, device_ulp2.ULP2_HIST) \
        and history is not None else None
    patch = decode_chunk(dt, host, r.encoding, payload, r.n_changed, r.decoded_len, where, hist)
    if patch.dense is not None:
        pos = np.flatnonzero(patch.dense != host)
        val = patch.dense[pos]
    else:
        pos, val = patch.positions, patch.values
    if moves is not None:
        moves.add(e.name, r.chunk_index, moves_of_changes(dt, n, pos, host[pos], val))
    return DevicePatch(torch.from_numpy(pos.astype(np.int64)).to(seg.device),
                       _to_device_ints(val, dt.itemsize, seg.device))


class DeviceTensors:
    """``apply.SegmentTarget`` over contiguous torch tensors on any device, with the region hooks.

    A region is segment ``ci`` of a tensor as a view of its elements as same-width integers (``_ints``):
    the storage itself, so ``write_segment`` scatters into the tensor and returns the same view, read
    back by the next hash. ``impl`` picks the CUDA hash kernel ("auto", "triton", "torch").
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], impl: str = "auto", scan: str = "auto",
                 history: HistoryBook | None = None, moves: MovesRecorder | None = None) -> None:
        if scan not in _SCANS:
            raise UsageError(f"scan must be one of {', '.join(_SCANS)}, got {scan!r}")
        self.impl, self.scan = impl, scan
        # The applier's history hooks: this target decodes ulp_hist chunks against ``history`` and
        # records every decoded chunk's moves into ``moves`` itself (its regions are device tensors).
        self.history, self.moves = history, moves
        self.decodes_history = history is not None or moves is not None
        # Device hashes are taken one at a time: a Triton kernel compiles on its first launch, which is
        # not safe from several threads at once (the applier's pools), and one stream serializes them.
        self._device_lock = threading.Lock()
        self.tensors: dict[str, _Info] = {}
        self._t: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor) or t.layout != torch.strided or not t.is_contiguous() \
                    or t.is_conj() or t.is_neg():
                raise UsageError(f"tensor {name!r}: expected a contiguous dense torch.Tensor")
            try:
                dt = safetensors_dtype(t.dtype)
            except UsageError as err:
                raise UsageError(f"tensor {name!r}: {err}") from None
            self._t[name] = t.detach()
            self.tensors[name] = _Info(dt, tuple(int(x) for x in t.shape), t.numel() * t.element_size())

    def read_segment(self, name: str, ci: int) -> torch.Tensor:
        t = self._t[name]
        per = SEGMENT_BYTES // t.element_size()
        return _ints(t)[ci * per:(ci + 1) * per]

    def write_segment(self, name: str, ci: int, region: torch.Tensor, view: torch.Tensor,
                      patch: DevicePatch) -> torch.Tensor:
        view[patch.positions] = patch.values
        return region

    # region hooks (see apply.SegmentTarget)

    def _hashes(self, t: torch.Tensor) -> list[bytes]:
        if t.device.type == "cpu":
            return _seg_hashes(t, self.impl)
        with self._device_lock:
            return _seg_hashes(t, self.impl)

    def hash_region(self, region: torch.Tensor) -> bytes:
        return self._hashes(region)[0] if region.numel() else b""

    def hash_segments(self, name: str) -> list[bytes]:
        return self._hashes(self._t[name])

    def region_view(self, region: torch.Tensor, dt_name: str) -> torch.Tensor:
        return region  # already the dtype's integers

    def decode_region(self, d: DeltaReader, e: TensorEntry, r: ChunkRecord, view: torch.Tensor) -> DevicePatch:
        return _decode(d, e, r, view, self.scan, self._device_lock, self.history, self.moves)

    def post_image_hash(self, view: torch.Tensor, patch: DevicePatch) -> bytes:
        img = view.clone()
        img[patch.positions] = patch.values
        return self.hash_region(img)


def _refuse_structural(d: DeltaReader) -> None:
    for e in d.tensors:
        if e.op not in ("same", "patch"):
            raise UsageError(f"{d.path}: tensor {e.name!r} is {e.op}d by this delta, which cannot be done in "
                             "place in device tensors; apply it to a checkpoint and reload")


def apply_to_device_tensors(delta_path: str, tensors: dict[str, torch.Tensor], *,
                            impl: str = "auto", scan: str = "auto", history: HistoryBook | None = None) -> ApplyReport:
    """Apply the delta in place into ``tensors`` (CUDA or CPU, contiguous; the delta's base, or partly
    applied by an interrupted call). Refuses, before any write, wrong bases and deltas that do not
    decode to their target; ends with the target fingerprint verified. ``impl`` picks the segment
    hash kernel on CUDA ("auto", "triton", "torch"); ``scan`` the rank-to-position map ("triton": the
    kernels of ``gpu.scan``; "torch": a stable sort; "auto": Triton wherever it can run).
    ``history``: the tensors' history book (as ``deltarefit.apply``'s): ``ulp_hist`` chunks decode
    against it on the host from a copy of their segment (refused by name, nothing written, where it is
    not theirs), and it advances once the apply is verified (one that cannot be written is started
    over: the verified apply stands)."""
    with DeltaReader(delta_path) as d, torch.no_grad():
        _refuse_structural(d)
        moves = MovesRecorder() if history is not None else None
        rep = run_apply(d, DeviceTensors(tensors, impl, scan, history=history, moves=moves), journal=None,
                        moves=moves)
        if history is not None and moves is not None:
            # The tensors are verified at the target: a book that cannot be written (a full disk,
            # something planted at its path) is started over instead of failing the apply.
            advance_or_start_over(history, d, moves, tolerate=(OSError, DeltaRefitError))
        return rep
