/* One decode step of a Llama-family decoder in one C call: the whole layer stack (and
 * optionally the output projection) for R decode rows, each one token of its own sequence
 * (its own context length and block table), CPU float32, weights read straight from their
 * GGUF blocks (Q4_1 / Q8_0), every weight once per step whatever R.
 *
 * Why: per token the unfused path runs ~15 torch ops and ~6 ctypes calls per layer; at batch 1
 * on SmolLM2 that dispatch was ~2.5 ms of a ~12.9 ms step. Here one OpenMP parallel region
 * spans the whole step: the matrix products (all R rows at once, decode_matrix.c) and the
 * attention (one task per row and KV head, reading its keys and values once for the group's
 * query heads) are shared out with `omp for` (one barrier
 * each, five per layer whatever R); the small vector ops (RMSNorm, residual adds, block sums
 * and int8 blocks of the activations) are computed by every thread on its own private copy of
 * the R rows, so they need no barrier.
 *
 * The arithmetic is the unfused path's, operation for operation, so greedy tokens stay those of
 * transformers; and each row's is the same whatever R (a row's numbers never depend on which
 * rows share its step):
 *   - RMSNorm: baton_rms_norm (rms_norm.c), called as is;
 *   - matrix rows: see decode_matrix.c (gguf_gemm.c's one-row arithmetic per output element:
 *     AVX-512 for Q4_1 where the caller asks for it, AVX2 otherwise; with more than one row the
 *     unfused path takes AVX2 up to 8 rows and dense float32 above, another summation order);
 *   - RoPE: x' = x c - y s, y' = x s + y c on rotation pairs, products rounded before the add
 *     (torch's complex multiply, checked bit for bit by the tests);
 *   - attention: per query head, two passes (scores eight keys at a time, softmax, the
 *     weighted values in position order), shared out by (row, KV head);
 *   - SwiGLU: silu(g) * u with silu(g) = g / (1 + e^-g); the one place the values may differ
 *     from torch's in the last bit (its vectorized exp is another polynomial).
 * With int8_isa set (the opt-in int8_activations), every product's input rows are quantized
 * per 32 values (baton_quantize_row_q8) and rows are summed with gguf_gemm.c's integer-dot
 * tiles, as baton_gguf_gemm_q8 computes a row (the AVX-512 VNNI choice takes the 256-bit
 * VNNI tile here, so only its summation order differs from the unfused path's), for any R:
 * the unfused path quantizes up to 8 rows and multiplies dense float32 above.
 *
 * KV cache per layer: head-major [2, KVH, num_blocks, block_size, D] (engine/attention/
 * kv_layout.py), addressed by element strides like paged_decode.c. A row's key and value
 * go to slot table[p / block_size] * block_size + p % block_size of its position p.
 * Build: see engine/native.py (which hashes this file and the files it includes).
 */
#include <omp.h>
#include <stdlib.h>

#include "gguf_gemm.c"
#include "../attention/paged_decode.c"
#include "rms_norm.c"
#include "decode_matrix.c"

typedef struct {
    ds_matrix qkv;     /* [(H + 2 KVH) D, E], q and k rows in rotation-pair order */
    ds_matrix o;       /* [E, H D] */
    ds_matrix gate_up; /* [2 I, E]: gate rows, then up rows */
    ds_matrix down;    /* [E, I] */
    const float *input_norm, *post_norm; /* [E] */
    float *kv_cache; /* head-major [2, KVH, num_blocks, block_size, D] */
} ds_layer;

typedef struct {
    int64_t num_layers, hidden, intermediate, num_heads, num_kv_heads, head_dim;
    int64_t block_size, stride_kv, stride_head, stride_block, stride_token; /* in elements */
    int64_t max_positions, vocab;
    float eps, scale;
    int32_t avx512; /* 1: Q4_1 rows with the AVX-512 kernel (gguf_kernel.gemv_isa's choice) */
    const ds_layer *layers;  /* [num_layers] */
    const float *final_norm; /* [E] */
    const float *embed;      /* [vocab, E] */
    const float *rope;       /* [max_positions, D / 2, 2]: (cos, sin) of each rotation pair */
    ds_matrix head;          /* output projection; blocks NULL: logits are not computed here */
    int32_t int8_isa;        /* 0: float32 activations; else BATON_I8_* (int8_activations) */
} ds_model;

