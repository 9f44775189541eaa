// The C ops of ops.c run over torch's own intra-op thread pool (at::parallel_for): rows (or
// sequences) are split between the threads torch already runs, so nothing competes with torch's
// OpenMP team for the cores. Each row's arithmetic is the same whatever the split, so the result
// does not depend on the thread count or the batch. Built beside ops.c when torch's headers are
// there; without them the Python side calls ops.c's serial entry points.
#include <ATen/Parallel.h>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "bf16.h"

extern "C" {
void ss_rms_norm(const void *x, int64_t x_stride, void *residual, const void *w, void *out, int64_t rows,
                 int64_t hidden, float eps, int dtype);
void ss_rope(void *qkv, int64_t row_stride, const int64_t *positions, const float *cos_t, const float *sin_t,
             int64_t rows, int64_t heads, int64_t dim, int dtype);
void ss_store_kv(const void *k, int64_t k_stride, const void *v, int64_t v_stride, const int64_t *slots,
                 int64_t rows, int64_t width, void *k_cache, void *v_cache, int dtype);
void ss_linear_cols(const void *x, int64_t x_stride, const void *w, const void *bias, int64_t n0, int64_t n1,
                    int64_t k_dim, int64_t rows, void *out, int64_t out_stride, int dtype);
void ss_qlinear_tiles(const void *x, int64_t x_stride, const void *quants, const void *scale, const void *mins,
                      const float *bias, int64_t t0, int64_t t1, int64_t n_dim, int64_t k_dim, int64_t rows,
                      void *out, int64_t out_stride, int fmt, int dtype);
void ss_qdequant_tiles(const void *quants, const void *scale, const void *mins, int64_t t0, int64_t t1,
                       int64_t n_dim, int64_t k_dim, void *out, int fmt, int dtype);
void ss_silu_mul_rows(const void *gate_up, void *out, int64_t r0, int64_t r1, int64_t inter, int dtype);
void ss_decode_attention_items(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                               const int64_t *tables, int64_t max_blocks, const int64_t *lens,
                               const int64_t *tails, int64_t tail_width, int64_t item0, int64_t item1, int64_t hq,
                               int64_t hkv, int64_t dim, int64_t block_size, int64_t window, float scale, void *out,
                               int dtype, int kvq);
void ss_store_kv_q(const void *k, int64_t k_stride, const void *v, int64_t v_stride, const int64_t *slots,
                   int64_t rows, int64_t hkv, int64_t dim, void *k_cache, void *v_cache, int dtype, int kvq);
void ss_mla_decode_items(const void *q_lat, const void *q_pe, const void *kv, int64_t plane, const int64_t *tables,
                         int64_t max_blocks, const int64_t *lens, int64_t item0, int64_t item1, int64_t heads,
                         int64_t c_dim, int64_t p_dim, int64_t half, int64_t block_size, float scale, void *out,
                         int dtype);
int64_t ss_prefill_ctx_pad(int64_t ctx);
int64_t ss_prefill_kv_items(int64_t ctx_pad, int64_t hkv);
int64_t ss_prefill_items(int64_t q_len, int64_t hkv, int64_t group);
void ss_prefill_kv_f32(const void *k, int64_t k_stride, const void *v, int64_t v_stride, int64_t ctx,
                       int64_t ctx_pad, int64_t dim, int64_t item0, int64_t item1, float *kt, float *vf, int dtype);
void ss_prefill_attention_items(const void *q, int64_t q_stride, const float *kt, const float *vf, int64_t ctx,
                                int64_t ctx_pad, int64_t q_len, int64_t hq, int64_t hkv, int64_t dim, int64_t window,
                                float scale, void *out, int dtype, int64_t item0, int64_t item1);
}

namespace {
constexpr int64_t kRowGrain = 64;   // norm and RoPE rows per task: below this one thread is faster

inline const char *at_row(const void *p, int64_t row, int64_t stride, int dtype) {
    return static_cast<const char *>(p) + row * stride * (dtype == 1 ? 2 : 4);
}
inline char *at_row(void *p, int64_t row, int64_t stride, int dtype) {
    return static_cast<char *>(p) + row * stride * (dtype == 1 ? 2 : 4);
}
}  // namespace

