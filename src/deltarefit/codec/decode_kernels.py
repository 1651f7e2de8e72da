"""Numba kernels of the ULP-context codec's decoder: a chunk payload back into sorted positions and
target bits (``ulp_decode``, or its four parts one at a time), and ``scatter`` of the result.

Decoders never trust their input: every count, context id, rank and length is checked, reading past
the end of the payload is detected, and failures come back as negative status codes (see
``constants.STATUS``). Pure functions over numpy arrays that release the GIL. The shared range coder,
raw bit stream and keys are in ``primitives``; the bitstream is specified in FORMAT.md ("Encoding 1:
ulp").
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .primitives import MAX_UNARY, PROB_INIT, U64, _dec_bit, _get, _get_gamma, _key, _unkey


@njit(nogil=True, cache=True)
def ulp_decode_groups(payload, n_changed, n, n_ctx, gbeg, gend, granks, gctx):
    """Decoder, part 1 (needs no base): the group section. Fills ``granks``/``gctx`` (each change's
    rank and context, grouped by context, ascending ranks within a group) and ``gbeg``/``gend`` (each
    context's slice of them). Returns (status, state): the state resumes the streams for part 3."""
    return ulp_groups_core(payload, n_changed, n, n_ctx, np.zeros(n_ctx, np.int32), 1, 2, gbeg, gend, granks, gctx)


@njit(nogil=True, cache=True)
def ulp_groups_core(payload, n_changed, n, n_ctx, cstate, n_states, qdepth, gbeg, gend, granks, gctx):
    """``ulp_decode_groups`` of encodings 1 and 5: context c's gap quotients use the slots of its
    history state ``cstate[c]`` (``encode_kernels.ulp_encode_core``)."""
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
    pq = np.full(qdepth * n_states, PROB_INIT, np.uint16)  # per state: "q > 0", "q > 1", ...
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
        q0 = qdepth * np.int64(cstate[c])
        prev = -1
        for j in range(cnt):
            q = 0
            while q < qdepth:
                bit, s = _dec_bit(s, payload, rc_end, pq, q0 + q)
                if bit == 0:
                    break
                q += 1
            if q == qdepth:
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
    return positions_core(base, None, None, ctx_shift, ctx_mask, 0, n_ctx, gbeg, gend, granks, n_changed, out_pos,
                          out_ctx, None)


@njit(nogil=True, cache=True)
def ulp_decode_deltas(payload, state, ectx, bits, n_ctx, out_neg, out_mag):
    """Decoder, part 3 (needs no base): each change's signed ulp distance, in position order, given
    its context (``ectx``). Checks that both streams end exactly. Returns 0 or a negative status."""
    return ulp_deltas_core(payload, state, ectx, bits, n_ctx, np.zeros(n_ctx, np.int32), 1, np.zeros(1, np.uint8), out_neg,
                           out_mag)


@njit(nogil=True, cache=True)
def ulp_deltas_core(payload, state, ectx, bits, n_ctx, cstate, n_states, flip, out_neg, out_mag):
    """``ulp_decode_deltas`` of encodings 1 and 5: in history states other than 0 the sign comes from
    the range coder, XOR ``flip[j]`` (``encode_kernels.ulp_encode_core``)."""
    code, rng, spos, sbad, acc, nacc, rpos, rbad, rc_end = state
    # Explicit types: a state that went through Python comes back as plain ints (all below 2**40).
    s = (U64(code), U64(rng), np.int64(spos), np.int64(sbad))
    r = (U64(acc), np.int64(nacc), np.int64(rpos), np.int64(rbad))
    rc_end = np.int64(rc_end)
    lim = payload.size
    plen = np.full(n_ctx * MAX_UNARY, PROB_INIT, np.uint16)
    psign = np.full(n_states, PROB_INIT, np.uint16)
    for j in range(ectx.size):
        e = np.int64(ectx[j])
        ln = 1
        while ln < bits:
            bit, s = _dec_bit(s, payload, rc_end, plen, e * MAX_UNARY + ln - 1)
            if bit == 0:
                break
            ln += 1
        h = np.int64(cstate[e])
        if h == 0:
            v, r = _get(r, payload, lim, ln)
            out_neg[j] = np.uint8(v & U64(1))
            out_mag[j] = (U64(1) << U64(ln - 1)) | (v >> U64(1))
        else:
            bit, s = _dec_bit(s, payload, rc_end, psign, h)
            v, r = _get(r, payload, lim, ln - 1)
            out_neg[j] = np.uint8(bit ^ np.int64(flip[j]))
            out_mag[j] = (U64(1) << U64(ln - 1)) | v
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
def hist_positions(base, hist, cmap, ctx_shift, ctx_mask, n_exp, n_ctx, gbeg, gend, granks, n_changed, out_pos,
                   out_ctx, out_flip):
    """``ulp_positions`` of encoding 5: element i's context is ``cmap[(hist[i] & 127) * n_exp +
    exponent]``; each change's sign flag (``hist[i] >> 7``) goes to ``out_flip``. Hazard: indexes its
    tables unchecked; ``hist_tables`` (which ``hist_decode`` runs first) must have passed."""
    return positions_core(base, hist, cmap, ctx_shift, ctx_mask, n_exp, n_ctx, gbeg, gend, granks, n_changed, out_pos,
                          out_ctx, out_flip)


@njit(nogil=True, cache=True)
def positions_core(base, hist, cmap, ctx_shift, ctx_mask, n_exp, n_ctx, gbeg, gend, granks, n_changed, out_pos,
                   out_ctx, out_flip):
    """The countdown of ``ulp_positions`` (``hist`` None: an element's context is its exponent field)
    and ``hist_positions``. numba compiles a version per argument types and prunes the ``is None``
    branches in each, so encoding 1's loop carries no history lookup."""
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
        x = np.int64((U64(base[i]) >> cs) & cm)
        hk = 0
        if hist is None:
            e = x
        else:
            hk = np.int64(hist[i])
            e = np.int64(cmap[(hk & 127) * n_exp + x])
        c = left[e] - 1
        left[e] = c
        if c == 0:
            if out_flip is not None:
                out_flip[o] = hk >> 7
            out_pos[o] = i
            out_ctx[o] = e
            o += 1
            p = ptr[e] + 1
            ptr[e] = p
            if p < gend[e]:
                left[e] = granks[p] - granks[p - 1]
    return 0 if o == n_changed else -3


@njit(nogil=True, cache=True)
def hist_tables(hist, cmap, cstate, ctx_mask, n_exp, n_states, qdepth):
    """The checks ``hist_decode`` makes of its model before it reads the payload (none of it is
    trusted): 0, or -2 when a parameter, a table entry (``cstate``'s in ``[0, n_states)``, ``cmap``'s
    first ``n_states * n_exp`` in ``[0, cstate.size)``) or a history state (``hist & 127``, below
    ``n_states``) is out of range; with them all in range no context, slot or table index leaves its
    array."""
    if n_states < 1 or qdepth < 1 or n_exp < 1 or ctx_mask >= n_exp or cmap.size < n_states * n_exp:
        return -2
    for c in range(cstate.size):
        if cstate[c] < 0 or cstate[c] >= n_states:
            return -2
    for x in range(n_states * n_exp):
        if cmap[x] < 0 or cmap[x] >= cstate.size:
            return -2
    for i in range(hist.size):
        if (np.int64(hist[i]) & 127) >= n_states:
            return -2
    return 0


@njit(nogil=True, cache=True)
def hist_decode(base, hist, payload, n_changed, bits, kind, ctx_shift, ctx_mask, n_exp, cmap, cstate, n_states,
                qdepth, out_pos, out_val):
    """``ulp_decode`` of encoding 5, given the chunk's history states (``hist``, one per element; the
    caller checks they are the ones the chunk names) and the context map (``cmap``: state and exponent
    to context; ``cstate``: each context's state). Trusts none of them: -4 for a history of the wrong
    length, -2 for a state or table entry out of range (``hist_tables``). Returns 0 or a negative
    status, the same as ``_native.decode_hist``."""
    n = base.size
    n_ctx = cstate.size
    if n_changed <= 0 or n_changed > n or out_pos.size < n_changed or out_val.size < n_changed or hist.size != n:
        return -4
    st = hist_tables(hist, cmap, cstate, ctx_mask, n_exp, n_states, qdepth)
    if st:
        return st
    gbeg = np.zeros(n_ctx, np.int64)
    gend = np.zeros(n_ctx, np.int64)
    granks = np.empty(n_changed, np.int64)
    gctx = np.empty(n_changed, np.int32)
    st, state = ulp_groups_core(payload, n_changed, n, n_ctx, cstate, n_states, qdepth, gbeg, gend, granks, gctx)
    if st:
        return st
    ectx = np.empty(n_changed, np.int32)
    flip = np.empty(n_changed, np.uint8)
    st = hist_positions(base, hist, cmap, ctx_shift, ctx_mask, n_exp, n_ctx, gbeg, gend, granks, n_changed, out_pos,
                        ectx, flip)
    if st:
        return st
    neg = np.empty(n_changed, np.uint8)
    mag = np.empty(n_changed, np.uint64)
    st = ulp_deltas_core(payload, state, ectx, bits, n_ctx, cstate, n_states, flip, neg, mag)
    if st:
        return st
    ulp_apply_deltas(base, out_pos[:n_changed], neg, mag, bits, kind, out_val)
    return 0


@njit(nogil=True, cache=True)
def scatter(dst, pos, val):
    """dst[pos[j]] = val[j]. Positions must already be validated."""
    for j in range(pos.size):
        dst[pos[j]] = val[j]
