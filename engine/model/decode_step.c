/* One batch-1 decode step of a Llama-family decoder in one C call: the whole layer stack (and
 * optionally the output projection) for ONE token, CPU float32, weights read straight from
 * their GGUF blocks (Q4_1 / Q8_0).
 *
 * Why: per token the unfused path runs ~15 torch ops and ~6 ctypes calls per layer; at batch 1
 * on SmolLM2 that dispatch was ~2.5 ms of a ~12.9 ms step. Here one OpenMP parallel region
 * spans the whole step: the matrix products and the attention are shared out with `omp for`
 * (one barrier each); the small vector ops (RMSNorm, RoPE of q, residual adds, block sums of the
 * activations) are computed by every thread on its own private copy, so they need no barrier.
 *
 * The arithmetic is the unfused path's, operation for operation, so greedy tokens stay those of
 * transformers:
 *   - RMSNorm: baton_rms_norm (rms_norm.c), called as is;
 *   - matrix rows: each output row is computed exactly as gguf_gemm.c computes it for one row
 *     of x (gemv_avx512 for Q4_1 where the caller asks for AVX-512, baton_gguf_gemm's AVX2 loop
 *     otherwise, as gguf_kernel.gguf_matmul chooses); only which thread computes a row differs;
 *     a bias is added after the row sum (torch's y.add_(bias));
 *   - RoPE: x' = x c - y s, y' = x s + y c on rotation pairs, products rounded before the add
 *     (torch's complex multiply, checked bit for bit by the tests);
 *   - attention: paged_decode.c's arithmetic per query head (pass 1 eight keys at a time,
 *     softmax, pass 2), shared out by query head instead of by KV head;
 *   - SwiGLU: silu(g) * u with silu(g) = g / (1 + e^-g); the one place the values may differ
 *     from torch's in the last bit (its vectorized exp is another polynomial).
 * With int8_isa set (the opt-in int8_activations), every product's input vector is quantized
 * per 32 values (baton_quantize_row_q8) and rows are summed with gguf_gemm.c's integer-dot
 * tiles, as baton_gguf_gemm_q8 computes one row (the AVX-512 VNNI choice takes the 256-bit
 * VNNI tile here, so only its summation order differs from the unfused path's).
 *
 * KV cache per layer: head-major [2, KVH, num_blocks, block_size, D] (engine/attention/
 * kv_layout.py), addressed by element strides like paged_decode.c. The token's key and value
 * go to slot block_table[p / block_size] * block_size + p % block_size of position p.
 * Build: see engine/native.py (which hashes this file and the files it includes).
 */
#include <omp.h>
#include <stdlib.h>

#include "gguf_gemm.c"
#include "../attention/paged_decode.c"
#include "rms_norm.c"

/* One weight matrix W [n, k] in GGUF blocks, with an optional bias [n]. */
typedef struct {
    const uint8_t *blocks; /* [n, k / 32 * block bytes] */
    const float *bias;     /* [n] or NULL */
    int64_t n, k;
    int32_t type; /* GGML type id: 3 Q4_1, 8 Q8_0 */
} ds_matrix;

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

/* The input vector of a product, as every kernel wants it: x [K], its block sums, and with
 * int8 its quantized blocks (q [K], scales d and d * sum(q) [K / 32]). Per thread. */
typedef struct {
    const float *x, *xsum;
    const int8_t *xq;
    const float *xd, *xs;
    int avx512, int8_isa;
} ds_input;

/* Parts of the step, timed by thread 0 when the caller passes a timings array. */
enum {
    T_NORM,      /* RMSNorms, residual adds, block sums (every thread, private copies) */
    T_QKV,       /* qkv product */
    T_ROPE_KV,   /* RoPE (every thread) and the KV cache write (one thread, no wait) */
    T_ATTENTION, /* attention over the paged cache */
    T_O,         /* output projection of attention */
    T_GATE_UP,   /* gate/up product and SwiGLU */
    T_DOWN,      /* down product */
    T_HEAD,      /* logits */
    T_PARTS
};