/* Parts of the step, timed by thread 0 when the caller passes a timings array. */
enum {
    T_NORM,      /* RMSNorms, residual adds, block sums (every thread, private copies) */
    T_QKV,       /* qkv product */
    T_ATTENTION, /* RoPE, the KV cache write and the attention over the paged cache */
    T_O,         /* output projection of attention */
    T_GATE_UP,   /* gate/up product and SwiGLU */
    T_DOWN,      /* down product */
    T_HEAD,      /* logits */
    T_PARTS
};

/* RoPE of `heads` rows of D from src into dst: pairs (x, y) -> (x c - y s, y c + x s), each
 * product rounded before the add, as torch's complex multiply. Written with intrinsics: GCC 12
 * turns the plain C of a complex multiply into vfmaddsub (fused, despite -ffp-contract=off). */
static void rope_rows(const float *src, int64_t heads, int64_t D, const float *rot, float *dst) {
    for (int64_t i = 0; i < D; i += 8) {
        const __m256 cs = _mm256_loadu_ps(rot + i);     /* c0 s0 c1 s1 ... */
        const __m256 c = _mm256_moveldup_ps(cs);        /* c0 c0 c1 c1 ... */
        const __m256 s = _mm256_movehdup_ps(cs);        /* s0 s0 s1 s1 ... */
        for (int64_t h = 0; h < heads; h++) {
            const __m256 v = _mm256_loadu_ps(src + h * D + i);         /* x0 y0 x1 y1 ... */
            const __m256 swapped = _mm256_permute_ps(v, 0xB1);        /* y0 x0 y1 x1 ... */
            /* even lanes x c - y s, odd lanes y c + x s */
            _mm256_storeu_ps(dst + h * D + i,
                             _mm256_addsub_ps(_mm256_mul_ps(v, c), _mm256_mul_ps(swapped, s)));
        }
    }
}

/* Attention of ng query heads of one KV head (q: their roped queries [ng, D]; k_head, v_head:
 * that KV head's base in the cache) over its len keys and values, into o [ng, D]: for each
 * head the same two passes (scores eight keys at a time, softmax, the weighted values summed
 * in position order), so a head's numbers do not depend on ng or on which heads share its
 * call. The heads share each key and value row while it is in L1
 * (pass 1: a chunk of 8 keys; pass 2: a tile of ATTEND_TILE values), so the group's keys and
 * values are read from memory once instead of once per head.
 * The last position's key and value (this step's token) are read from new_k, new_v instead
 * of the cache: the same values, so the cache write needs no barrier before the attention.
 * scores: [ng, len] scratch. */
#define ATTEND_TILE 32
static void attend_heads(const float *q, int64_t ng, const float *k_head, const float *v_head,
                         const float *new_k, const float *new_v, int64_t stride_block,
                         int64_t stride_token, const int64_t *table, int64_t len,
                         int64_t head_dim, int64_t block_size, float scale, float *scores,
                         float *o) {
#define KEY(t)                                                                                     \
    ((t) == len - 1 ? new_k                                                                        \
                    : k_head + table[(t) / block_size] * stride_block +                           \
                          ((t) % block_size) * stride_token)
#define VALUE(t)                                                                                   \
    ((t) == len - 1 ? new_v                                                                        \
                    : v_head + table[(t) / block_size] * stride_block +                           \
                          ((t) % block_size) * stride_token)
    const __m256 scale_v = _mm256_set1_ps(scale);
    int64_t t0 = 0;
    for (; t0 + 8 <= len; t0 += 8) {
        const float *k[8];
        for (int j = 0; j < 8; j++) k[j] = KEY(t0 + j);
        for (int64_t g = 0; g < ng; g++) {
            const float *qv = q + g * head_dim;
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
    for (int64_t t = t0; t < len; t++)
        for (int64_t g = 0; g < ng; g++)
            scores[g * len + t] = dot(q + g * head_dim, KEY(t), head_dim) * scale;
    float norms[MAX_G];
    for (int64_t g = 0; g < ng; g++) {
        float *sg = scores + g * len;
        float m = -INFINITY, sum = 0.0f;
        for (int64_t t = 0; t < len; t++) m = sg[t] > m ? sg[t] : m;
        const __m256 mv = _mm256_set1_ps(m);
        __m256 sums = _mm256_setzero_ps();
        int64_t t = 0;
        for (; t + 8 <= len; t += 8) {
            __m256 p = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(sg + t), mv));
            _mm256_storeu_ps(sg + t, p);
            sums = _mm256_add_ps(sums, p);
        }
        sum = hsum(sums);
        for (; t < len; t++) {
            sg[t] = expf(sg[t] - m);
            sum += sg[t];
        }
        norms[g] = 1.0f / sum;
    }
    /* pass 2 by tiles of positions: o[g] holds head g's running sums between tiles (stored and
     * loaded back unchanged: the sums are those of one pass over every position in order) */
    for (int64_t tile = 0; tile < len; tile += ATTEND_TILE) {
        const int64_t end = tile + ATTEND_TILE < len ? tile + ATTEND_TILE : len;
        const float *vs[ATTEND_TILE];
        for (int64_t t = tile; t < end; t++) vs[t - tile] = VALUE(t);
        for (int64_t i0 = 0; i0 < head_dim; i0 += 64) {
            const int64_t lanes = head_dim - i0 < 64 ? (head_dim - i0) / 8 : 8;
            for (int64_t g = 0; g < ng; g++) {
                const float *pg = scores + g * len;
                float *og = o + g * head_dim + i0;
                __m256 acc[8];
                for (int64_t i = 0; i < lanes; i++)
                    acc[i] = tile == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(og + 8 * i);
                for (int64_t t = tile; t < end; t++) {
                    const float *v = vs[t - tile] + i0;
                    const __m256 p = _mm256_set1_ps(pg[t]);
                    for (int64_t i = 0; i < lanes; i++)
                        acc[i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * i), acc[i]);
                }
                for (int64_t i = 0; i < lanes; i++) _mm256_storeu_ps(og + 8 * i, acc[i]);
            }
        }
    }
    for (int64_t g = 0; g < ng; g++) {
        const __m256 norm = _mm256_set1_ps(norms[g]);
        float *og = o + g * head_dim;
        for (int64_t i = 0; i < head_dim; i += 8)
            _mm256_storeu_ps(og + i, _mm256_mul_ps(_mm256_loadu_ps(og + i), norm));
    }
