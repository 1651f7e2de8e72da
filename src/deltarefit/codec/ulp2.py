"""Format version 2's ulp class, one chunk at a time: ``encode_ulp2`` codes a chunk as encoding 6
(``ulp2``) and, given the chunk's history, 7 (``ulp2_hist``) in both coder variants and keeps the
smallest; ``decode_ulp2`` decodes either back into a ``Patch``. FORMAT.md, "Format version 2", specifies
the bytes.

The kernels are the native extension's (``_native.ulp2_encode``, ``_native.ulp2_decode``) where it was
built with them and is in use (``codec.native``), numba's (``codec.ulp2_kernels``) otherwise; both write
the same bytes and refuse the same payloads with the same status. Bad input raises ``DecodeError``.
"""

from __future__ import annotations

import contextlib

import numpy as np

from ..dtypes import DType
from ..errors import DecodeError
from . import native
from .constants import STATUS
from .encodings import ULP2, ULP2_HIST, EncodedChunk, Patch, _ctx, _kind, max_payload_len, scratch_array
from .history import HIST_ID_BYTES, History

VARIANTS = (0, 1)
_NO_STATES = np.zeros(0, np.uint8)


def _numba():
    from . import ulp2_kernels

    return ulp2_kernels


def _encoder():
    kern = native.kernel("ulp2_encode")
    return kern if kern is not None else _numba().ulp2_encode


def _decoder():
    kern = native.kernel("ulp2_decode")
    return kern if kern is not None else _numba().ulp2_decode


def encode_variant(dt: DType, base: np.ndarray, target: np.ndarray, states: np.ndarray | None,
                   variant: int, limit: int | None = None) -> tuple[int, bytes | None]:
    """(m, payload) of one chunk in one coder ``variant``: encoding 7's payload (without the history id)
    when ``states`` (the history's per-element bytes) are given, else encoding 6's. The payload is None
    where nothing changed, the variant cannot code the chunk, or it would exceed ``limit`` bytes (default:
    the chunk record's bound)."""
    n = base.size
    if target.size != n:
        raise ValueError(f"base of {n} elements and target of {target.size}")
    shift, mask, n_exp = _ctx(dt)
    hist = 0 if states is None else 1
    if limit is None:
        limit = max_payload_len(dt, n) - (HIST_ID_BYTES if hist else 0)
    pos = scratch_array("ulp2_pos", n, np.int32)
    out = scratch_array("ulp2_out", limit, np.uint8)
    args = (base, target, _NO_STATES if states is None else states, dt.bits, _kind(dt), shift, mask, n_exp, hist,
            variant, pos, out)
    m = nbytes = -1
    kern = native.kernel("ulp2_encode")
    if kern is not None:
        with contextlib.suppress(BufferError):  # an unaligned view: numba takes it
            m, nbytes = kern(*args)
    if m < 0:
        m, nbytes = _numba().ulp2_encode(*args)
    return m, (out[:nbytes].tobytes() if m > 0 and nbytes > 0 else None)


def encode_ulp2(dt: DType, base: np.ndarray, target: np.ndarray, history: History | None = None) -> EncodedChunk | None:
    """The smallest format 2 ulp-class coding of a chunk (uint views of one length): encoding 6 in each
    coder variant (ties: variant 0), and with ``history`` (what the chunk's last versions changed, as
    encoding 5 takes it) also encoding 7, kept only where strictly smaller. None where nothing changed or
    no variant can code the chunk within its record's bound."""
    best: EncodedChunk | None = None
    m = 0
    for v in VARIANTS:
        m, got = encode_variant(dt, base, target, None, v)
        if m == 0:
            return None
        if got is not None and (best is None or len(got) < len(best.payload)):
            best = EncodedChunk(ULP2, got, m, 0)
    if history is not None and history.m:
        if history.n != base.size:
            raise ValueError(f"history of a {history.n}-element chunk given for a chunk of {base.size}")
        states = history.states()
        for v in VARIANTS:
            _, got = encode_variant(dt, base, target, states, v)
            if got is not None and (best is None or HIST_ID_BYTES + len(got) < len(best.payload)):
                best = EncodedChunk(ULP2_HIST, history.id + got, m, 0)
    return best


def _moved(res) -> tuple[int, np.ndarray | None]:
    if isinstance(res, tuple):
        return res[0], np.array(res[1:], np.uint64)
    return res, None


def decode_ulp2(dt: DType, base: np.ndarray, encoding: int, payload: bytes, n_changed: int, where: str,
                history: History | None = None, digest: tuple[int, int, int] | None = None) -> Patch:
    """Decode an encoding 6 or 7 payload against its base (uint view). Encoding 7 needs ``history``, the
    one its payload names (refused otherwise, before anything is decoded). ``digest`` as
    ``decode.decode_chunk``'s: the native decoder then gives the additive digest's move
    (``Patch.moved``); numba's leaves it None."""
    n = base.size
    mv = memoryview(payload)
    states = _NO_STATES
    hist = 0
    if encoding == ULP2_HIST:
        if len(payload) < HIST_ID_BYTES:
            raise DecodeError(f"{where}: ulp2_hist chunk is too short to name its history")
        want = bytes(mv[:HIST_ID_BYTES])
        if history is None:
            raise DecodeError(f"{where}: chunk is coded against history {want.hex()}, and none is held here")
        if history.n != n or history.id != want:
            raise DecodeError(f"{where}: chunk is coded against history {want.hex()}, this decoder holds "
                              f"{history.id.hex()} (a {history.n}-element chunk)")
        states = history.states()
        hist = 1
        mv = mv[HIST_ID_BYTES:]
    elif encoding != ULP2:
        raise DecodeError(f"{where}: encoding {encoding} is not of the ulp2 class")
    pos = np.empty(n_changed, np.int64)
    val = np.empty(n_changed, dt.uint)
    shift, mask, n_exp = _ctx(dt)
    buf = np.frombuffer(mv, np.uint8)
    args = (base, states, buf, n_changed, dt.bits, _kind(dt), shift, mask, n_exp, hist, pos, val)
    st = moved = None
    kern = native.kernel("ulp2_decode")
    if kern is not None and base.flags.c_contiguous:
        with contextlib.suppress(BufferError):
            st, moved = _moved(kern(*args, digest) if digest is not None else kern(*args))
    if st is None:
        st = _numba().ulp2_decode(*args)
    if st != 0:
        raise DecodeError(f"{where}: {STATUS.get(st, f'status {st}')}")
    return Patch(pos, val, None, moved)
