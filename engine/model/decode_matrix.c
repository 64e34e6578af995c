/* The matrix products of the fused decode step (decode_step.c): y [R, N] = x [R, K] W^T for the
 * step's R activation rows, W read straight from its GGUF blocks, every weight row once per
 * step (a pair of weight rows stays in L1 while all R activation rows pass it).
 *
 * Each output element is computed exactly as the one-row kernels compute it for one row of x,
 * whatever R and whichever tile it falls in (the tiles only share the unpacked weights and the
 * x loads): so a row's result never depends on the other rows of the step.
 *   - float32, AVX2: baton_gguf_gemm's arithmetic per (weight row, activation row);
 *   - float32, AVX-512 (where the caller asks for it; Q4_1 rows, and Q8_0 rows too where it
 *     also asks for AMX: gguf_kernel.q8_0_rows_avx512): gemv_avx512's arithmetic;
 *   - int8 activations: gguf_gemm.c's ymm integer-dot tiles of the chosen ISA (the AVX-512 VNNI
 *     choice takes the 256-bit VNNI tile, as the one-row fused step always has);
 * a bias is added after the row sum (torch's y.add_(bias)).
 * Included by decode_step.c after gguf_gemm.c.
 */

/* One weight matrix W [n, k] in GGUF blocks, with an optional bias [n]. */
typedef struct {
    const uint8_t *blocks; /* [n, k / 32 * block bytes] */
    const float *bias;     /* [n] or NULL */
    int64_t n, k;
    int32_t type; /* GGML type id: 3 Q4_1, 8 Q8_0 */
} ds_matrix;

/* The input rows of a product, as every kernel wants them: x [R, K] (row stride K), their
 * block sums [R, K / 32] and with int8 their quantized blocks (q [R, K], scales d and
 * d * sum(q) [R, K / 32]). */
typedef struct {
    const float *x, *xsum;
    const int8_t *xq;
    const float *xd, *xs;
    int avx512, int8_isa;
    int by_panels; /* float32 products of a step of more than EXACT_MAX_ROWS rows (AVX2) */
    int by_lanes;  /* float32 products of a step of LANES_MIN_ROWS rows or more on AVX-512 */
    float *panels; /* this thread's scratch for either: PANELS_FLOATS_PER_K floats per element
                    * of the largest K, or lanes_scratch_floats (few rows: only the head's K) */
    float *xt;     /* by lanes: the input rows packed (gemm_lanes.c), shared by the team */
    int by_amx;    /* steps of AMX_MIN_ROWS rows or more on AMX: every product in tiles */
    uint16_t *xb;  /* by AMX: the input rows' bfloat16 parts (gemm_amx.c), shared by the team */
    float *xb_sum; /* by AMX: the input rows' block sums, shared by the team */
} ds_input;

/* Products of more rows than this (float32) go through gguf_gemm.c's panels: each weight
 * rebuilt once per step into float32, then register tiles of 3 x 4. Up to it every output
 * element is computed with the one-row kernels' arithmetic, so a step of up to EXACT_MAX_ROWS
 * rows gives each row the numbers it has alone; above it each row has the panel arithmetic's
 * numbers, also the same whatever the other rows. Measured on a 2-core AVX2 EPYC, SmolLM2's
 * gate/up product: 8 rows 0.84x the one-row tiles, 16 rows 1.5x, 64 rows 1.7x.
 * On AVX-512 (the caller's avx512), steps of LANES_MIN_ROWS rows or more multiply by lanes
 * instead (gemm_lanes.c: input rows in the lanes, one running sum per element), again the same
 * numbers for a row whatever the other rows. Measured on a 2-core Zen 4 EPYC (2 threads,
 * SmolLM2's shapes): in a 256-token prompt step the products took 264-268 ms by lanes against
 * 357-375 ms by panels (the same build with -DLANES_MIN_ROWS=100000, runs alternating); alone
 * (python -m benchmarks.product_paths) lanes are 1.02-1.27x the panels at 32-256 rows and
 * 1.06-1.17x at 16, and lose below 16 rows, where most of a vector is empty.
 * Which arithmetic a step takes is set by its row count (and the ISA), for every product of
 * the step but the head: the logits of up to EXACT_MAX_ROWS rows take the one-row arithmetic
 * in any step (decode_step.c). */