#undef KEY
#undef VALUE
}

static int matrix_ok(const ds_matrix *w, int64_t n, int64_t k) {
    return w->blocks != NULL && w->n == n && w->k == k && k % QK == 0 &&
           block_bytes_of(w->type) != 0;
}

/* Shapes this step takes; 0 if fine, else -1. */
static int check_model(const ds_model *m) {
    const int64_t E = m->hidden, I = m->intermediate, H = m->num_heads, KVH = m->num_kv_heads,
                  D = m->head_dim;
    if (E <= 0 || E % 8 || D % 8 || KVH <= 0 || H % KVH || H / KVH > MAX_G || m->block_size <= 0)
        return -1;
    if (m->avx512 && !baton_cpu_has_avx512()) return -1;
    if (m->int8_isa && (m->int8_isa < BATON_I8_AVX2 || m->int8_isa > BATON_I8_AVX512VNNI ||
                        !(baton_cpu_int8_isas() & (1 << m->int8_isa))))
        return -1;
    for (int64_t l = 0; l < m->num_layers; l++) {
        const ds_layer *L = &m->layers[l];
        if (!matrix_ok(&L->qkv, (H + 2 * KVH) * D, E) || !matrix_ok(&L->o, E, H * D) ||
            !matrix_ok(&L->gate_up, 2 * I, E) || !matrix_ok(&L->down, E, I))
            return -1;
    }
    if (m->head.blocks != NULL && !matrix_ok(&m->head, m->vocab, E)) return -1;
    return 0;
}

/* Whether the rows can share one step: no row's new slot lies in a block another row reads
 * (positions before its own new one) or writes. The scheduler guarantees it (a block being
 * filled belongs to one sequence; only full blocks are shared), and it is what lets a row's
 * cache write go unsynchronized with the others' attention. 1 if fine. O(R * blocks read). */
static int rows_disjoint(const int64_t *tables, int64_t width, const int64_t *seq_lens, int64_t R,
                         int64_t bs) {
    for (int64_t r = 0; r < R; r++) {
        const int64_t new_block = tables[r * width + (seq_lens[r] - 1) / bs];
        for (int64_t s = 0; s < R; s++) {
            if (s == r) continue;
            const int64_t *t = tables + s * width;
            if (t[(seq_lens[s] - 1) / bs] == new_block) return 0;
            for (int64_t j = 0; j * bs < seq_lens[s] - 1; j++)
                if (t[j] == new_block) return 0;
        }
    }
    return 1;
}

