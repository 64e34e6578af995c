/* One window of keys for many query vectors on Intel AMX, float32-accurate: the (m, l, acc)
 * state that paged_decode.c's pd_attend_* leaves for keys [t0, t1) of a block table's KV head
 * h (at most WA_MAX_KEYS of them), each query vector up to its own limit, computed with tile
 * products. Included by decode_step.c after gemm_amx.c (AMX_TARGET, amx_configure, amx_widen)
 * and paged_decode.c (PdArgs, PdRows, pd_exp512_reduced); gemm_lanes.c gives transpose16.
 *
 * The window is done in two passes rather than as an online softmax: all its scores first,
 *   s = scale q K^T [ng, n],   m = max s,   p = e^(s - m),   l = sum p,   acc = p V,
 * the max and sum over the keys each query vector attends to (p = 0 past them). The max is then
 * exact for the window, and the output needs no rescaling.
 *
 * Why the tile products stay float32-accurate: q, k, p and v are each split into three
 * bfloat16 parts, x = h + m + l (gemm_amx.c's split: 8 + 8 + 8 bits of significand, each part
 * rounded to nearest, so |m| <= 2^-8 |x| and |l| <= 2^-16 |x|), and a product sums six part
 * products, the smaller ones first:
 *   x . y = h_x l_y + m_x m_y + h_x m_y + l_x h_y + m_x h_y + h_x h_y
 * (the three left out, m_x l_y, l_x m_y and l_x l_y, are together at most ~2^-23 |x| |y|:
 * float32's rounding). A tile product multiplies bfloat16 pairs exactly and adds in float32.
 * So a score or output element differs from the float32 one by float32 rounding (another
 * order of the sums), not by bfloat16's.
 *
 * The keys and values of a window are packed once (wa_pack) for every pass over them: a
 * prompt's chunks share its windows (decode_step.c packs a window to its last chunk's end;
 * an earlier chunk's passes leave the keys past its own end out with weight 0, exactly).
 *
 * A query vector's numbers depend on its own query and the keys only: a tile row is one query
 * vector, and the hardware's sums for a row do not depend on the other rows. So they are the
 * same whichever vectors share its pass (a prompt's rows, however chunked; a decode group).
 *
 * Layout (bfloat16 unless said; NG = ng rounded up to 16, NK = n rounded up to 32):
 *   qb [3][NG][D]            the query parts; an A tile is 16 vectors x 32 elements (row
 *                            stride 2 D bytes)
 *   kb [3][NK/16][D/32][16][16][2]  K^T in AMX's pair layout: per 16 keys and 32 elements a 1 KB
 *                            B tile whose row i holds elements 2i, 2i + 1 of each key
 *   vb [3][NK/32][D/16][16][16][2]  V per 32 keys and 16 elements: row i holds keys 2i, 2i + 1
 *                            of each element
 *   pb [3][NG][NK]           the weights' parts; an A tile is 16 vectors x 32 keys
 *   s  [NG][NK] float32      the scores (unscaled dot products)
 * Keys past n are zero in kb and vb (a zero value times a zero weight adds nothing), and rows
 * past ng are zero in qb and pb. */

#define WA_MAX_KEYS 128 /* keys of a window: ATTEND_WINDOW */
#define WA_MAX_NG 64    /* query vectors of a pass: MAX_NG */

/* A window's packed keys and values (kb, vb below, for WA_MAX_KEYS keys) in 16-bit words. */
static inline int64_t wa_pack_words(int64_t D) { return 2 * 3 * WA_MAX_KEYS * D; }

/* Scratch of one pass over a packed window (qb, pb, s), in floats, for head_dim D. */
static inline int64_t wa_scratch_floats(int64_t D) {
    const int64_t words = 3 * WA_MAX_NG * D + 3 * WA_MAX_NG * WA_MAX_KEYS;
    return (words + 1) / 2 + 16 + WA_MAX_NG * WA_MAX_KEYS;
}

/* Whether a window of head_dim D takes this kernel. */
static inline int wa_takes(int64_t D) { return D % 32 == 0 && D <= PD_MAX_D; }

/* The three bfloat16 parts of 32 floats (a: the first 16, b: the next), as 32 words each in
 * order. */
