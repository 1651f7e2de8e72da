/* Native kernels of the ULP-context codec. Optional: the numba kernels in kernels.py compute the same
 * outputs and bytes, and tests hold the two equal. Everything here runs without the GIL.
 *
 * scan16(base, target, shift, mask, n_ctx, pos, ectx, rank, bvals, tvals[, bits, kind, out])
 *     kernels.ulp_scan for 16-bit elements (bf16, fp16, int16, uint16); with ``out``, the changes are
 *     coded too (encode_changes below), in the same call.
 * encode_changes(ectx, rank, bvals, tvals, itemsize, bits, kind, n_ctx, out)
 *     kernels.ulp_encode_changes, byte for byte, for any item size.
 * decode_ulp(base, payload, n_changed, itemsize, bits, kind, shift, mask, n_ctx, out_pos, out_val)
 *     kernels.ulp_decode: the same positions, values and status, for any item size (see the decoder's
 *     section below). Unlike the encoder's kernels it trusts nothing in the payload.
 * encode_hist16(base, target, hist, cmap, shift, mask, n_exp, n_ctx, pos, ectx, rank, bvals, tvals, flip,
 *               bits, kind, cstate, n_states, qdepth, out) -> (m, nbytes)
 *     encoding 5 (ulp_hist): kernels.hist_scan + kernels.ulp_encode_core for 16-bit elements, in one call.
 * decode_hist(base, hist, payload, n_changed, itemsize, bits, kind, shift, mask, n_exp, cmap, cstate,
 *             n_states, qdepth, out_pos, out_val) -> status
 *     kernels.hist_decode: the same positions, values and status, for any item size; it trusts neither
 *     the payload nor the history nor the tables. For 16-bit floats its positions pass splits (pos_hist_split):
 *     state 0 through decode_ulp's block passes, the other states one by one; else numba's countdown.
 * Encodings 1 and 5 share the coder, the group decoder and the value decoder: encoding 5 is encoding 1
 * with history contexts, qdepth gap-quotient decisions per history state and range-coded signs
 * (hmodel_t; NULL for encoding 1, whose code paths are kept as they were).
 *
 * The scan is a histogram of every element's context (a change's rank is the count of earlier elements
 * of its context). With AVX-512 a block of 32 elements is compared in one step; each change's rank is
 * the counters at the block's start plus a popcount of the block's earlier lanes of its context; and
 * the block is counted into the histogram with one compare and popcount per context of the chunk's
 * "hot window" (the 16 consecutive contexts holding most of it: 99.99% of a real bf16 checkpoint's
 * elements), the rest one by one. The portable path counts one element at a time, in four arrays, one
 * per lane i % 4, so that consecutive increments of one context do not wait on each other's store.
 *
 * Buffers are checked here (size, alignment, writability): a bad one raises ValueError, a misaligned one
 * BufferError (the caller copies and retries). The encoder's inputs are trusted to be what they are
 * (bits coded as found) but not to hold still: a caller's tensor may change during the scan (another
 * thread writing it), so each element is read once and the tables indexed with what was read are
 * checked where they are used; whatever the input, no read or write leaves the buffers. (Whether the
 * delta then decodes to what was hashed is the publisher's check.) The decoder's payload is not trusted.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_ulp2.h" /* format 2: ulp2_encode, ulp2_decode, ulp2_kernel(s) */

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_AVX512_PATH 1 /* (also: x86-64 inline asm, as for csel) */
#else
#define HAVE_AVX512_PATH 0
#endif

#define LANES 4 /* counter arrays, one per lane i % LANES; each holds mask + 1 contexts */

typedef struct {
    int32_t *pos, *ectx, *rank;
    uint16_t *bvals, *tvals;
} out16;

/* Elements [i, n) one by one (the tail of a block loop, or a whole chunk on the portable path). */
static Py_ssize_t scan16_tail(const uint16_t *b, const uint16_t *t, Py_ssize_t i, Py_ssize_t n,
                              unsigned shift, unsigned mask, int32_t *c, out16 o, Py_ssize_t m)
{
    for (; i < n; i++) {
        /* Each element read once: the caller's buffers may change under the scan (a tensor written by
         * another thread), and a change coded from a second read could hold equal values. */
        const uint16_t bi = b[i], ti = t[i];
        unsigned e = ((unsigned)bi >> shift) & mask;
        if (bi != ti) {
            o.pos[m] = (int32_t)i;
            o.ectx[m] = (int32_t)e;
            int32_t r = 0;
            for (unsigned l = 0; l < LANES; l++)
                r += c[l * (mask + 1) + e];
            o.rank[m] = r;
            o.bvals[m] = bi;
            o.tvals[m] = ti;
            m++;
        }
        c[(i % LANES) * (mask + 1) + e]++;
    }
    return m;
}

#if HAVE_AVX512_PATH
#define WINDOW 16 /* contexts counted with vector compares; the rest one by one */

/* The window of WINDOW consecutive contexts holding most of the chunk, from a sample of it. */
static unsigned hot_window(const uint16_t *b, Py_ssize_t n, unsigned shift, unsigned mask, int32_t *scratch)
{
    Py_ssize_t step = n / 4096 + 1;
    memset(scratch, 0, ((size_t)mask + 1) * sizeof(int32_t));
    for (Py_ssize_t i = 0; i < n; i += step)
        scratch[((unsigned)b[i] >> shift) & mask]++;
    int32_t sum = 0, best = -1;
    unsigned best_e0 = 0;
    for (unsigned e = 0; e <= mask; e++) {
        sum += scratch[e];
        if (e >= WINDOW)
            sum -= scratch[e - WINDOW];
        if (e + 1 >= WINDOW && sum > best) {
            best = sum;
            best_e0 = e + 1 - WINDOW;
        }
    }
    return best_e0;
}

__attribute__((target("avx512f,avx512bw,avx512vl,popcnt,bmi,bmi2")))
static Py_ssize_t scan16_avx512(const uint16_t *b, const uint16_t *t, Py_ssize_t n, unsigned shift,
                                unsigned mask, int32_t *c, out16 o)
{
    /* Counters: one array (c, lane 0 of the portable path's four), exact after every block. Contexts in
     * the chunk's hot window are counted with a compare and a popcount each per block, the others one by
     * one behind a branch that is rarely taken. (A window of 8 left 2% of real elements outside and ran
     * no faster than the plain histogram: that branch then mispredicts in most blocks.) */
    if (mask + 1 < WINDOW) /* int16, uint16: one context */
        return scan16_tail(b, t, 0, n, shift, mask, c, o, 0);
    Py_ssize_t m = 0, i = 0;
    const unsigned e0 = hot_window(b, n, shift, mask, c + LANES * (mask + 1));
    const __m512i vmask = _mm512_set1_epi16((short)mask);
    const __m128i vshift = _mm_cvtsi32_si128((int)shift);
    const __m512i ve0 = _mm512_set1_epi16((short)e0), vwin = _mm512_set1_epi16(WINDOW);
    __m512i vk[WINDOW];
    for (unsigned k = 0; k < WINDOW; k++)
        vk[k] = _mm512_set1_epi16((short)(e0 + k));
    int32_t *const hot = c + e0;
    /* A block's elements are loaded once, into registers, and every use reads those (stored to the
     * arrays below when a lane is needed): a second read of a buffer that changes under the scan could
     * code a change with equal values or count an element in another context than its rank's. */
    uint16_t bb[32], tt[32], eb[32];
    for (; i + 32 <= n; i += 32) {
        __m512i vb = _mm512_loadu_si512((const void *)(b + i));
        __m512i vt = _mm512_loadu_si512((const void *)(t + i));
        __m512i ve = _mm512_and_si512(_mm512_srl_epi16(vb, vshift), vmask);
        __mmask32 ch = _mm512_cmpneq_epu16_mask(vb, vt);
        uint32_t out = ~(uint32_t)_mm512_cmplt_epu16_mask(_mm512_sub_epi16(ve, ve0), vwin);
        if (ch | out)
            _mm512_storeu_si512((void *)eb, ve);
        if (ch) {
            _mm512_storeu_si512((void *)bb, vb);
            _mm512_storeu_si512((void *)tt, vt);
        }
        while (ch) {
            unsigned k = (unsigned)__builtin_ctz(ch);
            unsigned ek = eb[k];
            __mmask32 same = _mm512_cmpeq_epu16_mask(ve, _mm512_set1_epi16((short)ek));
            o.pos[m] = (int32_t)(i + k);
            o.ectx[m] = (int32_t)ek;
            o.rank[m] = c[ek] + __builtin_popcount((uint32_t)same & ((1u << k) - 1u));
            o.bvals[m] = bb[k];
            o.tvals[m] = tt[k];
            m++;
            ch &= ch - 1;
        }
        for (unsigned k = 0; k < WINDOW; k++)
            hot[k] += __builtin_popcount((uint32_t)_mm512_cmpeq_epu16_mask(ve, vk[k]));
        if (__builtin_expect(out != 0, 0)) while (out) {
            c[eb[__builtin_ctz(out)]]++;
            out &= out - 1;
        }
    }
    /* The tail counts with the portable path's lanes; lanes 1-3 start at zero, so ranks stay sums. */
    return scan16_tail(b, t, i, n, shift, mask, c, o, m);
}
#endif

static int simd_allowed = 1; /* use_simd(False) turns the AVX-512 path off (tests compare the two) */

static int have_avx512(void)
{
#if HAVE_AVX512_PATH
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl");
    }
    return known && simd_allowed;
#else
    return 0;
#endif
}

static int get_buf(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t need, unsigned align, const char *what)
{
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return -1;
    if (view->len < need) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, needs %zd", what, view->len, need);
        PyBuffer_Release(view);
        return -1;
    }
    if (((uintptr_t)view->buf) % align) {
        PyErr_Format(PyExc_BufferError, "%s is not aligned to %u bytes", what, align);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------------
 * encode_changes(ectx, rank, bvals, tvals, itemsize, bits, kind, n_ctx, out) -> nbytes (or -5)
 *
 * kernels.ulp_encode_changes, byte for byte (FORMAT.md, "Encoding 1: ulp"): the same range coder, raw
 * bit stream, Rice parameter choice and value model. Here the coder's state lives in registers; numba
 * kept it in memory, a load and a store per coded bit.
 * ------------------------------------------------------------------------------------------------ */

#define PROB_BITS 11
#define MOVE_BITS 5
#define RC_TOP (1u << 24)
#define MAX_UNARY 64
#define KIND_FLOAT 0
#define KIND_INT 1

typedef struct {
    uint64_t low, range, cache, csize;
    Py_ssize_t opos, cap;
    uint8_t *out;
} rc_t;

typedef struct {
    uint64_t acc;
    unsigned nacc;
    Py_ssize_t pos, cap;
    uint8_t *out;
} raw_t;

static inline void rc_shift_low(rc_t *r)
{
    if (r->low < 0xFF000000ull || r->low >= (1ull << 32)) {
        uint64_t carry = r->low >> 32, temp = r->cache;
        do {
            if (r->opos < r->cap)
                r->out[r->opos] = (uint8_t)((temp + carry) & 0xFF);
            r->opos++;
            temp = 0xFF;
        } while (--r->csize != 0);
        r->cache = (r->low >> 24) & 0xFF;
    }
    r->csize++;
    r->low = (r->low & 0x00FFFFFFull) << 8;
}

/* Code one bit, or nothing when active == 0 (the gap code's conditional second bit), with selects the
 * compiler turns into conditional moves: the bits are coin flips the branch predictor cannot learn, and
 * the selects beat masks by 2 ticks per change. At most one renormalisation step can follow
 * (probabilities stay within [31, 2017] of 2048, so the range never falls below 2^18), and it is rare
 * enough to stay a branch. */
static inline void rc_bit_if(rc_t *r, uint16_t *probs, Py_ssize_t idx, uint64_t bit, uint64_t active)
{
    uint64_t p = probs[idx], bound = (r->range >> PROB_BITS) * p;
    uint64_t up = p + (((1u << PROB_BITS) - p) >> MOVE_BITS), down = p - (p >> MOVE_BITS);
    uint64_t nrange = bit ? r->range - bound : bound, nlow = r->low + (bit ? bound : 0);
    uint64_t np = bit ? down : up;
    r->low = active ? nlow : r->low;
    r->range = active ? nrange : r->range;
    probs[idx] = (uint16_t)(active ? np : p);
    if (__builtin_expect(r->range < RC_TOP, 0)) {
        r->range = (r->range << 8) & 0xFFFFFFFFull;
        rc_shift_low(r);
    }
}

static inline void rc_bit(rc_t *r, uint16_t *probs, Py_ssize_t idx, uint64_t bit) { rc_bit_if(r, probs, idx, bit, 1); }

/* Raw bits, LSB first. Branch-free: each put stores all 8 bytes of the accumulator and advances by
 * the whole bytes in it; the next store overwrites the partial byte. raw_t.cap is the allocation, 8
 * bytes past the usable size: a stream that ends past the usable size loses bytes here and is refused
 * (-5) after coding, as the numba coder refuses it. */
static inline void raw_put56(raw_t *w, uint64_t value, unsigned nbits) /* nbits <= 56 */
{
    w->acc |= (value & ((1ull << nbits) - 1)) << w->nacc;
    w->nacc += nbits;
    if (__builtin_expect(w->pos + 8 <= w->cap, 1))
        memcpy(w->out + w->pos, &w->acc, 8);
    w->pos += w->nacc >> 3;
    w->acc >>= (w->nacc & ~7u); /* < 64: nacc <= 7 + 56 */
    w->nacc &= 7;
}

static inline void raw_put(raw_t *w, uint64_t value, unsigned nbits)
{
    while (nbits > 32) {
        raw_put56(w, value, 32);
        value >>= 32;
        nbits -= 32;
    }
    raw_put56(w, value, nbits);
}

static inline unsigned bitlen64(uint64_t x) { return x ? 64u - (unsigned)__builtin_clzll(x) : 0u; }

static inline void raw_gamma(raw_t *w, uint64_t x)
{
    unsigned nb = bitlen64(x);
    raw_put(w, 1ull << (nb - 1), nb);
    raw_put(w, x, nb - 1);
}

static inline uint64_t load_item(const void *p, Py_ssize_t j, int itemsize)
{
    switch (itemsize) {
    case 1: return ((const uint8_t *)p)[j];
    case 2: return ((const uint16_t *)p)[j];
    case 4: return ((const uint32_t *)p)[j];
    default: return ((const uint64_t *)p)[j];
    }
}

static inline uint64_t key_of(uint64_t u, int kind, uint64_t sign, uint64_t mask)
{
    if (kind == KIND_FLOAT) {
        uint64_t m = 0 - (uint64_t)((u & sign) != 0);
        return u ^ (sign | (m & mask));
    }
    if (kind == KIND_INT)
        return u ^ sign;
    return u;
}

/* The history model of encoding 5 (FORMAT.md, "Encoding 5: ulp_hist"; kernels.ulp_encode_core): context
 * c belongs to history state cstate[c]; each state has qdepth slots for the gap quotients' "q > t"
 * decisions, and in a state other than 0 a change's sign goes through the range coder (slot: the state)
 * XOR its flip bit. Encoding 1 is the model with one state, qdepth 2 and raw signs: the coders take a
 * NULL model for it (and keep its own code path, constant-folded). */
typedef struct {
    const int32_t *cstate; /* per context */
    int n_states, qdepth;
    const uint8_t *flip; /* encoder: per change (position order); decoder: per element (hist, bit 7) */
    const int32_t *cmap; /* decoder: (state, exponent) to context, state-major */
    Py_ssize_t n_exp;
} hmodel_t;

/* Returns the payload length, -5 if out is too small, -7 if memory ran out, -2 if the changes' arrays
 * are not a scan's (a context or state out of range, ranks not increasing, a change with equal values). Inlined into one copy per
 * item size (below), so the value loads are not a switch per change; H is NULL (encoding 1) or the
 * history model (encoding 5). */
static inline __attribute__((always_inline)) Py_ssize_t encode_changes_t(const int32_t *ectx, const int32_t *rank, const void *bvals, const void *tvals,
                                   Py_ssize_t m, int itemsize, int bits, int kind, Py_ssize_t n_ctx, uint8_t *out,
                                   Py_ssize_t out_cap, const hmodel_t *H)
{
    const uint64_t mask = bits >= 64 ? ~0ull : (1ull << bits) - 1, sign = 1ull << (bits - 1);
    Py_ssize_t rawcap = m * 20 + n_ctx * 24 + 64;
    int64_t *gcount = calloc((size_t)n_ctx, sizeof(int64_t));
    int64_t *gstart = calloc((size_t)n_ctx + 1, sizeof(int64_t));
    int64_t *fill = malloc(((size_t)n_ctx + 1) * sizeof(int64_t));
    int64_t *granks = malloc(((size_t)m + 1) * sizeof(int64_t));
    uint8_t *raw = malloc((size_t)rawcap + 8);
    uint16_t *plen = malloc((size_t)n_ctx * MAX_UNARY * sizeof(uint16_t));
    /* encoding 5's slots: per state, qdepth quotient decisions and a sign */
    uint16_t *pqh = H ? malloc(((size_t)H->qdepth + 1) * (size_t)H->n_states * sizeof(uint16_t)) : NULL;
    uint16_t *psign = H ? pqh + (size_t)H->qdepth * (size_t)H->n_states : NULL;
    Py_ssize_t ret = -7;
    if (!gcount || !gstart || !fill || !granks || !raw || !plen || (H && !pqh))
        goto done;
    if (H)
        for (size_t i = 0; i < ((size_t)H->qdepth + 1) * (size_t)H->n_states; i++)
            pqh[i] = 1u << (PROB_BITS - 1);
    /* The changes' arrays are read more than once (contexts twice here, again with the values): each
     * read is checked where it indexes, so that arrays changed between reads are refused (-2), never
     * followed outside the tables. */
    for (Py_ssize_t j = 0; j < m; j++) {
        const int32_t e = ectx[j];
        if (e < 0 || e >= n_ctx) {
            ret = -2;
            goto done;
        }
        gcount[e]++;
    }
    for (Py_ssize_t c = 0; c < n_ctx; c++)
        gstart[c + 1] = gstart[c] + gcount[c];
    memcpy(fill, gstart, (size_t)n_ctx * sizeof(int64_t));
    for (Py_ssize_t j = 0; j < m; j++) {
        const int32_t e = ectx[j];
        if (e < 0 || e >= n_ctx || fill[e] >= gstart[e + 1]) {
            ret = -2;
            goto done;
        }
        granks[fill[e]++] = rank[j];
    }
    if (H)
        for (Py_ssize_t c = 0; c < n_ctx; c++)
            if (H->cstate[c] < 0 || H->cstate[c] >= H->n_states) {
                ret = -2;
                goto done;
            }

    rc_t rc = {0, 0xFFFFFFFFull, 0, 1, 4, out_cap, out};
    raw_t w = {0, 0, 0, rawcap + 8, raw};
    uint64_t ngroups = 0;
    for (Py_ssize_t c = 0; c < n_ctx; c++)
        ngroups += gcount[c] > 0;
    raw_gamma(&w, ngroups);
    uint16_t pq[2] = {1u << (PROB_BITS - 1), 1u << (PROB_BITS - 1)};
    Py_ssize_t prev_c = -1;
    for (Py_ssize_t c = 0; c < n_ctx; c++) {
        int64_t cnt = gcount[c];
        if (cnt == 0)
            continue;
        raw_gamma(&w, (uint64_t)(c - prev_c));
        prev_c = c;
        raw_gamma(&w, (uint64_t)cnt);
        const int64_t *g = granks + gstart[c];
        int64_t span = g[cnt - 1] + 1 - cnt;
        int k0 = (int)bitlen64((uint64_t)(span / cnt)) - 1;
        int best_k = 0;
        int64_t best_cost = -1;
        int klo = k0 - 1 > 0 ? k0 - 1 : 0, khi = k0 + 2 < 25 ? k0 + 2 : 25;
        /* The (up to) three candidates' costs in one pass over the gaps; ties go to the smallest k. */
        int64_t q0 = 0, q1 = 0, q2 = 0, prev_r = -1;
        if (g[0] < 0 || span < 0) {
            ret = -2;
            goto done;
        }
        for (int64_t j = 0; j < cnt; j++) {
            int64_t gap = g[j] - prev_r - 1;
            if (gap < 0) { /* ranks in a context strictly increase */
                ret = -2;
                goto done;
            }
            prev_r = g[j];
            q0 += gap >> klo;
            q1 += gap >> (klo + 1);
            q2 += gap >> (klo + 2);
        }
        const int64_t qs[3] = {q0, q1, q2};
        for (int k = klo; k < khi; k++) {
            int64_t cost = cnt * (k + 1) + qs[k - klo];
            if (best_cost < 0 || cost < best_cost) {
                best_cost = cost;
                best_k = k;
            }
        }
        raw_put(&w, (uint64_t)best_k, 5);
        int64_t prev = -1;
        const uint64_t kmask = (1ull << best_k) - 1;
        if (H) { /* encoding 5: qdepth decisions in the context's state's slots, then as below */
            const int32_t cs = H->cstate[c];
            if (cs < 0 || cs >= H->n_states) {
                ret = -2;
                goto done;
            }
            uint16_t *pqs = pqh + (Py_ssize_t)H->qdepth * cs;
            const uint64_t qd = (uint64_t)H->qdepth;
            for (int64_t j = 0; j < cnt; j++) {
                int64_t gap = g[j] - prev - 1;
                prev = g[j];
                uint64_t q = (uint64_t)gap >> best_k;
                for (uint64_t t = 0; t < qd; t++) {
                    rc_bit(&rc, pqs, (Py_ssize_t)t, q > t);
                    if (q <= t)
                        break;
                }
                if (q >= qd) {
                    q -= qd;
                    while (q >= 32) {
                        raw_put(&w, 0, 32);
                        q -= 32;
                    }
                    raw_put(&w, 1ull << q, (unsigned)q + 1);
                }
                raw_put56(&w, (uint64_t)gap, (unsigned)best_k);
            }
            continue;
        }
        for (int64_t j = 0; j < cnt; j++) {
            int64_t gap = g[j] - prev - 1;
            prev = g[j];
            uint64_t q = (uint64_t)gap >> best_k;
            /* Quotient: "q > 0" and "q > 1" through the range coder, the rest of the unary code raw,
             * then the k low bits; one raw put for both while they fit in 56 bits. */
            rc_bit(&rc, pq, 0, q > 0);
            rc_bit_if(&rc, pq, 1, q > 1, q > 0);
            if (__builtin_expect(q < 2, 1)) {
                raw_put56(&w, (uint64_t)gap, (unsigned)best_k);
            } else if (q - 1 + (uint64_t)best_k <= 56) {
                unsigned u = (unsigned)q - 1; /* q - 2 zeros and a one */
                raw_put56(&w, (1ull << (u - 1)) | (((uint64_t)gap & kmask) << u), u + (unsigned)best_k);
            } else {
                q -= 2;
                while (q >= 32) {
                    raw_put(&w, 0, 32);
                    q -= 32;
                }
                raw_put(&w, 1ull << q, (unsigned)q + 1);
                raw_put(&w, (uint64_t)gap, (unsigned)best_k);
            }
        }
    }
    for (Py_ssize_t i = 0; i < n_ctx * MAX_UNARY; i++)
        plen[i] = 1u << (PROB_BITS - 1);
    for (Py_ssize_t j = 0; j < m; j++) {
        uint64_t b = load_item(bvals, j, itemsize), t = load_item(tvals, j, itemsize);
        Py_ssize_t e = ectx[j];
        if (e < 0 || e >= n_ctx || ((b ^ t) & mask) == 0) { /* a change holds two values */
            ret = -2;
            goto done;
        }
        /* Sign and magnitude without a branch: the sign of a step is a coin flip (a branch on it cost a
         * third of this loop). */
        uint64_t d = (key_of(t, kind, sign, mask) - key_of(b, kind, sign, mask)) & mask;
        uint64_t neg = (d >> (bits - 1)) & 1, flip = 0 - neg;
        uint64_t mag = ((d ^ flip) - flip) & mask;
        unsigned ln = bitlen64(mag);
        uint16_t *pl = plen + e * MAX_UNARY;
        /* encoding 5, a state other than 0: the sign through the range coder, after the length */
        const int32_t h = H ? H->cstate[e] : 0;
        if (h < 0 || (H && h >= H->n_states)) {
            ret = -2;
            goto done;
        }
        if (__builtin_expect(ln == 1 && bits > 1, 1)) { /* a step of one ulp: most changes */
            rc_bit(&rc, pl, 0, 0);
            if (H && h)
                rc_bit(&rc, psign, h, neg ^ H->flip[j]);
            else
                raw_put56(&w, neg, 1);
            continue;
        }
        for (unsigned t2 = 0; t2 + 1 < ln; t2++)
            rc_bit(&rc, pl, t2, 1);
        if ((int)ln < bits)
            rc_bit(&rc, pl, ln - 1, 0);
        if (H && h) {
            rc_bit(&rc, psign, h, neg ^ H->flip[j]);
            raw_put(&w, mag, ln - 1);
        } else {
            raw_put(&w, neg | (mag << 1), ln);
        }
    }
    for (int k = 0; k < 5; k++)
        rc_shift_low(&rc);
    Py_ssize_t end = rc.opos;
    if (w.nacc > 0)
        raw_put(&w, 0, 8 - w.nacc);
    if (w.pos > rawcap || end + w.pos > out_cap) {
        ret = -5;
        goto done;
    }
    Py_ssize_t rc_len = end - 4;
    for (int k = 0; k < 4; k++)
        out[k] = (uint8_t)((rc_len >> (8 * k)) & 0xFF);
    memcpy(out + end, raw, (size_t)w.pos);
    ret = end + w.pos;
done:
    free(gcount);
    free(gstart);
    free(fill);
    free(granks);
    free(raw);
    free(plen);
    free(pqh);
    return ret;
}

#define SPECIALISE(size)                                                                                      \
    static Py_ssize_t encode_changes_##size(const int32_t *ectx, const int32_t *rank, const void *bv, const void *tv, \
                                            Py_ssize_t m, int bits, int kind, Py_ssize_t n_ctx, uint8_t *out,        \
                                            Py_ssize_t cap)                                                          \
    {                                                                                                                \
        return encode_changes_t(ectx, rank, bv, tv, m, size, bits, kind, n_ctx, out, cap, NULL);                     \
    }
