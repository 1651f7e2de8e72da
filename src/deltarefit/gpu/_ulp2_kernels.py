"""Triton kernels of format 2's interleaved rANS lanes (encodings 6 ``ulp2`` and 7 ``ulp2_hist``),
imported only by ``gpu.ulp2``. FORMAT.md, "Format version 2", is the specification; the names here are
its names (``W`` lanes, probability bits ``M``, unit bits ``R``, lower bound ``L = 2^LB``).

One program per chunk; the W lanes of the coder are the program's vector ``tl.arange(0, W)``, so a
step (a set of lanes each coding one symbol) is one vector operation. The byte stream is shared by
the lanes: in a step the lanes that read (decode) or write (encode) a unit take their places in lane
order from an exclusive prefix count over the lanes that do (``tl.associative_scan(need, 0, _sum_combine) - need``).

* ``decode_kernel``: the position pass reads the base W elements at a time, looks up each element's
  context probability, decodes the decisions, and turns the change mask into positions with a prefix
  count; the value pass decodes per group of W changes the bit length (a [W, BITS] comparison against
  the context's cumulative frequencies), the sign and the mantissa rounds, and writes the target bits
  into a staging area (positions and values of the chunk's changes, never the tensor). Every
  refusal the lanes can meet is a per-chunk ``status`` (0 or a negative ``codec.constants.STATUS``
  code); loads are masked so that a hostile payload reads nothing outside its buffers.
* ``encode_kernel``: the exact reverse (the last step first), each lane starting at ``L``; units are
  written backwards from the end of the chunk's output area (of the bound's size), so the stream is
  that area's tail; the final lane states and the tail's start go to ``lanes_out`` / ``top_out``.

Values are kept as int64 holding the dtype's unsigned bits (widths up to 32 bits; ``gpu.ulp2`` sends
8-byte dtypes to the host decoder). Hazards as in ``_scan_kernels``: only ``triton.language``
builtins and this module's own ``@triton.jit`` helpers (sums and scans as ``tl.reduce`` /
``tl.associative_scan`` with ``_sum_combine``, inline: under the interpreter every helper call costs
milliseconds).
"""

from __future__ import annotations

import triton
import triton.language as tl

_sum_combine = tl.standard._sum_combine


@triton.jit
def _keys(u, KIND: tl.constexpr, BITS: tl.constexpr):
    """FORMAT.md's key of unsigned bits ``u`` (int64, below 2^BITS): monotone in the value."""
    ALL: tl.constexpr = (1 << BITS) - 1
    TOP: tl.constexpr = 1 << (BITS - 1)
    if KIND == 0:
        return tl.where((u & TOP) != 0, ALL - u, u | TOP)
    if KIND == 1:
        return u ^ TOP
    return u


@triton.jit
def _unkeys(k, KIND: tl.constexpr, BITS: tl.constexpr):
    ALL: tl.constexpr = (1 << BITS) - 1
    TOP: tl.constexpr = 1 << (BITS - 1)
    if KIND == 0:
        return tl.where((k & TOP) != 0, k ^ TOP, ALL - k)
    if KIND == 1:
        return k ^ TOP
    return k


@triton.jit
def _dec_step(x, act, slot, c, f, rd, st, stream_ptr, s_off, s_len,
              M: tl.constexpr, R: tl.constexpr, LB: tl.constexpr):
    """One decode step over the lanes ``act``: ``x = f * (x >> M) + slot - c``, then the lanes below L
    read their unit, in lane order, from unit ``rd`` on. Returns (x, rd, st, the lanes that found the
    stream ended: status -1)."""
    UB: tl.constexpr = R // 8
    x = tl.where(act, f * (x >> M) + slot - c, x)
    need = act & (x < (1 << LB))
    ni = need.to(tl.int32)
    idx = (rd + tl.associative_scan(ni, 0, _sum_combine) - ni).to(tl.int64)
    inside = (idx + 1) * UB <= s_len
    ok = need & inside
    u = tl.load(stream_ptr + s_off + idx * UB, mask=ok, other=0).to(tl.int64)
    if UB == 2:
        u = u | (tl.load(stream_ptr + s_off + idx * UB + 1, mask=ok, other=0).to(tl.int64) << 8)
    x = tl.where(need, (x << R) | u, x)
    short = need & (inside == 0)
    st = tl.where((tl.reduce(short.to(tl.int32), 0, _sum_combine) > 0) & (st == 0), -1, st)
    return x, rd + tl.reduce(ni, 0, _sum_combine), st, short


