/* Paged attention for the native CPU backend, in float32 and in bfloat16
 * (gpu_worker/attention/native_backend.py has the design): per sequence and KV head, its
 * query vectors attend block by block with an online softmax, accumulating in float32. Layouts: q[t, h, d] at q + t * q_tok + h * q_head + d, out likewise;
 * caches [blocks, block_size, kv_heads, head_dim], block_stride floats apart, contiguous
 * within a block; tables[s, j] int32, table_stride apart; seqs (int64) the sequences to
 * compute (other rows of out are left as they are). With AVX2 and FMA the inner loops use
 * intrinsics (a polynomial exponential, relative error about 2e-7), elsewhere plain C;
 * with AVX-512 (and tiles set) keys go in tiles of 16, see attend_tiles. Built with
 * OpenMP, a call's sequences spread over the threads. The caller has checked every index.
 *
 * The code below the prelude is written once over an element type T and compiled twice:
 * this file includes itself with T = float (entry points *_f32) and T = uint16_t holding
 * bfloat16 (*_bf16: loads widen to float32, stores round to nearest even). */
#ifndef T
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif
#if HAVE_AVX2 && defined(__AVX512F__)
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
#endif
#if HAVE_AVX512 && defined(__AVX512BF16__)
#define HAVE_AVX512BF16 1
#else
#define HAVE_AVX512BF16 0
#endif
#ifdef _OPENMP
#include <omp.h>
#define HAVE_OPENMP 1
#else
#define HAVE_OPENMP 0
#endif

/* A quantized cache (gpu_worker/kv_quant.py): int8 codes [blocks, block_size, kv_heads,
 * head_dim], block_stride bytes apart, and a float16 scale per row [blocks, block_size,
 * kv_heads], scale_stride halves apart. */
typedef struct {
    const int8_t *keys, *values;
    const uint16_t *key_scales, *value_scales;
    int64_t block_stride, scale_stride;
} Q8;

#define MAX_VECTORS 16   /* query vectors attended together (per KV head) */
#define TILE_KV_HEADS 8  /* KV heads attended together in tiles */
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 256

#if HAVE_AVX2
/* [sum(a[0]), ..., sum(a[7])]: eight horizontal sums at once. */
static inline __m256 sum8(const __m256 *a) {
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20),
                         _mm256_permute2f128_ps(t0, t1, 0x31));
}

/* exp's range reduction (ln 2 in two parts) and polynomial, shared by exp8 and exp16. */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO 2.12194440e-4f
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

/* exp(x) on eight lanes for x <= 0 (a softmax after subtracting the max); 0 below -87. */
static inline __m256 exp8(__m256 x) {
    const __m256 floor_x = _mm256_set1_ps(-87.0f);
    const __m256 below = _mm256_cmp_ps(x, floor_x, _CMP_LT_OQ);
    x = _mm256_max_ps(x, floor_x);
    const __m256 n = _mm256_floor_ps(
        _mm256_fmadd_ps(x, _mm256_set1_ps(EXP_LOG2E), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P5));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i bits =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(below, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}
#endif

#if HAVE_AVX512
/* Lane j: the sum of a[TILE_SLOT[j]]'s lanes (the order the shuffles below leave). */
static const int TILE_SLOT[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

static inline __m512 sum16(const __m512 *a) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 8], 0x44),
                             _mm512_shuffle_f32x4(a[i], a[i + 8], 0xEE));
    for (int i = 0; i < 4; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[i], b[i + 4], 0x88),
                             _mm512_shuffle_f32x4(b[i], b[i + 4], 0xDD));
    for (int i = 0; i < 2; i++)
        d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[i], c[i + 2], 0x44),
                             _mm512_shuffle_ps(c[i], c[i + 2], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
}

/* exp8 on sixteen lanes. */
static inline __m512 exp16(__m512 x) {
    const __m512 floor_x = _mm512_set1_ps(-87.0f);
    const __mmask16 below = _mm512_cmp_ps_mask(x, floor_x, _CMP_LT_OQ);
    x = _mm512_max_ps(x, floor_x);
    const __m512 n = _mm512_roundscale_ps(
        _mm512_fmadd_ps(x, _mm512_set1_ps(EXP_LOG2E), _mm512_set1_ps(0.5f)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P5));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i bits =
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(~below, p, _mm512_castsi512_ps(bits));
}
#endif

