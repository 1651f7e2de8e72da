"""Encode one chunk: a pure function from (base bits, target bits) to the smallest bit-exact payload.

A chunk is one segment of a tensor (``integrity.SEGMENT_BYTES`` of raw bytes, the last one shorter).
``encode_chunk`` tries the encodings that can win for the chunk's change density and keeps the
smallest (the encodings are listed in ``codec.encodings``). Every encoder entry takes ``fmt``, the
delta's format version: 2 (the default) codes the ulp class as encodings 6 and 7 (``codec.ulp2``), 1
writes exactly format version 1's bytes (encodings 1-5). The scan and the coder of 16-bit chunks run
in the native extension where it was built and is in use (``codec.native``), in numba otherwise; both
write the same bytes.

The import path of the chunk codec: what ``codec.encodings`` (the encodings' numbers and values) and
``codec.decode`` (``decode_chunk``, ``decode_new``, ``moves_of_patch``) hold is importable from here too.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import zstandard

from ..dtypes import DType
from . import native
from .decode import decode_chunk as decode_chunk
from .decode import decode_new as decode_new
from .decode import moves_of_patch as moves_of_patch
from .encodings import (
    DENSE_XOR,
    ENCODING_NAMES,
    HIST_ENCODINGS,
    OVERWRITE,
    SPARSE_XOR,
    ULP,
    ULP2,
    ULP2_HIST,
    ULP_HIST,
    EncodedChunk,
    K,
    Patch,
    _ctx,
    _kind,
    max_payload_len,
    scratch_array,
)
from .history import N_STATES, QDEPTH, History, Moves, context_map, moves_of_changes
from .native import kernels_in_use as kernels_in_use  # (its earlier home)
from .ulp2 import encode_ulp2

__all__ = [
    "DENSE_XOR", "ENCODING_NAMES", "FORMATS", "HIST_ENCODINGS", "OVERWRITE", "SPARSE_XOR", "ULP", "ULP2", "ULP2_HIST", "ULP_HIST", "Changes", "EncodedChunk",
    "Patch", "decode_chunk", "decode_new", "encode_changes", "encode_chunk", "encode_hist", "encode_overwrite",
    "encode_raw", "encode_with_changes", "encode_with_moves", "kernels_in_use", "max_payload_len",
    "moves_of_patch", "scan_chunk", "scratch_array", "uint_view",
]

# Dense encodings are only worth trying once this fraction of a chunk changed and the ulp coding spends
# more than DENSE_TRY_BITS bits per element of the chunk: below that, zstd of a whole chunk never came
# close, and trying it costs two zstd passes over the chunk, about as much as the rest of the encoder.
# (On the benchmark pairs, dense was at least 2x the ulp size wherever ulp spent under 1 bit; the one
# chunk above 1 bit, 24% changed in the 4% pair, took 1.06 bits by ulp against 2.98 dense, and its trial
# cost 1.7 ms of a 34 ms encode.)
DENSE_TRY_FRACTION = 0.08
DENSE_TRY_BITS = 2.0
ZSTD_LEVEL = 1
FORMATS = (1, 2)  # the format versions the encoder writes (``fmt``)
# Format 2 also tries format 1's ulp coding (encodings 1 and 5) for chunks of at most this many changes:
# the ulp2 class carries 64 bytes of lane states and a table per context, which a chunk of a few changes
# (a LayerNorm's or a bias's) does not earn back, and the serial decoder costs such a chunk microseconds.
# Measured on the real 1% AdamW MiniLM pair (scripts/ulp2_sizes.py): chunks under 4,096 elements took
# 2,857 bytes in format 2 without this against 1,881 in format 1.
ULP1_MAX_CHANGES = 512

_tls = threading.local()


def _zc() -> zstandard.ZstdCompressor:
    # One compressor per thread: zstandard's objects are not safe to share between threads.
    c = getattr(_tls, "zc", None)
    if c is None:
        c = _tls.zc = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)
    return c


def _width_code(max_gap: int) -> int:
    return 1 if max_gap < 1 << 8 else 2 if max_gap < 1 << 16 else 4


@dataclass(frozen=True)
class Changes:
    """A chunk's changes in compact form: what ``scan_chunk`` finds on the host, or a GPU
    compare-and-compact kernel finds on the device (``deltarefit.gpu.encode``). Entries are in
    position order; ``ectx`` is the base's context (exponent field) and ``rank`` the position's rank
    among the chunk's elements of that context."""

    n: int  # elements in the chunk
    pos: np.ndarray  # ascending element indices
    ectx: np.ndarray  # int32
    rank: np.ndarray  # int32
    bvals: np.ndarray  # base bits at pos (uint view of the dtype)
    tvals: np.ndarray  # target bits at pos

    @property
    def m(self) -> int:
        return int(self.pos.size)


