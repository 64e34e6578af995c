/* y [M, N] = x [M, K] W^T for many rows of x on AVX-512, W in GGUF Q4_1 or Q8_0 blocks: the
 * input rows in the vector lanes. Included by gguf_gemm.c after its AVX-512 part (it uses
 * AVX512_TARGET and rebuild_rows).
 *
 * x is first packed 16 rows to a vector, xt [ceil(M / 16), K, 16] (rows past M are zeros).
 * LANES_NT weight rows are rebuilt into a float32 panel (rebuild_rows: the checkpoint's own
 * weights, as gguf_gemm.c's panels). For each k, the tile loads LANES_MV vectors of xt (16 input
 * rows each) and broadcasts each panel row's weight: LANES_MV x LANES_NT multiply-adds per
 * LANES_MV + LANES_NT loads, the LANES_MV x LANES_NT sums in registers, no horizontal sums.
 *
 * Per output element: one running sum over k = 0 .. K - 1 in order, a fused multiply-add each
 * (s = x[i, k] w[n, k] + s, from s = 0), then + bias. That is the same whichever tile, lane,
 * vector or thread computes it, so a row's result does not depend on the other rows of the
 * product. (It is also what a kernel with the weight rows in the lanes and x broadcast would
 * compute: the same chain per element.)
 */

#define LANES 16   /* input rows per vector */
#define LANES_MV 2 /* vectors of input rows per tile */
#define LANES_NT 12 /* weight rows per tile: 2 x 12 sums + 2 x loads + a broadcast = 27 registers */

static inline int64_t lanes_groups(int64_t M) { return (M + LANES - 1) / LANES; }

/* r[j] = column j of the 16 x 16 matrix whose rows were r[0 .. 15]: unpacks pair rows, then
 * row pairs' 64-bit halves, then 128-bit lanes in two shuffles (out_{4L + c} gathers lane L of
 * the four vectors holding column 4L + c of rows 4i .. 4i + 3). */
AVX512_TARGET static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* u[4i + c], lane L: column 4L + c of rows 4i .. 4i + 3 */
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]),
                      c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int c = 0; c < 4; c++) {
        const __m512 p0 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x44),
                     p1 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xEE),
                     q0 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x44),
                     q1 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xEE);
        t[c] = _mm512_shuffle_f32x4(p0, q0, 0x88);
        t[4 + c] = _mm512_shuffle_f32x4(p0, q0, 0xDD);
        t[8 + c] = _mm512_shuffle_f32x4(p1, q1, 0x88);
        t[12 + c] = _mm512_shuffle_f32x4(p1, q1, 0xDD);
    }
    for (int j = 0; j < 16; j++) r[j] = t[j];
}

/* out [K, 16] (row stride os floats) = rows [16, K] (row stride K; rows past `rows` zeros),
 * transposed 16 x 16 at a time. */
AVX512_TARGET static void transpose_rows16(const float *in, int64_t rows, int64_t K, float *out,
                                           int64_t os) {
    for (int64_t k0 = 0; k0 < K; k0 += 16) {
        __m512 r[16];
        for (int l = 0; l < 16; l++)
            r[l] = l < rows ? _mm512_loadu_ps(in + l * K + k0) : _mm512_setzero_ps();
        transpose16(r);
        for (int j = 0; j < 16; j++) _mm512_storeu_ps(out + (k0 + j) * os, r[j]);
    }
}

/* Group g of x [M, K] into xt: xt[(g K + k) 16 + l] = x[16 g + l, k], zero past row M. */
AVX512_TARGET static void lanes_pack_group(const float *x, int64_t M, int64_t K, int64_t g,
                                           float *xt) {
    const int64_t rows = M - g * LANES;
    transpose_rows16(x + g * LANES * K, rows < LANES ? rows : LANES, K, xt + g * K * LANES, LANES);
}

/* xt = x [M, K] packed (every thread of the team; ends with a barrier). */
AVX512_TARGET static void lanes_pack_for(const float *x, int64_t M, int64_t K, float *xt) {
#pragma omp for schedule(static) nowait
    for (int64_t g = 0; g < lanes_groups(M); g++) lanes_pack_group(x, M, K, g, xt);
    team_barrier();
}

