"""Numba primitives both directions of the ULP-context codec share: the binary range coder, the raw
bit stream, and the keys. ``encode_kernels`` and ``decode_kernels`` inline them into their loops.

All are ``inline="always"`` helpers over scalars and numpy arrays, never called from Python. All
arithmetic is on uint64 with explicit casts: numba promotes mixed int64/uint64 arithmetic to float64,
which would silently lose bits. The bitstream they write and read is specified in FORMAT.md
("Encoding 1: ulp").

Hazard: numba's on-disk cache of the kernels that inline these (``cache=True``) is invalidated only
by changes to the kernel's own file, and it keeps this module's constants as compiled. After editing
this file, touch ``encode_kernels.py`` and ``decode_kernels.py`` (or remove their ``__pycache__``
entries), or the cached kernels keep the old code.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .constants import KIND_FLOAT, KIND_INT

U64 = np.uint64
PROB_BITS = 11
PROB_INIT = 1 << (PROB_BITS - 1)
MOVE_BITS = 5
TOP = 1 << 24
MAX_UNARY = 64  # adaptive slots for unary codes (gap quotients, magnitude lengths)


# ---------------------------------------------------------------------------------------------
# Range coder (LZMA style: 11-bit adaptive probabilities, carry propagation through a cache byte).
# Encoder state is a tuple (low, range, cache, cache_size, out_pos); decoder state (code, range,
# in_pos, overrun). Tuples of scalars stay in registers; state arrays did not (2x slower).
# Only bits worth modelling go through it (unary codes); equiprobable bits go to a raw bit stream.
# ---------------------------------------------------------------------------------------------


@njit(inline="always")
def _shift_low(low, cache, csize, opos, out):
    if low < U64(0xFF000000) or low >= U64(1 << 32):
        carry = low >> U64(32)
        temp = cache
        while True:
            if opos < out.size:
                out[opos] = np.uint8((temp + carry) & U64(0xFF))
            opos += 1
            temp = U64(0xFF)
            csize -= 1
            if csize == 0:
                break
        cache = (low >> U64(24)) & U64(0xFF)
    csize += 1
    low = (low & U64(0x00FFFFFF)) << U64(8)
    return low, cache, csize, opos


@njit(inline="always")
def _enc_bit(st, out, probs, idx, bit):
    """Code one bit. The encoder's state lives in ``st`` (uint64[5]: low, range, cache, cache size,
    output position), updated in place: as a tuple returned through the coding loops, numba kept it
    in memory and every coded bit cost 4.5x more (measured; the bytes are the same)."""
    low = st[0]
    rng = st[1]
    p = U64(probs[idx])
    bound = (rng >> U64(PROB_BITS)) * p
    if bit == 0:
        rng = bound
        probs[idx] = np.uint16(p + ((U64(1 << PROB_BITS) - p) >> U64(MOVE_BITS)))
    else:
        low += bound
        rng -= bound
        probs[idx] = np.uint16(p - (p >> U64(MOVE_BITS)))
    while rng < U64(TOP):
        rng = (rng << U64(8)) & U64(0xFFFFFFFF)
        cache = st[2]
        csize = st[3]
        opos = st[4]
        if low < U64(0xFF000000) or low >= U64(1 << 32):  # _shift_low, written out (see above)
            carry = low >> U64(32)
            temp = cache
            while True:
                if opos < U64(out.size):
                    out[opos] = np.uint8((temp + carry) & U64(0xFF))
                opos += U64(1)
                temp = U64(0xFF)
                csize -= U64(1)
                if csize == U64(0):
                    break
            cache = (low >> U64(24)) & U64(0xFF)
        st[2] = cache
        st[3] = csize + U64(1)
        st[4] = opos
        low = (low & U64(0x00FFFFFF)) << U64(8)
    st[0] = low
    st[1] = rng


@njit(inline="always")
def _enc_flush(s, out):
    low, _rng, cache, csize, opos = s
    for _ in range(5):
        low, cache, csize, opos = _shift_low(low, cache, csize, opos, out)
    return opos


@njit(inline="always")
def _dec_byte(buf, pos, lim):
    if pos < lim:
        return U64(buf[pos]), 0
    return U64(0), 1


@njit(inline="always")
def _dec_bit(s, buf, lim, probs, idx):
    code, rng, pos, bad = s
    p = U64(probs[idx])
    bound = (rng >> U64(PROB_BITS)) * p
    if code < bound:
        rng = bound
        probs[idx] = np.uint16(p + ((U64(1 << PROB_BITS) - p) >> U64(MOVE_BITS)))
        bit = 0
    else:
        code -= bound
        rng -= bound
        probs[idx] = np.uint16(p - (p >> U64(MOVE_BITS)))
        bit = 1
    while rng < U64(TOP):
        rng = (rng << U64(8)) & U64(0xFFFFFFFF)
        v, o = _dec_byte(buf, pos, lim)
        pos += 1
        bad |= o
        code = ((code << U64(8)) | v) & U64(0xFFFFFFFF)
    return bit, (code, rng, pos, bad)


# Raw bit stream, LSB first: writer state (acc, nacc, pos), reader state (acc, nacc, pos, bad).


@njit(inline="always")
def _put(w, out, value, nbits):
    acc, nacc, pos = w
    while nbits > 0:
        nb = min(nbits, 32)
        acc |= (value & ((U64(1) << U64(nb)) - U64(1))) << U64(nacc)
        value >>= U64(nb)
        nbits -= nb
        nacc += nb
        while nacc >= 8:
            if pos < out.size:
                out[pos] = np.uint8(acc & U64(0xFF))
            pos += 1
            acc >>= U64(8)
            nacc -= 8
    return (acc, nacc, pos)


@njit(inline="always")
def _put_gamma(w, out, x):
    # Elias gamma of x >= 1: (len-1) zeros, a one, then the len-1 bits below the leading one.
    nb = _bitlen(x)
    w = _put(w, out, U64(1) << U64(nb - 1), nb)
    return _put(w, out, x, nb - 1)


@njit(inline="always")
def _get(r, buf, lim, nbits):
    acc, nacc, pos, bad = r
    v = U64(0)
    shift = 0
    while nbits > 0:
        nb = min(nbits, 32)
        while nacc < nb:
            if pos < lim:
                acc |= U64(buf[pos]) << U64(nacc)
            else:
                bad = 1
            pos += 1
            nacc += 8
        v |= (acc & ((U64(1) << U64(nb)) - U64(1))) << U64(shift)
        acc >>= U64(nb)
        nacc -= nb
        shift += nb
        nbits -= nb
    return v, (acc, nacc, pos, bad)


@njit(inline="always")
def _get_gamma(r, buf, lim, max_bits):
    # Returns 0 for a malformed code (gamma values are >= 1).
    nz = 0
    while True:
        b, r = _get(r, buf, lim, 1)
        if b == U64(1):
            break
        nz += 1
        if nz >= max_bits or r[3] != 0:
            return U64(0), r
    rest, r = _get(r, buf, lim, nz)
    return (U64(1) << U64(nz)) | rest, r


@njit(inline="always")
def _bitlen(x):
    n = 0
    while x > U64(0):
        n += 1
        x >>= U64(1)
    return n


# ---------------------------------------------------------------------------------------------
# Keys: a monotone bijection from bit patterns to unsigned integers, so D = key(t) - key(b) is the
# signed distance in ulps for floats (-0.0 and +0.0 are one apart; NaN payloads keep their bits).
# ---------------------------------------------------------------------------------------------


@njit(inline="always")
def _key(u, kind, sign, mask):
    if kind == KIND_FLOAT:
        # Negative: mask - u (= u ^ mask); positive: u | sign (= u ^ sign). Branch-free: weights' signs
        # are coin flips, and the branch cost the encoder about 15% (same keys).
        m = U64(0) - U64((u & sign) != U64(0))
        return u ^ (sign | (m & mask))
    if kind == KIND_INT:
        return u ^ sign
    return u


@njit(inline="always")
def _unkey(k, kind, sign, mask):
    if kind == KIND_FLOAT:
        if k & sign:
            return k ^ sign
        return mask - k
    if kind == KIND_INT:
        return k ^ sign
    return k