def _scan_buffers(n: int, udt: np.dtype, scratch: bool) -> tuple[np.ndarray, ...]:
    """(pos, ectx, rank, bvals, tvals) for a chunk of ``n`` elements: fresh, or this thread's (at least
    ``n`` long; the kernels fill the first m). One lookup per chunk: it runs once per MiB per thread."""
    if not scratch:
        return np.empty(n, np.int32), np.empty(n, np.int32), np.empty(n, np.int32), np.empty(n, udt), np.empty(n, udt)
    cache = getattr(_tls, "scan", None)
    if cache is None:
        cache = _tls.scan = {}
    key = np.dtype(udt).str
    bufs = cache.get(key)
    if bufs is None or bufs[0].size < n:
        k = max(n, 1)
        bufs = cache[key] = (np.empty(k, np.int32), np.empty(k, np.int32), np.empty(k, np.int32), np.empty(k, udt),
                             np.empty(k, udt))
    return bufs


def _native16(dt: DType) -> bool:
    return native.USE_NATIVE and native.SCAN_AVX512 and dt.itemsize == 2


def scan_chunk(dt: DType, base: np.ndarray, target: np.ndarray, *, scratch: bool = False) -> Changes:
    """The changes between two uint views of one chunk (equal length). With ``scratch``, the result
    lives in this thread's scratch arrays and is valid until its next ``scan_chunk(scratch=True)``."""
    n = base.size
    shift, mask, nctx = _ctx(dt)
    bufs = _scan_buffers(n, base.dtype, scratch)
    m = -1
    if _native16(dt):
        with contextlib.suppress(BufferError):  # an unaligned view: numba takes it
            m = native.ext.scan16(base, target, shift, mask, nctx, *bufs)
    if m < 0:
        m = K.ulp_scan(base, target, shift, mask, nctx, *bufs)
    pos, ectx, rank, bvals, tvals = bufs
    return Changes(n, pos[:m], ectx[:m], rank[:m], bvals[:m], tvals[:m])


def _check_fmt(fmt: int) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"format version {fmt} is not one this encoder writes ({', '.join(map(str, FORMATS))})")


def _encode2(dt: DType, base: np.ndarray, target: np.ndarray, history: History | None) -> tuple[EncodedChunk | None, Changes]:
    """Format 2's choice: the ulp2 class (``encode_ulp2``, with ``history`` encoding 7 too) and the
    candidates that may beat it (``_choose``), and the scan's changes (this thread's scratch)."""
    ch = scan_chunk(dt, base, target, scratch=True)
    if ch.m == 0:
        return None, ch
    if history is not None and history.m == 0:
        history = None  # (encoding 7 over an empty history is encoding 6 and 28 bytes more)
    got = _choose(dt, ch, lambda: (base, target), encode_ulp2(dt, base, target, history))
    if ch.m <= ULP1_MAX_CHANGES:
        cands = [got, encode_changes(dt, ch, lambda: (base, target), fmt=1)]
        if history is not None:
            # (last: its scan rewrites this thread's scan buffers, with the same changes in the same order)
            cands.append(encode_hist(dt, base, target, history))
        got = min((c for c in cands if c is not None), key=lambda c: len(c.payload))  # (ties: the first)
    return got, ch


