/* y[M, N] = x[M, K] W^T for W kept in GGUF's Q4_1 or Q8_0 blocks, float32 arithmetic.
 *
 * Each weight is rebuilt exactly as gguf-py's dequantize (and so our float32 checkpoint) has
 * it: Q4_1 w = d * q + m (a float32 multiply, then a float32 add, never fused), Q8_0
 * w = q * d. Only the order of the K-sums differs from a dense float32 GEMM. Reading 20 or
 * 34 bytes per 32 weights instead of 128 is what makes small-M products (decode) faster: they
 * are bound by memory bandwidth.
 *
 * Layout: W is N rows of K / 32 blocks each, row-major; K % 32 == 0.
 *   Q4_1 block (20 bytes): f16 d, f16 m, 16 bytes: weight j in the low nibble of byte j,
 *                          weight j + 16 in its high nibble.
 *   Q8_0 block (34 bytes): f16 d, 32 int8 weights.
 * Build: cc -O3 -mavx2 -mfma -mf16c -ffp-contract=off -fopenmp -shared -fPIC.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../simd_math.h"
#include "team_barrier.h"

#define QK 32
#define TILE_M 4 /* rows of x sharing one unpacked block */

static inline float f16_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* The 32 quants of one block as four float vectors of 8, in order (Q4_1 unsigned 0..15,
 * Q8_0 signed). Q4_1: bytes 0-7 and 8-15 widened to 32-bit lanes (each load folded into the
 * widening), their low nibbles are quants 0-15 and their high nibbles quants 16-31. Fewer
 * shuffles than splitting the nibbles as bytes first: SmolLM2's one-row fused decode step took
 * 11.2 vs 13.5 ms (4 rows: 26.3 vs 28.1), both in one process on the 2-core AVX2 EPYC. */
static inline void quants_q4_1(const uint8_t *qs, __m256 q[4]) {
    const __m256i lo8 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qs));
    const __m256i hi8 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8)));
    const __m256i nibble = _mm256_set1_epi32(0x0F);
    q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(lo8, nibble));
    q[1] = _mm256_cvtepi32_ps(_mm256_and_si256(hi8, nibble));
    q[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(lo8, 4));
    q[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(hi8, 4));
}

/* A Q4_1 block's d and m (its first two f16) as floats, in one conversion. */
static inline void scales_q4_1(const uint8_t *blk, __m256 *d, float *m) {
    int32_t dm;
    memcpy(&dm, blk, 4);
    const __m128 both = _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
    *d = _mm256_broadcastss_ps(both);
    *m = _mm_cvtss_f32(_mm_movehdup_ps(both));
}

static inline void quants_q8_0(const uint8_t *qs, __m256 q[4]) {
    for (int i = 0; i < 4; i++)
        q[i] = _mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * i))));
}

/* The 32 weights of one block as four vectors of 8, in order, each computed as gguf-py does:
 * Q4_1 (d * q) + m, Q8_0 q * d. */
static inline void rebuild_q4_1(const uint8_t *b, __m256 w[4]) {
    __m256 d;
    float m1;
    scales_q4_1(b, &d, &m1);
    const __m256 m = _mm256_set1_ps(m1);
    quants_q4_1(b + 4, w);
    for (int i = 0; i < 4; i++) w[i] = _mm256_add_ps(_mm256_mul_ps(d, w[i]), m);
}

static inline void rebuild_q8_0(const uint8_t *b, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(f16_to_f32(b));
    quants_q8_0(b + 2, w);
    for (int i = 0; i < 4; i++) w[i] = _mm256_mul_ps(w[i], d);
}

/* y[i * ys] = (W row `row`) . (x row i) for i < TM (x [TM, K], xsum [TM, K / 32]): the
 * arithmetic of every float32 AVX2 product of this file and of the fused decode step, per
 * output element. Per block the dot product is factored: for Q4_1
 *   sum_j x_j (d q_j + m) = d * sum_j x_j q_j + m * sum_j x_j,
 * with sum_j x_j computed once per row of x and block, shared by all N outputs; for Q8_0
 *   sum_j x_j (q_j d) = d * sum_j x_j q_j.
 * TM is a constant where it is inlined (callers switch on it), so acc is registers. */
static inline __attribute__((always_inline)) void row_tile_avx2(const uint8_t *row, int32_t type,
                                                                int64_t K, const float *x,
                                                                const float *xsum, const int TM,
                                                                float *y, int64_t ys) {
    const int64_t block_bytes = type == 3 ? 20 : 34, nb = K / QK;
    __m256 acc[TILE_M];
    float offset[TILE_M];
    for (int i = 0; i < TM; i++) {
        acc[i] = _mm256_setzero_ps();
        offset[i] = 0.0f;
    }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * block_bytes;
        __m256 d, q[4];
        float m = 0.0f;
        if (type == 3) {
            scales_q4_1(blk, &d, &m);
            quants_q4_1(blk + 4, q);
        } else {
            d = _mm256_set1_ps(f16_to_f32(blk));
            quants_q8_0(blk + 2, q);
        }
        /* each row's p = x0 q0 + x1 q1 + x2 q2 + x3 q3 in that order, the rows side by side */
        __m256 p[TILE_M];
        for (int i = 0; i < TM; i++) p[i] = _mm256_mul_ps(_mm256_loadu_ps(x + i * K + b * QK), q[0]);
        for (int j = 1; j < 4; j++)
            for (int i = 0; i < TM; i++)
                p[i] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * K + b * QK + 8 * j), q[j], p[i]);
        for (int i = 0; i < TM; i++) {
            acc[i] = _mm256_fmadd_ps(d, p[i], acc[i]);
            if (type == 3) offset[i] += m * xsum[i * nb + b];
        }
    }
    for (int i = 0; i < TM; i++) y[i * ys] = hsum(acc[i]) + offset[i];
}

