/* Decode attention straight over the paged KV cache (CPU, float32): one query token per
 * sequence, every key and value read once from its block, nothing gathered, one pass.
 *
 * For sequence b and KV head h, the G = H / KVH query heads of the group share each key and
 * value row:  s[g, t] = scale * q[b, h G + g] . K[h, blk(t), t % bs]   (t < seq_lens[b])
 *             out[b, h G + g] = sum_t softmax(s[g])_t * V[h, blk(t), t % bs]
 * with blk(t) = block_tables[b, t / bs].
 *
 * One pass with an online softmax: keys come 32 at a time; per query head
 * their scores update a running max m, the sum l of e^(s - m) and the unnormalized output
 * acc = sum e^(s - m) V (both rescaled by e^(m_old - m_new) when the max grows). Each key and
 * value row is read from memory once and used while it is in L1.
 *
 * Shared prefixes: sequences whose tables start with the same physical blocks (prefix-cache
 * hits on one prompt head) read those blocks once for all of them. Their query vectors for a
 * KV head are gathered into one [R G, D] matrix and the shared keys pass through the same
 * loop as one sequence's G heads do, so each key and value row is loaded once for R
 * sequences instead of R times (a 16-stream step over a 2,000-token shared prompt otherwise
 * streams ~1.4 GB of K and V). Each query vector's arithmetic is the same whichever pass it
 * is in (no lane mixes query vectors). A sequence's own keys after the shared ones follow as
 * a task of its own.
 *
 * Work split: the tasks (a group's shared keys or a sequence's own keys, for one KV head)
 * are cut into segments of about equal work (keys x query vectors) that threads take one at a
 * time (dynamic: a thread held up by other load leaves the rest to the others), so a long
 * sequence (batch 1) is split across threads too. Every segment leaves its partial (m, l, acc)
 * states; after the parallel loop each (sequence, head) merges its segments' states in key
 * order (the log-sum-exp merge of split softmaxes).
 *
 * Prefetch: a pass keeps the keys and values two spans ahead of the one it attends on their
 * way into L2, paced over each span's work (pd_prefetch_paced): a block of one KV head is
 * 4 KB, and the hardware's prefetchers stop at each. (A 32-sequence SmolLM2 step streams ~240
 * MB of K and V.) Into L2 rather than L1, and two spans ahead rather than one: measured faster
 * (docs/design/cpu-kernels.md, decode attention). Where the caller knows the keys the thread
 * attends next (PdArgs.next_table: the fused step's next window), the last spans' prefetches
 * go to their first span.
 *
 * Two instruction sets in one library: AVX2 + FMA (the build flags), and AVX-512 F/VL/DQ
 * behind a target attribute, taken only when cpuid reports it (baton_paged_decode) or asked
 * for (baton_paged_decode_isa). The two sum in different orders (float32, same formula). The
 * AVX-512 code has two paths with the same sums: register tiles of a few query vectors, and
 * for passes that fill vectors of 16 query vectors well (pd_by_lanes), 16 of them in the lanes
 * of a vector.
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

/* n floats starting on a cache line (free() them): 32-byte vector loads from a buffer that
 * malloc left 16 bytes off would straddle two lines every other load (~25% slower products). */
static inline float *pd_aligned_floats(int64_t n) {
    const size_t bytes = sizeof(float) * (size_t)(n > 0 ? n : 1);
    return aligned_alloc(64, (bytes + 63) / 64 * 64);
}
#define MAX_NG 64 /* query vectors in one pass over keys: G per sequence, times sequences */
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

/* The call's fixed arguments. */
typedef struct {
    const float *q, *cache;
    int64_t stride_kv, stride_head, stride_block, stride_token;
    const int64_t *block_tables, *seq_lens;
    int64_t max_blocks, num_heads, num_kv_heads, group, head_dim, block_size;
    float scale;
    /* The keys [next_t0, next_t1) of next_table's KV head next_h that this thread attends
     * next (next_table NULL: unknown): a pass prefetches their first span after its own keys. */
    const int64_t *next_table;
    int64_t next_h, next_t0, next_t1;
} PdArgs;

/* One query head's running softmax state over the keys seen so far. */
typedef struct {
    float m, l;  /* running max of the scores, sum of e^(s - m) */
} PdRunning;

/* The cache rows of a block table's KV head h: K of its block i starts at pd_block_k(i), V
 * stride_kv later. */
static inline const float *pd_block_k(const PdArgs *a, const int64_t *table, int64_t h,
                                      int64_t i) {
    return a->cache + h * a->stride_head + table[i] * a->stride_block;
}

/* Walks the key rows [t0, t1) of a block table's head h in order, 8 at a time, with no
 * division per row (a 64-bit division per row was ~10% of the kernel's time). */
typedef struct {
    const PdArgs *a;
    const int64_t *table;
    int64_t h;
    int64_t blk, off;    /* the next row: block index in the table, row in the block */
    int64_t num_blocks;  /* the blocks up to t1: ceil(t1 / block_size) */
} PdRows;

static inline PdRows pd_rows_from(const PdArgs *a, const int64_t *table, int64_t h, int64_t t0,
                                  int64_t t1) {
    const int64_t bs = a->block_size;
    PdRows r = {a, table, h, t0 / bs, t0 % bs, (t1 + bs - 1) / bs};
    return r;
}

/* k[j], j < 8: the next n rows' keys (past n: the last row again); v[j] = k[j] + stride_kv. */
static inline void pd_next_rows(PdRows *r, int64_t n, const float **k, const float **v) {
    const PdArgs *a = r->a;
    const float *base = pd_block_k(a, r->table, r->h, r->blk);
    for (int j = 0; j < PD_CHUNK; j++) {
        if (j >= n) {
            k[j] = k[n - 1];
        } else {
            k[j] = base + r->off * a->stride_token;
            if (++r->off == a->block_size) {
                r->off = 0;
                if (++r->blk < r->num_blocks) base = pd_block_k(a, r->table, r->h, r->blk);
            }
        }
        v[j] = k[j] + a->stride_kv;
    }
}

/* The keys of chunk [t, t + n) each query vector g attends to: n, or with limits (its own
 * end of keys, a prompt's row attending up to itself) as many as lie before limits[g]; a
 * vector whose keys ended before t gets 0 and is left as it is, so its state is the one a
 * pass over [t0, limits[g]) alone leaves (masked lanes add 0 x V, an exact no-op). */
