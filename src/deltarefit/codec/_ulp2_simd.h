/* _ulp2.c's SIMD positions passes (included there, after dec_t, pos_scalar and take_bits): variant 0,
 * 16-bit elements, no history, the contexts with changes in [clo, clo + 64). Each runs the chunk's full
 * steps of 32 elements and leaves the rest to pos_scalar (*done = steps run). The stream is the copy
 * padded with 64 zero bytes (a step reads at most 40 bytes past its start). A step that would read past the
 * stream's end or find more changes than the record's is undone and left to pos_scalar too, which refuses
 * it at the exact element, with the exact status, as numba's decoder does. */
#if ULP2_X86

/* [8-lane need mask] -> a byte shuffle putting the next popcount(mask) bytes, in lane order, into the low
 * bytes of the 16-bit lanes that need one (0 elsewhere). */
static uint8_t expand8[256][16];
/* [8-lane need mask] -> the dword permutation taking lane l the (rank of l)-th of 8 bytes widened. */
static int32_t perm8[256][8];
/* [8-lane mask] -> the lanes set, in increasing order (then zeros): a step's changes by one compress. */
static uint8_t cidx8[256][8];
/* [8-lane mask] -> the byte shuffle gathering those lanes' 16-bit elements in increasing order. */
static uint8_t cidx16[256][16];

__attribute__((constructor)) static void ulp2_init_tables(void)
{
    for (int msk = 0; msk < 256; msk++) {
        int r = 0;
        for (int l = 0; l < 8; l++) {
            expand8[msk][2 * l] = (msk >> l) & 1 ? (uint8_t)r++ : 0x80;
            expand8[msk][2 * l + 1] = 0x80;
        }
        r = 0;
        for (int l = 0; l < 8; l++)
            perm8[msk][l] = (msk >> l) & 1 ? r++ : 0;
        r = 0;
        memset(cidx16[msk], 0x80, 16);
        for (int l = 0; l < 8; l++)
            if ((msk >> l) & 1) {
                cidx16[msk][2 * r] = (uint8_t)(2 * l);
                cidx16[msk][2 * r + 1] = (uint8_t)(2 * l + 1);
                cidx8[msk][r++] = (uint8_t)l;
            }
    }
}

/* The stream (D->sb: padded with 64 zero bytes) and the 64 probabilities of the window. */
static const uint8_t *simd_setup(const dec_t *D, int64_t clo, uint8_t *tab)
{
    for (int j = 0; j < 64; j++)
        tab[j] = clo + j < D->nctx ? (uint8_t)D->ptab[clo + j] : 0;
    return D->sb;
}

/* One step of 32: the probabilities by NT 16-entry byte lookups (the contexts with changes lie in
 * [clo, clo + 16 NT)), the decisions, and the lanes below L refilled in lane order. The need and bit masks
 * are packed without a lane permute (their bytes: lanes 0-7, 16-23, 8-15, 24-31) and the refill runs
 * branch-free (a step refills about one byte: a branch on it mispredicts). */
