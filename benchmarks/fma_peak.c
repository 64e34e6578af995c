/* The float32 arithmetic rate this CPU's cores can reach at most: each thread of an OpenMP team
 * runs independent chains of fused multiply-adds on registers (no memory), enough chains to
 * cover the instruction's latency on every FMA unit, in AVX2 (8 lanes) and, where cpuid
 * reports it, AVX-512 (16 lanes); the faster counts. No kernel of a model step can do its
 * multiply-adds faster, so benchmarks/serving_bounds.py takes this rate as its ceiling.
 * Build: engine/native.py (load_native), like the engine's kernels.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#define CHAINS 12 /* independent accumulators: latency 4 x 2 units, with room to spare */

static float chains_avx2(int64_t iters) {
    __m256 acc[CHAINS];
    const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
    for (int c = 0; c < CHAINS; c++) acc[c] = _mm256_set1_ps((float)c);
    for (int64_t i = 0; i < iters; i++)
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm256_fmadd_ps(acc[c], a, b);
    __m256 sum = acc[0];
    for (int c = 1; c < CHAINS; c++) sum = _mm256_add_ps(sum, acc[c]);
    float lanes[8];
    _mm256_storeu_ps(lanes, sum);
    return lanes[0];
}

__attribute__((target("avx512f"))) static float chains_avx512(int64_t iters) {
    __m512 acc[CHAINS];
    const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
    for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_set1_ps((float)c);
    for (int64_t i = 0; i < iters; i++)
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
    __m512 sum = acc[0];
    for (int c = 1; c < CHAINS; c++) sum = _mm512_add_ps(sum, acc[c]);
    return _mm512_reduce_add_ps(sum);
}

/* *flops = floating-point operations a second (2 per lane of a fused multiply-add) of
 * `threads` threads each running `iters` rounds of the chains, 16 lanes wide where avx512 and
 * the CPU has AVX-512 F, else 8. Returns 0, or -1 for bad arguments. *sink receives the sums
 * (so that the compiler keeps the chains). */
int baton_fma_peak(int threads, int64_t iters, int avx512, double *flops, float *sink) {
    if (threads < 1 || iters < 1) return -1;
    __builtin_cpu_init();
    const int wide = avx512 && __builtin_cpu_supports("avx512f");
    float total = 0.0f;
    const double start = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : total)
    total += wide ? chains_avx512(iters) : chains_avx2(iters);
    const double seconds = omp_get_wtime() - start;
    *flops = 2.0 * CHAINS * (wide ? 16 : 8) * (double)iters * threads / seconds;
    *sink = total;
    return 0;
}