/* row_tile_avx2 with tm (1 .. TILE_M) made a constant. */
static void row_rows_avx2(const uint8_t *row, int32_t type, int64_t K, const float *x,
                          const float *xsum, int tm, float *y, int64_t ys) {
    switch (tm) {
    case 1: row_tile_avx2(row, type, K, x, xsum, 1, y, ys); break;
    case 2: row_tile_avx2(row, type, K, x, xsum, 2, y, ys); break;
    case 3: row_tile_avx2(row, type, K, x, xsum, 3, y, ys); break;
    default: row_tile_avx2(row, type, K, x, xsum, 4, y, ys); break;
    }
}

/* y[M, N] = x[M, K] W^T (row_tile_avx2 per weight row and TILE_M rows of x): the same products
 * as a dense float32 GEMM over the dequantized weights, summed in another order. Returns 0, or
 * -1 for an unknown block type or K not a multiple of 32. */
int baton_gguf_gemm(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                    int32_t type, float *xsum, float *y) {
    const int64_t block_bytes = type == 3 ? 20 : type == 8 ? 34 : 0; /* GGML type ids */
    if (block_bytes == 0 || K % QK != 0) return -1;
    const int64_t nb = K / QK;
    if (type == 3) /* xsum: [M, nb] scratch from the caller */
        for (int64_t i = 0; i < M * nb; i++) {
            const float *xb = x + i * QK;
            __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                                     _mm256_add_ps(_mm256_loadu_ps(xb + 16),
                                                   _mm256_loadu_ps(xb + 24)));
            xsum[i] = hsum(s);
        }
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t m0 = 0; m0 < M; m0 += TILE_M)
            row_rows_avx2(w + n * nb * block_bytes, type, K, x + m0 * K, xsum + m0 * nb,
                          M - m0 < TILE_M ? (int)(M - m0) : TILE_M, y + m0 * N + n, N);
    return 0;
}

/* ---- many rows: weights rebuilt into a float32 panel ----------------------------------------
 * Past a few rows, unpacking every block again for each tile of TILE_M rows costs more than
 * the products themselves. Here PANEL_N weight rows are rebuilt once into a panel (w = d q + m
 * or q d, exactly the checkpoint's float32 weights: rebuild_q4_1 / rebuild_q8_0), which stays
 * in L1 while tiles of PANEL_TM input rows pass it: PANEL_TM x PANEL_N running sums in
 * registers, PANEL_TM + PANEL_N loads per PANEL_TM x PANEL_N multiply-adds. Input rows go in
 * blocks of PANEL_MB, so that a block stays in L2 while every panel passes it.
 *
 * Per output element: eight lane sums over k (lane j takes k = j mod 8, in order of k, fused
 * multiply-adds), then hsum. That is the same whichever tile, block or thread computes the
 * element, so a row's result does not depend on the other rows of the product; it is a dense
 * float32 product of the same weights, summed in another order than row_tile_avx2 (which
 * factors d and m out of each block). */
#define PANEL_N 4   /* weight rows per panel */
#define PANEL_TM 3  /* input rows per tile: 3 x 4 sums + 3 x loads + 1 w load = 16 registers */
#define PANEL_MB 96 /* input rows per block (a multiple of PANEL_TM) */

/* Rows [n0, n0 + count) of W (count <= rows) rebuilt into panel [rows, K]; the rows past
 * count repeat the last one (their sums are computed and dropped). */
static inline void rebuild_rows(const uint8_t *w, int32_t type, int64_t K, int64_t n0, int count,
                                int rows, float *panel) {
    const int64_t block_bytes = type == 3 ? 20 : 34, nb = K / QK;
    for (int r = 0; r < rows; r++) {
        const uint8_t *row = w + (n0 + (r < count ? r : count - 1)) * nb * block_bytes;
        float *out = panel + r * K;
        for (int64_t b = 0; b < nb; b++) {
            __m256 v[4];
            if (type == 3) rebuild_q4_1(row + b * block_bytes, v);
            else rebuild_q8_0(row + b * block_bytes, v);
            for (int j = 0; j < 4; j++) _mm256_storeu_ps(out + b * QK + 8 * j, v[j]);
        }
    }
}

/* y[i * ys + r] = (panel row r) . (x row i) (+ bias[r]), i < TM, r < count (x [TM, K]). TM is
 * a constant where it is inlined (panel_rows switches on it), so the sums are registers. */
