/* Weight-only quantized linear: out[r][n] = bias[n] + sum_k x[r][k] * w[n][k], with w held as
 * 8-bit or 4-bit quants and per-block scales (kernels/cpu_quant.py packs them). Decode is bound by
 * reading weights, so the quants are decoded in registers next to the FMAs that use them: no
 * dequantized copy is ever written. Activations float32 or bfloat16 (dtype 0 / 1), fp32 arithmetic,
 * one rounding to the activation dtype at the end (bf16 activations of GGUF blocks on AVX512_BF16
 * CPUs: each block's x . q as one bf16 dot product, quant_bh.h).
 *
 * Packed layout (one sequential stream per tile of QT output columns, no stream per column):
 *   quants: [N/QT tiles][K/32 blocks][QT columns][32 int8 | 16 nibble bytes]
 *   QF_INT8: scale fp32 [N], w = s * q                      (one scale per output column)
 *   QF_Q8:   scale fp16 [tiles][blocks][QT], w = d * q     (GGUF Q8_0)
 *   QF_Q4:   scale, mins fp16 [tiles][blocks][QT], w = d * q + m  (GGUF Q4_1; Q4_0 as m = -8d)
 * A 4-bit block's 16 bytes are 2 halves of 8: byte 8h + i holds element 16h + i in its low nibble
 * and element 16h + 8 + i in its high one (i < 8), so 8 bytes zero-extended to dwords give 8
 * consecutive elements with one AND and the next 8 with one shift (AVX2), or, the 8 bytes
 * broadcast, 16 consecutive elements with one variable shift and one AND (AVX-512).
 *
 * Per (row, column) the arithmetic is fixed, whatever the tile or batch it shares: per block
 * t = x . q (vector lanes, in order), acc += d * t, the sum of acc's lanes; for QF_Q4 plus
 * sum_b m_b * xsum_b, with xsum_b the row's sum of x over block b, computed once per call
 * (sum_k x_k (d q_k + m) = d x.q + m sum x: the minimums cost one multiply-add per block for all
 * of a tile's columns). QF_INT8 accumulates x . q over all of K and scales once. So a row's
 * result is batch-invariant.
 *
 * Optional for QF_Q4 (fmt | Q_ACT8): activations quantized to int8 per row and block of 32 once per
 * call (dx = max|x| / 127, xq = round(x / dx), as llama.cpp's Q8 activations), so each block's
 * x . q is an exact integer dot product (AVX2 maddubs + madd: a third of the fp32 path's
 * instructions); acc += (d dx) * that, and the minimum term as above from the fp32 block sums.
 * Results differ from the fp32 path by the activation rounding (up to dx / 2 per element); still
 * batch-invariant (a row's quantization and sums do not depend on the other rows).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { QF_INT8 = 0, QF_Q8 = 1, QF_Q4 = 2, Q_ACT8 = 4, Q_DOT = 8 };
/* Q_DOT: bf16 passes of Q_DOT_MIN_ROWS rows or more may take quant_dot.c's bf16 dot products
 * (the weight rounded to bf16 per tile, as the dense path's GEMM: not this file's arithmetic, so
 * the engine sets it only outside the deterministic mode). From the dense path's threshold
 * (quant_linear.py DENSE_MIN_ROWS), which it replaces up to 127 rows: below it decode and
 * speculative verification rows keep this file's row-independent kernel, so a verification
 * computes what plain decoding computes (the tests hold it for the default model). */
#define Q_DOT_MIN_ROWS 32
/* Weak: quant.c also builds alone (tests/unit/test_quant_kernels.py), without quant_dot.c. */
int ss_qdot_available(void) __attribute__((weak));
void ss_qdot_tiles(const void *x, int64_t x_stride, const void *quants, const void *scale, const void *mins,
                   const float *bias, int64_t t0, int64_t t1, int64_t n_dim, int64_t k_dim, int64_t rows, void *out,
                   int64_t out_stride, int fmt) __attribute__((weak));
