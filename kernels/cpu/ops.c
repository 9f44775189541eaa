/* Fused CPU ops for small-batch decode, where torch's per-op dispatch costs more than the
 * arithmetic: one call instead of the 4-7 torch ops each of these replaces.
 *
 * Built at first use by kernels/cpu_ops.py (gcc -O3 -march=native) and called through ctypes
 * with raw pointers; single-threaded on purpose (a decode row is a few microseconds of work;
 * waking an OpenMP team costs more, and a second OpenMP runtime beside torch's would fight it).
 *
 * Every op rounds where the torch code it replaces rounds (bf16 after each op, arithmetic in
 * fp32), so the result is bit-identical to that torch code except rms_norm's sum of squares,
 * whose order differs (fp32 accumulation, well inside bf16 rounding).
 * dtype codes: 0 = float32, 1 = bfloat16.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "kv_quant.h"

static inline float rnd(float x, int bf) { return bf ? bf2f(f2bf(x)) : x; }

#include "vexp.h"

static inline float load(const void *p, int64_t i, int bf) {
    return bf ? bf2f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int64_t i, float v, int bf) {
    if (bf) ((uint16_t *)p)[i] = f2bf(v); else ((float *)p)[i] = v;
}

/* out[r] = w * norm(x[r]), bf16 as transformers' Llama RMSNorm: normalise in fp32, round to the
 * dtype, multiply by the weight in the dtype. With `residual` (not NULL): residual[r] += x[r]
 * first (rounded to the dtype) and the sum is normalised: the decoder layer's residual add and
 * the next norm in one pass. Row strides in elements. */
#define LANES 16
static inline __attribute__((always_inline)) void rms_norm_rows(const void *x, int64_t x_stride, void *residual, const void *w, void *out,
                          int64_t rows, int64_t hidden, float eps, int bf) {
    float buf[hidden];
    for (int64_t r = 0; r < rows; r++) {
        const int64_t xo = r * x_stride, ro = r * hidden;
        for (int64_t i = 0; i < hidden; i++) {
            float v = load(x, xo + i, bf);
            if (residual) {
                v = rnd(v + load(residual, ro + i, bf), bf);
                store(residual, ro + i, v, bf);
            }
            buf[i] = v;
        }
        float lanes[LANES] = {0};   /* LANES partial sums: a reduction the compiler can vectorise */
        int64_t i = 0;
        for (; i + LANES <= hidden; i += LANES)
            for (int l = 0; l < LANES; l++) lanes[l] += buf[i + l] * buf[i + l];
        float ss = 0.f;
        for (; i < hidden; i++) ss += buf[i] * buf[i];
        for (int l = 0; l < LANES; l++) ss += lanes[l];
        const float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
        for (int64_t i = 0; i < hidden; i++)
            store(out, ro + i, load(w, i, bf) * rnd(buf[i] * inv, bf), bf);
    }
}

void ss_rms_norm(const void *x, int64_t x_stride, void *residual, const void *w, void *out,
                 int64_t rows, int64_t hidden, float eps, int dtype) {
    if (dtype == 1) rms_norm_rows(x, x_stride, residual, w, out, rows, hidden, eps, 1);
    else rms_norm_rows(x, x_stride, residual, w, out, rows, hidden, eps, 0);
}

/* Rotate-half RoPE in place on the first `heads` heads of each row of the fused qkv projection:
 * x*cos + cat(x2, x1)*signed_sin, each product and the sum rounded to the dtype, cos/sin read
 * from the fp32 full-width tables at each row's position and rounded to the dtype first. */