#define EXACT_MAX_ROWS 8
#ifndef LANES_MIN_ROWS /* -DLANES_MIN_ROWS=... at build time overrides it (A/B runs) */
#define LANES_MIN_ROWS 16
#endif
/* Where the CPU has AMX (and the caller asks for it: the model's avx512 = 2), every step past
 * the exact rows (AMX_MIN_ROWS rows or more) takes AMX tiles for every product (gemm_amx.c)
 * instead of the panels (9-15 rows) or the lanes. Measured on a
 * 2-vCPU Intel Xeon VM with AMX (python -m benchmarks.isa_steps --rows 9,12,16,24,32,64:
 * SmolLM2, 2 threads, whole decode steps, gguf_isa auto against avx512): 0.89x the time of
 * the panels' at 9 rows, 0.81x at 12, 0.78-0.81x of the lanes' at 16-64 rows (docs/design/
 * cpu-kernels.md). */
#ifndef AMX_MIN_ROWS
#define AMX_MIN_ROWS (EXACT_MAX_ROWS + 1)
#endif
/* The per-thread panel scratch of the panels, in floats per element of K: two PANEL_N-row
 * panels (gate and up). The lanes' is lanes_scratch_floats (gemm_lanes.c). */
#define PANELS_FLOATS_PER_K (2 * PANEL_N)

/* Work sharing: guided chunks (half of what is left per grab, down to 32 matrix rows / 32
 * SwiGLU outputs): a thread the OS has descheduled leaves its share to the others instead of
 * holding up the barrier with half of every product (at load ~7 on the 2 shared cores dynamic
 * chunks took 133 vs 159 ms per one-row step with static halves), while on a quiet machine
 * guided costs what static does (7.76 vs 7.70 ms per step at 2 threads; dynamic chunks of 32
 * rows: 9.02 ms). Which thread computes a row never changes its value. The per-head tasks
 * (decode_step.c: RoPE per row and KV head, the windows' merge per row and head) are guided
 * down to one: a 256-token prompt step has 3,072 of them a layer, and one claim each (dynamic)
 * cost ~6 ms of its ~295 ms on the Zen 4 VM. -DROWS_SCHEDULE=... (with SWIGLU_SCHEDULE and
 * HEADS_SCHEDULE) at build time overrides them. */
#ifndef ROWS_SCHEDULE
#define ROWS_SCHEDULE schedule(guided, 16)
#define SWIGLU_SCHEDULE schedule(guided, 4)
#define HEADS_SCHEDULE schedule(guided, 1)
#endif
_Static_assert(TILE_M == I8_TILE_M, "one tile height for the float32 and the int8 tiles");
_Static_assert(AVX512_TILE_M >= TILE_M, "swiglu_for's tiles hold either");
#define PRAGMA(x) _Pragma(#x)
/* A work-share of the step: `omp for` without its barrier; each is followed by team_barrier()
 * (team_barrier.h: waits without sleeping). */
#define OMP_FOR(sched) PRAGMA(omp for sched nowait)

static inline int64_t block_bytes_of(int32_t type) { return type == 3 ? 20 : type == 8 ? 34 : 0; }

/* Block sums of x [K] (sum of each block of 32), the formula of gguf_gemm.c. Rows of a
 * [R, K] matrix are consecutive blocks, so one call with K = R K sums them all. */
static void block_sums(const float *x, int64_t K, float *xsum) {
    for (int64_t b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                                 _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24)));
        xsum[b] = hsum(s);
    }
}

/* in = the R rows of x [R, K] ready for a product: block sums where the AVX2 float32 tiles
 * take them (Q4_1's m sum(x); the AVX-512 tiles rebuild the weights, panels and lanes need
 * none), and the int8 blocks where the step uses them (per block of 32, so all rows in one
 * call). */
static void prepare_input(ds_input *in, const float *x, int64_t R, int64_t K, float *xsum,
                          int8_t *xq, float *xd, float *xs) {
    if (in->by_amx) amx_split_for(x, R, K, in->xb, in->xb_sum); /* ends in a barrier */
    /* packed even for few rows (whose products read x): swiglu_lanes_for reads xt */
    else if (in->by_lanes) lanes_pack_for(x, R, K, in->xt); /* barrier */
    else if (!in->by_panels && !in->avx512 && !in->int8_isa) block_sums(x, R * K, xsum);
    if (in->int8_isa) baton_quantize_row_q8(x, R * K, xq, xd, xs);
    in->x = x;
    in->xsum = xsum;
    in->xq = xq;
    in->xd = xd;
    in->xs = xs;
}

