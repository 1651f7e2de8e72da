"""Numba encoder of format 2's ulp class (encodings 6 ``ulp2`` and 7 ``ulp2_hist``, FORMAT.md "Format
version 2"): interleaved rANS lanes over static per-chunk tables.

``ulp2_encode`` is the reference every other encoder (the C one in ``_ulp2.c``, the device path) is held
to byte for byte. It reads each base and target element once, into its own arrays (contexts, the
changes' distances), and codes from those only: a buffer another thread writes while it runs gives a
wrong payload (which the chunk's post hash refuses), never an access out of bounds or a zero frequency.

The coding runs the decoder's steps in exact reverse order (the last step first, its lanes from W - 1
down to 0), each lane starting at L; the units it emits are written from the end of ``out`` backwards
(so they lie in reading order) and moved behind the header and the lane states at the end.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .constants import KIND_FLOAT
from .primitives import U64, _bitlen, _key

N_HIST_STATES = 7  # codec.history.N_STATES (the states 0..6 of encoding 5's history bytes)


@njit(inline="always")
def variant_params(variant):
    """(M probability bits, R unit bits, W lanes, L lower bound, state bytes, unit bytes) of a coder
    variant; W = 0 for an unknown one."""
    if variant == 0:
        return 8, 8, 32, 256, 2, 1
    if variant == 1:
        return 12, 16, 16, 65536, 4, 2
    return 0, 0, 0, 0, 0, 0


@njit(inline="always")
def _put_sym(x, c, f, M, R, L, UB, out, e, lo):
    """Encode the symbol [c, c + f) into lane state ``x``; an emitted unit goes to ``out[e - UB:e]``.
    Returns (x, e); e = -1 when the units would run into the header (``lo``)."""
    if x >= ((L >> M) << R) * f:
        u = x & ((1 << R) - 1)
        e -= UB
        if e < lo:
            return x, -1
        out[e] = np.uint8(u & 0xFF)
        if UB == 2:
            out[e + 1] = np.uint8(u >> 8)
        x >>= R
    return ((x // f) << M) + (x % f) + c, e


@njit(inline="always")
def _put_varint(out, o, v):
    while v >= 0x80:
        out[o] = np.uint8((v & 0x7F) | 0x80)
        o += 1
        v >>= 7
    out[o] = np.uint8(v)
    return o + 1


@njit(inline="always")
def _put_uint(out, o, v, nbytes):
    out[o] = np.uint8(v & 0xFF)
    if nbytes == 2:
        out[o + 1] = np.uint8((v >> 8) & 0xFF)
    return o + nbytes


@njit(nogil=True, cache=True)
def ulp2_encode(base, target, states, bits, kind, shift, mask, n_exp, hist, variant, pos, out):
    """Code a chunk as encoding 6 (``hist`` 0) or 7 (``hist`` 1, without the 16-byte history id) in coder
    ``variant``. Returns (m changed elements, payload bytes written to ``out``); bytes = 0 where m = 0,
    -1 where the variant cannot code the chunk (a value table does not normalize), ``out`` is too small,
    or an argument is out of range (lengths, a history state above 6, an exponent past ``n_exp``).
    ``pos`` (int32, >= n) is scratch: it holds the changed positions, ascending, on return."""
    n = base.size
    M, R, W, L, SB, UB = variant_params(variant)
    if W == 0 or target.size != n or pos.size < n or (hist != 0 and states.size < n) or n_exp < 1:
        return 0, -1
    if bits < 8 or bits > 64:
        return 0, -1
    one = 1 << M
    nctx = n_exp * (N_HIST_STATES if hist != 0 else 1)
    sign = U64(1) << U64(bits - 1)
    full = (sign - U64(1)) | sign
    umask = U64(mask)
    ushift = U64(shift)
    # 1. One read of every element: its context, and each change's distance and flip.
    ctx = np.empty(n, np.uint16)
    dist = np.empty(n, np.uint64)
    flip = np.zeros(n, np.uint8)
    ne = np.zeros(nctx, np.int64)
    ce = np.zeros(nctx, np.int64)
    m = 0
    for i in range(n):
        b = U64(base[i])
        t = U64(target[i])
        x = np.int64((b >> ushift) & umask) if kind == KIND_FLOAT else np.int64(0)
        st = 0
        fl = 0
        if hist != 0:
            sb = np.int64(states[i])
            st = sb & 127
            fl = sb >> 7
            if st >= N_HIST_STATES:
                return 0, -1
        if x >= n_exp:
            return 0, -1
        c = st * n_exp + x
        ctx[i] = c
        ne[c] += 1
        if b != t:
            pos[m] = i
            dist[m] = (_key(t, kind, sign, full) - _key(b, kind, sign, full)) & full
            flip[m] = fl if st != 0 else 0
            ce[c] += 1
            m += 1
    if m == 0:
        return 0, 0
    # 2. Tables from the exact counts (FORMAT.md, "The encoder").
    gidx = np.full(nctx, -1, np.int64)
    G = 0
    for c in range(nctx):
        if ce[c] > 0:
            gidx[c] = G
            G += 1
    gctx = np.empty(G, np.int64)
    prob = np.zeros(nctx, np.int64)
    for c in range(nctx):
        if ce[c] > 0:
            gctx[gidx[c]] = c
            p = (2 * ce[c] * one + ne[c]) // (2 * ne[c])
            prob[c] = min(max(p, 1), one - 1)
    klen = np.empty(m, np.int64)
    neg = np.empty(m, np.int64)
    mag = np.empty(m, np.uint64)
    cnt = np.zeros((G, bits + 1), np.int64)
    sc = np.zeros(N_HIST_STATES, np.int64)
    sc1 = np.zeros(N_HIST_STATES, np.int64)
    for j in range(m):
        d = dist[j]
        s = 1 if d & sign else 0
        a = ((U64(0) - d) & full) if s else d
        k = _bitlen(a)
        klen[j] = k
        neg[j] = s
        mag[j] = a
        c = np.int64(ctx[pos[j]])
        cnt[gidx[c], k] += 1
        t = c // n_exp
        sc[t] += 1
        sc1[t] += s ^ np.int64(flip[j])
    kmax = np.zeros(G, np.int64)
    cum = np.zeros((G, bits + 1), np.int64)
    for g in range(G):
        tot = 0
        best = 1
        for k in range(1, bits + 1):
            tot += cnt[g, k]
            if cnt[g, k] > 0:
                kmax[g] = k
            if cnt[g, k] > cnt[g, best]:
                best = k
        fs = np.zeros(bits + 1, np.int64)
        fsum = 0
        for k in range(1, bits + 1):
            if cnt[g, k] > 0:
                fs[k] = max(1, (cnt[g, k] * one) // tot)
                fsum += fs[k]
        fs[best] += one - fsum
        if fs[best] < 1:
            return m, -1
        for k in range(1, bits + 1):
            cum[g, k] = cum[g, k - 1] + fs[k]
    sign_p = np.full(N_HIST_STATES, one >> 1, np.int64)
    if hist != 0:
        for t in range(1, N_HIST_STATES):
            if sc[t] > 0:
                sign_p[t] = min(max((2 * sc1[t] * one + sc[t]) // (2 * sc[t]), 1), one - 1)
    # 3. Header: variant, position table, value tables, sign probabilities; lane states reserved.
    PB = 1 if variant == 0 else 2
    need = 1 + 5 + G * (5 + PB) + G * (1 + PB * (bits - 1)) + 6 * PB + W * SB
    if out.size < need:
        return m, -1
    o = 0
    out[o] = np.uint8(variant)
    o += 1
    o = _put_varint(out, o, G)
    prev = -1
    for g in range(G):
        c = gctx[g]
        o = _put_varint(out, o, c - prev - 1)
        o = _put_uint(out, o, prob[c], PB)
        prev = c
    for g in range(G):
        out[o] = np.uint8(kmax[g])
        o += 1
        for k in range(1, kmax[g]):
            o = _put_uint(out, o, cum[g, k] - cum[g, k - 1], PB)
    if hist != 0:
        for t in range(1, N_HIST_STATES):
            o = _put_uint(out, o, sign_p[t], PB)
    st_off = o
    lo = o + W * SB
    # 4. The steps in reverse: values (last group first), then positions (last step first).
    xs = np.full(W, L, np.int64)
    e = out.size
    ng = (m + W - 1) // W
    for g in range(ng - 1, -1, -1):
        j0 = g * W
        j1 = min(m, j0 + W)
        rounds = 0
        for j in range(j0, j1):
            rounds = max(rounds, (klen[j] - 1 + M - 1) // M)
        for r in range(rounds, 0, -1):
            for j in range(j1 - 1, j0 - 1, -1):
                left = klen[j] - 1 - (r - 1) * M
                if left > 0:
                    nb = min(M, left)
                    v = np.int64((mag[j] >> U64((r - 1) * M)) & U64((1 << nb) - 1))
                    xs[j - j0], e = _put_sym(xs[j - j0], v << (M - nb), np.int64(1) << (M - nb), M, R, L, UB, out, e, lo)
                    if e < 0:
                        return m, -1
        for j in range(j1 - 1, j0 - 1, -1):
            c = np.int64(ctx[pos[j]])
            t = c // n_exp
            bit = neg[j]
            q = one >> 1
            if hist != 0 and t != 0:
                bit ^= np.int64(flip[j])
                q = sign_p[t]
            if bit:
                xs[j - j0], e = _put_sym(xs[j - j0], 0, q, M, R, L, UB, out, e, lo)
            else:
                xs[j - j0], e = _put_sym(xs[j - j0], q, one - q, M, R, L, UB, out, e, lo)
            if e < 0:
                return m, -1
        for j in range(j1 - 1, j0 - 1, -1):
            g2 = gidx[np.int64(ctx[pos[j]])]
            k = klen[j]
            xs[j - j0], e = _put_sym(xs[j - j0], cum[g2, k - 1], cum[g2, k] - cum[g2, k - 1], M, R, L, UB, out, e, lo)
            if e < 0:
                return m, -1
    jp = m - 1
    ns = (n + W - 1) // W
    for s in range(ns - 1, -1, -1):
        for lane in range(W - 1, -1, -1):
            i = s * W + lane
            if i >= n:
                continue
            p = prob[np.int64(ctx[i])]
            if p == 0:
                continue
            if jp >= 0 and pos[jp] == i:
                jp -= 1
                xs[lane], e = _put_sym(xs[lane], 0, p, M, R, L, UB, out, e, lo)
            else:
                xs[lane], e = _put_sym(xs[lane], p, one - p, M, R, L, UB, out, e, lo)
            if e < 0:
                return m, -1
    for lane in range(W):
        x = xs[lane]
        for b in range(SB):
            out[st_off + lane * SB + b] = np.uint8((x >> (8 * b)) & 0xFF)
    slen = out.size - e
    for q in range(slen):  # forward copy: the destination lies below the source
        out[lo + q] = out[e + q]
    return m, lo + slen