#define QT 8          /* output columns per tile of the layout */
#define QB 32         /* weights per block */
#define Q_ROWS 8      /* activation rows converted to fp32 at a time */
#define Q_COLS 256    /* columns per chunk: its quants stay in L2 while every row block passes */
#define ALWAYS __attribute__((always_inline))

#include "bf16.h"
#include "f16.h"   /* h2f: the fallback for no F16C */

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__)) || defined(__F16C__)
#include <immintrin.h>
#endif

/* n halves to floats: once per tile and row block, so the block loop only broadcasts. */
static inline void scales_f32(const uint16_t *h, float *f, int64_t n) {
    int64_t i = 0;
#ifdef __F16C__
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < n; i++) f[i] = h2f(h[i]);
}

#if defined(__AVX512F__)
#define QV 16
typedef __m512 vf;
static inline vf v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline vf v_zero(void) { return _mm512_setzero_ps(); }
static inline vf v_set1(float a) { return _mm512_set1_ps(a); }
static inline vf v_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf v_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf v_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float v_hsum(vf a) { return _mm512_reduce_add_ps(a); }
static inline void dec_q8(const uint8_t *p, vf *q) {
    for (int j = 0; j < 2; j++)
        q[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16 * j))));
}
static inline void dec_q4(const uint8_t *p, vf *q) {   /* vector h: bytes 8h..8h+7's low, then high nibbles */
    const __m512i low = _mm512_set1_epi32(15), sh = _mm512_set_epi32(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int h = 0; h < 2; h++) {
        int64_t bytes;
        memcpy(&bytes, p + 8 * h, 8);
        const __m512i u = _mm512_cvtepu8_epi32(_mm_set1_epi64x(bytes));
        q[h] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(u, sh), low));
    }
}
#define Q_NB2 8       /* columns per register tile of 2 rows (2 x 8) and of 4 rows (4 x 4): 32 registers */
#define Q_NB4 4
#elif defined(__AVX2__) && defined(__FMA__)
#define QV 8
typedef __m256 vf;
static inline vf v_load(const float *p) { return _mm256_loadu_ps(p); }
static inline vf v_zero(void) { return _mm256_setzero_ps(); }
static inline vf v_set1(float a) { return _mm256_set1_ps(a); }
static inline vf v_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf v_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf v_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float v_hsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline void dec_q8(const uint8_t *p, vf *q) {
    for (int j = 0; j < 4; j++)
        q[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * j))));
}
static inline void dec_q4(const uint8_t *p, vf *q) {   /* vectors 2h, 2h + 1: bytes 8h..8h+7's low, high nibbles */
    /* 8 bytes zero-extended to dwords hold each low nibble under its high one: one AND gives 8
     * elements, one shift the next 8; one constant, no byte shuffle (13% faster at one row on a
     * Zen 3 than a broadcast, a variable shift, then 3 shifts and 4 ANDs on a dword layout). */
    const __m256i low = _mm256_set1_epi32(15);
    for (int h = 0; h < 2; h++) {
        const __m256i u = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * h)));
        q[2 * h] = _mm256_cvtepi32_ps(_mm256_and_si256(u, low));
        q[2 * h + 1] = _mm256_cvtepi32_ps(_mm256_srli_epi32(u, 4));
    }
}
#define Q_NB2 4       /* columns per register tile of 2 rows (2 x 4) and of 4 rows (4 x 2): 16 registers */
#define Q_NB4 2
#endif

#ifdef QV
#define QJ (QB / QV)  /* vectors per block */
#define Q_PREFETCH 1024   /* bytes ahead in the tile's quant stream */

/* total[r * QT + c] = the d * q part of dot(x row r, w column c0 + c) of one tile, r < NR,
 * c < NB, as a register tile: each block of a column is decoded once for NR rows. db: the tile's
 * scales as floats ([blocks][QT]). */