/* x[j] = exp(x[j] - top) for j < n; returns their sum. */
static inline float exp_shifted(float *x, int64_t n, float top) {
    int64_t j = 0;
    float total = 0.0f;
#if HAVE_AVX2
    __m256 sums = _mm256_setzero_ps();
    const __m256 shift = _mm256_set1_ps(top);
    for (; j + 8 <= n; j += 8) {
        const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), shift));
        _mm256_storeu_ps(x + j, p);
        sums = _mm256_add_ps(sums, p);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, sums);
    total = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) +
            ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
#endif
    for (; j < n; j++) {
        x[j] = expf(x[j] - top);
        total += x[j];
    }
    return total;
}

/* The online softmax's step: a row's running max raised to include top (finite); returns
 * the factor its running sums take (0 for the first keys, 1 when the max holds). */
static inline float raise_max(float *run_max, float top) {
    const float old = *run_max;
    if (top <= old) return 1.0f;
    *run_max = top;
    return old == -INFINITY ? 0.0f : expf(old - top);
}

/* The largest of x[0 .. n). */
static inline float block_max(const float *x, int64_t n) {
    float top = -INFINITY;
    for (int64_t j = 0; j < n; j++) top = x[j] > top ? x[j] : top;
    return top;
}

/* bfloat16 <-> float32: bf16 is float32's upper half. */
static inline float bf16_to_f32(uint16_t x) {
    const uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN stays NaN */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* float16 -> float32 (a quantized cache's scales; subnormals included). */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu;
    const uint32_t mant = h & 0x3ffu;
    if (exp == 0) { /* zero or subnormal: mant * 2^-24 */
        const float f = (float)mant * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    const uint32_t bits = sign | (exp == 31 ? 0x7f800000u : (exp + 112u) << 23) | mant << 13;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Rows [0, n) of an int8 block for one KV head, times their float16 scales, into
 * out[j * head_dim + d]: codes key_row apart, scales num_kv_heads apart. */
static inline void dequantize_rows(float *out, const int8_t *codes, const uint16_t *scales,
                                   int64_t n, int64_t key_row, int64_t num_kv_heads,
                                   int64_t head_dim) {
    for (int64_t j = 0; j < n; j++) {
        const float scale = f16_to_f32(scales[j * num_kv_heads]);
        const int8_t *c = codes + j * key_row;
        float *o = out + j * head_dim;
        for (int64_t d = 0; d < head_dim; d++) o[d] = (float)c[d] * scale;
    }
}

/* What this build uses: 1 AVX2 and FMA, 2 AVX-512 tiles, 4 AVX-512 BF16 dot products,
 * 8 OpenMP threads over the sequences. */
int expeditor_kernel_features(void) {
    return HAVE_AVX2 | HAVE_AVX512 << 1 | HAVE_AVX512BF16 << 2 | HAVE_OPENMP << 3;
}

/* The threads a call may use (OpenMP's: torch's pool, sized by torch.set_num_threads). */
int expeditor_kernel_threads(void) {
#if HAVE_OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

#define T float
#define NAME(x) x##_f32
#define LOAD(p) (*(p))
#define STORE(x) (x)
#define LOAD8(p) _mm256_loadu_ps(p)
#define LOAD16(p) _mm512_loadu_ps(p)
#define DOT_BF16 0
#include __FILE__
#undef T
#undef NAME
#undef LOAD
#undef STORE
#undef LOAD8
#undef LOAD16
#undef DOT_BF16

#define T uint16_t
#define NAME(x) x##_bf16
#define LOAD(p) bf16_to_f32(*(p))
#define STORE(x) f32_to_bf16(x)
#define LOAD8(p)                                                                       \
    _mm256_castsi256_ps(                                                               \
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define LOAD16(p)                                                                      \
    _mm512_castsi512_ps(                                                               \
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define DOT_BF16 HAVE_AVX512BF16 /* q . k in bf16 pairs, float32 sums (vdpbf16ps) */
#include __FILE__

#else /* the code over T */

/* scores[r][j] = q[r] . k_j for the block's first n_slots keys (rows key_row apart). */
static inline __attribute__((always_inline)) void NAME(block_scores)(
    const float *qv, int64_t nv, const T *kb, int64_t key_row, int64_t n_slots,
    const int64_t head_dim, float *scores, int64_t score_row) {
    int64_t j0 = 0;
#if HAVE_AVX2
    if (head_dim % 8 == 0)
        for (; j0 + 8 <= n_slots; j0 += 8)
            for (int64_t r = 0; r < nv; r++) {
                const float *qr = qv + r * head_dim;
                __m256 a[8];
                for (int t = 0; t < 8; t++) {
                    const T *k = kb + (j0 + t) * key_row;
                    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(qr), LOAD8(k));
                    for (int64_t d = 8; d < head_dim; d += 8)
                        acc = _mm256_fmadd_ps(_mm256_loadu_ps(qr + d), LOAD8(k + d), acc);
                    a[t] = acc;
                }
                _mm256_storeu_ps(scores + r * score_row + j0, sum8(a));
            }
#endif
    for (int64_t j = j0; j < n_slots; j++) {
        const T *k = kb + j * key_row;
        for (int64_t r = 0; r < nv; r++) {
            const float *qr = qv + r * head_dim;
            float x = 0.0f;
            for (int64_t d = 0; d < head_dim; d++) x += qr[d] * LOAD(k + d);
            scores[r * score_row + j] = x;
        }
    }
}

/* acc[r] += sum_j p[r][j] * v_j over the block's first n_slots values. */
static inline __attribute__((always_inline)) void NAME(block_values)(
    float *acc, int64_t nv, const T *vb, int64_t key_row, int64_t n_slots,
    const int64_t head_dim, const float *p, int64_t p_row) {
#if HAVE_AVX2
    if (head_dim % 8 == 0) {
        /* 64 columns at a time, and as many query vectors as keep eight independent
         * accumulators in registers (one chain per vector would wait on each FMA). Rows
         * past nv (up to a multiple of the group) are the caller's zeroed spares. */
        for (int64_t c0 = 0; c0 < head_dim; c0 += 64) {
            const int64_t lanes = head_dim - c0 < 64 ? (head_dim - c0) / 8 : 8;
            const int64_t group = 8 / lanes;
            for (int64_t r0 = 0; r0 < nv; r0 += group) {
                __m256 a[8];
                for (int64_t g = 0; g < group; g++)
                    for (int64_t c = 0; c < lanes; c++)
                        a[g * lanes + c] = _mm256_loadu_ps(acc + (r0 + g) * head_dim + c0 + 8 * c);
                for (int64_t j = 0; j < n_slots; j++) {
                    const T *v = vb + j * key_row + c0;
                    __m256 vv[8];
                    for (int64_t c = 0; c < lanes; c++) vv[c] = LOAD8(v + 8 * c);
                    for (int64_t g = 0; g < group; g++) {
                        const __m256 w = _mm256_set1_ps(p[(r0 + g) * p_row + j]);
                        for (int64_t c = 0; c < lanes; c++)
                            a[g * lanes + c] = _mm256_fmadd_ps(w, vv[c], a[g * lanes + c]);
                    }
                }
                for (int64_t g = 0; g < group; g++)
                    for (int64_t c = 0; c < lanes; c++)
                        _mm256_storeu_ps(acc + (r0 + g) * head_dim + c0 + 8 * c, a[g * lanes + c]);
            }
        }
        return;
    }
#endif
    for (int64_t j = 0; j < n_slots; j++) {
        const T *v = vb + j * key_row;
        for (int64_t r = 0; r < nv; r++) {
            const float w = p[r * p_row + j];
            for (int64_t d = 0; d < head_dim; d++) acc[r * head_dim + d] += w * LOAD(v + d);
        }
    }
}

/* A block's scores soft-capped and masked, then turned into the online softmax's weights
 * (scores[r][j] = exp(score - running max)), the running sums and accumulators rescaled. */
static inline __attribute__((always_inline)) void NAME(mask_and_weigh)(
    float *scores_buf, float *acc_buf, float *run_max, float *run_sum, const int64_t *row_pos,
    int64_t nv, int64_t base, int64_t n_slots, int64_t low_pos, int64_t hi,
    const int64_t head_dim, int64_t block_size, int64_t window, float softcap) {
    float(*scores)[block_size] = (float(*)[block_size])scores_buf;
    float(*acc)[head_dim] = (float(*)[head_dim])acc_buf;
    if (softcap > 0.0f)
        for (int64_t r = 0; r < nv; r++)
            for (int64_t j = 0; j < n_slots; j++)
                scores[r][j] = softcap * tanhf(scores[r][j] / softcap);
    /* Only a block past the lowest row's position, or (windowed) reaching below the
     * highest row's window, has keys some row must not see. */
    if (base + n_slots - 1 > low_pos || (window > 0 && base <= hi - window))
        for (int64_t r = 0; r < nv; r++)
            for (int64_t j = 0; j < n_slots; j++) {
                const int64_t key = base + j;
                if (key > row_pos[r] || (window > 0 && key <= row_pos[r] - window))
                    scores[r][j] = -INFINITY;
            }
    for (int64_t r = 0; r < nv; r++) {
        const float top = block_max(scores[r], n_slots);
        if (top == -INFINITY) {
            for (int64_t j = 0; j < n_slots; j++) scores[r][j] = 0.0f;
            continue;
        }
        const float alpha = raise_max(&run_max[r], top);
        const float total = exp_shifted(scores[r], n_slots, run_max[r]);
        run_sum[r] = run_sum[r] * alpha + total;
        if (alpha != 1.0f)
            for (int64_t d = 0; d < head_dim; d++) acc[r][d] *= alpha;
    }
}

/* One sequence's query vectors v0 .. v0 + nv of KV head kv; head_dim is a constant in
 * the specialised copies below (the compiler then unrolls the head_dim loops). */
static inline __attribute__((always_inline)) void NAME(attend_vectors)(
    const T *q, int64_t q_tok, int64_t q_head, const T *key_cache,
    const T *value_cache, T *out, int64_t o_tok, int64_t o_head, const int32_t *table,
    int64_t q0, int64_t first_pos, int64_t per_kv, int64_t kv, int64_t v0, int64_t nv,
    int64_t key_row, int64_t block_stride, const int64_t head_dim, int64_t block_size,
    float scale, int64_t window, float softcap, const Q8 *q8) {
    float qv_buf[MAX_VECTORS * head_dim], acc_buf[MAX_VECTORS * head_dim];
    float scores_buf[MAX_VECTORS * block_size];
    float(*qv)[head_dim] = (float(*)[head_dim])qv_buf;
    float(*acc)[head_dim] = (float(*)[head_dim])acc_buf;
    float run_max[MAX_VECTORS], run_sum[MAX_VECTORS];
    int64_t row_pos[MAX_VECTORS];
    /* Rows grow with the vectors: the first has the lowest position, the last the highest. */
    const int64_t low_pos = first_pos + v0 / per_kv, hi = first_pos + (v0 + nv - 1) / per_kv;
    const int64_t lo = window > 0 && low_pos - window + 1 > 0 ? low_pos - window + 1 : 0;
    /* Spare rows past nv too: block_values may run them (zero weights into zero sums). */
    memset(acc_buf, 0, sizeof(acc_buf));
    memset(scores_buf, 0, sizeof(scores_buf));
    for (int64_t r = 0; r < nv; r++) {
        const int64_t vec = v0 + r, row = vec / per_kv;
        const int64_t head = kv * per_kv + vec % per_kv;
        const T *src = q + (q0 + row) * q_tok + head * q_head;
        for (int64_t d = 0; d < head_dim; d++) qv[r][d] = LOAD(src + d) * scale;
        run_max[r] = -INFINITY;
        run_sum[r] = 0.0f;
        row_pos[r] = first_pos + row;
    }
    for (int64_t b = lo / block_size; b * block_size <= hi; b++) {
        const int64_t base = b * block_size;
        const int64_t n_slots = hi + 1 - base < block_size ? hi + 1 - base : block_size;
        const int64_t block = table[b];
        if (q8) { /* a quantized cache: the block's rows of this KV head as floats */
            const int64_t codes = block * q8->block_stride + kv * head_dim;
            const int64_t scales = block * q8->scale_stride + kv;
            const int64_t heads = key_row / head_dim;
            float kf[block_size * head_dim], vf[block_size * head_dim];
            dequantize_rows(kf, q8->keys + codes, q8->key_scales + scales, n_slots, key_row,
                            heads, head_dim);
            dequantize_rows(vf, q8->values + codes, q8->value_scales + scales, n_slots,
                            key_row, heads, head_dim);
            block_scores_f32(qv_buf, nv, kf, head_dim, n_slots, head_dim, scores_buf,
                             block_size);
            NAME(mask_and_weigh)(scores_buf, acc_buf, run_max, run_sum, row_pos, nv, base,
                                 n_slots, low_pos, hi, head_dim, block_size, window, softcap);
            block_values_f32(acc_buf, nv, vf, head_dim, n_slots, head_dim, scores_buf,
                             block_size);
            continue;
        }
        const T *kb = key_cache + block * block_stride + kv * head_dim;
        const T *vb = value_cache + block * block_stride + kv * head_dim;
        if ((b + 1) * block_size <= hi) { /* the next block is a jump: fetch it early */
            const int64_t next = table[b + 1] * block_stride + kv * head_dim;
            for (int64_t j = 0; j < block_size; j++) {
                __builtin_prefetch(key_cache + next + j * key_row);
                __builtin_prefetch(value_cache + next + j * key_row);
            }
        }
        NAME(block_scores)(qv_buf, nv, kb, key_row, n_slots, head_dim, scores_buf, block_size);
        NAME(mask_and_weigh)(scores_buf, acc_buf, run_max, run_sum, row_pos, nv, base, n_slots,
                             low_pos, hi, head_dim, block_size, window, softcap);
        NAME(block_values)(acc_buf, nv, vb, key_row, n_slots, head_dim, scores_buf, block_size);
    }
    for (int64_t r = 0; r < nv; r++) {
        const int64_t vec = v0 + r, row = vec / per_kv;
        const int64_t head = kv * per_kv + vec % per_kv;
        T *dst = out + (q0 + row) * o_tok + head * o_head;
        const float inv = run_sum[r] > 0.0f ? 1.0f / run_sum[r] : 0.0f;
        for (int64_t d = 0; d < head_dim; d++) dst[d] = STORE(acc[r][d] * inv);
    }
}

#if HAVE_AVX512
/* The same attention with keys in tiles of 16 slots (block_size a multiple of 16) and
 * sixteen-lane registers: a vector's 16 scores of a tile are one register (its mask, max,
 * exponentials and sum too), each key and value row is loaded once per tile for G
 * vectors at a time, and in bf16 the scores are vdpbf16ps dot products of the raw bf16
 * query and key pairs (the scale applied to the sums). */
#if DOT_BF16
#define QLANES 32
#define QREG __m512bh
#else
#define QLANES 16
#define QREG __m512
#endif

/* acc[g] += sum_j p[g][j] * v_j over the tile's first n slots, for G vectors. */
static inline __attribute__((always_inline)) void NAME(tile_values)(
    float *acc, const float *p, const T *vb, int64_t key_row, int64_t n, const int64_t head_dim,
    const int G) {
    for (int64_t c0 = 0; c0 < head_dim; c0 += 64) {
        const int64_t lanes = head_dim - c0 < 64 ? (head_dim - c0) / 16 : 4;
        __m512 a[4][4], vv[4];
        for (int g = 0; g < G; g++)
            for (int64_t c = 0; c < lanes; c++)
                a[g][c] = _mm512_loadu_ps(acc + g * head_dim + c0 + 16 * c);
        for (int64_t j = 0; j < n; j++) {
            for (int64_t c = 0; c < lanes; c++) vv[c] = LOAD16(vb + j * key_row + c0 + 16 * c);
            for (int g = 0; g < G; g++) {
                const __m512 w = _mm512_set1_ps(p[g * 16 + j]);
                for (int64_t c = 0; c < lanes; c++) a[g][c] = _mm512_fmadd_ps(w, vv[c], a[g][c]);
            }
        }
        for (int g = 0; g < G; g++)
            for (int64_t c = 0; c < lanes; c++)
                _mm512_storeu_ps(acc + g * head_dim + c0 + 16 * c, a[g][c]);
    }
}

static inline __attribute__((always_inline)) void NAME(attend_tiles)(
    const T *q, int64_t q_tok, int64_t q_head, const T *key_cache, const T *value_cache,
    T *out, int64_t o_tok, int64_t o_head, const int32_t *table, int64_t q0,
    int64_t first_pos, int64_t per_kv, int64_t kv0, int64_t n_kv, int64_t v0, int64_t nv,
    int64_t key_row, int64_t block_stride, const int64_t head_dim, int64_t block_size,
    float scale, int64_t window) {
    /* Vectors v0 .. v0 + nv of each of KV heads kv0 .. kv0 + n_kv, the heads' state side by
     * side so that a tile's rows are read whole, once. */
    QREG qv[n_kv][nv][head_dim / QLANES];
    float acc[n_kv][nv][head_dim], p[n_kv][nv][16], run_max[n_kv][nv], run_sum[n_kv][nv];
    int32_t row_pos[MAX_VECTORS];
    const int64_t low_pos = first_pos + v0 / per_kv, hi = first_pos + (v0 + nv - 1) / per_kv;
    const int64_t lo = window > 0 && low_pos - window + 1 > 0 ? low_pos - window + 1 : 0;
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const int64_t lines = n_kv * head_dim * (int64_t)sizeof(T); /* bytes of a slot's heads */
    for (int64_t r = 0; r < nv; r++) row_pos[r] = (int32_t)(first_pos + (v0 + r) / per_kv);
    for (int64_t h = 0; h < n_kv; h++)
        for (int64_t r = 0; r < nv; r++) {
            const int64_t vec = v0 + r, row = vec / per_kv;
            const T *src = q + (q0 + row) * q_tok + ((kv0 + h) * per_kv + vec % per_kv) * q_head;
            for (int64_t c = 0; c < head_dim / QLANES; c++)
#if DOT_BF16
                memcpy(&qv[h][r][c], src + QLANES * c, sizeof qv[h][r][c]);
#else
                qv[h][r][c] = _mm512_mul_ps(LOAD16(src + QLANES * c), _mm512_set1_ps(scale));
#endif
            memset(acc[h][r], 0, sizeof acc[h][r]);
            run_max[h][r] = -INFINITY;
            run_sum[h][r] = 0.0f;
        }
    for (int64_t base = lo / 16 * 16; base <= hi; base += 16) {
        const int64_t n = hi + 1 - base < 16 ? hi + 1 - base : 16;
        const int64_t at = table[base / block_size] * block_stride + base % block_size * key_row +
                           kv0 * head_dim;
        if (base + 16 <= hi) { /* fetch the next tile early: it may be in another block */
            const int64_t next = base + 16;
            const int64_t at2 = table[next / block_size] * block_stride +
                                next % block_size * key_row + kv0 * head_dim;
            for (int64_t j = 0; j < 16; j++)
                for (int64_t b = 0; b < lines; b += 64) {
                    __builtin_prefetch((const char *)(key_cache + at2 + j * key_row) + b);
                    __builtin_prefetch((const char *)(value_cache + at2 + j * key_row) + b);
                }
        }
        const __m512i keys = _mm512_add_epi32(_mm512_set1_epi32((int32_t)base), iota);
        for (int64_t h = 0; h < n_kv; h++) {
            const T *kb = key_cache + at + h * head_dim, *vb = value_cache + at + h * head_dim;
            for (int64_t r = 0; r < nv; r++) {
                __mmask16 seen = _mm512_cmple_epi32_mask(keys, _mm512_set1_epi32(row_pos[r]));
                if (window > 0)
                    seen &= _mm512_cmpgt_epi32_mask(
                        keys, _mm512_set1_epi32(row_pos[r] - (int32_t)window));
                if (!seen) { /* keys of later rows, or below the row's window */
                    memset(p[h][r], 0, sizeof p[h][r]);
                    continue;
                }
                __m512 a[16];
                for (int j = 0; j < 16; j++) { /* slots past n: in the block, masked below */
                    const T *k = kb + j * key_row;
                    __m512 s = _mm512_setzero_ps();
                    for (int64_t c = 0; c < head_dim / QLANES; c++) {
#if DOT_BF16
                        __m512bh kk;
                        memcpy(&kk, k + QLANES * c, sizeof kk);
                        s = _mm512_dpbf16_ps(s, qv[h][r][c], kk);
#else
                        s = _mm512_fmadd_ps(qv[h][r][c], LOAD16(k + QLANES * c), s);
#endif
                    }
                    a[TILE_SLOT[j]] = s;
                }
                __m512 scores = sum16(a);
#if DOT_BF16
                scores = _mm512_mul_ps(scores, _mm512_set1_ps(scale));
#endif
                const float top = _mm512_mask_reduce_max_ps(seen, scores);
                const float alpha = raise_max(&run_max[h][r], top);
                const __m512 max = _mm512_set1_ps(run_max[h][r]);
                const __m512 shifted = _mm512_maskz_sub_ps(seen, scores, max);
                const __m512 e = _mm512_maskz_mov_ps(seen, exp16(shifted));
                run_sum[h][r] = run_sum[h][r] * alpha + _mm512_reduce_add_ps(e);
                _mm512_storeu_ps(p[h][r], e);
                if (alpha != 1.0f)
                    for (int64_t d = 0; d < head_dim; d++) acc[h][r][d] *= alpha;
            }
            for (int64_t r0 = 0; r0 < nv; r0 += 4) {
                float *a0 = acc[h][r0];
                const float *p0 = p[h][r0];
                switch (nv - r0 < 4 ? nv - r0 : 4) {
                case 1: NAME(tile_values)(a0, p0, vb, key_row, n, head_dim, 1); break;
                case 2: NAME(tile_values)(a0, p0, vb, key_row, n, head_dim, 2); break;
                case 3: NAME(tile_values)(a0, p0, vb, key_row, n, head_dim, 3); break;
                default: NAME(tile_values)(a0, p0, vb, key_row, n, head_dim, 4); break;
                }
            }
        }
    }
    for (int64_t h = 0; h < n_kv; h++)
        for (int64_t r = 0; r < nv; r++) {
            const int64_t vec = v0 + r, row = vec / per_kv;
            T *dst = out + (q0 + row) * o_tok + ((kv0 + h) * per_kv + vec % per_kv) * o_head;
            const float inv = run_sum[h][r] > 0.0f ? 1.0f / run_sum[h][r] : 0.0f;
            for (int64_t d = 0; d < head_dim; d++) dst[d] = STORE(acc[h][r][d] * inv);
        }
}
#undef QLANES
#undef QREG
#define TILES(D)                                                                             \
    NAME(attend_tiles)(q, q_tok, q_head, key_cache, value_cache, out, o_tok, o_head, table, q0, \
                       first_pos, per_kv, kv0, n_kv, v0, nv, key_row, block_stride, D,          \
                       block_size, scale, window)
#endif

#define ATTEND(D)                                                                            \
    NAME(attend_vectors)(q, q_tok, q_head, key_cache, value_cache, out, o_tok, o_head, table, q0,  \
                   first_pos, per_kv, kv, v0, nv, key_row, block_stride, D, block_size, scale, \
                   window, softcap, q8)

static int NAME(paged_attention)(
    const T *q, int64_t q_tok, int64_t q_head,
    const T *key_cache, const T *value_cache, int64_t block_stride,
    T *out, int64_t o_tok, int64_t o_head,
    const int32_t *tables, int64_t table_stride,
    const int32_t *seq_lens, const int32_t *query_start_loc, const int64_t *seqs,
    int64_t n_seqs, int64_t num_heads, int64_t block_size, int64_t num_kv_heads, int64_t head_dim,
    float scale, int64_t window, float softcap, int tiles, const Q8 *q8) {
    if (head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK || num_kv_heads <= 0 ||
        num_heads % num_kv_heads != 0)
        return -1;
    const int64_t per_kv = num_heads / num_kv_heads;
    const int64_t key_row = num_kv_heads * head_dim; /* floats between two slots */
    /* Sequences spread over the process's OpenMP threads (torch's own pool: see
     * native_backend.py), taken one at a time as each thread finishes its last. */
#pragma omp parallel for schedule(dynamic, 1) if (n_seqs > 1)
    for (int64_t si = 0; si < n_seqs; si++) {
        const int64_t s = seqs[si];
        const int64_t q0 = query_start_loc[s];
        const int64_t n_rows = (int64_t)query_start_loc[s + 1] - q0;
        const int64_t n_keys = seq_lens[s];
        if (n_rows <= 0 || n_keys <= 0) continue;
        const int32_t *table = tables + s * table_stride;
        const int64_t first_pos = n_keys - n_rows;
        const int64_t n_vectors = n_rows * per_kv;
#if HAVE_AVX512
        if (tiles && !q8 && softcap <= 0.0f && block_size % 16 == 0 && head_dim % 32 == 0) {
            for (int64_t v0 = 0; v0 < n_vectors; v0 += MAX_VECTORS)
                for (int64_t kv0 = 0; kv0 < num_kv_heads; kv0 += TILE_KV_HEADS) {
                    const int64_t nv = n_vectors - v0 < MAX_VECTORS ? n_vectors - v0 : MAX_VECTORS;
                    const int64_t left = num_kv_heads - kv0;
                    const int64_t n_kv = left < TILE_KV_HEADS ? left : TILE_KV_HEADS;
                    switch (head_dim) {
                    case 64: TILES(64); break;
                    case 128: TILES(128); break;
                    default: TILES(head_dim); break;
                    }
                }
            continue;
        }
#endif
        for (int64_t kv = 0; kv < num_kv_heads; kv++)
            for (int64_t v0 = 0; v0 < n_vectors; v0 += MAX_VECTORS) {
                const int64_t nv = n_vectors - v0 < MAX_VECTORS ? n_vectors - v0 : MAX_VECTORS;
                switch (head_dim) {
                case 16: ATTEND(16); break;
                case 32: ATTEND(32); break;
                case 64: ATTEND(64); break;
                case 128: ATTEND(128); break;
                default: ATTEND(head_dim); break;
                }
            }
    }
    return 0;
}

int NAME(expeditor_paged_attention)(
    const T *q, int64_t q_tok, int64_t q_head,
    const T *key_cache, const T *value_cache, int64_t block_stride,
    T *out, int64_t o_tok, int64_t o_head,
    const int32_t *tables, int64_t table_stride,
    const int32_t *seq_lens, const int32_t *query_start_loc, const int64_t *seqs,
    int64_t n_seqs, int64_t num_heads, int64_t block_size, int64_t num_kv_heads, int64_t head_dim,
    float scale, int64_t window, float softcap, int tiles) {
    return NAME(paged_attention)(q, q_tok, q_head, key_cache, value_cache, block_stride, out,
                                 o_tok, o_head, tables, table_stride, seq_lens, query_start_loc,
                                 seqs, n_seqs, num_heads, block_size, num_kv_heads, head_dim,
                                 scale, window, softcap, tiles, 0);
}

/* The same over an int8 cache (Q8's layout): each block's rows of a KV head are
 * dequantized into float32 once per query group, then attended as a float32 cache is. */
int NAME(expeditor_paged_attention_q8)(
    const T *q, int64_t q_tok, int64_t q_head,
    const int8_t *key_codes, const int8_t *value_codes, int64_t code_stride,
    const uint16_t *key_scales, const uint16_t *value_scales, int64_t scale_stride,
    T *out, int64_t o_tok, int64_t o_head,
    const int32_t *tables, int64_t table_stride,
    const int32_t *seq_lens, const int32_t *query_start_loc, const int64_t *seqs,
    int64_t n_seqs, int64_t num_heads, int64_t block_size, int64_t num_kv_heads, int64_t head_dim,
    float scale, int64_t window, float softcap) {
    const Q8 q8 = {key_codes, value_codes, key_scales, value_scales, code_stride, scale_stride};
    return NAME(paged_attention)(q, q_tok, q_head, 0, 0, 0, out, o_tok, o_head, tables,
                                 table_stride, seq_lens, query_start_loc, seqs, n_seqs,
                                 num_heads, block_size, num_kv_heads, head_dim, scale, window,
                                 softcap, 0, &q8);
}

/* Each token's new key and value rows into slot block * block_size + offset (< 0: none). */
void NAME(expeditor_store_kv)(const T *k, int64_t k_tok, int64_t k_head, const T *v,
                            int64_t v_tok, int64_t v_head, T *key_cache,
                            T *value_cache, int64_t block_stride, const int64_t *slots,
                            int64_t n_tokens, int64_t block_size, int64_t num_kv_heads,
                            int64_t head_dim) {
    const int64_t key_row = num_kv_heads * head_dim;
    for (int64_t t = 0; t < n_tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        const int64_t at = slot / block_size * block_stride + slot % block_size * key_row;
        for (int64_t h = 0; h < num_kv_heads; h++) {
            memcpy(key_cache + at + h * head_dim, k + t * k_tok + h * k_head,
                   sizeof(T) * head_dim);
            memcpy(value_cache + at + h * head_dim, v + t * v_tok + h * v_head,
                   sizeof(T) * head_dim);
        }
    }
}

#undef ATTEND
#undef TILES
#endif /* T */