SPECIALISE(1)
SPECIALISE(2)
SPECIALISE(4)
SPECIALISE(8)

static Py_ssize_t encode_changes_c(const int32_t *ectx, const int32_t *rank, const void *bvals, const void *tvals,
                                   Py_ssize_t m, int itemsize, int bits, int kind, Py_ssize_t n_ctx, uint8_t *out,
                                   Py_ssize_t out_cap)
{
    switch (itemsize) {
    case 1: return encode_changes_1(ectx, rank, bvals, tvals, m, bits, kind, n_ctx, out, out_cap);
    case 2: return encode_changes_2(ectx, rank, bvals, tvals, m, bits, kind, n_ctx, out, out_cap);
    case 4: return encode_changes_4(ectx, rank, bvals, tvals, m, bits, kind, n_ctx, out, out_cap);
    default: return encode_changes_8(ectx, rank, bvals, tvals, m, bits, kind, n_ctx, out, out_cap);
    }
}

static PyObject *py_encode_changes(PyObject *self, PyObject *args)
{
    PyObject *oe, *orank, *ob, *ot, *oout;
    int itemsize, bits, kind;
    Py_ssize_t n_ctx;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOiiinO", &oe, &orank, &ob, &ot, &itemsize, &bits, &kind, &n_ctx, &oout))
        return NULL;
    if ((itemsize != 1 && itemsize != 2 && itemsize != 4 && itemsize != 8) || bits < 1 || bits > 8 * itemsize ||
        kind < 0 || kind > 2 || n_ctx < 1 || n_ctx > 65536) {
        PyErr_SetString(PyExc_ValueError, "encode_changes: itemsize, bits, kind or n_ctx out of range");
        return NULL;
    }
    Py_buffer ve, vr, vb, vt, vo;
    if (PyObject_GetBuffer(oe, &ve, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    Py_ssize_t m = ve.len / 4;
    PyObject *ret = NULL;
    int got = 0;
    if (ve.len % 4 || ((uintptr_t)ve.buf) % 4 || m < 1) {
        PyErr_SetString(PyExc_ValueError, "encode_changes: ectx must be a non-empty aligned int32 array");
        goto done;
    }
    if (get_buf(orank, &vr, 0, 4 * m, 4, "rank") < 0) goto done;
    got++;
    if (get_buf(ob, &vb, 0, itemsize * m, (unsigned)itemsize, "bvals") < 0) goto done;
    got++;
    if (get_buf(ot, &vt, 0, itemsize * m, (unsigned)itemsize, "tvals") < 0) goto done;
    got++;
    if (get_buf(oout, &vo, 1, 9, 1, "out") < 0) goto done;
    got++;
    {
        const int32_t *ectx = ve.buf;
        for (Py_ssize_t j = 0; j < m; j++) {
            if (ectx[j] < 0 || ectx[j] >= n_ctx) {
                PyErr_Format(PyExc_ValueError, "encode_changes: context %d out of range", (int)ectx[j]);
                goto done;
            }
        }
        Py_ssize_t r;
        Py_BEGIN_ALLOW_THREADS
        r = encode_changes_c(ectx, vr.buf, vb.buf, vt.buf, m, itemsize, bits, kind, n_ctx, vo.buf, vo.len);
        Py_END_ALLOW_THREADS
        if (r == -7)
            PyErr_NoMemory();
        else if (r == -2)
            PyErr_SetString(PyExc_ValueError, "encode_changes: the changes are not a scan's (a context out of range, "
                            "ranks not increasing or equal values; changed while coded?)");
        else
            ret = PyLong_FromSsize_t(r);
    }
done:
    if (got >= 4) PyBuffer_Release(&vo);
    if (got >= 3) PyBuffer_Release(&vt);
    if (got >= 2) PyBuffer_Release(&vb);
    if (got >= 1) PyBuffer_Release(&vr);
    PyBuffer_Release(&ve);
    return ret;
}

static PyObject *py_scan16(PyObject *self, PyObject *args)
{
    PyObject *ob, *ot, *opos, *oectx, *orank, *obv, *otv, *oout = Py_None;
    unsigned shift, mask;
    Py_ssize_t n_ctx;
    int bits = 16, kind = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOIInOOOOO|iiO", &ob, &ot, &shift, &mask, &n_ctx, &opos, &oectx, &orank, &obv,
                          &otv, &bits, &kind, &oout))
        return NULL;
    if (shift > 15 || mask > 0xFFFF || n_ctx < 1 || n_ctx > 65536 || (Py_ssize_t)mask >= n_ctx || bits < 1 ||
        bits > 16 || kind < 0 || kind > 2) {
        PyErr_SetString(PyExc_ValueError, "scan16: context (shift, mask, n_ctx), bits or kind out of range");
        return NULL;
    }
    Py_buffer v[8];
    int got = 0;
    PyObject *ret = NULL;
    if (PyObject_GetBuffer(ob, &v[0], PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    got = 1;
    Py_ssize_t n = v[0].len / 2;
    if (v[0].len % 2 || n > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "scan16: base is not a whole number (< 2^31) of 16-bit elements");
        goto done;
    }
    if (((uintptr_t)v[0].buf) % 2) {
        PyErr_SetString(PyExc_BufferError, "scan16: base is not aligned to 2 bytes");
        goto done;
    }
    {
        PyObject *objs[6] = {ot, opos, oectx, orank, obv, otv};
        const char *names[6] = {"target", "pos", "ectx", "rank", "bvals", "tvals"};
        const unsigned size[6] = {2, 4, 4, 4, 2, 2};
        for (int k = 0; k < 6; k++) {
            if (get_buf(objs[k], &v[k + 1], k > 0, size[k] * n, size[k], names[k]) < 0)
                goto done;
            got++;
        }
    }
    if (v[1].len != v[0].len) {
        PyErr_SetString(PyExc_ValueError, "scan16: base and target differ in length");
        goto done;
    }
    if (oout != Py_None) {
        if (get_buf(oout, &v[7], 1, 9, 1, "out") < 0)
            goto done;
        got++;
    }
    {
        int32_t *counters = calloc(((size_t)mask + 1) * (LANES + 1), sizeof(int32_t)); /* + hot_window's */
        if (counters == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        out16 o = {v[2].buf, v[3].buf, v[4].buf, v[5].buf, v[6].buf};
        const uint16_t *b = v[0].buf, *t = v[1].buf;
        Py_ssize_t m, nbytes = 0;
        Py_BEGIN_ALLOW_THREADS
#if HAVE_AVX512_PATH
        if (have_avx512())
            m = scan16_avx512(b, t, n, shift, mask, counters, o);
        else
#endif
            m = scan16_tail(b, t, 0, n, shift, mask, counters, o, 0);
        if (oout != Py_None && m > 0)
            nbytes = encode_changes_2(o.ectx, o.rank, o.bvals, o.tvals, m, bits, kind, n_ctx, v[7].buf, v[7].len);
        Py_END_ALLOW_THREADS
        free(counters);
        if (nbytes == -7)
            PyErr_NoMemory();
        else if (nbytes == -2)
            PyErr_SetString(PyExc_ValueError, "scan16: the changes found are not consistent");
        else if (oout == Py_None)
            ret = PyLong_FromSsize_t(m);
        else
            ret = Py_BuildValue("(nn)", m, nbytes);
    }
done:
    while (got > 0)
        PyBuffer_Release(&v[--got]);
    return ret;
}

/* ------------------------------------------------------------------------------------------------
 * encode_hist16(base, target, hist, cmap, shift, mask, n_exp, n_ctx, pos, ectx, rank, bvals, tvals, flip,
 *               bits, kind, cstate, n_states, qdepth, out) -> (m, nbytes)
 *
 * kernels.hist_scan + kernels.ulp_encode_core (encoding 5) for 16-bit elements, in one call: element i's
 * context is cmap[(hist[i] & 127) * n_exp + exponent], its flip bit hist[i] >> 7. The scan counts in
 * four arrays, one per lane i % 4 (as scan16's portable path): a rank is their sum; with AVX-512 and
 * context_map's table, 32 elements at a time (scan_hist16_avx512, the same output). nbytes is the
 * coder's (0 when nothing changed, -5 when out is too small). The tables and the history are checked
 * (ValueError): a bad one would index outside the counters.
 * ------------------------------------------------------------------------------------------------ */

/* Elements [i, n) one by one, the m changes before them already out (the tail of the block loop below,
 * or a whole chunk on the portable path); -1 where a history state or a context is out of range. */
static Py_ssize_t scan_hist16(const uint16_t *b, const uint16_t *t, const uint8_t *hist, const int32_t *cmap,
                              unsigned shift, unsigned mask, Py_ssize_t n_exp, Py_ssize_t n_ctx, Py_ssize_t n_states,
                              Py_ssize_t i,
                              Py_ssize_t n, int32_t *c, out16 o, uint8_t *flip, Py_ssize_t m)
{
    for (; i < n; i++) {
        /* Each element, history byte and table entry read once and checked where it is used: the
         * caller's checks ran before the scan, and its buffers may change under it. */
        const unsigned h = hist[i];
        const uint16_t bi = b[i], ti = t[i];
        if ((Py_ssize_t)(h & 127) >= n_states)
            return -1;
        const int32_t e = cmap[(Py_ssize_t)(h & 127) * n_exp + (((unsigned)bi >> shift) & mask)];
        if (e < 0 || e >= n_ctx)
            return -1;
        if (bi != ti) {
            o.pos[m] = (int32_t)i;
            o.ectx[m] = e;
            int32_t r = 0;
            for (Py_ssize_t l = 0; l < LANES; l++)
                r += c[l * n_ctx + e];
            o.rank[m] = r;
            o.bvals[m] = bi;
            o.tvals[m] = ti;
            flip[m] = (uint8_t)(h >> 7);
            m++;
        }
        c[(i % LANES) * n_ctx + e]++;
    }
    return m;
}

/* Whether encoding 5's table is the one context_map makes, element context (state << ebits) | exponent
 * with n_exp = 2^ebits = mask + 1 exponent contexts and ids below 2^16: the contexts the vector scan
 * computes. Returns ebits, or -1 for any other table (the scan then looks each element up). */
static int hist_identity(const int32_t *cmap, Py_ssize_t n_exp, Py_ssize_t n_ctx, Py_ssize_t n_states, unsigned mask)
{
    if ((Py_ssize_t)mask + 1 != n_exp || (n_exp & (n_exp - 1)) || n_states * n_exp > 65536 || n_ctx < n_states * n_exp)
        return -1;
    for (Py_ssize_t x = 0; x < n_states * n_exp; x++)
        if (cmap[x] != (int32_t)x)
            return -1;
    return __builtin_ctzll((unsigned long long)n_exp);
}

#if HAVE_AVX512_PATH
/* scan_hist16 for context_map's table (hist_identity), 32 elements at a time, as scan16_avx512: the
 * counters are c's first array (the portable path's lane 0), exact after every block; the hot window
 * is state 0's (most elements have no recent move), counted with a compare and a popcount each per
 * block, and the other contexts (the elements with a recent move among them) one by one. States are
 * below n_states (checked by the caller), so contexts stay below n_ctx. */
__attribute__((target("avx512f,avx512bw,avx512vl,popcnt,bmi,bmi2")))
static Py_ssize_t scan_hist16_avx512(const uint16_t *b, const uint16_t *t, const uint8_t *hist, const int32_t *cmap,
                                     unsigned shift, unsigned mask, unsigned ebits, Py_ssize_t n_exp, Py_ssize_t n_ctx,
                                     Py_ssize_t n_states, Py_ssize_t n, int32_t *c, int32_t *scratch, out16 o,
                                     uint8_t *flip)
{
    if (mask + 1 < WINDOW)
        return scan_hist16(b, t, hist, cmap, shift, mask, n_exp, n_ctx, n_states, 0, n, c, o, flip, 0);
    Py_ssize_t m = 0, i = 0;
    const unsigned e0 = hot_window(b, n, shift, mask, scratch); /* state 0's contexts are the exponents */
    const __m512i vmask = _mm512_set1_epi16((short)mask), v127 = _mm512_set1_epi16(127);
    const __m128i vshift = _mm_cvtsi32_si128((int)shift), vebits = _mm_cvtsi32_si128((int)ebits);
    const __m512i ve0 = _mm512_set1_epi16((short)e0), vwin = _mm512_set1_epi16(WINDOW);
    __m512i vk[WINDOW];
    for (unsigned k = 0; k < WINDOW; k++)
        vk[k] = _mm512_set1_epi16((short)(e0 + k));
    int32_t *const hot = c + e0;
    /* Each block loaded once (as scan16_avx512), its history states checked in the registers used. */
    const __m512i vns = _mm512_set1_epi16((short)n_states);
    uint16_t eb[32], bb[32], tt[32];
    uint8_t hb[32];
    for (; i + 32 <= n; i += 32) {
        const __m512i vb = _mm512_loadu_si512((const void *)(b + i));
        const __m512i vt = _mm512_loadu_si512((const void *)(t + i));
        const __m256i vh8 = _mm256_loadu_si256((const __m256i *)(hist + i));
        const __m512i vh = _mm512_cvtepu8_epi16(vh8);
        if (_mm512_cmpge_epu16_mask(_mm512_and_si512(vh, v127), vns))
            return -1;
        const __m512i ve = _mm512_or_si512(_mm512_sll_epi16(_mm512_and_si512(vh, v127), vebits),
                                           _mm512_and_si512(_mm512_srl_epi16(vb, vshift), vmask));
        __mmask32 ch = _mm512_cmpneq_epu16_mask(vb, vt);
        uint32_t out = ~(uint32_t)_mm512_cmplt_epu16_mask(_mm512_sub_epi16(ve, ve0), vwin);
        if (ch | out)
            _mm512_storeu_si512((void *)eb, ve);
        if (ch) {
            _mm512_storeu_si512((void *)bb, vb);
            _mm512_storeu_si512((void *)tt, vt);
            _mm256_storeu_si256((__m256i *)hb, vh8);
        }
        while (ch) {
            const unsigned k = (unsigned)__builtin_ctz(ch);
            const unsigned ek = eb[k];
            const __mmask32 same = _mm512_cmpeq_epu16_mask(ve, _mm512_set1_epi16((short)ek));
            o.pos[m] = (int32_t)(i + k);
            o.ectx[m] = (int32_t)ek;
            o.rank[m] = c[ek] + __builtin_popcount((uint32_t)same & ((1u << k) - 1u));
            o.bvals[m] = bb[k];
            o.tvals[m] = tt[k];
            flip[m] = (uint8_t)(hb[k] >> 7);
            m++;
            ch &= ch - 1;
        }
        for (unsigned k = 0; k < WINDOW; k++)
            hot[k] += __builtin_popcount((uint32_t)_mm512_cmpeq_epu16_mask(ve, vk[k]));
        while (out) {
            c[eb[__builtin_ctz(out)]]++;
            out &= out - 1;
        }
    }
    /* The tail counts with the portable path's lanes; lanes 1-3 start at zero, so ranks stay sums. */
    return m < 0 ? m : scan_hist16(b, t, hist, cmap, shift, mask, n_exp, n_ctx, n_states, i, n, c, o, flip, m);
}
#endif

/* The largest history state (hist & 127) among n bytes (a plain reduction the compiler vectorizes). */
static unsigned max_state(const uint8_t *hist, Py_ssize_t n)
{
    uint8_t mx = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint8_t h = hist[i] & 127;
        mx = h > mx ? h : mx;
    }
    return mx;
}

/* encoding 5's tables: 0 when cstate's n_ctx entries lie in [0, n_states), cmap's n_states * n_exp
 * entries (it holds at least as many) in [0, n_ctx), and every history state below n_states; else -2. */
static int hist_tables_ok(const uint8_t *hist, Py_ssize_t n, const int32_t *cmap, const int32_t *cstate,
                          Py_ssize_t n_ctx, Py_ssize_t n_exp, Py_ssize_t n_states)
{
    for (Py_ssize_t c = 0; c < n_ctx; c++)
        if (cstate[c] < 0 || cstate[c] >= n_states)
            return -2;
    for (Py_ssize_t x = 0; x < n_states * n_exp; x++)
        if (cmap[x] < 0 || cmap[x] >= n_ctx)
            return -2;
    return (Py_ssize_t)max_state(hist, n) < n_states ? 0 : -2;
}

static PyObject *py_encode_hist16(PyObject *self, PyObject *args)
{
    PyObject *ob, *ot, *oh, *ocmap, *opos, *oectx, *orank, *obv, *otv, *oflip, *ocs, *oout;
    unsigned shift, mask;
    Py_ssize_t n_exp, n_ctx;
    int bits, kind, n_states, qdepth;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOIInnOOOOOOiiOiiO", &ob, &ot, &oh, &ocmap, &shift, &mask, &n_exp, &n_ctx, &opos,
                          &oectx, &orank, &obv, &otv, &oflip, &bits, &kind, &ocs, &n_states, &qdepth, &oout))
        return NULL;
    if (shift > 15 || mask > 0xFFFF || n_exp < 1 || (Py_ssize_t)mask >= n_exp || n_ctx < 1 || n_ctx > (1 << 24) ||
        n_states < 1 || n_states > 128 || qdepth < 1 || qdepth > 4096 || (Py_ssize_t)n_states * n_exp > (1 << 24) ||
        bits < 1 || bits > 16 || kind < 0 || kind > 2) {
        PyErr_SetString(PyExc_ValueError,
                        "encode_hist16: context (shift, mask, n_exp, n_ctx), states, qdepth, bits or kind out of range");
        return NULL;
    }
    Py_buffer v[12];
    int got = 0;
    PyObject *ret = NULL;
    if (PyObject_GetBuffer(ob, &v[0], PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    got = 1;
    const Py_ssize_t n = v[0].len / 2;
    if (v[0].len % 2 || n > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "encode_hist16: base is not a whole number (< 2^31) of 16-bit elements");
        goto done;
    }
    if (((uintptr_t)v[0].buf) % 2) {
        PyErr_SetString(PyExc_BufferError, "encode_hist16: base is not aligned to 2 bytes");
        goto done;
    }
    {
        PyObject *objs[11] = {ot, oh, ocmap, ocs, opos, oectx, orank, obv, otv, oflip, oout};
        const char *names[11] = {"target", "hist", "cmap", "cstate", "pos", "ectx", "rank", "bvals", "tvals", "flip", "out"};
        const Py_ssize_t need[11] = {2 * n, n, 4 * (Py_ssize_t)n_states * n_exp, 4 * n_ctx, 4 * n, 4 * n, 4 * n,
                                     2 * n, 2 * n, n, 9};
        const unsigned align[11] = {2, 1, 4, 4, 4, 4, 4, 2, 2, 1, 1};
        for (int k = 0; k < 11; k++) {
            if (get_buf(objs[k], &v[k + 1], k >= 4, need[k], align[k], names[k]) < 0)
                goto done;
            got++;
        }
    }
    if (v[1].len != v[0].len || v[2].len != n) {
        PyErr_SetString(PyExc_ValueError, "encode_hist16: base, target and hist differ in length");
        goto done;
    }
    if (hist_tables_ok(v[2].buf, n, v[3].buf, v[4].buf, n_ctx, n_exp, n_states) != 0) {
        PyErr_SetString(PyExc_ValueError, "encode_hist16: a history state, cmap or cstate entry is out of range");
        goto done;
    }
    {
        /* the counters, then hot_window's scratch (mask + 1) */
        int32_t *counters = calloc((size_t)n_ctx * LANES + mask + 1, sizeof(int32_t));
        if (counters == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        out16 o = {v[5].buf, v[6].buf, v[7].buf, v[8].buf, v[9].buf};
        uint8_t *flip = v[10].buf;
        const hmodel_t H = {v[4].buf, n_states, qdepth, flip};
        const int ebits = have_avx512() ? hist_identity(v[3].buf, n_exp, n_ctx, n_states, mask) : -1;
        Py_ssize_t m, nbytes = 0;
        Py_BEGIN_ALLOW_THREADS
#if HAVE_AVX512_PATH
        if (ebits >= 0)
            m = scan_hist16_avx512(v[0].buf, v[1].buf, v[2].buf, v[3].buf, shift, mask, (unsigned)ebits, n_exp, n_ctx,
                                   n_states, n, counters, counters + (size_t)n_ctx * LANES, o, flip);
        else
#endif
            m = scan_hist16(v[0].buf, v[1].buf, v[2].buf, v[3].buf, shift, mask, n_exp, n_ctx, n_states, 0, n,
                            counters, o, flip, 0);
        if (m > 0)
            nbytes = encode_changes_t(o.ectx, o.rank, o.bvals, o.tvals, m, 2, bits, kind, n_ctx, v[11].buf,
                                      v[11].len, &H);
        Py_END_ALLOW_THREADS
        free(counters);
        if (m < 0 || nbytes == -2)
            PyErr_SetString(PyExc_ValueError, "encode_hist16: a history state, cmap or cstate entry is out of "
                            "range (changed during the scan)");
        else if (nbytes == -7)
            PyErr_NoMemory();
        else
            ret = Py_BuildValue("(nn)", m, nbytes);
    }
done:
    while (got > 0)
        PyBuffer_Release(&v[--got]);
    return ret;
}

/* ------------------------------------------------------------------------------------------------
 * decode_ulp(base, payload, n_changed, itemsize, bits, kind, shift, mask, n_ctx, out_pos, out_val) -> status
 *
 * kernels.ulp_decode, output for output and status for status (kernels.STATUS): the group section
 * (range decoder and raw bit reader), the rank-to-position pass over the base, the ulp distances and
 * the target bits. The payload is hostile: the readers keep numba's state (a byte past either part
 * reads as zero and sets a flag, checked where numba checks it), so a malformed payload takes the same
 * path to the same status; no read or write leaves the buffers.
 *
 * Positions: the r-th element of context e is the next change of group e. For 16-bit and 8-bit floats
 * the base is taken in blocks of 64 elements: the block's contexts (one byte each) are compared with
 * each context that still has changes (with AVX-512, AVX2 or SSE2, chosen at run time), each mask's
 * popcount is subtracted from its context's countdown (in vectors), and only the contexts whose next
 * change falls in the block (a bit mask over the contexts, without a branch per context) are visited;
 * the block's changes are then emitted in position order from a 64-bit mask. Contexts without changes
 * cost nothing, and one whose group is exhausted leaves the list. The AVX-512 passes (pos_avx512 and,
 * with GFNI, BITALG and VBMI2, pos_gfni, which counts a window of 16 contexts at once) keep each
 * block's work in one function and select the due contexts' changes without a branch on the data in
 * nearly every block. The passes write the same positions (tests hold each to numba's). While more than BLOCK_CTX contexts
 * have changes left, elements are counted one by one (numba's countdown, "scalar"), which costs the
 * same for any number of contexts; so do 32- and 64-bit floats (up to 2048 contexts) and machines
 * without SSE2 and popcnt. One-context dtypes (integers) need no pass: a change's rank is its position.
 * ------------------------------------------------------------------------------------------------ */

#define BLOCK_CTX 32            /* contexts the block path compares against at most */
#define BLOCK_IDLE (1 << 30)    /* block path: countdown of a context with no change left */
#define BLOCK_MAX_N (1 << 29)   /* ... which stays above any count in chunks up to this many elements */
#define DEC_HUGE (INT64_MAX / 4) /* countdown of a context with no change left: never reaches zero */

typedef struct {
    uint64_t code, range;
    int64_t pos;
    int bad;
} rcd_t;

/* The raw bit stream: bp bits read from byte `start` on; `avail` = 8 * (lim - start). numba's reader
 * loads a byte only when it needs one of its bits, so after bp bits it has loaded ceil(bp / 8) bytes and
 * its overrun flag is set exactly when bp > avail; its leftover bits are the upper ones of the last byte
 * loaded. Here the same state is a bit position, read 57 bits at a time. */
typedef struct {
    const uint8_t *buf;
    int64_t start, lim, bp, avail;
} rawr_t;

/* c ? a : b for c in {0, 1}, as a conditional move (GCC may otherwise branch on c). */
static inline uint64_t csel(uint64_t c, uint64_t a, uint64_t b)
{
#if HAVE_AVX512_PATH
    __asm__("test %1, %1\n\tcmovnz %2, %0" : "+r"(b) : "r"(c), "r"(a) : "cc");
    return b;
#else
    return c ? a : b;
#endif
}

/* Decode one bit, or nothing when active == 0 (the gap code's conditional second bit), with selects
 * rather than branches (the bits are coin flips). At most one renormalisation step follows a bit (see
 * rc_bit_if), but a loop costs nothing and states numba's rule. */
static inline uint64_t rcd_bit_if(rcd_t *s, const uint8_t *buf, int64_t lim, uint16_t *probs, Py_ssize_t idx,
                                  uint64_t active)
{
    uint64_t p = probs[idx], bound = (s->range >> PROB_BITS) * p;
    uint64_t bit = s->code >= bound;
    uint64_t up = p + (((1u << PROB_BITS) - p) >> MOVE_BITS), down = p - (p >> MOVE_BITS);
    uint64_t ncode = bit ? s->code - bound : s->code, nrange = bit ? s->range - bound : bound;
    s->code = active ? ncode : s->code;
    s->range = active ? nrange : s->range;
    probs[idx] = (uint16_t)(active ? (bit ? down : up) : p);
    while (__builtin_expect(s->range < RC_TOP, 0)) {
        s->range = (s->range << 8) & 0xFFFFFFFFull;
        uint64_t v = 0;
        if (s->pos < lim)
            v = buf[s->pos];
        else
            s->bad = 1;
        s->pos++;
        s->code = ((s->code << 8) | v) & 0xFFFFFFFFull;
    }
    return bit & active;
}

static inline uint64_t rcd_bit(rcd_t *s, const uint8_t *buf, int64_t lim, uint16_t *probs, Py_ssize_t idx)
{
    return rcd_bit_if(s, buf, lim, probs, idx, 1);
}

/* The next 57 or more bits (zeros past lim). */
static inline uint64_t rawr_peek(const rawr_t *r)
{
    int64_t byte = r->start + (r->bp >> 3);
    uint64_t w = 0;
    if (__builtin_expect(byte + 8 <= r->lim, 1)) {
        memcpy(&w, r->buf + byte, 8);
    } else {
        for (int k = 0; k < 8 && byte + k < r->lim; k++)
            w |= (uint64_t)r->buf[byte + k] << (8 * k);
    }
    return w >> (r->bp & 7);
}

static inline int rawr_bad(const rawr_t *r) { return r->bp > r->avail; }

static inline uint64_t rawr_get(rawr_t *r, int nbits) /* nbits <= 64 */
{
    uint64_t v;
    if (nbits > 56) {
        v = rawr_peek(r) & 0xFFFFFFFFull;
        r->bp += 32;
        v |= (rawr_peek(r) & ((1ull << (nbits - 32)) - 1)) << 32;
        r->bp += nbits - 32;
        return v;
    }
    v = rawr_peek(r) & ((1ull << nbits) - 1);
    r->bp += nbits;
    return v;
}

/* Elias gamma; 0 for a malformed code. numba reads it bit by bit and gives up after a zero bit that
 * is the 40th or leaves the stream overrun; the zeros come first, so that is: 40 or more zeros, or
 * zeros reaching past the end. (Callers refuse a 0 at once: the position after it does not matter.) */
static inline uint64_t rawr_gamma(rawr_t *r)
{
    unsigned z = (unsigned)__builtin_ctzll(rawr_peek(r) | (1ull << 56));
    if (z > 0 && (z >= 40 || r->bp + z > r->avail))
        return 0;
    r->bp += z + 1;
    return (1ull << z) | rawr_get(r, (int)z);
}

/* The rest of a gap quotient's unary code (q >= qd, the decisions through the range coder): numba's
 * loop adds one per zero bit and stops at a one or at the first bit read past the end (consumed either
 * way), refusing (-3) once q << k reaches n. Returns q, or -3. */
static inline int64_t rawr_unary(rawr_t *r, int k, int64_t n, int64_t qd)
{
    const int64_t room = r->avail - r->bp > 0 ? r->avail - r->bp : 0; /* zeros it can add before overrun */
    int64_t t = 0;
    for (;;) {
        r->bp += t; /* peek at bp + t */
        uint64_t w = rawr_peek(r);
        r->bp -= t;
        unsigned z = (unsigned)__builtin_ctzll(w | (1ull << 56));
        t += z;
        if (z < 56 || t >= room || ((qd + t) << k) >= n)
            break;
    }
    if (t > room)
        t = room;
    if (t >= 1 && ((qd + t) << k) >= n)
        return -3;
    r->bp += t + 1;
    return qd + t;
}

/* kernels.ulp_groups_core: fills granks (grouped by context, ascending within a group), gbeg and gend
 * (zeroed by the caller); leaves the streams where the values start. H: NULL for encoding 1 (two
 * quotient decisions, one slot pair), else encoding 5's model (tables checked by the caller) with
 * pqh, its qdepth * n_states quotient slots. Inlined into one copy each (dec_groups, dec_groups_hist). */
static inline __attribute__((always_inline)) int dec_groups_t(const uint8_t *pl, int64_t plen, int64_t n_changed,
                                                              int64_t n, int64_t n_ctx, int64_t *gbeg, int64_t *gend,
                                                              int64_t *granks, rcd_t *s_out, rawr_t *r_out,
                                                              int64_t *rc_end_out, const hmodel_t *H, uint16_t *pqh)
{
    if (n_changed <= 0 || n_changed > n)
        return -4;
    if (plen < 9)
        return -1;
    int64_t rc_len = (int64_t)pl[0] | (int64_t)pl[1] << 8 | (int64_t)pl[2] << 16 | (int64_t)pl[3] << 24;
    int64_t rc_end = 4 + rc_len;
    if (rc_len < 5 || rc_end > plen)
        return -1;
    uint64_t code = 0;
    for (int k = 0; k < 5; k++)
        code = ((code << 8) | pl[4 + k]) & 0xFFFFFFFFull;
    rcd_t s = {code, 0xFFFFFFFFull, 9, 0};
    rawr_t r = {pl, rc_end, plen, 0, 8 * (plen - rc_end)};
    int64_t ngroups = (int64_t)rawr_gamma(&r);
    if (ngroups <= 0 || ngroups > n_ctx)
        return -2;
    uint16_t pq[2] = {1u << (PROB_BITS - 1), 1u << (PROB_BITS - 1)};
    int64_t c = -1, total = 0;
    for (int64_t gi = 0; gi < ngroups; gi++) {
        int64_t dc = (int64_t)rawr_gamma(&r);
        if (dc <= 0 || c + dc >= n_ctx)
            return -2;
        c += dc;
        int64_t cnt = (int64_t)rawr_gamma(&r);
        if (cnt <= 0)
            return -2;
        if (total + cnt > n_changed)
            return -4;
        int k = (int)rawr_get(&r, 5);
        if (k > 24)
            return -2;
        gbeg[c] = total;
        int64_t prev = -1;
        const int64_t qd = H ? H->qdepth : 2;
        uint16_t *const pqs = H ? pqh + qd * H->cstate[c] : pq;
        for (int64_t j = 0; j < cnt; j++) {
            int64_t q;
            if (H) {
                q = 0;
                while (q < qd && rcd_bit(&s, pl, rc_end, pqs, q))
                    q++;
            } else {
                uint64_t b0 = rcd_bit(&s, pl, rc_end, pq, 0);
                q = (int64_t)(b0 + rcd_bit_if(&s, pl, rc_end, pq, 1, b0));
            }
            /* q == qd (for encoding 1 a quarter of the gaps, at random): the unary rest without a branch
             * while it is short, within the stream and legal (rawr_unary's result then); else rawr_unary. */
            /* One load of the raw stream per gap: the unary rest and the k low bits both come from
             * the 57 bits it gives, where they fit (z + 1 + k <= 57), else rawr_get reads again. */
            const uint64_t w = rawr_peek(&r);
            const int64_t z = __builtin_ctzll(w | (1ull << 56));
            const uint64_t is2 = q == qd;
            const uint64_t fast = (uint64_t)(z < 56) & (uint64_t)(z < r.avail - r.bp) & (uint64_t)(((qd + z) << k) < n);
            int64_t g;
            if (__builtin_expect(is2 & (fast ^ 1), 0)) {
                q = rawr_unary(&r, k, n, qd);
                if (q < 0)
                    return -3;
                g = (int64_t)rawr_get(&r, k);
            } else {
                const int64_t used = (z + 1) & (0 - (int64_t)is2);
                q += z & (0 - (int64_t)is2);
                if (__builtin_expect(used + k <= 57, 1)) {
                    g = (int64_t)((w >> used) & ((1ull << k) - 1));
                    r.bp += used + k;
                } else {
                    r.bp += used;
                    g = (int64_t)rawr_get(&r, k);
                }
            }
            int64_t rk = prev + 1 + ((q << k) | g);
            if (rk >= n)
                return -3;
            granks[total + j] = rk;
            prev = rk;
        }
        total += cnt;
        gend[c] = total;
        if (s.bad || rawr_bad(&r))
            return -1;
    }
    if (total != n_changed)
        return -4;
    *s_out = s;
    *r_out = r;
    *rc_end_out = rc_end;
    return 0;
}

static __attribute__((noinline)) int dec_groups(const uint8_t *pl, int64_t plen, int64_t n_changed, int64_t n,
                                                int64_t n_ctx, int64_t *gbeg, int64_t *gend, int64_t *granks,
                                                rcd_t *s_out, rawr_t *r_out, int64_t *rc_end_out)
{
    return dec_groups_t(pl, plen, n_changed, n, n_ctx, gbeg, gend, granks, s_out, r_out, rc_end_out, NULL, NULL);
}

static __attribute__((noinline)) int dec_groups_hist(const uint8_t *pl, int64_t plen, int64_t n_changed, int64_t n,
                                                     int64_t n_ctx, int64_t *gbeg, int64_t *gend, int64_t *granks,
                                                     rcd_t *s_out, rawr_t *r_out, int64_t *rc_end_out,
                                                     const hmodel_t *H, uint16_t *pqh)
{
    return dec_groups_t(pl, plen, n_changed, n, n_ctx, gbeg, gend, granks, s_out, r_out, rc_end_out, H, pqh);
}

static inline uint64_t unkey_of(uint64_t k, int kind, uint64_t sign, uint64_t mask)
{
    if (kind == KIND_FLOAT) { /* sign set: k ^ sign; else mask - k = k ^ mask. Without a branch: signs are coin flips */
        uint64_t pos = ((k & sign) != 0) - 1ull; /* all ones when the sign bit is clear */
        return k ^ (sign ^ (pos & (mask ^ sign)));
    }
    if (kind == KIND_INT)
        return k ^ sign;
    return k;
}

static inline uint64_t load_u(const uint8_t *p, int64_t j, int itemsize) /* any alignment */
{
    uint8_t b1;
    uint16_t b2;
    uint32_t b4;
    uint64_t b8;
    switch (itemsize) {
    case 1: memcpy(&b1, p + j, 1); return b1;
    case 2: memcpy(&b2, p + 2 * j, 2); return b2;
    case 4: memcpy(&b4, p + 4 * j, 4); return b4;
    default: memcpy(&b8, p + 8 * j, 8); return b8;
    }
}

typedef struct {
    const int64_t *gend, *granks;
    int64_t *ptr, *nxt; /* per context: next change's index in granks, elements to skip before it */
    int64_t *out_pos;
    int32_t *out_ctx;
    int64_t o, active; /* changes emitted, contexts with changes left */
    int64_t cap;       /* entries out_pos and out_ctx hold (n_changed) */
} posst_t;

/* numba's countdown over elements [i, end) of any item size: element i's context is its exponent field,
 * or with hist (encoding 5) cmap[(hist[i] & 127) * n_exp + exponent]. One loop for both: every caller
 * passes hist as a constant or always the same pointer, so the test folds away where it is NULL. */
static inline __attribute__((always_inline)) void pos_count_t(posst_t *P, const uint8_t *base, const uint8_t *hist,
                                                              const int32_t *cmap, int64_t n_exp, int64_t i,
                                                              int64_t end, int itemsize, unsigned shift, uint64_t cm)
{
    /* The state in locals: stores through nxt could alias P's fields, and the compiler would reload them
     * for every element. */
    int64_t *const nxt = P->nxt, *const ptr = P->ptr, *const out_pos = P->out_pos;
    const int64_t *const gend = P->gend, *const granks = P->granks;
    int32_t *const out_ctx = P->out_ctx;
    int64_t o = P->o, active = P->active;
    for (; i < end; i++) {
        const int64_t x = (int64_t)((load_u(base, i, itemsize) >> shift) & cm);
        const int64_t e = hist ? cmap[(int64_t)(hist[i] & 127) * n_exp + x] : x; /* hist: a constant at each use */
        int64_t c = nxt[e];
        nxt[e] = c - 1; /* unconditional: the rare change rewrites it */
        if (__builtin_expect(c == 0, 0)) {
            out_pos[o] = i;
            out_ctx[o] = (int32_t)e;
            o++;
            int64_t p = ++ptr[e];
            if (p < gend[e]) {
                nxt[e] = granks[p] - granks[p - 1] - 1;
            } else {
                nxt[e] = DEC_HUGE;
                if (--active == 0)
                    break;
            }
        }
    }
    P->o = o;
    P->active = active;
}

/* numba's countdown over elements [i, end) of any item size (kernels.ulp_positions). */
static inline __attribute__((always_inline)) void pos_scalar_t(posst_t *P, const uint8_t *base, int64_t i, int64_t end,
                                                               int itemsize, unsigned shift, uint64_t cm)
{
    pos_count_t(P, base, NULL, NULL, 0, i, end, itemsize, shift, cm);
}
static __attribute__((noinline)) void pos_scalar(posst_t *P, const uint8_t *base, int64_t i, int64_t end, int itemsize, unsigned shift,
                       uint64_t cm)
{
    switch (itemsize) {
    case 1: pos_scalar_t(P, base, i, end, 1, shift, cm); break;
    case 2: pos_scalar_t(P, base, i, end, 2, shift, cm); break;
    case 4: pos_scalar_t(P, base, i, end, 4, shift, cm); break;
    default: pos_scalar_t(P, base, i, end, 8, shift, cm); break;
    }
}

/* Block kernels: the 64 contexts of elements b[0..64) (of 2 or 1 bytes: for 1, shift + exponent bits
 * <= 8, so a 16-bit shift moves no bit of the next byte into the field) into ctxb, and for each of the na contexts in
 * actx the mask of the block's lanes holding it and its popcount; each countdown nx[k] goes down by the
 * popcount. Returns the contexts whose next change lies in the block (bit k: nx[k] < popcount). The
 * arrays hold BLOCK_CTX entries, those past na padded (pcs 0, nx BLOCK_IDLE): the countdowns are
 * updated BLOCK_CTX at a time, in vectors. */
typedef uint64_t (*blockfn_t)(const uint8_t *b, int itemsize, unsigned shift, unsigned cm, const uint8_t *actx,
                              int na, uint64_t *masks, int32_t *pcs, int32_t *nx, uint8_t *ctxb);

#if HAVE_AVX512_PATH
__attribute__((target("avx2,popcnt"))) static uint64_t block_avx2(const uint8_t *b, int itemsize, unsigned shift, unsigned cm,
                                                               const uint8_t *actx, int na, uint64_t *masks,
                                                               int32_t *pcs, int32_t *nx, uint8_t *ctxb)
{
    const __m128i vs = _mm_cvtsi32_si128((int)shift);
    __m256i e0, e1;
    if (itemsize == 1) {
        const __m256i vm = _mm256_set1_epi8((char)cm);
        e0 = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)b), vs), vm);
        e1 = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(b + 32)), vs), vm);
    } else {
        const __m256i vm = _mm256_set1_epi16((short)cm);
        __m256i x0 = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)b), vs), vm);
        __m256i x1 = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(b + 32)), vs), vm);
        __m256i x2 = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(b + 64)), vs), vm);
        __m256i x3 = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(b + 96)), vs), vm);
        e0 = _mm256_permute4x64_epi64(_mm256_packus_epi16(x0, x1), 0xD8);
        e1 = _mm256_permute4x64_epi64(_mm256_packus_epi16(x2, x3), 0xD8);
    }
    _mm256_storeu_si256((__m256i *)ctxb, e0);
    _mm256_storeu_si256((__m256i *)(ctxb + 32), e1);
    uint64_t due = 0;
    for (int k = 0; k < na; k++) {
        __m256i v = _mm256_set1_epi8((char)actx[k]);
        uint64_t m = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(e0, v)) |
                     (uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(e1, v)) << 32;
        masks[k] = m;
        pcs[k] = __builtin_popcountll(m);
    }
    for (int k = 0; k < na; k += 8) {
        __m256i vp = _mm256_loadu_si256((const __m256i *)(pcs + k)), vx = _mm256_loadu_si256((const __m256i *)(nx + k));
        due |= (uint64_t)(unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(vp, vx))) << k;
        _mm256_storeu_si256((__m256i *)(nx + k), _mm256_sub_epi32(vx, vp));
    }
    return due;
}

