/* Paged attention for the native CPU backend (gpu_worker/attention/native_backend.py;
 * docs/architecture.md, "Attention", has the design). The caller has checked every index.
 *
 * q[t, h, d] sits at q + t * q_tok + h * q_head + d, out likewise; the caches [blocks,
 * block_size, kv_heads, head_dim] block_stride elements apart, contiguous in a block (an
 * int8 cache: codes, and a float16 scale per row [blocks, block_size, kv_heads]
 * scale_stride apart); tables[s, j] int32, table_stride apart; seqs int64.
 *
 * The code after the prelude is over an element type T, compiled twice (the file includes
 * itself): float (*_f32) and uint16_t holding bfloat16 (*_bf16: loads widen, stores round
 * to nearest even). */
#ifndef T
#include "cpu_vectors.h"
#if defined(__AVX512BF16__)
#define HAVE_AVX512BF16 1
#else
#define HAVE_AVX512BF16 0
#endif

/* The machine's own vector (NL floats), for the value sums' broadcasts: lowered to
 * half-width registers, a 16-float one is assembled in memory. */
#define NL (HAVE_AVX512 ? 16 : HAVE_AVX2 ? 8 : 4)
typedef float vn __attribute__((vector_size(4 * NL)));

#define MAX_VECTORS 16  /* query vectors of a KV head attended together */
#define TILE_KV_HEADS 8 /* KV heads attended together */
#define MAX_HEAD_DIM 256
/* Value columns (NL-float vectors) and query vectors accumulated at once: as many as
 * keep the accumulators in registers (32 of AVX-512's, 16 of AVX2's). */
#define VALUE_COLS 4
#define VALUE_VECTORS (HAVE_AVX512 ? 4 : 2)

static const v16 IOTA = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

/* Lane j: the sum of a[TILE_SLOT[j]]'s lanes. The four levels halve the lanes with
 * shuffles that are single instructions (vshuff32x4 across 128-bit lanes, vshufps
 * within), leaving the sums in this order. */