static inline __attribute__((always_inline)) void rope_rows(void *qkv, int64_t row_stride, const int64_t *positions, const float *cos_t,
                      const float *sin_t, int64_t rows, int64_t heads, int64_t dim, int bf) {
    const int64_t half = dim / 2;
    float c[dim], s[dim], v[dim];
    for (int64_t r = 0; r < rows; r++) {
        const float *cp = cos_t + positions[r] * dim, *sp = sin_t + positions[r] * dim;
        for (int64_t i = 0; i < dim; i++) { c[i] = rnd(cp[i], bf); s[i] = rnd(sp[i], bf); }
        for (int64_t h = 0; h < heads; h++) {
            const int64_t o = r * row_stride + h * dim;
            for (int64_t i = 0; i < dim; i++) v[i] = load(qkv, o + i, bf);
            for (int64_t i = 0; i < dim; i++) {
                const float rot = i < half ? v[i + half] : v[i - half];
                store(qkv, o + i, rnd(v[i] * c[i], bf) + rnd(rot * s[i], bf), bf);
            }
        }
    }
}

void ss_rope(void *qkv, int64_t row_stride, const int64_t *positions, const float *cos_t, const float *sin_t,
             int64_t rows, int64_t heads, int64_t dim, int dtype) {
    if (dtype == 1) rope_rows(qkv, row_stride, positions, cos_t, sin_t, rows, heads, dim, 1);
    else rope_rows(qkv, row_stride, positions, cos_t, sin_t, rows, heads, dim, 0);
}

#define CHUNK 32   /* keys per online-softmax step of decode attention */

#ifdef __AVX512F__
/* One chunk of n keys (contiguous rows key_stride apart) for the GROUP query heads of one KV
 * head, D a multiple of 16: every key row is loaded into registers once, converted from bf16 by
 * a shift, and serves all heads; the dots of different keys and heads are independent, so they
 * overlap in the pipeline instead of waiting on one reduction at a time. */
static inline __m512 load16(const void *p, int64_t i, int bf) {
    if (bf) return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i))), 16));
    return _mm512_loadu_ps((const float *)p + i);
}

static inline void chunk_scores16(const float *qf, int64_t group, int64_t dim, const void *k_cache, int64_t base,
                                  int64_t key_stride, int64_t n, float *sc /* [group][CHUNK] */, int bf) {
    const int64_t c16 = dim / 16;
    for (int64_t j = 0; j < n; j++) {
        __m512 k[16];
        for (int64_t c = 0; c < c16; c++) k[c] = load16(k_cache, base + j * key_stride + c * 16, bf);
        for (int64_t g = 0; g < group; g++) {
            __m512 s = _mm512_mul_ps(_mm512_loadu_ps(qf + g * dim), k[0]);
            for (int64_t c = 1; c < c16; c++) s = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * dim + c * 16), k[c], s);
            sc[g * CHUNK + j] = _mm512_reduce_add_ps(s);
        }
    }
}

/* acc[g] += sum_j sc[g][j] * V[j]: the chunk's value rows converted once into an fp32 buffer
 * (L1), then each head's accumulator lives in registers for the whole chunk: no store-to-load
 * chain through memory from one key to the next. */
static inline void chunk_values16(float *acc, int64_t group, int64_t dim, const void *v_cache, int64_t base,
                                  int64_t key_stride, int64_t n, const float *sc, int bf) {
    const int64_t c16 = dim / 16;
    float vf[CHUNK * 256] __attribute__((aligned(64)));
    for (int64_t j = 0; j < n; j++)
        for (int64_t c = 0; c < c16; c++)
            _mm512_store_ps(vf + j * dim + c * 16, load16(v_cache, base + j * key_stride + c * 16, bf));
    for (int64_t g = 0; g < group; g++) {
        __m512 a[16];
        for (int64_t c = 0; c < c16; c++) a[c] = _mm512_loadu_ps(acc + g * dim + c * 16);
        for (int64_t j = 0; j < n; j++) {
            const __m512 w = _mm512_set1_ps(sc[g * CHUNK + j]);
            for (int64_t c = 0; c < c16; c++) a[c] = _mm512_fmadd_ps(w, _mm512_load_ps(vf + j * dim + c * 16), a[c]);
        }
        for (int64_t c = 0; c < c16; c++) _mm512_storeu_ps(acc + g * dim + c * 16, a[c]);
    }
}
#define VECTOR_DIM(dim) ((dim) % 16 == 0 && (dim) <= 256)
#else
#define VECTOR_DIM(dim) 0
#endif