__attribute__((target("sse2,popcnt"))) static uint64_t block_sse2(const uint8_t *b, int itemsize, unsigned shift, unsigned cm,
                                                               const uint8_t *actx, int na, uint64_t *masks,
                                                               int32_t *pcs, int32_t *nx, uint8_t *ctxb)
{
    const __m128i vs = _mm_cvtsi32_si128((int)shift);
    __m128i e[4];
    for (int q = 0; q < 4; q++) {
        if (itemsize == 1) {
            e[q] = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(b + 16 * q)), vs),
                                 _mm_set1_epi8((char)cm));
        } else {
            const __m128i vm = _mm_set1_epi16((short)cm);
            __m128i lo = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(b + 32 * q)), vs), vm);
            __m128i hi = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(b + 32 * q + 16)), vs), vm);
            e[q] = _mm_packus_epi16(lo, hi);
        }
        _mm_storeu_si128((__m128i *)(ctxb + 16 * q), e[q]);
    }
    uint64_t due = 0;
    for (int k = 0; k < na; k++) {
        __m128i v = _mm_set1_epi8((char)actx[k]);
        uint64_t m = (uint64_t)(uint16_t)_mm_movemask_epi8(_mm_cmpeq_epi8(e[0], v)) |
                     (uint64_t)(uint16_t)_mm_movemask_epi8(_mm_cmpeq_epi8(e[1], v)) << 16 |
                     (uint64_t)(uint16_t)_mm_movemask_epi8(_mm_cmpeq_epi8(e[2], v)) << 32 |
                     (uint64_t)(uint16_t)_mm_movemask_epi8(_mm_cmpeq_epi8(e[3], v)) << 48;
        masks[k] = m;
        pcs[k] = __builtin_popcountll(m);
    }
    for (int k = 0; k < na; k += 4) {
        __m128i vp = _mm_loadu_si128((const __m128i *)(pcs + k)), vx = _mm_loadu_si128((const __m128i *)(nx + k));
        due |= (uint64_t)(unsigned)_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpgt_epi32(vp, vx))) << k;
        _mm_storeu_si128((__m128i *)(nx + k), _mm_sub_epi32(vx, vp));
    }
    return due;
}
#endif

