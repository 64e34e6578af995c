/* y [M, N] = x [M, K] W^T for many rows of x on Intel AMX (tiles of bfloat16 products), W in
 * GGUF Q4_1 or Q8_0 blocks, with float32 accuracy. Included by gguf_gemm.c after gemm_lanes.c
 * (it uses transpose16, quants16_q4_1 / quants16_q8_0 and team_barrier).
 *
 * Why the products stay float32-accurate in bfloat16 tiles:
 *   - a block's quants are small integers (Q4_1: 0 .. 15, Q8_0: -128 .. 127), exact in bfloat16;
 *   - each float32 x is split into three bfloat16 parts, x = h + m + l exactly (h = x rounded to
 *     bfloat16, m = the rest rounded, l = what is left: 8 + 8 + 8 bits of significand);
 *   - a tile product multiplies bfloat16 pairs exactly and adds in float32.
 * So per block of 32 the tile computes c = sum_k x_k q_k with float32 additions only (l, then
 * m, then h parts, each TDPBF16PS adding its pair products into c in the hardware's order), and
 * per output element the sum over blocks is, block by block in order,
 *   s = d_b c_b + s,   then for Q4_1   s = m_b xsum_b + s   (fused multiply-adds, from s = 0),
 * then + bias. The same whichever tile, thread or other rows compute it: a row's result does
 * not depend on the other rows of the product. The numbers differ from the lanes' chain
 * (gemm_lanes.c) by float32 rounding only. Inputs below float32's normal range (|x| < 2^-126)
 * are read as zero by the bfloat16 conversions.
 *
 * Layout: x is split once per product input into xb [3][G * 16][K] bfloat16 (G = ceil(M / 16),
 * rows past M zero) and xsum [G * 16][K / 32] (each block's sum of x). For 16 weight rows at a
 * time a thread packs their quants into B tiles, [K / 32][16 pairs of k][16 rows][2] bfloat16
 * (AMX's pair-interleaved layout: one 1 KB tile per block), and d, m per block; a pass takes
 * up to AMX_PACKS packs and, for every group of 16 input rows and every block, loads the three
 * A tiles once, multiplies each pack's B tile into its own C tile, stores the C tiles and
 * scales them into the pack's sums [16 input rows][16 weight rows]. */

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_ROWS 16 /* rows of a tile: input rows of a group, weight rows of a pack */
#define AMX_TARGET                                                                                 \
    __attribute__((target("amx-tile,amx-bf16,avx512bf16,avx512f,avx512bw,avx512vl,avx512dq,"     \
                          "avx2,fma,f16c")))
/* The tile intrinsics are asm statements that name no memory: a compiler barrier keeps plain
 * stores before a tile load of them, and loads of a stored tile after the store. */
#define AMX_MEMORY_BARRIER() __asm__ volatile("" ::: "memory")
#define AMX_ARCH_REQ_XCOMP_PERM 0x1023 /* arch_prctl: ask for a state component */
#define AMX_XFEATURE_XTILEDATA 18

#define AMX_PACKS 4 /* packs of 16 weight rows per pass: C tiles 0, 5, 6, 7 */
/* Per-thread scratch of the AMX products in floats for a largest K of max_k: AMX_PACKS packs of
 * 16 weight rows (B tiles + d, m per block: 9 floats per element of K each), their stored C
 * tiles and their sums (256 floats a pack each). */
static inline int64_t amx_scratch_floats(int64_t max_k) {
    return AMX_PACKS * (9 * max_k + 2 * 256);
}

static inline int64_t amx_groups(int64_t M) { return (M + AMX_ROWS - 1) / AMX_ROWS; }

/* 1 where this CPU has AMX tiles with bfloat16 products and AVX-512 BF16, the OS keeps tile
 * state (XCR0 bits 17, 18) and granted this process the tile data (arch_prctl), else 0. */