/* Key or value row `off` (elements of the cache's dtype; bytes for a quantized cache) as floats. */
static inline void kv_row(const void *cache, int64_t off, int64_t dim, int bf, int kvq, float *row) {
    if (kvq) {
        kv_row_dequant(cache, off, dim, kvq, row);
        return;
    }
    for (int64_t i = 0; i < dim; i++) row[i] = load(cache, off + i, bf);
}

/* Paged decode attention, one query token per sequence, all sequences in one call.
 * q: [B, Hq, D] (row stride q_stride elements); caches: [blocks, block_size, Hkv, D];
 * tables: [B, max_blocks] int64; lens: [B] context lengths (the query sits at lens[b]-1);
 * window: keys with pos > qpos - window, 0 for none. out: [B, Hq, D].
 * tails (NULL: none): [B, 1 + tail_width] int64, a token-tree row's last keys: tails[b][0] = t,
 * then the flat slots of its last t keys (its ancestors in the tree, then itself), which sit
 * anywhere in the cache; keys before them come through the table. Chunks are cut by logical
 * position, so a tree row is the same arithmetic as the plain decode row at that position. Online softmax in fp32,
 * one chunk of up to CHUNK keys of one block at a time (bounded stack whatever the context); each
 * key row is converted to fp32 once and serves the GROUP query heads that share it; the dot
 * products are `omp simd` reductions (vectorised without -ffast-math). The output is rounded once.
 * FMA contraction is allowed here: no torch op's rounding is being copied. */