/* sums [LANES_NT, LANES_MV * 16]: sums[j][16 v + l] = panel row j . input row 16 v + l of the
 * MV groups at xt (group stride K * 16). MV is a constant where it is inlined. */
AVX512_TARGET static inline __attribute__((always_inline)) void
lanes_tile(const float *xt, int64_t K, const int MV, const float *panel, float *sums) {
    __m512 acc[LANES_MV][LANES_NT];
    for (int v = 0; v < MV; v++)
        for (int j = 0; j < LANES_NT; j++) acc[v][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m512 xv[LANES_MV];
        for (int v = 0; v < MV; v++) xv[v] = _mm512_load_ps(xt + (v * K + k) * LANES);
        for (int j = 0; j < LANES_NT; j++) {
            const __m512 wv = _mm512_set1_ps(panel[j * K + k]);
            for (int v = 0; v < MV; v++) acc[v][j] = _mm512_fmadd_ps(xv[v], wv, acc[v][j]);
        }
    }
    for (int v = 0; v < MV; v++)
        for (int j = 0; j < LANES_NT; j++)
            _mm512_storeu_ps(sums + j * LANES_MV * LANES + v * LANES, acc[v][j]);
}

/* lanes_tile for the groups g, g + 1 (or g alone, the last) of xt; returns the input rows the
 * sums hold. */
AVX512_TARGET static int64_t lanes_tiles(const float *xt, int64_t M, int64_t K, int64_t g,
                                         const float *panel, float *sums) {
    const float *at = xt + g * K * LANES;
    if (lanes_groups(M) - g >= 2) lanes_tile(at, K, 2, panel, sums);
    else lanes_tile(at, K, 1, panel, sums);
    const int64_t rows = M - g * LANES;
    return rows < LANES_MV * LANES ? rows : LANES_MV * LANES;
}

/* y [M, N] (+ bias [N] or NULL) = x W^T by lanes, xt holding x packed (lanes_pack_for); tiles
 * of LANES_NT weight rows shared out among the threads. panel: LANES_NT * K floats of this
 * thread's own. Call from inside a parallel region (every thread; ends with team_barrier). */
AVX512_TARGET static void lanes_product_for(const float *xt, int64_t M, int64_t K,
                                            const uint8_t *w, int64_t N, int32_t type,
                                            const float *bias, float *panel, float *y) {
    const int64_t tiles = (N + LANES_NT - 1) / LANES_NT;
#pragma omp for schedule(guided, 4) nowait
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * LANES_NT;
        const int count = N - n0 < LANES_NT ? (int)(N - n0) : LANES_NT;
        rebuild_rows(w, type, K, n0, count, LANES_NT, panel);
        for (int64_t g = 0; g < lanes_groups(M); g += LANES_MV) {
            float sums[LANES_NT * LANES_MV * LANES];
            const int64_t rows = lanes_tiles(xt, M, K, g, panel, sums);
            for (int64_t i = 0; i < rows; i++) {
                float *out = y + (g * LANES + i) * N + n0;
                for (int j = 0; j < count; j++) {
                    const float s = sums[j * LANES_MV * LANES + i];
                    out[j] = bias == NULL ? s : s + bias[n0 + j];
                }
            }
        }
    }
    team_barrier();
}

/* ---- few rows: the weight rows in the lanes -------------------------------------------------
 * A product of up to LANES_FEW_MAX rows (the logits of a prompt step's last token) would leave
 * most of every vector of input rows empty. There LANES_FEW_NV x 16 weight rows are rebuilt and
 * transposed, wt [K, 16 LANES_FEW_NV], and each input row's x[i, k] is broadcast into them: per
 * element the same chain of fused multiply-adds over k in order (s = x w + s), so the same
 * numbers as the lanes above. */
#define LANES_FEW_MAX 4
#define LANES_FEW_NV 4 /* vectors of 16 weight rows per tile: 4 chains for one input row */
/* The few rows' per-thread scratch, in floats per element of K: a tile's rebuilt weight rows
 * and their transposed copy. */
#define LANES_SCRATCH_PER_K (2 * 16 * LANES_FEW_NV)

