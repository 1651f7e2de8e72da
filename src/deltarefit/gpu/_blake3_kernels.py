"""Triton kernels for BLAKE3 segment hashes (imported only by ``blake3_triton``; needs ``triton``).

Contract of each kernel is in its docstring; the algorithm is ``blake3_torch``'s module docstring.

Hazards, once for all kernels:

* Every BLAKE3 word is ``tl.uint32``: additions wrap mod 2**32 by design, and ``>>`` must be a logical
  shift (on ``int32`` it would be arithmetic and smear the sign bit into rotations). Loaded bytes and
  the int32-stored chaining values are bitcast / zero-extended to uint32 before any arithmetic.
* Rotations are ``(x >> n) | (x << (32 - n))`` with constant ``n`` (on uint32, so no sign smear); the
  backend turns that into one funnel shift.
* Message words are little-endian. The u32 loads of LOAD=1/2 rely on the device being little-endian
  (every CUDA/ROCm GPU, and the host under the interpreter); LOAD=0 assembles words from bytes.
* Byte offsets exceed 2**31 for buffers over 2 GiB: chunk indices are widened to int64 before any
  multiplication.
* Chunk counters fit the low word (< 2**32 chunks per message); the high counter word is always 0.
"""

from __future__ import annotations

import triton
import triton.language as tl

_IV0: tl.constexpr = tl.constexpr(0x6A09E667)
_IV1: tl.constexpr = tl.constexpr(0xBB67AE85)
_IV2: tl.constexpr = tl.constexpr(0x3C6EF372)
_IV3: tl.constexpr = tl.constexpr(0xA54FF53A)
_IV4: tl.constexpr = tl.constexpr(0x510E527F)
_IV5: tl.constexpr = tl.constexpr(0x9B05688C)
_IV6: tl.constexpr = tl.constexpr(0x1F83D9AB)
_IV7: tl.constexpr = tl.constexpr(0x5BE0CD19)


@triton.jit
def _g(a, b, c, d, mx, my):
    # Rotations written out as (x >> n) | (x << (32 - n)) (one funnel shift each once compiled) rather
    # than a helper: every helper call costs the interpreter a module re-patch, and there are 3584 per chunk.
    a = a + b + mx
    d = d ^ a
    d = (d >> 16) | (d << 16)
    c = c + d
    b = b ^ c
    b = (b >> 12) | (b << 20)
    a = a + b + my
    d = d ^ a
    d = (d >> 8) | (d << 24)
    c = c + d
    b = b ^ c
    b = (b >> 7) | (b << 25)
    return a, b, c, d


@triton.jit
def _iv(like, w: tl.constexpr):
    return tl.full(like.shape, w, tl.uint32)


