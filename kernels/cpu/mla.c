/* Absorbed-MLA decode attention over the paged latent cache (kernels/mla_decode.py has the torch
 * reference and the signature). Each latent row is read once per block and scored against every
 * head (the point of MLA: one cached vector serves all heads); online softmax per head over
 * chunks of one block, float32 accumulation, each row computed alone. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "bf16.h"

static inline void to_float(const void *src, int64_t at, int64_t n, int bf, float *dst) {
    if (bf) {
        const uint16_t *h = (const uint16_t *)src + at;
        for (int64_t j = 0; j < n; j++) dst[j] = bf2f(h[j]);
    } else {
        memcpy(dst, (const float *)src + at, n * sizeof(float));
    }
}

#define MLA_HEAD_CHUNK 16   /* heads per work item: a row's items share its latent reads from cache */
#define TT 16               /* tokens per tile: one 16-lane vector of scores per head */

/* Tokens [start, start + count) of a row's table (count <= TT) as lat[t][width] and, transposed and
 * zero-padded to TT, latT[j][TT]. */
static void load_tile(const void *kv, int64_t plane, const int64_t *table, int64_t block_size, int64_t start,
                      int64_t count, int64_t half, int64_t width, int bf, float *lat, float *latT) {
    for (int64_t t = 0; t < count; t++) {
        const int64_t pos = start + t, base = (table[pos / block_size] * block_size + pos % block_size) * half;
        to_float(kv, base, half, bf, lat + t * width);
        to_float(kv, plane + base, width - half, bf, lat + t * width + half);
    }
    for (int64_t j = 0; j < width; j++)
        for (int64_t t = 0; t < TT; t++) latT[j * TT + t] = t < count ? lat[t * width + j] : 0.f;
}

/* s[h][t] = q[h] . latent[t] for 4 heads at once: each transposed latent row is loaded once for
 * the 4 heads (register tile of 4 x 16 scores). q rows padded to a multiple of 4 heads. */
static void scores4(const float *q, int64_t width, const float *latT, float *s) {
    float s0[TT] = {0}, s1[TT] = {0}, s2[TT] = {0}, s3[TT] = {0};
    const float *q0 = q, *q1 = q + width, *q2 = q + 2 * width, *q3 = q + 3 * width;
    for (int64_t j = 0; j < width; j++) {
        const float *v = latT + j * TT;
        const float a0 = q0[j], a1 = q1[j], a2 = q2[j], a3 = q3[j];
#pragma omp simd
        for (int t = 0; t < TT; t++) {
            s0[t] += a0 * v[t];
            s1[t] += a1 * v[t];
            s2[t] += a2 * v[t];
            s3[t] += a3 * v[t];
        }
    }
    memcpy(s, s0, sizeof s0);
    memcpy(s + TT, s1, sizeof s1);
    memcpy(s + 2 * TT, s2, sizeof s2);
    memcpy(s + 3 * TT, s3, sizeof s3);
}

/* acc[h] += sum_t p[h][t] * c[t] for 4 heads: each latent row loaded once for the 4 heads. */
static void accumulate4(float *acc, int64_t c_dim, const float *p, const float *lat, int64_t width, int64_t count) {
    float *a0 = acc, *a1 = acc + c_dim, *a2 = acc + 2 * c_dim, *a3 = acc + 3 * c_dim;
    for (int64_t t = 0; t < count; t++) {
        const float *row = lat + t * width;
        const float p0 = p[t], p1 = p[TT + t], p2 = p[2 * TT + t], p3 = p[3 * TT + t];
#pragma omp simd
        for (int64_t j = 0; j < c_dim; j++) {
            a0[j] += p0 * row[j];
            a1[j] += p1 * row[j];
            a2[j] += p2 * row[j];
            a3[j] += p3 * row[j];
        }
    }
}

