/* Format 2's ulp class in C: encodings 6 (ulp2) and 7 (ulp2_hist), FORMAT.md "Format version 2".
 *
 * ulp2_encode(base, target, states, bits, kind, shift, mask, n_exp, hist, variant, pos, out) -> (m, nbytes)
 *     codec.ulp2_encode_kernels.ulp2_encode, byte for byte and return for return.
 * ulp2_decode(base, states, payload, n_changed, bits, kind, shift, mask, n_exp, hist, pos_out, val_out
 *             [, digest]) -> status, or (status, a0, a1) with digest = (start, s0, s1)
 *     the changes in increasing position and their target bits; status 0 or a codec.constants.STATUS code.
 * ulp2_kernel([name]) -> the positions pass in use before; ulp2_kernels() -> those this machine runs.
 *
 * The decoder trusts nothing in the payload: every table and stream read is bounds-checked, every table
 * entry range-checked before it is used. The SIMD positions passes read the stream from a copy padded with
 * zeros (a step reads at most 32 bytes past its position) and refuse once the position passes the end.
 * The encoder reads each input element once, into its own arrays, and codes from those only: an input
 * another thread writes while it runs gives a wrong payload (the chunk's post hash refuses it), never an
 * access out of bounds or a zero frequency.
 *
 * Positions pass (variant 0, 16-bit elements, one context per exponent, the contexts with changes within
 * 64 consecutive ones): 32 lanes of 16-bit states, a step of 32 elements at a time: the probabilities by
 * a 64-entry table lookup in registers, the binary decisions branch-free, the lanes that fall below L
 * take the next bytes in lane order (a prefix popcount and a byte shuffle; AVX-512: an expand). Every
 * other case, the tail step and the values pass run the scalar code, which is the reference.
 */
#include "_ulp2.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define ULP2_X86 1
#else
#define ULP2_X86 0
#endif

#define N_HIST 7
#define ST_TRUNC -1
#define ST_COUNT -4
#define ST_SMALL -5
#define ST_TRAIL -6
#define ST_VARIANT -7
#define ST_TABLE -8
#define ST_STATE -9
#define ST_END -10
#define ST_NOMEM -1000

typedef struct {
    int M, R, W, SB, UB;
    uint32_t L;
} vpar_t;

static int vparams(int variant, vpar_t *v)
{
    if (variant == 0) {
        *v = (vpar_t){8, 8, 32, 2, 1, 256};
        return 1;
    }
    if (variant == 1) {
        *v = (vpar_t){12, 16, 16, 4, 2, 65536};
        return 1;
    }
    return 0;
}

static inline uint64_t ld(const uint8_t *p, int64_t i, int isz)
{
    switch (isz) {
    case 1: return p[i];
    case 2: { uint16_t v; memcpy(&v, p + 2 * i, 2); return v; }
    case 4: { uint32_t v; memcpy(&v, p + 4 * i, 4); return v; }
    default: { uint64_t v; memcpy(&v, p + 8 * i, 8); return v; }
    }
}

static inline void st(uint8_t *p, int64_t i, int isz, uint64_t v)
{
    switch (isz) {
    case 1: p[i] = (uint8_t)v; break;
    case 2: { uint16_t x = (uint16_t)v; memcpy(p + 2 * i, &x, 2); break; }
    case 4: { uint32_t x = (uint32_t)v; memcpy(p + 4 * i, &x, 4); break; }
    default: memcpy(p + 8 * i, &v, 8); break;
    }
}

static inline uint64_t key_of(uint64_t u, int kind, uint64_t sign, uint64_t full)
{
    if (kind == 0) /* (u & sign) ? full - u : u | sign, branch-free: the sign of a weight is a coin toss */
        return u ^ (sign | ((0 - (uint64_t)((u & sign) != 0)) & (sign - 1)));
    (void)full;
    return kind == 1 ? u ^ sign : u;
}

static inline uint64_t unkey_of(uint64_t k, int kind, uint64_t sign, uint64_t full)
{
    if (kind == 0) /* (k & sign) ? k ^ sign : full - k, branch-free */
        return k ^ (sign | (((uint64_t)((k & sign) != 0) - 1) & (sign - 1)));
    (void)full;
    return kind == 1 ? k ^ sign : k;
}

static inline int bitlen(uint64_t x) { return x ? 64 - __builtin_clzll(x) : 0; }

/* ================================================================================================
 * Encoder
 * ================================================================================================ */

/* Encode [c, c + f) into *x; an emitted unit goes below *e; 0 where it would run into the header. */
static inline int put_sym(uint64_t *x, uint64_t c, uint64_t f, const vpar_t *V, uint8_t *out, int64_t *e, int64_t lo)
{
    uint64_t v = *x;
    if (v >= ((uint64_t)(V->L >> V->M) << V->R) * f) {
        *e -= V->UB;
        if (*e < lo)
            return 0;
        out[*e] = (uint8_t)v;
        if (V->UB == 2)
            out[*e + 1] = (uint8_t)(v >> 8);
        v >>= V->R;
    }
    *x = ((v / f) << V->M) + (v % f) + c;
    return 1;
}

static inline int64_t put_varint(uint8_t *out, int64_t o, uint64_t v)
{
    while (v >= 0x80) {
        out[o++] = (uint8_t)((v & 0x7F) | 0x80);
        v >>= 7;
    }
    out[o++] = (uint8_t)v;
    return o;
}

static inline int64_t put_uint(uint8_t *out, int64_t o, uint64_t v, int nb)
{
    out[o] = (uint8_t)v;
    if (nb == 2)
        out[o + 1] = (uint8_t)(v >> 8);
    return o + nb;
}