static inline void pd_chunk_keys(const int64_t *limits, int64_t group, int64_t t, int64_t n,
                                 int64_t *nv) {
    for (int64_t g = 0; g < group; g++) {
        const int64_t left = limits == NULL ? n : limits[g] - t;
        nv[g] = left < 0 ? 0 : left < n ? left : n;
    }
}

/* ---- AVX2: keys [t0, t1) of task (b, h) into run and acc [G, D] -----------------------------
 * Keys come PD_SPAN (32) at a time: the scores of a span, then one online-softmax update per
 * query vector (a running max, sum and rescale per 32 keys rather than per 8), then the
 * output update. The body is inlined with d a constant where the caller knows it (64, 128),
 * so that the register tiles below are registers, not stack arrays. Rows past n in a span
 * repeat the last row with weight 0: every loop over the span has a constant trip count.
 * Query vectors go three at a time through the scores (3 x 4 keys: 12 sums in registers
 * share each load) and two at a time through the output update (2 x 32 lanes); each sum is
 * the same chain of fused multiply-adds whichever tile it is in, so a query vector's numbers
 * do not depend on the others passing the keys with it. A span starts every 32 keys from
 * the pass's first key (a window of 128 keys: at fixed places). */

/* s[q] = scale * (qv[q] . k[j]) for the chunk's 8 keys j, q < NQ (<= 3): per key, 8 lane sums
 * over d in order, then hsum8. */
static inline __attribute__((always_inline)) void pd_scores_avx2(const float *qv, const int NQ,
                                                                 const float *const *k,
                                                                 const int64_t d, __m256 scale,
                                                                 __m256 *s) {
    __m256 dots[3][PD_CHUNK];
    for (int half = 0; half < PD_CHUNK; half += 4) {
        __m256 sum[3][4];
        for (int q = 0; q < NQ; q++)
            for (int j = 0; j < 4; j++) sum[q][j] = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i += 8) {
            __m256 x[3];
            for (int q = 0; q < NQ; q++) x[q] = _mm256_loadu_ps(qv + q * d + i);
            for (int j = 0; j < 4; j++) {
                const __m256 key = _mm256_loadu_ps(k[half + j] + i);
                for (int q = 0; q < NQ; q++) sum[q][j] = _mm256_fmadd_ps(x[q], key, sum[q][j]);
            }
        }
        for (int q = 0; q < NQ; q++)
            for (int j = 0; j < 4; j++) dots[q][half + j] = sum[q][j];
    }
    for (int q = 0; q < NQ; q++) s[q] = _mm256_mul_ps(hsum8(dots[q]), scale);
}

#define PD_SPAN 32 /* keys per online-softmax update (AVX2) */

/* k[j], j < PD_SPAN: the next n rows' keys (past n: the last row again); v likewise. */
static inline void pd_next_span(PdRows *r, int64_t n, const float **k, const float **v) {
    for (int c = 0; c < PD_SPAN; c += PD_CHUNK) {
        const int64_t left = n - c;
        if (left > 0) {
            pd_next_rows(r, left < PD_CHUNK ? left : PD_CHUNK, k + c, v + c);
        } else {
            for (int j = 0; j < PD_CHUNK; j++) {
                k[c + j] = k[c - 1];
                v[c + j] = v[c - 1];
            }
        }
    }
}

/* Software prefetch of the rows a pass reads next: the pass walks a second PdRows (`ahead`)
 * in front of its own and prefetches, paced over each span's work (pd_prefetch_paced), the
 * span two after it (over its first span, the second and the third), so that a span's keys
 * and values are on their way to L2 while the two spans before it are attended. A block of one
 * KV head is 4 KB in the cache (SmolLM2: 16 keys x 64 floats), and the hardware's prefetchers
 * stop at 4 KB pages. */
typedef struct {
    PdRows rows;
    int64_t left; /* rows still to prefetch */
    int then;     /* 1: the first span of the args' next keys follows */
} PdAhead;

/* Prefetches into L2 the keys and values (d floats each) of the next n rows of ahead. */
static inline void pd_prefetch_next(PdAhead *ahead, int64_t n, const int64_t d) {
    PdRows *r = &ahead->rows;
    const PdArgs *a = r->a;
    if (ahead->left <= 0 && ahead->then) { /* on to the first span of the next keys */
        const int64_t t1 = a->next_t0 + PD_SPAN < a->next_t1 ? a->next_t0 + PD_SPAN : a->next_t1;
        *r = pd_rows_from(a, a->next_table, a->next_h, a->next_t0, t1);
        ahead->left = t1 - a->next_t0;
        ahead->then = 0;
    }
    if (n > ahead->left) n = ahead->left;
    if (n <= 0) return;
    ahead->left -= n;
    const float *base = pd_block_k(a, r->table, r->h, r->blk);
    for (int64_t j = 0; j < n; j++) {
        const float *k = base + r->off * a->stride_token;
        for (int64_t e = 0; e < d; e += 16) {
            _mm_prefetch((const char *)(k + e), _MM_HINT_T1);
            _mm_prefetch((const char *)(k + a->stride_kv + e), _MM_HINT_T1);
        }
        if (++r->off == a->block_size) {
            r->off = 0;
            if (++r->blk >= r->num_blocks) {
                ahead->left = 0;
                return;
            }
            base = pd_block_k(a, r->table, r->h, r->blk);
        }
    }
}

/* The rows to prefetch for a pass over keys [t0, t1): from its second span on (the first is
 * read at once, or was prefetched by the pass before: PdArgs.next_table). */
static inline PdAhead pd_ahead_from(const PdArgs *a, const int64_t *table, int64_t h, int64_t t0,
                                    int64_t t1) {
    const int64_t start = t0 + PD_SPAN < t1 ? t0 + PD_SPAN : t1;
    PdAhead ahead = {pd_rows_from(a, table, h, start, t1), t1 - start,
                     a->next_table != NULL && a->next_t1 > a->next_t0};
    return ahead;
}

/* Sends the prefetches due by the end of the unit-th of a span's `units` parts of work (score
 * tiles and output tiles alike): `quota` rows (PD_SPAN; the pass's first span, 2 PD_SPAN: the
 * second span and the third) in even portions over the whole span (*sent: rows sent so far
 * this span). Sent in bursts at the scores (8 rows for every 8 keys, the second span at the
 * pass's start), the prefetches of a pass of 12 query vectors overran the core's queue of
 * misses and the output update found the memory idle: over 30 layers' caches (more than the
 * CPU's caches hold) the pass took 1.55-1.7x its time over cached keys, 1.1-1.3x paced
 * (docs/design/cpu-kernels.md, decode attention). */
