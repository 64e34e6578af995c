/* One decode step of a Llama-family decoder in one C call: the whole layer stack (and
 * optionally the output projection) for R decode rows, each one token of its own sequence
 * (its own context length and block table), CPU float32, weights read straight from their
 * GGUF blocks (Q4_1 / Q8_0), every weight once per step whatever R.
 *
 * Why: per token the unfused path runs ~15 torch ops and ~6 ctypes calls per layer; at batch 1
 * on SmolLM2 that dispatch was ~2.5 ms of a ~12.9 ms step. Here one OpenMP parallel region
 * spans the whole step: the matrix products (all R rows at once, decode_matrix.c) and the
 * attention (RoPE and the cache write per row and KV head; windows of keys, each read once for
 * the query heads of its KV head, and for every row of a shared prompt head; the windows'
 * merge per head) are shared out with `omp for` (one barrier each, seven per layer whatever
 * R: team_barrier.h's, which waits without sleeping); the small vector ops (RMSNorm, residual
 * adds, block sums and int8 blocks of the activations) are computed by every thread on its own
 * private copy of the R rows, so they need no barrier.
 *
 * The arithmetic is the unfused path's, operation for operation, so greedy tokens stay those of
 * transformers; and each row's is the same whatever R (a row's numbers never depend on which
 * rows share its step):
 *   - RMSNorm: baton_rms_norm (rms_norm.c), called as is;
 *   - matrix rows: see decode_matrix.c (gguf_gemm.c's one-row arithmetic per output element:
 *     AVX-512 for Q4_1 (and Q8_0 with AMX) where the caller asks for it, AVX2 otherwise; with
 *     more than one row the unfused path takes AVX2 up to 8 rows and dense float32 above,
 *     another summation order);
 *   - RoPE: x' = x c - y s, y' = x s + y c on rotation pairs, products rounded before the add
 *     (torch's complex multiply, checked bit for bit by the tests);
 *   - attention: paged_decode.c's one-pass online softmax per window of ATTEND_WINDOW keys,
 *     the windows merged in key order (see ATTEND_WINDOW below); with AMX, in steps of
 *     AMX_MIN_ROWS rows or more, a prompt's windows (rows of one sequence, two or more, in the
 *     step) are attended on tiles instead, window_amx.c, each window's keys packed once for
 *     all of the prompt's chunks (float32-accurate too, another order of the sums: so a prompt
 *     row's numbers are those of a step of the same kind, however the prompt is chunked);
 *   - SwiGLU: silu(g) * u with silu(g) = g / (1 + e^-g); the one place the values may differ
 *     from torch's in the last bit (its vectorized exp is another polynomial).
 * With int8_isa set (the opt-in int8_activations), every product's input rows are quantized
 * per 32 values (baton_quantize_row_q8) and rows are summed with gguf_gemm.c's integer-dot
 * tiles, as baton_gguf_gemm_q8 computes a row (the AVX-512 VNNI choice takes the 256-bit
 * VNNI tile here, so only its summation order differs from the unfused path's), for any R:
 * the unfused path quantizes up to 8 rows and multiplies dense float32 above.
 *
 * KV cache per layer: head-major [2, KVH, num_blocks, block_size, D] (engine/attention/
 * kv_layout.py), addressed by element strides like paged_decode.c. A row's key and value
 * go to slot table[p / block_size] * block_size + p % block_size of its position p.
 * Build: see engine/native.py (which hashes this file and the files it includes).
 */
#include <omp.h>
#include <stdlib.h>

#include "gguf_gemm.c"
#include "../attention/paged_decode.c"
#include "../attention/window_amx.c"
#include "rms_norm.c"
#include "decode_matrix.c"

#define SCRATCH_ALIGN 16 /* floats: one 64-byte cache line */

/* n floats rounded up to whole cache lines. */
static inline int64_t lines(int64_t n) { return (n + SCRATCH_ALIGN - 1) / SCRATCH_ALIGN * SCRATCH_ALIGN; }

typedef struct {
    ds_matrix qkv;     /* [(H + 2 KVH) D, E], q and k rows in rotation-pair order */
    ds_matrix o;       /* [E, H D] */
    ds_matrix gate_up; /* [2 I, E]: gate rows, then up rows */
    ds_matrix down;    /* [E, I] */
    const float *input_norm, *post_norm; /* [E] */
    float *kv_cache; /* head-major [2, KVH, num_blocks, block_size, D] */
} ds_layer;

typedef struct {
    int64_t num_layers, hidden, intermediate, num_heads, num_kv_heads, head_dim;
    int64_t block_size, stride_kv, stride_head, stride_block, stride_token; /* in elements */
    int64_t max_positions, vocab;
    float eps, scale;
    int32_t avx512; /* 1: Q4_1 rows with the AVX-512 kernel (gguf_kernel.gemv_isa's choice);
                     * 2: that, Q8_0 rows too (gguf_kernel.q8_0_rows_avx512), and the
                     * products of many rows on AMX (gemm_amx.c) */
    const ds_layer *layers;  /* [num_layers] */
    const float *final_norm; /* [E] */
    const float *embed;      /* [vocab, E] */
    const float *rope;       /* [max_positions, D / 2, 2]: (cos, sin) of each rotation pair */
    ds_matrix head;          /* output projection; blocks NULL: logits are not computed here */
    int32_t int8_isa;        /* 0: float32 activations; else BATON_I8_* (int8_activations) */
    int64_t max_state_bytes; /* a step whose attention states would take more is refused (-3) */
} ds_model;

