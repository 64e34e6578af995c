/* Decode attention straight over the paged KV cache (CPU, float32): one query token per
 * sequence, every key and value read once from its block, nothing gathered, one pass.
 *
 * For sequence b and KV head h, the G = H / KVH query heads of the group share each key and
 * value row:  s[g, t] = scale * q[b, h G + g] . K[h, blk(t), t % bs]   (t < seq_lens[b])
 *             out[b, h G + g] = sum_t softmax(s[g])_t * V[h, blk(t), t % bs]
 * with blk(t) = block_tables[b, t / bs].
 *
 * One pass with an online softmax: keys come 8 at a time (a chunk); per query head the chunk's
 * scores update a running max m, the sum l of e^(s - m) and the unnormalized output
 * acc = sum e^(s - m) V (both rescaled by e^(m_old - m_new) when the max grows). Each key and
 * value row is read from memory once and used while it is in L1.
 *
 * Work split: the (sequence, KV head) tasks laid end to end form one line of key positions,
 * cut into equal pieces that threads take one at a time (dynamic: a thread held up by other
 * load leaves the rest to the others), so a long sequence (batch 1) is split across threads
 * too. A task cut by a piece boundary leaves partial (m, l, acc) states that are merged after
 * the parallel loop (the log-sum-exp merge of split softmaxes).
 *
 * A 32-sequence SmolLM2 step streams ~240 MB of K and V from memory; software prefetching of
 * the next blocks (tried: 8 to 64 tokens ahead) measured no faster than the hardware's.
 *
 * Two instruction sets in one library: AVX2 + FMA (the build flags), and AVX-512 F/VL/DQ
 * behind a target attribute, taken only when cpuid reports it (baton_paged_decode) or asked
 * for (baton_paged_decode_isa). The two sum in different orders (float32, same formula).
 *
 * Cache addressing by element strides of the head-major view [2, KVH, num_blocks, bs, D]:
 * kv (K -> V), head, block, token; D is contiguous. D % 8 == 0 (AVX-512: D % 16 == 0, else
 * its call runs the AVX2 code), D <= PD_MAX_D, G <= MAX_G.
 * Build: see engine/native.py.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../simd_math.h"

#define MAX_G 16
#define PD_MAX_D 256
#define PD_CHUNK 8
#define PD_PIECE_KEYS 512

#define PD_AVX512_TARGET __attribute__((target("avx512f,avx512vl,avx512dq,avx2,fma,f16c")))

static inline float pd_hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
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

/* q . k over d floats (d % 8 == 0); kept for decode_step.c, which includes this file. */
static inline __attribute__((unused)) float dot(const float *a, const float *b, int64_t d) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    return hsum(acc);
}

/* The call's fixed arguments. */
typedef struct {
    const float *q, *cache;
    int64_t stride_kv, stride_head, stride_block, stride_token;
    const int64_t *block_tables, *seq_lens;
    int64_t max_blocks, num_heads, num_kv_heads, group, head_dim, block_size;
    float scale;
} PdArgs;

/* One query head's running softmax state over the keys seen so far. */
typedef struct {
    float m, l;  /* running max of the scores, sum of e^(s - m) */
} PdRunning;

/* The cache rows of task (b, h): K of its block i starts at pd_block_k(i), V stride_kv later. */
static inline const float *pd_block_k(const PdArgs *a, int64_t b, int64_t h, int64_t i) {
    return a->cache + h * a->stride_head + a->block_tables[b * a->max_blocks + i] * a->stride_block;
}

/* Walks the key rows of one task's piece in order, 8 at a time, with no division per row
 * (a 64-bit division per row was ~10% of the kernel's time). */
typedef struct {
    const PdArgs *a;
    int64_t b, h;
    int64_t blk, off;    /* the next row: block index in the table, row in the block */
    int64_t num_blocks;  /* this task's blocks: ceil(len / block_size) */
} PdRows;

static inline PdRows pd_rows_from(const PdArgs *a, int64_t b, int64_t h, int64_t t0) {
    const int64_t bs = a->block_size, len = a->seq_lens[b];
    PdRows r = {a, b, h, t0 / bs, t0 % bs, (len + bs - 1) / bs};
    return r;
}