AMX_TARGET static inline void wa_split32(__m512 a, __m512 b, __m512i part[3]) {
    for (int p = 0; p < 3; p++) {
        const __m512bh x = _mm512_cvtne2ps_pbh(b, a); /* words 0-15 from a, 16-31 from b */
        part[p] = (__m512i)x;
        a = _mm512_sub_ps(a, amx_widen((__m256bh)_mm512_castsi512_si256(part[p])));
        b = _mm512_sub_ps(b, amx_widen((__m256bh)_mm512_extracti64x4_epi64(part[p], 1)));
    }
}

/* The mask of the first `count` of 16 lanes (none for count <= 0, all for count >= 16). */
static inline __mmask16 wa_first(int64_t count) {
    return count <= 0 ? 0 : count >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << count) - 1);
}

/* e^x for x <= 0 by pd_exp512's reduction and polynomial, scaled by 2^n with scalef (below
 * 2^-126 it underflows gradually, and the tile products read such a weight's parts as 0). The
 * lanes past a vector's keys may hold any finite x, even an overflow to inf: they are masked
 * to 0 after. */
AMX_TARGET static inline __m512 wa_exp_nonpositive(__m512 x) {
    __m512 n;
    const __m512 y = pd_exp512_reduced(x, &n);
    return _mm512_scalef_ps(y, n);
}

/* Loads A tiles 2, 3, 4 (parts l, m, h) from a, its parts `plane` words apart, rows `stride`
 * bytes apart. */
#define WA_A_PARTS(a, plane, stride)                                                               \
    do {                                                                                           \
        _tile_loadd(2, (a) + 2 * (plane), stride);                                                 \
        _tile_loadd(3, (a) + (plane), stride);                                                     \
        _tile_loadd(4, (a), stride);                                                               \
    } while (0)

/* C tile c += the products of the A parts (tiles 2, 3, 4: l, m, h) with part `part` (0: h, 1:
 * m, 2: l) of the B tile at b (parts `plane` words apart), loaded into tile `slot`. Over the
 * parts l, m, h in turn a C tile sums the six part products smallest first:
 *   h_x l_y, then m_x m_y, h_x m_y, then l_x h_y, m_x h_y, h_x h_y. */
#define WA_B_PART(c, slot, b, plane, part)                                                         \
    do {                                                                                           \
        _tile_loadd(slot, (b) + (part) * (plane), 64);                                             \
        if ((part) == 2) {                                                                         \
            _tile_dpbf16ps(c, 4, slot);                                                            \
        } else if ((part) == 1) {                                                                  \
            _tile_dpbf16ps(c, 3, slot);                                                            \
            _tile_dpbf16ps(c, 4, slot);                                                            \
        } else {                                                                                   \
            _tile_dpbf16ps(c, 2, slot);                                                            \
            _tile_dpbf16ps(c, 3, slot);                                                            \
            _tile_dpbf16ps(c, 4, slot);                                                            \
        }                                                                                          \
    } while (0)

/* out [16 rows][16 cols floats] (rows out_stride bytes apart) = the sum over steps i < steps of
 * the A parts at a + 32 i (parts a_plane words apart, rows a_stride bytes apart) times the B
 * tiles at b + i b_step + j b_gap for column tiles j < cols (1 to 3), their parts b_plane words
 * apart: C tiles 0, 1 and 6. The A parts are loaded once for all the columns; the B tiles
 * alternate between tiles 5 and 7, so that a load does not wait for the products reading the
 * tile before it (docs/design/cpu-kernels.md: a prompt's windows on AMX). */
AMX_TARGET static inline __attribute__((always_inline)) void wa_tile_columns(
    const uint16_t *a, int64_t a_plane, int64_t a_stride, const uint16_t *b, int64_t b_step,
    int64_t b_gap, int64_t b_plane, int64_t steps, const int cols, float *out,
    int64_t out_stride) {
    _tile_zero(0);
    if (cols > 1) _tile_zero(1);
    if (cols > 2) _tile_zero(6);
    for (int64_t i = 0; i < steps; i++) {
        const uint16_t *b0 = b + i * b_step, *b1 = b0 + b_gap, *b2 = b1 + b_gap;
        WA_A_PARTS(a + 32 * i, a_plane, a_stride);
        if (cols == 3) {
            WA_B_PART(0, 5, b0, b_plane, 2);
            WA_B_PART(1, 7, b1, b_plane, 2);
            WA_B_PART(6, 5, b2, b_plane, 2);
            WA_B_PART(0, 7, b0, b_plane, 1);
            WA_B_PART(1, 5, b1, b_plane, 1);
            WA_B_PART(6, 7, b2, b_plane, 1);
            WA_B_PART(0, 5, b0, b_plane, 0);
            WA_B_PART(1, 7, b1, b_plane, 0);
            WA_B_PART(6, 5, b2, b_plane, 0);
        } else if (cols == 2) {
            for (int part = 2; part >= 0; part--) {
                WA_B_PART(0, 5, b0, b_plane, part);
                WA_B_PART(1, 7, b1, b_plane, part);
            }
        } else {
            WA_B_PART(0, 5, b0, b_plane, 2);
            WA_B_PART(0, 7, b0, b_plane, 1);
            WA_B_PART(0, 5, b0, b_plane, 0);
        }
    }
    _tile_stored(0, out, out_stride);
    if (cols > 1) _tile_stored(1, out + 16, out_stride);
    if (cols > 2) _tile_stored(6, out + 32, out_stride);
}

