/* Causal prefill attention for CPUs with AVX-512 (torch's SDPA reaches about a fifth of the FMA
 * rate the linears do on a 512-token prompt; docs/kernels.md "Prefill attention").
 *
 * Two passes, both split between torch's threads by parallel.cpp:
 *  1. ss_prefill_kv_f32: the context's keys transposed to fp32 tiles [Hkv][ctx_pad / KB][D][KB]
 *     (each block's tile contiguous: a [D][ctx] layout puts a long context's rows 4 KiB apart, on
 *     one L1 set) and its values
 *     converted to fp32 [Hkv][ctx_pad][D], once per call, shared by every query block;
 *  2. ss_prefill_attention_items: one item = one KV head x one block of query positions (all the
 *     query heads of that group: up to ROWS rows reuse each key and value). Scores come from a
 *     4-row x 64-key register tile (a broadcast query element times four key vectors per step),
 *     values from a 4-row x 64-column tile; online softmax in fp32 per row.
 *
 * Key blocks are aligned to absolute positions and always KB wide (masked lanes are exact zeros),
 * so a row's arithmetic depends only on its own position and the keys before it: the same row
 * gives the same bits whether the prompt arrives whole, in chunks, or after a prefix-cache hit.
 * q: rows [q_len] of Hq*D at q_stride; k, v: rows [ctx] of Hkv*D at k_stride / v_stride; the
 * queries are the last q_len positions of the ctx keys. window: keys with pos > qpos - window,
 * 0 for none. out: [q_len, Hq, D] contiguous, rounded once. dtype: 0 float32, 1 bfloat16.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "vexp.h"

#define KB 64      /* keys per block: four vectors of a score tile */
#define ROWS 64    /* query rows (positions x heads of one group) per item */

int64_t ss_prefill_ctx_pad(int64_t ctx) { return (ctx + KB - 1) / KB * KB; }

int64_t ss_prefill_kv_items(int64_t ctx_pad, int64_t hkv) { return hkv * (ctx_pad / KB); }

int64_t ss_prefill_block_positions(int64_t group) { return group >= ROWS ? 1 : ROWS / group; }

int64_t ss_prefill_items(int64_t q_len, int64_t hkv, int64_t group) {
    const int64_t qb = ss_prefill_block_positions(group);
    return hkv * ((q_len + qb - 1) / qb);
}

#ifdef __AVX512F__
#include <immintrin.h>

int ss_prefill_attention_fast(void) { return 1; }