static inline __attribute__((always_inline)) void panel_tile(const float *x, int64_t K,
                                                             const float *panel, const int TM,
                                                             int count, const float *bias,
                                                             float *y, int64_t ys) {
    __m256 acc[PANEL_TM][PANEL_N];
    for (int i = 0; i < TM; i++)
        for (int r = 0; r < PANEL_N; r++) acc[i][r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        __m256 xv[PANEL_TM];
        for (int i = 0; i < TM; i++) xv[i] = _mm256_loadu_ps(x + i * K + k);
        for (int r = 0; r < PANEL_N; r++) {
            const __m256 wv = _mm256_loadu_ps(panel + r * K + k);
            for (int i = 0; i < TM; i++) acc[i][r] = _mm256_fmadd_ps(xv[i], wv, acc[i][r]);
        }
    }
    for (int i = 0; i < TM; i++)
        for (int r = 0; r < count; r++)
            y[i * ys + r] = bias == NULL ? hsum(acc[i][r]) : hsum(acc[i][r]) + bias[r];
}

/* The panel times input rows [0, M) of x [M, K] (+ bias [count] or NULL): y[i * ys + r],
 * r < count. */
static void panel_rows(const float *x, int64_t M, int64_t K, const float *panel, int count,
                       const float *bias, float *y, int64_t ys) {
    int64_t i = 0;
    for (; i + PANEL_TM <= M; i += PANEL_TM)
        panel_tile(x + i * K, K, panel, PANEL_TM, count, bias, y + i * ys, ys);
    if (M - i == 2) panel_tile(x + i * K, K, panel, 2, count, bias, y + i * ys, ys);
    else if (M - i == 1) panel_tile(x + i * K, K, panel, 1, count, bias, y + i * ys, ys);
}

/* y[M, N] = x[M, K] W^T (+ bias [N] or NULL) by panels (the arithmetic above), panels shared
 * out among the threads. panel: PANEL_N * K floats of this thread's own. Call from inside a
 * parallel region with `omp for` semantics: every thread of the team calls it; it ends with
 * team_barrier(). */
static void panel_product_for(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                              int32_t type, const float *bias, float *panel, float *y) {
    const int64_t groups = (N + PANEL_N - 1) / PANEL_N;
    for (int64_t m0 = 0; m0 < M; m0 += PANEL_MB) {
        const int64_t mb = M - m0 < PANEL_MB ? M - m0 : PANEL_MB;
#pragma omp for schedule(guided, 4) nowait
        for (int64_t g = 0; g < groups; g++) {
            const int64_t n0 = g * PANEL_N;
            const int count = N - n0 < PANEL_N ? (int)(N - n0) : PANEL_N;
            rebuild_rows(w, type, K, n0, count, PANEL_N, panel);
            panel_rows(x + m0 * K, mb, K, panel, count, bias == NULL ? NULL : bias + n0,
                       y + m0 * N + n0, N);
        }
    }
    team_barrier(); /* the blocks' work-shares write disjoint outputs: one barrier at the end */
}

/* y[M, N] = x[M, K] W^T by panels (panel_product_for): products of many rows. Returns 0, -1
 * for an unknown block type or K not a multiple of 32, -2 when scratch memory failed. */
int baton_gguf_gemm_panel(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                          int32_t type, float *y) {
    if ((type != 3 && type != 8) || K % QK != 0 || K <= 0) return -1;
    const int threads = omp_get_max_threads();
    float *panels = aligned_alloc(64, sizeof(float) * (size_t)(threads * PANEL_N * K)); /* K % 32 == 0 */
    if (panels == NULL) return -2;
#pragma omp parallel num_threads(threads)
    panel_product_for(x, M, K, w, N, type, NULL, panels + omp_get_thread_num() * PANEL_N * K, y);
    free(panels);
    return 0;
}

/* Dequantize rows [0, N) into out[N, K] float32: the reference the tests compare against. */
int baton_gguf_dequantize(const uint8_t *w, int64_t N, int64_t K, int32_t type, float *out) {
    const int64_t block_bytes = type == 3 ? 20 : type == 8 ? 34 : 0;
    if (block_bytes == 0 || K % QK != 0) return -1;
    const int64_t nb = K / QK;
    for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < nb; b++) {
            __m256 wv[4];
            const uint8_t *blk = w + (n * nb + b) * block_bytes;
            if (type == 3) rebuild_q4_1(blk, wv);
            else rebuild_q8_0(blk, wv);
            for (int j = 0; j < 4; j++) _mm256_storeu_ps(out + n * K + b * QK + 8 * j, wv[j]);
        }
    return 0;
}

/* 1 where this CPU runs AVX-512 F, BW and VL (GCC's cpuid probe), else 0. */
int baton_cpu_has_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
}

