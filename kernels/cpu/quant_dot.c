/* Quantized linear for batches of bf16 rows on CPUs with AVX512_BF16 (quant.c's layout and formats).
 *
 * quant.c decodes each block in registers for at most 4 rows and multiplies in fp32: two FMAs and a
 * scale per row, block and column, so from about 8 rows it costs more than a bf16 GEMM on the
 * dequantized weight; dequantizing a whole layer for that GEMM (quant_linear.py's dense path)
 * writes and reads the weight in memory every pass. Here each tile of 8 output columns is decoded
 * once per call into an L1-sized buffer as bf16 (w = d q + m, rounded once: the dense path's
 * values), then every row multiplies it with vdpbf16ps from 4-row x 4-column register tiles (two
 * products per lane and instruction). Products of bf16 values are exact in fp32; the order of the
 * sums differs from quant.c's, so this path is for the non-deterministic mode (quant.c Q_DOT).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "f16.h"

enum { QF_INT8 = 0, QF_Q8 = 1, QF_Q4 = 2 };
#define QT 8     /* output columns per tile of the layout (quant.c) */
#define QB 32    /* weights per block */

#if defined(__AVX512BF16__)
#include <immintrin.h>

int ss_qdot_available(void) { return 1; }

#define KEEP_IN_REGISTERS(x) __asm__("" : "+v"(x))

/* Column c of block b of one tile into wt[b][c][0..32) as bf16. */
static inline void decode_block(const uint8_t *qt, const uint16_t *dh, const uint16_t *mh, const float *s32,
                                int64_t b, int c, int fmt, uint16_t *wt) {
    __m512 lo, hi;
    if (fmt == QF_Q4) {
        const uint8_t *p = qt + (b * QT + c) * (QB / 2);
        const __m512i low = _mm512_set1_epi32(15);
        const __m512i sh = _mm512_set_epi32(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0);
        int64_t b0, b1;
        memcpy(&b0, p, 8);
        memcpy(&b1, p + 8, 8);
        lo = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_set1_epi64x(b0)), sh), low));
        hi = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_set1_epi64x(b1)), sh), low));
    } else {
        const uint8_t *p = qt + (b * QT + c) * QB;
        lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
        hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
    }
    const __m512 d = _mm512_set1_ps(fmt == QF_INT8 ? s32[c] : h2f(dh[b * QT + c]));
    if (fmt == QF_Q4) {
        const __m512 m = _mm512_set1_ps(h2f(mh[b * QT + c]));
        lo = _mm512_fmadd_ps(d, lo, m);
        hi = _mm512_fmadd_ps(d, hi, m);
    } else {
        lo = _mm512_mul_ps(d, lo);
        hi = _mm512_mul_ps(d, hi);
    }
    _mm512_storeu_si512(wt + (b * QT + c) * QB, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

/* out[r][c0 + c] for NR rows from r0 and 4 columns: sum over blocks of x row . w column. */
static inline __attribute__((always_inline)) void dot_tile(const uint16_t *x, int64_t x_stride, const uint16_t *wt,
                                                           int64_t nb, int64_t r0, int c0, float *total,
                                                           const int NR) {
    __m512 acc[4][4];
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i w[4];
        for (int c = 0; c < 4; c++) {
            w[c] = _mm512_loadu_si512(wt + (b * QT + c0 + c) * QB);
            KEEP_IN_REGISTERS(w[c]);
        }
        for (int r = 0; r < NR; r++) {
            const __m512i xv = _mm512_loadu_si512(x + (r0 + r) * x_stride + b * QB);
            for (int c = 0; c < 4; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)xv, (__m512bh)w[c]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < 4; c++) total[r * QT + c0 + c] = _mm512_reduce_add_ps(acc[r][c]);
}

static void tile_rows(const uint16_t *x, int64_t x_stride, const uint16_t *wt, int64_t nb, int64_t rows,
                      const float *bias, int64_t t, int64_t n_dim, uint16_t *out, int64_t out_stride) {
    float total[4 * QT];
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
        const int64_t nr = rows - r0 < 4 ? rows - r0 : 4;
        for (int c0 = 0; c0 < QT; c0 += 4) {
            switch (nr) {
                case 4: dot_tile(x, x_stride, wt, nb, r0, c0, total, 4); break;
                case 3: dot_tile(x, x_stride, wt, nb, r0, c0, total, 3); break;
                case 2: dot_tile(x, x_stride, wt, nb, r0, c0, total, 2); break;
                default: dot_tile(x, x_stride, wt, nb, r0, c0, total, 1); break;
            }
        }
        for (int64_t r = 0; r < nr; r++)
            for (int c = 0; c < QT && t * QT + c < n_dim; c++) {
                const int64_t n = t * QT + c;
                out[(r0 + r) * out_stride + n] = f2bf(total[r * QT + c] + (bias ? bias[n] : 0.f));
            }
    }
}

/* Tiles [t0, t1) of the output columns for bf16 x [rows, K] (row stride x_stride) into bf16 out;
 * fmt QF_INT8 / QF_Q8 / QF_Q4 as quant.c, K a multiple of 32. */
void ss_qdot_tiles(const void *x, int64_t x_stride, const void *quants, const void *scale, const void *mins,
                   const float *bias, int64_t t0, int64_t t1, int64_t n_dim, int64_t k_dim, int64_t rows, void *out,
                   int64_t out_stride, int fmt) {
    const int64_t nb = k_dim / QB, bpb = fmt == QF_Q4 ? QB / 2 : QB;
    uint16_t *wt = aligned_alloc(64, (size_t)(nb * QT * QB) * sizeof(uint16_t));
    for (int64_t t = t0; t < t1; t++) {
        const uint8_t *qt = (const uint8_t *)quants + t * nb * QT * bpb;
        const uint16_t *dh = fmt == QF_INT8 ? NULL : (const uint16_t *)scale + t * nb * QT;
        const uint16_t *mh = fmt == QF_Q4 ? (const uint16_t *)mins + t * nb * QT : NULL;
        float s32[QT];
        for (int c = 0; c < QT; c++)   /* QF_INT8: one fp32 scale per output column */
            s32[c] = fmt == QF_INT8 && t * QT + c < n_dim ? ((const float *)scale)[t * QT + c] : 0.f;
        for (int64_t b = 0; b < nb; b++)
            for (int c = 0; c < QT; c++) decode_block(qt, dh, mh, s32, b, c, fmt, wt);
        tile_rows((const uint16_t *)x, x_stride, wt, nb, rows, bias, t, n_dim, (uint16_t *)out, out_stride);
    }
    free(wt);
}
#else
int ss_qdot_available(void) { return 0; }

void ss_qdot_tiles(const void *x, int64_t x_stride, const void *quants, const void *scale, const void *mins,
                   const float *bias, int64_t t0, int64_t t1, int64_t n_dim, int64_t k_dim, int64_t rows, void *out,
                   int64_t out_stride, int fmt) {   /* never called: quant.c checks ss_qdot_available() */
    (void)x; (void)x_stride; (void)quants; (void)scale; (void)mins; (void)bias; (void)t0; (void)t1; (void)n_dim;
    (void)k_dim; (void)rows; (void)out; (void)out_stride; (void)fmt;
}
#endif