typedef struct {
    uint16_t *ctx;   /* [n] every element's context */
    int64_t *ne, *ce, *gidx, *gctx, *prob, *cnt, *cum, *kmax;
    int32_t *pos;    /* [m] the changes */
    uint64_t *dist;  /* [m] */
    uint8_t *flip;   /* [m] */
} encw_t;

static void encw_free(encw_t *w)
{
    free(w->ctx); free(w->ne); free(w->ce); free(w->gidx); free(w->gctx); free(w->prob); free(w->cnt);
    free(w->cum); free(w->kmax); free(w->pos); free(w->dist); free(w->flip);
}

/* Returns nbytes (>= 0), -1 (cannot code / out too small / bad argument) or ST_NOMEM; *m_out the changes. */
static int64_t ulp2_encode_c(const uint8_t *base, const uint8_t *target, const uint8_t *states, int64_t n, int isz,
                             int bits, int kind, unsigned shift, uint64_t mask, int64_t n_exp, int hist, int variant,
                             int32_t *pos_out, uint8_t *out, int64_t cap, int64_t *m_out)
{
    vpar_t V;
    *m_out = 0;
    if (!vparams(variant, &V) || n_exp < 1 || bits < 8 || bits > 64)
        return -1;
    const int64_t one = 1ll << V.M, nctx = n_exp * (hist ? N_HIST : 1);
    const uint64_t sign = 1ull << (bits - 1), full = (sign - 1) | sign;
    encw_t w = {0};
    int64_t ret = -1, m = 0, mcap = n / 16 + 64;
    w.ctx = malloc((size_t)n * 2 + 2);
    w.ne = calloc((size_t)nctx, 8);
    w.ce = calloc((size_t)nctx, 8);
    w.gidx = malloc((size_t)nctx * 8);
    w.prob = calloc((size_t)nctx, 8);
    w.pos = malloc((size_t)mcap * 4);
    w.dist = malloc((size_t)mcap * 8);
    w.flip = malloc((size_t)mcap);
    if (!w.ctx || !w.ne || !w.ce || !w.gidx || !w.prob || !w.pos || !w.dist || !w.flip) {
        ret = ST_NOMEM;
        goto done;
    }
    /* 1. One read of every element. */
    for (int64_t i = 0; i < n; i++) {
        const uint64_t b = ld(base, i, isz), t = ld(target, i, isz);
        const int64_t x = kind == 0 ? (int64_t)((b >> shift) & mask) : 0;
        int64_t stt = 0, fl = 0;
        if (hist) {
            const int64_t sb = states[i];
            stt = sb & 127;
            fl = sb >> 7;
            if (stt >= N_HIST)
                goto done;
        }
        if (x >= n_exp)
            goto done;
        const int64_t c = stt * n_exp + x;
        w.ctx[i] = (uint16_t)c;
        w.ne[c]++;
        if (b != t) {
            if (m == mcap) {
                mcap *= 2;
                int32_t *p2 = realloc(w.pos, (size_t)mcap * 4);
                if (p2) w.pos = p2;
                uint64_t *d2 = realloc(w.dist, (size_t)mcap * 8);
                if (d2) w.dist = d2;
                uint8_t *f2 = realloc(w.flip, (size_t)mcap);
                if (f2) w.flip = f2;
                if (!p2 || !d2 || !f2) {
                    ret = ST_NOMEM;
                    goto done;
                }
            }
            w.pos[m] = (int32_t)i;
            w.dist[m] = (key_of(t, kind, sign, full) - key_of(b, kind, sign, full)) & full;
            w.flip[m] = (uint8_t)(stt != 0 ? fl : 0);
            w.ce[c]++;
            m++;
        }
    }
    *m_out = m;
    memcpy(pos_out, w.pos, (size_t)m * 4);
    if (m == 0) {
        ret = 0;
        goto done;
    }
    /* 2. Tables from the exact counts. */
    int64_t G = 0;
    for (int64_t c = 0; c < nctx; c++)
        w.gidx[c] = w.ce[c] > 0 ? G++ : -1;
    const int64_t B1 = bits + 1;
    w.gctx = malloc((size_t)G * 8);
    w.cnt = calloc((size_t)(G * B1), 8);
    w.cum = calloc((size_t)(G * B1), 8);
    w.kmax = calloc((size_t)G, 8);
    if (!w.gctx || !w.cnt || !w.cum || !w.kmax) {
        ret = ST_NOMEM;
        goto done;
    }
    for (int64_t c = 0; c < nctx; c++)
        if (w.ce[c] > 0) {
            w.gctx[w.gidx[c]] = c;
            int64_t p = (2 * w.ce[c] * one + w.ne[c]) / (2 * w.ne[c]);
            w.prob[c] = p < 1 ? 1 : (p > one - 1 ? one - 1 : p);
        }
    int64_t sc[N_HIST] = {0}, sc1[N_HIST] = {0};
    for (int64_t j = 0; j < m; j++) {
        const uint64_t d = w.dist[j];
        const int s = (d & sign) != 0;
        const uint64_t a = s ? ((0 - d) & full) : d;
        const int k = bitlen(a);
        const int64_t c = w.ctx[w.pos[j]];
        w.cnt[w.gidx[c] * B1 + k]++;
        sc[c / n_exp]++;
        sc1[c / n_exp] += s ^ w.flip[j];
    }
    for (int64_t g = 0; g < G; g++) {
        int64_t *cn = w.cnt + g * B1, *cu = w.cum + g * B1, tot = 0, fsum = 0, fs[65] = {0};
        int best = 1;
        for (int k = 1; k <= bits; k++) {
            tot += cn[k];
            if (cn[k] > 0)
                w.kmax[g] = k;
            if (cn[k] > cn[best])
                best = k;
        }
        for (int k = 1; k <= bits; k++)
            if (cn[k] > 0) {
                fs[k] = (cn[k] * one) / tot;
                if (fs[k] < 1)
                    fs[k] = 1;
                fsum += fs[k];
            }
        fs[best] += one - fsum;
        if (fs[best] < 1)
            goto done;
        for (int k = 1; k <= bits; k++)
            cu[k] = cu[k - 1] + fs[k];
    }
    int64_t sign_p[N_HIST];
    for (int t = 0; t < N_HIST; t++) {
        sign_p[t] = one >> 1;
        if (hist && t > 0 && sc[t] > 0) {
            int64_t p = (2 * sc1[t] * one + sc[t]) / (2 * sc[t]);
            sign_p[t] = p < 1 ? 1 : (p > one - 1 ? one - 1 : p);
        }
    }
    /* 3. Header. */
    const int PB = variant == 0 ? 1 : 2;
    const int64_t need = 1 + 5 + G * (5 + PB) + G * (1 + PB * (bits - 1)) + 6 * PB + V.W * V.SB;
    if (cap < need)
        goto done;
    int64_t o = 0;
    out[o++] = (uint8_t)variant;
    o = put_varint(out, o, (uint64_t)G);
    int64_t prev = -1;
    for (int64_t g = 0; g < G; g++) {
        const int64_t c = w.gctx[g];
        o = put_varint(out, o, (uint64_t)(c - prev - 1));
        o = put_uint(out, o, (uint64_t)w.prob[c], PB);
        prev = c;
    }
    for (int64_t g = 0; g < G; g++) {
        out[o++] = (uint8_t)w.kmax[g];
        for (int k = 1; k < w.kmax[g]; k++)
            o = put_uint(out, o, (uint64_t)(w.cum[g * B1 + k] - w.cum[g * B1 + k - 1]), PB);
    }
    if (hist)
        for (int t = 1; t < N_HIST; t++)
            o = put_uint(out, o, (uint64_t)sign_p[t], PB);
    const int64_t st_off = o, lo = o + V.W * V.SB;
    /* 4. The steps in reverse. */
    uint64_t xs[32];
    for (int l = 0; l < V.W; l++)
        xs[l] = V.L;
    int64_t e = cap;
    const int64_t W = V.W, ng = (m + W - 1) / W;
    for (int64_t g = ng - 1; g >= 0; g--) {
        const int64_t j0 = g * W, j1 = m < j0 + W ? m : j0 + W;
        int64_t rounds = 0;
        for (int64_t j = j0; j < j1; j++) {
            const uint64_t d = w.dist[j];
            const int k = bitlen((d & sign) ? ((0 - d) & full) : d);
            const int64_t r = (k - 1 + V.M - 1) / V.M;
            if (r > rounds)
                rounds = r;
        }
        for (int64_t r = rounds; r > 0; r--)
            for (int64_t j = j1 - 1; j >= j0; j--) {
                const uint64_t d = w.dist[j], a = (d & sign) ? ((0 - d) & full) : d;
                const int64_t left = bitlen(a) - 1 - (r - 1) * V.M;
                if (left > 0) {
                    const int nb = left < V.M ? (int)left : V.M;
                    const uint64_t v = (a >> ((r - 1) * V.M)) & ((1ull << nb) - 1);
                    if (!put_sym(&xs[j - j0], v << (V.M - nb), 1ull << (V.M - nb), &V, out, &e, lo))
                        goto done;
                }
            }
        for (int64_t j = j1 - 1; j >= j0; j--) {
            const int64_t c = w.ctx[w.pos[j]], t = c / n_exp;
            int64_t bit = (w.dist[j] & sign) != 0, q = one >> 1;
            if (hist && t != 0) {
                bit ^= w.flip[j];
                q = sign_p[t];
            }
            if (!(bit ? put_sym(&xs[j - j0], 0, (uint64_t)q, &V, out, &e, lo)
                      : put_sym(&xs[j - j0], (uint64_t)q, (uint64_t)(one - q), &V, out, &e, lo)))
                goto done;
        }
        for (int64_t j = j1 - 1; j >= j0; j--) {
            const int64_t g2 = w.gidx[w.ctx[w.pos[j]]];
            const uint64_t d = w.dist[j];
            const int k = bitlen((d & sign) ? ((0 - d) & full) : d);
            const int64_t *cu = w.cum + g2 * B1;
            if (!put_sym(&xs[j - j0], (uint64_t)cu[k - 1], (uint64_t)(cu[k] - cu[k - 1]), &V, out, &e, lo))
                goto done;
        }
    }
    int64_t jp = m - 1;
    const int64_t ns = (n + W - 1) / W;
    for (int64_t s = ns - 1; s >= 0; s--)
        for (int64_t l = W - 1; l >= 0; l--) {
            const int64_t i = s * W + l;
            if (i >= n)
                continue;
            const int64_t p = w.prob[w.ctx[i]];
            if (p == 0)
                continue;
            int ok;
            if (jp >= 0 && w.pos[jp] == i) {
                jp--;
                ok = put_sym(&xs[l], 0, (uint64_t)p, &V, out, &e, lo);
            } else
                ok = put_sym(&xs[l], (uint64_t)p, (uint64_t)(one - p), &V, out, &e, lo);
            if (!ok)
                goto done;
        }
    for (int l = 0; l < V.W; l++)
        for (int b = 0; b < V.SB; b++)
            out[st_off + l * V.SB + b] = (uint8_t)(xs[l] >> (8 * b));
    const int64_t slen = cap - e;
    memmove(out + lo, out + e, (size_t)slen);
    ret = lo + slen;
done:
    encw_free(&w);
    return ret;
}

