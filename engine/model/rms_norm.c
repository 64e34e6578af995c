/* RMSNorm of float32 rows, one C call instead of six torch ops (each ~4 us of dispatch at
 * batch 1, where a decode step runs 61 norms on rows of 576).
 *
 * y[m, :] = weight * (x[m, :] * inv_rms), inv_rms = 1 / sqrt(mean(x[m, :]^2) + eps): HF's
 * formula and order of operations in float32; only the summation order of the mean differs
 * (eight lanes, then across them).
 * Build: cc -O3 -mavx2 -mfma -mf16c -ffp-contract=off -fopenmp -shared -fPIC.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "../simd_math.h"

/* y = weight * (v * inv_rms) for one row v of E, inv_rms = 1 / sqrt(mean(v^2) + eps) with the
 * row's squares summed into the 8 lanes of acc. */
static inline void rms_scale_row(const float *v, const float *weight, int64_t E, __m256 acc,
                                 float eps, float *y) {
    const float inv_rms = 1.0f / sqrtf(hsum(acc) / (float)E + eps);
    const __m256 k = _mm256_set1_ps(inv_rms);
    for (int64_t e = 0; e < E; e += 8)
        _mm256_storeu_ps(y + e, _mm256_mul_ps(_mm256_loadu_ps(weight + e),
                                              _mm256_mul_ps(_mm256_loadu_ps(v + e), k)));
}

/* x, y: [M, E] row-major (y may be x); weight: [E]. Returns 0, or -1 for E not a multiple of 8. */
int baton_rms_norm(const float *x, int64_t M, int64_t E, const float *weight, float eps,
                   float *y) {
    if (E % 8 != 0 || E <= 0) return -1;
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * E;
        float *yr = y + m * E;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t e = 0; e < E; e += 8) {
            const __m256 v = _mm256_loadu_ps(xr + e);
            acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
        }
        rms_scale_row(xr, weight, E, acc, eps, yr);
    }
    return 0;
}

/* The residual add fused with the norm that follows it (a pre-norm decoder's x + attn, then
 * the MLP's norm; x + mlp, then the next layer's norm): one pass over the rows instead of the
 * add's and the norm's six torch ops.
 *   s[m, :] = x[m, :] + r[m, :]             (s may be x or r)
 *   y[m, :] = weight * (s[m, :] * inv_rms)  (as baton_rms_norm over s)
 * x, r, s, y: [M, E] row-major; weight: [E]. Rows are shared out between threads (OpenMP)
 * from PARALLEL_ROWS rows on. Returns 0, or -1 for E not a multiple of 8. */
#define PARALLEL_ROWS 64

int baton_add_rms_norm(const float *x, const float *r, int64_t M, int64_t E, const float *weight,
                       float eps, float *s, float *y) {
    if (E % 8 != 0 || E <= 0) return -1;
#pragma omp parallel for schedule(static) if (M >= PARALLEL_ROWS)
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * E, *rr = r + m * E;
        float *sr = s + m * E, *yr = y + m * E;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t e = 0; e < E; e += 8) {
            const __m256 v = _mm256_add_ps(_mm256_loadu_ps(xr + e), _mm256_loadu_ps(rr + e));
            _mm256_storeu_ps(sr + e, v);
            acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
        }
        rms_scale_row(sr, weight, E, acc, eps, yr);
    }
    return 0;
}
