"""Numba kernels of the ULP-context codec: a binary range coder and the chunk encode/decode loops.

Pure functions over numpy arrays; they release the GIL, so chunks run in parallel on threads.
The bitstream is specified in FORMAT.md ("Encoding 1: ulp"). All arithmetic is on uint64 with
explicit casts: numba promotes mixed int64/uint64 arithmetic to float64, which would silently lose bits.

Decoders never trust their input: every count, context id, rank and length is checked, reading past
the end of the payload is detected, and failures come back as negative status codes (see ``STATUS``).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .constants import KIND_FLOAT, KIND_INT, KIND_UINT, STATUS  # noqa: F401 - STATUS is read as K.STATUS

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
                bk = U64(base[i + k])
                ek = np.int64((bk >> cs) & cm)
                if bk != U64(target[i + k]):
                    pos[m] = i + k
                    ectx[m] = ek
                    rank[m] = s0[ek] + s1[ek] + s2[ek] + s3[ek]
                    bvals[m] = base[i + k]
                    tvals[m] = target[i + k]
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
        ek = np.int64((bk >> cs) & cm)
        if bk != U64(target[j]):
            pos[m] = j
            ectx[m] = ek
            rank[m] = s0[ek] + s1[ek] + s2[ek] + s3[ek]
            bvals[m] = base[j]
            tvals[m] = target[j]
            m += 1
        s0[ek] += 1
    return m


@njit(nogil=True, cache=True)
def ulp_encode_changes(ectx, rank, bvals, tvals, bits, kind, n_ctx, out):
    """Code a chunk's changes (``ulp_scan``'s output, m >= 1 entries in position order; positions are
    implied by context and rank) into ``out``. Returns the byte count, or -5 if ``out`` is too small.
    The same bytes whether the scan ran here or on a GPU."""
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
    pq = np.full(2, PROB_INIT, np.uint16)  # slots for "q > 0" and "q > 1"
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
        prev = -1
        for j in range(gstart[c], gstart[c + 1]):
            gap = granks[j] - prev - 1
            prev = granks[j]
            q = gap >> best_k
            # Quotient: "q > 0" and "q > 1" through the range coder (they carry what the geometric
            # model misses), the rest of the unary code raw.
            _enc_bit(st, out, pq, 0, 1 if q > 0 else 0)
            if q > 0:
                _enc_bit(st, out, pq, 1, 1 if q > 1 else 0)
                if q > 1:
                    q -= 2
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
        w = _put(w, raw, neg | (mag << U64(1)), ln)  # sign, then the ln-1 bits below the leading one
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


@njit(nogil=True, cache=True)
def ulp_decode_groups(payload, n_changed, n, n_ctx, gbeg, gend, granks, gctx):
    """Decoder, part 1 (needs no base): the group section. Fills ``granks``/``gctx`` (each change's
    rank and context, grouped by context, ascending ranks within a group) and ``gbeg``/``gend`` (each
    context's slice of them). Returns (status, state): the state resumes the streams for part 3."""
    bad_state = (U64(0), U64(0), 0, 0, U64(0), 0, 0, 0, 0)
    if n_changed <= 0 or n_changed > n:
        return -4, bad_state
    if payload.size < 9:
        return -1, bad_state
    rc_len = 0
    for k in range(4):
        rc_len |= np.int64(payload[k]) << (8 * k)
    rc_end = 4 + rc_len
    if rc_len < 5 or rc_end > payload.size:
        return -1, bad_state
    code = U64(0)
    for k in range(5):
        code = ((code << U64(8)) | U64(payload[4 + k])) & U64(0xFFFFFFFF)
    s = (code, U64(0xFFFFFFFF), 9, 0)
    lim = payload.size
    r = (U64(0), 0, rc_end, 0)
    g, r = _get_gamma(r, payload, lim, 40)
    ngroups = np.int64(g)
    if ngroups <= 0 or ngroups > n_ctx:
        return -2, bad_state
    pq = np.full(2, PROB_INIT, np.uint16)  # slots for "q > 0" and "q > 1"
    c = -1
    total = 0
    for _ in range(ngroups):
        g, r = _get_gamma(r, payload, lim, 40)
        dc = np.int64(g)
        if dc <= 0 or c + dc >= n_ctx:
            return -2, bad_state
        c += dc
        g, r = _get_gamma(r, payload, lim, 40)
        cnt = np.int64(g)
        if cnt <= 0:
            return -2, bad_state
        if total + cnt > n_changed:
            return -4, bad_state
        g, r = _get(r, payload, lim, 5)
        k = np.int64(g)
        if k > 24:
            return -2, bad_state
        gbeg[c] = total
        prev = -1
        for j in range(cnt):
            q = 0
            bit, s = _dec_bit(s, payload, rc_end, pq, 0)
            if bit == 1:
                bit, s = _dec_bit(s, payload, rc_end, pq, 1)
                q = 1
                if bit == 1:
                    q = 2
                    while True:
                        b1, r = _get(r, payload, lim, 1)
                        if b1 == U64(1) or r[3] != 0:
                            break
                        q += 1
                        if (q << k) >= n:
                            return -3, bad_state
            g, r = _get(r, payload, lim, k)
            rk = prev + 1 + ((q << k) | np.int64(g))
            if rk >= n:
                return -3, bad_state
            granks[total + j] = rk
            gctx[total + j] = c
            prev = rk
        total += cnt
        gend[c] = total
        if s[3] != 0 or r[3] != 0:
            return -1, bad_state
    if total != n_changed:
        return -4, bad_state
    return 0, (s[0], s[1], s[2], s[3], r[0], r[1], r[2], r[3], rc_end)


@njit(nogil=True, cache=True)
def ulp_positions(base, ctx_shift, ctx_mask, n_ctx, gbeg, gend, granks, n_changed, out_pos, out_ctx):
    """Decoder, part 2 (on the host; a device does it with a sort): the position of each change, in
    position order, and its context. Returns 0, or -3 if a rank lies beyond its context's elements."""
    cs = U64(ctx_shift)
    cm = U64(ctx_mask)
    # The r-th element of context e is the next change of group e. Each context counts down to its
    # next change (never reaching zero again once its group is exhausted).
    left = np.full(n_ctx, -1, np.int64)
    ptr = gbeg.copy()
    for e in range(n_ctx):
        if gend[e] > gbeg[e]:
            left[e] = granks[gbeg[e]] + 1
    o = 0
    for i in range(base.size):
        e = np.int64((U64(base[i]) >> cs) & cm)
        c = left[e] - 1
        left[e] = c
        if c == 0:
            out_pos[o] = i
            out_ctx[o] = e
            o += 1
            p = ptr[e] + 1
            ptr[e] = p
            if p < gend[e]:
                left[e] = granks[p] - granks[p - 1]
    return 0 if o == n_changed else -3


@njit(nogil=True, cache=True)
def ulp_decode_deltas(payload, state, ectx, bits, n_ctx, out_neg, out_mag):
    """Decoder, part 3 (needs no base): each change's signed ulp distance, in position order, given
    its context (``ectx``). Checks that both streams end exactly. Returns 0 or a negative status."""
    code, rng, spos, sbad, acc, nacc, rpos, rbad, rc_end = state
    # Explicit types: a state that went through Python comes back as plain ints (all below 2**40).
    s = (U64(code), U64(rng), np.int64(spos), np.int64(sbad))
    r = (U64(acc), np.int64(nacc), np.int64(rpos), np.int64(rbad))
    rc_end = np.int64(rc_end)
    lim = payload.size
    plen = np.full(n_ctx * MAX_UNARY, PROB_INIT, np.uint16)
    for j in range(ectx.size):
        e = np.int64(ectx[j])
        ln = 1
        while ln < bits:
            bit, s = _dec_bit(s, payload, rc_end, plen, e * MAX_UNARY + ln - 1)
            if bit == 0:
                break
            ln += 1
        v, r = _get(r, payload, lim, ln)
        out_neg[j] = np.uint8(v & U64(1))
        out_mag[j] = (U64(1) << U64(ln - 1)) | (v >> U64(1))
    if s[3] != 0 or r[3] != 0:
        return -1
    # Both streams must be consumed exactly: the range decoder's reads end at its part's end, and
    # the raw stream holds no whole unread byte (padding bits are zero).
    if s[2] != rc_end or r[2] != lim or (r[0] != U64(0)):
        return -6
    return 0


@njit(nogil=True, cache=True)
def ulp_apply_deltas(base, pos, neg, mag, bits, kind, out_val):
    """Decoder, part 4: target bits = unkey(key(base) +- magnitude) at each position."""
    mask = (U64(1) << U64(bits - 1) << U64(1)) - U64(1)
    sign = U64(1) << U64(bits - 1)
    for j in range(pos.size):
        kb = _key(U64(base[pos[j]]), kind, sign, mask)
        kt = ((kb - mag[j]) if neg[j] else (kb + mag[j])) & mask
        out_val[j] = _unkey(kt, kind, sign, mask)


@njit(nogil=True, cache=True)
def ulp_decode(base, payload, n_changed, bits, kind, ctx_shift, ctx_mask, n_ctx, out_pos, out_val):
    """Decode one chunk into sorted positions and target values. Returns 0 or a negative status."""
    n = base.size
    if n_changed <= 0 or n_changed > n or out_pos.size < n_changed or out_val.size < n_changed:
        return -4
    gbeg = np.zeros(n_ctx, np.int64)
    gend = np.zeros(n_ctx, np.int64)
    granks = np.empty(n_changed, np.int64)
    gctx = np.empty(n_changed, np.int32)
    st, state = ulp_decode_groups(payload, n_changed, n, n_ctx, gbeg, gend, granks, gctx)
    if st:
        return st
    ectx = np.empty(n_changed, np.int32)
    st = ulp_positions(base, ctx_shift, ctx_mask, n_ctx, gbeg, gend, granks, n_changed, out_pos, ectx)
    if st:
        return st
    neg = np.empty(n_changed, np.uint8)
    mag = np.empty(n_changed, np.uint64)
    st = ulp_decode_deltas(payload, state, ectx, bits, n_ctx, neg, mag)
    if st:
        return st
    ulp_apply_deltas(base, out_pos[:n_changed], neg, mag, bits, kind, out_val)
    return 0


@njit(nogil=True, cache=True)
def scatter(dst, pos, val):
    """dst[pos[j]] = val[j]. Positions must already be validated."""
    for j in range(pos.size):
        dst[pos[j]] = val[j]