static inline float ld(const void *p, int64_t i, int bf) {
    return bf ? bf2f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* gcc folds a vector reused by four FMAs into each of them as a memory operand: four loads
 * instead of one, and a 512-bit load costs Zen 4 two load slots (the tiles were load-bound). */
#define KEEP_IN_REGISTERS(x) __asm__("" : "+v"(x))

/* bf16 activations on a CPU with AVX512_BF16: both products on vdpbf16ps (two bf16 products
 * summed into an fp32 lane per instruction: half the instructions of the fp32 tiles). Scores are
 * exact sums of bf16 products, as in the fp32 tiles; the softmax weights are rounded to bf16 for
 * the value product (as GPU flash attention does), their sum stays fp32. Layouts as the fp32
 * ones with pairs in 32-bit lanes: keys [Hkv][ctx_pad / KB][D / 2][KB] pairs of dims, values
 * [Hkv][ctx_pad / 2][D] pairs of keys. */
#ifdef __AVX512BF16__
#define BF16_DOT(dtype) ((dtype) == 1)
#define DOT(acc, a, b) _mm512_dpbf16_ps((acc), (__m512bh)(a), (__m512bh)(b))

static inline uint32_t pair(const uint16_t *p, int64_t i0, int64_t i1, int ok0, int ok1) {
    return (ok0 ? p[i0] : 0u) | (ok1 ? (uint32_t)p[i1] << 16 : 0u);
}

static void kv_pairs(const void *k, int64_t k_stride, const void *v, int64_t v_stride, int64_t ctx, int64_t ctx_pad,
                     int64_t dim, int64_t item0, int64_t item1, uint32_t *kt, uint32_t *vf) {
    const int64_t blocks = ctx_pad / KB, half = dim / 2;
    const uint16_t *kb16 = k, *vb16 = v;
    for (int64_t it = item0; it < item1; it++) {
        const int64_t h = it / blocks, j0 = it % blocks * KB;
        uint32_t *kh = kt + h * ctx_pad * half + j0 * half, *vh = vf + h * ctx_pad * half;
        for (int64_t j = j0; j < j0 + KB; j++)
            for (int64_t d2 = 0; d2 < half; d2++) {
                const int64_t at = j * k_stride + h * dim + 2 * d2;
                kh[d2 * KB + (j - j0)] = pair(kb16, at, at + 1, j < ctx, j < ctx);
            }
        for (int64_t j2 = j0 / 2; j2 < (j0 + KB) / 2; j2++)
            for (int64_t d = 0; d < dim; d++)
                vh[j2 * dim + d] = pair(vb16, 2 * j2 * v_stride + h * dim + d, (2 * j2 + 1) * v_stride + h * dim + d,
                                        2 * j2 < ctx, 2 * j2 + 1 < ctx);
    }
}

static inline void score_tile_dot(const uint32_t *qp, const uint32_t *kt, int64_t kb, int64_t dim, int64_t r0,
                                  float scale, float *s) {
    const int64_t half = dim / 2;
    __m512 a[4][4];
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 4; c++) a[r][c] = _mm512_setzero_ps();
    for (int64_t d2 = 0; d2 < half; d2++) {
        const uint32_t *kd = kt + kb * half + d2 * KB;
        __m512i k0 = _mm512_loadu_si512(kd), k1 = _mm512_loadu_si512(kd + 16);
        __m512i k2 = _mm512_loadu_si512(kd + 32), k3 = _mm512_loadu_si512(kd + 48);
        KEEP_IN_REGISTERS(k0);
        KEEP_IN_REGISTERS(k1);
        KEEP_IN_REGISTERS(k2);
        KEEP_IN_REGISTERS(k3);
        for (int r = 0; r < 4; r++) {
            const __m512i qv = _mm512_set1_epi32((int)qp[(r0 + r) * half + d2]);
            a[r][0] = DOT(a[r][0], qv, k0);
            a[r][1] = DOT(a[r][1], qv, k1);
            a[r][2] = DOT(a[r][2], qv, k2);
            a[r][3] = DOT(a[r][3], qv, k3);
        }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(s + (r0 + r) * KB + c * 16, _mm512_mul_ps(a[r][c], sc));
}

/* Row r's softmax weights (fp32, KB of them) as KB / 2 bf16 pairs. */
static inline void weight_pairs(const float *s, uint32_t *pp) {
    for (int c = 0; c < KB; c += 32) {
        const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + c + 16), _mm512_loadu_ps(s + c));
        _mm512_storeu_si512(pp + c / 2, (__m512i)b);
    }
}

static inline __attribute__((always_inline)) void value_tile_dot(const uint32_t *pp, const uint32_t *vf, int64_t kb,
                                                                 int64_t dim, int64_t r0, int64_t c0, float *o,
                                                                 const int NC) {
    __m512 a[4][4];
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < NC; c++) a[r][c] = _mm512_loadu_ps(o + (r0 + r) * dim + c0 + c * 16);
    for (int64_t j2 = 0; j2 < KB / 2; j2++) {
        const uint32_t *vj = vf + (kb / 2 + j2) * dim + c0;
        __m512i vv[4];
        for (int c = 0; c < NC; c++) {
            vv[c] = _mm512_loadu_si512(vj + c * 16);
            KEEP_IN_REGISTERS(vv[c]);
        }
        for (int r = 0; r < 4; r++) {
            const __m512i w = _mm512_set1_epi32((int)pp[(r0 + r) * (KB / 2) + j2]);
            for (int c = 0; c < NC; c++) a[r][c] = DOT(a[r][c], w, vv[c]);
        }
    }
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < NC; c++) _mm512_storeu_ps(o + (r0 + r) * dim + c0 + c * 16, a[r][c]);
}

static inline void value_tiles_dot(const uint32_t *pp, const uint32_t *vf, int64_t kb, int64_t dim, int64_t r0,
                                   float *o) {
    int64_t c0 = 0;
    for (; c0 + 64 <= dim; c0 += 64) value_tile_dot(pp, vf, kb, dim, r0, c0, o, 4);
    switch ((dim - c0) / 16) {
        case 3: value_tile_dot(pp, vf, kb, dim, r0, c0, o, 3); break;
        case 2: value_tile_dot(pp, vf, kb, dim, r0, c0, o, 2); break;
        case 1: value_tile_dot(pp, vf, kb, dim, r0, c0, o, 1); break;
        default: break;
    }
}
#else
#define BF16_DOT(dtype) 0
static void kv_pairs(const void *k, int64_t k_stride, const void *v, int64_t v_stride, int64_t ctx, int64_t ctx_pad,
                     int64_t dim, int64_t item0, int64_t item1, uint32_t *kt, uint32_t *vf) {
    (void)k; (void)k_stride; (void)v; (void)v_stride; (void)ctx; (void)ctx_pad; (void)dim; (void)item0; (void)item1;
    (void)kt; (void)vf;
}
#endif

