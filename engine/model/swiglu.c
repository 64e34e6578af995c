/* SwiGLU's activation of float32 rows in one pass: out = silu(gate) * up, read from the fused
 * gate/up projection's output [M, 2 I] (gate: columns [0, I), up: [I, 2 I)) into a contiguous
 * [M, I] (the down projection's input). torch spends two passes on it (silu in place on the
 * strided gate view, then the multiply), ~75 ms of a 2,048-token SmolLM2 prefill step.
 *
 *   silu(g) = g / (1 + e^-g)   (e^-g clamped to [e^-87.3, e^88]: float32's normal range)
 *
 * e^x is simd_math.h's Cody-Waite / Cephes polynomial (within ~2 ulp of expf), so the
 * result differs from torch's F.silu in the last bits only. Rows are shared out between
 * threads (OpenMP) from PARALLEL_ROWS rows on. I % 8 == 0.
 * Build: see engine/native.py.
 */
#include <immintrin.h>
#include <stdint.h>

#include "../simd_math.h"

#define PARALLEL_ROWS 16

/* gate_up: [M, 2 I] with row stride ld (>= 2 I); out: [M, I] contiguous.
 * Returns 0, or -1 for I not a multiple of 8. */
int baton_swiglu(const float *gate_up, int64_t M, int64_t I, int64_t ld, float *out) {
    if (I % 8 != 0 || I <= 0) return -1;
    const __m256 one = _mm256_set1_ps(1.0f);
#pragma omp parallel for schedule(static) if (M >= PARALLEL_ROWS)
    for (int64_t m = 0; m < M; m++) {
        const float *g = gate_up + m * ld, *u = g + I;
        float *o = out + m * I;
        for (int64_t i = 0; i < I; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
        }
    }
    return 0;
}