/* Parts of the step, timed by thread 0 when the caller passes a timings array. */
enum {
    T_NORM,      /* RMSNorms, residual adds, block sums (every thread, private copies) */
    T_QKV,       /* qkv product */
    T_ATTENTION, /* RoPE, the KV cache write and the attention over the paged cache */
    T_O,         /* output projection of attention */
    T_GATE_UP,   /* gate/up product and SwiGLU */
    T_DOWN,      /* down product */
    T_HEAD,      /* logits */
    T_PARTS
};

/* RoPE of `heads` rows of D from src into dst: pairs (x, y) -> (x c - y s, y c + x s), each
 * product rounded before the add, as torch's complex multiply. Written with intrinsics: GCC 12
 * turns the plain C of a complex multiply into vfmaddsub (fused, despite -ffp-contract=off). */
static void rope_rows(const float *src, int64_t heads, int64_t D, const float *rot, float *dst) {
    for (int64_t i = 0; i < D; i += 8) {
        const __m256 cs = _mm256_loadu_ps(rot + i);     /* c0 s0 c1 s1 ... */
        const __m256 c = _mm256_moveldup_ps(cs);        /* c0 c0 c1 c1 ... */
        const __m256 s = _mm256_movehdup_ps(cs);        /* s0 s0 s1 s1 ... */
        for (int64_t h = 0; h < heads; h++) {
            const __m256 v = _mm256_loadu_ps(src + h * D + i);         /* x0 y0 x1 y1 ... */
            const __m256 swapped = _mm256_permute_ps(v, 0xB1);        /* y0 x0 y1 x1 ... */
            /* even lanes x c - y s, odd lanes y c + x s */
            _mm256_storeu_ps(dst + h * D + i,
                             _mm256_addsub_ps(_mm256_mul_ps(v, c), _mm256_mul_ps(swapped, s)));
        }
    }
}

/* Attention by fixed windows of keys. A row's keys [0, len) are cut at multiples of
 * ATTEND_WINDOW; each window's (m, l, acc) state of each query head comes from paged_decode.c's
 * one-pass online softmax over that window alone, and a head's output merges its windows'
 * states in key order (the log-sum-exp merge). Windows shared by a group of rows run once for
 * the group, its rows' query vectors side by side, so those keys and values are read once for
 * all of them; every other window runs for its row alone. Two kinds of group:
 *   - decode rows of sequences whose tables start with the same blocks (prefix-cache hits on
 *     one prompt head: pd_find_groups) share the windows wholly inside those blocks;
 *   - a prompt's chunk (consecutive rows of one sequence), up to MAX_NG / G rows at a time,
 *     share every window, each row attending up to its own position (the kernel's limits).
 *     Off AMX one thread runs a chunk's windows from 0 in order and merges each into the
 *     chunk's running states as it ends (the merge the heads would do, in the same order),
 *     so a long prompt's rows keep one state per head instead of one per window (less
 *     memory to write and read back); many windows are cut into runs, so that
 *     the threads still share a step's work evenly (plan_attention).
 * A window's numbers for a row are the same whichever way it runs (no lane mixes query
 * vectors; a row's keys end in a window as they would alone) and the cut points do not depend
 * on the other rows: a row's output is the same whatever rows share its step. */
#define ATTEND_WINDOW 128
/* Window tasks go to threads WINDOW_GRAB at a time (dynamic: a thread held up by other load
 * leaves the rest to the others), so that a thread knows the next window it attends and
 * prefetches its first keys at the end of the one before. */
#ifndef WINDOW_GRAB
#define WINDOW_GRAB 2
#endif
#define WINDOWS_SCHEDULE schedule(dynamic, WINDOW_GRAB)
/* Tasks a thread of a prompt chunk's windows, at least (plan_attention's runs of windows). */
#define CHUNK_TASKS 16
_Static_assert(ATTEND_WINDOW == WA_MAX_KEYS && MAX_NG == WA_MAX_NG, "window_amx.c's bounds");

/* One window: keys [w ATTEND_WINDOW, k1) of KV head h for members[row0 .. row0 + nrows),
 * each member up to its own sequence length. */
typedef struct {
    int64_t h, w, k1, row0, nrows;
} ds_window;

/* Windows run together by one thread: on AMX, a prompt's window w of KV head h for each of its
 * chunks (chunk: the window's keys are packed once for all of them); off AMX, a run of a
 * prompt chunk's consecutive windows (fold when it starts at window 0: see below); or any
 * window alone. */
typedef struct {
    int64_t first, count; /* windows[first .. first + count) */
    int chunk;            /* 1: a prompt's chunks, in order (the last one reaches furthest) */
    int fold;             /* 1: one chunk's windows 0, 1, ... merged as they run */
} ds_window_task;

/* The windows of a step: which rows share which, and every window each row needs.
 * States: each row's (m, l, acc) per query head and slot, [state0[b] .. + H slots(b)) in
 * units of 2 + D floats, head-major. A row's first `folded[b]` windows (a prompt chunk's
 * windows from 0 that one task runs in order) are merged as they run, the first slot holding
 * their merge; every later window has a slot of its own. The head's merge of its slots in key
 * order then computes, operation for operation, the merge of its windows in key order (the
 * first slot merged into the empty state is that state exactly). */
typedef struct {
    int64_t *members; /* [2 R]: the groups' rows, then each decode row by itself */
    ds_window *windows;
    ds_window_task *tasks;
    int64_t num_windows; /* windows to run */
    int64_t num_tasks;
    int64_t *folded, *state0, *slots; /* [R] each */
    int64_t num_slots;                /* sum over rows of H slots(b) */
} ds_attention_plan;

static void free_plan(ds_attention_plan *p) {
    free(p->members);
    free(p->windows);
    free(p->tasks);
    free(p->folded);
}