/* Runs the decoder stack for R decode rows, row r one token tokens[r] at position
 * seq_lens[r] - 1 of its own sequence, whose keys live in the blocks of its block table
 * (tables [R, width], at least ceil(seq_lens[r] / block_size) entries used): writes every
 * row's keys and values into every layer's cache, the final-normed hidden states into
 * hidden [R, E] and, where the model has a head and logits is not NULL, the logits of rows
 * logit_rows (strictly increasing, num_logit_rows of them) into logits [num_logit_rows, vocab].
 * Each row's results are those the step computes for that row alone (R = 1).
 * timings: NULL, or [T_PARTS] seconds that thread 0 adds its time per part to.
 * Returns 0; -1 for a shape, token, position or row set it does not take (nothing written
 * then); -2 when scratch memory failed. */
int baton_decode_rows(const ds_model *m, int64_t R, const int64_t *tokens, const int64_t *tables,
                      int64_t width, const int64_t *seq_lens, const int64_t *logit_rows,
                      int64_t num_logit_rows, float *hidden, float *logits, double *timings) {
    const int64_t E = m->hidden, I = m->intermediate, H = m->num_heads, KVH = m->num_kv_heads,
                  D = m->head_dim, G = m->num_heads / (m->num_kv_heads ? m->num_kv_heads : 1);
    if (check_model(m) != 0 || R < 1 || num_logit_rows < 0 || num_logit_rows > R) return -1;
    int64_t max_len = 0;
    for (int64_t r = 0; r < R; r++) {
        const int64_t blocks = (seq_lens[r] + m->block_size - 1) / m->block_size;
        if (tokens[r] < 0 || tokens[r] >= m->vocab || seq_lens[r] < 1 ||
            seq_lens[r] > m->max_positions || blocks > width)
            return -1;
        max_len = seq_lens[r] > max_len ? seq_lens[r] : max_len;
    }
    for (int64_t i = 0; i < num_logit_rows; i++)
        if (logit_rows[i] < i || logit_rows[i] >= R ||
            (i > 0 && logit_rows[i] <= logit_rows[i - 1]))
            return -1;
    if (R > 1 && !rows_disjoint(tables, width, seq_lens, R, m->block_size)) return -1;
    const int64_t q_size = H * D, kv_size = KVH * D, qkv_n = q_size + 2 * kv_size;
    const int64_t max_k = I > E ? (I > q_size ? I : q_size) : (E > q_size ? E : q_size);
    /* shared: qkv, attention output, a product's output, the SwiGLU activations (all [R, .]);
     * then per thread (private): residuals x and normed xn [R, E], roped q and k of one head,
     * block sums, int8 scales [R, max_k / 32] (three), attention scores [G, max_len], int8
     * quants [R, max_k] bytes */
    const int64_t own_size =
        2 * R * E + (G + 1) * D + 3 * R * (max_k / QK) + G * max_len + R * max_k / 4;
    const int threads = omp_get_max_threads();
    /* A KV head's query heads go to `runs` tasks of run_len heads: one task per KV head reads
     * its keys and values once for all its heads; with fewer than two tasks a thread, the
     * groups are split so that the threads share the attention (a head's numbers are the same
     * whichever run computes it). */
    const int64_t wanted = (2 * threads + R * KVH - 1) / (R * KVH);
    const int64_t runs_asked = wanted < 1 ? 1 : wanted > G ? G : wanted;
    const int64_t run_len = (G + runs_asked - 1) / runs_asked, runs = (G + run_len - 1) / run_len;
    float *shared = malloc(sizeof(float) *
                           (size_t)(R * (qkv_n + q_size + E + I) + threads * own_size));
    if (shared == NULL) return -2;
    float *qkv = shared, *attn = qkv + R * qkv_n, *tmp = attn + R * q_size, *act = tmp + R * E;
    float *own_all = act + R * I;
#pragma omp parallel num_threads(threads)
    {
        const int64_t nb = R * (max_k / QK);
        float *x = own_all + omp_get_thread_num() * own_size, *xn = x + R * E, *q = xn + R * E,
              *k = q + G * D, *xsum = k + D, *xd = xsum + nb, *xs = xd + nb, *scores = xs + nb;
        int8_t *xq = (int8_t *)(scores + G * max_len); /* R * max_k bytes */
        ds_input in = {.avx512 = m->avx512, .int8_isa = m->int8_isa};
        const int timed = timings != NULL && omp_get_thread_num() == 0;
        double t_prev = timed ? omp_get_wtime() : 0.0;
#define MARK(part)                                                                                 \
    do {                                                                                           \
        if (timed) {                                                                               \
            const double t_now = omp_get_wtime();                                                  \
            timings[part] += t_now - t_prev;                                                       \
            t_prev = t_now;                                                                        \
        }                                                                                          \
    } while (0)
        for (int64_t r = 0; r < R; r++)
            memcpy(x + r * E, m->embed + tokens[r] * E, sizeof(float) * (size_t)E);
        for (int64_t l = 0; l < m->num_layers; l++) {
            const ds_layer *L = &m->layers[l];
            baton_rms_norm(x, R, E, L->input_norm, m->eps, xn);
            prepare_input(&in, xn, R, E, xsum, xq, xd, xs);
            MARK(T_NORM);
            matrix_for(&L->qkv, &in, R, qkv);
            MARK(T_QKV);
            /* one task per (row, KV head, run of its query heads): RoPE of those q heads and
             * of the k head, the attention; the task of a group's first run also writes the
             * row's key and value of that KV head to the cache. Nobody waits for the write: the
             * attention reads this step's key and value from k and qkv, the cache only at
             * other rows' blocks and positions before this one (rows_disjoint). */
            OMP_FOR(HEADS_SCHEDULE)
            for (int64_t task = 0; task < R * KVH * runs; task++) {
                const int64_t r = task / (KVH * runs), h = task / runs % KVH, run = task % runs;
                const int64_t g0 = run * run_len, ng = g0 + run_len < G ? run_len : G - g0;
                const int64_t pos = seq_lens[r] - 1, *table = tables + r * width;
                const float *rot = m->rope + pos * D; /* (cos, sin) pairs of this position */
                const float *row = qkv + r * qkv_n, *v = row + q_size + kv_size + h * D;
                rope_rows(row + (h * G + g0) * D, ng, D, rot, q);
                rope_rows(row + q_size + h * D, 1, D, rot, k);
                float *k_head = L->kv_cache + h * m->stride_head;
                if (run == 0) {
                    float *k_dst = k_head + table[pos / m->block_size] * m->stride_block +
                                   (pos % m->block_size) * m->stride_token;
                    memcpy(k_dst, k, sizeof(float) * (size_t)D);
                    memcpy(k_dst + m->stride_kv, v, sizeof(float) * (size_t)D);
                }
                attend_heads(q, ng, k_head, k_head + m->stride_kv, k, v, m->stride_block,
                             m->stride_token, table, seq_lens[r], D, m->block_size, m->scale,
                             scores, attn + r * q_size + (h * G + g0) * D);
            }
            MARK(T_ATTENTION);
            prepare_input(&in, attn, R, q_size, xsum, xq, xd, xs);
            MARK(T_NORM);
            matrix_for(&L->o, &in, R, tmp);
            MARK(T_O);
            for (int64_t e = 0; e < R * E; e++) x[e] = x[e] + tmp[e];
            baton_rms_norm(x, R, E, L->post_norm, m->eps, xn);
            prepare_input(&in, xn, R, E, xsum, xq, xd, xs);
            MARK(T_NORM);
            swiglu_for(&L->gate_up, &in, R, I, act);
            MARK(T_GATE_UP);
            prepare_input(&in, act, R, I, xsum, xq, xd, xs);
            MARK(T_NORM);
            matrix_for(&L->down, &in, R, tmp);
            MARK(T_DOWN);
            for (int64_t e = 0; e < R * E; e++) x[e] = x[e] + tmp[e];
        }
        baton_rms_norm(x, R, E, m->final_norm, m->eps, xn);
#pragma omp master
        memcpy(hidden, xn, sizeof(float) * (size_t)(R * E));
        if (m->head.blocks != NULL && logits != NULL && num_logit_rows > 0) {
            /* the logit rows to the front of xn (logit_rows[i] >= i: in place) */
            for (int64_t i = 0; i < num_logit_rows; i++)
                if (logit_rows[i] != i)
                    memcpy(xn + i * E, xn + logit_rows[i] * E, sizeof(float) * (size_t)E);
            prepare_input(&in, xn, num_logit_rows, E, xsum, xq, xd, xs);
            MARK(T_NORM);
            matrix_for(&m->head, &in, num_logit_rows, logits); /* Q8_0: AVX2 (or int8) rows */
            MARK(T_HEAD);
        } else {
            MARK(T_NORM);
        }
#undef MARK
    }
    free(shared);
    return 0;
}