static inline void pd_prefetch_paced(PdAhead *ahead, int64_t *sent, int64_t unit, int64_t units,
                                     int64_t quota, const int64_t d) {
    const int64_t due = quota * (unit + 1) / units;
    if (due > *sent) pd_prefetch_next(ahead, due - *sent, d);
    *sent = due;
}

/* Per query vector g of a span: fold its 32 scores s[g] (4 vectors; lanes >= n[g] are
 * ignored) into run[g]; returns in p[g] the weights e^(s - m) of the span's keys (0 past n[g])
 * and in rescale[g] the factor the accumulated output must be multiplied by first (1 when the
 * max did not grow). A query vector with n[g] = 0 keeps its run, with weights 0 and rescale 1
 * (the output update is then an exact no-op). The span's weights are summed lane-wise over
 * its 4 vectors, then across lanes. */
static inline void pd_online_softmax_span(__m256 (*s)[PD_SPAN / 8], int64_t group,
                                          const int64_t *n, PdRunning *run, float (*p)[PD_SPAN],
                                          float *rescale) {
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t g = 0; g < group; g++) {
        if (n[g] == 0) {
            rescale[g] = 1.0f;
            for (int c = 0; c < PD_SPAN; c += 8) _mm256_storeu_ps(p[g] + c, _mm256_setzero_ps());
            continue;
        }
        __m256 valid[PD_SPAN / 8], sg[PD_SPAN / 8];
        __m256 mx = _mm256_set1_ps(-INFINITY);
        for (int c = 0; c < PD_SPAN / 8; c++) {
            valid[c] = _mm256_cmp_ps(_mm256_add_ps(lane, _mm256_set1_ps((float)(8 * c))),
                                     _mm256_set1_ps((float)n[g]), _CMP_LT_OQ);
            sg[c] = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s[g][c], valid[c]);
            mx = _mm256_max_ps(mx, sg[c]);
        }
        const float m_new = fmaxf(run[g].m, pd_hmax(mx));
        rescale[g] = 1.0f;
        if (m_new > run[g].m) {
            rescale[g] = run[g].m == -INFINITY ? 0.0f : expf(run[g].m - m_new);
            run[g].l *= rescale[g];
            run[g].m = m_new;
        }
        const __m256 m = _mm256_set1_ps(m_new);
        __m256 total = _mm256_setzero_ps();
        for (int c = 0; c < PD_SPAN / 8; c++) {
            const __m256 pc = _mm256_and_ps(exp_ps(_mm256_sub_ps(sg[c], m)), valid[c]);
            total = _mm256_add_ps(total, pc);
            _mm256_storeu_ps(p[g] + 8 * c, pc);
        }
        run[g].l += hsum(total);
    }
}

/* o[q] = o[q] * rescale[q] + sum_j p[q, j] V[j] for q < NQ (<= 2) over the span's keys, 32
 * lanes at a time (8 at a time for the last d % 32): per lane the multiply, then the fused
 * multiply-adds in key order. */
static inline __attribute__((always_inline)) void pd_values_span_avx2(float *o, const int NQ,
                                                                 const float (*p)[PD_SPAN],
                                                                 const float *rescale,
                                                                 const float *const *v,
                                                                 const int64_t d) {
    for (int64_t i0 = 0; i0 < d; i0 += 32) {
        const int lanes = d - i0 >= 32 ? 4 : (int)((d - i0) / 8);
        __m256 sum[2][4];
        for (int q = 0; q < NQ; q++) {
            const __m256 r = _mm256_set1_ps(rescale[q]);
            for (int w = 0; w < lanes; w++)
                sum[q][w] = _mm256_mul_ps(_mm256_loadu_ps(o + q * d + i0 + 8 * w), r);
        }
        for (int j = 0; j < PD_SPAN; j++) {
            __m256 val[4];
            for (int w = 0; w < lanes; w++) val[w] = _mm256_loadu_ps(v[j] + i0 + 8 * w);
            for (int q = 0; q < NQ; q++) {
                const __m256 pj = _mm256_broadcast_ss(&p[q][j]);
                for (int w = 0; w < lanes; w++) sum[q][w] = _mm256_fmadd_ps(pj, val[w], sum[q][w]);
            }
        }
        for (int q = 0; q < NQ; q++)
            for (int w = 0; w < lanes; w++) _mm256_storeu_ps(o + q * d + i0 + 8 * w, sum[q][w]);
    }
}

#define PD_ATTEND pd_attend_avx2
#define PD_SPAN_LOOP pd_attend_avx2_span_loop
#define PD_ISA
#define PD_SCORES pd_scores_avx2
#define PD_VALUES pd_values_span_avx2
#define PD_VALUES_TILE 2
#include "paged_decode_span_loop.h"

/* ---- AVX-512 (D % 16 == 0): the same steps 16 lanes wide ------------------------------------
 * The span loop of the AVX2 code, with scores and output updates 16 lanes wide: a score is 16
 * lane sums over d in order, folded to 8 (lane i + lane i + 8), then hsum8; query vectors go
 * three at a time through the scores (3 x 4 keys: 12 sums in registers share each load) and
 * four at a time through the output update (4 x 64 lanes). As in the AVX2 code, a query
 * vector's numbers do not depend on which others pass the keys with it. */
PD_AVX512_TARGET static inline __m256 pd_fold512(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
}

/* s[q] = scale * (qv[q] . k[j]) for the chunk's 8 keys j, q < NQ (<= 3). */
PD_AVX512_TARGET static inline __attribute__((always_inline)) void pd_scores_avx512(
    const float *qv, const int NQ, const float *const *k, const int64_t d, __m256 scale,
    __m256 *s) {
    __m256 half[3][PD_CHUNK];
    for (int j0 = 0; j0 < PD_CHUNK; j0 += 4) {
        __m512 sum[3][4];
        for (int q = 0; q < NQ; q++)
            for (int j = 0; j < 4; j++) sum[q][j] = _mm512_setzero_ps();
        for (int64_t i = 0; i < d; i += 16) {
            __m512 x[3];
            for (int q = 0; q < NQ; q++) x[q] = _mm512_loadu_ps(qv + q * d + i);
            for (int j = 0; j < 4; j++) {
                const __m512 key = _mm512_loadu_ps(k[j0 + j] + i);
                for (int q = 0; q < NQ; q++) sum[q][j] = _mm512_fmadd_ps(x[q], key, sum[q][j]);
            }
        }
        for (int q = 0; q < NQ; q++)
            for (int j = 0; j < 4; j++) half[q][j0 + j] = pd_fold512(sum[q][j]);
    }
    for (int q = 0; q < NQ; q++) s[q] = _mm256_mul_ps(hsum8(half[q]), scale);
}