@triton.jit
def _compress(c0, c1, c2, c3, c4, c5, c6, c7,
              m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15,
              counter, block_len, flags):
    """First 8 output words (the chaining value) of one compression; all arguments uint32, one shape."""
    v0, v1, v2, v3, v4, v5, v6, v7 = c0, c1, c2, c3, c4, c5, c6, c7
    v8 = _iv(c0, _IV0)
    v9 = _iv(c0, _IV1)
    v10 = _iv(c0, _IV2)
    v11 = _iv(c0, _IV3)
    v12 = counter
    v13 = tl.zeros_like(c0)  # counter high word
    v14 = block_len
    v15 = flags
    # The 7 rounds, unrolled, with the message schedule (MSG_PERMUTATION applied r times) written out;
    # blake3_torch.MSG_SCHEDULE is the same table and the tests compare the two implementations.
    # round 0
    v0, v4, v8, v12 = _g(v0, v4, v8, v12, m0, m1)
    v1, v5, v9, v13 = _g(v1, v5, v9, v13, m2, m3)
    v2, v6, v10, v14 = _g(v2, v6, v10, v14, m4, m5)
    v3, v7, v11, v15 = _g(v3, v7, v11, v15, m6, m7)
    v0, v5, v10, v15 = _g(v0, v5, v10, v15, m8, m9)
    v1, v6, v11, v12 = _g(v1, v6, v11, v12, m10, m11)
    v2, v7, v8, v13 = _g(v2, v7, v8, v13, m12, m13)
    v3, v4, v9, v14 = _g(v3, v4, v9, v14, m14, m15)
    # round 1
    v0, v4, v8, v12 = _g(v0, v4, v8, v12, m2, m6)
    v1, v5, v9, v13 = _g(v1, v5, v9, v13, m3, m10)
    v2, v6, v10, v14 = _g(v2, v6, v10, v14, m7, m0)
    v3, v7, v11, v15 = _g(v3, v7, v11, v15, m4, m13)
    v0, v5, v10, v15 = _g(v0, v5, v10, v15, m1, m11)
    v1, v6, v11, v12 = _g(v1, v6, v11, v12, m12, m5)
    v2, v7, v8, v13 = _g(v2, v7, v8, v13, m9, m14)
    v3, v4, v9, v14 = _g(v3, v4, v9, v14, m15, m8)
    # round 2
    v0, v4, v8, v12 = _g(v0, v4, v8, v12, m3, m4)
    v1, v5, v9, v13 = _g(v1, v5, v9, v13, m10, m12)
    v2, v6, v10, v14 = _g(v2, v6, v10, v14, m13, m2)
    v3, v7, v11, v15 = _g(v3, v7, v11, v15, m7, m14)
    v0, v5, v10, v15 = _g(v0, v5, v10, v15, m6, m5)
    v1, v6, v11, v12 = _g(v1, v6, v11, v12, m9, m0)
    v2, v7, v8, v13 = _g(v2, v7, v8, v13, m11, m15)
    v3, v4, v9, v14 = _g(v3, v4, v9, v14, m8, m1)
    # round 3
    v0, v4, v8, v12 = _g(v0, v4, v8, v12, m10, m7)
    v1, v5, v9, v13 = _g(v1, v5, v9, v13, m12, m9)
    v2, v6, v10, v14 = _g(v2, v6, v10, v14, m14, m3)
    v3, v7, v11, v15 = _g(v3, v7, v11, v15, m13, m15)
    v0, v5, v10, v15 = _g(v0, v5, v10, v15, m4, m0)
    v1, v6, v11, v12 = _g(v1, v6, v11, v12, m11, m2)
    v2, v7, v8, v13 = _g(v2, v7, v8, v13, m5, m8)
    v3, v4, v9, v14 = _g(v3, v4, v9, v14, m1, m6)
    # round 4
    v0, v4, v8, v12 = _g(v0, v4, v8, v12, m12, m13)
    v1, v5, v9, v13 = _g(v1, v5, v9, v13, m9, m11)
    v2, v6, v10, v14 = _g(v2, v6, v10, v14, m15, m10)
    v3, v7, v11, v15 = _g(v3, v7, v11, v15, m14, m8)
    v0, v5, v10, v15 = _g(v0, v5, v10, v15, m7, m2)
    v1, v6, v11, v12 = _g(v1, v6, v11, v12, m5, m3)
    v2, v7, v8, v13 = _g(v2, v7, v8, v13, m0, m1)
    v3, v4, v9, v14 = _g(v3, v4, v9, v14, m6, m4)
    # round 5
    v0, v4, v8, v12 = _g(v0, v4, v8, v12, m9, m14)
    v1, v5, v9, v13 = _g(v1, v5, v9, v13, m11, m5)
    v2, v6, v10, v14 = _g(v2, v6, v10, v14, m8, m12)
    v3, v7, v11, v15 = _g(v3, v7, v11, v15, m15, m1)
    v0, v5, v10, v15 = _g(v0, v5, v10, v15, m13, m3)
    v1, v6, v11, v12 = _g(v1, v6, v11, v12, m0, m10)
    v2, v7, v8, v13 = _g(v2, v7, v8, v13, m2, m6)
    v3, v4, v9, v14 = _g(v3, v4, v9, v14, m4, m7)
    # round 6
    v0, v4, v8, v12 = _g(v0, v4, v8, v12, m11, m15)
    v1, v5, v9, v13 = _g(v1, v5, v9, v13, m5, m0)
    v2, v6, v10, v14 = _g(v2, v6, v10, v14, m1, m9)
    v3, v7, v11, v15 = _g(v3, v7, v11, v15, m8, m6)
    v0, v5, v10, v15 = _g(v0, v5, v10, v15, m14, m10)
    v1, v6, v11, v12 = _g(v1, v6, v11, v12, m2, m12)
    v2, v7, v8, v13 = _g(v2, v7, v8, v13, m3, m4)
    v3, v4, v9, v14 = _g(v3, v4, v9, v14, m7, m13)
    return v0 ^ v8, v1 ^ v9, v2 ^ v10, v3 ^ v11, v4 ^ v12, v5 ^ v13, v6 ^ v14, v7 ^ v15