/* Row r's heads [h0, h1): online softmax over tiles of TT tokens, the latent-space output. */
__attribute__((optimize("fp-contract=fast")))
static void mla_row(const void *q_lat, const void *q_pe, const void *kv, int64_t plane, const int64_t *table,
                    int64_t len, int64_t r, int64_t h0, int64_t h1, int64_t heads, int64_t c_dim, int64_t p_dim,
                    int64_t half, int64_t block_size, float scale, void *out, int bf, float *work) {
    const int64_t width = c_dim + p_dim, nh = h1 - h0, nh4 = (nh + 3) / 4 * 4;
    float *lat = work, *latT = lat + TT * width, *q = latT + TT * width, *acc = q + nh4 * width;
    float *m = acc + nh4 * c_dim, *l = m + nh4, *s = l + nh4;
    memset(q, 0, sizeof(float) * nh4 * width);
    for (int64_t h = 0; h < nh; h++) {
        to_float(q_lat, (r * heads + h0 + h) * c_dim, c_dim, bf, q + h * width);
        to_float(q_pe, (r * heads + h0 + h) * p_dim, p_dim, bf, q + h * width + c_dim);
    }
    for (int64_t h = 0; h < nh4; h++) {
        m[h] = -INFINITY;
        l[h] = 0.f;
    }
    memset(acc, 0, sizeof(float) * nh4 * c_dim);
    for (int64_t start = 0; start < len; start += TT) {
        const int64_t count = len - start < TT ? len - start : TT;
        load_tile(kv, plane, table, block_size, start, count, half, width, bf, lat, latT);
        for (int64_t h = 0; h < nh4; h += 4) scores4(q + h * width, width, latT, s + h * TT);
        for (int64_t h = 0; h < nh4; h++) {
            float *sh = s + h * TT, mx = m[h], sum = 0.f;
            for (int64_t t = 0; t < count; t++) {
                sh[t] *= scale;
                mx = sh[t] > mx ? sh[t] : mx;
            }
            for (int64_t t = 0; t < count; t++) {
                sh[t] = expf(sh[t] - mx);
                sum += sh[t];
            }
            const float alpha = expf(m[h] - mx);
            float *a = acc + h * c_dim;
#pragma omp simd
            for (int64_t j = 0; j < c_dim; j++) a[j] *= alpha;
            l[h] = l[h] * alpha + sum;
            m[h] = mx;
        }
        for (int64_t h = 0; h < nh4; h += 4) accumulate4(acc + h * c_dim, c_dim, s + h * TT, lat, width, count);
    }
    for (int64_t h = 0; h < nh; h++) {
        const int64_t o = (r * heads + h0 + h) * c_dim;
        for (int64_t j = 0; j < c_dim; j++) {
            const float v = acc[h * c_dim + j] / l[h];
            if (bf) ((uint16_t *)out)[o + j] = f2bf(v);
            else ((float *)out)[o + j] = v;
        }
    }
}

/* Work items [item0, item1) of (row, chunk of MLA_HEAD_CHUNK heads): parallel.cpp splits them
 * between threads; each item's arithmetic is the same whatever the split. */
void ss_mla_decode_items(const void *q_lat, const void *q_pe, const void *kv, int64_t plane, const int64_t *tables,
                         int64_t max_blocks, const int64_t *lens, int64_t item0, int64_t item1, int64_t heads,
                         int64_t c_dim, int64_t p_dim, int64_t half, int64_t block_size, float scale, void *out,
                         int dtype) {
    const int64_t chunks = (heads + MLA_HEAD_CHUNK - 1) / MLA_HEAD_CHUNK, width = c_dim + p_dim;
    const int64_t nh4 = ((MLA_HEAD_CHUNK < heads ? MLA_HEAD_CHUNK : heads) + 3) / 4 * 4;
    float *work = malloc(sizeof(float) * (2 * TT * width + nh4 * (width + c_dim + 2 + TT)));
    for (int64_t item = item0; item < item1; item++) {
        const int64_t r = item / chunks, h0 = (item % chunks) * MLA_HEAD_CHUNK;
        const int64_t h1 = h0 + MLA_HEAD_CHUNK < heads ? h0 + MLA_HEAD_CHUNK : heads;
        mla_row(q_lat, q_pe, kv, plane, tables + r * max_blocks, lens[r], r, h0, h1, heads, c_dim, p_dim, half,
                block_size, scale, out, dtype == 1, work);
    }
    free(work);
}

void ss_mla_decode(const void *q_lat, const void *q_pe, const void *kv, int64_t plane, const int64_t *tables,
                   int64_t max_blocks, const int64_t *lens, int64_t rows, int64_t heads, int64_t c_dim,
                   int64_t p_dim, int64_t half, int64_t block_size, float scale, void *out, int dtype) {
    const int64_t chunks = (heads + MLA_HEAD_CHUNK - 1) / MLA_HEAD_CHUNK;
    ss_mla_decode_items(q_lat, q_pe, kv, plane, tables, max_blocks, lens, 0, rows * chunks, heads, c_dim, p_dim,
                        half, block_size, scale, out, dtype);
}