/* ================================================================================================
 * Decoder
 * ================================================================================================ */

typedef struct {
    /* the chunk */
    const uint8_t *base, *states;
    int64_t n, n_exp, nctx;
    int isz, bits, kind, hist;
    unsigned shift;
    uint64_t mask;
    /* the coder */
    vpar_t V;
    uint16_t *ptab;   /* [nctx] p, 0 where the context has no entry */
    int32_t *gidx;    /* [nctx] value table of a context, -1 none */
    uint32_t *cum;    /* [G][bits + 1] */
    int32_t *kk;      /* [G] K */
    uint32_t *klut;   /* variant 0: [G][256] per slot: k | c << 8 | f << 16 of its bit length k */
    uint8_t *sbuf;    /* the stream, copied and padded */
    uint32_t sign_p[N_HIST];
    uint32_t x[32];
    const uint8_t *sb; /* stream */
    int64_t slen, sp;
    /* the output */
    int64_t m, k;
    int64_t *pos;
    uint16_t *ectx;   /* [m] contexts of the changes (with a history) */
    uint16_t *ebase;  /* [m + 32] base elements of the changes (16-bit elements without a history, else NULL):
                       * the positions pass keeps them, the values pass reads no base at a position */
} dec_t;

static int get_varint(const uint8_t *p, int64_t len, int64_t *o, uint64_t *v)
{
    uint64_t r = 0;
    for (int b = 0; b < 5; b++) {
        if (*o >= len)
            return ST_TRUNC;
        const uint8_t c = p[(*o)++];
        r |= (uint64_t)(c & 0x7F) << (7 * b);
        if (!(c & 0x80)) {
            if ((b > 0 && c == 0) || r >= (1ull << 32))
                return ST_TABLE;
            *v = r;
            return 0;
        }
    }
    return ST_TABLE;
}