#define FAST __attribute__((optimize("fp-contract=fast")))
static inline __attribute__((always_inline)) FAST void decode_rows(
        const void *q, int64_t q_stride, const void *k_cache, const void *v_cache, const int64_t *tables,
        int64_t max_blocks, const int64_t *lens, const int64_t *tails, int64_t tail_width, int64_t item0,
        int64_t item1, int64_t hq, int64_t hkv, int64_t dim, int64_t block_size, int64_t window, float scale,
        void *out, int bf, int kvq) {
    /* A quantized cache's row is dim bytes and a scale (kv_quant.h): offsets count bytes there. */
    const int64_t row_w = kvq ? dim + KV_SCALE_BYTES : dim, key_stride = hkv * row_w;
    const int64_t group = hq / hkv;
    const int vector_dim = VECTOR_DIM(dim) && !kvq;
    (void)vector_dim;
    float qf[group][dim], acc[group][dim], mx[group], denom[group], sc[group][CHUNK], row[dim];
    /* A chunk that reaches a tree row's tail is gathered here first (rows as stored, bytes copied). */
    const int64_t es = kvq ? 1 : bf ? 2 : 4;
    char kscr[tails ? CHUNK * row_w * es : 1], vscr[tails ? CHUNK * row_w * es : 1];
    for (int64_t item = item0; item < item1; item++) {   /* item: (sequence b, KV head kh) */
        const int64_t b = item / hkv, kh = item % hkv;
        const int64_t len = lens[b];
        const int64_t *tail = tails ? tails + b * (tail_width + 1) : 0;
        const int64_t table_len = tail ? len - tail[0] : len;
        const int64_t first = window > 0 && len > window ? len - window : 0;
        {
            for (int64_t g = 0; g < group; g++) {
                for (int64_t i = 0; i < dim; i++) {
                    qf[g][i] = load(q, b * q_stride + (kh * group + g) * dim + i, bf) * scale;
                    acc[g][i] = 0.f;
                }
                mx[g] = -INFINITY;
                denom[g] = 0.f;
            }
            for (int64_t p0 = first; p0 < len;) {
                const int64_t block = p0 / block_size, in_block = p0 - block * block_size;
                int64_t n = block_size - in_block;
                if (n > CHUNK) n = CHUNK;
                if (n > len - p0) n = len - p0;
                const void *kc = k_cache, *vc = v_cache;
                int64_t stride = key_stride;
                int64_t base = (tables[b * max_blocks + block] * block_size + in_block) * key_stride + kh * row_w;
                if (p0 + n > table_len) {
                    for (int64_t j = 0; j < n; j++) {
                        const int64_t p = p0 + j;
                        const int64_t slot = p < table_len ? tables[b * max_blocks + p / block_size] * block_size
                                                                 + p % block_size
                                                           : tail[1 + p - table_len];
                        const int64_t off = (slot * key_stride + kh * row_w) * es;
                        memcpy(kscr + j * row_w * es, (const char *)k_cache + off, row_w * es);
                        memcpy(vscr + j * row_w * es, (const char *)v_cache + off, row_w * es);
                    }
                    kc = kscr;
                    vc = vscr;
                    base = 0;
                    stride = row_w;
                }
#ifdef __AVX512F__
                if (vector_dim) chunk_scores16(&qf[0][0], group, dim, kc, base, stride, n, &sc[0][0], bf);
                else
#endif
                for (int64_t j = 0; j < n; j++) {
                    kv_row(kc, base + j * stride, dim, bf, kvq, row);
                    for (int64_t g = 0; g < group; g++) {
                        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                        for (int64_t i = 0; i < dim; i++) dot += qf[g][i] * row[i];
                        sc[g][j] = dot;
                    }
                }
                for (int64_t g = 0; g < group; g++) {
                    float m = mx[g];
                    for (int64_t j = 0; j < n; j++) m = sc[g][j] > m ? sc[g][j] : m;
                    const float rescale = mx[g] == -INFINITY ? 0.f : expf(mx[g] - m);
                    mx[g] = m;
                    exp_shifted(sc[g], n, m);
                    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
                    for (int64_t j = 0; j < n; j++) sum += sc[g][j];
                    denom[g] = denom[g] * rescale + sum;
                    for (int64_t i = 0; i < dim; i++) acc[g][i] *= rescale;
                }
#ifdef __AVX512F__
                if (vector_dim) chunk_values16(&acc[0][0], group, dim, vc, base, stride, n, &sc[0][0], bf);
                else
#endif
                for (int64_t j = 0; j < n; j++) {
                    kv_row(vc, base + j * stride, dim, bf, kvq, row);
                    for (int64_t g = 0; g < group; g++) {
                        const float wgt = sc[g][j];
                        float *a = acc[g];
#pragma omp simd
                        for (int64_t i = 0; i < dim; i++) a[i] += wgt * row[i];
                    }
                }
                p0 += n;
            }
            for (int64_t g = 0; g < group; g++)
                for (int64_t i = 0; i < dim; i++)
                    store(out, (b * hq + kh * group + g) * dim + i, acc[g][i] / denom[g], bf);
        }
    }
}

/* Items [item0, item1) of the batch's (sequence, KV head) pairs: parallel.cpp splits them
 * between threads; each item's arithmetic is the same whatever the split. */
FAST void ss_decode_attention_items(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                                    const int64_t *tables, int64_t max_blocks, const int64_t *lens,
                                    const int64_t *tails, int64_t tail_width, int64_t item0, int64_t item1,
                                    int64_t hq, int64_t hkv, int64_t dim, int64_t block_size, int64_t window,
                                    float scale, void *out, int dtype, int kvq) {
    if (dtype == 1)
        decode_rows(q, q_stride, k_cache, v_cache, tables, max_blocks, lens, tails, tail_width, item0, item1, hq,
                    hkv, dim, block_size, window, scale, out, 1, kvq);
    else
        decode_rows(q, q_stride, k_cache, v_cache, tables, max_blocks, lens, tails, tail_width, item0, item1, hq,
                    hkv, dim, block_size, window, scale, out, 0, kvq);
}