static inline ALWAYS void qtile(const float *xf, int64_t k_dim, const uint8_t *qt, const float *db, int c0,
                                const int NR, const int NB, const int fmt, float *total) {
    const int64_t nb = k_dim / QB, bpb = fmt == QF_Q4 ? QB / 2 : QB;
    vf acc[4][QT];
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NB; c++) acc[r][c] = v_zero();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *qb = qt + b * QT * bpb;
        for (int64_t line = 0; line < QT * bpb; line += 64)   /* the block's 2 (4-bit) or 4 lines, ahead */
            _mm_prefetch((const char *)qb + Q_PREFETCH + line, _MM_HINT_T0);
        for (int c = 0; c < NB; c++) {
            vf q[QJ];
            if (fmt == QF_Q4) dec_q4(qb + (c0 + c) * bpb, q); else dec_q8(qb + (c0 + c) * bpb, q);
            for (int r = 0; r < NR; r++) {
                const float *xr = xf + r * k_dim + b * QB;
                if (fmt == QF_INT8) {
                    for (int j = 0; j < QJ; j++) acc[r][c] = v_fma(v_load(xr + j * QV), q[j], acc[r][c]);
                    continue;
                }
                vf t = v_mul(v_load(xr), q[0]);
                for (int j = 1; j < QJ; j++) t = v_fma(v_load(xr + j * QV), q[j], t);
                acc[r][c] = v_fma(v_set1(db[b * QT + c0 + c]), t, acc[r][c]);
            }
        }
    }
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NB; c++) total[r * QT + c0 + c] = v_hsum(acc[r][c]);
}

/* One tile for the next 4, 2 or 1 of nr rows, with constant tile sizes so that the accumulators
 * stay in registers; returns the rows done. More rows per tile decode each block for more rows. */
static inline ALWAYS int64_t qtile_rows(const float *xf, int64_t k_dim, const uint8_t *qt, const float *db,
                                        int64_t nr, const int fmt, float *total) {
    if (nr >= 4) {
        for (int c0 = 0; c0 < QT; c0 += Q_NB4) qtile(xf, k_dim, qt, db, c0, 4, Q_NB4, fmt, total);
        return 4;
    }
    if (nr >= 2) {
        for (int c0 = 0; c0 < QT; c0 += Q_NB2) qtile(xf, k_dim, qt, db, c0, 2, Q_NB2, fmt, total);
        return 2;
    }
    qtile(xf, k_dim, qt, db, 0, 1, QT, fmt, total);
    return 1;
}

/* xs[r][b] = the sum of row r's x over block b (the vectors added in order, then their lanes). */
static void block_sums(const float *xf, int64_t rows, int64_t k_dim, float *xs) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < k_dim / QB; b++) {
            vf s = v_load(xf + r * k_dim + b * QB);
            for (int j = 1; j < QJ; j++) s = v_add(s, v_load(xf + r * k_dim + b * QB + j * QV));
            xs[r * (k_dim / QB) + b] = v_hsum(s);
        }
}
#else
#define QV 1

/* Portable: elementwise, the same formula as the vector paths with one lane. */
static inline float q_at(const uint8_t *qt, int64_t b, int c, int j, int fmt) {
    if (fmt != QF_Q4) return (float)(int8_t)qt[(b * QT + c) * QB + j];
    const uint8_t byte = qt[(b * QT + c) * (QB / 2) + 8 * (j / 16) + j % 8];
    return (float)((j % 16) < 8 ? byte & 15 : byte >> 4);
}

static inline int64_t qtile_rows(const float *xf, int64_t k_dim, const uint8_t *qt, const float *db, int64_t nr,
                                 const int fmt, float *total) {
    const int64_t nb = k_dim / QB;
    for (int64_t r = 0; r < nr; r++)
        for (int c = 0; c < QT; c++) {
            float acc = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                float t = 0.f;
                for (int j = 0; j < QB; j++) t += xf[r * k_dim + b * QB + j] * q_at(qt, b, c, j, fmt);
                acc += fmt == QF_INT8 ? t : db[b * QT + c] * t;
            }
            total[r * QT + c] = acc;
        }
    return nr;
}