/* k[j], j < 8: the next n rows' keys (past n: the last row again); v[j] = k[j] + stride_kv. */
static inline void pd_next_rows(PdRows *r, int64_t n, const float **k, const float **v) {
    const PdArgs *a = r->a;
    const float *base = pd_block_k(a, r->b, r->h, r->blk);
    for (int j = 0; j < PD_CHUNK; j++) {
        if (j >= n) {
            k[j] = k[n - 1];
        } else {
            k[j] = base + r->off * a->stride_token;
            if (++r->off == a->block_size) {
                r->off = 0;
                if (++r->blk < r->num_blocks) base = pd_block_k(a, r->b, r->h, r->blk);
            }
        }
        v[j] = k[j] + a->stride_kv;
    }
}

/* Per query head g of a chunk: fold the 8 scores s[g] (lanes >= n are ignored) into run[g];
 * returns in p[g] the weights e^(s - m) of the chunk's keys (0 past n) and in rescale[g] the
 * factor the accumulated output must be multiplied by first (1 when the max did not grow). */
static inline void pd_online_softmax(const __m256 *s, int64_t group, int64_t n, PdRunning *run,
                                  float p[][PD_CHUNK], float *rescale) {
    const __m256 valid = _mm256_cmp_ps(
        _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_ps((float)n), _CMP_LT_OQ);
    for (int64_t g = 0; g < group; g++) {
        const __m256 sg = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s[g], valid);
        const float m_new = fmaxf(run[g].m, pd_hmax(sg));
        rescale[g] = 1.0f;
        if (m_new > run[g].m) {
            rescale[g] = run[g].m == -INFINITY ? 0.0f : expf(run[g].m - m_new);
            run[g].l *= rescale[g];
            run[g].m = m_new;
        }
        const __m256 pg = _mm256_and_ps(
            exp_ps(_mm256_sub_ps(sg, _mm256_set1_ps(m_new))), valid);
        run[g].l += hsum(pg);
        _mm256_storeu_ps(p[g], pg);
    }
}

/* ---- AVX2: keys [t0, t1) of task (b, h) into run and acc [G, D] -----------------------------
 * The body is inlined with d a constant where the caller knows it (64, 128), so that the
 * register tiles below are registers, not stack arrays. PdRows past n in a chunk repeat the last
 * row with weight 0: every loop over the chunk has a constant trip count. */
static inline __attribute__((always_inline)) void pd_attend_avx2_body(
    const PdArgs *a, int64_t b, int64_t h, int64_t t0, int64_t t1, PdRunning *run,
    float *acc, const int64_t d) {
    const int64_t group = a->group;
    const float *qg = a->q + (b * a->num_heads + h * group) * d;
    const __m256 scale = _mm256_set1_ps(a->scale);
    PdRows rows = pd_rows_from(a, b, h, t0);
    for (int64_t t = t0; t < t1; t += PD_CHUNK) {
        const int64_t n = t1 - t < PD_CHUNK ? t1 - t : PD_CHUNK;
        const float *k[PD_CHUNK], *v[PD_CHUNK];
        pd_next_rows(&rows, n, k, v);
        __m256 s[MAX_G];
        for (int64_t g = 0; g < group; g++) {
            const float *qv = qg + g * d;
            __m256 dots[PD_CHUNK];
            for (int j = 0; j < PD_CHUNK; j++) dots[j] = _mm256_setzero_ps();
            for (int64_t i = 0; i < d; i += 8) {
                const __m256 x = _mm256_loadu_ps(qv + i);
                for (int j = 0; j < PD_CHUNK; j++)
                    dots[j] = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[j] + i), dots[j]);
            }
            s[g] = _mm256_mul_ps(hsum8(dots), scale);
        }
        float p[MAX_G][PD_CHUNK], rescale[MAX_G];
        pd_online_softmax(s, group, n, run, p, rescale);
        /* acc[g] = acc[g] * rescale[g] + sum_j p[g, j] V[j], 64 lanes at a time in registers */
        for (int64_t g = 0; g < group; g++) {
            float *o = acc + g * d;
            const __m256 r = _mm256_set1_ps(rescale[g]);
            for (int64_t i0 = 0; i0 < d; i0 += 64) {
                if (d - i0 >= 64) {
                    __m256 sum[8];
                    for (int i = 0; i < 8; i++)
                        sum[i] = _mm256_mul_ps(_mm256_loadu_ps(o + i0 + 8 * i), r);
                    for (int j = 0; j < PD_CHUNK; j++) {
                        const __m256 pj = _mm256_broadcast_ss(&p[g][j]);
                        for (int i = 0; i < 8; i++)
                            sum[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v[j] + i0 + 8 * i), sum[i]);
                    }
                    for (int i = 0; i < 8; i++) _mm256_storeu_ps(o + i0 + 8 * i, sum[i]);
                } else {  /* the last d % 64 lanes, 8 at a time */
                    for (int64_t i = i0; i < d; i += 8) {
                        __m256 sum = _mm256_mul_ps(_mm256_loadu_ps(o + i), r);
                        for (int j = 0; j < PD_CHUNK; j++)
                            sum = _mm256_fmadd_ps(_mm256_broadcast_ss(&p[g][j]),
                                                  _mm256_loadu_ps(v[j] + i), sum);
                        _mm256_storeu_ps(o + i, sum);
                    }
                }
            }
        }
    }
}

