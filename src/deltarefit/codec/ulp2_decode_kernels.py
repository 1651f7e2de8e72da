"""Numba decoder of format 2's ulp class (encodings 6 ``ulp2`` and 7 ``ulp2_hist``, FORMAT.md "Format
version 2"): the plain scalar loop over the spec's steps, in the spec's order, the reference every other
decoder (C with SIMD, Triton) is held to.

It trusts nothing: every read of the payload is bounds-checked (past its end: status -1), every table
entry range-checked (-8), lane states checked on entry (-9) and at the end (-10), the position count
checked against the record (-4), unread bytes refused (-6). Each base element is read once (its bits
are kept in ``val_out`` until its value is decoded) and each change's context is kept, so a base that
changes while it runs cannot send an index out of bounds. Status codes: ``codec.constants.STATUS``.

Hazard: numba's on-disk cache of ``ulp2_decode`` is invalidated by changes to this file only; it inlines
``variant_params`` from ``ulp2_encode_kernels`` and ``_key``/``_unkey`` from ``primitives``. After editing
those, touch this file (see ``primitives``).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .constants import KIND_FLOAT
from .primitives import U64, _key, _unkey
from .ulp2_encode_kernels import N_HIST_STATES, variant_params

TRUNCATED = -1
COUNT = -4
SMALL = -5
TRAILING = -6
VARIANT = -7
TABLE = -8
STATE = -9
END = -10


@njit(inline="always")
def _get_varint(buf, o):
    """(value, next offset, status): unsigned LEB128 of at most 5 bytes, below 2^32, minimal."""
    v = 0
    for q in range(5):
        if o >= buf.size:
            return 0, o, TRUNCATED
        b = np.int64(buf[o])
        o += 1
        v |= (b & 0x7F) << (7 * q)
        if b < 0x80:
            if q > 0 and b == 0:
                return 0, o, TABLE  # non-minimal
            if v >= 1 << 32:
                return 0, o, TABLE
            return v, o, 0
    return 0, o, TABLE  # longer than 5 bytes


@njit(inline="always")
def _get_uint(buf, o, nbytes):
    """(value, next offset); the caller checked ``o + nbytes <= buf.size``."""
    v = np.int64(buf[o])
    if nbytes == 2:
        v |= np.int64(buf[o + 1]) << 8
    elif nbytes == 4:
        v |= (np.int64(buf[o + 1]) << 8) | (np.int64(buf[o + 2]) << 16) | (np.int64(buf[o + 3]) << 24)
    return v, o + nbytes


@njit(inline="always")
def _renorm(x, L, R, UB, buf, o):
    """Read one unit into a lane below L. (x, o, status)."""
    if x < L:
        if o + UB > buf.size:
            return x, o, TRUNCATED
        u, o = _get_uint(buf, o, UB)
        x = (x << R) | u
    return x, o, 0


@njit(nogil=True, cache=True)
def ulp2_decode(base, states, payload, n_changed, bits, kind, shift, mask, n_exp, hist, pos_out, val_out):
    """Decode an encoding 6 (``hist`` 0) or 7 (``hist`` 1; ``payload`` without the history id) payload
    against ``base`` (and the history ``states``, uint8 per element, for ``hist`` 1). Writes the
    changes' positions (ascending) to ``pos_out[:n_changed]`` and their target bits to
    ``val_out[:n_changed]``. Returns 0 or a negative status (``codec.constants.STATUS``)."""
    n = base.size
    m = n_changed
    if m < 0 or pos_out.size < m or val_out.size < m or (hist != 0 and states.size < n):
        return SMALL
    if n_exp < 1 or bits < 8 or bits > 64:
        return TABLE
    size = payload.size
    if size < 1:
        return TRUNCATED
    variant = np.int64(payload[0])
    M, R, W, L, SB, UB = variant_params(variant)
    if W == 0:
        return VARIANT
    PB = 1 if variant == 0 else 2
    one = 1 << M
    slot_mask = one - 1
    nctx = n_exp * (N_HIST_STATES if hist != 0 else 1)
    o = 1
    # Position table.
    G, o, st = _get_varint(payload, o)
    if st != 0:
        return st
    if G < 1 or nctx < G:
        return TABLE
    prob = np.zeros(nctx, np.int64)
    gidx = np.full(nctx, -1, np.int64)
    gctx = np.empty(G, np.int64)
    prev = -1
    for g in range(G):
        gap, o, st = _get_varint(payload, o)
        if st != 0:
            return st
        c = prev + 1 + gap
        if c >= nctx:
            return TABLE
        if o + PB > size:
            return TRUNCATED
        p, o = _get_uint(payload, o, PB)
        if p < 1 or p > one - 1:
            return TABLE
        prob[c] = p
        gidx[c] = g
        gctx[g] = c
        prev = c
    # Value tables: cumulative frequencies cum[g, 0..K].
    kmax = np.empty(G, np.int64)
    cum = np.zeros((G, bits + 1), np.int64)
    for g in range(G):
        if o >= size:
            return TRUNCATED
        K = np.int64(payload[o])
        o += 1
        if K < 1 or bits < K:
            return TABLE
        kmax[g] = K
        if o + PB * (K - 1) > size:
            return TRUNCATED
        for k in range(1, K):
            f, o = _get_uint(payload, o, PB)
            cum[g, k] = cum[g, k - 1] + f
        if cum[g, K - 1] >= one:
            return TABLE
        cum[g, K] = one
    sign_p = np.full(N_HIST_STATES, one >> 1, np.int64)
    if hist != 0:
        if o + PB * (N_HIST_STATES - 1) > size:
            return TRUNCATED
        for t in range(1, N_HIST_STATES):
            p, o = _get_uint(payload, o, PB)
            if p < 1 or p > one - 1:
                return TABLE
            sign_p[t] = p
    # Lane states.
    if o + W * SB > size:
        return TRUNCATED
    xs = np.empty(W, np.int64)
    for lane in range(W):
        x, o = _get_uint(payload, o, SB)
        if x < L or x >= L << R:
            return STATE
        xs[lane] = x
    sign = U64(1) << U64(bits - 1)
    full = (sign - U64(1)) | sign
    umask = U64(mask)
    ushift = U64(shift)
    # 1. Positions: val_out holds each change's base bits, cctx its context, until its value is decoded.
    cctx = np.empty(m, np.int64)
    cflip = np.zeros(m, np.int64)
    j = 0
    ns = (n + W - 1) // W
    for s in range(ns):
        for lane in range(W):
            i = s * W + lane
            if i >= n:
                break
            b = U64(base[i])
            x = np.int64((b >> ushift) & umask) if kind == KIND_FLOAT else np.int64(0)
            t = 0
            fl = 0
            if hist != 0:
                sb = np.int64(states[i])
                t = sb & 127
                fl = sb >> 7
                if t >= N_HIST_STATES:
                    return TABLE
            if x >= n_exp:
                return TABLE
            c = t * n_exp + x
            p = prob[c]
            if p == 0:
                continue
            xl = xs[lane]
            slot = xl & slot_mask
            if slot < p:
                xl = p * (xl >> M) + slot
                hit = True
            else:
                xl = (one - p) * (xl >> M) + slot - p
                hit = False
            xl, o, st = _renorm(xl, L, R, UB, payload, o)
            if st != 0:
                return st
            xs[lane] = xl
            if hit:
                if j >= m:
                    return COUNT
                pos_out[j] = i
                val_out[j] = b
                cctx[j] = c
                cflip[j] = fl if t != 0 else 0
                j += 1
    if j != m or m == 0:
        return COUNT
    # 2. Values, W changes at a time: lengths, signs, then the mantissa bits M at a time.
    klen = np.empty(W, np.int64)
    neg = np.empty(W, np.int64)
    mant = np.empty(W, np.uint64)
    done = np.empty(W, np.int64)
    ng = (m + W - 1) // W
    for g in range(ng):
        j0 = g * W
        j1 = min(m, j0 + W)
        for jj in range(j0, j1):
            lane = jj - j0
            g2 = gidx[cctx[jj]]
            xl = xs[lane]
            slot = xl & slot_mask
            k = 1
            while cum[g2, k] <= slot:
                k += 1
            lo_c = cum[g2, k - 1]
            xl = (cum[g2, k] - lo_c) * (xl >> M) + slot - lo_c
            xl, o, st = _renorm(xl, L, R, UB, payload, o)
            if st != 0:
                return st
            xs[lane] = xl
            klen[lane] = k
        for jj in range(j0, j1):
            lane = jj - j0
            t = cctx[jj] // n_exp
            q = sign_p[t] if hist != 0 else one >> 1
            xl = xs[lane]
            slot = xl & slot_mask
            if slot < q:
                xl = q * (xl >> M) + slot
                bit = 1
            else:
                xl = (one - q) * (xl >> M) + slot - q
                bit = 0
            xl, o, st = _renorm(xl, L, R, UB, payload, o)
            if st != 0:
                return st
            xs[lane] = xl
            neg[lane] = bit ^ cflip[jj]
            mant[lane] = U64(0)
            done[lane] = 0
        more = True
        while more:
            more = False
            for jj in range(j0, j1):
                lane = jj - j0
                left = klen[lane] - 1 - done[lane]
                if left <= 0:
                    continue
                nb = min(M, left)
                xl = xs[lane]
                slot = xl & slot_mask
                f = np.int64(1) << (M - nb)
                v = slot >> (M - nb)
                xl = f * (xl >> M) + (slot & (f - 1))
                xl, o, st = _renorm(xl, L, R, UB, payload, o)
                if st != 0:
                    return st
                xs[lane] = xl
                mant[lane] |= U64(v) << U64(done[lane])
                done[lane] += nb
                if left > nb:
                    more = True
        for jj in range(j0, j1):
            lane = jj - j0
            a = (U64(1) << U64(klen[lane] - 1)) + mant[lane]
            d = ((U64(0) - a) & full) if neg[lane] else (a & full)
            kb = _key(U64(val_out[jj]), kind, sign, full)
            val_out[jj] = _unkey((kb + d) & full, kind, sign, full)
    # 3. End: every lane back at L, every byte read.
    for lane in range(W):
        if xs[lane] != L:
            return END
    if o != size:
        return TRAILING
    return 0