/* wa_tile_columns over column tiles [0, tiles), three at a time. */
AMX_TARGET static inline void wa_tile_row(const uint16_t *a, int64_t a_plane, int64_t a_stride,
                                          const uint16_t *b, int64_t b_step, int64_t b_gap,
                                          int64_t b_plane, int64_t steps, int64_t tiles,
                                          float *out, int64_t out_stride) {
    int64_t t = 0;
    for (; t + 3 <= tiles; t += 3)
        wa_tile_columns(a, a_plane, a_stride, b + t * b_gap, b_step, b_gap, b_plane, steps, 3,
                        out + 16 * t, out_stride);
    if (tiles - t == 2)
        wa_tile_columns(a, a_plane, a_stride, b + t * b_gap, b_step, b_gap, b_plane, steps, 2,
                        out + 16 * t, out_stride);
    else if (tiles - t == 1)
        wa_tile_columns(a, a_plane, a_stride, b + t * b_gap, b_step, b_gap, b_plane, steps, 1,
                        out + 16 * t, out_stride);
}

/* The packed keys and values of keys [t0, t1) (t1 - t0 <= WA_MAX_KEYS) of table's KV head h:
 * kb, then vb, in pack (wa_pack_words(D) words; NK = t1 - t0 rounded up to 32 keys used). */
AMX_TARGET static void wa_pack(const PdArgs *a, const int64_t *table, int64_t h, int64_t t0,
                               int64_t t1, uint16_t *pack) {
    const int64_t D = a->head_dim, n = t1 - t0, NK = (n + 31) / 32 * 32;
    const int64_t KS = D / 32, DT = D / 16, KT = NK / 16, VT = NK / 32, k_plane = NK * D;
    uint16_t *kb = pack, *vb = pack + 3 * k_plane;
    /* the window's key and value rows (NULL past n) */
    const float *k[WA_MAX_KEYS], *v[WA_MAX_KEYS];
    PdRows rows = pd_rows_from(a, table, h, t0, t1);
    for (int64_t j = 0; j < NK; j += PD_CHUNK) {
        if (j < n) {
            pd_next_rows(&rows, n - j < PD_CHUNK ? n - j : PD_CHUNK, k + j, v + j);
            for (int64_t i = n - j; i < PD_CHUNK; i++) k[j + i] = v[j + i] = NULL;
        } else {
            for (int i = 0; i < PD_CHUNK; i++) k[j + i] = v[j + i] = NULL;
        }
    }
    /* K^T: per 16 keys and 32 elements, each part's 16 x 16 word pairs transposed */
    for (int64_t kt = 0; kt < KT; kt++)
        for (int64_t ks = 0; ks < KS; ks++) {
            __m512 part_rows[3][16];
            for (int j = 0; j < 16; j++) {
                const float *key = k[kt * 16 + j];
                __m512i part[3];
                wa_split32(key ? _mm512_loadu_ps(key + ks * 32) : _mm512_setzero_ps(),
                           key ? _mm512_loadu_ps(key + ks * 32 + 16) : _mm512_setzero_ps(), part);
                for (int p = 0; p < 3; p++) part_rows[p][j] = _mm512_castsi512_ps(part[p]);
            }
            for (int p = 0; p < 3; p++) {
                transpose16(part_rows[p]);
                uint16_t *tile = kb + p * k_plane + (kt * KS + ks) * 512;
                for (int i = 0; i < 16; i++) _mm512_storeu_ps(tile + i * 32, part_rows[p][i]);
            }
        }
    /* V: per 32 keys and 16 elements, row i the pairs (key 2i, key 2i + 1) of each element */
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                           24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                           16, 0);
    for (int64_t vt = 0; vt < VT; vt++)
        for (int64_t dt = 0; dt < DT; dt++)
            for (int i = 0; i < 16; i++) {
                const float *v0 = v[vt * 32 + 2 * i], *v1 = v[vt * 32 + 2 * i + 1];
                __m512i part[3];
                wa_split32(v0 ? _mm512_loadu_ps(v0 + dt * 16) : _mm512_setzero_ps(),
                           v1 ? _mm512_loadu_ps(v1 + dt * 16) : _mm512_setzero_ps(), part);
                for (int p = 0; p < 3; p++)
                    _mm512_storeu_si512(vb + p * k_plane + (vt * DT + dt) * 512 + i * 32,
                                        _mm512_permutexvar_epi16(pairs, part[p]));
            }
}