/* o[q] = o[q] * rescale[q] + sum_j p[q, j] V[j] for q < NQ (<= 4) over the span's keys, 64
 * lanes at a time (16 at a time for the last d % 64): per lane the multiply, then the fused
 * multiply-adds in key order. p[q, j] is p[q * q_stride + j * key_stride]. */
PD_AVX512_TARGET static inline __attribute__((always_inline)) void pd_values_span_avx512(
    float *o, const int NQ, const float *p, const int64_t q_stride, const int64_t key_stride,
    const float *rescale, const float *const *v, const int64_t d) {
    for (int64_t i0 = 0; i0 < d; i0 += 64) {
        const int lanes = d - i0 >= 64 ? 4 : (int)((d - i0) / 16);
        __m512 sum[4][4];
        for (int q = 0; q < NQ; q++) {
            const __m512 r = _mm512_set1_ps(rescale[q]);
            for (int w = 0; w < lanes; w++)
                sum[q][w] = _mm512_mul_ps(_mm512_loadu_ps(o + q * d + i0 + 16 * w), r);
        }
        for (int j = 0; j < PD_SPAN; j++) {
            __m512 val[4];
            for (int w = 0; w < lanes; w++) val[w] = _mm512_loadu_ps(v[j] + i0 + 16 * w);
            for (int q = 0; q < NQ; q++) {
                const __m512 pj = _mm512_set1_ps(p[q * q_stride + j * key_stride]);
                for (int w = 0; w < lanes; w++) sum[q][w] = _mm512_fmadd_ps(pj, val[w], sum[q][w]);
            }
        }
        for (int q = 0; q < NQ; q++)
            for (int w = 0; w < lanes; w++) _mm512_storeu_ps(o + q * d + i0 + 16 * w, sum[q][w]);
    }
}

/* pd_values_span_avx512 on weights p[q][j] (the span loop's layout) */
PD_AVX512_TARGET static inline __attribute__((always_inline)) void pd_values_span_rows_avx512(
    float *o, const int NQ, const float (*p)[PD_SPAN], const float *rescale,
    const float *const *v, const int64_t d) {
    pd_values_span_avx512(o, NQ, &p[0][0], PD_SPAN, 1, rescale, v, d);
}

#define PD_ATTEND pd_attend_avx512_by_tiles
#define PD_SPAN_LOOP pd_attend_avx512_span_loop
#define PD_ISA PD_AVX512_TARGET
#define PD_SCORES pd_scores_avx512
#define PD_VALUES pd_values_span_rows_avx512
#define PD_VALUES_TILE 4
#include "paged_decode_span_loop.h"

/* ---- AVX-512, many query vectors: query vectors in lanes -------------------------------------
 * A pass of many query vectors (pd_by_lanes: a prompt chunk's rows, a group of decode rows over
 * a shared prefix) holds them transposed, 16 to a vector (qt[e][lane] = q[lane][e]), and
 * computes a key's scores for 16 query vectors at once: each fused multiply-add broadcasts one
 * of the key's elements against a row of qt, and no sum crosses lanes. The sums are those of
 * pd_scores_avx512 term for term (the chain of lane l over elements l, l + 16, ..., the fold
 * of lane l with lane l + 8, hsum8's pairs), the online softmax that of
 * pd_online_softmax_span (the same max, expf, exp_ps polynomial and order of the weights'
 * sums) and the output update that of pd_values_span_avx512: a query vector's numbers are bit
 * for bit those of the tiled code, whichever path a pass takes. */
#define PD_LANES_MIN 32

/* Whether a pass of ng query vectors goes by lanes: 32 or more, or a last vector of 16 lanes
 * more than three quarters full (13-16 vectors: 5 SmolLM2 decode rows over a shared prompt).
 * Fewer fill a vector too little, and 17-31 leave most of a second one empty: by tiles.
 * Measured with benchmarks/attention_paths.py (one pass of 128 keys, Intel Xeon, AVX-512):
 * lanes / tiles 1.53x at 3 vectors, 1.10x at 9, 0.94x at 12, 0.85x at 15, 1.12x at 18. At 12
 * (4 SmolLM2 rows) the fused step's attention over 2,000 cold keys was 3% faster by lanes on
 * that Xeon, and 8% faster by tiles on a Zen 4 EPYC with paced prefetches (one thread;
 * docs/design/cpu-kernels.md, decode attention): by tiles. */
static inline int pd_by_lanes(int64_t ng) {
    return ng >= PD_LANES_MIN || ng % 16 == 0 || ng % 16 >= 13;
}

/* e^x = y 2^n (x within float32's range): n = floor(x log2(e) + 1/2) and y = e^(x - n ln 2)
 * by exp_ps's reduction and polynomial, 16 lanes wide; returns y, n in *n_out. */
PD_AVX512_TARGET static inline __m512 pd_exp512_reduced(__m512 x, __m512 *n_out) {
    const __m512 n = _mm512_roundscale_ps(
        _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    *n_out = n;
    return _mm512_add_ps(_mm512_fmadd_ps(y, _mm512_mul_ps(x, x), x), _mm512_set1_ps(1.0f));
}

/* exp_ps 16 lanes wide, the same operations lane by lane */
PD_AVX512_TARGET static inline __m512 pd_exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.0f));
    __m512 n;
    const __m512 y = pd_exp512_reduced(x, &n);
    __m512i e = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

/* f[j] = p_i + p_(i+8) for NK keys k[j], 16 query vectors qt [d][16]: p_l the chain of fused
 * multiply-adds over elements l, l + 16, ... (pd_scores_avx512's lane l, then its fold) */
PD_AVX512_TARGET static inline __attribute__((always_inline)) void pd_fold_lanes(
    const float *qt, const int NK, const float *const *k, const int64_t d, const int i,
    __m512 *f) {
    __m512 lo[4], hi[4];
    for (int j = 0; j < NK; j++) lo[j] = hi[j] = _mm512_setzero_ps();
    for (int64_t e = 0; e < d; e += 16) {
        const __m512 qa = _mm512_load_ps(qt + (e + i) * 16), qb = _mm512_load_ps(qt + (e + i + 8) * 16);
        for (int j = 0; j < NK; j++) {
            lo[j] = _mm512_fmadd_ps(qa, _mm512_set1_ps(k[j][e + i]), lo[j]);
            hi[j] = _mm512_fmadd_ps(qb, _mm512_set1_ps(k[j][e + i + 8]), hi[j]);
        }
    }
    for (int j = 0; j < NK; j++) f[j] = _mm512_add_ps(lo[j], hi[j]);
}

