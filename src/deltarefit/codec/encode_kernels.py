"""Numba kernels of the ULP-context codec's encoder: the scan of a chunk for its changes (``ulp_scan``)
and the coding of those changes into a chunk payload (``ulp_encode_changes``).

Pure functions over numpy arrays that release the GIL, so chunks encode in parallel on threads. The
coder's input is the scan's output whether the scan ran here or on a GPU (``gpu.scan``), and the bytes
are the same either way; the native kernels (``_native.c``) write the same bytes too. The shared range
coder, raw bit stream and keys are in ``primitives``; the bitstream is specified in FORMAT.md
("Encoding 1: ulp").
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .primitives import MAX_UNARY, PROB_INIT, U64, _bitlen, _enc_bit, _enc_flush, _key, _put, _put_gamma


@njit(nogil=True, cache=True)
def ulp_scan(base, target, ctx_shift, ctx_mask, n_ctx, pos, ectx, rank, bvals, tvals):
    """Pass 1 of the encoder (what a GPU compare-and-compact produces instead): the changed positions
    in order, their context (the base's exponent field), their rank among the chunk's elements of the
    same context, and the base and target bits there. Fills the arrays' first m entries; returns m.
    The arrays must hold ``base.size`` entries (np.empty: untouched pages cost nothing).

    Speed hazard: the per-context counters are the loop's critical path (a store feeding the next
    load whenever neighbours share an exponent, which they mostly do). Four counter arrays, one per
    lane ``i % 4``, break that chain; a rank is the sum of the four. A group of four unchanged
    elements (the common case) takes one branch. The loop's shape matters to numba: the same logic
    written with ``range(0, n, 4)`` and an inlined helper per lane ran 7x slower."""
    n = base.size
    cs = U64(ctx_shift)
    cm = U64(ctx_mask)
    s0 = np.zeros(n_ctx, np.int32)
    s1 = np.zeros(n_ctx, np.int32)
    s2 = np.zeros(n_ctx, np.int32)
    s3 = np.zeros(n_ctx, np.int32)
    m = 0
    n4 = n - n % 4
    i = 0
    while i < n4:
        b0 = U64(base[i])
        b1 = U64(base[i + 1])
        b2 = U64(base[i + 2])
        b3 = U64(base[i + 3])
        e0 = np.int64((b0 >> cs) & cm)
        e1 = np.int64((b1 >> cs) & cm)
        e2 = np.int64((b2 >> cs) & cm)
        e3 = np.int64((b3 >> cs) & cm)
        if ((b0 != U64(target[i])) | (b1 != U64(target[i + 1])) | (b2 != U64(target[i + 2]))
                | (b3 != U64(target[i + 3]))):
            for k in range(4):
                # Each element read once here and its bits stored as read: a target changing under the
                # scan (a tensor another thread writes) must not give a change two equal values.
                bk = U64(base[i + k])
                tk = U64(target[i + k])
                ek = np.int64((bk >> cs) & cm)
                if bk != tk:
                    pos[m] = i + k
                    ectx[m] = ek
                    rank[m] = s0[ek] + s1[ek] + s2[ek] + s3[ek]
                    bvals[m] = bk
                    tvals[m] = tk
                    m += 1
                if k == 0:
                    s0[ek] += 1
                elif k == 1:
                    s1[ek] += 1
                elif k == 2:
                    s2[ek] += 1
                else:
                    s3[ek] += 1
        else:
            s0[e0] += 1
            s1[e1] += 1
            s2[e2] += 1
            s3[e3] += 1
        i += 4
    for j in range(n4, n):
        bk = U64(base[j])
        tk = U64(target[j])
        ek = np.int64((bk >> cs) & cm)
        if bk != tk:
            pos[m] = j
            ectx[m] = ek
            rank[m] = s0[ek] + s1[ek] + s2[ek] + s3[ek]
            bvals[m] = bk
            tvals[m] = tk
            m += 1
        s0[ek] += 1
    return m


@njit(nogil=True, cache=True)
def ulp_encode_changes(ectx, rank, bvals, tvals, bits, kind, n_ctx, out):
    """Code a chunk's changes (``ulp_scan``'s output, m >= 1 entries in position order; positions are
    implied by context and rank) into ``out``. Returns the byte count, or -5 if ``out`` is too small.
    The same bytes whether the scan ran here or on a GPU."""
    return ulp_encode_core(ectx, rank, bvals, tvals, bits, kind, n_ctx, np.zeros(n_ctx, np.int32), 1, 2, np.zeros(1, np.uint8), out)


@njit(nogil=True, cache=True)
def hist_scan(base, target, hist, cmap, ctx_shift, ctx_mask, n_exp, n_ctx, pos, ectx, rank, bvals, tvals, flip):
    """``ulp_scan`` with the stream's history in the context (encoding 5, FORMAT.md "Encoding 5:
    ulp_hist"): element i's context is ``cmap[(hist[i] & 127) * n_exp + exponent]``, ``hist[i] & 127``
    its history state, and ``hist[i] >> 7`` whether its sign is coded flipped (``flip``). Fills the
    arrays' first m entries; returns m."""
    n = base.size
    cs = U64(ctx_shift)
    cm = U64(ctx_mask)
    seen = np.zeros(n_ctx, np.int32)
    m = 0
    for i in range(n):
        bk = U64(base[i])
        tk = U64(target[i])  # read once (ulp_scan)
        hk = np.int64(hist[i])
        ek = np.int64(cmap[(hk & 127) * n_exp + np.int64((bk >> cs) & cm)])
        if bk != tk:
            flip[m] = hk >> 7
            pos[m] = i
            ectx[m] = ek
            rank[m] = seen[ek]
            bvals[m] = bk
            tvals[m] = tk
            m += 1
        seen[ek] += 1
    return m