static uint8_t select_in_byte[256][8]; /* [byte][j]: the lane of its j-th set bit */

static void init_select(void)
{
    for (int v = 0; v < 256; v++) {
        int j = 0;
        for (int l = 0; l < 8; l++)
            if (v >> l & 1)
                select_in_byte[v][j++] = (uint8_t)l;
    }
}

/* The lane of the x-th (from 0) set bit of m; x < popcount(m). Branch-free broadword select. */
static inline unsigned select64(uint64_t m, uint64_t x)
{
    const uint64_t L = 0x0101010101010101ull, H = 0x8080808080808080ull;
    uint64_t s = m - ((m >> 1) & 0x5555555555555555ull);
    s = (s & 0x3333333333333333ull) + ((s >> 2) & 0x3333333333333333ull);
    s = ((s + (s >> 4)) & 0x0F0F0F0F0F0F0F0Full) * L; /* byte j: set bits in bytes 0..j */
    uint64_t gt = ((s | H) - (x + 1) * L) & H;        /* bytes whose count exceeds x */
    unsigned byte = (unsigned)__builtin_ctzll(gt) >> 3;
    unsigned before = (unsigned)(((s << 8) >> (8 * byte)) & 0xFF);
    return 8 * byte + select_in_byte[(m >> (8 * byte)) & 0xFF][x - before];
}


/* Positions of 16-bit float elements (contexts fit a byte). */
static inline __attribute__((always_inline)) void pos_block_t(posst_t *P, const uint8_t *base, int64_t n,
                                                             int itemsize, unsigned shift, unsigned cm,
                                                             int64_t n_ctx, blockfn_t fn)
{
    uint8_t actx[BLOCK_CTX], ctxb[64];
    uint64_t masks[BLOCK_CTX];
    int32_t pcs[BLOCK_CTX], nx[BLOCK_CTX];
    for (int k = 0; k < BLOCK_CTX; k++) {
        pcs[k] = 0;
        nx[k] = BLOCK_IDLE;
    }
    int64_t i = 0;
    /* Element by element while many contexts have changes left. */
    while (P->active > BLOCK_CTX && i + 64 <= n) {
        pos_scalar_t(P, base, i, i + 64, itemsize, shift, cm);
        i += 64;
    }
    if (P->active == 0 || P->active > BLOCK_CTX) {
        if (P->active)
            pos_scalar(P, base, i, n, itemsize, shift, cm);
        return;
    }
    int na = 0;
    for (int64_t e = 0; e < n_ctx; e++)
        if (P->nxt[e] < DEC_HUGE / 2) {
            actx[na] = (uint8_t)e;
            nx[na++] = (int32_t)P->nxt[e]; /* < n <= BLOCK_MAX_N */
        }
    for (; na > 0 && i + 64 <= n; i += 64) {
        uint64_t due = fn(base + itemsize * i, itemsize, shift, cm, actx, na, masks, pcs, nx, ctxb);
        if (!due)
            continue;
        uint64_t chg = 0;
        int gone = 0;
        while (due) {
            int k = __builtin_ctzll(due);
            due &= due - 1;
            int64_t e = actx[k], pc = pcs[k], x = nx[k] + pc;
            const uint64_t m = masks[k];
            for (;;) {
                chg |= 1ull << select64(m, (uint64_t)x);
                int64_t p = ++P->ptr[e];
                if (p >= P->gend[e]) {
                    x = BLOCK_IDLE;
                    gone = 1;
                    break;
                }
                x += P->granks[p] - P->granks[p - 1];
                if (x >= pc)
                    break;
            }
            nx[k] = (int32_t)(x - pc);
        }
        /* Emit in position order. Up to four changes (nearly every block) without a loop whose exit
         * would mispredict: four entries are written, the ones past the block's count to be
         * overwritten by the next block's (or left past the end of the changes, inside the arrays). */
        const int cnt = __builtin_popcountll(chg);
        if (__builtin_expect(cnt <= 4 && P->o + 4 <= P->cap, 1)) {
            for (int t = 0; t < 4; t++) {
                int l = __builtin_ctzll(chg | (1ull << 63));
                chg &= chg - 1;
                P->out_pos[P->o + t] = i + l;
                P->out_ctx[P->o + t] = ctxb[l];
            }
            P->o += cnt;
        } else {
            while (chg) {
                int l = __builtin_ctzll(chg);
                chg &= chg - 1;
                P->out_pos[P->o] = i + l;
                P->out_ctx[P->o] = ctxb[l];
                P->o++;
            }
        }
        if (gone) { /* drop the exhausted contexts */
            int w = 0;
            for (int k = 0; k < na; k++)
                if (nx[k] < BLOCK_IDLE / 2) {
                    actx[w] = actx[k];
                    nx[w++] = nx[k];
                }
            P->active -= na - w;
            for (int k = w; k < na; k++) { /* the padding again */
                pcs[k] = 0;
                nx[k] = BLOCK_IDLE;
            }
            na = w;
        }
    }
    if (na == 0)
        return;
    for (int64_t e = 0; e < n_ctx; e++)
        P->nxt[e] = DEC_HUGE;
    for (int k = 0; k < na; k++)
        P->nxt[actx[k]] = nx[k];
    pos_scalar(P, base, i, n, itemsize, shift, cm);
}

/* (popcnt: every kernel it runs with needs it, and without it GCC calls a function per popcount) */
#if HAVE_AVX512_PATH
__attribute__((target("popcnt")))
#endif
static __attribute__((noinline)) void pos_block(posst_t *P, const uint8_t *base, int64_t n, int itemsize,
                                                unsigned shift, unsigned cm, int64_t n_ctx, blockfn_t fn)
{
    pos_block_t(P, base, n, itemsize, shift, cm, n_ctx, fn);
}