static inline uint32_t get_u(const uint8_t *p, int nb) { return nb == 1 ? p[0] : (uint32_t)p[0] | ((uint32_t)p[1] << 8); }

/* The tables and lane states: D->sb/slen set to the stream. */
static int parse_header(dec_t *D, const uint8_t *pl, int64_t plen)
{
    if (plen < 1)
        return ST_TRUNC;
    if (!vparams(pl[0], &D->V))
        return ST_VARIANT;
    const vpar_t *V = &D->V;
    const int PB = pl[0] == 0 ? 1 : 2;
    const uint32_t one = 1u << V->M;
    int64_t o = 1;
    uint64_t G;
    int r = get_varint(pl, plen, &o, &G);
    if (r)
        return r;
    if (G == 0 || G > (uint64_t)D->nctx)
        return ST_TABLE;
    int64_t prev = -1, ng = 0;
    int32_t *gctx = malloc(sizeof(int32_t) * (size_t)D->nctx);
    if (!gctx)
        return ST_NOMEM;
    for (uint64_t g = 0; g < G; g++) {
        uint64_t gap;
        if ((r = get_varint(pl, plen, &o, &gap)))
            goto fail;
        const int64_t c = prev + 1 + (int64_t)gap;
        if (c >= D->nctx) {
            r = ST_TABLE;
            goto fail;
        }
        if (o + PB > plen) {
            r = ST_TRUNC;
            goto fail;
        }
        const uint32_t p = get_u(pl + o, PB);
        o += PB;
        if (p < 1 || p > one - 1) {
            r = ST_TABLE;
            goto fail;
        }
        D->ptab[c] = (uint16_t)p;
        D->gidx[c] = (int32_t)ng;
        gctx[ng++] = (int32_t)c;
        prev = c;
    }
    const int64_t B1 = D->bits + 1;
    D->cum = calloc((size_t)(ng * B1), 4);
    D->kk = malloc(sizeof(int32_t) * (size_t)ng);
    if (!D->cum || !D->kk) {
        r = ST_NOMEM;
        goto fail;
    }
    for (int64_t g = 0; g < ng; g++) {
        if (o >= plen) {
            r = ST_TRUNC;
            goto fail;
        }
        const int K = pl[o++];
        if (K < 1 || K > D->bits) {
            r = ST_TABLE;
            goto fail;
        }
        uint32_t *cu = D->cum + g * B1, sum = 0;
        for (int k = 1; k < K; k++) {
            if (o + PB > plen) {
                r = ST_TRUNC;
                goto fail;
            }
            sum += get_u(pl + o, PB);
            o += PB;
            cu[k] = sum;
        }
        if (sum >= one) {
            r = ST_TABLE;
            goto fail;
        }
        cu[K] = one;
        D->kk[g] = K;
    }
    if (V->M == 8) {
        D->klut = malloc(sizeof(uint32_t) * (size_t)(ng * 256) + 4);
        if (!D->klut) {
            r = ST_NOMEM;
            goto fail;
        }
        for (int64_t g = 0; g < ng; g++) /* the slots [cum[k-1], cum[k]) of each k (cum rises to 256) */
            for (int k = 1; k <= D->kk[g]; k++) {
                const uint32_t c0 = D->cum[g * B1 + k - 1], c1 = D->cum[g * B1 + k];
                const uint32_t e = (uint32_t)k | c0 << 8 | (c1 - c0) << 16;
                for (uint32_t q = c0; q < c1; q++)
                    D->klut[g * 256 + q] = e;
            }
    }
    free(gctx);
    gctx = NULL;
    for (int t = 0; t < N_HIST; t++)
        D->sign_p[t] = one >> 1;
    if (D->hist)
        for (int t = 1; t < N_HIST; t++) {
            if (o + PB > plen)
                return ST_TRUNC;
            const uint32_t p = get_u(pl + o, PB);
            o += PB;
            if (p < 1 || p > one - 1)
                return ST_TABLE;
            D->sign_p[t] = p;
        }
    if (o + (int64_t)V->W * V->SB > plen)
        return ST_TRUNC;
    for (int l = 0; l < V->W; l++) {
        const uint8_t *q = pl + o + l * V->SB;
        const uint32_t x = V->SB == 2 ? (uint32_t)q[0] | ((uint32_t)q[1] << 8)
                                      : (uint32_t)q[0] | ((uint32_t)q[1] << 8) | ((uint32_t)q[2] << 16) | ((uint32_t)q[3] << 24);
        if (x < V->L || (uint64_t)x >= ((uint64_t)V->L << V->R))
            return ST_STATE;
        D->x[l] = x;
    }
    o += (int64_t)V->W * V->SB;
    D->slen = plen - o;
    D->sp = 0;
    D->sbuf = malloc((size_t)D->slen + 64);
    if (!D->sbuf)
        return ST_NOMEM;
    memcpy(D->sbuf, pl + o, (size_t)D->slen);
    memset(D->sbuf + D->slen, 0, 64);
    D->sb = D->sbuf;
    return 0;
fail:
    free(gctx);
    return r;
}