int baton_cpu_has_amx(void) {
    static int has = -1;
    if (has >= 0) return has;
    unsigned a, b, c, d;
    int ok = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 24)) && (d & (1u << 22));
    ok = ok && __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5)); /* AVX512_BF16 */
    ok = ok && __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 27));        /* OSXSAVE */
    if (ok) {
        unsigned lo, hi;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        ok = (lo & (3u << 17)) == (3u << 17);
    }
    ok = ok && baton_cpu_has_avx512();
    ok = ok && syscall(SYS_arch_prctl, AMX_ARCH_REQ_XCOMP_PERM, AMX_XFEATURE_XTILEDATA) == 0;
    has = ok;
    return has;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) amx_tile_config;

/* Tiles 0, 5, 6, 7 (C), 1 (B), 2-4 (the A parts) of 64 bytes a row: B of 16 rows, A and C of
 * `rows` (1 .. 16: the input rows of a group). A product's rows are independent, so a group of
 * fewer input rows gives them the same numbers in smaller tiles. Per thread; loading a
 * configuration zeroes the tiles. */
AMX_TARGET static void amx_configure_rows(int rows) {
    amx_tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.rows[t] = t == 1 ? AMX_ROWS : rows;
        config.colsb[t] = 64;
    }
    AMX_MEMORY_BARRIER(); /* the configuration is written */
    _tile_loadconfig(&config);
}

/* Every tile of 16 rows. */
AMX_TARGET static void amx_configure(void) { amx_configure_rows(AMX_ROWS); }

/* float32 -> bfloat16 bits in float32 lanes (the bfloat16 value as float32). */
AMX_TARGET static inline __m512 amx_widen(__m256bh v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)v), 16));
}

/* Row i of x [K] into the three parts (part p at xb + p * plane) and its block sums. */
AMX_TARGET static void amx_split_row(const float *x, int64_t K, uint16_t *xb, int64_t plane,
                                     float *xsum) {
    for (int64_t k0 = 0; k0 < K; k0 += 16) {
        const __m512 v = _mm512_loadu_ps(x + k0);
        const __m256bh h = _mm512_cvtneps_pbh(v);
        const __m512 r1 = _mm512_sub_ps(v, amx_widen(h));
        const __m256bh m = _mm512_cvtneps_pbh(r1);
        const __m256bh l = _mm512_cvtneps_pbh(_mm512_sub_ps(r1, amx_widen(m)));
        _mm256_storeu_si256((__m256i *)(xb + k0), (__m256i)h);
        _mm256_storeu_si256((__m256i *)(xb + plane + k0), (__m256i)m);
        _mm256_storeu_si256((__m256i *)(xb + 2 * plane + k0), (__m256i)l);
    }
    for (int64_t b = 0; b < K / QK; b++)
        xsum[b] = _mm512_reduce_add_ps(
            _mm512_add_ps(_mm512_loadu_ps(x + b * QK), _mm512_loadu_ps(x + b * QK + 16)));
}

/* xb, xsum from x [M, K] (rows up to amx_groups(M) * 16, past M zero): every thread of the
 * team; ends with a barrier. */
AMX_TARGET static void amx_split_for(const float *x, int64_t M, int64_t K, uint16_t *xb,
                                     float *xsum) {
    const int64_t rows = amx_groups(M) * AMX_ROWS, plane = rows * K, nb = K / QK;
#pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < rows; i++) {
        if (i < M) {
            amx_split_row(x + i * K, K, xb + i * K, plane, xsum + i * nb);
        } else {
            for (int p = 0; p < 3; p++) memset(xb + p * plane + i * K, 0, sizeof(uint16_t) * K);
            memset(xsum + i * nb, 0, sizeof(float) * nb);
        }
    }
    team_barrier();
}

/* The word permutes and the quant table of amx_pack_q4_1_block. */
typedef struct {
    __m512i to_halves[2], to_pairs[4], lut;
} amx_q4_1_words;