__attribute__((target("avx2,popcnt,bmi"))) static inline __attribute__((always_inline)) int
pos_avx2_t(dec_t *D, int64_t clo, int64_t *done, const int NT)
{
    uint8_t tab[64];
    const uint8_t *sb = simd_setup(D, clo, tab);
    const int64_t S = D->n / 32, slen = D->slen, m = D->m;
    int64_t sp = D->sp, k = D->k;
    int64_t *const pos = D->pos;
    uint16_t *const eb = D->ebase;
    __m256i t[4], bsub[4];
    for (int j = 0; j < NT; j++) {
        t[j] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(tab + 16 * j)));
        bsub[j] = _mm256_set1_epi8((char)(16 * j));
    }
    const __m128i vsh = _mm_cvtsi32_si128((int)D->shift);
    const __m256i vmask = _mm256_set1_epi16(D->kind == 0 ? (short)D->mask : 0), vclo = _mm256_set1_epi16((short)clo);
    const __m256i ff = _mm256_set1_epi16(0xFF), vout = _mm256_set1_epi16((short)(16 * NT)), zero = _mm256_setzero_si256();
    const __m256i b70 = _mm256_set1_epi8(0x70);
    uint16_t xs[32];
    for (int l = 0; l < 32; l++)
        xs[l] = (uint16_t)D->x[l];
    __m256i x[2] = {_mm256_loadu_si256((const __m256i *)xs), _mm256_loadu_si256((const __m256i *)(xs + 16))};
    const uint8_t *bp = D->base;
    int64_t s;
    for (s = 0; s < S; s++) {
        __m256i bit[2], need[2], pw[2], xd[2];
        const __m256i bv0 = _mm256_loadu_si256((const __m256i *)(bp + 64 * s));
        const __m256i bv1 = _mm256_loadu_si256((const __m256i *)(bp + 64 * s + 32));
        {   /* the probabilities: window offsets as bytes (16 NT: outside), NT 16-entry byte lookups */
            const __m256i d0 = _mm256_min_epu16(_mm256_sub_epi16(_mm256_and_si256(_mm256_srl_epi16(bv0, vsh), vmask), vclo), vout);
            const __m256i d1 = _mm256_min_epu16(_mm256_sub_epi16(_mm256_and_si256(_mm256_srl_epi16(bv1, vsh), vmask), vclo), vout);
            const __m256i d = _mm256_packus_epi16(d0, d1); /* per 128-bit half: 8 of d0, 8 of d1 */
            __m256i p = _mm256_shuffle_epi8(t[0], _mm256_adds_epu8(d, b70));
            for (int j = 1; j < NT; j++)
                p = _mm256_or_si256(p, _mm256_shuffle_epi8(t[j], _mm256_adds_epu8(_mm256_sub_epi8(d, bsub[j]), b70)));
            pw[0] = _mm256_unpacklo_epi8(p, zero);
            pw[1] = _mm256_unpackhi_epi8(p, zero);
        }
        for (int h = 0; h < 2; h++) {
            const __m256i p = pw[h];
            const __m256i slot = _mm256_and_si256(x[h], ff), hi = _mm256_srli_epi16(x[h], 8);
            const __m256i mul = _mm256_mullo_epi16(p, hi);
            bit[h] = _mm256_cmpgt_epi16(p, slot);
            xd[h] = _mm256_blendv_epi8(_mm256_sub_epi16(_mm256_sub_epi16(x[h], mul), p), _mm256_add_epi16(mul, slot), bit[h]);
            need[h] = _mm256_cmpeq_epi16(_mm256_srli_epi16(xd[h], 8), zero);
        }
        const uint32_t br = (uint32_t)_mm256_movemask_epi8(_mm256_packs_epi16(bit[0], bit[1]));
        const uint32_t nr = (uint32_t)_mm256_movemask_epi8(_mm256_packs_epi16(need[0], need[1]));
        const int nn = __builtin_popcount(nr), nb = __builtin_popcount(br);
        if (sp + nn > slen || k + nb > m)
            break; /* a step that refuses: pos_scalar runs it again, lane by lane, for the exact status */
        {   /* the refill: sp <= slen here, the loads stay within the 64 bytes of padding */
            const uint8_t *q = sb + sp;
            const int o1 = __builtin_popcount(nr & 0xFF), o2 = __builtin_popcount(nr & 0xFF00FF);
            const int o3 = __builtin_popcount(nr & 0xFFFFFF);
            const __m128i w0 = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)q), _mm_loadu_si128((const __m128i *)expand8[nr & 0xFF]));
            const __m128i w1 = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(q + o1)), _mm_loadu_si128((const __m128i *)expand8[(nr >> 16) & 0xFF]));
            const __m128i w2 = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(q + o2)), _mm_loadu_si128((const __m128i *)expand8[(nr >> 8) & 0xFF]));
            const __m128i w3 = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(q + o3)), _mm_loadu_si128((const __m128i *)expand8[nr >> 24]));
            x[0] = _mm256_or_si256(_mm256_blendv_epi8(xd[0], _mm256_slli_epi16(xd[0], 8), need[0]), _mm256_set_m128i(w1, w0));
            x[1] = _mm256_or_si256(_mm256_blendv_epi8(xd[1], _mm256_slli_epi16(xd[1], 8), need[1]), _mm256_set_m128i(w3, w2));
        }
        sp += nn;
        if (br) { /* the changes in lane order and their base elements: compress tables per 8 lanes (8 written) */
            const uint32_t bm = (br & 0xFF0000FF) | ((br >> 8) & 0xFF00) | ((br << 8) & 0xFF0000);
            if (k + 32 <= m) {
                const __m128i bh[4] = {_mm256_castsi256_si128(bv0), _mm256_extracti128_si256(bv0, 1),
                                       _mm256_castsi256_si128(bv1), _mm256_extracti128_si256(bv1, 1)};
                for (int g = 0; g < 4; g++) {
                    const uint32_t bg = (bm >> (8 * g)) & 255;
                    const __m128i ix = _mm_loadl_epi64((const __m128i *)cidx8[bg]);
                    const __m256i i0 = _mm256_set1_epi64x(32 * s + 8 * g);
                    _mm256_storeu_si256((__m256i *)(pos + k), _mm256_add_epi64(i0, _mm256_cvtepu8_epi64(ix)));
                    _mm256_storeu_si256((__m256i *)(pos + k + 4), _mm256_add_epi64(i0, _mm256_cvtepu8_epi64(_mm_srli_si128(ix, 4))));
                    _mm_storeu_si128((__m128i *)(eb + k), _mm_shuffle_epi8(bh[g], _mm_loadu_si128((const __m128i *)cidx16[bg])));
                    k += __builtin_popcount(bg);
                }
            } else
                for (uint32_t b2 = bm; b2; b2 &= b2 - 1) {
                    const int64_t i = 32 * s + __builtin_ctz(b2);
                    eb[k] = (uint16_t)ld(bp, i, 2);
                    pos[k++] = i;
                }
        }
    }
    _mm256_storeu_si256((__m256i *)xs, x[0]);
    _mm256_storeu_si256((__m256i *)(xs + 16), x[1]);
    for (int l = 0; l < 32; l++)
        D->x[l] = xs[l];
    D->sp = sp;
    D->k = k;
    *done = s;
    return 0;
}