static void block_sums(const float *xf, int64_t rows, int64_t k_dim, float *xs) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < k_dim / QB; b++) {
            float s = 0.f;
            for (int j = 0; j < QB; j++) s += xf[r * k_dim + b * QB + j];
            xs[r * (k_dim / QB) + b] = s;
        }
}
#endif

#if QV > 1
static inline __m256 load8h(const uint16_t *h) {   /* QT = 8 halves as floats */
#ifdef __F16C__
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
#else
    return _mm256_setr_ps(h2f(h[0]), h2f(h[1]), h2f(h[2]), h2f(h[3]), h2f(h[4]), h2f(h[5]), h2f(h[6]), h2f(h[7]));
#endif
}
#endif

/* mt[c] = sum_b m[b][c] * xs[b] for the tile's columns, from the fp16 minimums mh [blocks][QT]:
 * one conversion, multiply and add per block for all QT of them (8 lanes), the same order
 * whatever the tile shape. */
static inline void min_terms(const uint16_t *mh, const float *xs, int64_t nb, float *mt) {
#if QV > 1
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) acc = _mm256_add_ps(acc, _mm256_mul_ps(load8h(mh + b * QT), _mm256_set1_ps(xs[b])));
    _mm256_storeu_ps(mt, acc);
#else
    for (int c = 0; c < QT; c++) mt[c] = 0.f;
    for (int64_t b = 0; b < nb; b++)
        for (int c = 0; c < QT; c++) mt[c] += h2f(mh[b * QT + c]) * xs[b];
#endif
}

/* Int8 activations (Q_ACT8): element e of a block sits at byte P(e) of its 32, the order in which
 * the 4-bit kernel unpacks a block's nibbles (bytes 0-15: the 16 bytes' low nibbles, 16-31: their
 * high ones). xq [rows][blocks][32], dx [rows][blocks]. */
static inline int act8_pos(int e) { return (e % 16 < 8 ? 0 : 16) + 8 * (e / 16) + e % 8; }

static void quant_act8(const float *xf, int64_t rows, int64_t k_dim, int8_t *xq, float *dx) {
    const int64_t nb = k_dim / QB;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = xf + r * k_dim + b * QB;
#if defined(__AVX2__)
            /* The same values as the loop below: max of |x| (exact in any order), x * inv rounded to
             * nearest even by cvtps (the default rounding mode), in [-127, 127] by construction. */
            const __m256 sign = _mm256_set1_ps(-0.f);
            __m256 m = _mm256_andnot_ps(sign, _mm256_loadu_ps(xb));
            for (int j = 1; j < 4; j++) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + 8 * j)));
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            const float amx = _mm_cvtss_f32(h);
            const __m256 iv = _mm256_set1_ps(amx > 0.f ? 127.f / amx : 0.f);
            dx[r * nb + b] = amx / 127.f;
            __m256i v[4];
            for (int j = 0; j < 4; j++) v[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * j), iv));
            /* elements 0-7, 16-23 (the low nibbles' order), then 8-15, 24-31: packs interleave 128-bit
             * lanes, so pack (0-7, 16-23) and (8-15, 24-31) as dwords then words, and fix the order. */
            const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[2]), _mm256_packs_epi32(v[1], v[3]));
            /* w's dwords: [0-3, 16-19, 8-11, 24-27 | 4-7, 20-23, 12-15, 28-31] -> [0-7, 16-23, 8-15, 24-31] */
            _mm256_storeu_si256((__m256i *)(xq + (r * nb + b) * QB),
                                _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
            continue;
#endif
            float amax = 0.f;
            for (int e = 0; e < QB; e++) amax = fabsf(xb[e]) > amax ? fabsf(xb[e]) : amax;
            const float inv = amax > 0.f ? 127.f / amax : 0.f;
            dx[r * nb + b] = amax / 127.f;
            for (int e = 0; e < QB; e++) {
                const float v = nearbyintf(xb[e] * inv);
                xq[(r * nb + b) * QB + act8_pos(e)] = (int8_t)(v > 127.f ? 127.f : v < -127.f ? -127.f : v);
            }
        }
}