/* ---- AVX-512 matrix-vector product (one row of x), chosen at run time ----------------------
 * Compiled for AVX-512 F/BW/VL through a target attribute, in the same library as the AVX2
 * kernels; the caller (gguf_kernel.py) calls it only when /proc/cpuinfo lists those flags, and
 * baton_gguf_gemv_avx512 itself refuses (-2) on a CPU without them, so it never faults. One
 * block is two vectors of 16: the products x_j w_j of the block's rebuilt float32 weights,
 * summed 16 lanes wide (float32 arithmetic; baton_gguf_gemm factors d and m out of the block
 * instead, another order of the same sums). Two output rows per iteration share the x loads
 * and give the core independent accumulation chains (4, 8 were no faster). */
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

AVX512_TARGET static inline void quants16_q4_1(const uint8_t *qs, __m512 *q_lo, __m512 *q_hi) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)qs);
    const __m128i mask = _mm_set1_epi8(0x0F);
    *q_lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, mask)));
    *q_hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask)));
}

AVX512_TARGET static inline void quants16_q8_0(const uint8_t *qs, __m512 *q_lo, __m512 *q_hi) {
    *q_lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)qs)));
    *q_hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16))));
}

/* A Q4_1 block pair's scales, (d0, m0, d1, m1): blocks b0 and b1 (of two weight rows) in one
 * f16 conversion. */
AVX512_TARGET static inline __m128 scales_pair_q4_1(const uint8_t *b0, const uint8_t *b1) {
    int32_t dm0, dm1;
    memcpy(&dm0, b0, 4);
    memcpy(&dm1, b1, 4);
    return _mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128(dm0), dm1, 1));
}

#define AVX512_TILE_M 8 /* rows of x sharing one rebuilt block in tile_avx512 */

/* y[i * ys + r] = (weight row r) . (input row i) for r < count (<= 2), i < TM (<= AVX512_TILE_M):
 * the AVX-512 arithmetic of every float32 product of one to a few rows (gemv_avx512, the fused
 * step's few-row products), per output element. Weight row r starts at w + r * row_bytes; a
 * lone row (count 1) is computed twice, the copy dropped. Per block each weight row's 32
 * float32 weights are rebuilt exactly (Q4_1: w = d q + m, q = 0..15, as a table of the 16
 * values d k + m, one fused multiply-add, looked up by each nibble with a permute; Q8_0:
 * w = d q), and every input row adds x_lo w_lo, then x_hi w_hi, to its 16 running sums (two
 * fused multiply-adds a row and block); y = the lanes' sum. d k + m is one rounding of the
 * exact value (d k is exact in float32: an 11-bit significand times 4 bits), the float32
 * weight of the converted checkpoint; d q of Q8_0 is exact. So an extra input row costs two
 * fused multiply-adds a block and weight row, and the weights are rebuilt once for all TM
 * rows. TYPE and TM are constants where it is inlined (callers switch on them). */
AVX512_TARGET static inline __attribute__((always_inline)) void tile_avx512(
    const uint8_t *w, int64_t row_bytes, const int32_t TYPE, int64_t K, int count,
    const float *x, const int TM, float *y, int64_t ys) {
    const int64_t nb = K / QK, bb = TYPE == 3 ? 20 : 34;
    const uint8_t *row1 = w + (count > 1 ? row_bytes : 0);
    __m512 acc[2][AVX512_TILE_M]; /* with the 4 rebuilt weight vectors: 20 of the 32 registers */
    for (int i = 0; i < TM; i++) acc[0][i] = acc[1][i] = _mm512_setzero_ps();
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i lane1 = _mm512_set1_epi32(1), lane2 = _mm512_set1_epi32(2),
                  lane3 = _mm512_set1_epi32(3);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *b0 = w + b * bb, *b1 = row1 + b * bb;
        __m512 w0_lo, w0_hi, w1_lo, w1_hi;
        if (TYPE == 3) {
            const __m512 dm = _mm512_castps128_ps512(scales_pair_q4_1(b0, b1));
            const __m512 t0 = _mm512_fmadd_ps(_mm512_broadcastss_ps(_mm512_castps512_ps128(dm)),
                                              iota, _mm512_permutexvar_ps(lane1, dm));
            const __m512 t1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(lane2, dm), iota,
                                              _mm512_permutexvar_ps(lane3, dm));
            const __m512i i0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b0 + 4)));
            const __m512i i1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b1 + 4)));
            w0_lo = _mm512_permutexvar_ps(i0, t0);
            w0_hi = _mm512_permutexvar_ps(_mm512_srli_epi32(i0, 4), t0);
            w1_lo = _mm512_permutexvar_ps(i1, t1);
            w1_hi = _mm512_permutexvar_ps(_mm512_srli_epi32(i1, 4), t1);
        } else {
            __m512 q0_lo, q0_hi, q1_lo, q1_hi;
            quants16_q8_0(b0 + 2, &q0_lo, &q0_hi);
            quants16_q8_0(b1 + 2, &q1_lo, &q1_hi);
            const __m512 d0 = _mm512_set1_ps(f16_to_f32(b0)), d1 = _mm512_set1_ps(f16_to_f32(b1));
            w0_lo = _mm512_mul_ps(q0_lo, d0);
            w0_hi = _mm512_mul_ps(q0_hi, d0);
            w1_lo = _mm512_mul_ps(q1_lo, d1);
            w1_hi = _mm512_mul_ps(q1_hi, d1);
        }
        for (int i = 0; i < TM; i++) {
            const float *xb = x + i * K + b * QK;
            const __m512 x_lo = _mm512_loadu_ps(xb), x_hi = _mm512_loadu_ps(xb + 16);
            acc[0][i] = _mm512_fmadd_ps(x_hi, w0_hi, _mm512_fmadd_ps(x_lo, w0_lo, acc[0][i]));
            acc[1][i] = _mm512_fmadd_ps(x_hi, w1_hi, _mm512_fmadd_ps(x_lo, w1_lo, acc[1][i]));
        }
    }
    for (int i = 0; i < TM; i++) {
        y[i * ys] = _mm512_reduce_add_ps(acc[0][i]);
        if (count > 1) y[i * ys + 1] = _mm512_reduce_add_ps(acc[1][i]);
    }
}