/* Items [item0, item1) of (KV head, block of KB keys), ctx_pad / KB per head: kt[h][j / KB][d][j % KB]
 * = k[j][h][d] and vf[h][j][d] = v[j][h][d] in fp32; keys at ctx and past it are zeros. */
void ss_prefill_kv_f32(const void *k, int64_t k_stride, const void *v, int64_t v_stride, int64_t ctx,
                       int64_t ctx_pad, int64_t dim, int64_t item0, int64_t item1, float *kt, float *vf, int dtype) {
    const int64_t blocks = ctx_pad / KB;
    if (BF16_DOT(dtype)) {
        kv_pairs(k, k_stride, v, v_stride, ctx, ctx_pad, dim, item0, item1, (uint32_t *)kt, (uint32_t *)vf);
        return;
    }
    for (int64_t it = item0; it < item1; it++) {
        const int64_t h = it / blocks, j0 = it % blocks * KB, j1 = j0 + KB < ctx ? j0 + KB : ctx;
        float *kh = kt + h * dim * ctx_pad, *vh = vf + h * ctx_pad * dim;
        for (int64_t j = j0; j < j0 + KB; j++)
            for (int64_t d = 0; d < dim; d++) {
                kh[j0 * dim + d * KB + (j - j0)] = j < j1 ? ld(k, j * k_stride + h * dim + d, dtype) : 0.f;
                vh[j * dim + d] = j < j1 ? ld(v, j * v_stride + h * dim + d, dtype) : 0.f;
            }
    }
}

/* s[r][0..KB) = qf[r] . kt[:, kb..kb+KB) for four rows r0..r0+3. */
static inline void score_tile(const float *qf, const float *kt, int64_t kb, int64_t dim, int64_t r0, float *s) {
    __m512 a[4][4];
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 4; c++) a[r][c] = _mm512_setzero_ps();
    const float *q0 = qf + r0 * dim;
    for (int64_t d = 0; d < dim; d++) {
        const float *kd = kt + kb * dim + d * KB;
        __m512 k0 = _mm512_loadu_ps(kd), k1 = _mm512_loadu_ps(kd + 16);
        __m512 k2 = _mm512_loadu_ps(kd + 32), k3 = _mm512_loadu_ps(kd + 48);
        KEEP_IN_REGISTERS(k0);
        KEEP_IN_REGISTERS(k1);
        KEEP_IN_REGISTERS(k2);
        KEEP_IN_REGISTERS(k3);
        for (int r = 0; r < 4; r++) {
            const __m512 qv = _mm512_set1_ps(q0[r * dim + d]);
            a[r][0] = _mm512_fmadd_ps(qv, k0, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(qv, k1, a[r][1]);
            a[r][2] = _mm512_fmadd_ps(qv, k2, a[r][2]);
            a[r][3] = _mm512_fmadd_ps(qv, k3, a[r][3]);
        }
    }
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(s + (r0 + r) * KB + c * 16, a[r][c]);
}

/* o[r][c0..c0+16*NC) += sum_j p[r][j] * vf[kb + j][same columns] for four rows r0..r0+3; NC a
 * constant at each use (4 for the full tile, 1-3 for a head dim's last columns). */
static inline __attribute__((always_inline)) void value_tile(const float *p, const float *vf, int64_t kb,
                                                             int64_t dim, int64_t r0, int64_t c0, float *o,
                                                             const int NC) {
    __m512 a[4][4];
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < NC; c++) a[r][c] = _mm512_loadu_ps(o + (r0 + r) * dim + c0 + c * 16);
    for (int64_t j = 0; j < KB; j++) {
        const float *vj = vf + (kb + j) * dim + c0;
        __m512 vv[4];
        for (int c = 0; c < NC; c++) {
            vv[c] = _mm512_loadu_ps(vj + c * 16);
            KEEP_IN_REGISTERS(vv[c]);
        }
        for (int r = 0; r < 4; r++) {
            const __m512 w = _mm512_set1_ps(p[(r0 + r) * KB + j]);
            for (int c = 0; c < NC; c++) a[r][c] = _mm512_fmadd_ps(w, vv[c], a[r][c]);
        }
    }
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < NC; c++) _mm512_storeu_ps(o + (r0 + r) * dim + c0 + c * 16, a[r][c]);
}