/* Row b's state of query head `head` for window w (plan's slots). */
static inline float *state_of(const ds_attention_plan *p, float *states, int64_t b, int64_t head,
                              int64_t w, int64_t state_floats) {
    const int64_t slot = w < p->folded[b] ? 0 : w - p->folded[b] + 1;
    return states + (p->state0[b] + head * p->slots[b] + slot) * state_floats;
}

/* 0, or -2 when scratch memory failed. chunk_tasks: a prompt's window is one task for all its
 * chunks (AMX packs its keys once for them); else each chunk's windows are runs of its own, the
 * first folded, so that a short prompt's few windows still spread evenly over the threads (a
 * 256-token prompt has 2 windows per KV head: as 6 tasks of all chunks, two threads would get
 * 4 and 2 of them; as 39 of one chunk each, the largest first, about half each). threads: the
 * step's team. */
static int plan_attention(ds_attention_plan *p, const int64_t *tables, int64_t width,
                          const int64_t *seq_lens, int64_t R, int64_t G, int64_t KVH,
                          int64_t block_size, int chunk_tasks, int threads) {
    const int64_t W = ATTEND_WINDOW, per_group = MAX_NG / G;
    p->folded = malloc(sizeof(int64_t) * (size_t)(3 * R));
    /* scratch [R] each: run_end, idx, sub_lens, sub_shared, row0, rows, same, sorted, gshared,
     * chunk_row0, chunk_rows, chunk_end; sub_members [2 R]; sub_tables [R, width] */
    int64_t *run_end = malloc(sizeof(int64_t) * (size_t)(14 * R + R * width));
    p->members = malloc(sizeof(int64_t) * (size_t)(2 * R));
    p->windows = NULL;
    p->tasks = NULL;
    if (!run_end || !p->members || !p->folded) {
        free(run_end);
        return -2;
    }
    int64_t *idx = run_end + R, *sub_lens = idx + R, *sub_shared = sub_lens + R;
    int64_t *row0 = sub_shared + R, *rows = row0 + R, *same = rows + R, *sorted = same + R;
    int64_t *gshared = sorted + R, *chunk_row0 = gshared + R, *chunk_rows = chunk_row0 + R;
    int64_t *chunk_end = chunk_rows + R, *sub_members = chunk_end + R;
    int64_t *sub_tables = sub_members + 2 * R;
    /* runs of rows with the same table: one sequence's tokens (rows_disjoint checked them) */
    for (int64_t r = R - 1; r >= 0; r--)
        run_end[r] = r + 1 < R && memcmp(tables + r * width, tables + (r + 1) * width,
                                         sizeof(int64_t) * (size_t)width) == 0
                         ? run_end[r + 1]
                         : r + 1;
    /* decode rows (runs of one row), grouped by the prompt blocks their tables share */
    int64_t nd = 0;
    for (int64_t r = 0; r < R; r = run_end[r]) {
        if (run_end[r] != r + 1) continue;
        memcpy(sub_tables + nd * width, tables + r * width, sizeof(int64_t) * (size_t)width);
        sub_lens[nd] = seq_lens[r];
        idx[nd++] = r;
    }
    PdArgs a = {0};
    a.block_tables = sub_tables, a.seq_lens = sub_lens, a.max_blocks = width;
    a.group = G, a.block_size = block_size;
    const int64_t num_groups =
        pd_find_groups(&a, nd, sub_members, sub_shared, row0, rows, same, sorted);
    int64_t total = 0; /* every row's windows */
    for (int64_t r = 0; r < R; r++) total += (seq_lens[r] + W - 1) / W;
    p->windows = malloc(sizeof(ds_window) * (size_t)(KVH * total > 0 ? KVH * total : 1));
    p->tasks = malloc(sizeof(ds_window_task) * (size_t)(KVH * total > 0 ? KVH * total : 1));
    if (!p->windows || !p->tasks) {
        free(run_end);
        return -2;
    }
    /* members: the decode groups' rows, the chunks' rows (per_group at a time), then each
     * decode row by itself (from single0 on, in sub-row order) */
    int64_t m = 0, num_chunks = 0;
    for (int64_t g = 0; g < num_groups; g++) {
        gshared[g] = sub_shared[sub_members[row0[g]]];
        const int64_t first = m;
        for (int64_t i = row0[g]; i < row0[g] + rows[g]; i++) p->members[m++] = idx[sub_members[i]];
        row0[g] = first;
    }
    int64_t num_prompts = 0; /* the prompts' chunks: prompt_chunk0[i] .. prompt_chunk0[i + 1] */
    int64_t *prompt_chunk0 = sorted; /* (sorted is free again) */
    for (int64_t r = 0; r < R; r = run_end[r]) {
        if (run_end[r] == r + 1) continue;
        prompt_chunk0[num_prompts++] = num_chunks;
        for (int64_t c = r; c < run_end[r]; c += per_group) {
            const int64_t n = run_end[r] - c < per_group ? run_end[r] - c : per_group;
            chunk_row0[num_chunks] = m;
            chunk_rows[num_chunks] = n;
            chunk_end[num_chunks++] = seq_lens[c + n - 1]; /* its last (longest) row's */
            for (int64_t i = c; i < c + n; i++) p->members[m++] = i;
        }
    }
    const int64_t single0 = m;
    for (int64_t i = 0; i < nd; i++) p->members[m++] = idx[i];
    prompt_chunk0[num_prompts] = num_chunks;
    /* Off AMX a chunk's windows run in runs of `segment`, the first folded (state_of): about
     * CHUNK_TASKS tasks a thread at least, so that threads share them out evenly, and most
     * prompts' windows all folded in one run (a chunk's rows then keep one state per head). */
    int64_t chunk_windows = 0;
    for (int64_t c = 0; c < num_chunks; c++) chunk_windows += (chunk_end[c] + W - 1) / W;
    const int64_t per_thread = CHUNK_TASKS * (threads > 0 ? threads : 1);
    const int64_t per_run = (KVH * chunk_windows + per_thread - 1) / per_thread;
    const int64_t segment = chunk_tasks || per_run < 1 ? 1 : per_run;
    for (int64_t r = 0; r < R; r++) p->folded[r] = 1;
    for (int64_t c = 0; c < num_chunks && segment > 1; c++)
        for (int64_t i = chunk_row0[c]; i < chunk_row0[c] + chunk_rows[c]; i++) {
            const int64_t b = p->members[i], n = (seq_lens[b] + W - 1) / W;
            p->folded[b] = n < segment ? n : segment;
        }
    p->state0 = p->folded + R;
    p->slots = p->state0 + R;
    p->num_slots = 0;
    for (int64_t r = 0; r < R; r++) {
        p->slots[r] = (seq_lens[r] + W - 1) / W - p->folded[r] + 1;
        p->state0[r] = p->num_slots;
        p->num_slots += (KVH * G) * p->slots[r];
    }
    p->num_windows = p->num_tasks = 0;
#define ALONE(window)                                                                              \
    do {                                                                                           \
        p->tasks[p->num_tasks++] = (ds_window_task){.first = p->num_windows, .count = 1};          \
        p->windows[p->num_windows++] = window;                                                     \
    } while (0)
    for (int64_t h = 0; h < KVH; h++) {
        for (int64_t g = 0; g < num_groups; g++) /* windows wholly inside the shared keys */
            for (int64_t w = 0; w < gshared[g] / W; w++)
                ALONE(((ds_window){h, w, (w + 1) * W, row0[g], rows[g]}));
        for (int64_t i = 0; i < num_prompts && chunk_tasks; i++) /* per window, all chunks */
            for (int64_t w = 0; w * W < chunk_end[prompt_chunk0[i + 1] - 1]; w++) {
                ds_window_task task = {p->num_windows, 0, 1, 0}; /* the chunks reaching w */
                for (int64_t c = prompt_chunk0[i]; c < prompt_chunk0[i + 1]; c++) {
                    if (w * W >= chunk_end[c]) continue;
                    p->windows[p->num_windows++] = (ds_window){
                        h, w, (w + 1) * W < chunk_end[c] ? (w + 1) * W : chunk_end[c],
                        chunk_row0[c], chunk_rows[c]};
                    task.count++;
                }
                p->tasks[p->num_tasks++] = task;
            }
        /* per chunk, runs of its windows: the last chunks (the most keys) first */
        for (int64_t c = num_chunks - 1; c >= 0 && !chunk_tasks; c--)
            for (int64_t w0 = 0; w0 * W < chunk_end[c]; w0 += segment) {
                ds_window_task task = {p->num_windows, 0, 0, w0 == 0};
                for (int64_t w = w0; w < w0 + segment && w * W < chunk_end[c]; w++) {
                    p->windows[p->num_windows++] = (ds_window){
                        h, w, (w + 1) * W < chunk_end[c] ? (w + 1) * W : chunk_end[c],
                        chunk_row0[c], chunk_rows[c]};
                    task.count++;
                }
                p->tasks[p->num_tasks++] = task;
            }
        for (int64_t i = 0; i < nd; i++) /* a decode row's other windows, alone */
            for (int64_t w = sub_shared[i] / W; w * W < sub_lens[i]; w++)
                ALONE(((ds_window){h, w, (w + 1) * W < sub_lens[i] ? (w + 1) * W : sub_lens[i],
                                   single0 + i, 1}));
    }
#undef ALONE
    free(run_end);
    return 0;
}

