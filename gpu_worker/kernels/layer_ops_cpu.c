/* A bfloat16 decoder layer's elementwise operations on a CPU, each in one pass (the
 * design: gpu_worker/layer_ops.py). Each computes what transformers' operations compute
 * in bf16, rounding where they round: float32 arithmetic on widened bf16 values, the
 * result of every operation rounded to bf16. Rows spread over OpenMP threads (torch's,
 * as in paged_attention_cpu.c) when there are enough of them. */
#include "cpu_vectors.h"

#define PARALLEL_ELEMENTS 32768 /* below this, one thread: a parallel region costs more */

/* Whether any lane of m (a comparison's) is set. */
INLINE int any16(v16i m) {
#if HAVE_AVX512
    return _mm512_test_epi32_mask((__m512i)m, (__m512i)m) != 0;
#else
    static const v16i none = {0};
    return memcmp(&m, &none, sizeof m) != 0;
#endif
}

/* x[r] += add[r] (rounded; add NULL: x as it is), then out[r] = weight * bf16(x[r] *
 * rsqrt(mean(x[r]^2) + eps)): the residual add and RMSNorm, rows of width contiguous. */
void expeditor_add_rms_norm_bf16(uint16_t *x, const uint16_t *add, const uint16_t *weight,
                                 uint16_t *out, int64_t rows, int64_t width, float eps) {
#pragma omp parallel for if (rows * width >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *xr = x + r * width;
        v16 squares = {0};
        for (int64_t d = 0; d < width; d += 16) {
            const int64_t n = MIN(width - d, 16);
            v16 v = load_bf16(xr + d, n);
            if (add) {
                v = round_bf16(v + load_bf16(add + r * width + d, n));
                store_bf16(xr + d, v, n);
            }
            squares += v * v;
        }
        float sum = 0.0f;
        for (int i = 0; i < 16; i++) sum += squares[i];
        const float inv = 1.0f / sqrtf(sum / (float)width + eps);
        for (int64_t d = 0; d < width; d += 16) {
            const int64_t n = MIN(width - d, 16);
            const v16 normed = round_bf16(load_bf16(xr + d, n) * inv);
            store_bf16(out + r * width + d, load_bf16(weight + d, n) * normed, n);
        }
    }
}

/* q = q * cos + rotate_half(q) * sin in place, for heads [t, h, :head_dim] at qk + t *
 * tok_stride + h * head_dim; cos and sin [t, head_dim] contiguous. */
void expeditor_rotary_bf16(uint16_t *qk, int64_t tok_stride, int64_t tokens, int64_t heads,
                           int64_t head_dim, const uint16_t *cos, const uint16_t *sin) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for if (tokens * heads * head_dim >= PARALLEL_ELEMENTS)
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *q = qk + t * tok_stride + h * head_dim;
            for (int64_t d = 0; d < half; d += 16) {
                const int64_t n = MIN(half - d, 16);
                const v16 a = load_bf16(q + d, n), b = load_bf16(q + half + d, n);
                const v16 lo = round_bf16(a * load_bf16(c + d, n)) +
                               round_bf16(-b * load_bf16(s + d, n));
                const v16 hi = round_bf16(b * load_bf16(c + half + d, n)) +
                               round_bf16(a * load_bf16(s + half + d, n));
                store_bf16(q + d, lo, n);
                store_bf16(q + half + d, hi, n);
            }
        }
    }
}

/* out[r] = bf16(silu(gate)) * up, where row r of gate_up is gate then up (width each). */
void expeditor_silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows,
                             int64_t width) {
#pragma omp parallel for if (rows * width >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = gate_up + r * 2 * width, *up = gate + width;
        for (int64_t d = 0; d < width; d += 16) {
            const int64_t n = MIN(width - d, 16);
            const v16 g = load_bf16(gate + d, n);
            const v16i negative = g < splat(0.0f);
            const v16 x = select16(negative, g, -g);
            v16 e = exp16(x); /* exp(-|g|): no overflow */
            const v16i deep = x < splat(-87.0f);
            if (any16(deep)) { /* below exp16's floor, down to where torch's exp(-g)
                                * overflows (its silu: -0): e^-16 times exp(x + 16) */
                const v16 scaled = exp16(x + 16.0f) * 1.12535174719e-7f;
                e = select16(deep & (x >= splat(-88.72283935546875f)), scaled, e);
            }
            const v16 silu = select16(negative, g * e, g) / (1.0f + e);
            store_bf16(out + r * width + d, round_bf16(silu) * load_bf16(up + d, n), n);
        }
    }
}
