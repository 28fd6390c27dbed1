/* What the native CPU kernels share (paged_attention_cpu.c, layer_ops_cpu.c): vectors of
 * 16 floats in GCC vector extensions (one AVX-512 register, two AVX2 ones, four SSE
 * ones: the build's -march decides), a polynomial exponential, and bfloat16 <-> float32
 * (bf16 is float32's upper half; stores round to nearest even, NaN stays NaN). */
#ifndef EXPEDITOR_CPU_VECTORS_H
#define EXPEDITOR_CPU_VECTORS_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif
#if defined(__AVX512F__)
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
#endif
#if HAVE_AVX2
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#define HAVE_OPENMP 1
#else
#define HAVE_OPENMP 0
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef float v8 __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
#define SHUFFLE __builtin_shufflevector
#define INLINE static inline __attribute__((always_inline)) /* vectors stay in registers */
#define MIN(a, b) ((a) < (b) ? (a) : (b))

INLINE v16 splat(float x) { return (v16){0} + x; }

/* m ? a : b, lane by lane (m: a comparison's all-ones or zero lanes). */
INLINE v16 select16(v16i m, v16 a, v16 b) { return (v16)((m & (v16i)a) | (~m & (v16i)b)); }

/* exp(x) lane by lane for x <= 0 (a softmax after subtracting the max); 0 below -87:
 * 2^n times a polynomial of the remainder (relative error about 2e-7), ln 2 in two parts. */
INLINE v16 exp16(v16 x) {
    const v16i below = x < splat(-87.0f);
    x = select16(below, splat(-87.0f), x);
    const v16 y = x * 1.44269504088896341f + 0.5f;
    v16i n = __builtin_convertvector(y, v16i); /* truncated; floor for negative y below */
    n += __builtin_convertvector(n, v16) > y;
    const v16 nf = __builtin_convertvector(n, v16);
    const v16 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    v16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return (v16)(~below & (v16i)(p * (v16)((n + 127) << 23)));
}

INLINE uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* bfloat16 lanes widened, as instructions where the build has them (GCC would split a
 * 16-lane conversion in two). */
INLINE v8 widen8(v8h h) {
#if HAVE_AVX2
    return (v8)_mm256_slli_epi32(_mm256_cvtepu16_epi32((__m128i)h), 16);
#else
    return (v8)(__builtin_convertvector(h, v8u) << 16);
#endif
}
INLINE v16 widen16(v16h h) {
#if HAVE_AVX512
    return (v16)_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16);
#else
    const v8 lo = widen8(SHUFFLE(h, h, 0, 1, 2, 3, 4, 5, 6, 7));
    const v8 hi = widen8(SHUFFLE(h, h, 8, 9, 10, 11, 12, 13, 14, 15));
    return SHUFFLE(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
}

/* The first n (<= 16) bfloat16 values at p as float32 lanes, the rest zero. */
INLINE v16 load_bf16(const uint16_t *p, int64_t n) {
    v16h h = {0};
    if (n == 16) memcpy(&h, p, sizeof h); /* whole: one load */
    else memcpy(&h, p, sizeof(uint16_t) * n);
    return widen16(h);
}

/* x's lanes rounded to bfloat16, as float32 (rounded, then widened again). */
INLINE v16 round_bf16(v16 x) {
    const v16u bits = (v16u)x, nan = (bits & 0x7fffffffu) > 0x7f800000u;
    const v16u rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    return (v16)((nan & 0x7fc00000u) | (~nan & rounded));
}

/* x's first n (<= 16) lanes rounded to bfloat16 and stored at p. */
INLINE void store_bf16(uint16_t *p, v16 x, int64_t n) {
    const v16u bits = (v16u)round_bf16(x) >> 16;
#if HAVE_AVX512
    const v16h h = (v16h)_mm512_cvtepi32_epi16((__m512i)bits);
#else
    const v16h h = __builtin_convertvector(bits, v16h);
#endif
    if (n == 16) memcpy(p, &h, sizeof h);
    else memcpy(p, &h, sizeof(uint16_t) * n);
}
#endif