AMX_TARGET static amx_q4_1_words amx_q4_1_words_make(void) {
    /* the first permutes: half[h][c], word 8 w' + r: word 4 c + w' of row 8 h + r
     * (w' < 4, r < 8) */
    uint16_t idx1[2][32], idx2[4][32], table[32];
    for (int c = 0; c < 2; c++)
        for (int w = 0; w < 4; w++)
            for (int r = 0; r < 8; r++) /* row r: z[r / 4] (second table from r = 4), lane r % 4 */
                idx1[c][8 * w + r] = (uint16_t)(32 * (r / 4) + 8 * (r % 4) + 4 * c + w);
    /* the second permutes: pairs[k], word 16 s + j: word 2 k + s of row j (s < 2, j < 16) */
    for (int k = 0; k < 4; k++)
        for (int s = 0; s < 2; s++)
            for (int j = 0; j < 16; j++) /* rows 8 .. 15 from the second table */
                idx2[k][16 * s + j] = (uint16_t)(32 * (j / 8) + 8 * ((2 * k + s) % 4) + j % 8);
    for (int n = 0; n < 32; n++) { /* bfloat16 bits of the quant value n (n < 16 used) */
        const float v = (float)n;
        uint32_t u;
        memcpy(&u, &v, 4);
        table[n] = (uint16_t)(u >> 16);
    }
    amx_q4_1_words t;
    for (int c = 0; c < 2; c++) t.to_halves[c] = _mm512_loadu_si512(idx1[c]);
    for (int k = 0; k < 4; k++) t.to_pairs[k] = _mm512_loadu_si512(idx2[k]);
    t.lut = _mm512_loadu_si512(table);
    return t;
}

/* One Q4_1 block of 16 weight rows (blk[j]: row j's block, NULL: a zero row) as its B tile
 * (bt [512] bfloat16, AMX's pair-interleaved layout: tile row p holds pair p of every weight
 * row) and d, m [16] each. Row j's quant bytes qs[i] hold quants i (low nibble) and i + 16
 * (high nibble), so pair p < 8 is the low nibbles of its 16-bit word p and pair p + 8 the high
 * nibbles: a transpose of 16 rows x 8 words (two rounds of word permutes) puts word p of
 * every row side by side, and each nibble becomes its bfloat16 value by a table lookup. The
 * tile holds the same bits as amx_pack_weights' general path (quants converted to float32,
 * then bfloat16 pairs transposed as float32 lanes), which spends ~2.5x the instructions: a
 * 64-token prompt step's products ran ~1.27x faster this way (docs/design/cpu-kernels.md). */
AMX_TARGET static inline void amx_pack_q4_1_block(const amx_q4_1_words *t,
                                                  const uint8_t *const blk[16], uint16_t *bt,
                                                  float *d, float *m) {
    uint32_t dm_bits[16]; /* d, m as float16 bits (low, high half) */
    __m128i qs[16];
    for (int j = 0; j < 16; j++) {
        if (blk[j] == NULL) {
            qs[j] = _mm_setzero_si128();
            dm_bits[j] = 0;
        } else {
            qs[j] = _mm_loadu_si128((const __m128i *)(blk[j] + 4));
            memcpy(&dm_bits[j], blk[j], 4);
        }
    }
    const __m512i bits = _mm512_loadu_si512(dm_bits);
    _mm512_storeu_ps(d, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(bits)));
    _mm512_storeu_ps(m, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16))));
    __m512i z[4]; /* z[i], 128-bit lane L: the 8 words of row 4 i + L */
    for (int i = 0; i < 4; i++)
        z[i] = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_set_m128i(qs[4 * i + 1], qs[4 * i])),
            _mm256_set_m128i(qs[4 * i + 3], qs[4 * i + 2]), 1);
    __m512i half[2][2];
    for (int h = 0; h < 2; h++)
        for (int c = 0; c < 2; c++)
            half[h][c] = _mm512_permutex2var_epi16(z[2 * h], t->to_halves[c], z[2 * h + 1]);
    const __m512i low = _mm512_set1_epi16(15);
    for (int k = 0; k < 4; k++) {
        const __m512i pairs = _mm512_permutex2var_epi16(half[0][k / 2], t->to_pairs[k],
                                                        half[1][k / 2]);
        for (int s = 0; s < 2; s++) {
            const int p = 2 * k + s;
            /* bytes (qs[2 p], qs[2 p + 1]) of row j widened to the words 2 j, 2 j + 1 */
            const __m512i wide = _mm512_cvtepu8_epi16(
                s == 0 ? _mm512_castsi512_si256(pairs) : _mm512_extracti64x4_epi64(pairs, 1));
            _mm512_storeu_si512(bt + p * 32,
                                _mm512_permutexvar_epi16(_mm512_and_si512(wide, low), t->lut));
            _mm512_storeu_si512(bt + (p + 8) * 32,
                                _mm512_permutexvar_epi16(_mm512_srli_epi16(wide, 4), t->lut));
        }
    }
}