#if HAVE_AVX512_PATH
/* The 64 contexts of a block (16-bit elements b[0..128) bytes, or 8-bit ones), one per byte. */
__attribute__((target("avx512f,avx512bw"))) static inline __m512i block_ctx_avx512(const uint8_t *b, int itemsize,
                                                                                   __m128i vs, unsigned cm)
{
    if (itemsize == 1)
        return _mm512_and_si512(_mm512_srl_epi16(_mm512_loadu_si512((const void *)b), vs), _mm512_set1_epi8((char)cm));
    const __m512i vm = _mm512_set1_epi16((short)cm);
    __m512i a = _mm512_and_si512(_mm512_srl_epi16(_mm512_loadu_si512((const void *)b), vs), vm);
    __m512i c = _mm512_and_si512(_mm512_srl_epi16(_mm512_loadu_si512((const void *)(b + 64)), vs), vm);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(a)), _mm512_cvtepi16_epi8(c), 1);
}

/* The AVX-512 positions pass: pos_block_t's blocks of 64, each block's work in one function, and no
 * branch on the data in nearly every block. Per block and context with changes left: one compare into a
 * mask, its popcount off the countdown (a scalar: storing popcounts to update countdowns in vectors
 * costs a failed store-to-load forward per block), the sign bit into the block's due mask. The due
 * contexts (up to DUE_SLOTS_AVX512 of them; more in a loop) then each take the slot code below, which
 * selects the context's next two changes with pdep without a branch on whether the second one lies in
 * the block (a loop takes a third and more, rarely): a mispredicted branch per block cost more than
 * all the compares. A context follows its changes through dgap, the gaps between its ranks, ending in
 * BLOCK_IDLE: an exhausted context's countdown jumps to about BLOCK_IDLE (>= 2^29, never due again in
 * a chunk of at most BLOCK_MAX_N elements) and leaves the list after the block. Unused slots work on
 * slot BLOCK_CTX, whose countdown (64) never comes due and whose gaps are zeros, reset every block. */
#define DUE_SLOTS_AVX512 2 /* (fewer: the loop's exit mispredicts; more: slots cost more than it) */
#define DUE_SLOTS_GFNI 1   /* (more ran slower here: its slots are on the chain from block to block) */

/* One due context k (the lowest bit of ``due``; ``DUMMY`` when none is left): x, its next change's rank
 * among the block's lanes of its context, is < pc. Both AVX-512 positions passes take this slot; ``...``
 * is each pass's own bookkeeping after it, with x, k and pc in scope. */
#define DUE_SLOT_STEP(DUMMY, ...)                                                                   \
    do {                                                                                            \
        const int k = __builtin_ctzll(due | (1ull << DUMMY));                                       \
        due &= due - 1;                                                                             \
        const uint64_t m = _mm512_cmpeq_epi8_mask(e, vk[k]);                                        \
        const int32_t pc = (int32_t)__builtin_popcountll(m);                                        \
        const int32_t *q = gp[k];                                                                   \
        int32_t x = nx[k] + pc, x1 = x + q[0];                                                      \
        const uint32_t s1 = x1 < pc;                                                                \
        chg |= _pdep_u64((uint64_t)(x < pc) << (x & 63), m) | _pdep_u64((uint64_t)s1 << (x1 & 63), m); \
        x = (int32_t)csel(s1, (uint32_t)(x1 + q[1]), (uint32_t)x1);                                 \
        q += 1 + s1;                                                                                \
        while (__builtin_expect(x < pc, 0)) {                                                       \
            chg |= _pdep_u64(1ull << x, m);                                                         \
            x += *q++;                                                                              \
        }                                                                                           \
        gp[k] = q;                                                                                  \
        nx[k] = x - pc;                                                                             \
        __VA_ARGS__;                                                                                \
    } while (0)

static const int32_t zero_gaps[8]; /* >= 2 + the most slots */

__attribute__((target("avx512f,avx512bw,popcnt,bmi,bmi2"))) static __attribute__((noinline)) void
pos_avx512(posst_t *P, const uint8_t *base, int64_t n, int itemsize, unsigned shift, unsigned cm, int64_t n_ctx,
           int32_t *dgap)
{
    int64_t i = 0;
    while (P->active > BLOCK_CTX && i + 64 <= n) { /* element by element while many contexts have changes left */
        pos_scalar_t(P, base, i, i + 64, itemsize, shift, cm);
        i += 64;
    }
    if (P->active == 0 || P->active > BLOCK_CTX) {
        if (P->active)
            pos_scalar(P, base, i, n, itemsize, shift, cm);
        return;
    }
    const int64_t *const gend = P->gend, *const granks = P->granks;
    for (int64_t j = 0; j + 1 < P->cap; j++)
        dgap[j] = (int32_t)(granks[j + 1] - granks[j]); /* < n <= BLOCK_MAX_N (across groups: overwritten) */
    dgap[P->cap] = 0;                                 /* read, unused, after the last group's end */
    for (int64_t e = 0; e < n_ctx; e++)
        if (gend[e] > 0)
            dgap[gend[e] - 1] = BLOCK_IDLE;
    __m512i vk[BLOCK_CTX + 1];
    const int32_t *gp[BLOCK_CTX + 1];
    uint8_t actx[BLOCK_CTX], ctxb[64];
    int32_t nx[BLOCK_CTX + 1];
    int na = 0;
    for (int64_t e = 0; e < n_ctx; e++)
        if (P->nxt[e] < DEC_HUGE / 2) {
            actx[na] = (uint8_t)e;
            vk[na] = _mm512_set1_epi8((char)e);
            gp[na] = dgap + P->ptr[e];
            nx[na++] = (int32_t)P->nxt[e]; /* < n <= BLOCK_MAX_N */
        }
    vk[BLOCK_CTX] = _mm512_setzero_si512();
    nx[BLOCK_CTX] = 64;
    const __m128i vs = _mm_cvtsi32_si128((int)shift);
    int64_t *const out_pos = P->out_pos;
    int32_t *const out_ctx = P->out_ctx;
    int64_t o = P->o;
    const int64_t cap = P->cap;
    for (; na > 0 && i + 64 <= n; i += 64) {
        const __m512i e = block_ctx_avx512(base + itemsize * i, itemsize, vs, cm);
        uint64_t due = 0;
        for (int k = 0; k < na; k++) {
            int32_t x = nx[k] - (int32_t)__builtin_popcountll(_mm512_cmpeq_epi8_mask(e, vk[k]));
            nx[k] = x;
            due |= (uint64_t)((uint32_t)x >> 31) << k;
        }
        if (!due)
            continue;
        _mm512_storeu_si512((void *)ctxb, e);
        gp[BLOCK_CTX] = zero_gaps;
        uint64_t chg = 0;
        uint32_t gone = 0;
#define DUE_SLOT() DUE_SLOT_STEP(BLOCK_CTX, gone |= (uint32_t)(x - pc) >> 29)
        for (int t = 0; t < DUE_SLOTS_AVX512; t++)
            DUE_SLOT();
        while (__builtin_expect(due != 0, 0))
            DUE_SLOT();
#undef DUE_SLOT
        /* Emit in position order: four entries without a loop in nearly every block (written past the
         * block's count, to be overwritten by the next block's or left inside the arrays). */
        const int cnt = __builtin_popcountll(chg);
        if (__builtin_expect(cnt <= 4 && o + 4 <= cap, 1)) {
            for (int t = 0; t < 4; t++) {
                int l = __builtin_ctzll(chg | (1ull << 63));
                chg &= chg - 1;
                out_pos[o + t] = i + l;
                out_ctx[o + t] = ctxb[l];
            }
            o += cnt;
        } else {
            while (chg) {
                int l = __builtin_ctzll(chg);
                chg &= chg - 1;
                out_pos[o] = i + l;
                out_ctx[o] = ctxb[l];
                o++;
            }
        }
        if (__builtin_expect(gone != 0, 0)) { /* drop the exhausted contexts */
            int w = 0;
            for (int k = 0; k < na; k++)
                if (nx[k] < BLOCK_IDLE / 2) {
                    actx[w] = actx[k];
                    vk[w] = vk[k];
                    gp[w] = gp[k];
                    nx[w++] = nx[k];
                }
            P->active -= na - w;
            na = w;
        }
    }
    P->o = o;
    if (na == 0)
        return;
    for (int64_t e = 0; e < n_ctx; e++)
        P->nxt[e] = DEC_HUGE;
    for (int k = 0; k < na; k++) {
        P->nxt[actx[k]] = nx[k];
        P->ptr[actx[k]] = gp[k] - dgap;
    }
    pos_scalar(P, base, i, n, itemsize, shift, cm);
}

/* The same pass on CPUs with GFNI, BITALG and VBMI2 (AVX-512 from Ice Lake and Zen 4 on): the countdowns of a
 * window of 16 consecutive contexts are counted all at once, in vectors. Each lane's context in the
 * window becomes a one-hot bit (two bytes of them: contexts 0-7 and 8-15 of the window), an affine
 * transform in GF(2) transposes each 8x8 bit matrix (one per 8 lanes), so that a byte popcount gives
 * the lanes of each context among each 8, and three folds add the 8 groups: 16 counts in about 20
 * instructions, where the compares took 13 per context. Contexts with changes outside the window (few,
 * rare ones: the window is the 16 holding the most changes) are counted one compare each, as in
 * pos_avx512. Slots 0-15 are the window's contexts (their countdowns in a vector; one without changes
 * counts down from BLOCK_IDLE, never due), 16 on the others', and GSLOT_DUMMY the unused slot. A
 * block's changes are emitted with two byte compresses (lanes, contexts) and two stores. */
#define GSLOT_OUT 16
#define GSLOT_DUMMY (GSLOT_OUT + BLOCK_CTX)

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi2,gfni,avx512bitalg,popcnt,bmi,bmi2"))) static __attribute__((noinline)) void
pos_gfni(posst_t *P, const uint8_t *base, int64_t n, int itemsize, unsigned shift, unsigned cm, int64_t n_ctx,
         int32_t *dgap)
{
    int64_t i = 0;
    while (P->active > BLOCK_CTX && i + 64 <= n) { /* element by element while many contexts have changes left */
        pos_scalar_t(P, base, i, i + 64, itemsize, shift, cm);
        i += 64;
    }
    if (P->active == 0 || P->active > BLOCK_CTX) {
        if (P->active)
            pos_scalar(P, base, i, n, itemsize, shift, cm);
        return;
    }
    const int64_t *const gend = P->gend, *const granks = P->granks;
    for (int64_t j = 0; j + 1 < P->cap; j++)
        dgap[j] = (int32_t)(granks[j + 1] - granks[j]); /* < n <= BLOCK_MAX_N (across groups: overwritten) */
    dgap[P->cap] = 0;                                 /* read, unused, after the last group's end */
    for (int64_t e = 0; e < n_ctx; e++)
        if (gend[e] > 0)
            dgap[gend[e] - 1] = BLOCK_IDLE;
    /* The window: the 16 consecutive contexts holding the most changes left (the first such). */
    int64_t e0 = 0, best = -1, sum = 0;
    for (int64_t e = 0; e < n_ctx + 15; e++) { /* sum: changes left in contexts (e - 16, e] */
        if (e < n_ctx && P->nxt[e] < DEC_HUGE / 2)
            sum += gend[e] - P->ptr[e];
        if (e >= 16 && e - 16 < n_ctx && P->nxt[e - 16] < DEC_HUGE / 2)
            sum -= gend[e - 16] - P->ptr[e - 16];
        if (e >= 15 && sum > best) {
            best = sum;
            e0 = e - 15;
        }
    }
    __m512i vk[GSLOT_DUMMY + 1];
    const int32_t *gp[GSLOT_DUMMY + 1];
    uint8_t actx[GSLOT_DUMMY + 1], ctxb[64];
    int32_t nx[GSLOT_DUMMY + 1];
    int na = GSLOT_OUT; /* slots in use: the window's, then the others' */
    for (int j = 0; j < GSLOT_OUT; j++) {
        const int64_t e = e0 + j;
        actx[j] = (uint8_t)e;
        vk[j] = _mm512_set1_epi8((char)e);
        gp[j] = zero_gaps;
        nx[j] = BLOCK_IDLE;
        if (e < n_ctx && P->nxt[e] < DEC_HUGE / 2) {
            gp[j] = dgap + P->ptr[e];
            nx[j] = (int32_t)P->nxt[e];
        }
    }
    for (int64_t e = 0; e < n_ctx; e++)
        if (P->nxt[e] < DEC_HUGE / 2 && (e < e0 || e >= e0 + 16)) {
            actx[na] = (uint8_t)e;
            vk[na] = _mm512_set1_epi8((char)e);
            gp[na] = dgap + P->ptr[e];
            nx[na++] = (int32_t)P->nxt[e];
        }
    vk[GSLOT_DUMMY] = _mm512_setzero_si512();
    nx[GSLOT_DUMMY] = 64;
    __m512i nxv = _mm512_loadu_si512((const void *)nx);
    const __m128i vs = _mm_cvtsi32_si128((int)shift);
    const __m512i ve0 = _mm512_set1_epi8((char)e0), v16 = _mm512_set1_epi8(16);
    const __m512i lut_lo = _mm512_set4_epi32(0, 0, (int)0x80402010, 0x08040201);
    const __m512i lut_hi = _mm512_set4_epi32((int)0x80402010, 0x08040201, 0, 0);
    const __m512i transpose = _mm512_set1_epi64(0x8040201008040201ll);
    const __m512i gather = _mm512_set_epi64(7, 3, 6, 2, 5, 1, 4, 0);
    uint8_t iota_b[64];
    for (int l = 0; l < 64; l++)
        iota_b[l] = (uint8_t)l;
    const __m512i iota = _mm512_loadu_si512((const void *)iota_b);
    int64_t *const out_pos = P->out_pos;
    int32_t *const out_ctx = P->out_ctx;
    int64_t o = P->o, active = P->active;
    const int64_t cap = P->cap;
    for (; active > 0 && i + 64 <= n; i += 64) {
        const __m512i e = block_ctx_avx512(base + itemsize * i, itemsize, vs, cm);
        const __m512i d = _mm512_sub_epi8(e, ve0);
        const __mmask64 inw = _mm512_cmplt_epu8_mask(d, v16);
        const __m512i tlo = _mm512_gf2p8affine_epi64_epi8(transpose, _mm512_maskz_shuffle_epi8(inw, lut_lo, d), 0);
        const __m512i thi = _mm512_gf2p8affine_epi64_epi8(transpose, _mm512_maskz_shuffle_epi8(inw, lut_hi, d), 0);
        const __m512i clo = _mm512_popcnt_epi8(tlo), chi = _mm512_popcnt_epi8(thi);
        /* byte j of qword q: lanes 8q..8q+7 of context j (clo) or 8 + j (chi); add the qwords */
        __m512i z = _mm512_add_epi8(_mm512_shuffle_i64x2(clo, chi, 0x44), _mm512_shuffle_i64x2(clo, chi, 0xEE));
        z = _mm512_add_epi8(z, _mm512_shuffle_i64x2(z, z, 0xB1));
        z = _mm512_permutexvar_epi64(gather, z); /* qwords: lo 0+2, hi 0+2, lo 1+3, hi 1+3, ... */
        const __m128i cnt = _mm_add_epi8(_mm512_castsi512_si128(z), _mm512_extracti32x4_epi32(z, 1));
        nxv = _mm512_sub_epi32(nxv, _mm512_cvtepu8_epi32(cnt));
        uint64_t due = (uint64_t)_mm512_cmplt_epi32_mask(nxv, _mm512_setzero_si512());
        /* The other contexts' countdowns move only in a block holding a lane outside the window: in a
         * real checkpoint's chunk they are the rare exponents (a few hundred of its elements), so nearly
         * every block skips their compares. */
        if (__builtin_expect(inw != ~(__mmask64)0, 0))
            for (int k = GSLOT_OUT; k < na; k++) {
                int32_t x = nx[k] - (int32_t)__builtin_popcountll(_mm512_cmpeq_epi8_mask(e, vk[k]));
                nx[k] = x;
                due |= (uint64_t)((uint32_t)x >> 31) << k;
            }
        if (!due)
            continue;
        _mm512_storeu_si512((void *)nx, nxv); /* the window's countdowns, for the slots to read */
        gp[GSLOT_DUMMY] = zero_gaps;
        uint64_t chg = 0;
        uint32_t gone = 0;
#define DUE_SLOT()                                                                                  \
    DUE_SLOT_STEP(GSLOT_DUMMY,                                                                      \
                  nxv = _mm512_mask_set1_epi32(nxv, (__mmask16)(1u << (k & 31)) & (__mmask16)-(k < GSLOT_OUT), \
                                               x - pc);                                             \
                  gone += (uint32_t)(x - pc) >> 29)
        for (int t = 0; t < DUE_SLOTS_GFNI; t++)
            DUE_SLOT();
        while (__builtin_expect(due != 0, 0))
            DUE_SLOT();
#undef DUE_SLOT
        /* Emit in position order: the lanes and their contexts compressed, eight entries written in
         * nearly every block (those past the block's count to be overwritten, or left inside the arrays). */
        const int cnt_chg = __builtin_popcountll(chg);
        if (__builtin_expect(cnt_chg <= 8 && o + 8 <= cap, 1)) {
            const __m128i lanes = _mm512_castsi512_si128(_mm512_maskz_compress_epi8(chg, iota));
            const __m128i ctxs = _mm512_castsi512_si128(_mm512_maskz_compress_epi8(chg, e));
            _mm512_storeu_si512((void *)(out_pos + o), _mm512_add_epi64(_mm512_cvtepu8_epi64(lanes), _mm512_set1_epi64(i)));
            _mm256_storeu_si256((__m256i *)(out_ctx + o), _mm256_cvtepu8_epi32(ctxs));
            o += cnt_chg;
        } else {
            _mm512_storeu_si512((void *)ctxb, e);
            while (chg) {
                int l = __builtin_ctzll(chg);
                chg &= chg - 1;
                out_pos[o] = i + l;
                out_ctx[o] = ctxb[l];
                o++;
            }
        }
        if (__builtin_expect(gone != 0, 0)) { /* exhausted: the window's stay (idle), the others leave */
            active -= gone;
            int w = GSLOT_OUT;
            for (int k = GSLOT_OUT; k < na; k++)
                if (nx[k] < BLOCK_IDLE / 2) {
                    actx[w] = actx[k];
                    vk[w] = vk[k];
                    gp[w] = gp[k];
                    nx[w++] = nx[k];
                }
            na = w;
        }
    }
    P->o = o;
    P->active = active;
    if (active == 0)
        return;
    _mm512_storeu_si512((void *)nx, nxv);
    for (int64_t e = 0; e < n_ctx; e++)
        P->nxt[e] = DEC_HUGE;
    for (int k = 0; k < na; k++)
        if (nx[k] < BLOCK_IDLE / 2) {
            P->nxt[actx[k]] = nx[k];
            P->ptr[actx[k]] = gp[k] - dgap;
        }
    pos_scalar(P, base, i, n, itemsize, shift, cm);
}
#endif

static int dec_choice = -1; /* decode_kernel(): -1 auto, else an index of dec_names (tests compare them) */
static int dec_current(void);
static blockfn_t block_kernel(int k);

/* Target bits: unkey(key(base) +- magnitude), the magnitude being the leading one of its length and
 * the raw bits above the sign. One copy per item size. */
