/* Decode attention straight over the paged KV cache (CPU, float32, AVX2): one query token per
 * sequence, every key and value read once from its block, nothing gathered.
 *
 * For sequence b and KV head h, the G = H / KVH query heads of the group share each key and
 * value row:  s[g, t] = scale * q[b, h G + g] . K[h, blk(t), t % bs]   (t < seq_lens[b])
 *             out[b, h G + g] = sum_t softmax(s[g])_t * V[h, blk(t), t % bs]
 * with blk(t) = block_tables[b, t / bs]. The softmax keeps all scores (one float per key and
 * query head) in a scratch row, then takes max, exp and sum in three passes.
 *
 * Cache addressing by element strides of the head-major view [2, KVH, num_blocks, bs, D]:
 * kv (K -> V), head, block, token; D is contiguous. D % 8 == 0, G <= MAX_G, D <= MAX_D.
 * Build: see engine/native.py.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_G 16
#define MAX_D 256

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float dot(const float *a, const float *b, int64_t d) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    return hsum(acc);
}

/* Returns 0, or -1 for shapes this kernel does not take, -2 when scratch memory failed. */
int baton_paged_decode(const float *q, const float *cache, int64_t stride_kv,
                       int64_t stride_head, int64_t stride_block, int64_t stride_token,
                       const int64_t *block_tables, int64_t max_blocks,
                       const int64_t *seq_lens, int64_t num_seqs, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                       float scale, float *out) {
    const int64_t group = num_heads / num_kv_heads;
    if (group * num_kv_heads != num_heads || group > MAX_G || head_dim % 8 != 0 ||
        head_dim > MAX_D)
        return -1;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(| : failed)
    for (int64_t task = 0; task < num_seqs * num_kv_heads; task++) {
        const int64_t b = task / num_kv_heads, h = task % num_kv_heads;
        const int64_t len = seq_lens[b];
        const int64_t *table = block_tables + b * max_blocks;
        const float *k_head = cache + h * stride_head;
        const float *v_head = k_head + stride_kv;
        const float *qg = q + (b * num_heads + h * group) * head_dim;
        float *scores = malloc(sizeof(float) * (size_t)(group * (len > 0 ? len : 1)));
        if (scores == NULL) {
            failed = 1;
            continue;
        }
        /* pass 1: scores [group, len] */
        for (int64_t t = 0; t < len; t++) {
            const float *k = k_head + table[t / block_size] * stride_block +
                             (t % block_size) * stride_token;
            for (int64_t g = 0; g < group; g++)
                scores[g * len + t] = dot(qg + g * head_dim, k, head_dim) * scale;
        }
        /* softmax per query head: max, exp, sum */
        float inv_sum[MAX_G];
        for (int64_t g = 0; g < group; g++) {
            float *s = scores + g * len, m = -INFINITY, sum = 0.0f;
            for (int64_t t = 0; t < len; t++) m = s[t] > m ? s[t] : m;
            for (int64_t t = 0; t < len; t++) {
                s[t] = expf(s[t] - m);
                sum += s[t];
            }
            inv_sum[g] = 1.0f / sum;
        }
        /* pass 2: out[g] = sum_t p[g, t] V[t] */
        __m256 acc[MAX_G][MAX_D / 8];
        for (int64_t g = 0; g < group; g++)
            for (int64_t i = 0; i < head_dim / 8; i++) acc[g][i] = _mm256_setzero_ps();
        for (int64_t t = 0; t < len; t++) {
            const float *v = v_head + table[t / block_size] * stride_block +
                             (t % block_size) * stride_token;
            for (int64_t g = 0; g < group; g++) {
                const __m256 p = _mm256_set1_ps(scores[g * len + t]);
                for (int64_t i = 0; i < head_dim / 8; i++)
                    acc[g][i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * i), acc[g][i]);
            }
        }
        for (int64_t g = 0; g < group; g++) {
            float *o = out + (b * num_heads + h * group + g) * head_dim;
            const __m256 norm = _mm256_set1_ps(inv_sum[g]);
            for (int64_t i = 0; i < head_dim / 8; i++)
                _mm256_storeu_ps(o + 8 * i, _mm256_mul_ps(acc[g][i], norm));
        }
        free(scores);
    }
    return failed ? -2 : 0;
}