static void pd_attend_avx2(const PdArgs *a, int64_t b, int64_t h, int64_t t0, int64_t t1,
                        PdRunning *run, float *acc) {
    if (a->head_dim == 64)
        pd_attend_avx2_body(a, b, h, t0, t1, run, acc, 64);
    else if (a->head_dim == 128)
        pd_attend_avx2_body(a, b, h, t0, t1, run, acc, 128);
    else
        pd_attend_avx2_body(a, b, h, t0, t1, run, acc, a->head_dim);
}

/* ---- AVX-512 (D % 16 == 0): the same steps 16 lanes wide ------------------------------------ */
PD_AVX512_TARGET static inline __m256 pd_fold512(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
}

PD_AVX512_TARGET static inline __attribute__((always_inline)) void pd_attend_avx512_body(
    const PdArgs *a, int64_t b, int64_t h, int64_t t0, int64_t t1, PdRunning *run,
    float *acc, const int64_t d) {
    const int64_t group = a->group;
    const float *qg = a->q + (b * a->num_heads + h * group) * d;
    const __m256 scale = _mm256_set1_ps(a->scale);
    PdRows rows = pd_rows_from(a, b, h, t0);
    for (int64_t t = t0; t < t1; t += PD_CHUNK) {
        const int64_t n = t1 - t < PD_CHUNK ? t1 - t : PD_CHUNK;
        const float *k[PD_CHUNK], *v[PD_CHUNK];
        pd_next_rows(&rows, n, k, v);
        __m256 s[MAX_G];
        for (int64_t g = 0; g < group; g++) {
            const float *qv = qg + g * d;
            __m512 dots[PD_CHUNK];
            for (int j = 0; j < PD_CHUNK; j++) dots[j] = _mm512_setzero_ps();
            for (int64_t i = 0; i < d; i += 16) {
                const __m512 x = _mm512_loadu_ps(qv + i);
                for (int j = 0; j < PD_CHUNK; j++)
                    dots[j] = _mm512_fmadd_ps(x, _mm512_loadu_ps(k[j] + i), dots[j]);
            }
            __m256 half[PD_CHUNK];
            for (int j = 0; j < PD_CHUNK; j++) half[j] = pd_fold512(dots[j]);
            s[g] = _mm256_mul_ps(hsum8(half), scale);
        }
        float p[MAX_G][PD_CHUNK], rescale[MAX_G];
        pd_online_softmax(s, group, n, run, p, rescale);
        for (int64_t g = 0; g < group; g++) {
            float *o = acc + g * d;
            const __m512 r = _mm512_set1_ps(rescale[g]);
            for (int64_t i0 = 0; i0 < d; i0 += 128) {
                if (d - i0 >= 128) {
                    __m512 sum[8];
                    for (int i = 0; i < 8; i++)
                        sum[i] = _mm512_mul_ps(_mm512_loadu_ps(o + i0 + 16 * i), r);
                    for (int j = 0; j < PD_CHUNK; j++) {
                        const __m512 pj = _mm512_set1_ps(p[g][j]);
                        for (int i = 0; i < 8; i++)
                            sum[i] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(v[j] + i0 + 16 * i), sum[i]);
                    }
                    for (int i = 0; i < 8; i++) _mm512_storeu_ps(o + i0 + 16 * i, sum[i]);
                } else if (d - i0 == 64) {  /* 4 vectors: SmolLM2's and Llama's D = 64 */
                    __m512 sum[4];
                    for (int i = 0; i < 4; i++)
                        sum[i] = _mm512_mul_ps(_mm512_loadu_ps(o + i0 + 16 * i), r);
                    for (int j = 0; j < PD_CHUNK; j++) {
                        const __m512 pj = _mm512_set1_ps(p[g][j]);
                        for (int i = 0; i < 4; i++)
                            sum[i] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(v[j] + i0 + 16 * i), sum[i]);
                    }
                    for (int i = 0; i < 4; i++) _mm512_storeu_ps(o + i0 + 16 * i, sum[i]);
                } else {  /* the last lanes, 16 at a time */
                    for (int64_t i = i0; i < d; i += 16) {
                        __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(o + i), r);
                        for (int j = 0; j < PD_CHUNK; j++)
                            sum = _mm512_fmadd_ps(_mm512_set1_ps(p[g][j]), _mm512_loadu_ps(v[j] + i),
                                                  sum);
                        _mm512_storeu_ps(o + i, sum);
                    }
                }
            }
        }
    }
}