extern "C" void ss_rms_norm_par(const void *x, int64_t x_stride, void *residual, const void *w, void *out,
                                int64_t rows, int64_t hidden, float eps, int dtype) {
    at::parallel_for(0, rows, kRowGrain, [&](int64_t r0, int64_t r1) {
        ss_rms_norm(at_row(x, r0, x_stride, dtype), x_stride,
                    residual ? at_row(residual, r0, hidden, dtype) : nullptr, w, at_row(out, r0, hidden, dtype),
                    r1 - r0, hidden, eps, dtype);
    });
}

extern "C" void ss_rope_par(void *qkv, int64_t row_stride, const int64_t *positions, const float *cos_t,
                            const float *sin_t, int64_t rows, int64_t heads, int64_t dim, int dtype) {
    at::parallel_for(0, rows, kRowGrain, [&](int64_t r0, int64_t r1) {
        ss_rope(at_row(qkv, r0, row_stride, dtype), row_stride, positions + r0, cos_t, sin_t, r1 - r0, heads, dim,
                dtype);
    });
}

extern "C" void ss_decode_attention_par(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                                        const int64_t *tables, int64_t max_blocks, const int64_t *lens,
                                        const int64_t *tails, int64_t tail_width, int64_t batch, int64_t hq,
                                        int64_t hkv, int64_t dim, int64_t block_size, int64_t window, float scale,
                                        void *out, int dtype, int kvq) {
    // Work items are (sequence, KV head) pairs: a single sequence still spreads over its KV heads.
    at::parallel_for(0, batch * hkv, 1, [&](int64_t i0, int64_t i1) {
        ss_decode_attention_items(q, q_stride, k_cache, v_cache, tables, max_blocks, lens, tails, tail_width, i0, i1,
                                  hq, hkv, dim, block_size, window, scale, out, dtype, kvq);
    });
}

extern "C" void ss_mla_decode_par(const void *q_lat, const void *q_pe, const void *kv, int64_t plane,
                                  const int64_t *tables, int64_t max_blocks, const int64_t *lens, int64_t rows,
                                  int64_t heads, int64_t c_dim, int64_t p_dim, int64_t half, int64_t block_size,
                                  float scale, void *out, int dtype) {
    // Work items are (row, chunk of 16 heads), as kernels/cpu/mla.c splits them.
    const int64_t chunks = (heads + 15) / 16;
    at::parallel_for(0, rows * chunks, 1, [&](int64_t i0, int64_t i1) {
        ss_mla_decode_items(q_lat, q_pe, kv, plane, tables, max_blocks, lens, i0, i1, heads, c_dim, p_dim, half,
                            block_size, scale, out, dtype);
    });
}

// Prefill attention (prefill_attn.c): the keys and values to fp32 once, then the query blocks; both
// passes split between torch's threads (items of one pass cost about the same).
extern "C" void ss_prefill_attention_par(const void *q, int64_t q_stride, const void *k, int64_t k_stride,
                                         const void *v, int64_t v_stride, int64_t q_len, int64_t ctx, int64_t hq,
                                         int64_t hkv, int64_t dim, int64_t window, float scale, void *out,
                                         int dtype) {
    const int64_t ctx_pad = ss_prefill_ctx_pad(ctx);
    const size_t n = static_cast<size_t>(hkv * ctx_pad * dim);
    std::unique_ptr<float[]> kt(new float[n]), vf(new float[n]);   // every element written by the first pass
    at::parallel_for(0, ss_prefill_kv_items(ctx_pad, hkv), 1, [&](int64_t i0, int64_t i1) {
        ss_prefill_kv_f32(k, k_stride, v, v_stride, ctx, ctx_pad, dim, i0, i1, kt.get(), vf.get(), dtype);
    });
    at::parallel_for(0, ss_prefill_items(q_len, hkv, hq / hkv), 1, [&](int64_t i0, int64_t i1) {
        ss_prefill_attention_items(q, q_stride, kt.get(), vf.get(), ctx, ctx_pad, q_len, hq, hkv, dim, window,
                                   scale, out, dtype, i0, i1);
    });
}