static inline int64_t ctx_at(const dec_t *D, int64_t i, int isz, int hist)
{
    const int64_t x = D->kind == 0 ? (int64_t)((ld(D->base, i, isz) >> D->shift) & D->mask) : 0;
    return hist ? (int64_t)(D->states[i] & 127) * D->n_exp + x : x;
}

/* Lane l's renormalization, branch-free (the stream is a copy padded with 64 zero bytes, so the unit is
 * read whether or not the lane takes it); a lane that moves past the stream's end jumps to trunc. */
#define RENORM(xx)                                                                                     \
    {                                                                                                  \
        const uint32_t nd_ = (xx) < L;                                                                 \
        const uint32_t u_ = UB == 1 ? sb[sp] : (uint32_t)sb[sp] | ((uint32_t)sb[sp + 1] << 8);           \
        (xx) = nd_ ? (((xx) << R) | u_) : (xx);                                                        \
        sp += nd_ * UB;                                                                                \
        if (__builtin_expect(sp > slen, 0))                                                            \
            goto trunc;                                                                                \
    }

/* Positions steps [s0, s1) one lane at a time (the reference; the SIMD passes' tail). */
static inline __attribute__((always_inline)) int pos_scalar_t(dec_t *D, int64_t s0, int64_t s1, int isz, int hist,
                                                              const int M, const int R, const int UB, const uint32_t L,
                                                              const int W)
{
    const int64_t n = D->n, m = D->m, slen = D->slen;
    const uint32_t smask = (1u << M) - 1;
    const uint8_t *sb = D->sb;
    const uint16_t *ptab = D->ptab;
    int64_t sp = D->sp, k = D->k;
    uint32_t x[32];
    memcpy(x, D->x, sizeof x);
    for (int64_t s = s0; s < s1; s++)
        for (int64_t l = 0; l < W; l++) {
            const int64_t i = s * W + l;
            if (i >= n)
                break;
            if (hist && (D->states[i] & 127) >= N_HIST)
                goto table;
            const int64_t c = ctx_at(D, i, isz, hist);
            const uint32_t p = ptab[c], slot = x[l] & smask, hi = x[l] >> M;
            const int bit = slot < p;
            x[l] = bit ? p * hi + slot : x[l] - p * hi - p;
            RENORM(x[l])
            if (bit) {
                if (k >= m)
                    goto count; /* more changes than the record's, refused at once */
                D->pos[k] = i;
                if (hist)
                    D->ectx[k] = (uint16_t)c;
                else if (isz == 2)
                    D->ebase[k] = (uint16_t)ld(D->base, i, 2);
                k++;
            }
        }
    memcpy(D->x, x, sizeof x);
    D->sp = sp;
    D->k = k;
    return 0;
trunc:
    return ST_TRUNC;
table:
    return ST_TABLE;
count:
    return ST_COUNT;
}

#define POS_V(isz, hist)                                                                               \
    (D->V.W == 32 ? pos_scalar_t(D, s0, s1, isz, hist, 8, 8, 1, 256, 32)                               \
                  : pos_scalar_t(D, s0, s1, isz, hist, 12, 16, 2, 65536, 16))

static __attribute__((noinline)) int pos_scalar(dec_t *D, int64_t s0, int64_t s1)
{
    if (D->hist)
        switch (D->isz) {
        case 1: return POS_V(1, 1);
        case 2: return POS_V(2, 1);
        case 4: return POS_V(4, 1);
        default: return POS_V(8, 1);
        }
    switch (D->isz) {
    case 1: return POS_V(1, 0);
    case 2: return POS_V(2, 0);
    case 4: return POS_V(4, 0);
    default: return POS_V(8, 0);
    }
}

/* The changes' bits of one step's mask (16-bit elements, no history): their positions and base elements.
 * The caller checked that they fit (k + popcount(bits) <= m). */
static inline void take_bits(dec_t *D, uint32_t bits, int64_t i0)
{
    while (bits) {
        const int64_t i = i0 + __builtin_ctz(bits);
        bits &= bits - 1;
        D->ebase[D->k] = (uint16_t)ld(D->base, i, 2);
        D->pos[D->k++] = i;
    }
}

/* Change j's base element: kept by the positions pass (16-bit elements without a history), else read. */
static inline uint64_t ebase_of(const dec_t *D, int64_t j)
{
    return D->ebase ? D->ebase[j] : ld(D->base, D->pos[j], D->isz);
}

/* Change j's context: kept by the positions pass with a history, else from its base element. */
static inline int64_t ectx_of(const dec_t *D, int64_t j)
{
    return D->hist ? D->ectx[j] : D->kind == 0 ? (int64_t)((ebase_of(D, j) >> D->shift) & D->mask) : 0;
}

#include "_ulp2_simd.h"

/* ------------------------------------------------------------------------------------------------
 * Values pass (scalar, every path)
 * ------------------------------------------------------------------------------------------------ */