#if defined(__AVX2__) && defined(__FMA__)
#define Q_ACT8_SIMD 1
#define Q_PREFETCH8 4096  /* bytes ahead: this path eats the stream ~2.5x as fast (12% faster at one row
                           * and 2 threads on a Zen 3 than 1024 bytes) */
/* total[r * QT + c] = the d * q part of row r, column c0 + c over a tile, with int8 activations:
 * per block the 32 nibbles as bytes (a broadcast, a variable shift and an AND), then for each of
 * NR rows maddubs and madd give 8 int32 partial dot products (exact), converted and added with
 * weight d dx: acc += dd * float(isum). dd: [NR][blocks][QT]. */
static inline ALWAYS void qtile8(const int8_t *xq, int64_t nb, const uint8_t *qt, const float *dd, int c0,
                                 const int NR, const int NB, float *total) {
    const __m256i low = _mm256_set1_epi8(15), sh = _mm256_set_epi32(4, 4, 4, 4, 0, 0, 0, 0);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[4][QT];
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NB; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *qb = qt + b * QT * (QB / 2);
        _mm_prefetch((const char *)qb + Q_PREFETCH8, _MM_HINT_T0);
        _mm_prefetch((const char *)qb + Q_PREFETCH8 + 64, _MM_HINT_T0);
        for (int c = 0; c < NB; c++) {
            const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(qb + (c0 + c) * (QB / 2))));
            const __m256i q = _mm256_and_si256(_mm256_srlv_epi32(v, sh), low);
            for (int r = 0; r < NR; r++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (r * nb + b) * QB));
                const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), ones);
                acc[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(dd[(r * nb + b) * QT + c0 + c]), _mm256_cvtepi32_ps(p),
                                            acc[r][c]);
            }
        }
    }
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NB; c++) {
            const __m256 a = acc[r][c];
            __m128 t = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
            t = _mm_add_ps(t, _mm_movehl_ps(t, t));
            t = _mm_add_ss(t, _mm_movehdup_ps(t));
            total[r * QT + c0 + c] = _mm_cvtss_f32(t);
        }
}

static inline ALWAYS int64_t qtile8_rows(const int8_t *xq, int64_t nb, const uint8_t *qt, const float *dd,
                                         int64_t nr, float *total) {
    if (nr >= 4) {
        for (int c0 = 0; c0 < QT; c0 += 2) qtile8(xq, nb, qt, dd, c0, 4, 2, total);
        return 4;
    }
    if (nr >= 2) {
        for (int c0 = 0; c0 < QT; c0 += 4) qtile8(xq, nb, qt, dd, c0, 2, 4, total);
        return 2;
    }
    qtile8(xq, nb, qt, dd, 0, 1, QT, total);
    return 1;
}
#else
/* Portable: per block the integer dot product, then acc += dd * it, block by block. */
static inline int64_t qtile8_rows(const int8_t *xq, int64_t nb, const uint8_t *qt, const float *dd, int64_t nr,
                                  float *total) {
    for (int64_t r = 0; r < nr; r++)
        for (int c = 0; c < QT; c++) {
            float acc = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *qb = qt + (b * QT + c) * (QB / 2);
                int32_t isum = 0;
                for (int e = 0; e < QB; e++) {
                    const uint8_t byte = qb[8 * (e / 16) + e % 8];
                    isum += (e % 16 < 8 ? byte & 15 : byte >> 4) * xq[(r * nb + b) * QB + act8_pos(e)];
                }
                acc += dd[(r * nb + b) * QT + c] * (float)isum;
            }
            total[r * QT + c] = acc;
        }
    return nr;
}
#endif

