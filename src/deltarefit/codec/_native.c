/* Native kernels of the ULP-context codec. Optional: the numba kernels in kernels.py compute the same
 * outputs and bytes, and tests hold the two equal. Everything here runs without the GIL.
 *
 * scan16(base, target, shift, mask, n_ctx, pos, ectx, rank, bvals, tvals[, bits, kind, out])
 *     kernels.ulp_scan for 16-bit elements (bf16, fp16, int16, uint16); with ``out``, the changes are
 *     coded too (encode_changes below), in the same call.
 * encode_changes(ectx, rank, bvals, tvals, itemsize, bits, kind, n_ctx, out)
 *     kernels.ulp_encode_changes, byte for byte, for any item size.
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
 * BufferError (the caller copies and retries). Contents are trusted: this is the encoder's side.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_AVX512_PATH 1
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
        unsigned e = ((unsigned)b[i] >> shift) & mask;
        if (b[i] != t[i]) {
            o.pos[m] = (int32_t)i;
            o.ectx[m] = (int32_t)e;
            int32_t r = 0;
            for (unsigned l = 0; l < LANES; l++)
                r += c[l * (mask + 1) + e];
            o.rank[m] = r;
            o.bvals[m] = b[i];
            o.tvals[m] = t[i];
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
    for (; i + 32 <= n; i += 32) {
        __m512i vb = _mm512_loadu_si512((const void *)(b + i));
        __m512i vt = _mm512_loadu_si512((const void *)(t + i));
        __m512i ve = _mm512_and_si512(_mm512_srl_epi16(vb, vshift), vmask);
        __mmask32 ch = _mm512_cmpneq_epu16_mask(vb, vt);
        while (ch) {
            unsigned k = (unsigned)__builtin_ctz(ch);
            unsigned ek = ((unsigned)b[i + k] >> shift) & mask;
            __mmask32 same = _mm512_cmpeq_epu16_mask(ve, _mm512_set1_epi16((short)ek));
            o.pos[m] = (int32_t)(i + k);
            o.ectx[m] = (int32_t)ek;
            o.rank[m] = c[ek] + __builtin_popcount((uint32_t)same & ((1u << k) - 1u));
            o.bvals[m] = b[i + k];
            o.tvals[m] = t[i + k];
            m++;
            ch &= ch - 1;
        }
        for (unsigned k = 0; k < WINDOW; k++)
            hot[k] += __builtin_popcount((uint32_t)_mm512_cmpeq_epu16_mask(ve, vk[k]));
        uint32_t out = ~(uint32_t)_mm512_cmplt_epu16_mask(_mm512_sub_epi16(ve, ve0), vwin);
        if (__builtin_expect(out != 0, 0)) while (out) {
            unsigned k = (unsigned)__builtin_ctz(out);
            c[((unsigned)b[i + k] >> shift) & mask]++;
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

/* Returns the payload length, -5 if out is too small, -7 if memory ran out. Inlined into one copy per
 * item size (below), so the value loads are not a switch per change. */
static inline __attribute__((always_inline)) Py_ssize_t encode_changes_t(const int32_t *ectx, const int32_t *rank, const void *bvals, const void *tvals,
                                   Py_ssize_t m, int itemsize, int bits, int kind, Py_ssize_t n_ctx, uint8_t *out,
                                   Py_ssize_t out_cap)
{
    const uint64_t mask = bits >= 64 ? ~0ull : (1ull << bits) - 1, sign = 1ull << (bits - 1);
    Py_ssize_t rawcap = m * 20 + n_ctx * 24 + 64;
    int64_t *gcount = calloc((size_t)n_ctx, sizeof(int64_t));
    int64_t *gstart = calloc((size_t)n_ctx + 1, sizeof(int64_t));
    int64_t *fill = malloc(((size_t)n_ctx + 1) * sizeof(int64_t));
    int64_t *granks = malloc(((size_t)m + 1) * sizeof(int64_t));
    uint8_t *raw = malloc((size_t)rawcap + 8);
    uint16_t *plen = malloc((size_t)n_ctx * MAX_UNARY * sizeof(uint16_t));
    Py_ssize_t ret = -7;
    if (!gcount || !gstart || !fill || !granks || !raw || !plen)
        goto done;
    for (Py_ssize_t j = 0; j < m; j++)
        gcount[ectx[j]]++;
    for (Py_ssize_t c = 0; c < n_ctx; c++)
        gstart[c + 1] = gstart[c] + gcount[c];
    memcpy(fill, gstart, (size_t)n_ctx * sizeof(int64_t));
    for (Py_ssize_t j = 0; j < m; j++)
        granks[fill[ectx[j]]++] = rank[j];

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
        for (int64_t j = 0; j < cnt; j++) {
            int64_t gap = g[j] - prev_r - 1;
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
        /* Sign and magnitude without a branch: the sign of a step is a coin flip (a branch on it cost a
         * third of this loop). */
        uint64_t d = (key_of(t, kind, sign, mask) - key_of(b, kind, sign, mask)) & mask;
        uint64_t neg = (d >> (bits - 1)) & 1, flip = 0 - neg;
        uint64_t mag = ((d ^ flip) - flip) & mask;
        unsigned ln = bitlen64(mag);
        uint16_t *pl = plen + e * MAX_UNARY;
        if (__builtin_expect(ln == 1 && bits > 1, 1)) { /* a step of one ulp: most changes */
            rc_bit(&rc, pl, 0, 0);
            raw_put56(&w, neg, 1);
            continue;
        }
        for (unsigned t2 = 0; t2 + 1 < ln; t2++)
            rc_bit(&rc, pl, t2, 1);
        if ((int)ln < bits)
            rc_bit(&rc, pl, ln - 1, 0);
        raw_put(&w, neg | (mag << 1), ln);
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
    return ret;
}

#define SPECIALISE(size)                                                                                      \
    static Py_ssize_t encode_changes_##size(const int32_t *ectx, const int32_t *rank, const void *bv, const void *tv, \
                                            Py_ssize_t m, int bits, int kind, Py_ssize_t n_ctx, uint8_t *out,        \
                                            Py_ssize_t cap)                                                          \
    {                                                                                                                \
        return encode_changes_t(ectx, rank, bv, tv, m, size, bits, kind, n_ctx, out, cap);                           \
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

static PyMethodDef methods[] = {
    {"scan16", py_scan16, METH_VARARGS,
     "scan16(base, target, shift, mask, n_ctx, pos, ectx, rank, bvals, tvals[, bits, kind, out]) -> m: "
     "kernels.ulp_scan for 16-bit elements; with out, also codes the changes: -> (m, nbytes), nbytes as "
     "encode_changes returns it (0 when nothing changed)."},
    {"encode_changes", py_encode_changes, METH_VARARGS,
     "encode_changes(ectx, rank, bvals, tvals, itemsize, bits, kind, n_ctx, out) -> nbytes: "
     "kernels.ulp_encode_changes, the same bytes."},
    {"use_simd", py_use_simd, METH_O, "use_simd(on) -> previous setting: allow the AVX-512 path (default True)."},
    {"simd", py_simd, METH_NOARGS, "The instruction set scan16 uses here: 'avx512' or 'portable'."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", "Native kernels of the ULP codec.", -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
