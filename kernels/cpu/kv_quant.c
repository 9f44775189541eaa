/* Storing K/V rows into a quantized cache (kv_quant.h's row format): per (row, KV head) the
 * scale s = max|x| / QMAX rounded to fp16, then each value x * (1/s) rounded to int8 (to nearest
 * even, clamped to +-127) or encoded as E4M3FN (to nearest even, clamped to +-448). Arithmetic and
 * rounding as cluster/kv/kv_quant.py's quantize_rows, so the two write the same bytes. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "kv_quant.h"

float ss_e4m3_values[256];

/* E4M3FN: bias 7, 3 mantissa bits, no infinities, 0x7f/0xff NaN, largest finite 448. */
static float e4m3_decode(uint8_t b) {
    const int e = (b >> 3) & 0xf, m = b & 7;
    float v;
    if (e == 15 && m == 7) v = NAN;
    else if (e == 0) v = ldexpf((float)m, -9);                  /* subnormal: m/8 * 2^-6 */
    else v = ldexpf(1.0f + (float)m / 8.0f, e - 7);
    return (b & 0x80) ? -v : v;
}

__attribute__((constructor)) static void fill_e4m3_values(void) {
    for (int b = 0; b < 256; b++) ss_e4m3_values[b] = e4m3_decode((uint8_t)b);
}

/* |x| <= 448 (clamped by the caller), not NaN: the nearest E4M3FN, ties to even. Every step below
 * is exact in fp32, so rintf (round to nearest even) does the only rounding. */
static inline uint8_t e4m3_encode(float x) {
    const uint8_t sign = signbit(x) ? 0x80 : 0;   /* -0 too, as torch encodes it */
    const float a = fabsf(x);
    if (a < 0x1p-6f) return sign | (uint8_t)rintf(a * 512.0f);   /* subnormals (8 rounds up to 0x08) */
    int e;
    frexpf(a, &e);                          /* a = f * 2^e, f in [0.5, 1) */
    e -= 1;                                 /* a = (1 + m/8) * 2^e */
    int m = (int)rintf((ldexpf(a, -e) - 1.0f) * 8.0f);
    if (m == 8) { m = 0; e += 1; }
    return sign | (uint8_t)(((e + 7) << 3) | m);
}

static inline void quantize_head(const float *x, int64_t dim, int kvq, uint8_t *out) {
    if (kvq == 3) kvq = 1;   /* the int4 view is a way of reading int8 rows; they are stored as int8 */
    float amax = 0.f;
    for (int64_t i = 0; i < dim; i++) amax = fmaxf(amax, fabsf(x[i]));
    const uint16_t s16 = f2h(amax / (kvq == 1 ? 127.0f : 448.0f));
    const float s = h2f(s16), inv = s == 0.f ? 0.f : 1.0f / s;
    if (kvq == 1) {
        for (int64_t i = 0; i < dim; i++) {
            float q = rintf(x[i] * inv);
            q = q > 127.f ? 127.f : (q < -127.f ? -127.f : q);
            ((int8_t *)out)[i] = (int8_t)q;
        }
    } else {
        for (int64_t i = 0; i < dim; i++) {
            float v = x[i] * inv;
            v = v > 448.f ? 448.f : (v < -448.f ? -448.f : v);
            out[i] = e4m3_encode(v);
        }
    }
    memcpy(out + dim, &s16, 2);
}

/* Rows of k and v ([rows, hkv * dim] in the activation dtype, row strides in elements) into the
 * quantized caches at their flat slots ([slots, hkv, dim + 2] bytes). */
void ss_store_kv_q(const void *k, int64_t k_stride, const void *v, int64_t v_stride, const int64_t *slots,
                   int64_t rows, int64_t hkv, int64_t dim, void *k_cache, void *v_cache, int dtype, int kvq) {
    const int64_t width = dim + KV_SCALE_BYTES;
    float x[dim];
    for (int64_t r = 0; r < rows; r++) {
        for (int side = 0; side < 2; side++) {
            const void *src = side ? v : k;
            const int64_t stride = side ? v_stride : k_stride;
            uint8_t *dst = (uint8_t *)(side ? v_cache : k_cache) + slots[r] * hkv * width;
            for (int64_t h = 0; h < hkv; h++) {
                for (int64_t i = 0; i < dim; i++) {
                    const int64_t at = r * stride + h * dim + i;
                    x[i] = dtype == 1 ? bf2f(((const uint16_t *)src)[at]) : ((const float *)src)[at];
                }
                quantize_head(x, dim, kvq, dst + h * width);
            }
        }
    }
}