/* One row of x times pairs of weight rows (tile_avx512), the pairs shared out among threads. */
AVX512_TARGET static void gemv_avx512(const float *x, int64_t K, const uint8_t *w, int64_t N,
                                      int32_t type, float *y) {
    const int64_t row_bytes = K / QK * (type == 3 ? 20 : 34), pairs = (N + 1) / 2;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < pairs; g++) {
        const int64_t n0 = 2 * g;
        const int count = N - n0 < 2 ? 1 : 2;
        const uint8_t *rows = w + n0 * row_bytes;
        if (type == 3) tile_avx512(rows, row_bytes, 3, K, count, x, 1, y + n0, 1);
        else tile_avx512(rows, row_bytes, 8, K, count, x, 1, y + n0, 1);
    }
}

/* y[1, N] = x[1, K] W^T with AVX-512. Returns 0; -1 for an unknown block type or K not a
 * multiple of 32; -2 where this CPU lacks AVX-512 F/BW/VL (the caller then uses
 * baton_gguf_gemm). */
int baton_gguf_gemv_avx512(const float *x, int64_t K, const uint8_t *w, int64_t N, int32_t type,
                           float *y) {
    if ((type != 3 && type != 8) || K % QK != 0) return -1;
    if (!baton_cpu_has_avx512()) return -2;
    gemv_avx512(x, K, w, N, type, y);
    return 0;
}

#include "gemm_lanes.c"
#include "gemm_amx.c"

/* ==== int8 activations (opt-in: EngineOptions.int8_activations) =============================
 * llama.cpp's arithmetic for a decode step: the activation rows are quantized to int8 per block
 * of 32 (like its Q8_1), and each block's dot product with the weight quants is an exact
 * integer sum; only the per-block scales are float32. This changes the result (x is rounded to
 * 8 bits per block), unlike everything above.
 *
 * Activation layout (three arrays, one row after another for M rows):
 *   q [M, K]      int8    q_j = round_half_even(x_j * (1 / d)), in [-127, 127]
 *   d [M, K / 32] float32 d = max_j |x_j| / 127 (float32 division; 0 for an all-zero block,
 *                         whose q are then 0)
 *   s [M, K / 32] float32 s = d * sum_j q_j (an exact integer sum converted to float32, then
 *                         one float32 multiply): the x-sum Q4_1's min term needs.
 * d and s stay float32 (llama.cpp rounds them to f16), so the only rounding is that of q.
 *
 * Per weight block b of row n (all sums over the block's 32 values, integer, exact):
 *   Q4_1 (w = d_w q_w + m_w, q_w in 0..15):  y += d_w d_x sum q_w q_x + m_w s_x
 *   Q8_0 (w = d_w q_w, q_w in -127..127):    y += d_w d_x sum q_w q_x
 * The float32 part: the product (d_w * d_x) is rounded once and multiplies the int sum, the
 * terms are summed in float32 (order: per ISA, see the kernels).
 *
 * ISAs, chosen at run time (baton_cpu_int8_isas says which this CPU has):
 *   BATON_I8_AVX2       maddubs (u8 x s8 -> s16 pairs) + madd (-> s32), one block per ymm
 *   BATON_I8_AVXVNNI    vpdpbusd on ymm (AVX-VNNI), one block per ymm
 *   BATON_I8_AVX512VNNI vpdpbusd on zmm (AVX-512 VNNI), two blocks per zmm
 * Q8_0 weights are signed: dot(w, x) = dot(|w|, sign(x, w)) (|w| <= 127, so maddubs' s16
 * pairs, at most 2 * 127 * 127, never saturate; Q4_1 pairs at most 2 * 15 * 127). */

#define BATON_I8_AVX2 1
#define BATON_I8_AVXVNNI 2
#define BATON_I8_AVX512VNNI 3
#ifndef I8_ROWS
#define I8_ROWS 2 /* weight rows per iteration: independent chains sharing the x loads */
#endif
#define I8_TILE_M 4 /* activation rows sharing one unpacked weight block */

