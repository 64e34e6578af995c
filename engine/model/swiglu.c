/* SwiGLU's activation of float32 rows in one pass: out = silu(gate) * up, read from the fused
 * gate/up projection's output [M, 2 I] (gate: columns [0, I), up: [I, 2 I)) into a contiguous
 * [M, I] (the down projection's input). torch spends two passes on it (silu in place on the
 * strided gate view, then the multiply), ~75 ms of a 2,048-token SmolLM2 prefill step.
 *
 *   silu(g) = g / (1 + e^-g)   (e^-g clamped to [e^-88, e^88]: float32's finite range)
 *
 * e^x is the Cody-Waite / Cephes polynomial of paged_decode.c (within ~2 ulp of expf), so the
 * result differs from torch's F.silu in the last bits only. Rows are shared out between
 * threads (OpenMP) from PARALLEL_ROWS rows on. I % 8 == 0.
 * Build: see engine/native.py.
 */
#include <immintrin.h>
#include <stdint.h>

#define PARALLEL_ROWS 16

/* e^x for x in [-88, 88], 8 lanes. */
static inline __m256 swiglu_exp(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.0f)), _mm256_set1_ps(88.0f));
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
            const __m256 e = swiglu_exp(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
        }
    }
    return 0;
}