@triton.jit
def decode_kernel(base_ptr, states_ptr, stream_ptr, chunk_ptr, lanes_ptr, p_ptr, cum_ptr, sp_ptr,
                  pos_ptr, ctx_ptr, val_ptr, status_ptr,
                  SHIFT: tl.constexpr, MASK: tl.constexpr, NEXP: tl.constexpr, NCT: tl.constexpr,
                  HIST: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr, SIGNED: tl.constexpr,
                  M: tl.constexpr, R: tl.constexpr, W: tl.constexpr, LB: tl.constexpr, NR: tl.constexpr):
    """Chunk ``c = program_id``: ``chunk[c] = (base offset, n, m, stream offset, stream length, output
    offset)`` (int64). Its tables: ``p[c, NCT]``, ``cum[c, NCT, BITS + 1]`` (cumulative frequencies,
    2^M past K), ``sp[c, 8]`` (sign probabilities by history state), ``lanes[c, W]`` (initial states).
    Writes ``pos``, ``ctx`` and the target bits ``val`` of its m changes at the output offset, and
    ``status[c]``."""
    c = tl.program_id(0)
    ch = chunk_ptr + c * 6
    boff = tl.load(ch)
    n = tl.load(ch + 1)
    m = tl.load(ch + 2)
    s_off = tl.load(ch + 3)
    s_len = tl.load(ch + 4)
    o_off = tl.load(ch + 5)
    ALL: tl.constexpr = (1 << BITS) - 1
    ONE: tl.constexpr = 1 << M
    HALF: tl.constexpr = 1 << (M - 1)
    lane = tl.arange(0, W)
    x = tl.load(lanes_ptr + c * W + lane).to(tl.int64)
    rd = tl.full([], 0, tl.int64)
    st = tl.full([], 0, tl.int32)
    cnt = tl.full([], 0, tl.int64)
    pt = p_ptr + c * NCT
    for s in range(0, (n + W - 1) // W):  # 1. positions
        i = s * W + lane
        ok = i < n
        b = tl.load(base_ptr + boff + i, mask=ok, other=0).to(tl.int64) & ALL
        e = ((b >> SHIFT) & MASK).to(tl.int32)
        if HIST:
            t = tl.load(states_ptr + boff + i, mask=ok, other=0).to(tl.int32) & 127
            bad = (tl.reduce((ok & (t >= 7)).to(tl.int32), 0, _sum_combine) > 0) & (st == 0)
            st = tl.where(bad, -8, st)  # a history byte no book holds (the host decoder's check)
            e = tl.minimum(t, 6) * NEXP + e
        p = tl.load(pt + e, mask=ok, other=0).to(tl.int64)
        act = ok & (p > 0)
        slot = x & (ONE - 1)
        bit = slot < p
        st0 = st
        x, rd, st, short = _dec_step(x, act, slot, tl.where(bit, 0, p), tl.where(bit, p, ONE - p), rd, st,
                                     stream_ptr, s_off, s_len, M, R, LB)
        chg = act & bit
        ci = chg.to(tl.int64)
        dst = cnt + tl.associative_scan(ci, 0, _sum_combine) - ci
        keep = chg & (dst < m)
        # More changes than the record's: -4, unless a lane before (or at) the first such read past
        # the stream's end (-1), as a decoder taking the lanes one by one finds first.
        over = chg & (dst >= m)
        first_over = tl.reduce((tl.associative_scan(over.to(tl.int32), 0, _sum_combine) == 0).to(tl.int32), 0,
                               _sum_combine)
        first_short = tl.reduce((tl.associative_scan(short.to(tl.int32), 0, _sum_combine) == 0).to(tl.int32), 0,
                                _sum_combine)
        st = tl.where((st0 == 0) & (first_over < first_short), -4, st)
        tl.store(pos_ptr + o_off + dst, i, mask=keep)
        tl.store(ctx_ptr + o_off + dst, e, mask=keep)
        cnt += tl.reduce(ci, 0, _sum_combine)
    st = tl.where(((cnt != m) | (m == 0)) & (st == 0), -4, st)
    kk = tl.arange(0, BITS)
    ct = cum_ptr + c * (NCT * (BITS + 1))
    for g in range(0, tl.where(st == 0, (m + W - 1) // W, 0)):  # 2. values
        j = g * W + lane
        ok = j < m
        pos = tl.load(pos_ptr + o_off + j, mask=ok, other=0)
        e = tl.minimum(tl.maximum(tl.load(ctx_ptr + o_off + j, mask=ok, other=0), 0), NCT - 1)
        b = tl.load(base_ptr + boff + pos, mask=ok, other=0).to(tl.int64) & ALL
        row = ct + e * (BITS + 1)
        slot = x & (ONE - 1)  # round 0: the bit length k of |D|
        cums = tl.load(row[:, None] + kk[None, :], mask=ok[:, None], other=ONE).to(tl.int64)
        k = 1 + tl.reduce(((cums <= slot[:, None]) & (kk[None, :] >= 1)).to(tl.int32), 1, _sum_combine)
        c0 = tl.load(row + k - 1, mask=ok, other=0).to(tl.int64)
        c1 = tl.load(row + k, mask=ok, other=ONE).to(tl.int64)
        x, rd, st, short = _dec_step(x, ok, slot, c0, c1 - c0, rd, st, stream_ptr, s_off, s_len, M, R, LB)
        slot = x & (ONE - 1)  # round 1: the sign, a binary decision (1: [0, q))
        q = tl.full([W], HALF, tl.int64)
        flip = q < 0
        if HIST:
            sb = tl.load(states_ptr + boff + pos, mask=ok, other=0).to(tl.int32)
            t = tl.minimum(sb & 127, 6)
            q = tl.load(sp_ptr + c * 8 + t, mask=ok, other=HALF).to(tl.int64)  # sp[0] = 2^(M-1)
            flip = (t >= 1) & ((sb >> 7) != 0)  # (no flip in state 0)
        one = slot < q
        neg = one ^ flip
        cc = tl.where(one, 0, q)
        f = tl.where(one, q, ONE - q)
        x, rd, st, short = _dec_step(x, ok, slot, cc, f, rd, st, stream_ptr, s_off, s_len, M, R, LB)
        left = (k - 1).to(tl.int64)
        mant = tl.full([W], 0, tl.int64)
        done = tl.full([W], 0, tl.int64)
        for _q in range(NR):  # rounds 2, 3, ...: the mantissa, M bits at a time, low bits first
            a = ok & (left > 0)
            if tl.reduce(a.to(tl.int32), 0, _sum_combine) > 0:  # (a round no lane takes is a no-op)
                r = tl.minimum(left, M)
                sh = M - r
                slot = x & (ONE - 1)
                v = slot >> sh
                x, rd, st, short = _dec_step(x, a, slot, v << sh, tl.full([W], 1, tl.int64) << sh, rd, st,
                                      stream_ptr, s_off, s_len, M, R, LB)
                mant = tl.where(a, mant | (v << done), mant)
                done = tl.where(a, done + r, done)
                left = tl.where(a, left - r, left)
        mag = (tl.full([W], 1, tl.int64) << (k - 1).to(tl.int64)) + mant
        kb = _keys(b, KIND, BITS)
        u = _unkeys(tl.where(neg, kb - mag, kb + mag) & ALL, KIND, BITS)
        if SIGNED:
            u = tl.where(u >= (1 << (BITS - 1)), u - (1 << BITS), u)
        tl.store(val_ptr + o_off + j, u, mask=ok)
    st = tl.where((tl.reduce((x != (1 << LB)).to(tl.int32), 0, _sum_combine) > 0) & (st == 0), -10, st)  # 3. end
    st = tl.where((rd * (R // 8) != s_len) & (st == 0), -6, st)
    tl.store(status_ptr + c, st)


@triton.jit
def _enc_step(x, act, c, f, top, st, out_ptr, o_off,
              M: tl.constexpr, R: tl.constexpr, LB: tl.constexpr):
    """One encode step over the lanes ``act`` (the inverse of ``_dec_step``): each emits at most one
    unit, placed in lane order just below ``top`` (units). Returns (x, top, st)."""
    UB: tl.constexpr = R // 8
    fs = tl.where(act, f, 1)
    em = act & (x >= (((1 << LB) >> M) << R) * fs)
    unit = x & ((1 << R) - 1)
    x = tl.where(em, x >> R, x)
    x = tl.where(act, ((x // fs) << M) + (x % fs) + c, x)
    ei = em.to(tl.int64)
    ne = tl.reduce(ei, 0, _sum_combine)
    dst = top - ne + tl.associative_scan(ei, 0, _sum_combine) - ei
    ok = em & (dst >= 0)
    tl.store(out_ptr + o_off + dst * UB, (unit & 255).to(tl.uint8), mask=ok)
    if UB == 2:
        tl.store(out_ptr + o_off + dst * UB + 1, (unit >> 8).to(tl.uint8), mask=ok)
    st = tl.where((top - ne < 0) & (st == 0), -5, st)
    return x, top - ne, st


@triton.jit
def encode_kernel(base_ptr, target_ptr, states_ptr, chg_ptr, chunk_ptr, p_ptr, cum_ptr, sp_ptr,
                  out_ptr, lanes_ptr, top_ptr, status_ptr,
                  SHIFT: tl.constexpr, MASK: tl.constexpr, NEXP: tl.constexpr, NCT: tl.constexpr,
                  HIST: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr,
                  M: tl.constexpr, R: tl.constexpr, W: tl.constexpr, LB: tl.constexpr, NR: tl.constexpr):
    """Chunk ``c = program_id``: ``chunk[c] = (base offset, n, m, changes offset, output offset, output
    units)``; ``chg`` the chunk's m changed positions, ascending; tables as ``decode_kernel``'s. Writes
    the stream into the tail of its output area, ``lanes[c, W]``, ``top[c]`` (the stream's first unit
    in the area) and ``status[c]``."""
    c = tl.program_id(0)
    ch = chunk_ptr + c * 6
    boff = tl.load(ch)
    n = tl.load(ch + 1)
    m = tl.load(ch + 2)
    g_off = tl.load(ch + 3)
    o_off = tl.load(ch + 4)
    top = tl.load(ch + 5)
    ALL: tl.constexpr = (1 << BITS) - 1
    ONE: tl.constexpr = 1 << M
    HALF: tl.constexpr = 1 << (M - 1)
    lane = tl.arange(0, W)
    kk = tl.arange(0, BITS)
    x = tl.full([W], 1 << LB, tl.int64)
    st = tl.full([], 0, tl.int32)
    ct = cum_ptr + c * (NCT * (BITS + 1))
    ng = (m + W - 1) // W
    for gg in range(0, ng):  # the values, last group first
        j = (ng - 1 - gg) * W + lane
        ok = j < m
        pos = tl.load(chg_ptr + g_off + j, mask=ok, other=0)
        b = tl.load(base_ptr + boff + pos, mask=ok, other=0).to(tl.int64) & ALL
        v = tl.load(target_ptr + boff + pos, mask=ok, other=0).to(tl.int64) & ALL
        d = (_keys(v, KIND, BITS) - _keys(b, KIND, BITS)) & ALL
        neg = (d >> (BITS - 1)) != 0
        mag = tl.where(neg, (1 << BITS) - d, d)
        k = tl.reduce(((mag[:, None] >> kk[None, :]) > 0).to(tl.int64), 1, _sum_combine)
        mant = mag - (tl.full([W], 1, tl.int64) << tl.maximum(k - 1, 0))
        e = ((b >> SHIFT) & MASK).to(tl.int32)
        sb = tl.full([W], 0, tl.int32)
        if HIST:
            sb = tl.load(states_ptr + boff + pos, mask=ok, other=0).to(tl.int32)
            e = tl.minimum(sb & 127, 6) * NEXP + e
        for qq in range(NR):  # mantissa rounds, last first
            q = NR - 1 - qq
            a = ok & (k - 1 > q * M)
            if tl.reduce(a.to(tl.int32), 0, _sum_combine) > 0:  # (a round no lane takes is a no-op)
                r = tl.minimum(k - 1 - q * M, M)
                sh = tl.where(a, M - r, 0)
                val = (mant >> (q * M)) & ((tl.full([W], 1, tl.int64) << tl.maximum(r, 0)) - 1)
                x, top, st = _enc_step(x, a, val << sh, tl.full([W], 1, tl.int64) << sh, top, st, out_ptr,
                                       o_off, M, R, LB)
        q1 = tl.full([W], HALF, tl.int64)  # the sign, a binary decision (1: [0, q))
        one = neg
        if HIST:
            t = tl.minimum(sb & 127, 6)
            q1 = tl.load(sp_ptr + c * 8 + t, mask=ok, other=HALF).to(tl.int64)
            one = neg ^ ((t >= 1) & ((sb >> 7) != 0))
        cc = tl.where(one, 0, q1)
        f = tl.where(one, q1, ONE - q1)
        x, top, st = _enc_step(x, ok, cc, f, top, st, out_ptr, o_off, M, R, LB)
        row = ct + e * (BITS + 1)  # the bit length
        c0 = tl.load(row + k - 1, mask=ok, other=0).to(tl.int64)
        c1 = tl.load(row + k, mask=ok, other=ONE).to(tl.int64)
        st = tl.where((tl.reduce((ok & (c1 <= c0)).to(tl.int32), 0, _sum_combine) > 0) & (st == 0), -8, st)
        x, top, st = _enc_step(x, ok & (c1 > c0), c0, c1 - c0, top, st, out_ptr, o_off, M, R, LB)
    ns = (n + W - 1) // W
    pt = p_ptr + c * NCT
    for ss in range(0, ns):  # the positions, last step first
        i = (ns - 1 - ss) * W + lane
        ok = i < n
        b = tl.load(base_ptr + boff + i, mask=ok, other=0).to(tl.int64) & ALL
        v = tl.load(target_ptr + boff + i, mask=ok, other=0).to(tl.int64) & ALL
        e = ((b >> SHIFT) & MASK).to(tl.int32)
        if HIST:
            e = tl.minimum(tl.load(states_ptr + boff + i, mask=ok, other=0).to(tl.int32) & 127, 6) * NEXP + e
        p = tl.load(pt + e, mask=ok, other=0).to(tl.int64)
        act = ok & (p > 0)
        bit = b != v
        st = tl.where((tl.reduce((ok & bit & (p == 0)).to(tl.int32), 0, _sum_combine) > 0) & (st == 0), -8, st)
        x, top, st = _enc_step(x, act, tl.where(bit, 0, p), tl.where(bit, p, ONE - p), top, st, out_ptr, o_off,
                               M, R, LB)
    tl.store(lanes_ptr + c * W + lane, x)
    tl.store(top_ptr + c, top)
    tl.store(status_ptr + c, st)