/* ---- the tiles: y[i * ys + r] = (row n0 + r of W) . (input row i), r < count <= 2,
 * i < TM <= TILE_M; x, xsum (and xq, xd, xs) start at the tile's first input row. TM is a
 * constant where the tiles are inlined (a switch on tm), so accumulators are registers. */

/* float32, AVX2: baton_gguf_gemm's tile (gguf_gemm.c: row_tile_avx2) for each weight row. */
static void rows_avx2(const ds_matrix *w, const float *x, const float *xsum, int64_t n0,
                      int count, int tm, float *y, int64_t ys) {
    const int64_t row_bytes = w->k / QK * block_bytes_of(w->type);
    for (int r = 0; r < count; r++)
        row_rows_avx2(w->blocks + (n0 + r) * row_bytes, w->type, w->k, x, xsum, tm, y + r, ys);
}

/* float32, AVX-512: gguf_gemm.c's tile_avx512 (gemv_avx512's arithmetic) for Q4_1 or Q8_0,
 * with the block type and tm (1 .. AVX512_TILE_M) made constants. */
AVX512_TARGET static void rows_avx512(const ds_matrix *w, const float *x, int64_t n0, int count,
                                      int tm, float *y, int64_t ys) {
    const int64_t row_bytes = w->k / QK * block_bytes_of(w->type);
    const uint8_t *rows = w->blocks + n0 * row_bytes;
#define TILE_TM(TYPE)                                                                              \
    switch (tm) {                                                                                  \
    case 1: tile_avx512(rows, row_bytes, TYPE, w->k, count, x, 1, y, ys); break;                   \
    case 2: tile_avx512(rows, row_bytes, TYPE, w->k, count, x, 2, y, ys); break;                   \
    case 3: tile_avx512(rows, row_bytes, TYPE, w->k, count, x, 3, y, ys); break;                   \
    case 4: tile_avx512(rows, row_bytes, TYPE, w->k, count, x, 4, y, ys); break;                   \
    case 5: tile_avx512(rows, row_bytes, TYPE, w->k, count, x, 5, y, ys); break;                   \
    case 6: tile_avx512(rows, row_bytes, TYPE, w->k, count, x, 6, y, ys); break;                   \
    case 7: tile_avx512(rows, row_bytes, TYPE, w->k, count, x, 7, y, ys); break;                   \
    default: tile_avx512(rows, row_bytes, TYPE, w->k, count, x, 8, y, ys); break;                  \
    }
    if (w->type == 3) {
        TILE_TM(3)
    } else {
        TILE_TM(8)
    }
#undef TILE_TM
}

/* int8: gguf_gemm.c's tile of each ISA, W starting at the first weight row, y[i * ys + r]. */
#define DEFINE_I8_ROWS(NAME, TARGET, TILE)                                                         \
    TARGET static void NAME(const int8_t *xq, const float *xd, const float *xs, int64_t K,        \
                            const uint8_t *w, int count, int32_t type, int tm, float *y,          \
                            int64_t ys) {                                                         \
        switch (tm) {                                                                              \
        case 1: TILE(xq, xd, xs, K, w, 0, count, type, 0, 1, ys, y); break;                        \
        case 2: TILE(xq, xd, xs, K, w, 0, count, type, 0, 2, ys, y); break;                        \
        case 3: TILE(xq, xd, xs, K, w, 0, count, type, 0, 3, ys, y); break;                        \
        default: TILE(xq, xd, xs, K, w, 0, count, type, 0, 4, ys, y); break;                       \
        }                                                                                          \
    }
DEFINE_I8_ROWS(i8_rows_avx2, NO_TARGET, gemm_q8_avx2_tile)
DEFINE_I8_ROWS(i8_rows_avxvnni, AVXVNNI_TARGET, gemm_q8_avxvnni_tile)
DEFINE_I8_ROWS(i8_rows_vnni256, AVX512VNNI_TARGET, gemm_q8_vnni256_tile)

static void i8_rows(const ds_matrix *w, const ds_input *in, int64_t n0, int count, int64_t m0,
                    int tm, float *y, int64_t ys) {
    const int64_t nb = w->k / QK;
    const uint8_t *rows = w->blocks + n0 * nb * block_bytes_of(w->type);
    const int8_t *xq = in->xq + m0 * w->k;
    const float *xd = in->xd + m0 * nb, *xs = in->xs + m0 * nb;
    if (in->int8_isa == BATON_I8_AVXVNNI)
        i8_rows_avxvnni(xq, xd, xs, w->k, rows, count, w->type, tm, y, ys);
    else if (in->int8_isa == BATON_I8_AVX512VNNI)
        i8_rows_vnni256(xq, xd, xs, w->k, rows, count, w->type, tm, y, ys);
    else
        i8_rows_avx2(xq, xd, xs, w->k, rows, count, w->type, tm, y, ys);
}