/* Weight rows n0 .. n0 + count - 1 (count <= 16; the rest zero) packed: bt [K / 32][512]
 * bfloat16 (one B tile per block), dm [K / 32][32] (d of the 16 rows, then their m). */
AMX_TARGET static void amx_pack_weights(const uint8_t *w, int32_t type, int64_t K, int64_t n0,
                                        int count, uint16_t *bt, float *dm) {
    const int64_t nb = K / QK, bb = type == 3 ? 20 : 34, row_bytes = nb * bb;
    if (type == 3) {
        const amx_q4_1_words t = amx_q4_1_words_make();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk[16];
            for (int j = 0; j < 16; j++)
                blk[j] = j < count ? w + (n0 + j) * row_bytes + b * bb : NULL;
            amx_pack_q4_1_block(&t, blk, bt + b * 512, dm + b * 32, dm + b * 32 + 16);
        }
        return;
    }
    for (int64_t b = 0; b < nb; b++) {
        __m512 r[16]; /* r[j]: the 32 quants of weight row j as 16 pairs of bfloat16 */
        float *d = dm + b * 32, *m = d + 16;
        for (int j = 0; j < 16; j++) {
            if (j >= count) {
                r[j] = _mm512_setzero_ps();
                d[j] = m[j] = 0.0f;
                continue;
            }
            const uint8_t *blk = w + (n0 + j) * row_bytes + b * bb;
            __m512 q_lo, q_hi; /* quants 0-15, 16-31 */
            if (type == 3) quants16_q4_1(blk + 4, &q_lo, &q_hi);
            else quants16_q8_0(blk + 2, &q_lo, &q_hi);
            r[j] = _mm512_castsi512_ps((__m512i)_mm512_cvtne2ps_pbh(q_hi, q_lo));
            d[j] = f16_to_f32(blk);
            m[j] = type == 3 ? f16_to_f32(blk + 2) : 0.0f;
        }
        transpose16(r); /* r[p]: pair p (quants 2p, 2p + 1) of the 16 rows */
        for (int p = 0; p < 16; p++) _mm512_storeu_ps((float *)(bt + b * 512 + p * 32), r[p]);
    }
}

/* A thread's scratch (amx_scratch_floats(K) floats) cut into its parts: per pack its B tiles
 * (8 K floats) and d, m (K floats), then the packs' stored C tiles and their sums. */
typedef struct {
    uint16_t *bt[AMX_PACKS];
    float *dm[AMX_PACKS];
    float *c, *sums;
} amx_scratch_parts;

static inline amx_scratch_parts amx_scratch_at(float *scratch, int64_t K) {
    amx_scratch_parts parts;
    for (int j = 0; j < AMX_PACKS; j++) {
        parts.bt[j] = (uint16_t *)(scratch + 9 * K * j);
        parts.dm[j] = scratch + 9 * K * j + 8 * K;
    }
    parts.c = scratch + 9 * K * AMX_PACKS;
    parts.sums = parts.c + 256 * AMX_PACKS;
    return parts;
}

/* Pack j's block b: C tile ct = the resident l, m, h part tiles (2, 3, 4) times its B tile
 * (loaded into tile 1), stored at c. (A macro: tile numbers are immediates.) */
