/* Decode attention straight over the paged KV cache (CPU, float32, AVX2): one query token per
 * sequence, every key and value read once from its block, nothing gathered.
 *
 * For sequence b and KV head h, the G = H / KVH query heads of the group share each key and
 * value row:  s[g, t] = scale * q[b, h G + g] . K[h, blk(t), t % bs]   (t < seq_lens[b])
 *             out[b, h G + g] = sum_t softmax(s[g])_t * V[h, blk(t), t % bs]
 * with blk(t) = block_tables[b, t / bs]. Pass 1 computes the scores of 8 keys at a time (8
 * independent FMA chains per query head) into a scratch row per query head; the softmax takes
 * max, exp (vectorized) and sum over it; pass 2 sums the value rows weighted by it.
 *
 * Cache addressing by element strides of the head-major view [2, KVH, num_blocks, bs, D]:
 * kv (K -> V), head, block, token; D is contiguous. D % 8 == 0, G <= MAX_G.
 * Build: see engine/native.py.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_G 16

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* e^x for x <= 0 (scores minus their max), 8 lanes: Cody-Waite range reduction and the
 * Cephes expf polynomial, within ~2 ulp of expf; below -87.3 it returns 0. */
static inline __m256 exp_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    __m256 n = _mm256_floor_ps(
        _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* The 8 lane sums of 8 vectors, as one vector: out[j] = sum(v[j]). */
static inline __m256 hsum8(const __m256 v[8]) {
    const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
    const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
    const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
    /* ab = [s0 s1 s2 s3 | s0' s1' s2' s3'] (low and high 128-bit halves), cd likewise */
    const __m256 lo = _mm256_permute2f128_ps(ab, cd, 0x20), hi = _mm256_permute2f128_ps(ab, cd, 0x31);
    return _mm256_add_ps(lo, hi);
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
    if (group * num_kv_heads != num_heads || group > MAX_G || head_dim % 8 != 0) return -1;
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
        /* pass 1: scores [group, len], 8 keys at a time (independent FMA chains) */
        const __m256 scale_v = _mm256_set1_ps(scale);
        int64_t t0 = 0;
        for (; t0 + 8 <= len; t0 += 8) {
            const float *k[8];
            for (int j = 0; j < 8; j++) {
                const int64_t t = t0 + j;
                k[j] = k_head + table[t / block_size] * stride_block +
                       (t % block_size) * stride_token;
            }
            for (int64_t g = 0; g < group; g++) {
                const float *qv = qg + g * head_dim;
                __m256 acc[8];
                for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
                for (int64_t i = 0; i < head_dim; i += 8) {
                    const __m256 x = _mm256_loadu_ps(qv + i);
                    for (int j = 0; j < 8; j++)
                        acc[j] = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[j] + i), acc[j]);
                }
                _mm256_storeu_ps(scores + g * len + t0, _mm256_mul_ps(hsum8(acc), scale_v));
            }
        }
        for (int64_t t = t0; t < len; t++) {
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
            const __m256 mv = _mm256_set1_ps(m);
            __m256 sums = _mm256_setzero_ps();
            int64_t t = 0;
            for (; t + 8 <= len; t += 8) {
                __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
                _mm256_storeu_ps(s + t, p);
                sums = _mm256_add_ps(sums, p);
            }
            sum = hsum(sums);
            for (; t < len; t++) {
                s[t] = expf(s[t] - m);
                sum += s[t];
            }
            inv_sum[g] = 1.0f / sum;
        }
        /* pass 2: out[g] = sum_t p[g, t] V[t], 64 output lanes at a time in registers (the
         * group's later heads find the V rows in cache) */
        for (int64_t g = 0; g < group; g++) {
            float *o = out + (b * num_heads + h * group + g) * head_dim;
            const __m256 norm = _mm256_set1_ps(inv_sum[g]);
            for (int64_t i0 = 0; i0 < head_dim; i0 += 64) {
                const int64_t lanes = head_dim - i0 < 64 ? (head_dim - i0) / 8 : 8;
                __m256 acc[8];
                for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
                for (int64_t t = 0; t < len; t++) {
                    const float *v = v_head + table[t / block_size] * stride_block +
                                     (t % block_size) * stride_token + i0;
                    const __m256 p = _mm256_set1_ps(scores[g * len + t]);
                    for (int64_t i = 0; i < lanes; i++)
                        acc[i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * i), acc[i]);
                }
                for (int64_t i = 0; i < lanes; i++)
                    _mm256_storeu_ps(o + i0 + 8 * i, _mm256_mul_ps(acc[i], norm));
            }
        }
        free(scores);
    }
    return failed ? -2 : 0;
}