/* Work sharing: guided chunks (half of what is left per grab, down to 32 matrix rows / 32
 * SwiGLU outputs) and one attention head at a time: a thread the OS has descheduled leaves its
 * share to the others instead of holding up the barrier with half of every product (at load ~7
 * on the 2 shared cores dynamic chunks took 133 vs 159 ms per step with static halves), while
 * on a quiet machine guided costs what static does (7.76 vs 7.70 ms per step at 2 threads;
 * dynamic chunks of 32 rows: 9.02 ms). Which thread computes a row never changes its value.
 * -DROWS_SCHEDULE=... (with the other two) at build time overrides them, for A/B runs. */
#ifndef ROWS_SCHEDULE
#define ROWS_SCHEDULE schedule(guided, 16)
#define SWIGLU_SCHEDULE schedule(guided, 4)
#define HEADS_SCHEDULE schedule(dynamic, 1)
#endif
#define PRAGMA(x) _Pragma(#x)
#define OMP_FOR(sched) PRAGMA(omp for sched)

static inline int64_t block_bytes_of(int32_t type) { return type == 3 ? 20 : type == 8 ? 34 : 0; }

/* Block sums of x [K] (sum of each block of 32), the formula of gguf_gemm.c. */
static void block_sums(const float *x, int64_t K, float *xsum) {
    for (int64_t b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                                 _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24)));
        xsum[b] = hsum(s);
    }
}

/* in = x [K] ready for a product: block sums, and the int8 blocks where the step uses them. */
static void prepare_input(ds_input *in, const float *x, int64_t K, float *xsum, int8_t *xq,
                          float *xd, float *xs) {
    block_sums(x, K, xsum);
    if (in->int8_isa) baton_quantize_row_q8(x, K, xq, xd, xs);
    in->x = x;
    in->xsum = xsum;
    in->xq = xq;
    in->xd = xd;
    in->xs = xs;
}

/* Rows [0, rows) (rows <= I8_ROWS) of W x from the int8 blocks of x, W starting at `w`, with
 * gguf_gemm.c's tile of each ISA (one activation row). */
static void i8_tile_avx2(const int8_t *xq, const float *xd, const float *xs, int64_t K,
                         const uint8_t *w, int rows, int32_t type, float *y) {
    gemm_q8_avx2_tile(xq, xd, xs, K, w, 0, rows, type, 0, 1, 0, y);
}
AVXVNNI_TARGET static void i8_tile_avxvnni(const int8_t *xq, const float *xd, const float *xs,
                                           int64_t K, const uint8_t *w, int rows, int32_t type,
                                           float *y) {
    gemm_q8_avxvnni_tile(xq, xd, xs, K, w, 0, rows, type, 0, 1, 0, y);
}
AVX512VNNI_TARGET static void i8_tile_vnni256(const int8_t *xq, const float *xd, const float *xs,
                                              int64_t K, const uint8_t *w, int rows, int32_t type,
                                              float *y) {
    gemm_q8_vnni256_tile(xq, xd, xs, K, w, 0, rows, type, 0, 1, 0, y);
}

static void i8_rows(const ds_matrix *w, const ds_input *in, int64_t n0, int count, float *y) {
    const uint8_t *rows = w->blocks + n0 * (w->k / QK) * block_bytes_of(w->type);
    if (in->int8_isa == BATON_I8_AVXVNNI)
        i8_tile_avxvnni(in->xq, in->xd, in->xs, w->k, rows, count, w->type, y);
    else if (in->int8_isa == BATON_I8_AVX512VNNI)
        i8_tile_vnni256(in->xq, in->xd, in->xs, w->k, rows, count, w->type, y);
    else
        i8_tile_avx2(in->xq, in->xd, in->xs, w->k, rows, count, w->type, y);
}