/* Window of 64 contexts from clo; the lookups only over the part that holds one (chi: the last). */
__attribute__((target("avx2,popcnt,bmi"))) static int pos_avx2(dec_t *D, int64_t clo, int64_t chi, int64_t *done)
{
    switch ((chi - clo) / 16) {
    case 0: return pos_avx2_t(D, clo, done, 1);
    case 1: return pos_avx2_t(D, clo, done, 2);
    case 2: return pos_avx2_t(D, clo, done, 3);
    default: return pos_avx2_t(D, clo, done, 4);
    }
}

/* Variant 1 (16 lanes of 32-bit states, 12-bit probabilities, 16-bit units), AVX2: a block's probabilities
 * first (the window's low and high bytes by four 16-entry byte lookups each, 32 elements at a time), then
 * the steps over two registers of 8 lanes, the units widened and permuted into place. */
#define V1_BLOCK 1024
__attribute__((target("avx2,popcnt,bmi"))) static int pos_avx2_v1(dec_t *D, int64_t clo, int64_t *done)
{
    uint8_t tlo[64], thi[64];
    for (int j = 0; j < 64; j++) {
        const uint16_t p = clo + j < D->nctx ? D->ptab[clo + j] : 0;
        tlo[j] = (uint8_t)p;
        thi[j] = (uint8_t)(p >> 8);
    }
    __m256i tl[4], th[4];
    for (int j = 0; j < 4; j++) {
        tl[j] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(tlo + 16 * j)));
        th[j] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(thi + 16 * j)));
    }
    const __m256i bsub[4] = {_mm256_setzero_si256(), _mm256_set1_epi8(16), _mm256_set1_epi8(32), _mm256_set1_epi8(48)};
    const __m256i b70 = _mm256_set1_epi8(0x70), v64w = _mm256_set1_epi16(64);
    const __m128i vsh = _mm_cvtsi32_si128((int)D->shift);
    const __m256i vmaskw = _mm256_set1_epi16(D->kind == 0 ? (short)D->mask : 0), vclow = _mm256_set1_epi16((short)clo);
    uint16_t ptmp[V1_BLOCK];
    const uint8_t *sb = D->sb;
    const int64_t S = D->n / 16, slen = D->slen;
    int64_t sp = D->sp;
    const __m256i fff = _mm256_set1_epi32(4095), zero = _mm256_setzero_si256();
    __m256i x[2] = {_mm256_loadu_si256((const __m256i *)D->x), _mm256_loadu_si256((const __m256i *)(D->x + 8))};
    const uint8_t *bp = D->base;
    int64_t s = 0;
    for (int64_t s0 = 0; s0 < S; s0 += V1_BLOCK / 16) {
        const int64_t s1 = S - s0 < V1_BLOCK / 16 ? S : s0 + V1_BLOCK / 16;
        for (int64_t e0 = 16 * s0; e0 < 16 * s1; e0 += 32) { /* (an odd step count: 16 more, from the base or 0) */
            __m256i dw[2];
            for (int h = 0; h < 2; h++) {
                __m256i b;
                if (e0 + 16 * h + 16 <= D->n)
                    b = _mm256_loadu_si256((const __m256i *)(bp + 2 * (e0 + 16 * h)));
                else
                    b = zero; /* past the chunk: never decoded */
                dw[h] = _mm256_min_epu16(_mm256_sub_epi16(_mm256_and_si256(_mm256_srl_epi16(b, vsh), vmaskw), vclow), v64w);
            }
            const __m256i d = _mm256_packus_epi16(dw[0], dw[1]);
            __m256i pl = zero, ph = zero;
            for (int j = 0; j < 4; j++) {
                const __m256i idx = _mm256_adds_epu8(_mm256_sub_epi8(d, bsub[j]), b70);
                pl = _mm256_or_si256(pl, _mm256_shuffle_epi8(tl[j], idx));
                ph = _mm256_or_si256(ph, _mm256_shuffle_epi8(th[j], idx));
            }
            _mm256_storeu_si256((__m256i *)(ptmp + (e0 - 16 * s0)), _mm256_unpacklo_epi8(pl, ph));
            _mm256_storeu_si256((__m256i *)(ptmp + (e0 - 16 * s0) + 16), _mm256_unpackhi_epi8(pl, ph));
        }
        for (s = s0; s < s1; s++) {
            __m256i bit[2], need[2], xd[2];
            for (int h = 0; h < 2; h++) {
                const __m256i p = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(ptmp + 16 * (s - s0) + 8 * h)));
                const __m256i slot = _mm256_and_si256(x[h], fff), mul = _mm256_mullo_epi32(p, _mm256_srli_epi32(x[h], 12));
                bit[h] = _mm256_cmpgt_epi32(p, slot);
                xd[h] = _mm256_blendv_epi8(_mm256_sub_epi32(_mm256_sub_epi32(x[h], mul), p), _mm256_add_epi32(mul, slot), bit[h]);
                need[h] = _mm256_cmpeq_epi32(_mm256_srli_epi32(xd[h], 16), zero);
            }
            const uint32_t bm = (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(bit[0])) |
                                (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(bit[1])) << 8;
            const uint32_t n0 = (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(need[0]));
            const uint32_t n1 = (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(need[1]));
            const int c0 = __builtin_popcount(n0), c1 = __builtin_popcount(n1);
            if (sp + 2 * (c0 + c1) > slen || D->k + __builtin_popcount(bm) > D->m)
                goto out; /* a step that refuses: pos_scalar runs it again, lane by lane, for the exact status */
            for (int h = 0; h < 2; h++) {
                const uint32_t nh = h ? n1 : n0;
                const __m256i u = _mm256_permutevar8x32_epi32(
                    _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(sb + sp + (h ? 2 * c0 : 0)))),
                    _mm256_loadu_si256((const __m256i *)perm8[nh]));
                x[h] = _mm256_blendv_epi8(xd[h], _mm256_or_si256(_mm256_slli_epi32(xd[h], 16), u), need[h]);
            }
            sp += 2 * (c0 + c1);
            take_bits(D, bm, 16 * s);
        }
    }
