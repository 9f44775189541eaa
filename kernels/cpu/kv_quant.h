/* Quantized KV rows (cluster/kv/kv_quant.py): per (token, KV head) D one-byte values, then the
 * fp16 scale's two bytes. kvq codes: 0 = the activation dtype (not quantized), 1 = int8,
 * 2 = fp8 E4M3FN, 3 = int8 read through its int4 view (QuantSpec's draft: the top nibble of each
 * value, at the middle of its 16-wide step; stores under code 3 write plain int8). Shared by ops.c (the decode attention reads rows) and kv_quant.c (stores them). */
#ifndef SPLITSERVE_KV_QUANT_H
#define SPLITSERVE_KV_QUANT_H
#include <stdint.h>
#include <string.h>

#include "f16.h"

#define KV_SCALE_BYTES 2

extern float ss_e4m3_values[256];   /* every E4M3FN byte as a float (kv_quant.c fills it at load) */

/* One quantized row (at byte offset `off`) as floats, already multiplied by its scale. */
static inline void kv_row_dequant(const void *cache, int64_t off, int64_t dim, int kvq, float *row) {
    const uint8_t *p = (const uint8_t *)cache + off;
    uint16_t s16;
    memcpy(&s16, p + dim, 2);
    const float s = h2f(s16);
    if (kvq == 1) {
        const int8_t *q = (const int8_t *)p;
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) row[i] = (float)q[i] * s;
    } else if (kvq == 3) {
        const int8_t *q = (const int8_t *)p;
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) row[i] = (float)((q[i] & ~15) + 8) * s;
    } else {
        for (int64_t i = 0; i < dim; i++) row[i] = ss_e4m3_values[p[i]] * s;
    }
}
#endif