/* s[j] = scale * (q . k[j]) for NK (<= 4) keys and the 16 query vectors of qt, summed as
 * hsum8 sums a key's folded lanes: ((f0 + f1) + (f2 + f3)) + ((f4 + f5) + (f6 + f7)). */
PD_AVX512_TARGET static inline __attribute__((always_inline)) void pd_scores_lanes(
    const float *qt, const int NK, const float *const *k, const int64_t d, __m512 scale,
    __m512 *s) {
    __m512 a[4], b[4], low[4], f[4];
    pd_fold_lanes(qt, NK, k, d, 0, a);
    pd_fold_lanes(qt, NK, k, d, 1, f);
    for (int j = 0; j < NK; j++) a[j] = _mm512_add_ps(a[j], f[j]);
    pd_fold_lanes(qt, NK, k, d, 2, b);
    pd_fold_lanes(qt, NK, k, d, 3, f);
    for (int j = 0; j < NK; j++) low[j] = _mm512_add_ps(a[j], _mm512_add_ps(b[j], f[j]));
    pd_fold_lanes(qt, NK, k, d, 4, a);
    pd_fold_lanes(qt, NK, k, d, 5, f);
    for (int j = 0; j < NK; j++) a[j] = _mm512_add_ps(a[j], f[j]);
    pd_fold_lanes(qt, NK, k, d, 6, b);
    pd_fold_lanes(qt, NK, k, d, 7, f);
    for (int j = 0; j < NK; j++)
        s[j] = _mm512_mul_ps(_mm512_add_ps(low[j], _mm512_add_ps(a[j], _mm512_add_ps(b[j], f[j]))),
                             scale);
}

/* The span loop with query vectors in lanes: keys [t0, t1) for the group query vectors qg
 * [group, d] (group <= MAX_NG), into run and acc as pd_attend_avx512_by_tiles. */
PD_AVX512_TARGET static inline __attribute__((always_inline)) void pd_attend_lanes_loop(
    const PdArgs *a, const float *qg, int64_t group, const int64_t *limits, const int64_t *table,
    int64_t h, int64_t t0, int64_t t1, PdRunning *run, float *acc, const int64_t d) {
    const int64_t vectors = (group + 15) / 16;
    /* qt [vectors][d][16], lanes past group 0 */
    float qt[vectors * d * 16] __attribute__((aligned(64)));
    for (int64_t c = 0; c < vectors; c++)
        for (int64_t e = 0; e < d; e++)
            for (int lane = 0; lane < 16; lane++) {
                const int64_t g = 16 * c + lane;
                qt[(c * d + e) * 16 + lane] = g < group ? qg[g * d + e] : 0.0f;
            }
    const __m512 scale = _mm512_set1_ps(a->scale);
    PdAhead ahead = pd_ahead_from(a, table, h, t0, t1);
    PdRows rows = pd_rows_from(a, table, h, t0, t1);
    for (int64_t t = t0; t < t1; t += PD_SPAN) {
        const int64_t n = t1 - t < PD_SPAN ? t1 - t : PD_SPAN;
        const float *k[PD_SPAN], *v[PD_SPAN];
        pd_next_span(&rows, n, k, v);
        int64_t nv[MAX_NG + 16];
        pd_chunk_keys(limits, group, t, n, nv);
        /* parts of the span's work: per vector of 16, its score tiles and output tiles */
        const int64_t units = vectors * ((n + 3) / 4) + (group + 3) / 4;
        const int64_t quota = t == t0 ? 2 * PD_SPAN : PD_SPAN;
        int64_t unit = 0, sent = 0;
        for (int64_t c = 0; c < vectors; c++) {
            const int64_t g0 = 16 * c, lanes = group - g0 < 16 ? group - g0 : 16;
            int32_t counts[16] __attribute__((aligned(64)));
            for (int lane = 0; lane < 16; lane++) counts[lane] = lane < lanes ? (int32_t)nv[g0 + lane] : 0;
            const __m512i count = _mm512_load_si512(counts);
            /* scores of the span's keys (in fours; keys past n repeat the last and are masked) */
            __m512 s[PD_SPAN];
#pragma GCC unroll 1
            for (int j = 0; j < n; j += 4) {
                pd_prefetch_paced(&ahead, &sent, unit++, units, quota, d);
                pd_scores_lanes(qt + c * d * 16, 4, k + j, d, scale, s + j);
            }
            __mmask16 valid[PD_SPAN];
            __m512 mx = _mm512_set1_ps(-INFINITY);
            for (int j = 0; j < n; j++) {
                valid[j] = _mm512_cmpgt_epi32_mask(count, _mm512_set1_epi32(j));
                mx = _mm512_mask_max_ps(mx, valid[j], mx, s[j]);
            }
            /* per query vector, pd_online_softmax_span's update of its running max and sum */
            float top[16] __attribute__((aligned(64))), m_new[16] __attribute__((aligned(64)));
            float rescale[16];
            _mm512_store_ps(top, mx);
            for (int lane = 0; lane < 16; lane++) {
                PdRunning *r = &run[g0 + lane];
                rescale[lane] = 1.0f;
                m_new[lane] = 0.0f;
                if (lane >= lanes || counts[lane] == 0) continue;
                m_new[lane] = fmaxf(r->m, top[lane]);
                if (m_new[lane] > r->m) {
                    rescale[lane] = r->m == -INFINITY ? 0.0f : expf(r->m - m_new[lane]);
                    r->l *= rescale[lane];
                    r->m = m_new[lane];
                }
            }
            /* weights p [PD_SPAN][16] (0 where masked), and each lane's sum of them as
             * pd_online_softmax_span adds its span's weights: per key lane i of 8, the keys
             * i, i + 8, i + 16, i + 24 in order, then hsum's pairs */
            float p[PD_SPAN * 16] __attribute__((aligned(64)));
            const __m512 m = _mm512_load_ps(m_new);
            for (int j = 0; j < PD_SPAN; j++) {
                const __m512 pj = j < n ? _mm512_maskz_mov_ps(valid[j], pd_exp512(_mm512_sub_ps(s[j], m)))
                                        : _mm512_setzero_ps();
                _mm512_store_ps(p + j * 16, pj);
            }
            __m512 lane_sum[8];
            for (int i = 0; i < 8; i++) {
                __m512 total = _mm512_load_ps(p + i * 16);
                for (int j = i + 8; j < PD_SPAN; j += 8)
                    total = _mm512_add_ps(total, _mm512_load_ps(p + j * 16));
                lane_sum[i] = total;
            }
            const __m512 sum = _mm512_add_ps(
                _mm512_add_ps(_mm512_add_ps(lane_sum[0], lane_sum[4]), _mm512_add_ps(lane_sum[2], lane_sum[6])),
                _mm512_add_ps(_mm512_add_ps(lane_sum[1], lane_sum[5]), _mm512_add_ps(lane_sum[3], lane_sum[7])));
            float added[16] __attribute__((aligned(64)));
            _mm512_store_ps(added, sum);
            for (int lane = 0; lane < lanes; lane++)
                if (counts[lane] > 0) run[g0 + lane].l += added[lane];
            /* the outputs, four query vectors at a time */
            float *o = acc + g0 * d;
            int64_t q = 0;
            for (; q + 4 <= lanes; q += 4) {
                pd_prefetch_paced(&ahead, &sent, unit++, units, quota, d);
                pd_values_span_avx512(o + q * d, 4, p + q, 1, 16, rescale + q, v, d);
            }
            if (q < lanes) pd_prefetch_paced(&ahead, &sent, unit++, units, quota, d);
            if (lanes - q == 3) pd_values_span_avx512(o + q * d, 3, p + q, 1, 16, rescale + q, v, d);
            else if (lanes - q == 2) pd_values_span_avx512(o + q * d, 2, p + q, 1, 16, rescale + q, v, d);
            else if (lanes - q == 1) pd_values_span_avx512(o + q * d, 1, p + q, 1, 16, rescale + q, v, d);
        }
    }
}