PD_AVX512_TARGET static void pd_attend_avx512(const PdArgs *a, int64_t b, int64_t h, int64_t t0,
                                        int64_t t1, PdRunning *run,
                                        float *acc) {
    if (a->head_dim == 64)
        pd_attend_avx512_body(a, b, h, t0, t1, run, acc, 64);
    else if (a->head_dim == 128)
        pd_attend_avx512_body(a, b, h, t0, t1, run, acc, 128);
    else
        pd_attend_avx512_body(a, b, h, t0, t1, run, acc, a->head_dim);
}

/* 1 where this CPU (and OS) runs AVX-512 F, VL and DQ, else 0. */
int baton_paged_decode_has_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq");
}

/* out[b, h G + g] = acc[g] / l[g] */
static inline void pd_write_out(const PdArgs *a, int64_t task, const PdRunning *run, const float *acc,
                             float *out) {
    const int64_t b = task / a->num_kv_heads, h = task % a->num_kv_heads;
    for (int64_t g = 0; g < a->group; g++) {
        float *o = out + (b * a->num_heads + h * a->group + g) * a->head_dim;
        const float inv = run[g].l > 0.0f ? 1.0f / run[g].l : 0.0f;
        for (int64_t i = 0; i < a->head_dim; i++) o[i] = acc[g * a->head_dim + i] * inv;
    }
}

/* isa: 0 = AVX2, 1 = AVX-512 (its code needs D % 16 == 0; other D run the AVX2 code).
 * Returns 0, -1 for shapes this kernel does not take, -2 when scratch memory failed, -3 for
 * AVX-512 on a CPU without it. */