def encode_chunk(dt: DType, base: np.ndarray, target: np.ndarray, history: History | None = None, *,
                 fmt: int = 2) -> EncodedChunk | None:
    """Smallest bit-exact encoding of ``target`` given ``base`` (uint views, equal length), or None.
    With ``history`` (what the previous version changed in this chunk), the history-conditioned
    coding (``ULP_HIST``, format 2: ``ULP2_HIST``) is a candidate too, and the smaller of it and the rest
    is kept. ``fmt``: the delta's format version (1 or 2)."""
    _check_fmt(fmt)
    if fmt == 2:
        return _encode2(dt, base, target, history)[0]
    if history is None and _native16(dt):
        with contextlib.suppress(BufferError):  # an unaligned view: numba takes it
            return _encode_native16(dt, base, target)
    return encode_with_moves(dt, base, target, history, fmt=1)[0]


def encode_with_changes(dt: DType, base: np.ndarray, target: np.ndarray, *,
                        fmt: int = 2) -> tuple[EncodedChunk | None, np.ndarray, np.ndarray, np.ndarray]:
    """``encode_chunk`` without history, and the changes its scan found: (chunk or None, positions
    (int32, ascending), base bits, target bits). The three arrays are views of this thread's scratch
    arrays, valid until its next scan."""
    _check_fmt(fmt)
    if fmt == 2:
        got, ch = _encode2(dt, base, target, None)
        return got, ch.pos, ch.bvals, ch.tvals
    got = None
    scanned = False
    if _native16(dt):
        with contextlib.suppress(BufferError):  # an unaligned view: numba takes it
            got = _encode_native16(dt, base, target)
            scanned = True
    if not scanned:
        got = encode_changes(dt, scan_chunk(dt, base, target, scratch=True), lambda: (base, target), fmt=1)
    # Both scans fill this thread's scratch arrays with the changes in position order.
    pos, _, _, bvals, tvals = _scan_buffers(base.size, base.dtype, True)
    m = 0 if got is None else got.n_changed
    return got, pos[:m], bvals[:m], tvals[:m]


def encode_with_moves(dt: DType, base: np.ndarray, target: np.ndarray, history: History | None,
                      changes: Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None = None,
                      *, fmt: int = 2) -> tuple[EncodedChunk | None, Moves]:
    """``encode_chunk`` with ``history``, and the chunk's moves in this version (what the next
    version's history is made of), taken from the scan the coding made anyway. ``changes``, where
    given, is called with that scan's changes (as ``encode_with_changes`` returns them) when any."""
    _check_fmt(fmt)
    n = base.size
    if fmt == 2:
        got, ch = _encode2(dt, base, target, history)
        if got is None:
            return None, Moves(n, np.empty(0, np.int64), np.empty(0, np.bool_))
        if changes is not None:
            changes(ch.pos, ch.bvals, ch.tvals)
        return got, moves_of_changes(dt, n, ch.pos, ch.bvals, ch.tvals)
    got, pos, bvals, tvals = encode_with_changes(dt, base, target, fmt=1)
    if got is None:
        return None, Moves(n, np.empty(0, np.int64), np.empty(0, np.bool_))
    if changes is not None:
        changes(pos, bvals, tvals)
    moves = moves_of_changes(dt, n, pos, bvals, tvals)
    if history is None or history.m == 0:
        return got, moves
    hist = encode_hist(dt, base, target, history)
    return (hist if hist is not None and len(hist.payload) < len(got.payload) else got), moves


