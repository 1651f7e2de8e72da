"""Encode and decode one chunk: pure functions from (base bits, target bits) to bytes and back.

A chunk is one segment of a tensor (``integrity.SEGMENT_BYTES`` of raw bytes, the last one shorter).
``encode_chunk`` tries the encodings that can win for the chunk's change density and keeps the
smallest; ``decode_chunk`` turns a payload back into a ``Patch`` that, scattered over the base,
gives the target bit for bit. Encodings (numbers are part of the format, see FORMAT.md):

* ``ULP``         positions grouped by the base's exponent, rice-coded gaps per group, signed ulp
                  distances, all through an adaptive binary range coder (primitives.py; the kernels in encode_kernels.py and decode_kernels.py).
* ``SPARSE_XOR``  zstd( u8 width | position gaps as uint{8,16,32} | XOR values ) (the NeMo-RL layout).
* ``DENSE_XOR``   zstd( base XOR target ) over the whole chunk.
* ``OVERWRITE``   zstd( target ) over the whole chunk; also used for added or re-typed tensors.

Decoding an ``ULP`` chunk runs the native decoder (``_native.decode_ulp``) where the extension was
built (and is in use: ``codec.native.USE_NATIVE``), and numba's ``kernels.ulp_decode`` otherwise or under ``DELTAREFIT_KERNELS=numba``. The two give
the same positions and values and refuse the same payloads with the same status (so the same
``DecodeError`` message); tests hold them equal on valid, truncated and fuzzed payloads. Native, because
decoding is the rollout side's step: its rank-to-position pass over the base compares blocks of 64
elements with the contexts that still hold changes (SSE2, AVX2 or AVX-512, chosen at run time) instead
of counting elements one by one, which was over half of numba's decode of a bf16 chunk.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import zstandard

from ..dtypes import DType
from ..errors import DecodeError, LimitError
from . import native
from .constants import KIND_FLOAT, KIND_INT, KIND_UINT, STATUS
from .history import (
    HIST_ID_BYTES,
    N_STATES,
    QDEPTH,
    History,
    Moves,
    context_map,
    moves_of_changes,
    moves_of_images,
)
from .native import kernels_in_use as kernels_in_use  # (its earlier home)


class _Numba:
    """``codec.kernels`` (numba), imported on first use: a process whose chunks all run on the native
    kernels (a CLI apply of bf16 weights) never pays numba's import and its kernels' first calls."""

    def __getattr__(self, name: str):
        from . import kernels

        return getattr(kernels, name)


K = _Numba()

ULP = 1
SPARSE_XOR = 2
DENSE_XOR = 3
OVERWRITE = 4
ULP_HIST = 5
ENCODING_NAMES = {ULP: "ulp", SPARSE_XOR: "sparse_xor", DENSE_XOR: "dense_xor", OVERWRITE: "overwrite",
                  ULP_HIST: "ulp_hist"}

# Dense encodings are only worth trying once this fraction of a chunk changed and the ulp coding spends
# more than DENSE_TRY_BITS bits per element of the chunk: below that, zstd of a whole chunk never came
# close, and trying it costs two zstd passes over the chunk, about as much as the rest of the encoder.
# (On the benchmark pairs, dense was at least 2x the ulp size wherever ulp spent under 1 bit; the one
# chunk above 1 bit, 24% changed in the 4% pair, took 1.06 bits by ulp against 2.98 dense, and its trial
# cost 1.7 ms of a 34 ms encode.)
DENSE_TRY_FRACTION = 0.08
DENSE_TRY_BITS = 2.0
ZSTD_LEVEL = 1

_tls = threading.local()



def _zc() -> zstandard.ZstdCompressor:
    # One compressor per thread: zstandard's objects are not safe to share between threads.
    c = getattr(_tls, "zc", None)
    if c is None:
        c = _tls.zc = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)
    return c


def scratch_array(name: str, n: int, dt: np.dtype) -> np.ndarray:
    """A per-thread reusable array of at least ``n`` entries (its first ``n`` returned). Hazard: the
    next call with the same name on the same thread reuses the memory, so results in it must be used
    or copied first. Fresh multi-MiB arrays per chunk cost a page fault per touched page and an unmap
    (about 20% of the scan over a real pair)."""
    key = (name, np.dtype(dt).str)
    bufs = getattr(_tls, "scratch", None)
    if bufs is None:
        bufs = _tls.scratch = {}
    a = bufs.get(key)
    if a is None or a.size < n:
        a = bufs[key] = np.empty(max(n, 1), dt)
    return a[:n]


def _zd() -> zstandard.ZstdDecompressor:
    d = getattr(_tls, "zd", None)
    if d is None:
        d = _tls.zd = zstandard.ZstdDecompressor()
    return d


@dataclass(frozen=True)
class EncodedChunk:
    encoding: int
    payload: bytes
    n_changed: int
    decoded_len: int  # bytes the zstd stage expands to (0 for ULP)


@dataclass(frozen=True)
class Patch:
    """Decoded chunk: either sparse (positions, values) or a full dense image of the chunk."""

    positions: np.ndarray | None  # sorted int64 element indices
    values: np.ndarray | None  # target bits at those positions (uint view of the dtype)
    dense: np.ndarray | None  # the whole target chunk (uint view)

    def apply_to(self, view: np.ndarray) -> None:
        """Write the target bits into ``view`` (the chunk's elements, same uint dtype). Idempotent."""
        if self.dense is not None:
            view[:] = self.dense
        elif self.positions is not None and self.positions.size:
            from . import elements  # the native scatter, without the GIL (numpy's holds it)

            elements.put(view, self.positions, self.values)


def _kind(dt: DType) -> int:
    return {"float": KIND_FLOAT, "int": KIND_INT}.get(dt.kind, KIND_UINT)


def _ctx(dt: DType) -> tuple[int, int, int]:
    """(shift, mask, n_contexts) selecting a float's exponent field; a single context otherwise."""
    if dt.kind == "float":
        return dt.man_bits, (1 << dt.exp_bits) - 1, 1 << dt.exp_bits
    return 0, 0, 1


def max_payload_len(dt: DType, n: int) -> int:
    """Hard limit on one chunk's payload: never more than a zstd'd overwrite could need, plus slack."""
    return n * dt.itemsize + n * dt.itemsize // 64 + 4096


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


def encode_chunk(dt: DType, base: np.ndarray, target: np.ndarray, history: History | None = None) -> EncodedChunk | None:
    """Smallest bit-exact encoding of ``target`` given ``base`` (uint views, equal length), or None.
    With ``history`` (what the previous version changed in this chunk), the history-conditioned
    coding (``ULP_HIST``) is a candidate too, and the smaller of it and the rest is kept."""
    if history is None and _native16(dt):
        with contextlib.suppress(BufferError):  # an unaligned view: numba takes it
            return _encode_native16(dt, base, target)
    return encode_with_moves(dt, base, target, history)[0]


def encode_with_changes(dt: DType, base: np.ndarray,
                        target: np.ndarray) -> tuple[EncodedChunk | None, np.ndarray, np.ndarray, np.ndarray]:
    """``encode_chunk`` without history, and the changes its scan found: (chunk or None, positions
    (int32, ascending), base bits, target bits). The three arrays are views of this thread's scratch
    arrays, valid until its next scan."""
    got = None
    scanned = False
    if _native16(dt):
        with contextlib.suppress(BufferError):  # an unaligned view: numba takes it
            got = _encode_native16(dt, base, target)
            scanned = True
    if not scanned:
        got = encode_changes(dt, scan_chunk(dt, base, target, scratch=True), lambda: (base, target))
    # Both scans fill this thread's scratch arrays with the changes in position order.
    pos, _, _, bvals, tvals = _scan_buffers(base.size, base.dtype, True)
    m = 0 if got is None else got.n_changed
    return got, pos[:m], bvals[:m], tvals[:m]


def encode_with_moves(dt: DType, base: np.ndarray, target: np.ndarray, history: History | None,
                      changes: Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None = None,
                      ) -> tuple[EncodedChunk | None, Moves]:
    """``encode_chunk`` with ``history``, and the chunk's moves in this version (what the next
    version's history is made of), taken from the scan the coding made anyway. ``changes``, where
    given, is called with that scan's changes (as ``encode_with_changes`` returns them) when any."""
    got, pos, bvals, tvals = encode_with_changes(dt, base, target)
    n = base.size
    if got is None:
        return None, Moves(n, np.empty(0, np.int64), np.empty(0, np.bool_))
    if changes is not None:
        changes(pos, bvals, tvals)
    moves = moves_of_changes(dt, n, pos, bvals, tvals)
    if history is None or history.m == 0:
        return got, moves
    hist = encode_hist(dt, base, target, history)
    return (hist if hist is not None and len(hist.payload) < len(got.payload) else got), moves


def moves_of_patch(dt: DType, base: np.ndarray, patch: Patch) -> Moves:
    """A decoded chunk's moves (its changes and their directions) against its base (uint view)."""
    if patch.dense is not None:
        return moves_of_images(dt, base, patch.dense)
    if patch.positions is None or not patch.positions.size:
        return Moves(base.size, np.empty(0, np.int64), np.empty(0, np.bool_))
    return moves_of_changes(dt, base.size, patch.positions, base[patch.positions], patch.values)


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


def encode_raw(dt: DType, base: np.ndarray, target: np.ndarray) -> EncodedChunk | None:
    """``encode_chunk`` of two raw byte views (1-D uint8, equal length, whole elements), viewed as the
    dtype's uint here: the encoder's per-segment entry, kept lean (it runs once per MiB on every thread)."""
    # The native path first, on the raw views as they are: going through uint_view (whose alignment
    # check, ndarray.ctypes, costs microseconds) for every segment was 0.9-1.2 ms slower per encode of
    # the real 3.5% pair in three of four alternating runs. encode_chunk tries the same path on the
    # views it is given.
    if _native16(dt):
        try:
            return _encode_native16(dt, base, target)
        except BufferError:  # an odd address: a tensor at an odd offset in its file (copied below)
            pass
    return encode_chunk(dt, uint_view(base, dt), uint_view(target, dt))


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


def encode_changes(dt: DType, ch: Changes, dense) -> EncodedChunk | None:
    """Smallest bit-exact encoding of a chunk from its compact changes, or None when nothing changed.
    ``dense()`` returns the whole chunk's (base, target) uint views; it is called only for chunks
    changed so densely that a whole-chunk encoding may win (at least ``DENSE_TRY_FRACTION``)."""
    if ch.m == 0:
        return None
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


def _unzstd(payload: bytes, expected: int, where: str) -> bytes:
    try:
        params = zstandard.get_frame_parameters(payload)
    except zstandard.ZstdError as e:
        raise DecodeError(f"{where}: not a zstd frame ({e})") from None
    if params.content_size != expected:
        raise LimitError(f"{where}: zstd frame declares {params.content_size} bytes, expected {expected}")
    try:
        raw = _zd().decompress(payload, max_output_size=expected)
    except zstandard.ZstdError as e:
        raise DecodeError(f"{where}: zstd frame does not decode ({e})") from None
    if len(raw) != expected:
        raise DecodeError(f"{where}: zstd frame holds {len(raw)} bytes, expected {expected}")
    return raw


def decode_new(dt: DType, n: int, encoding: int, payload: bytes, where: str) -> np.ndarray:
    """The ``n`` elements of a chunk of a tensor with no base (added or re-typed): OVERWRITE only."""
    if encoding != OVERWRITE:
        raise DecodeError(f"{where}: a new tensor's chunk must be an overwrite, not encoding {encoding}")
    return np.frombuffer(_unzstd(payload, n * dt.itemsize, where), dt.uint)


def decode_chunk(
    dt: DType, base: np.ndarray, encoding: int, payload: bytes, n_changed: int, decoded_len: int, where: str,
    history: History | None = None,
) -> Patch:
    """Decode a chunk payload against its base (uint view). Raises DecodeError/LimitError on bad input.
    A ``ULP_HIST`` chunk needs ``history``, the one its payload names (refused otherwise)."""
    n = base.size
    if not 0 <= n_changed <= n:
        raise DecodeError(f"{where}: record claims {n_changed} changed elements in a chunk of {n}")
    if encoding == ULP_HIST:
        return _decode_hist(dt, base, payload, n_changed, decoded_len, where, history)
    if encoding == ULP:
        if decoded_len != 0:
            raise DecodeError(f"{where}: ulp chunk declares a decoded length")
        pos = np.empty(n_changed, np.int64)
        val = np.empty(n_changed, dt.uint)
        shift, mask, nctx = _ctx(dt)
        if native.USE_NATIVE and native.ext is not None and base.flags.c_contiguous:  # (any alignment)
            st = native.ext.decode_ulp(base, payload, n_changed, dt.itemsize, dt.bits, _kind(dt), shift, mask,
                                       nctx, pos, val)
        else:
            buf = np.frombuffer(payload, np.uint8)
            st = K.ulp_decode(base, buf, n_changed, dt.bits, _kind(dt), shift, mask, nctx, pos, val)
        if st != 0:
            raise DecodeError(f"{where}: {STATUS.get(st, f'status {st}')}")
        return Patch(pos, val, None)
    if encoding in (DENSE_XOR, OVERWRITE):
        raw = _unzstd(payload, n * dt.itemsize, where)
        arr = np.frombuffer(raw, dt.uint)
        if encoding == DENSE_XOR:
            arr = np.bitwise_xor(base, arr)
        changed = int(np.count_nonzero(arr != base))
        if changed != n_changed:
            raise DecodeError(f"{where}: decodes to {changed} changed elements, record says {n_changed}")
        return Patch(None, None, arr)
    if encoding == SPARSE_XOR:
        if decoded_len < 1:
            raise DecodeError(f"{where}: sparse chunk declares {decoded_len} decoded bytes")
        limit = 1 + n_changed * (4 + dt.itemsize)
        if decoded_len > limit:
            raise LimitError(f"{where}: sparse chunk declares {decoded_len} decoded bytes, limit {limit}")
        raw = _unzstd(payload, decoded_len, where)
        w = raw[0]
        if w not in (1, 2, 4) or len(raw) != 1 + n_changed * (w + dt.itemsize):
            raise DecodeError(f"{where}: sparse chunk layout does not match its {n_changed} changes")
        gaps = np.frombuffer(raw, f"<u{w}", n_changed, 1).astype(np.int64)
        pos = np.cumsum(gaps + 1) - 1
        if n_changed and pos[-1] >= n:
            raise DecodeError(f"{where}: position {int(pos[-1])} lies beyond the chunk's {n} elements")
        xor = np.frombuffer(raw, dt.uint, n_changed, 1 + n_changed * w)
        val = np.bitwise_xor(base[pos], xor)
        if np.any(val == base[pos]):
            raise DecodeError(f"{where}: sparse chunk lists an unchanged element")
        return Patch(pos, val, None)
    raise DecodeError(f"{where}: unknown encoding {encoding}")


def _decode_hist(dt: DType, base: np.ndarray, payload: bytes, n_changed: int, decoded_len: int, where: str,
                 history: History | None) -> Patch:
    n = base.size
    if decoded_len != 0:
        raise DecodeError(f"{where}: ulp_hist chunk declares a decoded length")
    if len(payload) < HIST_ID_BYTES:
        raise DecodeError(f"{where}: ulp_hist chunk is too short to name its history")
    want = payload[:HIST_ID_BYTES]
    if history is None:
        raise DecodeError(f"{where}: chunk is coded against history {want.hex()}, and none is held here")
    if history.n != n or history.id != want:
        raise DecodeError(f"{where}: chunk is coded against history {want.hex()}, this decoder holds "
                          f"{history.id.hex()} (a {history.n}-element chunk)")
    pos = np.empty(n_changed, np.int64)
    val = np.empty(n_changed, dt.uint)
    shift, mask, n_exp = _ctx(dt)
    cmap, cstate = context_map(n_exp)
    states = history.states()
    st = None
    if native.USE_NATIVE and native.ext is not None and base.flags.c_contiguous:  # (any alignment of the base)
        with contextlib.suppress(BufferError):
            st = native.ext.decode_hist(base, states, memoryview(payload)[HIST_ID_BYTES:], n_changed, dt.itemsize,
                                        dt.bits, _kind(dt), shift, mask, n_exp, cmap, cstate, N_STATES, QDEPTH, pos,
                                        val)
    if st is None:
        buf = np.frombuffer(payload, np.uint8, offset=HIST_ID_BYTES)
        st = K.hist_decode(base, states, buf, n_changed, dt.bits, _kind(dt), shift, mask, n_exp, cmap, cstate,
                           N_STATES, QDEPTH, pos, val)
    if st != 0:
        raise DecodeError(f"{where}: {STATUS.get(st, f'status {st}')}")
    return Patch(pos, val, None)