/* Quantize one row of K floats (K % 32 == 0) as described above. Returns 0, -1 for a bad K. */
int baton_quantize_row_q8(const float *x, int64_t K, int8_t *q, float *d, float *s) {
    if (K % QK != 0 || K <= 0) return -1;
    const __m256 sign_mask = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_mask, v[i]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float db = _mm_cvtss_f32(m4) / 127.0f;
        const float inv = db != 0.0f ? 1.0f / db : 0.0f;
        const __m256 vinv = _mm256_set1_ps(inv);
        __m256i qi[4];
        for (int i = 0; i < 4; i++) /* x * (1/d), rounded to nearest, ties to even */
            qi[i] = _mm256_cvtps_epi32(_mm256_round_ps(
                _mm256_mul_ps(v[i], vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        const __m256i sum32 = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]),
                                               _mm256_add_epi32(qi[2], qi[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum32),
                                   _mm256_extracti128_si256(sum32, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        /* int32 -> int16 -> int8 (packs interleave 128-bit lanes: permute back into order) */
        const __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]);
        const __m256i p16b = _mm256_packs_epi32(qi[2], qi[3]);
        __m256i p8 = _mm256_packs_epi16(p16a, p16b);
        p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + b * QK), p8);
        d[b] = db;
        s[b] = db * (float)_mm_cvtsi128_si32(s4);
    }
    return 0;
}

/* The 32 quants of a Q4_1 block as 32 unsigned bytes in order (low nibbles: 0..15, high
 * nibbles: 16..31), matching 32 consecutive activation quants. */
static inline __m256i q4_1_bytes(const uint8_t *qs) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)qs);
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

/* 8 int32 partial sums of u8 w x s8 x over one block, per ISA (AVX2 fallback) */
static inline __m256i dot_u8s8_avx2(__m256i w, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}
#define AVXVNNI_TARGET __attribute__((target("avxvnni,avx2,fma,f16c")))
#define AVX512VNNI_TARGET \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
AVXVNNI_TARGET static inline __m256i dot_u8s8_avxvnni(__m256i w, __m256i x) {
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
}
AVX512VNNI_TARGET static inline __m256i dot_u8s8_vnni256(__m256i w, __m256i x) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
}

/* The ymm (one block per vector) kernel, instantiated per ISA by DOT: rows [n0, n0 + rows)
 * of W times activation rows [m0, m0 + TM). acc[r][i] holds 8 float lanes per (weight row,
 * activation row); each block adds cvt(int sums) * (d_w * d_x) to it; Q4_1 adds m_w * s_x to a
 * scalar offset. y = lanes summed (hsum) + offset. */
