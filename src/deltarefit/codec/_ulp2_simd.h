/* _ulp2.c's SIMD positions passes (included there, after dec_t, pos_scalar and take_bits): variant 0,
 * 16-bit elements, no history, the contexts with changes in [clo, clo + 64). Each runs the chunk's full
 * steps of 32 elements and leaves the tail step to pos_scalar (*done = steps run). The stream is the
 * copy padded with 64 zero bytes; a step that moves past the stream's end refuses (ST_TRUNC), as the
 * scalar pass refuses the read itself. */
#if ULP2_X86

/* [8-lane need mask] -> a byte shuffle putting the next popcount(mask) bytes, in lane order, into the low
 * bytes of the 16-bit lanes that need one (0 elsewhere). */
static uint8_t expand8[256][16];

__attribute__((constructor)) static void ulp2_init_tables(void)
{
    for (int msk = 0; msk < 256; msk++) {
        int r = 0;
        for (int l = 0; l < 8; l++) {
            expand8[msk][2 * l] = (msk >> l) & 1 ? (uint8_t)r++ : 0x80;
            expand8[msk][2 * l + 1] = 0x80;
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

__attribute__((target("avx2,popcnt,bmi"))) static int pos_avx2(dec_t *D, int64_t clo, int64_t *done)
{
    uint8_t tab[64];
    const uint8_t *sb = simd_setup(D, clo, tab);
    const int64_t S = D->n / 32, slen = D->slen;
    int64_t sp = D->sp;
    const __m256i t0 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)tab));
    const __m256i t1 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(tab + 16)));
    const __m256i t2 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(tab + 32)));
    const __m256i t3 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(tab + 48)));
    const __m128i vsh = _mm_cvtsi32_si128((int)D->shift);
    const __m256i vmask = _mm256_set1_epi16(D->kind == 0 ? (short)D->mask : 0), vclo = _mm256_set1_epi16((short)clo);
    const __m256i ff = _mm256_set1_epi16(0xFF), not63 = _mm256_set1_epi16(~63), v15 = _mm256_set1_epi16(15);
    const __m256i z80 = _mm256_set1_epi16((short)0x8000), one = _mm256_set1_epi16(1), two = _mm256_set1_epi16(2);
    const __m256i three = _mm256_set1_epi16(3), zero = _mm256_setzero_si256();
    uint16_t xs[32];
    for (int l = 0; l < 32; l++)
        xs[l] = (uint16_t)D->x[l];
    __m256i x[2] = {_mm256_loadu_si256((const __m256i *)xs), _mm256_loadu_si256((const __m256i *)(xs + 16))};
    const uint8_t *bp = D->base;
    int r = 0;
    int64_t s;
    for (s = 0; s < S; s++) {
        __m256i bit[2], need[2];
        for (int h = 0; h < 2; h++) {
            const __m256i b = _mm256_loadu_si256((const __m256i *)(bp + 64 * s + 32 * h));
            const __m256i d = _mm256_sub_epi16(_mm256_and_si256(_mm256_srl_epi16(b, vsh), vmask), vclo);
            const __m256i inw = _mm256_cmpeq_epi16(_mm256_and_si256(d, not63), zero);
            const __m256i idx = _mm256_or_si256(_mm256_and_si256(d, v15), z80), q = _mm256_and_si256(_mm256_srli_epi16(d, 4), three);
            __m256i p = _mm256_shuffle_epi8(t0, idx);
            p = _mm256_blendv_epi8(p, _mm256_shuffle_epi8(t1, idx), _mm256_cmpeq_epi16(q, one));
            p = _mm256_blendv_epi8(p, _mm256_shuffle_epi8(t2, idx), _mm256_cmpeq_epi16(q, two));
            p = _mm256_blendv_epi8(p, _mm256_shuffle_epi8(t3, idx), _mm256_cmpeq_epi16(q, three));
            p = _mm256_and_si256(p, inw);
            const __m256i slot = _mm256_and_si256(x[h], ff), hi = _mm256_srli_epi16(x[h], 8);
            const __m256i mul = _mm256_mullo_epi16(p, hi);
            bit[h] = _mm256_cmpgt_epi16(p, slot);
            x[h] = _mm256_blendv_epi8(_mm256_sub_epi16(_mm256_sub_epi16(x[h], mul), p), _mm256_add_epi16(mul, slot), bit[h]);
            need[h] = _mm256_cmpeq_epi16(_mm256_srli_epi16(x[h], 8), zero);
        }
        const uint32_t bm = (uint32_t)_mm256_movemask_epi8(_mm256_permute4x64_epi64(_mm256_packs_epi16(bit[0], bit[1]), 0xD8));
        const uint32_t nm = (uint32_t)_mm256_movemask_epi8(_mm256_permute4x64_epi64(_mm256_packs_epi16(need[0], need[1]), 0xD8));
        if (nm) {
            const uint8_t *q = sb + sp;
            const int o1 = __builtin_popcount(nm & 0xFF), o2 = __builtin_popcount(nm & 0xFFFF);
            const int o3 = __builtin_popcount(nm & 0xFFFFFF);
            const __m128i w0 = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)q), _mm_loadu_si128((const __m128i *)expand8[nm & 0xFF]));
            const __m128i w1 = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(q + o1)), _mm_loadu_si128((const __m128i *)expand8[(nm >> 8) & 0xFF]));
            const __m128i w2 = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(q + o2)), _mm_loadu_si128((const __m128i *)expand8[(nm >> 16) & 0xFF]));
            const __m128i w3 = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(q + o3)), _mm_loadu_si128((const __m128i *)expand8[nm >> 24]));
            x[0] = _mm256_blendv_epi8(x[0], _mm256_or_si256(_mm256_slli_epi16(x[0], 8), _mm256_set_m128i(w1, w0)), need[0]);
            x[1] = _mm256_blendv_epi8(x[1], _mm256_or_si256(_mm256_slli_epi16(x[1], 8), _mm256_set_m128i(w3, w2)), need[1]);
            sp += __builtin_popcount(nm);
            if (sp > slen) {
                r = ST_TRUNC;
                break;
            }
        }
        take_bits(D, bm, 32 * s);
    }
    _mm256_storeu_si256((__m256i *)xs, x[0]);
    _mm256_storeu_si256((__m256i *)(xs + 16), x[1]);
    for (int l = 0; l < 32; l++)
        D->x[l] = xs[l];
    D->sp = sp;
    *done = s;
    return r;
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
        x = _mm512_mask_blend_epi16(bit, _mm512_sub_epi16(_mm512_sub_epi16(x, mul), p), _mm512_add_epi16(mul, slot));
        const __mmask32 need = _mm512_cmplt_epu16_mask(x, v256);
        if (need) {
            const __m512i w = _mm512_maskz_expand_epi16(need, _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(sb + sp))));
            x = _mm512_mask_blend_epi16(need, x, _mm512_or_si512(_mm512_slli_epi16(x, 8), w));
            sp += __builtin_popcount((uint32_t)need);
            if (sp > slen) {
                r = ST_TRUNC;
                break;
            }
        }
        take_bits(D, (uint32_t)bit, 32 * s);
    }
    _mm512_storeu_si512(xs, x);
    for (int l = 0; l < 32; l++)
        D->x[l] = xs[l];
    D->sp = sp;
    *done = s;
    return r;
}
#endif