#define AMX_PACK_BLOCK(ct, bt, b, c)                                                               \
    do {                                                                                           \
        _tile_zero(ct);                                                                            \
        _tile_loadd(1, (bt) + (b) * 512, 64);                                                      \
        _tile_dpbf16ps(ct, 2, 1);                                                                  \
        _tile_dpbf16ps(ct, 3, 1);                                                                  \
        _tile_dpbf16ps(ct, 4, 1);                                                                  \
        _tile_stored(ct, c, 64);                                                                   \
    } while (0)

/* sums [packs][16 input rows][16 weight rows] = input rows 16 g .. 16 g + 15 of M times each
 * of `packs` (<= AMX_PACKS) packed sets of 16 weight rows (bt[j], dm[j]), over all K (no
 * bias); rows of the last group past M are left out (fewer tile rows, their sums not
 * computed). Per block the three part tiles are loaded once for all packs (a tile load costs
 * about three tile products here), each pack's C tile stored to c [packs][256] and scaled into
 * the sums. Expects every tile of 16 rows configured, and leaves them so. */
AMX_TARGET static void amx_group(const uint16_t *xb, int64_t plane, const float *xsum, int64_t K,
                                 int64_t g, int64_t M, int32_t type, int packs,
                                 uint16_t *const bt[], float *const dm[], float *c, float *sums) {
    const int64_t nb = K / QK, stride = 2 * K; /* bytes between rows of x's parts */
    const uint16_t *a = xb + g * AMX_ROWS * K;
    const float *s = xsum + g * AMX_ROWS * nb;
    const int rows = M - g * AMX_ROWS < AMX_ROWS ? (int)(M - g * AMX_ROWS) : AMX_ROWS;
    if (rows < AMX_ROWS) amx_configure_rows(rows);
    memset(sums, 0, sizeof(float) * 256 * (size_t)packs);
    for (int64_t b = 0; b < nb; b++) {
        AMX_MEMORY_BARRIER(); /* the packs, parts and sums are written */
        _tile_loadd(2, a + 2 * plane + b * QK, stride); /* l */
        _tile_loadd(3, a + plane + b * QK, stride);     /* m */
        _tile_loadd(4, a + b * QK, stride);             /* h */
        AMX_PACK_BLOCK(0, bt[0], b, c);
        if (packs > 1) AMX_PACK_BLOCK(5, bt[1], b, c + 256);
        if (packs > 2) AMX_PACK_BLOCK(6, bt[2], b, c + 512);
        if (packs > 3) AMX_PACK_BLOCK(7, bt[3], b, c + 768);
        AMX_MEMORY_BARRIER();
        for (int j = 0; j < packs; j++) {
            const __m512 d = _mm512_loadu_ps(dm[j] + b * 32), m = _mm512_loadu_ps(dm[j] + b * 32 + 16);
            float *sj = sums + 256 * j;
            const float *cj = c + 256 * j;
            for (int i = 0; i < rows; i++) {
                __m512 v = _mm512_fmadd_ps(d, _mm512_load_ps(cj + 16 * i), _mm512_load_ps(sj + 16 * i));
                if (type == 3) v = _mm512_fmadd_ps(m, _mm512_set1_ps(s[i * nb + b]), v);
                _mm512_store_ps(sj + 16 * i, v);
            }
        }
    }
    if (rows < AMX_ROWS) amx_configure();
}

/* Packs per pass over the input groups for `total` packs shared among `threads`: the most (up
 * to AMX_PACKS) whose passes spread evenly, fewest packs on the busiest thread first. */
static inline int amx_packs_per_pass(int64_t total, int threads) {
    int best = 1;
    int64_t best_load = total;
    for (int p = AMX_PACKS; p >= 1; p--) {
        const int64_t passes = (total + p - 1) / p, load = (passes + threads - 1) / threads * p;
        if (load < best_load) {
            best = p;
            best_load = load;
        }
    }
    return best;
}

