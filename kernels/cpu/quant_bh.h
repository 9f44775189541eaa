/* quant.c's register tiles for bf16 activations on CPUs with AVX512_BF16 (included by quant.c after
 * its own tiles): a block's quants become 32 exact bf16 integers (a 4-bit block through one table
 * permute, an 8-bit one through fp32), and t = x . q is one `vdpbf16ps` over the block (products
 * exact in fp32, summed in pairs) instead of two fp32 multiply-adds on x converted to fp32; then
 * acc += d * t as the fp32 path does. A third fewer instructions per weight and per row, x read as
 * bf16 (half the bytes in L1), and 8-row tiles that decode each block once for 8 rows.
 *
 * The arithmetic per (row, column) is still fixed whatever the batch: one tile shape per row count
 * changes which rows share a decode, never a row's sums, so a row's result is batch-invariant and a
 * speculative verification computes what plain decoding computes. It differs from the fp32 path's
 * by the order of the block's additions (pairs, then lanes), as any change of vector width would.
 */
#ifndef SPLITSERVE_QUANT_BH_H
#define SPLITSERVE_QUANT_BH_H

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define Q_BH 1

/* bf16 of the integers 0..15 (and 16..31 unused): the 4-bit quants' values. */
static const uint16_t BH_INTS[32] = {0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
                                     0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

/* The block's 32 quants in element order as bf16: byte 8h + i holds element 16h + i (low nibble)
 * and 16h + 8 + i (high), so [low 0..7, high 0..7, low 8..15, high 8..15] is element order. */
static inline __m512bh dec_q4_bh(const uint8_t *p, __m512i table) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)p), m = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(bytes, m), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), m);
    const __m256i order = _mm256_set_m128i(_mm_unpackhi_epi64(lo, hi), _mm_unpacklo_epi64(lo, hi));
    return (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(order), table);
}

static inline __m512bh dec_q8_bh(const uint8_t *p) {   /* |q| <= 128: exact in bf16 */
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

/* total[r * QT + c0 + c] = the d * q part of dot(x row r, column c0 + c), r < NR, c < NB: x bf16
 * rows of stride ld (elements), db the tile's scales as floats ([blocks][QT]). */
static inline ALWAYS void qtile_bh(const uint16_t *xb, int64_t ld, int64_t nb, const uint8_t *qt, const float *db,
                                   int c0, const int NR, const int NB, const int fmt, float *total) {
    const int64_t bpb = fmt == QF_Q4 ? QB / 2 : QB;
    const __m512i table = _mm512_loadu_si512((const void *)BH_INTS);
    __m512 acc[8][QT];
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NB; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *qb = qt + b * QT * bpb;
        for (int64_t line = 0; line < QT * bpb; line += 64)
            _mm_prefetch((const char *)qb + Q_PREFETCH + line, _MM_HINT_T0);
        for (int c = 0; c < NB; c++) {
            const __m512bh q = fmt == QF_Q4 ? dec_q4_bh(qb + (c0 + c) * bpb, table) : dec_q8_bh(qb + (c0 + c) * bpb);
            const __m512 d = _mm512_set1_ps(db[b * QT + c0 + c]);
            for (int r = 0; r < NR; r++) {
                const __m512bh x = (__m512bh)_mm512_loadu_si512((const void *)(xb + r * ld + b * QB));
                acc[r][c] = _mm512_fmadd_ps(d, _mm512_dpbf16_ps(_mm512_setzero_ps(), x, q), acc[r][c]);
            }
        }
    }
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NB; c++) total[r * QT + c0 + c] = _mm512_reduce_add_ps(acc[r][c]);
}

/* One tile for the next 8, 4, 2 or 1 of nr rows (constant shapes: the accumulators stay in
 * registers); returns the rows done. */
static inline ALWAYS int64_t qtile_bh_rows(const uint16_t *xb, int64_t ld, int64_t nb, const uint8_t *qt,
                                           const float *db, int64_t nr, const int fmt, float *total) {
    if (nr >= 8) {
        for (int c0 = 0; c0 < QT; c0 += 2) qtile_bh(xb, ld, nb, qt, db, c0, 8, 2, fmt, total);
        return 8;
    }
    if (nr >= 4) {
        for (int c0 = 0; c0 < QT; c0 += 4) qtile_bh(xb, ld, nb, qt, db, c0, 4, 4, fmt, total);
        return 4;
    }
    if (nr >= 2) {
        qtile_bh(xb, ld, nb, qt, db, 0, 2, QT, fmt, total);
        return 2;
    }
    qtile_bh(xb, ld, nb, qt, db, 0, 1, QT, fmt, total);
    return 1;
}
#endif
#endif
