/* Absorbed-MLA decode attention over the paged latent cache (kernels/mla_decode.py has the torch
 * reference and the signature). Each latent row is read once per block and scored against every
 * head (the point of MLA: one cached vector serves all heads); online softmax per head over
 * chunks of one block, float32 accumulation, each row computed alone. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include "bf16.h"

static inline float ld(const void *p, int64_t i, int bf) {
    return bf ? bf2f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0.f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* Latent vectors of `count` tokens of block `block` into lat[count][C + P] (float). */
static void load_block(const void *kv, int64_t plane, int64_t block, int64_t block_size, int64_t count,
                       int64_t half, int64_t width, int bf, float *lat) {
    for (int64_t t = 0; t < count; t++) {
        const int64_t base = (block * block_size + t) * half;
        for (int64_t j = 0; j < width; j++)
            lat[t * width + j] = j < half ? ld(kv, base + j, bf) : ld(kv, plane + base + j - half, bf);
    }
}

__attribute__((optimize("fp-contract=fast")))
void ss_mla_decode(const void *q_lat, const void *q_pe, const void *kv, int64_t plane, const int64_t *tables,
                   int64_t max_blocks, const int64_t *lens, int64_t rows, int64_t heads, int64_t c_dim,
                   int64_t p_dim, int64_t half, int64_t block_size, float scale, void *out, int dtype) {
    const int bf = dtype == 1, width = (int)(c_dim + p_dim);
    float *lat = malloc(sizeof(float) * block_size * width);
    float *q = malloc(sizeof(float) * heads * width);
    float *acc = malloc(sizeof(float) * heads * c_dim);
    float *m = malloc(sizeof(float) * heads), *l = malloc(sizeof(float) * heads);
    float *s = malloc(sizeof(float) * block_size);
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t h = 0; h < heads; h++) {
            for (int64_t j = 0; j < c_dim; j++) q[h * width + j] = ld(q_lat, (r * heads + h) * c_dim + j, bf);
            for (int64_t j = 0; j < p_dim; j++) q[h * width + c_dim + j] = ld(q_pe, (r * heads + h) * p_dim + j, bf);
            m[h] = -INFINITY;
            l[h] = 0.f;
        }
        for (int64_t i = 0; i < heads * c_dim; i++) acc[i] = 0.f;
        for (int64_t start = 0; start < lens[r]; start += block_size) {
            const int64_t count = lens[r] - start < block_size ? lens[r] - start : block_size;
            load_block(kv, plane, tables[r * max_blocks + start / block_size], block_size, count, half, width, bf, lat);
            for (int64_t h = 0; h < heads; h++) {
                float mx = m[h];
                for (int64_t t = 0; t < count; t++) {
                    s[t] = dot(q + h * width, lat + t * width, width) * scale;
                    mx = s[t] > mx ? s[t] : mx;
                }
                const float alpha = expf(m[h] - mx);
                float *a = acc + h * c_dim;
                l[h] *= alpha;
                for (int64_t j = 0; j < c_dim; j++) a[j] *= alpha;
                for (int64_t t = 0; t < count; t++) {
                    const float p = expf(s[t] - mx);
                    l[h] += p;
                    for (int64_t j = 0; j < c_dim; j++) a[j] += p * lat[t * width + j];
                }
                m[h] = mx;
            }
        }
        for (int64_t h = 0; h < heads; h++)
            for (int64_t j = 0; j < c_dim; j++) {
                const float v = acc[h * c_dim + j] / l[h];
                if (bf) ((uint16_t *)out)[(r * heads + h) * c_dim + j] = f2bf(v);
                else ((float *)out)[(r * heads + h) * c_dim + j] = v;
            }
    }
    free(lat); free(q); free(acc); free(m); free(l); free(s);
}