PD_AVX512_TARGET static void pd_attend_avx512_by_lanes(const PdArgs *a, const float *qg,
                                                       int64_t ng, const int64_t *limits,
                                                       const int64_t *table, int64_t h,
                                                       int64_t t0, int64_t t1, PdRunning *run,
                                                       float *acc) {
    if (a->head_dim == 64)
        pd_attend_lanes_loop(a, qg, ng, limits, table, h, t0, t1, run, acc, 64);
    else
        pd_attend_lanes_loop(a, qg, ng, limits, table, h, t0, t1, run, acc, a->head_dim);
}

/* Keys [t0, t1) of table's KV head h for the ng query vectors qg [ng, D] (ng <= MAX_NG), into
 * run [ng] and acc [ng, D]: by lanes where pd_by_lanes(ng), else by tiles. */
PD_AVX512_TARGET static void pd_attend_avx512(const PdArgs *a, const float *qg, int64_t ng,
                                              const int64_t *limits, const int64_t *table,
                                              int64_t h, int64_t t0, int64_t t1, PdRunning *run,
                                              float *acc) {
    if (!pd_by_lanes(ng))
        pd_attend_avx512_by_tiles(a, qg, ng, limits, table, h, t0, t1, run, acc);
    else
        pd_attend_avx512_by_lanes(a, qg, ng, limits, table, h, t0, t1, run, acc);
}

/* 1 where this CPU (and OS) runs AVX-512 F, VL and DQ, else 0. */
int baton_paged_decode_has_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq");
}

/* One pass (tests): keys [t0, t1) of a block table's KV head h for the ng query vectors qg
 * [ng, D], each up to its own limit (limits [ng], or NULL: all), from a fresh state, by one
 * path: 0 = AVX2, 1 = AVX-512 by tiles, 2 = AVX-512 by lanes. Writes each vector's running max
 * m [ng], sum l [ng] and unnormalized output acc [ng, D]. Returns 0, -1 for shapes the path
 * does not take, -3 for an AVX-512 path on a CPU without it. */
int baton_paged_decode_pass(const float *qg, int64_t ng, const int64_t *limits,
                            const float *cache, int64_t stride_kv, int64_t stride_head,
                            int64_t stride_block, int64_t stride_token, const int64_t *table,
                            int64_t h, int64_t t0, int64_t t1, int64_t head_dim,
                            int64_t block_size, float scale, int path, float *m, float *l,
                            float *acc) {
    if (ng <= 0 || ng > MAX_NG || head_dim <= 0 || head_dim > PD_MAX_D || block_size <= 0 ||
        t0 < 0 || t1 < t0 || head_dim % (path == 0 ? 8 : 16) != 0 || path < 0 || path > 2)
        return -1;
    if (path > 0 && !baton_paged_decode_has_avx512()) return -3;
    const PdArgs a = {.cache = cache,
                      .stride_kv = stride_kv,
                      .stride_head = stride_head,
                      .stride_block = stride_block,
                      .stride_token = stride_token,
                      .head_dim = head_dim,
                      .block_size = block_size,
                      .scale = scale};
    PdRunning run[MAX_NG];
    for (int64_t g = 0; g < ng; g++) run[g] = (PdRunning){-INFINITY, 0.0f};
    memset(acc, 0, sizeof(float) * (size_t)(ng * head_dim));
    if (path == 0)
        pd_attend_avx2(&a, qg, ng, limits, table, h, t0, t1, run, acc);
    else if (path == 1)
        pd_attend_avx512_by_tiles(&a, qg, ng, limits, table, h, t0, t1, run, acc);
    else
        pd_attend_avx512_by_lanes(&a, qg, ng, limits, table, h, t0, t1, run, acc);
    for (int64_t g = 0; g < ng; g++) m[g] = run[g].m, l[g] = run[g].l;
    return 0;
}

/* A run of keys [k0, k1) of KV head h for nrows sequences, members[row0 .. row0 + nrows):
 * one shared-prefix group's (their tables agree on those keys' blocks) or one sequence's own.
 * Its partial states, per member and query head (m, l, acc [D]), start at slots + slot. */
typedef struct {
    int64_t h, k0, k1, row0, nrows, slot;
} PdSegment;