out:
    _mm256_storeu_si256((__m256i *)D->x, x[0]);
    _mm256_storeu_si256((__m256i *)(D->x + 8), x[1]);
    D->sp = sp;
    *done = s;
    return 0;
}

__attribute__((target("avx512f,avx512bw,avx512vbmi2,popcnt,bmi"))) static int pos_avx512(dec_t *D, int64_t clo,
                                                                                         int64_t *done)
{
    uint8_t tab[64];
    const uint8_t *sb = simd_setup(D, clo, tab);
    uint16_t tw[64], xs[32];
    for (int j = 0; j < 64; j++)
        tw[j] = tab[j];
    const __m512i tlo = _mm512_loadu_si512(tw), thi = _mm512_loadu_si512(tw + 32);
    const int64_t S = D->n / 32, slen = D->slen;
    int64_t sp = D->sp;
    const __m128i vsh = _mm_cvtsi32_si128((int)D->shift);
    const __m512i vmask = _mm512_set1_epi16(D->kind == 0 ? (short)D->mask : 0), vclo = _mm512_set1_epi16((short)clo);
    const __m512i ff = _mm512_set1_epi16(0xFF), v64 = _mm512_set1_epi16(64), v256 = _mm512_set1_epi16(256);
    for (int l = 0; l < 32; l++)
        xs[l] = (uint16_t)D->x[l];
    __m512i x = _mm512_loadu_si512(xs);
    const uint8_t *bp = D->base;
    int r = 0;
    int64_t s;
    for (s = 0; s < S; s++) {
        const __m512i b = _mm512_loadu_si512(bp + 64 * s);
        const __m512i d = _mm512_sub_epi16(_mm512_and_si512(_mm512_srl_epi16(b, vsh), vmask), vclo);
        const __mmask32 inw = _mm512_cmplt_epu16_mask(d, v64);
        const __m512i p = _mm512_maskz_permutex2var_epi16(inw, tlo, d, thi);
        const __m512i slot = _mm512_and_si512(x, ff), mul = _mm512_mullo_epi16(p, _mm512_srli_epi16(x, 8));
        const __mmask32 bit = _mm512_cmplt_epu16_mask(slot, p);
        const __m512i xd = _mm512_mask_blend_epi16(bit, _mm512_sub_epi16(_mm512_sub_epi16(x, mul), p), _mm512_add_epi16(mul, slot));
        const __mmask32 need = _mm512_cmplt_epu16_mask(xd, v256);
        const __m512i w = _mm512_maskz_expand_epi16(need, _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(sb + sp))));
        const __m512i xr = _mm512_mask_blend_epi16(need, xd, _mm512_or_si512(_mm512_slli_epi16(xd, 8), w));
        if (sp + __builtin_popcount((uint32_t)need) > slen || D->k + __builtin_popcount((uint32_t)bit) > D->m)
            break; /* a step that refuses: pos_scalar runs it again, lane by lane, for the exact status */
        x = xr;
        sp += __builtin_popcount((uint32_t)need);
        take_bits(D, (uint32_t)bit, 32 * s);
    }
    _mm512_storeu_si512(xs, x);
    for (int l = 0; l < 32; l++)
        D->x[l] = xs[l];
    D->sp = sp;
    *done = s;
    return r;
}