/* The first n keys (n <= WA_MAX_KEYS) of a window packed by wa_pack for pack_keys >= n keys,
 * for the ng (<= WA_MAX_NG) query vectors qg [ng, D] (D % 32 == 0), each up to its count of
 * keys (counts [ng]: clamped to 0 .. n), into run [ng] and acc [ng rounded up to 16 rows, D]
 * (rows past ng get zeros). A vector with no keys gets m = -inf, l = 0, acc = 0. Keys of the
 * pack past n are left out exactly (weight 0), so a vector's numbers do not depend on how many
 * keys the pack holds. scratch: wa_scratch_floats(D) floats, 64-byte aligned. */
AMX_TARGET static void wa_attend_packed(const uint16_t *pack, int64_t pack_keys, int64_t n,
                                        int64_t D, float scale_factor, const float *qg,
                                        int64_t ng, const int64_t *counts, PdRunning *run,
                                        float *acc, float *scratch) {
    const int64_t NG = (ng + 15) / 16 * 16, NK = (n + 31) / 32 * 32;
    const int64_t KS = D / 32, DT = D / 16, KT = NK / 16, VT = NK / 32;
    const int64_t k_plane = (pack_keys + 31) / 32 * 32 * D;
    const uint16_t *kb = pack, *vb = pack + 3 * k_plane;
    const int64_t q_plane = NG * D, p_plane = NG * NK;
    uint16_t *qb = (uint16_t *)scratch, *pb = qb + 3 * q_plane;
    float *s = (float *)(((uintptr_t)(pb + 3 * p_plane) + 63) & ~(uintptr_t)63);

    /* the query parts */
    for (int64_t g = 0; g < NG; g++)
        for (int64_t e = 0; e < D; e += 32) {
            __m512i part[3];
            const __m512 lo = g < ng ? _mm512_loadu_ps(qg + g * D + e) : _mm512_setzero_ps();
            const __m512 hi = g < ng ? _mm512_loadu_ps(qg + g * D + e + 16) : _mm512_setzero_ps();
            wa_split32(lo, hi, part);
            for (int p = 0; p < 3; p++) _mm512_storeu_si512(qb + p * q_plane + g * D + e, part[p]);
        }

    /* s = q K^T, three key tiles at a time (wa_tile_row) */
    amx_configure();
    AMX_MEMORY_BARRIER(); /* the parts are written */
    for (int64_t r = 0; r < NG / 16; r++) /* over the elements, 32 at a time */
        wa_tile_row(qb + r * 16 * D, q_plane, 2 * D, kb, 512, KS * 512, k_plane, KS, KT,
                    s + r * 16 * NK, 4 * NK);
    AMX_MEMORY_BARRIER(); /* the scores are stored */

    /* per query vector: its max, weights and their sum; the weights' parts. A vector's (up to
     * 8) vectors of scores are taken at once, 0 past its keys, so that their exponentials
     * overlap rather than wait on each other 32 keys at a time; weights past its keys are 0,
     * and adding them changes no sum. */
    const __m512 scale = _mm512_set1_ps(scale_factor);
    for (int64_t g = 0; g < NG; g++) {
        int64_t count = g < ng ? counts[g] : 0;
        count = count < 0 ? 0 : count > n ? n : count;
        if (count == 0) { /* no keys (a row past ng, a prompt row before the window) */
            for (int64_t j = 0; j < NK; j += 32)
                for (int p = 0; p < 3; p++)
                    _mm512_storeu_si512(pb + p * p_plane + g * NK + j, _mm512_setzero_si512());
            if (g < ng) run[g] = (PdRunning){-INFINITY, 0.0f};
            continue;
        }
        const float *sg = s + g * NK;
        __m512 w[WA_MAX_KEYS / 16];
        __mmask16 keep[WA_MAX_KEYS / 16];
        /* the max of the unscaled scores, then scaled (scale > 0: the same as the max of the
         * scaled ones) */
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int c = 0; c < WA_MAX_KEYS / 16; c++) {
            keep[c] = wa_first(count - 16 * c);
            w[c] = _mm512_maskz_loadu_ps(keep[c], sg + 16 * c);
            mx = _mm512_mask_max_ps(mx, keep[c], mx, w[c]);
        }
        const float m = _mm512_reduce_max_ps(mx) * scale_factor;
        const __m512 mv = _mm512_set1_ps(m);
        __m512 total = _mm512_setzero_ps();
        for (int c = 0; c < WA_MAX_KEYS / 16; c++) {
            const __m512 x = _mm512_sub_ps(_mm512_mul_ps(w[c], scale), mv);
            w[c] = _mm512_maskz_mov_ps(keep[c], wa_exp_nonpositive(x));
            total = _mm512_add_ps(total, w[c]);
        }
        for (int64_t j = 0; j < NK / 32; j++) {
            __m512i part[3];
            wa_split32(w[2 * j], w[2 * j + 1], part);
            for (int p = 0; p < 3; p++)
                _mm512_storeu_si512(pb + p * p_plane + g * NK + 32 * j, part[p]);
        }
        if (g < ng) run[g] = (PdRunning){m, _mm512_reduce_add_ps(total)};
    }

    /* acc = p V, three tiles of 16 elements at a time (wa_tile_row) */
    AMX_MEMORY_BARRIER(); /* the weights are written */
    for (int64_t r = 0; r < NG / 16; r++) /* over the keys, 32 at a time */
        wa_tile_row(pb + r * 16 * NK, p_plane, 2 * NK, vb, DT * 512, 512, k_plane, VT, DT,
                    acc + r * 16 * D, 4 * D);
    AMX_MEMORY_BARRIER(); /* acc is stored */
}