static int matrix_ok(const ds_matrix *w, int64_t n, int64_t k) {
    return w->blocks != NULL && w->n == n && w->k == k && k % QK == 0 &&
           block_bytes_of(w->type) != 0;
}

/* Shapes this step takes; 0 if fine, else -1. */
static int check_model(const ds_model *m) {
    const int64_t E = m->hidden, I = m->intermediate, H = m->num_heads, KVH = m->num_kv_heads,
                  D = m->head_dim;
    if (E <= 0 || E % 8 || D % 8 || KVH <= 0 || H % KVH || H / KVH > MAX_G || m->block_size <= 0)
        return -1;
    if (m->avx512 && !baton_cpu_has_avx512()) return -1;
    if (m->avx512 == 2 && !baton_cpu_has_amx()) return -1;
    if (m->int8_isa && (m->int8_isa < BATON_I8_AVX2 || m->int8_isa > BATON_I8_AVX512VNNI ||
                        !(baton_cpu_int8_isas() & (1 << m->int8_isa))))
        return -1;
    for (int64_t l = 0; l < m->num_layers; l++) {
        const ds_layer *L = &m->layers[l];
        if (!matrix_ok(&L->qkv, (H + 2 * KVH) * D, E) || !matrix_ok(&L->o, E, H * D) ||
            !matrix_ok(&L->gate_up, 2 * I, E) || !matrix_ok(&L->down, E, I))
            return -1;
    }
    if (m->head.blocks != NULL && !matrix_ok(&m->head, m->vocab, E)) return -1;
    return 0;
}

/* Whether the rows can share one step. Consecutive rows with the same block table (over the
 * whole width) are one sequence's tokens, their positions one after another (a prompt's chunk;
 * a decode row is a sequence of one). No sequence may write (into a block holding one of its
 * rows' positions) to a block another sequence reads or writes (up to its last row's
 * position). The scheduler guarantees it (a block being filled belongs to one sequence; only
 * full blocks are shared), and it is what makes a row's keys its own sequence's whatever rows
 * share the step. 1 if fine, 0 if not (or no scratch memory). O(S^2 * blocks), S sequences. */
