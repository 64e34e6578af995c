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
#include <stdint.h>
#include <string.h>

#define QK 32
#define TILE_M 4 /* rows of x sharing one unpacked block */

static inline float f16_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The 32 quants of one block as four float vectors of 8, in order (Q4_1 unsigned 0..15,
 * Q8_0 signed). */
static inline void quants_q4_1(const uint8_t *qs, __m256 q[4]) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)qs);
    const __m128i lo = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

static inline void quants_q8_0(const uint8_t *qs, __m256 q[4]) {
    for (int i = 0; i < 4; i++)
        q[i] = _mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * i))));
}

/* The 32 weights of one block as four vectors of 8, in order, each computed as gguf-py does:
 * Q4_1 (d * q) + m, Q8_0 q * d. */
static inline void rebuild_q4_1(const uint8_t *b, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(f16_to_f32(b));
    const __m256 m = _mm256_set1_ps(f16_to_f32(b + 2));
    quants_q4_1(b + 4, w);
    for (int i = 0; i < 4; i++) w[i] = _mm256_add_ps(_mm256_mul_ps(d, w[i]), m);
}

static inline void rebuild_q8_0(const uint8_t *b, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(f16_to_f32(b));
    quants_q8_0(b + 2, w);
    for (int i = 0; i < 4; i++) w[i] = _mm256_mul_ps(w[i], d);
}

/* y[M, N] = x[M, K] W^T. Per block the dot product is factored: for Q4_1
 *   sum_j x_j (d q_j + m) = d * sum_j x_j q_j + m * sum_j x_j,
 * with sum_j x_j computed once per row of x and block, shared by all N outputs; for Q8_0
 *   sum_j x_j (q_j d) = d * sum_j x_j q_j.
 * The same products as a dense float32 GEMM over the dequantized weights, summed in another
 * order. Returns 0, or -1 for an unknown block type or K not a multiple of 32. */
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
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = w + n * nb * block_bytes;
        for (int64_t m0 = 0; m0 < M; m0 += TILE_M) {
            const int64_t tm = M - m0 < TILE_M ? M - m0 : TILE_M;
            __m256 acc[TILE_M];
            float offset[TILE_M];
            for (int i = 0; i < TILE_M; i++) {
                acc[i] = _mm256_setzero_ps();
                offset[i] = 0.0f;
            }
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = row + b * block_bytes;
                const __m256 d = _mm256_set1_ps(f16_to_f32(blk));
                __m256 q[4];
                if (type == 3) quants_q4_1(blk + 4, q);
                else quants_q8_0(blk + 2, q);
                const float m = type == 3 ? f16_to_f32(blk + 2) : 0.0f;
                for (int64_t i = 0; i < tm; i++) {
                    const float *xb = x + (m0 + i) * K + b * QK;
                    __m256 p = _mm256_mul_ps(_mm256_loadu_ps(xb), q[0]);
                    p = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8), q[1], p);
                    p = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), q[2], p);
                    p = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), q[3], p);
                    acc[i] = _mm256_fmadd_ps(d, p, acc[i]);
                    if (type == 3) offset[i] += m * xsum[(m0 + i) * nb + b];
                }
            }
            for (int64_t i = 0; i < tm; i++) y[(m0 + i) * N + n] = hsum(acc[i]) + offset[i];
        }
    }
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
 * block is two vectors of 16: the same products x_j q_j, d and m as baton_gguf_gemm, summed
 * 16 lanes wide instead of 8 (float32 arithmetic, another summation order). GEMV_ROWS output
 * rows per iteration share the x loads and give the core independent accumulation chains. */
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

#ifndef GEMV_ROWS
#define GEMV_ROWS 2 /* output rows per iteration: independent accumulation chains (4, 8: no faster) */
#endif

AVX512_TARGET static void gemv_avx512(const float *x, int64_t K, const uint8_t *w, int64_t N,
                                      int32_t type, const float *xsum, float *y) {
    const int64_t block_bytes = type == 3 ? 20 : 34;
    const int64_t nb = K / QK;
    const int64_t groups = (N + GEMV_ROWS - 1) / GEMV_ROWS;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t n0 = g * GEMV_ROWS;
        const int rows = N - n0 < GEMV_ROWS ? (int)(N - n0) : GEMV_ROWS;
        const uint8_t *row[GEMV_ROWS];
        __m512 acc[GEMV_ROWS];
        float offset[GEMV_ROWS];
        for (int r = 0; r < GEMV_ROWS; r++) { /* a short last group repeats its last row */
            row[r] = w + (n0 + (r < rows ? r : rows - 1)) * nb * block_bytes;
            acc[r] = _mm512_setzero_ps();
            offset[r] = 0.0f;
        }
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + b * QK;
            const __m512 x_lo = _mm512_loadu_ps(xb), x_hi = _mm512_loadu_ps(xb + 16);
            for (int r = 0; r < GEMV_ROWS; r++) {
                const uint8_t *blk = row[r] + b * block_bytes;
                __m512 q_lo, q_hi;
                if (type == 3) {
                    quants16_q4_1(blk + 4, &q_lo, &q_hi);
                    offset[r] += f16_to_f32(blk + 2) * xsum[b];
                } else {
                    quants16_q8_0(blk + 2, &q_lo, &q_hi);
                }
                const __m512 p = _mm512_fmadd_ps(x_hi, q_hi, _mm512_mul_ps(x_lo, q_lo));
                acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(f16_to_f32(blk)), p, acc[r]);
            }
        }
        for (int r = 0; r < rows; r++) y[n0 + r] = _mm512_reduce_add_ps(acc[r]) + offset[r];
    }
}

/* y[1, N] = x[1, K] W^T with AVX-512. Returns 0; -1 for an unknown block type or K not a
 * multiple of 32; -2 where this CPU lacks AVX-512 F/BW/VL (the caller then uses
 * baton_gguf_gemm). xsum: [K / 32] scratch. */
int baton_gguf_gemv_avx512(const float *x, int64_t K, const uint8_t *w, int64_t N, int32_t type,
                           float *xsum, float *y) {
    if ((type != 3 && type != 8) || K % QK != 0) return -1;
    if (!baton_cpu_has_avx512()) return -2;
    const int64_t nb = K / QK;
    if (type == 3)
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + b * QK;
            __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                                     _mm256_add_ps(_mm256_loadu_ps(xb + 16),
                                                   _mm256_loadu_ps(xb + 24)));
            xsum[b] = hsum(s);
        }
    gemv_avx512(x, K, w, N, type, xsum, y);
    return 0;
}