@triton.jit
def _le_word(p, off, n_bytes, live):
    """Little-endian u32 from 4 bytes at ``p + off``; bytes at or past ``n_bytes`` read as 0 (padding)."""
    b0 = tl.load(p + off, mask=live & (off < n_bytes), other=0).to(tl.uint32)
    b1 = tl.load(p + off + 1, mask=live & (off + 1 < n_bytes), other=0).to(tl.uint32)
    b2 = tl.load(p + off + 2, mask=live & (off + 2 < n_bytes), other=0).to(tl.uint32)
    b3 = tl.load(p + off + 3, mask=live & (off + 3 < n_bytes), other=0).to(tl.uint32)
    return b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)


@triton.jit
def _split2(x):
    """``[T, 2k]`` -> (even columns, odd columns), each ``[T, k]`` (``[T]`` when k == 1)."""
    T: tl.constexpr = x.shape[0]
    K: tl.constexpr = x.shape[1] // 2
    if K == 1:
        return tl.split(x)
    else:
        return tl.split(tl.reshape(x, [T, K, 2]))


@triton.jit
def _columns16(w):
    """``[T, 16]`` -> its 16 columns, in order (register shuffles, no memory)."""
    e, o = _split2(w)  # e: 0 2 4 .. 14, o: 1 3 5 .. 15
    e0, e1 = _split2(e)  # 0 4 8 12 | 2 6 10 14
    o0, o1 = _split2(o)  # 1 5 9 13 | 3 7 11 15
    e00, e01 = _split2(e0)  # 0 8 | 4 12
    e10, e11 = _split2(e1)  # 2 10 | 6 14
    o00, o01 = _split2(o0)  # 1 9 | 5 13
    o10, o11 = _split2(o1)  # 3 11 | 7 15
    w0, w8 = _split2(e00)
    w4, w12 = _split2(e01)
    w2, w10 = _split2(e10)
    w6, w14 = _split2(e11)
    w1, w9 = _split2(o00)
    w5, w13 = _split2(o01)
    w3, w11 = _split2(o10)
    w7, w15 = _split2(o11)
    return w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15