static int rows_disjoint(const int64_t *tables, int64_t width, const int64_t *seq_lens, int64_t R,
                         int64_t bs) {
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(R + 1)); /* each sequence's first row */
    if (first == NULL) return 0;
    int64_t S = 0;
    int ok = 1;
    for (int64_t r = 0; r < R && ok; r++) {
        if (r > 0 && memcmp(tables + r * width, tables + (r - 1) * width,
                            sizeof(int64_t) * (size_t)width) == 0)
            ok = seq_lens[r] == seq_lens[r - 1] + 1;
        else
            first[S++] = r;
    }
    first[S] = R;
    for (int64_t a = 0; a < S && ok; a++) {
        const int64_t *ta = tables + first[a] * width;
        const int64_t lo = (seq_lens[first[a]] - 1) / bs, hi = (seq_lens[first[a + 1] - 1] - 1) / bs;
        for (int64_t b = 0; b < S && ok; b++) {
            if (b == a) continue;
            const int64_t *tb = tables + first[b] * width;
            const int64_t used = (seq_lens[first[b + 1] - 1] - 1) / bs; /* blocks 0 .. used */
            for (int64_t i = lo; i <= hi && ok; i++)
                for (int64_t j = 0; j <= used && ok; j++) ok = ta[i] != tb[j];
        }
    }
    free(first);
    return ok;
}

/* Rows up to which every product of a step has the one-row kernels' arithmetic (above it: the
 * panels'), for callers that compare steps. */
int baton_decode_exact_max_rows(void) { return EXACT_MAX_ROWS; }

/* Rows from which a step's float32 products on AVX-512 multiply by lanes (up to it: panels). */
int baton_decode_lanes_min_rows(void) { return LANES_MIN_ROWS; }
int baton_decode_amx_min_rows(void) { return AMX_MIN_ROWS; }

/* Runs the decoder stack for R rows, row r one token tokens[r] at position seq_lens[r] - 1 of
 * its sequence, whose keys live in the blocks of its block table (tables [R, width], at least
 * ceil(seq_lens[r] / block_size) entries used). Consecutive rows with the same table are one
 * sequence's consecutive tokens (a prompt's chunk: each row attends to the keys before it,
 * those written by this step's earlier rows included); any other rows are decodes of their own
 * sequences. Writes every row's keys and values into every layer's cache, the final-normed
 * hidden states into hidden [R, E] and, where the model has a head and logits is not NULL,
 * the logits of rows logit_rows (strictly increasing, num_logit_rows of them) into logits
 * [num_logit_rows, vocab]. only_logit_rows: the last layer past its attention (the output
 * and MLP products, the final norm) runs for the logit rows alone, since nothing reads the
 * other rows' results: hidden holds the logit rows' states, zeros elsewhere (a 256-token
 * prompt's step skips 255/256 of a layer's products but the qkv; 2.8% of SmolLM2's). A row's
 * results do not depend on the other rows of the step: they are what a step of as many rows
 * computes for it with the keys before it in the cache (up to EXACT_MAX_ROWS rows: what it
 * computes alone, R = 1).
 * timings: NULL, or [T_PARTS] seconds that thread 0 adds its time per part to.
 * Returns 0; -1 for a shape, token, position or row set it does not take (nothing written
 * then); -2 when scratch memory failed; -3 when its attention states would pass
 * m->max_state_bytes (nothing written). */