void ss_decode_attention(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                         const int64_t *tables, int64_t max_blocks, const int64_t *lens, const int64_t *tails,
                         int64_t tail_width, int64_t batch, int64_t hq, int64_t hkv, int64_t dim, int64_t block_size,
                         int64_t window, float scale, void *out, int dtype, int kvq) {
    ss_decode_attention_items(q, q_stride, k_cache, v_cache, tables, max_blocks, lens, tails, tail_width, 0,
                              batch * hkv, hq, hkv, dim, block_size, window, scale, out, dtype, kvq);
}

/* Store each row's new K and V (rows of width Hkv*D, row strides in elements, views of the fused
 * qkv projection) at its flat cache slot: one call for both, instead of two index_copy_. */
void ss_store_kv(const void *k, int64_t k_stride, const void *v, int64_t v_stride, const int64_t *slots,
                 int64_t rows, int64_t width, void *k_cache, void *v_cache, int dtype) {
    const int64_t es = dtype == 1 ? 2 : 4;
    for (int64_t r = 0; r < rows; r++) {
        memcpy((char *)k_cache + slots[r] * width * es, (const char *)k + r * k_stride * es, width * es);
        memcpy((char *)v_cache + slots[r] * width * es, (const char *)v + r * v_stride * es, width * es);
    }
}

/* out[r] = silu(gate) * up for rows [r0, r1) of the fused [rows, 2I] projection (gate then up),
 * the activation rounded to the dtype before the product as F.silu(g) * u; exp as in the
 * attention (AVX-512 polynomial: a few fp32 ulp from torch's). */
static inline __attribute__((always_inline)) void silu_mul_rows(const void *gate_up, void *out, int64_t r0,
                                                                int64_t r1, int64_t inter, int bf) {
    float e[64];
    for (int64_t r = r0; r < r1; r++) {
        const int64_t go = r * 2 * inter, oo = r * inter;
        for (int64_t i0 = 0; i0 < inter; i0 += 64) {
            const int64_t n = inter - i0 < 64 ? inter - i0 : 64;
            for (int64_t i = 0; i < n; i++) e[i] = -load(gate_up, go + i0 + i, bf);
            exp_shifted(e, n, 0.f);
            for (int64_t i = 0; i < n; i++) {
                const float g = load(gate_up, go + i0 + i, bf);
                const float act = rnd(g / (1.0f + e[i]), bf);
                store(out, oo + i0 + i, act * load(gate_up, go + inter + i0 + i, bf), bf);
            }
        }
    }
}

void ss_silu_mul_rows(const void *gate_up, void *out, int64_t r0, int64_t r1, int64_t inter, int dtype) {
    if (dtype == 1) silu_mul_rows(gate_up, out, r0, r1, inter, 1);
    else silu_mul_rows(gate_up, out, r0, r1, inter, 0);
}

void ss_silu_mul(const void *gate_up, void *out, int64_t rows, int64_t inter, int dtype) {
    ss_silu_mul_rows(gate_up, out, 0, rows, inter, dtype);
}

/* out[r][n] = bias[n] + sum_k x[r][k] * w[n][k] for n in [n0, n1): a linear layer that streams
 * each weight row once per block of LIN_ROWS rows, the regime where decode is bound by reading
 * weights. w: [N, K] in the model's dtype, row-major (torch's own layout); x and out row-strided;
 * fp32 accumulation over K in one fixed order, one rounding at the end. AVX-512 where K is a
 * multiple of 16, AVX2 with FMA where it is a multiple of 8. Any number of rows: a row's result
 * is the same whatever the rows beside it (no shape-dependent choice of algorithm), which the
 * batch-invariant mode relies on. */
#define LIN_ROWS 8
#ifdef __AVX512F__
/* total[r * 8 + c] = dot(x row r, w row n + c) for r < NR, c < NB, as a register tile: each
 * 16-wide weight chunk is loaded once for NR rows and each activation chunk once for NB columns
 * (NR * NB FMAs per NR + NB loads; a core with one load per FMA to spare was load-bound with one
 * column at a time). One accumulator per (row, column), K chunks added in order, then one
 * horizontal sum: a row's result never depends on which rows or columns share its tile. */