static const int TILE_SLOT[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

INLINE v16 sum16(const v16 *a) {
    v16 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)
        b[i] = SHUFFLE(a[i], a[i + 8], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               SHUFFLE(a[i], a[i + 8], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        c[i] = SHUFFLE(b[i], b[i + 4], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               SHUFFLE(b[i], b[i + 4], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        d[i] = SHUFFLE(c[i], c[i + 2], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
               SHUFFLE(c[i], c[i + 2], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    return SHUFFLE(d[0], d[1], 0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30) +
           SHUFFLE(d[0], d[1], 1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29, 31);
}

/* The sum of x's lanes (halving them each step), and their maximum. */
INLINE float hsum(v16 x) {
    v8 y = SHUFFLE(x, x, 0, 1, 2, 3, 4, 5, 6, 7) + SHUFFLE(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 z = SHUFFLE(y, y, 0, 1, 2, 3) + SHUFFLE(y, y, 4, 5, 6, 7);
    z = z + SHUFFLE(z, z, 2, 3, 0, 1);
    return (z + SHUFFLE(z, z, 1, 0, 3, 2))[0];
}
#define VMAX(a, b) /* a > b ? a : b lane by lane (maxps' rule), any width */             \
    ({ const __typeof__(a) a_ = (a), b_ = (b); const __typeof__(a_ > b_) m_ = a_ > b_; \
       (__typeof__(a_))((m_ & (__typeof__(m_))a_) | (~m_ & (__typeof__(m_))b_)); })
INLINE float hmax(v16 x) {
#if HAVE_AVX512
    return _mm512_reduce_max_ps((__m512)x);
#else
    v8 y = VMAX(SHUFFLE(x, x, 0, 1, 2, 3, 4, 5, 6, 7), SHUFFLE(x, x, 8, 9, 10, 11, 12, 13, 14, 15));
    v4 z = VMAX(SHUFFLE(y, y, 0, 1, 2, 3), SHUFFLE(y, y, 4, 5, 6, 7));
    z = VMAX(z, SHUFFLE(z, z, 2, 3, 0, 1));
    return VMAX(z, SHUFFLE(z, z, 1, 0, 3, 2))[0];
#endif
}

/* The online softmax's step: a row's running max raised to include top (finite); returns
 * the factor its running sums take (0 for the first keys, 1 when the max holds). */
INLINE float raise_max(float *run_max, float top) {
    const float old = *run_max;
    if (top <= old) return 1.0f;
    *run_max = top;
    return old == -INFINITY ? 0.0f : expf(old - top);
}

/* float16 -> float32 (an int8 cache's scales; subnormals included). */
INLINE float f16_to_f32(uint16_t h) {
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

/* The first n (<= the vector's lanes) elements at p as float32 lanes, the rest zero
 * (load_bf16, in cpu_vectors.h, for 16 bfloat16), and a float32 as T. */
typedef uint16_t vnh __attribute__((vector_size(2 * NL)));
typedef uint32_t vnu __attribute__((vector_size(4 * NL)));
INLINE v16 load_f32(const float *p, int64_t n) {
    v16 x = {0};
    memcpy(&x, p, sizeof(float) * (n == 16 ? 16 : n)); /* whole: one load */
    return x;
}
INLINE vn loadn_f32(const float *p, int64_t n) {
    vn x = {0};
    memcpy(&x, p, sizeof(float) * (n == NL ? NL : n));
    return x;
}
INLINE vn loadn_bf16(const uint16_t *p, int64_t n) {
    vnh h = {0};
    memcpy(&h, p, sizeof(uint16_t) * (n == NL ? NL : n));
#if NL == 16
    return widen16(h);
#elif NL == 8
    return widen8(h);
#else
    return (vn)(__builtin_convertvector(h, vnu) << 16);
#endif
}
INLINE float to_f32(float x) { return x; }
#define to_bf16 f32_to_bf16
#define LOAD(p, n) NAME(load)(p, n)
#define LOADN(p, n) NAME(loadn)(p, n)
#define STORE(x) NAME(to)(x)

/* What this build targets (native_backend.FEATURES names the bits). */
int expeditor_kernel_features(void) {
    return HAVE_AVX2 | HAVE_AVX512 << 1 | HAVE_AVX512BF16 << 2 | HAVE_OPENMP << 3;
}

/* The threads a call may use (OpenMP's: torch's pool, sized by torch.set_num_threads). */
int expeditor_kernel_threads(void) {
#if HAVE_OPENMP
    return omp_get_max_threads();
#endif
    return 1;
}

#define T float
#define NAME(x) x##_f32
#define DOT_BF16 0
#include __FILE__
#undef T
#undef NAME
#undef DOT_BF16
#define T uint16_t
#define NAME(x) x##_bf16
#define DOT_BF16 HAVE_AVX512BF16
#include __FILE__

#else /* the code over T */

typedef struct {
    const T *q;
    const void *keys, *values; /* T, or int8 codes with key_scales */
    const uint16_t *key_scales, *value_scales;
    T *out;
    const int32_t *tables, *seq_lens, *starts;
    int64_t q_tok, q_head, o_tok, o_head, block_stride, scale_stride, table_stride;
    int64_t block_size, num_kv_heads, per_kv, key_row, window;
    float scale, softcap;
} NAME(Args);

/* Where the key and value rows of KV heads kv0 .. kv0 + n_kv of positions base .. base +
 * n sit: in the cache, or (an int8 cache) dequantized into kbuf and vbuf, as the torch
 * backend dequantizes them (float32 products, rounded to T). */
INLINE void NAME(tile_rows)(
    const NAME(Args) *a, const int32_t *table, int64_t base, int64_t n, int64_t kv0,
    int64_t n_kv, const int64_t head_dim, const T **krow, const T **vrow, T *kbuf, T *vbuf) {
    int64_t b = base / a->block_size, off = base % a->block_size;
    for (int64_t j = 0; j < n; j++, off++) {
        if (off == a->block_size) b++, off = 0;
        const int64_t at = table[b] * a->block_stride + off * a->key_row + kv0 * head_dim;
        krow[j] = (const T *)a->keys + at, vrow[j] = (const T *)a->values + at;
        if (!a->key_scales) continue;
        const int64_t sc = table[b] * a->scale_stride + off * a->num_kv_heads + kv0;
        const int8_t *kc = (const int8_t *)a->keys + at, *vc = (const int8_t *)a->values + at;
        T *kd = kbuf + j * n_kv * head_dim, *vd = vbuf + j * n_kv * head_dim;
        for (int64_t h = 0; h < n_kv; h++) {
            const float ks = f16_to_f32(a->key_scales[sc + h]);
            const float vs = f16_to_f32(a->value_scales[sc + h]);
            for (int64_t d = h * head_dim; d < (h + 1) * head_dim; d++) {
                kd[d] = STORE((float)kc[d] * ks);
                vd[d] = STORE((float)vc[d] * vs);
            }
        }
        krow[j] = kd, vrow[j] = vd;
    }
    for (int64_t j = n; j < 16; j++) krow[j] = krow[n - 1], vrow[j] = vrow[n - 1];
}

/* One key row's 16-lane partial dot product with a query vector (its lanes' sum is the
 * score): float32 FMAs over the scaled query, or bf16 pairs over the raw one (dot). */
INLINE v16 NAME(partial_dot)(const v16 *qv, const T *k, const int64_t head_dim, const int dot) {
    v16 s = {0};
    (void)dot;
#if DOT_BF16
    if (dot) {
        for (int64_t c = 0; c < head_dim / 32; c++) {
            v16 kk;
            memcpy(&kk, k + 32 * c, sizeof kk);
            s = (v16)_mm512_dpbf16_ps((__m512)s, (__m512bh)qv[c], (__m512bh)kk);
        }
        return s;
    }
#endif
    for (int64_t c = 0; c < (head_dim + 15) / 16; c++)
        s += qv[c] * LOAD(k + 16 * c, MIN(head_dim - 16 * c, 16));
    return s;
}

/* acc[g] += sum_j p[g][j] * v_j over the tile's first n rows, for G vectors (acc rows
 * stride floats apart, p rows 16), in the machine's own vectors. */
INLINE void NAME(tile_values)(float *acc, int64_t stride, const float *p, const T *const *vrow,
                              int64_t n, const int64_t head_dim, const int G) {
    const int64_t chunks = (head_dim + NL - 1) / NL;
    for (int64_t c0 = 0; c0 < chunks; c0 += VALUE_COLS) {
        const int64_t cols = MIN(chunks - c0, VALUE_COLS);
        vn acc_v[VALUE_VECTORS][VALUE_COLS], vv[VALUE_COLS];
        for (int g = 0; g < G; g++)
            for (int64_t c = 0; c < cols; c++)
                memcpy(&acc_v[g][c], acc + g * stride + NL * (c0 + c), sizeof(vn));
        for (int64_t j = 0; j < n; j++) {
            for (int64_t c = 0; c < cols; c++)
                vv[c] = LOADN(vrow[j] + NL * (c0 + c), MIN(head_dim - NL * (c0 + c), NL));
            for (int g = 0; g < G; g++)
                for (int64_t c = 0; c < cols; c++) acc_v[g][c] += p[g * 16 + j] * vv[c];
        }
        for (int g = 0; g < G; g++)
            for (int64_t c = 0; c < cols; c++)
                memcpy(acc + g * stride + NL * (c0 + c), &acc_v[g][c], sizeof(vn));
    }
}

/* Vectors v0 .. v0 + nv of KV heads kv0 .. kv0 + n_kv of one sequence (rows grow with the
 * vectors: the first has the lowest position, the last the highest); head_dim is a
 * constant in the specialised copies below (the compiler then unrolls its loops). */
INLINE void NAME(attend_tiles)(
    const NAME(Args) *a, const int32_t *table, int64_t q0, int64_t first_pos, int64_t kv0,
    int64_t n_kv, int64_t v0, int64_t nv, const int64_t head_dim) {
    const int64_t per_kv = a->per_kv, window = a->window, hp = (head_dim + 15) / 16 * 16;
    const int dot = DOT_BF16 && head_dim % 32 == 0, quantized = a->key_scales != 0;
    v16 qv[n_kv][nv][hp / 16];
    float acc[n_kv][nv][hp], p[n_kv][nv][16], run_max[n_kv][nv], run_sum[n_kv][nv];
    T kbuf[quantized ? 16 * n_kv * head_dim : 1], vbuf[quantized ? 16 * n_kv * head_dim : 1];
    const T *rows[2][2][16], *(*cur)[16] = rows[0], *(*next)[16] = rows[1]; /* keys, values */
    const int64_t low_pos = first_pos + v0 / per_kv, hi = first_pos + (v0 + nv - 1) / per_kv;
    const int64_t lo = window > 0 && low_pos - window + 1 > 0 ? low_pos - window + 1 : 0;
    for (int64_t h = 0; h < n_kv; h++)
        for (int64_t r = 0; r < nv; r++) {
            const int64_t vec = v0 + r, head = (kv0 + h) * per_kv + vec % per_kv;
            const T *src = a->q + (q0 + vec / per_kv) * a->q_tok + head * a->q_head;
            for (int64_t c = 0; dot && c < head_dim / 32; c++) /* raw bf16 pairs */
                memcpy(&qv[h][r][c], src + 32 * c, sizeof(v16));
            for (int64_t c = 0; !dot && c < hp / 16; c++)
                qv[h][r][c] = LOAD(src + 16 * c, MIN(head_dim - 16 * c, 16)) * splat(a->scale);
            memset(acc[h][r], 0, sizeof acc[h][r]);
            run_max[h][r] = -INFINITY;
            run_sum[h][r] = 0.0f;
        }
    int ready = 0; /* cur holds this tile's rows: the last tile fetched them early */
    for (int64_t base = lo / 16 * 16; base <= hi; base += 16) {
        const int64_t n = MIN(hi + 1 - base, 16);
        if (!ready)
            NAME(tile_rows)(a, table, base, n, kv0, n_kv, head_dim, cur[0], cur[1], kbuf, vbuf);
        const T **krow = cur[0], **vrow = cur[1], **next_k = next[0], **next_v = next[1];
        /* The next tile's rows, fetched early (an int8 cache's are dequantized later). */
        const int64_t m = quantized || base + 16 > hi ? 0 : MIN(hi - base - 15, 16);
        if (m) NAME(tile_rows)(a, table, base + 16, m, kv0, n_kv, head_dim, next_k, next_v, 0, 0);
        for (int64_t h = 0; h < n_kv; h++) {
            for (int64_t j = 0; j < m; j++) /* head h's lines, spread over the heads */
                for (int64_t b = 0; b < head_dim * (int64_t)sizeof(T); b += 64) {
                    __builtin_prefetch((const char *)(next_k[j] + h * head_dim) + b);
                    __builtin_prefetch((const char *)(next_v[j] + h * head_dim) + b);
                }
            for (int64_t r = 0; r < nv; r++) {
                /* The keys row r sees: a contiguous run of the tile's slots. */
                const int64_t pos = first_pos + (v0 + r) / per_kv;
                const int64_t last = MIN(pos - base, n - 1), from = pos - window + 1 - base;
                const int64_t first = window > 0 && from > 0 ? from : 0;
                if (last < first) { /* keys of later rows, or below the row's window */
                    memset(p[h][r], 0, sizeof p[h][r]);
                    continue;
                }
                v16 part[16]; /* rows past n repeat row n - 1, masked below */
#pragma GCC unroll 16
                for (int64_t j = 0; j < 16; j++)
                    part[TILE_SLOT[j]] =
                        NAME(partial_dot)(qv[h][r], krow[j] + h * head_dim, head_dim, dot);
                v16 s = sum16(part);
                if (dot) s *= splat(a->scale);
                if (a->softcap > 0.0f)
                    for (int j = 0; j < 16; j++) s[j] = a->softcap * tanhf(s[j] / a->softcap);
                s = select16((IOTA >= splat(first)) & (IOTA <= splat(last)), s, splat(-INFINITY));
                const float alpha = raise_max(&run_max[h][r], hmax(s));
                const v16 e = exp16(s - splat(run_max[h][r]));
                run_sum[h][r] = run_sum[h][r] * alpha + hsum(e);
                memcpy(p[h][r], &e, sizeof e);
                if (alpha != 1.0f)
                    for (int64_t d = 0; d < head_dim; d++) acc[h][r][d] *= alpha;
            }
            const T *vh[16];
            for (int64_t j = 0; j < n; j++) vh[j] = vrow[j] + h * head_dim;
            for (int64_t r0 = 0; r0 < nv; r0 += VALUE_VECTORS) {
                float *a0 = acc[h][r0];
                const float *p0 = p[h][r0];
                switch (nv - r0 < VALUE_VECTORS ? nv - r0 : VALUE_VECTORS) {
                case 1: NAME(tile_values)(a0, hp, p0, vh, n, head_dim, 1); break;
#if VALUE_VECTORS > 2
                case 2: NAME(tile_values)(a0, hp, p0, vh, n, head_dim, 2); break;
                case 3: NAME(tile_values)(a0, hp, p0, vh, n, head_dim, 3); break;
#endif
                default: NAME(tile_values)(a0, hp, p0, vh, n, head_dim, VALUE_VECTORS); break;
                }
            }
        }
        const T *(*swap)[16] = cur;
        cur = next, next = swap, ready = m > 0;
    }
    for (int64_t h = 0; h < n_kv; h++)
        for (int64_t r = 0; r < nv; r++) {
            const int64_t vec = v0 + r, head = (kv0 + h) * per_kv + vec % per_kv;
            T *dst = a->out + (q0 + vec / per_kv) * a->o_tok + head * a->o_head;
            const float inv = run_sum[h][r] > 0.0f ? 1.0f / run_sum[h][r] : 0.0f;
            for (int64_t d = 0; d < head_dim; d++) dst[d] = STORE(acc[h][r][d] * inv);
        }
}

#define TILES(D) NAME(attend_tiles)(&a, table, q0, first_pos, kv0, n_kv, v0, nv, D)

/* The new key and value rows (k, v, rows like q's; NULL for an int8 cache, whose codes
 * the caller stores) into slot block * block_size + offset (slots[t] < 0: none), then the
 * attention of the sequences seqs[0 .. n_seqs). Returns 0, or -1: shapes beyond it. */
int NAME(expeditor_paged_attention)(
    const T *q, int64_t q_tok, int64_t q_head, const T *k, int64_t k_tok, int64_t k_head,
    const T *v, int64_t v_tok, int64_t v_head, const int64_t *slots, int64_t n_tokens,
    void *key_cache, void *value_cache, int64_t block_stride,
    const uint16_t *key_scales, const uint16_t *value_scales, int64_t scale_stride,
    T *out, int64_t o_tok, int64_t o_head,
    const int32_t *tables, int64_t table_stride,
    const int32_t *seq_lens, const int32_t *query_start_loc, const int64_t *seqs,
    int64_t n_seqs, int64_t num_heads, int64_t block_size, int64_t num_kv_heads, int64_t head_dim,
    float scale, int64_t window, float softcap) {
    if (head_dim > MAX_HEAD_DIM || num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return -1;
    const int64_t key_row = num_kv_heads * head_dim;
    for (int64_t t = 0; k && t < n_tokens; t++) {
        const int64_t at = slots[t] / block_size * block_stride + slots[t] % block_size * key_row;
        for (int64_t h = 0; slots[t] >= 0 && h < num_kv_heads; h++) {
            T *kc = (T *)key_cache + at + h * head_dim, *vc = (T *)value_cache + at + h * head_dim;
            memcpy(kc, k + t * k_tok + h * k_head, sizeof(T) * head_dim);
            memcpy(vc, v + t * v_tok + h * v_head, sizeof(T) * head_dim);
        }
    }
    const NAME(Args) a = {
        q, key_cache, value_cache, key_scales, value_scales, out, tables, seq_lens,
        query_start_loc, q_tok, q_head, o_tok, o_head, block_stride, scale_stride,
        table_stride, block_size, num_kv_heads, num_heads / num_kv_heads,
        key_row, window, scale, softcap};
    /* Sequences spread over the process's OpenMP threads (torch's own pool), taken one at
     * a time as each thread finishes its last. */
#pragma omp parallel for schedule(dynamic, 1) if (n_seqs > 1)
    for (int64_t si = 0; si < n_seqs; si++) {
        const int64_t s = seqs[si], q0 = query_start_loc[s];
        const int64_t n_rows = (int64_t)query_start_loc[s + 1] - q0, n_keys = seq_lens[s];
        if (n_rows <= 0 || n_keys <= 0) continue;
        const int32_t *table = tables + s * table_stride;
        const int64_t first_pos = n_keys - n_rows, n_vectors = n_rows * a.per_kv;
        for (int64_t v0 = 0; v0 < n_vectors; v0 += MAX_VECTORS)
            for (int64_t kv0 = 0; kv0 < num_kv_heads; kv0 += TILE_KV_HEADS) {
                const int64_t nv = MIN(n_vectors - v0, MAX_VECTORS);
                const int64_t n_kv = MIN(num_kv_heads - kv0, TILE_KV_HEADS);
                switch (head_dim) {
                case 64: TILES(64); break;
                case 128: TILES(128); break;
                default: TILES(head_dim); break;
                }
            }
    }
    return 0;
}

#undef TILES
#endif /* T */