# Integer arguments are not specialized on their values (== 1, multiple of 16): that would compile a
# new variant for many buffer lengths, for no speed (offsets are multiples of 1024 by construction).
@triton.jit(do_not_specialize=["n_bytes", "chunk_begin", "chunk_end", "chunks_per_seg", "seg_bytes"])
def chunk_cv_kernel(src_ptr, cv_ptr, n_bytes, chunk_begin, chunk_end, chunks_per_seg, seg_bytes,
                    TILE: tl.constexpr, LOAD: tl.constexpr):
    """Chaining values of chunks ``chunk_begin .. chunk_end - 1``; one lane per chunk, TILE per program.

    ``src_ptr``: the buffer's bytes (``n_bytes`` of them); chunk ``g`` covers ``[1024 g, 1024 g + 1024)``
    clipped to ``n_bytes``. Writes ``cv_ptr[8 g + i]`` (int32 bit patterns of the u32 words).
    The chunk counter is ``g % chunks_per_seg``; a chunk whose segment (``seg_bytes`` long, the last one
    shorter) is a single chunk gets ROOT on its last block, so its "chaining value" is the digest.

    LOAD selects how message words are read:
      0: four masked byte loads per word: any length and alignment; short/empty chunks handled.
      1: one u32 load per word (16 per block): only for whole 1024-byte chunks, 4-byte aligned base.
      2: one [TILE, 16] u32 tile per block, split into columns: same preconditions as 1.
    """
    pid = tl.program_id(0)
    g = chunk_begin + pid.to(tl.int64) * TILE + tl.arange(0, TILE).to(tl.int64)
    live = g < chunk_end
    start = g * 1024  # int64: > 2**31 past 2 MiB chunks
    chunk_len = tl.minimum(tl.maximum(n_bytes - start, 0), 1024)
    n_blocks = tl.maximum((chunk_len + 63) // 64, 1)  # an empty chunk is one empty block
    counter = (g % chunks_per_seg).to(tl.uint32)
    seg_start = (g // chunks_per_seg) * seg_bytes
    single = tl.minimum(n_bytes - seg_start, seg_bytes) <= 1024
    end_flags = tl.where(single, 2 | 8, 2)  # CHUNK_END, plus ROOT for a one-chunk segment

    c0 = _iv(counter, _IV0)
    c1 = _iv(counter, _IV1)
    c2 = _iv(counter, _IV2)
    c3 = _iv(counter, _IV3)
    c4 = _iv(counter, _IV4)
    c5 = _iv(counter, _IV5)
    c6 = _iv(counter, _IV6)
    c7 = _iv(counter, _IV7)
    wp = src_ptr.to(tl.pointer_type(tl.uint32))
    for b in range(16):
        flags = (tl.where(b == 0, 1, 0) | tl.where(b == n_blocks - 1, end_flags, 0)).to(tl.uint32)
        if LOAD == 0:
            off = start + b * 64
            m0 = _le_word(src_ptr, off, n_bytes, live)
            m1 = _le_word(src_ptr, off + 4, n_bytes, live)
            m2 = _le_word(src_ptr, off + 8, n_bytes, live)
            m3 = _le_word(src_ptr, off + 12, n_bytes, live)
            m4 = _le_word(src_ptr, off + 16, n_bytes, live)
            m5 = _le_word(src_ptr, off + 20, n_bytes, live)
            m6 = _le_word(src_ptr, off + 24, n_bytes, live)
            m7 = _le_word(src_ptr, off + 28, n_bytes, live)
            m8 = _le_word(src_ptr, off + 32, n_bytes, live)
            m9 = _le_word(src_ptr, off + 36, n_bytes, live)
            m10 = _le_word(src_ptr, off + 40, n_bytes, live)
            m11 = _le_word(src_ptr, off + 44, n_bytes, live)
            m12 = _le_word(src_ptr, off + 48, n_bytes, live)
            m13 = _le_word(src_ptr, off + 52, n_bytes, live)
            m14 = _le_word(src_ptr, off + 56, n_bytes, live)
            m15 = _le_word(src_ptr, off + 60, n_bytes, live)
            block_len = tl.minimum(tl.maximum(chunk_len - b * 64, 0), 64).to(tl.uint32)
        elif LOAD == 1:
            wo = g * 256 + b * 16
            m0 = tl.load(wp + wo, mask=live, other=0)
            m1 = tl.load(wp + wo + 1, mask=live, other=0)
            m2 = tl.load(wp + wo + 2, mask=live, other=0)
            m3 = tl.load(wp + wo + 3, mask=live, other=0)
            m4 = tl.load(wp + wo + 4, mask=live, other=0)
            m5 = tl.load(wp + wo + 5, mask=live, other=0)
            m6 = tl.load(wp + wo + 6, mask=live, other=0)
            m7 = tl.load(wp + wo + 7, mask=live, other=0)
            m8 = tl.load(wp + wo + 8, mask=live, other=0)
            m9 = tl.load(wp + wo + 9, mask=live, other=0)
            m10 = tl.load(wp + wo + 10, mask=live, other=0)
            m11 = tl.load(wp + wo + 11, mask=live, other=0)
            m12 = tl.load(wp + wo + 12, mask=live, other=0)
            m13 = tl.load(wp + wo + 13, mask=live, other=0)
            m14 = tl.load(wp + wo + 14, mask=live, other=0)
            m15 = tl.load(wp + wo + 15, mask=live, other=0)
            block_len = tl.full(counter.shape, 64, tl.uint32)
        else:
            wo = (g * 256 + b * 16)[:, None] + tl.arange(0, 16)[None, :]
            w = tl.load(wp + wo, mask=live[:, None], other=0)
            m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15 = _columns16(w)
            block_len = tl.full(counter.shape, 64, tl.uint32)
        n0, n1, n2, n3, n4, n5, n6, n7 = _compress(
            c0, c1, c2, c3, c4, c5, c6, c7,
            m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15,
            counter, block_len, flags)
        if LOAD == 0:
            active = b < n_blocks  # short last chunk: blocks past its end leave the CV alone
            c0 = tl.where(active, n0, c0)
            c1 = tl.where(active, n1, c1)
            c2 = tl.where(active, n2, c2)
            c3 = tl.where(active, n3, c3)
            c4 = tl.where(active, n4, c4)
            c5 = tl.where(active, n5, c5)
            c6 = tl.where(active, n6, c6)
            c7 = tl.where(active, n7, c7)
        else:
            c0, c1, c2, c3, c4, c5, c6, c7 = n0, n1, n2, n3, n4, n5, n6, n7
    o = cv_ptr + g * 8
    tl.store(o, c0.to(tl.int32, bitcast=True), mask=live)
    tl.store(o + 1, c1.to(tl.int32, bitcast=True), mask=live)
    tl.store(o + 2, c2.to(tl.int32, bitcast=True), mask=live)
    tl.store(o + 3, c3.to(tl.int32, bitcast=True), mask=live)
    tl.store(o + 4, c4.to(tl.int32, bitcast=True), mask=live)
    tl.store(o + 5, c5.to(tl.int32, bitcast=True), mask=live)
    tl.store(o + 6, c6.to(tl.int32, bitcast=True), mask=live)
    tl.store(o + 7, c7.to(tl.int32, bitcast=True), mask=live)


@triton.jit
def _ld(p, i, mask):
    return tl.load(p + i, mask=mask, other=0).to(tl.uint32, bitcast=True)


@triton.jit(do_not_specialize=["n_out", "n_full", "in_full", "out_full", "last_in"])
def parent_kernel(in_ptr, out_ptr, n_out, n_full, in_full, out_full, last_in, TILE: tl.constexpr):
    """One merge level: node ``j`` of the output level, one lane per output node.

    Input level: ``n_full`` segments of ``in_full`` nodes each, then the last segment's ``last_in`` nodes
    (0 if none); output level likewise with ``out_full = ceil(in_full / 2)`` (>= 1) and
    ``ceil(last_in / 2)``; ``n_out`` nodes in all. Nodes are 8 int32 words. Output node ``i`` of a segment
    is ``parent(2i, 2i + 1)``, or node ``2i`` unchanged when it has no right sibling (odd count: carry
    up; a finished root is carried like that too). The merge of a segment's last two nodes is the root.
    """
    pid = tl.program_id(0)
    j = pid.to(tl.int64) * TILE + tl.arange(0, TILE).to(tl.int64)
    live = j < n_out
    full_out = n_full * out_full
    in_fulls = j < full_out
    seg = j // out_full
    i = tl.where(in_fulls, j - seg * out_full, j - full_out)
    base = tl.where(in_fulls, seg * in_full, n_full * in_full)
    count = tl.where(in_fulls, in_full, last_in)
    has_r = live & (2 * i + 1 < count)
    flags = tl.where(count == 2, 4 | 8, 4).to(tl.uint32)  # PARENT, plus ROOT for the segment's last merge
    lp = in_ptr + (base + 2 * i) * 8
    rp = lp + 8
    l0 = _ld(lp, 0, live)
    l1 = _ld(lp, 1, live)
    l2 = _ld(lp, 2, live)
    l3 = _ld(lp, 3, live)
    l4 = _ld(lp, 4, live)
    l5 = _ld(lp, 5, live)
    l6 = _ld(lp, 6, live)
    l7 = _ld(lp, 7, live)
    r0 = _ld(rp, 0, has_r)
    r1 = _ld(rp, 1, has_r)
    r2 = _ld(rp, 2, has_r)
    r3 = _ld(rp, 3, has_r)
    r4 = _ld(rp, 4, has_r)
    r5 = _ld(rp, 5, has_r)
    r6 = _ld(rp, 6, has_r)
    r7 = _ld(rp, 7, has_r)
    zero = tl.zeros_like(flags)
    n0, n1, n2, n3, n4, n5, n6, n7 = _compress(
        _iv(flags, _IV0), _iv(flags, _IV1), _iv(flags, _IV2), _iv(flags, _IV3),
        _iv(flags, _IV4), _iv(flags, _IV5), _iv(flags, _IV6), _iv(flags, _IV7),
        l0, l1, l2, l3, l4, l5, l6, l7, r0, r1, r2, r3, r4, r5, r6, r7,
        zero, zero + 64, flags)
    o = out_ptr + j * 8
    tl.store(o, tl.where(has_r, n0, l0).to(tl.int32, bitcast=True), mask=live)
    tl.store(o + 1, tl.where(has_r, n1, l1).to(tl.int32, bitcast=True), mask=live)
    tl.store(o + 2, tl.where(has_r, n2, l2).to(tl.int32, bitcast=True), mask=live)
    tl.store(o + 3, tl.where(has_r, n3, l3).to(tl.int32, bitcast=True), mask=live)
    tl.store(o + 4, tl.where(has_r, n4, l4).to(tl.int32, bitcast=True), mask=live)
    tl.store(o + 5, tl.where(has_r, n5, l5).to(tl.int32, bitcast=True), mask=live)
    tl.store(o + 6, tl.where(has_r, n6, l6).to(tl.int32, bitcast=True), mask=live)
    tl.store(o + 7, tl.where(has_r, n7, l7).to(tl.int32, bitcast=True), mask=live)