/* The coder's constants are the variant's, compile-time in each copy (no division by a variable). */
static inline __attribute__((always_inline)) int values_t(dec_t *D, uint8_t *val, const int M, const int R,
                                                          const int UB, const uint32_t L, const int W, const int hist,
                                                          const int simd)
{
    const int64_t m = D->m, B1 = D->bits + 1, n_exp = D->n_exp, slen = D->slen;
    const uint32_t smask = (1u << M) - 1;
    const uint64_t sign = 1ull << (D->bits - 1), full = (sign - 1) | sign;
    const uint8_t *sb = D->sb;
    int64_t sp = D->sp;
    const int isz = D->isz, kind = D->kind;
    const uint8_t *const base = D->base; /* (locals: the stores through val may alias D for the compiler) */
    const int64_t *const posv = D->pos;
    const uint16_t *const eb = D->ebase;
    uint32_t x[32];
    int kl[32], neg[32];
    uint64_t mant[32];
    memcpy(x, D->x, sizeof x);
    for (int64_t j0 = 0; j0 < m; j0 += W) {
        const int nl = (int)(m - j0 < W ? m - j0 : W);
        int rounds = 0;
#if ULP2_X86
        if (M == 8 && simd && nl == 32) {
            int stored = 0;
            const int r = values_group_avx2(D, j0, x, &sp, kl, neg, mant, val, &stored);
            if (r)
                return r;
            if (stored)
                continue;
            goto values;
        }
#endif
        for (int l = 0; l < nl; l++) { /* round 0: the bit lengths */
            const int32_t g = D->gidx[ectx_of(D, j0 + l)];
            if (g < 0)
                return ST_TABLE; /* only where the base changed since the positions pass */
            const uint32_t *cu = D->cum + (int64_t)g * B1, slot = x[l] & smask;
            int k = 1;
            if (M == 8)
                k = D->klut[(int64_t)g * 256 + slot] & 255;
            else
                for (int q = 1; q < D->kk[g]; q++)
                    k += cu[q] <= slot;
            x[l] = (cu[k] - cu[k - 1]) * (x[l] >> M) + slot - cu[k - 1];
            RENORM(x[l])
            kl[l] = k;
            mant[l] = 0;
            const int r = (k - 1 + M - 1) / M;
            rounds = r > rounds ? r : rounds;
        }
        for (int l = 0; l < nl; l++) { /* round 1: the signs */
            uint32_t p = 1u << (M - 1);
            int flip = 0;
            if (hist) {
                const int64_t t = D->ectx[j0 + l] / n_exp;
                if (t) {
                    p = D->sign_p[t];
                    flip = D->states[D->pos[j0 + l]] >> 7;
                }
            }
            const uint32_t slot = x[l] & smask, hi = x[l] >> M;
            const int b = slot < p;
            x[l] = b ? p * hi + slot : x[l] - p * hi - p;
            RENORM(x[l])
            neg[l] = b ^ flip;
        }
        for (int r = 1; r <= rounds; r++) /* rounds 2, 3, ...: the bits below the leading one */
            for (int l = 0; l < nl; l++) {
                const int left = kl[l] - 1 - (r - 1) * M;
                if (left > 0) {
                    const int nb = left < M ? left : M;
                    const uint32_t slot = x[l] & smask, v = slot >> (M - nb);
                    x[l] = (1u << (M - nb)) * (x[l] >> M) + slot - (v << (M - nb));
                    RENORM(x[l])
                    mant[l] |= (uint64_t)v << ((r - 1) * M);
                }
            }
    values:
        for (int l = 0; l < nl; l++) {
            const int64_t j = j0 + l;
            const uint64_t a = (1ull << (kl[l] - 1)) | mant[l], ng = 0 - (uint64_t)neg[l], d = (a ^ ng) - ng;
            const uint64_t b = eb ? eb[j] : ld(base, posv[j], isz);
            st(val, j, isz, unkey_of((key_of(b, kind, sign, full) + d) & full, kind, sign, full));
        }
    }
    memcpy(D->x, x, sizeof x);
    D->sp = sp;
    return 0;
trunc:
    return ST_TRUNC;
}

static __attribute__((noinline)) int values_pass(dec_t *D, uint8_t *val, int ker)
{
    if (D->V.W == 32) {
        if (ker > 0 && D->bits <= 32) /* (mantissas in 32-bit lanes) */
            return D->hist ? values_t(D, val, 8, 8, 1, 256, 32, 1, 1) : values_t(D, val, 8, 8, 1, 256, 32, 0, 1);
        return D->hist ? values_t(D, val, 8, 8, 1, 256, 32, 1, 0) : values_t(D, val, 8, 8, 1, 256, 32, 0, 0);
    }
    return D->hist ? values_t(D, val, 12, 16, 2, 65536, 16, 1, 0) : values_t(D, val, 12, 16, 2, 65536, 16, 0, 0);
}

/* ------------------------------------------------------------------------------------------------
 * The additive digest's move (integrity.additive; _native.c's digest_move computes the same sums).
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

static void move_sums(const dec_t *D, const uint8_t *val, const uint64_t *dg, uint64_t *sums)
{
    uint64_t a0 = 0, a1 = 0;
    for (int64_t j = 0; j < D->m; j++) {
        const uint64_t f = dg[0] + (uint64_t)D->pos[j];
        const uint64_t g0 = mix64(f ^ dg[1]), g1 = mix64(f ^ dg[2]);
        const uint64_t bn = ld(val, j, D->isz) * 0x9E3779B97F4A7C15ULL;
        const uint64_t bo = ebase_of(D, j) * 0x9E3779B97F4A7C15ULL;
        a0 += mix64(g0 ^ bn) - mix64(g0 ^ bo);
        a1 += mix64(g1 ^ bn) - mix64(g1 ^ bo);
    }
    sums[0] += a0;
    sums[1] += a1;
}

/* ------------------------------------------------------------------------------------------------
 * The kernels
 * ------------------------------------------------------------------------------------------------ */