/* Row n of W x, as baton_gguf_gemm computes it for one row of x (AVX2). */
static float row_avx2(const ds_matrix *w, const float *x, const float *xsum, int64_t n) {
    const int64_t bb = block_bytes_of(w->type), nb = w->k / QK;
    const uint8_t *row = w->blocks + n * nb * bb;
    __m256 acc = _mm256_setzero_ps();
    float offset = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * bb;
        const __m256 d = _mm256_set1_ps(f16_to_f32(blk));
        __m256 q[4];
        if (w->type == 3) quants_q4_1(blk + 4, q);
        else quants_q8_0(blk + 2, q);
        const float m = w->type == 3 ? f16_to_f32(blk + 2) : 0.0f;
        const float *xb = x + b * QK;
        __m256 p = _mm256_mul_ps(_mm256_loadu_ps(xb), q[0]);
        p = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8), q[1], p);
        p = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), q[2], p);
        p = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), q[3], p);
        acc = _mm256_fmadd_ps(d, p, acc);
        if (w->type == 3) offset += m * xsum[b];
    }
    return hsum(acc) + offset;
}

/* Rows n0, n0 + 1 (rows = 1 or 2) of W x for a Q4_1 W, as gemv_avx512 computes them. */
AVX512_TARGET static void rows_avx512_q4_1(const ds_matrix *w, const float *x, const float *xsum,
                                           int64_t n0, int rows, float *y) {
    const int64_t nb = w->k / QK;
    const uint8_t *row[2] = {w->blocks + n0 * nb * 20,
                             w->blocks + (n0 + (rows > 1 ? 1 : 0)) * nb * 20};
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    float offset[2] = {0.0f, 0.0f};
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * QK;
        const __m512 x_lo = _mm512_loadu_ps(xb), x_hi = _mm512_loadu_ps(xb + 16);
        for (int r = 0; r < 2; r++) {
            const uint8_t *blk = row[r] + b * 20;
            __m512 q_lo, q_hi;
            quants16_q4_1(blk + 4, &q_lo, &q_hi);
            offset[r] += f16_to_f32(blk + 2) * xsum[b];
            const __m512 p = _mm512_fmadd_ps(x_hi, q_hi, _mm512_mul_ps(x_lo, q_lo));
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(f16_to_f32(blk)), p, acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) y[r] = _mm512_reduce_add_ps(acc[r]) + offset[r];
}

/* y[0 .. count) = rows n0 .. n0 + count of W x (+ bias), count <= 2. */
static void matrix_rows(const ds_matrix *w, const ds_input *in, int64_t n0, int count,
                        float *y) {
    if (in->int8_isa) {
        i8_rows(w, in, n0, count, y);
    } else if (in->avx512 && w->type == 3) {
        rows_avx512_q4_1(w, in->x, in->xsum, n0, count, y);
    } else {
        for (int r = 0; r < count; r++) y[r] = row_avx2(w, in->x, in->xsum, n0 + r);
    }
    if (w->bias != NULL)
        for (int r = 0; r < count; r++) y[r] = y[r] + w->bias[n0 + r];
}

/* y = W x, rows shared out among the team (call from every thread; ends with a barrier). */
static void matrix_for(const ds_matrix *w, const ds_input *in, float *y) {
    const int64_t pairs = (w->n + 1) / 2;
    OMP_FOR(ROWS_SCHEDULE)
    for (int64_t g = 0; g < pairs; g++) {
        const int64_t n0 = 2 * g;
        matrix_rows(w, in, n0, w->n - n0 < 2 ? 1 : 2, y + n0);
    }
}

/* act[i0 .. i0 + count) = silu(gate) * up for the gate/up rows i0 .. i0 + count (count <= 8). */
static void swiglu_rows(const ds_matrix *w, const ds_input *in, int64_t inter, int64_t i0,
                        int count, float *act) {
    float gate[8], up[8];
    for (int r = 0; r < count; r += 2) {
        const int c = count - r < 2 ? 1 : 2;
        matrix_rows(w, in, i0 + r, c, gate + r);
        matrix_rows(w, in, inter + i0 + r, c, up + r);
    }
    if (count == 8) {
        const __m256 g = _mm256_loadu_ps(gate);
        const __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), g));
        const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        _mm256_storeu_ps(act + i0, _mm256_mul_ps(silu, _mm256_loadu_ps(up)));
    } else {
        for (int r = 0; r < count; r++) act[i0 + r] = gate[r] / (1.0f + expf(-gate[r])) * up[r];
    }
}

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