#include "quant_bh.h"   /* Q_BH: the bf16-dot tiles for bf16 activations (AVX512_BF16) */

static inline float load_x(const void *p, int64_t i, int bf) {
    return bf ? bf2f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Up to Q_ROWS rows (row-strided x and out) over tiles [t0, t1): x converted to fp32 once, then
 * each tile's scales to floats once, then the tile for 4, 2 or 1 rows at a time. */
static inline ALWAYS void qlinear_block(const void *x, int64_t x_stride, const uint8_t *quants, const void *scale,
                                        const uint16_t *mins, const float *bias, int64_t t0, int64_t t1,
                                        int64_t n_dim, int64_t k_dim, int64_t rows, void *out, int64_t out_stride,
                                        const int fmt, const int bf, const int act8) {
    const int64_t nb = k_dim / QB, bpb = fmt == QF_Q4 ? QB / 2 : QB;
    float xf[Q_ROWS * k_dim], xs[fmt == QF_Q4 ? Q_ROWS * nb : 1], db[act8 ? 1 : nb * QT];
    float total[Q_ROWS * QT], mt[QT], dx[act8 ? Q_ROWS * nb : 1], dd[act8 ? Q_ROWS * nb * QT : 1];
    int8_t xq[act8 ? Q_ROWS * k_dim : 1];
    for (int64_t r = 0; r < rows; r++)
        for (int64_t k = 0; k < k_dim; k++) xf[r * k_dim + k] = load_x(x, r * x_stride + k, bf);
    if (fmt == QF_Q4) block_sums(xf, rows, k_dim, xs);
    if (act8) quant_act8(xf, rows, k_dim, xq, dx);
    for (int64_t t = t0; t < t1; t++) {
        const uint16_t *dh = (const uint16_t *)scale + t * nb * QT;
        if (fmt != QF_INT8 && !act8) scales_f32(dh, db, nb * QT);
        if (act8)   /* dd[r][b][c] = d[b][c] * dx[r][b], straight from the fp16 scales */
            for (int64_t r = 0; r < rows; r++)
                for (int64_t b = 0; b < nb; b++) {
#ifdef Q_ACT8_SIMD
                    _mm256_storeu_ps(dd + (r * nb + b) * QT,
                                     _mm256_mul_ps(load8h(dh + b * QT), _mm256_set1_ps(dx[r * nb + b])));
#else
                    for (int c = 0; c < QT; c++) dd[(r * nb + b) * QT + c] = h2f(dh[b * QT + c]) * dx[r * nb + b];
#endif
                }
        for (int64_t r0 = 0, nr; r0 < rows; r0 += nr) {
            if (act8)
                nr = qtile8_rows(xq + r0 * k_dim, nb, quants + t * nb * QT * bpb, dd + r0 * nb * QT, rows - r0, total);
#ifdef Q_BH
            else if (bf && fmt != QF_INT8)
                nr = qtile_bh_rows((const uint16_t *)x + r0 * x_stride, x_stride, nb, quants + t * nb * QT * bpb, db,
                                   rows - r0, fmt, total);
#endif
            else
                nr = qtile_rows(xf + r0 * k_dim, k_dim, quants + t * nb * QT * bpb, db, rows - r0, fmt, total);
            for (int64_t r = 0; r < nr; r++) {
                if (fmt == QF_Q4) min_terms(mins + t * nb * QT, xs + (r0 + r) * nb, nb, mt);
                for (int c = 0; c < QT && t * QT + c < n_dim; c++) {
                    const int64_t n = t * QT + c;
                    float v = total[r * QT + c];
                    if (fmt == QF_Q4) v += mt[c];
                    if (fmt == QF_INT8) v *= ((const float *)scale)[n];
                    if (bias) v += bias[n];
                    if (bf) ((uint16_t *)out)[(r0 + r) * out_stride + n] = f2bf(v);
                    else ((float *)out)[(r0 + r) * out_stride + n] = v;
                }
            }
        }
    }
}

static inline ALWAYS void qlinear_tiles(const void *x, int64_t x_stride, const uint8_t *quants, const void *scale,
                                        const uint16_t *mins, const float *bias, int64_t t0, int64_t t1,
                                        int64_t n_dim, int64_t k_dim, int64_t rows, void *out, int64_t out_stride,
                                        const int fmt, const int bf, const int act8) {
    const int64_t es = bf ? 2 : 4;
    if (rows <= Q_ROWS) {   /* one row block: x converted once for all the tiles (no chunks to keep in L2) */
        qlinear_block(x, x_stride, quants, scale, mins, bias, t0, t1, n_dim, k_dim, rows, out, out_stride, fmt, bf, act8);
        return;
    }
    for (int64_t c0 = t0; c0 < t1; c0 += Q_COLS / QT) {
        const int64_t c1 = t1 - c0 < Q_COLS / QT ? t1 : c0 + Q_COLS / QT;
        for (int64_t r0 = 0; r0 < rows; r0 += Q_ROWS)
            qlinear_block((const char *)x + r0 * x_stride * es, x_stride, quants, scale, mins, bias, c0, c1, n_dim,
                          k_dim, rows - r0 < Q_ROWS ? rows - r0 : Q_ROWS, (char *)out + r0 * out_stride * es,
                          out_stride, fmt, bf, act8);
    }
}

/* Tiles [t0, t1) of the output columns (parallel.cpp splits them between threads). K a multiple
 * of 32; quants/scale/mins as the layout above (mins NULL but for QF_Q4); bias fp32 or NULL. */
void ss_qlinear_tiles(const void *x, int64_t x_stride, const void *quants, const void *scale, const void *mins,
                      const float *bias, int64_t t0, int64_t t1, int64_t n_dim, int64_t k_dim, int64_t rows,
                      void *out, int64_t out_stride, int fmt, int dtype) {
#define Q_CALL(F, B, A) qlinear_tiles(x, x_stride, quants, scale, mins, bias, t0, t1, n_dim, k_dim, rows, out, \
                                      out_stride, F, B, A)
    if ((fmt & Q_DOT) && !(fmt & Q_ACT8) && dtype == 1 && rows >= Q_DOT_MIN_ROWS && ss_qdot_available && ss_qdot_available()) {
        ss_qdot_tiles(x, x_stride, quants, scale, mins, bias, t0, t1, n_dim, k_dim, rows, out, out_stride,
                      fmt & ~Q_DOT);
        return;
    }
    const int act8 = (fmt & Q_ACT8) && (fmt & ~(Q_ACT8 | Q_DOT)) == QF_Q4;   /* int8 activations: 4-bit weights only */
    fmt &= ~(Q_ACT8 | Q_DOT);
    if (dtype == 1) {
        if (act8) Q_CALL(QF_Q4, 1, 1);
        else if (fmt == QF_Q4) Q_CALL(QF_Q4, 1, 0); else if (fmt == QF_Q8) Q_CALL(QF_Q8, 1, 0); else Q_CALL(QF_INT8, 1, 0);
    } else {
        if (act8) Q_CALL(QF_Q4, 0, 1);
        else if (fmt == QF_Q4) Q_CALL(QF_Q4, 0, 0); else if (fmt == QF_Q8) Q_CALL(QF_Q8, 0, 0); else Q_CALL(QF_INT8, 0, 0);
    }
#undef Q_CALL
}

void ss_qlinear(const void *x, int64_t x_stride, const void *quants, const void *scale, const void *mins,
                const float *bias, int64_t n_dim, int64_t k_dim, int64_t rows, void *out, int64_t out_stride, int fmt,
                int dtype) {
    ss_qlinear_tiles(x, x_stride, quants, scale, mins, bias, 0, (n_dim + QT - 1) / QT, n_dim, k_dim, rows, out,
                     out_stride, fmt, dtype);
}