static inline __attribute__((always_inline)) void lin_tile(const float *xf, int64_t k_dim, const void *w, int64_t n,
                                                           const int NR, const int NB, int bf, float *total) {
    __m512 acc[4][8];
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NB; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < k_dim; k += 16) {
        __m512 wv[8];
        for (int c = 0; c < NB; c++) wv[c] = load16(w, (n + c) * k_dim + k, bf);
        for (int r = 0; r < NR; r++) {
            const __m512 xv = _mm512_loadu_ps(xf + r * k_dim + k);
            for (int c = 0; c < NB; c++) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NB; c++) total[r * 8 + c] = _mm512_reduce_add_ps(acc[r][c]);
}

/* The tile shapes with constant sizes (so the accumulators stay in registers): 1 x 8 for a single
 * row, NR x 4 otherwise, NR x 1 for the last columns. */
static inline __attribute__((always_inline)) void lin_tile_any(const float *xf, int64_t k_dim, const void *w,
                                                               int64_t n, int64_t nr, int nb, int bf, float *total) {
    if (nb == 8) { lin_tile(xf, k_dim, w, n, 1, 8, bf, total); return; }
    if (nb == 4) {
        switch (nr) {
        case 1: lin_tile(xf, k_dim, w, n, 1, 4, bf, total); return;
        case 2: lin_tile(xf, k_dim, w, n, 2, 4, bf, total); return;
        case 3: lin_tile(xf, k_dim, w, n, 3, 4, bf, total); return;
        default: lin_tile(xf, k_dim, w, n, 4, 4, bf, total); return;
        }
    }
    switch (nr) {
    case 1: lin_tile(xf, k_dim, w, n, 1, 1, bf, total); return;
    case 2: lin_tile(xf, k_dim, w, n, 2, 1, bf, total); return;
    case 3: lin_tile(xf, k_dim, w, n, 3, 1, bf, total); return;
    default: lin_tile(xf, k_dim, w, n, 4, 1, bf, total); return;
    }
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* The same register tile on AVX2 (8 lanes, 16 registers): 1 x 8 for a single row, 2 x 6
 * otherwise, NR x 1 for the last columns. Each (row, column) keeps one accumulator over K in
 * order, so a row's result does not depend on the tile it was computed in. */
#include <immintrin.h>
#define LIN8_NR 2          /* rows per tile */
#define LIN8_NB 6          /* weight rows (output columns) per tile: 2 x 6 measured best of 2x4, 3x4, 4x2, 4x3 on a Zen 3 */
#define LIN8_PREFETCH 128  /* elements ahead in the next tile's rows: +25% at one row on a Zen 3 (DRAM-bound) */
static inline __m256 load8(const void *p, int64_t i, int bf) {
    if (bf) return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i))), 16));
    return _mm256_loadu_ps((const float *)p + i);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __attribute__((always_inline)) void lin_tile8(const float *xf, int64_t k_dim, const void *w, int64_t n,
                                                            const int NR, const int NB, int bf, float *total) {
    __m256 acc[LIN8_NR][8];
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NB; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < k_dim; k += 8) {
        /* The next tile's weight rows, one cache line each per 64 bytes of a row consumed: at
         * one row the loop is bound by DRAM, and the hardware prefetcher alone lags. */
        if ((k * (bf ? 2 : 4)) % 64 == 0)
            for (int c = 0; c < NB; c++)
                _mm_prefetch((const char *)w + ((n + NB + c) * k_dim + k + LIN8_PREFETCH) * (bf ? 2 : 4), _MM_HINT_T0);
        __m256 xv[LIN8_NR];
        for (int r = 0; r < NR; r++) xv[r] = _mm256_loadu_ps(xf + r * k_dim + k);
        for (int c = 0; c < NB; c++) {
            const __m256 wv = load8(w, (n + c) * k_dim + k, bf);
            for (int r = 0; r < NR; r++) acc[r][c] = _mm256_fmadd_ps(xv[r], wv, acc[r][c]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NB; c++) total[r * 8 + c] = hsum8(acc[r][c]);
}

static inline __attribute__((always_inline)) void lin_tile8_any(const float *xf, int64_t k_dim, const void *w,
                                                                int64_t n, int64_t nr, int nb, int bf, float *total) {
    /* Constant tile sizes in every call, so that the accumulators stay in registers. */
    if (nb == 8) lin_tile8(xf, k_dim, w, n, 1, 8, bf, total);
    else if (nb == LIN8_NB && nr == 1) lin_tile8(xf, k_dim, w, n, 1, LIN8_NB, bf, total);
    else if (nb == LIN8_NB) lin_tile8(xf, k_dim, w, n, LIN8_NR, LIN8_NB, bf, total);
    else if (nr == 1) lin_tile8(xf, k_dim, w, n, 1, 1, bf, total);
    else lin_tile8(xf, k_dim, w, n, LIN8_NR, 1, bf, total);
}
#endif

static inline __attribute__((always_inline)) FAST void linear_block(
        const void *x, int64_t x_stride, const void *w, const void *bias, int64_t n0, int64_t n1, int64_t k_dim,
        int64_t rows, void *out, int64_t out_stride, int bf) {
    float xf[LIN_ROWS][k_dim];
    for (int64_t r = 0; r < rows; r++)
        for (int64_t k = 0; k < k_dim; k++) xf[r][k] = load(x, r * x_stride + k, bf);
#ifdef __AVX512F__
    if (k_dim % 16 == 0) {
        const int wide = rows == 1 ? 8 : 4;
        float total[4 * 8];
        for (int64_t n = n0; n < n1;) {
            const int nb = n1 - n >= wide ? wide : 1;
            /* Row blocks inside the column block: the NB weight rows stay in L1 after the first. */
            for (int64_t rb = 0; rb < rows; rb += 4) {
                const int64_t nr = rows - rb < 4 ? rows - rb : 4;
                lin_tile_any(xf[rb], k_dim, w, n, nr, nb, bf, total);
                for (int64_t r = 0; r < nr; r++)
                    for (int c = 0; c < nb; c++)
                        store(out, (rb + r) * out_stride + n + c,
                              total[r * 8 + c] + (bias ? load(bias, n + c, bf) : 0.f), bf);
            }
            n += nb;
        }
        return;
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (k_dim % 8 == 0) {
        const int wide = rows == 1 ? 8 : LIN8_NB;
        float total[LIN8_NR * 8];
        for (int64_t n = n0; n < n1;) {
            const int nb = n1 - n >= wide ? wide : 1;
            for (int64_t rb = 0; rb < rows; rb += LIN8_NR) {
                const int64_t nr = rows - rb < LIN8_NR ? rows - rb : LIN8_NR;
                lin_tile8_any(xf[rb], k_dim, w, n, nr, nb, bf, total);
                for (int64_t r = 0; r < nr; r++)
                    for (int c = 0; c < nb; c++)
                        store(out, (rb + r) * out_stride + n + c,
                              total[r * 8 + c] + (bias ? load(bias, n + c, bf) : 0.f), bf);
            }
            n += nb;
        }
        return;
    }
#endif
    for (int64_t n = n0; n < n1; n++) {
        const float b = bias ? load(bias, n, bf) : 0.f;
        for (int64_t r = 0; r < rows; r++) {
            float dot = 0.f;
            const float *xr = xf[r];
#pragma omp simd reduction(+ : dot)
            for (int64_t k = 0; k < k_dim; k++) dot += xr[k] * load(w, n * k_dim + k, bf);
            store(out, r * out_stride + n, dot + b, bf);
        }
    }
}

/* Columns [n0, n1) in chunks of LIN_COLS (a chunk's weight rows stay in L2 while every block of
 * rows passes over them); rows in blocks of LIN_ROWS. */
#define LIN_COLS 256
static inline __attribute__((always_inline)) void linear_rows(
        const void *x, int64_t x_stride, const void *w, const void *bias, int64_t n0, int64_t n1, int64_t k_dim,
        int64_t rows, void *out, int64_t out_stride, int bf) {
    const int64_t es = bf ? 2 : 4;
    for (int64_t c0 = n0; c0 < n1; c0 += LIN_COLS) {
        const int64_t c1 = n1 - c0 < LIN_COLS ? n1 : c0 + LIN_COLS;
        for (int64_t r0 = 0; r0 < rows; r0 += LIN_ROWS)
            linear_block((const char *)x + r0 * x_stride * es, x_stride, w, bias, c0, c1, k_dim,
                         rows - r0 < LIN_ROWS ? rows - r0 : LIN_ROWS, (char *)out + r0 * out_stride * es,
                         out_stride, bf);
    }
}

FAST void ss_linear_cols(const void *x, int64_t x_stride, const void *w, const void *bias, int64_t n0, int64_t n1,
                         int64_t k_dim, int64_t rows, void *out, int64_t out_stride, int dtype) {
    if (dtype == 1) linear_rows(x, x_stride, w, bias, n0, n1, k_dim, rows, out, out_stride, 1);
    else linear_rows(x, x_stride, w, bias, n0, n1, k_dim, rows, out, out_stride, 0);
}

void ss_linear(const void *x, int64_t x_stride, const void *w, const void *bias, int64_t n_dim, int64_t k_dim,
               int64_t rows, void *out, int64_t out_stride, int dtype) {
    ss_linear_cols(x, x_stride, w, bias, 0, n_dim, k_dim, rows, out, out_stride, dtype);
}

/* Greedy decoding under a grammar (cluster/engine/grammar.py): for each of n logits rows rows[j]
 * (fp32), the first index of the largest logit its token bitmask (mask row mask_rows[j]: bit
 * i & 31 of word i >> 5) allows, and the row's largest logit overall; token -1 when the mask
 * allows nothing. One pass over the row for both maxima (vectorised), one more up to the first
 * index that holds the allowed one: what torch.argmax of the fully masked row gives, without
 * writing -inf over the ~49k logits the mask forbids. With `steer`, that token's logit is then
 * raised above the row's maximum, so that any later argmax of the row picks it. */
void ss_masked_argmax(float *logits, int64_t row_stride, const int32_t *masks, int64_t mask_stride,
                      const int64_t *rows, const int64_t *mask_rows, int64_t n, int64_t vocab, int steer,
                      int64_t *out_token, float *out_max) {
    for (int64_t j = 0; j < n; j++) {
        float *x = logits + rows[j] * row_stride;
        const uint32_t *m = (const uint32_t *)(masks + mask_rows[j] * mask_stride);
        float best = -INFINITY, top = -INFINITY;
        uint32_t any = 0;
        for (int64_t w = 0; w * 32 < vocab; w++) {
            const uint32_t bits = m[w];
            const float *xs = x + w * 32;
            const int lim = vocab - w * 32 < 32 ? (int)(vocab - w * 32) : 32;
            any |= bits;
#pragma omp simd reduction(max : best, top)
            for (int b = 0; b < lim; b++) {
                const float v = xs[b];
                top = v > top ? v : top;
                const float a = ((bits >> b) & 1u) ? v : -INFINITY;
                best = a > best ? a : best;
            }
        }
        int64_t token = -1;
        for (int64_t i = 0; any && i < vocab; i++) {
            if (((m[i >> 5] >> (i & 31)) & 1u) && x[i] == best) {
                token = i;
                break;
            }
        }
        if (steer && token >= 0) {
            const float lift = fabsf(top) * 1e-3f;
            x[token] = top + (lift > 1.0f ? lift : 1.0f);
        }
        out_token[j] = token;
        out_max[j] = top;
    }
}