@njit(nogil=True, cache=True)
def ulp_encode_core(ectx, rank, bvals, tvals, bits, kind, n_ctx, cstate, n_states, qdepth, flip, out):
    """The coder of encodings 1 and 5. Context c belongs to history state ``cstate[c]`` (all 0 for
    encoding 1): a state has its own slots for the gap quotients, and the sign of a change in a state
    other than 0 goes through the range coder in its state's slot instead of raw, XOR ``flip[j]`` (the
    direction the history predicts; ``flip`` is read only for such changes)."""
    m = ectx.size
    mask = (U64(1) << U64(bits - 1) << U64(1)) - U64(1)
    sign = U64(1) << U64(bits - 1)
    # Group the changes by context (a counting sort keeps rank order within a group).
    gcount = np.zeros(n_ctx, np.int64)
    for j in range(m):
        gcount[ectx[j]] += 1
    gstart = np.zeros(n_ctx + 1, np.int64)
    for c in range(n_ctx):
        gstart[c + 1] = gstart[c] + gcount[c]
    fill = gstart[:n_ctx].copy()
    granks = np.empty(m, np.int64)
    for j in range(m):
        c = ectx[j]
        granks[fill[c]] = rank[j]
        fill[c] += 1
    raw = np.empty(m * 20 + n_ctx * 24 + 64, np.uint8)
    st = np.array([0, 0xFFFFFFFF, 0, 1, 4], np.uint64)  # range coder: low, range, cache, cache size, out pos
    w = (U64(0), 0, 0)
    ngroups = 0
    for c in range(n_ctx):
        if gcount[c] > 0:
            ngroups += 1
    w = _put_gamma(w, raw, U64(ngroups))
    pq = np.full(qdepth * n_states, PROB_INIT, np.uint16)  # per state: "q > 0", "q > 1", ...
    psign = np.full(n_states, PROB_INIT, np.uint16)  # per state (0 unused: raw)
    prev_c = -1
    for c in range(n_ctx):
        cnt = gcount[c]
        if cnt == 0:
            continue
        w = _put_gamma(w, raw, U64(c - prev_c))
        prev_c = c
        w = _put_gamma(w, raw, U64(cnt))
        # Rice parameter: the best of the three around log2(mean gap) (the cost is convex in k).
        span = granks[gstart[c + 1] - 1] + 1 - cnt  # sum of the gaps
        k0 = _bitlen(U64(span // cnt)) - 1
        best_k = 0
        best_cost = -1
        for k in range(max(k0 - 1, 0), min(k0 + 2, 25)):
            cost = cnt * (k + 1)
            prev = -1
            for j in range(gstart[c], gstart[c + 1]):
                cost += (granks[j] - prev - 1) >> k
                prev = granks[j]
            if best_cost < 0 or cost < best_cost:
                best_cost = cost
                best_k = k
        w = _put(w, raw, U64(best_k), 5)
        q0 = qdepth * np.int64(cstate[c])
        prev = -1
        for j in range(gstart[c], gstart[c + 1]):
            gap = granks[j] - prev - 1
            prev = granks[j]
            q = gap >> best_k
            # Quotient: "q > 0" and "q > 1" through the range coder (they carry what the geometric
            # model misses), the rest of the unary code raw.
            for t in range(qdepth):
                _enc_bit(st, out, pq, q0 + t, 1 if q > t else 0)
                if q <= t:
                    break
            if q >= qdepth:
                q -= qdepth
                while q >= 32:
                    w = _put(w, raw, U64(0), 32)
                    q -= 32
                w = _put(w, raw, U64(1) << U64(q), q + 1)
            w = _put(w, raw, U64(gap), best_k)
    # Values, in position order: sign (raw: it carries a full bit) and magnitude of D = key(t) - key(b);
    # the magnitude's length is unary-coded in the base's context, its lower bits go raw.
    plen = np.full(n_ctx * MAX_UNARY, PROB_INIT, np.uint16)
    for j in range(m):
        b = U64(bvals[j])
        t = U64(tvals[j])
        e = ectx[j]
        d = (_key(t, kind, sign, mask) - _key(b, kind, sign, mask)) & mask
        neg = U64(0)
        mag = d
        if d & sign:
            neg = U64(1)
            mag = ((~d) + U64(1)) & mask
        ln = _bitlen(mag)
        for t2 in range(ln - 1):
            _enc_bit(st, out, plen, e * MAX_UNARY + t2, 1)
        if ln < bits:
            _enc_bit(st, out, plen, e * MAX_UNARY + ln - 1, 0)
        h = np.int64(cstate[e])
        if h == 0:
            w = _put(w, raw, neg | (mag << U64(1)), ln)  # sign, then the ln-1 bits below the leading one
        else:
            _enc_bit(st, out, psign, h, np.int64(neg) ^ np.int64(flip[j]))
            w = _put(w, raw, mag, ln - 1)
    end = _enc_flush((st[0], st[1], st[2], np.int64(st[3]), np.int64(st[4])), out)
    _acc, nacc, rpos = w
    if nacc > 0:
        w = _put(w, raw, U64(0), 8 - nacc)
        rpos = w[2]
    if rpos > raw.size or end + rpos > out.size:
        return -5
    rc_len = end - 4
    for k in range(4):
        out[k] = np.uint8((rc_len >> (8 * k)) & 0xFF)
    out[end:end + rpos] = raw[:rpos]
    return end + rpos