/* ------------------------------------------------------------------------------------------------
 * Values pass, variant 0, a full group of 32 changes (lanes 0..31) in four registers of 8 32-bit lanes.
 * Round 0 looks each lane's slot up in its context's packed table (a gather), round 1 decides the
 * signs, the rounds after it take the mantissa bits (a lane without bits left is not touched). The
 * lanes that decode renormalize in lane order: their next bytes widened and permuted into place.
 * ------------------------------------------------------------------------------------------------ */
__attribute__((target("avx2,popcnt,bmi"))) static inline int renorm_x4(__m256i *x, const __m256i *xn,
                                                                       const __m256i *act, const uint8_t *sb,
                                                                       int64_t *sp, int64_t slen)
{
    const __m256i v256 = _mm256_set1_epi32(256);
    __m256i need[4];
    uint32_t nm = 0;
    for (int q = 0; q < 4; q++) {
        x[q] = _mm256_blendv_epi8(x[q], xn[q], act[q]);
        need[q] = _mm256_and_si256(act[q], _mm256_cmpgt_epi32(v256, xn[q]));
        nm |= (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(need[q])) << (8 * q);
    }
    int64_t o = *sp;
    for (int q = 0; q < 4; q++) {
        const uint32_t mq = (nm >> (8 * q)) & 255;
        if (mq) {
            const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sb + o)));
            const __m256i w = _mm256_permutevar8x32_epi32(b, _mm256_loadu_si256((const __m256i *)perm8[mq]));
            x[q] = _mm256_blendv_epi8(x[q], _mm256_or_si256(_mm256_slli_epi32(x[q], 8), w), need[q]);
            o += __builtin_popcount(mq);
        }
    }
    *sp = o;
    return o > slen ? ST_TRUNC : 0;
}