#define DEFINE_YMM_KERNEL(NAME, TARGET, DOT)                                                    \
    TARGET static inline __attribute__((always_inline)) void NAME##_tile(                       \
        const int8_t *xq, const float *xd, const float *xs, int64_t K, const uint8_t *w,         \
        int64_t n0, int rows, int32_t type, int64_t m0, const int TM, int64_t N, float *y) {     \
        const int64_t nb = K / QK, bb = type == 3 ? 20 : 34;                                   \
        const uint8_t *row[I8_ROWS];                                                            \
        __m256 acc[I8_ROWS][I8_TILE_M];                                                         \
        float off[I8_ROWS][I8_TILE_M];                                                          \
        for (int r = 0; r < I8_ROWS; r++) {                                                     \
            row[r] = w + (n0 + (r < rows ? r : rows - 1)) * nb * bb;                            \
            for (int i = 0; i < TM; i++) {                                                      \
                acc[r][i] = _mm256_setzero_ps();                                                \
                off[r][i] = 0.0f;                                                               \
            }                                                                                   \
        }                                                                                       \
        for (int64_t b = 0; b < nb; b++) {                                                      \
            for (int r = 0; r < I8_ROWS; r++) {                                                 \
                const uint8_t *blk = row[r] + b * bb;                                           \
                const float dw = f16_to_f32(blk);                                               \
                if (type == 3) {                                                                \
                    const __m256i qw = q4_1_bytes(blk + 4);                                     \
                    const float mw = f16_to_f32(blk + 2);                                       \
                    for (int i = 0; i < TM; i++) {                                              \
                        const int64_t xb = (m0 + i) * nb + b;                                   \
                        const __m256i qx = _mm256_loadu_si256((const __m256i *)(xq + xb * QK)); \
                        const __m256 p = _mm256_cvtepi32_ps(DOT(qw, qx));                       \
                        acc[r][i] = _mm256_fmadd_ps(_mm256_set1_ps(dw * xd[xb]), p, acc[r][i]); \
                        off[r][i] += mw * xs[xb];                                               \
                    }                                                                           \
                } else {                                                                        \
                    const __m256i qw = _mm256_loadu_si256((const __m256i *)(blk + 2));          \
                    const __m256i aw = _mm256_sign_epi8(qw, qw);                                \
                    for (int i = 0; i < TM; i++) {                                              \
                        const int64_t xb = (m0 + i) * nb + b;                                   \
                        const __m256i qx = _mm256_loadu_si256((const __m256i *)(xq + xb * QK)); \
                        const __m256 p = _mm256_cvtepi32_ps(DOT(aw, _mm256_sign_epi8(qx, qw))); \
                        acc[r][i] = _mm256_fmadd_ps(_mm256_set1_ps(dw * xd[xb]), p, acc[r][i]); \
                    }                                                                           \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        for (int r = 0; r < rows; r++)                                                          \
            for (int i = 0; i < TM; i++)                                                        \
                y[(m0 + i) * N + n0 + r] = hsum(acc[r][i]) + off[r][i];                         \
    }                                                                                           \
    TARGET static void NAME(const int8_t *xq, const float *xd, const float *xs, int64_t M,      \
                            int64_t K, const uint8_t *w, int64_t N, int32_t type, float *y) {   \
        const int64_t groups = (N + I8_ROWS - 1) / I8_ROWS;                                     \
        _Pragma("omp parallel for schedule(static)") for (int64_t g = 0; g < groups; g++) {     \
            const int64_t n0 = g * I8_ROWS;                                                     \
            const int rows = N - n0 < I8_ROWS ? (int)(N - n0) : I8_ROWS;                        \
            for (int64_t m0 = 0; m0 < M; m0 += I8_TILE_M) {                                     \
                switch (M - m0 < I8_TILE_M ? (int)(M - m0) : I8_TILE_M) {                      \
                case 1: NAME##_tile(xq, xd, xs, K, w, n0, rows, type, m0, 1, N, y); break;      \
                case 2: NAME##_tile(xq, xd, xs, K, w, n0, rows, type, m0, 2, N, y); break;      \
                case 3: NAME##_tile(xq, xd, xs, K, w, n0, rows, type, m0, 3, N, y); break;      \
                default: NAME##_tile(xq, xd, xs, K, w, n0, rows, type, m0, 4, N, y); break;     \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
    }

#define NO_TARGET
DEFINE_YMM_KERNEL(gemm_q8_avx2, NO_TARGET, dot_u8s8_avx2)
DEFINE_YMM_KERNEL(gemm_q8_avxvnni, AVXVNNI_TARGET, dot_u8s8_avxvnni)
DEFINE_YMM_KERNEL(gemm_q8_vnni256, AVX512VNNI_TARGET, dot_u8s8_vnni256)

/* AVX-512 VNNI, two blocks per zmm (lanes 0..7: block b, 8..15: block b + 1), one activation
 * row; an odd last block goes through the ymm VNNI dot. */
AVX512VNNI_TARGET static void gemv_q8_avx512vnni(const int8_t *xq, const float *xd,
                                                 const float *xs, int64_t K, const uint8_t *w,
                                                 int64_t N, int32_t type, float *y) {
    const int64_t nb = K / QK, bb = type == 3 ? 20 : 34, pairs = nb / 2;
    const int64_t groups = (N + I8_ROWS - 1) / I8_ROWS;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t n0 = g * I8_ROWS;
        const int rows = N - n0 < I8_ROWS ? (int)(N - n0) : I8_ROWS;
        const uint8_t *row[I8_ROWS];
        __m512 acc[I8_ROWS];
        float off[I8_ROWS];
        for (int r = 0; r < I8_ROWS; r++) {
            row[r] = w + (n0 + (r < rows ? r : rows - 1)) * nb * bb;
            acc[r] = _mm512_setzero_ps();
            off[r] = 0.0f;
        }
        for (int64_t p = 0; p < pairs; p++) {
            const int64_t b = 2 * p;
            const __m512i qx = _mm512_loadu_si512((const void *)(xq + b * QK));
            const float dx0 = xd[b], dx1 = xd[b + 1];
            for (int r = 0; r < I8_ROWS; r++) {
                const uint8_t *b0 = row[r] + b * bb, *b1 = b0 + bb;
                __m512i dot;
                if (type == 3) {
                    const __m512i qw = _mm512_inserti64x4(
                        _mm512_castsi256_si512(q4_1_bytes(b0 + 4)), q4_1_bytes(b1 + 4), 1);
                    dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), qw, qx);
                    off[r] += f16_to_f32(b0 + 2) * xs[b] + f16_to_f32(b1 + 2) * xs[b + 1];
                } else {
                    const __m512i qw = _mm512_inserti64x4(
                        _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + 2))),
                        _mm256_loadu_si256((const __m256i *)(b1 + 2)), 1);
                    const __m512i aw = _mm512_abs_epi8(qw);
                    /* sign(x, w): x where w > 0, -x where w < 0, 0 where w == 0 */
                    const __mmask64 neg = _mm512_movepi8_mask(qw);
                    const __m512i sx = _mm512_mask_sub_epi8(qx, neg, _mm512_setzero_si512(), qx);
                    dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), aw, sx);
                }
                const __m512 scale = _mm512_mask_broadcastss_ps(
                    _mm512_set1_ps(f16_to_f32(b0) * dx0), 0xFF00,
                    _mm_set_ss(f16_to_f32(b1) * dx1));
                acc[r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(dot), acc[r]);
            }
        }
        if (nb % 2) { /* the odd last block */
            const int64_t b = nb - 1;
            const __m256i qx = _mm256_loadu_si256((const __m256i *)(xq + b * QK));
            for (int r = 0; r < I8_ROWS; r++) {
                const uint8_t *blk = row[r] + b * bb;
                __m256i dot;
                if (type == 3) {
                    dot = dot_u8s8_vnni256(q4_1_bytes(blk + 4), qx);
                    off[r] += f16_to_f32(blk + 2) * xs[b];
                } else {
                    const __m256i qw = _mm256_loadu_si256((const __m256i *)(blk + 2));
                    dot = dot_u8s8_vnni256(_mm256_sign_epi8(qw, qw), _mm256_sign_epi8(qx, qw));
                }
                const __m512 p = _mm512_zextps256_ps512(_mm256_cvtepi32_ps(dot)); /* 8..15: 0 */
                acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(f16_to_f32(blk) * xd[b]), p, acc[r]);
            }
        }
        for (int r = 0; r < rows; r++) y[n0 + r] = _mm512_reduce_add_ps(acc[r]) + off[r];
    }
}