int baton_decode_rows(const ds_model *m, int64_t R, const int64_t *tokens, const int64_t *tables,
                      int64_t width, const int64_t *seq_lens, const int64_t *logit_rows,
                      int64_t num_logit_rows, int only_logit_rows, float *hidden, float *logits,
                      double *timings) {
    const int64_t E = m->hidden, I = m->intermediate, H = m->num_heads, KVH = m->num_kv_heads,
                  D = m->head_dim, G = m->num_heads / (m->num_kv_heads ? m->num_kv_heads : 1);
    if (check_model(m) != 0 || R < 1 || num_logit_rows < 0 || num_logit_rows > R) return -1;
    for (int64_t r = 0; r < R; r++) {
        const int64_t blocks = (seq_lens[r] + m->block_size - 1) / m->block_size;
        if (tokens[r] < 0 || tokens[r] >= m->vocab || seq_lens[r] < 1 ||
            seq_lens[r] > m->max_positions || blocks > width)
            return -1;
    }
    for (int64_t i = 0; i < num_logit_rows; i++)
        if (logit_rows[i] < i || logit_rows[i] >= R ||
            (i > 0 && logit_rows[i] <= logit_rows[i - 1]))
            return -1;
    if (R > 1 && !rows_disjoint(tables, width, seq_lens, R, m->block_size)) return -1;
    const int64_t q_size = H * D, kv_size = KVH * D, qkv_n = q_size + 2 * kv_size;
    const int64_t max_k = I > E ? (I > q_size ? I : q_size) : (E > q_size ? E : q_size);
    const int by_lanes = !m->int8_isa && m->avx512 && R >= LANES_MIN_ROWS;
    const int by_amx = !m->int8_isa && m->avx512 == 2 && R >= AMX_MIN_ROWS;
    /* with AMX, the prompts' windows too are attended by tiles (window_amx.c) */
    const int by_amx_windows = by_amx && wa_takes(D);
    ds_attention_plan plan;
    if (plan_attention(&plan, tables, width, seq_lens, R, G, KVH, m->block_size, by_amx_windows,
                       omp_get_max_threads()) != 0) {
        free_plan(&plan);
        return -2;
    }
    const int64_t num_states = plan.num_slots, state_floats = 2 + D;
    if ((double)num_states * (double)(sizeof(float) * state_floats) > (double)m->max_state_bytes) {
        free_plan(&plan); /* many decode rows over long contexts, or a chunk's many windows */
        return -3;
    }
    /* shared: qkv, attention output, a product's output, the SwiGLU activations (all [R, .]);
     * then per thread (private): residuals x and normed xn [R, E], roped q and k of one head,
     * block sums, int8 scales [R, max_k / 32] (three), a window's queries and states, int8
     * quants [R, max_k] bytes */
    /* Every part starts on a cache line (SCRATCH_ALIGN floats): the products' 32-byte loads of
     * x rows and panels then never straddle two lines, whatever address malloc returns. */
    /* a window's queries, outputs and running states; a fold's outputs and states */
    const int64_t window_size = lines(3 * MAX_NG * D + 4 * MAX_NG);
    /* few rows' products: the head, and with only_logit_rows a pruned last layer's */
    const int64_t lanes_own = lanes_scratch_floats(max_k, only_logit_rows ? max_k : E);
    const int64_t amx_own = amx_scratch_floats(max_k);
    /* AMX windows: per thread window_amx.c's scratch, then a window's packed keys */
    const int64_t amx_window_size =
        by_amx_windows ? lines(wa_scratch_floats(D) + wa_pack_words(D) / 2) : 0;
    const int64_t own_size =
        2 * lines(R * E) + lines(D) + 3 * lines(R * (max_k / QK)) + window_size +
        lines(R * max_k / 4) +
        lines(by_amx     ? (lanes_own > amx_own ? lanes_own : amx_own)
              : by_lanes ? lanes_own
                         : PANELS_FLOATS_PER_K * max_k) +
        amx_window_size;
    /* by lanes: the packed rows; by AMX: the rows' three bfloat16 parts, then their block sums */
    const int64_t amx_rows = amx_groups(R) * AMX_ROWS;
    const int64_t xt_size =
        by_amx     ? lines(3 * amx_rows * max_k / 2) + lines(amx_rows * (max_k / QK))
        : by_lanes ? lines(lanes_groups(R) * LANES * max_k)
                   : 0;
    const int threads = omp_get_max_threads();
    const int64_t shared_size = lines(R * qkv_n) + 2 * lines(R * q_size) + lines(R * E) +
                                lines(R * I) + lines(num_states * state_floats) + xt_size;
    float *shared = aligned_alloc(
        sizeof(float) * SCRATCH_ALIGN,
        sizeof(float) * (size_t)(shared_size + threads * own_size));
    if (shared == NULL) {
        free_plan(&plan);
        return -2;
    }
    float *qkv = shared, *attn = qkv + lines(R * qkv_n), *tmp = attn + lines(R * q_size),
          *act = tmp + lines(R * E);
    /* roped queries [R, H, D]; window states (plan's slots, 2 + D floats each) */
    float *roped = act + lines(R * I), *states = roped + lines(R * q_size),
          *xt = states + lines(num_states * state_floats);
    float *own_all = shared + shared_size;
    team_barrier_t barrier = {0, 0};
#pragma omp parallel num_threads(threads)
    {
        team_enter(&barrier);
        const int64_t nb = R * (max_k / QK);
        float *x = own_all + omp_get_thread_num() * own_size, *xn = x + lines(R * E),
              *k = xn + lines(R * E), *xsum = k + lines(D), *xd = xsum + lines(nb),
              *xs = xd + lines(nb), *window_q = xs + lines(nb);
        float *window_acc = window_q + MAX_NG * D;
        PdRunning *window_run = (PdRunning *)(window_acc + MAX_NG * D);
        float *fold_acc = (float *)(window_run + MAX_NG);
        PdRunning *fold_run = (PdRunning *)(fold_acc + MAX_NG * D);
        float *amx_window = x + own_size - amx_window_size; /* window_amx.c's scratch */
        uint16_t *amx_pack = (uint16_t *)(amx_window + (by_amx_windows ? wa_scratch_floats(D) : 0));
        int64_t window_limits[MAX_NG], window_counts[MAX_NG];
        int8_t *xq = (int8_t *)(window_q + window_size); /* R * max_k bytes */
        ds_input in = {.avx512 = m->avx512,
                       .int8_isa = m->int8_isa,
                       .by_panels = !m->int8_isa && R > EXACT_MAX_ROWS && !by_lanes && !by_amx,
                       .by_lanes = by_lanes,
                       .panels = window_q + window_size + lines(R * max_k / 4),
                       .xt = xt,
                       .by_amx = by_amx,
                       .xb = (uint16_t *)xt,
                       .xb_sum = xt + lines(3 * amx_rows * max_k / 2)};
        const int timed = timings != NULL && omp_get_thread_num() == 0;
        double t_prev = timed ? omp_get_wtime() : 0.0;
#define MARK(part)                                                                                 \
    do {                                                                                           \
        if (timed) {                                                                               \
            const double t_now = omp_get_wtime();                                                  \
            timings[part] += t_now - t_prev;                                                       \
            t_prev = t_now;                                                                        \
        }                                                                                          \
    } while (0)
        for (int64_t r = 0; r < R; r++)
            memcpy(x + r * E, m->embed + tokens[r] * E, sizeof(float) * (size_t)E);
        for (int64_t l = 0; l < m->num_layers; l++) {
            const ds_layer *L = &m->layers[l];
            baton_rms_norm(x, R, E, L->input_norm, m->eps, xn);
            prepare_input(&in, xn, R, E, xsum, xq, xd, xs);
            MARK(T_NORM);
            matrix_for(&L->qkv, &in, R, qkv);
            MARK(T_QKV);
            /* RoPE of every row's query heads and keys; its key and value to the cache */
            OMP_FOR(HEADS_SCHEDULE)
            for (int64_t task = 0; task < R * KVH; task++) {
                const int64_t r = task / KVH, h = task % KVH;
                const int64_t pos = seq_lens[r] - 1, *table = tables + r * width;
                const float *rot = m->rope + pos * D; /* (cos, sin) pairs of this position */
                const float *row = qkv + r * qkv_n, *v = row + q_size + kv_size + h * D;
                rope_rows(row + h * G * D, G, D, rot, roped + r * q_size + h * G * D);
                rope_rows(row + q_size + h * D, 1, D, rot, k);
                float *k_dst = L->kv_cache + h * m->stride_head +
                               table[pos / m->block_size] * m->stride_block +
                               (pos % m->block_size) * m->stride_token;
                memcpy(k_dst, k, sizeof(float) * (size_t)D);
                memcpy(k_dst + m->stride_kv, v, sizeof(float) * (size_t)D);
            }
            team_barrier();
            /* every window of keys (after the barrier: this step's keys are in the cache) */
            const PdArgs pa = {.cache = L->kv_cache,
                               .stride_kv = m->stride_kv,
                               .stride_head = m->stride_head,
                               .stride_block = m->stride_block,
                               .stride_token = m->stride_token,
                               .head_dim = D,
                               .block_size = m->block_size,
                               .scale = m->scale};
            const int alone = omp_get_num_threads() == 1;
            OMP_FOR(WINDOWS_SCHEDULE)
            for (int64_t t = 0; t < plan.num_tasks; t++) {
                const ds_window_task *task = &plan.tasks[t];
                /* the keys this thread attends next, where it knows them: the next task's in
                 * its grab of WINDOW_GRAB tasks, or every next task when it runs alone (a
                 * window on the vector kernel) */
                PdArgs after = pa; /* after the task's last window */
                if ((alone || (t + 1) % WINDOW_GRAB != 0) && t + 1 < plan.num_tasks &&
                    !(by_amx_windows && plan.tasks[t + 1].chunk)) {
                    const ds_window *next = &plan.windows[plan.tasks[t + 1].first];
                    after.next_table = tables + plan.members[next->row0] * width;
                    after.next_h = next->h;
                    after.next_t0 = next->w * ATTEND_WINDOW;
                    after.next_t1 = next->k1;
                }
                PdArgs pw = after;
                /* a prompt's window on AMX: its keys packed once for all its chunks, to the
                 * furthest (the last chunk's) end */
                const int packed = by_amx_windows && task->chunk;
                const ds_window *last = &plan.windows[task->first + task->count - 1];
                if (packed)
                    wa_pack(&pa, tables + plan.members[last->row0] * width, last->h,
                            last->w * ATTEND_WINDOW, last->k1, amx_pack);
                const int64_t end = task->first + task->count;
                const int fold = task->fold && task->count > 1;
                for (int64_t i = task->first; i < end; i++) {
                    const ds_window *win = &plan.windows[i];
                    if (i + 1 < end && !packed) { /* the task's next window */
                        const ds_window *next = win + 1;
                        pw.next_table = tables + plan.members[next->row0] * width;
                        pw.next_h = next->h;
                        pw.next_t0 = next->w * ATTEND_WINDOW;
                        pw.next_t1 = next->k1;
                    } else if (i + 1 == end && i > task->first) {
                        pw.next_table = after.next_table;
                        pw.next_h = after.next_h;
                        pw.next_t0 = after.next_t0;
                        pw.next_t1 = after.next_t1;
                    }
                    const int64_t lead = plan.members[win->row0], ng = win->nrows * G;
                    const int64_t k0 = win->w * ATTEND_WINDOW, k1 = win->k1;
                    const float *qg = roped + lead * q_size + win->h * G * D;
                    const int64_t *limits = NULL; /* each query vector's end of keys */
                    if (win->nrows > 1) { /* the group's query vectors side by side */
                        for (int64_t j = 0; j < win->nrows; j++) {
                            const int64_t b = plan.members[win->row0 + j];
                            memcpy(window_q + j * G * D, roped + b * q_size + win->h * G * D,
                                   sizeof(float) * (size_t)(G * D));
                            for (int64_t g = 0; g < G; g++)
                                window_limits[j * G + g] = seq_lens[b];
                        }
                        qg = window_q;
                        limits = window_limits;
                    }
                    const int64_t *table = tables + lead * width; /* every member's, to k1 */
                    if (packed) {
                        for (int64_t v = 0; v < ng; v++)
                            window_counts[v] = (limits ? limits[v] : seq_lens[lead]) - k0;
                        wa_attend_packed(amx_pack, last->k1 - k0, k1 - k0, D, m->scale, qg, ng,
                                         window_counts, window_run, window_acc, amx_window);
                    } else {
                        for (int64_t v = 0; v < ng; v++)
                            window_run[v] = (PdRunning){-INFINITY, 0.0f};
                        memset(window_acc, 0, sizeof(float) * (size_t)(ng * D));
                        if (m->avx512 && D % 16 == 0)
                            pd_attend_avx512(&pw, qg, ng, limits, table, win->h, k0, k1,
                                             window_run, window_acc);
                        else
                            pd_attend_avx2(&pw, qg, ng, limits, table, win->h, k0, k1,
                                           window_run, window_acc);
                    }
                    if (fold) { /* into the task's running states, from the empty ones */
                        if (i == task->first)
                            for (int64_t v = 0; v < ng; v++) {
                                fold_run[v] = (PdRunning){-INFINITY, 0.0f};
                                memset(fold_acc + v * D, 0, sizeof(float) * (size_t)D);
                            }
                        for (int64_t j = 0; j < win->nrows; j++) {
                            if (seq_lens[plan.members[win->row0 + j]] <= k0) continue;
                            for (int64_t v = j * G; v < (j + 1) * G; v++)
                                pd_merge(&fold_run[v], fold_acc + v * D, window_run[v].m,
                                         window_run[v].l, window_acc + v * D, D);
                        }
                        if (i + 1 < end) continue;
                    }
                    const PdRunning *from_run = fold ? fold_run : window_run;
                    const float *from_acc = fold ? fold_acc : window_acc;
                    for (int64_t j = 0; j < win->nrows; j++)
                        for (int64_t g = 0; g < G; g++) {
                            const int64_t b = plan.members[win->row0 + j], v = j * G + g;
                            if (!fold && seq_lens[b] <= k0) continue; /* a row before w */
                            /* a fold's rows: their first slot */
                            float *st = state_of(&plan, states, b, win->h * G + g,
                                                 fold ? 0 : win->w, state_floats);
                            st[0] = from_run[v].m;
                            st[1] = from_run[v].l;
                            /* a loop, not memcpy: a 64-token prompt over 2,000 cached tokens
                             * stores ~300,000 of these states, a libc call each */
                            for (int64_t e = 0; e < D; e++) st[2 + e] = from_acc[v * D + e];
                        }
                }
            }
            team_barrier();
            /* each head's windows merged in key order: every row's, or in a pruned last layer
             * the logit rows' (attn then holds those rows, in order) */
            const int pruned = only_logit_rows && l == m->num_layers - 1;
            const int64_t Rl = pruned ? num_logit_rows : R; /* rows past the attention */
            OMP_FOR(HEADS_SCHEDULE)
            for (int64_t task = 0; task < Rl * H; task++) {
                const int64_t b = pruned ? logit_rows[task / H] : task / H;
                const float *st = state_of(&plan, states, b, task % H, 0, state_floats);
                PdRunning run = {-INFINITY, 0.0f};
                memset(window_acc, 0, sizeof(float) * (size_t)D);
                for (int64_t slot = 0; slot < plan.slots[b]; slot++, st += state_floats)
                    pd_merge(&run, window_acc, st[0], st[1], st + 2, D);
                const float inv = 1.0f / run.l;
                for (int64_t e = 0; e < D; e++) attn[task * D + e] = window_acc[e] * inv;
            }
            team_barrier();
            MARK(T_ATTENTION);
            if (pruned) /* this thread's residuals of the logit rows to the front (in place:
                         * logit_rows[i] >= i) */
                for (int64_t i = 0; i < Rl; i++)
                    if (logit_rows[i] != i)
                        memcpy(x + i * E, x + logit_rows[i] * E, sizeof(float) * (size_t)E);
            /* Rl rows from here on; in keeps the step's kinds of products (set by R), so each
             * row's numbers are what the whole step computes for it */
            prepare_input(&in, attn, Rl, q_size, xsum, xq, xd, xs);
            MARK(T_NORM);
            matrix_for(&L->o, &in, Rl, tmp);
            MARK(T_O);
            for (int64_t e = 0; e < Rl * E; e++) x[e] = x[e] + tmp[e];
            baton_rms_norm(x, Rl, E, L->post_norm, m->eps, xn);
            prepare_input(&in, xn, Rl, E, xsum, xq, xd, xs);
            MARK(T_NORM);
            swiglu_for(&L->gate_up, &in, Rl, I, act);
            MARK(T_GATE_UP);
            prepare_input(&in, act, Rl, I, xsum, xq, xd, xs);
            MARK(T_NORM);
            matrix_for(&L->down, &in, Rl, tmp);
            MARK(T_DOWN);
            for (int64_t e = 0; e < Rl * E; e++) x[e] = x[e] + tmp[e];
        }
        /* the rows the last layer ran for: all R, or the logit rows (at the front of x) */
        const int64_t Rf = only_logit_rows ? num_logit_rows : R;
        baton_rms_norm(x, Rf, E, m->final_norm, m->eps, xn);
#pragma omp master
        {
            if (!only_logit_rows) {
                memcpy(hidden, xn, sizeof(float) * (size_t)(R * E));
            } else {
                memset(hidden, 0, sizeof(float) * (size_t)(R * E));
                for (int64_t i = 0; i < Rf; i++)
                    memcpy(hidden + logit_rows[i] * E, xn + i * E, sizeof(float) * (size_t)E);
            }
        }
        if (m->head.blocks != NULL && logits != NULL && num_logit_rows > 0) {
            /* the logit rows to the front of xn (logit_rows[i] >= i: in place; there already
             * with only_logit_rows) */
            for (int64_t i = 0; i < num_logit_rows && !only_logit_rows; i++)
                if (logit_rows[i] != i)
                    memcpy(xn + i * E, xn + logit_rows[i] * E, sizeof(float) * (size_t)E);
            /* The head's arithmetic is set by its own row count: up to EXACT_MAX_ROWS logit
             * rows (a prompt's last row, a few decode rows beside it) take the exact kernels in
             * any step, whose weights are read once with no packing or rebuilding. */
            if (num_logit_rows <= EXACT_MAX_ROWS) in.by_amx = in.by_lanes = in.by_panels = 0;
            prepare_input(&in, xn, num_logit_rows, E, xsum, xq, xd, xs);
            MARK(T_NORM);
            matrix_for(&m->head, &in, num_logit_rows, logits);
            MARK(T_HEAD);
        } else {
            MARK(T_NORM);
        }
#undef MARK
        team_leave();
    }
    free(shared);
    free_plan(&plan);
    return 0;
}