extern "C" void ss_silu_mul_par(const void *gate_up, void *out, int64_t rows, int64_t inter, int dtype) {
    at::parallel_for(0, rows, kRowGrain / 4, [&](int64_t r0, int64_t r1) {
        ss_silu_mul_rows(gate_up, out, r0, r1, inter, dtype);
    });
}

// A pure-decode pass's whole attention block for one layer in one call: RoPE on the queries and
// keys of the fused projection (in place), K/V stored at their slots, then attention for every
// row: the same arithmetic as the three separate ops, without two Python round trips per layer.
extern "C" void ss_decode_block(void *qkv, int64_t qkv_stride, const int64_t *positions, const float *cos_t,
                                const float *sin_t, const int64_t *slots, void *k_cache, void *v_cache,
                                const int64_t *tables, int64_t max_blocks, const int64_t *lens, int64_t batch,
                                int64_t hq, int64_t hkv, int64_t dim, int64_t block_size, int64_t window, float scale,
                                void *out, int dtype, int kvq) {
    ss_rope_par(qkv, qkv_stride, positions, cos_t, sin_t, batch, hq + hkv, dim, dtype);
    const char *base = static_cast<const char *>(qkv);
    const int64_t es = dtype == 1 ? 2 : 4;
    const char *k = base + hq * dim * es, *v = base + (hq + hkv) * dim * es;
    if (kvq)
        ss_store_kv_q(k, qkv_stride, v, qkv_stride, slots, batch, hkv, dim, k_cache, v_cache, dtype, kvq);
    else
        ss_store_kv(k, qkv_stride, v, qkv_stride, slots, batch, hkv * dim, k_cache, v_cache, dtype);
    ss_decode_attention_par(qkv, qkv_stride, k_cache, v_cache, tables, max_blocks, lens, nullptr, 0, batch, hq, hkv,
                            dim, block_size, window, scale, out, dtype, kvq);
}

extern "C" void ss_linear_par(const void *x, int64_t x_stride, const void *w, const void *bias, int64_t n_dim,
                              int64_t k_dim, int64_t rows, void *out, int64_t out_stride, int dtype) {
    // Output columns split between threads (each thread streams its own weight rows); 64 at least.
    at::parallel_for(0, n_dim, 64, [&](int64_t n0, int64_t n1) {
        ss_linear_cols(x, x_stride, w, bias, n0, n1, k_dim, rows, out, out_stride, dtype);
    });
}

extern "C" void ss_qlinear_par(const void *x, int64_t x_stride, const void *quants, const void *scale,
                               const void *mins, const float *bias, int64_t n_dim, int64_t k_dim, int64_t rows,
                               void *out, int64_t out_stride, int fmt, int dtype) {
    // Tiles of 8 output columns (quant.c's QT) split between threads, 8 tiles at least, as ss_linear_par.
    at::parallel_for(0, (n_dim + 7) / 8, 8, [&](int64_t t0, int64_t t1) {
        ss_qlinear_tiles(x, x_stride, quants, scale, mins, bias, t0, t1, n_dim, k_dim, rows, out, out_stride, fmt,
                         dtype);
    });
}

extern "C" void ss_qdequant_par(const void *quants, const void *scale, const void *mins, int64_t t0, int64_t t1,
                                int64_t n_dim, int64_t k_dim, void *out, int fmt, int dtype) {
    // Tiles of 8 rows of the dense weight split between threads (each element's value is the same
    // whatever the split); out holds rows from t0 * 8 on.
    const int64_t es = dtype == 1 ? 2 : 4;
    at::parallel_for(t0, t1, 16, [&](int64_t a, int64_t b) {
        ss_qdequant_tiles(quants, scale, mins, a, b, n_dim, k_dim, static_cast<char *>(out) + (a - t0) * 8 * k_dim * es,
                          fmt, dtype);
    });
}