/* y [M, N] (+ bias) = x W^T from xb, xsum (amx_split_for); passes of up to AMX_PACKS packs of
 * 16 weight rows shared out among the threads. scratch: amx_scratch_floats(K) floats of this
 * thread's own (64-byte aligned). Every thread (ends with team_barrier). */
AMX_TARGET static void amx_product_for(const uint16_t *xb, const float *xsum, int64_t M,
                                       int64_t K, const uint8_t *w, int64_t N, int32_t type,
                                       const float *bias, float *scratch, float *y) {
    const int64_t packs = (N + AMX_ROWS - 1) / AMX_ROWS, plane = amx_groups(M) * AMX_ROWS * K;
    const int per = amx_packs_per_pass(packs, omp_get_num_threads());
    const int64_t passes = (packs + per - 1) / per;
    amx_scratch_parts parts = amx_scratch_at(scratch, K);
    uint16_t **bt = parts.bt;
    float **dm = parts.dm, *c = parts.c, *sums = parts.sums;
    amx_configure();
#pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < passes; t++) {
        const int64_t first = t * per;
        const int count = packs - first < per ? (int)(packs - first) : per;
        for (int j = 0; j < count; j++) {
            const int64_t n0 = (first + j) * AMX_ROWS;
            amx_pack_weights(w, type, K, n0, N - n0 < AMX_ROWS ? (int)(N - n0) : AMX_ROWS, bt[j],
                             dm[j]);
        }
        for (int64_t g = 0; g < amx_groups(M); g++) {
            amx_group(xb, plane, xsum, K, g, M, type, count, bt, dm, c, sums);
            for (int j = 0; j < count; j++) {
                const int64_t n0 = (first + j) * AMX_ROWS;
                const int rows = N - n0 < AMX_ROWS ? (int)(N - n0) : AMX_ROWS;
                const __mmask16 valid = (__mmask16)((1u << rows) - 1);
                const __m512 add = bias == NULL ? _mm512_setzero_ps()
                                                : _mm512_maskz_loadu_ps(valid, bias + n0);
                for (int i = 0; i < 16 && g * AMX_ROWS + i < M; i++) {
                    __m512 v = _mm512_load_ps(sums + 256 * j + 16 * i);
                    if (bias != NULL) v = _mm512_add_ps(v, add);
                    _mm512_mask_storeu_ps(y + (g * AMX_ROWS + i) * N + n0, valid, v);
                }
            }
        }
    }
    _tile_release();
    team_barrier();
}

/* y[M, N] = x[M, K] W^T on AMX: the entry point for tests and benchmarks. Returns 0, -1 for an
 * unknown block type or K not a multiple of 32, -2 where this CPU (or OS) lacks AMX, -3 when
 * scratch memory failed. */
int baton_gguf_gemm_amx(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                        int32_t type, float *y) {
    if ((type != 3 && type != 8) || K % QK != 0 || K <= 0 || M < 1) return -1;
    if (!baton_cpu_has_amx()) return -2;
    const int threads = omp_get_max_threads();
    const int64_t rows = amx_groups(M) * AMX_ROWS, own = amx_scratch_floats(K);
    const int64_t xb_floats = (3 * rows * K / 2 + 15) / 16 * 16, xsum_floats = rows * (K / QK);
    const size_t floats = (size_t)(xb_floats + (xsum_floats + 15) / 16 * 16 + threads * own);
    float *scratch = aligned_alloc(64, sizeof(float) * floats);
    if (scratch == NULL) return -3;
    uint16_t *xb = (uint16_t *)scratch;
    float *xsum = scratch + xb_floats;
#pragma omp parallel num_threads(threads)
    {
        float *mine = xsum + (xsum_floats + 15) / 16 * 16 + omp_get_thread_num() * own;
        amx_split_for(x, M, K, xb, xsum);
        amx_product_for(xb, xsum, M, K, w, N, type, NULL, mine, y);
    }
    free(scratch);
    return 0;
}