#define N_KER 3
static const char *const ker_names[N_KER] = {"scalar", "avx2", "avx512"};
static int ker_choice = -1;

static int ker_supported(int k)
{
    if (k == 0)
        return 1;
#if ULP2_X86
    __builtin_cpu_init();
    if (k == 1)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt");
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vbmi2") && __builtin_cpu_supports("popcnt");
#else
    return 0;
#endif
}

static int ker_current(void)
{
    if (ker_choice >= 0)
        return ker_choice;
    /* "avx512" runs only when asked for by name: it has not yet been held to the scalar pass on an
     * AVX-512 machine (tests/test_ulp2_native.py does that wherever it runs). */
    int k = 1;
    while (k > 0 && !ker_supported(k))
        k--;
    return k;
}

/* This thread's last decode: nanoseconds of its positions pass and of the whole (ulp2_timing(), for the
 * benchmark scripts/ulp2_decode_bench.py). */
static __thread int64_t last_ns[2];

static inline int64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static int ulp2_decode_c(dec_t *D, const uint8_t *pl, int64_t plen, uint8_t *val, const uint64_t *dg, uint64_t *sums,
                         int ker)
{
    const int64_t t0 = now_ns();
    int r = parse_header(D, pl, plen);
    if (r)
        return r;
    const int64_t W = D->V.W, ns = (D->n + W - 1) / W;
    int64_t done = 0;
#if ULP2_X86
    if (ker > 0 && D->isz == 2 && !D->hist) {
        /* the contexts with changes must lie in a window of 64 */
        int64_t clo = -1, chi = -1;
        for (int64_t c = 0; c < D->nctx; c++)
            if (D->ptab[c]) {
                if (clo < 0)
                    clo = c;
                chi = c;
            }
        if (chi - clo < 64) {
            r = D->V.W == 16 ? pos_avx2_v1(D, clo, &done) : ker == 2 ? pos_avx512(D, clo, &done) : pos_avx2(D, clo, chi, &done);
            if (r)
                return r;
        }
    }
#else
    (void)ker;
#endif
    r = pos_scalar(D, done, ns);
    if (r)
        return r;
    last_ns[0] = now_ns() - t0;
    if (D->k != D->m || D->m == 0)
        return ST_COUNT;
    r = values_pass(D, val, ker);
    if (r)
        return r;
    for (int l = 0; l < W; l++)
        if (D->x[l] != D->V.L)
            return ST_END;
    if (D->sp != D->slen)
        return ST_TRAIL;
    if (dg)
        move_sums(D, val, dg, sums);
    last_ns[1] = now_ns() - t0;
    return 0;
}

/* ================================================================================================
 * Python entry points
 * ================================================================================================ */

/* A C-contiguous buffer of items of `isz` bytes (0: any) holding at least `need` items. */
static int buf(PyObject *o, Py_buffer *v, int writable, int isz, Py_ssize_t need, const char *what)
{
    if (PyObject_GetBuffer(o, v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    if (isz && v->itemsize != isz) {
        PyErr_Format(PyExc_ValueError, "%s has items of %zd bytes, needs %d", what, v->itemsize, isz);
        PyBuffer_Release(v);
        return -1;
    }
    if (v->len / (v->itemsize ? v->itemsize : 1) < need) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd items, needs %zd", what, v->len / (v->itemsize ? v->itemsize : 1), need);
        PyBuffer_Release(v);
        return -1;
    }
    return 0;
}

static int check_args(const char *fn, int bits, int kind, unsigned shift, unsigned long long mask, Py_ssize_t n_exp,
                      int hist)
{
    if ((bits != 8 && bits != 16 && bits != 32 && bits != 64) || kind < 0 || kind > 2 || shift >= (unsigned)bits ||
        n_exp < 1 || n_exp > 8192 || mask >= (unsigned long long)n_exp || (hist != 0 && hist != 1)) {
        PyErr_Format(PyExc_ValueError, "%s: bits, kind, shift, mask, n_exp or hist out of range", fn);
        return -1;
    }
    return 0;
}

PyObject *py_ulp2_encode(PyObject *self, PyObject *args)
{
    PyObject *ob, *ot, *os, *op, *oo;
    int bits, kind, hist, variant;
    unsigned shift;
    unsigned long long mask;
    Py_ssize_t n_exp;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOiiIKniiOO", &ob, &ot, &os, &bits, &kind, &shift, &mask, &n_exp, &hist, &variant,
                          &op, &oo))
        return NULL;
    if (check_args("ulp2_encode", bits, kind, shift, mask, n_exp, hist) < 0)
        return NULL;
    const int isz = bits / 8;
    Py_buffer v[5];
    int got = 0;
    PyObject *ret = NULL;
    if (buf(ob, &v[0], 0, isz, 0, "base") < 0)
        return NULL;
    got = 1;
    const Py_ssize_t n = v[0].len / isz;
    if (buf(ot, &v[1], 0, isz, 0, "target") < 0)
        goto done;
    got = 2;
    if (v[1].len != v[0].len) {
        PyErr_SetString(PyExc_ValueError, "ulp2_encode: base and target differ in length");
        goto done;
    }
    if (buf(os, &v[2], 0, 1, hist ? n : 0, "states") < 0)
        goto done;
    got = 3;
    if (buf(op, &v[3], 1, 4, n, "pos") < 0)
        goto done;
    got = 4;
    if (buf(oo, &v[4], 1, 1, 0, "out") < 0)
        goto done;
    got = 5;
    {
        int64_t m = 0, nb;
        Py_BEGIN_ALLOW_THREADS
        nb = ulp2_encode_c(v[0].buf, v[1].buf, v[2].buf, n, isz, bits, kind, shift, mask, n_exp, hist, variant,
                           v[3].buf, v[4].buf, v[4].len, &m);
        Py_END_ALLOW_THREADS
        if (nb == ST_NOMEM)
            PyErr_NoMemory();
        else
            ret = Py_BuildValue("(LL)", (long long)m, (long long)nb);
    }