int baton_paged_decode_isa(const float *q, const float *cache, int64_t stride_kv,
                           int64_t stride_head, int64_t stride_block, int64_t stride_token,
                           const int64_t *block_tables, int64_t max_blocks,
                           const int64_t *seq_lens, int64_t num_seqs, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                           float scale, float *out, int isa) {
    const int64_t group = num_heads / num_kv_heads;
    if (num_kv_heads <= 0 || group * num_kv_heads != num_heads || group > MAX_G ||
        head_dim % 8 != 0 || head_dim > PD_MAX_D || head_dim <= 0)
        return -1;
    if (isa == 1 && !baton_paged_decode_has_avx512()) return -3;
    const int wide = isa == 1 && head_dim % 16 == 0;
    const PdArgs a = {q,          cache,        stride_kv,      stride_head, stride_block,
                    stride_token, block_tables, seq_lens,     max_blocks,  num_heads,
                    num_kv_heads, group,        head_dim,       block_size,  scale};
    const int64_t num_tasks = num_seqs * num_kv_heads;
    int64_t total = 0;
    for (int64_t b = 0; b < num_seqs; b++) total += (seq_lens[b] > 0 ? seq_lens[b] : 0);
    total *= num_kv_heads;
    const int threads = total >= 2 * 64 ? omp_get_max_threads() : 1;
    /* pieces of the line, handed out one at a time (a thread that other load on the machine
     * holds up leaves its share to the others): PIECE_KEYS keys or more, 8 per thread at most */
    int64_t pieces = total / PD_PIECE_KEYS;
    pieces = threads == 1 ? 1 : pieces < threads ? threads : pieces > 8 * threads ? 8 * threads : pieces;
    /* a piece cuts two tasks at most (its first and its last): slot 2 p holds the part of its
     * first task (t0 > 0), slot 2 p + 1 that of its last (t0 == 0, t1 < len): slots in index
     * order hold a cut task's parts in key order. A slot: m [G], l [G], acc [G, D]. */
    const int64_t slot_floats = group * (2 + head_dim);
    int64_t *slot_task = malloc(sizeof(int64_t) * 2 * (size_t)pieces);
    float *slots = malloc(sizeof(float) * (size_t)(2 * pieces * slot_floats));
    if (slot_task == NULL || slots == NULL) {
        free(slot_task);
        free(slots);
        return -2;
    }
    for (int64_t i = 0; i < 2 * pieces; i++) slot_task[i] = -1;
    for (int64_t b = 0; b < num_seqs; b++) /* no keys: zeros (the loop skips these tasks) */
        if (seq_lens[b] <= 0)
            memset(out + b * num_heads * head_dim, 0, sizeof(float) * (size_t)(num_heads * head_dim));
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t piece = 0; piece < pieces; piece++) {
        /* this piece [w0, w1) of the line of all tasks' key positions */
        const int64_t w0 = total * piece / pieces, w1 = total * (piece + 1) / pieces;
        PdRunning run[MAX_G];
        float acc[MAX_G * PD_MAX_D];
        int64_t start = 0; /* line position of task's first key */
        for (int64_t task = 0; task < num_tasks && start < w1; task++) {
            const int64_t b = task / num_kv_heads, h = task % num_kv_heads;
            const int64_t len = seq_lens[b] > 0 ? seq_lens[b] : 0;
            const int64_t t0 = w0 > start ? w0 - start : 0;
            const int64_t t1 = w1 - start < len ? w1 - start : len;
            start += len;
            if (t0 >= t1) continue; /* not in this piece */
            for (int64_t g = 0; g < group; g++) run[g] = (PdRunning){-INFINITY, 0.0f};
            memset(acc, 0, sizeof(float) * (size_t)(group * head_dim));
            if (wide)
                pd_attend_avx512(&a, b, h, t0, t1, run, acc);
            else
                pd_attend_avx2(&a, b, h, t0, t1, run, acc);
            if (t0 == 0 && t1 == len) {
                pd_write_out(&a, task, run, acc, out);
            } else {
                const int64_t i = 2 * piece + (t0 == 0 ? 1 : 0);
                float *slot = slots + i * slot_floats;
                slot_task[i] = task;
                for (int64_t g = 0; g < group; g++) {
                    slot[g] = run[g].m;
                    slot[group + g] = run[g].l;
                }
                memcpy(slot + 2 * group, acc, sizeof(float) * (size_t)(group * head_dim));
            }
        }
    }
    /* merge each cut task's parts (adjacent slots), the log-sum-exp way, and write it out */
    for (int64_t i = 0; i < 2 * pieces; i++) {
        if (slot_task[i] < 0) continue;
        const int64_t task = slot_task[i];
        PdRunning run[MAX_G];
        float *acc = slots + i * slot_floats + 2 * group;
        for (int64_t g = 0; g < group; g++)
            run[g] = (PdRunning){slots[i * slot_floats + g], slots[i * slot_floats + group + g]};
        for (; i + 1 < 2 * pieces && (slot_task[i + 1] == task || slot_task[i + 1] < 0); i++) {
            if (slot_task[i + 1] < 0) continue;
            const float *next = slots + (i + 1) * slot_floats;
            for (int64_t g = 0; g < group; g++) {
                const float m = fmaxf(run[g].m, next[g]);
                const float ca = run[g].m == -INFINITY ? 0.0f : expf(run[g].m - m);
                const float cb = next[g] == -INFINITY ? 0.0f : expf(next[g] - m);
                run[g] = (PdRunning){m, run[g].l * ca + next[group + g] * cb};
                for (int64_t e = 0; e < head_dim; e++)
                    acc[g * head_dim + e] =
                        acc[g * head_dim + e] * ca + next[2 * group + g * head_dim + e] * cb;
            }
        }
        pd_write_out(&a, task, run, acc, out);
    }
    free(slot_task);
    free(slots);
    return 0;
}

/* The AVX-512 code where cpuid reports it, else AVX2. Returns as baton_paged_decode_isa. */
int baton_paged_decode(const float *q, const float *cache, int64_t stride_kv,
                       int64_t stride_head, int64_t stride_block, int64_t stride_token,
                       const int64_t *block_tables, int64_t max_blocks,
                       const int64_t *seq_lens, int64_t num_seqs, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                       float scale, float *out) {
    static int isa = -1;  /* benign race: every thread computes the same value */
    if (isa < 0) isa = baton_paged_decode_has_avx512();
    return baton_paged_decode_isa(q, cache, stride_kv, stride_head, stride_block, stride_token,
                                  block_tables, max_blocks, seq_lens, num_seqs, num_heads,
                                  num_kv_heads, head_dim, block_size, scale, out, isa);
}