static inline void value_tiles(const float *p, const float *vf, int64_t kb, int64_t dim, int64_t r0, float *o) {
    int64_t c0 = 0;
    for (; c0 + 64 <= dim; c0 += 64) value_tile(p, vf, kb, dim, r0, c0, o, 4);
    switch ((dim - c0) / 16) {
        case 3: value_tile(p, vf, kb, dim, r0, c0, o, 3); break;
        case 2: value_tile(p, vf, kb, dim, r0, c0, o, 2); break;
        case 1: value_tile(p, vf, kb, dim, r0, c0, o, 1); break;
        default: break;
    }
}

/* Row r's scores of block kb: masked to its keys, turned into weights (online softmax); returns 0
 * when the row has no key in the block (its weights are zeroed and its state left as it was). */
static inline int softmax_row(float *s, int64_t kb, int64_t pos, int64_t window, float *m, float *l, float *o,
                              int64_t dim) {
    const int64_t lo = window > 0 ? pos - window + 1 : 0;
    if (kb < lo || kb + KB - 1 > pos)
        for (int64_t j = 0; j < KB; j++)
            if (kb + j < lo || kb + j > pos) s[j] = -INFINITY;
    __m512 mx = _mm512_loadu_ps(s);
    for (int c = 1; c < KB / 16; c++) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + c * 16));
    const float blk = _mm512_reduce_max_ps(mx);
    if (blk == -INFINITY) {
        memset(s, 0, KB * sizeof(float));
        return 0;
    }
    const float m_new = blk > *m ? blk : *m;
    const float corr = *m == -INFINITY ? 0.f : expf(*m - m_new);
    exp_shifted(s, KB, m_new);
    __m512 sum = _mm512_loadu_ps(s);
    for (int c = 1; c < KB / 16; c++) sum = _mm512_add_ps(sum, _mm512_loadu_ps(s + c * 16));
    *l = *l * corr + _mm512_reduce_add_ps(sum);
    *m = m_new;
    if (corr != 1.f)
        for (int64_t d = 0; d < dim; d++) o[d] *= corr;
    return 1;
}

typedef struct {
    float qf[ROWS * 256], o[ROWS * 256], s[ROWS * KB], m[ROWS], l[ROWS];
    uint32_t qp[ROWS * 128], pp[ROWS * KB / 2];   /* the bf16-dot tiles' queries and weights, in pairs */
    int64_t pos[ROWS];
} Scratch;

/* Query block `qb` of KV head h into the scratch: rows (position, head of the group), scaled
 * queries in fp32, padded to a multiple of 4 with copies of the last row. Returns the row count. */
static int64_t load_rows(Scratch *w, const void *q, int64_t q_stride, int64_t q0, int64_t npos, int64_t h,
                         int64_t group, int64_t dim, int64_t first_pos, float scale, int bf) {
    const int64_t n = npos * group, n4 = (n + 3) & ~(int64_t)3;
    for (int64_t r = 0; r < n4; r++) {
        const int64_t rr = r < n ? r : n - 1, pi = rr / group, head = h * group + rr % group;
        const int64_t at = (q0 + pi) * q_stride + head * dim;
        if (BF16_DOT(bf))   /* unscaled: the scale multiplies the fp32 scores */
            memcpy(w->qp + r * dim / 2, (const uint16_t *)q + at, (size_t)dim * sizeof(uint16_t));
        else
            for (int64_t d = 0; d < dim; d++) w->qf[r * dim + d] = ld(q, at + d, bf) * scale;
        w->pos[r] = first_pos + q0 + pi;
        w->m[r] = -INFINITY;
        w->l[r] = 0.f;
    }
    memset(w->o, 0, (size_t)(n4 * dim) * sizeof(float));
    return n4;
}