def encode_hist(dt: DType, base: np.ndarray, target: np.ndarray, history: History) -> EncodedChunk | None:
    """The ``ULP_HIST`` coding of a chunk against ``history`` (FORMAT.md, "Encoding 5: ulp_hist"), or
    None when nothing changed or it does not fit. Payload: the history's id, then the ulp bitstream
    with each context split by the element's previous change (none, up, down)."""
    n = base.size
    if history.n != n:
        raise ValueError(f"history of a {history.n}-element chunk given for a chunk of {n}")
    shift, mask, n_exp = _ctx(dt)
    cmap, cstate = context_map(n_exp)
    pos, ectx, rank, bvals, tvals = _scan_buffers(n, base.dtype, True)
    flip = scratch_array("flip", n, np.uint8)
    states = history.states()
    out = scratch_array("payload", max_payload_len(dt, n) + 64, np.uint8)
    m = -1
    if native.USE_NATIVE and native.ext is not None and dt.itemsize == 2:  # scan and code in one call, the same bytes
        with contextlib.suppress(BufferError):  # an unaligned view: numba takes it
            m, nbytes = native.ext.encode_hist16(base, target, states, cmap, shift, mask, n_exp, cstate.size, pos,
                                                 ectx, rank, bvals, tvals, flip, dt.bits, _kind(dt), cstate, N_STATES,
                                                 QDEPTH, out)
    if m < 0:
        m = K.hist_scan(base, target, states, cmap, shift, mask, n_exp, cstate.size, pos, ectx, rank, bvals, tvals,
                        flip)
        if m:
            nbytes = K.ulp_encode_core(ectx[:m], rank[:m], bvals[:m], tvals[:m], dt.bits, _kind(dt), cstate.size,
                                       cstate, N_STATES, QDEPTH, flip[:m], out)
    if m == 0:
        return None
    if nbytes < 0:
        return None
    return EncodedChunk(ULP_HIST, history.id + out[:nbytes].tobytes(), m, 0)


def encode_raw(dt: DType, base: np.ndarray, target: np.ndarray, *, fmt: int = 2) -> EncodedChunk | None:
    """``encode_chunk`` of two raw byte views (1-D uint8, equal length, whole elements), viewed as the
    dtype's uint here: the encoder's per-segment entry, kept lean (it runs once per MiB on every thread)."""
    if fmt != 1:
        _check_fmt(fmt)
        return encode_chunk(dt, uint_view(base, dt), uint_view(target, dt), fmt=fmt)
    # The native path first, on the raw views as they are: going through uint_view (whose alignment
    # check, ndarray.ctypes, costs microseconds) for every segment was 0.9-1.2 ms slower per encode of
    # the real 3.5% pair in three of four alternating runs. encode_chunk tries the same path on the
    # views it is given.
    if _native16(dt):
        try:
            return _encode_native16(dt, base, target)
        except BufferError:  # an odd address: a tensor at an odd offset in its file (copied below)
            pass
    return encode_chunk(dt, uint_view(base, dt), uint_view(target, dt), fmt=1)


def uint_view(raw: np.ndarray, dt: DType) -> np.ndarray:
    """View raw bytes as unsigned integers of the dtype's width (copying only if misaligned)."""
    v = raw.view(dt.uint)
    # (flags.aligned: the address is a multiple of the item size, without building a .ctypes object)
    return v if v.flags.aligned else raw.copy().view(dt.uint)


def _encode_native16(dt: DType, base: np.ndarray, target: np.ndarray) -> EncodedChunk | None:
    # One native call scans and codes; the common case (a float chunk whose ulp coding wins outright)
    # returns without building a Changes. Raises BufferError for a misaligned raw view.
    n = base.nbytes // 2
    shift, mask, nctx = _ctx(dt)
    bufs = _scan_buffers(n, np.dtype(np.uint16), True)
    # The numba coder's limit (encode_changes): both reject the same chunks.
    out = scratch_array("payload", max_payload_len(dt, n) + 64, np.uint8)
    m, nbytes = native.ext.scan16(base, target, shift, mask, nctx, *bufs, dt.bits, _kind(dt), out)
    if m == 0:
        return None
    if nbytes >= 0 and not _try_dense(n, m, nbytes) and not _try_sparse(dt, m, nbytes):
        return EncodedChunk(ULP, out[:nbytes].tobytes(), m, 0)  # what _choose would pick
    pos, ectx, rank, bvals, tvals = (b[:m] for b in bufs)
    ch = Changes(n, pos, ectx, rank, bvals, tvals)
    views = base.view(np.uint16), target.view(np.uint16)
    return _choose(dt, ch, lambda: views, _ulp_candidate(ch, out, nbytes))


def _ulp_candidate(ch: Changes, out: np.ndarray, nbytes: int) -> EncodedChunk | None:
    return EncodedChunk(ULP, out[:nbytes].tobytes(), ch.m, 0) if nbytes >= 0 else None