/* Groups of sequences whose tables start with the same blocks: members[] lists each group's
 * sequences (at most MAX_NG / G per group, so that one pass serves them), then every sequence
 * once by itself; shared[b] is the keys sequence b shares with its group (0: none). Two
 * sequences share a block when their tables name the same physical block: a prefix-cache hit
 * on the same prompt head (only full blocks are ever shared). A group forms around its first
 * sequence (lead): of the later ones starting with lead's first block, each sharing `same`
 * leading blocks with lead, it takes those sharing at least c blocks, c chosen to save the
 * most reads (c x the others taken); the rest may group among themselves. Returns the number
 * of groups; their first members and sizes go to group_row0 / group_rows. same, sorted:
 * scratch [num_seqs]. */
static int pd_descending(const void *x, const void *y) {
    const int64_t a = *(const int64_t *)x, b = *(const int64_t *)y;
    return (a < b) - (a > b);
}

static int64_t pd_find_groups(const PdArgs *a, int64_t num_seqs, int64_t *members,
                              int64_t *shared, int64_t *group_row0, int64_t *group_rows,
                              int64_t *same, int64_t *sorted) {
    const int64_t bs = a->block_size, per_group = MAX_NG / a->group, width = a->max_blocks;
    const int64_t *tables = a->block_tables;
    int64_t num_groups = 0, used = 0;
    for (int64_t b = 0; b < num_seqs; b++) shared[b] = -1; /* -1: not placed yet */
    for (int64_t lead = 0; lead < num_seqs; lead++) {
        const int64_t full = a->seq_lens[lead] > 0 ? a->seq_lens[lead] / bs : 0;
        if (shared[lead] >= 0 || full == 0) continue;
        const int64_t *head = tables + lead * width;
        int64_t num_same = 0; /* sorted[]: the nonzero same[] values, largest first */
        for (int64_t b = lead + 1; b < num_seqs; b++) {
            const int64_t full_b = a->seq_lens[b] > 0 ? a->seq_lens[b] / bs : 0;
            const int64_t limit = full_b < full ? full_b : full;
            same[b] = 0;
            if (shared[b] >= 0) continue;
            while (same[b] < limit && tables[b * width + same[b]] == head[same[b]]) same[b]++;
            if (same[b] > 0) sorted[num_same++] = same[b];
        }
        qsort(sorted, (size_t)num_same, sizeof(int64_t), pd_descending);
        int64_t best = 0, best_saved = 0; /* c, and the reads it saves */
        for (int64_t i = 0; i < num_same; i++) {
            const int64_t takers = i + 1 < per_group - 1 ? i + 1 : per_group - 1;
            if (sorted[i] * takers > best_saved) best = sorted[i], best_saved = sorted[i] * takers;
        }
        if (best == 0) continue; /* nobody shares lead's first block */
        const int64_t row0 = used;
        members[used++] = lead;
        for (int64_t b = lead + 1; b < num_seqs && used - row0 < per_group; b++)
            if (shared[b] < 0 && same[b] >= best) members[used++] = b;
        for (int64_t i = row0; i < used; i++) shared[members[i]] = best * bs;
        group_row0[num_groups] = row0;
        group_rows[num_groups++] = used - row0;
    }
    for (int64_t b = 0; b < num_seqs; b++) {
        if (shared[b] < 0) shared[b] = 0;
        members[used + b] = b;
    }
    return num_groups;
}

/* The grouping baton_paged_decode uses for these tables (tests): shared[b] as above, and
 * group_of[b] the index of b's group (-1: none). Returns the number of groups, or -1 / -2 as
 * baton_paged_decode_isa. */
int baton_paged_decode_groups(const int64_t *block_tables, int64_t max_blocks,
                              const int64_t *seq_lens, int64_t num_seqs, int64_t group,
                              int64_t block_size, int64_t *shared, int64_t *group_of) {
    if (group <= 0 || group > MAX_G || block_size <= 0) return -1;
    PdArgs a = {0};
    a.block_tables = block_tables, a.seq_lens = seq_lens, a.max_blocks = max_blocks;
    a.group = group, a.block_size = block_size;
    int64_t *scratch = malloc(sizeof(int64_t) * (size_t)(6 * (num_seqs > 0 ? num_seqs : 1)));
    if (scratch == NULL) return -2;
    int64_t *members = scratch, *row0 = scratch + 2 * num_seqs, *rows = scratch + 3 * num_seqs;
    const int64_t n = pd_find_groups(&a, num_seqs, members, shared, row0, rows,
                                     scratch + 4 * num_seqs, scratch + 5 * num_seqs);
    for (int64_t b = 0; b < num_seqs; b++) group_of[b] = -1;
    for (int64_t g = 0; g < n; g++)
        for (int64_t i = row0[g]; i < row0[g] + rows[g]; i++) group_of[members[i]] = g;
    free(scratch);
    return (int)n;
}