/* The input rows that share one unpacking of a block of W: AVX512_TILE_M on the AVX-512
 * float32 tiles (two running sums a row and weight row, so 8 rows fit the registers), else
 * TILE_M. */
static inline int tile_rows(const ds_matrix *w, const ds_input *in) {
    return !in->int8_isa && in->avx512 && (w->type == 3 || in->avx512 == 2) ? AVX512_TILE_M
                                                                            : TILE_M;
}

/* y[i * ys + r] = rows n0 + r of W times input rows m0 + i (+ bias), r < count <= 2,
 * i < tm <= tile_rows(w, in). */
static void matrix_rows(const ds_matrix *w, const ds_input *in, int64_t n0, int count, int64_t m0,
                        int tm, float *y, int64_t ys) {
    const float *x = in->x + m0 * w->k, *xsum = in->xsum + m0 * (w->k / QK);
    if (in->int8_isa) i8_rows(w, in, n0, count, m0, tm, y, ys);
    else if (in->avx512 && (w->type == 3 || in->avx512 == 2))
        rows_avx512(w, x, n0, count, tm, y, ys);
    else rows_avx2(w, x, xsum, n0, count, tm, y, ys);
    if (w->bias != NULL)
        for (int i = 0; i < tm; i++)
            for (int r = 0; r < count; r++) y[i * ys + r] = y[i * ys + r] + w->bias[n0 + r];
}

/* y [R, N] = x W^T, pairs of weight rows shared out among the team, each pair times all R
 * input rows (call from every thread; ends with a barrier). */
static void matrix_for(const ds_matrix *w, const ds_input *in, int64_t R, float *y) {
    const int64_t pairs = (w->n + 1) / 2, N = w->n;
    if (in->by_amx) { /* every product of the step */
        amx_product_for(in->xb, in->xb_sum, R, w->k, w->blocks, N, w->type, w->bias, in->panels,
                        y);
        return;
    }
    if (in->by_lanes && lanes_few_rows(R)) {
        lanes_few_product_for(in->x, R, w->k, w->blocks, N, w->type, w->bias, in->panels, y);
        return;
    }
    if (in->by_lanes) {
        lanes_product_for(in->xt, R, w->k, w->blocks, N, w->type, w->bias, in->panels, y);
        return;
    }
    if (in->by_panels) {
        panel_product_for(in->x, R, w->k, w->blocks, N, w->type, w->bias, in->panels, y);
        return;
    }
    const int th = tile_rows(w, in);
    OMP_FOR(ROWS_SCHEDULE)
    for (int64_t g = 0; g < pairs; g++) {
        const int64_t n0 = 2 * g;
        for (int64_t m0 = 0; m0 < R; m0 += th)
            matrix_rows(w, in, n0, N - n0 < 2 ? 1 : 2, m0, R - m0 < th ? (int)(R - m0) : th,
                        y + m0 * N + n0, N);
    }
    team_barrier();
}