static inline __attribute__((always_inline)) void apply_values_t(const uint8_t *base, const int64_t *pos,
                                                                 const uint64_t *raw, const uint8_t *lens, int64_t m,
                                                                 int itemsize, int bits, int kind, uint8_t *out)
{
    const uint64_t mask = bits >= 64 ? ~0ull : (1ull << bits) - 1, sign = 1ull << (bits - 1);
    for (int64_t j = 0; j < m; j++) {
        uint64_t v = raw[j], mag = (1ull << (lens[j] - 1)) | (v >> 1);
        uint64_t kb = key_of(load_u(base, pos[j], itemsize), kind, sign, mask);
        uint64_t flip = 0 - (v & 1); /* the sign of the step, as a select: another coin flip */
        uint64_t t = unkey_of((kb + ((mag ^ flip) - flip)) & mask, kind, sign, mask);
        switch (itemsize) {
        case 1: out[j] = (uint8_t)t; break;
        case 2: { uint16_t x = (uint16_t)t; memcpy(out + 2 * j, &x, 2); break; }
        case 4: { uint32_t x = (uint32_t)t; memcpy(out + 4 * j, &x, 4); break; }
        default: memcpy(out + 8 * j, &t, 8); break;
        }
    }
}

static __attribute__((noinline)) void apply_values(const uint8_t *base, const int64_t *pos, const uint64_t *raw,
                                                   const uint8_t *lens, int64_t m, int itemsize, int bits, int kind,
                                                   uint8_t *out)
{
    switch (itemsize) {
    case 1: apply_values_t(base, pos, raw, lens, m, 1, bits, kind, out); break;
    case 2: apply_values_t(base, pos, raw, lens, m, 2, bits, kind, out); break;
    case 4: apply_values_t(base, pos, raw, lens, m, 4, bits, kind, out); break;
    default: apply_values_t(base, pos, raw, lens, m, 8, bits, kind, out); break;
    }
}

/* The additive digest's move (digest_move's sums, below) by the changes just decoded: the old bits are
 * the base's at each position (the decode is against the segment as it is), the new ones out's. Taken
 * here, a block of changes at a time while their base lines are still in cache, instead of a second
 * pass that gathers them from the segment again. dg: {start, s0, s1}; sums accumulate. */
#define MOVE_BLOCK 256
static void move_sums(const int64_t *pos, const uint64_t *od, const uint64_t *nw, Py_ssize_t m, uint64_t start,
                      uint64_t s0, uint64_t s1, uint64_t *out);
#if HAVE_AVX512_PATH
static void move_sums_avx512(const int64_t *pos, const uint64_t *od, const uint64_t *nw, Py_ssize_t m,
                             uint64_t start, uint64_t s0, uint64_t s1, uint64_t *out);
#endif

static void values_moved(const uint8_t *base, const int64_t *pos, const uint64_t *raw, const uint8_t *lens, int64_t m,
                         int itemsize, int bits, int kind, uint8_t *out, const uint64_t *dg, uint64_t *sums)
{
#if HAVE_AVX512_PATH
    const int wide = have_avx512() && __builtin_cpu_supports("avx512dq");
#endif
    uint64_t od[MOVE_BLOCK], nw[MOVE_BLOCK];
    for (int64_t j0 = 0; j0 < m; j0 += MOVE_BLOCK) {
        const int64_t k = m - j0 < MOVE_BLOCK ? m - j0 : MOVE_BLOCK;
        uint8_t *o = out + (size_t)j0 * (size_t)itemsize;
        apply_values(base, pos + j0, raw + j0, lens + j0, k, itemsize, bits, kind, o);
        for (int64_t j = 0; j < k; j++) {
            od[j] = load_u(base, pos[j0 + j], itemsize);
            nw[j] = load_u(o, j, itemsize);
        }
#if HAVE_AVX512_PATH
        if (wide)
            move_sums_avx512(pos + j0, od, nw, k, dg[0], dg[1], dg[2], sums);
        else
#endif
            move_sums(pos + j0, od, nw, k, dg[0], dg[1], dg[2], sums);
    }
}

/* Encoding 5's positions pass (kernels.hist_positions): numba's countdown over elements [0, n), element
 * i's context cmap[(hist[i] & 127) * n_exp + exponent] (the tables and states checked by the caller). */
static inline __attribute__((always_inline)) void pos_hist_t(posst_t *P, const uint8_t *base, const uint8_t *hist,
                                                             const int32_t *cmap, int64_t n_exp, int64_t n,
                                                             int itemsize, unsigned shift, uint64_t cm)
{
    pos_count_t(P, base, hist, cmap, n_exp, 0, n, itemsize, shift, cm);
}


static __attribute__((noinline)) void pos_hist(posst_t *P, const uint8_t *base, const uint8_t *hist, const int32_t *cmap,
                                               int64_t n_exp, int64_t n, int itemsize, unsigned shift, uint64_t cm)
{
    switch (itemsize) {
    case 1: pos_hist_t(P, base, hist, cmap, n_exp, n, 1, shift, cm); break;
    case 2: pos_hist_t(P, base, hist, cmap, n_exp, n, 2, shift, cm); break;
    case 4: pos_hist_t(P, base, hist, cmap, n_exp, n, 4, shift, cm); break;
    default: pos_hist_t(P, base, hist, cmap, n_exp, n, 8, shift, cm); break;
    }
}

#if HAVE_AVX512_PATH

/* pos_hist for 16-bit elements in two passes, where the tables allow it: the same positions and
 * contexts, and the same count (decode_c's -3), since each change is found by exactly one of them.
 * State 0's contexts must be its exponents (cmap[x] == x for x <= cm) and every other state's lie
 * above cm (context_map's layout); an exponent e* whose state-0 group is empty must exist.
 *  1. The other states (about 7% of the elements): one scan of the history, 64 bytes at a time, finds
 *     the block's elements of another state and counts them down per context, as pos_hist_t does
 *     (with selects: a change is no rare event there), into a list of their own.
 *  2. State 0: the same scan writes a copy of the base in which every element of another state has
 *     exponent e*; over it, a state-0 change's rank among its exponent's state-0 elements is its rank
 *     among the copy's elements of that exponent, and e* has no change to find: decode_ulp's block
 *     passes (kern: dec_current()'s, > 0) with contexts 0..cm find them, their own fallbacks kept.
 *  3. The two lists, each in position order, merge into out_pos and out_ctx.
 * Returns 1 when done; 0 (P untouched) when the tables, the groups or the memory do not allow it. */
__attribute__((target("popcnt"))) static __attribute__((noinline)) int
pos_hist_split(posst_t *P, const uint8_t *base, const hmodel_t *H, int64_t n, unsigned shift, unsigned cm,
               int64_t n_ctx, int32_t *dgap, int kern)
{
    const int32_t *const cmap = H->cmap;
    const int64_t n_exp = H->n_exp;
    if (cm > 0xFF || ((uint64_t)cm << shift) > 0xFFFF || n > BLOCK_MAX_N || (int64_t)cm + 1 > n_ctx)
        return 0;
    for (int64_t x = 0; x <= (int64_t)cm; x++)
        if (cmap[x] != x)
            return 0;
    const int64_t top = H->n_states - 1 < 127 ? H->n_states - 1 : 127; /* (hist & 127 < n_states: checked) */
    for (int64_t h = 1; h <= top; h++)
        for (int64_t x = 0; x <= (int64_t)cm; x++)
            if (cmap[h * n_exp + x] <= (int64_t)cm)
                return 0;
    int64_t *const ptr = P->ptr, *const nxt = P->nxt;
    const int64_t *const gend = P->gend, *const granks = P->granks;
    int64_t estar = -1, active0 = 0, other = 0; /* other: changes in contexts above cm */
    for (int64_t c = 0; c < n_ctx; c++) {
        if (c <= (int64_t)cm) {
            if (gend[c] > ptr[c])
                active0++;
            else if (estar < 0)
                estar = c;
        } else {
            other += gend[c] - ptr[c];
        }
    }
    if (estar < 0)
        return 0;
    uint16_t *copy = malloc((size_t)n * sizeof(uint16_t));
    int64_t *pos1 = malloc(((size_t)other + 1) * sizeof(int64_t));
    int32_t *ctx1 = malloc(((size_t)other + 1) * sizeof(int32_t));
    int64_t *ngap = malloc(((size_t)other + 1) * sizeof(int64_t));
    if (!copy || !pos1 || !ctx1 || !ngap) {
        free(copy);
        free(pos1);
        free(ctx1);
        free(ngap);
        return 0;
    }
    /* The groups come in context order (dec_groups_t), so those above cm are granks[first, cap). A
     * context's countdown after its change at group index p: ngap[p - first] (after its last, none).
     * From here on ptr of these contexts (read by nothing else) is relative to first. */
    const int64_t first = P->cap - other;
    for (int64_t c = (int64_t)cm + 1; c < n_ctx; c++) {
        if (gend[c] == ptr[c]) /* none (gbeg 0): counts down from DEC_HUGE and reads ngap[other] */
            ptr[c] = P->cap;
        for (int64_t p = ptr[c]; p < gend[c]; p++)
            ngap[p - first] = p + 1 < gend[c] ? granks[p + 1] - granks[p] - 1 : DEC_HUGE;
        ptr[c] -= first;
    }
    const int32_t *rows[128]; /* cmap's row of each state */
    for (int64_t h = 0; h < 128; h++)
        rows[h] = cmap + (h <= top ? h : 0) * n_exp;
    ngap[other] = DEC_HUGE; /* read, unused, by a context exhausted at the end of granks or without changes */
    const uint8_t *const hist = H->flip;
    const uint16_t fld = (uint16_t)(cm << shift), put = (uint16_t)(estar << shift);
    const __m128i m7f = _mm_set1_epi8(0x7F), zero = _mm_setzero_si128();
    const __m128i vfld = _mm_set1_epi16((short)fld), vput = _mm_set1_epi16((short)put);
    int64_t o1 = 0, i = 0;
    for (; i < n; i += 64) {
        uint64_t nz; /* the block's elements of another state */
        if (i + 64 <= n) {
            nz = 0;
            for (int q = 0; q < 4; q++) {
                const __m128i st0 =
                    _mm_cmpeq_epi8(_mm_and_si128(_mm_loadu_si128((const __m128i *)(hist + i + 16 * q)), m7f), zero);
                nz |= (uint64_t)(~(unsigned)_mm_movemask_epi8(st0) & 0xFFFFu) << (16 * q);
                for (int half = 0; half < 2; half++) {
                    const __m128i keep = half ? _mm_unpackhi_epi8(st0, st0) : _mm_unpacklo_epi8(st0, st0);
                    const int64_t j = i + 16 * q + 8 * half;
                    const __m128i b = _mm_loadu_si128((const __m128i *)(base + 2 * j));
                    const __m128i moved = _mm_or_si128(_mm_andnot_si128(vfld, b), vput);
                    _mm_storeu_si128((__m128i *)(copy + j), _mm_or_si128(_mm_and_si128(keep, b), _mm_andnot_si128(keep, moved)));
                }
            }
        } else { /* the last, partial block */
            nz = 0;
            for (int64_t j = i; j < n; j++) {
                const uint16_t u = (uint16_t)load_u(base, j, 2);
                const int moved = (hist[j] & 127) != 0;
                copy[j] = moved ? (uint16_t)((u & ~fld) | put) : u;
                nz |= (uint64_t)moved << (j - i);
            }
        }
        while (nz) { /* pos_hist_t's countdown, for these elements only */
            const int64_t j = i + __builtin_ctzll(nz);
            nz &= nz - 1;
            const int64_t c = rows[hist[j] & 127][(load_u(base, j, 2) >> shift) & cm];
            const int64_t cd = nxt[c], pc = ptr[c], hit = cd == 0;
            pos1[o1] = j; /* kept when it is a change */
            ctx1[o1] = (int32_t)c;
            o1 += hit;
            nxt[c] = (int64_t)csel((uint64_t)hit, (uint64_t)ngap[pc], (uint64_t)(cd - 1));
            ptr[c] = pc + hit;
        }
    }
    posst_t P0 = {gend, granks, ptr, nxt, P->out_pos, P->out_ctx, 0, active0, P->cap};
    const uint8_t *const cb = (const uint8_t *)copy;
    if (kern == 4)
        pos_gfni(&P0, cb, n, 2, shift, cm, (int64_t)cm + 1, dgap);
    else if (kern == 3)
        pos_avx512(&P0, cb, n, 2, shift, cm, (int64_t)cm + 1, dgap);
    else
        pos_block(&P0, cb, n, 2, shift, cm, (int64_t)cm + 1, block_kernel(kern));
    /* Merge from the back, in place (the state-0 list is out_pos[0, P0.o)), with selects: which list
     * the next entry comes from is a coin flip. wr > a throughout, and out_pos holds an entry 0. */
    int64_t *const out_pos = P->out_pos;
    int32_t *const out_ctx = P->out_ctx;
    int64_t a = P0.o - 1, b1 = o1 - 1, wr = P0.o + o1 - 1;
    while (b1 >= 0) {
        const int64_t ia = a < 0 ? 0 : a, pa = out_pos[ia], pb = pos1[b1];
        const int32_t ca = out_ctx[ia], cb = ctx1[b1];
        const int64_t t = (a >= 0) & (pa > pb);
        out_pos[wr] = t ? pa : pb;
        out_ctx[wr] = t ? ca : cb;
        wr--;
        a -= t;
        b1 -= 1 - t;
    }
    P->o = P0.o + o1;
    free(copy);
    free(pos1);
    free(ctx1);
    free(ngap);
    return 1;
}
#endif

/* kernels.ulp_decode (H NULL) or kernels.hist_decode (H: encoding 5's model, its tables and states
 * checked by the caller; H->flip is the history, one byte per element). Returns 0, a negative status,
 * or -7 (out of memory). */
static int decode_c(const uint8_t *base, int64_t n, const uint8_t *pl, int64_t plen, int64_t n_changed,
                    int itemsize, int bits, int kind, unsigned shift, uint64_t cm, int64_t n_ctx,
                    int64_t *out_pos, uint8_t *out_val, const hmodel_t *H, const uint64_t *dg, uint64_t *sums)
{
    int64_t *gbeg = calloc((size_t)n_ctx, sizeof(int64_t));
    int64_t *gend = calloc((size_t)n_ctx, sizeof(int64_t));
    int64_t *ptr = malloc((size_t)n_ctx * sizeof(int64_t));
    int64_t *nxt = malloc((size_t)n_ctx * sizeof(int64_t));
    int64_t *granks = malloc((size_t)n_changed * sizeof(int64_t));
    int32_t *dgap = malloc(((size_t)n_changed + 1) * sizeof(int32_t)); /* pos_avx512's and pos_gfni's */
    int32_t *ectx = malloc((size_t)n_changed * sizeof(int32_t));
    uint16_t *plens = malloc((size_t)n_ctx * MAX_UNARY * sizeof(uint16_t));
    uint8_t *lens = malloc((size_t)n_changed);
    /* encoding 5's slots: per state, qdepth quotient decisions and a sign */
    const size_t nslots = H ? ((size_t)H->qdepth + 1) * (size_t)H->n_states : 0;
    uint16_t *pqh = H ? malloc(nslots * sizeof(uint16_t)) : NULL;
    int st = -7;
    if (!gbeg || !gend || !ptr || !nxt || !granks || !dgap || !ectx || !plens || !lens || (H && !pqh))
        goto done;
    for (size_t k = 0; k < nslots; k++)
        pqh[k] = 1u << (PROB_BITS - 1);
    rcd_t s;
    rawr_t r;
    int64_t rc_end;
    if (H)
        st = dec_groups_hist(pl, plen, n_changed, n, n_ctx, gbeg, gend, granks, &s, &r, &rc_end, H, pqh);
    else
        st = dec_groups(pl, plen, n_changed, n, n_ctx, gbeg, gend, granks, &s, &r, &rc_end);
    if (st)
        goto done;
    /* Part 2: positions, in position order, and their contexts. */
    if (n_ctx == 1) { /* every element is context 0: a rank is a position */
        memcpy(out_pos, granks, (size_t)n_changed * sizeof(int64_t));
        memset(ectx, 0, (size_t)n_changed * sizeof(int32_t));
    } else if (H) {
        posst_t P = {gend, granks, ptr, nxt, out_pos, ectx, 0, 0, n_changed};
        for (int64_t e = 0; e < n_ctx; e++) {
            ptr[e] = gbeg[e];
            if (gend[e] > gbeg[e]) {
                nxt[e] = granks[gbeg[e]];
                P.active++;
            } else {
                nxt[e] = DEC_HUGE;
            }
        }
        const int kern = dec_current();
#if HAVE_AVX512_PATH
        if (!(kern > 0 && itemsize == 2 && pos_hist_split(&P, base, H, n, shift, (unsigned)cm, n_ctx, dgap, kern)))
#else
        (void)kern;
#endif
            pos_hist(&P, base, H->flip, H->cmap, H->n_exp, n, itemsize, shift, cm);
        if (P.o != n_changed) {
            st = -3;
            goto done;
        }
    } else {
        posst_t P = {gend, granks, ptr, nxt, out_pos, ectx, 0, 0, n_changed};
        for (int64_t e = 0; e < n_ctx; e++) {
            ptr[e] = gbeg[e];
            if (gend[e] > gbeg[e]) {
                nxt[e] = granks[gbeg[e]];
                P.active++;
            } else {
                nxt[e] = DEC_HUGE;
            }
        }
        const int kern = dec_current();
        if (kern > 0 && n <= BLOCK_MAX_N &&
            ((itemsize == 2 && cm <= 0xFF) || (itemsize == 1 && (cm << shift) <= 0xFF)))
#if HAVE_AVX512_PATH
            if (kern == 4)
                pos_gfni(&P, base, n, itemsize, shift, (unsigned)cm, n_ctx, dgap);
            else if (kern == 3)
                pos_avx512(&P, base, n, itemsize, shift, (unsigned)cm, n_ctx, dgap);
            else
#endif
                pos_block(&P, base, n, itemsize, shift, (unsigned)cm, n_ctx, block_kernel(kern));
        else
            pos_scalar(&P, base, 0, n, itemsize, shift, cm);
        if (P.o != n_changed) {
            st = -3;
            goto done;
        }
    }
    for (int64_t i = 0; i < n_ctx * MAX_UNARY; i++)
        plens[i] = 1u << (PROB_BITS - 1);
    /* Parts 3 and 4: each change's ulp distance, then its target bits: two loops, as numba's (the
     * coder's serial chain alone, then loads from the base at scattered positions). Fused, the loop ran
     * at half the speed; run between pos_gfni's blocks, it slowed that pass by more than its own time. */
    uint64_t *raw = (uint64_t *)granks; /* free by now */
    if (H) { /* encoding 5: in a state other than 0, the sign from the range coder XOR the flip bit */
        uint16_t *const psign = pqh + (size_t)H->qdepth * (size_t)H->n_states;
        for (int64_t j = 0; j < n_changed; j++) {
            uint16_t *pe = plens + (int64_t)ectx[j] * MAX_UNARY;
            int ln = 1;
            while (ln < bits) {
                if (!rcd_bit(&s, pl, rc_end, pe, ln - 1))
                    break;
                ln++;
            }
            lens[j] = (uint8_t)ln;
            const int32_t h = H->cstate[ectx[j]];
            if (h == 0) {
                raw[j] = rawr_get(&r, ln);
            } else {
                const uint64_t sgn = rcd_bit(&s, pl, rc_end, psign, h) ^ (uint64_t)(H->flip[out_pos[j]] >> 7);
                raw[j] = (rawr_get(&r, ln - 1) << 1) | sgn; /* apply_values' layout: sign, then the bits */
            }
        }
    } else
    for (int64_t j = 0; j < n_changed; j++) {
        uint16_t *pe = plens + (int64_t)ectx[j] * MAX_UNARY;
        int ln = 1;
        while (ln < bits) {
            if (!rcd_bit(&s, pl, rc_end, pe, ln - 1))
                break;
            ln++;
        }
        lens[j] = (uint8_t)ln;
        raw[j] = rawr_get(&r, ln);
    }
    if (dg)
        values_moved(base, out_pos, raw, lens, n_changed, itemsize, bits, kind, out_val, dg, sums);
    else
        apply_values(base, out_pos, raw, lens, n_changed, itemsize, bits, kind, out_val);
    if (s.bad || rawr_bad(&r))
        st = -1;
    else if (s.pos != rc_end || rc_end + (r.bp + 7) / 8 != plen || ((r.bp & 7) && rawr_peek(&r) != 0))
        st = -6; /* (the leftover bits: those of the last byte read, above bp) */
    else
        st = 0;
done:
    free(gbeg);
    free(gend);
    free(ptr);
    free(nxt);
    free(granks);
    free(dgap);
    free(ectx);
    free(plens);
    free(lens);
    free(pqh);
    return st;
}

