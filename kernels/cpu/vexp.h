/* exp_shifted: the vectorised exp shared by ops.c (decode attention, SiLU) and prefill_attn.c. */
#ifndef SPLITSERVE_VEXP_H
#define SPLITSERVE_VEXP_H
#include <math.h>
#include <stdint.h>

/* exp(x - m) in place over a[0..n): 2^k by the exponent, 2^f on [-0.5, 0.5] by a degree-6
 * Taylor series (relative error ~2e-7, a few fp32 ulp). AVX-512 where the compiler targets it
 * (gcc does not vectorise the bit tricks of a scalar version), libm's expf otherwise. */
#ifdef __AVX512F__
#include <immintrin.h>
static inline void exp_shifted(float *a, int64_t n, float m) {
    const __m512 vm = _mm512_set1_ps(m), lo = _mm512_set1_ps(-87.0f);
    const __m512 log2e = _mm512_set1_ps(1.4426950408889634f), ln2 = _mm512_set1_ps(0.6931471805599453f);
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 k = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1);
        __m512 x = _mm512_max_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, a + j), vm), lo);
        const __m512 t = _mm512_mul_ps(x, log2e);
        const __m512 r = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512 y = _mm512_mul_ps(_mm512_sub_ps(t, r), ln2);
        __m512 p = _mm512_set1_ps(1.0f / 720.0f);
        p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f / 120.0f));
        p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f / 24.0f));
        p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f / 6.0f));
        p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(0.5f));
        p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f));
        p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f));
        _mm512_mask_storeu_ps(a + j, k, _mm512_scalef_ps(p, r));
    }
}
#else
static inline void exp_shifted(float *a, int64_t n, float m) {
    for (int64_t j = 0; j < n; j++) a[j] = expf(a[j] - m);
}
#endif
#endif