static void attend_item(Scratch *w, int64_t n4, const float *kt, const float *vf, int64_t dim, int64_t window,
                        float scale, int dot) {
    const int64_t first = window > 0 && w->pos[0] - window + 1 > 0 ? (w->pos[0] - window + 1) / KB * KB : 0;
    for (int64_t kb = first; kb <= w->pos[n4 - 1]; kb += KB) {
        for (int64_t r0 = 0; r0 < n4; r0 += 4) {
#ifdef __AVX512BF16__
            if (dot) {
                score_tile_dot(w->qp, (const uint32_t *)kt, kb, dim, r0, scale, w->s);
                continue;
            }
#endif
            score_tile(w->qf, kt, kb, dim, r0, w->s);
        }
        for (int64_t r = 0; r < n4; r++)
            softmax_row(w->s + r * KB, kb, w->pos[r], window, &w->m[r], &w->l[r], w->o + r * dim, dim);
#ifdef __AVX512BF16__
        if (dot) {
            for (int64_t r = 0; r < n4; r++) weight_pairs(w->s + r * KB, w->pp + r * (KB / 2));
            for (int64_t r0 = 0; r0 < n4; r0 += 4) value_tiles_dot(w->pp, (const uint32_t *)vf, kb, dim, r0, w->o);
            continue;
        }
#endif
        (void)scale;
        (void)dot;
        for (int64_t r0 = 0; r0 < n4; r0 += 4) value_tiles(w->s, vf, kb, dim, r0, w->o);
    }
}

/* Items [item0, item1) of ss_prefill_items, in an order that pairs cheap early query blocks with
 * expensive late ones, so contiguous ranges of items cost about the same (causal work grows). */
void ss_prefill_attention_items(const void *q, int64_t q_stride, const float *kt, const float *vf, int64_t ctx,
                                int64_t ctx_pad, int64_t q_len, int64_t hq, int64_t hkv, int64_t dim, int64_t window,
                                float scale, void *out, int dtype, int64_t item0, int64_t item1) {
    const int64_t group = hq / hkv, qb = ss_prefill_block_positions(group), nqb = (q_len + qb - 1) / qb;
    Scratch *w = aligned_alloc(64, sizeof(Scratch));
    for (int64_t it = item0; it < item1; it++) {
        const int64_t k = it / hkv, h = it % hkv;
        const int64_t b = k % 2 == 0 ? k / 2 : nqb - 1 - k / 2;
        const int64_t q0 = b * qb, npos = q_len - q0 < qb ? q_len - q0 : qb;
        const int64_t n4 = load_rows(w, q, q_stride, q0, npos, h, group, dim, ctx - q_len, scale, dtype);
        const int dot = BF16_DOT(dtype);   /* a pair layout takes half the floats of a head's fp32 one */
        const int64_t head_floats = dot ? ctx_pad * dim / 2 : ctx_pad * dim;
        attend_item(w, n4, kt + h * head_floats, vf + h * head_floats, dim, window, scale, dot);
        for (int64_t r = 0; r < npos * group; r++) {
            const int64_t pi = r / group, head = h * group + r % group;
            const float inv = 1.f / w->l[r];
            for (int64_t d = 0; d < dim; d++) {
                const float val = w->o[r * dim + d] * inv;
                const int64_t at = ((q0 + pi) * hq + head) * dim + d;
                if (dtype) ((uint16_t *)out)[at] = f2bf(val); else ((float *)out)[at] = val;
            }
        }
    }
    free(w);
}
#else
int ss_prefill_attention_fast(void) { return 0; }
#endif

/* The whole attention on one thread (built without parallel.cpp; its _par splits both passes). */
void ss_prefill_attention(const void *q, int64_t q_stride, const void *k, int64_t k_stride, const void *v,
                          int64_t v_stride, int64_t q_len, int64_t ctx, int64_t hq, int64_t hkv, int64_t dim,
                          int64_t window, float scale, void *out, int dtype) {
#ifdef __AVX512F__
    const int64_t ctx_pad = ss_prefill_ctx_pad(ctx);
    float *kt = malloc((size_t)(hkv * ctx_pad * dim) * sizeof(float));
    float *vf = malloc((size_t)(hkv * ctx_pad * dim) * sizeof(float));
    ss_prefill_kv_f32(k, k_stride, v, v_stride, ctx, ctx_pad, dim, 0, ss_prefill_kv_items(ctx_pad, hkv), kt, vf, dtype);
    ss_prefill_attention_items(q, q_stride, kt, vf, ctx, ctx_pad, q_len, hq, hkv, dim, window, scale, out, dtype, 0,
                               ss_prefill_items(q_len, hkv, hq / hkv));
    free(kt);
    free(vf);
#else
    (void)q; (void)q_stride; (void)k; (void)k_stride; (void)v; (void)v_stride; (void)q_len; (void)ctx; (void)hq;
    (void)hkv; (void)dim; (void)window; (void)scale; (void)out; (void)dtype;   /* callers check _fast() first */
#endif
}
