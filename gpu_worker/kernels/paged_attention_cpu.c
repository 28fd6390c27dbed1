/* Paged attention for the CPU worker, straight from the block tables (float32).
 *
 * For each chosen sequence and KV head, the query vectors of that head's query heads
 * (every query row of the sequence times the heads per KV head) attend over the
 * sequence's keys block by block, reading each key and value row of the cache once for
 * all of them, with an online softmax: no gather into a contiguous copy, no padding, no
 * mask tensor. Query row i of a sequence with L keys after this step and n query rows
 * is at position L - n + i and sees the keys k with k <= position (causal) and, with a
 * window w > 0, position - w < k. With softcap c > 0 the scaled scores become
 * c * tanh(score / c).
 *
 * Layouts: q[t, h, d] at q + t * q_tok + h * q_head + d; out likewise (o_tok, o_head);
 * the caches [blocks, block_size, kv_heads, head_dim], block_stride floats from one block
 * to the next and contiguous within a block (a layer's view of the worker's cache);
 * tables[s, j] (int32,
 * table_stride apart) the j-th block of sequence s; seq_lens[s] and query_start_loc
 * (int32) as the step's metadata has them; seqs[0 .. n_seqs) the sequences to compute
 * (int64 indices into them; the other sequences' output rows are left as they are).
 *
 * The exponential is a polynomial the compiler vectorises (relative error about 2e-7,
 * like SDPA's vectorised exp); everything else is plain float arithmetic.
 * Returns 0, or -1 when the shapes are beyond the fixed scratch sizes below. The
 * caller checks the metadata (block ids, lengths) against the cache first.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_VECTORS 16   /* query vectors attended together */
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 256

/* exp(x) for x <= 0 (what a softmax needs after subtracting the max); 0 below -87. */
static inline float exp_nonpositive(float x) {
    const float below = x < -87.0f ? 0.0f : 1.0f;
    x = x < -87.0f ? -87.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union {
        int32_t i;
        float f;
    } scale;
    scale.i = ((int32_t)n + 127) << 23;
    return p * scale.f * below;
}

/* One sequence's query vectors v0 .. v0 + nv of KV head kv; head_dim is a constant in
 * the specialised copies below (the compiler then unrolls the head_dim loops). */
static inline __attribute__((always_inline)) void attend_vectors(
    const float *q, int64_t q_tok, int64_t q_head, const float *key_cache,
    const float *value_cache, float *out, int64_t o_tok, int64_t o_head, const int32_t *table,
    int64_t q0, int64_t first_pos, int64_t per_kv, int64_t kv, int64_t v0, int64_t nv,
    int64_t key_row, int64_t block_stride, const int64_t head_dim, int64_t block_size,
    float scale, int64_t window, float softcap) {
    /* Scratch sized to the shapes (rows head_dim apart, not MAX_HEAD_DIM: they stay in
     * a few cache lines). */
    float qv_buf[MAX_VECTORS * head_dim], acc_buf[MAX_VECTORS * head_dim];
    float scores_buf[MAX_VECTORS * block_size];
    float(*qv)[head_dim] = (float(*)[head_dim])qv_buf;
    float(*acc)[head_dim] = (float(*)[head_dim])acc_buf;
    float(*scores)[block_size] = (float(*)[block_size])scores_buf;
    float run_max[MAX_VECTORS], run_sum[MAX_VECTORS];
    int64_t row_pos[MAX_VECTORS];
    int64_t lo = INT64_MAX, hi = -1, low_pos = INT64_MAX;
    for (int64_t r = 0; r < nv; r++) {
        const int64_t vec = v0 + r, row = vec / per_kv;
        const int64_t head = kv * per_kv + vec % per_kv;
        const float *src = q + (q0 + row) * q_tok + head * q_head;
        for (int64_t d = 0; d < head_dim; d++) qv[r][d] = src[d] * scale;
        for (int64_t d = 0; d < head_dim; d++) acc[r][d] = 0.0f;
        run_max[r] = -INFINITY;
        run_sum[r] = 0.0f;
        row_pos[r] = first_pos + row;
        const int64_t from =
            window > 0 && row_pos[r] - window + 1 > 0 ? row_pos[r] - window + 1 : 0;
        if (from < lo) lo = from;
        if (row_pos[r] > hi) hi = row_pos[r];
        if (row_pos[r] < low_pos) low_pos = row_pos[r];
    }
    for (int64_t b = lo / block_size; b * block_size <= hi; b++) {
        const int64_t base = b * block_size;
        const int64_t n_slots = hi + 1 - base < block_size ? hi + 1 - base : block_size;
        const int64_t block = table[b];
        const float *kb = key_cache + block * block_stride + kv * head_dim;
        const float *vb = value_cache + block * block_stride + kv * head_dim;
        for (int64_t j = 0; j < n_slots; j++) {
            const float *k = kb + j * key_row;
            for (int64_t r = 0; r < nv; r++) {
                float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                int64_t d = 0;
                for (; d + 8 <= head_dim; d += 8)
                    for (int t = 0; t < 8; t++) lanes[t] += qv[r][d + t] * k[d + t];
                float x = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) +
                          ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
                for (; d < head_dim; d++) x += qv[r][d] * k[d];
                scores[r][j] = x;
            }
        }
        if (softcap > 0.0f)
            for (int64_t r = 0; r < nv; r++)
                for (int64_t j = 0; j < n_slots; j++)
                    scores[r][j] = softcap * tanhf(scores[r][j] / softcap);
        /* Only a block past the lowest row's position, or (windowed) reaching below
         * the highest row's window, has keys some row must not see. */
        if (base + n_slots - 1 > low_pos || (window > 0 && base <= hi - window))
            for (int64_t r = 0; r < nv; r++)
                for (int64_t j = 0; j < n_slots; j++) {
                    const int64_t key = base + j;
                    if (key > row_pos[r] || (window > 0 && key <= row_pos[r] - window))
                        scores[r][j] = -INFINITY;
                }
        for (int64_t r = 0; r < nv; r++) {
            float top = -INFINITY;
            for (int64_t j = 0; j < n_slots; j++) top = scores[r][j] > top ? scores[r][j] : top;
            if (top == -INFINITY) {
                for (int64_t j = 0; j < n_slots; j++) scores[r][j] = 0.0f;
                continue;
            }
            const float new_max = top > run_max[r] ? top : run_max[r];
            const float alpha =
                run_max[r] == -INFINITY ? 0.0f : exp_nonpositive(run_max[r] - new_max);
            run_max[r] = new_max;
            for (int64_t j = 0; j < n_slots; j++)
                scores[r][j] = exp_nonpositive(scores[r][j] - new_max);
            float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            int64_t j = 0;
            for (; j + 8 <= n_slots; j += 8)
                for (int t = 0; t < 8; t++) lanes[t] += scores[r][j + t];
            float total = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) +
                          ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
            for (; j < n_slots; j++) total += scores[r][j];
            run_sum[r] = run_sum[r] * alpha + total;
            if (alpha != 1.0f)
                for (int64_t d = 0; d < head_dim; d++) acc[r][d] *= alpha;
        }
        for (int64_t j = 0; j < n_slots; j++) {
            const float *v = vb + j * key_row;
            for (int64_t r = 0; r < nv; r++) {
                const float p = scores[r][j];
                for (int64_t d = 0; d < head_dim; d++) acc[r][d] += p * v[d];
            }
        }
    }
    for (int64_t r = 0; r < nv; r++) {
        const int64_t vec = v0 + r, row = vec / per_kv;
        const int64_t head = kv * per_kv + vec % per_kv;
        float *dst = out + (q0 + row) * o_tok + head * o_head;
        const float inv = run_sum[r] > 0.0f ? 1.0f / run_sum[r] : 0.0f;
        for (int64_t d = 0; d < head_dim; d++) dst[d] = acc[r][d] * inv;
    }
}

