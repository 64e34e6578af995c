/* The span loop of one pass over keys [t0, t1) of a block table's KV head h, for one
 * instruction set: paged_decode.c includes this file once per set, after defining
 *
 *   PD_ATTEND         the name of the pass's function
 *   PD_SPAN_LOOP      the name of its loop (inlined into it for each constant d)
 *   PD_ISA            both functions' target attribute, or nothing (the build flags' set)
 *   PD_SCORES         s[q] = scale * (qv[q] . k[j]) for a chunk's 8 keys, q < NQ (<= 3)
 *   PD_VALUES         o[q] = o[q] * rescale[q] + sum_j p[q, j] V[j] over a span, q < NQ
 *   PD_VALUES_TILE    the most query vectors PD_VALUES takes at once (2 or 4)
 *
 * and undefines them at its end. Per span: the keys' rows, the scores of every query vector
 * (three at a time), one online-softmax update per vector, then the output update
 * (PD_VALUES_TILE vectors at a time, the rest in one smaller tile); each tile first sends its
 * share of the prefetches (pd_prefetch_paced). Each query vector's
 * numbers are the same whichever tile it is in. d is a constant where the caller knows it,
 * so that the tiles are registers. */
static inline __attribute__((always_inline)) PD_ISA void PD_SPAN_LOOP(
    const PdArgs *a, const float *qg, int64_t group, const int64_t *limits, const int64_t *table,
    int64_t h, int64_t t0, int64_t t1, PdRunning *run, float *acc, const int64_t d) {
    const __m256 scale = _mm256_set1_ps(a->scale);
    PdAhead ahead = pd_ahead_from(a, table, h, t0, t1);
    PdRows rows = pd_rows_from(a, table, h, t0, t1);
    for (int64_t t = t0; t < t1; t += PD_SPAN) {
        const int64_t n = t1 - t < PD_SPAN ? t1 - t : PD_SPAN;
        const float *k[PD_SPAN], *v[PD_SPAN];
        pd_next_span(&rows, n, k, v);
        int64_t nv[MAX_NG];
        pd_chunk_keys(limits, group, t, n, nv);
        /* parts of the span's work: a score tile per 3 query vectors and chunk of keys, an
         * output tile per PD_VALUES_TILE query vectors */
        const int64_t units = (n + PD_CHUNK - 1) / PD_CHUNK * ((group + 2) / 3) +
                              (group + PD_VALUES_TILE - 1) / PD_VALUES_TILE;
        const int64_t quota = t == t0 ? 2 * PD_SPAN : PD_SPAN;
        int64_t unit = 0, sent = 0;
        __m256 s[MAX_NG][PD_SPAN / 8];
        for (int c = 0; c < PD_SPAN / 8; c++) {
            if (8 * c >= n) { /* past the pass's keys: weights 0 whatever the scores */
                for (int64_t g = 0; g < group; g++) s[g][c] = _mm256_setzero_ps();
                continue;
            }
            __m256 sc[MAX_NG];
            int64_t g = 0;
            for (; g + 3 <= group; g += 3) {
                pd_prefetch_paced(&ahead, &sent, unit++, units, quota, d);
                PD_SCORES(qg + g * d, 3, k + 8 * c, d, scale, sc + g);
            }
            if (g < group) pd_prefetch_paced(&ahead, &sent, unit++, units, quota, d);
            if (group - g == 2) PD_SCORES(qg + g * d, 2, k + 8 * c, d, scale, sc + g);
            else if (group - g == 1) PD_SCORES(qg + g * d, 1, k + 8 * c, d, scale, sc + g);
            for (g = 0; g < group; g++) s[g][c] = sc[g];
        }
        float p[MAX_NG][PD_SPAN], rescale[MAX_NG];
        pd_online_softmax_span(s, group, nv, run, p, rescale);
        int64_t g = 0;
        for (; g + PD_VALUES_TILE <= group; g += PD_VALUES_TILE) {
            pd_prefetch_paced(&ahead, &sent, unit++, units, quota, d);
            PD_VALUES(acc + g * d, PD_VALUES_TILE, p + g, rescale + g, v, d);
        }
        if (g < group) pd_prefetch_paced(&ahead, &sent, unit++, units, quota, d);
        /* the rest (< PD_VALUES_TILE vectors) in one call; a constant-false test drops the
         * tiles this set's PD_VALUES does not take */
        if (PD_VALUES_TILE > 3 && group - g == 3) PD_VALUES(acc + g * d, 3, p + g, rescale + g, v, d);
        else if (PD_VALUES_TILE > 2 && group - g == 2)
            PD_VALUES(acc + g * d, 2, p + g, rescale + g, v, d);
        else if (group - g == 1) PD_VALUES(acc + g * d, 1, p + g, rescale + g, v, d);
    }
}

/* Keys [t0, t1) of table's KV head h for the ng query vectors qg [ng, D] (ng <= MAX_NG), into
 * run [ng] and acc [ng, D]. */
PD_ISA static void PD_ATTEND(const PdArgs *a, const float *qg, int64_t ng, const int64_t *limits,
                             const int64_t *table, int64_t h, int64_t t0, int64_t t1,
                             PdRunning *run, float *acc) {
    if (a->head_dim == 64)
        PD_SPAN_LOOP(a, qg, ng, limits, table, h, t0, t1, run, acc, 64);
    else if (a->head_dim == 128)
        PD_SPAN_LOOP(a, qg, ng, limits, table, h, t0, t1, run, acc, 128);
    else
        PD_SPAN_LOOP(a, qg, ng, limits, table, h, t0, t1, run, acc, a->head_dim);
}

#undef PD_ATTEND
#undef PD_SPAN_LOOP
#undef PD_ISA
#undef PD_SCORES
#undef PD_VALUES
#undef PD_VALUES_TILE