/* silu(g) * u = g / (1 + e^-g) * u on 8 lanes. */
static inline __m256 silu_mul(__m256 g, __m256 u) {
    const __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

/* swiglu_for for many rows (float32): PANEL_N gate rows and the PANEL_N up rows of the same
 * outputs rebuilt into two panels, then each block of input rows times both (the panel
 * arithmetic: gguf_gemm.c), silu(gate) * up per output. */
static void swiglu_panels_for(const ds_matrix *w, const ds_input *in, int64_t R, int64_t inter,
                              float *act) {
    const int64_t K = w->k, chunks = (inter + PANEL_N - 1) / PANEL_N;
    float *gate_panel = in->panels, *up_panel = in->panels + PANEL_N * K;
    for (int64_t m0 = 0; m0 < R; m0 += PANEL_MB) {
        const int64_t mb = R - m0 < PANEL_MB ? R - m0 : PANEL_MB;
        OMP_FOR(schedule(guided, 4))
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t i0 = c * PANEL_N;
            const int count = inter - i0 < PANEL_N ? (int)(inter - i0) : PANEL_N;
            rebuild_rows(w->blocks, w->type, K, i0, count, PANEL_N, gate_panel);
            rebuild_rows(w->blocks, w->type, K, inter + i0, count, PANEL_N, up_panel);
            const float *gate_bias = w->bias == NULL ? NULL : w->bias + i0;
            const float *up_bias = w->bias == NULL ? NULL : w->bias + inter + i0;
            /* [mb, PANEL_N] each, 8 lanes (two rows) at a time: lanes past count or mb are
             * zeros, computed and dropped */
            float gate[PANEL_MB * PANEL_N + 8], up[PANEL_MB * PANEL_N + 8];
            if (count < PANEL_N) {
                memset(gate, 0, sizeof gate);
                memset(up, 0, sizeof up);
            } else {
                memset(gate + mb * PANEL_N, 0, sizeof(float) * 8);
                memset(up + mb * PANEL_N, 0, sizeof(float) * 8);
            }
            panel_rows(in->x + m0 * K, mb, K, gate_panel, count, gate_bias, gate, PANEL_N);
            panel_rows(in->x + m0 * K, mb, K, up_panel, count, up_bias, up, PANEL_N);
            for (int64_t e = 0; e < mb * PANEL_N; e += 8)
                _mm256_storeu_ps(gate + e,
                                 silu_mul(_mm256_loadu_ps(gate + e), _mm256_loadu_ps(up + e)));
            for (int64_t i = 0; i < mb; i++)
                memcpy(act + (m0 + i) * inter + i0, gate + i * PANEL_N,
                       sizeof(float) * (size_t)count);
        }
    }
    team_barrier();
}

/* swiglu_for by lanes (AVX-512, float32): LANES_NT / 2 gate rows and the up rows of the same
 * outputs rebuilt into one panel, each tile of input rows times it (gemm_lanes.c's arithmetic),
 * then silu(gate) * up per output (silu_mul, 8 rows at a time). */
