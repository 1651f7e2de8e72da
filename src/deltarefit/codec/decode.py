"""Decode one chunk: a payload and its record, against the chunk's base, back into the ``Patch`` that,
scattered over the base, gives the target bit for bit (``decode_chunk``; ``decode_new`` for a tensor
with no base), and the moves a decoded chunk made (``moves_of_patch``, what the next version's history
is made of). Bad input raises ``DecodeError`` or ``LimitError``; nothing here writes the base.

Decoding an ``ULP`` or ``ULP_HIST`` chunk runs the native decoder (``_native.decode_ulp``,
``_native.decode_hist``) where the extension was built and is in use (``codec.native.USE_NATIVE``), and
numba's (``kernels.ulp_decode``, ``kernels.hist_decode``) otherwise or under ``DELTAREFIT_KERNELS=numba``.
The two give the same positions and values and refuse the same payloads with the same status (so the
same ``DecodeError`` message); tests hold them equal on valid, truncated and fuzzed payloads. Native,
because decoding is the rollout side's step: its rank-to-position pass over the base compares blocks of
64 elements with the contexts that still hold changes (SSE2, AVX2 or AVX-512, chosen at run time)
instead of counting elements one by one, which was over half of numba's decode of a bf16 chunk.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import zstandard

from ..dtypes import DType
from ..errors import DecodeError, LimitError
from . import native
from .constants import STATUS
from .encodings import DENSE_XOR, OVERWRITE, SPARSE_XOR, ULP, ULP2, ULP2_HIST, ULP_HIST, K, Patch, _ctx, _kind
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
from .ulp2 import decode_ulp2

_tls = threading.local()


def _zd() -> zstandard.ZstdDecompressor:
    d = getattr(_tls, "zd", None)
    if d is None:
        d = _tls.zd = zstandard.ZstdDecompressor()
    return d


def moves_of_patch(dt: DType, base: np.ndarray, patch: Patch) -> Moves:
    """A decoded chunk's moves (its changes and their directions) against its base (uint view)."""
    if patch.dense is not None:
        return moves_of_images(dt, base, patch.dense)
    if patch.positions is None or not patch.positions.size:
        return Moves(base.size, np.empty(0, np.int64), np.empty(0, np.bool_))
    return moves_of_changes(dt, base.size, patch.positions, base[patch.positions], patch.values)


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


def _moved(res) -> tuple[int, np.ndarray | None]:
    """(status, digest move) of a native decode's result: ``(status, a0, a1)`` where it was asked for the
    digest, else the status alone."""
    if isinstance(res, tuple):
        return res[0], np.array(res[1:], np.uint64)
    return res, None


def decode_chunk(
    dt: DType, base: np.ndarray, encoding: int, payload: bytes, n_changed: int, decoded_len: int, where: str,
    history: History | None = None, *, digest: tuple[int, int, int] | None = None,
) -> Patch:
    """Decode a chunk payload against its base (uint view). Raises DecodeError/LimitError on bad input.
    A ``ULP_HIST`` or ``ULP2_HIST`` chunk needs ``history``, the one its payload names (refused otherwise).
    ``digest``: ``(start, s0, s1)``, the chunk's first element index in its tensor and the tensor's
    additive-digest seeds; the native decoder of ``ULP``, ``ULP_HIST``, ``ULP2`` and ``ULP2_HIST`` chunks then also gives the
    digest's move by the changes (``Patch.moved``, what ``integrity.additive.move`` gives over the base),
    taken in the same pass. Other paths leave ``Patch.moved`` None."""
    n = base.size
    if not 0 <= n_changed <= n:
        raise DecodeError(f"{where}: record claims {n_changed} changed elements in a chunk of {n}")
    if encoding in (ULP2, ULP2_HIST):
        if decoded_len != 0:
            raise DecodeError(f"{where}: {'ulp2' if encoding == ULP2 else 'ulp2_hist'} chunk declares a decoded length")
        return decode_ulp2(dt, base, encoding, payload, n_changed, where, history, digest)
    if encoding == ULP_HIST:
        return _decode_hist(dt, base, payload, n_changed, decoded_len, where, history, digest)
    if encoding == ULP:
        if decoded_len != 0:
            raise DecodeError(f"{where}: ulp chunk declares a decoded length")
        pos = np.empty(n_changed, np.int64)
        val = np.empty(n_changed, dt.uint)
        shift, mask, nctx = _ctx(dt)
        moved = None
        if native.USE_NATIVE and native.ext is not None and base.flags.c_contiguous:  # (any alignment)
            st, moved = _moved(native.ext.decode_ulp(base, payload, n_changed, dt.itemsize, dt.bits, _kind(dt), shift,
                                                     mask, nctx, pos, val, digest))
        else:
            buf = np.frombuffer(payload, np.uint8)
            st = K.ulp_decode(base, buf, n_changed, dt.bits, _kind(dt), shift, mask, nctx, pos, val)
        if st != 0:
            raise DecodeError(f"{where}: {STATUS.get(st, f'status {st}')}")
        return Patch(pos, val, None, moved)
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
                 history: History | None, digest: tuple[int, int, int] | None) -> Patch:
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
    st = moved = None
    if native.USE_NATIVE and native.ext is not None and base.flags.c_contiguous:  # (any alignment of the base)
        with contextlib.suppress(BufferError):
            st, moved = _moved(native.ext.decode_hist(
                base, states, memoryview(payload)[HIST_ID_BYTES:], n_changed, dt.itemsize, dt.bits, _kind(dt), shift,
                mask, n_exp, cmap, cstate, N_STATES, QDEPTH, pos, val, digest))
    if st is None:
        buf = np.frombuffer(payload, np.uint8, offset=HIST_ID_BYTES)
        st = K.hist_decode(base, states, buf, n_changed, dt.bits, _kind(dt), shift, mask, n_exp, cmap, cstate,
                           N_STATES, QDEPTH, pos, val)
    if st != 0:
        raise DecodeError(f"{where}: {STATUS.get(st, f'status {st}')}")
    return Patch(pos, val, None, moved)