/* Fold partial state (m, l, acc) into (run, total): the log-sum-exp merge of two softmaxes. */
static inline void pd_merge(PdRunning *run, float *total, float m, float l, const float *acc,
                            int64_t d) {
    const float m_new = fmaxf(run->m, m);
    const float ca = run->m == -INFINITY ? 0.0f : expf(run->m - m_new);
    const float cb = m == -INFINITY ? 0.0f : expf(m - m_new);
    *run = (PdRunning){m_new, run->l * ca + l * cb};
    for (int64_t e = 0; e < d; e++) total[e] = total[e] * ca + acc[e] * cb;
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
    const int64_t group = num_kv_heads > 0 ? num_heads / num_kv_heads : 0;
    if (num_kv_heads <= 0 || group * num_kv_heads != num_heads || group > MAX_G ||
        head_dim % 8 != 0 || head_dim > PD_MAX_D || head_dim <= 0 || block_size <= 0)
        return -1;
    if (isa == 1 && !baton_paged_decode_has_avx512()) return -3;
    if (num_seqs <= 0) return 0;
    const int wide = isa == 1 && head_dim % 16 == 0;
    const PdArgs a = {q,          cache,        stride_kv,      stride_head, stride_block,
                    stride_token, block_tables, seq_lens,     max_blocks,  num_heads,
                    num_kv_heads, group,        head_dim,       block_size,  scale};
    const int64_t D = head_dim, KVH = num_kv_heads, state_floats = 2 + D;
    int rc = -2;
    int64_t *members = malloc(sizeof(int64_t) * (size_t)(2 * num_seqs));
    int64_t *shared = malloc(sizeof(int64_t) * (size_t)num_seqs);
    int64_t *group_row0 = malloc(sizeof(int64_t) * (size_t)num_seqs);
    int64_t *group_rows = malloc(sizeof(int64_t) * (size_t)num_seqs);
    int64_t *same = malloc(sizeof(int64_t) * (size_t)(2 * num_seqs));
    PdSegment *segments = NULL;
    float *slots = NULL, *scratch = NULL, *totals = NULL;
    PdRunning *runs = NULL;
    if (!members || !shared || !group_row0 || !group_rows || !same) goto done;
    const int64_t num_groups = pd_find_groups(&a, num_seqs, members, shared, group_row0, group_rows, same, same + num_seqs);
    int64_t single0 = 0; /* members[single0 + b] == b */
    for (int64_t g = 0; g < num_groups; g++) single0 += group_rows[g];

    /* the tasks: each group's shared keys, then each sequence's own, per KV head; their work
     * (keys x query vectors) sets how many segments each is cut into */
    int64_t work = 0;
    for (int64_t g = 0; g < num_groups; g++)
        work += shared[members[group_row0[g]]] * group_rows[g];
    for (int64_t b = 0; b < num_seqs; b++)
        if (seq_lens[b] > shared[b]) work += seq_lens[b] - shared[b];
    work *= KVH;
    const int threads = work >= 2 * 64 ? omp_get_max_threads() : 1;
    int64_t pieces = work / PD_PIECE_KEYS;
    pieces = threads == 1 ? 1 : pieces < threads ? threads : pieces > 8 * threads ? 8 * threads : pieces;
    const int64_t piece_work = work / pieces > 0 ? work / pieces : 1;
    int64_t num_segments = 0, slot_floats = 0;
    for (int pass = 0; pass < 2; pass++) {
        num_segments = slot_floats = 0;
        for (int64_t t = 0; t < num_groups + num_seqs; t++) {
            const int own = t >= num_groups;
            const int64_t row0 = own ? single0 + (t - num_groups) : group_row0[t];
            const int64_t nrows = own ? 1 : group_rows[t];
            const int64_t b = members[row0];
            const int64_t k0 = own ? shared[b] : 0;
            const int64_t k1 = own ? (seq_lens[b] > 0 ? seq_lens[b] : 0) : shared[b];
            if (k1 <= k0) continue;
            int64_t cuts = ((k1 - k0) * nrows + piece_work - 1) / piece_work;
            cuts = cuts < 1 ? 1 : cuts > k1 - k0 ? k1 - k0 : cuts;
            for (int64_t h = 0; h < KVH; h++)
                for (int64_t c = 0; c < cuts; c++) {
                    if (pass == 1)
                        segments[num_segments] = (PdSegment){
                            h, k0 + (k1 - k0) * c / cuts, k0 + (k1 - k0) * (c + 1) / cuts,
                            row0, nrows, slot_floats};
                    num_segments++;
                    slot_floats += nrows * group * state_floats;
                }
        }
        if (pass == 0) {
            segments = malloc(sizeof(PdSegment) * (size_t)(num_segments > 0 ? num_segments : 1));
            slots = malloc(sizeof(float) * (size_t)(slot_floats > 0 ? slot_floats : 1));
            /* per thread: the gathered query vectors, their acc [MAX_NG, D] and states */
            scratch = pd_aligned_floats(threads * (2 * MAX_NG * D + 2 * MAX_NG));
            if (!segments || !slots || !scratch) goto done;
        }
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t i = 0; i < num_segments; i++) {
        const PdSegment *sg = &segments[i];
        float *qbuf = scratch + (size_t)omp_get_thread_num() * (2 * MAX_NG * D + 2 * MAX_NG);
        float *acc = qbuf + MAX_NG * D;
        PdRunning *run = (PdRunning *)(acc + MAX_NG * D);
        const int64_t ng = sg->nrows * group;
        const float *qg;
        if (sg->nrows == 1) {
            qg = q + (members[sg->row0] * num_heads + sg->h * group) * D;
        } else { /* the members' G query vectors of head h, one matrix */
            for (int64_t r = 0; r < sg->nrows; r++)
                memcpy(qbuf + r * group * D, q + (members[sg->row0 + r] * num_heads + sg->h * group) * D,
                       sizeof(float) * (size_t)(group * D));
            qg = qbuf;
        }
        for (int64_t v = 0; v < ng; v++) run[v] = (PdRunning){-INFINITY, 0.0f};
        memset(acc, 0, sizeof(float) * (size_t)(ng * D));
        /* the group's keys are in every member's table: its first member's names them */
        const int64_t *table = block_tables + members[sg->row0] * max_blocks;
        if (wide)
            pd_attend_avx512(&a, qg, ng, NULL, table, sg->h, sg->k0, sg->k1, run, acc);
        else
            pd_attend_avx2(&a, qg, ng, NULL, table, sg->h, sg->k0, sg->k1, run, acc);
        float *slot = slots + sg->slot;
        for (int64_t v = 0; v < ng; v++) {
            slot[v * state_floats] = run[v].m;
            slot[v * state_floats + 1] = run[v].l;
            memcpy(slot + v * state_floats + 2, acc + v * D, sizeof(float) * (size_t)D);
        }
    }
    /* each (sequence, head)'s segments, merged in key order: the segments were laid out
     * groups' shared keys first, each task's cuts in key order */
    totals = calloc((size_t)(num_seqs * num_heads * D), sizeof(float));
    runs = malloc(sizeof(PdRunning) * (size_t)(num_seqs * num_heads));
    if (!totals || !runs) goto done;
    for (int64_t e = 0; e < num_seqs * num_heads; e++) runs[e] = (PdRunning){-INFINITY, 0.0f};
    for (int64_t i = 0; i < num_segments; i++) {
        const PdSegment *sg = &segments[i];
        for (int64_t r = 0; r < sg->nrows; r++) {
            const int64_t b = members[sg->row0 + r];
            for (int64_t g = 0; g < group; g++) {
                const int64_t head = b * num_heads + sg->h * group + g;
                const float *st = slots + sg->slot + (r * group + g) * state_floats;
                pd_merge(&runs[head], totals + head * D, st[0], st[1], st + 2, D);
            }
        }
    }
    /* out = acc / l (zeros for a sequence with no keys) */
    for (int64_t head = 0; head < num_seqs * num_heads; head++) {
        const float inv = runs[head].l > 0.0f ? 1.0f / runs[head].l : 0.0f;
        for (int64_t e = 0; e < D; e++) out[head * D + e] = totals[head * D + e] * inv;
    }
    rc = 0;
done:
    free(members);
    free(shared);
    free(group_row0);
    free(group_rows);
    free(same);
    free(segments);
    free(slots);
    free(scratch);
    free(totals);
    free(runs);
    return rc;
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