def encode_changes(dt: DType, ch: Changes, dense, *, fmt: int = 2) -> EncodedChunk | None:
    """Smallest bit-exact encoding of a chunk from its compact changes, or None when nothing changed.
    ``dense()`` returns the whole chunk's (base, target) uint views; in format 1 it is called only for
    chunks changed so densely that a whole-chunk encoding may win (at least ``DENSE_TRY_FRACTION``), in
    format 2 for every chunk with changes (encoding 6 codes a decision for every element)."""
    _check_fmt(fmt)
    if ch.m == 0:
        return None
    if fmt == 2:  # _encode2's choice (no history), so that every caller writes deltarefit.encode's bytes
        base, target = dense()
        got = _choose(dt, ch, lambda: (base, target), encode_ulp2(dt, base, target))
        if ch.m <= ULP1_MAX_CHANGES:
            alt = encode_changes(dt, ch, lambda: (base, target), fmt=1)
            got = min((c for c in (got, alt) if c is not None), key=lambda c: len(c.payload))  # (ties: the first)
        return got
    _, _, nctx = _ctx(dt)
    out = scratch_array("payload", max_payload_len(dt, ch.n) + 64, np.uint8)  # copied out by tobytes()
    if native.USE_NATIVE and native.ext is not None:
        nbytes = native.ext.encode_changes(ch.ectx, ch.rank, ch.bvals, ch.tvals, dt.itemsize, dt.bits, _kind(dt),
                                           nctx, out)
    else:
        nbytes = K.ulp_encode_changes(ch.ectx, ch.rank, ch.bvals, ch.tvals, dt.bits, _kind(dt), nctx, out)
    return _choose(dt, ch, dense, _ulp_candidate(ch, out, nbytes))


def _try_dense(n: int, m: int, ulp_bytes: int) -> bool:
    """Whether whole-chunk encodings may beat an ulp coding of ``ulp_bytes`` (see DENSE_TRY_BITS)."""
    return m >= DENSE_TRY_FRACTION * n and 8 * ulp_bytes > DENSE_TRY_BITS * n


def _try_sparse(dt: DType, m: int, ulp_bytes: int) -> bool:
    """Whether the sparse XOR layout may beat the ulp coding: only where the ulp model may lose,
    integer tensors or float changes that are not small steps (over 24 bits per change)."""
    return dt.kind != "float" or ulp_bytes > 3 * m


def _choose(dt: DType, ch: Changes, dense, ulp: EncodedChunk | None) -> EncodedChunk | None:
    """The smallest of the ulp coding (None if it did not fit) and the candidates that may beat it."""
    n, m = ch.n, ch.m
    if m == 0:
        return None
    cands = [ulp] if ulp is not None else []
    if not cands or _try_dense(n, m, len(cands[0].payload)):
        base, target = dense()
        x = np.bitwise_xor(base, target)
        raw = x.tobytes()
        cands.append(EncodedChunk(DENSE_XOR, _zc().compress(raw), m, len(raw)))
        raw_t = target.tobytes()
        cands.append(EncodedChunk(OVERWRITE, _zc().compress(raw_t), m, len(raw_t)))
    elif _try_sparse(dt, m, len(cands[0].payload)):
        pos = ch.pos.astype(np.int64)
        gaps = np.diff(pos, prepend=-1) - 1
        w = _width_code(int(gaps.max()))
        raw = bytes([w]) + gaps.astype(f"<u{w}").tobytes() + np.bitwise_xor(ch.bvals, ch.tvals).tobytes()
        cands.append(EncodedChunk(SPARSE_XOR, _zc().compress(raw), m, len(raw)))
    return min(cands, key=lambda c: len(c.payload))


def encode_overwrite(target: np.ndarray) -> EncodedChunk:
    """An OVERWRITE chunk (for tensors with no usable base: added, reshaped, re-typed)."""
    raw = target.tobytes()
    return EncodedChunk(OVERWRITE, _zc().compress(raw), target.size, len(raw))