AVX512_TARGET static void swiglu_lanes_for(const ds_matrix *w, const ds_input *in, int64_t R,
                                           int64_t inter, float *act) {
    const int64_t K = w->k, half = LANES_NT / 2, chunks = (inter + half - 1) / half;
    OMP_FOR(schedule(guided, 4))
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t i0 = c * half;
        const int count = inter - i0 < half ? (int)(inter - i0) : (int)half;
        rebuild_rows(w->blocks, w->type, K, i0, count, half, in->panels);
        rebuild_rows(w->blocks, w->type, K, inter + i0, count, half, in->panels + half * K);
        for (int64_t g = 0; g < lanes_groups(R); g += LANES_MV) {
            /* sums [LANES_NT, LANES_MV * 16]: gate outputs i0 + j in rows j < half, up in the
             * rows after; lanes past `rows` (and with one group, past 16) are not read */
            float sums[LANES_NT * LANES_MV * LANES];
            const int64_t rows = lanes_tiles(in->xt, R, K, g, in->panels, sums);
            for (int j = 0; j < count; j++) {
                float *gate = sums + j * LANES_MV * LANES, *up = gate + half * LANES_MV * LANES;
                if (w->bias != NULL)
                    for (int64_t i = 0; i < rows; i++) {
                        gate[i] = gate[i] + w->bias[i0 + j];
                        up[i] = up[i] + w->bias[inter + i0 + j];
                    }
                for (int64_t i = 0; i < rows; i += 8)
                    _mm256_storeu_ps(gate + i,
                                     silu_mul(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
                for (int64_t i = 0; i < rows; i++) act[(g * LANES + i) * inter + i0 + j] = gate[i];
            }
        }
    }
    team_barrier();
}

/* swiglu_for on AMX (gemm_amx.c's arithmetic): passes of up to 32 outputs, their gate rows and
 * up rows packed (16 rows a pack, gate packs then up packs), for each group of 16 input rows
 * all the sums, + bias, then silu(gate) * up (silu_mul, 8 outputs at a time). */
AMX_TARGET static void swiglu_amx_for(const ds_matrix *w, const ds_input *in, int64_t R,
                                      int64_t inter, float *act) {
    const int64_t K = w->k, width = AMX_PACKS / 2 * AMX_ROWS, passes = (inter + width - 1) / width;
    const int64_t plane = amx_groups(R) * AMX_ROWS * K;
    amx_scratch_parts parts = amx_scratch_at(in->panels, K); /* amx_scratch_floats(K) */
    uint16_t **bt = parts.bt;
    float **dm = parts.dm, *c = parts.c, *sums = parts.sums;
    amx_configure();
    OMP_FOR(schedule(static))
    for (int64_t t = 0; t < passes; t++) {
        const int64_t i0 = t * width;
        const int count = inter - i0 < width ? (int)(inter - i0) : (int)width;
        const int half = (count + AMX_ROWS - 1) / AMX_ROWS; /* gate packs; as many up packs */
        for (int j = 0; j < half; j++) {
            const int64_t o = i0 + j * AMX_ROWS;
            const int rows = inter - o < AMX_ROWS ? (int)(inter - o) : AMX_ROWS;
            amx_pack_weights(w->blocks, w->type, K, o, rows, bt[j], dm[j]);
            amx_pack_weights(w->blocks, w->type, K, inter + o, rows, bt[half + j], dm[half + j]);
        }
        for (int64_t g = 0; g < amx_groups(R); g++) {
            amx_group(in->xb, plane, in->xb_sum, K, g, R, w->type, 2 * half, bt, dm, c, sums);
            for (int i = 0; i < AMX_ROWS && g * AMX_ROWS + i < R; i++) {
                float gs[AMX_PACKS / 2 * AMX_ROWS], us[AMX_PACKS / 2 * AMX_ROWS];
                for (int j = 0; j < half; j++) {
                    __m512 gate = _mm512_load_ps(sums + 256 * j + 16 * i);
                    __m512 up = _mm512_load_ps(sums + 256 * (half + j) + 16 * i);
                    if (w->bias != NULL) {
                        const int64_t o = i0 + j * AMX_ROWS;
                        const int rows = inter - o < AMX_ROWS ? (int)(inter - o) : AMX_ROWS;
                        const __mmask16 valid = (__mmask16)((1u << rows) - 1);
                        gate = _mm512_add_ps(gate, _mm512_maskz_loadu_ps(valid, w->bias + o));
                        up = _mm512_add_ps(up, _mm512_maskz_loadu_ps(valid, w->bias + inter + o));
                    }
                    _mm512_storeu_ps(gs + 16 * j, gate);
                    _mm512_storeu_ps(us + 16 * j, up);
                }
                for (int e = 0; e < 16 * half; e += 8)
                    _mm256_storeu_ps(gs + e,
                                     silu_mul(_mm256_loadu_ps(gs + e), _mm256_loadu_ps(us + e)));
                memcpy(act + (g * AMX_ROWS + i) * inter + i0, gs, sizeof(float) * (size_t)count);
            }
        }
    }
    _tile_release();
    team_barrier();
}

/* act [R, I] = silu(gate) * up, the gate/up rows (gate rows, then up rows of W [2 I, E]) shared
 * out 8 outputs at a time, each times all R input rows (every thread; ends with a barrier).
 * silu(g) = g / (1 + e^-g): exp_ps on 8 outputs, expf on a shorter last chunk. */
static void swiglu_for(const ds_matrix *w, const ds_input *in, int64_t R, int64_t inter,
                       float *act) {
    if (in->by_amx) {
        swiglu_amx_for(w, in, R, inter, act);
        return;
    }
    if (in->by_lanes) {
        swiglu_lanes_for(w, in, R, inter, act);
        return;
    }
    if (in->by_panels) {
        swiglu_panels_for(w, in, R, inter, act);
        return;
    }
    const int th = tile_rows(w, in);
    OMP_FOR(SWIGLU_SCHEDULE)
    for (int64_t c = 0; c < (inter + 7) / 8; c++) {
        const int64_t i0 = 8 * c;
        const int count = inter - i0 < 8 ? (int)(inter - i0) : 8;
        for (int64_t m0 = 0; m0 < R; m0 += th) {
            const int tm = R - m0 < th ? (int)(R - m0) : th;
            float gate[AVX512_TILE_M][8], up[AVX512_TILE_M][8];
            for (int r = 0; r < count; r += 2) {
                const int pair = count - r < 2 ? 1 : 2;
                matrix_rows(w, in, i0 + r, pair, m0, tm, gate[0] + r, 8);
                matrix_rows(w, in, inter + i0 + r, pair, m0, tm, up[0] + r, 8);
            }
            for (int i = 0; i < tm; i++) {
                float *out = act + (m0 + i) * inter + i0;
                if (count == 8) {
                    const __m256 g = _mm256_loadu_ps(gate[i]);
                    const __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), g));
                    const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
                    _mm256_storeu_ps(out, _mm256_mul_ps(silu, _mm256_loadu_ps(up[i])));
                } else {
                    for (int r = 0; r < count; r++)
                        out[r] = gate[i][r] / (1.0f + expf(-gate[i][r])) * up[i][r];
                }
            }
        }
    }
    team_barrier();
}