/* out[D] = attention of one query head qv over the len keys and values of its KV head (k_head,
 * v_head: that head's base in the cache), exactly paged_decode.c's arithmetic for that head.
 * The last position's key and value (this step's token) are read from new_k, new_v instead
 * of the cache: the same values, so the cache write needs no barrier before the attention.
 * scores: [len] scratch. */
static void attend_head(const float *qv, const float *k_head, const float *v_head,
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
        __m256 acc[8];
        for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
        for (int64_t i = 0; i < head_dim; i += 8) {
            const __m256 x = _mm256_loadu_ps(qv + i);
            for (int j = 0; j < 8; j++)
                acc[j] = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[j] + i), acc[j]);
        }
        _mm256_storeu_ps(scores + t0, _mm256_mul_ps(hsum8(acc), scale_v));
    }
    for (int64_t t = t0; t < len; t++) scores[t] = dot(qv, KEY(t), head_dim) * scale;
    float m = -INFINITY, sum = 0.0f;
    for (int64_t t = 0; t < len; t++) m = scores[t] > m ? scores[t] : m;
    const __m256 mv = _mm256_set1_ps(m);
    __m256 sums = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= len; t += 8) {
        __m256 p = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(scores + t), mv));
        _mm256_storeu_ps(scores + t, p);
        sums = _mm256_add_ps(sums, p);
    }
    sum = hsum(sums);
    for (; t < len; t++) {
        scores[t] = expf(scores[t] - m);
        sum += scores[t];
    }
    const __m256 norm = _mm256_set1_ps(1.0f / sum);
    for (int64_t i0 = 0; i0 < head_dim; i0 += 64) {
        const int64_t lanes = head_dim - i0 < 64 ? (head_dim - i0) / 8 : 8;
        __m256 acc[8];
        for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t t = 0; t < len; t++) {
            const float *v = VALUE(t) + i0;
            const __m256 p = _mm256_set1_ps(scores[t]);
            for (int64_t i = 0; i < lanes; i++)
                acc[i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * i), acc[i]);
        }
        for (int64_t i = 0; i < lanes; i++) _mm256_storeu_ps(o + i0 + 8 * i, _mm256_mul_ps(acc[i], norm));
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
    if (E <= 0 || E % 8 || D % 8 || KVH <= 0 || H % KVH || m->block_size <= 0) return -1;
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

/* Runs the decoder stack for one token at position seq_len - 1 of a sequence whose keys live in
 * the blocks of block_table (at least ceil(seq_len / block_size) entries): writes the token's
 * keys and values into every layer's cache, the final-normed hidden state into hidden [E] and,
 * where the model has a head, the logits into logits [vocab] (logits may be NULL: skipped).
 * timings: NULL, or [T_PARTS] seconds that thread 0 adds its time per part to.
 * Returns 0; -1 for a shape, token or position it does not take (nothing written then); -2
 * when scratch memory failed. */