/* Whether a product of `rows` input rows puts its weight rows in the lanes (the few rows). */
static inline int lanes_few_rows(int64_t rows) { return rows <= LANES_FEW_MAX; }

/* Floats of one thread's scratch for the lanes products of a step whose largest K is max_k and
 * whose few-row products (only the output head: a prompt's last rows) have K = few_k: a tile of
 * LANES_NT rebuilt weight rows of the largest K, or the few rows' tile. */
static inline int64_t lanes_scratch_floats(int64_t max_k, int64_t few_k) {
    const int64_t tile = LANES_NT * max_k, few = LANES_SCRATCH_PER_K * few_k;
    return tile > few ? tile : few;
}

/* y [M, N] (+ bias) = x [M, K] W^T for M <= LANES_FEW_MAX, x row-major; tiles of
 * 16 LANES_FEW_NV weight rows shared out among the threads. scratch: LANES_SCRATCH_PER_K * K
 * floats of this thread's own (64-byte aligned). Every thread (ends with team_barrier). */
AVX512_TARGET static void lanes_few_product_for(const float *x, int64_t M, int64_t K,
                                                const uint8_t *w, int64_t N, int32_t type,
                                                const float *bias, float *scratch, float *y) {
    const int64_t width = 16 * LANES_FEW_NV, tiles = (N + width - 1) / width;
    float *rows = scratch, *wt = scratch + width * K;
#pragma omp for schedule(guided, 4) nowait
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * width;
        const int count = N - n0 < width ? (int)(N - n0) : (int)width;
        rebuild_rows(w, type, K, n0, count, (int)width, rows);
        for (int v = 0; v < LANES_FEW_NV; v++)
            transpose_rows16(rows + v * 16 * K, 16, K, wt + v * 16, width);
        for (int64_t i = 0; i < M; i++) {
            __m512 acc[LANES_FEW_NV];
            for (int v = 0; v < LANES_FEW_NV; v++) acc[v] = _mm512_setzero_ps();
            const float *xi = x + i * K;
            for (int64_t k = 0; k < K; k++) {
                const __m512 xb = _mm512_set1_ps(xi[k]);
                for (int v = 0; v < LANES_FEW_NV; v++)
                    acc[v] = _mm512_fmadd_ps(xb, _mm512_load_ps(wt + k * width + v * 16), acc[v]);
            }
            float sums[16 * LANES_FEW_NV];
            for (int v = 0; v < LANES_FEW_NV; v++) _mm512_storeu_ps(sums + v * 16, acc[v]);
            for (int j = 0; j < count; j++)
                y[i * N + n0 + j] = bias == NULL ? sums[j] : sums[j] + bias[n0 + j];
        }
    }
    team_barrier();
}

/* y[M, N] = x[M, K] W^T by lanes (lanes_product_for): the entry point for tests and
 * benchmarks. Returns 0, -1 for an unknown block type or K not a multiple of 32, -2 where this
 * CPU lacks AVX-512 F/BW/VL, -3 when scratch memory failed. */
int baton_gguf_gemm_lanes(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                          int32_t type, float *y) {
    if ((type != 3 && type != 8) || K % QK != 0 || K <= 0 || M < 1) return -1;
    if (!baton_cpu_has_avx512()) return -2;
    const int threads = omp_get_max_threads();
    const int64_t own = lanes_scratch_floats(K, K);
    const size_t xt_floats = lanes_few_rows(M) ? 0 : (size_t)(lanes_groups(M) * LANES * K);
    float *scratch = aligned_alloc(64, sizeof(float) * (xt_floats + (size_t)(threads * own)));
    if (scratch == NULL) return -3;
#pragma omp parallel num_threads(threads)
    {
        float *mine = scratch + xt_floats + omp_get_thread_num() * own;
        if (lanes_few_rows(M)) {
            lanes_few_product_for(x, M, K, w, N, type, NULL, mine, y);
        } else {
            lanes_pack_for(x, M, K, scratch);
            lanes_product_for(scratch, M, K, w, N, type, NULL, mine, y);
        }
    }
    free(scratch);
    return 0;
}