// One decoder layer of a pure-decode pass on 4-bit or 8-bit weights (kernels/cpu_quant.py's
// formats) in one call: norm, qkv, the decode block (RoPE, K/V store, attention), o, add-norm,
// gate_up, SiLU-times-up, down, and the residual add, each by the same entry point the separate
// Python calls reach, in the same order: the same bits, without ~8 Python round trips per layer
// (about half of a 4-bit step at batch 1 went to them). cpu_ops.py's decode_layer mirrors
// these structs with ctypes; every integer is int64 and every float a double (no padding).
struct SsQWeight {
    const void *quants, *scales, *mins;
    const float *bias;
    int64_t n, fmt;
};
struct SsLayer {
    const void *ln1, *ln2;
    double eps;
    int64_t window;
    const float *cos_t, *sin_t;
    SsQWeight qkv, o, gate_up, down;
};
struct SsDecodePass {
    int64_t batch, hidden, hq, hkv, dim, inter, block_size, max_blocks, kvq, dtype;
    double scale;
    const int64_t *positions, *slots, *tables, *lens;
    void *h, *qkv, *attn, *y, *gate_up, *act;   // scratch, rows contiguous
};

namespace {
void qlinear(const SsQWeight &w, const void *x, int64_t k, int64_t rows, void *out, int dtype) {
    ss_qlinear_par(x, k, w.quants, w.scales, w.mins, w.bias, w.n, k, rows, out, w.n, static_cast<int>(w.fmt), dtype);
}

// x += y, rounded to the dtype as torch's add_ rounds (fp32 sum, then round to nearest even).
void add_rows(void *x, const void *y, int64_t n, int dtype) {
    if (dtype == 1) {
        auto *xb = static_cast<uint16_t *>(x);
        const auto *yb = static_cast<const uint16_t *>(y);
        for (int64_t i = 0; i < n; i++) xb[i] = f2bf(bf2f(xb[i]) + bf2f(yb[i]));
    } else {
        auto *xf = static_cast<float *>(x);
        const auto *yf = static_cast<const float *>(y);
        for (int64_t i = 0; i < n; i++) xf[i] += yf[i];
    }
}
}  // namespace

extern "C" void ss_decode_layer(const SsLayer *L, const SsDecodePass *P, void *x, void *k_cache, void *v_cache) {
    const int dt = static_cast<int>(P->dtype);
    const int64_t b = P->batch, hid = P->hidden, qd = P->hq * P->dim;
    const float eps = static_cast<float>(L->eps);
    ss_rms_norm_par(x, hid, nullptr, L->ln1, P->h, b, hid, eps, dt);
    qlinear(L->qkv, P->h, hid, b, P->qkv, dt);
    ss_decode_block(P->qkv, L->qkv.n, P->positions, L->cos_t, L->sin_t, P->slots, k_cache, v_cache, P->tables,
                    P->max_blocks, P->lens, b, P->hq, P->hkv, P->dim, P->block_size, L->window,
                    static_cast<float>(P->scale), P->attn, dt, static_cast<int>(P->kvq));
    qlinear(L->o, P->attn, qd, b, P->y, dt);
    ss_rms_norm_par(P->y, hid, x, L->ln2, P->h, b, hid, eps, dt);     // x += attention; h = norm(x)
    qlinear(L->gate_up, P->h, hid, b, P->gate_up, dt);
    ss_silu_mul_par(P->gate_up, P->act, b, P->inter, dt);
    qlinear(L->down, P->act, P->inter, b, P->y, dt);
    add_rows(x, P->y, b * hid, dt);
}