int baton_decode_step(const ds_model *m, int64_t token, const int64_t *block_table,
                      int64_t seq_len, float *hidden, float *logits, double *timings) {
    const int64_t E = m->hidden, I = m->intermediate, H = m->num_heads, KVH = m->num_kv_heads,
                  D = m->head_dim, G = m->num_heads / (m->num_kv_heads ? m->num_kv_heads : 1);
    const int64_t pos = seq_len - 1;
    if (check_model(m) != 0 || token < 0 || token >= m->vocab || pos < 0 ||
        pos >= m->max_positions)
        return -1;
    const int64_t q_size = H * D, kv_size = KVH * D, qkv_n = q_size + 2 * kv_size;
    const int64_t slot_block = block_table[pos / m->block_size], slot_off = pos % m->block_size;
    const float *rot = m->rope + pos * D; /* (cos, sin) pairs of this position */
    const int64_t max_k = I > E ? (I > q_size ? I : q_size) : (E > q_size ? E : q_size);
    /* shared: qkv, attention output, a product's output, the SwiGLU activations; then per
     * thread (private): residual x, normed xn, roped q and k, block sums, attention scores */
    const int64_t own_size =
        2 * E + q_size + kv_size + max_k / QK + seq_len + max_k / 4 + 2 * (max_k / QK);
    const int threads = omp_get_max_threads();
    float *shared = malloc(sizeof(float) * (size_t)(qkv_n + q_size + E + I + threads * own_size));
    if (shared == NULL) return -2;
    float *qkv = shared, *attn = qkv + qkv_n, *tmp = attn + q_size, *act = tmp + E;
    float *own_all = act + I;
#pragma omp parallel num_threads(threads)
    {
        float *x = own_all + omp_get_thread_num() * own_size, *xn = x + E, *q = xn + E,
              *k = q + q_size, *xsum = k + kv_size, *scores = xsum + max_k / QK;
        float *xd = scores + seq_len, *xs = xd + max_k / QK;
        int8_t *xq = (int8_t *)(xs + max_k / QK); /* max_k bytes */
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
        memcpy(x, m->embed + token * E, sizeof(float) * (size_t)E);
        for (int64_t l = 0; l < m->num_layers; l++) {
            const ds_layer *L = &m->layers[l];
            baton_rms_norm(x, 1, E, L->input_norm, m->eps, xn);
            prepare_input(&in, xn, E, xsum, xq, xd, xs);
            MARK(T_NORM);
            matrix_for(&L->qkv, &in, qkv);
            MARK(T_QKV);
            rope_rows(qkv, H + KVH, D, rot, q); /* q, then k right after it */
            const float *v = qkv + q_size + kv_size;
            /* one thread writes the token's key and value to the cache; nobody waits for it:
             * the attention below reads them from k and v, the cache only at other slots */
#pragma omp single nowait
            {
                float *k_dst =
                    L->kv_cache + slot_block * m->stride_block + slot_off * m->stride_token;
                for (int64_t h = 0; h < KVH; h++) {
                    memcpy(k_dst + h * m->stride_head, k + h * D, sizeof(float) * (size_t)D);
                    memcpy(k_dst + m->stride_kv + h * m->stride_head, v + h * D,
                           sizeof(float) * (size_t)D);
                }
            }
            MARK(T_ROPE_KV);
            OMP_FOR(HEADS_SCHEDULE)
            for (int64_t hq = 0; hq < H; hq++) {
                const int64_t h = hq / G;
                const float *k_head = L->kv_cache + h * m->stride_head;
                attend_head(q + hq * D, k_head, k_head + m->stride_kv, k + h * D, v + h * D,
                            m->stride_block, m->stride_token, block_table, seq_len, D,
                            m->block_size, m->scale, scores, attn + hq * D);
            }
            MARK(T_ATTENTION);
            prepare_input(&in, attn, q_size, xsum, xq, xd, xs);
            MARK(T_NORM);
            matrix_for(&L->o, &in, tmp);
            MARK(T_O);
            for (int64_t e = 0; e < E; e++) x[e] = x[e] + tmp[e];
            baton_rms_norm(x, 1, E, L->post_norm, m->eps, xn);
            prepare_input(&in, xn, E, xsum, xq, xd, xs);
            MARK(T_NORM);
            OMP_FOR(SWIGLU_SCHEDULE)
            for (int64_t c = 0; c < (I + 7) / 8; c++) {
                const int64_t i0 = 8 * c;
                swiglu_rows(&L->gate_up, &in, I, i0, I - i0 < 8 ? (int)(I - i0) : 8, act);
            }
            MARK(T_GATE_UP);
            prepare_input(&in, act, I, xsum, xq, xd, xs);
            MARK(T_NORM);
            matrix_for(&L->down, &in, tmp);
            MARK(T_DOWN);
            for (int64_t e = 0; e < E; e++) x[e] = x[e] + tmp[e];
        }
        baton_rms_norm(x, 1, E, m->final_norm, m->eps, xn);
        prepare_input(&in, xn, E, xsum, xq, xd, xs);
#pragma omp master
        memcpy(hidden, xn, sizeof(float) * (size_t)E);
        MARK(T_NORM);
        if (m->head.blocks != NULL && logits != NULL) {
            matrix_for(&m->head, &in, logits); /* Q8_0 rows: AVX2 (or int8), as unfused */
            MARK(T_HEAD);
        }
#undef MARK
    }
    free(shared);
    return 0;
}