/* Floats of scratch baton_window_amx_pass needs for head_dim D. */
int64_t baton_window_amx_scratch_floats(int64_t head_dim) {
    return wa_scratch_floats(head_dim) + (wa_pack_words(head_dim) + 1) / 2 + 16;
}

/* One window by this kernel (tests, benchmarks): keys [t0, t1) packed, then the first n
 * (<= t1 - t0) of them attended, as baton_paged_decode_pass attends keys [t0, t0 + n), for at
 * most WA_MAX_NG query vectors and WA_MAX_KEYS keys; acc has room for ng rounded up to 16
 * rows; scratch holds baton_window_amx_scratch_floats(head_dim) floats. Returns 0, -1 for
 * shapes it does not take, -3 on a CPU without AMX. */
int baton_window_amx_pass(const float *qg, int64_t ng, const int64_t *limits, const float *cache,
                          int64_t stride_kv, int64_t stride_head, int64_t stride_block,
                          int64_t stride_token, const int64_t *table, int64_t h, int64_t t0,
                          int64_t t1, int64_t n, int64_t head_dim, int64_t block_size, float scale,
                          float *m, float *l, float *acc, float *scratch) {
    if (ng <= 0 || ng > WA_MAX_NG || !wa_takes(head_dim) || block_size <= 0 || t0 < 0 ||
        t1 < t0 || t1 - t0 > WA_MAX_KEYS || n < 0 || n > t1 - t0)
        return -1;
    if (!baton_cpu_has_amx()) return -3;
    const PdArgs a = {.cache = cache,
                      .stride_kv = stride_kv,
                      .stride_head = stride_head,
                      .stride_block = stride_block,
                      .stride_token = stride_token,
                      .head_dim = head_dim,
                      .block_size = block_size,
                      .scale = scale};
    float *aligned = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    uint16_t *pack = (uint16_t *)(aligned + wa_scratch_floats(head_dim));
    int64_t counts[WA_MAX_NG];
    for (int64_t g = 0; g < ng; g++) counts[g] = limits == NULL ? n : limits[g] - t0;
    PdRunning run[WA_MAX_NG];
    wa_pack(&a, table, h, t0, t1, pack);
    wa_attend_packed(pack, t1 - t0, n, head_dim, scale, qg, ng, counts, run, acc, aligned);
    for (int64_t g = 0; g < ng; g++) m[g] = run[g].m, l[g] = run[g].l;
    return 0;
}