static int decode_ulp_c(const uint8_t *base, int64_t n, const uint8_t *pl, int64_t plen, int64_t n_changed,
                        int itemsize, int bits, int kind, unsigned shift, uint64_t cm, int64_t n_ctx,
                        int64_t *out_pos, uint8_t *out_val, const uint64_t *dg, uint64_t *sums)
{
    return decode_c(base, n, pl, plen, n_changed, itemsize, bits, kind, shift, cm, n_ctx, out_pos, out_val, NULL, dg,
                    sums);
}

/* Positions passes by name, and the one in use: "auto" picks the best this machine runs. */
#define N_DEC 5
static const char *const dec_names[N_DEC] = {"scalar", "sse2", "avx2", "avx512", "avx512gfni"};

static int dec_supported(int k)
{
    if (k == 0)
        return 1;
#if HAVE_AVX512_PATH
    __builtin_cpu_init();
    if (k == 1)
        return __builtin_cpu_supports("sse2") && __builtin_cpu_supports("popcnt");
    if (k == 2)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt");
    int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("popcnt") && __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2");
    if (k == 3)
        return avx512;
    return avx512 && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi2") &&
           __builtin_cpu_supports("gfni") && __builtin_cpu_supports("avx512bitalg");
#else
    return 0;
#endif
}

static int dec_current(void)
{
    static int best = -1;
    if (dec_choice >= 0)
        return dec_choice;
    if (best < 0)
        for (best = N_DEC - 1; best > 0 && !dec_supported(best); best--)
            ;
    return best;
}

static blockfn_t block_kernel(int k)
{
#if HAVE_AVX512_PATH
    return k == 2 ? block_avx2 : block_sse2;
#else
    (void)k;
    return NULL; /* not reached: only "scalar" is supported */
#endif
}

/* The optional digest argument of decode_ulp and decode_hist: None, or (start, s0, s1) -> dg. Returns 1
 * with dg set, 0 for None, -1 with an exception. */
static int digest_arg(PyObject *o, uint64_t *dg)
{
    if (o == NULL || o == Py_None)
        return 0;
    long long start;
    unsigned long long s0, s1;
    if (!PyArg_ParseTuple(o, "LKK;digest must be (start, s0, s1)", &start, &s0, &s1))
        return -1;
    dg[0] = (uint64_t)start;
    dg[1] = s0;
    dg[2] = s1;
    return 1;
}

/* A decode's result: the status, or with a digest (status, a0, a1), the move of the additive digest. */
static PyObject *decode_result(long st, int have_dg, const uint64_t *sums)
{
    if (!have_dg)
        return PyLong_FromLong(st);
    return Py_BuildValue("(lKK)", st, (unsigned long long)sums[0], (unsigned long long)sums[1]);
}

static PyObject *py_decode_ulp(PyObject *self, PyObject *args)
{
    PyObject *ob, *op, *opos, *oval, *odg = NULL;
    Py_ssize_t n_changed, n_ctx;
    int itemsize, bits, kind;
    unsigned shift;
    unsigned long long cm;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOniiiIKnOO|O", &ob, &op, &n_changed, &itemsize, &bits, &kind, &shift, &cm, &n_ctx,
                          &opos, &oval, &odg))
        return NULL;
    uint64_t dg[3], sums[2] = {0, 0};
    const int have_dg = digest_arg(odg, dg);
    if (have_dg < 0)
        return NULL;
    if ((itemsize != 1 && itemsize != 2 && itemsize != 4 && itemsize != 8) || bits < 1 || bits > 8 * itemsize ||
        kind < 0 || kind > 2 || n_ctx < 1 || n_ctx > 65536 || shift >= (unsigned)(8 * itemsize) ||
        cm >= (unsigned long long)n_ctx) {
        PyErr_SetString(PyExc_ValueError, "decode_ulp: itemsize, bits, kind or context (shift, mask, n_ctx) out of range");
        return NULL;
    }
    Py_buffer vb, vp, vpos, vval;
    int got = 0;
    long st = 0;
    PyObject *ret = NULL;
    if (PyObject_GetBuffer(ob, &vb, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    got = 1;
    if (vb.len % itemsize) {
        PyErr_SetString(PyExc_ValueError, "decode_ulp: base is not a whole number of elements");
        goto done;
    }
    if (PyObject_GetBuffer(op, &vp, PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    got = 2;
    if (get_buf(opos, &vpos, 1, 0, 8, "out_pos") < 0)
        goto done;
    got = 3;
    if (get_buf(oval, &vval, 1, 0, (unsigned)itemsize, "out_val") < 0)
        goto done;
    got = 4;
    {
        const int64_t n = vb.len / itemsize;
        /* kernels.ulp_decode's first check, status for status */
        if (n_changed <= 0 || n_changed > n || vpos.len / 8 < n_changed || vval.len / itemsize < n_changed) {
            ret = decode_result(-4, have_dg, sums);
            goto done;
        }
        Py_BEGIN_ALLOW_THREADS
        st = decode_ulp_c(vb.buf, n, vp.buf, vp.len, n_changed, itemsize, bits, kind, shift, cm, n_ctx, vpos.buf,
                          vval.buf, have_dg ? dg : NULL, sums);
        Py_END_ALLOW_THREADS
        if (st == -7)
            PyErr_NoMemory();
        else
            ret = decode_result(st, have_dg, sums);
    }
done:
    if (got >= 4) PyBuffer_Release(&vval);
    if (got >= 3) PyBuffer_Release(&vpos);
    if (got >= 2) PyBuffer_Release(&vp);
    PyBuffer_Release(&vb);
    return ret;
}

/* decode_hist(base, hist, payload, n_changed, itemsize, bits, kind, shift, mask, n_exp, cmap, cstate,
 *             n_states, qdepth, out_pos, out_val) -> status
 *
 * kernels.hist_decode (encoding 5), output for output and status for status, the payload, the history
 * and the tables all untrusted: -4 for counts or a history of the wrong length, -2 for a table or a
 * history state out of range (kernels.hist_tables), then decode_ulp's statuses. The positions pass is
 * pos_hist_split where it applies (16-bit elements, context_map's layout of the tables, a positions
 * pass other than "scalar" in use), else numba's countdown, element by element. */
static PyObject *py_decode_hist(PyObject *self, PyObject *args)
{
    PyObject *ob, *oh, *op, *ocmap, *ocs, *opos, *oval, *odg = NULL;
    Py_ssize_t n_changed, n_exp;
    int itemsize, bits, kind, n_states, qdepth;
    unsigned shift;
    unsigned long long cm;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOniiiIKnOOiiOO|O", &ob, &oh, &op, &n_changed, &itemsize, &bits, &kind, &shift,
                          &cm, &n_exp, &ocmap, &ocs, &n_states, &qdepth, &opos, &oval, &odg))
        return NULL;
    uint64_t dg[3], sums[2] = {0, 0};
    const int have_dg = digest_arg(odg, dg);
    if (have_dg < 0)
        return NULL;
    if ((itemsize != 1 && itemsize != 2 && itemsize != 4 && itemsize != 8) || bits < 1 || bits > 8 * itemsize ||
        kind < 0 || kind > 2 || shift >= (unsigned)(8 * itemsize) || n_states > 65536 || qdepth > 4096 ||
        n_exp > (1 << 24)) {
        PyErr_SetString(PyExc_ValueError, "decode_hist: itemsize, bits, kind, shift, n_states, qdepth or n_exp out of range");
        return NULL;
    }
    Py_buffer v[7]; /* base, hist, payload, cmap, cstate, out_pos, out_val */
    int got = 0;
    long st = 0;
    PyObject *ret = NULL;
    if (PyObject_GetBuffer(ob, &v[0], PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    got = 1;
    if (v[0].len % itemsize) {
        PyErr_SetString(PyExc_ValueError, "decode_hist: base is not a whole number of elements");
        goto done;
    }
    {
        PyObject *objs[6] = {oh, op, ocmap, ocs, opos, oval};
        const char *names[6] = {"hist", "payload", "cmap", "cstate", "out_pos", "out_val"};
        const unsigned align[6] = {1, 1, 4, 4, 8, (unsigned)itemsize};
        for (int k = 0; k < 6; k++) {
            if (get_buf(objs[k], &v[k + 1], k >= 4, 0, align[k], names[k]) < 0)
                goto done;
            got++;
        }
    }
    {
        const int64_t n = v[0].len / itemsize;
        const Py_ssize_t n_cmap = v[3].len / 4, n_ctx = v[4].len / 4;
        /* kernels.hist_decode's first checks, status for status */
        if (n_changed <= 0 || n_changed > n || v[5].len / 8 < n_changed || v[6].len / itemsize < n_changed ||
            v[1].len != n) {
            ret = decode_result(-4, have_dg, sums);
            goto done;
        }
        if (n_states < 1 || qdepth < 1 || n_exp < 1 || cm >= (unsigned long long)n_exp ||
            n_cmap < (Py_ssize_t)n_states * n_exp) {
            ret = decode_result(-2, have_dg, sums);
            goto done;
        }
        const hmodel_t H = {v[4].buf, n_states, qdepth, v[1].buf, v[3].buf, n_exp};
        Py_BEGIN_ALLOW_THREADS
        st = hist_tables_ok(v[1].buf, n, v[3].buf, v[4].buf, n_ctx, n_exp, n_states);
        if (st == 0)
            st = decode_c(v[0].buf, n, v[2].buf, v[2].len, n_changed, itemsize, bits, kind, shift, cm, n_ctx,
                          v[5].buf, v[6].buf, &H, have_dg ? dg : NULL, sums);
        Py_END_ALLOW_THREADS
        if (st == -7)
            PyErr_NoMemory();
        else
            ret = decode_result(st, have_dg, sums);
    }
done:
    while (got > 0)
        PyBuffer_Release(&v[--got]);
    return ret;
}

static PyObject *py_decode_kernel(PyObject *self, PyObject *args)
{
    const char *name = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "|z", &name))
        return NULL;
    const char *was = dec_names[dec_current()];
    if (name != NULL) {
        int k = strcmp(name, "auto") == 0 ? -1 : -2;
        for (int j = 0; j < N_DEC; j++)
            if (strcmp(name, dec_names[j]) == 0)
                k = j;
        if (k == -2 || (k >= 0 && !dec_supported(k))) {
            PyErr_Format(PyExc_ValueError, "decode_kernel: %s is not a kernel this machine runs", name);
            return NULL;
        }
        dec_choice = k;
    }
    return PyUnicode_FromString(was);
}

static PyObject *py_decode_kernels(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    PyObject *l = PyList_New(0);
    for (int k = 0; l && k < N_DEC; k++)
        if (dec_supported(k)) {
            PyObject *s = PyUnicode_FromString(dec_names[k]);
            if (!s || PyList_Append(l, s) < 0) {
                Py_XDECREF(s);
                Py_DECREF(l);
                return NULL;
            }
            Py_DECREF(s);
        }
    return l;
}

static PyObject *py_use_simd(PyObject *self, PyObject *arg)
{
    (void)self;
    int on = PyObject_IsTrue(arg);
    if (on < 0)
        return NULL;
    int was = simd_allowed;
    simd_allowed = on;
    return PyBool_FromLong(was);
}

static PyObject *py_simd(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyUnicode_FromString(have_avx512() ? "avx512" : "portable");
}

/* ------------------------------------------------------------------------------------------------
 * digest(flat, start, bits, itemsize, s0, s1) -> (a0, a1)
 *
 * integrity.additive's additive digest of some elements of a tensor (its module docstring defines it):
 * sum_i mix(mix(f_i ^ s) ^ (b_i * golden)) mod 2^64 per lane, f_i = flat[i] (an int64 array) or, with
 * flat None, start + i. The same sums as its numba kernels and its numpy reference.
 * ------------------------------------------------------------------------------------------------ */

static inline uint64_t mix64(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ULL;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBULL;
    x ^= x >> 31;
    return x;
}

/* Elements and indices are read with memcpy: a tensor in a mapped checkpoint need not be aligned to its
 * width (the compiler turns the copies into unaligned loads). */
#define DIGEST_LOOP(T, F)                                                                              \
    for (Py_ssize_t i = 0; i < n; i++) {                                                               \
        uint64_t f = (F);                                                                              \
        T v_;                                                                                          \
        memcpy(&v_, (const char *)bits + (size_t)i * sizeof(T), sizeof(T));                            \
        uint64_t b = (uint64_t)v_ * 0x9E3779B97F4A7C15ULL;                                             \
        a0 += mix64(mix64(f ^ s0) ^ b);                                                                \
        a1 += mix64(mix64(f ^ s1) ^ b);                                                                \
    }

/* Four loops per index source (an array, or start + i), one per element width, each a plain reduction
 * the compiler vectorizes (no branch inside). */
#define DIGEST_BODY                                                                                     \
    uint64_t a0 = 0, a1 = 0;                                                                           \
    if (flat) {                                                                                        \
        switch (itemsize) {                                                                            \
        case 1: DIGEST_LOOP(uint8_t, flat_at(flat, i)) break;                                          \
        case 2: DIGEST_LOOP(uint16_t, flat_at(flat, i)) break;                                         \
        case 4: DIGEST_LOOP(uint32_t, flat_at(flat, i)) break;                                         \
        default: DIGEST_LOOP(uint64_t, flat_at(flat, i)) break;                                        \
        }                                                                                              \
    } else {                                                                                           \
        uint64_t s = (uint64_t)start;                                                                  \
        switch (itemsize) {                                                                            \
        case 1: DIGEST_LOOP(uint8_t, s + (uint64_t)i) break;                                           \
        case 2: DIGEST_LOOP(uint16_t, s + (uint64_t)i) break;                                          \
        case 4: DIGEST_LOOP(uint32_t, s + (uint64_t)i) break;                                          \
        default: DIGEST_LOOP(uint64_t, s + (uint64_t)i) break;                                         \
        }                                                                                              \
    }                                                                                                  \
    out[0] = a0;                                                                                       \
    out[1] = a1;

static inline uint64_t flat_at(const void *flat, Py_ssize_t i)
{
    uint64_t f;
    memcpy(&f, (const char *)flat + (size_t)i * 8, 8);
    return f;
}

static void digest_sums(const int64_t *flat, long long start, const void *bits, Py_ssize_t n, int itemsize,
                        uint64_t s0, uint64_t s1, uint64_t *out)
{
    DIGEST_BODY
}

#if HAVE_AVX512_PATH
/* The same loops compiled for AVX-512 (64-bit multiplies in vectors). */
__attribute__((target("avx512f,avx512dq,avx512vl,avx512bw")))
static void digest_sums_avx512(const int64_t *flat, long long start, const void *bits, Py_ssize_t n, int itemsize,
                               uint64_t s0, uint64_t s1, uint64_t *out)
{
    DIGEST_BODY
}
#endif

static PyObject *py_digest(PyObject *self, PyObject *args)
{
    PyObject *oflat, *obits;
    long long start;
    int itemsize;
    unsigned long long s0, s1;
    (void)self;
    if (!PyArg_ParseTuple(args, "OLOiKK", &oflat, &start, &obits, &itemsize, &s0, &s1))
        return NULL;
    if (itemsize != 1 && itemsize != 2 && itemsize != 4 && itemsize != 8) {
        PyErr_SetString(PyExc_ValueError, "digest: itemsize must be 1, 2, 4 or 8");
        return NULL;
    }
    Py_buffer vb, vf;
    if (get_buf(obits, &vb, 0, 0, 1, "bits") < 0)
        return NULL;
    if (vb.len % itemsize) {
        PyBuffer_Release(&vb);
        PyErr_SetString(PyExc_ValueError, "digest: bits is not a whole number of elements");
        return NULL;
    }
    Py_ssize_t n = vb.len / itemsize;
    const int64_t *flat = NULL;
    int have_flat = oflat != Py_None;
    if (have_flat) {
        if (get_buf(oflat, &vf, 0, 8 * n, 1, "flat") < 0) {
            PyBuffer_Release(&vb);
            return NULL;
        }
        flat = vf.buf;
    }
    uint64_t out[2];
    Py_BEGIN_ALLOW_THREADS
#if HAVE_AVX512_PATH
    if (have_avx512() && __builtin_cpu_supports("avx512dq"))
        digest_sums_avx512(flat, start, vb.buf, n, itemsize, s0, s1, out);
    else
#endif
        digest_sums(flat, start, vb.buf, n, itemsize, s0, s1, out);
    Py_END_ALLOW_THREADS
    if (have_flat)
        PyBuffer_Release(&vf);
    PyBuffer_Release(&vb);
    return Py_BuildValue("(KK)", (unsigned long long)out[0], (unsigned long long)out[1]);
}

/* ------------------------------------------------------------------------------------------------
 * Elements at positions: put(dst, pos, vals, itemsize), equal_at(view, pos, vals, itemsize) and
 * digest_move(view, pos, new, itemsize, start, s0, s1).
 *
 * The per-chunk element work of an apply (the scatter of a patch, the read-back of what it wrote, how
 * its changes move a tensor's additive digest) with the GIL released: numpy's fancy indexing holds it,
 * so apply threads took turns. Every position is checked against the array first; one out of range
 * raises IndexError with nothing written (positions come from a checked decode, so that is a bug).
 * ------------------------------------------------------------------------------------------------ */

static int pos_in_range(const int64_t *pos, Py_ssize_t m, Py_ssize_t n)
{
    uint64_t bad = 0;
    for (Py_ssize_t j = 0; j < m; j++)
        bad |= (uint64_t)pos[j] >= (uint64_t)n; /* a negative one too */
    return !bad;
}

/* The three arrays of an element call: view/dst (itemsize elements), pos (int64, m), vals (m elements). */
static int elem_bufs(PyObject *ov, PyObject *op, PyObject *ox, int itemsize, int writable, Py_buffer *bv,
                     Py_buffer *bp, Py_buffer *bx, Py_ssize_t *n, Py_ssize_t *m, const char *what)
{
    if (itemsize != 1 && itemsize != 2 && itemsize != 4 && itemsize != 8) {
        PyErr_Format(PyExc_ValueError, "%s: itemsize must be 1, 2, 4 or 8", what);
        return -1;
    }
    if (get_buf(ov, bv, writable, 0, 1, "view") < 0)
        return -1;
    if (get_buf(op, bp, 0, 0, 8, "pos") < 0) {
        PyBuffer_Release(bv);
        return -1;
    }
    *n = bv->len / itemsize;
    *m = bp->len / 8;
    if (get_buf(ox, bx, 0, *m * itemsize, 1, "vals") < 0) {
        PyBuffer_Release(bv);
        PyBuffer_Release(bp);
        return -1;
    }
    if (bv->len % itemsize || bp->len % 8 || bx->len != *m * itemsize) {
        PyBuffer_Release(bv);
        PyBuffer_Release(bp);
        PyBuffer_Release(bx);
        PyErr_Format(PyExc_ValueError, "%s: arrays are not whole elements, or vals is not one per position", what);
        return -1;
    }
    return 0;
}

static void elem_release(Py_buffer *bv, Py_buffer *bp, Py_buffer *bx)
{
    PyBuffer_Release(bv);
    PyBuffer_Release(bp);
    PyBuffer_Release(bx);
}

#define ELEM_SWITCH(...)                                                                               \
    switch (itemsize) {                                                                                \
    case 1: { typedef uint8_t T; __VA_ARGS__ } break;                                                  \
    case 2: { typedef uint16_t T; __VA_ARGS__ } break;                                                 \
    case 4: { typedef uint32_t T; __VA_ARGS__ } break;                                                 \
    default: { typedef uint64_t T; __VA_ARGS__ } break;                                                \
    }

/* put (writable view: dst[pos[j]] = vals[j]) and equal_at (view[pos[j]] == vals[j] for all j): one
 * argument parse, one range check, one release. Returns the bool for equal_at, None for put. */
static PyObject *elem_call(PyObject *args, int put, const char *what, const char *range_msg)
{
    PyObject *ov, *op, *ox;
    int itemsize;
    if (!PyArg_ParseTuple(args, "OOOi", &ov, &op, &ox, &itemsize))
        return NULL;
    Py_buffer bv, bp, bx;
    Py_ssize_t n, m;
    if (elem_bufs(ov, op, ox, itemsize, put, &bv, &bp, &bx, &n, &m, what) < 0)
        return NULL;
    int ok;
    uint64_t diff = 0;
    Py_BEGIN_ALLOW_THREADS
    const int64_t *pos = bp.buf;
    ok = pos_in_range(pos, m, n);
    if (ok && put) {
        char *dst = bv.buf;
        const char *src = bx.buf;
        ELEM_SWITCH(for (Py_ssize_t j = 0; j < m; j++) {
            T v;
            memcpy(&v, src + (size_t)j * sizeof(T), sizeof(T));
            memcpy(dst + (size_t)pos[j] * sizeof(T), &v, sizeof(T));
        })
    } else if (ok) {
        const char *view = bv.buf, *src = bx.buf;
        ELEM_SWITCH(for (Py_ssize_t j = 0; j < m; j++) {
            T x, y;
            memcpy(&x, view + (size_t)pos[j] * sizeof(T), sizeof(T));
            memcpy(&y, src + (size_t)j * sizeof(T), sizeof(T));
            diff |= (uint64_t)(x ^ y);
        })
    }
    Py_END_ALLOW_THREADS
    elem_release(&bv, &bp, &bx);
    if (!ok) {
        PyErr_SetString(PyExc_IndexError, range_msg);
        return NULL;
    }
    if (put)
        Py_RETURN_NONE;
    return PyBool_FromLong(diff == 0);
}

static PyObject *py_put(PyObject *self, PyObject *args)
{
    (void)self;
    return elem_call(args, 1, "put", "put: a position is outside the array (nothing written)");
}

static PyObject *py_equal_at(PyObject *self, PyObject *args)
{
    (void)self;
    return elem_call(args, 0, "equal_at", "equal_at: a position is outside the array");
}

/* digest_move's sums over one block: the old and new bits already gathered into words, so the loop has
 * no gather and the compiler vectorizes it (the index mixes are shared by old and new). */
#define MOVE_BODY                                                                                       \
    uint64_t a0 = 0, a1 = 0;                                                                           \
    for (Py_ssize_t j = 0; j < m; j++) {                                                               \
        const uint64_t f = start + (uint64_t)pos[j];                                                   \
        const uint64_t g0 = mix64(f ^ s0), g1 = mix64(f ^ s1);                                         \
        const uint64_t bn = nw[j] * 0x9E3779B97F4A7C15ULL, bo = od[j] * 0x9E3779B97F4A7C15ULL;         \
        a0 += mix64(g0 ^ bn) - mix64(g0 ^ bo);                                                         \
        a1 += mix64(g1 ^ bn) - mix64(g1 ^ bo);                                                         \
    }                                                                                                  \
    out[0] += a0;                                                                                      \
    out[1] += a1;

static void move_sums(const int64_t *pos, const uint64_t *od, const uint64_t *nw, Py_ssize_t m, uint64_t start,
                      uint64_t s0, uint64_t s1, uint64_t *out)
{
    MOVE_BODY
}

#if HAVE_AVX512_PATH
__attribute__((target("avx512f,avx512dq,avx512vl,avx512bw")))
static void move_sums_avx512(const int64_t *pos, const uint64_t *od, const uint64_t *nw, Py_ssize_t m,
                             uint64_t start, uint64_t s0, uint64_t s1, uint64_t *out)
{
    MOVE_BODY
}
#endif
#undef MOVE_BODY

/* sum_j h(start + pos_j, new_j) - h(start + pos_j, view[pos_j]) per lane, h as in digest(). */
static PyObject *py_digest_move(PyObject *self, PyObject *args)
{
    PyObject *ov, *op, *ox;
    int itemsize;
    long long start;
    unsigned long long s0, s1;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOiLKK", &ov, &op, &ox, &itemsize, &start, &s0, &s1))
        return NULL;
    Py_buffer bv, bp, bx;
    Py_ssize_t n, m;
    if (elem_bufs(ov, op, ox, itemsize, 0, &bv, &bp, &bx, &n, &m, "digest_move") < 0)
        return NULL;
    int ok;
    uint64_t sums[2] = {0, 0};
    Py_BEGIN_ALLOW_THREADS
    const int64_t *pos = bp.buf;
    ok = pos_in_range(pos, m, n);
#if HAVE_AVX512_PATH
    const int wide = have_avx512() && __builtin_cpu_supports("avx512dq");
#endif
    uint64_t od[MOVE_BLOCK], nw[MOVE_BLOCK];
    for (Py_ssize_t j0 = 0; ok && j0 < m; j0 += MOVE_BLOCK) {
        const Py_ssize_t k = m - j0 < MOVE_BLOCK ? m - j0 : MOVE_BLOCK;
        const char *view = bv.buf, *src = (const char *)bx.buf + (size_t)j0 * itemsize;
        ELEM_SWITCH(for (Py_ssize_t j = 0; j < k; j++) {
            T o, v;
            memcpy(&o, view + (size_t)pos[j0 + j] * sizeof(T), sizeof(T));
            memcpy(&v, src + (size_t)j * sizeof(T), sizeof(T));
            od[j] = o;
            nw[j] = v;
        })
#if HAVE_AVX512_PATH
        if (wide)
            move_sums_avx512(pos + j0, od, nw, k, (uint64_t)start, s0, s1, sums);
        else
#endif
            move_sums(pos + j0, od, nw, k, (uint64_t)start, s0, s1, sums);
    }
    Py_END_ALLOW_THREADS
    elem_release(&bv, &bp, &bx);
    if (!ok) {
        PyErr_SetString(PyExc_IndexError, "digest_move: a position is outside the array");
        return NULL;
    }
    return Py_BuildValue("(KK)", (unsigned long long)sums[0], (unsigned long long)sums[1]);
}
#undef ELEM_SWITCH

/* ------------------------------------------------------------------------------------------------
 * merge_records(p0, d0, p1, d1, p2, d2, n, table, out_pos, out_pos32, out_state) -> k
 *
 * history_kernels.merge_records, the same outputs: three change sets (newest first; positions uint32,
 * down flags packed least significant bit first, at least one byte each) merged into the positions
 * whose state (table[13 + the sets' signed moves there]) is not 0, with their history bytes. Returns
 * how many were written, or -(1 + d) when set d's positions do not ascend strictly below n. Every
 * input is checked first (lengths, the flags' bytes, the outputs' room): a record from a book is
 * untrusted local state.
 * ------------------------------------------------------------------------------------------------ */

static int ascending_u32(const uint32_t *p, Py_ssize_t m, int64_t n)
{
    int64_t prev = -1;
    for (Py_ssize_t i = 0; i < m; i++) {
        const int64_t x = p[i];
        if (x <= prev || x >= n)
            return 0;
        prev = x;
    }
    return 1;
}

static PyObject *py_merge_records(PyObject *self, PyObject *args)
{
    PyObject *o[11];
    long long n;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOOOLOOOO", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &n, &o[6], &o[7], &o[8],
                          &o[9]))
        return NULL;
    Py_buffer b[10];
    int got = 0;
    static const char *const names[10] = {"p0", "d0", "p1", "d1", "p2", "d2", "table", "out_pos", "out_pos32",
                                          "out_state"};
    static const int writable[10] = {0, 0, 0, 0, 0, 0, 0, 1, 1, 1};
    static const unsigned align[10] = {1, 1, 1, 1, 1, 1, 1, 8, 4, 1};
    for (; got < 10; got++)
        if (get_buf(o[got], &b[got], writable[got], 0, align[got], names[got]) < 0)
            break;
    PyObject *res = NULL;
    if (got < 10)
        goto done;
    Py_ssize_t m[3];
    for (int d = 0; d < 3; d++) {
        m[d] = b[2 * d].len / 4;
        if (b[2 * d].len % 4 || b[2 * d + 1].len < (m[d] + 7) / 8 || b[2 * d + 1].len < 1) {
            PyErr_Format(PyExc_ValueError, "merge_records: change set %d: %zd position bytes, %zd flag bytes", d,
                         b[2 * d].len, b[2 * d + 1].len);
            goto done;
        }
    }
    const Py_ssize_t total = m[0] + m[1] + m[2];
    if (b[6].len < 27 || b[7].len / 8 < total || b[8].len / 4 < total || b[9].len < total || n < 0) {
        PyErr_SetString(PyExc_ValueError, "merge_records: the table or an output is too short");
        goto done;
    }
    long long k = 0;
    Py_BEGIN_ALLOW_THREADS
    const uint32_t *p0 = b[0].buf, *p1 = b[2].buf, *p2 = b[4].buf;
    const uint8_t *d0 = b[1].buf, *d1 = b[3].buf, *d2 = b[5].buf, *table = b[6].buf;
    int64_t *out_pos = b[7].buf;
    uint32_t *out_pos32 = b[8].buf;
    uint8_t *out_state = b[9].buf;
    if (!ascending_u32(p0, m[0], n))
        k = -1;
    else if (!ascending_u32(p1, m[1], n))
        k = -2;
    else if (!ascending_u32(p2, m[2], n))
        k = -3;
    else {
        /* Branch-free steps (as numba's): which sets hold the smallest position is data. */
        const int64_t big = n;
        Py_ssize_t i0 = 0, i1 = 0, i2 = 0;
        for (Py_ssize_t t = 0; t < total; t++) {
            const int64_t a = i0 < m[0] ? (int64_t)p0[i0] : big;
            const int64_t bb = i1 < m[1] ? (int64_t)p1[i1] : big;
            const int64_t c = i2 < m[2] ? (int64_t)p2[i2] : big;
            int64_t p = a < bb ? a : bb;
            p = c < p ? c : p;
            const int64_t e0 = a == p, e1 = bb == p, e2 = c == p;
            const int64_t s0 = i0 < m[0] ? 9 - 18 * (int64_t)((d0[i0 >> 3] >> (i0 & 7)) & 1) : 0;
            const int64_t s1 = i1 < m[1] ? 3 - 6 * (int64_t)((d1[i1 >> 3] >> (i1 & 7)) & 1) : 0;
            const int64_t s2 = i2 < m[2] ? 1 - 2 * (int64_t)((d2[i2 >> 3] >> (i2 & 7)) & 1) : 0;
            const uint8_t st = table[13 + e0 * s0 + e1 * s1 + e2 * s2];
            out_pos[k] = p;
            out_pos32[k] = (uint32_t)p;
            out_state[k] = st;
            k += (st & 127) != 0;
            i0 += e0;
            i1 += e1;
            i2 += e2;
            if (i0 == m[0] && i1 == m[1] && i2 == m[2])
                break;
        }
    }
    Py_END_ALLOW_THREADS
    res = PyLong_FromLongLong(k);