/* Bit i set where this CPU runs int8 ISA i (1 << BATON_I8_AVX2 | ...), by GCC's cpuid probe. */
int baton_cpu_int8_isas(void) {
    __builtin_cpu_init();
    int isas = 1 << BATON_I8_AVX2; /* the library itself needs AVX2 */
    if (__builtin_cpu_supports("avxvnni")) isas |= 1 << BATON_I8_AVXVNNI;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
        isas |= 1 << BATON_I8_AVX512VNNI;
    return isas;
}

/* The int8 ISA to use by default: AVX-VNNI (ymm) where present, else AVX-512 VNNI, else
 * AVX2. Measured on this project's Xeon (1 thread, one row, SmolLM2 shapes, Q4_1): ymm
 * vpdpbusd 9.1-9.3 GB/s of blocks, AVX2 maddubs 8.4-8.7, the zmm kernel 7.0 (two blocks per
 * zmm cost an insert and a masked scale broadcast, which outweigh the wider dot). */
static int best_int8_isa(void) {
    const int isas = baton_cpu_int8_isas();
    if (isas & (1 << BATON_I8_AVXVNNI)) return BATON_I8_AVXVNNI;
    if (isas & (1 << BATON_I8_AVX512VNNI)) return BATON_I8_AVX512VNNI;
    return BATON_I8_AVX2;
}

/* y[M, N] = x W^T from quantized activation rows (layout above: xq [M, K], xd and xs
 * [M, K / 32]) and W in Q4_1 (type 3) or Q8_0 (type 8) blocks. isa: 0 = the best this CPU
 * runs, else BATON_I8_*. One activation row on AVX-512 VNNI takes the zmm kernel; several rows
 * take the ymm kernel of that ISA (up to I8_TILE_M rows share each unpacked weight block).
 * Returns 0; -1 for a bad type / K / M; -2 when `isa` is not one this CPU runs. */
int baton_gguf_gemm_q8(const int8_t *xq, const float *xd, const float *xs, int64_t M, int64_t K,
                       const uint8_t *w, int64_t N, int32_t type, int32_t isa, float *y) {
    if ((type != 3 && type != 8) || K % QK != 0 || K <= 0 || M < 1) return -1;
    if (isa == 0) isa = best_int8_isa();
    if (isa < BATON_I8_AVX2 || isa > BATON_I8_AVX512VNNI || !(baton_cpu_int8_isas() & (1 << isa)))
        return -2;
    if (isa == BATON_I8_AVX512VNNI && M == 1) gemv_q8_avx512vnni(xq, xd, xs, K, w, N, type, y);
    else if (isa == BATON_I8_AVX512VNNI) gemm_q8_vnni256(xq, xd, xs, M, K, w, N, type, y);
    else if (isa == BATON_I8_AVXVNNI) gemm_q8_avxvnni(xq, xd, xs, M, K, w, N, type, y);
    else gemm_q8_avx2(xq, xd, xs, M, K, w, N, type, y);
    return 0;
}

/* One activation row: the signature the fused decode step calls. */
int baton_gguf_gemv_q8(const int8_t *xq, const float *xd, const float *xs, int64_t K,
                       const uint8_t *w, int64_t N, int32_t type, float *y) {
    return baton_gguf_gemm_q8(xq, xd, xs, 1, K, w, N, type, 0, y);
}

/* Quantize x [M, K] into scratch and multiply: the one call a layer makes. scratch holds
 * M * (K + 8 * K / 32) bytes: xd [M, K / 32] float32, then xs [M, K / 32] float32, then
 * xq [M, K] int8. Returns as baton_gguf_gemm_q8. */
int baton_gguf_gemm_q8_f32(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                           int32_t type, int32_t isa, void *scratch, float *y) {
    if (K % QK != 0 || K <= 0 || M < 1) return -1;
    const int64_t nb = K / QK;
    float *xd = (float *)scratch, *xs = xd + M * nb;
    int8_t *xq = (int8_t *)(xs + M * nb);
    for (int64_t m = 0; m < M; m++)
        baton_quantize_row_q8(x + m * K, K, xq + m * K, xd + m * nb, xs + m * nb);
    return baton_gguf_gemm_q8(xq, xd, xs, M, K, w, N, type, isa, y);
}