// One mixture-of-experts layer in one call (kernels/cpu_moe.py): the (token, slot) pairs arrive
// sorted by expert (`starts[e]` .. `starts[e + 1]` are expert e's, `rows[p]` pair p's token,
// `weights[p]` its routing weight in fp32). Gather each pair's token row, then every active
// expert's gate_up over its rows, SiLU-times-up, down, and the weighted rows added into their
// tokens' outputs in ascending expert order, each step rounded where the torch reference rounds
// (kernels/moe_reference.py). The GEMMs are ss_linear_cols: a row's arithmetic is the same
// whatever rows share the call, so the result is batch-invariant. Work items are (active expert,
// column chunk) pairs, so one expert of many rows (prefill) and many experts of one row (decode)
// both spread over the threads, and the thread team wakes four times per layer, not per expert.
extern "C" void ss_moe_experts(const void *x, int64_t x_stride, const void *gate_up, const void *down,
                               const int64_t *rows, const int64_t *starts, const float *weights,
                               int64_t num_experts, int64_t pairs, int64_t hidden, int64_t inter, int64_t max_rows,
                               void *xg, void *gu, void *act, void *y, void *out, int dtype) {
    const int64_t es = dtype == 1 ? 2 : 4;
    char *xg_c = static_cast<char *>(xg), *gu_c = static_cast<char *>(gu), *act_c = static_cast<char *>(act);
    char *y_c = static_cast<char *>(y);
    const char *gate_up_c = static_cast<const char *>(gate_up), *down_c = static_cast<const char *>(down);
    // The experts with tokens computed here: all of them with max_rows < 0; else those of at most
    // max_rows tokens, the caller having written the others' rows of `y` (BLAS wins on many rows).
    std::vector<int64_t> active;
    for (int64_t e = 0; e < num_experts; ++e) {
        const int64_t n = starts[e + 1] - starts[e];
        if (n > 0 && (max_rows < 0 || n <= max_rows)) active.push_back(e);
    }
    const int64_t n_active = static_cast<int64_t>(active.size());
    at::parallel_for(0, pairs, 16, [&](int64_t p0, int64_t p1) {
        for (int64_t p = p0; p < p1; ++p)
            std::memcpy(xg_c + p * hidden * es, at_row(x, rows[p], x_stride, dtype), hidden * es);
    });
    constexpr int64_t kChunk = 64;   // output columns per work item
    const int64_t gu_chunks = (2 * inter + kChunk - 1) / kChunk;
    at::parallel_for(0, n_active * gu_chunks, 1, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
            const int64_t e = active[i / gu_chunks], c0 = (i % gu_chunks) * kChunk;
            const int64_t c1 = c0 + kChunk < 2 * inter ? c0 + kChunk : 2 * inter;
            ss_linear_cols(xg_c + starts[e] * hidden * es, hidden, gate_up_c + e * 2 * inter * hidden * es, nullptr,
                           c0, c1, hidden, starts[e + 1] - starts[e], gu_c + starts[e] * 2 * inter * es, 2 * inter,
                           dtype);
        }
    });
    at::parallel_for(0, n_active, 1, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) ss_silu_mul_rows(gu, act, starts[active[i]], starts[active[i] + 1], inter, dtype);
    });
    const int64_t down_chunks = (hidden + kChunk - 1) / kChunk;
    at::parallel_for(0, n_active * down_chunks, 1, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
            const int64_t e = active[i / down_chunks], c0 = (i % down_chunks) * kChunk;
            const int64_t c1 = c0 + kChunk < hidden ? c0 + kChunk : hidden;
            ss_linear_cols(act_c + starts[e] * inter * es, inter, down_c + e * hidden * inter * es, nullptr, c0, c1,
                           inter, starts[e + 1] - starts[e], y_c + starts[e] * hidden * es, hidden, dtype);
        }
    });
    // out[token] += round(y * weight), pairs in sorted (ascending expert) order; threads split columns.
    at::parallel_for(0, hidden, 256, [&](int64_t c0, int64_t c1) {
        for (int64_t p = 0; p < pairs; ++p) {
            const float w = weights[p];
            if (dtype == 1) {
                const uint16_t *src = reinterpret_cast<const uint16_t *>(y_c) + p * hidden;
                uint16_t *dst = static_cast<uint16_t *>(out) + rows[p] * hidden;
                for (int64_t c = c0; c < c1; ++c) dst[c] = f2bf(bf2f(dst[c]) + bf2f(f2bf(bf2f(src[c]) * w)));
            } else {
                const float *src = reinterpret_cast<const float *>(y_c) + p * hidden;
                float *dst = static_cast<float *>(out) + rows[p] * hidden;
                for (int64_t c = c0; c < c1; ++c) dst[c] = dst[c] + src[c] * w;
            }
        }
    });
}