done:
    for (int i = 0; i < got; i++)
        PyBuffer_Release(&b[i]);
    return res;
}

static PyMethodDef methods[] = {
    {"digest", py_digest, METH_VARARGS,
     "digest(flat, start, bits, itemsize, s0, s1) -> (a0, a1): integrity.additive's additive sums of the elements "
     "``bits`` at checkpoint flat indices ``flat`` (int64), or start, start + 1, ... when flat is None."},
    {"put", py_put, METH_VARARGS,
     "put(dst, pos, vals, itemsize): dst[pos[j]] = vals[j] (pos int64, every one checked first: IndexError, nothing "
     "written), without the GIL."},
    {"equal_at", py_equal_at, METH_VARARGS,
     "equal_at(view, pos, vals, itemsize) -> bool: whether view[pos[j]] == vals[j] for every j (positions checked)."},
    {"merge_records", py_merge_records, METH_VARARGS,
     "merge_records(p0, d0, p1, d1, p2, d2, n, table, out_pos, out_pos32, out_state) -> k: "
     "history_kernels.merge_records, the same outputs (-(1 + d): set d's positions do not ascend below n)."},
    {"digest_move", py_digest_move, METH_VARARGS,
     "digest_move(view, pos, new, itemsize, start, s0, s1) -> (a0, a1): how digest()'s sums move when the elements "
     "view[pos] at checkpoint flat indices start + pos become new (positions checked)."},
    {"scan16", py_scan16, METH_VARARGS,
     "scan16(base, target, shift, mask, n_ctx, pos, ectx, rank, bvals, tvals[, bits, kind, out]) -> m: "
     "kernels.ulp_scan for 16-bit elements; with out, also codes the changes: -> (m, nbytes), nbytes as "
     "encode_changes returns it (0 when nothing changed)."},
    {"encode_changes", py_encode_changes, METH_VARARGS,
     "encode_changes(ectx, rank, bvals, tvals, itemsize, bits, kind, n_ctx, out) -> nbytes: "
     "kernels.ulp_encode_changes, the same bytes."},
    {"encode_hist16", py_encode_hist16, METH_VARARGS,
     "encode_hist16(base, target, hist, cmap, shift, mask, n_exp, n_ctx, pos, ectx, rank, bvals, tvals, flip, bits, "
     "kind, cstate, n_states, qdepth, out) -> (m, nbytes): kernels.hist_scan + kernels.ulp_encode_core (encoding 5) "
     "for 16-bit elements, the same bytes."},
    {"decode_ulp", py_decode_ulp, METH_VARARGS,
     "decode_ulp(base, payload, n_changed, itemsize, bits, kind, shift, mask, n_ctx, out_pos, out_val[, digest]) -> "
     "status: kernels.ulp_decode, the same positions, values and status (0 or a kernels.STATUS code). digest: "
     "(start, s0, s1): returns (status, a0, a1), the additive digest's move by the changes as digest_move(base, "
     "out_pos, out_val, itemsize, start, s0, s1) gives it (meaningful where status is 0)."},
    {"decode_hist", py_decode_hist, METH_VARARGS,
     "decode_hist(base, hist, payload, n_changed, itemsize, bits, kind, shift, mask, n_exp, cmap, cstate, n_states, "
     "qdepth, out_pos, out_val[, digest]) -> status: kernels.hist_decode (encoding 5), the same positions, values and "
     "status; digest as in decode_ulp."},
    {"decode_kernel", py_decode_kernel, METH_VARARGS,
     "decode_kernel([name]) -> the one in use before: the positions pass decode_ulp and decode_hist use for 16-bit "
     "floats, one of decode_kernels(); 'auto' (the default) picks the fastest."},
    {"decode_kernels", py_decode_kernels, METH_NOARGS,
     "The positions passes this machine runs: 'scalar' (numba's countdown), 'sse2', 'avx2', 'avx512', 'avx512gfni' "
     "(blocks of 64)."},
    {"use_simd", py_use_simd, METH_O, "use_simd(on) -> previous setting: allow the AVX-512 path (default True)."},
    {"ulp2_encode", py_ulp2_encode, METH_VARARGS,
     "ulp2_encode(base, target, states, bits, kind, shift, mask, n_exp, hist, variant, pos, out) -> (m, nbytes): "
     "encoding 6 (hist 0) or 7 (hist 1, without its history id) in a coder variant, as ulp2_kernels.ulp2_encode."},
    {"ulp2_decode", py_ulp2_decode, METH_VARARGS,
     "ulp2_decode(base, states, payload, n_changed, bits, kind, shift, mask, n_exp, hist, pos_out, val_out[, digest]) "
     "-> status, or (status, a0, a1) with digest = (start, s0, s1): encodings 6 and 7, positions and target bits."},
    {"ulp2_kernel", py_ulp2_kernel, METH_VARARGS,
     "ulp2_kernel([name]) -> the one in use before: ulp2_decode's positions pass, one of ulp2_kernels() or 'auto'."},
    {"ulp2_kernels", py_ulp2_kernels, METH_NOARGS, "ulp2_kernels() -> the positions passes ulp2_decode runs here."},
    {"ulp2_timing", py_ulp2_timing, METH_NOARGS,
     "ulp2_timing() -> (positions ns, whole ns) of this thread's last successful ulp2_decode (for benchmarks)."},
    {"simd", py_simd, METH_NOARGS, "The instruction set scan16 uses here: 'avx512' or 'portable'."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", "Native kernels of the ULP codec.", -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void)
{
    init_select();
    return PyModule_Create(&module);
}
