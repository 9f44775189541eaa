/* IEEE half <-> float32 in plain C (exact decode; encode rounds to nearest even, as torch does). */
#ifndef SPLITSERVE_F16_H
#define SPLITSERVE_F16_H
#include <stdint.h>
#include <string.h>

static inline float h2f(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t u;
    float f;
    if (e == 0) {                       /* zero or subnormal: m * 2^-24, exact in float */
        f = (float)m * 0x1p-24f;
        memcpy(&u, &f, 4);
        u |= sign;
    } else if (e == 31) {
        u = sign | 0x7f800000u | (m << 13);
    } else {
        u = sign | ((e + 112u) << 23) | (m << 13);
    }
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f2h(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t sign = (u >> 16) & 0x8000u;
    u &= 0x7fffffffu;
    if (u >= 0x47800000u)                          /* >= 65536, inf or NaN */
        return (uint16_t)(sign | (u > 0x7f800000u ? 0x7e00u : 0x7c00u));
    if (u < 0x38800000u) {                         /* below 2^-14: a subnormal half (or zero) */
        /* Adding 0.5 makes the float unit's own rounding (to nearest even) round the mantissa
         * at 2^-24, the half's subnormal step; the low bits then hold the half's bits. */
        float a;
        memcpy(&a, &u, 4);
        a += 0.5f;
        uint32_t r;
        memcpy(&r, &a, 4);
        return (uint16_t)(sign | (r - 0x3f000000u));
    }
    const uint32_t odd = (u >> 13) & 1u;           /* ties to even */
    u += 0xc8000fffu + odd;                         /* rebias the exponent (-112 << 23), round at bit 13 */
    return (uint16_t)(sign | (u >> 13));
}
#endif