__attribute__((target("avx2,popcnt,bmi"))) static int values_group_avx2(dec_t *D, int64_t j0, uint32_t *xa,
                                                                        int64_t *sp, int *kl, int *neg,
                                                                        uint64_t *mant, uint8_t *val, int *stored)
{
    int32_t go[32];
    uint32_t ps[32], ma[32];
    int flip[32];
    if (D->ebase && !D->hist && D->kind == 0) { /* the contexts from the kept base elements, 8 at a time */
        const __m128i vsh = _mm_cvtsi32_si128((int)D->shift);
        const __m256i vm = _mm256_set1_epi32((int)D->mask), half = _mm256_set1_epi32(128);
        __m256i any = _mm256_setzero_si256();
        for (int q = 0; q < 4; q++) {
            const __m256i c = _mm256_and_si256(_mm256_srl_epi32(_mm256_cvtepu16_epi32(
                                  _mm_loadu_si128((const __m128i *)(D->ebase + j0 + 8 * q))), vsh), vm);
            const __m256i g = _mm256_i32gather_epi32(D->gidx, c, 4); /* (c <= mask < n_exp) */
            any = _mm256_or_si256(any, g);
            _mm256_storeu_si256((__m256i *)(go + 8 * q), _mm256_slli_epi32(g, 8));
            _mm256_storeu_si256((__m256i *)(ps + 8 * q), half);
        }
        if (_mm256_movemask_ps(_mm256_castsi256_ps(any)))
            return ST_TABLE;
        memset(flip, 0, sizeof flip);
    } else
    for (int l = 0; l < 32; l++) {
        const int64_t c = ectx_of(D, j0 + l);
        const int32_t g = D->gidx[c];
        if (g < 0)
            return ST_TABLE; /* only where the base changed since the positions pass */
        go[l] = g * 256;
        ps[l] = 128;
        flip[l] = 0;
        if (D->hist) {
            const int64_t t = c / D->n_exp;
            if (t) {
                ps[l] = D->sign_p[t];
                flip[l] = D->states[D->pos[j0 + l]] >> 7;
            }
        }
    }
    const __m256i ff = _mm256_set1_epi32(255), ones = _mm256_set1_epi32(-1), one = _mm256_set1_epi32(1);
    const __m256i v8 = _mm256_set1_epi32(8), zero = _mm256_setzero_si256();
    __m256i x[4], xn[4], act[4] = {ones, ones, ones, ones}, mt[4] = {zero, zero, zero, zero};
    for (int q = 0; q < 4; q++)
        x[q] = _mm256_loadu_si256((const __m256i *)(xa + 8 * q));
    int r;
    /* round 0: the bit lengths */
    for (int q = 0; q < 4; q++) {
        const __m256i slot = _mm256_and_si256(x[q], ff), hi = _mm256_srli_epi32(x[q], 8);
        const __m256i e = _mm256_i32gather_epi32((const int *)D->klut,
                                                 _mm256_add_epi32(_mm256_loadu_si256((const __m256i *)(go + 8 * q)), slot), 4);
        const __m256i c = _mm256_and_si256(_mm256_srli_epi32(e, 8), ff), f = _mm256_srli_epi32(e, 16);
        xn[q] = _mm256_add_epi32(_mm256_mullo_epi16(f, hi), _mm256_sub_epi32(slot, c));
        _mm256_storeu_si256((__m256i *)(kl + 8 * q), _mm256_and_si256(e, ff));
    }
    if ((r = renorm_x4(x, xn, act, D->sb, sp, D->slen)))
        return r;
    /* round 1: the signs */
    uint32_t nb = 0;
    for (int q = 0; q < 4; q++) {
        const __m256i slot = _mm256_and_si256(x[q], ff), hi = _mm256_srli_epi32(x[q], 8);
        const __m256i p = _mm256_loadu_si256((const __m256i *)(ps + 8 * q)), mul = _mm256_mullo_epi16(p, hi);
        const __m256i bit = _mm256_cmpgt_epi32(p, slot);
        xn[q] = _mm256_blendv_epi8(_mm256_sub_epi32(_mm256_sub_epi32(x[q], mul), p), _mm256_add_epi32(mul, slot), bit);
        nb |= (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(bit)) << (8 * q);
    }
    if ((r = renorm_x4(x, xn, act, D->sb, sp, D->slen)))
        return r;
    int kmax = 1;
    for (int l = 0; l < 32; l++) {
        neg[l] = (int)((nb >> l) & 1) ^ flip[l];
        kmax = kl[l] > kmax ? kl[l] : kmax;
    }
    /* rounds 2, 3, ...: the bits below the leading one, 8 at a time */
    for (int rr = 1; rr <= (kmax - 1 + 7) / 8; rr++) {
        const __m256i done = _mm256_set1_epi32(1 + (rr - 1) * 8), at = _mm256_set1_epi32((rr - 1) * 8);
        for (int q = 0; q < 4; q++) {
            const __m256i left = _mm256_sub_epi32(_mm256_loadu_si256((const __m256i *)(kl + 8 * q)), done);
            act[q] = _mm256_cmpgt_epi32(left, zero);
            const __m256i sh = _mm256_sub_epi32(v8, _mm256_min_epi32(_mm256_max_epi32(left, zero), v8));
            const __m256i slot = _mm256_and_si256(x[q], ff), hi = _mm256_srli_epi32(x[q], 8);
            const __m256i f = _mm256_sllv_epi32(one, sh), v = _mm256_srlv_epi32(slot, sh);
            xn[q] = _mm256_add_epi32(_mm256_mullo_epi16(f, hi), _mm256_and_si256(slot, _mm256_sub_epi32(f, one)));
            mt[q] = _mm256_or_si256(mt[q], _mm256_and_si256(act[q], _mm256_sllv_epi32(v, at)));
        }
        if ((r = renorm_x4(x, xn, act, D->sb, sp, D->slen)))
            return r;
    }
    for (int q = 0; q < 4; q++)
        _mm256_storeu_si256((__m256i *)(xa + 8 * q), x[q]);
    if (D->ebase && D->kind == 0 && !D->hist) {
        /* 16-bit float elements: the targets here, 8 lanes at a time; the order key of b is
         * b ^ (b's sign ? 0xFFFF : 0x8000), its inverse t ^ (t's sign ? 0x8000 : 0xFFFF) */
        const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128), s15 = _mm256_set1_epi32(0x8000);
        const __m256i lo15 = _mm256_set1_epi32(0x7FFF), f16 = _mm256_set1_epi32(0xFFFF);
        __m256i t[4];
        for (int q = 0; q < 4; q++) {
            const __m256i k1 = _mm256_sub_epi32(_mm256_loadu_si256((const __m256i *)(kl + 8 * q)), one);
            const __m256i a = _mm256_or_si256(_mm256_sllv_epi32(one, k1), mt[q]);
            const __m256i ng = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)((nb >> (8 * q)) & 255)), sel), sel);
            const __m256i d = _mm256_sub_epi32(_mm256_xor_si256(a, ng), ng);
            const __m256i b = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(D->ebase + j0 + 8 * q)));
            const __m256i bs = _mm256_srli_epi32(b, 15), key = _mm256_xor_si256(b, _mm256_or_si256(s15,
                                   _mm256_and_si256(_mm256_sub_epi32(zero, bs), lo15)));
            const __m256i u = _mm256_and_si256(_mm256_add_epi32(key, d), f16);
            t[q] = _mm256_xor_si256(u, _mm256_or_si256(s15, _mm256_and_si256(_mm256_sub_epi32(_mm256_srli_epi32(u, 15), one), lo15)));
        }
        _mm256_storeu_si256((__m256i *)val + 2 * (j0 / 32), _mm256_permute4x64_epi64(_mm256_packus_epi32(t[0], t[1]), 0xD8));
        _mm256_storeu_si256((__m256i *)val + 2 * (j0 / 32) + 1, _mm256_permute4x64_epi64(_mm256_packus_epi32(t[2], t[3]), 0xD8));
        *stored = 1;
        return 0;
    }
    for (int q = 0; q < 4; q++)
        _mm256_storeu_si256((__m256i *)(ma + 8 * q), mt[q]);
    for (int l = 0; l < 32; l++)
        mant[l] = ma[l];
    return 0;
}
#endif