done:
    while (got > 0)
        PyBuffer_Release(&v[--got]);
    return ret;
}

PyObject *py_ulp2_decode(PyObject *self, PyObject *args)
{
    PyObject *ob, *os, *opl, *opos, *oval, *odg = NULL;
    Py_ssize_t n_changed, n_exp;
    int bits, kind, hist;
    unsigned shift;
    unsigned long long mask;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOniiIKniOO|O", &ob, &os, &opl, &n_changed, &bits, &kind, &shift, &mask, &n_exp,
                          &hist, &opos, &oval, &odg))
        return NULL;
    if (check_args("ulp2_decode", bits, kind, shift, mask, n_exp, hist) < 0)
        return NULL;
    uint64_t dg[3] = {0, 0, 0}, sums[2] = {0, 0};
    int have_dg = 0;
    if (odg && odg != Py_None) {
        long long s;
        unsigned long long s0, s1;
        if (!PyArg_ParseTuple(odg, "LKK;digest must be (start, s0, s1)", &s, &s0, &s1))
            return NULL;
        dg[0] = (uint64_t)s;
        dg[1] = s0;
        dg[2] = s1;
        have_dg = 1;
    }
    const int isz = bits / 8;
    Py_buffer v[5];
    int got = 0;
    PyObject *ret = NULL;
    long stv = 0;
    if (buf(ob, &v[0], 0, isz, 0, "base") < 0)
        return NULL;
    got = 1;
    const Py_ssize_t n = v[0].len / isz;
    if (buf(os, &v[1], 0, 1, 0, "states") < 0)
        goto done;
    got = 2;
    if (buf(opl, &v[2], 0, 1, 0, "payload") < 0)
        goto done;
    got = 3;
    if (buf(opos, &v[3], 1, 8, 0, "pos_out") < 0)
        goto done;
    got = 4;
    if (buf(oval, &v[4], 1, isz, 0, "val_out") < 0)
        goto done;
    got = 5;
    /* numba's order: the outputs and the history too small, then the payload, then the count */
    if (n_changed < 0 || v[3].len / 8 < n_changed || v[4].len / isz < n_changed || (hist && v[1].len < n)) {
        stv = ST_SMALL;
    } else {
        dec_t D;
        memset(&D, 0, sizeof D);
        D.base = v[0].buf;
        D.states = v[1].buf;
        D.n = n;
        D.n_exp = n_exp;
        D.nctx = n_exp * (hist ? N_HIST : 1);
        D.isz = isz;
        D.bits = bits;
        D.kind = kind;
        D.hist = hist;
        D.shift = shift;
        D.mask = mask;
        D.m = n_changed;
        D.pos = v[3].buf;
        const int ker = ker_current();
        Py_BEGIN_ALLOW_THREADS
        D.ptab = calloc((size_t)D.nctx, 2);
        D.gidx = malloc(sizeof(int32_t) * (size_t)D.nctx);
        D.ectx = malloc((size_t)(n_changed < n ? n_changed : n) * 2 + 2);
        if (!hist && isz == 2)
            D.ebase = malloc((size_t)((n_changed < n ? n_changed : n) + 32) * 2);
        if (!D.ptab || !D.gidx || !D.ectx || (!hist && isz == 2 && !D.ebase))
            stv = ST_NOMEM;
        else {
            for (int64_t c = 0; c < D.nctx; c++)
                D.gidx[c] = -1;
            stv = ulp2_decode_c(&D, v[2].buf, v[2].len, v[4].buf, have_dg ? dg : NULL, sums, ker);
        }
        free(D.ptab);
        free(D.gidx);
        free(D.ectx);
        free(D.ebase);
        free(D.cum);
        free(D.kk);
        free(D.klut);
        free(D.sbuf);
        Py_END_ALLOW_THREADS
    }
    if (stv == ST_NOMEM)
        PyErr_NoMemory();
    else if (have_dg)
        ret = Py_BuildValue("(lKK)", stv, (unsigned long long)sums[0], (unsigned long long)sums[1]);
    else
        ret = PyLong_FromLong(stv);
done:
    while (got > 0)
        PyBuffer_Release(&v[--got]);
    return ret;
}

PyObject *py_ulp2_kernel(PyObject *self, PyObject *args)
{
    const char *name = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "|z", &name))
        return NULL;
    const char *was = ker_names[ker_current()];
    if (name != NULL) {
        int k = strcmp(name, "auto") == 0 ? -1 : -2;
        for (int j = 0; j < N_KER; j++)
            if (strcmp(name, ker_names[j]) == 0)
                k = j;
        if (k == -2 || (k >= 0 && !ker_supported(k))) {
            PyErr_Format(PyExc_ValueError, "ulp2_kernel: %s is not a kernel this machine runs", name);
            return NULL;
        }
        ker_choice = k;
    }
    return PyUnicode_FromString(was);
}

PyObject *py_ulp2_kernels(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    PyObject *l = PyList_New(0);
    for (int k = 0; l && k < N_KER; k++)
        if (ker_supported(k)) {
            PyObject *s = PyUnicode_FromString(ker_names[k]);
            if (!s || PyList_Append(l, s) < 0) {
                Py_XDECREF(s);
                Py_DECREF(l);
                return NULL;
            }
            Py_DECREF(s);
        }
    return l;
}

PyObject *py_ulp2_timing(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return Py_BuildValue("(LL)", (long long)last_ns[0], (long long)last_ns[1]);
}