#define ATTEND(D)                                                                            \
    attend_vectors(q, q_tok, q_head, key_cache, value_cache, out, o_tok, o_head, table, q0,  \
                   first_pos, per_kv, kv, v0, nv, key_row, block_stride, D, block_size, scale, \
                   window, softcap)

int expeditor_paged_attention_f32(
    const float *q, int64_t q_tok, int64_t q_head,
    const float *key_cache, const float *value_cache, int64_t block_stride,
    float *out, int64_t o_tok, int64_t o_head,
    const int32_t *tables, int64_t table_stride,
    const int32_t *seq_lens, const int32_t *query_start_loc, const int64_t *seqs,
    int64_t n_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    float scale, int64_t window, float softcap) {
    if (head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK || num_kv_heads <= 0 ||
        num_heads % num_kv_heads != 0)
        return -1;
    const int64_t per_kv = num_heads / num_kv_heads;
    const int64_t key_row = num_kv_heads * head_dim; /* floats between two slots */
    for (int64_t si = 0; si < n_seqs; si++) {
        const int64_t s = seqs[si];
        const int64_t q0 = query_start_loc[s];
        const int64_t n_rows = (int64_t)query_start_loc[s + 1] - q0;
        const int64_t n_keys = seq_lens[s];
        if (n_rows <= 0 || n_keys <= 0) continue;
        const int32_t *table = tables + s * table_stride;
        const int64_t first_pos = n_keys - n_rows;
        const int64_t n_vectors = n_rows * per_kv;
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

/* Store each token's new key and value rows in its cache slot (slot < 0: none).
 * k[t, h, d] at k + t * k_tok + h * k_head + d, v likewise; a slot is
 * block * block_size + offset, its row kv_heads * head_dim contiguous floats. */
void expeditor_store_kv_f32(const float *k, int64_t k_tok, int64_t k_head, const float *v,
                            int64_t v_tok, int64_t v_head, float *key_cache,
                            float *value_cache, int64_t block_stride, int64_t block_size,
                            const int64_t *slots, int64_t n_tokens, int64_t num_kv_heads,
                            int64_t head_dim) {
    const int64_t key_row = num_kv_heads * head_dim;
    for (int64_t t = 0; t < n_tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        const int64_t at = slot / block_size * block_stride + slot % block_size * key_row;
        for (int64_t h = 0; h < num_kv_heads; h++) {
            memcpy(key_cache + at + h * head_dim, k + t * k_tok + h * k_head,
                   sizeof(float) * head_dim);
            memcpy(value_cache + at + h * head_dim, v + t * v_tok + h * v_head,
                   sizeof(float) * head_dim);
        }
    }
}
