/* Quantized weights (quant.c's packed layout) written out as a dense float32 or bfloat16 [N, K]
 * matrix, for passes with enough rows that a BLAS GEMM on the dense weight beats quant.c's
 * weight-streaming kernel (prefill). Each element is w = d * q + m (QF_Q4), d * q (QF_Q8) or s * q
 * (QF_INT8), in fp32 (a product, then a sum: the order of cpu_quant.py's reference dequantize),
 * then rounded once to the output dtype: the same bits whatever the tile range or thread split.
 * Plain loops: gcc -O3 -march=native vectorizes them; the pass writes 2 or 4 bytes a weight
 * against the GEMM's K multiply-adds per weight and row, a small share at prefill sizes. */
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "f16.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define DQ_AVX512 1
#endif

enum { DQ_INT8 = 0, DQ_Q8 = 1, DQ_Q4 = 2 };   /* quant.c's QF_* */
#define QT 8    /* output columns per tile */
#define QB 32   /* weights per block */

static inline void store_row(const float *v, void *out, int64_t at, int bf) {
    if (bf) {
        uint16_t *o = (uint16_t *)out + at;
        for (int e = 0; e < QB; e++) o[e] = f2bf(v[e]);
    } else {
        float *o = (float *)out + at;
        for (int e = 0; e < QB; e++) o[e] = v[e];
    }
}

#ifdef DQ_AVX512
/* 16 floats stored as bfloat16, rounded as f2bf (to nearest even; a NaN stays a quiet NaN). */
static inline void store_bf16x16(__m512 v, uint16_t *o) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    _mm256_storeu_si256((__m256i *)o, _mm512_cvtepi32_epi16(r));
}

/* One block of one column, vectorized: the same products and sums as block_values below. */
static inline void block_simd(const uint8_t *qb, float d, float m, int fmt, void *out, int64_t at, int bf) {
    const __m512 vd = _mm512_set1_ps(d), vm = _mm512_set1_ps(m);
    for (int h = 0; h < 2; h++) {   /* elements 16h .. 16h + 15 */
        __m512 v;
        if (fmt == DQ_Q4) {   /* bytes 8h..8h+7: their low nibbles, then their high ones */
            const __m512i sh = _mm512_set_epi32(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0);
            int64_t bytes;
            memcpy(&bytes, qb + 8 * h, 8);
            const __m512i u = _mm512_cvtepu8_epi32(_mm_set1_epi64x(bytes));
            const __m512 q = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(u, sh), _mm512_set1_epi32(15)));
            v = _mm512_add_ps(_mm512_mul_ps(vd, q), vm);
        } else {
            const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qb + 16 * h))));
            v = _mm512_mul_ps(vd, q);
        }
        if (bf) store_bf16x16(v, (uint16_t *)out + at + 16 * h);
        else _mm512_storeu_ps((float *)out + at + 16 * h, v);
    }
}
#endif

/* One block of one column: 32 values into v, in element order. */
static inline void block_values(const uint8_t *qb, float d, float m, int fmt, float *v) {
    if (fmt == DQ_Q4) {   /* byte 8h + i: element 16h + i low nibble, 16h + 8 + i high nibble */
        for (int h = 0; h < 2; h++)
            for (int i = 0; i < 8; i++) {
                const uint8_t byte = qb[8 * h + i];
                v[16 * h + i] = d * (float)(byte & 15) + m;
                v[16 * h + 8 + i] = d * (float)(byte >> 4) + m;
            }
        return;
    }
    for (int e = 0; e < QB; e++) v[e] = d * (float)(int8_t)qb[e];
}

static inline void dequant_tiles(const uint8_t *quants, const void *scale, const uint16_t *mins, int64_t t0,
                                 int64_t t1, int64_t n_dim, int64_t k_dim, void *out, const int fmt, const int bf) {
    const int64_t nb = k_dim / QB, bpb = fmt == DQ_Q4 ? QB / 2 : QB;
    float v[QB];
    for (int64_t t = t0; t < t1; t++)
        for (int c = 0; c < QT && t * QT + c < n_dim; c++) {
            const int64_t n = t * QT + c;
            for (int64_t b = 0; b < nb; b++) {
                const int64_t at = (t * nb + b) * QT + c;   /* this block's scale (and minimum) */
                const float d = fmt == DQ_INT8 ? ((const float *)scale)[n] : h2f(((const uint16_t *)scale)[at]);
                const float m = fmt == DQ_Q4 ? h2f(mins[at]) : 0.f;
#ifdef DQ_AVX512
                block_simd(quants + at * bpb, d, m, fmt, out, (n - t0 * QT) * k_dim + b * QB, bf);
                continue;
#endif
                block_values(quants + at * bpb, d, m, fmt, v);
                store_row(v, out, (n - t0 * QT) * k_dim + b * QB, bf);
            }
        }
}

/* Rows [t0 * 8, min(t1 * 8, n_dim)) of the dense [n_dim, k_dim] weight in `out` (row-major,
 * contiguous, its first row the weight's row t0 * 8): float32 (dtype 0) or bfloat16 (1). */
void ss_qdequant_tiles(const void *quants, const void *scale, const void *mins, int64_t t0, int64_t t1,
                       int64_t n_dim, int64_t k_dim, void *out, int fmt, int dtype) {
    const uint8_t *q = (const uint8_t *)quants;
    const uint16_t *mn = (const uint16_t *)mins;
    if (dtype == 1) {
        if (fmt == DQ_Q4) dequant_tiles(q, scale, mn, t0, t1, n_dim, k_dim, out, DQ_Q4, 1);
        else if (fmt == DQ_Q8) dequant_tiles(q, scale, mn, t0, t1, n_dim, k_dim, out, DQ_Q8, 1);
        else dequant_tiles(q, scale, mn, t0, t1, n_dim, k_dim, out, DQ_INT8, 1);
    } else {
        if (fmt == DQ_Q4) dequant_tiles(q, scale, mn, t0, t1, n_dim, k_dim, out, DQ_Q4, 0);
        else if (fmt == DQ_Q8) dequant_tiles(q, scale, mn, t0, t1, n_dim, k_dim, out, DQ_Q8, 0);
        else dequant_tiles(q, scale, mn, t0, t1, n_dim, k_dim, out, DQ_INT8, 0);
    }
}

/* The serial entry point (parallel.cpp's ss_qdequant_par splits the tiles between threads). */
void ss_qdequant(const void *quants, const void *scale, const void *mins, int64_t t0, int64_t t1, int64_t n_dim,
                 int64_t k_dim, void *out, int fmt, int dtype) {
    ss_qdequant_tiles(quants, scale, mins, t0, t1, n_dim, k_dim, out, fmt, dtype);
}
